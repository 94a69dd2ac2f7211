//! The GPU KV cache: per layer, K and V as `[capacity, kv_dim]` in the cache's [`KvType`] (f16
//! by default; f32, bf16 and q8_0 selectable, q8_0 as llama.cpp's blocks of 32 values, each
//! `[capacity, kv_dim]` row whole blocks), allocated once; `kv_dim` is each layer's own (KV
//! heads x head dim: Gemma 4's global layers differ from its sliding ones). Keys and values are
//! written converted (after RoPE) and every attention kernel reads each type. A latent attention
//! layer keeps one row of `kv_lora_rank + rope` values per position (the normed latent and the
//! rotated key part, `LatentAttentionSpec::cache_width`) in its K buffer, in the same type, and no
//! V. A sliding-window layer keeps a mirrored ring of at most `2 * kv_ring_positions(window)`
//! rows (`moe_lanes_kernels::kv::kv_ring_positions`), so a long context costs full KV only in the
//! global layers.

use moe_lanes_kernels::cuda::ops::KvPtr;
use moe_lanes_kernels::cuda::{CudaBackend, DPtr, DeviceBuffer};

use super::GpuError;
use crate::model::arch::{LayerPlan, Mixer};
use crate::model::context::KvType;
use moe_lanes_kernels::kv::{kv_ring_positions, kv_ring_rows, KV_RING_CHUNK_POSITIONS};

/// One layer's keys or values per layer, in the cache's type.
pub(crate) enum KvBufs {
    F32(Vec<DeviceBuffer<f32>>),
    F16(Vec<DeviceBuffer<u16>>),
    Bf16(Vec<DeviceBuffer<u16>>),
    /// q8_0 blocks (34 bytes per 32 values).
    Q8_0(Vec<DeviceBuffer<u8>>),
}

impl KvBufs {
    /// One buffer per layer of `elems[l]` values, on layer `l`'s device (`bes[l]`).
    fn new(bes: &[&CudaBackend], kv: KvType, elems: &[usize]) -> Result<KvBufs, GpuError> {
        let per_layer = || bes.iter().zip(elems);
        let u16s = || per_layer().map(|(be, &n)| be.alloc_zeros::<u16>(n)).collect::<Result<Vec<_>, _>>();
        Ok(match kv {
            KvType::F32 => {
                KvBufs::F32(per_layer().map(|(be, &n)| be.alloc_zeros::<f32>(n)).collect::<Result<_, _>>()?)
            }
            KvType::F16 => KvBufs::F16(u16s()?),
            KvType::Bf16 => KvBufs::Bf16(u16s()?),
            KvType::Q8_0 => KvBufs::Q8_0(
                per_layer()
                    .map(|(be, &n)| be.alloc_zeros::<u8>(kv.bytes_of(n as u64) as usize))
                    .collect::<Result<_, _>>()?,
            ),
        })
    }
    fn layer(&self, l: usize) -> KvPtr {
        match self {
            KvBufs::F32(b) => KvPtr::F32(b[l].ptr()),
            KvBufs::F16(b) => KvPtr::F16(b[l].ptr()),
            KvBufs::Bf16(b) => KvPtr::Bf16(b[l].ptr()),
            KvBufs::Q8_0(b) => KvPtr::Q8_0(b[l].ptr()),
        }
    }
    fn bytes(&self) -> usize {
        match self {
            KvBufs::F32(b) => b.iter().map(DeviceBuffer::bytes).sum(),
            KvBufs::F16(b) | KvBufs::Bf16(b) => b.iter().map(DeviceBuffer::bytes).sum(),
            KvBufs::Q8_0(b) => b.iter().map(DeviceBuffer::bytes).sum(),
        }
    }
    /// Queue a copy of layer `l`'s first `n` values into `dst`'s layer `l` (a cache of the same
    /// type; whole q8_0 blocks: every row is).
    fn copy_prefix(&self, dst: &KvBufs, be: &CudaBackend, l: usize, n: usize) -> Result<(), GpuError> {
        fn go<T>(
            be: &CudaBackend,
            s: &DeviceBuffer<T>,
            d: &DeviceBuffer<T>,
            n: usize,
        ) -> Result<(), GpuError> {
            Ok(be.copy(s.ptr().sub(0, n), d.ptr().sub(0, n))?)
        }
        match (self, dst) {
            (KvBufs::F32(s), KvBufs::F32(d)) => go(be, &s[l], &d[l], n),
            (KvBufs::F16(s), KvBufs::F16(d)) | (KvBufs::Bf16(s), KvBufs::Bf16(d)) => go(be, &s[l], &d[l], n),
            (KvBufs::Q8_0(s), KvBufs::Q8_0(d)) => {
                go(be, &s[l], &d[l], KvType::Q8_0.bytes_of(n as u64) as usize)
            }
            _ => unreachable!("a cache grows into one of its own type"),
        }
    }
    fn n_layers(&self) -> usize {
        match self {
            KvBufs::F32(b) => b.len(),
            KvBufs::F16(b) | KvBufs::Bf16(b) => b.len(),
            KvBufs::Q8_0(b) => b.len(),
        }
    }
    fn serial(&self) -> u64 {
        match self {
            KvBufs::F32(b) => b[0].serial(),
            KvBufs::F16(b) | KvBufs::Bf16(b) => b[0].serial(),
            KvBufs::Q8_0(b) => b[0].serial(),
        }
    }
}

/// A Gated DeltaNet layer's state on the device: the conv's last inputs and the matrix state
/// (f32, fixed size whatever the context).
pub(crate) struct DeltaStateBufs {
    conv: DeviceBuffer<f32>,
    matrix: DeviceBuffer<f32>,
}

/// A session's recurrent (DeltaNet) state copied off the device (`GpuModel::read_recurrent`):
/// per layer of the model, a DeltaNet layer's conv inputs and matrix state (`None` for the
/// other layers).
#[derive(Debug, Clone, Default)]
pub struct RecurrentState {
    pub layers: Vec<Option<(Vec<f32>, Vec<f32>)>>,
}

/// A DeltaNet layer's state pointers, for the kernels.
pub(crate) struct DeltaStatePtrs {
    pub conv: DPtr<f32>,
    pub matrix: DPtr<f32>,
}

/// A session on the device: K and V for the attention layers (a DeltaNet layer's entries hold one
/// value), the recurrent state of the DeltaNet layers. Each layer's buffers live on the device
/// that runs the layer (the model split over several GPUs, `crate::gpu::split`).
pub struct GpuKvCache {
    k: KvBufs,
    v: KvBufs,
    delta: Vec<Option<DeltaStateBufs>>,
    kv_type: KvType,
    pub(crate) capacity: usize,
    pub(crate) kv_dim: usize,
    pub(crate) n_positions: usize,
    /// Whether a sliding-window layer keeps a ring (of `kv_ring_positions`) that wraps below
    /// `capacity`: positions more than a call's chunk back are overwritten then.
    rings: bool,
}

/// Whether a layer keeping a ring of `ring` positions (0: a full layer) holds it as the mirrored
/// ring of `2 * ring` rows in a cache of `capacity` positions (`kv_ring_rows`), else linear rows.
fn ring_rows(ring: usize, capacity: usize) -> bool {
    ring > 0 && capacity >= 2 * ring
}

/// A block type (q8_0) needs every attention head to be whole blocks: refused by name otherwise
/// (at engine build, before anything is uploaded, and again for each cache).
pub(crate) fn check_kv_blocks(plan: &LayerPlan, kv_type: KvType) -> Result<(), GpuError> {
    let block = kv_type.block_len();
    let mut head_dims = plan.layers().iter().filter_map(|l| l.as_attention().map(|a| a.head_dim));
    if let Some(head_dim) = head_dims.find(|d| !d.is_multiple_of(block)) {
        return Err(GpuError::KvBlocks { kv_type, block, head_dim });
    }
    let latent = plan.layers().iter().find_map(|l| match &l.mixer {
        Mixer::LatentAttention(m) => Some(m.cache_width()),
        _ => None,
    });
    match latent.filter(|w| !w.is_multiple_of(block)) {
        Some(width) => Err(GpuError::LatentKvBlocks { kv_type, block, width }),
        None => Ok(()),
    }
}

impl GpuKvCache {
    /// The cache of `plan`'s layers, layer `l`'s buffers on `bes[l]` (one per layer).
    pub(crate) fn new(
        bes: &[&CudaBackend],
        plan: &LayerPlan,
        kv_dim: usize,
        capacity: usize,
        kv_type: KvType,
    ) -> Result<Self, GpuError> {
        check_kv_blocks(plan, kv_type)?;
        let block = kv_type.block_len();
        // Per layer: K's and V's values (an attention layer's own `kv_dim`; a latent layer's rows
        // in K; a DeltaNet layer's one block).
        let (k_elems, v_elems): (Vec<usize>, Vec<usize>) = plan
            .layers()
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Attention(a) => {
                    let rows = kv_ring_rows(a.window.unwrap_or(0), capacity);
                    (rows * a.kv_dim(), rows * a.kv_dim())
                }
                Mixer::LatentAttention(m) => (capacity * m.cache_width(), block),
                Mixer::GatedDeltaNet(_) => (block, block),
            })
            .unzip();
        assert_eq!(bes.len(), k_elems.len(), "one device per layer");
        let k = KvBufs::new(bes, kv_type, &k_elems)?;
        let v = KvBufs::new(bes, kv_type, &v_elems)?;
        let delta = plan
            .layers()
            .iter()
            .zip(bes)
            .map(|(l, be)| match &l.mixer {
                Mixer::GatedDeltaNet(d) => Ok(Some(DeltaStateBufs {
                    conv: be.alloc_zeros::<f32>(d.conv_state_len())?,
                    matrix: be.alloc_zeros::<f32>(d.matrix_state_len())?,
                })),
                Mixer::Attention(_) | Mixer::LatentAttention(_) => Ok(None),
            })
            .collect::<Result<_, GpuError>>()?;
        let rings = plan.layers().iter().any(|l| {
            l.as_attention().and_then(|a| a.window).is_some_and(|w| kv_ring_positions(w) < capacity)
        });
        Ok(GpuKvCache { k, v, delta, kv_type, capacity, kv_dim, n_positions: 0, rings })
    }

    /// Layer `l`'s recurrent state (conv, matrix), `None` for a layer without one.
    pub(crate) fn delta_state_of(&self, l: usize) -> Option<DeltaStatePtrs> {
        self.delta.get(l)?.as_ref().map(|d| DeltaStatePtrs { conv: d.conv.ptr(), matrix: d.matrix.ptr() })
    }

    /// DeltaNet layer `l`'s state.
    pub(crate) fn delta_state(&self, l: usize) -> DeltaStatePtrs {
        let d = self.delta[l].as_ref().expect("a DeltaNet layer of the plan the cache was made for");
        DeltaStatePtrs { conv: d.conv.ptr(), matrix: d.matrix.ptr() }
    }

    /// Zero the recurrent state of `layers` (a session starting at position 0), the layers
    /// `be`'s device runs; queued on its stream.
    pub(crate) fn reset_recurrent(
        &self,
        be: &CudaBackend,
        layers: std::ops::Range<usize>,
    ) -> Result<(), GpuError> {
        for d in self.delta[layers].iter().flatten() {
            be.zero(d.conv.ptr())?;
            be.zero(d.matrix.ptr())?;
        }
        Ok(())
    }
    /// Layer `l`'s keys, `[capacity, kv_dim]` (the layer's own `kv_dim`; a latent layer's rows,
    /// `[capacity, cache_width]`).
    pub(crate) fn k(&self, l: usize) -> KvPtr {
        self.k.layer(l)
    }
    /// Layer `l`'s values, `[capacity, kv_dim]` (the layer's own `kv_dim`).
    pub(crate) fn v(&self, l: usize) -> KvPtr {
        self.v.layer(l)
    }
    /// The allocation serial a captured decode graph keys on.
    pub(crate) fn serial(&self) -> u64 {
        self.k.serial()
    }
    pub fn n_layers(&self) -> usize {
        self.k.n_layers()
    }
    pub fn kv_type(&self) -> KvType {
        self.kv_type
    }
    pub fn n_positions(&self) -> usize {
        self.n_positions
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Forget every position (the memory stays allocated).
    pub fn clear(&mut self) {
        self.n_positions = 0;
    }

    /// Whether it holds recurrent (DeltaNet) state, which a truncation cannot take back.
    pub fn has_recurrent(&self) -> bool {
        self.delta.iter().any(Option::is_some)
    }

    /// Keep the first `n` positions (later ones are overwritten as new tokens come); false,
    /// changing nothing, where a recurrent layer's state cannot go back, a sliding-window ring
    /// has overwritten keys position `n` still sees (more than [`KV_RING_CHUNK_POSITIONS`]
    /// back), or `n` is more.
    pub fn truncate(&mut self, n: usize) -> bool {
        if self.has_recurrent() && n != self.n_positions {
            return false;
        }
        self.cut(n)
    }

    /// Whether the attention layers can keep the first `n` positions: `n` at most what it holds,
    /// and no ring has overwritten keys position `n` still sees.
    pub(crate) fn can_cut(&self, n: usize) -> bool {
        n <= self.n_positions && !(self.rings && n + KV_RING_CHUNK_POSITIONS < self.n_positions)
    }

    /// [`Self::truncate`] with the recurrent state already put back to position `n` (a
    /// checkpoint's, by the caller); false, changing nothing, where [`Self::can_cut`] is not.
    pub(crate) fn cut(&mut self, n: usize) -> bool {
        if !self.can_cut(n) {
            return false;
        }
        self.n_positions = n;
        true
    }
    /// Whether a cache of `capacity` positions keeps this one's row layout in every layer, so
    /// [`Self::copy_layer_into`] can move it there: not where a sliding-window layer's rows
    /// would turn from linear into the mirrored ring (`kv_ring_rows`).
    pub(crate) fn can_grow_to(&self, plan: &LayerPlan, capacity: usize) -> bool {
        let ring = |l: &crate::model::arch::LayerSpec| {
            l.as_attention().map_or(0, |a| kv_ring_positions(a.window.unwrap_or(0)))
        };
        plan.layers().iter().map(ring).all(|r| ring_rows(r, self.capacity) == ring_rows(r, capacity))
    }

    /// Queue copies of layer `l`'s positions (and recurrent state) into `new`, a larger cache of
    /// the same plan and type on the same devices (`be` runs layer `l`) with the same row
    /// layout ([`Self::can_grow_to`]).
    pub(crate) fn copy_layer_into(
        &self,
        new: &GpuKvCache,
        be: &CudaBackend,
        layer: &Mixer,
        l: usize,
    ) -> Result<(), GpuError> {
        let n = self.n_positions;
        match layer {
            Mixer::Attention(a) => {
                let (d, ring) = (a.kv_dim(), kv_ring_positions(a.window.unwrap_or(0)));
                // a ring's rows whole, else the positions held
                let rows = if ring_rows(ring, self.capacity) { 2 * ring } else { n };
                self.k.copy_prefix(&new.k, be, l, rows * d)?;
                self.v.copy_prefix(&new.v, be, l, rows * d)
            }
            Mixer::LatentAttention(m) => self.k.copy_prefix(&new.k, be, l, n * m.cache_width()),
            Mixer::GatedDeltaNet(_) => {
                let (from, to) = (self.delta_state(l), new.delta_state(l));
                be.copy(from.conv, to.conv)?;
                Ok(be.copy(from.matrix, to.matrix)?)
            }
        }
    }

    pub fn bytes(&self) -> usize {
        let delta: usize = self.delta.iter().flatten().map(|d| d.conv.bytes() + d.matrix.bytes()).sum();
        self.k.bytes() + self.v.bytes() + delta
    }
}
