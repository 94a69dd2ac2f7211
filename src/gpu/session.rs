//! A GPU inference session: a [`GpuModel`] with its KV cache and the pool cold lane, for logits
//! and greedy generation from the CLI (`--engine gpu`) or an embedding service.

use super::{
    CudaBackend, CudaError, GpuError, GpuKvCache, GpuModel, HotAssignment, PoolColdError, PoolColdExperts,
};
use crate::model::Model;
use std::sync::Arc;

/// Why a session could not start.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// No usable GPU: callers fall back to the CPU pipeline and say so.
    #[error("no usable GPU: {0}")]
    NoGpu(#[from] CudaError),
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error(transparent)]
    Cold(#[from] PoolColdError),
}

pub struct GpuSession<'m> {
    gpu: GpuModel,
    cold: PoolColdExperts<'m>,
    cache: GpuKvCache,
}

impl<'m> GpuSession<'m> {
    /// Upload the model with `hot` experts in the VRAM cache; room for `n_positions` tokens.
    pub fn new(
        model: &'m Model,
        hot: &HotAssignment,
        cold_threads: usize,
        n_positions: usize,
    ) -> Result<GpuSession<'m>, SessionError> {
        let backend = Arc::new(CudaBackend::try_new()?);
        let gpu = GpuModel::new(model, backend, hot)?;
        let cache = gpu.new_kv_cache(n_positions.clamp(1, model.config().max_positions))?;
        Ok(GpuSession { gpu, cold: PoolColdExperts::new(model, cold_threads)?, cache })
    }

    pub fn device_name(&self) -> String {
        self.gpu.backend().info().name.clone()
    }

    /// Run `tokens` after what the cache holds; one logits row per token.
    pub fn logits(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>, GpuError> {
        let logits = self.gpu.forward(tokens, &mut self.cache, &mut self.cold)?;
        Ok((0..logits.n_rows).map(|i| logits.row(i).to_vec()).collect())
    }

    /// Greedy generation from a fresh cache: prefill `prompt`, then decode `n_new` tokens.
    pub fn generate(&mut self, prompt: &[u32], n_new: usize) -> Result<Vec<u32>, GpuError> {
        self.cache.clear();
        let mut generated = Vec::with_capacity(n_new);
        if n_new == 0 {
            return Ok(generated);
        }
        let mut next = *self
            .gpu
            .forward(prompt, &mut self.cache, &mut self.cold)?
            .argmax
            .last()
            .expect("one row per token");
        generated.push(next);
        while generated.len() < n_new {
            next = self.gpu.forward(&[next], &mut self.cache, &mut self.cold)?.argmax[0];
            generated.push(next);
        }
        Ok(generated)
    }
}
