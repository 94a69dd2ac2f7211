//! The server's service on the library's engine thread ([`moe_lanes::engine::worker`]): takes
//! completion jobs from a bounded queue one at a time, applies manual hot-cache changes only
//! between requests, switches the perf mode between tokens, and publishes a snapshot (perf JSON,
//! hot set, counters) after every request for the HTTP side to read without waiting.

use crate::prom;
use crossbeam_channel::Receiver;
use moe_lanes::actors::Exchange;
use moe_lanes::engine::worker::{spawn_engine_thread, Built, EngineService};
use moe_lanes::engine::{
    BuildReport, Engine, EngineError, EngineOptions, FinishReason, Generation, GenerationError,
    GenerationOptions, LiveCache,
};
use moe_lanes::hot_set::HotSet;
use moe_lanes::model::Model;
use moe_lanes::perf::ModelFingerprint;
use moe_lanes::perf::PerfMode;
use moe_lanes::sample::Logprobs;
use moe_lanes::text::{StopPush, StopStrings, TextStream, Tokenizer};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

/// How often an idle worker looks for a pending hot-cache apply or perf-mode switch.
const IDLE_POLL: Duration = Duration::from_millis(20);

/// How often a running request republishes the snapshot (perf JSON, gauges), so the live page
/// and `/moe-layer-perf` move while long generations run.
const PUBLISH_EVERY: Duration = Duration::from_millis(250);

/// One completion request, validated.
pub struct CompletionJob {
    pub prompt: Vec<u32>,
    pub generation: GenerationOptions,
    /// Text out (decoded pieces, stop strings), when the model has a tokenizer.
    pub text: Option<TextOut>,
    pub events: tokio::sync::mpsc::Sender<Event>,
    pub enqueued_at: Instant,
}

/// What a text request needs on the engine thread: the tokenizer and its stop strings.
#[derive(Clone)]
pub struct TextOut {
    pub tokenizer: Arc<Tokenizer>,
    pub stops: StopStrings,
}

/// What the worker tells the request handler.
#[derive(Debug)]
pub enum Event {
    /// `text`: the whole UTF-8 this token released (empty without a tokenizer, or while a
    /// character or a possible stop string is held back).
    Token {
        id: u32,
        text: String,
        logprobs: Option<Logprobs>,
    },
    /// `tail`: text released only at the end (held back until then).
    Done {
        prompt_tokens: usize,
        completion_tokens: usize,
        finish: FinishReason,
        tail: String,
    },
    Failed(String),
}

/// A manual hot-cache apply: the exchanges that turn the current set into the asked one.
pub struct ApplyJob {
    /// The hot set asked for, validated against the snapshot; `layers[l]`: whether layer `l`
    /// is set by it (the others keep what the engine holds when the apply runs: an online
    /// policy may have moved them since the snapshot).
    pub target: HotSet,
    pub layers: Vec<bool>,
    pub reply: tokio::sync::oneshot::Sender<Result<usize, String>>,
}

/// What the HTTP side reads (never blocks on the engine).
#[derive(Default)]
pub struct Snapshot {
    /// The hot-cache policy (`planned`, `lru`, `lfu`, `tinylfu`).
    pub cache_policy: &'static str,
    pub perf_json: Option<String>,
    pub hot_set: Option<HotSet>,
    pub hot_bytes: u64,
    pub perf_mode: Option<PerfMode>,
    /// The hot-cache budget the engine was planned for, when it was built from one.
    pub hot_budget_bytes: Option<u64>,
    /// Free device memory at the last publish (GPU engine).
    pub device_free_bytes: Option<u64>,
}

/// State shared between the HTTP side and the worker.
pub struct Shared {
    pub snapshot: RwLock<Snapshot>,
    pub apply: Mutex<Option<ApplyJob>>,
    pub apply_pending: AtomicBool,
    pub mode_switch: Mutex<Option<PerfMode>>,
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    pub updates: AtomicU64,
    pub exchanges_applied: AtomicU64,
}

impl Shared {
    pub fn new() -> Shared {
        Shared {
            snapshot: RwLock::new(Snapshot::default()),
            apply: Mutex::new(None),
            apply_pending: AtomicBool::new(false),
            mode_switch: Mutex::new(None),
            running: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            updates: AtomicU64::new(0),
            exchanges_applied: AtomicU64::new(0),
        }
    }
}

/// Start the engine thread (named `moe-engine`): build the engine there, report how it went
/// through `built`, then serve jobs until the queue closes. The thread returns the perf JSON
/// (`None` inside when the engine keeps none; `None` outside when the build failed).
pub fn spawn(
    model: Arc<Model>,
    opts: EngineOptions,
    jobs: Receiver<CompletionJob>,
    shared: Arc<Shared>,
    built: std::sync::mpsc::Sender<Built>,
) -> std::io::Result<std::thread::JoinHandle<Option<Option<String>>>> {
    let policy = opts.update;
    let m = model.clone();
    let make = move |engine: &mut dyn Engine, report: &BuildReport| {
        {
            let mut snap = shared.snapshot.write().expect("snapshot lock");
            snap.hot_budget_bytes = report.budget_bytes;
            snap.cache_policy = policy.cache.kind.name();
        }
        engine.set_copy_logits(false);
        let live = LiveCache::new(&*engine, ModelFingerprint::of(&m), m.layer_expert_bytes(), policy);
        // The first snapshot is there before the server listens (no request sees an empty one).
        publish(&*engine, &shared);
        Service { live, shared }
    };
    spawn_engine_thread("moe-engine", model, opts, jobs, make, move |b| {
        let _ = built.send(b);
    })
}

/// The server's jobs on the engine thread, with the live cache they update.
struct Service {
    live: LiveCache,
    shared: Arc<Shared>,
}

impl EngineService for Service {
    type Job = CompletionJob;
    type Output = Option<String>;

    fn idle_poll(&self) -> Option<Duration> {
        Some(IDLE_POLL)
    }

    fn between_jobs(&mut self, engine: &mut dyn Engine) {
        between_requests(engine, &mut self.live, &self.shared);
    }

    fn serve(&mut self, engine: &mut dyn Engine, job: CompletionJob) {
        self.shared.waiting.fetch_sub(1, Ordering::Relaxed);
        if job.events.is_closed() {
            // Its client left while it waited: nothing to compute.
            prom::request_cancelled();
            return;
        }
        self.shared.running.fetch_add(1, Ordering::Relaxed);
        complete(engine, &mut self.live, job, &self.shared);
    }

    fn finish(self, engine: &mut dyn Engine) -> Option<String> {
        engine.perf().map(|p| p.to_json())
    }
}

/// A pending apply (no request runs now; applied through the live cache, rate 1.0) and a
/// pending perf-mode switch.
fn between_requests(engine: &mut dyn Engine, live: &mut LiveCache, shared: &Shared) {
    switch_mode(engine, shared);
    let job = shared.apply.lock().expect("apply lock").take();
    if let Some(job) = job {
        let result = manual_exchanges(engine, &job)
            .and_then(|x| live.request_manual_exchanges(engine, x))
            .map(|o| o.map_or(0, |o| o.exchanges))
            .map_err(|e| e.to_string());
        if let Ok(n) = &result {
            shared.updates.fetch_add(1, Ordering::Relaxed);
            shared.exchanges_applied.fetch_add(*n as u64, Ordering::Relaxed);
            prom::cache_updated();
        }
        publish(engine, shared);
        shared.apply_pending.store(false, Ordering::Release);
        let _ = job.reply.send(result);
    }
}

/// The exchanges from the engine's hot set now to the job's target in the layers it names.
fn manual_exchanges(engine: &dyn Engine, job: &ApplyJob) -> Result<Vec<Exchange>, EngineError> {
    let current = engine.hot_set().ok_or(EngineError::NoHotCache { engine: engine.kind() })?;
    let hot_ids = |set: &HotSet, l: usize| (0..set.n_experts).filter(|&e| set.layers[l].is_hot(e)).collect();
    let lists: Vec<Vec<usize>> = (0..current.layers.len())
        .map(|l| if job.layers[l] { hot_ids(&job.target, l) } else { hot_ids(current, l) })
        .collect();
    let target = HotSet::from_lists(current.layers.len(), current.n_experts, current.n_lanes, &lists);
    Ok(moe_lanes::cache::update::exchanges_to(current, &target)?)
}

fn switch_mode(engine: &mut dyn Engine, shared: &Shared) {
    let mode = shared.mode_switch.lock().expect("mode lock").take();
    if let Some(mode) = mode {
        engine.set_perf_mode(mode);
        publish(engine, shared);
    }
}

/// Prefill, then decode greedily, streaming each token; stops early when the client is gone.
fn complete(engine: &mut dyn Engine, live: &mut LiveCache, job: CompletionJob, shared: &Shared) {
    let started = Instant::now();
    prom::request_started(started - job.enqueued_at, job.prompt.len());
    live.begin_request();
    let mut result = generate(engine, live, &job, shared, started);
    // The automatic update after the request; suspended while a manual apply waits (it runs
    // next, between requests).
    let ended = if shared.apply_pending.load(Ordering::Acquire) {
        live.end_request_without_update();
        Ok(None)
    } else {
        live.end_request(engine)
    };
    if let (Ok(_), Err(e)) = (&result, ended) {
        result = Err(e.into());
    }
    // Counters and the snapshot are current before the client hears the end.
    shared.running.fetch_sub(1, Ordering::Relaxed);
    publish(engine, shared);
    let event = match result {
        Ok(Some((n, finish, tail))) => {
            prom::request_finished(started.elapsed());
            Event::Done { prompt_tokens: job.prompt.len(), completion_tokens: n, finish, tail }
        }
        Ok(None) => {
            prom::request_cancelled();
            return;
        }
        Err(e) => {
            prom::request_failed();
            Event::Failed(e.to_string())
        }
    };
    let _ = job.events.blocking_send(event);
}

/// How a generation ended: tokens generated, why, and the text held back to the end.
type Ended = (usize, FinishReason, String);

/// Why a job failed (its client hears the message).
#[derive(Debug, thiserror::Error)]
enum JobError {
    #[error(transparent)]
    Generation(#[from] GenerationError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("cannot decode the generated text: {0}")]
    Text(#[from] moe_lanes::text::TokenizerError),
}

/// Generate with the job's sampler, streaming each token (and its text); `Ok(None)`: the client
/// went away (its generation stopped). A completed stop string ends it with `Stop`.
fn generate(
    engine: &mut dyn Engine,
    live: &mut LiveCache,
    job: &CompletionJob,
    shared: &Shared,
    started: Instant,
) -> Result<Option<Ended>, JobError> {
    let mut session = Generation::new(engine, &job.prompt, job.generation.clone())?;
    // Control tokens (`<|im_end|>`, ...) are not in the text, as `run` shows it by default.
    let mut text = job.text.as_ref().map(|t| TextStream::new(&t.tokenizer, true, t.stops.clone()));
    let mut stopped_on = None;
    let mut first = true;
    let mut published = Instant::now();
    while let Some(t) = session.next_token()? {
        if first {
            prom::first_token(started.elapsed());
            first = false;
        } else {
            prom::inter_token(std::time::Duration::from_micros(t.step_us));
        }
        let piece = match text.as_mut() {
            Some(s) => s.push(t.id)?,
            None => StopPush::default(),
        };
        if job
            .events
            .blocking_send(Event::Token { id: t.id, text: piece.text, logprobs: t.logprobs })
            .is_err()
        {
            return Ok(None);
        }
        if piece.stopped.is_some() {
            stopped_on = Some(t.id);
            session.cancel();
        }
        switch_mode(session.engine_mut(), shared);
        if published.elapsed() >= PUBLISH_EVERY {
            publish(session.engine_mut(), shared);
            published = Instant::now();
        }
        if !shared.apply_pending.load(Ordering::Acquire) {
            live.after_tokens(session.engine_mut(), 1)?;
        }
    }
    let n = session.generated_tokens();
    // The held-back text; a stop string its last bytes complete still cuts it.
    let end = text.map(TextStream::finish).unwrap_or_default();
    let last = session.generated().last().copied();
    let finish = match (stopped_on.or(end.stopped.and(last)), session.finish_reason()) {
        (Some(token), _) => FinishReason::Stop { token },
        (None, finish) => finish.expect("finished"),
    };
    Ok(Some((n, finish, end.text)))
}

fn publish(engine: &dyn Engine, shared: &Shared) {
    let mut s = shared.snapshot.write().expect("snapshot lock");
    s.perf_json = engine.perf().map(|p| p.to_json());
    s.perf_mode = engine.perf().map(|p| p.mode());
    s.hot_set = engine.hot_set().cloned();
    s.hot_bytes = engine.hot_bytes();
    s.device_free_bytes = engine.device_free_bytes();
    // The per-layer figures went to the exporter as they were recorded (the perf state records
    // through the facade); only the engine gauges are set here.
    prom::engine_gauges(s.hot_bytes, s.hot_budget_bytes, s.device_free_bytes);
}
