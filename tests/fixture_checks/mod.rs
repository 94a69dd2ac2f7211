//! The `transformers` fixtures of the architectures with their own test files (Qwen hybrids,
//! GPT-OSS, DeepSeek-V3: tests/fixtures/make_*.py): each `golden.json` holds a prompt, its logits,
//! a second prompt chunk on the same session with its logits, and greedy tokens; the checks every
//! such test file runs on them, on the oracle and the CPU pipeline.
#![allow(dead_code)]

use crate::common::{fixtures_root, max_rel_err};
use moe_lanes::hot_set::HotSet;
use moe_lanes::model::Model;
use moe_lanes::phase::Phase;
use moe_lanes::pipeline::{Pipeline, PipelineOptions};
use moe_lanes::reference::{NoObserver, Reference};
use serde::Deserialize;
use std::sync::Arc;

#[derive(Deserialize)]
pub struct Golden {
    pub prompt: Vec<u32>,
    pub logits: Vec<Vec<f32>>,
    pub greedy_new_tokens: Vec<u32>,
    pub second_chunk: Vec<u32>,
    pub second_chunk_logits: Vec<Vec<f32>>,
    /// GPT-OSS's window of its sliding layers.
    #[serde(default)]
    pub sliding_window: Option<usize>,
}

/// The issues' bound for the reference and the pipeline against `transformers`.
pub const TOLERANCE: f32 = 1e-3;
/// The issues' bound for the GPU engine (bf16 activations in its prefill GEMMs).
pub const GPU_TOLERANCE: f32 = 2e-3;
/// The hot fractions every engine is checked at.
pub const HOT_FRACTIONS: [f64; 3] = [0.0, 0.5, 1.0];

pub fn open(name: &str) -> (Arc<Model>, Golden) {
    let dir = fixtures_root().join(name);
    let golden = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    (Arc::new(Model::open(&dir).unwrap()), golden)
}

/// `fraction` of each MoE layer's experts hot, the lowest ids (a dense FFN layer has none).
pub fn hot_set(model: &Model, fraction: f64) -> HotSet {
    let c = model.config();
    let all = HotSet::from_fraction(c.n_layers, c.n_experts, 1, fraction, None).unwrap();
    let lists: Vec<Vec<usize>> = (0..c.n_layers)
        .map(|l| match model.plan().layer(l).has_experts() {
            true => (0..c.n_experts).filter(|&e| all.layers[l].is_hot(e)).collect(),
            false => Vec::new(),
        })
        .collect();
    HotSet::from_lists(c.n_layers, c.n_experts, 1, &lists)
}

pub fn pipeline(model: &Arc<Model>, hot_fraction: f64, max_batch_tokens: usize) -> Pipeline {
    let opts = PipelineOptions {
        hot_set: Some(hot_set(model, hot_fraction)),
        max_batch_tokens,
        ..Default::default()
    };
    Pipeline::new(model.clone(), opts).unwrap()
}

/// `model` (the fixture, or the fixture rewritten into another layout) on the oracle and the
/// pipeline at hot 0.5: the prompt's logits within [`TOLERANCE`] of the fixture's; `what` names
/// the case in the messages.
pub fn check_prompt_logits(model: &Arc<Model>, g: &Golden, what: &str) {
    let r = Reference::new(model).unwrap();
    let got = r.forward(&mut r.new_cache(), &g.prompt, &mut NoObserver).unwrap();
    let err = max_rel_err(&got, &g.logits);
    assert!(err < TOLERANCE, "{what}oracle vs transformers {err}");
    let mut p = pipeline(model, 0.5, 512);
    let got = p.forward(&mut p.new_cache(), &g.prompt, Phase::Prefill).unwrap();
    let err = max_rel_err(&got, &g.logits);
    assert!(err < TOLERANCE, "{what}pipeline vs transformers {err}");
}

/// The oracle: prefill, then the second chunk on the same session, then greedy tokens.
pub fn check_reference(name: &str) {
    let (model, g) = open(name);
    let r = Reference::new(&model).unwrap();
    let mut cache = r.new_cache();
    let prefill = r.forward(&mut cache, &g.prompt, &mut NoObserver).unwrap();
    let second = r.forward(&mut cache, &g.second_chunk, &mut NoObserver).unwrap();
    let (e1, e2) = (max_rel_err(&prefill, &g.logits), max_rel_err(&second, &g.second_chunk_logits));
    println!("{name} reference: prefill {e1:.2e}, second chunk {e2:.2e}");
    assert!(e1 < TOLERANCE && e2 < TOLERANCE, "{name}: {e1} {e2}");
    assert_eq!(r.generate(&g.prompt, g.greedy_new_tokens.len()).unwrap(), g.greedy_new_tokens, "{name}");
}

/// The pipeline's prefill and second chunk at every hot fraction, in sub-batches of each of
/// `batches` tokens (a short one makes the prompt cross sub-batch boundaries).
pub fn check_pipeline_prefill(name: &str, batches: &[usize]) {
    let (model, g) = open(name);
    for hot in HOT_FRACTIONS {
        for &batch in batches {
            let mut p = pipeline(&model, hot, batch);
            let mut cache = p.new_cache();
            let prefill = p.forward(&mut cache, &g.prompt, Phase::Prefill).unwrap();
            let second = p.forward(&mut cache, &g.second_chunk, Phase::Prefill).unwrap();
            let (e1, e2) = (max_rel_err(&prefill, &g.logits), max_rel_err(&second, &g.second_chunk_logits));
            println!("{name} pipeline hot {hot} batch {batch}: prefill {e1:.2e}, second chunk {e2:.2e}");
            assert!(e1 < TOLERANCE && e2 < TOLERANCE, "{name} hot {hot} batch {batch}: {e1} {e2}");
        }
    }
}

/// The pipeline decoding the first `n` prompt tokens one at a time gives their prefill logits.
pub fn check_pipeline_decode(name: &str, hot_fractions: &[f64], n: usize) {
    let (model, g) = open(name);
    let n = n.min(g.prompt.len());
    for &hot in hot_fractions {
        let mut p = pipeline(&model, hot, 512);
        let mut cache = p.new_cache();
        let mut stepped = Vec::new();
        for &t in &g.prompt[..n] {
            stepped.extend(p.forward(&mut cache, &[t], Phase::Decode).unwrap());
        }
        let err = max_rel_err(&stepped, &g.logits[..n]);
        println!("{name} pipeline hot {hot}: decode {err:.2e}");
        assert!(err < TOLERANCE, "{name} hot {hot}: {err}");
    }
}

/// The pipeline's greedy continuation is transformers'.
pub fn check_pipeline_greedy(name: &str, hot_fractions: &[f64]) {
    let (model, g) = open(name);
    for &hot in hot_fractions {
        let got = pipeline(&model, hot, 512).generate(&g.prompt, g.greedy_new_tokens.len()).unwrap();
        assert_eq!(got, g.greedy_new_tokens, "{name} hot {hot}");
    }
}

/// The GPU engine on `model` with `hot_fraction` of each MoE layer's experts cached.
pub fn gpu_engine(model: &Arc<Model>, hot_fraction: f64) -> Box<dyn moe_lanes::engine::Engine + '_> {
    gpu_engine_kv(model, hot_fraction, None)
}

/// [`gpu_engine`] with a KV cache of type `kv` (`None`: the engine's default).
pub fn gpu_engine_kv(
    model: &Arc<Model>,
    hot_fraction: f64,
    kv: Option<moe_lanes::model::context::KvType>,
) -> Box<dyn moe_lanes::engine::Engine + '_> {
    use moe_lanes::engine::{build_engine, EngineKind, EngineOptions, HotChoice};
    let mut opts = EngineOptions::new(128);
    opts.kv_type = kv;
    opts.cuda = moe_lanes::env::cuda_config().unwrap();
    opts.kind = Some(EngineKind::Gpu);
    opts.hot = HotChoice::Set(hot_set(model, hot_fraction));
    opts.cold_threads = moe_lanes::threads::ColdThreads::Fixed(2);
    let (engine, report) = build_engine(model, opts).unwrap();
    assert_eq!(report.kind, EngineKind::Gpu);
    engine
}

/// The GPU engine against transformers at each hot fraction: the prompt's and the second
/// chunk's logits within [`GPU_TOLERANCE`], then the prompt's greedy continuation one decode
/// call a token (the decode graphs), identical. Skipped without a usable GPU.
pub fn check_gpu(name: &str, hot_fractions: &[f64]) {
    check_gpu_within(name, hot_fractions, GPU_TOLERANCE);
}

/// [`check_gpu`] within `tolerance`.
pub fn check_gpu_within(name: &str, hot_fractions: &[f64], tolerance: f32) {
    check_gpu_within_kv(name, hot_fractions, tolerance, None);
}

/// [`check_gpu_within`] with a KV cache of type `kv` (`None`: the engine's default).
pub fn check_gpu_within_kv(
    name: &str,
    hot_fractions: &[f64],
    tolerance: f32,
    kv: Option<moe_lanes::model::context::KvType>,
) {
    if !crate::common::gpu_usable() {
        return;
    }
    let (model, g) = open(name);
    for &hot in hot_fractions {
        let mut engine = gpu_engine_kv(&model, hot, kv);
        let mut cache = engine.new_cache(128).unwrap();
        let prefill = engine.forward(&g.prompt, Phase::Prefill, &mut cache).unwrap().rows();
        let second = engine.forward(&g.second_chunk, Phase::Prefill, &mut cache).unwrap().rows();
        let (e1, e2) = (max_rel_err(&prefill, &g.logits), max_rel_err(&second, &g.second_chunk_logits));
        println!("{name} gpu hot {hot} kv {kv:?}: prefill {e1:.2e}, second chunk {e2:.2e}");
        assert!(e1 < tolerance && e2 < tolerance, "{name} hot {hot}: {e1} {e2}");
        let mut cache = engine.new_cache(128).unwrap();
        let mut next = *engine.forward(&g.prompt, Phase::Prefill, &mut cache).unwrap().argmax.last().unwrap();
        let mut got = Vec::new();
        for _ in 0..g.greedy_new_tokens.len() {
            got.push(next);
            next = engine.forward(&[next], Phase::Decode, &mut cache).unwrap().argmax[0];
        }
        assert_eq!(got, g.greedy_new_tokens, "{name} gpu hot {hot}");
    }
}
