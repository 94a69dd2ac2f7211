//! Qwen3-Next (`qwen3_next`, GGUF `qwen3next`): three Gated DeltaNet layers to one gated
//! full-attention layer (`layer_types` / `full_attention_interval`), partial RoPE (a quarter of
//! each head), per-head q/k RMSNorm, a sigmoid output gate from a double-width q projection, and
//! in every layer a routed MoE beside a sigmoid-gated shared expert. Its checkpoints store
//! zero-centred RMSNorm weights and the DeltaNet projections fused per key head.

use super::*;
use crate::model::config::ModelConfig;
use serde_json::{Map, Value};

pub(super) const ADAPTER: Adapter = Adapter {
    arch: Arch::Qwen3Next,
    hf_model_type: "qwen3_next",
    hf_class: "Qwen3NextForCausalLM",
    gguf_arch: "qwen3next",
    rope_style: RopeStyle::HalfSplit,
    gguf_rope_style: RopeStyle::HalfSplit,
    gguf_ffn_norm: "post_attention_norm",
    shared_expert: true,
    hf_naming: HfNaming::Mlp,
    default_rope_theta: 10_000_000.0,
    gguf_default_norm_topk: true,
    hf_default_norm_topk: true,
    hybrid: HybridTraits {
        delta_net: Some(DeltaNetProjections::Grouped),
        gguf_delta_net: Some((DeltaNetProjections::SplitGroupedBa, VHeadOrder::Grouped)),
        hf_text_model_type: None,
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
    hybrid_layer(c, layer_idx, c.norm_topk_prob)
}

/// The layer of a Qwen hybrid: DeltaNet or gated attention by the config's layer types, then a
/// routed MoE with a gated shared expert (shared with Qwen3.5). The DeltaNet's tensor layout is
/// the file's (`HybridConfig::projections`, `v_heads`).
pub(super) fn hybrid_layer(c: &ModelConfig, layer_idx: usize, norm_topk_prob: bool) -> LayerSpec {
    let h = c.hybrid.as_ref().expect("hybrid architectures read their DeltaNet config");
    let mixer = if h.is_full_attention(layer_idx) {
        let Mixer::Attention(mut a) = standard_attention(c, QkNorm::PerHead, false) else {
            unreachable!("standard_attention builds attention")
        };
        a.output_gate = true;
        Mixer::Attention(a)
    } else {
        Mixer::GatedDeltaNet(DeltaNetSpec {
            n_k_heads: h.n_k_heads,
            n_v_heads: h.n_v_heads,
            k_head_dim: h.k_head_dim,
            v_head_dim: h.v_head_dim,
            conv_kernel: h.conv_kernel,
            projections: h.projections,
            v_heads: h.v_heads,
        })
    };
    let shared = SharedExpertSpec { ff: c.shared_expert_ff, gated: true };
    let Ffn::Moe(mut moe) = standard_moe(c, RoutingVariant::SoftmaxThenTopK, Some(shared)) else {
        unreachable!("standard_moe builds a MoE")
    };
    moe.router.norm_topk_prob = norm_topk_prob;
    LayerSpec::new(mixer, Ffn::Moe(moe))
}

fn hf_extra_fields(c: &ModelConfig, obj: &mut Map<String, Value>) {
    super::qwen2_moe::hf_extra_fields(c, obj);
    obj.remove("use_sliding_window");
}
