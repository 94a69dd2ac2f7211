//! `moe-lanes tokenize` / `detokenize` and `synth --vocab-from` through the real binary.

#[path = "../../tests/common/mod.rs"]
mod common;

mod bin;

use bin::{command, failure, ok_stdout, p};
use moe_lanes::text::Tokenizer;
use std::io::Write;
use std::process::Stdio;

fn qwen2() -> String {
    p(&common::tokenizers().join("ggml-vocab-qwen2.gguf")).to_string()
}

fn ids_of(stdout: &str) -> Vec<u32> {
    serde_json::from_str(stdout.trim()).unwrap()
}

/// Run with `stdin` piped in; returns stdout.
fn with_stdin(args: &[&str], stdin: &str) -> String {
    let mut child = command().args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{args:?}");
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn tokenize_prints_ids_and_detokenize_inverts_it() {
    let vocab = qwen2();
    let text = "Hello, 世界! <|im_start|>user 🦀\n  x";
    let lib = Tokenizer::from_gguf_path(vocab.as_ref()).unwrap();
    let ids = ids_of(&ok_stdout(&["tokenize", "--model", &vocab, "--text", text]));
    assert_eq!(ids, lib.encode(text, false, true).unwrap());
    assert!(ids.contains(&lib.token_id("<|im_start|>").unwrap()), "special tokens are parsed");
    let plain = ids_of(&ok_stdout(&["tokenize", "--model", &vocab, "--text", text, "--no-parse-special"]));
    assert_eq!(plain, lib.encode(text, false, false).unwrap());
    // From a file and from standard input: the same ids.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("t.txt");
    std::fs::write(&file, text).unwrap();
    assert_eq!(ids_of(&ok_stdout(&["tokenize", "--model", &vocab, "--text-file", p(&file)])), ids);
    assert_eq!(ids_of(&with_stdin(&["tokenize", "--model", &vocab], text)), ids);
    // Back: --tokens, or the JSON array on standard input.
    let csv: Vec<String> = ids.iter().map(u32::to_string).collect();
    let back = ok_stdout(&["detokenize", "--model", &vocab, "--tokens", &csv.join(",")]);
    assert_eq!(back, format!("{text}\n"));
    let json: serde_json::Value =
        serde_json::from_str(&with_stdin(&["detokenize", "--model", &vocab, "--json"], &format!("{ids:?}")))
            .unwrap();
    assert_eq!(json["text"], text);
    let skipped = ok_stdout(&["detokenize", "--model", &vocab, "--tokens", &csv.join(","), "--skip-special"]);
    assert_eq!(skipped, format!("{}\n", text.replace("<|im_start|>", "")));
}

#[test]
fn tokenize_json_and_special() {
    let vocab = qwen2();
    let out = ok_stdout(&["tokenize", "--model", &vocab, "--text", "Hello world 🦀", "--json"]);
    insta::assert_snapshot!("tokenize_json", out);
    let spm = p(&common::tokenizers().join("ggml-vocab-llama-spm.gguf")).to_string();
    let without = ids_of(&ok_stdout(&["tokenize", "--model", &spm, "--text", "Hi"]));
    let with = ids_of(&ok_stdout(&["tokenize", "--model", &spm, "--text", "Hi", "--special"]));
    assert_eq!(with[0], 1, "--special adds the BOS the metadata asks for");
    assert_eq!(&with[1..], &without[..]);
}

#[test]
fn bad_input_is_a_clear_error() {
    let vocab = qwen2();
    let err = failure(&["detokenize", "--model", &vocab, "--tokens", "1,151936"]);
    assert!(err.contains("token id 151936 is out of range: the vocabulary has 151936 tokens"), "{err}");
    let err = failure(&["tokenize", "--model", "/nonexistent/x.gguf", "--text", "a"]);
    assert!(err.contains("/nonexistent/x.gguf: no such file or directory"), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let err = failure(&["tokenize", "--model", p(dir.path()), "--text", "a"]);
    assert!(err.contains("no tokenizer.json"), "{err}");
    let bin = dir.path().join("bad.txt");
    std::fs::write(&bin, [0xff, 0xfe, b'a']).unwrap();
    let err = failure(&["tokenize", "--model", &vocab, "--text-file", p(&bin)]);
    assert!(err.contains("bad.txt") && err.contains("UTF-8"), "{err}");
}

#[test]
fn synth_vocab_from_makes_a_model_that_tokenizes_like_the_vocab_and_runs() {
    let dir = tempfile::tempdir().unwrap();
    let vocab = qwen2();
    let model = dir.path().join("q.gguf");
    ok_stdout(&["synth", "--arch", "qwen3_moe", "--vocab-from", &vocab, "--out", p(&model)]);
    let report: serde_json::Value =
        serde_json::from_str(&ok_stdout(&["inspect", p(&model), "--json"])).unwrap();
    assert_eq!(report["vocab"], 151_936);
    // A sample of llama.cpp's vectors (all of them: tests/tokenizer_model.rs, through the library).
    for (text, _) in common::vocab_test_vectors("ggml-vocab-qwen2").into_iter().step_by(5) {
        let theirs = ok_stdout(&["tokenize", "--model", &vocab, "--text", &text]);
        assert_eq!(ok_stdout(&["tokenize", "--model", p(&model), "--text", &text]), theirs, "{text:?}");
    }
    let prompt = ids_of(&ok_stdout(&["tokenize", "--model", p(&model), "--text", "Hello world"]));
    let csv: Vec<String> = prompt.iter().map(u32::to_string).collect();
    let generated: serde_json::Value = serde_json::from_str(&ok_stdout(&[
        "generate",
        "--model",
        p(&model),
        "--tokens",
        &csv.join(","),
        "--max-new-tokens",
        "3",
    ]))
    .unwrap();
    let new = generated["tokens"].as_array().unwrap();
    assert_eq!(new.len(), 3);
    let new: Vec<String> = new.iter().map(|v| v.as_u64().unwrap().to_string()).collect();
    // The generated ids decode with the copied tokenizer.
    ok_stdout(&["detokenize", "--model", p(&model), "--tokens", &new.join(",")]);
}
