//! The `moe-lanes` command-line interface. The only place that turns library errors into
//! `anyhow` errors and prints; everything it does is a library call.

use anyhow::{bail, ensure, Context, Result};
use clap::{Args, Parser, Subcommand};
use moe_lanes::adapter;
use moe_lanes::cache::trace::{read_learn_or_trace, ExpertTracer};
use moe_lanes::cache::update::{UpdateMode, UpdatePolicy};
use moe_lanes::cache::weighting::{WeightMode, Weighting};
use moe_lanes::dtype::DType;
use moe_lanes::engine::{
    build_engine, BuildReport, Engine, EngineError, EngineKind, EngineOptions, Generation, GenerationOptions,
    HotBudget, HotChoice, LiveCache, TracedEngine,
};
use moe_lanes::env;
use moe_lanes::hot_set::{HotSet, MAX_HOT_LANES};
use moe_lanes::inspect::{format_bytes, InspectReport};
use moe_lanes::model::context::KvType;
use moe_lanes::model::Model;
use moe_lanes::perf::{ModelFingerprint, PerfMode};
use moe_lanes::phase::Phase;
use moe_lanes::pipeline::ColdKernels;
use moe_lanes::reference::Reference;
use moe_lanes::synth::{self, DimOverrides, Preset, Skew, SynthFormat, SynthOptions};
use moe_lanes::threads::ColdThreads;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Print a line to stdout; a closed pipe (`moe-lanes logits ... | head`) ends the program quietly
/// instead of panicking.
macro_rules! out {
    ($($arg:tt)*) => { emit(&format!("{}\n", format_args!($($arg)*))) };
}

/// Like `out!` without the trailing newline.
macro_rules! out_raw {
    ($($arg:tt)*) => { emit(&format!($($arg)*)) };
}

mod chat_cmd;
mod quantize_cmd;
mod run_cmd;
mod text_cmds;

fn emit(text: &str) -> Result<()> {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(text.as_bytes()).and_then(|_| stdout.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        other => Ok(other?),
    }
}

#[derive(Parser)]
#[command(
    name = "moe-lanes",
    version,
    about = "Run Mixture-of-Experts models with hot experts on the GPU and cold experts on a CPU lane pool"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text tokens on the default synthetic model (created on first use) and report timing.
    Demo(DemoArgs),
    /// Write a checkpoint with random weights for any supported architecture.
    Synth(SynthArgs),
    /// Show a model's architecture, dimensions, dtypes and sizes.
    Inspect(InspectArgs),
    /// Print the logits of every position as JSON.
    Logits(LogitsArgs),
    /// Generate token ids, greedy or sampled (--temperature > 0); prints them as JSON.
    Generate(GenerateArgs),
    /// Learn pass: run tokens through the pipeline with the cache off and write the perf JSON
    /// learn file (per-layer, per-expert usage and timings).
    Learn(LearnArgs),
    /// Rewrite a GGUF file with quantized matrices (q8_0, q4_0, q5_0, q5_1, iq4_nl, q4_k_m,
    /// q5_k_m, q6_k, mxfp4_moe) in llama.cpp's layout and tensor-type mix.
    Quantize(quantize_cmd::QuantizeArgs),
    /// Measure the machine's read bandwidth and the cold-lane kernels' decode/prefill speed.
    BenchKernels(BenchKernelsArgs),
    /// End-to-end prompt processing and generation speed on the GPU with a hot cache.
    Bench(BenchArgs),
    /// What-if planner: per layer the experts a budget holds, their bytes, the predicted hit
    /// rate, and tg/pp predicted by a cost model calibrated from the learn file's perf data.
    Plan(PlanArgs),
    /// Serve the model over HTTP: the OpenAI API (/v1/models, /v1/completions with text or token-id
    /// prompts, /v1/chat/completions), /metrics, /moe-layer-perf, /moe-hot-cache, /health, the live
    /// page. Stops on ctrl-c or SIGTERM after in-flight requests finish.
    Serve(ServeArgs),
    /// Generate text from a text prompt, streamed as it is generated, then a one-line summary
    /// on stderr (prompt t/s, generation t/s, hit rate). Sampling flags as `generate`.
    Run(run_cmd::RunArgs),
    /// Chat over standard input: each line a user turn, each answer streamed to stdout through
    /// the model's chat template (GPT-OSS: the built-in Harmony template when the file has none,
    /// the final channel printed, the reasoning with --show-reasoning).
    Chat(chat_cmd::ChatArgs),
    /// Text to token ids with the model's tokenizer (GGUF metadata or tokenizer.json); prints a
    /// JSON array of ids.
    Tokenize(text_cmds::TokenizeArgs),
    /// Token ids to text with the model's tokenizer.
    Detokenize(text_cmds::DetokenizeArgs),
}

#[derive(Args)]
struct PlanArgs {
    #[arg(long)]
    model: PathBuf,
    /// Learn file (perf JSON from learn, or --perf-json of generate/bench for decode timings; the
    /// per-layer-call cost model fits best to a bench at a budget that leaves some cold slots per
    /// layer, e.g. 50%), or an expert trace (--trace of a model-running command).
    #[arg(long, required_unless_present = "trace", conflicts_with = "trace")]
    learn: Option<PathBuf>,
    /// Expert trace (--trace of a model-running command) whose counts replace a learn pass.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Hot-cache budget in MiB; -1 = the device's free memory after the weights and the KV
    /// cache of the model's context, minus 1024 MiB (needs a GPU).
    #[arg(long, allow_negative_numbers = true, required_unless_present = "policy_fractions")]
    hot_budget_mib: Option<i64>,
    /// Replay the --trace under every hot-cache policy (static, online updater, lru, lfu,
    /// tinylfu, adaptive, reuse) and Belady's optimum at the same capacity (per layer the budget's share of its
    /// experts, or each of --policy-fractions): hit rates, copies, predicted tg with
    /// --calibration.
    #[arg(long, requires = "trace")]
    policies: bool,
    /// --policies at these shares of each layer's experts instead of the budget's, e.g. 0.25,0.5.
    #[arg(long, value_delimiter = ',', requires = "policies")]
    policy_fractions: Vec<f64>,
    /// --policies: calls between a step policy's step and the first call its exchanges serve:
    /// 0 as the engines by default, 1 as with {"cache_policy": {"lag_steps": 1}}.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1), requires = "policies")]
    policy_lag: u8,
    /// --policies: a perf JSON with a decode phase (generate or bench --perf-json) whose
    /// per-slot costs predict tg.
    #[arg(long, requires = "policies")]
    calibration: Option<PathBuf>,
    /// flat, pressure, smooth_pressure, time or balanced.
    #[arg(long, default_value = "flat")]
    weighting: String,
    #[arg(long, default_value_t = moe_lanes::cache::weighting::DEFAULT_LAYER_CURVE)]
    layer_curve: f64,
    /// Also print the curve over budgets (0, 10, ..., 100% of all experts).
    #[arg(long)]
    sweep: bool,
    #[arg(long)]
    json: bool,
    /// Context size for the -1 budget's KV cache (default: the model's).
    #[arg(long)]
    ctx_size: Option<usize>,
}

/// `serve --parallel`'s default, as llama-server's: four requests at once, at the cost of the KV
/// cache of four contexts against the `-1` hot budget (raise it for many users, with
/// `--ctx-size` to keep experts in VRAM).
const DEFAULT_PARALLEL: u16 = 4;

#[derive(Args)]
struct ServeArgs {
    #[arg(long)]
    model: PathBuf,
    /// Address to listen on (loopback by default; port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: std::net::SocketAddr,
    /// Token required (Authorization: Bearer) by mutating endpoints; needed for them when
    /// --listen is not a loopback address.
    #[arg(long)]
    admin_token: Option<String>,
    /// Requests that may wait for the engine; more get 429.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// Requests generated together (continuous batching: one engine call per step over every
    /// running request); the `-1` hot budget leaves room for the KV cache of this many contexts.
    #[arg(long, default_value_t = DEFAULT_PARALLEL, value_parser = clap::value_parser!(u16).range(1..=256))]
    parallel: u16,
    /// Most tokens in one batched step: one per decoding request, the rest prompt chunks.
    #[arg(long, default_value_t = moe_lanes::engine::batch::DEFAULT_STEP_TOKENS, value_parser = count(1))]
    batch_tokens: usize,
    /// Finished requests' KV caches kept for prefix reuse (0: none): a prompt that starts with
    /// one's tokens (a chat's earlier turns) skips that part of its prefill.
    #[arg(long, default_value_t = moe_lanes::engine::batch::DEFAULT_PREFIX_CACHE, value_parser = count(0))]
    prefix_cache: usize,
    /// With a prefix cache, a hybrid model's (DeltaNet) recurrent state is checkpointed at each
    /// prompt's end and at its last three multiples of this many positions (0: at the end only),
    /// so a prompt sharing part of a kept request reuses up to the latest checkpoint in that part.
    #[arg(long, default_value_t = moe_lanes::engine::batch::DEFAULT_CHECKPOINT_TOKENS, value_parser = count(0))]
    checkpoint_tokens: usize,
    /// Jinja chat template for /v1/chat/completions (default: the model's own,
    /// tokenizer.chat_template; a GPT-OSS model without one gets the built-in Harmony template,
    /// and its answers' analysis channel is reasoning_content).
    #[arg(long)]
    chat_template: Option<PathBuf>,
    #[command(flatten)]
    engine: EngineArgs,
}

#[derive(Args)]
struct BenchArgs {
    #[arg(long)]
    model: PathBuf,
    /// Prompt tokens (pp).
    #[arg(short = 'p', long, default_value_t = 512, allow_negative_numbers = true, value_parser = count(0))]
    prompt_tokens: usize,
    /// Generated tokens (tg).
    #[arg(short = 'n', long, default_value_t = 128, allow_negative_numbers = true, value_parser = count(0))]
    gen_tokens: usize,
    /// Positions already in the KV cache before each timed pp and tg, prefilled untimed
    /// (llama-bench's -d). 0: tg decodes from position 0, as llama-bench's tg test.
    #[arg(short = 'd', long, default_value_t = 0, allow_negative_numbers = true, value_parser = count(0))]
    depth: usize,
    /// Timed runs (median and spread are reported).
    #[arg(long, default_value_t = 3, allow_negative_numbers = true, value_parser = count(1))]
    runs: usize,
    #[arg(long)]
    json: bool,
    /// Feed the greedy token back during tg (default: random token ids, as llama-bench does).
    #[arg(long)]
    greedy: bool,
    /// Metrics on vs off in one call: install the Prometheus recorder (as serve does) and time
    /// tg in every run also with the perf state off (alternating order); prints the cost of
    /// recording.
    #[arg(long)]
    metrics_ab: bool,
    /// A scenario instead of the plain pp/tg runs: shift (requests from one domain of a
    /// `synth --skew domains:D` model, then from another; policies static_first, online,
    /// static_second; -p/-n are each request's prompt and generated tokens), or
    /// locality:p=P,drift=R[,topics=G][,window=W] (the plain pp/tg runs fed by the routing
    /// process with short-term memory of a `synth --skew` model with the same spec: each token
    /// re-picks the topic, so the experts, of one of the previous W tokens with probability P,
    /// else draws from a Zipf popular set of the G topics that changes by one topic with
    /// probability R per token; defaults G 16, W 8).
    #[arg(long)]
    scenario: Option<String>,
    /// shift: the model's number of domains (its `--skew domains:D`).
    #[arg(long, default_value_t = 2)]
    domains: usize,
    /// shift: the domain before the shift and the one after it.
    #[arg(long, value_delimiter = ',', default_value = "0,1")]
    shift: Vec<usize>,
    /// shift: requests per domain.
    #[arg(long, default_value_t = 8)]
    requests: usize,
    /// Batched throughput instead (llama-batched-bench): for each batch size B, B sequences of
    /// -p prompt tokens prefilled together, then -n decode steps of one token for each of them;
    /// aggregate pp/tg/total t/s and the decode step's p50/p99.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["scenario", "metrics_ab", "greedy"])]
    parallel: Option<Vec<usize>>,
    #[command(flatten)]
    engine: EngineArgs,
}

/// Engine selection, hot cache and perf settings shared by every command that runs a model.
#[derive(Args)]
struct EngineArgs {
    /// Forward engine: gpu (dense path and hot experts on the GPU, cold experts on the CPU pool;
    /// an error without a usable GPU), pipeline (CPU lanes) or reference (the oracle). Default:
    /// gpu when a usable GPU is present, else pipeline (the choice and why are printed on stderr).
    #[arg(long)]
    engine: Option<String>,
    /// Per layer, this fraction of experts is hot: the most used of --learn, else of a built-in
    /// learn pass (--learn-tokens).
    #[arg(long, conflicts_with = "hot_budget_mib", allow_negative_numbers = true)]
    hot_fraction: Option<f64>,
    /// Hot-cache budget in MiB, planned from --learn (or a built-in learn pass); -1 = free VRAM
    /// after weights, KV cache and scratch, minus 1024 MiB.
    #[arg(long, allow_negative_numbers = true)]
    hot_budget_mib: Option<i64>,
    /// Learn file (perf JSON) or expert trace (--trace) that ranks experts for --hot-fraction
    /// and --hot-budget-mib.
    #[arg(long)]
    learn: Option<PathBuf>,
    /// Write an expert trace here: per forward call and layer the phase, the routed experts
    /// (hot and cold slots each) and the layer's slot counts, as JSON lines (gpu or pipeline
    /// engine; replay it with plan --trace or --learn).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Tokens routed by the built-in learn pass (budget without --learn).
    #[arg(long, default_value_t = 256, allow_negative_numbers = true, value_parser = count(1))]
    learn_tokens: usize,
    /// Explicit hot experts: JSON {"layers": {"0": [ids...], ...}}.
    #[arg(long, conflicts_with_all = ["hot_fraction", "hot_budget_mib"])]
    hot_experts: Option<PathBuf>,
    /// Hot lanes of the CPU pipeline (1..=3); hot experts are dealt round-robin over them.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = count_in(1, MAX_HOT_LANES))]
    hot_lanes: usize,
    /// Cold-lane threads: auto (every core the process may use, less one per busy CPU hot lane
    /// and two for an active GPU lane) or a number.
    #[arg(long, default_value = "auto")]
    cold_threads: String,
    /// Engine tuning as JSON, e.g. {"gpu": {"prefill_attention": "tiled", "decode_graph":
    /// false}} (gpu fields: prefill_attention, prefill_activations, decode_graph,
    /// graph_lane_events, batch_gemm_min_tokens, hot_grouped_min_rows,
    /// hot_grouped_min_rows_quantized, max_call_tokens, ping_pong_max_rows; the MOE_LANES_*
    /// variables
    /// override them), and {"cache_policy": {"kind": "adaptive", "half_life": 32, "pin_fraction":
    /// 0.25, "copy_cost": {...}, "lag_steps": 0}} (--cache-policy overrides its kind; lag_steps
    /// 0, the default: a step's exchanges before the next call, 1: the step beside the next call,
    /// its exchanges before the one after).
    #[arg(long)]
    engine_config: Option<PathBuf>,
    /// Write the perf JSON here after the run.
    #[arg(long)]
    perf_json: Option<PathBuf>,
    /// Replace existing --perf-json and --trace files (never the model or another input, never
    /// a device or FIFO).
    #[arg(long)]
    force: bool,
    /// full, update or off.
    #[arg(long, default_value = "full")]
    perf_mode: String,
    /// How the planner and the updater rank experts: flat (usage, spread over layers first),
    /// pressure (favour layers whose cold lane is slow), smooth_pressure (pressure, outliers
    /// damped), time (total MoE time), balanced (pressure with a stronger per-layer spread).
    #[arg(long, default_value = "flat")]
    weighting: String,
    /// Exponent of the layer weight (0: usage alone; larger: lean harder on the layer signal).
    #[arg(long, default_value_t = moe_lanes::cache::weighting::DEFAULT_LAYER_CURVE)]
    layer_curve: f64,
    /// Hot-cache policy: reuse (the default: after every call, eviction and admission by each
    /// expert's chance of use in the next call, learned per layer from its recency, its uses in
    /// the last 8 calls and its long frequency; a miss is admitted only past a margin learned
    /// from what earlier swaps paid, so a stable workload keeps the learned cache), planned
    /// (learn + plan, moved only by --update), or another one applied after every call:
    /// adaptive (decayed-count eviction and admission at the half-life whose shadow cache saves
    /// the most net of its copies' cost: the host DRAM read, PCIe unless overlapped), lru, lfu
    /// (decayed counts), tinylfu
    /// (frequency admission, LRU eviction, a quarter of the slots pinned to the learned ranking,
    /// a copy-cost gate). Default: the --engine-config file's cache_policy, else reuse.
    #[arg(long)]
    cache_policy: Option<String>,
    /// The planned policy's online updater: off (the cache changes only by manual applies) or
    /// auto (after each request the cache follows the workload; selects the planned policy
    /// unless --cache-policy names another, which is an error).
    #[arg(long, default_value = "off")]
    update: String,
    /// Fraction of hot slots one automatic update may exchange.
    #[arg(long, default_value_t = moe_lanes::cache::update::DEFAULT_UPDATE_RATE)]
    update_rate: f64,
    /// Also update every N generated tokens inside a request (0: only after requests).
    #[arg(long, default_value_t = 0)]
    update_every_tokens: usize,
    /// Cold-lane kernels of the CPU pipeline: simd (moe-lanes-kernels) or plain.
    #[arg(long, default_value = "simd")]
    cold_kernels: String,
    /// Post-Fetch in GPU prefill (bf16 and quantized models): auto (a cost model copies a cold expert to a VRAM
    /// scratchpad and runs it on the GPU when that beats the CPU), on (every cold expert that
    /// fits), cpu (scratchpad allocated, every cold expert on the CPU), off (no scratchpad).
    /// Default: MOE_LANES_POSTFETCH, else auto.
    #[arg(long)]
    postfetch: Option<String>,
    /// Post-Fetch: a fetched expert whose copy is still in flight when the CPU lane is done is
    /// waited for (true) or computed on the CPU (false). Default:
    /// MOE_LANES_POSTFETCH_BLOCK_ON_MISS, else true.
    #[arg(long)]
    postfetch_block_on_miss: Option<bool>,
    /// Post-Fetch: expert copies in flight at most (the layer's other chosen experts run on the
    /// CPU). Default: MOE_LANES_POSTFETCH_MAX_TRANSFERS, else 256.
    #[arg(long)]
    postfetch_max_transfers: Option<usize>,
    /// Post-Fetch: VRAM of the scratchpad in MiB (at least one expert, at most the cold experts
    /// of the layer with the most; 0: off). Default: MOE_LANES_POSTFETCH_SCRATCH_MIB, else 1024.
    #[arg(long)]
    postfetch_scratch_mib: Option<f64>,
    /// Post-Fetch: copy streams (1 to 4). Default: MOE_LANES_POSTFETCH_STREAMS, else 1.
    #[arg(long)]
    postfetch_streams: Option<usize>,
    /// Post-Fetch: a line per prefill layer with the decision on stderr.
    #[arg(long)]
    postfetch_debug: bool,
    /// Post-Fetch in GPU decode too: a token's cold experts split between the CPU lane and
    /// copies to the scratchpad by the same cost model (measured slower on the H200 machine,
    /// where both read the host's DRAM). Default: MOE_LANES_POSTFETCH_DECODE, else false.
    #[arg(long)]
    postfetch_decode: Option<bool>,
    /// Activations of the decode of quantised weights (CPU: experts of up to 4 tokens, the
    /// dense stage's quantised matrices, and many-token Q4_K, Q5_K, Q6_K, Q8_0 and MXFP4
    /// products): f32, q8 (8-bit for every quantised type) or auto. CPU with AVX-512 VNNI: auto
    /// is 8-bit except for few-token Q8_0 products, the default; AVX2 alone: 8-bit for Q4_0, Q4_K, Q5_K and Q6_K. GPU engine: q8 and auto (the default) are 8-bit for every quantised
    /// type and its prefill GEMMs round them to bf16; f32 keeps f32 (prefill: bf16 hi + lo).
    /// MOE_LANES_Q8_ACTIVATIONS sets the default.
    #[arg(long)]
    activations: Option<String>,
    /// Context size in positions (prompt + generated tokens). Default: the model's trained
    /// context, lowered to what the KV cache can take of the available memory.
    #[arg(long)]
    ctx_size: Option<usize>,
    /// GPUs to split the layers over, in layer order (CUDA device numbers, e.g. 0,1; a number
    /// twice runs two streams on that GPU): the first runs the embedding, the last the head;
    /// each holds its layers' weights, KV cache and hot experts. Default: one GPU,
    /// MOE_LANES_CUDA_DEVICE or 0.
    #[arg(long)]
    devices: Option<String>,
    /// Each --devices entry's share of the layers (llama.cpp's -ts), one positive number per
    /// device, e.g. 3,1. Default: by each GPU's free memory.
    #[arg(long)]
    tensor_split: Option<String>,
    /// KV cache type of the keys: f32, f16, bf16 or q8_0 (llama.cpp's flag and q8_0 layout:
    /// blocks of 32, heads of a multiple of 32). Default: f16 on the gpu engine, f32 on the
    /// pipeline; the reference engine keeps f32 and refuses the others.
    #[arg(long)]
    cache_type_k: Option<String>,
    /// KV cache type of the values: f32, f16, bf16 or q8_0; keys and values share one type.
    #[arg(long)]
    cache_type_v: Option<String>,
}

#[derive(Args)]
struct BenchKernelsArgs {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Cold-pool threads (default: every CPU this process may use).
    #[arg(long)]
    threads: Option<usize>,
    /// Force a SIMD level: scalar, avx2, avx512, avx512bf16 or amx (default: MOE_LANES_SIMD or the best detected).
    #[arg(long)]
    simd: Option<String>,
    /// Smaller buffers and fewer rounds (a smoke run).
    #[arg(long)]
    quick: bool,
    /// Expert weight type: bf16 (default), f16, f32, q8_0, q4_0, q5_0, q5_1, iq4_nl, q4_k, q5_k,
    /// q6_k or mxfp4.
    #[arg(long)]
    dtype: Option<String>,
    /// Activations of the tiles of quantised weights for experts of up to 4 tokens, and of Q4_K
    /// and Q6_K experts' prefill tiles (AVX-512 VNNI): f32, q8 (8-bit for every quantised type) or auto (8-bit except for Q8_0; the default with VNNI, unless
    /// MOE_LANES_Q8_ACTIVATIONS says otherwise).
    #[arg(long)]
    activations: Option<String>,
}

#[derive(Args)]
struct DemoArgs {
    /// Model to run instead of the default synthetic one.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 16)]
    max_new_tokens: usize,
    /// Forward engine (default: gpu when usable, else pipeline).
    #[arg(long)]
    engine: Option<String>,
}

#[derive(Args)]
struct SynthArgs {
    /// Architecture: qwen3_moe, mixtral, olmoe, qwen2_moe, the hybrids qwen3_next and qwen3_5_moe
    /// (Gated DeltaNet + gated attention; GGUF in llama.cpp's layout or safetensors), gpt_oss,
    /// deepseek_v3, glm4_moe or gemma4 (GGUF `gemma4` in llama.cpp's layout, or its published
    /// safetensors form).
    #[arg(long, default_value = "qwen3_moe")]
    arch: String,
    /// Dimension preset: tiny, qwen3-30b-a3b, or for the hybrids qwen3.6-35b-a3b (--arch
    /// qwen3_5_moe) and qwen3-next-80b-a3b (--arch qwen3_next), gpt-oss-20b / gpt-oss-120b
    /// (--arch gpt_oss), deepseek-v3 / kimi-k2 (--arch deepseek_v3), glm-4.5-air (--arch glm4_moe);
    /// --layers N shrinks any.
    #[arg(long, default_value = "tiny")]
    preset: String,
    /// gguf or safetensors (a directory).
    #[arg(long, default_value = "gguf")]
    format: String,
    /// Output file (gguf) or directory (safetensors).
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// uniform, skewed (top half of experts gets ~90% of slots), zipf:S, domains:D (D token
    /// ranges, each routing to its own popular experts), or
    /// locality:p=P,drift=R[,topics=G][,window=W] (G token ranges, each routing sharply to its
    /// own experts; bench --scenario
    /// with the same spec feeds tokens that re-pick a recent token's topic with probability P,
    /// from a popular set drifting by one topic with probability R per token).
    #[arg(long, default_value = "skewed")]
    skew: String,
    /// bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    #[arg(long)]
    layers: Option<usize>,
    #[arg(long)]
    hidden: Option<usize>,
    #[arg(long)]
    heads: Option<usize>,
    #[arg(long)]
    kv_heads: Option<usize>,
    #[arg(long)]
    head_dim: Option<usize>,
    #[arg(long)]
    vocab: Option<usize>,
    /// Copy the tokenizer (and chat template) of this GGUF file, a vocabulary-only one works;
    /// the vocabulary size follows it. Safetensors output also gets it as tokenizer.json (byte-level
    /// BPE vocabularies only).
    #[arg(long)]
    vocab_from: Option<PathBuf>,
    #[arg(long)]
    experts: Option<usize>,
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long)]
    expert_ff: Option<usize>,
    #[arg(long)]
    shared_expert_ff: Option<usize>,
    /// Tie the lm_head to the token embedding.
    #[arg(long)]
    tied: bool,
    /// Multi-token-prediction layers after the last layer, as llama.cpp's converter writes a
    /// Qwen3.5 or GLM-4.5 checkpoint's (hybrids and glm4_moe, GGUF only): loaded and not run;
    /// `inspect` lists them.
    #[arg(long)]
    mtp_layers: Option<usize>,
    /// No q/k/v biases (glm4_moe's `attention_bias: false`, as some GLM-4.5 derivatives have;
    /// GLM-4.5 itself has them).
    #[arg(long)]
    no_attention_bias: bool,
    /// Quantize the checkpoint (GGUF only): q8_0, q4_0, q5_0, q5_1, iq4_nl, q4_k_m, q5_k_m, q6_k or
    /// mxfp4_moe, tensor types chosen as `quantize` does. K-quants need rows of 256 values (e.g.
    /// --hidden 256 --expert-ff 256 --head-dim 64); other rows of 32s fall back as llama.cpp's do
    /// (Q4_K to q5_0, Q5_K to q5_1, Q6_K to q8_0).
    #[arg(long)]
    quant: Option<String>,
    /// With --quant, for files made to be timed: quantize only each expert tensor's first ROWS
    /// rows and copy them (drawn per row) into the rest; the same types, sizes and statistics at
    /// about the speed of memory (K-quants otherwise take hours for a 70 GB file), the experts no
    /// longer independent draws: not for accuracy tests.
    #[arg(long, value_name = "ROWS")]
    expert_row_pool: Option<std::num::NonZeroUsize>,
    /// YaRN RoPE scaling by this factor over the preset's context (which becomes F times longer),
    /// as Qwen3's model cards extend 32k to 128k; for architectures without their own scaling.
    #[arg(long, value_name = "F")]
    yarn: Option<f32>,
    /// Replace an existing output file (never a device or FIFO).
    #[arg(long)]
    force: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct InspectArgs {
    /// A GGUF file or a directory with config.json and safetensors.
    path: PathBuf,
    #[arg(long)]
    json: bool,
    /// Also measure routing coverage over this many tokens with the reference pass (1 to the
    /// model's context).
    #[arg(long, allow_negative_numbers = true, value_parser = count(1))]
    coverage_tokens: Option<usize>,
}

#[derive(Args)]
struct LogitsArgs {
    #[arg(long)]
    model: PathBuf,
    #[command(flatten)]
    prompt: PromptArgs,
    #[command(flatten)]
    engine: EngineArgs,
}

/// The prompt's token ids: on the command line, or from a file for long prompts.
#[derive(Args)]
struct PromptArgs {
    /// Comma-separated token ids.
    #[arg(
        long,
        value_delimiter = ',',
        required_unless_present = "tokens_file",
        conflicts_with = "tokens_file"
    )]
    tokens: Vec<u32>,
    /// A file of token ids separated by commas or white space (for prompts too long for a command line).
    #[arg(long)]
    tokens_file: Option<PathBuf>,
}

impl PromptArgs {
    fn ids(&self) -> Result<Vec<u32>> {
        let Some(path) = &self.tokens_file else { return Ok(self.tokens.clone()) };
        let text =
            std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
        let words = text.split(|c: char| c == ',' || c.is_whitespace()).filter(|w| !w.is_empty());
        let ids = words
            .enumerate()
            .map(|(i, w)| {
                w.parse::<u32>()
                    .with_context(|| format!("{}: token {} is '{w}', not a token id", path.display(), i + 1))
            })
            .collect::<Result<Vec<u32>>>()?;
        if ids.is_empty() {
            bail!("{}: no token ids", path.display());
        }
        Ok(ids)
    }
}

#[derive(Args)]
struct GenerateArgs {
    #[arg(long)]
    model: PathBuf,
    #[command(flatten)]
    prompt: PromptArgs,
    #[arg(long, default_value_t = 16)]
    max_new_tokens: usize,
    /// Comma-separated token ids that end the generation (not printed).
    #[arg(long, value_delimiter = ',')]
    stop_ids: Vec<u32>,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    engine: EngineArgs,
}

/// How the next token is chosen (llama.cpp's flag names).
#[derive(Args)]
struct SamplingArgs {
    /// 0 = greedy (the default); higher = more random.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    /// Keep the K most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Keep the most likely tokens whose probabilities sum to P (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Drop tokens less likely than P times the most likely one (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Penalise tokens of the last --repeat-last-n (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Window of the repeat, presence and frequency penalties, in tokens.
    #[arg(long, default_value_t = moe_lanes::sample::DEFAULT_PENALTY_LAST_N)]
    repeat_last_n: usize,
    /// Subtract from the logits of tokens in the window (0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    presence_penalty: f32,
    /// Subtract per occurrence in the window (0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    frequency_penalty: f32,
    /// Same seed, same tokens (default: from the clock).
    #[arg(long)]
    seed: Option<u64>,
    /// Print each token's log-probability and this many alternatives (0..=20).
    #[arg(long)]
    logprobs: Option<usize>,
}

impl SamplingArgs {
    fn params(&self) -> Result<moe_lanes::sample::SamplingParams> {
        let p = moe_lanes::sample::SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repeat_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            penalty_last_n: self.repeat_last_n,
            seed: self.seed,
            logprobs: self.logprobs,
        };
        // Flag names in the message, not the API's field names.
        p.validate().map_err(|e| {
            let flag = match e.field {
                "repetition_penalty" => "repeat-penalty".to_string(),
                "top_logprobs" => "logprobs".to_string(),
                f => f.replace('_', "-"),
            };
            anyhow::anyhow!("--{flag} {}: must be {}", e.value, e.expected)
        })?;
        Ok(p)
    }
}

#[derive(Args)]
struct LearnArgs {
    #[arg(long)]
    model: PathBuf,
    /// Comma-separated token ids; default: --n-tokens sampled ids.
    #[arg(long, value_delimiter = ',')]
    tokens: Vec<u32>,
    /// Tokens to sample when --tokens is not given.
    #[arg(long, default_value_t = 256, allow_negative_numbers = true, value_parser = count(1))]
    n_tokens: usize,
    /// Where to write the learn file.
    #[arg(long)]
    out: PathBuf,
    /// Replace an existing --out file (never the model, a device or FIFO).
    #[arg(long)]
    force: bool,
    /// Forward engine (default: gpu when usable, else pipeline). The cache is off.
    #[arg(long)]
    engine: Option<String>,
    /// Cold-lane threads: auto (every core the process may use, less one per busy CPU hot lane
    /// and two for an active GPU lane) or a number.
    #[arg(long, default_value = "auto")]
    cold_threads: String,
}

/// A clap parser for a count of at least `min`: a negative or malformed value gets a range
/// error that names the range (not clap's "unexpected argument '-1'").
fn count(min: usize) -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync + 'static {
    count_in(min, usize::MAX)
}

/// [`count`] with an upper bound too.
fn count_in(
    min: usize,
    max: usize,
) -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync + 'static {
    move |s: &str| {
        let range = if max == usize::MAX {
            format!("a whole number of at least {min}")
        } else {
            format!("{min} to {max}")
        };
        match s.trim().parse::<i128>() {
            Ok(n) if n >= min as i128 && n <= max as i128 => Ok(n as usize),
            Ok(_) => Err(format!("out of range: expected {range}")),
            Err(_) => Err(format!("not a number: expected {range}")),
        }
    }
}

/// `--hot-budget-mib`: bytes (checked, never wrapped), or `None` for -1 (auto).
fn budget_mib(mib: i64) -> Result<Option<u64>> {
    match mib {
        -1 => Ok(None),
        mib if mib >= 0 => (mib as u64)
            .checked_mul(1 << 20)
            .map(Some)
            .with_context(|| format!("--hot-budget-mib {mib}: too large (at most {} MiB)", u64::MAX >> 20)),
        mib => bail!("--hot-budget-mib {mib}: expected a size in MiB or -1 for auto"),
    }
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    // Ctrl-c or SIGTERM mid-write (synth, the first demo) leaves no partial model behind; the
    // server handles those signals itself (it lets in-flight requests finish).
    if !matches!(cli.command, Command::Serve(_)) {
        let _ = ctrlc::set_handler(|| {
            moe_lanes::format::remove_partial_files();
            std::process::exit(130);
        });
    }
    match cli.command {
        Command::Serve(args) => serve(args),
        Command::Demo(args) => demo(args),
        Command::Synth(args) => synth_cmd(args),
        Command::Inspect(args) => inspect(args),
        Command::Logits(args) => logits(args),
        Command::Generate(args) => generate(args),
        Command::Learn(args) => learn(args),
        Command::Quantize(args) => quantize_cmd::quantize(args),
        Command::BenchKernels(args) => bench_kernels(args),
        Command::Bench(args) => bench(args),
        Command::Run(args) => run_cmd::run(args),
        Command::Chat(args) => chat_cmd::chat(args),
        Command::Tokenize(args) => text_cmds::tokenize(args),
        Command::Detokenize(args) => text_cmds::detokenize(args),
        Command::Plan(args) => plan(args),
    }
}

fn open_model(path: &Path) -> Result<Model> {
    Model::open(path).with_context(|| format!("cannot open model {}", path.display()))
}

/// The model with its session context set from `--ctx-size` (checked against the trained
/// context and the host memory a KV cache of the engine's type would take, [`ctx_kv_type`]).
fn open_model_ctx(path: &Path, args: &EngineArgs) -> Result<Arc<Model>> {
    let kv = ctx_kv_type(args.engine.as_deref(), kv_type_flags(args)?);
    open_model_with_context(path, args.ctx_size, kv)
}

fn open_model_with_context(path: &Path, ctx_size: Option<usize>, kv: KvType) -> Result<Arc<Model>> {
    use moe_lanes::model::context::{available_memory_bytes, resolve_context};
    let mut model = open_model(path)?;
    let positions = resolve_context(model.config(), ctx_size, available_memory_bytes(), kv)
        .with_context(|| format!("--ctx-size for {}", path.display()))?;
    model.set_context(positions);
    Ok(Arc::new(model))
}

/// The KV type the host-memory check of `--ctx-size` counts: the one asked for, else the
/// default of the engine named (the oracle's f32; the GPU engine's, which the pipeline it replays
/// into when the device is lost keeps; the pipeline's), else the larger of the GPU's and the
/// pipeline's defaults (the engine is chosen later).
fn ctx_kv_type(engine: Option<&str>, asked: Option<KvType>) -> KvType {
    let (gpu, cpu) = (moe_lanes::gpu::GpuOptions::default().kv_type, moe_lanes::pipeline::PIPELINE_KV_TYPE);
    asked.unwrap_or(match engine.map(str::parse::<EngineKind>) {
        Some(Ok(EngineKind::Reference)) => KvType::F32,
        Some(Ok(EngineKind::Gpu)) => gpu,
        Some(Ok(EngineKind::Pipeline)) => cpu,
        _ => {
            if gpu.bytes_of(32) >= cpu.bytes_of(32) {
                gpu
            } else {
                cpu
            }
        }
    })
}

/// Engine options with the environment applied (read here, at the edge; `moe_lanes::env` lists
/// the variables): device and cubin cache, GPU profile, fault injection, a simulated VRAM limit,
/// and the engine tuning ([`tuning`]).
fn base_options(n_positions: usize) -> Result<EngineOptions> {
    options_tuned(n_positions, &tuning(None)?)
}

/// The engine tuning: `--engine-config FILE`'s settings (none: the defaults), the environment's
/// over them.
fn tuning(file: Option<&std::path::Path>) -> Result<moe_lanes::engine::tuning::EngineTuning> {
    let file = file.map(moe_lanes::engine::tuning::EngineTuning::read).transpose()?.unwrap_or_default();
    Ok(file.overridden_by(env::engine_tuning()?))
}

/// [`base_options`] with `tuning` applied.
fn options_tuned(
    n_positions: usize,
    tuning: &moe_lanes::engine::tuning::EngineTuning,
) -> Result<EngineOptions> {
    let mut opts = EngineOptions::new(n_positions);
    opts.cuda = env::cuda_config()?;
    if let Some(devices) = env::cuda_devices()? {
        opts.gpu.devices = devices;
    }
    opts.gpu.profile = env::gpu_profile();
    opts.gpu.faults = env::faults()?;
    opts.vram_limit_bytes = env::vram_limit_bytes()?;
    opts.pipeline.profile = env::cpu_profile();
    tuning.apply(&mut opts).context("engine tuning (--engine-config, MOE_LANES_*)")?;
    Ok(opts)
}

/// Typed engine options from the flags (and the environment, [`base_options`]).
fn engine_options(
    model: &Model,
    args: &EngineArgs,
    n_positions: usize,
    default_hot: HotChoice,
) -> Result<EngineOptions> {
    check_engine_outputs(model, args)?;
    let tuning = tuning(args.engine_config.as_deref())?;
    let mut opts = options_tuned(n_positions, &tuning)?;
    let mut cache_policy = tuning.cache_policy.unwrap_or_default();
    let mode = args.update.parse::<UpdateMode>().map_err(|e| anyhow::anyhow!("--update: {e}"))?;
    if let Some(kind) = &args.cache_policy {
        cache_policy.kind = kind.parse().map_err(|e| anyhow::anyhow!("--cache-policy: {e}"))?;
    } else if mode == UpdateMode::Auto {
        // --update auto is the planned policy's updater: it asks for that policy.
        cache_policy.kind = moe_lanes::cache::policy::PolicyKind::Planned;
    }
    if mode == UpdateMode::Auto && cache_policy.kind != moe_lanes::cache::policy::PolicyKind::Planned {
        bail!(
            "--update auto runs the planned policy's updater; --cache-policy {} moves the cache itself",
            cache_policy.kind.name()
        );
    }
    opts.kind = args.engine.as_deref().map(str::parse::<EngineKind>).transpose()?;
    let fingerprint = ModelFingerprint::of(model);
    opts.learn = args.learn.as_deref().map(|p| read_learn_or_trace(p, &fingerprint)).transpose()?;
    opts.weighting = weighting(&args.weighting, args.layer_curve)?;
    opts.update = UpdatePolicy {
        mode,
        rate: args.update_rate,
        every_tokens: args.update_every_tokens,
        weighting: opts.weighting,
        cache: cache_policy,
        ..UpdatePolicy::default()
    };
    opts.update.check().context("--update-rate, --engine-config cache_policy")?;
    opts.learn_tokens = args.learn_tokens;
    opts.hot = hot_choice(model, args, default_hot)?;
    opts.cold_threads = cold_threads(&args.cold_threads)?;
    opts.perf_mode = args.perf_mode.parse::<PerfMode>().map_err(anyhow::Error::msg)?;
    opts.pipeline.n_hot_lanes = args.hot_lanes;
    opts.pipeline.cold_kernels = args.cold_kernels.parse::<ColdKernels>().map_err(anyhow::Error::msg)?;
    if let Some(name) = &args.activations {
        opts.activations = Some(name.parse().map_err(|e| anyhow::anyhow!("--activations {name}: {e}"))?);
    }
    opts.gpu.perf_mode = opts.perf_mode;
    device_flags(&mut opts.gpu, args)?;
    postfetch_flags(&mut opts.gpu.postfetch, args)?;
    opts.kv_type = kv_type_flags(args)?;
    Ok(opts)
}

/// `--devices` and `--tensor-split` over what the environment set (the device numbers are
/// checked against the visible GPUs when the engine is built).
fn device_flags(gpu: &mut moe_lanes::gpu::GpuOptions, args: &EngineArgs) -> Result<()> {
    if let Some(list) = &args.devices {
        let parse = |d: &str| d.trim().parse::<usize>().ok();
        gpu.devices =
            list.split(',').map(parse).collect::<Option<Vec<_>>>().filter(|d| !d.is_empty()).ok_or_else(
                || {
                    anyhow::anyhow!(
                        "--devices {list}: expected CUDA device numbers separated by commas, e.g. 0,1"
                    )
                },
            )?;
    }
    if let Some(list) = &args.tensor_split {
        let parse = |v: &str| v.trim().parse::<f64>().ok().filter(|v| v.is_finite() && *v > 0.0);
        gpu.tensor_split = list.split(',').map(parse).collect::<Option<Vec<_>>>().ok_or_else(|| {
            anyhow::anyhow!("--tensor-split {list}: expected positive numbers separated by commas, e.g. 3,1")
        })?;
        let devices = gpu.devices.len();
        ensure!(
            devices == 0 || devices == gpu.tensor_split.len(),
            "--tensor-split {list}: {} shares for {devices} devices (--devices): give one share per device",
            gpu.tensor_split.len()
        );
    }
    Ok(())
}

/// `--cache-type-k` / `--cache-type-v`: one type for keys and values, or `None` for the
/// engine's default.
fn kv_type_flags(args: &EngineArgs) -> Result<Option<KvType>> {
    let parse = |flag: &str, v: &Option<String>| {
        v.as_deref()
            .map(|name| name.parse::<KvType>().map_err(|e| anyhow::anyhow!("{flag} {name}: {e}")))
            .transpose()
    };
    let (k, v) = (parse("--cache-type-k", &args.cache_type_k)?, parse("--cache-type-v", &args.cache_type_v)?);
    if let (Some(k), Some(v)) = (k, v) {
        ensure!(k == v, "--cache-type-k {k} and --cache-type-v {v}: keys and values share one type");
    }
    Ok(k.or(v))
}

/// The `--postfetch*` flags over what the tuning file and the environment set.
fn postfetch_flags(o: &mut moe_lanes::gpu::PostFetchOptions, args: &EngineArgs) -> Result<()> {
    if let Some(m) = &args.postfetch {
        o.mode = m.parse().map_err(|e| anyhow::anyhow!("--postfetch {m}: {e}"))?;
    }
    if let Some(b) = args.postfetch_block_on_miss {
        o.block_on_miss = b;
    }
    if let Some(n) = args.postfetch_max_transfers {
        ensure!(n > 0, "--postfetch-max-transfers: expected a count > 0");
        o.max_transfers = n;
    }
    if let Some(mib) = args.postfetch_scratch_mib {
        o.scratch_bytes = env::parse_mib(&mib.to_string())
            .ok_or_else(|| anyhow::anyhow!("--postfetch-scratch-mib {mib}: expected a size in MiB"))?;
    }
    if let Some(n) = args.postfetch_streams {
        let max = moe_lanes::gpu::POSTFETCH_MAX_STREAMS;
        ensure!((1..=max).contains(&n), "--postfetch-streams {n}: expected 1 to {max}");
        o.streams = n;
    }
    o.debug |= args.postfetch_debug;
    if let Some(b) = args.postfetch_decode {
        o.decode = b;
    }
    Ok(())
}

fn hot_choice(model: &Model, args: &EngineArgs, default: HotChoice) -> Result<HotChoice> {
    let c = model.config();
    if let Some(path) = &args.hot_experts {
        return Ok(HotChoice::Set(HotSet::from_experts_file(path, c.n_layers, c.n_experts, args.hot_lanes)?));
    }
    Ok(match (args.hot_budget_mib.map(budget_mib).transpose()?, args.hot_fraction) {
        (Some(None), _) => HotChoice::Budget(HotBudget::Auto),
        (Some(Some(bytes)), _) => HotChoice::Budget(HotBudget::Bytes(bytes)),
        (None, Some(f)) if (0.0..=1.0).contains(&f) => HotChoice::Budget(HotBudget::Fraction(f)),
        (None, Some(f)) => bail!("--hot-fraction {f}: expected a value in 0..=1"),
        (None, None) if args.learn.is_some() && matches!(default, HotChoice::None) => {
            bail!("--learn ranks experts for --hot-fraction or --hot-budget-mib; give one of them")
        }
        (None, None) => default,
    })
}

/// Build the engine the flags describe and say on stderr which one runs (and why not the GPU);
/// with `trace`, its forward calls are traced into that file.
fn open_engine<'m>(
    model: &'m Arc<Model>,
    opts: EngineOptions,
    trace: Option<&Path>,
) -> Result<(Box<dyn Engine + 'm>, BuildReport)> {
    let wanted = opts.kind;
    let (mut engine, report) = build_engine(model, opts).map_err(|e| match e {
        EngineError::NoGpu { .. } => anyhow::anyhow!(
            "--engine gpu: {e} (--engine pipeline runs on the CPU; without --engine the GPU is used when usable)"
        ),
        e => e.into(),
    })?;
    if let Some(path) = trace {
        if engine.perf().is_none() {
            bail!(
                "--trace {}: the {} engine keeps no counts (use gpu or pipeline)",
                path.display(),
                report.kind
            );
        }
        let tracer = ExpertTracer::create(path, &ModelFingerprint::of(model))?;
        engine = Box::new(TracedEngine::new(engine, tracer));
    }
    if let Some(reason) = &report.gpu_unavailable {
        if wanted.is_some() || report.kind != EngineKind::Reference {
            eprintln!("GPU engine unavailable ({reason}); running the {} engine", report.kind);
        }
    }
    eprintln!(
        "engine: {} on {} ({} hot experts from {})",
        report.kind,
        engine.device(),
        report.n_hot_experts,
        report.hot_source
    );
    Ok((engine, report))
}

fn serve(args: ServeArgs) -> Result<()> {
    let model = open_model_ctx(&args.model, &args.engine)?;
    let positions = model.config().max_positions;
    if let Some(path) = &args.engine.trace {
        bail!("--trace {}: serve does not trace (trace with run, generate, logits or bench)", path.display());
    }
    let mut opts = engine_options(&model, &args.engine, positions, HotChoice::None)?;
    opts.sequences = args.parallel as usize;
    let name =
        args.model.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    // Text in and out need the tokenizer; a model without one (or with one this build cannot
    // read) is served with token-id prompts only, saying so.
    let tokenizer = match moe_lanes::text::Tokenizer::from_model(&model) {
        Ok(t) => Some(std::sync::Arc::new(t)),
        Err(e) => {
            eprintln!("text API off (prompts are token ids): {e}");
            None
        }
    };
    let chat_template = match &tokenizer {
        None => Err("the model has no tokenizer".to_string()),
        Some(tok) => {
            let arch = model.config().arch;
            moe_lanes::text::ChatTemplate::for_model(args.chat_template.as_deref(), tok, &args.model, arch)
                .map(std::sync::Arc::new)
                .map_err(|e| e.to_string())
        }
    };
    if let (Some(path), None) = (&args.chat_template, &tokenizer) {
        anyhow::bail!("--chat-template {}: the model has no tokenizer to render it with", path.display());
    }
    // A template asked for that cannot be read or parsed stops serve; the model's own, missing or
    // broken, only turns the chat API off.
    match (&chat_template, &args.chat_template, &tokenizer) {
        (Err(why), Some(_), _) => anyhow::bail!("--chat-template: {why}"),
        (Err(why), None, Some(_)) => eprintln!("chat API off: {why}"),
        _ => {}
    }
    let serve_opts = moe_lanes_server::ServeOptions {
        tokenizer,
        chat_template,
        listen: args.listen,
        admin_token: args.admin_token,
        queue_capacity: args.queue,
        batch: moe_lanes::engine::BatchOptions {
            max_sequences: args.parallel as usize,
            step_tokens: args.batch_tokens,
            prefix_cache: args.prefix_cache,
            checkpoint_tokens: args.checkpoint_tokens,
        },
        model_name: name,
        perf_json: args.engine.perf_json.clone(),
    };
    moe_lanes_server::run(model, opts, serve_opts, |s| {
        eprintln!(
            "engine: {} on {} ({} hot experts from {})",
            s.report.kind, s.device, s.report.n_hot_experts, s.report.hot_source
        );
        if let Some(reason) = &s.report.gpu_unavailable {
            eprintln!("GPU engine unavailable ({reason})");
        }
        // The one line scripts wait for (the port, when --listen asked for port 0).
        println!("listening on http://{}", s.addr);
    })?;
    Ok(())
}

/// Every file the CLI writes follows one rule (`moe_lanes::output`), checked before any work.
fn check_output(path: &Path, force: bool, inputs: &[&Path]) -> Result<()> {
    use moe_lanes::output::OutputKind;
    Ok(moe_lanes::output::check_output(path, force, inputs, OutputKind::File)?)
}

/// `--perf-json` and `--trace` against the rule; the model, `--learn` and `--hot-experts` are
/// inputs.
fn check_engine_outputs(model: &Model, args: &EngineArgs) -> Result<()> {
    let mut inputs = vec![model.path()];
    inputs.extend(args.learn.as_deref());
    inputs.extend(args.hot_experts.as_deref());
    if let (Some(perf), Some(trace)) = (&args.perf_json, &args.trace) {
        let same = perf == trace || moe_lanes::output::same_file(perf, trace);
        ensure!(!same, "--perf-json and --trace name the same file {}", perf.display());
    }
    for path in args.perf_json.iter().chain(&args.trace) {
        check_output(path, args.force, &inputs)?;
    }
    Ok(())
}

fn write_perf(engine: &dyn Engine, path: &Option<PathBuf>) -> Result<()> {
    if let (Some(path), Some(perf)) = (path, engine.perf()) {
        moe_lanes::output::write_atomic(path, perf.to_json().as_bytes())?;
    }
    Ok(())
}

fn synth_cmd(args: SynthArgs) -> Result<()> {
    let opts = SynthOptions {
        adapter: adapter::by_name(&args.arch)?,
        preset: args.preset.parse::<Preset>().map_err(anyhow::Error::msg)?,
        dims: DimOverrides {
            n_layers: args.layers,
            hidden: args.hidden,
            n_heads: args.heads,
            n_kv_heads: args.kv_heads,
            head_dim: args.head_dim,
            vocab: args.vocab,
            n_experts: args.experts,
            n_experts_used: args.top_k,
            expert_ff: args.expert_ff,
            shared_expert_ff: args.shared_expert_ff,
            tied_embeddings: args.tied.then_some(true),
            mtp_layers: args.mtp_layers,
            attention_bias: args.no_attention_bias.then_some(false),
            yarn_factor: args.yarn,
        },
        dtype: DType::parse_float(&args.dtype)
            .with_context(|| format!("--dtype {}: expected bf16, f16 or f32", args.dtype))?,
        seed: args.seed,
        skew: args.skew.parse::<Skew>().map_err(anyhow::Error::msg)?,
        format: match args.format.as_str() {
            "gguf" => SynthFormat::Gguf,
            "safetensors" | "hf" => SynthFormat::Safetensors,
            other => bail!("--format {other}: expected gguf or safetensors"),
        },
        out: args.out,
        vocab_from: args.vocab_from,
    };
    let inputs: Vec<&Path> = opts.vocab_from.as_deref().into_iter().collect();
    synth::check_output_path(&opts.out, args.force, &inputs)?;
    let mix = args.quant.as_deref().map(|name| quantize_cmd::parse_mix(name, "--quant")).transpose()?;
    if args.expert_row_pool.is_some() && mix.is_none() {
        bail!("--expert-row-pool pools quantized rows: it needs --quant");
    }
    let report = write_with_progress(&opts, mix, args.expert_row_pool)?;
    if args.json {
        out!("{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        out!(
            "wrote {} ({}, {} tensors)",
            report.path.display(),
            format_bytes(report.n_bytes),
            report.n_tensors
        )?;
    }
    Ok(())
}

/// A byte progress bar on stderr (indicatif hides it when stderr is not a terminal).
fn byte_progress_bar(what: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(&format!(
            "{{spinner}} {what} [{{bar:40}}] {{bytes}}/{{total_bytes}} {{bytes_per_sec}} eta {{eta}}"
        ))
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar
}

fn write_with_progress(
    opts: &SynthOptions,
    mix: Option<moe_lanes::quantize::QuantMix>,
    expert_row_pool: Option<std::num::NonZeroUsize>,
) -> Result<synth::SynthReport> {
    let bar = byte_progress_bar("writing");
    let mut progress = |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    };
    let report = match (mix, expert_row_pool) {
        (None, _) => synth::write_synthetic(opts, &mut progress),
        (Some(mix), None) => synth::write_synthetic_quantized(opts, mix, &mut progress),
        (Some(mix), Some(pool)) => synth::write_synthetic_quantized_pooled(opts, mix, pool, &mut progress),
    };
    bar.finish_and_clear();
    Ok(report?)
}

fn inspect(args: InspectArgs) -> Result<()> {
    let model = open_model(&args.path)?;
    let mut report = InspectReport::new(&model);
    if let Some(n_tokens) = args.coverage_tokens {
        let max = model.config().max_positions;
        ensure!(n_tokens <= max, "--coverage-tokens {n_tokens}: at most {max} (the model's context)");
        if n_tokens > 1024 {
            eprintln!("measuring routing coverage over {n_tokens} tokens with the reference pass (slow)...");
        }
        report.measure_coverage(&model, n_tokens)?;
    }
    if args.json {
        out!("{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        out_raw!("{}", report.to_text())?;
    }
    Ok(())
}

fn logits(args: LogitsArgs) -> Result<()> {
    let prompt = args.prompt.ids()?;
    let model = open_model_ctx(&args.model, &args.engine)?;
    if prompt.len() > model.config().max_positions {
        bail!(
            "{} prompt tokens exceed the context of {} positions",
            prompt.len(),
            model.config().max_positions
        );
    }
    let opts = engine_options(&model, &args.engine, prompt.len(), HotChoice::None)?;
    let (mut engine, _) = open_engine(&model, opts, args.engine.trace.as_deref())?;
    let mut cache = engine.new_cache(prompt.len())?;
    let logits = engine.forward(&prompt, Phase::Prefill, &mut cache)?;
    let out = serde_json::json!({ "tokens": prompt, "logits": logits.rows() });
    out!("{}", serde_json::to_string(&out)?)?;
    write_perf(engine.as_ref(), &args.engine.perf_json)
}

fn generate(args: GenerateArgs) -> Result<()> {
    let prompt = args.prompt.ids()?;
    let sampling = args.sampling.params()?;
    let model = open_model_ctx(&args.model, &args.engine)?;
    // Before any work: prompt + new tokens must fit the context.
    moe_lanes::reference::check_generation_fits(
        prompt.len(),
        args.max_new_tokens,
        model.config().max_positions,
    )?;
    let opts = engine_options(&model, &args.engine, prompt.len() + args.max_new_tokens, HotChoice::None)?;
    let policy = opts.update;
    let (mut engine, _) = open_engine(&model, opts, args.engine.trace.as_deref())?;
    let mut live =
        LiveCache::new(engine.as_ref(), ModelFingerprint::of(&model), model.layer_expert_bytes(), policy);
    let gen_opts =
        GenerationOptions { max_tokens: args.max_new_tokens, stop_ids: args.stop_ids.clone(), sampling };
    live.begin_request();
    let mut session = Generation::new(engine.as_mut(), &prompt, gen_opts)?;
    let mut logprobs = Vec::new();
    // The online updater (--update auto) runs between tokens and after the request.
    while let Some(t) = session.next_token()? {
        logprobs.extend(t.logprobs.clone());
        live.after_tokens(session.engine_mut(), 1)?;
    }
    let finish = session.finish_reason().expect("the loop ran to the end");
    let mut out = serde_json::json!({ "tokens": session.generated(), "finish_reason": finish.openai() });
    if args.sampling.logprobs.is_some() {
        out["logprobs"] = serde_json::to_value(&logprobs)?;
    }
    live.end_request(session.engine_mut())?;
    drop(session);
    out!("{out}")?;
    write_perf(engine.as_ref(), &args.engine.perf_json)
}

fn learn(args: LearnArgs) -> Result<()> {
    check_output(&args.out, args.force, &[&args.model])?;
    let model = Arc::new(open_model(&args.model)?);
    let tokens = if args.tokens.is_empty() {
        moe_lanes::inspect::sample_tokens(model.config().vocab, args.n_tokens)
    } else {
        args.tokens.clone()
    };
    let mut opts = base_options(tokens.len())?;
    opts.kind = args.engine.as_deref().map(str::parse::<EngineKind>).transpose()?;
    if opts.kind == Some(EngineKind::Reference) {
        bail!("learn needs an engine with perf state: gpu or pipeline");
    }
    opts.cold_threads = cold_threads(&args.cold_threads)?;
    let (mut engine, _) = open_engine(&model, opts, None)?;
    let mut cache = engine.new_cache(tokens.len())?;
    engine.forward(&tokens, Phase::Prefill, &mut cache)?;
    write_perf(engine.as_ref(), &Some(args.out.clone()))?;
    eprintln!("learned {} tokens -> {}", tokens.len(), args.out.display());
    Ok(())
}

/// `--cold-threads auto|N`, parsed once into the library's type.
fn cold_threads(given: &str) -> Result<ColdThreads> {
    given
        .parse::<ColdThreads>()
        .map_err(|e| anyhow::anyhow!("--cold-threads {given}: expected auto or 1..={}", e.max))
}

/// Where the default synthetic model lives: `$MOE_LANES_HOME` or `~/.cache/moe-lanes`.
fn default_model_path() -> PathBuf {
    // An empty MOE_LANES_HOME is unset (not the current directory).
    let home = std::env::var_os("MOE_LANES_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let base = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
            base.join(".cache").join("moe-lanes")
        });
    home.join("default-qwen3moe-small.gguf")
}

/// The embedded default: a small Qwen3-MoE-shaped model with skewed routing.
fn default_model_options(out: PathBuf) -> Result<SynthOptions> {
    Ok(SynthOptions {
        adapter: adapter::by_name("qwen3_moe")?,
        preset: Preset::Tiny,
        dims: DimOverrides {
            n_layers: Some(4),
            hidden: Some(256),
            n_heads: Some(8),
            n_kv_heads: Some(2),
            head_dim: Some(32),
            vocab: Some(2048),
            n_experts: Some(32),
            n_experts_used: Some(4),
            expert_ff: Some(128),
            ..DimOverrides::default()
        },
        dtype: DType::BF16,
        seed: 42,
        skew: Skew::Skewed,
        format: SynthFormat::Gguf,
        out,
        vocab_from: None,
    })
}

fn demo(args: DemoArgs) -> Result<()> {
    let model = Arc::new(match args.model {
        Some(p) => open_model(&p)?,
        None => default_model()?,
    });
    out_raw!("{}", InspectReport::new(&model).to_text())?;
    let prompt = moe_lanes::inspect::sample_tokens(model.config().vocab, 8);
    let expected = Reference::new(&model)?.generate(&prompt, args.max_new_tokens)?;
    // Half of every layer's experts hot: on the GPU when one is usable, else on the CPU hot lane.
    let mut opts = base_options(prompt.len() + args.max_new_tokens)?;
    opts.kind = args.engine.as_deref().map(str::parse::<EngineKind>).transpose()?;
    opts.hot = HotChoice::Budget(HotBudget::Fraction(0.5));
    let (mut engine, _) = open_engine(&model, opts, None)?;
    let start = Instant::now();
    let tokens = engine.generate(&prompt, args.max_new_tokens)?;
    let seconds = start.elapsed().as_secs_f64();
    out!("prompt    {prompt:?}")?;
    out!("generated {tokens:?}")?;
    out!("matches the reference forward pass: {}", if tokens == expected { "yes" } else { "NO" })?;
    out!(
        "engine {} ({}): {} tokens generated in {:.3} s ({:.1} tokens/s; the {}-token prompt's processing included)",
        engine.kind(),
        engine.device(),
        tokens.len(),
        seconds,
        tokens.len() as f64 / seconds,
        prompt.len()
    )?;
    if tokens != expected {
        bail!("the engine's tokens differ from the reference: {tokens:?} vs {expected:?}");
    }
    Ok(())
}

/// The embedded default model: written on first use (concurrent first runs each write their own
/// temporary file and rename it into place), and written again if the cached copy is unreadable.
fn default_model() -> Result<Model> {
    let path = default_model_path();
    if path.exists() {
        match Model::open(&path) {
            // Written before synth gave its vocabulary the ChatML template: the same weights again,
            // with the template, so `serve` on it has a chat API.
            Ok(model) if !has_chat_template(&model) => {
                eprintln!(
                    "the cached default model {} has no chat template; writing it again",
                    path.display()
                )
            }
            Ok(model) => return Ok(model),
            Err(e) => {
                eprintln!("the cached default model {} is unreadable ({e}); writing it again", path.display())
            }
        }
    } else {
        std::fs::create_dir_all(path.parent().expect("has a parent"))
            .with_context(|| format!("cannot create {}", path.display()))?;
        eprintln!("first use: writing the default synthetic model to {}", path.display());
    }
    write_with_progress(&default_model_options(path.clone())?, None, None)?;
    open_model(&path)
}

fn has_chat_template(model: &Model) -> bool {
    moe_lanes::text::Tokenizer::from_model(model).is_ok_and(|t| t.chat_template().is_some())
}

fn bench_kernels(args: BenchKernelsArgs) -> Result<()> {
    use moe_lanes_kernels::bench::{run_kernel_bench, KernelBenchOptions};
    let simd = match args.simd {
        Some(name) => Some(
            name.parse::<moe_lanes_kernels::simd::SimdLevel>()
                .map_err(|e| anyhow::anyhow!("--simd {name}: {e}"))?,
        ),
        None => env::simd_override()?,
    };
    let dtype = match args.dtype {
        Some(name) => Some(moe_lanes_kernels::WeightDType::parse(&name).with_context(|| {
            format!(
                "--dtype {name}: expected bf16, f16, f32, q8_0, q4_0, q5_0, q5_1, iq4_nl, q4_k, q5_k, q6_k or mxfp4"
            )
        })?),
        None => None,
    };
    let activations = match args.activations {
        Some(name) => Some(name.parse().map_err(|e| anyhow::anyhow!("--activations {name}: {e}"))?),
        None => env::q8_activations()?,
    };
    if let Some(n) = args.threads {
        let max = moe_lanes_kernels::pool::MAX_POOL_THREADS;
        ensure!((1..=max).contains(&n), "--threads {n}: expected 1 to {max}");
    }
    let report = run_kernel_bench(KernelBenchOptions {
        threads: args.threads,
        simd,
        quick: args.quick,
        dtype,
        activations,
    })?;
    if args.json {
        out!("{}", report.to_json())?;
    } else {
        out_raw!("{}", report.to_text())?;
    }
    Ok(())
}

/// `bench --parallel`: the batched throughput table (or JSON).
fn bench_parallel(args: &BenchArgs, engine: &mut dyn Engine, parallel: &[usize]) -> Result<()> {
    use moe_lanes::bench_batched::{run_batched_bench, to_text, BatchedBenchOptions};
    let opts = BatchedBenchOptions {
        n_prompt_tokens: args.prompt_tokens,
        n_gen_tokens: args.gen_tokens,
        parallel: parallel.to_vec(),
        n_runs: args.runs,
    };
    let rows = run_batched_bench(engine, &opts)?;
    if let Some(text) = engine_profile(engine) {
        eprintln!("== stage profile (MOE_LANES_GPU_PROFILE, every call of every batch size) ==\n{text}");
    }
    if args.json {
        let json =
            serde_json::json!({"engine": engine.kind().name(), "device": engine.device(), "rows": rows});
        out!("{json}")?;
    } else {
        out_raw!("engine {} on {}\n{}", engine.kind(), engine.device(), to_text(&rows))?;
    }
    Ok(())
}

fn bench(args: BenchArgs) -> Result<()> {
    use moe_lanes::bench::{run_bench, BenchOptions};
    if args.metrics_ab {
        // Before the engine is built: its perf state registers its handles with the recorder.
        moe_lanes_server::install_metrics();
    }
    let model = open_model_ctx(&args.model, &args.engine)?;
    let n_positions = args.prompt_tokens.saturating_add(args.gen_tokens);
    let mut opts = engine_options(&model, &args.engine, n_positions, HotChoice::Budget(HotBudget::Auto))?;
    if let Some(parallel) = &args.parallel {
        opts.sequences = parallel.iter().copied().max().unwrap_or(1);
        let (mut engine, _) = open_engine(&model, opts, args.engine.trace.as_deref())?;
        return bench_parallel(&args, engine.as_mut(), parallel);
    }
    let budget = match opts.hot {
        HotChoice::Budget(b) => Some(b),
        _ => None,
    };
    let simd_name = moe_lanes::expert_math::cold_simd_level(opts.simd)?.name().to_string();
    let update_policy = opts.update;
    let (mut engine, build) = open_engine(&model, opts, args.engine.trace.as_deref())?;
    let locality = match args.scenario.as_deref() {
        None => None,
        Some("shift") => return bench_shift(&args, engine.as_mut(), &model, update_policy),
        Some(spec) if spec.starts_with("locality:") => Some(
            spec.parse::<moe_lanes::locality::LocalityParams>()
                .map_err(|e| anyhow::anyhow!("--scenario: {e}"))?,
        ),
        Some(other) => bail!("--scenario {other}: expected shift or locality:p=P,drift=R"),
    };
    let bench_opts = BenchOptions {
        n_prompt_tokens: args.prompt_tokens,
        n_gen_tokens: args.gen_tokens,
        n_runs: args.runs,
        depth: args.depth,
        budget,
        threads: build.threads,
        simd: simd_name,
        greedy: args.greedy,
        metrics_ab: args.metrics_ab,
        locality,
        update: update_policy,
    };
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} bench [{bar:30}] {pos}/{len} phases {elapsed}")
            .expect("valid template"),
    );
    let report = run_bench(engine.as_mut(), &build, &model, &bench_opts, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    });
    bar.finish_and_clear();
    let report = report?;
    if let Some(text) = engine_profile(engine.as_ref()) {
        let var = if engine.kind() == EngineKind::Pipeline { "CPU_PROFILE" } else { "GPU_PROFILE" };
        eprintln!("== stage profile (MOE_LANES_{var}, timed runs, warm-up excluded) ==\n{text}");
    }
    if args.json {
        out!("{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        out_raw!("{}", report.to_text())?;
    }
    write_perf(engine.as_ref(), &args.engine.perf_json)
}

fn engine_profile(engine: &dyn Engine) -> Option<String> {
    engine.profile_report()
}

/// `--weighting W --layer-curve C`.
fn weighting(mode: &str, layer_curve: f64) -> Result<Weighting> {
    let mode = mode.parse::<WeightMode>().map_err(|e| anyhow::anyhow!("--weighting: {e}"))?;
    Weighting::new(mode, layer_curve).context("--layer-curve")
}

fn plan(args: PlanArgs) -> Result<()> {
    use moe_lanes::cache::whatif::{what_if, PlanShape};
    let model = open_model_with_context(&args.model, args.ctx_size, ctx_kv_type(None, None))?;
    let c = model.config();
    if args.policies {
        return plan_policies(&args, &model);
    }
    let usage = args.learn.as_ref().or(args.trace.as_ref()).expect("clap requires --learn or --trace");
    let obs = read_learn_or_trace(usage, &ModelFingerprint::of(&model))?;
    let w = weighting(&args.weighting, args.layer_curve)?;
    let budget_bytes = plan_budget(&args, &model)?;
    let shape = PlanShape {
        n_layers: c.n_layers,
        n_experts: c.n_experts,
        n_experts_used: c.n_experts_used,
        layer_expert_bytes: model.layer_expert_bytes(),
    };
    let report = what_if(&obs, &w, shape, budget_bytes, args.sweep)?;
    if args.json {
        out!("{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        out_raw!("{}", report.to_text())?;
    }
    Ok(())
}

/// `plan`'s budget in bytes (`--hot-budget-mib`, -1: the device's free memory estimate).
fn plan_budget(args: &PlanArgs, model: &Model) -> Result<u64> {
    let c = model.config();
    let mib = args.hot_budget_mib.context("--hot-budget-mib is required")?;
    Ok(match budget_mib(mib)? {
        None => {
            let opts = base_options(c.max_positions)?;
            moe_lanes::engine::build::auto_budget_estimate(model, c.max_positions, &opts)
                .context("--hot-budget-mib -1")?
        }
        Some(bytes) => bytes,
    })
}

/// `plan --trace FILE --policies`: the trace replayed under every policy and Belady's optimum.
fn plan_policies(args: &PlanArgs, model: &Model) -> Result<()> {
    use moe_lanes::cache::replay::{replay, ReplayOptions, Steps};
    use moe_lanes::cache::whatif::CostModel;
    let c = model.config();
    let fingerprint = ModelFingerprint::of(model);
    let path = args.trace.as_ref().expect("clap requires --trace with --policies");
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    let (_, records) = moe_lanes::cache::trace::trace_records(path, &text, &fingerprint)?;
    let steps = Steps::from_records(&records, c.n_layers, c.n_experts);
    let fractions = if args.policy_fractions.is_empty() {
        // A budget past every expert's bytes holds them all.
        let all: u64 = model.layer_expert_bytes().iter().map(|b| b * c.n_experts as u64).sum();
        vec![(plan_budget(args, model)? as f64 / all.max(1) as f64).min(1.0)]
    } else {
        args.policy_fractions.clone()
    };
    if let Some(f) = fractions.iter().find(|f| !(0.0..=1.0).contains(*f)) {
        bail!("--policy-fractions: {f} is not a share in 0..=1");
    }
    let cost = match &args.calibration {
        Some(p) => Some(CostModel::calibrate(&read_learn_or_trace(p, &fingerprint)?.phases)),
        None => None,
    };
    let bytes = model.layer_expert_bytes();
    let calibration = cost.as_ref().map(|cm| (cm, bytes.as_slice(), c.n_experts_used));
    let reports: Vec<_> = fractions
        .iter()
        .map(|&fraction| {
            let mut opts = ReplayOptions { fraction, ..ReplayOptions::default() };
            opts.policy.lag_steps = args.policy_lag.into();
            replay(&steps, &opts, calibration)
        })
        .collect();
    if args.json {
        out!("{}", serde_json::to_string_pretty(&reports)?)?;
    } else {
        for r in &reports {
            out_raw!("{}\n", r.to_text())?;
        }
    }
    Ok(())
}

fn bench_shift(
    args: &BenchArgs,
    engine: &mut dyn Engine,
    model: &Model,
    update: moe_lanes::cache::update::UpdatePolicy,
) -> Result<()> {
    use moe_lanes::scenario::{run_shift, ShiftOptions};
    let &[first, second] = args.shift.as_slice() else {
        bail!("--shift: expected two domains, A,B");
    };
    let opts = ShiftOptions {
        n_domains: args.domains,
        domains: (first, second),
        n_requests: args.requests,
        n_prompt_tokens: args.prompt_tokens,
        n_gen_tokens: args.gen_tokens,
        update,
    };
    let bar = indicatif::ProgressBar::new(0);
    let report = run_shift(engine, model, &opts, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    });
    bar.finish_and_clear();
    let report = report?;
    if args.json {
        out!("{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        out_raw!("{}", report.to_text())?;
    }
    write_perf(engine, &args.engine.perf_json)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The engine flags of one `logits` command line.
    fn engine_args(flags: &[&str]) -> EngineArgs {
        let argv = ["moe-lanes", "logits", "--model", "m.gguf", "--tokens", "1"].iter().chain(flags);
        match Cli::try_parse_from(argv).expect("parses").command {
            Command::Logits(args) => args.engine,
            _ => unreachable!("a logits command line"),
        }
    }

    #[test]
    fn postfetch_flags_override_the_environment_defaults() {
        let mut o = moe_lanes::gpu::PostFetchOptions::default();
        postfetch_flags(&mut o, &engine_args(&[])).unwrap();
        assert!(!o.decode && o.block_on_miss, "defaults kept");
        let args = engine_args(&["--postfetch-decode", "true", "--postfetch-block-on-miss", "false"]);
        postfetch_flags(&mut o, &args).unwrap();
        assert!(o.decode && !o.block_on_miss);
        assert!(postfetch_flags(&mut o, &engine_args(&["--postfetch-streams", "9"])).is_err());
    }
}
