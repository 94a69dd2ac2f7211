//! Launchers of the latent attention kernels (`kernels/cuda/mla.cu`): DeepSeek-V3 / Kimi K2's
//! MLA in the absorbed form over a cache of one `[rank | rope]` row per position (the RMS-normed
//! latent and the rotated key part every head shares). A layer runs [`CudaBackend::mla_prep`]
//! (q's rope parts rotated into the absorbed query, the new latent rows normed, rotated and
//! appended), [`CudaBackend::mla_absorb`] (each head's no-RoPE query through its `k_b`),
//! [`CudaBackend::mla_attention`] (split over positions, graph-safe, then
//! `attention_combine_f32`) and [`CudaBackend::mla_values`] (each head's latent through its `v_b`).

use super::kernel::{
    mla_mma_shared_bytes, Kernel, ATTENTION_COMBINE_DIMS, MLA_HEADS, MLA_MAX_RANK, MLA_MAX_ROPE,
};
use super::kernel::{MLA_MMA_GROUPS, MLA_TOKENS};
use super::ops::{args, i, kv_kernel, need, rope_scaling_args, DevicePos, KvPtr, RopeScaling};
use super::ops::{ATTENTION_SPLIT_CHUNK, ATTENTION_SPLIT_TARGET_BLOCKS};
use super::{CudaBackend, CudaError, DPtr, Result};

/// One latent attention layer's sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaShape {
    pub heads: usize,
    /// `kv_lora_rank`: the latent's width.
    pub rank: usize,
    /// Per head: the key part without RoPE, the rotated part (shared by the heads in the cache),
    /// the value.
    pub nope: usize,
    pub rope: usize,
    pub v_dim: usize,
}

impl MlaShape {
    /// Values of one cache row: the latent and the rotated key part.
    pub fn width(&self) -> usize {
        self.rank + self.rope
    }
    /// Values of one token's q: every head's `[nope | rope]`.
    pub fn q_dim(&self) -> usize {
        self.heads * (self.nope + self.rope)
    }
    /// Values of one token's absorbed query: every head's `[latent | rope]`.
    pub fn abs_dim(&self) -> usize {
        self.heads * self.width()
    }
    /// Whether the kernels take this shape: a latent of at most [`MLA_MAX_RANK`], an even
    /// rotated part of at most [`MLA_MAX_ROPE`], per-head products of at most
    /// [`MLA_MAX_RANK`] columns (`nope`; the latent for `v_b`).
    pub fn fits(&self) -> bool {
        self.rank > 0
            && self.rank <= MLA_MAX_RANK
            && self.rope.is_multiple_of(2)
            && self.rope <= MLA_MAX_ROPE
            && self.nope > 0
            && self.nope <= MLA_MAX_RANK
            && self.v_dim > 0
            && self.heads > 0
    }
    fn check(&self, kernel: Kernel) -> Result<()> {
        if self.fits() {
            return Ok(());
        }
        let reason = format!(
            "latent attention of rank {} (at most {MLA_MAX_RANK}), rope {} (even, at most {MLA_MAX_ROPE}), nope {} (at most {MLA_MAX_RANK}), {} heads, v {}",
            self.rank, self.rope, self.nope, self.heads, self.v_dim
        );
        Err(CudaError::Shape { kernel: kernel.symbol(), reason })
    }
}

/// The RoPE of a latent layer's rotated parts: base, pairing, YaRN's table.
#[derive(Debug, Clone, Copy)]
pub struct MlaRope {
    pub theta: f32,
    pub interleaved: bool,
    pub scaling: Option<RopeScaling>,
}

impl CudaBackend {
    /// For `n_tokens` tokens at positions `pos0..` (or from `*pos` on the device, the decode
    /// graph): q's rope parts (`q`: `[n_tokens, q_dim]`) rotated and times `scale` into the
    /// absorbed queries' rope parts (`q_abs`: `[n_tokens, abs_dim]`); the new rows of `kv`
    /// (`[n_tokens, width]`, `kv_a`'s output) RMS-normed over the latent (weight `kv_norm`),
    /// their rope parts rotated, stored at rows `pos0..` of `cache` (`[capacity, width]`) in its
    /// type. One launch.
    #[allow(clippy::too_many_arguments)]
    pub fn mla_prep(
        &self,
        shape: MlaShape,
        q: DPtr<f32>,
        kv: DPtr<f32>,
        kv_norm: DPtr<f32>,
        q_abs: DPtr<f32>,
        cache: KvPtr,
        n_tokens: usize,
        pos0: usize,
        pos: Option<DPtr<i32>>,
        rope: MlaRope,
        eps: f32,
        scale: f32,
    ) -> Result<()> {
        const K: Kernel = Kernel::MlaPrepF32;
        shape.check(K)?;
        let width = shape.width();
        let block = cache.kv_type().block_len();
        if !width.is_multiple_of(block) {
            let reason = format!(
                "{} caches store blocks of {block} values; a row of {width} splits one",
                cache.kv_type()
            );
            return Err(CudaError::Shape { kernel: K.symbol(), reason });
        }
        need(K, "q", q, n_tokens * shape.q_dim())?;
        need(K, "kv", kv, n_tokens * width)?;
        need(K, "kv_norm", kv_norm, shape.rank)?;
        need(K, "q_abs", q_abs, n_tokens * shape.abs_dim())?;
        if let Some(p) = pos {
            need(K, "pos", p, 1)?;
        }
        if cache.len() < (pos0 + n_tokens) * width {
            let reason = format!(
                "the cache holds {} values, rows up to {} of {width} needed",
                cache.len(),
                pos0 + n_tokens
            );
            return Err(CudaError::Shape { kernel: K.symbol(), reason });
        }
        let (freqs, rope_scale) = rope_scaling_args(K, rope.scaling, shape.rope)?;
        let pos_ptr = pos.map_or(0, |p| p.raw());
        self.launch(
            K,
            (n_tokens as u32, shape.heads as u32 + 1, 1),
            256,
            0,
            args![
                q.raw(),
                kv.raw(),
                kv_norm.raw(),
                q_abs.raw(),
                cache.raw(),
                i(shape.heads),
                i(shape.nope),
                i(shape.rope),
                i(shape.rank),
                i(pos0),
                pos_ptr,
                rope.theta,
                rope.interleaved as i32,
                eps,
                scale,
                cache.type_code(),
                freqs,
                rope_scale
            ],
        )
    }

    /// Per head `h` and token `t`: `y[t, h, r] = scale * sum_c w[h][r][c] * x[t, h, c]` for
    /// `r < rows`, `c < cols`; `w` bf16 `[heads, rows, cols]`; x and y rows of `x_row` / `y_row`
    /// values, head `h` at `h * x_head` / `h * y_head`.
    #[allow(clippy::too_many_arguments)]
    pub fn mla_head_gemv(
        &self,
        x: DPtr<f32>,
        w: DPtr<u16>,
        y: DPtr<f32>,
        n_tokens: usize,
        heads: usize,
        [rows, cols]: [usize; 2],
        [x_row, x_head]: [usize; 2],
        [y_row, y_head]: [usize; 2],
        scale: f32,
    ) -> Result<()> {
        const K: Kernel = Kernel::MlaHeadGemvBf16;
        if cols == 0
            || cols > MLA_MAX_RANK
            || (heads - 1) * x_head + cols > x_row
            || (heads - 1) * y_head + rows > y_row
        {
            let reason = format!(
                "{heads} heads of [{rows}, {cols}] over rows of {x_row} (heads at {x_head}) into rows of {y_row} (heads at {y_head}); at most {MLA_MAX_RANK} columns"
            );
            return Err(CudaError::Shape { kernel: K.symbol(), reason });
        }
        need(K, "w", w, heads * rows * cols)?;
        need(K, "x", x, (n_tokens - 1) * x_row + (heads - 1) * x_head + cols)?;
        need(K, "y", y, (n_tokens - 1) * y_row + (heads - 1) * y_head + rows)?;
        let shared = (MLA_TOKENS * cols * 4) as u32;
        let grid = (rows.div_ceil(8) as u32, heads as u32, n_tokens.div_ceil(MLA_TOKENS) as u32);
        self.launch(
            K,
            grid,
            256,
            shared,
            args![
                x.raw(),
                w.raw(),
                y.raw(),
                i(n_tokens),
                i(rows),
                i(cols),
                i(x_row),
                i(x_head),
                i(y_row),
                i(y_head),
                scale
            ],
        )
    }

    /// The absorbed queries' latent parts: `q_abs[t, h, :rank] = scale * k_b[h] · q_nope[t, h]`
    /// (`k_b` bf16 `[heads, rank, nope]`; the rope parts are [`Self::mla_prep`]'s).
    pub fn mla_absorb(
        &self,
        shape: MlaShape,
        q: DPtr<f32>,
        k_b: DPtr<u16>,
        q_abs: DPtr<f32>,
        n_tokens: usize,
        scale: f32,
    ) -> Result<()> {
        shape.check(Kernel::MlaHeadGemvBf16)?;
        let (qw, w) = (shape.nope + shape.rope, shape.width());
        let x = [shape.q_dim(), qw];
        self.mla_head_gemv(
            q,
            k_b,
            q_abs,
            n_tokens,
            shape.heads,
            [shape.rank, shape.nope],
            x,
            [shape.abs_dim(), w],
            scale,
        )
    }

    /// The heads' values: `values[t, h * v..] = v_b[h] · latent[t, h]` (`v_b` bf16 `[heads, v,
    /// rank]`, `latent` the attention's output `[n_tokens, heads, rank]`).
    pub fn mla_values(
        &self,
        shape: MlaShape,
        latent: DPtr<f32>,
        v_b: DPtr<u16>,
        values: DPtr<f32>,
        n_tokens: usize,
    ) -> Result<()> {
        shape.check(Kernel::MlaHeadGemvBf16)?;
        let (h, r, v) = (shape.heads, shape.rank, shape.v_dim);
        self.mla_head_gemv(latent, v_b, values, n_tokens, h, [v, r], [h * r, r], [h * v, v], 1.0)
    }

    /// The tensor-core split pass for this shape and cache, if it takes them: a 16-bit cache
    /// (f16, bf16) on sm_80+, rows of whole 16-value steps and a latent of whole 32-column
    /// slices (DeepSeek-V3 / Kimi K2: 576 and 512), the cache 16-byte aligned.
    fn mla_attention_mma(&self, shape: MlaShape, cache: KvPtr) -> Option<Kernel> {
        let k = match cache {
            KvPtr::F16(_) => Kernel::MlaAttentionMmaF16,
            KvPtr::Bf16(_) => Kernel::MlaAttentionMmaBf16,
            _ => return None,
        };
        let fits = shape.width().is_multiple_of(16) && shape.rank.is_multiple_of(32);
        (fits && self.info().has_sm80() && cache.raw().is_multiple_of(16)).then_some(k)
    }

    /// Spans of the split latent attention for `n_tokens` rows over `positions`: as the split
    /// attention's, over blocks of [`MLA_HEADS`] heads.
    pub fn mla_attention_max_splits(n_tokens: usize, heads: usize, positions: usize) -> usize {
        let blocks_per_split = (n_tokens * heads.div_ceil(MLA_HEADS)).max(1);
        let cap = (ATTENTION_SPLIT_TARGET_BLOCKS / blocks_per_split).max(1);
        positions.div_ceil(ATTENTION_SPLIT_CHUNK).clamp(1, cap)
    }

    /// Floats of the partials [`Self::mla_attention`] needs.
    pub fn mla_attention_scratch(n_tokens: usize, heads: usize, rank: usize, positions: usize) -> usize {
        n_tokens * heads * Self::mla_attention_max_splits(n_tokens, heads, positions) * (rank + 2)
    }

    /// Causal attention of `n_tokens` absorbed queries (`q_abs` `[n_tokens, abs_dim]`, scaled;
    /// row `t` at position `pos0 + t`, or `*at.pos + t`) over the latent cache (`[capacity,
    /// width]`, keys and values the same rows, the latent the value): the latent each head
    /// attends to into `out` (`[n_tokens, heads, rank]`). Split over positions (grid sized for
    /// `at.max_positions` in the decode graph), then combined: two launches. `part` holds
    /// [`Self::mla_attention_scratch`] floats.
    #[allow(clippy::too_many_arguments)]
    pub fn mla_attention(
        &self,
        shape: MlaShape,
        q_abs: DPtr<f32>,
        cache: KvPtr,
        out: DPtr<f32>,
        part: DPtr<f32>,
        n_tokens: usize,
        pos0: usize,
        at: Option<DevicePos>,
    ) -> Result<()> {
        let k = kv_kernel(Kernel::MLA_ATTENTION_SPLIT, cache);
        shape.check(k)?;
        let (heads, rank, width) = (shape.heads, shape.rank, shape.width());
        let total = at.map_or(pos0, |a| a.max_positions) + n_tokens;
        if !width.is_multiple_of(cache.kv_type().block_len()) || cache.len() < total * width {
            let reason = format!("a cache of {} values for {total} rows of {width}", cache.len());
            return Err(CudaError::Shape { kernel: k.symbol(), reason });
        }
        need(k, "q_abs", q_abs, n_tokens * shape.abs_dim())?;
        need(k, "out", out, n_tokens * heads * rank)?;
        if let Some(a) = at {
            need(k, "pos", a.pos, 1)?;
        }
        let splits = Self::mla_attention_max_splits(n_tokens, heads, total);
        need(k, "part", part, Self::mla_attention_scratch(n_tokens, heads, rank, total))?;
        let pos_ptr = at.map_or(0, |a| a.pos.raw());
        let (rope, raw) = (shape.rope, cache.raw());
        match self.mla_attention_mma(shape, cache) {
            Some(mma) => {
                let grid = ((n_tokens * heads).div_ceil(16 * MLA_MMA_GROUPS) as u32, splits as u32, 1);
                let (threads, smem) = ((128 * MLA_MMA_GROUPS) as u32, mla_mma_shared_bytes() as u32);
                let tokens = i(n_tokens);
                self.launch(
                    mma,
                    grid,
                    threads,
                    smem,
                    args![
                        q_abs.raw(),
                        raw,
                        part.raw(),
                        tokens,
                        i(pos0),
                        i(heads),
                        i(rank),
                        i(rope),
                        i(splits),
                        pos_ptr
                    ],
                )?;
            }
            None => {
                let grid = (heads.div_ceil(MLA_HEADS) as u32, splits as u32, n_tokens as u32);
                self.launch(
                    k,
                    grid,
                    256,
                    0,
                    args![
                        q_abs.raw(),
                        raw,
                        part.raw(),
                        i(pos0),
                        i(heads),
                        i(rank),
                        i(rope),
                        i(splits),
                        pos_ptr
                    ],
                )?;
            }
        }
        let (window, sinks) = (0i32, 0u64);
        // the combine's blocks take ATTENTION_COMBINE_DIMS of a head's dims each: the latent's
        self.launch(
            Kernel::AttentionCombineF32,
            (heads as u32, n_tokens as u32, rank.div_ceil(ATTENTION_COMBINE_DIMS) as u32),
            128,
            0,
            args![part.raw(), out.raw(), i(heads), i(rank), i(splits), i(pos0), window, pos_ptr, sinks],
        )
    }
}
