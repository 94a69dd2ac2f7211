//! OLMoE (`olmoe`): RMSNorm over the whole q and k projections, optional q/k/v clipping,
//! softmax-then-top-k routing.

use super::*;
use crate::model::config::{ConfigError, HfFields, ModelConfig};
use crate::model::{GgufMeta, ModelError};
use serde_json::{json, Map, Value};

pub(super) const ADAPTER: Adapter = Adapter {
    arch: Arch::Olmoe,
    hf_model_type: "olmoe",
    hf_class: "OlmoeForCausalLM",
    gguf_arch: "olmoe",
    rope_style: RopeStyle::HalfSplit,
    gguf_rope_style: RopeStyle::HalfSplit,
    gguf_ffn_norm: "ffn_norm",
    shared_expert: false,
    hf_naming: HfNaming::Mlp,
    default_rope_theta: 10_000.0,
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
    LayerSpec::new(
        standard_attention(c, QkNorm::WholeProjection, false),
        standard_moe(c, RoutingVariant::SoftmaxThenTopK, None),
    )
}

fn hf_expert_dims(f: &HfFields<'_>) -> Result<ExpertDims, ConfigError> {
    Ok(ExpertDims {
        n_experts: f.expert_count()?,
        expert_ff: f.usize("intermediate_size")?,
        shared_expert_ff: 0,
    })
}

fn gguf_expert_dims(meta: &GgufMeta<'_>, n_experts: usize) -> Result<ExpertDims, ModelError> {
    Ok(ExpertDims { n_experts, expert_ff: meta.usize("feed_forward_length")?, shared_expert_ff: 0 })
}

fn hf_extra_fields(c: &ModelConfig, obj: &mut Map<String, Value>) {
    obj.insert("num_experts".into(), json!(c.n_experts));
    obj.insert("intermediate_size".into(), json!(c.expert_ff));
    obj.insert("clip_qkv".into(), json!(c.clip_qkv));
}
