//! `GpuModel`: a model resident on one GPU (non-expert weights + the VRAM hot cache) and the
//! forward call that drives it: a loop over the plan's layers, each running the mixer stage
//! (`mixer`: attention or DeltaNet) and the MoE stage (`moe`, `route`: the hot/cold split, the
//! lanes, the join and the fallback) over one shared [`Device`] (`device`), between the
//! embedding and the head (`head`); one-token decode calls replay graphs (`graph`); statistics
//! in `stats`.

use super::device::{Device, LayerCtx};
use super::graph::Graphs;
use super::head::{head_kernels, HeadStage};
use super::hot_cache::HotCache;
use super::kv::GpuKvCache;
use super::mixer::MixerStage;
use super::moe::{LayerFault, MoePlan, MoeStage};
use super::options::GpuOptions;
use super::postfetch::plan::PostFetchTotals;
use super::postfetch::PostFetch;
use super::scratch::Scratch;
use super::stats::{self, CallTimes, ForwardStats, Profiler, StageProfile};
use super::weights::DenseWeights;
use super::GpuError;
use crate::cache::hot_set::HotSet;
use crate::cache::perf::{PerfMode, PerfState};
use crate::forward::LogitRows;
use crate::forward::Logits;
use crate::model::arch::LayerPlan;
use crate::model::config::ModelConfig;
use crate::model::context::KvType;
use crate::model::Model;
use crate::moe::cold::{ColdLane, PlainColdLane};
use crate::moe::phase::Phase;
use crate::reference::ForwardError;
use moe_lanes_kernels::cuda::{CudaBackend, DeviceBuffer, Glu};
use std::sync::Arc;
use std::time::Instant;

/// One sequence's rows in a forward call: `n` rows from `row0`, the first at position `pos0`
/// of `cache`.
#[derive(Clone, Copy)]
pub(crate) struct GpuSeg<'c> {
    pub row0: usize,
    pub n: usize,
    pub pos0: usize,
    pub cache: &'c GpuKvCache,
}

impl<'c> GpuSeg<'c> {
    /// A call's only sequence: its `n` rows from row 0, after what `cache` holds.
    pub fn whole(cache: &'c GpuKvCache, n: usize) -> GpuSeg<'c> {
        GpuSeg { row0: 0, n, pos0: cache.n_positions, cache }
    }
}

/// Elements of the prefill dequantization scratch (bf16, 32 MiB): a quantized matrix with more
/// elements is dequantized and multiplied in row ranges.
const DEQUANT_SCRATCH_ELEMS: usize = 16 << 20;

/// The dequantization scratch a model needs: none for a float model, else room for the largest
/// quantized matrix (dense or expert) up to [`DEQUANT_SCRATCH_ELEMS`].
fn dequant_scratch(
    be: &CudaBackend,
    (cfg, plan): (&ModelConfig, &LayerPlan),
    w: &DenseWeights,
    hot: &HotCache,
) -> Result<Option<DeviceBuffer<u16>>, GpuError> {
    let experts = if hot.any_quantized() { cfg.expert_ff * cfg.hidden } else { 0 };
    let most = w.max_quantized_elems.max(experts);
    if most == 0 {
        return Ok(None);
    }
    let widest_row =
        cfg.hidden.max(widest_attention(plan, cfg).0).max(cfg.expert_ff).max(cfg.shared_expert_ff);
    Ok(Some(be.alloc_zeros::<u16>(most.min(DEQUANT_SCRATCH_ELEMS.max(widest_row)))?))
}

/// The widest attention layer's query and key rows `(q_dim, kv_dim)` (the config's where no
/// layer has its own sizes).
fn widest_attention(plan: &LayerPlan, cfg: &ModelConfig) -> (usize, usize) {
    let layers = plan.layers().iter().filter_map(|l| l.as_attention());
    layers.fold((cfg.q_dim(), cfg.kv_dim()), |(q, kv), a| (q.max(a.q_dim(cfg.n_heads)), kv.max(a.kv_dim())))
}

/// A model resident on one GPU, as a loop over owned stages: the shared `Device` (device,
/// plan, options, weights, scratch), the mixers, the MoE layers (hot cache, lanes, join,
/// Post-Fetch), the embedding and head, and the decode graphs.
pub struct GpuModel {
    dev: Device,
    mixer: MixerStage,
    pub(super) moe: MoeStage,
    head: HeadStage,
    pub(super) graphs: Graphs,
    stats: ForwardStats,
    pub(super) perf: PerfState,
    pub(super) call_idx: u64,
}

impl GpuModel {
    /// Whether the GPU engine runs every layer kind of `model`'s plan; the first it lacks, by
    /// name, otherwise (checked before anything touches the device).
    pub fn supports(model: &Model) -> Result<(), GpuError> {
        let cfg = model.config();
        let head_dims = model.plan().layers().iter().filter_map(|l| l.as_attention().map(|a| a.head_dim));
        if let Some(head_dim) = std::iter::once(cfg.head_dim).chain(head_dims).find(|d| d % 2 == 1) {
            return Err(GpuError::OddHeadDim { head_dim });
        }
        let iq4_nl = crate::format::dtype::DType::IQ4_NL;
        if let Some((tensor, ..)) = model.tensor_list().into_iter().find(|(_, d, ..)| *d == iq4_nl) {
            return Err(GpuError::TensorType { tensor, dtype: iq4_nl.ggml_name() });
        }
        if let Some((layer_idx, kind)) = model.plan().first_unsupported(super::mixer::runs_mixer) {
            return Err(GpuError::Mixer { layer_idx, kind });
        }
        let attention =
            model.plan().layers().iter().enumerate().filter_map(|(l, s)| Some((l, s.as_attention()?)));
        if let Some(e) = attention.filter_map(|(l, a)| super::mixer::unsupported_attention(l, a)).next() {
            return Err(e);
        }
        // SiLU, GPT-OSS's clamped SwiGLU and Gemma 4's tanh GELU experts have hot-lane kernels;
        // the erf GELU none.
        super::hot_cache::expert_glu(model)?;
        // Dense FFN layers run the same gated activations.
        if let Some((layer_idx, kind)) = model.plan().first_unsupported_ffn(|f| match f {
            crate::model::arch::Ffn::Moe(_) => true,
            crate::model::arch::Ffn::Dense(d) => Glu::of(d.activation.kernel()).is_some(),
        }) {
            return Err(GpuError::Ffn { layer_idx, kind });
        }
        // Per-branch norms normalise the dense (shared) branch's output: they come with one.
        let branch = |l: &crate::model::arch::LayerSpec| {
            l.as_moe().is_some_and(|m| m.branch_norms && m.shared.is_none())
        };
        if let Some(layer_idx) = model.plan().layers().iter().position(branch) {
            return Err(GpuError::Ffn {
                layer_idx,
                kind: "mixture of experts with branch norms but no dense branch",
            });
        }
        Ok(())
    }

    /// Upload every non-expert weight; the hot cache starts empty (every expert cold) until
    /// [`GpuModel::allocate_hot`].
    pub fn new(model: Arc<Model>, be: Arc<CudaBackend>, opts: GpuOptions) -> Result<GpuModel, GpuError> {
        be.bind_to_thread()?;
        let cfg = model.config().clone();
        GpuModel::supports(&model)?;
        super::kv::check_kv_blocks(model.plan(), opts.kv_type)?;
        let w = DenseWeights::upload(&model, &be)?;
        let hot = HotCache::empty(&be, &model)?;
        let dequant = dequant_scratch(&be, (&cfg, model.plan()), &w, &hot)?;
        let postfetch = PostFetch::new(&be, &model, opts.postfetch)?;
        let moe = MoeStage::new(&be, &cfg, hot, postfetch, PlainColdLane::new(model.clone()))?;
        let mut gm = GpuModel {
            mixer: MixerStage::new(model.plan()),
            moe,
            head: HeadStage::new(&be, &cfg, 8)?,
            graphs: Graphs::default(),
            perf: PerfState::new(opts.perf_mode, cfg.n_layers, cfg.n_experts, cfg.n_experts_used),
            stats: ForwardStats::default(),
            call_idx: 0,
            dev: Device {
                plan: model.plan().clone(),
                expert_layers: model.plan().expert_layers(),
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
        };
        if opts.profile {
            gm.enable_profile()?;
        }
        Ok(gm)
    }

    /// Allocate the hot cache once (capacity = each layer's hot count) and fill it.
    pub fn allocate_hot(&mut self, set: &HotSet) -> Result<(), GpuError> {
        self.dev.be.bind_to_thread()?;
        self.graphs = Graphs::default(); // their slot pointers go with the old cache
        let (be, model) = (&self.dev.be, &self.dev.model);
        self.moe.hot.allocate(be, model, set)?;
        if let Some(pf) = self.moe.postfetch.as_mut() {
            let n = self.dev.cfg.n_experts;
            let cold = set.layers.iter().map(|ls| n - ls.n_hot().min(n));
            pf.fit_slots(be, super::postfetch::plan::fitted_slots(pf.slots, cold))?;
        }
        Ok(())
    }

    /// Exchange one cache slot between calls: `add` takes the slot of `evict`.
    pub fn exchange(&mut self, layer_idx: usize, evict: usize, add: usize) -> Result<(), GpuError> {
        self.dev.be.bind_to_thread()?;
        let src = self.moe.postfetch.as_ref().and_then(|pf| pf.exchange_source());
        self.moe.hot.exchange(&self.dev.be, &self.dev.model, src, (layer_idx, evict, add))
    }

    pub fn hot_set(&self) -> &HotSet {
        self.moe.hot.set()
    }

    pub fn config(&self) -> &ModelConfig {
        &self.dev.cfg
    }

    pub fn backend(&self) -> &Arc<CudaBackend> {
        &self.dev.be
    }

    /// The KV cache's element type.
    pub fn kv_type(&self) -> KvType {
        self.dev.opts.kv_type
    }

    pub fn perf(&self) -> &PerfState {
        &self.perf
    }

    /// Start the perf state over (after a learn pass, say).
    pub fn reset_perf(&mut self) {
        let c = &self.dev.cfg;
        self.perf = PerfState::new(self.dev.opts.perf_mode, c.n_layers, c.n_experts, c.n_experts_used);
        if let Some(pf) = self.moe.postfetch.as_mut() {
            pf.totals = PostFetchTotals::default();
        }
    }

    /// The cold lane's thread count: Post-Fetch's CPU cost per token and its staging threads.
    pub fn set_cold_threads(&mut self, n_threads: usize) {
        let (h, ff) = (self.dev.cfg.hidden, self.dev.cfg.expert_ff);
        if let Some(pf) = self.moe.postfetch.as_mut() {
            pf.set_cold_threads(h, ff, n_threads);
        }
    }

    /// Learn passes count routed slots in the cold lane: fetch nothing while `paused`.
    pub fn pause_postfetch(&mut self, paused: bool) {
        self.moe.pause_postfetch(paused);
    }

    pub fn perf_mut(&mut self) -> &mut PerfState {
        &mut self.perf
    }

    /// Bytes of the hot expert caches (all layers).
    pub fn hot_cache_bytes(&self) -> usize {
        self.moe.hot.bytes()
    }

    /// Bytes of the non-expert matrices on the device.
    pub fn weight_bytes(&self) -> usize {
        self.dev.w.matrix_bytes
    }

    pub fn set_copy_logits(&mut self, on: bool) {
        self.dev.opts.copy_logits = on;
    }

    pub fn copies_logits(&self) -> bool {
        self.dev.opts.copy_logits
    }

    /// Statistics of the last forward call.
    pub fn last_stats(&self) -> &ForwardStats {
        &self.stats
    }

    /// A KV cache for up to `capacity` positions.
    pub fn new_kv_cache(&self, capacity: usize) -> Result<GpuKvCache, GpuError> {
        let c = &self.dev.cfg;
        if capacity == 0 || capacity > c.max_positions {
            return Err(GpuError::CacheCapacity { capacity, max_positions: c.max_positions });
        }
        GpuKvCache::new(&self.dev.be, &self.dev.plan, c.kv_dim(), capacity, self.dev.opts.kv_type)
    }

    /// Device scratch (and the stages' host twins) for calls of up to `t` tokens; grows, never
    /// shrinks.
    pub fn reserve_tokens(&mut self, t: usize) -> Result<(), GpuError> {
        let dev = &mut self.dev;
        if dev.scratch.as_ref().is_some_and(|s| s.cap >= t) {
            return Ok(());
        }
        dev.scratch = None; // free first
        let gated = dev.plan.layers().iter().any(|l| l.as_attention().is_some_and(|a| a.output_gate));
        let dense_ff = dev.plan.layers().iter().filter_map(|l| match l.ffn {
            crate::model::arch::Ffn::Dense(d) => Some(d.ff),
            crate::model::arch::Ffn::Moe(_) => None,
        });
        let attn = widest_attention(&dev.plan, &dev.cfg);
        let s = Scratch::new(&dev.be, &dev.cfg, t, gated, dense_ff.max().unwrap_or(0), attn)?;
        self.moe.reserve(&dev.be, &dev.cfg, s.cap)?;
        self.head = HeadStage::new(&dev.be, &dev.cfg, s.cap)?;
        dev.scratch = Some(s);
        Ok(())
    }

    pub(super) fn check_call(&self, tokens: &[u32], cache: &GpuKvCache) -> Result<(), GpuError> {
        let c = &self.dev.cfg;
        if tokens.is_empty() {
            return Err(ForwardError::EmptyInput.into());
        }
        let pos0 = cache.n_positions;
        if let Some((i, &token)) = tokens.iter().enumerate().find(|(_, &t)| t as usize >= c.vocab) {
            return Err(ForwardError::TokenOutOfRange { token, position: pos0 + i, vocab: c.vocab }.into());
        }
        if cache.n_layers() != c.n_layers || cache.kv_dim != c.kv_dim() {
            return Err(GpuError::CacheModel {
                cache_layers: cache.n_layers(),
                cache_kv_dim: cache.kv_dim,
                model_layers: c.n_layers,
                model_kv_dim: c.kv_dim(),
            });
        }
        if pos0 + tokens.len() > cache.capacity {
            return Err(ForwardError::ContextFull { max_positions: cache.capacity }.into());
        }
        Ok(())
    }

    /// Run `tokens` after what `cache` holds, in the caller's `phase` (decided once per call);
    /// the hot and cold lanes of every MoE layer split the routed slots; returns one logits row
    /// per token (or only the greedy tokens when logits copies are off).
    pub fn forward(
        &mut self,
        tokens: &[u32],
        phase: Phase,
        cache: &mut GpuKvCache,
        cold: &mut dyn ColdLane,
    ) -> Result<Logits, GpuError> {
        self.forward_rows(tokens, phase, cache, cold, LogitRows::All)
    }

    /// As [`GpuModel::forward`], with the lm_head run only for the `rows` asked for
    /// ([`LogitRows::Last`]: the last token's row, as generation and prompt processing need).
    /// A call longer than [`GpuOptions::max_call_tokens`] runs as consecutive calls of at most
    /// that many tokens (scratch grows with a call's tokens; a 32768-token prompt of a
    /// DeepSeek-V3-shaped model asked for about 94 GB of it in one call), after the whole call
    /// is checked, so a bad token or a full context changes nothing.
    pub fn forward_rows(
        &mut self,
        tokens: &[u32],
        phase: Phase,
        cache: &mut GpuKvCache,
        cold: &mut dyn ColdLane,
        rows: LogitRows,
    ) -> Result<Logits, GpuError> {
        let limit = self.dev.opts.max_call_tokens.max(1);
        if tokens.len() <= limit {
            return self.forward_call(tokens, phase, cache, cold, rows);
        }
        self.check_call(tokens, cache)?;
        let mut logits = Logits::empty(self.dev.cfg.vocab);
        for chunk in tokens.chunks(limit) {
            let part = self.forward_call(chunk, phase, cache, cold, rows)?;
            match rows {
                LogitRows::All => logits.append(part),
                LogitRows::Last => logits = part,
            }
        }
        Ok(logits)
    }

    /// One engine call of at most [`GpuOptions::max_call_tokens`] tokens.
    fn forward_call(
        &mut self,
        tokens: &[u32],
        phase: Phase,
        cache: &mut GpuKvCache,
        cold: &mut dyn ColdLane,
        rows: LogitRows,
    ) -> Result<Logits, GpuError> {
        let call_start = Instant::now();
        self.start_call(&mut [(tokens, &mut *cache)])?;
        let eager = self.timing_sample(tokens, phase);
        if !eager && self.graph_eligible(tokens, phase) {
            return self.forward_graph(tokens[0], cache, cold, rows, call_start);
        }
        if !eager && self.segments_eligible(tokens, phase) {
            return self.forward_segments(tokens[0], cache, cold, rows, call_start);
        }
        let t = tokens.len();
        self.embed(tokens)?;
        self.layers(0..self.dev.cfg.n_layers, phase, t, &[GpuSeg::whole(cache, t)], cold)?;
        let copy_start = Instant::now();
        let n = head_kernels(&self.dev, phase, t, rows)?;
        let logits = self.head.copies(&self.dev, self.perf.mode(), t, n)?;
        let copy_us = copy_start.elapsed().as_secs_f64() * 1e6;
        cache.n_positions += t;
        self.finish_call(phase, t, call_start, copy_start, copy_us)?;
        Ok(logits)
    }

    /// A call's start, after checking each sequence's tokens against its cache: counted (an
    /// injected device loss fails it here), the device bound, scratch for every row, and a
    /// new (or cleared) session's recurrent state zeroed.
    pub(super) fn start_call(&mut self, seqs: &mut [(&[u32], &mut GpuKvCache)]) -> Result<(), GpuError> {
        for (tokens, cache) in seqs.iter() {
            self.check_call(tokens, cache)?;
        }
        self.call_idx += 1;
        if self.dev.opts.faults.gpu_lost_at_call == Some(self.call_idx) {
            return Err(GpuError::Injected { what: "gpu lost" });
        }
        self.dev.be.bind_to_thread()?;
        let landed = self.moe.hot.admit_landed(&self.dev.be)?;
        if landed > 0 {
            self.perf.record_landed_exchanges(landed as u64);
        }
        self.reserve_tokens(seqs.iter().map(|(tokens, _)| tokens.len()).sum())?;
        for (_, cache) in seqs.iter_mut() {
            if cache.n_positions == 0 {
                cache.reset_recurrent(&self.dev.be)?;
            }
        }
        Ok(())
    }

    /// The `layers` over the call's `t` rows: each layer's mixer (per sequence, `segs`), then
    /// its MoE block.
    pub(super) fn layers(
        &mut self,
        layers: std::ops::Range<usize>,
        phase: Phase,
        t: usize,
        segs: &[GpuSeg<'_>],
        cold: &mut dyn ColdLane,
    ) -> Result<(), GpuError> {
        for l in layers {
            let cx = LayerCtx::of(&self.dev, self.call_idx, l, phase, t);
            cx.mark(0)?;
            self.mixer.run(&cx, segs)?;
            self.moe.run(&cx, &mut self.perf, cold)?;
        }
        Ok(())
    }

    /// A split layer's start in the decode segments (one token): its mark, mixer and routing;
    /// how its MoE block runs.
    pub(super) fn split_layer_start(&mut self, l: usize, seg: GpuSeg<'_>) -> Result<MoePlan, GpuError> {
        let cx = LayerCtx::of(&self.dev, self.call_idx, l, Phase::Decode, 1);
        cx.mark(0)?;
        self.mixer.run(&cx, &[seg])?;
        self.moe.route_layer(&cx)
    }

    /// A split layer's hot lane in the decode segments.
    pub(super) fn split_layer_hot(&mut self, l: usize, plan: MoePlan) -> Result<(), LayerFault> {
        let cx = LayerCtx::of(&self.dev, self.call_idx, l, Phase::Decode, 1);
        self.moe.hot_lane_device(&cx, plan)
    }

    /// A split layer's cold lane between the decode segments' graphs, settled (a failed lane
    /// recomputed all-cold); the next part adds the layer's MoE output.
    pub(super) fn split_layer_cold(&mut self, l: usize, cold: &mut dyn ColdLane) -> Result<(), GpuError> {
        let cx = LayerCtx::of(&self.dev, self.call_idx, l, Phase::Decode, 1);
        let outcome = self.moe.cold_lane_device(&cx, cold);
        self.moe.settle(&cx, &mut self.perf, cold, outcome).map(|_| ())
    }

    /// The head's copies back for a call of `t` rows and `n` logits rows.
    pub(super) fn head_copies(&mut self, t: usize, n: usize) -> Result<Logits, GpuError> {
        self.head.copies(&self.dev, self.perf.mode(), t, n)
    }

    /// After the stream is idle: lane statistics, perf state, profile.
    pub(super) fn finish_call(
        &mut self,
        phase: Phase,
        t: usize,
        call_start: Instant,
        copy_start: Instant,
        copy_us: f64,
    ) -> Result<(), GpuError> {
        let mut layers = std::mem::take(&mut self.stats.layers);
        layers.clear();
        for (r, ev) in self.moe.records.iter().zip(&mut self.moe.lane_events) {
            layers.push(stats::lane_stats(r, ev.hot_us(r, phase == Phase::Decode)?));
        }
        // decode calls fetch only with `PostFetchOptions::decode`
        if phase != Phase::Decode || self.moe.postfetch.as_ref().is_some_and(|p| p.opts.decode) {
            self.moe.postfetch_finish(&mut self.perf)?;
        }
        let total_us = call_start.elapsed().as_secs_f64() * 1e6;
        self.stats = ForwardStats { n_tokens: t, prefill: phase != Phase::Decode, layers, total_us };
        if self.perf.mode() != PerfMode::Off {
            let (c, cap) = (&self.dev.cfg, self.dev.s().cap);
            let stride = t * c.n_experts_used;
            // Brought back with the greedy tokens by `HeadStage::copies`.
            let ids = &self.head.pin_tail.as_slice()?[cap..][..c.n_layers * stride];
            let (hot, experts) = (self.moe.hot.resident(), &self.dev.expert_layers);
            stats::record_call(&mut self.perf, &self.stats, (ids, stride, stride), hot, experts);
        }
        if let Some(p) = &mut self.dev.profiler {
            let enqueue_us = (copy_start - call_start).as_secs_f64() * 1e6;
            p.collect(&CallTimes {
                decode: phase == Phase::Decode,
                n_tokens: t,
                copy_us,
                enqueue_us,
                total_us,
            })?;
        }
        Ok(())
    }

    /// Turn on the per-stage GPU timing breakdown: CUDA event records at stage boundaries,
    /// read after each call's final copy.
    pub fn enable_profile(&mut self) -> Result<(), GpuError> {
        let (be, n_layers) = (&self.dev.be, self.dev.cfg.n_layers);
        let n_marks = stats::PROFILE_LAYER_STAGES.len() + 1;
        let layer_marks = (0..n_layers)
            .map(|_| (0..n_marks).map(|_| be.event()).collect::<Result<Vec<_>, _>>())
            .collect::<Result<Vec<_>, _>>()?;
        let tail_marks = (0..3).map(|_| be.event()).collect::<Result<Vec<_>, _>>()?;
        self.dev.profiler = Some(Profiler {
            layer_marks,
            tail_marks,
            decode: StageProfile::default(),
            prefill: StageProfile::default(),
        });
        Ok(())
    }

    /// The profile as text (decode and prefill), when profiling is on.
    pub fn profile_report(&self) -> Option<String> {
        let p = self.dev.profiler.as_ref()?;
        Some(format!("{}{}", p.decode.report("decode"), p.prefill.report("prefill")))
    }

    /// Clear the accumulated profile.
    pub fn reset_profile(&mut self) {
        if let Some(p) = &mut self.dev.profiler {
            p.decode = StageProfile::default();
            p.prefill = StageProfile::default();
        }
    }

    pub(super) fn dev(&self) -> &Device {
        &self.dev
    }

    pub(super) fn dev_mut(&mut self) -> &mut Device {
        &mut self.dev
    }

    pub(super) fn mixer(&self) -> &MixerStage {
        &self.mixer
    }

    /// The shared device state beside the mixer and MoE stages, to change the stages.
    pub(super) fn stages_mut(&mut self) -> (&Device, &mut MixerStage, &mut MoeStage) {
        (&self.dev, &mut self.mixer, &mut self.moe)
    }

    /// The embedding of the call's tokens.
    pub(super) fn embed(&mut self, tokens: &[u32]) -> Result<(), GpuError> {
        self.head.embed(&self.dev, tokens)
    }
}
