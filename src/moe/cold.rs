//! The cold lane: the one boundary both engines call for the routed experts that are not hot
//! (the CPU pipeline's join for its cold section, the GPU engine for the experts not in the VRAM
//! cache), the one all-cold fallback, and a plain CPU implementation (f32 math straight from the
//! model's expert bytes) that serves as the test oracle and as the last resort when the fast cold
//! lane itself fails. The fast implementation is [`crate::moe::pool_lane::PoolLane`].

use crate::format::tensor::TensorRef;
use crate::model::Model;
use moe_lanes_kernels::KernelError;
use std::sync::Arc;

/// One cold routed slot: add `weight * expert(hidden_rows[row_idx])` into `out_rows[row_idx]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ColdSlot {
    /// Row in the `hidden_rows` / `out_rows` handed to [`ColdLane::compute`].
    pub row_idx: usize,
    /// Original expert id in the layer.
    pub expert_idx: usize,
    /// Routing weight.
    pub weight: f32,
}

/// Why a cold lane could not be built or could not compute its slots. At run time the engine
/// falls back (counted by reason).
#[derive(Debug, thiserror::Error)]
pub enum ColdError {
    #[error("cold lane: {source}")]
    Setup { source: KernelError },
    #[error("cold lane, layer {layer_idx}: {source}")]
    Kernel { layer_idx: usize, source: KernelError },
    #[error("cold lane, layer {layer_idx}: injected fault")]
    Injected { layer_idx: usize },
    #[error("cold lane, layer {layer_idx}: panicked")]
    Panicked { layer_idx: usize },
    #[error("cold lane, layer {layer_idx}: {source}")]
    Compute { layer_idx: usize, source: crate::moe::expert_math::ComputeError },
}

/// Computes the cold slots of one MoE layer on the CPU while the hot lane(s) compute the hot ones.
pub trait ColdLane {
    /// `hidden_rows` is `[n_rows, hidden]` (the FFN-normed rows of the tokens that have cold
    /// slots, compacted or not); `out_rows` is the same shape, zero on entry. For every slot, add
    /// `weight * down(act(gate(x)) * up(x))` of the slot's row into the same row of `out_rows`.
    /// The order of additions must not depend on how many threads run it.
    fn compute(
        &mut self,
        layer_idx: usize,
        hidden_rows: &[f32],
        slots: &[ColdSlot],
        out_rows: &mut [f32],
    ) -> Result<(), ColdError>;
}

/// The one all-cold fallback of both engines: every routed slot of layer `layer_idx` computed by
/// `lane` into `out` (`[n_rows, hidden]`, overwritten), from `rows` (`[n_rows, hidden]`);
/// `routes` yields each row's `k` (expert, weight) pairs, row after row. Each row's slots are
/// added in routing order. `slots` is the caller's reused list.
pub fn all_cold(
    lane: &mut dyn ColdLane,
    layer_idx: usize,
    rows: &[f32],
    routes: impl IntoIterator<Item = (usize, f32)>,
    k: usize,
    slots: &mut Vec<ColdSlot>,
    out: &mut [f32],
) -> Result<(), ColdError> {
    slots.clear();
    let with_rows = routes.into_iter().enumerate();
    slots.extend(with_rows.map(|(i, (expert_idx, weight))| ColdSlot { row_idx: i / k, expert_idx, weight }));
    out.fill(0.0);
    lane.compute(layer_idx, rows, slots, out)
}

/// A simple, obviously-right CPU cold lane: decodes weight rows to f32 as it goes (no caching,
/// no SIMD, single-threaded). For tests and as the fallback, not for speed.
pub struct PlainColdLane {
    model: Arc<Model>,
    row: Vec<f32>,
    h: Vec<f32>,
    /// Slots computed so far (all layers).
    pub slots_computed: u64,
}

impl PlainColdLane {
    pub fn new(model: Arc<Model>) -> PlainColdLane {
        let c = model.config();
        let (row, h) = (vec![0.0; c.hidden.max(c.expert_ff)], vec![0.0; c.expert_ff]);
        PlainColdLane { model, row, h, slots_computed: 0 }
    }
}

fn row_dot(t: &TensorRef<'_>, row: usize, x: &[f32], buf: &mut [f32]) -> f32 {
    let buf = &mut buf[..x.len()];
    t.read_f32_into(row * x.len(), buf).expect("expert tensor validated at open (rows are whole blocks)");
    buf.iter().zip(x).map(|(a, b)| a * b).sum()
}

fn gated(model: &Model, g: f32, u: f32) -> f32 {
    model.plan().expert_activation().kernel().gated(g, u)
}

impl ColdLane for PlainColdLane {
    fn compute(
        &mut self,
        layer_idx: usize,
        hidden_rows: &[f32],
        slots: &[ColdSlot],
        out_rows: &mut [f32],
    ) -> Result<(), ColdError> {
        let c = self.model.config();
        let (hidden, ff) = (c.hidden, c.expert_ff);
        for slot in slots {
            let e = self.model.expert(layer_idx, slot.expert_idx);
            let x = &hidden_rows[slot.row_idx * hidden..][..hidden];
            let bias = self.model.expert_bias(layer_idx, slot.expert_idx);
            for r in 0..ff {
                let g = row_dot(&e.gate, r, x, &mut self.row);
                let u = row_dot(&e.up, r, x, &mut self.row);
                let (g, u) = bias.map_or((g, u), |b| (g + b.gate[r], u + b.up[r]));
                self.h[r] = gated(&self.model, g, u);
            }
            let out = &mut out_rows[slot.row_idx * hidden..][..hidden];
            for (d, o) in out.iter_mut().enumerate() {
                let y = row_dot(&e.down, d, &self.h, &mut self.row);
                *o += slot.weight * bias.map_or(y, |b| y + b.down[d]);
            }
            self.slots_computed += 1;
        }
        Ok(())
    }
}
