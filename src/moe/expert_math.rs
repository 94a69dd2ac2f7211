//! Expert FFN math for the lanes: `y = down · (act(gate · x) * (up · x))` for a group of tokens
//! that share one expert, decoding raw bf16/f16/f32 weight bytes on the fly ("plain kernels").
//!
//! [`ExpertKernel`] is the math of one expert for a group of tokens, below the lanes (the lanes'
//! one cold-lane trait is [`crate::moe::cold::ColdLane`]): the lane actors' cold workers and the
//! CPU pipeline's all-cold fallback ([`KernelLane`]) call it. [`PlainKernel`] is the plain
//! implementation: each weight row is decoded once per group and dotted with every token of the
//! group (so expert-major worklists read each expert's weights once per layer); [`SimdKernel`]
//! runs the SIMD kernels of `moe-lanes-kernels`.

use crate::format::dtype::DType;
use crate::format::quant::dequantize;
use crate::format::tensor::decode_f32;
use crate::model::arch::FfnActivation;
use crate::model::Model;
use crate::moe::cold::{ColdError, ColdLane, ColdSlot};
use crate::moe::math::dot;
use moe_lanes_kernels::SimdLevel;
use std::sync::Arc;

/// Raw bytes of one expert's three projections.
#[derive(Debug, Clone, Copy)]
pub struct ExpertBytes<'a> {
    /// Element type of gate and up.
    pub dtype: DType,
    /// Element type of down (quantised mixes may differ from gate/up).
    pub down_dtype: DType,
    /// `[ff, hidden]`
    pub gate: &'a [u8],
    /// `[ff, hidden]`
    pub up: &'a [u8],
    /// `[hidden, ff]`
    pub down: &'a [u8],
    /// The expert's biases (GPT-OSS), `None` for bias-free experts.
    pub bias: Option<crate::model::expert_extras::ExpertBiasRef<'a>>,
}

/// Shape of one expert FFN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FfnDims {
    pub hidden: usize,
    pub ff: usize,
}

/// Reusable buffers of one worker, sized for `max_group` tokens.
#[derive(Debug, Clone)]
pub struct FfnScratch {
    row: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    /// Gathered inputs of one group, `[max_group, hidden]`.
    pub xs: Vec<f32>,
    /// Outputs of one group, `[max_group, hidden]`.
    pub ys: Vec<f32>,
}

impl FfnScratch {
    pub fn new(dims: FfnDims, max_group: usize) -> FfnScratch {
        FfnScratch {
            row: vec![0.0; dims.hidden.max(dims.ff)],
            gate: vec![0.0; max_group * dims.ff],
            up: vec![0.0; max_group * dims.ff],
            xs: vec![0.0; max_group * dims.hidden],
            ys: vec![0.0; max_group * dims.hidden],
        }
    }
}

/// Why expert math failed.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ComputeError {
    #[error("expert weights of dtype {0} are not supported by this kernel")]
    UnsupportedDType(DType),
    #[error("expert {expert_idx} of layer {layer_idx}: {reason}")]
    Bad { layer_idx: usize, expert_idx: usize, reason: &'static str },
}

/// One expert's FFN over a group of tokens (plain, SIMD, or none for benchmarks).
pub trait ExpertKernel: Send + Sync {
    fn dims(&self) -> FfnDims;
    /// For `n` tokens (`xs[..n * hidden]`), write `ys[..n * hidden]` = the expert's FFN output.
    fn expert_ffn(
        &self,
        layer_idx: usize,
        expert_idx: usize,
        n: usize,
        scratch: &mut FfnScratch,
    ) -> Result<(), ComputeError>;
}

/// Plain kernels over the model's RAM experts.
pub struct PlainKernel {
    model: Arc<Model>,
    dims: FfnDims,
    activation: FfnActivation,
}

impl PlainKernel {
    pub fn new(model: Arc<Model>) -> PlainKernel {
        let c = model.config();
        let dims = FfnDims { hidden: c.hidden, ff: c.expert_ff };
        let activation = model.plan().expert_activation();
        PlainKernel { model, dims, activation }
    }
}

impl ExpertKernel for PlainKernel {
    fn dims(&self) -> FfnDims {
        self.dims
    }

    fn expert_ffn(
        &self,
        layer_idx: usize,
        expert_idx: usize,
        n: usize,
        scratch: &mut FfnScratch,
    ) -> Result<(), ComputeError> {
        let e = self.model.expert(layer_idx, expert_idx);
        let w = ExpertBytes {
            dtype: e.gate.dtype,
            down_dtype: e.down.dtype,
            gate: e.gate.data,
            up: e.up.data,
            down: e.down.data,
            bias: self.model.expert_bias(layer_idx, expert_idx),
        };
        ffn_plain(w, self.dims, self.activation, n, scratch)
    }
}

/// Per-expert kernels as a [`ColdLane`], one slot at a time (the CPU pipeline's all-cold
/// fallback runs on it): for each slot in order, `out[row] += weight * FFN_e(x[row])`.
pub struct KernelLane<'a> {
    pub compute: &'a dyn ExpertKernel,
    /// Sized for one token at least.
    pub scratch: &'a mut FfnScratch,
}

impl ColdLane for KernelLane<'_> {
    fn compute(
        &mut self,
        layer_idx: usize,
        hidden_rows: &[f32],
        slots: &[ColdSlot],
        out_rows: &mut [f32],
    ) -> Result<(), ColdError> {
        let h = self.compute.dims().hidden;
        for slot in slots {
            self.scratch.xs[..h].copy_from_slice(&hidden_rows[slot.row_idx * h..][..h]);
            let result = self.compute.expert_ffn(layer_idx, slot.expert_idx, 1, self.scratch);
            result.map_err(|source| ColdError::Compute { layer_idx, source })?;
            let out = &mut out_rows[slot.row_idx * h..][..h];
            for (o, y) in out.iter_mut().zip(&self.scratch.ys[..h]) {
                *o += slot.weight * y;
            }
        }
        Ok(())
    }
}

/// A compute that does no math (outputs zeros): the data-plane benchmark uses it to measure
/// everything but the expert math.
pub struct NullKernel(pub FfnDims);

impl ExpertKernel for NullKernel {
    fn dims(&self) -> FfnDims {
        self.0
    }
    fn expert_ffn(&self, _: usize, _: usize, n: usize, s: &mut FfnScratch) -> Result<(), ComputeError> {
        s.ys[..n * self.0.hidden].iter_mut().for_each(|y| *y = 0.0);
        Ok(())
    }
}

/// Decode one row of `dtype` (whole blocks) into `out`.
fn decode_row(dtype: DType, bytes: &[u8], out: &mut [f32]) -> Result<(), ComputeError> {
    if dtype.is_float() {
        decode_f32(dtype, bytes, out);
        Ok(())
    } else {
        dequantize(dtype, bytes, out).map_err(|_| ComputeError::UnsupportedDType(dtype))
    }
}

/// `x / (1 + e^-x)`
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// The plain kernel: `scratch.ys[i] = down · (act(gate · xs[i]) * (up · xs[i]))` for i < n.
pub fn ffn_plain(
    w: ExpertBytes<'_>,
    dims: FfnDims,
    activation: FfnActivation,
    n: usize,
    s: &mut FfnScratch,
) -> Result<(), ComputeError> {
    let FfnDims { hidden, ff } = dims;
    let bytes_of =
        |dtype: DType, cols: usize| dtype.bytes_for(cols).ok_or(ComputeError::UnsupportedDType(dtype));
    let (gate_row, down_row) = (bytes_of(w.dtype, hidden)?, bytes_of(w.down_dtype, ff)?);
    if w.gate.len() != ff * gate_row || w.up.len() != ff * gate_row || w.down.len() != hidden * down_row {
        return Err(ComputeError::Bad {
            layer_idx: 0,
            expert_idx: 0,
            reason: "weight bytes do not match the dims",
        });
    }
    let row = &mut s.row[..hidden];
    for r in 0..ff {
        decode_row(w.dtype, &w.gate[r * gate_row..(r + 1) * gate_row], row)?;
        for i in 0..n {
            s.gate[i * ff + r] = dot(row, &s.xs[i * hidden..(i + 1) * hidden]);
        }
        decode_row(w.dtype, &w.up[r * gate_row..(r + 1) * gate_row], row)?;
        for i in 0..n {
            s.up[i * ff + r] = dot(row, &s.xs[i * hidden..(i + 1) * hidden]);
        }
    }
    let act = activation.kernel();
    for i in 0..n {
        let (gates, ups) = (&mut s.gate[i * ff..(i + 1) * ff], &s.up[i * ff..(i + 1) * ff]);
        for (r, (g, u)) in gates.iter_mut().zip(ups).enumerate() {
            *g = match w.bias {
                Some(b) => act.gated(*g + b.gate[r], u + b.up[r]),
                None => act.gated(*g, *u),
            };
        }
    }
    let row = &mut s.row[..ff];
    for r in 0..hidden {
        decode_row(w.down_dtype, &w.down[r * down_row..(r + 1) * down_row], row)?;
        let b = w.bias.map_or(0.0, |b| b.down[r]);
        for i in 0..n {
            let y = dot(row, &s.gate[i * ff..(i + 1) * ff]);
            s.ys[i * hidden + r] = if w.bias.is_some() { y + b } else { y };
        }
    }
    Ok(())
}

/// The fast cold-lane kernels of `moe-lanes-kernels` (runtime-dispatched SIMD, level from
/// `MOE_LANES_SIMD` or the best exact level the CPU has: AVX-512 BF16 only when named) behind
/// the same [`ExpertKernel`] boundary. Same math as [`PlainKernel`], different summation order
/// (equal within rounding).
pub struct SimdKernel {
    model: Arc<Model>,
    dims: FfnDims,
    level: moe_lanes_kernels::SimdLevel,
    act: moe_lanes_kernels::Activation,
}

/// The kernels' name for a tensor element type (every type the library reads has one).
pub fn kernel_dtype(dtype: DType) -> moe_lanes_kernels::WeightDType {
    use moe_lanes_kernels::WeightDType;
    match dtype {
        DType::F32 => WeightDType::F32,
        DType::F16 => WeightDType::F16,
        DType::BF16 => WeightDType::BF16,
        DType::Q8_0 => WeightDType::Q8_0,
        DType::Q4_0 => WeightDType::Q4_0,
        DType::Q4_K => WeightDType::Q4_K,
        DType::Q5_K => WeightDType::Q5_K,
        DType::Q6_K => WeightDType::Q6_K,
        DType::MXFP4 => WeightDType::Mxfp4,
        DType::Q5_0 => WeightDType::Q5_0,
        DType::Q5_1 => WeightDType::Q5_1,
        DType::IQ4_NL => WeightDType::Iq4Nl,
    }
}

/// Unit token weights for [`SimdKernel`]'s down projection (which accumulates `w * y`).
static UNIT_WEIGHTS: [f32; GROUP_TOKENS_MAX] = [1.0; GROUP_TOKENS_MAX];

impl SimdKernel {
    /// `forced`: a SIMD level named by the caller; `None` picks [`cold_simd_level`]'s default.
    pub fn new(model: Arc<Model>, forced: Option<SimdLevel>) -> Result<SimdKernel, ComputeError> {
        let level = cold_simd_level(forced).map_err(|_| ComputeError::Bad {
            layer_idx: 0,
            expert_idx: 0,
            reason: "the forced SIMD level is one this CPU lacks",
        })?;
        let act = model.plan().expert_activation().kernel();
        let c = model.config();
        let dims = FfnDims { hidden: c.hidden, ff: c.expert_ff };
        Ok(SimdKernel { model, dims, level, act })
    }
}

/// Most tokens one lane computes together per expert (the group is split beyond it). Each
/// worker's scratch holds `GROUP_TOKENS_MAX * (2 * ff + 2 * hidden)` floats.
pub const GROUP_TOKENS_MAX: usize = 64;

/// The cold lane's SIMD level: the forced one (checked against this CPU), else the best the CPU
/// has except AVX-512 BF16, whose kernel rounds activations to BF16 (about 1e-3 relative,
/// outside the engines' contract with the reference): that one only when named. AMX, when
/// detected, is kept: its tiles split the activations into two BF16 parts (about f32 accuracy).
pub fn cold_simd_level(forced: Option<SimdLevel>) -> Result<SimdLevel, moe_lanes_kernels::KernelError> {
    let level = SimdLevel::resolve(forced)?;
    Ok(if level == SimdLevel::Avx512Bf16 && forced.is_none() { SimdLevel::Avx512 } else { level })
}

impl ExpertKernel for SimdKernel {
    fn dims(&self) -> FfnDims {
        self.dims
    }

    fn expert_ffn(
        &self,
        layer_idx: usize,
        expert_idx: usize,
        n: usize,
        s: &mut FfnScratch,
    ) -> Result<(), ComputeError> {
        let FfnDims { hidden, ff } = self.dims;
        let e = self.model.expert(layer_idx, expert_idx);
        let w = moe_lanes_kernels::ExpertWeights {
            gate: e.gate.data,
            up: e.up.data,
            down: e.down.data,
            dtype: kernel_dtype(e.gate.dtype),
            down_dtype: kernel_dtype(e.down.dtype),
            hidden,
            ff,
            bias: kernel_bias(&self.model, layer_idx, expert_idx),
        };
        let bad = |_| ComputeError::Bad { layer_idx, expert_idx, reason: "kernel rejected the shapes" };
        let h = &mut s.gate[..n * ff];
        moe_lanes_kernels::gate_up_activation(self.level, &w, self.act, &s.xs[..n * hidden], 0..ff, h)
            .map_err(bad)?;
        let ys = &mut s.ys[..n * hidden];
        ys.iter_mut().for_each(|y| *y = 0.0);
        moe_lanes_kernels::down_accumulate(
            self.level,
            &w,
            &s.gate[..n * ff],
            &UNIT_WEIGHTS[..n],
            0..hidden,
            ys,
        )
        .map_err(bad)
    }
}

/// The kernels' view of an expert's biases (GPT-OSS), `None` for bias-free experts.
pub(crate) fn kernel_bias(
    model: &Model,
    layer_idx: usize,
    expert_idx: usize,
) -> Option<moe_lanes_kernels::ExpertBias<'_>> {
    model.expert_bias(layer_idx, expert_idx).map(|b| moe_lanes_kernels::ExpertBias {
        gate: b.gate,
        up: b.up,
        down: b.down,
    })
}
