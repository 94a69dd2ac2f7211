//! Typed observations: the one reading of perf JSON shared by learn files, live perf snapshots
//! (the engine's own [`PerfState`](crate::cache::perf::PerfState)), manual applies (a learn file posted to `/moe-hot-cache`)
//! and automatic updates (the difference of two snapshots). Seed 003 calls it
//! `parse_observations`.
//!
//! Per layer: every expert's hot, cold and raw counts (a learn pass has only raw counts, a live
//! snapshot has the hot/cold split), calls, cold slots per call, the per-call lane times, and
//! the wait per cold slot (the pressure signal of `cache::weighting`).
//!
//! Parsing is tolerant of missing optional fields (they read as zero) and strict on wrong types
//! ([`PerfReport::parse`] names the field). A document that names the model it was recorded on
//! (`"model"`: architecture, layer and expert counts, expert shape) is refused on another model,
//! naming the first field that differs; an older document without it is checked by its layer
//! and expert counts.

use crate::cache::perf::{LayerPerf, ModelFingerprint, PerfError, PerfReport, PhasePerf};
use crate::model::Model;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One expert row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExpertObservation {
    pub expert: usize,
    /// Slots served from the hot cache.
    pub hot: u64,
    /// Slots that went to the cold lane.
    pub cold: u64,
    /// Slots counted without a hot/cold split (a learn pass), or hot + cold.
    pub raw: u64,
}

impl ExpertObservation {
    /// Routed slots of this expert: hot + cold when split, else raw.
    pub fn count(&self) -> u64 {
        if self.hot + self.cold > 0 {
            self.hot + self.cold
        } else {
            self.raw
        }
    }
}

/// One layer: where hit data and timing pressure meet.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LayerObservation {
    pub layer: usize,
    pub experts: Vec<ExpertObservation>,
    /// Whether hot/cold branch counts are present (a live snapshot) or only raw counts.
    pub has_branch_counts: bool,
    pub calls: u64,
    pub cold_slots_per_call: f64,
    pub hot_time_per_call_us: f64,
    pub cold_time_per_call_us: f64,
    pub join_wait_per_call_us: f64,
    pub moe_time_per_call_us: f64,
    /// Join wait per cold slot; when the run recorded no join wait, cold-lane time per cold
    /// slot; without either, MoE time per routed slot (zero when nothing was timed).
    pub wait_per_cold_slot_us: f64,
}

impl LayerObservation {
    pub fn total(&self) -> u64 {
        self.experts.iter().map(ExpertObservation::count).sum()
    }

    /// Share of the layer's routed slots that went to hot experts (0 without branch counts).
    pub fn hit_rate(&self) -> f64 {
        let hot: u64 = self.experts.iter().map(|e| e.hot).sum();
        let all: u64 = self.experts.iter().map(|e| e.hot + e.cold).sum();
        if all == 0 {
            0.0
        } else {
            hot as f64 / all as f64
        }
    }
}

/// Every layer of one model, indexed by layer.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Observations {
    pub model: Option<ModelFingerprint>,
    pub n_experts: usize,
    pub n_experts_used: usize,
    pub layers: Vec<LayerObservation>,
    /// Per-phase call totals (the cost model's calibration).
    pub phases: BTreeMap<String, PhasePerf>,
}

/// A perf document that cannot be used for this model.
#[derive(Debug, thiserror::Error)]
pub enum ObserveError {
    #[error(transparent)]
    Perf(#[from] PerfError),
    #[error("{source_name}: recorded on another model: {field} is {found} there, {expected} in this model")]
    ModelMismatch { source_name: PathBuf, field: &'static str, expected: String, found: String },
    #[error("{source_name}: layers[{index}].layer is {layer}, past the model's {n_layers} layers")]
    LayerOutOfRange { source_name: PathBuf, index: usize, layer: usize, n_layers: usize },
    #[error("{source_name}: layer {layer} appears twice")]
    DuplicateLayer { source_name: PathBuf, layer: usize },
    #[error("{source_name}: expert counts for {found} layers; this model has {expected} (a learn file from another model?)")]
    MissingLayers { source_name: PathBuf, found: usize, expected: usize },
}

impl ModelFingerprint {
    pub fn of(model: &Model) -> ModelFingerprint {
        let c = model.config();
        let architecture = serde_json::to_value(c.arch)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_else(|| format!("{:?}", c.arch));
        ModelFingerprint {
            architecture,
            n_layers: c.n_layers,
            n_experts: c.n_experts,
            n_experts_used: c.n_experts_used,
            expert_shape: [c.hidden, c.expert_ff],
        }
    }

    /// The first field where `other` differs: (name, ours, theirs).
    fn first_difference(&self, other: &ModelFingerprint) -> Option<(&'static str, String, String)> {
        let pairs: [(&'static str, String, String); 5] = [
            ("architecture", self.architecture.clone(), other.architecture.clone()),
            ("n_layers", self.n_layers.to_string(), other.n_layers.to_string()),
            ("n_experts", self.n_experts.to_string(), other.n_experts.to_string()),
            ("n_experts_used", self.n_experts_used.to_string(), other.n_experts_used.to_string()),
            ("expert_shape", format!("{:?}", self.expert_shape), format!("{:?}", other.expert_shape)),
        ];
        pairs.into_iter().find(|(_, a, b)| a != b)
    }
}

/// Parse a learn file, a perf snapshot or a manual-apply payload (`source` names it in errors)
/// for the model `model`.
pub fn parse_observations(
    source: &Path,
    text: &str,
    model: &ModelFingerprint,
) -> Result<Observations, ObserveError> {
    // Array lengths are checked after the model fingerprint, so another model's file is named
    // as such rather than by its first short array.
    let report = PerfReport::parse(source, text, None)?;
    observations_from_report(source, &report, model)
}

/// Read and parse a learn file.
pub fn read_observations(path: &Path, model: &ModelFingerprint) -> Result<Observations, ObserveError> {
    let report = PerfReport::read(path, None)?;
    observations_from_report(path, &report, model)
}

/// A document recorded on `theirs` is refused for `model` (naming the first field that differs).
pub(crate) fn check_fingerprint(
    source: &Path,
    model: &ModelFingerprint,
    theirs: &ModelFingerprint,
) -> Result<(), ObserveError> {
    match model.first_difference(theirs) {
        Some((field, expected, found)) => {
            Err(ObserveError::ModelMismatch { source_name: source.into(), field, expected, found })
        }
        None => Ok(()),
    }
}

/// Typed observations of an already parsed document, checked against `model`.
pub fn observations_from_report(
    source: &Path,
    report: &PerfReport,
    model: &ModelFingerprint,
) -> Result<Observations, ObserveError> {
    let mismatch = |field, expected: String, found: String| ObserveError::ModelMismatch {
        source_name: source.into(),
        field,
        expected,
        found,
    };
    if let Some(theirs) = &report.model {
        check_fingerprint(source, model, theirs)?;
    }
    if report.n_expert != 0 && report.n_expert != model.n_experts {
        return Err(mismatch("n_expert", model.n_experts.to_string(), report.n_expert.to_string()));
    }
    let mut layers: Vec<Option<LayerObservation>> = vec![None; model.n_layers];
    for (index, lp) in report.layers.iter().enumerate() {
        if lp.layer >= model.n_layers {
            return Err(ObserveError::LayerOutOfRange {
                source_name: source.into(),
                index,
                layer: lp.layer,
                n_layers: model.n_layers,
            });
        }
        for (name, a) in
            [("experts", &lp.experts), ("hot_experts", &lp.hot_experts), ("cold_experts", &lp.cold_experts)]
        {
            if !a.is_empty() && a.len() != model.n_experts {
                return Err(PerfError::Malformed {
                    path: source.into(),
                    field: format!("layers[{index}].{name}"),
                    reason: format!("has {} entries, the model has {} experts", a.len(), model.n_experts),
                }
                .into());
            }
        }
        if layers[lp.layer].is_some() {
            return Err(ObserveError::DuplicateLayer { source_name: source.into(), layer: lp.layer });
        }
        if lp.experts.is_empty() && lp.hot_experts.is_empty() && lp.cold_experts.is_empty() {
            continue;
        }
        layers[lp.layer] = Some(layer_observation(lp, model.n_experts));
    }
    let found = layers.iter().filter(|l| l.is_some()).count();
    if found != model.n_layers {
        return Err(ObserveError::MissingLayers {
            source_name: source.into(),
            found,
            expected: model.n_layers,
        });
    }
    Ok(Observations {
        model: report.model.clone(),
        n_experts: model.n_experts,
        n_experts_used: model.n_experts_used,
        layers: layers.into_iter().map(|l| l.expect("checked above")).collect(),
        phases: report.phases.clone(),
    })
}

fn per(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

fn layer_observation(lp: &LayerPerf, n_experts: usize) -> LayerObservation {
    let at = |v: &[u64], e: usize| v.get(e).copied().unwrap_or(0);
    let experts: Vec<ExpertObservation> = (0..n_experts)
        .map(|e| {
            let (hot, cold) = (at(&lp.hot_experts, e), at(&lp.cold_experts, e));
            let raw = at(&lp.experts, e).max(hot + cold);
            ExpertObservation { expert: e, hot, cold, raw }
        })
        .collect();
    let has_branch_counts = experts.iter().any(|x| x.hot + x.cold > 0);
    let cold_slots =
        if lp.cold_slots_total > 0 { lp.cold_slots_total } else { experts.iter().map(|x| x.cold).sum() };
    let hits = experts.iter().map(ExpertObservation::count).sum::<u64>().max(lp.expert_hits_total);
    let wait_per_cold_slot_us = if lp.parallel_join_wait_us > 0 && cold_slots > 0 {
        per(lp.parallel_join_wait_us, cold_slots)
    } else if lp.parallel_cold_time_us > 0 && cold_slots > 0 {
        per(lp.parallel_cold_time_us, cold_slots)
    } else {
        per(lp.moe_time_us, hits)
    };
    LayerObservation {
        layer: lp.layer,
        experts,
        has_branch_counts,
        calls: lp.calls,
        cold_slots_per_call: per(cold_slots, lp.calls),
        hot_time_per_call_us: per(lp.parallel_hot_time_us, lp.calls),
        cold_time_per_call_us: per(lp.parallel_cold_time_us, lp.calls),
        join_wait_per_call_us: per(lp.parallel_join_wait_us, lp.calls),
        moe_time_per_call_us: per(lp.moe_time_us, lp.calls),
        wait_per_cold_slot_us,
    }
}

impl Observations {
    /// Observations with raw counts only (no timings): what a plain count table says.
    pub fn from_counts(counts: &[Vec<u64>], n_experts_used: usize) -> Observations {
        let n_experts = counts.first().map_or(0, Vec::len);
        let layers = counts
            .iter()
            .enumerate()
            .map(|(layer, c)| LayerObservation {
                layer,
                experts: c
                    .iter()
                    .enumerate()
                    .map(|(expert, &raw)| ExpertObservation { expert, hot: 0, cold: 0, raw })
                    .collect(),
                ..LayerObservation::default()
            })
            .collect();
        Observations { model: None, n_experts, n_experts_used, layers, phases: BTreeMap::new() }
    }

    /// Per layer, per expert routed slots.
    pub fn counts(&self) -> Vec<Vec<u64>> {
        self.layers.iter().map(|l| l.experts.iter().map(ExpertObservation::count).collect()).collect()
    }

    /// Share of routed slots served hot, over every layer.
    pub fn hit_rate(&self) -> f64 {
        let hot: u64 = self.layers.iter().flat_map(|l| &l.experts).map(|e| e.hot).sum();
        let all: u64 = self.layers.iter().flat_map(|l| &l.experts).map(|e| e.hot + e.cold).sum();
        per(hot, all)
    }

    /// What happened between two snapshots of the same live perf state (the automatic
    /// updater's window): counts and times are differences; the model is `after`'s.
    pub fn between(before: &PerfReport, after: &PerfReport, model: &ModelFingerprint) -> Observations {
        let diff = |a: &[u64], b: &[u64]| -> Vec<u64> {
            b.iter().enumerate().map(|(i, &x)| x.saturating_sub(a.get(i).copied().unwrap_or(0))).collect()
        };
        let d = |a: u64, b: u64| b.saturating_sub(a);
        let layers = after
            .layers
            .iter()
            .map(|b| {
                let empty = LayerPerf::default();
                let a = before.layers.iter().find(|x| x.layer == b.layer).unwrap_or(&empty);
                let lp = LayerPerf {
                    layer: b.layer,
                    calls: d(a.calls, b.calls),
                    expert_hits_total: d(a.expert_hits_total, b.expert_hits_total),
                    hot_slots_total: d(a.hot_slots_total, b.hot_slots_total),
                    cold_slots_total: d(a.cold_slots_total, b.cold_slots_total),
                    moe_time_us: d(a.moe_time_us, b.moe_time_us),
                    parallel_hot_time_us: d(a.parallel_hot_time_us, b.parallel_hot_time_us),
                    parallel_cold_time_us: d(a.parallel_cold_time_us, b.parallel_cold_time_us),
                    parallel_join_wait_us: d(a.parallel_join_wait_us, b.parallel_join_wait_us),
                    experts: diff(&a.experts, &b.experts),
                    hot_experts: diff(&a.hot_experts, &b.hot_experts),
                    cold_experts: diff(&a.cold_experts, &b.cold_experts),
                    ..LayerPerf::default()
                };
                layer_observation(&lp, model.n_experts)
            })
            .collect();
        Observations {
            model: Some(model.clone()),
            n_experts: model.n_experts,
            n_experts_used: model.n_experts_used,
            layers,
            phases: BTreeMap::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp() -> ModelFingerprint {
        ModelFingerprint {
            architecture: "qwen3_moe".into(),
            n_layers: 2,
            n_experts: 3,
            n_experts_used: 1,
            expert_shape: [8, 4],
        }
    }

    #[test]
    fn learn_and_live_documents_read_the_same_way() {
        let p = Path::new("learn.json");
        // A learn file: raw counts only, no timings, no model section.
        let learn = parse_observations(
            p,
            r#"{"layers": [{"layer": 1, "experts": [0, 2, 1]}, {"layer": 0, "experts": [3, 0, 0]}]}"#,
            &fp(),
        )
        .unwrap();
        assert_eq!(learn.counts(), vec![vec![3, 0, 0], vec![0, 2, 1]]);
        assert!(!learn.layers[0].has_branch_counts);
        // A live snapshot: hot/cold split and timings.
        let live = parse_observations(
            p,
            r#"{"layers": [
                {"layer": 0, "calls": 4, "cold_slots_total": 2, "parallel_join_wait_us": 10,
                 "experts": [3, 0, 1], "hot_experts": [3, 0, 0], "cold_experts": [0, 0, 1]},
                {"layer": 1, "calls": 4, "hot_experts": [0, 0, 0], "cold_experts": [2, 1, 1],
                 "parallel_cold_time_us": 8}]}"#,
            &fp(),
        )
        .unwrap();
        let l0 = &live.layers[0];
        assert!(l0.has_branch_counts);
        assert_eq!(l0.experts[0], ExpertObservation { expert: 0, hot: 3, cold: 0, raw: 3 });
        assert_eq!(l0.cold_slots_per_call, 0.5);
        assert_eq!(l0.wait_per_cold_slot_us, 5.0, "join wait per cold slot");
        assert_eq!(live.layers[1].wait_per_cold_slot_us, 2.0, "no join wait: cold time per cold slot");
        assert!((live.hit_rate() - 3.0 / 8.0).abs() < 1e-12);
    }

    #[test]
    fn another_models_file_is_refused_naming_the_field() {
        let p = Path::new("other.json");
        let mut theirs = fp();
        theirs.expert_shape = [8, 16];
        let doc = serde_json::json!({"model": theirs, "layers": [
            {"layer": 0, "experts": [1, 0, 0]}, {"layer": 1, "experts": [1, 0, 0]}]});
        let err = parse_observations(p, &doc.to_string(), &fp()).unwrap_err().to_string();
        assert!(
            err.contains("other.json") && err.contains("expert_shape") && err.contains("[8, 16]"),
            "{err}"
        );
        let err = parse_observations(p, r#"{"layers": [{"layer": 0, "experts": [1, 0, 0]}]}"#, &fp())
            .unwrap_err()
            .to_string();
        assert!(err.contains("1 layers") && err.contains("has 2"), "{err}");
        let err = parse_observations(p, r#"{"n_expert": 5, "layers": []}"#, &fp()).unwrap_err().to_string();
        assert!(err.contains("n_expert is 5 there"), "{err}");
        let err = parse_observations(p, r#"{"layers": [{"layer": 7, "experts": [1, 0, 0]}]}"#, &fp())
            .unwrap_err()
            .to_string();
        assert!(err.contains("layers[0].layer is 7"), "{err}");
        let err = parse_observations(p, r#"{"layers": [{"layer": 0, "calls": "many"}]}"#, &fp())
            .unwrap_err()
            .to_string();
        assert!(err.contains("layers[0].calls"), "wrong types are refused: {err}");
        let err = parse_observations(p, r#"{"layers": [{"layer": 0, "experts": [1]}]}"#, &fp())
            .unwrap_err()
            .to_string();
        assert!(err.contains("layers[0].experts") && err.contains("has 1 entries"), "{err}");
    }

    #[test]
    fn window_between_two_snapshots() {
        let mut a = PerfReport { n_expert: 3, ..PerfReport::default() };
        for layer in 0..2 {
            a.layers.push(LayerPerf {
                layer,
                hot_experts: vec![1, 0, 0],
                cold_experts: vec![0, 1, 0],
                experts: vec![1, 1, 0],
                ..LayerPerf::default()
            });
        }
        let mut b = a.clone();
        b.layers[1].cold_experts = vec![0, 1, 5];
        b.layers[1].experts = vec![1, 1, 5];
        let w = Observations::between(&a, &b, &fp());
        assert_eq!(w.counts(), vec![vec![0, 0, 0], vec![0, 0, 5]]);
        assert_eq!(w.hit_rate(), 0.0);
    }
}
