//! The GPU engine's options: its switches ([`GpuOptions`]), how prefill attention and
//! activations run, and the faults injected on purpose to prove each fallback path.

use super::postfetch::plan::PostFetchOptions;
use crate::cache::perf::PerfMode;
use crate::model::context::KvType;
use crate::moe::faults::{FaultLane, LaneFault, LaneFaultSchedule};
use moe_lanes_kernels::WeightDType;
use std::time::Duration;

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
    /// Split for float weights; quantized weights, whose own rounding is far coarser, take
    /// 8-bit activations on int8 tensor cores where their type has int8 grouped tiles (the hot
    /// lane's MXFP4 experts, `grouped_*_mxfp4_q8`, as llama.cpp's MMQ) and one bf16 rounding
    /// elsewhere.
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
    /// Whether the grouped GEMMs of quantized weights with int8 tiles take them.
    pub fn int8(self) -> bool {
        self == PrefillActivations::Auto
    }
}

/// Engine switches.
#[derive(Debug, Clone)]
pub struct GpuOptions {
    /// The CUDA devices the layers are split over (`--devices 0,1`), in layer order: the first
    /// runs the embedding, the last the head. Empty: the one `CudaConfig::device_ordinal` names
    /// (0, or `MOE_LANES_CUDA_DEVICE`). An ordinal
    /// may repeat: two contexts' streams on one GPU, each with its own layers (how the
    /// multi-device path is tested on a one-GPU machine).
    pub devices: Vec<usize>,
    /// Each device's share of the layers (`--tensor-split 3,1`, llama.cpp's `-ts`), one positive
    /// number per device; empty: shares by each device's free memory
    /// ([`crate::gpu::split`]).
    pub tensor_split: Vec<f64>,
    /// The prefill hot lane's GEMMs: grouped (default) or per expert through cuBLAS.
    pub prefill_attention: PrefillAttention,
    /// What prefill GEMMs take as activations, by weight type.
    pub prefill_activations: PrefillActivations,
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
    /// The GEMVs of quantized weights take their activations quantized to 8 bits per block of 32
    /// on the device and dot them in integers (llama.cpp's MMVQ; bound in
    /// `moe_lanes_kernels::q8`): the hot lane's, and the dense matrices' in decode (a token, a
    /// batched step's rows; a short prefill chunk's dense GEMVs keep f32: 8-bit there failed
    /// `quant_engine`'s 3-7-token prompts against their 3e-2 on the H200); off: f32
    /// activations (f32 rounding only). `--activations f32` at the CLI turns it off.
    pub q8_activations: bool,
    /// The KV cache's element type (`--cache-type-k/v` at the CLI): f16 (default) or f32.
    pub kv_type: KvType,
    /// KV caches commit device memory as positions come (`kv`: addresses reserved for the
    /// whole capacity, pages mapped on demand, as vAttention), so short sessions hold little;
    /// off, or where the driver has no virtual memory management, each cache is allocated whole
    /// (`MOE_LANES_KV_PAGING=0` at the CLI). Default on.
    pub kv_paging: bool,
    /// A decode call (a batched step) of at least this many tokens runs as GEMMs (each weight
    /// read once for every row, instead of per-row GEMVs) the dense projections that the
    /// batched-decode GEMVs do not take: bf16 matrices whose k is not whole 32-column slabs, and
    /// calls past `DECODE_GEMV_MAX_TOKENS` rows (up to that many, bf16 matrices take the
    /// tensor-core GEMV and quantized ones the quantized GEMV, whatever this says). Its MoE
    /// keeps the decode path (worklist on the device, no host sync when all hot); its hot
    /// experts are [`GpuOptions::hot_grouped_min_rows`]'s question.
    pub batch_gemm_min_tokens: usize,
    /// A decode call (a batched step) of at least this many rows runs its hot experts as the
    /// grouped GEMMs over a worklist sorted by expert on the device (each hot expert read once
    /// for all the rows routed to it) instead of a GEMV per routed entry (which reads an expert
    /// once per entry). Of bf16 slots; quantized ones take
    /// [`GpuOptions::hot_grouped_min_rows_quantized`].
    pub hot_grouped_min_rows: usize,
    /// [`GpuOptions::hot_grouped_min_rows`] for a decode step over quantized hot slots (prefill
    /// calls keep the bf16 rule).
    pub hot_grouped_min_rows_quantized: usize,
    /// Most tokens of one engine call: a longer prompt runs as consecutive calls of this many
    /// (the last one shorter). Device scratch is sized for the longest call; see
    /// [`MAX_CALL_TOKENS`] for the cost.
    pub max_call_tokens: usize,
    /// A batched decode step of 2 to this many rows, on one device with cold experts in some
    /// layer, runs as two micro-batches whose lanes ping-pong (`ping_pong`): one's cold experts
    /// on the CPU while the GPU runs the other's dense stages. 0 or 1 (the default): never.
    pub ping_pong_max_rows: usize,
}

/// [`GpuOptions::ping_pong_max_rows`]'s default: off. Measured on the H200 host (16-layer
/// Qwen3-30B-A3B-shaped Q4_K_M, `scripts/gpu-measure.sh pingpong`, benches/RESULTS.md "lane
/// ping-pong"): the fronts ran hidden (the driver's wait for the routing fell from the GPU's
/// whole share to about 0.1 ms a step), yet the steps were slower, at budget 0 B = 2 / 4 / 8
/// 0.77-0.88x / 0.83-0.92x / 0.87-0.98x, at half the experts hot 0.84-0.96x: the driver's own
/// time per micro-batch (two fronts' and joins' launches, host worklists, about 90 us a layer)
/// and the pool's fixed cost per job (two 1-row jobs 484 us against one 2-row job 425 us) are
/// more than the GPU time hidden. What would move it: fronts launched as captured graphs, a
/// cheaper job start on the pool. Cost of turning it on: where both halves of a step route to
/// the same cold expert it is read twice (`t` rows touch about `E (1 - (1 - k / E)^t)` distinct
/// experts; at top-8 of 128, 4 rows as two halves read 5% more, 8 rows 12%, 16 rows 23%).
pub const PING_PONG_MAX_ROWS: usize = 0;

/// [`GpuOptions::max_call_tokens`]'s default, llama.cpp's default logical batch (`n_batch`).
/// Cost: scratch grows linearly with it (its largest parts: the logits rows, `tokens x vocab`
/// floats, and the prefill GEMMs' split activations, `tokens x top-k x widest row` bf16 pairs):
/// about 6 GB at 2048 tokens for a DeepSeek-V3-shaped model, 2 GB for Qwen3-30B-A3B. Smaller
/// calls re-read the dense weights and, with cold experts, re-copy the Post-Fetched ones more
/// often per prompt token.
pub const MAX_CALL_TOKENS: usize = 2048;

/// [`GpuOptions::batch_gemm_min_tokens`]'s default.
pub const BATCH_GEMM_MIN_TOKENS: usize = 8;

/// [`GpuOptions::hot_grouped_min_rows`]'s default, from the bytes read (not yet timed on a GPU):
/// `t` rows route `t * k` entries onto about `E (1 - (1 - k / E)^t)` distinct experts; at top-8 of
/// 128 (Qwen3-30B-A3B) 8 rows touch about 52 experts for 64 entries (19% fewer expert bytes than
/// the per-entry GEMVs), 16 rows about 82 for 128 (36% fewer); at 4 rows the saving (9%) is
/// within what the grouped kernels' 64-row tiles may lose to the GEMVs.
pub const HOT_GROUPED_MIN_ROWS: usize = 8;

/// [`GpuOptions::hot_grouped_min_rows_quantized`]'s default. Measured on the H200 (16-layer
/// Qwen3-30B-A3B-shaped Q4_K_M, every expert hot, `bench --parallel 4,8,16,32`, two rounds,
/// benches/RESULTS.md "quantized hot lane"): the per-entry GEMVs gave B = 8 / 16 / 32 1787-1805 /
/// 1962-1977 / 2098-2100 t/s against the grouped lane's 970-983 / 1232-1243 / 1606-1616 (the
/// grouped kernels dequantize each tile for the tensor cores, which a few rows a slot do not
/// repay); with half the experts hot the two were within 3%. The gap narrows with rows (1.84x,
/// 1.59x, 1.30x): 64, the most rows the decode GEMVs take, is where it is expected to close; not
/// measured between 33 and 64.
pub const HOT_GROUPED_MIN_ROWS_QUANTIZED: usize = 64;

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            devices: Vec::new(),
            tensor_split: Vec::new(),
            prefill_attention: PrefillAttention::Mma,
            prefill_activations: PrefillActivations::default(),
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
            kv_paging: true,
            batch_gemm_min_tokens: BATCH_GEMM_MIN_TOKENS,
            hot_grouped_min_rows: HOT_GROUPED_MIN_ROWS,
            hot_grouped_min_rows_quantized: HOT_GROUPED_MIN_ROWS_QUANTIZED,
            max_call_tokens: MAX_CALL_TOKENS,
            ping_pong_max_rows: PING_PONG_MAX_ROWS,
        }
    }
}
