//! The VRAM hot cache: per layer a fixed number of expert slots (gate, up, down as bf16),
//! allocated once, and `hot_id_map` (expert -> slot) on the host ([`HotSet`], one lane) and on
//! the device (`[n_layers * n_experts]` i32, -1 = cold). Exchanges rewrite a slot and both maps;
//! capacity never changes. Exchanges copy on the backend's side stream (through pinned staging),
//! so a call's compute runs beside them and waits only where a layer uses an exchanged slot.

use super::weights::bf16_bits;
use super::GpuError;
use crate::cache::hot_set::{HotSet, LayerHotSet};
use crate::model::Model;
use moe_lanes_kernels::cuda::{CudaBackend, DPtr, DeviceBuffer, GpuEvent, PinnedBuffer};

/// One layer's slots: `[capacity, ff, hidden]` gate and up, `[capacity, hidden, ff]` down.
struct HotLayer {
    capacity: usize,
    gate: Option<DeviceBuffer<u16>>,
    up: Option<DeviceBuffer<u16>>,
    down: Option<DeviceBuffer<u16>>,
}

/// Device pointers of one layer's cached experts.
#[derive(Clone, Copy)]
pub(crate) struct SlotPtrs {
    pub gate: DPtr<u16>,
    pub up: DPtr<u16>,
    pub down: DPtr<u16>,
}

pub(crate) struct HotCache {
    layers: Vec<HotLayer>,
    map_dev: DeviceBuffer<i32>,
    set: HotSet,
    allocated: bool,
    n_experts: usize,
    /// Elements of one expert matrix (`ff * hidden`).
    expert_elems: usize,
    /// Pinned staging for exchanges (gate, up, down of one expert each), used in turn so one
    /// fills while the other copies; allocated at the first exchange.
    staging: Vec<PinnedBuffer<u16>>,
    next_staging: usize,
    /// Per layer: recorded on the side stream after the layer's last exchange.
    exchanged: Vec<GpuEvent>,
    /// Per layer: an exchange is queued that the compute stream has not waited for yet.
    pending: Vec<bool>,
}

/// Staging buffers for exchanges (each holds one expert's three matrices).
const EXCHANGE_STAGING_BUFFERS: usize = 2;

impl HotCache {
    /// No slots yet: every expert is cold until [`HotCache::allocate`].
    pub fn empty(
        be: &CudaBackend,
        n_layers: usize,
        n_experts: usize,
        expert_elems: usize,
    ) -> Result<Self, GpuError> {
        Ok(HotCache {
            layers: (0..n_layers)
                .map(|_| HotLayer { capacity: 0, gate: None, up: None, down: None })
                .collect(),
            map_dev: be.upload(&vec![-1i32; n_layers * n_experts])?,
            set: HotSet::empty(n_layers, n_experts, 1),
            allocated: false,
            n_experts,
            expert_elems,
            staging: Vec::new(),
            next_staging: 0,
            exchanged: (0..n_layers).map(|_| be.event()).collect::<Result<_, _>>()?,
            pending: vec![false; n_layers],
        })
    }

    /// Allocate each layer's capacity (= its hot count in `set`) once and copy the experts in.
    pub fn allocate(&mut self, be: &CudaBackend, model: &Model, set: &HotSet) -> Result<(), GpuError> {
        if self.allocated {
            return Err(GpuError::HotCacheAllocated);
        }
        check_shape(set, self.layers.len(), self.n_experts)?;
        for (hl, ls) in self.layers.iter_mut().zip(&set.layers) {
            let cap = ls.n_hot();
            let alloc = || -> Result<Option<DeviceBuffer<u16>>, GpuError> {
                Ok(if cap == 0 { None } else { Some(be.alloc_zeros::<u16>(cap * self.expert_elems)?) })
            };
            *hl = HotLayer { capacity: cap, gate: alloc()?, up: alloc()?, down: alloc()? };
        }
        self.allocated = true;
        for (l, ls) in set.layers.iter().enumerate() {
            for (slot, &e) in ls.slots[0].iter().enumerate() {
                self.write_slot(be, model, l, slot, e as usize)?;
                self.write_map(be, l, e as usize, slot as i32)?;
            }
        }
        self.set = set.clone();
        be.synchronize()?;
        Ok(())
    }

    /// Expert `add` takes the slot of hot expert `evict` in `layer_idx`. Checked before anything
    /// changes; the host map changes now, the slot contents and the device map on the side stream
    /// (the compute stream waits for them before it next runs this layer's MoE block).
    pub fn exchange(
        &mut self,
        be: &CudaBackend,
        model: &Model,
        layer_idx: usize,
        evict: usize,
        add: usize,
    ) -> Result<(), GpuError> {
        let mut next = self.set.clone();
        let slot = next.apply_exchange(layer_idx, evict, add)?.slot_idx as usize;
        let n = self.expert_elems;
        if self.staging.is_empty() {
            for _ in 0..EXCHANGE_STAGING_BUFFERS {
                self.staging.push(be.alloc_pinned::<u16>(3 * n)?);
            }
        }
        let buf = &mut self.staging[self.next_staging];
        self.next_staging = (self.next_staging + 1) % EXCHANGE_STAGING_BUFFERS;
        let x = model.expert(layer_idx, add);
        let host = buf.as_mut_slice()?;
        for (i, t) in [x.gate, x.up, x.down].into_iter().enumerate() {
            host[i * n..(i + 1) * n].copy_from_slice(&bf16_bits(t)?);
        }
        let hl = &self.layers[layer_idx];
        for (i, dst) in [&hl.gate, &hl.up, &hl.down].into_iter().enumerate() {
            let dst = dst.as_ref().expect("a hot expert implies an allocated layer");
            be.write_async_side(buf, i * n..(i + 1) * n, dst.ptr().sub(slot * n, n))?;
        }
        let map = self.map_dev.ptr();
        be.write_side(&[-1i32], map.sub(layer_idx * self.n_experts + evict, 1))?;
        be.write_side(&[slot as i32], map.sub(layer_idx * self.n_experts + add, 1))?;
        be.record_side(&self.exchanged[layer_idx])?;
        self.pending[layer_idx] = true;
        self.set = next;
        Ok(())
    }

    /// Before layer `l` uses the cache: make the compute stream wait (on the GPU) for the
    /// layer's queued exchanges.
    pub fn order_after_exchanges(&mut self, be: &CudaBackend, l: usize) -> Result<(), GpuError> {
        if std::mem::take(&mut self.pending[l]) {
            be.wait_event(&self.exchanged[l])?;
        }
        Ok(())
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
        let n = self.expert_elems;
        for (buf, t) in [(&hl.gate, x.gate), (&hl.up, x.up), (&hl.down, x.down)] {
            let buf = buf.as_ref().expect("capacity > 0, so the layer is allocated");
            be.write(&bf16_bits(t)?, buf.ptr().sub(slot * n, n))?;
        }
        Ok(())
    }

    fn write_map(&self, be: &CudaBackend, l: usize, e: usize, slot: i32) -> Result<(), GpuError> {
        be.write(&[slot], self.map_dev.ptr().sub(l * self.n_experts + e, 1))?;
        Ok(())
    }

    pub fn set(&self) -> &HotSet {
        &self.set
    }

    pub fn layer(&self, l: usize) -> &LayerHotSet {
        &self.set.layers[l]
    }

    pub fn n_hot(&self, l: usize) -> usize {
        self.set.layers[l].n_hot()
    }

    pub fn all_hot(&self, l: usize) -> bool {
        self.n_hot(l) == self.n_experts
    }

    pub fn map_dev(&self, l: usize) -> DPtr<i32> {
        self.map_dev.ptr().sub(l * self.n_experts, self.n_experts)
    }

    pub fn slots(&self, l: usize) -> Option<SlotPtrs> {
        let hl = &self.layers[l];
        Some(SlotPtrs {
            gate: hl.gate.as_ref()?.ptr(),
            up: hl.up.as_ref()?.ptr(),
            down: hl.down.as_ref()?.ptr(),
        })
    }

    pub fn bytes(&self) -> usize {
        self.layers.iter().flat_map(|h| [&h.gate, &h.up, &h.down]).flatten().map(DeviceBuffer::bytes).sum()
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
