//! moe-lanes: run large Mixture-of-Experts language models on one machine with a small GPU.
//!
//! This crate is the library a service embeds. Its folders show the layers, lowest first:
//! - [`format`]: element types, tensor views, GGUF and safetensors files;
//! - [`model`]: the model view by role, architecture adapters, configs, tensor names;
//! - [`reference`]: the plain f32 oracle (shares no arithmetic with the fast paths);
//! - [`moe`]: routing, worklist, phases and policy, cold-lane expert math, the CPU lane pipeline;
//! - [`cache`]: hot set, planner, perf state;
//! - [`gpu`]: the GPU dense stage and hot lane;
//! - [`sample`]: choosing the next token (greedy, sampling filters, penalties, seeds, logprobs);
//! - [`text`]: tokenizers (GGUF metadata, `tokenizer.json`) and streaming detokenization;
//! - [`engine`]: the one `Engine` interface every backend implements, which the CLI, the
//!   server and embedding services go through.
//!
//! The `moe-lanes` CLI is a separate package (`cli/`). See ARCHITECTURE.md.

// The actors live in the top-level `actors/` directory (DESIGN.md layout) but are compiled as
// part of this crate: they need the library's types and the library's engines need them.
#[path = "../actors/mod.rs"]
pub mod actors;

pub mod bench;
pub mod cache;
pub mod engine;
pub mod env;
pub mod format;
pub mod gpu;
pub mod inspect;
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
pub use moe::{expert_math, phase, pipeline, routing, worklist};
