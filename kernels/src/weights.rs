//! Weight views and element types of one expert FFN, and the gate activations.
//!
//! Weights are raw little-endian bytes (straight from a memory-mapped file, possibly
//! unaligned) in PyTorch `Linear` layout: gate and up are `[ff, hidden]`, down is `[hidden, ff]`.

use serde::{Deserialize, Serialize};

use crate::error::KernelError;

/// Element type of weight bytes: a float type, or a GGML quantised block type as GGUF stores it
/// (see [`crate::quant`] for the layouts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[allow(non_camel_case_types)]
pub enum WeightDType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_K,
    Q5_K,
    Q6_K,
    /// GGML's MXFP4 (type 39): 32 E2M1 values under one E8M0 scale byte.
    Mxfp4,
    /// GGML's Q5_0 (type 6): 32 five-bit values minus 16 under one f16 scale.
    Q5_0,
    /// GGML's Q5_1 (type 7): 32 five-bit values under an f16 scale and an f16 min.
    Q5_1,
    /// GGML's IQ4_NL (type 20): 32 nibbles indexing a fixed non-linear table, one f16 scale.
    Iq4Nl,
}

impl WeightDType {
    /// The float element types.
    pub const FLOATS: [WeightDType; 3] = [WeightDType::F32, WeightDType::F16, WeightDType::BF16];
    /// The quantised block types.
    pub const QUANTIZED: [WeightDType; 9] = [
        WeightDType::Q8_0,
        WeightDType::Q4_0,
        WeightDType::Q4_K,
        WeightDType::Q5_K,
        WeightDType::Q6_K,
        WeightDType::Mxfp4,
        WeightDType::Q5_0,
        WeightDType::Q5_1,
        WeightDType::Iq4Nl,
    ];

    /// Whether values are stored in quantised blocks.
    pub fn is_quantized(self) -> bool {
        !matches!(self, WeightDType::F32 | WeightDType::F16 | WeightDType::BF16)
    }

    /// Values per block (1 for the float types).
    pub fn block_elems(self) -> usize {
        match self {
            WeightDType::F32 | WeightDType::F16 | WeightDType::BF16 => 1,
            WeightDType::Q8_0
            | WeightDType::Q4_0
            | WeightDType::Mxfp4
            | WeightDType::Q5_0
            | WeightDType::Q5_1
            | WeightDType::Iq4Nl => 32,
            WeightDType::Q4_K | WeightDType::Q5_K | WeightDType::Q6_K => 256,
        }
    }

    /// Bytes per block (bytes per element for the float types).
    pub fn block_bytes(self) -> usize {
        match self {
            WeightDType::F32 => 4,
            WeightDType::F16 | WeightDType::BF16 => 2,
            WeightDType::Q8_0 => 34,
            WeightDType::Q4_0 => 18,
            WeightDType::Q4_K => 144,
            WeightDType::Q5_K => 176,
            WeightDType::Q6_K => 210,
            WeightDType::Mxfp4 => 17,
            WeightDType::Q5_0 => 22,
            WeightDType::Q5_1 => 24,
            WeightDType::Iq4Nl => 18,
        }
    }

    /// Bytes of a row of `cols` values (`cols` a whole number of blocks, see [`Self::block_elems`]).
    pub fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_elems() * self.block_bytes()
    }

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            WeightDType::F32 => "f32",
            WeightDType::F16 => "f16",
            WeightDType::BF16 => "bf16",
            WeightDType::Q8_0 => "q8_0",
            WeightDType::Q4_0 => "q4_0",
            WeightDType::Q4_K => "q4_k",
            WeightDType::Q5_K => "q5_k",
            WeightDType::Q6_K => "q6_k",
            WeightDType::Mxfp4 => "mxfp4",
            WeightDType::Q5_0 => "q5_0",
            WeightDType::Q5_1 => "q5_1",
            WeightDType::Iq4Nl => "iq4_nl",
        }
    }

    /// Parses a lower- or upper-case name as [`Self::name`] writes it.
    pub fn parse(name: &str) -> Option<WeightDType> {
        let lowered = name.trim().to_ascii_lowercase();
        WeightDType::FLOATS.into_iter().chain(WeightDType::QUANTIZED).find(|d| d.name() == lowered)
    }

    /// Reads element `index` of `bytes` as f32 (scalar, unaligned-safe; a quantised type decodes
    /// the element's whole block). Panics if out of bounds.
    #[inline]
    pub fn load_f32(self, bytes: &[u8], index: usize) -> f32 {
        match self {
            WeightDType::F32 => {
                let at = index * 4;
                f32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
            }
            WeightDType::F16 => {
                let at = index * 2;
                half::f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
            }
            WeightDType::BF16 => {
                let at = index * 2;
                bf16_bits_to_f32(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
            }
            quantized => {
                let (n, bb) = (quantized.block_elems(), quantized.block_bytes());
                let mut block = [0.0f32; crate::quant::MAX_BLOCK_ELEMS];
                let at = index / n * bb;
                crate::quant::dequantize_block(quantized, &bytes[at..at + bb], &mut block[..n]);
                block[index % n]
            }
        }
    }

    /// Decodes a whole row (`out.len()` values, whole blocks) of `bytes` to f32.
    pub fn decode_row(self, bytes: &[u8], out: &mut [f32]) {
        if self.is_quantized() {
            let (n, bb) = (self.block_elems(), self.block_bytes());
            for (block, y) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(n)) {
                crate::quant::dequantize_block(self, block, y);
            }
        } else {
            for (c, o) in out.iter_mut().enumerate() {
                *o = self.load_f32(bytes, c);
            }
        }
    }

    /// Encodes `values` as little-endian bytes of this float type (round to nearest even).
    ///
    /// # Panics
    /// For a quantised type: the kernels read blocks but do not make them (the library's
    /// quantiser does).
    pub fn encode(self, values: &[f32]) -> Vec<u8> {
        assert!(!self.is_quantized(), "encode is for float types, not {}", self.name());
        let mut bytes = Vec::with_capacity(values.len() * self.block_bytes());
        for &value in values {
            match self {
                WeightDType::F32 => bytes.extend_from_slice(&value.to_le_bytes()),
                WeightDType::F16 => {
                    bytes.extend_from_slice(&half::f16::from_f32(value).to_bits().to_le_bytes())
                }
                _ => bytes.extend_from_slice(&half::bf16::from_f32(value).to_bits().to_le_bytes()),
            }
        }
        bytes
    }
}

/// BF16 bit pattern to f32: the BF16 bits are the high half of the f32 bits.
#[inline]
pub fn bf16_bits_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// The weights of one expert FFN: `h = act(gate·x) * (up·x)`, `y = down·h`.
#[derive(Debug, Clone, Copy)]
pub struct ExpertWeights<'a> {
    /// `[ff, hidden]` row-major.
    pub gate: &'a [u8],
    /// `[ff, hidden]` row-major.
    pub up: &'a [u8],
    /// `[hidden, ff]` row-major.
    pub down: &'a [u8],
    /// Element type of gate and up.
    pub dtype: WeightDType,
    /// Element type of down (a quantised `_M` mix may store it in another block type).
    pub down_dtype: WeightDType,
    pub hidden: usize,
    pub ff: usize,
    /// Biases added to gate/up before the activation and to down's output (GPT-OSS); `None`
    /// for bias-free experts.
    pub bias: Option<ExpertBias<'a>>,
}

/// One expert's biases, f32: `gate` and `up` `[ff]`, `down` `[hidden]`.
#[derive(Debug, Clone, Copy)]
pub struct ExpertBias<'a> {
    pub gate: &'a [f32],
    pub up: &'a [f32],
    pub down: &'a [f32],
}

impl<'a> ExpertWeights<'a> {
    /// Bytes of the `[ff, hidden]` gate (or up) matrix.
    pub fn gate_up_bytes(&self) -> usize {
        self.ff * self.dtype.row_bytes(self.hidden)
    }

    /// Bytes of the `[hidden, ff]` down matrix.
    pub fn down_bytes(&self) -> usize {
        self.hidden * self.down_dtype.row_bytes(self.ff)
    }

    /// Bytes of all three matrices: what a full pass over this expert reads.
    pub fn total_bytes(&self) -> usize {
        2 * self.gate_up_bytes() + self.down_bytes()
    }

    /// Checks that each matrix slice has exactly the length its shape implies (rows whole
    /// blocks).
    pub fn validate(&self) -> Result<(), KernelError> {
        let whole = |dtype: WeightDType, cols: usize, what| {
            if cols.is_multiple_of(dtype.block_elems()) {
                Ok(())
            } else {
                Err(KernelError::ShapeMismatch { what, expected: dtype.block_elems(), actual: cols })
            }
        };
        whole(self.dtype, self.hidden, "gate/up row (whole blocks)")?;
        whole(self.down_dtype, self.ff, "down row (whole blocks)")?;
        if let Some(b) = &self.bias {
            for (what, len, expected) in [
                ("gate bias", b.gate.len(), self.ff),
                ("up bias", b.up.len(), self.ff),
                ("down bias", b.down.len(), self.hidden),
            ] {
                if len != expected {
                    return Err(KernelError::ShapeMismatch { what, expected, actual: len });
                }
            }
        }
        let gate_up = self.gate_up_bytes();
        for (what, slice, expected) in
            [("gate", self.gate, gate_up), ("up", self.up, gate_up), ("down", self.down, self.down_bytes())]
        {
            if slice.len() != expected {
                return Err(KernelError::ShapeMismatch { what, expected, actual: slice.len() });
            }
        }
        Ok(())
    }
}

/// Gate activation of the expert FFN.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Activation {
    /// `silu(g) * u` with `silu(g) = g / (1 + e^-g)` (SwiGLU).
    Silu,
    /// Exact GELU as PyTorch `gelu`: `0.5 g (1 + erf(g / sqrt 2))` (GeGLU).
    Gelu,
    /// PyTorch `gelu(approximate="tanh")`.
    GeluTanh,
    /// GPT-OSS's clamped SwiGLU: `g = min(gate, 7)`, `u = clamp(up, -7, 7)`,
    /// `(u + 1) * g * sigmoid(1.702 g)` (see [`Activation::gated`]).
    SwigluOai,
}

/// GPT-OSS's SwiGLU gain (`swiglu_alpha`).
pub const SWIGLU_OAI_ALPHA: f32 = 1.702;
/// GPT-OSS's SwiGLU clamp (`swiglu_limit`).
pub const SWIGLU_OAI_LIMIT: f32 = 7.0;

impl Activation {
    /// Applies the activation to a gate value (for [`Activation::SwigluOai`], the clamped gate's
    /// `g * sigmoid(1.702 g)`, without the up factor).
    #[inline]
    pub fn apply(self, gate: f32) -> f32 {
        match self {
            Activation::Silu => gate / (1.0 + (-gate).exp()),
            Activation::SwigluOai => {
                let g = gate.min(SWIGLU_OAI_LIMIT);
                g / (1.0 + (-SWIGLU_OAI_ALPHA * g).exp())
            }
            Activation::Gelu => {
                let g = gate as f64;
                (0.5 * g * (1.0 + erf(g * std::f64::consts::FRAC_1_SQRT_2))) as f32
            }
            Activation::GeluTanh => {
                let g = gate as f64;
                let inner = (2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g);
                (0.5 * g * (1.0 + inner.tanh())) as f32
            }
        }
    }

    /// The gated product `act(gate) * up` stored into `h`.
    #[inline]
    pub fn gated(self, gate: f32, up: f32) -> f32 {
        match self {
            Activation::SwigluOai => (up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT) + 1.0) * self.apply(gate),
            _ => self.apply(gate) * up,
        }
    }
}

/// Error function, Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7), evaluated in f64.
pub fn erf(x: f64) -> f64 {
    let sign = if x < 0.0 { -1.0 } else { 1.0 };
    let a = x.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let poly = t
        * (0.254_829_592
            + t * (-0.284_496_736 + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    sign * (1.0 - poly * (-a * a).exp())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_matches_known_values() {
        for (x, expected) in
            [(0.0, 0.0), (0.5, 0.520_499_877_8), (1.0, 0.842_700_792_9), (-2.0, -0.995_322_265)]
        {
            assert!((erf(x) - expected).abs() < 3e-7, "erf({x})");
        }
    }

    #[test]
    fn activations_match_known_values() {
        assert!((Activation::Silu.apply(1.0) - 0.731_058_6).abs() < 1e-6);
        assert!((Activation::Gelu.apply(1.0) - 0.841_344_7).abs() < 1e-6);
        assert!((Activation::GeluTanh.apply(1.0) - 0.841_192).abs() < 1e-5);
    }

    #[test]
    fn dtype_roundtrip() {
        let values = [1.5f32, -2.25, 0.0, 3.0e-3];
        for dtype in WeightDType::FLOATS {
            let bytes = dtype.encode(&values);
            for (i, v) in values.iter().enumerate() {
                assert!((dtype.load_f32(&bytes, i) - v).abs() <= v.abs() * 1e-2);
            }
        }
    }
}
