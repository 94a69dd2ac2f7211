//! The GPU KV cache: per layer, K and V as f32 `[capacity, kv_dim]`, allocated once.

use moe_lanes_kernels::cuda::{CudaBackend, DeviceBuffer};

use super::GpuError;

pub struct GpuKvCache {
    pub(crate) k: Vec<DeviceBuffer<f32>>,
    pub(crate) v: Vec<DeviceBuffer<f32>>,
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
    ) -> Result<Self, GpuError> {
        let mut k = Vec::with_capacity(n_layers);
        let mut v = Vec::with_capacity(n_layers);
        for _ in 0..n_layers {
            k.push(be.alloc_zeros::<f32>(capacity * kv_dim)?);
            v.push(be.alloc_zeros::<f32>(capacity * kv_dim)?);
        }
        Ok(GpuKvCache { k, v, capacity, kv_dim, n_positions: 0 })
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
        self.k.iter().chain(&self.v).map(DeviceBuffer::bytes).sum()
    }
}
