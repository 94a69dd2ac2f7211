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
use moe_lanes_kernels::cuda::{CudaBackend, DPtr, DeviceBuffer, Glu};

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
        let lw = dev.w.layer(l);
        if fused {
            self.route_fused(cx, ids, wts)?;
        } else {
            be.rmsnorm(s.hidden.ptr(), router_norm(dev, l).ptr(), s.normed.ptr(), t, h, c.rms_eps)?;
            dev.gemv(cx.phase, s.normed.ptr(), lw.router(), s.router_logits.ptr(), t, c.n_experts, h, false)?;
            if let Some(b) = &lw.router_bias {
                be.add_bias_rows(s.router_logits.ptr(), b.ptr(), t, c.n_experts)?;
            }
            top_k(dev, l, t, ids, wts)?;
        }
        if let Some(scale) = &lw.extras.router_expert_scale {
            be.route_expert_scale(ids, wts, scale.ptr(), t * k, c.n_experts)?;
        }
        if lw.extras.branch_norms.is_some() {
            // the router read its own norm of the residual: the branches, then the experts' input
            branches(cx)?;
        } else if lw.extras.router_input_scale.is_some() {
            be.rmsnorm(s.hidden.ptr(), lw.ffn_norm.ptr(), s.normed.ptr(), t, h, c.rms_eps)?;
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
        let router = dev.w.layer(l).router().bf16().expect("route_fusable: a bf16 router");
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
            weight: router_norm(dev, l).ptr(),
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
            selection_bias: dev.w.layer(l).selection_bias.as_ref().map(|b| b.ptr()),
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
    let (c, lw) = (&dev.cfg, dev.w.layer(l));
    let softmax = dev.plan.layer(l).as_moe().is_some_and(|m| m.router.variant != RoutingVariant::Sigmoid);
    softmax
        && lw.router().bf16().is_some()
        && lw.router_bias.is_none()
        && CudaBackend::route_decode_fits(c.hidden, c.n_experts)
}

/// The weight of the RMSNorm the router reads: the FFN norm's, or (Gemma 4) the learned input
/// scale times `hidden^-0.5` over the residual.
fn router_norm(dev: &Device, l: usize) -> &DeviceBuffer<f32> {
    let lw = dev.w.layer(l);
    lw.extras.router_input_scale.as_ref().unwrap_or(&lw.ffn_norm)
}

/// Per-branch norms (Gemma 4, `MoeSpec::branch_norms`), after the routing: the dense branch
/// over the FFN norm's rows, normed by its post norm into the shared expert's rows (the join
/// adds them, [`add_moe_output`]); then the experts' input, their own norm of the residual, in
/// the normed rows the lanes read.
fn branches(cx: &LayerCtx<'_>) -> Result<(), GpuError> {
    let (dev, l, t) = (cx.dev, cx.l, cx.t);
    let (c, be, s) = (&dev.cfg, &dev.be, dev.s());
    let lw = dev.w.layer(l);
    let [shared_post, experts_pre, _] = lw.extras.branch_norms.as_ref().expect("a layer with branch norms");
    let sw = lw.shared.as_ref().expect("branch norms come with the dense branch (GpuModel::supports)");
    let (h, out) = (c.hidden, s.shared_out.ptr());
    be.rmsnorm(s.hidden.ptr(), lw.ffn_norm.ptr(), s.normed.ptr(), t, h, c.rms_eps)?;
    gated_ffn(cx, sw, c.shared_expert_ff, out, false)?;
    be.rmsnorm(out, shared_post.ptr(), out, t, h, c.rms_eps)?;
    be.rmsnorm(s.hidden.ptr(), experts_pre.ptr(), s.normed.ptr(), t, h, c.rms_eps)?;
    Ok(())
}

/// The layer's MoE output (`moe_out`, the routed experts' rows joined) into the residual
/// stream: with branch norms normed by the experts' post norm and the dense branch's rows added;
/// normed by the FFN's post norm (sandwich norms); added; the layer's output scalar on the
/// residual (Gemma 4). Other layers: the one add.
pub(crate) fn add_moe_output(dev: &Device, l: usize, t: usize) -> Result<(), GpuError> {
    let (c, be, s) = (&dev.cfg, &dev.be, dev.s());
    let (x, h, ex) = (s.moe_out.ptr(), c.hidden, &dev.w.layer(l).extras);
    if let Some([_, _, experts_post]) = &ex.branch_norms {
        be.rmsnorm(x, experts_post.ptr(), x, t, h, c.rms_eps)?;
        be.add(x, s.shared_out.ptr(), t * h)?;
    }
    if let Some([_, ffn_post]) = &ex.post_norms {
        be.rmsnorm(x, ffn_post.ptr(), x, t, h, c.rms_eps)?;
    }
    be.add(s.hidden.ptr(), x, t * h)?;
    if let Some(scale) = ex.output_scale {
        be.scale(s.hidden.ptr(), t * h, scale)?;
    }
    Ok(())
}

/// The shared expert, added into the layer's MoE output (scaled by its sigmoid gate when it
/// has one); with branch norms it ran with the routing and the join adds it.
pub(crate) fn shared_expert(cx: &LayerCtx<'_>) -> Result<(), GpuError> {
    let (dev, t) = (cx.dev, cx.t);
    let Some(sw) = &dev.w.layer(cx.l).shared else { return Ok(()) };
    if dev.w.layer(cx.l).extras.branch_norms.is_some() {
        return Ok(());
    }
    let (h, be, s) = (dev.cfg.hidden, &dev.be, dev.s());
    gated_ffn(cx, sw, dev.cfg.shared_expert_ff, s.shared_out.ptr(), false)?;
    match &sw.gate_logit {
        Some(gl) => {
            dev.gemv(cx.phase, s.normed.ptr(), gl.view(), s.shared_gl.ptr(), t, 1, h, false)?;
            be.add_sigmoid_scaled_rows(s.moe_out.ptr(), s.shared_out.ptr(), s.shared_gl.ptr(), t, h)?;
        }
        None => be.add(s.moe_out.ptr(), s.shared_out.ptr(), t * h)?,
    }
    Ok(())
}

/// A dense FFN layer (no experts): FFN norm, then `down · act(gate · x) * (up · x)` added
/// straight into the residual stream.
pub(crate) fn dense_ffn(cx: &LayerCtx<'_>) -> Result<(), GpuError> {
    let (dev, l, t) = (cx.dev, cx.l, cx.t);
    let (c, s) = (&dev.cfg, dev.s());
    let lw = dev.w.layer(l);
    let w = lw.dense.as_ref().expect("the plan says a dense FFN");
    let Ffn::Dense(d) = dev.plan.layer(l).ffn else { unreachable!("the plan says a dense FFN") };
    dev.be.rmsnorm(s.hidden.ptr(), lw.ffn_norm.ptr(), s.normed.ptr(), t, c.hidden, c.rms_eps)?;
    cx.mark(4)?;
    gated_ffn(cx, w, d.ff, s.hidden.ptr(), true)
}

/// `out (+)= down · act(gate · x) * (up · x)` over the FFN-normed rows, `ff` wide (the layer's
/// activation: SiLU, or Gemma 4's tanh GELU).
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
    let activation = match dev.plan.layer(cx.l).ffn {
        Ffn::Moe(m) => m.activation,
        Ffn::Dense(d) => d.activation,
    };
    match Glu::of(activation.kernel()) {
        Some(Glu::Silu) => dev.be.silu_mul(s.g.ptr(), s.u.ptr(), s.h.ptr(), t * ff)?,
        Some(glu) => dev.be.glu_mul(glu, s.g.ptr(), s.u.ptr(), s.h.ptr(), t * ff)?,
        None => return Err(GpuError::Activation { activation }),
    }
    dev.linear(phase, s.h.ptr(), w.down.view(), out, t, h, ff, accumulate)
}

/// Layer `l`'s section of a routing buffer laid out `[n_layers, t * k]` for a call of `t`
/// tokens (so the perf state copies exactly the call's ids, every layer at once).
pub(crate) fn route_ids<T>(all: DPtr<T>, k: usize, l: usize, t: usize) -> DPtr<T> {
    all.sub(l * t * k, t * k)
}
