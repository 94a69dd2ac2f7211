//! The server's service on the library's engine thread ([`moe_lanes::engine::worker`]): takes
//! completion jobs from a bounded queue into a [`Batcher`] (continuous batching: up to
//! `--parallel` requests run together, one batched engine call per step, each joining and leaving
//! between steps), streams each request's tokens to its client, drops a request whose client hung
//! up, applies manual hot-cache changes only when no request runs (new requests wait while one is
//! pending), switches the perf mode between steps, and publishes a snapshot (perf JSON, hot set,
//! counters) after every request for the HTTP side to read without waiting.

use crate::prom;
use crossbeam_channel::Receiver;
use moe_lanes::actors::Exchange;
use moe_lanes::engine::batch::PrefixStats;
use moe_lanes::engine::worker::{spawn_engine_thread, Built, EngineService};
use moe_lanes::engine::{
    BatchOptions, Batcher, BuildReport, Engine, EngineError, EngineOptions, FinishReason, GeneratedToken,
    GenerationOptions, LiveCache, SeqEvent, SeqId,
};
use moe_lanes::hot_set::HotSet;
use moe_lanes::model::Model;
use moe_lanes::perf::ModelFingerprint;
use moe_lanes::perf::PerfMode;
use moe_lanes::sample::Logprobs;
use moe_lanes::text::{HarmonyTokens, StopStrings, TextPiece, TextStream, Tokenizer, TokenizerRef};
use std::collections::HashMap;
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

/// What a text request needs on the engine thread: the tokenizer and its stop strings, and for a
/// GPT-OSS chat the Harmony tokens its output is parsed with (reasoning apart from content).
#[derive(Clone)]
pub struct TextOut {
    pub tokenizer: Arc<Tokenizer>,
    pub stops: StopStrings,
    pub harmony: Option<HarmonyTokens>,
}

/// What the worker tells the request handler.
#[derive(Debug)]
pub enum Event {
    /// `text`: the whole UTF-8 this token released (empty without a tokenizer, or while a
    /// character or a possible stop string is held back); `reasoning`: a Harmony model's
    /// analysis text it released (empty otherwise).
    Token {
        id: u32,
        text: String,
        reasoning: String,
        logprobs: Option<Logprobs>,
    },
    /// `tail`, `tail_reasoning`: text released only at the end (held back until then).
    Done {
        prompt_tokens: usize,
        completion_tokens: usize,
        finish: FinishReason,
        tail: String,
        tail_reasoning: String,
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
    /// The hot-cache policy (`planned`, `lru`, `lfu`, `tinylfu`, `adaptive`, `reuse`).
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
/// through `built`, then serve jobs until the queue closes, up to `batch.max_sequences` at once
/// in one batched engine call per step. The thread returns the perf JSON (`None` inside when the
/// engine keeps none; `None` outside when the build failed).
pub fn spawn(
    model: Arc<Model>,
    opts: EngineOptions,
    batch: BatchOptions,
    jobs: Receiver<CompletionJob>,
    shared: Arc<Shared>,
    built: std::sync::mpsc::Sender<Built>,
) -> std::io::Result<std::thread::JoinHandle<Option<Option<String>>>> {
    let policy = opts.update;
    let m = model.clone();
    // KV-cache use is the positions the running requests reserve over what the batch may hold.
    let kv_capacity = (batch.max_sequences * opts.n_positions).max(1);
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
        Service {
            live,
            shared,
            batcher: Batcher::new(batch),
            running: HashMap::new(),
            published: Instant::now(),
            kv_capacity,
            prefix_seen: PrefixStats::default(),
        }
    };
    spawn_engine_thread("moe-engine", model, opts, jobs, make, move |b| {
        let _ = built.send(b);
    })
}

/// A request the batcher runs: its job, its text stream, and what its end needs.
struct Running {
    job: CompletionJob,
    text: Option<TextStream<'static>>,
    started: Instant,
    generated: usize,
}

/// The server's jobs on the engine thread: the batcher that runs them together, with the live
/// cache they update.
struct Service {
    live: LiveCache,
    shared: Arc<Shared>,
    batcher: Batcher,
    running: HashMap<SeqId, Running>,
    published: Instant,
    /// Positions the batch may hold (sequences x context), for the KV-cache use gauge.
    kv_capacity: usize,
    /// The batcher's prefix-reuse counts already exported.
    prefix_seen: PrefixStats,
}

impl EngineService for Service {
    type Job = CompletionJob;
    type Output = Option<String>;

    fn idle_poll(&self) -> Option<Duration> {
        Some(IDLE_POLL)
    }

    fn between_jobs(&mut self, engine: &mut dyn Engine) {
        switch_mode(engine, &self.shared);
        if self.batcher.is_empty() {
            between_requests(engine, &mut self.live, &self.shared);
        }
    }

    fn serve(&mut self, engine: &mut dyn Engine, job: CompletionJob) {
        self.shared.waiting.fetch_sub(1, Ordering::Relaxed);
        if job.events.is_closed() {
            // Its client left while it waited: nothing to compute.
            prom::request_cancelled();
            return;
        }
        self.admit(engine, job);
    }

    fn busy(&self) -> bool {
        !self.batcher.is_empty()
    }

    /// No new request joins while a manual apply waits: the running ones finish, then it applies.
    fn has_room(&self) -> bool {
        self.batcher.has_room() && !self.shared.apply_pending.load(Ordering::Acquire)
    }

    fn work(&mut self, engine: &mut dyn Engine) {
        self.drop_gone_clients();
        let events = self.batcher.step(engine);
        let step = self.batcher.last_step();
        prom::batch_step(step.sequences, Duration::from_micros(step.wall_us));
        let mut generated = 0;
        for event in events {
            generated += usize::from(matches!(event, SeqEvent::Token(..)));
            self.on_event(engine, event);
        }
        if !self.shared.apply_pending.load(Ordering::Acquire) && generated > 0 {
            if let Err(e) = self.live.after_tokens(engine, generated) {
                self.fail_all(&e.to_string());
            }
        }
        if self.batcher.is_empty() {
            self.end_busy_period(engine);
        } else if self.published.elapsed() >= PUBLISH_EVERY {
            self.publish(engine);
        }
    }

    fn finish(self, engine: &mut dyn Engine) -> Option<String> {
        engine.perf().map(|p| p.to_json())
    }
}

impl Service {
    /// A request joins the batch (its first step is the next); refused requests hear why.
    fn admit(&mut self, engine: &mut dyn Engine, job: CompletionJob) {
        let started = Instant::now();
        prom::request_started(started - job.enqueued_at, job.prompt.len());
        if self.batcher.is_empty() {
            self.live.begin_request();
        }
        let added = self.batcher.add(engine, &job.prompt, job.generation.clone());
        let (now, seen) = (self.batcher.prefix_stats(), self.prefix_seen);
        prom::prefix_reuse(
            now.lookups - seen.lookups,
            now.hits - seen.hits,
            now.reused_tokens - seen.reused_tokens,
        );
        self.prefix_seen = now;
        match added {
            Ok(Ok(id)) => {
                self.shared.running.fetch_add(1, Ordering::Relaxed);
                // Control tokens (`<|im_end|>`, ...) are not in the text, as `run` shows it by default.
                let text = job.text.as_ref().map(|t| match t.harmony {
                    Some(tokens) => TextStream::harmony(
                        TokenizerRef::Shared(t.tokenizer.clone()),
                        tokens,
                        t.stops.clone(),
                    ),
                    None => TextStream::shared(t.tokenizer.clone(), true, t.stops.clone()),
                });
                self.running.insert(id, Running { job, text, started, generated: 0 });
            }
            Ok(Err(e)) => {
                prom::request_failed();
                let _ = job.events.blocking_send(Event::Failed(e.to_string()));
            }
            Err(full) => {
                prom::request_failed();
                let _ = job.events.blocking_send(Event::Failed(full.to_string()));
            }
        }
        if self.batcher.is_empty() {
            self.live.end_request_without_update();
        }
        self.gauges();
    }

    /// Requests whose client hung up leave the batch before the step.
    fn drop_gone_clients(&mut self) {
        let gone: Vec<SeqId> =
            self.running.iter().filter(|(_, r)| r.job.events.is_closed()).map(|(id, _)| *id).collect();
        for id in gone {
            self.batcher.cancel(id);
            self.running.remove(&id);
            self.shared.running.fetch_sub(1, Ordering::Relaxed);
            prom::request_cancelled();
        }
    }

    fn on_event(&mut self, engine: &mut dyn Engine, event: SeqEvent) {
        match event {
            SeqEvent::Token(id, t) => self.on_token(engine, id, t),
            SeqEvent::Finished { id, finish, generated, .. } => {
                self.end(engine, id, Ok((finish, generated.last().copied())));
            }
            SeqEvent::Failed(id, e) => self.end(engine, id, Err(e.to_string())),
        }
    }

    /// A token: its text streamed to the client; a completed stop string ends the request.
    fn on_token(&mut self, engine: &mut dyn Engine, id: SeqId, t: GeneratedToken) {
        let Some(r) = self.running.get_mut(&id) else { return };
        if r.generated == 0 {
            prom::first_token(r.started.elapsed());
        } else {
            prom::inter_token(Duration::from_micros(t.step_us));
        }
        r.generated += 1;
        let piece = match r.text.as_mut().map(|s| s.push(t.id)) {
            Some(Ok(p)) => p,
            Some(Err(e)) => {
                return self.end(engine, id, Err(format!("cannot decode the generated text: {e}")))
            }
            None => TextPiece::default(),
        };
        let stopped = piece.stopped.is_some();
        let token =
            Event::Token { id: t.id, text: piece.text, reasoning: piece.reasoning, logprobs: t.logprobs };
        let sent = r.job.events.blocking_send(token);
        if sent.is_err() {
            // The client went away: its generation stops.
            self.batcher.cancel(id);
            self.running.remove(&id);
            self.shared.running.fetch_sub(1, Ordering::Relaxed);
            prom::request_cancelled();
        } else if stopped {
            self.batcher.cancel(id);
            self.end(engine, id, Ok((FinishReason::Stop { token: t.id }, Some(t.id))));
        }
    }

    /// A request's end: the held-back text (a stop string its last bytes complete still cuts
    /// it), then `Done` or `Failed`; counters and the snapshot are current before the client
    /// hears it.
    fn end(
        &mut self,
        engine: &mut dyn Engine,
        id: SeqId,
        outcome: Result<(FinishReason, Option<u32>), String>,
    ) {
        let Some(r) = self.running.remove(&id) else { return };
        self.shared.running.fetch_sub(1, Ordering::Relaxed);
        self.publish(engine);
        let event = match outcome {
            Ok((finish, last)) => {
                let end = r.text.map(TextStream::finish).unwrap_or_default();
                let finish = match (finish, end.stopped.and(last)) {
                    (FinishReason::Stop { token }, _) => FinishReason::Stop { token },
                    (_, Some(token)) => FinishReason::Stop { token },
                    (finish, None) => finish,
                };
                prom::request_finished(r.started.elapsed());
                Event::Done {
                    prompt_tokens: r.job.prompt.len(),
                    completion_tokens: r.generated,
                    finish,
                    tail: end.text,
                    tail_reasoning: end.reasoning,
                }
            }
            Err(message) => {
                prom::request_failed();
                Event::Failed(message)
            }
        };
        let _ = r.job.events.blocking_send(event);
    }

    /// An update failed mid-batch: every running request fails with it.
    fn fail_all(&mut self, message: &str) {
        for (id, r) in std::mem::take(&mut self.running) {
            self.batcher.cancel(id);
            self.shared.running.fetch_sub(1, Ordering::Relaxed);
            prom::request_failed();
            let _ = r.job.events.blocking_send(Event::Failed(message.to_string()));
        }
    }

    /// The batch drained: the automatic update of the busy period (suspended while a manual
    /// apply waits: it runs next, between requests).
    fn end_busy_period(&mut self, engine: &mut dyn Engine) {
        if self.shared.apply_pending.load(Ordering::Acquire) {
            self.live.end_request_without_update();
        } else if let Err(e) = self.live.end_request(engine) {
            eprintln!("moe-lanes serve: the automatic hot-cache update after the batch failed: {e}");
        }
        self.publish(engine);
    }

    fn publish(&mut self, engine: &dyn Engine) {
        publish(engine, &self.shared);
        self.gauges();
        self.published = Instant::now();
    }

    fn gauges(&self) {
        let reserved = self.batcher.reserved_positions();
        prom::kv_cache_usage(reserved as f64 / self.kv_capacity as f64);
    }
}

/// A pending apply (no request runs now; applied through the live cache, rate 1.0).
fn between_requests(engine: &mut dyn Engine, live: &mut LiveCache, shared: &Shared) {
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
