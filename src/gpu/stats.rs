//! Lane statistics of the GPU engine: per layer of a call, what each lane did and when
//! (read off CUDA events for the hot lane and host clocks for the cold lane), folded into the
//! shared [`PerfState`] after the call; and the opt-in per-stage GPU profile.

use crate::cache::hot_set::HotSet;
use crate::cache::perf::{LayerTiming, PerfMode, PerfState};
use moe_lanes_kernels::cuda::GpuEvent;
use std::time::{Duration, Instant};

use super::GpuError;

/// What one MoE layer did in one call (host side; the hot lane's GPU time comes from events).
#[derive(Debug, Clone, Default)]
pub(crate) struct LayerRecord {
    /// Both lanes ran (no fallback).
    pub launched: bool,
    pub hot_slots: usize,
    pub cold_slots: usize,
    pub cold_rows: usize,
    /// Host time the hot lane could start (routing done on the GPU); set when CUDA events
    /// timed the lane.
    pub hot_at: Option<Instant>,
    /// The hot lane ran without events (an all-hot layer inside a decode graph).
    pub hot_untimed: bool,
    /// Host clock window of the cold lane.
    pub cold: Option<(Instant, Instant)>,
    /// The join ran on the GPU stream (no host wait): its wait is the gap between lane ends.
    pub gpu_joined: bool,
    pub join_wait_us: f64,
    pub wall_us: f64,
    pub worklist_us: f64,
    /// The host split the layer (routing back on the host, `wall_us` measured); false for a
    /// fully cached decode layer, whose hot lane runs on the stream alone.
    pub split: bool,
    /// A ping-pong micro-batch's layer: `join_wait_us` is the driver's wait for its routing, and
    /// its overlap the front's GPU time less that wait (the front events of `ping_pong`).
    pub ping_pong_front: bool,
}

/// Lane timings and slot counts of one MoE layer in one forward call.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerLaneStats {
    pub hot_slots: usize,
    pub cold_slots: usize,
    /// Token rows handed to the cold lane.
    pub cold_rows: usize,
    /// GPU time of the hot lane (CUDA events around its kernels).
    pub hot_us: f64,
    /// CPU time of the cold lane.
    pub cold_us: f64,
    /// From the split (routing known on the host) to the join (both lanes done).
    pub wall_us: f64,
    /// Time both lanes were busy at once (the hot lane placed on the host clock at the time it
    /// could start, lasting `hot_us`).
    pub overlap_us: f64,
    /// Time the join waited for the later lane.
    pub join_wait_us: f64,
    /// The layer fell back to all-cold.
    pub fell_back: bool,
    /// The host split the layer between the lanes (`wall_us` measured).
    pub split: bool,
}

/// Statistics of the last forward call.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ForwardStats {
    pub n_tokens: usize,
    /// The call ran as two micro-batches whose lanes ping-pong (their layers' figures summed).
    pub ping_pong: bool,
    pub prefill: bool,
    pub layers: Vec<LayerLaneStats>,
    /// Host wall time of the whole call, logits copy included.
    pub total_us: f64,
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Fold a layer's record and its hot-lane GPU time into lane statistics.
pub(crate) fn lane_stats(r: &LayerRecord, hot_us: f64) -> LayerLaneStats {
    let mut s = LayerLaneStats {
        hot_slots: r.hot_slots,
        cold_slots: r.cold_slots,
        cold_rows: r.cold_rows,
        hot_us,
        wall_us: r.wall_us,
        join_wait_us: r.join_wait_us,
        fell_back: !r.launched,
        split: r.split,
        ..Default::default()
    };
    if let (Some(hs), Some((cs, ce))) = (r.hot_at, r.cold) {
        s.cold_us = us(ce - cs);
        let he = hs + Duration::from_secs_f64(hot_us / 1e6);
        s.overlap_us = he.min(ce).checked_duration_since(hs.max(cs)).map_or(0.0, us);
        if r.gpu_joined {
            s.join_wait_us = us(if ce > he { ce - he } else { he - ce });
        }
    }
    s
}

impl LayerLaneStats {
    /// One layer's figures over both micro-batches of a ping-pong step: counts and times
    /// summed, fallen back or split if either was.
    pub(crate) fn merged(&self, b: &LayerLaneStats) -> LayerLaneStats {
        LayerLaneStats {
            hot_slots: self.hot_slots + b.hot_slots,
            cold_slots: self.cold_slots + b.cold_slots,
            cold_rows: self.cold_rows + b.cold_rows,
            hot_us: self.hot_us + b.hot_us,
            cold_us: self.cold_us + b.cold_us,
            wall_us: self.wall_us + b.wall_us,
            overlap_us: self.overlap_us + b.overlap_us,
            join_wait_us: self.join_wait_us + b.join_wait_us,
            fell_back: self.fell_back || b.fell_back,
            split: self.split || b.split,
        }
    }
}

/// Record the call's `layers` (one device's; every layer on one device) into the perf state:
/// per-layer timings, and per-slot counts from the routing ids of every layer with experts
/// (`ids[l * stride ..][.. n_slots]`; `expert_layers`), hot by the call's map.
pub(crate) fn record_call(
    perf: &mut PerfState,
    stats: &ForwardStats,
    (ids, stride, n_slots): (&[i32], usize, usize),
    hot: &HotSet,
    expert_layers: &[bool],
    layers: std::ops::Range<usize>,
) {
    if perf.mode() == PerfMode::Off {
        return;
    }
    for (l, s) in stats.layers.iter().enumerate().skip(layers.start).take(layers.len()) {
        let map = &hot.layers[l];
        let routed = if expert_layers[l] { &ids[l * stride..][..n_slots] } else { &[] };
        for &e in routed {
            perf.record_slot(l, e as usize, map.is_hot(e as usize));
        }
        let timing = LayerTiming {
            routing_us: 0,
            worklist_us: 0,
            hot_us: s.hot_us as u64,
            cold_us: s.cold_us as u64,
            wall_us: s.wall_us as u64,
            overlap_us: s.overlap_us as u64,
            join_wait_us: s.join_wait_us as u64,
            merge_us: 0,
            split: s.split,
        };
        perf.record_layer_call(l, &timing, !s.fell_back);
    }
}

/// Events around each layer's hot lane, reused every call, and the lane's last decode time
/// they measured (what a decode graph's untimed all-hot layer reports, see
/// [`super::graph::HOT_TIMING_EVERY_CALLS`]).
pub(crate) struct LaneEvents {
    pub start: GpuEvent,
    pub end: GpuEvent,
    pub last_hot_us: f64,
}

impl LaneEvents {
    pub fn new(start: GpuEvent, end: GpuEvent) -> LaneEvents {
        LaneEvents { start, end, last_hot_us: 0.0 }
    }

    /// A pair for each of `n_layers` layers.
    pub fn per_layer(
        be: &moe_lanes_kernels::cuda::CudaBackend,
        n_layers: usize,
    ) -> Result<Vec<LaneEvents>, GpuError> {
        (0..n_layers).map(|_| Ok(LaneEvents::new(be.event()?, be.event()?))).collect()
    }

    /// The hot lane's GPU time in a call: measured by the events when the lane was timed
    /// (kept when the call is a decode call), else (an untimed all-hot layer of a decode graph)
    /// the last decode call's measured time; 0 when no hot lane ran.
    pub fn hot_us(&mut self, r: &LayerRecord, decode: bool) -> Result<f64, GpuError> {
        if r.hot_at.is_some() {
            let us = self.start.elapsed_ms(&self.end)? as f64 * 1e3;
            if decode {
                self.last_hot_us = us;
            }
            return Ok(us);
        }
        Ok(if r.hot_untimed { self.last_hot_us } else { 0.0 })
    }
}

/// Stage names of the opt-in per-stage GPU timing breakdown (`MOE_LANES_GPU_PROFILE=1`): the
/// time on the GPU timeline between consecutive CUDA events recorded at stage boundaries, so a
/// stage includes any time the GPU sat idle waiting for the host (synchronisation, host work).
pub const PROFILE_LAYER_STAGES: [&str; 9] = [
    "qkv+norm+rope",
    "attention kernel",
    "o proj",
    "ffn norm+router+topk+D2H",
    "shared expert",
    "worklist: host sync+build+H2D | decode: GPU kernel",
    "hot lane",
    "cold lane: (decode: host sync) compute+H2D+add",
    "residual add",
];
/// Stages outside the layers: embedding, final norm + lm_head, argmax.
pub const PROFILE_TAIL_STAGES: [&str; 3] = ["embed", "final norm+lm_head", "argmax"];

/// Accumulated per-stage times (microseconds) over forward calls, per phase.
#[derive(Debug, Clone, Default)]
pub struct StageProfile {
    pub calls: usize,
    pub tokens: usize,
    pub layer_calls: usize,
    /// Summed over layers and calls.
    pub layer_us: [f64; 9],
    pub tail_us: [f64; 3],
    /// Host time of the logits + argmax copies.
    pub copy_us: f64,
    /// Host wall time of the calls.
    pub total_us: f64,
    /// Host time from the call's start to the start of the final copy (all work enqueued). Close
    /// to `total_us` with a short final copy: the host, not the GPU, sets the pace.
    pub enqueue_us: f64,
}

impl StageProfile {
    pub fn report(&self, name: &str) -> String {
        if self.calls == 0 {
            return String::new();
        }
        let per = |v: f64| v / self.calls as f64;
        let lc = self.layer_calls.max(1) as f64;
        let mut out = format!(
            "{name}: {} calls, {:.1} tokens/call, wall {:.1} us/call\n",
            self.calls,
            self.tokens as f64 / self.calls as f64,
            per(self.total_us)
        );
        let mut gpu_sum = 0.0;
        for (i, n) in PROFILE_LAYER_STAGES.iter().enumerate() {
            gpu_sum += self.layer_us[i];
            out += &format!(
                "  layer  {n:40} {:10.1} us/layer {:10.1} us/call\n",
                self.layer_us[i] / lc,
                per(self.layer_us[i])
            );
        }
        for (i, n) in PROFILE_TAIL_STAGES.iter().enumerate() {
            gpu_sum += self.tail_us[i];
            out += &format!("  tail   {n:40} {:>10} {:10.1} us/call\n", "", per(self.tail_us[i]));
        }
        out +=
            &format!("  host   {:40} {:>10} {:10.1} us/call\n", "logits+argmax copy", "", per(self.copy_us));
        out += &format!("  sum of GPU stages {:.1} us/call\n", per(gpu_sum));
        out +=
            &format!("  host enqueue (call start -> final copy start) {:.1} us/call\n", per(self.enqueue_us));
        out
    }
}

/// Events and sums of the per-stage profile.
pub(crate) struct Profiler {
    /// `[layer][mark]`, marks 0..=9 (stage i runs from mark i to mark i + 1).
    pub layer_marks: Vec<Vec<GpuEvent>>,
    /// start, before embed; after lm_head; after argmax.
    pub tail_marks: Vec<GpuEvent>,
    pub decode: StageProfile,
    pub prefill: StageProfile,
}

/// Host-side times of one call, for the profile.
pub(crate) struct CallTimes {
    pub decode: bool,
    pub n_tokens: usize,
    pub copy_us: f64,
    pub enqueue_us: f64,
    pub total_us: f64,
}

impl Profiler {
    /// After the stream is idle: add this call's stage times.
    pub fn collect(&mut self, t: &CallTimes) -> Result<(), GpuError> {
        let prof = if t.decode { &mut self.decode } else { &mut self.prefill };
        prof.calls += 1;
        prof.tokens += t.n_tokens;
        prof.layer_calls += self.layer_marks.len();
        prof.copy_us += t.copy_us;
        prof.total_us += t.total_us;
        prof.enqueue_us += t.enqueue_us;
        for marks in &self.layer_marks {
            for i in 0..PROFILE_LAYER_STAGES.len() {
                prof.layer_us[i] += marks[i].elapsed_ms(&marks[i + 1])? as f64 * 1e3;
            }
        }
        let first = &self.layer_marks[0][0];
        let last = &self.layer_marks[self.layer_marks.len() - 1][PROFILE_LAYER_STAGES.len()];
        prof.tail_us[0] += self.tail_marks[0].elapsed_ms(first)? as f64 * 1e3;
        prof.tail_us[1] += last.elapsed_ms(&self.tail_marks[1])? as f64 * 1e3;
        prof.tail_us[2] += self.tail_marks[1].elapsed_ms(&self.tail_marks[2])? as f64 * 1e3;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ping-pong layer's figures: both micro-batches' counts and times summed, fallen back or
    /// split when either was.
    #[test]
    fn merged_lane_stats_sum_both_micro_batches() {
        let a = LayerLaneStats {
            hot_slots: 3,
            cold_slots: 5,
            cold_rows: 1,
            hot_us: 10.0,
            cold_us: 200.0,
            wall_us: 250.0,
            overlap_us: 40.0,
            join_wait_us: 2.0,
            fell_back: false,
            split: true,
        };
        let b = LayerLaneStats { hot_slots: 1, cold_slots: 7, cold_rows: 2, fell_back: true, ..a.clone() };
        let m = a.merged(&b);
        assert_eq!((m.hot_slots, m.cold_slots, m.cold_rows), (4, 12, 3));
        assert_eq!((m.cold_us, m.overlap_us, m.join_wait_us, m.wall_us), (400.0, 80.0, 4.0, 500.0));
        assert!(m.fell_back && m.split);
        assert!(!a.merged(&a).fell_back);
    }
}
