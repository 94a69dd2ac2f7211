//! `inspect`: a model's architecture, dimensions, dtypes and byte sizes (one expert, all experts,
//! everything else), as text or JSON, plus an optional measured routing coverage.

use crate::model::{Model, ModelFormat};
use crate::reference::{ExpertCounts, ForwardError, Reference};
use serde::Serialize;
use std::collections::BTreeMap;

/// What `inspect` reports.
#[derive(Debug, Clone, Serialize)]
pub struct InspectReport {
    pub path: String,
    pub format: ModelFormat,
    pub arch: &'static str,
    pub gguf_arch: &'static str,
    pub n_layers: usize,
    pub n_experts: usize,
    pub n_experts_used: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub expert_ff: usize,
    pub shared_expert_ff: usize,
    pub vocab: usize,
    pub tied_embeddings: bool,
    pub norm_topk_prob: bool,
    pub rope_theta: f32,
    /// What each layer is, one line per run of equal layers (`LayerPlan::summary`).
    pub layer_kinds: Vec<String>,
    /// Multi-token-prediction layers after the last layer: loaded, not run.
    #[serde(skip_serializing_if = "is_zero")]
    pub mtp_layers: usize,
    pub expert_dtype: String,
    /// Tensor count per dtype.
    pub dtypes: BTreeMap<String, usize>,
    pub n_tensors: usize,
    /// gate + up + down of one expert.
    pub expert_bytes: u64,
    pub all_experts_bytes: u64,
    pub other_bytes: u64,
    pub total_bytes: u64,
    /// Share of routed slots that the most-used half of each layer's experts received, measured
    /// with the reference forward pass (only when asked for).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_half_coverage: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub coverage_tokens: Option<usize>,
}

impl InspectReport {
    pub fn new(model: &Model) -> InspectReport {
        let c = model.config();
        let a = model.adapter();
        let tensors = model.tensor_list();
        let mut dtypes = BTreeMap::new();
        for (_, dtype, _, _) in &tensors {
            *dtypes.entry(dtype.name().to_string()).or_insert(0) += 1;
        }
        let total_bytes: u64 = tensors.iter().map(|t| t.3 as u64).sum();
        let expert_bytes = model.expert_bytes() as u64;
        let all_experts_bytes = model.all_experts_bytes();
        InspectReport {
            path: model.path().display().to_string(),
            format: model.format(),
            arch: a.hf_model_type,
            gguf_arch: a.gguf_arch,
            n_layers: c.n_layers,
            n_experts: c.n_experts,
            n_experts_used: c.n_experts_used,
            hidden: c.hidden,
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            expert_ff: c.expert_ff,
            shared_expert_ff: c.shared_expert_ff,
            vocab: c.vocab,
            tied_embeddings: c.tied_embeddings,
            norm_topk_prob: c.norm_topk_prob,
            rope_theta: c.rope_theta,
            layer_kinds: model.plan().summary(),
            mtp_layers: c.mtp_layers,
            expert_dtype: model.expert_dtype().name().to_string(),
            dtypes,
            n_tensors: tensors.len(),
            expert_bytes,
            all_experts_bytes,
            other_bytes: total_bytes - all_experts_bytes,
            total_bytes,
            top_half_coverage: None,
            coverage_tokens: None,
        }
    }

    /// Measure routing coverage on `n_tokens` pseudo-random tokens with the reference pass.
    pub fn measure_coverage(&mut self, model: &Model, n_tokens: usize) -> Result<(), ForwardError> {
        let counts = measure_expert_counts(model, n_tokens)?;
        self.top_half_coverage = Some(counts.top_half_coverage());
        self.coverage_tokens = Some(n_tokens);
        Ok(())
    }

    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let mut line = |k: &str, v: String| s.push_str(&format!("{k:<18} {v}\n"));
        line("path", self.path.clone());
        line("format", format!("{:?}", self.format).to_lowercase());
        line("architecture", format!("{} (adapter {}, gguf arch {})", self.arch, self.arch, self.gguf_arch));
        line("layers", self.n_layers.to_string());
        for kinds in &self.layer_kinds {
            line("  layer kinds", kinds.clone());
        }
        if self.mtp_layers > 0 {
            line("  mtp layers", format!("{} (multi-token prediction: loaded, not run)", self.mtp_layers));
        }
        line("experts", format!("{} (top-{} used per token)", self.n_experts, self.n_experts_used));
        line("hidden", self.hidden.to_string());
        line(
            "attention",
            format!("{} q heads, {} kv heads, head dim {}", self.n_heads, self.n_kv_heads, self.head_dim),
        );
        line("expert ff", self.expert_ff.to_string());
        if self.shared_expert_ff > 0 {
            line("shared expert ff", self.shared_expert_ff.to_string());
        }
        line(
            "vocab",
            format!("{} ({})", self.vocab, if self.tied_embeddings { "tied embeddings" } else { "untied" }),
        );
        line("rope theta", self.rope_theta.to_string());
        line("expert dtype", self.expert_dtype.clone());
        let dtypes: Vec<String> = self.dtypes.iter().map(|(k, v)| format!("{k} x{v}")).collect();
        line("tensors", format!("{} ({})", self.n_tensors, dtypes.join(", ")));
        line("one expert", format_bytes(self.expert_bytes));
        line("all experts", format_bytes(self.all_experts_bytes));
        line("everything else", format_bytes(self.other_bytes));
        line("total", format_bytes(self.total_bytes));
        if let (Some(cov), Some(n)) = (self.top_half_coverage, self.coverage_tokens) {
            line(
                "routing coverage",
                format!("{:.1}% of slots to the top half of experts ({n} tokens)", cov * 100.0),
            );
        }
        s
    }
}

/// Route `n_tokens` deterministic pseudo-random tokens through the reference pass and count
/// expert usage per layer.
pub fn measure_expert_counts(model: &Model, n_tokens: usize) -> Result<ExpertCounts, ForwardError> {
    let c = model.config();
    let reference = Reference::new(model)?;
    let mut counts = ExpertCounts::new(c.n_layers, c.n_experts);
    let tokens = sample_tokens(c.vocab, n_tokens.min(c.max_positions));
    let mut cache = reference.new_cache();
    reference.forward_no_logits(&mut cache, &tokens, &mut counts)?;
    Ok(counts)
}

/// Deterministic "ordinary prompt" stand-in: token ids spread over the vocabulary.
pub fn sample_tokens(vocab: usize, n_tokens: usize) -> Vec<u32> {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    (0..n_tokens)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % vocab as u64) as u32
        })
        .collect()
}

/// `1.50 GiB (1610612736 bytes)`
pub fn format_bytes(n_bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    let mut value = n_bytes as f64;
    let mut unit = "B";
    for u in UNITS {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = u;
    }
    if unit == "B" {
        format!("{n_bytes} B")
    } else {
        format!("{value:.2} {unit} ({n_bytes} bytes)")
    }
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}
