//! AVX-512 tile kernels (512-bit): the AVX-512F kernels widen BF16/F16 to f32 like the AVX2
//! ones; the AVX-512 BF16 kernel feeds BF16 weights straight into `vdpbf16ps`, rounding the f32
//! activations to BF16 once per 32 columns (shared by all rows of the tile). Only called after
//! [`crate::SimdLevel::Avx512`] / [`crate::SimdLevel::Avx512Bf16`] was detected.

use std::arch::x86_64::*;

use crate::weights::{bf16_bits_to_f32, WeightDType};

const DT_F32: u8 = 0;
const DT_F16: u8 = 1;
const DT_BF16: u8 = 2;

/// Rows per tile for a token block of `n_tokens` (at most [`MAX_TILE_TOKENS`]): up to 24
/// accumulators plus weights and activations within 32 zmm registers.
pub(crate) fn rows_per_tile(n_tokens: usize) -> usize {
    match n_tokens {
        1 => 8,
        _ => 4,
    }
}

/// Largest token block of one tile.
pub(crate) const MAX_TILE_TOKENS: usize = 6;

// SAFETY (callers): the CPU must have the target features named below (callers check
// the detected SIMD level first) and every pointer argument must cover the rows and columns
// the shape arguments describe (the safe wrappers in `ffn.rs` build them from slices).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn load16<const DT: u8>(row: *const u8, col: usize) -> __m512 {
    // SAFETY (all arms): the tile loop only asks for `col + 16 <= cols` of a row the caller
    // vouched for; loadu tolerates any alignment.
    unsafe {
        match DT {
            DT_F32 => _mm512_loadu_ps(row.add(col * 4) as *const f32),
            DT_F16 => _mm512_cvtph_ps(_mm256_loadu_si256(row.add(col * 2) as *const __m256i)),
            _ => {
                let widened = _mm512_cvtepu16_epi32(_mm256_loadu_si256(row.add(col * 2) as *const __m256i));
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(widened))
            }
        }
    }
}

#[inline]
fn load_scalar<const DT: u8>(row: *const u8, col: usize) -> f32 {
    // SAFETY: one element at `col < cols`; read_unaligned tolerates any alignment.
    unsafe {
        match DT {
            DT_F32 => (row.add(col * 4) as *const f32).read_unaligned(),
            DT_F16 => half::f16::from_bits((row.add(col * 2) as *const u16).read_unaligned()).to_f32(),
            _ => bf16_bits_to_f32((row.add(col * 2) as *const u16).read_unaligned()),
        }
    }
}

/// Register-blocked `R x T` tile with f32 FMAs.
// SAFETY (callers): the CPU must have the target features named below (callers check
// the detected SIMD level first) and every pointer argument must cover the rows and columns
// the shape arguments describe (the safe wrappers in `ffn.rs` build them from slices).
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
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
    let xs: [*const f32; T] = std::array::from_fn(|i| unsafe { *xs.add(i) });
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let vector_cols = cols / 16 * 16;
    let line_cols = if DT == DT_F32 { 16 } else { 32 };
    let elem_bytes = if DT == DT_F32 { 4 } else { 2 };
    let mut col = 0;
    while col < vector_cols {
        if let Some(next_rows) = &prefetch_rows {
            if col % line_cols == 0 {
                for next_row in next_rows {
                    // A hint only: prefetches never fault, and the address stays in the next row.
                    _mm_prefetch::<_MM_HINT_T1>(next_row.wrapping_add(col * elem_bytes) as *const i8);
                }
            }
        }
        let mut w = [_mm512_setzero_ps(); R];
        for r in 0..R {
            // SAFETY: col + 16 <= cols, see load16.
            w[r] = unsafe { load16::<DT>(rows[r], col) };
        }
        for t in 0..T {
            // SAFETY: xs[t] has `cols` f32 and col + 16 <= cols.
            let x = unsafe { _mm512_loadu_ps(xs[t].add(col)) };
            for r in 0..R {
                acc[r][t] = _mm512_fmadd_ps(w[r], x, acc[r][t]);
            }
        }
        col += 16;
    }
    for r in 0..R {
        for t in 0..T {
            let mut sum = _mm512_reduce_add_ps(acc[r][t]);
            for c in vector_cols..cols {
                // SAFETY: c < cols.
                sum += load_scalar::<DT>(rows[r], c) * unsafe { *xs[t].add(c) };
            }
            // SAFETY: r * T + t < R * T.
            unsafe { *out.add(r * T + t) = sum };
        }
    }
}

/// Register-blocked `R x T` BF16 tile with `vdpbf16ps` (32 columns per step).
// SAFETY (callers): the CPU must have the target features named below (callers check
// the detected SIMD level first) and every pointer argument must cover the rows and columns
// the shape arguments describe (the safe wrappers in `ffn.rs` build them from slices).
#[target_feature(enable = "avx512f,avx512bf16,avx2,fma,f16c")]
unsafe fn tile_bf16dot_rt<const R: usize, const T: usize>(
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
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let vector_cols = cols / 32 * 32;
    let mut col = 0;
    while col < vector_cols {
        if let Some(next_rows) = &prefetch_rows {
            for next_row in next_rows {
                // A hint only: prefetches never fault, and the address stays in the next row.
                _mm_prefetch::<_MM_HINT_T1>(next_row.wrapping_add(col * 2) as *const i8);
            }
        }
        let mut w = [_mm512_setzero_si512(); R];
        for r in 0..R {
            // SAFETY: 32 BF16 (64 bytes) at col + 32 <= cols; loadu tolerates any alignment.
            w[r] = unsafe { _mm512_loadu_si512(rows[r].add(col * 2) as *const __m512i) };
        }
        for t in 0..T {
            // SAFETY: xs[t] has `cols` f32 and col + 32 <= cols.
            let (low, high) =
                unsafe { (_mm512_loadu_ps(xs[t].add(col)), _mm512_loadu_ps(xs[t].add(col + 16))) };
            // Lower 16 BF16 lanes come from the second operand: element order matches the weights.
            let x = _mm512_cvtne2ps_pbh(high, low);
            for r in 0..R {
                // SAFETY: __m512i and __m512bh are both 64-byte plain vector registers.
                let w_bh: __m512bh = unsafe { std::mem::transmute::<__m512i, __m512bh>(w[r]) };
                acc[r][t] = _mm512_dpbf16_ps(acc[r][t], w_bh, x);
            }
        }
        col += 32;
    }
    for r in 0..R {
        for t in 0..T {
            let mut sum = _mm512_reduce_add_ps(acc[r][t]);
            for c in vector_cols..cols {
                // SAFETY: c < cols.
                sum += load_scalar::<DT_BF16>(rows[r], c) * unsafe { *xs[t].add(c) };
            }
            // SAFETY: r * T + t < R * T.
            unsafe { *out.add(r * T + t) = sum };
        }
    }
}

macro_rules! dispatch_shapes {
    ($rows:ident, $prefetch_rows:ident, $xs:ident, $cols:ident, $out:ident, $kernel:ident $(::<$dt:ident>)?) => {
        match ($rows.len(), $xs.len()) {
            (8, 1) => $kernel::<$($dt,)? 8, 1>($rows.as_ptr(), $prefetch_rows, $xs.as_ptr(), $cols, $out.as_mut_ptr()),
            (4, 2) => $kernel::<$($dt,)? 4, 2>($rows.as_ptr(), $prefetch_rows, $xs.as_ptr(), $cols, $out.as_mut_ptr()),
            (4, 3) => $kernel::<$($dt,)? 4, 3>($rows.as_ptr(), $prefetch_rows, $xs.as_ptr(), $cols, $out.as_mut_ptr()),
            (4, 4) => $kernel::<$($dt,)? 4, 4>($rows.as_ptr(), $prefetch_rows, $xs.as_ptr(), $cols, $out.as_mut_ptr()),
            (4, 5) => $kernel::<$($dt,)? 4, 5>($rows.as_ptr(), $prefetch_rows, $xs.as_ptr(), $cols, $out.as_mut_ptr()),
            (4, 6) => $kernel::<$($dt,)? 4, 6>($rows.as_ptr(), $prefetch_rows, $xs.as_ptr(), $cols, $out.as_mut_ptr()),
            (1, 1) => $kernel::<$($dt,)? 1, 1>($rows.as_ptr(), $prefetch_rows, $xs.as_ptr(), $cols, $out.as_mut_ptr()),
            (1, 2) => $kernel::<$($dt,)? 1, 2>($rows.as_ptr(), $prefetch_rows, $xs.as_ptr(), $cols, $out.as_mut_ptr()),
            (1, 3) => $kernel::<$($dt,)? 1, 3>($rows.as_ptr(), $prefetch_rows, $xs.as_ptr(), $cols, $out.as_mut_ptr()),
            (1, 4) => $kernel::<$($dt,)? 1, 4>($rows.as_ptr(), $prefetch_rows, $xs.as_ptr(), $cols, $out.as_mut_ptr()),
            (1, 5) => $kernel::<$($dt,)? 1, 5>($rows.as_ptr(), $prefetch_rows, $xs.as_ptr(), $cols, $out.as_mut_ptr()),
            (1, 6) => $kernel::<$($dt,)? 1, 6>($rows.as_ptr(), $prefetch_rows, $xs.as_ptr(), $cols, $out.as_mut_ptr()),
            (r, t) => unreachable!("no AVX-512 tile of {r}x{t}"),
        }
    };
}

// SAFETY (callers): the CPU must have the target features named below (callers check
// the detected SIMD level first) and every pointer argument must cover the rows and columns
// the shape arguments describe (the safe wrappers in `ffn.rs` build them from slices).
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn tile_dtype<const DT: u8>(
    rows: &[*const u8],
    prefetch_rows: *const *const u8,
    xs: &[*const f32],
    cols: usize,
    out: &mut [f32],
) {
    debug_assert!(out.len() >= rows.len() * xs.len());
    // SAFETY: the pointer counts match the const shape; the caller vouches for the data.
    unsafe { dispatch_shapes!(rows, prefetch_rows, xs, cols, out, tile_rt::<DT>) }
}

/// `out[r * T + t] = dot(row r, x t)` with AVX-512F; shapes as in [`crate::scalar::tile`],
/// limited to the (rows, tokens) pairs of [`rows_per_tile`] plus single rows.
///
/// # Safety
/// As [`crate::scalar::tile`], and the CPU must support AVX-512F, AVX2, FMA and F16C.
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
            WeightDType::BF16 => tile_dtype::<DT_BF16>(rows, prefetch_rows, xs, cols, out),
        }
    }
}

/// As [`tile`], but BF16 weights go through `vdpbf16ps` (activations rounded to BF16).
///
/// # Safety
/// As [`tile`], and the CPU must also support AVX-512 BF16.
pub(crate) unsafe fn tile_bf16dot(
    dtype: WeightDType,
    rows: &[*const u8],
    prefetch_rows: *const *const u8,
    xs: &[*const f32],
    cols: usize,
    out: &mut [f32],
) {
    if dtype != WeightDType::BF16 {
        // SAFETY: forwarded contract; AVX-512 BF16 implies AVX-512F here (see simd.rs).
        return unsafe { tile(dtype, rows, prefetch_rows, xs, cols, out) };
    }
    // SAFETY: the caller checked AVX-512 BF16 and the pointer contracts.
    unsafe { tile_bf16dot_shapes(rows, prefetch_rows, xs, cols, out) }
}

#[target_feature(enable = "avx512f,avx512bf16,avx2,fma,f16c")]
unsafe fn tile_bf16dot_shapes(
    rows: &[*const u8],
    prefetch_rows: *const *const u8,
    xs: &[*const f32],
    cols: usize,
    out: &mut [f32],
) {
    debug_assert!(out.len() >= rows.len() * xs.len());
    // SAFETY: the pointer counts match the const shape; the caller vouches for the data.
    unsafe { dispatch_shapes!(rows, prefetch_rows, xs, cols, out, tile_bf16dot_rt) }
}

/// Concurrent sequential streams of one thread in the read probe ([`sum_f32`]).
const READ_STREAMS: usize = 4;

/// Sum of `len` f32 (the read probe).
///
/// # Safety
/// `data` must address `len` readable f32; the CPU must support AVX-512F.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn sum_f32(data: *const f32, len: usize) -> f32 {
    // READ_STREAMS equal parts walked side by side, two vectors of each per step: several
    // concurrent sequential streams per core, as the GEMV tiles read 8 rows at once (one stream
    // per core leaves the L2 prefetchers short of misses in flight and under-reads DRAM).
    let mut acc = [_mm512_setzero_ps(); 2 * READ_STREAMS];
    let part = len / (32 * READ_STREAMS) * 32;
    let mut i = 0;
    while i < part {
        for (k, a) in acc.iter_mut().enumerate() {
            let at = (k / 2) * part + i + (k % 2) * 16;
            // SAFETY: at + 16 <= (k / 2 + 1) * part <= len.
            *a = _mm512_add_ps(*a, unsafe { _mm512_loadu_ps(data.add(at)) });
        }
        i += 32;
    }
    let mut total = 0.0;
    for a in acc {
        total += _mm512_reduce_add_ps(a);
    }
    for j in part * READ_STREAMS..len {
        // SAFETY: j < len.
        total += unsafe { *data.add(j) };
    }
    total
}

/// The quantised tile: one token on 8 rows or 1 row runs the fused decode tile
/// ([`crate::x86_quant_tile::avx512`]); other shapes [`crate::quant::tile`] over this level's
/// SIMD dequantisation ([`crate::x86_quant::avx512`], bit-equal to the scalar blocks) and this
/// level's f32 tile.
///
/// # Safety
/// As [`crate::quant::tile`], and the CPU must support the features named below.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
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
        && unsafe { crate::x86_quant_tile::avx512::decode_tile(dtype, rows, prefetch_rows, xs[0], cols, out) }
    {
        return;
    }
    let dequant = |src: *const u8, n_blocks: usize, dst: *mut f32| {
        // SAFETY: quant::tile hands whole blocks of a row and room for their values; the CPU
        // features are this function's.
        unsafe { crate::x86_quant::avx512::dequantize_blocks(dtype, src, n_blocks, dst) }
    };
    let mut run_f32 = |rows: &[*const u8], xs: &[*const f32], cols: usize, out: &mut [f32]| {
        // SAFETY: quant::tile hands f32 chunk rows of `cols` values and in-bounds xs.
        unsafe { tile(WeightDType::F32, rows, std::ptr::null(), xs, cols, out) }
    };
    // SAFETY: forwarded from the caller.
    unsafe { crate::quant::tile(dtype, rows, prefetch_rows, xs, cols, out, dequant, &mut run_f32) }
}
