//! Lane ping-pong: a batched decode step whose layers have cold experts runs as two
//! micro-batches (the first half of the sequences, A, and the rest, B) whose lanes alternate, so
//! the CPU pool computes one micro-batch's cold experts while the GPU runs the other's dense
//! stages. Within one sequence, layer `l + 1`'s attention waits for layer `l`'s cold experts;
//! across two micro-batches it need not.
//!
//! Layer `l` of the step, on the GPU's one stream and the cold thread's one queue:
//!
//! ```text
//! GPU:  A_l mixer, route, hot | B_{l-1} join, B_l mixer, route, hot | A_l join, A_{l+1} ...
//! CPU:  B_{l-1} cold          | A_l cold                            | B_l cold ...
//! ```
//!
//! The driver enqueues A's layer, hands A's cold rows to the cold thread once A's routing is on
//! the host, joins B's previous layer when its rows are back, enqueues B's layer, and so on.
//! The cold thread runs the cold lane (the pool, as its thread 0) one job after another, so the
//! pool is idle only while neither micro-batch's routing has reached the host.
//!
//! Each micro-batch has its own device scratch, batch rows, MoE host and pinned buffers, lane
//! records and events: B's live in a [`MicroState`] that the driver swaps into the stages to
//! run B (moves, no copies). A micro-batch's rows run the same kernels and cold lane as a
//! batched step of its sequences alone would; its routing ids and lane figures are merged into
//! the call's afterwards. What it costs: cold experts that both halves route to are read twice
//! ([`super::options::PING_PONG_MAX_ROWS`]); what it measures: each layer's cold-lane time that
//! overlapped the other micro-batch (`overlap_us`) and the driver's wait for each cold result
//! (`join_wait_us`).

use super::batch::{BatchRows, GpuSeqInput};
use super::device::LayerCtx;
use super::head::head_kernels;
use super::model::{GpuModel, GpuSeg};
use super::moe::{cold_failed, collect_cold, LayerFault, MoePlan, MoeStage};
use super::options::GpuFaults;
use super::route::dense_ffn;
use super::scratch::{HostScratch, MoePinned, RouteView, Scratch};
use super::shard::Shard;
use super::stats::{LaneEvents, LayerLaneStats, LayerRecord};
use super::GpuError;
use crate::cache::perf::{FallbackReason, PerfState};
use crate::forward::{LogitRows, Logits};
use crate::moe::cold::{ColdError, ColdLane, ColdSlot};
use crate::moe::faults::LayerFailure;
use crate::moe::phase::Phase;
use crate::moe::worklist::WorklistOrder;
use crossbeam_channel::{Receiver, Sender};
use moe_lanes_kernels::ThreadAffinity;
use std::time::Instant;

/// The second micro-batch's per-call state, swapped with the stages' own to run it.
pub(crate) struct MicroState {
    scratch: Option<Scratch>,
    rows: Option<BatchRows>,
    host: HostScratch,
    pin: MoePinned,
    records: Vec<LayerRecord>,
    lane_events: Vec<LaneEvents>,
}

impl MicroState {
    fn new(sh: &Shard) -> Result<MicroState, GpuError> {
        let (be, cfg) = (&sh.dev.be, &sh.dev.cfg);
        let lane_events = (0..cfg.n_layers)
            .map(|_| Ok(LaneEvents::new(be.event()?, be.event()?)))
            .collect::<Result<Vec<_>, GpuError>>()?;
        Ok(MicroState {
            scratch: None,
            rows: None,
            host: HostScratch::new(cfg, 8),
            pin: MoePinned::new(be, cfg, 8)?,
            records: vec![LayerRecord::default(); cfg.n_layers],
            lane_events,
        })
    }

    /// `layers`' lane figures (A's, in the layers of the range) with B's added.
    fn merge_lanes(
        &mut self,
        range: std::ops::Range<usize>,
        decode: bool,
        layers: &mut [LayerLaneStats],
    ) -> Result<(), GpuError> {
        let records = self.records[range.clone()].iter();
        for ((r, ev), a) in records.zip(&mut self.lane_events[range]).zip(layers) {
            *a = a.merged(&super::stats::lane_stats(r, ev.hot_us(r, decode)?));
        }
        Ok(())
    }
}

/// One cold-lane job of a micro-batch: its layer's compact cold rows and slots, and the rows
/// the lane adds into (zero on entry); the buffers travel back with the result.
struct ColdJob {
    layer: usize,
    bufs: ColdBufs,
    reply: Sender<ColdDone>,
}

#[derive(Default)]
struct ColdBufs {
    rows: Vec<f32>,
    slots: Vec<ColdSlot>,
    out: Vec<f32>,
}

struct ColdDone {
    bufs: ColdBufs,
    result: Result<(), ColdError>,
    /// The job's window on the cold thread.
    window: (Instant, Instant),
}

/// Spin until `rx` has a message (`None`: every sender is gone). Both ends of a ping-pong step
/// wait on cores of their own, and a parked thread's wake-up costs about as much as the GPU's
/// share of a layer that the step hides.
fn spin_recv<T>(rx: &Receiver<T>) -> Option<T> {
    loop {
        match rx.try_recv() {
            Ok(msg) => return Some(msg),
            Err(crossbeam_channel::TryRecvError::Empty) => std::hint::spin_loop(),
            Err(crossbeam_channel::TryRecvError::Disconnected) => return None,
        }
    }
}

/// The cold thread's loop: each job in turn, a panic caught and reported as the job's error.
fn cold_thread(cold: &mut (dyn ColdLane + Send), jobs: Receiver<ColdJob>) {
    while let Some(mut job) = spin_recv(&jobs) {
        let start = Instant::now();
        let l = job.layer;
        let b = &mut job.bufs;
        let run = std::panic::AssertUnwindSafe(|| cold.compute(l, &b.rows, &b.slots, &mut b.out));
        let result = std::panic::catch_unwind(run).unwrap_or(Err(ColdError::Panicked { layer_idx: l }));
        let done = ColdDone { bufs: job.bufs, result, window: (start, Instant::now()) };
        // the driver only stops listening when the call failed: nothing waits for the result
        let _ = job.reply.send(done);
    }
}

/// The driver's side of the cold thread for one micro-batch (or the fallback's): its own reply
/// channel and buffers.
struct ColdClient {
    jobs: Sender<ColdJob>,
    reply: (Sender<ColdDone>, Receiver<ColdDone>),
    bufs: Option<ColdBufs>,
}

impl ColdClient {
    fn new(jobs: &Sender<ColdJob>) -> ColdClient {
        let reply = crossbeam_channel::bounded(1);
        ColdClient { jobs: jobs.clone(), reply, bufs: Some(ColdBufs::default()) }
    }

    /// The buffers for the next job, emptied.
    fn take_bufs(&mut self) -> ColdBufs {
        let mut b = self.bufs.take().unwrap_or_default();
        b.rows.clear();
        b.slots.clear();
        b.out.clear();
        b
    }

    fn submit(&self, layer: usize, bufs: ColdBufs) -> Result<(), LayerFault> {
        let job = ColdJob { layer, bufs, reply: self.reply.0.clone() };
        self.jobs.send(job).map_err(|_| thread_gone(layer))
    }

    /// The job's result, and how long the caller waited for it (microseconds).
    fn wait(&mut self, layer: usize) -> Result<(ColdDone, f64), LayerFault> {
        let start = Instant::now();
        let done = spin_recv(&self.reply.1).ok_or_else(|| thread_gone(layer))?;
        Ok((done, start.elapsed().as_secs_f64() * 1e6))
    }
}

fn thread_gone(layer_idx: usize) -> LayerFault {
    let detail = format!("layer {layer_idx}: the cold thread stopped");
    LayerFailure::of_cold_lane(FallbackReason::LaneFailed, detail).into()
}

/// The cold lane through the cold thread, one job at a time (a fallback's all-cold layer).
impl ColdLane for ColdClient {
    fn compute(
        &mut self,
        layer_idx: usize,
        hidden_rows: &[f32],
        slots: &[ColdSlot],
        out_rows: &mut [f32],
    ) -> Result<(), ColdError> {
        let mut b = self.take_bufs();
        b.rows.extend_from_slice(hidden_rows);
        b.slots.extend_from_slice(slots);
        b.out.resize(out_rows.len(), 0.0);
        let stopped = || ColdError::Panicked { layer_idx };
        self.submit(layer_idx, b).map_err(|_| stopped())?;
        let (done, _) = self.wait(layer_idx).map_err(|_| stopped())?;
        out_rows.copy_from_slice(&done.bufs.out);
        self.bufs = Some(done.bufs);
        done.result
    }
}

/// One micro-batch as the driver runs it: its sequences' segments, rows, cold client and the
/// layer whose cold job is in flight.
struct Micro<'a> {
    segs: &'a [GpuSeg<'a>],
    t: usize,
    cold: ColdClient,
    pending: Option<Pending>,
}

/// A layer whose cold job is in flight: joined before the micro-batch's next layer.
struct Pending {
    l: usize,
    plan: MoePlan,
    split_at: Instant,
}

impl GpuModel {
    /// Whether a batched call runs as two ping-pong micro-batches: a decode step of 2 to
    /// [`super::GpuOptions::ping_pong_max_rows`] rows over at least two sequences, on one device
    /// with cold experts in some layer, without injected faults or the stage profile.
    pub(super) fn ping_pong_applies(&self, seqs: &[GpuSeqInput<'_>], phase: Phase) -> bool {
        let [sh] = self.shards.as_slice() else { return false };
        let t: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        let opts = &sh.dev.opts;
        phase == Phase::Decode
            && seqs.len() >= 2
            && t <= opts.ping_pong_max_rows
            && opts.faults == GpuFaults::default()
            && sh.dev.profiler.is_none()
            && !sh.all_hot()
    }

    /// [`GpuModel::forward_batch`] as two micro-batches whose lanes ping-pong (module docs).
    pub(super) fn forward_ping_pong(
        &mut self,
        seqs: &mut [GpuSeqInput<'_>],
        cold: &mut (dyn ColdLane + Send),
    ) -> Result<Logits, GpuError> {
        let call_start = Instant::now();
        let mut calls: Vec<(&[u32], &mut super::kv::GpuKvCache)> =
            seqs.iter_mut().map(|s| (s.tokens, &mut *s.cache)).collect();
        self.start_call(&mut calls)?;
        drop(calls);
        let tokens: Vec<u32> = seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let t = tokens.len();
        self.enter(0)?;
        let sh = &mut self.shards[0];
        sh.embed(&tokens)?;
        let (a, b) = seqs.split_at(seqs.len().div_ceil(2));
        sh.ping_pong_layers((a, b), cold, &mut self.perf)?;
        sh.gather_last_rows(seqs)?;
        let copy_start = Instant::now();
        let n = seqs.len();
        head_kernels(&sh.dev, Phase::Decode, n, LogitRows::All)?;
        let logits = sh.head_copies(self.perf.mode(), t, n)?;
        let copy_us = copy_start.elapsed().as_secs_f64() * 1e6;
        for s in seqs.iter_mut() {
            s.cache.n_positions += s.tokens.len();
        }
        self.finish_call(Phase::Decode, t, call_start, copy_start, copy_us)?;
        Ok(logits)
    }
}

fn segments<'a>(seqs: &'a [GpuSeqInput<'_>]) -> Vec<GpuSeg<'a>> {
    let mut row0 = 0;
    let seg = |s: &'a GpuSeqInput<'_>| {
        let seg = GpuSeg { row0, n: s.tokens.len(), pos0: s.cache.n_positions, cache: &*s.cache };
        row0 += seg.n;
        seg
    };
    seqs.iter().map(seg).collect()
}

impl Shard {
    /// Swap the second micro-batch's state into the stages (or back out).
    fn swap_micro(&mut self, m: &mut MicroState) {
        std::mem::swap(&mut self.dev.scratch, &mut m.scratch);
        std::mem::swap(&mut self.dev.rows, &mut m.rows);
        std::mem::swap(&mut self.moe.host, &mut m.host);
        std::mem::swap(&mut self.moe.pin, &mut m.pin);
        std::mem::swap(&mut self.moe.records, &mut m.records);
        std::mem::swap(&mut self.moe.lane_events, &mut m.lane_events);
    }

    /// `f` with micro-batch B's state in the stages; A's back after, whatever `f` returned.
    fn in_b<R>(&mut self, m: &mut MicroState, f: impl FnOnce(&mut Shard) -> R) -> R {
        self.swap_micro(m);
        let r = f(self);
        self.swap_micro(m);
        r
    }

    /// This device's layers over both micro-batches (`a`'s rows first in the hidden rows, where
    /// the embedding put them, and where B's return after the last layer).
    fn ping_pong_layers(
        &mut self,
        (a, b): (&[GpuSeqInput<'_>], &[GpuSeqInput<'_>]),
        cold: &mut (dyn ColdLane + Send),
        perf: &mut PerfState,
    ) -> Result<(), GpuError> {
        let mut m = match self.micro.take() {
            Some(m) => m,
            None => MicroState::new(self)?,
        };
        let ran = self.ping_pong_with(&mut m, (a, b), cold, perf);
        self.micro = Some(m);
        ran
    }

    fn ping_pong_with(
        &mut self,
        m: &mut MicroState,
        (a, b): (&[GpuSeqInput<'_>], &[GpuSeqInput<'_>]),
        cold: &mut (dyn ColdLane + Send),
        perf: &mut PerfState,
    ) -> Result<(), GpuError> {
        let (segs_a, segs_b) = (segments(a), segments(b));
        let t_a: usize = segs_a.iter().map(|s| s.n).sum();
        let t_b: usize = segs_b.iter().map(|s| s.n).sum();
        let (h, n_layers) = (self.dev.cfg.hidden, self.dev.cfg.n_layers);
        self.in_b(m, |sh| sh.reserve_scratch(t_b))?;
        let b_hidden = m.scratch.as_ref().expect("reserved above").hidden.ptr();
        let a_hidden = self.dev.s().hidden.ptr();
        self.dev.be.copy(a_hidden.sub(t_a * h, t_b * h), b_hidden.sub(0, t_b * h))?;
        let be = &self.dev.be;
        self.dev.rows = Some(BatchRows::build(be, self.dev.rows.take(), &segs_a, Phase::Decode, n_layers)?);
        m.rows = Some(BatchRows::build(be, m.rows.take(), &segs_b, Phase::Decode, n_layers)?);
        self.ping_pong = Some((t_a, t_b));
        // The cold thread on the CPU the pool leaves its caller, this driver on the ones it
        // leaves free: sharing a core with either would slow a pool thread, and every barrier
        // of every cold job with it (measured: a 1-row job took 2.3x as long unpinned).
        let cpus = cold.cpus();
        let _driver = ThreadAffinity::pin(&cpus.spare);
        let ran = std::thread::scope(|scope| {
            let (jobs, queue) = crossbeam_channel::unbounded::<ColdJob>();
            scope.spawn(move || {
                let _pinned = ThreadAffinity::pin(&cpus.driver);
                cold_thread(cold, queue)
            });
            let mut xa = Micro { segs: &segs_a, t: t_a, cold: ColdClient::new(&jobs), pending: None };
            let mut xb = Micro { segs: &segs_b, t: t_b, cold: ColdClient::new(&jobs), pending: None };
            let mut fallback = ColdClient::new(&jobs);
            drop(jobs); // the thread ends when the clients are dropped
            self.ping_pong_loop(m, (&mut xa, &mut xb), &mut fallback, perf)
        });
        for r in [self.dev.rows.as_mut(), m.rows.as_mut()].into_iter().flatten() {
            r.active = false;
        }
        ran?;
        self.dev.be.copy(b_hidden.sub(0, t_b * h), a_hidden.sub(t_a * h, t_b * h))?;
        Ok(())
    }

    /// Every layer: A's start, B's previous layer joined and B's start, A's join; B's last
    /// layer joined after.
    fn ping_pong_loop(
        &mut self,
        m: &mut MicroState,
        (xa, xb): (&mut Micro<'_>, &mut Micro<'_>),
        fallback: &mut ColdClient,
        perf: &mut PerfState,
    ) -> Result<(), GpuError> {
        for l in self.layers() {
            self.micro_start(l, xa, fallback, perf)?;
            self.in_b(m, |sh| {
                sh.micro_join(xb, fallback, perf)?;
                sh.micro_start(l, xb, fallback, perf)
            })?;
            self.micro_join(xa, fallback, perf)?;
        }
        self.in_b(m, |sh| sh.micro_join(xb, fallback, perf))
    }

    /// Layer `l` of the micro-batch in the stages: mixer, routing, hot lane, and its cold rows
    /// handed to the cold thread (the layer finished at once when it has none).
    fn micro_start(
        &mut self,
        l: usize,
        x: &mut Micro<'_>,
        fallback: &mut ColdClient,
        perf: &mut PerfState,
    ) -> Result<(), GpuError> {
        let cx = LayerCtx::of(&self.dev, self.call_idx, l, Phase::Decode, x.t);
        self.mixer.run(&cx, x.segs)?;
        if !self.dev.expert_layers[l] {
            self.moe.records[l] = LayerRecord::default();
            return dense_ffn(&cx);
        }
        let plan = self.moe.route_layer(&cx)?;
        let split_at = Instant::now();
        let submitted = self.moe.hot_lane_device(&cx, plan).and_then(|()| self.moe.cold_submit(&cx, &mut x.cold));
        match submitted {
            Ok(true) => {
                x.pending = Some(Pending { l, plan, split_at });
                Ok(())
            }
            Ok(false) => self.moe.finish(&cx, perf, fallback, Ok(()), plan.direct),
            Err(fault) => self.moe.finish(&cx, perf, fallback, Err(fault), plan.direct),
        }
    }

    /// The micro-batch's layer in flight, if any: its cold rows added on the stream once they
    /// are back, then the layer's end (a failed lane recomputed all-cold).
    fn micro_join(
        &mut self,
        x: &mut Micro<'_>,
        fallback: &mut ColdClient,
        perf: &mut PerfState,
    ) -> Result<(), GpuError> {
        let Some(p) = x.pending.take() else { return Ok(()) };
        let cx = LayerCtx::of(&self.dev, self.call_idx, p.l, Phase::Decode, x.t);
        let joined = self.moe.cold_join(&cx, &mut x.cold);
        self.moe.records[p.l].wall_us = p.split_at.elapsed().as_secs_f64() * 1e6;
        self.moe.finish(&cx, perf, fallback, joined, p.plan.direct)
    }

    /// A ping-pong call's routing ids as one call of `t_a + t_b` rows would have them: per
    /// layer A's rows (in the head's pinned tail, `a_ids`) then B's (read back here).
    pub(super) fn merged_ids(
        &self,
        (t_a, t_b): (usize, usize),
        a_ids: &[i32],
        out: &mut Vec<i32>,
    ) -> Result<(), GpuError> {
        let (k, n_layers) = (self.dev.cfg.n_experts_used, self.dev.cfg.n_layers);
        let Some(m) = self.micro.as_ref() else { return Ok(()) };
        let b_scratch = m.scratch.as_ref().expect("the call reserved it");
        let mut b_ids = vec![0i32; n_layers * t_b * k];
        self.dev.be.read(b_scratch.ids().sub(0, b_ids.len()), &mut b_ids)?;
        out.clear();
        for l in 0..n_layers {
            out.extend_from_slice(&a_ids[l * t_a * k..][..t_a * k]);
            out.extend_from_slice(&b_ids[l * t_b * k..][..t_b * k]);
        }
        Ok(())
    }

    /// After a ping-pong call: B's lane figures added into the layers' (`layers`: this
    /// device's, A's).
    pub(super) fn merge_micro_lanes(
        &mut self,
        decode: bool,
        layers: &mut [LayerLaneStats],
    ) -> Result<(), GpuError> {
        let range = self.layers();
        match (self.ping_pong, self.micro.as_mut()) {
            (Some(_), Some(m)) => m.merge_lanes(range, decode, layers),
            _ => Ok(()),
        }
    }
}

impl MoeStage {
    /// The device path's cold side, asynchronously: once the routing is on the host, the
    /// token-major worklist and the compact cold rows handed to the cold thread. Whether a job
    /// went (none: the layer is all hot, or no row has a cold slot).
    fn cold_submit(&mut self, cx: &LayerCtx<'_>, cold: &mut ColdClient) -> Result<bool, LayerFault> {
        let (dev, l, t) = (cx.dev, cx.l, cx.t);
        let (h, k) = (dev.cfg.hidden, dev.cfg.n_experts_used);
        if self.hot.all_hot(l) {
            self.records[l].hot_slots = t * k;
            return Ok(false);
        }
        self.wait_routes()?;
        self.records[l].hot_at = Some(Instant::now());
        self.host_worklist(cx, WorklistOrder::TokenMajor)?;
        self.postfetch_reset(); // every cold expert on the CPU: the scratchpad is not shared
        let n_rows = collect_cold(&mut self.host, t, false);
        let rec = &mut self.records[l];
        (rec.hot_slots, rec.cold_slots, rec.cold_rows) =
            (self.host.worklist.hot_count_total(), self.host.cold_slots.len(), n_rows);
        rec.split = true;
        if n_rows == 0 {
            return Ok(false);
        }
        let mut b = cold.take_bufs();
        let normed = RouteView::of(self.pin.route.as_slice()?, dev.s().cap, k, t, h).rows;
        for &ti in &self.host.cold_row_tok {
            b.rows.extend_from_slice(&normed[ti * h..][..h]);
        }
        b.slots.extend_from_slice(&self.host.cold_slots);
        b.out.resize(n_rows * h, 0.0);
        cold.submit(l, b)?;
        Ok(true)
    }

    /// The cold job of layer `cx.l` back: its rows scattered to their tokens in the pinned
    /// output, copied to the device and added into the MoE output on the stream.
    fn cold_join(&mut self, cx: &LayerCtx<'_>, cold: &mut ColdClient) -> Result<(), LayerFault> {
        let (dev, l, t) = (cx.dev, cx.l, cx.t);
        let h = dev.cfg.hidden;
        let (done, wait_us) = cold.wait(l)?;
        let ColdDone { bufs, result, window } = done;
        let scattered = result.map_err(cold_failed).and_then(|()| {
            let out = &mut self.pin.cold_out.as_mut_slice()?[..t * h];
            out.fill(0.0);
            for (r, &ti) in self.host.cold_row_tok.iter().enumerate() {
                out[ti * h..][..h].copy_from_slice(&bufs.out[r * h..][..h]);
            }
            Ok(())
        });
        cold.bufs = Some(bufs);
        scattered?;
        let rec = &mut self.records[l];
        rec.cold = Some(window);
        rec.join_wait_us = wait_us;
        let cold_us = (window.1 - window.0).as_secs_f64() * 1e6;
        rec.ping_pong_overlap_us = Some((cold_us - wait_us).max(0.0));
        let s = dev.s();
        dev.be.write_async(&self.pin.cold_out, t * h, s.cold_out.ptr())?;
        dev.be.add(s.moe_out.ptr(), s.cold_out.ptr(), t * h)?;
        Ok(())
    }
}
