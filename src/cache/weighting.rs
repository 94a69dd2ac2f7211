//! Weighting: typed observations ([`crate::cache::observe`]) become one score per (layer,
//! expert) and a ranking the planner packs into a budget and the updater plans exchanges by.
//!
//! Notation, per layer `l` and expert `e`: `c[l][e]` the expert's routed slots (hot + cold, or
//! the raw count of a learn pass), `s[l][e] = c[l][e] / sum_e c[l][e]` its share of the layer
//! (0 for a layer with no slots). Each mode picks a *layer signal* `S[l]`, turned into a *layer
//! weight* with the layer curve `k` (`--layer-curve`, default [`DEFAULT_LAYER_CURVE`]):
//!
//! `W[l] = (max(S[l], mean(S) / 100) / mean(S)) ^ k`, and `W[l] = 1` when `mean(S) = 0` (no
//! timings recorded: every mode then ranks by usage alone). `k = 0` turns every layer weight off;
//! a larger `k` leans harder on the signal.
//!
//! | mode | layer signal `S[l]` | score | order |
//! |---|---|---|---|
//! | `flat` (default) | 1 (usage only) | `s[l][e]` | by rank inside the layer first (every layer's best expert, then every layer's second, ...), then score |
//! | `pressure` | `P[l]` = wait per cold slot (join wait / cold slots; else cold-lane time / cold slots; else MoE time / slots) | `s[l][e] * W[l]` | score |
//! | `smooth_pressure` | `sqrt(P[l] * median(P))`: pressure with outliers pulled toward the median (order kept) | `s[l][e] * W[l]` | score |
//! | `time` | MoE time per layer call | `s[l][e] * W[l]` | score |
//! | `balanced` | `P[l]` | `s[l][e] * W[l] / (1 + r[l][e])`, `r` the expert's rank inside its layer (0 = most used): a layer's deeper experts lose to other layers' first ones, a soft form of `flat`'s interleave on top of `pressure`, so the budget spreads over more layers | score |
//!
//! Ties break to the lower layer, then the lower expert id, so every ranking is deterministic.

use crate::cache::observe::Observations;
use serde::Serialize;

/// The layer curve of the default weighting.
pub const DEFAULT_LAYER_CURVE: f64 = 0.5;

/// How experts are ranked against each other across layers (formulas: module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum WeightMode {
    #[default]
    Flat,
    Pressure,
    SmoothPressure,
    Time,
    Balanced,
}

impl WeightMode {
    pub const ALL: [WeightMode; 5] = [
        WeightMode::Flat,
        WeightMode::Pressure,
        WeightMode::SmoothPressure,
        WeightMode::Time,
        WeightMode::Balanced,
    ];

    pub fn name(self) -> &'static str {
        match self {
            WeightMode::Flat => "flat",
            WeightMode::Pressure => "pressure",
            WeightMode::SmoothPressure => "smooth_pressure",
            WeightMode::Time => "time",
            WeightMode::Balanced => "balanced",
        }
    }
}

impl std::str::FromStr for WeightMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        WeightMode::ALL.into_iter().find(|m| m.name() == s).ok_or_else(|| {
            format!("unknown weighting '{s}' (expected flat, pressure, smooth_pressure, time or balanced)")
        })
    }
}

/// A weighting mode with its layer curve.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Weighting {
    pub mode: WeightMode,
    pub layer_curve: f64,
}

impl Default for Weighting {
    fn default() -> Self {
        Weighting { mode: WeightMode::Flat, layer_curve: DEFAULT_LAYER_CURVE }
    }
}

/// A layer curve that is not a finite number >= 0.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("layer curve {0}: expected a finite number >= 0")]
pub struct BadLayerCurve(pub f64);

impl Weighting {
    pub fn new(mode: WeightMode, layer_curve: f64) -> Result<Weighting, BadLayerCurve> {
        if !layer_curve.is_finite() || layer_curve < 0.0 {
            return Err(BadLayerCurve(layer_curve));
        }
        Ok(Weighting { mode, layer_curve })
    }
}

/// One scored (layer, expert).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scored {
    pub layer_idx: usize,
    pub expert_idx: usize,
    /// Rank inside its layer by count (0 = most used; ties to the lower id).
    pub rank: usize,
    pub score: f64,
}

/// The layer signal `S[l]` of `mode` (module docs).
pub fn layer_signals(obs: &Observations, mode: WeightMode) -> Vec<f64> {
    let pressure: Vec<f64> = obs.layers.iter().map(|l| l.wait_per_cold_slot_us).collect();
    match mode {
        WeightMode::Flat => vec![1.0; obs.layers.len()],
        WeightMode::Pressure | WeightMode::Balanced => pressure,
        WeightMode::SmoothPressure => {
            let mut sorted = pressure.clone();
            sorted.sort_by(f64::total_cmp);
            let median = if sorted.is_empty() {
                0.0
            } else if sorted.len() % 2 == 1 {
                sorted[sorted.len() / 2]
            } else {
                0.5 * (sorted[sorted.len() / 2 - 1] + sorted[sorted.len() / 2])
            };
            pressure.iter().map(|p| (p * median).sqrt()).collect()
        }
        WeightMode::Time => obs.layers.iter().map(|l| l.moe_time_per_call_us).collect(),
    }
}

/// `W[l]` from the signals and the curve.
pub fn layer_weights(signals: &[f64], layer_curve: f64) -> Vec<f64> {
    let n = signals.len().max(1) as f64;
    let mean = signals.iter().sum::<f64>() / n;
    if mean <= 0.0 || !mean.is_finite() {
        return vec![1.0; signals.len()];
    }
    signals.iter().map(|&s| (s.max(mean / 100.0) / mean).powf(layer_curve)).collect()
}

/// Every (layer, expert) with its score, in ranking order (most valuable first).
pub fn rank(obs: &Observations, w: &Weighting) -> Vec<Scored> {
    let weights = layer_weights(&layer_signals(obs, w.mode), w.layer_curve);
    let mut out = Vec::with_capacity(obs.layers.len() * obs.n_experts);
    for (layer_idx, layer) in obs.layers.iter().enumerate() {
        let counts: Vec<u64> = layer.experts.iter().map(|e| e.count()).collect();
        let total: u64 = counts.iter().sum();
        let mut order: Vec<usize> = (0..counts.len()).collect();
        order.sort_by(|&a, &b| counts[b].cmp(&counts[a]).then(a.cmp(&b)));
        for (rank, expert_idx) in order.into_iter().enumerate() {
            let share = if total == 0 { 0.0 } else { counts[expert_idx] as f64 / total as f64 };
            let score = match w.mode {
                WeightMode::Flat => share,
                WeightMode::Balanced => share * weights[layer_idx] / (1 + rank) as f64,
                _ => share * weights[layer_idx],
            };
            out.push(Scored { layer_idx, expert_idx, rank, score });
        }
    }
    let tie = |a: &Scored, b: &Scored| a.layer_idx.cmp(&b.layer_idx).then(a.expert_idx.cmp(&b.expert_idx));
    match w.mode {
        WeightMode::Flat => {
            out.sort_by(|a, b| a.rank.cmp(&b.rank).then(b.score.total_cmp(&a.score)).then(tie(a, b)))
        }
        _ => out.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.rank.cmp(&b.rank)).then(tie(a, b))),
    }
    out
}

/// Per layer, per expert scores (the updater compares a cold expert with the hot one it would
/// evict by these).
pub fn score_observations(obs: &Observations, w: &Weighting) -> Vec<Vec<f64>> {
    let mut scores = vec![vec![0.0; obs.n_experts]; obs.layers.len()];
    for s in rank(obs, w) {
        scores[s.layer_idx][s.expert_idx] = s.score;
    }
    scores
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::observe::{ExpertObservation, LayerObservation};

    /// Layers with counts and a (pressure, time) signal each.
    fn obs(layers: &[(&[u64], f64, f64)]) -> Observations {
        let n_experts = layers[0].0.len();
        Observations {
            n_experts,
            n_experts_used: 1,
            layers: layers
                .iter()
                .enumerate()
                .map(|(layer, &(c, pressure, time))| LayerObservation {
                    layer,
                    experts: c
                        .iter()
                        .enumerate()
                        .map(|(expert, &raw)| ExpertObservation { expert, raw, ..Default::default() })
                        .collect(),
                    wait_per_cold_slot_us: pressure,
                    moe_time_per_call_us: time,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    fn top(o: &Observations, mode: WeightMode, curve: f64, n: usize) -> Vec<(usize, usize)> {
        rank(o, &Weighting::new(mode, curve).unwrap())
            .iter()
            .take(n)
            .map(|s| (s.layer_idx, s.expert_idx))
            .collect()
    }

    fn per_layer(picks: &[(usize, usize)], n_layers: usize) -> Vec<usize> {
        (0..n_layers).map(|l| picks.iter().filter(|p| p.0 == l).count()).collect()
    }

    #[test]
    fn flat_takes_every_layers_best_expert_first() {
        // Layer 1 is far slower, but flat looks at usage only.
        let o = obs(&[(&[90, 10, 0], 1.0, 1.0), (&[40, 35, 25], 50.0, 50.0), (&[60, 30, 10], 1.0, 1.0)]);
        assert_eq!(top(&o, WeightMode::Flat, 0.5, 3), vec![(0, 0), (2, 0), (1, 0)]);
        assert_eq!(per_layer(&top(&o, WeightMode::Flat, 0.5, 6), 3), vec![2, 2, 2]);
    }

    #[test]
    fn pressure_favours_layers_whose_cold_lane_is_slow() {
        let o = obs(&[(&[50, 30, 20], 1.0, 9.0), (&[50, 30, 20], 16.0, 1.0)]);
        // Same usage; layer 1 waits 16x longer per cold slot: its experts go first.
        assert_eq!(top(&o, WeightMode::Pressure, 0.5, 3), vec![(1, 0), (1, 1), (1, 2)]);
        // Without the curve, pressure is usage alone.
        assert_eq!(per_layer(&top(&o, WeightMode::Pressure, 0.0, 4), 2), vec![2, 2]);
    }

    #[test]
    fn smooth_pressure_damps_an_outlier_layer() {
        let layers: Vec<(&[u64], f64, f64)> = vec![
            (&[40, 30, 20, 10], 1000.0, 1.0),
            (&[40, 30, 20, 10], 100.0, 1.0),
            (&[40, 30, 20, 10], 100.0, 1.0),
            (&[40, 30, 20, 10], 100.0, 1.0),
        ];
        let o = obs(&layers);
        let hard = per_layer(&top(&o, WeightMode::Pressure, 1.0, 6), 4);
        let smooth = per_layer(&top(&o, WeightMode::SmoothPressure, 1.0, 6), 4);
        assert_eq!(hard[0], 4, "pressure gives the outlier every slot it has: {hard:?}");
        assert!(smooth[0] < hard[0] && smooth[0] >= 1, "{smooth:?}");
        assert!(smooth[1..].iter().sum::<usize>() > hard[1..].iter().sum::<usize>());
    }

    #[test]
    fn time_follows_total_moe_time_not_join_wait() {
        let o = obs(&[(&[50, 30, 20], 20.0, 1.0), (&[50, 30, 20], 1.0, 20.0)]);
        assert_eq!(top(&o, WeightMode::Time, 1.0, 2), vec![(1, 0), (1, 1)]);
        assert_eq!(top(&o, WeightMode::Pressure, 1.0, 2), vec![(0, 0), (0, 1)]);
    }

    #[test]
    fn balanced_spreads_over_more_layers_than_pressure() {
        let o =
            obs(&[(&[70, 20, 10, 0], 9.0, 1.0), (&[70, 20, 10, 0], 1.0, 1.0), (&[70, 20, 10, 0], 1.0, 1.0)]);
        let p = per_layer(&top(&o, WeightMode::Pressure, 1.0, 3), 3);
        let b = per_layer(&top(&o, WeightMode::Balanced, 1.0, 3), 3);
        assert_eq!(p, vec![3, 0, 0], "pressure piles onto the slow layer");
        assert!(b.iter().filter(|&&n| n > 0).count() > 1, "balanced spreads: {b:?}");
    }

    #[test]
    fn layer_curve_sharpens_the_layer_weight() {
        assert_eq!(layer_weights(&[1.0, 3.0], 0.0), vec![1.0, 1.0]);
        let w1 = layer_weights(&[1.0, 3.0], 0.5);
        let w2 = layer_weights(&[1.0, 3.0], 2.0);
        assert!(w2[1] / w2[0] > w1[1] / w1[0]);
        assert_eq!(layer_weights(&[0.0, 0.0], 1.0), vec![1.0, 1.0], "no timings: usage only");
        assert!(Weighting::new(WeightMode::Flat, -1.0).is_err());
        assert!(Weighting::new(WeightMode::Flat, f64::NAN).is_err());
        assert_eq!("smooth_pressure".parse::<WeightMode>(), Ok(WeightMode::SmoothPressure));
        assert!("hot".parse::<WeightMode>().unwrap_err().contains("balanced"));
    }
}
