//! The pipeline engine: the default forward pass of moe-lanes.
//!
//! Every token of a forward call is processed together: batched dense stage (embeddings,
//! RMSNorm, attention over the KV cache with RoPE per adapter, q/k norms, qkv bias, router
//! logits), then per MoE layer the lane pipeline — Router -> Dispatcher (worklist) -> hot
//! lane(s) and cold pool concurrently -> Join — with the shared expert (sigmoid-gated) computed
//! on the driver thread while the lanes run, then the final norm and the lm_head.
//!
//! The arithmetic here is written independently of [`crate::reference`] (the oracle), which the
//! tests compare it against. The phase is given per call; a call longer than
//! `max_batch_tokens` runs as sub-batches that all keep the call's phase. Slot exchanges queued
//! on the Updater are applied at the start of a call, never during one.
//!
//! Fallback: if the worklist fails its consistency check or a lane fails, that layer's experts
//! are computed all-cold on the driver thread from the RAM experts, and the fallback is counted
//! with its reason. The result is the same.

use crate::actors::messages::LANE_SPIN;
use crate::actors::{apply_exchanges, CpuHotLane, HotLane, LaneError, LaneSet, UpdaterHandle};
use crate::cache::hot_set::{HotSet, HotSetError, MAX_HOT_LANES};
use crate::cache::perf::{FallbackReason, LayerTiming, PerfMode, PerfState};
use crate::format::tensor::TensorError;
pub use crate::forward::argmax;
use crate::forward::BatchPiece;
pub use crate::forward::LogitRows;
use crate::model::arch::{DeltaNetSpec, LatentAttentionSpec, LayerPlan, Mixer, QkNorm, RopeSpec, RopeStyle};
use crate::model::config::ModelConfig;
use crate::model::context::StateCheckpoints;
use crate::model::Model;
use crate::moe::cold::{all_cold, ColdError, ColdLane, ColdSlot};
use crate::moe::delta_net::{conv_step, prefill, recurrent_step, DeltaNetState, PrefillWork, TokenInputs};
use crate::moe::dense::{
    check_matrices, decode_row, global_matrices, DenseStage, LayerMatrices, LayerVectors, MixerMatrices,
};
use crate::moe::expert_math::{
    cold_simd_level, ExpertKernel, FfnScratch, KernelLane, PlainKernel, SimdKernel,
};
use crate::moe::faults::LayerFailure;
use crate::moe::math::{dot, sigmoid};
use crate::moe::phase::{CacheState, ColdState, ExecPlan, Phase, PolicySwitches, PpPolicy};
use crate::moe::pool_lane::PoolLane;
use crate::moe::profile::{mark, CpuProfiler};
use crate::moe::routing::Router;
use crate::reference::ForwardError;
use moe_lanes_kernels::kv::{kv_ring_positions, KV_RING_CHUNK_POSITIONS};
use moe_lanes_kernels::{
    par_chunks_mut, AttentionInput, AttentionShape, ColdPool, DecodeActivations, DenseMatrix, KernelError,
    KvRows, KvType, MatmulPart, SimdLevel,
};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// Most tokens one sub-batch carries; longer calls are split (same phase). Every per-token
/// buffer of the engine (activations, worklist, lane buffers) is sized for it once:
/// roughly `max_batch_tokens * (6 * hidden + 2 * q_dim + k * hidden * 2)` floats.
pub const MAX_BATCH_TOKENS: usize = 512;
/// Calls of at least this many tokens run the per-head q/k norm and RoPE on the dense pool
/// (prefill; in decode the 36-odd heads cost less than waking the pool).
const PAR_HEADS_MIN_TOKENS: usize = 8;

/// Default cold-lane participants when none is given: the rule of `--cold-threads auto`
/// ([`crate::threads::auto_cold_threads`]) for a pipeline whose driver is cold participant 0 and
/// whose hot lanes hold no experts (every core). The driver computes its share while it would
/// otherwise wait for the lanes, so this many minus one worker threads start. `build_engine`
/// applies the same rule with the hot set known (one core less per busy hot lane).
pub fn default_cold_workers() -> usize {
    crate::threads::auto_cold_threads(&crate::threads::ThreadInputs::this_machine())
}

/// Default dense-stage threads: every core the process may use (the lanes are idle meanwhile).
pub fn default_dense_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// Test hooks that break things on purpose, to prove the fallback path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultInjection {
    /// Corrupt the worklist of this layer after it is built (every call).
    pub corrupt_worklist_layer: Option<usize>,
    /// Seeded lane faults (errors, panics, stalls) injected into lane tasks.
    pub lanes: Option<crate::actors::LaneFaultSchedule>,
    /// How long the join waits for the lanes of a layer (default: `LANE_TIMEOUT`).
    pub lane_timeout: Option<std::time::Duration>,
}

/// Which kernels the cold lane runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ColdKernels {
    /// The plain row-dot kernel of [`crate::moe::expert_math`] (bit-identical to the reference).
    Plain,
    /// The SIMD kernels of `moe-lanes-kernels` (equal within rounding).
    #[default]
    Simd,
}

impl std::str::FromStr for ColdKernels {
    type Err = String;
    fn from_str(s: &str) -> Result<ColdKernels, String> {
        match s {
            "plain" => Ok(ColdKernels::Plain),
            "simd" => Ok(ColdKernels::Simd),
            other => Err(format!("cold kernels '{other}': expected plain or simd")),
        }
    }
}

/// How to build a pipeline.
#[derive(Debug, Clone)]
pub struct PipelineOptions {
    /// Hot experts; `None` = none (cache off).
    pub hot_set: Option<HotSet>,
    /// Hot lanes (1..=3) when `hot_set` is `None`; otherwise the hot set decides.
    pub n_hot_lanes: usize,
    /// Cold-lane participants, the driver included when `driver_cold`.
    pub n_cold_workers: usize,
    /// The driver computes cold share 0 itself while the lanes run (saves a wake-up per layer).
    pub driver_cold: bool,
    /// Threads of the dense stage (attention, projections, router, shared expert, lm_head),
    /// the driver included; they run while the lanes are idle.
    pub n_dense_threads: usize,
    /// The cold lane runs on the dense stage's pool (one pool of pinned threads for both
    /// stages, the driver as thread 0; `n_cold_workers` of its threads, at most all of them, take
    /// cold work), splitting every cold expert by rows over them. Needs the SIMD kernels and
    /// `driver_cold`; otherwise, or when false, the lane actors' cold worker threads run it, one
    /// even share of the slots each.
    pub pool_cold: bool,
    /// Record the per-stage profile ([`crate::moe::profile`]; `MOE_LANES_CPU_PROFILE`).
    pub profile: bool,
    pub perf_mode: PerfMode,
    /// The cold lane's kernels.
    pub cold_kernels: ColdKernels,
    /// A forced SIMD level for the SIMD cold kernels (`None`: the best exact one).
    pub simd: Option<moe_lanes_kernels::SimdLevel>,
    /// Activations of the pool cold lane's tiles of quantised experts and of the dense stage's
    /// quantised matrices (`None`: [`moe_lanes_kernels::DecodeActivations::resolve`]'s default
    /// for the level). The lane-actor cold kernels (no pool lane) keep f32 activations, and so
    /// does the dense stage then.
    pub activations: Option<moe_lanes_kernels::DecodeActivations>,
    pub switches: PolicySwitches,
    pub max_batch_tokens: usize,
    pub fault: FaultInjection,
    /// The KV cache's element type (keys, values and latent attention's latents), converted on
    /// append; attention reads it a chunk at a time as f32 ([`PIPELINE_KV_TYPE`] by default).
    pub kv_type: KvType,
}

/// The pipeline's default KV cache type.
pub const PIPELINE_KV_TYPE: KvType = KvType::F32;

impl Default for PipelineOptions {
    fn default() -> Self {
        PipelineOptions {
            hot_set: None,
            n_hot_lanes: 1,
            n_cold_workers: default_cold_workers(),
            driver_cold: true,
            n_dense_threads: default_dense_threads(),
            pool_cold: true,
            profile: false,
            perf_mode: PerfMode::Full,
            cold_kernels: ColdKernels::Simd,
            simd: None,
            activations: None,
            switches: PolicySwitches::default(),
            max_batch_tokens: MAX_BATCH_TOKENS,
            fault: FaultInjection::default(),
            kv_type: PIPELINE_KV_TYPE,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error(transparent)]
    Tensor(#[from] TensorError),
    #[error(transparent)]
    HotSet(#[from] HotSetError),
    #[error(transparent)]
    Lane(#[from] LaneError),
    #[error("dense stage: {0}")]
    Kernel(#[from] KernelError),
    #[error("all-cold fallback failed: {0}")]
    Cold(#[from] ColdError),
    #[error("pipeline: {0}")]
    Setup(String),
    #[error(
        "KV cache type {kv_type} stores blocks of {block} values, but layer {layer}'s cached rows are {width} wide \
         (not a multiple of {block}): choose another type"
    )]
    KvBlocks { kv_type: KvType, block: usize, layer: usize, width: usize },
}

/// The engine's KV cache, head-major: per layer and KV head (`l * max_kv_heads + kv_head`; a
/// layer with fewer KV heads leaves the rest of its entries empty), the
/// keys and values of every position so far as one contiguous `positions x head_dim` buffer,
/// so attention streams a head's keys sequentially.
#[derive(Debug, Clone)]
pub struct PipelineCache {
    keys: Vec<KvRows>,
    values: Vec<KvRows>,
    /// Per layer, the fixed-size state of a Gated DeltaNet layer (`None` for attention layers,
    /// whose entries in `keys` / `values` are the ones used).
    recurrent: Vec<Option<DeltaNetState>>,
    /// Per layer, a latent attention layer's cache: per position the normalised latent and the
    /// rotated key part (`kv_lora_rank + rope_dim` floats; empty for other layers). It is the
    /// absorbed attention's one key/value head: keys and values are the same buffer.
    latent: Vec<KvRows>,
    /// Per layer, the position of its cached rows' first row: a sliding-window layer drops the
    /// positions no later query sees once it holds more than twice its ring
    /// (`kv_ring_positions`), keeping the ring; 0 for every other layer.
    kv_start: Vec<usize>,
    n_positions: usize,
    kv_type: KvType,
    /// `recurrent` at earlier positions.
    checkpoints: StateCheckpoints<Vec<Option<DeltaNetState>>>,
}

impl PipelineCache {
    pub fn n_positions(&self) -> usize {
        self.n_positions
    }

    /// Whether a layer holds recurrent (DeltaNet) state.
    pub fn has_recurrent(&self) -> bool {
        self.recurrent.iter().any(Option::is_some)
    }

    /// Keep the recurrent layers' state at the current position, for a later [`Self::truncate`]
    /// back to it; false (nothing kept) without recurrent layers or with one there already.
    pub fn checkpoint(&mut self) -> bool {
        if !self.has_recurrent() || self.checkpoints.has(self.n_positions) {
            return false;
        }
        self.checkpoints.push(self.n_positions, self.recurrent.clone());
        true
    }

    /// The most positions up to `n` that [`Self::truncate`] can keep: `n`, or with recurrent
    /// layers the latest checkpoint at or before it (all it holds from `n` up).
    pub fn rewind_point(&self, n: usize) -> Option<usize> {
        self.checkpoints.reach(n, self.n_positions, self.has_recurrent())
    }

    /// Keep the first `n` positions (a cached prefix reused), a recurrent layer's state from its
    /// checkpoint at `n`; false, changing nothing, where a recurrent state has no checkpoint at
    /// `n`, a sliding-window layer has dropped keys position `n` still sees (more than a call's
    /// `KV_RING_CHUNK_POSITIONS` back, as the GPU's rings), or `n` is more than it holds.
    pub fn truncate(&mut self, n: usize) -> bool {
        let recurrent = self.has_recurrent() && n != self.n_positions;
        let dropped = self.kv_start.iter().any(|&s| s > 0);
        if n > self.n_positions
            || (recurrent && !self.checkpoints.has(n))
            || (dropped && n + KV_RING_CHUNK_POSITIONS < self.n_positions)
        {
            return false;
        }
        if recurrent {
            self.recurrent.clone_from(self.checkpoints.rewind(n).expect("checked above"));
        }
        let per_layer = self.keys.len() / self.kv_start.len().max(1);
        for (l, &start) in self.kv_start.iter().enumerate() {
            let held = (self.n_positions - start).max(1);
            let keep = n.saturating_sub(start);
            let heads = l * per_layer..(l + 1) * per_layer;
            let bufs = self.keys[heads.clone()].iter_mut().chain(&mut self.values[heads]);
            for buf in bufs.chain(std::iter::once(&mut self.latent[l])) {
                let width = buf.n_values() / held;
                buf.truncate(keep * width);
            }
        }
        self.n_positions = n;
        true
    }
    /// The element type of its keys, values and latents.
    pub fn kv_type(&self) -> KvType {
        self.kv_type
    }
    /// Bytes of cached keys, values and latents (the recurrent state not counted).
    pub fn kv_bytes(&self) -> usize {
        self.keys.iter().chain(&self.values).chain(&self.latent).map(KvRows::bytes).sum()
    }
}

/// A sliding-window layer's cache once it holds more than twice its ring of `window` +
/// `KV_RING_CHUNK_POSITIONS` positions up to `end`: the positions before the last ring dropped
/// (no later query sees them), so a long context costs this layer a bounded cache.
fn drop_past_ring(
    cache: &mut PipelineCache,
    l: usize,
    heads: Range<usize>,
    hd: usize,
    window: usize,
    end: usize,
) {
    let ring = kv_ring_positions(window);
    let held = end - cache.kv_start[l];
    if held <= 2 * ring {
        return;
    }
    let drop = held - ring;
    for h in heads {
        cache.keys[h].drain_front(drop * hd);
        cache.values[h].drain_front(drop * hd);
    }
    cache.kv_start[l] += drop;
}

/// Refuses a block type (q8_0) where a layer's cached rows (an attention head, a latent row) are
/// not whole blocks.
fn check_kv_type(plan: &LayerPlan, kv_type: KvType) -> Result<(), PipelineError> {
    let block = kv_type.block_len();
    for (layer, spec) in plan.layers().iter().enumerate() {
        let width = match &spec.mixer {
            Mixer::Attention(a) => a.head_dim,
            Mixer::LatentAttention(a) => a.cache_width(),
            Mixer::GatedDeltaNet(_) => continue,
        };
        if !width.is_multiple_of(block) {
            return Err(PipelineError::KvBlocks { kv_type, block, layer, width });
        }
    }
    Ok(())
}

/// Per-call activations, sized once for `max_batch_tokens`.
struct Activations {
    hidden: Vec<f32>,
    normed: Vec<f32>,
    /// A gated q projection's output, `[query | gate]` per head, before the split.
    q_gated: Vec<f32>,
    /// The sigmoid output gate's logits, `q_dim` per token.
    gate: Vec<f32>,
    /// A DeltaNet layer's input projections, one buffer per stored projection.
    delta_in: [Vec<f32>; 4],
    /// A DeltaNet layer's per-head outputs, `value_dim` per token, before `out_proj`.
    delta_out: Vec<f32>,
    /// Per layer, a DeltaNet layer's one-token inputs (reused every token).
    delta_token: Vec<Option<TokenInputs>>,
    /// The chunked DeltaNet prefill's workspace (calls of several tokens).
    delta_prefill: PrefillWork,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    router_logits: Vec<f32>,
    moe: Vec<f32>,
    shared_g: Vec<f32>,
    shared_u: Vec<f32>,
    shared_y: Vec<f32>,
    shared_gate: Vec<f32>,
    /// Latent attention buffers (empty without latent layers).
    mla: MlaBuffers,
}

/// A latent attention layer's per-call buffers, sized for the plan's widest latent layer.
#[derive(Default)]
struct MlaBuffers {
    /// `q_a`'s output (`q_lora_rank` per token).
    qa: Vec<f32>,
    /// `kv_a`'s output (`kv_lora_rank + rope` per token).
    kv: Vec<f32>,
    /// q (`heads * (nope + rope)` per token).
    q: Vec<f32>,
    /// The absorbed q, `[latent | rope]` per head and token, and the attention's output
    /// (the same width; its first `kv_lora_rank` values per head are used).
    q_abs: Vec<f32>,
    out: Vec<f32>,
    /// One head's gathered inputs and outputs of `k_b` / `v_b` (`max(nope, rank)` and
    /// `max(rank, v)` per token).
    head_in: Vec<f32>,
    head_out: Vec<f32>,
    /// The heads' values (`heads * v` per token), `o`'s input.
    values: Vec<f32>,
}

impl MlaBuffers {
    fn new(plan: &LayerPlan, m: usize) -> MlaBuffers {
        let widest = |f: &dyn Fn(&LatentAttentionSpec) -> usize| {
            plan.layers()
                .iter()
                .filter_map(|l| match &l.mixer {
                    Mixer::LatentAttention(a) => Some(f(a)),
                    _ => None,
                })
                .max()
                .unwrap_or(0)
        };
        let per_head = |a: &LatentAttentionSpec| a.n_heads * a.cache_width();
        MlaBuffers {
            qa: vec![0.0; m * widest(&|a| a.q_lora_rank.unwrap_or(0))],
            kv: vec![0.0; m * widest(&|a| a.cache_width())],
            q: vec![0.0; m * widest(&|a| a.q_dim())],
            q_abs: vec![0.0; m * widest(&per_head)],
            out: vec![0.0; m * widest(&per_head)],
            head_in: vec![0.0; m * widest(&|a| a.nope_dim.max(a.kv_lora_rank))],
            head_out: vec![0.0; m * widest(&|a| a.kv_lora_rank.max(a.v_dim))],
            values: vec![0.0; m * widest(&|a| a.n_heads * a.v_dim)],
        }
    }
}

/// The pipeline engine over one model.
pub struct Pipeline {
    model: Arc<Model>,
    config: ModelConfig,
    /// Every layer's kind, walked by the layer loop.
    plan: LayerPlan,
    final_norm: Vec<f32>,
    layers: Vec<LayerVectors>,
    dense: DenseStage,
    /// One router per MoE layer, built from its spec (buffers reused across calls); `None` for
    /// a dense FFN layer.
    routers: Vec<Option<Router>>,
    lanes: LaneSet,
    hot_set: HotSet,
    perf: PerfState,
    policy: PpPolicy,
    updater: UpdaterHandle,
    cold: Arc<dyn ExpertKernel>,
    /// The cold lane on the dense stage's pool (see [`PipelineOptions::pool_cold`]).
    pool_lane: Option<PoolLane>,
    /// Cold-lane participants, the driver included.
    cold_threads: usize,
    /// The per-stage profile, when asked for.
    profile: Option<CpuProfiler>,
    fallback_scratch: FfnScratch,
    /// The all-cold fallback's slots (reused).
    fallback_slots: Vec<ColdSlot>,
    act: Activations,
    /// One cos/sin table per distinct RoPE of the plan (a Gemma 4 has two), grown as positions
    /// are reached; `rope_of[l]`: layer `l`'s table (0 for a layer without RoPE).
    ropes: Vec<RopeTable>,
    rope_of: Vec<usize>,
    call_idx: u64,
    plans: Vec<ExecPlan>,
    fault: FaultInjection,
    max_batch_tokens: usize,
    kv_type: KvType,
    /// The sub-batch being run: each sequence's rows, and per row its position and sequence.
    segments: Vec<Segment>,
    positions: Vec<usize>,
    row_seq: Vec<usize>,
}

/// One sequence of a batched call ([`Pipeline::forward_many`]): its cache and its tokens.
pub struct SeqInput<'a> {
    pub cache: &'a mut PipelineCache,
    pub tokens: &'a [u32],
}

/// A sequence's rows in a sub-batch: `n` rows from `row0`, at positions from `first_pos`.
#[derive(Debug, Clone, Copy)]
struct Segment {
    seq: usize,
    row0: usize,
    n: usize,
    first_pos: usize,
}

impl Activations {
    fn new(c: &ModelConfig, plan: &LayerPlan, m: usize, level: SimdLevel) -> Activations {
        // The shared expert's buffers serve the dense FFN layers too.
        let sff = plan
            .layers()
            .iter()
            .map(|l| match l.ffn {
                crate::model::arch::Ffn::Dense(d) => d.ff,
                crate::model::arch::Ffn::Moe(_) => c.shared_expert_ff,
            })
            .max()
            .unwrap_or(0);
        let gated = plan.layers().iter().any(|l| l.as_attention().is_some_and(|a| a.output_gate));
        let widest = |f: &dyn Fn(&DeltaNetSpec) -> usize| {
            plan.layers()
                .iter()
                .filter_map(|l| match &l.mixer {
                    Mixer::GatedDeltaNet(d) => Some(f(d)),
                    Mixer::Attention(_) | Mixer::LatentAttention(_) => None,
                })
                .max()
                .unwrap_or(0)
        };
        // Grouped: [qkvz, ba]; split: [qkv, z, b, a]; split with grouped ba: [qkv, z, ba]; each
        // buffer sized for the widest use.
        let delta_in = [
            m * widest(&|d| d.conv_dim() + d.value_dim()),
            m * widest(&|d| d.value_dim().max(2 * d.n_v_heads)),
            m * widest(&|d| 2 * d.n_v_heads),
            m * widest(&|d| d.n_v_heads),
        ];
        Activations {
            hidden: vec![0.0; m * c.hidden],
            normed: vec![0.0; m * c.hidden],
            q_gated: vec![0.0; if gated { 2 * m * c.max_q_dim() } else { 0 }],
            gate: vec![0.0; if gated { m * c.max_q_dim() } else { 0 }],
            delta_in: delta_in.map(|n| vec![0.0; n]),
            delta_out: vec![0.0; m * widest(&|d| d.value_dim())],
            delta_token: plan
                .layers()
                .iter()
                .map(|l| match &l.mixer {
                    Mixer::GatedDeltaNet(d) => Some(TokenInputs::new(d)),
                    Mixer::Attention(_) | Mixer::LatentAttention(_) => None,
                })
                .collect(),
            delta_prefill: PrefillWork::new(
                plan.layers().iter().filter_map(|l| match &l.mixer {
                    Mixer::GatedDeltaNet(d) => Some(d),
                    _ => None,
                }),
                level,
                m,
            ),
            mla: MlaBuffers::new(plan, m),
            q: vec![0.0; m * c.max_q_dim()],
            k: vec![0.0; m * c.max_kv_dim()],
            v: vec![0.0; m * c.max_kv_dim()],
            attn: vec![0.0; m * c.max_q_dim()],
            proj: vec![0.0; m * c.hidden],
            router_logits: vec![0.0; m * c.n_experts],
            moe: vec![0.0; m * c.hidden],
            shared_g: vec![0.0; m * sff],
            shared_u: vec![0.0; m * sff],
            shared_y: vec![0.0; m * c.hidden],
            shared_gate: vec![0.0; m],
        }
    }
}

/// The final norm and every layer's small vectors, decoded to f32; the matrices are checked
/// here and read in place later.
fn load_dense(model: &Model) -> Result<(Vec<f32>, Vec<LayerVectors>), TensorError> {
    check_matrices(model)?;
    let final_norm = model.output_norm_weight()?;
    let layers =
        (0..model.config().n_layers).map(|l| LayerVectors::load(model, l)).collect::<Result<_, _>>()?;
    Ok((final_norm, layers))
}

impl Pipeline {
    /// Build the engine with CPU hot lanes caching `options.hot_set`.
    pub fn new(model: Arc<Model>, options: PipelineOptions) -> Result<Pipeline, PipelineError> {
        let c = model.config().clone();
        let hot_set = options
            .hot_set
            .clone()
            .unwrap_or_else(|| HotSet::empty(c.n_layers, c.n_experts, options.n_hot_lanes));
        check_no_hot_dense_layers(&model, &hot_set)?;
        let lanes = (0..hot_set.n_lanes)
            .map(|i| CpuHotLane::new(model.clone(), &hot_set, i).map(|l| Box::new(l) as Box<dyn HotLane>))
            .collect::<Result<Vec<_>, _>>()?;
        Self::with_hot_lanes(model, PipelineOptions { hot_set: Some(hot_set), ..options }, lanes)
    }

    /// Build the engine with the given hot lanes (one per lane of the hot set; e.g. a CUDA
    /// lane, or a failing lane in tests).
    pub fn with_hot_lanes(
        model: Arc<Model>,
        options: PipelineOptions,
        hot_lanes: Vec<Box<dyn HotLane>>,
    ) -> Result<Pipeline, PipelineError> {
        let c = model.config().clone();
        let hot_set = options
            .hot_set
            .clone()
            .unwrap_or_else(|| HotSet::empty(c.n_layers, c.n_experts, hot_lanes.len()));
        if hot_lanes.is_empty() || hot_lanes.len() > MAX_HOT_LANES || hot_lanes.len() != hot_set.n_lanes {
            return Err(PipelineError::Setup(format!(
                "{} hot lanes given for a hot set of {} lanes (1..={MAX_HOT_LANES})",
                hot_lanes.len(),
                hot_set.n_lanes
            )));
        }
        if options.max_batch_tokens == 0 {
            return Err(PipelineError::Setup("max_batch_tokens must be at least 1".into()));
        }
        let (final_norm, layers) = load_dense(&model)?;
        let level = cold_simd_level(options.simd)?;
        let mut dense = DenseStage::new(options.n_dense_threads, level);
        let m = options.max_batch_tokens;
        let cold: Arc<dyn ExpertKernel> = match options.cold_kernels {
            ColdKernels::Plain => Arc::new(PlainKernel::new(model.clone())),
            ColdKernels::Simd => Arc::new(
                SimdKernel::new(model.clone(), options.simd)
                    .map_err(|e| PipelineError::Setup(format!("cold kernels: {e}")))?,
            ),
        };
        let pool_lane =
            (options.pool_cold && options.driver_cold && options.cold_kernels == ColdKernels::Simd)
                .then(|| PoolLane::new(model.clone(), level, options.activations));
        dense.set_activations(pool_lane.as_ref().map_or(DecodeActivations::F32, PoolLane::activations));
        // With the pool lane the driver alone is the lane set's cold participant.
        let (lane_workers, cold_threads) = match pool_lane {
            Some(_) => (1, options.n_cold_workers.clamp(1, dense.n_threads())),
            None => (options.n_cold_workers, options.n_cold_workers),
        };
        // Lane threads plus the driver (which is cold participant 0 when `driver_cold`).
        let n_threads = hot_lanes.len() + lane_workers + usize::from(!options.driver_cold);
        let n_cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let spin = if n_cores >= n_threads { LANE_SPIN } else { std::time::Duration::ZERO };
        let mut lanes = LaneSet::start_with(
            hot_lanes,
            cold.clone(),
            lane_workers,
            m,
            c.n_experts_used,
            c.n_experts,
            spin,
            options.driver_cold,
        );
        lanes.set_fault_schedule(options.fault.lanes);
        if let Some(t) = options.fault.lane_timeout {
            lanes.set_timeout(t);
        }
        let plan = model.plan().clone();
        check_kv_type(&plan, options.kv_type)?;
        let (ropes, rope_of) = RopeTable::per_layer(&plan);
        let routers = plan
            .layers()
            .iter()
            .zip(&layers)
            .map(|(spec, v)| {
                spec.as_moe().map(|moe| {
                    let router = match &v.selection_bias {
                        Some(b) => Router::new(moe.router, m).with_selection_bias(b.clone()),
                        None => Router::new(moe.router, m),
                    };
                    match &v.router_expert_scale {
                        Some(s) => router.with_expert_scale(s.clone()),
                        None => router,
                    }
                })
            })
            .collect();
        let act = Activations::new(&c, &plan, m, level);
        let updater = UpdaterHandle::start().map_err(|e| PipelineError::Setup(format!("updater: {e}")))?;
        let switches = options.switches;
        Ok(Pipeline {
            perf: PerfState::new(options.perf_mode, c.n_layers, c.n_experts, c.n_experts_used),
            policy: PpPolicy { profile: model.profile(), switches },
            fallback_scratch: FfnScratch::new(cold.dims(), 1),
            fallback_slots: Vec::with_capacity(m * c.n_experts_used),
            cold,
            pool_lane,
            cold_threads,
            profile: options.profile.then(CpuProfiler::default),
            routers,
            lanes,
            hot_set,
            updater,
            act,
            ropes,
            rope_of,
            call_idx: 0,
            plans: Vec::new(),
            fault: options.fault,
            max_batch_tokens: m,
            segments: Vec::new(),
            positions: Vec::with_capacity(m),
            row_seq: Vec::with_capacity(m),
            kv_type: options.kv_type,
            final_norm,
            layers,
            dense,
            plan,
            config: c,
            model,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Faults injected by [`FaultInjection::lanes`] so far, and the layers refused because a
    /// lane that timed out still held the layer input.
    pub fn lane_fault_log(&self) -> (&[crate::actors::InjectedFault], u64) {
        self.lanes.fault_log()
    }

    /// Threads of the dense stage, the driver included.
    pub fn dense_threads(&self) -> usize {
        self.dense.n_threads()
    }

    /// Cold-lane participants, the driver included (with the pool lane: the dense pool's
    /// threads that take cold work).
    pub fn cold_threads(&self) -> usize {
        self.cold_threads
    }

    /// The activations of the cold lane's few-token tiles of quantised experts: the pool lane's
    /// setting, F32 without the pool lane (the lane-actor kernels keep f32).
    pub fn cold_activations(&self) -> DecodeActivations {
        self.pool_lane.as_ref().map_or(DecodeActivations::F32, PoolLane::activations)
    }

    /// The per-stage profile's table, when it is recorded ([`PipelineOptions::profile`]).
    pub fn profile_report(&self) -> Option<String> {
        self.profile.as_ref().map(CpuProfiler::report)
    }

    /// Start the per-stage profile over (after a warm-up).
    pub fn reset_profile(&mut self) {
        if let Some(p) = &mut self.profile {
            *p = CpuProfiler::default();
        }
    }

    /// The engine's logits rows and argmax took `us` (timed by the engine around the call).
    pub fn profile_logits_us(&mut self, us: f64) {
        mark(&mut self.profile, |p| p.add_tail_us(2, us));
    }

    /// Whether the cold lane runs on the dense stage's pool ([`PipelineOptions::pool_cold`]).
    pub fn pool_cold(&self) -> bool {
        self.pool_lane.is_some()
    }

    /// Bytes of weights this engine holds as f32 copies (norm weights, biases, the shared
    /// expert's gate vector): every matrix is read in place from the mapped file.
    pub fn weight_copy_bytes(&self) -> usize {
        4 * self.final_norm.len() + self.layers.iter().map(LayerVectors::f32_bytes).sum::<usize>()
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub fn perf(&self) -> &PerfState {
        &self.perf
    }

    pub fn perf_mut(&mut self) -> &mut PerfState {
        &mut self.perf
    }

    pub fn hot_set(&self) -> &HotSet {
        &self.hot_set
    }

    /// The plans of the last forward call, one per sub-batch.
    pub fn last_plans(&self) -> &[ExecPlan] {
        &self.plans
    }

    /// The Updater: queue slot exchanges here; they apply at the start of the next call.
    pub fn updater(&self) -> &UpdaterHandle {
        &self.updater
    }

    pub fn new_cache(&self) -> PipelineCache {
        let recurrent = self
            .plan
            .layers()
            .iter()
            .map(|l| match &l.mixer {
                Mixer::GatedDeltaNet(d) => Some(DeltaNetState::new(d)),
                Mixer::Attention(_) | Mixer::LatentAttention(_) => None,
            })
            .collect();
        let rows = |n| vec![KvRows::new(self.kv_type); n];
        PipelineCache {
            latent: rows(self.config.n_layers),
            kv_start: vec![0; self.config.n_layers],
            keys: rows(self.config.n_layers * self.config.max_kv_heads()),
            values: rows(self.config.n_layers * self.config.max_kv_heads()),
            recurrent,
            n_positions: 0,
            kv_type: self.kv_type,
            checkpoints: StateCheckpoints::default(),
        }
    }

    /// Apply every queued exchange (between calls; [`apply_exchanges`]: at a failure the rest
    /// are queued again). Returns how many were taken from the queue.
    pub fn apply_pending_exchanges(&mut self) -> Result<usize, PipelineError> {
        apply_exchanges(
            self,
            |p| &p.updater,
            |p| &mut p.perf,
            |p, x| {
                let slot = p.hot_set.apply_exchange(x.layer_idx, x.evict, x.add)?;
                if let Err(e) = p.lanes.load_slot(slot.lane_idx as usize, x.layer_idx, slot.slot_idx, x.add) {
                    // Keep the maps true to the lane's contents: undo, and report.
                    let _ = p.hot_set.apply_exchange(x.layer_idx, x.add, x.evict);
                    return Err(e.into());
                }
                // a CPU hot lane's slot is loaded now: the expert is hot from the next call on
                p.perf.record_landed_exchanges(1);
                Ok(p.model.expert_bytes_of_layer(x.layer_idx) as u64)
            },
        )
    }

    /// Run `tokens` after whatever `cache` holds, in `phase`; returns one logits row per token.
    /// Checks every token id before touching the cache, so a bad id changes nothing.
    pub fn forward(
        &mut self,
        cache: &mut PipelineCache,
        tokens: &[u32],
        phase: Phase,
    ) -> Result<Vec<Vec<f32>>, PipelineError> {
        self.forward_rows(cache, tokens, phase, LogitRows::All)
    }

    /// As [`Pipeline::forward`], computing the lm_head only for the `rows` asked for (with
    /// [`LogitRows::Last`], one row: the last token's).
    pub fn forward_rows(
        &mut self,
        cache: &mut PipelineCache,
        tokens: &[u32],
        phase: Phase,
        rows: LogitRows,
    ) -> Result<Vec<Vec<f32>>, PipelineError> {
        self.forward_many(&mut [SeqInput { cache, tokens }], phase, rows)
    }

    /// One call over several sequences (continuous batching): each sequence's tokens run after
    /// what its cache holds, every row-wise stage (projections, router, lanes, lm_head) over all
    /// of the call's tokens at once, attention and recurrent state per sequence. Returns the
    /// `rows` asked for of each sequence in order ([`LogitRows::Last`]: one row per sequence).
    /// Every sequence is checked before any cache changes.
    pub fn forward_many(
        &mut self,
        seqs: &mut [SeqInput<'_>],
        phase: Phase,
        rows: LogitRows,
    ) -> Result<Vec<Vec<f32>>, PipelineError> {
        for s in seqs.iter() {
            self.check_sequence(s.cache, s.tokens)?;
        }
        self.apply_pending_exchanges()?;
        self.plans.clear();
        let lens: Vec<usize> = seqs.iter().map(|s| s.tokens.len()).collect();
        let mut logits = Vec::with_capacity(match rows {
            LogitRows::All => lens.iter().sum(),
            LogitRows::Last => seqs.len(),
        });
        for pieces in crate::forward::pack_batch(&lens, self.max_batch_tokens) {
            let n: usize = pieces.iter().map(|p| p.tokens.len()).sum();
            self.call_idx += 1;
            let cache_state = CacheState {
                n_hot_slots: self.hot_set.layers.iter().map(|l| l.n_hot()).sum(),
                n_experts: self.config.n_experts,
            };
            let cold_state = ColdState { n_workers: self.cold_threads, healthy: true };
            // The phase is the call's, whatever the sub-batch's size.
            let plan = self.policy.plan(phase, n, cache_state, cold_state);
            self.plans.push(plan);
            let start = Instant::now();
            mark(&mut self.profile, |p| p.begin(phase == Phase::Decode, n));
            self.forward_batch(seqs, &pieces, &plan, rows, &mut logits)?;
            mark(&mut self.profile, |p| p.add_total_us(start.elapsed().as_secs_f64() * 1e6));
        }
        Ok(logits)
    }

    /// A sequence of a call: tokens present and in the vocabulary, room in the context.
    fn check_sequence(&self, cache: &PipelineCache, tokens: &[u32]) -> Result<(), PipelineError> {
        let c = &self.config;
        if tokens.is_empty() {
            return Err(ForwardError::EmptyInput.into());
        }
        if let Some((i, &token)) = tokens.iter().enumerate().find(|(_, &t)| t as usize >= c.vocab) {
            let position = cache.n_positions + i;
            return Err(ForwardError::TokenOutOfRange { token, position, vocab: c.vocab }.into());
        }
        if cache.n_positions + tokens.len() > c.max_positions {
            return Err(ForwardError::ContextFull { max_positions: c.max_positions }.into());
        }
        Ok(())
    }

    /// Greedy generation: prefill `prompt` (Prefill), then decode `n_new` tokens (Decode).
    pub fn generate(&mut self, prompt: &[u32], n_new: usize) -> Result<Vec<u32>, PipelineError> {
        crate::reference::check_generation_fits(prompt.len(), n_new, self.config.max_positions)?;
        let mut cache = self.new_cache();
        let logits = self.forward_rows(&mut cache, prompt, Phase::Prefill, LogitRows::Last)?;
        let mut next = argmax(logits.last().expect("prompt is not empty"));
        let mut out = Vec::with_capacity(n_new);
        for i in 0..n_new {
            out.push(next);
            if i + 1 < n_new {
                let logits = self.forward(&mut cache, &[next], Phase::Decode)?;
                next = argmax(&logits[0]);
            }
        }
        Ok(out)
    }

    /// One sub-batch: the `pieces` of `seqs` it holds, as one block of rows.
    fn forward_batch(
        &mut self,
        seqs: &mut [SeqInput<'_>],
        pieces: &[BatchPiece],
        plan: &ExecPlan,
        rows: LogitRows,
        logits_out: &mut Vec<Vec<f32>>,
    ) -> Result<(), PipelineError> {
        let h = self.config.hidden;
        self.segments.clear();
        self.positions.clear();
        self.row_seq.clear();
        let mut head_rows = Vec::new();
        for p in pieces {
            let (row0, n) = (self.positions.len(), p.tokens.len());
            let first_pos = seqs[p.seq].cache.n_positions;
            self.segments.push(Segment { seq: p.seq, row0, n, first_pos });
            self.positions.extend(first_pos..first_pos + n);
            self.row_seq.extend(std::iter::repeat_n(p.seq, n));
            match rows {
                LogitRows::All => head_rows.extend(row0..row0 + n),
                LogitRows::Last if p.tokens.end == seqs[p.seq].tokens.len() => head_rows.push(row0 + n - 1),
                LogitRows::Last => {}
            }
        }
        let n = self.positions.len();
        self.ensure_rope(self.positions.iter().max().map_or(0, |p| p + 1));
        let model = Arc::clone(&self.model);
        let (embedding, head) = global_matrices(&model)?;
        let tokens = pieces.iter().flat_map(|p| &seqs[p.seq].tokens[p.tokens.clone()]);
        for (t, &token) in tokens.enumerate() {
            decode_row(&embedding, token as usize, &mut self.act.hidden[t * h..(t + 1) * h]);
        }
        if let Some(scale) = self.config.embedding_scale {
            self.act.hidden[..n * h].iter_mut().for_each(|x| *x *= scale);
        }
        mark(&mut self.profile, |p| p.tail(0));
        for l in 0..self.config.n_layers {
            let m = LayerMatrices::resolve(&model, l)?;
            match &m.mixer {
                MixerMatrices::Attention { q, k, v, o } => {
                    self.attention_block(seqs, l, [q, k, o], v.as_ref(), n)?
                }
                MixerMatrices::DeltaNet { inputs, out } => self.delta_net_block(seqs, l, inputs, out, n)?,
                MixerMatrices::Latent { .. } => self.latent_block(seqs, l, &m.mixer, n)?,
            }
            match &m.dense_ffn {
                Some(ffn) => self.dense_ffn_block(l, ffn, n)?,
                None => self.moe_block(l, &m, n, plan)?,
            }
            if let Some(scale) = self.layers[l].output_scale {
                self.act.hidden[..n * h].iter_mut().for_each(|x| *x *= scale);
            }
        }
        for s in &self.segments {
            seqs[s.seq].cache.n_positions += s.n;
        }
        self.head(&head, &head_rows, logits_out)
    }

    /// Final norm and lm_head of the sub-batch's `rows` (row indices), one logits row each.
    fn head(
        &mut self,
        head: &DenseMatrix<'_>,
        rows: &[usize],
        logits_out: &mut Vec<Vec<f32>>,
    ) -> Result<(), PipelineError> {
        if rows.is_empty() {
            return Ok(());
        }
        let (h, vocab, eps, k) = (self.config.hidden, self.config.vocab, self.config.rms_eps, rows.len());
        for (i, &t) in rows.iter().enumerate() {
            let x = &self.act.hidden[t * h..(t + 1) * h];
            rms_norm_row(x, &self.final_norm, eps, &mut self.act.normed[i * h..(i + 1) * h]);
        }
        let mut out = vec![0.0; k * vocab];
        self.dense.matmul(&self.act.normed[..k * h], &mut [MatmulPart { w: *head, y: &mut out }])?;
        if let Some(cap) = self.config.final_logit_softcap {
            out.iter_mut().for_each(|x| *x = cap * (*x / cap).tanh());
        }
        if k == 1 {
            // Decode: the row is the buffer, no second copy of a vocab-sized row.
            logits_out.push(out);
        } else {
            logits_out.extend(out.chunks_exact(vocab).map(<[f32]>::to_vec));
        }
        mark(&mut self.profile, |p| p.tail(1));
        Ok(())
    }

    fn ensure_rope(&mut self, n_positions: usize) {
        for table in &mut self.ropes {
            table.grow(n_positions);
        }
    }

    fn attention_block(
        &mut self,
        seqs: &mut [SeqInput<'_>],
        l: usize,
        [wq, wk, wo]: [&DenseMatrix<'_>; 3],
        wv: Option<&DenseMatrix<'_>>,
        n: usize,
    ) -> Result<(), PipelineError> {
        self.attn_norm(l, n)?;
        let (c, a) = (&self.config, &mut self.act);
        let spec = *self.plan.layer(l).attention();
        let (h, qd, kvd, hd) = (c.hidden, spec.q_dim(c.n_heads), spec.kv_dim(), spec.head_dim);
        let output_gate = spec.output_gate;
        let q_out = if output_gate { &mut a.q_gated[..2 * n * qd] } else { &mut a.q[..n * qd] };
        let (q, k) = (MatmulPart { w: *wq, y: q_out }, MatmulPart { w: *wk, y: &mut a.k[..n * kvd] });
        // on the stack: this runs every layer of every decode token
        match wv {
            Some(wv) => {
                let v = MatmulPart { w: *wv, y: &mut a.v[..n * kvd] };
                self.dense.matmul(&a.normed[..n * h], &mut [q, k, v])?
            }
            None => self.dense.matmul(&a.normed[..n * h], &mut [q, k])?,
        }
        if wv.is_none() {
            // Keys as values: the k projection's output, before its norm and RoPE.
            a.v[..n * kvd].copy_from_slice(&a.k[..n * kvd]);
        }
        if output_gate {
            // `[query | gate]` per head: the query to `q`, the gate to `gate`.
            let pairs = a.q_gated[..2 * n * qd].chunks_exact(2 * hd);
            for ((pair, q), g) in pairs.zip(a.q.chunks_exact_mut(hd)).zip(a.gate.chunks_exact_mut(hd)) {
                q.copy_from_slice(&pair[..hd]);
                g.copy_from_slice(&pair[hd..]);
            }
        }
        mark(&mut self.profile, |p| p.layer(0));
        self.qkv_post(l, n)?;
        for i in 0..self.segments.len() {
            let seg = self.segments[i];
            self.attend_segment(seqs[seg.seq].cache, l, seg)?;
        }
        let (c, a) = (&self.config, &mut self.act);
        let h = c.hidden;
        if output_gate {
            for (x, g) in a.attn[..n * qd].iter_mut().zip(&a.gate[..n * qd]) {
                *x *= sigmoid(*g);
            }
        }
        mark(&mut self.profile, |p| p.layer(2));
        self.dense.matmul(&a.attn[..n * qd], &mut [MatmulPart { w: *wo, y: &mut a.proj[..n * h] }])?;
        if let Some(b) = &self.layers[l].o_bias {
            for row in a.proj[..n * h].chunks_exact_mut(h) {
                row.iter_mut().zip(b).for_each(|(x, y)| *x += y);
            }
        }
        if let Some([post, _]) = &self.layers[l].post_norms {
            for row in a.proj[..n * h].chunks_exact_mut(h) {
                rms_norm_in_place(row, post, c.rms_eps);
            }
        }
        for (x, y) in a.hidden[..n * h].iter_mut().zip(&a.proj[..n * h]) {
            *x += y;
        }
        mark(&mut self.profile, |p| p.layer(3));
        Ok(())
    }

    /// One sequence's part of an attention layer: its new keys and values appended to its
    /// cache, its queries attended over the cache.
    fn attend_segment(
        &mut self,
        cache: &mut PipelineCache,
        l: usize,
        seg: Segment,
    ) -> Result<(), PipelineError> {
        let (c, a) = (&self.config, &mut self.act);
        let spec = self.plan.layer(l).attention();
        let (qd, kvd, hd, nkv) = (spec.q_dim(c.n_heads), spec.kv_dim(), spec.head_dim, spec.n_kv_heads);
        let at = l * c.max_kv_heads();
        let (keys, values) = (&mut cache.keys[at..at + nkv], &mut cache.values[at..at + nkv]);
        let rows = seg.row0..seg.row0 + seg.n;
        for kvh in 0..nkv {
            // One (amortised) growth per call, not one per token.
            keys[kvh].reserve(seg.n * hd);
            values[kvh].reserve(seg.n * hd);
        }
        for t in rows.clone() {
            for kvh in 0..nkv {
                let at = t * kvd + kvh * hd;
                keys[kvh].push(&a.k[at..at + hd])?;
                values[kvh].push(&a.v[at..at + hd])?;
            }
        }
        mark(&mut self.profile, |p| p.layer(1));
        let input = AttentionInput {
            shape: AttentionShape { n_heads: c.n_heads, n_kv_heads: nkv, head_dim: hd },
            q: &a.q[rows.start * qd..rows.end * qd],
            keys,
            values,
            first_pos: seg.first_pos,
            kv_start: cache.kv_start[l],
            window: spec.window,
            sinks: self.layers[l].sinks.as_deref(),
        };
        self.dense.attention(&input, &mut a.attn[rows.start * qd..rows.end * qd])?;
        if let Some(w) = spec.window {
            drop_past_ring(cache, l, at..at + nkv, hd, w, seg.first_pos + seg.n);
        }
        Ok(())
    }

    /// After the q/k/v projections: biases, q/k norms, clipping, RoPE.
    fn qkv_post(&mut self, l: usize, n: usize) -> Result<(), PipelineError> {
        let c = &self.config;
        let (w, a) = (&self.layers[l], &mut self.act);
        let spec = *self.plan.layer(l).attention();
        let (qd, kvd, hd) = (spec.q_dim(c.n_heads), spec.kv_dim(), spec.head_dim);
        for (buf, bias, dim) in
            [(&mut a.q, &w.q_bias, qd), (&mut a.k, &w.k_bias, kvd), (&mut a.v, &w.v_bias, kvd)]
        {
            if let Some(b) = bias {
                for row in buf[..n * dim].chunks_exact_mut(dim) {
                    row.iter_mut().zip(b).for_each(|(x, y)| *x += y);
                }
            }
        }
        if spec.v_norm {
            for head in a.v[..n * kvd].chunks_exact_mut(hd) {
                rms_norm_unweighted(head, c.rms_eps);
            }
        }
        let per_head = matches!(spec.qk_norm, QkNorm::None | QkNorm::PerHead) && spec.clip_qkv.is_none();
        if per_head && n >= PAR_HEADS_MIN_TOKENS {
            self.norm_rope_heads_on_pool(l, n)?;
        } else {
            self.norm_rope_sequential(l, n);
        }
        // The attention kernels scale scores by `1 / sqrt(head_dim)`: another scale goes into q.
        if let Some(scale) = spec.scale {
            let factor = scale * (hd as f32).sqrt();
            self.act.q[..n * qd].iter_mut().for_each(|x| *x *= factor);
        }
        Ok(())
    }

    /// Per-head q/k norm (if any) and RoPE of each head on the dense pool's threads (prefill):
    /// the same per-head functions as the sequential path, so the same bits.
    fn norm_rope_heads_on_pool(&mut self, l: usize, n: usize) -> Result<(), PipelineError> {
        let c = &self.config;
        let spec = self.plan.layer(l).attention();
        let style = spec.rope.style;
        let table = &self.ropes[self.rope_of[l]];
        let (hd, half, eps) = (spec.head_dim, table.half, c.rms_eps);
        let (qd, kvd) = (spec.q_dim(c.n_heads), spec.kv_dim());
        let w = &self.layers[l];
        let (qn, kn) = match spec.qk_norm {
            QkNorm::PerHead => (w.q_norm.as_deref(), w.k_norm.as_deref()),
            _ => (None, None),
        };
        let (a, rope, positions, pool) =
            (&mut self.act, &table.table, &self.positions, self.dense.pool_mut());
        for (buf, dim, norm) in [(&mut a.q[..n * qd], qd, qn), (&mut a.k[..n * kvd], kvd, kn)] {
            let heads_per_token = dim / hd;
            par_chunks_mut(pool, buf, hd, &|i, head| {
                if let Some(weight) = norm {
                    rms_norm_in_place(head, weight, eps);
                }
                let t = positions[i / heads_per_token];
                rope_head(&mut head[..2 * half], &rope[t * half..(t + 1) * half], style);
            })?;
        }
        Ok(())
    }

    /// Biases done: q/k norms (per head or over the projection), clipping, RoPE on this thread.
    fn norm_rope_sequential(&mut self, l: usize, n: usize) {
        let c = &self.config;
        let (w, a) = (&self.layers[l], &mut self.act);
        let spec = self.plan.layer(l).attention();
        let (qd, kvd, hd) = (spec.q_dim(c.n_heads), spec.kv_dim(), spec.head_dim);
        match spec.qk_norm {
            QkNorm::None => {}
            QkNorm::WholeProjection => {
                let (qn, kn) = (w.q_norm.as_ref().expect("validated"), w.k_norm.as_ref().expect("validated"));
                for row in a.q[..n * qd].chunks_exact_mut(qd) {
                    rms_norm_in_place(row, qn, c.rms_eps);
                }
                for row in a.k[..n * kvd].chunks_exact_mut(kvd) {
                    rms_norm_in_place(row, kn, c.rms_eps);
                }
            }
            QkNorm::PerHead => {
                let (qn, kn) = (w.q_norm.as_ref().expect("validated"), w.k_norm.as_ref().expect("validated"));
                for head in a.q[..n * qd].chunks_exact_mut(hd) {
                    rms_norm_in_place(head, qn, c.rms_eps);
                }
                for head in a.k[..n * kvd].chunks_exact_mut(hd) {
                    rms_norm_in_place(head, kn, c.rms_eps);
                }
            }
        }
        let spec = self.plan.layer(l).attention();
        if let Some(clip) = spec.clip_qkv {
            for x in
                a.q[..n * qd].iter_mut().chain(a.k[..n * kvd].iter_mut()).chain(a.v[..n * kvd].iter_mut())
            {
                *x = x.clamp(-clip, clip);
            }
        }
        let rope = &self.ropes[self.rope_of[l]];
        let half = rope.half;
        for t in 0..n {
            let pos = self.positions[t];
            let table = &rope.table[pos * half..(pos + 1) * half];
            for head in a.q[t * qd..(t + 1) * qd].chunks_exact_mut(hd) {
                rope_head(&mut head[..2 * half], table, spec.rope.style);
            }
            for head in a.k[t * kvd..(t + 1) * kvd].chunks_exact_mut(hd) {
                rope_head(&mut head[..2 * half], table, spec.rope.style);
            }
        }
    }

    /// A latent attention layer over `n` tokens, in the absorbed form for prefill and decode
    /// alike: each head's no-RoPE query goes through its `k_b` into the latent space, so the
    /// attention runs over the cache as it is (one key/value head of `kv_lora_rank + rope`
    /// values per position, keys and values the same buffer), and each head's output latent
    /// goes through its `v_b` before `o`. The cache never holds per-head keys or values.
    fn latent_block(
        &mut self,
        seqs: &mut [SeqInput<'_>],
        l: usize,
        mixer: &MixerMatrices<'_>,
        n: usize,
    ) -> Result<(), PipelineError> {
        let MixerMatrices::Latent { q_a, q, kv_a, k_b, v_b, o } = mixer else {
            unreachable!("a latent layer")
        };
        let Mixer::LatentAttention(spec) = self.plan.layer(l).mixer else { unreachable!("a latent layer") };
        self.latent_project(seqs, l, &spec, [q_a.as_ref(), Some(q), Some(kv_a)], n)?;
        let (c, a) = (&self.config, &mut self.act);
        let (h, heads, rank, nope, rope) =
            (c.hidden, spec.n_heads, spec.kv_lora_rank, spec.nope_dim, spec.rope_dim);
        let (width, qw, vd) = (spec.cache_width(), nope + rope, spec.v_dim);
        let b = &mut a.mla;
        // The kernel scales scores by 1/sqrt(width): the absorbed q carries the rest.
        let q_scale = spec.scale * (width as f32).sqrt();
        for hd in 0..heads {
            for t in 0..n {
                b.head_in[t * nope..(t + 1) * nope].copy_from_slice(&b.q[t * heads * qw + hd * qw..][..nope]);
            }
            let w = head_rows(k_b, hd, rank);
            self.dense
                .matmul(&b.head_in[..n * nope], &mut [MatmulPart { w, y: &mut b.head_out[..n * rank] }])?;
            for t in 0..n {
                let dst = &mut b.q_abs[(t * heads + hd) * width..][..width];
                dst[..rank].copy_from_slice(&b.head_out[t * rank..(t + 1) * rank]);
                dst[rank..].copy_from_slice(&b.q[t * heads * qw + hd * qw + nope..][..rope]);
                dst.iter_mut().for_each(|x| *x *= q_scale);
            }
        }
        for seg in &self.segments {
            let kv = std::slice::from_ref(&seqs[seg.seq].cache.latent[l]);
            let rows = seg.row0 * heads * width..(seg.row0 + seg.n) * heads * width;
            let input = AttentionInput {
                shape: AttentionShape { n_heads: heads, n_kv_heads: 1, head_dim: width },
                q: &b.q_abs[rows.clone()],
                keys: kv,
                values: kv,
                first_pos: seg.first_pos,
                kv_start: 0,
                window: None,
                sinks: None,
            };
            self.dense.attention(&input, &mut b.out[rows])?;
        }
        for hd in 0..heads {
            for t in 0..n {
                b.head_in[t * rank..(t + 1) * rank]
                    .copy_from_slice(&b.out[(t * heads + hd) * width..][..rank]);
            }
            let w = head_rows(v_b, hd, vd);
            self.dense
                .matmul(&b.head_in[..n * rank], &mut [MatmulPart { w, y: &mut b.head_out[..n * vd] }])?;
            for t in 0..n {
                b.values[(t * heads + hd) * vd..][..vd].copy_from_slice(&b.head_out[t * vd..(t + 1) * vd]);
            }
        }
        self.dense
            .matmul(&b.values[..n * heads * vd], &mut [MatmulPart { w: *o, y: &mut a.proj[..n * h] }])?;
        for (x, y) in a.hidden[..n * h].iter_mut().zip(&a.proj[..n * h]) {
            *x += y;
        }
        Ok(())
    }

    /// A latent layer's projections: its norm, q (low-rank with its norm, or plain) and the
    /// latent with the shared key part; the latent's norm; RoPE on every rope part; the call's
    /// positions appended to `cache`.
    fn latent_project(
        &mut self,
        seqs: &mut [SeqInput<'_>],
        l: usize,
        spec: &LatentAttentionSpec,
        [q_a, q, kv_a]: [Option<&DenseMatrix<'_>>; 3],
        n: usize,
    ) -> Result<(), PipelineError> {
        self.attn_norm(l, n)?;
        let (c, a) = (&self.config, &mut self.act);
        let (h, eps) = (c.hidden, c.rms_eps);
        let w = &self.layers[l];
        let (q, kv_a) = (q.expect("q"), kv_a.expect("kv_a"));
        let (width, qd) = (spec.cache_width(), spec.q_dim());
        let b = &mut a.mla;
        let x = &a.normed[..n * h];
        let (q_norm, kv_norm) = w.latent_norms.as_ref().expect("loaded for latent layers");
        match q_a {
            Some(q_a) => {
                let r = q_a.rows;
                self.dense.matmul(
                    x,
                    &mut [
                        MatmulPart { w: *q_a, y: &mut b.qa[..n * r] },
                        MatmulPart { w: *kv_a, y: &mut b.kv[..n * width] },
                    ],
                )?;
                let norm = q_norm.as_ref().expect("a low-rank q has its norm");
                for row in b.qa[..n * r].chunks_exact_mut(r) {
                    rms_norm_in_place(row, norm, eps);
                }
                self.dense.matmul(&b.qa[..n * r], &mut [MatmulPart { w: *q, y: &mut b.q[..n * qd] }])?;
            }
            None => self.dense.matmul(
                x,
                &mut [
                    MatmulPart { w: *q, y: &mut b.q[..n * qd] },
                    MatmulPart { w: *kv_a, y: &mut b.kv[..n * width] },
                ],
            )?,
        }
        let (rank, nope, rope) = (spec.kv_lora_rank, spec.nope_dim, spec.rope_dim);
        let half = rope / 2;
        for seg in &self.segments {
            seqs[seg.seq].cache.latent[l].reserve(seg.n * width);
        }
        for (t, &seq) in self.row_seq[..n].iter().enumerate() {
            let pos = self.positions[t];
            let table = &self.ropes[self.rope_of[l]].table[pos * half..(pos + 1) * half];
            let row = &mut b.kv[t * width..(t + 1) * width];
            rms_norm_in_place(&mut row[..rank], kv_norm, eps);
            rope_head(&mut row[rank..], table, spec.rope.style);
            seqs[seq].cache.latent[l].push(row)?;
            for head in b.q[t * qd..(t + 1) * qd].chunks_exact_mut(nope + rope) {
                rope_head(&mut head[nope..], table, spec.rope.style);
            }
        }
        Ok(())
    }

    /// A Gated DeltaNet layer over `n` tokens: the input projections as one batched matmul, the
    /// conv and delta rule on the session's state (one token: the recurrent step; more: the
    /// chunked prefill, every head on the pool at once), the output projection batched.
    fn delta_net_block(
        &mut self,
        seqs: &mut [SeqInput<'_>],
        l: usize,
        inputs: &[DenseMatrix<'_>],
        out: &DenseMatrix<'_>,
        n: usize,
    ) -> Result<(), PipelineError> {
        self.attn_norm(l, n)?;
        let c = &self.config;
        let Mixer::GatedDeltaNet(d) = self.plan.layer(l).mixer else { unreachable!("a DeltaNet layer") };
        let a = &mut self.act;
        let h = c.hidden;
        // Two, three or four input projections, as the file stores them (`MixerMatrices`).
        fn part<'a, 'y>(m: &DenseMatrix<'a>, buf: &'y mut [f32], n: usize) -> MatmulPart<'a, 'y> {
            MatmulPart { w: *m, y: &mut buf[..n * m.rows] }
        }
        let [b0, b1, b2, b3] = &mut a.delta_in;
        let x = &a.normed[..n * h];
        match inputs {
            [m0, m1] => self.dense.matmul(x, &mut [part(m0, b0, n), part(m1, b1, n)])?,
            [m0, m1, m2] => self.dense.matmul(x, &mut [part(m0, b0, n), part(m1, b1, n), part(m2, b2, n)])?,
            [m0, m1, m2, m3] => {
                let mut parts = [part(m0, b0, n), part(m1, b1, n), part(m2, b2, n), part(m3, b3, n)];
                self.dense.matmul(x, &mut parts)?
            }
            _ => unreachable!("a DeltaNet layer has two to four input projections"),
        }
        mark(&mut self.profile, |p| p.layer(0));
        mark(&mut self.profile, |p| p.layer(1));
        for i in 0..self.segments.len() {
            let seg = self.segments[i];
            let state = seqs[seg.seq].cache.recurrent[l].as_mut().expect("the cache follows the plan");
            self.delta_segment(state, l, &d, inputs, seg)?;
        }
        mark(&mut self.profile, |p| p.layer(2));
        let (vd, h, a) = (d.value_dim(), self.config.hidden, &mut self.act);
        self.dense.matmul(&a.delta_out[..n * vd], &mut [MatmulPart { w: *out, y: &mut a.proj[..n * h] }])?;
        for (x, y) in a.hidden[..n * h].iter_mut().zip(&a.proj[..n * h]) {
            *x += y;
        }
        mark(&mut self.profile, |p| p.layer(3));
        Ok(())
    }

    /// One sequence's part of a DeltaNet layer over its state: the recurrent step for one
    /// token, else the chunked prefill (its input rows moved to the front first: the sequences
    /// before it are done with theirs).
    fn delta_segment(
        &mut self,
        state: &mut DeltaNetState,
        l: usize,
        d: &DeltaNetSpec,
        inputs: &[DenseMatrix<'_>],
        seg: Segment,
    ) -> Result<(), PipelineError> {
        let (w, a, eps) = (&self.layers[l], &mut self.act, self.config.rms_eps);
        let vectors = w.delta_net.as_ref().expect("loaded for DeltaNet layers");
        let vd = d.value_dim();
        let out = &mut a.delta_out[seg.row0 * vd..(seg.row0 + seg.n) * vd];
        let pool = self.dense.pool_mut();
        if seg.n == 1 {
            let token = a.delta_token[l].as_mut().expect("made for DeltaNet layers");
            token.gather(d, &a.delta_in, seg.row0);
            conv_step(d, &vectors.conv, state, &mut token.qkv);
            recurrent_step(d, vectors, state, token, eps, pool, out)?;
            return Ok(());
        }
        if seg.row0 > 0 {
            for (buf, m) in a.delta_in.iter_mut().zip(inputs) {
                buf.copy_within(seg.row0 * m.rows..(seg.row0 + seg.n) * m.rows, 0);
            }
        }
        prefill(d, vectors, state, &a.delta_in, seg.n, eps, &mut a.delta_prefill, pool, out)?;
        Ok(())
    }

    fn moe_block(
        &mut self,
        l: usize,
        m: &LayerMatrices<'_>,
        n: usize,
        plan: &ExecPlan,
    ) -> Result<(), PipelineError> {
        let mut timing = LayerTiming::default();
        let t0 = Instant::now();
        self.route_layer(l, m, n)?;
        let branch = self.layers[l].branch_norms.is_some();
        if branch {
            // The dense branch reads the FFN norm's output; the experts their own norm's.
            let shared = m.shared.as_ref().expect("branch norms come with the dense branch");
            self.shared_expert(l, shared, n)?;
            self.experts_norm(l, n)?;
        }
        mark(&mut self.profile, |p| p.layer(4));
        let t1 = Instant::now();
        // Dispatcher stage: the worklist, in the lanes' shared layer input.
        let mut failure = self.dispatch(l, n, plan);
        mark(&mut self.profile, |p| p.layer(5));
        let t2 = Instant::now();
        timing.routing_us = (t1 - t0).as_micros() as u64;
        timing.worklist_us = (t2 - t1).as_micros() as u64;
        // The shared expert on the dense pool, then the lanes get the cores (with branch norms it
        // ran before the dispatch, on the FFN norm's output).
        if let (Some(shared), false) = (&m.shared, branch) {
            self.shared_expert(l, shared, n)?;
        }
        mark(&mut self.profile, |p| p.layer(6));
        let h = self.config.hidden;
        let mut section = match &mut self.pool_lane {
            // One pool for both stages: its threads go on to the cold section without parking.
            Some(lane) => Some(lane.on(self.dense.pool_mut(), self.cold_threads)),
            None => {
                self.dense.park();
                None
            }
        };
        let a = &mut self.act;
        let shared_work = || {};
        let mut launched = false;
        if failure.is_none() {
            match self.lanes.run_layer_with(
                plan.merge,
                plan.compact_cold_reduce,
                &mut a.moe[..n * h],
                &mut timing,
                shared_work,
                section.as_mut().map(|s| s as &mut dyn ColdLane),
            ) {
                Ok(()) => launched = true,
                Err(f) => failure = Some(f),
            }
        } else {
            shared_work();
        }
        if let Some(f) = failure {
            self.perf.record_fallback(l, f.reason, &f.detail);
            self.all_cold(l, n)?;
            launched = false;
        }
        mark(&mut self.profile, |p| p.layer(7));
        let a = &mut self.act;
        let (eps, w) = (self.config.rms_eps, &self.layers[l]);
        if let Some([shared_post, _, experts_post]) = &w.branch_norms {
            for (o, y) in a.moe[..n * h].chunks_exact_mut(h).zip(a.shared_y[..n * h].chunks_exact_mut(h)) {
                rms_norm_in_place(o, experts_post, eps);
                rms_norm_in_place(y, shared_post, eps);
                o.iter_mut().zip(y.iter()).for_each(|(o, y)| *o += y);
            }
        } else if m.shared.is_some() {
            for t in 0..n {
                let g = a.shared_gate[t];
                for (o, y) in a.moe[t * h..(t + 1) * h].iter_mut().zip(&a.shared_y[t * h..(t + 1) * h]) {
                    *o += g * y;
                }
            }
        }
        if let Some([_, post]) = &w.post_norms {
            for row in a.moe[..n * h].chunks_exact_mut(h) {
                rms_norm_in_place(row, post, eps);
            }
        }
        for (x, y) in a.hidden[..n * h].iter_mut().zip(&a.moe[..n * h]) {
            *x += y;
        }
        mark(&mut self.profile, |p| p.layer(8));
        self.perf.record_layer_call(l, &timing, launched);
        Ok(())
    }

    /// FFN norm and the Router stage of layer `l` (routes kept in the router); counts slots.
    fn route_layer(&mut self, l: usize, m: &LayerMatrices<'_>, n: usize) -> Result<(), PipelineError> {
        let c = &self.config;
        let (h, n_experts) = (c.hidden, c.n_experts);
        let (w, a, pool) = (&self.layers[l], &mut self.act, self.dense.pool_mut());
        rms_norm_rows(pool, (&a.hidden[..n * h], h), &w.ffn_norm, c.rms_eps, &mut a.normed[..n * h])?;
        let y = &mut a.router_logits[..n * n_experts];
        let router = m.router.expect("MoE layers have a router");
        let input = match &w.router_input_scale {
            // The residual through a weightless RMSNorm, times the scale (`hidden^-0.5` folded in).
            Some(scale) => {
                rms_norm_rows(pool, (&a.hidden[..n * h], h), scale, c.rms_eps, &mut a.proj[..n * h])?;
                &a.proj[..n * h]
            }
            None => &a.normed[..n * h],
        };
        self.dense.matmul(input, &mut [MatmulPart { w: router, y }])?;
        if let Some(b) = &self.layers[l].router_bias {
            for row in y.chunks_exact_mut(n_experts) {
                row.iter_mut().zip(b).for_each(|(x, v)| *x += v);
            }
        }
        let routes = self.routers[l]
            .as_mut()
            .expect("MoE layers have a router")
            .route(&a.router_logits[..n * n_experts], n)
            .map_err(|e| PipelineError::Setup(e.to_string()))?;
        let hot_layer = &self.hot_set.layers[l];
        if self.perf.mode() != PerfMode::Off {
            for &e in &routes.expert_ids {
                self.perf.record_slot(l, e as usize, hot_layer.is_hot(e as usize));
            }
        }
        Ok(())
    }

    /// The attention (or mixer) norm of layer `l`'s input into `normed`.
    fn attn_norm(&mut self, l: usize, n: usize) -> Result<(), KernelError> {
        let (h, eps) = (self.config.hidden, self.config.rms_eps);
        let (w, a) = (&self.layers[l], &mut self.act);
        rms_norm_rows(
            self.dense.pool_mut(),
            (&a.hidden[..n * h], h),
            &w.attn_norm,
            eps,
            &mut a.normed[..n * h],
        )
    }

    /// The experts' own norm of the layer input into `normed` (`MoeSpec::branch_norms`).
    fn experts_norm(&mut self, l: usize, n: usize) -> Result<(), KernelError> {
        let (h, eps) = (self.config.hidden, self.config.rms_eps);
        let (w, a) = (&self.layers[l], &mut self.act);
        let [_, pre, _] = w.branch_norms.as_ref().expect("a layer with branch norms");
        rms_norm_rows(self.dense.pool_mut(), (&a.hidden[..n * h], h), pre, eps, &mut a.normed[..n * h])
    }

    /// The shared expert of layer `l` on the dense pool: `shared_y` and its sigmoid gate.
    fn shared_expert(&mut self, l: usize, w: &[DenseMatrix<'_>; 3], n: usize) -> Result<(), PipelineError> {
        let (h, sff) = (self.config.hidden, self.config.shared_expert_ff);
        let a = &mut self.act;
        let x = &a.normed[..n * h];
        let (g, u) = (&mut a.shared_g[..n * sff], &mut a.shared_u[..n * sff]);
        self.dense.matmul(x, &mut [MatmulPart { w: w[0], y: g }, MatmulPart { w: w[1], y: u }])?;
        let act = self.plan.layer(l).as_moe().expect("a MoE layer").activation.kernel();
        for (gv, uv) in g.iter_mut().zip(u.iter()) {
            *gv = act.gated(*gv, *uv);
        }
        self.dense
            .matmul(&a.shared_g[..n * sff], &mut [MatmulPart { w: w[2], y: &mut a.shared_y[..n * h] }])?;
        // An ungated shared expert (DeepSeek-V3) is added as it is.
        for t in 0..n {
            a.shared_gate[t] = match &self.layers[l].shared_gate_logit {
                Some(g) => sigmoid(dot(g, &a.normed[t * h..(t + 1) * h])),
                None => 1.0,
            };
        }
        Ok(())
    }

    /// A dense FFN layer (no experts): its norm, `down · act(gate · x) * (up · x)`, the residual.
    fn dense_ffn_block(&mut self, l: usize, w: &[DenseMatrix<'_>; 3], n: usize) -> Result<(), PipelineError> {
        let (h, ff, eps) = (self.config.hidden, w[0].rows, self.config.rms_eps);
        let a = &mut self.act;
        rms_norm_rows(
            self.dense.pool_mut(),
            (&a.hidden[..n * h], h),
            &self.layers[l].ffn_norm,
            eps,
            &mut a.normed[..n * h],
        )?;
        let (g, u) = (&mut a.shared_g[..n * ff], &mut a.shared_u[..n * ff]);
        self.dense
            .matmul(&a.normed[..n * h], &mut [MatmulPart { w: w[0], y: g }, MatmulPart { w: w[1], y: u }])?;
        let crate::model::arch::Ffn::Dense(spec) = self.plan.layer(l).ffn else {
            unreachable!("a dense layer")
        };
        let act = spec.activation.kernel();
        for (gv, uv) in g.iter_mut().zip(u.iter()) {
            *gv = act.gated(*gv, *uv);
        }
        self.dense
            .matmul(&a.shared_g[..n * ff], &mut [MatmulPart { w: w[2], y: &mut a.shared_y[..n * h] }])?;
        for (x, y) in a.hidden[..n * h].iter_mut().zip(&a.shared_y[..n * h]) {
            *x += y;
        }
        Ok(())
    }

    /// Build and check layer `l`'s worklist in the lanes' shared input (the Dispatcher).
    /// Returns why the layer cannot be split, if it cannot.
    fn dispatch(&mut self, l: usize, n: usize, plan: &ExecPlan) -> Option<LayerFailure> {
        let (h, k) = (self.config.hidden, self.config.n_experts_used);
        let hot_layer = &self.hot_set.layers[l];
        let routes = self.routers[l].as_ref().expect("MoE layers have a router").routes();
        let Some(input) = self.lanes.input_mut() else {
            let detail = "a lane that timed out still holds the layer input";
            return Some(LayerFailure::new(FallbackReason::LaneUnavailable, detail));
        };
        input.call_idx = self.call_idx;
        input.layer_idx = l;
        input.n_tokens = n;
        input.x[..n * h].copy_from_slice(&self.act.normed[..n * h]);
        let wl = &mut input.worklist;
        if let Err(e) = wl.build(&routes.expert_ids, &routes.weights, n, k, Some(hot_layer), plan.order) {
            return Some(LayerFailure::new(FallbackReason::Shape, e.to_string()));
        }
        if self.fault.corrupt_worklist_layer == Some(l) {
            wl.inject_corruption();
        }
        let checked = wl.check_consistency(Some(hot_layer)).err();
        checked.map(|e| LayerFailure::new(FallbackReason::Worklist, e.to_string()))
    }

    /// All-cold fallback on this thread, from the RAM experts: layer `l`'s routed experts of
    /// every token into `act.moe` (the cold kernels one slot at a time).
    fn all_cold(&mut self, l: usize, n: usize) -> Result<(), PipelineError> {
        let (h, k) = (self.config.hidden, self.config.n_experts_used);
        let routes = self.routers[l].as_ref().expect("MoE layers have a router").routes();
        let pairs = routes.expert_ids[..n * k].iter().zip(&routes.weights[..n * k]);
        let a = &mut self.act;
        let mut lane = KernelLane { compute: &*self.cold, scratch: &mut self.fallback_scratch };
        let (rows, out) = (&a.normed[..n * h], &mut a.moe[..n * h]);
        all_cold(
            &mut lane,
            l,
            rows,
            pairs.map(|(&e, &w)| (e as usize, w)),
            k,
            &mut self.fallback_slots,
            out,
        )?;
        Ok(())
    }
}

/// A hot set naming experts of a layer that has none (a dense FFN layer) is refused by name.
fn check_no_hot_dense_layers(model: &Model, hot_set: &HotSet) -> Result<(), PipelineError> {
    let plan = model.plan();
    match hot_set.layers.iter().enumerate().find(|(l, hl)| !plan.layer(*l).has_experts() && hl.n_hot() > 0) {
        Some((l, hl)) => Err(PipelineError::Setup(format!(
            "layer {l} is a dense FFN layer without experts, but the hot set names {} of its experts",
            hl.n_hot()
        ))),
        None => Ok(()),
    }
}

/// Rows `head * rows .. (head + 1) * rows` of a stacked per-head matrix.
fn head_rows<'m>(m: &DenseMatrix<'m>, head: usize, rows: usize) -> DenseMatrix<'m> {
    let rb = m.row_bytes();
    DenseMatrix {
        bytes: &m.bytes[head * rows * rb..(head + 1) * rows * rb],
        dtype: m.dtype,
        rows,
        cols: m.cols,
    }
}

/// Fewest rows [`rms_norm_rows`] spreads over the pool's threads: a row is about 3 us at 2048
/// values (its sum of squares one dependent chain of f32 adds), so a prefill chunk's 512 rows
/// took a millisecond on one thread per norm, per layer; a decode step's few rows stay on the
/// caller's thread.
const PAR_NORM_MIN_ROWS: usize = 16;

/// `out` row t = [`rms_norm_row`] of `x` row t, for the rows of `h` values in `x`; many rows on
/// the pool's threads, each computed exactly as alone (the same bits).
fn rms_norm_rows(
    pool: &mut ColdPool,
    (x, h): (&[f32], usize),
    weight: &[f32],
    eps: f32,
    out: &mut [f32],
) -> Result<(), KernelError> {
    if out.len() / h < PAR_NORM_MIN_ROWS {
        for (x, out) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
            rms_norm_row(x, weight, eps, out);
        }
        return Ok(());
    }
    par_chunks_mut(pool, out, h, &|t, row| rms_norm_row(&x[t * h..(t + 1) * h], weight, eps, row))
}

fn rms_norm_row(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let mut ss = 0.0f32;
    for v in x {
        ss += v * v;
    }
    let inv = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for ((o, v), w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * inv * w;
    }
}

fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let mut ss = 0.0f32;
    for v in x.iter() {
        ss += v * v;
    }
    let inv = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for (v, w) in x.iter_mut().zip(weight) {
        *v = *v * inv * w;
    }
}

/// RMSNorm without a weight (a Gemma 4 value head).
fn rms_norm_unweighted(x: &mut [f32], eps: f32) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// The cos/sin of one RoPE: `table[pos * half + i]` for pair `i` at position `pos`.
struct RopeTable {
    spec: RopeSpec,
    half: usize,
    table: Vec<(f32, f32)>,
}

impl RopeTable {
    /// One table per distinct RoPE of `plan`'s layers, and each layer's table.
    fn per_layer(plan: &LayerPlan) -> (Vec<RopeTable>, Vec<usize>) {
        let mut tables: Vec<RopeTable> = Vec::new();
        let mut of = Vec::with_capacity(plan.len());
        for spec in plan.layers() {
            let rope = match &spec.mixer {
                Mixer::Attention(a) => a.rope,
                Mixer::LatentAttention(m) => m.rope,
                Mixer::GatedDeltaNet(_) => {
                    of.push(0);
                    continue;
                }
            };
            let idx = tables.iter().position(|t| t.spec == rope).unwrap_or_else(|| {
                tables.push(RopeTable { spec: rope, half: rope.dims / 2, table: Vec::new() });
                tables.len() - 1
            });
            of.push(idx);
        }
        (tables, of)
    }

    fn grow(&mut self, n_positions: usize) {
        let have = self.table.len().checked_div(self.half).unwrap_or(n_positions);
        let scale = self.spec.attention_factor();
        for pos in have..n_positions {
            for i in 0..self.half {
                let angle = pos as f64 * self.spec.inv_freq(i);
                self.table.push(((angle.cos() * scale) as f32, (angle.sin() * scale) as f32));
            }
        }
    }
}

fn rope_head(head: &mut [f32], table: &[(f32, f32)], style: RopeStyle) {
    let half = head.len() / 2;
    for (i, &(cos, sin)) in table.iter().enumerate().take(half) {
        let (a, b) = match style {
            RopeStyle::HalfSplit => (i, i + half),
            RopeStyle::Interleaved => (2 * i, 2 * i + 1),
        };
        let (x0, x1) = (head[a], head[b]);
        head[a] = x0 * cos - x1 * sin;
        head[b] = x1 * cos + x0 * sin;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows spread over the pool give each row the bits it has alone, for row counts on both
    /// sides of [`PAR_NORM_MIN_ROWS`]; every row is written.
    #[test]
    fn pooled_norm_rows_equal_one_row_at_a_time() {
        let h = 96;
        let mut pool = ColdPool::new(3);
        let weight: Vec<f32> = (0..h).map(|i| 0.5 + (i as f32 * 0.13).cos()).collect();
        for n in [1, PAR_NORM_MIN_ROWS - 1, PAR_NORM_MIN_ROWS, 41] {
            let x: Vec<f32> = (0..n * h).map(|i| (i as f32 * 0.37).sin() * (1.0 + (i % 7) as f32)).collect();
            let mut alone = vec![0.0f32; n * h];
            for (x, out) in x.chunks_exact(h).zip(alone.chunks_exact_mut(h)) {
                rms_norm_row(x, &weight, 1e-6, out);
            }
            let mut pooled = vec![f32::NAN; n * h];
            rms_norm_rows(&mut pool, (&x, h), &weight, 1e-6, &mut pooled).unwrap();
            let same = alone.iter().zip(&pooled).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{n} rows: pooled norms differ from one row at a time");
        }
    }
}
