//! Chat templates: a model's `tokenizer.chat_template` (Jinja) rendered with `minijinja` the way
//! Hugging Face `transformers`' `apply_chat_template` renders it.
//!
//! What the template sees, as in `transformers`: `messages` (`role`, `content`),
//! `add_generation_prompt`, `tools` and `documents` (none), `bos_token`/`eos_token` (the
//! tokenizer's, when it has them), `enable_thinking` and `reasoning_effort` (only when set; GPT-OSS's
//! template reads the latter), an assistant message's `thinking` (only when it has one), and the functions
//! `raise_exception(message)` (a [`ChatTemplateError::Raised`]) and `strftime_now(format)` (UTC).
//! The environment matches `transformers`' (`trim_blocks`, `lstrip_blocks`, loop controls, no
//! auto-escaping, a `tojson` filter that writes as Python's `json.dumps` does) and templates may
//! call Python's string and dict methods (`.startswith`, `.split`, `.strip`, `.items()`, ...;
//! `minijinja-contrib`'s pycompat).

use super::harmony::{is_harmony_capable, ReasoningEffort, HARMONY_TEMPLATE};
use super::{Tokenizer, TokenizerError};
use crate::model::arch::Arch;
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use std::path::{Path, PathBuf};

/// The ChatML template (`<|im_start|>role\ncontent<|im_end|>\n` per message, then
/// `<|im_start|>assistant\n` for the generation prompt), as Qwen and many other models use it.
/// `synth` writes it into models whose vocabulary has `<|im_start|>` and `<|im_end|>` but no
/// template (every synthetic vocabulary, the demo model's included), so their chat API works.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\
{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Whether a tokenizer can use [`CHATML_TEMPLATE`]: it has both of its markers as tokens.
pub fn is_chatml_capable(tokenizer: &Tokenizer) -> bool {
    tokenizer.token_id("<|im_start|>").is_some() && tokenizer.token_id("<|im_end|>").is_some()
}

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` (what the template accepts).
    pub role: String,
    pub content: String,
    /// An assistant turn's reasoning (GPT-OSS's template reads it as `thinking`; the chat API's
    /// `reasoning_content`); absent from the template's view when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thinking: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into(), thinking: None }
    }

    /// The same message with reasoning (`thinking`).
    pub fn with_thinking(mut self, thinking: impl Into<String>) -> ChatMessage {
        self.thinking = Some(thinking.into());
        self
    }

    pub fn system(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("system", content)
    }

    pub fn user(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("user", content)
    }

    pub fn assistant(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("assistant", content)
    }
}

/// How to render, beyond the messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RenderOptions {
    /// End with the header of an assistant turn (what a model continues from).
    pub add_generation_prompt: bool,
    /// `enable_thinking` for templates that read it (Qwen3); `None` leaves it undefined.
    pub enable_thinking: Option<bool>,
    /// `reasoning_effort` for templates that read it (GPT-OSS); `None` leaves it undefined.
    pub reasoning_effort: Option<ReasoningEffort>,
}

/// Why a chat template cannot be loaded or rendered.
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error("{model}: the model has no chat template (tokenizer.chat_template); give one as a file")]
    NoTemplate { model: PathBuf },
    #[error(
        "{model}: a GPT-OSS model without a chat template needs Harmony's tokens (<|start|>, <|end|>, <|message|>, <|channel|>, <|return|>) for the built-in Harmony template; its vocabulary lacks them"
    )]
    NoHarmonyTokens { model: PathBuf },
    #[error("{path}: cannot read the chat template: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{origin}: chat template syntax error at line {line}: {message}")]
    Syntax { origin: String, line: usize, message: String },
    /// The template called `raise_exception(message)` (it rejects the conversation).
    #[error("{origin}: the chat template rejects the conversation: {message}")]
    Raised { origin: String, message: String },
    #[error("{origin}: chat template failed at line {line}: {message}")]
    Render { origin: String, line: usize, message: String },
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// The error `raise_exception` returns, found again in the render error's sources.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Raised(String);

/// A compiled chat template with the special tokens it is rendered with. `Send + Sync`.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where the template came from, for errors (a file, or the model's metadata).
    origin: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

const NAME: &str = "chat";

impl ChatTemplate {
    /// Compile `source`; `origin` names it in errors. Special tokens absent stay undefined.
    pub fn new(
        source: &str,
        origin: impl Into<String>,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<ChatTemplate, ChatTemplateError> {
        let origin = origin.into();
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", |message: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
        });
        env.add_function("strftime_now", |format: String| strftime_utc(&format, unix_now_s()));
        env.add_template_owned(NAME, source.to_string()).map_err(|e| ChatTemplateError::Syntax {
            origin: origin.clone(),
            line: e.line().unwrap_or(0),
            message: error_message(&e),
        })?;
        Ok(ChatTemplate {
            env,
            origin,
            bos_token: bos_token.map(str::to_owned),
            eos_token: eos_token.map(str::to_owned),
        })
    }

    /// The model's own template (`tokenizer.chat_template` of its GGUF metadata or
    /// `tokenizer_config.json`), with its BOS/EOS texts; `model` names it in errors.
    pub fn from_tokenizer(tokenizer: &Tokenizer, model: &Path) -> Result<ChatTemplate, ChatTemplateError> {
        let source =
            tokenizer.chat_template().ok_or_else(|| ChatTemplateError::NoTemplate { model: model.into() })?;
        let origin = format!("{}: tokenizer.chat_template", model.display());
        let (bos, eos) = special_texts(tokenizer);
        ChatTemplate::new(source, origin, bos, eos)
    }

    /// A template from a Jinja file, with `tokenizer`'s BOS/EOS texts.
    pub fn from_file(path: &Path, tokenizer: &Tokenizer) -> Result<ChatTemplate, ChatTemplateError> {
        let source = std::fs::read_to_string(path)
            .map_err(|source| ChatTemplateError::Io { path: path.into(), source })?;
        let (bos, eos) = special_texts(tokenizer);
        ChatTemplate::new(&source, path.display().to_string(), bos, eos)
    }

    /// The template a model's chats use: `file` when given, else the model's own, else for a
    /// GPT-OSS model ([`Arch::GptOss`]) the built-in [`HARMONY_TEMPLATE`] (its vocabulary must
    /// have Harmony's tokens).
    pub fn for_model(
        file: Option<&Path>,
        tokenizer: &Tokenizer,
        model: &Path,
        arch: Arch,
    ) -> Result<ChatTemplate, ChatTemplateError> {
        if file.is_some() || tokenizer.chat_template().is_some() || arch != Arch::GptOss {
            return ChatTemplate::from_file_or_model(file, tokenizer, model);
        }
        if !is_harmony_capable(tokenizer) {
            return Err(ChatTemplateError::NoHarmonyTokens { model: model.into() });
        }
        let (bos, eos) = special_texts(tokenizer);
        ChatTemplate::new(HARMONY_TEMPLATE, "built-in Harmony template", bos, eos)
    }

    /// The same template with `strftime_now` reading a fixed clock (`unix_s`, UTC) instead of
    /// the system's: renderings that name the date become reproducible (tests, fixtures).
    pub fn with_clock(mut self, unix_s: i64) -> ChatTemplate {
        self.env.add_function("strftime_now", move |format: String| strftime_utc(&format, unix_s));
        self
    }

    /// `from_file` when a file is given, else `from_tokenizer`.
    pub fn from_file_or_model(
        file: Option<&Path>,
        tokenizer: &Tokenizer,
        model: &Path,
    ) -> Result<ChatTemplate, ChatTemplateError> {
        match file {
            Some(path) => ChatTemplate::from_file(path, tokenizer),
            None => ChatTemplate::from_tokenizer(tokenizer, model),
        }
    }

    /// The conversation as the model's prompt text.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        self.render_with(messages, RenderOptions { add_generation_prompt, ..RenderOptions::default() })
    }

    /// [`render`](Self::render) with every option.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        opts: RenderOptions,
    ) -> Result<String, ChatTemplateError> {
        let mut ctx = serde_json::Map::new();
        ctx.insert("messages".into(), serde_json::to_value(messages).expect("strings serialize"));
        ctx.insert("tools".into(), serde_json::Value::Null);
        ctx.insert("documents".into(), serde_json::Value::Null);
        ctx.insert("add_generation_prompt".into(), opts.add_generation_prompt.into());
        if let Some(bos) = &self.bos_token {
            ctx.insert("bos_token".into(), bos.clone().into());
        }
        if let Some(eos) = &self.eos_token {
            ctx.insert("eos_token".into(), eos.clone().into());
        }
        if let Some(on) = opts.enable_thinking {
            ctx.insert("enable_thinking".into(), on.into());
        }
        if let Some(effort) = opts.reasoning_effort {
            ctx.insert("reasoning_effort".into(), effort.as_str().into());
        }
        let template = self.env.get_template(NAME).expect("added in new");
        template.render(Value::from_serialize(&ctx)).map_err(|e| self.render_error(&e))
    }

    /// The conversation rendered, then tokenized as `transformers` does (`add_special_tokens =
    /// False`: the template writes BOS itself where the model wants one; control tokens in the
    /// text become those tokens).
    pub fn encode(
        &self,
        tokenizer: &Tokenizer,
        messages: &[ChatMessage],
        opts: RenderOptions,
    ) -> Result<Vec<u32>, ChatTemplateError> {
        let text = self.render_with(messages, opts)?;
        Ok(tokenizer.encode(&text, false, true)?)
    }

    /// Where the template came from (a file path, or `<model>: tokenizer.chat_template`).
    pub fn origin(&self) -> &str {
        &self.origin
    }

    fn render_error(&self, e: &Error) -> ChatTemplateError {
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
        while let Some(s) = source {
            if let Some(Raised(message)) = s.downcast_ref::<Raised>() {
                return ChatTemplateError::Raised { origin: self.origin.clone(), message: message.clone() };
            }
            source = s.source();
        }
        ChatTemplateError::Render {
            origin: self.origin.clone(),
            line: e.line().unwrap_or(0),
            message: error_message(e),
        }
    }
}

/// The BOS and EOS token texts, as `transformers` hands them to templates.
fn special_texts(tokenizer: &Tokenizer) -> (Option<&str>, Option<&str>) {
    let text = |id: Option<u32>| id.and_then(|id| tokenizer.token_text(id));
    (text(tokenizer.bos()), text(tokenizer.eos()))
}

fn error_message(e: &Error) -> String {
    match e.detail() {
        Some(detail) => format!("{}: {detail}", e.kind()),
        None => e.kind().to_string(),
    }
}

/// `tojson` as `transformers` defines it: Python's `json.dumps(x, ensure_ascii=False,
/// indent=indent, sort_keys=sort_keys)`, so `", "` and `": "` separators without an indent.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let mut json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::BadSerialization, "tojson").with_source(e))?;
    if sort_keys == Some(true) {
        json.sort_all_objects();
    }
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let spaces = vec![b' '; n];
            let fmt = serde_json::ser::PrettyFormatter::with_indent(&spaces);
            serde::Serialize::serialize(&json, &mut serde_json::Serializer::with_formatter(&mut out, fmt))
        }
        None => {
            serde::Serialize::serialize(&json, &mut serde_json::Serializer::with_formatter(&mut out, PyJson))
        }
    };
    written.map_err(|e| Error::new(ErrorKind::BadSerialization, "tojson").with_source(e))?;
    let mut text = String::from_utf8(out).expect("serde_json writes UTF-8");
    if ensure_ascii == Some(true) {
        text = text
            .chars()
            .map(|c| if c.is_ascii() { c.to_string() } else { utf16_escapes(c) })
            .collect::<String>();
    }
    Ok(Value::from_safe_string(text))
}

fn utf16_escapes(c: char) -> String {
    let mut units = [0u16; 2];
    c.encode_utf16(&mut units).iter().map(|u| format!("\\u{u:04x}")).collect()
}

/// Python's compact-but-spaced JSON: `{"a": 1, "b": [1, 2]}`.
struct PyJson;

impl serde_json::ser::Formatter for PyJson {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

fn unix_now_s() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

/// `strftime` for the codes chat templates use (`%d %b %Y`, `%Y-%m-%d`, ...), in UTC.
fn strftime_utc(format: &str, unix_s: i64) -> Result<String, Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = unix_s.div_euclid(86_400);
    let secs = unix_s.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let code = chars.next().unwrap_or('%');
        let piece = match code {
            'Y' => year.to_string(),
            'y' => format!("{:02}", year.rem_euclid(100)),
            'm' => format!("{month:02}"),
            'd' => format!("{day:02}"),
            'e' => format!("{day:>2}"),
            'B' => MONTHS[month as usize - 1].to_string(),
            'b' => MONTHS[month as usize - 1][..3].to_string(),
            'A' => DAYS[weekday].to_string(),
            'a' => DAYS[weekday][..3].to_string(),
            'H' => format!("{:02}", secs / 3600),
            'M' => format!("{:02}", secs / 60 % 60),
            'S' => format!("{:02}", secs % 60),
            '%' => "%".to_string(),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: format code %{other} is not supported"),
                ))
            }
        };
        out.push_str(&piece);
    }
    Ok(out)
}

/// Days since 1970-01-01 to (year, month, day) (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(src: &str) -> ChatTemplate {
        ChatTemplate::new(src, "test", Some("<s>"), Some("</s>")).unwrap()
    }

    #[test]
    fn renders_messages_and_special_tokens() {
        let t = template(
            "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content.strip() }}\n{% endfor %}\
             {% if add_generation_prompt %}[assistant]{% endif %}",
        );
        let msgs = [ChatMessage::system(" be brief "), ChatMessage::user("hi")];
        assert_eq!(t.render(&msgs, true).unwrap(), "<s>[system]be brief\n[user]hi\n[assistant]");
        assert_eq!(t.render(&msgs, false).unwrap(), "<s>[system]be brief\n[user]hi\n");
    }

    #[test]
    fn raise_exception_is_a_typed_error_with_the_message() {
        let t = template(
            "{% if messages|length == 0 %}{{ raise_exception('No messages provided.') }}{% endif %}",
        );
        match t.render(&[], false) {
            Err(ChatTemplateError::Raised { message, origin }) => {
                assert_eq!(message, "No messages provided.");
                assert_eq!(origin, "test");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn syntax_and_render_errors_name_the_origin_and_line() {
        let err = ChatTemplate::new("line one\n{% if %}", "x.jinja", None, None).unwrap_err();
        assert!(matches!(&err, ChatTemplateError::Syntax { line: 2, .. }), "{err:?}");
        assert!(err.to_string().starts_with("x.jinja: chat template syntax error at line 2"), "{err}");
        let t = template("\n{{ messages[0].content + 1 }}");
        let err = t.render(&[ChatMessage::user("a")], false).unwrap_err();
        assert!(matches!(&err, ChatTemplateError::Render { line: 2, .. }), "{err:?}");
    }

    #[test]
    fn tojson_writes_like_python_json_dumps() {
        let t = template("{{ {'a': [1, 'é<'], 'b': none} | tojson }}|{{ 'é' | tojson(ensure_ascii=true) }}");
        assert_eq!(t.render(&[], false).unwrap(), "{\"a\": [1, \"é<\"], \"b\": null}|\"\\u00e9\"");
    }

    #[test]
    fn enable_thinking_is_undefined_unless_set() {
        let t = template("{% if enable_thinking is defined %}{{ 'on' if enable_thinking else 'off' }}{% else %}unset{% endif %}");
        let with = |e| {
            t.render_with(
                &[],
                RenderOptions { add_generation_prompt: true, enable_thinking: e, reasoning_effort: None },
            )
        };
        assert_eq!(with(None).unwrap(), "unset");
        assert_eq!(with(Some(false)).unwrap(), "off");
        assert_eq!(with(Some(true)).unwrap(), "on");
    }

    #[test]
    fn strftime_formats_utc_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let s = 1_709_211_909;
        assert_eq!(strftime_utc("%d %b %Y, %A %H:%M:%S %%", s).unwrap(), "29 Feb 2024, Thursday 13:05:09 %");
        assert_eq!(strftime_utc("%Y-%m-%d", 0).unwrap(), "1970-01-01");
        assert!(strftime_utc("%Q", 0).is_err());
    }
}
