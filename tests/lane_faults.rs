//! Seeded lane-fault schedules over long generations on the CPU pipeline (TigerBeetle's VOPR is
//! the model): for each seed, lane tasks fail, panic or stall past the join's timeout at places
//! the seed decides; the logits stay equal to the reference at every step, every injected fault
//! is counted with its reason, and nothing hangs. A failing seed is named in the message and
//! reproduces alone (the schedule depends on the seed and the place only, never on timing).

#[path = "pipeline_common/mod.rs"]
mod common;

use common::*;
use moe_lanes::actors::{InjectedFault, LaneFault, LaneFaultSchedule};
use moe_lanes::hot_set::HotSet;
use moe_lanes::perf::FallbackReason;
use moe_lanes::phase::Phase;
use moe_lanes::pipeline::{FaultInjection, Pipeline, PipelineOptions};
use std::collections::BTreeMap;
use std::time::Duration;

const SEEDS: std::ops::Range<u64> = 1..11;
const PROMPT_TOKENS: usize = 7;
const DECODE_STEPS: usize = 40;
/// Generous against a healthy lane on a loaded machine (a tiny layer takes microseconds), short
/// enough to keep the test quick.
const LANE_TIMEOUT: Duration = Duration::from_millis(100);
/// Well past the timeout even when the driver is descheduled before it starts waiting (the join's
/// clock starts when it waits, the stall's when the lane starts).
const STALL: Duration = Duration::from_millis(400);
/// The whole schedule of one seed must finish within this (a hang fails the test, not CI).
const DEADLINE: Duration = Duration::from_secs(240);

/// The chunks of one generation: a prompt, single-token decode steps, and every ninth step a
/// three-token verify batch (a different plan).
fn chunks(seed: u64, vocab: usize) -> Vec<Vec<u32>> {
    let toks = tokens(seed, PROMPT_TOKENS + 3 * DECODE_STEPS, vocab);
    let mut out = vec![toks[..PROMPT_TOKENS].to_vec()];
    let mut at = PROMPT_TOKENS;
    for step in 0..DECODE_STEPS {
        let n = if step % 9 == 8 { 3 } else { 1 };
        out.push(toks[at..at + n].to_vec());
        at += n;
    }
    out
}

/// The reason each faulted layer call must be counted under: a failed or panicked lane answers
/// at once (`lane_failed`, whatever else happened in the layer); a stall alone is a lane that
/// did not answer in time (`lane_unavailable`).
fn expected_reasons(log: &[InjectedFault]) -> BTreeMap<FallbackReason, u64> {
    let mut per_call: BTreeMap<(u64, usize), bool> = BTreeMap::new();
    for f in log {
        let failed = per_call.entry((f.call_idx, f.layer_idx)).or_insert(false);
        *failed |= f.fault != LaneFault::Stall;
    }
    let mut out = BTreeMap::new();
    for failed in per_call.values() {
        let reason = if *failed { FallbackReason::LaneFailed } else { FallbackReason::LaneUnavailable };
        *out.entry(reason).or_insert(0) += 1;
    }
    out
}

/// Run one seed; returns the injected faults by kind.
fn run_seed(seed: u64) -> BTreeMap<LaneFault, usize> {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = TinySpec::simple((seed % 4) as usize);
    spec.n_layers = 3;
    spec.seed = seed;
    let model = write_tiny(dir.path(), &spec);
    let c = model.config().clone();
    let schedule = LaneFaultSchedule { seed, per_mille: 100, stall: STALL };
    let opts = PipelineOptions {
        hot_set: Some(HotSet::from_fraction(c.n_layers, c.n_experts, 2, 0.5, None).unwrap()),
        n_cold_workers: 3,
        // Odd seeds: the cold lane on the dense pool (faults reach the driver's section); even
        // seeds: the lane actors' cold worker threads (faults reach every worker).
        pool_cold: seed % 2 == 1,
        fault: FaultInjection {
            lanes: Some(schedule),
            lane_timeout: Some(LANE_TIMEOUT),
            ..Default::default()
        },
        ..Default::default()
    };
    let mut p = Pipeline::new(model.clone(), opts).unwrap();
    let chunks = chunks(seed, c.vocab);
    let refs: Vec<&[u32]> = chunks.iter().map(Vec::as_slice).collect();
    let want = reference_logits(&model, &refs);
    let mut cache = p.new_cache();
    let mut got = Vec::new();
    for (i, chunk) in chunks.iter().enumerate() {
        let phase = if i == 0 { Phase::Prefill } else { Phase::Decode };
        got.extend(
            p.forward(&mut cache, chunk, phase).unwrap_or_else(|e| panic!("seed {seed}, call {i}: {e}")),
        );
        let d = rel_diff(&got, &want[..got.len()]);
        assert!(d <= 1e-4, "seed {seed}: logits differ from the reference after call {i} ({d})");
    }
    let (log, busy_refusals) = p.lane_fault_log();
    let want_reasons = expected_reasons(log);
    let perf = p.perf();
    let failed = want_reasons.get(&FallbackReason::LaneFailed).copied().unwrap_or(0);
    let stalled = want_reasons.get(&FallbackReason::LaneUnavailable).copied().unwrap_or(0);
    assert_eq!(perf.fallbacks(FallbackReason::LaneFailed), failed, "seed {seed}: lane_failed count");
    assert_eq!(
        perf.fallbacks(FallbackReason::LaneUnavailable),
        stalled + busy_refusals,
        "seed {seed}: lane_unavailable = layers with a stall + layers refused while a stalled lane held the input"
    );
    for reason in [FallbackReason::Worklist, FallbackReason::Shape, FallbackReason::GpuLost] {
        assert_eq!(perf.fallbacks(reason), 0, "seed {seed}: no {reason:?} fallback was injected");
    }
    let mut kinds = BTreeMap::new();
    for f in log {
        *kinds.entry(f.fault).or_insert(0) += 1;
    }
    kinds
}

#[test]
fn seeded_lane_faults_over_long_generations_keep_the_output_exact_and_counted() {
    // The injected panics are expected: keep them out of the test output, report any other.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !info.to_string().contains("injected lane panic") {
            default_hook(info);
        }
    }));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut total: BTreeMap<LaneFault, usize> = BTreeMap::new();
        for seed in SEEDS {
            let kinds = run_seed(seed);
            assert!(!kinds.is_empty(), "seed {seed}: the schedule injected nothing");
            for (k, n) in kinds {
                *total.entry(k).or_insert(0) += n;
            }
        }
        tx.send(total).unwrap();
    });
    let total = rx.recv_timeout(DEADLINE).expect("the fault schedule finished (no hang, no failing seed)");
    for kind in [LaneFault::Error, LaneFault::Panic, LaneFault::Stall] {
        assert!(total.get(&kind).copied().unwrap_or(0) > 0, "{kind:?} was injected at least once: {total:?}");
    }
    println!("lane faults injected over {} seeds: {total:?}", SEEDS.end - SEEDS.start);
}
