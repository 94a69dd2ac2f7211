//! moe-lanes: run large Mixture-of-Experts language models on one machine with a small GPU.
//!
//! This crate is the library: model formats (GGUF, safetensors), architecture adapters, synthetic
//! checkpoints, the reference forward pass, and (as they land) routing, worklists, cache planning,
//! perf state and metrics. `src/main.rs` is the `moe-lanes` CLI on top of it. See ARCHITECTURE.md.

pub mod adapter;
pub mod bench;
pub mod config;
pub mod dtype;
pub mod gguf;
pub mod gpu;
pub mod inspect;
pub mod model;
pub mod naming;
pub mod plan;
pub mod reference;
pub mod safetensors;
pub mod synth;
pub mod tensor;
pub mod vocab;
