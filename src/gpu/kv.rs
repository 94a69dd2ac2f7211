//! The GPU KV cache: per layer, K and V as `[capacity, kv_dim]` in the cache's [`KvType`] (f16
//! by default; f32, bf16 and q8_0 selectable, q8_0 as llama.cpp's blocks of 32 values, each
//! `[capacity, kv_dim]` row whole blocks); `kv_dim` is each layer's own (KV heads x head dim:
//! Gemma 4's global layers differ from its sliding ones). Keys and values are written converted
//! (after RoPE) and every attention kernel reads each type. A latent attention layer keeps one
//! row of `kv_lora_rank + rope` values per position (the normed latent and the rotated key part,
//! `LatentAttentionSpec::cache_width`) in its K buffer, in the same type, and no V. A
//! sliding-window layer keeps a mirrored ring of at most `2 * kv_ring_positions(window)` rows
//! (`moe_lanes_kernels::kv::kv_ring_positions`), so a long context costs full KV only in the
//! global layers.
//!
//! Paging (vAttention's scheme, `GpuOptions::kv_paging`, on by default): a buffer whose rows are
//! written in position order (full and latent attention, and a sliding-window layer whose rows
//! stay linear) reserves device addresses for its whole capacity once and commits physical pages
//! as positions come ([`moe_lanes_kernels::cuda::PagedBuffer`]): each call first commits
//! [`committed_positions`] of the positions it will hold ([`GpuKvCache::commit`]), so a
//! 16-sequence server at 32k context holds what its sessions use, not 16 full caches. The
//! address never moves, so the kernels, `KvPtr` and the decode graphs keyed on
//! [`GpuKvCache::serial`] are as with whole buffers. The mirrored rings, the DeltaNet state,
//! buffers of a page or less, and every buffer where paging is off or the driver refuses it are
//! allocated whole (and zeroed), as before.

use moe_lanes_kernels::cuda::ops::KvPtr;
use moe_lanes_kernels::cuda::{CudaBackend, CudaError, DPtr, DeviceBuffer, PagedBuffer};

use super::GpuError;
use crate::model::arch::{LayerPlan, Mixer};
use crate::model::context::KvType;
use moe_lanes_kernels::kv::{kv_ring_positions, kv_ring_rows, KV_RING_CHUNK_POSITIONS};
use std::ops::Range;

/// Positions committed past the ones a call needs, before rounding up to a power of two: the
/// decode graph's attention grid covers a power-of-two bucket of at least 256 positions
/// (`graph::positions_bucket`), and a few hundred positions of decode run without a commit.
const COMMIT_HEADROOM_POSITIONS: usize = 256;

/// The positions a paged cache of `capacity` commits for a call that needs its first `n`: the
/// next power of two past `n` + [`COMMIT_HEADROOM_POSITIONS`] (at least every position the
/// attention kernels may address for `n`, the decode graph's bucket included), at most
/// `capacity`.
pub(crate) fn committed_positions(n: usize, capacity: usize) -> usize {
    (n + COMMIT_HEADROOM_POSITIONS).next_power_of_two().min(capacity)
}

/// One layer's keys or values as bytes in the cache's type.
pub(crate) enum KvStore {
    /// Allocated and zeroed whole.
    Whole(DeviceBuffer<u8>),
    /// Rows of `row_bytes` committed front to back as positions come.
    Paged { buf: PagedBuffer, row_bytes: usize },
}

/// What one layer's K or V store holds: its bytes, and the bytes of one position's row where its
/// rows are written in position order (it may be paged).
#[derive(Debug, Clone, Copy)]
struct StoreSpec {
    bytes: usize,
    linear_row_bytes: Option<usize>,
}

impl KvStore {
    /// A store of `spec` on `be`'s device: paged where `paging` is on, its rows are linear and
    /// it is larger than a page; else (or where the driver refuses the reservation) whole.
    fn new(be: &CudaBackend, spec: StoreSpec, paging: bool) -> Result<KvStore, CudaError> {
        let larger_than_a_page = be.page_bytes().is_some_and(|p| spec.bytes > p);
        if let Some(row_bytes) = spec.linear_row_bytes.filter(|_| paging && larger_than_a_page) {
            if let Ok(buf) = be.reserve_paged(spec.bytes) {
                return Ok(KvStore::Paged { buf, row_bytes });
            }
        }
        Ok(KvStore::Whole(be.alloc_zeros::<u8>(spec.bytes)?))
    }
    fn ptr(&self) -> DPtr<u8> {
        match self {
            KvStore::Whole(b) => b.ptr(),
            KvStore::Paged { buf, .. } => buf.ptr(),
        }
    }
    /// Bytes of device memory it holds (a paged store's committed pages).
    fn committed_bytes(&self) -> usize {
        match self {
            KvStore::Whole(b) => b.bytes(),
            KvStore::Paged { buf, .. } => buf.committed_bytes(),
        }
    }
    fn serial(&self) -> u64 {
        match self {
            KvStore::Whole(b) => b.serial(),
            KvStore::Paged { buf, .. } => buf.serial(),
        }
    }
    /// Commit the first `rows` rows of a paged store (nothing for a whole one).
    fn commit(&mut self, be: &CudaBackend, rows: usize) -> Result<(), CudaError> {
        if let KvStore::Paged { buf, row_bytes } = self {
            be.commit_paged(buf, rows * *row_bytes)?;
        }
        Ok(())
    }
}

/// A cache type's view of a store's bytes.
fn kv_ptr(kv_type: KvType, p: DPtr<u8>) -> KvPtr {
    match kv_type {
        KvType::F32 => KvPtr::F32(p.as_f32()),
        KvType::F16 => KvPtr::F16(p.as_u16()),
        KvType::Bf16 => KvPtr::Bf16(p.as_u16()),
        KvType::Q8_0 => KvPtr::Q8_0(p),
    }
}

/// Every layer's keys (or values), one store per layer.
pub(crate) struct KvBufs(Vec<KvStore>);

impl KvBufs {
    /// One store per layer, `specs[l]` on layer `l`'s device (`bes[l]`).
    fn new(bes: &[&CudaBackend], specs: &[StoreSpec], paging: bool) -> Result<KvBufs, GpuError> {
        let stores = bes.iter().zip(specs).map(|(be, &spec)| KvStore::new(be, spec, paging));
        Ok(KvBufs(stores.collect::<Result<_, _>>()?))
    }
    /// Queue a copy of layer `l`'s first `bytes` into `dst`'s layer `l` (a cache of the same
    /// type, committed that far).
    fn copy_prefix(&self, dst: &KvBufs, be: &CudaBackend, l: usize, bytes: usize) -> Result<(), GpuError> {
        Ok(be.copy(self.0[l].ptr().sub(0, bytes), dst.0[l].ptr().sub(0, bytes))?)
    }
}

/// Layer `l`'s K and V stores for a cache of `capacity` positions in `kv_type`: an attention
/// layer's rows (linear, or its mirrored ring), a latent layer's rows in K (a block in V), a
/// DeltaNet layer's one block in each.
fn layer_specs(layer: &Mixer, capacity: usize, kv_type: KvType) -> (StoreSpec, StoreSpec) {
    let bytes = |values: usize| kv_type.bytes_of(values as u64) as usize;
    let block = StoreSpec { bytes: bytes(kv_type.block_len()), linear_row_bytes: None };
    let rows = |n: usize, width: usize, linear: bool| StoreSpec {
        bytes: bytes(n * width),
        linear_row_bytes: linear.then(|| bytes(width)),
    };
    match layer {
        Mixer::Attention(a) => {
            let window = a.window.unwrap_or(0);
            let linear = !ring_rows(kv_ring_positions(window), capacity);
            let spec = rows(kv_ring_rows(window, capacity), a.kv_dim(), linear);
            (spec, spec)
        }
        Mixer::LatentAttention(m) => (rows(capacity, m.cache_width(), true), block),
        Mixer::GatedDeltaNet(_) => (block, block),
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
    /// The cache of `plan`'s layers, layer `l`'s buffers on `bes[l]` (one per layer); those
    /// whose rows are linear paged where `paging` is on (nothing committed yet:
    /// [`Self::commit`]).
    pub(crate) fn new(
        bes: &[&CudaBackend],
        plan: &LayerPlan,
        (kv_dim, capacity): (usize, usize),
        kv_type: KvType,
        paging: bool,
    ) -> Result<Self, GpuError> {
        check_kv_blocks(plan, kv_type)?;
        let (k_specs, v_specs): (Vec<StoreSpec>, Vec<StoreSpec>) =
            plan.layers().iter().map(|l| layer_specs(&l.mixer, capacity, kv_type)).unzip();
        assert_eq!(bes.len(), k_specs.len(), "one device per layer");
        let k = KvBufs::new(bes, &k_specs, paging)?;
        let v = KvBufs::new(bes, &v_specs, paging)?;
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

    /// Commit the paged buffers of `layers` (the layers `be`'s device runs) for a call that
    /// needs the first `n_positions`: [`committed_positions`] of them, each newly mapped page
    /// zeroed on the device's stream before the call's work. An out-of-memory device is
    /// [`GpuError::KvMemory`] (the device still works); nothing to do for whole buffers.
    pub(crate) fn commit(
        &mut self,
        be: &CudaBackend,
        layers: Range<usize>,
        n_positions: usize,
    ) -> Result<(), GpuError> {
        let rows = committed_positions(n_positions, self.capacity);
        let stores = self.k.0[layers.clone()].iter_mut().chain(&mut self.v.0[layers]);
        for store in stores {
            store.commit(be, rows).map_err(|source| match source.is_out_of_memory() {
                true => GpuError::KvMemory { positions: rows, source },
                false => GpuError::Cuda(source),
            })?;
        }
        Ok(())
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
        kv_ptr(self.kv_type, self.k.0[l].ptr())
    }
    /// Layer `l`'s values, `[capacity, kv_dim]` (the layer's own `kv_dim`).
    pub(crate) fn v(&self, l: usize) -> KvPtr {
        kv_ptr(self.kv_type, self.v.0[l].ptr())
    }
    /// The allocation serial a captured decode graph keys on.
    pub(crate) fn serial(&self) -> u64 {
        self.k.0[0].serial()
    }
    pub fn n_layers(&self) -> usize {
        self.k.0.len()
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
    /// Forget every position (the memory stays allocated, committed pages included).
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
    /// layout ([`Self::can_grow_to`]), committed for this one's positions.
    pub(crate) fn copy_layer_into(
        &self,
        new: &GpuKvCache,
        be: &CudaBackend,
        layer: &Mixer,
        l: usize,
    ) -> Result<(), GpuError> {
        let n = self.n_positions;
        let bytes = |values: usize| self.kv_type.bytes_of(values as u64) as usize;
        match layer {
            Mixer::Attention(a) => {
                let (d, ring) = (a.kv_dim(), kv_ring_positions(a.window.unwrap_or(0)));
                // a ring's rows whole, else the positions held
                let rows = if ring_rows(ring, self.capacity) { 2 * ring } else { n };
                self.k.copy_prefix(&new.k, be, l, bytes(rows * d))?;
                self.v.copy_prefix(&new.v, be, l, bytes(rows * d))
            }
            Mixer::LatentAttention(m) => self.k.copy_prefix(&new.k, be, l, bytes(n * m.cache_width())),
            Mixer::GatedDeltaNet(_) => {
                let (from, to) = (self.delta_state(l), new.delta_state(l));
                be.copy(from.conv, to.conv)?;
                Ok(be.copy(from.matrix, to.matrix)?)
            }
        }
    }

    /// Bytes of device memory it holds: whole buffers, the pages committed so far of paged ones
    /// (whole pages), the recurrent state.
    pub fn bytes(&self) -> usize {
        let stores = self.k.0.iter().chain(&self.v.0);
        let delta: usize = self.delta.iter().flatten().map(|d| d.conv.bytes() + d.matrix.bytes()).sum();
        stores.map(KvStore::committed_bytes).sum::<usize>() + delta
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commits_reach_a_power_of_two_past_the_headroom_within_the_capacity() {
        assert_eq!(committed_positions(0, 32768), 256);
        assert_eq!(committed_positions(1, 32768), 512);
        assert_eq!(committed_positions(256, 32768), 512);
        assert_eq!(committed_positions(257, 32768), 1024);
        assert_eq!(committed_positions(768, 32768), 1024);
        assert_eq!(committed_positions(769, 32768), 2048);
        assert_eq!(committed_positions(3000, 4096), 4096);
        assert_eq!(committed_positions(10, 100), 100);
    }

    #[test]
    fn commits_cover_the_needed_positions_and_their_headroom_or_the_capacity() {
        for capacity in [1usize, 7, 256, 1000, 4096, 40960] {
            for n in (0..=capacity).step_by(capacity.div_ceil(97)) {
                let c = committed_positions(n, capacity);
                assert!(c <= capacity, "{n} of {capacity}: {c}");
                assert!(c == capacity || c >= n + COMMIT_HEADROOM_POSITIONS, "{n} of {capacity}: {c}");
                assert!(c >= committed_positions(n.saturating_sub(1), capacity), "monotonic at {n}");
            }
        }
    }
}
