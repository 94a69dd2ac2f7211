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
//!
//! Q6_K rows (Q4_K_M files' `ffn_down` in some layers) take the same layout with signed levels
//! `q - 32` and the tokens flipped to unsigned (`x + 128`, so `vpdpbusd` still multiplies u8 by
//! i8): per sub-block of 16 columns (one scale each) 4 `vpdpbusd` per token, the two sub-blocks
//! of an activation block combined as `cvt(dot_a) d sc_a + cvt(dot_b) d sc_b - corr` before one
//! multiply by the token's block scale, where `corr = 128 (d sc_a c_a + d sc_b c_b)` removes the
//! flip (`c` the sub-block's sum of `q - 32`, unpacked with the levels).

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
/// Columns under one Q6_K scale.
const Q6_SUB_COLS: usize = 16;

/// A row block unpacked for the tiles (module docs); grows, never shrinks: 115 KB of levels and
/// 57 KB of scales a thread at 7168 columns (Q6_K: 29 KB of scales and 14 KB of corrections more).
/// Q4_K: `scale` and `min` per sub-block of 32; Q6_K: `scale` (`d sc`) per 16 columns and `min`
/// the flip's correction per 32.
#[derive(Default)]
struct Unpacked {
    /// Whether the block holds Q6_K rows (else Q4_K).
    q6_k: bool,
    levels: Vec<u32>,
    scale: Vec<f32>,
    min: Vec<f32>,
}

thread_local! {
    static UNPACKED: RefCell<Unpacked> = RefCell::new(Unpacked::default());
}

/// Whether these tiles take rows of `dtype`.
pub(crate) fn takes(dtype: WeightDType) -> bool {
    matches!(dtype, WeightDType::Q4_K | WeightDType::Q6_K)
}

/// 64 bytes at `at` of each listed row (zeros for the missing lanes), transposed: dword d of
/// lane r is bytes `4d..4d + 4` of row r.
///
/// # Safety
/// The CPU has AVX-512F; each row of `rows` holds 64 readable bytes at `at`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load_transposed(rows: &[*const u8], at: usize) -> [__m512i; 16] {
    transpose16(std::array::from_fn(|r| match rows.get(r) {
        // SAFETY: the caller's contract.
        Some(&row) => unsafe { _mm512_loadu_si512(row.add(at) as *const _) },
        None => _mm512_setzero_si512(),
    }))
}

/// Rows `rows` (at most [`GEMM_ROWS`]) of `cols` Q6_K values into `u`, a 256-column block at a
/// time (its bytes are read once, by 16 loads in flight): `d sc` per 16 columns per row; the
/// levels `q - 32` as signed bytes in the Q4_K layout (group `c / 4` of column c); per 32
/// columns the correction of the tokens' flip. Value l of quarter qr of half h: low bits from
/// `ql[64h + l + 32 (qr & 1)]` (low nibble for qr < 2), high bits from `qh[32h + l] >> 2qr`.
///
/// # Safety
/// The CPU has AVX-512 VNNI; each pointer of `rows` addresses `cols / 256` whole Q6_K blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn unpack_q6(rows: &[*const u8], cols: usize, u: &mut Unpacked) {
    u.q6_k = true;
    u.levels.resize(cols / 4 * GEMM_ROWS, 0);
    u.scale.resize(cols / Q6_SUB_COLS * GEMM_ROWS, 0.0);
    u.min.resize(cols / SUB_COLS * GEMM_ROWS, 0.0);
    let bytes = WeightDType::Q6_K.block_bytes();
    for blk in 0..cols / 256 {
        // SAFETY: block `blk` of every listed row is whole (the caller's contract).
        unsafe {
            unpack_q6_levels(rows, blk * bytes, 256 * blk, u);
            unpack_q6_scales(rows, blk * bytes, 16 * blk, u);
        }
        for k in 8 * blk..8 * blk + 8 {
            // SAFETY: activation block k's groups, scales and correction lie in `u`.
            unsafe { q6_correction(u, k) };
        }
    }
}

/// The levels of the Q6_K block at byte `at` of each listed row, columns `col0..col0 + 256`.
///
/// # Safety
/// As [`unpack_q6`]; `u.levels` holds the block's groups.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn unpack_q6_levels(rows: &[*const u8], at: usize, col0: usize, u: &mut Unpacked) {
    let (low4, low2, bias) = (_mm512_set1_epi8(15), _mm512_set1_epi8(3), _mm512_set1_epi8(32));
    let level = |nibbles: __m512i, high: __m512i, shift: u32| {
        let h = _mm512_and_si512(_mm512_srlv_epi32(high, _mm512_set1_epi32(shift as i32)), low2);
        _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(nibbles, low4), _mm512_slli_epi32::<4>(h)), bias)
    };
    // SAFETY: the 64 qh bytes at 128 and each half's 64 ql bytes lie in every listed row's block.
    let qh = unsafe { load_transposed(rows, at + 128) };
    for half in 0..2 {
        let ql = unsafe { load_transposed(rows, at + 64 * half) };
        for (d, &v) in ql.iter().enumerate() {
            // dword d: ql bytes 4d..; d < 8: columns l (low nibbles) and 64 + l (high), d >= 8:
            // 32 + l and 96 + l, l = 4 (d % 8); their high bits in qh dword 8 half + d % 8
            let (z, shift) = (qh[8 * half + d % 8], if d < 8 { 0 } else { 2 });
            let col = col0 + 128 * half + 4 * (d % 8) + 32 * (d / 8);
            let lo = level(v, z, shift);
            let hi = level(_mm512_srli_epi32::<4>(v), z, shift + 4);
            // SAFETY: groups col / 4 and col / 4 + 16 lie in `u.levels`.
            unsafe {
                let dst = u.levels.as_mut_ptr();
                _mm512_storeu_si512(dst.add(col / 4 * GEMM_ROWS) as *mut _, lo);
                _mm512_storeu_si512(dst.add((col / 4 + 16) * GEMM_ROWS) as *mut _, hi);
            }
        }
    }
}

/// `d sc` of the Q6_K block at byte `at` of each listed row (zeros for the missing lanes) into
/// sub-blocks `j0..j0 + 16` of `u.scale`: a row's 16 scales as one vector, then transposed.
///
/// # Safety
/// As [`unpack_q6`]; `u.scale` holds the 16 sub-blocks.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn unpack_q6_scales(rows: &[*const u8], at: usize, j0: usize, u: &mut Unpacked) {
    let bytes = WeightDType::Q6_K.block_bytes();
    let per_row = std::array::from_fn(|r| match rows.get(r) {
        Some(&row) => {
            // SAFETY: the block's bytes are whole (the caller's contract).
            let block = unsafe { std::slice::from_raw_parts(row.add(at), bytes) };
            let sc = unsafe { _mm_loadu_si128(block[192..208].as_ptr() as *const _) };
            let v = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)),
                _mm512_set1_ps(half_at(block, 208)),
            );
            _mm512_castps_si512(v)
        }
        None => _mm512_setzero_si512(),
    });
    for (j, v) in transpose16(per_row).into_iter().enumerate() {
        // SAFETY: sub-block j0 + j's 16 lanes lie in `u.scale`.
        unsafe { _mm512_storeu_si512(u.scale.as_mut_ptr().add((j0 + j) * GEMM_ROWS) as *mut _, v) };
    }
}

/// The flip's correction of activation block k, `128 (d sc_a c_a + d sc_b c_b)` per row, from
/// its two sub-blocks' levels and scales.
///
/// # Safety
/// The CPU has AVX-512 VNNI; `u` holds block k's groups and scales, and its `min` lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q6_correction(u: &mut Unpacked, k: usize) {
    let ones = _mm512_set1_epi8(1);
    let mut corr = _mm512_setzero_ps();
    for j in [2 * k, 2 * k + 1] {
        let mut sum = _mm512_setzero_si512();
        for g in 0..4 {
            // SAFETY: group 4j + g lies in `u.levels`.
            let w = unsafe { _mm512_loadu_si512(u.levels.as_ptr().add((4 * j + g) * GEMM_ROWS) as *const _) };
            sum = _mm512_dpbusd_epi32(sum, ones, w);
        }
        // SAFETY: sub-block j's 16 lanes lie in `u.scale`.
        let scale = unsafe { _mm512_loadu_ps(u.scale.as_ptr().add(j * GEMM_ROWS)) };
        corr = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sum), corr);
    }
    // SAFETY: block k's 16 lanes lie in `u.min`.
    unsafe {
        _mm512_storeu_ps(u.min.as_mut_ptr().add(k * GEMM_ROWS), _mm512_mul_ps(corr, _mm512_set1_ps(128.0)))
    };
}

/// Rows `rows` (at most [`GEMM_ROWS`]; the rest of the lanes zero) of `cols` Q4_K values into
/// `u`: the scales per row, the levels 64 bytes of 16 rows at a time through a 16 x 16 dword
/// transpose (a lane per row), each dword holding four columns' nibbles of two sub-blocks.
///
/// # Safety
/// The CPU has AVX-512F; each pointer of `rows` addresses `cols / 256` whole Q4_K blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn unpack(rows: &[*const u8], cols: usize, u: &mut Unpacked) {
    u.q6_k = false;
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
            let t = unsafe { load_transposed(rows, blk * bytes + 16 + 64 * q) };
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

/// [`tile`] over a Q6_K block (module docs): tokens flipped to unsigned per broadcast.
// SAFETY (callers): as `tile`, `u` unpacked by `unpack_q6` with `blocks` activation blocks.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile_q6<const T: usize>(
    u: &Unpacked,
    blocks: usize,
    xs: &[Q8Row; T],
    out: &mut [[f32; GEMM_ROWS]; T],
) {
    let mut acc = [_mm512_setzero_ps(); T];
    for k in 0..blocks {
        let mut part = [_mm512_setzero_ps(); T];
        for j in [2 * k, 2 * k + 1] {
            let mut dot = [_mm512_setzero_si512(); T];
            for i in 0..Q6_SUB_COLS / 4 {
                // SAFETY: group 4j + i of 16 lanes lies in `u.levels`; the token's four values
                // at column 16j + 4i lie in its row.
                unsafe {
                    let w = _mm512_loadu_si512(u.levels.as_ptr().add((4 * j + i) * GEMM_ROWS) as *const _);
                    for t in 0..T {
                        let x = (xs[t].qs.add(Q6_SUB_COLS * j + 4 * i) as *const i32).read_unaligned();
                        let flipped = _mm512_set1_epi32(x ^ 0x8080_8080_u32 as i32);
                        dot[t] = _mm512_dpbusd_epi32(dot[t], flipped, w);
                    }
                }
            }
            // SAFETY: sub-block j's 16 lanes lie in `u.scale`.
            let s = unsafe { _mm512_loadu_ps(u.scale.as_ptr().add(j * GEMM_ROWS)) };
            for t in 0..T {
                part[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]), s, part[t]);
            }
        }
        // SAFETY: block k's 16 lanes lie in `u.min`; the tokens' block k scale in their rows.
        unsafe {
            let corr = _mm512_loadu_ps(u.min.as_ptr().add(k * GEMM_ROWS));
            for t in 0..T {
                acc[t] =
                    _mm512_fmadd_ps(_mm512_sub_ps(part[t], corr), _mm512_set1_ps(*xs[t].d.add(k)), acc[t]);
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
            unsafe {
                match u.q6_k {
                    true => tile_q6::<$t>(u, subs, &xs, o),
                    false => tile::<$t>(u, subs, &xs, o),
                }
            }
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

/// `dot(row r, x t)` of rows `0..n_rows` of `dtype` (one [`takes`] names) and the 8-bit tokens
/// `0..n_tokens` of `q8`, each handed to `sink(r, t, value)`; for a fixed token, rows arrive in
/// increasing order.
///
/// # Safety
/// The CPU has AVX-512 VNNI; `cols % 256 == 0`; `row_ptr(r)` addresses `cols` values of `dtype`
/// for every `r < n_rows`; each `q8.row(t)`, `t < n_tokens`, holds `cols` quantised values with
/// their scales and sums.
pub(crate) unsafe fn rows_times_tokens(
    dtype: WeightDType,
    cols: usize,
    n_rows: usize,
    row_ptr: impl Fn(usize) -> *const u8,
    n_tokens: usize,
    q8: Q8Rows<'_>,
    mut sink: impl FnMut(usize, usize, f32),
) {
    UNPACKED.with(|u| {
        let mut u = u.borrow_mut();
        let mut row0 = 0;
        while row0 < n_rows {
            let block_rows = GEMM_ROWS.min(n_rows - row0);
            let rows: [*const u8; GEMM_ROWS] = std::array::from_fn(|r| row_ptr(row0 + r.min(block_rows - 1)));
            // SAFETY: the rows hold whole blocks of `dtype` (the caller's contract).
            unsafe {
                match dtype {
                    WeightDType::Q6_K => unpack_q6(&rows[..block_rows], cols, &mut u),
                    _ => unpack(&rows[..block_rows], cols, &mut u),
                }
            };
            // the next block's rows into L2 while this one's tiles run (the unpack reads them
            // next; it was where the weights' memory latency landed)
            let row_bytes = dtype.row_bytes(cols);
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
                // this block unpacked for `dtype`.
                unsafe { token_tile(&u, cols / SUB_COLS, &q8, t0, n, block_rows, &mut block_sink) };
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
        for dtype in [WeightDType::Q4_K, WeightDType::Q6_K] {
            check_tiles(dtype);
        }
    }

    /// Random blocks of `dtype` with small f16 scales (d and dmin for Q4_K, d for Q6_K; the
    /// 8-bit scales random).
    fn random_rows(dtype: WeightDType, rows: usize, cols: usize) -> Vec<u8> {
        let mut bytes = crate::test_random_bytes(rows * dtype.row_bytes(cols));
        for (i, block) in bytes.chunks_exact_mut(dtype.block_bytes()).enumerate() {
            let d = half::f16::from_f32(0.001 + (i % 7) as f32 * 3e-4).to_bits().to_le_bytes();
            let dmin = half::f16::from_f32(0.002 - (i % 5) as f32 * 2e-4).to_bits().to_le_bytes();
            match dtype {
                WeightDType::Q6_K => block[208..210].copy_from_slice(&d),
                _ => {
                    block[0..2].copy_from_slice(&d);
                    block[2..4].copy_from_slice(&dmin);
                }
            }
        }
        bytes
    }

    fn check_tiles(dtype: WeightDType) {
        let (rows, cols, n_tokens) = (37usize, 512usize, 19usize);
        let bytes = random_rows(dtype, rows, cols);
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
                    dtype,
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
                        "{dtype:?}, {n} tokens: row {r} token {t}: {} vs {want}",
                        got[r * n + t]
                    );
                }
            }
        }
    }
}
