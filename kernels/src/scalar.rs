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
    let row_bytes = cols * dtype.size_bytes();
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

/// Sequential f32 dot product of one weight row (raw bytes) with `x`.
pub fn dot_row(dtype: WeightDType, row: &[u8], x: &[f32]) -> f32 {
    let mut sum = 0.0f32;
    for (c, &xv) in x.iter().enumerate() {
        sum += dtype.load_f32(row, c) * xv;
    }
    sum
}
