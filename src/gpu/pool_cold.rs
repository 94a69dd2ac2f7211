//! The fast CPU cold lane for the GPU engine: a [`ColdExperts`] that groups a layer's cold slots
//! by expert (expert-major, so each expert's weights are read once per layer) and runs them on the
//! SIMD cold pool of `moe-lanes-kernels`, straight from the memory-mapped expert bytes (float or
//! quantized blocks, as the CPU pipeline's cold lane).
//!
//! The grouping and the job are [`ExpertGroups`], shared with the CPU pipeline's pool cold lane.

use super::cold::{ColdError, ColdExperts, ColdSlot};
use crate::model::Model;
use crate::moe::expert_groups::{ExpertGroups, GroupRun};
use moe_lanes_kernels::pool::ColdSchedule;
use moe_lanes_kernels::{Activation, ColdPool, DecodeActivations, KernelError, SimdLevel};
use std::sync::Arc;

/// Why the pool cold lane cannot serve a model.
#[derive(Debug, thiserror::Error)]
pub enum PoolColdError {
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

/// Cold lane on the SIMD thread pool.
pub struct PoolColdExperts {
    model: Arc<Model>,
    pool: ColdPool,
    level: SimdLevel,
    activations: DecodeActivations,
    act: Activation,
    groups: ExpertGroups,
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
        let act = model.plan().expert_activation().kernel();
        let c = model.config().clone();
        let level = crate::moe::expert_math::cold_simd_level(simd)?;
        Ok(PoolColdExperts {
            model,
            pool: {
                let mut pool = ColdPool::new(n_threads.max(1));
                pool.set_schedule(schedule);
                pool
            },
            level,
            activations: DecodeActivations::resolve(None, level),
            act,
            groups: ExpertGroups::new(c.n_experts),
            expert_counts: vec![vec![0; c.n_experts]; c.n_layers],
            slots_computed: 0,
        })
    }

    /// Sets the activations of the few-token decode tiles (`None`: the default for the level,
    /// [`DecodeActivations::resolve`]); they change results within the 8-bit rounding.
    pub fn set_activations(&mut self, requested: Option<DecodeActivations>) {
        self.activations = DecodeActivations::resolve(requested, self.level);
    }

    /// The activations the few-token tiles of quantised experts run with (Q8 or Auto only where
    /// the level has AVX-512 VNNI).
    pub fn activations(&self) -> DecodeActivations {
        self.activations.at(self.level)
    }

    pub fn n_threads(&self) -> usize {
        self.pool.n_threads()
    }

    pub fn simd_level(&self) -> SimdLevel {
        self.level
    }

    fn group_by_expert(&mut self, layer_idx: usize, slots: &[ColdSlot]) {
        self.groups.clear();
        for slot in slots {
            self.groups.push(slot.expert_idx, slot.row_idx as u32, slot.weight);
            self.expert_counts[layer_idx][slot.expert_idx] += 1;
        }
    }
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
        let run = GroupRun {
            level: self.level,
            activations: self.activations,
            act: self.act,
            layer_idx,
            x: hidden_rows,
        };
        let all = self.pool.n_threads();
        let result = self.groups.run(&self.model, &run, &mut self.pool, all, out_rows);
        result.map_err(|source| ColdError::Kernel { layer_idx, source })?;
        self.slots_computed += slots.len() as u64;
        Ok(())
    }
}
