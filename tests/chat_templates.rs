//! Chat templates render exactly as `transformers`' `apply_chat_template` does: every case of
//! the fixtures made by tests/fixtures/chat_templates/make_chat_templates.py, byte for byte
//! (and the same `raise_exception` message where the template rejects the conversation).

mod common;

use moe_lanes::text::{
    ChatMessage, ChatTemplate, ChatTemplateError, ReasoningEffort, RenderOptions, Tokenizer, HARMONY_TEMPLATE,
};
use serde::Deserialize;
use std::path::Path;

#[derive(Deserialize)]
struct Fixture {
    template: String,
    gguf: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    enable_thinking: Option<bool>,
    rendered: Option<String>,
    error: Option<String>,
}

fn fixture(name: &str) -> Fixture {
    let path = common::repo_root().join("tests/fixtures/chat_templates").join(format!("{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// The template as the library loads it: from the file, or the GGUF's own.
fn load(fx: &Fixture) -> ChatTemplate {
    let dir = common::tokenizers();
    let tok = Tokenizer::from_gguf_path(&dir.join(&fx.gguf)).unwrap();
    let bos = tok.bos().and_then(|id| tok.token_text(id)).map(str::to_owned);
    let eos = tok.eos().and_then(|id| tok.token_text(id)).map(str::to_owned);
    assert_eq!((bos, eos), (fx.bos_token.clone(), fx.eos_token.clone()), "special tokens of {}", fx.gguf);
    match fx.template.strip_prefix("gguf:") {
        Some(file) => ChatTemplate::from_tokenizer(&tok, &dir.join(file)).unwrap(),
        None => ChatTemplate::from_file(&dir.join(&fx.template), &tok).unwrap(),
    }
}

fn check(name: &str) {
    let fx = fixture(name);
    let template = load(&fx);
    assert!(fx.cases.len() >= 20, "{name}: fixture has {} cases", fx.cases.len());
    for case in &fx.cases {
        let opts = RenderOptions {
            add_generation_prompt: case.add_generation_prompt,
            enable_thinking: case.enable_thinking,
            reasoning_effort: None,
        };
        let got = template.render_with(&case.messages, opts);
        match (&case.rendered, &case.error, got) {
            (Some(want), None, Ok(got)) => assert_eq!(&got, want, "{name}: case {}", case.name),
            (None, Some(want), Err(ChatTemplateError::Raised { message, .. })) => {
                assert_eq!(&message, want, "{name}: case {}", case.name)
            }
            (_, _, got) => {
                panic!("{name}: case {}: got {got:?}, want {:?} / {:?}", case.name, case.rendered, case.error)
            }
        }
    }
}

#[test]
fn qwen3_renders_as_transformers() {
    check("qwen3");
}

#[test]
fn qwen35_renders_as_transformers() {
    check("qwen35");
}

#[test]
fn mistral_nemo_renders_as_transformers() {
    check("mistral_nemo");
}

#[test]
fn the_template_inside_the_qwen2_gguf_renders_as_transformers() {
    check("qwen2_gguf");
}

#[test]
fn a_model_without_a_template_is_a_clear_error() {
    let spm = common::tokenizers().join("ggml-vocab-llama-spm.gguf");
    let tok = Tokenizer::from_gguf_path(&spm).unwrap();
    let err = ChatTemplate::from_tokenizer(&tok, &spm).unwrap_err();
    assert!(matches!(err, ChatTemplateError::NoTemplate { .. }));
    assert!(err.to_string().contains("ggml-vocab-llama-spm.gguf: the model has no chat template"), "{err}");
    let missing = Path::new("/nonexistent/t.jinja");
    let err = ChatTemplate::from_file(missing, &tok).unwrap_err();
    assert!(err.to_string().starts_with("/nonexistent/t.jinja: cannot read the chat template"), "{err}");
}

#[test]
fn encode_tokenizes_the_rendered_prompt_with_control_tokens() {
    let qwen2 = common::tokenizers().join("ggml-vocab-qwen2.gguf");
    let tok = Tokenizer::from_gguf_path(&qwen2).unwrap();
    let template = ChatTemplate::from_tokenizer(&tok, &qwen2).unwrap();
    let msgs = [ChatMessage::user("Hi")];
    let opts = RenderOptions { add_generation_prompt: true, ..RenderOptions::default() };
    let ids = template.encode(&tok, &msgs, opts).unwrap();
    let im_start = tok.token_id("<|im_start|>").unwrap();
    assert_eq!(ids.iter().filter(|&&id| id == im_start).count(), 3, "system, user, assistant headers");
    assert_eq!(tok.decode(&ids, false).unwrap(), template.render(&msgs, true).unwrap());
}

/// The Harmony fixtures (tests/fixtures/chat_templates/make_harmony.py): a clock and cases.
#[derive(Deserialize)]
struct HarmonyFixture {
    clock_unix_s: i64,
    cases: Vec<HarmonyCase>,
}

#[derive(Deserialize)]
struct HarmonyCase {
    name: String,
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    reasoning_effort: Option<ReasoningEffort>,
    rendered: String,
}

/// Render every case of `name` with `source` (BOS/EOS as GPT-OSS's tokenizer has them) on the
/// fixture's clock.
fn check_harmony(name: &str, source: &str) {
    let path = common::repo_root().join("tests/fixtures/chat_templates").join(format!("{name}.json"));
    let fx: HarmonyFixture = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let template = ChatTemplate::new(source, name, Some("<|startoftext|>"), Some("<|return|>"))
        .unwrap()
        .with_clock(fx.clock_unix_s);
    assert!(fx.cases.len() >= 40, "{name}: fixture has {} cases", fx.cases.len());
    for case in &fx.cases {
        let opts = RenderOptions {
            add_generation_prompt: case.add_generation_prompt,
            enable_thinking: None,
            reasoning_effort: case.reasoning_effort,
        };
        let got = template
            .render_with(&case.messages, opts)
            .unwrap_or_else(|e| panic!("{name}: {}: {e}", case.name));
        assert_eq!(got, case.rendered, "{name}: case {}", case.name);
    }
}

#[test]
fn the_built_in_harmony_template_renders_as_openai_harmony() {
    check_harmony("harmony_builtin", HARMONY_TEMPLATE);
}

/// GPT-OSS's own template (as its GGUF files carry it: macros, namespaces, `is mapping` tests,
/// `strftime_now`, `tojson`) renders as `transformers` renders it.
#[test]
fn the_gpt_oss_template_renders_as_transformers() {
    let path = common::tokenizers().join("templates/openai-gpt-oss-120b.jinja");
    check_harmony("gpt_oss", &std::fs::read_to_string(path).unwrap());
}

#[test]
fn the_built_in_harmony_template_refuses_roles_it_cannot_render() {
    let t = ChatTemplate::new(HARMONY_TEMPLATE, "built-in", None, None).unwrap();
    match t.render(&[ChatMessage::new("tool", "{}")], true) {
        Err(ChatTemplateError::Raised { message, .. }) => {
            assert!(message.contains("not 'tool'"), "{message}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_gpt_oss_model_without_a_template_needs_harmony_tokens_for_the_built_in_one() {
    use moe_lanes::model::arch::Arch;
    let spm = common::tokenizers().join("ggml-vocab-llama-spm.gguf");
    let tok = Tokenizer::from_gguf_path(&spm).unwrap();
    let err = ChatTemplate::for_model(None, &tok, &spm, Arch::GptOss).unwrap_err();
    assert!(matches!(err, ChatTemplateError::NoHarmonyTokens { .. }), "{err:?}");
    assert!(err.to_string().contains("needs Harmony's tokens"), "{err}");
    // Any other architecture without a template is the plain error.
    let err = ChatTemplate::for_model(None, &tok, &spm, Arch::Qwen3Moe).unwrap_err();
    assert!(matches!(err, ChatTemplateError::NoTemplate { .. }), "{err:?}");
    // A model's own template wins over the built-in one.
    let qwen2 = common::tokenizers().join("ggml-vocab-qwen2.gguf");
    let tok = Tokenizer::from_gguf_path(&qwen2).unwrap();
    let t = ChatTemplate::for_model(None, &tok, &qwen2, Arch::GptOss).unwrap();
    assert!(t.origin().ends_with("tokenizer.chat_template"), "{}", t.origin());
}
