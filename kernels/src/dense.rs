//! Dense (non-expert) matrix products on the pool's threads: `y = x · Wᵀ` for weight matrices
//! read in place (raw little-endian bytes of any alignment, F32/F16/BF16, `[rows, cols]`
//! row-major, as `Linear` stores them) and f32 activations of one token (GEMV, decode) or many
//! (GEMM, prefill).
//!
//! Several matrices that share one input (q/k/v, or gate/up) go in one call: their row blocks
//! form one work space, split over the pool's threads by guided self-scheduling in claims of
//! whole `ROW_BLOCK`s, so every thread streams weights at once and each output value is
//! computed by one tile call. Blocks start at absolute multiples of `ROW_BLOCK`, so the
//! result does not depend on the thread count (the same bits with 1 thread or 16).
//!
//! Prefill is a GEMM by construction: the tile kernels take a block of 8 weight rows and run it
//! against every token of the call in register-blocked token groups of up to 6, so a weight row
//! is read from memory once per call (then from L1/L2), not once per token. On the `amx` level
//! a call of 8 or more tokens over BF16 or quantised matrices runs on the AMX tiles instead
//! (`x86_amx`): `x` is packed once per call by all threads, then the claims (whole 16-row tiles)
//! run; a tile's value is the same whichever thread computes it, so the bits still do not depend
//! on the thread count.
//!
//! Quantised matrices take 8-bit activations where the call's [`DecodeActivations`] says so for
//! their type and token count (`DecodeActivations::takes`, the cold lane's rule): `x` is
//! quantised once per call (by all threads for many tokens, token rows claimed like the AMX
//! packing) and the VNNI tiles dot the raw weight levels against it, as llama.cpp's CPU backend
//! does for every quantised product. With f32 activations a Q6_K `lm_head` decodes each weight to
//! f32 before its multiply-add, and on the 2-core build machine (Zen 4) that held a CPU-only
//! Q4_K_M token's 151936-row head at about 18 GB/s, 14.4 of its 21.7 ms. On AMX hosts the rule
//! sends many-token products of every type the many-token integer tiles take to them too (they
//! beat the AMX-BF16 tiles there on experts, `ffn::q8_many_tokens`); a call with such a part has
//! no AMX form.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::error::KernelError;
use crate::ffn::{dot_tiles, ROW_BLOCK};
use crate::pool::ColdPool;
use crate::q8::{quantize_raw, DecodeActivations, Q8Activations, Q8RowIds, Q8Rows};
use crate::simd::SimdLevel;
use crate::weights::WeightDType;

/// Most matrices one [`par_matmul`] call takes (q, k, v is the widest use).
pub const MAX_MATMUL_PARTS: usize = 4;
/// Longest claim in row blocks (256 rows: 1 MiB of BF16 at 2048 columns), so the last claims
/// are short enough for threads to finish together.
const MAX_CLAIM_BLOCKS: usize = 32;
/// Tokens from which a call's 8-bit `x` is quantised by all of the pool's threads: one
/// broadcast (a few us) against about 0.5 us of one thread's work per 2048-value token.
const PAR_QUANTIZE_MIN_TOKENS: usize = 16;

/// A weight matrix `[rows, cols]` as raw bytes (possibly unaligned, straight from a mapped file).
#[derive(Debug, Clone, Copy)]
pub struct DenseMatrix<'a> {
    pub bytes: &'a [u8],
    pub dtype: WeightDType,
    pub rows: usize,
    pub cols: usize,
}

impl<'a> DenseMatrix<'a> {
    /// Checks that `bytes` holds exactly `rows x cols` elements of `dtype` (rows whole blocks).
    pub fn new(bytes: &'a [u8], dtype: WeightDType, rows: usize, cols: usize) -> Result<Self, KernelError> {
        let expected = rows * dtype.row_bytes(cols);
        if bytes.len() != expected || cols == 0 || !cols.is_multiple_of(dtype.block_elems()) {
            return Err(KernelError::ShapeMismatch {
                what: "dense matrix bytes",
                expected,
                actual: bytes.len(),
            });
        }
        Ok(DenseMatrix { bytes, dtype, rows, cols })
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.cols)
    }

    /// Row `r` as bytes (for embedding lookups).
    pub fn row(&self, r: usize) -> &'a [u8] {
        &self.bytes[r * self.row_bytes()..(r + 1) * self.row_bytes()]
    }
}

/// One output of a [`par_matmul`] call: `y` (`tokens x w.rows`) receives `x · wᵀ`.
pub struct MatmulPart<'a, 'y> {
    pub w: DenseMatrix<'a>,
    pub y: &'y mut [f32],
}

/// Raw view of one part for the worker threads.
#[derive(Clone, Copy)]
struct RawPart {
    base: *const u8,
    dtype: WeightDType,
    rows: usize,
    row_bytes: usize,
    y: *mut f32,
    /// First block of this part in the call's block space.
    first_block: usize,
    /// The rows take the call's 8-bit `x` ([`RawCall::q8`]).
    q8: bool,
}

/// Everything the threads share for one call.
struct RawCall {
    parts: [Option<RawPart>; MAX_MATMUL_PARTS],
    x: *const f32,
    cols: usize,
    n_tokens: usize,
    total_blocks: usize,
    level: SimdLevel,
    next_block: AtomicUsize,
    /// The AMX form of the call, where every part runs on the tiles ([`attach_amx`]).
    amx: Option<AmxTokens>,
    /// `x` quantised to 8 bits, where a part takes it and the call has no AMX form
    /// ([`attach_q8`]).
    q8: Option<Q8Tokens>,
}

/// `x` as 8-bit rows (`crate::q8`), token `t` in row `t`; written before any row runs (token
/// rows claimed through `next_token`).
struct Q8Tokens {
    base: (*mut i8, *mut f32, *mut f32),
    next_token: AtomicUsize,
}

/// `x` packed once per call as the AMX tiles' B operand ([`crate::x86_amx::pack_tiles`]), by all
/// threads (token tiles claimed through `next_tile`) before any row runs.
struct AmxTokens {
    packed: *mut u32,
    words: usize,
    next_tile: AtomicUsize,
}

thread_local! {
    /// The calling thread's packed-`x` buffer (grows, never shrinks: 4 MiB for 512 tokens of
    /// 2048 columns).
    static PACKED_X: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The calling thread's 8-bit `x` (grows, never shrinks: 1.1 MiB for 512 tokens of 2048).
    static Q8_X: std::cell::RefCell<Q8Activations> = const { std::cell::RefCell::new(Q8Activations::new()) };
}

// SAFETY: the pointers address the caller's matrices (read only), output slices and packed-`x`
// buffer, which outlive the broadcasts; threads write disjoint row ranges of the outputs (each
// block is claimed by exactly one thread through `next_block`) and disjoint token tiles of the
// packed buffer (`next_tile`), which is only read after the packing broadcast returned.
unsafe impl Sync for RawCall {}

/// `part.y = x · part.wᵀ` for every part, on all of `pool`'s threads. `x` is `tokens x cols`;
/// every matrix has `cols` columns; each `y` is `tokens x rows`. Quantised parts take 8-bit
/// activations where `activations` says so for their type (module docs).
pub fn par_matmul(
    pool: &mut ColdPool,
    (level, activations): (SimdLevel, DecodeActivations),
    x: &[f32],
    parts: &mut [MatmulPart<'_, '_>],
) -> Result<(), KernelError> {
    let mut call = raw_call((level, activations), x, parts)?;
    if call.total_blocks == 0 {
        return Ok(());
    }
    PACKED_X.with_borrow_mut(|buf| {
        Q8_X.with_borrow_mut(|q8| {
            attach_amx(&mut call, buf);
            attach_q8(&mut call, q8)?;
            if call.amx.is_some() || call.n_tokens >= PAR_QUANTIZE_MIN_TOKENS {
                pool.broadcast(&|_index, _n_threads| prepare_worker(&call))?;
            } else {
                prepare_worker(&call);
            }
            pool.broadcast(&|_index, n_threads| matmul_worker(&call, n_threads))
        })
    })
}

/// The same product on the calling thread alone (small matrices, or a caller without a pool).
pub fn matmul(
    (level, activations): (SimdLevel, DecodeActivations),
    x: &[f32],
    parts: &mut [MatmulPart<'_, '_>],
) -> Result<(), KernelError> {
    let mut call = raw_call((level, activations), x, parts)?;
    PACKED_X.with_borrow_mut(|buf| {
        Q8_X.with_borrow_mut(|q8| {
            attach_amx(&mut call, buf);
            attach_q8(&mut call, q8)?;
            prepare_worker(&call);
            matmul_worker(&call, 1);
            Ok(())
        })
    })
}

/// Gives `call` its 8-bit `x` in `buf` when a part takes it and the call has no AMX form.
fn attach_q8(call: &mut RawCall, buf: &mut Q8Activations) -> Result<(), KernelError> {
    if call.amx.is_none() && call.parts.iter().flatten().any(|p| p.q8) {
        buf.reserve_rows(call.n_tokens, call.cols)?;
        call.q8 = Some(Q8Tokens { base: buf.raw_mut(), next_token: AtomicUsize::new(0) });
    }
    Ok(())
}

/// Before any row runs: packs (AMX) or quantises (8-bit) `x` until no token is left.
fn prepare_worker(call: &RawCall) {
    pack_worker(call);
    quantize_worker(call);
}

/// Quantises token rows of a call's 8-bit `x` until none are left (nothing without one).
fn quantize_worker(call: &RawCall) {
    let Some(q8) = &call.q8 else { return };
    let (cols, blocks) = (call.cols, call.cols / crate::q8::Q8_BLOCK);
    loop {
        let t = q8.next_token.fetch_add(1, Ordering::Relaxed);
        if t >= call.n_tokens {
            return;
        }
        // SAFETY: x holds n_tokens rows of cols f32 (raw_call); the buffer holds n_tokens rows
        // of cols values (attach_q8: reserve_rows, cols a multiple of 32 there), and this thread
        // alone claimed row t.
        unsafe {
            let (qs, d, sum) = q8.base;
            quantize_raw(call.x.add(t * cols), cols, qs.add(t * cols), d.add(t * blocks), sum.add(t * blocks))
        };
    }
}

/// Gives `call` its AMX form, with `buf` sized for the packed `x`, when the level is AMX and
/// every part's rows run on the tiles for this many tokens (BF16 or quantised, 8 tokens or more)
/// and none takes 8-bit activations.
fn attach_amx(call: &mut RawCall, buf: &mut Vec<u32>) {
    #[cfg(target_arch = "x86_64")]
    {
        // a part that takes 8-bit activations runs the integer tiles (the cold lane's rule:
        // every type they take, which beat the AMX-BF16 tiles there in experts)
        let usable = |p: &RawPart| !p.q8 && crate::x86_amx::usable(p.dtype, call.n_tokens, call.cols);
        if call.level == SimdLevel::Amx && call.parts.iter().flatten().all(usable) {
            let words = crate::x86_amx::packed_words(call.n_tokens, call.cols);
            if buf.len() < words {
                buf.resize(words, 0);
            }
            call.amx = Some(AmxTokens { packed: buf.as_mut_ptr(), words, next_tile: AtomicUsize::new(0) });
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (call, buf);
}

/// Packs token tiles of an AMX call's `x` until none are left (nothing without an AMX form).
fn pack_worker(call: &RawCall) {
    let Some(amx) = &call.amx else { return };
    #[cfg(target_arch = "x86_64")]
    loop {
        let tile = amx.next_tile.fetch_add(1, Ordering::Relaxed);
        if tile >= crate::x86_amx::token_tiles(call.n_tokens) {
            return;
        }
        let (x, cols) = (call.x, call.cols);
        // SAFETY: the level is AMX (attach_amx), cols % 32 == 0 (usable), x holds n_tokens rows
        // of cols f32; the buffer holds the call's packed words, and this thread alone claimed
        // this tile.
        unsafe {
            crate::x86_amx::pack_tiles(call.n_tokens, cols, |t| x.add(t * cols), tile..tile + 1, amx.packed)
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = amx;
}

fn raw_call(
    (level, activations): (SimdLevel, DecodeActivations),
    x: &[f32],
    parts: &mut [MatmulPart<'_, '_>],
) -> Result<RawCall, KernelError> {
    level.ensure_supported()?;
    if parts.is_empty() || parts.len() > MAX_MATMUL_PARTS {
        return Err(KernelError::ShapeMismatch {
            what: "matmul parts (1..=MAX_MATMUL_PARTS)",
            expected: MAX_MATMUL_PARTS,
            actual: parts.len(),
        });
    }
    let cols = parts[0].w.cols;
    if cols == 0 || !x.len().is_multiple_of(cols) {
        return Err(KernelError::ShapeMismatch {
            what: "x (tokens x cols)",
            expected: cols,
            actual: x.len(),
        });
    }
    let n_tokens = x.len() / cols;
    let mut raw = [None; MAX_MATMUL_PARTS];
    let mut blocks = 0;
    for (slot, part) in raw.iter_mut().zip(parts.iter_mut()) {
        let w = part.w;
        let expected = w.rows * w.dtype.row_bytes(cols);
        if w.cols != cols || w.bytes.len() != expected {
            return Err(KernelError::ShapeMismatch { what: "matrix bytes", expected, actual: w.bytes.len() });
        }
        if part.y.len() != n_tokens * w.rows {
            let (expected, actual) = (n_tokens * w.rows, part.y.len());
            return Err(KernelError::ShapeMismatch { what: "y (tokens x rows)", expected, actual });
        }
        *slot = Some(RawPart {
            base: w.bytes.as_ptr(),
            dtype: w.dtype,
            rows: w.rows,
            row_bytes: w.row_bytes(),
            y: part.y.as_mut_ptr(),
            first_block: blocks,
            q8: activations.takes(level, w.dtype, n_tokens),
        });
        blocks += w.rows.div_ceil(ROW_BLOCK);
    }
    Ok(RawCall {
        parts: raw,
        x: x.as_ptr(),
        cols,
        n_tokens,
        total_blocks: blocks,
        level,
        next_block: AtomicUsize::new(0),
        amx: None,
        q8: None,
    })
}

/// Claims block ranges until none are left and computes them.
fn matmul_worker(call: &RawCall, n_threads: usize) {
    loop {
        let done = call.next_block.load(Ordering::Relaxed);
        if done >= call.total_blocks {
            return;
        }
        let mut want = ((call.total_blocks - done) / (2 * n_threads)).clamp(1, MAX_CLAIM_BLOCKS);
        if call.amx.is_some() {
            // whole 16-row tiles: a tile's rows outside the claim would be computed for nothing
            want = want.next_multiple_of(2);
        }
        let start = call.next_block.fetch_add(want, Ordering::Relaxed);
        if start >= call.total_blocks {
            return;
        }
        let end = (start + want).min(call.total_blocks);
        for part in call.parts.iter().flatten() {
            let part_blocks = part.first_block..part.first_block + part.rows.div_ceil(ROW_BLOCK);
            let (lo, hi) = (start.max(part_blocks.start), end.min(part_blocks.end));
            if lo < hi {
                let first_row = (lo - part.first_block) * ROW_BLOCK;
                let last_row = ((hi - part.first_block) * ROW_BLOCK).min(part.rows);
                part_rows(call, part, first_row, last_row);
            }
        }
    }
}

/// Rows `first..last` of one part for every token.
fn part_rows(call: &RawCall, part: &RawPart, first: usize, last: usize) {
    let (base, row_bytes, x, cols, y, rows) =
        (part.base, part.row_bytes, call.x, call.cols, part.y, part.rows);
    #[cfg(target_arch = "x86_64")]
    if let Some(amx) = &call.amx {
        let mat = crate::x86_amx::Rows { base, row_bytes, n_rows: rows, dtype: part.dtype };
        let sink = |row: usize, tokens: std::ops::Range<usize>, [values]: [&[f32; 16]; 1]| {
            for (j, t) in tokens.enumerate() {
                // SAFETY: y holds n_tokens x rows f32 and this thread alone claimed `row`.
                unsafe { *y.add(t * rows + row) = values[j] };
            }
        };
        // SAFETY: every thread finished packing before this broadcast (pack_worker ran in the one
        // before, or on this thread), so the words are only read now; the level is AMX and the
        // part usable (attach_amx); the matrix holds `rows` rows of cols values (raw_call).
        unsafe {
            let packed = std::slice::from_raw_parts(amx.packed, amx.words);
            crate::x86_amx::rows_times_packed([mat], first..last, cols, call.n_tokens, packed, sink)
        };
        return;
    }
    // SAFETY: `raw_call` checked the matrix holds `rows` rows of `cols` elements, x holds
    // `n_tokens` rows of `cols` f32 and y `n_tokens x rows` f32; first..last < rows; this thread
    // alone claimed these rows, so its writes to y do not race; the level was checked.
    unsafe {
        dot_tiles(
            call.level,
            part.dtype,
            cols,
            last - first,
            rows - first,
            |r| base.add((first + r) * row_bytes),
            call.n_tokens,
            |t| x.add(t * cols),
            q8_tokens(call, part),
            |r, t, value| *y.add(t * rows + first + r) = value,
        )
    };
}

/// The call's 8-bit `x` for `part`'s rows, if they take it (token `t` is row `t`).
fn q8_tokens<'a>(call: &'a RawCall, part: &RawPart) -> Option<Q8Rows<'a>> {
    let q8 = call.q8.as_ref().filter(|_| part.q8)?;
    let (qs, d, sum) = q8.base;
    Some(Q8Rows {
        base: (qs.cast_const(), d.cast_const(), sum.cast_const()),
        cols: call.cols,
        ids: Q8RowIds::From(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_shapes() {
        let bytes = WeightDType::F32.encode(&[1.0; 6]);
        assert!(DenseMatrix::new(&bytes, WeightDType::F32, 2, 4).is_err());
        let w = DenseMatrix::new(&bytes, WeightDType::F32, 2, 3).unwrap();
        let mut y = [0.0f32; 3];
        let err = matmul(
            (SimdLevel::Scalar, DecodeActivations::Auto),
            &[1.0; 3],
            &mut [MatmulPart { w, y: &mut y }],
        )
        .unwrap_err();
        assert!(matches!(err, KernelError::ShapeMismatch { what: "y (tokens x rows)", .. }));
        let mut y = [0.0f32; 2];
        assert!(matmul(
            (SimdLevel::Scalar, DecodeActivations::Auto),
            &[1.0; 4],
            &mut [MatmulPart { w, y: &mut y }]
        )
        .is_err());
        matmul(
            (SimdLevel::Scalar, DecodeActivations::Auto),
            &[1.0, 2.0, 3.0],
            &mut [MatmulPart { w, y: &mut y }],
        )
        .unwrap();
        assert_eq!(y, [6.0, 6.0]);
    }
}
