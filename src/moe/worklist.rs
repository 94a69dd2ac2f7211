//! The worklist: the compact description of one layer's expert work (DESIGN.md "The worklist").
//!
//! For `n_tokens` tokens and `k` experts per token there are `n_tokens * k` *slots*; slot
//! `t * k + j` is token t's j-th choice. Every slot goes to exactly one section: the hot section
//! of the lane that caches its expert (`HOT`, `HOT1`, `HOT2`), or the cold section. Each section
//! is a set of columns (the DESIGN.md fields) whose first `count` entries are valid (compact
//! prefixes). Order is token-major (slot order) or expert-major (grouped by expert id, slot order
//! within an expert, so each expert's weights are read once per layer).
//!
//! Columns are allocated once to capacity (`max_tokens * k`) and reused; [`Worklist::build`]
//! never allocates.

use crate::cache::hot_set::{LayerHotSet, MAX_HOT_LANES};

/// Entry order inside every section.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum WorklistOrder {
    /// Slot order: token by token (decode, warmup).
    #[serde(rename = "token")]
    TokenMajor,
    /// Grouped by expert id (prompt processing).
    #[serde(rename = "expert")]
    ExpertMajor,
}

/// One hot lane's section: `HOT_ID` (cache slot), `HOT_SRC_SLOT`, `HOT_TOKEN_ID`, `HOT_WEIGHT`,
/// `HOT_EXPERT_ID` (original id, for accounting) and `HOT_COUNT`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HotSection {
    pub hot_id: Vec<u32>,
    pub hot_src_slot: Vec<u32>,
    pub hot_token_id: Vec<u32>,
    pub hot_weight: Vec<f32>,
    pub hot_expert_id: Vec<u32>,
    pub hot_count: usize,
}

/// Why a worklist cannot be built or is not consistent.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum WorklistError {
    #[error("{n_slots} slots exceed the worklist capacity of {capacity}")]
    OverCapacity { n_slots: usize, capacity: usize },
    #[error("routes have k = {found}, the worklist was sized for k = {expected}")]
    WrongK { found: usize, expected: usize },
    #[error("slot {slot}: {reason}")]
    Inconsistent { slot: usize, reason: &'static str },
    #[error("section counts do not add up: hot {n_hot} + cold {n_cold} != {n_slots} slots")]
    Counts { n_hot: usize, n_cold: usize, n_slots: usize },
}

/// The worklist of one layer (see the module doc).
#[derive(Debug, Clone)]
pub struct Worklist {
    pub n_tokens: usize,
    pub k: usize,
    pub order: WorklistOrder,
    /// Hot lanes in use (1..=3); sections past it stay empty.
    pub n_hot_lanes: usize,
    pub hot: [HotSection; MAX_HOT_LANES],
    /// `COLD_ID`: the original expert id.
    pub cold_id: Vec<u32>,
    pub cold_src_slot: Vec<u32>,
    pub cold_token_id: Vec<u32>,
    pub cold_weight: Vec<f32>,
    pub cold_count: usize,
    capacity: usize,
    n_experts: usize,
    /// Scratch: per-expert counters (counting sort), `n_experts + 1`.
    expert_starts: Vec<u32>,
    /// Scratch: the slot visit order, `capacity`.
    visit: Vec<u32>,
    /// Scratch for the consistency check, `capacity`.
    seen: Vec<bool>,
}

impl Worklist {
    /// Capacity `max_tokens * k` per section (a lane may hold every slot).
    pub fn new(max_tokens: usize, k: usize, n_experts: usize) -> Worklist {
        let capacity = max_tokens * k;
        let section = || HotSection {
            hot_id: vec![0; capacity],
            hot_src_slot: vec![0; capacity],
            hot_token_id: vec![0; capacity],
            hot_weight: vec![0.0; capacity],
            hot_expert_id: vec![0; capacity],
            hot_count: 0,
        };
        Worklist {
            n_tokens: 0,
            k,
            order: WorklistOrder::TokenMajor,
            n_hot_lanes: 1,
            hot: [section(), section(), section()],
            cold_id: vec![0; capacity],
            cold_src_slot: vec![0; capacity],
            cold_token_id: vec![0; capacity],
            cold_weight: vec![0.0; capacity],
            cold_count: 0,
            capacity,
            n_experts,
            expert_starts: vec![0; n_experts + 1],
            visit: vec![0; capacity],
            seen: vec![false; capacity],
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn n_slots(&self) -> usize {
        self.n_tokens * self.k
    }

    /// Break the worklist on purpose (fault injection: proves the consistency check and the
    /// fallback): duplicate a cold slot, or point a hot entry at a slot that does not exist.
    pub fn inject_corruption(&mut self) {
        if self.cold_count >= 2 {
            self.cold_src_slot[1] = self.cold_src_slot[0];
        } else if self.hot[0].hot_count >= 1 {
            self.hot[0].hot_id[0] = u32::MAX;
        } else {
            self.cold_count = self.cold_count.saturating_sub(1);
        }
    }

    /// Sum of the hot sections' counts (for hit rates).
    pub fn hot_count_total(&self) -> usize {
        self.hot[..self.n_hot_lanes].iter().map(|s| s.hot_count).sum()
    }

    /// Build from routes (`expert_ids`/`weights`, `[n_tokens * k]`) and the layer's hot map.
    /// `hot: None` sends every slot cold (the all-cold plan).
    pub fn build(
        &mut self,
        expert_ids: &[u32],
        weights: &[f32],
        n_tokens: usize,
        k: usize,
        hot: Option<&LayerHotSet>,
        order: WorklistOrder,
    ) -> Result<(), WorklistError> {
        let n_slots = n_tokens * k;
        if k != self.k {
            return Err(WorklistError::WrongK { found: k, expected: self.k });
        }
        if n_slots > self.capacity || expert_ids.len() != n_slots || weights.len() != n_slots {
            return Err(WorklistError::OverCapacity {
                n_slots: n_slots.max(expert_ids.len()),
                capacity: self.capacity,
            });
        }
        self.n_tokens = n_tokens;
        self.order = order;
        self.n_hot_lanes = hot.map(|h| h.slots.len()).unwrap_or(1).clamp(1, MAX_HOT_LANES);
        for s in &mut self.hot {
            s.hot_count = 0;
        }
        self.cold_count = 0;
        // The visit order: identity, or a stable counting sort by expert id.
        match order {
            WorklistOrder::TokenMajor => {
                for (i, v) in self.visit[..n_slots].iter_mut().enumerate() {
                    *v = i as u32;
                }
            }
            WorklistOrder::ExpertMajor => {
                let starts = &mut self.expert_starts;
                starts.iter_mut().for_each(|c| *c = 0);
                for &e in expert_ids {
                    let e = (e as usize).min(self.n_experts - 1);
                    starts[e + 1] += 1;
                }
                for e in 0..self.n_experts {
                    starts[e + 1] += starts[e];
                }
                for (slot, &e) in expert_ids.iter().enumerate() {
                    let e = (e as usize).min(self.n_experts - 1);
                    self.visit[starts[e] as usize] = slot as u32;
                    starts[e] += 1;
                }
            }
        }
        for i in 0..n_slots {
            let slot = self.visit[i] as usize;
            let expert = expert_ids[slot];
            let token = (slot / k) as u32;
            let weight = weights[slot];
            match hot.and_then(|h| h.hot_id_map.get(expert as usize).copied().flatten()) {
                Some(hs) => {
                    let s = &mut self.hot[hs.lane_idx as usize];
                    let n = s.hot_count;
                    s.hot_id[n] = hs.slot_idx;
                    s.hot_src_slot[n] = slot as u32;
                    s.hot_token_id[n] = token;
                    s.hot_weight[n] = weight;
                    s.hot_expert_id[n] = expert;
                    s.hot_count += 1;
                }
                None => {
                    let n = self.cold_count;
                    self.cold_id[n] = expert;
                    self.cold_src_slot[n] = slot as u32;
                    self.cold_token_id[n] = token;
                    self.cold_weight[n] = weight;
                    self.cold_count += 1;
                }
            }
        }
        Ok(())
    }

    /// Every slot in exactly one section, token ids matching slots, ids in range, weights
    /// finite, counts adding up, and the declared order respected. `hot` is the map the hot ids
    /// must agree with.
    pub fn check_consistency(&mut self, hot: Option<&LayerHotSet>) -> Result<(), WorklistError> {
        let n_slots = self.n_slots();
        let n_hot = self.hot_count_total();
        if n_slots > self.capacity || n_hot + self.cold_count != n_slots {
            return Err(WorklistError::Counts { n_hot, n_cold: self.cold_count, n_slots });
        }
        let (k, n_experts) = (self.k, self.n_experts);
        let seen = &mut self.seen;
        seen[..n_slots].iter_mut().for_each(|s| *s = false);
        let mut visit = |slot: u32, token: u32, expert: u32, weight: f32| -> Result<(), WorklistError> {
            let slot = slot as usize;
            let bad = |reason| Err(WorklistError::Inconsistent { slot, reason });
            if slot >= n_slots {
                return bad("source slot out of range");
            }
            if seen[slot] {
                return bad("slot appears twice");
            }
            seen[slot] = true;
            if token as usize != slot / k {
                return bad("token id does not match the slot");
            }
            if expert as usize >= n_experts {
                return bad("expert id out of range");
            }
            if !weight.is_finite() {
                return bad("weight is not finite");
            }
            Ok(())
        };
        for (lane_idx, s) in self.hot.iter().enumerate() {
            if lane_idx >= self.n_hot_lanes && s.hot_count > 0 {
                return Err(WorklistError::Counts { n_hot, n_cold: self.cold_count, n_slots });
            }
            for i in 0..s.hot_count {
                visit(s.hot_src_slot[i], s.hot_token_id[i], s.hot_expert_id[i], s.hot_weight[i])?;
                let slot = s.hot_src_slot[i] as usize;
                let agrees = hot
                    .and_then(|h| h.hot_id_map[s.hot_expert_id[i] as usize])
                    .is_some_and(|hs| hs.lane_idx as usize == lane_idx && hs.slot_idx == s.hot_id[i]);
                if !agrees {
                    return Err(WorklistError::Inconsistent {
                        slot,
                        reason: "hot id disagrees with the hot map",
                    });
                }
            }
            if !ordered(&s.hot_expert_id[..s.hot_count], &s.hot_src_slot[..s.hot_count], self.order) {
                return Err(WorklistError::Inconsistent { slot: 0, reason: "hot section out of order" });
            }
        }
        for i in 0..self.cold_count {
            visit(self.cold_src_slot[i], self.cold_token_id[i], self.cold_id[i], self.cold_weight[i])?;
            if hot.is_some_and(|h| h.is_hot(self.cold_id[i] as usize)) {
                return Err(WorklistError::Inconsistent {
                    slot: self.cold_src_slot[i] as usize,
                    reason: "cold entry of a hot expert",
                });
            }
        }
        if !ordered(&self.cold_id[..self.cold_count], &self.cold_src_slot[..self.cold_count], self.order) {
            return Err(WorklistError::Inconsistent { slot: 0, reason: "cold section out of order" });
        }
        Ok(())
    }

    /// Column pointers and capacities, to prove that steady-state builds do not allocate.
    pub fn buffer_fingerprint(&self) -> Vec<(usize, usize)> {
        let mut v = vec![
            (self.cold_id.as_ptr() as usize, self.cold_id.capacity()),
            (self.cold_src_slot.as_ptr() as usize, self.cold_src_slot.capacity()),
            (self.cold_weight.as_ptr() as usize, self.cold_weight.capacity()),
            (self.visit.as_ptr() as usize, self.visit.capacity()),
        ];
        for s in &self.hot {
            v.push((s.hot_id.as_ptr() as usize, s.hot_id.capacity()));
            v.push((s.hot_weight.as_ptr() as usize, s.hot_weight.capacity()));
        }
        v
    }
}

fn ordered(experts: &[u32], slots: &[u32], order: WorklistOrder) -> bool {
    let key = |i: usize| match order {
        WorklistOrder::TokenMajor => (0, slots[i]),
        WorklistOrder::ExpertMajor => (experts[i], slots[i]),
    };
    (1..experts.len()).all(|i| key(i - 1) < key(i))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::hot_set::HotSet;

    fn routes() -> (Vec<u32>, Vec<f32>) {
        // 3 tokens, k = 2, 4 experts.
        (vec![2, 0, 1, 2, 3, 0], vec![0.6, 0.4, 0.7, 0.3, 0.5, 0.5])
    }

    #[test]
    fn prefixes_counts_and_order() {
        let (ids, w) = routes();
        let hs = HotSet::from_lists(1, 4, 1, &[vec![0, 3]]);
        let mut wl = Worklist::new(4, 2, 4);
        wl.build(&ids, &w, 3, 2, Some(&hs.layers[0]), WorklistOrder::TokenMajor).unwrap();
        assert_eq!(wl.hot[0].hot_count, 3);
        assert_eq!(wl.cold_count, 3);
        assert_eq!(&wl.hot[0].hot_src_slot[..3], &[1, 4, 5]);
        assert_eq!(&wl.hot[0].hot_expert_id[..3], &[0, 3, 0]);
        assert_eq!(&wl.hot[0].hot_id[..3], &[0, 1, 0]);
        assert_eq!(&wl.cold_src_slot[..3], &[0, 2, 3]);
        assert_eq!(&wl.cold_token_id[..3], &[0, 1, 1]);
        wl.check_consistency(Some(&hs.layers[0])).unwrap();

        wl.build(&ids, &w, 3, 2, Some(&hs.layers[0]), WorklistOrder::ExpertMajor).unwrap();
        assert_eq!(&wl.hot[0].hot_expert_id[..3], &[0, 0, 3]);
        assert_eq!(&wl.hot[0].hot_src_slot[..3], &[1, 5, 4]);
        assert_eq!(&wl.cold_id[..3], &[1, 2, 2]);
        assert_eq!(&wl.cold_src_slot[..3], &[2, 0, 3]);
        wl.check_consistency(Some(&hs.layers[0])).unwrap();
    }

    #[test]
    fn several_hot_lanes_add_up() {
        let (ids, w) = routes();
        let hs = HotSet::from_lists(1, 4, 3, &[vec![0, 1, 2]]);
        let mut wl = Worklist::new(3, 2, 4);
        wl.build(&ids, &w, 3, 2, Some(&hs.layers[0]), WorklistOrder::TokenMajor).unwrap();
        assert_eq!([wl.hot[0].hot_count, wl.hot[1].hot_count, wl.hot[2].hot_count], [2, 1, 2]);
        assert_eq!(wl.hot_count_total() + wl.cold_count, 6);
        wl.check_consistency(Some(&hs.layers[0])).unwrap();
    }

    #[test]
    fn capacity_is_enforced_and_builds_do_not_allocate() {
        let (ids, w) = routes();
        let mut wl = Worklist::new(2, 2, 4);
        assert_eq!(wl.capacity(), 4);
        assert!(matches!(
            wl.build(&ids, &w, 3, 2, None, WorklistOrder::TokenMajor),
            Err(WorklistError::OverCapacity { .. })
        ));
        let before = wl.buffer_fingerprint();
        for order in [WorklistOrder::TokenMajor, WorklistOrder::ExpertMajor] {
            wl.build(&ids[..4], &w[..4], 2, 2, None, order).unwrap();
            assert_eq!(wl.cold_count, 4);
            wl.check_consistency(None).unwrap();
        }
        assert_eq!(before, wl.buffer_fingerprint());
    }

    #[test]
    fn corruption_is_detected() {
        let (ids, w) = routes();
        let hs = HotSet::from_lists(1, 4, 1, &[vec![0]]);
        let mut wl = Worklist::new(3, 2, 4);
        wl.build(&ids, &w, 3, 2, Some(&hs.layers[0]), WorklistOrder::TokenMajor).unwrap();
        wl.cold_src_slot[0] = wl.cold_src_slot[1];
        assert!(wl.check_consistency(Some(&hs.layers[0])).is_err());
        wl.build(&ids, &w, 3, 2, Some(&hs.layers[0]), WorklistOrder::TokenMajor).unwrap();
        wl.hot[0].hot_id[0] = 7;
        assert!(wl.check_consistency(Some(&hs.layers[0])).is_err());
        wl.build(&ids, &w, 3, 2, Some(&hs.layers[0]), WorklistOrder::TokenMajor).unwrap();
        wl.cold_count -= 1;
        assert!(matches!(wl.check_consistency(Some(&hs.layers[0])), Err(WorklistError::Counts { .. })));
    }
}
