//! The online updater's planning (seed 003 `plan_layer_replacements`, `update_max_exchange`):
//! from per-(layer, expert) scores of a window of live observations, propose evict/add pairs.
//!
//! Per layer, the hot experts sorted by score (weakest first) are paired with the cold experts
//! sorted by score (strongest first); a pair is a candidate only when the cold expert beats the
//! one it would evict by the hysteresis margin: `score(add) > score(evict) * (1 + margin)` and
//! `score(add) > 0`, so experts of about equal value do not swap back and forth; and, since a
//! window's counts are noisy (a count `c` varies by about `sqrt(c)` between windows of a
//! stationary workload, and pairing the weakest hot with the strongest cold picks the noise's
//! extremes), only when the raw window counts differ by more than their noise:
//! `count(add) - count(evict) > NOISE_Z * sqrt(count(add) + count(evict))` (the difference of
//! two Poisson counts has variance `count(add) + count(evict)`). A stationary workload then
//! converges to about no exchanges, while a real shift (an expert used tens of times where the
//! one it replaces is not) still passes at once. Candidates of
//! every layer are sorted by gain (`score(add) - score(evict)`, ties to the lower layer) and the
//! first `max_exchanges(rate, n_hot)` are taken: `ceil(rate * n_hot)` slots per update, where
//! `n_hot` is every layer's hot slots together. Automatic updates use the configured
//! `update_rate`; a manual apply uses rate 1.0 (every slot may change).

use crate::cache::hot_set::{Exchange, HotSet, HotSetError};
use crate::cache::policy::{PolicyConfig, PolicyError};
use crate::cache::weighting::Weighting;
use serde::Serialize;

/// Default `--update-rate`: a tenth of the hot slots may change per update.
pub const DEFAULT_UPDATE_RATE: f64 = 0.1;
/// Default hysteresis margin: an expert must score 20% above the one it evicts.
pub const DEFAULT_HYSTERESIS_MARGIN: f64 = 0.2;
/// How many standard deviations of window noise an expert's count must beat the count of the
/// one it evicts by (module docs): 3 keeps the false exchanges of a stationary workload rare even
/// at the extremes of many pairs.
pub const NOISE_Z: f64 = 3.0;
/// Fewest routed slots in a window before an automatic update plans from it (a shorter window
/// is too noisy to act on; the window keeps growing until it has them).
pub const MIN_WINDOW_SLOTS: u64 = 64;

/// Whether the hot cache follows the workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum UpdateMode {
    /// The cache changes only by manual applies.
    #[default]
    Off,
    /// After each request (or every `every_tokens` tokens) the updater exchanges experts.
    Auto,
}

impl std::str::FromStr for UpdateMode {
    type Err = String;
    fn from_str(s: &str) -> Result<UpdateMode, String> {
        match s {
            "off" => Ok(UpdateMode::Off),
            "auto" => Ok(UpdateMode::Auto),
            other => Err(format!("update mode '{other}': expected off or auto")),
        }
    }
}

/// The updater's settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct UpdatePolicy {
    pub mode: UpdateMode,
    /// Fraction of hot slots an automatic update may exchange (0..=1).
    pub rate: f64,
    pub margin: f64,
    /// Also update every this many generated tokens inside a request (0: only after requests).
    pub every_tokens: usize,
    pub weighting: Weighting,
    /// Which policy keeps the cache: `planned` (the updater above, per `mode`) or a per-token
    /// online policy (`cache::policy`; then `mode` and `every_tokens` are not used).
    pub cache: PolicyConfig,
}

impl Default for UpdatePolicy {
    fn default() -> Self {
        UpdatePolicy {
            mode: UpdateMode::Off,
            rate: DEFAULT_UPDATE_RATE,
            margin: DEFAULT_HYSTERESIS_MARGIN,
            every_tokens: 0,
            weighting: Weighting::default(),
            cache: PolicyConfig::default(),
        }
    }
}

/// An update setting out of range.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum UpdateError {
    #[error("update rate {0}: expected a fraction in 0..=1")]
    BadRate(f64),
    #[error("hysteresis margin {0}: expected a finite number >= 0")]
    BadMargin(f64),
    #[error(transparent)]
    Policy(#[from] PolicyError),
}

impl UpdatePolicy {
    pub fn check(&self) -> Result<(), UpdateError> {
        if !(0.0..=1.0).contains(&self.rate) || self.rate.is_nan() {
            return Err(UpdateError::BadRate(self.rate));
        }
        if !self.margin.is_finite() || self.margin < 0.0 {
            return Err(UpdateError::BadMargin(self.margin));
        }
        Ok(self.cache.check()?)
    }
}

/// Most exchanges one update may make: `ceil(rate * n_hot)`.
pub fn max_exchanges(rate: f64, n_hot: usize) -> usize {
    ((rate.clamp(0.0, 1.0) * n_hot as f64) - 1e-9).ceil().max(0.0) as usize
}

/// One proposed exchange with its gain.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub exchange: Exchange,
    pub gain: f64,
}

/// Candidates of every layer, by gain (module docs), before the rate cap: `scores` per layer
/// and expert under the weighting, `counts` the window's raw counts they came from (`None`: no
/// noise test, e.g. scores that are not counts).
pub fn candidates(
    scores: &[Vec<f64>],
    counts: Option<&[Vec<u64>]>,
    hot: &HotSet,
    margin: f64,
) -> Vec<Candidate> {
    let mut out = Vec::new();
    for (layer_idx, (layer, s)) in hot.layers.iter().zip(scores).enumerate() {
        let mut hot_ids: Vec<usize> = (0..hot.n_experts).filter(|&e| layer.is_hot(e)).collect();
        let mut cold_ids: Vec<usize> = (0..hot.n_experts).filter(|&e| !layer.is_hot(e)).collect();
        hot_ids.sort_by(|&a, &b| s[a].total_cmp(&s[b]).then(a.cmp(&b)));
        cold_ids.sort_by(|&a, &b| s[b].total_cmp(&s[a]).then(a.cmp(&b)));
        let above_noise = |add: usize, evict: usize| {
            counts.and_then(|c| c.get(layer_idx)).is_none_or(|c| {
                let (a, e) = (c[add] as f64, c[evict] as f64);
                a - e > NOISE_Z * (a + e).sqrt()
            })
        };
        for (&evict, &add) in hot_ids.iter().zip(&cold_ids) {
            if s[add] <= 0.0 || s[add] <= s[evict] * (1.0 + margin) {
                break;
            }
            // The pairs are in falling order of the margin test, not of the noise test: a pair
            // within the noise is skipped, the next may still pass.
            if above_noise(add, evict) {
                out.push(Candidate { exchange: Exchange { layer_idx, evict, add }, gain: s[add] - s[evict] });
            }
        }
    }
    out.sort_by(|a, b| b.gain.total_cmp(&a.gain).then(a.exchange.layer_idx.cmp(&b.exchange.layer_idx)));
    out
}

/// The exchanges of one update: candidates capped by `rate`.
pub fn plan_exchanges(
    scores: &[Vec<f64>],
    counts: Option<&[Vec<u64>]>,
    hot: &HotSet,
    rate: f64,
    margin: f64,
) -> Vec<Exchange> {
    let n_hot: usize = hot.layers.iter().map(|l| l.n_hot()).sum();
    let mut c = candidates(scores, counts, hot, margin);
    c.truncate(max_exchanges(rate, n_hot));
    c.into_iter().map(|c| c.exchange).collect()
}

/// Exchanges that turn `current` into `target` (a manual apply: rate 1.0); every layer must
/// keep its number of slots (the capacity never changes).
pub fn exchanges_to(current: &HotSet, target: &HotSet) -> Result<Vec<Exchange>, HotSetError> {
    let mut out = Vec::new();
    for (layer_idx, (cur, want)) in current.layers.iter().zip(&target.layers).enumerate() {
        if cur.n_hot() != want.n_hot() {
            return Err(HotSetError::BadExchange {
                layer_idx,
                reason: format!(
                    "the layer has {} cache slots; {} experts were given",
                    cur.n_hot(),
                    want.n_hot()
                ),
            });
        }
        let evict = (0..current.n_experts).filter(|&e| cur.is_hot(e) && !want.is_hot(e));
        let add = (0..target.n_experts).filter(|&e| want.is_hot(e) && !cur.is_hot(e));
        out.extend(evict.zip(add).map(|(evict, add)| Exchange { layer_idx, evict, add }));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hysteresis_keeps_near_equal_experts_in_place() {
        let hot = HotSet::from_lists(1, 4, 1, &[vec![0, 1]]);
        // Expert 2 beats expert 1 by 10%: under the 20% margin, nothing moves.
        let scores = vec![vec![0.5, 0.20, 0.22, 0.08]];
        assert!(plan_exchanges(&scores, None, &hot, 1.0, 0.2).is_empty());
        // By 50%: it moves in, in place of the weakest hot expert.
        let scores = vec![vec![0.5, 0.20, 0.30, 0.0]];
        assert_eq!(
            plan_exchanges(&scores, None, &hot, 1.0, 0.2),
            vec![Exchange { layer_idx: 0, evict: 1, add: 2 }]
        );
    }

    #[test]
    fn rate_caps_the_exchanges_and_gain_orders_them() {
        let hot = HotSet::from_lists(2, 4, 1, &[vec![0, 1], vec![0, 1]]);
        let scores = vec![vec![0.0, 0.1, 0.5, 0.4], vec![0.0, 0.0, 0.2, 0.9]];
        let all = plan_exchanges(&scores, None, &hot, 1.0, 0.2);
        assert_eq!(all.len(), 4);
        assert_eq!(all[0], Exchange { layer_idx: 1, evict: 0, add: 3 }, "largest gain first");
        assert_eq!(plan_exchanges(&scores, None, &hot, 0.25, 0.2).len(), 1, "ceil(0.25 * 4) = 1");
        assert_eq!(plan_exchanges(&scores, None, &hot, 0.0, 0.2).len(), 0);
        assert_eq!(max_exchanges(0.1, 48), 5);
    }

    /// Poisson-like counts of a window of `n` slots over `rates` (a fixed-seed xorshift, so the
    /// test is reproducible): each slot picks an expert by the rates.
    fn window(rates: &[f64], n: usize, seed: &mut u64) -> Vec<u64> {
        let total: f64 = rates.iter().sum();
        let mut counts = vec![0; rates.len()];
        for _ in 0..n {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            let mut u = (*seed >> 11) as f64 / (1u64 << 53) as f64 * total;
            let e = rates.iter().position(|&r| {
                u -= r;
                u < 0.0
            });
            counts[e.unwrap_or(rates.len() - 1)] += 1;
        }
        counts
    }

    /// Run `windows` updates of 16 layers x 128 experts (half hot, rate 0.1) on windows of
    /// `rates`; the exchanges of each update.
    fn run(rates: &[f64], hot: &mut HotSet, windows: usize, noise_test: bool, seed: &mut u64) -> Vec<usize> {
        (0..windows)
            .map(|_| {
                let counts: Vec<Vec<u64>> = (0..16).map(|_| window(rates, 1024, seed)).collect();
                let scores: Vec<Vec<f64>> =
                    counts.iter().map(|c| c.iter().map(|&x| x as f64).collect()).collect();
                let ex = plan_exchanges(&scores, noise_test.then_some(&counts[..]), hot, 0.1, 0.2);
                for x in &ex {
                    hot.apply_exchange(x.layer_idx, x.evict, x.add).unwrap();
                }
                ex.len()
            })
            .collect()
    }

    #[test]
    fn a_stationary_workload_settles_and_a_shift_is_followed() {
        // Skewed routing: expert e has rate 1 / (1 + e / 8); the best static cache is 0..64.
        let rates: Vec<f64> = (0..128).map(|e| 1.0 / (1.0 + e as f64 / 8.0)).collect();
        let best: Vec<Vec<usize>> = vec![(0..64).collect(); 16];
        let mut seed = 0x9e37_79b9_7f4a_7c15;
        // Without the noise test the margin alone lets noise swap near-equal experts each time.
        let mut hot = HotSet::from_lists(16, 128, 1, &best);
        let churn = run(&rates, &mut hot, 10, false, &mut seed);
        assert!(churn.iter().sum::<usize>() > 100, "margin only: {churn:?}");
        // With it: about nothing moves over 10 windows (at most 1% of the 10 x 103 the cap allows).
        let mut hot = HotSet::from_lists(16, 128, 1, &best);
        let settled = run(&rates, &mut hot, 10, true, &mut seed);
        assert!(settled.iter().sum::<usize>() <= 10, "noise test: {settled:?}, margin only: {churn:?}");
        // A shift (the popular experts are now 64..128): the cap (ceil(0.1 * 1024) = 103) is
        // used at once and the cache follows within a few windows.
        let shifted: Vec<f64> = (0..128).map(|e| rates[(e + 64) % 128]).collect();
        let moved = run(&shifted, &mut hot, 6, true, &mut seed);
        assert_eq!(moved[0], 103, "{moved:?}");
        let new_top = hot.layers.iter().map(|l| (64..80).filter(|&e| l.is_hot(e)).count()).sum::<usize>();
        assert_eq!(new_top, 16 * 16, "every layer's 16 most used experts are hot after the shift");
    }

    #[test]
    fn manual_target_keeps_capacity() {
        let cur = HotSet::from_lists(1, 4, 1, &[vec![0, 1]]);
        let ok = HotSet::from_lists(1, 4, 1, &[vec![1, 3]]);
        assert_eq!(exchanges_to(&cur, &ok).unwrap(), vec![Exchange { layer_idx: 0, evict: 0, add: 3 }]);
        let bad = HotSet::from_lists(1, 4, 1, &[vec![3]]);
        assert!(exchanges_to(&cur, &bad).unwrap_err().to_string().contains("2 cache slots"));
        assert!(UpdatePolicy { rate: 1.5, ..UpdatePolicy::default() }.check().is_err());
    }
}
