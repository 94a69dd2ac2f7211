//! Qwen3.5 / Qwen3.6 MoE (`qwen3_5_moe` as published, with the language model's config in
//! `text_config` and its weights under `model.language_model.*` beside a vision tower that a
//! text engine ignores; the text-only `qwen3_5_moe_text`; GGUF `qwen35moe`): the Qwen3-Next
//! layer pattern with the DeltaNet projections stored apart (`in_proj_qkv`, `in_proj_z`,
//! `in_proj_b`, `in_proj_a`), a router that always renormalises its top-k, and experts usually
//! stored fused (`mlp.experts.gate_up_proj`). Text positions see plain partial RoPE: its MRoPE
//! sections all carry the same position for text.

use super::qwen3_next::hybrid_layer;
use super::*;
use crate::model::config::ModelConfig;
use serde_json::{Map, Value};

pub(super) const ADAPTER: Adapter = Adapter {
    arch: Arch::Qwen35Moe,
    hf_model_type: "qwen3_5_moe",
    hf_class: "Qwen3_5MoeForConditionalGeneration",
    gguf_arch: "qwen35moe",
    rope_style: RopeStyle::HalfSplit,
    gguf_rope_style: RopeStyle::HalfSplit,
    gguf_ffn_norm: "post_attention_norm",
    shared_expert: true,
    hf_naming: HfNaming::Mlp,
    default_rope_theta: 10_000_000.0,
    gguf_default_norm_topk: true,
    hf_default_norm_topk: true,
    hybrid: HybridTraits {
        delta_net: Some(DeltaNetProjections::Split),
        gguf_delta_net: Some((DeltaNetProjections::Split, VHeadOrder::Tiled)),
        hf_text_model_type: Some("qwen3_5_moe_text"),
        hf_zero_centred_norms: true,
        default_partial_rotary: 0.25,
    },
    profile: DEFAULT_PROFILE,
    hf_expert_dims: super::qwen2_moe::hf_expert_dims,
    gguf_expert_dims: super::qwen2_moe::gguf_expert_dims,
    hf_extra_fields,
    layer,
};

fn layer(c: &ModelConfig, layer_idx: usize) -> LayerSpec {
    // transformers' Qwen3.5 router has no `norm_topk_prob`: it always renormalises.
    hybrid_layer(c, layer_idx, true)
}

fn hf_extra_fields(c: &ModelConfig, obj: &mut Map<String, Value>) {
    super::qwen2_moe::hf_extra_fields(c, obj);
    for field in [
        "use_sliding_window",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
        "intermediate_size",
    ] {
        obj.remove(field);
    }
}
