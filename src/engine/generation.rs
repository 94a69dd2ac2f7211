//! A generation session: prefill a prompt, then hand back one token per call, chosen by a
//! [`Sampler`], until `max_tokens`, a stop id, or the caller stops asking (cancel = stop calling
//! [`Generation::next_token`], or return `ControlFlow::Break` from [`Generation::run`]).
//!
//! Greedy generation without logprobs or penalties keeps the engine's fast path (only the
//! greedy ids come back); anything else turns on the logits rows for the session and restores
//! the engine's setting when the session ends.

use super::{Engine, EngineError, KvCache, Logits};
use crate::moe::phase::Phase;
use crate::sample::{Logprobs, Sampler, SamplingError, SamplingParams};
use std::ops::ControlFlow;
use std::time::Instant;

/// What to generate.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GenerationOptions {
    /// Most tokens to generate (a stop id ends sooner).
    pub max_tokens: usize,
    /// Tokens that end the generation (EOS, end-of-turn); the stop token is not returned.
    pub stop_ids: Vec<u32>,
    pub sampling: SamplingParams,
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// `max_tokens` were generated.
    Length,
    /// A stop id was chosen.
    Stop { token: u32 },
    /// The caller stopped it.
    Cancelled,
}

impl FinishReason {
    /// OpenAI's `finish_reason`.
    pub fn openai(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop { .. } | FinishReason::Cancelled => "stop",
        }
    }
}

/// One generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct GeneratedToken {
    pub id: u32,
    /// Present when the sampling parameters ask for logprobs.
    pub logprobs: Option<Logprobs>,
    /// Time from the start of the session (prefill included) to this token: the first token's
    /// is the time to first token.
    pub at_us: u64,
    /// Time since the previous token (the first token's equals `at_us`): inter-token latency.
    pub step_us: u64,
}

/// Bad generation options (checked before any work).
#[derive(Debug, thiserror::Error)]
pub enum GenerationError {
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("stop id {id} is not below the vocabulary size {vocab}")]
    StopId { id: u32, vocab: usize },
    #[error("the {engine} engine returned no logits rows, which sampling needs")]
    NoLogits { engine: super::EngineKind },
}

/// One sequence's generation state, apart from the engine that runs it: its cache, sampler,
/// context and progress. [`Generation`] drives one over an engine; the batcher
/// ([`super::batch::Batcher`]) drives many through one engine call per step.
pub(super) struct Sequence {
    pub(super) cache: KvCache,
    sampler: Sampler,
    pub(super) opts: GenerationOptions,
    /// Prompt and generated tokens (the penalties' window).
    context: Vec<u32>,
    n_prompt: usize,
    /// Prompt tokens fed to the engine so far (chunked prefill).
    prefilled: usize,
    /// The last chosen token, not yet fed to the engine.
    pending: Option<u32>,
    n_generated: usize,
    pub(super) finish: Option<FinishReason>,
    started: Instant,
    last: Instant,
}

impl Sequence {
    /// The options and that prompt + `max_tokens` fits, checked; the sampler they ask for.
    pub(super) fn check<E: Engine + ?Sized>(
        engine: &E,
        prompt: &[u32],
        opts: &GenerationOptions,
    ) -> Result<Sampler, GenerationError> {
        let vocab = engine.config().vocab;
        if let Some(&id) = opts.stop_ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(GenerationError::StopId { id, vocab });
        }
        if prompt.is_empty() {
            return Err(EngineError::from(crate::forward::ForwardError::EmptyInput).into());
        }
        let sampler = Sampler::new(opts.sampling.clone())?;
        crate::reference::check_generation_fits(prompt.len(), opts.max_tokens, engine.config().max_positions)
            .map_err(EngineError::from)?;
        Ok(sampler)
    }

    /// Check the options and that prompt + `max_tokens` fits; a cache for it from `engine`.
    pub(super) fn new<E: Engine + ?Sized>(
        engine: &E,
        prompt: &[u32],
        opts: GenerationOptions,
    ) -> Result<Sequence, GenerationError> {
        let sampler = Sequence::check(engine, prompt, &opts)?;
        let cache = engine.new_cache(prompt.len() + opts.max_tokens)?;
        Ok(Sequence::start(sampler, prompt, opts, cache))
    }

    /// As [`Sequence::new`], over `cache`, which holds the first `cache.n_positions()` prompt
    /// tokens already (a reused prefix: at most all but the last prompt token) and has room for
    /// the rest and `max_tokens`.
    pub(super) fn with_cache<E: Engine + ?Sized>(
        engine: &E,
        prompt: &[u32],
        opts: GenerationOptions,
        cache: KvCache,
    ) -> Result<Sequence, GenerationError> {
        let sampler = Sequence::check(engine, prompt, &opts)?;
        assert!(cache.n_positions() < prompt.len(), "a reused prefix leaves the last prompt token to feed");
        assert!(cache.capacity() >= prompt.len() + opts.max_tokens, "the cache has room");
        Ok(Sequence::start(sampler, prompt, opts, cache))
    }

    /// A checked sequence over `cache` (empty, or holding a reused prefix of the prompt).
    fn start(sampler: Sampler, prompt: &[u32], opts: GenerationOptions, cache: KvCache) -> Sequence {
        let reused = cache.n_positions();
        let now = Instant::now();
        Sequence {
            cache,
            sampler,
            context: prompt.to_vec(),
            n_prompt: prompt.len(),
            prefilled: reused,
            pending: None,
            n_generated: 0,
            finish: if opts.max_tokens == 0 { Some(FinishReason::Length) } else { None },
            opts,
            started: now,
            last: now,
        }
    }

    /// Whether its prompt is still going in (not finished, no token chosen yet).
    pub(super) fn is_prefilling(&self) -> bool {
        self.finish.is_none() && self.pending.is_none()
    }

    /// Whether this sequence's logits rows must come back (sampling, logprobs).
    pub(super) fn needs_logits(&self) -> bool {
        self.opts.sampling.needs_logits()
    }

    /// The tokens of its next engine call, at most `budget` of the prompt (decode: the one
    /// pending token), and whether they are prompt tokens; `None` once finished.
    pub(super) fn next_input(&self, budget: usize) -> Option<(&[u32], Phase)> {
        if self.finish.is_some() {
            return None;
        }
        match self.pending {
            Some(_) => Some((&self.context[self.context.len() - 1..], Phase::Decode)),
            None => {
                let end = self.n_prompt.min(self.prefilled + budget.max(1));
                Some((&self.context[self.prefilled..end], Phase::Prefill))
            }
        }
    }

    /// The engine ran `fed` tokens of [`Sequence::next_input`]; `logits` holds their last row
    /// at `row`. Returns the chosen token once the prompt is done (`None` after a prompt chunk
    /// that is not the last, or when the chosen token is a stop id).
    pub(super) fn accept(
        &mut self,
        fed: usize,
        logits: &Logits,
        row: usize,
        engine: super::EngineKind,
    ) -> Result<Option<GeneratedToken>, GenerationError> {
        if self.pending.take().is_none() {
            self.prefilled += fed;
            if self.prefilled < self.n_prompt {
                return Ok(None);
            }
        }
        let (id, logprobs) = self.choose(logits, row, engine)?;
        let now = Instant::now();
        let token = GeneratedToken {
            id,
            logprobs,
            at_us: (now - self.started).as_micros() as u64,
            step_us: (now - if self.n_generated == 0 { self.started } else { self.last }).as_micros() as u64,
        };
        self.last = now;
        if self.opts.stop_ids.contains(&id) {
            self.finish = Some(FinishReason::Stop { token: id });
            return Ok(None);
        }
        self.context.push(id);
        self.n_generated += 1;
        if self.n_generated == self.opts.max_tokens {
            self.finish = Some(FinishReason::Length);
        } else {
            self.pending = Some(id);
        }
        Ok(Some(token))
    }

    /// Start the clock of the first token now, when the first prompt tokens go to the engine
    /// (no-op after that).
    pub(super) fn start_clock(&mut self) {
        if self.prefilled == 0 && self.pending.is_none() {
            self.started = Instant::now();
        }
    }

    fn choose(
        &mut self,
        logits: &Logits,
        row: usize,
        engine: super::EngineKind,
    ) -> Result<(u32, Option<Logprobs>), GenerationError> {
        if !self.opts.sampling.needs_logits() {
            return Ok((logits.argmax[row], None));
        }
        if logits.data.len() < logits.n_rows * logits.vocab {
            return Err(GenerationError::NoLogits { engine });
        }
        let r = logits.row(row);
        let id = self.sampler.sample(r, &self.context);
        Ok((id, self.sampler.logprobs(r, id)))
    }

    /// Stop now.
    pub(super) fn cancel(&mut self) {
        if self.finish.is_none() {
            self.finish = Some(FinishReason::Cancelled);
        }
    }

    pub(super) fn prompt_tokens(&self) -> usize {
        self.n_prompt
    }

    pub(super) fn generated_tokens(&self) -> usize {
        self.n_generated
    }

    pub(super) fn generated(&self) -> &[u32] {
        &self.context[self.n_prompt..]
    }

    /// Its cache and the tokens the cache holds (the context but the last chosen token, which
    /// was not fed), for reuse as a prefix.
    pub(super) fn into_prefix(self) -> (Vec<u32>, KvCache) {
        let mut tokens = self.context;
        tokens.truncate(self.cache.n_positions());
        (tokens, self.cache)
    }
}

/// A running generation over one engine and one KV cache.
pub struct Generation<'e, E: Engine + ?Sized> {
    engine: &'e mut E,
    seq: Sequence,
    restore_copy_logits: Option<bool>,
}

impl<'e, E: Engine + ?Sized> Generation<'e, E> {
    /// Check the options and that prompt + `max_tokens` fits; nothing runs until the first
    /// [`next_token`](Self::next_token).
    pub fn new(engine: &'e mut E, prompt: &[u32], opts: GenerationOptions) -> Result<Self, GenerationError> {
        let seq = Sequence::new(&*engine, prompt, opts)?;
        let needs = seq.needs_logits();
        let restore_copy_logits = (engine.copies_logits() != needs).then(|| engine.copies_logits());
        engine.set_copy_logits(needs);
        Ok(Generation { engine, seq, restore_copy_logits })
    }

    /// The next token, or `None` once finished (see [`finish_reason`](Self::finish_reason)).
    pub fn next_token(&mut self) -> Result<Option<GeneratedToken>, GenerationError> {
        let Some((input, phase)) = self.seq.next_input(usize::MAX) else { return Ok(None) };
        let input = input.to_vec();
        self.seq.start_clock();
        let logits = match phase {
            Phase::Decode => self.engine.forward(&input, phase, &mut self.seq.cache)?,
            _ => self.engine.forward_last(&input, phase, &mut self.seq.cache)?,
        };
        let last = logits.n_rows.checked_sub(1).expect("one row per token");
        let kind = self.engine.kind();
        self.seq.accept(input.len(), &logits, last, kind)
    }

    /// Generate until the end, handing each token to `on_token`; `Break` cancels.
    pub fn run(
        &mut self,
        mut on_token: impl FnMut(&GeneratedToken) -> ControlFlow<()>,
    ) -> Result<FinishReason, GenerationError> {
        while let Some(t) = self.next_token()? {
            if on_token(&t).is_break() {
                self.cancel();
            }
        }
        Ok(self.seq.finish.expect("set when next_token returns None"))
    }

    /// Stop now; later calls return `None`.
    pub fn cancel(&mut self) {
        self.seq.cancel();
    }

    /// `None` while running.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.seq.finish
    }

    pub fn prompt_tokens(&self) -> usize {
        self.seq.prompt_tokens()
    }

    pub fn generated_tokens(&self) -> usize {
        self.seq.generated_tokens()
    }

    /// The generated ids so far.
    pub fn generated(&self) -> &[u32] {
        self.seq.generated()
    }

    /// The engine, between tokens (to switch its perf mode, say). Exchanges and forward calls
    /// made here do not touch this session's cache.
    pub fn engine_mut(&mut self) -> &mut E {
        self.engine
    }

    /// The session's cache (prompt and generated tokens except the last, which was not fed).
    pub fn cache(&self) -> &KvCache {
        &self.seq.cache
    }
}

impl<E: Engine + ?Sized> Drop for Generation<'_, E> {
    fn drop(&mut self) {
        if let Some(on) = self.restore_copy_logits {
            self.engine.set_copy_logits(on);
        }
    }
}

#[cfg(test)]
mod tests;
