//! GPT-OSS's Harmony format end to end through the real binary: a synth GPT-OSS file (Harmony's
//! tokens, no template: the built-in Harmony template) rewritten so its greedy output is a fixed
//! Harmony completion (`<|channel|>analysis<|message|>hm<|end|>ok<|return|>`: every layer's output
//! zeroed, so each logit row depends on the current token only, and the embedding / lm_head
//! chaining each scripted token to the next). The server's `reasoning_content` / `content`
//! (streamed and not), `run --chat`, `chat`, and the reasoning effort reaching the template.

mod bin;

use bin::server::{sse_data, Server};
use bin::{command, ok_stdout, p};
use moe_lanes::dtype::DType;
use moe_lanes::gguf::{GgufFile, GgufWriter, MetaValue};
use moe_lanes::model::arch::Arch;
use moe_lanes::text::{ChatMessage, ChatTemplate, ReasoningEffort, RenderOptions, Tokenizer};
use serde_json::{json, Value};
use std::io::Write;
use std::path::{Path, PathBuf};

/// What the scripted model answers after `<|start|>assistant`.
const SCRIPT: &str = "<|channel|>analysis<|message|>hm<|end|>ok<|return|>";

/// A synth GPT-OSS file whose greedy completion of any chat prompt is [`SCRIPT`].
fn scripted_gpt_oss(dir: &Path) -> PathBuf {
    scripted_gpt_oss_with(dir, None)
}

/// [`scripted_gpt_oss`], with `template` as its `tokenizer.chat_template` when given.
fn scripted_gpt_oss_with(dir: &Path, template: Option<&str>) -> PathBuf {
    let plain = dir.join("gpt-oss.gguf");
    ok_stdout(&["synth", "--arch", "gpt_oss", "--out", p(&plain)]);
    let tok = Tokenizer::from_gguf_path(&plain).unwrap();
    assert!(tok.chat_template().is_none(), "synth writes no template for GPT-OSS (the built-in one is used)");
    let last = *tok.encode("assistant", false, true).unwrap().last().unwrap();
    let mut chain = vec![last];
    chain.extend(tok.encode(SCRIPT, false, true).unwrap());
    let distinct: std::collections::HashSet<_> = chain.iter().collect();
    assert_eq!(distinct.len(), chain.len(), "the script's tokens must differ: {chain:?}");
    let out = dir.join("gpt-oss-scripted.gguf");
    rewrite(&plain, &out, &chain, template);
    out
}

/// `src` with each layer's output zeroed and token `chain[i]` embedded as unit vector `i`, whose
/// lm_head row is `chain[i + 1]`'s.
fn rewrite(src: &Path, dst: &Path, chain: &[u32], template: Option<&str>) {
    let file = GgufFile::open(src).unwrap();
    let mut w = GgufWriter::new();
    for (key, value) in file.metadata() {
        w.add_metadata(key.clone(), value.clone());
    }
    if let Some(t) = template {
        w.add_metadata("tokenizer.chat_template", MetaValue::String(t.to_string()));
    }
    let infos = file.tensor_infos().to_vec();
    let scripted = |name: &str| matches!(name, "token_embd.weight" | "output.weight" | "output_norm.weight");
    for info in &infos {
        let dtype = if scripted(&info.name) { DType::F32 } else { info.dtype };
        w.add_tensor(info.name.clone(), dtype, &info.shape);
    }
    let embd = infos.iter().find(|i| i.name == "token_embd.weight").unwrap();
    let (vocab, hidden) = (embd.shape[0], embd.shape[1]);
    let f32_bytes = |v: Vec<f32>| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let mut fill = |idx: usize, out: &mut dyn Write| {
        let info = &infos[idx];
        let name = info.name.as_str();
        let zeroed = name.contains("attn_output") || name.contains("ffn_down_exps");
        let bytes = match name {
            "output_norm.weight" => f32_bytes(vec![1.0; hidden]),
            "token_embd.weight" | "output.weight" => {
                let mut m = vec![0f32; hidden * vocab];
                for (i, pair) in chain.windows(2).enumerate() {
                    let row = if name == "token_embd.weight" { pair[0] } else { pair[1] };
                    m[row as usize * hidden + i] = if name == "token_embd.weight" { 1.0 } else { 20.0 };
                }
                f32_bytes(m)
            }
            _ if zeroed => vec![0u8; info.dtype.bytes_for(info.shape.iter().product()).unwrap()],
            _ => file.tensor(name).unwrap().data.to_vec(),
        };
        out.write_all(&bytes)
    };
    w.write(dst, &mut fill, &mut |_| {}).unwrap();
}

/// The prompt length the built-in Harmony template gives one user turn.
fn prompt_tokens(model: &Path, effort: Option<ReasoningEffort>) -> u64 {
    let tok = Tokenizer::from_gguf_path(model).unwrap();
    let t = ChatTemplate::for_model(None, &tok, model, Arch::GptOss).unwrap();
    let opts =
        RenderOptions { add_generation_prompt: true, reasoning_effort: effort, ..RenderOptions::default() };
    t.encode(&tok, &[ChatMessage::user("Hi")], opts).unwrap().len() as u64
}

#[test]
fn chat_completions_split_reasoning_from_content_streamed_and_not() {
    let dir = tempfile::tempdir().unwrap();
    let model = scripted_gpt_oss(dir.path());
    let server = Server::start(p(&model), &[]);
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20, "temperature": 0});
    let (status, v) = server.json("POST", "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["message"], json!({"role": "assistant", "content": "ok", "reasoning_content": "hm"}));
    assert_eq!(choice["finish_reason"], "stop", "<|return|> ends the generation");
    assert_eq!(v["usage"]["prompt_tokens"].as_u64(), Some(prompt_tokens(&model, None)));
    // Every scripted token but the <|return|> that ended it (a stop id is not counted).
    assert_eq!(v["usage"]["completion_tokens"].as_u64(), Some(tokens_of(&model, SCRIPT) - 1));

    let mut stream = body.clone();
    stream["stream"] = json!(true);
    let (status, text) = server.request("POST", "/v1/chat/completions", stream.to_string().as_bytes(), &[]);
    assert_eq!(status, 200, "{text}");
    let data = sse_data(&text);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{text}");
    let (mut reasoning, mut content) = (String::new(), String::new());
    for d in &data[..data.len() - 1] {
        let delta = &serde_json::from_str::<Value>(d).unwrap()["choices"][0]["delta"];
        reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or(""));
        content.push_str(delta["content"].as_str().unwrap_or(""));
    }
    assert_eq!((reasoning.as_str(), content.as_str()), ("hm", "ok"), "{text}");
}

fn tokens_of(model: &Path, text: &str) -> u64 {
    Tokenizer::from_gguf_path(model).unwrap().encode(text, false, true).unwrap().len() as u64
}

#[test]
fn reasoning_effort_reaches_the_template_and_bad_values_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = scripted_gpt_oss(dir.path());
    let server = Server::start(p(&model), &[]);
    let user = json!([{"role": "user", "content": "Hi"}]);
    let asked = [
        json!({"messages": user, "max_tokens": 1, "reasoning_effort": "high"}),
        json!({"messages": user, "max_tokens": 1, "chat_template_kwargs": {"reasoning_effort": "high"}}),
    ];
    for body in asked {
        let (status, v) = server.json("POST", "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{v}");
        assert_eq!(
            v["usage"]["prompt_tokens"].as_u64(),
            Some(prompt_tokens(&model, Some(ReasoningEffort::High)))
        );
    }
    let bad = [
        (json!({"messages": user, "reasoning_effort": "max"}), "reasoning_effort"),
        (json!({"messages": user, "reasoning_effort": 3}), "reasoning_effort"),
        (
            json!({"messages": user, "chat_template_kwargs": {"reasoning_effort": "max"}}),
            "chat_template_kwargs.reasoning_effort",
        ),
        (json!({"messages": user, "chat_template_kwargs": {"tools": []}}), "chat_template_kwargs"),
        (json!({"messages": user, "chat_template_kwargs": "high"}), "chat_template_kwargs"),
        (
            json!({"messages": [{"role": "assistant", "content": "a", "reasoning_content": 1}]}),
            "messages[0].reasoning_content",
        ),
        (json!({"messages": [{"role": "tool", "content": "a"}]}), "messages"),
    ];
    for (body, param) in bad {
        let (status, v) = server.json("POST", "/v1/chat/completions", &body);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
    // An earlier assistant turn's reasoning is accepted (and, as Harmony says, not rendered).
    let turns = json!([
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "ok", "reasoning_content": "hm"},
        {"role": "user", "content": "Hi"}
    ]);
    let (status, v) =
        server.json("POST", "/v1/chat/completions", &json!({"messages": turns, "max_tokens": 20}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "ok");
}

#[test]
fn run_chat_prints_the_final_channel_and_the_reasoning_on_request() {
    let dir = tempfile::tempdir().unwrap();
    let model = scripted_gpt_oss(dir.path());
    let out = command()
        .args(["run", "--model", p(&model), "--chat", "--prompt", "Hi", "-n", "20", "--show-reasoning"])
        .args(["--reasoning-effort", "low"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8(out.stdout).unwrap(), "ok\n");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(stderr.starts_with("hm") || stderr.contains("\nhm"), "reasoning on stderr: {stderr}");
    // Without --show-reasoning the reasoning is not shown at all.
    let out = command()
        .args(["run", "--model", p(&model), "--chat", "--prompt", "Hi", "-n", "20"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8(out.stdout).unwrap(), "ok\n");
    assert!(!String::from_utf8(out.stderr).unwrap().contains("hm"));
    // The chat flags need --chat; a bad effort is refused by name.
    let stderr = bin::failure(&["run", "--model", p(&model), "--prompt", "Hi", "--show-reasoning"]);
    assert!(stderr.contains("--show-reasoning needs --chat"), "{stderr}");
    let out = command()
        .args(["run", "--model", p(&model), "--chat", "--prompt", "x", "--reasoning-effort", "max"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("reasoning effort 'max' is not one of low, medium, high"));
}

#[test]
fn chat_answers_each_line_of_standard_input() {
    let dir = tempfile::tempdir().unwrap();
    let model = scripted_gpt_oss(dir.path());
    let mut child = command()
        .args(["chat", "--model", p(&model), "-n", "20", "--system", "Be brief."])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"Hi\n\nAgain\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8(out.stdout).unwrap(), "ok\nok\n", "one answer per non-empty line");
}

/// A GPT-OSS file that carries its own template (as real GGUF files do) is rendered with it, not
/// with the built-in one; the output is parsed the same.
#[test]
fn a_file_with_gpt_oss_s_own_template_renders_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let source =
        std::fs::read_to_string(root.join("tests/fixtures/tokenizers/templates/openai-gpt-oss-120b.jinja"))
            .unwrap();
    let model = scripted_gpt_oss_with(dir.path(), Some(&source));
    let tok = Tokenizer::from_gguf_path(&model).unwrap();
    let own = ChatTemplate::for_model(None, &tok, &model, Arch::GptOss).unwrap();
    let opts = RenderOptions { add_generation_prompt: true, ..RenderOptions::default() };
    let sys = [ChatMessage::system("Be brief."), ChatMessage::user("Hi")];
    let want = own.encode(&tok, &sys, opts).unwrap().len() as u64;
    let builtin = ChatTemplate::new(moe_lanes::text::HARMONY_TEMPLATE, "b", None, None).unwrap();
    assert_ne!(want, builtin.encode(&tok, &sys, opts).unwrap().len() as u64, "the two templates differ here");
    let server = Server::start(p(&model), &[]);
    let body = json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "max_tokens": 20});
    let (status, v) = server.json("POST", "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"].as_u64(), Some(want));
    assert_eq!(
        v["choices"][0]["message"],
        json!({"role": "assistant", "content": "ok", "reasoning_content": "hm"})
    );
}
