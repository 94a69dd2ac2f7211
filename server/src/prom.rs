//! Prometheus metrics. Request-level figures (queue wait, time to first token, inter-token
//! latency, request latency, tokens) record through the `metrics` facade with handles made once;
//! the per-layer engine figures are kept by the engine's perf state (the one store the perf JSON
//! is also rendered from) and copied into the facade after each request, so `/metrics` and
//! `/moe-layer-perf` never disagree. Names follow Prometheus conventions: `moe_lanes_` prefix,
//! base units, `_total` counters, `_seconds` histograms.

use metrics::{counter, gauge, histogram, Counter, Histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use moe_lanes::perf::{FallbackReason, PerfReport};
use std::sync::OnceLock;
use std::time::Duration;

/// Buckets for per-token and per-layer latencies: 50 µs to 10 s.
const LATENCY_BUCKETS_S: [f64; 16] =
    [5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

/// Install the recorder (once per process) and return the handle that renders `/metrics`.
pub fn install() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &LATENCY_BUCKETS_S)
                .expect("non-empty buckets")
                .build_recorder();
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder).expect("the only recorder of this process");
            describe();
            handles();
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
    describe_counter!("moe_lanes_requests_total", "Requests by outcome.");
    describe_gauge!("moe_lanes_requests_running", "Requests being generated.");
    describe_gauge!("moe_lanes_requests_waiting", "Requests in the queue.");
    describe_counter!("moe_lanes_layer_hot_slots_total", "Routed slots served by the hot lane, per layer.");
    describe_counter!("moe_lanes_layer_cold_slots_total", "Routed slots served by the cold lane, per layer.");
    describe_counter!("moe_lanes_layer_lane_busy_seconds", "Busy time so far per layer and lane (hot, cold).");
    describe_counter!("moe_lanes_layer_overlap_seconds", "Time so far both lanes ran at once, per layer.");
    describe_counter!("moe_lanes_layer_join_wait_seconds", "Time so far the join waited, per layer.");
    describe_counter!("moe_lanes_layer_calls_total", "Forward calls through the layer's MoE block.");
    describe_counter!("moe_lanes_fallbacks_total", "Layers that ran all-cold, by layer and reason.");
    describe_counter!("moe_lanes_cache_updates_total", "Hot-cache updates applied.");
    describe_gauge!("moe_lanes_hot_bytes", "Bytes held by the hot cache.");
    describe_gauge!("moe_lanes_perf_mode", "Perf mode (1 on the current mode's label).");
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
    })
}

pub fn request_started(queue_wait: Duration) {
    handles().queue_wait.record(queue_wait.as_secs_f64());
}

pub fn first_token(after: Duration) {
    handles().ttft.record(after.as_secs_f64());
}

pub fn inter_token(gap: Duration) {
    handles().itl.record(gap.as_secs_f64());
}

pub fn request_finished(took: Duration, prompt_tokens: usize, generated: usize) {
    let h = handles();
    h.request.record(took.as_secs_f64());
    h.prompt_tokens.increment(prompt_tokens as u64);
    h.generated_tokens.increment(generated as u64);
    h.ok.increment(1);
}

pub fn request_failed() {
    handles().failed.increment(1);
}

pub fn request_cancelled() {
    handles().cancelled.increment(1);
}

pub fn queue_depth(running: u64, waiting: u64) {
    gauge!("moe_lanes_requests_running").set(running as f64);
    gauge!("moe_lanes_requests_waiting").set(waiting as f64);
}

/// Copy the perf state's per-layer totals into the facade (after each request; the perf state
/// is the store, these are its Prometheus view). Per-expert counts stay in the JSON only.
pub fn record_perf(report: &PerfReport, hot_bytes: u64) {
    for l in &report.layers {
        let layer = l.layer.to_string();
        counter!("moe_lanes_layer_hot_slots_total", "layer" => layer.clone()).absolute(l.hot_slots_total);
        counter!("moe_lanes_layer_cold_slots_total", "layer" => layer.clone()).absolute(l.cold_slots_total);
        counter!("moe_lanes_layer_calls_total", "layer" => layer.clone()).absolute(l.calls);
        let secs = |us: u64| us as f64 / 1e6;
        gauge!("moe_lanes_layer_lane_busy_seconds", "layer" => layer.clone(), "lane" => "hot")
            .set(secs(l.parallel_hot_time_us));
        gauge!("moe_lanes_layer_lane_busy_seconds", "layer" => layer.clone(), "lane" => "cold")
            .set(secs(l.parallel_cold_time_us));
        gauge!("moe_lanes_layer_overlap_seconds", "layer" => layer.clone()).set(secs(l.parallel_overlap_us));
        gauge!("moe_lanes_layer_join_wait_seconds", "layer" => layer.clone())
            .set(secs(l.parallel_join_wait_us));
        for reason in FallbackReason::ALL {
            let n = l.fallback_reasons.get(reason.name()).copied().unwrap_or(0);
            counter!("moe_lanes_fallbacks_total", "layer" => layer.clone(), "reason" => reason.name()).absolute(n);
        }
    }
    counter!("moe_lanes_cache_updates_total").absolute(report.updates);
    gauge!("moe_lanes_hot_bytes").set(hot_bytes as f64);
    for mode in ["full", "update", "off"] {
        let on = serde_json::to_value(report.mode).ok().and_then(|v| v.as_str().map(|s| s == mode)) == Some(true);
        gauge!("moe_lanes_perf_mode", "mode" => mode).set(if on { 1.0 } else { 0.0 });
    }
}
