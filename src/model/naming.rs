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
}

impl LayerRole {
    /// RMSNorm weights that zero-centred checkpoints store as `w` for a scale of `1 + w`.
    pub fn is_centred_norm(self) -> bool {
        matches!(self, LayerRole::AttnNorm | LayerRole::FfnNorm | LayerRole::QNorm | LayerRole::KNorm)
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
    let moe = match naming {
        HfNaming::Mlp => "mlp",
        HfNaming::BlockSparseMoe => "block_sparse_moe",
    };
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
        LayerRole::Router => format!("{moe}.gate.weight"),
        LayerRole::SharedGate => "mlp.shared_expert.gate_proj.weight".to_string(),
        LayerRole::SharedUp => "mlp.shared_expert.up_proj.weight".to_string(),
        LayerRole::SharedDown => "mlp.shared_expert.down_proj.weight".to_string(),
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
    };
    format!("model.layers.{layer}.{suffix}")
}

/// llama.cpp's name of a per-layer tensor of `adapter`'s architecture.
pub fn gguf_layer(adapter: &Adapter, layer: usize, role: LayerRole) -> String {
    if role == LayerRole::FfnNorm {
        return format!("blk.{layer}.{}.weight", adapter.gguf_ffn_norm);
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
    };
    format!("blk.{layer}.{suffix}")
}

pub fn hf_expert(naming: HfNaming, layer: usize, expert_idx: usize, proj: ExpertProj) -> String {
    match naming {
        HfNaming::Mlp => {
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
    }
}
