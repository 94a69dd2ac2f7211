//! The engine's tuning as configuration: a typed, serde-deserialisable section that the CLI reads
//! from `--engine-config FILE` (JSON) and that embedding code may build or deserialise itself.
//! Every field is optional: unset keeps the engine's default. The environment variables of
//! [`crate::env::engine_tuning`] are overrides of a file's values, read in that one place; the
//! CLI's flags (`--postfetch*`, `--activations`, `--cache-policy`) override both.
//!
//! ```json
//! {"gpu": {"prefill_attention": "tiled", "decode_graph": false, "hot_grouped_min_rows": 16},
//!  "cpu": {"cold_schedule": "phased", "reduce_merge": "off"},
//!  "postfetch": {"mode": "on", "scratch_mib": 2048, "decode": true}}
//! ```
//!
//! Every field is a choice whose question is still open or that depends on the machine: the
//! GPU's prefill kernels and decode graphs (benches/RESULTS.md has the A/B tables), the CPU's SIMD
//! level and cold-pool schedule (per host), the pipeline's merge and cold-reduce policies (equal
//! within rounding; the policy picks per call, the switch forces one for A/B), Post-Fetch's cost
//! model inputs (per machine: PCIe, host bandwidth).

use super::build::EngineOptions;
use crate::gpu::{GpuOptions, PostFetchMode, PostFetchOptions, PrefillActivations, PrefillAttention};
use crate::moe::phase::Switch;
use crate::moe::worklist::WorklistOrder;
use moe_lanes_kernels::pool::ColdSchedule;
use moe_lanes_kernels::{DecodeActivations, SimdLevel};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The GPU engine's tuning: the A/B choices whose question is still open (benches/RESULTS.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GpuTuning {
    /// Prefill attention: `mma` (default), `tiled` or `rows` (`MOE_LANES_GPU_ATTENTION`).
    pub prefill_attention: Option<PrefillAttention>,
    /// What the prefill GEMMs feed the tensor cores: `auto` (default), `split` or `bf16`
    /// (`MOE_LANES_PREFILL_ACTIVATIONS`).
    pub prefill_activations: Option<PrefillActivations>,
    /// Replay decode as CUDA graphs (default true; `MOE_LANES_GPU_GRAPH=0`).
    pub decode_graph: Option<bool>,
    /// Hot-lane events inside the decode graphs on every call (default false;
    /// `MOE_LANES_GRAPH_LANE_EVENTS=1`).
    pub graph_lane_events: Option<bool>,
    /// A decode call (a batched step) of at least this many tokens runs as GEMMs the dense
    /// projections the batched-decode GEMVs do not take ([`crate::gpu::GpuOptions`] says which)
    /// (`MOE_LANES_BATCH_GEMM_MIN_TOKENS`; default [`crate::gpu::BATCH_GEMM_MIN_TOKENS`]).
    pub batch_gemm_min_tokens: Option<usize>,
    /// A decode call (a batched step) of at least this many rows runs its hot experts as grouped
    /// GEMMs over a worklist sorted by expert (each read once per step) instead of per-entry
    /// GEMVs (`MOE_LANES_HOT_GROUPED_MIN_ROWS`; default [`crate::gpu::HOT_GROUPED_MIN_ROWS`]).
    pub hot_grouped_min_rows: Option<usize>,
    /// The same for a decode step over quantized hot slots
    /// (`MOE_LANES_HOT_GROUPED_MIN_ROWS_QUANTIZED`; default
    /// [`crate::gpu::HOT_GROUPED_MIN_ROWS_QUANTIZED`]).
    pub hot_grouped_min_rows_quantized: Option<usize>,
    /// Most tokens of one engine call; longer prompts run as consecutive calls of this many
    /// (default [`crate::gpu::MAX_CALL_TOKENS`], whose doc gives the scratch it costs).
    pub max_call_tokens: Option<usize>,
    /// A batched decode step of 2 to this many rows with cold experts runs as two micro-batches
    /// whose lanes ping-pong; 0: never (`MOE_LANES_PING_PONG_MAX_ROWS`; default
    /// [`crate::gpu::PING_PONG_MAX_ROWS`], off: its doc has the measurement).
    pub ping_pong_max_rows: Option<usize>,
    /// KV caches commit device memory as positions come (default true; `MOE_LANES_KV_PAGING=0`
    /// allocates each whole).
    pub kv_paging: Option<bool>,
}

impl GpuTuning {
    /// These settings with `over`'s wherever `over` has one (the environment over a file).
    pub fn overridden_by(self, over: GpuTuning) -> GpuTuning {
        GpuTuning {
            prefill_attention: over.prefill_attention.or(self.prefill_attention),
            prefill_activations: over.prefill_activations.or(self.prefill_activations),
            decode_graph: over.decode_graph.or(self.decode_graph),
            graph_lane_events: over.graph_lane_events.or(self.graph_lane_events),
            batch_gemm_min_tokens: over.batch_gemm_min_tokens.or(self.batch_gemm_min_tokens),
            hot_grouped_min_rows: over.hot_grouped_min_rows.or(self.hot_grouped_min_rows),
            hot_grouped_min_rows_quantized: over
                .hot_grouped_min_rows_quantized
                .or(self.hot_grouped_min_rows_quantized),
            max_call_tokens: over.max_call_tokens.or(self.max_call_tokens),
            ping_pong_max_rows: over.ping_pong_max_rows.or(self.ping_pong_max_rows),
            kv_paging: over.kv_paging.or(self.kv_paging),
        }
    }

    /// Set the options these settings name; the others keep their values.
    pub fn apply(&self, gpu: &mut GpuOptions) {
        let set = |slot: &mut bool, v: Option<bool>| *slot = v.unwrap_or(*slot);
        gpu.prefill_attention = self.prefill_attention.unwrap_or(gpu.prefill_attention);
        gpu.prefill_activations = self.prefill_activations.unwrap_or(gpu.prefill_activations);
        set(&mut gpu.decode_graph, self.decode_graph);
        set(&mut gpu.graph_lane_events, self.graph_lane_events);
        gpu.batch_gemm_min_tokens = self.batch_gemm_min_tokens.unwrap_or(gpu.batch_gemm_min_tokens);
        gpu.hot_grouped_min_rows = self.hot_grouped_min_rows.unwrap_or(gpu.hot_grouped_min_rows);
        gpu.hot_grouped_min_rows_quantized =
            self.hot_grouped_min_rows_quantized.unwrap_or(gpu.hot_grouped_min_rows_quantized);
        gpu.max_call_tokens = self.max_call_tokens.unwrap_or(gpu.max_call_tokens);
        gpu.ping_pong_max_rows = self.ping_pong_max_rows.unwrap_or(gpu.ping_pong_max_rows);
        set(&mut gpu.kv_paging, self.kv_paging);
    }
}

/// The CPU engines' tuning: the cold lane's kernels and pool, and the pipeline's A/B switches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CpuTuning {
    /// The cold lane's SIMD level: `scalar`, `avx2`, `avx512`, `avx512bf16`, `amx` (default: the
    /// best this CPU has; `MOE_LANES_SIMD`).
    pub simd: Option<SimdLevel>,
    /// The few-token tiles of quantised experts: `q8`, `f32` or `auto` (`MOE_LANES_Q8_ACTIVATIONS`).
    pub activations: Option<DecodeActivations>,
    /// The GPU engine's cold-pool schedule: `auto` (default), `phased`, `pipelined`
    /// (`MOE_LANES_COLD_SCHEDULE`).
    pub cold_schedule: Option<ColdSchedule>,
    /// The pipeline's worklist order: `token` or `expert` (default: by phase; `MOE_LANES_ORDER`).
    pub order: Option<WorklistOrder>,
    /// The pipeline's reduce-merge of slot rows: `off`, `on`, `auto` (`MOE_LANES_REDUCE_MERGE`).
    pub reduce_merge: Option<Switch>,
    /// The pipeline's compact cold reduce: `off`, `on`, `auto` (`MOE_LANES_COMPACT_COLD_REDUCE`).
    pub compact_cold_reduce: Option<Switch>,
}

impl CpuTuning {
    /// These settings with `over`'s wherever `over` has one.
    pub fn overridden_by(self, over: CpuTuning) -> CpuTuning {
        CpuTuning {
            simd: over.simd.or(self.simd),
            activations: over.activations.or(self.activations),
            cold_schedule: over.cold_schedule.or(self.cold_schedule),
            order: over.order.or(self.order),
            reduce_merge: over.reduce_merge.or(self.reduce_merge),
            compact_cold_reduce: over.compact_cold_reduce.or(self.compact_cold_reduce),
        }
    }

    /// Set the options these settings name; the others keep their values.
    pub fn apply(&self, opts: &mut EngineOptions) {
        opts.simd = self.simd.or(opts.simd);
        opts.activations = self.activations.or(opts.activations);
        opts.cold_schedule = self.cold_schedule.unwrap_or(opts.cold_schedule);
        let sw = &mut opts.pipeline.switches;
        sw.order = self.order.or(sw.order);
        sw.reduce_merge = self.reduce_merge.unwrap_or(sw.reduce_merge);
        if let Some(c) = self.compact_cold_reduce {
            sw.compact_cold_reduce = match c {
                Switch::On => Some(true),
                Switch::Off => Some(false),
                Switch::Auto => None,
            };
        }
    }
}

/// Post-Fetch's settings (`gpu::postfetch`): what the cost model may fetch and how.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PostFetchTuning {
    /// `auto` (default: the cost model decides), `on`, `off`, `cpu` (`MOE_LANES_POSTFETCH`).
    pub mode: Option<PostFetchMode>,
    /// Wait for a fetched expert whose copy is late (default true).
    pub block_on_miss: Option<bool>,
    /// Expert copies in flight at most (> 0).
    pub max_transfers: Option<usize>,
    /// VRAM of the scratchpad, MiB (decimals allowed; 0: off).
    pub scratch_mib: Option<f64>,
    /// Copy streams (1 to [`crate::gpu::POSTFETCH_MAX_STREAMS`]).
    pub streams: Option<usize>,
    /// Decode splits a layer's cold experts by the same cost model (default false).
    pub decode: Option<bool>,
    /// Copies read the registered model file's pages (default true; else staged).
    pub register: Option<bool>,
    /// A line per prefill layer with the decision, on stderr.
    pub debug: Option<bool>,
}

impl PostFetchTuning {
    /// These settings with `over`'s wherever `over` has one.
    pub fn overridden_by(self, over: PostFetchTuning) -> PostFetchTuning {
        PostFetchTuning {
            mode: over.mode.or(self.mode),
            block_on_miss: over.block_on_miss.or(self.block_on_miss),
            max_transfers: over.max_transfers.or(self.max_transfers),
            scratch_mib: over.scratch_mib.or(self.scratch_mib),
            streams: over.streams.or(self.streams),
            decode: over.decode.or(self.decode),
            register: over.register.or(self.register),
            debug: over.debug.or(self.debug),
        }
    }

    /// Set the options these settings name (each checked against its range first: a bad one
    /// changes nothing); the others keep their values.
    pub fn apply(&self, o: &mut PostFetchOptions) -> Result<(), TuningError> {
        let max = crate::gpu::POSTFETCH_MAX_STREAMS;
        let range = |field: &'static str, value: String, expected: &'static str| TuningError::Range {
            field,
            value,
            expected,
        };
        if let Some(n) = self.max_transfers.filter(|&n| n == 0) {
            return Err(range("postfetch.max_transfers", n.to_string(), "a count > 0"));
        }
        if let Some(n) = self.streams.filter(|n| !(1..=max).contains(n)) {
            return Err(range("postfetch.streams", n.to_string(), "1 to 4"));
        }
        if let Some(m) = self.scratch_mib.filter(|m| !m.is_finite() || *m < 0.0) {
            return Err(range("postfetch.scratch_mib", m.to_string(), "a size in MiB >= 0"));
        }
        o.mode = self.mode.unwrap_or(o.mode);
        o.block_on_miss = self.block_on_miss.unwrap_or(o.block_on_miss);
        o.max_transfers = self.max_transfers.unwrap_or(o.max_transfers);
        if let Some(mib) = self.scratch_mib {
            o.scratch_bytes = (mib * (1 << 20) as f64) as usize;
        }
        o.streams = self.streams.unwrap_or(o.streams);
        o.decode = self.decode.unwrap_or(o.decode);
        o.register = self.register.unwrap_or(o.register);
        o.debug = self.debug.unwrap_or(o.debug);
        Ok(())
    }
}

// `PostFetchTuning::apply`'s message names the bound.
const _: () = assert!(crate::gpu::POSTFETCH_MAX_STREAMS == 4);

/// Every engine's tuning section: the GPU engine's, the CPU engines', Post-Fetch's, and the
/// hot-cache policy of every engine with a hot cache (`{"cache_policy": {"kind": "lru",
/// "half_life": 16}}`, fields of [`crate::cache::policy::PolicyConfig`]; `--cache-policy`
/// overrides its kind).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineTuning {
    pub gpu: GpuTuning,
    pub cpu: CpuTuning,
    pub postfetch: PostFetchTuning,
    pub cache_policy: Option<crate::cache::policy::PolicyConfig>,
}

impl EngineTuning {
    /// These settings with `over`'s wherever `over` has one (the environment over a file).
    pub fn overridden_by(self, over: EngineTuning) -> EngineTuning {
        EngineTuning {
            gpu: self.gpu.overridden_by(over.gpu),
            cpu: self.cpu.overridden_by(over.cpu),
            postfetch: self.postfetch.overridden_by(over.postfetch),
            cache_policy: over.cache_policy.or(self.cache_policy),
        }
    }

    /// Set the engine options these settings name (the cache policy is the updater's: see
    /// [`EngineTuning::cache_policy`]); a setting out of range is an error and changes nothing.
    pub fn apply(&self, opts: &mut EngineOptions) -> Result<(), TuningError> {
        if let Some(n) = self.gpu.max_call_tokens.filter(|&n| n == 0) {
            let (field, expected) = ("gpu.max_call_tokens", "a count of tokens > 0");
            return Err(TuningError::Range { field, value: n.to_string(), expected });
        }
        let mut postfetch = opts.gpu.postfetch;
        self.postfetch.apply(&mut postfetch)?;
        self.gpu.apply(&mut opts.gpu);
        opts.gpu.postfetch = postfetch;
        self.cpu.apply(opts);
        Ok(())
    }
}

/// A tuning file that cannot be used, naming the file (and, from serde, the field and line).
#[derive(Debug, thiserror::Error)]
pub enum TuningError {
    #[error("{path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: {source}")]
    Parse { path: PathBuf, source: serde_json::Error },
    #[error("{field} = {value}: expected {expected}")]
    Range { field: &'static str, value: String, expected: &'static str },
}

impl EngineTuning {
    /// Read a JSON tuning file; unknown fields and values are errors naming them.
    pub fn read(path: &Path) -> Result<EngineTuning, TuningError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| TuningError::Read { path: path.into(), source })?;
        serde_json::from_str(&text).map_err(|source| TuningError::Parse { path: path.into(), source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_sets_what_it_names_and_the_environment_overrides_it() {
        let file: EngineTuning = serde_json::from_str(
            r#"{"gpu": {"prefill_attention": "rows", "decode_graph": false, "hot_grouped_min_rows": 3}}"#,
        )
        .unwrap();
        let env = GpuTuning { prefill_attention: Some(PrefillAttention::Tiled), ..GpuTuning::default() };
        let mut gpu = GpuOptions::default();
        let before = gpu.clone();
        file.gpu.overridden_by(env).apply(&mut gpu);
        assert_eq!(gpu.prefill_attention, PrefillAttention::Tiled, "the environment wins");
        assert!(!gpu.decode_graph);
        assert_eq!(gpu.hot_grouped_min_rows, 3);
        assert_eq!(gpu.prefill_activations, before.prefill_activations, "unset keeps the default");
        assert_eq!(gpu.graph_lane_events, before.graph_lane_events);
        let file: EngineTuning = serde_json::from_str(r#"{"gpu": {"max_call_tokens": 64}}"#).unwrap();
        file.gpu.apply(&mut gpu);
        assert_eq!(gpu.max_call_tokens, 64);
        assert!(gpu.kv_paging, "paged KV caches by default");
        let file: EngineTuning = serde_json::from_str(r#"{"gpu": {"kv_paging": false}}"#).unwrap();
        file.gpu.apply(&mut gpu);
        assert!(!gpu.kv_paging);
    }

    #[test]
    fn unknown_fields_and_values_are_refused_by_name() {
        let err = serde_json::from_str::<EngineTuning>(r#"{"gpu": {"decode_graphs": true}}"#).unwrap_err();
        assert!(err.to_string().contains("decode_graphs"), "{err}");
        let err =
            serde_json::from_str::<EngineTuning>(r#"{"gpu": {"prefill_attention": "fast"}}"#).unwrap_err();
        assert!(err.to_string().contains("fast") && err.to_string().contains("mma"), "{err}");
        assert_eq!(serde_json::from_str::<EngineTuning>("{}").unwrap(), EngineTuning::default());
        let t: EngineTuning = serde_json::from_str(r#"{"cache_policy": {"kind": "lfu"}}"#).unwrap();
        assert_eq!(t.cache_policy.unwrap().kind, crate::cache::policy::PolicyKind::Lfu);
        let err = serde_json::from_str::<EngineTuning>(r#"{"cache_policy": {"kind": "arc"}}"#).unwrap_err();
        assert!(err.to_string().contains("arc") && err.to_string().contains("tinylfu"), "{err}");
        let err = serde_json::from_str::<EngineTuning>(r#"{"cpu": {"simd": "neon"}}"#).unwrap_err();
        assert!(err.to_string().contains("neon") && err.to_string().contains("avx512"), "{err}");
        let err = serde_json::from_str::<EngineTuning>(r#"{"postfetch": {"scratch": 1}}"#).unwrap_err();
        assert!(err.to_string().contains("scratch") && err.to_string().contains("scratch_mib"), "{err}");
    }

    #[test]
    fn cpu_and_postfetch_sections_set_the_engine_options_under_the_environment() {
        let file: EngineTuning = serde_json::from_str(
            r#"{"cpu": {"simd": "avx2", "cold_schedule": "phased", "order": "expert", "reduce_merge": "off",
                        "compact_cold_reduce": "on"},
                "postfetch": {"mode": "on", "scratch_mib": 0.5, "streams": 2, "decode": true}}"#,
        )
        .unwrap();
        let env: EngineTuning = serde_json::from_str(r#"{"postfetch": {"mode": "cpu"}}"#).unwrap();
        let mut opts = EngineOptions::new(64);
        file.overridden_by(env).apply(&mut opts).unwrap();
        assert_eq!(opts.simd, Some(SimdLevel::Avx2));
        assert_eq!(opts.cold_schedule, ColdSchedule::Phased);
        let sw = opts.pipeline.switches;
        assert_eq!(
            (sw.order, sw.reduce_merge, sw.compact_cold_reduce),
            (Some(WorklistOrder::ExpertMajor), Switch::Off, Some(true))
        );
        let pf = opts.gpu.postfetch;
        assert_eq!(pf.mode, PostFetchMode::Cpu, "the environment wins");
        assert_eq!((pf.scratch_bytes, pf.streams, pf.decode), (1 << 19, 2, true));
        assert_eq!(pf.block_on_miss, PostFetchOptions::default().block_on_miss, "unset keeps the default");
    }

    #[test]
    fn settings_out_of_range_are_refused_and_change_nothing() {
        for (json, field) in [
            (r#"{"postfetch": {"streams": 9}}"#, "postfetch.streams"),
            (r#"{"postfetch": {"max_transfers": 0}}"#, "postfetch.max_transfers"),
            (r#"{"postfetch": {"scratch_mib": -1}, "cpu": {"simd": "scalar"}}"#, "postfetch.scratch_mib"),
            (r#"{"gpu": {"max_call_tokens": 0}, "cpu": {"simd": "scalar"}}"#, "gpu.max_call_tokens"),
        ] {
            let t: EngineTuning = serde_json::from_str(json).unwrap();
            let mut opts = EngineOptions::new(64);
            let before = (opts.gpu.postfetch, opts.simd);
            let err = t.apply(&mut opts).unwrap_err();
            assert!(err.to_string().contains(field), "{err}");
            assert_eq!((opts.gpu.postfetch, opts.simd), before, "{json}: nothing changed");
        }
    }
}
