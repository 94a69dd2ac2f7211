//! Qwen2-MoE (`qwen2_moe`, GGUF `qwen2moe`): q/k/v biases, softmax-then-top-k routing and a
//! shared expert scaled by its own sigmoid gate in every layer.

use super::*;
use crate::model::config::{ConfigError, HfFields, ModelConfig};
use crate::model::{GgufMeta, ModelError};
use serde_json::{json, Map, Value};

pub(super) const ADAPTER: Adapter = Adapter {
    arch: Arch::Qwen2Moe,
    hf_model_type: "qwen2_moe",
    hf_class: "Qwen2MoeForCausalLM",
    gguf_arch: "qwen2moe",
    rope_style: RopeStyle::HalfSplit,
    gguf_rope_style: RopeStyle::HalfSplit,
    gguf_ffn_norm: "ffn_norm",
    shared_expert: true,
    hf_naming: HfNaming::Mlp,
    default_rope_theta: 1_000_000.0,
    gguf_default_norm_topk: false,
    hf_default_norm_topk: false,
    hybrid: HybridTraits::NONE,
    profile: DEFAULT_PROFILE,
    hf_expert_dims,
    gguf_expert_dims,
    hf_extra_fields,
    layer,
};

fn layer(c: &ModelConfig, _layer_idx: usize) -> LayerSpec {
    let shared = SharedExpertSpec { ff: c.shared_expert_ff, gated: true };
    LayerSpec::new(
        standard_attention(c, QkNorm::None, true),
        standard_moe(c, RoutingVariant::SoftmaxThenTopK, Some(shared)),
    )
}

pub(super) fn hf_expert_dims(f: &HfFields<'_>) -> Result<ExpertDims, ConfigError> {
    Ok(ExpertDims {
        n_experts: f.expert_count()?,
        expert_ff: f.usize("moe_intermediate_size")?,
        shared_expert_ff: f.usize("shared_expert_intermediate_size")?,
    })
}

pub(super) fn gguf_expert_dims(meta: &GgufMeta<'_>, n_experts: usize) -> Result<ExpertDims, ModelError> {
    Ok(ExpertDims {
        n_experts,
        expert_ff: meta.usize("expert_feed_forward_length")?,
        shared_expert_ff: meta.usize("expert_shared_feed_forward_length")?,
    })
}

pub(super) fn hf_extra_fields(c: &ModelConfig, obj: &mut Map<String, Value>) {
    super::qwen3_moe::hf_extra_fields(c, obj);
    obj.insert("shared_expert_intermediate_size".into(), json!(c.shared_expert_ff));
}
