//! Criterion bench of the tokenizer: encode and decode 100 KB of mixed text (English, code,
//! several scripts, emoji, whitespace runs) with the qwen2 byte-level BPE and the Llama
//! SentencePiece vocabularies of tests/fixtures/tokenizers.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use moe_lanes::text::Tokenizer;
use std::path::PathBuf;

/// About 100 KB of mixed text, deterministic.
fn text_100kb() -> String {
    let pieces = [
        "The quick brown fox jumps over the lazy dog; it's 3.14159 o'clock, isn't it? ",
        "fn main() {\n    let v: Vec<u32> = (0..1024).map(|i| i * 2).collect();\n}\n",
        "Съешь же ещё этих мягких французских булок. 我能吞下玻璃而不伤身体。 ",
        "नमस्ते दुनिया 🦀🚀 ١٢٣٤ 	\t  \n\n  ",
    ];
    let mut text = String::new();
    let mut i = 0;
    while text.len() < 100_000 {
        text.push_str(pieces[i % pieces.len()]);
        i += 1;
    }
    text
}

fn vocab(name: &str) -> Tokenizer {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers").join(name);
    Tokenizer::from_gguf_path(&path).unwrap_or_else(|e| panic!("{e}"))
}

fn bench_tokenizer(c: &mut Criterion) {
    let text = text_100kb();
    let mut group = c.benchmark_group("tokenizer_100kb");
    group.throughput(Throughput::Bytes(text.len() as u64));
    group.sample_size(10);
    for name in ["ggml-vocab-qwen2.gguf", "ggml-vocab-llama-spm.gguf"] {
        let tok = vocab(name);
        let ids = tok.encode(&text, false, true).unwrap();
        group
            .bench_function(format!("encode/{name}"), |b| b.iter(|| tok.encode(&text, false, true).unwrap()));
        group.bench_function(format!("decode/{name}"), |b| b.iter(|| tok.decode(&ids, false).unwrap()));
    }
    group.finish();
}

criterion_group!(benches, bench_tokenizer);
criterion_main!(benches);
