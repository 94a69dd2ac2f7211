//! Request bodies, validated field by field (an error names the field), and OpenAI-shaped JSON
//! errors and responses.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use moe_lanes::engine::GenerationOptions;
use moe_lanes::sample::SamplingParams;
use serde_json::{json, Map, Value};

/// Largest request body accepted.
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// Default `max_tokens` of a completion (OpenAI's default).
pub const DEFAULT_MAX_TOKENS: usize = 16;

/// An HTTP error with an OpenAI-shaped JSON body.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    pub fn bad(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param: Some(param.into()),
        }
    }

    pub fn status(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, kind, message: message.into(), param: None }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body =
            json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": null}});
        (self.status, axum::Json(body)).into_response()
    }
}

/// The body as a JSON object (413 past the limit, 400 on anything but an object).
pub fn object(
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<Map<String, Value>, ApiError> {
    let bytes = body.map_err(|e| ApiError::status(e.status(), "invalid_request_error", e.body_text()))?;
    let value: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad("(body)", format!("body is not JSON: {e}")))?;
    match value {
        Value::Object(m) => Ok(m),
        _ => Err(ApiError::bad("(body)", "body must be a JSON object")),
    }
}

/// A validated `POST /v1/completions`.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    pub prompt: Vec<u32>,
    pub stream: bool,
    /// Tokens, stop ids and sampling.
    pub generation: GenerationOptions,
}

/// Most alternatives the completions API's `logprobs` may ask for (OpenAI's limit).
pub const MAX_COMPLETION_LOGPROBS: u64 = 5;

/// Fields accepted with only their default meaning (anything else there is refused, not ignored).
const NEUTRAL: [(&str, fn(&Value) -> bool); 4] = [
    ("model", |v| v.is_string()),
    ("n", |v| v.as_u64() == Some(1)),
    ("echo", |v| v.as_bool() == Some(false)),
    ("user", |v| v.is_string()),
];

/// The fields this server reads (besides the neutral ones).
const FIELDS: [&str; 15] = [
    "prompt",
    "max_tokens",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "logprobs",
    "stop",
    "stop_token_ids",
    "stream_options",
];

/// Parse a completion request for a model of `vocab` tokens.
pub fn completion(body: &Map<String, Value>, vocab: usize) -> Result<CompletionRequest, ApiError> {
    for (key, value) in body {
        match key.as_str() {
            k if FIELDS.contains(&k) => {}
            k => match NEUTRAL.iter().find(|(name, _)| *name == k) {
                Some((_, ok)) if ok(value) => {}
                Some(_) => {
                    return Err(ApiError::bad(
                        k,
                        format!("{k}: only one choice, without echo, is served; got {value}"),
                    ))
                }
                None => return Err(ApiError::bad(k, format!("unknown field '{k}'"))),
            },
        }
    }
    let prompt = prompt_ids(body.get("prompt"), vocab)?;
    let max_tokens = match present(body, "max_tokens") {
        None => DEFAULT_MAX_TOKENS,
        Some(v) => v.as_u64().filter(|&n| n >= 1).ok_or_else(|| {
            ApiError::bad("max_tokens", format!("max_tokens must be a whole number of at least 1; got {v}"))
        })? as usize,
    };
    let stream = match present(body, "stream") {
        None => false,
        Some(v) => v
            .as_bool()
            .ok_or_else(|| ApiError::bad("stream", format!("stream must be true or false; got {v}")))?,
    };
    let sampling = sampling(body)?;
    let mut stop_ids = token_ids(body, "stop", vocab)?;
    stop_ids.extend(token_ids(body, "stop_token_ids", vocab)?);
    Ok(CompletionRequest { prompt, stream, generation: GenerationOptions { max_tokens, stop_ids, sampling } })
}

/// A field that is there and not null.
fn present<'a>(body: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    body.get(key).filter(|v| !v.is_null())
}

fn number(body: &Map<String, Value>, key: &str, default: f32) -> Result<f32, ApiError> {
    match present(body, key) {
        None => Ok(default),
        Some(v) => v
            .as_f64()
            .map(|x| x as f32)
            .ok_or_else(|| ApiError::bad(key, format!("{key} must be a number; got {v}"))),
    }
}

/// The sampling fields, typed and range-checked (an error names the field).
fn sampling(body: &Map<String, Value>) -> Result<SamplingParams, ApiError> {
    let d = SamplingParams::default();
    let whole = |key: &str| -> Result<Option<u64>, ApiError> {
        present(body, key)
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| ApiError::bad(key, format!("{key} must be a whole number >= 0; got {v}")))
            })
            .transpose()
    };
    // top_k: -1 is "off" in vLLM and llama.cpp's server, as 0 is here.
    let top_k = match present(body, "top_k") {
        Some(v) if v.as_i64() == Some(-1) => 0,
        _ => whole("top_k")?.unwrap_or(0) as usize,
    };
    let logprobs = whole("logprobs")?;
    if let Some(n) = logprobs.filter(|&n| n > MAX_COMPLETION_LOGPROBS) {
        return Err(ApiError::bad(
            "logprobs",
            format!("logprobs = {n}: at most {MAX_COMPLETION_LOGPROBS} alternatives"),
        ));
    }
    let p = SamplingParams {
        temperature: number(body, "temperature", 1.0)?,
        top_k,
        top_p: number(body, "top_p", d.top_p)?,
        min_p: number(body, "min_p", d.min_p)?,
        repetition_penalty: number(body, "repetition_penalty", d.repetition_penalty)?,
        presence_penalty: number(body, "presence_penalty", d.presence_penalty)?,
        frequency_penalty: number(body, "frequency_penalty", d.frequency_penalty)?,
        penalty_last_n: d.penalty_last_n,
        seed: whole("seed")?,
        logprobs: logprobs.map(|n| n as usize),
    };
    p.validate().map_err(|e| ApiError::bad(e.field, e.to_string()))?;
    Ok(p)
}

/// `stop` / `stop_token_ids` as token ids (stop strings need the text API).
fn token_ids(body: &Map<String, Value>, key: &str, vocab: usize) -> Result<Vec<u32>, ApiError> {
    let items = match present(body, key) {
        None => return Ok(Vec::new()),
        Some(Value::String(_)) => {
            return Err(ApiError::bad(
                key,
                format!("{key}: stop strings need the text API (not in this build); give token ids"),
            ))
        }
        Some(Value::Array(items)) => items,
        Some(v) if v.is_u64() => std::slice::from_ref(v),
        Some(v) => return Err(ApiError::bad(key, format!("{key} must be an array of token ids; got {v}"))),
    };
    items
        .iter()
        .enumerate()
        .map(|(i, id)| match id.as_u64() {
            Some(n) if (n as usize) < vocab => Ok(n as u32),
            _ => Err(ApiError::bad(
                key,
                format!("{key}[{i}] = {id}: token ids are whole numbers below the vocabulary size {vocab}"),
            )),
        })
        .collect()
}

fn prompt_ids(v: Option<&Value>, vocab: usize) -> Result<Vec<u32>, ApiError> {
    let Some(v) = v else { return Err(ApiError::bad("prompt", "prompt is required")) };
    let ids = match v {
        Value::String(_) => return Err(ApiError::bad(
            "prompt",
            "text prompts need the text API (not in this build): pass the prompt as an array of token ids",
        )),
        Value::Array(items) if items.len() == 1 && items[0].is_array() => {
            items[0].as_array().expect("checked")
        }
        Value::Array(items) if items.iter().any(Value::is_array) => {
            return Err(ApiError::bad("prompt", "one prompt per request: a batch of prompts is not served"))
        }
        Value::Array(items) => items,
        other => {
            return Err(ApiError::bad("prompt", format!("prompt must be an array of token ids; got {other}")))
        }
    };
    if ids.is_empty() {
        return Err(ApiError::bad("prompt", "prompt is empty"));
    }
    ids.iter()
        .enumerate()
        .map(|(i, id)| match id.as_u64() {
            Some(n) if (n as usize) < vocab => Ok(n as u32),
            _ => Err(ApiError::bad(
                "prompt",
                format!("prompt[{i}] = {id}: token ids are whole numbers below the vocabulary size {vocab}"),
            )),
        })
        .collect()
}
