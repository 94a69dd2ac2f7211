//! Batched throughput, as llama.cpp's `llama-batched-bench` measures it (`moe-lanes bench
//! --parallel B,..`): for each batch size B, B sequences of `pp` prompt tokens each are prefilled
//! in one batched call (the engine packs them into its sub-batches), then `tg` decode steps feed
//! one random token id to every sequence in one [`Engine::forward_batch`] call each. Reported per B:
//! prompt, generation and total tokens per second over all sequences (llama-batched-bench's S_PP,
//! S_TG and S), and the decode step's p50/p99 (every stream's inter-token latency).

use crate::engine::{BatchSeq, Engine, EngineError, KvCache};
use crate::inspect::sample_tokens;
use crate::moe::phase::Phase;
use serde::Serialize;
use std::time::Instant;

#[derive(Debug, Clone)]
pub struct BatchedBenchOptions {
    pub n_prompt_tokens: usize,
    /// Decode steps (tokens generated per sequence).
    pub n_gen_tokens: usize,
    /// The batch sizes to measure, in order.
    pub parallel: Vec<usize>,
    /// Timed runs per batch size (medians reported).
    pub n_runs: usize,
}

/// One batch size's figures (medians over the runs).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct BatchedRow {
    pub parallel: usize,
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub pp_s: f64,
    pub tg_s: f64,
    /// All sequences' prompt tokens over the prefill time (S_PP).
    pub pp_tokens_per_s: f64,
    /// All sequences' generated tokens over the decode time (S_TG).
    pub tg_tokens_per_s: f64,
    /// Everything over the whole time (S).
    pub total_tokens_per_s: f64,
    /// Decode step time percentiles over every step of every run, in milliseconds.
    pub step_ms_p50: f64,
    pub step_ms_p99: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum BatchedBenchError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("bench --parallel: batch sizes must be at least 1 and runs and generated tokens at least 1")]
    ZeroCount,
    #[error("bench --parallel: {positions} positions per sequence exceed the model's {max_positions}")]
    TooLong { positions: usize, max_positions: usize },
}

/// One warm-up of each batch size (short: the kernels and scratch are ready), then the timed runs.
pub fn run_batched_bench(
    engine: &mut dyn Engine,
    opts: &BatchedBenchOptions,
) -> Result<Vec<BatchedRow>, BatchedBenchError> {
    let positions = opts.n_prompt_tokens + opts.n_gen_tokens;
    if opts.parallel.contains(&0) || opts.n_runs == 0 || opts.n_gen_tokens == 0 {
        return Err(BatchedBenchError::ZeroCount);
    }
    let max_positions = engine.config().max_positions;
    if positions > max_positions {
        return Err(BatchedBenchError::TooLong { positions, max_positions });
    }
    let restore = engine.copies_logits();
    engine.set_copy_logits(false);
    let rows = opts.parallel.iter().map(|&b| batch_row(engine, opts, b)).collect();
    engine.set_copy_logits(restore);
    rows
}

fn batch_row(
    engine: &mut dyn Engine,
    opts: &BatchedBenchOptions,
    b: usize,
) -> Result<BatchedRow, BatchedBenchError> {
    let (pp, tg) = (opts.n_prompt_tokens, opts.n_gen_tokens);
    one_run(engine, b, pp.min(16), tg.min(2), 0)?;
    let mut runs = Vec::with_capacity(opts.n_runs);
    let mut steps = Vec::new();
    for run in 0..opts.n_runs {
        let (pp_s, tg_s, step_s) = one_run(engine, b, pp, tg, run + 1)?;
        runs.push((pp_s, tg_s));
        steps.extend(step_s);
    }
    let median = |f: &dyn Fn(&(f64, f64)) -> f64| {
        let mut v: Vec<f64> = runs.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (pp_s, tg_s) = (median(&|r| r.0), median(&|r| r.1));
    steps.sort_by(f64::total_cmp);
    let pct = |p: f64| steps[((steps.len() - 1) as f64 * p).round() as usize] * 1e3;
    let per_s = |tokens: usize, s: f64| if s > 0.0 { tokens as f64 / s } else { 0.0 };
    Ok(BatchedRow {
        parallel: b,
        prompt_tokens: pp,
        gen_tokens: tg,
        pp_s,
        tg_s,
        pp_tokens_per_s: per_s(b * pp, pp_s),
        tg_tokens_per_s: per_s(b * tg, tg_s),
        total_tokens_per_s: per_s(b * (pp + tg), pp_s + tg_s),
        step_ms_p50: pct(0.5),
        step_ms_p99: pct(0.99),
    })
}

/// B fresh sequences: the prompts in one batched call, then `tg` batched decode steps. Returns
/// the prefill time, the decode time and each step's time, in seconds.
fn one_run(
    engine: &mut dyn Engine,
    b: usize,
    pp: usize,
    tg: usize,
    seed: usize,
) -> Result<(f64, f64, Vec<f64>), EngineError> {
    let vocab = engine.config().vocab;
    let mut caches: Vec<KvCache> = (0..b).map(|_| engine.new_cache(pp + tg)).collect::<Result<_, _>>()?;
    // Distinct prompts and feeds per sequence and run, from one deterministic stream.
    let stream = sample_tokens(vocab, (seed + 1) * b * (pp + tg));
    let stream = &stream[seed * b * (pp + tg)..];
    let (prompts, feeds) = stream.split_at(b * pp);
    let start = Instant::now();
    if pp > 0 {
        let mut seqs: Vec<BatchSeq<'_>> = prompts
            .chunks(pp)
            .zip(caches.iter_mut())
            .map(|(tokens, cache)| BatchSeq { tokens, cache })
            .collect();
        engine.forward_batch(&mut seqs, Phase::Prefill)?;
    }
    let pp_s = start.elapsed().as_secs_f64();
    let mut step_s = Vec::with_capacity(tg);
    let start = Instant::now();
    for step in feeds.chunks(b).take(tg) {
        let t0 = Instant::now();
        let mut seqs: Vec<BatchSeq<'_>> =
            step.chunks(1).zip(caches.iter_mut()).map(|(tokens, cache)| BatchSeq { tokens, cache }).collect();
        engine.forward_batch(&mut seqs, Phase::Decode)?;
        step_s.push(t0.elapsed().as_secs_f64());
    }
    Ok((pp_s, start.elapsed().as_secs_f64(), step_s))
}

/// The rows as llama-batched-bench's table.
pub fn to_text(rows: &[BatchedRow]) -> String {
    let mut out = String::from(
        "|    PP |    TG |    B |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |    S t/s | step p50 ms | step p99 ms |\n\
         |-------|-------|------|----------|----------|----------|----------|----------|-------------|-------------|\n",
    );
    for r in rows {
        out.push_str(&format!(
            "| {:5} | {:5} | {:4} | {:8.3} | {:8.2} | {:8.3} | {:8.2} | {:8.2} | {:11.2} | {:11.2} |\n",
            r.prompt_tokens,
            r.gen_tokens,
            r.parallel,
            r.pp_s,
            r.pp_tokens_per_s,
            r.tg_s,
            r.tg_tokens_per_s,
            r.total_tokens_per_s,
            r.step_ms_p50,
            r.step_ms_p99
        ));
    }
    out
}
