//! Batched throughput, as llama.cpp's `llama-batched-bench` measures it (`moe-lanes bench
//! --parallel B,..`): for each batch size B, B sequences of `pp` prompt tokens each are prefilled
//! in one batched call (the engine packs them into its sub-batches), then `tg` decode steps feed
//! one random token id to every sequence in one [`Engine::forward_batch`] call each. Reported per B:
//! prompt, generation and total tokens per second over all sequences (llama-batched-bench's S_PP,
//! S_TG and S), the decode step's p50/p99 (every stream's inter-token latency), and the decode
//! steps' lanes from the engine's perf state (cold-lane time, the part of it overlapped, the
//! join's wait, and how many steps ran as ping-pong micro-batches).

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
    /// Per decode step, summed over the MoE layers (the engine's lane figures, medians over the
    /// runs, milliseconds): the cold lane's time, the part of it that overlapped other work
    /// (the hot lane, or with ping-pong the other micro-batch), and the join's wait for the
    /// later lane.
    pub cold_ms_per_step: f64,
    pub overlap_ms_per_step: f64,
    pub join_wait_ms_per_step: f64,
    /// Decode steps that ran as two ping-pong micro-batches, of every timed run.
    pub ping_pong_steps: u64,
}

/// An engine's lane totals of its decode calls: cold-lane, overlap and join-wait time over every
/// layer (microseconds), and the ping-pong calls; zero without a perf state.
#[derive(Debug, Clone, Copy, Default)]
struct DecodeLanes {
    cold_us: u64,
    overlap_us: u64,
    join_wait_us: u64,
    ping_pong: u64,
}

impl DecodeLanes {
    fn of(engine: &dyn Engine) -> DecodeLanes {
        let Some(report) = engine.perf().map(|p| p.report()) else { return DecodeLanes::default() };
        let sum = |f: fn(&crate::cache::perf::LayerPerf) -> u64| report.layers.iter().map(f).sum();
        DecodeLanes {
            cold_us: sum(|l| l.parallel_cold_time_us),
            overlap_us: sum(|l| l.parallel_overlap_us),
            join_wait_us: sum(|l| l.parallel_join_wait_us),
            ping_pong: report.phases.get(Phase::Decode.name()).map_or(0, |p| p.ping_pong_calls),
        }
    }

    /// What the calls between `before` and `self` added.
    fn since(self, before: DecodeLanes) -> DecodeLanes {
        DecodeLanes {
            cold_us: self.cold_us.saturating_sub(before.cold_us),
            overlap_us: self.overlap_us.saturating_sub(before.overlap_us),
            join_wait_us: self.join_wait_us.saturating_sub(before.join_wait_us),
            ping_pong: self.ping_pong.saturating_sub(before.ping_pong),
        }
    }
}

/// One timed run's figures: prefill and decode time, each step's time, the decode lanes.
struct RunTimes {
    pp_s: f64,
    tg_s: f64,
    step_s: Vec<f64>,
    lanes: DecodeLanes,
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
    let runs: Vec<RunTimes> =
        (0..opts.n_runs).map(|run| one_run(engine, b, pp, tg, run + 1)).collect::<Result<_, _>>()?;
    let median = |f: &dyn Fn(&RunTimes) -> f64| {
        let mut v: Vec<f64> = runs.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (pp_s, tg_s) = (median(&|r| r.pp_s), median(&|r| r.tg_s));
    let per_step_ms = |f: fn(&DecodeLanes) -> u64| median(&|r| f(&r.lanes) as f64 / 1e3 / tg as f64);
    let mut steps: Vec<f64> = runs.iter().flat_map(|r| r.step_s.iter().copied()).collect();
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
        cold_ms_per_step: per_step_ms(|l| l.cold_us),
        overlap_ms_per_step: per_step_ms(|l| l.overlap_us),
        join_wait_ms_per_step: per_step_ms(|l| l.join_wait_us),
        ping_pong_steps: runs.iter().map(|r| r.lanes.ping_pong).sum(),
    })
}

/// B fresh sequences: the prompts in one batched call, then `tg` batched decode steps. Returns
/// the prefill time, the decode time and each step's time (seconds), and the decode steps'
/// lane figures.
fn one_run(
    engine: &mut dyn Engine,
    b: usize,
    pp: usize,
    tg: usize,
    seed: usize,
) -> Result<RunTimes, EngineError> {
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
    let lanes_before = DecodeLanes::of(engine);
    let start = Instant::now();
    for step in feeds.chunks(b).take(tg) {
        let t0 = Instant::now();
        let mut seqs: Vec<BatchSeq<'_>> =
            step.chunks(1).zip(caches.iter_mut()).map(|(tokens, cache)| BatchSeq { tokens, cache }).collect();
        engine.forward_batch(&mut seqs, Phase::Decode)?;
        step_s.push(t0.elapsed().as_secs_f64());
    }
    let tg_s = start.elapsed().as_secs_f64();
    Ok(RunTimes { pp_s, tg_s, step_s, lanes: DecodeLanes::of(engine).since(lanes_before) })
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
    out.push_str(
        "\nlanes per decode step, summed over the layers (ms):\n\
         |    B |  cold lane |  overlapped |  join wait | ping-pong steps |\n\
         |------|------------|-------------|------------|-----------------|\n",
    );
    for r in rows {
        out.push_str(&format!(
            "| {:4} | {:10.3} | {:11.3} | {:10.3} | {:15} |\n",
            r.parallel, r.cold_ms_per_step, r.overlap_ms_per_step, r.join_wait_ms_per_step, r.ping_pong_steps
        ));
    }
    out
}
