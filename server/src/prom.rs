//! Prometheus metrics: the exporter (the only place that knows Prometheus) and the server's own
//! figures. Request-level figures (queue wait, time to first token, inter-token latency, request
//! latency, tokens, requests running and waiting) and engine gauges (hot bytes, budget, free
//! device memory) record through the `metrics` facade with handles made once. The per-layer
//! figures (slots, calls, lane times, overlap, join wait, fallbacks, exchanges, perf mode) are
//! recorded by the library's perf state itself, per layer call, through handles it registered
//! when it was created; the exporter installed here is what they land in. Names follow
//! Prometheus conventions: `moe_lanes_` prefix, base units, `_total` counters, `_seconds`
//! histograms.

use metrics::{counter, gauge, histogram, Counter, Gauge, Histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use moe_lanes::perf::{metric_names, LAYER_BUCKETS_S};
use std::sync::OnceLock;
use std::time::Duration;

/// Buckets for per-token and per-request latencies: 50 µs to 10 s.
const LATENCY_BUCKETS_S: [f64; 16] =
    [5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

/// Buckets for the requests of one batched step.
const BATCH_SIZE_BUCKETS: [f64; 9] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

/// How often histogram samples are folded into their buckets between scrapes (bounds the
/// memory samples hold when nobody scrapes).
const UPKEEP_EVERY: Duration = Duration::from_secs(2);

/// Install the recorder (once per process) and return the handle that renders `/metrics`.
/// Per-layer-call histograms get µs–ms buckets, the other `_seconds` histograms 50 µs–10 s.
pub fn install() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Prefix(metric_names::LAYER_PREFIX.into()), &LAYER_BUCKETS_S)
                .expect("non-empty buckets")
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &LATENCY_BUCKETS_S)
                .expect("non-empty buckets")
                .set_buckets_for_metric(Matcher::Full("moe_lanes_batch_size".into()), &BATCH_SIZE_BUCKETS)
                .expect("non-empty buckets")
                .build_recorder();
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder).expect("the only recorder of this process");
            describe();
            moe_lanes::perf::describe_metrics();
            handles();
            let upkeep = handle.clone();
            let _ = std::thread::Builder::new().name("metrics-upkeep".into()).spawn(move || loop {
                std::thread::sleep(UPKEEP_EVERY);
                upkeep.run_upkeep();
            });
            handle
        })
        .clone()
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_histogram!("moe_lanes_queue_wait_seconds", Unit::Seconds, "Time a request waited in the queue.");
    describe_histogram!("moe_lanes_time_to_first_token_seconds", Unit::Seconds, "Prefill to first token.");
    describe_histogram!("moe_lanes_inter_token_seconds", Unit::Seconds, "Time between generated tokens.");
    describe_histogram!("moe_lanes_request_seconds", Unit::Seconds, "Request latency once started.");
    describe_counter!("moe_lanes_prompt_tokens_total", "Prompt tokens processed.");
    describe_counter!("moe_lanes_generated_tokens_total", "Tokens generated.");
    describe_counter!(
        "moe_lanes_requests_total",
        "Completion requests by outcome: ok, error, cancelled (after the queue took them), rejected (429, queue full) and invalid (4xx, refused before the queue)."
    );
    describe_gauge!("moe_lanes_requests_running", "Requests being generated.");
    describe_gauge!("moe_lanes_requests_waiting", "Requests in the queue.");
    describe_counter!("moe_lanes_cache_updates_total", "Manual hot-cache applies (POST /moe-hot-cache).");
    describe_gauge!("moe_lanes_hot_bytes", Unit::Bytes, "Bytes held by the hot cache.");
    describe_gauge!(
        "moe_lanes_hot_budget_bytes",
        Unit::Bytes,
        "Hot-cache budget the engine was planned for."
    );
    describe_gauge!("moe_lanes_device_free_bytes", Unit::Bytes, "Free device memory (GPU engine only).");
    describe_histogram!("moe_lanes_batch_size", "Requests in one batched engine step.");
    describe_counter!("moe_lanes_prefix_cache_lookups_total", "Requests that looked for a kept prefix.");
    describe_counter!("moe_lanes_prefix_cache_hits_total", "Requests that reused a kept prefix's KV cache.");
    describe_counter!(
        "moe_lanes_prefix_cache_reused_tokens_total",
        "Prompt tokens whose prefill a kept prefix saved."
    );
    describe_histogram!("moe_lanes_step_seconds", Unit::Seconds, "Time of one batched engine step.");
    describe_gauge!(
        "moe_lanes_kv_cache_usage_ratio",
        "KV-cache positions the running requests reserve over what --parallel requests of the full context may hold (0 to 1)."
    );
}

/// The handles used per token or per request, made once.
struct Handles {
    queue_wait: Histogram,
    ttft: Histogram,
    itl: Histogram,
    request: Histogram,
    prompt_tokens: Counter,
    generated_tokens: Counter,
    ok: Counter,
    failed: Counter,
    cancelled: Counter,
    rejected: Counter,
    invalid: Counter,
    running: Gauge,
    waiting: Gauge,
    cache_updates: Counter,
    hot_bytes: Gauge,
    batch_size: Histogram,
    step: Histogram,
    kv_usage: Gauge,
    prefix_lookups: Counter,
    prefix_hits: Counter,
    prefix_tokens: Counter,
}

fn handles() -> &'static Handles {
    static H: OnceLock<Handles> = OnceLock::new();
    H.get_or_init(|| Handles {
        queue_wait: histogram!("moe_lanes_queue_wait_seconds"),
        ttft: histogram!("moe_lanes_time_to_first_token_seconds"),
        itl: histogram!("moe_lanes_inter_token_seconds"),
        request: histogram!("moe_lanes_request_seconds"),
        prompt_tokens: counter!("moe_lanes_prompt_tokens_total"),
        generated_tokens: counter!("moe_lanes_generated_tokens_total"),
        ok: counter!("moe_lanes_requests_total", "outcome" => "ok"),
        failed: counter!("moe_lanes_requests_total", "outcome" => "error"),
        cancelled: counter!("moe_lanes_requests_total", "outcome" => "cancelled"),
        rejected: counter!("moe_lanes_requests_total", "outcome" => "rejected"),
        invalid: counter!("moe_lanes_requests_total", "outcome" => "invalid"),
        running: gauge!("moe_lanes_requests_running"),
        waiting: gauge!("moe_lanes_requests_waiting"),
        cache_updates: counter!("moe_lanes_cache_updates_total"),
        hot_bytes: gauge!("moe_lanes_hot_bytes"),
        batch_size: histogram!("moe_lanes_batch_size"),
        step: histogram!("moe_lanes_step_seconds"),
        kv_usage: gauge!("moe_lanes_kv_cache_usage_ratio"),
        prefix_lookups: counter!("moe_lanes_prefix_cache_lookups_total"),
        prefix_hits: counter!("moe_lanes_prefix_cache_hits_total"),
        prefix_tokens: counter!("moe_lanes_prefix_cache_reused_tokens_total"),
    })
}

/// A request left the queue; its prompt is processed now.
pub fn request_started(queue_wait: Duration, prompt_tokens: usize) {
    let h = handles();
    h.queue_wait.record(queue_wait.as_secs_f64());
    h.prompt_tokens.increment(prompt_tokens as u64);
}

/// The first token was generated (tokens count as they come, so throughput is live).
pub fn first_token(after: Duration) {
    handles().ttft.record(after.as_secs_f64());
    handles().generated_tokens.increment(1);
}

/// One more token was generated, `gap` after the previous one.
pub fn inter_token(gap: Duration) {
    handles().itl.record(gap.as_secs_f64());
    handles().generated_tokens.increment(1);
}

pub fn request_finished(took: Duration) {
    let h = handles();
    h.request.record(took.as_secs_f64());
    h.ok.increment(1);
}

pub fn request_failed() {
    handles().failed.increment(1);
}

pub fn request_cancelled() {
    handles().cancelled.increment(1);
}

/// A completion request refused before the queue took it: `rejected` (429, the queue is full),
/// `error` (5xx) or `invalid` (any other status: a malformed or unanswerable request).
pub fn request_refused(status: axum::http::StatusCode) {
    let h = handles();
    match status {
        axum::http::StatusCode::TOO_MANY_REQUESTS => h.rejected.increment(1),
        s if s.is_server_error() => h.failed.increment(1),
        _ => h.invalid.increment(1),
    }
}

pub fn queue_depth(running: u64, waiting: u64) {
    handles().running.set(running as f64);
    handles().waiting.set(waiting as f64);
}

/// One batched engine step: how many requests it ran and how long it took.
pub fn batch_step(sequences: usize, took: Duration) {
    handles().batch_size.record(sequences as f64);
    handles().step.record(took.as_secs_f64());
}

/// Prefix reuse since the last call: lookups, hits and prompt tokens saved.
pub fn prefix_reuse(lookups: u64, hits: u64, tokens: u64) {
    let h = handles();
    h.prefix_lookups.increment(lookups);
    h.prefix_hits.increment(hits);
    h.prefix_tokens.increment(tokens);
}

/// The share of the KV-cache positions the running requests reserve.
pub fn kv_cache_usage(ratio: f64) {
    handles().kv_usage.set(ratio);
}

/// A manual hot-cache apply went through.
pub fn cache_updated() {
    handles().cache_updates.increment(1);
}

/// Engine gauges, after each request or apply: hot bytes, and the budget and free device
/// memory where the engine knows them (their handles are made the first time they are known,
/// so an engine without a budget or a device exports no made-up zero).
pub fn engine_gauges(hot_bytes: u64, budget_bytes: Option<u64>, device_free_bytes: Option<u64>) {
    static BUDGET: OnceLock<Gauge> = OnceLock::new();
    static FREE: OnceLock<Gauge> = OnceLock::new();
    handles().hot_bytes.set(hot_bytes as f64);
    if let Some(b) = budget_bytes {
        BUDGET.get_or_init(|| gauge!("moe_lanes_hot_budget_bytes")).set(b as f64);
    }
    if let Some(f) = device_free_bytes {
        FREE.get_or_init(|| gauge!("moe_lanes_device_free_bytes")).set(f as f64);
    }
}
