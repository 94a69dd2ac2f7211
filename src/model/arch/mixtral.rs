//! Mixtral (`mixtral`; in GGUF llama.cpp's `llama` with experts): top-k-then-softmax routing,
//! an optional sliding window, and q/k rows permuted to GGML's interleaved RoPE in GGUF files.

use super::*;
use crate::model::config::{ConfigError, HfFields, ModelConfig};
use crate::model::{GgufMeta, ModelError};
use serde_json::{json, Map, Value};

pub(super) const ADAPTER: Adapter = Adapter {
    arch: Arch::Mixtral,
    hf_model_type: "mixtral",
    hf_class: "MixtralForCausalLM",
    gguf_arch: "llama",
    rope_style: RopeStyle::HalfSplit,
    gguf_rope_style: RopeStyle::Interleaved,
    gguf_ffn_norm: "ffn_norm",
    shared_expert: false,
    hf_naming: HfNaming::BlockSparseMoe,
    default_rope_theta: 1_000_000.0,
    gguf_default_norm_topk: true,
    hf_default_norm_topk: false,
    hybrid: HybridTraits::NONE,
    profile: DEFAULT_PROFILE,
    hf_expert_dims,
    gguf_expert_dims,
    hf_extra_fields,
    layer,
};

fn layer(c: &ModelConfig, _layer_idx: usize) -> LayerSpec {
    LayerSpec::new(
        standard_attention(c, QkNorm::None, false),
        standard_moe(c, RoutingVariant::TopKThenSoftmax, None),
    )
}

fn hf_expert_dims(f: &HfFields<'_>) -> Result<ExpertDims, ConfigError> {
    Ok(ExpertDims {
        n_experts: f.usize("num_local_experts")?,
        expert_ff: f.usize("intermediate_size")?,
        shared_expert_ff: 0,
    })
}

fn gguf_expert_dims(meta: &GgufMeta<'_>, n_experts: usize) -> Result<ExpertDims, ModelError> {
    Ok(ExpertDims { n_experts, expert_ff: meta.usize("feed_forward_length")?, shared_expert_ff: 0 })
}

fn hf_extra_fields(c: &ModelConfig, obj: &mut Map<String, Value>) {
    obj.insert("num_local_experts".into(), json!(c.n_experts));
    obj.insert("intermediate_size".into(), json!(c.expert_ff));
    obj.insert("sliding_window".into(), json!(c.sliding_window));
}
