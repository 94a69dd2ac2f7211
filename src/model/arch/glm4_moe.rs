//! GLM-4.5 / 4.6 (`glm4_moe`, GGUF `glm4moe`): grouped-query attention with q/k/v biases, an
//! optional per-head q/k norm (`use_qk_norm`) and RoPE on the first half of each head
//! (`partial_rotary_factor` 0.5, half-split pairs in both formats); the first
//! `first_k_dense_replace` layers a dense FFN, the others a MoE with DeepSeek-V3's sigmoid routing
//! (selection bias for the choice only, group-limited top-k, renormalised, times
//! `routed_scaling_factor`) beside an ungated shared expert. The NextN/MTP layers
//! (`num_nextn_predict_layers`) are loaded and not run.

use super::*;
use crate::model::config::{ConfigError, DenseLayers, HfFields, ModelConfig, SigmoidRouting};
use serde_json::{json, Map, Value};

pub(super) const ADAPTER: Adapter = Adapter {
    arch: Arch::Glm4Moe,
    hf_model_type: "glm4_moe",
    hf_class: "Glm4MoeForCausalLM",
    gguf_arch: "glm4moe",
    // transformers' `rotate_half` on the rotated part; llama.cpp's `LLAMA_ROPE_TYPE_NEOX`.
    rope_style: RopeStyle::HalfSplit,
    gguf_rope_style: RopeStyle::HalfSplit,
    // llama.cpp's glm4moe keeps transformers' name (`LLM_TENSOR_ATTN_POST_NORM`).
    gguf_ffn_norm: "post_attention_norm",
    shared_expert: true,
    hf_naming: HfNaming::SharedExperts,
    default_rope_theta: 10_000.0,
    gguf_default_norm_topk: false,
    hf_default_norm_topk: true,
    hybrid: HybridTraits { default_partial_rotary: 0.5, ..HybridTraits::NONE },
    profile: DEFAULT_PROFILE,
    hf_expert_dims,
    gguf_expert_dims: super::deepseek_v3::gguf_expert_dims,
    hf_extra_fields,
    layer,
};

fn layer(c: &ModelConfig, layer_idx: usize) -> LayerSpec {
    let qk_norm = if c.qk_norm { QkNorm::PerHead } else { QkNorm::None };
    let mixer = standard_attention(c, qk_norm, c.attention_bias);
    LayerSpec::new(mixer, super::deepseek_v3::sigmoid_ffn(c, layer_idx))
}

fn hf_expert_dims(f: &HfFields<'_>) -> Result<ExpertDims, ConfigError> {
    let expert_ff = f.usize("moe_intermediate_size")?;
    // transformers' default: one shared expert.
    let n_shared = f.opt_count("n_shared_experts")?.unwrap_or(1);
    Ok(ExpertDims {
        n_experts: f.usize("n_routed_experts")?,
        expert_ff,
        shared_expert_ff: expert_ff * n_shared,
    })
}

fn hf_extra_fields(c: &ModelConfig, obj: &mut Map<String, Value>) {
    obj.insert("n_routed_experts".into(), json!(c.n_experts));
    obj.insert("moe_intermediate_size".into(), json!(c.expert_ff));
    obj.insert("n_shared_experts".into(), json!(c.shared_expert_ff / c.expert_ff.max(1)));
    let dense = c.dense_layers.unwrap_or(DenseLayers { count: 0, ff: c.expert_ff });
    obj.insert("first_k_dense_replace".into(), json!(dense.count));
    obj.insert("intermediate_size".into(), json!(dense.ff));
    let r =
        c.sigmoid_routing.unwrap_or(SigmoidRouting { n_group: 1, topk_group: 1, routed_scaling_factor: 1.0 });
    obj.insert("n_group".into(), json!(r.n_group));
    obj.insert("topk_group".into(), json!(r.topk_group));
    obj.insert("routed_scaling_factor".into(), json!(r.routed_scaling_factor));
    obj.insert("use_qk_norm".into(), json!(c.qk_norm));
    obj.insert("num_nextn_predict_layers".into(), json!(c.mtp_layers));
    // transformers' default is 0.5, so a full rotation must be said.
    let factor = c.rotary_dims as f64 / c.head_dim.max(1) as f64;
    obj.insert("partial_rotary_factor".into(), json!(factor));
    obj.remove("rope_theta");
    obj.insert(
        "rope_parameters".into(),
        json!({"rope_type": "default", "rope_theta": c.rope_theta, "partial_rotary_factor": factor}),
    );
}
