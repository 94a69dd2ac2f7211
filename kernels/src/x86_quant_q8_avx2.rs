//! AVX2 fused one-token decode tiles with 8-bit activations ([`crate::q8`]) for CPUs without
//! AVX-512 VNNI (AVX2-only desktops, AVX-512 without VNNI): Q4_0, Q4_K, Q5_K and Q6_K, the types
//! of llama.cpp's Q4_0, Q4_K_M and Q5_K_M files. The raw weight levels (u8: 0..16, 0..32, 0..64,
//! Q5_K's fifth bit added as 16 to its nibble) are multiplied
//! with the int8 activations by `vpmaddubsw` (u8 x i8, adjacent pairs summed into i16: at most
//! 2 x 63 x 127 = 16002, inside i16) and the pairs summed into i32 by `vpmaddwd` against ones, or
//! against Q6_K's i8 sub-block scales widened to i16 (its 16-value groups weighted in the same
//! instruction). Offsets and mins are folded per activation block: Q4_0's 8 and Q6_K's 32 against
//! integer sums of the activations (per 32, or per 16 columns, prepared once per block for the
//! tile's rows), the K-quants' mins against the activations' `d * sum`. The scales go on once per
//! (sub-)block in f32. On the build machine's Zen 4 forced to AVX2, a Q4_K_M token of a 4-layer
//! Qwen3-30B-A3B-shaped file decoded at 0.47x llama.cpp's AVX2 build with the f32 tiles these
//! replace for those types (benches/RESULTS.md, session 35).
//!
//! The integer dots are exact, so a row's result differs from the exact dot of the dequantised
//! weights with the rounded activations by f32 rounding only, and from the f32 tiles by the
//! activation rounding (bound in [`crate::q8`]), as the VNNI tiles' do.

use std::arch::x86_64::*;

use crate::q8::Q8Row;
use crate::weights::WeightDType;

use super::avx2::load_x;
// every type code: the shared `dispatch_decode_tile!` names them all (`takes` gates them first)
use super::{prefetch_rows_through, tile_rows, IQ4_NL, MXFP4, Q4_0, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0};

/// Whether the level's one-token 8-bit tiles here take `dtype`.
pub(crate) fn takes(dtype: WeightDType) -> bool {
    matches!(dtype, WeightDType::Q4_0 | WeightDType::Q4_K | WeightDType::Q5_K | WeightDType::Q6_K)
}

/// 32 u8 levels times 32 i8 activations, summed per four columns (8 i32 lanes; lanes 0..4 the
/// first 16 columns).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot4(levels: __m256i, x: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(levels, x), _mm256_set1_epi16(1))
}

/// 32 int8 activations of block `j` of the row.
// SAFETY (callers): the CPU has the features named below (the caller checked the SIMD level)
// and the pointers cover the block, lanes or rows this function reads and writes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn x_block(x: Q8Row, j: usize) -> __m256i {
    // SAFETY: the caller vouches that block j of the row (32 values) is there.
    unsafe { _mm256_loadu_si256(x.qs.add(32 * j) as *const __m256i) }
}

/// The f16 at `p`, widened.
// SAFETY (callers): as `x_block`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn half(p: *const u8) -> f32 {
    // SAFETY: the caller vouches for two readable bytes at `p`.
    let bits = unsafe { (p as *const u16).read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// Lane `j` of `v` in every lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn splat_lane(v: __m256, j: usize) -> __m256 {
    _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(j as i32))
}

/// What a block's rows share of its activations: Q4_0 `8 * Σq` per four columns of the block
/// (`off`); Q6_K the sums of `q` per 16 columns (`sums16`, 16 i16 lanes in column order).
#[derive(Clone, Copy)]
struct XBlock {
    off: __m256i,
    sums16: __m256i,
}

/// The shared part of block `blk` (of the type's size) of the row `x`.
// SAFETY (callers): as `x_block`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn prepare<const Q: u8>(x: Q8Row, blk: usize) -> XBlock {
    let zero = _mm256_setzero_si256();
    // SAFETY: block blk's 32 (Q4_0) or 256 (Q6_K) values lie inside the row.
    unsafe {
        match Q {
            Q4_0 => XBlock { off: dot4(_mm256_set1_epi8(8), x_block(x, blk)), sums16: zero },
            Q6_K => {
                let mut sums = [0i16; 16];
                for j in 0..8 {
                    let fours = dot4(_mm256_set1_epi8(1), x_block(x, 8 * blk + j));
                    let h = _mm256_hadd_epi32(fours, fours);
                    let h = _mm256_hadd_epi32(h, h);
                    sums[2 * j] = _mm256_extract_epi32::<0>(h) as i16;
                    sums[2 * j + 1] = _mm256_extract_epi32::<4>(h) as i16;
                }
                XBlock { off: zero, sums16: _mm256_loadu_si256(sums.as_ptr() as *const __m256i) }
            }
            _ => XBlock { off: zero, sums16: zero },
        }
    }
}

/// Q4_0 block at `b` (activation block `blk`): `acc += d d_x (Σ q x - 8 Σ x)` per four columns.
// SAFETY (callers): as `x_block`, one 18-byte block at `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0(b: *const u8, x: Q8Row, blk: usize, xb: &XBlock, acc: &mut __m256) {
    // SAFETY: the block's 18 bytes and the activation block's 32 values and scale.
    unsafe {
        let raw = _mm_loadu_si128(b.add(2) as *const __m128i);
        let low4 = _mm_set1_epi8(15);
        let levels =
            _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(raw), low4), _mm_and_si128(raw, low4));
        let dot = _mm256_sub_epi32(dot4(levels, x_block(x, blk)), xb.off);
        let scale = _mm256_set1_ps(half(b) * *x.d.add(blk));
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, *acc);
    }
}

/// Q4_K (`FIFTH` false) or Q5_K block at `b` (activation blocks `8 blk..8 blk + 8`, one per
/// sub-block): per sub-block `d sc_j d_x,j Σ q x`, less `dmin Σ_j m_j (d_x,j Σ x)` once per
/// block; Q5_K's fifth bits (bit `j` of `qh[l]` for sub-block `j`) add 16 to the nibbles.
// SAFETY (callers): as `x_block`, one 144-byte (176-byte) block at `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k_asym<const FIFTH: bool>(b: *const u8, x: Q8Row, blk: usize, acc: &mut __m256) {
    // SAFETY: the block's 144 (176) bytes, the 8 activation blocks' values, scales and sums.
    unsafe {
        let (sc, m) = crate::x86_quant::k_scales_mins(&*(b.add(4) as *const [u8; 12]));
        let widen = |v: &[u8; 8]| {
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(v.as_ptr() as *const __m128i)))
        };
        let coef =
            _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(half(b)), widen(&sc)), load_x(x.d.add(8 * blk)));
        let mins = _mm256_mul_ps(widen(&m), load_x(x.sum.add(8 * blk)));
        *acc = _mm256_fnmadd_ps(_mm256_set1_ps(half(b.add(2))), mins, *acc);
        let (low4, sixteen) = (_mm256_set1_epi8(15), _mm256_set1_epi8(16));
        let qs = b.add(if FIFTH { 48 } else { 16 });
        for p in 0..4 {
            let raw = _mm256_loadu_si256(qs.add(32 * p) as *const __m256i);
            let mut lo = _mm256_and_si256(raw, low4);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low4);
            let (jlo, jhi) = (2 * p, 2 * p + 1);
            if FIFTH {
                let qh = _mm256_loadu_si256(b.add(16) as *const __m256i);
                let fifth = |j: usize| {
                    let bit = _mm256_set1_epi8((1u8 << j) as i8);
                    _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), sixteen)
                };
                lo = _mm256_or_si256(lo, fifth(jlo));
                hi = _mm256_or_si256(hi, fifth(jhi));
            }
            let dlo = dot4(lo, x_block(x, 8 * blk + jlo));
            let dhi = dot4(hi, x_block(x, 8 * blk + jhi));
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dlo), splat_lane(coef, jlo), *acc);
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dhi), splat_lane(coef, jhi), *acc);
        }
    }
}

/// Q6_K block at `b` (activation blocks `8 blk..8 blk + 8`): per 32 columns `Σ sc_g Σ q x` (the
/// two 16-column groups weighted by `vpmaddwd`) times `d d_x`, less `32 d d_x Σ sc_g Σ x` for the
/// block's offset, from the shared sums per 16 columns.
// SAFETY (callers): as `x_block`, one 210-byte block at `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k(b: *const u8, x: Q8Row, blk: usize, xb: &XBlock, acc: &mut __m256) {
    // SAFETY: the block's 210 bytes, the 8 activation blocks' values and scales.
    unsafe {
        let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(192) as *const __m128i));
        let coef = _mm256_mul_ps(_mm256_set1_ps(half(b.add(208))), load_x(x.d.add(8 * blk)));
        // the offset: 32 d Σ_j d_x,j Σ_(g in j) sc_g Σx_g
        let offset = _mm256_cvtepi32_ps(_mm256_madd_epi16(sc16, xb.sums16));
        *acc = _mm256_fnmadd_ps(offset, _mm256_mul_ps(coef, _mm256_set1_ps(32.0)), *acc);
        // [sc_a x 8 | sc_b x 8] from the pair (sc_a, sc_b) in one i32 lane
        let spread = _mm256_setr_epi8(
            0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3,
        );
        let (low4, high2) = (_mm256_set1_epi8(15), _mm256_set1_epi8(0x30));
        for half in 0..2 {
            let ql0 = _mm256_loadu_si256(b.add(64 * half) as *const __m256i);
            let ql1 = _mm256_loadu_si256(b.add(64 * half + 32) as *const __m256i);
            let qh = _mm256_loadu_si256(b.add(128 + 32 * half) as *const __m256i);
            let levels = [
                _mm256_or_si256(
                    _mm256_and_si256(ql0, low4),
                    _mm256_and_si256(_mm256_slli_epi16::<4>(qh), high2),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(ql1, low4),
                    _mm256_and_si256(_mm256_slli_epi16::<2>(qh), high2),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), low4),
                    _mm256_and_si256(qh, high2),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), low4),
                    _mm256_and_si256(_mm256_srli_epi16::<2>(qh), high2),
                ),
            ];
            for (k, v) in levels.into_iter().enumerate() {
                let j = 4 * half + k;
                let pair = _mm256_permutevar8x32_epi32(sc16, _mm256_set1_epi32(j as i32));
                let scales = _mm256_shuffle_epi8(pair, spread);
                let pairs = _mm256_maddubs_epi16(v, x_block(x, 8 * blk + j));
                let dot = _mm256_madd_epi16(pairs, scales);
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), splat_lane(coef, j), *acc);
            }
        }
    }
}

/// `out[r] = dot(row r, x)` for `R` quantised rows of `cols` values (whole blocks of `Q`),
/// block by block across the rows, prefetching the next row block's lines as it goes.
// SAFETY (callers): the CPU has the features named below (the caller checked the SIMD level)
// and the pointers cover the block, lanes or rows this function reads and writes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fused_rows<const Q: u8, const R: usize>(
    dtype: WeightDType,
    rows: &[*const u8],
    prefetch_rows: *const *const u8,
    x: Q8Row,
    cols: usize,
    out: &mut [f32],
) {
    let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
    // SAFETY: `rows` holds R pointers, a non-null `prefetch_rows` R more (the caller's contract).
    let (rows, next) = unsafe { tile_rows::<R>(rows, prefetch_rows) };
    let mut acc = [_mm256_setzero_ps(); R];
    let mut prefetched = 0;
    for blk in 0..cols / be {
        // SAFETY: block `blk` lies inside every row (`cols` whole blocks) and inside `x`.
        unsafe {
            let xb = prepare::<Q>(x, blk);
            for r in 0..R {
                let b = rows[r].add(blk * bb);
                match Q {
                    Q4_0 => q4_0(b, x, blk, &xb, &mut acc[r]),
                    Q4_K => k_asym::<false>(b, x, blk, &mut acc[r]),
                    Q5_K => k_asym::<true>(b, x, blk, &mut acc[r]),
                    Q6_K => q6_k(b, x, blk, &xb, &mut acc[r]),
                    _ => unreachable!("decode_tile takes only the types of `takes`"),
                }
            }
        }
        if let Some(next) = &next {
            prefetch_rows_through(next, &mut prefetched, (blk + 1) * bb);
        }
    }
    for r in 0..R {
        out[r] = crate::x86_avx2::horizontal_sum(acc[r]);
    }
}

/// The fused one-token tile with 8-bit activations for 8 or 1 rows of Q4_0, Q4_K, Q5_K or Q6_K
/// (`out[r] = dot(row r, x)`), or false (nothing done) for any other row count or type.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; every `rows[r]` must address
/// `dtype.row_bytes(cols)` readable bytes (`cols` whole blocks of the quantised `dtype`), `x`
/// one quantised row of `cols` values; `out` must hold `rows.len()` values; `prefetch_rows`
/// null or `rows.len()` pointers (hints only, never dereferenced).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn decode_tile(
    dtype: WeightDType,
    rows: &[*const u8],
    prefetch_rows: *const *const u8,
    x: Q8Row,
    cols: usize,
    out: &mut [f32],
) -> bool {
    if !takes(dtype) {
        return false;
    }
    dispatch_decode_tile!(fused_rows, dtype, rows, prefetch_rows, x, cols, out)
}
