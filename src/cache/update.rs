//! The online updater's planning (seed 003 `plan_layer_replacements`, `update_max_exchange`):
//! from per-(layer, expert) scores of a window of live observations, propose evict/add pairs.
//!
//! Per layer, the hot experts sorted by score (weakest first) are paired with the cold experts
//! sorted by score (strongest first); a pair is a candidate only when the cold expert beats the
//! one it would evict by the hysteresis margin: `score(add) > score(evict) * (1 + margin)` and
//! `score(add) > 0`, so experts of about equal value do not swap back and forth. Candidates of
//! every layer are sorted by gain (`score(add) - score(evict)`, ties to the lower layer) and the
//! first `max_exchanges(rate, n_hot)` are taken: `ceil(rate * n_hot)` slots per update, where
//! `n_hot` is every layer's hot slots together. Automatic updates use the configured
//! `update_rate`; a manual apply uses rate 1.0 (every slot may change).

use crate::cache::hot_set::{Exchange, HotSet, HotSetError};
use crate::cache::weighting::Weighting;
use serde::Serialize;

/// Default `--update-rate`: a tenth of the hot slots may change per update.
pub const DEFAULT_UPDATE_RATE: f64 = 0.1;
/// Default hysteresis margin: an expert must score 20% above the one it evicts.
pub const DEFAULT_HYSTERESIS_MARGIN: f64 = 0.2;
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
}

impl Default for UpdatePolicy {
    fn default() -> Self {
        UpdatePolicy {
            mode: UpdateMode::Off,
            rate: DEFAULT_UPDATE_RATE,
            margin: DEFAULT_HYSTERESIS_MARGIN,
            every_tokens: 0,
            weighting: Weighting::default(),
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
}

impl UpdatePolicy {
    pub fn check(&self) -> Result<(), UpdateError> {
        if !(0.0..=1.0).contains(&self.rate) || self.rate.is_nan() {
            return Err(UpdateError::BadRate(self.rate));
        }
        if !self.margin.is_finite() || self.margin < 0.0 {
            return Err(UpdateError::BadMargin(self.margin));
        }
        Ok(())
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

/// Candidates of every layer, by gain (module docs), before the rate cap.
pub fn candidates(scores: &[Vec<f64>], hot: &HotSet, margin: f64) -> Vec<Candidate> {
    let mut out = Vec::new();
    for (layer_idx, (layer, s)) in hot.layers.iter().zip(scores).enumerate() {
        let mut hot_ids: Vec<usize> = (0..hot.n_experts).filter(|&e| layer.is_hot(e)).collect();
        let mut cold_ids: Vec<usize> = (0..hot.n_experts).filter(|&e| !layer.is_hot(e)).collect();
        hot_ids.sort_by(|&a, &b| s[a].total_cmp(&s[b]).then(a.cmp(&b)));
        cold_ids.sort_by(|&a, &b| s[b].total_cmp(&s[a]).then(a.cmp(&b)));
        for (&evict, &add) in hot_ids.iter().zip(&cold_ids) {
            if s[add] <= 0.0 || s[add] <= s[evict] * (1.0 + margin) {
                break;
            }
            out.push(Candidate { exchange: Exchange { layer_idx, evict, add }, gain: s[add] - s[evict] });
        }
    }
    out.sort_by(|a, b| b.gain.total_cmp(&a.gain).then(a.exchange.layer_idx.cmp(&b.exchange.layer_idx)));
    out
}

/// The exchanges of one update: candidates capped by `rate`.
pub fn plan_exchanges(scores: &[Vec<f64>], hot: &HotSet, rate: f64, margin: f64) -> Vec<Exchange> {
    let n_hot: usize = hot.layers.iter().map(|l| l.n_hot()).sum();
    let mut c = candidates(scores, hot, margin);
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
        assert!(plan_exchanges(&scores, &hot, 1.0, 0.2).is_empty());
        // By 50%: it moves in, in place of the weakest hot expert.
        let scores = vec![vec![0.5, 0.20, 0.30, 0.0]];
        assert_eq!(
            plan_exchanges(&scores, &hot, 1.0, 0.2),
            vec![Exchange { layer_idx: 0, evict: 1, add: 2 }]
        );
    }

    #[test]
    fn rate_caps_the_exchanges_and_gain_orders_them() {
        let hot = HotSet::from_lists(2, 4, 1, &[vec![0, 1], vec![0, 1]]);
        let scores = vec![vec![0.0, 0.1, 0.5, 0.4], vec![0.0, 0.0, 0.2, 0.9]];
        let all = plan_exchanges(&scores, &hot, 1.0, 0.2);
        assert_eq!(all.len(), 4);
        assert_eq!(all[0], Exchange { layer_idx: 1, evict: 0, add: 3 }, "largest gain first");
        assert_eq!(plan_exchanges(&scores, &hot, 0.25, 0.2).len(), 1, "ceil(0.25 * 4) = 1");
        assert_eq!(plan_exchanges(&scores, &hot, 0.0, 0.2).len(), 0);
        assert_eq!(max_exchanges(0.1, 48), 5);
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
