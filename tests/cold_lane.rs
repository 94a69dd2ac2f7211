//! The SIMD pool cold lane (the one both engines use) equals the plain CPU cold lane on random
//! slots (expert ids repeated across rows, rows with several experts, empty calls), for every
//! adapter.

mod common;

use common::*;
use moe_lanes::model::Model;
use moe_lanes::moe::cold::{ColdLane, ColdSlot, PlainColdLane};
use moe_lanes::moe::pool_lane::PoolColdLane;
use moe_lanes::synth::SynthFormat;

fn random_slots(seed: u64, n_rows: usize, n_experts: usize, k: usize) -> Vec<ColdSlot> {
    let mut state = seed | 1;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut slots = Vec::new();
    for row_idx in 0..n_rows {
        for j in 0..k {
            let expert_idx = (next() as usize + j) % n_experts;
            let weight = (next() % 1000) as f32 / 1000.0;
            slots.push(ColdSlot { row_idx, expert_idx, weight });
        }
    }
    slots
}

#[test]
fn pool_cold_lane_equals_plain_cold_lane() {
    let dir = tempfile::tempdir().unwrap();
    for arch in ARCHS {
        let model =
            std::sync::Arc::new(Model::open(&synth_tiny(dir.path(), arch, SynthFormat::Gguf, 4)).unwrap());
        let c = model.config().clone();
        let mut plain = PlainColdLane::new(model.clone());
        let mut pool =
            PoolColdLane::new(model.clone(), 3, None, moe_lanes_kernels::pool::ColdSchedule::Auto).unwrap();
        for (call_idx, n_rows) in [1usize, 5, 17, 1, 0].into_iter().enumerate() {
            let hidden: Vec<f32> =
                (0..n_rows * c.hidden).map(|i| ((i * 7919 + call_idx) % 97) as f32 / 48.0 - 1.0).collect();
            let slots = random_slots(call_idx as u64 + 3, n_rows, c.n_experts, c.n_experts_used);
            let layer_idx = call_idx % c.n_layers;
            let (mut a, mut b) = (vec![0.0; hidden.len()], vec![0.0; hidden.len()]);
            plain.compute(layer_idx, &hidden, &slots, &mut a).unwrap();
            pool.compute(layer_idx, &hidden, &slots, &mut b).unwrap();
            if n_rows > 0 {
                let err = max_rel_err(&[b.clone()], &[a.clone()]);
                // BF16 weights with f32 activations; avx512bf16 rounds activations to bf16.
                assert!(err < 1e-2, "{arch} call {call_idx}: {err}");
            }
        }
        assert!(pool.lane.slots_computed > 0);
        let counted: u64 = pool.lane.expert_counts.iter().flatten().sum();
        assert_eq!(counted, pool.lane.slots_computed, "every slot is counted for learn passes");
    }
}
