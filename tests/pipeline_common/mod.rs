//! Helpers shared by the pipeline integration tests: tiny synthetic models and the comparison
//! against the reference oracle.
#![allow(dead_code)]

use moe_lanes::arch::ADAPTERS;
use moe_lanes::dtype::DType;
use moe_lanes::model::Model;
use moe_lanes::reference::{NoObserver, Reference};
use moe_lanes::synth::{self, DimOverrides, Preset, Skew, SynthFormat, SynthOptions};
use std::path::Path;
use std::sync::Arc;

/// Dimensions of a tiny random model.
#[derive(Debug, Clone)]
pub struct TinySpec {
    pub adapter_idx: usize,
    pub gguf: bool,
    pub seed: u64,
    pub n_layers: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub n_experts: usize,
    pub k: usize,
    pub expert_ff: usize,
    pub tied: bool,
    pub dtype: DType,
}

impl TinySpec {
    pub fn simple(adapter_idx: usize) -> TinySpec {
        TinySpec {
            adapter_idx,
            gguf: false,
            seed: 7,
            n_layers: 2,
            hidden: 32,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 8,
            n_experts: 8,
            k: 2,
            expert_ff: 16,
            tied: false,
            dtype: DType::BF16,
        }
    }
}

/// Write the model under `dir` and open it.
pub fn write_tiny(dir: &Path, spec: &TinySpec) -> Arc<Model> {
    let adapter = &ADAPTERS[spec.adapter_idx];
    let out = if spec.gguf { dir.join("m.gguf") } else { dir.join("m") };
    let opts = SynthOptions {
        adapter,
        preset: Preset::Tiny,
        dims: DimOverrides {
            n_layers: Some(spec.n_layers),
            hidden: Some(spec.hidden),
            n_heads: Some(spec.n_heads),
            n_kv_heads: Some(spec.n_kv_heads),
            head_dim: Some(spec.head_dim),
            vocab: Some(if spec.gguf { 300 } else { 97 }),
            n_experts: Some(spec.n_experts),
            n_experts_used: Some(spec.k),
            expert_ff: Some(spec.expert_ff),
            shared_expert_ff: if adapter.shared_expert { Some(24) } else { None },
            tied_embeddings: Some(spec.tied),
            mtp_layers: None,
            attention_bias: None,
            yarn_factor: None,
        },
        dtype: spec.dtype,
        seed: spec.seed,
        skew: Skew::Skewed,
        format: if spec.gguf { SynthFormat::Gguf } else { SynthFormat::Safetensors },
        out: out.clone(),
        vocab_from: None,
    };
    synth::write_synthetic(&opts, &mut |_, _| {}).expect("synth");
    Arc::new(Model::open(&out).expect("open"))
}

/// Reference logits of `tokens` run as the given chunks (prefill then decode steps).
pub fn reference_logits(model: &Model, chunks: &[&[u32]]) -> Vec<Vec<f32>> {
    let r = Reference::new(model).expect("reference");
    let mut cache = r.new_cache();
    let mut out = Vec::new();
    for c in chunks {
        out.extend(r.forward(&mut cache, c, &mut NoObserver).expect("reference forward"));
    }
    out
}

/// `max |a - b| / max |b|` over all rows.
pub fn rel_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len(), "row count");
    let mut max_diff = 0.0f32;
    let mut max_ref = 0.0f32;
    for (ra, rb) in a.iter().zip(b) {
        assert_eq!(ra.len(), rb.len());
        for (x, y) in ra.iter().zip(rb) {
            max_diff = max_diff.max((x - y).abs());
            max_ref = max_ref.max(y.abs());
        }
    }
    max_diff / max_ref.max(1e-30)
}

/// Deterministic token ids below `vocab`.
pub fn tokens(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        })
        .collect()
}
