//! Synthetic checkpoints: random weights for any adapter, written as GGUF (loadable by llama.cpp)
//! or as a Hugging Face safetensors directory, with the same weights in both for the same seed.
//!
//! Determinism: every tensor is generated row by row from `(seed, canonical name, row)`, where the
//! canonical name is the Hugging Face name, so the values do not depend on the format, the write
//! order or the chunking. GGUF-only transforms (stacking experts, permuting llama q/k rows for
//! GGML's interleaved RoPE, F32 for 1-D tensors and the router) move or widen values exactly.
//!
//! Routing skew is built into the weights with a *bias channel*: hidden channel 0 of every token
//! embedding holds a constant, and no attention output or expert down projection writes into it,
//! so after each RMSNorm the router sees the same value there for every token; each expert's router
//! weight on that channel then acts as a per-expert logit bias, ranked by a per-layer random
//! permutation, `bias(rank) = -s * ln(1 + rank)` in units of the router logits' noise.

use crate::format::dtype::DType;
use crate::format::gguf::{GgufError, GgufFile, GgufValueType, GgufWriter, MetaArray, MetaValue};
use crate::format::safetensors::{self, SafetensorsError, TensorSpec};
use crate::format::tensor::encode_f32;
use crate::model::arch::{Adapter, Arch, DeltaNetProjections, HfNaming, RopeStyle, VHeadOrder, YarnSpec};
use crate::model::config::HybridConfig;
use crate::model::config::ModelConfig;
use crate::model::naming::{self, ExpertProj, GlobalRole, LayerRole};
use crate::model::{expected_layer_shape, required_layer_roles};
use crate::output::{check_output, OutputKind};
use crate::quantize::{tensor_type, ModelFacts, QuantMix, QuantizeError};
use crate::text::{is_chatml_capable, HfTokenizerFiles, Tokenizer, TokenizerError, CHATML_TEMPLATE};
use crate::vocab::{self, VocabSpecials};
use half::{bf16, f16};
use serde::Serialize;
use std::io::Write;
use std::sync::Arc;

mod gguf_gemma4;
mod gguf_hybrid;
use std::path::{Path, PathBuf};

/// Dimension presets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// A few layers and experts; loads in milliseconds (tests).
    Tiny,
    /// Qwen3-30B-A3B's shapes (48 layers unless `--layers`).
    Qwen3_30bA3b,
    /// Qwen3.6-35B-A3B's shapes (`--arch qwen3_5_moe`): 40 layers, 3 Gated DeltaNet to 1 gated
    /// attention, 256 experts (top-8) and a shared expert, vocab 248,320.
    Qwen36_35bA3b,
    /// Qwen3-Next-80B-A3B's shapes (`--arch qwen3_next`): 48 layers, 512 experts (top-10).
    Qwen3Next80bA3b,
    /// GPT-OSS-20B's shapes (`--arch gpt_oss`): 24 layers, 32 experts (top-4) of 2880, hidden
    /// 2880, 64 q / 8 kv heads of 64, sliding window 128 on even layers, YaRN x32 of 4096.
    GptOss20b,
    /// GPT-OSS-120B's shapes (`--arch gpt_oss`): as 20B with 36 layers and 128 experts.
    GptOss120b,
    /// DeepSeek-V3's shapes (`--arch deepseek_v3`): 61 layers (3 dense of 18432), hidden 7168,
    /// 128 heads of MLA (q rank 1536, kv rank 512, nope 128, rope 64, v 128), 256 experts of
    /// 2048 (top-8 in 4 of 8 groups, scale 2.5) and a shared one, YaRN x40 of 4096.
    DeepseekV3,
    /// Kimi K2's shapes (`--arch deepseek_v3`): as DeepSeek-V3 with 64 heads, 384 experts in one
    /// group, one dense layer, scale 2.827, vocab 163840, YaRN x32 of 4096, theta 50000.
    KimiK2,
    /// GLM-4.5-Air's shapes (`--arch glm4_moe`): 46 layers (the first dense of 10944), hidden
    /// 4096, 96 q / 8 kv heads of 128 with q/k/v biases and RoPE on half of each head, 128
    /// experts of 1408 (top-8, sigmoid with the selection bias) and a shared one, vocab 151,552.
    Glm45Air,
}

impl Preset {
    /// A preset of a hybrid (DeltaNet) model.
    fn is_hybrid(self) -> bool {
        matches!(self, Preset::Qwen36_35bA3b | Preset::Qwen3Next80bA3b)
    }
}

impl std::str::FromStr for Preset {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "tiny" => Ok(Preset::Tiny),
            "qwen3-30b-a3b" => Ok(Preset::Qwen3_30bA3b),
            "qwen3.6-35b-a3b" => Ok(Preset::Qwen36_35bA3b),
            "qwen3-next-80b-a3b" => Ok(Preset::Qwen3Next80bA3b),
            "gpt-oss-20b" => Ok(Preset::GptOss20b),
            "gpt-oss-120b" => Ok(Preset::GptOss120b),
            "deepseek-v3" => Ok(Preset::DeepseekV3),
            "kimi-k2" => Ok(Preset::KimiK2),
            "glm-4.5-air" => Ok(Preset::Glm45Air),
            other => Err(format!(
                "unknown preset '{other}' (expected tiny, qwen3-30b-a3b, qwen3.6-35b-a3b, qwen3-next-80b-a3b, gpt-oss-20b, gpt-oss-120b, deepseek-v3, kimi-k2 or glm-4.5-air)"
            )),
        }
    }
}

/// How routed slots spread over a layer's experts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "kind", content = "s", rename_all = "snake_case")]
pub enum Skew {
    /// No bias: every expert equally likely.
    Uniform,
    /// Calibrated so that the most-used half of each layer's experts receives about 90% of the
    /// routed slots, as Qwen3-30B-A3B shows on real text.
    Skewed,
    /// `bias(rank) = -s * ln(1 + rank)`.
    Zipf(f32),
    /// `D` domains: the vocabulary splits into `D` equal token ranges, and each range routes to
    /// its own popular experts (its own ranking per layer, skewed as `Skewed`), so routing
    /// depends on the input. For bench scenarios where the workload moves.
    Domains(usize),
    /// `locality:p=P,drift=R[,topics=G][,window=W]`: `G` topics as `domains:G`, each with sharply
    /// ranked experts ([`crate::locality::LOCALITY_EXPONENT`]), so a token's experts follow its
    /// topic; `bench --scenario` with the same spec feeds the routing process with short-term
    /// memory ([`crate::locality`]: re-pick a recent token's topic with probability `p`, a
    /// popular set drifting at `drift` per token).
    Locality(crate::locality::LocalityParams),
}

/// The top-half coverage `Skew::Skewed` aims for (Qwen3-30B-A3B on real text shows 85-95%).
pub const SKEWED_TARGET_COVERAGE: f64 = 0.90;

/// Expected top-half coverage for logits `bias(rank) + noise`, with unit Gaussian noise, by
/// simulation (deterministic). This is the statistical model of the router the bias channel
/// builds; `tests/synth_skew.rs` checks it against real forward passes.
pub fn simulated_top_half_coverage(n_experts: usize, k: usize, exponent: f32) -> f64 {
    const N_TOKENS: usize = 3000;
    let bias: Vec<f32> = (0..n_experts).map(|rank| -exponent * (1.0 + rank as f32).ln()).collect();
    let mut rng = SplitMix::new(0x5EED);
    let mut counts = vec![0u64; n_experts];
    let mut logits: Vec<(f32, usize)> = vec![(0.0, 0); n_experts];
    for _ in 0..N_TOKENS {
        for (rank, slot) in logits.iter_mut().enumerate() {
            *slot = (bias[rank] + rng.gaussian(), rank);
        }
        logits.select_nth_unstable_by(k - 1, |a, b| b.0.total_cmp(&a.0));
        logits[..k].iter().for_each(|&(_, rank)| counts[rank] += 1);
    }
    counts.sort_unstable_by(|a, b| b.cmp(a));
    let top: u64 = counts[..n_experts.div_ceil(2)].iter().sum();
    top as f64 / (N_TOKENS * k) as f64
}

/// The exponent whose simulated top-half coverage is `target` (bisection).
pub fn calibrate_exponent(n_experts: usize, k: usize, target: f64) -> f32 {
    let (mut lo, mut hi) = (0.0f32, 8.0f32);
    for _ in 0..24 {
        let mid = 0.5 * (lo + hi);
        if simulated_top_half_coverage(n_experts, k, mid) < target {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

impl std::str::FromStr for Skew {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "uniform" => Ok(Skew::Uniform),
            "skewed" => Ok(Skew::Skewed),
            _ if s.starts_with("locality:") => s.parse().map(Skew::Locality).map_err(|e| format!("{e}")),
            _ if s.starts_with("domains:") => match s["domains:".len()..].parse::<usize>() {
                Ok(d) if d >= 1 => Ok(Skew::Domains(d)),
                _ => Err(format!("skew '{s}': domains:D needs a whole number D >= 1")),
            },
            _ => match s.strip_prefix("zipf:").map(str::parse::<f32>) {
                Some(Ok(v)) if v.is_finite() && v >= 0.0 => Ok(Skew::Zipf(v)),
                _ => Err(format!(
                    "unknown skew '{s}' (expected uniform, skewed, zipf:S with S >= 0, domains:D with D >= 1 or locality:p=P,drift=R)"
                )),
            },
        }
    }
}

impl Skew {
    /// The bias exponent for a layer of `n_experts` with top-`k` routing (`None`: no bias).
    pub fn exponent(self, n_experts: usize, k: usize) -> Option<f32> {
        match self {
            Skew::Uniform => None,
            Skew::Skewed | Skew::Domains(_) => Some(calibrate_exponent(n_experts, k, SKEWED_TARGET_COVERAGE)),
            Skew::Zipf(s) => Some(s),
            Skew::Locality(_) => Some(crate::locality::LOCALITY_EXPONENT),
        }
    }

    /// Domains of the vocabulary (1 unless `Domains`).
    pub fn n_domains(self) -> usize {
        match self {
            Skew::Domains(d) => d,
            Skew::Locality(l) => l.topics,
            _ => 1,
        }
    }
}

// The vocabulary's split into domains is the locality workload's too (its topics): defined there,
// so the dependency runs one way (synth -> locality).
pub use crate::locality::{domain_of_token, domain_tokens};

/// Output file format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SynthFormat {
    Gguf,
    Safetensors,
}

/// Dimension overrides on top of a preset (`None` keeps the preset's value).
#[derive(Debug, Clone, Default)]
pub struct DimOverrides {
    pub n_layers: Option<usize>,
    pub hidden: Option<usize>,
    pub n_heads: Option<usize>,
    pub n_kv_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub vocab: Option<usize>,
    pub n_experts: Option<usize>,
    pub n_experts_used: Option<usize>,
    pub expert_ff: Option<usize>,
    pub shared_expert_ff: Option<usize>,
    pub tied_embeddings: Option<bool>,
    /// Multi-token-prediction (NextN) layers after the last layer, as llama.cpp's converter
    /// writes Qwen3.5's and GLM-4.5's (hybrids and glm4_moe, GGUF only): loaded, not run.
    pub mtp_layers: Option<usize>,
    /// q/k/v biases where the architecture leaves them to the config (glm4_moe's
    /// `attention_bias`, on by default as in GLM-4.5).
    pub attention_bias: Option<bool>,
    /// YaRN RoPE scaling by this factor over the preset's context (`original_max_position_embeddings`
    /// = the preset's context, the context this many times it), as Qwen3's model cards extend
    /// 32k to 128k; for architectures without their own RoPE scaling.
    pub yarn_factor: Option<f32>,
}

/// A tiny `qwen3_moe` GGUF test model's options (the crate's unit tests share it).
#[cfg(test)]
pub(crate) fn tiny_test_options(
    out: PathBuf,
    dims: DimOverrides,
    dtype: DType,
    seed: u64,
    skew: Skew,
) -> SynthOptions {
    SynthOptions {
        adapter: crate::model::arch::by_name("qwen3_moe").expect("a known adapter"),
        preset: Preset::Tiny,
        dims,
        dtype,
        seed,
        skew,
        format: SynthFormat::Gguf,
        out,
        vocab_from: None,
    }
}

/// [`tiny_test_options`] for an architecture whose routed experts carry biases and the clamped
/// SwiGLU (GPT-OSS), for engine tests that must not name one.
#[cfg(test)]
pub(crate) fn tiny_biased_experts_options(out: PathBuf, dims: DimOverrides, dtype: DType) -> SynthOptions {
    let adapter = crate::model::arch::by_name("gpt_oss").expect("a known adapter");
    SynthOptions { adapter, ..tiny_test_options(out, dims, dtype, 5, Skew::Skewed) }
}

/// Everything `synth` needs.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    pub adapter: &'static Adapter,
    pub preset: Preset,
    pub dims: DimOverrides,
    pub dtype: DType,
    pub seed: u64,
    pub skew: Skew,
    pub format: SynthFormat,
    pub out: PathBuf,
    /// Copy the tokenizer of this GGUF file (every `tokenizer.*` key, chat template included;
    /// the ChatML template when the vocabulary has `<|im_start|>`/`<|im_end|>` but no template)
    /// instead of writing the small synthetic one (which has the ChatML template; GGUF output
    /// only); the vocabulary size follows it. Safetensors output gets it as `tokenizer.json` +
    /// `tokenizer_config.json` (byte-level BPE only).
    pub vocab_from: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("invalid synthetic model: {field}: {reason}")]
    InvalidDims { field: String, reason: String },
    #[error("--dtype {0}: synth writes F32, F16 or BF16")]
    UnsupportedDType(DType),
    #[error(transparent)]
    Output(#[from] crate::output::OutputError),
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Safetensors(#[from] SafetensorsError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("{path}: cannot write {file}: {source}")]
    WriteTokenizer { path: PathBuf, file: &'static str, source: std::io::Error },
    #[error("--quant {mix}: quantized checkpoints are GGUF files (--format gguf)")]
    QuantFormat { mix: QuantMix },
    #[error(transparent)]
    Quantize(#[from] QuantizeError),
}

/// A real tokenizer to put into a synthetic model: its `tokenizer.*` metadata, validated, and
/// for safetensors output the same tokenizer as Hugging Face files.
struct CopiedTokenizer {
    metadata: Vec<(String, MetaValue)>,
    n_vocab: usize,
    hf_files: Option<HfTokenizerFiles>,
}

impl CopiedTokenizer {
    /// Read and validate (by loading it) the tokenizer of a GGUF file.
    /// A vocabulary with ChatML's markers but no template gets [`CHATML_TEMPLATE`].
    fn read(path: &Path, format: SynthFormat) -> Result<CopiedTokenizer, SynthError> {
        let file = GgufFile::open(path)?;
        let tokenizer = Tokenizer::from_gguf(&file)?;
        let add_chatml = tokenizer.chat_template().is_none() && is_chatml_capable(&tokenizer);
        let hf_files = match format {
            SynthFormat::Gguf => None,
            SynthFormat::Safetensors => Some(with_chatml(tokenizer.to_hf_files()?, add_chatml)),
        };
        let mut metadata: Vec<(String, MetaValue)> =
            file.metadata().iter().filter(|(k, _)| k.starts_with("tokenizer.")).cloned().collect();
        if add_chatml {
            metadata.push((CHAT_TEMPLATE_KEY.into(), MetaValue::String(CHATML_TEMPLATE.into())));
        }
        Ok(CopiedTokenizer { metadata, n_vocab: tokenizer.n_vocab(), hf_files })
    }

    /// Write `tokenizer.json` and `tokenizer_config.json` into a safetensors model directory.
    fn write_hf_files(&self, dir: &Path) -> Result<(), SynthError> {
        let Some(files) = &self.hf_files else { return Ok(()) };
        for (file, text) in [
            ("tokenizer.json", &files.tokenizer_json),
            ("tokenizer_config.json", &files.tokenizer_config_json),
        ] {
            std::fs::write(dir.join(file), text).map_err(|source| SynthError::WriteTokenizer {
                path: dir.into(),
                file,
                source,
            })?;
        }
        Ok(())
    }
}

/// GGUF's key of the Jinja chat template.
const CHAT_TEMPLATE_KEY: &str = "tokenizer.chat_template";

/// `tokenizer_config.json` with [`CHATML_TEMPLATE`] as its `chat_template` when `add` is set.
fn with_chatml(mut files: HfTokenizerFiles, add: bool) -> HfTokenizerFiles {
    if add {
        let mut config: serde_json::Value =
            serde_json::from_str(&files.tokenizer_config_json).expect("the exporter writes valid JSON");
        config["chat_template"] = CHATML_TEMPLATE.into();
        files.tokenizer_config_json = serde_json::to_string_pretty(&config).expect("JSON values serialize");
    }
    files
}

/// What was written.
#[derive(Debug, Clone, Serialize)]
pub struct SynthReport {
    pub path: PathBuf,
    pub format: SynthFormat,
    pub n_bytes: u64,
    pub n_tensors: usize,
    pub config: ModelConfig,
}

/// The model config a preset plus overrides describe.
pub fn synth_config(
    adapter: &Adapter,
    preset: Preset,
    dims: &DimOverrides,
) -> Result<ModelConfig, SynthError> {
    let mut c = preset_config(adapter, preset);
    let hybrid = adapter.hybrid.delta_net.is_some();
    if preset != Preset::Tiny && hybrid != preset.is_hybrid() {
        let want =
            if preset.is_hybrid() { "qwen3_next or qwen3_5_moe" } else { "an attention-only architecture" };
        return Err(invalid("preset", format!("this preset is for {want}, not {}", adapter.hf_model_type)));
    }
    let oss_preset = matches!(preset, Preset::GptOss20b | Preset::GptOss120b);
    if oss_preset != (adapter.arch == Arch::GptOss) && preset != Preset::Tiny {
        let want = if oss_preset { "gpt_oss" } else { "another architecture" };
        return Err(invalid("preset", format!("this preset is for {want}, not {}", adapter.hf_model_type)));
    }
    let ds_preset = matches!(preset, Preset::DeepseekV3 | Preset::KimiK2);
    if ds_preset != (adapter.arch == Arch::DeepseekV3) && preset != Preset::Tiny {
        let want = if ds_preset { "deepseek_v3" } else { "another architecture" };
        return Err(invalid("preset", format!("this preset is for {want}, not {}", adapter.hf_model_type)));
    }
    let glm_preset = preset == Preset::Glm45Air;
    if glm_preset != (adapter.arch == Arch::Glm4Moe) && preset != Preset::Tiny {
        let want = if glm_preset { "glm4_moe" } else { "another architecture" };
        return Err(invalid("preset", format!("this preset is for {want}, not {}", adapter.hf_model_type)));
    }
    if hybrid {
        tiny_hybrid(&mut c, preset, dims);
    }
    let set = |slot: &mut usize, v: Option<usize>| {
        if let Some(v) = v {
            *slot = v
        }
    };
    set(&mut c.n_layers, dims.n_layers);
    set(&mut c.hidden, dims.hidden);
    set(&mut c.n_heads, dims.n_heads);
    set(&mut c.n_kv_heads, dims.n_kv_heads);
    set(&mut c.head_dim, dims.head_dim);
    set(&mut c.vocab, dims.vocab);
    set(&mut c.n_experts, dims.n_experts);
    set(&mut c.n_experts_used, dims.n_experts_used);
    set(&mut c.expert_ff, dims.expert_ff);
    if adapter.shared_expert {
        set(&mut c.shared_expert_ff, dims.shared_expert_ff);
    } else if dims.shared_expert_ff.is_some() {
        return Err(invalid("shared_expert_ff", format!("{} has no shared expert", adapter.hf_model_type)));
    }
    if let Some(tied) = dims.tied_embeddings {
        c.tied_embeddings = tied;
    }
    if let Some(mtp) = dims.mtp_layers.filter(|&m| m > 0) {
        if !hybrid && adapter.arch != Arch::Glm4Moe {
            return Err(invalid("mtp_layers", format!("{} has no MTP layers here", adapter.hf_model_type)));
        }
        c.mtp_layers = mtp;
    }
    c.rotary_dims = ((c.head_dim as f64 * adapter.hybrid.default_partial_rotary) as usize).max(2) & !1;
    c.zero_centred_norms = adapter.hybrid.hf_zero_centred_norms;
    if let Some(h) = &mut c.hybrid {
        h.full_attention_layers = HybridConfig::every_nth_full(QWEN_HYBRID_INTERVAL, c.n_layers);
        // The canonical model is the Hugging Face checkpoint; a GGUF file is written from it in
        // llama.cpp's layout (`gguf_tensor_plan`).
        h.projections = adapter.hybrid.delta_net.expect("a hybrid config belongs to a hybrid architecture");
        h.v_heads = VHeadOrder::Grouped;
    }
    if adapter.arch == Arch::GptOss {
        gpt_oss_traits(&mut c, preset);
    }
    if adapter.arch == Arch::DeepseekV3 {
        deepseek_traits(&mut c, preset);
    }
    if adapter.arch == Arch::Gemma4 {
        gemma4_traits(&mut c);
    }
    if adapter.arch == Arch::Glm4Moe {
        glm_traits(&mut c, preset);
        c.attention_bias = dims.attention_bias.unwrap_or(true);
    } else if dims.attention_bias.is_some() {
        let reason = format!("{} fixes its attention biases", adapter.hf_model_type);
        return Err(invalid("attention_bias", reason));
    }
    if let Some(factor) = dims.yarn_factor {
        extend_with_yarn(&mut c, factor, adapter)?;
    }
    c.validate().map_err(|(field, reason)| invalid(field, reason))?;
    check_dim_limits(&c)?;
    if adapter.shared_expert && c.shared_expert_ff == 0 {
        return Err(invalid("shared_expert_ff", "must be greater than zero".into()));
    }
    Ok(c)
}

/// `--yarn F`: YaRN over the preset's context, which becomes `F` times longer (the attention
/// factor YaRN's default for `F`, as transformers computes it when the config names none).
fn extend_with_yarn(c: &mut ModelConfig, factor: f32, adapter: &Adapter) -> Result<(), SynthError> {
    if !factor.is_finite() || factor < 1.0 {
        return Err(invalid("yarn", format!("factor {factor} must be a finite number >= 1")));
    }
    if c.yarn.is_some() || c.rope_linear.is_some() {
        let reason = format!("{} brings its own RoPE scaling", adapter.hf_model_type);
        return Err(invalid("yarn", reason));
    }
    let original_context = c.max_positions;
    c.max_positions = (original_context as f64 * factor as f64).round() as usize;
    c.yarn = Some(YarnSpec {
        factor,
        original_context,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
        attention_factor: crate::model::arch::yarn_default_attention_factor(factor),
    });
    Ok(())
}

/// The dimensions a preset names, before overrides.
fn preset_config(adapter: &Adapter, preset: Preset) -> ModelConfig {
    match preset {
        Preset::Tiny => tiny_config(adapter),
        Preset::Qwen3_30bA3b => ModelConfig {
            n_layers: 48,
            hidden: 2048,
            n_heads: 32,
            n_kv_heads: 4,
            head_dim: 128,
            vocab: 151_936,
            n_experts: 128,
            n_experts_used: 8,
            expert_ff: 768,
            shared_expert_ff: if adapter.shared_expert { 768 } else { 0 },
            rope_theta: 1_000_000.0,
            max_positions: 40_960,
            ..preset_config(adapter, Preset::Tiny)
        },
        Preset::Qwen36_35bA3b | Preset::Qwen3Next80bA3b => {
            let next = preset == Preset::Qwen3Next80bA3b;
            ModelConfig {
                arch: adapter.arch,
                n_layers: if next { 48 } else { 40 },
                hidden: 2048,
                n_heads: 16,
                n_kv_heads: 2,
                head_dim: 256,
                vocab: if next { 151_936 } else { 248_320 },
                n_experts: if next { 512 } else { 256 },
                n_experts_used: if next { 10 } else { 8 },
                expert_ff: 512,
                shared_expert_ff: 512,
                rms_eps: 1e-6,
                rope_theta: 10_000_000.0,
                rope_style: adapter.rope_style,
                norm_topk_prob: true,
                tied_embeddings: false,
                max_positions: 262_144,
                sliding_window: None,
                sliding_window_layers: None,
                yarn: None,
                rope_linear: None,
                clip_qkv: None,
                rotary_dims: 0,
                hybrid: Some(HybridConfig {
                    n_k_heads: 16,
                    n_v_heads: 32,
                    k_head_dim: 128,
                    v_head_dim: 128,
                    conv_kernel: 4,
                    full_attention_layers: Vec::new(),
                    projections: adapter.hybrid.delta_net.unwrap_or(DeltaNetProjections::Split),
                    v_heads: VHeadOrder::Grouped,
                }),
                zero_centred_norms: false,
                mtp_layers: 0,
                mla: None,
                dense_layers: None,
                sigmoid_routing: None,
                qk_norm: false,
                attention_bias: false,
                global_attention: None,
                embedding_scale: None,
                final_logit_softcap: None,
            }
        }
        Preset::DeepseekV3 | Preset::KimiK2 => deepseek_preset(adapter, preset),
        Preset::Glm45Air => ModelConfig {
            n_layers: 46,
            hidden: 4096,
            n_heads: 96,
            n_kv_heads: 8,
            head_dim: 128,
            vocab: 151_552,
            n_experts: 128,
            n_experts_used: 8,
            expert_ff: 1408,
            shared_expert_ff: 1408,
            rms_eps: 1e-5,
            rope_theta: 1_000_000.0,
            max_positions: 131_072,
            ..preset_config(adapter, Preset::Tiny)
        },
        Preset::GptOss20b | Preset::GptOss120b => {
            let big = preset == Preset::GptOss120b;
            ModelConfig {
                n_layers: if big { 36 } else { 24 },
                hidden: 2880,
                n_heads: 64,
                n_kv_heads: 8,
                head_dim: 64,
                vocab: 201_088,
                n_experts: if big { 128 } else { 32 },
                n_experts_used: 4,
                expert_ff: 2880,
                max_positions: 131_072,
                ..preset_config(adapter, Preset::Tiny)
            }
        }
    }
}

/// GPT-OSS's attention and RoPE: a 128-token window (16 in the tiny preset, so short prompts
/// cross it) on the even layers, YaRN x32 of 4096 as published (transformers' form: beta 32/1,
/// no truncation).
/// The tiny preset's dimensions (every architecture's base).
fn tiny_config(adapter: &Adapter) -> ModelConfig {
    ModelConfig {
        arch: adapter.arch,
        n_layers: 2,
        hidden: 64,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 16,
        vocab: 512,
        n_experts: 8,
        n_experts_used: 2,
        expert_ff: 32,
        shared_expert_ff: if adapter.shared_expert { 48 } else { 0 },
        rms_eps: 1e-6,
        rope_theta: adapter.default_rope_theta,
        rope_style: adapter.rope_style,
        norm_topk_prob: adapter.gguf_default_norm_topk,
        tied_embeddings: false,
        max_positions: 4096,
        sliding_window: None,
        sliding_window_layers: None,
        yarn: None,
        rope_linear: None,
        clip_qkv: None,
        rotary_dims: 0,
        hybrid: None,
        zero_centred_norms: false,
        mtp_layers: 0,
        mla: None,
        dense_layers: None,
        sigmoid_routing: None,
        qk_norm: false,
        attention_bias: false,
        global_attention: None,
        embedding_scale: None,
        final_logit_softcap: None,
    }
}

/// DeepSeek-V3's and Kimi K2's dimensions (the MLA, dense layers and router in `deepseek_traits`).
fn deepseek_preset(adapter: &Adapter, preset: Preset) -> ModelConfig {
    let kimi = preset == Preset::KimiK2;
    ModelConfig {
        n_layers: 61,
        hidden: 7168,
        n_heads: if kimi { 64 } else { 128 },
        n_kv_heads: if kimi { 64 } else { 128 },
        head_dim: 64,
        vocab: if kimi { 163_840 } else { 129_280 },
        n_experts: if kimi { 384 } else { 256 },
        n_experts_used: 8,
        expert_ff: 2048,
        shared_expert_ff: 2048,
        rope_theta: if kimi { 50_000.0 } else { 10_000.0 },
        max_positions: if kimi { 131_072 } else { 163_840 },
        ..preset_config(adapter, Preset::Tiny)
    }
}

/// DeepSeek-V3's latent attention, leading dense layers and grouped sigmoid router (tiny: a
/// 32-wide latent, RoPE on 8 of each head (`head_dim`), one dense layer of 48, 4 groups of which
/// 2 are kept, scale 2.5). Every head is its own key/value head (MLA).
fn deepseek_traits(c: &mut ModelConfig, preset: Preset) {
    let tiny = preset == Preset::Tiny;
    let (q_rank, kv_rank, nope, v) = if tiny { (32, 32, 16, 16) } else { (1536, 512, 128, 128) };
    c.n_kv_heads = c.n_heads;
    // Whole shared experts of the routed size (`n_shared_experts`).
    c.shared_expert_ff = c.expert_ff * (c.shared_expert_ff / c.expert_ff.max(1)).max(1);
    c.rope_style = RopeStyle::Interleaved;
    c.norm_topk_prob = true;
    c.mla = Some(crate::model::config::MlaConfig {
        q_lora_rank: Some(q_rank),
        kv_lora_rank: kv_rank,
        qk_nope_head_dim: nope,
        qk_rope_head_dim: c.head_dim,
        v_head_dim: v,
        mscale_all_dim: 1.0,
    });
    let kimi = preset == Preset::KimiK2;
    let dense = match preset {
        Preset::Tiny => 1,
        Preset::KimiK2 => 1,
        _ => 3,
    };
    let ff = if tiny { 48 } else { 18432 };
    c.dense_layers = (c.n_layers > dense).then_some(crate::model::config::DenseLayers { count: dense, ff });
    let (n_group, topk_group) = match preset {
        Preset::Tiny => (4.min(c.n_experts / 2).max(1), 2.min(c.n_experts / 2).max(1)),
        _ if kimi => (1, 1),
        _ => (8, 4),
    };
    let scale = if kimi { 2.827 } else { 2.5 };
    c.sigmoid_routing =
        Some(crate::model::config::SigmoidRouting { n_group, topk_group, routed_scaling_factor: scale });
    let (factor, original) = if tiny {
        (4.0, 64)
    } else if kimi {
        (32.0, 4096)
    } else {
        (40.0, 4096)
    };
    c.yarn = Some(YarnSpec {
        factor,
        original_context: original,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
        attention_factor: 1.0,
    });
}

/// GLM-4.5's leading dense layer, grouped sigmoid router and per-head q/k norm (tiny: one dense
/// layer of 48, 2 groups of which 1 is kept, scale 2.5, q/k norm on; GLM-4.5-Air: one dense
/// layer of 10944, one group, scale 1, no q/k norm). RoPE on half of each head comes from the
/// adapter's default.
fn glm_traits(c: &mut ModelConfig, preset: Preset) {
    let tiny = preset == Preset::Tiny;
    // Whole shared experts of the routed size (`n_shared_experts`).
    c.shared_expert_ff = c.expert_ff * (c.shared_expert_ff / c.expert_ff.max(1)).max(1);
    c.norm_topk_prob = true;
    c.qk_norm = tiny;
    let ff = if tiny { 48 } else { 10944 };
    c.dense_layers = (c.n_layers > 1).then_some(crate::model::config::DenseLayers { count: 1, ff });
    // Tiny: two groups where the experts split evenly, the second kept too only when one group
    // cannot hold the experts a token takes (an `--experts` / `--experts-used` override).
    let n_group = if tiny && c.n_experts >= 4 && c.n_experts.is_multiple_of(2) { 2 } else { 1 };
    let topk_group = if c.n_experts_used * n_group > c.n_experts { n_group } else { 1 };
    let scale = if tiny { 2.5 } else { 1.0 };
    c.sigmoid_routing =
        Some(crate::model::config::SigmoidRouting { n_group, topk_group, routed_scaling_factor: scale });
}

fn gpt_oss_traits(c: &mut ModelConfig, preset: Preset) {
    c.sliding_window = Some(if preset == Preset::Tiny { 16 } else { 128 });
    c.sliding_window_layers = Some(crate::model::config::every_other_layer(c.n_layers));
    c.yarn = Some(crate::model::arch::YarnSpec {
        factor: 32.0,
        original_context: 4096,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: false,
        attention_factor: crate::model::arch::yarn_default_attention_factor(32.0),
    });
    c.rms_eps = 1e-5;
    c.norm_topk_prob = false;
}

/// Gemma 4's traits over the chosen dims: even layers sliding (window 16), the others (the last
/// always) global with twice the head dim, one KV head, keys as values and proportional RoPE
/// on a quarter of each head; embeddings times `sqrt(hidden)`, logits capped at 30.
fn gemma4_traits(c: &mut ModelConfig) {
    c.sliding_window = Some(16);
    c.sliding_window_layers = Some((0..c.n_layers).filter(|l| l % 2 == 0 && l + 1 != c.n_layers).collect());
    c.rotary_dims = c.head_dim;
    c.global_attention = Some(crate::model::config::GlobalAttention {
        head_dim: 2 * c.head_dim,
        n_kv_heads: 1,
        rope_theta: 1_000_000.0,
        turning_pairs: (2 * c.head_dim) / 8,
        values_from_keys: true,
    });
    c.embedding_scale = Some((c.hidden as f64).sqrt() as f32);
    c.final_logit_softcap = Some(30.0);
    c.norm_topk_prob = true;
}

/// One layer in this many is full attention in the Qwen hybrids (`full_attention_interval`).
const QWEN_HYBRID_INTERVAL: usize = 4;

/// The tiny preset of a hybrid architecture: four layers (three DeltaNet, one attention) and small
/// DeltaNet heads, unless overridden.
fn tiny_hybrid(c: &mut ModelConfig, preset: Preset, dims: &DimOverrides) {
    if preset != Preset::Tiny {
        return;
    }
    if dims.n_layers.is_none() {
        c.n_layers = QWEN_HYBRID_INTERVAL;
    }
    c.hybrid = Some(HybridConfig {
        n_k_heads: 2,
        n_v_heads: 4,
        k_head_dim: 16,
        v_head_dim: 16,
        conv_kernel: 4,
        full_attention_layers: Vec::new(),
        projections: DeltaNetProjections::Split,
        v_heads: VHeadOrder::Grouped,
    });
}

/// The largest value of any one dimension of a synthetic model (a row of this many f32 values is
/// 64 MiB: generated rows stay small whatever is asked for).
pub const MAX_SYNTH_DIM: usize = 1 << 24;
/// The most layers times experts per layer (the writer plans one entry per expert tensor).
pub const MAX_SYNTH_EXPERT_TENSORS: usize = 1 << 20;

/// Every dimension within [`MAX_SYNTH_DIM`] and layers times experts within
/// [`MAX_SYNTH_EXPERT_TENSORS`], checked before anything is planned or allocated.
fn check_dim_limits(c: &ModelConfig) -> Result<(), SynthError> {
    let dims = [
        ("layers", c.n_layers),
        ("hidden", c.hidden),
        ("heads", c.n_heads),
        ("kv_heads", c.n_kv_heads),
        ("head_dim", c.head_dim),
        ("vocab", c.vocab),
        ("experts", c.n_experts),
        ("expert_ff", c.expert_ff),
        ("shared_expert_ff", c.shared_expert_ff),
    ];
    for (field, v) in dims {
        if v > MAX_SYNTH_DIM {
            return Err(invalid(field, format!("{v} is above the limit of {MAX_SYNTH_DIM}")));
        }
    }
    let wide =
        [("q_dim", c.n_heads.checked_mul(c.head_dim)), ("kv_dim", c.n_kv_heads.checked_mul(c.head_dim))];
    for (field, v) in wide {
        if v.is_none_or(|v| v > MAX_SYNTH_DIM) {
            return Err(invalid(
                field,
                format!("heads times head_dim is above the limit of {MAX_SYNTH_DIM}"),
            ));
        }
    }
    if c.n_layers * c.n_experts > MAX_SYNTH_EXPERT_TENSORS {
        let reason = format!(
            "{} layers of {} experts: at most {MAX_SYNTH_EXPERT_TENSORS} experts in all",
            c.n_layers, c.n_experts
        );
        return Err(invalid("experts", reason));
    }
    Ok(())
}

/// The checkpoint's bytes (checked arithmetic), refused when they do not fit the free space of
/// the output's filesystem.
fn check_disk_space(opts: &SynthOptions, tensors: &[PlannedTensor]) -> Result<u64, SynthError> {
    let too_big = || invalid("size", "the checkpoint's size overflows 64 bits".into());
    let mut total: u64 = 0;
    for t in tensors {
        let n = t.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).ok_or_else(too_big)?;
        let bytes = t.dtype.bytes_for(n).ok_or_else(too_big)?;
        total = total.checked_add(bytes as u64).ok_or_else(too_big)?;
    }
    let dir = opts.out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if let Some(free) = crate::output::free_bytes(dir) {
        if total > free {
            let reason = format!(
                "the checkpoint needs {} and {} has {} free",
                crate::inspect::format_bytes(total),
                dir.display(),
                crate::inspect::format_bytes(free)
            );
            return Err(invalid("size", reason));
        }
    }
    Ok(total)
}

fn invalid(field: &str, reason: String) -> SynthError {
    SynthError::InvalidDims { field: field.into(), reason }
}

/// Write a synthetic checkpoint. `progress(bytes_done, bytes_total)` is called as data is written.
pub fn write_synthetic(
    opts: &SynthOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<SynthReport, SynthError> {
    write_synthetic_as(opts, None, None, progress)
}

/// [`write_synthetic`], each GGUF tensor stored as `quantize --type quant` would store the float
/// file's (no float file is written).
fn write_synthetic_as(
    opts: &SynthOptions,
    quant: Option<QuantMix>,
    expert_row_pool: Option<usize>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<SynthReport, SynthError> {
    if !opts.dtype.is_float() {
        return Err(SynthError::UnsupportedDType(opts.dtype));
    }
    refuse_special(&opts.out)?;
    let mut config = synth_config(opts.adapter, opts.preset, &opts.dims)?;
    let copied = copied_tokenizer(opts, &mut config)?;
    let min_vocab = 256 + vocab_specials(config.arch).tokens().len();
    if opts.format == SynthFormat::Gguf && copied.is_none() && config.vocab < min_vocab {
        return Err(invalid(
            "vocab",
            format!("{} is below {min_vocab} (GGUF needs a byte-level tokenizer)", config.vocab),
        ));
    }
    if opts.skew.n_domains() + 1 >= config.hidden {
        return Err(invalid(
            "skew",
            format!(
                "domains:{} needs a hidden size above {}",
                opts.skew.n_domains(),
                opts.skew.n_domains() + 1
            ),
        ));
    }
    if opts.format == SynthFormat::Safetensors && config.mtp_layers > 0 {
        return Err(invalid("mtp_layers", "MTP layers are written to GGUF files only".into()));
    }
    let generator = WeightGenerator { expert_row_pool, ..WeightGenerator::new(&config, opts) };
    let mut tensors = match opts.format {
        SynthFormat::Gguf => gguf_tensor_plan(&config, opts),
        SynthFormat::Safetensors => hf_tensor_plan(&config, opts),
    };
    if let Some(mix) = quant {
        apply_quant_mix(&config, &mut tensors, mix);
    }
    check_disk_space(opts, &tensors)?;
    let mut fill = |idx: usize, out: &mut dyn Write| generator.write_tensor(&tensors[idx], out);
    let n_bytes = match opts.format {
        SynthFormat::Gguf => {
            let file_type = quant.map(QuantMix::file_type);
            write_gguf(&config, opts, copied.as_ref(), &tensors, file_type, &mut fill, progress)?
        }
        SynthFormat::Safetensors => {
            let n_bytes = write_hf(&config, opts, &tensors, &mut fill, progress)?;
            copied.as_ref().map(|c| c.write_hf_files(&opts.out)).transpose()?;
            n_bytes
        }
    };
    if opts.format == SynthFormat::Gguf {
        // What a reader of the file sees.
        config.rope_style = opts.adapter.gguf_rope_style;
        config.zero_centred_norms = false;
        if let (Some(h), Some((projections, v_heads))) =
            (&mut config.hybrid, opts.adapter.hybrid.gguf_delta_net)
        {
            (h.projections, h.v_heads) = (projections, v_heads);
        }
    }
    Ok(SynthReport { path: opts.out.clone(), format: opts.format, n_bytes, n_tensors: tensors.len(), config })
}

/// `synth --quant`: each tensor is generated as the float checkpoint's and stored as
/// `quantize --type mix` would store it, straight into `out` (no float file: a 40-layer
/// Qwen3.6-shaped checkpoint is 70 GB in BF16 and 20 GB in Q4_K_M).
/// Each planned tensor's type in `mix`, as `quantize` chooses it for the same file.
fn apply_quant_mix(config: &ModelConfig, tensors: &mut [PlannedTensor], mix: QuantMix) {
    let facts = ModelFacts {
        n_layers: config.n_layers + config.mtp_layers,
        n_experts: config.n_experts,
        tied_embeddings: config.tied_embeddings,
        n_gqa: config.n_heads / config.n_kv_heads.max(1),
    };
    for t in tensors {
        t.dtype = tensor_type(mix, &t.name, &t.shape, t.dtype, facts);
    }
}

pub fn write_synthetic_quantized(
    opts: &SynthOptions,
    mix: QuantMix,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<SynthReport, SynthError> {
    if opts.format != SynthFormat::Gguf {
        return Err(SynthError::QuantFormat { mix });
    }
    write_synthetic_as(opts, Some(mix), None, progress)
}

/// [`write_synthetic_quantized`] at about the speed of memory for files made to be timed: each
/// quantized expert tensor's first `expert_row_pool` rows are generated and quantized as there,
/// every later row is a copy of one of them (drawn by a hash of the row). Quantizing is what
/// takes the time (K-quants search scales: a 70 GB GLM-4.5-Air Q4_K_M file takes hours on one
/// core); the copies have the same types, sizes and value statistics, so the kernels' work and
/// the bytes they read are those of the full file, but the experts are no longer independent
/// draws: not for accuracy tests. The router and every other tensor are generated as usual.
pub fn write_synthetic_quantized_pooled(
    opts: &SynthOptions,
    mix: QuantMix,
    expert_row_pool: std::num::NonZeroUsize,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<SynthReport, SynthError> {
    if opts.format != SynthFormat::Gguf {
        return Err(SynthError::QuantFormat { mix });
    }
    write_synthetic_as(opts, Some(mix), Some(expert_row_pool.get()), progress)
}

/// `--vocab-from`: read the tokenizer and make the vocabulary size follow it.
fn copied_tokenizer(
    opts: &SynthOptions,
    config: &mut ModelConfig,
) -> Result<Option<CopiedTokenizer>, SynthError> {
    let Some(path) = &opts.vocab_from else { return Ok(None) };
    let copied = CopiedTokenizer::read(path, opts.format)?;
    if let Some(v) = opts.dims.vocab.filter(|&v| v != copied.n_vocab) {
        let reason =
            format!("{v} conflicts with the {} tokens of --vocab-from {}", copied.n_vocab, path.display());
        return Err(invalid("vocab", reason));
    }
    config.vocab = copied.n_vocab;
    Ok(Some(copied))
}

fn write_gguf(
    config: &ModelConfig,
    opts: &SynthOptions,
    copied: Option<&CopiedTokenizer>,
    tensors: &[PlannedTensor],
    quantized_file_type: Option<u32>,
    fill: &mut dyn FnMut(usize, &mut dyn Write) -> std::io::Result<()>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<u64, SynthError> {
    let mut w = GgufWriter::new();
    add_gguf_metadata(&mut w, config, opts);
    if let Some(file_type) = quantized_file_type {
        w.add_metadata("general.file_type", MetaValue::U32(file_type));
    }
    match copied {
        Some(tok) => tok.metadata.iter().for_each(|(k, v)| w.add_metadata(k.clone(), v.clone())),
        None => add_synthetic_vocab(&mut w, config),
    }
    for t in tensors {
        w.add_tensor(t.name.clone(), t.dtype, &t.shape);
    }
    let total = w.total_bytes();
    w.write(&opts.out, fill, &mut |done| progress(done, total))?;
    Ok(total)
}

fn write_hf(
    config: &ModelConfig,
    opts: &SynthOptions,
    tensors: &[PlannedTensor],
    fill: &mut dyn FnMut(usize, &mut dyn Write) -> std::io::Result<()>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<u64, SynthError> {
    let specs: Vec<TensorSpec> = tensors
        .iter()
        .map(|t| TensorSpec { name: t.name.clone(), dtype: t.dtype, shape: t.shape.clone() })
        .collect();
    let total: u64 = tensors.iter().map(|t| t.n_bytes() as u64).sum();
    let hf_json = config.to_hf_json(opts.adapter);
    // Shards of at most 4 GiB, as Hugging Face writes large checkpoints.
    const MAX_SHARD_BYTES: u64 = 4 << 30;
    let mut done = 0u64;
    safetensors::write_model_dir(&opts.out, &hf_json, &specs, Some(MAX_SHARD_BYTES), fill, &mut |n_bytes| {
        done += n_bytes;
        progress(done, total)
    })?;
    Ok(total)
}

/// llama.cpp's deepseek2 keys: the latent attention's sizes (MQA over the latent: one KV head
/// of `kv_lora_rank + rope`), the leading dense layers, sigmoid gating with its groups and scale.
/// Written after the generic keys' values, which these replace where both name one.
fn add_deepseek_metadata(w: &mut GgufWriter, c: &ModelConfig, arch: &str) {
    let k = |suffix: &str| format!("{arch}.{suffix}");
    let u32v = |v: usize| MetaValue::U32(v as u32);
    if let Some(m) = &c.mla {
        if let Some(q) = m.q_lora_rank {
            w.add_metadata(k("attention.q_lora_rank"), u32v(q));
        }
        w.add_metadata(k("attention.kv_lora_rank"), u32v(m.kv_lora_rank));
        w.add_metadata(k("attention.key_length_mla"), u32v(m.qk_nope_head_dim + m.qk_rope_head_dim));
        w.add_metadata(k("attention.value_length_mla"), u32v(m.v_head_dim));
        w.add_metadata(k("rope.scaling.yarn_log_multiplier"), MetaValue::F32(0.1 * m.mscale_all_dim));
    }
    if c.mla.is_some() || c.arch == Arch::Glm4Moe {
        w.add_metadata(k("expert_shared_count"), u32v(c.shared_expert_ff / c.expert_ff.max(1)));
    }
    if let Some(d) = &c.dense_layers {
        w.add_metadata(k("leading_dense_block_count"), u32v(d.count));
    }
    if let Some(r) = &c.sigmoid_routing {
        w.add_metadata(k("expert_gating_func"), MetaValue::U32(2));
        w.add_metadata(k("expert_weights_scale"), MetaValue::F32(r.routed_scaling_factor));
        w.add_metadata(k("expert_group_count"), u32v(r.n_group));
        w.add_metadata(k("expert_group_used_count"), u32v(r.topk_group));
    }
}

/// llama.cpp's metadata keys for the architecture.
fn add_gguf_metadata(w: &mut GgufWriter, c: &ModelConfig, opts: &SynthOptions) {
    gguf_metadata(w, c, opts.adapter, opts.dtype);
}

/// The model metadata llama.cpp's converter writes for `c` (its keys for `adapter`'s GGUF
/// architecture; no tokenizer), for a file of `dtype` weights. Public so that a checkpoint can be
/// rewritten in llama.cpp's layout by other writers (the tests' fixture conversion).
pub fn gguf_metadata(w: &mut GgufWriter, c: &ModelConfig, adapter: &Adapter, dtype: DType) {
    let arch = adapter.gguf_arch;
    let k = |suffix: &str| format!("{arch}.{suffix}");
    let u32v = |v: usize| MetaValue::U32(v as u32);
    w.add_metadata("general.architecture", MetaValue::String(arch.into()));
    w.add_metadata(
        "general.name",
        MetaValue::String(format!("moe-lanes synthetic {}", adapter.hf_model_type)),
    );
    w.add_metadata("general.file_type", MetaValue::U32(gguf_file_type(dtype)));
    w.add_metadata("general.quantization_version", MetaValue::U32(2));
    w.add_metadata(k("context_length"), u32v(c.max_positions));
    w.add_metadata(k("embedding_length"), u32v(c.hidden));
    w.add_metadata(k("block_count"), u32v(c.n_layers + c.mtp_layers));
    if c.mtp_layers > 0 {
        w.add_metadata(k("nextn_predict_layers"), u32v(c.mtp_layers));
    }
    let dense_ff = if matches!(c.arch, Arch::Qwen3Moe | Arch::Qwen2Moe) {
        c.expert_ff * c.n_experts_used
    } else {
        c.expert_ff
    };
    let dense_ff = c.dense_layers.map_or(dense_ff, |d| d.ff);
    w.add_metadata(k("feed_forward_length"), u32v(dense_ff));
    add_deepseek_metadata(w, c, arch);
    w.add_metadata(k("expert_feed_forward_length"), u32v(c.expert_ff));
    if c.shared_expert_ff > 0 && c.arch != Arch::Gemma4 {
        w.add_metadata(k("expert_shared_feed_forward_length"), u32v(c.shared_expert_ff));
    }
    w.add_metadata(k("attention.head_count"), u32v(c.n_heads));
    // MLA is MQA over the latent in llama.cpp's deepseek2: one KV head of the latent + rope.
    let (kv_heads, key, value) = match &c.mla {
        Some(m) => (1, m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank),
        None => (c.n_kv_heads, c.head_dim, c.head_dim),
    };
    w.add_metadata(k("attention.head_count_kv"), u32v(kv_heads));
    w.add_metadata(k("attention.key_length"), u32v(key));
    w.add_metadata(k("attention.value_length"), u32v(value));
    w.add_metadata(k("attention.layer_norm_rms_epsilon"), MetaValue::F32(c.rms_eps));
    w.add_metadata(k("rope.freq_base"), MetaValue::F32(c.rope_theta));
    w.add_metadata(k("rope.dimension_count"), u32v(c.rotary_dims));
    w.add_metadata(k("expert_count"), u32v(c.n_experts));
    w.add_metadata(k("expert_used_count"), u32v(c.n_experts_used));
    w.add_metadata(k("expert_weights_norm"), MetaValue::Bool(c.norm_topk_prob));
    w.add_metadata(k("vocab_size"), u32v(c.vocab));
    if let Some(window) = c.sliding_window {
        w.add_metadata(k("attention.sliding_window"), u32v(window));
    }
    if let Some(y) = c.yarn {
        w.add_metadata(k("rope.scaling.type"), MetaValue::String("yarn".into()));
        w.add_metadata(k("rope.scaling.factor"), MetaValue::F32(y.factor));
        w.add_metadata(k("rope.scaling.original_context_length"), u32v(y.original_context));
        w.add_metadata(k("rope.scaling.yarn_beta_fast"), MetaValue::F32(y.beta_fast));
        w.add_metadata(k("rope.scaling.yarn_beta_slow"), MetaValue::F32(y.beta_slow));
        // Said only where it differs from what a reader takes without it (`config_from_gguf`:
        // 1 for a latent attention, whose `mscale` and `mscale_all_dim` DeepSeek-V3 and Kimi K2
        // set equal; else YaRN's default): a DeepSeek config with `mscale` != `mscale_all_dim`.
        let default =
            if c.mla.is_some() { 1.0 } else { crate::model::arch::yarn_default_attention_factor(y.factor) };
        if (y.attention_factor - default).abs() > 1e-6 {
            w.add_metadata(k("rope.scaling.attn_factor"), MetaValue::F32(y.attention_factor));
        }
    }
    if let Some(factor) = c.rope_linear {
        w.add_metadata(k("rope.scaling.type"), MetaValue::String("linear".into()));
        w.add_metadata(k("rope.scaling.factor"), MetaValue::F32(factor));
    }
    if let Some(h) = &c.hybrid {
        add_hybrid_metadata(w, c, h, arch);
    }
    if c.arch == Arch::Gemma4 {
        gguf_gemma4::add_metadata(w, c, arch);
    }
}

/// The DeltaNet keys llama.cpp's converter writes for the Qwen hybrids.
fn add_hybrid_metadata(w: &mut GgufWriter, c: &ModelConfig, h: &HybridConfig, arch: &str) {
    let k = |suffix: &str| format!("{arch}.{suffix}");
    let u32v = |v: usize| MetaValue::U32(v as u32);
    w.add_metadata(k("ssm.conv_kernel"), u32v(h.conv_kernel));
    w.add_metadata(k("ssm.state_size"), u32v(h.k_head_dim));
    w.add_metadata(k("ssm.group_count"), u32v(h.n_k_heads));
    w.add_metadata(k("ssm.time_step_rank"), u32v(h.n_v_heads));
    w.add_metadata(k("ssm.inner_size"), u32v(h.n_v_heads * h.v_head_dim));
    let recurrent = (0..c.n_layers).map(|l| MetaValue::Bool(!h.is_full_attention(l))).collect();
    let array = MetaArray { elem_type: GgufValueType::Bool, values: recurrent };
    w.add_metadata(k("attention.recurrent_layers"), MetaValue::Array(array));
    w.add_metadata(k("full_attention_interval"), u32v(QWEN_HYBRID_INTERVAL));
    if c.arch == Arch::Qwen35Moe {
        // Qwen3.5's MRoPE sections (11, 11, 10 of 32 rotated pairs), scaled to this model's
        // rotary dims; text positions give every section the same position.
        let pairs = c.rotary_dims / 2;
        let first = pairs * 11 / 32;
        let sections = [first, first, pairs - 2 * first, 0].map(|s| s as i32).to_vec();
        w.add_metadata(k("rope.dimension_sections"), MetaValue::i32_array(sections));
    }
}

/// The small synthetic byte-level BPE tokenizer (src/vocab.rs): with ChatML's markers and the
/// ChatML chat template, or for GPT-OSS with Harmony's tokens and no template (the built-in
/// Harmony template renders its chats, `text::HARMONY_TEMPLATE`).
fn add_synthetic_vocab(w: &mut GgufWriter, c: &ModelConfig) {
    let specials = vocab_specials(c.arch);
    let v = vocab::synthetic_vocab_with(c.vocab, specials).expect("vocab size checked by the caller");
    for (key, value) in v.gguf_metadata() {
        w.add_metadata(key, value);
    }
    if specials == VocabSpecials::ChatMl {
        // Its specials are ChatML's markers, so chat works out of the box (the demo model's too).
        w.add_metadata(CHAT_TEMPLATE_KEY, MetaValue::String(CHATML_TEMPLATE.into()));
    }
}

/// The special tokens of an architecture's synthetic vocabulary: Harmony's for GPT-OSS.
pub fn vocab_specials(arch: crate::model::arch::Arch) -> VocabSpecials {
    match arch {
        crate::model::arch::Arch::GptOss => VocabSpecials::Harmony,
        _ => VocabSpecials::ChatMl,
    }
}

/// llama.cpp's `general.file_type` (LLAMA_FTYPE_*) for an all-float file.
fn gguf_file_type(dtype: DType) -> u32 {
    match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        _ => 32, // MOSTLY_BF16
    }
}

/// One tensor as written: its on-disk name, dtype and shape, and the canonical tensors whose rows
/// it concatenates (several for a stacked GGUF expert tensor).
struct PlannedTensor {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    parts: Vec<Canonical>,
    layout: Layout,
}

/// How a planned tensor's canonical parts are laid out on disk.
#[derive(Clone, Copy, PartialEq)]
enum Layout {
    /// Each part's rows in turn.
    Rows,
    /// Each part transposed (GPT-OSS's input-major `down_proj`: `[ff, hidden]` of a
    /// `[hidden, ff]` part).
    Columns,
    /// Parts in pairs (gate, up) of `[r, c]`, each pair written as `[c, 2r]` with the gate's
    /// row `i` in column `2i` and the up's in `2i + 1` (GPT-OSS's `gate_up_proj`).
    InterleavedColumns,
}

impl PlannedTensor {
    fn n_bytes(&self) -> usize {
        self.dtype.bytes_for(self.shape.iter().product()).expect("float dtype")
    }
}

/// A tensor in its canonical (Hugging Face) form, and how to generate it.
#[derive(Clone)]
struct Canonical {
    /// Hugging Face name; seeds the generator.
    key: String,
    /// The canonical (Hugging Face) tensor's rows and columns.
    n_rows: usize,
    n_cols: usize,
    init: Init,
    /// Which canonical row each row on disk holds.
    rows: RowMap,
    /// Which canonical column each column on disk holds (`None`: all, in order).
    cols: Option<Arc<[usize]>>,
    /// How a canonical value is stored.
    value: ValueMap,
    layer_idx: usize,
}

/// The rows a tensor on disk takes from its canonical tensor.
#[derive(Clone)]
enum RowMap {
    Same,
    /// llama.cpp's permuted order for interleaved RoPE (`head_dim` of the heads).
    RopeInterleaved(usize),
    /// Disk row `i` is canonical row `rows[i]` (llama.cpp's DeltaNet layouts).
    Pick(Arc<[usize]>),
}

/// How a canonical value (already rounded to the model dtype) is stored.
#[derive(Clone, Copy, PartialEq)]
enum ValueMap {
    Same,
    /// `1 + w`: a zero-centred RMSNorm weight in a file that stores the scale (GGUF).
    PlusOne,
    /// `-exp(w)`: llama.cpp's `ssm_a` for a DeltaNet's `A_log`.
    NegExp,
}

impl Canonical {
    fn disk_rows(&self) -> usize {
        match &self.rows {
            RowMap::Pick(rows) => rows.len(),
            _ => self.n_rows,
        }
    }

    fn disk_cols(&self) -> usize {
        self.cols.as_ref().map_or(self.n_cols, |c| c.len())
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Init {
    /// Uniform with this standard deviation.
    Uniform(f32),
    /// `1 + uniform(±0.1)`: RMSNorm weights.
    NormWeight,
    /// `uniform(±0.1)`: RMSNorm weights of a zero-centred checkpoint (applied as `1 + w`).
    CentredNormWeight,
    /// Token embeddings: std 1, channel 0 set to the bias channel when skewed.
    Embedding,
    /// Output projections (attention o, expert/shared down): row 0 zero when skewed.
    ResidualWriter(f32),
    /// Router rows: column 0 carries the expert's bias when skewed.
    Router(f32),
    /// llama.cpp's `rope_freqs` for a proportional RoPE: 1 for this many pairs, then 1e30
    /// (f32 as its converter makes it, not rounded to the model dtype).
    RopeFreqs(usize),
}

/// One encode buffer per hardware thread.
fn thread_buffers() -> Vec<Vec<u8>> {
    vec![Vec::new(); std::thread::available_parallelism().map_or(1, |n| n.get())]
}

/// Whether a pooled file copies rows of `t`: a quantized expert tensor (GGUF `*_exps`) whose
/// parts store rows of one length (so one pool row fits every row) and that has rows to copy.
fn pools(t: &PlannedTensor) -> bool {
    let width = t.parts.first().map(Canonical::disk_cols);
    !t.dtype.is_float()
        && t.name.contains("_exps")
        && t.parts.iter().all(|p| Some(p.disk_cols()) == width && p.disk_rows() > 0)
}

/// Below this many values a batch of rows is encoded on the calling thread (spawning costs more).
const PARALLEL_MIN_VALUES: usize = 1 << 18;

/// Generates canonical tensors deterministically.
struct WeightGenerator {
    seed: u64,
    model_dtype: DType,
    hidden: usize,
    skew_exponent: Option<f32>,
    /// Per layer, per expert: the logit bias in noise units.
    router_bias: Vec<Vec<f32>>,
    /// `Domains(D)`: per domain, per layer, per expert biases; channel `1 + d` carries domain d.
    domain_bias: Vec<Vec<Vec<f32>>>,
    vocab: usize,
    /// [`write_synthetic_quantized_pooled`]: rows quantized per expert tensor, the rest copies.
    expert_row_pool: Option<usize>,
}

/// Bytes of pooled rows gathered before one write.
const POOL_WRITE_BYTES: usize = 64 << 20;

impl WeightGenerator {
    fn new(config: &ModelConfig, opts: &SynthOptions) -> WeightGenerator {
        let skew_exponent = opts.skew.exponent(config.n_experts, config.n_experts_used);
        let router_bias = (0..config.n_layers)
            .map(|layer_idx| match skew_exponent {
                None => vec![0.0; config.n_experts],
                Some(s) => expert_biases(opts.seed, layer_idx, config.n_experts, s),
            })
            .collect();
        let domain_bias = match (opts.skew, skew_exponent) {
            (Skew::Domains(_) | Skew::Locality(_), Some(s)) => (0..opts.skew.n_domains())
                .map(|domain| {
                    (0..config.n_layers)
                        .map(|layer_idx| {
                            let layer_key = (domain + 1) * 0x1_0000 + layer_idx;
                            expert_biases(opts.seed, layer_key, config.n_experts, s)
                        })
                        .collect()
                })
                .collect(),
            _ => Vec::new(),
        };
        WeightGenerator {
            seed: opts.seed,
            model_dtype: opts.dtype,
            hidden: config.hidden,
            skew_exponent,
            router_bias,
            domain_bias,
            vocab: config.vocab,
            expert_row_pool: None,
        }
    }

    fn write_tensor(&self, t: &PlannedTensor, out: &mut dyn Write) -> std::io::Result<()> {
        if t.layout != Layout::Rows {
            return self.write_transposed(t, out);
        }
        if let Some(pool_rows) = self.expert_row_pool.filter(|_| pools(t)) {
            return self.write_pooled(t, pool_rows, out);
        }
        let mut buffers = thread_buffers();
        for part in &t.parts {
            self.write_part_rows(part, t.dtype, 0..part.disk_rows(), &mut buffers, out)?;
        }
        Ok(())
    }

    /// Disk rows `rows` of `part` stored as `dtype`, into `out` in order.
    fn write_part_rows(
        &self,
        part: &Canonical,
        dtype: DType,
        rows: std::ops::Range<usize>,
        buffers: &mut [Vec<u8>],
        out: &mut dyn Write,
    ) -> std::io::Result<()> {
        // Rows per thread and batch: about 1 Mi values, whatever the row length.
        let batch = ((1 << 20) / part.n_cols.max(1) + 1) * buffers.len();
        for first in rows.clone().step_by(batch) {
            let last = (first + batch).min(rows.end);
            self.encode_rows(part, dtype, first..last, buffers)?;
            for b in buffers.iter() {
                out.write_all(b)?;
            }
        }
        Ok(())
    }

    /// [`write_synthetic_quantized_pooled`]'s expert tensor: the tensor's first `pool_rows` disk
    /// rows (over its parts in order) generated and quantized, each later row a copy of one of
    /// them drawn by the part's seed.
    fn write_pooled(&self, t: &PlannedTensor, pool_rows: usize, out: &mut dyn Write) -> std::io::Result<()> {
        let (mut buffers, mut pool, mut gathered) = (thread_buffers(), Vec::new(), Vec::new());
        let mut n_pool = 0;
        for part in &t.parts {
            let own = pool_rows.saturating_sub(n_pool).min(part.disk_rows());
            let start = pool.len();
            self.write_part_rows(part, t.dtype, 0..own, &mut buffers, &mut pool)?;
            out.write_all(&pool[start..])?;
            n_pool += own;
            if own == part.disk_rows() {
                continue;
            }
            let row_bytes = pool.len() / n_pool;
            let mut rng = SplitMix::new(self.seed ^ hash_str(&part.key) ^ 0x706f_6f6c);
            for _ in own..part.disk_rows() {
                let i = (rng.next_u64() % n_pool as u64) as usize;
                gathered.extend_from_slice(&pool[i * row_bytes..(i + 1) * row_bytes]);
                if gathered.len() >= POOL_WRITE_BYTES {
                    out.write_all(&gathered)?;
                    gathered.clear();
                }
            }
            out.write_all(&gathered)?;
            gathered.clear();
        }
        Ok(())
    }

    /// Disk rows `rows` of `part` stored as `dtype` into `buffers`, one contiguous share of the
    /// rows per buffer, each share on its own thread when there is enough work.
    fn encode_rows(
        &self,
        part: &Canonical,
        dtype: DType,
        rows: std::ops::Range<usize>,
        buffers: &mut [Vec<u8>],
    ) -> std::io::Result<()> {
        let encode = |lo: usize, hi: usize, bytes: &mut Vec<u8>| -> std::io::Result<()> {
            let (mut values, mut row_values) = (Vec::new(), Vec::new());
            for row in lo..hi {
                row_values.clear();
                self.push_row(part, disk_row_to_canonical(part, row), &mut row_values);
                stored_row(part, &row_values, &mut values);
            }
            bytes.clear();
            if dtype.is_float() {
                encode_f32(dtype, &values, bytes);
            } else {
                crate::format::quant::quantize(dtype, &values, bytes).map_err(std::io::Error::other)?;
            }
            Ok(())
        };
        let share = rows.len().div_ceil(buffers.len());
        if rows.len() * part.n_cols < PARALLEL_MIN_VALUES {
            buffers.iter_mut().for_each(Vec::clear);
            return encode(rows.start, rows.end, &mut buffers[0]);
        }
        std::thread::scope(|s| {
            let handles: Vec<_> = buffers
                .iter_mut()
                .enumerate()
                .map(|(i, b)| {
                    let lo = (rows.start + i * share).min(rows.end);
                    let hi = (lo + share).min(rows.end);
                    s.spawn(move || encode(lo, hi, b))
                })
                .collect();
            handles.into_iter().try_for_each(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
        })
    }

    /// [`Layout::Columns`] and [`Layout::InterleavedColumns`]: each part (or gate/up pair)
    /// generated whole (its disk rows: a [`RowMap::Pick`] of the canonical rows, as a latent
    /// attention's `k_b` takes one head's key rows of `kv_b_proj`), then written column by column;
    /// a quantized type encodes the transposed part whole (its rows, the part's disk rows long).
    fn write_transposed(&self, t: &PlannedTensor, out: &mut dyn Write) -> std::io::Result<()> {
        let group = if t.layout == Layout::InterleavedColumns { 2 } else { 1 };
        let (mut bytes, mut cols) = (Vec::new(), Vec::new());
        for parts in t.parts.chunks(group) {
            let whole: Vec<Vec<f32>> = parts
                .iter()
                .map(|p| {
                    let mut v = Vec::with_capacity(p.disk_rows() * p.n_cols);
                    (0..p.disk_rows()).for_each(|r| self.push_row(p, disk_row_to_canonical(p, r), &mut v));
                    v
                })
                .collect();
            let (rows, n_cols) = (parts[0].disk_rows(), parts[0].n_cols);
            cols.clear();
            for c in 0..n_cols {
                for r in 0..rows {
                    cols.extend(whole.iter().map(|m| m[r * n_cols + c]));
                }
            }
            bytes.clear();
            if t.dtype.is_float() {
                encode_f32(t.dtype, &cols, &mut bytes);
            } else {
                crate::format::quant::quantize(t.dtype, &cols, &mut bytes).map_err(std::io::Error::other)?;
            }
            out.write_all(&bytes)?;
        }
        Ok(())
    }

    /// Append canonical row `row` of `part`, rounded to the model dtype.
    fn push_row(&self, part: &Canonical, row: usize, values: &mut Vec<f32>) {
        let mut rng =
            SplitMix::new(self.seed ^ hash_str(&part.key) ^ (row as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let start = values.len();
        let skewed = self.skew_exponent.is_some();
        if let Init::RopeFreqs(turning) = part.init {
            values.extend((0..part.n_cols).map(|i| if i < turning { 1.0 } else { 1e30 }));
            return;
        }
        match part.init {
            Init::RopeFreqs(_) => unreachable!("written above"),
            Init::NormWeight => values.extend((0..part.n_cols).map(|_| 1.0 + 0.1 * rng.uniform_pm1())),
            Init::CentredNormWeight => values.extend((0..part.n_cols).map(|_| 0.1 * rng.uniform_pm1())),
            Init::Uniform(std) | Init::ResidualWriter(std) | Init::Router(std) => {
                let a = std * 3f32.sqrt();
                values.extend((0..part.n_cols).map(|_| a * rng.uniform_pm1()))
            }
            Init::Embedding => values.extend((0..part.n_cols).map(|_| 3f32.sqrt() * rng.uniform_pm1())),
        }
        if !self.domain_bias.is_empty() {
            self.domain_channels(part, row, &mut values[start..]);
        } else if skewed {
            let row_values = &mut values[start..];
            match part.init {
                Init::Embedding => row_values[0] = (self.hidden as f32).sqrt(),
                Init::ResidualWriter(_) if row == 0 => row_values.iter_mut().for_each(|v| *v = 0.0),
                Init::Router(std) => row_values[0] = std * self.router_bias[part.layer_idx][row],
                _ => {}
            }
        }
        for v in &mut values[start..] {
            *v = round_to(self.model_dtype, *v);
        }
    }
}

impl WeightGenerator {
    /// `Domains(D)`: channels `1..=D` carry the domain instead of channel 0 carrying one bias.
    /// A token of domain d has `sqrt(hidden)` on channel `1 + d` and 0 on the other domain
    /// channels; no residual writer writes those channels; router column `1 + d` holds domain
    /// d's expert biases. Each value still depends only on (seed, name, row).
    fn domain_channels(&self, part: &Canonical, row: usize, row_values: &mut [f32]) {
        let d = self.domain_bias.len();
        match part.init {
            Init::Embedding => {
                let domain = domain_of_token(row as u32, self.vocab, d);
                for j in 0..d {
                    row_values[1 + j] = if j == domain { (self.hidden as f32).sqrt() } else { 0.0 };
                }
            }
            Init::ResidualWriter(_) if (1..=d).contains(&row) => row_values.iter_mut().for_each(|v| *v = 0.0),
            Init::Router(std) => {
                for j in 0..d {
                    row_values[1 + j] = std * self.domain_bias[j][part.layer_idx][row];
                }
            }
            _ => {}
        }
    }
}

/// Map an on-disk row to the canonical row (identity unless the rows are RoPE-permuted).
fn disk_row_to_canonical(part: &Canonical, disk_row: usize) -> usize {
    match &part.rows {
        RowMap::Same => disk_row,
        RowMap::Pick(rows) => rows[disk_row],
        &RowMap::RopeInterleaved(head_dim) => {
            let head = disk_row / head_dim;
            let local = disk_row % head_dim;
            let half = head_dim / 2;
            let canonical_local = if local.is_multiple_of(2) { local / 2 } else { half + local / 2 };
            head * head_dim + canonical_local
        }
    }
}

/// Append the disk form of one canonical row: its columns as the disk keeps them, each value
/// mapped.
fn stored_row(part: &Canonical, canonical: &[f32], out: &mut Vec<f32>) {
    let map = |v: f32| match part.value {
        ValueMap::Same => v,
        ValueMap::PlusOne => 1.0 + v,
        ValueMap::NegExp => -v.exp(),
    };
    match &part.cols {
        None => out.extend(canonical.iter().map(|&v| map(v))),
        Some(cols) => out.extend(cols.iter().map(|&c| map(canonical[c]))),
    }
}

fn round_to(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::BF16 => bf16::from_f32(v).to_f32(),
        DType::F16 => f16::from_f32(v).to_f32(),
        _ => v,
    }
}

/// Per-expert logit biases for one layer: a random ranking, `-s * ln(1 + rank)`.
pub fn expert_biases(seed: u64, layer_idx: usize, n_experts: usize, exponent: f32) -> Vec<f32> {
    let mut order: Vec<usize> = (0..n_experts).collect();
    let mut rng = SplitMix::new(seed ^ 0xB1A5_u64.wrapping_mul(layer_idx as u64 + 1));
    for i in (1..n_experts).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    let mut bias = vec![0.0; n_experts];
    for (rank, &expert_idx) in order.iter().enumerate() {
        bias[expert_idx] = -exponent * (1.0 + rank as f32).ln();
    }
    bias
}

/// SplitMix64: tiny, fast, and stable across versions (a crate's RNG stream may change between
/// releases, which would silently change every synthetic model).
struct SplitMix(u64);

impl SplitMix {
    fn new(seed: u64) -> SplitMix {
        SplitMix(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Standard normal (Box-Muller).
    fn gaussian(&mut self) -> f32 {
        let u1 = ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let u2 = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }

    /// Uniform in [-1, 1).
    fn uniform_pm1(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// FNV-1a, for seeding from names.
fn hash_str(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// How each per-layer role is initialised.
fn layer_init(c: &ModelConfig, role: LayerRole) -> Init {
    let inv_sqrt = |n: usize| 1.0 / (n as f32).sqrt();
    match role {
        LayerRole::AttnNorm | LayerRole::FfnNorm | LayerRole::QNorm | LayerRole::KNorm => norm_init(c),
        LayerRole::Q | LayerRole::K | LayerRole::V => Init::Uniform(inv_sqrt(c.hidden)),
        LayerRole::QBias | LayerRole::KBias | LayerRole::VBias => Init::Uniform(0.1),
        // A column ([hidden, 1], see `layer_parts`): its row 0 is the skew's bias channel.
        LayerRole::OBias => Init::ResidualWriter(0.1),
        LayerRole::RouterBias => Init::Uniform(0.1),
        LayerRole::Sinks => Init::Uniform(0.5),
        LayerRole::O => Init::ResidualWriter(0.5 * inv_sqrt(c.q_dim())),
        // Router logits with unit noise: rows of std sqrt(2 / hidden) against normed hidden states
        // whose non-bias channels hold about half the energy.
        LayerRole::Router => Init::Router((2.0 / c.hidden as f32).sqrt()),
        LayerRole::SharedGate | LayerRole::SharedUp => Init::Uniform(inv_sqrt(c.hidden)),
        LayerRole::SharedDown => Init::ResidualWriter(0.5 * inv_sqrt(c.shared_expert_ff)),
        LayerRole::SharedExpertGate => Init::Uniform(inv_sqrt(c.hidden)),
        LayerRole::RouterSelectionBias => Init::Uniform(0.1),
        LayerRole::MlaQANorm | LayerRole::MlaKvANorm => norm_init(c),
        LayerRole::MlaQA | LayerRole::MlaKvA => Init::Uniform(inv_sqrt(c.hidden)),
        LayerRole::MlaQB => Init::Uniform(inv_sqrt(c.mla.and_then(|m| m.q_lora_rank).unwrap_or(c.hidden))),
        LayerRole::MlaKvB | LayerRole::MlaKB | LayerRole::MlaVB => {
            Init::Uniform(inv_sqrt(c.mla.map_or(c.hidden, |m| m.kv_lora_rank)))
        }
        LayerRole::DenseGate | LayerRole::DenseUp => Init::Uniform(inv_sqrt(c.hidden)),
        LayerRole::DenseDown => {
            Init::ResidualWriter(0.5 * inv_sqrt(c.dense_layers.map_or(c.expert_ff, |d| d.ff)))
        }
        LayerRole::DeltaQkvz
        | LayerRole::DeltaBa
        | LayerRole::DeltaQkv
        | LayerRole::DeltaZ
        | LayerRole::DeltaB
        | LayerRole::DeltaA => Init::Uniform(inv_sqrt(c.hidden)),
        LayerRole::DeltaConv => Init::Uniform(0.5),
        // dt_bias and A_log around zero: decays exp(-exp(A_log) * softplus(a + dt_bias)) near 1/2.
        LayerRole::DeltaDtBias | LayerRole::DeltaALog => Init::Uniform(0.5),
        LayerRole::DeltaNorm => Init::NormWeight,
        LayerRole::PostAttnNorm
        | LayerRole::PostFfnNorm
        | LayerRole::SharedPostNorm
        | LayerRole::ExpertsNorm
        | LayerRole::ExpertsPostNorm
        | LayerRole::RouterInputScale
        | LayerRole::RouterExpertScale
        | LayerRole::LayerScalar => norm_init(c),
        LayerRole::DeltaOut => {
            let value_dim = c.hybrid.as_ref().map_or(c.hidden, |h| h.n_v_heads * h.v_head_dim);
            Init::ResidualWriter(0.5 * inv_sqrt(value_dim))
        }
    }
}

/// RMSNorm weights as the checkpoint stores them (zero-centred or not).
fn norm_init(c: &ModelConfig) -> Init {
    if c.zero_centred_norms {
        Init::CentredNormWeight
    } else {
        Init::NormWeight
    }
}

fn expert_init(c: &ModelConfig, proj: ExpertProj) -> Init {
    match proj {
        ExpertProj::Gate | ExpertProj::Up => Init::Uniform(1.0 / (c.hidden as f32).sqrt()),
        ExpertProj::Down => Init::ResidualWriter(0.5 / (c.expert_ff as f32).sqrt()),
    }
}

fn canonical_2d(key: String, shape: &[usize], init: Init, layer_idx: usize) -> Canonical {
    let (n_rows, n_cols) = match shape {
        [n] => (1, *n),
        [r, c] => (*r, *c),
        _ => unreachable!("canonical tensors are 1-D or 2-D"),
    };
    Canonical { key, n_rows, n_cols, init, rows: RowMap::Same, cols: None, value: ValueMap::Same, layer_idx }
}

fn global_parts(c: &ModelConfig, a: &Adapter) -> Vec<(GlobalRole, Canonical)> {
    let mut parts = vec![(
        GlobalRole::TokenEmbedding,
        canonical_2d(
            naming::hf_global(GlobalRole::TokenEmbedding).into(),
            &[c.vocab, c.hidden],
            Init::Embedding,
            0,
        ),
    )];
    parts.push((
        GlobalRole::OutputNorm,
        canonical_2d(naming::hf_global(GlobalRole::OutputNorm).into(), &[c.hidden], norm_init(c), 0),
    ));
    if !c.tied_embeddings {
        let init = Init::Uniform(1.0 / (c.hidden as f32).sqrt());
        parts.push((
            GlobalRole::Output,
            canonical_2d(naming::hf_global(GlobalRole::Output).into(), &[c.vocab, c.hidden], init, 0),
        ));
    }
    let _ = a;
    parts
}

fn layer_parts(c: &ModelConfig, a: &Adapter, layer_idx: usize) -> Vec<(LayerRole, Canonical)> {
    let spec = (a.layer)(c, layer_idx);
    let mut roles = required_layer_roles(&spec);
    // A latent layer's fused `kv_b` as transformers stores it (GGUF: `attn_kv_b`, split at open).
    if matches!(spec.mixer, crate::model::arch::Mixer::LatentAttention(_)) {
        roles.push(LayerRole::MlaKvB);
    }
    roles
        .into_iter()
        .map(|role| {
            let shape = expected_layer_shape(c, &spec, role);
            let key = naming::hf_layer(a.hf_naming, layer_idx, role);
            let shape2: Vec<usize> = match shape[..] {
                [1, n] => vec![n],
                // The o bias writes the residual like o: a column, so a skew's channels stay clear.
                [n] if role == LayerRole::OBias => vec![n, 1],
                _ => shape,
            };
            (role, canonical_2d(key, &shape2, layer_init(c, role), layer_idx))
        })
        .collect()
}

fn expert_part(
    c: &ModelConfig,
    a: &Adapter,
    layer_idx: usize,
    expert_idx: usize,
    proj: ExpertProj,
) -> Canonical {
    let shape = if proj == ExpertProj::Down { [c.hidden, c.expert_ff] } else { [c.expert_ff, c.hidden] };
    canonical_2d(
        naming::hf_expert(a.hf_naming, layer_idx, expert_idx, proj),
        &shape,
        expert_init(c, proj),
        layer_idx,
    )
}

fn hf_tensor_plan(c: &ModelConfig, opts: &SynthOptions) -> Vec<PlannedTensor> {
    let a = opts.adapter;
    // A published multimodal checkpoint (Qwen3.5) keeps the language model under
    // `model.language_model.` and its experts fused, as transformers reads it.
    let nested = a.hybrid.hf_text_model_type.is_some();
    let name = |key: &str| match key.strip_prefix("model.") {
        Some(rest) if nested => format!("model.language_model.{rest}"),
        _ => key.to_string(),
    };
    let mut plan = Vec::new();
    let mut fused = Vec::new();
    // The parts keep their per-expert keys (they seed the values), so a fused file holds the
    // same experts as a per-expert one.
    let mut push = |key: &str, parts: Vec<Canonical>, shape: Vec<usize>| {
        plan.push(PlannedTensor { name: name(key), dtype: opts.dtype, shape, parts, layout: Layout::Rows });
    };
    for (_, part) in global_parts(c, a) {
        let shape = if part.n_rows == 1 && part.key.ends_with("norm.weight") {
            vec![part.n_cols]
        } else {
            vec![part.n_rows, part.n_cols]
        };
        push(&part.key.clone(), vec![part], shape);
    }
    for layer_idx in 0..c.n_layers {
        let spec = (a.layer)(c, layer_idx);
        for (role, part) in layer_parts(c, a, layer_idx) {
            let mut shape = expected_layer_shape(c, &spec, role);
            if role == LayerRole::DeltaConv {
                shape.insert(1, 1); // transformers' Conv1d weight: [channels, 1, width]
            }
            push(&part.key.clone(), vec![part], shape);
        }
        if !spec.has_experts() {
            continue;
        }
        if a.hf_naming == HfNaming::GptOss {
            gpt_oss_hf_experts(c, a, layer_idx, opts.dtype, &mut fused);
            continue;
        }
        if nested {
            let gate_up = (0..c.n_experts)
                .flat_map(|e| [ExpertProj::Gate, ExpertProj::Up].map(|p| expert_part(c, a, layer_idx, e, p)))
                .collect();
            push(
                &naming::hf_fused_experts_of(a.hf_naming, layer_idx, false),
                gate_up,
                vec![c.n_experts, 2 * c.expert_ff, c.hidden],
            );
            let down = (0..c.n_experts).map(|e| expert_part(c, a, layer_idx, e, ExpertProj::Down)).collect();
            let down_name = naming::hf_fused_experts_of(a.hf_naming, layer_idx, true);
            push(&down_name, down, vec![c.n_experts, c.hidden, c.expert_ff]);
            continue;
        }
        for expert_idx in 0..c.n_experts {
            for proj in ExpertProj::ALL {
                let part = expert_part(c, a, layer_idx, expert_idx, proj);
                let shape = vec![part.n_rows, part.n_cols];
                push(&part.key.clone(), vec![part], shape);
            }
        }
    }
    plan.extend(fused);
    plan
}

/// One expert bias as a canonical column (`[rows, 1]`, so a skew's channel rows stay clear in
/// the down bias as in the down projection).
fn expert_bias_part(c: &ModelConfig, a: &Adapter, layer_idx: usize, e: usize, proj: ExpertProj) -> Canonical {
    let key = naming::hf_expert(a.hf_naming, layer_idx, e, proj).replace(".weight", ".bias");
    let (rows, init) = match proj {
        ExpertProj::Down => (c.hidden, Init::ResidualWriter(0.1)),
        ExpertProj::Gate | ExpertProj::Up => (c.expert_ff, Init::Uniform(0.1)),
    };
    canonical_2d(key, &[rows, 1], init, layer_idx)
}

/// GPT-OSS's fused, input-major experts as transformers saves them: `gate_up_proj`
/// `[E, hidden, 2 ff]` (gate and up interleaved), `down_proj` `[E, ff, hidden]`, and their biases.
fn gpt_oss_hf_experts(c: &ModelConfig, a: &Adapter, l: usize, dtype: DType, plan: &mut Vec<PlannedTensor>) {
    let (e_n, h, ff) = (c.n_experts, c.hidden, c.expert_ff);
    let pairs = |f: &dyn Fn(usize, ExpertProj) -> Canonical| -> Vec<Canonical> {
        (0..e_n).flat_map(|e| [f(e, ExpertProj::Gate), f(e, ExpertProj::Up)]).collect()
    };
    let downs = |f: &dyn Fn(usize, ExpertProj) -> Canonical| -> Vec<Canonical> {
        (0..e_n).map(|e| f(e, ExpertProj::Down)).collect()
    };
    let weight = |e, p| expert_part(c, a, l, e, p);
    let bias = |e, p| expert_bias_part(c, a, l, e, p);
    let mut push = |name: String, shape: Vec<usize>, parts, layout| {
        plan.push(PlannedTensor { name, dtype, shape, parts, layout });
    };
    push(
        naming::hf_fused_experts(l, false),
        vec![e_n, h, 2 * ff],
        pairs(&weight),
        Layout::InterleavedColumns,
    );
    push(naming::hf_fused_expert_bias(l, false), vec![e_n, 2 * ff], pairs(&bias), Layout::InterleavedColumns);
    push(naming::hf_fused_experts(l, true), vec![e_n, ff, h], downs(&weight), Layout::Columns);
    push(naming::hf_fused_expert_bias(l, true), vec![e_n, h], downs(&bias), Layout::Columns);
}

fn gguf_tensor_plan(c: &ModelConfig, opts: &SynthOptions) -> Vec<PlannedTensor> {
    let a = opts.adapter;
    // llama.cpp's converter permutes q/k rows where its GGUF RoPE pairs differ from the HF ones,
    // and stores zero-centred norms as the scale `1 + w`.
    let permute = a.gguf_rope_style != a.rope_style;
    let plus_one = |part: &mut Canonical, centred: bool| {
        if c.zero_centred_norms && centred {
            part.value = ValueMap::PlusOne;
        }
    };
    let mut plan = Vec::new();
    for (role, mut part) in global_parts(c, a) {
        plus_one(&mut part, role == GlobalRole::OutputNorm);
        let dtype = if role == GlobalRole::OutputNorm { DType::F32 } else { opts.dtype };
        let shape =
            if role == GlobalRole::OutputNorm { vec![part.n_cols] } else { vec![part.n_rows, part.n_cols] };
        let layout = Layout::Rows;
        plan.push(PlannedTensor {
            name: naming::gguf_global(role).into(),
            dtype,
            shape,
            parts: vec![part],
            layout,
        });
    }
    let gemma4 = a.hf_naming == HfNaming::Gemma4;
    plan.extend(gguf_gemma4::rope_freqs(c).filter(|_| gemma4));
    for layer_idx in 0..c.n_layers {
        let delta = gguf_hybrid::delta_parts(c, a, layer_idx);
        let mut tensors: Vec<(LayerRole, Vec<Canonical>)> = Vec::new();
        for (role, mut part) in layer_parts(c, a, layer_idx) {
            if delta.is_some() && role.is_delta_net() {
                continue;
            }
            if role == LayerRole::MlaKvB {
                plan.extend(mla_split(c, a, layer_idx, &part, opts.dtype));
                continue;
            }
            if permute && matches!(role, LayerRole::Q | LayerRole::K) {
                part.rows = RowMap::RopeInterleaved(c.head_dim);
            }
            plus_one(&mut part, role.is_centred_norm());
            tensors.push((role, vec![part]));
        }
        tensors.extend(delta.into_iter().flatten());
        let has_experts = (a.layer)(c, layer_idx).has_experts();
        if gemma4 && has_experts {
            plan.extend(gguf_gemma4::experts(c, opts, layer_idx));
        }
        let has_experts = has_experts && !gemma4;
        for (role, parts) in tensors {
            let (rows, cols) = (parts.iter().map(Canonical::disk_rows).sum::<usize>(), parts[0].disk_cols());
            let one_d = rows == 1 || cols == 1;
            // Routers and DeltaNet convs stay f32, as llama.cpp's converter keeps them.
            let f32_role = one_d || matches!(role, LayerRole::Router | LayerRole::DeltaConv);
            let dtype = if f32_role { DType::F32 } else { opts.dtype };
            let shape = if one_d { vec![rows * cols] } else { vec![rows, cols] };
            let name = naming::gguf_layer(a, layer_idx, role);
            plan.push(PlannedTensor { name, dtype, shape, parts, layout: Layout::Rows });
        }
        for proj in ExpertProj::ALL.into_iter().filter(|_| has_experts) {
            let parts: Vec<Canonical> =
                (0..c.n_experts).map(|e| expert_part(c, a, layer_idx, e, proj)).collect();
            let shape = vec![c.n_experts, parts[0].n_rows, parts[0].n_cols];
            plan.push(PlannedTensor {
                name: naming::gguf_experts(layer_idx, proj),
                dtype: opts.dtype,
                shape,
                parts,
                layout: Layout::Rows,
            });
        }
        if (a.layer)(c, layer_idx).as_moe().is_some_and(|m| m.expert_bias) {
            for proj in ExpertProj::ALL {
                let parts: Vec<Canonical> =
                    (0..c.n_experts).map(|e| expert_bias_part(c, a, layer_idx, e, proj)).collect();
                let shape = vec![c.n_experts, parts[0].n_rows];
                let name = naming::gguf_expert_bias(layer_idx, proj);
                plan.push(PlannedTensor { name, dtype: DType::F32, shape, parts, layout: Layout::Rows });
            }
        }
    }
    plan.extend(gguf_hybrid::mtp_tensors(c, opts));
    plan
}

/// A latent attention layer's `kv_b_proj` as llama.cpp's converter writes it: `attn_k_b`
/// `[heads, kv_lora_rank, nope]` (each head's key rows transposed) and `attn_v_b` `[heads, v,
/// kv_lora_rank]` (each head's value rows), both drawn from the canonical `kv_b` rows.
fn mla_split(
    c: &ModelConfig,
    a: &Adapter,
    layer_idx: usize,
    kv_b: &Canonical,
    dtype: DType,
) -> [PlannedTensor; 2] {
    let crate::model::arch::Mixer::LatentAttention(m) = (a.layer)(c, layer_idx).mixer else {
        unreachable!("kv_b belongs to a latent attention layer")
    };
    let (k_shape, v_shape) = crate::model::mla::split_shapes(&m);
    let head_rows = |h: usize, key: bool| -> Arc<[usize]> {
        let first = h * (m.nope_dim + m.v_dim) + if key { 0 } else { m.nope_dim };
        (first..first + if key { m.nope_dim } else { m.v_dim }).collect()
    };
    let pick = |rows: Arc<[usize]>| Canonical { rows: RowMap::Pick(rows), ..kv_b.clone() };
    let k_parts = (0..m.n_heads).map(|h| pick(head_rows(h, true))).collect();
    let v_rows: Vec<usize> = (0..m.n_heads).flat_map(|h| head_rows(h, false).to_vec()).collect();
    [
        PlannedTensor {
            name: naming::gguf_layer(a, layer_idx, LayerRole::MlaKB),
            dtype,
            shape: k_shape.to_vec(),
            parts: k_parts,
            layout: Layout::Columns,
        },
        PlannedTensor {
            name: naming::gguf_layer(a, layer_idx, LayerRole::MlaVB),
            dtype,
            shape: v_shape.to_vec(),
            parts: vec![pick(v_rows.into())],
            layout: Layout::Rows,
        },
    ]
}

/// Reject output paths that cannot be written before any work starts (the rule of
/// [`crate::output`]; `--vocab-from` is an input).
pub fn check_output_path(path: &Path, force: bool, inputs: &[&Path]) -> Result<(), SynthError> {
    Ok(check_output(path, force, inputs, OutputKind::FileOrDir)?)
}

/// Never replace something that is not a regular file or a directory (a device node, a FIFO,
/// a socket): the atomic rename would put a regular file in its place.
fn refuse_special(path: &Path) -> Result<(), SynthError> {
    // `force`: whether to replace an existing file was decided by the caller's check.
    Ok(check_output(path, true, &[], OutputKind::FileOrDir)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skew_parses() {
        assert_eq!("uniform".parse::<Skew>().unwrap(), Skew::Uniform);
        assert_eq!("zipf:1.5".parse::<Skew>().unwrap(), Skew::Zipf(1.5));
        assert!("zipf:-1".parse::<Skew>().is_err());
        assert!("zipf".parse::<Skew>().is_err());
    }

    #[test]
    fn rope_permutation_is_a_bijection_within_heads() {
        let part = Canonical {
            key: "q".into(),
            n_rows: 16,
            n_cols: 1,
            init: Init::NormWeight,
            rows: RowMap::RopeInterleaved(8),
            cols: None,
            value: ValueMap::Same,
            layer_idx: 0,
        };
        let mapped: Vec<usize> = (0..16).map(|r| disk_row_to_canonical(&part, r)).collect();
        assert_eq!(&mapped[..8], &[0, 4, 1, 5, 2, 6, 3, 7]);
        let mut sorted = mapped.clone();
        sorted.sort();
        assert_eq!(sorted, (0..16).collect::<Vec<_>>());
    }

    /// `synth --preset glm-4.5-air --quant q4_k_m` types the tensors as llama.cpp's Q4_K_M of
    /// GLM-4.5-Air: rows of 1408 (expert down projections) and 10944 (the dense layer's down
    /// projection) are not whole 256-value super-blocks, so Q4_K falls back to Q5_0 and Q6_K to
    /// Q8_0; rows of 4096 keep Q4_K.
    #[test]
    fn glm_4_5_air_q4_k_m_falls_back_to_q5_0_like_llama_cpp() {
        let adapter = crate::model::arch::by_name("glm4_moe").unwrap();
        let opts = SynthOptions {
            adapter,
            preset: Preset::Glm45Air,
            dims: DimOverrides::default(),
            dtype: DType::BF16,
            seed: 0,
            skew: Skew::Skewed,
            format: SynthFormat::Gguf,
            out: PathBuf::from("unused.gguf"),
            vocab_from: None,
        };
        let config = synth_config(adapter, Preset::Glm45Air, &opts.dims).unwrap();
        let mut tensors = gguf_tensor_plan(&config, &opts);
        apply_quant_mix(&config, &mut tensors, QuantMix::Q4_K_M);
        let t = |name: &str| {
            let t = tensors.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("{name}"));
            (t.shape.last().copied().unwrap(), t.dtype)
        };
        // Layer 0 is dense (FFN 10944) and a use_more_bits layer: its Q6_K down falls back to Q8_0.
        assert_eq!(t("blk.0.ffn_up.weight"), (4096, DType::Q4_K));
        assert_eq!(t("blk.0.ffn_down.weight"), (10944, DType::Q8_0));
        // Layer 9 is not a use_more_bits layer: Q4_K experts' down rows of 1408 take Q5_0.
        assert!(!crate::quantize::use_more_bits(9, config.n_layers + config.mtp_layers));
        assert_eq!(t("blk.9.ffn_down_exps.weight"), (1408, DType::Q5_0));
        assert_eq!(t("blk.9.ffn_up_exps.weight"), (4096, DType::Q4_K));
        assert_eq!(t("blk.9.ffn_down_shexp.weight"), (1408, DType::Q5_0));
        assert!(crate::quantize::use_more_bits(13, config.n_layers + config.mtp_layers));
        assert_eq!(t("blk.13.ffn_down_exps.weight"), (1408, DType::Q8_0));
    }

    #[test]
    fn biases_are_a_permuted_ranking() {
        let b = expert_biases(7, 0, 8, 1.0);
        let mut sorted = b.clone();
        sorted.sort_by(|x, y| y.partial_cmp(x).unwrap());
        assert_eq!(sorted[0], 0.0);
        assert!((sorted[7] + 8f32.ln()).abs() < 1e-6);
        assert_ne!(b, expert_biases(7, 1, 8, 1.0), "layers get different rankings");
    }
}
