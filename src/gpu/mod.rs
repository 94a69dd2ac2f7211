//! The GPU side of moe-lanes: a model resident on one CUDA device (non-expert weights and a VRAM
//! hot cache of experts) whose MoE layers split routed slots into a hot lane on the GPU and a cold
//! lane on the CPU ([`ColdExperts`]), overlapped and joined per layer.
//!
//! Without a CUDA driver nothing here can run: [`CudaBackend::try_new`] returns an error that
//! callers report before falling back to the CPU path.

pub mod cold;
pub mod engine;
pub mod pool_cold;
pub mod session;

pub use cold::{ColdExperts, ColdSlot, CpuColdExperts};
pub use engine::{
    ForwardStats, GpuError, GpuKvCache, GpuModel, GpuOptions, HotAssignment, LayerLaneStats, Logits, Phase,
    StageProfile,
};
pub use moe_lanes_kernels::cuda::{CudaBackend, CudaError};
pub use pool_cold::{PoolColdError, PoolColdExperts};
pub use session::{GpuSession, SessionError};
