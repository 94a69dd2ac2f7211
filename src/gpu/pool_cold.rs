//! The fast CPU cold lane for the GPU engine: a [`ColdExperts`] that groups a layer's cold slots
//! by expert (expert-major, so each expert's weights are read once per layer) and runs them on the
//! SIMD cold pool of `moe-lanes-kernels`, straight from the memory-mapped expert bytes.
//!
//! Steady state allocates nothing: the per-expert token lists are reused between calls, and the
//! job's expert list is recycled through an in-place `collect` (same layout, new lifetime).

use super::cold::{ColdError, ColdExperts, ColdSlot};
use crate::format::dtype::DType;
use crate::model::adapter::FfnActivation;
use crate::model::Model;
use moe_lanes_kernels::pool::ColdSchedule;
use moe_lanes_kernels::{
    Activation, ColdExpertWork, ColdJob, ColdPool, ExpertWeights, KernelError, SimdLevel, WeightDType,
};
use std::sync::Arc;

/// Why the pool cold lane cannot serve a model.
#[derive(Debug, thiserror::Error)]
pub enum PoolColdError {
    #[error("the cold pool needs F32, F16 or BF16 experts; this model's experts are {0}")]
    ExpertDType(DType),
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

/// Cold lane on the SIMD thread pool.
pub struct PoolColdExperts {
    model: Arc<Model>,
    pool: ColdPool,
    level: SimdLevel,
    act: Activation,
    dtype: WeightDType,
    /// Per expert: rows routed to it in the current call, and their weights.
    token_idx: Vec<Vec<u32>>,
    token_weight: Vec<Vec<f32>>,
    /// Experts with at least one slot in the current call, in first-seen order.
    active: Vec<usize>,
    work_storage: Vec<ColdExpertWork<'static>>,
    /// Routed slots per `[layer][expert]` seen by this lane (learn passes read it).
    pub expert_counts: Vec<Vec<u64>>,
    /// Slots computed so far (all layers).
    pub slots_computed: u64,
}

impl PoolColdExperts {
    /// A pool of `n_threads` workers (pinned to cores).
    /// `simd`: a forced SIMD level (else [`crate::moe::expert_math::cold_simd_level`]'s default);
    /// `schedule`: the pool's schedule (it changes speed, never results).
    pub fn new(
        model: Arc<Model>,
        n_threads: usize,
        simd: Option<SimdLevel>,
        schedule: ColdSchedule,
    ) -> Result<PoolColdExperts, PoolColdError> {
        let dtype = match model.expert_dtype() {
            DType::BF16 => WeightDType::BF16,
            DType::F16 => WeightDType::F16,
            DType::F32 => WeightDType::F32,
            other => return Err(PoolColdError::ExpertDType(other)),
        };
        let act = match model.adapter().activation {
            FfnActivation::Silu => Activation::Silu,
            FfnActivation::Gelu => Activation::Gelu,
        };
        let c = model.config().clone();
        Ok(PoolColdExperts {
            model,
            pool: {
                let mut pool = ColdPool::new(n_threads.max(1));
                pool.set_schedule(schedule);
                pool
            },
            level: crate::moe::expert_math::cold_simd_level(simd)?,
            act,
            dtype,
            token_idx: vec![Vec::new(); c.n_experts],
            token_weight: vec![Vec::new(); c.n_experts],
            active: Vec::with_capacity(c.n_experts),
            work_storage: Vec::with_capacity(c.n_experts),
            expert_counts: vec![vec![0; c.n_experts]; c.n_layers],
            slots_computed: 0,
        })
    }

    pub fn n_threads(&self) -> usize {
        self.pool.n_threads()
    }

    pub fn simd_level(&self) -> SimdLevel {
        self.level
    }

    fn group_by_expert(&mut self, layer_idx: usize, slots: &[ColdSlot]) {
        for &expert_idx in &self.active {
            self.token_idx[expert_idx].clear();
            self.token_weight[expert_idx].clear();
        }
        self.active.clear();
        for slot in slots {
            if self.token_idx[slot.expert_idx].is_empty() {
                self.active.push(slot.expert_idx);
            }
            self.token_idx[slot.expert_idx].push(slot.row_idx as u32);
            self.token_weight[slot.expert_idx].push(slot.weight);
            self.expert_counts[layer_idx][slot.expert_idx] += 1;
        }
    }
}

/// Reuse a vector's allocation for a new element lifetime: an in-place collect of an empty
/// vector keeps the buffer (same size and alignment), so no `unsafe` is needed.
fn recycle<'a>(mut storage: Vec<ColdExpertWork<'static>>) -> Vec<ColdExpertWork<'a>> {
    storage.clear();
    storage.into_iter().map(|_| unreachable!("the vector is empty")).collect()
}

fn unrecycle(mut work: Vec<ColdExpertWork<'_>>) -> Vec<ColdExpertWork<'static>> {
    work.clear();
    work.into_iter().map(|_| unreachable!("the vector is empty")).collect()
}

impl ColdExperts for PoolColdExperts {
    fn compute(
        &mut self,
        layer_idx: usize,
        hidden_rows: &[f32],
        slots: &[ColdSlot],
        out_rows: &mut [f32],
    ) -> Result<(), ColdError> {
        if slots.is_empty() {
            return Ok(());
        }
        self.group_by_expert(layer_idx, slots);
        let c = self.model.config();
        let mut work = recycle(std::mem::take(&mut self.work_storage));
        for &expert_idx in &self.active {
            let e = self.model.expert(layer_idx, expert_idx);
            work.push(ColdExpertWork {
                weights: ExpertWeights {
                    gate: e.gate.data,
                    up: e.up.data,
                    down: e.down.data,
                    dtype: self.dtype,
                    down_dtype: self.dtype,
                    hidden: c.hidden,
                    ff: c.expert_ff,
                },
                token_idx: &self.token_idx[expert_idx],
                token_weight: &self.token_weight[expert_idx],
            });
        }
        let job = ColdJob {
            level: self.level,
            act: self.act,
            hidden: c.hidden,
            ff: c.expert_ff,
            x: hidden_rows,
            experts: &work,
        };
        let result = self.pool.run(&job, out_rows);
        self.work_storage = unrecycle(work);
        result.map_err(|source| ColdError::Kernel { layer_idx, source })?;
        self.slots_computed += slots.len() as u64;
        Ok(())
    }
}
