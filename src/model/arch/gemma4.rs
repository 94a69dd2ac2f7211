//! Gemma 4 MoE (`gemma4` as published, the language model's config in `text_config` and its
//! weights under `model.language_model.*` beside vision and audio towers a text engine ignores;
//! the text-only `gemma4_text`; GGUF `gemma4`): sliding-window layers and global layers
//! interleaved (`layer_types`), the global ones with their own head dim, KV heads and
//! proportional RoPE, and their values taken from the k projection (`attention_k_eq_v`); per-head
//! q/k norms and a weightless v norm, scores unscaled; sandwich norms around the attention and
//! the FFN; a dense GeGLU MLP (the plan's ungated shared expert) beside the routed experts, each
//! branch with its own norms; a router reading the un-normalised input through a weightless
//! RMSNorm times a learned scale and `hidden^-0.5`, softmax, top-k, renormalised, times a
//! learned per-expert scale; fused tanh-GELU experts; a learned scalar on each layer's output;
//! embeddings times `sqrt(hidden)` and soft-capped logits.

use super::*;
use crate::model::config::{ConfigError, HfFields, ModelConfig};
use crate::model::{GgufMeta, ModelError};
use serde_json::{json, Map, Value};

pub(super) const ADAPTER: Adapter = Adapter {
    arch: Arch::Gemma4,
    hf_model_type: "gemma4",
    hf_class: "Gemma4ForConditionalGeneration",
    gguf_arch: "gemma4",
    rope_style: RopeStyle::HalfSplit,
    gguf_rope_style: RopeStyle::HalfSplit,
    gguf_ffn_norm: "ffn_norm",
    shared_expert: true,
    hf_naming: HfNaming::Gemma4,
    default_rope_theta: 10_000.0,
    gguf_default_norm_topk: true,
    hf_default_norm_topk: true,
    hybrid: HybridTraits { hf_text_model_type: Some("gemma4_text"), ..HybridTraits::NONE },
    profile: DEFAULT_PROFILE,
    hf_expert_dims,
    gguf_expert_dims,
    hf_extra_fields,
    layer,
};

fn layer(c: &ModelConfig, layer_idx: usize) -> LayerSpec {
    let Mixer::Attention(mut a) = standard_attention(c, QkNorm::PerHead, false) else {
        unreachable!("standard_attention builds attention")
    };
    a.window = c.window_of(layer_idx);
    a.v_norm = true;
    a.scale = Some(1.0);
    if let Some(g) = c.global_of(layer_idx) {
        a.head_dim = g.head_dim;
        a.n_kv_heads = g.n_kv_heads;
        a.values_from_keys = g.values_from_keys;
        a.rope = RopeSpec {
            style: c.rope_style,
            theta: g.rope_theta,
            dims: g.head_dim,
            yarn: None,
            linear: None,
            turning_pairs: Some(g.turning_pairs),
        };
    }
    let dense = SharedExpertSpec { ff: c.shared_expert_ff, gated: false };
    let Ffn::Moe(mut moe) = standard_moe(c, RoutingVariant::SoftmaxThenTopK, Some(dense)) else {
        unreachable!("standard_moe builds a MoE")
    };
    moe.router.norm_topk_prob = true;
    moe.router.scaled_input = true;
    moe.router.per_expert_scale = true;
    moe.activation = FfnActivation::GeluTanh;
    moe.branch_norms = true;
    LayerSpec { mixer: Mixer::Attention(a), ffn: Ffn::Moe(moe), post_norms: true, output_scale: true }
}

/// `num_experts`, `moe_intermediate_size`, and the dense MLP's `intermediate_size` as the shared
/// expert's.
fn hf_expert_dims(f: &HfFields<'_>) -> Result<ExpertDims, ConfigError> {
    Ok(ExpertDims {
        n_experts: f.usize("num_experts")?,
        expert_ff: f.usize("moe_intermediate_size")?,
        shared_expert_ff: f.usize("intermediate_size")?,
    })
}

fn gguf_expert_dims(meta: &GgufMeta<'_>, n_experts: usize) -> Result<ExpertDims, ModelError> {
    Ok(ExpertDims {
        n_experts,
        expert_ff: meta.usize("expert_feed_forward_length")?,
        shared_expert_ff: meta.usize("feed_forward_length")?,
    })
}

/// What transformers' `Gemma4TextConfig` reads (the text config; `to_hf_json` nests it).
fn hf_extra_fields(c: &ModelConfig, obj: &mut Map<String, Value>) {
    for field in ["hidden_act", "norm_topk_prob", "num_experts_per_tok", "rope_theta", "attention_bias"] {
        obj.remove(field);
    }
    obj.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
    obj.insert("enable_moe_block".into(), json!(true));
    obj.insert("num_experts".into(), json!(c.n_experts));
    obj.insert("top_k_experts".into(), json!(c.n_experts_used));
    obj.insert("moe_intermediate_size".into(), json!(c.expert_ff));
    obj.insert("intermediate_size".into(), json!(c.shared_expert_ff));
    obj.insert("hidden_size_per_layer_input".into(), json!(0));
    obj.insert("num_kv_shared_layers".into(), json!(0));
    obj.insert("sliding_window".into(), json!(c.sliding_window));
    obj.insert("final_logit_softcapping".into(), json!(c.final_logit_softcap));
    let types: Vec<&str> = (0..c.n_layers)
        .map(|l| if c.window_of(l).is_some() { "sliding_attention" } else { "full_attention" })
        .collect();
    obj.insert("layer_types".into(), json!(types));
    let g = c.global_attention.expect("gemma4 configs carry the global layers' sizes");
    obj.insert("global_head_dim".into(), json!(g.head_dim));
    obj.insert("num_global_key_value_heads".into(), json!(g.n_kv_heads));
    obj.insert("attention_k_eq_v".into(), json!(g.values_from_keys));
    let factor = 2.0 * g.turning_pairs as f64 / g.head_dim as f64;
    obj.insert(
        "rope_parameters".into(),
        json!({
            "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_theta},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": factor,
                               "rope_theta": g.rope_theta},
        }),
    );
}
