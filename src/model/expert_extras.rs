//! What some architectures' experts carry beyond three row-major matrices: GPT-OSS's per-expert
//! biases (decoded to f32 once at open, for every lane's kernels and the oracle) and its
//! transformers checkpoints' input-major fused layout (`gate_up_proj` `[E, hidden, 2 ff]` with
//! gate and up in alternate columns, `down_proj` `[E, ff, hidden]`), which is rewritten once at
//! open into the `[ff, hidden]` / `[hidden, ff]` rows every engine reads (the element bytes are
//! moved, not converted, so the values are exact).

use crate::format::dtype::DType;
use crate::format::tensor::TensorRef;
use crate::model::naming::{self, ExpertProj};
use crate::model::ModelError;
use std::path::Path;

/// One layer's expert biases, f32, expert-major: `gate`/`up` `[E * ff]`, `down` `[E * hidden]`.
#[derive(Debug, Clone)]
pub struct LayerExpertBiases {
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub down: Vec<f32>,
}

/// One expert's biases.
#[derive(Debug, Clone, Copy)]
pub struct ExpertBiasRef<'a> {
    /// `[ff]`
    pub gate: &'a [f32],
    /// `[ff]`
    pub up: &'a [f32],
    /// `[hidden]`
    pub down: &'a [f32],
}

impl LayerExpertBiases {
    pub fn expert(&self, e: usize, ff: usize, hidden: usize) -> ExpertBiasRef<'_> {
        ExpertBiasRef {
            gate: &self.gate[e * ff..][..ff],
            up: &self.up[e * ff..][..ff],
            down: &self.down[e * hidden..][..hidden],
        }
    }
}

/// One layer's experts rewritten into row-major stacks: `gate`/`up` `[E, ff, hidden]`, `down`
/// `[E, hidden, ff]`, in the checkpoint's element type.
#[derive(Debug)]
pub struct OwnedLayerExperts {
    pub gate: Vec<u8>,
    pub up: Vec<u8>,
    pub down: Vec<u8>,
}

impl OwnedLayerExperts {
    pub fn of(&self, proj: ExpertProj) -> &[u8] {
        match proj {
            ExpertProj::Gate => &self.gate,
            ExpertProj::Up => &self.up,
            ExpertProj::Down => &self.down,
        }
    }
}

/// Shapes a fused GPT-OSS layer is checked against.
pub struct Dims {
    pub n_experts: usize,
    pub hidden: usize,
    pub ff: usize,
}

fn shape_error(path: &Path, t: &TensorRef<'_>, expected: Vec<usize>) -> ModelError {
    ModelError::ShapeMismatch { path: path.into(), tensor: t.name.into(), expected, found: t.shape.to_vec() }
}

fn float_elem(path: &Path, t: &TensorRef<'_>) -> Result<usize, ModelError> {
    match t.dtype {
        DType::F32 => Ok(4),
        DType::F16 | DType::BF16 => Ok(2),
        dtype => Err(ModelError::DTypeMismatch {
            path: path.into(),
            tensor: t.name.into(),
            dtype,
            allowed: "F32, F16 or BF16 (GPT-OSS fused experts; MXFP4 checkpoints are not read yet)",
        }),
    }
}

/// `gate_up_proj` `[E, hidden, 2 ff]` (column `2i` gate row `i`, `2i + 1` up row `i`) and
/// `down_proj` `[E, ff, hidden]` into row-major stacks.
pub fn rewrite_gpt_oss_layer(
    path: &Path,
    gate_up: TensorRef<'_>,
    down: TensorRef<'_>,
    d: &Dims,
) -> Result<(OwnedLayerExperts, DType), ModelError> {
    let (e_n, h, ff) = (d.n_experts, d.hidden, d.ff);
    if gate_up.shape != [e_n, h, 2 * ff] {
        return Err(shape_error(path, &gate_up, vec![e_n, h, 2 * ff]));
    }
    if down.shape != [e_n, ff, h] {
        return Err(shape_error(path, &down, vec![e_n, ff, h]));
    }
    let el = float_elem(path, &gate_up)?;
    if down.dtype != gate_up.dtype {
        return Err(ModelError::DTypeMismatch {
            path: path.into(),
            tensor: down.name.into(),
            dtype: down.dtype,
            allowed: "the dtype of gate_up_proj",
        });
    }
    let mut out = OwnedLayerExperts {
        gate: vec![0; e_n * ff * h * el],
        up: vec![0; e_n * ff * h * el],
        down: vec![0; e_n * h * ff * el],
    };
    for e in 0..e_n {
        for j in 0..h {
            for i in 0..ff {
                let src = ((e * h + j) * 2 * ff + 2 * i) * el;
                let dst = ((e * ff + i) * h + j) * el;
                out.gate[dst..dst + el].copy_from_slice(&gate_up.data[src..src + el]);
                out.up[dst..dst + el].copy_from_slice(&gate_up.data[src + el..src + 2 * el]);
            }
        }
        for i in 0..ff {
            for j in 0..h {
                let src = ((e * ff + i) * h + j) * el;
                let dst = ((e * h + j) * ff + i) * el;
                out.down[dst..dst + el].copy_from_slice(&down.data[src..src + el]);
            }
        }
    }
    Ok((out, gate_up.dtype))
}

/// A bias tensor as f32, checked against `expected` (leading unit dims ignored).
fn bias_values(path: &Path, t: TensorRef<'_>, expected: &[usize]) -> Result<Vec<f32>, ModelError> {
    let ones = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
    if ones(t.shape) != ones(expected) {
        return Err(shape_error(path, &t, expected.to_vec()));
    }
    float_elem(path, &t)?;
    t.to_f32_vec().map_err(|e| ModelError::BadTensor { path: path.into(), reason: e.to_string() })
}

/// GPT-OSS's fused biases: `gate_up_proj_bias` `[E, 2 ff]` (interleaved) and `down_proj_bias`.
pub fn gpt_oss_biases(
    path: &Path,
    gate_up: TensorRef<'_>,
    down: TensorRef<'_>,
    d: &Dims,
) -> Result<LayerExpertBiases, ModelError> {
    let gu = bias_values(path, gate_up, &[d.n_experts, 2 * d.ff])?;
    let down = bias_values(path, down, &[d.n_experts, d.hidden])?;
    Ok(LayerExpertBiases {
        gate: gu.iter().step_by(2).copied().collect(),
        up: gu.iter().skip(1).step_by(2).copied().collect(),
        down,
    })
}

/// llama.cpp's stacked biases `blk.N.ffn_{gate,up,down}_exps.bias`, through `find` (a name to its
/// tensor).
pub fn gguf_biases<'a>(
    path: &Path,
    layer: usize,
    find: impl Fn(&str) -> Option<TensorRef<'a>>,
    d: &Dims,
) -> Result<LayerExpertBiases, ModelError> {
    let get = |proj: ExpertProj, rows: usize| {
        let name = naming::gguf_expert_bias(layer, proj);
        let t = find(&name).ok_or_else(|| ModelError::MissingTensor { path: path.into(), tensor: name })?;
        bias_values(path, t, &[d.n_experts, rows])
    };
    Ok(LayerExpertBiases {
        gate: get(ExpertProj::Gate, d.ff)?,
        up: get(ExpertProj::Up, d.ff)?,
        down: get(ExpertProj::Down, d.hidden)?,
    })
}
