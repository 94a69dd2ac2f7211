//! `POST /v1/chat/completions`: the messages rendered through the model's chat template (or
//! `serve --chat-template FILE`), generation to an end-of-generation token, `max_tokens` or a
//! stop string, and the answer as `choices[0].message` or, streamed, as `chat.completion.chunk`
//! deltas (the first names the role) ending in `data: [DONE]`.
//!
//! GPT-OSS (Harmony) as llama-server serves it: `reasoning_effort` (top level or in
//! `chat_template_kwargs`) goes to the template, an assistant message's `reasoning_content` is
//! its `thinking`, and the output is parsed on its tokens: the analysis channel is
//! `reasoning_content`, the final channel `content` (deltas of either when streamed).

use crate::api::{self, ApiError};
use crate::routes::{collect, created, enqueue, rand_id, refused, sse, AppState, Item};
use crate::worker::TextOut;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use moe_lanes::engine::GenerationOptions;
use moe_lanes::sample::Logprobs;
use moe_lanes::text::{
    ChatMessage, ChatTemplateError, HarmonyTokens, ReasoningEffort, RenderOptions, StopStrings, Tokenizer,
};
use serde_json::{json, Map, Value};
use std::sync::Arc;

/// The fields a chat request may carry (besides `model`, `n` = 1 and `user`).
const FIELDS: [&str; 19] = [
    "messages",
    "reasoning_effort",
    "chat_template_kwargs",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "logprobs",
    "top_logprobs",
    "stop",
    "ignore_eos",
];

/// A validated chat request.
pub struct ChatRequest {
    pub prompt: Vec<u32>,
    pub stream: bool,
    pub generation: GenerationOptions,
    pub stops: StopStrings,
    /// `logprobs: true`: each token's logprob (and `top_logprobs` alternatives).
    pub logprobs: bool,
    pub tokenizer: Arc<Tokenizer>,
    /// Parse the output as Harmony (a GPT-OSS model).
    pub harmony: Option<HarmonyTokens>,
}

/// Parse and render a chat request; `max_tokens` defaults to what the context has left.
pub fn parse(body: &Map<String, Value>, s: &AppState) -> Result<ChatRequest, ApiError> {
    api::known_fields(body, &FIELDS)?;
    let messages = messages(body.get("messages"))?;
    let (tok, template) = match (&s.tokenizer, &s.chat_template) {
        (Some(tok), Ok(t)) => (tok, t),
        (None, _) => {
            return Err(ApiError::bad(
                "messages",
                "chat needs the model's tokenizer, and this model has none",
            ))
        }
        (_, Err(why)) => {
            return Err(ApiError::bad(
                "messages",
                format!("this server has no chat template ({why}); start serve with --chat-template FILE"),
            ))
        }
    };
    let opts = render_options(body)?;
    let prompt = template.encode(tok, &messages, opts).map_err(|e| template_error(&e))?;
    if prompt.is_empty() {
        return Err(ApiError::bad("messages", "the chat template rendered an empty prompt"));
    }
    let asked = match api::max_tokens(body, "max_completion_tokens")? {
        Some(n) => Some(n),
        None => api::max_tokens(body, "max_tokens")?,
    };
    let max_tokens = asked.unwrap_or(s.ctx_positions.saturating_sub(prompt.len()).max(1));
    api::check_fits("messages", prompt.len(), max_tokens, s.ctx_positions)?;
    let logprobs = api::flag(body, "logprobs")?;
    let sampling = api::sampling(&sampling_fields(body, logprobs)?)?;
    let (mut stop_ids, stops) = api::stop(body, s.vocab, Some(tok))?;
    if !api::flag(body, "ignore_eos")? {
        // the model's end-of-generation tokens end the answer unless `ignore_eos` (llama-server's)
        stop_ids.extend(tok.eog_ids());
    }
    Ok(ChatRequest {
        prompt,
        stream: api::flag(body, "stream")?,
        generation: GenerationOptions { max_tokens, stop_ids, sampling },
        stops,
        logprobs,
        tokenizer: tok.clone(),
        harmony: s.harmony,
    })
}

/// The template's options: `reasoning_effort` and `enable_thinking`, top level or in
/// `chat_template_kwargs` (as llama-server takes them; the top level wins).
fn render_options(body: &Map<String, Value>) -> Result<RenderOptions, ApiError> {
    let kwargs = match body.get("chat_template_kwargs") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(other) => {
            return Err(ApiError::bad(
                "chat_template_kwargs",
                format!("chat_template_kwargs must be an object; got {other}"),
            ))
        }
    };
    if let Some(key) = kwargs.keys().find(|k| !["reasoning_effort", "enable_thinking"].contains(&k.as_str()))
    {
        return Err(ApiError::bad(
            "chat_template_kwargs",
            format!(
                "chat_template_kwargs.{key} is not supported (supported: reasoning_effort, enable_thinking)"
            ),
        ));
    }
    let pick = |key: &str| match body.get(key).filter(|v| !v.is_null()) {
        Some(v) => Some((key.to_string(), v)),
        None => kwargs.get(key).filter(|v| !v.is_null()).map(|v| (format!("chat_template_kwargs.{key}"), v)),
    };
    let reasoning_effort = match pick("reasoning_effort") {
        None => None,
        Some((field, v)) => {
            let parsed =
                v.as_str().ok_or_else(|| format!("{field} must be a string (low, medium, high); got {v}"));
            Some(
                parsed
                    .and_then(|s| s.parse::<ReasoningEffort>().map_err(|e| format!("{field}: {e}")))
                    .map_err(|message| ApiError::bad(&field, message))?,
            )
        }
    };
    let enable_thinking = match pick("enable_thinking") {
        None => None,
        Some((_, Value::Bool(b))) => Some(*b),
        Some((field, v)) => {
            return Err(ApiError::bad(&field, format!("{field} must be true or false; got {v}")))
        }
    };
    Ok(RenderOptions { add_generation_prompt: true, enable_thinking, reasoning_effort })
}

/// The body as the completions API's sampling fields: `logprobs: true` with `top_logprobs: k`
/// is the completions API's `logprobs: k`.
fn sampling_fields(body: &Map<String, Value>, logprobs: bool) -> Result<Map<String, Value>, ApiError> {
    let mut m = body.clone();
    let top = m.remove("top_logprobs").filter(|v| !v.is_null());
    m.remove("logprobs");
    match (logprobs, top) {
        (true, top) => {
            m.insert("logprobs".into(), top.unwrap_or(json!(0)));
        }
        (false, Some(_)) => {
            return Err(ApiError::bad("top_logprobs", "top_logprobs needs logprobs: true"));
        }
        (false, None) => {}
    }
    api::sampling(&m).map_err(|mut e| {
        if e.param.as_deref() == Some("logprobs") {
            e.param = Some("top_logprobs".into());
            e.message = e.message.replacen("logprobs", "top_logprobs", 1);
        }
        e
    })?;
    Ok(m)
}

fn template_error(e: &ChatTemplateError) -> ApiError {
    ApiError::bad("messages", format!("the chat template cannot render these messages: {e}"))
}

/// `messages`: a non-empty array of `{role, content}`; content is a string, an array of text
/// parts (joined), or null (an assistant turn without text).
fn messages(v: Option<&Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let items = match v {
        None => return Err(ApiError::bad("messages", "messages is required")),
        Some(Value::Array(items)) if !items.is_empty() => items,
        Some(other) => {
            return Err(ApiError::bad("messages", format!("messages must be a non-empty array; got {other}")))
        }
    };
    items.iter().enumerate().map(|(i, m)| message(i, m)).collect()
}

fn message(i: usize, m: &Value) -> Result<ChatMessage, ApiError> {
    let field = |f: &str| format!("messages[{i}].{f}");
    let obj = m.as_object().ok_or_else(|| {
        ApiError::bad(&format!("messages[{i}]"), format!("messages[{i}] must be an object; got {m}"))
    })?;
    let role = obj.get("role").and_then(Value::as_str).ok_or_else(|| {
        ApiError::bad(&field("role"), format!("{} must be a string (system, user, assistant)", field("role")))
    })?;
    let content = match obj.get("content") {
        Some(Value::String(s)) => s.clone(),
        None | Some(Value::Null) => String::new(),
        Some(Value::Array(parts)) => parts
            .iter()
            .enumerate()
            .map(|(j, p)| match (p["type"].as_str(), p["text"].as_str()) {
                (Some("text"), Some(t)) => Ok(t),
                _ => Err(ApiError::bad(
                    &field("content"),
                    format!(
                        "{}[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) are served",
                        field("content")
                    ),
                )),
            })
            .collect::<Result<String, _>>()?,
        Some(other) => {
            return Err(ApiError::bad(
                &field("content"),
                format!("{} must be a string or an array of text parts; got {other}", field("content")),
            ))
        }
    };
    let message = ChatMessage::new(role, content);
    match obj.get("reasoning_content") {
        None | Some(Value::Null) => Ok(message),
        Some(Value::String(thinking)) => Ok(message.with_thinking(thinking.clone())),
        Some(other) => Err(ApiError::bad(
            &field("reasoning_content"),
            format!("{} must be a string; got {other}", field("reasoning_content")),
        )),
    }
}

/// A streamed delta: `reasoning_content` and `content`, each only when it has text (`content`
/// also when neither has: a logprobs-only chunk).
fn delta(text: &str, reasoning: &str) -> Value {
    let mut d = Map::new();
    if !reasoning.is_empty() {
        d.insert("reasoning_content".into(), json!(reasoning));
    }
    if !text.is_empty() || reasoning.is_empty() {
        d.insert("content".into(), json!(text));
    }
    Value::Object(d)
}

/// One token in the chat API's `logprobs.content` shape.
fn token_logprobs(tok: &Tokenizer, lp: &Logprobs) -> Value {
    let entry = |id: u32, logprob: f32| {
        let bytes = tok.token_bytes(id).unwrap_or_default();
        json!({"token": String::from_utf8_lossy(&bytes), "logprob": logprob, "bytes": bytes})
    };
    let mut v = entry(lp.chosen.id, lp.chosen.logprob);
    v["top_logprobs"] = lp.top.iter().map(|t| entry(t.id, t.logprob)).collect();
    v
}

pub async fn chat_completions(
    State(s): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req = api::object(body).and_then(|o| parse(&o, &s)).map_err(refused)?;
    let tok = req.tokenizer;
    let text = TextOut { tokenizer: tok.clone(), stops: req.stops, harmony: req.harmony };
    let rx = enqueue(&s, req.prompt, req.generation, Some(text)).map_err(refused)?;
    let (id, model, want_lp) = (format!("chatcmpl-{:x}", rand_id()), s.model_name.clone(), req.logprobs);
    let head = move |choices: Value| json!({"id": id, "object": "chat.completion.chunk", "created": created(), "model": model, "choices": choices});
    if req.stream {
        let first = head(
            json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
        );
        let head = head.clone();
        let format = move |item: Item| -> Vec<Value> {
            match item {
                Item::Token { text, reasoning, logprobs, .. } => {
                    let lp =
                        logprobs.filter(|_| want_lp).map(|lp| json!({"content": [token_logprobs(&tok, lp)]}));
                    if text.is_empty() && reasoning.is_empty() && lp.is_none() {
                        return Vec::new();
                    }
                    vec![head(
                        json!([{"index": 0, "delta": delta(text, reasoning), "logprobs": lp, "finish_reason": null}]),
                    )]
                }
                Item::Done { tail, tail_reasoning, finish, usage } => {
                    let mut out = Vec::new();
                    if !tail.is_empty() || !tail_reasoning.is_empty() {
                        out.push(head(json!([{"index": 0, "delta": delta(tail, tail_reasoning), "logprobs": null, "finish_reason": null}])));
                    }
                    let mut last =
                        head(json!([{"index": 0, "delta": {}, "logprobs": null, "finish_reason": finish}]));
                    last["usage"] = usage;
                    out.push(last);
                    out
                }
            }
        };
        return Ok(sse(rx, vec![first], format).into_response());
    }
    let c = collect(rx).await?;
    let lp = want_lp.then(
        || json!({"content": c.logprobs.iter().map(|lp| token_logprobs(&tok, lp)).collect::<Vec<_>>()}),
    );
    let mut message = json!({"role": "assistant", "content": c.text});
    if !c.reasoning.is_empty() {
        message["reasoning_content"] = json!(c.reasoning);
    }
    let choice = json!({"index": 0, "message": message, "logprobs": lp, "finish_reason": c.finish});
    let mut v = head(json!([choice]));
    v["object"] = json!("chat.completion");
    v["usage"] = c.usage;
    Ok(Json(v).into_response())
}
