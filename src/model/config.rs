//! The numbers that describe one model (layer count, dims, expert counts, RoPE theta, ...),
//! parsed from a Hugging Face `config.json` or from GGUF metadata, validated once, and written back
//! out by `synth`. Architecture behaviour that is not a number lives in [`crate::model::arch`].

use crate::model::arch::{
    self, Adapter, Arch, DeltaNetProjections, RopeStyle, UnsupportedArch, VHeadOrder, YarnSpec,
};
use serde::Serialize;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// A validated model configuration.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelConfig {
    pub arch: Arch,
    pub n_layers: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub n_experts: usize,
    pub n_experts_used: usize,
    /// Intermediate size of one routed expert.
    pub expert_ff: usize,
    /// Intermediate size of the shared expert (0 when the architecture has none).
    pub shared_expert_ff: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    /// RoPE pairing of the q/k weights as stored in this file.
    pub rope_style: RopeStyle,
    /// Renormalise the top-k weights to sum to one (softmax-then-top-k routers only).
    pub norm_topk_prob: bool,
    pub tied_embeddings: bool,
    pub max_positions: usize,
    /// Attend only to the last `sliding_window` positions (Mixtral may set it).
    pub sliding_window: Option<usize>,
    /// The layers that use `sliding_window` (`layer_types`' `sliding_attention` entries; GPT-OSS:
    /// the even layers); `None`: every layer does.
    pub sliding_window_layers: Option<Vec<usize>>,
    /// YaRN RoPE scaling (`rope_parameters.rope_type` "yarn"; GGUF `rope.scaling.type`).
    pub yarn: Option<YarnSpec>,
    /// Linear RoPE scaling ("position interpolation", `rope_type` "linear"; GGUF
    /// `rope.scaling.type` "linear"): every frequency divided by this factor. At most one of
    /// `yarn` and this is set.
    pub rope_linear: Option<f32>,
    /// Clamp q/k/v projections to `[-clip, clip]` (OLMoE option).
    pub clip_qkv: Option<f32>,
    /// Leading values of each attention head that RoPE rotates (`head_dim`, or
    /// `partial_rotary_factor * head_dim`).
    pub rotary_dims: usize,
    /// Gated DeltaNet layers beside the attention layers (Qwen3-Next, Qwen3.5).
    pub hybrid: Option<HybridConfig>,
    /// RMSNorm weights are stored zero-centred (the scale is `1 + w`; transformers' Qwen3-Next
    /// and Qwen3.5 checkpoints), except the DeltaNet's gated norm.
    pub zero_centred_norms: bool,
    /// Multi-token-prediction (NextN) layers the file carries after the last layer: loaded,
    /// not run by a forward pass (`mtp_num_hidden_layers`, GGUF `nextn_predict_layers`).
    pub mtp_layers: usize,
    /// Multi-head latent attention in every layer (DeepSeek-V3, Kimi K2: `kv_lora_rank`).
    pub mla: Option<MlaConfig>,
    /// The first `count` layers have a dense FFN of `ff` instead of experts
    /// (`first_k_dense_replace` / `intermediate_size`; GGUF `leading_dense_block_count` /
    /// `feed_forward_length`).
    pub dense_layers: Option<DenseLayers>,
    /// Sigmoid routing with a selection bias, group-limited top-k and a weight scale
    /// (DeepSeek-V3: `n_group`, `topk_group`, `routed_scaling_factor`).
    pub sigmoid_routing: Option<SigmoidRouting>,
    /// Per-head RMSNorm of q and k where the architecture makes it optional (GLM-4.5's
    /// `use_qk_norm`; GGUF: `attn_q_norm` tensors present). Architectures whose q/k norm is fixed
    /// ignore it.
    pub qk_norm: bool,
    /// q/k/v biases where the architecture makes them optional (GLM-4.5's `attention_bias`,
    /// true in GLM-4.5/4.6 and false in some derivatives; GGUF: `attn_q.bias` tensors present).
    /// Architectures whose biases are fixed ignore it.
    pub attention_bias: bool,
    /// The global (full-attention) layers' own sizes beside the sliding ones' (Gemma 4);
    /// `None`: every layer has the sizes above.
    pub global_attention: Option<GlobalAttention>,
    /// Token embeddings are multiplied by this before the first layer (Gemma: `sqrt(hidden)`).
    pub embedding_scale: Option<f32>,
    /// Final logits are soft-capped, `cap * tanh(logits / cap)` (`final_logit_softcapping`).
    pub final_logit_softcap: Option<f32>,
}

/// Gemma 4's global layers: their head dim, KV heads, proportional RoPE and k-as-v
/// (`per_layer_config` / `global_head_dim`, `num_global_key_value_heads`, `attention_k_eq_v`,
/// `rope_parameters.full_attention`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GlobalAttention {
    pub head_dim: usize,
    pub n_kv_heads: usize,
    pub rope_theta: f32,
    /// The proportional RoPE's turning pairs: `partial_rotary_factor * head_dim / 2`.
    pub turning_pairs: usize,
    /// No v projection: the values are the k projection's output.
    pub values_from_keys: bool,
}

/// The latent attention's sizes (transformers' names).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MlaConfig {
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// YaRN's `mscale_all_dim` (0: none): the softmax scale is multiplied by
    /// `(0.1 mscale_all_dim ln(factor) + 1)^2` when RoPE is YaRN-scaled.
    pub mscale_all_dim: f32,
}

impl MlaConfig {
    /// The softmax scale of the latent attention, as transformers' `yarn_apply_mscale`.
    pub fn softmax_scale(&self, yarn: Option<&YarnSpec>) -> f32 {
        let base = 1.0 / ((self.qk_nope_head_dim + self.qk_rope_head_dim) as f64).sqrt();
        let m = match yarn {
            Some(y) if self.mscale_all_dim != 0.0 && y.factor > 1.0 => {
                0.1 * self.mscale_all_dim as f64 * (y.factor as f64).ln() + 1.0
            }
            _ => 1.0,
        };
        (base * m * m) as f32
    }
}

/// Leading dense FFN layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DenseLayers {
    pub count: usize,
    pub ff: usize,
}

/// DeepSeek-V3's router numbers.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SigmoidRouting {
    pub n_group: usize,
    pub topk_group: usize,
    pub routed_scaling_factor: f32,
}

/// The linear-attention side of a hybrid model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HybridConfig {
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
    pub conv_kernel: usize,
    /// The layers with full attention; every other layer is Gated DeltaNet.
    pub full_attention_layers: Vec<usize>,
    /// How the file stores the DeltaNet input projections and orders the value heads (the
    /// architecture's Hugging Face or GGUF layout).
    pub projections: DeltaNetProjections,
    pub v_heads: VHeadOrder,
}

impl HybridConfig {
    pub fn is_full_attention(&self, layer_idx: usize) -> bool {
        self.full_attention_layers.contains(&layer_idx)
    }

    /// Every `interval`-th layer full attention (`(l + 1) % interval == 0`), as transformers and
    /// llama.cpp derive it from `full_attention_interval`.
    pub fn every_nth_full(interval: usize, n_layers: usize) -> Vec<usize> {
        (0..n_layers).filter(|l| (l + 1) % interval.max(1) == 0).collect()
    }
}

/// A config that cannot be used, naming the file and the field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: missing field '{field}'")]
    MissingField { path: PathBuf, field: String },
    #[error("{path}: field '{field}' must be {expected}, found {found}")]
    WrongType { path: PathBuf, field: String, expected: &'static str, found: String },
    #[error("{path}: field '{field}': {reason}")]
    Invalid { path: PathBuf, field: String, reason: String },
    #[error("{path}: {source}")]
    Arch { path: PathBuf, source: UnsupportedArch },
}

/// Reads typed fields out of a `config.json` object with errors that name the field.
pub struct HfFields<'a> {
    path: &'a Path,
    value: &'a Value,
}

impl<'a> HfFields<'a> {
    fn raw(&self, field: &str) -> Option<&'a Value> {
        self.value.get(field).filter(|v| !v.is_null())
    }

    pub(crate) fn usize(&self, field: &str) -> Result<usize, ConfigError> {
        self.opt_usize(field)?
            .ok_or_else(|| ConfigError::MissingField { path: self.path.into(), field: field.into() })
    }

    /// An optional count (`n_shared_experts`).
    pub(crate) fn opt_count(&self, field: &str) -> Result<Option<usize>, ConfigError> {
        self.opt_usize(field)
    }

    fn opt_usize(&self, field: &str) -> Result<Option<usize>, ConfigError> {
        match self.raw(field) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| self.wrong(field, "a non-negative integer", v)),
        }
    }

    fn opt_f64(&self, field: &str) -> Result<Option<f64>, ConfigError> {
        match self.raw(field) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| self.wrong(field, "a number", v)),
        }
    }

    fn opt_bool(&self, field: &str) -> Result<Option<bool>, ConfigError> {
        match self.raw(field) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.wrong(field, "true or false", v)),
        }
    }

    fn opt_str(&self, field: &str) -> Result<Option<&'a str>, ConfigError> {
        match self.raw(field) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.wrong(field, "a string", v)),
        }
    }

    fn wrong(&self, field: &str, expected: &'static str, found: &Value) -> ConfigError {
        ConfigError::WrongType {
            path: self.path.into(),
            field: field.into(),
            expected,
            found: found.to_string(),
        }
    }

    fn invalid(&self, field: &str, reason: impl Into<String>) -> ConfigError {
        ConfigError::Invalid { path: self.path.into(), field: field.into(), reason: reason.into() }
    }

    /// `num_experts`, or `num_local_experts` (transformers 5 saves qwen3_moe that way).
    pub(crate) fn expert_count(&self) -> Result<usize, ConfigError> {
        match self.opt_usize("num_experts")? {
            Some(n) => Ok(n),
            None => self.usize("num_local_experts").map_err(|_| ConfigError::MissingField {
                path: self.path.into(),
                field: "num_experts".into(),
            }),
        }
    }

    /// `rope_theta`, or transformers 5's `rope_parameters.rope_theta`.
    fn rope_theta(&self, default: f32) -> Result<f32, ConfigError> {
        if let Some(theta) = self.opt_f64("rope_theta")? {
            return Ok(theta as f32);
        }
        if let Some(params) = self.raw("rope_parameters") {
            let nested = HfFields { path: self.path, value: params };
            if let Some(kind) = nested.opt_str("rope_type")? {
                if !["default", "yarn", "linear"].contains(&kind) {
                    return Err(
                        self.invalid("rope_parameters.rope_type", format!("'{kind}' is not supported"))
                    );
                }
            }
            if let Some(theta) = nested.opt_f64("rope_theta")? {
                return Ok(theta as f32);
            }
        }
        Ok(default)
    }

    /// `partial_rotary_factor` (in `rope_parameters` or at the top level) times `head_dim`.
    fn rotary_dims(&self, head_dim: usize, default_factor: f64) -> Result<usize, ConfigError> {
        let nested = self.raw("rope_parameters").map(|value| HfFields { path: self.path, value });
        let factor = match nested.as_ref().map(|n| n.opt_f64("partial_rotary_factor")).transpose()?.flatten()
        {
            Some(f) => f,
            None => self.opt_f64("partial_rotary_factor")?.unwrap_or(default_factor),
        };
        let dims = (head_dim as f64 * factor) as usize;
        if !(factor > 0.0 && factor <= 1.0) || dims == 0 || !dims.is_multiple_of(2) {
            return Err(self.invalid(
                "partial_rotary_factor",
                format!("{factor} of head_dim {head_dim} must give an even, positive number of rotated dims"),
            ));
        }
        Ok(dims)
    }

    /// The DeltaNet sizes and which layers are full attention (`layer_types`, else
    /// `full_attention_interval`, default 4).
    fn hybrid(&self, n_layers: usize, projections: DeltaNetProjections) -> Result<HybridConfig, ConfigError> {
        let full_attention_layers = match self.raw("layer_types") {
            Some(types) => self.full_layers_from_types(types, n_layers)?,
            None => {
                let interval = self.opt_usize("full_attention_interval")?.unwrap_or(4);
                if interval == 0 {
                    return Err(self.invalid("full_attention_interval", "must be greater than zero"));
                }
                HybridConfig::every_nth_full(interval, n_layers)
            }
        };
        Ok(HybridConfig {
            n_k_heads: self.usize("linear_num_key_heads")?,
            n_v_heads: self.usize("linear_num_value_heads")?,
            k_head_dim: self.usize("linear_key_head_dim")?,
            v_head_dim: self.usize("linear_value_head_dim")?,
            conv_kernel: self.opt_usize("linear_conv_kernel_dim")?.unwrap_or(4),
            full_attention_layers,
            projections,
            v_heads: VHeadOrder::Grouped,
        })
    }

    fn full_layers_from_types(&self, types: &Value, n_layers: usize) -> Result<Vec<usize>, ConfigError> {
        let list = types.as_array().ok_or_else(|| self.wrong("layer_types", "a list of strings", types))?;
        if list.len() != n_layers {
            return Err(self.invalid("layer_types", format!("{} entries for {n_layers} layers", list.len())));
        }
        let mut full = Vec::new();
        for (l, t) in list.iter().enumerate() {
            match t.as_str() {
                Some("full_attention") => full.push(l),
                Some("linear_attention") => {}
                _ => {
                    return Err(self.invalid(
                        "layer_types",
                        format!("entry {l} is {t}: expected \"full_attention\" or \"linear_attention\""),
                    ))
                }
            }
        }
        Ok(full)
    }

    /// The factor of linear RoPE scaling from `rope_scaling` or `rope_parameters` (`rope_type`
    /// or `type` "linear"), at least 1; `None` for any other kind.
    fn rope_linear(&self) -> Result<Option<f32>, ConfigError> {
        let Some((field, scaling)) = self.rope_scaling_field() else { return Ok(None) };
        let kind = scaling.get("rope_type").or_else(|| scaling.get("type")).and_then(Value::as_str);
        if kind != Some("linear") {
            return Ok(None);
        }
        let f = HfFields { path: self.path, value: scaling };
        match f.opt_f64("factor")? {
            Some(factor) if factor >= 1.0 && factor.is_finite() => Ok(Some(factor as f32)),
            other => {
                Err(self.invalid(field, format!("linear RoPE scaling needs a 'factor' >= 1, not {other:?}")))
            }
        }
    }

    /// Where the RoPE scaling is: `rope_scaling` (older Hub configs), else transformers 5's
    /// `rope_parameters`.
    fn rope_scaling_field(&self) -> Option<(&'static str, &Value)> {
        match (self.raw("rope_parameters"), self.raw("rope_scaling")) {
            (_, Some(s)) => Some(("rope_scaling", s)),
            (Some(p), None) => Some(("rope_parameters", p)),
            (None, None) => None,
        }
    }

    /// YaRN scaling from `rope_parameters` (transformers 5) or `rope_scaling`; other scaling
    /// kinds than linear ([`Self::rope_linear`]) are refused by name.
    fn yarn(&self) -> Result<Option<YarnSpec>, ConfigError> {
        let Some((field, scaling)) = self.rope_scaling_field() else { return Ok(None) };
        let kind = scaling.get("rope_type").or_else(|| scaling.get("type")).and_then(Value::as_str);
        match kind {
            None | Some("default") | Some("linear") => return Ok(None),
            Some("yarn") => {}
            Some(other) => {
                return Err(self.invalid(field, format!("'{other}' RoPE scaling is not supported")))
            }
        }
        let f = HfFields { path: self.path, value: scaling };
        let named = |e: ConfigError| match e {
            ConfigError::MissingField { path, field: inner } => {
                ConfigError::MissingField { path, field: format!("{field}.{inner}") }
            }
            other => other,
        };
        let factor = f.opt_f64("factor")?.ok_or_else(|| self.invalid(field, "yarn needs 'factor'"))? as f32;
        let original_context = f.usize("original_max_position_embeddings").map_err(named)?;
        if factor.partial_cmp(&1.0).is_none_or(|o| o.is_lt()) || original_context == 0 {
            return Err(self.invalid(
                field,
                format!("yarn factor {factor} must be >= 1 and original_max_position_embeddings > 0"),
            ));
        }
        // DeepSeek's `mscale` / `mscale_all_dim`: the attention factor is their ratio
        // (transformers' `_compute_yarn_parameters`); `mscale_all_dim` also scales the softmax
        // of a latent attention (`MlaConfig::softmax_scale`).
        let mscale = |v: f64| if factor <= 1.0 { 1.0 } else { 0.1 * v * (factor as f64).ln() + 1.0 };
        let attention_factor =
            match (f.opt_f64("attention_factor")?, f.opt_f64("mscale")?, f.opt_f64("mscale_all_dim")?) {
                (Some(a), _, _) => a as f32,
                (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => (mscale(m) / mscale(all)) as f32,
                (None, _, _) => arch::yarn_default_attention_factor(factor),
            };
        Ok(Some(YarnSpec {
            factor,
            original_context,
            beta_fast: f.opt_f64("beta_fast")?.unwrap_or(32.0) as f32,
            beta_slow: f.opt_f64("beta_slow")?.unwrap_or(1.0) as f32,
            truncate: f.opt_bool("truncate")?.unwrap_or(true),
            attention_factor,
        }))
    }

    /// The layers `layer_types` marks `sliding_attention` (an attention-only model's); `None`
    /// without `layer_types`, or `default` when the architecture has its own pattern.
    fn sliding_layers(
        &self,
        n_layers: usize,
        default: Option<Vec<usize>>,
    ) -> Result<Option<Vec<usize>>, ConfigError> {
        let Some(types) = self.raw("layer_types") else { return Ok(default) };
        let list = types.as_array().ok_or_else(|| self.wrong("layer_types", "a list of strings", types))?;
        if list.len() != n_layers {
            return Err(self.invalid("layer_types", format!("{} entries for {n_layers} layers", list.len())));
        }
        let mut sliding = Vec::new();
        for (l, t) in list.iter().enumerate() {
            match t.as_str() {
                Some("sliding_attention") => sliding.push(l),
                Some("full_attention") => {}
                _ => {
                    return Err(self.invalid(
                        "layer_types",
                        format!("entry {l} is {t}: expected \"full_attention\" or \"sliding_attention\""),
                    ))
                }
            }
        }
        Ok(Some(sliding))
    }

    /// The latent attention's sizes, when the config has `kv_lora_rank`.
    fn mla(&self) -> Result<Option<MlaConfig>, ConfigError> {
        let Some(kv_lora_rank) = self.opt_usize("kv_lora_rank")? else { return Ok(None) };
        let scaling = self.raw("rope_scaling").or_else(|| self.raw("rope_parameters"));
        let mscale_all_dim = match scaling {
            Some(value) => HfFields { path: self.path, value }.opt_f64("mscale_all_dim")?.unwrap_or(0.0),
            None => 0.0,
        };
        Ok(Some(MlaConfig {
            q_lora_rank: self.opt_usize("q_lora_rank")?,
            kv_lora_rank,
            qk_nope_head_dim: self.usize("qk_nope_head_dim")?,
            qk_rope_head_dim: self.usize("qk_rope_head_dim")?,
            v_head_dim: self.usize("v_head_dim")?,
            mscale_all_dim: mscale_all_dim as f32,
        }))
    }

    /// `first_k_dense_replace` leading dense layers of `intermediate_size`.
    fn dense_layers(&self, n_layers: usize) -> Result<Option<DenseLayers>, ConfigError> {
        match self.opt_usize("first_k_dense_replace")? {
            None | Some(0) => Ok(None),
            Some(count) if count >= n_layers => Err(self.invalid(
                "first_k_dense_replace",
                format!("{count} dense layers of {n_layers}: at least one layer must have experts"),
            )),
            Some(count) => Ok(Some(DenseLayers { count, ff: self.usize("intermediate_size")? })),
        }
    }

    /// DeepSeek-V3's router numbers (`n_group`, `topk_group`, `routed_scaling_factor`).
    fn sigmoid_routing(&self) -> Result<Option<SigmoidRouting>, ConfigError> {
        let scale = self.opt_f64("routed_scaling_factor")?;
        let n_group = self.opt_usize("n_group")?;
        if scale.is_none() && n_group.is_none() {
            return Ok(None);
        }
        Ok(Some(SigmoidRouting {
            n_group: n_group.unwrap_or(1),
            topk_group: self.opt_usize("topk_group")?.unwrap_or(1),
            routed_scaling_factor: scale.unwrap_or(1.0) as f32,
        }))
    }

    /// Gemma 4's fields (`config` parsed by the common path first): refuses what the plan does
    /// not run (per-layer input embeddings, shared KV layers, bidirectional attention, a dense
    /// model), reads the layer types, both RoPEs, the global layers' sizes, the soft-cap.
    fn gemma4(&self, config: &mut ModelConfig) -> Result<(), ConfigError> {
        let act = match self.opt_str("hidden_activation")? {
            Some(a) => Some(("hidden_activation", a)),
            None => self.opt_str("hidden_act")?.map(|a| ("hidden_act", a)),
        };
        if let Some((field, a)) = act.filter(|(_, a)| !matches!(*a, "gelu_pytorch_tanh" | "gelu_new")) {
            return Err(self.invalid(field, format!("'{}' is not supported (expected gelu_pytorch_tanh)", a)));
        }
        if self.opt_bool("enable_moe_block")? != Some(true) {
            return Err(self.invalid("enable_moe_block", "only the MoE Gemma 4 (true) is supported"));
        }
        let refused = [
            ("hidden_size_per_layer_input", "per-layer input embeddings are not supported"),
            ("num_kv_shared_layers", "layers sharing another layer's KV are not supported"),
        ];
        for (field, reason) in refused {
            if self.opt_usize(field)?.unwrap_or(0) != 0 {
                return Err(self.invalid(field, reason));
            }
        }
        if let Some(mode) = self.opt_str("use_bidirectional_attention")?.filter(|m| *m == "all") {
            return Err(self.invalid("use_bidirectional_attention", format!("'{mode}' is not supported")));
        }
        if self.opt_bool("attention_bias")? == Some(true) {
            return Err(self.invalid("attention_bias", "q/k/v/o biases are not supported for gemma4"));
        }
        let n = config.n_layers;
        let sliding = match self.raw("layer_types") {
            Some(_) => self.sliding_layers(n, None)?.unwrap_or_default(),
            // transformers' default: five sliding layers, then a global one; the last global.
            None => (0..n).filter(|l| (l + 1) % 6 != 0 && l + 1 != n).collect(),
        };
        let window = self.usize("sliding_window")?;
        let (sliding_theta, full_rope) = self.gemma4_ropes()?;
        config.sliding_window = Some(window);
        config.sliding_window_layers = Some(sliding.clone());
        config.rope_theta = sliding_theta;
        config.rotary_dims = config.head_dim;
        let (head_dim, n_kv_heads) = self.gemma4_global_sizes(config, &sliding)?;
        let (theta, factor) = full_rope;
        config.global_attention = Some(GlobalAttention {
            head_dim,
            n_kv_heads,
            rope_theta: theta,
            turning_pairs: (factor * head_dim as f64 / 2.0).floor() as usize,
            values_from_keys: self.opt_bool("attention_k_eq_v")?.unwrap_or(false),
        });
        config.embedding_scale = Some((config.hidden as f64).sqrt() as f32);
        config.final_logit_softcap = self.opt_f64("final_logit_softcapping")?.map(|c| c as f32);
        Ok(())
    }

    /// `rope_parameters.sliding_attention` (plain RoPE: its theta) and `.full_attention`
    /// (proportional RoPE: theta and `partial_rotary_factor`); transformers' defaults without them.
    fn gemma4_ropes(&self) -> Result<(f32, (f32, f64)), ConfigError> {
        let Some(params) = self.raw("rope_parameters") else { return Ok((10_000.0, (1_000_000.0, 0.25))) };
        let of = |kind: &str| -> Result<Option<HfFields<'a>>, ConfigError> {
            Ok(params.get(kind).filter(|v| !v.is_null()).map(|value| HfFields { path: self.path, value }))
        };
        let field = |kind: &str| format!("rope_parameters.{kind}");
        let sliding = of("sliding_attention")?;
        let sliding_theta = match &sliding {
            Some(s) => {
                if let Some(t) = s.opt_str("rope_type")?.filter(|t| *t != "default") {
                    return Err(
                        self.invalid(&field("sliding_attention"), format!("'{t}' RoPE is not supported"))
                    );
                }
                s.opt_f64("rope_theta")?.unwrap_or(10_000.0) as f32
            }
            None => 10_000.0,
        };
        let full = match of("full_attention")? {
            Some(g) => {
                let factor = match g.opt_str("rope_type")? {
                    Some("proportional") => g.opt_f64("partial_rotary_factor")?.unwrap_or(1.0),
                    None | Some("default") => 1.0,
                    Some(t) => {
                        return Err(
                            self.invalid(&field("full_attention"), format!("'{t}' RoPE is not supported"))
                        )
                    }
                };
                if g.opt_f64("factor")?.is_some_and(|f| f != 1.0) {
                    return Err(self
                        .invalid(&field("full_attention"), "a RoPE 'factor' other than 1 is not supported"));
                }
                if !(factor > 0.0 && factor <= 1.0) {
                    return Err(
                        self.invalid(&field("full_attention"), format!("partial_rotary_factor {factor}"))
                    );
                }
                (g.opt_f64("rope_theta")?.unwrap_or(1_000_000.0) as f32, factor)
            }
            None => (1_000_000.0, 0.25),
        };
        Ok((sliding_theta, full))
    }

    /// The global layers' head dim and KV heads: `per_layer_config` (what transformers saves; every
    /// global layer the same, no sliding layer overridden), else `global_head_dim` (default 512)
    /// and `num_global_key_value_heads` (read where `attention_k_eq_v`, as transformers does).
    fn gemma4_global_sizes(&self, c: &ModelConfig, sliding: &[usize]) -> Result<(usize, usize), ConfigError> {
        let Some(per_layer) = self.raw("per_layer_config") else {
            let head_dim = self.opt_usize("global_head_dim")?.unwrap_or(512);
            let kv = match self.opt_bool("attention_k_eq_v")?.unwrap_or(false) {
                true => self.opt_usize("num_global_key_value_heads")?,
                false => None,
            };
            return Ok((head_dim, kv.unwrap_or(c.n_kv_heads)));
        };
        let map =
            per_layer.as_object().ok_or_else(|| self.wrong("per_layer_config", "an object", per_layer))?;
        let mut sizes = None;
        for l in (0..c.n_layers).filter(|l| !sliding.contains(l)) {
            let entry = map.get(&l.to_string()).filter(|v| !v.is_null());
            let e = entry.map(|value| HfFields { path: self.path, value });
            let head_dim =
                e.as_ref().map(|e| e.opt_usize("head_dim")).transpose()?.flatten().unwrap_or(c.head_dim);
            let kv = e.as_ref().map(|e| e.opt_usize("num_key_value_heads")).transpose()?.flatten();
            let this = (head_dim, kv.unwrap_or(c.n_kv_heads));
            if sizes.is_some_and(|s| s != this) {
                return Err(self.invalid(
                    "per_layer_config",
                    format!("layer {l}: every global layer must have the same sizes"),
                ));
            }
            sizes = Some(this);
        }
        if let Some(l) = sliding.iter().find(|l| map.contains_key(&l.to_string())) {
            return Err(
                self.invalid("per_layer_config", format!("sliding layer {l}: overrides are not supported"))
            );
        }
        Ok(sizes.unwrap_or((c.head_dim, c.n_kv_heads)))
    }

    /// `num_experts_per_tok`, or Gemma 4's `top_k_experts`.
    fn experts_per_token(&self) -> Result<usize, ConfigError> {
        match self.opt_usize("top_k_experts")? {
            Some(k) => Ok(k),
            None => self.usize("num_experts_per_tok"),
        }
    }

    /// GPT-OSS's clamped SwiGLU constants: the kernels implement 1.702 and 7 only.
    fn check_swiglu(&self) -> Result<(), ConfigError> {
        for (field, want) in [("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)] {
            if let Some(v) = self.opt_f64(field)? {
                if (v - want).abs() > 1e-6 {
                    return Err(self.invalid(field, format!("{v}: only {want} is supported")));
                }
            }
        }
        Ok(())
    }
}

impl ModelConfig {
    /// Parse and validate a Hugging Face `config.json` value read from `path`.
    pub fn from_hf_json(value: &Value, path: &Path) -> Result<(ModelConfig, &'static Adapter), ConfigError> {
        let f = HfFields { path, value };
        if !value.is_object() {
            return Err(ConfigError::WrongType {
                path: path.into(),
                field: "(top level)".into(),
                expected: "a JSON object",
                found: value.to_string(),
            });
        }
        let model_type = f
            .opt_str("model_type")?
            .ok_or_else(|| ConfigError::MissingField { path: path.into(), field: "model_type".into() })?;
        let adapter = arch::for_hf_model_type(model_type)
            .map_err(|source| ConfigError::Arch { path: path.into(), source })?;
        // A multimodal checkpoint nests the language model's config (Qwen3.5's `text_config`).
        let nested = adapter.hybrid.hf_text_model_type.is_some() && model_type == adapter.hf_model_type;
        let text;
        let f = if nested {
            text = f.raw("text_config").ok_or_else(|| ConfigError::MissingField {
                path: path.into(),
                field: "text_config".into(),
            })?;
            HfFields { path, value: text }
        } else {
            f
        };
        if let Some(act) = f.opt_str("hidden_act")? {
            if act != "silu" {
                return Err(f.invalid(
                    "hidden_act",
                    format!("'{act}' is not supported for {model_type} (expected silu)"),
                ));
            }
        }
        let (yarn, rope_linear) = (f.yarn()?, f.rope_linear()?);
        refuse_dense_layers(&f)?;
        let hidden = f.usize("hidden_size")?;
        let n_heads = f.usize("num_attention_heads")?;
        let n_kv_heads = f.opt_usize("num_key_value_heads")?.unwrap_or(n_heads);
        let head_dim = match f.opt_usize("head_dim")? {
            Some(d) => d,
            None if n_heads > 0 && hidden % n_heads == 0 => hidden / n_heads,
            None => return Err(f.invalid("num_attention_heads", "hidden_size is not a multiple of it")),
        };
        let dims = (adapter.hf_expert_dims)(&f)?;
        let sliding_window = match f.opt_bool("use_sliding_window")? {
            Some(false) => None,
            _ => f.opt_usize("sliding_window")?,
        };
        let mla = f.mla()?;
        // A latent attention's RoPE part is its `head_dim` (as transformers sets it).
        let head_dim = mla.map_or(head_dim, |m| m.qk_rope_head_dim);
        let rope_style = match f.opt_bool("rope_interleave")? {
            Some(false) if mla.is_some() => RopeStyle::HalfSplit,
            _ => adapter.rope_style,
        };
        let rotary_dims = f.rotary_dims(head_dim, adapter.hybrid.default_partial_rotary)?;
        let n_layers = f.usize("num_hidden_layers")?;
        let dense_layers = f.dense_layers(n_layers)?;
        let sigmoid_routing = f.sigmoid_routing()?;
        let hybrid = adapter.hybrid.delta_net.map(|p| f.hybrid(n_layers, p)).transpose()?;
        let sliding_window_layers = if hybrid.is_some() {
            None
        } else {
            let oss = adapter.arch == Arch::GptOss;
            let default = oss.then(|| every_other_layer(n_layers));
            f.sliding_layers(n_layers, default)?
        };
        if adapter.arch == Arch::GptOss {
            f.check_swiglu()?;
        }
        let mut config = ModelConfig {
            arch: adapter.arch,
            n_layers,
            hidden,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab: f.usize("vocab_size")?,
            n_experts: dims.n_experts,
            n_experts_used: f.experts_per_token()?,
            expert_ff: dims.expert_ff,
            shared_expert_ff: dims.shared_expert_ff,
            rms_eps: f.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            rope_theta: f.rope_theta(adapter.default_rope_theta)?,
            rope_style,
            norm_topk_prob: f.opt_bool("norm_topk_prob")?.unwrap_or(adapter.hf_default_norm_topk),
            tied_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            max_positions: f.opt_usize("max_position_embeddings")?.unwrap_or(4096),
            sliding_window,
            sliding_window_layers,
            yarn,
            rope_linear,
            clip_qkv: f.opt_f64("clip_qkv")?.map(|c| c as f32),
            rotary_dims,
            hybrid,
            zero_centred_norms: adapter.hybrid.hf_zero_centred_norms,
            mtp_layers: match f.opt_usize("mtp_num_hidden_layers")? {
                Some(n) => n,
                None => f.opt_usize("num_nextn_predict_layers")?.unwrap_or(0),
            },
            mla,
            dense_layers,
            sigmoid_routing,
            qk_norm: f.opt_bool("use_qk_norm")?.unwrap_or(false),
            attention_bias: false,
            global_attention: None,
            embedding_scale: None,
            final_logit_softcap: None,
        };
        (adapter.arch == Arch::Gemma4).then(|| f.gemma4(&mut config)).transpose()?;
        config.validate().map_err(|(field, reason)| f.invalid(field, reason))?;
        // Read only where the architecture leaves the biases to the config (GLM-4.5), so a
        // config's flag never disagrees with an architecture that fixes them.
        if config.attention_bias_is_optional(adapter) {
            config.attention_bias = f.opt_bool("attention_bias")?.unwrap_or(false);
        }
        Ok((config, adapter))
    }

    /// Whether `adapter`'s layers take their q/k/v biases from [`ModelConfig::attention_bias`]
    /// (GLM-4.5) rather than fixing them.
    pub fn attention_bias_is_optional(&self, adapter: &Adapter) -> bool {
        let qkv_bias = |flag: bool| {
            let c = ModelConfig { attention_bias: flag, ..self.clone() };
            (0..c.n_layers).find_map(|l| (adapter.layer)(&c, l).as_attention().map(|a| a.qkv_bias))
        };
        qkv_bias(true) != qkv_bias(false)
    }

    /// Check the relations between fields; returns the offending field and why.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        let positive = [
            ("num_hidden_layers", self.n_layers),
            ("hidden_size", self.hidden),
            ("num_attention_heads", self.n_heads),
            ("num_key_value_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab),
            ("num_experts", self.n_experts),
            ("num_experts_per_tok", self.n_experts_used),
            ("expert intermediate size", self.expert_ff),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err((field, "must be greater than zero".into()));
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err((
                "num_key_value_heads",
                format!("{} does not divide {} heads", self.n_kv_heads, self.n_heads),
            ));
        }
        if self.n_experts_used > self.n_experts {
            return Err((
                "num_experts_per_tok",
                format!("{} exceeds {} experts", self.n_experts_used, self.n_experts),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(("head_dim", format!("{} is odd; RoPE needs pairs", self.head_dim)));
        }
        // Written so NaN fails too (NaN > 0.0 is false).
        let positive = |v: f32| v.partial_cmp(&0.0) == Some(std::cmp::Ordering::Greater);
        if !positive(self.rms_eps) || !positive(self.rope_theta) {
            return Err(("rms_norm_eps/rope_theta", "must be positive".into()));
        }
        if self.rotary_dims == 0 || self.rotary_dims > self.head_dim || !self.rotary_dims.is_multiple_of(2) {
            return Err((
                "partial_rotary_factor",
                format!(
                    "{} rotated dims of head_dim {}: must be even and 2..=head_dim",
                    self.rotary_dims, self.head_dim
                ),
            ));
        }
        self.validate_deepseek()?;
        if let Some(g) = &self.global_attention {
            if g.head_dim == 0 || !g.head_dim.is_multiple_of(2) || g.turning_pairs > g.head_dim / 2 {
                return Err((
                    "per_layer_config.head_dim",
                    format!("global head dim {}: must be even and positive", g.head_dim),
                ));
            }
            if g.n_kv_heads == 0 || !self.n_heads.is_multiple_of(g.n_kv_heads) {
                return Err((
                    "num_global_key_value_heads",
                    format!("{} does not divide {} heads", g.n_kv_heads, self.n_heads),
                ));
            }
        }
        match &self.hybrid {
            Some(h) => h.validate(self.n_layers),
            None => Ok(()),
        }
    }

    /// The latent attention's and the grouped router's sizes.
    fn validate_deepseek(&self) -> Result<(), (&'static str, String)> {
        if let Some(m) = &self.mla {
            let sizes = [
                ("kv_lora_rank", m.kv_lora_rank),
                ("qk_nope_head_dim", m.qk_nope_head_dim),
                ("qk_rope_head_dim", m.qk_rope_head_dim),
                ("v_head_dim", m.v_head_dim),
                ("q_lora_rank", m.q_lora_rank.unwrap_or(1)),
            ];
            if let Some((field, _)) = sizes.iter().find(|(_, v)| *v == 0) {
                return Err((field, "must be greater than zero".into()));
            }
        }
        if let Some(d) = &self.dense_layers {
            if d.ff == 0 {
                return Err(("intermediate_size", "must be greater than zero".into()));
            }
        }
        if let Some(r) = &self.sigmoid_routing {
            let per_group = self.n_experts / r.n_group.max(1);
            if r.n_group == 0 || !self.n_experts.is_multiple_of(r.n_group) || per_group < 2 {
                return Err((
                    "n_group",
                    format!(
                        "{} groups of {} experts: groups must divide them, two or more each",
                        r.n_group, self.n_experts
                    ),
                ));
            }
            if r.topk_group == 0 || r.topk_group > r.n_group || r.topk_group * per_group < self.n_experts_used
            {
                return Err((
                    "topk_group",
                    format!(
                        "{} of {} groups of {per_group} cannot hold the {} experts each token takes",
                        r.topk_group, r.n_group, self.n_experts_used
                    ),
                ));
            }
            if !(r.routed_scaling_factor.is_finite() && r.routed_scaling_factor > 0.0) {
                return Err((
                    "routed_scaling_factor",
                    format!("{}: must be positive", r.routed_scaling_factor),
                ));
            }
        }
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// The sliding window of layer `layer_idx`, `None` for full attention.
    pub fn window_of(&self, layer_idx: usize) -> Option<usize> {
        match &self.sliding_window_layers {
            Some(layers) if !layers.contains(&layer_idx) => None,
            _ => self.sliding_window,
        }
    }

    /// The layers that hold a KV cache (every layer but a hybrid's DeltaNet layers).
    pub fn n_attention_layers(&self) -> usize {
        self.hybrid.as_ref().map_or(self.n_layers, |h| h.full_attention_layers.len())
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// The global attention sizes of layer `layer_idx`, `None` where it has the config's own
    /// (a sliding layer, or every layer without [`ModelConfig::global_attention`]).
    pub fn global_of(&self, layer_idx: usize) -> Option<&GlobalAttention> {
        self.global_attention.as_ref().filter(|_| self.window_of(layer_idx).is_none())
    }

    /// Keys (or values) per position of layer `layer_idx`, an attention layer.
    pub fn layer_kv_dim(&self, layer_idx: usize) -> usize {
        self.global_of(layer_idx).map_or(self.kv_dim(), |g| g.n_kv_heads * g.head_dim)
    }

    /// The widest head of any layer.
    pub fn max_head_dim(&self) -> usize {
        self.global_attention.map_or(self.head_dim, |g| g.head_dim.max(self.head_dim))
    }

    /// The most KV heads of any layer.
    pub fn max_kv_heads(&self) -> usize {
        self.global_attention.map_or(self.n_kv_heads, |g| g.n_kv_heads.max(self.n_kv_heads))
    }

    /// The widest q (every head, no gate) of any layer.
    pub fn max_q_dim(&self) -> usize {
        self.n_heads * self.max_head_dim()
    }

    /// The widest k (or v) of any layer.
    pub fn max_kv_dim(&self) -> usize {
        (0..self.n_layers).map(|l| self.layer_kv_dim(l)).max().unwrap_or(0)
    }

    /// A `config.json` that `transformers` loads for this architecture.
    pub fn to_hf_json(&self, adapter: &Adapter) -> Value {
        // The config has one flag for these, so every layer of the architecture shares them.
        let activation = (0..self.n_layers)
            .find_map(|l| (adapter.layer)(self, l).as_moe().map(|m| m.activation))
            .unwrap_or(arch::FfnActivation::Silu);
        let attention_bias = (0..self.n_layers)
            .find_map(|l| (adapter.layer)(self, l).as_attention().map(|a| a.qkv_bias))
            .unwrap_or(false);
        let mut v = json!({
            "model_type": adapter.hf_model_type,
            "architectures": [adapter.hf_class],
            "num_hidden_layers": self.n_layers,
            "hidden_size": self.hidden,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "num_experts_per_tok": self.n_experts_used,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "norm_topk_prob": self.norm_topk_prob,
            "tie_word_embeddings": self.tied_embeddings,
            "max_position_embeddings": self.max_positions,
            "hidden_act": activation.hf_name(),
            "attention_bias": attention_bias,
            "torch_dtype": "bfloat16",
            "bos_token_id": self.vocab - 1,
            "eos_token_id": self.vocab - 1,
        });
        let obj = v.as_object_mut().expect("json! object");
        if self.rotary_dims != self.head_dim {
            obj.insert("partial_rotary_factor".into(), json!(self.rotary_dims as f64 / self.head_dim as f64));
        }
        if let Some(factor) = self.rope_linear {
            obj.insert("rope_scaling".into(), json!({"rope_type": "linear", "factor": factor}));
        }
        if let Some(y) = self.yarn {
            // Architectures with their own `rope_parameters` (DeepSeek, GPT-OSS) replace this.
            obj.insert(
                "rope_scaling".into(),
                json!({
                    "rope_type": "yarn", "factor": y.factor,
                    "original_max_position_embeddings": y.original_context,
                    "beta_fast": y.beta_fast, "beta_slow": y.beta_slow,
                }),
            );
        }
        if let Some(h) = &self.hybrid {
            obj.insert("linear_num_key_heads".into(), json!(h.n_k_heads));
            obj.insert("linear_num_value_heads".into(), json!(h.n_v_heads));
            obj.insert("linear_key_head_dim".into(), json!(h.k_head_dim));
            obj.insert("linear_value_head_dim".into(), json!(h.v_head_dim));
            obj.insert("linear_conv_kernel_dim".into(), json!(h.conv_kernel));
            let types: Vec<&str> = (0..self.n_layers)
                .map(|l| if h.is_full_attention(l) { "full_attention" } else { "linear_attention" })
                .collect();
            obj.insert("layer_types".into(), json!(types));
        }
        (adapter.hf_extra_fields)(self, obj);
        if obj.contains_key("rope_parameters") {
            obj.remove("rope_scaling");
        }
        match adapter.hybrid.hf_text_model_type {
            // The published multimodal form: the language model's config nested.
            Some(text_type) => {
                obj.insert("model_type".into(), json!(text_type));
                obj.remove("architectures");
                json!({
                    "model_type": adapter.hf_model_type,
                    "architectures": [adapter.hf_class],
                    "tie_word_embeddings": self.tied_embeddings,
                    "text_config": v,
                })
            }
            None => v,
        }
    }
}

impl HybridConfig {
    fn validate(&self, n_layers: usize) -> Result<(), (&'static str, String)> {
        let positive = [
            ("linear_num_key_heads", self.n_k_heads),
            ("linear_num_value_heads", self.n_v_heads),
            ("linear_key_head_dim", self.k_head_dim),
            ("linear_value_head_dim", self.v_head_dim),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err((field, "must be greater than zero".into()));
            }
        }
        if self.conv_kernel < 2 {
            return Err((
                "linear_conv_kernel_dim",
                format!("{}: the conv needs a width of at least 2", self.conv_kernel),
            ));
        }
        if !self.n_v_heads.is_multiple_of(self.n_k_heads) {
            return Err((
                "linear_num_value_heads",
                format!("{} is not a multiple of {} key heads", self.n_v_heads, self.n_k_heads),
            ));
        }
        if let Some(&l) = self.full_attention_layers.iter().find(|&&l| l >= n_layers) {
            return Err(("layer_types", format!("full-attention layer {l} is past the {n_layers} layers")));
        }
        Ok(())
    }
}

/// Layers 0, 2, 4, ...: GPT-OSS's sliding layers (transformers' default `layer_types`, llama.cpp's
/// SWA pattern 2).
pub fn every_other_layer(n_layers: usize) -> Vec<usize> {
    (0..n_layers).step_by(2).collect()
}

/// Layers with a dense MLP instead of experts (`mlp_only_layers`, `decoder_sparse_step` > 1) are
/// not supported yet: every layer must be a MoE layer.
fn refuse_dense_layers(f: &HfFields<'_>) -> Result<(), ConfigError> {
    if let Some(layers) = f.raw("mlp_only_layers") {
        let empty = layers.as_array().map(|a| a.is_empty()).unwrap_or(false);
        if !empty {
            return Err(f.invalid("mlp_only_layers", format!("dense MLP layers {layers} are not supported")));
        }
    }
    if let Some(step) = f.opt_usize("decoder_sparse_step")? {
        if step != 1 {
            return Err(
                f.invalid("decoder_sparse_step", format!("{step}: only every-layer MoE (1) is supported"))
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen3_json() -> Value {
        json!({
            "model_type": "qwen3_moe", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 24, "vocab_size": 509, "num_experts": 8,
            "num_experts_per_tok": 3, "moe_intermediate_size": 40, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "norm_topk_prob": true
        })
    }

    #[test]
    fn parses_qwen3_with_v5_rope_parameters() {
        let (c, a) = ModelConfig::from_hf_json(&qwen3_json(), Path::new("c.json")).unwrap();
        assert_eq!(a.arch, Arch::Qwen3Moe);
        assert_eq!((c.head_dim, c.n_experts, c.n_experts_used, c.expert_ff), (24, 8, 3, 40));
        assert_eq!(c.rope_theta, 1e6);
        assert!(c.norm_topk_prob && !c.tied_embeddings);
    }

    #[test]
    fn round_trips_through_to_hf_json() {
        let (c, a) = ModelConfig::from_hf_json(&qwen3_json(), Path::new("c.json")).unwrap();
        let (back, _) = ModelConfig::from_hf_json(&c.to_hf_json(a), Path::new("c.json")).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn errors_name_file_and_field() {
        let mut v = qwen3_json();
        v.as_object_mut().unwrap().remove("num_experts");
        let err = ModelConfig::from_hf_json(&v, Path::new("/m/config.json")).unwrap_err().to_string();
        assert!(err.contains("/m/config.json") && err.contains("num_experts"), "{err}");

        let mut v = qwen3_json();
        v["hidden_size"] = json!("big");
        let err = ModelConfig::from_hf_json(&v, Path::new("c.json")).unwrap_err().to_string();
        assert!(err.contains("hidden_size") && err.contains("integer"), "{err}");

        let mut v = qwen3_json();
        v["num_experts_per_tok"] = json!(9);
        let err = ModelConfig::from_hf_json(&v, Path::new("c.json")).unwrap_err().to_string();
        assert!(err.contains("num_experts_per_tok") && err.contains("exceeds"), "{err}");

        let mut v = qwen3_json();
        v["model_type"] = json!("llama4");
        let err = ModelConfig::from_hf_json(&v, Path::new("c.json")).unwrap_err().to_string();
        assert!(err.contains("llama4") && err.contains("qwen2_moe"), "{err}");

        let mut v = qwen3_json();
        v["mlp_only_layers"] = json!([0]);
        let err = ModelConfig::from_hf_json(&v, Path::new("c.json")).unwrap_err().to_string();
        assert!(err.contains("mlp_only_layers"), "{err}");
    }

    /// The published nested `gemma4` form reads its `text_config`; what the plan cannot run is
    /// refused by field.
    #[test]
    fn gemma4_nested_config_and_its_refusals() {
        let text = json!({
            "model_type": "gemma4_text", "num_hidden_layers": 4, "hidden_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 311,
            "num_experts": 8, "top_k_experts": 3, "moe_intermediate_size": 16, "intermediate_size": 48,
            "enable_moe_block": true, "sliding_window": 8, "global_head_dim": 32,
            "num_global_key_value_heads": 1, "attention_k_eq_v": true,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh"
        });
        let v = json!({"model_type": "gemma4", "text_config": text.clone(), "vision_config": {}});
        let (c, a) = ModelConfig::from_hf_json(&v, Path::new("c.json")).unwrap();
        assert_eq!(a.arch, Arch::Gemma4);
        let g = c.global_attention.unwrap();
        assert_eq!((g.head_dim, g.n_kv_heads, g.turning_pairs, g.values_from_keys), (32, 1, 4, true));
        assert_eq!((c.window_of(0), c.window_of(1), c.n_experts_used), (Some(8), None, 3));
        assert_eq!((c.layer_kv_dim(0), c.layer_kv_dim(1), c.shared_expert_ff), (32, 32, 48));
        for (field, value) in [
            ("hidden_size_per_layer_input", json!(256)),
            ("num_kv_shared_layers", json!(2)),
            ("enable_moe_block", json!(false)),
            ("hidden_activation", json!("silu")),
        ] {
            let mut t = text.clone();
            t[field] = value;
            let err = ModelConfig::from_hf_json(&t, Path::new("c.json")).unwrap_err().to_string();
            assert!(err.contains(field), "{field}: {err}");
        }
    }
}
