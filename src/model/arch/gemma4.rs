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

/// Values below this in llama.cpp's `rope_freqs` (a divisor of each pair's frequency) would turn
/// their pair measurably; the converter writes 1e30 for the pairs that stay put.
const STILL_PAIR_MIN: f32 = 1e20;

/// The sliding layers' per-layer flags of a `gemma4` GGUF (`attention.sliding_window_pattern`,
/// one bool a layer, as llama.cpp reads it).
fn gguf_sliding_flags(meta: &GgufMeta<'_>, n_layers: usize) -> Result<Vec<bool>, ModelError> {
    let key = meta.key("attention.sliding_window_pattern");
    let value = meta
        .file
        .get(&key)
        .ok_or_else(|| ModelError::MissingMetadata { path: meta.file.path().into(), key: key.clone() })?;
    let flags: Option<Vec<bool>> =
        value.as_array().and_then(|a| a.values.iter().map(|v| v.as_bool()).collect());
    flags.filter(|f| f.len() == n_layers).ok_or_else(|| meta.bad(key, "an array of bools, one per layer"))
}

/// A key llama.cpp reads as one value or one per layer (`attention.head_count_kv`).
fn gguf_per_layer(meta: &GgufMeta<'_>, suffix: &str, n_layers: usize) -> Result<Vec<usize>, ModelError> {
    let key = meta.key(suffix);
    let value = meta
        .file
        .get(&key)
        .ok_or_else(|| ModelError::MissingMetadata { path: meta.file.path().into(), key: key.clone() })?;
    if let Some(v) = value.as_u64() {
        return Ok(vec![v as usize; n_layers]);
    }
    let values: Option<Vec<usize>> =
        value.as_array().and_then(|a| a.values.iter().map(|v| v.as_u64().map(|v| v as usize)).collect());
    values
        .filter(|v| v.len() == n_layers)
        .ok_or_else(|| meta.bad(key, "a non-negative integer or an array of them, one per layer"))
}

/// The one value `per_layer` holds over the layers `pick` selects (`None`: no such layer).
fn uniform(
    meta: &GgufMeta<'_>,
    suffix: &str,
    per_layer: &[usize],
    pick: impl Fn(usize) -> bool,
) -> Result<Option<usize>, ModelError> {
    let mut picked = (0..per_layer.len()).filter(|&l| pick(l)).map(|l| per_layer[l]);
    let first = picked.next();
    match picked.find(|v| Some(*v) != first) {
        Some(_) => {
            Err(meta.bad(meta.key(suffix), "the same value on every layer of a kind (sliding or global)"))
        }
        None => Ok(first),
    }
}

/// The sliding layers' head dim and KV heads, the plan's defaults (llama.cpp's
/// `attention.key_length_swa` and the sliding layers' `attention.head_count_kv`).
pub(crate) fn gguf_sliding_sizes(meta: &GgufMeta<'_>) -> Result<(usize, usize), ModelError> {
    let n_layers = meta.usize("block_count")?;
    let sliding = gguf_sliding_flags(meta, n_layers)?;
    let head_dim = meta.usize("attention.key_length_swa")?;
    if meta.opt_u64("attention.value_length_swa")?.is_some_and(|v| v as usize != head_dim) {
        return Err(meta.bad(meta.key("attention.value_length_swa"), "equal to attention.key_length_swa"));
    }
    let kv = gguf_per_layer(meta, "attention.head_count_kv", n_layers)?;
    let n_kv_heads = uniform(meta, "attention.head_count_kv", &kv, |l| sliding[l])?;
    Ok((head_dim, n_kv_heads.unwrap_or(kv[0])))
}

/// Gemma 4's traits from llama.cpp's `gemma4` keys (the common ones read first): the sliding
/// pattern and window, both RoPE bases, the global layers' sizes, their proportional RoPE from
/// `rope_freqs.weight`, keys as values where their `attn_v` is absent, the soft-cap. What the
/// plan does not run (per-layer input embeddings, layers sharing KV) is refused by its key.
pub(crate) fn gguf_traits(meta: &GgufMeta<'_>, c: &mut ModelConfig) -> Result<(), ModelError> {
    for (suffix, reason) in [
        ("embedding_length_per_layer_input", "0 (per-layer input embeddings are not supported)"),
        ("attention.shared_kv_layers", "0 (layers sharing another layer's KV are not supported)"),
    ] {
        if meta.opt_u64(suffix)?.unwrap_or(0) != 0 {
            return Err(meta.bad(meta.key(suffix), reason));
        }
    }
    let n = c.n_layers;
    let sliding = gguf_sliding_flags(meta, n)?;
    let head_dim = meta.usize("attention.key_length")?;
    if meta.opt_u64("attention.value_length")?.is_some_and(|v| v as usize != head_dim) {
        return Err(meta.bad(meta.key("attention.value_length"), "equal to attention.key_length"));
    }
    if meta.opt_u64("rope.dimension_count")?.is_some_and(|d| d as usize != head_dim) {
        return Err(meta.bad(meta.key("rope.dimension_count"), "equal to attention.key_length"));
    }
    if meta.opt_u64("rope.dimension_count_swa")?.is_some_and(|d| d as usize != c.head_dim) {
        return Err(meta.bad(meta.key("rope.dimension_count_swa"), "equal to attention.key_length_swa"));
    }
    let kv = gguf_per_layer(meta, "attention.head_count_kv", n)?;
    let n_kv_heads = uniform(meta, "attention.head_count_kv", &kv, |l| !sliding[l])?.unwrap_or(c.n_kv_heads);
    let first_global = (0..n).find(|&l| !sliding[l]);
    let turning_pairs = match first_global {
        Some(_) => gguf_turning_pairs(meta, head_dim)?,
        None => head_dim / 2,
    };
    let adapter = &ADAPTER;
    let values_from_keys = first_global.is_some_and(|l| {
        meta.file
            .tensor(&crate::model::naming::gguf_layer(adapter, l, crate::model::naming::LayerRole::V))
            .is_none()
    });
    let global_theta = c.rope_theta;
    c.rope_theta = meta.opt_f32("rope.freq_base_swa")?.unwrap_or(global_theta);
    c.rotary_dims = c.head_dim;
    c.sliding_window = Some(meta.usize("attention.sliding_window")?);
    c.sliding_window_layers = Some((0..n).filter(|&l| sliding[l]).collect());
    c.global_attention = Some(crate::model::config::GlobalAttention {
        head_dim,
        n_kv_heads,
        rope_theta: global_theta,
        turning_pairs,
        values_from_keys,
    });
    c.embedding_scale = Some((c.hidden as f64).sqrt() as f32);
    c.final_logit_softcap = meta.opt_f32("final_logit_softcapping")?.filter(|&cap| cap != 0.0);
    Ok(())
}

/// The proportional RoPE's turning pairs from llama.cpp's `rope_freqs.weight` (`[head_dim / 2]`):
/// the leading 1s turn at `theta^(-2i/head_dim)`, the rest (1e30) do not.
fn gguf_turning_pairs(meta: &GgufMeta<'_>, head_dim: usize) -> Result<usize, ModelError> {
    let name = crate::model::naming::GGUF_ROPE_FREQS;
    let path = meta.file.path();
    let t = meta
        .file
        .tensor(name)
        .ok_or_else(|| ModelError::MissingTensor { path: path.into(), tensor: name.into() })?;
    let bad = |reason: String| ModelError::BadValues { path: path.into(), tensor: name.into(), reason };
    if t.shape.iter().product::<usize>() != head_dim / 2 {
        return Err(ModelError::ShapeMismatch {
            path: path.into(),
            tensor: name.into(),
            expected: vec![head_dim / 2],
            found: t.shape.to_vec(),
        });
    }
    let factors = t.to_f32_vec().map_err(|e| bad(e.to_string()))?;
    let turning = factors.iter().take_while(|&&f| f == 1.0).count();
    match factors[turning..].iter().position(|&f| f.is_nan() || f < STILL_PAIR_MIN) {
        Some(i) => Err(bad(format!(
            "holds {} at {}: Gemma 4's proportional RoPE is 1 for each turning pair, then at least {STILL_PAIR_MIN:e}",
            factors[turning + i],
            turning + i
        ))),
        None => Ok(turning),
    }
}
