//! The hybrid Gated DeltaNet + gated attention models (Qwen3-Next, Qwen3.5-MoE) on the fast
//! engines, against the `transformers` fixtures of tests/fixtures/make_hybrid.py: prefill logits,
//! a second prompt chunk on the same session, token-by-token decode of the prompt, and greedy
//! continuations, at hot fractions 0, 0.5 and 1.

mod common;
mod fixture_checks;

use common::*;
use fixture_checks::GPU_TOLERANCE;
use moe_lanes::hot_set::HotSet;
use moe_lanes::model::Model;
use moe_lanes::phase::Phase;
use moe_lanes::pipeline::{Pipeline, PipelineOptions};
use std::sync::Arc;

const HYBRIDS: [&str; 2] = ["qwen3_next_a", "qwen3_5_moe_a"];

fn pipeline(model: &Arc<Model>, hot_fraction: f64, max_batch_tokens: usize) -> Pipeline {
    fixture_checks::pipeline(model, hot_fraction, max_batch_tokens)
}

/// 32-token sub-batches: the 70-token prompt crosses sub-batch boundaries and DeltaNet chunks.
#[test]
fn pipeline_prefill_and_a_second_chunk_match_transformers_at_every_hot_fraction() {
    for name in HYBRIDS {
        fixture_checks::check_pipeline_prefill(name, &[32]);
    }
}

#[test]
fn pipeline_decode_token_by_token_equals_its_prefill() {
    for name in HYBRIDS {
        fixture_checks::check_pipeline_decode(name, &[0.5], 20);
    }
}

#[test]
fn pipeline_greedy_continuations_are_identical() {
    for name in HYBRIDS {
        fixture_checks::check_pipeline_greedy(name, &[0.0, 1.0]);
    }
}

/// Prefill, a second chunk, decode steps and greedy tokens on the GPU engine against
/// transformers, at hot fractions 0, 0.5 and 1 (the decode steps run as CUDA graphs).
#[test]
fn gpu_engine_matches_transformers_on_the_hybrids() {
    for name in HYBRIDS {
        fixture_checks::check_gpu(name, &fixture_checks::HOT_FRACTIONS);
    }
}

/// `synth` writes both hybrids (Qwen3.5 in its published nested form with fused experts); they
/// open, and the pipeline agrees with the oracle on them, prefill then decode.
#[test]
fn synthetic_hybrids_run_on_the_pipeline_as_on_the_oracle() {
    use moe_lanes::reference::{NoObserver, Reference};
    use moe_lanes::synth::{self, DimOverrides, Preset, Skew, SynthFormat, SynthOptions};
    let dir = tempfile::tempdir().unwrap();
    for arch in ["qwen3_next", "qwen3_5_moe"] {
        let out = dir.path().join(arch);
        let opts = SynthOptions {
            adapter: moe_lanes::arch::by_name(arch).unwrap(),
            preset: Preset::Tiny,
            dims: DimOverrides { n_layers: Some(5), ..Default::default() },
            dtype: moe_lanes::dtype::DType::BF16,
            seed: 3,
            skew: Skew::Skewed,
            format: SynthFormat::Safetensors,
            out: out.clone(),
            vocab_from: None,
        };
        synth::write_synthetic(&opts, &mut |_, _| {}).unwrap();
        let model = Arc::new(Model::open(&out).unwrap());
        assert_eq!(model.config().n_attention_layers(), 1, "{arch}: layer 3 of 5");
        let tokens: Vec<u32> = (0..40).map(|i| (i * 37 % 500) as u32).collect();
        let reference = Reference::new(&model).unwrap();
        let mut rc = reference.new_cache();
        let mut want = reference.forward(&mut rc, &tokens[..30], &mut NoObserver).unwrap();
        want.extend(reference.forward(&mut rc, &tokens[30..], &mut NoObserver).unwrap());
        let mut p = pipeline(&model, 0.5, 16);
        let mut cache = p.new_cache();
        let mut got = p.forward(&mut cache, &tokens[..30], Phase::Prefill).unwrap();
        for &t in &tokens[30..] {
            got.extend(p.forward(&mut cache, &[t], Phase::Decode).unwrap());
        }
        let err = max_rel_err(&got, &want);
        assert!(err < 1e-4, "{arch}: {err}");
    }
}

/// Real DeltaNet sizes (Qwen3.6's 32 value heads of 128 x 128) make the pipeline run the heads
/// on the dense stage's pool: the same bits as on one thread, and the oracle's logits.
#[test]
fn deltanet_heads_on_the_pool_change_no_bit() {
    use moe_lanes::reference::{NoObserver, Reference};
    let dir = tempfile::tempdir().unwrap();
    let model = synth_qwen36(dir.path(), Some(32), 5);
    let tokens: Vec<u32> = (0..12).map(|i| (i * 53 % 300) as u32).collect();
    let run = |threads: usize| {
        let c = model.config();
        let hot_set = HotSet::from_fraction(c.n_layers, c.n_experts, 1, 0.5, None).unwrap();
        let opts = PipelineOptions { hot_set: Some(hot_set), n_dense_threads: threads, ..Default::default() };
        let mut p = Pipeline::new(model.clone(), opts).unwrap();
        let mut cache = p.new_cache();
        let mut rows = p.forward(&mut cache, &tokens[..8], Phase::Prefill).unwrap();
        for &t in &tokens[8..] {
            rows.extend(p.forward(&mut cache, &[t], Phase::Decode).unwrap());
        }
        rows
    };
    let (one, pooled) = (run(1), run(3));
    assert_eq!(one, pooled, "the pool changes no bit");
    let reference = Reference::new(&model).unwrap();
    let mut rc = reference.new_cache();
    let want = reference.forward(&mut rc, &tokens, &mut NoObserver).unwrap();
    let err = max_rel_err(&pooled, &want);
    assert!(err < 1e-4, "{err}");
}

/// A synthetic hybrid of one seed as a GGUF file (llama.cpp's layout: Qwen3-Next's split `qkv`
/// and `z` beside its grouped `ba`, Qwen3.5's value heads in tiled order, `ssm_a = -exp(A_log)`,
/// norms stored as scales, `post_attention_norm`) and as a safetensors directory is one model:
/// the oracle gives the same logits on both, and the pipeline (and the GPU engine where there is
/// one) on the GGUF file gives the oracle's.
#[test]
fn gguf_hybrids_are_the_safetensors_model_in_llama_cpp_layout() {
    use moe_lanes::arch::{DeltaNetProjections, Mixer, VHeadOrder};
    use moe_lanes::reference::{NoObserver, Reference};
    use moe_lanes::synth::{self, DimOverrides, Preset, Skew, SynthFormat, SynthOptions};
    let dir = tempfile::tempdir().unwrap();
    let tokens: Vec<u32> = (0..24).map(|i| (i * 41 % 500) as u32).collect();
    for (arch, layout) in [
        ("qwen3_next", (DeltaNetProjections::SplitGroupedBa, VHeadOrder::Grouped)),
        ("qwen3_5_moe", (DeltaNetProjections::Split, VHeadOrder::Tiled)),
    ] {
        let mut logits = Vec::new();
        let mut models = Vec::new();
        for format in [SynthFormat::Gguf, SynthFormat::Safetensors] {
            let out = dir.path().join(format!("{arch}-{format:?}"));
            let opts = SynthOptions {
                adapter: moe_lanes::arch::by_name(arch).unwrap(),
                preset: Preset::Tiny,
                dims: DimOverrides { n_layers: Some(5), ..Default::default() },
                dtype: moe_lanes::dtype::DType::BF16,
                seed: 9,
                skew: Skew::Skewed,
                format,
                out: out.clone(),
                vocab_from: None,
            };
            synth::write_synthetic(&opts, &mut |_, _| {}).unwrap();
            let model = Arc::new(Model::open(&out).unwrap());
            let reference = Reference::new(&model).unwrap();
            let mut rc = reference.new_cache();
            logits.push(reference.forward(&mut rc, &tokens, &mut NoObserver).unwrap());
            models.push(model);
        }
        let gguf = &models[0];
        let Mixer::GatedDeltaNet(d) = gguf.layer_spec(0).mixer else { panic!("{arch}: layer 0 is DeltaNet") };
        assert_eq!((d.projections, d.v_heads), layout, "{arch}");
        assert!(d.n_v_heads > d.n_k_heads, "{arch}: the head order matters");
        assert_eq!(gguf.config().n_attention_layers(), 1, "{arch}: layer 3 of 5");
        let err = max_rel_err(&logits[0], &logits[1]);
        assert!(err < 1e-5, "{arch}: oracle on GGUF vs safetensors: {err}");
        let mut p = pipeline(gguf, 0.5, 16);
        let mut cache = p.new_cache();
        let mut got = p.forward(&mut cache, &tokens[..20], Phase::Prefill).unwrap();
        for &t in &tokens[20..] {
            got.extend(p.forward(&mut cache, &[t], Phase::Decode).unwrap());
        }
        let err = max_rel_err(&got, &logits[1]);
        assert!(err < 1e-4, "{arch}: pipeline on GGUF vs oracle: {err}");
        if gpu_usable() {
            let mut engine = fixture_checks::gpu_engine(gguf, 0.5);
            let mut cache = engine.new_cache(64).unwrap();
            let got = engine.forward(&tokens, Phase::Prefill, &mut cache).unwrap().rows();
            let err = max_rel_err(&got, &logits[1]);
            println!("{arch} gguf gpu: {err:.2e}");
            assert!(err < GPU_TOLERANCE, "{arch}: GPU on GGUF vs oracle: {err}");
        }
    }
}

/// A GGUF file with the multi-token-prediction layer llama.cpp's converter appends after the last
/// layer (`nextn_predict_layers`, `blk.N.nextn.*`): it opens with the layers a forward pass runs,
/// says it carries the MTP layer, and gives the logits of the same file without it.
#[test]
fn mtp_layers_are_loaded_and_not_run() {
    use moe_lanes::reference::{NoObserver, Reference};
    use moe_lanes::synth::{self, DimOverrides, Preset, Skew, SynthFormat, SynthOptions};
    let dir = tempfile::tempdir().unwrap();
    let tokens: Vec<u32> = (0..12).map(|i| (i * 29 % 500) as u32).collect();
    let mut runs = Vec::new();
    for mtp in [Some(1), None] {
        let out = dir.path().join(format!("mtp-{mtp:?}.gguf"));
        let opts = SynthOptions {
            adapter: moe_lanes::arch::by_name("qwen3_5_moe").unwrap(),
            preset: Preset::Tiny,
            dims: DimOverrides { n_layers: Some(5), mtp_layers: mtp, ..Default::default() },
            dtype: moe_lanes::dtype::DType::BF16,
            seed: 4,
            skew: Skew::Skewed,
            format: SynthFormat::Gguf,
            out: out.clone(),
            vocab_from: None,
        };
        synth::write_synthetic(&opts, &mut |_, _| {}).unwrap();
        let model = Arc::new(Model::open(&out).unwrap());
        assert_eq!(model.config().n_layers, 5);
        assert_eq!(model.config().mtp_layers, mtp.unwrap_or(0));
        let tensors = model.tensor_list().len();
        let reference = Reference::new(&model).unwrap();
        let mut rc = reference.new_cache();
        runs.push((reference.forward(&mut rc, &tokens, &mut NoObserver).unwrap(), tensors));
    }
    assert!(runs[0].1 > runs[1].1, "the MTP layer's tensors are in the file: {} vs {}", runs[0].1, runs[1].1);
    assert_eq!(runs[0].0, runs[1].0, "the MTP layer changes no logit");
}

/// Qwen3.6's attention shape (16 query heads over 2 KV heads of 256) on the GPU engine: its
/// default f16 KV cache runs the wide-head tensor-core kernels (prefill of 80 tokens: 640 query
/// rows of a KV head, ten 64-row blocks over five 16-key tiles; then decode steps on the split
/// kernel), and the logits of every row stay within [`GPU_TOLERANCE`] of the oracle's.
#[test]
fn gpu_engine_on_heads_of_256_matches_the_oracle() {
    use moe_lanes::reference::{NoObserver, Reference};
    let dir = tempfile::tempdir().unwrap();
    let model = synth_qwen36(dir.path(), None, 7);
    let c = model.config();
    assert_eq!((c.n_heads, c.n_kv_heads, c.head_dim), (16, 2, 256), "Qwen3.6's attention heads");
    let tokens: Vec<u32> = (0..84).map(|i| (i * 37 % 300) as u32).collect();
    let reference = Reference::new(&model).unwrap();
    let mut rc = reference.new_cache();
    let want = reference.forward(&mut rc, &tokens, &mut NoObserver).unwrap();
    if !gpu_usable() {
        return;
    }
    let mut engine = fixture_checks::gpu_engine(&model, 0.5);
    let mut cache = engine.new_cache(128).unwrap();
    let mut got = engine.forward(&tokens[..80], Phase::Prefill, &mut cache).unwrap().rows();
    for &t in &tokens[80..] {
        got.extend(engine.forward(&[t], Phase::Decode, &mut cache).unwrap().rows());
    }
    let err = max_rel_err(&got, &want);
    println!("qwen3.6-shaped heads of 256 on the GPU engine: {err:.2e}");
    assert!(err < GPU_TOLERANCE, "GPU engine vs oracle at head dim 256: {err}");
}

/// A 4-layer Qwen3.6-shaped safetensors checkpoint (hidden 64, 8 experts of 32, top-2, a shared
/// expert of 32; the preset's attention heads, of `head_dim` if given) under `dir`.
fn synth_qwen36(dir: &std::path::Path, head_dim: Option<usize>, seed: u64) -> Arc<Model> {
    use moe_lanes::synth::{self, DimOverrides, Preset, Skew, SynthFormat, SynthOptions};
    let out = dir.join("q36");
    let dims = DimOverrides {
        n_layers: Some(4),
        hidden: Some(64),
        head_dim,
        vocab: Some(300),
        n_experts: Some(8),
        n_experts_used: Some(2),
        expert_ff: Some(32),
        shared_expert_ff: Some(32),
        ..Default::default()
    };
    let opts = SynthOptions {
        adapter: moe_lanes::arch::by_name("qwen3_5_moe").unwrap(),
        preset: Preset::Qwen36_35bA3b,
        dims,
        dtype: moe_lanes::dtype::DType::BF16,
        seed,
        skew: Skew::Skewed,
        format: SynthFormat::Safetensors,
        out: out.clone(),
        vocab_from: None,
    };
    synth::write_synthetic(&opts, &mut |_, _| {}).unwrap();
    Arc::new(Model::open(&out).unwrap())
}
