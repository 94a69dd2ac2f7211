//! The end-to-end benchmark behind `moe-lanes bench`: choose a hot set (from a learn file's
//! counts, or a short learn pass of its own), plan it into a VRAM budget, then time prompt
//! processing (PP) and token generation (TG) separately over several runs, with the lane
//! statistics (hit rate, overlap, join wait, fallbacks) of the same runs.

use crate::cache::planner::{plan_fraction, plan_hot_set, WeightMode};
use crate::gpu::{
    CudaBackend, ForwardStats, GpuError, GpuKvCache, GpuModel, HotAssignment, PoolColdError, PoolColdExperts,
};
use crate::inspect::sample_tokens;
use crate::model::Model;
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;

/// VRAM kept free by the automatic budget for warm-up and transient buffers (DESIGN.md).
pub const AUTO_BUDGET_RESERVE_BYTES: u64 = 1024 << 20;

/// How much of the experts goes into the hot cache.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HotBudget {
    /// Exactly this many bytes (planned with exact expert sizes).
    Bytes(u64),
    /// Free VRAM after weights and KV cache, minus [`AUTO_BUDGET_RESERVE_BYTES`].
    Auto,
    /// This fraction of each layer's experts (the most used ones).
    Fraction(f64),
}

#[derive(Debug, Clone)]
pub struct BenchOptions {
    pub budget: HotBudget,
    /// Per-layer expert counts from a learn file; `None` runs a learn pass first.
    pub learn_counts: Option<Vec<Vec<u64>>>,
    pub n_prompt_tokens: usize,
    pub n_gen_tokens: usize,
    pub n_runs: usize,
    pub cold_threads: usize,
    /// Tokens the built-in learn pass routes (prompt processing of sampled tokens).
    pub learn_tokens: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("no GPU: {0}")]
    NoGpu(String),
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error(transparent)]
    Cold(#[from] PoolColdError),
    #[error(transparent)]
    Plan(#[from] crate::cache::planner::PlanError),
    #[error("{0}")]
    Invalid(String),
}

/// Median and spread of one measured quantity.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(values: &[f64]) -> Spread {
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let median = if v.is_empty() {
            0.0
        } else if v.len() % 2 == 1 {
            v[v.len() / 2]
        } else {
            0.5 * (v[v.len() / 2 - 1] + v[v.len() / 2])
        };
        Spread { median, min: v.first().copied().unwrap_or(0.0), max: v.last().copied().unwrap_or(0.0) }
    }
}

/// Lane statistics summed over many layer calls.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct LaneTotals {
    pub hot_slots: u64,
    pub cold_slots: u64,
    pub layer_calls: u64,
    pub overlap_us: f64,
    pub join_wait_us: f64,
    pub hot_us: f64,
    pub cold_us: f64,
    pub fallbacks: u64,
}

impl LaneTotals {
    fn add(&mut self, stats: &ForwardStats) {
        for l in &stats.layers {
            self.hot_slots += l.hot_slots as u64;
            self.cold_slots += l.cold_slots as u64;
            self.layer_calls += 1;
            self.overlap_us += l.overlap_us;
            self.join_wait_us += l.join_wait_us;
            self.hot_us += l.hot_us;
            self.cold_us += l.cold_us;
        }
    }

    pub fn hit_rate(&self) -> f64 {
        let total = self.hot_slots + self.cold_slots;
        if total == 0 {
            0.0
        } else {
            self.hot_slots as f64 / total as f64
        }
    }

    fn per_call(&self, total_us: f64) -> f64 {
        if self.layer_calls == 0 {
            0.0
        } else {
            total_us / self.layer_calls as f64
        }
    }
}

/// What `bench --json` prints.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub device: String,
    pub model: String,
    pub n_prompt_tokens: usize,
    pub n_gen_tokens: usize,
    pub n_runs: usize,
    pub pp_tokens_per_s: f64,
    pub tg_tokens_per_s: f64,
    pub pp_tokens_per_s_spread: Spread,
    pub tg_tokens_per_s_spread: Spread,
    /// Share of routed slots served by the hot lane during generation.
    pub hit_rate: f64,
    pub pp_hit_rate: f64,
    /// Mean per layer call during generation.
    pub overlap_us: f64,
    pub join_wait_us: f64,
    pub hot_lane_us: f64,
    pub cold_lane_us: f64,
    pub fallbacks: u64,
    pub hot_bytes: u64,
    pub hot_experts: usize,
    pub all_experts_bytes: u64,
    pub budget: HotBudget,
    /// Hit rate the plan predicts from the learn counts.
    pub planned_hit_rate: f64,
    pub learn_source: &'static str,
    pub cold_threads: usize,
    pub simd: String,
}

/// Run the benchmark on the GPU. `progress(done, total)` ticks once per phase of each run.
pub fn run_bench(
    model: &Model,
    opts: &BenchOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<BenchReport, BenchError> {
    if opts.n_prompt_tokens == 0 || opts.n_gen_tokens == 0 || opts.n_runs == 0 {
        return Err(BenchError::Invalid(
            "prompt tokens, generated tokens and runs must all be at least 1".into(),
        ));
    }
    let c = model.config().clone();
    let context = opts.n_prompt_tokens + opts.n_gen_tokens;
    if context > c.max_positions {
        return Err(BenchError::Invalid(format!(
            "{context} positions exceed the model's {}",
            c.max_positions
        )));
    }
    let backend = Arc::new(CudaBackend::try_new().map_err(|e| BenchError::NoGpu(e.to_string()))?);
    let device = format!("{} ({})", backend.info().name, backend.info().arch());
    let mut cold = PoolColdExperts::new(model, opts.cold_threads)?;
    let (counts, learn_source) = match &opts.learn_counts {
        Some(counts) => (counts.clone(), "learn file"),
        None => (
            learn_pass(model, &backend, &mut cold, opts.learn_tokens.min(c.max_positions))?,
            "built-in learn pass",
        ),
    };
    let expert_bytes = model.expert_bytes() as u64;
    let hot = match opts.budget {
        HotBudget::Fraction(f) => plan_fraction(Some(&counts), c.n_layers, c.n_experts, f),
        HotBudget::Bytes(bytes) => {
            plan_hot_set(&counts, c.n_layers, c.n_experts, expert_bytes, bytes, WeightMode::Flat)?.layers
        }
        HotBudget::Auto => {
            let budget = auto_budget_bytes(model, &backend, context);
            plan_hot_set(&counts, c.n_layers, c.n_experts, expert_bytes, budget, WeightMode::Flat)?.layers
        }
    };
    let planned = crate::cache::planner::HotPlan { layers: hot.clone(), expert_bytes, budget_bytes: 0 };
    let mut gpu = GpuModel::new(model, backend, &HotAssignment { per_layer: hot })?;
    let mut cache = gpu.new_kv_cache(context)?;
    gpu.set_copy_logits(false); // the bench only needs the greedy tokens
    let prompt = sample_tokens(c.vocab, opts.n_prompt_tokens);
    // Warm-up: first cuBLAS calls, page-ins of cold experts, pool threads.
    run_once(&mut gpu, &mut cache, &mut cold, &prompt[..prompt.len().min(32)], 4)?;
    gpu.reset_profile();
    let total_ticks = 2 * opts.n_runs as u64;
    let (mut pp_rates, mut tg_rates) = (Vec::new(), Vec::new());
    let (mut pp_lanes, mut tg_lanes) = (LaneTotals::default(), LaneTotals::default());
    for run_idx in 0..opts.n_runs {
        cache.clear();
        let start = Instant::now();
        let logits = gpu.forward(&prompt, &mut cache, &mut cold)?;
        pp_rates.push(prompt.len() as f64 / start.elapsed().as_secs_f64());
        pp_lanes.add(gpu.last_stats());
        progress(2 * run_idx as u64 + 1, total_ticks);
        let mut next = *logits.argmax.last().expect("one row per prompt token");
        let start = Instant::now();
        for _ in 0..opts.n_gen_tokens {
            next = gpu.forward(&[next], &mut cache, &mut cold)?.argmax[0];
            tg_lanes.add(gpu.last_stats());
        }
        tg_rates.push(opts.n_gen_tokens as f64 / start.elapsed().as_secs_f64());
        progress(2 * run_idx as u64 + 2, total_ticks);
    }
    if let Some(report) = gpu.profile_report() {
        eprintln!("== GPU stage profile (MOE_LANES_GPU_PROFILE, timed runs, warm-up excluded) ==\n{report}");
    }
    let (pp, tg) = (Spread::of(&pp_rates), Spread::of(&tg_rates));
    Ok(BenchReport {
        device,
        model: model.path().display().to_string(),
        n_prompt_tokens: opts.n_prompt_tokens,
        n_gen_tokens: opts.n_gen_tokens,
        n_runs: opts.n_runs,
        pp_tokens_per_s: pp.median,
        tg_tokens_per_s: tg.median,
        pp_tokens_per_s_spread: pp,
        tg_tokens_per_s_spread: tg,
        hit_rate: tg_lanes.hit_rate(),
        pp_hit_rate: pp_lanes.hit_rate(),
        overlap_us: tg_lanes.per_call(tg_lanes.overlap_us),
        join_wait_us: tg_lanes.per_call(tg_lanes.join_wait_us),
        hot_lane_us: tg_lanes.per_call(tg_lanes.hot_us),
        cold_lane_us: tg_lanes.per_call(tg_lanes.cold_us),
        fallbacks: pp_lanes.fallbacks + tg_lanes.fallbacks,
        hot_bytes: gpu.hot_cache_bytes() as u64,
        hot_experts: planned.n_slots(),
        all_experts_bytes: expert_bytes * (c.n_layers * c.n_experts) as u64,
        budget: opts.budget,
        planned_hit_rate: planned.expected_hit_rate(&counts),
        learn_source,
        cold_threads: cold.n_threads(),
        simd: cold.simd_level().name().to_string(),
    })
}

/// Prefill `prompt`, then decode `n_gen` tokens greedily.
fn run_once(
    gpu: &mut GpuModel,
    cache: &mut GpuKvCache,
    cold: &mut PoolColdExperts<'_>,
    prompt: &[u32],
    n_gen: usize,
) -> Result<(), GpuError> {
    cache.clear();
    let mut next = *gpu.forward(prompt, cache, cold)?.argmax.last().expect("rows");
    for _ in 0..n_gen {
        next = gpu.forward(&[next], cache, cold)?.argmax[0];
    }
    Ok(())
}

/// All experts cold: every routed slot reaches the cold lane, which counts them per expert.
fn learn_pass(
    model: &Model,
    backend: &Arc<CudaBackend>,
    cold: &mut PoolColdExperts<'_>,
    n_tokens: usize,
) -> Result<Vec<Vec<u64>>, BenchError> {
    let c = model.config();
    let mut gpu = GpuModel::new(model, backend.clone(), &HotAssignment::none(c.n_layers))?;
    let mut cache = gpu.new_kv_cache(n_tokens.max(1))?;
    cold.expert_counts.iter_mut().for_each(|l| l.fill(0));
    // A different token stream from the timed prompt, so the plan is not fitted to it.
    let tokens: Vec<u32> = sample_tokens(c.vocab, n_tokens + 1013).split_off(1013);
    gpu.forward(&tokens, &mut cache, cold)?;
    Ok(cold.expert_counts.clone())
}

/// Free VRAM for the hot cache: total minus non-expert weights, KV cache and the reserve.
fn auto_budget_bytes(model: &Model, backend: &CudaBackend, context: usize) -> u64 {
    let c = model.config();
    let report = crate::inspect::InspectReport::new(model);
    let kv_bytes = (2 * c.n_layers * context * c.kv_dim() * std::mem::size_of::<f32>()) as u64;
    (backend.info().total_mem_bytes as u64)
        .saturating_sub(report.other_bytes + kv_bytes + AUTO_BUDGET_RESERVE_BYTES)
}

impl BenchReport {
    pub fn to_text(&self) -> String {
        format!(
            "device        {}\nmodel         {}\nhot cache     {} experts, {:.1} MiB of {:.1} MiB ({:?}, planned hit rate {:.1}% from {})\n\
             pp{:<4}        {:.1} t/s (min {:.1}, max {:.1}; hit rate {:.1}%)\n\
             tg{:<4}        {:.1} t/s (min {:.1}, max {:.1}; hit rate {:.1}%)\n\
             per layer     hot {:.1} us, cold {:.1} us, overlap {:.1} us, join wait {:.1} us, fallbacks {}\n\
             cold lane     {} threads, {}\n",
            self.device,
            self.model,
            self.hot_experts,
            self.hot_bytes as f64 / (1 << 20) as f64,
            self.all_experts_bytes as f64 / (1 << 20) as f64,
            self.budget,
            self.planned_hit_rate * 100.0,
            self.learn_source,
            self.n_prompt_tokens,
            self.pp_tokens_per_s,
            self.pp_tokens_per_s_spread.min,
            self.pp_tokens_per_s_spread.max,
            self.pp_hit_rate * 100.0,
            self.n_gen_tokens,
            self.tg_tokens_per_s,
            self.tg_tokens_per_s_spread.min,
            self.tg_tokens_per_s_spread.max,
            self.hit_rate * 100.0,
            self.hot_lane_us,
            self.cold_lane_us,
            self.overlap_us,
            self.join_wait_us,
            self.fallbacks,
            self.cold_threads,
            self.simd,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_takes_median_and_extremes() {
        assert_eq!(Spread::of(&[3.0, 1.0, 2.0]), Spread { median: 2.0, min: 1.0, max: 3.0 });
        assert_eq!(Spread::of(&[4.0, 1.0]).median, 2.5);
    }
}
