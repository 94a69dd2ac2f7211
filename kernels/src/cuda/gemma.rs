//! Launchers of Gemma 4's small kernels (`kernels/cuda/gemma.cu`): the scalar scales, the
//! soft-capped logits, the per-expert scale on the routing weights and the dense GeGLU's gated
//! activation. Lengths are checked before any launch ([`super::CudaError::Shape`]).

use super::epilogue::Glu;
use super::kernel::Kernel;
use super::ops::{args, blocks, i, need};
use super::{CudaBackend, CudaError, DPtr, Result};

const BLOCK: u32 = 256;

impl CudaBackend {
    /// `x *= s` on the first `n` elements (embeddings times `sqrt(hidden)`, a layer's output
    /// scalar).
    pub fn scale(&self, x: DPtr<f32>, n: usize, s: f32) -> Result<()> {
        const K: Kernel = Kernel::ScaleF32;
        need(K, "x", x, n)?;
        self.launch(K, (blocks(n, BLOCK), 1, 1), BLOCK, 0, args![x.raw(), i(n), s])
    }

    /// `x = cap * tanh(x / cap)` on the first `n` elements (soft-capped logits); `cap` must be
    /// positive and finite.
    pub fn softcap(&self, x: DPtr<f32>, n: usize, cap: f32) -> Result<()> {
        const K: Kernel = Kernel::SoftcapF32;
        if !(cap.is_finite() && cap > 0.0) {
            let reason = format!("soft cap {cap} is not a positive finite number");
            return Err(CudaError::Shape { kernel: K.symbol(), reason });
        }
        need(K, "x", x, n)?;
        self.launch(K, (blocks(n, BLOCK), 1, 1), BLOCK, 0, args![x.raw(), i(n), cap])
    }

    /// `w[j] *= scale[ids[j]]` over `n` routed entries (`scale`: one value per expert,
    /// `n_experts`); an id out of range leaves its weight (the worklist check refuses it).
    pub fn route_expert_scale(
        &self,
        ids: DPtr<i32>,
        w: DPtr<f32>,
        scale: DPtr<f32>,
        n: usize,
        n_experts: usize,
    ) -> Result<()> {
        const K: Kernel = Kernel::RouteExpertScaleF32;
        need(K, "ids", ids, n)?;
        need(K, "weights", w, n)?;
        need(K, "scale", scale, n_experts)?;
        let args = args![ids.raw(), w.raw(), scale.raw(), i(n), i(n_experts)];
        self.launch(K, (blocks(n, BLOCK), 1, 1), BLOCK, 0, args)
    }

    /// `out = glu(gate, up)` on the first `n` elements, the hot lane's gated activation
    /// ([`Glu`]) for a dense FFN (Gemma 4's GeGLU branch: [`Glu::GeluTanh`]).
    pub fn glu_mul(&self, glu: Glu, g: DPtr<f32>, u: DPtr<f32>, out: DPtr<f32>, n: usize) -> Result<()> {
        const K: Kernel = Kernel::GluMulF32;
        need(K, "g", g, n)?;
        need(K, "u", u, n)?;
        need(K, "out", out, n)?;
        let args = args![g.raw(), u.raw(), out.raw(), i(n), glu.code()];
        self.launch(K, (blocks(n, BLOCK), 1, 1), BLOCK, 0, args)
    }
}
