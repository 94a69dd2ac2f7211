//! The decode graph: a one-token decode call over a model whose every layer is all hot has no
//! host step between its kernels (the worklist is built on the GPU, nothing goes to the cold
//! lane), so it is captured once into a CUDA graph and replayed for every later token: one
//! launch instead of about a dozen per layer, and no launch gaps between the kernels on the GPU.
//!
//! What changes from token to token lives in device memory (`Scratch::step`: the token id and
//! its position, one small upload per token): the embedding reads the id, the fused q/k norm +
//! RoPE kernel reads the position and appends the new key/value rows to the cache there, and the
//! split attention reads it too, over a grid sized for a bucket of positions (powers of two):
//! crossing into the next bucket captures again. Every allocation the graph points into is part
//! of its key by serial number, not by address (KV cache, scratch, attention partials: the
//! stream-ordered allocator gives a freed address to the next allocation that fits, so a grown
//! scratch can start where the old one did while its other buffers moved; a new hot-cache
//! allocation drops the graph);
//! exchanges rewrite slots in place, so they only need ordering before the launch. The results
//! are the eager call's, bit for bit (the same kernels in the same order; the extra attention
//! splits are empty and add exact zeros).

use super::head::{embed_rows, head_kernels};
use super::kv::GpuKvCache;
use super::model::{GpuModel, GpuSeg};
use super::options::GpuFaults;
use super::route::add_moe_output;
use super::shard::Shard;
use super::stats::LayerRecord;
use super::GpuError;
use crate::cache::perf::{PerfMode, PerfState};
use crate::forward::LogitRows;
use crate::forward::Logits;
use crate::moe::cold::ColdLane;
use crate::moe::phase::Phase;
use moe_lanes_kernels::cuda::StreamGraph;
use std::time::Instant;

/// Smallest attention bucket: positions below it share one graph.
const MIN_GRAPH_POSITIONS: usize = 256;

/// One decode call in this many that could replay graphs runs eagerly instead, with CUDA events
/// around every hot lane, when the perf state records (and `GpuOptions::graph_lane_events` is
/// off): the graphs' all-hot layers carry no events, which would stop programmatic dependent
/// launch at each hot lane, and report the times of the last timed call. Cost: that call's
/// launches, about 7% of one token in 64 (0.1% of tg).
pub(crate) const HOT_TIMING_EVERY_CALLS: u64 = 64;

/// Everything a captured decode graph points at, as allocation serials
/// (`DeviceBuffer::serial`); a change means capturing again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GraphKey {
    kv_cache: u64,
    scratch: u64,
    attn_part: u64,
    /// The split attention's grid covers this many positions before the token.
    max_positions: usize,
    profile: bool,
}

/// One device's decode graphs of the last calls that could replay them.
#[derive(Default)]
pub(crate) struct Graphs {
    /// The captured one-token decode call, replayed while its key holds.
    graph: Option<DecodeGraph>,
    /// The captured decode call of a model with cold experts in some layers.
    segments: Option<DecodeSegments>,
}

pub(crate) struct DecodeGraph {
    graph: StreamGraph,
    key: GraphKey,
    /// The layer records the captured call left: a replay does the same work.
    records: Vec<LayerRecord>,
}

/// The attention bucket for a token at `pos0` in a cache of `capacity` positions: the grid
/// covers `bucket + 1` positions, at least `pos0 + 1` and at most `capacity`.
fn positions_bucket(pos0: usize, capacity: usize) -> usize {
    assert!(pos0 < capacity, "the call was checked against the cache capacity");
    (pos0 + 1).next_power_of_two().max(MIN_GRAPH_POSITIONS).min(capacity) - 1
}

/// What a decode step's graphs run with: the cold lane, the perf state (a split layer's cold
/// lane counts its fallbacks), which logits rows the head writes.
pub(crate) struct StepLanes<'a> {
    pub cold: &'a mut dyn ColdLane,
    pub perf: &'a mut PerfState,
    pub rows: LogitRows,
}

impl GpuModel {
    /// Whether this decode call, which graphs could run, runs eagerly to time the hot lanes
    /// ([`HOT_TIMING_EVERY_CALLS`]; the first such call is one); counts the calls.
    pub(super) fn timing_sample(&mut self, tokens: &[u32], phase: Phase) -> bool {
        if self.shards[0].dev.opts.graph_lane_events
            || self.perf.mode() == PerfMode::Off
            || !self.graphs_apply(tokens, phase)
        {
            return false;
        }
        self.graph_calls += 1;
        self.graph_calls % HOT_TIMING_EVERY_CALLS == 1
    }

    /// Graphs on, one decode token, no injected faults, the fused q/k norm + RoPE: each device
    /// runs its layers as the decode graph (all hot) or as decode segments (some cold experts).
    pub(super) fn graphs_apply(&self, tokens: &[u32], phase: Phase) -> bool {
        let first = &self.shards[0];
        let opts = &first.dev.opts;
        opts.decode_graph
            && phase == Phase::Decode
            && tokens.len() == 1
            && opts.faults == GpuFaults::default()
            && first.mixer.qk_fused_all
    }

    /// A decode call through each device's graphs in layer order (the hidden row hopping
    /// between devices), then the logits and greedy token back and the call's stats.
    pub(super) fn forward_graphs(
        &mut self,
        token: u32,
        cache: &mut GpuKvCache,
        cold: &mut dyn ColdLane,
        rows: LogitRows,
        call_start: Instant,
    ) -> Result<Logits, GpuError> {
        let n = self.shards.len();
        for d in 0..n {
            if d > 0 {
                self.hop(d, 1)?;
            }
            self.enter(d)?;
            let sh = &mut self.shards[d];
            let mut lanes = StepLanes { cold: &mut *cold, perf: &mut self.perf, rows };
            if sh.all_hot() {
                sh.forward_graph(token, cache, &mut lanes)?;
            } else {
                sh.forward_segments(token, cache, &mut lanes)?;
            }
        }
        let copy_start = Instant::now();
        let mode = self.perf.mode();
        let logits = self.last_mut().head_copies(mode, 1, 1)?;
        let copy_us = copy_start.elapsed().as_secs_f64() * 1e6;
        cache.n_positions += 1;
        self.finish_call(Phase::Decode, 1, call_start, copy_start, copy_us)?;
        Ok(logits)
    }
}

impl Shard {
    /// Whether every layer of this device is all hot (no cold lane, no host step): its decode
    /// step is one graph.
    pub(super) fn all_hot(&self) -> bool {
        self.layers().all(|l| self.moe.hot.all_hot(l))
    }

    /// Before a decode step's graphs: the attention partials reserved, the token and its
    /// position on the device; the key the step's graphs need.
    fn graph_step_start(&mut self, token: u32, cache: &GpuKvCache) -> Result<GraphKey, GpuError> {
        let pos0 = cache.n_positions;
        self.mixer.reserve_attention(&self.dev, 1, cache)?;
        let key = self.graph_key(cache, positions_bucket(pos0, cache.capacity));
        let dev = &self.dev;
        dev.be.write(&[token as i32, pos0 as i32], dev.s().step.ptr())?;
        Ok(key)
    }

    /// This device's decode step through its graph (captured first when its key changed).
    fn forward_graph(
        &mut self,
        token: u32,
        cache: &GpuKvCache,
        lanes: &mut StepLanes<'_>,
    ) -> Result<(), GpuError> {
        let pos0 = cache.n_positions;
        let key = self.graph_step_start(token, cache)?;
        if self.graphs.graph.as_ref().is_none_or(|g| g.key != key) {
            self.graphs.graph = None;
            self.graphs.graph = Some(self.capture(key, pos0, cache, lanes)?);
        }
        let g = self.graphs.graph.as_ref().expect("captured above");
        self.dev.be.launch_graph(&g.graph)?;
        replay_records(&mut self.moe.records, &g.records);
        Ok(())
    }

    fn graph_key(&self, cache: &GpuKvCache, max_positions: usize) -> GraphKey {
        GraphKey {
            // One buffer stands for each owner: a KV cache's and a scratch's buffers are
            // allocated together and replaced together (the stages' pinned buffers with the
            // scratch).
            kv_cache: cache.serial(),
            scratch: self.dev.s().hidden.serial(),
            attn_part: self.mixer.part_serial(),
            max_positions,
            profile: self.dev.profiler.is_some(),
        }
    }

    /// Capture one decode step's kernels on this device (the embedding on the first, its
    /// layers, the head to the argmax on the last) into a graph. The capture always ends, so a
    /// failed enqueue leaves the stream usable.
    fn capture(
        &mut self,
        key: GraphKey,
        pos0: usize,
        cache: &GpuKvCache,
        lanes: &mut StepLanes<'_>,
    ) -> Result<DecodeGraph, GpuError> {
        self.dev.be.begin_capture()?;
        self.dev.step = Some(key.max_positions);
        let enqueued = self.enqueue_decode(pos0, cache, lanes);
        self.dev.step = None;
        let graph = self.dev.be.end_capture();
        enqueued?;
        Ok(DecodeGraph { graph: graph?, key, records: self.moe.records.clone() })
    }

    fn enqueue_decode(
        &mut self,
        pos0: usize,
        cache: &GpuKvCache,
        lanes: &mut StepLanes<'_>,
    ) -> Result<(), GpuError> {
        let layers = self.layers();
        self.part_start(layers.start)?;
        self.whole_layers(layers, pos0, cache, lanes)?;
        self.head_end(lanes.rows)
    }

    /// The head's kernels on the device that runs it (nothing on the others).
    fn head_end(&self, rows: LogitRows) -> Result<(), GpuError> {
        if self.dev.ends.head {
            head_kernels(&self.dev, Phase::Decode, 1, rows)?;
        }
        Ok(())
    }
}

/// A decode call over a model with cold experts in some layers ("split" layers), as graphs
/// between its host steps: part i runs from the previous split layer's join (the add of its
/// MoE output) through the next split layer's attention and routing (its copy to the host
/// included), then that layer's hot lane is its own graph, launched before the host waits for
/// the routing, so the hot GEMVs run while the host builds the worklist and the CPU computes
/// the cold experts (queued on the stream eagerly, as without graphs). All-hot layers between
/// split layers run inside the parts. One graph launch replaces a dozen kernel launches per
/// layer, so the host's launches no longer pace the GPU after each join. Same kernels in the
/// same order as the eager call: the same bits.
pub(crate) struct DecodeSegments {
    key: GraphKey,
    /// The split layers, ascending; part i ends at split layer i, the last part at the logits.
    split_layers: Vec<usize>,
    parts: Vec<StreamGraph>,
    /// The hot lane of split layer i.
    hot: Vec<StreamGraph>,
    /// The layer records the capture left (the all-hot layers' stay as they are).
    records: Vec<LayerRecord>,
}

impl Shard {
    /// This device's layers with cold experts, ascending.
    fn split_layers(&self) -> impl Iterator<Item = usize> + '_ {
        self.layers().filter(|&l| !self.moe.hot.all_hot(l))
    }

    /// This device's decode step through its segments (captured first when the key or the
    /// split layers changed).
    fn forward_segments(
        &mut self,
        token: u32,
        cache: &GpuKvCache,
        lanes: &mut StepLanes<'_>,
    ) -> Result<(), GpuError> {
        let pos0 = cache.n_positions;
        let key = self.graph_step_start(token, cache)?;
        let stale =
            |g: &DecodeSegments| g.key != key || !g.split_layers.iter().copied().eq(self.split_layers());
        if self.graphs.segments.as_ref().is_none_or(stale) {
            self.graphs.segments = None;
            let split = self.split_layers().collect();
            self.graphs.segments = Some(self.capture_segments(key, pos0, cache, lanes, split)?);
        }
        let segs = self.graphs.segments.take().expect("captured above");
        let run = self.run_segments(&segs, lanes);
        self.graphs.segments = Some(segs);
        run
    }

    /// Launch the parts and hot lanes in turn, each split layer's cold lane on the host between.
    fn run_segments(&mut self, segs: &DecodeSegments, lanes: &mut StepLanes<'_>) -> Result<(), GpuError> {
        replay_records(&mut self.moe.records, &segs.records);
        for (i, part) in segs.parts.iter().enumerate() {
            self.dev.be.launch_graph(part)?;
            let Some(&l) = segs.split_layers.get(i) else { break };
            self.moe.pin.route.fence_replayed();
            self.dev.be.launch_graph(&segs.hot[i])?;
            self.split_layer_cold(l, lanes.cold, lanes.perf)?;
        }
        Ok(())
    }

    /// Capture the parts and hot lanes of a decode step whose `split` layers have cold experts.
    fn capture_segments(
        &mut self,
        key: GraphKey,
        pos0: usize,
        cache: &GpuKvCache,
        lanes: &mut StepLanes<'_>,
        split: Vec<usize>,
    ) -> Result<DecodeSegments, GpuError> {
        self.dev.step = Some(key.max_positions);
        let (mut parts, mut hot) = (Vec::with_capacity(split.len() + 1), Vec::with_capacity(split.len()));
        let enqueued = self.enqueue_segments(pos0, cache, lanes, &split, (&mut parts, &mut hot));
        self.dev.step = None;
        enqueued?;
        Ok(DecodeSegments { key, split_layers: split, parts, hot, records: self.moe.records.clone() })
    }

    fn enqueue_segments(
        &mut self,
        pos0: usize,
        cache: &GpuKvCache,
        lanes: &mut StepLanes<'_>,
        split: &[usize],
        (parts, hot): (&mut Vec<StreamGraph>, &mut Vec<StreamGraph>),
    ) -> Result<(), GpuError> {
        let mut first = self.dev.layers.start;
        for &sl in split {
            let mut plan = None;
            self.captured(parts, |m| {
                m.part_start(first)?;
                m.whole_layers(first..sl, pos0, cache, lanes)?;
                plan = Some(m.split_layer_start(sl, GpuSeg { row0: 0, n: 1, pos0, cache })?);
                Ok(())
            })?;
            let plan = plan.expect("routed above");
            assert!(plan.device_path && !plan.direct, "a split decode layer takes the device path");
            let fault = |_| GpuError::HotLaneCapture { layer_idx: sl };
            self.captured(hot, |m| m.split_layer_hot(sl, plan).map_err(fault))?;
            first = sl + 1;
        }
        self.captured(parts, |m| {
            m.part_start(first)?;
            m.whole_layers(first..m.dev.layers.end, pos0, cache, lanes)?;
            m.head_end(lanes.rows)
        })
    }

    /// A part's first work: at the device's first layer the embedding (the first device) or
    /// nothing (the hidden row hopped in before the launch); else the previous layer's MoE output
    /// added into the residual stream.
    fn part_start(&mut self, first: usize) -> Result<(), GpuError> {
        let dev = &self.dev;
        let s = dev.s();
        if first == dev.layers.start {
            if dev.ends.embed {
                dev.mark_tail(0)?;
                embed_rows(dev, s.step.ptr().sub(0, 1))?;
            }
            return Ok(());
        }
        add_moe_output(dev, first - 1, 1)?;
        dev.mark(first - 1, 9)
    }

    fn whole_layers(
        &mut self,
        layers: std::ops::Range<usize>,
        pos0: usize,
        cache: &GpuKvCache,
        lanes: &mut StepLanes<'_>,
    ) -> Result<(), GpuError> {
        let segs = [GpuSeg { row0: 0, n: 1, pos0, cache }];
        self.run_layers(layers, Phase::Decode, (1, &segs), lanes.cold, lanes.perf)
    }

    /// Run `f`'s enqueues as one captured graph, appended to `graphs`; the capture always ends,
    /// so a failed enqueue leaves the stream usable.
    fn captured(
        &mut self,
        graphs: &mut Vec<StreamGraph>,
        f: impl FnOnce(&mut Self) -> Result<(), GpuError>,
    ) -> Result<(), GpuError> {
        self.dev.be.begin_capture()?;
        let enqueued = f(self);
        let graph = self.dev.be.end_capture();
        enqueued?;
        graphs.push(graph?);
        Ok(())
    }
}

/// The layer records of a replay: the ones captured with the graphs (what each layer ran),
/// copied into `records`' storage, their timed hot lanes started now.
fn replay_records(records: &mut Vec<LayerRecord>, captured: &[LayerRecord]) {
    records.clear();
    records.extend_from_slice(captured);
    let now = Instant::now();
    records.iter_mut().filter(|r| r.hot_at.is_some()).for_each(|r| r.hot_at = Some(now));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_the_position_and_stay_in_the_cache() {
        assert_eq!(positions_bucket(0, 4096), 255);
        assert_eq!(positions_bucket(255, 4096), 255);
        assert_eq!(positions_bucket(256, 4096), 511);
        assert_eq!(positions_bucket(3000, 4096), 4095);
        assert_eq!(positions_bucket(10, 100), 99);
        for (pos0, cap) in [(0, 1), (7, 8), (511, 513), (1000, 5000)] {
            let b = positions_bucket(pos0, cap);
            assert!(b >= pos0 && b < cap, "{pos0} {cap} -> {b}");
        }
    }

    /// A paged cache commits every position a decode token's graph may address: the bucket's.
    #[test]
    fn paged_caches_commit_the_whole_bucket() {
        for cap in [1, 8, 300, 513, 1024, 5000, 32768] {
            for pos0 in 0..cap.min(3000) {
                let committed = super::super::kv::committed_positions(pos0 + 1, cap);
                assert!(committed > positions_bucket(pos0, cap), "{pos0} of {cap}: {committed}");
            }
        }
    }
}
