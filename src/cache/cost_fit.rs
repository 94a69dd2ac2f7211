//! The per-layer-call lane cost behind `moe-lanes plan`'s predictions, fitted to one
//! calibration run's [`LaneCost`] sums and extrapolated to other budgets.
//!
//! A split layer call (the lanes ran) of `n` tokens costs, in lane wall time:
//! - `W0` when none of its slots is cold (the hot lane, the host split and the join);
//! - `F + D*d + S*s` with `s` cold slots of `d` distinct cold experts: `F` is the fixed cost of
//!   a call with cold work (waking the cold lane, the host sync on the GPU, the join), `D` the
//!   cost of reading one cold expert's weights (once per call: prefill reads each expert once
//!   per layer) and `S` the cost of one cold slot's arithmetic.
//!
//! `W0` is the mean of the calls without cold work. `F`, `D`, `S` are least squares over the
//! calls with cold work, from the moments the perf state sums ([`LaneCost`]); of the models
//! `F + S*s`, `F + D*d + S*s`, `F + D*d`, `S*s`, `D*d`, `F` the one with the smallest residual
//! whose terms are all >= 0 and whose regressors are not collinear (in one-token decode
//! `d == s`, so `D` and `S` are one term). When every call with cold work had the same `s` and
//! `d` (one bucket: a calibration at budget 0 has 8 cold slots in every decode call), `F` and
//! `S` cannot be told apart: the line through `(0, W0)` and the bucket is taken when `W0` was
//! measured, else the cost is taken as proportional to `s` (`F = 0`); [`FitKind`] says which.
//!
//! A budget's layer call is then predicted from the planned hot set and the learn counts: with
//! `h` the layer's planned hit rate, `q_e = min(1, k * count_e / total)` the chance a token
//! routes to expert `e`, and slots hot independently with chance `h`:
//! `P0 = h^(k*n)` (no cold slot), `E[s] = n*k*(1-h)`, `E[d] = sum over cold e of 1-(1-q_e)^n`,
//! and `cost = P0*W0 + (1-P0)*F + D*E[d] + S*E[s]`. A layer whose every expert is cached costs
//! its hot lane alone, `n*k*hot` (the GPU runs it on the stream without a host split).

use crate::cache::perf::LaneCost;
use serde::Serialize;

/// How `F`, `D` and `S` were found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FitKind {
    /// Least squares over calls with different numbers of cold slots.
    LeastSquares,
    /// One bucket of cold calls: the line through `(0, W0)` and it.
    ThroughNoCold,
    /// One bucket and no call without cold work: proportional to the cold slots.
    Proportional,
    /// No call with cold work: the per-slot cold time of the phase totals.
    PerSlotOnly,
}

/// A fitted per-layer-call cost (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LayerCallCost {
    pub tokens_per_call: f64,
    /// `W0`; `None` when no split call without cold work was recorded.
    pub no_cold_us: Option<f64>,
    pub fixed_us: f64,
    pub per_cold_expert_us: f64,
    pub per_cold_slot_us: f64,
    pub fit: FitKind,
}

/// The terms a candidate model uses: intercept, `d`, `s`.
const MODELS: [[bool; 3]; 6] = [
    [true, false, true],
    [true, true, true],
    [true, true, false],
    [false, false, true],
    [false, true, false],
    [true, false, false],
];

/// Solve the normal equations of the terms in `use_`; `None` when singular or ill-conditioned.
fn solve(m: &[[f64; 3]; 3], r: &[f64; 3], use_: [bool; 3]) -> Option<[f64; 3]> {
    let idx: Vec<usize> = (0..3).filter(|&i| use_[i]).collect();
    let p = idx.len();
    if idx.iter().any(|&i| m[i][i] <= 0.0) {
        return None;
    }
    // Scale to unit diagonal so the pivot test reads as a correlation.
    let sc: Vec<f64> = idx.iter().map(|&i| m[i][i].sqrt()).collect();
    let mut a = vec![vec![0.0; p + 1]; p];
    for (row, &i) in idx.iter().enumerate() {
        for (col, &j) in idx.iter().enumerate() {
            a[row][col] = m[i][j] / (sc[row] * sc[col]);
        }
        a[row][p] = r[i] / sc[row];
    }
    for c in 0..p {
        let piv = (c..p).max_by(|&x, &y| a[x][c].abs().total_cmp(&a[y][c].abs()))?;
        a.swap(c, piv);
        if a[c][c].abs() < 1e-6 {
            return None;
        }
        let pivot_row = a[c].clone();
        for (row, r) in a.iter_mut().enumerate() {
            if row != c {
                let f = r[c] / pivot_row[c];
                r.iter_mut().zip(&pivot_row).skip(c).for_each(|(x, y)| *x -= f * y);
            }
        }
    }
    let mut beta = [0.0; 3];
    for (row, &i) in idx.iter().enumerate() {
        beta[i] = a[row][p] / a[row][row] / sc[row];
    }
    Some(beta)
}

impl LayerCallCost {
    /// Fit the calls of one phase; `None` when no split call was recorded. `cold_us_per_slot`
    /// is the phase totals' per-slot cold time, for a calibration without cold work.
    pub fn fit(c: &LaneCost, cold_us_per_slot: f64) -> Option<LayerCallCost> {
        if !c.is_recorded() {
            return None;
        }
        let calls = (c.calls_cold + c.calls_no_cold) as f64;
        let no_cold_us = (c.calls_no_cold > 0).then(|| c.wall_no_cold_us as f64 / c.calls_no_cold as f64);
        let mut cost = LayerCallCost {
            tokens_per_call: (c.tokens as f64 / calls).max(1.0),
            no_cold_us,
            fixed_us: 0.0,
            per_cold_expert_us: 0.0,
            per_cold_slot_us: cold_us_per_slot,
            fit: FitKind::PerSlotOnly,
        };
        if c.calls_cold == 0 {
            return Some(cost);
        }
        let f = |v: u64| v as f64;
        let m = [
            [f(c.calls_cold), f(c.cold_experts), f(c.cold_slots)],
            [f(c.cold_experts), f(c.cold_experts_sq), f(c.experts_x_slots)],
            [f(c.cold_slots), f(c.experts_x_slots), f(c.cold_slots_sq)],
        ];
        let r = [f(c.wall_cold_us), f(c.experts_x_wall_us), f(c.slots_x_wall_us)];
        let one_bucket =
            solve(&m, &r, [true, false, true]).is_none() && solve(&m, &r, [true, true, false]).is_none();
        if one_bucket {
            let (mean_y, mean_s) = (r[0] / m[0][0], m[0][2] / m[0][0]);
            (cost.fixed_us, cost.per_cold_slot_us, cost.fit) = match no_cold_us {
                Some(w0) if mean_y >= w0 => (w0, (mean_y - w0) / mean_s, FitKind::ThroughNoCold),
                Some(_) => (mean_y, 0.0, FitKind::ThroughNoCold),
                None => (0.0, mean_y / mean_s, FitKind::Proportional),
            };
            return Some(cost);
        }
        let sse = |b: &[f64; 3]| {
            let fit: f64 = (0..3).map(|i| b[i] * r[i]).sum::<f64>();
            let quad: f64 =
                (0..3).flat_map(|i| (0..3).map(move |j| (i, j))).map(|(i, j)| b[i] * m[i][j] * b[j]).sum();
            f(c.wall_sq_us2) - 2.0 * fit + quad
        };
        let scale = f(c.wall_sq_us2).max(1.0);
        let mut best: Option<([f64; 3], f64)> = None;
        for use_ in MODELS {
            let Some(b) = solve(&m, &r, use_) else { continue };
            if b.iter().any(|&x| x < -1e-9 * scale.sqrt()) {
                continue;
            }
            let e = sse(&b);
            // An earlier (simpler) model keeps its place unless a later one fits clearly better.
            if best.is_none_or(|(_, be)| e < be - 1e-9 * scale) {
                best = Some((b.map(|x| x.max(0.0)), e));
            }
        }
        let (b, _) = best?;
        (cost.fixed_us, cost.per_cold_expert_us, cost.per_cold_slot_us, cost.fit) =
            (b[0], b[1], b[2], FitKind::LeastSquares);
        Some(cost)
    }

    /// Predicted lane wall of one layer call with `hot` cached of `counts` (learn counts per
    /// expert), `k` experts per token, `hot_us_per_slot` the hot lane's per-slot time.
    pub fn layer_call_us(&self, hot: &[usize], counts: &[u64], k: usize, hot_us_per_slot: f64) -> f64 {
        let (n, kf) = (self.tokens_per_call, k as f64);
        let n_experts = counts.len();
        if hot.len() >= n_experts {
            return n * kf * hot_us_per_slot;
        }
        let mut is_hot = vec![false; n_experts];
        hot.iter().for_each(|&e| is_hot[e] = true);
        let total: u64 = counts.iter().sum();
        let q = |e: usize| {
            if total == 0 {
                kf / n_experts as f64
            } else {
                (kf * counts[e] as f64 / total as f64).min(1.0)
            }
        };
        let h = if total == 0 {
            hot.len() as f64 / n_experts as f64
        } else {
            hot.iter().map(|&e| counts[e]).sum::<u64>() as f64 / total as f64
        };
        let p0 = h.powf(kf * n);
        let e_slots = n * kf * (1.0 - h);
        let e_experts: f64 = (0..n_experts).filter(|&e| !is_hot[e]).map(|e| 1.0 - (1.0 - q(e)).powf(n)).sum();
        let w0 = self.no_cold_us.unwrap_or(n * kf * hot_us_per_slot);
        p0 * w0
            + (1.0 - p0) * self.fixed_us
            + self.per_cold_expert_us * e_experts
            + self.per_cold_slot_us * e_slots
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sums of one-token decode calls following `y = F + S*s` exactly.
    fn decode_calls(calls: &[(u64, u64, u64)]) -> LaneCost {
        let mut c = LaneCost::default();
        for &(n, s, y) in calls {
            for _ in 0..n {
                c.add_call(1, s, s, y);
            }
        }
        c
    }

    #[test]
    fn fixed_plus_per_slot_is_recovered_and_extrapolates_exactly() {
        // F = 120, S = 60, W0 = 30, measured at a high budget: mostly 0-2 cold slots.
        let c = decode_calls(&[(800, 0, 30), (150, 1, 180), (40, 2, 240), (3, 3, 300)]);
        let cost = LayerCallCost::fit(&c, 999.0).unwrap();
        assert_eq!(cost.fit, FitKind::LeastSquares);
        assert!((cost.fixed_us - 120.0).abs() < 1e-6, "{cost:?}");
        assert!((cost.per_cold_slot_us - 60.0).abs() < 1e-6 && cost.per_cold_expert_us.abs() < 1e-9);
        assert_eq!(cost.no_cold_us, Some(30.0));
        // Budget 0 (nothing hot): every call has k = 8 cold slots: F + 8 S = 600.
        let counts = [5, 4, 3, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1];
        assert!((cost.layer_call_us(&[], &counts, 8, 5.0) - 600.0).abs() < 1e-6);
        // Everything cached: the hot lane alone.
        let all: Vec<usize> = (0..16).collect();
        assert!((cost.layer_call_us(&all, &counts, 8, 5.0) - 40.0).abs() < 1e-9);
        // In between, the binomial mix: h = 12/27 hot by counts.
        let h: f64 = 12.0 / 27.0;
        let want = h.powi(8) * 30.0 + (1.0 - h.powi(8)) * 120.0 + 60.0 * 8.0 * (1.0 - h);
        assert!((cost.layer_call_us(&[0, 1, 2], &counts, 8, 5.0) - want).abs() < 1e-6);
    }

    #[test]
    fn one_bucket_falls_back_to_a_line_through_w0_or_proportional() {
        let c = decode_calls(&[(10, 0, 40), (100, 8, 520)]);
        let cost = LayerCallCost::fit(&c, 0.0).unwrap();
        assert_eq!(cost.fit, FitKind::ThroughNoCold);
        assert_eq!((cost.fixed_us, cost.per_cold_slot_us), (40.0, 60.0));
        let cost = LayerCallCost::fit(&decode_calls(&[(100, 8, 520)]), 0.0).unwrap();
        assert_eq!(cost.fit, FitKind::Proportional);
        assert_eq!((cost.fixed_us, cost.per_cold_slot_us, cost.no_cold_us), (0.0, 65.0, None));
        let cost = LayerCallCost::fit(&decode_calls(&[(100, 0, 50)]), 7.0).unwrap();
        assert_eq!((cost.fit, cost.per_cold_slot_us), (FitKind::PerSlotOnly, 7.0));
        assert!(LayerCallCost::fit(&LaneCost::default(), 7.0).is_none());
    }

    #[test]
    fn prefill_separates_expert_reads_from_slot_work() {
        // y = 200 + 900 d + 3 s over calls of 64 tokens with different expert/slot mixes.
        let mut c = LaneCost::default();
        for (d, s) in [(4u64, 40u64), (10, 60), (20, 300), (30, 200), (16, 128)] {
            c.add_call(64, d, s, 200 + 900 * d + 3 * s);
        }
        let cost = LayerCallCost::fit(&c, 0.0).unwrap();
        assert!((cost.fixed_us - 200.0).abs() < 1e-3, "{cost:?}");
        assert!((cost.per_cold_expert_us - 900.0).abs() < 1e-3 && (cost.per_cold_slot_us - 3.0).abs() < 1e-4);
        assert_eq!(cost.tokens_per_call, 64.0);
        // Nothing hot, 64 tokens, uniform routing over 4 experts at k = 2: every expert is
        // read (q = 0.5), 128 slots.
        let want = 200.0 + 900.0 * 4.0 * (1.0 - 0.5f64.powi(64)) + 3.0 * 128.0;
        assert!((cost.layer_call_us(&[], &[1, 1, 1, 1], 2, 0.0) - want).abs() < 1e-6);
    }

    #[test]
    fn a_negative_slope_is_not_extrapolated() {
        // Noisy data where more cold slots looked cheaper: the fit keeps every term >= 0.
        let c = decode_calls(&[(100, 1, 200), (50, 2, 190)]);
        let cost = LayerCallCost::fit(&c, 0.0).unwrap();
        assert!(cost.per_cold_slot_us >= 0.0 && cost.fixed_us >= 0.0 && cost.per_cold_expert_us >= 0.0);
    }
}
