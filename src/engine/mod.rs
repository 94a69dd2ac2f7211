//! The one engine interface. The reference oracle, the CPU lane pipeline and the GPU engine all
//! implement [`Engine`]: `forward(tokens, phase, cache)`, `generate`, perf state, hot-set
//! exchanges. The CLI dispatches once on [`EngineKind`]; the server and embedding services hold a
//! `Box<dyn Engine>`. [`build::build_engine`] turns typed options (engine, hot-cache budget or
//! fraction, learn counts, perf mode, faults) into an engine.

pub mod batch;
pub mod build;
mod cpu;
pub mod generation;
mod gpu;
mod gpu_devices;
pub mod live;
mod policy_worker;
mod traced;
pub mod tuning;
pub mod worker;

use crate::actors::Exchange;
use crate::cache::hot_set::{HotSet, HotSetError};
use crate::cache::perf::PerfState;
use crate::cache::planner::PlanError;
pub use crate::forward::Logits;
use crate::gpu::{GpuError, GpuKvCache};
use crate::model::config::ModelConfig;
use crate::model::context::StateCheckpoints;
use crate::moe::cold::ColdError;
use crate::moe::phase::Phase;
use crate::moe::pipeline::{PipelineCache, PipelineError};
use crate::reference::ForwardError;

pub use batch::{BatchOptions, Batcher, SeqEvent, SeqId, StepReport};
pub use build::{build_engine, BuildReport, EngineOptions, HotBudget, HotChoice, AUTO_BUDGET_RESERVE_BYTES};
pub use generation::{FinishReason, GeneratedToken, Generation, GenerationError, GenerationOptions};
pub use gpu::GpuEngine;
pub use live::{LiveCache, UpdateKind, UpdateOutcome};
pub use traced::TracedEngine;

/// Which engine runs a forward call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    /// The plain f32 oracle, one token at a time.
    Reference,
    /// The CPU lane pipeline (dense stage, hot lanes and cold pool on the CPU).
    Pipeline,
    /// Dense stage and hot lane on the GPU, cold lane on the CPU pool.
    Gpu,
}

impl EngineKind {
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Reference => "reference",
            EngineKind::Pipeline => "pipeline",
            EngineKind::Gpu => "gpu",
        }
    }
}

impl std::fmt::Display for EngineKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// An engine name that is not one of the three.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("unknown engine '{given}' (available: reference, pipeline, gpu)")]
pub struct UnknownEngine {
    pub given: String,
}

impl std::str::FromStr for EngineKind {
    type Err = UnknownEngine;
    fn from_str(s: &str) -> Result<EngineKind, UnknownEngine> {
        match s {
            "reference" => Ok(EngineKind::Reference),
            "pipeline" => Ok(EngineKind::Pipeline),
            "gpu" => Ok(EngineKind::Gpu),
            other => Err(UnknownEngine { given: other.to_string() }),
        }
    }
}

/// The KV cache of one session (sequence) of an engine.
pub enum KvCache {
    Reference(crate::reference::KvCache),
    Pipeline(PipelineCache),
    Gpu(GpuSessionCache),
}

/// The GPU engine's session cache: the device KV cache, the tokens it holds (so a session can
/// move to the CPU pipeline exactly if the device is lost), and the CPU cache once it has.
pub struct GpuSessionCache {
    pub(crate) kv: GpuKvCache,
    pub(crate) tokens: Vec<u32>,
    pub(crate) cpu: Option<PipelineCache>,
    /// The device's recurrent state at earlier positions, on the host (`GpuModel::read_recurrent`).
    pub(crate) checkpoints: StateCheckpoints<crate::gpu::RecurrentState>,
}

impl KvCache {
    pub fn n_positions(&self) -> usize {
        match self {
            KvCache::Reference(c) => c.n_positions(),
            KvCache::Pipeline(c) => c.n_positions(),
            KvCache::Gpu(c) => c.tokens.len(),
        }
    }

    /// Most positions it can hold (the GPU's is allocated for a session; the CPU caches grow).
    pub fn capacity(&self) -> usize {
        match self {
            KvCache::Gpu(c) => c.kv.capacity(),
            KvCache::Reference(_) | KvCache::Pipeline(_) => usize::MAX,
        }
    }

    /// Bytes its keys and values hold (the pipeline's as they grow, the GPU's as allocated: a
    /// paged GPU cache's pages committed so far); `None` for the oracle's.
    pub fn kv_bytes(&self) -> Option<usize> {
        match self {
            KvCache::Reference(_) => None,
            KvCache::Pipeline(c) => Some(c.kv_bytes()),
            KvCache::Gpu(c) => Some(c.kv.bytes()),
        }
    }

    /// Whether it holds recurrent (DeltaNet) state, which goes back only to its checkpoints.
    pub fn has_recurrent(&self) -> bool {
        match self {
            KvCache::Reference(c) => c.has_recurrent(),
            KvCache::Pipeline(c) => c.has_recurrent(),
            KvCache::Gpu(c) => c.kv.has_recurrent(),
        }
    }

    /// The most positions up to `n` that a rewind ([`Engine::rewind`]) can keep: `n`, or with
    /// recurrent state the latest checkpoint at or before it (none: no such checkpoint).
    pub fn rewind_point(&self, n: usize) -> Option<usize> {
        match self {
            KvCache::Reference(c) => c.rewind_point(n),
            KvCache::Pipeline(c) => c.rewind_point(n),
            KvCache::Gpu(c) => match c.cpu.as_ref() {
                Some(p) => p.rewind_point(n),
                None => c.checkpoints.reach(n, c.tokens.len(), c.kv.has_recurrent()),
            },
        }
    }

    /// Keep the first `n` positions: a cached prefix reused by a new request. False, changing
    /// nothing, when it cannot: `n` above what it holds, recurrent (DeltaNet) state without a
    /// checkpoint at `n` (the GPU's device state goes back through [`Engine::rewind`] only), or a
    /// sliding-window ring that no longer holds what position `n` sees (more than a call's
    /// `KV_RING_CHUNK_POSITIONS` back).
    pub fn truncate(&mut self, n: usize) -> bool {
        match self {
            KvCache::Reference(c) => c.truncate(n),
            KvCache::Pipeline(c) => c.truncate(n),
            KvCache::Gpu(c) => {
                let recurrent = c.cpu.is_none() && c.kv.has_recurrent();
                if n > c.tokens.len() || (recurrent && n != c.tokens.len()) {
                    return false;
                }
                // After a device loss the CPU copy serves; the device cache stays where it was.
                let kept = match c.cpu.as_mut() {
                    Some(p) => p.truncate(n),
                    None => c.kv.truncate(n),
                };
                if !kept {
                    return false;
                }
                if c.cpu.is_some() {
                    c.kv.truncate(n);
                }
                c.tokens.truncate(n);
                true
            }
        }
    }

    pub fn kind(&self) -> EngineKind {
        match self {
            KvCache::Reference(_) => EngineKind::Reference,
            KvCache::Pipeline(_) => EngineKind::Pipeline,
            KvCache::Gpu(_) => EngineKind::Gpu,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error(transparent)]
    HotSet(#[from] HotSetError),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(transparent)]
    Cold(#[from] ColdError),
    #[error(transparent)]
    Budget(#[from] build::BudgetError),
    #[error(transparent)]
    Update(#[from] crate::cache::update::UpdateError),
    #[error("a {cache} KV cache was given to the {engine} engine")]
    CacheKind { engine: EngineKind, cache: EngineKind },
    #[error("the {engine} engine has no hot cache to exchange experts in")]
    NoHotCache { engine: EngineKind },
    #[error("the GPU engine cannot run: {reason}")]
    NoGpu { reason: String },
    #[error(
        "the {engine} engine keeps its KV cache in f32 (it is the oracle); {asked} KV caches are supported by \
         the gpu and pipeline engines (pass --cache-type-k/--cache-type-v f32, or leave them out)"
    )]
    KvType { engine: EngineKind, asked: crate::model::context::KvType },
    #[error(transparent)]
    Updater(#[from] crate::actors::UpdaterError),
    #[error(transparent)]
    Trace(#[from] crate::cache::trace::TraceError),
    /// A batched step failed; each of its sequences hears why.
    #[error("the batched step failed: {message}")]
    Step { message: String },
}

/// What every engine does. Calls on one engine are sequential (`&mut self`); exchanges queued
/// with [`Engine::request_exchange`] apply between calls, never during one.
pub trait Engine {
    fn kind(&self) -> EngineKind;
    /// Where it runs, for reports ("cpu", or the GPU's name and architecture).
    fn device(&self) -> String;
    fn config(&self) -> &ModelConfig;
    /// A KV cache for one sequence of up to `capacity` positions.
    fn new_cache(&self, capacity: usize) -> Result<KvCache, EngineError>;
    /// Run `tokens` after what `cache` holds, in `phase` (decided by the caller, once per call).
    fn forward(&mut self, tokens: &[u32], phase: Phase, cache: &mut KvCache) -> Result<Logits, EngineError>;
    /// As [`Engine::forward`], but only the last token's logits row is needed (generation):
    /// engines that can skip the lm_head of the other rows do. Returns one row.
    fn forward_last(
        &mut self,
        tokens: &[u32],
        phase: Phase,
        cache: &mut KvCache,
    ) -> Result<Logits, EngineError> {
        Ok(self.forward(tokens, phase, cache)?.last_row())
    }
    /// One call over several sequences (continuous batching): each sequence's tokens run after
    /// what its cache holds, in `phase`; returns each sequence's last logits row, in order. Every
    /// sequence is checked before any cache changes. Engines that batch (the pipeline, the GPU)
    /// run the row-wise stages over all of the call's tokens at once, so a cold expert is
    /// computed once for every token routed to it; the default runs one call per sequence.
    fn forward_batch(&mut self, seqs: &mut [BatchSeq<'_>], phase: Phase) -> Result<Logits, EngineError> {
        check_batch(self.config(), seqs)?;
        let mut out = Logits::empty(self.config().vocab);
        for s in seqs.iter_mut() {
            out.append(self.forward_last(s.tokens, phase, s.cache)?);
        }
        Ok(out)
    }
    /// Perf state (counts, lane timings, fallbacks); `None` for the oracle.
    fn perf(&self) -> Option<&PerfState>;
    /// The perf state, to record what the updater did (`None` for the oracle).
    fn perf_mut(&mut self) -> Option<&mut PerfState> {
        None
    }
    /// Which experts are hot; `None` for the oracle.
    fn hot_set(&self) -> Option<&HotSet>;
    /// Bytes held by the hot cache (VRAM on the GPU, RAM copies on the CPU pipeline).
    fn hot_bytes(&self) -> u64;
    /// Free device memory in bytes, where the engine has a device that can tell (the GPU).
    fn device_free_bytes(&self) -> Option<u64> {
        None
    }
    /// Per GPU the engine runs on: its layers, dense and hot bytes, cached experts (none
    /// without a GPU).
    fn device_reports(&self) -> Vec<crate::gpu::DeviceReport> {
        Vec::new()
    }
    /// Queue an exchange for the Updater; it applies before the next call.
    fn request_exchange(&self, exchange: Exchange) -> Result<(), EngineError>;
    /// Apply every queued exchange now (between calls). Returns how many were applied.
    fn apply_exchanges(&mut self) -> Result<usize, EngineError>;
    /// Keep `cache`'s recurrent (DeltaNet) state at its current position, so that a later
    /// [`Engine::rewind`] can go back there (prefix reuse); false where nothing was kept (no
    /// recurrent state, or a checkpoint there already).
    fn checkpoint(&self, cache: &mut KvCache) -> Result<bool, EngineError> {
        Ok(match cache {
            KvCache::Reference(c) => c.checkpoint(),
            KvCache::Pipeline(c) => c.checkpoint(),
            KvCache::Gpu(_) => false,
        })
    }
    /// Cut `cache` back to its first `n` positions (a kept prefix reused), its recurrent state
    /// from the checkpoint at `n` ([`KvCache::rewind_point`]); false, changing nothing, where it
    /// cannot ([`KvCache::truncate`]).
    fn rewind(&self, cache: &mut KvCache, n: usize) -> Result<bool, EngineError> {
        Ok(cache.truncate(n))
    }
    /// Make room in `cache` for `capacity` positions, keeping what it holds (a kept prefix
    /// taken by a longer request); false where it cannot grow. The CPU engines' caches grow as
    /// they fill; the GPU's, allocated for a request, move into a larger allocation.
    fn reserve(&self, cache: &mut KvCache, capacity: usize) -> Result<bool, EngineError> {
        Ok(cache.capacity() >= capacity)
    }
    /// Whether forward calls copy logits rows back (default on); off: only greedy tokens.
    fn set_copy_logits(&mut self, _on: bool) {}
    /// Whether forward calls copy logits rows back now (the CPU engines always do).
    fn copies_logits(&self) -> bool {
        true
    }
    /// Record the thread counts the engine was built with in its perf state (the perf JSON).
    fn set_thread_report(&mut self, _threads: crate::threads::ThreadReport) {}
    /// Switch the perf mode between calls (engines without perf state ignore it).
    fn set_perf_mode(&mut self, _mode: crate::cache::perf::PerfMode) {}
    /// The per-stage GPU profile, when the engine records one.
    fn profile_report(&self) -> Option<String> {
        None
    }
    /// Start the per-stage profile over (after a warm-up, say).
    fn reset_profile(&mut self) {}

    /// A [`Generation`] session: sampled or greedy, token by token, with stop ids and timing.
    fn generation(
        &mut self,
        prompt: &[u32],
        opts: GenerationOptions,
    ) -> Result<Generation<'_, Self>, GenerationError>
    where
        Self: Sized,
    {
        Generation::new(self, prompt, opts)
    }

    /// Greedy generation from a fresh cache: prefill `prompt` (Prefill), then decode `n_new`
    /// tokens one at a time (Decode).
    fn generate(&mut self, prompt: &[u32], n_new: usize) -> Result<Vec<u32>, EngineError> {
        crate::reference::check_generation_fits(prompt.len(), n_new, self.config().max_positions)?;
        let mut cache = self.new_cache(prompt.len() + n_new)?;
        let mut out = Vec::with_capacity(n_new);
        if n_new == 0 {
            return Ok(out);
        }
        let mut next =
            *self.forward_last(prompt, Phase::Prefill, &mut cache)?.argmax.last().expect("one row");
        out.push(next);
        while out.len() < n_new {
            next = self.forward(&[next], Phase::Decode, &mut cache)?.argmax[0];
            out.push(next);
        }
        Ok(out)
    }
}

/// One sequence of a batched forward call ([`Engine::forward_batch`]).
pub struct BatchSeq<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut KvCache,
}

/// What every engine checks of a batched call before it runs: each sequence has tokens, in
/// the vocabulary, with room in the model's context.
pub fn check_batch(config: &ModelConfig, seqs: &[BatchSeq<'_>]) -> Result<(), EngineError> {
    for s in seqs {
        let at = s.cache.n_positions();
        if s.tokens.is_empty() {
            return Err(ForwardError::EmptyInput.into());
        }
        if let Some((i, &token)) = s.tokens.iter().enumerate().find(|(_, &t)| t as usize >= config.vocab) {
            return Err(ForwardError::TokenOutOfRange { token, position: at + i, vocab: config.vocab }.into());
        }
        if at + s.tokens.len() > config.max_positions {
            return Err(ForwardError::ContextFull { max_positions: config.max_positions }.into());
        }
    }
    Ok(())
}

fn wrong_cache(engine: EngineKind, cache: &KvCache) -> EngineError {
    EngineError::CacheKind { engine, cache: cache.kind() }
}
