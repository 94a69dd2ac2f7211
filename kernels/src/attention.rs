//! Causal multi-head attention (grouped-query, optional sliding window) over a head-major KV
//! cache, on the pool's threads.
//!
//! The cache holds one contiguous `[positions, head_dim]` f32 buffer per KV head, so the keys a
//! head scans are one sequential stream. Work units are (token, query head) pairs, claimed one
//! at a time; each unit's scores (`q · k * scale`, by the SIMD tile kernels with F32 "weights")
//! go to the claiming thread's own scratch row, then a max-subtracted softmax and the weighted
//! sum of the values. A unit's result does not depend on which thread ran it. Calls of
//! `TILED_MIN_TOKENS` tokens or more (prefill) run in tiles instead ([`crate::attention_tiled`]).

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::attention_tiled::{thread_scratch_floats, TiledCall, TILED_MIN_TOKENS};
use crate::error::KernelError;
use crate::ffn::dot_tiles;
use crate::pool::ColdPool;
use crate::simd::SimdLevel;
use crate::weights::WeightDType;

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
    pub keys: &'a [Vec<f32>],
    /// Per KV head, `positions x head_dim` values.
    pub values: &'a [Vec<f32>],
    /// Position of the call's first token.
    pub first_pos: usize,
    /// Sliding window: a token at `pos` sees `pos + 1 - window ..= pos`.
    pub window: Option<usize>,
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
        if self.q.len() % q_dim != 0 {
            return bad("q (tokens x n_heads*head_dim)", q_dim, self.q.len());
        }
        let n_tokens = self.q.len() / q_dim;
        if out_len != self.q.len() {
            return bad("attention out", self.q.len(), out_len);
        }
        if self.keys.len() != n_kv_heads || self.values.len() != n_kv_heads {
            return bad("kv heads", n_kv_heads, self.keys.len().min(self.values.len()));
        }
        let need = (self.first_pos + n_tokens) * head_dim;
        for buf in self.keys.iter().chain(self.values) {
            if buf.len() < need {
                return bad("kv cache (positions x head_dim)", need, buf.len());
            }
        }
        if self.window == Some(0) {
            return bad("sliding window", 1, 0);
        }
        Ok(n_tokens)
    }
}

/// Scores scratch reused across calls: one row of positions per pool thread.
#[derive(Debug, Default)]
pub struct AttentionScratch {
    scores: Vec<f32>,
    /// The tiled prefill path's per-thread regions.
    tiles: Vec<f32>,
}

struct RawAttention<'a> {
    input: AttentionInput<'a>,
    level: SimdLevel,
    n_tokens: usize,
    /// Scores: `n_threads` rows of `row_len`.
    scores: *mut f32,
    row_len: usize,
    out: *mut f32,
    next_unit: AtomicUsize,
}

// SAFETY: `scores` rows are per thread index (each thread writes only its own row); `out` is
// written per (token, head) unit, each claimed by exactly one thread through `next_unit`; the
// buffers outlive the broadcast.
unsafe impl Sync for RawAttention<'_> {}

/// `out[t, head] = softmax(q[t, head] · K[kv]ᵀ / sqrt(head_dim)) · V[kv]` over the visible
/// positions, for every token of the call and every query head, on all of `pool`'s threads.
pub fn par_attention(
    pool: &mut ColdPool,
    level: SimdLevel,
    input: &AttentionInput<'_>,
    scratch: &mut AttentionScratch,
    out: &mut [f32],
) -> Result<(), KernelError> {
    level.ensure_supported()?;
    let n_tokens = input.validate(out.len())?;
    if n_tokens >= TILED_MIN_TOKENS {
        let call = tiled_call(level, input, n_tokens, scratch, pool.n_threads(), out);
        return pool.broadcast(&|index, _| call.work(index));
    }
    let row_len = input.first_pos + n_tokens;
    let n_threads = pool.n_threads();
    if scratch.scores.len() < n_threads * row_len {
        scratch.scores.resize(n_threads * row_len, 0.0);
    }
    let call = RawAttention {
        input: *input,
        level,
        n_tokens,
        scores: scratch.scores.as_mut_ptr(),
        row_len,
        out: out.as_mut_ptr(),
        next_unit: AtomicUsize::new(0),
    };
    pool.broadcast(&|index, _| attention_worker(&call, index))
}

/// The same attention on the calling thread alone (small calls, where waking the pool costs
/// more than the work).
pub fn attention(
    level: SimdLevel,
    input: &AttentionInput<'_>,
    scratch: &mut AttentionScratch,
    out: &mut [f32],
) -> Result<(), KernelError> {
    level.ensure_supported()?;
    let n_tokens = input.validate(out.len())?;
    if n_tokens >= TILED_MIN_TOKENS {
        tiled_call(level, input, n_tokens, scratch, 1, out).work(0);
        return Ok(());
    }
    let row_len = input.first_pos + n_tokens;
    if scratch.scores.len() < row_len {
        scratch.scores.resize(row_len, 0.0);
    }
    let call = RawAttention {
        input: *input,
        level,
        n_tokens,
        scores: scratch.scores.as_mut_ptr(),
        row_len,
        out: out.as_mut_ptr(),
        next_unit: AtomicUsize::new(0),
    };
    attention_worker(&call, 0);
    Ok(())
}

/// A tiled prefill call over `n_threads` scratch regions (see [`crate::attention_tiled`]).
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
    TiledCall {
        input: *input,
        level,
        n_tokens,
        scratch: scratch.tiles.as_mut_ptr(),
        out: out.as_mut_ptr(),
        next_unit: AtomicUsize::new(0),
    }
}

fn attention_worker(call: &RawAttention<'_>, index: usize) {
    let n_heads = call.input.shape.n_heads;
    loop {
        let unit = call.next_unit.fetch_add(1, Ordering::Relaxed);
        if unit >= call.n_tokens * n_heads {
            return;
        }
        // SAFETY: row `index` of the scores belongs to this thread (index < n_threads rows).
        let scores =
            unsafe { std::slice::from_raw_parts_mut(call.scores.add(index * call.row_len), call.row_len) };
        let hd = call.input.shape.head_dim;
        let at = unit * hd; // (token, head) units are laid out as the q and out rows are.
                            // SAFETY: this unit alone writes out[at..at + hd]; validate checked out's length.
        let out = unsafe { std::slice::from_raw_parts_mut(call.out.add(at), hd) };
        attend(call.level, &call.input, unit / n_heads, unit % n_heads, scores, out);
    }
}

/// One (token, head) unit.
fn attend(
    level: SimdLevel,
    input: &AttentionInput<'_>,
    t: usize,
    head: usize,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let AttentionShape { n_heads, n_kv_heads, head_dim: hd } = input.shape;
    let kv = head / (n_heads / n_kv_heads);
    let pos = input.first_pos + t;
    let first = input.window.map_or(0, |w| (pos + 1).saturating_sub(w));
    let q = &input.q[(t * n_heads + head) * hd..(t * n_heads + head + 1) * hd];
    let (keys, values) = (&input.keys[kv], &input.values[kv]);
    let scale = 1.0 / (hd as f32).sqrt();
    let scores = &mut scores[first..=pos];
    let key_base = keys[first * hd..].as_ptr() as *const u8;
    let sink = &mut *scores;
    // SAFETY: rows are positions first..=pos of `keys` (validate checked the cache holds them),
    // `hd` f32 each; q holds hd f32; the level was checked by the caller.
    unsafe {
        dot_tiles(
            level,
            WeightDType::F32,
            hd,
            pos + 1 - first,
            pos + 1 - first,
            |r| key_base.add(r * hd * 4),
            1,
            |_| q.as_ptr(),
            |r, _, value| sink[r] = value * scale,
        )
    };
    softmax(scores);
    out.iter_mut().for_each(|o| *o = 0.0);
    for (p, &prob) in scores.iter().enumerate() {
        let v = &values[(first + p) * hd..(first + p + 1) * hd];
        for (o, &vv) in out.iter_mut().zip(v) {
            *o += prob * vv;
        }
    }
}

/// Softmax in place (max-subtracted, f32).
fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// Single-thread scalar oracle for [`par_attention`]: plain loops, sequential dot products.
pub fn attention_reference(input: &AttentionInput<'_>, out: &mut [f32]) -> Result<(), KernelError> {
    let n_tokens = input.validate(out.len())?;
    let AttentionShape { n_heads, n_kv_heads, head_dim: hd } = input.shape;
    let scale = 1.0 / (hd as f32).sqrt();
    for t in 0..n_tokens {
        let pos = input.first_pos + t;
        let first = input.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        for head in 0..n_heads {
            let kv = head / (n_heads / n_kv_heads);
            let q = &input.q[(t * n_heads + head) * hd..(t * n_heads + head + 1) * hd];
            let mut scores: Vec<f32> = (first..=pos)
                .map(|p| {
                    let k = &input.keys[kv][p * hd..(p + 1) * hd];
                    q.iter().zip(k).map(|(a, b)| a * b).fold(0.0f32, |s, v| s + v) * scale
                })
                .collect();
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = scores
                .iter_mut()
                .map(|s| {
                    *s = (*s - max).exp();
                    *s
                })
                .sum();
            let o = &mut out[(t * n_heads + head) * hd..(t * n_heads + head + 1) * hd];
            o.iter_mut().for_each(|v| *v = 0.0);
            for (p, s) in (first..=pos).zip(&scores) {
                for (ov, vv) in o.iter_mut().zip(&input.values[kv][p * hd..(p + 1) * hd]) {
                    *ov += s / sum * vv;
                }
            }
        }
    }
    Ok(())
}
