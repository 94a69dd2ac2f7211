//! GPT-OSS's Harmony chat format: the built-in template ([`HARMONY_TEMPLATE`], for files that
//! carry none), the reasoning effort, and the output parser that splits what the model writes
//! into reasoning (the `analysis` channel) and content (`final`, `commentary`), as llama-server
//! does (`reasoning_content` and `content`).
//!
//! A Harmony completion, after the prompt's `<|start|>assistant`, is a run of messages:
//! `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>`.
//! The parser is a state machine over token ids (never a pattern over decoded text):
//! - a header (the text before `<|message|>`: role, `<|channel|>NAME`, ` to=RECIPIENT`,
//!   `<|constrain|>TYPE`) picks where the message's text goes: `analysis` to reasoning, a message
//!   with a recipient (a tool call, which is not served) nowhere, anything else to content;
//! - `<|end|>` ends a message, `<|start|>` opens the next (a `<|start|>` inside a message ends it
//!   too), `<|return|>` and `<|call|>` end the completion;
//! - malformed output becomes content, never an error: text after `<|end|>` without a
//!   `<|start|>`, a header longer than [`MAX_HEADER_BYTES`] or one the completion ends inside
//!   (its raw text, special tokens written out).
//!
//! [`HarmonyStream`] does this as ids arrive (deltas; split UTF-8 held back per message);
//! [`parse_harmony`] does it on a whole completion and returns the messages. Their texts agree
//! (the tests check it on any id sequence).

use super::stream::{StreamDecoder, TokenizerRef};
use super::{Tokenizer, TokenizerError};
use crate::model::arch::Arch;

/// The built-in Harmony chat template, for GPT-OSS files without `tokenizer.chat_template`:
/// what `openai-harmony` renders for a conversation (system message with the model identity,
/// knowledge cutoff, current date, reasoning effort and valid channels; the first
/// `system`/`developer` message as the developer's instructions; user turns; assistant turns in
/// the `final` channel, a last one without a generation prompt ending in `<|return|>` as in
/// training; an assistant's `thinking` is not rendered, as Harmony drops earlier turns' reasoning).
/// Unlike GPT-OSS's own template it writes no blank line after the instructions (openai-harmony
/// writes none).
///
/// Reads `messages` (`role`, `content`), `add_generation_prompt`,
/// `reasoning_effort` (default `medium`), `model_identity` and `strftime_now`.
pub const HARMONY_TEMPLATE: &str = r#"
{%- if reasoning_effort is defined and reasoning_effort %}{% set effort = reasoning_effort %}{% else %}{% set effort = "medium" %}{% endif %}
{%- if model_identity is defined and model_identity %}{% set identity = model_identity %}{% else %}{% set identity = "You are ChatGPT, a large language model trained by OpenAI." %}{% endif %}
{{- "<|start|>system<|message|>" + identity + "\nKnowledge cutoff: 2024-06\nCurrent date: " + strftime_now("%Y-%m-%d") + "\n\nReasoning: " + effort + "\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>" }}
{%- if messages and messages[0].role in ["system", "developer"] %}
{%- if messages[0].content %}{{- "<|start|>developer<|message|># Instructions\n\n" + messages[0].content + "<|end|>" }}{% endif %}
{%- set rest = messages[1:] %}
{%- else %}
{%- set rest = messages %}
{%- endif %}
{%- for message in rest %}
{%- if message.role == "user" %}
{{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
{%- elif message.role == "assistant" and loop.last and not add_generation_prompt %}
{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" }}
{%- elif message.role == "assistant" %}
{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
{%- elif message.role not in ["system", "developer"] %}
{{- raise_exception("the built-in Harmony template renders system, developer, user and assistant messages, not '" + message.role + "'") }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|start|>assistant" }}{% endif %}"#;

/// Longest header (the text between `<|start|>` and `<|message|>`) the parser waits for; a
/// longer one is malformed output and becomes content.
pub const MAX_HEADER_BYTES: usize = 256;

/// GPT-OSS's reasoning effort (`Reasoning: low|medium|high` in the system message).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReasoningEffort {
    Low,
    Medium,
    High,
}

/// A reasoning effort that is not `low`, `medium` or `high`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("reasoning effort '{given}' is not one of low, medium, high")]
pub struct ReasoningEffortError {
    pub given: String,
}

impl ReasoningEffort {
    pub fn as_str(self) -> &'static str {
        match self {
            ReasoningEffort::Low => "low",
            ReasoningEffort::Medium => "medium",
            ReasoningEffort::High => "high",
        }
    }
}

impl std::str::FromStr for ReasoningEffort {
    type Err = ReasoningEffortError;
    fn from_str(s: &str) -> Result<ReasoningEffort, ReasoningEffortError> {
        match s {
            "low" => Ok(ReasoningEffort::Low),
            "medium" => Ok(ReasoningEffort::Medium),
            "high" => Ok(ReasoningEffort::High),
            _ => Err(ReasoningEffortError { given: s.to_string() }),
        }
    }
}

/// The ids of Harmony's structural tokens in a vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HarmonyTokens {
    pub start: u32,
    pub end: u32,
    pub message: u32,
    pub channel: u32,
    pub constrain: Option<u32>,
    pub return_: u32,
    pub call: Option<u32>,
}

impl HarmonyTokens {
    /// Harmony's tokens, when the vocabulary has `<|start|>`, `<|end|>`, `<|message|>`,
    /// `<|channel|>` and `<|return|>` (`<|constrain|>` and `<|call|>` are optional).
    pub fn of(tokenizer: &Tokenizer) -> Option<HarmonyTokens> {
        let id = |text: &str| tokenizer.token_id(text);
        Some(HarmonyTokens {
            start: id("<|start|>")?,
            end: id("<|end|>")?,
            message: id("<|message|>")?,
            channel: id("<|channel|>")?,
            constrain: id("<|constrain|>"),
            return_: id("<|return|>")?,
            call: id("<|call|>"),
        })
    }

    /// The tokens a model's chats are parsed with: a GPT-OSS model's ([`Arch::GptOss`]) whose
    /// vocabulary has them; `None` for every other model (plain text out).
    pub fn for_arch(arch: Arch, tokenizer: &Tokenizer) -> Option<HarmonyTokens> {
        (arch == Arch::GptOss).then(|| HarmonyTokens::of(tokenizer)).flatten()
    }

    fn kind(&self, id: u32) -> Kind {
        if id == self.start {
            Kind::Start
        } else if id == self.end {
            Kind::End
        } else if id == self.message {
            Kind::Message
        } else if id == self.channel {
            Kind::Channel
        } else if id == self.return_ || Some(id) == self.call {
            Kind::Stop
        } else {
            Kind::Other
        }
    }
}

/// Whether a tokenizer speaks Harmony (has its structural tokens).
pub fn is_harmony_capable(tokenizer: &Tokenizer) -> bool {
    HarmonyTokens::of(tokenizer).is_some()
}

/// What a token does to the parser.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Start,
    End,
    Message,
    Channel,
    /// `<|return|>` or `<|call|>`: the completion is over.
    Stop,
    /// Text, `<|constrain|>` and any other token.
    Other,
}

/// Where a message's text goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HarmonyRoute {
    /// `analysis`: the model's reasoning (`reasoning_content`).
    Reasoning,
    /// `final`, `commentary` without a recipient, no channel, or malformed output (`content`).
    Content,
    /// A message to a recipient (` to=functions.x`, a tool call): not shown.
    Hidden,
}

/// The route a header gives: its channel (the word after the last `<|channel|>`) and whether it
/// names a recipient.
fn route_of(header: &str) -> HarmonyRoute {
    let after_channel = header.rsplit_once("<|channel|>").map(|(_, c)| c);
    let recipient = header.starts_with("to=") || header.contains(" to=");
    let channel = after_channel.and_then(|c| c.split(|ch: char| ch.is_whitespace() || ch == '<').next());
    match (recipient, channel) {
        (true, _) => HarmonyRoute::Hidden,
        (false, Some("analysis")) => HarmonyRoute::Reasoning,
        _ => HarmonyRoute::Content,
    }
}

/// Text for reasoning and content.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HarmonyDelta {
    pub reasoning: String,
    pub content: String,
}

impl HarmonyDelta {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty()
    }

    fn add(&mut self, route: HarmonyRoute, text: &str) {
        match route {
            HarmonyRoute::Reasoning => self.reasoning.push_str(text),
            HarmonyRoute::Content => self.content.push_str(text),
            HarmonyRoute::Hidden => {}
        }
    }

    /// Append another delta.
    pub fn extend(&mut self, other: &HarmonyDelta) {
        self.reasoning.push_str(&other.reasoning);
        self.content.push_str(&other.content);
    }
}

/// Where the streaming parser is.
#[derive(Debug)]
enum State<'t> {
    /// Reading a header: its raw bytes so far.
    Header(Vec<u8>),
    /// Inside a message's text.
    Body(HarmonyRoute, StreamDecoder<'t>),
    /// After `<|end|>`, waiting for `<|start|>`.
    Between,
    /// After `<|return|>` or `<|call|>`: everything else is ignored.
    Done,
}

/// The Harmony parser for a completion streamed id by id (see the module docs). Starts in a
/// header: the prompt ended with `<|start|>assistant`.
#[derive(Debug)]
pub struct HarmonyStream<'t> {
    tokenizer: TokenizerRef<'t>,
    tokens: HarmonyTokens,
    state: State<'t>,
}

impl<'t> HarmonyStream<'t> {
    pub fn new(tokenizer: TokenizerRef<'t>, tokens: HarmonyTokens) -> HarmonyStream<'t> {
        HarmonyStream { tokenizer, tokens, state: State::Header(Vec::new()) }
    }

    /// Whether `<|return|>` or `<|call|>` ended the completion.
    pub fn is_done(&self) -> bool {
        matches!(self.state, State::Done)
    }

    /// Add one id; returns the reasoning and content it released (often nothing).
    pub fn push(&mut self, id: u32) -> Result<HarmonyDelta, TokenizerError> {
        self.tokenizer.check(id)?;
        let kind = self.tokens.kind(id);
        let mut out = HarmonyDelta::default();
        let state = std::mem::replace(&mut self.state, State::Done);
        self.state = match (state, kind) {
            (State::Done, _) => State::Done,
            (State::Header(h), Kind::Message) => {
                State::Body(route_of(&String::from_utf8_lossy(&h)), self.decoder())
            }
            (State::Header(h), Kind::Start) => {
                out.add(HarmonyRoute::Content, &String::from_utf8_lossy(&h));
                State::Header(Vec::new())
            }
            (State::Header(h), Kind::End | Kind::Stop) => {
                out.add(HarmonyRoute::Content, &String::from_utf8_lossy(&h));
                after_message(kind)
            }
            (State::Header(mut h), Kind::Channel | Kind::Other) => {
                self.tokenizer.append_bytes(id, &mut h);
                if h.len() > MAX_HEADER_BYTES {
                    out.add(HarmonyRoute::Content, &String::from_utf8_lossy(&h));
                    State::Body(HarmonyRoute::Content, self.decoder())
                } else {
                    State::Header(h)
                }
            }
            (State::Body(route, decoder), Kind::Start | Kind::End | Kind::Stop) => {
                out.add(route, &decoder.finish());
                after_message(kind)
            }
            (State::Body(route, mut decoder), Kind::Message | Kind::Channel | Kind::Other) => {
                out.add(route, &decoder.push(id)?);
                State::Body(route, decoder)
            }
            (State::Between, Kind::Start) => State::Header(Vec::new()),
            (State::Between, Kind::End) => State::Between,
            (State::Between, Kind::Stop) => State::Done,
            (State::Between, Kind::Channel) => {
                let mut h = Vec::new();
                self.tokenizer.append_bytes(id, &mut h);
                State::Header(h)
            }
            (State::Between, Kind::Message | Kind::Other) => {
                let mut decoder = self.decoder();
                out.add(HarmonyRoute::Content, &decoder.push(id)?);
                State::Body(HarmonyRoute::Content, decoder)
            }
        };
        Ok(out)
    }

    /// The end of the completion: what was held back (an unfinished header as content, a split
    /// character as U+FFFD).
    pub fn finish(self) -> HarmonyDelta {
        let mut out = HarmonyDelta::default();
        match self.state {
            State::Header(h) => out.add(HarmonyRoute::Content, &String::from_utf8_lossy(&h)),
            State::Body(route, decoder) => out.add(route, &decoder.finish()),
            State::Between | State::Done => {}
        }
        out
    }

    fn decoder(&self) -> StreamDecoder<'t> {
        StreamDecoder::over(self.tokenizer.clone(), true)
    }
}

/// The state after a message ends on `kind` (`<|start|>`, `<|end|>` or a stop).
fn after_message<'t>(kind: Kind) -> State<'t> {
    match kind {
        Kind::Start => State::Header(Vec::new()),
        Kind::Stop => State::Done,
        _ => State::Between,
    }
}

/// One message of a parsed completion.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct HarmonyMessage {
    /// The header's raw text (`assistant<|channel|>final`); empty for malformed output.
    pub header: String,
    pub route: HarmonyRoute,
    pub text: String,
}

/// A whole completion, parsed.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct HarmonyParsed {
    pub messages: Vec<HarmonyMessage>,
    /// Whether `<|return|>` or `<|call|>` ended it.
    pub done: bool,
}

impl HarmonyParsed {
    /// The reasoning and content texts (each route's messages joined).
    pub fn texts(&self) -> HarmonyDelta {
        let mut out = HarmonyDelta::default();
        for m in &self.messages {
            out.add(m.route, &m.text);
        }
        out
    }
}

/// Parse a whole completion (the ids after the prompt's `<|start|>assistant`) into messages, by
/// the rules of the module docs; the texts equal [`HarmonyStream`]'s deltas joined.
pub fn parse_harmony(
    tokenizer: &Tokenizer,
    tokens: HarmonyTokens,
    ids: &[u32],
) -> Result<HarmonyParsed, TokenizerError> {
    for &id in ids {
        tokenizer.check(id)?;
    }
    let mut parsed = HarmonyParsed::default();
    let mut at = 0;
    let mut header = Some(Vec::new()); // the prompt opened a header
    while at < ids.len() {
        let Some(h) = header.as_mut() else {
            // Between messages: skip `<|end|>`s; then a header, a stop, or stray text.
            match tokens.kind(ids[at]) {
                Kind::End => at += 1,
                Kind::Start => {
                    header = Some(Vec::new());
                    at += 1;
                }
                Kind::Stop => break,
                Kind::Channel => header = Some(Vec::new()),
                Kind::Message | Kind::Other => {
                    at = body(tokenizer, tokens, ids, at, String::new(), HarmonyRoute::Content, &mut parsed)?;
                    header = next_after(tokens, ids, &mut at, &mut parsed);
                }
            }
            continue;
        };
        let kind = tokens.kind(ids[at]);
        match kind {
            Kind::Message => {
                let text = String::from_utf8_lossy(h).into_owned();
                let route = route_of(&text);
                at = body(tokenizer, tokens, ids, at + 1, text, route, &mut parsed)?;
                header = next_after(tokens, ids, &mut at, &mut parsed);
            }
            Kind::Start | Kind::End | Kind::Stop => {
                malformed(&mut parsed, h);
                header = if kind == Kind::Start { Some(Vec::new()) } else { None };
                at += 1;
                if kind == Kind::Stop {
                    parsed.done = true;
                    return Ok(parsed);
                }
            }
            Kind::Channel | Kind::Other => {
                tokenizer.append_bytes(ids[at], h);
                at += 1;
                if h.len() > MAX_HEADER_BYTES {
                    malformed(&mut parsed, h);
                    at = body(tokenizer, tokens, ids, at, String::new(), HarmonyRoute::Content, &mut parsed)?;
                    header = next_after(tokens, ids, &mut at, &mut parsed);
                }
            }
        }
    }
    if let Some(h) = header {
        malformed(&mut parsed, &h);
    }
    parsed.done |= ids.get(at).is_some_and(|&id| tokens.kind(id) == Kind::Stop);
    Ok(parsed)
}

/// A header that never reached `<|message|>`: its raw text as content (nothing when empty).
fn malformed(parsed: &mut HarmonyParsed, header: &[u8]) {
    if !header.is_empty() {
        let text = String::from_utf8_lossy(header).into_owned();
        parsed.messages.push(HarmonyMessage { header: String::new(), route: HarmonyRoute::Content, text });
    }
}

/// A message's text from `from` to the next `<|start|>`, `<|end|>` or stop (or the end);
/// returns where it stopped.
fn body(
    tokenizer: &Tokenizer,
    tokens: HarmonyTokens,
    ids: &[u32],
    from: usize,
    header: String,
    route: HarmonyRoute,
    parsed: &mut HarmonyParsed,
) -> Result<usize, TokenizerError> {
    let end = ids[from..]
        .iter()
        .position(|&id| matches!(tokens.kind(id), Kind::Start | Kind::End | Kind::Stop))
        .map_or(ids.len(), |n| from + n);
    let text = tokenizer.decode(&ids[from..end], true)?;
    parsed.messages.push(HarmonyMessage { header, route, text });
    Ok(end)
}

/// After a message's text: consume the token that ended it; a new header after `<|start|>`,
/// none after `<|end|>` (between messages) or a stop (the end: `at` moves past the ids).
fn next_after(
    tokens: HarmonyTokens,
    ids: &[u32],
    at: &mut usize,
    parsed: &mut HarmonyParsed,
) -> Option<Vec<u8>> {
    let &id = ids.get(*at)?;
    *at += 1;
    match tokens.kind(id) {
        Kind::Start => Some(Vec::new()),
        Kind::Stop => {
            parsed.done = true;
            *at = ids.len();
            None
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::gguf::GgufWriter;
    use crate::vocab::{synthetic_vocab_with, VocabSpecials};
    use proptest::prelude::*;
    use std::sync::OnceLock;

    /// A synthetic vocabulary with Harmony's tokens, loaded as the library loads a GGUF file.
    fn tok() -> &'static Tokenizer {
        static TOK: OnceLock<Tokenizer> = OnceLock::new();
        TOK.get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("harmony-vocab.gguf");
            let mut w = GgufWriter::new();
            w.add_metadata("general.architecture", crate::format::gguf::MetaValue::String("gpt-oss".into()));
            for (k, v) in synthetic_vocab_with(400, VocabSpecials::Harmony).unwrap().gguf_metadata() {
                w.add_metadata(k, v);
            }
            w.write(&path, &mut |_, _| Ok(()), &mut |_| {}).unwrap();
            Tokenizer::from_gguf_path(&path).unwrap()
        })
    }

    fn tokens() -> HarmonyTokens {
        HarmonyTokens::of(tok()).unwrap()
    }

    fn ids(text: &str) -> Vec<u32> {
        tok().encode(text, false, true).unwrap()
    }

    /// The streamed deltas joined, and whether the stream ended on a stop token.
    fn stream(ids: &[u32]) -> (HarmonyDelta, bool) {
        let mut s = HarmonyStream::new(TokenizerRef::Borrowed(tok()), tokens());
        let mut all = HarmonyDelta::default();
        for &id in ids {
            all.extend(&s.push(id).unwrap());
        }
        let done = s.is_done();
        all.extend(&s.finish());
        (all, done)
    }

    /// Streamed and whole parses agree; returns (reasoning, content, done).
    fn both(text: &str) -> (String, String, bool) {
        let ids = ids(text);
        let (streamed, done) = stream(&ids);
        let parsed = parse_harmony(tok(), tokens(), &ids).unwrap();
        assert_eq!(parsed.texts(), streamed, "whole vs streamed parse of {text:?}");
        assert_eq!(parsed.done, done, "done of {text:?}");
        (streamed.reasoning, streamed.content, done)
    }

    #[test]
    fn analysis_is_reasoning_and_final_is_content() {
        let out = both("<|channel|>analysis<|message|>Two and two.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>");
        assert_eq!(out, ("Two and two.".into(), "4".into(), true));
        let parsed = parse_harmony(tok(), tokens(), &ids("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b<|return|>")).unwrap();
        let routes: Vec<_> = parsed.messages.iter().map(|m| (m.header.as_str(), m.route)).collect();
        assert_eq!(
            routes,
            [
                ("<|channel|>analysis", HarmonyRoute::Reasoning),
                ("assistant<|channel|>final", HarmonyRoute::Content)
            ]
        );
    }

    #[test]
    fn text_after_a_stop_token_is_ignored_and_call_stops_too() {
        assert_eq!(
            both("<|channel|>final<|message|>yes<|return|>more<|start|>x"),
            (String::new(), "yes".into(), true)
        );
        assert_eq!(both("<|channel|>final<|message|>yes<|call|>more"), (String::new(), "yes".into(), true));
    }

    #[test]
    fn a_completion_cut_mid_stream_keeps_what_it_has() {
        assert_eq!(
            both("<|channel|>analysis<|message|>Thinking abo"),
            ("Thinking abo".into(), String::new(), false)
        );
        assert_eq!(
            both("<|channel|>analysis<|message|>r<|end|><|start|>assistant<|channel|>final<|message|>An"),
            ("r".into(), "An".into(), false)
        );
        // Ended by <|end|> with no <|return|>: the message is whole, the completion not done.
        assert_eq!(both("<|channel|>final<|message|>ok<|end|>"), (String::new(), "ok".into(), false));
    }

    #[test]
    fn commentary_is_content_and_a_message_to_a_recipient_is_hidden() {
        assert_eq!(
            both("<|channel|>commentary<|message|>Let me check.<|end|>"),
            (String::new(), "Let me check.".into(), false)
        );
        let call = "<|channel|>analysis<|message|>need weather<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{\"city\": \"Oslo\"}<|call|>";
        assert_eq!(both(call), ("need weather".into(), String::new(), true));
        assert_eq!(
            both("<|channel|>commentary to=functions.x<|message|>{}<|call|>"),
            (String::new(), String::new(), true)
        );
    }

    #[test]
    fn malformed_output_becomes_content() {
        // No channel at all: a header that never reaches <|message|> is content, raw.
        assert_eq!(both("Hello there"), (String::new(), "Hello there".into(), false));
        assert_eq!(both("oops<|channel|>fin"), (String::new(), "oops<|channel|>fin".into(), false));
        // Text after <|end|> without <|start|>.
        assert_eq!(both("<|channel|>final<|message|>a<|end|>b c"), (String::new(), "ab c".into(), false));
        // A channel after <|end|> without <|start|> opens a header.
        assert_eq!(
            both("<|channel|>analysis<|message|>r<|end|><|channel|>final<|message|>c"),
            ("r".into(), "c".into(), false)
        );
        // <|message|> with no header text: content.
        assert_eq!(both("<|message|>plain<|return|>"), (String::new(), "plain".into(), true));
        // A header longer than the limit is released as content.
        let long = "x".repeat(MAX_HEADER_BYTES + 10);
        assert_eq!(both(&long), (String::new(), long.clone(), false));
        // Structural tokens out of place inside a message are dropped.
        assert_eq!(
            both("<|channel|>final<|message|>a<|message|>b<|channel|>c<|return|>"),
            (String::new(), "abc".into(), true)
        );
    }

    #[test]
    fn split_utf8_is_held_back_within_a_message_and_flushed_at_its_end() {
        let t = tok();
        let head = ids("<|channel|>final<|message|>");
        // "é" is 0xC3 0xA9: the synthetic vocabulary's byte tokens are its first 256 ids.
        let mut s = HarmonyStream::new(TokenizerRef::Borrowed(t), tokens());
        for id in head {
            assert!(s.push(id).unwrap().is_empty());
        }
        assert_eq!(s.push(0xC3).unwrap().content, "");
        assert_eq!(s.push(0xA9).unwrap().content, "é");
        assert_eq!(s.push(0xC3).unwrap().content, "");
        // The message ends on a split character: U+FFFD, as the whole parse decodes it.
        assert_eq!(s.push(tokens().end).unwrap().content, "\u{FFFD}");
    }

    #[test]
    fn an_id_out_of_range_is_an_error() {
        let mut s = HarmonyStream::new(TokenizerRef::Borrowed(tok()), tokens());
        assert!(matches!(s.push(100_000), Err(TokenizerError::IdOutOfRange { .. })));
        assert!(parse_harmony(tok(), tokens(), &[1, 100_000]).is_err());
    }

    #[test]
    fn reasoning_effort_parses_its_three_names() {
        for e in [ReasoningEffort::Low, ReasoningEffort::Medium, ReasoningEffort::High] {
            assert_eq!(e.as_str().parse::<ReasoningEffort>(), Ok(e));
        }
        assert_eq!(
            "max".parse::<ReasoningEffort>().unwrap_err().to_string(),
            "reasoning effort 'max' is not one of low, medium, high"
        );
    }

    #[test]
    fn end_is_not_end_of_generation_in_a_harmony_vocabulary() {
        let t = tok();
        let id = |s: &str| t.token_id(s).unwrap();
        assert!(t.is_eog(id("<|return|>")) && t.is_eog(id("<|call|>")));
        assert!(!t.is_eog(id("<|end|>")), "<|end|> ends a message, not the completion");
    }

    #[test]
    fn a_harmony_text_stream_cuts_stop_strings_in_the_content_only() {
        use crate::text::{StopStrings, TextStream};
        let stops = StopStrings::new(vec!["STOP".into()]).unwrap();
        let mut stream = TextStream::harmony(TokenizerRef::Borrowed(tok()), tokens(), stops);
        let (mut reasoning, mut content, mut stopped) = (String::new(), String::new(), None);
        for id in ids("<|channel|>analysis<|message|>no STOP here<|end|><|start|>assistant<|channel|>final<|message|>yes STOP no") {
            let piece = stream.push(id).unwrap();
            reasoning.push_str(&piece.reasoning);
            content.push_str(&piece.text);
            stopped = stopped.or(piece.stopped);
        }
        let end = stream.finish();
        assert_eq!(end.stopped, Some(0));
        assert_eq!((reasoning.as_str(), content.as_str(), stopped), ("no STOP here", "yes ", Some(0)));
    }

    proptest! {
        /// Any id sequence parses without panic, and the streamed deltas joined equal the whole
        /// parse (the same messages' texts).
        #[test]
        fn any_ids_parse_and_streaming_equals_whole(
            picks in proptest::collection::vec(0usize..16, 0..60),
        ) {
            let t = tok();
            let h = tokens();
            let specials = [h.start, h.end, h.message, h.channel, h.return_, h.call.unwrap(), h.constrain.unwrap()];
            let words = ids("analysis final commentary to=functions.f ");
            let ids: Vec<u32> = picks
                .iter()
                .enumerate()
                .map(|(i, &p)| match p {
                    0..=6 => specials[p],
                    7 => 0xC3,           // the first byte of "é"
                    8 => 0xA9,           // its second byte
                    9 => 0xF0,           // a 4-byte lead
                    10 => t.token_id("<|endoftext|>").unwrap(),
                    _ => words[(i * 7 + p) % words.len()],
                })
                .collect();
            let (streamed, done) = stream(&ids);
            let parsed = parse_harmony(t, h, &ids).unwrap();
            prop_assert_eq!(parsed.texts(), streamed);
            prop_assert_eq!(parsed.done, done);
        }
    }
}
