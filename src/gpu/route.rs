//! The router and the shared expert of an MoE layer on the GPU: FFN norm, router GEMV, top-k
//! (or the fused decode launch that also writes the hot worklist), the routing's copy to the
//! host when a lane there needs it, and the sigmoid-gated shared expert added into the layer's
//! MoE output.

use super::device::{Device, LayerCtx};
use super::moe::MoeStage;
use super::weights::SharedWeights;
use super::GpuError;
use crate::model::arch::{Ffn, RoutingVariant};
use moe_lanes_kernels::cuda::ops::{HotWorklist, NormRows, RouteVariant, SigmoidRoute};
use moe_lanes_kernels::cuda::{CudaBackend, DPtr};

impl MoeStage {
    /// FFN norm, router GEMV and top-k on the GPU into layer `cx.l`'s routing section (the fused
    /// launch with `fused`, which also writes the device worklist); the MoE output zeroed with
    /// `zero_moe`; when the host needs the routing (`to_host`), its copy queued to pinned memory
    /// (the pinned buffers' accessors wait for it). `rows_to_host` also queues the FFN-normed
    /// rows to pinned memory (decode on the device path with cold slots), ready at the same event.
    pub fn route(
        &mut self,
        cx: &LayerCtx<'_>,
        zero_moe: bool,
        to_host: bool,
        rows_to_host: bool,
        fused: bool,
    ) -> Result<(), GpuError> {
        let (dev, l, t) = (cx.dev, cx.l, cx.t);
        let (c, be, s) = (&dev.cfg, &dev.be, dev.s());
        let (h, k) = (c.hidden, c.n_experts_used);
        let (ids, wts) = (route_ids(s.ids(), k, l, t), route_ids(s.weights.ptr(), k, l, t));
        if zero_moe {
            be.zero(s.moe_out.ptr().sub(0, t * h))?;
        }
        if fused {
            self.route_fused(cx, ids, wts)?;
        } else {
            let lw = &dev.w.layers[l];
            be.rmsnorm(s.hidden.ptr(), lw.ffn_norm.ptr(), s.normed.ptr(), t, h, c.rms_eps)?;
            dev.gemv(s.normed.ptr(), lw.router(), s.router_logits.ptr(), t, c.n_experts, h, false)?;
            if let Some(b) = &lw.router_bias {
                be.add_bias_rows(s.router_logits.ptr(), b.ptr(), t, c.n_experts)?;
            }
            top_k(dev, l, t, ids, wts)?;
        }
        if to_host {
            let rows = s.normed.ptr().sub(0, if rows_to_host { t * h } else { 0 });
            let copies =
                [(ids.cast::<u32>(), 0), (wts.cast::<u32>(), s.cap * k), (rows.cast::<u32>(), 2 * s.cap * k)];
            be.read_async_many(&copies, &mut self.pin.route)?;
        }
        cx.mark(4)
    }

    /// The fused decode routing: norm, router, top-k and the device path's hot worklist in one
    /// launch (a bf16 router, [`route_fusable`]).
    fn route_fused(&self, cx: &LayerCtx<'_>, ids: DPtr<i32>, wts: DPtr<f32>) -> Result<(), GpuError> {
        let (dev, l, t) = (cx.dev, cx.l, cx.t);
        let (c, s) = (&dev.cfg, dev.s());
        let router = dev.w.layers[l].router().bf16().expect("route_fusable: a bf16 router");
        let (variant, norm_topk) = softmax_variant(dev, l);
        let (lay, wi, n_ent) = (s.layout, s.work_i.ptr(), t * c.n_experts_used);
        let worklist = HotWorklist {
            map: self.hot.map_dev(l),
            slots: wi.sub(lay.slots, n_ent),
            tokens: wi.sub(lay.tokens, n_ent),
            tok_off: wi.sub(lay.tok_off, t + 1),
            tok_rows: wi.sub(lay.tok_rows, t),
        };
        let rows = NormRows {
            x: s.hidden.ptr(),
            weight: dev.w.layers[l].ffn_norm.ptr(),
            normed: s.normed.ptr(),
            n_rows: t,
            dim: c.hidden,
            eps: c.rms_eps,
        };
        let (logits, counter) = (s.router_logits.ptr(), s.route_counter.ptr());
        let (e_n, k) = (c.n_experts, c.n_experts_used);
        dev.be.route_decode(
            rows,
            router,
            e_n,
            k,
            variant,
            norm_topk,
            logits,
            ids,
            wts,
            counter,
            Some(worklist),
        )?;
        Ok(())
    }
}

/// Layer `l`'s top-k over the router logits of `t` rows into `ids` and `wts`, by its routing
/// variant (softmax before or after the top-k, or sigmoid scores with the selection bias).
fn top_k(dev: &Device, l: usize, t: usize, ids: DPtr<i32>, wts: DPtr<f32>) -> Result<(), GpuError> {
    let (c, logits) = (&dev.cfg, dev.s().router_logits.ptr());
    let spec = dev.plan.layer(l).as_moe().expect("MoE layers only").router;
    if spec.variant == RoutingVariant::Sigmoid {
        let r = SigmoidRoute {
            selection_bias: dev.w.layers[l].selection_bias.as_ref().map(|b| b.ptr()),
            n_group: spec.n_group,
            topk_group: spec.topk_group,
            norm: spec.norm_topk_prob,
            scale: spec.scale,
        };
        return Ok(dev.be.route_sigmoid(logits, t, c.n_experts, c.n_experts_used, r, ids, wts)?);
    }
    let (variant, norm_topk) = softmax_variant(dev, l);
    Ok(dev.be.route_topk(logits, t, c.n_experts, c.n_experts_used, variant, norm_topk, ids, wts)?)
}

/// Layer `l`'s softmax routing as the kernels take it, and whether the top-k weights are
/// renormalised.
fn softmax_variant(dev: &Device, l: usize) -> (RouteVariant, bool) {
    let spec = dev.plan.layer(l).as_moe().expect("MoE layers only").router;
    let variant = match spec.variant {
        RoutingVariant::SoftmaxThenTopK => RouteVariant::SoftmaxThenTopK,
        RoutingVariant::TopKThenSoftmax => RouteVariant::TopKThenSoftmax,
        RoutingVariant::Sigmoid => unreachable!("sigmoid routers take route_sigmoid"),
    };
    (variant, spec.norm_topk_prob)
}

/// Whether layer `l`'s decode routing runs as the one fused launch (`route_decode`: norm,
/// router, top-k and the hot worklist): for a bf16 router without a bias whose rows fit the
/// kernel's shared memory (else four or five launches).
pub(crate) fn route_fusable(dev: &Device, l: usize) -> bool {
    let (c, lw) = (&dev.cfg, &dev.w.layers[l]);
    let softmax = dev.plan.layer(l).as_moe().is_some_and(|m| m.router.variant != RoutingVariant::Sigmoid);
    softmax
        && lw.router().bf16().is_some()
        && lw.router_bias.is_none()
        && CudaBackend::route_decode_fits(c.hidden, c.n_experts)
}

/// The shared expert, added into the layer's MoE output (scaled by its sigmoid gate when it
/// has one).
pub(crate) fn shared_expert(cx: &LayerCtx<'_>) -> Result<(), GpuError> {
    let (dev, t) = (cx.dev, cx.t);
    let Some(sw) = &dev.w.layers[cx.l].shared else { return Ok(()) };
    let (h, be, s) = (dev.cfg.hidden, &dev.be, dev.s());
    gated_ffn(cx, sw, dev.cfg.shared_expert_ff, s.shared_out.ptr(), false)?;
    match &sw.gate_logit {
        Some(gl) => {
            dev.gemv(s.normed.ptr(), gl.view(), s.shared_gl.ptr(), t, 1, h, false)?;
            be.add_sigmoid_scaled_rows(s.moe_out.ptr(), s.shared_out.ptr(), s.shared_gl.ptr(), t, h)?;
        }
        None => be.add(s.moe_out.ptr(), s.shared_out.ptr(), t * h)?,
    }
    Ok(())
}

/// A dense FFN layer (no experts): FFN norm, then `down · silu(gate · x) * (up · x)` added
/// straight into the residual stream.
pub(crate) fn dense_ffn(cx: &LayerCtx<'_>) -> Result<(), GpuError> {
    let (dev, l, t) = (cx.dev, cx.l, cx.t);
    let (c, s) = (&dev.cfg, dev.s());
    let lw = &dev.w.layers[l];
    let w = lw.dense.as_ref().expect("the plan says a dense FFN");
    let Ffn::Dense(d) = dev.plan.layer(l).ffn else { unreachable!("the plan says a dense FFN") };
    dev.be.rmsnorm(s.hidden.ptr(), lw.ffn_norm.ptr(), s.normed.ptr(), t, c.hidden, c.rms_eps)?;
    cx.mark(4)?;
    gated_ffn(cx, w, d.ff, s.hidden.ptr(), true)
}

/// `out (+)= down · silu(gate · x) * (up · x)` over the FFN-normed rows, `ff` wide.
fn gated_ffn(
    cx: &LayerCtx<'_>,
    w: &SharedWeights,
    ff: usize,
    out: DPtr<f32>,
    accumulate: bool,
) -> Result<(), GpuError> {
    let (dev, phase, t) = (cx.dev, cx.phase, cx.t);
    let (h, s) = (dev.cfg.hidden, dev.s());
    dev.linear(phase, s.normed.ptr(), w.gate.view(), s.g.ptr(), t, ff, h, false)?;
    dev.linear(phase, s.normed.ptr(), w.up.view(), s.u.ptr(), t, ff, h, false)?;
    dev.be.silu_mul(s.g.ptr(), s.u.ptr(), s.h.ptr(), t * ff)?;
    dev.linear(phase, s.h.ptr(), w.down.view(), out, t, h, ff, accumulate)
}

/// Layer `l`'s section of a routing buffer laid out `[n_layers, t * k]` for a call of `t`
/// tokens (so the perf state copies exactly the call's ids, every layer at once).
pub(crate) fn route_ids<T>(all: DPtr<T>, k: usize, l: usize, t: usize) -> DPtr<T> {
    all.sub(l * t * k, t * k)
}
