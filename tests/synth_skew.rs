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
