//! Qwen3-MoE (`qwen3_moe`, GGUF `qwen3moe`): per-head q/k RMSNorm, softmax-then-top-k routing,
//! every layer a MoE.

use super::*;
use crate::model::config::{ConfigError, HfFields, ModelConfig};
use crate::model::{GgufMeta, ModelError};
use serde_json::{json, Map, Value};

pub(super) const ADAPTER: Adapter = Adapter {
    arch: Arch::Qwen3Moe,
    hf_model_type: "qwen3_moe",
    hf_class: "Qwen3MoeForCausalLM",
    gguf_arch: "qwen3moe",
    rope_style: RopeStyle::HalfSplit,
    gguf_rope_style: RopeStyle::HalfSplit,
    gguf_ffn_norm: "ffn_norm",
    shared_expert: false,
    hf_naming: HfNaming::Mlp,
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
        standard_attention(c, QkNorm::PerHead, false),
        standard_moe(c, RoutingVariant::SoftmaxThenTopK, None),
    )
}

fn hf_expert_dims(f: &HfFields<'_>) -> Result<ExpertDims, ConfigError> {
    Ok(ExpertDims {
        n_experts: f.expert_count()?,
        expert_ff: f.usize("moe_intermediate_size")?,
        shared_expert_ff: 0,
    })
}

fn gguf_expert_dims(meta: &GgufMeta<'_>, n_experts: usize) -> Result<ExpertDims, ModelError> {
    Ok(ExpertDims { n_experts, expert_ff: meta.usize("expert_feed_forward_length")?, shared_expert_ff: 0 })
}

/// The Qwen MoE family's fields (shared with `qwen2_moe`).
pub(super) fn hf_extra_fields(c: &ModelConfig, obj: &mut Map<String, Value>) {
    obj.insert("num_experts".into(), json!(c.n_experts));
    obj.insert("moe_intermediate_size".into(), json!(c.expert_ff));
    obj.insert("intermediate_size".into(), json!(c.expert_ff * c.n_experts_used));
    obj.insert("decoder_sparse_step".into(), json!(1));
    obj.insert("mlp_only_layers".into(), json!([]));
    obj.insert("use_sliding_window".into(), json!(false));
}
