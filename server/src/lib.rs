//! moe-lanes over HTTP (the only package that knows HTTP): `GET /` (live page), `GET /health`, `GET /metrics`
//! (Prometheus), `GET /moe-layer-perf[?mode=full|update|off]` (perf JSON), `GET|POST
//! /moe-hot-cache` (hot set; manual apply between requests), and the OpenAI-compatible `GET
//! /v1/models`, `POST /v1/completions` (text or token-id prompts) and `POST
//! /v1/chat/completions` (messages through the chat template), streaming as server-sent events.
//! One engine thread serves a bounded queue, running up to `--parallel` requests together
//! (continuous batching); 429 when the queue is full; a client that hangs up cancels its
//! generation.

pub mod api;
mod chat;
mod page;
mod prom;
mod routes;
mod worker;

pub use api::{DEFAULT_MAX_TOKENS, MAX_BODY_BYTES};

use moe_lanes::engine::{BuildReport, EngineError, EngineOptions};
use moe_lanes::model::Model;
use moe_lanes::text::{ChatTemplate, Tokenizer};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

/// Install the process's Prometheus recorder (once; `serve` does it too), so everything that
/// records through the `metrics` facade (the engine's perf state) records for real: what
/// `bench --metrics-ab` measures the cost of.
pub fn install_metrics() {
    prom::install();
}

/// How to serve.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub listen: SocketAddr,
    /// Needed for mutating endpoints when `listen` is not a loopback address.
    pub admin_token: Option<String>,
    /// Requests that may wait for the engine before new ones get 429.
    pub queue_capacity: usize,
    /// How requests run together: at most `max_sequences` at once, `step_tokens` a step.
    pub batch: moe_lanes::engine::BatchOptions,
    /// The name `/v1/models` reports.
    pub model_name: String,
    /// Write the perf JSON here at shutdown.
    pub perf_json: Option<PathBuf>,
    /// The model's tokenizer: text prompts, text out, stop strings and chat need it (without
    /// one, prompts are token ids).
    pub tokenizer: Option<Arc<Tokenizer>>,
    /// What renders `/v1/chat/completions` messages, or why there is nothing (the 400 says it).
    pub chat_template: Result<Arc<ChatTemplate>, String>,
}

/// What went wrong serving.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("the HTTP server failed: {0}")]
    Http(std::io::Error),
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
    #[error("the engine thread stopped before it was ready")]
    WorkerGone,
    #[error("cannot write the perf JSON: {0}")]
    PerfJson(#[from] moe_lanes::output::OutputError),
    #[error("queue capacity 0: at least one request must be able to wait")]
    NoQueue,
}

/// What started: the engine's build report, its device, and the bound address.
pub struct Started {
    pub report: BuildReport,
    pub device: String,
    pub addr: SocketAddr,
}

/// Build the engine, listen, serve until ctrl-c or SIGTERM (in-flight requests finish), then
/// write the perf JSON if asked. `on_start` hears what started once the socket is bound.
pub fn run(
    model: Arc<Model>,
    engine: EngineOptions,
    opts: ServeOptions,
    on_start: impl FnOnce(&Started),
) -> Result<(), ServeError> {
    if opts.queue_capacity == 0 {
        return Err(ServeError::NoQueue);
    }
    let metrics = prom::install();
    let shared = Arc::new(worker::Shared::new());
    let (jobs_tx, jobs_rx) = crossbeam_channel::bounded(opts.queue_capacity);
    let (built_tx, built_rx) = std::sync::mpsc::channel();
    let (m, sh) = (model.clone(), shared.clone());
    let thread = worker::spawn(m, engine, opts.batch, jobs_rx, sh, built_tx).map_err(ServeError::Runtime)?;
    let (report, device) = built_rx.recv().map_err(|_| ServeError::WorkerGone)??;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(ServeError::Runtime)?;
    let c = model.config();
    let state = routes::AppState {
        jobs: jobs_tx,
        shared,
        metrics,
        model_name: opts.model_name.clone(),
        tokenizer: opts.tokenizer.clone(),
        chat_template: opts.chat_template.clone(),
        harmony: opts.tokenizer.as_deref().and_then(|t| moe_lanes::text::HarmonyTokens::for_arch(c.arch, t)),
        admin_token: opts.admin_token.clone(),
        loopback: opts.listen.ip().is_loopback(),
        n_layers: c.n_layers,
        n_experts: c.n_experts,
        vocab: c.vocab,
        ctx_positions: c.max_positions,
        fingerprint: moe_lanes::perf::ModelFingerprint::of(&model),
    };
    rt.block_on(serve(state, &opts, report, device, on_start))?;
    drop(rt);
    let perf = thread.join().ok().flatten().flatten();
    write_perf(&opts, perf)
}

async fn serve(
    state: routes::AppState,
    opts: &ServeOptions,
    report: BuildReport,
    device: String,
    on_start: impl FnOnce(&Started),
) -> Result<(), ServeError> {
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .map_err(|source| ServeError::Bind { addr: opts.listen, source })?;
    let addr = listener.local_addr().map_err(ServeError::Http)?;
    on_start(&Started { report, device, addr });
    axum::serve(listener, routes::router(state))
        .with_graceful_shutdown(shutdown_signal())
        .await
        .map_err(ServeError::Http)
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}

/// The perf JSON at shutdown, written to a temp name and renamed (never a partial file; the
/// path was checked by `moe_lanes::output::check_output` before the server started).
fn write_perf(opts: &ServeOptions, perf: Option<String>) -> Result<(), ServeError> {
    let (Some(path), Some(json)) = (&opts.perf_json, perf) else { return Ok(()) };
    Ok(moe_lanes::output::write_atomic(path, json.as_bytes())?)
}
