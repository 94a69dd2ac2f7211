//! [`TracedEngine`]: any engine with an [`ExpertTracer`] around its forward calls (`--trace
//! FILE` at the CLI). Everything else is the inner engine's; an engine built without a trace
//! is not wrapped, so tracing costs nothing unless asked for.

use super::{Engine, EngineError, EngineKind, KvCache, Logits};
use crate::actors::Exchange;
use crate::cache::hot_set::HotSet;
use crate::cache::perf::PerfState;
use crate::cache::trace::ExpertTracer;
use crate::model::config::ModelConfig;
use crate::moe::phase::Phase;

/// An engine whose forward calls are traced (one line per call and layer).
pub struct TracedEngine<'m> {
    inner: Box<dyn Engine + 'm>,
    tracer: ExpertTracer,
}

impl<'m> TracedEngine<'m> {
    pub fn new(inner: Box<dyn Engine + 'm>, tracer: ExpertTracer) -> TracedEngine<'m> {
        TracedEngine { inner, tracer }
    }

    fn traced(
        &mut self,
        tokens: &[u32],
        phase: Phase,
        call: impl FnOnce(&mut dyn Engine) -> Result<Logits, EngineError>,
    ) -> Result<Logits, EngineError> {
        self.tracer.before_call(self.inner.perf())?;
        let logits = call(self.inner.as_mut())?;
        self.tracer.after_call(self.inner.perf(), phase, tokens.len())?;
        Ok(logits)
    }
}

impl Engine for TracedEngine<'_> {
    fn kind(&self) -> EngineKind {
        self.inner.kind()
    }
    fn device(&self) -> String {
        self.inner.device()
    }
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn new_cache(&self, capacity: usize) -> Result<KvCache, EngineError> {
        self.inner.new_cache(capacity)
    }
    fn forward(&mut self, tokens: &[u32], phase: Phase, cache: &mut KvCache) -> Result<Logits, EngineError> {
        self.traced(tokens, phase, |e| e.forward(tokens, phase, cache))
    }
    fn forward_last(
        &mut self,
        tokens: &[u32],
        phase: Phase,
        cache: &mut KvCache,
    ) -> Result<Logits, EngineError> {
        self.traced(tokens, phase, |e| e.forward_last(tokens, phase, cache))
    }
    fn perf(&self) -> Option<&PerfState> {
        self.inner.perf()
    }
    fn perf_mut(&mut self) -> Option<&mut PerfState> {
        self.inner.perf_mut()
    }
    fn hot_set(&self) -> Option<&HotSet> {
        self.inner.hot_set()
    }
    fn hot_bytes(&self) -> u64 {
        self.inner.hot_bytes()
    }
    fn device_free_bytes(&self) -> Option<u64> {
        self.inner.device_free_bytes()
    }
    fn device_reports(&self) -> Vec<crate::gpu::DeviceReport> {
        self.inner.device_reports()
    }
    fn request_exchange(&self, exchange: Exchange) -> Result<(), EngineError> {
        self.inner.request_exchange(exchange)
    }
    fn apply_exchanges(&mut self) -> Result<usize, EngineError> {
        self.inner.apply_exchanges()
    }
    fn checkpoint(&self, cache: &mut KvCache) -> Result<bool, EngineError> {
        self.inner.checkpoint(cache)
    }
    fn rewind(&self, cache: &mut KvCache, n: usize) -> Result<bool, EngineError> {
        self.inner.rewind(cache, n)
    }
    fn set_copy_logits(&mut self, on: bool) {
        self.inner.set_copy_logits(on)
    }
    fn copies_logits(&self) -> bool {
        self.inner.copies_logits()
    }
    fn set_thread_report(&mut self, threads: crate::threads::ThreadReport) {
        self.inner.set_thread_report(threads)
    }
    fn set_perf_mode(&mut self, mode: crate::cache::perf::PerfMode) {
        self.inner.set_perf_mode(mode)
    }
    fn profile_report(&self) -> Option<String> {
        self.inner.profile_report()
    }
    fn reset_profile(&mut self) {
        self.inner.reset_profile()
    }
}
