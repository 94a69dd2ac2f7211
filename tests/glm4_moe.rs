//! GLM-4.5 / 4.6 (issue 42, item 3) against the `transformers` fixture of
//! tests/fixtures/make_glm4_moe.py: grouped-query attention with q/k/v biases, per-head q/k norm
//! and RoPE on half of each head (`rotate_half` pairs), a dense first layer, sigmoid routing with
//! a selection bias over 2 groups of which 1 is kept, `routed_scaling_factor` 2.5, an ungated
//! shared expert; every kind already in the plan (DeepSeek-V3's FFN side, the Qwen attention).
//! The oracle and the CPU pipeline at hot fractions 0, 0.5 and 1: prefill, a second chunk on the
//! same session, decode token by token, greedy tokens; the default engine on whatever the machine
//! has (the GPU engine where it takes the plan, else the pipeline) matches transformers.

mod common;
mod fixture_checks;

use common::*;
use fixture_checks::{Golden, HOT_FRACTIONS, TOLERANCE};
use moe_lanes::arch::{Ffn, Mixer, QkNorm, RoutingVariant};
use moe_lanes::engine::{build_engine, EngineOptions, HotChoice};
use moe_lanes::hot_set::HotSet;
use moe_lanes::model::Model;
use moe_lanes::phase::Phase;
use moe_lanes::pipeline::{Pipeline, PipelineOptions};
use moe_lanes::reference::{NoObserver, Reference};
use std::sync::Arc;

const NAME: &str = "glm4_moe_a";

fn open() -> (Arc<Model>, Golden) {
    fixture_checks::open(NAME)
}

fn pipeline(model: &Arc<Model>, hot_fraction: f64, max_batch_tokens: usize) -> Pipeline {
    fixture_checks::pipeline(model, hot_fraction, max_batch_tokens)
}

#[test]
fn the_plan_says_what_glm4_moe_is() {
    let (model, _) = open();
    let c = model.config();
    assert_eq!((c.mtp_layers, c.rotary_dims, c.head_dim), (1, 8, 16));
    let plan = model.plan();
    for (l, spec) in plan.layers().iter().enumerate() {
        let Mixer::Attention(a) = spec.mixer else { panic!("layer {l}: {:?}", spec.mixer) };
        assert!(a.qkv_bias && !a.o_bias && !a.sinks && !a.output_gate, "layer {l}");
        assert_eq!((a.qk_norm, a.rope.dims, a.head_dim), (QkNorm::PerHead, 8, 16));
        match (l, &spec.ffn) {
            (0, Ffn::Dense(d)) => assert_eq!(d.ff, 48),
            (0, other) => panic!("layer 0 is dense: {other:?}"),
            (_, Ffn::Moe(moe)) => {
                let r = moe.router;
                assert_eq!(r.variant, RoutingVariant::Sigmoid);
                assert!(r.selection_bias && r.norm_topk_prob);
                assert_eq!((r.n_group, r.topk_group, r.scale), (2, 1, 2.5));
                assert!(moe.shared.is_some_and(|s| !s.gated && s.ff == 16));
            }
            (_, other) => panic!("layer {l} routes: {other:?}"),
        }
    }
    let summary = plan.summary().join("\n");
    assert!(summary.contains("dense ffn") && summary.contains("1 of 2 groups"), "{summary}");
    assert!(summary.contains("ungated shared expert"), "{summary}");
    assert_eq!(plan.expert_layers(), vec![false, true, true]);
    assert_eq!(model.expert_bytes_of_layer(0), 0);
}

#[test]
fn reference_matches_transformers_prefill_second_chunk_and_greedy() {
    fixture_checks::check_reference(NAME);
}

#[test]
fn pipeline_prefill_and_a_second_chunk_match_transformers_at_every_hot_fraction() {
    fixture_checks::check_pipeline_prefill(NAME, &[8, 512]);
}

#[test]
fn pipeline_decode_token_by_token_equals_transformers() {
    fixture_checks::check_pipeline_decode(NAME, &HOT_FRACTIONS, usize::MAX);
}

#[test]
fn pipeline_greedy_continuations_are_identical() {
    fixture_checks::check_pipeline_greedy(NAME, &HOT_FRACTIONS);
}

/// The GPU engine (the dense first layer, sigmoid routing with the selection bias, the ungated
/// shared expert on the device) against transformers at hot fractions 0, 0.5 and 1.
#[test]
fn gpu_engine_matches_transformers() {
    fixture_checks::check_gpu(NAME, &HOT_FRACTIONS);
}

/// A hot set that names experts of the dense layer is refused by name.
#[test]
fn a_hot_set_in_the_dense_layer_is_refused() {
    let (model, _) = open();
    let c = model.config();
    let all = HotSet::from_fraction(c.n_layers, c.n_experts, 1, 0.5, None).unwrap();
    let opts = PipelineOptions { hot_set: Some(all), ..Default::default() };
    let err = Pipeline::new(model.clone(), opts).err().expect("refused").to_string();
    assert!(err.contains("layer 0") && err.contains("dense"), "{err}");
}

/// The default engine (the GPU engine where a GPU exists and takes the plan, or the pipeline it
/// falls back to) matches transformers at a 50% byte budget; the dense layer gets no experts.
#[test]
fn the_default_engine_matches_transformers() {
    let (model, g) = open();
    let mut opts = EngineOptions::new(128);
    opts.hot = HotChoice::Budget(moe_lanes::engine::HotBudget::Fraction(0.5));
    opts.cold_threads = moe_lanes::threads::ColdThreads::Fixed(2);
    if gpu_usable() {
        opts.cuda = moe_lanes::env::cuda_config().unwrap();
    }
    let (mut engine, report) = build_engine(&model, opts).unwrap();
    println!("glm4_moe: engine {:?}", report.kind);
    let mut cache = engine.new_cache(128).unwrap();
    let prefill = engine.forward(&g.prompt, Phase::Prefill, &mut cache).unwrap().rows();
    let err = max_rel_err(&prefill, &g.logits);
    // The GPU engine's tolerance (issue 42: 2e-3); the pipeline meets 1e-3 above.
    assert!(err < 2.0 * TOLERANCE, "{err}");
}

/// `synth --arch glm4_moe` (tiny: a dense first layer, 2 groups of 4 experts, q/k norm, half
/// RoPE), with q/k/v biases (GLM-4.5) and without (`--no-attention-bias`, as some derivatives):
/// both formats open with the same plan and give the same logits on both CPU engines, and the
/// pipeline matches the oracle on each. The GGUF file carries an MTP layer (`--mtp-layers 1`, as
/// llama.cpp's converter writes GLM-4.5), loaded and not run, and passes gguf-py's check of
/// llama.cpp's glm4moe layout.
#[test]
fn synthetic_glm4_moe_in_both_formats_gives_the_same_logits() {
    use moe_lanes::synth::SynthFormat;
    let dir = tempfile::tempdir().unwrap();
    let prompt: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % 500).collect();
    for bias in [true, false] {
        let (mut oracle, mut pipe) = (Vec::new(), Vec::new());
        for format in [SynthFormat::Safetensors, SynthFormat::Gguf] {
            let out = dir.path().join(format!("m-{bias}-{format:?}"));
            let mut opts = synth_options("glm4_moe", format, out, 42);
            opts.dims.n_layers = Some(3);
            opts.dims.attention_bias = (!bias).then_some(false);
            if format == SynthFormat::Gguf {
                opts.out.set_extension("gguf");
                opts.dims.mtp_layers = Some(1);
            }
            moe_lanes::synth::write_synthetic(&opts, &mut |_, _| {}).unwrap();
            let model = Arc::new(Model::open(&opts.out).unwrap());
            assert_eq!(model.plan().expert_layers(), vec![false, true, true], "{format:?}");
            let c = model.config();
            assert!(c.qk_norm && c.rotary_dims * 2 == c.head_dim, "{format:?}");
            assert_eq!(c.attention_bias, bias, "{format:?}");
            assert_eq!(model.layer(1, moe_lanes::naming::LayerRole::QBias).is_some(), bias, "{format:?}");
            if format == SynthFormat::Gguf {
                assert_eq!((c.n_layers, c.mtp_layers), (3, 1));
                assert!(model.tensor_list().iter().any(|t| t.0 == "blk.3.nextn.eh_proj.weight"));
                if let Some((ok, text)) = common::llama_layout::gguf_py_layout_check(&opts.out) {
                    assert!(ok, "{text}");
                }
            }
            let r = Reference::new(&model).unwrap();
            let want = r.forward(&mut r.new_cache(), &prompt, &mut NoObserver).unwrap();
            let mut p = pipeline(&model, 0.5, 512);
            let got = p.forward(&mut p.new_cache(), &prompt, Phase::Prefill).unwrap();
            let err = max_rel_err(&got, &want);
            assert!(err < TOLERANCE, "{format:?}: pipeline vs oracle {err}");
            oracle.push(want);
            pipe.push(got);
        }
        for (engine, runs) in [("oracle", &oracle), ("pipeline", &pipe)] {
            let err = max_rel_err(&runs[1], &runs[0]);
            println!("synthetic glm4_moe (bias {bias}) {engine}: gguf vs safetensors {err:.2e}");
            assert!(err < 1e-5, "bias {bias}, {engine}: the formats differ by {err}");
        }
    }
}

/// The fixture rewritten in llama.cpp's glm4moe layout by our own writer
/// (`common::llama_layout`): gguf-py finds what llama.cpp's loader asks for, and the oracle and
/// the pipeline on it give the fixture's transformers logits.
#[test]
fn the_fixture_in_llama_cpp_layout_gives_its_logits() {
    use common::llama_layout::{gguf_py_layout_check, write_llama_layout, KvB};
    let (hf, g) = open();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("glm.gguf");
    write_llama_layout(&hf, &path, KvB::Split);
    if let Some((ok, text)) = gguf_py_layout_check(&path) {
        assert!(ok, "{text}");
    }
    let model = Arc::new(Model::open(&path).unwrap());
    let (c, want) = (model.config(), hf.config());
    assert_eq!(
        (c.qk_norm, c.attention_bias, c.rotary_dims),
        (want.qk_norm, want.attention_bias, want.rotary_dims)
    );
    assert_eq!((c.dense_layers, c.sigmoid_routing), (want.dense_layers, want.sigmoid_routing));
    fixture_checks::check_prompt_logits(&model, &g, "");
}

/// A GLM config with `attention_bias: false` on a checkpoint without q/k/v biases opens and runs
/// (no bias tensor required); `attention_bias` left out is transformers' default, false.
#[test]
fn a_glm_config_without_attention_bias_needs_no_bias_tensors() {
    use moe_lanes::synth::SynthFormat;
    let dir = tempfile::tempdir().unwrap();
    let mut opts = synth_options("glm4_moe", SynthFormat::Safetensors, dir.path().join("nb"), 7);
    opts.dims.attention_bias = Some(false);
    moe_lanes::synth::write_synthetic(&opts, &mut |_, _| {}).unwrap();
    let config_path = opts.out.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&config_path).unwrap()).unwrap();
    assert_eq!(config["attention_bias"], serde_json::json!(false));
    config.as_object_mut().unwrap().remove("attention_bias");
    std::fs::write(&config_path, serde_json::to_vec(&config).unwrap()).unwrap();
    let model = Model::open(&opts.out).unwrap();
    assert!(!model.config().attention_bias);
    let Mixer::Attention(a) = model.layer_spec(0).mixer else { panic!("GQA") };
    assert!(!a.qkv_bias);
    // The other way round, a config that says true on this checkpoint names the missing bias.
    config["attention_bias"] = serde_json::json!(true);
    std::fs::write(&config_path, serde_json::to_vec(&config).unwrap()).unwrap();
    let err = Model::open(&opts.out).err().expect("refused").to_string();
    assert!(err.contains("q_proj.bias"), "{err}");
    // Other architectures fix their biases: the override is refused by name.
    let mut other = synth_options("qwen3_moe", SynthFormat::Gguf, dir.path().join("q.gguf"), 7);
    other.dims.attention_bias = Some(false);
    let err = moe_lanes::synth::write_synthetic(&other, &mut |_, _| {}).unwrap_err().to_string();
    assert!(err.contains("attention_bias"), "{err}");
}

/// The preset: GLM-4.5-Air's shapes, shrunk with `--layers`.
#[test]
fn glm_preset_has_its_shapes() {
    use moe_lanes::synth::{synth_config, DimOverrides, Preset};
    let a = adapter("glm4_moe");
    let full = synth_config(a, "glm-4.5-air".parse::<Preset>().unwrap(), &DimOverrides::default()).unwrap();
    assert_eq!(
        (full.n_layers, full.hidden, full.n_heads, full.n_kv_heads, full.head_dim),
        (46, 4096, 96, 8, 128)
    );
    assert_eq!(
        (full.n_experts, full.n_experts_used, full.expert_ff, full.shared_expert_ff),
        (128, 8, 1408, 1408)
    );
    assert_eq!((full.rotary_dims, full.vocab), (64, 151_552));
    let d = full.dense_layers.unwrap();
    assert_eq!((d.count, d.ff), (1, 10944));
    let dims = DimOverrides { n_layers: Some(4), ..Default::default() };
    let small = synth_config(a, "glm-4.5-air".parse::<Preset>().unwrap(), &dims).unwrap();
    assert_eq!(small.n_layers, 4);
    assert!(synth_config(adapter("qwen3_moe"), "glm-4.5-air".parse().unwrap(), &dims).is_err());
    assert!(synth_config(a, "deepseek-v3".parse().unwrap(), &dims).is_err());
}
