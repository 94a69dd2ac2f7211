//! Borrowed, zero-copy views of tensors inside memory-mapped model files, and conversion of float
//! data to `f32` for the reference path.
//!
//! Shapes are always row-major, outermost dimension first, as PyTorch and safetensors write them.
//! (GGUF stores dimensions innermost first; its reader reverses them.) A 2-D weight of a linear
//! layer is `[out_features, in_features]`.

use crate::format::dtype::DType;
use crate::format::quant;
use half::{bf16, f16};

/// A tensor as it lies in a file: name, element type, shape and the raw bytes.
#[derive(Debug, Clone, Copy)]
pub struct TensorRef<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

/// A tensor's data could not be read as floats.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum TensorError {
    #[error("tensor '{name}': dtype {dtype} has no float conversion yet")]
    UnsupportedDType { name: String, dtype: DType },
    #[error("tensor '{name}': {n_bytes} bytes do not hold shape {shape:?} of {dtype}")]
    SizeMismatch { name: String, dtype: DType, shape: Vec<usize>, n_bytes: usize },
}

impl<'a> TensorRef<'a> {
    pub fn n_elems(&self) -> usize {
        self.shape.iter().product()
    }

    /// Decode all elements to `f32` (bf16/f16 widen exactly).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>, TensorError> {
        let mut out = vec![0.0; self.n_elems()];
        self.read_f32_into(0, &mut out)?;
        Ok(out)
    }

    /// Decode elements `[start_elem, start_elem + out.len())` into `out`. Quantised tensors are
    /// dequantised (plain code, [`crate::format::quant`]); the range must then start and end on
    /// block boundaries.
    pub fn read_f32_into(&self, start_elem: usize, out: &mut [f32]) -> Result<(), TensorError> {
        let size_mismatch = || TensorError::SizeMismatch {
            name: self.name.to_string(),
            dtype: self.dtype,
            shape: self.shape.to_vec(),
            n_bytes: self.data.len(),
        };
        let block = self.dtype.block_elems();
        let end_elem = start_elem + out.len();
        if self.dtype.bytes_for(self.n_elems()) != Some(self.data.len())
            || end_elem > self.n_elems()
            || !start_elem.is_multiple_of(block)
            || !end_elem.is_multiple_of(block)
        {
            return Err(size_mismatch());
        }
        let (begin, end) =
            (start_elem / block * self.dtype.block_bytes(), end_elem / block * self.dtype.block_bytes());
        if self.dtype.is_float() {
            decode_f32(self.dtype, &self.data[begin..end], out);
        } else {
            quant::dequantize(self.dtype, &self.data[begin..end], out).map_err(|_| size_mismatch())?;
        }
        Ok(())
    }
}

/// Decode little-endian float bytes of `dtype` into `out` (lengths must agree).
pub fn decode_f32(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        other => panic!("decode_f32 called with non-float dtype {other}"),
    }
}

/// Encode `f32` values as little-endian bytes of a float `dtype` (round to nearest even).
pub fn encode_f32(dtype: DType, values: &[f32], out: &mut Vec<u8>) {
    match dtype {
        DType::F32 => values.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        DType::F16 => {
            values.iter().for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_bits().to_le_bytes()))
        }
        DType::BF16 => {
            values.iter().for_each(|v| out.extend_from_slice(&bf16::from_f32(*v).to_bits().to_le_bytes()))
        }
        other => panic!("encode_f32 called with non-float dtype {other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_is_exact_for_representable_values() {
        let values = [1.0f32, -2.5, 0.15625, 3.0e-3];
        let mut bytes = Vec::new();
        encode_f32(DType::BF16, &values, &mut bytes);
        let t = TensorRef { name: "t", dtype: DType::BF16, shape: &[2, 2], data: &bytes };
        let back = t.to_f32_vec().unwrap();
        for (a, b) in values.iter().zip(&back) {
            assert!((a - b).abs() <= a.abs() / 128.0);
        }
    }

    #[test]
    fn size_mismatch_is_an_error() {
        let bytes = [0u8; 6];
        let t = TensorRef { name: "w", dtype: DType::F32, shape: &[2], data: &bytes };
        assert!(matches!(t.to_f32_vec(), Err(TensorError::SizeMismatch { .. })));
    }
}
