//! The environment variables moe-lanes honours, read in this one module. The library's engines
//! take typed options (the GPU engine's tuning also from a file: [`crate::engine::tuning`], which
//! these variables override); the CLI (the edge) calls these once and passes the values down, and
//! `kernels/` reads no environment at all. An embedding service may call them too, or not.
//!
//! | variable | effect |
//! |---|---|
//! | `MOE_LANES_SIMD` | force the cold lane's SIMD level (`scalar`, `avx2`, `avx512`, `avx512bf16`, `amx`) |
//! | `MOE_LANES_Q8_ACTIVATIONS` | the cold pool's few-token tiles of quantised experts (AVX-512 VNNI): `1` 8-bit activations for every quantised type, `0` f32, `auto` (the default with VNNI) 8-bit except for Q8_0 |
//! | `MOE_LANES_COLD_SCHEDULE` | the GPU engine's cold-pool schedule (`auto`, `phased`, `pipelined`) |
//! | `MOE_LANES_CUDA_DEVICE` | CUDA device ordinal: the GPU engine runs on this one device (default 0; `--devices` splits the layers over several) |
//! | `MOE_LANES_NVRTC_CACHE` | cubin cache (default `$XDG_CACHE_HOME/moe-lanes/nvrtc` or `~/.cache/moe-lanes/nvrtc`) |
//! | `CUDA_HOME`, `CUDA_PATH`, `CUDA_ROOT` | where NVRTC finds the CUDA headers |
//! | `MOE_LANES_PDL=0` | launch kernels without programmatic dependent launch (on by default where the GPU has it, sm_90+: a kernel's blocks are scheduled while the one before it finishes) |
//! | `MOE_LANES_GPU_PROFILE=1` | per-stage GPU profile in `bench` |
//! | `MOE_LANES_CPU_PROFILE=1` | per-stage profile of the CPU pipeline in `bench` ([`crate::moe::profile`]) |
//! | `MOE_LANES_GPU_GRAPH=0` | launch every decode kernel one by one instead of replaying the captured decode graph (all-hot models) or decode segments (models with cold experts) |
//! | `MOE_LANES_KV_PAGING=0` | allocate each GPU KV cache whole instead of committing its pages as positions come (on by default where the driver has virtual memory management) |
//! | `MOE_LANES_GRAPH_LANE_EVENTS=1` | the decode graphs record CUDA events around every all-hot layer's hot lane on every call (an A/B: the events stop programmatic dependent launch there); default: none in the graphs, one decode call in 64 runs eagerly and timed |
//! | `MOE_LANES_PREFILL_ACTIVATIONS` | what the GPU prefill GEMMs feed the tensor cores: `auto` (default: bf16 hi + lo for float weights; quantized ones 8-bit activations on int8 tensor cores where their type has int8 tiles (MXFP4 experts), one bf16 rounding elsewhere), `split` (hi + lo for every type), `bf16` (one bf16 rounding for every quantized type) |
//! | `MOE_LANES_GPU_ATTENTION` | the GPU prefill attention: `mma` (default, flash-style tiles of queries x keys on the tensor cores, bf16 hi + lo operands; heads of a multiple of 16 up to 128 dims on sm_80+, else `tiled`), `tiled` (the same tiles in f32 on the CUDA cores) or `rows` (one block per token and head) |
//! | `MOE_LANES_FAULT` | fault injection, e.g. `hot_error:1,gpu_lost:3` (see [`GpuFaults`]) |
//! | `MOE_LANES_VRAM_LIMIT_MIB` | simulate a smaller GPU for the budget |
//! | `MOE_LANES_ORDER`, `MOE_LANES_REDUCE_MERGE`, `MOE_LANES_COMPACT_COLD_REDUCE` | pipeline A/B switches ([`cpu_tuning`]) |
//! | `MOE_LANES_POSTFETCH` | Post-Fetch of cold experts in GPU prefill (bf16 and quantized files): `auto` (a cost model decides per expert), `on` (every cold expert that fits), `cpu` (scratchpad allocated, every expert on the CPU: A/B at equal VRAM), `off` (no scratchpad); default `auto` |
//! | `MOE_LANES_POSTFETCH_BLOCK_ON_MISS` | `1` (default): a fetched expert whose copy is still in flight when the CPU lane is done is waited for; `0`: the CPU computes it |
//! | `MOE_LANES_POSTFETCH_MAX_TRANSFERS` | expert copies in flight at most; the layer's other chosen experts run on the CPU (default 256) |
//! | `MOE_LANES_POSTFETCH_SCRATCH_MIB` | VRAM of the scratchpad (default 1024; decimals allowed; at least one expert, at most the cold experts of the layer with the most; 0: off) |
//! | `MOE_LANES_POSTFETCH_STREAMS` | copy streams (default 1, at most 4) |
//! | `MOE_LANES_POSTFETCH_DEBUG=1` | a line per prefill layer with the decision (stderr) |
//! | `MOE_LANES_POSTFETCH_DECODE` | `1`: decode splits a layer's cold experts between the CPU lane and copies to the scratchpad by the same cost model; `0` (default): decode keeps every cold expert on the CPU |
//! | `MOE_LANES_POSTFETCH_REGISTER` | `1` (default): copies read the model file's pages, registered with the device (read-only) once at engine start; `0`, or when the driver refuses: staged through pinned buffers |

use crate::engine::tuning::{CpuTuning, EngineTuning, GpuTuning, PostFetchTuning};
use crate::gpu::{GpuFaults, PrefillActivations, PrefillAttention, POSTFETCH_MAX_STREAMS};
use crate::moe::phase::Switch;
use crate::moe::worklist::WorklistOrder;
use moe_lanes_kernels::cuda::CudaConfig;
use moe_lanes_kernels::pool::ColdSchedule;
use moe_lanes_kernels::{DecodeActivations, SimdLevel};
use std::path::PathBuf;

/// A variable set to a value it cannot take.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("{var}={value}: expected {expected}")]
pub struct EnvError {
    pub var: &'static str,
    pub value: String,
    pub expected: &'static str,
}

fn var(name: &'static str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn bad(var: &'static str, value: &str, expected: &'static str) -> EnvError {
    EnvError { var, value: value.to_string(), expected }
}

/// A count variable (unset: `None`); anything but a whole number is an error naming it.
fn count(name: &'static str, expected: &'static str) -> Result<Option<usize>, EnvError> {
    var(name).map(|v| v.parse::<usize>().map_err(|_| bad(name, &v, expected))).transpose()
}

/// `MOE_LANES_SIMD`, parsed (whether this CPU has it is checked where the level is used).
pub fn simd_override() -> Result<Option<SimdLevel>, EnvError> {
    var("MOE_LANES_SIMD")
        .map(|v| {
            SimdLevel::parse(&v)
                .map_err(|_| bad("MOE_LANES_SIMD", &v, "scalar, avx2, avx512, avx512bf16 or amx"))
        })
        .transpose()
}

/// `MOE_LANES_Q8_ACTIVATIONS`: `1` Q8, `0` F32, `auto` Auto; unset `None` (the level's default).
pub fn q8_activations() -> Result<Option<DecodeActivations>, EnvError> {
    var("MOE_LANES_Q8_ACTIVATIONS")
        .map(|v| match v.trim() {
            "1" => Ok(DecodeActivations::Q8),
            "0" => Ok(DecodeActivations::F32),
            "auto" => Ok(DecodeActivations::Auto),
            _ => Err(bad("MOE_LANES_Q8_ACTIVATIONS", &v, "0, 1 or auto")),
        })
        .transpose()
}

/// `MOE_LANES_COLD_SCHEDULE` (an unknown value is an error; unset `None`: `auto`).
pub fn cold_schedule() -> Result<Option<ColdSchedule>, EnvError> {
    var("MOE_LANES_COLD_SCHEDULE")
        .map(|v| {
            ColdSchedule::parse(&v)
                .ok_or_else(|| bad("MOE_LANES_COLD_SCHEDULE", &v, "auto, phased or pipelined"))
        })
        .transpose()
}

/// `MOE_LANES_CUDA_DEVICE` as the GPU engine's device list (`GpuOptions::devices`): the one
/// device it names, or `None` when unset (device 0).
pub fn cuda_devices() -> Result<Option<Vec<usize>>, EnvError> {
    var("MOE_LANES_CUDA_DEVICE")
        .map(|v| v.parse().map(|d| vec![d]).map_err(|_| bad("MOE_LANES_CUDA_DEVICE", &v, "a device number")))
        .transpose()
}

/// `MOE_LANES_CUDA_DEVICE`, `MOE_LANES_NVRTC_CACHE` (or the XDG / home cache), CUDA headers,
/// `MOE_LANES_PDL` (`0` or `1`; unset: on).
pub fn cuda_config() -> Result<CudaConfig, EnvError> {
    let device_ordinal = match var("MOE_LANES_CUDA_DEVICE") {
        None => 0,
        Some(v) => v.parse().map_err(|_| bad("MOE_LANES_CUDA_DEVICE", &v, "a device number"))?,
    };
    let nvrtc_cache_dir = var("MOE_LANES_NVRTC_CACHE")
        .map(PathBuf::from)
        .or_else(|| var("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("moe-lanes/nvrtc")))
        .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache/moe-lanes/nvrtc")));
    let cuda_include_dir = ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"]
        .into_iter()
        .filter_map(var)
        .map(|d| PathBuf::from(d).join("include"))
        .find(|p| p.join("cuda_bf16.h").exists());
    let programmatic_launch = match var("MOE_LANES_PDL").as_deref().map(str::trim) {
        None | Some("1") => true,
        Some("0") => false,
        Some(v) => return Err(bad("MOE_LANES_PDL", v, "0 or 1")),
    };
    Ok(CudaConfig { device_ordinal, nvrtc_cache_dir, cuda_include_dir, programmatic_launch })
}

/// `MOE_LANES_GPU_PROFILE` set to anything but `0`.
pub fn gpu_profile() -> bool {
    var("MOE_LANES_GPU_PROFILE").is_some_and(|v| v != "0")
}

/// `MOE_LANES_CPU_PROFILE` set to anything but `0`.
pub fn cpu_profile() -> bool {
    var("MOE_LANES_CPU_PROFILE").is_some_and(|v| v != "0")
}

/// `MOE_LANES_FAULT`.
pub fn faults() -> Result<GpuFaults, EnvError> {
    match var("MOE_LANES_FAULT") {
        None => Ok(GpuFaults::default()),
        Some(v) => v.parse().map_err(|_| bad("MOE_LANES_FAULT", &v, "NAME:N[,NAME:N...] (see GpuFaults)")),
    }
}

/// `MOE_LANES_VRAM_LIMIT_MIB`, in bytes.
pub fn vram_limit_bytes() -> Result<Option<u64>, EnvError> {
    var("MOE_LANES_VRAM_LIMIT_MIB")
        .map(|v| {
            v.parse::<u64>()
                .map(|mib| mib << 20)
                .map_err(|_| bad("MOE_LANES_VRAM_LIMIT_MIB", &v, "a size in MiB"))
        })
        .transpose()
}

/// The GPU engine's tuning from the environment, each variable an override of a tuning file's
/// value (unset: `None`): `MOE_LANES_GPU_ATTENTION` (`mma`, `tiled`, `rows`),
/// `MOE_LANES_PREFILL_ACTIVATIONS` (`auto`, `split`, `bf16`), `MOE_LANES_GPU_GRAPH` (`0` off),
/// `MOE_LANES_GRAPH_LANE_EVENTS` (`1` on), `MOE_LANES_KV_PAGING` (`0` off),
/// `MOE_LANES_BATCH_GEMM_MIN_TOKENS` and
/// `MOE_LANES_HOT_GROUPED_MIN_ROWS`, `MOE_LANES_HOT_GROUPED_MIN_ROWS_QUANTIZED` and
/// `MOE_LANES_PING_PONG_MAX_ROWS` (counts).
pub fn gpu_tuning() -> Result<GpuTuning, EnvError> {
    let prefill_attention = match var("MOE_LANES_GPU_ATTENTION").as_deref() {
        None => None,
        Some("mma") => Some(PrefillAttention::Mma),
        Some("tiled") => Some(PrefillAttention::Tiled),
        Some("rows") => Some(PrefillAttention::PerRow),
        Some(v) => return Err(bad("MOE_LANES_GPU_ATTENTION", v, "mma, tiled or rows")),
    };
    let prefill_activations = match var("MOE_LANES_PREFILL_ACTIVATIONS").as_deref() {
        None => None,
        Some("auto") => Some(PrefillActivations::Auto),
        Some("split") => Some(PrefillActivations::Split),
        Some("bf16") => Some(PrefillActivations::Bf16),
        Some(v) => return Err(bad("MOE_LANES_PREFILL_ACTIVATIONS", v, "auto, split or bf16")),
    };
    let batch_gemm_min_tokens = count("MOE_LANES_BATCH_GEMM_MIN_TOKENS", "a token count")?;
    let hot_grouped_min_rows = count("MOE_LANES_HOT_GROUPED_MIN_ROWS", "a row count")?;
    let hot_grouped_min_rows_quantized = count("MOE_LANES_HOT_GROUPED_MIN_ROWS_QUANTIZED", "a row count")?;
    let ping_pong_max_rows = count("MOE_LANES_PING_PONG_MAX_ROWS", "a row count")?;
    Ok(GpuTuning {
        prefill_attention,
        prefill_activations,
        decode_graph: var("MOE_LANES_GPU_GRAPH").map(|v| v != "0"),
        graph_lane_events: var("MOE_LANES_GRAPH_LANE_EVENTS").map(|v| v == "1"),
        batch_gemm_min_tokens,
        hot_grouped_min_rows,
        hot_grouped_min_rows_quantized,
        max_call_tokens: None, // the tuning file's (no variable)
        ping_pong_max_rows,
        kv_paging: var("MOE_LANES_KV_PAGING").map(|v| v != "0"),
    })
}

/// Every engine's tuning from the environment, each variable an override of a tuning file's
/// value (unset: `None`): [`gpu_tuning`], [`cpu_tuning`], [`postfetch_tuning`].
pub fn engine_tuning() -> Result<EngineTuning, EnvError> {
    Ok(EngineTuning {
        gpu: gpu_tuning()?,
        cpu: cpu_tuning()?,
        postfetch: postfetch_tuning()?,
        cache_policy: None,
    })
}

/// The CPU engines' tuning: `MOE_LANES_SIMD`, `MOE_LANES_Q8_ACTIVATIONS`,
/// `MOE_LANES_COLD_SCHEDULE`, and the pipeline's A/B switches (`MOE_LANES_REDUCE_MERGE`,
/// `MOE_LANES_COMPACT_COLD_REDUCE`: `off|on|auto`; `MOE_LANES_ORDER`: `token|expert`). A value
/// outside those is an error.
pub fn cpu_tuning() -> Result<CpuTuning, EnvError> {
    let switch = |name: &'static str| -> Result<Option<Switch>, EnvError> {
        var(name).map(|v| v.parse::<Switch>().map_err(|_| bad(name, &v, "off, on or auto"))).transpose()
    };
    let order = match var("MOE_LANES_ORDER") {
        None => None,
        Some(v) => Some(match v.as_str() {
            "token" => WorklistOrder::TokenMajor,
            "expert" => WorklistOrder::ExpertMajor,
            _ => return Err(bad("MOE_LANES_ORDER", &v, "token or expert")),
        }),
    };
    Ok(CpuTuning {
        simd: simd_override()?,
        activations: q8_activations()?,
        cold_schedule: cold_schedule()?,
        order,
        reduce_merge: switch("MOE_LANES_REDUCE_MERGE")?,
        compact_cold_reduce: switch("MOE_LANES_COMPACT_COLD_REDUCE")?,
    })
}

/// A size in MiB (decimals allowed) as bytes.
pub fn parse_mib(v: &str) -> Option<usize> {
    v.trim()
        .parse::<f64>()
        .ok()
        .filter(|m| m.is_finite() && *m >= 0.0)
        .map(|m| (m * (1 << 20) as f64) as usize)
}

/// A flag value: `1`/`on`/`true` or `0`/`off`/`false`.
pub fn parse_flag(v: &str) -> Option<bool> {
    match v.trim() {
        "1" | "on" | "true" => Some(true),
        "0" | "off" | "false" => Some(false),
        _ => None,
    }
}

// the message of `MOE_LANES_POSTFETCH_STREAMS` names the bound
const _: () = assert!(POSTFETCH_MAX_STREAMS == 4);

/// `MOE_LANES_POSTFETCH*`, each an override (unset: `None`).
pub fn postfetch_tuning() -> Result<PostFetchTuning, EnvError> {
    let flag = |name: &'static str| -> Result<Option<bool>, EnvError> {
        var(name).map(|v| parse_flag(&v).ok_or_else(|| bad(name, &v, "0 or 1"))).transpose()
    };
    let mode = var("MOE_LANES_POSTFETCH")
        .map(|v| v.parse().map_err(|_| bad("MOE_LANES_POSTFETCH", &v, "auto, on, off or cpu")))
        .transpose()?;
    let max_transfers = var("MOE_LANES_POSTFETCH_MAX_TRANSFERS")
        .map(|v| {
            let n = v.parse::<usize>().ok().filter(|&n| n > 0);
            n.ok_or_else(|| bad("MOE_LANES_POSTFETCH_MAX_TRANSFERS", &v, "a count > 0"))
        })
        .transpose()?;
    let scratch_mib = var("MOE_LANES_POSTFETCH_SCRATCH_MIB")
        .map(|v| {
            let mib = v.trim().parse::<f64>().ok().filter(|m| m.is_finite() && *m >= 0.0);
            mib.ok_or_else(|| bad("MOE_LANES_POSTFETCH_SCRATCH_MIB", &v, "a size in MiB"))
        })
        .transpose()?;
    let streams = var("MOE_LANES_POSTFETCH_STREAMS")
        .map(|v| {
            let n = v.parse::<usize>().ok().filter(|n| (1..=POSTFETCH_MAX_STREAMS).contains(n));
            n.ok_or_else(|| bad("MOE_LANES_POSTFETCH_STREAMS", &v, "1 to 4"))
        })
        .transpose()?;
    Ok(PostFetchTuning {
        mode,
        block_on_miss: flag("MOE_LANES_POSTFETCH_BLOCK_ON_MISS")?,
        max_transfers,
        scratch_mib,
        streams,
        decode: flag("MOE_LANES_POSTFETCH_DECODE")?,
        register: flag("MOE_LANES_POSTFETCH_REGISTER")?,
        debug: flag("MOE_LANES_POSTFETCH_DEBUG")?,
    })
}

#[cfg(test)]
mod postfetch_tests {
    use super::*;

    #[test]
    fn mib_and_flags_parse() {
        assert_eq!(parse_mib("1024"), Some(1 << 30));
        assert_eq!(parse_mib("0.5"), Some(1 << 19));
        assert_eq!(parse_mib("-1"), None);
        assert_eq!(parse_mib("x"), None);
        assert_eq!((parse_flag("1"), parse_flag("off"), parse_flag("yes")), (Some(true), Some(false), None));
    }
}
