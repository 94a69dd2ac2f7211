//! Non-expert weights on the device: embeddings, norms, attention, router, shared expert,
//! lm_head. Matrices of float files are stored as bf16 (bf16 copied bit-exactly, f16/f32 rounded
//! to nearest even); quantized matrices keep their GGUF blocks exactly as the file stores them (a
//! 4-bit matrix costs 4-bit VRAM; the decode GEMV and the embedding lookup dequantize in
//! registers, exactly as the CPU; prefill dequantizes row ranges to bf16 for cuBLAS). Norm
//! weights and biases stay f32.

use super::GpuError;
use crate::format::dtype::DType;
use crate::format::tensor::{TensorError, TensorRef};
use crate::model::naming::{GlobalRole, LayerRole};
use crate::model::Model;
use crate::moe::expert_math::kernel_dtype;
use half::bf16;
use moe_lanes_kernels::cuda::{CudaBackend, DeviceBuffer, TypedWeights};
use moe_lanes_kernels::WeightDType;

/// A weight matrix on the device in its stored type (bf16 or GGUF blocks).
pub(crate) struct DevMatrix {
    buf: DeviceBuffer<u8>,
    dtype: WeightDType,
}

impl DevMatrix {
    pub fn view(&self) -> TypedWeights {
        TypedWeights { bytes: self.buf.ptr(), dtype: self.dtype }
    }
}

pub(crate) struct SharedWeights {
    pub gate: DevMatrix,
    pub up: DevMatrix,
    pub down: DevMatrix,
    pub gate_logit: DevMatrix,
}

pub(crate) struct LayerWeights {
    pub attn_norm: DeviceBuffer<f32>,
    pub q: DevMatrix,
    pub k: DevMatrix,
    pub v: DevMatrix,
    pub o: DevMatrix,
    pub q_bias: Option<DeviceBuffer<f32>>,
    pub k_bias: Option<DeviceBuffer<f32>>,
    pub v_bias: Option<DeviceBuffer<f32>>,
    pub q_norm: Option<DeviceBuffer<f32>>,
    pub k_norm: Option<DeviceBuffer<f32>>,
    pub ffn_norm: DeviceBuffer<f32>,
    pub router: DevMatrix,
    pub shared: Option<SharedWeights>,
}

pub(crate) struct DenseWeights {
    /// The embedding table in its stored type (the lookup decodes quantized rows exactly).
    pub embed: DevMatrix,
    pub final_norm: DeviceBuffer<f32>,
    /// `None`: tied, the embedding is the lm_head.
    pub lm_head: Option<DevMatrix>,
    pub layers: Vec<LayerWeights>,
    /// Bytes of the matrices on the device.
    pub matrix_bytes: usize,
    /// Elements of the largest quantized matrix (0: none), for the prefill dequantization
    /// scratch.
    pub max_quantized_elems: usize,
}

/// bf16 bit patterns of a tensor (bf16 copied exactly; f16/f32 and dequantized blocks rounded to
/// nearest even).
pub(crate) fn bf16_bits(t: TensorRef<'_>) -> Result<Vec<u16>, GpuError> {
    match t.dtype {
        DType::BF16 => {
            let n = t.n_elems();
            if t.data.len() != 2 * n {
                return Err(TensorError::SizeMismatch {
                    name: t.name.into(),
                    dtype: t.dtype,
                    shape: t.shape.to_vec(),
                    n_bytes: t.data.len(),
                }
                .into());
            }
            Ok(t.data.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect())
        }
        DType::F16 | DType::F32 | DType::Q8_0 | DType::Q4_0 | DType::Q4_K | DType::Q5_K | DType::Q6_K => {
            Ok(t.to_f32_vec()?.into_iter().map(|v| bf16::from_f32(v).to_bits()).collect())
        }
    }
}

/// The type a tensor is stored in on the device: its own when quantized, bf16 otherwise.
pub(crate) fn stored_dtype(dtype: DType) -> WeightDType {
    match dtype {
        DType::Q8_0 | DType::Q4_0 | DType::Q4_K | DType::Q5_K | DType::Q6_K => kernel_dtype(dtype),
        _ => WeightDType::BF16,
    }
}

/// A tensor's bytes as the device stores them ([`stored_dtype`]): quantized blocks borrowed
/// from the file (length checked), bf16 bit patterns otherwise.
pub(crate) fn stored_bytes<'t>(t: TensorRef<'t>) -> Result<std::borrow::Cow<'t, [u8]>, GpuError> {
    if stored_dtype(t.dtype) == WeightDType::BF16 {
        return Ok(std::borrow::Cow::Owned(bytemuck::cast_slice(&bf16_bits(t)?).to_vec()));
    }
    if t.dtype.bytes_for(t.n_elems()) != Some(t.data.len()) {
        return Err(TensorError::SizeMismatch {
            name: t.name.into(),
            dtype: t.dtype,
            shape: t.shape.to_vec(),
            n_bytes: t.data.len(),
        }
        .into());
    }
    Ok(std::borrow::Cow::Borrowed(t.data))
}

struct Uploader<'b> {
    be: &'b CudaBackend,
    matrix_bytes: usize,
    max_quantized_elems: usize,
}

impl Uploader<'_> {
    /// A matrix in its stored type.
    fn mat(&mut self, t: TensorRef<'_>) -> Result<DevMatrix, GpuError> {
        let dtype = stored_dtype(t.dtype);
        if dtype.is_quantized() {
            self.max_quantized_elems = self.max_quantized_elems.max(t.n_elems());
        }
        self.upload(&stored_bytes(t)?, dtype)
    }
    fn upload(&mut self, bytes: &[u8], dtype: WeightDType) -> Result<DevMatrix, GpuError> {
        let buf = self.be.upload(bytes)?;
        self.matrix_bytes += buf.bytes();
        Ok(DevMatrix { buf, dtype })
    }
    fn vec(&self, t: TensorRef<'_>) -> Result<DeviceBuffer<f32>, GpuError> {
        Ok(self.be.upload(&t.to_f32_vec()?)?)
    }
}

impl DenseWeights {
    pub fn upload(model: &Model, be: &CudaBackend) -> Result<DenseWeights, GpuError> {
        let mut up = Uploader { be, matrix_bytes: 0, max_quantized_elems: 0 };
        let embed = up.mat(model.global(GlobalRole::TokenEmbedding).expect("validated at open"))?;
        let final_norm = up.vec(model.global(GlobalRole::OutputNorm).expect("validated at open"))?;
        let lm_head = model.global(GlobalRole::Output).map(|t| up.mat(t)).transpose()?;
        let layers = (0..model.config().n_layers)
            .map(|l| upload_layer(model, l, &mut up))
            .collect::<Result<_, _>>()?;
        let (matrix_bytes, max_quantized_elems) = (up.matrix_bytes, up.max_quantized_elems);
        Ok(DenseWeights { embed, final_norm, lm_head, layers, matrix_bytes, max_quantized_elems })
    }
}

fn upload_layer(model: &Model, l: usize, up: &mut Uploader<'_>) -> Result<LayerWeights, GpuError> {
    let req = |r| model.required(l, r);
    let shared = if model.layer_spec(l).moe().shared.is_some() {
        Some(SharedWeights {
            gate: up.mat(req(LayerRole::SharedGate))?,
            up: up.mat(req(LayerRole::SharedUp))?,
            down: up.mat(req(LayerRole::SharedDown))?,
            gate_logit: up.mat(req(LayerRole::SharedExpertGate))?,
        })
    } else {
        None
    };
    let opt_vec = |up: &Uploader<'_>, r| model.layer(l, r).map(|t| up.vec(t)).transpose();
    Ok(LayerWeights {
        attn_norm: up.vec(req(LayerRole::AttnNorm))?,
        q: up.mat(req(LayerRole::Q))?,
        k: up.mat(req(LayerRole::K))?,
        v: up.mat(req(LayerRole::V))?,
        o: up.mat(req(LayerRole::O))?,
        q_bias: opt_vec(up, LayerRole::QBias)?,
        k_bias: opt_vec(up, LayerRole::KBias)?,
        v_bias: opt_vec(up, LayerRole::VBias)?,
        q_norm: opt_vec(up, LayerRole::QNorm)?,
        k_norm: opt_vec(up, LayerRole::KNorm)?,
        ffn_norm: up.vec(req(LayerRole::FfnNorm))?,
        router: up.mat(req(LayerRole::Router))?,
        shared,
    })
}
