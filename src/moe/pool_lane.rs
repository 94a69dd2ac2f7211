//! The fast cold lane, one implementation for both engines: a layer's cold slots grouped by
//! expert (expert-major, so each expert's weights are read once per layer) and run as one
//! [`ColdJob`](moe_lanes_kernels::pool::ColdJob) on a SIMD [`ColdPool`], straight from the
//! memory-mapped expert bytes (float or quantized blocks).
//!
//! - The CPU pipeline runs it on the pinned pool its dense stage uses, the driver as thread 0
//!   ([`PoolLane::on`]): every participant streams rows of every expert (the pool splits experts
//!   by rows), so one decode token's 8 cold experts keep all cores reading, where one expert per
//!   lane thread would keep only 8 busy; and no thread changes pools between the dense stage and
//!   the lanes, so nobody parks and wakes per layer.
//! - The GPU engine runs it on a pool of its own ([`PoolColdLane`]) while the GPU computes the
//!   hot slots.
//!
//! The pool's accumulation order is fixed (experts in first-seen order of the slots, their rows
//! in slot order), so the result is the same bits for any thread count. The grouping is
//! [`ExpertGroups`].

use crate::model::Model;
use crate::moe::cold::{ColdError, ColdLane, ColdSlot};
use crate::moe::expert_groups::{ExpertGroups, GroupRun};
use moe_lanes_kernels::pool::ColdSchedule;
use moe_lanes_kernels::{Activation, ColdPool, DecodeActivations, SimdLevel};
use std::sync::Arc;

/// The pool cold lane's state: kernels level, activations, the grouping and the counts. It runs
/// on a pool lent per layer ([`PoolLane::on`]) or owned ([`PoolColdLane`]).
pub struct PoolLane {
    model: Arc<Model>,
    level: SimdLevel,
    activations: DecodeActivations,
    act: Activation,
    groups: ExpertGroups,
    /// Routed slots per `[layer][expert]` seen by this lane (learn passes read it).
    pub expert_counts: Vec<Vec<u64>>,
    /// Slots computed so far (all layers).
    pub slots_computed: u64,
}

impl PoolLane {
    /// The pool's kernels read every expert dtype (floats and GGML blocks, per matrix).
    /// `activations`: of the few-token decode tiles of quantised experts (`None`: the default for
    /// the level, [`DecodeActivations::resolve`]).
    pub fn new(model: Arc<Model>, level: SimdLevel, activations: Option<DecodeActivations>) -> PoolLane {
        let act = model.plan().expert_activation().kernel();
        let c = model.config();
        let (groups, expert_counts) =
            (ExpertGroups::new(c.n_experts), vec![vec![0; c.n_experts]; c.n_layers]);
        let activations = DecodeActivations::resolve(activations, level);
        PoolLane { model, level, activations, act, groups, expert_counts, slots_computed: 0 }
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

    pub fn simd_level(&self) -> SimdLevel {
        self.level
    }

    /// This lane on `pool`'s first `participants` threads, for one layer.
    pub fn on<'a>(&'a mut self, pool: &'a mut ColdPool, participants: usize) -> PoolLaneOn<'a> {
        PoolLaneOn { lane: self, pool, participants }
    }
}

/// A [`PoolLane`] bound to a pool: the [`ColdLane`] both engines call.
pub struct PoolLaneOn<'a> {
    lane: &'a mut PoolLane,
    pool: &'a mut ColdPool,
    participants: usize,
}

impl ColdLane for PoolLaneOn<'_> {
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
        let lane = &mut *self.lane;
        lane.groups.clear();
        for slot in slots {
            lane.groups.push(slot.expert_idx, slot.row_idx as u32, slot.weight);
            lane.expert_counts[layer_idx][slot.expert_idx] += 1;
        }
        let run = GroupRun {
            level: lane.level,
            activations: lane.activations,
            act: lane.act,
            layer_idx,
            x: hidden_rows,
        };
        let result = lane.groups.run(&lane.model, &run, self.pool, self.participants, out_rows);
        result.map_err(|source| ColdError::Kernel { layer_idx, source })?;
        lane.slots_computed += slots.len() as u64;
        Ok(())
    }
}

/// The pool cold lane with a pool of its own, all of whose threads take cold work (the GPU
/// engine's cold lane).
pub struct PoolColdLane {
    /// The lane's state (counts, activations).
    pub lane: PoolLane,
    pool: ColdPool,
}

impl PoolColdLane {
    /// A pool of `n_threads` workers (pinned to cores).
    /// `simd`: a forced SIMD level (else [`crate::moe::expert_math::cold_simd_level`]'s default);
    /// `schedule`: the pool's schedule (it changes speed, never results).
    pub fn new(
        model: Arc<Model>,
        n_threads: usize,
        simd: Option<SimdLevel>,
        schedule: ColdSchedule,
    ) -> Result<PoolColdLane, ColdError> {
        let level =
            crate::moe::expert_math::cold_simd_level(simd).map_err(|source| ColdError::Setup { source })?;
        let mut pool = ColdPool::new(n_threads.max(1));
        pool.set_schedule(schedule);
        Ok(PoolColdLane { lane: PoolLane::new(model, level, None), pool })
    }

    pub fn n_threads(&self) -> usize {
        self.pool.n_threads()
    }
}

impl ColdLane for PoolColdLane {
    fn compute(
        &mut self,
        layer_idx: usize,
        hidden_rows: &[f32],
        slots: &[ColdSlot],
        out_rows: &mut [f32],
    ) -> Result<(), ColdError> {
        let all = self.pool.n_threads();
        self.lane.on(&mut self.pool, all).compute(layer_idx, hidden_rows, slots, out_rows)
    }
}
