//! GGML quantised blocks as GGUF stores them: plain dequantisation to f32 (what the oracle reads)
//! and the quantiser behind `moe-lanes quantize` and `synth --quant`.
//!
//! Block layouts (little-endian, `d`/`dmin` are f16):
//! - Q8_0, 32 values: `d`, 32 × i8 `q`; `x = d * q`.
//! - Q4_0, 32 values: `d`, 16 bytes; byte `j` holds value `j` (low nibble) and `j + 16` (high);
//!   `x = d * (q - 8)`.
//! - Q4_K, 256 values: `d`, `dmin`, 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles;
//!   each 64 values use 32 bytes (low nibbles first 32 values, high nibbles next 32);
//!   `x = (d * sc) * q - (dmin * m)`.
//! - Q5_K, 256 values: as Q4_K plus 32 bytes `qh` between the scales and the nibbles: bit
//!   `2i` / `2i + 1` of `qh[l]` is the fifth bit of value `l` / `l + 32` of the `i`-th 64.
//! - Q6_K, 256 values: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 × i8 scales (one
//!   per 16 values), `d`; `x = (d * sc) * (q - 32)`.
//! - MXFP4, 32 values: one E8M0 byte `e`, 16 bytes; byte `j` holds value `j` (low nibble) and
//!   `j + 16` (high); `x = kvalues[q] * 2^(e - 128)` with llama.cpp's doubled E2M1 table
//!   `kvalues` (0, 1, 2, 3, 4, 6, 8, 12 and their negatives). `e = 0xFF` (NaN in the MX spec) is
//!   read as llama.cpp's CPU code and gguf-py read it, `2^127` (see [`e8m0_half`]); the quantiser
//!   never writes it, and `moe-lanes quantize` refuses to read it ([`check_mxfp4_scales`]).
//! - Q5_0, 32 values: `d`, 4 bytes `qh` (a little-endian u32; bit `j` is the fifth bit of
//!   value `j`), 16 nibble bytes as Q4_0; `x = d * (q - 16)`.
//! - Q5_1, 32 values: `d`, `m`, `qh`, 16 nibble bytes; `x = d * q + m`.
//! - IQ4_NL, 32 values: `d`, 16 nibble bytes as Q4_0; `x = d * kvalues[q]` with llama.cpp's
//!   non-linear table [`IQ4_NL_VALUES`].
//!
//! The dequantisation is written for clarity and follows ggml's formulas operation by operation
//! in f32, so it equals gguf-py's `gguf.quants.dequantize` bit for bit (tests/quant_fixtures.rs).
//! The fast kernels keep their own copy (`moe-lanes-kernels`), as the oracle shares no code with
//! them.

use crate::format::dtype::DType;
use half::f16;

/// Values per Q4_0 / Q8_0 block.
pub const QK: usize = 32;
/// Values per K-quant super-block.
pub const QK_K: usize = 256;

/// A quantised row could not be written or read.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum QuantError {
    #[error("{dtype} is not a quantised block type")]
    NotQuantized { dtype: DType },
    #[error("{n_values} values are not a whole number of {dtype} blocks ({block_elems} values each)")]
    PartialBlock { dtype: DType, n_values: usize, block_elems: usize },
    #[error("{n_bytes} bytes do not hold {n_values} values of {dtype}")]
    ByteCount { dtype: DType, n_values: usize, n_bytes: usize },
    #[error("value {index} is {value}: {dtype} blocks hold finite values only")]
    NonFinite { dtype: DType, index: usize, value: f32 },
    #[error("{dtype} block {block} has the E8M0 scale 0xFF (NaN in the MX spec; llama.cpp's ggml_validate_row_data refuses it)")]
    NanScale { dtype: DType, block: usize },
}

/// llama.cpp's doubled E2M1 values (`kvalues_mxfp4`), indexed by an MXFP4 nibble.
pub const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// llama.cpp's IQ4_NL levels (`kvalues_iq4nl`), indexed by a nibble.
pub const IQ4_NL_VALUES: [i8; 16] =
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// `2^(e - 128)`, half the E8M0 scale, as llama.cpp's `ggml_e8m0_to_fp32_half` computes it (bit
/// patterns; `e = 0xFF` gives `2^127`, not NaN).
pub fn e8m0_half(e: u8) -> f32 {
    if e < 2 {
        f32::from_bits(0x0020_0000 << e)
    } else {
        f32::from_bits(((e as u32) - 1) << 23)
    }
}

/// Refuses MXFP4 bytes with a block whose scale is `0xFF`, as llama.cpp's `ggml_validate_row_data`
/// does (`bytes` whole blocks; other types pass).
pub fn check_mxfp4_scales(dtype: DType, bytes: &[u8]) -> Result<(), QuantError> {
    if dtype != DType::MXFP4 {
        return Ok(());
    }
    match bytes.chunks_exact(dtype.block_bytes()).position(|b| b[0] == 0xFF) {
        Some(block) => Err(QuantError::NanScale { dtype, block }),
        None => Ok(()),
    }
}

fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

fn check(dtype: DType, n_values: usize, n_bytes: usize) -> Result<(), QuantError> {
    if dtype.is_float() {
        return Err(QuantError::NotQuantized { dtype });
    }
    if !n_values.is_multiple_of(dtype.block_elems()) {
        return Err(QuantError::PartialBlock { dtype, n_values, block_elems: dtype.block_elems() });
    }
    if dtype.bytes_for(n_values) != Some(n_bytes) {
        return Err(QuantError::ByteCount { dtype, n_values, n_bytes });
    }
    Ok(())
}

/// Dequantise whole blocks of `dtype` from `bytes` into `out` (`out.len()` values).
pub fn dequantize(dtype: DType, bytes: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    check(dtype, out.len(), bytes.len())?;
    let (n, bb) = (dtype.block_elems(), dtype.block_bytes());
    for (block, y) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(n)) {
        match dtype {
            DType::Q8_0 => dequant_q8_0(block, y),
            DType::Q4_0 => dequant_q4_0(block, y),
            DType::Q4_K => dequant_q4_k(block, y),
            DType::Q5_K => dequant_q5_k(block, y),
            DType::Q6_K => dequant_q6_k(block, y),
            DType::MXFP4 => dequant_mxfp4(block, y),
            DType::Q5_0 => dequant_q5(block, 2, |q| (q as i32 - 16) as f32 * f16_at(block, 0), y),
            DType::Q5_1 => dequant_q5(block, 4, |q| q as f32 * f16_at(block, 0) + f16_at(block, 2), y),
            DType::IQ4_NL => dequant_iq4_nl(block, y),
            DType::F32 | DType::F16 | DType::BF16 => unreachable!("checked above"),
        }
    }
    Ok(())
}

/// Q5_0/Q5_1: the five-bit level of value `j` (nibble as Q4_0, bit `j` of the `qh` word at
/// `b[qh_at..]` as bit 4) through `value`.
fn dequant_q5(b: &[u8], qh_at: usize, value: impl Fn(u8) -> f32, y: &mut [f32]) {
    let qh = u32::from_le_bytes([b[qh_at], b[qh_at + 1], b[qh_at + 2], b[qh_at + 3]]);
    for j in 0..QK / 2 {
        let byte = b[qh_at + 4 + j];
        let high = |bit: usize| (((qh >> bit) & 1) as u8) << 4;
        y[j] = value((byte & 0x0F) | high(j));
        y[j + QK / 2] = value((byte >> 4) | high(j + QK / 2));
    }
}

fn dequant_iq4_nl(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..QK / 2 {
        let byte = b[2 + j];
        y[j] = d * IQ4_NL_VALUES[(byte & 0x0F) as usize] as f32;
        y[j + QK / 2] = d * IQ4_NL_VALUES[(byte >> 4) as usize] as f32;
    }
}

fn dequant_mxfp4(b: &[u8], y: &mut [f32]) {
    let d = e8m0_half(b[0]);
    for j in 0..QK / 2 {
        let byte = b[1 + j];
        y[j] = MXFP4_VALUES[(byte & 0x0F) as usize] as f32 * d;
        y[j + QK / 2] = MXFP4_VALUES[(byte >> 4) as usize] as f32 * d;
    }
}

fn dequant_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, out) in y.iter_mut().enumerate() {
        *out = d * (b[2 + j] as i8) as f32;
    }
}

fn dequant_q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..QK / 2 {
        let byte = b[2 + j];
        y[j] = d * ((byte & 0x0F) as i32 - 8) as f32;
        y[j + QK / 2] = d * ((byte >> 4) as i32 - 8) as f32;
    }
}

/// Scale and min of sub-block `j` (0..8) from the 12 packed bytes of a Q4_K/Q5_K block.
pub fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

fn dequant_q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for chunk in 0..4 {
        for half in 0..2 {
            let (sc, m) = scale_min_k4(2 * chunk + half, scales);
            let (d1, m1) = (d * sc as f32, dmin * m as f32);
            for l in 0..32 {
                let q = (qs[32 * chunk + l] >> (4 * half)) & 0x0F;
                y[64 * chunk + 32 * half + l] = d1 * q as f32 - m1;
            }
        }
    }
}

fn dequant_q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for chunk in 0..4 {
        for half in 0..2 {
            let (sc, m) = scale_min_k4(2 * chunk + half, scales);
            let (d1, m1) = (d * sc as f32, dmin * m as f32);
            let high_bit = 2 * chunk + half;
            for l in 0..32 {
                let low = (qs[32 * chunk + l] >> (4 * half)) & 0x0F;
                let high = ((qh[l] >> high_bit) & 1) << 4;
                y[64 * chunk + 32 * half + l] = d1 * (low | high) as f32 - m1;
            }
        }
    }
}

fn dequant_q6_k(b: &[u8], y: &mut [f32]) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for pos in 0..QK_K {
        let (half, within) = (pos / 128, pos % 128);
        let (quarter, l) = (within / 32, within % 32);
        // Quarters 0 and 2 share ql bytes 0..32 (low / high nibble), 1 and 3 bytes 32..64.
        let ql_byte = ql[64 * half + 32 * (quarter % 2) + l];
        let low = if quarter < 2 { ql_byte & 0x0F } else { ql_byte >> 4 };
        let high = (qh[32 * half + l] >> (2 * quarter)) & 3;
        let q = ((low | (high << 4)) as i32 - 32) as f32;
        y[pos] = (d * scales[pos / 16] as i8 as f32) * q;
    }
}

/// Quantise `values` (a whole number of blocks) into `out` as `dtype`; returns the bytes added.
pub fn quantize(dtype: DType, values: &[f32], out: &mut Vec<u8>) -> Result<usize, QuantError> {
    if dtype.is_float() {
        return Err(QuantError::NotQuantized { dtype });
    }
    if !values.len().is_multiple_of(dtype.block_elems()) {
        let (n_values, block_elems) = (values.len(), dtype.block_elems());
        return Err(QuantError::PartialBlock { dtype, n_values, block_elems });
    }
    if matches!(dtype, DType::MXFP4 | DType::Q5_0 | DType::Q5_1 | DType::IQ4_NL) {
        if let Some(index) = values.iter().position(|v| !v.is_finite()) {
            return Err(QuantError::NonFinite { dtype, index, value: values[index] });
        }
    }
    let before = out.len();
    for block in values.chunks_exact(dtype.block_elems()) {
        match dtype {
            DType::Q8_0 => quant_q8_0(block, out),
            DType::Q4_0 => quant_q4_0(block, out),
            DType::Q4_K => quant_k_asym(block, 15, out),
            DType::Q5_K => quant_k_asym(block, 31, out),
            DType::Q6_K => quant_q6_k(block, out),
            DType::MXFP4 => quant_mxfp4(block, out),
            DType::Q5_0 => quant_q5_0(block, out),
            DType::Q5_1 => quant_q5_1(block, out),
            DType::IQ4_NL => quant_iq4_nl(block, out),
            DType::F32 | DType::F16 | DType::BF16 => unreachable!("checked above"),
        }
    }
    Ok(out.len() - before)
}

fn push_f16(out: &mut Vec<u8>, v: f32) -> f32 {
    let h = f16::from_f32(v);
    out.extend_from_slice(&h.to_bits().to_le_bytes());
    h.to_f32()
}

fn round_clamp(v: f32, lo: i32, hi: i32) -> i32 {
    (v.round() as i32).clamp(lo, hi)
}

fn quant_q8_0(x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = push_f16(out, amax / 127.0);
    let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
    out.extend(x.iter().map(|v| round_clamp(v * inv, -127, 127) as i8 as u8));
}

fn quant_q4_0(x: &[f32], out: &mut Vec<u8>) {
    // The value of largest magnitude maps to -8 exactly, so its sign picks the scale's sign.
    let extreme = x.iter().fold(0.0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
    let d = push_f16(out, extreme / -8.0);
    let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
    let q = |v: f32| round_clamp(v * inv + 8.0, 0, 15) as u8;
    out.extend((0..QK / 2).map(|j| q(x[j]) | (q(x[j + QK / 2]) << 4)));
}

/// Best `(scale, min)` for `x ≈ scale * q - min` with `q` in `0..=nmax` and `min >= 0`: a grid
/// over the step count around `nmax`, each assignment also refitted by least squares; the
/// candidate with the least squared error wins.
fn fit_scale_min(x: &[f32], nmax: i32) -> (f32, f32) {
    let lo = x.iter().fold(f32::INFINITY, |a, &v| a.min(v)).min(0.0);
    let hi = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    if hi <= lo {
        return (0.0, -lo);
    }
    let error = |scale: f32, min: f32| -> f32 {
        x.iter()
            .map(|&v| {
                let q = if scale > 0.0 { round_clamp((v + min) / scale, 0, nmax) } else { 0 };
                let e = scale * q as f32 - min - v;
                e * e
            })
            .sum()
    };
    let mut best = ((hi - lo) / nmax as f32, -lo);
    let mut best_err = error(best.0, best.1);
    for step in 0..12 {
        let scale = (hi - lo) / (nmax as f32 - 1.0 + step as f32 * 0.2);
        let mut qs_buf = [0.0f32; QK];
        let qs = &mut qs_buf[..x.len()];
        qs.iter_mut().zip(x).for_each(|(q, &v)| *q = round_clamp((v - lo) / scale, 0, nmax) as f32);
        // The grid candidate's levels are `qs` (the same rounding of the same quotient), so its
        // error reuses them: a third fewer divisions and roundings, the same bits.
        let min = -lo;
        let grid_err: f32 = qs
            .iter()
            .zip(x)
            .map(|(&q, &v)| {
                let e = scale * q - min - v;
                e * e
            })
            .sum();
        let refit = least_squares(qs, x);
        for (candidate, err) in [((scale, min), grid_err), (refit, error(refit.0, refit.1))] {
            if candidate.0 > 0.0 && err < best_err {
                best = candidate;
                best_err = err;
            }
        }
    }
    best
}

/// `(a, m)` minimising `sum (a * q - m - x)^2` with `m >= 0`.
fn least_squares(qs: &[f32], x: &[f32]) -> (f32, f32) {
    let n = x.len() as f32;
    let (sq, sx) = (qs.iter().sum::<f32>(), x.iter().sum::<f32>());
    let sqq = qs.iter().map(|q| q * q).sum::<f32>();
    let sqx = qs.iter().zip(x).map(|(q, v)| q * v).sum::<f32>();
    let det = n * sqq - sq * sq;
    if det <= 0.0 || sqq <= 0.0 {
        return (0.0, 0.0);
    }
    let (a, b) = ((n * sqx - sq * sx) / det, (sqq * sx - sq * sqx) / det);
    if b <= 0.0 {
        (a, -b)
    } else {
        (sqx / sqq, 0.0)
    }
}

/// Q4_K (`nmax` 15) and Q5_K (`nmax` 31): 8 sub-blocks of 32 with 6-bit scales and mins.
fn quant_k_asym(x: &[f32], nmax: i32, out: &mut Vec<u8>) {
    let fits: Vec<(f32, f32)> = x.chunks_exact(32).map(|c| fit_scale_min(c, nmax)).collect();
    let max_scale = fits.iter().fold(0.0f32, |a, f| a.max(f.0));
    let max_min = fits.iter().fold(0.0f32, |a, f| a.max(f.1));
    let d = push_f16(out, max_scale / 63.0);
    let dmin = push_f16(out, max_min / 63.0);
    let q6 = |v: f32, unit: f32| if unit > 0.0 { round_clamp(v / unit, 0, 63) as u8 } else { 0 };
    let sc: Vec<u8> = fits.iter().map(|f| q6(f.0, d)).collect();
    let mn: Vec<u8> = fits.iter().map(|f| q6(f.1, dmin)).collect();
    let mut packed = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            packed[j] = sc[j];
            packed[j + 4] = mn[j];
        } else {
            packed[j + 4] = (sc[j] & 0x0F) | ((mn[j] & 0x0F) << 4);
            packed[j - 4] |= (sc[j] >> 4) << 6;
            packed[j] |= (mn[j] >> 4) << 6;
        }
    }
    out.extend_from_slice(&packed);
    let levels: Vec<u8> = (0..QK_K)
        .map(|i| {
            let (step, min) = (d * sc[i / 32] as f32, dmin * mn[i / 32] as f32);
            if step > 0.0 {
                round_clamp((x[i] + min) / step, 0, nmax) as u8
            } else {
                0
            }
        })
        .collect();
    if nmax > 15 {
        let mut qh = [0u8; 32];
        for (i, &q) in levels.iter().enumerate() {
            let (chunk, rest) = (i / 64, i % 64);
            qh[rest % 32] |= (q >> 4) << (2 * chunk + rest / 32);
        }
        out.extend_from_slice(&qh);
    }
    for chunk in 0..4 {
        let at = 64 * chunk;
        out.extend((0..32).map(|l| (levels[at + l] & 0x0F) | ((levels[at + 32 + l] & 0x0F) << 4)));
    }
}

/// MXFP4 as llama.cpp's `quantize_row_mxfp4_ref`: `e = floor(log2(max|x|)) - 2 + 127` (so the
/// largest value lands near the table's 6 = 12 / 2; 0 for an all-zero block, and 0 where a tiny
/// block would give a negative exponent, which C leaves undefined), then each value the nearest
/// table entry `kvalues[i] * 2^(e - 128)`, the first on ties (index 0, +0, before 8, -0).
fn quant_mxfp4(x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0.0f32, |a, v| if a < v.abs() { v.abs() } else { a });
    let e = if amax > 0.0 { (amax.log2().floor() - 2.0 + 127.0).max(0.0) as u8 } else { 0 };
    let d = e8m0_half(e);
    let best = |v: f32| -> u8 {
        let mut best = (0u8, (MXFP4_VALUES[0] as f32 * d - v).abs());
        for (i, &k) in MXFP4_VALUES.iter().enumerate().skip(1) {
            let err = (k as f32 * d - v).abs();
            if err < best.1 {
                best = (i as u8, err);
            }
        }
        best.0
    };
    out.push(e);
    out.extend((0..QK / 2).map(|j| best(x[j]) | (best(x[j + QK / 2]) << 4)));
}

/// Packs 32 five-bit levels as Q5_0/Q5_1 store them after their scales: the `qh` word (bit `j`
/// = bit 4 of level `j`), then the low nibbles of levels `j` and `j + 16` in byte `j`. As
/// llama.cpp packs them, only bits 0..5 of each level count.
fn push_q5_levels(levels: &[u8; QK], out: &mut Vec<u8>) {
    let qh = levels.iter().enumerate().fold(0u32, |qh, (j, &l)| qh | (((l as u32 & 0x10) >> 4) << j));
    out.extend(qh.to_le_bytes());
    out.extend((0..QK / 2).map(|j| (levels[j] & 0x0F) | ((levels[j + QK / 2] & 0x0F) << 4)));
}

/// Q5_0 as llama.cpp's `quantize_row_q5_0_ref`: the value of largest magnitude (the first on
/// ties) maps to level 0 (`d = max / -16`); each value `x / d + 16.5` truncated (f32
/// arithmetic, `1 / d` from the unrounded `d`) and capped at 31.
fn quant_q5_0(x: &[f32], out: &mut Vec<u8>) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            (amax, max) = (v.abs(), v);
        }
    }
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend(f16::from_f32(d).to_bits().to_le_bytes());
    let levels: [u8; QK] = std::array::from_fn(|j| ((x[j] * id + 16.5) as i8).min(31) as u8);
    push_q5_levels(&levels, out);
}

/// Q5_1 as llama.cpp's `quantize_row_q5_1_ref`: `d = (max - min) / 31`, `m = min`, each
/// value `(x - min) / d + 0.5` truncated (f32 arithmetic, `1 / d` from the unrounded `d`) and,
/// as gguf-py does, capped at 31.
fn quant_q5_1(x: &[f32], out: &mut Vec<u8>) {
    let (min, max) = x.iter().fold((f32::MAX, -f32::MAX), |(lo, hi), &v| {
        (if v < lo { v } else { lo }, if v > hi { v } else { hi })
    });
    let d = (max - min) / 31.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend(f16::from_f32(d).to_bits().to_le_bytes());
    out.extend(f16::from_f32(min).to_bits().to_le_bytes());
    let levels: [u8; QK] = std::array::from_fn(|j| (((x[j] - min) * id + 0.5) as u8).min(31));
    push_q5_levels(&levels, out);
}

/// The index of the entry of the ascending `values` nearest `x` (the upper one on ties), as
/// llama.cpp's `best_index_int8`.
fn nearest_level(values: &[i8; 16], x: f32) -> usize {
    if x <= values[0] as f32 {
        return 0;
    }
    if x >= values[15] as f32 {
        return 15;
    }
    let (mut lo, mut hi) = (0, 15);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if x < values[mid] as f32 {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    if x - (values[hi - 1] as f32) < values[hi] as f32 - x {
        hi - 1
    } else {
        hi
    }
}

/// IQ4_NL as llama.cpp's `quantize_row_iq4_nl_ref` (no importance matrix, no scale search): the
/// value of largest magnitude picks `d = max / -127`, each value the nearest table level of
/// `x / d`, then `d` refitted by least squares weighted by `x^2`; blocks with `max|x| < 1e-15`
/// get `d = 0`.
fn quant_iq4_nl(x: &[f32], out: &mut Vec<u8>) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            (amax, max) = (v.abs(), v);
        }
    }
    let mut levels = [0u8; QK];
    let mut d = 0.0f32;
    if amax >= 1e-15 {
        let id = 1.0 / (max / IQ4_NL_VALUES[0] as f32);
        let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
        for (l, &v) in levels.iter_mut().zip(x) {
            *l = nearest_level(&IQ4_NL_VALUES, id * v) as u8;
            let (q, w) = (IQ4_NL_VALUES[*l as usize] as f32, v * v);
            sumqx += w * q * v;
            sumq2 += w * q * q;
        }
        d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
    }
    out.extend(f16::from_f32(d).to_bits().to_le_bytes());
    out.extend((0..QK / 2).map(|j| levels[j] | (levels[j + QK / 2] << 4)));
}

/// Q6_K: 16 sub-blocks of 16 with signed 8-bit scales under one f16 `d`, values in -32..=31.
fn quant_q6_k(x: &[f32], out: &mut Vec<u8>) {
    // Per sub-block the value of largest magnitude maps to -32, as Q4_0 does with -8.
    let scales: Vec<f32> = x
        .chunks_exact(16)
        .map(|c| c.iter().fold(0.0f32, |a, &v| if v.abs() > a.abs() { v } else { a }) / -32.0)
        .collect();
    let extreme = scales.iter().fold(0.0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
    let d = f16::from_f32(extreme / -128.0).to_f32();
    let sc: Vec<i8> =
        scales.iter().map(|&s| if d != 0.0 { round_clamp(s / d, -128, 127) as i8 } else { 0 }).collect();
    let levels: Vec<u8> = (0..QK_K)
        .map(|i| {
            let step = d * sc[i / 16] as f32;
            let q = if step != 0.0 { round_clamp(x[i] / step, -32, 31) } else { 0 };
            (q + 32) as u8
        })
        .collect();
    let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
    for half in 0..2 {
        for l in 0..32 {
            let at = 128 * half + l;
            let [q1, q2, q3, q4] = [levels[at], levels[at + 32], levels[at + 64], levels[at + 96]];
            ql[64 * half + l] = (q1 & 0x0F) | ((q3 & 0x0F) << 4);
            ql[64 * half + 32 + l] = (q2 & 0x0F) | ((q4 & 0x0F) << 4);
            qh[32 * half + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
    out.extend_from_slice(&ql);
    out.extend_from_slice(&qh);
    out.extend(sc.iter().map(|&s| s as u8));
    push_f16(out, d);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32 - 0.5) * 0.2
            })
            .collect()
    }

    /// Round trip error per type, relative to the row's largest magnitude `amax`: the worst value
    /// within about one quantisation step (`amax / 8` for Q4_0, about `2 amax / 15` for Q4_K over
    /// a sub-block's range, halving per extra bit), the RMS error well below half a step.
    #[test]
    fn quantize_then_dequantize_is_close() {
        let x = values(1024, 7);
        let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        for (dtype, worst_bound, rms_bound) in [
            (DType::Q8_0, 0.005, 0.003),
            (DType::Q4_0, 0.13, 0.05),
            (DType::Q4_K, 0.13, 0.05),
            (DType::Q5_K, 0.065, 0.025),
            (DType::Q6_K, 0.035, 0.012),
            (DType::MXFP4, 0.17, 0.07),
            (DType::Q5_0, 0.0626, 0.02),
            (DType::Q5_1, 0.035, 0.02),
            (DType::IQ4_NL, 0.13, 0.05),
        ] {
            let mut bytes = Vec::new();
            assert_eq!(quantize(dtype, &x, &mut bytes).unwrap(), dtype.bytes_for(x.len()).unwrap());
            let mut y = vec![0.0; x.len()];
            dequantize(dtype, &bytes, &mut y).unwrap();
            let worst = x.iter().zip(&y).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max) / amax;
            let rms = (x.iter().zip(&y).map(|(a, b)| (a - b) * (a - b)).sum::<f32>() / x.len() as f32).sqrt()
                / amax;
            eprintln!("{dtype}: worst {worst:.4} rms {rms:.4} (of amax)");
            assert!(worst <= worst_bound && rms <= rms_bound, "{dtype}: worst {worst} rms {rms}");
        }
    }

    proptest::proptest! {
        /// MXFP4 round trips, for any block of finite values: the scale is llama.cpp's
        /// (`max|x|` in `[4, 8)` times `2^(e - 127)`, or `e = 0` for a zero block), every value
        /// is the nearest table entry under that scale (no other entry closer), quantising the
        /// dequantised block gives the same bytes, and the error is at most a quarter of
        /// `max|x|` (the gap from 6 to 8 units at the top of the scale).
        #[test]
        fn mxfp4_round_trip_properties(
            values in proptest::collection::vec(-1.0e3f32..1.0e3, 32),
            exponent in -30i32..30,
        ) {
            let x: Vec<f32> = values.iter().map(|v| v * 2f32.powi(exponent)).collect();
            let mut bytes = Vec::new();
            quantize(DType::MXFP4, &x, &mut bytes).unwrap();
            let mut y = vec![0.0f32; 32];
            dequantize(DType::MXFP4, &bytes, &mut y).unwrap();
            let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let e = bytes[0];
            if amax > 0.0 {
                let unit = 2f64.powi(e as i32 - 127);
                let ratio = amax as f64 / unit;
                // f32 log2 rounds up just below a power of two (as llama.cpp's log2f does): a
                // ratio a hair under 4 is llama.cpp's choice too.
                proptest::prop_assert!((4.0 * (1.0 - 1e-6)..8.0).contains(&ratio), "amax {amax} e {e}");
            } else {
                proptest::prop_assert_eq!(e, 0);
            }
            let d = e8m0_half(e);
            for (&v, &q) in x.iter().zip(&y) {
                let err = (q - v).abs();
                for k in MXFP4_VALUES {
                    proptest::prop_assert!(err <= (k as f32 * d - v).abs(), "{v}: {q} while {k} is closer");
                }
                proptest::prop_assert!(err <= 0.25 * amax, "{v}: {q}");
            }
            let mut again = Vec::new();
            quantize(DType::MXFP4, &y, &mut again).unwrap();
            proptest::prop_assert_eq!(again, bytes);
        }

        /// Negating a block flips the sign bit of every nonzero level and keeps the scale.
        #[test]
        fn mxfp4_is_sign_symmetric(values in proptest::collection::vec(-10.0f32..10.0, 32)) {
            let neg: Vec<f32> = values.iter().map(|v| -v).collect();
            let (mut a, mut b) = (Vec::new(), Vec::new());
            quantize(DType::MXFP4, &values, &mut a).unwrap();
            quantize(DType::MXFP4, &neg, &mut b).unwrap();
            proptest::prop_assert_eq!(a[0], b[0]);
            for (&p, &n) in a[1..].iter().zip(&b[1..]) {
                for shift in [0, 4] {
                    let (p, n) = ((p >> shift) & 15, (n >> shift) & 15);
                    let flipped = if p == 0 { 0 } else { p ^ 8 };
                    proptest::prop_assert_eq!(n, flipped);
                }
            }
        }
    }

    /// The f16 of `v` widened back (what a block stores for a scale or min).
    fn f16_round(v: f32) -> f32 {
        f16::from_f32(v).to_f32()
    }

    proptest::proptest! {
        /// Q5_0 round trips: the value of largest magnitude is exactly level 0 (`d = max / -16`),
        /// every value within `|d|` (half a step, or a whole one for `-max`, capped at level 31)
        /// plus the f16 rounding of `d` over 16 steps; quantising the dequantised block gives the
        /// same bytes (its extreme is `-16 d` again).
        #[test]
        fn q5_0_round_trip_properties(
            values in proptest::collection::vec(-100.0f32..100.0, 32),
            exponent in -6i32..6,
        ) {
            let x: Vec<f32> = values.iter().map(|v| v * 2f32.powi(exponent)).collect();
            let (amax, max) = x.iter().fold((0.0f32, 0.0f32), |(a, m), &v| if a < v.abs() { (v.abs(), v) } else { (a, m) });
            proptest::prop_assume!(amax > 0.1);
            let mut bytes = Vec::new();
            quantize(DType::Q5_0, &x, &mut bytes).unwrap();
            let mut y = vec![0.0f32; 32];
            dequantize(DType::Q5_0, &bytes, &mut y).unwrap();
            let d = max / -16.0;
            let bound = d.abs() * 1.0001 + 16.0 * (f16_round(d) - d).abs();
            for (&v, &q) in x.iter().zip(&y) {
                proptest::prop_assert!((q - v).abs() <= bound, "{v}: {q}, bound {bound}");
            }
            let mut again = Vec::new();
            quantize(DType::Q5_0, &y, &mut again).unwrap();
            proptest::prop_assert_eq!(again, bytes);
        }

        /// Q5_1 round trips: `m` is the f16 of the block's minimum, every value within half a
        /// step `d = (max - min) / 31` plus the f16 roundings of `d` (over 31 steps) and `m`.
        #[test]
        fn q5_1_round_trip_properties(
            values in proptest::collection::vec(-100.0f32..100.0, 32),
            exponent in -6i32..6,
        ) {
            let x: Vec<f32> = values.iter().map(|v| v * 2f32.powi(exponent)).collect();
            let min = x.iter().fold(f32::MAX, |a, &v| a.min(v));
            let max = x.iter().fold(-f32::MAX, |a, &v| a.max(v));
            let mut bytes = Vec::new();
            quantize(DType::Q5_1, &x, &mut bytes).unwrap();
            proptest::prop_assert_eq!(f16_at(&bytes, 2), f16_round(min));
            let mut y = vec![0.0f32; 32];
            dequantize(DType::Q5_1, &bytes, &mut y).unwrap();
            let d = (max - min) / 31.0;
            let bound = d * 0.5001 + 31.0 * (f16_round(d) - d).abs() + (f16_round(min) - min).abs() + 1e-6 * max.abs().max(min.abs());
            for (&v, &q) in x.iter().zip(&y) {
                proptest::prop_assert!((q - v).abs() <= bound, "{v}: {q}, bound {bound}");
            }
        }

        /// IQ4_NL round trips within 15% of `max|x|` (half the table's widest gap, 24 of 127, is
        /// 9.4%; the refitted scale moves the levels a little), and the sign of the value of
        /// largest magnitude is kept.
        #[test]
        fn iq4_nl_round_trip_error_is_bounded(
            values in proptest::collection::vec(-100.0f32..100.0, 32),
            exponent in -6i32..6,
        ) {
            let x: Vec<f32> = values.iter().map(|v| v * 2f32.powi(exponent)).collect();
            let (amax, max) = x.iter().fold((0.0f32, 0.0f32), |(a, m), &v| if v.abs() > a { (v.abs(), v) } else { (a, m) });
            proptest::prop_assume!(amax > 0.1);
            let mut bytes = Vec::new();
            quantize(DType::IQ4_NL, &x, &mut bytes).unwrap();
            let mut y = vec![0.0f32; 32];
            dequantize(DType::IQ4_NL, &bytes, &mut y).unwrap();
            for (&v, &q) in x.iter().zip(&y) {
                proptest::prop_assert!((q - v).abs() <= 0.15 * amax, "{v}: {q}");
                if v == max {
                    proptest::prop_assert!(q * v > 0.0, "{v}: {q}");
                }
            }
        }
    }

    #[test]
    fn q5_and_iq4_nl_refuse_non_finite_values_and_zero_blocks_decode_to_zero() {
        for dtype in [DType::Q5_0, DType::Q5_1, DType::IQ4_NL] {
            let mut x = vec![0.5f32; 64];
            x[33] = f32::NAN;
            let err = quantize(dtype, &x, &mut Vec::new()).unwrap_err();
            assert!(matches!(err, QuantError::NonFinite { index: 33, .. }), "{err}");
            let mut bytes = Vec::new();
            quantize(dtype, &[0.0; 32], &mut bytes).unwrap();
            let mut y = [1.0f32; 32];
            dequantize(dtype, &bytes, &mut y).unwrap();
            assert!(y.iter().all(|&v| v == 0.0), "{dtype}: {y:?}");
        }
    }

    #[test]
    fn q5_layout_puts_the_fifth_bits_in_a_little_endian_word() {
        // Q5_0 with d = 1: value j = level j - 16. Level 31 at 0 and 17 (fifth bits 0 and 17),
        // level 16 elsewhere except 1 (level 0).
        let mut block = vec![0u8; 22];
        block[..2].copy_from_slice(&f16::from_f32(1.0).to_bits().to_le_bytes());
        let qh: u32 = (1 << 0) | (1 << 17) | !((1 << 1) | (1 << 0) | (1 << 17));
        block[2..6].copy_from_slice(&qh.to_le_bytes());
        block[6] = 0x0F; // value 0 low nibble 15, value 16 high nibble 0
        block[7] = 0xF0; // value 1 nibble 0, value 17 nibble 15
        let mut y = [f32::NAN; 32];
        dequantize(DType::Q5_0, &block, &mut y).unwrap();
        assert_eq!((y[0], y[1], y[16], y[17], y[2]), (15.0, -16.0, 0.0, 15.0, 0.0));
    }

    #[test]
    fn mxfp4_refuses_non_finite_values() {
        let mut x = vec![0.5f32; 64];
        x[40] = f32::NAN;
        let err = quantize(DType::MXFP4, &x, &mut Vec::new()).unwrap_err();
        assert!(matches!(err, QuantError::NonFinite { index: 40, .. }), "{err}");
        x[40] = f32::INFINITY;
        assert!(quantize(DType::MXFP4, &x, &mut Vec::new()).is_err());
    }

    #[test]
    fn bad_lengths_are_errors() {
        let mut out = Vec::new();
        assert!(matches!(quantize(DType::Q4_K, &[0.0; 32], &mut out), Err(QuantError::PartialBlock { .. })));
        assert!(matches!(quantize(DType::F32, &[0.0; 32], &mut out), Err(QuantError::NotQuantized { .. })));
        let mut y = [0.0; 32];
        assert!(matches!(dequantize(DType::Q8_0, &[0; 33], &mut y), Err(QuantError::ByteCount { .. })));
    }
}
