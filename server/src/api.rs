//! Request bodies, validated field by field (an error names the field), and OpenAI-shaped JSON
//! errors and responses.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use moe_lanes::engine::GenerationOptions;
use moe_lanes::sample::SamplingParams;
use moe_lanes::text::{StopStrings, Tokenizer};
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
    /// OpenAI's machine-readable `code` (`context_length_exceeded`), when there is one.
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn bad(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param: Some(param.into()),
            code: None,
        }
    }

    pub fn status(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, kind, message: message.into(), param: None, code: None }
    }

    /// The prompt and `max_tokens` do not fit the context: names both numbers and the limit,
    /// and the field to shorten (`prompt_param` when the prompt alone is too long).
    pub fn context(prompt_param: &str, prompt_tokens: usize, max_tokens: usize, ctx: usize) -> ApiError {
        let asked = prompt_tokens.saturating_add(max_tokens);
        let (param, advice) = if prompt_tokens >= ctx {
            (prompt_param, format!("shorten the prompt to fewer than {ctx} tokens"))
        } else {
            (
                "max_tokens",
                format!("shorten the prompt or ask for at most {} max_tokens", ctx - prompt_tokens),
            )
        };
        let message = format!(
            "this model's context is {ctx} tokens, but {asked} were asked for: {prompt_tokens} in the \
             prompt + {max_tokens} max_tokens; {advice}"
        );
        ApiError { code: Some("context_length_exceeded"), ..ApiError::bad(param, message) }
    }
}

/// The request fits the context (prompt + max_tokens <= ctx), else [`ApiError::context`].
pub fn check_fits(
    prompt_param: &str,
    prompt_tokens: usize,
    max_tokens: usize,
    ctx: usize,
) -> Result<(), ApiError> {
    match prompt_tokens.checked_add(max_tokens) {
        Some(n) if n <= ctx => Ok(()),
        _ => Err(ApiError::context(prompt_param, prompt_tokens, max_tokens, ctx)),
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}});
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
#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub prompt: Vec<u32>,
    pub stream: bool,
    /// Tokens, stop ids (with the tokenizer's end-of-generation ids) and sampling.
    pub generation: GenerationOptions,
    /// Stop strings (text requests; needs the tokenizer).
    pub stops: StopStrings,
}

/// Most alternatives the completions API's `logprobs` may ask for (OpenAI's limit).
pub const MAX_COMPLETION_LOGPROBS: u64 = 5;

/// Whether a field's value is its default meaning.
type IsNeutral = fn(&Value) -> bool;

/// Fields accepted with only their default meaning (anything else there is refused, not ignored).
const NEUTRAL: [(&str, IsNeutral); 4] = [
    ("model", |v| v.is_string()),
    ("n", |v| v.as_u64() == Some(1)),
    ("echo", |v| v.as_bool() == Some(false)),
    ("user", |v| v.is_string()),
];

/// The fields this server reads (besides the neutral ones).
const FIELDS: [&str; 16] = [
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
    "ignore_eos",
];

/// Refuse fields this server does not read; accept the neutral ones only with their default.
pub(crate) fn known_fields(body: &Map<String, Value>, fields: &[&str]) -> Result<(), ApiError> {
    for (key, value) in body {
        match key.as_str() {
            k if fields.contains(&k) => {}
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
    Ok(())
}

/// Parse a completion request for a model of `vocab` tokens; text prompts and stop strings
/// need `tok`. The context check is the caller's (it knows the limit).
pub fn completion(
    body: &Map<String, Value>,
    vocab: usize,
    tok: Option<&Tokenizer>,
) -> Result<CompletionRequest, ApiError> {
    known_fields(body, &FIELDS)?;
    let (prompt, is_text) = prompt(body.get("prompt"), vocab, tok)?;
    let max_tokens = max_tokens(body, "max_tokens")?.unwrap_or(DEFAULT_MAX_TOKENS);
    let stream = flag(body, "stream")?;
    let sampling = sampling(body)?;
    let (mut stop_ids, stops) = stop(body, vocab, tok)?;
    stop_ids.extend(token_ids(body, "stop_token_ids", vocab)?);
    // Text prompts end at the model's end-of-generation tokens (as `run` does) unless
    // `ignore_eos` (llama-server's field, for benchmarks); token-id prompts only at the ids given
    // (as `generate` does).
    if is_text && !flag(body, "ignore_eos")? {
        stop_ids.extend(tok.map_or(&[][..], Tokenizer::eog_ids));
    }
    Ok(CompletionRequest {
        prompt,
        stream,
        generation: GenerationOptions { max_tokens, stop_ids, sampling },
        stops,
    })
}

/// A `max_tokens`-like field: a whole number of at least 1, or absent.
pub(crate) fn max_tokens(body: &Map<String, Value>, key: &str) -> Result<Option<usize>, ApiError> {
    present(body, key)
        .map(|v| {
            v.as_u64().filter(|&n| n >= 1).map(|n| n as usize).ok_or_else(|| {
                ApiError::bad(key, format!("{key} must be a whole number of at least 1; got {v}"))
            })
        })
        .transpose()
}

pub(crate) fn flag(body: &Map<String, Value>, key: &str) -> Result<bool, ApiError> {
    match present(body, key) {
        None => Ok(false),
        Some(v) => {
            v.as_bool().ok_or_else(|| ApiError::bad(key, format!("{key} must be true or false; got {v}")))
        }
    }
}

/// `stop`: token ids (a number or an array of numbers) or stop strings (a string or an array of
/// strings, as many as the library's `MAX_STOP_STRINGS`; they need the tokenizer).
pub(crate) fn stop(
    body: &Map<String, Value>,
    vocab: usize,
    tok: Option<&Tokenizer>,
) -> Result<(Vec<u32>, StopStrings), ApiError> {
    let strings: Vec<String> = match present(body, "stop") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) if !items.is_empty() && items.iter().all(Value::is_string) => {
            items.iter().filter_map(Value::as_str).map(str::to_string).collect()
        }
        _ => return Ok((token_ids(body, "stop", vocab)?, StopStrings::default())),
    };
    if tok.is_none() {
        return Err(ApiError::bad(
            "stop",
            "stop strings need the model's tokenizer, and this model has none; give token ids",
        ));
    }
    let stops = StopStrings::new(strings).map_err(|e| ApiError::bad("stop", format!("stop: {e}")))?;
    Ok((Vec::new(), stops))
}

/// A field that is there and not null.
pub(crate) fn present<'a>(body: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
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
pub(crate) fn sampling(body: &Map<String, Value>) -> Result<SamplingParams, ApiError> {
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

/// `stop` / `stop_token_ids` as token ids.
fn token_ids(body: &Map<String, Value>, key: &str, vocab: usize) -> Result<Vec<u32>, ApiError> {
    let items = match present(body, key) {
        None => return Ok(Vec::new()),
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

/// The prompt: text (a string, or an array of one string; needs the tokenizer, which encodes
/// it as `run` does: BOS as the metadata says, control tokens written in the text parsed) or
/// token ids (an array, or an array of one array).
/// Returns the ids and whether the prompt was text.
fn prompt(v: Option<&Value>, vocab: usize, tok: Option<&Tokenizer>) -> Result<(Vec<u32>, bool), ApiError> {
    let Some(v) = v else { return Err(ApiError::bad("prompt", "prompt is required")) };
    let batch =
        || ApiError::bad("prompt", "one prompt per request: a batch of several prompts is not served");
    let ids = match v {
        Value::String(text) => return Ok((text_prompt(text, tok)?, true)),
        Value::Array(items) if items.len() == 1 && items[0].is_string() => {
            return Ok((text_prompt(items[0].as_str().expect("checked"), tok)?, true))
        }
        Value::Array(items) if items.len() == 1 && items[0].is_array() => {
            items[0].as_array().expect("checked")
        }
        Value::Array(items) if items.len() > 1 && items.iter().all(|i| i.is_array() || i.is_string()) => {
            return Err(batch())
        }
        Value::Array(items) => items,
        other => {
            return Err(ApiError::bad(
                "prompt",
                format!("prompt must be a string or an array of token ids; got {other}"),
            ))
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
        .collect::<Result<Vec<u32>, ApiError>>()
        .map(|ids| (ids, false))
}

fn text_prompt(text: &str, tok: Option<&Tokenizer>) -> Result<Vec<u32>, ApiError> {
    let tok = tok.ok_or_else(|| {
        ApiError::bad(
            "prompt",
            "text prompts need the model's tokenizer, and this model has none; pass token ids",
        )
    })?;
    let ids = tok.encode(text, true, true).map_err(|e| ApiError::bad("prompt", e.to_string()))?;
    if ids.is_empty() {
        return Err(ApiError::bad("prompt", "prompt is empty"));
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;
    use moe_lanes::text::Tokenizer;

    fn qwen_tokenizer() -> Tokenizer {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tokenizers/ggml-vocab-qwen2.gguf");
        Tokenizer::from_gguf_path(path.as_ref()).unwrap()
    }

    /// Text prompts stop at the model's end-of-generation ids unless `ignore_eos` (llama-server's
    /// benchmark field); a non-boolean `ignore_eos` is refused by name.
    #[test]
    fn ignore_eos_drops_the_end_of_generation_stops_of_text_prompts() {
        let tok = qwen_tokenizer();
        let vocab = 151_936;
        let req = |extra: Value| {
            let mut body = serde_json::json!({"prompt": "hello", "max_tokens": 8});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            completion(body.as_object().unwrap(), vocab, Some(&tok))
        };
        let eog = tok.eog_ids();
        assert!(!eog.is_empty());
        let plain = req(serde_json::json!({})).unwrap().generation.stop_ids;
        assert!(eog.iter().all(|id| plain.contains(id)), "{plain:?}");
        let ignored = req(serde_json::json!({"ignore_eos": true})).unwrap().generation.stop_ids;
        assert!(eog.iter().all(|id| !ignored.contains(id)), "{ignored:?}");
        let kept = req(serde_json::json!({"ignore_eos": false})).unwrap().generation.stop_ids;
        assert_eq!(kept, plain);
        let Err(e) = req(serde_json::json!({"ignore_eos": "yes"})) else { panic!("a string was taken") };
        assert!(format!("{e:?}").contains("ignore_eos"), "{e:?}");
    }
}
