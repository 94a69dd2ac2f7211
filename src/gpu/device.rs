//! What every stage of the GPU engine reads: the device, the model's shapes and per-layer plan,
//! the engine's options, the non-expert weights, the per-call device scratch and the profiler
//! ([`Device`]); the layer context a stage takes ([`LayerCtx`]); and the matrix products every
//! stage runs ([`Device::linear`], [`Device::gemv`], [`Device::gemm`]).
//!
//! Invariant: nothing here changes during a layer. The stages own what they change (the mixer
//! its attention partials, the MoE stage its hot cache, host scratch, Post-Fetch and lane
//! records, the head its pinned tail), so a layer runs as `mixer.run(&cx)` then
//! `moe.run(&cx)` over one shared `&Device`.

use super::options::{GpuOptions, LayerFaults};
use super::scratch::{Q8Buf, Scratch};
use super::stats::Profiler;
use super::weights::{DenseWeights, Ends};
use super::GpuError;
use crate::model::arch::LayerPlan;
use crate::model::config::ModelConfig;
use crate::model::Model;
use crate::moe::phase::Phase;
use moe_lanes_kernels::cuda::kernel::{DECODE_GEMV_MAX_TOKENS, QUANT_MAX_TOKENS};
use moe_lanes_kernels::cuda::quant::wide_alignment_bytes;
use moe_lanes_kernels::cuda::{CudaBackend, DPtr, DeviceBuffer, Q8Rows, TypedWeights};
use moe_lanes_kernels::q8::Q8_BLOCK;
use std::sync::Arc;

/// The engine's shared, read-only-per-layer state: one per device the model is split over.
pub(crate) struct Device {
    pub be: Arc<CudaBackend>,
    /// The layers this device runs (every layer on one device).
    pub layers: std::ops::Range<usize>,
    /// The ends of the model it runs beside them (the embedding on the first device, the head on
    /// the last).
    pub ends: Ends,
    pub model: Arc<Model>,
    pub cfg: ModelConfig,
    /// Every layer's kind (the engine walks it; each stage reads its layer's spec).
    pub plan: LayerPlan,
    /// Per layer: it routes to experts (a dense FFN layer does not).
    pub expert_layers: Vec<bool>,
    pub opts: GpuOptions,
    pub w: DenseWeights,
    pub scratch: Option<Scratch>,
    /// bf16 rows of quantized matrices for the prefill GEMMs (none for a float model).
    pub dequant: Option<DeviceBuffer<u16>>,
    pub profiler: Option<Profiler>,
    /// While a decode graph is captured: the most positions its attention is sized for (the
    /// position itself is read from device memory, `Scratch::step`).
    pub step: Option<usize>,
    /// A batched call's per-row positions and cache addresses on the device (`batch`), set for
    /// the call's layers (`active`) and kept (its buffers reused) between calls.
    pub rows: Option<super::batch::BatchRows>,
}

/// One layer of one forward call, as a stage sees it.
#[derive(Clone, Copy)]
pub(crate) struct LayerCtx<'a> {
    pub dev: &'a Device,
    pub l: usize,
    pub phase: Phase,
    /// The call's token rows.
    pub t: usize,
    /// The faults injected into this layer of this call.
    pub faults: LayerFaults,
}

impl LayerCtx<'_> {
    /// Layer `l` of forward call `call_idx` (counted from 1) over `t` rows.
    pub fn of(dev: &Device, call_idx: u64, l: usize, phase: Phase, t: usize) -> LayerCtx<'_> {
        LayerCtx { dev, l, phase, t, faults: dev.opts.faults.at(call_idx, l) }
    }

    /// Profile mark `m` of this layer.
    pub fn mark(&self, m: usize) -> Result<(), GpuError> {
        self.dev.mark(self.l, m)
    }
}

/// A scratch's bf16 hi and lo rows of an f32 input ([`CudaBackend::gather_split_bf16`]).
pub type SplitRows = (DPtr<u16>, DPtr<u16>);

impl Device {
    /// The per-call scratch (reserved before any stage runs).
    pub fn s(&self) -> &Scratch {
        self.scratch.as_ref().expect("reserved")
    }

    /// `y (+)= W x` for `t` rows: GEMV kernels in decode (one token over a short bf16 matrix: the
    /// split GEMV; 2 to [`DECODE_GEMV_MAX_TOKENS`] rows of bf16: the tensor-core GEMV; up to that
    /// many rows of a quantized matrix, and a few rows in any phase: the quantized GEMV), cuBLAS
    /// otherwise (quantized rows dequantized to bf16 first).
    #[allow(clippy::too_many_arguments)]
    pub fn linear(
        &self,
        phase: Phase,
        x: DPtr<f32>,
        w: TypedWeights,
        y: DPtr<f32>,
        t: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<(), GpuError> {
        if let Some(bf) =
            w.bf16().filter(|bf| phase == Phase::Decode && t == 1 && self.be.split_gemv_pays(*bf, x, n, k))
        {
            return Ok(self.be.gemv_bf16_split(bf, x, y, n, k, accumulate)?);
        }
        if let Some(bf) = w.bf16() {
            if let Some(xs) = self.decode_mma_rows(phase, x, &[bf], t, k)? {
                return Ok(self.be.gemv_mma_bf16(&[bf], xs, &[y], &[n], t, k, accumulate)?);
            }
        }
        if self.by_gemv(phase, w, t) {
            return self.gemv(phase, x, w, y, t, n, k, accumulate);
        }
        let s = self.s();
        let lo = self.opts.prefill_activations.split(w.dtype).then(|| s.x_lo.ptr());
        self.be.gather_split_bf16(x, None, s.x_hi.ptr(), lo, t, k)?;
        self.gemm(w, s.x_hi.ptr(), lo, y, t, n, k, accumulate)
    }

    /// Whether [`Device::linear`] takes the GEMV kernels for `t` rows of `w` (after the bf16
    /// split and tensor-core paths): decode calls too small for a GEMM, and quantized matrices
    /// over a few rows in any phase or up to [`DECODE_GEMV_MAX_TOKENS`] decode rows.
    fn by_gemv(&self, phase: Phase, w: TypedWeights, t: usize) -> bool {
        let decode_rows = phase == Phase::Decode && t <= DECODE_GEMV_MAX_TOKENS;
        let few_rows = w.dtype.is_quantized() && (t <= QUANT_MAX_TOKENS as usize || decode_rows);
        (phase == Phase::Decode && !self.gemm_pays(t)) || few_rows
    }

    /// The 8-bit rows that every matrix of `ws` (quantized, over the same `t` rows of `k`)
    /// would quantize for itself in [`Device::linear`]'s GEMV path, so a caller can write them
    /// once; None when any of them takes another path.
    pub fn shared_q8_rows(&self, phase: Phase, ws: &[TypedWeights], t: usize, k: usize) -> Option<Q8Rows> {
        let mut rows = None;
        for w in ws {
            // gemv_q8 takes quantized matrices only; every one of them writes the same scratch
            rows = Some(self.gemv_q8(phase, *w, t, k).filter(|_| self.by_gemv(phase, *w, t))?);
        }
        rows
    }

    /// The bf16 hi + lo rows of `x` (`t` rows of `k`) when a decode call of `t` rows multiplies
    /// them with the bf16 matrices `ws` on the tensor-core GEMV ([`CudaBackend::gemv_mma_bf16`]:
    /// 2 to [`DECODE_GEMV_MAX_TOKENS`] rows, whole 32-column slabs): written to the scratch here.
    /// None: another kernel takes the call.
    pub fn decode_mma_rows(
        &self,
        phase: Phase,
        x: DPtr<f32>,
        ws: &[DPtr<u16>],
        t: usize,
        k: usize,
    ) -> Result<Option<SplitRows>, GpuError> {
        let s = self.s();
        let (hi, lo) = (s.x_hi.ptr(), s.x_lo.ptr());
        let rows = phase == Phase::Decode && (2..=DECODE_GEMV_MAX_TOKENS).contains(&t);
        if !rows || !ws.iter().all(|&w| CudaBackend::gemv_mma_fits(w, hi, lo, k)) {
            return Ok(None);
        }
        self.be.gather_split_bf16(x, None, hi, Some(lo), t, k)?;
        Ok(Some((hi, lo)))
    }

    /// Whether `t` rows of a decode call (a batched step) run their projections as GEMMs, each
    /// weight read once for all rows, instead of GEMVs that read it once a row
    /// ([`GpuOptions::batch_gemm_min_tokens`]).
    pub fn gemm_pays(&self, t: usize) -> bool {
        t >= self.opts.batch_gemm_min_tokens
    }

    /// The 8-bit rows [`Device::gemv`] quantizes `t` rows of `k` into for `w`: one token, or the
    /// rows of a decode call (a batched step); a prefill chunk's rows keep f32, as its GEMMs keep
    /// about f32 (`GpuOptions::prefill_activations`). None: f32 activations.
    fn gemv_q8(&self, phase: Phase, w: TypedWeights, t: usize, k: usize) -> Option<Q8Rows> {
        self.dense_q8(w, t, k).filter(|_| t == 1 || phase == Phase::Decode)
    }

    /// The GEMV of a matrix in its stored type (8-bit activations where [`Device::gemv_q8`]
    /// gives rows).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv(
        &self,
        phase: Phase,
        x: DPtr<f32>,
        w: TypedWeights,
        y: DPtr<f32>,
        t: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<(), GpuError> {
        if let Some(bf) = w.bf16() {
            return Ok(self.be.gemv_bf16(bf, x, y, t, n, k, accumulate)?);
        }
        match self.gemv_q8(phase, w, t, k) {
            Some(xq) => {
                self.be.quantize_q8(x, t, k, xq)?;
                self.be.gemv_quant_q8_tokens(w.dtype, w.bytes, xq, y, t, n, k, accumulate)?
            }
            None => self.be.gemv_quant(w.dtype, w.bytes, x, y, t, n, k, accumulate)?,
        }
        Ok(())
    }

    /// Where the GEMV of `w` over `t` rows of `k` takes 8-bit activations
    /// (`GpuOptions::q8_activations`; a quantized matrix aligned for the wide chunks; rows of
    /// whole blocks of 32 that fit the scratch): the dense 8-bit rows, for
    /// [`CudaBackend::quantize_q8`] to write and the GEMV to read; None: f32 activations.
    pub fn dense_q8(&self, w: TypedWeights, t: usize, k: usize) -> Option<Q8Rows> {
        let wide = w.dtype.is_quantized() && w.bytes.raw().is_multiple_of(wide_alignment_bytes(w.dtype));
        self.q8_room(&self.scratch.as_ref()?.q8_dense, t, k).filter(|_| wide)
    }

    /// `buf` for `rows` rows of `k` when the GEMVs take 8-bit activations and `k` is whole
    /// blocks of 32.
    pub fn q8_room(&self, buf: &Q8Buf, rows: usize, k: usize) -> Option<Q8Rows> {
        let q8 = buf.rows();
        let fits = k.is_multiple_of(Q8_BLOCK) && q8.q.len() >= rows * k;
        (self.opts.q8_activations && fits).then_some(q8)
    }

    /// cuBLAS GEMM of a matrix in its stored type over bf16 activations (hi + optional lo): a
    /// quantized matrix is dequantized to bf16 in row ranges that fit the dequantization scratch,
    /// each GEMM writing its column range of `y`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        w: TypedWeights,
        x_hi: DPtr<u16>,
        x_lo: Option<DPtr<u16>>,
        y: DPtr<f32>,
        t: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<(), GpuError> {
        if let Some(bf) = w.bf16() {
            self.be.gemm_bf16(bf, x_hi, x_lo, y, t, n, k, accumulate)?;
            return Ok(());
        }
        let buf = self.dequant.as_ref().expect("reserved for a model with quantized matrices").ptr();
        assert!(buf.len() >= k, "the dequantization scratch holds at least one row");
        let rows_per = (buf.len() / k).min(n);
        for r0 in (0..n).step_by(rows_per) {
            let r = rows_per.min(n - r0);
            self.be.dequantize_bf16(w.dtype, w.bytes, r0, r, k, buf)?;
            self.be.gemm_bf16_strided(buf.sub(0, r * k), x_hi, x_lo, y.from(r0), t, r, k, n, accumulate)?;
        }
        Ok(())
    }

    /// The batched call's row tables, while its layers run.
    pub fn batch_rows(&self) -> Option<&super::batch::BatchRows> {
        self.rows.as_ref().filter(|r| r.active)
    }

    /// Profile mark `m` of layer `l` (a CUDA event, when profiling).
    pub fn mark(&self, l: usize, m: usize) -> Result<(), GpuError> {
        if let Some(p) = &self.profiler {
            self.be.record(&p.layer_marks[l][m])?;
        }
        Ok(())
    }

    /// Profile mark `m` of the call's head and tail.
    pub fn mark_tail(&self, m: usize) -> Result<(), GpuError> {
        if let Some(p) = &self.profiler {
            self.be.record(&p.tail_marks[m])?;
        }
        Ok(())
    }
}
