//! The live hot cache: drives the online updater around requests on any [`Engine`].
//!
//! - After each request ([`LiveCache::end_request`]), or every `every_tokens` generated tokens
//!   inside one ([`LiveCache::after_tokens`]), an automatic update (policy `auto`) reads the
//!   window of live perf counts since the last update as typed observations, scores them with
//!   the weighting, plans exchanges by gain with hysteresis, capped by `update_rate`
//!   ([`crate::cache::update`]), queues them on the engine's Updater and applies them between
//!   calls. A window with fewer than [`MIN_WINDOW_SLOTS`] routed slots keeps growing instead.
//! - A manual apply ([`LiveCache::request_manual`]: the CLI's `--hot-experts`, the server's
//!   `POST /moe-hot-cache`) is validated whole at once, uses rate 1.0, and is applied only when
//!   no request runs: asked during one, it waits for the request's end, and automatic updates
//!   are suspended while it waits.
//! - Statistics (updates, exchanges, bytes copied, copy time, hit rate of the window before the
//!   last update and of the one after it) go into the perf state's `cache_updates`.
//!
//! - With an online policy (`UpdatePolicy::cache`: `lru`, `lfu`, `tinylfu`, `adaptive` or `reuse`) the
//!   planned updater does not run; instead, after every call ([`LiveCache::after_tokens`] per
//!   generated token, and at the request's end) the experts each layer routed since the last
//!   step (read off the perf counts) are one step of that layer's [`LayerPolicy`]
//!   (`cache::policy`), run inline and its exchanges applied before the next call (the default,
//!   `PolicyConfig::lag_steps` 0). With `lag_steps` 1 the step runs on the policy's own thread
//!   while the engine runs the next call (`policy_worker`) and the exchanges it decides are
//!   applied at the step after it (one call later; at a request's end at once).
//!
//! The automatic updater and the online policies need the perf counts: with perf mode `off`
//! no window ever fills and no step is seen.

use super::policy_worker::{LayerStep, PolicyWorker};
use super::{Engine, EngineError};
use crate::actors::Exchange;
use crate::cache::hot_set::HotSet;
use crate::cache::observe::Observations;
use crate::cache::perf::{ModelFingerprint, PerfReport};
use crate::cache::policy::{LayerPolicy, PolicyKind};
use crate::cache::update::{exchanges_to, plan_exchanges, UpdateMode, UpdatePolicy, MIN_WINDOW_SLOTS};
use crate::cache::weighting::score_observations;
use crate::moe::phase::Phase;
use serde::Serialize;
use std::time::Instant;

/// Which kind of change was applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum UpdateKind {
    Auto,
    Manual,
    /// Exchanges of the online policy after one call.
    Policy,
}

/// One applied update.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct UpdateOutcome {
    pub kind: UpdateKind,
    pub exchanges: usize,
    /// Hit rate of the window the update was planned from (automatic updates).
    pub hit_rate_before: f64,
    pub copy_time_us: u64,
    /// Applied between two calls of a running request (automatic updates every N tokens).
    pub during_request: bool,
}

/// The updater's driver; one per engine.
#[derive(Debug)]
pub struct LiveCache {
    policy: UpdatePolicy,
    model: ModelFingerprint,
    /// Bytes of one expert of each layer (what an exchange copies).
    layer_expert_bytes: Vec<u64>,
    window: PerfReport,
    tokens_in_window: usize,
    in_request: bool,
    pending_manual: Option<Vec<Exchange>>,
    after_pending: bool,
    /// The online policy's per-layer state (made at its first step).
    online: Option<OnlineState>,
}

/// Per layer, the online policy (on its worker) and the routed counts it has seen.
#[derive(Debug)]
struct OnlineState {
    worker: PolicyWorker,
    /// `seen[l][e]`: hot + cold slots of expert `e` in layer `l` at the last step.
    seen: Vec<Vec<u64>>,
}

impl OnlineState {
    /// From the cache now; each layer's pinned core ranked by the counts so far (then slot order).
    fn new(policy: &UpdatePolicy, hot: &HotSet, report: &PerfReport) -> OnlineState {
        let counts = |l: usize, e: usize| {
            report.layers.get(l).map_or(0, |x| {
                x.hot_experts.get(e).copied().unwrap_or(0) + x.cold_experts.get(e).copied().unwrap_or(0)
            })
        };
        let layers = hot
            .layers
            .iter()
            .enumerate()
            .map(|(l, layer)| {
                let mut resident: Vec<usize> = layer.slots.iter().flatten().map(|&e| e as usize).collect();
                resident.sort_by_key(|&e| std::cmp::Reverse(counts(l, e)));
                LayerPolicy::new(policy.cache, hot.n_experts, &resident, &resident)
            })
            .collect();
        let seen =
            (0..hot.layers.len()).map(|l| (0..hot.n_experts).map(|e| counts(l, e)).collect()).collect();
        // without the lag the engine waits for every step: run it on the caller's thread
        // instead of a round trip to the worker's
        let worker = match policy.cache.lag_steps {
            0 => PolicyWorker::inline(layers),
            _ => PolicyWorker::spawn(layers),
        };
        OnlineState { worker, seen }
    }

    /// The experts each layer routed since the last step (read off the perf counts, which move
    /// `seen` on) with the cache's residency now, into `step` (one entry a layer, its buffers
    /// reused); whether any layer routed one.
    fn routed_since(&mut self, report: &PerfReport, hot: &HotSet, step: &mut Vec<LayerStep>) -> bool {
        let n_layers = self.seen.len();
        step.truncate(n_layers);
        while step.len() < n_layers {
            step.push(LayerStep { layer_idx: step.len(), experts: Vec::new(), resident: Vec::new() });
        }
        let mut any = false;
        for (l, s) in step.iter_mut().enumerate() {
            s.experts.clear();
            let Some(layer) = report.layers.get(l) else { continue };
            for (e, seen) in self.seen[l].iter_mut().enumerate() {
                let now = layer.hot_experts.get(e).copied().unwrap_or(0)
                    + layer.cold_experts.get(e).copied().unwrap_or(0);
                if now > *seen {
                    s.experts.push(e);
                }
                *seen = now;
            }
            if !s.experts.is_empty() {
                s.resident.clear();
                s.resident.extend(hot.layers[l].hot_id_map.iter().map(Option::is_some));
                any = true;
            }
        }
        any
    }
}

/// Two applies of one step reported as one: `last`'s figures, with the exchanges and copy time
/// of `first` (if any) added.
fn then(first: Option<UpdateOutcome>, last: UpdateOutcome) -> UpdateOutcome {
    match first {
        None => last,
        Some(s) => UpdateOutcome {
            exchanges: s.exchanges + last.exchanges,
            copy_time_us: s.copy_time_us + last.copy_time_us,
            ..last
        },
    }
}

/// Whether some layer's cache holds some experts but not all (an online policy has nothing to
/// decide where every layer's is empty or full: budget 0, or every expert on the GPU).
fn exchanges_possible(hot: &HotSet) -> bool {
    hot.layers.iter().any(|l| (1..hot.n_experts).contains(&l.n_hot()))
}

fn snapshot(engine: &dyn Engine) -> PerfReport {
    engine.perf().map(|p| p.report().clone()).unwrap_or_default()
}

impl LiveCache {
    /// `policy` must pass [`UpdatePolicy::check`] (the CLI and server check it first).
    pub fn new(
        engine: &dyn Engine,
        model: ModelFingerprint,
        layer_expert_bytes: Vec<u64>,
        policy: UpdatePolicy,
    ) -> LiveCache {
        LiveCache {
            policy,
            model,
            layer_expert_bytes,
            window: snapshot(engine),
            tokens_in_window: 0,
            in_request: false,
            pending_manual: None,
            after_pending: false,
            // Made now, so the first call's experts are its first step.
            online: match (policy.cache.kind, engine.hot_set(), engine.perf()) {
                (PolicyKind::Planned, _, _) | (_, None, _) | (_, _, None) => None,
                (_, Some(hot), Some(perf)) => Some(OnlineState::new(&policy, hot, perf.report())),
            },
        }
    }

    pub fn policy(&self) -> &UpdatePolicy {
        &self.policy
    }

    pub fn set_policy(&mut self, policy: UpdatePolicy) {
        if policy.cache != self.policy.cache {
            self.online = None;
        }
        self.policy = policy;
    }

    fn online_policy(&self) -> bool {
        self.policy.cache.kind != PolicyKind::Planned
    }

    pub fn in_request(&self) -> bool {
        self.in_request
    }

    pub fn manual_pending(&self) -> bool {
        self.pending_manual.is_some()
    }

    pub fn begin_request(&mut self) {
        self.in_request = true;
    }

    /// The request ended: a waiting manual apply runs now, else an automatic update.
    pub fn end_request(&mut self, engine: &mut dyn Engine) -> Result<Option<UpdateOutcome>, EngineError> {
        self.in_request = false;
        if let Some(exchanges) = self.pending_manual.take() {
            return self.apply(engine, exchanges, UpdateKind::Manual, 0.0).map(Some);
        }
        if self.online_policy() {
            let stepped = self.policy_step(engine)?;
            return self.flush_policy(engine, stepped);
        }
        self.auto_update(engine)
    }

    /// The request ended, without an update (the server, while its own manual apply waits).
    pub fn end_request_without_update(&mut self) {
        self.in_request = false;
    }

    /// `n` tokens were generated inside the running request: update every `every_tokens`.
    pub fn after_tokens(
        &mut self,
        engine: &mut dyn Engine,
        n: usize,
    ) -> Result<Option<UpdateOutcome>, EngineError> {
        self.tokens_in_window += n;
        if self.online_policy() {
            return self.policy_step(engine);
        }
        if self.policy.every_tokens == 0 || self.tokens_in_window < self.policy.every_tokens {
            return Ok(None);
        }
        self.auto_update(engine)
    }

    /// An automatic update now, if the policy is `auto`, no manual apply waits, and the window
    /// has enough slots.
    pub fn auto_update(&mut self, engine: &mut dyn Engine) -> Result<Option<UpdateOutcome>, EngineError> {
        if self.policy.mode != UpdateMode::Auto || self.pending_manual.is_some() {
            return Ok(None);
        }
        let Some(hot) = engine.hot_set().cloned() else { return Ok(None) };
        let now = snapshot(engine);
        let window = Observations::between(&self.window, &now, &self.model);
        if window.counts().iter().flatten().sum::<u64>() < MIN_WINDOW_SLOTS {
            return Ok(None);
        }
        let hit_rate = window.hit_rate();
        if self.after_pending {
            if let Some(p) = engine.perf_mut() {
                p.cache_updates_mut().last_hit_rate_after = hit_rate;
            }
            self.after_pending = false;
        }
        let scores = score_observations(&window, &self.policy.weighting);
        let counts = window.counts();
        let exchanges = plan_exchanges(&scores, Some(&counts), &hot, self.policy.rate, self.policy.margin);
        self.apply(engine, exchanges, UpdateKind::Auto, hit_rate).map(Some)
    }

    /// One step of the online policy: the exchanges the previous step decided applied now, then
    /// the experts each layer routed since the last step handed to the policy's worker
    /// (`engine::policy_worker`); with `lag_steps` 0 (the default) the worker steps inline and
    /// this step's exchanges are applied now too, else it decides while the engine runs the next
    /// call. Nothing while a manual apply waits.
    pub fn policy_step(&mut self, engine: &mut dyn Engine) -> Result<Option<UpdateOutcome>, EngineError> {
        if !self.online_policy() || self.pending_manual.is_some() {
            return Ok(None);
        }
        let (Some(hot), Some(perf)) = (engine.hot_set(), engine.perf()) else { return Ok(None) };
        if !exchanges_possible(hot) {
            return Ok(None);
        }
        let state = self.online.get_or_insert_with(|| OnlineState::new(&self.policy, hot, perf.report()));
        let decided = state.worker.take();
        let applied =
            if decided.is_empty() { Ok(None) } else { self.apply_policy(engine, decided).map(Some) };
        // read after the apply: the residency holds the evictions just made
        if let (Some(hot), Some(perf), Some(state)) = (engine.hot_set(), engine.perf(), self.online.as_mut())
        {
            let mut step = state.worker.buffer();
            if state.routed_since(perf.report(), hot, &mut step) {
                state.worker.submit(step);
            } else {
                state.worker.give_back(step);
            }
        }
        let applied = applied?;
        if self.policy.cache.lag_steps == 0 {
            // no lag: this step's exchanges serve the next call (the engine waits for the step)
            let now = self.online.as_mut().map(|s| s.worker.take()).unwrap_or_default();
            if !now.is_empty() {
                let later = self.apply_policy(engine, now)?;
                return Ok(Some(then(applied, later)));
            }
        }
        Ok(applied)
    }

    /// At a request's end: the last step's exchanges applied now too (nothing waits for a token
    /// there), so the next request starts from everything the policy decided.
    fn flush_policy(
        &mut self,
        engine: &mut dyn Engine,
        stepped: Option<UpdateOutcome>,
    ) -> Result<Option<UpdateOutcome>, EngineError> {
        let Some(state) = self.online.as_mut() else { return Ok(stepped) };
        let decided = state.worker.take();
        if decided.is_empty() {
            return Ok(stepped);
        }
        let last = self.apply_policy(engine, decided)?;
        Ok(Some(then(stepped, last)))
    }

    /// Apply the online policy's exchanges (no window snapshot: the policy keeps its own counts).
    fn apply_policy(
        &mut self,
        engine: &mut dyn Engine,
        exchanges: Vec<Exchange>,
    ) -> Result<UpdateOutcome, EngineError> {
        let start = Instant::now();
        let mut refused = None;
        for (i, &x) in exchanges.iter().enumerate() {
            if let Err(e) = engine.request_exchange(x) {
                refused = Some((exchanges.len() - i, e));
                break;
            }
        }
        let n = engine.apply_exchanges()?;
        let copy_time_us = start.elapsed().as_micros() as u64;
        let bytes: u64 = exchanges.iter().take(n).map(|x| self.layer_expert_bytes[x.layer_idx]).sum();
        if let Some(p) = engine.perf_mut() {
            if let Some((n_refused, _)) = &refused {
                p.record_refused_exchanges(*n_refused as u64);
            }
            let s = p.cache_updates_mut();
            s.exchanges += n as u64;
            s.bytes_copied += bytes;
            s.copy_time_us += copy_time_us;
        }
        if let Some((_, e)) = refused {
            return Err(e);
        }
        Ok(UpdateOutcome {
            kind: UpdateKind::Policy,
            exchanges: n,
            hit_rate_before: 0.0,
            copy_time_us,
            during_request: self.in_request,
        })
    }

    /// Turn the cache into `target` (rate 1.0). Validated now, so a bad target changes nothing;
    /// applied now when no request runs, else when the running one ends (`Ok(None)`).
    pub fn request_manual(
        &mut self,
        engine: &mut dyn Engine,
        target: &HotSet,
    ) -> Result<Option<UpdateOutcome>, EngineError> {
        let current = engine.hot_set().ok_or(EngineError::NoHotCache { engine: engine.kind() })?;
        let exchanges = exchanges_to(current, target)?;
        self.request_manual_exchanges(engine, exchanges)
    }

    /// A manual apply already turned into exchanges (validated by the caller, e.g. the server
    /// with [`crate::cache::update::exchanges_to`]): now when no request runs, else at its end.
    pub fn request_manual_exchanges(
        &mut self,
        engine: &mut dyn Engine,
        exchanges: Vec<Exchange>,
    ) -> Result<Option<UpdateOutcome>, EngineError> {
        if self.in_request {
            self.pending_manual = Some(exchanges);
            return Ok(None);
        }
        self.apply(engine, exchanges, UpdateKind::Manual, 0.0).map(Some)
    }

    fn apply(
        &mut self,
        engine: &mut dyn Engine,
        exchanges: Vec<Exchange>,
        kind: UpdateKind,
        hit_rate_before: f64,
    ) -> Result<UpdateOutcome, EngineError> {
        // an online step still in flight decided against the cache before this apply: its
        // exchanges may evict what this one evicts (the next step starts from the new cache)
        if let Some(state) = self.online.as_mut() {
            drop(state.worker.take());
        }
        let start = Instant::now();
        let mut refused = None;
        for (i, &x) in exchanges.iter().enumerate() {
            if let Err(e) = engine.request_exchange(x) {
                refused = Some((exchanges.len() - i, e));
                break;
            }
        }
        let n = engine.apply_exchanges()?;
        if let Some((n_refused, e)) = refused {
            // What was queued is applied; the rest is counted and the refusal reported.
            if let Some(p) = engine.perf_mut() {
                p.record_refused_exchanges(n_refused as u64);
            }
            return Err(e);
        }
        let copy_time_us = start.elapsed().as_micros() as u64;
        // the engine applies the requested exchanges in order (`n` of them)
        let bytes: u64 = exchanges.iter().take(n).map(|x| self.layer_expert_bytes[x.layer_idx]).sum();
        if let Some(p) = engine.perf_mut() {
            let s = p.cache_updates_mut();
            match kind {
                UpdateKind::Auto => s.auto_updates += 1,
                UpdateKind::Manual => s.manual_applies += 1,
                UpdateKind::Policy => {}
            }
            s.exchanges += n as u64;
            s.bytes_copied += bytes;
            s.copy_time_us += copy_time_us;
            if kind == UpdateKind::Auto && n > 0 {
                s.last_hit_rate_before = hit_rate_before;
            }
        }
        self.after_pending |= kind == UpdateKind::Auto && n > 0;
        self.window = snapshot(engine);
        self.tokens_in_window = 0;
        Ok(UpdateOutcome {
            kind,
            exchanges: n,
            hit_rate_before,
            copy_time_us,
            during_request: self.in_request,
        })
    }

    /// Greedy generation as one request: prefill, decode (updating every `every_tokens`),
    /// then the end-of-request update.
    pub fn generate(
        &mut self,
        engine: &mut dyn Engine,
        prompt: &[u32],
        n_new: usize,
    ) -> Result<Vec<u32>, EngineError> {
        crate::reference::check_generation_fits(prompt.len(), n_new, engine.config().max_positions)?;
        let mut cache = engine.new_cache(prompt.len() + n_new)?;
        let mut out = Vec::with_capacity(n_new);
        self.begin_request();
        let result = (|| {
            if n_new == 0 {
                return Ok(());
            }
            let mut next = *engine.forward(prompt, Phase::Prefill, &mut cache)?.argmax.last().expect("rows");
            out.push(next);
            while out.len() < n_new {
                self.after_tokens(engine, 1)?;
                next = engine.forward(&[next], Phase::Decode, &mut cache)?.argmax[0];
                out.push(next);
            }
            Ok::<(), EngineError>(())
        })();
        let ended = self.end_request(engine);
        result?;
        ended?;
        Ok(out)
    }
}
