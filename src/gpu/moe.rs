//! The MoE block of one layer on the GPU engine: split the routed slots into the hot lane (GPU,
//! from the VRAM cache) and the cold lane (CPU, [`ColdLane`]), run both at once, join, and
//! fall back to all-cold when a lane fails.
//!
//! Two paths build the same [`Worklist`](crate::moe::worklist::Worklist):
//! - *device path* (decode, prefill calls of at most `QUANT_MAX_TOKENS` rows over quantized
//!   slots, and all-hot prefill calls whose entries the device sorts in one block): the hot
//!   worklist is built on the GPU from the routing ids and the device `hot_id_map` (token-major
//!   for the GEMVs, sorted by slot for the grouped GEMMs), so an all-hot layer never goes back to
//!   the host; when the layer has cold experts the host builds the worklist (token-major) for the
//!   cold lane, which joins on the GPU stream (no host wait);
//! - *host path* (other prefill calls, warmup, and any layer named by a fault injection): the host builds
//!   the worklist expert-major, checks it, uploads it, and the hot lane runs the grouped
//!   tensor-core GEMMs over every cached expert's gathered token rows (one launch for gate, up
//!   and the activation, one for down; quantized slots are decoded tile by tile inside those
//!   kernels); the join waits for the hot lane's event with a timeout.
//!
//! A fallback recomputes the layer's routed experts all-cold on the CPU from the RAM experts
//! (the given cold lane, or the plain one when the cold lane itself failed), overwrites the
//! layer's MoE output, adds the shared expert again, and is counted by reason.

use super::device::{Device, LayerCtx};
use super::hot_cache::{HotCache, SlotEpilogue, SlotPtrs};
use super::postfetch::{PostFetch, PF_CPU, PF_LATE};
use super::route::{add_moe_output, dense_ffn, route_fusable, route_ids, shared_expert};
use super::scratch::{HostScratch, MoePinned, RouteView, WorkLayout};
use super::stats::{LaneEvents, LayerRecord};
use super::GpuError;
use crate::cache::perf::{FallbackReason, PerfState};
use crate::model::config::ModelConfig;
use crate::moe::cold::{all_cold, ColdError, ColdLane, ColdSlot, PlainColdLane};
use crate::moe::faults::LayerFailure;
use crate::moe::phase::Phase;
use crate::moe::worklist::{WorklistError, WorklistOrder};
use moe_lanes_kernels::cuda::kernel::{
    GROUPED_DECODE_MAX_TOKENS, GROUPED_DECODE_TILE_ROWS, GROUPED_TILE_ROWS, QUANT_MAX_TOKENS,
};
use moe_lanes_kernels::cuda::ops::grouped_tiles;
use moe_lanes_kernels::cuda::quant::TYPED_TAIL_BYTES;
use moe_lanes_kernels::cuda::{CudaBackend, DPtr, GpuEvent, TypedWeights};
use moe_lanes_kernels::WeightDType;
use std::time::{Duration, Instant};

/// The MoE layers' stage: what it owns and changes between and during calls.
pub(crate) struct MoeStage {
    /// The VRAM hot cache: every layer's cached experts and their maps.
    pub hot: HotCache,
    /// Post-Fetch's scratchpad, streams and totals (none: off, or not a fetchable model).
    pub postfetch: Option<PostFetch>,
    /// Host buffers of one call (worklist, cold rows, Post-Fetch's lists).
    pub host: HostScratch,
    /// Pinned buffers of one call: the routing and the cold rows.
    pub pin: MoePinned,
    /// Per layer, the hot lane's CUDA events.
    pub lane_events: Vec<LaneEvents>,
    /// Per layer, events around a ping-pong micro-batch's front (`ping_pong`).
    pub front_events: Vec<LaneEvents>,
    /// Per layer, what its lanes did in the last call.
    pub records: Vec<LayerRecord>,
    /// The plain CPU cold lane: computes a layer when the given cold lane failed.
    fallback_cold: PlainColdLane,
}

impl MoeStage {
    pub fn new(
        be: &CudaBackend,
        dev_cfg: &ModelConfig,
        hot: HotCache,
        postfetch: Option<PostFetch>,
        fallback_cold: PlainColdLane,
    ) -> Result<MoeStage, GpuError> {
        let n_layers = dev_cfg.n_layers;
        let lane_events = LaneEvents::per_layer(be, n_layers)?;
        let front_events = LaneEvents::per_layer(be, n_layers)?;
        Ok(MoeStage {
            hot,
            postfetch,
            host: HostScratch::new(dev_cfg, 8),
            pin: MoePinned::new(be, dev_cfg, 8)?,
            lane_events,
            front_events,
            records: vec![LayerRecord::default(); n_layers],
            fallback_cold,
        })
    }

    /// Host and pinned buffers for calls of up to `cap` tokens (the device scratch's capacity).
    pub fn reserve(&mut self, be: &CudaBackend, cfg: &ModelConfig, cap: usize) -> Result<(), GpuError> {
        self.host = HostScratch::new(cfg, cap);
        self.pin = MoePinned::new(be, cfg, cap)?;
        Ok(())
    }
}

/// How a layer's MoE block runs after its routing ([`MoeStage::route_layer`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct MoePlan {
    /// Decode GEMVs, worklist on the GPU ([`MoeStage::hot_lane_device`]); else the host path.
    pub(crate) device_path: bool,
    /// The hot lane accumulates straight into the residual stream.
    pub(crate) direct: bool,
    /// The fused routing wrote the device worklist.
    pub(crate) worklist_built: bool,
}

/// How a layer's split ended when it did not end well.
pub(crate) enum LayerFault {
    /// Recompute the layer all-cold (with the plain lane when the cold lane itself failed).
    Fallback(LayerFailure),
    /// The device failed: the call cannot go on here.
    Fatal(GpuError),
}

impl From<GpuError> for LayerFault {
    fn from(e: GpuError) -> LayerFault {
        LayerFault::Fatal(e)
    }
}

impl From<moe_lanes_kernels::cuda::CudaError> for LayerFault {
    fn from(e: moe_lanes_kernels::cuda::CudaError) -> LayerFault {
        LayerFault::Fatal(e.into())
    }
}

impl From<LayerFailure> for LayerFault {
    fn from(f: LayerFailure) -> LayerFault {
        LayerFault::Fallback(f)
    }
}

fn hot_failed(e: impl std::fmt::Display) -> LayerFault {
    LayerFailure::new(FallbackReason::LaneFailed, format!("hot lane: {e}")).into()
}

pub(super) fn cold_failed(e: ColdError) -> LayerFault {
    LayerFailure::of_cold_lane(FallbackReason::LaneFailed, e.to_string()).into()
}

impl MoeStage {
    /// Layer `cx.l`'s MoE block: routing, the hot and cold lanes, the join, a fallback when a
    /// lane fails (counted in `perf`), the output added into the residual stream.
    pub fn run(
        &mut self,
        cx: &LayerCtx<'_>,
        perf: &mut PerfState,
        cold: &mut dyn ColdLane,
    ) -> Result<(), GpuError> {
        if !cx.dev.expert_layers[cx.l] {
            // a dense FFN layer: no routing, no lanes (its profile stages after the FFN are empty)
            self.records[cx.l] = LayerRecord::default();
            dense_ffn(cx)?;
            return (5..=9).try_for_each(|m| cx.mark(m));
        }
        let plan = self.route_layer(cx)?;
        let outcome =
            if plan.device_path { self.moe_device(cx, cold, plan) } else { self.moe_host(cx, cold) };
        self.finish(cx, perf, cold, outcome, plan.direct)
    }

    /// The start of layer `l`'s MoE block: its record reset, the routing (to the host when a
    /// lane there needs it) and the shared expert; how the rest runs.
    pub fn route_layer(&mut self, cx: &LayerCtx<'_>) -> Result<MoePlan, GpuError> {
        let (dev, l, phase, t) = (cx.dev, cx.l, cx.phase, cx.t);
        self.records[l] = LayerRecord::default();
        self.postfetch_reset();
        // A few prefill rows over quantized slots take the decode kernels too: they read each
        // weight once per row (as cheap as dequantizing the slots for tensor cores) and keep the
        // dequantized values exact (f32, as the CPU) instead of rounding them to bf16.
        let few_quantized =
            t <= QUANT_MAX_TOKENS as usize && self.hot.slots(l).is_some_and(|c| !c.all_bf16());
        let by_gemv = phase == Phase::Decode || few_quantized;
        let all_hot = self.hot.all_hot(l);
        // An all-hot prefill call whose worklist the device sorts (one block): the grouped GEMMs
        // on that worklist, so the layer never waits for the host.
        let grouped_prefill =
            !by_gemv && all_hot && self.hot.slots(l).is_some_and(|c| hot_grouped(dev, t, &c, phase));
        let device_path = (by_gemv || grouped_prefill) && !cx.faults.any();
        // All-hot decode without a shared expert: the hot lane accumulates straight into the
        // residual stream (no zero fill, no add).
        let lw = dev.w.layer(l);
        let direct = device_path && all_hot && lw.shared.is_none() && !lw.extras.around_output();
        let to_host = !(device_path && all_hot);
        // the fused routing (one block a row) also writes the device path's hot worklist
        let fused = device_path && by_gemv && route_fusable(dev, l);
        self.route(cx, !direct, to_host, device_path && to_host, fused)?;
        shared_expert(cx)?;
        dev.mark(l, 5)?;
        Ok(MoePlan { device_path, direct, worklist_built: fused })
    }

    /// The end of layer `l`'s MoE block: a lane's failure recomputed all-cold (counted), then
    /// the layer's MoE output added into the residual stream unless the hot lane wrote there.
    pub(super) fn finish(
        &mut self,
        cx: &LayerCtx<'_>,
        perf: &mut PerfState,
        cold: &mut dyn ColdLane,
        outcome: Result<(), LayerFault>,
        direct: bool,
    ) -> Result<(), GpuError> {
        let (dev, l, t) = (cx.dev, cx.l, cx.t);
        let fell_back = self.settle(cx, perf, cold, outcome)?;
        if !direct || fell_back {
            add_moe_output(dev, l, t)?;
        }
        dev.mark(l, 9)?;
        Ok(())
    }

    /// A lane's failure recomputed all-cold into the layer's MoE output (counted); whether it
    /// fell back. The layer's record is marked launched or not.
    pub fn settle(
        &mut self,
        cx: &LayerCtx<'_>,
        perf: &mut PerfState,
        cold: &mut dyn ColdLane,
        outcome: Result<(), LayerFault>,
    ) -> Result<bool, GpuError> {
        let fell_back = match outcome {
            Ok(()) => false,
            Err(LayerFault::Fatal(e)) => return Err(e),
            Err(LayerFault::Fallback(f)) => {
                perf.record_fallback(cx.l, f.reason, &f.detail);
                self.all_cold(cx, if f.cold_lane_failed { None } else { Some(cold) })?;
                true
            }
        };
        self.records[cx.l].launched = !fell_back;
        cx.mark(8)?;
        Ok(fell_back)
    }

    /// The device path: worklist on the GPU, hot lane by GEMV kernels or grouped GEMMs, cold
    /// lane on the host, join on the stream.
    fn moe_device(
        &mut self,
        cx: &LayerCtx<'_>,
        cold: &mut dyn ColdLane,
        plan: MoePlan,
    ) -> Result<(), LayerFault> {
        self.hot_lane_device(cx, plan)?;
        if self.hot.all_hot(cx.l) {
            self.records[cx.l].hot_slots = cx.t * cx.dev.cfg.n_experts_used;
            return Ok(());
        }
        self.cold_lane_device(cx, cold)
    }

    /// The device path's hot lane: the worklist from the routing ids (unless the fused routing
    /// wrote it) and the GEMVs over the cached experts; entries of cold experts are skipped.
    pub fn hot_lane_device(&mut self, cx: &LayerCtx<'_>, plan: MoePlan) -> Result<(), LayerFault> {
        let (dev, l, t) = (cx.dev, cx.l, cx.t);
        let (k, e_n) = (dev.cfg.n_experts_used, dev.cfg.n_experts);
        let n_ent = t * k;
        let s = dev.s();
        let (lay, wi) = (s.layout, s.work_i.ptr());
        let ids = route_ids(s.ids(), k, l, t);
        let (p_slots, p_toks) = (wi.sub(lay.slots, n_ent), wi.sub(lay.tokens, n_ent));
        let (p_off, p_rows) = (wi.sub(lay.tok_off, t + 1), wi.sub(lay.tok_rows, t));
        let grouped = self.hot.slots(l).is_some_and(|c| hot_grouped(dev, t, &c, cx.phase));
        // the grouped lane sorts its own worklist (over the token-major one's sections)
        if !plan.worklist_built && !grouped {
            dev.be.hot_worklist_tokens(
                self.hot.map_dev(l),
                ids,
                t,
                k,
                e_n,
                p_slots,
                p_toks,
                p_off,
                p_rows,
            )?;
        }
        dev.mark(l, 6)?;
        // an all-hot layer inside a decode graph may run untimed (GpuOptions::graph_lane_events)
        let timed = dev.step.is_none() || dev.opts.graph_lane_events || !self.hot.all_hot(l);
        if timed {
            dev.be.record(&self.lane_events[l].start)?;
            self.records[l].hot_at = Some(Instant::now());
        } else {
            self.records[l].hot_untimed = true;
        }
        if let Some(c) = self.hot.slots(l) {
            let out = if plan.direct { s.hidden.ptr() } else { s.moe_out.ptr() };
            let w = [c.gate, c.up, c.down];
            if grouped {
                hot_grouped_decode(dev, w, &c.epi, (self.hot.map_dev(l), c.n_slots), l, t, out)
                    .map_err(hot_failed)?;
                if !self.hot.all_hot(l) {
                    // the cold lane's side (Post-Fetch's GEMVs) reads the token-major worklist
                    let map = self.hot.map_dev(l);
                    dev.be.hot_worklist_tokens(map, ids, t, k, e_n, p_slots, p_toks, p_off, p_rows)?;
                }
            } else {
                // entries routed to cold experts have slot -1: the kernels skip them
                expert_gemvs(dev, w, &c.epi, p_slots, l, t, out).map_err(hot_failed)?;
            }
        }
        if timed {
            dev.be.record(&self.lane_events[l].end)?;
        }
        dev.mark(l, 7)?;
        Ok(())
    }

    /// The device path's cold lane: once the routing is on the host, the host worklist, the
    /// experts Post-Fetch takes ([`MoeStage::postfetch_issue_decode`]) copied and run on the
    /// GPU, the other cold experts on the CPU, their rows joined on the stream.
    pub fn cold_lane_device(&mut self, cx: &LayerCtx<'_>, cold: &mut dyn ColdLane) -> Result<(), LayerFault> {
        let (l, t) = (cx.l, cx.t);
        let split_at = Instant::now();
        self.wait_routes()?;
        // The hot lane cannot start on the GPU before routing is done: place it now.
        self.records[l].hot_at = Some(Instant::now());
        self.records[l].gpu_joined = true;
        self.host_worklist(cx, WorklistOrder::TokenMajor)?;
        // decode graphs replay the routing without `route_layer`'s reset: the slots a prefill on
        // this cache fetched must not reach this layer's CPU lane (see `postfetch::decode`)
        self.postfetch_reset();
        self.postfetch_issue_decode(cx.dev, l, t)?;
        self.fetched_lane_gemv(cx.dev, t).map_err(hot_failed)?;
        self.cold_lane_joined_on_stream(cx, cold)?;
        self.records[l].wall_us = split_at.elapsed().as_secs_f64() * 1e6;
        self.records[l].split = true;
        Ok(())
    }

    /// Device path: the cold rows of the host worklist on the CPU, added on the GPU stream.
    fn cold_lane_joined_on_stream(
        &mut self,
        cx: &LayerCtx<'_>,
        cold: &mut dyn ColdLane,
    ) -> Result<(), LayerFault> {
        let (dev, l, t) = (cx.dev, cx.l, cx.t);
        let h = dev.cfg.hidden;
        let n_rows = collect_cold(&mut self.host, t, false);
        let rec = &mut self.records[l];
        (rec.hot_slots, rec.cold_slots, rec.cold_rows) =
            (self.host.worklist.hot_count_total(), self.host.cold_slots.len(), n_rows);
        if n_rows == 0 {
            return Ok(());
        }
        let s = dev.s();
        let faults = cx.faults;
        let cold_start = Instant::now();
        let hs = &mut self.host;
        let (cap, k) = (s.cap, dev.cfg.n_experts_used);
        let normed = RouteView::of(self.pin.route.as_slice()?, cap, k, t, h).rows;
        let out = &mut self.pin.cold_out.as_mut_slice()?[..t * h];
        out.fill(0.0);
        if n_rows == t {
            call_cold(cold, faults, l, normed, &hs.cold_slots, out).map_err(cold_failed)?;
        } else {
            hs.cold_in.clear();
            for &ti in &hs.cold_row_tok {
                hs.cold_in.extend_from_slice(&normed[ti * h..][..h]);
            }
            hs.cold_out.clear();
            hs.cold_out.resize(n_rows * h, 0.0);
            call_cold(cold, faults, l, &hs.cold_in, &hs.cold_slots, &mut hs.cold_out).map_err(cold_failed)?;
            for (r, &ti) in hs.cold_row_tok.iter().enumerate() {
                out[ti * h..][..h].copy_from_slice(&hs.cold_out[r * h..][..h]);
            }
        }
        self.records[l].cold = Some((cold_start, Instant::now()));
        dev.be.write_async(&self.pin.cold_out, t * h, s.cold_out.ptr())?;
        dev.be.add(s.moe_out.ptr(), s.cold_out.ptr(), t * h)?;
        Ok(())
    }

    /// Host path: worklist built and checked on the host, Post-Fetch's copies queued (prefill),
    /// hot lane (and, with `block_on_miss`, the fetched experts) by grouped GEMMs, cold lane on
    /// the CPU meanwhile, Post-Fetch's readiness query, join on the host with a timeout.
    fn moe_host(&mut self, cx: &LayerCtx<'_>, cold: &mut dyn ColdLane) -> Result<(), LayerFault> {
        let (dev, l, t) = (cx.dev, cx.l, cx.t);
        self.wait_routes()?;
        let split_at = Instant::now();
        self.host_worklist(cx, WorklistOrder::ExpertMajor)?;
        self.postfetch_issue(l, cx.phase)?;
        self.records[l].worklist_us = split_at.elapsed().as_secs_f64() * 1e6;
        let n_cold_rows = self.upload_worklist(dev, l, t)?;
        self.postfetch_start_copies(dev)?;
        dev.mark(l, 6)?;
        dev.be.record(&self.lane_events[l].start)?;
        self.records[l].hot_at = Some(Instant::now());
        let faults = cx.faults;
        if faults.hot_error {
            return Err(hot_failed("injected error"));
        }
        if self.records[l].hot_slots + self.host.pf_slot.len() > 0 {
            self.hot_lane_gemm(dev, l, t).map_err(hot_failed)?;
            if !self.host.pf_slot.is_empty() {
                self.postfetch_launched();
            }
        }
        dev.be.record(&self.lane_events[l].end)?;
        dev.mark(l, 7)?;
        if !self.host.cold_slots.is_empty() {
            self.cold_lane_host_join(cx, n_cold_rows, cold)?;
        }
        self.postfetch_join(cx, n_cold_rows, cold)?;
        let timed_out = faults.hot_timeout;
        if n_cold_rows > 0 || timed_out {
            let wait_start = Instant::now();
            let limit = if timed_out { Duration::ZERO } else { dev.opts.hot_lane_timeout };
            if timed_out || !wait_event(&self.lane_events[l].end, limit) {
                let detail = format!("hot lane did not finish within {limit:?}");
                return Err(LayerFailure::new(FallbackReason::LaneUnavailable, detail).into());
            }
            self.records[l].join_wait_us = wait_start.elapsed().as_secs_f64() * 1e6;
        }
        self.records[l].wall_us = split_at.elapsed().as_secs_f64() * 1e6;
        self.records[l].split = true;
        Ok(())
    }

    /// Post-Fetch once the CPU lane is done: the readiness query; when it was deferred
    /// (`block_on_miss` off), the late experts on the CPU (their rows were gathered with the
    /// cold lane's, `n_cold_rows`), then the GEMMs and scatter of the fetched experts whose
    /// copies are complete.
    fn postfetch_join(
        &mut self,
        cx: &LayerCtx<'_>,
        n_cold_rows: usize,
        cold: &mut dyn ColdLane,
    ) -> Result<(), LayerFault> {
        let (l, t) = (cx.l, cx.t);
        let late = cx.faults.postfetch_late;
        if !self.postfetch_ready(late)? {
            return Ok(());
        }
        if late_cold_slots(&mut self.host, t) > 0 {
            self.records[l].cold_slots += self.host.cold_slots.len();
            self.cold_lane_host_join(cx, n_cold_rows, cold)?;
        }
        self.postfetch_entries();
        if !self.host.pf_slot.is_empty() {
            self.fetched_lane_gemm(cx.dev, t).map_err(hot_failed)?;
            self.postfetch_launched();
        }
        Ok(())
    }

    /// The fetched experts after the readiness query: their entries (after the hot ones, which
    /// the hot lane's scatter already added) uploaded, their GEMMs, their scatter.
    fn fetched_lane_gemm(&mut self, dev: &Device, t: usize) -> Result<(), GpuError> {
        let s = dev.s();
        let lay = s.layout;
        let (n_hot, n_all, n_rows) = encode_hot(&mut self.host, &lay, t, false);
        encode_fetched_tiles(&mut self.host, &lay, n_hot)?;
        // stream-ordered after the hot lane's launches, which read the same sections
        dev.be.write(&self.host.work_i, s.work_i.ptr())?;
        dev.be.write(&self.host.work_f[..n_all], s.work_f.ptr())?;
        self.postfetch_gemm(dev, t, n_all)?;
        let (wi, h, n_ent) = (s.work_i.ptr(), dev.cfg.hidden, n_all - n_hot);
        let (ent, off, rows) =
            (wi.sub(lay.entries, n_ent), wi.sub(lay.tok_off, n_rows + 1), wi.sub(lay.tok_rows, n_rows));
        dev.be.moe_scatter_accum(s.y.ptr(), ent, s.work_f.ptr(), off, rows, s.moe_out.ptr(), n_rows, h)?;
        Ok(())
    }

    /// The host worklist's hot and cold sections as the GPU's integer layout; uploads it and
    /// queues the cold rows' gather and copy to pinned memory. Returns the cold row count
    /// (tokens of the CPU lane's entries, and of the fetched experts' while their readiness
    /// query is deferred: a late one runs on the CPU).
    fn upload_worklist(&mut self, dev: &Device, l: usize, t: usize) -> Result<usize, GpuError> {
        let h = dev.cfg.hidden;
        let deferred = self.postfetch.as_ref().and_then(|p| p.current).is_some_and(|c| c.deferred);
        let s = dev.s();
        let (n_hot, n_all, _) = encode_hot(&mut self.host, &s.layout, t, true);
        self.host.n_tiles = 0;
        {
            let slots = &self.host.worklist.hot[0].hot_id[..n_hot];
            let tiles = &mut self.host.work_i[s.layout.tiles..][..3 * n_hot];
            self.host.n_tiles = grouped_tiles(slots, tiles)?;
            encode_fetched_tiles(&mut self.host, &s.layout, n_hot)?;
        }
        let n_cold_rows = collect_cold(&mut self.host, t, deferred);
        for (r, &ti) in self.host.cold_row_tok.iter().enumerate() {
            self.host.work_i[s.layout.cold_rows + r] = ti as i32;
        }
        let rec = &mut self.records[l];
        (rec.hot_slots, rec.cold_slots, rec.cold_rows) = (n_hot, self.host.cold_slots.len(), n_cold_rows);
        dev.be.write(&self.host.work_i, s.work_i.ptr())?;
        dev.be.write(&self.host.work_f[..n_all.max(1)], s.work_f.ptr())?;
        if n_cold_rows > 0 {
            let rows = s.work_i.ptr().sub(s.layout.cold_rows, n_cold_rows);
            dev.be.gather_rows(s.normed.ptr(), rows, s.cold_in.ptr(), n_cold_rows, h)?;
            dev.be.read_async(s.cold_in.ptr(), &mut self.pin.cold_in, n_cold_rows * h)?;
        }
        Ok(n_cold_rows)
    }

    /// The hot lane over the host worklist (expert-major): the cached experts' GEMMs over their
    /// gathered rows, one entry row each in `y`, then Post-Fetch's fetched experts' GEMMs (entry
    /// rows after the hot ones), then one weighted scatter of both into the token rows.
    fn hot_lane_gemm(&self, dev: &Device, l: usize, t: usize) -> Result<(), GpuError> {
        let n_hot = self.host.worklist.hot[0].hot_count;
        if n_hot > 0 {
            self.hot_lane_grouped(dev, l, t)?
        }
        let n_all = n_hot + self.host.pf_slot.len();
        if n_all > n_hot {
            self.postfetch_gemm(dev, t, n_all)?;
        }
        let (h, n_hot) = (dev.cfg.hidden, n_all);
        let s = dev.s();
        let (lay, wi, n_rows) = (s.layout, s.work_i.ptr(), self.host.tok_rows);
        let (ent, off, rows) =
            (wi.sub(lay.entries, n_hot), wi.sub(lay.tok_off, n_rows + 1), wi.sub(lay.tok_rows, n_rows));
        dev.be.moe_scatter_accum(s.y.ptr(), ent, s.work_f.ptr(), off, rows, s.moe_out.ptr(), n_rows, h)?;
        Ok(())
    }

    /// Grouped: one tensor-core launch for gate, up and the activation over every cached
    /// expert (rows gathered from the normed tokens in the kernel), one for down. Quantized
    /// slots are decoded tile by tile inside the kernels (`grouped_*_typed`).
    fn hot_lane_grouped(&self, dev: &Device, l: usize, t: usize) -> Result<(), GpuError> {
        let s = dev.s();
        let n_hot = self.host.worklist.hot[0].hot_count;
        let c = self.hot.slots(l).expect("hot entries imply a cache");
        let nt = self.host.n_tiles;
        let tiles = s.work_i.ptr().sub(s.layout.tiles, 3 * nt);
        grouped_ffn(dev, [c.gate, c.up, c.down], &c.epi, c.n_slots, (tiles, nt, GROUPED_TILE_ROWS), n_hot, t)
    }

    /// Host path: the cold lane on the CPU (`HostScratch::cold_slots` over the `n_rows` gathered
    /// rows) while the hot lane runs, its rows scattered into the layer output on the stream.
    /// A second call in the layer (Post-Fetch's late experts) extends the lane's time.
    fn cold_lane_host_join(
        &mut self,
        cx: &LayerCtx<'_>,
        n_rows: usize,
        cold: &mut dyn ColdLane,
    ) -> Result<(), LayerFault> {
        let (dev, l) = (cx.dev, cx.l);
        let h = dev.cfg.hidden;
        let s = dev.s();
        let input = &self.pin.cold_in.as_slice()?[..n_rows * h];
        let cold_start = Instant::now();
        let out = &mut self.pin.cold_out.as_mut_slice()?[..n_rows * h];
        out.fill(0.0);
        call_cold(cold, cx.faults, l, input, &self.host.cold_slots, out).map_err(cold_failed)?;
        let started = self.records[l].cold.map_or(cold_start, |(start, _)| start);
        self.records[l].cold = Some((started, Instant::now()));
        dev.be.write_async(&self.pin.cold_out, n_rows * h, s.cold_out.ptr())?;
        let rows = s.work_i.ptr().sub(s.layout.cold_rows, n_rows);
        dev.be.scatter_add_rows(s.cold_out.ptr(), rows, s.moe_out.ptr(), n_rows, h)?;
        Ok(())
    }

    /// Wait until the layer's routing is on the host (its copy is the last before the split).
    pub(super) fn wait_routes(&self) -> Result<(), GpuError> {
        self.pin.route.as_slice()?;
        Ok(())
    }

    /// Build (and check) layer `l`'s worklist on the host from the pinned routing.
    pub(super) fn host_worklist(
        &mut self,
        cx: &LayerCtx<'_>,
        order: WorklistOrder,
    ) -> Result<(), LayerFault> {
        let (dev, l, t) = (cx.dev, cx.l, cx.t);
        let (k, e_n) = (dev.cfg.n_experts_used, dev.cfg.n_experts);
        let s = dev.s();
        let hs = &mut self.host;
        hs.expert_ids.clear();
        let route = RouteView::of(self.pin.route.as_slice()?, s.cap, k, t, 0);
        for &e in route.ids {
            if e < 0 || e as usize >= e_n {
                return Err(GpuError::BadRoute { layer_idx: l, expert_id: e }.into());
            }
            hs.expert_ids.push(e as u32);
        }
        let layer = self.hot.layer(l);
        let wts = route.weights;
        let shape =
            |e: WorklistError| LayerFault::from(LayerFailure::new(FallbackReason::Shape, e.to_string()));
        hs.worklist.build(&hs.expert_ids, wts, t, k, Some(layer), order).map_err(shape)?;
        if cx.faults.worklist {
            hs.worklist.inject_corruption();
        }
        let bad =
            |e: WorklistError| LayerFault::from(LayerFailure::new(FallbackReason::Worklist, e.to_string()));
        hs.worklist.check_consistency(Some(layer)).map_err(bad)
    }

    /// Recompute layer `l`'s routed experts all-cold on the CPU (`cold`, or the plain lane when
    /// `None`), overwrite the layer's output with them and add the shared expert again.
    fn all_cold(&mut self, cx: &LayerCtx<'_>, cold: Option<&mut dyn ColdLane>) -> Result<(), GpuError> {
        let (dev, l, t) = (cx.dev, cx.l, cx.t);
        let (h, k) = (dev.cfg.hidden, dev.cfg.n_experts_used);
        self.records[l] = LayerRecord { cold_slots: t * k, cold_rows: t, ..LayerRecord::default() };
        dev.be.synchronize()?;
        let s = dev.s();
        let hs = &mut self.host;
        hs.cold_in.resize(t * h, 0.0);
        dev.be.read(s.normed.ptr().sub(0, t * h), &mut hs.cold_in)?;
        hs.route_ids.resize(t * k, 0);
        dev.be.read(route_ids(s.ids(), k, l, t), &mut hs.route_ids[..t * k])?;
        hs.work_f.resize(hs.work_f.len().max(t * k), 0.0);
        dev.be.read(route_ids(s.weights.ptr(), k, l, t), &mut hs.work_f[..t * k])?;
        if let Some(&e) = hs.route_ids[..t * k].iter().find(|&&e| e < 0 || e as usize >= dev.cfg.n_experts) {
            return Err(GpuError::BadRoute { layer_idx: l, expert_id: e });
        }
        hs.cold_out.resize(t * h, 0.0);
        let lane: &mut dyn ColdLane = match cold {
            Some(c) => c,
            None => &mut self.fallback_cold,
        };
        let routes = hs.route_ids[..t * k].iter().zip(&hs.work_f[..t * k]).map(|(&e, &w)| (e as usize, w));
        all_cold(lane, l, &hs.cold_in, routes, k, &mut hs.cold_slots, &mut hs.cold_out)
            .map_err(GpuError::Cold)?;
        dev.be.write(&hs.cold_out, s.moe_out.ptr().sub(0, t * h))?;
        shared_expert(cx)
    }
}

/// The decode GEMVs of `t` tokens' routed entries over the experts `w` (gate, up, down
/// stacks: the hot cache or Post-Fetch's scratchpad; `epi` their activation and slot biases),
/// entry `j`'s expert at `slots[j]` (-1: skipped), the weighted down rows accumulated into
/// `out`. The entries' tokens and the token rows are the device worklist's
/// (`hot_worklist_tokens` or the fused routing).
pub(crate) fn expert_gemvs(
    dev: &Device,
    [gate, up, down]: [TypedWeights; 3],
    epi: &SlotEpilogue,
    slots: DPtr<i32>,
    l: usize,
    t: usize,
    out: DPtr<f32>,
) -> Result<(), GpuError> {
    let (h, k, ff) = (dev.cfg.hidden, dev.cfg.n_experts_used, dev.cfg.expert_ff);
    let n_ent = t * k;
    let s = dev.s();
    let (lay, wi) = (s.layout, s.work_i.ptr());
    let (toks, off, rows) = (wi.sub(lay.tokens, n_ent), wi.sub(lay.tok_off, t + 1), wi.sub(lay.tok_rows, t));
    let (wts, x, hb) = (route_ids(s.weights.ptr(), k, l, t), s.normed.ptr(), s.h.ptr());
    if let (Some(g), Some(u), Some(d)) = (gate.bf16(), up.bf16(), down.bf16()) {
        dev.be.moe_gate_up_gemv(g, u, x, slots, toks, hb, n_ent, ff, h, &epi.gate_up)?;
        dev.be.moe_down_accum(d, hb, slots, wts, off, rows, out, t, h, ff, epi.down_bias)?;
        return Ok(());
    }
    // quantized experts read x and h in 8 bits when the GEMVs take them
    let xq = dev.q8_room(&s.q8_moe, t, h);
    let hq = dev.q8_room(&s.q8_h, n_ent, ff);
    if let Some(xq) = xq {
        dev.be.quantize_q8(x, t, h, xq)?;
    }
    dev.be.moe_gate_up_gemv_typed(gate, up, x, xq, slots, toks, hb, n_ent, ff, h, &epi.gate_up)?;
    if let Some(hq) = hq {
        dev.be.quantize_q8(hb, n_ent, ff, hq)?;
    }
    dev.be.moe_down_accum_typed(down, hb, hq, slots, wts, off, rows, out, t, h, ff, epi.down_bias)?;
    Ok(())
}

/// Whether a device-path call of `t` rows (a batched decode step, an all-hot prefill call) over
/// the cached experts `c` runs its hot lane grouped ([`super::GpuOptions::hot_grouped_min_rows`],
/// a decode step over quantized slots `hot_grouped_min_rows_quantized`; never inside a decode
/// graph, whose calls are one token; at most what one block sorts).
fn hot_grouped(dev: &Device, t: usize, c: &SlotPtrs, phase: Phase) -> bool {
    let o = &dev.opts;
    let quantized_decode = phase == Phase::Decode && !c.all_bf16();
    let min_rows = if quantized_decode { o.hot_grouped_min_rows_quantized } else { o.hot_grouped_min_rows };
    t >= min_rows
        && dev.step.is_none()
        && CudaBackend::hot_worklist_grouped_fits(t, dev.cfg.n_experts_used, c.n_slots)
}

/// The hot lane of a batched decode step or an all-hot prefill call grouped by expert: the worklist sorted by cache slot on
/// the device ([`CudaBackend::hot_worklist_grouped`] over the layer's routing and expert-to-slot
/// `map`), the grouped GEMMs over it (each cached expert read once for all its rows), then the
/// weighted rows added into `out` by token (cold entries skipped). Writes the worklist's
/// tokens, entries, token rows and tiles sections and `work_f`.
fn hot_grouped_decode(
    dev: &Device,
    w: [TypedWeights; 3],
    epi: &SlotEpilogue,
    (map, n_slots): (DPtr<i32>, usize),
    l: usize,
    t: usize,
    out: DPtr<f32>,
) -> Result<(), GpuError> {
    let (k, e_n, h) = (dev.cfg.n_experts_used, dev.cfg.n_experts, dev.cfg.hidden);
    let n = t * k;
    let s = dev.s();
    let (lay, wi) = (s.layout, s.work_i.ptr());
    // a batched step's one or two rows an expert take the decode shape's tiles
    let tile_rows = if t <= GROUPED_DECODE_MAX_TOKENS { GROUPED_DECODE_TILE_ROWS } else { GROUPED_TILE_ROWS };
    let nt = CudaBackend::hot_grouped_max_tiles(n, n_slots, tile_rows);
    let tiles = wi.sub(lay.tiles, 3 * nt);
    let (toks, ent) = (wi.sub(lay.tokens, n), wi.sub(lay.entries, n));
    let (off, rows, wsorted) =
        (wi.sub(lay.tok_off, t + 1), wi.sub(lay.tok_rows, t), s.work_f.ptr().sub(0, n));
    let routing = (map, route_ids(s.ids(), k, l, t), route_ids(s.weights.ptr(), k, l, t));
    let shape = (t, k, e_n, n_slots, tile_rows);
    dev.be.hot_worklist_grouped(routing, shape, (toks, wsorted, ent), (off, rows, tiles))?;
    grouped_ffn(dev, w, epi, n_slots, (tiles, nt, tile_rows), n, t)?;
    dev.be.moe_scatter_accum(s.y.ptr(), ent, wsorted, off, rows, out, t, h)?;
    Ok(())
}

/// The grouped GEMMs of expert stacks `w` (gate, up, down; `n_slots` experts each) over
/// `tiles` (`(slot, first row, rows)` triples, `n_tiles`, each of at most `tile_rows` rows) of
/// the entry rows `0..n_rows`: the
/// normed token rows gathered by the worklist's tokens, `h = glu(gate x + bg, up x + bu)` in
/// `h`, `down h + bd` in `y` (`epi`: the activation and slot biases; the typed launchers: bf16
/// stacks take the bf16 kernels, quantized tiles are decoded in the kernel).
pub(super) fn grouped_ffn(
    dev: &Device,
    w: [TypedWeights; 3],
    epi: &SlotEpilogue,
    n: usize,
    (tiles, nt, tile_rows): (DPtr<i32>, usize, usize),
    n_rows: usize,
    t: usize,
) -> Result<(), GpuError> {
    let (h, ff) = (dev.cfg.hidden, dev.cfg.expert_ff);
    let s = dev.s();
    let toks = s.work_i.ptr().sub(s.layout.tokens, n_rows);
    let (x, hbuf, y, be) = (s.normed.ptr(), s.h.ptr(), s.y.ptr(), &dev.be);
    if int8_tiles(dev, &w, n, tile_rows) {
        return grouped_ffn_q8(dev, w, epi, n, (tiles, nt), n_rows, t);
    }
    let [gate, up, down] = w;
    let split = |w: TypedWeights| dev.opts.prefill_activations.split(w.dtype);
    be.grouped_gate_up_typed(
        gate,
        up,
        n,
        x,
        toks,
        t,
        tiles,
        nt,
        tile_rows,
        hbuf,
        n_rows,
        ff,
        h,
        split(gate),
        &epi.gate_up,
    )?;
    be.grouped_gemm_typed(
        down,
        n,
        hbuf,
        None,
        n_rows,
        tiles,
        nt,
        tile_rows,
        y,
        n_rows,
        h,
        ff,
        split(down),
        epi.down_bias,
    )?;
    Ok(())
}

/// Whether a grouped FFN over caches `w` of `n_slots` slots takes the int8 tiles: 8-bit prefill
/// activations asked for (`PrefillActivations::Auto`), prefill's tile shape, MXFP4 gate, up and
/// down, each cache with [`TYPED_TAIL_BYTES`] past its rows (the hot cache's; others keep the
/// bf16 tiles).
fn int8_tiles(dev: &Device, w: &[TypedWeights; 3], n_slots: usize, tile_rows: usize) -> bool {
    let (h, ff) = (dev.cfg.hidden, dev.cfg.expert_ff);
    let shapes = [(ff, h), (ff, h), (h, ff)];
    let tailed = w.iter().zip(shapes).all(|(w, (rows, k))| {
        w.dtype == WeightDType::Mxfp4
            && w.bytes.len() >= n_slots * rows * w.dtype.row_bytes(k) + TYPED_TAIL_BYTES
    });
    dev.opts.prefill_activations.int8() && tile_rows == GROUPED_TILE_ROWS && tailed
}

/// [`grouped_ffn`] on the int8 tiles: the gathered normed rows and then h quantized to 8 bits
/// (the decode GEMVs' `q8_moe` / `q8_h` scratch), each block's integer dot scaled by its x and
/// weight scales.
fn grouped_ffn_q8(
    dev: &Device,
    [gate, up, down]: [TypedWeights; 3],
    epi: &SlotEpilogue,
    n: usize,
    tiles: (DPtr<i32>, usize),
    n_rows: usize,
    t: usize,
) -> Result<(), GpuError> {
    let (h, ff) = (dev.cfg.hidden, dev.cfg.expert_ff);
    let (s, be) = (dev.s(), &dev.be);
    let toks = s.work_i.ptr().sub(s.layout.tokens, n_rows);
    let (xq, hq) = (s.q8_moe.rows(), s.q8_h.rows());
    be.quantize_q8(s.normed.ptr(), t, h, xq)?;
    let out = (s.h.ptr(), n_rows);
    be.grouped_gate_up_q8((gate, up), n, (xq, toks, t), tiles, out, (ff, h), &epi.gate_up)?;
    be.quantize_q8(s.h.ptr(), n_rows, ff, hq)?;
    be.grouped_gemm_q8(down, n, (hq, None, n_rows), tiles, (s.y.ptr(), n_rows), (h, ff), epi.down_bias)?;
    Ok(())
}

/// Run the cold lane (with the injected faults of this layer); a panic is caught and reported.
fn call_cold(
    cold: &mut dyn ColdLane,
    faults: super::LayerFaults,
    l: usize,
    input: &[f32],
    slots: &[ColdSlot],
    out: &mut [f32],
) -> Result<(), ColdError> {
    if faults.cold_error {
        return Err(ColdError::Injected { layer_idx: l });
    }
    let panic_here = faults.cold_panic;
    let run = std::panic::AssertUnwindSafe(|| {
        if panic_here {
            panic!("injected cold-lane panic in layer {l}");
        }
        cold.compute(l, input, slots, out)
    });
    std::panic::catch_unwind(run).unwrap_or(Err(ColdError::Panicked { layer_idx: l }))
}

/// Poll `ev` until it completes or `limit` passes; `false` on time-out.
fn wait_event(ev: &GpuEvent, limit: Duration) -> bool {
    let start = Instant::now();
    loop {
        if ev.is_done() {
            return true;
        }
        if start.elapsed() >= limit {
            return false;
        }
        std::hint::spin_loop();
    }
}

/// The worklist's hot section, then Post-Fetch's fetched entries (`pf_*`: slots of the
/// scratchpad), as the GPU layout: per entry slot, token and weight; token rows with GPU
/// entries (`tok_off`, `tok_rows`) and the entries grouped by token row (`entries`). Without
/// `with_hot`, the hot entries (already scattered) are neither written nor grouped: the rows and
/// `entries` are the fetched entries' only, which keep their places after the hot ones.
/// Returns (hot entries, all GPU entries, token rows).
fn encode_hot(hs: &mut HostScratch, lay: &WorkLayout, t: usize, with_hot: bool) -> (usize, usize, usize) {
    let sec = &hs.worklist.hot[0];
    let n_hot = sec.hot_count;
    let n_all = n_hot + hs.pf_slot.len();
    let first = if with_hot { 0 } else { n_hot };
    let starts = &mut hs.tok_count[..t];
    starts.fill(0);
    for i in first..n_hot {
        hs.work_i[lay.slots + i] = sec.hot_id[i] as i32;
        hs.work_i[lay.tokens + i] = sec.hot_token_id[i] as i32;
        hs.work_f[i] = sec.hot_weight[i];
        starts[sec.hot_token_id[i] as usize] += 1;
    }
    for (j, i) in (n_hot..n_all).enumerate() {
        hs.work_i[lay.slots + i] = hs.pf_slot[j] as i32;
        hs.work_i[lay.tokens + i] = hs.pf_token[j] as i32;
        hs.work_f[i] = hs.pf_weight[j];
        starts[hs.pf_token[j] as usize] += 1;
    }
    let (mut n_rows, mut off) = (0usize, 0u32);
    hs.work_i[lay.tok_off] = 0;
    for (ti, start) in starts.iter_mut().enumerate() {
        let count = *start;
        if count == 0 {
            continue;
        }
        hs.work_i[lay.tok_rows + n_rows] = ti as i32;
        *start = off;
        off += count;
        n_rows += 1;
        hs.work_i[lay.tok_off + n_rows] = off as i32;
    }
    for i in first..n_all {
        let tok = if i < n_hot { sec.hot_token_id[i] } else { hs.pf_token[i - n_hot] } as usize;
        hs.work_i[lay.entries + starts[tok] as usize] = i as i32;
        starts[tok] += 1;
    }
    hs.tok_rows = n_rows;
    (n_hot, n_all, n_rows)
}

/// Post-Fetch's entries (after the `n_hot` hot ones) as grouped-GEMM tiles in the tiles section
/// after the hot tiles: slots of the scratchpad, first rows counted from entry 0.
fn encode_fetched_tiles(hs: &mut HostScratch, lay: &WorkLayout, n_hot: usize) -> Result<(), GpuError> {
    hs.pf_tile_at = 3 * hs.n_tiles;
    hs.pf_tiles = 0;
    if hs.pf_slot.is_empty() {
        return Ok(());
    }
    let tiles = &mut hs.work_i[lay.tiles + hs.pf_tile_at..lay.tiles + 3 * (n_hot + hs.pf_slot.len())];
    hs.pf_tiles = grouped_tiles(&hs.pf_slot, tiles)?;
    for tile in tiles[..3 * hs.pf_tiles].chunks_exact_mut(3) {
        tile[1] += n_hot as i32;
    }
    Ok(())
}

/// The worklist's cold section as compact rows (tokens with cold slots, in token order) and
/// the CPU lane's cold slots (in worklist order: not those of experts Post-Fetch copies, whose
/// tokens get rows too with `fetched_rows`). Returns the row count.
pub(super) fn collect_cold(hs: &mut HostScratch, t: usize, fetched_rows: bool) -> usize {
    let wl = &hs.worklist;
    let row_of = &mut hs.tok_count[..t];
    row_of.fill(u32::MAX);
    let cpu = |i: usize| hs.pf_fetch[wl.cold_id[i] as usize] == PF_CPU;
    for i in (0..wl.cold_count).filter(|&i| fetched_rows || cpu(i)) {
        row_of[wl.cold_token_id[i] as usize] = 0;
    }
    hs.cold_row_tok.clear();
    for (ti, row) in row_of.iter_mut().enumerate() {
        if *row == 0 {
            *row = hs.cold_row_tok.len() as u32;
            hs.cold_row_tok.push(ti);
        }
    }
    hs.cold_slots.clear();
    for i in (0..wl.cold_count).filter(|&i| cpu(i)) {
        hs.cold_slots.push(ColdSlot {
            row_idx: row_of[wl.cold_token_id[i] as usize] as usize,
            expert_idx: wl.cold_id[i] as usize,
            weight: wl.cold_weight[i],
        });
    }
    hs.cold_row_tok.len()
}

/// The cold slots of the fetched experts whose copies were late ([`PF_LATE`]), over the rows
/// [`collect_cold`] gathered (with `fetched_rows`). Returns their count.
fn late_cold_slots(hs: &mut HostScratch, t: usize) -> usize {
    let row_of = &mut hs.tok_count[..t];
    for (r, &ti) in hs.cold_row_tok.iter().enumerate() {
        row_of[ti] = r as u32;
    }
    let wl = &hs.worklist;
    hs.cold_slots.clear();
    for i in (0..wl.cold_count).filter(|&i| hs.pf_fetch[wl.cold_id[i] as usize] == PF_LATE) {
        hs.cold_slots.push(ColdSlot {
            row_idx: row_of[wl.cold_token_id[i] as usize] as usize,
            expert_idx: wl.cold_id[i] as usize,
            weight: wl.cold_weight[i],
        });
    }
    hs.cold_slots.len()
}
