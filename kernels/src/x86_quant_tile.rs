//! Fused one-token (decode) tiles over GGML-quantised rows: every block is decoded to f32 in
//! registers and multiplied into the accumulators straight away, with no store and reload of
//! dequantised values through an L1 buffer.
//!
//! AVX-512: Q4_0, MXFP4 and IQ4_NL look their values up in a per-block table of the 16
//! dequantised values (`vpermps`, exactly the scalar values), Q5_0/Q5_1 in one of 32 (`vpermt2ps`); the K-quants dot the raw levels (constant tables
//! 0..16 / 0..32 for Q4_K / Q5_K; Q6_K's 64 six-bit levels per step assembled with one
//! `vpternlogd` against activations put into the levels' byte order once per block), scale each
//! sub-block's dot once, and take the mins (Q4_K/Q5_K) or the offset 32 (Q6_K) as one 16-lane term
//! against sums of x per 16 columns shared by the tile's rows. AVX2: the 4- and 5-bit types look
//! their values up in a per-(sub-)block table (`scale * q - min` in one FMA); Q8_0 and Q6_K convert
//! the integers and apply the (sub-)block scale once per 32 or 16 values, MXFP4 its doubled E2M1
//! integers (a `pshufb` lookup) and its scale once per 32, IQ4_NL likewise with its f16 scale,
//! Q5_0 its levels minus 16 and Q5_1 its levels and `m * sum(x)` once per 32. Results differ from the
//! scalar kernel by f32 rounding only (summation order, the fused table entries, the factored
//! scales).
//!
//! AVX-512 VNNI (`avx512_vnni`, in `x86_quant_vnni.rs`): with 8-bit activations
//! ([`crate::q8`], [`crate::DecodeActivations`] Q8 or Auto) the raw levels are dotted against int8
//! activations with `vpdpbusd` and scaled once per (sub-)block; results then differ from the
//! scalar kernel by the activation rounding (bound in [`crate::q8`]). `ffn::run_tile` takes
//! that tile when the one-token call comes with a quantised row and the level has VNNI.
//!
//! Every block is read in its compressed size once; the next row block's bytes are prefetched
//! into L2 as the block advances (one hint per cache line).

// Block type codes of the tiles' const generic.
const Q8_0: u8 = 0;
const Q4_0: u8 = 1;
const Q4_K: u8 = 2;
const Q5_K: u8 = 3;
const Q6_K: u8 = 4;
const MXFP4: u8 = 5;
const Q5_0: u8 = 6;
const Q5_1: u8 = 7;
const IQ4_NL: u8 = 8;

/// A fused tile's `R` rows as an array, and the `R` rows it prefetches (`None`: none).
///
/// # Safety
/// `rows` holds at least `R` pointers; a non-null `prefetch_rows` addresses `R` pointers.
#[inline(always)]
unsafe fn tile_rows<const R: usize>(
    rows: &[*const u8],
    prefetch_rows: *const *const u8,
) -> ([*const u8; R], Option<[*const u8; R]>) {
    // SAFETY: a non-null `prefetch_rows` holds R pointers (the caller's contract).
    let next = (!prefetch_rows.is_null()).then(|| std::array::from_fn(|r| unsafe { *prefetch_rows.add(r) }));
    (std::array::from_fn(|r| rows[r]), next)
}

/// Prefetches (into L2) every cache line of each of `next` rows below byte `upto`, from
/// `*prefetched` on, so the next row block streams while this one is decoded.
#[inline(always)]
fn prefetch_rows_through(next: &[*const u8], prefetched: &mut usize, upto: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
    while *prefetched < upto {
        for row in next {
            // SAFETY: SSE is part of the x86-64 baseline; a prefetch is a hint that never faults,
            // and the address stays in the row.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(row.wrapping_add(*prefetched) as *const i8) };
        }
        *prefetched += 64;
    }
}

/// A level's `decode_tile` body: the fused tile of `$fused_rows` for 8 or 1 rows of a quantised
/// type, `true`; `false` (nothing done) for any other row count or type.
macro_rules! dispatch_decode_tile {
    ($fused_rows:ident, $dtype:expr, $rows:expr, $prefetch:expr, $x:expr, $cols:expr, $out:expr) => {{
        macro_rules! by_rows {
            ($q:expr) => {
                match $rows.len() {
                    // SAFETY: forwarded from the caller; the row count matches R.
                    8 => unsafe { $fused_rows::<{ $q }, 8>($dtype, $rows, $prefetch, $x, $cols, $out) },
                    // SAFETY: as above.
                    1 => unsafe { $fused_rows::<{ $q }, 1>($dtype, $rows, $prefetch, $x, $cols, $out) },
                    _ => return false,
                }
            };
        }
        match $dtype {
            WeightDType::Q8_0 => by_rows!(Q8_0),
            WeightDType::Q4_0 => by_rows!(Q4_0),
            WeightDType::Q4_K => by_rows!(Q4_K),
            WeightDType::Q5_K => by_rows!(Q5_K),
            WeightDType::Q6_K => by_rows!(Q6_K),
            WeightDType::Mxfp4 => by_rows!(MXFP4),
            WeightDType::Q5_0 => by_rows!(Q5_0),
            WeightDType::Q5_1 => by_rows!(Q5_1),
            WeightDType::Iq4Nl => by_rows!(IQ4_NL),
            _ => return false,
        }
        true
    }};
}

/// AVX-512 VNNI fused decode tiles with 8-bit activations.
#[path = "x86_quant_vnni.rs"]
pub(crate) mod avx512_vnni;

/// AVX2 fused decode tiles with 8-bit activations (Q4_0, Q4_K, Q5_K, Q6_K).
#[path = "x86_quant_q8_avx2.rs"]
pub(crate) mod avx2_q8;

/// AVX-512F fused decode tiles (16 lanes).
pub(crate) mod avx512 {
    use std::arch::x86_64::*;

    use crate::weights::WeightDType;

    use super::{prefetch_rows_through, tile_rows, IQ4_NL, MXFP4, Q4_0, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0};

    /// Two accumulators per row: halves of a block alternate between them, so the FMA chain of
    /// one row is half as long.
    type Acc = [__m512; 2];

    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn iota() -> __m512 {
        _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.)
    }

    /// 16 bytes at `p` zero-extended to 16 i32 lanes.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn load_u8(p: *const u8) -> __m512i {
        // SAFETY: the caller vouches for 16 readable bytes at `p`; loadu tolerates any alignment.
        _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(p as *const __m128i) })
    }

    /// 16 f32 at `p`.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn load_x(p: *const f32) -> __m512 {
        // SAFETY: the caller vouches for 16 readable f32 at `p`.
        unsafe { _mm512_loadu_ps(p) }
    }

    /// The f16 at `p` widened (exactly) and broadcast to 16 lanes.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn half_splat(p: *const u8) -> __m512 {
        // SAFETY: the caller vouches for two readable bytes at `p`.
        let bits = unsafe { (p as *const u16).read_unaligned() };
        _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// Q8_0 block at `b` against 32 f32 at `x`: `acc += d * (q · x)`.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn q8_0(b: *const u8, x: *const f32, acc: &mut Acc) {
        // SAFETY: the caller vouches for one 34-byte block at `b` and 32 f32 at `x`.
        unsafe {
            let q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(b.add(2) as *const __m128i)));
            let q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(b.add(18) as *const __m128i)));
            let dot = _mm512_fmadd_ps(q1, load_x(x.add(16)), _mm512_mul_ps(q0, load_x(x)));
            acc[0] = _mm512_fmadd_ps(half_splat(b), dot, acc[0]);
        }
    }

    /// Q4_0 block at `b` against 32 f32 at `x`, values looked up in the table `d * (i - 8)`.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn q4_0(b: *const u8, x: *const f32, acc: &mut Acc) {
        // SAFETY: the caller vouches for one 18-byte block at `b` and 32 f32 at `x`.
        unsafe {
            let table = _mm512_mul_ps(half_splat(b), _mm512_sub_ps(iota(), _mm512_set1_ps(8.0)));
            let q = load_u8(b.add(2));
            let lo = _mm512_permutexvar_ps(q, table);
            let hi = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(q), table);
            acc[0] = _mm512_fmadd_ps(lo, load_x(x), acc[0]);
            acc[1] = _mm512_fmadd_ps(hi, load_x(x.add(16)), acc[1]);
        }
    }

    /// MXFP4 block at `b` against 32 f32 at `x`, values looked up in the table
    /// `kvalues[i] * e8m0_half(e)` (exact products: the scalar values).
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn mxfp4(b: *const u8, x: *const f32, acc: &mut Acc) {
        // SAFETY: the caller vouches for one 17-byte block at `b` and 32 f32 at `x`.
        unsafe {
            let levels = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                crate::quant::MXFP4_VALUES.as_ptr() as *const __m128i,
            )));
            let table = _mm512_mul_ps(levels, _mm512_set1_ps(crate::quant::e8m0_half(*b)));
            let q = load_u8(b.add(1));
            let lo = _mm512_permutexvar_ps(q, table);
            let hi = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(q), table);
            acc[0] = _mm512_fmadd_ps(lo, load_x(x), acc[0]);
            acc[1] = _mm512_fmadd_ps(hi, load_x(x.add(16)), acc[1]);
        }
    }

    /// Q5_0 (`MIN` false, table `d * (i - 16)`) or Q5_1 (`i * d + m`) block at `b` against 32
    /// f32 at `x`: the 32-entry table of the block's values (exactly the scalar values) in two
    /// registers, looked up with `vpermt2ps` by the five-bit levels.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn q5<const MIN: bool>(b: *const u8, x: *const f32, acc: &mut Acc) {
        // SAFETY: the caller vouches for one 22- or 24-byte block at `b` and 32 f32 at `x`.
        unsafe {
            let d = half_splat(b);
            let (t0, t1) = if MIN {
                let m = half_splat(b.add(2));
                let sixteen = _mm512_set1_ps(16.0);
                (
                    _mm512_add_ps(_mm512_mul_ps(iota(), d), m),
                    _mm512_add_ps(_mm512_mul_ps(_mm512_add_ps(iota(), sixteen), d), m),
                )
            } else {
                (_mm512_mul_ps(_mm512_sub_ps(iota(), _mm512_set1_ps(16.0)), d), _mm512_mul_ps(iota(), d))
            };
            let (lo, hi) = crate::x86_quant::q5_levels(b.add(if MIN { 4 } else { 2 }));
            let vlo = _mm512_permutex2var_ps(t0, _mm512_cvtepu8_epi32(lo), t1);
            let vhi = _mm512_permutex2var_ps(t0, _mm512_cvtepu8_epi32(hi), t1);
            acc[0] = _mm512_fmadd_ps(vlo, load_x(x), acc[0]);
            acc[1] = _mm512_fmadd_ps(vhi, load_x(x.add(16)), acc[1]);
        }
    }

    /// IQ4_NL block at `b` against 32 f32 at `x`, values looked up in the table
    /// `d * kvalues[i]` (exactly the scalar values).
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn iq4_nl(b: *const u8, x: *const f32, acc: &mut Acc) {
        // SAFETY: the caller vouches for one 18-byte block at `b` and 32 f32 at `x`.
        unsafe {
            let levels = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                crate::quant::IQ4_NL_VALUES.as_ptr() as *const __m128i,
            )));
            let table = _mm512_mul_ps(half_splat(b), levels);
            let q = load_u8(b.add(2));
            let lo = _mm512_permutexvar_ps(q, table);
            let hi = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(q), table);
            acc[0] = _mm512_fmadd_ps(lo, load_x(x), acc[0]);
            acc[1] = _mm512_fmadd_ps(hi, load_x(x.add(16)), acc[1]);
        }
    }

    /// The 8 scales (lanes 0..8, `d * sc`) and 8 mins (lanes 8..16, `dmin * m`) of a Q4_K/Q5_K
    /// block at `b`, unpacked in vector registers.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn k_coefficients(b: *const u8) -> __m512 {
        // SAFETY: the caller vouches for a whole K-quant block at `b` (16 header bytes and the
        // quants after them, of which `k_scales_mins_vec` reads 4).
        unsafe {
            let d_dmin = _mm_cvtph_ps(_mm_cvtsi32_si128((b as *const i32).read_unaligned()));
            let packed = crate::x86_quant::k_scales_mins_vec(b.add(4));
            let pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
            let factor = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(d_dmin));
            _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(packed)), factor)
        }
    }

    /// The scales of `k_coefficients` stored for broadcasting (entries 0..8), and the min term
    /// `sum_j min_j * (x summed over sub-block j)` as a vector to subtract (its lane sum): the
    /// mins repeated per 16 values times `xsum16` (lane i: the sum of the block's x[16i..16i+16]).
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn k_scales_and_min_term(b: *const u8, xsum16: __m512) -> ([f32; 16], __m512) {
        let mut scale = [0.0f32; 16];
        // SAFETY: forwarded from the caller (a whole K-quant block at `b`); `scale` holds 16 f32.
        unsafe {
            let c = k_coefficients(b);
            _mm512_storeu_ps(scale.as_mut_ptr(), c);
            let twice = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
            (scale, _mm512_mul_ps(_mm512_permutexvar_ps(twice, c), xsum16))
        }
    }

    /// Sums of the 128-bit quarters of `a` and `b` paired: quarters 0 and 1 of the result
    /// from `a`, 2 and 3 from `b` (when `PAIR` is 0x44/0xEE), or 0 from `a`, 1 from `b`, ...
    /// (0x88/0xDD): one step of `xsum16`'s transposing add tree.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn add_quarters<const LO: i32, const HI: i32>(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(_mm512_shuffle_f32x4::<LO>(a, b), _mm512_shuffle_f32x4::<HI>(a, b))
    }

    /// As `add_quarters`, lanes within each quarter.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn add_lanes<const LO: i32, const HI: i32>(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(_mm512_shuffle_ps::<LO>(a, b), _mm512_shuffle_ps::<HI>(a, b))
    }

    /// Per 16 activations of the 256 at `x`, their sum (lane i: x[16i..16i+16]), by a
    /// transposing add tree: pairs of quarters, quarters, pairs of lanes, lanes; lane 4k + m
    /// then holds the sum of vector 4m + k, put in order by one permute.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn xsum16(x: *const f32) -> __m512 {
        let mut t = [_mm512_setzero_ps(); 8];
        // SAFETY: the caller vouches for 256 readable f32 at `x`.
        unsafe {
            for (p, t) in t.iter_mut().enumerate() {
                *t = add_quarters::<0x44, 0xEE>(load_x(x.add(32 * p)), load_x(x.add(32 * p + 16)));
            }
        }
        let mut y = [_mm512_setzero_ps(); 4];
        for (r, y) in y.iter_mut().enumerate() {
            *y = add_quarters::<0x88, 0xDD>(t[2 * r], t[2 * r + 1]);
        }
        let z = [add_lanes::<0x44, 0xEE>(y[0], y[1]), add_lanes::<0x44, 0xEE>(y[2], y[3])];
        let w = add_lanes::<0x88, 0xDD>(z[0], z[1]);
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_ps(order, w)
    }

    /// Q4_K block at `b` against 256 f32 at `x`: per sub-block `scale * (q · x)`, the values
    /// `q` looked up in the constant table 0..16 by the nibbles (low nibbles of 32 bytes:
    /// sub-block 2p, high: 2p+1), the mins factored out against `xsum16` (see `xsum16`).
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn q4_k(b: *const u8, x: *const f32, xsum16: __m512, acc: &mut Acc) {
        // SAFETY: the caller vouches for one 144-byte block at `b` and 256 f32 at `x`; every
        // offset below stays inside them.
        unsafe {
            let (scale, min_term) = k_scales_and_min_term(b, xsum16);
            acc[1] = _mm512_sub_ps(acc[1], min_term);
            let iota = iota();
            for p in 0..4 {
                let (q0, q1) = (load_u8(b.add(16 + 32 * p)), load_u8(b.add(32 + 32 * p)));
                let at = x.add(64 * p);
                let lo = _mm512_fmadd_ps(
                    _mm512_permutexvar_ps(q1, iota),
                    load_x(at.add(16)),
                    _mm512_mul_ps(_mm512_permutexvar_ps(q0, iota), load_x(at)),
                );
                let (h0, h1) = (_mm512_srli_epi32::<4>(q0), _mm512_srli_epi32::<4>(q1));
                let hi = _mm512_fmadd_ps(
                    _mm512_permutexvar_ps(h1, iota),
                    load_x(at.add(48)),
                    _mm512_mul_ps(_mm512_permutexvar_ps(h0, iota), load_x(at.add(32))),
                );
                acc[0] = _mm512_fmadd_ps(_mm512_set1_ps(scale[2 * p]), lo, acc[0]);
                acc[1] = _mm512_fmadd_ps(_mm512_set1_ps(scale[2 * p + 1]), hi, acc[1]);
            }
        }
    }

    /// Bit `j` of every lane of `h` moved to bit 4 (other bits are don't-cares above bit 4).
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn bit_to_4(h: __m512i, j: u32) -> __m512i {
        if j <= 4 {
            _mm512_sll_epi32(h, _mm_cvtsi32_si128(4 - j as i32))
        } else {
            _mm512_srl_epi32(h, _mm_cvtsi32_si128(j as i32 - 4))
        }
    }

    /// Q5_K block at `b` against 256 f32 at `x`: as Q4_K with the constant 32-entry table 0..32
    /// (`vpermt2ps`), the index's bit 4 taken from the fifth-bit bytes.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn q5_k(b: *const u8, x: *const f32, xsum16: __m512, acc: &mut Acc) {
        // SAFETY: the caller vouches for one 176-byte block at `b` and 256 f32 at `x`; every
        // offset below stays inside them.
        unsafe {
            let (scale, min_term) = k_scales_and_min_term(b, xsum16);
            acc[1] = _mm512_sub_ps(acc[1], min_term);
            let (iota, iota16) = (iota(), _mm512_add_ps(iota(), _mm512_set1_ps(16.0)));
            let low4 = _mm512_set1_epi32(15);
            let fifth = [load_u8(b.add(16)), load_u8(b.add(32))];
            for p in 0..4 {
                let (mut lo, mut hi) = (_mm512_setzero_ps(), _mm512_setzero_ps());
                for (h, &fifth) in fifth.iter().enumerate() {
                    let q = load_u8(b.add(48 + 32 * p + 16 * h));
                    // (q & 15) | (fifth bit at 4, don't-cares above): ternary select on `low4`.
                    let idx_lo = _mm512_ternarylogic_epi32::<0xE4>(q, bit_to_4(fifth, 2 * p as u32), low4);
                    let idx_hi = _mm512_ternarylogic_epi32::<0xE4>(
                        _mm512_srli_epi32::<4>(q),
                        bit_to_4(fifth, 2 * p as u32 + 1),
                        low4,
                    );
                    let (ql, qh) = (
                        _mm512_permutex2var_ps(iota, idx_lo, iota16),
                        _mm512_permutex2var_ps(iota, idx_hi, iota16),
                    );
                    lo = _mm512_fmadd_ps(ql, load_x(x.add(64 * p + 16 * h)), lo);
                    hi = _mm512_fmadd_ps(qh, load_x(x.add(64 * p + 32 + 16 * h)), hi);
                }
                acc[0] = _mm512_fmadd_ps(_mm512_set1_ps(scale[2 * p]), lo, acc[0]);
                acc[1] = _mm512_fmadd_ps(_mm512_set1_ps(scale[2 * p + 1]), hi, acc[1]);
            }
        }
    }

    /// The 128 six-bit levels (offset 32 not subtracted) of one Q6_K half block (64 `ql` bytes
    /// at `ql`, 32 `qh` bytes at `qh`) as bytes in column order: 64 at a time in 512-bit
    /// registers. Bytes 0..32 of `ql` give columns 0..32 (low nibbles) and 64..96 (high), bytes
    /// 32..64 columns 32..64 and 96..128; their `qh` byte is the same for both, bit pairs 0, 1,
    /// 2, 3 in that column order. The pairs are masked first (0x33 per byte for the lower 256
    /// bits, 0xCC for the upper), so shifting them to bits 4..6 leaves bits 6..8 clear and one
    /// ternary select `(nibble & 15) | (pair & !15)` builds 64 levels.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn q6_levels(ql: *const u8, qh: *const u8) -> [__m512i; 2] {
        // SAFETY: the caller vouches for 64 readable bytes at `ql` and 32 at `qh`.
        let (a, h) = unsafe {
            (
                _mm512_loadu_si512(ql as *const _),
                _mm512_broadcast_i64x4(_mm256_loadu_si256(qh as *const __m256i)),
            )
        };
        let low4 = _mm512_set1_epi32(0x0F0F_0F0F);
        let (m, mh) = (0x3333_3333_3333_3333, 0xCCCC_CCCC_CCCC_CCCCu64 as i64);
        let h = _mm512_and_si512(h, _mm512_setr_epi64(m, m, m, m, mh, mh, mh, mh));
        let lo_pairs = _mm512_sllv_epi64(h, _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2));
        let hi_pairs = _mm512_srlv_epi64(h, _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2));
        [
            _mm512_ternarylogic_epi32::<0xE4>(a, lo_pairs, low4),
            _mm512_ternarylogic_epi32::<0xE4>(_mm512_srli_epi64::<4>(a), hi_pairs, low4),
        ]
    }

    /// The 256 activations at `x` in the order `q6_k` reads its levels: per 64 columns (group
    /// g), four vectors k = 0..4 with lane j holding column `64g + 4j + k` (byte k of level
    /// dword j), stored to `out`; done once per block and shared by the tile's rows.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn q6_x_order(x: *const f32, out: &mut [f32; 256]) {
        // SAFETY: the caller vouches for 256 readable f32 at `x`; `out` holds 256.
        unsafe {
            for g in 0..4 {
                let v: [__m512; 4] = std::array::from_fn(|m| load_x(x.add(64 * g + 16 * m)));
                for k in 0..4 {
                    let idx = _mm512_add_epi32(
                        _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28),
                        _mm512_set1_epi32(k as i32),
                    );
                    let lo = _mm512_permutex2var_ps(v[0], idx, v[1]);
                    let p = _mm512_mask_blend_ps(0xFF00, lo, _mm512_permutex2var_ps(v[2], idx, v[3]));
                    _mm512_storeu_ps(out.as_mut_ptr().add(64 * g + 16 * k), p);
                }
            }
        }
    }

    /// Q6_K block at `b` against 256 f32 at `x` (reordered by `q6_x_order`): the levels built 64
    /// at a time by `q6_levels` (one group of 64 columns), byte k of every dword taken by a
    /// shift and a mask and converted, `q · x` summed over the group's four vectors, then
    /// scaled once by the lanes' sub-block scales (lane j: sub-block `4g + j / 4`); the offset
    /// 32 factored out against `xsum16` (see `xsum16`).
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn q6_k(b: *const u8, x: *const f32, xsum16: __m512, acc: &mut Acc) {
        // SAFETY: the caller vouches for one 210-byte block at `b` and 256 f32 at `x`; every
        // offset below stays inside them.
        unsafe {
            let sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(b.add(192) as *const __m128i)));
            let sc = _mm512_mul_ps(half_splat(b.add(208)), sc);
            // The offset 32 factored out: minus 32 * scale_i * (sum of x over sub-block i).
            acc[1] = _mm512_fnmadd_ps(_mm512_mul_ps(sc, _mm512_set1_ps(32.0)), xsum16, acc[1]);
            let low6 = _mm512_set1_epi32(0x3F);
            let quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
            for half in 0..2 {
                let v = q6_levels(b.add(64 * half), b.add(128 + 32 * half));
                for (h, v) in v.into_iter().enumerate() {
                    let g = 2 * half + h;
                    let at = x.add(64 * g);
                    let q = [
                        _mm512_and_si512(v, low6),
                        _mm512_and_si512(_mm512_srli_epi32::<8>(v), low6),
                        _mm512_and_si512(_mm512_srli_epi32::<16>(v), low6),
                        _mm512_srli_epi32::<24>(v),
                    ];
                    let mut dot = _mm512_mul_ps(_mm512_cvtepi32_ps(q[0]), load_x(at));
                    for (k, &q) in q.iter().enumerate().skip(1) {
                        dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), load_x(at.add(16 * k)), dot);
                    }
                    let s =
                        _mm512_permutexvar_ps(_mm512_add_epi32(quarter, _mm512_set1_epi32(4 * g as i32)), sc);
                    acc[h] = _mm512_fmadd_ps(s, dot, acc[h]);
                }
            }
        }
    }

    /// One block of type `Q` at `b` against its activations at `x`.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn block<const Q: u8>(b: *const u8, x: *const f32, xsum16: __m512, acc: &mut Acc) {
        // SAFETY: forwarded from the caller (one whole block, its activations, the CPU features
        // of this module, checked by the only caller, `fused_rows`).
        unsafe {
            match Q {
                Q8_0 => q8_0(b, x, acc),
                Q4_0 => q4_0(b, x, acc),
                MXFP4 => mxfp4(b, x, acc),
                Q5_0 => q5::<false>(b, x, acc),
                Q5_1 => q5::<true>(b, x, acc),
                IQ4_NL => iq4_nl(b, x, acc),
                Q4_K => q4_k(b, x, xsum16, acc),
                Q5_K => q5_k(b, x, xsum16, acc),
                _ => q6_k(b, x, xsum16, acc),
            }
        }
    }

    /// `out[r] = dot(row r, x)` for `R` quantised rows of `cols` values (whole blocks of `Q`),
    /// block by block across the rows, prefetching the next row block's lines as it goes.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn fused_rows<const Q: u8, const R: usize>(
        dtype: WeightDType,
        rows: &[*const u8],
        prefetch_rows: *const *const u8,
        x: *const f32,
        cols: usize,
        out: &mut [f32],
    ) {
        let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
        // SAFETY: `rows` holds R pointers, a non-null `prefetch_rows` R more (the caller's contract).
        let (rows, next) = unsafe { tile_rows::<R>(rows, prefetch_rows) };
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        let mut x_order = [0.0f32; 256];
        let mut prefetched = 0;
        for blk in 0..cols / be {
            // K-quants: the block's activations summed per 16, shared by the R rows.
            // SAFETY: block `blk`'s `be` (256) activations lie inside `x`.
            let k_quant = matches!(Q, Q4_K | Q5_K | Q6_K);
            let xs = if k_quant { unsafe { xsum16(x.add(blk * be)) } } else { _mm512_setzero_ps() };
            let xb = if Q == Q6_K {
                // SAFETY: as above; Q6_K reads its activations reordered (see `q6_x_order`).
                unsafe { q6_x_order(x.add(blk * be), &mut x_order) };
                x_order.as_ptr()
            } else {
                x.wrapping_add(blk * be)
            };
            for r in 0..R {
                // SAFETY: block `blk` lies inside row r (`cols` whole blocks) and its `be`
                // activations at `xb`; the CPU features are this function's.
                unsafe { block::<Q>(rows[r].add(blk * bb), xb, xs, &mut acc[r]) };
            }
            if let Some(next) = &next {
                prefetch_rows_through(next, &mut prefetched, (blk + 1) * bb);
            }
        }
        for r in 0..R {
            out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
        }
    }

    /// The fused one-token tile for 8 or 1 rows (`out[r] = dot(row r, x)`), or false (nothing
    /// done) for any other row count.
    ///
    /// # Safety
    /// The CPU must support AVX-512F, AVX2, FMA and F16C; every `rows[r]` must address
    /// `dtype.row_bytes(cols)` readable bytes (`cols` whole blocks of the quantised `dtype`),
    /// `x` `cols` f32; `out` must hold `rows.len()` values; `prefetch_rows` null or
    /// `rows.len()` pointers (hints only, never dereferenced).
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(crate) unsafe fn decode_tile(
        dtype: WeightDType,
        rows: &[*const u8],
        prefetch_rows: *const *const u8,
        x: *const f32,
        cols: usize,
        out: &mut [f32],
    ) -> bool {
        dispatch_decode_tile!(fused_rows, dtype, rows, prefetch_rows, x, cols, out)
    }
}

/// AVX2 fused decode tiles (8 lanes): values converted to f32 in registers; Q4_K/Q5_K
/// dequantised there with one FMA (`scale * q - min`), the others with the (sub-)block scale
/// applied once to the integer values' dot product.
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use crate::weights::WeightDType;

    use super::{prefetch_rows_through, tile_rows, IQ4_NL, MXFP4, Q4_0, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0};

    /// Two accumulators per row (see the AVX-512 tile).
    type Acc = [__m256; 2];

    /// 8 bytes at `p` zero-extended to 8 i32 lanes.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_u8(p: *const u8) -> __m256i {
        // SAFETY: the caller vouches for 8 readable bytes at `p`; loadl tolerates any alignment.
        _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(p as *const __m128i) })
    }

    /// 8 bytes at `p` sign-extended to 8 f32 lanes.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_i8_f32(p: *const u8) -> __m256 {
        // SAFETY: the caller vouches for 8 readable bytes at `p`.
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(unsafe { _mm_loadl_epi64(p as *const __m128i) }))
    }

    /// 8 f32 at `p`.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn load_x(p: *const f32) -> __m256 {
        // SAFETY: the caller vouches for 8 readable f32 at `p`.
        unsafe { _mm256_loadu_ps(p) }
    }

    /// The f16 at `p` widened (exactly) and broadcast to 8 lanes.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn half_splat(p: *const u8) -> __m256 {
        // SAFETY: the caller vouches for two readable bytes at `p`.
        let bits = unsafe { (p as *const u16).read_unaligned() };
        _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// Q8_0 block at `b` against 32 f32 at `x`: `acc += d * (q · x)`.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_0(b: *const u8, x: *const f32, acc: &mut Acc) {
        // SAFETY: the caller vouches for one 34-byte block at `b` and 32 f32 at `x`.
        unsafe {
            let mut dot = _mm256_mul_ps(load_i8_f32(b.add(2)), load_x(x));
            for i in 1..4 {
                dot = _mm256_fmadd_ps(load_i8_f32(b.add(2 + 8 * i)), load_x(x.add(8 * i)), dot);
            }
            acc[0] = _mm256_fmadd_ps(half_splat(b), dot, acc[0]);
        }
    }

    /// Q4_0 block at `b` against 32 f32 at `x`: `acc += d * ((q - 8) · x)`.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_0(b: *const u8, x: *const f32, acc: &mut Acc) {
        // SAFETY: the caller vouches for one 18-byte block at `b` and 32 f32 at `x`.
        unsafe {
            let (low4, eight) = (_mm256_set1_epi32(15), _mm256_set1_epi32(8));
            let mut dot = _mm256_setzero_ps();
            for h in 0..2 {
                let q = load_u8(b.add(2 + 8 * h));
                let lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(q, low4), eight));
                let hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32::<4>(q), eight));
                dot = _mm256_fmadd_ps(lo, load_x(x.add(8 * h)), dot);
                dot = _mm256_fmadd_ps(hi, load_x(x.add(16 + 8 * h)), dot);
            }
            acc[0] = _mm256_fmadd_ps(half_splat(b), dot, acc[0]);
        }
    }

    /// MXFP4 block at `b` against 32 f32 at `x`: `acc += e8m0_half(e) * (kvalues[q] · x)`, the
    /// doubled E2M1 integers looked up with `pshufb`.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn mxfp4(b: *const u8, x: *const f32, acc: &mut Acc) {
        // SAFETY: the caller vouches for one 17-byte block at `b` and 32 f32 at `x`.
        unsafe {
            let (lo, hi) = crate::x86_quant::mxfp4_levels(b.add(1));
            let f = |v: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
            let mut dot = _mm256_mul_ps(f(lo), load_x(x));
            dot = _mm256_fmadd_ps(f(_mm_srli_si128::<8>(lo)), load_x(x.add(8)), dot);
            dot = _mm256_fmadd_ps(f(hi), load_x(x.add(16)), dot);
            dot = _mm256_fmadd_ps(f(_mm_srli_si128::<8>(hi)), load_x(x.add(24)), dot);
            acc[0] = _mm256_fmadd_ps(_mm256_set1_ps(crate::quant::e8m0_half(*b)), dot, acc[0]);
        }
    }

    /// `levels · x` over 32 values: `lo` the i8 (or, `SIGNED` false, u8) levels of values 0..16,
    /// `hi` of 16..32.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn levels_dot<const SIGNED: bool>(lo: __m128i, hi: __m128i, x: *const f32) -> __m256 {
        let f = |v: __m128i| {
            _mm256_cvtepi32_ps(if SIGNED { _mm256_cvtepi8_epi32(v) } else { _mm256_cvtepu8_epi32(v) })
        };
        // SAFETY: the caller vouches for 32 f32 at `x`.
        unsafe {
            let mut dot = _mm256_mul_ps(f(lo), load_x(x));
            dot = _mm256_fmadd_ps(f(_mm_srli_si128::<8>(lo)), load_x(x.add(8)), dot);
            dot = _mm256_fmadd_ps(f(hi), load_x(x.add(16)), dot);
            _mm256_fmadd_ps(f(_mm_srli_si128::<8>(hi)), load_x(x.add(24)), dot)
        }
    }

    /// Q5_0 block at `b` against 32 f32 at `x`: `acc += d * ((q - 16) · x)`; Q5_1 (`MIN`):
    /// `acc += d * (q · x) + m * sum(x)`.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q5<const MIN: bool>(b: *const u8, x: *const f32, acc: &mut Acc) {
        // SAFETY: the caller vouches for one 22- or 24-byte block at `b` and 32 f32 at `x`.
        unsafe {
            let (lo, hi) = crate::x86_quant::q5_levels(b.add(if MIN { 4 } else { 2 }));
            if MIN {
                let dot = levels_dot::<false>(lo, hi, x);
                let xs = _mm256_add_ps(
                    _mm256_add_ps(load_x(x), load_x(x.add(8))),
                    _mm256_add_ps(load_x(x.add(16)), load_x(x.add(24))),
                );
                acc[0] = _mm256_fmadd_ps(half_splat(b), dot, acc[0]);
                acc[1] = _mm256_fmadd_ps(half_splat(b.add(2)), xs, acc[1]);
            } else {
                let sixteen = _mm_set1_epi8(16);
                let dot = levels_dot::<true>(_mm_sub_epi8(lo, sixteen), _mm_sub_epi8(hi, sixteen), x);
                acc[0] = _mm256_fmadd_ps(half_splat(b), dot, acc[0]);
            }
        }
    }

    /// IQ4_NL block at `b` against 32 f32 at `x`: `acc += d * (kvalues[q] · x)`, the levels
    /// looked up with `pshufb`.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn iq4_nl(b: *const u8, x: *const f32, acc: &mut Acc) {
        // SAFETY: the caller vouches for one 18-byte block at `b` and 32 f32 at `x`.
        unsafe {
            let (lo, hi) = crate::x86_quant::table_levels(&crate::quant::IQ4_NL_VALUES, b.add(2));
            acc[0] = _mm256_fmadd_ps(half_splat(b), levels_dot::<true>(lo, hi, x), acc[0]);
        }
    }

    /// The 8 scales (`d * sc`, entries 0..8) and 8 mins (`dmin * m`, 8..16) of a Q4_K/Q5_K
    /// block at `b`.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn k_coefficients(b: *const u8) -> [f32; 16] {
        let mut out = [0.0f32; 16];
        // SAFETY: the caller vouches for a whole K-quant block at `b` (16 header bytes).
        unsafe {
            let (sc, m) = crate::x86_quant::k_scales_mins(&*(b.add(4) as *const [u8; 12]));
            _mm256_storeu_ps(
                out.as_mut_ptr(),
                _mm256_mul_ps(half_splat(b), _mm256_cvtepi32_ps(load_u8(sc.as_ptr()))),
            );
            let min = _mm256_mul_ps(half_splat(b.add(2)), _mm256_cvtepi32_ps(load_u8(m.as_ptr())));
            _mm256_storeu_ps(out.as_mut_ptr().add(8), min);
        }
        out
    }

    /// Q4_K (`FIFTH` false) or Q5_K block at `b` against 256 f32 at `x`: every value
    /// `scale * q - min` in one FMA, then multiplied into the accumulators.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn k_asym<const FIFTH: bool>(b: *const u8, x: *const f32, acc: &mut Acc) {
        // SAFETY: the caller vouches for one whole block at `b` (144 or 176 bytes) and 256 f32
        // at `x`; every offset below stays inside them.
        unsafe {
            let c = k_coefficients(b);
            let (low4, bit4) = (_mm256_set1_epi32(15), _mm256_set1_epi32(16));
            let qs = b.add(if FIFTH { 48 } else { 16 });
            for p in 0..4 {
                let (s_lo, m_lo) = (_mm256_set1_ps(c[2 * p]), _mm256_set1_ps(c[8 + 2 * p]));
                let (s_hi, m_hi) = (_mm256_set1_ps(c[2 * p + 1]), _mm256_set1_ps(c[9 + 2 * p]));
                for h in 0..4 {
                    let q = load_u8(qs.add(32 * p + 8 * h));
                    let (mut lo, mut hi) = (_mm256_and_si256(q, low4), _mm256_srli_epi32::<4>(q));
                    if FIFTH {
                        let f = load_u8(b.add(16 + 8 * h));
                        let shift = |j: i32| {
                            _mm256_and_si256(
                                _mm256_srl_epi32(_mm256_slli_epi32::<4>(f), _mm_cvtsi32_si128(j)),
                                bit4,
                            )
                        };
                        lo = _mm256_or_si256(lo, shift(2 * p as i32));
                        hi = _mm256_or_si256(hi, shift(2 * p as i32 + 1));
                    }
                    let lo = _mm256_fmsub_ps(s_lo, _mm256_cvtepi32_ps(lo), m_lo);
                    let hi = _mm256_fmsub_ps(s_hi, _mm256_cvtepi32_ps(hi), m_hi);
                    acc[0] = _mm256_fmadd_ps(lo, load_x(x.add(64 * p + 8 * h)), acc[0]);
                    acc[1] = _mm256_fmadd_ps(hi, load_x(x.add(64 * p + 32 + 8 * h)), acc[1]);
                }
            }
        }
    }

    /// Q6_K block at `b` against 256 f32 at `x`: `acc += (d * sc) * ((q - 32) · x)` per
    /// sub-block of 16 (two vectors).
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q6_k(b: *const u8, x: *const f32, acc: &mut Acc) {
        let mut scale = [0.0f32; 16];
        // SAFETY: the caller vouches for one 210-byte block at `b` and 256 f32 at `x`; every
        // offset below stays inside them.
        unsafe {
            let d = half_splat(b.add(208));
            _mm256_storeu_ps(scale.as_mut_ptr(), _mm256_mul_ps(d, load_i8_f32(b.add(192))));
            _mm256_storeu_ps(scale.as_mut_ptr().add(8), _mm256_mul_ps(d, load_i8_f32(b.add(200))));
            let (low4, high2, offset) =
                (_mm256_set1_epi32(15), _mm256_set1_epi32(0x30), _mm256_set1_epi32(32));
            for half in 0..2 {
                let (ql, qh) = (b.add(64 * half), b.add(128 + 32 * half));
                for g in 0..2 {
                    let mut dot = [_mm256_setzero_ps(); 4];
                    for k in 0..2 {
                        let l = 16 * g + 8 * k;
                        let (a, c, h) = (load_u8(ql.add(l)), load_u8(ql.add(32 + l)), load_u8(qh.add(l)));
                        let low = [
                            _mm256_and_si256(a, low4),
                            _mm256_and_si256(c, low4),
                            _mm256_srli_epi32::<4>(a),
                            _mm256_srli_epi32::<4>(c),
                        ];
                        let high = [
                            _mm256_slli_epi32::<4>(h),
                            _mm256_slli_epi32::<2>(h),
                            h,
                            _mm256_srli_epi32::<2>(h),
                        ];
                        for quarter in 0..4 {
                            let v = _mm256_or_si256(low[quarter], _mm256_and_si256(high[quarter], high2));
                            let q = _mm256_cvtepi32_ps(_mm256_sub_epi32(v, offset));
                            dot[quarter] = _mm256_fmadd_ps(
                                q,
                                load_x(x.add(128 * half + 32 * quarter + l)),
                                dot[quarter],
                            );
                        }
                    }
                    for (quarter, dot) in dot.into_iter().enumerate() {
                        let s = _mm256_set1_ps(scale[8 * half + 2 * quarter + g]);
                        acc[quarter & 1] = _mm256_fmadd_ps(s, dot, acc[quarter & 1]);
                    }
                }
            }
        }
    }

    /// One block of type `Q` at `b` against its activations at `x`.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block<const Q: u8>(b: *const u8, x: *const f32, acc: &mut Acc) {
        // SAFETY: forwarded from the caller (one whole block and its activations).
        unsafe {
            match Q {
                Q8_0 => q8_0(b, x, acc),
                Q4_0 => q4_0(b, x, acc),
                MXFP4 => mxfp4(b, x, acc),
                Q5_0 => q5::<false>(b, x, acc),
                Q5_1 => q5::<true>(b, x, acc),
                IQ4_NL => iq4_nl(b, x, acc),
                Q4_K => k_asym::<false>(b, x, acc),
                Q5_K => k_asym::<true>(b, x, acc),
                _ => q6_k(b, x, acc),
            }
        }
    }

    /// As the AVX-512 `fused_rows`, over 8 lanes.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn fused_rows<const Q: u8, const R: usize>(
        dtype: WeightDType,
        rows: &[*const u8],
        prefetch_rows: *const *const u8,
        x: *const f32,
        cols: usize,
        out: &mut [f32],
    ) {
        let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
        // SAFETY: `rows` holds R pointers, a non-null `prefetch_rows` R more (the caller's contract).
        let (rows, next) = unsafe { tile_rows::<R>(rows, prefetch_rows) };
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let mut prefetched = 0;
        for blk in 0..cols / be {
            for r in 0..R {
                // SAFETY: block `blk` lies inside row r (`cols` whole blocks) and its `be`
                // activations inside `x`; the CPU features are this function's.
                unsafe { block::<Q>(rows[r].add(blk * bb), x.add(blk * be), &mut acc[r]) };
            }
            if let Some(next) = &next {
                prefetch_rows_through(next, &mut prefetched, (blk + 1) * bb);
            }
        }
        for r in 0..R {
            out[r] = crate::x86_avx2::horizontal_sum(_mm256_add_ps(acc[r][0], acc[r][1]));
        }
    }

    /// The fused one-token tile for 8 or 1 rows, or false (nothing done) for any other row
    /// count; as the AVX-512 `decode_tile`.
    ///
    /// # Safety
    /// As the AVX-512 `decode_tile`, with AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn decode_tile(
        dtype: WeightDType,
        rows: &[*const u8],
        prefetch_rows: *const *const u8,
        x: *const f32,
        cols: usize,
        out: &mut [f32],
    ) -> bool {
        dispatch_decode_tile!(fused_rows, dtype, rows, prefetch_rows, x, cols, out)
    }
}
