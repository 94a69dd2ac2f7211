//! The VRAM hot cache: per layer a fixed number of expert slots (gate, up, down in their stored
//! type: GGUF blocks as the file stores them, bf16 for float files, so a 4-bit expert costs
//! 4-bit VRAM and the planner's byte budget counts real bytes),
//! allocated once, and `hot_id_map` (expert -> slot) on the host ([`HotSet`], one lane) and on
//! the device (`[n_layers * n_experts]` i32, -1 = cold). Exchanges rewrite a slot and both maps;
//! capacity never changes.
//!
//! An exchange never makes a call wait. The evicted expert turns cold at once (host map and
//! device map, on the compute stream); the added one's bytes are copied beside the compute (from
//! the model's registered maps on Post-Fetch's exchange stream, else through pinned staging on
//! the side stream, after the compute stream is done with the slot), and it turns hot only at the
//! start of a call after its copy has landed ([`HotCache::admit_landed`]). Until then it runs on
//! the cold lane. So two sets: the logical one ([`HotCache::set`], what the planner and the
//! policies see, the admitted expert counted from its exchange on) and the resident one
//! ([`HotCache::resident`], what the lanes use and the device map mirrors); both maps of the
//! resident set change only between calls, so the host's worklist and the device's always agree.
//! A model whose experts carry biases (GPT-OSS) keeps each slot's biases beside its matrices
//! (f32 `[capacity, ff]` gate and up, `[capacity, hidden]` down), written and exchanged with
//! them; the kernels read them through the layer's [`SlotEpilogue`].

use super::weights::{stored_bytes, stored_dtype};
use super::GpuError;
use crate::cache::hot_set::{HotSet, HotSlot, LayerHotSet};
use crate::model::Model;
use moe_lanes_kernels::cuda::quant::TYPED_TAIL_BYTES;
use moe_lanes_kernels::cuda::{
    CopyStream, CudaBackend, DPtr, DeviceBuffer, GateUpEpilogue, Glu, GpuEvent, HostRegistration,
    PinnedBuffer, TypedWeights,
};
use moe_lanes_kernels::WeightDType;

/// Stored types and bytes of one expert's matrices in a layer (experts of a layer share them).
#[derive(Clone, Copy)]
pub(crate) struct SlotShape {
    pub dtypes: [WeightDType; 3],
    /// Bytes of one expert's gate, up, down.
    pub bytes: [usize; 3],
}

impl SlotShape {
    /// Layer `l`'s slot shape; none (0 bytes) for a layer without experts.
    pub fn of(model: &Model, l: usize) -> SlotShape {
        if !model.layer_spec(l).has_experts() {
            return SlotShape { dtypes: [WeightDType::BF16; 3], bytes: [0; 3] };
        }
        let (c, x) = (model.config(), model.expert(l, 0));
        let dtypes = [x.gate.dtype, x.up.dtype, x.down.dtype].map(stored_dtype);
        let bytes = [
            c.expert_ff * dtypes[0].row_bytes(c.hidden),
            c.expert_ff * dtypes[1].row_bytes(c.hidden),
            c.hidden * dtypes[2].row_bytes(c.expert_ff),
        ];
        SlotShape { dtypes, bytes }
    }

    fn total_bytes(&self) -> usize {
        self.bytes.iter().sum()
    }
}

/// One layer's slots: `[capacity, ff, hidden]` gate and up, `[capacity, hidden, ff]` down.
struct HotLayer {
    capacity: usize,
    shape: SlotShape,
    /// Gate, up, down (none while the capacity is 0).
    bufs: Option<[DeviceBuffer<u8>; 3]>,
    /// The slots' gate, up and down biases, f32 `[capacity, ff]` x2 and `[capacity, hidden]`
    /// (none: the model's experts have none, or the capacity is 0).
    bias: Option<[DeviceBuffer<f32>; 3]>,
}

/// What the hot lane's kernels apply around one layer's expert products: the gate/up
/// epilogue (the activation, the slots' gate and up biases) and the slots' down biases.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SlotEpilogue {
    pub gate_up: GateUpEpilogue,
    pub down_bias: Option<DPtr<f32>>,
}

impl SlotEpilogue {
    /// The activation alone: experts without biases.
    pub fn plain(glu: Glu) -> SlotEpilogue {
        SlotEpilogue { gate_up: GateUpEpilogue { glu, ..GateUpEpilogue::default() }, down_bias: None }
    }

    /// The activation and slot biases `[gate, up, down]` of a cache.
    fn biased(glu: Glu, [g, u, d]: [DPtr<f32>; 3]) -> SlotEpilogue {
        SlotEpilogue {
            gate_up: GateUpEpilogue { glu, gate_bias: Some(g), up_bias: Some(u) },
            down_bias: Some(d),
        }
    }
}

/// The hot lane's activation for `model`'s experts; the GELUs have no GPU kernels.
pub(crate) fn expert_glu(model: &Model) -> Result<Glu, GpuError> {
    let activation = model.plan().expert_activation();
    Glu::of(activation.kernel()).ok_or(GpuError::Activation { activation })
}

/// Device views of one layer's cached experts (every slot).
#[derive(Clone, Copy)]
pub(crate) struct SlotPtrs {
    pub n_slots: usize,
    pub gate: TypedWeights,
    pub up: TypedWeights,
    pub down: TypedWeights,
    /// The activation and the slots' biases.
    pub epi: SlotEpilogue,
}

impl SlotPtrs {
    /// Every matrix is bf16 (a float file): the tuned bf16 kernels and the grouped GEMM apply.
    pub fn all_bf16(&self) -> bool {
        [self.gate, self.up, self.down].iter().all(|m| m.dtype == WeightDType::BF16)
    }
}

pub(crate) struct HotCache {
    layers: Vec<HotLayer>,
    /// The experts' gated activation.
    glu: Glu,
    map_dev: DeviceBuffer<i32>,
    /// The logical hot set (module docs).
    set: HotSet,
    /// The resident hot set: `set` less the admissions whose copies have not landed. A slot
    /// being filled keeps its new expert in `slots` while the expert's `hot_id_map` entry stays
    /// `None`.
    resident: HotSet,
    /// Exchanged-in experts whose copies are queued, not yet seen landed.
    admitting: Vec<Admission>,
    /// Events of landed admissions, reused.
    spare_events: Vec<GpuEvent>,
    /// Recorded on the compute stream at each exchange: the slot's copy waits for it.
    slot_free: GpuEvent,
    allocated: bool,
    n_experts: usize,
    /// Pinned staging for exchanges (gate, up, down of one expert each), used in turn so one
    /// fills while the other copies; allocated at the first staged exchange.
    staging: Vec<PinnedBuffer<u8>>,
    next_staging: usize,
    /// Per layer: it routes to experts (a dense FFN layer does not).
    has_experts: Vec<bool>,
}

/// An expert exchanged into `slot` of `layer` whose copy may still be in flight.
struct Admission {
    layer: usize,
    slot: usize,
    expert: usize,
    /// Recorded on the copy's stream after its copies.
    landed: GpuEvent,
}

/// Where an exchange's copies can read the experts' bytes without staging: the model's maps
/// registered with the device, and the copy stream they were registered for.
#[derive(Clone, Copy)]
pub(crate) struct RegisteredSource<'a> {
    pub stream: &'a CopyStream,
    pub maps: &'a [HostRegistration],
}

/// Staging buffers for exchanges (each holds one expert's three matrices).
const EXCHANGE_STAGING_BUFFERS: usize = 2;

impl HotCache {
    /// No slots yet: every expert is cold until [`HotCache::allocate`].
    pub fn empty(be: &CudaBackend, model: &Model) -> Result<Self, GpuError> {
        let (n_layers, n_experts) = (model.config().n_layers, model.config().n_experts);
        Ok(HotCache {
            layers: (0..n_layers)
                .map(|l| HotLayer { capacity: 0, shape: SlotShape::of(model, l), bufs: None, bias: None })
                .collect(),
            glu: expert_glu(model)?,
            map_dev: be.upload(&vec![-1i32; n_layers * n_experts])?,
            set: HotSet::empty(n_layers, n_experts, 1),
            resident: HotSet::empty(n_layers, n_experts, 1),
            admitting: Vec::new(),
            spare_events: Vec::new(),
            slot_free: be.event()?,
            allocated: false,
            n_experts,
            staging: Vec::new(),
            next_staging: 0,
            has_experts: model.plan().expert_layers(),
        })
    }

    /// Allocate each layer's capacity (= its hot count in `set`) once and copy the experts in.
    pub fn allocate(&mut self, be: &CudaBackend, model: &Model, set: &HotSet) -> Result<(), GpuError> {
        if self.allocated {
            return Err(GpuError::HotCacheAllocated);
        }
        check_shape(set, self.layers.len(), self.n_experts)?;
        let (ff, hidden) = (model.config().expert_ff, model.config().hidden);
        for (l, (hl, ls)) in self.layers.iter_mut().zip(&set.layers).enumerate() {
            hl.capacity = ls.n_hot();
            let alloc = |i: usize| be.alloc_zeros::<u8>(hl.capacity * hl.shape.bytes[i] + TYPED_TAIL_BYTES);
            hl.bufs = if hl.capacity == 0 { None } else { Some([alloc(0)?, alloc(1)?, alloc(2)?]) };
            let biased = hl.capacity > 0 && model.expert_bias(l, 0).is_some();
            let alloc_f = |n: usize| be.alloc_zeros::<f32>(hl.capacity * n);
            hl.bias = if biased { Some([alloc_f(ff)?, alloc_f(ff)?, alloc_f(hidden)?]) } else { None };
        }
        self.allocated = true;
        for (l, ls) in set.layers.iter().enumerate() {
            for (slot, &e) in ls.slots[0].iter().enumerate() {
                self.write_slot(be, model, l, slot, e as usize)?;
                self.write_map(be, l, e as usize, slot as i32)?;
            }
        }
        self.set = set.clone();
        self.resident = set.clone();
        be.synchronize()?;
        Ok(())
    }

    /// Expert `add` takes the slot of hot expert `evict` in `layer_idx` (module docs): checked
    /// before anything changes; `evict` turns cold now, `add`'s copy is queued (from `src` when
    /// given, else staged), and `add` turns hot at a call's start after the copy has landed.
    pub fn exchange(
        &mut self,
        be: &CudaBackend,
        model: &Model,
        src: Option<RegisteredSource<'_>>,
        (layer_idx, evict, add): (usize, usize, usize),
    ) -> Result<(), GpuError> {
        let mut next = self.set.clone();
        let slot = next.apply_exchange(layer_idx, evict, add)?.slot_idx as usize;
        self.vacate(be, layer_idx, evict, slot)?;
        self.resident.layers[layer_idx].slots[0][slot] = add as u32;
        be.record(&self.slot_free)?;
        let landed = match self.spare_events.pop() {
            Some(ev) => ev,
            None => be.event()?,
        };
        match src {
            Some(src) => self.copy_registered(be, model, src, (layer_idx, add, slot), &landed)?,
            None => self.copy_staged(be, model, (layer_idx, add, slot), &landed)?,
        }
        self.admitting.push(Admission { layer: layer_idx, slot, expert: add, landed });
        self.set = next;
        Ok(())
    }

    /// `evict` leaves the resident set (both maps) and any admission into `slot` is dropped:
    /// its copy, queued earlier on the same stream, is overwritten by the next one.
    fn vacate(&mut self, be: &CudaBackend, l: usize, evict: usize, slot: usize) -> Result<(), GpuError> {
        if self.resident.layers[l].hot_id_map[evict].take().is_some() {
            self.write_map(be, l, evict, -1)?;
        }
        while let Some(i) = self.admitting.iter().position(|a| a.layer == l && a.slot == slot) {
            let dropped = self.admitting.swap_remove(i);
            self.spare_events.push(dropped.landed);
        }
        Ok(())
    }

    /// Queue `add`'s bytes from the registered maps into `slot` on the source's stream, after
    /// the compute stream is done with the slot; `landed` recorded after them.
    fn copy_registered(
        &self,
        be: &CudaBackend,
        model: &Model,
        src: RegisteredSource<'_>,
        (l, add, slot): (usize, usize, usize),
        landed: &GpuEvent,
    ) -> Result<(), GpuError> {
        let x = model.expert(l, add);
        let hl = &self.layers[l];
        let bufs = hl.bufs.as_ref().expect("a hot expert implies an allocated layer");
        be.wait_event_on(src.stream, &self.slot_free)?;
        for ((dst, t), n) in bufs.iter().zip([x.gate, x.up, x.down]).zip(hl.shape.bytes) {
            let found = src.maps.iter().find_map(|r| r.range_of(t.data).map(|at| (r, at)));
            let (reg, at) = found.ok_or(GpuError::ExchangeSource { layer_idx: l, expert_idx: add })?;
            assert_eq!(at.len(), n, "layer {l}: an expert's stored bytes are its slot's");
            be.write_registered_on(src.stream, reg, at, dst.ptr().sub(slot * n, n))?;
        }
        be.record_on(src.stream, landed)?;
        Ok(())
    }

    /// Stage `add`'s bytes (and biases) into pinned memory and queue them into `slot` on the
    /// side stream, after the compute stream is done with the slot; `landed` recorded after.
    fn copy_staged(
        &mut self,
        be: &CudaBackend,
        model: &Model,
        (l, add, slot): (usize, usize, usize),
        landed: &GpuEvent,
    ) -> Result<(), GpuError> {
        if self.staging.is_empty() {
            let most = self.layers.iter().map(|hl| hl.shape.total_bytes()).max().unwrap_or(0);
            for _ in 0..EXCHANGE_STAGING_BUFFERS {
                self.staging.push(be.alloc_pinned::<u8>(most)?);
            }
        }
        let buf = &mut self.staging[self.next_staging];
        self.next_staging = (self.next_staging + 1) % EXCHANGE_STAGING_BUFFERS;
        let x = model.expert(l, add);
        let hl = &self.layers[l];
        let host = buf.as_mut_slice()?;
        let mut at = 0;
        for (t, n) in [x.gate, x.up, x.down].into_iter().zip(hl.shape.bytes) {
            host[at..at + n].copy_from_slice(&stored_bytes(t)?);
            at += n;
        }
        let bufs = hl.bufs.as_ref().expect("a hot expert implies an allocated layer");
        be.wait_event_side(&self.slot_free)?;
        let mut at = 0;
        for (dst, n) in bufs.iter().zip(hl.shape.bytes) {
            be.write_async_side(buf, at..at + n, dst.ptr().sub(slot * n, n))?;
            at += n;
        }
        if let (Some(bias), Some(b)) = (&hl.bias, model.expert_bias(l, add)) {
            for (dst, src) in bias.iter().zip([b.gate, b.up, b.down]) {
                be.write_side(src, dst.ptr().sub(slot * src.len(), src.len()))?;
            }
        }
        be.record_side(landed)?;
        Ok(())
    }

    /// At a call's start: the admissions whose copies have landed join the resident set and
    /// the device map (written on the compute stream, before the call's kernels). How many.
    pub fn admit_landed(&mut self, be: &CudaBackend) -> Result<usize, GpuError> {
        let mut admitted = 0;
        let mut i = 0;
        while i < self.admitting.len() {
            if !self.admitting[i].landed.is_done() {
                i += 1;
                continue;
            }
            let a = self.admitting.swap_remove(i);
            let hot = HotSlot { lane_idx: 0, slot_idx: a.slot as u32 };
            self.resident.layers[a.layer].hot_id_map[a.expert] = Some(hot);
            self.write_map(be, a.layer, a.expert, a.slot as i32)?;
            self.spare_events.push(a.landed);
            admitted += 1;
        }
        Ok(admitted)
    }

    fn write_slot(
        &self,
        be: &CudaBackend,
        model: &Model,
        l: usize,
        slot: usize,
        e: usize,
    ) -> Result<(), GpuError> {
        let x = model.expert(l, e);
        let hl = &self.layers[l];
        assert!(slot < hl.capacity, "slot {slot} of layer {l} beyond capacity {}", hl.capacity);
        let bufs = hl.bufs.as_ref().expect("capacity > 0, so the layer is allocated");
        for ((buf, t), n) in bufs.iter().zip([x.gate, x.up, x.down]).zip(hl.shape.bytes) {
            be.write(&stored_bytes(t)?, buf.ptr().sub(slot * n, n))?;
        }
        if let (Some(bias), Some(b)) = (&hl.bias, model.expert_bias(l, e)) {
            for (dst, src) in bias.iter().zip([b.gate, b.up, b.down]) {
                be.write(src, dst.ptr().sub(slot * src.len(), src.len()))?;
            }
        }
        Ok(())
    }

    fn write_map(&self, be: &CudaBackend, l: usize, e: usize, slot: i32) -> Result<(), GpuError> {
        be.write(&[slot], self.map_dev.ptr().sub(l * self.n_experts + e, 1))?;
        Ok(())
    }

    /// The logical hot set (module docs).
    pub fn set(&self) -> &HotSet {
        &self.set
    }

    /// The resident hot set: what the lanes use now (module docs).
    pub fn resident(&self) -> &HotSet {
        &self.resident
    }

    /// Layer `l`'s resident map.
    pub fn layer(&self, l: usize) -> &LayerHotSet {
        &self.resident.layers[l]
    }

    pub fn n_hot(&self, l: usize) -> usize {
        self.set.layers[l].n_hot()
    }

    /// Every expert of layer `l` is cached, or the layer has none (a dense FFN layer needs no
    /// cold lane either).
    pub fn all_hot(&self, l: usize) -> bool {
        self.n_hot(l) == self.n_experts || !self.has_experts[l]
    }

    pub fn map_dev(&self, l: usize) -> DPtr<i32> {
        self.map_dev.ptr().sub(l * self.n_experts, self.n_experts)
    }

    pub fn slots(&self, l: usize) -> Option<SlotPtrs> {
        let hl = &self.layers[l];
        let [g, u, d] = hl.bufs.as_ref()?;
        let view =
            |b: &DeviceBuffer<u8>, i: usize| TypedWeights { bytes: b.ptr(), dtype: hl.shape.dtypes[i] };
        let epi = match &hl.bias {
            Some(b) => SlotEpilogue::biased(self.glu, [0, 1, 2].map(|i| b[i].ptr())),
            None => SlotEpilogue::plain(self.glu),
        };
        Some(SlotPtrs { n_slots: hl.capacity, gate: view(g, 0), up: view(u, 1), down: view(d, 2), epi })
    }

    /// Whether any layer stores its experts quantized.
    pub fn any_quantized(&self) -> bool {
        self.layers.iter().any(|hl| hl.shape.dtypes.iter().any(|d| d.is_quantized()))
    }

    /// VRAM of every slot: matrices and biases.
    pub fn bytes(&self) -> usize {
        let weights: usize =
            self.layers.iter().flat_map(|h| h.bufs.iter().flatten()).map(DeviceBuffer::bytes).sum();
        weights
            + self.layers.iter().flat_map(|h| h.bias.iter().flatten()).map(DeviceBuffer::bytes).sum::<usize>()
    }
}

fn check_shape(set: &HotSet, n_layers: usize, n_experts: usize) -> Result<(), GpuError> {
    if set.layers.len() != n_layers {
        return Err(GpuError::HotLayers { given: set.layers.len(), expected: n_layers });
    }
    if set.n_experts != n_experts {
        return Err(GpuError::HotExperts { n_experts: set.n_experts, expected: n_experts });
    }
    if set.n_lanes != 1 {
        return Err(GpuError::HotLanes { lanes: set.n_lanes });
    }
    Ok(())
}
