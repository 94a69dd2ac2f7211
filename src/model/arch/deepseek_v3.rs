//! DeepSeek-V3 (`deepseek_v3`, GGUF `deepseek2`; Kimi K2 is the same architecture): multi-head
//! latent attention in every layer (low-rank q with its norm, one normalised latent and a shared
//! RoPE key part per position, RoPE on the `qk_rope_head_dim` parts only, interleaved pairs,
//! YaRN with `mscale_all_dim` in the softmax scale); the first `first_k_dense_replace` layers a
//! dense FFN, the others a MoE with sigmoid routing (selection bias for the choice only,
//! group-limited top-k, renormalised, times `routed_scaling_factor`) beside an ungated shared
//! expert.

use super::*;
use crate::model::config::{ConfigError, HfFields, ModelConfig};
use crate::model::{GgufMeta, ModelError};
use serde_json::{json, Map, Value};

pub(super) const ADAPTER: Adapter = Adapter {
    arch: Arch::DeepseekV3,
    hf_model_type: "deepseek_v3",
    hf_class: "DeepseekV3ForCausalLM",
    gguf_arch: "deepseek2",
    // transformers' `rope_interleave` (true by default; a config may turn it off) and
    // llama.cpp's `LLAMA_ROPE_TYPE_NORM` for deepseek2: pairs (2i, 2i + 1).
    rope_style: RopeStyle::Interleaved,
    gguf_rope_style: RopeStyle::Interleaved,
    gguf_ffn_norm: "ffn_norm",
    shared_expert: true,
    hf_naming: HfNaming::SharedExperts,
    default_rope_theta: 10_000.0,
    gguf_default_norm_topk: false,
    hf_default_norm_topk: true,
    hybrid: HybridTraits::NONE,
    profile: DEFAULT_PROFILE,
    hf_expert_dims,
    gguf_expert_dims,
    hf_extra_fields,
    layer,
};

fn layer(c: &ModelConfig, layer_idx: usize) -> LayerSpec {
    let m = c.mla.expect("deepseek_v3 configs carry the latent attention's sizes (checked at open)");
    let mixer = Mixer::LatentAttention(LatentAttentionSpec {
        n_heads: c.n_heads,
        q_lora_rank: m.q_lora_rank,
        kv_lora_rank: m.kv_lora_rank,
        nope_dim: m.qk_nope_head_dim,
        rope_dim: m.qk_rope_head_dim,
        v_dim: m.v_head_dim,
        rope: RopeSpec {
            style: c.rope_style,
            theta: c.rope_theta,
            dims: m.qk_rope_head_dim,
            yarn: c.yarn,
            linear: c.rope_linear,
            turning_pairs: None,
        },
        scale: m.softmax_scale(c.yarn.as_ref()),
    });
    LayerSpec::new(mixer, sigmoid_ffn(c, layer_idx))
}

/// The FFN of DeepSeek-V3's layers (and GLM-4.5's): the leading `first_k_dense_replace` layers
/// dense, the rest a MoE with ungated shared experts and the sigmoid router (selection bias,
/// groups, scale).
pub(super) fn sigmoid_ffn(c: &ModelConfig, layer_idx: usize) -> Ffn {
    if let Some(d) = c.dense_layers.filter(|d| layer_idx < d.count) {
        return Ffn::Dense(DenseFfnSpec { ff: d.ff, activation: FfnActivation::Silu });
    }
    let shared =
        (c.shared_expert_ff > 0).then_some(SharedExpertSpec { ff: c.shared_expert_ff, gated: false });
    let Ffn::Moe(mut moe) = standard_moe(c, RoutingVariant::Sigmoid, shared) else {
        unreachable!("standard_moe builds a MoE")
    };
    let r = c.sigmoid_routing.unwrap_or(crate::model::config::SigmoidRouting {
        n_group: 1,
        topk_group: 1,
        routed_scaling_factor: 1.0,
    });
    moe.router.selection_bias = true;
    moe.router.n_group = r.n_group;
    moe.router.topk_group = r.topk_group;
    moe.router.scale = r.routed_scaling_factor;
    Ffn::Moe(moe)
}

fn hf_expert_dims(f: &HfFields<'_>) -> Result<ExpertDims, ConfigError> {
    let expert_ff = f.usize("moe_intermediate_size")?;
    let n_shared = f.opt_count("n_shared_experts")?.unwrap_or(0);
    Ok(ExpertDims {
        n_experts: f.usize("n_routed_experts")?,
        expert_ff,
        shared_expert_ff: expert_ff * n_shared,
    })
}

/// llama.cpp's expert keys of `deepseek2` and `glm4moe`: shared experts counted, each of the routed size.
pub(super) fn gguf_expert_dims(meta: &GgufMeta<'_>, n_experts: usize) -> Result<ExpertDims, ModelError> {
    let expert_ff = meta.usize("expert_feed_forward_length")?;
    let n_shared = meta.opt_count("expert_shared_count")?.unwrap_or(0);
    Ok(ExpertDims { n_experts, expert_ff, shared_expert_ff: expert_ff * n_shared })
}

fn hf_extra_fields(c: &ModelConfig, obj: &mut Map<String, Value>) {
    let m = c.mla.expect("deepseek_v3 configs carry the latent attention's sizes");
    obj.insert("n_routed_experts".into(), json!(c.n_experts));
    obj.insert("moe_intermediate_size".into(), json!(c.expert_ff));
    obj.insert("n_shared_experts".into(), json!(c.shared_expert_ff / c.expert_ff.max(1)));
    let dense = c.dense_layers.unwrap_or(crate::model::config::DenseLayers { count: 0, ff: c.expert_ff });
    obj.insert("first_k_dense_replace".into(), json!(dense.count));
    obj.insert("intermediate_size".into(), json!(dense.ff));
    if let Some(r) = c.sigmoid_routing {
        obj.insert("n_group".into(), json!(r.n_group));
        obj.insert("topk_group".into(), json!(r.topk_group));
        obj.insert("routed_scaling_factor".into(), json!(r.routed_scaling_factor));
    }
    obj.insert("q_lora_rank".into(), json!(m.q_lora_rank));
    obj.insert("kv_lora_rank".into(), json!(m.kv_lora_rank));
    obj.insert("qk_nope_head_dim".into(), json!(m.qk_nope_head_dim));
    obj.insert("qk_rope_head_dim".into(), json!(m.qk_rope_head_dim));
    obj.insert("v_head_dim".into(), json!(m.v_head_dim));
    obj.insert("rope_interleave".into(), json!(c.rope_style == RopeStyle::Interleaved));
    obj.insert("num_key_value_heads".into(), json!(c.n_heads));
    obj.remove("head_dim");
    obj.remove("rope_theta");
    let mut rope = json!({"rope_type": "default", "rope_theta": c.rope_theta});
    if let Some(y) = c.yarn {
        rope = json!({
            "rope_type": "yarn", "rope_theta": c.rope_theta, "factor": y.factor,
            "original_max_position_embeddings": y.original_context, "beta_fast": y.beta_fast,
            "beta_slow": y.beta_slow, "mscale": m.mscale_all_dim, "mscale_all_dim": m.mscale_all_dim,
        });
    }
    obj.insert("rope_parameters".into(), rope);
}
