//! The two CPU engines behind [`Engine`]: the reference oracle and the lane pipeline.

use super::{check_batch, wrong_cache, BatchSeq, Engine, EngineError, EngineKind, KvCache, Logits};
use crate::actors::Exchange;
use crate::cache::hot_set::HotSet;
use crate::cache::perf::PerfState;
use crate::model::config::ModelConfig;
use crate::moe::phase::Phase;
use crate::moe::pipeline::{LogitRows, Pipeline, SeqInput};
use crate::reference::{NoObserver, Reference};

/// The oracle as an engine: every phase is one token at a time; no hot cache, no perf state.
pub struct ReferenceEngine<'m> {
    reference: Reference<'m>,
    config: ModelConfig,
}

impl<'m> ReferenceEngine<'m> {
    pub fn new(reference: Reference<'m>, config: ModelConfig) -> ReferenceEngine<'m> {
        ReferenceEngine { reference, config }
    }
}

impl Engine for ReferenceEngine<'_> {
    fn kind(&self) -> EngineKind {
        EngineKind::Reference
    }
    fn device(&self) -> String {
        "cpu".into()
    }
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn new_cache(&self, _capacity: usize) -> Result<KvCache, EngineError> {
        Ok(KvCache::Reference(self.reference.new_cache()))
    }
    fn forward(&mut self, tokens: &[u32], _phase: Phase, cache: &mut KvCache) -> Result<Logits, EngineError> {
        let KvCache::Reference(c) = cache else { return Err(wrong_cache(self.kind(), cache)) };
        let rows = self.reference.forward(c, tokens, &mut NoObserver)?;
        Ok(Logits::from_rows(rows, self.config.vocab))
    }
    fn perf(&self) -> Option<&PerfState> {
        None
    }
    fn hot_set(&self) -> Option<&HotSet> {
        None
    }
    fn hot_bytes(&self) -> u64 {
        0
    }
    fn request_exchange(&self, _exchange: Exchange) -> Result<(), EngineError> {
        Err(EngineError::NoHotCache { engine: self.kind() })
    }
    fn apply_exchanges(&mut self) -> Result<usize, EngineError> {
        Ok(0)
    }
}

impl Engine for Pipeline {
    fn kind(&self) -> EngineKind {
        EngineKind::Pipeline
    }
    fn profile_report(&self) -> Option<String> {
        Pipeline::profile_report(self)
    }
    fn reset_profile(&mut self) {
        Pipeline::reset_profile(self)
    }
    fn device(&self) -> String {
        "cpu".into()
    }
    fn config(&self) -> &ModelConfig {
        Pipeline::config(self)
    }
    fn new_cache(&self, _capacity: usize) -> Result<KvCache, EngineError> {
        Ok(KvCache::Pipeline(Pipeline::new_cache(self)))
    }
    fn forward(&mut self, tokens: &[u32], phase: Phase, cache: &mut KvCache) -> Result<Logits, EngineError> {
        timed_forward(self, tokens, phase, cache, LogitRows::All)
    }
    fn forward_last(
        &mut self,
        tokens: &[u32],
        phase: Phase,
        cache: &mut KvCache,
    ) -> Result<Logits, EngineError> {
        timed_forward(self, tokens, phase, cache, LogitRows::Last)
    }
    fn forward_batch(&mut self, seqs: &mut [BatchSeq<'_>], phase: Phase) -> Result<Logits, EngineError> {
        check_batch(Pipeline::config(self), seqs)?;
        let kind = self.kind();
        let mut inputs = Vec::with_capacity(seqs.len());
        for s in seqs.iter_mut() {
            let KvCache::Pipeline(c) = &mut *s.cache else { return Err(wrong_cache(kind, s.cache)) };
            inputs.push(SeqInput { cache: c, tokens: s.tokens });
        }
        let n_tokens = inputs.iter().map(|s| s.tokens.len()).sum();
        let before = Pipeline::perf(self).lane_snapshot();
        let start = std::time::Instant::now();
        let rows = self.forward_many(&mut inputs, phase, LogitRows::Last)?;
        let wall_us = start.elapsed().as_micros() as u64;
        self.perf_mut().record_call(phase.name(), n_tokens, wall_us, &before);
        Ok(Logits::from_rows(rows, Pipeline::config(self).vocab))
    }
    fn perf(&self) -> Option<&PerfState> {
        Some(Pipeline::perf(self))
    }
    fn perf_mut(&mut self) -> Option<&mut PerfState> {
        Some(Pipeline::perf_mut(self))
    }
    fn set_perf_mode(&mut self, mode: crate::cache::perf::PerfMode) {
        self.perf_mut().set_mode(mode);
    }
    fn set_thread_report(&mut self, threads: crate::threads::ThreadReport) {
        self.perf_mut().set_threads(threads);
    }
    fn hot_set(&self) -> Option<&HotSet> {
        Some(Pipeline::hot_set(self))
    }
    fn hot_bytes(&self) -> u64 {
        let layers = Pipeline::hot_set(self).layers.iter().enumerate();
        layers.map(|(i, l)| (l.n_hot() * self.model().expert_bytes_of_layer(i)) as u64).sum()
    }
    fn request_exchange(&self, exchange: Exchange) -> Result<(), EngineError> {
        Ok(self.updater().request(exchange)?)
    }
    fn apply_exchanges(&mut self) -> Result<usize, EngineError> {
        Ok(self.apply_pending_exchanges()?)
    }
}

/// One pipeline call, recorded in the perf state's per-phase section (wall time and the lane
/// share of it) whichever logits rows it computes, so `plan`'s cost model sees every call.
fn timed_forward(
    p: &mut Pipeline,
    tokens: &[u32],
    phase: Phase,
    cache: &mut KvCache,
    rows: LogitRows,
) -> Result<Logits, EngineError> {
    let KvCache::Pipeline(c) = cache else { return Err(wrong_cache(p.kind(), cache)) };
    let before = Pipeline::perf(p).lane_snapshot();
    let start = std::time::Instant::now();
    let rows = Pipeline::forward_rows(p, c, tokens, phase, rows)?;
    let wall_us = start.elapsed().as_micros() as u64;
    p.perf_mut().record_call(phase.name(), tokens.len(), wall_us, &before);
    let logits_start = std::time::Instant::now();
    let logits = Logits::from_rows(rows, p.config().vocab);
    p.profile_logits_us(logits_start.elapsed().as_secs_f64() * 1e6);
    Ok(logits)
}
