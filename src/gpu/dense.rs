//! The dense stage of one layer on the GPU: attention with the KV cache (fused q/k/v, q/k norm
//! and RoPE, split-position decode attention), the FFN norm and the router, and the shared
//! expert. Decode uses GEMV kernels; prefill and warmup use cuBLAS GEMMs.

use super::kv::GpuKvCache;
use super::model::{GpuModel, GpuSeg, PrefillAttention};
use super::scratch::Q8Buf;
use super::weights::MixerWeights;
use super::GpuError;
use crate::model::arch::{AttentionSpec, DeltaNetSpec, Mixer, QkNorm, RopeStyle, RoutingVariant, VHeadOrder};
use crate::moe::phase::Phase;
use moe_lanes_kernels::cuda::kernel::QUANT_MAX_TOKENS;
use moe_lanes_kernels::cuda::kernel::{DELTA_MAX_CONV_KERNEL, DELTA_MAX_KEY_DIM};
use moe_lanes_kernels::cuda::ops::{
    DeltaShape, DevicePos, HotWorklist, KvAppend, KvPtr, NormRows, RouteVariant,
};
use moe_lanes_kernels::cuda::quant::wide_alignment_bytes;
use moe_lanes_kernels::cuda::{CudaBackend, DPtr, Q8Rows, TypedWeights};
use moe_lanes_kernels::q8::Q8_BLOCK;

impl GpuModel {
    /// `y (+)= W x` for `t` rows: GEMV kernel in decode (one token over a short bf16 matrix: the
    /// split GEMV; and for a few rows of a quantized matrix), cuBLAS otherwise (quantized rows
    /// dequantized to bf16 first).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn linear(
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
        let few_rows = w.dtype.is_quantized() && t <= QUANT_MAX_TOKENS as usize;
        if let Some(bf) =
            w.bf16().filter(|bf| phase == Phase::Decode && t == 1 && self.be.split_gemv_pays(*bf, x, n, k))
        {
            return Ok(self.be.gemv_bf16_split(bf, x, y, n, k, accumulate)?);
        }
        if (phase == Phase::Decode && !self.gemm_pays(t)) || few_rows {
            return self.gemv(x, w, y, t, n, k, accumulate);
        }
        let s = self.scratch.as_ref().expect("reserved");
        let lo = self.opts.prefill_activations.split(w.dtype).then(|| s.x_lo.ptr());
        self.be.gather_split_bf16(x, None, s.x_hi.ptr(), lo, t, k)?;
        self.gemm(w, s.x_hi.ptr(), lo, y, t, n, k, accumulate)
    }

    /// Whether `t` rows of a decode call (a batched step) run their projections as GEMMs, each
    /// weight read once for all rows, instead of GEMVs that read it once a row
    /// ([`super::GpuOptions::batch_gemm_min_tokens`]).
    pub(crate) fn gemm_pays(&self, t: usize) -> bool {
        t >= self.opts.batch_gemm_min_tokens
    }

    /// The decode GEMV of a matrix in its stored type.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemv(
        &self,
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
        match self.dense_q8(w, t, k) {
            Some(xq) => {
                self.be.quantize_q8(x, 1, k, xq)?;
                self.be.gemv_quant_q8(w.dtype, w.bytes, xq, y, n, k, accumulate)?
            }
            None => self.be.gemv_quant(w.dtype, w.bytes, x, y, t, n, k, accumulate)?,
        }
        Ok(())
    }

    /// Where the one-token GEMV of `w` over `t` rows of `k` takes 8-bit activations
    /// (`GpuOptions::q8_activations`; a quantized matrix aligned for the wide chunks; one row of
    /// whole blocks of 32): the dense 8-bit rows, for [`CudaBackend::quantize_q8`] to write and
    /// the GEMV to read; None: f32 activations.
    pub(crate) fn dense_q8(&self, w: TypedWeights, t: usize, k: usize) -> Option<Q8Rows> {
        let wide = w.dtype.is_quantized() && w.bytes.raw().is_multiple_of(wide_alignment_bytes(w.dtype));
        self.q8_room(&self.scratch.as_ref()?.q8_dense, t, k).filter(|_| wide && t == 1)
    }

    /// `buf` for `rows` rows of `k` when the GEMVs take 8-bit activations and `k` is whole
    /// blocks of 32.
    pub(crate) fn q8_room(&self, buf: &Q8Buf, rows: usize, k: usize) -> Option<Q8Rows> {
        let q8 = buf.rows();
        let fits = k.is_multiple_of(Q8_BLOCK) && q8.q.len() >= rows * k;
        (self.opts.q8_activations && fits).then_some(q8)
    }

    /// cuBLAS GEMM of a matrix in its stored type over bf16 activations (hi + optional lo): a
    /// quantized matrix is dequantized to bf16 in row ranges that fit the dequantization scratch,
    /// each GEMM writing its column range of `y`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm(
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

    /// Attention block of layer `l`: norm, q/k/v (+bias), q/k norm, RoPE, attention over the
    /// cache, o projection accumulated into the residual stream. The row-wise stages run over
    /// all `t` rows; RoPE, the KV append and the attention per sequence (`segs`).
    pub(crate) fn attention_block(
        &mut self,
        l: usize,
        phase: Phase,
        t: usize,
        segs: &[GpuSeg<'_>],
    ) -> Result<(), GpuError> {
        let c = &self.cfg;
        let (h, qd, kvd) = (c.hidden, c.q_dim(), c.kv_dim());
        let s = self.scratch.as_ref().expect("reserved");
        let lw = &self.w.layers[l];
        let w = lw.attention();
        self.be.rmsnorm(s.hidden.ptr(), lw.attn_norm.ptr(), s.normed.ptr(), t, h, c.rms_eps)?;
        // One sequence outside the decode graph with an f32 cache takes the new key/value rows
        // in place; otherwise they go to scratch and the q/k norm + RoPE kernel appends them
        // (converted) at the position it reads from the device (the graph) or the sequence's.
        let in_place = match (self.step, segs) {
            (None, [seg]) => match (seg.cache.k(l), seg.cache.v(l)) {
                (KvPtr::F32(kc), KvPtr::F32(vc)) => {
                    Some((kc.sub(seg.pos0 * kvd, t * kvd), vc.sub(seg.pos0 * kvd, t * kvd)))
                }
                _ => None,
            },
            _ => None,
        };
        let (k_new, v_new) = in_place
            .unwrap_or_else(|| (s.kv_step.ptr().sub(0, t * kvd), s.kv_step.ptr().sub(t * kvd, t * kvd)));
        let qkv = [w.q.view(), w.k.view(), w.v.view()];
        let (y, n) = ([s.q.ptr(), k_new, v_new], [qd, kvd, kvd]);
        if let (Phase::Decode, false, [Some(q), Some(k), Some(v)]) =
            (phase, self.gemm_pays(t), qkv.map(|m| m.bf16()))
        {
            self.be.gemv3_bf16([q, k, v], s.normed.ptr(), y, n, t, h)?;
        } else if phase == Phase::Decode && t == 1 {
            // quantized (or mixed) q/k/v: one launch of the one-token kernels, over the normed row
            // in 8 bits when they take it
            let nq = qkv.iter().find_map(|m| self.dense_q8(*m, t, h));
            if let Some(nq) = nq {
                self.be.quantize_q8(s.normed.ptr(), 1, h, nq)?;
            }
            self.be.gemv3_typed(qkv, s.normed.ptr(), nq, y, n, h)?;
        } else {
            self.linear(phase, s.normed.ptr(), w.q.view(), s.q.ptr(), t, qd, h, false)?;
            self.linear(phase, s.normed.ptr(), w.k.view(), k_new, t, kvd, h, false)?;
            self.linear(phase, s.normed.ptr(), w.v.view(), v_new, t, kvd, h, false)?;
        }
        if let Some(gate) = &w.q_gate {
            self.linear(phase, s.normed.ptr(), gate.view(), s.gate.ptr(), t, qd, h, false)?;
        }
        for (dst, bias, dim) in [(s.q.ptr(), &w.q_bias, qd), (k_new, &w.k_bias, kvd), (v_new, &w.v_bias, kvd)]
        {
            if let Some(b) = bias {
                self.be.add_bias_rows(dst, b.ptr(), t, dim)?;
            }
        }
        let (q, pos) = (s.q.ptr(), self.step.map(|_| s.step.ptr().sub(1, 1)));
        for seg in segs {
            let (rq, rkv) =
                (q.sub(seg.row0 * qd, seg.n * qd), |p: DPtr<f32>| p.sub(seg.row0 * kvd, seg.n * kvd));
            let append = in_place.is_none().then(|| KvAppend {
                pos,
                v: rkv(v_new),
                k_cache: seg.cache.k(l),
                v_cache: seg.cache.v(l),
            });
            self.qk_norm_rope(l, seg.n, seg.pos0, rq, rkv(k_new), rkv(v_new), append)?;
        }
        self.mark(l, 1)?;
        for seg in segs {
            self.attention(l, phase, seg)?;
        }
        let s = self.scratch.as_ref().expect("reserved");
        let w = self.w.layers[l].attention();
        if w.q_gate.is_some() {
            self.be.mul_sigmoid(s.attn.ptr(), s.gate.ptr(), t * qd)?;
        }
        self.mark(l, 2)?;
        // o projection accumulates straight into the residual stream.
        self.linear(phase, s.attn.ptr(), w.o.view(), s.hidden.ptr(), t, h, qd, true)?;
        self.mark(l, 3)?;
        Ok(())
    }

    /// Layer `l`'s token mixer, as the plan says: attention over the KV cache, or a Gated
    /// DeltaNet over the session's recurrent state.
    pub(crate) fn mixer_block(
        &mut self,
        l: usize,
        phase: Phase,
        t: usize,
        segs: &[GpuSeg<'_>],
    ) -> Result<(), GpuError> {
        match self.plan.layer(l).mixer {
            Mixer::Attention(_) => self.attention_block(l, phase, t, segs),
            Mixer::GatedDeltaNet(d) => self.delta_net_block(l, &d, phase, t, segs),
            Mixer::LatentAttention(_) => unreachable!("refused by GpuModel::supports"),
        }
    }

    /// A Gated DeltaNet layer: norm, the `[q|k|v|z]` and `[b|a]` projections, the causal conv
    /// and the delta rule over the session's state (the recurrent kernel, token by token, for
    /// fewer than [`DELTA_CHUNKED_MIN_TOKENS`] tokens; else the chunked prefill), the output
    /// projection accumulated into the residual stream.
    fn delta_net_block(
        &mut self,
        l: usize,
        d: &DeltaNetSpec,
        phase: Phase,
        t: usize,
        segs: &[GpuSeg<'_>],
    ) -> Result<(), GpuError> {
        let (c, s) = (&self.cfg, self.scratch.as_ref().expect("reserved"));
        let lw = &self.w.layers[l];
        let MixerWeights::DeltaNet(w) = &lw.mixer else { unreachable!("the plan says DeltaNet") };
        let shape = delta_shape(d);
        let (h, vd) = (c.hidden, d.value_dim());
        let (p, ba, out) = (s.delta_p.ptr(), s.delta_ba.ptr(), s.delta_out.ptr());
        self.be.rmsnorm(s.hidden.ptr(), lw.attn_norm.ptr(), s.normed.ptr(), t, h, c.rms_eps)?;
        self.linear(phase, s.normed.ptr(), w.qkvz.view(), p, t, shape.p_stride(), h, false)?;
        self.linear(phase, s.normed.ptr(), w.ba.view(), ba, t, 2 * d.n_v_heads, h, false)?;
        self.mark(l, 1)?;
        let vectors = [w.dt_bias.ptr(), w.neg_a.ptr(), w.norm.ptr()];
        let (ps, bas) = (shape.p_stride(), 2 * d.n_v_heads);
        for seg in segs {
            let state = seg.cache.delta_state(l);
            let (r0, n) = (seg.row0, seg.n);
            let (p, ba, out) = (p.sub(r0 * ps, n * ps), ba.sub(r0 * bas, n * bas), out.sub(r0 * vd, n * vd));
            if n >= DELTA_CHUNKED_MIN_TOKENS {
                let work = s.delta_work.ptr();
                self.be.delta_conv_rows(shape, p, state.conv, w.conv.ptr(), work, n)?;
                self.be.delta_rule_chunked(shape, p, ba, state.matrix, vectors, work, out, n, c.rms_eps)?;
            } else {
                self.be.delta_conv(shape, p, state.conv, w.conv.ptr(), n)?;
                self.be.delta_rule(shape, p, ba, state.matrix, vectors, out, n, c.rms_eps)?;
            }
        }
        self.mark(l, 2)?;
        self.linear(phase, out, w.out.view(), s.hidden.ptr(), t, h, vd, true)?;
        self.mark(l, 3)?;
        Ok(())
    }

    /// Whether q/k norm and RoPE run as the one fused launch (no clamp between them and a norm
    /// the fused kernel does); the decode graph needs it (its KV append lives there).
    pub(crate) fn qk_fused(&self, l: usize) -> bool {
        qk_fusable(self.plan.layer(l).attention())
    }

    /// Per-head q/k norm (or none) and RoPE, fused into one launch when no clamp sits between
    /// (`append`: the decode graph's, see [`KvAppend`]; only on the fused path).
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope(
        &self,
        l: usize,
        t: usize,
        pos0: usize,
        q: DPtr<f32>,
        k_new: DPtr<f32>,
        v_new: DPtr<f32>,
        append: Option<KvAppend>,
    ) -> Result<(), GpuError> {
        let (c, be, w, a) =
            (&self.cfg, &self.be, self.w.layers[l].attention(), self.plan.layer(l).attention());
        let (qd, kvd, hd, nh, nkv) = (c.q_dim(), c.kv_dim(), c.head_dim, c.n_heads, c.n_kv_heads);
        let rot = a.rope.dims;
        let (interleaved, theta) = (a.rope.style == RopeStyle::Interleaved, a.rope.theta);
        let norms =
            || (w.q_norm.as_ref().expect("validated").ptr(), w.k_norm.as_ref().expect("validated").ptr());
        if self.qk_fused(l) {
            let norm = (a.qk_norm == QkNorm::PerHead).then(norms);
            let eps = c.rms_eps;
            be.qk_norm_rope(
                q,
                k_new,
                norm,
                t,
                nh,
                nkv,
                qd,
                kvd,
                hd,
                rot,
                pos0,
                theta,
                interleaved,
                eps,
                append,
            )?;
            return Ok(());
        }
        assert!(
            append.as_ref().is_none_or(|a| a.pos.is_none()),
            "the decode graph runs only with the fused q/k norm + RoPE"
        );
        match a.qk_norm {
            QkNorm::None => {}
            QkNorm::PerHead => {
                be.rmsnorm(q, norms().0, q, t * nh, hd, c.rms_eps)?;
                be.rmsnorm(k_new, norms().1, k_new, t * nkv, hd, c.rms_eps)?;
            }
            QkNorm::WholeProjection => {
                be.rmsnorm(q, norms().0, q, t, qd, c.rms_eps)?;
                be.rmsnorm(k_new, norms().1, k_new, t, kvd, c.rms_eps)?;
            }
        }
        if let Some(clip) = a.clip_qkv {
            be.clamp(q, t * qd, clip)?;
            be.clamp(k_new, t * kvd, clip)?;
            be.clamp(v_new, t * kvd, clip)?;
        }
        be.rope(q, t, nh, qd, hd, rot, pos0, theta, interleaved)?;
        be.rope(k_new, t, nkv, kvd, hd, rot, pos0, theta, interleaved)?;
        if let Some(a) = append {
            be.kv_store_rows(k_new, v_new, a.k_cache, a.v_cache, t, pos0, kvd)?;
        }
        Ok(())
    }

    /// The split decode attention's partials for `t` rows over the whole cache (grows, never
    /// shrinks).
    pub(crate) fn reserve_attention(&mut self, t: usize, cache: &GpuKvCache) -> Result<(), GpuError> {
        let c = &self.cfg;
        let need = CudaBackend::attention_split_scratch(t, c.n_heads, c.head_dim, cache.capacity);
        if self.attn_part.as_ref().is_none_or(|b| b.len() < need) {
            self.attn_part = None; // free first
            self.attn_part = Some(self.be.alloc_zeros::<f32>(need)?);
        }
        Ok(())
    }

    /// One sequence's attention over its cache, its rows of the queries into its rows of the
    /// output. Decode: positions split over many blocks, partials combined by a second kernel.
    fn attention(&mut self, l: usize, phase: Phase, seg: &GpuSeg<'_>) -> Result<(), GpuError> {
        let c = &self.cfg;
        let window = self.plan.layer(l).attention().window.unwrap_or(0);
        let (nh, nkv, hd, qd) = (c.n_heads, c.n_kv_heads, c.head_dim, c.q_dim());
        let (t, pos0, cache) = (seg.n, seg.pos0, seg.cache);
        // A one-token sequence of a batched call takes the decode kernel whatever the call's phase.
        let decode = phase == Phase::Decode || (t == 1 && pos0 > 0);
        if decode {
            self.reserve_attention(t, cache)?;
        }
        let s = self.scratch.as_ref().expect("reserved");
        let rows = |p: DPtr<f32>| p.sub(seg.row0 * qd, t * qd);
        let (q, kc, vc, out) = (rows(s.q.ptr()), cache.k(l), cache.v(l), rows(s.attn.ptr()));
        match (&self.attn_part, decode) {
            (Some(part), true) => {
                let at =
                    self.step.map(|max_positions| DevicePos { pos: s.step.ptr().sub(1, 1), max_positions });
                self.be.attention_split(q, kc, vc, out, part.ptr(), t, pos0, nh, nkv, hd, window, at)?
            }
            _ if self.opts.prefill_attention == PrefillAttention::Mma
                && self.be.attention_mma_takes(hd, (q, kc, vc, out)) =>
            {
                self.be.attention_mma(q, kc, vc, out, t, pos0, nh, nkv, hd, window)?
            }
            _ if self.opts.prefill_attention != PrefillAttention::PerRow
                && CudaBackend::attention_tiled_fits(hd) =>
            {
                self.be.attention_tiled(q, kc, vc, out, t, pos0, nh, nkv, hd, window)?
            }
            _ => self.be.attention(q, kc, vc, out, t, pos0, nh, nkv, hd, window)?,
        }
        Ok(())
    }

    /// FFN norm, router GEMV and top-k on the GPU into layer `l`'s routing section; when the
    /// host needs the routing (`to_host`), queue its copy to pinned memory (the pinned buffers'
    /// accessors wait for it).
    /// `rows_to_host` also queues the FFN-normed rows to pinned memory (decode on the device
    /// path with cold slots), ready at the same event.
    /// Whether layer `l`'s decode routing runs as the one fused launch (`route_decode`: norm,
    /// router, top-k and the hot worklist): for a bf16 router whose rows fit the kernel's shared
    /// memory (else four launches).
    pub(crate) fn route_fusable(&self, l: usize) -> bool {
        let c = &self.cfg;
        self.w.layers[l].router.view().bf16().is_some()
            && CudaBackend::route_decode_fits(c.hidden, c.n_experts)
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn route(
        &mut self,
        l: usize,
        t: usize,
        zero_moe: bool,
        to_host: bool,
        rows_to_host: bool,
        fused: bool,
    ) -> Result<(), GpuError> {
        let c = &self.cfg;
        let (h, e_n, k) = (c.hidden, c.n_experts, c.n_experts_used);
        let router_spec = self.plan.layer(l).as_moe().expect("MoE layers only (GpuModel::supports)").router;
        let norm_topk = router_spec.norm_topk_prob;
        let variant = match router_spec.variant {
            RoutingVariant::SoftmaxThenTopK => RouteVariant::SoftmaxThenTopK,
            RoutingVariant::TopKThenSoftmax => RouteVariant::TopKThenSoftmax,
            RoutingVariant::Sigmoid => unreachable!("refused by GpuModel::supports"),
        };
        let s = self.scratch.as_ref().expect("reserved");
        let (ids, wts) = (route_ids(s.ids(), k, l, t), route_ids(s.weights.ptr(), k, l, t));
        if zero_moe {
            self.be.zero(s.moe_out.ptr().sub(0, t * h))?;
        }
        let norm_w = self.w.layers[l].ffn_norm.ptr();
        let router = self.w.layers[l].router.view();
        match router.bf16().filter(|_| fused) {
            Some(r) => {
                let (lay, wi) = (s.layout, s.work_i.ptr());
                let n_ent = t * k;
                let worklist = HotWorklist {
                    map: self.hot.map_dev(l),
                    slots: wi.sub(lay.slots, n_ent),
                    tokens: wi.sub(lay.tokens, n_ent),
                    tok_off: wi.sub(lay.tok_off, t + 1),
                    tok_rows: wi.sub(lay.tok_rows, t),
                };
                let rows = NormRows {
                    x: s.hidden.ptr(),
                    weight: norm_w,
                    normed: s.normed.ptr(),
                    n_rows: t,
                    dim: h,
                    eps: c.rms_eps,
                };
                let (logits, counter) = (s.router_logits.ptr(), s.route_counter.ptr());
                self.be.route_decode(
                    rows,
                    r,
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
            }
            None => {
                self.be.rmsnorm(s.hidden.ptr(), norm_w, s.normed.ptr(), t, h, c.rms_eps)?;
                self.gemv(s.normed.ptr(), router, s.router_logits.ptr(), t, e_n, h, false)?;
                self.be.route_topk(s.router_logits.ptr(), t, e_n, k, variant, norm_topk, ids, wts)?;
            }
        }
        let s = self.scratch.as_mut().expect("reserved");
        if to_host {
            let rows = s.normed.ptr().sub(0, if rows_to_host { t * h } else { 0 });
            let copies =
                [(ids.cast::<u32>(), 0), (wts.cast::<u32>(), s.cap * k), (rows.cast::<u32>(), 2 * s.cap * k)];
            self.be.read_async_many(&copies, &mut s.pin_route)?;
        }
        self.mark(l, 4)?;
        Ok(())
    }

    /// The shared expert (sigmoid-gated), added into the layer's MoE output.
    pub(crate) fn shared_expert(&self, l: usize, phase: Phase, t: usize) -> Result<(), GpuError> {
        let Some(sw) = &self.w.layers[l].shared else { return Ok(()) };
        let (h, sff) = (self.cfg.hidden, self.cfg.shared_expert_ff);
        let s = self.scratch.as_ref().expect("reserved");
        self.linear(phase, s.normed.ptr(), sw.gate.view(), s.g.ptr(), t, sff, h, false)?;
        self.linear(phase, s.normed.ptr(), sw.up.view(), s.u.ptr(), t, sff, h, false)?;
        self.be.silu_mul(s.g.ptr(), s.u.ptr(), s.h.ptr(), t * sff)?;
        self.linear(phase, s.h.ptr(), sw.down.view(), s.shared_out.ptr(), t, h, sff, false)?;
        self.gemv(s.normed.ptr(), sw.gate_logit.view(), s.shared_gl.ptr(), t, 1, h, false)?;
        self.be.add_sigmoid_scaled_rows(s.moe_out.ptr(), s.shared_out.ptr(), s.shared_gl.ptr(), t, h)?;
        Ok(())
    }
}

/// Layer `l`'s section of a routing buffer laid out `[n_layers, t * k]` for a call of `t`
/// tokens (so the perf state copies exactly the call's ids, every layer at once).
pub(crate) fn route_ids<T>(all: DPtr<T>, k: usize, l: usize, t: usize) -> DPtr<T> {
    all.sub(l * t * k, t * k)
}

/// Whether an attention layer of this kind takes the one fused q/k norm + RoPE launch: no clamp
/// between them and a norm the fused kernel does.
pub(crate) fn qk_fusable(a: &AttentionSpec) -> bool {
    a.clip_qkv.is_none() && matches!(a.qk_norm, QkNorm::None | QkNorm::PerHead)
}

/// The mixer kinds the GPU engine runs: attention layers without sinks, o bias or YaRN, and Gated
/// DeltaNet layers whose key heads fit the kernel's registers.
pub(crate) fn runs_mixer(m: &Mixer) -> bool {
    match m {
        // Attention sinks, an o bias and YaRN RoPE (GPT-OSS) have no kernels here yet, nor
        // Gemma 4's proportional RoPE, keys as values, v norm and score scale.
        Mixer::Attention(a) => {
            !a.sinks
                && !a.o_bias
                && a.rope.yarn.is_none()
                && a.rope.turning_pairs.is_none()
                && !a.values_from_keys
                && !a.v_norm
                && a.scale.is_none()
        }
        // Latent attention (DeepSeek-V3) has no kernels here yet.
        Mixer::LatentAttention(_) => false,
        Mixer::GatedDeltaNet(d) => {
            d.k_head_dim <= DELTA_MAX_KEY_DIM
                && d.v_head_dim <= 1024
                && d.conv_kernel <= DELTA_MAX_CONV_KERNEL
        }
    }
}

/// Calls of at least this many tokens run a DeltaNet layer's conv over every (token, channel) at
/// once and its delta rule chunked (every chunk's intra-chunk part in parallel, six launches in
/// all); shorter ones token by token in two launches, whose per-token steps cost less than the
/// chunked form's fixed launches and `chunk x chunk` work.
pub(crate) const DELTA_CHUNKED_MIN_TOKENS: usize = 16;

/// A DeltaNet layer's sizes as the kernels take them.
pub(crate) fn delta_shape(d: &DeltaNetSpec) -> DeltaShape {
    DeltaShape {
        n_k_heads: d.n_k_heads,
        n_v_heads: d.n_v_heads,
        k_head_dim: d.k_head_dim,
        v_head_dim: d.v_head_dim,
        conv_kernel: d.conv_kernel,
        tiled_v_heads: d.v_heads == VHeadOrder::Tiled,
    }
}
