//! Shared helpers for the kernel tests: seeded random data and misaligned weight buffers.

#![allow(dead_code)]

pub mod cuda;

use moe_lanes_kernels::{SimdLevel, WeightDType};

/// Normwise relative tolerance of every level whose products are exact f32 (scalar, AVX2,
/// AVX-512F, and AVX-512 BF16 for F16/F32 weights): only the summation order differs.
pub const F32_ACCUMULATION_TOLERANCE: f64 = 1e-4;
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

/// ||a - b||_2 / max(||reference||_2, tiny).
pub fn relative_error(actual: &[f32], reference: &[f32]) -> f64 {
    assert_eq!(actual.len(), reference.len());
    let diff: f64 = actual.iter().zip(reference).map(|(a, r)| ((a - r) as f64).powi(2)).sum();
    let norm: f64 = reference.iter().map(|r| (*r as f64).powi(2)).sum();
    (diff / norm.max(1e-30)).sqrt()
}
