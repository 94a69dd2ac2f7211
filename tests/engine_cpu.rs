//! The one engine interface on the CPU: the reference and the pipeline built by `build_engine`
//! agree, caches are per engine kind, exchanges go through the trait, and the typed options
//! (engine names, fault specs, budgets) parse or fail with clear messages.

mod common;

use moe_lanes::actors::Exchange;
use moe_lanes::engine::{build_engine, EngineError, EngineKind, EngineOptions, HotBudget, HotChoice};
use moe_lanes::gpu::GpuFaults;
use moe_lanes::model::Model;
use moe_lanes::phase::Phase;
use moe_lanes::synth::SynthFormat;
use std::sync::Arc;

fn model(dir: &std::path::Path) -> Arc<Model> {
    Arc::new(Model::open(&common::synth_tiny(dir, "qwen3_moe", SynthFormat::Gguf, 7)).unwrap())
}

fn options(kind: EngineKind, hot: HotChoice) -> EngineOptions {
    let mut opts = EngineOptions::new(32);
    opts.kind = Some(kind);
    opts.hot = hot;
    opts.cold_threads = moe_lanes::threads::ColdThreads::Fixed(2);
    opts
}

#[test]
fn reference_and_pipeline_engines_agree_through_the_trait() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(dir.path());
    let prompt = [3u32, 17, 99, 5, 240];
    let (mut reference, r) = build_engine(&model, options(EngineKind::Reference, HotChoice::None)).unwrap();
    assert_eq!(r.kind, EngineKind::Reference);
    let want = reference.generate(&prompt, 6).unwrap();
    let half = HotChoice::Budget(HotBudget::Fraction(0.5));
    let (mut pipeline, report) = build_engine(&model, options(EngineKind::Pipeline, half)).unwrap();
    assert_eq!(report.kind, EngineKind::Pipeline);
    assert!(report.n_hot_experts > 0 && pipeline.hot_bytes() > 0);
    assert_eq!(pipeline.generate(&prompt, 6).unwrap(), want);
    let perf = pipeline.perf().unwrap().report();
    let k = model.config().n_experts_used as u64;
    assert_eq!(perf.layers[0].expert_hits_total, (prompt.len() as u64 + 5) * k);
    assert!(reference.perf().is_none());
}

#[test]
fn a_cache_of_another_engine_is_refused_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(dir.path());
    let (mut reference, _) = build_engine(&model, options(EngineKind::Reference, HotChoice::None)).unwrap();
    let (pipeline, _) = build_engine(&model, options(EngineKind::Pipeline, HotChoice::None)).unwrap();
    let mut foreign = pipeline.new_cache(8).unwrap();
    let err = reference.forward(&[1, 2], Phase::Prefill, &mut foreign).unwrap_err();
    assert!(matches!(
        err,
        EngineError::CacheKind { engine: EngineKind::Reference, cache: EngineKind::Pipeline }
    ));
    assert_eq!(foreign.n_positions(), 0);
    assert!(err.to_string().contains("pipeline KV cache was given to the reference engine"), "{err}");
    let refused = reference.request_exchange(Exchange { layer_idx: 0, evict: 0, add: 1 }).unwrap_err();
    assert!(matches!(refused, EngineError::NoHotCache { .. }));
}

#[test]
fn pipeline_exchanges_through_the_trait_keep_the_output() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(dir.path());
    let prompt = [11u32, 4, 77];
    let (mut reference, _) = build_engine(&model, options(EngineKind::Reference, HotChoice::None)).unwrap();
    let want = reference.generate(&prompt, 4).unwrap();
    let half = HotChoice::Budget(HotBudget::Fraction(0.5));
    let (mut engine, _) = build_engine(&model, options(EngineKind::Pipeline, half)).unwrap();
    let set = engine.hot_set().unwrap().clone();
    let evict = (0..set.n_experts).find(|&e| set.layers[0].is_hot(e)).unwrap();
    let add = (0..set.n_experts).find(|&e| !set.layers[0].is_hot(e)).unwrap();
    engine.request_exchange(Exchange { layer_idx: 0, evict, add }).unwrap();
    assert_eq!(engine.generate(&prompt, 4).unwrap(), want);
    let after = engine.hot_set().unwrap();
    assert!(after.layers[0].is_hot(add) && !after.layers[0].is_hot(evict));
    assert_eq!(engine.perf().unwrap().report().updates, 1);
}

#[test]
fn a_byte_budget_is_planned_from_a_learn_pass_without_a_learn_file() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(dir.path());
    let two_experts = 2 * model.expert_bytes() as u64;
    let mut opts = options(EngineKind::Pipeline, HotChoice::Budget(HotBudget::Bytes(two_experts)));
    opts.learn_tokens = 32;
    let (engine, report) = build_engine(&model, opts).unwrap();
    assert_eq!(report.hot_source, "built-in learn pass");
    assert_eq!(report.n_hot_experts, 2);
    assert_eq!(engine.hot_bytes(), two_experts);
    assert!(report.planned_hit_rate.unwrap() > 0.0);
}

#[test]
fn typed_options_parse_or_name_what_is_wrong() {
    assert_eq!("gpu".parse::<EngineKind>().unwrap(), EngineKind::Gpu);
    let err = "warp".parse::<EngineKind>().unwrap_err();
    assert_eq!(err.to_string(), "unknown engine 'warp' (available: reference, pipeline, gpu)");
    let f: GpuFaults = "hot_error:1, cold_panic:0,gpu_lost:3,postfetch_late:2".parse().unwrap();
    assert_eq!(f.postfetch_late_layer, Some(2));
    assert!(f.at(1, 2).postfetch_late && !f.at(1, 2).any(), "prefill only: decode keeps its path");
    assert_eq!(f.hot_error_layer, Some(1));
    assert_eq!(f.cold_panic_layer, Some(0));
    assert_eq!(f.gpu_lost_at_call, Some(3));
    assert_eq!(f.cold_error_layer, None);
    let bad = "hot_error:x".parse::<GpuFaults>().unwrap_err();
    assert!(bad.to_string().contains("'hot_error:x'"), "{bad}");
    assert!("meteor:1".parse::<GpuFaults>().is_err());
}

/// The oracle keeps f32 KV caches: f32 asked for builds, another type is refused with a message
/// that names the engine and the flags (never silently ignored); the pipeline builds with every
/// type whose blocks its heads hold.
#[test]
fn the_oracle_takes_only_an_f32_kv_cache_and_the_pipeline_every_type() {
    use moe_lanes::model::context::KvType;
    let dir = tempfile::tempdir().unwrap();
    let model = model(dir.path());
    let with = |kind, t| {
        let mut opts = options(kind, HotChoice::None);
        opts.kv_type = Some(t);
        build_engine(&model, opts)
    };
    assert_eq!(with(EngineKind::Reference, KvType::F32).unwrap().1.kind, EngineKind::Reference);
    let err = with(EngineKind::Reference, KvType::F16).err().expect("f16 refused");
    assert!(
        matches!(err, EngineError::KvType { engine: EngineKind::Reference, asked: KvType::F16 }),
        "{err}"
    );
    assert!(err.to_string().contains("--cache-type-k"), "{err}");
    let head_dim = model.config().head_dim;
    for t in KvType::ALL {
        match with(EngineKind::Pipeline, t) {
            Ok((_, report)) => assert_eq!(report.kind, EngineKind::Pipeline),
            Err(e) => assert!(!head_dim.is_multiple_of(t.block_len()), "{t}: {e}"),
        }
    }
}
