//! The Harmony output parser (`text::parse_harmony`, `text::HarmonyStream`) against
//! openai-harmony's `parse_messages_from_completion_tokens` on the completions of
//! tests/fixtures/chat_templates/harmony_parse.json (made by make_harmony.py): the same
//! messages, channels and texts, streamed and whole; where openai-harmony refuses malformed
//! output, ours gives it as content (as llama-server does), never a panic.

mod common;

use moe_lanes::synth::SynthFormat;
use moe_lanes::text::{
    parse_harmony, HarmonyDelta, HarmonyRoute, HarmonyStream, HarmonyTokens, Tokenizer, TokenizerRef,
};
use serde::Deserialize;

#[derive(Deserialize)]
struct Fixture {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    completion: String,
    messages: Option<Vec<Message>>,
    error: Option<String>,
}

#[derive(Deserialize)]
struct Message {
    channel: Option<String>,
    recipient: Option<String>,
    text: String,
}

/// Where openai-harmony's message goes in the chat API.
fn route(m: &Message) -> HarmonyRoute {
    match (&m.recipient, m.channel.as_deref()) {
        (Some(_), _) => HarmonyRoute::Hidden,
        (None, Some("analysis")) => HarmonyRoute::Reasoning,
        _ => HarmonyRoute::Content,
    }
}

fn streamed(tok: &Tokenizer, tokens: HarmonyTokens, ids: &[u32]) -> HarmonyDelta {
    let mut s = HarmonyStream::new(TokenizerRef::Borrowed(tok), tokens);
    let mut all = HarmonyDelta::default();
    for &id in ids {
        all.extend(&s.push(id).unwrap());
    }
    all.extend(&s.finish());
    all
}

#[test]
fn harmony_completions_parse_as_openai_harmony_parses_them() {
    let dir = tempfile::tempdir().unwrap();
    let model = common::synth_tiny(dir.path(), "gpt_oss", SynthFormat::Gguf, 1);
    let tok = Tokenizer::from_gguf_path(&model).unwrap();
    let tokens = HarmonyTokens::of(&tok).expect("synth writes Harmony's tokens for gpt_oss");
    let path = common::repo_root().join("tests/fixtures/chat_templates/harmony_parse.json");
    let fx: Fixture = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert!(fx.cases.len() >= 12);
    for case in &fx.cases {
        let ids = tok.encode(&case.completion, false, true).unwrap();
        let parsed = parse_harmony(&tok, tokens, &ids).unwrap();
        let whole = parsed.texts();
        assert_eq!(streamed(&tok, tokens, &ids), whole, "{}: streamed vs whole", case.name);
        match (&case.messages, &case.error) {
            (Some(want), None) => {
                let got: Vec<(HarmonyRoute, &str)> =
                    parsed.messages.iter().map(|m| (m.route, m.text.as_str())).collect();
                let want: Vec<(HarmonyRoute, &str)> =
                    want.iter().map(|m| (route(m), m.text.as_str())).collect();
                assert_eq!(got, want, "{}", case.name);
                for (m, w) in parsed.messages.iter().zip(case.messages.iter().flatten()) {
                    let channel = w.channel.as_deref().unwrap();
                    assert!(
                        m.header.contains(&format!("<|channel|>{channel}")),
                        "{}: header {}",
                        case.name,
                        m.header
                    );
                }
            }
            (None, Some(error)) => {
                // Malformed for openai-harmony: ours shows it as content, never reasoning.
                assert!(whole.reasoning.is_empty(), "{}: {error}", case.name);
                assert!(!whole.content.is_empty(), "{}: {error}", case.name);
            }
            _ => panic!("{}: a case has messages or an error", case.name),
        }
    }
}

#[test]
fn malformed_completions_become_the_content_llama_server_shows() {
    let dir = tempfile::tempdir().unwrap();
    let model = common::synth_tiny(dir.path(), "gpt_oss", SynthFormat::Gguf, 1);
    let tok = Tokenizer::from_gguf_path(&model).unwrap();
    let tokens = HarmonyTokens::of(&tok).unwrap();
    for (completion, content) in [
        ("Hello there", "Hello there"),
        ("<|channel|>fin", "<|channel|>fin"),
        ("<|channel|>final<|message|>a<|end|>b c", "ab c"),
    ] {
        let ids = tok.encode(completion, false, true).unwrap();
        assert_eq!(parse_harmony(&tok, tokens, &ids).unwrap().texts().content, content, "{completion}");
    }
}
