//! moe-lanes: run large Mixture-of-Experts language models on one machine with a small GPU.
//!
//! This crate is the library: model formats (GGUF, safetensors), architecture adapters, synthetic
//! checkpoints, the reference forward pass, and (as they land) routing, worklists, cache planning,
//! perf state and metrics. `src/main.rs` is the `moe-lanes` CLI on top of it. See ARCHITECTURE.md.

// The actors live in the top-level `actors/` directory (DESIGN.md layout) but are compiled as
// part of this crate: the CLI in this package needs both the library and the actors, and the
// actors need the library, so they cannot be a separate crate without a dependency cycle.
#[path = "../actors/mod.rs"]
pub mod actors;
pub mod adapter;
pub mod bench;
pub mod config;
pub mod dtype;
pub mod expert_math;
pub mod gguf;
pub mod gpu;
pub mod hot_set;
pub mod inspect;
pub mod model;
pub mod naming;
pub mod perf;
pub mod phase;
pub mod pipeline;
pub mod plan;
pub mod reference;
pub mod routing;
pub mod safetensors;
pub mod synth;
pub mod tensor;
pub mod vocab;
pub mod worklist;
mod write_util;
