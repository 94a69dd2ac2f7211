//! GPT-OSS (issue 41) against the `transformers` fixture of tests/fixtures/make_gpt_oss.py:
//! alternating sliding-window (8 in the fixture) and full attention with sinks, q/k/v/o biases,
//! YaRN RoPE, a biased router, biased experts with the clamped SwiGLU; the prompt (20 tokens)
//! and the greedy continuation cross the window. The oracle and the CPU pipeline at hot
//! fractions 0, 0.5 and 1: prefill, a second chunk on the same session, decode step by step,
//! greedy tokens; the GPU engine within 2e-3 at the same hot fractions with an f32 KV cache (3e-3
//! with its default f16 cache).

mod common;
mod fixture_checks;

use common::*;
use fixture_checks::{Golden, HOT_FRACTIONS};
use moe_lanes::engine::{build_engine, EngineKind, EngineOptions};
use moe_lanes::model::context::KvType;
use moe_lanes::model::Model;
use moe_lanes::phase::Phase;
use moe_lanes::pipeline::Pipeline;
use moe_lanes::reference::{NoObserver, Reference};
use std::sync::Arc;

const NAME: &str = "gpt_oss_a";

fn open() -> (Arc<Model>, Golden) {
    fixture_checks::open(NAME)
}

fn pipeline(model: &Arc<Model>, hot_fraction: f64, max_batch_tokens: usize) -> Pipeline {
    fixture_checks::pipeline(model, hot_fraction, max_batch_tokens)
}

#[test]
fn the_plan_says_what_gpt_oss_is() {
    let (model, g) = open();
    assert!(g.prompt.len() > g.sliding_window.unwrap(), "the prompt crosses the window");
    let plan = model.plan();
    for (l, spec) in plan.layers().iter().enumerate() {
        let a = spec.attention();
        assert_eq!(a.window, (l % 2 == 0).then_some(g.sliding_window.unwrap()), "layer {l}");
        assert!(a.sinks && a.o_bias && a.qkv_bias && a.rope.yarn.is_some(), "layer {l}");
        let m = spec.as_moe().unwrap();
        assert!(m.router.bias && m.expert_bias, "layer {l}");
    }
    let summary = plan.summary().join("\n");
    assert!(summary.contains("sinks") && summary.contains("clamped swiglu"), "{summary}");
}

#[test]
fn reference_matches_transformers_prefill_second_chunk_and_greedy() {
    fixture_checks::check_reference(NAME);
}

/// 8-token sub-batches: the prompt crosses sub-batch boundaries and the window.
#[test]
fn pipeline_prefill_and_a_second_chunk_match_transformers_at_every_hot_fraction() {
    fixture_checks::check_pipeline_prefill(NAME, &[8, 512]);
}

#[test]
fn pipeline_decode_token_by_token_past_the_window_equals_transformers() {
    fixture_checks::check_pipeline_decode(NAME, &HOT_FRACTIONS, usize::MAX);
}

#[test]
fn pipeline_greedy_continuations_are_identical() {
    fixture_checks::check_pipeline_greedy(NAME, &HOT_FRACTIONS);
}

/// On a GPU: the GPU engine (asked for by name) against transformers at hot fractions 0, 0.5
/// and 1 (attention sinks, YaRN, the o and router biases, and the hot lane's expert biases and
/// clamped SwiGLU), greedy tokens identical through the decode graphs, with an f32 KV cache:
/// within the 2e-3 (measured 1.7e-4 on the H200, `scripts/gpu-diag-gptoss.sh`).
#[test]
fn gpu_matches_transformers_at_every_hot_fraction() {
    fixture_checks::check_gpu_within_kv(NAME, &HOT_FRACTIONS, 2e-3, Some(KvType::F32));
}

/// The same with the GPU engine's default f16 KV cache: within 3e-3. Measured 2.6e-3 on the H200
/// (f32 cache: 1.7e-4; `scripts/gpu-diag-gptoss.sh`): the keys' and values' f16 rounding, to
/// which this fixture is unusually sensitive (its one bf16 rounding of the prefill GEMMs'
/// activations moves it 1.7e-1). The other fixtures meet 2e-3 with the f16 cache.
#[test]
fn gpu_with_the_default_f16_cache_is_within_its_rounding() {
    fixture_checks::check_gpu_within(NAME, &HOT_FRACTIONS, 3e-3);
}

/// The GPU engine runs every kind GPT-OSS has (checked before any device is touched, so this
/// runs without a GPU too); on a GPU the default engine is the GPU engine.
#[test]
fn the_gpu_engine_runs_every_kind_of_gpt_oss() {
    let (model, _) = open();
    moe_lanes::gpu::GpuModel::supports(&model).unwrap();
    if !gpu_usable() {
        return;
    }
    let mut opts = EngineOptions::new(64);
    opts.cuda = moe_lanes::env::cuda_config().unwrap();
    let (_, report) = build_engine(&model, opts).unwrap();
    assert_eq!(report.kind, EngineKind::Gpu, "{:?}", report.gpu_unavailable);
}

/// A tiny synthetic GPT-OSS (4 layers, BF16, window 16) of `seed` in `format`, written in `dir`.
fn synth_tiny(dir: &std::path::Path, format: moe_lanes::synth::SynthFormat, seed: u64) -> Arc<Model> {
    use moe_lanes::synth::{self, DimOverrides, Preset, Skew, SynthFormat, SynthOptions};
    let out = dir.join(if format == SynthFormat::Gguf { "m.gguf" } else { "m" });
    let opts = SynthOptions {
        adapter: moe_lanes::arch::by_name("gpt_oss").unwrap(),
        preset: Preset::Tiny,
        dims: DimOverrides { n_layers: Some(4), ..Default::default() },
        dtype: moe_lanes::dtype::DType::BF16,
        seed,
        skew: Skew::Skewed,
        format,
        out: out.clone(),
        vocab_from: None,
    };
    synth::write_synthetic(&opts, &mut |_, _| {}).unwrap();
    Arc::new(Model::open(&out).unwrap())
}

/// `synth --arch gpt_oss` in both formats: GGUF (llama.cpp's names: `attn_sinks`,
/// `post_attention_norm`, `ffn_*_exps.bias`, the window and YaRN keys) and safetensors
/// (transformers' fused input-major experts) hold the same weights, open to the same plan and
/// give the same logits; the pipeline agrees with the oracle on them past the window (16 in the
/// tiny preset), prefill then decode.
#[test]
fn synthetic_gpt_oss_in_both_formats_runs_on_the_pipeline_as_on_the_oracle() {
    use moe_lanes::synth::SynthFormat;
    let dir = tempfile::tempdir().unwrap();
    let tokens: Vec<u32> = (0..40).map(|i| (i * 37 % 500) as u32).collect();
    let mut per_format = Vec::new();
    for format in [SynthFormat::Gguf, SynthFormat::Safetensors] {
        let model = synth_tiny(dir.path(), format, 11);
        let spec = model.layer_spec(0);
        assert_eq!(spec.attention().window, Some(16), "{format:?}");
        assert!(model.layer_spec(1).attention().window.is_none(), "{format:?}");
        assert!(spec.attention().sinks && spec.as_moe().is_some_and(|m| m.expert_bias && m.router.bias));
        let reference = Reference::new(&model).unwrap();
        let mut rc = reference.new_cache();
        let want = reference.forward(&mut rc, &tokens, &mut NoObserver).unwrap();
        let mut p = pipeline(&model, 0.5, 16);
        let mut cache = p.new_cache();
        let mut got = p.forward(&mut cache, &tokens[..30], Phase::Prefill).unwrap();
        for &t in &tokens[30..] {
            got.extend(p.forward(&mut cache, &[t], Phase::Decode).unwrap());
        }
        let err = max_rel_err(&got, &want);
        assert!(err < 1e-4, "{format:?}: {err}");
        per_format.push((want, model.config().yarn.expect("YaRN")));
    }
    // GPT-OSS's config says `truncate: false` (YaRN's correction range not rounded); a GGUF file
    // has no key for it and llama.cpp rounds for every model, so our GGUF reader does too (with
    // it llama.cpp's logits agree within 4e-4, without 4e-2: benches/RESULTS.md). The two
    // formats differ by that alone: the rounding moves these logits by about 2e-3.
    let ((gguf, gguf_yarn), (hf, hf_yarn)) = (&per_format[0], &per_format[1]);
    assert!(gguf_yarn.truncate && !hf_yarn.truncate);
    assert_eq!(moe_lanes::arch::YarnSpec { truncate: false, ..*gguf_yarn }, *hf_yarn);
    let err = max_rel_err(gguf, hf);
    assert!(err > 1e-5 && err < 5e-3, "GGUF and safetensors of one seed: {err}");
}

/// The published shapes: `--preset gpt-oss-20b|gpt-oss-120b` with `--layers N`, only with
/// `--arch gpt_oss`.
#[test]
fn gpt_oss_presets_have_the_published_shapes() {
    use moe_lanes::synth::{synth_config, DimOverrides, Preset};
    let a = moe_lanes::arch::by_name("gpt_oss").unwrap();
    let dims = DimOverrides { n_layers: Some(3), ..Default::default() };
    for (preset, experts) in [(Preset::GptOss20b, 32), (Preset::GptOss120b, 128)] {
        let c = synth_config(a, preset, &dims).unwrap();
        assert_eq!((c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim), (3, 2880, 64, 8, 64));
        assert_eq!((c.n_experts, c.n_experts_used, c.expert_ff, c.vocab), (experts, 4, 2880, 201_088));
        assert_eq!((c.sliding_window, c.sliding_window_layers.clone()), (Some(128), Some(vec![0, 2])));
        let y = c.yarn.unwrap();
        assert_eq!((y.factor, y.original_context), (32.0, 4096));
        assert_eq!(synth_config(a, Preset::GptOss120b, &DimOverrides::default()).unwrap().n_layers, 36);
    }
    let qwen = moe_lanes::arch::by_name("qwen3_moe").unwrap();
    assert!(synth_config(qwen, Preset::GptOss20b, &dims).is_err());
    assert!(synth_config(a, Preset::Qwen3_30bA3b, &dims).is_err());
}

/// Sliding-window rings (issue 41 item 4): one 1200-position session of a tiny synthetic GPT-OSS
/// (window 16, so a window layer's ring of 16 + `KV_RING_CHUNK_POSITIONS` positions wraps more
/// than twice): a 1100-token prompt in one call (the GPU runs it as calls of the ring's chunk),
/// decode past it, a truncation within the last chunk that continues exactly and one further
/// back that is refused. The pipeline within 1e-4 of the oracle, the GPU (hot fractions 0, 0.5,
/// 1, f32 KV) within 2e-3; the window layers' keys and values cost their ring, not the context.
#[test]
fn sliding_window_rings_keep_long_sessions_exact() {
    use moe_lanes::engine::{Engine, HotChoice, KvCache};
    use moe_lanes::model::context::{kv_bytes_per_position_of, session_bytes, window_kv_bytes};
    let dir = tempfile::tempdir().unwrap();
    let model = synth_tiny(dir.path(), moe_lanes::synth::SynthFormat::Gguf, 5);
    let c = model.config().clone();
    let (n, prompt) = (1200, 1100);
    let tokens: Vec<u32> = (0..n).map(|i| ((i * 37 + i / 7) % c.vocab) as u32).collect();
    let reference = Reference::new(&model).unwrap();
    let want = reference.forward(&mut reference.new_cache(), &tokens, &mut NoObserver).unwrap();
    let run = |engine: &mut dyn Engine, tolerance: f32, what: &str| {
        let mut cache = engine.new_cache(n + 8).unwrap();
        let mut got = vec![engine
            .forward(&tokens[..prompt], Phase::Prefill, &mut cache)
            .unwrap()
            .rows()
            .pop()
            .unwrap()];
        for &t in &tokens[prompt..] {
            got.extend(engine.forward(&[t], Phase::Decode, &mut cache).unwrap().rows());
        }
        let err = max_rel_err(&got, &want[prompt - 1..]);
        assert!(err < tolerance, "{what}: {err}");
        check_ring_bytes(&c, &cache, n, what);
        assert!(!cache.truncate(n - 600), "{what}: a ring cannot go 600 positions back");
        assert!(cache.truncate(n - 40), "{what}: 40 back is within the last chunk");
        let again: Vec<Vec<f32>> = tokens[n - 40..]
            .iter()
            .flat_map(|&t| engine.forward(&[t], Phase::Decode, &mut cache).unwrap().rows())
            .collect();
        let err = max_rel_err(&again, &want[n - 40..]);
        assert!(err < tolerance, "{what} after a truncation: {err}");
    };
    fn check_ring_bytes(c: &moe_lanes::model::config::ModelConfig, cache: &KvCache, n: usize, what: &str) {
        let kv = KvType::F32; // as the engines are built below
        let full_per_position = kv_bytes_per_position_of(c, kv) as usize;
        let bytes = cache.kv_bytes().unwrap();
        assert!(bytes as u64 <= session_bytes(c, kv, n + 8), "{what}: {bytes} over the accounting");
        assert!(bytes >= full_per_position * n, "{what}: the full layers keep every position");
        let windows = window_kv_bytes(c, kv, usize::MAX) as usize;
        assert!(bytes <= full_per_position * (n + 8) + windows, "{what}: window layers past their ring");
        assert!(windows < full_per_position * n, "{what}: the rings are smaller than the context");
    }
    for kind in [EngineKind::Pipeline, EngineKind::Gpu] {
        if kind == EngineKind::Gpu && !gpu_usable() {
            continue;
        }
        let fractions: &[f64] = if kind == EngineKind::Gpu { &HOT_FRACTIONS } else { &[0.5] };
        for &fraction in fractions {
            let mut opts = EngineOptions::new(n + 8);
            opts.kind = Some(kind);
            opts.kv_type = Some(KvType::F32);
            opts.cuda = moe_lanes::env::cuda_config().unwrap();
            opts.hot = HotChoice::Set(fixture_checks::hot_set(&model, fraction));
            let (mut engine, report) = build_engine(&model, opts).unwrap();
            assert_eq!(report.kind, kind);
            let tolerance = if kind == EngineKind::Gpu { 2e-3 } else { 1e-4 };
            run(engine.as_mut(), tolerance, &format!("{kind:?} hot {fraction}"));
        }
    }
}
