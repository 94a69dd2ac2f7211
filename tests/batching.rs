//! Continuous batching: one engine call over several sequences gives each sequence what it gets
//! alone. For every golden fixture (attention, Gated DeltaNet, latent attention, sliding windows
//! with sinks): three sequences of different lengths prefilled in one call (and across
//! sub-batches), then decoded together, then a step mixing a prompt chunk with decode tokens,
//! on the CPU pipeline and (where a GPU is usable) the GPU engine, at hot fractions 0, 0.5, 1;
//! and the [`Batcher`]: greedy tokens of concurrent requests identical to each alone, with
//! chunked prompts, a full batcher, a cancellation and a bad request among them.

mod common;

use moe_lanes::cache::hot_set::HotSet;
use moe_lanes::engine::{
    build_engine, BatchOptions, BatchSeq, Batcher, Engine, EngineKind, EngineOptions, FinishReason,
    GenerationOptions, HotChoice, SeqEvent, SeqId,
};
use moe_lanes::model::context::KvType;
use moe_lanes::model::Model;
use moe_lanes::phase::Phase;
use std::collections::HashMap;
use std::sync::Arc;

const POSITIONS: usize = 128;
/// Pipeline: the same kernels per row; sums over other row counts differ in the last bits.
const CPU_TOL: f32 = 1e-4;
/// GPU: decode GEMVs against GEMMs and bf16 activation splits (as tests/gpu_parity.rs).
const GPU_TOL: f32 = 2e-3;

fn open(name: &str) -> Arc<Model> {
    Arc::new(Model::open(&common::fixtures_root().join(name)).unwrap())
}

fn prompt(name: &str) -> Vec<u32> {
    let text = std::fs::read_to_string(common::fixtures_root().join(name).join("golden.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["prompt"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn hot_set(model: &Model, fraction: f64) -> HotSet {
    let c = model.config();
    let n_hot = (c.n_experts as f64 * fraction).round() as usize;
    let lists: Vec<Vec<usize>> = (0..c.n_layers)
        .map(|l| match model.plan().layer(l).has_experts() {
            true => (0..c.n_experts).filter(|e| (e + l) % c.n_experts < n_hot).collect(),
            false => Vec::new(),
        })
        .collect();
    HotSet::from_lists(c.n_layers, c.n_experts, 1, &lists)
}

fn engine(
    model: &Arc<Model>,
    kind: EngineKind,
    fraction: f64,
    max_batch_tokens: usize,
) -> Box<dyn Engine + '_> {
    engine_with_cache(model, kind, fraction, max_batch_tokens, None)
}

/// [`engine`] with the GPU's KV cache type (`None`: the default).
fn engine_with_cache(
    model: &Arc<Model>,
    kind: EngineKind,
    fraction: f64,
    max_batch_tokens: usize,
    kv_type: Option<KvType>,
) -> Box<dyn Engine + '_> {
    let opts = engine_options(model, kind, fraction, max_batch_tokens, kv_type);
    let (engine, report) = build_engine(model, opts).unwrap();
    assert_eq!(report.kind, kind);
    engine
}

fn engine_options(
    model: &Arc<Model>,
    kind: EngineKind,
    fraction: f64,
    max_batch_tokens: usize,
    kv_type: Option<KvType>,
) -> EngineOptions {
    let mut opts = EngineOptions::new(POSITIONS);
    opts.kind = Some(kind);
    opts.hot = HotChoice::Set(hot_set(model, fraction));
    opts.cold_threads = moe_lanes::threads::ColdThreads::Fixed(2);
    opts.pipeline.max_batch_tokens = max_batch_tokens;
    if kind == EngineKind::Gpu {
        opts.cuda = moe_lanes::env::cuda_config().unwrap();
        // the three-row decode steps below take the grouped hot lane (default: 8 rows); every
        // batched call takes the one-launch q/k norm + RoPE + append and decode attention
        opts.gpu.hot_grouped_min_rows = 2;
        opts.gpu.hot_grouped_min_rows_quantized = 2;
        opts.kv_type = kv_type;
    }
    opts
}

/// Three prompts of different lengths from the fixture's prompt.
fn prompts(name: &str) -> Vec<Vec<u32>> {
    let p = prompt(name);
    let n = p.len();
    vec![p.clone(), p[n / 3..].to_vec(), p.iter().rev().take(n / 2 + 1).copied().collect()]
}

/// The decode tokens fed to sequence `i` at step `s` (fixed, so alone and batched feed the same).
fn decode_token(vocab: usize, i: usize, s: usize) -> u32 {
    ((7 + 31 * i + 13 * s) % vocab) as u32
}

fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
    assert!(got.iter().all(|v| v.is_finite()));
    got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale
}

/// Each sequence alone: its prompt's last row, then a row per decode step, then the row after a
/// chunk of two more tokens.
fn alone(engine: &mut dyn Engine, prompts: &[Vec<u32>], steps: usize) -> Vec<Vec<Vec<f32>>> {
    let vocab = engine.config().vocab;
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut cache = engine.new_cache(POSITIONS).unwrap();
            let mut rows = vec![engine.forward_last(p, Phase::Prefill, &mut cache).unwrap().data];
            for s in 0..steps {
                let t = decode_token(vocab, i, s);
                rows.push(engine.forward(&[t], Phase::Decode, &mut cache).unwrap().data);
            }
            let chunk = [decode_token(vocab, i, 90), decode_token(vocab, i, 91)];
            rows.push(engine.forward_last(&chunk, Phase::Prefill, &mut cache).unwrap().data);
            rows
        })
        .collect()
}

/// The same work batched: one prefill call, `steps` decode calls, then a call where sequence 1
/// takes the two-token chunk while the others decode one more token (its row is compared only
/// for sequence 1).
fn batched(engine: &mut dyn Engine, prompts: &[Vec<u32>], steps: usize) -> Vec<Vec<Vec<f32>>> {
    let vocab = engine.config().vocab;
    let mut caches: Vec<_> = prompts.iter().map(|_| engine.new_cache(POSITIONS).unwrap()).collect();
    let mut rows: Vec<Vec<Vec<f32>>> = vec![Vec::new(); prompts.len()];
    let mut call = |engine: &mut dyn Engine,
                    inputs: Vec<Vec<u32>>,
                    phase: Phase,
                    rows: &mut Vec<Vec<Vec<f32>>>| {
        let mut seqs: Vec<BatchSeq<'_>> =
            inputs.iter().zip(caches.iter_mut()).map(|(t, cache)| BatchSeq { tokens: t, cache }).collect();
        let logits = engine.forward_batch(&mut seqs, phase).unwrap();
        assert_eq!(logits.n_rows, prompts.len());
        for (i, r) in rows.iter_mut().enumerate() {
            r.push(logits.row(i).to_vec());
        }
    };
    call(engine, prompts.to_vec(), Phase::Prefill, &mut rows);
    for s in 0..steps {
        let inputs = (0..prompts.len()).map(|i| vec![decode_token(vocab, i, s)]).collect();
        call(engine, inputs, Phase::Decode, &mut rows);
    }
    let mixed = (0..prompts.len())
        .map(|i| match i {
            1 => vec![decode_token(vocab, i, 90), decode_token(vocab, i, 91)],
            _ => vec![decode_token(vocab, i, 90)],
        })
        .collect();
    call(engine, mixed, Phase::Prefill, &mut rows);
    rows
}

fn check_fixture(name: &str, kind: EngineKind, fraction: f64, tol: f32) -> f32 {
    check_fixture_cache(name, kind, fraction, tol, None)
}

fn check_fixture_cache(name: &str, kind: EngineKind, fraction: f64, tol: f32, kv: Option<KvType>) -> f32 {
    let model = open(name);
    let ps = prompts(name);
    let steps = 3;
    // A short sub-batch on the pipeline makes the prefill call cross sub-batch boundaries.
    let mut e = engine_with_cache(&model, kind, fraction, 17, kv);
    e.set_copy_logits(true);
    let want = alone(e.as_mut(), &ps, steps);
    let got = batched(e.as_mut(), &ps, steps);
    let mut worst = 0f32;
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        for (s, (wr, gr)) in w.iter().zip(g).enumerate() {
            if s == steps + 1 && i != 1 {
                continue; // the mixed step: only sequence 1 fed the same chunk as alone
            }
            let err = rel_err(gr, wr);
            assert!(err <= tol, "{name} {kind} hot {fraction}: sequence {i} call {s}: {err:e} > {tol}");
            worst = worst.max(err);
        }
    }
    worst
}

#[test]
fn pipeline_batches_equal_each_sequence_alone() {
    for name in common::fixture_names() {
        for fraction in [0.0, 0.5, 1.0] {
            let err = check_fixture(&name, EngineKind::Pipeline, fraction, CPU_TOL);
            println!("{name} hot {fraction}: worst {err:.2e}");
        }
    }
}

#[test]
fn reference_engine_batches_by_calling_each_sequence() {
    let err = check_fixture("qwen3_moe_a", EngineKind::Reference, 0.0, 0.0);
    assert_eq!(err, 0.0);
}

#[test]
fn gpu_batches_equal_each_sequence_alone() {
    if !common::gpu_usable() {
        return;
    }
    for name in common::fixture_names() {
        if let Err(e) = moe_lanes::gpu::GpuModel::supports(&open(&name)) {
            eprintln!("{name}: not on the GPU engine: {e}");
            continue;
        }
        for fraction in [0.0, 0.5, 1.0] {
            let err = check_fixture(&name, EngineKind::Gpu, fraction, GPU_TOL);
            println!("{name} gpu hot {fraction}: worst {err:.2e}");
        }
    }
}

/// The batched decode attention and append read and write every cache type the fixtures take:
/// f32 and bf16 caches (f16 above; q8_0 needs heads of whole blocks of 32, which these small
/// fixtures' 16- and 24-dim heads are not: kernels/tests/cuda_kernels.rs covers it), on the
/// attention fixtures with GQA, sliding windows and sinks, and Gemma 4's layers of their own
/// head dims and KV heads.
#[test]
fn gpu_batches_equal_each_sequence_alone_with_every_cache_type() {
    if !common::gpu_usable() {
        return;
    }
    for name in ["qwen3_moe_a", "gpt_oss_a", "mixtral_a", "gemma4_a"] {
        if let Err(e) = moe_lanes::gpu::GpuModel::supports(&open(name)) {
            eprintln!("{name}: not on the GPU engine: {e}");
            continue;
        }
        for kv in [KvType::F32, KvType::Bf16] {
            let err = check_fixture_cache(name, EngineKind::Gpu, 1.0, GPU_TOL, Some(kv));
            println!("{name} gpu {kv} cache: worst {err:.2e}");
        }
    }
}

/// Lane ping-pong: the GPU's decode steps of two to four sequences with cold experts run as
/// two micro-batches whose lanes alternate (counted in the perf state's decode phase); every
/// sequence's rows equal those of the same steps run whole (ping-pong off), on every fixture
/// the GPU engine takes (attention, DeltaNet state, latent attention, sliding windows, dense
/// layers among the MoE ones), budget 0 and half hot. An all-hot model never ping-pongs.
#[test]
fn gpu_ping_pong_steps_equal_the_steps_run_whole() {
    if !common::gpu_usable() {
        return;
    }
    let ping_pong_calls = |e: &dyn Engine| e.perf().and_then(|p| p.report().phases.get("decode").copied());
    for name in common::fixture_names() {
        let model = open(&name);
        if moe_lanes::gpu::GpuModel::supports(&model).is_err() {
            continue;
        }
        let ps = prompts(&name);
        for fraction in [0.0, 0.5, 1.0] {
            let runs: Vec<(Vec<Vec<Vec<f32>>>, u64)> = [0, 4]
                .into_iter()
                .map(|max_rows| {
                    let mut opts = engine_options(&model, EngineKind::Gpu, fraction, 17, None);
                    opts.gpu.ping_pong_max_rows = max_rows;
                    let (mut e, _) = build_engine(&model, opts).unwrap();
                    e.set_copy_logits(true);
                    let rows = batched(e.as_mut(), &ps, 3);
                    (rows, ping_pong_calls(e.as_ref()).map_or(0, |p| p.ping_pong_calls))
                })
                .collect();
            let (whole, split) = (&runs[0], &runs[1]);
            assert_eq!(whole.1, 0, "{name} hot {fraction}: ping-pong off");
            let want = if fraction < 1.0 { 3 } else { 0 }; // the three decode steps, not the mixed one
            assert_eq!(split.1, want, "{name} hot {fraction}: ping-pong steps");
            for (i, (w, g)) in whole.0.iter().zip(&split.0).enumerate() {
                for (s, (wr, gr)) in w.iter().zip(g).enumerate() {
                    let err = rel_err(gr, wr);
                    assert!(err <= GPU_TOL, "{name} hot {fraction}: sequence {i} call {s}: {err:e}");
                }
            }
        }
    }
}

#[test]
fn a_bad_sequence_refuses_the_whole_call_and_changes_no_cache() {
    let model = open("qwen3_moe_a");
    let mut e = engine(&model, EngineKind::Pipeline, 0.5, 512);
    let vocab = e.config().vocab as u32;
    let mut caches: Vec<_> = (0..2).map(|_| e.new_cache(POSITIONS).unwrap()).collect();
    let inputs = [vec![1u32, 2, 3], vec![4, vocab]];
    let mut seqs: Vec<BatchSeq<'_>> =
        inputs.iter().zip(caches.iter_mut()).map(|(t, cache)| BatchSeq { tokens: t, cache }).collect();
    let err = e.forward_batch(&mut seqs, Phase::Prefill).unwrap_err().to_string();
    assert!(err.contains(&vocab.to_string()), "{err}");
    assert!(caches.iter().all(|c| c.n_positions() == 0));
}

/// Greedy generation of `prompt` alone.
fn generate_alone(engine: &mut dyn Engine, prompt: &[u32], n: usize) -> Vec<u32> {
    engine.generate(prompt, n).unwrap()
}

fn batcher_case(kind: EngineKind) {
    let model = open("qwen3_next_a");
    let mut e = engine(&model, kind, 0.5, 512);
    let base = prompt("qwen3_next_a");
    let requests: Vec<(Vec<u32>, usize)> =
        (0..6).map(|i| (base[i * 5..].iter().take(9 + 7 * i).copied().collect(), 3 + 2 * i)).collect();
    let want: Vec<Vec<u32>> = requests.iter().map(|(p, n)| generate_alone(e.as_mut(), p, *n)).collect();
    // Chunked prompts (7 tokens a step), at most 3 sequences at once.
    let mut b = Batcher::new(BatchOptions {
        max_sequences: 3,
        step_tokens: 7,
        prefix_cache: 0,
        ..Default::default()
    });
    let mut waiting: Vec<usize> = (0..requests.len()).collect();
    let (mut ids, mut got, mut done): (HashMap<SeqId, usize>, Vec<Vec<u32>>, Vec<bool>) =
        (HashMap::new(), vec![Vec::new(); requests.len()], vec![false; requests.len()]);
    // A bad request (a stop id outside the vocabulary) is refused at once and never runs.
    let bad = GenerationOptions { max_tokens: 2, stop_ids: vec![u32::MAX], ..Default::default() };
    assert!(b.add(e.as_ref(), &base, bad).unwrap().is_err());
    let mut steps = 0;
    while !(waiting.is_empty() && b.is_empty()) {
        while b.has_room() && !waiting.is_empty() {
            let r = waiting.remove(0);
            let opts = GenerationOptions { max_tokens: requests[r].1, ..Default::default() };
            ids.insert(b.add(e.as_ref(), &requests[r].0, opts).unwrap().unwrap(), r);
        }
        if b.len() == 3 {
            assert!(b.add(e.as_ref(), &base, GenerationOptions::default()).is_err(), "full at 3");
        }
        for ev in b.step(e.as_mut()) {
            match ev {
                SeqEvent::Token(id, t) => got[ids[&id]].push(t.id),
                SeqEvent::Finished { id, finish, generated, .. } => {
                    assert_eq!(finish, FinishReason::Length);
                    assert_eq!(generated, got[ids[&id]]);
                    done[ids[&id]] = true;
                }
                SeqEvent::Failed(id, e) => panic!("{id:?}: {e}"),
            }
        }
        assert!(b.last_step().tokens <= 7);
        steps += 1;
    }
    assert!(done.iter().all(|&d| d));
    assert_eq!(got, want, "{kind}");
    let total: usize = requests.iter().map(|(p, n)| p.len() + n).sum();
    assert!(steps < total, "{kind}: {steps} steps for {total} tokens: not batched");
}

#[test]
fn batcher_generates_what_each_request_generates_alone() {
    batcher_case(EngineKind::Pipeline);
}

#[test]
fn gpu_batcher_generates_what_each_request_generates_alone() {
    if common::gpu_usable() {
        batcher_case(EngineKind::Gpu);
    }
}

#[test]
fn a_cancelled_sequence_leaves_and_the_others_go_on_unchanged() {
    let model = open("qwen3_moe_a");
    let mut e = engine(&model, EngineKind::Pipeline, 0.5, 512);
    let p = prompt("qwen3_moe_a");
    let want = generate_alone(e.as_mut(), &p[2..], 6);
    let mut b = Batcher::new(BatchOptions::default());
    let opts = GenerationOptions { max_tokens: 6, ..Default::default() };
    let keep = b.add(e.as_ref(), &p[2..], opts.clone()).unwrap().unwrap();
    let gone = b.add(e.as_ref(), &p, opts).unwrap().unwrap();
    let mut got = Vec::new();
    let mut step = 0;
    while !b.is_empty() {
        if step == 2 {
            assert!(b.cancel(gone));
            assert!(!b.cancel(gone));
        }
        for ev in b.step(e.as_mut()) {
            match ev {
                SeqEvent::Token(id, t) if id == keep => got.push(t.id),
                SeqEvent::Token(id, _) => assert!(id == gone && step < 2),
                SeqEvent::Finished { id, .. } => assert_eq!(id, keep),
                SeqEvent::Failed(_, e) => panic!("{e}"),
            }
        }
        step += 1;
    }
    assert_eq!(got, want);
}

/// Multi-turn: a second request whose prompt is the first's prompt, its answer and a new turn
/// reuses the first's cache (attention layers cut to the shared prefix, a hybrid's recurrent
/// state from its checkpoint at the prompt's end; the GPU's allocation, sized for the first
/// request, grown for the second: latent, sliding-window and DeltaNet layers among the
/// fixtures) and generates what it generates alone; a
/// prompt sharing part of a kept one reuses that part, a hybrid up to its latest checkpoint in
/// it (every 8 positions here), and misses below its first.
fn prefix_case(kind: EngineKind) {
    for name in ["qwen3_moe_a", "qwen3_next_a", "deepseek_v3_a", "gpt_oss_a"] {
        let model = open(name);
        let mut e = engine(&model, kind, 0.5, 512);
        let vocab = model.config().vocab;
        let p: Vec<u32> = (0..60).map(|i| ((i * 37 + 11) % vocab) as u32).collect();
        let opts = BatchOptions { max_sequences: 4, step_tokens: 64, prefix_cache: 2, checkpoint_tokens: 8 };
        let mut b = Batcher::new(opts);
        let run = |b: &mut Batcher, e: &mut dyn Engine, prompt: &[u32], n: usize| -> Vec<u32> {
            let opts = GenerationOptions { max_tokens: n, ..Default::default() };
            b.add(e, prompt, opts).unwrap().unwrap();
            let mut out = Vec::new();
            while !b.is_empty() {
                for ev in b.step(e) {
                    match ev {
                        SeqEvent::Token(_, t) => out.push(t.id),
                        SeqEvent::Failed(_, err) => panic!("{err}"),
                        SeqEvent::Finished { .. } => {}
                    }
                }
            }
            out
        };
        let recurrent = name == "qwen3_next_a";
        // (prompt, tokens to generate, tokens it should reuse from the kept caches)
        let first = run(&mut b, e.as_mut(), &p[..20], 5);
        assert_eq!(b.prefix_stats().lookups, 0, "{name}: nothing kept yet");
        let mut second = p[..20].to_vec();
        second.extend(&first);
        second.extend(&p[20..26]);
        // the first's cache: the prompt (checkpoints at 8, 16 and its end, 20) and 4 fed answers
        let third: Vec<u32> = p[..10].iter().chain(&p[30..36]).copied().collect();
        // the second's cache went to the third: a hybrid holds checkpoints at 8 and 16 now
        let fourth: Vec<u32> = p[..5].iter().chain(&p[40..50]).copied().collect();
        let cases = [
            (second, 6, 20 + first.len() - 1),
            (third, 4, if recurrent { 8 } else { 10 }),
            (fourth, 3, if recurrent { 0 } else { 5 }),
        ];
        for (turn, (prompt, n, reuse)) in cases.into_iter().enumerate() {
            let before = b.prefix_stats();
            let want = generate_alone(e.as_mut(), &prompt, n);
            assert_eq!(run(&mut b, e.as_mut(), &prompt, n), want, "{name} {kind} turn {turn}");
            let after = b.prefix_stats();
            assert_eq!(after.lookups, before.lookups + 1, "{name} {kind} turn {turn}");
            assert_eq!(after.hits - before.hits, u64::from(reuse > 0), "{name} {kind} turn {turn}");
            let reused = (after.reused_tokens - before.reused_tokens) as usize;
            assert_eq!(reused, reuse, "{name} {kind} turn {turn}: tokens reused");
        }
    }
}

/// A long prompt keeps only the checkpoints that survive its prefill (the last three every-8
/// positions and its end: 80, 88, 96 and 100 of 100): a prompt sharing 70 of it misses, one
/// sharing 85 reuses 80, and both answer as they do alone.
#[test]
fn a_long_prompt_checkpoints_only_its_last_positions() {
    let model = open("qwen3_next_a");
    let mut e = engine(&model, EngineKind::Pipeline, 0.5, 512);
    let vocab = model.config().vocab;
    let p: Vec<u32> = (0..120).map(|i| ((i * 37 + 11) % vocab) as u32).collect();
    let opts = BatchOptions { max_sequences: 2, step_tokens: 64, prefix_cache: 2, checkpoint_tokens: 8 };
    let mut b = Batcher::new(opts);
    // (prompt, tokens reused from the kept caches)
    let cases = [
        (p[..100].to_vec(), 0),
        (p[..70].iter().chain(&p[110..115]).copied().collect::<Vec<u32>>(), 0),
        (p[..85].iter().chain(&p[100..105]).copied().collect(), 80),
    ];
    for (prompt, reuse) in cases {
        let before = b.prefix_stats().reused_tokens;
        let opts = GenerationOptions { max_tokens: 3, ..Default::default() };
        b.add(e.as_mut(), &prompt, opts).unwrap().unwrap();
        let mut out = Vec::new();
        while !b.is_empty() {
            for ev in b.step(e.as_mut()) {
                match ev {
                    SeqEvent::Token(_, t) => out.push(t.id),
                    SeqEvent::Failed(_, err) => panic!("{err}"),
                    SeqEvent::Finished { .. } => {}
                }
            }
        }
        assert_eq!(out, generate_alone(e.as_mut(), &prompt, 3), "prompt of {}", prompt.len());
        let reused = (b.prefix_stats().reused_tokens - before) as usize;
        assert_eq!(reused, reuse, "prompt of {}: tokens reused", prompt.len());
    }
}

#[test]
fn a_prompt_that_continues_a_finished_one_reuses_its_cache_and_generates_the_same() {
    prefix_case(EngineKind::Pipeline);
    prefix_case(EngineKind::Reference);
}

#[test]
fn gpu_prefix_reuse_rewinds_recurrent_state_to_its_checkpoints() {
    if common::gpu_usable() {
        prefix_case(EngineKind::Gpu);
    }
}
