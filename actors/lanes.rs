//! The lanes: the [`HotLane`] interface with its CPU implementation, the cold-lane worker, and
//! the thread loops that run them behind bounded channels.
//!
//! Both lanes share [`run_entries`]: walk a section's entries, group consecutive entries of the
//! same expert (at most [`GROUP_TOKENS_MAX`] tokens), gather their inputs, run the expert FFN
//! once per group, then write one unweighted row per entry or accumulate `weight * y` into
//! token rows (reduce).

use super::faults::act_out;
use super::messages::*;
use crate::cache::hot_set::HotSet;
use crate::format::dtype::DType;
use crate::model::arch::FfnActivation;
use crate::model::Model;
use crate::moe::expert_math::{ffn_plain, ExpertBytes, ExpertKernel, FfnDims, FfnScratch};
use crossbeam_channel::{Receiver, Sender};
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

/// A hot lane: computes the hot slots of its worklist section from its cached expert copies.
/// The CPU implementation below is used without a GPU and by tests; a CUDA lane implements the
/// same trait.
pub trait HotLane: Send {
    /// Compute entries `range` of hot section `lane_idx` of `input.worklist` into `out`
    /// (see [`LaneTask`] for the row layout).
    fn run(
        &mut self,
        lane_idx: usize,
        input: &LayerInput,
        range: Range<usize>,
        reduce_into_tokens: bool,
        out: &mut LaneBuffer,
    ) -> Result<(), LaneError>;

    /// Load expert `expert_idx` of layer `layer_idx` into cache slot `slot_idx` (replacing
    /// whatever it held). Called between forward calls only.
    fn load_slot(&mut self, layer_idx: usize, slot_idx: u32, expert_idx: usize) -> Result<(), LaneError>;
}

/// One cached expert copy (raw bytes, same dtype as the file).
struct CachedExpert {
    dtype: DType,
    down_dtype: DType,
    gate: Vec<u8>,
    up: Vec<u8>,
    down: Vec<u8>,
    /// gate, up and down biases (GPT-OSS).
    bias: Option<[Vec<f32>; 3]>,
}

/// The CPU hot lane: per layer and slot, an owned copy of the expert's bytes (the "VRAM cache"
/// of a machine without a GPU).
pub struct CpuHotLane {
    lane_idx: u8,
    model: Arc<Model>,
    dims: FfnDims,
    activation: FfnActivation,
    /// `slots[layer][slot]`
    slots: Vec<Vec<Option<CachedExpert>>>,
    scratch: FfnScratch,
}

impl CpuHotLane {
    /// A lane caching the experts `hot_set` assigns to lane `lane_idx`.
    pub fn new(model: Arc<Model>, hot_set: &HotSet, lane_idx: usize) -> Result<CpuHotLane, LaneError> {
        let c = model.config();
        let dims = FfnDims { hidden: c.hidden, ff: c.expert_ff };
        let mut lane = CpuHotLane {
            lane_idx: lane_idx as u8,
            activation: model.plan().expert_activation(),
            dims,
            slots: Vec::with_capacity(hot_set.layers.len()),
            scratch: FfnScratch::new(dims, GROUP_TOKENS_MAX),
            model,
        };
        for (layer_idx, layer) in hot_set.layers.iter().enumerate() {
            let ids = layer.slots.get(lane_idx).cloned().unwrap_or_default();
            lane.slots.push((0..ids.len()).map(|_| None).collect());
            for (slot_idx, e) in ids.into_iter().enumerate() {
                lane.load_slot(layer_idx, slot_idx as u32, e as usize)?;
            }
        }
        Ok(lane)
    }

    fn id(&self) -> LaneId {
        LaneId::Hot(self.lane_idx)
    }
}

impl HotLane for CpuHotLane {
    fn run(
        &mut self,
        lane_idx: usize,
        input: &LayerInput,
        range: Range<usize>,
        reduce: bool,
        out: &mut LaneBuffer,
    ) -> Result<(), LaneError> {
        let s = &input.worklist.hot[lane_idx];
        let id = self.id();
        let layer_idx = input.layer_idx;
        let (dims, activation) = (self.dims, self.activation);
        let slots = &self.slots[layer_idx];
        run_entries(
            input,
            range,
            |i| (s.hot_id[i], s.hot_token_id[i], s.hot_weight[i]),
            reduce,
            out,
            &mut self.scratch,
            |slot_idx, n, scratch| {
                let c = slots
                    .get(slot_idx as usize)
                    .and_then(Option::as_ref)
                    .ok_or(LaneError::EmptySlot { lane: id, layer_idx, slot_idx })?;
                let w = ExpertBytes {
                    dtype: c.dtype,
                    down_dtype: c.down_dtype,
                    gate: &c.gate,
                    up: &c.up,
                    down: &c.down,
                    bias: c.bias.as_ref().map(|[gate, up, down]| {
                        crate::model::expert_extras::ExpertBiasRef { gate, up, down }
                    }),
                };
                ffn_plain(w, dims, activation, n, scratch)
                    .map_err(|e| LaneError::Failed { lane: id, reason: e.to_string() })
            },
        )
    }

    fn load_slot(&mut self, layer_idx: usize, slot_idx: u32, expert_idx: usize) -> Result<(), LaneError> {
        let e = self.model.expert(layer_idx, expert_idx);
        let copy = CachedExpert {
            dtype: e.gate.dtype,
            down_dtype: e.down.dtype,
            gate: e.gate.data.to_vec(),
            up: e.up.data.to_vec(),
            down: e.down.data.to_vec(),
            bias: self
                .model
                .expert_bias(layer_idx, expert_idx)
                .map(|b| [b.gate.to_vec(), b.up.to_vec(), b.down.to_vec()]),
        };
        let id = self.id();
        let layer = &mut self.slots[layer_idx];
        let slot = slot_idx as usize;
        if slot >= layer.len() {
            return Err(LaneError::Failed {
                lane: id,
                reason: format!("slot {slot_idx} beyond the {} allocated in layer {layer_idx}", layer.len()),
            });
        }
        layer[slot] = Some(copy);
        Ok(())
    }
}

/// Walk entries `range`, computing each group of consecutive same-key entries once.
/// `entry(i) = (key, token, weight)`; `compute(key, n, scratch)` fills `scratch.ys[..n * hidden]`
/// from `scratch.xs[..n * hidden]`.
pub fn run_entries(
    input: &LayerInput,
    range: Range<usize>,
    entry: impl Fn(usize) -> (u32, u32, f32),
    reduce: bool,
    out: &mut LaneBuffer,
    scratch: &mut FfnScratch,
    mut compute: impl FnMut(u32, usize, &mut FfnScratch) -> Result<(), LaneError>,
) -> Result<(), LaneError> {
    let hidden = input.hidden;
    let n_entries = range.len();
    if reduce {
        let rows = &mut out.token_rows;
        if rows.len() < input.n_tokens * hidden {
            rows.resize(input.n_tokens * hidden, 0.0);
        }
        rows[..input.n_tokens * hidden].iter_mut().for_each(|v| *v = 0.0);
    } else if out.entry_rows.len() < n_entries * hidden {
        out.entry_rows.resize(n_entries * hidden, 0.0);
    }
    let mut i = range.start;
    while i < range.end {
        let (key, _, _) = entry(i);
        let mut n = 0;
        while i + n < range.end && n < GROUP_TOKENS_MAX && entry(i + n).0 == key {
            let token = entry(i + n).1 as usize;
            scratch.xs[n * hidden..(n + 1) * hidden]
                .copy_from_slice(&input.x[token * hidden..(token + 1) * hidden]);
            n += 1;
        }
        compute(key, n, scratch)?;
        for g in 0..n {
            let (_, token, weight) = entry(i + g);
            let y = &scratch.ys[g * hidden..(g + 1) * hidden];
            if reduce {
                let row = &mut out.token_rows[token as usize * hidden..(token as usize + 1) * hidden];
                for (r, v) in row.iter_mut().zip(y) {
                    *r += weight * v;
                }
            } else {
                let row_idx = i + g - range.start;
                out.entry_rows[row_idx * hidden..(row_idx + 1) * hidden].copy_from_slice(y);
            }
        }
        i += n;
    }
    Ok(())
}

/// Run one cold-lane task with `compute` (the cold lane's plain kernels or a drop-in).
pub fn run_cold_task(
    compute: &dyn ExpertKernel,
    lane: LaneId,
    input: &LayerInput,
    range: Range<usize>,
    reduce: bool,
    out: &mut LaneBuffer,
    scratch: &mut FfnScratch,
) -> Result<(), LaneError> {
    let wl = &input.worklist;
    let layer_idx = input.layer_idx;
    run_entries(
        input,
        range,
        |i| (wl.cold_id[i], wl.cold_token_id[i], wl.cold_weight[i]),
        reduce,
        out,
        scratch,
        |expert, n, scratch| {
            compute
                .expert_ffn(layer_idx, expert as usize, n, scratch)
                .map_err(|e| LaneError::Failed { lane, reason: e.to_string() })
        },
    )
}

fn finish(
    lane: LaneId,
    task: LaneTask,
    started_at: Instant,
    out: LaneBuffer,
    result: Result<(), LaneError>,
) -> LaneDone {
    let (call_idx, layer_idx) = (task.input.call_idx, task.input.layer_idx);
    // `task` (and its Arc of the layer input) is dropped here, before the join hears of it.
    drop(task);
    LaneDone { lane, call_idx, layer_idx, started_at, finished_at: Instant::now(), out, result }
}

/// The hot lane thread: runs tasks and slot exchanges until `Stop` or the channel closes.
pub fn hot_lane_loop(
    lane_idx: usize,
    mut lane: Box<dyn HotLane>,
    rx: Receiver<HotMsg>,
    done: Sender<LaneDone>,
    spin: std::time::Duration,
) {
    let id = LaneId::Hot(lane_idx as u8);
    while let Ok(msg) = recv_spin(&rx, spin, None) {
        match msg {
            HotMsg::Task(mut task) => {
                let started_at = Instant::now();
                let mut out = std::mem::take(&mut task.out);
                let range = task.range.clone();
                let reduce = task.reduce_into_tokens;
                let (input, fault) = (&task.input, task.fault);
                let result = catch_unwind(AssertUnwindSafe(|| {
                    act_out(fault, id)?;
                    lane.run(lane_idx, input, range, reduce, &mut out)
                }))
                .unwrap_or_else(|p| Err(LaneError::panicked(id, p)));
                if done.send(finish(id, task, started_at, out, result)).is_err() {
                    return;
                }
            }
            HotMsg::Exchange { layer_idx, slot_idx, expert_idx, reply } => {
                let result =
                    catch_unwind(AssertUnwindSafe(|| lane.load_slot(layer_idx, slot_idx, expert_idx)))
                        .unwrap_or_else(|p| Err(LaneError::panicked(id, p)));
                let _ = reply.send(result);
            }
            HotMsg::Stop => return,
        }
    }
}

/// A cold-pool worker thread.
pub fn cold_worker_loop(
    worker_idx: usize,
    compute: Arc<dyn ExpertKernel>,
    rx: Receiver<ColdMsg>,
    done: Sender<LaneDone>,
    spin: std::time::Duration,
) {
    let id = LaneId::Cold(worker_idx as u8);
    let mut scratch = FfnScratch::new(compute.dims(), GROUP_TOKENS_MAX);
    while let Ok(msg) = recv_spin(&rx, spin, None) {
        match msg {
            ColdMsg::Task(mut task) => {
                let started_at = Instant::now();
                let mut out = std::mem::take(&mut task.out);
                let range = task.range.clone();
                let reduce = task.reduce_into_tokens;
                let (input, fault) = (&task.input, task.fault);
                let result = catch_unwind(AssertUnwindSafe(|| {
                    act_out(fault, id)?;
                    run_cold_task(&*compute, id, input, range, reduce, &mut out, &mut scratch)
                }))
                .unwrap_or_else(|p| Err(LaneError::panicked(id, p)));
                if done.send(finish(id, task, started_at, out, result)).is_err() {
                    return;
                }
            }
            ColdMsg::Stop => return,
        }
    }
}
