//! One device's part of the model ([`Shard`]): a contiguous range of layers with their dense
//! weights, hot-cache slots, Post-Fetch scratchpad, scratch and decode graphs on one
//! [`CudaBackend`], and the ends of the model it runs beside them (the embedding on the first
//! device, the head on the last). [`super::GpuModel`] walks its shards in layer order; on one
//! device its one shard holds every layer and both ends, and the walk is the single-device
//! engine's, with no copy or synchronisation added.
//!
//! Every buffer a shard owns is indexed by the model's layer numbers (the hot cache's maps, the
//! lane records and events, the routing ids of the scratch); only the shard's own layers are
//! filled and run.

use super::device::{Device, LayerCtx};
use super::graph::Graphs;
use super::head::HeadStage;
use super::hot_cache::HotCache;
use super::kv::GpuKvCache;
use super::mixer::MixerStage;
use super::model::{dequant_scratch, widest_attention, GpuSeg};
use super::moe::{LayerFault, MoePlan, MoeStage};
use super::options::GpuOptions;
use super::postfetch::PostFetch;
use super::scratch::Scratch;
use super::stats::{self, LayerLaneStats};
use super::weights::{DenseWeights, Ends};
use super::GpuError;
use crate::cache::hot_set::HotSet;
use crate::cache::perf::{PerfMode, PerfState};
use crate::forward::Logits;
use crate::model::Model;
use crate::moe::cold::{ColdLane, PlainColdLane};
use crate::moe::phase::Phase;
use moe_lanes_kernels::cuda::CudaBackend;
use std::ops::Range;
use std::sync::Arc;

/// What one device holds and runs: the shared [`Device`] of its layers (backend, weights,
/// scratch), the mixers, the MoE layers (hot cache, lanes, join, Post-Fetch), the embedding and
/// head stage, and its decode graphs.
pub(crate) struct Shard {
    pub(super) dev: Device,
    pub(super) mixer: MixerStage,
    pub(super) moe: MoeStage,
    pub(super) head: HeadStage,
    pub(super) graphs: Graphs,
    /// The forward call being run (counted from 1 by the model): the injected faults' clock.
    pub(super) call_idx: u64,
    /// The second micro-batch's buffers of a ping-pong step, kept between calls.
    pub(super) micro: Option<super::ping_pong::MicroState>,
    /// The last call ran as two micro-batches of these many rows (`ping_pong`).
    pub(super) ping_pong: Option<(usize, usize)>,
}

/// Per-device figures of a model split over GPUs (the perf JSON's `devices`, `bench --json`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DeviceReport {
    /// The CUDA ordinal.
    pub ordinal: usize,
    pub name: String,
    /// The layers it runs, `[first, end)`.
    pub layers: [usize; 2],
    /// Non-expert matrices on the device (its layers', and the embedding or lm_head it runs).
    pub dense_mib: f64,
    /// Its hot cache.
    pub hot_mib: f64,
    /// Experts its hot cache holds (every layer of its range).
    pub experts_cached: usize,
}

impl Shard {
    /// Upload the weights of `layers` and of the `ends` it runs to `be`'s device; its hot cache
    /// starts empty.
    pub fn new(
        model: Arc<Model>,
        be: Arc<CudaBackend>,
        (layers, ends): (Range<usize>, Ends),
        opts: GpuOptions,
    ) -> Result<Shard, GpuError> {
        be.bind_to_thread()?;
        let cfg = model.config().clone();
        let w = DenseWeights::upload(&model, &be, layers.clone(), ends)?;
        let hot = HotCache::empty(&be, &model)?;
        let dequant = dequant_scratch(&be, (&cfg, model.plan()), &w, &hot)?;
        let postfetch = PostFetch::new(&be, &model, opts.postfetch)?;
        let moe = MoeStage::new(&be, &cfg, hot, postfetch, PlainColdLane::new(model.clone()))?;
        Ok(Shard {
            mixer: MixerStage::new(model.plan()),
            moe,
            head: HeadStage::new(&be, &cfg, 8)?,
            graphs: Graphs::default(),
            call_idx: 0,
            micro: None,
            ping_pong: None,
            dev: Device {
                plan: model.plan().clone(),
                expert_layers: model.plan().expert_layers(),
                layers,
                ends,
                w,
                scratch: None,
                dequant,
                profiler: None,
                step: None,
                rows: None,
                opts,
                cfg,
                model,
                be,
            },
        })
    }

    /// The layers this device runs.
    pub fn layers(&self) -> Range<usize> {
        self.dev.layers.clone()
    }

    /// Allocate the hot cache once for `set` (its layers outside this device's range are empty)
    /// and fill it; Post-Fetch's scratchpad fitted to the device's layer with the most cold
    /// experts.
    pub fn allocate_hot(&mut self, set: &HotSet) -> Result<(), GpuError> {
        self.dev.be.bind_to_thread()?;
        self.graphs = Graphs::default(); // their slot pointers go with the old cache
        let (be, model) = (&self.dev.be, &self.dev.model);
        self.moe.hot.allocate(be, model, set)?;
        if let Some(pf) = self.moe.postfetch.as_mut() {
            let n = self.dev.cfg.n_experts;
            let cold = set.layers[self.dev.layers.clone()].iter().map(|ls| n - ls.n_hot().min(n));
            pf.fit_slots(be, super::postfetch::plan::fitted_slots(pf.slots, cold))?;
        }
        Ok(())
    }

    /// Exchange one cache slot of one of this device's layers between calls.
    pub fn exchange(&mut self, layer_idx: usize, evict: usize, add: usize) -> Result<(), GpuError> {
        self.dev.be.bind_to_thread()?;
        let src = self.moe.postfetch.as_ref().and_then(|pf| pf.exchange_source());
        self.moe.hot.exchange(&self.dev.be, &self.dev.model, src, (layer_idx, evict, add))
    }

    /// Device scratch (and the stages' host twins) for calls of up to `t` tokens; grows, never
    /// shrinks.
    pub fn reserve_tokens(&mut self, t: usize) -> Result<(), GpuError> {
        if self.reserve_scratch(t)? {
            self.head = HeadStage::new(&self.dev.be, &self.dev.cfg, self.dev.s().cap)?;
        }
        Ok(())
    }

    /// The device scratch and the MoE stage's host and pinned buffers (not the head's) for
    /// calls of up to `t` tokens; whether they grew.
    pub(super) fn reserve_scratch(&mut self, t: usize) -> Result<bool, GpuError> {
        let dev = &mut self.dev;
        if dev.scratch.as_ref().is_some_and(|s| s.cap >= t) {
            return Ok(false);
        }
        dev.scratch = None; // free first
        let gated = dev.plan.layers().iter().any(|l| l.as_attention().is_some_and(|a| a.output_gate));
        let dense_ff = dev.plan.layers().iter().filter_map(|l| match l.ffn {
            crate::model::arch::Ffn::Dense(d) => Some(d.ff),
            crate::model::arch::Ffn::Moe(_) => None,
        });
        let attn = widest_attention(&dev.plan, &dev.cfg);
        let head = dev.ends.head;
        let s = Scratch::new(&dev.be, &dev.cfg, t, head, gated, dense_ff.max().unwrap_or(0), attn)?;
        self.moe.reserve(&dev.be, &dev.cfg, s.cap)?;
        dev.scratch = Some(s);
        Ok(true)
    }

    /// A call's start on this device (its context bound): exchanges whose copies landed
    /// admitted (how many), scratch for `t` rows, each sequence's paged KV buffers of this
    /// device's layers committed for the positions it will hold after the call, and a new (or
    /// cleared) session's recurrent state of this device's layers zeroed.
    pub fn start(
        &mut self,
        call_idx: u64,
        t: usize,
        seqs: &mut [(&[u32], &mut GpuKvCache)],
    ) -> Result<usize, GpuError> {
        self.call_idx = call_idx;
        self.ping_pong = None;
        self.dev.be.bind_to_thread()?;
        let landed = self.moe.hot.admit_landed(&self.dev.be)?;
        self.reserve_tokens(t)?;
        for (tokens, cache) in seqs.iter_mut() {
            cache.commit(&self.dev.be, self.layers(), cache.n_positions + tokens.len())?;
            if cache.n_positions == 0 {
                cache.reset_recurrent(&self.dev.be, self.layers())?;
            }
        }
        Ok(landed)
    }

    /// The `layers` (of this device's) over the call's `t` rows: each layer's mixer (per
    /// sequence, `segs`), then its MoE block.
    pub fn run_layers(
        &mut self,
        layers: Range<usize>,
        phase: Phase,
        (t, segs): (usize, &[GpuSeg<'_>]),
        cold: &mut dyn ColdLane,
        perf: &mut PerfState,
    ) -> Result<(), GpuError> {
        for l in layers {
            let cx = LayerCtx::of(&self.dev, self.call_idx, l, phase, t);
            cx.mark(0)?;
            self.mixer.run(&cx, segs)?;
            self.moe.run(&cx, perf, cold)?;
        }
        Ok(())
    }

    /// A split layer's start in the decode segments (one token): its mark, mixer and routing;
    /// how its MoE block runs.
    pub fn split_layer_start(&mut self, l: usize, seg: GpuSeg<'_>) -> Result<MoePlan, GpuError> {
        let cx = LayerCtx::of(&self.dev, self.call_idx, l, Phase::Decode, 1);
        cx.mark(0)?;
        self.mixer.run(&cx, &[seg])?;
        self.moe.route_layer(&cx)
    }

    /// A split layer's hot lane in the decode segments.
    pub fn split_layer_hot(&mut self, l: usize, plan: MoePlan) -> Result<(), LayerFault> {
        let cx = LayerCtx::of(&self.dev, self.call_idx, l, Phase::Decode, 1);
        self.moe.hot_lane_device(&cx, plan)
    }

    /// A split layer's cold lane between the decode segments' graphs, settled (a failed lane
    /// recomputed all-cold); the next part adds the layer's MoE output.
    pub fn split_layer_cold(
        &mut self,
        l: usize,
        cold: &mut dyn ColdLane,
        perf: &mut PerfState,
    ) -> Result<(), GpuError> {
        let cx = LayerCtx::of(&self.dev, self.call_idx, l, Phase::Decode, 1);
        let outcome = self.moe.cold_lane_device(&cx, cold);
        self.moe.settle(&cx, perf, cold, outcome).map(|_| ())
    }

    /// The embedding of the call's tokens (the first device).
    pub fn embed(&mut self, tokens: &[u32]) -> Result<(), GpuError> {
        self.head.embed(&self.dev, tokens)
    }

    /// The head's copies back for a call of `t` rows and `n` logits rows (the last device).
    pub fn head_copies(&mut self, perf_mode: PerfMode, t: usize, n: usize) -> Result<Logits, GpuError> {
        self.head.copies(&self.dev, perf_mode, t, n)
    }

    /// After the stream is idle: this device's layers' lane statistics appended to `layers`,
    /// and Post-Fetch's totals into `perf` (decode calls fetch only with
    /// `PostFetchOptions::decode`).
    pub fn finish_lanes(
        &mut self,
        phase: Phase,
        layers: &mut Vec<LayerLaneStats>,
        perf: &mut PerfState,
    ) -> Result<(), GpuError> {
        let decode = phase == Phase::Decode;
        let range = self.layers();
        let records = self.moe.records[range.clone()].iter();
        let first = layers.len();
        for (r, ev) in records.zip(&mut self.moe.lane_events[range]) {
            layers.push(stats::lane_stats(r, ev.hot_us(r, decode)?));
        }
        self.merge_micro_lanes(decode, &mut layers[first..])?;
        if !decode || self.moe.postfetch.as_ref().is_some_and(|p| p.opts.decode) {
            self.moe.postfetch_finish(perf)?;
        }
        Ok(())
    }

    /// This device's figures for the perf JSON.
    pub fn report(&self) -> DeviceReport {
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        let set = self.moe.hot.set();
        DeviceReport {
            ordinal: self.dev.be.info().ordinal,
            name: self.dev.be.info().name.clone(),
            layers: [self.dev.layers.start, self.dev.layers.end],
            dense_mib: mib(self.dev.w.matrix_bytes),
            hot_mib: mib(self.moe.hot.bytes()),
            experts_cached: set.layers[self.layers()].iter().map(|l| l.n_hot()).sum(),
        }
    }
}
