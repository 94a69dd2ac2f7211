//! Sessions over the reference engine of a tiny synthetic model: temperature 0 is the engine's
//! greedy generation, seeds reproduce, stop ids and cancel end early, rows follow the need.

use super::*;
use crate::dtype::DType;
use crate::engine::{build_engine, EngineKind, EngineOptions, FinishReason};
use crate::model::Model;
use crate::synth::{tiny_test_options, write_synthetic, DimOverrides, Skew};
use std::sync::Arc;

fn model(dir: &std::path::Path) -> Arc<Model> {
    let out = dir.join("m.gguf");
    let opts = tiny_test_options(out.clone(), DimOverrides::default(), DType::F32, 11, Skew::Skewed);
    write_synthetic(&opts, &mut |_, _| {}).unwrap();
    Arc::new(Model::open(&out).unwrap())
}

fn engine(model: &Arc<Model>, kind: EngineKind) -> Box<dyn Engine + '_> {
    let mut opts = EngineOptions::new(64);
    opts.kind = Some(kind);
    opts.cold_threads = crate::threads::ColdThreads::Fixed(1);
    build_engine(model, opts).unwrap().0
}

fn run(e: &mut dyn Engine, prompt: &[u32], opts: GenerationOptions) -> (Vec<GeneratedToken>, FinishReason) {
    let mut g = Generation::new(e, prompt, opts).unwrap();
    let mut out = Vec::new();
    let why = g.run(|t| {
        out.push(t.clone());
        ControlFlow::Continue(())
    });
    (out, why.unwrap())
}

fn ids(t: &[GeneratedToken]) -> Vec<u32> {
    t.iter().map(|t| t.id).collect()
}

const PROMPT: [u32; 4] = [5, 77, 130, 9];

#[test]
fn temperature_zero_is_the_engines_greedy_generation() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    for kind in [EngineKind::Reference, EngineKind::Pipeline] {
        let mut e = engine(&m, kind);
        let want = e.generate(&PROMPT, 6).unwrap();
        let opts = GenerationOptions { max_tokens: 6, ..GenerationOptions::default() };
        let (got, why) = run(e.as_mut(), &PROMPT, opts);
        assert_eq!(ids(&got), want, "{kind}");
        assert_eq!(why, FinishReason::Length);
        assert!(got.iter().all(|t| t.logprobs.is_none()));
        assert!(got[0].at_us == got[0].step_us && got[5].at_us >= got[4].at_us);
    }
}

#[test]
fn seeded_sampling_reproduces_and_logprobs_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let mut e = engine(&m, EngineKind::Reference);
    let sampling =
        |seed| SamplingParams { temperature: 1.5, seed: Some(seed), logprobs: Some(3), ..Default::default() };
    let opts = |seed| GenerationOptions { max_tokens: 12, sampling: sampling(seed), ..Default::default() };
    let (a, _) = run(e.as_mut(), &PROMPT, opts(1));
    let (b, _) = run(e.as_mut(), &PROMPT, opts(1));
    let (c, _) = run(e.as_mut(), &PROMPT, opts(2));
    assert_eq!(ids(&a), ids(&b));
    assert_ne!(ids(&a), ids(&c), "another seed, other tokens (T = 1.5 over the synthetic vocabulary)");
    assert_ne!(ids(&a), e.generate(&PROMPT, 12).unwrap(), "sampling is not greedy");
    for t in &a {
        let lp = t.logprobs.as_ref().unwrap();
        assert_eq!(lp.chosen.id, t.id);
        assert!(lp.chosen.logprob <= 0.0 && lp.top.len() == 3);
        assert!(lp.top[0].logprob >= lp.chosen.logprob);
    }
}

#[test]
fn a_stop_id_ends_the_generation_without_being_returned() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let mut e = engine(&m, EngineKind::Reference);
    let greedy = e.generate(&PROMPT, 6).unwrap();
    let stop = greedy[3];
    let first = greedy.iter().position(|&t| t == stop).unwrap();
    let opts = GenerationOptions { max_tokens: 6, stop_ids: vec![stop], ..Default::default() };
    let (got, why) = run(e.as_mut(), &PROMPT, opts);
    assert_eq!(ids(&got), greedy[..first].to_vec());
    assert_eq!(why, FinishReason::Stop { token: stop });
}

#[test]
fn cancel_stops_and_bad_options_are_refused_before_work() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let mut e = engine(&m, EngineKind::Reference);
    let opts = GenerationOptions { max_tokens: 10, ..Default::default() };
    let mut g = Generation::new(e.as_mut(), &PROMPT, opts.clone()).unwrap();
    let mut n = 0;
    let why = g
        .run(|_| {
            n += 1;
            if n == 2 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })
        .unwrap();
    assert_eq!((why, g.generated_tokens()), (FinishReason::Cancelled, 2));
    assert!(g.next_token().unwrap().is_none());
    drop(g);
    let vocab = m.config().vocab as u32;
    let bad_stop = GenerationOptions { stop_ids: vec![vocab], ..opts.clone() };
    assert!(matches!(Generation::new(e.as_mut(), &PROMPT, bad_stop), Err(GenerationError::StopId { .. })));
    let bad_t = GenerationOptions {
        sampling: SamplingParams { temperature: -1.0, ..Default::default() },
        ..opts.clone()
    };
    let err = Generation::new(e.as_mut(), &PROMPT, bad_t).err().unwrap();
    assert!(err.to_string().starts_with("temperature = -1"), "{err}");
    let too_long = GenerationOptions { max_tokens: m.config().max_positions, ..opts };
    assert!(Generation::new(e.as_mut(), &PROMPT, too_long).is_err());
}

/// An engine that only gives rows when told to, like the GPU engine.
struct RowsOnRequest<'m> {
    inner: Box<dyn Engine + 'm>,
    copy: bool,
    calls_with_rows: usize,
}

impl Engine for RowsOnRequest<'_> {
    fn kind(&self) -> EngineKind {
        self.inner.kind()
    }
    fn device(&self) -> String {
        self.inner.device()
    }
    fn config(&self) -> &crate::model::config::ModelConfig {
        self.inner.config()
    }
    fn new_cache(&self, capacity: usize) -> Result<KvCache, EngineError> {
        self.inner.new_cache(capacity)
    }
    fn forward(&mut self, tokens: &[u32], phase: Phase, cache: &mut KvCache) -> Result<Logits, EngineError> {
        let mut l = self.inner.forward(tokens, phase, cache)?;
        if self.copy {
            self.calls_with_rows += 1;
        } else {
            l.data.clear();
        }
        Ok(l)
    }
    fn perf(&self) -> Option<&crate::cache::perf::PerfState> {
        None
    }
    fn hot_set(&self) -> Option<&crate::cache::hot_set::HotSet> {
        None
    }
    fn hot_bytes(&self) -> u64 {
        0
    }
    fn request_exchange(&self, _: crate::actors::Exchange) -> Result<(), EngineError> {
        Ok(())
    }
    fn apply_exchanges(&mut self) -> Result<usize, EngineError> {
        Ok(0)
    }
    fn set_copy_logits(&mut self, on: bool) {
        self.copy = on;
    }
    fn copies_logits(&self) -> bool {
        self.copy
    }
}

#[test]
fn sampling_turns_rows_on_for_the_session_and_greedy_keeps_them_off() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let mut e = RowsOnRequest { inner: engine(&m, EngineKind::Reference), copy: false, calls_with_rows: 0 };
    let greedy = GenerationOptions { max_tokens: 4, ..Default::default() };
    let (g, _) = run(&mut e, &PROMPT, greedy);
    assert_eq!((e.calls_with_rows, e.copy), (0, false), "greedy: the fast path");
    let sampled = GenerationOptions {
        max_tokens: 4,
        sampling: SamplingParams {
            temperature: 0.0,
            repetition_penalty: 1.0,
            logprobs: Some(1),
            ..Default::default()
        },
        ..Default::default()
    };
    let (s, _) = run(&mut e, &PROMPT, sampled);
    assert_eq!(ids(&g), ids(&s));
    assert_eq!((e.calls_with_rows, e.copy), (4, false), "rows for the session, setting restored");
    let gen = e.generation(&PROMPT, GenerationOptions { max_tokens: 1, ..Default::default() }).unwrap();
    assert_eq!(gen.prompt_tokens(), PROMPT.len());
}
