//! What-if replay of an expert trace under every hot-cache policy, against Belady's optimum
//! (`moe-lanes plan --trace FILE --policies`).
//!
//! The trace's calls become per-layer *steps* (the distinct experts one call routed in that
//! layer; a decode token's top-k). The first [`DEFAULT_LEARN_FRACTION`] of the calls is the
//! learn pass: its counts rank each layer's experts, and the top `capacity` of that ranking is
//! the cache every policy starts from (and the static policy keeps); those calls are not scored.
//! Every layer gets the same capacity, `round(fraction * n_experts)` slots (the planner's flat
//! spread). The scored calls are replayed under:
//! - `static`: the learned cache, never changed;
//! - `hindsight`: the best cache that never changes, chosen from the scored calls themselves
//!   (the top `capacity` of their counts): a reference, not a policy. Where calls do not depend
//!   on the ones before (no locality in time), no causal policy can expect more hits than a fixed
//!   set of the most probable experts, which this estimates (`scripts/locality-bound.py` bounds
//!   the locality workload);
//! - `online`: today's updater (`cache::update::plan_exchanges`, flat scores of the window's
//!   counts, hysteresis and noise test, `rate` of the slots) every `update_every` calls, as
//!   `--update auto --update-every-tokens N` runs it;
//! - `lru`, `lfu`, `tinylfu`, `adaptive`, `reuse` ([`crate::cache::policy`]), step by step;
//! - `belady`: MIN with bypass from the same start ([`belady_hits`]): the most hits any demand
//!   policy can get (the updater, which admits from a window rather than on access, is measured
//!   against it too).
//!
//! The step policies' exchanges take effect `PolicyConfig::lag_steps` calls after the step that
//! decided them, as in the engines: by default (0) a step's exchanges serve from the next call;
//! with 1 the policy steps on a call's experts while the engine runs the next call, and its
//! exchanges are applied before the one after (`engine::policy_worker`), so a call's hits count
//! against the cache without the last step's exchanges (an admission serves from the second
//! call after its miss).
//!
//! Hit rate is hits over accesses (routed experts per call and layer). With a calibration (a
//! perf JSON with a decode phase) the predicted tg is the per-slot model of `plan`
//! (`other + sum_l max(k h_l hot, k (1-h_l) cold)` per token) plus each layer's copies per
//! token times [`CopyCost::copy_s`](crate::cache::policy::CopyCost::copy_s) of its expert bytes.

use crate::cache::hot_set::HotSet;
use crate::cache::policy::{belady_hits, LayerPolicy, PolicyConfig, PolicyKind};
use crate::cache::trace::TraceRecord;
use crate::cache::update::{
    plan_exchanges, DEFAULT_HYSTERESIS_MARGIN, DEFAULT_UPDATE_RATE, MIN_WINDOW_SLOTS,
};
use crate::cache::whatif::CostModel;
use serde::Serialize;

/// Share of a trace's calls used as the learn pass.
pub const DEFAULT_LEARN_FRACTION: f64 = 0.1;
/// Calls between two updates of the replayed `online` policy.
pub const DEFAULT_UPDATE_EVERY: usize = 32;

/// A trace cut into per-layer steps.
#[derive(Debug, Clone, PartialEq)]
pub struct Steps {
    pub n_experts: usize,
    /// `layers[l][i]`: the distinct experts of call `i` in layer `l`, ascending.
    pub layers: Vec<Vec<Vec<usize>>>,
    /// `decode[l][i]`: whether call `i` was a decode call (copies are charged per decode token).
    pub decode: Vec<Vec<bool>>,
}

impl Steps {
    /// Steps from a trace's records (each record one layer of one call, in call order).
    pub fn from_records(records: &[TraceRecord], n_layers: usize, n_experts: usize) -> Steps {
        let mut layers = vec![Vec::new(); n_layers];
        let mut decode = vec![Vec::new(); n_layers];
        for r in records {
            layers[r.layer].push(r.experts.iter().map(|x| x[0] as usize).collect());
            decode[r.layer].push(r.phase == "decode");
        }
        Steps { n_experts, layers, decode }
    }

    pub fn n_steps(&self) -> usize {
        self.layers.iter().map(Vec::len).max().unwrap_or(0)
    }
}

/// How to replay.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ReplayOptions {
    /// Hot slots per layer as a share of its experts.
    pub fraction: f64,
    pub learn_fraction: f64,
    pub update_every: usize,
    pub update_rate: f64,
    /// The online policies' settings (their `kind` is set per row; `lag_steps` as the engines).
    pub policy: PolicyConfig,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            fraction: 0.25,
            learn_fraction: DEFAULT_LEARN_FRACTION,
            update_every: DEFAULT_UPDATE_EVERY,
            update_rate: DEFAULT_UPDATE_RATE,
            policy: PolicyConfig::default(),
        }
    }
}

/// One policy's replay.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyRow {
    pub policy: String,
    pub hits: u64,
    pub hit_rate: f64,
    /// Hit rate over Belady's.
    pub of_belady: f64,
    /// Experts copied in (one per exchange).
    pub admissions: u64,
    pub hit_rate_per_layer: Vec<f64>,
    pub tg_tokens_per_s: Option<f64>,
}

/// Every policy at one capacity.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayReport {
    pub fraction: f64,
    pub capacity: usize,
    pub learn_steps: usize,
    pub scored_steps: usize,
    pub accesses: u64,
    pub rows: Vec<PolicyRow>,
}

/// One layer's steps: the learn prefix and the scored rest.
type Split<'a> = (&'a [Vec<usize>], &'a [Vec<usize>]);

/// Per layer: hits and admissions per scored step.
struct LayerRun {
    hits: u64,
    admissions: u64,
}

fn ranking(steps: &[Vec<usize>], n_experts: usize) -> Vec<usize> {
    let mut counts = vec![0u64; n_experts];
    steps.iter().flatten().for_each(|&e| counts[e] += 1);
    let mut order: Vec<usize> = (0..n_experts).collect();
    order.sort_by(|&a, &b| counts[b].cmp(&counts[a]).then(a.cmp(&b)));
    order
}

/// One layer under a step policy: hits against the engine's cache, which takes each step's
/// exchanges `lag` steps after the policy decided them (the policy itself sees them at once, as
/// the engine's residency it is synced to holds every exchange applied by then plus none
/// decided since: the same set).
fn run_policy(
    kind: PolicyKind,
    opts: &ReplayOptions,
    (learn, scored): Split<'_>,
    n: usize,
    cap: usize,
) -> LayerRun {
    let order = ranking(learn, n);
    let mut p = LayerPolicy::new(PolicyConfig { kind, ..opts.policy }, n, &order[..cap], &order);
    learn.iter().for_each(|s| p.observe(s));
    let mut engine = vec![false; n];
    order[..cap].iter().for_each(|&e| engine[e] = true);
    let mut pending = std::collections::VecDeque::new();
    let mut run = LayerRun { hits: 0, admissions: 0 };
    for s in scored {
        run.hits += s.iter().filter(|&&e| engine[e]).count() as u64;
        let out = p.step(s);
        run.admissions += out.exchanges.len() as u64;
        pending.push_back(out.exchanges);
        while pending.len() > opts.policy.lag_steps {
            for (evict, add) in pending.pop_front().unwrap_or_default() {
                (engine[evict], engine[add]) = (false, true);
            }
        }
    }
    run
}

/// Today's updater on every layer at once (it plans across layers): hits and admissions per layer.
fn run_online(steps: &Steps, learn: usize, cap: usize, opts: &ReplayOptions) -> Vec<LayerRun> {
    let n = steps.n_experts;
    let lists: Vec<Vec<usize>> =
        steps.layers.iter().map(|l| ranking(&l[..learn.min(l.len())], n)[..cap].to_vec()).collect();
    let mut hot = HotSet::from_lists(lists.len(), n, 1, &lists);
    let mut runs: Vec<LayerRun> = lists.iter().map(|_| LayerRun { hits: 0, admissions: 0 }).collect();
    let mut window = vec![vec![0u64; n]; lists.len()];
    for i in learn..steps.n_steps() {
        for (l, layer) in steps.layers.iter().enumerate() {
            for &e in layer.get(i).map(Vec::as_slice).unwrap_or(&[]) {
                runs[l].hits += u64::from(hot.layers[l].is_hot(e));
                window[l][e] += 1;
            }
        }
        let total: u64 = window.iter().flatten().sum();
        if !(i + 1 - learn).is_multiple_of(opts.update_every.max(1)) || total < MIN_WINDOW_SLOTS {
            continue;
        }
        let scores: Vec<Vec<f64>> = window
            .iter()
            .map(|c| {
                let t = c.iter().sum::<u64>().max(1) as f64;
                c.iter().map(|&x| x as f64 / t).collect()
            })
            .collect();
        for x in plan_exchanges(&scores, Some(&window), &hot, opts.update_rate, DEFAULT_HYSTERESIS_MARGIN) {
            if hot.apply_exchange(x.layer_idx, x.evict, x.add).is_ok() {
                runs[x.layer_idx].admissions += 1;
            }
        }
        window.iter_mut().for_each(|c| c.fill(0));
    }
    runs
}

/// Replay `steps` under every policy. `calibration` and `layer_expert_bytes` (with `k`, the
/// experts per token) give the predicted tg.
pub fn replay(
    steps: &Steps,
    opts: &ReplayOptions,
    calibration: Option<(&CostModel, &[u64], usize)>,
) -> ReplayReport {
    let n = steps.n_experts;
    let cap = ((opts.fraction.clamp(0.0, 1.0) * n as f64).round() as usize).min(n);
    let n_steps = steps.n_steps();
    let learn = ((opts.learn_fraction.clamp(0.0, 1.0) * n_steps as f64).round() as usize).min(n_steps);
    // per layer: (learn steps, scored steps)
    let parts: Vec<Split> = steps.layers.iter().map(|l| l.split_at(learn.min(l.len()))).collect();
    let accesses_l: Vec<u64> = parts.iter().map(|(_, s)| s.iter().map(|x| x.len() as u64).sum()).collect();
    let accesses: u64 = accesses_l.iter().sum();
    let mut per_policy: Vec<(String, Vec<LayerRun>)> = Vec::new();
    let statics = parts.iter().map(|(learn, scored)| {
        let order = ranking(learn, n);
        let hot = &order[..cap];
        LayerRun { hits: scored.iter().flatten().filter(|e| hot.contains(e)).count() as u64, admissions: 0 }
    });
    per_policy.push(("static".into(), statics.collect()));
    let hindsight = parts.iter().map(|(_, scored)| {
        let hot = &ranking(scored, n)[..cap];
        LayerRun { hits: scored.iter().flatten().filter(|e| hot.contains(e)).count() as u64, admissions: 0 }
    });
    per_policy.push(("hindsight".into(), hindsight.collect()));
    per_policy.push(("online".into(), run_online(steps, learn, cap, opts)));
    for kind in PolicyKind::ONLINE {
        let runs = parts.iter().map(|&part| run_policy(kind, opts, part, n, cap));
        per_policy.push((kind.name().into(), runs.collect()));
    }
    let belady = parts.iter().map(|(learn, scored)| LayerRun {
        hits: belady_hits(scored, &ranking(learn, n)[..cap]),
        admissions: 0,
    });
    per_policy.push(("belady".into(), belady.collect()));
    let belady_hits_total: u64 = per_policy.last().map_or(0, |(_, r)| r.iter().map(|x| x.hits).sum());
    let decode_steps =
        steps.decode.iter().map(|d| d[learn.min(d.len())..].iter().filter(|&&x| x).count()).max();
    let rows = per_policy
        .into_iter()
        .map(|(policy, runs)| {
            let hits: u64 = runs.iter().map(|r| r.hits).sum();
            let admissions = runs.iter().map(|r| r.admissions).sum();
            let rate = |h: u64, a: u64| if a == 0 { 1.0 } else { h as f64 / a as f64 };
            let per_layer: Vec<f64> = runs.iter().zip(&accesses_l).map(|(r, &a)| rate(r.hits, a)).collect();
            let tg = calibration.and_then(|(cost, bytes, k)| {
                let copies: f64 = runs
                    .iter()
                    .zip(bytes)
                    .map(|(r, &b)| r.admissions as f64 * opts.policy.copy_cost.copy_s(b))
                    .sum();
                predicted_tg(cost, &per_layer, k, copies / decode_steps.unwrap_or(0).max(1) as f64)
            });
            PolicyRow {
                policy,
                hits,
                hit_rate: rate(hits, accesses),
                of_belady: rate(hits, belady_hits_total),
                admissions,
                hit_rate_per_layer: per_layer,
                tg_tokens_per_s: tg,
            }
        })
        .collect();
    ReplayReport {
        fraction: opts.fraction,
        capacity: cap,
        learn_steps: learn,
        scored_steps: n_steps - learn,
        accesses,
        rows,
    }
}

/// Decode tokens per second at per-layer hit rates, plus `copy_s_per_token` of copies.
fn predicted_tg(cost: &CostModel, hit_rates: &[f64], k: usize, copy_s_per_token: f64) -> Option<f64> {
    let c = cost.phases.get("decode")?;
    let kf = k as f64;
    let lanes: f64 =
        hit_rates.iter().map(|h| (kf * h * c.hot_us_per_slot).max(kf * (1.0 - h) * c.cold_us_per_slot)).sum();
    let t = c.other_us_per_token + lanes + copy_s_per_token * 1e6;
    (t > 0.0).then(|| 1e6 / t)
}

impl ReplayReport {
    pub fn to_text(&self) -> String {
        let mut s = format!(
            "replay at {:.0}% ({} slots per layer): {} learn calls, {} scored calls, {} accesses\n",
            self.fraction * 100.0,
            self.capacity,
            self.learn_steps,
            self.scored_steps,
            self.accesses
        );
        s.push_str("policy    hit rate  of Belady  copies   tg\n");
        for r in &self.rows {
            let tg = r.tg_tokens_per_s.map_or("-".to_string(), |t| format!("{t:.1} t/s"));
            s.push_str(&format!(
                "{:<9} {:>7.1}%  {:>8.1}%  {:>6}   {}\n",
                r.policy,
                r.hit_rate * 100.0,
                r.of_belady * 100.0,
                r.admissions,
                tg
            ));
        }
        s
    }

    pub fn row(&self, policy: &str) -> Option<&PolicyRow> {
        self.rows.iter().find(|r| r.policy == policy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn steps_of(layer: Vec<Vec<usize>>, n: usize) -> Steps {
        let decode = vec![vec![true; layer.len()]];
        Steps { n_experts: n, layers: vec![layer], decode }
    }

    #[test]
    fn replay_scores_after_the_learn_pass_and_belady_bounds_every_row() {
        // learn: expert 0 twice; then a phase of expert 3 over and over
        let mut layer = vec![vec![0], vec![0]];
        layer.extend((0..18).map(|_| vec![3]));
        let lagged = PolicyConfig { lag_steps: 1, ..PolicyConfig::default() };
        let opts =
            ReplayOptions { fraction: 0.25, learn_fraction: 0.1, policy: lagged, ..ReplayOptions::default() };
        let layer_copy = layer.clone();
        let r = replay(&steps_of(layer, 4), &opts, None);
        assert_eq!((r.capacity, r.learn_steps, r.scored_steps, r.accesses), (1, 2, 18, 18));
        assert_eq!(r.row("static").unwrap().hits, 0);
        assert_eq!(r.row("hindsight").unwrap().hits, 18, "expert 3, every scored call");
        assert_eq!(r.row("belady").unwrap().hits, 17);
        // LRU admits 3 at its first call; the engine has it from the second call after
        assert_eq!(r.row("lru").unwrap().hits, 16);
        for row in r.rows.iter().filter(|row| row.policy != "hindsight") {
            assert!(row.hits <= 17, "{}", row.policy);
        }
        // inline steps (no lag): from the next call
        let policy = PolicyConfig { lag_steps: 0, ..opts.policy };
        let inline = replay(&steps_of(layer_copy, 4), &ReplayOptions { policy, ..opts }, None);
        assert_eq!(inline.row("lru").unwrap().hits, 17);
    }

    #[test]
    fn a_step_policy_serves_its_exchanges_after_the_lag() {
        // a burst of expert 1, one of 2, one of 1 again: one slot, LRU (every miss admitted)
        let mut layer = vec![vec![0]; 2];
        layer.extend([1, 1, 1, 2, 2, 2, 1, 1].iter().map(|&e| vec![e]));
        let steps = steps_of(layer, 4);
        let opts = |lag_steps| ReplayOptions {
            fraction: 0.25,
            learn_fraction: 0.2,
            policy: PolicyConfig { lag_steps, ..PolicyConfig::default() },
            ..Default::default()
        };
        let hits = |lag| replay(&steps, &opts(lag), None).row("lru").unwrap().hits;
        // inline (the default): every call of a burst after its first hits (2 + 2 + 1); one
        // call late, from the third (1 + 1 + 0)
        assert_eq!((hits(0), hits(1)), (5, 2));
        assert_eq!(ReplayOptions::default().policy.lag_steps, 0);
    }

    #[test]
    fn copies_lower_the_predicted_tg() {
        let mut cost = CostModel::default();
        let phase = crate::cache::whatif::PhaseCost {
            tokens: 10,
            other_us_per_token: 1000.0,
            hot_us_per_slot: 10.0,
            cold_us_per_slot: 100.0,
            hot_measured: true,
            layer_call: None,
        };
        cost.phases.insert("decode".into(), phase);
        let a = predicted_tg(&cost, &[0.5], 8, 0.0).unwrap();
        let b = predicted_tg(&cost, &[0.5], 8, 1e-3).unwrap();
        assert!((a - 1e6 / 1400.0).abs() < 1e-6 && b < a);
    }
}
