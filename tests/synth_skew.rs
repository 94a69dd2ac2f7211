//! The routing skew built into synthetic weights, measured on real forward passes.

mod common;

use common::*;
use moe_lanes::inspect::measure_expert_counts;
use moe_lanes::model::Model;
use moe_lanes::synth::{simulated_top_half_coverage, write_synthetic, Skew, SynthFormat};

fn coverage(arch: &str, skew: Skew, n_experts: usize, top_k: usize) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = synth_options(arch, SynthFormat::Gguf, dir.path().join("m.gguf"), 3);
    opts.skew = skew;
    opts.dims.n_experts = Some(n_experts);
    opts.dims.n_experts_used = Some(top_k);
    write_synthetic(&opts, &mut |_, _| {}).unwrap();
    let model = Model::open(&opts.out).unwrap();
    measure_expert_counts(&model, 1000).unwrap().top_half_coverage()
}

#[test]
fn skewed_routing_sends_85_to_95_percent_of_slots_to_the_top_half() {
    for (arch, n_experts, top_k) in
        [("qwen3_moe", 8, 2), ("olmoe", 16, 4), ("mixtral", 8, 2), ("qwen2_moe", 16, 2)]
    {
        let cov = coverage(arch, Skew::Skewed, n_experts, top_k);
        println!("{arch} {n_experts} experts top-{top_k}: measured top-half coverage {cov:.3}");
        assert!((0.85..=0.95).contains(&cov), "{arch}: coverage {cov}");
    }
}

#[test]
fn uniform_routing_spreads_slots() {
    let cov = coverage("qwen3_moe", Skew::Uniform, 8, 2);
    assert!(cov < 0.75, "uniform coverage {cov}");
}

#[test]
fn simulation_is_monotonic_in_the_exponent() {
    let low = simulated_top_half_coverage(128, 8, 0.2);
    let high = simulated_top_half_coverage(128, 8, 1.0);
    assert!(low < high && high <= 1.0, "{low} {high}");
}

/// `locality:`: every layer routes a token to its topic's experts, so the routing process's
/// re-picks of a recent topic are re-picks of the experts recent tokens used (measured on real
/// forward passes of the CPU pipeline, one token per call).
#[test]
fn locality_routing_follows_the_topics_so_experts_are_repicked() {
    use moe_lanes::engine::{build_engine, EngineKind, EngineOptions};
    use moe_lanes::locality::{LocalityParams, LocalityProcess};
    use moe_lanes::phase::Phase;
    use moe_lanes::synth::domain_of_token;
    use std::collections::{BTreeMap, BTreeSet};
    let dir = tempfile::tempdir().unwrap();
    let params = LocalityParams { p: 0.8, drift: 0.01, topics: 8, window: 8 };
    let mut opts = synth_options("qwen3_moe", SynthFormat::Gguf, dir.path().join("l.gguf"), 3);
    opts.skew = Skew::Locality(params);
    opts.dims.n_experts = Some(32);
    opts.dims.n_experts_used = Some(4);
    write_synthetic(&opts, &mut |_, _| {}).unwrap();
    let model = std::sync::Arc::new(Model::open(&opts.out).unwrap());
    let (vocab, n_layers) = (model.config().vocab, model.config().n_layers);
    let mut eo = EngineOptions::new(model.config().max_positions);
    eo.kind = Some(EngineKind::Pipeline);
    eo.cold_threads = moe_lanes::threads::ColdThreads::Fixed(1);
    let mut engine = build_engine(&model, eo).unwrap().0;
    let n = 300;
    let tokens = LocalityProcess::new(params, 5).tokens(vocab, n);
    let mut cache = engine.new_cache(n).unwrap();
    // routed[l][i]: the experts layer l routed token i to
    let mut routed = vec![Vec::new(); n_layers];
    for (i, &t) in tokens.iter().enumerate() {
        let count = |e: &dyn moe_lanes::engine::Engine| {
            let r = e.perf().unwrap().report();
            r.layers
                .iter()
                .map(|l| l.hot_experts.iter().zip(&l.cold_experts).map(|(h, c)| h + c).collect::<Vec<u64>>())
                .collect::<Vec<_>>()
        };
        let before = count(engine.as_ref());
        let phase = if i == 0 { Phase::Prefill } else { Phase::Decode };
        engine.forward(&[t], phase, &mut cache).unwrap();
        let after = count(engine.as_ref());
        for l in 0..n_layers {
            let set: BTreeSet<usize> = (0..after[l].len()).filter(|&e| after[l][e] > before[l][e]).collect();
            routed[l].push(set);
        }
    }
    let topic: Vec<usize> = tokens.iter().map(|&t| domain_of_token(t, vocab, params.topics)).collect();
    for (l, sets) in routed.iter().enumerate() {
        // the topic's most common set, and how many of its tokens route to exactly it
        let mut by_topic: BTreeMap<usize, BTreeMap<&BTreeSet<usize>, usize>> = BTreeMap::new();
        for (s, &g) in sets.iter().zip(&topic) {
            *by_topic.entry(g).or_default().entry(s).or_default() += 1;
        }
        let modal: usize = by_topic.values().map(|m| m.values().max().copied().unwrap_or(0)).sum();
        assert!(modal as f64 >= 0.9 * n as f64, "layer {l}: only {modal} of {n} tokens route as their topic");
        // expert re-picks: every expert of the token was used by one of the previous 8 tokens
        let repick = |i: usize, v: &[BTreeSet<usize>]| {
            let recent: BTreeSet<usize> = v[i.saturating_sub(8)..i].iter().flatten().copied().collect();
            v[i].iter().all(|e| recent.contains(e))
        };
        let experts = (1..n).filter(|&i| repick(i, sets)).count() as f64 / (n - 1) as f64;
        let topics = (1..n).filter(|&i| topic[i.saturating_sub(8)..i].contains(&topic[i])).count() as f64
            / (n - 1) as f64;
        assert!(topics >= params.p - 0.05, "the process re-picks: {topics}");
        assert!(experts >= topics - 0.1, "layer {l}: experts re-picked {experts:.3}, topics {topics:.3}");
    }
}
