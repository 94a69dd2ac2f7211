//! moe-lanes: run large Mixture-of-Experts language models on one machine with a small GPU.
//!
//! This crate is the library a service embeds. Its folders show the layers, lowest first:
//! - [`format`](mod@format): element types, tensor views, GGUF and safetensors files;
//! - [`model`]: the model view by role, architecture adapters, configs, tensor names;
//! - [`reference`](mod@reference): the plain f32 oracle (shares no arithmetic with the fast
//!   paths);
//! - [`moe`]: routing, worklist, phases and policy, cold-lane expert math, the CPU lane pipeline;
//! - [`cache`]: hot set, planner, perf state;
//! - [`gpu`]: the GPU dense stage and hot lane;
//! - [`sample`]: choosing the next token (greedy, sampling filters, penalties, seeds, logprobs);
//! - [`text`]: tokenizers (GGUF metadata, `tokenizer.json`), chat templates, streaming
//!   detokenization, and [`TextGenerator`](crate::text::TextGenerator) for async services;
//! - [`engine`]: the one [`Engine`](crate::engine::Engine) interface every backend implements,
//!   which the CLI, the server and embedding services go through.
//!
//! The `moe-lanes` CLI is a separate package (`cli/`). See ARCHITECTURE.md.
//!
//! # Example
//!
//! Write a tiny synthetic model (random weights, a small byte-level vocabulary), open it, build
//! an engine (the GPU when one is usable, else the CPU pipeline; here the pipeline) and generate
//! from a text prompt. `examples/embed.rs` is the same as a program
//! (`cargo run -p moe-lanes --example embed`), with a chat prompt.
//!
//! ```
//! use moe_lanes::engine::{build_engine, EngineKind, EngineOptions};
//! use moe_lanes::model::Model;
//! use moe_lanes::synth::{write_synthetic, DimOverrides, Preset, Skew, SynthFormat, SynthOptions};
//! use moe_lanes::text::Tokenizer;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let synth = SynthOptions {
//!     adapter: moe_lanes::adapter::by_name("qwen3_moe")?,
//!     preset: Preset::Tiny,
//!     dims: DimOverrides::default(),
//!     dtype: moe_lanes::dtype::DType::BF16,
//!     seed: 7,
//!     skew: Skew::Skewed,
//!     format: SynthFormat::Gguf,
//!     out: dir.path().join("tiny.gguf"),
//!     vocab_from: None,
//! };
//! write_synthetic(&synth, &mut |_done, _total| {})?;
//!
//! let model = std::sync::Arc::new(Model::open(&synth.out)?);
//! let tokenizer = Tokenizer::from_model(&model)?;
//! let mut opts = EngineOptions::with_context(64); // prompt + generated tokens
//! opts.kind = Some(EngineKind::Pipeline);
//! let (mut engine, report) = build_engine(&model, opts)?;
//! assert_eq!(report.kind, EngineKind::Pipeline);
//!
//! let prompt = tokenizer.encode("Once upon a time", false, true)?;
//! let tokens = engine.generate(&prompt, 8)?; // greedy
//! assert_eq!(tokens.len(), 8);
//! println!("{tokens:?}: {}", tokenizer.decode(&tokens, true)?);
//! # Ok(()) }
//! ```

pub mod bench;
pub mod bench_batched;
pub mod cache;
pub mod engine;
pub mod env;
pub mod format;
pub mod forward;
pub mod gpu;
pub mod inspect;
pub mod locality;
pub mod model;
pub mod moe;
pub mod output;
pub mod quantize;
pub mod reference;
pub mod sample;
pub mod scenario;
pub mod synth;
pub mod text;
pub mod threads;
pub mod vocab;

// The flat paths of earlier releases, kept so embedding code keeps compiling.
pub use cache::{hot_set, perf, planner};
pub use format::{dtype, gguf, safetensors, tensor};
pub use model::{arch, arch as adapter, config, naming};
pub use moe::{actors, expert_math, phase, pipeline, routing, worklist};
