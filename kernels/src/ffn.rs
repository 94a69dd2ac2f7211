//! Expert FFN primitives with run-time SIMD dispatch: row-range GEMV/GEMM of a weight matrix
//! against f32 activations, gate/up fused with the activation, and the down projection with
//! weighted accumulation straight into token rows.
//!
//! Every primitive works for one token (decode, GEMV) or many tokens of one expert (prefill,
//! expert-major): rows are processed in blocks of 8 and tokens in blocks of up to 6, and each
//! block runs a register-blocked tile kernel that loads every weight vector once and applies it
//! to all tokens of the block, so a weight row is streamed from memory once per call. Quantised
//! rows for more tokens than one block holds are decoded to f32 once per row block, then tiled.

use std::ops::Range;

use crate::error::KernelError;
use crate::q8::{Q8Activations, Q8Row, Q8Rows, Q8_MAX_TOKENS};
use crate::quant;
use crate::scalar;
use crate::simd::SimdLevel;
use crate::weights::{Activation, ExpertWeights, WeightDType};
#[cfg(target_arch = "x86_64")]
use crate::{x86_avx2, x86_avx512};

/// Rows of one row block; the pool also aligns its work split to it.
pub(crate) const ROW_BLOCK: usize = 8;
/// Row blocks between the one the tiles read and the one they prefetch into L2. One block ahead
/// (3.4 KB for a 768-wide Q4_K matrix, 13 KB for a 2048-wide Q6_K lm_head) left one-token decode
/// waiting on memory: on the build machine (2-core Zen 4, AVX-512 VNNI) two blocks ahead took a
/// 4-layer Qwen3-30B-A3B-shaped Q4_K_M file's CPU-only tg64 from 75.0 / 76.3 / 75.7 to 81.4 / 82.2
/// / 82.2 t/s in alternating runs (the Q6_K lm_head 8.0 -> 7.0 ms), where a distance of 24 KB
/// in whole blocks (8 blocks for the 768-wide down projections) lost 8% in the cold lane.
const PREFETCH_BLOCKS_AHEAD: usize = 2;

const MAX_TILE_TOKENS: usize = 6;

fn rows_per_tile(level: SimdLevel, n_tokens: usize) -> usize {
    match level {
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 | SimdLevel::Avx512Bf16 | SimdLevel::Amx => x86_avx512::rows_per_tile(n_tokens),
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => x86_avx2::rows_per_tile(n_tokens),
        _ => {
            let _ = n_tokens;
            ROW_BLOCK
        }
    }
}

#[cfg(target_arch = "x86_64")]
const _: () =
    assert!(x86_avx2::MAX_TILE_TOKENS == MAX_TILE_TOKENS && x86_avx512::MAX_TILE_TOKENS == MAX_TILE_TOKENS);

/// Runs one tile on the level's kernel.
///
/// # Safety
/// `level` must be supported by this CPU; pointer contract as [`scalar::tile`].
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn run_tile(
    level: SimdLevel,
    dtype: WeightDType,
    rows: &[*const u8],
    prefetch_rows: *const *const u8,
    xs: &[*const f32],
    q8: Option<Q8Row>,
    cols: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if let Some(x) = q8 {
        // SAFETY: `q8` is only given where the level has a tile for the type (`dot_tiles`: VNNI,
        // or AVX2's) and it holds the one token's `cols` quantised values; the rows as in the
        // caller's contract.
        let done = unsafe {
            match level.has_q8_dot() {
                true => {
                    crate::x86_quant_tile::avx512_vnni::decode_tile(dtype, rows, prefetch_rows, x, cols, out)
                }
                false => {
                    crate::x86_quant_tile::avx2_q8::decode_tile(dtype, rows, prefetch_rows, x, cols, out)
                }
            }
        };
        if done {
            return;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = q8;
    if dtype.is_quantized() {
        // SAFETY: forwarded from the caller (level detected; rows hold `cols` values of
        // `dtype`, whole blocks).
        unsafe {
            match level {
                #[cfg(target_arch = "x86_64")]
                SimdLevel::Avx2 => x86_avx2::quant_tile(dtype, rows, prefetch_rows, xs, cols, out),
                #[cfg(target_arch = "x86_64")]
                SimdLevel::Avx512 | SimdLevel::Avx512Bf16 | SimdLevel::Amx => {
                    x86_avx512::quant_tile(dtype, rows, prefetch_rows, xs, cols, out)
                }
                _ => {
                    let mut run_f32 =
                        |rows: &[*const u8], xs: &[*const f32], cols: usize, out: &mut [f32]| {
                            scalar::tile(WeightDType::F32, rows, xs, cols, out)
                        };
                    let dequant = |src: *const u8, n_blocks: usize, dst: *mut f32| {
                        quant::dequantize_blocks_scalar(dtype, src, n_blocks, dst)
                    };
                    quant::tile(dtype, rows, std::ptr::null(), xs, cols, out, dequant, &mut run_f32)
                }
            }
        };
        return;
    }
    // SAFETY: forwarded from the caller (level detected, pointers valid for `cols`).
    unsafe {
        match level {
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => x86_avx2::tile(dtype, rows, prefetch_rows, xs, cols, out),
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 | SimdLevel::Amx => x86_avx512::tile(dtype, rows, prefetch_rows, xs, cols, out),
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512Bf16 => x86_avx512::tile_bf16dot(dtype, rows, prefetch_rows, xs, cols, out),
            _ => {
                let _ = prefetch_rows;
                scalar::tile(dtype, rows, xs, cols, out)
            }
        }
    }
}

/// One row tile for a few tokens with 8-bit activations: the one-token tile per token (`q8.0`'s
/// rows from token `q8.1` on), the row tile prefetched once; `out` as [`run_tile`] (row-major,
/// `xs.len()` values a row). On VNNI an 8-row tile of any type but Q6_K takes the tokens two at
/// a time (`decode_tile_pair`: the levels and scales unpacked once for both).
///
/// # Safety
/// As [`run_tile`]; `q8.0.row(q8.1 + t)` holds token `t`'s quantised activations.
#[allow(clippy::too_many_arguments)]
unsafe fn q8_tokens(
    level: SimdLevel,
    dtype: WeightDType,
    rows: &[*const u8],
    prefetch_rows: *const *const u8,
    xs: &[*const f32],
    (q8, token0): (Q8Rows<'_>, usize),
    cols: usize,
    out: &mut [f32],
) {
    let n = xs.len();
    if n == 1 {
        // one token (every decode call): the tile writes `out` itself
        // SAFETY: forwarded contract.
        return unsafe { run_tile(level, dtype, rows, prefetch_rows, xs, Some(q8.row(token0)), cols, out) };
    }
    let mut token_sums = [0.0f32; 2 * ROW_BLOCK];
    let mut t = 0;
    #[cfg(target_arch = "x86_64")]
    while level.has_q8_dot() && t + 2 <= n {
        let prefetch = if t == 0 { prefetch_rows } else { std::ptr::null() };
        let pair = [q8.row(token0 + t), q8.row(token0 + t + 1)];
        // SAFETY: VNNI (has_q8_dot); the two tokens' quantised rows and the rows as in the
        // caller's contract.
        let sums = &mut token_sums[..2 * rows.len()];
        let done = unsafe {
            crate::x86_quant_tile::avx512_vnni::decode_tile_pair(dtype, rows, prefetch, pair, cols, sums)
        };
        if !done {
            break;
        }
        for r in 0..rows.len() {
            out[r * n + t] = sums[2 * r];
            out[r * n + t + 1] = sums[2 * r + 1];
        }
        t += 2;
    }
    let token_sums = &mut token_sums[..rows.len()];
    for t in t..n {
        let prefetch = if t == 0 { prefetch_rows } else { std::ptr::null() };
        // SAFETY: forwarded contract, token t alone.
        unsafe {
            run_tile(level, dtype, rows, prefetch, &xs[t..t + 1], Some(q8.row(token0 + t)), cols, token_sums)
        };
        for (r, v) in token_sums.iter().enumerate() {
            out[r * n + t] = *v;
        }
    }
}

/// Computes `dot(row r, x t)` for rows `0..n_rows` and tokens `0..n_tokens`, handing each
/// value to `sink(r, t, value)`. For a fixed token, rows arrive in increasing order.
///
/// Rows `n_rows..n_rows_prefetchable` exist in memory (the caller's range ends before the
/// matrix does): they are only prefetched, so streaming runs on across range boundaries.
///
/// `q8`: the tokens' activations quantised to 8 bits ([`crate::q8`]); used only when `dtype` is
/// quantised and the level has an 8-bit tile for it ([`SimdLevel::has_q8_tile`]): for
/// `n_tokens <= Q8_MAX_TOKENS` every token runs the one-token tile (VNNI's, or AVX2's) over each
/// row tile while the rows are in cache; for more, the many-token VNNI tiles take the types
/// [`q8_many_tokens`] names (the others run f32).
///
/// # Safety
/// `level` must be supported by this CPU; `row_ptr(r)` must address `cols` elements of
/// `dtype` for every `r < n_rows`, and `token_ptr(t)` `cols` f32 for every `t < n_tokens`;
/// `row_ptr(r)` must be computable (not dereferenced) for `r < n_rows_prefetchable`; each `q8`
/// row (`q8.row(t)`, `t < n_tokens`) must hold `cols` quantised values of token t's activations.
///
/// Quantised rows with more tokens than one tile takes (and no 8-bit activations) are decoded
/// to f32 once per row block ([`dequantized_dot_tiles`]).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn dot_tiles(
    level: SimdLevel,
    dtype: WeightDType,
    cols: usize,
    n_rows: usize,
    n_rows_prefetchable: usize,
    row_ptr: impl Fn(usize) -> *const u8,
    n_tokens: usize,
    token_ptr: impl Fn(usize) -> *const f32,
    q8: Option<Q8Rows<'_>>,
    sink: impl FnMut(usize, usize, f32),
) {
    let q8 = q8.filter(|_| level.has_q8_tile(dtype));
    #[cfg(target_arch = "x86_64")]
    if let Some(q8) = q8.filter(|_| n_tokens > Q8_MAX_TOKENS && q8_many_tokens(level, dtype)) {
        // SAFETY: VNNI checked (q8_many_tokens); the rows and 8-bit tokens are the caller's contract.
        return unsafe {
            crate::x86_quant_gemm::rows_times_tokens(dtype, cols, n_rows, row_ptr, n_tokens, q8, sink)
        };
    }
    let q8 = q8.filter(|_| n_tokens <= Q8_MAX_TOKENS);
    if q8.is_none() && dtype.is_quantized() && n_tokens > MAX_TILE_TOKENS {
        // SAFETY: forwarded contract.
        return unsafe {
            dequantized_dot_tiles(level, dtype, cols, n_rows, row_ptr, n_tokens, token_ptr, sink)
        };
    }
    // SAFETY: forwarded contract.
    unsafe {
        dot_tiles_direct(
            level,
            dtype,
            cols,
            n_rows,
            n_rows_prefetchable,
            row_ptr,
            n_tokens,
            token_ptr,
            q8,
            sink,
        )
    }
}

/// Whether calls of more than [`Q8_MAX_TOKENS`] tokens over `dtype` rows take 8-bit activations
/// at `level` (the many-token integer tiles, `x86_quant_gemm.rs`): the pool quantises the tokens
/// for them. Every type they take at every VNNI level, AMX hosts too: on the H200 machine's host
/// one expert of the Qwen3-30B-A3B shape ran 1.5-4.2x faster on them than on the AMX-BF16 tiles
/// for each of Q4_K, Q5_K, Q6_K, Q8_0 and MXFP4 at 8 to 128 tokens (`x86_quant_gemm`'s timing
/// test, benches/RESULTS.md session 46; Q4_K and Q6_K took them there since sessions 32-33).
pub(crate) fn q8_many_tokens(level: SimdLevel, dtype: WeightDType) -> bool {
    #[cfg(target_arch = "x86_64")]
    return level.has_q8_dot() && crate::x86_quant_gemm::takes(dtype);
    #[cfg(not(target_arch = "x86_64"))]
    return false;
}

thread_local! {
    /// [`dequantized_dot_tiles`]'s f32 rows (`ROW_BLOCK x cols`; grows, never shrinks: 229 KB a
    /// thread at 7168 columns).
    static DEQUANTIZED_ROWS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// [`dot_tiles`] over quantised rows for many tokens (prefill): each block of [`ROW_BLOCK`]
/// rows decoded to f32 once (into a per-thread buffer that stays in L2) and run by the f32
/// tiles for every token block. The fused quantised tile decodes a row chunk for each block of
/// [`MAX_TILE_TOKENS`] tokens, so an expert with 32 prefill tokens decoded every row 6 times (a
/// quarter of CPU-only Q4_K_M prefill time). Results differ from the fused tile by f32
/// summation order only (the decoders are bit-equal to [`quant::dequantize_block`]).
///
/// # Safety
/// As [`dot_tiles`]; `dtype` quantised.
#[allow(clippy::too_many_arguments)]
unsafe fn dequantized_dot_tiles(
    level: SimdLevel,
    dtype: WeightDType,
    cols: usize,
    n_rows: usize,
    row_ptr: impl Fn(usize) -> *const u8,
    n_tokens: usize,
    token_ptr: impl Fn(usize) -> *const f32,
    mut sink: impl FnMut(usize, usize, f32),
) {
    DEQUANTIZED_ROWS.with(|buf| {
        let mut buf = buf.borrow_mut();
        if buf.len() < ROW_BLOCK * cols {
            buf.resize(ROW_BLOCK * cols, 0.0);
        }
        let n_blocks = cols / dtype.block_elems();
        let mut row0 = 0;
        while row0 < n_rows {
            let block_rows = ROW_BLOCK.min(n_rows - row0);
            for r in 0..block_rows {
                // SAFETY: row `row0 + r` holds `cols` values of `dtype` (whole blocks); the
                // buffer holds ROW_BLOCK rows of `cols` f32.
                unsafe {
                    dequantize_rows(level, dtype, row_ptr(row0 + r), n_blocks, buf.as_mut_ptr().add(r * cols))
                };
            }
            let base = buf.as_ptr();
            let f32_row = |r: usize| base.wrapping_add(r * cols) as *const u8;
            let block_sink = |r: usize, t: usize, v: f32| sink(row0 + r, t, v);
            // SAFETY: the buffer's first `block_rows` rows hold `cols` f32 each; the tokens are
            // the caller's.
            unsafe {
                let (rows, tokens) = (block_rows, n_tokens);
                dot_tiles_direct(
                    level,
                    WeightDType::F32,
                    cols,
                    rows,
                    rows,
                    f32_row,
                    tokens,
                    &token_ptr,
                    None,
                    block_sink,
                )
            };
            row0 += block_rows;
        }
    })
}

/// `n_blocks` blocks of quantised `dtype` at `src` into f32 at `dst`, by the level's decoder.
///
/// # Safety
/// `level` supported by this CPU; `src` addresses `n_blocks` whole blocks, `dst` room for their
/// values.
pub(crate) unsafe fn dequantize_rows(
    level: SimdLevel,
    dtype: WeightDType,
    src: *const u8,
    n_blocks: usize,
    dst: *mut f32,
) {
    // SAFETY: forwarded contract (the level checked by the caller).
    unsafe {
        match level {
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => crate::x86_quant::avx2::dequantize_blocks(dtype, src, n_blocks, dst),
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 | SimdLevel::Avx512Bf16 | SimdLevel::Amx => {
                crate::x86_quant::avx512::dequantize_blocks(dtype, src, n_blocks, dst)
            }
            _ => quant::dequantize_blocks_scalar(dtype, src, n_blocks, dst),
        }
    }
}

/// [`dot_tiles`]'s tile loop: row blocks, token blocks, the level's tiles (fused quantised ones
/// where `dtype` is quantised).
///
/// # Safety
/// As [`dot_tiles`].
#[allow(clippy::too_many_arguments)]
unsafe fn dot_tiles_direct(
    level: SimdLevel,
    dtype: WeightDType,
    cols: usize,
    n_rows: usize,
    n_rows_prefetchable: usize,
    row_ptr: impl Fn(usize) -> *const u8,
    n_tokens: usize,
    token_ptr: impl Fn(usize) -> *const f32,
    q8: Option<Q8Rows<'_>>,
    mut sink: impl FnMut(usize, usize, f32),
) {
    let mut rows = [std::ptr::null::<u8>(); ROW_BLOCK];
    let mut next_block_rows = [std::ptr::null::<u8>(); ROW_BLOCK];
    let mut xs = [std::ptr::null::<f32>(); MAX_TILE_TOKENS];
    let mut sums = [0.0f32; ROW_BLOCK * MAX_TILE_TOKENS];
    let mut row0 = 0;
    let ahead = ROW_BLOCK * PREFETCH_BLOCKS_AHEAD;
    while row0 < n_rows {
        let block_rows = ROW_BLOCK.min(n_rows - row0);
        let mut token0 = 0;
        while token0 < n_tokens {
            let block_tokens = MAX_TILE_TOKENS.min(n_tokens - token0);
            for (i, x) in xs[..block_tokens].iter_mut().enumerate() {
                *x = token_ptr(token0 + i);
            }
            // 8-bit tokens run the one-token tile one after another
            let tile_tokens = if q8.is_some() { 1 } else { block_tokens };
            let tile_rows = if block_rows == ROW_BLOCK { rows_per_tile(level, tile_tokens) } else { 1 };
            // While the first token block streams this row block, prefetch a full row block
            // `ahead` rows on (same sub-tile position) into L2, whatever the row layout.
            let prefetch_next = token0 == 0 && row0 + ahead + ROW_BLOCK <= n_rows_prefetchable.max(n_rows);
            let mut sub = 0;
            while sub < block_rows {
                for (i, row) in rows[..tile_rows].iter_mut().enumerate() {
                    *row = row_ptr(row0 + sub + i);
                }
                let prefetch_rows = if prefetch_next {
                    for (i, row) in next_block_rows[..tile_rows].iter_mut().enumerate() {
                        *row = row_ptr(row0 + ahead + sub + i);
                    }
                    next_block_rows.as_ptr()
                } else {
                    std::ptr::null()
                };
                let out = &mut sums[..tile_rows * block_tokens];
                match q8 {
                    // SAFETY: as below, one token at a time (its quantised row, the contract).
                    Some(q) => unsafe {
                        q8_tokens(
                            level,
                            dtype,
                            &rows[..tile_rows],
                            prefetch_rows,
                            &xs[..block_tokens],
                            (q, token0),
                            cols,
                            out,
                        )
                    },
                    // SAFETY: forwarded contract; the tile shape is one the level's kernel
                    // provides; prefetch pointers address rows < n_rows_prefetchable (and are
                    // only hints).
                    None => unsafe {
                        run_tile(
                            level,
                            dtype,
                            &rows[..tile_rows],
                            prefetch_rows,
                            &xs[..block_tokens],
                            None,
                            cols,
                            out,
                        )
                    },
                }
                for r in 0..tile_rows {
                    for t in 0..block_tokens {
                        sink(row0 + sub + r, token0 + t, out[r * block_tokens + t]);
                    }
                }
                sub += tile_rows;
            }
            token0 += block_tokens;
        }
        row0 += block_rows;
    }
}

/// Gate/up fused with the activation for ff rows `ff_rows` and `n_tokens` tokens:
/// `h[t*ff + k] = act(gate_k·x_t) * (up_k·x_t)`. Gate row k and up row k stream side by side.
///
/// # Safety
/// `level` supported; `weights` validated; `token_ptr(t)` addresses `hidden` f32; `h_base`
/// addresses `n_tokens * ff` writable f32 not read or written by anyone else in `ff_rows`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gate_up_unchecked(
    level: SimdLevel,
    weights: &ExpertWeights<'_>,
    act: Activation,
    ff_rows: Range<usize>,
    n_tokens: usize,
    token_ptr: impl Fn(usize) -> *const f32,
    q8: Option<Q8Rows<'_>>,
    h_base: *mut f32,
) {
    let row_bytes = weights.dtype.row_bytes(weights.hidden);
    let (gate, up, ff, first) = (weights.gate.as_ptr(), weights.up.as_ptr(), weights.ff, ff_rows.start);
    // Virtual row 2i is gate row first+i, 2i+1 is up row first+i.
    let row_ptr = |virtual_row: usize| {
        let matrix = if virtual_row.is_multiple_of(2) { gate } else { up };
        // SAFETY: first + virtual_row / 2 < ff (dereferenced only below ff_rows.end), inside the
        // validated matrix.
        unsafe { matrix.add((first + virtual_row / 2) * row_bytes) }
    };
    let bias = weights.bias;
    let sink = |virtual_row: usize, token: usize, value: f32| {
        let row = first + virtual_row / 2;
        // SAFETY: token < n_tokens and the ff row is in `ff_rows`, which the caller owns.
        let slot = unsafe { &mut *h_base.add(token * ff + row) };
        if virtual_row.is_multiple_of(2) {
            // gate first (rows arrive in increasing order per token) ...
            *slot = bias.map_or(value, |b| value + b.gate[row]);
        } else {
            // ... then up completes the activation.
            *slot = act.gated(*slot, bias.map_or(value, |b| value + b.up[row]));
        }
    };
    #[cfg(target_arch = "x86_64")]
    if q8.is_none()
        && level == SimdLevel::Amx
        && crate::x86_amx::usable(weights.dtype, n_tokens, weights.hidden)
    {
        let mat =
            |base: *const u8| crate::x86_amx::Rows { base, row_bytes, n_rows: ff, dtype: weights.dtype };
        let sink = |row: usize, tokens: Range<usize>, [g, u]: [&[f32; 16]; 2]| {
            for (j, t) in tokens.enumerate() {
                // SAFETY: t < n_tokens and row is in `ff_rows`, which the caller owns.
                let (g, u) = bias.map_or((g[j], u[j]), |b| (g[j] + b.gate[row], u[j] + b.up[row]));
                unsafe { *h_base.add(t * ff + row) = act.gated(g, u) };
            }
        };
        // SAFETY: level Amx detected (caller), the call is usable, the matrices hold ff rows of
        // hidden values of their type (validated), ff_rows.end <= ff, tokens as in the caller's
        // contract.
        return unsafe {
            crate::x86_amx::rows_times_tokens(
                [mat(gate), mat(up)],
                ff_rows,
                weights.hidden,
                n_tokens,
                token_ptr,
                sink,
            )
        };
    }
    let prefetchable = 2 * (ff - first);
    // SAFETY: forwarded contract.
    unsafe {
        dot_tiles(
            level,
            weights.dtype,
            weights.hidden,
            2 * ff_rows.len(),
            prefetchable,
            row_ptr,
            n_tokens,
            token_ptr,
            q8,
            sink,
        )
    };
}

/// Words of `n_tokens` rows of `cols` f32 packed for the AMX tiles, when a call over `dtype` rows
/// of `cols` columns with that many tokens runs on them at `level` (else `None`): the pool packs
/// an expert's `h` once ([`amx_pack`]) for all of its down calls.
pub(crate) fn amx_packed_words(
    level: SimdLevel,
    dtype: WeightDType,
    n_tokens: usize,
    cols: usize,
) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    if level == SimdLevel::Amx && crate::x86_amx::usable(dtype, n_tokens, cols) {
        return Some(crate::x86_amx::packed_words(n_tokens, cols));
    }
    let _ = (level, dtype, n_tokens, cols);
    None
}

/// Packs `n_tokens` rows of `cols` f32 at `rows` (contiguous) for the AMX tiles into `out`.
///
/// # Safety
/// [`amx_packed_words`] gave `Some(n)` for this level and shape, `out` holds `n` words, and
/// `rows` addresses `n_tokens * cols` f32.
pub(crate) unsafe fn amx_pack(
    level: SimdLevel,
    n_tokens: usize,
    cols: usize,
    rows: *const f32,
    out: &mut [u32],
) {
    debug_assert_eq!(level, SimdLevel::Amx);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the level is Amx (AVX-512 BF16 present), cols % 32 == 0 (usable), rows as the
    // caller vouches.
    unsafe {
        crate::x86_amx::pack(n_tokens, cols, |t| rows.add(t * cols), out)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (level, n_tokens, cols, rows, out);
}

/// Down projection for hidden rows `hidden_rows`: `out(t)[row] += token_weight[t] * down_row·h_t`
/// with `h_t` at `h_base + t*ff` and the output row of token t at `out_row_ptr(t)`.
///
/// # Safety
/// `level` supported; `weights` validated; `h_base` addresses `n_tokens * ff` f32;
/// `out_row_ptr(t)` addresses `hidden` f32 whose `hidden_rows` nobody else touches meanwhile;
/// `amx_h`, if given, is the [`amx_pack`] of this `h`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn down_unchecked(
    level: SimdLevel,
    weights: &ExpertWeights<'_>,
    hidden_rows: Range<usize>,
    n_tokens: usize,
    h_base: *const f32,
    q8: Option<Q8Rows<'_>>,
    amx_h: Option<&[u32]>,
    token_weight: &[f32],
    out_row_ptr: impl Fn(usize) -> *mut f32,
) {
    // SAFETY: forwarded contract.
    unsafe {
        down_rows::<true>(level, weights, hidden_rows, n_tokens, h_base, q8, amx_h, token_weight, out_row_ptr)
    }
}

/// As [`down_unchecked`], but stores `token_weight[t] * down_row·h_t` instead of adding it (the
/// same product, so adding the stored values later in the same order gives the same bits).
///
/// # Safety
/// As [`down_unchecked`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn down_store_unchecked(
    level: SimdLevel,
    weights: &ExpertWeights<'_>,
    hidden_rows: Range<usize>,
    n_tokens: usize,
    h_base: *const f32,
    q8: Option<Q8Rows<'_>>,
    amx_h: Option<&[u32]>,
    token_weight: &[f32],
    out_row_ptr: impl Fn(usize) -> *mut f32,
) {
    // SAFETY: forwarded contract.
    unsafe {
        down_rows::<false>(
            level,
            weights,
            hidden_rows,
            n_tokens,
            h_base,
            q8,
            amx_h,
            token_weight,
            out_row_ptr,
        )
    }
}

/// Shared body of [`down_unchecked`] (`ACCUMULATE`) and [`down_store_unchecked`].
///
/// # Safety
/// As [`down_unchecked`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn down_rows<const ACCUMULATE: bool>(
    level: SimdLevel,
    weights: &ExpertWeights<'_>,
    hidden_rows: Range<usize>,
    n_tokens: usize,
    h_base: *const f32,
    q8: Option<Q8Rows<'_>>,
    amx_h: Option<&[u32]>,
    token_weight: &[f32],
    out_row_ptr: impl Fn(usize) -> *mut f32,
) {
    #[cfg(not(target_arch = "x86_64"))]
    let _ = amx_h;
    let row_bytes = weights.down_dtype.row_bytes(weights.ff);
    let (down, ff, first) = (weights.down.as_ptr(), weights.ff, hidden_rows.start);
    // SAFETY: first + r < hidden (dereferenced only below hidden_rows.end), inside the matrix.
    let row_ptr = |r: usize| unsafe { down.add((first + r) * row_bytes) };
    // SAFETY: t < n_tokens, h has n_tokens * ff values.
    let token_ptr = |t: usize| unsafe { h_base.add(t * ff) };
    let bias = weights.bias;
    let sink = |r: usize, t: usize, value: f32| {
        let value = bias.map_or(value, |b| value + b.down[first + r]);
        // SAFETY: the caller owns row first + r of token t's output row.
        unsafe {
            let slot = out_row_ptr(t).add(first + r);
            if ACCUMULATE {
                *slot += token_weight[t] * value;
            } else {
                *slot = token_weight[t] * value;
            }
        };
    };
    #[cfg(target_arch = "x86_64")]
    if q8.is_none() && level == SimdLevel::Amx && crate::x86_amx::usable(weights.down_dtype, n_tokens, ff) {
        let mat =
            crate::x86_amx::Rows { base: down, row_bytes, n_rows: weights.hidden, dtype: weights.down_dtype };
        let sink = |row: usize, tokens: Range<usize>, [values]: [&[f32; 16]; 1]| {
            for (j, t) in tokens.enumerate() {
                let value = bias.map_or(values[j], |b| values[j] + b.down[row]);
                // SAFETY: the caller owns row `row` of token t's output row.
                unsafe {
                    let slot = out_row_ptr(t).add(row);
                    if ACCUMULATE {
                        *slot += token_weight[t] * value;
                    } else {
                        *slot = token_weight[t] * value;
                    }
                }
            }
        };
        // SAFETY: level Amx detected (caller), the call is usable, the matrix holds hidden rows
        // of ff values of its type (validated), hidden_rows.end <= hidden, h holds n_tokens rows of ff (and
        // `amx_h` is its packing, the caller's contract).
        return unsafe {
            match amx_h {
                Some(b) => crate::x86_amx::rows_times_packed([mat], hidden_rows, ff, n_tokens, b, sink),
                None => crate::x86_amx::rows_times_tokens([mat], hidden_rows, ff, n_tokens, token_ptr, sink),
            }
        };
    }
    let prefetchable = weights.hidden - first;
    // SAFETY: forwarded contract.
    unsafe {
        dot_tiles(
            level,
            weights.down_dtype,
            ff,
            hidden_rows.len(),
            prefetchable,
            row_ptr,
            n_tokens,
            token_ptr,
            q8,
            sink,
        )
    };
}

fn check_len(what: &'static str, expected: usize, actual: usize) -> Result<(), KernelError> {
    if expected == actual {
        Ok(())
    } else {
        Err(KernelError::ShapeMismatch { what, expected, actual })
    }
}

fn check_rows(what: &'static str, rows: &Range<usize>, n_rows: usize) -> Result<(), KernelError> {
    if rows.start <= rows.end && rows.end <= n_rows {
        Ok(())
    } else {
        Err(KernelError::RowRangeOutOfBounds { what, start: rows.start, end: rows.end, rows: n_rows })
    }
}

/// GEMM over a row range: `y[t * rows.len() + i] = dot(matrix row rows.start + i, x_t)` for the
/// `T = x.len() / cols` tokens of `x` (`T x cols`, row-major). `matrix` is `[n_rows, cols]`
/// raw little-endian bytes of `dtype` (any alignment).
pub fn matmul_rows(
    level: SimdLevel,
    dtype: WeightDType,
    matrix: &[u8],
    cols: usize,
    x: &[f32],
    rows: Range<usize>,
    y: &mut [f32],
) -> Result<(), KernelError> {
    level.ensure_supported()?;
    let row_bytes = dtype.row_bytes(cols);
    if cols == 0
        || !cols.is_multiple_of(dtype.block_elems())
        || !matrix.len().is_multiple_of(row_bytes)
        || !x.len().is_multiple_of(cols)
    {
        return Err(KernelError::ShapeMismatch { what: "matrix/x columns", expected: cols, actual: x.len() });
    }
    let n_tokens = x.len() / cols;
    check_rows("matrix", &rows, matrix.len() / row_bytes)?;
    check_len("y", n_tokens * rows.len(), y.len())?;
    let n_out = rows.len();
    let (base, first, x_base) = (matrix.as_ptr(), rows.start, x.as_ptr());
    // SAFETY: level checked; rows are in bounds of `matrix`, tokens of `x`, sinks of `y`.
    unsafe {
        dot_tiles(
            level,
            dtype,
            cols,
            n_out,
            matrix.len() / row_bytes - first,
            |r| base.add((first + r) * row_bytes),
            n_tokens,
            |t| x_base.add(t * cols),
            None,
            |r, t, value| y[t * n_out + r] = value,
        )
    };
    Ok(())
}

/// GEMV over a row range: `y[i] = dot(matrix row rows.start + i, x)`; see [`matmul_rows`].
pub fn gemv_rows(
    level: SimdLevel,
    dtype: WeightDType,
    matrix: &[u8],
    cols: usize,
    x: &[f32],
    rows: Range<usize>,
    y: &mut [f32],
) -> Result<(), KernelError> {
    check_len("x", cols, x.len())?;
    matmul_rows(level, dtype, matrix, cols, x, rows, y)
}

/// As [`gemv_rows`] with 8-bit activations (one quantised row, [`Q8Activations`]): quantised
/// rows run the level's 8-bit decode tile where it has one for the type
/// ([`SimdLevel::has_q8_tile`]: VNNI's, or AVX2's); elsewhere (and for float rows) the f32
/// kernels run on the dequantised activations `d * q`.
pub fn gemv_rows_q8(
    level: SimdLevel,
    dtype: WeightDType,
    matrix: &[u8],
    cols: usize,
    x: &Q8Activations,
    rows: Range<usize>,
    y: &mut [f32],
) -> Result<(), KernelError> {
    matmul_rows_q8(level, dtype, matrix, cols, (x, 1), rows, y)
}

/// [`gemv_rows_q8`] for the first `n_tokens` rows of `x` (`y[t * rows.len() + r]`): up to
/// [`Q8_MAX_TOKENS`] tokens the decode tiles (on VNNI 8 rows of any type but Q6_K two tokens at
/// a time), more the many-token tiles where the type has them, as the cold lane runs an expert.
pub fn matmul_rows_q8(
    level: SimdLevel,
    dtype: WeightDType,
    matrix: &[u8],
    cols: usize,
    (x, n_tokens): (&Q8Activations, usize),
    rows: Range<usize>,
    y: &mut [f32],
) -> Result<(), KernelError> {
    level.ensure_supported()?;
    check_len("x", cols, x.cols())?;
    if x.reserved_values() < n_tokens * cols {
        return Err(KernelError::ShapeMismatch {
            what: "q8 rows x columns",
            expected: n_tokens * cols,
            actual: x.reserved_values(),
        });
    }
    let row_bytes = dtype.row_bytes(cols);
    if cols == 0 || !cols.is_multiple_of(dtype.block_elems()) || !matrix.len().is_multiple_of(row_bytes) {
        return Err(KernelError::ShapeMismatch {
            what: "matrix columns",
            expected: cols,
            actual: matrix.len(),
        });
    }
    check_rows("matrix", &rows, matrix.len() / row_bytes)?;
    check_len("y", rows.len() * n_tokens, y.len())?;
    let x_f32: Vec<Vec<f32>> = (0..n_tokens).map(|t| x.dequantized(t)).collect();
    let (base, first, n_out) = (matrix.as_ptr(), rows.start, rows.len());
    // SAFETY: level checked; rows are in bounds of `matrix`, the tokens of `x_f32` and the q8
    // rows (`cols` values each, `n_tokens` rows checked), sinks of `y`.
    unsafe {
        dot_tiles(
            level,
            dtype,
            cols,
            n_out,
            matrix.len() / row_bytes - first,
            |r| base.add((first + r) * row_bytes),
            n_tokens,
            |t| x_f32[t].as_ptr(),
            Some(x.rows_from(0)),
            |r, t, value| y[t * n_out + r] = value,
        )
    };
    Ok(())
}

/// Gate/up projections fused with the activation for the ff rows `ff_rows` of every token of
/// `x` (`T x hidden`): `h[t * ff + k] = act(gate_k·x_t) * (up_k·x_t)`; other entries of `h`
/// (`T x ff`) are left untouched.
pub fn gate_up_activation(
    level: SimdLevel,
    weights: &ExpertWeights<'_>,
    act: Activation,
    x: &[f32],
    ff_rows: Range<usize>,
    h: &mut [f32],
) -> Result<(), KernelError> {
    level.ensure_supported()?;
    weights.validate()?;
    let (hidden, ff) = (weights.hidden, weights.ff);
    if hidden == 0 || !x.len().is_multiple_of(hidden) {
        return Err(KernelError::ShapeMismatch {
            what: "x (tokens x hidden)",
            expected: hidden,
            actual: x.len(),
        });
    }
    let n_tokens = x.len() / hidden;
    check_rows("gate/up", &ff_rows, ff)?;
    check_len("h (tokens x ff)", n_tokens * ff, h.len())?;
    let x_base = x.as_ptr();
    // SAFETY: level checked, weights validated, x/h lengths checked, h exclusively borrowed.
    unsafe {
        gate_up_unchecked(
            level,
            weights,
            act,
            ff_rows,
            n_tokens,
            |t| x_base.add(t * hidden),
            None,
            h.as_mut_ptr(),
        )
    };
    Ok(())
}

/// Down projection with weighted accumulation for the hidden rows `hidden_rows`:
/// `out[t * hidden + row] += token_weight[t] * (down_row·h_t)` for every token of `h`
/// (`T x ff`); `out` is `T x hidden`.
pub fn down_accumulate(
    level: SimdLevel,
    weights: &ExpertWeights<'_>,
    h: &[f32],
    token_weight: &[f32],
    hidden_rows: Range<usize>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    level.ensure_supported()?;
    weights.validate()?;
    let (hidden, ff) = (weights.hidden, weights.ff);
    let n_tokens = token_weight.len();
    check_len("h (tokens x ff)", n_tokens * ff, h.len())?;
    check_len("out (tokens x hidden)", n_tokens * hidden, out.len())?;
    check_rows("down", &hidden_rows, hidden)?;
    let out_base = out.as_mut_ptr();
    // SAFETY: level checked, weights validated, h/out lengths checked, out exclusively borrowed.
    unsafe {
        down_unchecked(level, weights, hidden_rows, n_tokens, h.as_ptr(), None, None, token_weight, |t| {
            out_base.add(t * hidden)
        })
    };
    Ok(())
}

/// A whole expert on one thread: `out[t] += token_weight[t] * down(act(gate x_t) * up x_t)` for
/// the tokens of `x` (`T x hidden`). Allocates the `T x ff` intermediate; the cold pool does not.
pub fn expert_ffn_accumulate(
    level: SimdLevel,
    weights: &ExpertWeights<'_>,
    act: Activation,
    x: &[f32],
    token_weight: &[f32],
    out: &mut [f32],
) -> Result<(), KernelError> {
    let mut h = vec![0.0f32; token_weight.len() * weights.ff];
    gate_up_activation(level, weights, act, x, 0..weights.ff, &mut h)?;
    down_accumulate(level, weights, &h, token_weight, 0..weights.hidden, out)
}
