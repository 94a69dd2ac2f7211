//! Tensor roles and their names on disk. One vocabulary of roles (what a tensor is for) and the
//! name each format gives it: GGUF (llama.cpp names, experts stacked per layer) and the Hugging
//! Face layouts (per-expert tensors; Mixtral's `block_sparse_moe` family).

use crate::model::arch::HfNaming;

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
    };
    format!("model.layers.{layer}.{suffix}")
}

pub fn gguf_layer(layer: usize, role: LayerRole) -> String {
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
        LayerRole::FfnNorm => "ffn_norm.weight",
        LayerRole::Router => "ffn_gate_inp.weight",
        LayerRole::SharedGate => "ffn_gate_shexp.weight",
        LayerRole::SharedUp => "ffn_up_shexp.weight",
        LayerRole::SharedDown => "ffn_down_shexp.weight",
        LayerRole::SharedExpertGate => "ffn_gate_inp_shexp.weight",
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
        assert_eq!(gguf_layer(1, LayerRole::SharedExpertGate), "blk.1.ffn_gate_inp_shexp.weight");
    }
}
