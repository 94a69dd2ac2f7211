//! Request bodies, validated field by field (an error names the field), and OpenAI-shaped JSON
//! errors and responses.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
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
        let body = json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": null}});
        (self.status, axum::Json(body)).into_response()
    }
}

/// The body as a JSON object (413 past the limit, 400 on anything but an object).
pub fn object(body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>) -> Result<Map<String, Value>, ApiError> {
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
    pub max_tokens: usize,
    pub stream: bool,
}

/// Fields accepted with only their default meaning (anything else there is refused, not ignored).
const NEUTRAL: [(&str, fn(&Value) -> bool); 9] = [
    ("model", |v| v.is_string()),
    ("n", |v| v.as_u64() == Some(1)),
    ("temperature", |v| v.as_f64() == Some(0.0)),
    ("top_p", |v| v.as_f64() == Some(1.0)),
    ("echo", |v| v.as_bool() == Some(false)),
    ("user", |v| v.is_string()),
    ("logprobs", |v| v.is_null()),
    ("presence_penalty", |v| v.as_f64() == Some(0.0)),
    ("frequency_penalty", |v| v.as_f64() == Some(0.0)),
];

/// Parse a completion request for a model of `vocab` tokens.
pub fn completion(body: &Map<String, Value>, vocab: usize) -> Result<CompletionRequest, ApiError> {
    for (key, value) in body {
        match key.as_str() {
            "prompt" | "max_tokens" | "stream" => {}
            k => match NEUTRAL.iter().find(|(name, _)| *name == k) {
                Some((_, ok)) if ok(value) => {}
                Some(_) => return Err(ApiError::bad(k, format!("{k}: only greedy decoding of one choice is served (sampling comes with the text API); got {value}"))),
                None => return Err(ApiError::bad(k, format!("unknown field '{k}'"))),
            },
        }
    }
    let prompt = prompt_ids(body.get("prompt"), vocab)?;
    let max_tokens = match body.get("max_tokens") {
        None | Some(Value::Null) => DEFAULT_MAX_TOKENS,
        Some(v) => v.as_u64().filter(|&n| n >= 1).ok_or_else(|| ApiError::bad("max_tokens", format!("max_tokens must be a whole number of at least 1; got {v}")))? as usize,
    };
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(v) => v.as_bool().ok_or_else(|| ApiError::bad("stream", format!("stream must be true or false; got {v}")))?,
    };
    Ok(CompletionRequest { prompt, max_tokens, stream })
}

fn prompt_ids(v: Option<&Value>, vocab: usize) -> Result<Vec<u32>, ApiError> {
    let Some(v) = v else { return Err(ApiError::bad("prompt", "prompt is required")) };
    let ids = match v {
        Value::String(_) => return Err(ApiError::bad("prompt", "text prompts need the text API (not in this build): pass the prompt as an array of token ids")),
        Value::Array(items) if items.len() == 1 && items[0].is_array() => items[0].as_array().expect("checked"),
        Value::Array(items) if items.iter().any(Value::is_array) => return Err(ApiError::bad("prompt", "one prompt per request: a batch of prompts is not served")),
        Value::Array(items) => items,
        other => return Err(ApiError::bad("prompt", format!("prompt must be an array of token ids; got {other}"))),
    };
    if ids.is_empty() {
        return Err(ApiError::bad("prompt", "prompt is empty"));
    }
    ids.iter()
        .enumerate()
        .map(|(i, id)| match id.as_u64() {
            Some(n) if (n as usize) < vocab => Ok(n as u32),
            _ => Err(ApiError::bad("prompt", format!("prompt[{i}] = {id}: token ids are whole numbers below the vocabulary size {vocab}"))),
        })
        .collect()
}
