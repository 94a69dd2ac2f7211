//! Tensor roles and their names on disk. One vocabulary of roles (what a tensor is for) and the
//! name each format gives it: GGUF (llama.cpp names, experts stacked per layer) and the Hugging
//! Face layouts (per-expert tensors; Mixtral's `block_sparse_moe` family).

use crate::model::arch::{Adapter, DeltaNetProjections, HfNaming};

/// Tensors that exist once per model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GlobalRole {
    TokenEmbedding,
    OutputNorm,
    /// lm_head; absent when embeddings are tied.
    Output,
}

/// Non-expert tensors of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerRole {
    AttnNorm,
    Q,
    K,
    V,
    O,
    QBias,
    KBias,
    VBias,
    QNorm,
    KNorm,
    FfnNorm,
    Router,
    SharedGate,
    SharedUp,
    SharedDown,
    /// The shared expert's scalar sigmoid gate, `[1, hidden]` (Qwen2-MoE).
    SharedExpertGate,
    /// Gated DeltaNet (`DeltaNetProjections::Grouped`): q, k, v, z in one projection, grouped
    /// per key head.
    DeltaQkvz,
    /// Gated DeltaNet (grouped): b and a in one projection, grouped per key head.
    DeltaBa,
    /// Gated DeltaNet (`DeltaNetProjections::Split`): q, k, v in one projection.
    DeltaQkv,
    /// Gated DeltaNet (split): the output gate z, `[value_dim, hidden]`.
    DeltaZ,
    /// Gated DeltaNet (split): beta logits, `[v_heads, hidden]`.
    DeltaB,
    /// Gated DeltaNet (split): decay input a, `[v_heads, hidden]`.
    DeltaA,
    /// The depthwise causal conv, `[conv_dim, 1, kernel]`.
    DeltaConv,
    /// `dt_bias`, `[v_heads]`.
    DeltaDtBias,
    /// `A_log`, `[v_heads]` (the decay rate is `-exp(A_log)`).
    DeltaALog,
    /// The gated RMSNorm of each value head, `[v_head_dim]` (plain weights, not zero-centred).
    DeltaNorm,
    /// The output projection, `[hidden, value_dim]`.
    DeltaOut,
    /// The o projection's bias, `[hidden]` (GPT-OSS).
    OBias,
    /// One learned sink logit per query head, `[n_heads]` (GPT-OSS).
    Sinks,
    /// The router's bias, `[n_experts]` (GPT-OSS).
    RouterBias,
    /// The selection bias added to the router's scores for the choice only, `[n_experts]`
    /// (DeepSeek-V3's `e_score_correction_bias`, llama.cpp's `exp_probs_b`).
    RouterSelectionBias,
    /// MLA: the low-rank q projection, `[q_lora_rank, hidden]`.
    MlaQA,
    /// MLA: its RMSNorm, `[q_lora_rank]`.
    MlaQANorm,
    /// MLA: q from the low rank, `[heads * (nope + rope), q_lora_rank]` (without a low rank,
    /// [`LayerRole::Q`] is `[heads * (nope + rope), hidden]`).
    MlaQB,
    /// MLA: the latent and the shared RoPE key part, `[kv_lora_rank + rope, hidden]`.
    MlaKvA,
    /// MLA: the latent's RMSNorm, `[kv_lora_rank]`.
    MlaKvANorm,
    /// MLA: per head the no-RoPE key rows then the value rows, `[heads * (nope + v),
    /// kv_lora_rank]` (transformers; rewritten at open into [`LayerRole::MlaKB`] and
    /// [`LayerRole::MlaVB`]).
    MlaKvB,
    /// MLA: per head the key part transposed, `[heads, kv_lora_rank, nope]` (llama.cpp's split).
    MlaKB,
    /// MLA: per head the value part, `[heads, v, kv_lora_rank]`.
    MlaVB,
    /// A dense FFN layer's gate, up (`[ff, hidden]`) and down (`[hidden, ff]`).
    DenseGate,
    DenseUp,
    DenseDown,
    /// The mixer's output norm before the residual, `[hidden]` (Gemma 4's
    /// `post_attention_layernorm`; `LayerSpec::post_norms`).
    PostAttnNorm,
    /// The FFN's output norm before the residual, `[hidden]` (`post_feedforward_layernorm`).
    PostFfnNorm,
    /// The shared (dense) branch's output norm, `[hidden]` (`post_feedforward_layernorm_1`;
    /// `MoeSpec::branch_norms`).
    SharedPostNorm,
    /// The routed branch's input norm, `[hidden]` (`pre_feedforward_layernorm_2`).
    ExpertsNorm,
    /// The routed branch's output norm, `[hidden]` (`post_feedforward_layernorm_2`).
    ExpertsPostNorm,
    /// The router's per-channel input scale, `[hidden]` (`router.scale`;
    /// `RouterSpec::scaled_input`).
    RouterInputScale,
    /// The router's per-expert weight scale, `[n_experts]` (`router.per_expert_scale`).
    RouterExpertScale,
    /// The layer's output scalar, `[1]` (`layer_scalar`; `LayerSpec::output_scale`).
    LayerScalar,
}

impl LayerRole {
    /// RMSNorm weights that zero-centred checkpoints store as `w` for a scale of `1 + w`.
    pub fn is_centred_norm(self) -> bool {
        use LayerRole::*;
        matches!(self, AttnNorm | FfnNorm | QNorm | KNorm | MlaQANorm | MlaKvANorm)
    }

    /// A tensor of a Gated DeltaNet mixer.
    pub fn is_delta_net(self) -> bool {
        use LayerRole::*;
        matches!(
            self,
            DeltaQkvz
                | DeltaBa
                | DeltaQkv
                | DeltaZ
                | DeltaB
                | DeltaA
                | DeltaConv
                | DeltaDtBias
                | DeltaALog
                | DeltaNorm
                | DeltaOut
        )
    }
}

/// The input projections of a Gated DeltaNet layer stored as `p`, in the order every engine
/// reads them.
pub fn delta_input_roles(p: DeltaNetProjections) -> &'static [LayerRole] {
    use LayerRole::*;
    match p {
        DeltaNetProjections::Grouped => &[DeltaQkvz, DeltaBa],
        DeltaNetProjections::Split => &[DeltaQkv, DeltaZ, DeltaB, DeltaA],
        DeltaNetProjections::SplitGroupedBa => &[DeltaQkv, DeltaZ, DeltaBa],
    }
}

/// The three projections of one expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertProj {
    Gate,
    Up,
    Down,
}

impl ExpertProj {
    pub const ALL: [ExpertProj; 3] = [ExpertProj::Gate, ExpertProj::Up, ExpertProj::Down];
}

pub fn hf_global(role: GlobalRole) -> &'static str {
    match role {
        GlobalRole::TokenEmbedding => "model.embed_tokens.weight",
        GlobalRole::OutputNorm => "model.norm.weight",
        GlobalRole::Output => "lm_head.weight",
    }
}

pub fn gguf_global(role: GlobalRole) -> &'static str {
    match role {
        GlobalRole::TokenEmbedding => "token_embd.weight",
        GlobalRole::OutputNorm => "output_norm.weight",
        GlobalRole::Output => "output.weight",
    }
}

pub fn hf_layer(naming: HfNaming, layer: usize, role: LayerRole) -> String {
    let (moe, router) = match naming {
        HfNaming::Mlp => ("mlp", "mlp.gate"),
        HfNaming::BlockSparseMoe => ("block_sparse_moe", "block_sparse_moe.gate"),
        HfNaming::GptOss => ("mlp", "mlp.router"),
        HfNaming::SharedExperts => ("mlp", "mlp.gate"),
        HfNaming::Gemma4 => return format!("model.layers.{layer}.{}", gemma4_layer(role)),
    };
    let _ = moe;
    let shared = if naming == HfNaming::SharedExperts { "mlp.shared_experts" } else { "mlp.shared_expert" };
    let suffix = match role {
        LayerRole::AttnNorm => "input_layernorm.weight".to_string(),
        LayerRole::Q => "self_attn.q_proj.weight".to_string(),
        LayerRole::K => "self_attn.k_proj.weight".to_string(),
        LayerRole::V => "self_attn.v_proj.weight".to_string(),
        LayerRole::O => "self_attn.o_proj.weight".to_string(),
        LayerRole::QBias => "self_attn.q_proj.bias".to_string(),
        LayerRole::KBias => "self_attn.k_proj.bias".to_string(),
        LayerRole::VBias => "self_attn.v_proj.bias".to_string(),
        LayerRole::QNorm => "self_attn.q_norm.weight".to_string(),
        LayerRole::KNorm => "self_attn.k_norm.weight".to_string(),
        LayerRole::FfnNorm => "post_attention_layernorm.weight".to_string(),
        LayerRole::Router => format!("{router}.weight"),
        LayerRole::RouterBias => format!("{router}.bias"),
        LayerRole::OBias => "self_attn.o_proj.bias".to_string(),
        LayerRole::Sinks => "self_attn.sinks".to_string(),
        LayerRole::SharedGate => format!("{shared}.gate_proj.weight"),
        LayerRole::SharedUp => format!("{shared}.up_proj.weight"),
        LayerRole::SharedDown => format!("{shared}.down_proj.weight"),
        LayerRole::RouterSelectionBias => format!("{router}.e_score_correction_bias"),
        LayerRole::MlaQA => "self_attn.q_a_proj.weight".to_string(),
        LayerRole::MlaQANorm => "self_attn.q_a_layernorm.weight".to_string(),
        LayerRole::MlaQB => "self_attn.q_b_proj.weight".to_string(),
        LayerRole::MlaKvA => "self_attn.kv_a_proj_with_mqa.weight".to_string(),
        LayerRole::MlaKvANorm => "self_attn.kv_a_layernorm.weight".to_string(),
        LayerRole::MlaKvB => "self_attn.kv_b_proj.weight".to_string(),
        // Not in transformers' checkpoints: the split form is made at open (`Model::mla_kv_b`).
        LayerRole::MlaKB => "self_attn.k_b_proj.weight".to_string(),
        LayerRole::MlaVB => "self_attn.v_b_proj.weight".to_string(),
        LayerRole::DenseGate => "mlp.gate_proj.weight".to_string(),
        LayerRole::DenseUp => "mlp.up_proj.weight".to_string(),
        LayerRole::DenseDown => "mlp.down_proj.weight".to_string(),
        LayerRole::SharedExpertGate => "mlp.shared_expert_gate.weight".to_string(),
        LayerRole::DeltaQkvz => "linear_attn.in_proj_qkvz.weight".to_string(),
        LayerRole::DeltaBa => "linear_attn.in_proj_ba.weight".to_string(),
        LayerRole::DeltaQkv => "linear_attn.in_proj_qkv.weight".to_string(),
        LayerRole::DeltaZ => "linear_attn.in_proj_z.weight".to_string(),
        LayerRole::DeltaB => "linear_attn.in_proj_b.weight".to_string(),
        LayerRole::DeltaA => "linear_attn.in_proj_a.weight".to_string(),
        LayerRole::DeltaConv => "linear_attn.conv1d.weight".to_string(),
        LayerRole::DeltaDtBias => "linear_attn.dt_bias".to_string(),
        LayerRole::DeltaALog => "linear_attn.A_log".to_string(),
        LayerRole::DeltaNorm => "linear_attn.norm.weight".to_string(),
        LayerRole::DeltaOut => "linear_attn.out_proj.weight".to_string(),
        LayerRole::PostAttnNorm
        | LayerRole::PostFfnNorm
        | LayerRole::SharedPostNorm
        | LayerRole::ExpertsNorm
        | LayerRole::ExpertsPostNorm
        | LayerRole::RouterInputScale
        | LayerRole::RouterExpertScale
        | LayerRole::LayerScalar => gemma4_layer(role).to_string(),
    };
    format!("model.layers.{layer}.{suffix}")
}

/// Gemma 4's transformers names (the sandwich norms: its pre-FFN norm is
/// `pre_feedforward_layernorm`, its `post_attention_layernorm` the mixer's output norm).
fn gemma4_layer(role: LayerRole) -> &'static str {
    match role {
        LayerRole::FfnNorm => "pre_feedforward_layernorm.weight",
        LayerRole::PostAttnNorm => "post_attention_layernorm.weight",
        LayerRole::PostFfnNorm => "post_feedforward_layernorm.weight",
        LayerRole::SharedPostNorm => "post_feedforward_layernorm_1.weight",
        LayerRole::ExpertsNorm => "pre_feedforward_layernorm_2.weight",
        LayerRole::ExpertsPostNorm => "post_feedforward_layernorm_2.weight",
        LayerRole::Router => "router.proj.weight",
        LayerRole::RouterInputScale => "router.scale",
        LayerRole::RouterExpertScale => "router.per_expert_scale",
        LayerRole::LayerScalar => "layer_scalar",
        LayerRole::SharedGate => "mlp.gate_proj.weight",
        LayerRole::SharedUp => "mlp.up_proj.weight",
        LayerRole::SharedDown => "mlp.down_proj.weight",
        LayerRole::AttnNorm => "input_layernorm.weight",
        LayerRole::Q => "self_attn.q_proj.weight",
        LayerRole::K => "self_attn.k_proj.weight",
        LayerRole::V => "self_attn.v_proj.weight",
        LayerRole::O => "self_attn.o_proj.weight",
        LayerRole::QNorm => "self_attn.q_norm.weight",
        LayerRole::KNorm => "self_attn.k_norm.weight",
        // Roles a Gemma 4 layer never requires: a name no checkpoint has.
        _ => "unused",
    }
}

/// llama.cpp's name of a per-layer tensor of `adapter`'s architecture.
pub fn gguf_layer(adapter: &Adapter, layer: usize, role: LayerRole) -> String {
    if role == LayerRole::FfnNorm {
        return format!("blk.{layer}.{}.weight", adapter.gguf_ffn_norm);
    }
    // llama.cpp's gemma4 keeps its dense MLP (the plan's ungated shared expert) under the plain
    // FFN names.
    if adapter.hf_naming == HfNaming::Gemma4 {
        let dense = match role {
            LayerRole::SharedGate => Some(LayerRole::DenseGate),
            LayerRole::SharedUp => Some(LayerRole::DenseUp),
            LayerRole::SharedDown => Some(LayerRole::DenseDown),
            _ => None,
        };
        if let Some(dense) = dense {
            return gguf_layer(adapter, layer, dense);
        }
    }
    let suffix = match role {
        LayerRole::AttnNorm => "attn_norm.weight",
        LayerRole::Q => "attn_q.weight",
        LayerRole::K => "attn_k.weight",
        LayerRole::V => "attn_v.weight",
        LayerRole::O => "attn_output.weight",
        LayerRole::QBias => "attn_q.bias",
        LayerRole::KBias => "attn_k.bias",
        LayerRole::VBias => "attn_v.bias",
        LayerRole::QNorm => "attn_q_norm.weight",
        LayerRole::KNorm => "attn_k_norm.weight",
        LayerRole::FfnNorm => unreachable!("named above"),
        LayerRole::Router => "ffn_gate_inp.weight",
        LayerRole::SharedGate => "ffn_gate_shexp.weight",
        LayerRole::SharedUp => "ffn_up_shexp.weight",
        LayerRole::SharedDown => "ffn_down_shexp.weight",
        LayerRole::SharedExpertGate => "ffn_gate_inp_shexp.weight",
        // llama.cpp's names for the DeltaNet tensors (`ssm_in` is Qwen3-Next's fused qkvz,
        // which llama.cpp reads but its converter no longer writes).
        LayerRole::DeltaQkvz => "ssm_in.weight",
        LayerRole::DeltaBa => "ssm_ba.weight",
        LayerRole::DeltaQkv => "attn_qkv.weight",
        LayerRole::DeltaZ => "attn_gate.weight",
        LayerRole::DeltaB => "ssm_beta.weight",
        LayerRole::DeltaA => "ssm_alpha.weight",
        LayerRole::DeltaConv => "ssm_conv1d.weight",
        LayerRole::DeltaDtBias => "ssm_dt.bias",
        LayerRole::DeltaALog => "ssm_a",
        LayerRole::DeltaNorm => "ssm_norm.weight",
        LayerRole::DeltaOut => "ssm_out.weight",
        LayerRole::OBias => "attn_output.bias",
        LayerRole::Sinks => "attn_sinks.weight",
        LayerRole::RouterBias => "ffn_gate_inp.bias",
        LayerRole::RouterSelectionBias => "exp_probs_b.bias",
        LayerRole::MlaQA => "attn_q_a.weight",
        LayerRole::MlaQANorm => "attn_q_a_norm.weight",
        LayerRole::MlaQB => "attn_q_b.weight",
        LayerRole::MlaKvA => "attn_kv_a_mqa.weight",
        LayerRole::MlaKvANorm => "attn_kv_a_norm.weight",
        LayerRole::MlaKvB => "attn_kv_b.weight",
        LayerRole::MlaKB => "attn_k_b.weight",
        LayerRole::MlaVB => "attn_v_b.weight",
        LayerRole::DenseGate => "ffn_gate.weight",
        LayerRole::DenseUp => "ffn_up.weight",
        LayerRole::DenseDown => "ffn_down.weight",
        // llama.cpp's Gemma 4 names.
        LayerRole::PostAttnNorm => "post_attention_norm.weight",
        LayerRole::PostFfnNorm => "post_ffw_norm.weight",
        LayerRole::SharedPostNorm => "post_ffw_norm_1.weight",
        LayerRole::ExpertsNorm => "pre_ffw_norm_2.weight",
        LayerRole::ExpertsPostNorm => "post_ffw_norm_2.weight",
        LayerRole::RouterInputScale => "ffn_gate_inp.scale",
        LayerRole::RouterExpertScale => "ffn_down_exps.scale",
        LayerRole::LayerScalar => "layer_output_scale.weight",
    };
    format!("blk.{layer}.{suffix}")
}

/// The stacked bias of one projection of a layer's experts in GGUF (`[experts, rows]`).
pub fn gguf_expert_bias(layer: usize, proj: ExpertProj) -> String {
    gguf_experts(layer, proj).replace(".weight", ".bias")
}

/// GPT-OSS's fused expert biases: `gate_up_proj_bias` `[experts, 2 ff]` (gate and up
/// interleaved) or `down_proj_bias` `[experts, hidden]`.
pub fn hf_fused_expert_bias(layer: usize, down: bool) -> String {
    format!("{}_bias", hf_fused_experts(layer, down))
}

/// One expert's projection as a per-expert checkpoint names it (GPT-OSS's checkpoints fuse them,
/// [`hf_fused_experts`]; its per-expert name is the synthetic generator's key).
pub fn hf_expert(naming: HfNaming, layer: usize, expert_idx: usize, proj: ExpertProj) -> String {
    match naming {
        HfNaming::Mlp | HfNaming::GptOss | HfNaming::SharedExperts | HfNaming::Gemma4 => {
            let p = match proj {
                ExpertProj::Gate => "gate_proj",
                ExpertProj::Up => "up_proj",
                ExpertProj::Down => "down_proj",
            };
            format!("model.layers.{layer}.mlp.experts.{expert_idx}.{p}.weight")
        }
        HfNaming::BlockSparseMoe => {
            let w = match proj {
                ExpertProj::Gate => "w1",
                ExpertProj::Down => "w2",
                ExpertProj::Up => "w3",
            };
            format!("model.layers.{layer}.block_sparse_moe.experts.{expert_idx}.{w}.weight")
        }
    }
}

/// The stacked tensors of a layer's experts in transformers' fused form (published Qwen3.5
/// checkpoints): `gate_up_proj` `[experts, 2 * ff, hidden]` (gate rows first) and `down_proj`
/// `[experts, hidden, ff]`.
pub fn hf_fused_experts(layer: usize, down: bool) -> String {
    let p = if down { "down_proj" } else { "gate_up_proj" };
    format!("model.layers.{layer}.mlp.experts.{p}")
}

/// [`hf_fused_experts`] as `naming` places them (Gemma 4: `experts.*` beside `mlp`, not in it).
pub fn hf_fused_experts_of(naming: HfNaming, layer: usize, down: bool) -> String {
    match naming {
        HfNaming::Gemma4 => hf_fused_experts(layer, down).replace(".mlp.experts.", ".experts."),
        _ => hf_fused_experts(layer, down),
    }
}

/// llama.cpp's fused gate and up projections of a layer's experts, `[experts, 2 * ff, hidden]`
/// (each expert's gate rows, then its up rows: what its converter writes for Gemma 4).
pub fn gguf_gate_up_experts(layer: usize) -> String {
    format!("blk.{layer}.ffn_gate_up_exps.weight")
}

/// llama.cpp's `rope_freqs.weight`: per rotated pair a divisor of its frequency (Gemma 4's
/// proportional RoPE: 1 for the turning pairs, 1e30 for the rest, which then do not turn).
pub const GGUF_ROPE_FREQS: &str = "rope_freqs.weight";

/// The stacked tensor holding one projection of every expert of a layer.
pub fn gguf_experts(layer: usize, proj: ExpertProj) -> String {
    let p = match proj {
        ExpertProj::Gate => "ffn_gate_exps",
        ExpertProj::Up => "ffn_up_exps",
        ExpertProj::Down => "ffn_down_exps",
    };
    format!("blk.{layer}.{p}.weight")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_each_family() {
        assert_eq!(
            hf_expert(HfNaming::BlockSparseMoe, 3, 5, ExpertProj::Up),
            "model.layers.3.block_sparse_moe.experts.5.w3.weight"
        );
        assert_eq!(
            hf_expert(HfNaming::Mlp, 0, 1, ExpertProj::Down),
            "model.layers.0.mlp.experts.1.down_proj.weight"
        );
        assert_eq!(
            hf_layer(HfNaming::BlockSparseMoe, 2, LayerRole::Router),
            "model.layers.2.block_sparse_moe.gate.weight"
        );
        assert_eq!(gguf_experts(7, ExpertProj::Gate), "blk.7.ffn_gate_exps.weight");
        let qwen3 = crate::model::arch::of(crate::model::arch::Arch::Qwen3Moe);
        let next = crate::model::arch::of(crate::model::arch::Arch::Qwen3Next);
        assert_eq!(gguf_layer(qwen3, 1, LayerRole::SharedExpertGate), "blk.1.ffn_gate_inp_shexp.weight");
        assert_eq!(gguf_layer(qwen3, 2, LayerRole::FfnNorm), "blk.2.ffn_norm.weight");
        assert_eq!(gguf_layer(next, 2, LayerRole::FfnNorm), "blk.2.post_attention_norm.weight");
        let gemma4 = crate::model::arch::of(crate::model::arch::Arch::Gemma4);
        assert_eq!(gguf_layer(gemma4, 3, LayerRole::SharedDown), "blk.3.ffn_down.weight");
        assert_eq!(gguf_layer(gemma4, 3, LayerRole::FfnNorm), "blk.3.ffn_norm.weight");
        assert_eq!(gguf_layer(gemma4, 0, LayerRole::RouterExpertScale), "blk.0.ffn_down_exps.scale");
        assert_eq!(gguf_layer(qwen3, 1, LayerRole::SharedDown), "blk.1.ffn_down_shexp.weight");
    }
}
