//! AVX2 + FMA + F16C tile kernels (256-bit). BF16 weights widen by zero-extending u16 to u32
//! and shifting into the high half; F16 weights use `vcvtph2ps`; all loads are unaligned.
//! Only called after [`crate::SimdLevel::Avx2`] was detected.

use std::arch::x86_64::*;

use crate::weights::{bf16_bits_to_f32, WeightDType};

const DT_F32: u8 = 0;
const DT_F16: u8 = 1;
const DT_BF16: u8 = 2;

/// Rows per tile for a token block of `n_tokens` (at most [`MAX_TILE_TOKENS`]): keeps
/// `R * T` accumulators plus the weight and activation vectors within 16 ymm registers.
pub(crate) fn rows_per_tile(n_tokens: usize) -> usize {
    match n_tokens {
        1 => 8,
        2 | 3 => 4,
        _ => 2,
    }
}

/// Largest token block of one tile.
pub(crate) const MAX_TILE_TOKENS: usize = 6;

// SAFETY (callers): the CPU must have the target features named below (callers check
// the detected SIMD level first) and every pointer argument must cover the rows and columns
// the shape arguments describe (the safe wrappers in `ffn.rs` build them from slices).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8<const DT: u8>(row: *const u8, col: usize) -> __m256 {
    // SAFETY (all arms): the tile's caller guarantees `row` has `cols` elements and the tile
    // loop only asks for `col + 8 <= cols`; loadu tolerates any alignment.
    unsafe {
        match DT {
            DT_F32 => _mm256_loadu_ps(row.add(col * 4) as *const f32),
            DT_F16 => _mm256_cvtph_ps(_mm_loadu_si128(row.add(col * 2) as *const __m128i)),
            _ => {
                let widened = _mm256_cvtepu16_epi32(_mm_loadu_si128(row.add(col * 2) as *const __m128i));
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(widened))
            }
        }
    }
}

const fn elem_bytes<const DT: u8>() -> usize {
    if DT == DT_F32 {
        4
    } else {
        2
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn horizontal_sum(v: __m256) -> f32 {
    let pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let quad = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
    let single = _mm_add_ss(quad, _mm_shuffle_ps::<0b01>(quad, quad));
    _mm_cvtss_f32(single)
}

#[inline]
fn load_scalar<const DT: u8>(row: *const u8, col: usize) -> f32 {
    // SAFETY: same bounds as `load8`, one element; read_unaligned tolerates any alignment.
    unsafe {
        match DT {
            DT_F32 => (row.add(col * 4) as *const f32).read_unaligned(),
            DT_F16 => half::f16::from_bits((row.add(col * 2) as *const u16).read_unaligned()).to_f32(),
            _ => bf16_bits_to_f32((row.add(col * 2) as *const u16).read_unaligned()),
        }
    }
}

/// Register-blocked `R x T` tile: each weight vector is loaded once and applied to `T` tokens.
// SAFETY (callers): the CPU must have the target features named below (callers check
// the detected SIMD level first) and every pointer argument must cover the rows and columns
// the shape arguments describe (the safe wrappers in `ffn.rs` build them from slices).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_rt<const DT: u8, const R: usize, const T: usize>(
    rows: *const *const u8,
    prefetch_rows: *const *const u8,
    xs: *const *const f32,
    cols: usize,
    out: *mut f32,
) {
    // SAFETY: the caller passes R row pointers, R prefetch pointers (or null), T activation
    // pointers and R*T outputs.
    let rows: [*const u8; R] = std::array::from_fn(|i| unsafe { *rows.add(i) });
    let prefetch_rows: Option<[*const u8; R]> =
        (!prefetch_rows.is_null()).then(|| std::array::from_fn(|i| unsafe { *prefetch_rows.add(i) }));
    let line_cols = 64 / elem_bytes::<DT>();
    let xs: [*const f32; T] = std::array::from_fn(|i| unsafe { *xs.add(i) });
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let vector_cols = cols / 8 * 8;
    let mut col = 0;
    while col < vector_cols {
        if let Some(next_rows) = &prefetch_rows {
            if col % line_cols == 0 {
                for next_row in next_rows {
                    // A hint only: prefetches never fault, and the address stays in the next row.
                    _mm_prefetch::<_MM_HINT_T1>(next_row.wrapping_add(col * elem_bytes::<DT>()) as *const i8);
                }
            }
        }
        let mut w = [_mm256_setzero_ps(); R];
        for r in 0..R {
            // SAFETY: col + 8 <= cols, see load8.
            w[r] = unsafe { load8::<DT>(rows[r], col) };
        }
        for t in 0..T {
            // SAFETY: xs[t] has `cols` f32 and col + 8 <= cols.
            let x = unsafe { _mm256_loadu_ps(xs[t].add(col)) };
            for r in 0..R {
                acc[r][t] = _mm256_fmadd_ps(w[r], x, acc[r][t]);
            }
        }
        col += 8;
    }
    for r in 0..R {
        for t in 0..T {
            let mut sum = horizontal_sum(acc[r][t]);
            for c in vector_cols..cols {
                // SAFETY: c < cols.
                sum += load_scalar::<DT>(rows[r], c) * unsafe { *xs[t].add(c) };
            }
            // SAFETY: r * T + t < R * T.
            unsafe { *out.add(r * T + t) = sum };
        }
    }
}

/// BF16 decode tile (`T <= 2`), 16 columns per step: one 256-bit load holds 16 BF16 weights;
/// `<< 16` yields the even columns as f32 and `& 0xFFFF0000` the odd ones (two cheap ALU ops
/// per 16 weights instead of two widening shuffles and two shifts). The activations are split
/// into even/odd columns once per step and shared by all `R` rows.
// SAFETY (callers): the CPU must have the target features named below (callers check
// the detected SIMD level first) and every pointer argument must cover the rows and columns
// the shape arguments describe (the safe wrappers in `ffn.rs` build them from slices).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_bf16_split_rt<const R: usize, const T: usize>(
    rows: *const *const u8,
    prefetch_rows: *const *const u8,
    xs: *const *const f32,
    cols: usize,
    out: *mut f32,
) {
    // SAFETY: the caller passes R row pointers, R prefetch pointers (or null), T activation
    // pointers and R*T outputs.
    let rows: [*const u8; R] = std::array::from_fn(|i| unsafe { *rows.add(i) });
    let prefetch_rows: Option<[*const u8; R]> =
        (!prefetch_rows.is_null()).then(|| std::array::from_fn(|i| unsafe { *prefetch_rows.add(i) }));
    let xs: [*const f32; T] = std::array::from_fn(|i| unsafe { *xs.add(i) });
    let high_half = _mm256_castsi256_ps(_mm256_set1_epi32(0xFFFF_0000u32 as i32));
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    // Without a next block, "prefetch" the rows being read: a branch-free loop, hints hit L1.
    let prefetch_rows = prefetch_rows.unwrap_or(rows);
    macro_rules! step16 {
        ($col:expr) => {{
            let col = $col;
            let mut x_even = [_mm256_setzero_ps(); T];
            let mut x_odd = [_mm256_setzero_ps(); T];
            for t in 0..T {
                // SAFETY: xs[t] has `cols` f32 and col + 16 <= cols.
                let (a, b) =
                    unsafe { (_mm256_loadu_ps(xs[t].add(col)), _mm256_loadu_ps(xs[t].add(col + 8))) };
                // shuffle gives [0 2 8 10 | 4 6 12 14]; the 64-bit permute restores column order.
                let even = _mm256_shuffle_ps::<0b10_00_10_00>(a, b);
                let odd = _mm256_shuffle_ps::<0b11_01_11_01>(a, b);
                x_even[t] = _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(even)));
                x_odd[t] = _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(odd)));
            }
            for r in 0..R {
                // SAFETY: 16 BF16 (32 bytes) at col + 16 <= cols; loadu tolerates any alignment.
                let raw = unsafe { _mm256_loadu_si256(rows[r].add(col * 2) as *const __m256i) };
                let w_even = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(raw));
                let w_odd = _mm256_and_ps(_mm256_castsi256_ps(raw), high_half);
                for t in 0..T {
                    acc[r][t] = _mm256_fmadd_ps(w_even, x_even[t], acc[r][t]);
                    acc[r][t] = _mm256_fmadd_ps(w_odd, x_odd[t], acc[r][t]);
                }
            }
        }};
    }
    let line_cols = cols / 32 * 32;
    let split_cols = cols / 16 * 16;
    let mut col = 0;
    while col < line_cols {
        for next_row in &prefetch_rows {
            // A hint only: prefetches never fault, and the address stays in the next row.
            _mm_prefetch::<_MM_HINT_T1>(next_row.wrapping_add(col * 2) as *const i8);
        }
        step16!(col);
        step16!(col + 16);
        col += 32;
    }
    while col < split_cols {
        step16!(col);
        col += 16;
    }
    for r in 0..R {
        for t in 0..T {
            let mut sum = horizontal_sum(acc[r][t]);
            for c in split_cols..cols {
                // SAFETY: c < cols.
                sum += load_scalar::<DT_BF16>(rows[r], c) * unsafe { *xs[t].add(c) };
            }
            // SAFETY: r * T + t < R * T.
            unsafe { *out.add(r * T + t) = sum };
        }
    }
}

// SAFETY (callers): the CPU must have the target features named below (callers check
// the detected SIMD level first) and every pointer argument must cover the rows and columns
// the shape arguments describe (the safe wrappers in `ffn.rs` build them from slices).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_dtype<const DT: u8>(
    rows: &[*const u8],
    prefetch_rows: *const *const u8,
    xs: &[*const f32],
    cols: usize,
    out: &mut [f32],
) {
    macro_rules! dispatch {
        ($(($r:literal, $t:literal)),* $(,)?) => {
            match (rows.len(), xs.len()) {
                // SAFETY: the pointer counts match the const shape; the caller vouches for the data.
                $(($r, $t) => unsafe { tile_rt::<DT, $r, $t>(rows.as_ptr(), prefetch_rows, xs.as_ptr(), cols, out.as_mut_ptr()) },)*
                (r, t) => unreachable!("no AVX2 tile of {r}x{t}"),
            }
        };
    }
    debug_assert!(out.len() >= rows.len() * xs.len());
    dispatch!((8, 1), (4, 2), (4, 3), (2, 4), (2, 5), (2, 6), (1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (1, 6),)
}

/// `out[r * T + t] = dot(row r, x t)`; shapes as in [`crate::scalar::tile`] and limited to the
/// (rows, tokens) pairs of [`rows_per_tile`] plus single rows.
///
/// # Safety
/// As [`crate::scalar::tile`], and the CPU must support AVX2, FMA and F16C.
pub(crate) unsafe fn tile(
    dtype: WeightDType,
    rows: &[*const u8],
    prefetch_rows: *const *const u8,
    xs: &[*const f32],
    cols: usize,
    out: &mut [f32],
) {
    // SAFETY: the caller checked the CPU features and the pointer contracts.
    unsafe {
        match dtype {
            quantized @ (WeightDType::Q8_0
            | WeightDType::Q4_0
            | WeightDType::Q4_K
            | WeightDType::Q5_K
            | WeightDType::Q6_K
            | WeightDType::Mxfp4
            | WeightDType::Q5_0
            | WeightDType::Q5_1
            | WeightDType::Iq4Nl) => {
                unreachable!("{} rows go through quant_tile", quantized.name())
            }
            WeightDType::F32 => tile_dtype::<DT_F32>(rows, prefetch_rows, xs, cols, out),
            WeightDType::F16 => tile_dtype::<DT_F16>(rows, prefetch_rows, xs, cols, out),
            WeightDType::BF16 => match (rows.len(), xs.len()) {
                (8, 1) => tile_bf16_split_rt::<8, 1>(
                    rows.as_ptr(),
                    prefetch_rows,
                    xs.as_ptr(),
                    cols,
                    out.as_mut_ptr(),
                ),
                (4, 2) => tile_bf16_split_rt::<4, 2>(
                    rows.as_ptr(),
                    prefetch_rows,
                    xs.as_ptr(),
                    cols,
                    out.as_mut_ptr(),
                ),
                (1, 1) => tile_bf16_split_rt::<1, 1>(
                    rows.as_ptr(),
                    prefetch_rows,
                    xs.as_ptr(),
                    cols,
                    out.as_mut_ptr(),
                ),
                (1, 2) => tile_bf16_split_rt::<1, 2>(
                    rows.as_ptr(),
                    prefetch_rows,
                    xs.as_ptr(),
                    cols,
                    out.as_mut_ptr(),
                ),
                _ => tile_dtype::<DT_BF16>(rows, prefetch_rows, xs, cols, out),
            },
        }
    }
}

/// Concurrent sequential streams of one thread in the read probe ([`sum_f32`]).
const READ_STREAMS: usize = 4;

/// Sum of `len` f32 (the read probe).
///
/// # Safety
/// `data` must address `len` readable f32; the CPU must support AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn sum_f32(data: *const f32, len: usize) -> f32 {
    // READ_STREAMS equal parts walked side by side, two vectors of each per step: several
    // concurrent sequential streams per core, as the GEMV tiles read 8 rows at once (one stream
    // per core leaves the L2 prefetchers short of misses in flight and under-reads DRAM).
    let mut acc = [_mm256_setzero_ps(); 2 * READ_STREAMS];
    let part = len / (16 * READ_STREAMS) * 16;
    let mut i = 0;
    while i < part {
        for (k, a) in acc.iter_mut().enumerate() {
            let at = (k / 2) * part + i + (k % 2) * 8;
            // SAFETY: at + 8 <= (k / 2 + 1) * part <= len.
            *a = _mm256_add_ps(*a, unsafe { _mm256_loadu_ps(data.add(at)) });
        }
        i += 16;
    }
    let mut total = 0.0;
    for a in acc {
        total += horizontal_sum(a);
    }
    for j in part * READ_STREAMS..len {
        // SAFETY: j < len.
        total += unsafe { *data.add(j) };
    }
    total
}

/// The quantised tile: one token on 8 rows or 1 row runs the fused decode tile
/// ([`crate::x86_quant_tile::avx2`]); other shapes [`crate::quant::tile`] over this level's
/// SIMD dequantisation ([`crate::x86_quant::avx2`], bit-equal to the scalar blocks) and this
/// level's f32 tile.
///
/// # Safety
/// As [`crate::quant::tile`], and the CPU must support the features named below.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quant_tile(
    dtype: WeightDType,
    rows: &[*const u8],
    prefetch_rows: *const *const u8,
    xs: &[*const f32],
    cols: usize,
    out: &mut [f32],
) {
    // SAFETY: one token: the caller's contract covers the fused tile's (rows of `cols` whole
    // blocks, `cols` activations, room for the rows' sums); the CPU features are this function's.
    if xs.len() == 1
        && unsafe { crate::x86_quant_tile::avx2::decode_tile(dtype, rows, prefetch_rows, xs[0], cols, out) }
    {
        return;
    }
    let dequant = |src: *const u8, n_blocks: usize, dst: *mut f32| {
        // SAFETY: quant::tile hands whole blocks of a row and room for their values; the CPU
        // features are this function's.
        unsafe { crate::x86_quant::avx2::dequantize_blocks(dtype, src, n_blocks, dst) }
    };
    let mut run_f32 = |rows: &[*const u8], xs: &[*const f32], cols: usize, out: &mut [f32]| {
        // SAFETY: quant::tile hands f32 chunk rows of `cols` values and in-bounds xs.
        unsafe { tile(WeightDType::F32, rows, std::ptr::null(), xs, cols, out) }
    };
    // SAFETY: forwarded from the caller.
    unsafe { crate::quant::tile(dtype, rows, prefetch_rows, xs, cols, out, dequant, &mut run_f32) }
}
