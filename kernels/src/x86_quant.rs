//! SIMD dequantisation of GGML blocks for the AVX2 and AVX-512 levels, bit-identical to the
//! scalar [`crate::quant::dequantize_block`]: the same integer values, the same f32 products
//! in the same order (`scale * q - min` as a multiply then a subtract, never an FMA), and f16
//! scales widened exactly by `vcvtph2ps` (a NaN scale gives a NaN, as in the scalar code).
//!
//! One body ([`dequant_bodies`]) is compiled twice, over each level's lane helpers (16 lanes of
//! `__m512` or 8 of `__m256`); every function here needs the level's CPU features and pointers
//! covering whole blocks.

/// The 6-bit scales (`.0`) and mins (`.1`) of the 8 sub-blocks of a Q4_K/Q5_K block from its 12
/// packed bytes, with a few 32-bit word operations (as llama.cpp unpacks them).
#[inline(always)]
pub(crate) fn k_scales_mins(packed: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let word = |i: usize| {
        u32::from_le_bytes([packed[4 * i], packed[4 * i + 1], packed[4 * i + 2], packed[4 * i + 3]])
    };
    let (w0, w1, w2) = (word(0), word(1), word(2));
    let scales_hi = (w2 & LOW4) | (((w0 >> 6) & LOW2) << 4);
    let mins_hi = ((w2 >> 4) & LOW4) | (((w1 >> 6) & LOW2) << 4);
    let bytes = |lo: u32, hi: u32| {
        let (l, h) = (lo.to_le_bytes(), hi.to_le_bytes());
        [l[0], l[1], l[2], l[3], h[0], h[1], h[2], h[3]]
    };
    (bytes(w0 & LOW6, scales_hi), bytes(w1 & LOW6, mins_hi))
}

/// [`k_scales_mins`] in one SSE register: bytes 0..8 the 6-bit scales, bytes 8..16 the mins of
/// the 8 sub-blocks, from the 12 packed bytes at `p` (the same word operations, lane-parallel:
/// lanes [w0 & 63, (w2 & 15) | w0 top bits, w1 & 63, (w2 >> 4) | w1 top bits]).
///
/// # Safety
/// The CPU must support AVX2; `p` must address 16 readable bytes (the 12 packed bytes of a
/// K-quant block and 4 of the block's quants after them).
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn k_scales_mins_vec(p: *const u8) -> std::arch::x86_64::__m128i {
    use std::arch::x86_64::*;
    const LOW6: i32 = 0x3f3f_3f3f;
    const LOW4: i32 = 0x0f0f_0f0f;
    const TOP2: i32 = 0x3030_3030;
    // SAFETY: the caller vouches for 16 readable bytes at `p`; loadu tolerates any alignment.
    let w = unsafe { _mm_loadu_si128(p as *const __m128i) };
    // [w0, w2, w1, w2 >> 4] and [w0, w0, w1, w1] >> 2 (bits 6..8 of every byte down to 4..6).
    let low = _mm_srlv_epi32(_mm_shuffle_epi32::<0b10_01_10_00>(w), _mm_setr_epi32(0, 0, 0, 4));
    let top = _mm_srli_epi32::<2>(_mm_shuffle_epi32::<0b01_01_00_00>(w));
    _mm_or_si128(
        _mm_and_si128(low, _mm_setr_epi32(LOW6, LOW4, LOW6, LOW4)),
        _mm_and_si128(top, _mm_setr_epi32(0, TOP2, 0, TOP2)),
    )
}

/// The 32 signed levels `table[nibble]` of 16 nibble bytes at `qs` (values 0..16 from the low
/// nibbles in `.0`, 16..32 from the high ones in `.1`): one `pshufb` table lookup per half.
///
/// # Safety
/// The CPU must support AVX2 (SSSE3's `pshufb`); `qs` must address 16 readable bytes.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn table_levels(
    table: &[i8; 16],
    qs: *const u8,
) -> (std::arch::x86_64::__m128i, std::arch::x86_64::__m128i) {
    use std::arch::x86_64::*;
    // SAFETY: the table is 16 bytes; the caller vouches for 16 readable bytes at `qs`.
    unsafe {
        let table = _mm_loadu_si128(table.as_ptr() as *const __m128i);
        let q = _mm_loadu_si128(qs as *const __m128i);
        let low4 = _mm_set1_epi8(15);
        let lo = _mm_shuffle_epi8(table, _mm_and_si128(q, low4));
        let hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16::<4>(q), low4));
        (lo, hi)
    }
}

/// The 32 doubled E2M1 values (i8, [`crate::quant::MXFP4_VALUES`]) of the MXFP4 nibble bytes at
/// `qs` (16 bytes: values 0..16 from the low nibbles, 16..32 from the high ones).
///
/// # Safety
/// The CPU must support AVX2; `qs` must address 16 readable bytes.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn mxfp4_levels(qs: *const u8) -> (std::arch::x86_64::__m128i, std::arch::x86_64::__m128i) {
    // SAFETY: forwarded from the caller.
    unsafe { table_levels(&crate::quant::MXFP4_VALUES, qs) }
}

/// The 32 five-bit levels (u8, 0..32) of a Q5_0/Q5_1 block from its `qh` word and nibble bytes
/// at `p` (20 bytes: `qh` then 16 nibble bytes), values 0..16 in `.0`, 16..32 in `.1`: each
/// 16 bits of `qh` spread to a byte each (a byte shuffle, a bit test) as the nibbles' bit 4.
///
/// # Safety
/// The CPU must support AVX2; `p` must address 20 readable bytes.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn q5_levels(p: *const u8) -> (std::arch::x86_64::__m128i, std::arch::x86_64::__m128i) {
    use std::arch::x86_64::*;
    // SAFETY: the caller vouches for 20 readable bytes at `p`; loads tolerate any alignment.
    unsafe {
        let qh = (p as *const u32).read_unaligned();
        let q = _mm_loadu_si128(p.add(4) as *const __m128i);
        let bits = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
        let spread = |half: u32| {
            let bytes = _mm_shuffle_epi8(
                _mm_cvtsi32_si128(half as i32),
                _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
            );
            _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(bytes, bits), bits), _mm_set1_epi8(16))
        };
        let low4 = _mm_set1_epi8(15);
        let lo = _mm_or_si128(_mm_and_si128(q, low4), spread(qh & 0xFFFF));
        let hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16::<4>(q), low4), spread(qh >> 16));
        (lo, hi)
    }
}

/// The level-independent dequantisation bodies, written against the lane helpers of the module
/// that expands them: `LANES`, `F`, `I`, `half_splat(p)`, `splat(f32)`, `load_u8(p)`, `load_i8(p)`,
/// `and_i(I, i32)`, `srl_i(I, u32)`, `sll_i`, `or_i`, `sub_i32(I, i32)`, `to_f32(I)`, `mul`, `sub`, `add`,
/// `store(p, F)`, `scales8(bytes: *const u8, d: f32, out: *mut f32)` (8 u8 times d) and
/// `scales16_i8` (16 i8 times d).
macro_rules! dequant_bodies {
    ($features:literal) => {
        /// Q8_0 block at `b` into 32 f32 at `out`.
        // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
        // level) and the pointers cover the block, lanes or rows this function reads and writes.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn q8_0(b: *const u8, out: *mut f32) {
            // SAFETY: the caller vouches for one 34-byte block at `b` and 32 f32 at `out`.
            unsafe {
                let d = half_splat(b);
                for i in (0..32).step_by(LANES) {
                    store(out.add(i), mul(d, to_f32(load_i8(b.add(2 + i)))));
                }
            }
        }

        /// Q4_0 block at `b` into 32 f32 at `out` (low nibbles first, minus 8).
        // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
        // level) and the pointers cover the block, lanes or rows this function reads and writes.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn q4_0(b: *const u8, out: *mut f32) {
            // SAFETY: the caller vouches for one 18-byte block at `b` and 32 f32 at `out`.
            unsafe {
                let d = half_splat(b);
                for i in (0..16).step_by(LANES) {
                    let q = load_u8(b.add(2 + i));
                    store(out.add(i), mul(d, to_f32(sub_i32(and_i(q, 15), 8))));
                    store(out.add(16 + i), mul(d, to_f32(sub_i32(srl_i(q, 4), 8))));
                }
            }
        }

        /// MXFP4 block at `b` into 32 f32 at `out`: the doubled E2M1 values (a table lookup)
        /// times `e8m0_half(e)`, the scalar decoder's one product per value.
        // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
        // level) and the pointers cover the block, lanes or rows this function reads and writes.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn mxfp4(b: *const u8, out: *mut f32) {
            // SAFETY: the caller vouches for one 17-byte block at `b` and 32 f32 at `out`.
            unsafe {
                let d = splat(crate::quant::e8m0_half(*b));
                let (lo, hi) = crate::x86_quant::mxfp4_levels(b.add(1));
                let mut levels = [0i8; 32];
                std::arch::x86_64::_mm_storeu_si128(levels.as_mut_ptr() as *mut _, lo);
                std::arch::x86_64::_mm_storeu_si128(levels.as_mut_ptr().add(16) as *mut _, hi);
                for i in (0..32).step_by(LANES) {
                    store(out.add(i), mul(to_f32(load_i8(levels.as_ptr().add(i) as *const u8)), d));
                }
            }
        }

        /// Q5_0 (`MIN` false: `d * (q - 16)`) or Q5_1 (`d * q + m`) block at `b` into 32 f32
        /// at `out`, the scalar decoder's products (and sum) per value.
        // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
        // level) and the pointers cover the block, lanes or rows this function reads and writes.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn q5<const MIN: bool>(b: *const u8, out: *mut f32) {
            // SAFETY: the caller vouches for one 22- (Q5_0) or 24-byte (Q5_1) block at `b` and
            // 32 f32 at `out`.
            unsafe {
                let d = half_splat(b);
                let (lo, hi) = crate::x86_quant::q5_levels(b.add(if MIN { 4 } else { 2 }));
                let mut levels = [0u8; 32];
                std::arch::x86_64::_mm_storeu_si128(levels.as_mut_ptr() as *mut _, lo);
                std::arch::x86_64::_mm_storeu_si128(levels.as_mut_ptr().add(16) as *mut _, hi);
                for i in (0..32).step_by(LANES) {
                    let q = load_u8(levels.as_ptr().add(i));
                    if MIN {
                        store(out.add(i), add(mul(to_f32(q), d), half_splat(b.add(2))));
                    } else {
                        store(out.add(i), mul(to_f32(sub_i32(q, 16)), d));
                    }
                }
            }
        }

        /// IQ4_NL block at `b` into 32 f32 at `out`: `d * kvalues[nibble]` (a table lookup).
        // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
        // level) and the pointers cover the block, lanes or rows this function reads and writes.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn iq4_nl(b: *const u8, out: *mut f32) {
            // SAFETY: the caller vouches for one 18-byte block at `b` and 32 f32 at `out`.
            unsafe {
                let d = half_splat(b);
                let (lo, hi) = crate::x86_quant::table_levels(&crate::quant::IQ4_NL_VALUES, b.add(2));
                let mut levels = [0i8; 32];
                std::arch::x86_64::_mm_storeu_si128(levels.as_mut_ptr() as *mut _, lo);
                std::arch::x86_64::_mm_storeu_si128(levels.as_mut_ptr().add(16) as *mut _, hi);
                for i in (0..32).step_by(LANES) {
                    store(out.add(i), mul(d, to_f32(load_i8(levels.as_ptr().add(i) as *const u8))));
                }
            }
        }

        /// Q4_K (`FIFTH` false) or Q5_K block at `b` into 256 f32 at `out`.
        // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
        // level) and the pointers cover the block, lanes or rows this function reads and writes.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn k_asym<const FIFTH: bool>(b: *const u8, out: *mut f32) {
            let (mut scale, mut min) = ([0.0f32; 8], [0.0f32; 8]);
            // SAFETY: the caller vouches for one whole block at `b` (144 or 176 bytes) and 256
            // f32 at `out`; every offset below stays inside them.
            unsafe {
                let packed = &*(b.add(4) as *const [u8; 12]);
                let (sc, m) = crate::x86_quant::k_scales_mins(packed);
                scales8(
                    sc.as_ptr(),
                    crate::quant::half_at(std::slice::from_raw_parts(b, 2), 0),
                    scale.as_mut_ptr(),
                );
                scales8(
                    m.as_ptr(),
                    crate::quant::half_at(std::slice::from_raw_parts(b.add(2), 2), 0),
                    min.as_mut_ptr(),
                );
                let qs = b.add(if FIFTH { 48 } else { 16 });
                for pair in 0..4 {
                    let (s0, m0) = (splat(scale[2 * pair]), splat(min[2 * pair]));
                    let (s1, m1) = (splat(scale[2 * pair + 1]), splat(min[2 * pair + 1]));
                    for l in (0..32).step_by(LANES) {
                        let q = load_u8(qs.add(32 * pair + l));
                        let (mut lo, mut hi) = (and_i(q, 15), srl_i(q, 4));
                        if FIFTH {
                            let h = load_u8(b.add(16 + l));
                            lo = or_i(lo, and_i(sll_i(srl_i(h, 2 * pair as u32), 4), 16));
                            hi = or_i(hi, and_i(sll_i(srl_i(h, 2 * pair as u32 + 1), 4), 16));
                        }
                        store(out.add(64 * pair + l), sub(mul(s0, to_f32(lo)), m0));
                        store(out.add(64 * pair + 32 + l), sub(mul(s1, to_f32(hi)), m1));
                    }
                }
            }
        }

        /// Q6_K block at `b` into 256 f32 at `out`: `(d * sc) * (q - 32)`.
        // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
        // level) and the pointers cover the block, lanes or rows this function reads and writes.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn q6_k(b: *const u8, out: *mut f32) {
            let mut scale = [0.0f32; 16];
            // SAFETY: the caller vouches for one 210-byte block at `b` and 256 f32 at `out`;
            // every offset below stays inside them.
            unsafe {
                let d = crate::quant::half_at(std::slice::from_raw_parts(b.add(208), 2), 0);
                scales16_i8(b.add(192), d, scale.as_mut_ptr());
                for half in 0..2 {
                    let (ql, qh) = (b.add(64 * half), b.add(128 + 32 * half));
                    for l in (0..32).step_by(LANES) {
                        let h = load_u8(qh.add(l));
                        let (a, c) = (load_u8(ql.add(l)), load_u8(ql.add(l + 32)));
                        let q = [and_i(a, 15), and_i(c, 15), srl_i(a, 4), srl_i(c, 4)];
                        for (quarter, low) in q.into_iter().enumerate() {
                            let high = sll_i(and_i(srl_i(h, 2 * quarter as u32), 3), 4);
                            let v = to_f32(sub_i32(or_i(low, high), 32));
                            let s = splat(scale[8 * half + 2 * quarter + l / 16]);
                            store(out.add(128 * half + 32 * quarter + l), mul(s, v));
                        }
                    }
                }
            }
        }

        /// Dequantises `n_blocks` consecutive blocks of `dtype` at `src` into `out`.
        ///
        /// # Safety
        /// The CPU must have this level's features; `src` must address `n_blocks` whole blocks
        /// and `out` `n_blocks * dtype.block_elems()` writable f32.
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn dequantize_blocks(
            dtype: WeightDType,
            src: *const u8,
            n_blocks: usize,
            out: *mut f32,
        ) {
            let (bb, be) = (dtype.block_bytes(), dtype.block_elems());
            for i in 0..n_blocks {
                let (block, y) = (src.wrapping_add(i * bb), out.wrapping_add(i * be));
                // SAFETY: block i lies inside the caller's `n_blocks` blocks and outputs.
                unsafe {
                    match dtype {
                        WeightDType::Q8_0 => q8_0(block, y),
                        WeightDType::Q4_0 => q4_0(block, y),
                        WeightDType::Q4_K => k_asym::<false>(block, y),
                        WeightDType::Q5_K => k_asym::<true>(block, y),
                        WeightDType::Q6_K => q6_k(block, y),
                        WeightDType::Mxfp4 => mxfp4(block, y),
                        WeightDType::Q5_0 => q5::<false>(block, y),
                        WeightDType::Q5_1 => q5::<true>(block, y),
                        WeightDType::Iq4Nl => iq4_nl(block, y),
                        float => unreachable!("dequantize_blocks called with float type {}", float.name()),
                    }
                }
            }
        }
    };
}

/// AVX-512F lane helpers (16 f32 lanes) and the dequantisation bodies over them.
pub(crate) mod avx512 {
    use std::arch::x86_64::*;

    use crate::weights::WeightDType;

    const LANES: usize = 16;
    type F = __m512;
    type I = __m512i;

    // SAFETY (all helpers): callers have AVX-512F/F16C (checked level) and pass pointers to at
    // least the bytes each load reads (16 bytes, 2 for `half_splat`) or the 16 f32 a store writes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn half_splat(p: *const u8) -> F {
        // SAFETY: two readable bytes at `p` (see above); read_unaligned tolerates any alignment.
        let bits = unsafe { (p as *const u16).read_unaligned() };
        _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn splat(v: f32) -> F {
        _mm512_set1_ps(v)
    }
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn load_u8(p: *const u8) -> I {
        // SAFETY: 16 readable bytes at `p` (see above).
        _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(p as *const __m128i) })
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn load_i8(p: *const u8) -> I {
        // SAFETY: 16 readable bytes at `p` (see above).
        _mm512_cvtepi8_epi32(unsafe { _mm_loadu_si128(p as *const __m128i) })
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn and_i(a: I, mask: i32) -> I {
        _mm512_and_si512(a, _mm512_set1_epi32(mask))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn srl_i(a: I, n: u32) -> I {
        _mm512_srl_epi32(a, _mm_cvtsi32_si128(n as i32))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn sll_i(a: I, n: u32) -> I {
        _mm512_sll_epi32(a, _mm_cvtsi32_si128(n as i32))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn or_i(a: I, b: I) -> I {
        _mm512_or_si512(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn sub_i32(a: I, v: i32) -> I {
        _mm512_sub_epi32(a, _mm512_set1_epi32(v))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn to_f32(a: I) -> F {
        _mm512_cvtepi32_ps(a)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn mul(a: F, b: F) -> F {
        _mm512_mul_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn sub(a: F, b: F) -> F {
        _mm512_sub_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn add(a: F, b: F) -> F {
        _mm512_add_ps(a, b)
    }
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn store(p: *mut f32, v: F) {
        // SAFETY: 16 writable f32 at `p` (see above).
        unsafe { _mm512_storeu_ps(p, v) }
    }
    /// `out[i] = d * bytes[i] as f32` for 8 u8.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn scales8(bytes: *const u8, d: f32, out: *mut f32) {
        // SAFETY: 8 readable bytes and 8 writable f32 (see above).
        unsafe {
            let q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(bytes as *const __m128i));
            _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(q)));
        }
    }
    /// `out[i] = d * bytes[i] as i8 as f32` for 16 i8.
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn scales16_i8(bytes: *const u8, d: f32, out: *mut f32) {
        // SAFETY: 16 readable bytes and 16 writable f32 (see above).
        unsafe { store(out, mul(splat(d), to_f32(load_i8(bytes)))) }
    }

    dequant_bodies!("avx512f,avx2,fma,f16c");
}

/// AVX2 lane helpers (8 f32 lanes) and the dequantisation bodies over them.
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use crate::weights::WeightDType;

    const LANES: usize = 8;
    type F = __m256;
    type I = __m256i;

    // SAFETY (all helpers): callers have AVX2/FMA/F16C (checked level) and pass pointers to at
    // least the bytes each load reads (8 bytes, 2 for `half_splat`) or the 8 f32 a store writes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn half_splat(p: *const u8) -> F {
        // SAFETY: two readable bytes at `p` (see above); read_unaligned tolerates any alignment.
        let bits = unsafe { (p as *const u16).read_unaligned() };
        _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn splat(v: f32) -> F {
        _mm256_set1_ps(v)
    }
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_u8(p: *const u8) -> I {
        // SAFETY: 8 readable bytes at `p` (see above).
        _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(p as *const __m128i) })
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_i8(p: *const u8) -> I {
        // SAFETY: 8 readable bytes at `p` (see above).
        _mm256_cvtepi8_epi32(unsafe { _mm_loadl_epi64(p as *const __m128i) })
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn and_i(a: I, mask: i32) -> I {
        _mm256_and_si256(a, _mm256_set1_epi32(mask))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn srl_i(a: I, n: u32) -> I {
        _mm256_srl_epi32(a, _mm_cvtsi32_si128(n as i32))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn sll_i(a: I, n: u32) -> I {
        _mm256_sll_epi32(a, _mm_cvtsi32_si128(n as i32))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn or_i(a: I, b: I) -> I {
        _mm256_or_si256(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn sub_i32(a: I, v: i32) -> I {
        _mm256_sub_epi32(a, _mm256_set1_epi32(v))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn to_f32(a: I) -> F {
        _mm256_cvtepi32_ps(a)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn mul(a: F, b: F) -> F {
        _mm256_mul_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn sub(a: F, b: F) -> F {
        _mm256_sub_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn add(a: F, b: F) -> F {
        _mm256_add_ps(a, b)
    }
    // SAFETY (callers): the CPU has the features named below (the caller checked the SIMD
    // level) and the pointers cover the block, lanes or rows this function reads and writes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn store(p: *mut f32, v: F) {
        // SAFETY: 8 writable f32 at `p` (see above).
        unsafe { _mm256_storeu_ps(p, v) }
    }
    /// `out[i] = d * bytes[i] as f32` for 8 u8.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales8(bytes: *const u8, d: f32, out: *mut f32) {
        // SAFETY: 8 readable bytes and 8 writable f32 (see above).
        unsafe { store(out, mul(splat(d), to_f32(load_u8(bytes)))) }
    }
    /// `out[i] = d * bytes[i] as i8 as f32` for 16 i8.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales16_i8(bytes: *const u8, d: f32, out: *mut f32) {
        // SAFETY: 16 readable bytes and 16 writable f32 (see above).
        unsafe {
            store(out, mul(splat(d), to_f32(load_i8(bytes))));
            store(out.add(8), mul(splat(d), to_f32(load_i8(bytes.add(8)))));
        }
    }

    dequant_bodies!("avx2,fma,f16c");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::WeightDType;
    use crate::SimdLevel;

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
    }

    /// Every SIMD level's dequantisation of `blocks` (whole blocks of `dtype`) against the
    /// scalar block decoder, bit for bit (a NaN scale gives a NaN either way).
    fn check_levels(dtype: WeightDType, blocks: &[u8], what: &str) {
        let n_blocks = blocks.len() / dtype.block_bytes();
        let mut want = vec![0.0f32; n_blocks * dtype.block_elems()];
        // SAFETY: `blocks` holds n_blocks whole blocks, `want` their values.
        unsafe {
            crate::quant::dequantize_blocks_scalar(dtype, blocks.as_ptr(), n_blocks, want.as_mut_ptr())
        };
        for level in crate::available() {
            let mut got = vec![f32::NAN; want.len()];
            // SAFETY: the level is supported (available); pointers as above.
            unsafe {
                match level {
                    SimdLevel::Avx2 => {
                        avx2::dequantize_blocks(dtype, blocks.as_ptr(), n_blocks, got.as_mut_ptr())
                    }
                    SimdLevel::Avx512 | SimdLevel::Avx512Bf16 | SimdLevel::Amx => {
                        avx512::dequantize_blocks(dtype, blocks.as_ptr(), n_blocks, got.as_mut_ptr())
                    }
                    SimdLevel::Scalar => continue,
                }
            }
            assert!(same_bits(&got, &want), "{level} {dtype:?} {what}");
        }
    }

    #[test]
    fn simd_dequantization_is_bit_equal_to_scalar_on_random_blocks() {
        let sizes = WeightDType::QUANTIZED.map(|dtype| 1 + 97 * dtype.block_bytes());
        let stream = crate::test_random_bytes(sizes.iter().sum());
        let mut at = 0;
        for (dtype, size) in WeightDType::QUANTIZED.into_iter().zip(sizes) {
            // Random bytes everywhere (scales include subnormals, infinities and NaNs), one byte
            // past the allocation start so every block is unaligned.
            let bytes = &stream[at..at + size];
            at += size;
            check_levels(dtype, &bytes[1..], "random blocks");
        }
    }

    #[test]
    fn simd_dequantization_is_bit_equal_to_scalar_on_gguf_py_fixtures() {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/quant");
        for dtype in WeightDType::QUANTIZED {
            let path = dir.join(format!("{}.blocks", dtype.name()));
            let blocks = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            check_levels(dtype, &blocks, "gguf-py fixture");
        }
    }

    #[test]
    fn packed_k_scales_unpack_like_the_scalar_decoder() {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..2000 {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let mut packed = [0u8; 12];
            packed.iter_mut().enumerate().for_each(|(i, p)| *p = (state >> (i * 5 % 57)) as u8);
            let (sc, m) = k_scales_mins(&packed);
            if crate::simd::SimdLevel::Avx2.is_supported() {
                let mut bytes = [0u8; 16];
                bytes[..12].copy_from_slice(&packed);
                // SAFETY: AVX2 was just checked; `bytes` holds the 16 bytes read.
                let v = unsafe { k_scales_mins_vec(bytes.as_ptr()) };
                // SAFETY: an __m128i is 16 plain bytes.
                let v: [u8; 16] = unsafe { std::mem::transmute(v) };
                assert_eq!((&v[..8], &v[8..]), (&sc[..], &m[..]), "{packed:?}");
            }
            for j in 0..8 {
                assert_eq!(
                    crate::quant::scale_min(j, &packed),
                    (sc[j] as f32, m[j] as f32),
                    "{packed:?} {j}"
                );
            }
        }
    }
}
