//! GPT-OSS (`gpt_oss`, GGUF `gpt-oss`): sliding-window (even layers) and full attention (odd
//! layers) with learned per-head sinks, biases on q/k/v/o and YaRN RoPE; a router with a bias
//! whose top-k logits are softmaxed; experts with biases and the clamped SwiGLU
//! (`alpha` 1.702, `limit` 7).

use super::*;
use crate::model::config::{ConfigError, HfFields, ModelConfig};
use crate::model::{GgufMeta, ModelError};
use serde_json::{json, Map, Value};

pub(super) const ADAPTER: Adapter = Adapter {
    arch: Arch::GptOss,
    hf_model_type: "gpt_oss",
    hf_class: "GptOssForCausalLM",
    gguf_arch: "gpt-oss",
    rope_style: RopeStyle::HalfSplit,
    gguf_rope_style: RopeStyle::HalfSplit,
    gguf_ffn_norm: "post_attention_norm",
    shared_expert: false,
    hf_naming: HfNaming::GptOss,
    default_rope_theta: 150_000.0,
    gguf_default_norm_topk: false,
    hf_default_norm_topk: false,
    hybrid: HybridTraits::NONE,
    profile: DEFAULT_PROFILE,
    hf_expert_dims,
    gguf_expert_dims,
    hf_extra_fields,
    layer,
};

fn layer(c: &ModelConfig, layer_idx: usize) -> LayerSpec {
    let Mixer::Attention(mut attention) = standard_attention(c, QkNorm::None, true) else {
        unreachable!("standard_attention builds attention")
    };
    attention.o_bias = true;
    attention.sinks = true;
    attention.window = c.window_of(layer_idx);
    let Ffn::Moe(mut moe) = standard_moe(c, RoutingVariant::TopKThenSoftmax, None) else {
        unreachable!("standard_moe builds a MoE")
    };
    moe.router.bias = true;
    moe.expert_bias = true;
    moe.activation = FfnActivation::SwigluOai;
    LayerSpec::new(Mixer::Attention(attention), Ffn::Moe(moe))
}

fn hf_expert_dims(f: &HfFields<'_>) -> Result<ExpertDims, ConfigError> {
    Ok(ExpertDims {
        n_experts: f.expert_count()?,
        expert_ff: f.usize("intermediate_size")?,
        shared_expert_ff: 0,
    })
}

fn gguf_expert_dims(meta: &GgufMeta<'_>, n_experts: usize) -> Result<ExpertDims, ModelError> {
    Ok(ExpertDims { n_experts, expert_ff: meta.usize("expert_feed_forward_length")?, shared_expert_ff: 0 })
}

fn hf_extra_fields(c: &ModelConfig, obj: &mut Map<String, Value>) {
    obj.insert("num_local_experts".into(), json!(c.n_experts));
    obj.insert("intermediate_size".into(), json!(c.expert_ff));
    obj.insert("swiglu_alpha".into(), json!(1.702));
    obj.insert("swiglu_limit".into(), json!(7.0));
    obj.insert("attention_bias".into(), json!(true));
    obj.insert("sliding_window".into(), json!(c.sliding_window));
    let types: Vec<&str> = (0..c.n_layers)
        .map(|l| if c.window_of(l).is_some() { "sliding_attention" } else { "full_attention" })
        .collect();
    obj.insert("layer_types".into(), json!(types));
    obj.remove("rope_theta");
    let mut rope = json!({"rope_type": "default", "rope_theta": c.rope_theta});
    if let Some(y) = c.yarn {
        rope = json!({
            "rope_type": "yarn", "rope_theta": c.rope_theta, "factor": y.factor,
            "original_max_position_embeddings": y.original_context, "beta_fast": y.beta_fast,
            "beta_slow": y.beta_slow, "truncate": y.truncate,
        });
    }
    obj.insert("rope_parameters".into(), rope);
    obj.remove("norm_topk_prob");
}
