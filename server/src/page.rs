//! `GET /`: the live page, one self-contained HTML file (no external assets) whose script polls
//! `/health`, `/moe-hot-cache`, `/moe-layer-perf` and `/metrics` every second and shows, per
//! layer, hot experts, hot and cold slots, hit rate, the hot-cache policy's admissions and
//! evictions, lane times, overlap, join wait and fallbacks, an expert-use heatmap with the hot
//! experts outlined, and the serving figures.

use axum::http::header;
use axum::response::{IntoResponse, Response};

/// The page, compiled in.
const PAGE: &str = include_str!("page.html");

pub async fn page() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8"), (header::CACHE_CONTROL, "no-store")], PAGE)
        .into_response()
}
