//! The engine's tuning as configuration: a typed, serde-deserialisable section that the CLI reads
//! from `--engine-config FILE` (JSON) and that embedding code may build or deserialise itself.
//! Every field is optional: unset keeps the engine's default. The environment variables of
//! [`crate::env::gpu_tuning`] are overrides of a file's values, read in that one place.
//!
//! ```json
//! {"gpu": {"prefill_attention": "tiled", "decode_graph": false, "hot_dequant_mib": 512}}
//! ```

use crate::gpu::{GpuOptions, PrefillActivations, PrefillAttention};
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
    /// VRAM for quantized hot slots dequantized to bf16 before the grouped prefill GEMMs, MiB
    /// (default 0: the GEMMs decode tiles themselves; `MOE_LANES_HOT_DEQUANT_MIB`).
    pub hot_dequant_mib: Option<usize>,
    /// Dequantize those chunks on the side stream (default false; `MOE_LANES_HOT_DEQUANT_OVERLAP`).
    pub hot_dequant_overlap: Option<bool>,
    /// A decode call (a batched step) of at least this many tokens runs its dense projections
    /// and lm_head as GEMMs (each weight read once for all rows) instead of per-row GEMVs
    /// (`MOE_LANES_BATCH_GEMM_MIN_TOKENS`; default [`crate::gpu::BATCH_GEMM_MIN_TOKENS`]).
    pub batch_gemm_min_tokens: Option<usize>,
}

impl GpuTuning {
    /// These settings with `over`'s wherever `over` has one (the environment over a file).
    pub fn overridden_by(self, over: GpuTuning) -> GpuTuning {
        GpuTuning {
            prefill_attention: over.prefill_attention.or(self.prefill_attention),
            prefill_activations: over.prefill_activations.or(self.prefill_activations),
            decode_graph: over.decode_graph.or(self.decode_graph),
            graph_lane_events: over.graph_lane_events.or(self.graph_lane_events),
            hot_dequant_mib: over.hot_dequant_mib.or(self.hot_dequant_mib),
            hot_dequant_overlap: over.hot_dequant_overlap.or(self.hot_dequant_overlap),
            batch_gemm_min_tokens: over.batch_gemm_min_tokens.or(self.batch_gemm_min_tokens),
        }
    }

    /// Set the options these settings name; the others keep their values.
    pub fn apply(&self, gpu: &mut GpuOptions) {
        let set = |slot: &mut bool, v: Option<bool>| *slot = v.unwrap_or(*slot);
        gpu.prefill_attention = self.prefill_attention.unwrap_or(gpu.prefill_attention);
        gpu.prefill_activations = self.prefill_activations.unwrap_or(gpu.prefill_activations);
        set(&mut gpu.decode_graph, self.decode_graph);
        set(&mut gpu.graph_lane_events, self.graph_lane_events);
        set(&mut gpu.hot_dequant_overlap, self.hot_dequant_overlap);
        if let Some(mib) = self.hot_dequant_mib {
            gpu.hot_dequant_bytes = mib << 20;
        }
        gpu.batch_gemm_min_tokens = self.batch_gemm_min_tokens.unwrap_or(gpu.batch_gemm_min_tokens);
    }
}

/// Every engine's tuning section: the GPU engine's, and the hot-cache policy of every engine
/// with a hot cache (`{"cache_policy": {"kind": "lru", "half_life": 16}}`, fields of
/// [`crate::cache::policy::PolicyConfig`]; `--cache-policy` overrides its kind).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineTuning {
    pub gpu: GpuTuning,
    pub cache_policy: Option<crate::cache::policy::PolicyConfig>,
}

/// A tuning file that cannot be used, naming the file (and, from serde, the field and line).
#[derive(Debug, thiserror::Error)]
pub enum TuningError {
    #[error("{path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: {source}")]
    Parse { path: PathBuf, source: serde_json::Error },
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
            r#"{"gpu": {"prefill_attention": "rows", "decode_graph": false, "hot_dequant_mib": 3}}"#,
        )
        .unwrap();
        let env = GpuTuning { prefill_attention: Some(PrefillAttention::Tiled), ..GpuTuning::default() };
        let mut gpu = GpuOptions::default();
        let before = gpu;
        file.gpu.overridden_by(env).apply(&mut gpu);
        assert_eq!(gpu.prefill_attention, PrefillAttention::Tiled, "the environment wins");
        assert!(!gpu.decode_graph);
        assert_eq!(gpu.hot_dequant_bytes, 3 << 20);
        assert_eq!(gpu.prefill_activations, before.prefill_activations, "unset keeps the default");
        assert_eq!(gpu.graph_lane_events, before.graph_lane_events);
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
    }
}
