//! Embedding moe-lanes in a program: synthesise a tiny Mixture-of-Experts model into a temporary
//! directory, open it, build an engine (the GPU when one is usable, else the CPU pipeline),
//! render a chat prompt with the model's template (synthetic vocabularies carry ChatML), generate
//! greedily and print the tokens and their text.
//!
//!     cargo run -p moe-lanes --example embed [-- "your message"]
//!
//! The crate documentation (`src/lib.rs`) has the same steps as a doctest that `cargo test` runs.

use moe_lanes::adapter;
use moe_lanes::dtype::DType;
use moe_lanes::engine::{build_engine, EngineOptions};
use moe_lanes::model::Model;
use moe_lanes::synth::{write_synthetic, DimOverrides, Preset, Skew, SynthFormat, SynthOptions};
use moe_lanes::text::{ChatMessage, ChatTemplate, RenderOptions, Tokenizer};
use std::sync::Arc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let message = std::env::args().nth(1).unwrap_or_else(|| "Hello!".to_string());

    // 1. A tiny Qwen3-MoE-shaped model with random weights (a real one: any GGUF file or
    //    safetensors directory that `Model::open` reads).
    let dir = tempfile::tempdir()?;
    let synth = SynthOptions {
        adapter: adapter::by_name("qwen3_moe")?,
        preset: Preset::Tiny,
        dims: DimOverrides::default(),
        dtype: DType::BF16,
        seed: 7,
        skew: Skew::Skewed,
        format: SynthFormat::Gguf,
        out: dir.path().join("tiny.gguf"),
        vocab_from: None,
    };
    let written = write_synthetic(&synth, &mut |_done, _total| {})?;
    println!("wrote {} ({} bytes)", written.path.display(), written.n_bytes);

    // 2. Open it; its tokenizer and chat template come from the file.
    let model = Arc::new(Model::open(&synth.out)?);
    let tokenizer = Tokenizer::from_model(&model)?;
    let template = ChatTemplate::from_tokenizer(&tokenizer, &synth.out)?;

    // 3. An engine for sessions of up to 128 positions (prompt plus generated tokens).
    let (mut engine, report) = build_engine(&model, EngineOptions::with_context(128))?;
    println!("engine: {} on {}", report.kind, engine.device());

    // 4. The conversation as the model's prompt, then 16 greedy tokens.
    let conversation = [ChatMessage::user(message)];
    let opts = RenderOptions { add_generation_prompt: true, ..RenderOptions::default() };
    let prompt = template.encode(&tokenizer, &conversation, opts)?;
    println!("prompt: {:?}", tokenizer.decode(&prompt, false)?);
    let tokens = engine.generate(&prompt, 16)?;
    println!("generated: {tokens:?}");
    // Random weights: the text is noise, but it is the model's.
    println!("text: {:?}", tokenizer.decode(&tokens, true)?);
    Ok(())
}
