//! Lane ping-pong: a batched decode step whose layers have cold experts runs as two
//! micro-batches (the first half of the sequences, A, and the rest, B) whose lanes alternate, so
//! the CPU pool computes one micro-batch's cold experts while the GPU runs the other's dense
//! stages. Within one sequence, layer `l + 1`'s attention waits for layer `l`'s cold experts;
//! across two micro-batches it need not.
//!
//! The driver (the pool's thread 0, as in every step) enqueues a micro-batch's *front* of a
//! layer (mixer, routing, hot lane; a layer without cold work ends there) and its *back* later
//! (the routing on the host, the cold experts on the pool, their rows added on the stream):
//!
//! ```text
//! driver: A_l cold | A_l join, A_{l+1} front | B_l cold | B_l join, B_{l+1} front | A_{l+1} cold
//! GPU:    B_l front (queued before)          | A_l join, A_{l+1} front           | B_l join ...
//! ```
//!
//! While the pool computes one micro-batch's experts, the GPU runs the fronts queued for the
//! other, so its routing is on the host when the driver turns to it. No thread is handed
//! anything: with a cold thread taking each job by a hand-off the driver waited about as long
//! as each job ran, and with both threads spinning each job took ~2 ms (H200 host,
//! benches/RESULTS.md "lane ping-pong").
//!
//! Each micro-batch has its own device scratch, batch rows, MoE host and pinned buffers, lane
//! records and events: B's live in a [`MicroState`] that the driver swaps into the stages to
//! run B (moves, no copies). A micro-batch's rows run the same kernels and cold lane as a
//! batched step of its sequences alone would; its routing ids and lane figures are merged into
//! the call's afterwards. What it costs: cold experts that both halves route to are read twice
//! ([`super::options::PING_PONG_MAX_ROWS`]) and twice the launches; what it measures per layer:
//! the driver's wait for each micro-batch's routing (`join_wait_us`: GPU time not hidden) and
//! the front's GPU time it did not wait for (`overlap_us`: hidden under the other's cold lane).
//! Off by default: on the H200 host the hidden GPU time was less than the driver's and the
//! pool's added work ([`super::options::PING_PONG_MAX_ROWS`] has the figures).

use super::batch::{segments, BatchRows, GpuSeqInput};
use super::device::LayerCtx;
use super::model::{GpuModel, GpuSeg};
use super::moe::MoePlan;
use super::options::GpuFaults;
use super::route::dense_ffn;
use super::scratch::{HostScratch, MoePinned, Scratch};
use super::shard::Shard;
use super::stats::{LaneEvents, LayerLaneStats, LayerRecord};
use super::GpuError;
use crate::cache::perf::PerfState;
use crate::moe::cold::ColdLane;
use crate::moe::phase::Phase;
use std::time::Instant;

/// The second micro-batch's per-call state, swapped with the stages' own to run it.
pub(crate) struct MicroState {
    scratch: Option<Scratch>,
    rows: Option<BatchRows>,
    host: HostScratch,
    pin: MoePinned,
    records: Vec<LayerRecord>,
    lane_events: Vec<LaneEvents>,
    front_events: Vec<LaneEvents>,
}

impl MicroState {
    fn new(sh: &Shard) -> Result<MicroState, GpuError> {
        let (be, cfg) = (&sh.dev.be, &sh.dev.cfg);
        Ok(MicroState {
            scratch: None,
            rows: None,
            host: HostScratch::new(cfg, 8),
            pin: MoePinned::new(be, cfg, 8)?,
            records: vec![LayerRecord::default(); cfg.n_layers],
            lane_events: LaneEvents::per_layer(be, cfg.n_layers)?,
            front_events: LaneEvents::per_layer(be, cfg.n_layers)?,
        })
    }
}

/// A ping-pong layer's overlap: its front's GPU time that the driver did not wait for (it ran
/// under the other micro-batch's cold lane).
fn front_overlap(s: &mut LayerLaneStats, r: &LayerRecord, ev: &LaneEvents) -> Result<(), GpuError> {
    if r.ping_pong_front {
        let front_us = ev.start.elapsed_ms(&ev.end)? as f64 * 1e3;
        s.overlap_us = (front_us - r.join_wait_us).max(0.0);
    }
    Ok(())
}

/// One micro-batch as the driver runs it: its sequences' segments, its rows, and the layer whose
/// front is on the GPU and whose cold lane is still to run.
struct Micro<'a> {
    segs: &'a [GpuSeg<'a>],
    t: usize,
    pending: Option<Pending>,
}

struct Pending {
    l: usize,
    plan: MoePlan,
}

impl GpuModel {
    /// Whether a batched call runs as two ping-pong micro-batches: a decode step of 2 to
    /// [`super::GpuOptions::ping_pong_max_rows`] rows over at least two sequences, on one device
    /// with cold experts in some layer, without injected faults, the stage profile or decode's
    /// Post-Fetch (whose scratchpad the micro-batches would share).
    pub(super) fn ping_pong_applies(&self, seqs: &[GpuSeqInput<'_>], phase: Phase) -> bool {
        let [sh] = self.shards.as_slice() else { return false };
        let t: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        let opts = &sh.dev.opts;
        phase == Phase::Decode
            && seqs.len() >= 2
            && t <= opts.ping_pong_max_rows
            && opts.faults == GpuFaults::default()
            && !opts.postfetch.decode
            && sh.dev.profiler.is_none()
            && !sh.all_hot()
    }
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
        std::mem::swap(&mut self.moe.front_events, &mut m.front_events);
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
    pub(super) fn ping_pong_layers(
        &mut self,
        (a, b): (&[GpuSeqInput<'_>], &[GpuSeqInput<'_>]),
        cold: &mut dyn ColdLane,
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
        cold: &mut dyn ColdLane,
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
        let mut xa = Micro { segs: &segs_a, t: t_a, pending: None };
        let mut xb = Micro { segs: &segs_b, t: t_b, pending: None };
        let ran = self.ping_pong_loop(m, (&mut xa, &mut xb), cold, perf);
        for r in [self.dev.rows.as_mut(), m.rows.as_mut()].into_iter().flatten() {
            r.active = false;
        }
        ran?;
        self.dev.be.copy(b_hidden.sub(0, t_b * h), a_hidden.sub(t_a * h, t_b * h))?;
        Ok(())
    }

    /// Both fronts of the first layer; then per layer A's back and next front, B's back and
    /// next front (module docs).
    fn ping_pong_loop(
        &mut self,
        m: &mut MicroState,
        (xa, xb): (&mut Micro<'_>, &mut Micro<'_>),
        cold: &mut dyn ColdLane,
        perf: &mut PerfState,
    ) -> Result<(), GpuError> {
        let layers = self.layers();
        self.micro_front(layers.start, xa, cold, perf)?;
        self.in_b(m, |sh| sh.micro_front(layers.start, xb, cold, perf))?;
        for l in layers.clone() {
            let next = Some(l + 1).filter(|n| *n < layers.end);
            self.micro_back(xa, cold, perf)?;
            next.map_or(Ok(()), |n| self.micro_front(n, xa, cold, perf))?;
            self.in_b(m, |sh| {
                sh.micro_back(xb, cold, perf)?;
                next.map_or(Ok(()), |n| sh.micro_front(n, xb, cold, perf))
            })?;
        }
        Ok(())
    }

    /// Layer `l`'s front for the micro-batch in the stages: mixer, routing, hot lane (between
    /// the front events); a layer without cold work (a dense FFN, all hot, a failed hot lane)
    /// ends here, the others wait for their back.
    fn micro_front(
        &mut self,
        l: usize,
        x: &mut Micro<'_>,
        cold: &mut dyn ColdLane,
        perf: &mut PerfState,
    ) -> Result<(), GpuError> {
        self.dev.be.record(&self.moe.front_events[l].start)?;
        let cx = LayerCtx::of(&self.dev, self.call_idx, l, Phase::Decode, x.t);
        self.mixer.run(&cx, x.segs)?;
        if !self.dev.expert_layers[l] {
            self.moe.records[l] = LayerRecord::default();
            return dense_ffn(&cx);
        }
        let plan = self.moe.route_layer(&cx)?;
        let hot = self.moe.hot_lane_device(&cx, plan);
        self.dev.be.record(&self.moe.front_events[l].end)?;
        match hot {
            Ok(()) if !self.moe.hot.all_hot(l) => {
                x.pending = Some(Pending { l, plan });
                Ok(())
            }
            Ok(()) => {
                self.moe.records[l].hot_slots = x.t * self.dev.cfg.n_experts_used;
                self.moe.finish(&cx, perf, cold, Ok(()), plan.direct)
            }
            Err(fault) => self.moe.finish(&cx, perf, cold, Err(fault), plan.direct),
        }
    }

    /// The micro-batch's layer whose front is queued, if any: its routing on the host (the
    /// wait timed), its cold experts on the pool and their rows added on the stream, the layer's
    /// end (a failed lane recomputed all-cold).
    fn micro_back(
        &mut self,
        x: &mut Micro<'_>,
        cold: &mut dyn ColdLane,
        perf: &mut PerfState,
    ) -> Result<(), GpuError> {
        let Some(p) = x.pending.take() else { return Ok(()) };
        let cx = LayerCtx::of(&self.dev, self.call_idx, p.l, Phase::Decode, x.t);
        let wait_start = Instant::now();
        self.moe.wait_routes()?;
        let route_wait_us = wait_start.elapsed().as_secs_f64() * 1e6;
        let outcome = self.moe.cold_lane_device(&cx, cold);
        let rec = &mut self.moe.records[p.l];
        // the join ran on the stream behind the lane; the step's wait is for the routing
        (rec.gpu_joined, rec.join_wait_us, rec.ping_pong_front) = (false, route_wait_us, true);
        self.moe.finish(&cx, perf, cold, outcome, p.plan.direct)
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

    /// After a ping-pong call: the layers' figures (`layers`: this device's, A's) with each
    /// micro-batch's front overlap, and B's added.
    pub(super) fn merge_micro_lanes(
        &mut self,
        decode: bool,
        layers: &mut [LayerLaneStats],
    ) -> Result<(), GpuError> {
        let range = self.layers();
        let (Some(_), Some(m)) = (self.ping_pong, self.micro.as_mut()) else { return Ok(()) };
        for (i, l) in range.enumerate() {
            front_overlap(&mut layers[i], &self.moe.records[l], &self.moe.front_events[l])?;
            let r = &m.records[l];
            let mut b = super::stats::lane_stats(r, m.lane_events[l].hot_us(r, decode)?);
            front_overlap(&mut b, r, &m.front_events[l])?;
            layers[i] = layers[i].merged(&b);
        }
        Ok(())
    }
}
