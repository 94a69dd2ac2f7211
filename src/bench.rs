//! The end-to-end benchmark behind `moe-lanes bench`, on any [`Engine`]: time prompt processing
//! (PP) and token generation (TG) separately over several runs, and read the lane statistics of
//! the same runs (hit rate, overlap, join wait, lane times, fallbacks) off the engine's perf
//! state. Generation feeds random token ids by default (as llama-bench does), or the greedy token.
//! Both start at a depth (llama-bench's `-d`): a fresh cache holding that many positions,
//! prefilled untimed; 0 by default, so tg128 decodes positions 0..128 as llama-bench's tg test.

use crate::cache::perf::{ModelFingerprint, PerfMode, PerfReport};
use crate::cache::update::UpdatePolicy;
use crate::engine::{BuildReport, Engine, EngineError, HotBudget, KvCache, LiveCache, UpdateOutcome};
use crate::inspect::sample_tokens;
use crate::model::Model;
use crate::moe::phase::Phase;
use serde::Serialize;
use std::time::Instant;

#[derive(Debug, Clone)]
pub struct BenchOptions {
    pub n_prompt_tokens: usize,
    pub n_gen_tokens: usize,
    pub n_runs: usize,
    /// Positions in the KV cache before each timed pp and tg (llama-bench's `-d`): a fresh
    /// cache prefilled untimed with that many tokens. 0: pp on an empty cache and tg from
    /// position 0, as llama-bench's pp and tg tests (tg no longer continues after the prompt).
    pub depth: usize,
    /// The budget the engine was built with (reported as given).
    pub budget: Option<HotBudget>,
    /// The engine's threads (from its build report).
    pub threads: crate::threads::ThreadReport,
    pub simd: String,
    /// Feed each generated token back (greedy) instead of random token ids. Random ids (the
    /// default, as llama-bench does) keep the routing mix of a real workload; greedy output on
    /// random weights can loop on one token and hit the same experts over and over.
    pub greedy: bool,
    /// Metrics on vs off in one call: every run also times generation with the perf state off
    /// (nothing recorded, in either view), alternating which goes first, so the cost of
    /// recording is measured under the same conditions.
    pub metrics_ab: bool,
    /// Feed a locality workload (`bench --scenario locality:...`, [`crate::locality`]) as the
    /// prompt and the generated-token feed instead of random ids (seeded per run).
    pub locality: Option<crate::locality::LocalityParams>,
    /// The online updater: each timed run is one request, updated after it (and every
    /// `every_tokens` tokens inside it).
    pub update: UpdatePolicy,
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("bench: prompt tokens, generated tokens and runs must all be at least 1")]
    ZeroCount,
    #[error("bench: {positions} positions exceed the model's {max_positions}")]
    TooLong { positions: usize, max_positions: usize },
    #[error("bench: metrics on vs off needs an engine that records (perf state present, mode not off)")]
    NothingRecorded,
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

/// Lane statistics summed over many layer calls: the difference of two perf snapshots.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct LaneTotals {
    pub hot_slots: u64,
    pub cold_slots: u64,
    pub layer_calls: u64,
    pub overlap_us: u64,
    pub join_wait_us: u64,
    pub hot_us: u64,
    pub cold_us: u64,
    pub fallbacks: u64,
}

impl LaneTotals {
    /// What happened between `before` and `after`.
    pub fn between(before: &PerfReport, after: &PerfReport) -> LaneTotals {
        let mut t = LaneTotals::default();
        for (a, b) in before.layers.iter().zip(&after.layers) {
            t.hot_slots += b.hot_slots_total - a.hot_slots_total;
            t.cold_slots += b.cold_slots_total - a.cold_slots_total;
            t.layer_calls += b.calls - a.calls;
            t.overlap_us += b.parallel_overlap_us - a.parallel_overlap_us;
            t.join_wait_us += b.parallel_join_wait_us - a.parallel_join_wait_us;
            t.hot_us += b.parallel_hot_time_us - a.parallel_hot_time_us;
            t.cold_us += b.parallel_cold_time_us - a.parallel_cold_time_us;
            t.fallbacks += b.parallel_fallbacks - a.parallel_fallbacks;
        }
        t
    }

    fn add(&mut self, o: LaneTotals) {
        self.hot_slots += o.hot_slots;
        self.cold_slots += o.cold_slots;
        self.layer_calls += o.layer_calls;
        self.overlap_us += o.overlap_us;
        self.join_wait_us += o.join_wait_us;
        self.hot_us += o.hot_us;
        self.cold_us += o.cold_us;
        self.fallbacks += o.fallbacks;
    }

    pub fn hit_rate(&self) -> f64 {
        let total = self.hot_slots + self.cold_slots;
        if total == 0 {
            0.0
        } else {
            self.hot_slots as f64 / total as f64
        }
    }

    fn per_call(&self, total_us: u64) -> f64 {
        if self.layer_calls == 0 {
            0.0
        } else {
            total_us as f64 / self.layer_calls as f64
        }
    }
}

/// What `bench --json` prints.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub device: String,
    pub engine: String,
    pub model: String,
    pub n_prompt_tokens: usize,
    pub n_gen_tokens: usize,
    pub n_runs: usize,
    /// Positions in the cache before each timed pp and tg (`BenchOptions::depth`).
    pub depth: usize,
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
    /// Layer calls that fell back (timed runs, PP and TG), counted by the engine's perf state.
    pub fallbacks: u64,
    pub hot_bytes: u64,
    pub hot_experts: usize,
    pub all_experts_bytes: u64,
    pub budget: Option<HotBudget>,
    /// Hit rate the plan predicts from the learn counts (`None`: no counts, so unknown).
    pub planned_hit_rate: Option<f64>,
    pub learn_source: &'static str,
    pub cold_threads: usize,
    /// The engine's threads and how the cold count was chosen (`auto` or `fixed`).
    pub threads: crate::threads::ThreadReport,
    pub simd: String,
    /// The cold lane's few-token tiles of quantised experts: `auto` (8-bit activations except
    /// for Q8_0, AVX-512 VNNI), `q8` (8-bit for every quantised type) or `f32` (the engine's
    /// build report; `--activations`, `MOE_LANES_Q8_ACTIVATIONS`).
    pub activations: moe_lanes_kernels::DecodeActivations,
    /// What generation fed back: "random" token ids (default) or the "greedy" tokens.
    pub tg_feed: &'static str,
    /// Generation with the perf state off, timed in the same runs (`metrics_ab`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tg_metrics_off_tokens_per_s_spread: Option<Spread>,
    /// The online updater's policy and what it did over the timed runs.
    pub update: UpdatePolicy,
    pub cache_updates: u64,
    pub cache_exchanges: u64,
    /// Post-Fetch of cold experts in prefill over the whole run (GPU engine with it enabled).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub postfetch: Option<crate::cache::perf::PostFetchPerf>,
    /// Per GPU of the GPU engine, in layer order: its ordinal, name, layers, dense and hot MiB,
    /// cached experts (`--devices`; none on the CPU engines).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<crate::gpu::DeviceReport>,
}

fn snapshot(engine: &dyn Engine) -> PerfReport {
    engine.perf().map(|p| p.report().clone()).unwrap_or_default()
}

/// Run the benchmark on `engine` (built per `build`). `progress(done, total)` ticks once per
/// phase of each run.
pub fn run_bench(
    engine: &mut dyn Engine,
    build: &BuildReport,
    model: &Model,
    opts: &BenchOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<BenchReport, BenchError> {
    let c = model.config();
    if opts.n_prompt_tokens == 0 || opts.n_gen_tokens == 0 || opts.n_runs == 0 {
        return Err(BenchError::ZeroCount);
    }
    let context = opts.depth + opts.n_prompt_tokens.max(opts.n_gen_tokens);
    if context > c.max_positions {
        return Err(BenchError::TooLong { positions: context, max_positions: c.max_positions });
    }
    engine.set_copy_logits(false); // the bench only needs the greedy tokens
    let prompt = match opts.locality {
        Some(l) => crate::locality::LocalityProcess::new(l, 0).tokens(c.vocab, opts.n_prompt_tokens),
        None => sample_tokens(c.vocab, opts.n_prompt_tokens),
    };
    warm_up(engine, &prompt, opts.n_gen_tokens, c.max_positions)?;
    if opts.metrics_ab && engine.perf().is_none_or(|p| p.mode() == PerfMode::Off) {
        return Err(BenchError::NothingRecorded);
    }
    let timed = timed_runs(engine, model, opts, &prompt, progress)?;
    Ok(BenchReport::new(engine, build, model, opts, timed))
}

/// Warm-up with the whole prompt, as llama-bench does: a kernel's first launch at a new shape
/// (cuBLAS picks and lazily loads one per shape) costs milliseconds that are not prefill speed,
/// and the page-ins of cold experts and the pool threads' first wake-ups are not either; then a
/// few decode steps. The profile starts after it.
fn warm_up(
    engine: &mut dyn Engine,
    prompt: &[u32],
    n_gen: usize,
    max_positions: usize,
) -> Result<(), BenchError> {
    let steps = n_gen.min(4).min(max_positions - prompt.len());
    let mut cache = engine.new_cache(prompt.len() + steps)?;
    let mut next = *engine.forward_last(prompt, Phase::Prefill, &mut cache)?.argmax.last().expect("rows");
    for _ in 0..steps {
        next = engine.forward(&[next], Phase::Decode, &mut cache)?.argmax[0];
    }
    engine.reset_profile();
    Ok(())
}

/// What the timed runs measured.
#[derive(Default)]
struct TimedRuns {
    pp_rates: Vec<f64>,
    tg_rates: Vec<f64>,
    tg_off_rates: Vec<f64>,
    pp: LaneTotals,
    tg: LaneTotals,
    updates: u64,
    exchanges: u64,
}

/// The timed runs: each a request of the live cache, pp on a fresh cache at the depth, then tg
/// on another (and tg with the perf state off, alternating which goes first, for `metrics_ab`).
fn timed_runs(
    engine: &mut dyn Engine,
    model: &Model,
    opts: &BenchOptions,
    prompt: &[u32],
    progress: &mut dyn FnMut(u64, u64),
) -> Result<TimedRuns, BenchError> {
    let vocab = model.config().vocab;
    let depth = sample_tokens(vocab, opts.depth);
    let mut live =
        LiveCache::new(engine, ModelFingerprint::of(model), model.layer_expert_bytes(), opts.update);
    let mut t = TimedRuns::default();
    let (updates, exchanges) = (&mut t.updates, &mut t.exchanges);
    let mut count = |o: Option<UpdateOutcome>| {
        if let Some(o) = o {
            *updates += 1;
            *exchanges += o.exchanges as u64;
        }
    };
    let total_ticks = 2 * opts.n_runs as u64;
    for run_idx in 0..opts.n_runs {
        let mut cache = cache_at_depth(engine, &depth, opts.n_prompt_tokens)?;
        live.begin_request();
        let before = snapshot(engine);
        let start = Instant::now();
        // The lm_head of the last row only, as llama-bench's prompt processing.
        let logits = engine.forward_last(prompt, Phase::Prefill, &mut cache)?;
        t.pp_rates.push(prompt.len() as f64 / start.elapsed().as_secs_f64());
        t.pp.add(LaneTotals::between(&before, &snapshot(engine)));
        progress(2 * run_idx as u64 + 1, total_ticks);
        let next = *logits.argmax.last().expect("one row per prompt token");
        let feed = match opts.locality {
            Some(l) => {
                crate::locality::LocalityProcess::new(l, run_idx as u64 + 1).tokens(vocab, opts.n_gen_tokens)
            }
            None => random_feed(vocab, opts.n_gen_tokens, run_idx),
        };
        let off_first = opts.metrics_ab && run_idx % 2 == 1;
        if off_first {
            t.tg_off_rates.push(timed_tg_off(engine, &depth, next, &feed, opts)?);
        }
        let mut cache = cache_at_depth(engine, &depth, opts.n_gen_tokens)?;
        let mid = snapshot(engine);
        let mut after = |e: &mut dyn Engine| live.after_tokens(e, 1).map(&mut count);
        t.tg_rates.push(timed_tg(engine, &mut cache, next, &feed, opts.greedy, &mut after)?);
        t.tg.add(LaneTotals::between(&mid, &snapshot(engine)));
        if opts.metrics_ab && !off_first {
            t.tg_off_rates.push(timed_tg_off(engine, &depth, next, &feed, opts)?);
        }
        count(live.end_request(engine)?);
        progress(2 * run_idx as u64 + 2, total_ticks);
    }
    Ok(t)
}

/// Decode `feed.len()` tokens after `first` (feeding the greedy token or `feed`); tokens/s.
fn timed_tg(
    engine: &mut dyn Engine,
    cache: &mut KvCache,
    first: u32,
    feed: &[u32],
    greedy: bool,
    after_token: &mut dyn FnMut(&mut dyn Engine) -> Result<(), EngineError>,
) -> Result<f64, BenchError> {
    let mut next = first;
    let start = Instant::now();
    for &fed in feed {
        let g = engine.forward(&[next], Phase::Decode, cache)?.argmax[0];
        next = if greedy { g } else { fed };
        after_token(engine)?;
    }
    Ok(feed.len() as f64 / start.elapsed().as_secs_f64())
}

/// A fresh cache with room for `len` positions after `depth`, which are prefilled untimed.
fn cache_at_depth(engine: &mut dyn Engine, depth: &[u32], len: usize) -> Result<KvCache, BenchError> {
    let mut cache = engine.new_cache(depth.len() + len)?;
    if !depth.is_empty() {
        engine.forward_last(depth, Phase::Prefill, &mut cache)?;
    }
    Ok(cache)
}

/// The same generation with the perf state off (a fresh cache at the same depth); the mode
/// is restored after.
fn timed_tg_off(
    engine: &mut dyn Engine,
    depth: &[u32],
    first: u32,
    feed: &[u32],
    opts: &BenchOptions,
) -> Result<f64, BenchError> {
    let mode = engine.perf().map_or(PerfMode::Off, |p| p.mode());
    let mut cache = cache_at_depth(engine, depth, feed.len())?;
    engine.set_perf_mode(PerfMode::Off);
    let rate = timed_tg(engine, &mut cache, first, feed, opts.greedy, &mut |_| Ok(()));
    engine.set_perf_mode(mode);
    rate
}

/// Token ids fed during generation in run `run_idx` (drawn before the timing starts).
fn random_feed(vocab: usize, n: usize, run_idx: usize) -> Vec<u32> {
    let offset = 7919 * (run_idx + 1);
    sample_tokens(vocab, n + offset).split_off(offset)
}

impl BenchReport {
    /// The report of the timed runs `t`, with the engine's and the build's settings.
    fn new(
        engine: &dyn Engine,
        build: &BuildReport,
        model: &Model,
        opts: &BenchOptions,
        t: TimedRuns,
    ) -> Self {
        let (pps, tgs, pp, tg) = (Spread::of(&t.pp_rates), Spread::of(&t.tg_rates), t.pp, t.tg);
        BenchReport {
            device: engine.device(),
            engine: engine.kind().name().to_string(),
            model: model.path().display().to_string(),
            n_prompt_tokens: opts.n_prompt_tokens,
            n_gen_tokens: opts.n_gen_tokens,
            n_runs: opts.n_runs,
            depth: opts.depth,
            pp_tokens_per_s: pps.median,
            tg_tokens_per_s: tgs.median,
            pp_tokens_per_s_spread: pps,
            tg_tokens_per_s_spread: tgs,
            hit_rate: tg.hit_rate(),
            pp_hit_rate: pp.hit_rate(),
            overlap_us: tg.per_call(tg.overlap_us),
            join_wait_us: tg.per_call(tg.join_wait_us),
            hot_lane_us: tg.per_call(tg.hot_us),
            cold_lane_us: tg.per_call(tg.cold_us),
            fallbacks: pp.fallbacks + tg.fallbacks,
            hot_bytes: engine.hot_bytes(),
            hot_experts: build.n_hot_experts,
            all_experts_bytes: model.all_experts_bytes(),
            budget: opts.budget,
            planned_hit_rate: build.planned_hit_rate,
            learn_source: build.hot_source,
            cold_threads: opts.threads.cold,
            threads: opts.threads,
            simd: opts.simd.clone(),
            activations: build.activations,
            tg_feed: match (opts.greedy, opts.locality) {
                (true, _) => "greedy",
                (false, Some(_)) => "locality",
                (false, None) => "random",
            },
            tg_metrics_off_tokens_per_s_spread: opts.metrics_ab.then(|| Spread::of(&t.tg_off_rates)),
            update: opts.update,
            cache_updates: t.updates,
            cache_exchanges: t.exchanges,
            postfetch: snapshot(engine).postfetch,
            devices: engine.device_reports(),
        }
    }
    pub fn to_text(&self) -> String {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        let mut out =
            format!("device        {} (engine {})\nmodel         {}\n", self.device, self.engine, self.model);
        let plan = match self.budget {
            Some(b) => b.to_string(),
            None => "no budget".to_string(),
        };
        let planned = match self.planned_hit_rate {
            Some(r) => format!("planned hit rate {:.1}%", r * 100.0),
            None => "planned hit rate unknown: no learn counts".to_string(),
        };
        out += &format!(
            "hot cache     {} experts, {:.1} MiB of {:.1} MiB ({plan}, {planned}, experts from {})\n",
            self.hot_experts,
            mib(self.hot_bytes),
            mib(self.all_experts_bytes),
            self.learn_source
        );
        let (p, g) = (&self.pp_tokens_per_s_spread, &self.tg_tokens_per_s_spread);
        out += &format!(
            "pp{:<4}        {:.1} t/s (min {:.1}, max {:.1}; hit rate {:.1}%)\n",
            self.n_prompt_tokens,
            p.median,
            p.min,
            p.max,
            self.pp_hit_rate * 100.0
        );
        out += &format!(
            "tg{:<4}        {:.1} t/s (min {:.1}, max {:.1}; hit rate {:.1}%)\n",
            self.n_gen_tokens,
            g.median,
            g.min,
            g.max,
            self.hit_rate * 100.0
        );
        out += &format!(
            "per layer     hot {:.1} us, cold {:.1} us, overlap {:.1} us, join wait {:.1} us, fallbacks {}\n",
            self.hot_lane_us, self.cold_lane_us, self.overlap_us, self.join_wait_us, self.fallbacks
        );
        if let Some(p) = &self.postfetch {
            out += &postfetch_line(p);
        }
        if self.devices.len() > 1 {
            for d in &self.devices {
                out += &format!(
                    "device {:<6} {} layers {}..{}: dense {:.1} MiB, hot {:.1} MiB ({} experts)\n",
                    d.ordinal, d.name, d.layers[0], d.layers[1], d.dense_mib, d.hot_mib, d.experts_cached
                );
            }
        }
        out += &format!(
            "tg feeds      {} token ids; pp and tg start at depth {} (llama-bench -d)\n",
            self.tg_feed, self.depth
        );
        if self.update.mode == crate::cache::update::UpdateMode::Auto {
            out += &format!(
                "updates       {} ({} exchanges, rate {})\n",
                self.cache_updates, self.cache_exchanges, self.update.rate
            );
        }
        if let Some(off) = &self.tg_metrics_off_tokens_per_s_spread {
            out += &format!(
                "tg{:<4} off    {:.1} t/s with metrics off (min {:.1}, max {:.1}); recording costs {:.2}% of tg\n",
                self.n_gen_tokens,
                off.median,
                off.min,
                off.max,
                (off.median - self.tg_tokens_per_s) / off.median * 100.0
            );
        }
        let t = &self.threads;
        let chosen = match t.chosen_by {
            crate::threads::ThreadChoice::Auto => "auto",
            crate::threads::ThreadChoice::Fixed => "fixed",
        };
        out += &format!(
            "cold lane     {} threads ({chosen}), {}, activations {} ({})\n",
            t.cold,
            self.simd,
            self.activations,
            match moe_lanes_kernels::SimdLevel::parse(&self.simd) {
                Ok(level) => self.activations.describe_at(level),
                Err(_) => self.activations.describe(),
            }
        );
        if t.dense > 0 {
            out += &format!("dense stage   {} threads\n", t.dense);
        }
        out
    }
}

/// Bench's one line for Post-Fetch: what moved, and seed 001's three targets.
fn postfetch_line(p: &crate::cache::perf::PostFetchPerf) -> String {
    let pct = |x: Option<f64>| x.map_or("n/a".to_string(), |v| format!("{:.1}%", v * 100.0));
    format!(
        "postfetch     {}: {} experts fetched ({:.1} MiB, copy {:.1} ms), overlap {} (target >= 70%), \
         fallback {} (<= 5%), VRAM {:.1} MiB = {} of the hot cache (<= 10%), {} block waits, PCIe {:.1} GB/s, \
         copies {}{}\n",
        p.mode,
        p.experts_fetched,
        p.bytes_copied as f64 / (1 << 20) as f64,
        p.copy_time_us as f64 / 1e3,
        pct(p.transfer_overlap),
        pct(p.fallback_rate),
        p.scratch_bytes as f64 / (1 << 20) as f64,
        pct(p.vram_overhead),
        p.block_waits,
        p.pcie_bytes_per_s / 1e9,
        p.copy_source,
        p.register_error.as_ref().map_or(String::new(), |e| format!(" (registering the file failed: {e})")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn postfetch_line_reports_the_seed_targets() {
        let p = crate::cache::perf::PostFetchPerf {
            mode: "auto".into(),
            experts_fetched: 3,
            bytes_copied: 3 << 20,
            copy_time_us: 1500,
            transfer_overlap: Some(0.75),
            fallback_rate: None,
            scratch_bytes: 1 << 20,
            vram_overhead: Some(0.02),
            pcie_bytes_per_s: 5e10,
            copy_source: "staged".into(),
            register_error: Some("refused".into()),
            ..Default::default()
        };
        let line = postfetch_line(&p);
        assert!(
            line.starts_with("postfetch     auto: 3 experts fetched (3.0 MiB, copy 1.5 ms), overlap 75.0%"),
            "{line}"
        );
        assert!(line.contains("fallback n/a (<= 5%), VRAM 1.0 MiB = 2.0% of the hot cache"), "{line}");
        assert!(line.ends_with("copies staged (registering the file failed: refused)\n"), "{line}");
    }

    #[test]
    fn spread_takes_median_and_extremes() {
        assert_eq!(Spread::of(&[3.0, 1.0, 2.0]), Spread { median: 2.0, min: 1.0, max: 3.0 });
        assert_eq!(Spread::of(&[4.0, 1.0]).median, 2.5);
    }
}
