//! Continuous batching: many generations over one engine, one engine call per step. Every step
//! feeds each decoding sequence its pending token and fills the rest of the step's token budget
//! with prompt chunks of the sequences still prefilling (in arrival order), all in one
//! [`Engine::forward_batch`]; sequences join and leave between steps. A sequence's tokens are the
//! ones it would get alone (each sequence keeps its own cache, sampler and context; the
//! engines batch only their row-wise stages).

use super::generation::Sequence;
use super::KvCache;
use super::{
    BatchSeq, Engine, EngineError, FinishReason, GeneratedToken, GenerationError, GenerationOptions,
};
use crate::forward::Phase;
use crate::model::context::MAX_STATE_CHECKPOINTS;
use serde::Serialize;
use std::collections::VecDeque;
use std::time::Instant;

/// The default token budget of one step: prompt chunks fill it after the decode tokens.
pub const DEFAULT_STEP_TOKENS: usize = 512;

/// How a [`Batcher`] fills its steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BatchOptions {
    /// Most sequences running at once (the rest wait with their caller).
    pub max_sequences: usize,
    /// Most tokens in one step: one per decoding sequence, the rest prompt chunks (at least one
    /// prompt token per step while any sequence is prefilling, so prompts always progress).
    pub step_tokens: usize,
    /// Finished sequences' caches kept for prefix reuse (0: none): a new prompt that starts
    /// with one's tokens (a chat's earlier turns, a shared system prompt) takes that cache and
    /// skips the shared part of its prefill. Each kept cache holds its memory (VRAM on the GPU).
    /// A cache with recurrent (DeltaNet) state goes back only to a checkpoint of that state
    /// (below), so a prompt sharing part of it reuses up to the latest checkpoint in the part.
    #[serde(default)]
    pub prefix_cache: usize,
    /// With `prefix_cache`, a sequence with recurrent state checkpoints it (`Engine::checkpoint`)
    /// at its prompt's end and at the last multiples of this many positions before it (its
    /// prompt chunks cut there), `MAX_STATE_CHECKPOINTS` in all, the most a cache keeps; 0: at
    /// the prompt's end only.
    #[serde(default = "default_checkpoint_tokens")]
    pub checkpoint_tokens: usize,
}

/// [`BatchOptions::checkpoint_tokens`]'s default: a step's prompt budget, so a long prompt's
/// chunks are cut nowhere they would not be anyway. Cost: one copy of the recurrent state per
/// checkpoint (the GPU's to the host; a Qwen3.6-35B-A3B-shaped model about 63 MiB).
pub const DEFAULT_CHECKPOINT_TOKENS: usize = DEFAULT_STEP_TOKENS;

fn default_checkpoint_tokens() -> usize {
    DEFAULT_CHECKPOINT_TOKENS
}

/// [`BatchOptions::prefix_cache`]'s default.
pub const DEFAULT_PREFIX_CACHE: usize = 4;

impl Default for BatchOptions {
    fn default() -> Self {
        BatchOptions {
            max_sequences: 16,
            step_tokens: DEFAULT_STEP_TOKENS,
            prefix_cache: DEFAULT_PREFIX_CACHE,
            checkpoint_tokens: DEFAULT_CHECKPOINT_TOKENS,
        }
    }
}

/// Prefix reuse so far: lookups (sequences added while caches were kept), hits, and prompt
/// tokens whose prefill was skipped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PrefixStats {
    pub lookups: u64,
    pub hits: u64,
    pub reused_tokens: u64,
}

/// A sequence's handle in its [`Batcher`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

/// What a step did for one sequence.
#[derive(Debug)]
pub enum SeqEvent {
    /// Its next token.
    Token(SeqId, GeneratedToken),
    /// It ended (and left the batcher): `generated` tokens, and why.
    Finished { id: SeqId, finish: FinishReason, prompt_tokens: usize, generated: Vec<u32> },
    /// Its step failed (it left the batcher).
    Failed(SeqId, GenerationError),
}

/// What one step ran: its sequences, tokens and time (for step-time and batch-size metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepReport {
    pub sequences: usize,
    pub tokens: usize,
    pub prefill_tokens: usize,
    pub wall_us: u64,
}

/// Too many sequences for the batcher's `max_sequences`.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("the batcher runs at most {max_sequences} sequences at once")]
pub struct BatchFull {
    pub max_sequences: usize,
}

/// Many generations over one engine, stepped together.
pub struct Batcher {
    opts: BatchOptions,
    running: Vec<(SeqId, Sequence)>,
    next_id: u64,
    last: StepReport,
    /// Finished sequences' tokens and caches, newest first (prefix reuse).
    prefixes: VecDeque<(Vec<u32>, KvCache)>,
    prefix_stats: PrefixStats,
}

impl Batcher {
    pub fn new(opts: BatchOptions) -> Batcher {
        let opts = BatchOptions {
            max_sequences: opts.max_sequences.max(1),
            step_tokens: opts.step_tokens.max(1),
            ..opts
        };
        let prefixes = VecDeque::with_capacity(opts.prefix_cache);
        let prefix_stats = PrefixStats::default();
        Batcher { opts, running: Vec::new(), next_id: 0, last: StepReport::default(), prefixes, prefix_stats }
    }

    pub fn options(&self) -> BatchOptions {
        self.opts
    }

    /// Sequences running now.
    pub fn len(&self) -> usize {
        self.running.len()
    }

    pub fn is_empty(&self) -> bool {
        self.running.is_empty()
    }

    /// Whether another sequence may join.
    pub fn has_room(&self) -> bool {
        self.running.len() < self.opts.max_sequences
    }

    /// What the last step ran.
    pub fn last_step(&self) -> StepReport {
        self.last
    }

    /// Positions held by the running sequences' caches now.
    pub fn positions(&self) -> usize {
        self.running.iter().map(|(_, s)| s.cache.n_positions()).sum()
    }

    /// Positions the running sequences reserve (prompt + `max_tokens` each: their caches are
    /// allocated for it when they join and freed when they leave).
    pub fn reserved_positions(&self) -> usize {
        self.running.iter().map(|(_, s)| s.prompt_tokens() + s.opts.max_tokens).sum()
    }

    /// A new sequence: options and room in the context checked, its cache made; it runs from
    /// the next step. The outer error: no room (`max_sequences` running).
    pub fn add<E: Engine + ?Sized>(
        &mut self,
        engine: &E,
        prompt: &[u32],
        opts: GenerationOptions,
    ) -> Result<Result<SeqId, GenerationError>, BatchFull> {
        if !self.has_room() {
            return Err(BatchFull { max_sequences: self.opts.max_sequences });
        }
        let seq = match self.reuse_prefix(engine, prompt, &opts) {
            Some(cache) => Sequence::with_cache(engine, prompt, opts, cache),
            None => Sequence::new(engine, prompt, opts),
        };
        Ok(seq.map(|seq| {
            let id = SeqId(self.next_id);
            self.next_id += 1;
            self.running.push((id, seq));
            id
        }))
    }

    /// Prefix reuse so far.
    pub fn prefix_stats(&self) -> PrefixStats {
        self.prefix_stats
    }

    /// The kept cache sharing the longest reusable prefix with `prompt` (at most all but its
    /// last token, which must be fed for its logits; with recurrent state, up to its latest
    /// checkpoint there), rewound to that prefix, given room for the request
    /// ([`Engine::reserve`]) and taken out of the store. A cache whose rewind or growth fails on
    /// the device is dropped; one that cannot grow stays (a miss).
    fn reuse_prefix<E: Engine + ?Sized>(
        &mut self,
        engine: &E,
        prompt: &[u32],
        opts: &GenerationOptions,
    ) -> Option<KvCache> {
        if self.prefixes.is_empty() {
            return None;
        }
        self.prefix_stats.lookups += 1;
        let need = prompt.len().saturating_add(opts.max_tokens);
        let shared = |tokens: &[u32]| tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        let mut best: Option<(usize, usize)> = None;
        for (i, (tokens, cache)) in self.prefixes.iter().enumerate() {
            let reach = cache.rewind_point(shared(tokens).min(prompt.len() - 1)).unwrap_or(0);
            if reach > 0 && best.is_none_or(|(_, b)| reach > b) {
                best = Some((i, reach));
            }
        }
        let (i, n) = best?;
        let cache = &mut self.prefixes[i].1;
        match engine.rewind(cache, n).and_then(|done| Ok(done && engine.reserve(cache, need)?)) {
            Ok(true) => {}
            Ok(false) => return None,
            Err(_) => {
                self.prefixes.remove(i);
                return None;
            }
        }
        let (_, cache) = self.prefixes.remove(i)?;
        self.prefix_stats.hits += 1;
        self.prefix_stats.reused_tokens += n as u64;
        Some(cache)
    }

    /// Stop a sequence now (its caller went away): it leaves without a further event. Returns
    /// whether it was running.
    pub fn cancel(&mut self, id: SeqId) -> bool {
        let before = self.running.len();
        self.running.retain(|(i, _)| *i != id);
        self.running.len() != before
    }

    /// One engine call over every running sequence: decode tokens first, then prompt chunks
    /// within the step's token budget. Returns each sequence's token (if it chose one) and the
    /// sequences that ended. An engine error fails every sequence of the step.
    pub fn step<E: Engine + ?Sized>(&mut self, engine: &mut E) -> Vec<SeqEvent> {
        let mut events = Vec::new();
        self.finish_done(&mut events);
        if self.running.is_empty() {
            return events;
        }
        let picks = self.pick();
        let needs = picks.iter().any(|&(i, _)| self.running[i].1.needs_logits());
        if engine.copies_logits() != needs {
            engine.set_copy_logits(needs);
        }
        let start = Instant::now();
        let result = self.run(engine, &picks);
        let fed: Vec<usize> = picks.iter().map(|&(_, n)| n).collect();
        let prefilling: Vec<bool> = picks.iter().map(|&(i, _)| self.running[i].1.is_prefilling()).collect();
        let prefill_tokens = picks.iter().zip(&prefilling).filter(|(_, &p)| p).map(|(p, _)| p.1).sum();
        self.last = StepReport {
            sequences: picks.len(),
            tokens: fed.iter().sum(),
            prefill_tokens,
            wall_us: start.elapsed().as_micros() as u64,
        };
        match result {
            Ok(logits) => {
                let kind = engine.kind();
                for (row, &(i, n)) in picks.iter().enumerate() {
                    let (id, seq) = &mut self.running[i];
                    match seq.accept(n, &logits, row, kind) {
                        Ok(Some(t)) => events.push(SeqEvent::Token(*id, t)),
                        Ok(None) => {}
                        Err(e) => {
                            seq.cancel();
                            events.push(SeqEvent::Failed(*id, e));
                        }
                    }
                }
                self.checkpoint(engine, &picks, &prefilling, &mut events);
            }
            Err(e) => {
                let msg = e.to_string();
                for &(i, _) in &picks {
                    let (id, seq) = &mut self.running[i];
                    seq.cancel();
                    let err = EngineError::Step { message: msg.clone() };
                    events.push(SeqEvent::Failed(*id, err.into()));
                }
            }
        }
        self.finish_done(&mut events);
        events
    }

    /// Which sequences run this step and how many tokens each: every decoding one (one token),
    /// then prompt chunks in arrival order while the budget lasts (at least one token).
    fn pick(&self) -> Vec<(usize, usize)> {
        let mut picks: Vec<(usize, usize)> = Vec::new();
        for (i, (_, seq)) in self.running.iter().enumerate() {
            if let Some((_, Phase::Decode)) = seq.next_input(1) {
                picks.push((i, 1));
            }
        }
        let mut budget = self.opts.step_tokens.saturating_sub(picks.len()).max(1);
        for (i, (_, seq)) in self.running.iter().enumerate() {
            if budget == 0 {
                break;
            }
            if seq.is_prefilling() {
                let (chunk, _) = seq.next_input(self.to_checkpoint(seq, budget)).expect("prefilling");
                budget -= chunk.len();
                picks.push((i, chunk.len()));
            }
        }
        picks
    }

    /// Whether prompt chunks stop at recurrent-state checkpoints: kept prefixes and recurrent
    /// state.
    fn checkpoints(&self, seq: &Sequence) -> bool {
        self.opts.prefix_cache > 0 && seq.cache.has_recurrent()
    }

    /// The first checkpoint position after `at` within a prompt of `n_prompt` tokens, before
    /// its end (which always gets one): the multiples of `checkpoint_tokens`, but only the last
    /// `MAX_STATE_CHECKPOINTS - 1` of them, the ones a cache still keeps once the prompt's end is
    /// in (a long prompt's earlier ones would be copied only to be dropped).
    fn next_checkpoint(&self, at: usize, n_prompt: usize) -> Option<usize> {
        let every = self.opts.checkpoint_tokens;
        if every == 0 {
            return None;
        }
        let last = n_prompt.saturating_sub(1) / every * every;
        let first = last.saturating_sub((MAX_STATE_CHECKPOINTS - 2) * every).max(every);
        let next = (at / every + 1) * every;
        Some(next.max(first)).filter(|&b| b <= last)
    }

    /// `budget` for a prefilling sequence's next chunk, cut at its next checkpoint position.
    fn to_checkpoint(&self, seq: &Sequence, budget: usize) -> usize {
        if !self.checkpoints(seq) {
            return budget;
        }
        let at = seq.cache.n_positions();
        match self.next_checkpoint(at, seq.prompt_tokens()) {
            Some(b) => budget.min(b - at),
            None => budget,
        }
    }

    /// After a step: each sequence that was prefilling and has reached a checkpoint position
    /// (a multiple of `checkpoint_tokens`) or its prompt's end keeps its recurrent state; one
    /// whose checkpoint fails (the device) fails.
    fn checkpoint<E: Engine + ?Sized>(
        &mut self,
        engine: &E,
        picks: &[(usize, usize)],
        prefilling: &[bool],
        events: &mut Vec<SeqEvent>,
    ) {
        for (&(i, _), _) in picks.iter().zip(prefilling).filter(|(_, &p)| p) {
            let seq = &self.running[i].1;
            if !self.checkpoints(seq) {
                continue;
            }
            let at = seq.cache.n_positions();
            let boundary = at > 0 && self.next_checkpoint(at - 1, seq.prompt_tokens()) == Some(at);
            let due = boundary || !seq.is_prefilling();
            let (id, seq) = &mut self.running[i];
            if seq.finish == Some(FinishReason::Cancelled) || !due {
                continue;
            }
            if let Err(e) = engine.checkpoint(&mut seq.cache) {
                seq.cancel();
                events.push(SeqEvent::Failed(*id, e.into()));
            }
        }
    }

    /// The engine call of a step's picks, in pick order; the phase is prefill when any prompt
    /// chunk is in it.
    fn run<E: Engine + ?Sized>(
        &mut self,
        engine: &mut E,
        picks: &[(usize, usize)],
    ) -> Result<crate::forward::Logits, EngineError> {
        let phase = if picks.iter().any(|&(i, _)| self.running[i].1.is_prefilling()) {
            Phase::Prefill
        } else {
            Phase::Decode
        };
        let mut inputs: Vec<(Vec<u32>, usize)> = Vec::with_capacity(picks.len());
        for &(i, n) in picks {
            let seq = &mut self.running[i].1;
            seq.start_clock();
            let (tokens, _) = seq.next_input(n).expect("running");
            inputs.push((tokens.to_vec(), i));
        }
        // Each pick is a distinct sequence: hand out one `&mut` cache per pick, in pick order.
        let mut caches: Vec<Option<&mut super::KvCache>> =
            self.running.iter_mut().map(|(_, s)| Some(&mut s.cache)).collect();
        let mut seqs: Vec<BatchSeq<'_>> = inputs
            .iter()
            .map(|(tokens, i)| BatchSeq { tokens, cache: caches[*i].take().expect("one pick per sequence") })
            .collect();
        engine.forward_batch(&mut seqs, phase)
    }

    /// A finished sequence's cache kept for reuse (the oldest kept one dropped past the limit).
    fn keep_prefix(&mut self, seq: Sequence) {
        if self.opts.prefix_cache == 0 {
            return;
        }
        let (tokens, cache) = seq.into_prefix();
        if tokens.is_empty() {
            return;
        }
        self.prefixes.push_front((tokens, cache));
        self.prefixes.truncate(self.opts.prefix_cache);
    }

    /// Sequences that finished leave, with their `Finished` event.
    fn finish_done(&mut self, events: &mut Vec<SeqEvent>) {
        let mut i = 0;
        while i < self.running.len() {
            match self.running[i].1.finish {
                Some(finish) => {
                    let (id, seq) = self.running.remove(i);
                    if finish != FinishReason::Cancelled {
                        events.push(SeqEvent::Finished {
                            id,
                            finish,
                            prompt_tokens: seq.prompt_tokens(),
                            generated: seq.generated().to_vec(),
                        });
                        self.keep_prefix(seq);
                    }
                }
                None => i += 1,
            }
        }
    }
}

#[cfg(test)]
mod tests;
