//! The GPU KV cache: per layer, K and V as `[capacity, kv_dim]` in the cache's [`KvType`] (f16
//! by default, f32 selectable), allocated once. Keys and values are written converted (after
//! RoPE) and every attention kernel reads either type.

use moe_lanes_kernels::cuda::ops::KvPtr;
use moe_lanes_kernels::cuda::{CudaBackend, DeviceBuffer};

use super::GpuError;
use crate::model::context::KvType;

/// One layer's keys or values per layer, in the cache's type.
pub(crate) enum KvBufs {
    F32(Vec<DeviceBuffer<f32>>),
    F16(Vec<DeviceBuffer<u16>>),
}

impl KvBufs {
    fn new(be: &CudaBackend, kv: KvType, n_layers: usize, elems: usize) -> Result<KvBufs, GpuError> {
        Ok(match kv {
            KvType::F32 => {
                KvBufs::F32((0..n_layers).map(|_| be.alloc_zeros::<f32>(elems)).collect::<Result<_, _>>()?)
            }
            KvType::F16 => {
                KvBufs::F16((0..n_layers).map(|_| be.alloc_zeros::<u16>(elems)).collect::<Result<_, _>>()?)
            }
        })
    }
    fn layer(&self, l: usize) -> KvPtr {
        match self {
            KvBufs::F32(b) => KvPtr::F32(b[l].ptr()),
            KvBufs::F16(b) => KvPtr::F16(b[l].ptr()),
        }
    }
    fn bytes(&self) -> usize {
        match self {
            KvBufs::F32(b) => b.iter().map(DeviceBuffer::bytes).sum(),
            KvBufs::F16(b) => b.iter().map(DeviceBuffer::bytes).sum(),
        }
    }
    fn n_layers(&self) -> usize {
        match self {
            KvBufs::F32(b) => b.len(),
            KvBufs::F16(b) => b.len(),
        }
    }
    fn serial(&self) -> u64 {
        match self {
            KvBufs::F32(b) => b[0].serial(),
            KvBufs::F16(b) => b[0].serial(),
        }
    }
}

pub struct GpuKvCache {
    k: KvBufs,
    v: KvBufs,
    kv_type: KvType,
    pub(crate) capacity: usize,
    pub(crate) kv_dim: usize,
    pub(crate) n_positions: usize,
}

impl GpuKvCache {
    pub(crate) fn new(
        be: &CudaBackend,
        n_layers: usize,
        kv_dim: usize,
        capacity: usize,
        kv_type: KvType,
    ) -> Result<Self, GpuError> {
        let k = KvBufs::new(be, kv_type, n_layers, capacity * kv_dim)?;
        let v = KvBufs::new(be, kv_type, n_layers, capacity * kv_dim)?;
        Ok(GpuKvCache { k, v, kv_type, capacity, kv_dim, n_positions: 0 })
    }
    /// Layer `l`'s keys, `[capacity, kv_dim]`.
    pub(crate) fn k(&self, l: usize) -> KvPtr {
        self.k.layer(l)
    }
    /// Layer `l`'s values, `[capacity, kv_dim]`.
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
    pub fn bytes(&self) -> usize {
        self.k.bytes() + self.v.bytes()
    }
}
