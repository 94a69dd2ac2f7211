//! Causal multi-head attention (grouped-query, optional sliding window) over a head-major KV
//! cache, on the pool's threads.
//!
//! The cache holds one contiguous `[positions, head_dim]` buffer per KV head ([`KvRows`]: f32,
//! f16, bf16 or q8_0, read a chunk at a time as f32), so the keys a head scans are one
//! sequential stream. The work is done in units of one KV head's query rows
//! ([`crate::attention_tiled`]: prefill in token blocks, decode in key ranges combined after);
//! a unit's result does not depend on which thread ran it. `attention_reference` is the plain
//! oracle.

use std::sync::atomic::AtomicUsize;

use crate::attention_tiled::{partial_floats, split_count, thread_scratch_floats, TiledCall};
use crate::error::KernelError;
use crate::kv::KvRows;
use crate::pool::ColdPool;
use crate::simd::SimdLevel;

/// Head layout of one attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// One layer's attention inputs: queries of the call's tokens and the cache they attend over.
#[derive(Debug, Clone, Copy)]
pub struct AttentionInput<'a> {
    pub shape: AttentionShape,
    /// `tokens x (n_heads * head_dim)`, RoPE applied.
    pub q: &'a [f32],
    /// Per KV head, `positions x head_dim` keys (RoPE applied), the call's tokens included.
    pub keys: &'a [KvRows],
    /// Per KV head, `positions x head_dim` values.
    pub values: &'a [KvRows],
    /// Position of the call's first token.
    pub first_pos: usize,
    /// Position of the caches' first row: 0 for a full layer; a sliding-window layer's cache
    /// drops the positions no later query sees (every visible position is at or past it).
    pub kv_start: usize,
    /// Sliding window: a token at `pos` sees `pos + 1 - window ..= pos`.
    pub window: Option<usize>,
    /// One sink logit per query head (GPT-OSS): it joins each softmax's denominator and
    /// attends to nothing.
    pub sinks: Option<&'a [f32]>,
}

impl AttentionInput<'_> {
    /// Checks every length; returns the number of tokens.
    fn validate(&self, out_len: usize) -> Result<usize, KernelError> {
        let AttentionShape { n_heads, n_kv_heads, head_dim } = self.shape;
        let bad = |what, expected, actual| Err(KernelError::ShapeMismatch { what, expected, actual });
        if n_kv_heads == 0 || head_dim == 0 || n_heads % n_kv_heads != 0 {
            return bad("n_heads (a multiple of n_kv_heads)", n_kv_heads, n_heads);
        }
        let q_dim = n_heads * head_dim;
        if !self.q.len().is_multiple_of(q_dim) {
            return bad("q (tokens x n_heads*head_dim)", q_dim, self.q.len());
        }
        let n_tokens = self.q.len() / q_dim;
        if out_len != self.q.len() {
            return bad("attention out", self.q.len(), out_len);
        }
        if self.keys.len() != n_kv_heads || self.values.len() != n_kv_heads {
            return bad("kv heads", n_kv_heads, self.keys.len().min(self.values.len()));
        }
        let first_seen = self.window.map_or(0, |w| (self.first_pos + 1).saturating_sub(w));
        if self.kv_start > first_seen {
            return bad("kv_start (at most the first visible position)", first_seen, self.kv_start);
        }
        let need = (self.first_pos + n_tokens - self.kv_start) * head_dim;
        for buf in self.keys.iter().chain(self.values) {
            if buf.n_values() < need {
                return bad("kv cache (positions x head_dim)", need, buf.n_values());
            }
            let block = buf.kv_type().block_len();
            if !head_dim.is_multiple_of(block) {
                return bad("head_dim (a multiple of the KV type's block)", block, head_dim);
            }
        }
        if let Some(s) = self.sinks {
            if s.len() != n_heads {
                return bad("sinks (one per query head)", n_heads, s.len());
            }
        }
        if self.window == Some(0) {
            return bad("sliding window", 1, 0);
        }
        Ok(n_tokens)
    }
}

/// Scratch reused across calls: the units' per-thread regions and the decode splits' partials.
#[derive(Debug, Default)]
pub struct AttentionScratch {
    tiles: Vec<f32>,
    partials: Vec<f32>,
}

/// `out[t, head] = softmax(q[t, head] · K[kv]ᵀ / sqrt(head_dim)) · V[kv]` over the visible
/// positions, for every token of the call and every query head, on all of `pool`'s threads
/// (units of [`crate::attention_tiled`]).
pub fn par_attention(
    pool: &mut ColdPool,
    level: SimdLevel,
    input: &AttentionInput<'_>,
    scratch: &mut AttentionScratch,
    out: &mut [f32],
) -> Result<(), KernelError> {
    level.ensure_supported()?;
    let n_tokens = input.validate(out.len())?;
    let call = tiled_call(level, input, n_tokens, scratch, pool.n_threads(), out);
    pool.broadcast(&|index, _| call.work(index))?;
    call.combine();
    Ok(())
}

/// The same attention on the calling thread alone (small calls, where waking the pool costs
/// more than the work); the same units, so the same bits.
pub fn attention(
    level: SimdLevel,
    input: &AttentionInput<'_>,
    scratch: &mut AttentionScratch,
    out: &mut [f32],
) -> Result<(), KernelError> {
    level.ensure_supported()?;
    let n_tokens = input.validate(out.len())?;
    let call = tiled_call(level, input, n_tokens, scratch, 1, out);
    call.work(0);
    call.combine();
    Ok(())
}

/// A call's units over `n_threads` scratch regions (see [`crate::attention_tiled`]).
fn tiled_call<'a>(
    level: SimdLevel,
    input: &AttentionInput<'a>,
    n_tokens: usize,
    scratch: &mut AttentionScratch,
    n_threads: usize,
    out: &mut [f32],
) -> TiledCall<'a> {
    let need = n_threads * thread_scratch_floats(input.shape);
    if scratch.tiles.len() < need {
        scratch.tiles.resize(need, 0.0);
    }
    let splits = split_count(input, n_tokens);
    let partials = if splits > 1 { partial_floats(input.shape, n_tokens, splits) } else { 0 };
    if scratch.partials.len() < partials {
        scratch.partials.resize(partials, 0.0);
    }
    TiledCall {
        input: *input,
        level,
        n_tokens,
        scratch: scratch.tiles.as_mut_ptr(),
        out: out.as_mut_ptr(),
        next_unit: AtomicUsize::new(0),
        splits,
        partials: scratch.partials.as_mut_ptr(),
    }
}

/// Single-thread scalar oracle for [`par_attention`]: plain loops, sequential dot products.
pub fn attention_reference(input: &AttentionInput<'_>, out: &mut [f32]) -> Result<(), KernelError> {
    let n_tokens = input.validate(out.len())?;
    let AttentionShape { n_heads, n_kv_heads, head_dim: hd } = input.shape;
    let scale = 1.0 / (hd as f32).sqrt();
    let keys: Vec<Vec<f32>> = input.keys.iter().map(KvRows::to_f32_vec).collect();
    let values: Vec<Vec<f32>> = input.values.iter().map(KvRows::to_f32_vec).collect();
    for t in 0..n_tokens {
        let pos = input.first_pos + t;
        let first = input.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        for head in 0..n_heads {
            let kv = head / (n_heads / n_kv_heads);
            let q = &input.q[(t * n_heads + head) * hd..(t * n_heads + head + 1) * hd];
            let mut scores: Vec<f32> = (first..=pos)
                .map(|p| {
                    let k = &keys[kv][(p - input.kv_start) * hd..][..hd];
                    q.iter().zip(k).map(|(a, b)| a * b).fold(0.0f32, |s, v| s + v) * scale
                })
                .collect();
            let sink = input.sinks.map(|s| s[head]);
            let max = scores.iter().copied().chain(sink).fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = scores
                .iter_mut()
                .map(|s| {
                    *s = (*s - max).exp();
                    *s
                })
                .sum::<f32>()
                + sink.map_or(0.0, |s| (s - max).exp());
            let o = &mut out[(t * n_heads + head) * hd..(t * n_heads + head + 1) * hd];
            o.iter_mut().for_each(|v| *v = 0.0);
            for (p, s) in (first..=pos).zip(&scores) {
                for (ov, vv) in o.iter_mut().zip(&values[kv][(p - input.kv_start) * hd..][..hd]) {
                    *ov += s / sum * vv;
                }
            }
        }
    }
    Ok(())
}
