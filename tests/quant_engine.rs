//! Quantised models end to end on the CPU: a tiny synthetic model quantised with every mix
//! (`synth --quant`, through the library) runs on the pipeline engine within 1e-4 (normwise
//! relative, per logits row) of the reference engine on the same file, and greedy generation is
//! identical on a few prompts. The pipeline's SIMD kernels and the oracle see the same
//! dequantised weights (the kernels keep activations in f32), so only the summation order
//! differs, as for float models. The GPU engine refuses a quantised model with a typed error, and
//! the default engine choice falls back to the pipeline and says why.

mod common;

use moe_lanes::dtype::DType;
use moe_lanes::engine::{build_engine, EngineError, EngineKind, EngineOptions, HotBudget, HotChoice};
use moe_lanes::model::Model;
use moe_lanes::phase::Phase;
use moe_lanes::quantize::QuantMix;
use moe_lanes::synth::{write_synthetic_quantized, DimOverrides, SynthFormat};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Normwise relative tolerance of pipeline logits against the reference on a quantised file.
const LOGITS_TOLERANCE: f64 = 1e-4;

/// Tiny dims widened so every matrix row is whole K-quant super-blocks (256 values).
fn quantized_tiny(dir: &Path, arch: &str, mix: QuantMix) -> PathBuf {
    let mut opts = common::synth_options(arch, SynthFormat::Gguf, dir.join(format!("{arch}-{mix}.gguf")), 5);
    opts.dims = DimOverrides {
        hidden: Some(256),
        head_dim: Some(64),
        expert_ff: Some(256),
        shared_expert_ff: (arch == "qwen2_moe").then_some(256),
        ..DimOverrides::default()
    };
    write_synthetic_quantized(&opts, mix, &mut |_, _| {}).unwrap();
    opts.out
}

fn options(kind: Option<EngineKind>) -> EngineOptions {
    let mut opts = EngineOptions::new(64);
    opts.kind = kind;
    opts.hot = HotChoice::Budget(HotBudget::Fraction(0.5));
    opts.cold_threads = moe_lanes::threads::ColdThreads::Fixed(2);
    opts
}

fn relative_error(actual: &[f32], reference: &[f32]) -> f64 {
    let diff: f64 = actual.iter().zip(reference).map(|(a, r)| ((a - r) as f64).powi(2)).sum();
    let norm: f64 = reference.iter().map(|r| (*r as f64).powi(2)).sum();
    (diff / norm.max(1e-30)).sqrt()
}

const PROMPTS: [&[u32]; 3] = [&[3, 17, 99, 5, 240], &[1, 2, 3], &[400, 12, 77, 300, 8, 9, 31]];

#[test]
fn every_mix_runs_on_the_pipeline_within_tolerance_of_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    for mix in QuantMix::ALL {
        let model = Arc::new(Model::open(&quantized_tiny(dir.path(), "qwen3_moe", mix)).unwrap());
        let types: Vec<DType> = model.tensor_list().iter().map(|t| t.1).collect();
        assert!(types.contains(&mix.default_type()), "{mix}: {types:?}");
        let (mut reference, _) = build_engine(&model, options(Some(EngineKind::Reference))).unwrap();
        let (mut pipeline, report) = build_engine(&model, options(Some(EngineKind::Pipeline))).unwrap();
        assert_eq!(report.kind, EngineKind::Pipeline);
        for prompt in PROMPTS {
            let mut rc = reference.new_cache(64).unwrap();
            let mut pc = pipeline.new_cache(64).unwrap();
            let want = reference.forward(prompt, Phase::Prefill, &mut rc).unwrap();
            let got = pipeline.forward(prompt, Phase::Prefill, &mut pc).unwrap();
            for (row, (g, w)) in got.rows().iter().zip(want.rows().iter()).enumerate() {
                let error = relative_error(g, w);
                assert!(error <= LOGITS_TOLERANCE, "{mix} row {row}: relative error {error:e}");
            }
            assert_eq!(
                pipeline.generate(prompt, 6).unwrap(),
                reference.generate(prompt, 6).unwrap(),
                "{mix}"
            );
        }
    }
}

#[test]
fn a_q4_k_m_file_mixes_block_types_like_llama_cpp() {
    let dir = tempfile::tempdir().unwrap();
    let model = Model::open(&quantized_tiny(dir.path(), "qwen2_moe", QuantMix::Q4_K_M)).unwrap();
    let dtype_of = |name: &str| model.tensor_list().into_iter().find(|t| t.0 == name).unwrap().1;
    assert_eq!(dtype_of("output.weight"), DType::Q6_K);
    // use_more_bits(l, 2) picks the last layer only (l >= 7 * 2 / 8).
    assert_eq!(dtype_of("blk.1.ffn_down_exps.weight"), DType::Q6_K);
    assert_eq!(dtype_of("blk.1.ffn_down_shexp.weight"), DType::Q6_K);
    assert_eq!(dtype_of("blk.0.ffn_down_exps.weight"), DType::Q4_K);
    assert_eq!(dtype_of("blk.0.ffn_gate_exps.weight"), DType::Q4_K);
    assert_eq!(dtype_of("blk.0.attn_v.weight"), DType::Q8_0, "8 experts");
    assert_eq!(dtype_of("blk.0.attn_output.weight"), DType::Q5_K, "8 experts");
    assert_eq!(dtype_of("blk.0.attn_norm.weight"), DType::F32);
    // The router keeps its float type, as llama.cpp never quantises it.
    assert!(dtype_of("blk.0.ffn_gate_inp.weight").is_float());
}

#[test]
fn the_gpu_engine_refuses_a_quantized_model_and_the_default_falls_back() {
    let dir = tempfile::tempdir().unwrap();
    let model = Arc::new(Model::open(&quantized_tiny(dir.path(), "qwen3_moe", QuantMix::Q8_0)).unwrap());
    let err = build_engine(&model, options(Some(EngineKind::Gpu))).err().expect("refused");
    match &err {
        EngineError::QuantizedOnGpu { tensor, dtype } => {
            assert!(!dtype.is_float() && !tensor.is_empty(), "{err}");
            assert!(err.to_string().contains(tensor.as_str()) && err.to_string().contains("Q8_0"), "{err}");
        }
        other => panic!("expected QuantizedOnGpu, got {other}"),
    }
    let (_, report) = build_engine(&model, options(None)).unwrap();
    assert_eq!(report.kind, EngineKind::Pipeline);
    assert!(report.gpu_unavailable.unwrap().contains("quantized"));
}
