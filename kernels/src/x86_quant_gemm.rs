//! AVX-512 VNNI tiles of Q4_K rows for many tokens (prefill) with 8-bit activations
//! ([`crate::q8`]): 16 rows in the 16 lanes of a register, so one `vpdpbusd` takes four columns
//! of all 16 rows against four int8 values of one token (broadcast), and each row's K-quant scale
//! and min are lane vectors. The one-token VNNI tile (`x86_quant_vnni.rs`) keeps a row's columns
//! in the lanes, so it unpacks the nibbles and decodes the scales again for every token, and
//! an expert of 32 prefill tokens ran no faster on it than on rows dequantised to f32.
//!
//! Each block of up to [`GEMM_ROWS`] rows is unpacked once per call into a per-thread buffer:
//! the levels (u8, 0..16) as `[cols / 4][16 rows]` dwords, and per sub-block of 32 columns the
//! rows' `d sc_j` and `dmin m_j` as 16-lane vectors (missing rows zero). Then for each tile of
//! up to [`GEMM_TOKENS`] tokens, per sub-block: 8 `vpdpbusd` per token into i32 lanes, then
//! `acc += cvt(dot) * (d sc_j * d_x,j) - dmin m_j * sum_x,j` in f32. The result differs from the
//! exact dot of the dequantised weights with f32 `x` by the activation rounding (bound in
//! [`crate::q8`]) and f32 rounding, as the one-token VNNI tile's does.

use std::arch::x86_64::*;
use std::cell::RefCell;

use crate::q8::{Q8Row, Q8Rows};
use crate::quant::{half_at, scale_min};
use crate::weights::WeightDType;

/// Rows of a tile: the lanes of one register of i32 / f32.
pub(crate) const GEMM_ROWS: usize = 16;
/// Tokens of a tile: two accumulators each (i32 for a sub-block, f32 for the row), 16 of the 32
/// registers.
const GEMM_TOKENS: usize = 8;
/// Columns of a K-quant sub-block (one scale and min each), and of an activation block.
const SUB_COLS: usize = 32;

/// A row block unpacked for the tiles (module docs); grows, never shrinks: 115 KB of levels and
/// 57 KB of scales a thread at 7168 columns.
#[derive(Default)]
struct Unpacked {
    levels: Vec<u32>,
    scale: Vec<f32>,
    min: Vec<f32>,
}

thread_local! {
    static UNPACKED: RefCell<Unpacked> = RefCell::new(Unpacked::default());
}

/// Whether these tiles take rows of `dtype`.
pub(crate) fn takes(dtype: WeightDType) -> bool {
    dtype == WeightDType::Q4_K
}

/// Rows `rows` (at most [`GEMM_ROWS`]; the rest of the lanes zero) of `cols` Q4_K values into
/// `u`: the scales per row, the levels 64 bytes of 16 rows at a time through a 16 x 16 dword
/// transpose (a lane per row), each dword holding four columns' nibbles of two sub-blocks.
///
/// # Safety
/// The CPU has AVX-512F; each pointer of `rows` addresses `cols / 256` whole Q4_K blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn unpack(rows: &[*const u8], cols: usize, u: &mut Unpacked) {
    let (groups, subs) = (cols / 4, cols / SUB_COLS);
    u.levels.resize(groups * GEMM_ROWS, 0);
    u.scale.resize(subs * GEMM_ROWS, 0.0);
    u.min.resize(subs * GEMM_ROWS, 0.0);
    let bytes = WeightDType::Q4_K.block_bytes();
    for r in 0..GEMM_ROWS {
        let (scale, min) = (&mut u.scale, &mut u.min);
        let lanes = (0..subs).map(|j| j * GEMM_ROWS + r);
        let Some(&row) = rows.get(r) else {
            lanes.for_each(|at| (scale[at], min[at]) = (0.0, 0.0));
            continue;
        };
        // SAFETY: the row's `cols / 256` blocks are whole (the caller's contract).
        let row = unsafe { std::slice::from_raw_parts(row, cols / 256 * bytes) };
        for (j, at) in lanes.enumerate() {
            let block = &row[j / 8 * bytes..][..bytes];
            let (sc, m) = scale_min(j % 8, &block[4..16]);
            (scale[at], min[at]) = (half_at(block, 0) * sc, half_at(block, 2) * m);
        }
    }
    let low4 = _mm512_set1_epi8(15);
    for blk in 0..cols / 256 {
        for q in 0..2 {
            // SAFETY: the 64 nibble bytes at 16 + 64q of each listed row's block `blk`.
            let t = transpose16(std::array::from_fn(|r| match rows.get(r) {
                Some(&row) => unsafe { _mm512_loadu_si512(row.add(blk * bytes + 16 + 64 * q) as *const _) },
                None => _mm512_setzero_si512(),
            }));
            // dword d: chunk 2q + d / 8 (32 bytes: its low nibbles sub-block 2k, its high ones 2k + 1)
            for (d, &v) in t.iter().enumerate() {
                let (k, i) = (2 * q + d / 8, d % 8);
                let lo = 64 * blk + 8 * (2 * k) + i;
                let hi = lo + 8;
                // SAFETY: groups `lo` and `hi` lie in `u.levels` (cols / 4 groups of 16 lanes).
                unsafe {
                    let dst = u.levels.as_mut_ptr();
                    _mm512_storeu_si512(dst.add(lo * GEMM_ROWS) as *mut _, _mm512_and_si512(v, low4));
                    let h = _mm512_and_si512(_mm512_srli_epi32::<4>(v), low4);
                    _mm512_storeu_si512(dst.add(hi * GEMM_ROWS) as *mut _, h);
                }
            }
        }
    }
}

/// `out[d]` lane r = `rows[r]` lane d (16 x 16 dwords): pairs of dwords, then of qwords, within
/// each 128-bit lane, then a 4 x 4 transpose of the 128-bit lanes.
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
    let a: [__m512i; 16] = std::array::from_fn(|n| match n % 2 {
        0 => _mm512_unpacklo_epi32(r[n], r[n + 1]),
        _ => _mm512_unpackhi_epi32(r[n - 1], r[n]),
    });
    // b[4i + k], 128-bit lane L: dword 4L + k of rows 4i..4i + 4
    let b: [__m512i; 16] = std::array::from_fn(|n| {
        let (i, k) = (n / 4, n % 4);
        let (x, y) = (a[4 * i + k / 2], a[4 * i + 2 + k / 2]);
        match k % 2 {
            0 => _mm512_unpacklo_epi64(x, y),
            _ => _mm512_unpackhi_epi64(x, y),
        }
    });
    let mut out = [_mm512_setzero_si512(); 16];
    for k in 0..4 {
        let c0 = _mm512_shuffle_i32x4::<0x44>(b[k], b[4 + k]);
        let c1 = _mm512_shuffle_i32x4::<0xEE>(b[k], b[4 + k]);
        let c2 = _mm512_shuffle_i32x4::<0x44>(b[8 + k], b[12 + k]);
        let c3 = _mm512_shuffle_i32x4::<0xEE>(b[8 + k], b[12 + k]);
        out[k] = _mm512_shuffle_i32x4::<0x88>(c0, c2);
        out[4 + k] = _mm512_shuffle_i32x4::<0xDD>(c0, c2);
        out[8 + k] = _mm512_shuffle_i32x4::<0x88>(c1, c3);
        out[12 + k] = _mm512_shuffle_i32x4::<0xDD>(c1, c3);
    }
    out
}

/// `T` tokens (`xs`) against the unpacked block: lane r of `out[t]` is row r's dot with token t.
// SAFETY (callers): the CPU has the features named below (the caller checked the SIMD level);
// `xs` rows hold `subs * 32` values with their per-block scales and sums; `u` holds `subs`
// sub-blocks.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile<const T: usize>(u: &Unpacked, subs: usize, xs: &[Q8Row; T], out: &mut [[f32; GEMM_ROWS]; T]) {
    let mut acc = [_mm512_setzero_ps(); T];
    for j in 0..subs {
        let mut dot = [_mm512_setzero_si512(); T];
        for i in 0..SUB_COLS / 4 {
            // SAFETY: group 8j + i of 16 lanes lies in `u.levels` (subs sub-blocks); the
            // token's four values at column 32j + 4i lie in its row.
            unsafe {
                let w = _mm512_loadu_si512(u.levels.as_ptr().add((8 * j + i) * GEMM_ROWS) as *const _);
                for t in 0..T {
                    let x = (xs[t].qs.add(SUB_COLS * j + 4 * i) as *const i32).read_unaligned();
                    dot[t] = _mm512_dpbusd_epi32(dot[t], w, _mm512_set1_epi32(x));
                }
            }
        }
        // SAFETY: sub-block j's 16 lanes lie in `u.scale` / `u.min`; the tokens' block j scale
        // and sum lie in their rows.
        unsafe {
            let s = _mm512_loadu_ps(u.scale.as_ptr().add(j * GEMM_ROWS));
            let m = _mm512_loadu_ps(u.min.as_ptr().add(j * GEMM_ROWS));
            for t in 0..T {
                let f = _mm512_mul_ps(s, _mm512_set1_ps(*xs[t].d.add(j)));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]), f, acc[t]);
                acc[t] = _mm512_fnmadd_ps(m, _mm512_set1_ps(*xs[t].sum.add(j)), acc[t]);
            }
        }
    }
    for t in 0..T {
        // SAFETY: `out[t]` holds 16 f32.
        unsafe { _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]) };
    }
}

/// Tokens `t0..t0 + n` (n <= [`GEMM_TOKENS`]) of `q8` against the unpacked block; `sink(r, t, v)`
/// for its `n_rows` rows.
///
/// # Safety
/// As [`tile`]; the level has AVX-512 VNNI.
unsafe fn token_tile(
    u: &Unpacked,
    subs: usize,
    q8: &Q8Rows<'_>,
    t0: usize,
    n: usize,
    n_rows: usize,
    sink: &mut impl FnMut(usize, usize, f32),
) {
    let mut out = [[0.0f32; GEMM_ROWS]; GEMM_TOKENS];
    macro_rules! run {
        ($t:literal) => {{
            let xs: [Q8Row; $t] = std::array::from_fn(|i| q8.row(t0 + i));
            let o: &mut [[f32; GEMM_ROWS]; $t] = (&mut out[..$t]).try_into().expect("a tile of tokens");
            // SAFETY: forwarded contract.
            unsafe { tile::<$t>(u, subs, &xs, o) }
        }};
    }
    match n {
        1 => run!(1),
        2 => run!(2),
        3 => run!(3),
        4 => run!(4),
        5 => run!(5),
        6 => run!(6),
        7 => run!(7),
        _ => run!(8),
    }
    for (i, o) in out[..n].iter().enumerate() {
        for (r, &v) in o[..n_rows].iter().enumerate() {
            sink(r, t0 + i, v);
        }
    }
}

/// `dot(row r, x t)` of Q4_K rows `0..n_rows` and the 8-bit tokens `0..n_tokens` of `q8`, each
/// handed to `sink(r, t, value)`; for a fixed token, rows arrive in increasing order.
///
/// # Safety
/// The CPU has AVX-512 VNNI; `cols % 256 == 0`; `row_ptr(r)` addresses `cols` Q4_K values for
/// every `r < n_rows`; each `q8.row(t)`, `t < n_tokens`, holds `cols` quantised values with
/// their scales and sums.
pub(crate) unsafe fn rows_times_tokens(
    cols: usize,
    n_rows: usize,
    row_ptr: impl Fn(usize) -> *const u8,
    n_tokens: usize,
    q8: Q8Rows<'_>,
    mut sink: impl FnMut(usize, usize, f32),
) {
    let subs = cols / SUB_COLS;
    UNPACKED.with(|u| {
        let mut u = u.borrow_mut();
        let mut row0 = 0;
        while row0 < n_rows {
            let block_rows = GEMM_ROWS.min(n_rows - row0);
            let rows: [*const u8; GEMM_ROWS] = std::array::from_fn(|r| row_ptr(row0 + r.min(block_rows - 1)));
            // SAFETY: the rows hold whole blocks (the caller's contract).
            unsafe { unpack(&rows[..block_rows], cols, &mut u) };
            // the next block's rows into L2 while this one's tiles run (the unpack reads them
            // next; it was where the weights' memory latency landed)
            let row_bytes = WeightDType::Q4_K.row_bytes(cols);
            for r in row0 + block_rows..n_rows.min(row0 + block_rows + GEMM_ROWS) {
                let row = row_ptr(r);
                for at in (0..row_bytes).step_by(64) {
                    // SAFETY: a prefetch of a byte inside row r (rows below n_rows exist).
                    unsafe { _mm_prefetch::<_MM_HINT_T1>(row.add(at) as *const i8) };
                }
            }
            let mut block_sink = |r: usize, t: usize, v: f32| sink(row0 + r, t, v);
            for t0 in (0..n_tokens).step_by(GEMM_TOKENS) {
                let n = GEMM_TOKENS.min(n_tokens - t0);
                // SAFETY: the level and the tokens' rows are the caller's contract; `u` holds
                // this block's `subs` sub-blocks.
                unsafe { token_tile(&u, subs, &q8, t0, n, block_rows, &mut block_sink) };
            }
            row0 += block_rows;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::q8::{Q8Activations, Q8RowIds};

    /// Against the dequantised rows dotted with the dequantised 8-bit tokens in f64 (the same
    /// inputs, so only f32 rounding differs): partial row blocks and token tiles, 1..=19 tokens.
    #[test]
    fn tiles_match_the_dequantised_rows_and_tokens() {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vnni")) {
            return;
        }
        let (rows, cols, n_tokens) = (37usize, 512usize, 19usize);
        let dtype = WeightDType::Q4_K;
        let mut bytes = crate::test_random_bytes(rows * dtype.row_bytes(cols));
        for (i, block) in bytes.chunks_exact_mut(dtype.block_bytes()).enumerate() {
            let d = half::f16::from_f32(0.001 + (i % 7) as f32 * 3e-4).to_bits().to_le_bytes();
            let dmin = half::f16::from_f32(0.002 - (i % 5) as f32 * 2e-4).to_bits().to_le_bytes();
            block[0..2].copy_from_slice(&d);
            block[2..4].copy_from_slice(&dmin);
        }
        let mut w = vec![0.0f32; rows * cols];
        dtype.decode_row(&bytes, &mut w);
        let x: Vec<f32> = (0..n_tokens * cols).map(|i| ((i as f32) * 0.37).sin() * 2.0 + 0.1).collect();
        let mut q = Q8Activations::new();
        q.reserve_rows(n_tokens, cols).unwrap();
        for t in 0..n_tokens {
            q.quantize_row(t, &x[t * cols..][..cols]);
        }
        let base = q.raw_mut();
        let rows8 = Q8Rows {
            base: (base.0.cast_const(), base.1.cast_const(), base.2.cast_const()),
            cols,
            ids: Q8RowIds::From(0),
        };
        let xq: Vec<Vec<f64>> = (0..n_tokens)
            .map(|t| {
                let r = rows8.row(t);
                // SAFETY: row t holds `cols` values and `cols / 32` scales.
                (0..cols).map(|c| unsafe { f64::from(*r.qs.add(c)) * f64::from(*r.d.add(c / 32)) }).collect()
            })
            .collect();
        for n in [1usize, 5, 8, 13, 19] {
            let mut got = vec![f32::NAN; rows * n];
            let mut last = vec![None; n];
            let row_bytes = dtype.row_bytes(cols);
            // SAFETY: VNNI checked; rows of whole blocks; n quantised tokens of `cols`.
            unsafe {
                rows_times_tokens(
                    cols,
                    rows,
                    |r| bytes.as_ptr().add(r * row_bytes),
                    n,
                    rows8,
                    |r, t, v| {
                        assert!(last[t].is_none_or(|l| l < r), "rows of token {t} out of order");
                        last[t] = Some(r);
                        got[r * n + t] = v;
                    },
                )
            };
            for r in 0..rows {
                for t in 0..n {
                    let want: f64 = (0..cols).map(|c| f64::from(w[r * cols + c]) * xq[t][c]).sum();
                    let scale: f64 = (0..cols).map(|c| (f64::from(w[r * cols + c]) * xq[t][c]).abs()).sum();
                    let err = (f64::from(got[r * n + t]) - want).abs();
                    assert!(
                        err <= 1e-5 * scale + 1e-6,
                        "{n} tokens: row {r} token {t}: {} vs {want}",
                        got[r * n + t]
                    );
                }
            }
        }
    }
}
