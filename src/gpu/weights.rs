//! Non-expert weights on the device: embeddings, norms, attention, router, shared expert,
//! lm_head. Matrices are stored as bf16 (bf16 files copied bit-exactly, f16/f32 rounded to
//! nearest even); norm weights and biases stay f32.

use super::GpuError;
use crate::format::dtype::DType;
use crate::format::tensor::{TensorError, TensorRef};
use crate::model::naming::{GlobalRole, LayerRole};
use crate::model::Model;
use half::bf16;
use moe_lanes_kernels::cuda::{CudaBackend, DeviceBuffer};

pub(crate) struct SharedWeights {
    pub gate: DeviceBuffer<u16>,
    pub up: DeviceBuffer<u16>,
    pub down: DeviceBuffer<u16>,
    pub gate_logit: DeviceBuffer<u16>,
}

pub(crate) struct LayerWeights {
    pub attn_norm: DeviceBuffer<f32>,
    pub q: DeviceBuffer<u16>,
    pub k: DeviceBuffer<u16>,
    pub v: DeviceBuffer<u16>,
    pub o: DeviceBuffer<u16>,
    pub q_bias: Option<DeviceBuffer<f32>>,
    pub k_bias: Option<DeviceBuffer<f32>>,
    pub v_bias: Option<DeviceBuffer<f32>>,
    pub q_norm: Option<DeviceBuffer<f32>>,
    pub k_norm: Option<DeviceBuffer<f32>>,
    pub ffn_norm: DeviceBuffer<f32>,
    pub router: DeviceBuffer<u16>,
    pub shared: Option<SharedWeights>,
}

pub(crate) struct DenseWeights {
    pub embed: DeviceBuffer<u16>,
    pub final_norm: DeviceBuffer<f32>,
    /// `None`: tied, the embedding is the lm_head.
    pub lm_head: Option<DeviceBuffer<u16>>,
    pub layers: Vec<LayerWeights>,
    /// Bytes of the bf16 matrices on the device.
    pub matrix_bytes: usize,
}

/// bf16 bit patterns of a float tensor (bf16 copied exactly; f16/f32 rounded to nearest even).
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
        DType::F16 | DType::F32 => {
            Ok(t.to_f32_vec()?.into_iter().map(|v| bf16::from_f32(v).to_bits()).collect())
        }
        dtype => Err(GpuError::UnsupportedDType { tensor: t.name.to_string(), dtype }),
    }
}

struct Uploader<'b> {
    be: &'b CudaBackend,
    matrix_bytes: usize,
}

impl Uploader<'_> {
    fn mat(&mut self, t: TensorRef<'_>) -> Result<DeviceBuffer<u16>, GpuError> {
        let b = self.be.upload(&bf16_bits(t)?)?;
        self.matrix_bytes += b.bytes();
        Ok(b)
    }
    fn vec(&self, t: TensorRef<'_>) -> Result<DeviceBuffer<f32>, GpuError> {
        Ok(self.be.upload(&t.to_f32_vec()?)?)
    }
}

impl DenseWeights {
    pub fn upload(model: &Model, be: &CudaBackend) -> Result<DenseWeights, GpuError> {
        let mut up = Uploader { be, matrix_bytes: 0 };
        let embed = up.mat(model.global(GlobalRole::TokenEmbedding).expect("validated at open"))?;
        let final_norm = up.vec(model.global(GlobalRole::OutputNorm).expect("validated at open"))?;
        let lm_head = model.global(GlobalRole::Output).map(|t| up.mat(t)).transpose()?;
        let layers = (0..model.config().n_layers)
            .map(|l| upload_layer(model, l, &mut up))
            .collect::<Result<_, _>>()?;
        Ok(DenseWeights { embed, final_norm, lm_head, layers, matrix_bytes: up.matrix_bytes })
    }
}

fn upload_layer(model: &Model, l: usize, up: &mut Uploader<'_>) -> Result<LayerWeights, GpuError> {
    let req = |r| model.required(l, r);
    let shared = if model.adapter().shared_expert {
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
