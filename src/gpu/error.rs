//! What the GPU engine refuses or fails at: one typed enum with structured fields.

use crate::cache::hot_set::HotSetError;
use crate::format::tensor::TensorError;
use crate::reference::ForwardError;
use moe_lanes_kernels::cuda::CudaError;

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error(transparent)]
    Tensor(#[from] TensorError),
    #[error(transparent)]
    HotSet(#[from] HotSetError),
    #[error(transparent)]
    Cold(crate::moe::cold::ColdError),
    #[error(transparent)]
    Split(#[from] super::split::SplitError),
    #[error("the devices' layer ranges {ranges:?} do not cover layers 0..{n_layers} in order")]
    LayerRanges { ranges: Vec<std::ops::Range<usize>>, n_layers: usize },
    #[error(
        "the per-stage GPU profile (MOE_LANES_GPU_PROFILE) runs on one device; the model is split over {devices} \
         (use --devices with one device to profile)"
    )]
    SplitProfile { devices: usize },
    #[error("the experts' activation is {activation:?}; the GPU kernels implement SiLU, GPT-OSS's clamped SwiGLU and the tanh GELU only")]
    Activation { activation: crate::model::arch::FfnActivation },
    #[error(
        "layer {layer_idx} is a {kind} layer, which the GPU engine does not run yet (use --engine pipeline)"
    )]
    Mixer { layer_idx: usize, kind: &'static str },
    #[error(
        "layer {layer_idx}'s FFN is a {kind}, which the GPU engine does not run yet (use --engine pipeline)"
    )]
    Ffn { layer_idx: usize, kind: &'static str },
    /// IQ4_NL tensors: the GPU engine's tensor-core prefill and 8-bit activations of them left
    /// the reference by 3-6e-2 on the H200 (session 27, `quant_engine`), so it refuses them.
    #[error("tensor {tensor} is {dtype}, which the GPU engine does not run yet (use --engine pipeline)")]
    TensorType { tensor: String, dtype: &'static str },
    #[error("head_dim {head_dim} is odd; the GPU RoPE kernels need an even head_dim")]
    OddHeadDim { head_dim: usize },
    #[error(
        "layer {layer_idx}'s attention heads are {head_dim} wide; the GPU attention kernels take at most {max} \
         (use --engine pipeline)"
    )]
    WideHeads { layer_idx: usize, head_dim: usize, max: usize },
    #[error("layer {layer_idx}: {what}, which the GPU engine does not run yet (use --engine pipeline)")]
    AttentionKind { layer_idx: usize, what: &'static str },
    #[error("the hot set has {given} layers, the model has {expected}")]
    HotLayers { given: usize, expected: usize },
    #[error("the hot set has {n_experts} experts per layer, the model has {expected}")]
    HotExperts { n_experts: usize, expected: usize },
    #[error("the hot set uses {lanes} hot lanes; the GPU engine has one")]
    HotLanes { lanes: usize },
    #[error("the hot cache is already allocated; it is never reallocated (exchange slots instead)")]
    HotCacheAllocated,
    #[error("exchange into layer {layer_idx}: expert {expert_idx}'s bytes lie outside the registered maps")]
    ExchangeSource { layer_idx: usize, expert_idx: usize },
    #[error("KV cache capacity {capacity} outside 1..={max_positions}")]
    CacheCapacity { capacity: usize, max_positions: usize },
    #[error("this KV cache was made for another model ({cache_layers} layers of width {cache_kv_dim}; the model has {model_layers} of {model_kv_dim})")]
    CacheModel { cache_layers: usize, cache_kv_dim: usize, model_layers: usize, model_kv_dim: usize },
    #[error("layer {layer_idx}: the router produced expert id {expert_id} (NaN logits?)")]
    BadRoute { layer_idx: usize, expert_id: i32 },
    #[error(transparent)]
    PostFetch(#[from] super::postfetch::plan::BadTransition),
    #[error("layer {layer_idx}: the hot lane's kernels could not be captured into the decode graph")]
    HotLaneCapture { layer_idx: usize },
    #[error("injected fault: {what}")]
    Injected { what: &'static str },
    #[error(
        "KV cache type {kv_type} stores blocks of {block} values, but head_dim is {head_dim} (not a multiple of \
         {block}): choose another type"
    )]
    KvBlocks { kv_type: crate::model::context::KvType, block: usize, head_dim: usize },
    #[error(
        "KV cache type {kv_type} stores blocks of {block} values, but a latent attention row is {width} values \
         (kv_lora_rank + rope, not a multiple of {block}): choose another type"
    )]
    LatentKvBlocks { kv_type: crate::model::context::KvType, block: usize, width: usize },
    /// A paged KV cache could not commit pages for a call (`kv::GpuKvCache::commit`): the call
    /// fails before any work, and the device goes on serving (not a device loss).
    #[error("no device memory left to commit the KV cache for {positions} positions: {source}")]
    KvMemory { positions: usize, source: CudaError },
}

impl GpuError {
    /// Errors that mean the device (or its context) can no longer be trusted: the engine moves
    /// the session to the CPU pipeline instead of failing the call.
    pub fn is_device_loss(&self) -> bool {
        matches!(self, GpuError::Cuda(_) | GpuError::Injected { what: "gpu lost" })
    }
}
