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
    AttentionMask, BatchKv, DeltaShape, DevicePos, KvAppend, KvPtr, RopeScaling,
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
        let (h, qd, kvd) = (c.hidden, c.q_dim(), c.kv_dim());
        let s = dev.s();
        let lw = &dev.w.layers[l];
        let w = lw.attention();
        be.rmsnorm(s.hidden.ptr(), lw.attn_norm.ptr(), s.normed.ptr(), t, h, c.rms_eps)?;
        // One sequence outside the decode graph with an f32 cache takes the new key/value rows
        // in place; otherwise they go to scratch and the q/k norm + RoPE kernel appends them
        // (converted) at the position it reads from the device (the graph) or the sequence's.
        let in_place = match (dev.step, segs) {
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
        qkv_projections(cx, [k_new, v_new])?;
        let (q, pos) = (s.q.ptr(), dev.step.map(|_| s.step.ptr().sub(1, 1)));
        // a batched call: every row's q/k norm + RoPE + append in one launch, its decode rows'
        // attention in one (`BatchRows`)
        let rows = dev.batch_rows().filter(|_| in_place.is_none());
        let fused_rows = rows.filter(|_| qk_fusable(dev.plan.layer(l).attention()));
        if let Some(r) = fused_rows {
            qk_norm_rope_rows(dev, l, r.kv(l), [q, k_new, v_new])?;
        }
        for seg in segs.iter().filter(|_| fused_rows.is_none()) {
            let (rq, rkv) =
                (q.sub(seg.row0 * qd, seg.n * qd), |p: DPtr<f32>| p.sub(seg.row0 * kvd, seg.n * kvd));
            let append = in_place.is_none().then(|| KvAppend {
                pos,
                v: rkv(v_new),
                k_cache: seg.cache.k(l),
                v_cache: seg.cache.v(l),
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
        // o projection accumulates straight into the residual stream (its bias after it).
        dev.linear(phase, s.attn.ptr(), w.o.view(), s.hidden.ptr(), t, h, qd, true)?;
        if let Some(b) = &w.o_bias {
            be.add_bias_rows(s.hidden.ptr(), b.ptr(), t, h)?;
        }
        cx.mark(3)
    }

    /// The split decode attention's partials for `t` rows over the whole cache, and the latent
    /// attention's for its row chunks (grows, never shrinks).
    pub fn reserve_attention(&mut self, dev: &Device, t: usize, cache: &GpuKvCache) -> Result<(), GpuError> {
        let c = &dev.cfg;
        let latent = dev.plan.layers().iter().filter_map(|l| match &l.mixer {
            Mixer::LatentAttention(m) => Some(m),
            _ => None,
        });
        let attention = dev.plan.layers().iter().any(|l| l.as_attention().is_some());
        let need = match attention {
            true => CudaBackend::attention_split_scratch(t, c.n_heads, c.head_dim, cache.capacity),
            false => 0,
        };
        self.reserve_part(dev, need.max(super::latent::latent_part_floats(latent, t, cache.capacity)).max(1))
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
        let (c, be) = (&dev.cfg, &dev.be);
        let window = dev.plan.layer(l).attention().window.unwrap_or(0);
        let sinks = dev.w.layers[l].attention().sinks.as_ref().map(|b| b.ptr());
        let mask = AttentionMask { window, sinks };
        let (nh, nkv, hd, qd) = (c.n_heads, c.n_kv_heads, c.head_dim, c.q_dim());
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
        let c = &dev.cfg;
        let (nh, hd) = (c.n_heads, c.head_dim);
        self.reserve_part(
            dev,
            CudaBackend::attention_split_scratch(rows.n_decode, nh, hd, rows.max_positions),
        )?;
        let part = self.attn_part.as_ref().expect("reserved").ptr();
        let window = dev.plan.layer(l).attention().window.unwrap_or(0);
        let sinks = dev.w.layers[l].attention().sinks.as_ref().map(|b| b.ptr());
        let (s, launch) = (dev.s(), (rows.decode_rows(), rows.n_decode));
        let mask = AttentionMask { window, sinks };
        dev.be.attention_split_rows(
            s.q.ptr(),
            s.attn.ptr(),
            part,
            launch,
            rows.kv(l),
            nh,
            c.n_kv_heads,
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
    let (c, w, a) = (&dev.cfg, dev.w.layers[l].attention(), dev.plan.layer(l).attention());
    let scaling = w.rope_freqs.as_ref().map(|(f, scale)| RopeScaling { freqs: f.ptr(), scale: *scale });
    let norm = (a.qk_norm == QkNorm::PerHead)
        .then(|| (w.q_norm.as_ref().expect("validated").ptr(), w.k_norm.as_ref().expect("validated").ptr()));
    let heads = (c.n_heads, c.n_kv_heads, c.q_dim(), c.kv_dim());
    let rope = (a.rope.theta, a.rope.style == RopeStyle::Interleaved, c.rms_eps);
    dev.be.qk_norm_rope_rows((q, k_new, v_new), norm, kv, heads, (c.head_dim, a.rope.dims), rope, scaling)?;
    Ok(())
}

/// The q, k, v projections (+ biases, + the output gate's) of the normed rows: q into the
/// scratch, k and v into `[k_new, v_new]`.
fn qkv_projections(cx: &LayerCtx<'_>, [k_new, v_new]: [DPtr<f32>; 2]) -> Result<(), GpuError> {
    let (dev, phase, t) = (cx.dev, cx.phase, cx.t);
    let (c, be, s) = (&dev.cfg, &dev.be, dev.s());
    let (h, qd, kvd) = (c.hidden, c.q_dim(), c.kv_dim());
    let w = dev.w.layers[cx.l].attention();
    let qkv = [w.q.view(), w.k.view(), w.v.view()];
    let (y, n) = ([s.q.ptr(), k_new, v_new], [qd, kvd, kvd]);
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
    } else {
        dev.linear(phase, s.normed.ptr(), w.q.view(), s.q.ptr(), t, qd, h, false)?;
        dev.linear(phase, s.normed.ptr(), w.k.view(), k_new, t, kvd, h, false)?;
        dev.linear(phase, s.normed.ptr(), w.v.view(), v_new, t, kvd, h, false)?;
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
    let lw = &dev.w.layers[l];
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
    let (c, be, w, a) = (&dev.cfg, &dev.be, dev.w.layers[l].attention(), dev.plan.layer(l).attention());
    let (qd, kvd, hd, nh, nkv) = (c.q_dim(), c.kv_dim(), c.head_dim, c.n_heads, c.n_kv_heads);
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
        be.kv_store_rows(k_new, v_new, a.k_cache, a.v_cache, t, pos0, kvd)?;
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
        // Gemma 4's proportional RoPE, keys as values, v norm and score scale have no kernels
        // here yet.
        Mixer::Attention(a) => {
            a.rope.turning_pairs.is_none() && !a.values_from_keys && !a.v_norm && a.scale.is_none()
        }
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
