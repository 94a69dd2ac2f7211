//! 8-bit activations for the integer tiles (as llama.cpp's `q8` activations): one token at a
//! time for experts of up to [`Q8_MAX_TOKENS`] tokens, and the many-token Q4_K, Q5_K, Q6_K,
//! Q8_0 and MXFP4 tiles (`x86_quant_gemm.rs`) for more.
//!
//! [`Q8Activations`] holds rows of activations quantised per block of 32 values: `d = max|x| /
//! 127`, `q = round_ties_even(x * 127 / max|x|)` (i8, |q| <= 127), and per block `d` and `sum =
//! d * Σq` (the K-quant mins multiply it). The VNNI tiles (`x86_quant_vnni.rs`) dot the raw
//! weight levels (u8) against `q` with `vpdpbusd` and apply `d_w * d` once per (sub-)block; on
//! CPUs without VNNI the AVX2 one-token tiles (`x86_quant_q8_avx2.rs`: Q4_0, Q4_K, Q5_K, Q6_K) do the
//! same with `vpmaddubsw` ([`crate::SimdLevel::has_q8_tile`]).
//!
//! **Error bound.** Each value is rounded by at most half a step, `|x_i - d_b q_i| <= d_b / 2`
//! (`d_b` of the value's block `b`); the integer dots are exact, so an output differs from the
//! exact `Σ_i w_i x_i` (`w_i` the dequantised weight) by at most
//! `Σ_b (d_b / 2) Σ_{i in b} |w_i|` (= `Σ_b max_b|x| / 254 · Σ_{i in b} |w_i|`, i.e. at most
//! `1/254` of `Σ |w_i| max_b|x|`), plus f32 rounding of the per-block scale products and the
//! sums (relative `~1e-6` of `Σ |w_i||x_i|`). For activations of even magnitude within blocks
//! (max/mean |x| about 2) that is about 1% of `Σ |w||x|`, typically (random signs) far less.

use serde::{Deserialize, Serialize};

use crate::error::KernelError;
use crate::weights::WeightDType;

/// Values per activation block (the scale `d` and `sum` are per block).
pub const Q8_BLOCK: usize = 32;

/// How the few-token decode tiles of quantised weights take their activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DecodeActivations {
    /// f32 activations (dequantised weights times f32; f32 rounding only).
    #[default]
    F32,
    /// 8-bit activations against the raw weight levels (`vpdpbusd`, AVX-512 VNNI) for every
    /// quantised type: faster for most, with the rounding bound of the module docs. AVX2 (and
    /// AVX-512 without VNNI) takes them for Q4_0, Q4_K, Q5_K and Q6_K; other types there, and levels
    /// below AVX2, run F32.
    Q8,
    /// 8-bit activations for the types they measured faster on (Q4_0, Q4_K, Q5_K, Q6_K, MXFP4), f32
    /// for Q8_0, whose f32 tile runs as fast (near the read bandwidth; benches/RESULTS.md). The
    /// default where the level has 8-bit tiles. Experts of more than [`Q8_MAX_TOKENS`] tokens take 8 bits
    /// under Q8 and Auto alike, for the types the many-token VNNI tiles take (Q8_0 too).
    Auto,
}

impl DecodeActivations {
    /// `f32`, `q8` or `auto`.
    pub fn name(self) -> &'static str {
        match self {
            DecodeActivations::F32 => "f32",
            DecodeActivations::Q8 => "q8",
            DecodeActivations::Auto => "auto",
        }
    }

    /// Parses `f32`, `q8` or `auto` (case-insensitive).
    pub fn parse(name: &str) -> Result<DecodeActivations, KernelError> {
        match name.trim().to_ascii_lowercase().as_str() {
            "f32" => Ok(DecodeActivations::F32),
            "q8" => Ok(DecodeActivations::Q8),
            "auto" => Ok(DecodeActivations::Auto),
            _ => Err(KernelError::UnknownActivations { name: name.to_string() }),
        }
    }

    /// What runs at `level`: the requested setting (default [`DecodeActivations::Auto`]) where
    /// the level has integer tiles (AVX2 and up: [`crate::SimdLevel::has_q8_tiles`]), else F32.
    pub fn resolve(requested: Option<DecodeActivations>, level: crate::SimdLevel) -> DecodeActivations {
        requested.unwrap_or(DecodeActivations::Auto).at(level)
    }

    /// Which few-token tiles take 8-bit activations, in words (for reports).
    pub fn describe(self) -> &'static str {
        match self {
            DecodeActivations::F32 => "f32 for every type",
            DecodeActivations::Q8 => "8-bit for every quantised type",
            DecodeActivations::Auto => "8-bit for Q4_0, Q4_K, Q5_K, Q6_K, MXFP4; f32 for Q8_0",
        }
    }

    /// [`DecodeActivations::describe`] at `level`: without VNNI only AVX2's tiles' types.
    pub fn describe_at(self, level: crate::SimdLevel) -> &'static str {
        match self.at(level) {
            DecodeActivations::F32 => "f32 for every type",
            _ if level.has_q8_dot() => self.describe(),
            _ => "8-bit for Q4_0, Q4_K, Q5_K, Q6_K (AVX2 tiles); f32 for the others",
        }
    }

    /// This setting where `level` runs integer tiles, F32 where it does not.
    pub fn at(self, level: crate::SimdLevel) -> DecodeActivations {
        if level.has_q8_tiles() {
            self
        } else {
            DecodeActivations::F32
        }
    }

    /// Whether the few-token tiles of `dtype` take 8-bit activations under this setting (whether
    /// the level has such a tile is checked apart: [`crate::SimdLevel::has_q8_tile`]).
    pub fn q8_for(self, dtype: WeightDType) -> bool {
        match self {
            DecodeActivations::F32 => false,
            DecodeActivations::Q8 => dtype.is_quantized(),
            DecodeActivations::Auto => dtype.is_quantized() && dtype != WeightDType::Q8_0,
        }
    }
}

impl DecodeActivations {
    /// Whether a product of `n_tokens` tokens over `dtype` rows takes 8-bit activations at
    /// `level`: at most [`Q8_MAX_TOKENS`] tokens (one without VNNI: AVX2's tiles lost prefill
    /// speed on experts of 2-4 tokens, benches/RESULTS.md session 35), a type this setting takes
    /// 8-bit ([`DecodeActivations::q8_for`]) and a one-token tile for it at the level, or more tokens,
    /// a setting other than F32 and a type whose many-token VNNI tiles take them
    /// (`ffn::q8_many_tokens`: Q8_0 too under Auto, whose many-token tiles beat the f32 ones where
    /// its one-token tile does not; never without VNNI).
    pub(crate) fn takes(self, level: crate::SimdLevel, dtype: WeightDType, n_tokens: usize) -> bool {
        match n_tokens <= Q8_MAX_TOKENS {
            // AVX2's tiles take one token: a few tokens share the f32 tiles' decoded blocks
            true => level.has_q8_tile(dtype) && self.q8_for(dtype) && (n_tokens == 1 || level.has_q8_dot()),
            false => self != DecodeActivations::F32 && crate::ffn::q8_many_tokens(level, dtype),
        }
    }
}

impl std::fmt::Display for DecodeActivations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DecodeActivations {
    type Err = KernelError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DecodeActivations::parse(s)
    }
}

/// One quantised row as the tiles read it: `cols` i8 at `qs`, `cols / 32` f32 at `d` and `sum`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Q8Row {
    pub qs: *const i8,
    pub d: *const f32,
    pub sum: *const f32,
}

/// Most tokens of an expert whose tiles take 8-bit activations: each token runs the one-token
/// integer tile over a row block while it is in cache, which beats dequantising the rows to f32
/// for a few tokens (`bench-kernels` "layer 25% hot", experts of 1-3 tokens); beyond this the
/// f32 tiles share each dequantised block across their tokens (or, for Q4_K, Q5_K, Q6_K, Q8_0
/// and MXFP4, the many-token VNNI tiles take them).
pub const Q8_MAX_TOKENS: usize = 4;

/// The 8-bit rows of an expert's tokens: token `t` is row `ids[t]` (listed) or `first + t` of a
/// buffer of `cols`-value rows with base pointers `base` (`qs`, `d`, `sum`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Q8Rows<'a> {
    pub base: (*const i8, *const f32, *const f32),
    pub cols: usize,
    pub ids: Q8RowIds<'a>,
}

/// Which rows of a [`Q8Rows`] buffer an expert's tokens take.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Q8RowIds<'a> {
    /// Token `t` is row `ids[t]` (rows by token id).
    Listed(&'a [u32]),
    /// Token `t` is row `first + t` (rows by routed slot).
    From(usize),
}

impl Q8Rows<'_> {
    /// Token `t`'s row (pointer arithmetic only; the caller's contract says the row is there).
    pub(crate) fn row(&self, t: usize) -> Q8Row {
        let r = match self.ids {
            Q8RowIds::Listed(ids) => ids[t] as usize,
            Q8RowIds::From(first) => first + t,
        };
        let b = r * self.cols / Q8_BLOCK;
        Q8Row {
            qs: self.base.0.wrapping_add(r * self.cols),
            d: self.base.1.wrapping_add(b),
            sum: self.base.2.wrapping_add(b),
        }
    }
}

/// Rows of 8-bit activations (see the module docs); the buffers only grow.
#[derive(Debug, Default, Clone)]
pub struct Q8Activations {
    qs: Vec<i8>,
    d: Vec<f32>,
    sum: Vec<f32>,
    cols: usize,
}

impl Q8Activations {
    /// An empty buffer.
    pub const fn new() -> Q8Activations {
        Q8Activations { qs: Vec::new(), d: Vec::new(), sum: Vec::new(), cols: 0 }
    }

    /// Room for `rows` rows of `cols` values (a multiple of 32); contents unspecified.
    pub fn reserve_rows(&mut self, rows: usize, cols: usize) -> Result<(), KernelError> {
        if !cols.is_multiple_of(Q8_BLOCK) {
            return Err(KernelError::ShapeMismatch {
                what: "q8 columns (multiple of 32)",
                expected: 32,
                actual: cols,
            });
        }
        self.cols = cols;
        if self.qs.len() < rows * cols {
            self.qs.resize(rows * cols, 0);
            self.d.resize(rows * cols / Q8_BLOCK, 0.0);
            self.sum.resize(rows * cols / Q8_BLOCK, 0.0);
        }
        Ok(())
    }

    /// Quantises `x` (a multiple of 32 values) into one row.
    pub fn quantize(x: &[f32]) -> Result<Q8Activations, KernelError> {
        let mut q = Q8Activations::new();
        q.reserve_rows(1, x.len())?;
        q.quantize_row(0, x);
        Ok(q)
    }

    /// Quantises `x` (`cols` values) into row `row` (room reserved).
    ///
    /// # Panics
    /// When the row is out of the reserved room or `x` is not `cols` long.
    pub fn quantize_row(&mut self, row: usize, x: &[f32]) {
        let cols = self.cols;
        assert_eq!(x.len(), cols, "one row of {cols}");
        assert!((row + 1) * cols <= self.qs.len(), "row {row} reserved");
        let b0 = row * cols / Q8_BLOCK;
        // SAFETY: the three ranges lie inside the buffers (asserted above), `x` holds `cols`.
        unsafe {
            quantize_raw(
                x.as_ptr(),
                cols,
                self.qs.as_mut_ptr().add(row * cols),
                self.d.as_mut_ptr().add(b0),
                self.sum.as_mut_ptr().add(b0),
            )
        };
    }

    /// Columns per row.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Values of every reserved row (rows times columns).
    pub fn reserved_values(&self) -> usize {
        self.qs.len()
    }

    /// Row `row`'s values as the tiles see them, `d * q` (the activations the Q8 path dots).
    pub fn dequantized(&self, row: usize) -> Vec<f32> {
        let qs = &self.qs[row * self.cols..][..self.cols];
        let d = &self.d[row * self.cols / Q8_BLOCK..];
        qs.iter().enumerate().map(|(i, &q)| d[i / Q8_BLOCK] * q as f32).collect()
    }

    /// Rows `first..` as a [`Q8Rows`] (token `t` is row `first + t`); row `first` reserved.
    pub(crate) fn rows_from(&self, first: usize) -> Q8Rows<'_> {
        assert!((first + 1) * self.cols <= self.qs.len(), "row {first} reserved");
        Q8Rows {
            base: (self.qs.as_ptr(), self.d.as_ptr(), self.sum.as_ptr()),
            cols: self.cols,
            ids: Q8RowIds::From(first),
        }
    }

    /// Raw writable base pointers `(qs, d, sum)` of the whole buffer (the pool's scratch, written
    /// by several threads in disjoint rows).
    pub(crate) fn raw_mut(&mut self) -> (*mut i8, *mut f32, *mut f32) {
        (self.qs.as_mut_ptr(), self.d.as_mut_ptr(), self.sum.as_mut_ptr())
    }
}

/// Quantises `n` (a multiple of 32) f32 at `x` into `n` i8 at `qs` and `n / 32` f32 at `d` and
/// `sum`, with AVX-512 where the CPU has it (bit-equal to the scalar loop).
///
/// # Safety
/// The four ranges must be valid (read / written) for those lengths.
pub(crate) unsafe fn quantize_raw(x: *const f32, n: usize, qs: *mut i8, d: *mut f32, sum: *mut f32) {
    #[cfg(target_arch = "x86_64")]
    if crate::SimdLevel::Avx512.is_supported() {
        // SAFETY: AVX-512F (with AVX2) checked just above; ranges forwarded from the caller.
        unsafe { quantize_avx512(x, n, qs, d, sum) };
        return;
    }
    for b in 0..n / Q8_BLOCK {
        // SAFETY: block b lies inside the caller's ranges.
        let (xb, qb) = unsafe {
            (
                std::slice::from_raw_parts(x.add(b * Q8_BLOCK), Q8_BLOCK),
                std::slice::from_raw_parts_mut(qs.add(b * Q8_BLOCK), Q8_BLOCK),
            )
        };
        let (db, s) = quantize_block_scalar(xb, qb);
        // SAFETY: as above.
        unsafe { (*d.add(b), *sum.add(b)) = (db, s) };
    }
}

/// One block of 32: `(d, d * Σq)` and the values into `q` (the reference rounding).
pub(crate) fn quantize_block_scalar(x: &[f32], q: &mut [i8]) -> (f32, f32) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let (d, id) = if amax > 0.0 { (amax / 127.0, 127.0 / amax) } else { (0.0, 0.0) };
    let mut total = 0i32;
    for (o, &v) in q.iter_mut().zip(x) {
        let r = (v * id).round_ties_even() as i32;
        *o = r as i8;
        total += r;
    }
    (d, d * total as f32)
}

/// AVX-512 [`quantize_raw`]: 32 values per step, rounding by `vcvtps2dq` (nearest even).
///
/// # Safety
/// AVX-512F and AVX2 present; ranges as [`quantize_raw`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn quantize_avx512(x: *const f32, n: usize, qs: *mut i8, d: *mut f32, sum: *mut f32) {
    use std::arch::x86_64::*;
    for b in 0..n / Q8_BLOCK {
        // SAFETY: block b's 32 values, 32 bytes and two f32 lie inside the caller's ranges.
        unsafe {
            let (v0, v1) = (_mm512_loadu_ps(x.add(32 * b)), _mm512_loadu_ps(x.add(32 * b + 16)));
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            let (db, id) = if amax > 0.0 { (amax / 127.0, 127.0 / amax) } else { (0.0, 0.0) };
            let idv = _mm512_set1_ps(id);
            let q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, idv));
            let q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, idv));
            _mm_storeu_si128(qs.add(32 * b) as *mut __m128i, _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128(qs.add(32 * b + 16) as *mut __m128i, _mm512_cvtepi32_epi8(q1));
            let total = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            (*d.add(b), *sum.add(b)) = (db, db * total as f32);
        }
    }
}
