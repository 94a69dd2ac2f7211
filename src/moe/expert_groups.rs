//! A layer's cold entries grouped by expert (expert-major, so each expert's weights are read
//! once per layer) and run as one [`ColdJob`] on a [`ColdPool`], straight from the memory-mapped
//! expert bytes: the work of the pool cold lane ([`crate::moe::pool_lane`]) that both engines use.
//!
//! Steady state allocates nothing: the per-expert token lists are reused between layers, and the
//! job's expert list is recycled through an in-place `collect` (same layout, new lifetime).

use crate::model::Model;
use crate::moe::expert_math::kernel_dtype;
use moe_lanes_kernels::{
    Activation, ColdExpertWork, ColdJob, ColdPool, DecodeActivations, ExpertWeights, KernelError, SimdLevel,
};

/// Per expert the rows routed to it in the current layer and their weights; the experts with
/// at least one entry in first-seen order.
pub struct ExpertGroups {
    token_idx: Vec<Vec<u32>>,
    token_weight: Vec<Vec<f32>>,
    active: Vec<usize>,
    work_storage: Vec<ColdExpertWork<'static>>,
}

/// What a grouped layer runs with: kernels level, activation, inputs `[rows, hidden]`.
pub struct GroupRun<'a> {
    pub level: SimdLevel,
    /// Activations of the few-token decode tiles of quantised experts (Q8: 8-bit, VNNI).
    pub activations: DecodeActivations,
    pub act: Activation,
    pub layer_idx: usize,
    pub x: &'a [f32],
}

impl ExpertGroups {
    pub fn new(n_experts: usize) -> ExpertGroups {
        ExpertGroups {
            token_idx: vec![Vec::new(); n_experts],
            token_weight: vec![Vec::new(); n_experts],
            active: Vec::with_capacity(n_experts),
            work_storage: Vec::with_capacity(n_experts),
        }
    }

    /// Forget the previous layer's groups (only the experts it used are touched).
    pub fn clear(&mut self) {
        for &e in &self.active {
            self.token_idx[e].clear();
            self.token_weight[e].clear();
        }
        self.active.clear();
    }

    /// Row `row` goes to `expert` with routing weight `weight`.
    #[inline]
    pub fn push(&mut self, expert: usize, row: u32, weight: f32) {
        if self.token_idx[expert].is_empty() {
            self.active.push(expert);
        }
        self.token_idx[expert].push(row);
        self.token_weight[expert].push(weight);
    }

    /// `out[row] += weight * FFN_e(x[row])` for every grouped entry, on `pool`'s first
    /// `participants` threads; each matrix read in its own dtype.
    pub fn run(
        &mut self,
        model: &Model,
        run: &GroupRun<'_>,
        pool: &mut ColdPool,
        participants: usize,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        let c = model.config();
        let (hidden, ff) = (c.hidden, c.expert_ff);
        let mut work = recycle(std::mem::take(&mut self.work_storage));
        for &e in &self.active {
            let w = model.expert(run.layer_idx, e);
            work.push(ColdExpertWork {
                weights: ExpertWeights {
                    gate: w.gate.data,
                    up: w.up.data,
                    down: w.down.data,
                    dtype: kernel_dtype(w.gate.dtype),
                    down_dtype: kernel_dtype(w.down.dtype),
                    hidden,
                    ff,
                    bias: crate::moe::expert_math::kernel_bias(model, run.layer_idx, e),
                },
                token_idx: &self.token_idx[e],
                token_weight: &self.token_weight[e],
            });
        }
        let job = ColdJob {
            level: run.level,
            activations: run.activations,
            act: run.act,
            hidden,
            ff,
            x: run.x,
            experts: &work,
        };
        let result = pool.run_on(participants, &job, out);
        self.work_storage = unrecycle(work);
        result
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
