//! AVX-512 VNNI fused one-token decode tiles with 8-bit activations ([`crate::q8`]): the raw
//! weight levels (u8: 0..16, 0..32, 0..64; Q8_0's i8 plus 128) dotted against the int8
//! activations with `vpdpbusd` (u8 x i8 -> i32, four products per lane), the weight and
//! activation scales applied once per (sub-)block in f32.
//!
//! MXFP4's signed doubled E2M1 levels (-12..=12) become u8 by a `pshufb` table of the levels plus
//! 12, IQ4_NL's table levels (-127..=113) by a `pshufb` lookup plus 128; Q5_0/Q5_1 dot their
//! five-bit levels (0..32). Offsets are folded into the integer accumulator's start: Q6_K's 32, Q4_0's 8, MXFP4's 12 and Q8_0's 128
//! times the activations' sums per four values (one `vpdpbusd` per block, shared by the rows).
//! The K-quant mins go as one 16-lane product `[d sc_j | dmin m_j] * [d_x,j | sum_x,j]`, the
//! min lanes subtracted. Per block the activations are prepared once for the tile's rows
//! ([`XBlock`]); Q4_K/Q5_K read them paired by sub-block as their nibbles come (sub-blocks
//! `4q, 4q+2` from the low nibbles of 64 bytes, `4q+1, 4q+3` from the high ones; Q4_K's high
//! nibbles dotted in place, 16 times their level, the 1/16 in the activation scales), Q6_K in
//! column order (the levels of `q6_levels`). An 8-row Q4_K or Q5_K tile unpacks the 6-bit scales
//! of four rows' blocks at once ([`k_coefficients4`]). On the H200 machine's host one thread's
//! one-token Q4_K tiles read 7.5 GB/s against its 12.7 GB/s read probe (BF16: 11.7), about the
//! sum of the unpacking's time and the memory stalls; these two steps took 16 threads'
//! `bench-kernels` decode from 76 to 80-83 GB/s in one call (issue 46). Experts of 2-4 tokens
//! (batched decode, a partly hot layer) run 8 rows of every type but Q6_K two tokens at a time
//! ([`decode_tile_pair`]): the levels (and four K rows' scales) are unpacked once for both (the
//! build machine's "layer 25% hot" case: Q4_K 15-16.5 -> 17-17.8 GB/s, Q5_K 13.5-13.9 ->
//! 15.0-15.4, MXFP4 10.8-11.1 -> 12.8; the GPU host not measured yet; Q6_K's pair spilled
//! registers and ran slower, so it stays one token at a time). The results differ from
//! the exact dot of the dequantised weights with f32 `x` by the activation rounding (bound in
//! [`crate::q8`]) and f32 rounding of the scale products.

use std::arch::x86_64::*;

use crate::q8::Q8Row;
use crate::weights::WeightDType;

use super::avx512::{half_splat, k_coefficients, q6_levels};
use super::{prefetch_rows_through, tile_rows, IQ4_NL, MXFP4, Q4_0, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0};

/// Two accumulators per row (halves of a block alternate between them).
type Acc = [__m512; 2];

/// One block's activations prepared for the rows of a tile: `v` the int8 values (per 64
/// columns, in the order the type's levels come; the 32-value types use `v[0]`'s low half),
/// `off` the accumulator start per lane (minus the type's offset times the four values' sum),
/// `f` the activation scales (per type: see [`prepare`]).
struct XBlock {
    v: [__m512i; 4],
    off: [__m512i; 4],
    f: __m512,
}

/// `-(k * (x summed per four bytes))` per i32 lane of `v` (k < 256 as the u8 operand).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn neg_offset(k: i8, v: __m512i) -> __m512i {
    _mm512_sub_epi32(
        _mm512_setzero_si512(),
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(k), v),
    )
}

/// 32 int8 activations at `lo` in the low half, 32 at `hi` in the high half.
// SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
// level) and the pointers cover the block, lanes or rows this function reads and writes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn pair(lo: *const i8, hi: *const i8) -> __m512i {
    // SAFETY: the caller vouches for 32 readable bytes at each pointer.
    unsafe {
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_loadu_si256(lo as *const __m256i)),
            _mm256_loadu_si256(hi as *const __m256i),
        )
    }
}

/// Block `blk`'s activations of `x` prepared for type `Q` (see [`XBlock`]): Q4_K/Q5_K `v[2q]` =
/// sub-blocks `4q | 4q+2`, `v[2q+1]` = `4q+1 | 4q+3`, `f` = `[d_x,j (8) | sum_x,j (8)]`; Q6_K
/// `v[g]` columns `64g..64g+64`, `off` minus 32 sums, `f` lane s = `d_x` of sub-block s (16
/// values); Q4_0/Q8_0 `v[0]` the 32 values, `off[0]` minus 8 / 128 sums, `f` = `d_x` (all lanes).
// SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
// level) and the pointers cover the block, lanes or rows this function reads and writes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn prepare<const Q: u8>(x: Q8Row, blk: usize) -> XBlock {
    let zero = _mm512_setzero_si512();
    // SAFETY: block `blk` of the row: its 256 (or 32) values and 8 (or 1) scales and sums lie
    // inside the caller's row.
    unsafe {
        match Q {
            Q4_K | Q5_K => {
                let sub = |j: usize| x.qs.add(256 * blk + 32 * j);
                let v =
                    [pair(sub(0), sub(2)), pair(sub(1), sub(3)), pair(sub(4), sub(6)), pair(sub(5), sub(7))];
                let d = _mm256_loadu_ps(x.d.add(8 * blk));
                // Q4_K's high nibbles are dotted in place (16 times their level): 1/16 here.
                let d = if Q == Q4_K {
                    _mm256_mul_ps(d, _mm256_setr_ps(1.0, 0.0625, 1.0, 0.0625, 1.0, 0.0625, 1.0, 0.0625))
                } else {
                    d
                };
                let f =
                    _mm512_insertf32x8::<1>(_mm512_castps256_ps512(d), _mm256_loadu_ps(x.sum.add(8 * blk)));
                XBlock { v, off: [zero; 4], f }
            }
            Q6_K => {
                let v: [__m512i; 4] =
                    std::array::from_fn(|g| _mm512_loadu_si512(x.qs.add(256 * blk + 64 * g) as *const _));
                let off = v.map(|v| neg_offset(32, v));
                let half = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
                let f =
                    _mm512_permutexvar_ps(half, _mm512_castps256_ps512(_mm256_loadu_ps(x.d.add(8 * blk))));
                XBlock { v, off, f }
            }
            _ => {
                let v = _mm512_castsi256_si512(_mm256_loadu_si256(x.qs.add(32 * blk) as *const __m256i));
                let off = neg_offset(
                    match Q {
                        Q4_0 => 8,
                        MXFP4 => 12,
                        Q5_0 => 16,
                        Q5_1 => 0,
                        _ => -128, // Q8_0 and IQ4_NL: levels + 128
                    },
                    v,
                );
                let f = if Q == Q5_1 {
                    // [d_x (8 lanes) | sum_x, 0 ...]: the dot's and the min's factors.
                    _mm512_mask_blend_ps(
                        0xFF00,
                        _mm512_set1_ps(*x.d.add(blk)),
                        _mm512_maskz_mov_ps(0x0100, _mm512_set1_ps(*x.sum.add(blk))),
                    )
                } else {
                    _mm512_set1_ps(*x.d.add(blk))
                };
                XBlock { v: [v, zero, zero, zero], off: [off, zero, zero, zero], f }
            }
        }
    }
}

/// Q4_K or Q5_K (`Q`) block at `b`: per 64 nibble bytes the low and high nibbles
/// (plus Q5_K's fifth bits, by a byte mask test and a masked add of 16) dotted with `vpdpbusd`,
/// each result's two sub-blocks scaled by `d sc_j d_x,j` (a lane permute of the block's
/// products); the mins `dmin m_j sum_x,j` subtracted as one 16-lane product.
// SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
// level) and the pointers cover the block, lanes or rows this function reads and writes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn k_asym<const Q: u8>(b: *const u8, x: &XBlock, acc: &mut Acc) {
    // SAFETY: the caller vouches for one whole block at `b` (144 or 176 bytes).
    unsafe { k_asym_scaled::<Q>(b, x, _mm512_mul_ps(k_coefficients(b), x.f), acc) }
}

/// [`k_asym`] with the block's coefficients times the activations' (`c`, as
/// [`k_coefficients4`] gives them).
// SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
// level) and the pointers cover the block, lanes or rows this function reads and writes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn k_asym_scaled<const Q: u8>(b: *const u8, x: &XBlock, c: __m512, acc: &mut Acc) {
    // SAFETY: the caller vouches for one whole block at `b` (144 or 176 bytes).
    unsafe {
        acc[1] = _mm512_mask_sub_ps(acc[1], 0xFF00, acc[1], c);
        for q in 0..2 {
            let (lo, hi) = k_levels::<Q>(b, q);
            let zero = _mm512_setzero_si512();
            let dlo = _mm512_dpbusd_epi32(zero, lo, x.v[2 * q]);
            let dhi = _mm512_dpbusd_epi32(zero, hi, x.v[2 * q + 1]);
            let j = 4 * q as i32;
            let (slo, shi) = (pick2(j, j + 2), pick2(j + 1, j + 3));
            acc[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dlo), _mm512_permutexvar_ps(slo, c), acc[0]);
            acc[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dhi), _mm512_permutexvar_ps(shi, c), acc[1]);
        }
    }
}

/// Run `q` (0 or 1) of a Q4_K or Q5_K (`Q`) block's levels as u8: the low nibbles of
/// 64 bytes (sub-blocks `4q`, `4q+2`) and the high ones (`4q+1`, `4q+3`), Q5_K's fifth bits added
/// as 16 (a byte mask test and a masked add), Q4_K's high nibbles in place (16 times their level;
/// the 1/16 is in the prepared activation scales).
// SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
// level) and the pointers cover the block, lanes or rows this function reads and writes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn k_levels<const Q: u8>(b: *const u8, q: usize) -> (__m512i, __m512i) {
    // only Q4_K and Q5_K rows reach here (the walks branch on the type before)
    let fifth = Q == Q5_K;
    // SAFETY: the caller vouches for one whole block at `b` (144 or 176 bytes).
    unsafe {
        let low4 = _mm512_set1_epi8(15);
        let raw = _mm512_loadu_si512(b.add(if fifth { 48 } else { 16 } + 64 * q) as *const _);
        let lo = _mm512_and_si512(raw, low4);
        if !fifth {
            return (lo, _mm512_andnot_si512(low4, raw));
        }
        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), low4);
        let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(b.add(16) as *const __m256i));
        let bit = |j: usize| {
            let bytes = |j: usize| ((1u64 << j) * 0x0101_0101_0101_0101) as i64;
            let (a, c) = (bytes(j), bytes(j + 2));
            _mm512_setr_epi64(a, a, a, a, c, c, c, c)
        };
        let sixteen = _mm512_set1_epi8(16);
        (
            _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(qh, bit(4 * q)), lo, sixteen),
            _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(qh, bit(4 * q + 1)), hi, sixteen),
        )
    }
}

/// [`k_coefficients`] of four Q4_K/Q5_K blocks at once, each times the activations' `xf`: the
/// four 16-byte headers (d, dmin, the 12 packed scale bytes) in the 128-bit lanes of one
/// register, so the 6-bit unpack runs once for four rows.
// SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
// level) and the pointers cover the block, lanes or rows this function reads and writes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn k_coefficients4(b: [*const u8; 4], xf: __m512) -> [__m512; 4] {
    const LOW6: i32 = 0x3f3f_3f3f;
    const LOW4: i32 = 0x0f0f_0f0f;
    const TOP2: i32 = 0x3030_3030;
    // SAFETY: the caller vouches for a whole block at each pointer (16 header bytes first).
    let w = unsafe {
        let lane = |i: usize| _mm_loadu_si128(b[i] as *const __m128i);
        let w = _mm512_inserti32x4::<1>(_mm512_castsi128_si512(lane(0)), lane(1));
        _mm512_inserti32x4::<3>(_mm512_inserti32x4::<2>(w, lane(2)), lane(3))
    };
    // Per lane, dwords [d dmin, s0, s1, s2]: as `k_scales_mins_vec` over s0..s2 ->
    // bytes [sc0..sc7, m0..m7].
    let low = _mm512_srlv_epi32(_mm512_shuffle_epi32::<0b11_10_11_01>(w), _mm512_set4_epi32(4, 0, 0, 0));
    let top = _mm512_srli_epi32::<2>(_mm512_shuffle_epi32::<0b10_10_01_01>(w));
    let packed = _mm512_or_si512(
        _mm512_and_si512(low, _mm512_set4_epi32(LOW4, LOW6, LOW4, LOW6)),
        _mm512_and_si512(top, _mm512_set4_epi32(TOP2, 0, TOP2, 0)),
    );
    // [d0 dmin0 d1 dmin1 ... d3 dmin3] as f32 lanes 0..8.
    let halves =
        _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), w);
    let dd = _mm512_cvtph_ps(_mm512_castsi512_si256(halves));
    let row = |r: i32| {
        let levels = match r {
            0 => _mm512_castsi512_si128(packed),
            1 => _mm512_extracti32x4_epi32::<1>(packed),
            2 => _mm512_extracti32x4_epi32::<2>(packed),
            _ => _mm512_extracti32x4_epi32::<3>(packed),
        };
        let factor = _mm512_permutexvar_ps(pick2(2 * r, 2 * r + 1), dd);
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(levels)), _mm512_mul_ps(factor, xf))
    };
    [row(0), row(1), row(2), row(3)]
}

/// Lane indices: `a` in lanes 0..8, `b` in 8..16.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn pick2(a: i32, b: i32) -> __m512i {
    _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(a), _mm512_set1_epi32(b))
}

/// Q6_K block at `b`: the 64 levels per group of `q6_levels` dotted in column order, the
/// accumulator started at minus 32 times the activation sums; lane j of group g scaled by
/// `d sc_(4g + j/4) d_x`.
// SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
// level) and the pointers cover the block, lanes or rows this function reads and writes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q6_k(b: *const u8, x: &XBlock, acc: &mut Acc) {
    // SAFETY: the caller vouches for one 210-byte block at `b`.
    unsafe {
        let sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(b.add(192) as *const __m128i)));
        let sc = _mm512_mul_ps(_mm512_mul_ps(half_splat(b.add(208)), sc), x.f);
        let quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        for half in 0..2 {
            let v = q6_levels(b.add(64 * half), b.add(128 + 32 * half));
            for (h, v) in v.into_iter().enumerate() {
                let g = 2 * half + h;
                let dot = _mm512_dpbusd_epi32(x.off[g], v, x.v[g]);
                let s = _mm512_permutexvar_ps(_mm512_add_epi32(quarter, _mm512_set1_epi32(4 * g as i32)), sc);
                acc[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[h]);
            }
        }
    }
}

/// Q4_0 (levels: the nibbles, offset 8), MXFP4 (levels: the doubled E2M1 values + 12, offset 12),
/// Q5_0 (the five-bit levels, offset 16), IQ4_NL (the table levels + 128, offset 128) or Q8_0
/// (levels: i8 + 128) block at `b`: one 256-bit `vpdpbusd`, scaled by `d d_x`; Q5_1 (the
/// five-bit levels, no offset) adds its min as `m sum_x` in one more lane.
// SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
// level) and the pointers cover the block, lanes or rows this function reads and writes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn small_block<const Q: u8>(b: *const u8, x: &XBlock, acc: &mut Acc) {
    // SAFETY: forwarded from the caller (one whole block at `b`, the CPU features).
    unsafe { small_dot::<Q>(b, small_levels::<Q>(b), x, &mut acc[0]) }
}

/// [`small_block`] for two tokens (one accumulator each): the block's levels unpacked once.
// SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
// level) and the pointers cover the block, lanes or rows this function reads and writes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn small_block_pair<const Q: u8>(b: *const u8, x: &[XBlock; 2], acc: &mut [__m512; 2]) {
    // SAFETY: forwarded from the caller (one whole block at `b`, the CPU features).
    unsafe {
        let w = small_levels::<Q>(b);
        small_dot::<Q>(b, w, &x[0], &mut acc[0]);
        small_dot::<Q>(b, w, &x[1], &mut acc[1]);
    }
}

/// The 32 levels of a [`small_block`] type's block at `b` as u8 (see there).
// SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
// level) and the pointers cover the block, lanes or rows this function reads and writes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn small_levels<const Q: u8>(b: *const u8) -> __m256i {
    // SAFETY: the caller vouches for one 17-, 18-, 22-, 24- or 34-byte block at `b`.
    unsafe {
        let nibbles =
            |q: __m128i| _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(q), q), _mm256_set1_epi8(15));
        match Q {
            Q4_0 => nibbles(_mm_loadu_si128(b.add(2) as *const __m128i)),
            MXFP4 => {
                let table = _mm256_setr_epi8(
                    12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0, 12, 13, 14, 15, 16, 18, 20,
                    24, 12, 11, 10, 9, 8, 6, 4, 0,
                );
                _mm256_shuffle_epi8(table, nibbles(_mm_loadu_si128(b.add(1) as *const __m128i)))
            }
            Q5_0 | Q5_1 => {
                let (lo, hi) = crate::x86_quant::q5_levels(b.add(if Q == Q5_1 { 4 } else { 2 }));
                _mm256_set_m128i(hi, lo)
            }
            IQ4_NL => {
                let (lo, hi) = crate::x86_quant::table_levels(&crate::quant::IQ4_NL_VALUES, b.add(2));
                _mm256_xor_si256(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(-128))
            }
            _ => _mm256_xor_si256(_mm256_loadu_si256(b.add(2) as *const __m256i), _mm256_set1_epi8(-128)),
        }
    }
}

/// The levels `w` of the [`small_block`] at `b` against one token's prepared block, into `acc`.
// SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
// level) and the pointers cover the block, lanes or rows this function reads and writes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn small_dot<const Q: u8>(b: *const u8, w: __m256i, x: &XBlock, acc: &mut __m512) {
    // SAFETY: the caller vouches for one whole block at `b` (its scale bytes read here).
    unsafe {
        let dot = _mm256_dpbusd_epi32(_mm512_castsi512_si256(x.off[0]), w, _mm512_castsi512_si256(x.v[0]));
        let dot = _mm256_cvtepi32_ps(dot);
        if Q == Q5_1 {
            // [dot (8 lanes) | 1 ...] * [d d_x | m sum_x, 0 ...]: the min once per block.
            let d_m = _mm512_mask_blend_ps(0xFF00, half_splat(b), half_splat(b.add(2)));
            let v = _mm512_insertf32x8::<1>(_mm512_castps256_ps512(dot), _mm256_set1_ps(1.0));
            *acc = _mm512_fmadd_ps(v, _mm512_mul_ps(d_m, x.f), *acc);
            return;
        }
        let d = if Q == MXFP4 { _mm512_set1_ps(crate::quant::e8m0_half(*b)) } else { half_splat(b) };
        let s = _mm512_mul_ps(d, x.f);
        *acc = _mm512_fmadd_ps(_mm512_zextps256_ps512(dot), s, *acc);
    }
}

/// One block of type `Q` at `b` against its prepared activations.
// SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
// level) and the pointers cover the block, lanes or rows this function reads and writes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn block<const Q: u8>(b: *const u8, x: &XBlock, acc: &mut Acc) {
    // SAFETY: forwarded from the caller (one whole block, the CPU features of this module).
    unsafe {
        match Q {
            Q4_K | Q5_K => k_asym::<Q>(b, x, acc),
            Q6_K => q6_k(b, x, acc),
            _ => small_block::<Q>(b, x, acc),
        }
    }
}

/// `out[r] = dot(row r, x)` for `R` quantised rows of `cols` values (whole blocks of `Q`),
/// block by block across the rows, the block's activations prepared once for all rows,
/// prefetching the next row block's lines as it goes.
// SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
// level) and the pointers cover the block, lanes or rows this function reads and writes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
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
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    let mut prefetched = 0;
    for blk in 0..cols / be {
        // SAFETY: block `blk`'s activations lie inside the row `x` (`cols` values).
        let xb = unsafe { prepare::<Q>(x, blk) };
        if matches!(Q, Q4_K | Q5_K) && R.is_multiple_of(4) {
            for g in (0..R).step_by(4) {
                let at: [*const u8; 4] = std::array::from_fn(|i| rows[g + i].wrapping_add(blk * bb));
                // SAFETY: block `blk` lies inside rows g..g + 4 (`cols` whole blocks); the CPU
                // features are this function's.
                unsafe {
                    let c = k_coefficients4(at, xb.f);
                    for i in 0..4 {
                        k_asym_scaled::<Q>(at[i], &xb, c[i], &mut acc[g + i]);
                    }
                }
            }
        } else {
            for r in 0..R {
                // SAFETY: block `blk` lies inside row r (`cols` whole blocks); the CPU features
                // are this function's.
                unsafe { block::<Q>(rows[r].add(blk * bb), &xb, &mut acc[r]) };
            }
        }
        if let Some(next) = &next {
            prefetch_rows_through(next, &mut prefetched, (blk + 1) * bb);
        }
    }
    for r in 0..R {
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
    }
}

/// [`k_asym_scaled`] for two tokens (`x[t]`, `c[t]` the block's coefficients times token t's
/// activation scales, one accumulator per token): each 64-byte run of nibbles (and Q5_K's fifth
/// bits) is unpacked once for both.
// SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
// level) and the pointers cover the block, lanes or rows this function reads and writes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn k_asym_pair<const Q: u8>(b: *const u8, x: &[XBlock; 2], c: [__m512; 2], acc: &mut [__m512; 2]) {
    // SAFETY: the caller vouches for one whole block at `b` (144 or 176 bytes).
    unsafe {
        for t in 0..2 {
            // the mins, in the upper lanes (the accumulator is summed over all lanes)
            acc[t] = _mm512_mask_sub_ps(acc[t], 0xFF00, acc[t], c[t]);
        }
        for q in 0..2 {
            let (lo, hi) = k_levels::<Q>(b, q);
            let j = 4 * q as i32;
            let (slo, shi) = (pick2(j, j + 2), pick2(j + 1, j + 3));
            let zero = _mm512_setzero_si512();
            for t in 0..2 {
                let dlo = _mm512_dpbusd_epi32(zero, lo, x[t].v[2 * q]);
                let dhi = _mm512_dpbusd_epi32(zero, hi, x[t].v[2 * q + 1]);
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dlo), _mm512_permutexvar_ps(slo, c[t]), acc[t]);
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dhi), _mm512_permutexvar_ps(shi, c[t]), acc[t]);
            }
        }
    }
}

/// `out[2 r + t] = dot(row r, x t)` for 8 rows of type `Q` (not Q6_K) and two tokens:
/// [`fused_rows`]'s walk with each block's levels (and each four K rows' scales) unpacked once
/// for both tokens, the rows read once.
// SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
// level) and the pointers cover the block, lanes or rows this function reads and writes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn fused_rows_pair<const Q: u8>(
    dtype: WeightDType,
    rows: &[*const u8],
    prefetch_rows: *const *const u8,
    xs: [Q8Row; 2],
    cols: usize,
    out: &mut [f32],
) {
    const R: usize = 8;
    let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
    // SAFETY: `rows` holds R pointers, a non-null `prefetch_rows` R more (the caller's contract).
    let (rows, next) = unsafe { tile_rows::<R>(rows, prefetch_rows) };
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    let mut prefetched = 0;
    for blk in 0..cols / be {
        // SAFETY: block `blk`'s activations lie inside each token's row (`cols` values).
        let xb = unsafe { [prepare::<Q>(xs[0], blk), prepare::<Q>(xs[1], blk)] };
        if matches!(Q, Q4_K | Q5_K) {
            for g in (0..R).step_by(4) {
                let at: [*const u8; 4] = std::array::from_fn(|i| rows[g + i].wrapping_add(blk * bb));
                // SAFETY: block `blk` lies inside rows g..g + 4 (`cols` whole blocks); the CPU
                // features are this function's.
                unsafe {
                    let w = k_coefficients4(at, _mm512_set1_ps(1.0));
                    for i in 0..4 {
                        let c = [_mm512_mul_ps(w[i], xb[0].f), _mm512_mul_ps(w[i], xb[1].f)];
                        k_asym_pair::<Q>(at[i], &xb, c, &mut acc[g + i]);
                    }
                }
            }
        } else {
            for r in 0..R {
                // SAFETY: block `blk` lies inside row r (`cols` whole blocks); the CPU features
                // are this function's.
                unsafe { small_block_pair::<Q>(rows[r].add(blk * bb), &xb, &mut acc[r]) };
            }
        }
        if let Some(next) = &next {
            prefetch_rows_through(next, &mut prefetched, (blk + 1) * bb);
        }
    }
    for r in 0..R {
        for t in 0..2 {
            out[2 * r + t] = _mm512_reduce_add_ps(acc[r][t]);
        }
    }
}

/// The 8-row tile for two tokens at once ([`fused_rows_pair`]: `out[2 r + t]`) of every type
/// with a one-token VNNI tile but Q6_K, or false (nothing done) for any other row count or
/// type.
///
/// # Safety
/// As [`decode_tile`], for each of the two quantised rows `xs`; `out` must hold 16 values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn decode_tile_pair(
    dtype: WeightDType,
    rows: &[*const u8],
    prefetch_rows: *const *const u8,
    xs: [Q8Row; 2],
    cols: usize,
    out: &mut [f32],
) -> bool {
    if rows.len() != 8 {
        return false;
    }
    // SAFETY: forwarded from the caller; 8 rows.
    unsafe {
        match dtype {
            WeightDType::Q4_K => fused_rows_pair::<Q4_K>(dtype, rows, prefetch_rows, xs, cols, out),
            WeightDType::Q5_K => fused_rows_pair::<Q5_K>(dtype, rows, prefetch_rows, xs, cols, out),
            WeightDType::Q8_0 => fused_rows_pair::<Q8_0>(dtype, rows, prefetch_rows, xs, cols, out),
            WeightDType::Q4_0 => fused_rows_pair::<Q4_0>(dtype, rows, prefetch_rows, xs, cols, out),
            WeightDType::Mxfp4 => fused_rows_pair::<MXFP4>(dtype, rows, prefetch_rows, xs, cols, out),
            WeightDType::Q5_0 => fused_rows_pair::<Q5_0>(dtype, rows, prefetch_rows, xs, cols, out),
            WeightDType::Q5_1 => fused_rows_pair::<Q5_1>(dtype, rows, prefetch_rows, xs, cols, out),
            WeightDType::Iq4Nl => fused_rows_pair::<IQ4_NL>(dtype, rows, prefetch_rows, xs, cols, out),
            _ => return false,
        }
    }
    true
}

/// The fused one-token tile with 8-bit activations for 8 or 1 rows (`out[r] = dot(row r, x)`),
/// or false (nothing done) for any other row count or type.
///
/// # Safety
/// The CPU must support AVX-512F, BW, VL, VNNI, AVX2, FMA and F16C; every `rows[r]` must address
/// `dtype.row_bytes(cols)` readable bytes (`cols` whole blocks of the quantised `dtype`), `x`
/// one quantised row of `cols` values; `out` must hold `rows.len()` values; `prefetch_rows`
/// null or `rows.len()` pointers (hints only, never dereferenced).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn decode_tile(
    dtype: WeightDType,
    rows: &[*const u8],
    prefetch_rows: *const *const u8,
    x: Q8Row,
    cols: usize,
    out: &mut [f32],
) -> bool {
    dispatch_decode_tile!(fused_rows, dtype, rows, prefetch_rows, x, cols, out)
}
