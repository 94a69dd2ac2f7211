//! Shared helpers for the kernel tests: seeded random data and misaligned weight buffers.

#![allow(dead_code)]

pub mod cuda;

use moe_lanes_kernels::{SimdLevel, WeightDType};

/// Normwise relative tolerance of every level whose products are exact f32 (scalar, AVX2,
/// AVX-512F, and AVX-512 BF16 for F16/F32 weights): only the summation order differs.
pub const F32_ACCUMULATION_TOLERANCE: f64 = 1e-4;
/// Normwise relative tolerance of a cold-pool call with 8-bit activations (x and h each rounded
/// per block of 32 to 1/254 of the block's max |x|) against the f32 oracle.
pub const Q8_ACTIVATION_TOLERANCE: f64 = 2e-2;
/// Normwise relative tolerance of `vdpbf16ps` (activations rounded to BF16, 8-bit mantissa).
pub const BF16_DOT_TOLERANCE: f64 = 1e-2;

pub fn tolerance(level: SimdLevel, dtype: WeightDType) -> f64 {
    if level == SimdLevel::Avx512Bf16 && dtype == WeightDType::BF16 {
        BF16_DOT_TOLERANCE
    } else {
        F32_ACCUMULATION_TOLERANCE
    }
}

/// Deterministic xorshift generator.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Uniform in [-scale, scale).
    pub fn symmetric(&mut self, scale: f32) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.symmetric(scale)).collect()
    }
}

/// Weight bytes stored one byte past an allocation start, so the kernels see unaligned data.
pub struct MisalignedBytes(Vec<u8>);

impl MisalignedBytes {
    pub fn new(dtype: WeightDType, values: &[f32]) -> MisalignedBytes {
        let mut bytes = vec![0u8];
        bytes.extend(dtype.encode(values));
        MisalignedBytes(bytes)
    }
    pub fn bytes(&self) -> &[u8] {
        &self.0[1..]
    }
}

impl From<QuantBytes> for MisalignedBytes {
    fn from(q: QuantBytes) -> MisalignedBytes {
        MisalignedBytes(q.0)
    }
}

/// ||a - b||_2 / max(||reference||_2, tiny).
pub fn relative_error(actual: &[f32], reference: &[f32]) -> f64 {
    assert_eq!(actual.len(), reference.len());
    let diff: f64 = actual.iter().zip(reference).map(|(a, r)| ((a - r) as f64).powi(2)).sum();
    let norm: f64 = reference.iter().map(|r| (*r as f64).powi(2)).sum();
    (diff / norm.max(1e-30)).sqrt()
}

/// Random quantised rows (random bytes, f16 scales set to small values), one byte past an
/// allocation start so the kernels see unaligned blocks.
pub struct QuantBytes(Vec<u8>);

impl QuantBytes {
    pub fn random(rng: &mut Rng, dtype: WeightDType, rows: usize, cols: usize, scale: f32) -> QuantBytes {
        let n_bytes = rows * dtype.row_bytes(cols);
        let mut bytes: Vec<u8> = (0..n_bytes + 1).map(|_| rng.next_u64() as u8).collect();
        let scale_at: &[usize] = match dtype {
            WeightDType::Q8_0 | WeightDType::Q4_0 | WeightDType::Q5_0 | WeightDType::Iq4Nl => &[0],
            WeightDType::Q4_K | WeightDType::Q5_K | WeightDType::Q5_1 => &[0, 2],
            WeightDType::Mxfp4 => &[],
            _ => &[208],
        };
        if dtype == WeightDType::Mxfp4 {
            for block in bytes[1..].chunks_exact_mut(dtype.block_bytes()) {
                block[0] = mxfp4_scale_byte(rng, scale);
            }
        }
        for block in bytes[1..].chunks_exact_mut(dtype.block_bytes()) {
            for &at in scale_at {
                let d = half::f16::from_f32(rng.symmetric(scale)).to_bits().to_le_bytes();
                block[at..at + 2].copy_from_slice(&d);
            }
        }
        QuantBytes(bytes)
    }
    pub fn bytes(&self) -> &[u8] {
        &self.0[1..]
    }
}

/// A random MXFP4 E8M0 scale byte whose largest values (12 doubled levels) are about `scale`
/// or a few times smaller.
pub fn mxfp4_scale_byte(rng: &mut Rng, scale: f32) -> u8 {
    let top = (128.0 + (scale / 12.0).log2()).floor() as i64;
    (top - (rng.next_u64() % 3) as i64).clamp(0, 254) as u8
}

/// The 8-bit activation rounding bound of `moe_lanes_kernels::q8` for one output: per block of
/// 32, `max|x| / 254` times the block's `Σ |w|` (`w` the dequantised weights), slightly widened
/// for the f32 rounding of the scale.
pub fn q8_rounding_bound(w: &[f32], x: &[f32]) -> f64 {
    w.chunks(32)
        .zip(x.chunks(32))
        .map(|(w, x)| {
            let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
            amax / 254.0 * 1.0001 * w.iter().map(|v| v.abs() as f64).sum::<f64>()
        })
        .sum()
}
