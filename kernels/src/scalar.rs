//! Scalar reference tile kernel: plain f32 loops, sequential accumulation. Every SIMD level
//! is tested against it, and it is the `Scalar` level's implementation.

use crate::weights::WeightDType;

/// `out[r * T + t] = dot(row r, x t)` over `cols` columns for `R = rows.len()` weight rows and
/// `T = xs.len()` activation vectors.
///
/// # Safety
/// Every `rows[r]` must point to `cols` readable elements of `dtype` (any alignment), every
/// `xs[t]` to `cols` readable f32 (f32-aligned), and `out` must hold `R * T` values.
pub(crate) unsafe fn tile(
    dtype: WeightDType,
    rows: &[*const u8],
    xs: &[*const f32],
    cols: usize,
    out: &mut [f32],
) {
    let row_bytes = dtype.row_bytes(cols);
    let n_tokens = xs.len();
    for (r, &row_ptr) in rows.iter().enumerate() {
        // SAFETY: the caller guarantees `row_ptr` addresses `row_bytes` readable bytes; u8 has no
        // alignment requirement.
        let row = unsafe { std::slice::from_raw_parts(row_ptr, row_bytes) };
        for (t, &x_ptr) in xs.iter().enumerate() {
            // SAFETY: the caller guarantees `x_ptr` addresses `cols` readable, aligned f32.
            let x = unsafe { std::slice::from_raw_parts(x_ptr, cols) };
            out[r * n_tokens + t] = dot_row(dtype, row, x);
        }
    }
}

/// Sequential f32 dot product of one weight row (raw bytes) with `x` (quantised rows are
/// dequantised block by block).
pub fn dot_row(dtype: WeightDType, row: &[u8], x: &[f32]) -> f32 {
    let mut sum = 0.0f32;
    if dtype.is_quantized() {
        let mut block = [0.0f32; crate::quant::MAX_BLOCK_ELEMS];
        let (n, bb) = (dtype.block_elems(), dtype.block_bytes());
        for (bytes, xs) in row.chunks_exact(bb).zip(x.chunks_exact(n)) {
            crate::quant::dequantize_block(dtype, bytes, &mut block[..n]);
            for (w, xv) in block[..n].iter().zip(xs) {
                sum += w * xv;
            }
        }
        return sum;
    }
    for (c, &xv) in x.iter().enumerate() {
        sum += dtype.load_f32(row, c) * xv;
    }
    sum
}
