//! The hot set: per layer, which experts have a copy in a hot lane's cache, in which lane and
//! which slot (`hot_id_map`: expert -> slot), plus the hot/cold masks derived from it.
//!
//! Selection for now (cache planning comes in a later issue):
//! - [`HotSet::from_fraction`]: per layer the `ceil(F * n_experts)` most-used experts of a learn
//!   file (perf JSON, see [`crate::cache::perf`]), else the lowest ids;
//! - [`HotSet::from_experts_file`]: an explicit JSON file, format
//!   `{"layers": {"0": [3, 5, 7], "1": [0]}}` — keys are layer indexes as strings, values the
//!   expert ids that are hot in that layer; layers not listed have no hot experts.
//!
//! With several hot lanes, the hot experts of a layer are dealt round-robin over the lanes in
//! the order they were chosen; each lane numbers its slots from zero.

use crate::cache::perf::{PerfError, PerfReport};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Most hot lanes one worklist can describe (`HOT`, `HOT1`, `HOT2`). Each costs one worklist
/// section of `n_tokens * k` entries and one lane thread.
pub const MAX_HOT_LANES: usize = 3;

/// Where an expert's cached copy lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HotSlot {
    pub lane_idx: u8,
    pub slot_idx: u32,
}

/// Evict expert `evict` from the hot cache of layer `layer_idx` and load `add` into its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exchange {
    pub layer_idx: usize,
    pub evict: usize,
    pub add: usize,
}

/// One layer's hot map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerHotSet {
    /// `hot_id_map[expert] = Some(slot)` for hot experts.
    pub hot_id_map: Vec<Option<HotSlot>>,
    /// `slots[lane][slot] = expert` (the inverse map).
    pub slots: Vec<Vec<u32>>,
}

impl LayerHotSet {
    pub fn is_hot(&self, expert_idx: usize) -> bool {
        self.hot_id_map[expert_idx].is_some()
    }

    /// `hot_mask[e]` is true when expert e is hot; the cold mask is its negation.
    pub fn hot_mask(&self) -> Vec<bool> {
        self.hot_id_map.iter().map(Option::is_some).collect()
    }

    pub fn cold_mask(&self) -> Vec<bool> {
        self.hot_id_map.iter().map(Option::is_none).collect()
    }

    pub fn n_hot(&self) -> usize {
        self.slots.iter().map(Vec::len).sum()
    }
}

/// Every layer's hot map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HotSet {
    pub n_experts: usize,
    pub n_lanes: usize,
    pub layers: Vec<LayerHotSet>,
}

#[derive(Debug, thiserror::Error)]
pub enum HotSetError {
    #[error("--hot-fraction {0}: must be between 0 and 1")]
    BadFraction(f64),
    #[error("hot lanes: {0} requested, 1..={MAX_HOT_LANES} supported")]
    BadLaneCount(usize),
    #[error("{path}: cannot read: {reason}")]
    Io { path: PathBuf, reason: String },
    #[error("{path}: {field}: {reason}")]
    Malformed { path: PathBuf, field: String, reason: String },
    #[error(transparent)]
    Learn(#[from] PerfError),
    #[error("exchange in layer {layer_idx}: {reason}")]
    BadExchange { layer_idx: usize, reason: String },
}

impl HotSet {
    /// No expert hot anywhere.
    pub fn empty(n_layers: usize, n_experts: usize, n_lanes: usize) -> HotSet {
        Self::from_lists(n_layers, n_experts, n_lanes, &vec![Vec::new(); n_layers])
    }

    /// Per layer, the experts in `lists[layer]` (in that order) are hot, dealt round-robin to lanes.
    /// Ids out of range and duplicates are ignored by the callers that validate (see the file loader).
    pub fn from_lists(n_layers: usize, n_experts: usize, n_lanes: usize, lists: &[Vec<usize>]) -> HotSet {
        let n_lanes = n_lanes.clamp(1, MAX_HOT_LANES);
        let layers = (0..n_layers)
            .map(|l| {
                let mut layer =
                    LayerHotSet { hot_id_map: vec![None; n_experts], slots: vec![Vec::new(); n_lanes] };
                for (i, &e) in lists.get(l).map(Vec::as_slice).unwrap_or(&[]).iter().enumerate() {
                    if e >= n_experts || layer.hot_id_map[e].is_some() {
                        continue;
                    }
                    let lane_idx = i % n_lanes;
                    let slot_idx = layer.slots[lane_idx].len() as u32;
                    layer.slots[lane_idx].push(e as u32);
                    layer.hot_id_map[e] = Some(HotSlot { lane_idx: lane_idx as u8, slot_idx });
                }
                layer
            })
            .collect();
        HotSet { n_experts, n_lanes, layers }
    }

    /// `--hot-fraction F`: per layer the `ceil(F * n_experts)` most-used experts of `learn`
    /// (ties: lower id first), or the lowest ids without a learn file.
    pub fn from_fraction(
        n_layers: usize,
        n_experts: usize,
        n_lanes: usize,
        fraction: f64,
        learn: Option<&PerfReport>,
    ) -> Result<HotSet, HotSetError> {
        if !(0.0..=1.0).contains(&fraction) || fraction.is_nan() {
            return Err(HotSetError::BadFraction(fraction));
        }
        if n_lanes == 0 || n_lanes > MAX_HOT_LANES {
            return Err(HotSetError::BadLaneCount(n_lanes));
        }
        let n_hot = ((fraction * n_experts as f64) - 1e-9).ceil().max(0.0) as usize;
        let lists: Vec<Vec<usize>> = (0..n_layers)
            .map(|l| {
                let mut ids: Vec<usize> = (0..n_experts).collect();
                if let Some(counts) = learn.and_then(|r| r.layers.iter().find(|x| x.layer == l)) {
                    let count = |e: usize| counts.experts.get(e).copied().unwrap_or(0);
                    ids.sort_by(|&a, &b| count(b).cmp(&count(a)).then(a.cmp(&b)));
                }
                ids.truncate(n_hot.min(n_experts));
                ids
            })
            .collect();
        Ok(Self::from_lists(n_layers, n_experts, n_lanes, &lists))
    }

    /// `--hot-experts FILE`: `{"layers": {"0": [ids...], ...}}`.
    pub fn from_experts_file(
        path: &Path,
        n_layers: usize,
        n_experts: usize,
        n_lanes: usize,
    ) -> Result<HotSet, HotSetError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| HotSetError::Io { path: path.into(), reason: e.to_string() })?;
        Self::from_experts_json(path, &text, n_layers, n_experts, n_lanes)
    }

    /// The text of a `--hot-experts` file (`path` names it in errors); every key a plain layer
    /// number below `n_layers`, every id an expert below `n_experts`, none twice.
    pub fn from_experts_json(
        path: &Path,
        text: &str,
        n_layers: usize,
        n_experts: usize,
        n_lanes: usize,
    ) -> Result<HotSet, HotSetError> {
        let malformed = |field: &str, reason: String| HotSetError::Malformed {
            path: path.into(),
            field: field.into(),
            reason,
        };
        #[derive(serde::Deserialize)]
        struct File {
            layers: BTreeMap<String, Vec<u64>>,
        }
        let file: File = serde_json::from_str(text).map_err(|e| malformed("layers", e.to_string()))?;
        if n_lanes == 0 || n_lanes > MAX_HOT_LANES {
            return Err(HotSetError::BadLaneCount(n_lanes));
        }
        let mut lists = vec![Vec::new(); n_layers];
        for (key, ids) in &file.layers {
            let field = format!("layers.{key}");
            let layer_idx: usize =
                key.parse().ok().filter(|n: &usize| n.to_string() == *key).ok_or_else(|| {
                    malformed(
                        &field,
                        "layer key must be a layer number written plainly (\"0\", not \"00\" or \"+0\")"
                            .into(),
                    )
                })?;
            if layer_idx >= n_layers {
                return Err(malformed(&field, format!("the model has {n_layers} layers")));
            }
            for &e in ids {
                if e as usize >= n_experts {
                    return Err(malformed(
                        &field,
                        format!("expert {e} out of range (the model has {n_experts})"),
                    ));
                }
                if lists[layer_idx].contains(&(e as usize)) {
                    return Err(malformed(&field, format!("expert {e} listed twice")));
                }
                lists[layer_idx].push(e as usize);
            }
        }
        Ok(Self::from_lists(n_layers, n_experts, n_lanes, &lists))
    }

    /// Exchange one slot: expert `evict` leaves the cache, expert `add` takes its slot; the maps
    /// are rewritten. Returns the slot that now holds `add`.
    pub fn apply_exchange(
        &mut self,
        layer_idx: usize,
        evict: usize,
        add: usize,
    ) -> Result<HotSlot, HotSetError> {
        let bad = |reason: String| HotSetError::BadExchange { layer_idx, reason };
        let layer = self.layers.get_mut(layer_idx).ok_or_else(|| bad("no such layer".into()))?;
        if evict >= self.n_experts || add >= self.n_experts {
            return Err(bad(format!("expert id out of range ({} experts)", self.n_experts)));
        }
        let slot = layer.hot_id_map[evict].ok_or_else(|| bad(format!("expert {evict} is not hot")))?;
        if layer.hot_id_map[add].is_some() {
            return Err(bad(format!("expert {add} is already hot")));
        }
        layer.hot_id_map[evict] = None;
        layer.hot_id_map[add] = Some(slot);
        layer.slots[slot.lane_idx as usize][slot.slot_idx as usize] = add as u32;
        Ok(slot)
    }

    /// Hot experts per layer as the `--hot-experts` file format.
    pub fn to_experts_json(&self) -> serde_json::Value {
        let mut layers = serde_json::Map::new();
        for (l, layer) in self.layers.iter().enumerate() {
            let ids: Vec<usize> = (0..self.n_experts).filter(|&e| layer.is_hot(e)).collect();
            layers.insert(l.to_string(), serde_json::json!(ids));
        }
        serde_json::json!({ "layers": layers })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fraction_picks_most_used_or_lowest_ids() {
        let hs = HotSet::from_fraction(2, 8, 1, 0.5, None).unwrap();
        assert_eq!(hs.layers[0].slots[0], vec![0, 1, 2, 3]);
        let learn: PerfReport =
            serde_json::from_str(r#"{"layers":[{"layer":1,"experts":[0,9,0,5,7,1,0,3]}]}"#).unwrap();
        let hs = HotSet::from_fraction(2, 8, 2, 0.5, Some(&learn)).unwrap();
        assert_eq!(hs.layers[1].slots, vec![vec![1, 3], vec![4, 7]]);
        assert_eq!(hs.layers[1].hot_id_map[4], Some(HotSlot { lane_idx: 1, slot_idx: 0 }));
        assert_eq!(HotSet::from_fraction(1, 8, 1, 0.0, None).unwrap().layers[0].n_hot(), 0);
        assert_eq!(HotSet::from_fraction(1, 8, 1, 1.0, None).unwrap().layers[0].n_hot(), 8);
        assert!(HotSet::from_fraction(1, 8, 1, 1.5, None).is_err());
    }

    #[test]
    fn exchange_rewrites_both_maps() {
        let mut hs = HotSet::from_fraction(1, 4, 1, 0.5, None).unwrap();
        let slot = hs.apply_exchange(0, 1, 3).unwrap();
        assert_eq!(slot.slot_idx, 1);
        assert_eq!(hs.layers[0].slots[0], vec![0, 3]);
        assert!(!hs.layers[0].is_hot(1) && hs.layers[0].is_hot(3));
        assert!(hs.apply_exchange(0, 1, 2).is_err());
        assert!(hs.apply_exchange(0, 0, 3).is_err());
    }

    #[test]
    fn experts_file_round_trip_and_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hot.json");
        let hs = HotSet::from_lists(2, 6, 1, &[vec![5, 1], vec![]]);
        std::fs::write(&path, hs.to_experts_json().to_string()).unwrap();
        let back = HotSet::from_experts_file(&path, 2, 6, 1).unwrap();
        assert!(back.layers[0].is_hot(5) && back.layers[0].is_hot(1) && back.layers[1].n_hot() == 0);
        std::fs::write(&path, r#"{"layers": {"0": [9]}}"#).unwrap();
        let err = HotSet::from_experts_file(&path, 2, 6, 1).unwrap_err().to_string();
        assert!(
            err.contains("hot.json") && err.contains("layers.0") && err.contains("out of range"),
            "{err}"
        );
    }
}
