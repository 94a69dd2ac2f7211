//! The GPU side of moe-lanes: a model resident on one CUDA device, or split by layers over
//! several (non-expert weights and a VRAM hot cache of experts on the device that runs each
//! layer), whose MoE layers split routed slots into a hot lane on the GPU and a cold lane on the
//! CPU ([`crate::moe::cold::ColdLane`], one for every device), overlapped and joined per layer.
//!
//! `GpuModel` (`model`) walks its devices' `shard::Shard`s in layer order (`split`: which layers
//! each device runs; the hidden rows hop between devices through host memory); a shard is a
//! loop over its layers through owned stages that share one read-only `device::Device` per
//! layer (`device`: backend, plan, options, weights, scratch; the matrix products): `mixer` (attention or DeltaNet), `moe` with `route` (router, shared
//! expert, hot/cold split, lanes, join, fallback), `head` (embedding, lm_head, copies back),
//! `graph` (decode graphs over those stages); `latent` is the mixer's latent attention
//! (DeepSeek-V3 / Kimi K2). Beside them: `options` (switches, injected
//! faults), `weights` (upload), `hot_cache` (slots, maps, exchanges), `kv` (KV cache), `scratch` (per-call
//! buffers), `postfetch` (cold experts copied to a VRAM scratchpad and computed on the GPU when
//! a cost model says so), `stats` (lane statistics, profile), `batch` (one call over several
//! sequences), `ping_pong` (a batched decode step as two micro-batches whose lanes alternate).
//!
//! Without a CUDA driver nothing here can run: [`CudaBackend::try_new`] returns an error that
//! callers report before falling back to the CPU path.

mod batch;
mod device;
mod error;
mod graph;
mod head;
mod hot_cache;
mod kv;
mod latent;
mod mixer;
mod model;
mod moe;
mod options;
mod ping_pong;
mod postfetch;
mod route;
mod scratch;
mod shard;
pub mod split;
mod stats;
mod weights;

pub use batch::GpuSeqInput;
pub use error::GpuError;
pub use kv::{GpuKvCache, RecurrentState};
pub use model::GpuModel;
pub use moe_lanes_kernels::cuda::{CudaBackend, CudaError};
pub use options::{
    BadFault, GpuFaults, GpuOptions, LayerFaults, PrefillActivations, PrefillAttention,
    BATCH_GEMM_MIN_TOKENS, HOT_GROUPED_MIN_ROWS, HOT_GROUPED_MIN_ROWS_QUANTIZED, HOT_LANE_TIMEOUT,
    MAX_CALL_TOKENS, PING_PONG_MAX_ROWS,
};
pub use postfetch::plan::{
    BadPostFetchMode, PostFetchCosts, PostFetchMode, PostFetchOptions, DEFAULT_MAX_TRANSFERS,
    DEFAULT_SCRATCH_BYTES as POSTFETCH_DEFAULT_SCRATCH_BYTES, MAX_STREAMS as POSTFETCH_MAX_STREAMS,
};
pub use shard::DeviceReport;
pub use split::SplitError;
pub use stats::{ForwardStats, LayerLaneStats, StageProfile, PROFILE_LAYER_STAGES, PROFILE_TAIL_STAGES};
