//! The lane set and the Join: starts the HotLane and ColdPool threads, sends each layer's tasks,
//! waits for the lanes, merges their outputs and reads timings off the message timestamps.
//!
//! Merge: every slot `t * k + j` lives either in a lane's entry rows (unweighted) or was already
//! reduced into that lane's token rows. The join writes, per token, `sum_j w_j * row_j` over the
//! non-reduced slots in slot order (the same order as the reference, so a slot-row merge is
//! bit-identical to it), then adds the token rows of every lane that reduced.

use super::faults::{LaneFault, LaneFaultSchedule};
use super::lanes::{cold_worker_loop, hot_lane_loop, HotLane};
use super::messages::*;
use crate::cache::hot_set::MAX_HOT_LANES;
use crate::cache::perf::{FallbackReason, LayerTiming};
use crate::moe::cold::{ColdLane, ColdSlot};
use crate::moe::expert_math::ExpertKernel;
use crate::moe::faults::LayerFailure;
use crate::moe::phase::MergeKind;
use crate::moe::worklist::Worklist;
use crossbeam_channel::{bounded, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

struct Lane<M> {
    /// `None`: this cold share runs inline on the driver (cold participant 0).
    tx: Option<Sender<M>>,
    thread: Option<JoinHandle<()>>,
    /// The lane's buffer while it is at home (None while a task holds it, or after it was lost).
    buf: Option<LaneBuffer>,
}

/// Where a slot's row is: lane buffer index (hot lanes first, then cold workers), row, weight.
#[derive(Debug, Clone, Copy, Default)]
struct SlotLoc {
    buffer: u16,
    row: u32,
    weight: f32,
    reduced: bool,
}

/// The running lanes of one engine.
pub struct LaneSet {
    hot: Vec<Lane<HotMsg>>,
    cold: Vec<Lane<ColdMsg>>,
    done_rx: Receiver<LaneDone>,
    input: Arc<LayerInput>,
    hidden: usize,
    max_tokens: usize,
    k: usize,
    slot_locs: Vec<SlotLoc>,
    /// Poll window of the join before parking.
    spin: std::time::Duration,
    /// The driver's own cold share (participant 0), when it takes one: compute and scratch.
    driver_cold: Option<(Arc<dyn ExpertKernel>, crate::moe::expert_math::FfnScratch)>,
    /// Buffer index -> reduced this layer (hot lanes first, then cold workers).
    reduced: Vec<bool>,
    /// Where each buffer's rows came back this layer (indexes into `returned`).
    returned: Vec<Option<LaneBuffer>>,
    /// How long the join waits for the lanes of one layer.
    timeout: std::time::Duration,
    /// Seeded faults to inject (fault tests only), and the log of those injected.
    faults: Option<LaneFaultSchedule>,
    injected: Vec<InjectedFault>,
    /// Layers refused because a lane that timed out still held the layer input.
    busy_refusals: u64,
    /// The cold section handed to a driver-side [`ColdLane`], as its slots (reused).
    section_slots: Vec<ColdSlot>,
}

/// One fault the join injected into a lane task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InjectedFault {
    pub call_idx: u64,
    pub layer_idx: usize,
    pub lane: LaneId,
    pub fault: LaneFault,
}

impl LaneSet {
    /// Start one thread per hot lane and `n_cold_workers` cold workers, polling before parking
    /// only when the machine has a core for every lane thread and the driver (see [`LANE_SPIN`]).
    pub fn start(
        hot_lanes: Vec<Box<dyn HotLane>>,
        cold: Arc<dyn ExpertKernel>,
        n_cold_workers: usize,
        max_tokens: usize,
        k: usize,
        n_experts: usize,
    ) -> LaneSet {
        // Lane threads plus the driver, which is cold participant 0.
        let n_threads = hot_lanes.len() + n_cold_workers.clamp(1, MAX_COLD_WORKERS);
        let n_cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let spin = if n_cores >= n_threads { LANE_SPIN } else { std::time::Duration::ZERO };
        Self::start_with(hot_lanes, cold, n_cold_workers, max_tokens, k, n_experts, spin, true)
    }

    /// [`LaneSet::start`] with an explicit poll window for lanes and join (zero: park at once)
    /// and the choice whether the driver computes cold share 0 itself while it would otherwise
    /// wait (`driver_cold`: then `n_cold_workers` counts the driver and one thread fewer is
    /// started, which saves a thread wake-up per layer).
    #[allow(clippy::too_many_arguments)]
    pub fn start_with(
        hot_lanes: Vec<Box<dyn HotLane>>,
        cold: Arc<dyn ExpertKernel>,
        n_cold_workers: usize,
        max_tokens: usize,
        k: usize,
        n_experts: usize,
        spin: std::time::Duration,
        driver_cold: bool,
    ) -> LaneSet {
        assert!(!hot_lanes.is_empty() && hot_lanes.len() <= MAX_HOT_LANES, "1..=3 hot lanes");
        let n_cold_workers = n_cold_workers.clamp(1, MAX_COLD_WORKERS);
        let hidden = cold.dims().hidden;
        let capacity = max_tokens * k;
        let (done_tx, done_rx) = bounded(MAX_HOT_LANES + n_cold_workers + LANE_MAILBOX_CAPACITY);
        let buffer = |rows: usize| LaneBuffer {
            entry_rows: vec![0.0; rows * hidden],
            token_rows: vec![0.0; max_tokens * hidden],
        };
        let hot = hot_lanes
            .into_iter()
            .enumerate()
            .map(|(i, lane)| {
                let (tx, rx) = bounded(LANE_MAILBOX_CAPACITY);
                let done = done_tx.clone();
                let thread = std::thread::Builder::new()
                    .name(format!("moe-hot-{i}"))
                    .spawn(move || hot_lane_loop(i, lane, rx, done, spin))
                    .expect("spawn hot lane thread");
                Lane { tx: Some(tx), thread: Some(thread), buf: Some(buffer(capacity)) }
            })
            .collect::<Vec<_>>();
        let per_worker = capacity.div_ceil(n_cold_workers);
        let cold_lanes = (0..n_cold_workers)
            .map(|w| {
                if w == 0 && driver_cold {
                    return Lane { tx: None, thread: None, buf: Some(buffer(per_worker)) };
                }
                let (tx, rx) = bounded(LANE_MAILBOX_CAPACITY);
                let done = done_tx.clone();
                let compute = cold.clone();
                let thread = std::thread::Builder::new()
                    .name(format!("moe-cold-{w}"))
                    .spawn(move || cold_worker_loop(w, compute, rx, done, spin))
                    .expect("spawn cold worker thread");
                Lane { tx: Some(tx), thread: Some(thread), buf: Some(buffer(per_worker)) }
            })
            .collect::<Vec<_>>();
        let n_buffers = MAX_HOT_LANES + n_cold_workers;
        LaneSet {
            input: Arc::new(LayerInput {
                call_idx: 0,
                layer_idx: 0,
                n_tokens: 0,
                hidden,
                x: vec![0.0; max_tokens * hidden],
                worklist: Worklist::new(max_tokens, k, n_experts),
            }),
            hot,
            cold: cold_lanes,
            done_rx,
            hidden,
            max_tokens,
            k,
            slot_locs: vec![SlotLoc::default(); capacity],
            spin,
            driver_cold: driver_cold.then(|| {
                (cold.clone(), crate::moe::expert_math::FfnScratch::new(cold.dims(), GROUP_TOKENS_MAX))
            }),
            reduced: vec![false; n_buffers],
            returned: (0..n_buffers).map(|_| None).collect(),
            timeout: LANE_TIMEOUT,
            faults: None,
            injected: Vec::new(),
            busy_refusals: 0,
            section_slots: Vec::with_capacity(capacity),
        }
    }

    /// Wait at most `timeout` for the lanes of a layer (default [`LANE_TIMEOUT`]).
    pub fn set_timeout(&mut self, timeout: std::time::Duration) {
        assert!(!timeout.is_zero(), "a zero lane timeout fails every layer");
        self.timeout = timeout;
    }

    /// Inject the faults of `schedule` into the lane tasks sent from now on.
    pub fn set_fault_schedule(&mut self, schedule: Option<LaneFaultSchedule>) {
        self.faults = schedule;
    }

    /// The faults injected so far, and how many layers were refused because a lane that timed
    /// out still held the layer input.
    pub fn fault_log(&self) -> (&[InjectedFault], u64) {
        (&self.injected, self.busy_refusals)
    }

    /// The fault of `lane`'s task in the current layer, logged; `None` without a schedule.
    fn draw_fault(&mut self, lane: LaneId, can_stall: bool) -> Option<(LaneFault, std::time::Duration)> {
        let schedule = self.faults?;
        let (call_idx, layer_idx) = (self.input.call_idx, self.input.layer_idx);
        let fault = schedule.fault(call_idx, layer_idx, lane.into(), can_stall)?;
        self.injected.push(InjectedFault { call_idx, layer_idx, lane, fault });
        Some((fault, schedule.stall))
    }

    pub fn n_hot_lanes(&self) -> usize {
        self.hot.len()
    }

    pub fn n_cold_workers(&self) -> usize {
        self.cold.len()
    }

    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// The layer input to fill before [`LaneSet::run_layer`]; `None` if a lane still holds it
    /// (only after a lane timed out).
    pub fn input_mut(&mut self) -> Option<&mut LayerInput> {
        if Arc::get_mut(&mut self.input).is_none() {
            self.busy_refusals += 1;
            return None;
        }
        Arc::get_mut(&mut self.input)
    }

    pub fn input(&self) -> &LayerInput {
        &self.input
    }

    /// Ask hot lane `lane_idx` to load an expert into a slot and wait for it (between calls).
    pub fn load_slot(
        &self,
        lane_idx: usize,
        layer_idx: usize,
        slot_idx: u32,
        expert_idx: usize,
    ) -> Result<(), LaneError> {
        let lane = LaneId::Hot(lane_idx as u8);
        let (reply, rx) = bounded(1);
        self.hot
            .get(lane_idx)
            .ok_or(LaneError::Disconnected { lane })?
            .tx
            .as_ref()
            .ok_or(LaneError::Disconnected { lane })?
            .send(HotMsg::Exchange { layer_idx, slot_idx, expert_idx, reply })
            .map_err(|_| LaneError::Disconnected { lane })?;
        rx.recv_timeout(self.timeout).map_err(|_| LaneError::Disconnected { lane })?
    }

    /// Run the layer described by [`LaneSet::input`]: send the lanes their tasks, run
    /// `overlap_work` on this thread meanwhile, wait, merge into `out` (`[n_tokens, hidden]`,
    /// overwritten) and fill `timing`.
    pub fn run_layer(
        &mut self,
        merge: MergeKind,
        compact_cold_reduce: bool,
        out: &mut [f32],
        timing: &mut LayerTiming,
        overlap_work: impl FnOnce(),
    ) -> Result<(), LayerFailure> {
        self.run_layer_with(merge, compact_cold_reduce, out, timing, overlap_work, None)
    }

    /// [`LaneSet::run_layer`] where `section`, when given, is the cold lane that computes the
    /// driver's cold share (the whole cold section when the set has no cold worker threads)
    /// reduced into token rows, in place of the per-expert
    /// [`crate::moe::expert_math::ExpertKernel`] kernels; faults drawn for cold participant 0
    /// apply to it as to the driver's share.
    pub fn run_layer_with(
        &mut self,
        merge: MergeKind,
        compact_cold_reduce: bool,
        out: &mut [f32],
        timing: &mut LayerTiming,
        overlap_work: impl FnOnce(),
        section: Option<&mut dyn ColdLane>,
    ) -> Result<(), LayerFailure> {
        let sent_at = Instant::now();
        let hot_reduce = merge == MergeKind::ReduceMerge;
        let cold_reduce = section.is_some() || compact_cold_reduce || merge == MergeKind::ReduceMerge;
        let mut failure: Option<LayerFailure> = None;
        self.reduced.iter_mut().for_each(|r| *r = false);
        let mut n_sent = self.send_hot(sent_at, hot_reduce, &mut failure);
        let (n_cold_sent, driver_range) = self.send_cold(sent_at, cold_reduce, &mut failure);
        n_sent += n_cold_sent;
        let mut windows = LaneWindows::default();
        if let Some(w) = self.run_driver_share(driver_range, cold_reduce, section, &mut failure) {
            windows.cold = Some(w);
        }
        overlap_work();
        let wait_from = Instant::now();
        self.join_lanes(n_sent, &mut windows, &mut failure);
        let joined_at = Instant::now();
        if let Some(f) = failure {
            self.send_buffers_home();
            return Err(f);
        }
        self.merge(self.input.n_tokens, out);
        self.send_buffers_home();
        windows.fill(timing, sent_at, wait_from, joined_at, Instant::now());
        Ok(())
    }

    /// Send each busy hot lane its section. Returns how many tasks went out.
    fn send_hot(&mut self, sent_at: Instant, reduce: bool, failure: &mut Option<LayerFailure>) -> usize {
        let mut n_sent = 0;
        for lane_idx in 0..self.hot.len() {
            let count = self.input.worklist.hot[lane_idx].hot_count;
            if count == 0 {
                continue;
            }
            let fault = self.draw_fault(LaneId::Hot(lane_idx as u8), true);
            let lane = &mut self.hot[lane_idx];
            let out = lane.buf.take().unwrap_or_else(|| fresh_buffer(count, self.max_tokens, self.hidden));
            let task = LaneTask {
                input: self.input.clone(),
                range: 0..count,
                reduce_into_tokens: reduce,
                out,
                sent_at,
                fault,
            };
            let tx = lane.tx.as_ref().expect("hot lanes have threads");
            match tx.try_send(HotMsg::Task(task)) {
                Ok(()) => {
                    n_sent += 1;
                    self.reduced[lane_idx] = reduce;
                }
                Err(e) => {
                    if let HotMsg::Task(t) = e.into_inner() {
                        lane.buf = Some(t.out);
                    }
                    failure.get_or_insert(LayerFailure::new(
                        FallbackReason::LaneUnavailable,
                        format!("hot lane {lane_idx} does not accept tasks"),
                    ));
                }
            }
        }
        n_sent
    }

    /// Split the cold prefix evenly over the workers and send their shares; the driver's share
    /// (worker 0 without a thread) is returned, not sent. Returns (tasks sent, driver range).
    fn send_cold(
        &mut self,
        sent_at: Instant,
        reduce: bool,
        failure: &mut Option<LayerFailure>,
    ) -> (usize, std::ops::Range<usize>) {
        let cold_count = self.input.worklist.cold_count;
        let chunk = cold_count.div_ceil(self.cold.len()).max(1);
        let (mut n_sent, mut driver_range) = (0, 0..0);
        for w in 0..self.cold.len() {
            let range = (w * chunk).min(cold_count)..((w + 1) * chunk).min(cold_count);
            if range.is_empty() {
                continue;
            }
            if self.cold[w].tx.is_none() {
                driver_range = range;
                continue;
            }
            let fault = self.draw_fault(LaneId::Cold(w as u8), true);
            let lane = &mut self.cold[w];
            let tx = lane.tx.as_ref().expect("checked above");
            let out =
                lane.buf.take().unwrap_or_else(|| fresh_buffer(range.len(), self.max_tokens, self.hidden));
            let task = LaneTask {
                input: self.input.clone(),
                range,
                reduce_into_tokens: reduce,
                out,
                sent_at,
                fault,
            };
            match tx.try_send(ColdMsg::Task(task)) {
                Ok(()) => {
                    n_sent += 1;
                    self.reduced[MAX_HOT_LANES + w] = reduce;
                }
                Err(e) => {
                    if let ColdMsg::Task(t) = e.into_inner() {
                        lane.buf = Some(t.out);
                    }
                    failure.get_or_insert(LayerFailure::of_cold_lane(
                        FallbackReason::LaneUnavailable,
                        format!("cold worker {w} does not accept tasks"),
                    ));
                }
            }
        }
        (n_sent, driver_range)
    }

    /// The driver's own cold share, computed while the lanes run. Returns its time window.
    fn run_driver_share(
        &mut self,
        range: std::ops::Range<usize>,
        reduce: bool,
        section: Option<&mut dyn ColdLane>,
        failure: &mut Option<LayerFailure>,
    ) -> Option<(Instant, Instant)> {
        if range.is_empty() {
            return None;
        }
        self.driver_cold.as_ref()?;
        let fault = self.draw_fault(LaneId::Cold(0), false);
        let (compute, scratch) = self.driver_cold.as_mut()?;
        let started_at = Instant::now();
        let mut out = self.cold[0]
            .buf
            .take()
            .unwrap_or_else(|| fresh_buffer(range.len(), self.max_tokens, self.hidden));
        let (id, input, slots) = (LaneId::Cold(0), &self.input, &mut self.section_slots);
        // A panic in the driver's share is a lane failure like any other, not the caller's.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            super::faults::act_out(fault, id)?;
            match section {
                Some(section) => {
                    let n = input.n_tokens * input.hidden;
                    let rows = &mut out.token_rows[..n];
                    rows.iter_mut().for_each(|v| *v = 0.0);
                    section_slots(input, range, slots);
                    let result = section.compute(input.layer_idx, &input.x[..n], slots, rows);
                    result.map_err(|e| LaneError::Failed { lane: id, reason: e.to_string() })
                }
                None => super::lanes::run_cold_task(&**compute, id, input, range, reduce, &mut out, scratch),
            }
        }))
        .unwrap_or_else(|p| Err(LaneError::panicked(id, p)));
        let window = (started_at, Instant::now());
        self.reduced[MAX_HOT_LANES] = reduce;
        self.returned[MAX_HOT_LANES] = Some(out);
        if let Err(e) = result {
            failure.get_or_insert(LayerFailure::of_cold_lane(FallbackReason::LaneFailed, e.to_string()));
        }
        Some(window)
    }

    /// Wait for every lane that got a task (up to the timeout), taking their buffers and
    /// widening the lanes' time windows; late answers from an earlier layer go home.
    fn join_lanes(&mut self, n_sent: usize, windows: &mut LaneWindows, failure: &mut Option<LayerFailure>) {
        let (call_idx, layer_idx) = (self.input.call_idx, self.input.layer_idx);
        let mut n_done = 0;
        while n_done < n_sent {
            let Ok(done) = recv_spin(&self.done_rx, self.spin, Some(self.timeout)) else {
                failure.get_or_insert(LayerFailure::new(
                    FallbackReason::LaneUnavailable,
                    format!("{} lane(s) did not answer within {:?}", n_sent - n_done, self.timeout),
                ));
                break;
            };
            if done.call_idx != call_idx || done.layer_idx != layer_idx {
                // A late answer from a layer that already fell back: take its buffer home.
                self.home(done.lane, done.out);
                continue;
            }
            n_done += 1;
            windows.widen(done.lane, done.started_at, done.finished_at);
            if let Err(e) = &done.result {
                failure.get_or_insert(LayerFailure {
                    reason: FallbackReason::LaneFailed,
                    cold_lane_failed: matches!(done.lane, LaneId::Cold(_)),
                    detail: e.to_string(),
                });
            }
            self.returned[buffer_idx(done.lane)] = Some(done.out);
        }
    }

    fn merge(&mut self, n_tokens: usize, out: &mut [f32]) {
        let hidden = self.hidden;
        let k = self.k;
        let wl = &self.input.worklist;
        for (lane_idx, s) in wl.hot.iter().enumerate().take(wl.n_hot_lanes) {
            for i in 0..s.hot_count {
                self.slot_locs[s.hot_src_slot[i] as usize] = SlotLoc {
                    buffer: lane_idx as u16,
                    row: i as u32,
                    weight: s.hot_weight[i],
                    reduced: self.reduced[lane_idx],
                };
            }
        }
        let chunk = wl.cold_count.div_ceil(self.cold.len()).max(1);
        for i in 0..wl.cold_count {
            let w = i / chunk;
            self.slot_locs[wl.cold_src_slot[i] as usize] = SlotLoc {
                buffer: (MAX_HOT_LANES + w) as u16,
                row: (i - w * chunk) as u32,
                weight: wl.cold_weight[i],
                reduced: self.reduced[MAX_HOT_LANES + w],
            };
        }
        for t in 0..n_tokens {
            let row = &mut out[t * hidden..(t + 1) * hidden];
            row.iter_mut().for_each(|v| *v = 0.0);
            for j in 0..k {
                let loc = self.slot_locs[t * k + j];
                if loc.reduced {
                    continue;
                }
                let buf = self.returned[loc.buffer as usize].as_ref().expect("lane returned its rows");
                let src = &buf.entry_rows[loc.row as usize * hidden..(loc.row as usize + 1) * hidden];
                for (o, v) in row.iter_mut().zip(src) {
                    *o += loc.weight * v;
                }
            }
        }
        for (idx, reduced) in self.reduced.iter().enumerate() {
            if !reduced {
                continue;
            }
            if let Some(buf) = &self.returned[idx] {
                for (o, v) in out[..n_tokens * hidden].iter_mut().zip(&buf.token_rows) {
                    *o += v;
                }
            }
        }
    }

    fn home(&mut self, lane: LaneId, buf: LaneBuffer) {
        match lane {
            LaneId::Hot(i) => self.hot[i as usize].buf = Some(buf),
            LaneId::Cold(i) => self.cold[i as usize].buf = Some(buf),
        }
    }

    fn send_buffers_home(&mut self) {
        for idx in 0..self.returned.len() {
            if let Some(buf) = self.returned[idx].take() {
                let lane = if idx < MAX_HOT_LANES {
                    LaneId::Hot(idx as u8)
                } else {
                    LaneId::Cold((idx - MAX_HOT_LANES) as u8)
                };
                self.home(lane, buf);
            }
        }
    }
}

/// The cold entries `range` of the layer's worklist as cold-lane slots (row: the token).
fn section_slots(input: &LayerInput, range: std::ops::Range<usize>, slots: &mut Vec<ColdSlot>) {
    let wl = &input.worklist;
    slots.clear();
    slots.extend(range.map(|i| ColdSlot {
        row_idx: wl.cold_token_id[i] as usize,
        expert_idx: wl.cold_id[i] as usize,
        weight: wl.cold_weight[i],
    }));
}

fn buffer_idx(lane: LaneId) -> usize {
    match lane {
        LaneId::Hot(i) => i as usize,
        LaneId::Cold(i) => MAX_HOT_LANES + i as usize,
    }
}

fn fresh_buffer(rows: usize, max_tokens: usize, hidden: usize) -> LaneBuffer {
    LaneBuffer { entry_rows: vec![0.0; rows * hidden], token_rows: vec![0.0; max_tokens * hidden] }
}

impl Drop for LaneSet {
    fn drop(&mut self) {
        for tx in self.hot.iter().filter_map(|l| l.tx.as_ref()) {
            let _ = tx.try_send(HotMsg::Stop);
        }
        for tx in self.cold.iter().filter_map(|l| l.tx.as_ref()) {
            let _ = tx.try_send(ColdMsg::Stop);
        }
        // Drain late answers so no lane blocks on a full done channel, then join the threads.
        while self.done_rx.try_recv().is_ok() {}
        for t in self
            .hot
            .iter_mut()
            .filter_map(|l| l.thread.take())
            .chain(self.cold.iter_mut().filter_map(|l| l.thread.take()))
        {
            let _ = t.join();
        }
    }
}

/// When the hot lanes and the cold lanes ran (earliest start, latest finish of each kind).
#[derive(Default)]
struct LaneWindows {
    hot: Option<(Instant, Instant)>,
    cold: Option<(Instant, Instant)>,
}

impl LaneWindows {
    fn widen(&mut self, lane: LaneId, start: Instant, end: Instant) {
        let w = match lane {
            LaneId::Hot(_) => &mut self.hot,
            LaneId::Cold(_) => &mut self.cold,
        };
        *w = Some(w.map_or((start, end), |(s, e)| (s.min(start), e.max(end))));
    }

    /// Lane, overlap, join-wait, merge and wall times, read off the message timestamps.
    fn fill(
        &self,
        t: &mut LayerTiming,
        sent_at: Instant,
        wait_from: Instant,
        joined_at: Instant,
        merged_at: Instant,
    ) {
        let us = |a: Instant, b: Instant| b.saturating_duration_since(a).as_micros() as u64;
        t.hot_us = self.hot.map_or(0, |(s, e)| us(s, e));
        t.cold_us = self.cold.map_or(0, |(s, e)| us(s, e));
        t.overlap_us = match (self.hot, self.cold) {
            (Some((hs, he)), Some((cs, ce))) => us(hs.max(cs), he.min(ce)),
            _ => 0,
        };
        t.join_wait_us = us(wait_from, joined_at);
        t.merge_us = us(joined_at, merged_at);
        t.wall_us = us(sent_at, merged_at);
        t.split = true;
    }
}
