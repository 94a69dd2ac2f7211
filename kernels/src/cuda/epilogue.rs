//! What the hot lane's expert kernels apply around their matrix products (`common.cuh`'s `glu`,
//! `moe.cu`, `quant.cu`, `grouped_gemm.cu`): the gated activation of gate and up (SiLU,
//! GPT-OSS's clamped SwiGLU, or Gemma 4's tanh GELU) and per-slot expert biases, f32 and laid out like the cache's
//! slots (`[n_slots, ff]` for gate and up, `[n_slots, hidden]` for down). A launch without
//! biases passes null pointers and the kernels branch on them uniformly: the same launches and
//! the same bits as before for SiLU without biases.

use super::ops::need;
use super::{DPtr, Kernel, Result};
use crate::weights::Activation;

/// The gated activation of the hot lane's gate/up kernels (`h = glu(gate, up)`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Glu {
    /// `silu(gate) * up`.
    #[default]
    Silu,
    /// GPT-OSS's clamped SwiGLU ([`Activation::SwigluOai`]): `g = min(gate, 7)`,
    /// `u = clamp(up, -7, 7)`, `(u + 1) * g * sigmoid(1.702 g)`.
    SwigluOai,
    /// Gemma 4's `gelu_tanh(gate) * up` ([`Activation::GeluTanh`]).
    GeluTanh,
}

impl Glu {
    /// The kernels' form of the CPU kernels' activation; none for the erf GELU, which the hot
    /// lane has no kernels for.
    pub fn of(act: Activation) -> Option<Glu> {
        match act {
            Activation::Silu => Some(Glu::Silu),
            Activation::SwigluOai => Some(Glu::SwigluOai),
            Activation::GeluTanh => Some(Glu::GeluTanh),
            Activation::Gelu => None,
        }
    }

    /// `common.cuh`'s `GLU_SILU` / `GLU_SWIGLU_OAI` / `GLU_GELU_TANH`.
    pub(super) fn code(self) -> i32 {
        match self {
            Glu::Silu => 0,
            Glu::SwigluOai => 1,
            Glu::GeluTanh => 2,
        }
    }
}

/// The gate/up kernels' epilogue: per-slot biases added to the gate and up products (f32
/// `[n_slots, ff]` each; none: nothing added), then the gated activation.
#[derive(Clone, Copy, Debug, Default)]
pub struct GateUpEpilogue {
    pub glu: Glu,
    pub gate_bias: Option<DPtr<f32>>,
    pub up_bias: Option<DPtr<f32>>,
}

impl GateUpEpilogue {
    /// `silu(gate) * up`, no biases (every architecture but GPT-OSS).
    pub const SILU: GateUpEpilogue = GateUpEpilogue { glu: Glu::Silu, gate_bias: None, up_bias: None };

    /// SiLU without biases: the kernels' plain instances.
    pub fn is_plain(&self) -> bool {
        self.glu == Glu::Silu && self.gate_bias.is_none() && self.up_bias.is_none()
    }

    /// The epilogue's kernel arguments (activation code, gate and up bias pointers, 0 for none)
    /// once each bias holds `n_slots` rows of `ff`.
    pub(super) fn args(&self, kernel: Kernel, n_slots: usize, ff: usize) -> Result<(i32, u64, u64)> {
        let g = bias_arg(kernel, "gate bias", self.gate_bias, n_slots * ff)?;
        let u = bias_arg(kernel, "up bias", self.up_bias, n_slots * ff)?;
        Ok((self.glu.code(), g, u))
    }
}

/// An optional per-slot bias as a kernel argument (0: none), once it holds `n` values.
pub(super) fn bias_arg(kernel: Kernel, what: &str, bias: Option<DPtr<f32>>, n: usize) -> Result<u64> {
    match bias {
        None => Ok(0),
        Some(b) => need(kernel, what, b, n).map(|()| b.raw()),
    }
}

/// The whole slots a decode kernel's cache view holds (`cache_len` elements, `per_slot` a
/// slot): the rows its biases must hold.
pub(super) fn cache_slots(cache_len: usize, per_slot: usize) -> usize {
    cache_len / per_slot.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_gated_activation_has_its_code_and_the_erf_gelu_none() {
        assert_eq!(Glu::of(Activation::Silu).map(Glu::code), Some(0));
        assert_eq!(Glu::of(Activation::SwigluOai).map(Glu::code), Some(1));
        assert_eq!(Glu::of(Activation::GeluTanh).map(Glu::code), Some(2));
        assert_eq!(Glu::of(Activation::Gelu), None);
        assert_eq!(GateUpEpilogue::default().glu, Glu::Silu);
    }

    #[test]
    fn biases_must_hold_every_slot_of_the_cache() {
        assert_eq!((cache_slots(12, 4), cache_slots(13, 4), cache_slots(5, 0)), (3, 3, 5));
        let k = Kernel::MoeGateUpGemv;
        assert_eq!(bias_arg(k, "b", None, 100).unwrap(), 0);
    }
}
