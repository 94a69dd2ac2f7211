//! Gemma 4 MoE (issue 41, item 3) against the `transformers` fixture of
//! tests/fixtures/make_gemma4.py (`gemma4_text`): sliding layers (window 8, heads of 16, 2 KV
//! heads, plain RoPE) and global layers (heads of 32, 1 KV head, keys as values, proportional
//! RoPE on a quarter of each head) interleaved; q/k norms and a weightless v norm with unscaled
//! scores; sandwich norms; a dense GeGLU MLP beside 8 tanh-GELU experts, each branch with its own
//! norms; the scaled router with per-expert scales; a learned scalar per layer; embeddings times
//! `sqrt(hidden)`; soft-capped logits. A 70-token prompt (past the window and past one 64-token
//! prefill chunk), a second chunk on the same session, decode token by token and greedy tokens
//! past the window: the oracle and the CPU pipeline at hot fractions 0, 0.5 and 1.

mod common;
mod fixture_checks;

use fixture_checks::{Golden, HOT_FRACTIONS};
use moe_lanes::arch::{Ffn, FfnActivation, Mixer, QkNorm, RoutingVariant};
use moe_lanes::model::Model;
use std::sync::Arc;

const NAME: &str = "gemma4_a";

fn open() -> (Arc<Model>, Golden) {
    fixture_checks::open(NAME)
}

#[test]
fn the_plan_says_what_gemma4_is() {
    let (model, g) = open();
    let c = model.config();
    assert_eq!((c.head_dim, c.n_kv_heads, c.sliding_window), (16, 2, Some(8)));
    assert_eq!(c.final_logit_softcap, Some(3.0));
    assert_eq!(c.embedding_scale, Some(8.0));
    assert!(g.prompt.len() > 64 && g.prompt.len() > c.sliding_window.unwrap());
    for (l, spec) in model.plan().layers().iter().enumerate() {
        let Mixer::Attention(a) = spec.mixer else { panic!("layer {l}: {:?}", spec.mixer) };
        assert!(spec.post_norms && spec.output_scale, "layer {l}");
        assert_eq!((a.qk_norm, a.v_norm, a.scale), (QkNorm::PerHead, true, Some(1.0)), "layer {l}");
        let global = l % 2 == 1;
        assert_eq!(a.window, (!global).then_some(8), "layer {l}");
        assert_eq!((a.head_dim, a.n_kv_heads), if global { (32, 1) } else { (16, 2) }, "layer {l}");
        assert_eq!(a.values_from_keys, global, "layer {l}");
        assert_eq!(a.rope.dims, a.head_dim);
        assert_eq!(a.rope.turning_pairs, global.then_some(4), "layer {l}");
        assert_eq!(a.rope.theta, if global { 1e6 } else { 1e4 }, "layer {l}");
        let Ffn::Moe(m) = spec.ffn else { panic!("layer {l} is MoE") };
        assert_eq!(m.router.variant, RoutingVariant::SoftmaxThenTopK);
        assert!(m.router.norm_topk_prob && m.router.scaled_input && m.router.per_expert_scale);
        assert!(m.branch_norms && m.shared.is_some_and(|s| !s.gated && s.ff == 48));
        assert_eq!((m.activation, m.expert_ff, m.router.n_experts_used), (FfnActivation::GeluTanh, 16, 3));
    }
    let summary = model.plan().summary().join("\n");
    assert!(summary.contains("proportional rope") && summary.contains("keys as values"), "{summary}");
}

#[test]
fn reference_matches_transformers_prefill_second_chunk_and_greedy() {
    fixture_checks::check_reference(NAME);
}

#[test]
fn pipeline_prefill_and_a_second_chunk_match_transformers_at_every_hot_fraction() {
    // 64: the prompt crosses a sub-batch (prefill chunk) boundary; 7: many, inside the window.
    fixture_checks::check_pipeline_prefill(NAME, &[7, 64, 512]);
}

#[test]
fn pipeline_decode_token_by_token_equals_transformers() {
    fixture_checks::check_pipeline_decode(NAME, &HOT_FRACTIONS, usize::MAX);
}

#[test]
fn pipeline_greedy_continuations_are_identical() {
    fixture_checks::check_pipeline_greedy(NAME, &HOT_FRACTIONS);
}

/// The GPU engine (per-layer head dims and KV heads, keys as values, the v norm, proportional
/// RoPE, unscaled scores, sandwich norms, the output scalar, the scaled router with per-expert
/// scales, per-branch norms, the dense GeGLU branch, tanh-GELU experts on both lanes, scaled
/// embeddings and soft-capped logits) against transformers at hot fractions 0, 0.5 and 1: the
/// prompt and a second chunk within 2e-3, greedy tokens identical (the decode graphs).
#[test]
fn gpu_engine_matches_transformers() {
    fixture_checks::check_gpu(NAME, &HOT_FRACTIONS);
}

/// The GPU engine takes Gemma 4's plan (`supports` says so without a device); the default engine
/// is the GPU engine where a GPU exists (else the pipeline) and matches transformers.
#[test]
fn the_default_engine_takes_gemma4_and_matches_transformers() {
    use moe_lanes::engine::{build_engine, EngineKind, EngineOptions, HotBudget, HotChoice};
    use moe_lanes::phase::Phase;
    let (model, g) = open();
    moe_lanes::gpu::GpuModel::supports(&model).unwrap();
    let mut opts = EngineOptions::new(128);
    opts.hot = HotChoice::Budget(HotBudget::Fraction(0.5));
    opts.cold_threads = moe_lanes::threads::ColdThreads::Fixed(2);
    if common::gpu_usable() {
        opts.cuda = moe_lanes::env::cuda_config().unwrap();
    }
    let (mut engine, report) = build_engine(&model, opts).unwrap();
    let want = if common::gpu_usable() { EngineKind::Gpu } else { EngineKind::Pipeline };
    assert_eq!(report.kind, want);
    let mut cache = engine.new_cache(128).unwrap();
    let prefill = engine.forward(&g.prompt, Phase::Prefill, &mut cache).unwrap().rows();
    let err = common::max_rel_err(&prefill, &g.logits);
    // the GPU engine's tolerance (issue 42: 2e-3); the pipeline meets 1e-3 above
    assert!(err < 2.0 * fixture_checks::TOLERANCE, "{err}");
}

/// A KV cache position costs each global layer's own K and V width, and each sliding layer its
/// ring at its own width (`window_kv_bytes`: every position below the ring, the ring past it):
/// the fixture's global layers' one KV head of 32 beside the sliding layers' two of 16, and a
/// synth file's sliding layers of 4 KV heads beside its global layers' one of twice the head dim
/// (widths that differ).
#[test]
fn kv_bytes_per_position_count_each_layers_own_width() {
    use moe_lanes::model::context::{kv_bytes_per_position, session_bytes, window_kv_bytes, KvType};
    let (model, _) = open();
    let c = model.config();
    let global = |l: &usize| c.window_of(*l).is_none();
    let by_layer: u64 = (0..c.n_layers).filter(global).map(|l| 2 * 4 * c.layer_kv_dim(l) as u64).sum();
    assert_eq!(kv_bytes_per_position(c), by_layer);
    let (_dir, synth) = synth_gemma4_wide_sliding();
    let c = synth.config();
    let widths: Vec<usize> = (0..c.n_layers).map(|l| c.layer_kv_dim(l)).collect();
    assert_eq!(widths, [4 * c.head_dim, 2 * c.head_dim, 4 * c.head_dim, 2 * c.head_dim]);
    let sliding: Vec<usize> = (0..c.n_layers).filter(|&l| c.window_of(l).is_some()).collect();
    assert_eq!(sliding, [0, 2]);
    let ring = moe_lanes_kernels::kv::kv_ring_positions(c.sliding_window.unwrap()) as u64;
    let (full, slide) = (2 * 4 * 2 * c.head_dim as u64, 2 * 4 * 4 * c.head_dim as u64);
    assert_eq!(kv_bytes_per_position(c), 2 * full, "{widths:?}");
    assert_eq!(window_kv_bytes(c, KvType::F32, 40), 2 * slide * 40);
    assert_eq!(session_bytes(c, KvType::F32, 100_000), 2 * full * 100_000 + 2 * slide * 2 * ring);
}

/// [`synth_gemma4`] with 8 query heads over 4 KV heads on the sliding layers (the global ones
/// keep their one KV head of twice the head dim): layers of two widths.
fn synth_gemma4_wide_sliding() -> (tempfile::TempDir, Arc<Model>) {
    use moe_lanes::synth::DimOverrides;
    synth_gemma4_with(DimOverrides {
        n_layers: Some(4),
        n_heads: Some(8),
        n_kv_heads: Some(4),
        ..Default::default()
    })
}

/// The tiny synthetic Gemma 4 checkpoint (4 layers, BF16 safetensors) in a temporary directory.
fn synth_gemma4() -> (tempfile::TempDir, Arc<Model>) {
    synth_gemma4_with(moe_lanes::synth::DimOverrides { n_layers: Some(4), ..Default::default() })
}

fn synth_gemma4_with(dims: moe_lanes::synth::DimOverrides) -> (tempfile::TempDir, Arc<Model>) {
    synth_gemma4_in(moe_lanes::synth::SynthFormat::Safetensors, dims)
}

/// The same checkpoint (seed 11) in `format`: GGUF in llama.cpp's `gemma4` layout.
fn synth_gemma4_in(
    format: moe_lanes::synth::SynthFormat,
    dims: moe_lanes::synth::DimOverrides,
) -> (tempfile::TempDir, Arc<Model>) {
    use moe_lanes::synth::{self, Preset, Skew, SynthFormat, SynthOptions};
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join(if format == SynthFormat::Gguf { "g.gguf" } else { "g" });
    let opts = SynthOptions {
        adapter: moe_lanes::arch::by_name("gemma4").unwrap(),
        preset: Preset::Tiny,
        dims,
        dtype: moe_lanes::dtype::DType::BF16,
        seed: 11,
        skew: Skew::Skewed,
        format,
        out: out.clone(),
        vocab_from: None,
    };
    synth::write_synthetic(&opts, &mut |_, _| {}).unwrap();
    let model = Arc::new(Model::open(&out).unwrap());
    (dir, model)
}

/// The GPU KV cache holds each layer at its own width (the synth file's sliding layers with 4 KV
/// heads, its global ones 1 of twice the head dim), the sliding ones their ring: the bytes the
/// context accounting counts (`session_bytes`), in f16 (the default) and f32, below the ring and
/// past twice it.
#[test]
fn the_gpu_cache_holds_each_layers_own_width() {
    use moe_lanes::gpu::{CudaBackend, GpuModel, GpuOptions};
    use moe_lanes::model::context::{session_bytes, KvType};
    if !common::gpu_usable() {
        return;
    }
    let (_dir, model) = synth_gemma4_wide_sliding();
    let c = model.config().clone();
    let be = Arc::new(CudaBackend::with_config(&moe_lanes::env::cuda_config().unwrap()).unwrap());
    for kv_type in [KvType::F16, KvType::F32] {
        let opts = GpuOptions { kv_type, ..GpuOptions::default() };
        let gm = GpuModel::new(model.clone(), be.clone(), opts).unwrap();
        for n in [40, 4000] {
            let cache = gm.new_kv_cache(n).unwrap();
            let want = session_bytes(&c, kv_type, n);
            let widths: Vec<usize> = (0..4).map(|l| c.layer_kv_dim(l)).collect();
            assert_eq!(cache.bytes() as u64, want, "{kv_type} at {n}: {widths:?}");
            let every_row: u64 = widths.iter().map(|&w| 2 * kv_type.bytes_of((w * n) as u64)).sum();
            assert_eq!(n == 40, want == every_row, "{kv_type} at {n}: the rings cut only past them");
        }
    }
}

/// Global heads of 512 (26B-A4B's; the synth file's global layers have twice the sliding
/// layers' 256) are wider than the GPU attention kernels take: refused by name before any device
/// is touched, and the default engine falls back to the pipeline (`build_engine`'s list).
#[test]
fn global_heads_of_512_are_refused_by_name_on_the_gpu() {
    let dims =
        moe_lanes::synth::DimOverrides { n_layers: Some(2), head_dim: Some(256), ..Default::default() };
    let (_dir, model) = synth_gemma4_with(dims);
    let global = (0..2).find(|&l| model.plan().layer(l).attention().head_dim == 512).expect("a global layer");
    let err = moe_lanes::gpu::GpuModel::supports(&model).expect_err("refused");
    assert!(matches!(err, moe_lanes::gpu::GpuError::WideHeads { head_dim: 512, max: 256, .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains(&format!("layer {global}")) && text.contains("--engine pipeline"), "{text}");
}

/// The GPU engine on the synthetic BF16 Gemma 4 files (the tiny one, as safetensors and as
/// llama.cpp's GGUF, and one whose sliding and global layers differ in KV width) against the
/// oracle within 3e-2 at every hot fraction: a
/// prompt past the window in one prefill call, then decode token by token (the decode graphs).
/// Skipped without a usable GPU.
#[test]
fn gpu_engine_on_a_synth_gemma4_file_matches_the_oracle() {
    if !common::gpu_usable() {
        return;
    }
    let tiny_gguf = synth_gemma4_in(
        moe_lanes::synth::SynthFormat::Gguf,
        moe_lanes::synth::DimOverrides { n_layers: Some(4), ..Default::default() },
    );
    let files =
        [("tiny", synth_gemma4()), ("tiny gguf", tiny_gguf), ("wide sliding", synth_gemma4_wide_sliding())];
    for (what, (_dir, model)) in files {
        gpu_matches_the_oracle(what, &model);
    }
}

fn gpu_matches_the_oracle(what: &str, model: &Arc<Model>) {
    use moe_lanes::phase::Phase;
    use moe_lanes::reference::{NoObserver, Reference};
    let r = Reference::new(model).unwrap();
    let tokens: Vec<u32> = (0..40u32).map(|i| (i * 7 + 3) % model.config().vocab as u32).collect();
    let want = r.forward(&mut r.new_cache(), &tokens, &mut NoObserver).unwrap();
    for hot in HOT_FRACTIONS {
        let mut engine = fixture_checks::gpu_engine(model, hot);
        let mut cache = engine.new_cache(64).unwrap();
        let mut got = engine.forward(&tokens[..30], Phase::Prefill, &mut cache).unwrap().rows();
        for &t in &tokens[30..] {
            got.extend(engine.forward(&[t], Phase::Decode, &mut cache).unwrap().rows());
        }
        let err = common::max_rel_err(&got, &want);
        println!("synth gemma4 ({what}) gpu hot {hot}: {err:.2e}");
        assert!(err < fixture_checks::GPU_TOLERANCE, "{what} hot {hot}: {err}");
    }
}

/// `synth --arch gemma4` (tiny) in both formats: the published nested safetensors form (under
/// `model.language_model.`) and llama.cpp's GGUF `gemma4` layout (the sliding pattern, `*_swa`
/// keys, per-layer KV heads, `rope_freqs`, no `attn_v` on the global layers, fused
/// `ffn_gate_up_exps`). Each opens with both layer kinds and the CPU pipeline (prefill past the
/// window in sub-batches of 16, then decode) matches the oracle at every hot fraction; the two
/// files of one seed open to the same config and plan and give the oracle the same logits (CI's
/// check of the GGUF reading, where llama.cpp is not: scripts/moe-llama-check.sh runs that); the
/// GGUF file passes `scripts/gguf-layout-check.py` (gguf-py) where gguf-py is installed.
#[test]
fn synth_gemma4_in_both_formats_opens_to_one_model_and_the_pipeline_matches_the_oracle() {
    use moe_lanes::phase::Phase;
    use moe_lanes::reference::{NoObserver, Reference};
    use moe_lanes::synth::{DimOverrides, SynthFormat};
    let mut per_format = Vec::new();
    for format in [SynthFormat::Safetensors, SynthFormat::Gguf] {
        let (_dir, model) = synth_gemma4_in(format, DimOverrides { n_layers: Some(4), ..Default::default() });
        if format == SynthFormat::Gguf {
            // What llama.cpp's loader asks for, read by its gguf-py (where installed).
            if let Some((ok, text)) = common::llama_layout::gguf_py_layout_check(model.path()) {
                assert!(ok, "{text}");
            }
        }
        let plan = model.plan();
        assert!(plan.layer(0).attention().window.is_some() && plan.layer(3).attention().values_from_keys);
        let r = Reference::new(&model).unwrap();
        let tokens: Vec<u32> = (0..40u32).map(|i| (i * 7 + 3) % model.config().vocab as u32).collect();
        let want = r.forward(&mut r.new_cache(), &tokens, &mut NoObserver).unwrap();
        for hot in HOT_FRACTIONS {
            let mut p = fixture_checks::pipeline(&model, hot, 16);
            let mut cache = p.new_cache();
            let mut got = p.forward(&mut cache, &tokens[..30], Phase::Prefill).unwrap();
            for &t in &tokens[30..] {
                got.extend(p.forward(&mut cache, &[t], Phase::Decode).unwrap());
            }
            let err = common::max_rel_err(&got, &want);
            assert!(err < 1e-4, "{format:?} hot {hot}: {err}");
        }
        per_format.push((model.config().clone(), plan.summary(), want));
    }
    let ((st_config, st_plan, st_logits), (gguf_config, gguf_plan, gguf_logits)) =
        (&per_format[0], &per_format[1]);
    assert_eq!(st_plan, gguf_plan);
    assert_eq!(
        (st_config.global_attention, st_config.sliding_window, &st_config.sliding_window_layers),
        (gguf_config.global_attention, gguf_config.sliding_window, &gguf_config.sliding_window_layers)
    );
    assert_eq!(
        (st_config.embedding_scale, st_config.final_logit_softcap, st_config.rope_theta, st_config.head_dim),
        (
            gguf_config.embedding_scale,
            gguf_config.final_logit_softcap,
            gguf_config.rope_theta,
            gguf_config.head_dim
        )
    );
    let err = common::max_rel_err(gguf_logits, st_logits);
    assert!(err < 1e-6, "GGUF and safetensors of one seed: {err}");
}
