//! The HTTP endpoints (axum): health, models, metrics, perf JSON, hot-cache admin, completions
//! (chat completions are in `chat`).

use crate::api::{self, ApiError};
use crate::prom;
use crate::worker::TextOut;
use crate::worker::{ApplyJob, CompletionJob, Event, Shared};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use moe_lanes::actors::Exchange;
use moe_lanes::hot_set::HotSet;
use moe_lanes::perf::PerfMode;
use moe_lanes::sample::Logprobs;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Everything a handler needs.
#[derive(Clone)]
pub struct AppState {
    pub jobs: crossbeam_channel::Sender<CompletionJob>,
    pub shared: Arc<Shared>,
    pub metrics: metrics_exporter_prometheus::PrometheusHandle,
    pub model_name: String,
    /// Text in and out (text prompts, `text`, stop strings, chat), when the model has one.
    pub tokenizer: Option<Arc<moe_lanes::text::Tokenizer>>,
    /// Renders chat messages, or why there is nothing to (the model has no template).
    pub chat_template: Result<Arc<moe_lanes::text::ChatTemplate>, String>,
    /// A GPT-OSS model's Harmony tokens: its chat output is parsed into `reasoning_content` and
    /// `content`.
    pub harmony: Option<moe_lanes::text::HarmonyTokens>,
    pub admin_token: Option<String>,
    pub loopback: bool,
    pub n_layers: usize,
    pub n_experts: usize,
    pub vocab: usize,
    pub ctx_positions: usize,
    /// The model, to refuse a learn file recorded on another one.
    pub fingerprint: moe_lanes::perf::ModelFingerprint,
}

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/", get(crate::page::page))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/moe-layer-perf", get(layer_perf))
        .route("/moe-hot-cache", get(hot_cache).post(apply_hot_cache))
        .route("/v1/models", get(models))
        .route("/v1/completions", axum::routing::post(completions))
        .route("/v1/chat/completions", axum::routing::post(crate::chat::chat_completions))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(api::MAX_BODY_BYTES))
        .with_state(state)
}

/// Unknown paths and methods get a JSON error too (never an empty body).
async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::status(StatusCode::NOT_FOUND, "not_found_error", format!("no endpoint at {}", uri.path()))
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    let message = format!("{method} is not allowed on {}", uri.path());
    ApiError::status(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", message)
}

async fn health(State(s): State<AppState>) -> Json<Value> {
    Json(json!({
        "status": "ok",
        "model": s.model_name,
        "requests_running": s.shared.running.load(Ordering::Relaxed),
        "requests_waiting": s.shared.waiting.load(Ordering::Relaxed),
    }))
}

async fn models(State(s): State<AppState>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": s.model_name, "object": "model", "owned_by": "moe-lanes"}]}),
    )
}

async fn metrics(State(s): State<AppState>) -> Response {
    prom::queue_depth(s.shared.running.load(Ordering::Relaxed), s.shared.waiting.load(Ordering::Relaxed));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], s.metrics.render()).into_response()
}

/// Mutating endpoints: free on loopback, else only with `Authorization: Bearer <admin token>`.
fn check_admin(s: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    if s.loopback && s.admin_token.is_none() {
        return Ok(());
    }
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match (&s.admin_token, given) {
        (Some(token), Some(g)) if g == token => Ok(()),
        (None, _) => Err(ApiError::status(
            StatusCode::FORBIDDEN,
            "permission_error",
            "admin endpoints are off: the server listens beyond loopback without --admin-token",
        )),
        _ => Err(ApiError::status(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "this endpoint needs Authorization: Bearer <admin token>",
        )),
    }
}

async fn layer_perf(
    State(s): State<AppState>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    if let Some(key) = q.keys().find(|k| k.as_str() != "mode") {
        return Err(ApiError::bad(key, format!("unknown query parameter '{key}' (only mode)")));
    }
    if let Some(mode) = q.get("mode") {
        check_admin(&s, &headers)?;
        let mode: PerfMode = mode.parse().map_err(|e: String| ApiError::bad("mode", e))?;
        *s.shared.mode_switch.lock().expect("mode lock") = Some(mode);
        wait_until(Duration::from_secs(5), || s.shared.mode_switch.lock().expect("mode lock").is_none())
            .await;
    }
    let json = s.shared.snapshot.read().expect("snapshot lock").perf_json.clone();
    let json = json.ok_or_else(|| {
        ApiError::status(StatusCode::NOT_FOUND, "not_found_error", "this engine keeps no perf state")
    })?;
    Ok(([(header::CONTENT_TYPE, "application/json")], json).into_response())
}

async fn wait_until(limit: Duration, done: impl Fn() -> bool) {
    let start = Instant::now();
    while !done() && start.elapsed() < limit {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn hot_cache(State(s): State<AppState>) -> Json<Value> {
    let snap = s.shared.snapshot.read().expect("snapshot lock");
    let layers = snap.hot_set.as_ref().map(|h| h.to_experts_json()["layers"].clone());
    Json(json!({
        "layers": layers,
        "policy": snap.cache_policy,
        "hot_bytes": snap.hot_bytes,
        "hot_budget_bytes": snap.hot_budget_bytes,
        "device_free_bytes": snap.device_free_bytes,
        "updates": s.shared.updates.load(Ordering::Relaxed),
        "exchanges_applied": s.shared.exchanges_applied.load(Ordering::Relaxed),
        "apply_pending": s.shared.apply_pending.load(Ordering::Relaxed),
    }))
}

/// `POST /moe-hot-cache`: a hot set (`{"layers": {"0": [ids], ...}}`; layers not named keep
/// theirs) or a learn file (perf
/// JSON; each layer's slots go to its most used experts). Validated whole before anything changes;
/// applied when no request runs.
async fn apply_hot_cache(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    check_admin(&s, &headers)?;
    let text = String::from_utf8(
        body.map_err(|e| ApiError::status(e.status(), "invalid_request_error", e.body_text()))?.to_vec(),
    )
    .map_err(|_| ApiError::bad("(body)", "body is not UTF-8"))?;
    let current = s.shared.snapshot.read().expect("snapshot lock").hot_set.clone();
    let current = current.ok_or_else(|| {
        ApiError::status(StatusCode::CONFLICT, "invalid_request_error", "this engine has no hot cache")
    })?;
    let (target, layers) = target_set(&s, &current, &text)?;
    let exchanges = exchanges_between(&current, &target)?;
    if s.shared.apply_pending.swap(true, Ordering::AcqRel) {
        return Err(ApiError::status(
            StatusCode::CONFLICT,
            "conflict_error",
            "another hot-cache apply is pending",
        ));
    }
    let (reply, rx) = tokio::sync::oneshot::channel();
    let n = exchanges.len();
    *s.shared.apply.lock().expect("apply lock") = Some(ApplyJob { target, layers, reply });
    match rx.await {
        Ok(Ok(applied)) => Ok(Json(json!({"exchanges": n, "applied": applied}))),
        Ok(Err(e)) => Err(ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, "server_error", e)),
        Err(_) => {
            Err(ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the engine stopped"))
        }
    }
}

/// The hot set a body asks for, and which layers it sets.
fn target_set(s: &AppState, current: &HotSet, text: &str) -> Result<(HotSet, Vec<bool>), ApiError> {
    let value: Value =
        serde_json::from_str(text).map_err(|e| ApiError::bad("(body)", format!("body is not JSON: {e}")))?;
    let path = std::path::Path::new("request body");
    if value.get("layers").is_some_and(Value::is_array) {
        // The one parser of learn files, perf snapshots and manual applies (typed observations).
        let obs = moe_lanes::cache::observe::parse_observations(path, text, &s.fingerprint)
            .map_err(|e| ApiError::bad("layers", e.to_string()))?;
        let lists = obs
            .counts()
            .iter()
            .enumerate()
            .map(|(l, c)| top_experts(c, current.layers[l].n_hot()))
            .collect::<Vec<_>>();
        return Ok((
            HotSet::from_lists(s.n_layers, s.n_experts, current.n_lanes, &lists),
            vec![true; s.n_layers],
        ));
    }
    let asked = HotSet::from_experts_json(path, text, s.n_layers, s.n_experts, current.n_lanes)
        .map_err(|e| ApiError::bad("layers", e.to_string()))?;
    // Layers the body does not name keep their experts.
    let named = |l: usize| value["layers"].get(l.to_string()).is_some();
    let hot_ids =
        |set: &HotSet, l: usize| (0..s.n_experts).filter(|&e| set.layers[l].is_hot(e)).collect::<Vec<_>>();
    let lists: Vec<Vec<usize>> =
        (0..s.n_layers).map(|l| if named(l) { hot_ids(&asked, l) } else { hot_ids(current, l) }).collect();
    let layers = (0..s.n_layers).map(named).collect();
    Ok((HotSet::from_lists(s.n_layers, s.n_experts, current.n_lanes, &lists), layers))
}

/// The `n` most counted experts (lowest id first among equals).
fn top_experts(counts: &[u64], n: usize) -> Vec<usize> {
    let mut ids: Vec<usize> = (0..counts.len()).collect();
    ids.sort_by(|&a, &b| counts[b].cmp(&counts[a]).then(a.cmp(&b)));
    ids.truncate(n);
    ids
}

/// Slot exchanges from `current` to `target`; every layer must keep its slot count.
fn exchanges_between(current: &HotSet, target: &HotSet) -> Result<Vec<Exchange>, ApiError> {
    // The library's check (`cache::update::exchanges_to`) gives the same exchanges; this one
    // names the body field in the error.
    let mut out = Vec::new();
    for (l, (cur, want)) in current.layers.iter().zip(&target.layers).enumerate() {
        if cur.n_hot() != want.n_hot() {
            return Err(ApiError::bad(
                &format!("layers.{l}"),
                format!("layer {l} has {} cache slots; {} experts were given", cur.n_hot(), want.n_hot()),
            ));
        }
        let evict = (0..cur.hot_mask().len()).filter(|&e| cur.is_hot(e) && !want.is_hot(e));
        let add = (0..want.hot_mask().len()).filter(|&e| want.is_hot(e) && !cur.is_hot(e));
        out.extend(evict.zip(add).map(|(evict, add)| Exchange { layer_idx: l, evict, add }));
    }
    Ok(out)
}

async fn completions(
    State(s): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req = api::object(body)
        .and_then(|o| api::completion(&o, s.vocab, s.tokenizer.as_deref()))
        .and_then(|req| {
            api::check_fits("prompt", req.prompt.len(), req.generation.max_tokens, s.ctx_positions)
                .map(|_| req)
        })
        .map_err(refused)?;
    let text = s.tokenizer.clone().map(|tokenizer| TextOut { tokenizer, stops: req.stops, harmony: None });
    let rx = enqueue(&s, req.prompt, req.generation, text).map_err(refused)?;
    let id = format!("cmpl-{:x}", rand_id());
    let model = s.model_name.clone();
    let tok = s.tokenizer.clone();
    if req.stream {
        let format = move |item: Item| {
            let tok = tok.as_deref();
            let (choice, usage) = match item {
                Item::Token { id, text, logprobs, .. } => {
                    (completion_choice(&[id], text, logprobs, None, tok), None)
                }
                Item::Done { tail, finish, usage, .. } => {
                    (completion_choice(&[], tail, None, Some(finish), tok), Some(usage))
                }
            };
            let mut v = json!({"id": id, "object": "text_completion", "created": created(), "model": model, "choices": [choice]});
            if let Some(u) = usage {
                v["usage"] = u;
            }
            vec![v]
        };
        return Ok(sse(rx, Vec::new(), format).into_response());
    }
    let c = collect(rx).await?;
    let lp = (!c.logprobs.is_empty()).then(|| {
        let mut j = LogprobsJson::default();
        c.logprobs.iter().for_each(|lp| j.push(lp, tok.as_deref()));
        j.to_json()
    });
    let choice =
        json!({"index": 0, "text": c.text, "token_ids": c.ids, "logprobs": lp, "finish_reason": c.finish});
    Ok(Json(json!({
        "id": id, "object": "text_completion", "created": created(), "model": model,
        "choices": [choice], "usage": c.usage,
    }))
    .into_response())
}

/// A completion request refused before the queue took it, counted in
/// `moe_lanes_requests_total` by its outcome (the worker counts the requests it took).
pub(crate) fn refused(e: ApiError) -> ApiError {
    prom::request_refused(e.status);
    e
}

/// Queue a job (429 when the queue is full); its events come on the returned channel.
pub(crate) fn enqueue(
    s: &AppState,
    prompt: Vec<u32>,
    generation: moe_lanes::engine::GenerationOptions,
    text: Option<TextOut>,
) -> Result<tokio::sync::mpsc::Receiver<Event>, ApiError> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let job = CompletionJob { prompt, generation, text, events: tx, enqueued_at: Instant::now() };
    s.shared.waiting.fetch_add(1, Ordering::Relaxed);
    if s.jobs.try_send(job).is_err() {
        s.shared.waiting.fetch_sub(1, Ordering::Relaxed);
        return Err(ApiError::status(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "the request queue is full; retry later",
        ));
    }
    Ok(rx)
}

pub(crate) fn rand_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos());
    h.finish()
}

pub(crate) fn created() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn completion_choice(
    ids: &[u32],
    text: &str,
    logprobs: Option<&Logprobs>,
    finish: Option<&str>,
    tok: Option<&moe_lanes::text::Tokenizer>,
) -> Value {
    let lp = logprobs.map_or(Value::Null, |lp| {
        let mut j = LogprobsJson::default();
        j.push(lp, tok);
        j.to_json()
    });
    json!({"index": 0, "text": text, "token_ids": ids, "logprobs": lp, "finish_reason": finish})
}

/// A token's name in logprobs: its text, as OpenAI's API gives it (bytes that are not UTF-8 on
/// their own, part of a character, come out as U+FFFD); `token_id:<id>` (vLLM's spelling) when
/// the model is served without a tokenizer.
fn token_name(id: u32, tok: Option<&moe_lanes::text::Tokenizer>) -> String {
    match tok.and_then(|t| t.token_bytes(id).ok()) {
        Some(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        None => format!("token_id:{id}"),
    }
}

/// The completions API's `logprobs` object, built token by token.
#[derive(Default)]
struct LogprobsJson {
    tokens: Vec<String>,
    token_logprobs: Vec<f32>,
    top_logprobs: Vec<serde_json::Map<String, Value>>,
}

impl LogprobsJson {
    fn push(&mut self, lp: &Logprobs, tok: Option<&moe_lanes::text::Tokenizer>) {
        self.tokens.push(token_name(lp.chosen.id, tok));
        self.token_logprobs.push(lp.chosen.logprob);
        self.top_logprobs.push(lp.top.iter().map(|t| (token_name(t.id, tok), json!(t.logprob))).collect());
    }

    fn to_json(&self) -> Value {
        json!({
            "tokens": self.tokens, "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs, "text_offset": vec![0; self.tokens.len()],
        })
    }
}

pub(crate) fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens})
}

/// A whole generation, collected.
pub(crate) struct Collected {
    pub ids: Vec<u32>,
    pub text: String,
    /// A Harmony model's reasoning (empty otherwise).
    pub reasoning: String,
    /// Per token, when asked for.
    pub logprobs: Vec<Logprobs>,
    pub finish: &'static str,
    pub usage: Value,
}

pub(crate) async fn collect(mut rx: tokio::sync::mpsc::Receiver<Event>) -> Result<Collected, ApiError> {
    let mut ids = Vec::new();
    let mut text = String::new();
    let mut reasoning = String::new();
    let mut logprobs = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Token { id, text: piece, reasoning: thought, logprobs: lp } => {
                ids.push(id);
                text.push_str(&piece);
                reasoning.push_str(&thought);
                logprobs.extend(lp);
            }
            Event::Done { prompt_tokens, completion_tokens, finish, tail, tail_reasoning } => {
                text.push_str(&tail);
                reasoning.push_str(&tail_reasoning);
                let usage = usage(prompt_tokens, completion_tokens);
                return Ok(Collected { ids, text, reasoning, logprobs, finish: finish.openai(), usage });
            }
            Event::Failed(e) => {
                return Err(ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, "server_error", e))
            }
        }
    }
    Err(ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the engine stopped"))
}

/// One worker event, as a streaming formatter sees it.
pub(crate) enum Item<'a> {
    Token { id: u32, text: &'a str, reasoning: &'a str, logprobs: Option<&'a Logprobs> },
    Done { tail: &'a str, tail_reasoning: &'a str, finish: &'static str, usage: Value },
}

/// Server-sent events: `first` chunks, then what `format` makes of each event, then
/// `data: [DONE]`. A client that goes away drops the stream, and with it the generation.
pub(crate) fn sse(
    rx: tokio::sync::mpsc::Receiver<Event>,
    first: Vec<Value>,
    format: impl Fn(Item) -> Vec<Value> + Clone + Send + 'static,
) -> impl IntoResponse {
    use futures_util::stream::{self, StreamExt};
    let data =
        |v: Vec<Value>| v.into_iter().map(|v| SseEvent::default().data(v.to_string())).collect::<Vec<_>>();
    // The worker drops its sender after the last event, which ends this stream.
    let events = stream::unfold(rx, move |mut rx| {
        let format = format.clone();
        async move {
            let chunks = match rx.recv().await? {
                Event::Token { id, text, reasoning, logprobs } => data(format(Item::Token {
                    id,
                    text: &text,
                    reasoning: &reasoning,
                    logprobs: logprobs.as_ref(),
                })),
                Event::Done { prompt_tokens, completion_tokens, finish, tail, tail_reasoning } => {
                    let usage = usage(prompt_tokens, completion_tokens);
                    let finish = finish.openai();
                    data(format(Item::Done { tail: &tail, tail_reasoning: &tail_reasoning, finish, usage }))
                }
                Event::Failed(e) => {
                    vec![SseEvent::default()
                        .data(json!({"error": {"message": e, "type": "server_error"}}).to_string())]
                }
            };
            Some((stream::iter(chunks.into_iter().map(Ok::<_, std::convert::Infallible>)), rx))
        }
    })
    .flatten();
    let first = stream::iter(data(first).into_iter().map(Ok));
    let done = stream::once(async { Ok(SseEvent::default().data("[DONE]")) });
    Sse::new(first.chain(events).chain(done))
}
