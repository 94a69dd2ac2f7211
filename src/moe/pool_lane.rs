//! The CPU pipeline's cold lane on its shared pool: a layer's cold section grouped by expert
//! (each expert's weights read once per layer) and run as one
//! [`ColdJob`](moe_lanes_kernels::pool::ColdJob) on the pinned pool the dense stage uses, the
//! driver as thread 0. Every participant streams rows of every expert (the pool splits experts by
//! rows), so one decode token's 8 cold experts keep all cores reading,
//! where one expert per lane thread would keep only 8 busy; and no thread changes pools between
//! the dense stage and the lanes, so nobody parks and wakes per layer.
//!
//! The pool's accumulation order is fixed (experts in first-seen order of the section, their
//! tokens in entry order), so the result is the same bits for any thread count. The grouping is
//! [`ExpertGroups`], shared with the GPU engine's CPU cold lane.

use crate::model::Model;
use crate::moe::expert_groups::{ExpertGroups, GroupRun};
use crate::moe::worklist::Worklist;
use moe_lanes_kernels::{Activation, ColdPool, DecodeActivations, KernelError, SimdLevel};
use std::ops::Range;
use std::sync::Arc;

/// The grouping state of the pool cold lane (the pool itself belongs to the dense stage).
pub struct PoolLane {
    model: Arc<Model>,
    level: SimdLevel,
    activations: DecodeActivations,
    act: Activation,
    groups: ExpertGroups,
}

impl PoolLane {
    /// The pool's kernels read every expert dtype (floats and GGML blocks, per matrix).
    /// `activations`: of the few-token decode tiles of quantised experts.
    pub fn new(model: Arc<Model>, level: SimdLevel, activations: DecodeActivations) -> PoolLane {
        let act = model.plan().expert_activation().kernel();
        let groups = ExpertGroups::new(model.config().n_experts);
        PoolLane { model, level, activations, act, groups }
    }

    /// The activations the few-token tiles of quantised experts run with here (Q8 or Auto only
    /// where the level has AVX-512 VNNI).
    pub fn activations(&self) -> DecodeActivations {
        self.activations.at(self.level)
    }

    /// For the cold entries `range` of `wl` (layer `layer_idx`, inputs `x`: `[n_tokens, hidden]`),
    /// `token_rows[t] += weight * FFN_e(x_t)` on `pool`'s first `participants` threads.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &mut self,
        pool: &mut ColdPool,
        participants: usize,
        layer_idx: usize,
        x: &[f32],
        wl: &Worklist,
        range: Range<usize>,
        token_rows: &mut [f32],
    ) -> Result<(), KernelError> {
        self.groups.clear();
        for i in range {
            self.groups.push(wl.cold_id[i] as usize, wl.cold_token_id[i], wl.cold_weight[i]);
        }
        let run = GroupRun { level: self.level, activations: self.activations, act: self.act, layer_idx, x };
        self.groups.run(&self.model, &run, pool, participants, token_rows)
    }
}
