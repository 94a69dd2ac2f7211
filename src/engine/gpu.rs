//! The GPU engine behind [`Engine`]: [`GpuModel`] (dense stage and hot lane on the GPU) with the
//! SIMD pool as its cold lane, the Updater's exchanges applied between calls, and the CPU
//! pipeline standing by: when the device fails mid-session the session's tokens are replayed on
//! the pipeline and every later call runs there, counted as `gpu_lost` fallbacks.

use super::{
    check_batch, wrong_cache, BatchSeq, Engine, EngineError, EngineKind, GpuSessionCache, KvCache, Logits,
};
use crate::actors::{apply_exchanges, Exchange, UpdaterHandle};
use crate::cache::hot_set::HotSet;
use crate::cache::perf::{FallbackReason, PerfState};
use crate::gpu::{GpuError, GpuModel, GpuSeqInput};
use crate::model::config::ModelConfig;
use crate::model::Model;
use crate::moe::phase::Phase;
use crate::moe::pipeline::{LogitRows, Pipeline, PipelineError, PipelineOptions};
use crate::moe::pool_lane::PoolColdLane;
use std::sync::Arc;

pub struct GpuEngine {
    model: Arc<Model>,
    gpu: GpuModel,
    cold: PoolColdLane,
    updater: UpdaterHandle,
    /// Set once the device failed: every call runs here from then on.
    cpu: Option<Pipeline>,
    /// The device's error that moved the engine to the CPU pipeline (each call there counts a
    /// `gpu_lost` fallback with it).
    lost: Option<String>,
    cold_threads: usize,
}

impl GpuEngine {
    pub fn new(model: Arc<Model>, gpu: GpuModel, cold: PoolColdLane) -> Result<GpuEngine, EngineError> {
        let updater = UpdaterHandle::start().map_err(|e| PipelineError::Setup(format!("updater: {e}")))?;
        let cold_threads = cold.n_threads();
        Ok(GpuEngine { model, gpu, cold, updater, cpu: None, lost: None, cold_threads })
    }

    pub fn gpu(&self) -> &GpuModel {
        &self.gpu
    }

    pub fn gpu_mut(&mut self) -> &mut GpuModel {
        &mut self.gpu
    }

    pub fn cold(&self) -> &PoolColdLane {
        &self.cold
    }

    /// The device failed: from now on the CPU pipeline serves this engine.
    pub fn device_lost(&self) -> bool {
        self.cpu.is_some()
    }

    /// The device failed with `error`: the CPU pipeline takes every call from now on (the
    /// error kept for the fallbacks it counts).
    fn lose_device(&mut self, error: &GpuError) -> Result<(), EngineError> {
        self.lost = Some(error.to_string());
        let opts = PipelineOptions {
            n_cold_workers: self.cold_threads,
            activations: Some(self.cold.lane.activations()),
            // The GPU cache's type: the replayed session keeps its bytes (and its rounding).
            kv_type: self.gpu.kv_type(),
            ..PipelineOptions::default()
        };
        self.cpu = Some(Pipeline::new(self.model.clone(), opts)?);
        Ok(())
    }

    /// One call on the GPU (or, once the device is lost, on the CPU pipeline), with the lm_head
    /// for `rows` only.
    fn forward_rows(
        &mut self,
        tokens: &[u32],
        phase: Phase,
        cache: &mut KvCache,
        rows: LogitRows,
    ) -> Result<Logits, EngineError> {
        let KvCache::Gpu(c) = cache else { return Err(wrong_cache(self.kind(), cache)) };
        if self.cpu.is_none() {
            self.apply_exchanges()?;
            let before = self.gpu.perf().lane_snapshot();
            let start = std::time::Instant::now();
            match self.gpu.forward_rows(tokens, phase, &mut c.kv, &mut self.cold, rows) {
                Ok(logits) => {
                    let wall_us = start.elapsed().as_micros() as u64;
                    self.gpu.perf_mut().record_call(phase.name(), tokens.len(), wall_us, &before);
                    c.tokens.extend_from_slice(tokens);
                    return Ok(logits);
                }
                Err(e) if e.is_device_loss() => self.lose_device(&e)?,
                Err(e) => return Err(e.into()),
            }
        }
        self.forward_cpu(tokens, phase, c, rows)
    }

    /// Run on the CPU pipeline, first replaying the session's tokens into its own cache.
    fn forward_cpu(
        &mut self,
        tokens: &[u32],
        phase: Phase,
        c: &mut GpuSessionCache,
        rows: LogitRows,
    ) -> Result<Logits, EngineError> {
        let pipeline = self.cpu.as_mut().expect("device lost");
        if c.cpu.is_none() {
            let mut pc = pipeline.new_cache();
            if !c.tokens.is_empty() {
                Pipeline::forward(pipeline, &mut pc, &c.tokens, Phase::Prefill)?;
            }
            c.cpu = Some(pc);
        }
        let logits = pipeline.forward_rows(c.cpu.as_mut().expect("set above"), tokens, phase, rows)?;
        c.tokens.extend_from_slice(tokens);
        let perf = self.gpu.perf_mut();
        let lost = self.lost.as_deref().unwrap_or("the device failed");
        for l in 0..self.model.config().n_layers {
            perf.record_fallback(l, FallbackReason::GpuLost, lost);
        }
        Ok(Logits::from_rows(logits, self.model.config().vocab))
    }
}

impl Engine for GpuEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::Gpu
    }
    /// The GPU's name and architecture; a model split over GPUs names each, in layer order.
    fn device(&self) -> String {
        let names = self.gpu.backends().map(|be| format!("{} ({})", be.info().name, be.info().arch()));
        names.collect::<Vec<_>>().join(" + ")
    }
    fn config(&self) -> &ModelConfig {
        self.gpu.config()
    }
    fn new_cache(&self, capacity: usize) -> Result<KvCache, EngineError> {
        let kv = self.gpu.new_kv_cache(capacity)?;
        let checkpoints = Default::default();
        Ok(KvCache::Gpu(GpuSessionCache { kv, tokens: Vec::with_capacity(capacity), cpu: None, checkpoints }))
    }
    /// The device's recurrent state copied to the host (after a device loss, the CPU cache's).
    fn checkpoint(&self, cache: &mut KvCache) -> Result<bool, EngineError> {
        let kind = self.kind();
        let KvCache::Gpu(c) = cache else { return Err(wrong_cache(kind, cache)) };
        if let Some(p) = c.cpu.as_mut() {
            return Ok(p.checkpoint());
        }
        let at = c.tokens.len();
        if !c.kv.has_recurrent() || c.checkpoints.has(at) {
            return Ok(false);
        }
        let state = self.gpu.read_recurrent(&c.kv)?;
        c.checkpoints.push(at, state);
        Ok(true)
    }
    /// A recurrent state goes back by writing its checkpoint at `n` to the device.
    fn rewind(&self, cache: &mut KvCache, n: usize) -> Result<bool, EngineError> {
        let kind = self.kind();
        let KvCache::Gpu(c) = cache else { return Err(wrong_cache(kind, cache)) };
        if c.cpu.is_some() || !c.kv.has_recurrent() || n >= c.tokens.len() {
            return Ok(cache.truncate(n));
        }
        if !c.kv.can_cut(n) || !c.checkpoints.has(n) {
            return Ok(false);
        }
        let state = c.checkpoints.rewind(n).expect("checked above");
        self.gpu.write_recurrent(&c.kv, state)?;
        c.kv.cut(n);
        c.tokens.truncate(n);
        Ok(true)
    }
    /// A cache too small for `capacity` moves into a larger device allocation where its rows
    /// keep their layout (`GpuModel::grow_kv_cache`; a session already on the CPU grows there).
    fn reserve(&self, cache: &mut KvCache, capacity: usize) -> Result<bool, EngineError> {
        let kind = self.kind();
        let KvCache::Gpu(c) = cache else { return Err(wrong_cache(kind, cache)) };
        if c.cpu.is_some() || c.kv.capacity() >= capacity {
            return Ok(true);
        }
        let grown = self.gpu.grow_kv_cache(&c.kv, capacity)?;
        Ok(grown.map(|kv| c.kv = kv).is_some())
    }
    fn forward(&mut self, tokens: &[u32], phase: Phase, cache: &mut KvCache) -> Result<Logits, EngineError> {
        self.forward_rows(tokens, phase, cache, LogitRows::All)
    }
    fn forward_last(
        &mut self,
        tokens: &[u32],
        phase: Phase,
        cache: &mut KvCache,
    ) -> Result<Logits, EngineError> {
        self.forward_rows(tokens, phase, cache, LogitRows::Last)
    }
    /// One GPU call over every sequence; once the device is lost (or a session already moved
    /// to the CPU), one call per sequence, each on the pipeline.
    fn forward_batch(&mut self, seqs: &mut [BatchSeq<'_>], phase: Phase) -> Result<Logits, EngineError> {
        check_batch(self.config(), seqs)?;
        let kind = self.kind();
        let mut on_cpu = self.cpu.is_some();
        let mut inputs = Vec::with_capacity(seqs.len());
        for s in seqs.iter_mut() {
            let KvCache::Gpu(c) = &mut *s.cache else { return Err(wrong_cache(kind, s.cache)) };
            on_cpu |= c.cpu.is_some();
            inputs.push(GpuSeqInput { tokens: s.tokens, cache: &mut c.kv });
        }
        if !on_cpu {
            self.apply_exchanges()?;
            let before = self.gpu.perf().lane_snapshot();
            let start = std::time::Instant::now();
            match self.gpu.forward_batch(&mut inputs, phase, &mut self.cold) {
                Ok(logits) => {
                    let wall_us = start.elapsed().as_micros() as u64;
                    let n_tokens = seqs.iter().map(|s| s.tokens.len()).sum();
                    self.gpu.perf_mut().record_call(phase.name(), n_tokens, wall_us, &before);
                    for s in seqs.iter_mut() {
                        let KvCache::Gpu(c) = &mut *s.cache else { unreachable!("checked above") };
                        c.tokens.extend_from_slice(s.tokens);
                    }
                    return Ok(logits);
                }
                Err(e) if e.is_device_loss() => self.lose_device(&e)?,
                Err(e) => return Err(e.into()),
            }
        }
        drop(inputs);
        let mut out = Logits::empty(self.config().vocab);
        for s in seqs.iter_mut() {
            out.append(self.forward_rows(s.tokens, phase, s.cache, LogitRows::Last)?);
        }
        Ok(out)
    }
    fn perf(&self) -> Option<&PerfState> {
        Some(self.gpu.perf())
    }
    fn set_thread_report(&mut self, threads: crate::threads::ThreadReport) {
        self.gpu.perf_mut().set_threads(threads);
    }
    fn perf_mut(&mut self) -> Option<&mut PerfState> {
        Some(self.gpu.perf_mut())
    }
    fn set_perf_mode(&mut self, mode: crate::cache::perf::PerfMode) {
        self.gpu.perf_mut().set_mode(mode);
        if let Some(cpu) = self.cpu.as_mut() {
            cpu.perf_mut().set_mode(mode);
        }
    }
    fn hot_set(&self) -> Option<&HotSet> {
        Some(self.gpu.hot_set())
    }
    fn hot_bytes(&self) -> u64 {
        self.gpu.hot_cache_bytes() as u64
    }
    /// Summed over the GPUs (each counted once); none once the device is lost (the CPU
    /// pipeline serves then).
    fn device_free_bytes(&self) -> Option<u64> {
        if self.cpu.is_some() {
            return None;
        }
        let mut seen = Vec::new();
        let mut free = 0u64;
        for be in self.gpu.backends() {
            if !seen.contains(&be.info().ordinal) {
                seen.push(be.info().ordinal);
                free += be.mem_info().ok()?.0 as u64;
            }
        }
        Some(free)
    }
    fn device_reports(&self) -> Vec<crate::gpu::DeviceReport> {
        self.gpu.device_reports()
    }
    fn request_exchange(&self, exchange: Exchange) -> Result<(), EngineError> {
        Ok(self.updater.request(exchange)?)
    }
    /// Each exchange rewrites one cache slot in place and both copies of `hot_id_map`; the
    /// capacity never changes. An invalid exchange is refused before anything changes.
    fn apply_exchanges(&mut self) -> Result<usize, EngineError> {
        // Every slot holds one expert: an exchange rewrites one slot's bytes.
        let n_slots: usize = self.gpu.hot_set().layers.iter().map(|l| l.n_hot()).sum();
        let slot_bytes = (self.gpu.hot_cache_bytes() / n_slots.max(1)) as u64;
        apply_exchanges(
            self,
            |e| &e.updater,
            |e| e.gpu.perf_mut(),
            |e, x| {
                e.gpu.exchange(x.layer_idx, x.evict, x.add).map(|()| slot_bytes).map_err(EngineError::from)
            },
        )
    }
    fn set_copy_logits(&mut self, on: bool) {
        self.gpu.set_copy_logits(on);
    }
    fn copies_logits(&self) -> bool {
        // After a device loss the CPU pipeline answers, and it always copies rows.
        self.cpu.is_some() || self.gpu.copies_logits()
    }
    fn profile_report(&self) -> Option<String> {
        self.gpu.profile_report()
    }
    fn reset_profile(&mut self) {
        self.gpu.reset_profile();
    }
}
