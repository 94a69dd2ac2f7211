//! The mixer stage of one layer on the GPU: attention over the KV cache (fused q/k/v, q/k norm
//! and RoPE, split-position decode attention, tiled or tensor-core prefill attention) or a Gated
//! DeltaNet over the session's recurrent state, as the layer's plan says. Decode uses GEMV
//! kernels; prefill and warmup use cuBLAS GEMMs.

use super::batch::BatchRows;
use super::device::{Device, LayerCtx};
use super::kv::GpuKvCache;
use super::model::GpuSeg;
use super::options::PrefillAttention;
use super::weights::MixerWeights;
use super::GpuError;
use crate::model::arch::{AttentionSpec, DeltaNetSpec, LayerPlan, Mixer, QkNorm, RopeStyle, VHeadOrder};
use crate::moe::phase::Phase;
use moe_lanes_kernels::cuda::kernel::{DELTA_MAX_CONV_KERNEL, DELTA_MAX_KEY_DIM};
use moe_lanes_kernels::cuda::ops::{
    AttentionMask, BatchKv, DeltaShape, DevicePos, KvAppend, KvPtr, RopeScaling, ATTENTION_MAX_HEAD_DIM,
};
use moe_lanes_kernels::cuda::{CudaBackend, DPtr, DeviceBuffer};

/// The token mixers of every layer; owns the split decode attention's partials.
pub(crate) struct MixerStage {
    /// Partials of the split decode attention (grown to the cache's capacity on demand).
    attn_part: Option<DeviceBuffer<f32>>,
    /// Every layer's q/k norm + RoPE is the fused launch (`qk_fusable`), which the decode graphs
    /// need; fixed by the plan, so decided once here.
    pub qk_fused_all: bool,
}

impl MixerStage {
    pub fn new(plan: &LayerPlan) -> MixerStage {
        let qk_fused_all = plan.layers().iter().all(|s| s.as_attention().is_none_or(qk_fusable));
        MixerStage { attn_part: None, qk_fused_all }
    }

    /// The attention partials' allocation serial (0: none), for the decode graphs' key.
    pub fn part_serial(&self) -> u64 {
        self.attn_part.as_ref().map_or(0, |p| p.serial())
    }

    /// Layer `cx.l`'s token mixer, as the plan says: attention over the KV cache, or a Gated
    /// DeltaNet over the session's recurrent state. The row-wise stages run over all rows;
    /// RoPE, the KV append, attention and the recurrent state per sequence (`segs`).
    pub fn run(&mut self, cx: &LayerCtx<'_>, segs: &[GpuSeg<'_>]) -> Result<(), GpuError> {
        match cx.dev.plan.layer(cx.l).mixer {
            Mixer::Attention(_) => self.attention_block(cx, segs),
            Mixer::GatedDeltaNet(d) => delta_net_block(cx, &d, segs),
            Mixer::LatentAttention(m) => {
                let rows = segs.iter().map(|s| s.n).max().unwrap_or(0);
                // the partials for the longest sequence and the largest cache of the call
                let cache =
                    segs.iter().map(|s| s.cache).max_by_key(|c| c.capacity).expect("a call has a sequence");
                self.reserve_attention(cx.dev, rows, cache)?;
                let part = self.attn_part.as_ref().expect("reserved above").ptr();
                super::latent::latent_block(cx, &m, segs, part)
            }
        }
    }

    /// Attention block: norm, q/k/v (+bias), q/k norm, RoPE, attention over the cache, o
    /// projection accumulated into the residual stream.
    fn attention_block(&mut self, cx: &LayerCtx<'_>, segs: &[GpuSeg<'_>]) -> Result<(), GpuError> {
        let (dev, l, phase, t) = (cx.dev, cx.l, cx.phase, cx.t);
        let (c, be) = (&dev.cfg, &dev.be);
        let Heads { qd, kvd, .. } = Heads::of(dev, l);
        let h = c.hidden;
        let s = dev.s();
        let lw = dev.w.layer(l);
        let w = lw.attention();
        be.rmsnorm(s.hidden.ptr(), lw.attn_norm.ptr(), s.normed.ptr(), t, h, c.rms_eps)?;
        // One sequence outside the decode graph with an f32 cache of a full layer takes the new
        // key/value rows in place; otherwise they go to scratch and the q/k norm + RoPE kernel
        // appends them (converted, a window layer's through its ring) at the position it reads
        // from the device (the graph) or the sequence's.
        let window = dev.plan.layer(l).attention().window.unwrap_or(0);
        let in_place = match (dev.step, segs) {
            (None, [seg]) if window == 0 => match (seg.cache.k(l), seg.cache.v(l)) {
                (KvPtr::F32(kc), KvPtr::F32(vc)) => {
                    Some((kc.sub(seg.pos0 * kvd, t * kvd), vc.sub(seg.pos0 * kvd, t * kvd)))
                }
                _ => None,
            },
            _ => None,
        };
        let (k_new, v_new) = in_place
            .unwrap_or_else(|| (s.kv_step.ptr().sub(0, t * kvd), s.kv_step.ptr().sub(t * kvd, t * kvd)));
        qkv_projections(cx, [k_new, v_new])?;
        let (q, pos) = (s.q.ptr(), dev.step.map(|_| s.step.ptr().sub(1, 1)));
        // a batched call: every row's q/k norm + RoPE + append in one launch, its decode rows'
        // attention in one (`BatchRows`)
        let rows = dev.batch_rows().filter(|_| in_place.is_none());
        let fused_rows = rows.filter(|_| qk_fusable(dev.plan.layer(l).attention()));
        if let Some(r) = fused_rows {
            qk_norm_rope_rows(dev, l, r.kv(l, window), [q, k_new, v_new])?;
        }
        for seg in segs.iter().filter(|_| fused_rows.is_none()) {
            let (rq, rkv) =
                (q.sub(seg.row0 * qd, seg.n * qd), |p: DPtr<f32>| p.sub(seg.row0 * kvd, seg.n * kvd));
            let append = in_place.is_none().then(|| KvAppend {
                pos,
                v: rkv(v_new),
                k_cache: seg.cache.k(l),
                v_cache: seg.cache.v(l),
                window,
            });
            qk_norm_rope(dev, l, seg.n, seg.pos0, rq, rkv(k_new), rkv(v_new), append)?;
        }
        cx.mark(1)?;
        let batched = rows.filter(|r| r.n_decode > 0);
        if let Some(r) = batched {
            self.attention_rows(cx, r)?;
        }
        for seg in segs.iter().filter(|seg| batched.is_none() || !decode_attention(phase, seg)) {
            self.attention(cx, seg)?;
        }
        if w.q_gate.is_some() {
            be.mul_sigmoid(s.attn.ptr(), s.gate.ptr(), t * qd)?;
        }
        cx.mark(2)?;
        // o projection accumulates straight into the residual stream (its bias after it); with a
        // post norm (Gemma 4's sandwich) it goes through the shared expert's rows (free until the
        // FFN), normed, then added.
        let post = lw.extras.post_norms.as_ref().map(|[attn_post, _]| attn_post);
        let out = if post.is_some() { s.shared_out.ptr() } else { s.hidden.ptr() };
        dev.linear(phase, s.attn.ptr(), w.o.view(), out, t, h, qd, post.is_none())?;
        if let Some(b) = &w.o_bias {
            be.add_bias_rows(out, b.ptr(), t, h)?;
        }
        if let Some(norm) = post {
            be.rmsnorm(out, norm.ptr(), out, t, h, c.rms_eps)?;
            be.add(s.hidden.ptr(), out, t * h)?;
        }
        cx.mark(3)
    }

    /// The split decode attention's partials for `t` rows over the whole cache, and the latent
    /// attention's for its row chunks (grows, never shrinks).
    pub fn reserve_attention(&mut self, dev: &Device, t: usize, cache: &GpuKvCache) -> Result<(), GpuError> {
        let latent = dev.plan.layers().iter().filter_map(|l| match &l.mixer {
            Mixer::LatentAttention(m) => Some(m),
            _ => None,
        });
        let latent = super::latent::latent_part_floats(latent, t, cache.capacity);
        self.reserve_part(dev, split_scratch(dev, t, cache.capacity).max(latent).max(1))
    }

    /// The split attention's partials grown to `need` floats (a new allocation: the decode
    /// graphs see its serial change and capture again).
    fn reserve_part(&mut self, dev: &Device, need: usize) -> Result<(), GpuError> {
        if self.attn_part.as_ref().is_none_or(|b| b.len() < need) {
            self.attn_part = None; // free first
            self.attn_part = Some(dev.be.alloc_zeros::<f32>(need)?);
        }
        Ok(())
    }

    /// One sequence's attention over its cache, its rows of the queries into its rows of the
    /// output. Decode: positions split over many blocks, partials combined by a second kernel.
    fn attention(&mut self, cx: &LayerCtx<'_>, seg: &GpuSeg<'_>) -> Result<(), GpuError> {
        let (dev, l) = (cx.dev, cx.l);
        let be = &dev.be;
        let window = dev.plan.layer(l).attention().window.unwrap_or(0);
        let sinks = dev.w.layer(l).attention().sinks.as_ref().map(|b| b.ptr());
        let mask = AttentionMask { window, sinks };
        let Heads { nh, nkv, hd, qd, .. } = Heads::of(dev, l);
        let (t, pos0, cache) = (seg.n, seg.pos0, seg.cache);
        let decode = decode_attention(cx.phase, seg);
        if decode {
            self.reserve_attention(dev, t, cache)?;
        }
        let s = dev.s();
        let rows = |p: DPtr<f32>| p.sub(seg.row0 * qd, t * qd);
        let (q, kc, vc, out) = (rows(s.q.ptr()), cache.k(l), cache.v(l), rows(s.attn.ptr()));
        match (&self.attn_part, decode) {
            (Some(part), true) => {
                let at =
                    dev.step.map(|max_positions| DevicePos { pos: s.step.ptr().sub(1, 1), max_positions });
                be.attention_split(q, kc, vc, out, part.ptr(), t, pos0, nh, nkv, hd, mask, at)?
            }
            _ if dev.opts.prefill_attention == PrefillAttention::Mma
                && be.attention_mma_takes(hd, (q, kc, vc, out)) =>
            {
                be.attention_mma(q, kc, vc, out, t, pos0, nh, nkv, hd, mask)?
            }
            _ if dev.opts.prefill_attention != PrefillAttention::PerRow
                && CudaBackend::attention_tiled_fits(hd) =>
            {
                be.attention_tiled(q, kc, vc, out, t, pos0, nh, nkv, hd, mask)?
            }
            _ => be.attention(q, kc, vc, out, t, pos0, nh, nkv, hd, mask)?,
        }
        Ok(())
    }
}

impl MixerStage {
    /// A batched call's decode rows (`rows`) attending over their own sequences' caches: one
    /// split launch and one combine for every sequence.
    fn attention_rows(&mut self, cx: &LayerCtx<'_>, rows: &BatchRows) -> Result<(), GpuError> {
        let (dev, l) = (cx.dev, cx.l);
        let Heads { nh, nkv, hd, .. } = Heads::of(dev, l);
        self.reserve_part(dev, split_scratch(dev, rows.n_decode, rows.max_positions))?;
        let part = self.attn_part.as_ref().expect("reserved").ptr();
        let window = dev.plan.layer(l).attention().window.unwrap_or(0);
        let sinks = dev.w.layer(l).attention().sinks.as_ref().map(|b| b.ptr());
        let (s, launch) = (dev.s(), (rows.decode_rows(), rows.n_decode));
        let mask = AttentionMask { window, sinks };
        dev.be.attention_split_rows(
            s.q.ptr(),
            s.attn.ptr(),
            part,
            launch,
            rows.kv(l, window),
            nh,
            nkv,
            hd,
            mask,
        )?;
        Ok(())
    }
}

/// Whether a sequence's rows of a call attend by the split decode kernel: a decode call's, and a
/// one-token sequence's after a prompt whatever the call's phase (a batched call mixing decode
/// tokens with a prompt chunk).
pub(crate) fn decode_attention(phase: Phase, seg: &GpuSeg<'_>) -> bool {
    phase == Phase::Decode || (seg.n == 1 && seg.pos0 > 0)
}

/// [`qk_norm_rope`] with its append over every row of a batched call (`kv`: each row's
/// position and caches), one launch: `[q, k_new, v_new]` hold the call's rows.
fn qk_norm_rope_rows(
    dev: &Device,
    l: usize,
    kv: BatchKv,
    [q, k_new, v_new]: [DPtr<f32>; 3],
) -> Result<(), GpuError> {
    let (c, w, a) = (&dev.cfg, dev.w.layer(l).attention(), dev.plan.layer(l).attention());
    let scaling = w.rope_freqs.as_ref().map(|(f, scale)| RopeScaling { freqs: f.ptr(), scale: *scale });
    let norm = (a.qk_norm == QkNorm::PerHead)
        .then(|| (w.q_norm.as_ref().expect("validated").ptr(), w.k_norm.as_ref().expect("validated").ptr()));
    let d = Heads::of(dev, l);
    let heads = (d.nh, d.nkv, d.qd, d.kvd);
    let rope = (a.rope.theta, a.rope.style == RopeStyle::Interleaved, c.rms_eps);
    dev.be.qk_norm_rope_rows((q, k_new, v_new), norm, kv, heads, (d.hd, a.rope.dims), rope, scaling)?;
    Ok(())
}

/// The q, k, v projections (+ biases, + the output gate's) of the normed rows: q into the
/// scratch, k and v into `[k_new, v_new]`.
fn qkv_projections(cx: &LayerCtx<'_>, [k_new, v_new]: [DPtr<f32>; 2]) -> Result<(), GpuError> {
    let (dev, phase, t) = (cx.dev, cx.phase, cx.t);
    let (c, be, s) = (&dev.cfg, &dev.be, dev.s());
    let Heads { nkv, hd, qd, kvd, .. } = Heads::of(dev, cx.l);
    let h = c.hidden;
    let w = dev.w.layer(cx.l).attention();
    let Some(wv) = &w.v else {
        // values from keys (Gemma 4's global layers): the raw k projection is the values' source
        dev.linear(phase, s.normed.ptr(), w.q.view(), s.q.ptr(), t, qd, h, false)?;
        dev.linear(phase, s.normed.ptr(), w.k.view(), k_new, t, kvd, h, false)?;
        return qkv_ends(cx, [k_new, v_new], Some(k_new), (nkv, hd, qd, kvd));
    };
    let qkv = [w.q.view(), w.k.view(), wv.view()];
    let (y, n) = ([s.q.ptr(), k_new, v_new], [qd, kvd, kvd]);
    if let [Some(q), Some(k), Some(v)] = qkv.map(|m| m.bf16()) {
        if let Some(xs) = dev.decode_mma_rows(phase, s.normed.ptr(), &[q, k, v], t, h)? {
            be.gemv_mma_bf16(&[q, k, v], xs, &y, &n, t, h, false)?;
            return qkv_ends(cx, [k_new, v_new], None, (nkv, hd, qd, kvd));
        }
    }
    if let (Phase::Decode, false, [Some(q), Some(k), Some(v)]) =
        (phase, dev.gemm_pays(t), qkv.map(|m| m.bf16()))
    {
        be.gemv3_bf16([q, k, v], s.normed.ptr(), y, n, t, h)?;
    } else if phase == Phase::Decode && t == 1 {
        // quantized (or mixed) q/k/v: one launch of the one-token kernels, over the normed row
        // in 8 bits when they take it
        let nq = qkv.iter().find_map(|m| dev.dense_q8(*m, t, h));
        if let Some(nq) = nq {
            be.quantize_q8(s.normed.ptr(), 1, h, nq)?;
        }
        be.gemv3_typed(qkv, s.normed.ptr(), nq, y, n, h)?;
    } else if let Some(nq) = dev.shared_q8_rows(phase, &qkv, t, h) {
        // a few decode rows over quantized q/k/v: the normed rows in 8 bits once for the three
        be.quantize_q8(s.normed.ptr(), t, h, nq)?;
        for ((m, y), n) in qkv.iter().zip(y).zip(n) {
            be.gemv_quant_q8_tokens(m.dtype, m.bytes, nq, y, t, n, h, false)?;
        }
    } else {
        dev.linear(phase, s.normed.ptr(), w.q.view(), s.q.ptr(), t, qd, h, false)?;
        dev.linear(phase, s.normed.ptr(), w.k.view(), k_new, t, kvd, h, false)?;
        dev.linear(phase, s.normed.ptr(), wv.view(), v_new, t, kvd, h, false)?;
    }
    qkv_ends(cx, [k_new, v_new], None, (nkv, hd, qd, kvd))
}

/// After the q, k, v projections: the values from `v_from` (the raw keys, `values_from_keys`;
/// none: the v projection's rows in `v_new`) through the weightless v norm
/// (`AttentionSpec::v_norm`, one launch writing `v_new`) or copied, the output gate's
/// projection, the biases.
fn qkv_ends(
    cx: &LayerCtx<'_>,
    [k_new, v_new]: [DPtr<f32>; 2],
    v_from: Option<DPtr<f32>>,
    (nkv, hd, qd, kvd): (usize, usize, usize, usize),
) -> Result<(), GpuError> {
    let (dev, phase, t) = (cx.dev, cx.phase, cx.t);
    let (c, be, s) = (&dev.cfg, &dev.be, dev.s());
    let (h, w) = (c.hidden, dev.w.layer(cx.l).attention());
    let (src, v) = (v_from.unwrap_or(v_new).sub(0, t * kvd), v_new.sub(0, t * kvd));
    match &w.v_norm {
        Some(ones) => be.rmsnorm(src, ones.ptr(), v, t * nkv, hd, c.rms_eps)?,
        None if v_from.is_some() => be.copy(src, v)?,
        None => {}
    }
    if let Some(gate) = &w.q_gate {
        dev.linear(phase, s.normed.ptr(), gate.view(), s.gate.ptr(), t, qd, h, false)?;
    }
    for (dst, bias, dim) in [(s.q.ptr(), &w.q_bias, qd), (k_new, &w.k_bias, kvd), (v_new, &w.v_bias, kvd)] {
        if let Some(b) = bias {
            be.add_bias_rows(dst, b.ptr(), t, dim)?;
        }
    }
    Ok(())
}

/// A Gated DeltaNet layer: norm, the `[q|k|v|z]` and `[b|a]` projections, the causal conv
/// and the delta rule over the session's state (the recurrent kernel, token by token, for
/// fewer than [`DELTA_CHUNKED_MIN_TOKENS`] tokens; else the chunked prefill), the output
/// projection accumulated into the residual stream.
fn delta_net_block(cx: &LayerCtx<'_>, d: &DeltaNetSpec, segs: &[GpuSeg<'_>]) -> Result<(), GpuError> {
    let (dev, l, phase, t) = (cx.dev, cx.l, cx.phase, cx.t);
    let (c, be, s) = (&dev.cfg, &dev.be, dev.s());
    let lw = dev.w.layer(l);
    let MixerWeights::DeltaNet(w) = &lw.mixer else { unreachable!("the plan says DeltaNet") };
    let shape = delta_shape(d);
    let (h, vd) = (c.hidden, d.value_dim());
    let (p, ba, out) = (s.delta_p.ptr(), s.delta_ba.ptr(), s.delta_out.ptr());
    be.rmsnorm(s.hidden.ptr(), lw.attn_norm.ptr(), s.normed.ptr(), t, h, c.rms_eps)?;
    dev.linear(phase, s.normed.ptr(), w.qkvz.view(), p, t, shape.p_stride(), h, false)?;
    dev.linear(phase, s.normed.ptr(), w.ba.view(), ba, t, 2 * d.n_v_heads, h, false)?;
    cx.mark(1)?;
    let vectors = [w.dt_bias.ptr(), w.neg_a.ptr(), w.norm.ptr()];
    let (ps, bas) = (shape.p_stride(), 2 * d.n_v_heads);
    for seg in segs {
        let state = seg.cache.delta_state(l);
        let (r0, n) = (seg.row0, seg.n);
        let (p, ba, out) = (p.sub(r0 * ps, n * ps), ba.sub(r0 * bas, n * bas), out.sub(r0 * vd, n * vd));
        if n >= DELTA_CHUNKED_MIN_TOKENS {
            let work = s.delta_work.ptr();
            be.delta_conv_rows(shape, p, state.conv, w.conv.ptr(), work, n)?;
            be.delta_rule_chunked(shape, p, ba, state.matrix, vectors, work, out, n, c.rms_eps)?;
        } else {
            be.delta_conv(shape, p, state.conv, w.conv.ptr(), n)?;
            be.delta_rule(shape, p, ba, state.matrix, vectors, out, n, c.rms_eps)?;
        }
    }
    cx.mark(2)?;
    dev.linear(phase, out, w.out.view(), s.hidden.ptr(), t, h, vd, true)?;
    cx.mark(3)
}

/// Per-head q/k norm (or none) and RoPE of layer `l`, fused into one launch when no clamp sits
/// between (`append`: the decode graph's, see [`KvAppend`]; only on the fused path).
#[allow(clippy::too_many_arguments)]
fn qk_norm_rope(
    dev: &Device,
    l: usize,
    t: usize,
    pos0: usize,
    q: DPtr<f32>,
    k_new: DPtr<f32>,
    v_new: DPtr<f32>,
    append: Option<KvAppend>,
) -> Result<(), GpuError> {
    let (c, be, w, a) = (&dev.cfg, &dev.be, dev.w.layer(l).attention(), dev.plan.layer(l).attention());
    let Heads { nh, nkv, hd, qd, kvd } = Heads::of(dev, l);
    let rot = a.rope.dims;
    let (interleaved, theta) = (a.rope.style == RopeStyle::Interleaved, a.rope.theta);
    let scaling = w.rope_freqs.as_ref().map(|(f, scale)| RopeScaling { freqs: f.ptr(), scale: *scale });
    let norms = || (w.q_norm.as_ref().expect("validated").ptr(), w.k_norm.as_ref().expect("validated").ptr());
    if qk_fusable(a) {
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
            scaling,
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
    be.rope(q, t, nh, qd, hd, rot, pos0, theta, interleaved, scaling)?;
    be.rope(k_new, t, nkv, kvd, hd, rot, pos0, theta, interleaved, scaling)?;
    if let Some(a) = append {
        be.kv_store_rows(k_new, v_new, a.k_cache, a.v_cache, t, pos0, kvd, a.window)?;
    }
    Ok(())
}

/// Whether an attention layer of this kind takes the one fused q/k norm + RoPE launch: no clamp
/// between them and a norm the fused kernel does.
pub(crate) fn qk_fusable(a: &AttentionSpec) -> bool {
    a.clip_qkv.is_none() && matches!(a.qk_norm, QkNorm::None | QkNorm::PerHead)
}

/// The mixer kinds the GPU engine runs: attention layers (with sinks, an o bias and YaRN RoPE
/// too), Gated DeltaNet layers whose key heads fit the kernel's registers, and latent attention
/// layers whose sizes fit its kernels.
pub(crate) fn runs_mixer(m: &Mixer) -> bool {
    match m {
        // Every attention layer; what some cannot have is said by name (`unsupported_attention`).
        Mixer::Attention(_) => true,
        // Latent attention whose latent, rotated part and per-head products fit the kernels
        // (DeepSeek-V3 and Kimi K2: rank 512, rope 64, nope 128).
        Mixer::LatentAttention(m) => super::latent::mla_shape(m).fits(),
        Mixer::GatedDeltaNet(d) => {
            d.k_head_dim <= DELTA_MAX_KEY_DIM
                && d.v_head_dim <= 1024
                && d.conv_kernel <= DELTA_MAX_CONV_KERNEL
        }
    }
}

/// What the GPU engine cannot run of an attention layer, by name: heads wider than the attention
/// kernels take (Gemma 4 26B-A4B's global layers have 512), a proportional RoPE beside YaRN (both
/// take the one frequency table), an own score scale without a per-head q norm to fold it into.
pub(crate) fn unsupported_attention(l: usize, a: &AttentionSpec) -> Option<GpuError> {
    let what = |what| Some(GpuError::AttentionKind { layer_idx: l, what });
    if a.head_dim > ATTENTION_MAX_HEAD_DIM {
        return Some(GpuError::WideHeads { layer_idx: l, head_dim: a.head_dim, max: ATTENTION_MAX_HEAD_DIM });
    }
    if a.rope.turning_pairs.is_some() && a.rope.yarn.is_some() {
        return what("a proportional RoPE with YaRN");
    }
    if a.scale.is_some() && a.qk_norm != QkNorm::PerHead {
        return what("an own attention score scale without a per-head q norm");
    }
    None
}

/// An attention layer's sizes (its own head dim and KV heads where the plan gives them: Gemma
/// 4's global layers).
#[derive(Clone, Copy)]
pub(crate) struct Heads {
    pub nh: usize,
    pub nkv: usize,
    pub hd: usize,
    /// Query values of a row (`nh * hd`).
    pub qd: usize,
    /// Key (or value) values of a row (`nkv * hd`).
    pub kvd: usize,
}

impl Heads {
    /// Layer `l`'s (an attention layer).
    pub fn of(dev: &Device, l: usize) -> Heads {
        let (a, nh) = (dev.plan.layer(l).attention(), dev.cfg.n_heads);
        Heads { nh, nkv: a.n_kv_heads, hd: a.head_dim, qd: a.q_dim(nh), kvd: a.kv_dim() }
    }
}

/// The split decode attention's partials for `t` rows over `positions`, for the layer that needs
/// the most.
fn split_scratch(dev: &Device, t: usize, positions: usize) -> usize {
    let layers = dev.plan.layers().iter().filter_map(|s| s.as_attention());
    let need =
        |a: &AttentionSpec| CudaBackend::attention_split_scratch(t, dev.cfg.n_heads, a.head_dim, positions);
    layers.map(need).max().unwrap_or(0)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::arch::RopeSpec;

    /// Gemma 4's global layer as the fixture has it: heads of 32, one KV head, keys as values,
    /// v norm, unscaled scores, proportional RoPE on 4 of 16 pairs.
    fn gemma_global(head_dim: usize) -> AttentionSpec {
        AttentionSpec {
            head_dim,
            n_kv_heads: 1,
            qk_norm: QkNorm::PerHead,
            qkv_bias: false,
            rope: RopeSpec {
                style: RopeStyle::HalfSplit,
                theta: 1e6,
                dims: head_dim,
                yarn: None,
                linear: None,
                turning_pairs: Some(head_dim / 8),
            },
            window: None,
            clip_qkv: None,
            output_gate: false,
            o_bias: false,
            sinks: false,
            values_from_keys: true,
            v_norm: true,
            scale: Some(1.0),
        }
    }

    #[test]
    fn gemma_attention_runs_and_what_cannot_is_refused_by_name() {
        assert!(runs_mixer(&Mixer::Attention(gemma_global(32))));
        assert!(unsupported_attention(1, &gemma_global(32)).is_none());
        assert!(unsupported_attention(1, &gemma_global(ATTENTION_MAX_HEAD_DIM)).is_none());
        // 26B-A4B's global heads of 512: wider than the attention kernels take
        let e = unsupported_attention(5, &gemma_global(512)).expect("refused").to_string();
        assert!(e.contains("layer 5") && e.contains("512") && e.contains("at most 256"), "{e}");
        let unnormed = AttentionSpec { qk_norm: QkNorm::None, ..gemma_global(32) };
        let e = unsupported_attention(3, &unnormed).expect("refused").to_string();
        assert!(e.contains("layer 3") && e.contains("score scale"), "{e}");
        let mut yarn = gemma_global(32);
        yarn.rope.yarn = Some(crate::model::arch::YarnSpec {
            factor: 4.0,
            original_context: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
            attention_factor: 1.0,
        });
        let e = unsupported_attention(1, &yarn).expect("refused").to_string();
        assert!(e.contains("proportional RoPE with YaRN"), "{e}");
        assert!(qk_fusable(&gemma_global(32)), "the decode graphs take Gemma's q/k norm + RoPE");
    }
}
