//! Property tests: the pipeline equals the reference (within 1e-4 relative) for random adapter
//! configs, hot sets (empty, full, in between), token counts 1..64, every phase, both worklist
//! orders, every policy switch, and one to three hot lanes.

#[path = "pipeline_common/mod.rs"]
mod common;

use common::*;
use moe_lanes::dtype::DType;
use moe_lanes::hot_set::HotSet;
use moe_lanes::phase::{Phase, PolicySwitches, Switch};
use moe_lanes::pipeline::{ColdKernels, Pipeline, PipelineOptions};
use moe_lanes::worklist::WorklistOrder;
use proptest::prelude::*;
use proptest::test_runner::{RngSeed, TestRunner};

#[derive(Debug, Clone)]
struct Case {
    spec: TinySpec,
    /// Per layer: 0 = none hot, 1 = all hot, else a random mask.
    hot_kind: u8,
    hot_mask_seed: u64,
    n_hot_lanes: usize,
    n_tokens: usize,
    /// Tokens after the first call, run one by one in Decode.
    n_decode: usize,
    phase: Phase,
    order: Option<WorklistOrder>,
    reduce_merge: Switch,
    compact_cold_reduce: Option<bool>,
    n_cold_workers: usize,
    driver_cold: bool,
    simd: bool,
    /// The cold lane on the dense stage's pool (in effect with `simd` and `driver_cold`).
    pool_cold: bool,
    max_batch_tokens: usize,
}

fn case() -> impl Strategy<Value = Case> {
    let spec = (
        0usize..4,
        any::<bool>(),
        0u64..1000,
        1usize..=2,
        prop_oneof![Just(16usize), Just(24), Just(32)],
        prop_oneof![Just((2usize, 1usize)), Just((4, 2)), Just((4, 4)), Just((3, 1))],
        prop_oneof![Just(4usize), Just(6), Just(8)],
        (4usize..=8, 1usize..=4),
        prop_oneof![Just(8usize), Just(12), Just(20)],
        any::<bool>(),
        prop_oneof![Just(DType::BF16), Just(DType::F16), Just(DType::F32)],
    )
        .prop_map(
            |(
                adapter_idx,
                gguf,
                seed,
                n_layers,
                hidden,
                (n_heads, n_kv_heads),
                head_dim,
                (n_experts, k),
                expert_ff,
                tied,
                dtype,
            )| TinySpec {
                adapter_idx,
                gguf,
                seed,
                n_layers,
                hidden,
                n_heads,
                n_kv_heads,
                head_dim,
                n_experts,
                k: k.min(n_experts),
                expert_ff,
                tied,
                dtype,
            },
        );
    (
        spec,
        0u8..3,
        any::<u64>(),
        1usize..=3,
        1usize..=64,
        0usize..3,
        prop_oneof![Just(Phase::Warmup), Just(Phase::Prefill), Just(Phase::Decode)],
        prop_oneof![
            Just(None),
            Just(Some(WorklistOrder::TokenMajor)),
            Just(Some(WorklistOrder::ExpertMajor))
        ],
        prop_oneof![Just(Switch::Off), Just(Switch::On), Just(Switch::Auto)],
        prop_oneof![Just(None), Just(Some(true)), Just(Some(false))],
        (1usize..=3, any::<bool>(), any::<bool>(), any::<bool>()),
        prop_oneof![Just(64usize), Just(7), Just(1)],
    )
        .prop_map(
            |(
                spec,
                hot_kind,
                hot_mask_seed,
                n_hot_lanes,
                n_tokens,
                n_decode,
                phase,
                order,
                reduce_merge,
                compact_cold_reduce,
                (n_cold_workers, driver_cold, simd, pool_cold),
                max_batch_tokens,
            )| Case {
                spec,
                hot_kind,
                hot_mask_seed,
                n_hot_lanes,
                n_tokens,
                n_decode,
                phase,
                order,
                reduce_merge,
                compact_cold_reduce,
                n_cold_workers,
                driver_cold,
                simd,
                pool_cold,
                max_batch_tokens,
            },
        )
}

fn run_case(case: &Case) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let model = write_tiny(dir.path(), &case.spec);
    let c = model.config().clone();
    let lists: Vec<Vec<usize>> = (0..c.n_layers)
        .map(|l| match case.hot_kind {
            0 => vec![],
            1 => (0..c.n_experts).collect(),
            _ => (0..c.n_experts).filter(|e| (case.hot_mask_seed >> ((l * 13 + e) % 64)) & 1 == 1).collect(),
        })
        .collect();
    let hot_set = HotSet::from_lists(c.n_layers, c.n_experts, case.n_hot_lanes, &lists);
    let options = PipelineOptions {
        hot_set: Some(hot_set),
        n_hot_lanes: case.n_hot_lanes,
        n_cold_workers: case.n_cold_workers,
        driver_cold: case.driver_cold,
        cold_kernels: if case.simd { ColdKernels::Simd } else { ColdKernels::Plain },
        pool_cold: case.pool_cold,
        switches: PolicySwitches {
            reduce_merge: case.reduce_merge,
            compact_cold_reduce: case.compact_cold_reduce,
            order: case.order,
            dense_pp: None,
        },
        max_batch_tokens: case.max_batch_tokens,
        ..PipelineOptions::default()
    };
    let mut pipeline = Pipeline::new(model.clone(), options).unwrap();
    prop_assert_eq!(pipeline.pool_cold(), case.pool_cold && case.simd && case.driver_cold);
    let all = tokens(case.spec.seed + 1, case.n_tokens + case.n_decode, c.vocab);
    let (first, rest) = all.split_at(case.n_tokens);
    let mut chunks: Vec<&[u32]> = vec![first];
    chunks.extend(rest.chunks(1));
    let mut cache = pipeline.new_cache();
    let mut got = pipeline.forward(&mut cache, first, case.phase).unwrap();
    prop_assert!(pipeline.last_plans().iter().all(|p| p.phase == case.phase));
    for t in rest {
        got.extend(pipeline.forward(&mut cache, std::slice::from_ref(t), Phase::Decode).unwrap());
    }
    let want = reference_logits(&model, &chunks);
    let diff = rel_diff(&got, &want);
    prop_assert!(diff <= 1e-4, "relative difference {diff} for {case:?}");
    prop_assert_eq!(pipeline.perf().report().layers.iter().map(|l| l.parallel_fallbacks).sum::<u64>(), 0);
    Ok(())
}

#[test]
fn pipeline_equals_reference_on_random_configs() {
    // MOE_LANES_PROP_CASES=N runs N cases from a random seed (for soak runs); the default is a
    // fixed seed and 24 cases so `cargo test` is fast and deterministic.
    let soak: Option<u32> = std::env::var("MOE_LANES_PROP_CASES").ok().and_then(|v| v.parse().ok());
    let config = ProptestConfig {
        cases: soak.unwrap_or(24),
        rng_seed: if soak.is_some() { RngSeed::Random } else { RngSeed::Fixed(0x5eed_1a4e) },
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let mut runner = TestRunner::new(config);
    runner.run(&case(), |c| run_case(&c)).unwrap();
}
