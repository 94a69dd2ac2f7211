//! Compute kernels for moe-lanes. This crate knows nothing of models, files or actors: it takes
//! slices and shapes and computes. CPU kernels pick their SIMD level at run time.
//!
//! - [`simd`]: SIMD level detection and the forced level the caller passes in (parsed with `FromStr`).
//! - [`weights`]: expert weight views (raw, possibly unaligned bytes), dtypes and activations.
//! - [`q8`]: 8-bit activations for the integer (VNNI) decode tiles, [`DecodeActivations`].
//! - [`quant`]: GGML block dequantisation (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4) and the quantised tile.
//! - [`ffn`]: row-range GEMV/GEMM, fused gate/up + activation, down + weighted accumulation,
//!   in decode (one token) and prefill (many tokens per expert, register-blocked) form.
//! - [`pool`]: the cold pool of pinned threads running whole cold-lane jobs.
//! - [`dense`]: row-split GEMV/GEMM of dense weight matrices read in place, on the pool's threads.
//! - [`delta_rule`]: the chunked gated delta rule of one Gated DeltaNet value head (prefill).
//! - [`attention`](mod@attention): causal GQA attention over a head-major KV cache, on the pool's threads.
//! - [`cuda`]: the CUDA backend (dynamically loaded): NVRTC-compiled kernels, cuBLAS, streams, events.
//! - [`bench`](mod@bench): read bandwidth vs. cold-lane effective weight bandwidth.

pub mod attention;
pub mod attention_tiled;
pub mod bench;
pub mod cuda;
pub mod delta_rule;
pub mod dense;
pub mod error;
pub mod ffn;
pub mod kv;
pub mod par;
pub mod pool;
pub mod q8;
pub mod quant;
mod scalar;
pub mod simd;
pub mod sys;
pub mod weights;

/// The message of a panic `catch_unwind` caught (`panic!`'s string), else "unknown panic".
pub fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else {
        "unknown panic".into()
    }
}
#[cfg(target_arch = "x86_64")]
mod x86_amx;
#[cfg(target_arch = "x86_64")]
mod x86_avx2;
#[cfg(target_arch = "x86_64")]
mod x86_avx512;
#[cfg(target_arch = "x86_64")]
mod x86_quant;
#[cfg(target_arch = "x86_64")]
mod x86_quant_gemm;
#[cfg(target_arch = "x86_64")]
mod x86_quant_tile;

/// `n` pseudo-random bytes (xorshift64 from one fixed seed), the unit tests' random blocks.
#[cfg(test)]
pub(crate) fn test_random_bytes(n: usize) -> Vec<u8> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

pub use attention::{
    attention, attention_reference, par_attention, AttentionInput, AttentionScratch, AttentionShape,
};
pub use bench::{run_kernel_bench, KernelBenchOptions, KernelBenchReport};
pub use delta_rule::{
    delta_chunk_len, delta_rule_chunked, delta_rule_recurrent, DeltaHeadInputs, DeltaHeadShape,
};
pub use dense::{matmul, par_matmul, DenseMatrix, MatmulPart, MAX_MATMUL_PARTS};
pub use error::KernelError;
pub use ffn::{
    down_accumulate, expert_ffn_accumulate, gate_up_activation, gemv_rows, gemv_rows_q8, matmul_rows,
    matmul_rows_q8,
};
pub use kv::{KvRows, KvType, KvTypeError};
pub use par::{par_chunk_pairs_mut, par_chunks_mut};
pub use pool::{ColdExpertWork, ColdJob, ColdPool};
pub use q8::{DecodeActivations, Q8Activations, Q8_MAX_TOKENS};
pub use scalar::dot_row;
pub use simd::{available, has_avx512_vnni, SimdLevel};
pub use weights::{Activation, ExpertBias, ExpertWeights, WeightDType};
