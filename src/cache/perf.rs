//! Perf state: per layer and expert, hot and cold slot counts, calls, lane timings and fallbacks
//! with reasons; rendered as (and parsed from) the perf JSON of DESIGN.md, which is also the
//! learn file format.
//!
//! Modes: `full` (every counter and timing), `update` (only the slot counts the updater needs),
//! `off` (nothing recorded: every recording method returns after one branch on the mode).
//!
//! One store, two views: the state is owned by the engine's driver thread and records each layer
//! call once, into plain integers (allocated for every layer and expert when the state is created;
//! the perf JSON is rendered from them) and through `metrics` facade handles registered once per
//! layer, lane and fallback reason when the state is created ([`PerfMetrics`]; whatever recorder
//! the process installed, e.g. the server's Prometheus exporter, else no-ops). Per call that is a
//! few atomic adds: no allocation, no formatting, no lookup. Per-expert counts stay in the JSON.
//!
//! Parsing is tolerant where DESIGN.md says so: unknown fields are ignored, missing optional
//! fields default to zero, and a learn file may carry only `experts` per layer. Anything
//! malformed is a [`PerfError`] naming the file and the field.

use metrics::{Counter, Gauge, Histogram};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What the perf state records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum PerfMode {
    #[default]
    Full,
    Update,
    Off,
}

impl PerfMode {
    pub const ALL: [PerfMode; 3] = [PerfMode::Full, PerfMode::Update, PerfMode::Off];

    pub fn name(self) -> &'static str {
        match self {
            PerfMode::Full => "full",
            PerfMode::Update => "update",
            PerfMode::Off => "off",
        }
    }
}

impl std::str::FromStr for PerfMode {
    type Err = String;
    fn from_str(s: &str) -> Result<PerfMode, String> {
        match s {
            "full" => Ok(PerfMode::Full),
            "update" => Ok(PerfMode::Update),
            "off" => Ok(PerfMode::Off),
            other => Err(format!("perf mode '{other}': expected full, update or off")),
        }
    }
}

/// Why a layer ran all-cold instead of split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FallbackReason {
    /// A lane reported an error (or panicked).
    LaneFailed,
    /// A lane did not answer in time or its thread is gone.
    LaneUnavailable,
    /// The worklist failed its consistency check.
    Worklist,
    /// The layer's shape is outside what the split path handles (e.g. too many tokens).
    Shape,
    /// The GPU (or its context) failed: the whole call ran on the CPU pipeline.
    GpuLost,
}

impl FallbackReason {
    pub const ALL: [FallbackReason; 5] = [
        FallbackReason::LaneFailed,
        FallbackReason::LaneUnavailable,
        FallbackReason::Worklist,
        FallbackReason::Shape,
        FallbackReason::GpuLost,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FallbackReason::LaneFailed => "lane_failed",
            FallbackReason::LaneUnavailable => "lane_unavailable",
            FallbackReason::Worklist => "worklist",
            FallbackReason::Shape => "shape",
            FallbackReason::GpuLost => "gpu_lost",
        }
    }
}

/// One layer in the perf JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct LayerPerf {
    pub layer: usize,
    pub calls: u64,
    pub expert_hits_total: u64,
    pub hot_slots_total: u64,
    pub cold_slots_total: u64,
    pub moe_time_us: u64,
    pub routing_time_us: u64,
    pub worklist_time_us: u64,
    pub matmul_time_us: u64,
    pub branch_time_us: u64,
    pub gather_scatter_time_us: u64,
    pub merge_time_us: u64,
    pub parallel_wall_time_us: u64,
    pub parallel_hot_time_us: u64,
    pub parallel_cold_time_us: u64,
    pub parallel_overlap_us: u64,
    pub parallel_join_wait_us: u64,
    pub parallel_launches: u64,
    pub parallel_fallbacks: u64,
    pub fallback_reasons: BTreeMap<String, u64>,
    /// What the latest fallback reported (the lane's error, the device's), so a counted fault
    /// can be told apart from another; null where none fell back.
    pub last_fallback: Option<String>,
    pub experts: Vec<u64>,
    pub hot_experts: Vec<u64>,
    pub cold_experts: Vec<u64>,
    /// Experts copied into this layer's hot cache, and experts it evicted (one of each per
    /// applied exchange, by any policy or a manual apply).
    pub admissions: u64,
    pub evictions: u64,
}

/// The perf JSON document (also the learn file).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct PerfReport {
    pub mode: PerfMode,
    pub active: bool,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub updates: u64,
    pub overflow_resets: u64,
    /// The engine's thread counts (cold lane, dense stage) and how they were chosen.
    pub threads: crate::threads::ThreadReport,
    pub layers: Vec<LayerPerf>,
    /// The model this document was recorded on; a learn file from another model is refused
    /// (`cache::observe`). Absent in files written before it existed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelFingerprint>,
    /// Per phase (`warmup`, `prefill`, `decode`): forward calls, tokens, wall time and the lane
    /// share of it; the what-if planner's cost model is calibrated from these.
    pub phases: BTreeMap<String, PhasePerf>,
    /// What the hot-cache updater did (automatic updates and manual applies).
    pub cache_updates: CacheUpdateStats,
    /// Post-Fetch of cold experts in prefill (GPU engine with it enabled; absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub postfetch: Option<PostFetchPerf>,
}

/// Post-Fetch in the perf JSON: cold experts copied to a VRAM scratchpad and computed on the GPU
/// in prefill, summed over the run. Seed 001's targets: `transfer_overlap` >= 0.7,
/// `fallback_rate` <= 0.05, `vram_overhead` <= 0.1.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct PostFetchPerf {
    /// `auto` or `on`.
    pub mode: String,
    /// Prefill layer calls planned.
    pub layer_calls: u64,
    /// Experts the cost model (or `on`) chose for the GPU.
    pub experts_chosen: u64,
    pub experts_fetched: u64,
    pub bytes_copied: u64,
    /// Copy-lane time (first copy queued to last copy done, per layer call).
    pub copy_time_us: u64,
    /// Copy time not hidden behind compute (the host's CPU lane or the GPU's hot lane).
    pub copy_exposed_us: u64,
    /// `1 - copy_exposed / copy_time` (null before any copy).
    pub transfer_overlap: Option<f64>,
    /// Chosen experts that ran on the CPU after all, and why.
    pub fallbacks: u64,
    pub fallback_reasons: BTreeMap<String, u64>,
    /// `fallbacks / experts_chosen` (null before any was chosen).
    pub fallback_rate: Option<f64>,
    /// Times the host waited for a copy in flight (`block_on_miss`), and how long in all.
    pub block_waits: u64,
    pub block_wait_us: u64,
    /// VRAM of the scratchpad, the hot cache's, and their ratio (null without a hot cache).
    pub scratch_bytes: u64,
    pub hot_cache_bytes: u64,
    pub vram_overhead: Option<f64>,
    /// Host-to-device rate the cost model uses (measured at engine start).
    pub pcie_bytes_per_s: f64,
    /// `registered`: copies read the model file's pages (registered with the device);
    /// `staged`: through pinned buffers.
    pub copy_source: String,
    /// The driver's refusal to register the file, when that is why copies are staged.
    pub register_error: Option<String>,
}

/// The model a perf document was recorded on: architecture, layer and expert counts, and the
/// shape of one expert (`[hidden, expert_ff]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelFingerprint {
    pub architecture: String,
    pub n_layers: usize,
    pub n_experts: usize,
    pub n_experts_used: usize,
    pub expert_shape: [usize; 2],
}

/// Forward calls of one phase, summed over the run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct PhasePerf {
    pub calls: u64,
    pub tokens: u64,
    /// Wall time of the whole forward calls (dense stage, MoE, logits).
    pub wall_time_us: u64,
    /// Wall time of the split MoE region (hot and cold lanes, join) inside those calls.
    pub lane_wall_time_us: u64,
    pub hot_slots: u64,
    pub cold_slots: u64,
    pub hot_time_us: u64,
    pub cold_time_us: u64,
    /// What the what-if planner's cost model fits per layer call (absent in older files: all
    /// zero, and the planner falls back to its per-slot model). Ping-pong calls are left out:
    /// their layers' lane times are two micro-batches' interleaved.
    pub lane_cost: LaneCost,
    /// Calls that ran as two micro-batches whose lanes ping-pong (the GPU engine's batched
    /// decode steps, `gpu::PING_PONG_MAX_ROWS`); absent when none did.
    #[serde(skip_serializing_if = "is_zero")]
    pub ping_pong_calls: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Per phase, the split layer calls (lanes ran; fallbacks excluded) in sums the what-if
/// planner fits a per-layer-call cost to (`cache::whatif`): a call without cold work costs
/// `W0`; one with `s` cold slots of `d` distinct cold experts costs `F + D*d + S*s`. With
/// `y` the call's lane wall time, the sums are the least-squares moments of `(1, d, s, y)`
/// over the calls with cold work. Integer adds only, per layer call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct LaneCost {
    /// Split layer calls without cold slots, and their lane wall time.
    pub calls_no_cold: u64,
    pub wall_no_cold_us: u64,
    /// Layer calls that ran no lane region at all (the GPU's fully cached decode layers).
    pub calls_unsplit: u64,
    /// Tokens of the split calls (with or without cold work): tokens per layer call.
    pub tokens: u64,
    /// Split layer calls with cold slots, and the moments of their `d`, `s` and `y`.
    pub calls_cold: u64,
    pub cold_experts: u64,
    pub cold_slots: u64,
    pub wall_cold_us: u64,
    pub cold_experts_sq: u64,
    pub cold_slots_sq: u64,
    pub experts_x_slots: u64,
    pub experts_x_wall_us: u64,
    pub slots_x_wall_us: u64,
    pub wall_sq_us2: u64,
}

impl LaneCost {
    /// Whether any split layer call was recorded (false in files older than these fields).
    pub fn is_recorded(&self) -> bool {
        self.calls_cold + self.calls_no_cold > 0
    }

    /// Add one split layer call of `tokens` tokens: `cold_slots` slots of `cold_experts`
    /// distinct cold experts, its lanes took `wall_us`.
    #[inline]
    pub fn add_call(&mut self, tokens: u64, cold_experts: u64, cold_slots: u64, wall_us: u64) {
        self.tokens += tokens;
        if cold_slots == 0 {
            self.calls_no_cold += 1;
            self.wall_no_cold_us += wall_us;
            return;
        }
        let (d, s, y) = (cold_experts, cold_slots, wall_us);
        self.calls_cold += 1;
        self.cold_experts += d;
        self.cold_slots += s;
        self.wall_cold_us += y;
        self.cold_experts_sq += d * d;
        self.cold_slots_sq += s * s;
        self.experts_x_slots += d * s;
        self.experts_x_wall_us += d * y;
        self.slots_x_wall_us += s * y;
        self.wall_sq_us2 = self.wall_sq_us2.saturating_add(y * y);
    }

    fn add(&mut self, o: &LaneCost) {
        let LaneCost {
            calls_no_cold,
            wall_no_cold_us,
            calls_unsplit,
            tokens,
            calls_cold,
            cold_experts,
            cold_slots,
            wall_cold_us,
            cold_experts_sq,
            cold_slots_sq,
            experts_x_slots,
            experts_x_wall_us,
            slots_x_wall_us,
            wall_sq_us2,
        } = *o;
        self.calls_no_cold += calls_no_cold;
        self.wall_no_cold_us += wall_no_cold_us;
        self.calls_unsplit += calls_unsplit;
        self.tokens += tokens;
        self.calls_cold += calls_cold;
        self.cold_experts += cold_experts;
        self.cold_slots += cold_slots;
        self.wall_cold_us += wall_cold_us;
        self.cold_experts_sq += cold_experts_sq;
        self.cold_slots_sq += cold_slots_sq;
        self.experts_x_slots += experts_x_slots;
        self.experts_x_wall_us += experts_x_wall_us;
        self.slots_x_wall_us += slots_x_wall_us;
        self.wall_sq_us2 = self.wall_sq_us2.saturating_add(wall_sq_us2);
    }
}

/// Hot-cache update statistics (DESIGN.md "Update").
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct CacheUpdateStats {
    /// Automatic updates that ran (also those that found nothing worth exchanging).
    pub auto_updates: u64,
    pub manual_applies: u64,
    pub exchanges: u64,
    /// Exchanges the updater's full queue refused (none applied of them).
    pub exchanges_refused: u64,
    /// Exchanged-in experts whose copies landed and that the lanes then used as hot (on the GPU
    /// an exchanged-in expert runs cold until its copy has landed; the CPU's exchanges land at
    /// once). `exchanges - exchanges_landed` are in flight or were exchanged out first.
    pub exchanges_landed: u64,
    pub bytes_copied: u64,
    /// Host time spent issuing the exchanges (on the GPU the copies themselves run on the side
    /// stream, overlapped with compute).
    pub copy_time_us: u64,
    /// Hit rate of the window that the last update was planned from, and of the window after it.
    pub last_hit_rate_before: f64,
    pub last_hit_rate_after: f64,
}

/// Lane totals over every layer, for per-phase deltas.
#[derive(Debug, Clone, Copy, Default)]
pub struct LaneSnapshot {
    lane_wall_us: u64,
    hot_slots: u64,
    cold_slots: u64,
    hot_us: u64,
    cold_us: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum PerfError {
    #[error("{path}: cannot read: {reason}")]
    Io { path: PathBuf, reason: String },
    #[error("{path}: malformed perf JSON at '{field}': {reason}")]
    Malformed { path: PathBuf, field: String, reason: String },
}

impl PerfReport {
    /// Parse a learn file / perf snapshot. `n_experts` (when known) checks the expert arrays.
    pub fn parse(path: &Path, text: &str, n_experts: Option<usize>) -> Result<PerfReport, PerfError> {
        let malformed =
            |field: String, reason: String| PerfError::Malformed { path: path.into(), field, reason };
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| malformed("(document)".into(), e.to_string()))?;
        // Re-parse field by field so the error names the field (serde_json's own error names a line).
        let obj =
            value.as_object().ok_or_else(|| malformed("(document)".into(), "expected an object".into()))?;
        let mut report = PerfReport::default();
        for (key, v) in obj {
            let field = key.clone();
            let res: Result<(), serde_json::Error> = match key.as_str() {
                "mode" => serde_json::from_value(v.clone()).map(|x| report.mode = x),
                "active" => serde_json::from_value(v.clone()).map(|x| report.active = x),
                "n_expert" => serde_json::from_value(v.clone()).map(|x| report.n_expert = x),
                "n_expert_used" => serde_json::from_value(v.clone()).map(|x| report.n_expert_used = x),
                "updates" => serde_json::from_value(v.clone()).map(|x| report.updates = x),
                "overflow_resets" => serde_json::from_value(v.clone()).map(|x| report.overflow_resets = x),
                "threads" => serde_json::from_value(v.clone()).map(|x| report.threads = x),
                "model" => serde_json::from_value(v.clone()).map(|x| report.model = x),
                "phases" => serde_json::from_value(v.clone()).map(|x| report.phases = x),
                "cache_updates" => serde_json::from_value(v.clone()).map(|x| report.cache_updates = x),
                "layers" => {
                    let arr =
                        v.as_array().ok_or_else(|| malformed(field.clone(), "expected an array".into()))?;
                    for (i, layer) in arr.iter().enumerate() {
                        let lp =
                            parse_layer(layer).map_err(|(f, r)| malformed(format!("layers[{i}].{f}"), r))?;
                        if let Some(n) = n_experts {
                            for (name, a) in [
                                ("experts", &lp.experts),
                                ("hot_experts", &lp.hot_experts),
                                ("cold_experts", &lp.cold_experts),
                            ] {
                                if !a.is_empty() && a.len() != n {
                                    return Err(malformed(
                                        format!("layers[{i}].{name}"),
                                        format!("has {} entries, the model has {n} experts", a.len()),
                                    ));
                                }
                            }
                        }
                        report.layers.push(lp);
                    }
                    Ok(())
                }
                _ => Ok(()),
            };
            res.map_err(|e| malformed(field, e.to_string()))?;
        }
        Ok(report)
    }

    pub fn read(path: &Path, n_experts: Option<usize>) -> Result<PerfReport, PerfError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| PerfError::Io { path: path.into(), reason: e.to_string() })?;
        Self::parse(path, &text, n_experts)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("perf report serialises")
    }
}

fn parse_layer(v: &serde_json::Value) -> Result<LayerPerf, (String, String)> {
    let obj = v.as_object().ok_or_else(|| ("(layer)".to_string(), "expected an object".to_string()))?;
    if !obj.contains_key("layer") {
        return Err(("layer".into(), "missing field".into()));
    }
    // Field by field so the error names the field; unknown fields are skipped.
    let known = serde_json::to_value(LayerPerf::default()).expect("serialises");
    let known = known.as_object().expect("object");
    let mut filtered = serde_json::Map::new();
    for (k, x) in obj {
        if let Some(template) = known.get(k) {
            let one = serde_json::json!({ k.clone(): x.clone() });
            if let Err(e) = serde_json::from_value::<LayerPerf>(one) {
                let _ = template;
                return Err((k.clone(), e.to_string()));
            }
            filtered.insert(k.clone(), x.clone());
        }
    }
    serde_json::from_value(serde_json::Value::Object(filtered)).map_err(|e| ("(layer)".into(), e.to_string()))
}

/// Timings of one layer of one call, read off lane message timestamps.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LayerTiming {
    pub routing_us: u64,
    pub worklist_us: u64,
    pub hot_us: u64,
    pub cold_us: u64,
    pub wall_us: u64,
    pub overlap_us: u64,
    pub join_wait_us: u64,
    pub merge_us: u64,
    /// The lane region ran and `wall_us` measured it (false: e.g. a fully cached GPU decode
    /// layer, whose hot lane runs on the stream with no host split).
    pub split: bool,
}

/// Names of the metrics the perf state records (Prometheus conventions: `moe_lanes_` prefix,
/// base units, `_total` counters, `_seconds` histograms). Histograms named `moe_lanes_layer_*`
/// hold one layer call each (µs to ms); an exporter should give them [`LAYER_BUCKETS_S`].
pub mod metric_names {
    pub const LAYER_CALLS: &str = "moe_lanes_layer_calls_total";
    pub const LAYER_HOT_SLOTS: &str = "moe_lanes_layer_hot_slots_total";
    pub const LAYER_COLD_SLOTS: &str = "moe_lanes_layer_cold_slots_total";
    pub const LAYER_LANE: &str = "moe_lanes_layer_lane_seconds";
    pub const LAYER_OVERLAP: &str = "moe_lanes_layer_overlap_seconds";
    pub const LAYER_JOIN_WAIT: &str = "moe_lanes_layer_join_wait_seconds";
    pub const FALLBACKS: &str = "moe_lanes_fallbacks_total";
    pub const EXCHANGES: &str = "moe_lanes_cache_exchanges_total";
    pub const BYTES_COPIED: &str = "moe_lanes_cache_bytes_copied_total";
    pub const EXCHANGES_REFUSED: &str = "moe_lanes_cache_exchanges_refused_total";
    pub const EXCHANGES_LANDED: &str = "moe_lanes_cache_exchanges_landed_total";
    pub const ADMISSIONS: &str = "moe_lanes_cache_admissions_total";
    pub const EVICTIONS: &str = "moe_lanes_cache_evictions_total";
    pub const PERF_MODE: &str = "moe_lanes_perf_mode";
    pub const POSTFETCH_CHOSEN: &str = "moe_lanes_postfetch_experts_chosen_total";
    pub const POSTFETCH_FETCHED: &str = "moe_lanes_postfetch_experts_fetched_total";
    pub const POSTFETCH_BYTES: &str = "moe_lanes_postfetch_bytes_copied_total";
    pub const POSTFETCH_FALLBACKS: &str = "moe_lanes_postfetch_fallbacks_total";
    pub const POSTFETCH_BLOCK_WAITS: &str = "moe_lanes_postfetch_block_waits_total";
    pub const POSTFETCH_OVERLAP: &str = "moe_lanes_postfetch_transfer_overlap_ratio";
    pub const POSTFETCH_FALLBACK_RATIO: &str = "moe_lanes_postfetch_fallback_ratio";
    pub const POSTFETCH_VRAM: &str = "moe_lanes_postfetch_vram_overhead_ratio";
    pub const POSTFETCH_SCRATCH: &str = "moe_lanes_postfetch_scratch_bytes";
    /// Prefix of the per-layer-call histograms.
    pub const LAYER_PREFIX: &str = "moe_lanes_layer_";
}

/// Histogram buckets for one layer call's lane time, overlap and join wait: 10 µs to 250 ms.
pub const LAYER_BUCKETS_S: [f64; 14] =
    [1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25];

/// Describe the perf state's metrics to the installed recorder (help text and units).
pub fn describe_metrics() {
    use metric_names as m;
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(m::LAYER_CALLS, "Forward calls through the layer's MoE block.");
    describe_counter!(m::LAYER_HOT_SLOTS, "Routed slots served by the hot lane, per layer.");
    describe_counter!(m::LAYER_COLD_SLOTS, "Routed slots served by the cold lane, per layer.");
    describe_histogram!(
        m::LAYER_LANE,
        Unit::Seconds,
        "Busy time of one lane in one layer call (the cold lane: split calls only)."
    );
    describe_histogram!(
        m::LAYER_OVERLAP,
        Unit::Seconds,
        "Time both lanes ran at once in one split layer call."
    );
    describe_histogram!(m::LAYER_JOIN_WAIT, Unit::Seconds, "Time the join waited for the later lane.");
    describe_counter!(m::FALLBACKS, "Layer calls that ran all-cold, by layer and reason.");
    describe_counter!(m::EXCHANGES, "Hot-cache slot exchanges applied (one expert evicted, one loaded).");
    describe_counter!(m::EXCHANGES_REFUSED, "Hot-cache slot exchanges the updater's full queue refused.");
    describe_counter!(
        m::EXCHANGES_LANDED,
        "Hot-cache exchanges whose copy has landed and whose expert now serves from the hot lane."
    );
    describe_counter!(
        m::ADMISSIONS,
        "Experts copied into the layer's hot cache (by the policy or a manual apply)."
    );
    describe_counter!(
        m::EVICTIONS,
        "Experts evicted from the layer's hot cache (by the policy or a manual apply)."
    );
    describe_counter!(m::BYTES_COPIED, Unit::Bytes, "Expert weight bytes copied into the hot cache.");
    describe_gauge!(m::PERF_MODE, "Perf mode (1 on the current mode's label, 0 on the others).");
    describe_counter!(
        m::POSTFETCH_CHOSEN,
        "Post-Fetch: cold experts chosen for the GPU in prefill layer calls."
    );
    describe_counter!(m::POSTFETCH_FETCHED, "Post-Fetch: cold experts copied to the VRAM scratchpad.");
    describe_counter!(m::POSTFETCH_BYTES, Unit::Bytes, "Post-Fetch: expert bytes copied to the scratchpad.");
    describe_counter!(
        m::POSTFETCH_FALLBACKS,
        "Post-Fetch: chosen experts computed on the CPU after all, by reason."
    );
    describe_counter!(
        m::POSTFETCH_BLOCK_WAITS,
        "Post-Fetch: fetched experts whose late copy was waited for."
    );
    describe_gauge!(
        m::POSTFETCH_OVERLAP,
        "Post-Fetch: share of the copy time hidden behind compute (target >= 0.7)."
    );
    describe_gauge!(m::POSTFETCH_FALLBACK_RATIO, "Post-Fetch: fallbacks per chosen expert (target <= 0.05).");
    describe_gauge!(m::POSTFETCH_VRAM, "Post-Fetch: scratchpad VRAM over the hot cache's (target <= 0.1).");
    describe_gauge!(m::POSTFETCH_SCRATCH, Unit::Bytes, "Post-Fetch: VRAM of the scratchpad.");
}

/// One layer's handles, made once.
#[derive(Debug, Clone)]
struct LayerMetrics {
    calls: Counter,
    hot_slots: Counter,
    cold_slots: Counter,
    hot_lane: Histogram,
    cold_lane: Histogram,
    overlap: Histogram,
    join_wait: Histogram,
    /// In [`FallbackReason::ALL`] order.
    fallbacks: [Counter; 5],
    admissions: Counter,
    evictions: Counter,
    /// Slot totals already added to the counters (the counters move once per layer call).
    pushed_hot: u64,
    pushed_cold: u64,
}

/// The perf state's `metrics` facade handles: registered once per layer, lane and reason when
/// the state is created (labels formatted then, never per call).
#[derive(Debug, Clone)]
pub struct PerfMetrics {
    layers: Vec<LayerMetrics>,
    exchanges: Counter,
    exchanges_refused: Counter,
    exchanges_landed: Counter,
    bytes_copied: Counter,
    /// In [`PerfMode::ALL`] order.
    mode: [Gauge; 3],
    /// Registered at the first Post-Fetch report (GPU engines with a scratchpad only).
    postfetch: Option<PostFetchMetrics>,
    /// Recording into no exporter ([`PerfState::detach_metrics`]): handles registered later
    /// go nowhere too.
    detached: bool,
}

/// Post-Fetch's handles and the totals already added to its counters.
#[derive(Debug, Clone)]
struct PostFetchMetrics {
    chosen: Counter,
    fetched: Counter,
    bytes: Counter,
    block_waits: Counter,
    /// Per reason of the first report (the reasons are a fixed set).
    fallbacks: Vec<(String, Counter)>,
    overlap: Gauge,
    fallback_ratio: Gauge,
    vram: Gauge,
    scratch: Gauge,
    pushed: PostFetchPerf,
}

impl PostFetchMetrics {
    fn register(p: &PostFetchPerf) -> PostFetchMetrics {
        use metric_names as m;
        use metrics::{counter, gauge};
        let reason = |r: &String| (r.clone(), counter!(m::POSTFETCH_FALLBACKS, "reason" => r.clone()));
        PostFetchMetrics {
            chosen: counter!(m::POSTFETCH_CHOSEN),
            fetched: counter!(m::POSTFETCH_FETCHED),
            bytes: counter!(m::POSTFETCH_BYTES),
            block_waits: counter!(m::POSTFETCH_BLOCK_WAITS),
            fallbacks: p.fallback_reasons.keys().map(reason).collect(),
            overlap: gauge!(m::POSTFETCH_OVERLAP),
            fallback_ratio: gauge!(m::POSTFETCH_FALLBACK_RATIO),
            vram: gauge!(m::POSTFETCH_VRAM),
            scratch: gauge!(m::POSTFETCH_SCRATCH),
            pushed: PostFetchPerf::default(),
        }
    }

    /// Move the counters by what `p` (running totals) adds to the last report; set the ratios
    /// that are known.
    fn push(&mut self, p: &PostFetchPerf) {
        let was = &self.pushed;
        self.chosen.increment(p.experts_chosen.saturating_sub(was.experts_chosen));
        self.fetched.increment(p.experts_fetched.saturating_sub(was.experts_fetched));
        self.bytes.increment(p.bytes_copied.saturating_sub(was.bytes_copied));
        self.block_waits.increment(p.block_waits.saturating_sub(was.block_waits));
        for (reason, counter) in &self.fallbacks {
            let count = |q: &PostFetchPerf| q.fallback_reasons.get(reason).copied().unwrap_or(0);
            counter.increment(count(p).saturating_sub(count(was)));
        }
        let ratios = [(&self.overlap, p.transfer_overlap), (&self.fallback_ratio, p.fallback_rate)];
        for (gauge, value) in ratios.into_iter().chain([(&self.vram, p.vram_overhead)]) {
            if let Some(v) = value {
                gauge.set(v);
            }
        }
        self.scratch.set(p.scratch_bytes as f64);
        self.pushed = p.clone();
    }
}

impl PerfMetrics {
    fn register(n_layers: usize) -> PerfMetrics {
        use metric_names as m;
        use metrics::{counter, gauge, histogram};
        describe_metrics();
        let layers = (0..n_layers)
            .map(|l| {
                let layer = l.to_string();
                let fallback = |r: FallbackReason| counter!(m::FALLBACKS, "layer" => layer.clone(), "reason" => r.name());
                LayerMetrics {
                    calls: counter!(m::LAYER_CALLS, "layer" => layer.clone()),
                    hot_slots: counter!(m::LAYER_HOT_SLOTS, "layer" => layer.clone()),
                    cold_slots: counter!(m::LAYER_COLD_SLOTS, "layer" => layer.clone()),
                    hot_lane: histogram!(m::LAYER_LANE, "layer" => layer.clone(), "lane" => "hot"),
                    cold_lane: histogram!(m::LAYER_LANE, "layer" => layer.clone(), "lane" => "cold"),
                    overlap: histogram!(m::LAYER_OVERLAP, "layer" => layer.clone()),
                    join_wait: histogram!(m::LAYER_JOIN_WAIT, "layer" => layer.clone()),
                    fallbacks: FallbackReason::ALL.map(fallback),
                    admissions: counter!(m::ADMISSIONS, "layer" => layer.clone()),
                    evictions: counter!(m::EVICTIONS, "layer" => layer.clone()),
                    pushed_hot: 0,
                    pushed_cold: 0,
                }
            })
            .collect();
        PerfMetrics {
            layers,
            exchanges: counter!(m::EXCHANGES),
            exchanges_refused: counter!(m::EXCHANGES_REFUSED),
            exchanges_landed: counter!(m::EXCHANGES_LANDED),
            bytes_copied: counter!(m::BYTES_COPIED),
            mode: PerfMode::ALL.map(|mode| gauge!(m::PERF_MODE, "mode" => mode.name())),
            postfetch: None,
            detached: false,
        }
    }

    fn set_mode(&self, mode: PerfMode) {
        for (g, m) in self.mode.iter().zip(PerfMode::ALL) {
            g.set(if m == mode { 1.0 } else { 0.0 });
        }
    }
}

/// Microseconds as seconds, for the `_seconds` histograms.
#[inline]
fn secs(us: u64) -> f64 {
    us as f64 * 1e-6
}

/// The live perf state the engine records into.
#[derive(Debug, Clone)]
pub struct PerfState {
    mode: PerfMode,
    report: PerfReport,
    /// Per layer, the timings of the most recent call (`full` mode): hot-lane, cold-lane, wall,
    /// overlap and join wait of one layer and one call, beside the totals of the report.
    last_call: Vec<LayerTiming>,
    metrics: PerfMetrics,
    /// Per expert, the stamp of the layer call that last counted it cold (distinct cold
    /// experts per call without clearing anything); the current stamp.
    cold_seen: Vec<u32>,
    stamp: u32,
    /// The current layer call's slots, cold slots and distinct cold experts so far.
    call_slots: u64,
    call_cold_slots: u64,
    call_cold_experts: u64,
    /// Split layer calls since the last [`PerfState::record_call`], folded into its phase then.
    pending_cost: LaneCost,
    /// The call being recorded ran as ping-pong micro-batches ([`PerfState::mark_ping_pong`]).
    pending_ping_pong: bool,
}

impl PerfState {
    /// Allocate every counter once: `n_layers` layers of `n_experts` experts; register the
    /// facade handles of every layer, lane and fallback reason.
    pub fn new(mode: PerfMode, n_layers: usize, n_experts: usize, n_experts_used: usize) -> PerfState {
        let layers = (0..n_layers)
            .map(|layer| LayerPerf {
                layer,
                experts: vec![0; n_experts],
                hot_experts: vec![0; n_experts],
                cold_experts: vec![0; n_experts],
                fallback_reasons: FallbackReason::ALL.iter().map(|r| (r.name().to_string(), 0)).collect(),
                ..LayerPerf::default()
            })
            .collect();
        let metrics = PerfMetrics::register(n_layers);
        metrics.set_mode(mode);
        PerfState {
            mode,
            last_call: vec![LayerTiming::default(); n_layers],
            metrics,
            cold_seen: vec![0; n_experts],
            stamp: 1,
            call_slots: 0,
            call_cold_slots: 0,
            call_cold_experts: 0,
            pending_cost: LaneCost::default(),
            pending_ping_pong: false,
            report: PerfReport {
                mode,
                active: mode != PerfMode::Off,
                n_expert: n_experts,
                n_expert_used: n_experts_used,
                layers,
                ..PerfReport::default()
            },
        }
    }

    pub fn mode(&self) -> PerfMode {
        self.mode
    }

    /// From now on record into no exporter (the JSON view only): for a learn pass, whose
    /// routing is not served traffic and must not show in the process's metrics.
    pub fn detach_metrics(&mut self) {
        let n_layers = self.report.layers.len();
        self.metrics =
            metrics::with_local_recorder(&metrics::NoopRecorder, || PerfMetrics::register(n_layers));
        self.metrics.detached = true;
    }

    /// Switch what is recorded from the next call on (the counts so far stay).
    pub fn set_mode(&mut self, mode: PerfMode) {
        self.mode = mode;
        self.report.mode = mode;
        self.report.active = mode != PerfMode::Off;
        self.metrics.set_mode(mode);
    }

    /// Count one routed slot of `expert_idx` in `layer_idx`, hot or cold (plain integers; the
    /// facade counters move by the layer's slots once per layer call).
    #[inline]
    pub fn record_slot(&mut self, layer_idx: usize, expert_idx: usize, hot: bool) {
        if self.mode == PerfMode::Off {
            return;
        }
        let l = &mut self.report.layers[layer_idx];
        l.experts[expert_idx] += 1;
        l.expert_hits_total += 1;
        self.call_slots += 1;
        if hot {
            l.hot_experts[expert_idx] += 1;
            l.hot_slots_total += 1;
        } else {
            l.cold_experts[expert_idx] += 1;
            l.cold_slots_total += 1;
            self.call_cold_slots += 1;
            let seen = &mut self.cold_seen[expert_idx];
            if *seen != self.stamp {
                *seen = self.stamp;
                self.call_cold_experts += 1;
            }
        }
    }

    /// End the current layer call's slot tally; returns (tokens, distinct cold experts, cold
    /// slots) of it.
    #[inline]
    fn take_call_tally(&mut self) -> (u64, u64, u64) {
        let k = self.report.n_expert_used.max(1) as u64;
        let tally = (self.call_slots.div_ceil(k), self.call_cold_experts, self.call_cold_slots);
        (self.call_slots, self.call_cold_experts, self.call_cold_slots) = (0, 0, 0);
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.cold_seen.fill(0);
            self.stamp = 1;
        }
        tally
    }

    /// One layer call finished (split or fallback) with these timings.
    #[inline]
    pub fn record_layer_call(&mut self, layer_idx: usize, timing: &LayerTiming, launched: bool) {
        if self.mode == PerfMode::Off {
            return;
        }
        let (tokens, cold_experts, cold_slots) = self.take_call_tally();
        let l = &mut self.report.layers[layer_idx];
        let m = &mut self.metrics.layers[layer_idx];
        l.calls += 1;
        m.calls.increment(1);
        m.hot_slots.increment(l.hot_slots_total - m.pushed_hot);
        m.cold_slots.increment(l.cold_slots_total - m.pushed_cold);
        (m.pushed_hot, m.pushed_cold) = (l.hot_slots_total, l.cold_slots_total);
        if self.mode != PerfMode::Full {
            return;
        }
        self.last_call[layer_idx] = *timing;
        l.routing_time_us += timing.routing_us;
        l.worklist_time_us += timing.worklist_us;
        l.merge_time_us += timing.merge_us;
        l.moe_time_us += timing.wall_us + timing.routing_us + timing.worklist_us;
        if launched && timing.split {
            self.pending_cost.add_call(tokens, cold_experts, cold_slots, timing.wall_us);
        } else if launched {
            self.pending_cost.calls_unsplit += 1;
        }
        if launched {
            l.parallel_launches += 1;
            l.parallel_wall_time_us += timing.wall_us;
            l.parallel_hot_time_us += timing.hot_us;
            l.parallel_cold_time_us += timing.cold_us;
            l.parallel_overlap_us += timing.overlap_us;
            l.parallel_join_wait_us += timing.join_wait_us;
            m.hot_lane.record(secs(timing.hot_us));
            // Cold lane, overlap and join wait exist only where the host split the layer (a
            // fully cached GPU decode layer has none: no zero samples, three records fewer).
            if timing.split {
                m.cold_lane.record(secs(timing.cold_us));
                m.overlap.record(secs(timing.overlap_us));
                m.join_wait.record(secs(timing.join_wait_us));
            }
        }
    }

    /// Fallbacks are counted in every mode, `off` included: they are rare (off the hot path)
    /// and must never be silent.
    pub fn record_fallback(&mut self, layer_idx: usize, reason: FallbackReason, detail: &str) {
        let l = &mut self.report.layers[layer_idx];
        l.parallel_fallbacks += 1;
        l.last_fallback = Some(format!("{}: {detail}", reason.name()));
        *l.fallback_reasons.entry(reason.name().to_string()).or_insert(0) += 1;
        let i = FallbackReason::ALL.iter().position(|&r| r == reason).expect("every reason is in ALL");
        self.metrics.layers[layer_idx].fallbacks[i].increment(1);
    }

    /// One hot-cache slot exchange was applied in `layer_idx` (one expert admitted, one
    /// evicted), copying `bytes_copied` bytes of expert weights. Counted in every mode (rare
    /// next to slots, and a cache that churns must never be silent); the perf JSON's `updates`
    /// and the layer's `admissions` and `evictions` count them unless the mode is `off`.
    pub fn record_exchange(&mut self, layer_idx: usize, bytes_copied: u64) {
        if self.mode != PerfMode::Off {
            self.report.updates += 1;
            if let Some(layer) = self.report.layers.get_mut(layer_idx) {
                layer.admissions += 1;
                layer.evictions += 1;
            }
        }
        if let Some(m) = self.metrics.layers.get(layer_idx) {
            m.admissions.increment(1);
            m.evictions.increment(1);
        }
        self.metrics.exchanges.increment(1);
        self.metrics.bytes_copied.increment(bytes_copied);
    }

    /// `n` exchanges the updater refused (its queue was full): counted in every mode, in the perf
    /// JSON's `cache_updates.exchanges_refused` and the metric.
    pub fn record_refused_exchanges(&mut self, n: u64) {
        self.report.cache_updates.exchanges_refused += n;
        self.metrics.exchanges_refused.increment(n);
    }

    /// `n` exchanged-in experts whose copies landed (now hot for the lanes): counted in every
    /// mode, in the perf JSON's `cache_updates.exchanges_landed` and the metric.
    pub fn record_landed_exchanges(&mut self, n: u64) {
        self.report.cache_updates.exchanges_landed += n;
        self.metrics.exchanges_landed.increment(n);
    }

    /// Timings of `layer_idx` in the most recent call (`full` mode; zero otherwise).
    pub fn last_call(&self, layer_idx: usize) -> &LayerTiming {
        &self.last_call[layer_idx]
    }

    pub fn report(&self) -> &PerfReport {
        &self.report
    }

    /// Post-Fetch's running totals (the perf JSON's `postfetch`; the GPU engine sets them after
    /// each prefill call): the facade's counters move by what they add, its ratios are set.
    pub fn set_postfetch(&mut self, postfetch: PostFetchPerf) {
        let m = &mut self.metrics;
        let pf = match m.postfetch.as_mut() {
            Some(pf) => pf,
            None if m.detached => {
                let handles = metrics::with_local_recorder(&metrics::NoopRecorder, || {
                    PostFetchMetrics::register(&postfetch)
                });
                m.postfetch.insert(handles)
            }
            None => m.postfetch.insert(PostFetchMetrics::register(&postfetch)),
        };
        pf.push(&postfetch);
        self.report.postfetch = Some(postfetch);
    }

    /// Record the engine's thread counts (shown in the perf JSON).
    pub fn set_threads(&mut self, threads: crate::threads::ThreadReport) {
        self.report.threads = threads;
    }

    pub fn fallbacks(&self, reason: FallbackReason) -> u64 {
        self.report.layers.iter().map(|l| l.fallback_reasons.get(reason.name()).copied().unwrap_or(0)).sum()
    }

    pub fn to_json(&self) -> String {
        self.report.to_json()
    }

    /// Name the model the counts are recorded on (written into the perf JSON).
    pub fn set_model(&mut self, model: ModelFingerprint) {
        self.report.model = Some(model);
    }

    /// Lane totals now, to be passed to [`PerfState::record_call`] after the call.
    pub fn lane_snapshot(&self) -> LaneSnapshot {
        let mut s = LaneSnapshot::default();
        for l in &self.report.layers {
            s.lane_wall_us += l.parallel_wall_time_us;
            s.hot_slots += l.hot_slots_total;
            s.cold_slots += l.cold_slots_total;
            s.hot_us += l.parallel_hot_time_us;
            s.cold_us += l.parallel_cold_time_us;
        }
        s
    }

    /// One forward call of `n_tokens` in `phase` took `wall_us`; `before` was taken before it.
    pub fn record_call(&mut self, phase: &str, n_tokens: usize, wall_us: u64, before: &LaneSnapshot) {
        if self.mode == PerfMode::Off {
            return;
        }
        let now = self.lane_snapshot();
        // Look up by &str first: a String is made once per phase name, not per call.
        if !self.report.phases.contains_key(phase) {
            self.report.phases.insert(phase.to_string(), PhasePerf::default());
        }
        let p = self.report.phases.get_mut(phase).expect("inserted above");
        if std::mem::take(&mut self.pending_ping_pong) {
            p.ping_pong_calls += 1;
        } else {
            p.lane_cost.add(&self.pending_cost);
        }
        self.pending_cost = LaneCost::default();
        p.calls += 1;
        p.tokens += n_tokens as u64;
        p.wall_time_us += wall_us;
        p.lane_wall_time_us += now.lane_wall_us.saturating_sub(before.lane_wall_us);
        p.hot_slots += now.hot_slots.saturating_sub(before.hot_slots);
        p.cold_slots += now.cold_slots.saturating_sub(before.cold_slots);
        p.hot_time_us += now.hot_us.saturating_sub(before.hot_us);
        p.cold_time_us += now.cold_us.saturating_sub(before.cold_us);
    }

    /// The call being recorded (until [`PerfState::record_call`]) ran as two micro-batches
    /// whose lanes ping-pong.
    pub fn mark_ping_pong(&mut self) {
        self.pending_ping_pong = true;
    }

    /// The updater's statistics (counted in every mode: updates are rare and must be visible).
    pub fn cache_updates_mut(&mut self) -> &mut CacheUpdateStats {
        &mut self.report.cache_updates
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let mut st = PerfState::new(PerfMode::Full, 2, 4, 2);
        st.record_slot(1, 3, true);
        st.record_slot(1, 2, false);
        st.record_layer_call(
            1,
            &LayerTiming { hot_us: 5, cold_us: 7, wall_us: 9, split: true, ..Default::default() },
            true,
        );
        st.record_fallback(0, FallbackReason::Worklist, "a test's");
        let json = st.to_json();
        let back = PerfReport::parse(Path::new("x.json"), &json, Some(4)).unwrap();
        assert_eq!(&back, st.report());
    }

    #[test]
    fn tolerant_and_strict_where_it_should_be() {
        let p = Path::new("learn.json");
        let r = PerfReport::parse(
            p,
            r#"{"future": 1, "layers": [{"layer": 0, "experts": [1,2], "new": "x"}]}"#,
            Some(2),
        )
        .unwrap();
        assert_eq!(r.layers[0].experts, vec![1, 2]);
        assert_eq!(r.layers[0].calls, 0);
        let err =
            PerfReport::parse(p, r#"{"layers": [{"layer": 0, "experts": [1, "a"]}]}"#, None).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("learn.json") && msg.contains("layers[0].experts"), "{msg}");
        let err = PerfReport::parse(p, r#"{"layers": [{"layer": 0, "experts": [1]}]}"#, Some(3)).unwrap_err();
        assert!(err.to_string().contains("layers[0].experts"), "{err}");
        let err = PerfReport::parse(p, r#"{"n_expert": -1}"#, None).unwrap_err();
        assert!(err.to_string().contains("n_expert"), "{err}");
        assert!(PerfReport::parse(p, "not json", None).is_err());
    }

    /// The facade view moves with the JSON view: every handle registered at creation, counters
    /// and histograms moved per layer call, nothing recorded in `off` but fallbacks/exchanges.
    /// A metrics snapshot keyed `name{label=value,...}`; a snapshot reads and resets, so counters
    /// are what moved since the last one.
    fn snapshot_map(
        snapshotter: &metrics_util::debugging::Snapshotter,
    ) -> std::collections::HashMap<String, metrics_util::debugging::DebugValue> {
        let snap = snapshotter.snapshot().into_vec().into_iter();
        snap.map(|(k, _, _, v)| {
            let key = k.key();
            let labels: Vec<String> = key.labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
            (format!("{}{{{}}}", key.name(), labels.join(",")), v)
        })
        .collect()
    }

    /// Prometheus's `promtool check metrics` (CI's grafana check) rejects a metric without help
    /// text: every metric the perf state registers is described.
    #[test]
    fn every_registered_metric_has_help_text() {
        use metrics_util::debugging::DebuggingRecorder;

        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, || {
            describe_metrics();
            PerfState::new(PerfMode::Full, 2, 4, 2)
        });
        let snap = snapshotter.snapshot().into_vec();
        assert!(!snap.is_empty());
        for (key, _, help, _) in snap {
            let name = key.key().name().to_string();
            assert!(help.is_some_and(|h| !h.is_empty()), "{name} has no help text");
        }
    }

    #[test]
    fn records_through_the_facade() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};

        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let mut st = metrics::with_local_recorder(&recorder, || PerfState::new(PerfMode::Full, 2, 4, 2));
        // A snapshot reads and resets: counters are what moved since the last one.
        let take = || snapshot_map(&snapshotter);
        let snap = take();
        // Registered at creation: 2 layers x (3 counters + admissions + evictions + 4 histograms
        // + 5 reasons) + 4 (exchanges, refused, landed, bytes) + 3 modes.
        assert_eq!(snap.len(), 2 * 14 + 4 + 3);
        assert_eq!(snap["moe_lanes_cache_exchanges_refused_total{}"], DebugValue::Counter(0));
        assert_eq!(snap["moe_lanes_cache_exchanges_landed_total{}"], DebugValue::Counter(0));
        assert_eq!(snap["moe_lanes_perf_mode{mode=full}"], DebugValue::Gauge(1.0.into()));
        assert_eq!(snap["moe_lanes_perf_mode{mode=off}"], DebugValue::Gauge(0.0.into()));
        st.record_slot(1, 3, true);
        st.record_slot(1, 2, false);
        st.record_slot(1, 2, false);
        let t = LayerTiming {
            hot_us: 50,
            cold_us: 70,
            wall_us: 90,
            overlap_us: 40,
            join_wait_us: 20,
            split: true,
            ..Default::default()
        };
        st.record_layer_call(1, &t, true);
        st.record_slot(1, 3, true);
        st.record_layer_call(1, &t, false);
        st.record_fallback(0, FallbackReason::Shape, "a test's");
        st.record_exchange(1, 4096);
        st.record_refused_exchanges(1);
        let snap = take();
        assert_eq!(snap["moe_lanes_layer_hot_slots_total{layer=1}"], DebugValue::Counter(2));
        assert_eq!(snap["moe_lanes_layer_cold_slots_total{layer=1}"], DebugValue::Counter(2));
        assert_eq!(snap["moe_lanes_layer_calls_total{layer=1}"], DebugValue::Counter(2));
        assert_eq!(snap["moe_lanes_layer_calls_total{layer=0}"], DebugValue::Counter(0));
        // Lane times only for the launched call, in seconds.
        let DebugValue::Histogram(h) = &snap["moe_lanes_layer_lane_seconds{layer=1,lane=cold}"] else {
            panic!()
        };
        assert_eq!(h.iter().map(|v| v.into_inner()).collect::<Vec<_>>(), vec![70e-6]);
        let DebugValue::Histogram(h) = &snap["moe_lanes_layer_join_wait_seconds{layer=1}"] else { panic!() };
        assert_eq!(h.len(), 1);
        assert_eq!(snap["moe_lanes_fallbacks_total{layer=0,reason=shape}"], DebugValue::Counter(1));
        assert_eq!(snap["moe_lanes_fallbacks_total{layer=0,reason=worklist}"], DebugValue::Counter(0));
        assert_eq!(snap["moe_lanes_cache_exchanges_total{}"], DebugValue::Counter(1));
        assert_eq!(snap["moe_lanes_cache_bytes_copied_total{}"], DebugValue::Counter(4096));
        assert_eq!(snap["moe_lanes_cache_exchanges_refused_total{}"], DebugValue::Counter(1));
        assert_eq!(snap["moe_lanes_cache_admissions_total{layer=1}"], DebugValue::Counter(1));
        assert_eq!(snap["moe_lanes_cache_evictions_total{layer=1}"], DebugValue::Counter(1));
        assert_eq!(snap["moe_lanes_cache_admissions_total{layer=0}"], DebugValue::Counter(0));
        assert_eq!((st.report().layers[1].admissions, st.report().layers[1].evictions), (1, 1));
        assert_eq!(st.report().cache_updates.exchanges_refused, 1);
        // The JSON view holds the same totals.
        let l1 = &st.report().layers[1];
        assert_eq!(
            (l1.hot_slots_total, l1.cold_slots_total, l1.calls, l1.parallel_cold_time_us),
            (2, 2, 2, 70)
        );
        // Off: the hot path records nothing in either view; rare events still count.
        st.set_mode(PerfMode::Off);
        let before = st.report().layers.clone();
        st.record_slot(1, 3, true);
        st.record_layer_call(1, &t, true);
        st.record_exchange(1, 10);
        let snap = take();
        assert_eq!(snap["moe_lanes_perf_mode{mode=off}"], DebugValue::Gauge(1.0.into()));
        assert_eq!(snap["moe_lanes_layer_calls_total{layer=1}"], DebugValue::Counter(0));
        assert_eq!(snap["moe_lanes_layer_hot_slots_total{layer=1}"], DebugValue::Counter(0));
        let DebugValue::Histogram(h) = &snap["moe_lanes_layer_lane_seconds{layer=1,lane=hot}"] else {
            panic!()
        };
        assert!(h.is_empty());
        assert_eq!(snap["moe_lanes_cache_exchanges_total{}"], DebugValue::Counter(1));
        assert_eq!(st.report().layers, before);
        // Detached (a learn pass): the JSON view counts, the exporter hears nothing.
        st.set_mode(PerfMode::Full);
        st.detach_metrics();
        st.record_slot(0, 1, false);
        st.record_layer_call(0, &t, true);
        let snap = take();
        assert_eq!(snap["moe_lanes_layer_calls_total{layer=0}"], DebugValue::Counter(0));
        assert_eq!(st.report().layers[0].calls, 1);
    }

    /// Post-Fetch's handles appear with its first report, its counters move by what each
    /// report (running totals) adds, its known ratios are set; detached, nothing is heard.
    #[test]
    fn postfetch_records_through_the_facade() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};

        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let take = || snapshot_map(&snapshotter);
        let mut st = metrics::with_local_recorder(&recorder, || PerfState::new(PerfMode::Full, 1, 4, 2));
        assert!(!take().keys().any(|k| k.contains("postfetch")), "nothing before a report");
        let reasons = |n: u64| [("not_ready".to_string(), n), ("scratch_full".to_string(), 0)].into();
        let report = |fetched: u64, fallbacks: u64, overlap: Option<f64>| PostFetchPerf {
            experts_chosen: fetched + fallbacks,
            experts_fetched: fetched,
            bytes_copied: 100 * fetched,
            fallbacks,
            fallback_reasons: reasons(fallbacks),
            transfer_overlap: overlap,
            scratch_bytes: 1000,
            ..Default::default()
        };
        metrics::with_local_recorder(&recorder, || st.set_postfetch(report(3, 1, Some(0.5))));
        let snap = take();
        assert_eq!(snap["moe_lanes_postfetch_experts_fetched_total{}"], DebugValue::Counter(3));
        assert_eq!(snap["moe_lanes_postfetch_bytes_copied_total{}"], DebugValue::Counter(300));
        assert_eq!(snap["moe_lanes_postfetch_fallbacks_total{reason=not_ready}"], DebugValue::Counter(1));
        assert_eq!(snap["moe_lanes_postfetch_transfer_overlap_ratio{}"], DebugValue::Gauge(0.5.into()));
        assert_eq!(snap["moe_lanes_postfetch_scratch_bytes{}"], DebugValue::Gauge(1000.0.into()));
        // The next report's totals: the counters move by the difference (the handles stay).
        st.set_postfetch(report(5, 1, None));
        let snap = take();
        assert_eq!(snap["moe_lanes_postfetch_experts_fetched_total{}"], DebugValue::Counter(2));
        assert_eq!(snap["moe_lanes_postfetch_experts_chosen_total{}"], DebugValue::Counter(2));
        assert_eq!(snap["moe_lanes_postfetch_fallbacks_total{reason=not_ready}"], DebugValue::Counter(0));
        assert_eq!(st.report().postfetch.as_ref().map(|p| p.experts_fetched), Some(5));
        // A detached state registers its Post-Fetch handles nowhere.
        let mut learn = metrics::with_local_recorder(&recorder, || PerfState::new(PerfMode::Full, 1, 4, 2));
        learn.detach_metrics();
        take();
        metrics::with_local_recorder(&recorder, || learn.set_postfetch(report(7, 0, None)));
        assert_eq!(take()["moe_lanes_postfetch_experts_fetched_total{}"], DebugValue::Counter(0));
    }

    /// A call marked as ping-pong is counted in its phase and its layers' lane times are left out
    /// of the lane-cost fit (two micro-batches' interleaved); the next call is fitted again.
    #[test]
    fn ping_pong_calls_are_counted_and_left_out_of_the_lane_cost_fit() {
        let mut st = PerfState::new(PerfMode::Full, 1, 4, 2);
        let split = LayerTiming { cold_us: 50, wall_us: 80, split: true, ..Default::default() };
        let layer_call = |st: &mut PerfState| {
            st.record_slot(0, 1, false);
            st.record_slot(0, 2, false);
            st.record_layer_call(0, &split, true);
        };
        let before = st.lane_snapshot();
        layer_call(&mut st);
        st.mark_ping_pong();
        st.record_call("decode", 2, 100, &before);
        let decode = st.report().phases["decode"];
        assert_eq!((decode.calls, decode.ping_pong_calls, decode.lane_cost.calls_cold), (1, 1, 0));
        let before = st.lane_snapshot();
        layer_call(&mut st);
        st.record_call("decode", 2, 100, &before);
        let decode = st.report().phases["decode"];
        assert_eq!((decode.calls, decode.ping_pong_calls, decode.lane_cost.calls_cold), (2, 1, 1));
        assert!(st.to_json().contains("\"ping_pong_calls\": 1"), "{}", st.to_json());
    }

    #[test]
    fn off_records_nothing() {
        let mut st = PerfState::new(PerfMode::Off, 1, 2, 1);
        st.record_slot(0, 1, true);
        st.record_fallback(0, FallbackReason::Shape, "a test's");
        assert_eq!(st.report().layers[0].expert_hits_total, 0);
        assert_eq!(st.fallbacks(FallbackReason::Shape), 1);
    }
}
