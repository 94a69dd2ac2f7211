//! Host time of one hot-cache policy step per layer (issue 47: the online policies step every
//! layer of every decode token on the decode thread, so this is paid per layer per token).
//! Shape: 128 experts, top-8 (Qwen3-30B-A3B), caches of 32 and 64 experts (25% and 50%), on a
//! routing with short-term locality (each slot re-picks one of the last step's experts with
//! probability 0.8, else draws from a popular half).
//!
//! `cargo bench --bench policy_step`; criterion prints the time of one step per policy and cache.

use criterion::{black_box, Criterion};
use moe_lanes::cache::policy::{LayerPolicy, PolicyConfig, PolicyKind};

const N_EXPERTS: usize = 128;
const TOP_K: usize = 8;
/// Steps in the cycled trace (long enough that the policy's tables see a varied stream).
const TRACE_STEPS: usize = 4096;

/// Distinct experts of each step: each slot re-picks one of the last step's experts with
/// probability `p`, else draws from the first half (the popular set) or, one in four, anywhere.
fn locality_trace(p: f64, seed: u64) -> Vec<Vec<usize>> {
    let mut state = seed;
    let mut next = move |n: u64| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    let mut steps: Vec<Vec<usize>> = Vec::with_capacity(TRACE_STEPS);
    for _ in 0..TRACE_STEPS {
        let mut step: Vec<usize> = Vec::with_capacity(TOP_K);
        while step.len() < TOP_K {
            let last = steps.last();
            let e = match last {
                Some(l) if (next(1000) as f64) < p * 1000.0 => l[next(l.len() as u64) as usize],
                _ if next(4) == 0 => next(N_EXPERTS as u64) as usize,
                _ => next(N_EXPERTS as u64 / 2) as usize,
            };
            if !step.contains(&e) {
                step.push(e);
            }
        }
        steps.push(step);
    }
    steps
}

fn main() {
    let trace = locality_trace(0.8, 7);
    let ranking: Vec<usize> = (0..N_EXPERTS).collect();
    let mut c = Criterion::default().configure_from_args();
    for kind in [PolicyKind::Lru, PolicyKind::TinyLfu, PolicyKind::Adaptive, PolicyKind::Reuse] {
        for capacity in [32, 64] {
            let resident: Vec<usize> = (0..capacity).collect();
            let mut policy = LayerPolicy::new(PolicyConfig::of(kind), N_EXPERTS, &resident, &ranking);
            // warm the tables over the whole trace once
            trace.iter().for_each(|s| drop(policy.step(s)));
            let mut i = 0;
            c.bench_function(&format!("policy_step/{}/{capacity}", kind.name()), |b| {
                b.iter(|| {
                    i = (i + 1) % trace.len();
                    black_box(policy.step(black_box(&trace[i])))
                })
            });
        }
    }
    c.final_summary();
}
