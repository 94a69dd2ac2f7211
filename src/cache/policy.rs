//! Online admission and eviction for the hot cache (issue 47): policies that follow recent use,
//! token by token, next to the learn + plan + updater path (`cache::update`).
//!
//! Every policy works per layer on *steps*: one step is the set of distinct experts one forward
//! call routed in that layer (one decode token: its top-k). A step's hits are counted against the
//! cache as it was before the step; then the policy may admit experts of the step, each into the
//! slot of a victim that is **not** in the step (the engine applies exchanges between calls, so a
//! victim routed in the same call was still served hot). The cache is always full (slots never
//! change in number), so every admission is one exchange: one eviction, one copy.
//!
//! - [`PolicyKind::Lru`]: admit every miss, evict the least recently used.
//! - [`PolicyKind::Lfu`]: frequencies with exponential decay (half-life [`DEFAULT_HALF_LIFE`]
//!   steps); a miss is admitted when its decayed count beats the least frequent resident's.
//! - [`PolicyKind::TinyLfu`]: frequency admission (TinyLFU) in front of an LRU main region, a
//!   pinned learned core, and a copy-cost gate. The frequency "sketch" is exact: a layer has at
//!   most a few hundred experts, so one decayed counter per expert is cheaper and exact where
//!   TinyLFU's count-min sketch approximates a huge key space. A miss `e` is admitted into the
//!   slot of the least recently used unpinned resident `v` only when `freq(e) > freq(v)` (the
//!   TinyLFU test: one-off experts do not flush useful ones) and its expected reuse pays for the
//!   copy ([`CopyCost::pays`]): expected hot uses during its expected residence
//!   `rate(e) * residence` at least [`CopyCost::break_even_uses`]. `rate(e)` is the decayed count
//!   per step (`freq * ln 2 / half_life`), the residence is the unpinned slots over the recent
//!   admission rate. The pinned core is the top [`DEFAULT_PIN_FRACTION`] of the learned plan's
//!   ranking: never evicted.
//! - [`PolicyKind::Adaptive`]: LRFU, decayed counts for eviction and admission (a
//!   miss replaces the resident with the lowest count when its own count is higher), at the
//!   half-life that pays best now. One shadow cache per half-life of [`ADAPTIVE_HALF_LIVES`]
//!   (2 steps: about LRU; 32: about LFU) replays the same steps; each shadow's score is its
//!   decayed net saving in hot uses, `hits - break_even_uses * copies` (the copy-cost model:
//!   the host DRAM read the cold lane loses, and the PCIe time where the transfer is not
//!   overlapped, against what a hot use saves), and
//!   the real cache follows the best shadow's half-life. So a workload with short-term locality
//!   gets recency, a stable popular set gets frequency, and a half-life that copies more than
//!   its hits repay loses to a calmer one.
//! - [`PolicyKind::Reuse`]: eviction and admission by each expert's predicted chance of use in
//!   the next step, learned per layer from the layer's own steps ([`ReuseModel`]). An expert's
//!   features are its age (steps since its last use, in the buckets of [`REUSE_AGE_BOUNDS`]),
//!   its window count (how many of the last [`REUSE_WINDOW`] steps used it) and its frequency
//!   class (the quartile of its decayed count, half-life [`REUSE_FREQ_HALF_LIFE`], among the
//!   layer's experts); the prediction of a feature cell is the decayed share of the times an
//!   expert in that cell was used by the next step (table half-life [`REUSE_TABLE_HALF_LIFE`],
//!   a half-use prior). Victims are the residents with the lowest prediction (then the least
//!   recent); a miss takes a victim's slot only when its prediction beats the victim's by
//!   [`REUSE_MARGIN`] per step (hysteresis: a swap of near-equals costs a copy and gains about
//!   nothing). Why these features: a routing process with short-term memory (a token re-picks
//!   one of the last few tokens' experts with some probability `p`, else draws from a slowly
//!   drifting popular distribution) makes an expert's next-step chance `p * (its share of the
//!   recent window) + (1 - p) * (its long-run rate)`, so the window count, recency and long
//!   frequency together predict reuse where any one of them alone (LRU, LFU, one LRFU
//!   half-life) does not; learning the table instead of fixing the mix finds `p` per layer, and
//!   on a stable popular set (no locality) the table learns that only the frequency class
//!   matters.
//!
//! Reuse's admission margin is learned per layer (`CopyLedger`): every swap past the floor
//! [`REUSE_MARGIN`], made or declined, is judged by the uses that followed net of the copy's
//! break-even, and the wrong ones move the margin. It starts at [`REUSE_MARGIN_START`], far
//! above the floor: on a stable popular set no swap pays, so none is made and the cache stays
//! the learned one; where locality makes swaps pay, the declined ones bring it down.
//!
//! On replayed traces (benches/RESULTS.md, session 49, 25% and 50% budgets, each step's
//! exchanges serving the next call as the engines apply them by default, the copies' PCIe
//! transfer overlapped) reuse reaches at least 90% of Belady's hit rate in 10 of 12 cells at the
//! replay's shape (32 experts, top-4): not at 25% with p = 0.5 (83.1%, past the causal bound,
//! 87.4%) or with p = 0.8 and drift 0.1 (89.0%); at the GPU files' shape (128 experts, top-8) in
//! 11 of 12 (p = 0.5 at 25%: 87.6%). On the GPU machine, where an exchange never stalls a call
//! (the added expert turns hot once its copy has landed), it decodes 1.04-1.48x the best of the
//! static cache and the updater on locality workloads with p >= 0.8, 1.08 / 0.97x at p = 0.5
//! (session 49), and on `skewed` and `domains:2`, where the sceptical margin leaves the learned
//! cache in place, within the host's spread of them: so
//! [`PolicyKind::Reuse`] is the default (benches/RESULTS.md, session 43). On the traces: LRU follows locality but loses the popular set to one-off
//! experts on `skewed` and `domains:2` routing and copies the most; LFU (half-life 32) is slow on
//! locality; TinyLFU's pinned core goes stale when the popular set drifts and its gate admits too
//! little on bursty workloads; any one fixed half-life is best on some workloads and worst on
//! others, and the shadows pick per layer and per moment, within a few points of the best fixed
//! choice everywhere, with fewer copies than LRU.
//!
//! [`belady_hits`] is Belady's MIN with bypass (future-knowing: on a miss, evict the resident
//! used farthest in the future, or bypass when the missed expert itself is used later than every
//! resident), optimal for hits on the serialized access sequence from the same initial cache;
//! every step policy above is one such demand policy, so none beats it (tests: hand-checked
//! sequences, brute force on small ones, and a proptest over all policies).

use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// Half-life of the decayed frequencies, in steps (decode tokens).
pub const DEFAULT_HALF_LIFE: f64 = 32.0;
/// Share of a layer's hot slots the TinyLFU policy pins to the learned ranking's top.
pub const DEFAULT_PIN_FRACTION: f64 = 0.25;
/// The adaptive policy's candidate half-lives, in steps: from recency (2) to frequency (32).
pub const ADAPTIVE_HALF_LIVES: [f64; 5] = [2.0, 4.0, 8.0, 16.0, 32.0];
/// Half-life of the adaptive policy's shadow scores, in steps.
pub const ADAPTIVE_SCORE_HALF_LIFE: f64 = 128.0;
/// The reuse policy's short window, in steps: its window count is the steps of the last
/// `REUSE_WINDOW` that used the expert.
pub const REUSE_WINDOW: u32 = 8;
/// Upper bounds of the reuse policy's age buckets (steps since the last use); one more bucket
/// holds older and never-used experts.
pub const REUSE_AGE_BOUNDS: [u64; 10] = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32];
/// Frequency classes of the reuse policy: the quantile of an expert's long decayed count.
pub const REUSE_FREQ_CLASSES: usize = 4;
/// Half-life of the reuse policy's long decayed counts, in steps.
pub const REUSE_FREQ_HALF_LIFE: f64 = 256.0;
/// Half-life of the reuse policy's learned table, in steps.
pub const REUSE_TABLE_HALF_LIFE: f64 = 512.0;
/// The reuse policy admits a miss only when its predicted use probability per step beats the
/// victim's by at least this much (hysteresis against copies that do not pay): the floor of its
/// learned margin (`CopyLedger`).
pub const REUSE_MARGIN: f64 = 0.05;
/// The learned margin's ceiling: above a probability difference of 1 nothing is admitted.
pub const REUSE_MARGIN_MAX: f64 = 1.0;
/// Where the learned margin starts: sceptical, so a swap is made only once declined swaps have
/// been seen to pay (each lowers it by [`LEDGER_RATE_PER_USE`] per use of its net). On a stable
/// popular set nothing pays and the cache stays the learned one (replayed: 0-0.003 copies per
/// layer and step, against 0.005-0.024 starting at the floor); with short-term locality the
/// margin reaches the floor within the first few hundred steps (hit rates within a point of the
/// floor start's; benches/RESULTS.md, session 43).
pub const REUSE_MARGIN_START: f64 = 0.7;
/// Longest an admission is judged over (it is judged when its expert is evicted, or this many
/// steps after it), and the start of the residence that declined swaps are judged over.
pub const LEDGER_MAX_STEPS: u64 = 128;
/// Half-life, in judged admissions, of the mean residence declined swaps are judged over.
const LEDGER_RESIDENCE_HALF_LIFE: f64 = 16.0;
/// How far one wrong decision moves the margin, per use of its net (a declined swap that would
/// have paid 3 uses lowers it by 0.012; an admission that lost 3 uses raises it as much).
pub const LEDGER_RATE_PER_USE: f64 = 0.004;

/// PCIe host-to-device copy rate of a promotion, bytes/s (benches/RESULTS.md: 54-55 GB/s
/// measured from the registered model file on the H100/H200 hosts; 50 GB/s).
pub const PCIE_H2D_BYTES_PER_S: f64 = 50e9;
/// Host DRAM read bandwidth the copy takes from the cold lane, bytes/s (the hosts' read probe:
/// 100-182 GB/s between calls; 150 GB/s).
pub const HOST_DRAM_BYTES_PER_S: f64 = 150e9;
/// The cold lane's effective expert bandwidth in decode, bytes/s: what one cold use of an expert
/// costs (benches/RESULTS.md: 95-169 GB/s for BF16 experts on 16 cores; 120 GB/s).
pub const COLD_LANE_BYTES_PER_S: f64 = 120e9;
/// The GPU's HBM bandwidth, bytes/s (H100 SXM 3.35 TB/s; 3 TB/s): what one hot use costs.
pub const HBM_BYTES_PER_S: f64 = 3.0e12;

/// The cost of promoting one expert against what its hot uses save, from bandwidths (bytes/s).
/// Both sides scale with the expert's bytes, so the break-even is a number of uses.
///
/// A copy always reads the expert from host DRAM, bandwidth the cold lane then lacks. Its PCIe
/// transfer costs the step time only where the compute waits for it: the GPU engine copies
/// exchanges on a side stream beside the compute, which waits for a slot only where it reads it
/// (the next call), so with `pcie_overlapped` (the default) the transfer is counted as hidden
/// and the break-even is the host DRAM read over a use's saving (0.83 uses at the defaults;
/// 3.33 with the transfer counted). Measured on the GPU machine: at p = 0.5, 50% hot, 523
/// copies bought 786 hits over the static cache and the step got faster, so a copy repaid
/// itself in under 1.5 uses (benches/RESULTS.md, session 48).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CopyCost {
    pub pcie_h2d_bytes_per_s: f64,
    pub host_dram_bytes_per_s: f64,
    pub cold_lane_bytes_per_s: f64,
    pub hbm_bytes_per_s: f64,
    /// The PCIe transfer runs beside the compute (the side stream) and costs no step time.
    pub pcie_overlapped: bool,
}

impl Default for CopyCost {
    fn default() -> Self {
        CopyCost {
            pcie_h2d_bytes_per_s: PCIE_H2D_BYTES_PER_S,
            host_dram_bytes_per_s: HOST_DRAM_BYTES_PER_S,
            cold_lane_bytes_per_s: COLD_LANE_BYTES_PER_S,
            hbm_bytes_per_s: HBM_BYTES_PER_S,
            pcie_overlapped: true,
        }
    }
}

impl CopyCost {
    /// Seconds one promotion of `bytes` costs the step: the host DRAM read the cold lane loses,
    /// plus the PCIe transfer unless it is overlapped.
    pub fn copy_s(&self, bytes: u64) -> f64 {
        bytes as f64 * self.copy_s_per_byte()
    }

    fn copy_s_per_byte(&self) -> f64 {
        let pcie = if self.pcie_overlapped { 0.0 } else { 1.0 / self.pcie_h2d_bytes_per_s };
        pcie + 1.0 / self.host_dram_bytes_per_s
    }

    /// Seconds one hot use of `bytes` saves over a cold one.
    pub fn saving_per_use_s(&self, bytes: u64) -> f64 {
        (bytes as f64 / self.cold_lane_bytes_per_s - bytes as f64 / self.hbm_bytes_per_s).max(0.0)
    }

    /// Hot uses that pay for one copy (infinite when a hot use saves nothing).
    pub fn break_even_uses(&self) -> f64 {
        let save = 1.0 / self.cold_lane_bytes_per_s - 1.0 / self.hbm_bytes_per_s;
        if save <= 0.0 {
            return f64::INFINITY;
        }
        self.copy_s_per_byte() / save
    }

    /// Whether `expected_uses` hot uses pay for the copy.
    pub fn pays(&self, expected_uses: f64) -> bool {
        expected_uses >= self.break_even_uses()
    }

    pub fn check(&self) -> Result<(), PolicyError> {
        let fields = [
            ("pcie_h2d_bytes_per_s", self.pcie_h2d_bytes_per_s),
            ("host_dram_bytes_per_s", self.host_dram_bytes_per_s),
            ("cold_lane_bytes_per_s", self.cold_lane_bytes_per_s),
            ("hbm_bytes_per_s", self.hbm_bytes_per_s),
        ];
        match fields.into_iter().find(|(_, v)| !(v.is_finite() && *v > 0.0)) {
            Some((field, value)) => Err(PolicyError::BadSetting { field, value }),
            None => Ok(()),
        }
    }
}

/// A policy setting out of range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PolicyError {
    #[error("cache policy: {field} = {value}: expected a finite number above 0")]
    BadSetting { field: &'static str, value: f64 },
    #[error("cache policy: pin_fraction = {value}: expected a fraction in 0..=1")]
    BadPinFraction { value: f64 },
    #[error("cache policy '{name}': expected planned, lru, lfu, tinylfu, adaptive or reuse")]
    Unknown { name: String },
}

/// Which policy keeps the hot cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Learn + plan, moved only by the updater (`--update`, `cache::update`).
    Planned,
    Lru,
    Lfu,
    /// Frequency admission, LRU eviction, pinned learned core, copy-cost gate (module docs).
    #[serde(rename = "tinylfu")]
    TinyLfu,
    /// Decayed-count eviction and admission at the half-life whose shadow cache saved the most
    /// time net of its copies (module docs).
    Adaptive,
    /// Eviction and admission by each expert's learned chance of reuse from its recency, its
    /// uses in the last [`REUSE_WINDOW`] steps and its long frequency (module docs): the
    /// default. It starts from the learned plan; on a stable popular set its learned margin
    /// keeps that cache, where routing has short-term locality it follows it (GPU machine:
    /// 1.04-1.48x the best of the static cache and the updater on locality workloads but one
    /// cell, 0.92-1.04x on the stable ones, within the runs' spread; benches/RESULTS.md,
    /// session 49).
    #[default]
    Reuse,
}

impl PolicyKind {
    /// The per-token policies, in report order.
    pub const ONLINE: [PolicyKind; 5] =
        [PolicyKind::Lru, PolicyKind::Lfu, PolicyKind::TinyLfu, PolicyKind::Adaptive, PolicyKind::Reuse];

    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Planned => "planned",
            PolicyKind::Lru => "lru",
            PolicyKind::Lfu => "lfu",
            PolicyKind::TinyLfu => "tinylfu",
            PolicyKind::Adaptive => "adaptive",
            PolicyKind::Reuse => "reuse",
        }
    }
}

impl std::str::FromStr for PolicyKind {
    type Err = PolicyError;
    fn from_str(s: &str) -> Result<PolicyKind, PolicyError> {
        std::iter::once(PolicyKind::Planned)
            .chain(PolicyKind::ONLINE)
            .find(|k| k.name() == s)
            .ok_or_else(|| PolicyError::Unknown { name: s.into() })
    }
}

/// The policy's settings (the typed config's `cache_policy` section).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    pub kind: PolicyKind,
    /// Half-life of the decayed frequencies, in steps.
    pub half_life: f64,
    /// TinyLFU: share of each layer's slots pinned to the learned ranking's top.
    pub pin_fraction: f64,
    pub copy_cost: CopyCost,
    /// Calls between a step and the first call its exchanges serve: 0 (the default), the
    /// engine waits for the step after each call and applies its exchanges before the next (the
    /// step's host time on the decode thread, each admission serving one call sooner); 1, the
    /// step runs on its own thread while the engine computes the next call and its exchanges
    /// apply before the one after (`engine::policy_worker`). `plan --trace --policies` replays
    /// either.
    pub lag_steps: usize,
}

/// [`PolicyConfig::lag_steps`]'s default: the step waited for, its exchanges serving the next
/// call. Session 48 on the H200 (`scripts/policy-compare.sh`, `reuse` against `reuse-lagged`,
/// 8-layer BF16, locality p = 0.8 drift 0.1 and p = 0.5 drift 0.01 at 25% and 50% hot): tg at
/// or above the lagged step's in every cell, decode hit rate +0.2-1.0 points; replayed, +0.3-1.8
/// points of Belady's share (benches/RESULTS.md, session 48). Session 43 had made 1 the default
/// for the step's 25-40 us a token on the decode thread, measured where nothing is exchanged.
pub const DEFAULT_POLICY_LAG_STEPS: usize = 0;

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            kind: PolicyKind::default(),
            half_life: DEFAULT_HALF_LIFE,
            pin_fraction: DEFAULT_PIN_FRACTION,
            copy_cost: CopyCost::default(),
            lag_steps: DEFAULT_POLICY_LAG_STEPS,
        }
    }
}

impl PolicyConfig {
    pub fn of(kind: PolicyKind) -> PolicyConfig {
        PolicyConfig { kind, ..PolicyConfig::default() }
    }

    pub fn check(&self) -> Result<(), PolicyError> {
        if !(self.half_life.is_finite() && self.half_life > 0.0) {
            return Err(PolicyError::BadSetting { field: "half_life", value: self.half_life });
        }
        if !(0.0..=1.0).contains(&self.pin_fraction) {
            return Err(PolicyError::BadPinFraction { value: self.pin_fraction });
        }
        if self.lag_steps > 1 {
            return Err(PolicyError::BadSetting {
                field: "lag_steps (0 or 1)",
                value: self.lag_steps as f64,
            });
        }
        self.copy_cost.check()
    }
}

/// What one step did in one layer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepOutcome {
    /// Experts of the step that were resident before it.
    pub hits: usize,
    /// `(evict, add)` pairs, in order; the cache after the step.
    pub exchanges: Vec<(usize, usize)>,
}

/// One layer's policy state: residency and the recency and frequency of every expert.
#[derive(Debug, Clone)]
pub struct LayerPolicy {
    config: PolicyConfig,
    resident: Vec<bool>,
    pinned: Vec<bool>,
    last_use: Vec<u64>,
    /// Half-lives of the decayed counts (one; the adaptive policy's [`ADAPTIVE_HALF_LIVES`]),
    /// the per-step factor of each, and `freq[i][e]`, current as of the last step.
    halves: Vec<f64>,
    decays: Vec<f64>,
    freq: Vec<Vec<f64>>,
    clock: u64,
    /// Decayed admissions per step (half-life `config.half_life`).
    admit_rate: f64,
    in_step: Vec<bool>,
    /// Adaptive: one shadow cache per half-life and its decayed net saving (hits less
    /// break-even uses per copy), in uses.
    shadows: Vec<Vec<bool>>,
    shadow_score: Vec<f64>,
    /// Reuse: the learned predictor and the ledger that learns its admission margin.
    reuse: Option<ReuseModel>,
    ledger: Option<CopyLedger>,
    /// The residents of the real cache (`lists[0]`) and of each shadow (`lists[1 + i]`), in no
    /// order: victims are chosen among these, not among every expert.
    lists: Vec<Vec<usize>>,
    /// Scratch (no allocation per step after the first).
    misses: Vec<usize>,
    victims: Vec<usize>,
    pairs: Vec<(usize, usize)>,
}

/// The reuse policy's predictor (module docs): per expert an age bucket, a window count and a
/// frequency class, and per cell of those features the decayed share of steps that used an
/// expert in that cell, learned from the layer's own steps.
#[derive(Debug, Clone)]
pub struct ReuseModel {
    /// Bit `i` of `window[e]`: whether `e` was used `i` steps ago (bit 0: the last step).
    window: Vec<u32>,
    /// `cell[e]`: the cell of `e`'s features after the last step.
    cell: Vec<usize>,
    /// Decayed uses and observations per cell.
    used: Vec<f64>,
    seen: Vec<f64>,
    keep: f64,
    /// Experts by long count, most used first (then by index), and each one's place in it: a
    /// step's decay scales every count alike, so only the experts it used move (up).
    order: Vec<usize>,
    place: Vec<usize>,
    /// Scratch: a step's experts by place.
    moved: Vec<usize>,
    /// `prob[e]`: the prediction of `e`'s cell, set with the cells (victims are compared by it
    /// many times a step).
    prob: Vec<f64>,
}

impl ReuseModel {
    const AGES: usize = REUSE_AGE_BOUNDS.len() + 1;
    const COUNTS: usize = REUSE_WINDOW as usize + 1;

    pub fn new(n_experts: usize) -> ReuseModel {
        let cells = Self::AGES * Self::COUNTS * REUSE_FREQ_CLASSES;
        ReuseModel {
            window: vec![0; n_experts],
            cell: vec![Self::cell_of(Self::AGES - 1, 0, REUSE_FREQ_CLASSES - 1); n_experts],
            used: vec![0.0; cells],
            seen: vec![0.0; cells],
            keep: 0.5f64.powf(1.0 / REUSE_TABLE_HALF_LIFE),
            order: (0..n_experts).collect(),
            place: (0..n_experts).collect(),
            moved: Vec::new(),
            prob: vec![0.5; n_experts],
        }
    }

    fn cell_of(age_bucket: usize, count: usize, class: usize) -> usize {
        (age_bucket * Self::COUNTS + count) * REUSE_FREQ_CLASSES + class
    }

    /// The age bucket of `age_steps` (`None`: never used).
    fn age_bucket(age_steps: Option<u64>) -> usize {
        const LAST: u64 = REUSE_AGE_BOUNDS[REUSE_AGE_BOUNDS.len() - 1];
        const TABLE: [u8; LAST as usize + 1] = {
            let mut t = [0u8; LAST as usize + 1];
            let (mut age, mut bucket) = (0, 0);
            while age <= LAST as usize {
                while REUSE_AGE_BOUNDS[bucket] < age as u64 {
                    bucket += 1;
                }
                t[age] = bucket as u8;
                age += 1;
            }
            t
        };
        match age_steps {
            Some(a) if a <= LAST => TABLE[a as usize] as usize,
            _ => Self::AGES - 1,
        }
    }

    /// Learn from one step (`in_step[e]`: whether it used `e`) against the features before it.
    fn learn(&mut self, in_step: &[bool]) {
        self.used.iter_mut().for_each(|x| *x *= self.keep);
        self.seen.iter_mut().for_each(|x| *x *= self.keep);
        for (&c, &u) in self.cell.iter().zip(in_step) {
            self.seen[c] += 1.0;
            self.used[c] += f64::from(u8::from(u));
        }
    }

    /// The features after a step that used `experts` (`in_step`): `last_use` (0: never) at
    /// `clock`, long counts `freq`.
    fn refresh(&mut self, experts: &[usize], in_step: &[bool], last_use: &[u64], clock: u64, freq: &[f64]) {
        let mask = (1u32 << REUSE_WINDOW) - 1;
        for (w, &u) in self.window.iter_mut().zip(in_step) {
            *w = ((*w << 1) | u32::from(u)) & mask;
        }
        // highest placed first, so a used expert is never held back by one below it
        let mut moved = std::mem::take(&mut self.moved);
        moved.clear();
        moved.extend_from_slice(experts);
        moved.sort_unstable_by_key(|&e| self.place[e]);
        for &e in &moved {
            self.move_up(e, freq);
        }
        self.moved = moved;
        let n = self.order.len();
        let (mut class, mut next_class_at) = (0, n.div_ceil(REUSE_FREQ_CLASSES));
        for (rank, &e) in self.order.iter().enumerate() {
            // class = rank * CLASSES / n, stepped instead of divided
            while rank >= next_class_at {
                class += 1;
                next_class_at = ((class + 1) * n).div_ceil(REUSE_FREQ_CLASSES);
            }
            let age = (last_use[e] > 0).then(|| clock - last_use[e]);
            self.cell[e] = Self::cell_of(Self::age_bucket(age), self.window[e].count_ones() as usize, class);
        }
        for (p, &c) in self.prob.iter_mut().zip(&self.cell) {
            *p = (self.used[c] + 0.5) / (self.seen[c] + 1.0);
        }
    }

    /// `e`'s count grew: move it up the order past every expert it now ranks before.
    fn move_up(&mut self, e: usize, freq: &[f64]) {
        let before = |a: usize, b: usize| freq[a].total_cmp(&freq[b]).then(b.cmp(&a)).is_gt();
        let mut i = self.place[e];
        while i > 0 && before(e, self.order[i - 1]) {
            let prev = self.order[i - 1];
            self.order[i] = prev;
            self.place[prev] = i;
            i -= 1;
        }
        self.order[i] = e;
        self.place[e] = i;
    }

    /// Predicted chance that the next step uses `e` (a half-use prior on an empty cell).
    pub fn reuse_probability(&self, e: usize) -> f64 {
        self.prob[e]
    }

    /// Steps of the last [`REUSE_WINDOW`] that used `e`.
    pub fn window_count(&self, e: usize) -> u32 {
        self.window[e].count_ones()
    }
}

/// Which cache a step of [`LayerPolicy`] moves, and by what rule.
/// The reuse policy's admission margin, learned from outcomes: every swap it makes or declines
/// past the margin's floor is judged by its net, the admitted expert's uses less its victim's
/// less the copy's break-even uses ([`CopyCost::break_even_uses`]), counted over the admission's
/// residence (until its expert is evicted, at most [`LEDGER_MAX_STEPS`]) or, for a declined
/// swap, over the mean residence of the layer's judged admissions; both experts are routed or
/// not whatever the cache holds, so a declined swap is judged as well as a made one. A wrong
/// decision moves the margin by [`LEDGER_RATE_PER_USE`] per use of its net: up for an
/// admission that lost, down for a declined swap that would have paid (within
/// [`REUSE_MARGIN`]..=[`REUSE_MARGIN_MAX`]). So where copies repay themselves (short-term
/// locality) the margin stays near its floor, and where the predictions' differences are noise
/// (a stable popular set) it rises until swaps stop.
#[derive(Debug, Clone)]
struct CopyLedger {
    /// Decisions not judged yet.
    open: Vec<Decision>,
    margin: f64,
    /// Decayed mean residence of judged admissions, in steps.
    residence: f64,
    /// Admissions that paid, that lost; declined swaps that would have paid, would have lost.
    counts: [u64; 4],
}

impl Default for CopyLedger {
    fn default() -> Self {
        let residence = LEDGER_MAX_STEPS as f64 / 4.0;
        CopyLedger { open: Vec::new(), margin: REUSE_MARGIN_START, residence, counts: [0; 4] }
    }
}

/// One swap decision under judgement: uses of the admitted expert and of its victim since.
#[derive(Debug, Clone, Copy)]
struct Decision {
    expert: usize,
    victim: usize,
    admitted: bool,
    opened: u64,
    uses: [u32; 2],
}

impl CopyLedger {
    fn open(&mut self, d: Decision) {
        self.open.push(d);
    }

    /// One step's routed experts (`in_step`) counted for every open decision; the due ones
    /// judged (admissions at [`LEDGER_MAX_STEPS`], declined swaps at the mean residence).
    fn observe(&mut self, in_step: &[bool], clock: u64, break_even_uses: f64) {
        let horizon = self.residence.round().clamp(1.0, LEDGER_MAX_STEPS as f64) as u64;
        for d in &mut self.open {
            d.uses[0] += in_step[d.expert] as u32;
            d.uses[1] += in_step[d.victim] as u32;
        }
        self.close(clock, break_even_uses, |d, age| match d.admitted {
            true => age >= LEDGER_MAX_STEPS,
            false => age >= horizon,
        });
    }

    /// Expert `v` was evicted: the admission that brought it in is judged now.
    fn evicted(&mut self, v: usize, clock: u64, break_even_uses: f64) {
        self.close(clock, break_even_uses, |d, _| d.admitted && d.expert == v);
    }

    /// Judge and drop the open decisions `due(decision, age)` picks.
    fn close(&mut self, clock: u64, break_even_uses: f64, due: impl Fn(&Decision, u64) -> bool) {
        let mut i = 0;
        while i < self.open.len() {
            let age = clock - self.open[i].opened;
            if due(&self.open[i], age) {
                let d = self.open.swap_remove(i);
                self.judge(d, age, break_even_uses);
            } else {
                i += 1;
            }
        }
    }

    fn judge(&mut self, d: Decision, age: u64, break_even_uses: f64) {
        if d.admitted {
            let keep = 0.5f64.powf(1.0 / LEDGER_RESIDENCE_HALF_LIFE);
            self.residence = self.residence * keep + age as f64 * (1.0 - keep);
        }
        let net = d.uses[0] as f64 - d.uses[1] as f64 - break_even_uses;
        let paid = net >= 0.0;
        self.counts[usize::from(!d.admitted) * 2 + usize::from(!paid)] += 1;
        if d.admitted != paid {
            let step = LEDGER_RATE_PER_USE * net.abs();
            let m = if paid { self.margin - step } else { self.margin + step };
            self.margin = m.clamp(REUSE_MARGIN, REUSE_MARGIN_MAX);
        }
    }
}

#[derive(Clone, Copy)]
enum Rule {
    /// LRU eviction, every miss admitted.
    Lru,
    /// Evict the lowest decayed count of `freq[i]`; admit a miss that beats it.
    Lrfu(usize),
    /// LRU eviction, admit a miss whose count `freq[0]` beats the victim's and that pays.
    TinyLfu,
    /// Evict the lowest predicted reuse; admit a miss whose prediction beats it by
    /// [`REUSE_MARGIN`].
    Reuse,
}

impl LayerPolicy {
    /// A layer of `n_experts` with `resident` hot (the cache's capacity is its length) and
    /// `ranking` the learned order (most used first) the pinned core is taken from.
    pub fn new(config: PolicyConfig, n_experts: usize, resident: &[usize], ranking: &[usize]) -> LayerPolicy {
        let halves = match config.kind {
            PolicyKind::Adaptive => ADAPTIVE_HALF_LIVES.to_vec(),
            PolicyKind::Reuse => vec![REUSE_FREQ_HALF_LIFE],
            _ => vec![config.half_life],
        };
        let mut p = LayerPolicy {
            config,
            resident: vec![false; n_experts],
            pinned: vec![false; n_experts],
            last_use: vec![0; n_experts],
            decays: halves.iter().map(|h| 0.5f64.powf(1.0 / h)).collect(),
            freq: vec![vec![0.0; n_experts]; halves.len()],
            halves,
            clock: 0,
            admit_rate: 0.0,
            in_step: vec![false; n_experts],
            shadows: Vec::new(),
            shadow_score: Vec::new(),
            reuse: (config.kind == PolicyKind::Reuse).then(|| ReuseModel::new(n_experts)),
            ledger: (config.kind == PolicyKind::Reuse).then(CopyLedger::default),
            lists: Vec::new(),
            misses: Vec::new(),
            victims: Vec::new(),
            pairs: Vec::new(),
        };
        resident.iter().for_each(|&e| p.resident[e] = true);
        if config.kind == PolicyKind::TinyLfu {
            let n_pin = (config.pin_fraction * resident.len() as f64).floor() as usize;
            let core = ranking.iter().filter(|&&e| p.resident[e]).take(n_pin);
            core.for_each(|&e| p.pinned[e] = true);
        }
        if config.kind == PolicyKind::Adaptive {
            p.shadows = vec![p.resident.clone(); p.halves.len()];
            p.shadow_score = vec![0.0; p.halves.len()];
        }
        let listed = |r: &[bool]| (0..r.len()).filter(|&e| r[e]).collect::<Vec<usize>>();
        p.lists = std::iter::once(&p.resident).chain(&p.shadows).map(|r| listed(r)).collect();
        p
    }

    /// Advance the clock one step and count `experts` as used.
    fn touch_all(&mut self, experts: &[usize]) {
        self.clock += 1;
        for (f, &d) in self.freq.iter_mut().zip(&self.decays) {
            f.iter_mut().for_each(|x| *x *= d);
            experts.iter().for_each(|&e| f[e] += 1.0);
        }
        experts.iter().for_each(|&e| self.last_use[e] = self.clock);
        if let Some(m) = self.reuse.as_mut() {
            experts.iter().for_each(|&e| self.in_step[e] = true);
            m.learn(&self.in_step);
            m.refresh(experts, &self.in_step, &self.last_use, self.clock, &self.freq[0]);
            experts.iter().for_each(|&e| self.in_step[e] = false);
        }
    }

    /// The reuse policy's predictor (`None` under other policies).
    pub fn reuse_model(&self) -> Option<&ReuseModel> {
        self.reuse.as_ref()
    }

    /// How `a` compares with `b` as a keeper under `rule` (`Less`: `a` is evicted first).
    fn keeper_order(&self, rule: Rule, a: usize, b: usize) -> std::cmp::Ordering {
        match (rule, &self.reuse) {
            (Rule::Lrfu(i), _) => self.freq[i][a].total_cmp(&self.freq[i][b]).then(a.cmp(&b)),
            (Rule::Reuse, Some(m)) => m
                .reuse_probability(a)
                .total_cmp(&m.reuse_probability(b))
                .then(self.last_use[a].cmp(&self.last_use[b]))
                .then(self.freq[0][a].total_cmp(&self.freq[0][b]))
                .then(b.cmp(&a)),
            _ => (self.last_use[a], a).cmp(&(self.last_use[b], b)),
        }
    }

    /// How strong the miss `a` is against the miss `b` (`Greater`: `a` is admitted first).
    fn miss_order(&self, rule: Rule, a: usize, b: usize) -> std::cmp::Ordering {
        match rule {
            Rule::Lrfu(i) => self.freq[i][a].total_cmp(&self.freq[i][b]).then(b.cmp(&a)),
            Rule::Reuse => self.keeper_order(rule, a, b),
            _ => self.freq[0][a].total_cmp(&self.freq[0][b]).then(b.cmp(&a)),
        }
    }

    /// Whether the miss `e` takes the slot of the victim `v` under `rule`.
    fn admits(&self, rule: Rule, e: usize, v: usize) -> bool {
        let count = |e: usize| self.freq[0][e];
        match (rule, &self.reuse) {
            (Rule::Lru, _) => true,
            (Rule::Lrfu(i), _) => self.freq[i][e] > self.freq[i][v],
            (Rule::TinyLfu, _) => count(e) > count(v) && self.config.copy_cost.pays(self.expected_uses(e)),
            (Rule::Reuse, Some(m)) => m.reuse_probability(e) > m.reuse_probability(v) + self.reuse_margin(),
            (Rule::Reuse, None) => false,
        }
    }

    /// The reuse policy's admission margin now (its floor under other policies).
    pub fn reuse_margin(&self) -> f64 {
        self.ledger.as_ref().map_or(REUSE_MARGIN, |l| l.margin)
    }

    /// The ledger's closed decisions: (admissions that paid, admissions that lost, declined
    /// swaps that would have paid, declined swaps that would have lost).
    pub fn ledger_counts(&self) -> Option<[u64; 4]> {
        self.ledger.as_ref().map(|l| l.counts)
    }

    /// Reuse: a swap of `v` for the miss `e`, made or declined, to be judged by what follows;
    /// only candidates past the margin's floor (the rest would never be admitted).
    fn judge_later(&mut self, e: usize, v: usize, admitted: bool) {
        let (Some(m), Some(ledger)) = (&self.reuse, self.ledger.as_mut()) else { return };
        if m.reuse_probability(e) > m.reuse_probability(v) + REUSE_MARGIN {
            ledger.open(Decision { expert: e, victim: v, admitted, opened: self.clock, uses: [0, 0] });
        }
    }

    /// Count `experts` as used without scoring or admitting (a learn prefix warming the counts).
    pub fn observe(&mut self, experts: &[usize]) {
        self.touch_all(experts);
    }

    /// Set residency to what the engine's cache holds (after a manual apply, say).
    pub fn sync_resident(&mut self, resident: &[bool]) {
        if self.resident.as_slice() != resident {
            self.lists[0] = (0..resident.len()).filter(|&e| resident[e]).collect();
        }
        self.resident.copy_from_slice(resident);
        for (p, &r) in self.pinned.iter_mut().zip(resident) {
            *p &= r;
        }
    }

    pub fn is_resident(&self, e: usize) -> bool {
        self.resident[e]
    }

    pub fn n_resident(&self) -> usize {
        self.resident.iter().filter(|&&r| r).count()
    }

    /// The adaptive policy's half-life now (the shadow with the best net saving), else the
    /// configured one.
    pub fn half_life(&self) -> f64 {
        self.halves[self.best_shadow()]
    }

    fn best_shadow(&self) -> usize {
        let better = |a: &(usize, &f64), b: &(usize, &f64)| a.1.total_cmp(b.1).then(b.0.cmp(&a.0));
        self.shadow_score.iter().enumerate().max_by(better).map_or(0, |(i, _)| i)
    }

    /// Expected hot uses of `e` while resident (TinyLFU's copy gate, module docs).
    pub fn expected_uses(&self, e: usize) -> f64 {
        let rate = self.freq[0][e] * std::f64::consts::LN_2 / self.config.half_life;
        let unpinned = self.resident.iter().zip(&self.pinned).filter(|(&r, &p)| r && !p).count();
        let residence = unpinned as f64 / self.admit_rate.max(1.0 / self.config.half_life);
        rate * residence
    }

    /// Admissions of one step into `cache` under `rule` (misses strongest first, each against
    /// the next victim: not pinned, not in the step); the exchanges go to `out` when given.
    fn admit(
        &mut self,
        shadow: Option<usize>,
        rule: Rule,
        experts: &[usize],
        out: &mut Vec<(usize, usize)>,
    ) -> usize {
        let cache = match shadow {
            Some(i) => &self.shadows[i],
            None => &self.resident,
        };
        self.misses.clear();
        self.misses.extend(experts.iter().copied().filter(|&e| !cache[e]));
        if self.misses.is_empty() {
            return 0;
        }
        if shadow.is_none() && self.reuse_cannot_admit(rule) {
            return 0;
        }
        let mut misses = std::mem::take(&mut self.misses);
        misses.sort_by(|&a, &b| self.miss_order(rule, b, a));
        self.misses = misses;
        let pinned = |e: usize| shadow.is_none() && self.pinned[e];
        self.victims.clear();
        let list = &self.lists[shadow.map_or(0, |i| 1 + i)];
        self.victims.extend(list.iter().copied().filter(|&e| !pinned(e) && !self.in_step[e]));
        // Only the first `misses` victims can be used: select them, then order them.
        let mut victims = std::mem::take(&mut self.victims);
        let order = |a: &usize, b: &usize| self.keeper_order(rule, *a, *b);
        let m = self.misses.len();
        if victims.len() > m {
            victims.select_nth_unstable_by(m - 1, order);
            victims.truncate(m);
        }
        victims.sort_by(order);
        self.victims = victims;
        let mut next = 0;
        self.pairs.clear();
        for i in 0..self.misses.len() {
            let e = self.misses[i];
            let Some(&v) = self.victims.get(next) else { break };
            let admitted = self.admits(rule, e, v);
            if admitted {
                self.pairs.push((v, e));
                next += 1;
            }
            if shadow.is_none() {
                self.judge_later(e, v, admitted);
            }
        }
        let cache = match shadow {
            Some(i) => &mut self.shadows[i],
            None => &mut self.resident,
        };
        let list = &mut self.lists[shadow.map_or(0, |i| 1 + i)];
        for &(v, e) in &self.pairs {
            (cache[v], cache[e]) = (false, true);
            if let Some(slot) = list.iter_mut().find(|x| **x == v) {
                *slot = e;
            }
        }
        if shadow.is_none() {
            out.extend_from_slice(&self.pairs);
        }
        self.pairs.len()
    }

    /// Reuse: whether no miss of the step (`self.misses`) beats the weakest possible victim by
    /// the margin's floor, so nothing can be admitted or judged (a step on a stable popular set,
    /// most of the time): found in one pass instead of ordering the victims.
    fn reuse_cannot_admit(&self, rule: Rule) -> bool {
        let (Rule::Reuse, Some(m)) = (rule, &self.reuse) else { return false };
        let best_miss = self.misses.iter().map(|&e| m.reuse_probability(e)).fold(f64::MIN, f64::max);
        let victims = self.lists[0].iter().filter(|&&e| !self.pinned[e] && !self.in_step[e]);
        let weakest = victims.map(|&e| m.reuse_probability(e)).fold(f64::MAX, f64::min);
        best_miss <= weakest + REUSE_MARGIN
    }

    /// One step: count the hits of `experts` (distinct) against the cache before it, update
    /// recency and frequency, then admit the misses the policy takes (strongest first).
    pub fn step(&mut self, experts: &[usize]) -> StepOutcome {
        let mut out = StepOutcome {
            hits: experts.iter().filter(|&&e| self.resident[e]).count(),
            exchanges: Vec::new(),
        };
        let best = self.best_shadow();
        let keep = 0.5f64.powf(1.0 / ADAPTIVE_SCORE_HALF_LIFE);
        for (score, c) in self.shadow_score.iter_mut().zip(&self.shadows) {
            *score = *score * keep + experts.iter().filter(|&&e| c[e]).count() as f64;
        }
        self.touch_all(experts);
        experts.iter().for_each(|&e| self.in_step[e] = true);
        let rule = match self.config.kind {
            PolicyKind::Planned => None,
            PolicyKind::Lru => Some(Rule::Lru),
            PolicyKind::Lfu => Some(Rule::Lrfu(0)),
            PolicyKind::TinyLfu => Some(Rule::TinyLfu),
            PolicyKind::Adaptive => Some(Rule::Lrfu(best)),
            PolicyKind::Reuse => Some(Rule::Reuse),
        };
        let mut exchanges = Vec::new();
        let break_even = self.config.copy_cost.break_even_uses();
        if let Some(ledger) = self.ledger.as_mut() {
            // before this step's decisions open: they count uses from the next step on
            ledger.observe(&self.in_step, self.clock, break_even);
        }
        if let Some(rule) = rule {
            self.admit(None, rule, experts, &mut exchanges);
        }
        if let Some(ledger) = self.ledger.as_mut() {
            exchanges.iter().for_each(|&(v, _)| ledger.evicted(v, self.clock, break_even));
        }
        for i in 0..self.shadows.len() {
            let copies = self.admit(Some(i), Rule::Lrfu(i), experts, &mut exchanges);
            self.shadow_score[i] -= break_even * copies as f64;
        }
        experts.iter().for_each(|&e| self.in_step[e] = false);
        self.admit_rate = self.admit_rate * self.decays[0] + exchanges.len() as f64;
        out.exchanges = exchanges;
        out
    }
}

/// Belady's MIN with bypass: the most hits any demand policy gets on `steps` (serialized in
/// order) from the cache `initial` of `capacity` experts (`initial` is filled to the capacity
/// by the caller, or the capacity is taken as its length).
pub fn belady_hits(steps: &[Vec<usize>], initial: &[usize]) -> u64 {
    let accesses: Vec<usize> = steps.iter().flatten().copied().collect();
    let n = accesses.len();
    let n_experts = accesses.iter().chain(initial).copied().max().map_or(0, |m| m + 1);
    // next[i]: the next access to the same expert after i (n: never)
    let mut next = vec![n; n];
    let mut seen = vec![n; n_experts];
    for i in (0..n).rev() {
        next[i] = seen[accesses[i]];
        seen[accesses[i]] = i;
    }
    // residents keyed by their next use; `key[e]` the key of a resident
    let mut key = vec![None; n_experts];
    let mut set = BTreeSet::new();
    for &e in initial {
        if key[e].is_none() {
            key[e] = Some(seen[e]);
            set.insert((seen[e], e));
        }
    }
    let mut hits = 0;
    for (i, &e) in accesses.iter().enumerate() {
        if let Some(k) = key[e] {
            hits += 1;
            set.remove(&(k, e));
            key[e] = Some(next[i]);
            set.insert((next[i], e));
            continue;
        }
        let Some(&(far, v)) = set.iter().next_back() else { continue };
        if next[i] < far {
            set.remove(&(far, v));
            key[v] = None;
            key[e] = Some(next[i]);
            set.insert((next[i], e));
        }
    }
    hits
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn steps(v: &[&[usize]]) -> Vec<Vec<usize>> {
        v.iter().map(|s| s.to_vec()).collect()
    }

    fn run(kind: PolicyKind, seq: &[Vec<usize>], initial: &[usize], n_experts: usize) -> u64 {
        let mut p = LayerPolicy::new(PolicyConfig::of(kind), n_experts, initial, initial);
        seq.iter().map(|s| p.step(s).hits as u64).sum()
    }

    /// The optimum by trying every choice on the serialized sequence (small cases).
    fn brute_force(accesses: &[usize], cache: &mut Vec<usize>) -> u64 {
        let Some((&e, rest)) = accesses.split_first() else { return 0 };
        if cache.contains(&e) {
            return 1 + brute_force(rest, cache);
        }
        let mut best = brute_force(rest, cache); // bypass
        for i in 0..cache.len() {
            let old = std::mem::replace(&mut cache[i], e);
            best = best.max(brute_force(rest, cache));
            cache[i] = old;
        }
        best
    }

    #[test]
    fn belady_on_hand_checked_sequences() {
        // capacity 1, cache {0}: 1 1 0 -> admit 1 (hit on the second), 0 misses: 1 hit;
        // keeping 0 instead gives 1 hit too; either way 1.
        assert_eq!(belady_hits(&steps(&[&[1], &[1], &[0]]), &[0]), 1);
        // capacity 2, cache {0, 1}: 2 0 1 2 -> 2 bypassed: 0 and 1 hit; 2 misses again: 2 hits
        assert_eq!(belady_hits(&steps(&[&[2], &[0], &[1], &[2]]), &[0, 1]), 2);
        // capacity 2, cache {0, 1}: 2 2 2 0 -> evict 1 (never used): 2 hits on 2, 1 on 0
        assert_eq!(belady_hits(&steps(&[&[2], &[2], &[2], &[0]]), &[0, 1]), 3);
        // the classic: capacity 3 on 1 2 3 4 1 2 5 1 2 3 4 5 from {1,2,3}
        let classic: Vec<Vec<usize>> =
            [1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5].iter().map(|&e| vec![e]).collect();
        // hits 1 2 3; 4 is used again later than every resident: bypassed; 1 2 hit; 5 bypassed
        // likewise; 1 2 3 hit; 4 and 5 never again: bypassed. 3 + 2 + 3 = 8
        assert_eq!(belady_hits(&classic, &[1, 2, 3]), 8);
        let flat: Vec<usize> = classic.concat();
        assert_eq!(brute_force(&flat, &mut vec![1, 2, 3]), 8);
    }

    #[test]
    fn lru_admits_every_miss_and_evicts_the_least_recent() {
        let mut p = LayerPolicy::new(PolicyConfig::of(PolicyKind::Lru), 4, &[0, 1], &[0, 1]);
        assert_eq!(p.step(&[0]).hits, 1);
        // 2 misses: 1 is the least recent
        assert_eq!(p.step(&[2]).exchanges, vec![(1, 2)]);
        assert!(p.is_resident(0) && p.is_resident(2) && !p.is_resident(1));
        // a victim is never in the same step
        let out = p.step(&[3, 0]);
        assert_eq!((out.hits, out.exchanges), (1, vec![(2, 3)]));
    }

    #[test]
    fn tinylfu_keeps_its_pinned_core_and_refuses_one_offs() {
        let mut cfg = PolicyConfig::of(PolicyKind::TinyLfu);
        cfg.pin_fraction = 0.5;
        let mut p = LayerPolicy::new(cfg, 8, &[0, 1], &[0, 1]);
        for _ in 0..20 {
            p.step(&[1]);
        }
        // a one-off expert does not beat 1's frequency
        assert!(p.step(&[5]).exchanges.is_empty());
        // an expert used over and over does (1 not pinned; 0 is, never evicted though unused)
        let admitted: usize = (0..20).map(|_| p.step(&[6]).exchanges.len()).sum();
        assert_eq!(admitted, 1);
        assert!(p.is_resident(0) && p.is_resident(6) && !p.is_resident(1));
    }

    #[test]
    fn adaptive_follows_recency_on_bursts_and_frequency_on_a_stable_set() {
        let mut rng = 12345u64;
        let mut next = |n: u64| {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((rng >> 33) % n) as usize
        };
        let cfg = PolicyConfig::of(PolicyKind::Adaptive);
        // stable: experts 0..4 every step, plus one of 4..64 at random
        let mut stable = LayerPolicy::new(cfg, 64, &[0, 1, 2, 3, 4, 5], &[0, 1, 2, 3, 4, 5]);
        let mut copies = 0;
        for _ in 0..600 {
            let mut s = vec![0, 1, 2, 3, 4 + next(60)];
            s.dedup();
            copies += stable.step(&s).exchanges.len();
        }
        assert!(stable.half_life() >= 16.0, "stable: half-life {}", stable.half_life());
        // bursts: each 6 steps a new pair of experts, used every step of its burst
        let mut bursty = LayerPolicy::new(cfg, 64, &[0, 1, 2, 3], &[0, 1, 2, 3]);
        let mut hits = 0;
        for burst in 0..100 {
            let pair = [(burst * 2) % 64, (burst * 2 + 1) % 64];
            for _ in 0..6 {
                hits += bursty.step(&pair).hits;
            }
        }
        assert!(bursty.half_life() <= 4.0, "bursty: half-life {}", bursty.half_life());
        // the bursts' later steps hit: about 5 of 6 once recency wins
        assert!(hits > 100 * 2 * 4, "bursty hits {hits}");
        assert!(copies < 600, "stable: {copies} copies for 600 steps");
    }

    /// A deterministic pseudo-random source for the policy tests.
    fn lcg(seed: u64) -> impl FnMut(u64) -> usize {
        let mut rng = seed;
        move |n: u64| {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((rng >> 33) % n) as usize
        }
    }

    #[test]
    fn reuse_learns_that_recent_experts_come_back_and_follows_bursts() {
        let cfg = PolicyConfig::of(PolicyKind::Reuse);
        let mut p = LayerPolicy::new(cfg, 64, &[0, 1, 2, 3], &[0, 1, 2, 3]);
        let (mut hits, mut copies) = (0, 0);
        for burst in 0..101 {
            let pair = [(burst * 2) % 64, (burst * 2 + 1) % 64];
            // the last burst stops half-way
            for _ in 0..if burst == 100 { 3 } else { 6 } {
                let out = p.step(&pair);
                (hits, copies) = (hits + out.hits, copies + out.exchanges.len());
            }
        }
        let m = p.reuse_model().unwrap();
        // the pair of the running burst (3 of the last 3 steps) goes on; the one before ended
        // (its 6 uses were 4 to 9 steps ago, 5 in the window); a burst that has had its 6 steps
        // ends too
        let (now, before, never) =
            (m.reuse_probability(200 % 64), m.reuse_probability(198 % 64), m.reuse_probability(63));
        assert_eq!((m.window_count(200 % 64), m.window_count(198 % 64)), (3, 5));
        assert!(now > 0.9 && before < 0.1 && never < 0.1, "now {now}, before {before}, never {never}");
        // each burst's pair is admitted once, after its first step: 5 of 6 steps hit
        assert!(hits >= 100 * 2 * 5 - 20, "bursty hits {hits}");
        assert!(copies <= 101 * 2, "bursty copies {copies}");
    }

    #[test]
    fn reuse_keeps_a_stable_core_and_refuses_one_offs() {
        let mut next = lcg(777);
        let cfg = PolicyConfig::of(PolicyKind::Reuse);
        let mut reuse = LayerPolicy::new(cfg, 64, &[0, 1, 2, 3, 4, 5], &[0, 1, 2, 3, 4, 5]);
        let mut lru =
            LayerPolicy::new(PolicyConfig::of(PolicyKind::Lru), 64, &[0, 1, 2, 3, 4, 5], &[0, 1, 2, 3]);
        let (mut copies, mut lru_copies, mut hits) = (0, 0, 0);
        for _ in 0..600 {
            let s = [0, 1, 2, 3, 4 + next(60)];
            let out = reuse.step(&s);
            (copies, hits) = (copies + out.exchanges.len(), hits + out.hits);
            lru_copies += lru.step(&s).exchanges.len();
        }
        assert!((0..4).all(|e| reuse.is_resident(e)), "the core stays hot");
        assert!(hits >= 600 * 4, "every core use hits: {hits}");
        // a one-off's predicted reuse (about 1/60) does not beat a resident's by the margin once
        // the table has seen a few of them (while its cells are empty, some are copied)
        assert!(copies * 5 < lru_copies, "reuse copied {copies} one-offs; lru {lru_copies}");
        assert!(lru_copies > 500, "lru copies every one-off: {lru_copies}");
    }

    #[test]
    fn reuse_learns_its_margin_from_what_its_swaps_paid() {
        // a stable set: 16 experts of equal rate (each step 4 of them at random), 8 slots; a
        // swap between equals never repays its copy, whatever the predictor says
        // (with the PCIe transfer counted a copy needs 3.3 uses and the margin stays up; with it
        // overlapped, the default, 0.83: a declined swap "pays" whenever chance gave the miss
        // one use more than its victim, nearly as often as it loses, and only the wrong
        // decisions move the margin, so it sinks to the floor; the copies stay few and cheap)
        let cfg = PolicyConfig::of(PolicyKind::Reuse);
        let counted = PolicyConfig { copy_cost: CopyCost { pcie_overlapped: false, ..cfg.copy_cost }, ..cfg };
        for (cfg, lose_over_pay, steps_per_copy) in [(counted, 2, 100), (cfg, 1, 20)] {
            let mut next = lcg(4242);
            let initial: Vec<usize> = (0..8).collect();
            let mut p = LayerPolicy::new(cfg, 64, &initial, &initial);
            assert_eq!(p.reuse_margin(), REUSE_MARGIN_START);
            let mut copies = 0;
            for _ in 0..3000 {
                let mut s: Vec<usize> = (0..4).map(|_| next(16)).collect();
                s.sort_unstable();
                s.dedup();
                copies += p.step(&s).exchanges.len();
            }
            let [_, _, would_pay, would_lose] = p.ledger_counts().unwrap();
            let lose = would_lose > lose_over_pay * would_pay;
            assert!(lose, "declined swaps between equals lose: {would_pay} / {would_lose}");
            if !cfg.copy_cost.pcie_overlapped {
                assert!(
                    p.reuse_margin() > REUSE_MARGIN,
                    "the margin stays above its floor: {}",
                    p.reuse_margin()
                );
            }
            assert!(copies * steps_per_copy < 3000, "at most one copy per {steps_per_copy} steps: {copies}");
        }
        let cfg = PolicyConfig::of(PolicyKind::Reuse);
        // bursts: each admission is used 5 times more than its victim, far past break-even, and
        // predicted far above it: admitted even at the sceptical start, and they pay
        let mut b = LayerPolicy::new(cfg, 64, &[0, 1, 2, 3], &[0, 1, 2, 3]);
        let mut late = 0;
        for burst in 0..200 {
            let pair = [(burst * 2) % 64, (burst * 2 + 1) % 64];
            let n: usize = (0..6).map(|_| b.step(&pair).exchanges.len()).sum();
            late += if burst >= 100 { n } else { 0 };
        }
        let [paid, lost, ..] = b.ledger_counts().unwrap();
        assert!(paid > 10 * lost.max(1), "bursty admissions pay: {paid} paid, {lost} lost");
        assert!(b.reuse_margin() <= REUSE_MARGIN_START, "the margin did not rise: {}", b.reuse_margin());
        assert!(late >= 2 * 100, "every late burst is admitted: {late}");
    }

    #[test]
    fn reuse_keeps_its_count_order_as_a_full_sort_would() {
        let mut next = lcg(77);
        let cfg = PolicyConfig::of(PolicyKind::Reuse);
        let mut p = LayerPolicy::new(cfg, 40, &[0, 1, 2, 3], &[0, 1, 2, 3]);
        for i in 0..3000 {
            // bursts of a few experts between spells of random ones: ties and overtakes
            let n = 1 + next(6);
            let mut s: Vec<usize> = (0..n).map(|_| if i % 50 < 10 { next(5) } else { next(40) }).collect();
            s.sort_unstable();
            s.dedup();
            p.step(&s);
            let freq = &p.freq[0];
            let m = p.reuse.as_ref().unwrap();
            let mut full: Vec<usize> = (0..40).collect();
            full.sort_by(|&a, &b| freq[b].total_cmp(&freq[a]).then(a.cmp(&b)));
            assert_eq!(m.order, full, "step {i}");
            assert!(m.order.iter().enumerate().all(|(r, &e)| m.place[e] == r), "step {i}");
        }
    }

    #[test]
    fn reuse_admits_only_past_the_margin() {
        let cfg = PolicyConfig::of(PolicyKind::Reuse);
        let mut p = LayerPolicy::new(cfg, 8, &[0, 1], &[0, 1]);
        // teach the table: 0 and 1 every step, one of 2..8 at random
        let mut next = lcg(31);
        for _ in 0..400 {
            p.step(&[0, 1, 2 + next(6)]);
        }
        let m = p.reuse_model().unwrap();
        let (hot, one_off) =
            (m.reuse_probability(0), (2..8).map(|e| m.reuse_probability(e)).fold(0.0, f64::max));
        assert!(hot > one_off + REUSE_MARGIN, "hot {hot}, one-off {one_off}");
        assert!(p.is_resident(0) && p.is_resident(1));
        // a miss whose prediction is below the residents' is not admitted, even as the only miss
        assert!(p.step(&[0, 7]).exchanges.is_empty());
        assert!(p.step(&[1, 7]).exchanges.is_empty());
    }

    #[test]
    fn the_copy_gate_counts_dram_and_the_pcie_transfer_unless_overlapped() {
        let c = CopyCost::default();
        let bytes = 9_437_184; // one Qwen3-30B-A3B bf16 expert
        let uses = c.break_even_uses();
        assert!((c.copy_s(bytes) - uses * c.saving_per_use_s(bytes)).abs() < 1e-12);
        // overlapped (the default): 1/150 over 1/120 - 1/3000 (per GB/s): 0.83 uses
        assert!((uses - 1.0 / 1.2).abs() < 1e-9, "{uses}");
        assert!(c.pays(0.84) && !c.pays(0.8));
        // counted: 1/50 + 1/150 over the same: 3.33 uses
        let counted = CopyCost { pcie_overlapped: false, ..c };
        assert!((counted.break_even_uses() - 10.0 / 3.0).abs() < 1e-9);
        assert!(counted.copy_s(bytes) > 3.9 * c.copy_s(bytes));
        let slower_dram = CopyCost { host_dram_bytes_per_s: 10e9, ..c };
        assert!(slower_dram.break_even_uses() > 12.0);
        assert!(CopyCost { hbm_bytes_per_s: 0.0, ..c }.check().is_err());
        let json = r#"{"copy_cost": {"pcie_overlapped": false}}"#;
        let cfg: PolicyConfig = serde_json::from_str(json).unwrap();
        assert_eq!(cfg.copy_cost, counted);
    }

    #[test]
    fn kinds_parse_and_the_config_deserializes() {
        assert_eq!("tinylfu".parse::<PolicyKind>().unwrap(), PolicyKind::TinyLfu);
        assert!("arc".parse::<PolicyKind>().is_err());
        let c: PolicyConfig = serde_json::from_str(r#"{"kind":"lru","half_life":8}"#).unwrap();
        assert_eq!((c.kind, c.half_life, c.pin_fraction), (PolicyKind::Lru, 8.0, DEFAULT_PIN_FRACTION));
        assert!(serde_json::from_str::<PolicyConfig>(r#"{"kind":"lru","halflife":8}"#).is_err());
        assert!(PolicyConfig { pin_fraction: 1.5, ..c }.check().is_err());
        assert_eq!(c.lag_steps, DEFAULT_POLICY_LAG_STEPS);
        let c: PolicyConfig = serde_json::from_str(r#"{"kind":"reuse","lag_steps":0}"#).unwrap();
        assert!(c.check().is_ok() && c.lag_steps == 0);
        let err = PolicyConfig { lag_steps: 2, ..c }.check().unwrap_err().to_string();
        assert!(err.contains("lag_steps"), "{err}");
    }

    proptest! {
        #[test]
        fn belady_is_optimal_on_small_sequences(
            seq in proptest::collection::vec(0usize..5, 0..11),
            cap in 1usize..4,
        ) {
            let initial: Vec<usize> = (0..cap).collect();
            let steps: Vec<Vec<usize>> = seq.iter().map(|&e| vec![e]).collect();
            prop_assert_eq!(belady_hits(&steps, &initial), brute_force(&seq, &mut initial.clone()));
        }

        #[test]
        fn no_policy_beats_belady(
            raw in proptest::collection::vec(proptest::collection::vec(0usize..12, 1..4), 1..60),
            cap in 1usize..8,
        ) {
            let seq: Vec<Vec<usize>> = raw.into_iter().map(|mut s| { s.sort(); s.dedup(); s }).collect();
            let initial: Vec<usize> = (0..cap).collect();
            let best = belady_hits(&seq, &initial);
            for kind in PolicyKind::ONLINE {
                prop_assert!(run(kind, &seq, &initial, 12) <= best, "{:?}", kind);
            }
        }
    }
}
