//! A latent attention layer on the GPU (DeepSeek-V3, Kimi K2), in the absorbed form for prefill
//! and decode alike, as the CPU pipeline runs it: q (`q_a` -> RMSNorm -> `q_b`, or a plain `q`)
//! and `kv_a` projections; one launch that rotates q's rope parts into the absorbed queries and
//! norms, rotates and appends the new latent rows (`mla_prep`, position from device memory under
//! the decode graph); each head's no-RoPE query through its `k_b` into the latent space
//! (`mla_absorb`); attention over the cache's rows with the latent as value (`mla_attention`,
//! split over positions); each head's latent through its `v_b` (`mla_values`); `o` into the
//! residual stream. The cache never holds per-head keys or values.
//!
//! Prefill takes the absorbed form too: it needs no per-head key and value rows (the
//! unabsorbed form expands the latent into `heads x (nope + v)` values a position) and shares
//! every kernel with decode; its attention costs `heads x (rank + rope)` per (query, position)
//! against the unabsorbed `heads x (nope + rope + v)`. Every head reads the same cache rows, so
//! over an f16 / bf16 cache the split attention runs on tensor cores with the (token, head)
//! pairs as the rows of one product (`mla_attention_mma_*`): DeepSeek-V3 4 layers, pp512 at depth
//! 8192 on an H100, 920 -> 1893 t/s, tg32 220 -> 246 (session 30).

use super::device::LayerCtx;
use super::model::GpuSeg;
use super::GpuError;
use crate::model::arch::{LatentAttentionSpec, RopeStyle};
use moe_lanes_kernels::cuda::mla::{MlaRope, MlaShape};
use moe_lanes_kernels::cuda::ops::{DevicePos, RopeScaling};
use moe_lanes_kernels::cuda::{CudaBackend, DPtr};

/// Query rows of one split attention launch in a prefill: bounds the partials' scratch
/// (`rows x heads x (rank + 2)` floats; DeepSeek-V3: 17 MB), whatever the call's length.
pub(crate) const MLA_ATTENTION_ROWS: usize = 64;

/// A latent layer's sizes as the kernels take them.
pub(crate) fn mla_shape(m: &LatentAttentionSpec) -> MlaShape {
    MlaShape { heads: m.n_heads, rank: m.kv_lora_rank, nope: m.nope_dim, rope: m.rope_dim, v_dim: m.v_dim }
}

/// Floats of split-attention partials a call of `t` rows over a cache of `capacity` positions
/// needs for the plan's latent layers (`specs`); 0 without any. Every chunk size up to the
/// call's is counted: a shorter chunk (a prompt's last) may take more spans a row, and more
/// partials in all, than a full one where the heads' blocks do not divide the split target.
pub(crate) fn latent_part_floats<'a>(
    specs: impl Iterator<Item = &'a LatentAttentionSpec>,
    t: usize,
    capacity: usize,
) -> usize {
    let rows = t.min(MLA_ATTENTION_ROWS);
    specs
        .flat_map(|m| {
            (1..=rows)
                .map(|n| CudaBackend::mla_attention_scratch(n, m.n_heads, m.kv_lora_rank, capacity + rows))
        })
        .max()
        .unwrap_or(0)
}

/// Layer `cx.l`'s latent attention over the call's rows (`segs`: each sequence's rows, cache and
/// first position), its output added to the residual stream. `part`: the split attention's
/// partials ([`latent_part_floats`]).
pub(crate) fn latent_block(
    cx: &LayerCtx<'_>,
    m: &LatentAttentionSpec,
    segs: &[GpuSeg<'_>],
    part: DPtr<f32>,
) -> Result<(), GpuError> {
    let (dev, l, phase, t) = (cx.dev, cx.l, cx.phase, cx.t);
    let (c, be, s) = (&dev.cfg, &dev.be, dev.s());
    let lw = dev.w.layer(l);
    let w = lw.latent();
    let shape = mla_shape(m);
    let (h, qd, wd, ad) = (c.hidden, shape.q_dim(), shape.width(), shape.abs_dim());
    let b = &s.mla;
    let (q, kv, q_abs) = (b.q.ptr().sub(0, t * qd), b.kv.ptr().sub(0, t * wd), b.q_abs.ptr().sub(0, t * ad));
    be.rmsnorm(s.hidden.ptr(), lw.attn_norm.ptr(), s.normed.ptr(), t, h, c.rms_eps)?;
    match (&w.q_a, &w.q_a_norm, m.q_lora_rank) {
        (Some(q_a), Some(norm), Some(r)) => {
            let qa = b.qa.ptr().sub(0, t * r);
            dev.linear(phase, s.normed.ptr(), q_a.view(), qa, t, r, h, false)?;
            be.rmsnorm(qa, norm.ptr(), qa, t, r, c.rms_eps)?;
            dev.linear(phase, qa, w.q.view(), q, t, qd, r, false)?;
        }
        _ => dev.linear(phase, s.normed.ptr(), w.q.view(), q, t, qd, h, false)?,
    }
    dev.linear(phase, s.normed.ptr(), w.kv_a.view(), kv, t, wd, h, false)?;
    cx.mark(1)?;
    let scaling = w.rope_freqs.as_ref().map(|(f, scale)| RopeScaling { freqs: f.ptr(), scale: *scale });
    let rope = MlaRope { theta: m.rope.theta, interleaved: m.rope.style == RopeStyle::Interleaved, scaling };
    // The decode graph reads the position from device memory (one sequence then).
    let pos = dev.step.map(|_| s.step.ptr().sub(1, 1));
    for seg in segs {
        let (r0, n) = (seg.row0, seg.n);
        let (sq, skv, sabs) = (q.sub(r0 * qd, n * qd), kv.sub(r0 * wd, n * wd), q_abs.sub(r0 * ad, n * ad));
        let cache = seg.cache.k(l);
        be.mla_prep(
            shape,
            sq,
            skv,
            w.kv_a_norm.ptr(),
            sabs,
            cache,
            n,
            seg.pos0,
            pos,
            rope,
            c.rms_eps,
            m.scale,
        )?;
    }
    be.mla_absorb(shape, q, w.k_b.ptr(), q_abs, t, m.scale)?;
    let (rank, heads) = (shape.rank, shape.heads);
    let out = b.out.ptr().sub(0, t * heads * rank);
    for seg in segs {
        let at = dev.step.map(|max_positions| DevicePos { pos: s.step.ptr().sub(1, 1), max_positions });
        for r0 in (0..seg.n).step_by(MLA_ATTENTION_ROWS) {
            let n = MLA_ATTENTION_ROWS.min(seg.n - r0);
            let row0 = seg.row0 + r0;
            let (rq, ro) = (q_abs.sub(row0 * ad, n * ad), out.sub(row0 * heads * rank, n * heads * rank));
            be.mla_attention(shape, rq, seg.cache.k(l), ro, part, n, seg.pos0 + r0, at)?;
        }
    }
    cx.mark(2)?;
    let vd = heads * shape.v_dim;
    let values = b.values.ptr().sub(0, t * vd);
    be.mla_values(shape, out, w.v_b.ptr(), values, t)?;
    dev.linear(phase, values, w.o.view(), s.hidden.ptr(), t, h, vd, true)?;
    cx.mark(3)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::arch::{Mixer, RopeSpec};

    fn spec(kv_lora_rank: usize, rope_dim: usize) -> LatentAttentionSpec {
        LatentAttentionSpec {
            n_heads: 128,
            q_lora_rank: Some(1536),
            kv_lora_rank,
            nope_dim: 128,
            rope_dim,
            v_dim: 128,
            rope: RopeSpec {
                style: RopeStyle::Interleaved,
                theta: 1e4,
                dims: rope_dim,
                yarn: None,
                linear: None,
                turning_pairs: None,
            },
            scale: 0.1,
        }
    }

    /// DeepSeek-V3's and Kimi K2's latent layers (rank 512, rope 64) run; a wider latent or
    /// rotated part than the kernels hold is refused (by the plan's kind name, before a device).
    #[test]
    fn the_engine_runs_the_latent_sizes_its_kernels_hold() {
        let runs = |m| super::super::mixer::runs_mixer(&Mixer::LatentAttention(m));
        assert!(runs(spec(512, 64)));
        assert!(!runs(spec(1024, 64)));
        assert!(!runs(spec(512, 128)));
    }

    /// The split attention's partials stay bounded for long prefill calls (row chunks of
    /// `MLA_ATTENTION_ROWS`) and cover decode over the whole cache.
    #[test]
    fn the_partials_are_sized_by_row_chunks() {
        let m = spec(512, 64);
        let decode = latent_part_floats([&m].into_iter(), 1, 4096);
        let long = latent_part_floats([&m].into_iter(), 2048, 4096);
        let chunk = latent_part_floats([&m].into_iter(), MLA_ATTENTION_ROWS, 4096);
        assert_eq!(long, chunk);
        assert!(long * 4 <= 20 << 20, "{long} floats");
        assert_eq!(decode, CudaBackend::mla_attention_scratch(1, 128, 512, 4097));
        assert_eq!(latent_part_floats(std::iter::empty(), 8, 4096), 0);
    }

    /// A prompt's last, shorter chunk fits the partials reserved for the call: with 24 heads (3
    /// blocks of 8, which do not divide the split target) one row takes 341 spans where each of
    /// 64 rows takes 5.
    #[test]
    fn the_partials_cover_a_shorter_last_chunk() {
        let m = LatentAttentionSpec { n_heads: 24, ..spec(512, 64) };
        let reserved = latent_part_floats([&m].into_iter(), 100, 16384);
        for n in 1..=MLA_ATTENTION_ROWS {
            let need = CudaBackend::mla_attention_scratch(n, 24, 512, 16384 + MLA_ATTENTION_ROWS);
            assert!(need <= reserved, "a chunk of {n} rows needs {need} floats, {reserved} reserved");
        }
        let full =
            CudaBackend::mla_attention_scratch(MLA_ATTENTION_ROWS, 24, 512, 16384 + MLA_ATTENTION_ROWS);
        assert!(reserved > full, "the last chunk's need is past a full chunk's here");
    }
}
