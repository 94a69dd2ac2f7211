//! llama.cpp's own tokenizer test vectors (tests/fixtures/tokenizers/*.gguf.inp/.out): every input
//! must give exactly the expected ids (no BOS, special tokens not parsed), and decode back.

mod common;

use moe_lanes::text::Tokenizer;

fn check_vectors(name: &str) {
    let tok = Tokenizer::from_gguf_path(&common::tokenizers().join(format!("{name}.gguf"))).unwrap();
    let mut failures = Vec::new();
    let vectors = common::vocab_test_vectors(name);
    for (text, expected) in &vectors {
        let ids = tok.encode(text, false, false).unwrap();
        if &ids != expected {
            failures.push(format!("{text:?}\n  ours:     {ids:?}\n  expected: {expected:?}"));
        }
        assert_eq!(&tok.decode(&ids, false).unwrap(), text, "{name}: decode(encode({text:?}))");
    }
    assert!(
        failures.is_empty(),
        "{name}: {} of {} vectors differ:\n{}",
        failures.len(),
        vectors.len(),
        failures.join("\n")
    );
}

#[test]
fn qwen2_bpe_vectors() {
    check_vectors("ggml-vocab-qwen2");
}

#[test]
fn llama_spm_vectors() {
    check_vectors("ggml-vocab-llama-spm");
}
