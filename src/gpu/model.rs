//! `GpuModel`: a model resident on one GPU (non-expert weights + the VRAM hot cache) and the
//! forward call that drives it. The per-layer work lives in `dense` (attention, router, shared
//! expert) and `moe` (the hot/cold split, the lanes, the join and the fallback); statistics in
//! `stats`.

use super::graph::{DecodeGraph, DecodeSegments};
use super::hot_cache::HotCache;
use super::hot_dequant::HotDequant;
use super::kv::GpuKvCache;
use super::postfetch::plan::{PostFetchOptions, PostFetchTotals};
use super::postfetch::PostFetch;
use super::scratch::{HostScratch, Scratch};
use super::stats::{self, CallTimes, ForwardStats, LaneEvents, LayerRecord, Profiler, StageProfile};
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
use crate::moe::faults::{FaultLane, LaneFault, LaneFaultSchedule};
use crate::moe::phase::Phase;
use crate::reference::ForwardError;
use moe_lanes_kernels::cuda::{CudaBackend, DPtr, DeviceBuffer};
use moe_lanes_kernels::WeightDType;
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// How long the join waits for the hot lane before the layer falls back to all-cold.
/// Generous: a long prefill on a busy device can take seconds per layer.
pub const HOT_LANE_TIMEOUT: Duration = Duration::from_secs(120);

/// Faults injected on purpose (tests and `MOE_LANES_FAULT`), to prove each fallback path.
/// A layer named here always takes the host path (worklist built on the host).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuFaults {
    /// The hot lane's launch fails in this layer.
    pub hot_error_layer: Option<usize>,
    /// The hot lane "does not finish" in time in this layer.
    pub hot_timeout_layer: Option<usize>,
    /// The cold lane returns an error in this layer.
    pub cold_error_layer: Option<usize>,
    /// The cold lane panics in this layer.
    pub cold_panic_layer: Option<usize>,
    /// The host worklist of this layer is corrupted after it is built.
    pub corrupt_worklist_layer: Option<usize>,
    /// The device is "lost" at the start of this forward call (counted from 1).
    pub gpu_lost_at_call: Option<u64>,
    /// Post-Fetch's readiness query in this layer finds every copy still in flight (waited for
    /// with `block_on_miss`, else computed on the CPU).
    pub postfetch_late_layer: Option<usize>,
    /// Seeded faults per (call, layer): the hot lane's error or panic is a failed launch, its
    /// stall a time-out; the cold lane errors or panics (it cannot stall: the join runs it).
    pub schedule: Option<LaneFaultSchedule>,
}

/// The faults of one layer in one forward call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayerFaults {
    pub hot_error: bool,
    pub hot_timeout: bool,
    pub cold_error: bool,
    pub cold_panic: bool,
    pub worklist: bool,
    /// Prefill only (Post-Fetch), so not in [`LayerFaults::any`], which sends decode layers to
    /// the host path.
    pub postfetch_late: bool,
}

impl LayerFaults {
    pub fn any(&self) -> bool {
        self.hot_error || self.hot_timeout || self.cold_error || self.cold_panic || self.worklist
    }
}

impl GpuFaults {
    /// What goes wrong in layer `l` of forward call `call_idx` (counted from 1).
    pub fn at(&self, call_idx: u64, l: usize) -> LayerFaults {
        let mut f = LayerFaults {
            hot_error: self.hot_error_layer == Some(l),
            hot_timeout: self.hot_timeout_layer == Some(l),
            cold_error: self.cold_error_layer == Some(l),
            cold_panic: self.cold_panic_layer == Some(l),
            worklist: self.corrupt_worklist_layer == Some(l),
            postfetch_late: self.postfetch_late_layer == Some(l),
        };
        if let Some(s) = &self.schedule {
            match s.fault(call_idx, l, FaultLane::Hot(0), true) {
                Some(LaneFault::Error | LaneFault::Panic) => f.hot_error = true,
                Some(LaneFault::Stall) => f.hot_timeout = true,
                None => {}
            }
            match s.fault(call_idx, l, FaultLane::Cold(0), false) {
                Some(LaneFault::Panic) => f.cold_panic = true,
                Some(_) => f.cold_error = true,
                None => {}
            }
        }
        f
    }
}

/// A `MOE_LANES_FAULT` entry that is not `NAME:NUMBER` with a known name.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("fault '{entry}': expected NAME:N with NAME one of hot_error, hot_timeout, cold_error, cold_panic, worklist, postfetch_late, gpu_lost, seed")]
pub struct BadFault {
    pub entry: String,
}

impl std::str::FromStr for GpuFaults {
    type Err = BadFault;
    /// `hot_error:1,cold_panic:0,gpu_lost:3` (layers, and the call number for `gpu_lost`);
    /// `seed:S` adds a seeded schedule faulting about one lane task in ten.
    fn from_str(s: &str) -> Result<GpuFaults, BadFault> {
        let mut f = GpuFaults::default();
        for entry in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let bad = || BadFault { entry: entry.to_string() };
            let (name, n) = entry.split_once(':').ok_or_else(bad)?;
            let n: usize = n.parse().map_err(|_| bad())?;
            match name {
                "hot_error" => f.hot_error_layer = Some(n),
                "hot_timeout" => f.hot_timeout_layer = Some(n),
                "cold_error" => f.cold_error_layer = Some(n),
                "cold_panic" => f.cold_panic_layer = Some(n),
                "worklist" => f.corrupt_worklist_layer = Some(n),
                "postfetch_late" => f.postfetch_late_layer = Some(n),
                "gpu_lost" => f.gpu_lost_at_call = Some(n as u64),
                "seed" => f.schedule = Some(LaneFaultSchedule::seeded(n as u64)),
                _ => return Err(bad()),
            }
        }
        Ok(f)
    }
}

/// How prefill attention runs (an A/B switch: `MOE_LANES_GPU_ATTENTION` at the CLI). Decode
/// always splits positions over blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefillAttention {
    /// [`PrefillAttention::Tiled`]'s blocks with both products on the tensor cores (bf16 hi + lo
    /// operands, about f32 accuracy; heads of a multiple of 16 up to 128 dims on sm_80 and later,
    /// else the tiled kernel).
    #[default]
    Mma,
    /// Flash-style: a block per tile of query rows of one kv head's group, keys staged in
    /// shared-memory tiles, f32 on the CUDA cores (heads up to 128 dims; wider heads run per row).
    Tiled,
    /// One block per (token, head), reading the cache once per row.
    #[serde(rename = "rows")]
    PerRow,
}

/// The activations prefill GEMMs feed the tensor cores (`MOE_LANES_PREFILL_ACTIVATIONS` at the
/// CLI). The reference computes in f32; bf16 keeps 8 mantissa bits of each activation, split
/// hi + lo about 16 (two GEMMs, or two MMAs per step in the grouped hot lane).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefillActivations {
    /// Split hi + lo for every weight type.
    Split,
    /// One bf16 rounding for every weight type.
    Bf16,
    /// Split for float weights; one bf16 rounding for quantized weights, whose own rounding is
    /// far coarser (llama.cpp quantizes their activations to 8 bits).
    #[default]
    Auto,
}

impl PrefillActivations {
    /// Whether a GEMM over weights of `dtype` takes split activations.
    pub fn split(self, dtype: WeightDType) -> bool {
        match self {
            PrefillActivations::Split => true,
            PrefillActivations::Bf16 => false,
            PrefillActivations::Auto => !dtype.is_quantized(),
        }
    }
}

/// Engine switches.
#[derive(Debug, Clone, Copy)]
pub struct GpuOptions {
    /// The prefill hot lane's GEMMs: grouped (default) or per expert through cuBLAS.
    pub prefill_attention: PrefillAttention,
    /// What prefill GEMMs take as activations, by weight type.
    pub prefill_activations: PrefillActivations,
    /// VRAM for bf16 chunks of quantized hot slots in grouped prefill (the A/B baseline of
    /// `hot_dequant`: at least one slot a chunk); 0 (default): no scratch, the grouped kernels
    /// decode the quantized tiles themselves.
    pub hot_dequant_bytes: usize,
    /// Dequantize the next chunk of quantized hot slots on the side stream while the current
    /// chunk's GEMMs run (two half-size chunks in the scratch); off (default): one chunk, both on
    /// the compute stream.
    pub hot_dequant_overlap: bool,
    pub perf_mode: PerfMode,
    /// Record CUDA events per stage (`MOE_LANES_GPU_PROFILE=1` at the CLI).
    pub profile: bool,
    /// Copy every logits row to the host; off: only the greedy tokens come back.
    pub copy_logits: bool,
    pub hot_lane_timeout: Duration,
    pub faults: GpuFaults,
    /// One-token decode calls over a model whose layers are all hot replay a captured CUDA graph
    /// (`graph`), those over a model with cold experts its decode segments (graphs between the
    /// host steps); off: every kernel is launched one by one (`MOE_LANES_GPU_GRAPH=0` at the CLI).
    pub decode_graph: bool,
    /// The decode graphs time each all-hot layer's hot lane by a pair of CUDA events on every
    /// call (`MOE_LANES_GRAPH_LANE_EVENTS=1` at the CLI; an A/B). Off (default): no events in
    /// the graphs' all-hot layers, which would stop programmatic dependent launch there (6% of
    /// all-hot tg on the H100); one call in `graph::HOT_TIMING_EVERY_CALLS` runs eagerly
    /// instead, timed, and the others report its times.
    pub graph_lane_events: bool,
    /// Post-Fetch of cold experts in prefill (`postfetch` module).
    pub postfetch: PostFetchOptions,
    /// One-token decode GEMVs of quantized weights (the dense matrices and the hot lane) take
    /// their activations quantized to 8 bits per block of 32 on the device and dot them in
    /// integers (llama.cpp's MMVQ; bound in `moe_lanes_kernels::q8`); off: f32 activations
    /// (f32 rounding only). `--activations f32` at the CLI turns it off.
    pub q8_activations: bool,
    /// The KV cache's element type (`--cache-type-k/v` at the CLI): f16 (default) or f32.
    pub kv_type: KvType,
    /// A decode call (a batched step) of at least this many tokens runs its dense projections
    /// and the lm_head as GEMMs (each weight read once for every row) instead of per-row GEMVs;
    /// its MoE keeps the decode path (worklist on the device, no host sync when all hot).
    pub batch_gemm_min_tokens: usize,
}

/// [`GpuOptions::batch_gemm_min_tokens`]'s default.
pub const BATCH_GEMM_MIN_TOKENS: usize = 8;

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            prefill_attention: PrefillAttention::Mma,
            prefill_activations: PrefillActivations::default(),
            hot_dequant_bytes: 0,
            hot_dequant_overlap: false,
            perf_mode: PerfMode::Full,
            profile: false,
            copy_logits: true,
            hot_lane_timeout: HOT_LANE_TIMEOUT,
            faults: GpuFaults::default(),
            decode_graph: true,
            graph_lane_events: false,
            postfetch: PostFetchOptions::default(),
            q8_activations: true,
            kv_type: KvType::F16,
            batch_gemm_min_tokens: BATCH_GEMM_MIN_TOKENS,
        }
    }
}

/// Elements of the prefill dequantization scratch (bf16, 32 MiB): a quantized matrix with more
/// elements is dequantized and multiplied in row ranges.
const DEQUANT_SCRATCH_ELEMS: usize = 16 << 20;

/// The dequantization scratch a model needs: none for a float model, else room for the largest
/// quantized matrix (dense or expert) up to [`DEQUANT_SCRATCH_ELEMS`].
fn dequant_scratch(
    be: &CudaBackend,
    cfg: &ModelConfig,
    w: &DenseWeights,
    hot: &HotCache,
) -> Result<Option<DeviceBuffer<u16>>, GpuError> {
    let experts = if hot.any_quantized() { cfg.expert_ff * cfg.hidden } else { 0 };
    let most = w.max_quantized_elems.max(experts);
    if most == 0 {
        return Ok(None);
    }
    let widest_row = cfg.hidden.max(cfg.q_dim()).max(cfg.expert_ff).max(cfg.shared_expert_ff);
    Ok(Some(be.alloc_zeros::<u16>(most.min(DEQUANT_SCRATCH_ELEMS.max(widest_row)))?))
}

pub struct GpuModel {
    pub(crate) be: Arc<CudaBackend>,
    pub(crate) model: Arc<Model>,
    pub(crate) cfg: ModelConfig,
    /// Every layer's kind (the engine walks it; each stage reads its layer's spec).
    pub(crate) plan: LayerPlan,
    /// Every layer's q/k norm + RoPE is the fused launch (`qk_fused`), which the decode graphs
    /// need; fixed by the plan, so decided once here.
    pub(crate) qk_fused_all: bool,
    pub(crate) opts: GpuOptions,
    pub(crate) w: DenseWeights,
    pub(crate) hot: HotCache,
    pub(crate) scratch: Option<Scratch>,
    pub(crate) host: HostScratch,
    pub(crate) lane_events: Vec<LaneEvents>,
    pub(crate) records: Vec<LayerRecord>,
    pub(crate) stats: ForwardStats,
    pub(crate) perf: PerfState,
    /// The plain CPU cold lane: computes a layer when the given cold lane failed.
    pub(crate) fallback_cold: PlainColdLane,
    pub(crate) profiler: Option<Profiler>,
    /// Partials of the split decode attention (grown to the cache's capacity on demand).
    pub(crate) attn_part: Option<DeviceBuffer<f32>>,
    /// bf16 rows of quantized matrices for the prefill GEMMs (none for a float model).
    pub(crate) dequant: Option<DeviceBuffer<u16>>,
    /// bf16 gate, up and down of two chunks of quantized hot slots for the grouped prefill
    /// GEMMs (none for a float model).
    pub(crate) hot_dequant: Option<HotDequant>,
    /// Post-Fetch's scratchpad, streams and totals (none: off, or not a bf16 model).
    pub(crate) postfetch: Option<PostFetch>,
    pub(super) call_idx: u64,
    /// Decode calls that could run as graphs (the timing sample's count).
    pub(super) graph_calls: u64,
    /// The captured one-token decode call, replayed while its key holds.
    pub(super) graph: Option<DecodeGraph>,
    /// The captured decode call of a model with cold experts in some layers.
    pub(super) segments: Option<DecodeSegments>,
    /// While a decode graph is captured: the most positions its attention is sized for (the
    /// position itself is read from device memory, `Scratch::step`).
    pub(crate) step: Option<usize>,
}

impl GpuModel {
    /// Whether the GPU engine runs every layer kind of `model`'s plan; the first it lacks, by
    /// name, otherwise (checked before anything touches the device).
    pub fn supports(model: &Model) -> Result<(), GpuError> {
        let cfg = model.config();
        if cfg.head_dim % 2 == 1 {
            return Err(GpuError::OddHeadDim { head_dim: cfg.head_dim });
        }
        if let Some((layer_idx, kind)) = model.plan().first_unsupported(super::dense::runs_mixer) {
            return Err(GpuError::Mixer { layer_idx, kind });
        }
        // Layers with their own head dim or KV heads (Gemma 4's global layers), sandwich norms and
        // output scalars have no kernels here yet; nor embedding scales or soft-capped logits.
        let own_sizes = |l: &crate::model::arch::LayerSpec| {
            l.as_attention().is_some_and(|a| a.head_dim != cfg.head_dim || a.n_kv_heads != cfg.n_kv_heads)
        };
        if let Some(layer_idx) = model.plan().layers().iter().position(own_sizes) {
            return Err(GpuError::Mixer { layer_idx, kind: "attention with its own head dim or KV heads" });
        }
        let sandwich = |l: &crate::model::arch::LayerSpec| l.post_norms || l.output_scale;
        if let Some(layer_idx) = model.plan().layers().iter().position(sandwich) {
            return Err(GpuError::Mixer { layer_idx, kind: "a layer with post norms or an output scalar" });
        }
        if cfg.embedding_scale.is_some() || cfg.final_logit_softcap.is_some() {
            return Err(GpuError::Mixer { layer_idx: 0, kind: "scaled embeddings or soft-capped logits" });
        }
        let activation = model.plan().expert_activation();
        if activation != crate::model::arch::FfnActivation::Silu {
            return Err(GpuError::Activation { activation });
        }
        // Dense FFN layers, sigmoid routing and ungated shared experts (DeepSeek-V3) have no
        // kernels here yet.
        if let Some((layer_idx, kind)) = model.plan().first_unsupported_ffn(|f| match f {
            crate::model::arch::Ffn::Moe(m) => {
                m.router.variant != crate::model::arch::RoutingVariant::Sigmoid
                    && m.shared.is_none_or(|s| s.gated)
            }
            crate::model::arch::Ffn::Dense(_) => false,
        }) {
            return Err(GpuError::Ffn { layer_idx, kind });
        }
        // Router and expert biases (GPT-OSS) have no kernels here yet.
        let biased =
            |l: &crate::model::arch::LayerSpec| l.as_moe().is_some_and(|m| m.router.bias || m.expert_bias);
        if let Some(layer_idx) = model.plan().layers().iter().position(biased) {
            return Err(GpuError::Ffn { layer_idx, kind: "mixture of experts with router or expert biases" });
        }
        // Gemma 4's scaled router, per-expert scales and per-branch norms have no kernels here yet.
        let gemma = |l: &crate::model::arch::LayerSpec| {
            l.as_moe().is_some_and(|m| m.router.scaled_input || m.router.per_expert_scale || m.branch_norms)
        };
        if let Some(layer_idx) = model.plan().layers().iter().position(gemma) {
            return Err(GpuError::Ffn {
                layer_idx,
                kind: "mixture of experts with a scaled router, per-expert scales or branch norms",
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
        let dequant = dequant_scratch(&be, &cfg, &w, &hot)?;
        let wants_scratch = opts.hot_dequant_bytes > 0;
        let hot_dequant = if hot.any_quantized() && wants_scratch {
            Some(HotDequant::new(&be, &cfg, opts.hot_dequant_bytes, opts.hot_dequant_overlap)?)
        } else {
            None
        };
        let postfetch = PostFetch::new(&be, &model, opts.postfetch)?;
        let lane_events = (0..cfg.n_layers)
            .map(|_| Ok(LaneEvents::new(be.event()?, be.event()?)))
            .collect::<Result<Vec<_>, GpuError>>()?;
        let mut gm = GpuModel {
            plan: model.plan().clone(),
            qk_fused_all: model
                .plan()
                .layers()
                .iter()
                .all(|s| s.as_attention().is_none_or(super::dense::qk_fusable)),
            perf: PerfState::new(opts.perf_mode, cfg.n_layers, cfg.n_experts, cfg.n_experts_used),
            fallback_cold: PlainColdLane::new(model.clone()),
            host: HostScratch::new(&cfg, 8),
            records: vec![LayerRecord::default(); cfg.n_layers],
            stats: ForwardStats::default(),
            scratch: None,
            profiler: None,
            attn_part: None,
            dequant,
            hot_dequant,
            postfetch,
            call_idx: 0,
            graph_calls: 0,
            graph: None,
            segments: None,
            step: None,
            lane_events,
            hot,
            w,
            opts,
            cfg,
            model,
            be,
        };
        if opts.profile {
            gm.enable_profile()?;
        }
        Ok(gm)
    }

    /// Allocate the hot cache once (capacity = each layer's hot count) and fill it.
    pub fn allocate_hot(&mut self, set: &HotSet) -> Result<(), GpuError> {
        self.be.bind_to_thread()?;
        self.graph = None; // its slot pointers go with the old cache
        self.segments = None;
        self.hot.allocate(&self.be, &self.model, set)?;
        if let Some(pf) = self.postfetch.as_mut() {
            let n = self.cfg.n_experts;
            let cold = set.layers.iter().map(|ls| n - ls.n_hot().min(n));
            pf.fit_slots(&self.be, super::postfetch::plan::fitted_slots(pf.slots, cold))?;
        }
        Ok(())
    }

    /// Exchange one cache slot between calls: `add` takes the slot of `evict`.
    pub fn exchange(&mut self, layer_idx: usize, evict: usize, add: usize) -> Result<(), GpuError> {
        self.be.bind_to_thread()?;
        self.hot.exchange(&self.be, &self.model, layer_idx, evict, add)
    }

    pub fn hot_set(&self) -> &HotSet {
        self.hot.set()
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn backend(&self) -> &Arc<CudaBackend> {
        &self.be
    }

    pub fn perf(&self) -> &PerfState {
        &self.perf
    }

    /// Start the perf state over (after a learn pass, say).
    pub fn reset_perf(&mut self) {
        let c = &self.cfg;
        self.perf = PerfState::new(self.opts.perf_mode, c.n_layers, c.n_experts, c.n_experts_used);
        if let Some(pf) = self.postfetch.as_mut() {
            pf.totals = PostFetchTotals::default();
        }
    }

    /// The cold lane's thread count: Post-Fetch's CPU cost per token and its staging threads.
    pub fn set_cold_threads(&mut self, n_threads: usize) {
        let (h, ff) = (self.cfg.hidden, self.cfg.expert_ff);
        if let Some(pf) = self.postfetch.as_mut() {
            pf.set_cold_threads(h, ff, n_threads);
        }
    }

    pub fn perf_mut(&mut self) -> &mut PerfState {
        &mut self.perf
    }

    /// Bytes of the hot expert caches (all layers).
    pub fn hot_cache_bytes(&self) -> usize {
        self.hot.bytes()
    }

    /// Bytes of the non-expert matrices on the device.
    pub fn weight_bytes(&self) -> usize {
        self.w.matrix_bytes
    }

    pub fn set_copy_logits(&mut self, on: bool) {
        self.opts.copy_logits = on;
    }

    pub fn copies_logits(&self) -> bool {
        self.opts.copy_logits
    }

    /// Statistics of the last forward call.
    pub fn last_stats(&self) -> &ForwardStats {
        &self.stats
    }

    /// A KV cache for up to `capacity` positions.
    pub fn new_kv_cache(&self, capacity: usize) -> Result<GpuKvCache, GpuError> {
        if capacity == 0 || capacity > self.cfg.max_positions {
            return Err(GpuError::CacheCapacity { capacity, max_positions: self.cfg.max_positions });
        }
        GpuKvCache::new(&self.be, &self.plan, self.cfg.kv_dim(), capacity, self.opts.kv_type)
    }

    /// Device scratch (and its host twin) for calls of up to `t` tokens; grows, never shrinks.
    pub fn reserve_tokens(&mut self, t: usize) -> Result<(), GpuError> {
        if self.scratch.as_ref().is_some_and(|s| s.cap >= t) {
            return Ok(());
        }
        self.scratch = None; // free first
        let gated = self.plan.layers().iter().any(|l| l.as_attention().is_some_and(|a| a.output_gate));
        let s = Scratch::new(&self.be, &self.cfg, t, gated)?;
        self.host = HostScratch::new(&self.cfg, s.cap);
        self.scratch = Some(s);
        Ok(())
    }

    pub(super) fn check_call(&self, tokens: &[u32], cache: &GpuKvCache) -> Result<(), GpuError> {
        let c = &self.cfg;
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
    pub fn forward_rows(
        &mut self,
        tokens: &[u32],
        phase: Phase,
        cache: &mut GpuKvCache,
        cold: &mut dyn ColdLane,
        rows: LogitRows,
    ) -> Result<Logits, GpuError> {
        let call_start = Instant::now();
        self.check_call(tokens, cache)?;
        self.call_idx += 1;
        if self.opts.faults.gpu_lost_at_call == Some(self.call_idx) {
            return Err(GpuError::Injected { what: "gpu lost" });
        }
        self.be.bind_to_thread()?;
        let t = tokens.len();
        self.reserve_tokens(t)?;
        let pos0 = cache.n_positions;
        if pos0 == 0 {
            // A new (or cleared) session: recurrent layers start from zero state.
            cache.reset_recurrent(&self.be)?;
        }
        let eager = self.timing_sample(tokens, phase);
        if !eager && self.graph_eligible(tokens, phase) {
            return self.forward_graph(tokens[0], cache, cold, rows, call_start);
        }
        if !eager && self.segments_eligible(tokens, phase) {
            return self.forward_segments(tokens[0], cache, cold, rows, call_start);
        }
        self.embed(tokens)?;
        let segs = [GpuSeg::whole(cache, t)];
        for l in 0..self.cfg.n_layers {
            self.mark(l, 0)?;
            self.mixer_block(l, phase, t, &segs)?;
            self.moe_block(l, phase, t, cold)?;
        }
        let copy_start = Instant::now();
        let logits = self.head(phase, t, rows)?;
        let copy_us = copy_start.elapsed().as_secs_f64() * 1e6;
        cache.n_positions += t;
        self.finish_call(phase, t, call_start, copy_start, copy_us)?;
        Ok(logits)
    }

    pub(super) fn embed(&mut self, tokens: &[u32]) -> Result<(), GpuError> {
        let s = self.scratch.as_ref().expect("reserved");
        self.host.tokens_i32.clear();
        self.host.tokens_i32.extend(tokens.iter().map(|&x| x as i32));
        self.mark_tail(0)?;
        self.be.write(&self.host.tokens_i32, s.tokens.ptr())?;
        self.embed_rows(s.tokens.ptr().sub(0, tokens.len()))
    }

    /// The embedding rows of the token ids at `ids` (on the device) into the hidden rows.
    pub(super) fn embed_rows(&self, ids: DPtr<i32>) -> Result<(), GpuError> {
        let s = self.scratch.as_ref().expect("reserved");
        let (table, n, h) = (self.w.embed.view(), ids.len(), self.cfg.hidden);
        match table.bf16() {
            Some(bf) => self.be.embed(bf, ids, s.hidden.ptr(), n, h)?,
            None => self.be.embed_typed(table, self.cfg.vocab, ids, s.hidden.ptr(), n, h)?,
        }
        Ok(())
    }

    /// Final norm, lm_head, greedy tokens on the GPU, and the copies back, for the `rows` asked
    /// for (`Last`: the last token's row alone, by the one-row GEMV).
    fn head(&mut self, phase: Phase, t: usize, rows: LogitRows) -> Result<Logits, GpuError> {
        let n = self.head_kernels(phase, t, rows)?;
        self.head_copies(t, n)
    }

    /// The head's kernels (final norm, lm_head, argmax) for the `rows` asked for; returns how
    /// many logits rows they wrote.
    pub(super) fn head_kernels(&self, phase: Phase, t: usize, rows: LogitRows) -> Result<usize, GpuError> {
        let (c, be) = (&self.cfg, &self.be);
        let s = self.scratch.as_ref().expect("reserved");
        let (first, n, phase) = match rows {
            LogitRows::All => (0, t, phase),
            LogitRows::Last => (t - 1, 1, Phase::Decode),
        };
        let x = s.hidden.ptr().sub(first * c.hidden, n * c.hidden);
        let head = self.w.lm_head.as_ref().unwrap_or(&self.w.embed).view();
        be.rmsnorm(x, self.w.final_norm.ptr(), s.normed.ptr(), n, c.hidden, c.rms_eps)?;
        self.linear(phase, s.normed.ptr(), head, s.logits.ptr(), n, c.vocab, c.hidden, false)?;
        self.mark_tail(1)?;
        if n <= 8 {
            // decode: one row over many blocks (the one-block-per-row kernel is latency bound)
            be.argmax_split(s.logits.ptr(), n, c.vocab, s.argmax(), s.argmax_part.ptr())?;
        } else {
            be.argmax(s.logits.ptr(), n, c.vocab, s.argmax())?;
        }
        self.mark_tail(2)?;
        Ok(n)
    }

    /// The head's copies back: every logits row when asked for, and the greedy tokens.
    pub(super) fn head_copies(&mut self, t: usize, n: usize) -> Result<Logits, GpuError> {
        let (c, be) = (&self.cfg, &self.be);
        let s = self.scratch.as_ref().expect("reserved");
        let mut data = Vec::new();
        if self.opts.copy_logits {
            data = vec![0f32; n * c.vocab];
            be.read(s.logits.ptr().sub(0, n * c.vocab), &mut data)?;
        }
        let vocab = c.vocab;
        let argmax = self.read_tail(t, n)?;
        Ok(Logits { n_rows: n, vocab, data, argmax })
    }

    /// The call's `n` greedy tokens; when the perf state records, the same copy also brings
    /// every layer's routing ids of the call's `t` tokens into `pin_tail` (one transfer).
    fn read_tail(&mut self, t: usize, n: usize) -> Result<Vec<u32>, GpuError> {
        let (be, s) = (&self.be, self.scratch.as_mut().expect("reserved"));
        if self.perf.mode() == PerfMode::Off {
            let mut am = vec![0i32; n];
            be.read(s.argmax().sub(0, n), &mut am)?;
            return Ok(am.into_iter().map(|x| x as u32).collect());
        }
        let len = s.cap + self.cfg.n_layers * t * self.cfg.n_experts_used;
        be.read_async(s.tail_i.ptr().sub(0, len), &mut s.pin_tail, len)?;
        Ok(s.pin_tail.as_slice()?[..n].iter().map(|&x| x as u32).collect())
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
        for (r, ev) in self.records.iter().zip(&mut self.lane_events) {
            layers.push(stats::lane_stats(r, ev.hot_us(r, phase == Phase::Decode)?));
        }
        // decode calls fetch only with `PostFetchOptions::decode`
        if phase != Phase::Decode || self.postfetch.as_ref().is_some_and(|p| p.opts.decode) {
            self.postfetch_finish()?;
        }
        let total_us = call_start.elapsed().as_secs_f64() * 1e6;
        self.stats = ForwardStats { n_tokens: t, prefill: phase != Phase::Decode, layers, total_us };
        if self.perf.mode() != PerfMode::Off {
            let s = self.scratch.as_ref().expect("reserved");
            let stride = t * self.cfg.n_experts_used;
            // Brought back with the greedy tokens by `read_tail`.
            let ids = &s.pin_tail.as_slice()?[s.cap..][..self.cfg.n_layers * stride];
            stats::record_call(&mut self.perf, &self.stats, ids, stride, stride, self.hot.set());
        }
        if let Some(p) = &mut self.profiler {
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
        let n_marks = stats::PROFILE_LAYER_STAGES.len() + 1;
        let layer_marks = (0..self.cfg.n_layers)
            .map(|_| (0..n_marks).map(|_| self.be.event()).collect::<Result<Vec<_>, _>>())
            .collect::<Result<Vec<_>, _>>()?;
        let tail_marks = (0..3).map(|_| self.be.event()).collect::<Result<Vec<_>, _>>()?;
        self.profiler = Some(Profiler {
            layer_marks,
            tail_marks,
            decode: StageProfile::default(),
            prefill: StageProfile::default(),
        });
        Ok(())
    }

    /// The profile as text (decode and prefill), when profiling is on.
    pub fn profile_report(&self) -> Option<String> {
        self.profiler
            .as_ref()
            .map(|p| format!("{}{}", p.decode.report("decode"), p.prefill.report("prefill")))
    }

    /// Clear the accumulated profile.
    pub fn reset_profile(&mut self) {
        if let Some(p) = &mut self.profiler {
            p.decode = StageProfile::default();
            p.prefill = StageProfile::default();
        }
    }

    pub(crate) fn mark(&self, l: usize, m: usize) -> Result<(), GpuError> {
        if let Some(p) = &self.profiler {
            self.be.record(&p.layer_marks[l][m])?;
        }
        Ok(())
    }

    pub(super) fn mark_tail(&self, m: usize) -> Result<(), GpuError> {
        if let Some(p) = &self.profiler {
            self.be.record(&p.tail_marks[m])?;
        }
        Ok(())
    }
}
