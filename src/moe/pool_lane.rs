//! The CPU pipeline's cold lane on its shared pool: a layer's cold section grouped by expert
//! (each expert's weights read once per layer) and run as one [`ColdJob`] on the pinned pool the
//! dense stage uses, the driver as thread 0. Every participant streams rows of every expert (the
//! pool splits experts by rows), so one decode token's 8 cold experts keep all cores reading,
//! where one expert per lane thread would keep only 8 busy; and no thread changes pools between
//! the dense stage and the lanes, so nobody parks and wakes per layer.
//!
//! The pool's accumulation order is fixed (experts in first-seen order of the section, their
//! tokens in entry order), so the result is the same bits for any thread count. Steady state
//! allocates nothing: the token lists are reused and the job's expert list is recycled through an
//! in-place `collect` (same layout, new lifetime).

use crate::model::adapter::FfnActivation;
use crate::model::Model;
use crate::moe::expert_math::kernel_dtype;
use crate::moe::worklist::Worklist;
use moe_lanes_kernels::{
    Activation, ColdExpertWork, ColdJob, ColdPool, ExpertWeights, KernelError, SimdLevel,
};
use std::ops::Range;
use std::sync::Arc;

/// The grouping state of the pool cold lane (the pool itself belongs to the dense stage).
pub struct PoolLane {
    model: Arc<Model>,
    level: SimdLevel,
    act: Activation,
    /// Per expert: the section's rows routed to it in this layer, and their weights.
    token_idx: Vec<Vec<u32>>,
    token_weight: Vec<Vec<f32>>,
    /// Experts with at least one entry in this layer, in first-seen order.
    active: Vec<usize>,
    work_storage: Vec<ColdExpertWork<'static>>,
}

impl PoolLane {
    /// The pool's kernels read every expert dtype (floats and GGML blocks, per matrix).
    pub fn new(model: Arc<Model>, level: SimdLevel) -> PoolLane {
        let act = match model.adapter().activation {
            FfnActivation::Silu => Activation::Silu,
            // The plain kernel's GELU is the tanh form; all cold kernels agree on it.
            FfnActivation::Gelu => Activation::GeluTanh,
        };
        let n_experts = model.config().n_experts;
        PoolLane {
            model,
            level,
            act,
            token_idx: vec![Vec::new(); n_experts],
            token_weight: vec![Vec::new(); n_experts],
            active: Vec::with_capacity(n_experts),
            work_storage: Vec::with_capacity(n_experts),
        }
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
        self.group(wl, range);
        let c = self.model.config();
        let (hidden, ff) = (c.hidden, c.expert_ff);
        let mut work = recycle(std::mem::take(&mut self.work_storage));
        for &e in &self.active {
            let w = self.model.expert(layer_idx, e);
            work.push(ColdExpertWork {
                weights: ExpertWeights {
                    gate: w.gate.data,
                    up: w.up.data,
                    down: w.down.data,
                    dtype: kernel_dtype(w.gate.dtype),
                    down_dtype: kernel_dtype(w.down.dtype),
                    hidden,
                    ff,
                },
                token_idx: &self.token_idx[e],
                token_weight: &self.token_weight[e],
            });
        }
        let job = ColdJob { level: self.level, act: self.act, hidden, ff, x, experts: &work };
        let result = pool.run_on(participants, &job, token_rows);
        self.work_storage = unrecycle(work);
        result
    }

    fn group(&mut self, wl: &Worklist, range: Range<usize>) {
        for &e in &self.active {
            self.token_idx[e].clear();
            self.token_weight[e].clear();
        }
        self.active.clear();
        for i in range {
            let e = wl.cold_id[i] as usize;
            if self.token_idx[e].is_empty() {
                self.active.push(e);
            }
            self.token_idx[e].push(wl.cold_token_id[i]);
            self.token_weight[e].push(wl.cold_weight[i]);
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
