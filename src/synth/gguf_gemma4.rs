//! Gemma 4 in llama.cpp's GGUF layout (`gemma4`), as its converter (`conversion/gemma.py`,
//! `Gemma4Model`) writes it: the global and sliding layers' sizes and RoPE bases under separate
//! keys (`*_swa`), one `head_count_kv` per layer, the sliding pattern as one bool a layer, the
//! proportional RoPE as `rope_freqs.weight` (1 for each turning pair, 1e30 for the rest, with
//! `rope.dimension_count` the whole global head), the experts' gate and up fused
//! (`ffn_gate_up_exps`, each expert's gate rows then its up rows), and the dense MLP under the
//! plain FFN names. Norms are stored as they are (Gemma 4's RMSNorm has no `1 + w`).

use super::{canonical_2d, expert_part, Canonical, Init, Layout, PlannedTensor};
use crate::format::dtype::DType;
use crate::format::gguf::{GgufValueType, GgufWriter, MetaArray, MetaValue};
use crate::model::config::ModelConfig;
use crate::model::naming::{self, ExpertProj};

/// llama.cpp's `gemma4` keys beside the common ones (which these replace where both name one).
pub(super) fn add_metadata(w: &mut GgufWriter, c: &ModelConfig, arch: &str) {
    let Some(g) = c.global_attention else { return };
    let k = |suffix: &str| format!("{arch}.{suffix}");
    let u32v = |v: usize| MetaValue::U32(v as u32);
    let per_layer = |f: &dyn Fn(usize) -> MetaValue, elem_type| {
        MetaValue::Array(MetaArray { elem_type, values: (0..c.n_layers).map(f).collect() })
    };
    w.add_metadata(k("feed_forward_length"), u32v(c.shared_expert_ff));
    w.add_metadata(k("attention.key_length"), u32v(g.head_dim));
    w.add_metadata(k("attention.value_length"), u32v(g.head_dim));
    w.add_metadata(k("attention.key_length_swa"), u32v(c.head_dim));
    w.add_metadata(k("attention.value_length_swa"), u32v(c.head_dim));
    let kv = |l: usize| u32v(c.global_of(l).map_or(c.n_kv_heads, |g| g.n_kv_heads));
    w.add_metadata(k("attention.head_count_kv"), per_layer(&kv, GgufValueType::U32));
    let swa = |l: usize| MetaValue::Bool(c.window_of(l).is_some());
    w.add_metadata(k("attention.sliding_window_pattern"), per_layer(&swa, GgufValueType::Bool));
    w.add_metadata(k("rope.freq_base"), MetaValue::F32(g.rope_theta));
    w.add_metadata(k("rope.freq_base_swa"), MetaValue::F32(c.rope_theta));
    w.add_metadata(k("rope.dimension_count"), u32v(g.head_dim));
    w.add_metadata(k("rope.dimension_count_swa"), u32v(c.rotary_dims));
    if let Some(cap) = c.final_logit_softcap {
        w.add_metadata(k("final_logit_softcapping"), MetaValue::F32(cap));
    }
    w.add_metadata(k("embedding_length_per_layer_input"), u32v(0));
    w.add_metadata(k("attention.shared_kv_layers"), u32v(0));
}

/// `rope_freqs.weight`, `[global head_dim / 2]` f32: the global layers' proportional RoPE.
pub(super) fn rope_freqs(c: &ModelConfig) -> Option<PlannedTensor> {
    let g = c.global_attention?;
    let part = canonical_2d("rope_freqs".into(), &[g.head_dim / 2], Init::RopeFreqs(g.turning_pairs), 0);
    Some(PlannedTensor {
        name: naming::GGUF_ROPE_FREQS.into(),
        dtype: DType::F32,
        shape: vec![g.head_dim / 2],
        parts: vec![part],
        layout: Layout::Rows,
    })
}

/// A layer's experts: `ffn_gate_up_exps` `[experts, 2 ff, hidden]` and `ffn_down_exps`, drawn
/// from the per-expert canonical tensors (the same values as the safetensors checkpoint's).
pub(super) fn experts(c: &ModelConfig, opts: &super::SynthOptions, layer_idx: usize) -> [PlannedTensor; 2] {
    let a = opts.adapter;
    let gate_up: Vec<Canonical> = (0..c.n_experts)
        .flat_map(|e| [ExpertProj::Gate, ExpertProj::Up].map(|p| expert_part(c, a, layer_idx, e, p)))
        .collect();
    let down = (0..c.n_experts).map(|e| expert_part(c, a, layer_idx, e, ExpertProj::Down)).collect();
    [
        PlannedTensor {
            name: naming::gguf_gate_up_experts(layer_idx),
            dtype: opts.dtype,
            shape: vec![c.n_experts, 2 * c.expert_ff, c.hidden],
            parts: gate_up,
            layout: Layout::Rows,
        },
        PlannedTensor {
            name: naming::gguf_experts(layer_idx, ExpertProj::Down),
            dtype: opts.dtype,
            shape: vec![c.n_experts, c.hidden, c.expert_ff],
            parts: down,
            layout: Layout::Rows,
        },
    ]
}
