//! From typed options to an engine: choose the engine (GPU when usable, else the pipeline, and
//! say why), resolve the hot cache (explicit set, fraction, or a byte budget planned by the
//! library planner from learn counts or a built-in learn pass), and check the budget before
//! anything is allocated.

use super::cpu::ReferenceEngine;
use super::gpu::GpuEngine;
use super::gpu_devices::{
    check_split_budget, device_auto_budgets, device_parts, open_devices, plan_per_device, split_budget,
};
use super::{Engine, EngineError, EngineKind};
use crate::cache::hot_set::HotSet;
use crate::cache::observe::Observations;
use crate::cache::perf::ModelFingerprint;
use crate::cache::perf::PerfMode;
use crate::cache::planner::{plan_fraction, HotPlan};
use crate::cache::update::UpdatePolicy;
use crate::cache::weighting::Weighting;
use crate::gpu::{CudaBackend, GpuError, GpuKvCache, GpuModel, GpuOptions, PrefillActivations};
use crate::inspect::{sample_tokens, InspectReport};
use crate::model::context::{session_bytes, KvType};
use crate::model::Model;
use crate::moe::phase::Phase;
use crate::moe::pipeline::{Pipeline, PipelineOptions, MAX_BATCH_TOKENS};
use crate::moe::pool_lane::PoolColdLane;
use crate::reference::Reference;
use crate::threads::{ColdThreads, ThreadInputs, ThreadReport};
use moe_lanes_kernels::cuda::CudaConfig;
use moe_lanes_kernels::pool::ColdSchedule;
use moe_lanes_kernels::{DecodeActivations, SimdLevel};
use serde::Serialize;
use std::ops::Range;
use std::sync::Arc;

/// VRAM kept free by the automatic budget for warm-up and transient buffers (DESIGN.md).
pub const AUTO_BUDGET_RESERVE_BYTES: u64 = 1024 << 20;

/// Tokens skipped in the sampled stream before the learn pass's tokens, so a plan is not fitted
/// to the benchmark's own prompt (which starts at the stream's beginning).
const LEARN_STREAM_OFFSET: usize = 1013;

/// How much of the experts goes into the hot cache.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HotBudget {
    /// Exactly this many bytes (planned with exact expert sizes).
    Bytes(u64),
    /// Free VRAM after weights, KV cache and scratch, minus [`AUTO_BUDGET_RESERVE_BYTES`].
    Auto,
    /// This fraction of each layer's experts (the most used ones, ranked by the learn file or
    /// the built-in learn pass).
    Fraction(f64),
}

impl std::fmt::Display for HotBudget {
    /// In words, for reports: `budget 512.0 MiB`, `budget auto (free VRAM)`, `50% of each layer's
    /// experts`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HotBudget::Bytes(b) => write!(f, "budget {:.1} MiB", *b as f64 / MIB as f64),
            HotBudget::Auto => write!(f, "budget auto (free VRAM)"),
            // Rounded to 0.01%: 0.333 is "33.3%", not "33.300000000000004%".
            HotBudget::Fraction(x) => write!(f, "{}% of each layer's experts", (x * 10000.0).round() / 100.0),
        }
    }
}

/// Which experts start hot.
#[derive(Debug, Clone)]
pub enum HotChoice {
    None,
    Set(HotSet),
    Budget(HotBudget),
}

#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// `None`: the GPU when one is usable, else the pipeline.
    pub kind: Option<EngineKind>,
    pub hot: HotChoice,
    /// Typed observations of a learn file (`cache::observe`); `None` runs a learn pass when a
    /// budget needs it.
    pub learn: Option<Observations>,
    pub learn_tokens: usize,
    /// How the planner ranks experts (mode and layer curve).
    pub weighting: Weighting,
    /// The online updater (`--update`, `--update-rate`); callers drive it with
    /// [`crate::engine::LiveCache`].
    pub update: UpdatePolicy,
    /// Cold-lane threads: a number, or `auto` (the default): the rule of
    /// [`crate::threads::auto_cold_threads`] for the engine's lanes.
    pub cold_threads: ColdThreads,
    /// Positions the caller's sessions need (sizes the KV cache the auto budget leaves room for).
    pub n_positions: usize,
    /// Sessions that run at once (a batching server's `--parallel`): the auto budget and the
    /// budget check leave room for the KV cache of `n_positions` for each.
    pub sequences: usize,
    pub perf_mode: PerfMode,
    pub gpu: GpuOptions,
    /// Which device, and where NVRTC keeps its cubins.
    pub cuda: CudaConfig,
    /// A forced SIMD level for the cold lane (`None`: the best exact one for this CPU).
    pub simd: Option<SimdLevel>,
    /// Activations of the cold pool's few-token decode tiles of quantised experts (`None`: Auto
    /// where the level has AVX-512 VNNI, else F32; [`DecodeActivations::resolve`]).
    pub activations: Option<DecodeActivations>,
    /// The GPU engine's cold-pool schedule (changes speed, never results).
    pub cold_schedule: ColdSchedule,
    /// Simulate a smaller GPU: never plan past this many bytes of device memory in use.
    pub vram_limit_bytes: Option<u64>,
    /// Pipeline settings (its hot set comes from `hot`).
    pub pipeline: PipelineOptions,
    /// The KV cache's element type asked for (`--cache-type-k/v`); `None`: the engine's own
    /// (`gpu.kv_type` on the GPU, `pipeline.kv_type` on the pipeline; the reference oracle
    /// keeps f32 and refuses any other).
    pub kv_type: Option<KvType>,
}

impl EngineOptions {
    /// The defaults for sessions of up to `context_length` positions (prompt plus generated
    /// tokens; it sizes the KV cache that the automatic hot-cache budget leaves room for): the
    /// GPU when usable, else the pipeline; no hot cache; `auto` cold threads; full perf state.
    /// `EngineOptions::with_context(4096)` reads as what it is; [`EngineOptions::new`] is the
    /// same call.
    pub fn with_context(context_length: usize) -> EngineOptions {
        EngineOptions::new(context_length)
    }

    /// The same as [`EngineOptions::with_context`]: `n_positions` is the context length the
    /// caller's sessions need (prompt plus generated tokens), not a token count to generate.
    pub fn new(n_positions: usize) -> EngineOptions {
        EngineOptions {
            kind: None,
            hot: HotChoice::None,
            learn: None,
            learn_tokens: 256,
            weighting: Weighting::default(),
            update: UpdatePolicy::default(),
            cold_threads: ColdThreads::Auto,
            n_positions,
            sequences: 1,
            perf_mode: PerfMode::Full,
            gpu: GpuOptions::default(),
            cuda: CudaConfig::default(),
            simd: None,
            activations: None,
            cold_schedule: ColdSchedule::Auto,
            vram_limit_bytes: None,
            pipeline: PipelineOptions::default(),
            kv_type: None,
        }
    }

    /// The GPU engine's KV cache type: the one asked for, else `gpu.kv_type`.
    pub fn gpu_kv_type(&self) -> KvType {
        self.kv_type.unwrap_or(self.gpu.kv_type)
    }

    /// The CPU pipeline's KV cache type: the one asked for, else `pipeline.kv_type`.
    pub fn pipeline_kv_type(&self) -> KvType {
        self.kv_type.unwrap_or(self.pipeline.kv_type)
    }
}

/// What was built, and why.
#[derive(Debug, Clone, Serialize)]
pub struct BuildReport {
    pub kind: EngineKind,
    /// Why the GPU engine was not used, when it was wanted or the default.
    pub gpu_unavailable: Option<String>,
    pub hot_source: &'static str,
    pub n_hot_experts: usize,
    /// Threads of the cold lane.
    pub cold_threads: usize,
    /// The engine's threads and how they were chosen (also in the perf JSON).
    pub threads: ThreadReport,
    /// What the cold lane's few-token tiles of quantised experts run with (Q8 / Auto: 8-bit
    /// activations on AVX-512 VNNI; F32 on other levels, the plain kernels and the reference).
    pub activations: DecodeActivations,
    /// The budget planned for, in bytes (after `auto` was resolved).
    pub budget_bytes: Option<u64>,
    pub planned_hit_rate: Option<f64>,
    pub learn_counts: Option<Vec<Vec<u64>>>,
}

/// A budget that cannot be met, refused before anything is allocated.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum BudgetError {
    #[error("hot budget of {budget_mib} MiB exceeds the {available_mib} MiB left on the device ({device_mib} MiB) after the weights (~{weights_mib} MiB) and the KV cache ({kv_mib} MiB)")]
    TooLarge { budget_mib: u64, available_mib: u64, device_mib: u64, weights_mib: u64, kv_mib: u64 },
}

pub(super) const MIB: u64 = 1 << 20;

pub fn build_engine<'m>(
    model: &'m Arc<Model>,
    opts: EngineOptions,
) -> Result<(Box<dyn Engine + 'm>, BuildReport), EngineError> {
    let mut gpu_unavailable = None;
    if matches!(opts.kind, None | Some(EngineKind::Gpu)) {
        match open_devices(&opts) {
            Ok(bes) => match build_gpu(model, &opts, bes) {
                Ok((mut engine, report)) => {
                    engine.set_thread_report(report.threads);
                    return Ok((Box::new(engine), report));
                }
                // A layer kind the GPU engine does not run: the default engine is the pipeline.
                Err(EngineError::Gpu(
                    e @ (GpuError::Mixer { .. }
                    | GpuError::Ffn { .. }
                    | GpuError::Activation { .. }
                    | GpuError::WideHeads { .. }
                    | GpuError::AttentionKind { .. }),
                )) if opts.kind.is_none() => gpu_unavailable = Some(e.to_string()),
                Err(e) => return Err(e),
            },
            // A device list that names no usable device is the caller's mistake, not a reason to
            // fall back.
            Err(e @ GpuError::Split(_)) => return Err(e.into()),
            // Asked for by name, the GPU engine is not replaced by another: the caller said which.
            Err(e) if opts.kind == Some(EngineKind::Gpu) => {
                return Err(EngineError::NoGpu { reason: e.to_string() })
            }
            Err(e) => gpu_unavailable = Some(e.to_string()),
        }
    }
    if opts.kind == Some(EngineKind::Reference) {
        // The oracle keeps f32: another type asked for is refused, not ignored.
        if let Some(asked) = opts.kv_type.filter(|t| *t != KvType::F32) {
            return Err(EngineError::KvType { engine: EngineKind::Reference, asked });
        }
        let engine = ReferenceEngine::new(Reference::new(model)?, model.config().clone());
        let report = BuildReport {
            kind: EngineKind::Reference,
            gpu_unavailable: None,
            hot_source: "none (oracle)",
            n_hot_experts: 0,
            cold_threads: 0,
            threads: ThreadReport::default(),
            activations: DecodeActivations::F32,
            budget_bytes: None,
            planned_hit_rate: None,
            learn_counts: None,
        };
        return Ok((Box::new(engine), report));
    }
    let (mut engine, mut report) = build_pipeline(model, &opts)?;
    report.gpu_unavailable = gpu_unavailable;
    engine.set_thread_report(report.threads);
    Ok((Box::new(engine), report))
}

/// Every expert slot of the learn pass's routing, counted per layer and expert.
type Counts = Vec<Vec<u64>>;

/// Resolve the hot choice into per-layer expert lists. `learn` runs a learn pass when counts
/// are needed and none were given; `auto_bytes` is the automatic budget.
/// What a backend provides to resolve a budget: a learn pass, the layers of each device (one
/// range but for a model split over GPUs) and each device's automatic budget.
trait BudgetSource {
    fn learn(&mut self) -> Result<Counts, EngineError>;
    fn device_layers(&self) -> Vec<Range<usize>>;
    fn auto_bytes(&mut self) -> Result<Vec<u64>, EngineError>;
}

/// Layers without experts (dense FFN layers) hold no hot experts, whatever a plan or a
/// fraction gave them.
fn without_dense_layers(model: &Model, mut lists: Vec<Vec<usize>>) -> Vec<Vec<usize>> {
    for (list, has) in lists.iter_mut().zip(model.plan().expert_layers()) {
        if !has {
            list.clear();
        }
    }
    lists
}

fn resolve_hot(
    model: &Model,
    opts: &EngineOptions,
    src: &mut dyn BudgetSource,
) -> Result<(Vec<Vec<usize>>, Plan), EngineError> {
    let c = model.config();
    let (n_layers, n_experts) = (c.n_layers, c.n_experts);
    let learn_counts = opts.learn.as_ref().map(Observations::counts);
    let given = |source| Plan { source, counts: learn_counts.clone(), budget_bytes: None };
    match &opts.hot {
        HotChoice::None => Ok((vec![Vec::new(); n_layers], given("none"))),
        HotChoice::Set(set) => Ok((hot_lists(set), given("explicit hot set"))),
        HotChoice::Budget(HotBudget::Fraction(f)) => {
            // Without a learn file the built-in learn pass ranks the experts, as for a byte budget.
            let (counts, source) = match learn_counts {
                Some(c) => (c, "learn file"),
                None => (src.learn()?, "built-in learn pass"),
            };
            let lists = plan_fraction(Some(&counts), n_layers, n_experts, *f);
            Ok((lists, Plan { source, counts: Some(counts), budget_bytes: None }))
        }
        HotChoice::Budget(budget) => {
            let (obs, source) = match &opts.learn {
                Some(o) => (o.clone(), "learn file"),
                None => (Observations::from_counts(&src.learn()?, c.n_experts_used), "built-in learn pass"),
            };
            let ranges = src.device_layers();
            let budgets = match budget {
                HotBudget::Bytes(b) => split_budget(*b, &ranges, &model.layer_expert_bytes()),
                _ => src.auto_bytes()?,
            };
            let layers = plan_per_device(model, &obs, &opts.weighting, &ranges, &budgets)?;
            let bytes = budgets.iter().sum();
            Ok((layers, Plan { source, counts: Some(obs.counts()), budget_bytes: Some(bytes) }))
        }
    }
}

struct Plan {
    source: &'static str,
    counts: Option<Counts>,
    budget_bytes: Option<u64>,
}

fn hot_lists(set: &HotSet) -> Vec<Vec<usize>> {
    set.layers.iter().map(|l| (0..set.n_experts).filter(|&e| l.is_hot(e)).collect()).collect()
}

fn report(
    kind: EngineKind,
    lists: &[Vec<usize>],
    plan: Plan,
    model: &Model,
    (threads, activations): (ThreadReport, DecodeActivations),
) -> BuildReport {
    let hot =
        HotPlan { layers: lists.to_vec(), layer_expert_bytes: model.layer_expert_bytes(), budget_bytes: 0 };
    BuildReport {
        kind,
        gpu_unavailable: None,
        hot_source: plan.source,
        n_hot_experts: hot.n_slots(),
        cold_threads: threads.cold,
        threads,
        activations,
        budget_bytes: plan.budget_bytes,
        // No routed slots counted (no learn counts, or an empty pass): unknown, not 0%.
        planned_hit_rate: plan
            .counts
            .as_ref()
            .filter(|c| c.iter().flatten().any(|&n| n > 0))
            .map(|c| hot.expected_hit_rate(c)),
        learn_counts: plan.counts,
    }
}

fn build_pipeline(model: &Arc<Model>, opts: &EngineOptions) -> Result<(Pipeline, BuildReport), EngineError> {
    let c = model.config();
    populate(model);
    // The learn pass runs with the cache off (no busy hot lane); the engine with its hot set.
    let inputs = |busy_cpu_hot_lanes| ThreadInputs {
        driver_in_pool: opts.pipeline.driver_cold,
        busy_cpu_hot_lanes,
        ..ThreadInputs::this_machine()
    };
    let n_cold_workers = opts.cold_threads.resolve(&inputs(0));
    let base = PipelineOptions {
        perf_mode: opts.perf_mode,
        n_cold_workers,
        simd: opts.simd,
        activations: opts.activations,
        kv_type: opts.pipeline_kv_type(),
        ..opts.pipeline.clone()
    };
    let mut src = CpuSource { model, opts, base: &base };
    let (lists, plan) = resolve_hot(model, opts, &mut src)?;
    let lists = without_dense_layers(model, lists);
    let set = HotSet::from_lists(c.n_layers, c.n_experts, base.n_hot_lanes, &lists);
    let busy = (0..set.n_lanes).filter(|&lane| set.layers.iter().any(|l| !l.slots[lane].is_empty())).count();
    let n_cold_workers = opts.cold_threads.resolve(&inputs(busy));
    let popts = PipelineOptions { hot_set: Some(set), n_cold_workers, ..base };
    let mut pipeline = Pipeline::new(model.clone(), popts)?;
    pipeline.perf_mut().set_model(ModelFingerprint::of(model));
    let threads = ThreadReport {
        cold: pipeline.cold_threads(),
        dense: pipeline.dense_threads(),
        chosen_by: opts.cold_threads.into(),
    };
    let report = report(EngineKind::Pipeline, &lists, plan, model, (threads, pipeline.cold_activations()));
    Ok((pipeline, report))
}

struct CpuSource<'a> {
    model: &'a Arc<Model>,
    opts: &'a EngineOptions,
    base: &'a PipelineOptions,
}

impl BudgetSource for CpuSource<'_> {
    fn learn(&mut self) -> Result<Counts, EngineError> {
        let c = self.model.config();
        let popts = PipelineOptions { hot_set: None, perf_mode: PerfMode::Full, ..self.base.clone() };
        let mut p = Pipeline::new(self.model.clone(), popts)?;
        p.perf_mut().detach_metrics(); // the learn pass is not served traffic
        let tokens = learn_tokens(c.vocab, self.opts.learn_tokens.min(c.max_positions).max(1));
        let mut cache = p.new_cache();
        p.forward(&mut cache, &tokens, Phase::Prefill)?;
        Ok(p.perf().report().layers.iter().map(|l| l.experts.clone()).collect())
    }
    fn device_layers(&self) -> Vec<Range<usize>> {
        std::iter::once(0..self.model.config().n_layers).collect()
    }
    /// No VRAM on the CPU: the automatic budget is empty.
    fn auto_bytes(&mut self) -> Result<Vec<u64>, EngineError> {
        Ok(vec![0])
    }
}

struct GpuSource<'a> {
    gm: &'a mut GpuModel,
    cold: &'a mut PoolColdLane,
    opts: &'a EngineOptions,
    n_positions: usize,
}

impl BudgetSource for GpuSource<'_> {
    fn learn(&mut self) -> Result<Counts, EngineError> {
        let c = self.gm.config().clone();
        let n = self.opts.learn_tokens.clamp(1, c.max_positions);
        let mut kv = self.gm.new_kv_cache(n)?;
        self.cold.lane.expert_counts.iter_mut().for_each(|l| l.fill(0));
        self.gm.perf_mut().detach_metrics(); // the learn pass is not served traffic
                                             // the counts are the cold lane's: every routed slot must reach it
        self.gm.pause_postfetch(true);
        let learned = self.gm.forward(&learn_tokens(c.vocab, n), Phase::Prefill, &mut kv, self.cold);
        self.gm.pause_postfetch(false);
        learned?;
        self.gm.reset_perf();
        Ok(self.cold.lane.expert_counts.clone())
    }
    fn device_layers(&self) -> Vec<Range<usize>> {
        self.gm.device_layers()
    }
    /// Measured with one session's KV cache allocated (then freed for the session to take),
    /// less the KV caches of the other sessions that run at once; per device, each device's
    /// free memory (a GPU named twice shares its own among its entries). The probe is committed
    /// whole: a paged cache counts as the full cache it may grow into.
    fn auto_bytes(&mut self) -> Result<Vec<u64>, EngineError> {
        let mut probe: GpuKvCache = self.gm.new_kv_cache(self.n_positions)?;
        self.gm.commit_kv_cache(&mut probe, self.n_positions)?;
        let mem = self.gm.backends().map(|be| be.mem_info()).collect::<Result<Vec<_>, _>>();
        drop(probe);
        let mem = mem.map_err(crate::gpu::GpuError::from)?;
        let c = self.gm.config();
        let others = session_bytes(c, self.opts.gpu_kv_type(), self.n_positions)
            * (self.opts.sequences.max(1) - 1) as u64;
        let ordinals: Vec<usize> = self.gm.backends().map(|be| be.info().ordinal).collect();
        let ranges = self.gm.device_layers();
        Ok(device_auto_budgets(&mem, &ordinals, &ranges, self.opts.vram_limit_bytes, others))
    }
}

fn learn_tokens(vocab: usize, n: usize) -> Vec<u32> {
    sample_tokens(vocab, n + LEARN_STREAM_OFFSET).split_off(LEARN_STREAM_OFFSET)
}

fn build_gpu(
    model: &Arc<Model>,
    opts: &EngineOptions,
    bes: Vec<Arc<CudaBackend>>,
) -> Result<(GpuEngine, BuildReport), EngineError> {
    let c = model.config();
    let n_positions = opts.n_positions.clamp(1, c.max_positions);
    let parts = device_parts(model, opts, n_positions, bes)?;
    if let HotChoice::Budget(HotBudget::Bytes(b)) = opts.hot {
        match parts.as_slice() {
            [(be, _)] => {
                let device_bytes = device_limit(be.info().total_mem_bytes as u64, opts.vram_limit_bytes);
                check_budget(model, (n_positions, opts.sequences), opts.gpu_kv_type(), device_bytes, b)?
            }
            _ => check_split_budget(model, opts, n_positions, &parts, b)?,
        }
    }
    // The driver is the pool's thread 0; a GPU lane with hot experts needs cores of its own.
    let gpu_lane = !matches!(opts.hot, HotChoice::None | HotChoice::Budget(HotBudget::Bytes(0)));
    // f32 activations asked for: the prefill GEMMs of quantized weights split them too.
    let f32_asked = opts.activations == Some(DecodeActivations::F32);
    let gpu_opts = GpuOptions {
        q8_activations: opts.gpu.q8_activations && !f32_asked,
        kv_type: opts.gpu_kv_type(),
        prefill_activations: match opts.gpu.prefill_activations {
            PrefillActivations::Auto if f32_asked => PrefillActivations::Split,
            p => p,
        },
        ..opts.gpu.clone()
    };
    let mut gm = GpuModel::on_devices(model.clone(), parts, gpu_opts)?;
    let n_cold = opts.cold_threads.resolve(&ThreadInputs { gpu_lane, ..ThreadInputs::this_machine() });
    let mut cold = PoolColdLane::new(model.clone(), n_cold, opts.simd, opts.cold_schedule)?;
    gm.set_cold_threads(cold.n_threads());
    cold.lane.set_activations(opts.activations);
    gm.reserve_tokens(n_positions.min(MAX_BATCH_TOKENS))?;
    let mut src = GpuSource { gm: &mut gm, cold: &mut cold, opts, n_positions };
    let (lists, plan) = resolve_hot(model, opts, &mut src)?;
    let lists = without_dense_layers(model, lists);
    if lists.iter().any(|l| l.len() < c.n_experts) {
        populate(model); // a cold lane reads experts from RAM
    }
    gm.allocate_hot(&HotSet::from_lists(c.n_layers, c.n_experts, 1, &lists))?;
    gm.perf_mut().set_model(ModelFingerprint::of(model));
    let threads = ThreadReport { cold: cold.n_threads(), dense: 0, chosen_by: opts.cold_threads.into() };
    let report = report(EngineKind::Gpu, &lists, plan, model, (threads, cold.lane.activations()));
    Ok((GpuEngine::new(model.clone(), gm, cold)?, report))
}

/// Fault the model's mappings in before the engine runs ([`Model::populate`]). A failure only
/// leaves the pages to fault on first use, as without it, so the build goes on.
fn populate(model: &Model) {
    let _ = model.populate();
}

pub(super) fn device_limit(total: u64, limit: Option<u64>) -> u64 {
    limit.map_or(total, |l| l.min(total))
}

/// The automatic budget: free device memory (capped by a simulated limit on what may be in
/// use) minus the reserve.
pub fn auto_budget_bytes(free: u64, total: u64, limit: Option<u64>) -> u64 {
    let used = total.saturating_sub(free);
    let available = limit.map_or(free, |l| free.min(l.saturating_sub(used)));
    available.saturating_sub(AUTO_BUDGET_RESERVE_BYTES)
}

/// The automatic budget without building an engine (the what-if planner): the device's memory
/// (or the simulated limit) minus the weights, the KV cache of `n_positions` and the reserve.
/// Needs a usable GPU.
pub fn auto_budget_estimate(
    model: &Model,
    n_positions: usize,
    opts: &EngineOptions,
) -> Result<u64, EngineError> {
    let be =
        CudaBackend::with_config(&opts.cuda).map_err(|e| EngineError::NoGpu { reason: e.to_string() })?;
    let c = model.config();
    let device_bytes = device_limit(be.info().total_mem_bytes as u64, opts.vram_limit_bytes);
    let weights = InspectReport::new(model).other_bytes;
    let kv = session_bytes(c, opts.gpu_kv_type(), n_positions) * opts.sequences.max(1) as u64;
    Ok(device_bytes.saturating_sub(weights + kv + AUTO_BUDGET_RESERVE_BYTES))
}

/// Refuse a byte budget that cannot fit beside the weights and the KV cache.
fn check_budget(
    model: &Model,
    (n_positions, sequences): (usize, usize),
    kv_type: KvType,
    device_bytes: u64,
    budget: u64,
) -> Result<(), BudgetError> {
    let c = model.config();
    let weights = InspectReport::new(model).other_bytes;
    let kv = session_bytes(c, kv_type, n_positions) * sequences.max(1) as u64;
    let available = device_bytes.saturating_sub(weights + kv);
    if budget > available {
        return Err(BudgetError::TooLarge {
            budget_mib: budget.div_ceil(MIB),
            available_mib: available / MIB,
            device_mib: device_bytes / MIB,
            weights_mib: weights.div_ceil(MIB),
            kv_mib: kv.div_ceil(MIB),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_budget_respects_reserve_and_limit() {
        let g = 1u64 << 30;
        assert_eq!(auto_budget_bytes(10 * g, 80 * g, None), 10 * g - AUTO_BUDGET_RESERVE_BYTES);
        // 70 GiB in use, limit 72 GiB: only 2 GiB may be planned, minus the reserve.
        assert_eq!(auto_budget_bytes(10 * g, 80 * g, Some(72 * g)), g);
        // Already over the limit: nothing.
        assert_eq!(auto_budget_bytes(10 * g, 80 * g, Some(60 * g)), 0);
        assert_eq!(device_limit(80 * g, Some(8 * g)), 8 * g);
    }

    #[test]
    fn budgets_read_as_words() {
        assert_eq!(HotBudget::Fraction(0.333).to_string(), "33.3% of each layer's experts");
        assert_eq!(HotBudget::Bytes(3 << 19).to_string(), "budget 1.5 MiB");
        assert_eq!(HotBudget::Auto.to_string(), "budget auto (free VRAM)");
    }
}
