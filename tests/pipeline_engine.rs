//! Pipeline engine behaviour: phase edge cases, fallbacks with reasons, Updater exchanges
//! between calls, perf state.

#[path = "pipeline_common/mod.rs"]
mod common;

use common::*;
use moe_lanes::actors::messages::{LaneBuffer, LayerInput};
use moe_lanes::actors::{Exchange, HotLane, LaneError, LaneId};
use moe_lanes::hot_set::HotSet;
use moe_lanes::perf::{FallbackReason, PerfMode, PerfReport};
use moe_lanes::phase::{MergeKind, Phase};
use moe_lanes::pipeline::{FaultInjection, Pipeline, PipelineOptions};
use moe_lanes::worklist::WorklistOrder;
use std::ops::Range;

fn half_hot(model: &moe_lanes::model::Model, n_lanes: usize) -> HotSet {
    let c = model.config();
    HotSet::from_fraction(c.n_layers, c.n_experts, n_lanes, 0.5, None).unwrap()
}

#[test]
fn a_512_plus_1_prompt_keeps_its_tail_in_prefill() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = TinySpec::simple(0);
    spec.n_layers = 1;
    spec.hidden = 16;
    let model = write_tiny(dir.path(), &spec);
    let opts =
        PipelineOptions { hot_set: Some(half_hot(&model, 1)), n_cold_workers: 2, ..Default::default() };
    let mut p = Pipeline::new(model.clone(), opts).unwrap();
    let toks = tokens(3, 513, model.config().vocab);
    let mut cache = p.new_cache();
    let got = p.forward(&mut cache, &toks, Phase::Prefill).unwrap();
    let plans = p.last_plans().to_vec();
    assert_eq!(plans.len(), 2, "512 + 1");
    assert!(plans.iter().all(|pl| pl.phase == Phase::Prefill));
    assert_eq!(plans[1].order, WorklistOrder::ExpertMajor, "the one-token tail keeps the prefill plan");
    assert!(!plans[1].cpu_routing);
    let want = reference_logits(&model, &[&toks]);
    assert!(rel_diff(&got, &want) <= 1e-4);
}

#[test]
fn a_multi_token_verify_batch_during_generation_is_decode() {
    let dir = tempfile::tempdir().unwrap();
    let model = write_tiny(dir.path(), &TinySpec::simple(1));
    let mut p = Pipeline::new(
        model.clone(),
        PipelineOptions { hot_set: Some(half_hot(&model, 2)), ..Default::default() },
    )
    .unwrap();
    let toks = tokens(5, 9, model.config().vocab);
    let mut cache = p.new_cache();
    let mut got = p.forward(&mut cache, &toks[..5], Phase::Prefill).unwrap();
    got.extend(p.forward(&mut cache, &toks[5..], Phase::Decode).unwrap());
    let plan = p.last_plans()[0];
    assert_eq!(plan.phase, Phase::Decode);
    assert_eq!(plan.order, WorklistOrder::TokenMajor);
    assert_eq!(plan.merge, MergeKind::SlotRows, "direct merge is for one-token decode only");
    got.extend(p.forward(&mut cache, &toks[..1], Phase::Decode).unwrap());
    assert_eq!(p.last_plans()[0].merge, MergeKind::Direct);
    let want = reference_logits(&model, &[&toks[..5], &toks[5..], &toks[..1]]);
    assert!(rel_diff(&got, &want) <= 1e-4);
}

#[test]
fn warmup_plans_are_conservative() {
    let dir = tempfile::tempdir().unwrap();
    let model = write_tiny(dir.path(), &TinySpec::simple(2));
    let mut p = Pipeline::new(model.clone(), PipelineOptions::default()).unwrap();
    let toks = tokens(9, 40, model.config().vocab);
    let mut cache = p.new_cache();
    let got = p.forward(&mut cache, &toks, Phase::Warmup).unwrap();
    let plan = p.last_plans()[0];
    assert_eq!(plan.order, WorklistOrder::TokenMajor);
    assert_eq!(plan.merge, MergeKind::SlotRows);
    assert!(!plan.compact_cold_reduce && !plan.dense_pp);
    assert!(rel_diff(&got, &reference_logits(&model, &[&toks])) <= 1e-4);
}

/// A hot lane that always fails (or panics).
struct BrokenLane {
    panic: bool,
}

impl HotLane for BrokenLane {
    fn run(
        &mut self,
        _: usize,
        _: &LayerInput,
        _: Range<usize>,
        _: bool,
        _: &mut LaneBuffer,
    ) -> Result<(), LaneError> {
        if self.panic {
            panic!("injected hot lane panic");
        }
        Err(LaneError::Failed { lane: LaneId::Hot(0), reason: "injected failure".into() })
    }
    fn load_slot(&mut self, _: usize, _: u32, _: usize) -> Result<(), LaneError> {
        Ok(())
    }
}

#[test]
fn a_failing_hot_lane_falls_back_all_cold_with_a_reason() {
    for panic in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let model = write_tiny(dir.path(), &TinySpec::simple(3));
        let hot = HotSet::from_fraction(2, 8, 1, 1.0, None).unwrap();
        let opts = PipelineOptions { hot_set: Some(hot), ..Default::default() };
        let mut p =
            Pipeline::with_hot_lanes(model.clone(), opts, vec![Box::new(BrokenLane { panic })]).unwrap();
        let toks = tokens(11, 6, model.config().vocab);
        let mut cache = p.new_cache();
        let mut got = p.forward(&mut cache, &toks[..5], Phase::Prefill).unwrap();
        got.extend(p.forward(&mut cache, &toks[5..], Phase::Decode).unwrap());
        assert!(rel_diff(&got, &reference_logits(&model, &[&toks[..5], &toks[5..]])) <= 1e-4);
        // Every layer of both calls fell back, counted as lane_failed.
        assert_eq!(p.perf().fallbacks(FallbackReason::LaneFailed), 4, "panic = {panic}");
        let layer = &p.perf().report().layers[0];
        assert_eq!(layer.parallel_fallbacks, 2);
        assert_eq!(layer.fallback_reasons["lane_failed"], 2);
        // the latest fallback's own words
        let last = layer.last_fallback.as_deref().unwrap();
        let said = if panic { "Hot(0) panicked: injected hot lane panic" } else { "injected failure" };
        assert!(last.starts_with("lane_failed: ") && last.contains(said), "{last}");
    }
}

#[test]
fn a_corrupted_worklist_falls_back_all_cold_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let model = write_tiny(dir.path(), &TinySpec::simple(0));
    let opts = PipelineOptions {
        hot_set: Some(half_hot(&model, 1)),
        fault: FaultInjection { corrupt_worklist_layer: Some(1), ..Default::default() },
        ..Default::default()
    };
    let mut p = Pipeline::new(model.clone(), opts).unwrap();
    let toks = tokens(13, 12, model.config().vocab);
    let mut cache = p.new_cache();
    let got = p.forward(&mut cache, &toks, Phase::Prefill).unwrap();
    assert!(rel_diff(&got, &reference_logits(&model, &[&toks])) <= 1e-4);
    let report = p.perf().report();
    assert_eq!(report.layers[1].fallback_reasons["worklist"], 1);
    assert!(report.layers[1].last_fallback.as_deref().unwrap().starts_with("worklist: "));
    assert_eq!(report.layers[0].parallel_fallbacks, 0);
    assert_eq!(report.layers[0].last_fallback, None);
    assert_eq!(report.layers[0].parallel_launches, 1);
}

#[test]
fn updater_exchanges_apply_between_calls_and_keep_the_output() {
    let dir = tempfile::tempdir().unwrap();
    let model = write_tiny(dir.path(), &TinySpec::simple(1));
    let hot = HotSet::from_fraction(2, 8, 1, 0.5, None).unwrap(); // experts 0..4 hot
    let mut p =
        Pipeline::new(model.clone(), PipelineOptions { hot_set: Some(hot), ..Default::default() }).unwrap();
    let toks = tokens(17, 10, model.config().vocab);
    let want = reference_logits(&model, &[&toks]);
    let mut cache = p.new_cache();
    let before = p.forward(&mut cache, &toks, Phase::Prefill).unwrap();
    for l in 0..2 {
        for (evict, add) in [(0, 7), (1, 6), (2, 5), (3, 4)] {
            p.updater().request(Exchange { layer_idx: l, evict, add }).unwrap();
        }
    }
    // Queued, not applied: nothing changes until the next call starts.
    assert_eq!(p.updater().n_pending(), 8);
    assert!(p.hot_set().layers[0].is_hot(0));
    let mut cache = p.new_cache();
    let after = p.forward(&mut cache, &toks, Phase::Prefill).unwrap();
    assert_eq!(p.updater().n_pending(), 0);
    for l in 0..2 {
        let layer = &p.hot_set().layers[l];
        assert!((0..4).all(|e| !layer.is_hot(e)) && (4..8).all(|e| layer.is_hot(e)));
        assert_eq!(layer.hot_id_map[7].unwrap().slot_idx, 0, "expert 7 took expert 0's slot");
    }
    assert_eq!(p.perf().report().updates, 8);
    assert!(rel_diff(&before, &want) <= 1e-4);
    assert!(rel_diff(&after, &want) <= 1e-4);
    // The hot lane really serves the new experts: hot counts moved to 4..8.
    let l0 = &p.perf().report().layers[0];
    let hot_new: u64 = l0.hot_experts[4..].iter().sum();
    assert!(hot_new > 0);
    // A bad exchange is refused and changes nothing.
    p.updater().request(Exchange { layer_idx: 0, evict: 0, add: 1 }).unwrap();
    assert!(p.forward(&mut p.new_cache(), &toks, Phase::Prefill).is_err());
    assert!(p.hot_set().layers[0].is_hot(7));
}

#[test]
fn perf_state_counts_slots_and_renders_json() {
    let dir = tempfile::tempdir().unwrap();
    let model = write_tiny(dir.path(), &TinySpec::simple(0));
    let k = model.config().n_experts_used as u64;
    for mode in [PerfMode::Full, PerfMode::Update, PerfMode::Off] {
        let opts =
            PipelineOptions { hot_set: Some(half_hot(&model, 2)), perf_mode: mode, ..Default::default() };
        let mut p = Pipeline::new(model.clone(), opts).unwrap();
        let toks = tokens(19, 7, model.config().vocab);
        p.forward(&mut p.new_cache(), &toks, Phase::Prefill).unwrap();
        let report = PerfReport::parse(std::path::Path::new("live"), &p.perf().to_json(), Some(8)).unwrap();
        let l = &report.layers[0];
        match mode {
            PerfMode::Off => assert_eq!(l.expert_hits_total, 0),
            _ => {
                assert_eq!(l.expert_hits_total, 7 * k);
                assert_eq!(l.hot_slots_total + l.cold_slots_total, 7 * k);
                assert_eq!(l.experts.iter().sum::<u64>(), 7 * k);
                assert_eq!(l.calls, 1);
                assert_eq!(l.parallel_launches, u64::from(mode == PerfMode::Full));
                if mode == PerfMode::Full {
                    let last = p.perf().last_call(0);
                    assert!(last.wall_us >= last.join_wait_us);
                    assert!(last.overlap_us <= last.hot_us.min(last.cold_us));
                }
            }
        }
    }
}

/// The dense stage reads every matrix in place (only norm weights and biases are copied), its
/// thread count changes no bit, and `forward_rows(Last)` is the last row of `forward`.
#[test]
fn dense_stage_reads_weights_in_place_and_threads_change_no_bit() {
    use moe_lanes::format::dtype::DType;
    use moe_lanes::pipeline::LogitRows;
    for (adapter_idx, dtype, tied) in
        [(0, DType::BF16, false), (1, DType::F16, true), (2, DType::F32, false), (3, DType::BF16, false)]
    {
        let dir = tempfile::tempdir().unwrap();
        let spec = TinySpec { dtype, tied, ..TinySpec::simple(adapter_idx) };
        let model = write_tiny(dir.path(), &spec);
        let c = model.config().clone();
        let toks = tokens(21, 9, c.vocab);
        let mut runs = Vec::new();
        for n_dense_threads in [1, 2, 3] {
            let opts = PipelineOptions { n_dense_threads, ..Default::default() };
            let mut p = Pipeline::new(model.clone(), opts).unwrap();
            assert_eq!(p.dense_threads(), n_dense_threads);
            let per_layer_vectors = 2 * c.hidden + 2 * c.q_dim() + 2 * c.kv_dim() + 2 * c.head_dim + c.hidden;
            assert!(
                p.weight_copy_bytes() <= 4 * (c.hidden + c.n_layers * per_layer_vectors),
                "{} bytes copied: more than the small vectors",
                p.weight_copy_bytes()
            );
            let mut cache = p.new_cache();
            let mut got = p.forward(&mut cache, &toks[..7], Phase::Prefill).unwrap();
            got.extend(p.forward(&mut cache, &toks[7..8], Phase::Decode).unwrap());
            let mut last_cache = p.new_cache();
            let last = p.forward_rows(&mut last_cache, &toks[..7], Phase::Prefill, LogitRows::Last).unwrap();
            assert_eq!(last, vec![got[6].clone()], "the lm_head of the last row only");
            runs.push(got);
        }
        assert!(rel_diff(&runs[0], &reference_logits(&model, &[&toks[..7], &toks[7..8]])) <= 1e-4);
        assert_eq!(runs[0], runs[1], "{dtype}: 2 dense threads changed the bits");
        assert_eq!(runs[0], runs[2], "{dtype}: 3 dense threads changed the bits");
    }
}

/// The cold lane on the dense stage's pool: any number of participants (part of the pool or all
/// of it) gives the same bits, within the reference's tolerance, and the count is what was asked
/// for, capped at the pool's threads.
#[test]
fn pool_cold_lane_thread_counts_change_no_bit() {
    let dir = tempfile::tempdir().unwrap();
    let model = write_tiny(dir.path(), &TinySpec::simple(0));
    let c = model.config().clone();
    let toks = tokens(5, 12, c.vocab);
    let mut runs = Vec::new();
    for (n_dense_threads, n_cold_workers, want_cold) in
        [(1, 1, 1), (3, 1, 1), (3, 2, 2), (3, 3, 3), (2, 5, 2)]
    {
        let opts = PipelineOptions { n_dense_threads, n_cold_workers, ..Default::default() };
        let mut p = Pipeline::new(model.clone(), opts).unwrap();
        assert!(p.pool_cold(), "the pool lane is the default with SIMD kernels");
        assert_eq!(p.cold_threads(), want_cold);
        let mut cache = p.new_cache();
        let mut got = p.forward(&mut cache, &toks[..9], Phase::Prefill).unwrap();
        for t in &toks[9..] {
            got.extend(p.forward(&mut cache, std::slice::from_ref(t), Phase::Decode).unwrap());
        }
        runs.push(got);
    }
    let chunks: Vec<&[u32]> = std::iter::once(&toks[..9]).chain(toks[9..].chunks(1)).collect();
    assert!(rel_diff(&runs[0], &reference_logits(&model, &chunks)) <= 1e-4);
    for run in &runs[1..] {
        assert_eq!(&runs[0], run, "the pool cold lane's thread count changed the bits");
    }
}
