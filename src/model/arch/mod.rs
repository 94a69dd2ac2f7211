//! Architectures as data: one file per architecture, each turning a validated
//! [`ModelConfig`] into a per-layer [`LayerPlan`] that every engine walks.
//!
//! A [`LayerSpec`] names what a layer *is*: its token mixer ([`Mixer`]: today full attention with
//! its options) and its feed-forward block ([`Ffn`]: today a routed MoE with its router and an
//! optional shared expert). The engines (the oracle in `reference.rs`, the CPU pipeline, the GPU
//! engine) read every per-layer choice from the plan and implement each kind once; none of them
//! asks which architecture it runs. An architecture made of existing kinds is one new file here
//! (its [`Adapter`] row: names, config readers, the plan) plus its entry in [`ADAPTERS`].
//!
//! The [`Adapter`] keeps what is not per layer: the names an architecture goes by in each format,
//! how its config spells the expert sizes, the tensor-name family, defaults, and the pipeline
//! [`Profile`].

mod deepseek_v3;
mod gemma4;
pub(crate) use gemma4::{gguf_sliding_sizes as gemma4_gguf_sliding_sizes, gguf_traits as gemma4_gguf_traits};
mod glm4_moe;
mod gpt_oss;
mod mixtral;
mod olmoe;
mod qwen2_moe;
mod qwen35_moe;
mod qwen3_moe;
mod qwen3_next;

use crate::model::config::{ConfigError, HfFields, ModelConfig};
use crate::model::{GgufMeta, ModelError};
use serde::Serialize;

/// The supported architectures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Arch {
    Qwen3Moe,
    Mixtral,
    Olmoe,
    Qwen2Moe,
    Qwen3Next,
    Qwen35Moe,
    GptOss,
    DeepseekV3,
    Glm4Moe,
    Gemma4,
}

/// How router logits become the top-k expert ids and weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RoutingVariant {
    /// softmax over all experts, then take the k largest (optionally renormalised to sum to 1).
    SoftmaxThenTopK,
    /// take the k largest logits, then softmax over those k (always sums to 1).
    TopKThenSoftmax,
    /// DeepSeek-V3: `sigmoid(logit)` per expert; the choice adds the selection bias and keeps
    /// the best `topk_group` of `n_group` groups (a group's score is the sum of its two best);
    /// the weights are the chosen sigmoid scores (renormalised with `norm_topk_prob`) times
    /// the router's `scale`.
    Sigmoid,
}

/// FFN activation applied to the gate projection before multiplying by the up projection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FfnActivation {
    /// `x * sigmoid(x)` (Hugging Face `silu`).
    Silu,
    /// The exact GELU, `x * Phi(x)` (Hugging Face `gelu`).
    Gelu,
    /// The tanh approximation of GELU (Hugging Face `gelu_pytorch_tanh`, `gelu_new`).
    GeluTanh,
    /// GPT-OSS's clamped SwiGLU: `g = min(gate, 7)`, `u = clamp(up, -7, 7)`,
    /// `(u + 1) * g * sigmoid(1.702 g)` (`swiglu_alpha` 1.702 and `swiglu_limit` 7, the only
    /// values accepted from a config).
    SwigluOai,
}

impl FfnActivation {
    /// The kernels' activation for this one: the single mapping every lane uses.
    pub fn kernel(self) -> moe_lanes_kernels::weights::Activation {
        use moe_lanes_kernels::weights::Activation;
        match self {
            FfnActivation::Silu => Activation::Silu,
            FfnActivation::Gelu => Activation::Gelu,
            FfnActivation::GeluTanh => Activation::GeluTanh,
            FfnActivation::SwigluOai => Activation::SwigluOai,
        }
    }

    /// The Hugging Face `hidden_act` name.
    pub fn hf_name(self) -> &'static str {
        match self {
            FfnActivation::Silu => "silu",
            FfnActivation::Gelu => "gelu",
            FfnActivation::GeluTanh => "gelu_pytorch_tanh",
            // transformers' GPT-OSS config says `silu` and applies its own clamped form.
            FfnActivation::SwigluOai => "silu",
        }
    }
}

/// Where q/k RMSNorms sit, if the architecture has them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QkNorm {
    None,
    /// One norm of `head_dim` applied to every head (Qwen3-MoE).
    PerHead,
    /// One norm over the whole q (or k) projection, before splitting heads (OLMoE).
    WholeProjection,
}

/// How RoPE pairs up the values of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeStyle {
    /// Pairs `(i, i + d/2)`: Hugging Face `rotate_half`, GGML "NEOX".
    HalfSplit,
    /// Pairs `(2i, 2i + 1)`: GGML "NORM". llama.cpp's converter permutes the q/k rows of
    /// llama-family checkpoints so that this equals `HalfSplit` on the original weights.
    Interleaved,
}

/// The tensor-name family on disk for the Hugging Face layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HfNaming {
    /// `mlp.gate`, `mlp.experts.E.{gate,up,down}_proj`
    Mlp,
    /// `block_sparse_moe.gate`, `block_sparse_moe.experts.E.{w1,w3,w2}`
    BlockSparseMoe,
    /// GPT-OSS: `mlp.router` (weight and bias), experts fused and stored input-major
    /// (`mlp.experts.gate_up_proj` `[E, hidden, 2 ff]` with gate and up in alternate columns,
    /// `down_proj` `[E, ff, hidden]`, each with a bias), `self_attn.sinks`; in GGUF the FFN norm
    /// is `post_attention_norm`.
    GptOss,
    /// DeepSeek-V3: `mlp.gate` with `e_score_correction_bias`, `mlp.shared_experts.*`, the
    /// dense layers' `mlp.{gate,up,down}_proj`, the MLA projections (`q_a_proj`, `kv_b_proj`, ...).
    SharedExperts,
    /// Gemma 4: the dense MLP `mlp.{gate,up,down}_proj` (the plan's shared expert), `router.proj`
    /// with `router.scale` and `router.per_expert_scale`, fused `experts.gate_up_proj` /
    /// `experts.down_proj` outside `mlp`, the sandwich norms (`pre_feedforward_layernorm` before
    /// the FFN, `post_attention_layernorm` after the attention, `*_1` / `*_2` per branch) and
    /// `layer_scalar`.
    Gemma4,
}

/// RoPE of one attention layer.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RopeSpec {
    /// Pairing of the q/k weights as stored in this file.
    pub style: RopeStyle,
    pub theta: f32,
    /// How many leading values of each head rotate (the head dim, or less for partial RoPE:
    /// Qwen3-Next rotates 64 of 256); the rest pass through.
    pub dims: usize,
    /// YaRN frequency scaling (GPT-OSS), `None` for plain RoPE.
    pub yarn: Option<YarnSpec>,
    /// Linear scaling: every plain frequency divided by this factor (`None` with YaRN).
    pub linear: Option<f32>,
    /// Proportional RoPE (Gemma 4's global layers): `dims` is the whole head, and only its first
    /// `n` pairs turn, pair `i` at `theta^(-2i/dims)` as in plain RoPE; the other pairs have
    /// frequency 0 (they pass through). `None`: every pair of `dims` turns.
    pub turning_pairs: Option<usize>,
}

impl RopeSpec {
    /// The inverse frequency of pair `i` (of `dims / 2`), YaRN's or plain, zero past the
    /// turning pairs of a proportional RoPE: the one formula every engine's table reads.
    pub fn inv_freq(&self, i: usize) -> f64 {
        if self.turning_pairs.is_some_and(|n| i >= n) {
            return 0.0;
        }
        match &self.yarn {
            Some(y) => y.inv_freq(i, self.dims, self.theta),
            None => {
                let plain = 1.0 / (self.theta as f64).powf(2.0 * i as f64 / self.dims as f64);
                plain / self.linear.map_or(1.0, f64::from)
            }
        }
    }

    /// Whether the engines read this RoPE's frequencies from a table ([`Self::inv_freq`]) rather
    /// than computing `theta^(-2i/dims)` in place: YaRN, linear scaling, proportional RoPE.
    pub fn needs_table(&self) -> bool {
        self.yarn.is_some() || self.linear.is_some() || self.turning_pairs.is_some()
    }

    /// cos/sin are multiplied by this (YaRN's attention factor; 1 otherwise).
    pub fn attention_factor(&self) -> f64 {
        self.yarn.map_or(1.0, |y| y.attention_factor as f64)
    }
}

/// YaRN RoPE scaling as transformers computes it (`_compute_yarn_parameters`): each frequency
/// blends its interpolated (`/ factor`) and extrapolated value by a linear ramp between the
/// correction dims of `beta_fast` and `beta_slow` rotations over `original_context`, and cos/sin
/// are multiplied by `attention_factor` (`0.1 ln(factor) + 1` unless the config says).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct YarnSpec {
    pub factor: f32,
    pub original_context: usize,
    pub beta_fast: f32,
    pub beta_slow: f32,
    /// Round the correction range to whole dims (transformers' `truncate`, default true; GPT-OSS
    /// false).
    pub truncate: bool,
    pub attention_factor: f32,
}

impl YarnSpec {
    /// The inverse frequency of pair `i` of a `dims`-wide rotation at base `theta` (the one
    /// formula every engine's table reads; each applies it with its own arithmetic).
    pub fn inv_freq(&self, i: usize, dims: usize, theta: f32) -> f64 {
        let (base, d) = (theta as f64, dims as f64);
        let correction = |rotations: f64| {
            d * (self.original_context as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * base.ln())
        };
        let (mut low, mut high) = (correction(self.beta_fast as f64), correction(self.beta_slow as f64));
        if self.truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
        if low == high {
            high += 0.001;
        }
        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
        let extrapolation_factor = 1.0 - ramp;
        let pos_freq = base.powf(2.0 * i as f64 / d);
        let (extrapolated, interpolated) = (1.0 / pos_freq, 1.0 / (self.factor as f64 * pos_freq));
        interpolated * (1.0 - extrapolation_factor) + extrapolated * extrapolation_factor
    }
}

/// The attention factor transformers derives from a YaRN factor when the config gives none.
pub fn yarn_default_attention_factor(factor: f32) -> f32 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * factor.ln() + 1.0
    }
}

/// Full (softmax) attention with its options.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct AttentionSpec {
    /// Values per query/key/value head.
    pub head_dim: usize,
    /// Key/value heads of this layer (Gemma 4's global layers have fewer than its sliding ones).
    pub n_kv_heads: usize,
    pub qk_norm: QkNorm,
    /// q/k/v projections carry biases.
    pub qkv_bias: bool,
    pub rope: RopeSpec,
    /// Attend only to the last `window` positions.
    pub window: Option<usize>,
    /// Clamp q/k/v projections to `[-clip, clip]`.
    pub clip_qkv: Option<f32>,
    /// The q projection yields a gate beside each head's query (`[query | gate]` per head, twice
    /// the width), and the attention output is multiplied by `sigmoid(gate)` before `o`
    /// (Qwen3-Next, Qwen3.5).
    pub output_gate: bool,
    /// The o projection carries a bias (GPT-OSS).
    pub o_bias: bool,
    /// Each query head has a learned sink logit that joins its softmax's denominator and
    /// attends to nothing (GPT-OSS `sinks`, llama.cpp `attn_sinks`).
    pub sinks: bool,
    /// The values are the k projection's output as it leaves the projection (before the k norm
    /// and RoPE): the layer has no v projection (Gemma 4's global layers, `attention_k_eq_v`).
    pub values_from_keys: bool,
    /// Each value head is RMS-normalised without a weight before it is cached (Gemma 4).
    pub v_norm: bool,
    /// The scores' scale; `None`: `1 / sqrt(head_dim)` (Gemma 4: 1, its q/k norms set the scale).
    pub scale: Option<f32>,
}

impl AttentionSpec {
    /// Rows of q (every query head, without a gate).
    pub fn q_dim(&self, n_heads: usize) -> usize {
        n_heads * self.head_dim
    }
    /// Rows of k (and v): every KV head.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
    /// The factor of every `q . k` score.
    pub fn softmax_scale(&self) -> f32 {
        self.scale.unwrap_or(1.0 / (self.head_dim as f32).sqrt())
    }
}

/// How a Gated DeltaNet layer's input projections are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeltaNetProjections {
    /// Qwen3-Next: one `qkvz` projection grouped per key head (`[q | k | v.. | z..]` for each
    /// key head, its value heads inside) and one `ba` projection grouped the same way.
    Grouped,
    /// Qwen3.5: `qkv` (all q heads, all k heads, all v heads), `z`, `b` and `a` apart.
    Split,
    /// llama.cpp's Qwen3-Next files: `qkv` and `z` apart as in [`DeltaNetProjections::Split`]
    /// (its converter splits the fused projection), `b` and `a` fused per key head as in
    /// [`DeltaNetProjections::Grouped`].
    SplitGroupedBa,
}

/// The order of a DeltaNet layer's value heads, the same in every tensor with a part per value
/// head (v, z, b, a, dt bias, decay, conv channels of v, the output projection's columns).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VHeadOrder {
    /// The `r = v_heads / k_heads` value heads of key head `g` are `g r .. g r + r`
    /// (transformers, llama.cpp's Qwen3-Next).
    Grouped,
    /// Value head `j` belongs to key head `j % k_heads` (llama.cpp's Qwen3.5 converter reorders
    /// them so that ggml broadcasts q and k over the value heads).
    Tiled,
}

/// Gated DeltaNet linear attention: a causal depthwise conv over q, k, v; L2-normalised q/k; the
/// gated delta rule over a `[v_heads, k_head_dim, v_head_dim]` f32 state; an RMSNorm of each
/// value head gated by `silu(z)`; the output projection.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DeltaNetSpec {
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
    /// The causal conv's kernel width; its rolling state keeps `conv_kernel - 1` inputs.
    pub conv_kernel: usize,
    pub projections: DeltaNetProjections,
    pub v_heads: VHeadOrder,
}

impl DeltaNetSpec {
    /// The key head (q and k) that value head `v_head` reads.
    pub fn k_head_of(&self, v_head: usize) -> usize {
        match self.v_heads {
            VHeadOrder::Grouped => v_head / (self.n_v_heads / self.n_k_heads),
            VHeadOrder::Tiled => v_head % self.n_k_heads,
        }
    }
    pub fn key_dim(&self) -> usize {
        self.n_k_heads * self.k_head_dim
    }
    pub fn value_dim(&self) -> usize {
        self.n_v_heads * self.v_head_dim
    }
    /// Channels of the conv: q, k and v side by side.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// f32 values of the conv's rolling state.
    pub fn conv_state_len(&self) -> usize {
        self.conv_dim() * (self.conv_kernel - 1)
    }
    /// f32 values of the recurrent matrix state.
    pub fn matrix_state_len(&self) -> usize {
        self.n_v_heads * self.k_head_dim * self.v_head_dim
    }
}

/// What mixes information across positions in one layer.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mixer {
    Attention(AttentionSpec),
    GatedDeltaNet(DeltaNetSpec),
    LatentAttention(LatentAttentionSpec),
}

/// Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): q from a low-rank projection
/// (`q_a` -> RMSNorm -> `q_b`) or a plain one; keys and values from one latent per position
/// (`kv_a` -> `kv_lora_rank` latent, RMSNorm, plus a `rope_dim` key part shared by every head);
/// each head's key is `[nope | rope]`, its no-RoPE part and its value the latent through that
/// head's rows of `kv_b` (stored split as llama.cpp does: `k_b` `[heads, kv_lora_rank, nope]`,
/// `v_b` `[heads, v_dim, kv_lora_rank]`). Only the `rope_dim` parts rotate. A session keeps the
/// normalised latent and the rotated key part: `kv_lora_rank + rope_dim` values per position.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LatentAttentionSpec {
    pub n_heads: usize,
    /// `None`: a plain `q` projection (DeepSeek-V2-Lite).
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    /// Per head: the key part without RoPE, the rotated part, the value.
    pub nope_dim: usize,
    pub rope_dim: usize,
    pub v_dim: usize,
    /// RoPE of the `rope_dim` parts (`dims` = `rope_dim`).
    pub rope: RopeSpec,
    /// The softmax scale: `1 / sqrt(nope_dim + rope_dim)`, times YaRN's `mscale^2`.
    pub scale: f32,
}

impl LatentAttentionSpec {
    /// Values per position in a session's cache: the latent and the rotated key part.
    pub fn cache_width(&self) -> usize {
        self.kv_lora_rank + self.rope_dim
    }
    /// Rows of the q projection: every head's `[nope | rope]`.
    pub fn q_dim(&self) -> usize {
        self.n_heads * (self.nope_dim + self.rope_dim)
    }
}

/// How a MoE layer's router turns a token into expert ids and weights.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RouterSpec {
    pub variant: RoutingVariant,
    /// Renormalise the top-k weights to sum to one (softmax-then-top-k routers only).
    pub norm_topk_prob: bool,
    pub n_experts: usize,
    pub n_experts_used: usize,
    /// The router's linear layer carries a bias added to every logit (GPT-OSS).
    pub bias: bool,
    /// A per-expert bias added to the scores for the choice only (DeepSeek-V3's
    /// `e_score_correction_bias`, llama.cpp's `exp_probs_b`), [`RoutingVariant::Sigmoid`].
    pub selection_bias: bool,
    /// Group-limited choice: the experts in `n_group` equal groups, only the best `topk_group`
    /// groups eligible (1 and 1: no groups).
    pub n_group: usize,
    pub topk_group: usize,
    /// Routed weights are multiplied by this (`routed_scaling_factor`; 1 elsewhere).
    pub scale: f32,
    /// The router reads the layer's input before the FFN norm, RMS-normalised without a weight
    /// and multiplied by a learned per-channel scale and `hidden^-0.5` (Gemma 4's
    /// `router.scale`); otherwise it reads the FFN norm's output.
    pub scaled_input: bool,
    /// Each chosen weight (after renormalisation) is multiplied by its expert's learned scale
    /// (Gemma 4's `router.per_expert_scale`).
    pub per_expert_scale: bool,
}

/// A dense expert every token runs beside the routed ones, scaled by `sigmoid(gate · x)`
/// (Qwen2-MoE's `shared_expert_gate`) when `gated`, added as it is otherwise (DeepSeek-V3's
/// `shared_experts`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SharedExpertSpec {
    /// Intermediate size.
    pub ff: usize,
    pub gated: bool,
}

/// A plain gated FFN (`down · act(gate · x) * (up · x)`): DeepSeek-V3's first
/// `first_k_dense_replace` layers. A layer of this kind has no experts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DenseFfnSpec {
    pub ff: usize,
    pub activation: FfnActivation,
}

/// A routed mixture of experts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MoeSpec {
    pub router: RouterSpec,
    pub activation: FfnActivation,
    /// Intermediate size of one routed expert.
    pub expert_ff: usize,
    /// Each routed expert's gate, up and down projections carry biases (GPT-OSS).
    pub expert_bias: bool,
    pub shared: Option<SharedExpertSpec>,
    /// The shared (dense) branch and the routed branch each have their own norms (Gemma 4): the
    /// shared branch reads the FFN norm's output and its output is RMS-normalised
    /// (`SharedPostNorm`); the experts read the layer's input through their own norm
    /// (`ExpertsNorm`) and their weighted sum is RMS-normalised (`ExpertsPostNorm`); the two are
    /// added. Otherwise both read the FFN norm's output and add up unnormalised.
    pub branch_norms: bool,
}

/// The feed-forward block of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Ffn {
    Moe(MoeSpec),
    Dense(DenseFfnSpec),
}

/// One layer: pre-norm mixer, residual, pre-norm FFN, residual.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LayerSpec {
    pub mixer: Mixer,
    pub ffn: Ffn,
    /// Sandwich norms (Gemma 4): the mixer's output and the FFN's output are each RMS-normalised
    /// (`PostAttnNorm`, `PostFfnNorm`) before they join the residual.
    pub post_norms: bool,
    /// The layer's output, residual included, is multiplied by a learned scalar (Gemma 4's
    /// `layer_scalar`, `LayerScalar`).
    pub output_scale: bool,
}

impl LayerSpec {
    /// A plain pre-norm layer: no post norms, no output scale.
    pub fn new(mixer: Mixer, ffn: Ffn) -> LayerSpec {
        LayerSpec { mixer, ffn, post_norms: false, output_scale: false }
    }
}

impl LayerSpec {
    /// The attention options of this layer, `None` for another mixer kind.
    pub fn as_attention(&self) -> Option<&AttentionSpec> {
        match &self.mixer {
            Mixer::Attention(a) => Some(a),
            Mixer::GatedDeltaNet(_) | Mixer::LatentAttention(_) => None,
        }
    }

    /// The attention options of this layer, for engines that run attention layers only: they
    /// refuse a plan with another mixer kind when they are built ([`LayerPlan::first_unsupported`]),
    /// so this never sees one.
    pub fn attention(&self) -> &AttentionSpec {
        self.as_attention().expect("engines built over attention-only plans")
    }

    /// The MoE block of this layer, `None` for a dense FFN layer (no experts).
    pub fn as_moe(&self) -> Option<&MoeSpec> {
        match &self.ffn {
            Ffn::Moe(m) => Some(m),
            Ffn::Dense(_) => None,
        }
    }

    /// The layer routes to experts.
    pub fn has_experts(&self) -> bool {
        self.as_moe().is_some()
    }

    /// The shared expert of a MoE layer.
    pub fn shared_expert(&self) -> Option<SharedExpertSpec> {
        self.as_moe().and_then(|m| m.shared)
    }
}

/// Every layer's spec, in order.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerPlan {
    layers: Vec<LayerSpec>,
}

impl LayerPlan {
    /// The plan `adapter` gives the model `config` describes.
    pub fn new(adapter: &Adapter, config: &ModelConfig) -> LayerPlan {
        let layers: Vec<LayerSpec> = (0..config.n_layers).map(|l| (adapter.layer)(config, l)).collect();
        let moes: Vec<&MoeSpec> = layers.iter().filter_map(LayerSpec::as_moe).collect();
        let first = moes.first().expect("every architecture has MoE layers (checked at open)");
        assert!(
            moes.iter().all(|m| m.activation == first.activation
                && m.expert_ff == first.expert_ff
                && m.expert_bias == first.expert_bias),
            "{}: the lanes' kernels are built once for every layer's experts (one shape, one activation)",
            adapter.hf_model_type
        );
        LayerPlan { layers }
    }

    /// The activation of the routed experts: every MoE layer of a model shares it and the
    /// expert shape (checked in [`LayerPlan::new`]), so the lanes build their kernels once.
    pub fn expert_activation(&self) -> FfnActivation {
        self.first_moe().activation
    }

    /// The first MoE layer's block (every plan has one: `LayerPlan::new`).
    pub fn first_moe(&self) -> &MoeSpec {
        self.layers.iter().find_map(LayerSpec::as_moe).expect("a plan has MoE layers")
    }

    /// Per layer, whether it routes to experts (a dense FFN layer has none).
    pub fn expert_layers(&self) -> Vec<bool> {
        self.layers.iter().map(LayerSpec::has_experts).collect()
    }

    /// The first layer whose FFN an engine without `supported(ffn)` cannot run, with the kind's
    /// name.
    pub fn first_unsupported_ffn(&self, supported: impl Fn(&Ffn) -> bool) -> Option<(usize, &'static str)> {
        self.layers.iter().position(|l| !supported(&l.ffn)).map(|l| (l, self.layers[l].ffn.name()))
    }

    pub fn layer(&self, layer_idx: usize) -> &LayerSpec {
        &self.layers[layer_idx]
    }

    /// The first layer whose mixer an engine without `supported(mixer)` cannot run, with the
    /// kind's name, so the engine refuses the model by name at build time.
    pub fn first_unsupported(&self, supported: impl Fn(&Mixer) -> bool) -> Option<(usize, &'static str)> {
        self.layers.iter().position(|l| !supported(&l.mixer)).map(|l| (l, self.layers[l].mixer.name()))
    }

    pub fn layers(&self) -> &[LayerSpec] {
        &self.layers
    }

    /// Whether any layer attends through a sliding window (its KV cache is then a ring, and a
    /// call appends at most `KV_RING_CHUNK_POSITIONS` positions to a sequence).
    pub fn has_window(&self) -> bool {
        self.layers.iter().any(|l| l.as_attention().is_some_and(|a| a.window.is_some()))
    }

    pub fn len(&self) -> usize {
        self.layers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// One line per run of equal layers, for `inspect`: `"0-47: attention (neox rope, per-head q/k
    /// norm) + moe (8 of 128 experts, softmax, top-k, renormalised, silu)"`.
    pub fn summary(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut start = 0;
        for l in 1..=self.layers.len() {
            if l == self.layers.len() || self.layers[l] != self.layers[start] {
                let range = if l - 1 == start { format!("{start}") } else { format!("{start}-{}", l - 1) };
                out.push(format!("{range}: {}", describe(&self.layers[start])));
                start = l;
            }
        }
        out
    }
}

impl Mixer {
    /// The kind's name in errors and `inspect`.
    pub fn name(&self) -> &'static str {
        match self {
            Mixer::Attention(a) if a.sinks => "attention with sinks",
            Mixer::Attention(a) if a.v_norm || a.values_from_keys || a.rope.turning_pairs.is_some() => {
                "attention with a v norm, keys as values or proportional RoPE"
            }
            Mixer::Attention(_) => "attention",
            Mixer::GatedDeltaNet(_) => "gated deltanet",
            Mixer::LatentAttention(_) => "latent attention (MLA)",
        }
    }
}

impl Ffn {
    /// The kind's name in errors and `inspect`.
    pub fn name(&self) -> &'static str {
        match self {
            Ffn::Moe(m) if m.router.variant == RoutingVariant::Sigmoid => {
                "mixture of experts with sigmoid routing"
            }
            Ffn::Moe(m) if m.shared.is_some_and(|s| !s.gated) => {
                "mixture of experts with an ungated shared expert"
            }
            Ffn::Moe(_) => "mixture of experts",
            Ffn::Dense(_) => "dense FFN",
        }
    }
}

fn describe(spec: &LayerSpec) -> String {
    let mixer = match &spec.mixer {
        Mixer::Attention(a) => format!("attention ({})", describe_attention(a)),
        Mixer::GatedDeltaNet(d) => format!(
            "gated deltanet ({} k / {} v heads, k {} v {}, conv {})",
            d.n_k_heads, d.n_v_heads, d.k_head_dim, d.v_head_dim, d.conv_kernel
        ),
        Mixer::LatentAttention(m) => format!(
            "latent attention ({} heads, q rank {}, kv rank {}, nope {} rope {} v {}, {})",
            m.n_heads,
            m.q_lora_rank.map_or("none".into(), |r| r.to_string()),
            m.kv_lora_rank,
            m.nope_dim,
            m.rope_dim,
            m.v_dim,
            describe_attention_rope(&m.rope)
        ),
    };
    let ffn = match &spec.ffn {
        Ffn::Moe(m) => format!("{mixer} + moe ({})", describe_moe(m)),
        Ffn::Dense(d) => format!("{mixer} + dense ffn ({}, {})", d.ff, d.activation.hf_name()),
    };
    match (spec.post_norms, spec.output_scale) {
        (false, false) => ffn,
        (true, false) => format!("{ffn}, post norms"),
        (false, true) => format!("{ffn}, output scalar"),
        (true, true) => format!("{ffn}, post norms, output scalar"),
    }
}

fn describe_attention_rope(r: &RopeSpec) -> String {
    let style = match r.style {
        RopeStyle::HalfSplit => "neox rope",
        RopeStyle::Interleaved => "interleaved rope",
    };
    match (r.yarn, r.linear) {
        (Some(y), _) => format!("{style}, yarn x{} of {}", y.factor, y.original_context),
        (None, Some(f)) => format!("{style}, linear x{f}"),
        (None, None) => style.to_string(),
    }
}

fn describe_attention(a: &AttentionSpec) -> String {
    let mut mixer = vec![match a.rope.style {
        RopeStyle::HalfSplit => "neox rope".to_string(),
        RopeStyle::Interleaved => "interleaved rope".to_string(),
    }];
    if a.rope.dims < a.head_dim {
        mixer.push(format!("partial rope {}", a.rope.dims));
    }
    if let Some(n) = a.rope.turning_pairs {
        mixer.push(format!("proportional rope {n} of {} pairs, theta {}", a.rope.dims / 2, a.rope.theta));
    }
    if a.values_from_keys {
        mixer.push("keys as values".into());
    }
    if a.v_norm {
        mixer.push("v norm".into());
    }
    if let Some(s) = a.scale {
        mixer.push(format!("score scale {s}"));
    }
    match a.qk_norm {
        QkNorm::None => {}
        QkNorm::PerHead => mixer.push("per-head q/k norm".into()),
        QkNorm::WholeProjection => mixer.push("q/k norm".into()),
    }
    if a.qkv_bias {
        mixer.push("qkv bias".into());
    }
    if let Some(w) = a.window {
        mixer.push(format!("window {w}"));
    }
    if let Some(c) = a.clip_qkv {
        mixer.push(format!("clip {c}"));
    }
    if a.output_gate {
        mixer.push("output gate".into());
    }
    if a.o_bias {
        mixer.push("o bias".into());
    }
    if a.sinks {
        mixer.push("sinks".into());
    }
    if let Some(y) = a.rope.yarn {
        mixer.push(format!("yarn x{} of {}", y.factor, y.original_context));
    }
    if let Some(f) = a.rope.linear {
        mixer.push(format!("linear rope x{f}"));
    }
    mixer.join(", ")
}

fn describe_moe(m: &MoeSpec) -> String {
    let routing = match m.router.variant {
        RoutingVariant::SoftmaxThenTopK if m.router.norm_topk_prob => "softmax, top-k, renormalised",
        RoutingVariant::SoftmaxThenTopK => "softmax, top-k",
        RoutingVariant::TopKThenSoftmax => "top-k, softmax",
        RoutingVariant::Sigmoid if m.router.norm_topk_prob => "sigmoid, top-k, renormalised",
        RoutingVariant::Sigmoid => "sigmoid, top-k",
    };
    let mut ffn =
        vec![format!("{} of {} experts", m.router.n_experts_used, m.router.n_experts), routing.into()];
    if m.router.bias {
        ffn.push("router bias".into());
    }
    if m.router.selection_bias {
        ffn.push("selection bias".into());
    }
    if m.router.n_group > 1 {
        ffn.push(format!("{} of {} groups", m.router.topk_group, m.router.n_group));
    }
    if m.router.scale != 1.0 {
        ffn.push(format!("scaled x{}", m.router.scale));
    }
    ffn.push(match m.activation {
        FfnActivation::SwigluOai => "clamped swiglu".into(),
        other => other.hf_name().into(),
    });
    if m.expert_bias {
        ffn.push("expert biases".into());
    }
    if let Some(s) = m.shared {
        let kind = if s.gated { "gated" } else { "ungated" };
        ffn.push(format!("{kind} shared expert {}", s.ff));
    }
    if m.router.scaled_input {
        ffn.push("scaled router input".into());
    }
    if m.router.per_expert_scale {
        ffn.push("per-expert scale".into());
    }
    if m.branch_norms {
        ffn.push("branch norms".into());
    }
    ffn.join(", ")
}

/// Expert sizes as a config states them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertDims {
    pub n_experts: usize,
    pub expert_ff: usize,
    /// 0 without a shared expert.
    pub shared_expert_ff: usize,
}

/// Pipeline switches an architecture opts into (DESIGN.md "Phases and policies"), each read by
/// `moe::phase::PpPolicy::plan`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Profile {
    /// Route tiny decode batches on the CPU instead of launching router work on the GPU.
    pub cpu_decode_routing: bool,
    /// Largest batch (tokens) that `cpu_decode_routing` applies to.
    pub cpu_decode_routing_max_tokens: usize,
    /// One-token decode merges hot and cold rows directly, without a reduce pass.
    pub decode_direct_merge: bool,
    /// Prompt processing may run dense (all experts for all tokens) when cheaper.
    pub pp_dense: bool,
    /// Prompt processing reduces branch outputs before the merge.
    pub pp_reduce_merge: bool,
    /// The cold lane accumulates weighted expert outputs straight into token rows.
    pub compact_cold_reduce: bool,
}

/// The profile every current adapter starts from: proven shortcuts on, dense PP off.
pub const DEFAULT_PROFILE: Profile = Profile {
    cpu_decode_routing: true,
    cpu_decode_routing_max_tokens: 1,
    decode_direct_merge: true,
    pp_dense: false,
    pp_reduce_merge: true,
    compact_cold_reduce: true,
};

/// The allow-list entry for one architecture: its names, its config readers and its plan.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Adapter {
    pub arch: Arch,
    /// `model_type` in a Hugging Face `config.json`.
    pub hf_model_type: &'static str,
    /// The `architectures` class name `transformers` writes.
    pub hf_class: &'static str,
    /// `general.architecture` in GGUF (Mixtral is llama.cpp's `llama` with experts).
    pub gguf_arch: &'static str,
    /// RoPE pairing of the Hugging Face weights (GGUF files may store another, see `gguf_rope_style`).
    pub rope_style: RopeStyle,
    /// RoPE pairing of llama.cpp's GGUF weights.
    pub gguf_rope_style: RopeStyle,
    /// llama.cpp's name for the norm before the FFN: `ffn_norm`, or `post_attention_norm`
    /// where its converter keeps transformers' name (the Qwen hybrids).
    pub gguf_ffn_norm: &'static str,
    /// MoE layers carry a shared expert (its size is read from the config).
    pub shared_expert: bool,
    pub hf_naming: HfNaming,
    pub default_rope_theta: f32,
    /// What llama.cpp assumes for `expert_weights_norm` when a GGUF file does not say.
    pub gguf_default_norm_topk: bool,
    /// What `norm_topk_prob` is when a `config.json` does not say (transformers' default).
    pub hf_default_norm_topk: bool,
    /// What sets the Qwen hybrids apart ([`HybridTraits::NONE`] for the attention-only ones).
    pub hybrid: HybridTraits,
    pub profile: Profile,
    /// The expert sizes from a `config.json`.
    #[serde(skip)]
    pub hf_expert_dims: fn(&HfFields<'_>) -> Result<ExpertDims, ConfigError>,
    /// The expert sizes from GGUF metadata.
    #[serde(skip)]
    pub gguf_expert_dims: fn(&GgufMeta<'_>, usize) -> Result<ExpertDims, ModelError>,
    /// Architecture-specific `config.json` fields `transformers` needs (for `synth`).
    #[serde(skip)]
    pub hf_extra_fields: fn(&ModelConfig, &mut serde_json::Map<String, serde_json::Value>),
    /// The spec of layer `l`.
    #[serde(skip)]
    pub layer: fn(&ModelConfig, usize) -> LayerSpec,
}

/// The traits of an architecture that only the Gated DeltaNet hybrids have today: their layer
/// kind, their checkpoints' conventions and config defaults.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct HybridTraits {
    /// The architecture mixes Gated DeltaNet layers in, their projections stored this way in
    /// Hugging Face checkpoints (value heads grouped).
    pub delta_net: Option<DeltaNetProjections>,
    /// How llama.cpp's converter stores them in GGUF files.
    pub gguf_delta_net: Option<(DeltaNetProjections, VHeadOrder)>,
    /// The text-only `model_type` of an architecture published as a multimodal checkpoint
    /// (`qwen3_5_moe_text` for `qwen3_5_moe`, whose `config.json` nests it in `text_config`).
    pub hf_text_model_type: Option<&'static str>,
    /// Hugging Face checkpoints store RMSNorm weights zero-centred (scale `1 + w`).
    pub hf_zero_centred_norms: bool,
    /// `partial_rotary_factor` when a `config.json` does not say.
    pub default_partial_rotary: f64,
}

impl HybridTraits {
    /// An attention-only architecture: none of the above.
    pub const NONE: HybridTraits = HybridTraits {
        delta_net: None,
        gguf_delta_net: None,
        hf_text_model_type: None,
        hf_zero_centred_norms: false,
        default_partial_rotary: 1.0,
    };
}

impl PartialEq for Adapter {
    fn eq(&self, other: &Adapter) -> bool {
        self.arch == other.arch
    }
}

/// Every supported architecture.
pub static ADAPTERS: [Adapter; 10] = [
    qwen3_moe::ADAPTER,
    mixtral::ADAPTER,
    olmoe::ADAPTER,
    qwen2_moe::ADAPTER,
    qwen3_next::ADAPTER,
    qwen35_moe::ADAPTER,
    gpt_oss::ADAPTER,
    deepseek_v3::ADAPTER,
    glm4_moe::ADAPTER,
    gemma4::ADAPTER,
];

/// The attention layer every current architecture builds from its config: `qk_norm` and
/// `qkv_bias` are the architecture's, the rest is the config's.
fn standard_attention(c: &ModelConfig, qk_norm: QkNorm, qkv_bias: bool) -> Mixer {
    Mixer::Attention(AttentionSpec {
        head_dim: c.head_dim,
        n_kv_heads: c.n_kv_heads,
        qk_norm,
        qkv_bias,
        rope: RopeSpec {
            style: c.rope_style,
            theta: c.rope_theta,
            dims: c.rotary_dims,
            yarn: c.yarn,
            linear: c.rope_linear,
            turning_pairs: None,
        },
        window: c.sliding_window,
        clip_qkv: c.clip_qkv,
        output_gate: false,
        o_bias: false,
        sinks: false,
        values_from_keys: false,
        v_norm: false,
        scale: None,
    })
}

/// A routed MoE from the config's expert numbers.
fn standard_moe(c: &ModelConfig, variant: RoutingVariant, shared: Option<SharedExpertSpec>) -> Ffn {
    Ffn::Moe(MoeSpec {
        router: RouterSpec {
            variant,
            norm_topk_prob: c.norm_topk_prob,
            n_experts: c.n_experts,
            n_experts_used: c.n_experts_used,
            bias: false,
            selection_bias: false,
            n_group: 1,
            topk_group: 1,
            scale: 1.0,
            scaled_input: false,
            per_expert_scale: false,
        },
        activation: FfnActivation::Silu,
        expert_ff: c.expert_ff,
        expert_bias: false,
        shared,
        branch_norms: false,
    })
}

/// An architecture outside the allow-list.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("unsupported architecture '{found}' (from {source_kind}); supported: {supported}")]
pub struct UnsupportedArch {
    pub found: String,
    pub source_kind: &'static str,
    pub supported: String,
}

fn supported_list(names: impl Iterator<Item = &'static str>) -> String {
    names.collect::<Vec<_>>().join(", ")
}

/// The adapter of `arch`.
pub fn of(arch: Arch) -> &'static Adapter {
    ADAPTERS.iter().find(|a| a.arch == arch).expect("every Arch has an adapter")
}

/// Look up an adapter by Hugging Face `model_type`.
pub fn for_hf_model_type(model_type: &str) -> Result<&'static Adapter, UnsupportedArch> {
    let named =
        |a: &&Adapter| a.hf_model_type == model_type || a.hybrid.hf_text_model_type == Some(model_type);
    ADAPTERS.iter().find(named).ok_or_else(|| UnsupportedArch {
        found: model_type.to_string(),
        source_kind: "config.json model_type",
        supported: supported_list(ADAPTERS.iter().map(|a| a.hf_model_type)),
    })
}

/// Look up an adapter by GGUF `general.architecture`. `llama` is accepted only with experts
/// (that is Mixtral); a dense llama is refused.
pub fn for_gguf_arch(gguf_arch: &str, n_experts: usize) -> Result<&'static Adapter, UnsupportedArch> {
    let found = ADAPTERS.iter().find(|a| a.gguf_arch == gguf_arch);
    match found {
        Some(adapter) if gguf_arch != "llama" || n_experts > 0 => Ok(adapter),
        _ => Err(UnsupportedArch {
            found: if gguf_arch == "llama" {
                "llama (without experts)".to_string()
            } else {
                gguf_arch.to_string()
            },
            source_kind: "GGUF general.architecture",
            supported: supported_list(ADAPTERS.iter().map(|a| a.gguf_arch))
                + " (llama with experts = mixtral)",
        }),
    }
}

/// Look up an adapter by its user-facing name (`qwen3_moe`, `mixtral`, `olmoe`, `qwen2_moe`;
/// GGUF names are accepted too).
pub fn by_name(name: &str) -> Result<&'static Adapter, UnsupportedArch> {
    let normalized = name.to_ascii_lowercase().replace('-', "_");
    ADAPTERS
        .iter()
        .find(|a| a.hf_model_type == normalized || (a.gguf_arch == normalized && a.gguf_arch != "llama"))
        .ok_or_else(|| UnsupportedArch {
            found: name.to_string(),
            source_kind: "--arch",
            supported: supported_list(ADAPTERS.iter().map(|a| a.hf_model_type)),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_adapter_is_found_by_both_names() {
        for a in &ADAPTERS {
            assert_eq!(for_hf_model_type(a.hf_model_type).unwrap().arch, a.arch);
            assert_eq!(for_gguf_arch(a.gguf_arch, 8).unwrap().arch, a.arch);
            assert_eq!(by_name(a.hf_model_type).unwrap().arch, a.arch);
            assert_eq!(of(a.arch).hf_model_type, a.hf_model_type);
        }
    }

    #[test]
    fn unsupported_arch_lists_the_supported_ones() {
        let err = for_hf_model_type("glm4").unwrap_err().to_string();
        assert!(err.contains("glm4"), "{err}");
        for name in ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"] {
            assert!(err.contains(name), "{err}");
        }
        let err = for_gguf_arch("llama", 0).unwrap_err().to_string();
        assert!(err.contains("without experts"), "{err}");
    }

    #[test]
    fn profiles_are_declared_per_adapter() {
        for a in &ADAPTERS {
            assert!(a.profile.cpu_decode_routing_max_tokens >= 1);
        }
    }

    /// The plan of each architecture says what its file declares, for every layer.
    #[test]
    fn plans_follow_each_architecture() {
        use crate::synth::{synth_config, DimOverrides, Preset};
        for a in &ADAPTERS {
            let c = synth_config(a, Preset::Tiny, &DimOverrides::default()).unwrap();
            let plan = LayerPlan::new(a, &c);
            assert_eq!(plan.len(), c.n_layers);
            let hybrid = a.hybrid.delta_net.is_some();
            let deepseek = a.arch == Arch::DeepseekV3;
            let glm = a.arch == Arch::Glm4Moe;
            let gemma = a.arch == Arch::Gemma4;
            for (l, spec) in plan.layers().iter().enumerate() {
                // DeepSeek-V3: a dense first layer, then sigmoid-routed MoE with an ungated
                // shared expert; latent attention everywhere.
                let Some(moe) = spec.as_moe() else {
                    assert!((deepseek || glm) && l == 0, "{:?} layer {l}", a.arch);
                    continue;
                };
                assert_eq!(moe.shared.is_some(), a.shared_expert, "{:?}", a.arch);
                if let Mixer::LatentAttention(m) = spec.mixer {
                    assert!(deepseek, "{:?}", a.arch);
                    assert_eq!(
                        (moe.router.variant, moe.router.selection_bias),
                        (RoutingVariant::Sigmoid, true)
                    );
                    assert!(moe.shared.is_some_and(|s| !s.gated) && m.rope.dims == m.rope_dim);
                    continue;
                }
                assert!(!deepseek, "{:?} layer {l}", a.arch);
                // GLM-4.5: DeepSeek-V3's router and shared expert over grouped-query attention.
                let sigmoid =
                    (moe.router.variant, moe.router.selection_bias) == (RoutingVariant::Sigmoid, true);
                assert_eq!(sigmoid, glm, "{:?}", a.arch);
                assert!(!glm || moe.shared.is_some_and(|s| !s.gated), "{:?}", a.arch);
                assert_eq!((moe.router.n_experts, moe.expert_ff), (c.n_experts, c.expert_ff));
                // The Qwen hybrids: every fourth layer gated attention, the others DeltaNet.
                let full = !hybrid || (l + 1) % 4 == 0;
                let Some(att) = spec.as_attention() else {
                    assert!(!full, "{:?} layer {l}", a.arch);
                    continue;
                };
                assert!(full, "{:?} layer {l}", a.arch);
                assert_eq!(
                    att.qkv_bias,
                    matches!(a.arch, Arch::Qwen2Moe | Arch::GptOss | Arch::Glm4Moe),
                    "{:?}",
                    a.arch
                );
                let oss = a.arch == Arch::GptOss;
                assert_eq!((att.sinks, att.o_bias, att.rope.yarn.is_some()), (oss, oss, oss), "{:?}", a.arch);
                let sliding = (oss || gemma) && l % 2 == 0 && !(gemma && l + 1 == c.n_layers);
                assert_eq!(att.window.is_some(), sliding, "{:?} layer {l}", a.arch);
                // Gemma 4: its global layers have their own head dim, keys as values and
                // proportional RoPE; every layer its norms, scalar, scaled router, branch norms.
                assert_eq!(att.values_from_keys, gemma && !sliding, "{:?} layer {l}", a.arch);
                assert_eq!(att.rope.turning_pairs.is_some(), gemma && !sliding, "{:?} layer {l}", a.arch);
                assert_eq!((spec.post_norms, spec.output_scale, att.v_norm), (gemma, gemma, gemma));
                assert_eq!((moe.branch_norms, moe.router.scaled_input), (gemma, gemma), "{:?}", a.arch);
                assert_eq!((moe.router.bias, moe.expert_bias), (oss, oss), "{:?}", a.arch);
                assert_eq!(att.output_gate, hybrid, "{:?}", a.arch);
                assert_eq!(att.rope.dims < att.head_dim, hybrid || glm, "{:?}: partial RoPE", a.arch);
                let expected_norm = match a.arch {
                    Arch::Qwen3Moe | Arch::Qwen3Next | Arch::Qwen35Moe | Arch::Glm4Moe | Arch::Gemma4 => {
                        QkNorm::PerHead
                    }
                    Arch::Olmoe => QkNorm::WholeProjection,
                    Arch::Mixtral | Arch::Qwen2Moe | Arch::GptOss => QkNorm::None,
                    Arch::DeepseekV3 => unreachable!("latent attention, checked above"),
                };
                assert_eq!(att.qk_norm, expected_norm);
            }
            let runs = if hybrid || a.arch == Arch::GptOss || deepseek || glm || gemma { 2 } else { 1 };
            assert_eq!(plan.summary().len().min(2), runs, "{:?}", plan.summary());
        }
    }

    /// Every lane maps an activation through `FfnActivation::kernel`, so they cannot disagree
    /// (the CPU pool lane once mapped `Gelu` to the tanh form and the GPU engine's pool lane to
    /// the exact one); and each kernel activation is the function its Hugging Face name says.
    #[test]
    fn activations_map_to_the_function_their_name_says() {
        let exact = |x: f64| 0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2));
        let tanh = |x: f64| {
            0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
        };
        let silu = |x: f64| x / (1.0 + (-x).exp());
        for x in [-3.0f32, -1.0, -0.3, 0.0, 0.5, 1.0, 2.5] {
            let want = [
                (FfnActivation::Silu, silu(x as f64)),
                (FfnActivation::Gelu, exact(x as f64)),
                (FfnActivation::GeluTanh, tanh(x as f64)),
            ];
            for (act, w) in want {
                let got = act.kernel().apply(x) as f64;
                assert!((got - w).abs() < 2e-5, "{act:?}({x}) = {got}, want {w}");
            }
        }
        // The exact and tanh forms differ by more than the tolerance somewhere: the test can tell them apart.
        assert!((exact(-1.5) - tanh(-1.5)).abs() > 1e-4);
    }

    /// Abramowitz-Stegun 7.1.26 is too coarse here; a series that converges for |x| <= 3.
    fn erf(x: f64) -> f64 {
        let mut sum = 0.0;
        let mut term = x;
        for n in 0..60 {
            sum += term / (2 * n + 1) as f64;
            term *= -x * x / (n + 1) as f64;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    }
}
