//! The what-if planner behind `moe-lanes plan`: for a budget, the experts the weighting chooses
//! per layer, their bytes, the hit rate the learn counts predict, and tokens per second from a
//! cost model calibrated by the learn file's own perf data.
//!
//! Cost model, per phase (`prefill` gives pp, `decode` gives tg), from the `phases` section the
//! engines record ([`crate::cache::perf::PhasePerf`]):
//! - `other` = (wall time - lane wall time) / tokens: everything but the hot and cold lanes
//!   (attention, router, shared expert, join, logits), per token;
//! - per layer, the lane wall of one layer call predicted by [`LayerCallCost`] (fixed cost of a
//!   call with cold work, per distinct cold expert and per cold slot, fitted to the phase's
//!   `lane_cost` sums; see `cache::cost_fit`) from the planned hot set and the learn counts;
//! - per token, `T = other + sum_l cost_l / n` with `n` tokens per layer call, and tokens/s =
//!   `1e6 / T`.
//!
//! A learn file written before `lane_cost` existed falls back to the per-slot model (and the
//! report says so): `hot` = hot-lane time / hot slots, `cold` = cold-lane time / cold slots,
//! `T = other + sum_l max(k * h[l] * hot, k * (1 - h[l]) * cold)` with `h[l]` the planned hit
//! rate of layer `l`. A learn pass with the cache off has no hot slots: the hot per-slot time
//! is then taken as 0 and the report says so. A phase the file has no calls of has no
//! prediction (run `bench --perf-json` or `generate --perf-json` to record decode).

use crate::cache::cost_fit::{FitKind, LayerCallCost};
use crate::cache::observe::Observations;
use crate::cache::perf::PhasePerf;
use crate::cache::planner::{plan_weighted, HotPlan, PlanError};
use crate::cache::weighting::Weighting;
use serde::Serialize;
use std::collections::BTreeMap;

/// Budgets of a sweep, as percent of every expert's bytes.
pub const SWEEP_PERCENTS: [u64; 11] = [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100];

/// One phase's calibrated costs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PhaseCost {
    pub tokens: u64,
    pub other_us_per_token: f64,
    pub hot_us_per_slot: f64,
    pub cold_us_per_slot: f64,
    /// Whether the hot per-slot time was measured (false: no hot slots recorded, taken as 0).
    pub hot_measured: bool,
    /// The per-layer-call model; `None` for files without `lane_cost` (per-slot model).
    pub layer_call: Option<LayerCallCost>,
}

/// Costs per phase name.
#[derive(Debug, Clone, PartialEq, Serialize, Default)]
pub struct CostModel {
    pub phases: BTreeMap<String, PhaseCost>,
}

impl CostModel {
    pub fn calibrate(phases: &BTreeMap<String, PhasePerf>) -> CostModel {
        let per = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        let phases = phases
            .iter()
            .filter(|(_, p)| p.tokens > 0 && p.wall_time_us > 0)
            .map(|(name, p)| {
                let hot_measured = p.hot_slots > 0;
                let hot = per(p.hot_time_us, p.hot_slots);
                // Everything hot: a cold slot costs at least what a hot one does.
                let cold = if p.cold_slots > 0 { per(p.cold_time_us, p.cold_slots) } else { hot };
                let other = per(p.wall_time_us.saturating_sub(p.lane_wall_time_us), p.tokens);
                let cost = PhaseCost {
                    tokens: p.tokens,
                    other_us_per_token: other,
                    hot_us_per_slot: hot,
                    cold_us_per_slot: cold,
                    hot_measured,
                    layer_call: LayerCallCost::fit(&p.lane_cost, cold),
                };
                (name.clone(), cost)
            })
            .collect();
        CostModel { phases }
    }

    /// Predicted tokens per second of `phase` with `hot[l]` cached in layer `l`, `counts[l]`
    /// the learn counts, `k` experts per token; `None` when the phase was not recorded.
    pub fn tokens_per_s(
        &self,
        phase: &str,
        hot: &[Vec<usize>],
        counts: &[Vec<u64>],
        k: usize,
    ) -> Option<f64> {
        let c = self.phases.get(phase)?;
        let lanes: f64 = match &c.layer_call {
            Some(lc) => {
                let per_call: f64 =
                    hot.iter().zip(counts).map(|(h, n)| lc.layer_call_us(h, n, k, c.hot_us_per_slot)).sum();
                per_call / lc.tokens_per_call
            }
            None => {
                let kf = k as f64;
                hit_rates(hot, counts)
                    .iter()
                    .map(|h| (kf * h * c.hot_us_per_slot).max(kf * (1.0 - h) * c.cold_us_per_slot))
                    .sum()
            }
        };
        let t = c.other_us_per_token + lanes;
        (t > 0.0).then(|| 1e6 / t)
    }
}

/// One layer of a plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanLayer {
    pub layer: usize,
    pub experts: Vec<usize>,
    pub bytes: u64,
    pub hit_rate: f64,
}

/// The totals of a plan at one budget.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PlanPoint {
    pub budget_bytes: u64,
    pub used_bytes: u64,
    pub n_hot_experts: usize,
    pub hit_rate: f64,
    pub tg_tokens_per_s: Option<f64>,
    pub pp_tokens_per_s: Option<f64>,
}

/// What `plan` prints.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanReport {
    pub weighting: Weighting,
    /// Bytes of the largest expert (layers of a `_M` file differ; the plan counts each layer's).
    pub expert_bytes: u64,
    pub all_experts_bytes: u64,
    pub plan: PlanPoint,
    pub layers: Vec<PlanLayer>,
    pub cost_model: CostModel,
    pub notes: Vec<String>,
    /// The curve over budgets (`--sweep`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sweep: Option<Vec<PlanPoint>>,
}

/// The model dimensions a plan needs.
#[derive(Debug, Clone)]
pub struct PlanShape {
    pub n_layers: usize,
    pub n_experts: usize,
    pub n_experts_used: usize,
    /// Bytes of one expert of each layer.
    pub layer_expert_bytes: Vec<u64>,
}

fn hit_rates(hot: &[Vec<usize>], counts: &[Vec<u64>]) -> Vec<f64> {
    hot.iter()
        .zip(counts)
        .map(|(ids, c)| {
            let total: u64 = c.iter().sum();
            let hot: u64 = ids.iter().map(|&e| c[e]).sum();
            if total == 0 {
                0.0
            } else {
                hot as f64 / total as f64
            }
        })
        .collect()
}

fn point(
    obs: &Observations,
    w: &Weighting,
    shape: &PlanShape,
    cost: &CostModel,
    budget_bytes: u64,
) -> Result<(HotPlan, Vec<f64>, PlanPoint), PlanError> {
    let plan =
        plan_weighted(obs, w, shape.n_layers, shape.n_experts, &shape.layer_expert_bytes, budget_bytes)?;
    let counts = obs.counts();
    let hits = hit_rates(&plan.layers, &counts);
    let p = PlanPoint {
        budget_bytes,
        used_bytes: plan.used_bytes(),
        n_hot_experts: plan.n_slots(),
        hit_rate: plan.expected_hit_rate(&counts),
        tg_tokens_per_s: cost.tokens_per_s("decode", &plan.layers, &counts, shape.n_experts_used),
        pp_tokens_per_s: cost.tokens_per_s("prefill", &plan.layers, &counts, shape.n_experts_used),
    };
    Ok((plan, hits, p))
}

/// Plan `budget_bytes` (and the sweep when asked) from `obs` under `w`.
pub fn what_if(
    obs: &Observations,
    w: &Weighting,
    shape: PlanShape,
    budget_bytes: u64,
    sweep: bool,
) -> Result<PlanReport, PlanError> {
    let cost = CostModel::calibrate(&obs.phases);
    let (plan, hits, totals) = point(obs, w, &shape, &cost, budget_bytes)?;
    let layers = plan
        .layers
        .iter()
        .enumerate()
        .map(|(layer, ids)| PlanLayer {
            layer,
            experts: ids.clone(),
            bytes: ids.len() as u64 * shape.layer_expert_bytes[layer],
            hit_rate: hits[layer],
        })
        .collect();
    let all_experts_bytes = shape.layer_expert_bytes.iter().sum::<u64>() * shape.n_experts as u64;
    let sweep = sweep
        .then(|| {
            SWEEP_PERCENTS
                .iter()
                .map(|pct| point(obs, w, &shape, &cost, all_experts_bytes * pct / 100).map(|(_, _, p)| p))
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()?;
    Ok(PlanReport {
        weighting: *w,
        expert_bytes: shape.layer_expert_bytes.iter().copied().max().unwrap_or(0),
        all_experts_bytes,
        plan: totals,
        layers,
        notes: notes(&cost),
        cost_model: cost,
        sweep,
    })
}

fn notes(cost: &CostModel) -> Vec<String> {
    let mut notes = Vec::new();
    for (phase, what) in [("decode", "tg"), ("prefill", "pp")] {
        let Some(c) = cost.phases.get(phase) else {
            notes.push(format!(
                "no {phase} calls in the learn file: no {what} prediction (record one with bench --perf-json or generate --perf-json)"
            ));
            continue;
        };
        if !c.hot_measured {
            notes.push(format!(
                "no hot slots in the learn file's {phase} calls: hot-lane time taken as 0, so the {what} prediction is an upper bound"
            ));
        }
        let fallback = match c.layer_call.map(|l| l.fit) {
            None => Some("no per-layer-call lane costs (a file older than phases.*.lane_cost): per-slot model"),
            Some(FitKind::LeastSquares) => None,
            Some(FitKind::ThroughNoCold) => Some(
                "one cold-slot count only: cold cost taken as the line through the calls without cold work (calibrate at a budget that leaves a few cold slots per layer)",
            ),
            Some(FitKind::Proportional) => Some(
                "one cold-slot count and no call without cold work: cold cost taken as proportional to the cold slots (calibrate at a budget that leaves a few cold slots per layer)",
            ),
            Some(FitKind::PerSlotOnly) => Some(
                "no layer call with cold work: cold cost per slot from the phase totals (calibrate at a budget that leaves a few cold slots per layer)",
            ),
        };
        if let Some(why) = fallback {
            notes.push(format!("{what} prediction: {why}"));
        }
    }
    notes
}

impl PlanReport {
    pub fn to_text(&self) -> String {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let rate = |r: Option<f64>| r.map_or("-".to_string(), |v| format!("{v:.1} t/s"));
        let p = &self.plan;
        let mut out = format!(
            "weighting     {} (layer curve {})\nbudget        {:.2} MiB, used {:.2} MiB: {} hot experts of {:.2} MiB each ({:.2} MiB for all)\npredicted     hit rate {:.1}%, tg {}, pp {}\n",
            self.weighting.mode.name(),
            self.weighting.layer_curve,
            mib(p.budget_bytes),
            mib(p.used_bytes),
            p.n_hot_experts,
            mib(self.expert_bytes),
            mib(self.all_experts_bytes),
            p.hit_rate * 100.0,
            rate(p.tg_tokens_per_s),
            rate(p.pp_tokens_per_s),
        );
        for l in &self.layers {
            out += &format!(
                "layer {:>3}     {:>3} experts, {:>8.2} MiB, hit rate {:>5.1}%: {:?}\n",
                l.layer,
                l.experts.len(),
                mib(l.bytes),
                l.hit_rate * 100.0,
                l.experts
            );
        }
        if let Some(sweep) = &self.sweep {
            out += "sweep         budget MiB   experts   hit rate         tg         pp\n";
            for s in sweep {
                out += &format!(
                    "              {:>10.2} {:>9} {:>9.1}% {:>10} {:>10}\n",
                    mib(s.budget_bytes),
                    s.n_hot_experts,
                    s.hit_rate * 100.0,
                    rate(s.tg_tokens_per_s),
                    rate(s.pp_tokens_per_s)
                );
            }
        }
        for n in &self.notes {
            out += &format!("note          {n}\n");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::weighting::WeightMode;

    fn phases() -> BTreeMap<String, PhasePerf> {
        let decode = PhasePerf {
            calls: 10,
            tokens: 10,
            wall_time_us: 10_000,
            lane_wall_time_us: 6_000,
            hot_slots: 40,
            cold_slots: 40,
            hot_time_us: 400,
            cold_time_us: 4_000,
            ..PhasePerf::default()
        };
        [("decode".to_string(), decode)].into_iter().collect()
    }

    #[test]
    fn cost_model_is_calibrated_from_the_phases() {
        let cost = CostModel::calibrate(&phases());
        let c = cost.phases["decode"];
        assert_eq!((c.other_us_per_token, c.hot_us_per_slot, c.cold_us_per_slot), (400.0, 10.0, 100.0));
        // Two layers, k = 2: all cold costs 400 + 2 * 200 = 800 us; all hot 400 + 2 * 20 = 440 us.
        assert!(c.layer_call.is_none(), "no lane_cost in the file: the per-slot model");
        let counts = vec![vec![3, 1], vec![1, 3]];
        let all_cold = cost.tokens_per_s("decode", &[vec![], vec![]], &counts, 2).unwrap();
        let all_hot = cost.tokens_per_s("decode", &[vec![0, 1], vec![0, 1]], &counts, 2).unwrap();
        assert!((all_cold - 1250.0).abs() < 1e-9 && (all_hot - 1e6 / 440.0).abs() < 1e-9);
        assert!(cost.tokens_per_s("prefill", &[vec![]], &counts, 2).is_none());
        assert!(notes(&cost).iter().any(|n| n.contains("per-slot model")));
    }

    /// Decode calls following `lane wall = F + S * cold slots` (and `W0` without cold work),
    /// calibrated at a high budget (0-3 cold slots per call), predict budget 0 and every other
    /// budget's time exactly; the per-slot model of the same run would not.
    #[test]
    fn layer_call_model_extrapolates_across_budgets() {
        let (f, s, w0, other) = (120u64, 60u64, 30u64, 400.0);
        let mut p = PhasePerf {
            calls: 1000,
            tokens: 1000,
            hot_slots: 7000,
            hot_time_us: 35_000,
            ..Default::default()
        };
        for (n, c) in [(800u64, 0u64), (150, 1), (40, 2), (10, 3)] {
            let y = if c == 0 { w0 } else { f + s * c };
            for _ in 0..n {
                p.lane_cost.add_call(1, c, c, y);
                p.cold_slots += c;
                p.cold_time_us += y;
                p.lane_wall_time_us += y;
            }
        }
        p.wall_time_us = p.lane_wall_time_us + (other * 1000.0) as u64;
        let cost = CostModel::calibrate(&[("decode".to_string(), p)].into_iter().collect());
        assert!(notes(&cost).iter().all(|n| !n.contains("tg prediction")), "{:?}", notes(&cost));
        let counts = vec![vec![4, 2, 1, 1]; 2];
        // Budget 0, k = 2: each of 2 layers has 2 cold slots: 400 + 2 * (120 + 2 * 60) us.
        let tg0 = cost.tokens_per_s("decode", &[vec![], vec![]], &counts, 2).unwrap();
        assert!((tg0 - 1e6 / 880.0).abs() < 1e-6, "{tg0}");
        // Expert 0 hot in both layers: h = 0.5, P0 = 0.25, E[s] = 1 per layer.
        let t = 400.0 + 2.0 * (0.25 * 30.0 + 0.75 * 120.0 + 60.0);
        let tg = cost.tokens_per_s("decode", &[vec![0], vec![0]], &counts, 2).unwrap();
        assert!((tg - 1e6 / t).abs() < 1e-6, "{tg} vs {}", 1e6 / t);
        // Everything cached: the hot lane alone (5 us per slot).
        let all: Vec<usize> = (0..4).collect();
        let tg100 = cost.tokens_per_s("decode", &[all.clone(), all], &counts, 2).unwrap();
        assert!((tg100 - 1e6 / 420.0).abs() < 1e-6, "{tg100}");
        // The per-slot model spreads F over the few slots it saw and overestimates budget 0.
        let per_slot = cost.phases["decode"].cold_us_per_slot;
        assert!(400.0 + 4.0 * per_slot > 880.0 * 1.1, "{per_slot}");
    }

    #[test]
    fn sweep_rises_with_the_budget() {
        let mut obs = Observations::from_counts(&[vec![8, 4, 2, 1], vec![1, 1, 6, 8]], 2);
        obs.phases = phases();
        let shape =
            PlanShape { n_layers: 2, n_experts: 4, n_experts_used: 2, layer_expert_bytes: vec![100; 2] };
        let w = Weighting { mode: WeightMode::Flat, layer_curve: 0.5 };
        let r = what_if(&obs, &w, shape, 250, true).unwrap();
        assert_eq!(r.layers[0].experts, vec![0]);
        assert_eq!(r.layers[1].experts, vec![3]);
        assert_eq!(r.plan.used_bytes, 200);
        let sweep = r.sweep.as_ref().unwrap();
        assert_eq!(sweep.len(), SWEEP_PERCENTS.len());
        assert!(sweep.windows(2).all(|p| p[1].hit_rate >= p[0].hit_rate));
        // More hot is faster until the hot lane becomes the slower one (max of the lanes).
        assert!(sweep[10].tg_tokens_per_s > sweep[5].tg_tokens_per_s);
        assert!(sweep[5].tg_tokens_per_s > sweep[0].tg_tokens_per_s);
        assert_eq!(sweep.last().unwrap().hit_rate, 1.0);
        assert!(r.notes.iter().any(|n| n.contains("no prefill calls")));
    }
}
