//! The cache planner: which experts go into the VRAM hot cache, given typed observations (a
//! learn file or live perf state, [`crate::cache::observe`]), a weighting
//! ([`crate::cache::weighting`]: `flat`, `pressure`, `smooth_pressure`, `time`, `balanced`, and
//! the layer curve), the exact bytes of one expert of each layer (a `_M` file's layers differ),
//! and a byte budget: the ranking is packed in order, each expert taken while its layer's bytes
//! still fit.
//!
//! Plans are exact: the sum of the chosen experts' bytes is at most `budget_bytes`, and a layer
//! never holds more slots than it has experts.

use crate::cache::observe::Observations;
pub use crate::cache::weighting::WeightMode;
use crate::cache::weighting::{rank, Weighting};
use serde::Serialize;

/// A planning request that cannot be satisfied.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error("expert usage has {found} layers, the model has {expected}")]
    LayerCount { expected: usize, found: usize },
    #[error("layer {layer_idx}: expert usage has {found} experts, the model has {expected}")]
    ExpertCount { layer_idx: usize, expected: usize, found: usize },
    #[error("expert size must be greater than zero")]
    ZeroExpertBytes,
    #[error("expert sizes are given for {found} layers, the model has {expected}")]
    ExpertBytesLayers { expected: usize, found: usize },
}

/// The experts chosen per layer, in the order they were picked (most valuable first).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HotPlan {
    pub layers: Vec<Vec<usize>>,
    /// Bytes of one expert of each layer.
    pub layer_expert_bytes: Vec<u64>,
    pub budget_bytes: u64,
}

impl HotPlan {
    pub fn n_slots(&self) -> usize {
        self.layers.iter().map(Vec::len).sum()
    }

    pub fn used_bytes(&self) -> u64 {
        self.layers.iter().zip(&self.layer_expert_bytes).map(|(ids, b)| ids.len() as u64 * b).sum()
    }

    /// Share of `counts`' routed slots that this plan would serve from the cache.
    pub fn expected_hit_rate(&self, counts: &[Vec<u64>]) -> f64 {
        let total: u64 = counts.iter().flatten().sum();
        let hot: u64 =
            self.layers.iter().zip(counts).map(|(ids, c)| ids.iter().map(|&e| c[e]).sum::<u64>()).sum();
        if total == 0 {
            0.0
        } else {
            hot as f64 / total as f64
        }
    }
}

/// Pack the most valuable experts (by `counts` alone, the mode's layer signal being absent),
/// `expert_bytes` each, into `budget_bytes`.
pub fn plan_hot_set(
    counts: &[Vec<u64>],
    n_layers: usize,
    n_experts: usize,
    expert_bytes: u64,
    budget_bytes: u64,
    mode: WeightMode,
) -> Result<HotPlan, PlanError> {
    let obs = Observations::from_counts(counts, 1);
    let w = Weighting { mode, ..Weighting::default() };
    plan_weighted(&obs, &w, n_layers, n_experts, &vec![expert_bytes; n_layers], budget_bytes)
}

/// Pack the ranking of `obs` under `weighting` into `budget_bytes`, an expert of layer `l`
/// costing `layer_expert_bytes[l]`: in ranking order, each expert whose bytes still fit (with one
/// size for every layer, the first `budget / size` of the ranking).
pub fn plan_weighted(
    obs: &Observations,
    weighting: &Weighting,
    n_layers: usize,
    n_experts: usize,
    layer_expert_bytes: &[u64],
    budget_bytes: u64,
) -> Result<HotPlan, PlanError> {
    if obs.layers.len() != n_layers {
        return Err(PlanError::LayerCount { expected: n_layers, found: obs.layers.len() });
    }
    if let Some((layer_idx, l)) = obs.layers.iter().enumerate().find(|(_, l)| l.experts.len() != n_experts) {
        return Err(PlanError::ExpertCount { layer_idx, expected: n_experts, found: l.experts.len() });
    }
    if layer_expert_bytes.len() != n_layers {
        let found = layer_expert_bytes.len();
        return Err(PlanError::ExpertBytesLayers { expected: n_layers, found });
    }
    // A layer of 0 bytes has no experts (a dense FFN layer) and is never filled.
    if layer_expert_bytes.iter().all(|&b| b == 0) {
        return Err(PlanError::ZeroExpertBytes);
    }
    let (mut layers, mut left) = (vec![Vec::new(); n_layers], budget_bytes);
    for c in rank(obs, weighting) {
        let bytes = layer_expert_bytes[c.layer_idx];
        if bytes > 0 && bytes <= left {
            left -= bytes;
            layers[c.layer_idx].push(c.expert_idx);
        }
    }
    Ok(HotPlan { layers, layer_expert_bytes: layer_expert_bytes.to_vec(), budget_bytes })
}

/// Hot sets from a fraction of each layer's experts: the `fraction` most used per layer (by
/// `counts` when given, else the lowest ids).
pub fn plan_fraction(
    counts: Option<&[Vec<u64>]>,
    n_layers: usize,
    n_experts: usize,
    fraction: f64,
) -> Vec<Vec<usize>> {
    let n_hot = ((fraction.clamp(0.0, 1.0) * n_experts as f64).round() as usize).min(n_experts);
    (0..n_layers)
        .map(|layer_idx| match counts {
            Some(c) => {
                let mut order: Vec<usize> = (0..n_experts).collect();
                order.sort_by(|&a, &b| c[layer_idx][b].cmp(&c[layer_idx][a]).then(a.cmp(&b)));
                order.truncate(n_hot);
                order
            }
            None => (0..n_hot).collect(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts() -> Vec<Vec<u64>> {
        vec![vec![50, 30, 15, 5], vec![10, 70, 10, 10], vec![25, 25, 25, 25]]
    }

    #[test]
    fn flat_spreads_the_budget_across_layers_first() {
        let plan = plan_hot_set(&counts(), 3, 4, 100, 350, WeightMode::Flat).unwrap();
        assert_eq!(plan.layers, vec![vec![0], vec![1], vec![0]]);
        assert_eq!(plan.used_bytes(), 300);
        let plan = plan_hot_set(&counts(), 3, 4, 100, 500, WeightMode::Flat).unwrap();
        assert_eq!(plan.n_slots(), 5);
        assert_eq!(plan.layers[0], vec![0, 1], "second rank: layer 0's 30% beats layer 2's 25%");
    }

    #[test]
    fn pressure_follows_shares_across_layers() {
        let plan = plan_hot_set(&counts(), 3, 4, 100, 300, WeightMode::Pressure).unwrap();
        assert_eq!(plan.layers, vec![vec![0, 1], vec![1], vec![]]);
        assert!((plan.expected_hit_rate(&counts()) - 150.0 / 300.0).abs() < 1e-9);
    }

    #[test]
    fn budget_never_exceeded_and_full_budget_takes_everything() {
        for budget in [0, 99, 100, 1150, 5000] {
            let plan = plan_hot_set(&counts(), 3, 4, 100, budget, WeightMode::Flat).unwrap();
            assert!(plan.used_bytes() <= budget);
            assert!(plan.layers.iter().all(|l| l.len() <= 4));
        }
        let all = plan_hot_set(&counts(), 3, 4, 100, 1200, WeightMode::Pressure).unwrap();
        assert_eq!(all.n_slots(), 12);
        assert!((all.expected_hit_rate(&counts()) - 1.0).abs() < 1e-12);
    }

    /// A `_M`-like model: layer 1's experts are larger. The whole budget of all experts takes
    /// every expert, and a budget between sizes fills up with the smaller layers' experts.
    #[test]
    fn layers_of_different_sizes_pack_their_own_bytes() {
        let obs = Observations::from_counts(&counts(), 1);
        let w = Weighting { mode: WeightMode::Flat, ..Weighting::default() };
        let sizes = [100, 140, 100];
        let all = plan_weighted(&obs, &w, 3, 4, &sizes, 4 * 340).unwrap();
        assert_eq!((all.n_slots(), all.used_bytes()), (12, 4 * 340));
        let some = plan_weighted(&obs, &w, 3, 4, &sizes, 330).unwrap();
        assert_eq!(some.layers, vec![vec![0], vec![1], vec![]], "100 + 140 + 100 > 330: layer 2 waits");
        assert!(some.used_bytes() <= 330);
        let err = plan_weighted(&obs, &w, 3, 4, &sizes[..2], 1).unwrap_err();
        assert_eq!(err, PlanError::ExpertBytesLayers { expected: 3, found: 2 });
    }

    #[test]
    fn mismatched_usage_is_refused() {
        assert_eq!(
            plan_hot_set(&counts(), 2, 4, 1, 1, WeightMode::Flat).unwrap_err(),
            PlanError::LayerCount { expected: 2, found: 3 }
        );
        assert!(matches!(
            plan_hot_set(&counts(), 3, 5, 1, 1, WeightMode::Flat),
            Err(PlanError::ExpertCount { layer_idx: 0, .. })
        ));
        assert_eq!(
            plan_hot_set(&counts(), 3, 4, 0, 1, WeightMode::Flat).unwrap_err(),
            PlanError::ZeroExpertBytes
        );
    }

    #[test]
    fn fraction_takes_most_used_or_lowest_ids() {
        assert_eq!(plan_fraction(Some(&counts()), 3, 4, 0.5), vec![vec![0, 1], vec![1, 0], vec![0, 1]]);
        assert_eq!(plan_fraction(None, 2, 4, 0.25), vec![vec![0], vec![0]]);
        assert_eq!(plan_fraction(None, 1, 4, 1.0), vec![vec![0, 1, 2, 3]]);
    }
}
