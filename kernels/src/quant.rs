//! GGML quantised weights in the kernels: block dequantisation and the quantised tile.
//!
//! Layouts (as GGUF stores them; `d`/`dmin` f16): Q8_0 `d` + 32 i8 (34 bytes / 32 values);
//! Q4_0 `d` + 16 nibble bytes, value j low / j+16 high, minus 8 (18 / 32); Q4_K `d`, `dmin`,
//! 12 bytes of 6-bit scales/mins, 128 nibble bytes (144 / 256); Q5_K as Q4_K with 32 bytes of
//! fifth bits before the nibbles (176 / 256); Q6_K 128 low-nibble bytes, 64 bytes of 2-bit
//! pairs, 16 i8 scales, `d` (210 / 256); MXFP4 one E8M0 scale byte `e` + 16 nibble bytes, value
//! j low / j+16 high, each nibble an E2M1 value looked up doubled in [`MXFP4_VALUES`] and scaled by
//! [`e8m0_half`]`(e)` (17 / 32); Q5_0 `d`, 4 bytes `qh` (a little-endian u32 whose bit j is
//! the fifth bit of value j), 16 nibble bytes as Q4_0, minus 16 (22 / 32); Q5_1 `d`, `m`, `qh`,
//! nibbles, `d * q + m` (24 / 32); IQ4_NL `d` + 16 nibble bytes as Q4_0, each nibble indexing
//! [`IQ4_NL_VALUES`] (18 / 32).
//!
//! The quantised tile dequantises up to 256 columns of each row of the tile into an f32 buffer
//! on the stack (L1) with the level's decoder (the AVX2/AVX-512 ones in `x86_quant.rs` are
//! bit-equal to [`dequantize_block`]), prefetching the same bytes of the next row block, and
//! runs the level's f32 tile kernel on it, adding the partial sums chunk by chunk: weights are
//! read from memory once, in their compressed size, and the multiply-adds run in f32 at the
//! level's vector width. (256 columns measured best: 128 and 512 were 10-25% slower for decode
//! on the 2-core AMD EPYC build VM.) Activations stay f32 (no 8-bit activation rounding), so
//! every level agrees with the scalar one within f32 summation-order rounding.
//!
//! One token (decode) on the AVX2/AVX-512 levels skips this tile: `x86_quant_tile.rs` decodes
//! blocks in registers and multiplies them into the accumulators directly (no L1 buffer), or,
//! with 8-bit activations on AVX-512 VNNI ([`crate::q8`]), dots the raw levels as integers.

use crate::weights::WeightDType;

/// The level's f32 tile kernel as [`tile`] calls it: `(rows, xs, cols, out)`.
pub(crate) type F32Tile<'a> = dyn FnMut(&[*const u8], &[*const f32], usize, &mut [f32]) + 'a;

/// Values of the largest block (a K-quant super-block).
pub const MAX_BLOCK_ELEMS: usize = 256;
/// Columns dequantised per chunk of the quantised tile.
const CHUNK_COLS: usize = 256;

/// The f16 at `b[at..at + 2]` widened to f32 (exact; plain bit arithmetic, which inlines into
/// the block loops where a library call per block dominated the dequantisation).
#[inline(always)]
pub(crate) fn half_at(b: &[u8], at: usize) -> f32 {
    let h = u16::from_le_bytes([b[at], b[at + 1]]) as u32;
    let (sign, exp, mant) = ((h & 0x8000) << 16, (h >> 10) & 0x1f, h & 0x3ff);
    match exp {
        0 => {
            let magnitude = mant as f32 * (1.0 / 16_777_216.0); // subnormal: mant * 2^-24
            f32::from_bits(sign | magnitude.to_bits())
        }
        31 => f32::from_bits(sign | 0x7f80_0000 | (mant << 13)),
        _ => f32::from_bits(sign | ((exp + 112) << 23) | (mant << 13)),
    }
}

/// The E2M1 values of MXFP4's nibbles, doubled (so they are integers), as llama.cpp's
/// `kvalues_mxfp4`: a block's value is `MXFP4_VALUES[nibble] * e8m0_half(e)`.
pub const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// llama.cpp's non-linear IQ4_NL levels (`kvalues_iq4nl`), indexed by a nibble: a value is
/// `d * IQ4_NL_VALUES[nibble]`.
pub const IQ4_NL_VALUES: [i8; 16] =
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// The 32 five-bit levels (0..32) of a Q5_0/Q5_1 block's `qh` word (at `b[0..4]`) and nibble
/// bytes (`b[4..20]`): value j is nibble j (low, j < 16; high nibble of byte j - 16 after) with
/// bit j of `qh` as its fifth bit.
#[inline(always)]
pub(crate) fn q5_levels(b: &[u8]) -> [u8; 32] {
    let qh = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let mut q = [0u8; 32];
    for j in 0..16 {
        let byte = b[4 + j];
        q[j] = (byte & 15) | ((((qh >> j) & 1) as u8) << 4);
        q[j + 16] = (byte >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
    }
    q
}

/// Half the E8M0 scale `2^(e - 127)`, i.e. `2^(e - 128)`, as llama.cpp's `ggml_e8m0_to_fp32_half`
/// (and gguf-py) compute it: subnormal bit patterns for `e < 2`, and no NaN for `e = 0xFF` (which
/// the MX spec reserves for NaN; llama.cpp's CPU code reads it as `2^127`, and so does moe-lanes
/// everywhere, so every engine agrees with llama.cpp and gguf-py on such a block).
#[inline(always)]
pub fn e8m0_half(e: u8) -> f32 {
    if e < 2 {
        f32::from_bits(0x0020_0000 << e)
    } else {
        f32::from_bits(((e as u32) - 1) << 23)
    }
}

/// Dequantises one block of `dtype` (`block.len() == dtype.block_bytes()`) into `out`
/// (`dtype.block_elems()` values).
///
/// # Panics
/// For a float type, or when the lengths do not match the type.
#[inline(always)]
pub fn dequantize_block(dtype: WeightDType, block: &[u8], out: &mut [f32]) {
    assert_eq!(block.len(), dtype.block_bytes(), "one {} block", dtype.name());
    assert_eq!(out.len(), dtype.block_elems(), "one {} block", dtype.name());
    match dtype {
        WeightDType::Q8_0 => {
            let d = half_at(block, 0);
            for (o, &q) in out.iter_mut().zip(&block[2..34]) {
                *o = d * (q as i8) as f32;
            }
        }
        WeightDType::Q4_0 => {
            let d = half_at(block, 0);
            let (lo, hi) = out.split_at_mut(16);
            for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&block[2..18]) {
                *l = d * ((q & 15) as i32 - 8) as f32;
                *h = d * ((q >> 4) as i32 - 8) as f32;
            }
        }
        WeightDType::Q4_K => k_asym(block, &block[16..144], None, out),
        WeightDType::Q5_K => k_asym(block, &block[48..176], Some(&block[16..48]), out),
        WeightDType::Q6_K => q6_k(block, out),
        WeightDType::Mxfp4 => {
            let d = e8m0_half(block[0]);
            let (lo, hi) = out.split_at_mut(16);
            for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&block[1..17]) {
                *l = MXFP4_VALUES[(q & 15) as usize] as f32 * d;
                *h = MXFP4_VALUES[(q >> 4) as usize] as f32 * d;
            }
        }
        WeightDType::Q5_0 => {
            let d = half_at(block, 0);
            for (o, &q) in out.iter_mut().zip(&q5_levels(&block[2..22])) {
                *o = (q as i32 - 16) as f32 * d;
            }
        }
        WeightDType::Q5_1 => {
            let (d, m) = (half_at(block, 0), half_at(block, 2));
            for (o, &q) in out.iter_mut().zip(&q5_levels(&block[4..24])) {
                *o = q as f32 * d + m;
            }
        }
        WeightDType::Iq4Nl => {
            let d = half_at(block, 0);
            let (lo, hi) = out.split_at_mut(16);
            for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&block[2..18]) {
                *l = d * IQ4_NL_VALUES[(q & 15) as usize] as f32;
                *h = d * IQ4_NL_VALUES[(q >> 4) as usize] as f32;
            }
        }
        float => panic!("dequantize_block called with float type {}", float.name()),
    }
}

/// `bytes` (whole blocks of `from`) re-encoded as blocks of `to` holding exactly the same values,
/// or None where `to` cannot: Q4_K as Q5_K (the same scales and nibbles, the fifth bits zero), Q5_0
/// as Q5_1 (the min `-16 d`, None when a block's `-16 d` is not an f16), any type as itself. Lets
/// one matrix hold rows of two types without rounding them (llama.cpp's Q4_K_M gives a DeltaNet
/// layer's `attn_qkv` Q5_K and its `attn_gate` Q4_K, which the GPU runs as one `[q | k | v | z]`
/// matrix).
pub fn widen_blocks(from: WeightDType, to: WeightDType, bytes: &[u8]) -> Option<Vec<u8>> {
    let (fb, tb) = (from.block_bytes(), to.block_bytes());
    if from == to {
        return Some(bytes.to_vec());
    }
    if !bytes.len().is_multiple_of(fb) {
        return None;
    }
    let mut out = Vec::with_capacity(bytes.len() / fb * tb);
    for block in bytes.chunks_exact(fb) {
        match (from, to) {
            (WeightDType::Q4_K, WeightDType::Q5_K) => {
                out.extend_from_slice(&block[..16]);
                out.extend_from_slice(&[0u8; 32]);
                out.extend_from_slice(&block[16..144]);
            }
            (WeightDType::Q5_0, WeightDType::Q5_1) => {
                let m = -16.0 * half::f16::from_le_bytes([block[0], block[1]]).to_f32();
                let m_half = half::f16::from_f32(m);
                if m_half.to_f32() != m {
                    return None;
                }
                out.extend_from_slice(&block[..2]);
                out.extend_from_slice(&m_half.to_le_bytes());
                out.extend_from_slice(&block[2..22]);
            }
            _ => return None,
        }
    }
    Some(out)
}

/// The 6-bit scale and min of sub-block `j` of a Q4_K/Q5_K block's 12 packed bytes.
#[inline(always)]
pub(crate) fn scale_min(j: usize, packed: &[u8]) -> (f32, f32) {
    let (sc, m) = if j < 4 {
        (packed[j] & 63, packed[j + 4] & 63)
    } else {
        ((packed[j + 4] & 15) | ((packed[j - 4] >> 6) << 4), (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4))
    };
    (sc as f32, m as f32)
}

/// Q4_K (`qh` None) and Q5_K: `x = (d * sc) * q - (dmin * m)` per sub-block of 32.
#[inline(always)]
fn k_asym(block: &[u8], qs: &[u8], qh: Option<&[u8]>, out: &mut [f32]) {
    let (d, dmin) = (half_at(block, 0), half_at(block, 2));
    let packed = &block[4..16];
    for (sub, y) in out.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min(sub, packed);
        let (scale, min) = (d * sc, dmin * m);
        let (bytes, shift) = (&qs[32 * (sub / 2)..32 * (sub / 2) + 32], 4 * (sub % 2));
        match qh {
            None => {
                for (o, &q) in y.iter_mut().zip(bytes) {
                    *o = scale * ((q >> shift) & 15) as f32 - min;
                }
            }
            Some(qh) => {
                for ((o, &q), &h) in y.iter_mut().zip(bytes).zip(qh) {
                    let v = ((q >> shift) & 15) | (((h >> sub) & 1) << 4);
                    *o = scale * v as f32 - min;
                }
            }
        }
    }
}

/// Q6_K: `x = (d * sc) * (q - 32)`, one signed scale per 16 values.
#[inline(always)]
fn q6_k(block: &[u8], out: &mut [f32]) {
    let d = half_at(block, 208);
    for half in 0..2 {
        let ql = &block[64 * half..64 * half + 64];
        let qh = &block[128 + 32 * half..128 + 32 * half + 32];
        let scales = &block[192 + 8 * half..192 + 8 * half + 8];
        let y = &mut out[128 * half..128 * half + 128];
        for l in 0..32 {
            let h = qh[l];
            let q = [
                (ql[l] & 15) | ((h & 3) << 4),
                (ql[l + 32] & 15) | (((h >> 2) & 3) << 4),
                (ql[l] >> 4) | (((h >> 4) & 3) << 4),
                (ql[l + 32] >> 4) | (((h >> 6) & 3) << 4),
            ];
            for (quarter, &v) in q.iter().enumerate() {
                let sc = scales[2 * quarter + l / 16] as i8 as f32;
                y[32 * quarter + l] = (d * sc) * (v as i32 - 32) as f32;
            }
        }
    }
}

/// `out[r * T + t] = dot(row r, x t)` over `cols` columns of quantised rows: `dequant(src,
/// n_blocks, dst)` dequantises `n_blocks` blocks of `dtype` into f32 (the level's SIMD decoder,
/// bit-equal to [`dequantize_block`]) and each `run_f32` call runs the level's f32 tile kernel
/// over one dequantised chunk. While a chunk is decoded, the same bytes of `prefetch_rows` (the
/// next row block, or null) are prefetched.
///
/// # Safety
/// Every `rows[r]` must address `dtype.row_bytes(cols)` readable bytes (`cols` whole blocks),
/// every `xs[t]` `cols` readable f32; `out` must hold `R * T` values; `prefetch_rows` must be
/// null or hold `R` pointers (hints only, never dereferenced); `dequant` must be safe to call
/// on whole blocks of a row and room for their values; `run_f32` must be safe to call with f32
/// rows of the chunk's length and `xs` offset to the chunk.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile(
    dtype: WeightDType,
    rows: &[*const u8],
    prefetch_rows: *const *const u8,
    xs: &[*const f32],
    cols: usize,
    out: &mut [f32],
    mut dequant: impl FnMut(*const u8, usize, *mut f32),
    run_f32: &mut F32Tile<'_>,
) {
    const MAX_ROWS: usize = crate::ffn::ROW_BLOCK;
    const MAX_TOKENS: usize = 6;
    let (n_rows, n_tokens) = (rows.len(), xs.len());
    debug_assert!(n_rows <= MAX_ROWS && n_tokens <= MAX_TOKENS);
    let mut buf = [[0.0f32; CHUNK_COLS]; MAX_ROWS];
    let mut partial = [0.0f32; MAX_ROWS * MAX_TOKENS];
    let (block_elems, block_bytes) = (dtype.block_elems(), dtype.block_bytes());
    out.iter_mut().for_each(|o| *o = 0.0);
    let mut col0 = 0;
    while col0 < cols {
        let n = CHUNK_COLS.min(cols - col0);
        let byte0 = col0 / block_elems * block_bytes;
        let mut f32_rows = [std::ptr::null::<u8>(); MAX_ROWS];
        for r in 0..n_rows {
            // SAFETY: the caller guarantees `rows[r]` addresses the row's bytes; the chunk lies
            // inside it (col0 + n <= cols, whole blocks) and `buf[r]` holds CHUNK_COLS >= n.
            unsafe { dequant(rows[r].add(byte0), n / block_elems, buf[r].as_mut_ptr()) };
            if !prefetch_rows.is_null() {
                // SAFETY: a non-null `prefetch_rows` holds R pointers (r < R).
                let next = unsafe { *prefetch_rows.add(r) };
                prefetch_bytes(next.wrapping_add(byte0), n / block_elems * block_bytes);
            }
            f32_rows[r] = buf[r].as_ptr() as *const u8;
        }
        let mut chunk_xs = [std::ptr::null::<f32>(); MAX_TOKENS];
        for t in 0..n_tokens {
            // SAFETY: col0 < cols and `xs[t]` addresses `cols` f32.
            chunk_xs[t] = unsafe { xs[t].add(col0) };
        }
        let partial = &mut partial[..n_rows * n_tokens];
        run_f32(&f32_rows[..n_rows], &chunk_xs[..n_tokens], n, partial);
        for (o, p) in out.iter_mut().zip(partial.iter()) {
            *o += p;
        }
        col0 += n;
    }
}

/// Prefetch hints (into L2) for the cache lines of `len` bytes at `at`; never dereferences.
#[inline(always)]
fn prefetch_bytes(at: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let mut offset = 0;
        while offset < len {
            // SAFETY: SSE is part of the x86_64 baseline; a prefetch is a hint and never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(offset) as *const i8) };
            offset += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (at, len);
}

/// Dequantises `n_blocks` blocks of `dtype` at `src` into `out` with [`dequantize_block`].
///
/// # Safety
/// `src` must address `n_blocks` whole blocks, `out` `n_blocks * dtype.block_elems()` f32.
#[inline(always)]
pub(crate) unsafe fn dequantize_blocks_scalar(
    dtype: WeightDType,
    src: *const u8,
    n_blocks: usize,
    out: *mut f32,
) {
    let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
    // SAFETY: the caller vouches for both ranges.
    let (bytes, values) = unsafe {
        (std::slice::from_raw_parts(src, n_blocks * bb), std::slice::from_raw_parts_mut(out, n_blocks * be))
    };
    for (block, y) in bytes.chunks_exact(bb).zip(values.chunks_exact_mut(be)) {
        dequantize_block(dtype, block, y);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_widening_is_exact_for_every_bit_pattern() {
        for bits in 0..=u16::MAX {
            let want = half::f16::from_bits(bits).to_f32();
            let got = half_at(&bits.to_le_bytes(), 0);
            assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{bits:#06x}");
        }
    }

    /// Every widening decodes to the same f32 values as its source, over random blocks (random
    /// scales from subnormal to 2, random levels); pairs without one are refused.
    #[test]
    fn widened_blocks_hold_exactly_the_values_of_their_source() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut byte = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        };
        for (from, to) in [(WeightDType::Q4_K, WeightDType::Q5_K), (WeightDType::Q5_0, WeightDType::Q5_1)] {
            let blocks = 64;
            let mut bytes: Vec<u8> = (0..blocks * from.block_bytes()).map(|_| byte()).collect();
            for b in bytes.chunks_exact_mut(from.block_bytes()) {
                // scales of f16 exponents 0..16 (subnormal to below 2), so -16 d stays an f16
                b[1] &= 0b1011_1111;
                if from == WeightDType::Q4_K {
                    b[3] &= 0b1011_1111;
                }
            }
            let wide = widen_blocks(from, to, &bytes).expect("an exact widening");
            assert_eq!(wide.len(), blocks * to.block_bytes());
            let (mut want, mut got) = (vec![0f32; from.block_elems()], vec![0f32; to.block_elems()]);
            for (a, b) in bytes.chunks_exact(from.block_bytes()).zip(wide.chunks_exact(to.block_bytes())) {
                dequantize_block(from, a, &mut want);
                dequantize_block(to, b, &mut got);
                // equal as values: Q5_1's `16 d - 16 d` is +0 where Q5_0's `0 d` may be -0
                assert_eq!(got, want, "{} as {}", from.name(), to.name());
            }
        }
        let mut huge = vec![0u8; 22];
        huge[..2].copy_from_slice(&half::f16::from_f32(30000.0).to_le_bytes());
        assert!(widen_blocks(WeightDType::Q5_0, WeightDType::Q5_1, &huge).is_none(), "-16 d past f16");
        assert!(widen_blocks(WeightDType::Q5_K, WeightDType::Q6_K, &[0u8; 176]).is_none());
        assert_eq!(widen_blocks(WeightDType::Q8_0, WeightDType::Q8_0, &[7u8; 34]).unwrap(), vec![7u8; 34]);
    }

    #[test]
    fn q8_0_block_decodes_scale_times_value() {
        let mut block = vec![0u8; 34];
        block[..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
        block[2] = (-3i8) as u8;
        block[3] = 4;
        let mut out = [0.0f32; 32];
        dequantize_block(WeightDType::Q8_0, &block, &mut out);
        assert_eq!(&out[..3], &[-1.5, 2.0, 0.0]);
    }

    #[test]
    fn e8m0_half_is_two_to_the_e_minus_128() {
        for e in 0..=254u8 {
            assert_eq!(e8m0_half(e) as f64, 2f64.powi(e as i32 - 128), "{e}");
        }
        assert_eq!(e8m0_half(255), 2f32.powi(127), "0xFF reads as llama.cpp's CPU code reads it");
    }

    #[test]
    fn mxfp4_block_splits_nibbles_low_first() {
        let mut block = [0u8; 17];
        block[0] = 128; // half scale 1
        block[1] = 0xF7; // value 0: 12, value 16: -12
        block[2] = 0x98; // value 1: +0 (not -0), value 17: -1
        let mut out = [f32::NAN; 32];
        dequantize_block(WeightDType::Mxfp4, &block, &mut out);
        assert_eq!((out[0], out[16], out[17]), (12.0, -12.0, -1.0));
        assert_eq!(out[1].to_bits(), 0, "nibble 8 is +0");
    }

    #[test]
    fn q5_blocks_take_the_fifth_bit_from_the_qh_word() {
        // d = 1 (0x3C00), Q5_1's m = -0.5 (0xB800); qh bit 0 and bit 16 set (values 0 and 16),
        // byte 0 of the nibbles 0x3F: value 0 nibble 15 (level 31), value 16 nibble 3 (level 19).
        let mut q5_0 = [0u8; 22];
        q5_0[..2].copy_from_slice(&0x3C00u16.to_le_bytes());
        q5_0[2..6].copy_from_slice(&0x0001_0001u32.to_le_bytes());
        q5_0[6] = 0x3F;
        let mut out = [f32::NAN; 32];
        dequantize_block(WeightDType::Q5_0, &q5_0, &mut out);
        assert_eq!((out[0], out[16], out[1], out[17]), (15.0, 3.0, -16.0, -16.0));
        let mut q5_1 = [0u8; 24];
        q5_1[..2].copy_from_slice(&0x3C00u16.to_le_bytes());
        q5_1[2..4].copy_from_slice(&0xB800u16.to_le_bytes());
        q5_1[4..24].copy_from_slice(&q5_0[2..22]);
        dequantize_block(WeightDType::Q5_1, &q5_1, &mut out);
        assert_eq!((out[0], out[16], out[1]), (30.5, 18.5, -0.5));
    }

    #[test]
    fn iq4_nl_block_looks_nibbles_up_in_llama_cpp_table() {
        let mut block = [0u8; 18];
        block[..2].copy_from_slice(&0x3800u16.to_le_bytes()); // d = 0.5
        block[2] = 0xF0; // value 0: -127, value 16: 113
        block[3] = 0x78; // value 1: 1, value 17: -10
        let mut out = [f32::NAN; 32];
        dequantize_block(WeightDType::Iq4Nl, &block, &mut out);
        assert_eq!((out[0], out[16], out[1], out[17]), (-63.5, 56.5, 0.5, -5.0));
    }

    #[test]
    fn q4_0_block_splits_nibbles_low_first() {
        let mut block = vec![0x88u8; 18];
        block[..2].copy_from_slice(&half::f16::from_f32(2.0).to_bits().to_le_bytes());
        block[2] = 0x9A; // value 0: 10 - 8 = 2, value 16: 9 - 8 = 1
        let mut out = [0.0f32; 32];
        dequantize_block(WeightDType::Q4_0, &block, &mut out);
        assert_eq!((out[0], out[16], out[1]), (4.0, 2.0, 0.0));
    }
}
