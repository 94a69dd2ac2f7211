//! The CPU pipeline's Gated DeltaNet (Qwen3-Next / Qwen3.5 linear-attention layers): the
//! per-token pieces between the input projections and the output projection, which the dense
//! stage runs as batched matmuls around them.
//!
//! For each token: the projections are put in conv order (`q` of every key head, then `k`, then
//! `v` of every value head; a grouped checkpoint interleaves them per key head), the depthwise
//! causal conv runs over the last `kernel` inputs and SiLU, then for every value head `j` (its
//! key head `j / (v_heads / k_heads)`), with `q`, `k` L2-normalised and `q` scaled by
//! `1/sqrt(d_k)`:
//!
//! ```text
//! S <- S * exp(g)          g = -exp(A_log) * softplus(a + dt_bias)
//! S += k (x) beta (v - S^T k)   beta = sigmoid(b)
//! o  = S^T q
//! ```
//!
//! then `o` is RMS-normalised per head, scaled by the norm weight and by `silu(z)`. The state
//! (`[v_heads, d_k, d_v]` f32 and the conv's last `kernel - 1` inputs) is the session's and its
//! size does not grow with the context.
//!
//! A decode step runs that recurrence (`conv_step`, `recurrent_step`). A run of several
//! tokens (prefill) runs `prefill`: every value head on the pool at once, each over the call's
//! tokens in chunks (the conv and norms of a chunk's tokens, then the chunked delta rule of
//! `moe_lanes_kernels::delta_rule`, then the gated norm), one pool dispatch per layer.

use crate::model::arch::{DeltaNetProjections, DeltaNetSpec};
use crate::moe::dense::{DeltaNetVectors, PAR_MIN_MACS};
use moe_lanes_kernels::{
    delta_chunk_len, delta_rule_chunked, par_chunk_pairs_mut, par_chunks_mut, ColdPool, DeltaHeadInputs,
    DeltaHeadShape, KernelError, SimdLevel,
};

/// One DeltaNet layer's part of a session: fixed size, whatever the context.
#[derive(Debug, Clone)]
pub struct DeltaNetState {
    /// The conv's last `kernel - 1` inputs, oldest first, `conv_dim` each.
    conv: Vec<f32>,
    /// Per value head its `[d_k, d_v]` state followed by `d_v` values of the head's output for
    /// the current token and `d_v` of its delta scratch (so one chunk per head holds all a
    /// head's step writes: the heads run in parallel on the pool, [`recurrent_step`], and a step
    /// allocates nothing).
    heads: Vec<f32>,
}

impl DeltaNetState {
    pub fn new(d: &DeltaNetSpec) -> DeltaNetState {
        let heads = vec![0.0; d.n_v_heads * head_stride(d)];
        DeltaNetState { conv: vec![0.0; d.conv_state_len()], heads }
    }

    /// Bytes this state holds.
    pub fn bytes(&self) -> usize {
        4 * (self.conv.len() + self.heads.len())
    }
}

/// One head's chunk of [`DeltaNetState::heads`]: its state, its output and its delta scratch.
fn head_stride(d: &DeltaNetSpec) -> usize {
    d.k_head_dim * d.v_head_dim + 2 * d.v_head_dim
}

/// One token's inputs in conv order, taken from the projections' rows.
pub(crate) struct TokenInputs {
    pub qkv: Vec<f32>,
    pub z: Vec<f32>,
    pub b: Vec<f32>,
    pub a: Vec<f32>,
    /// Every key head's L2-normalised q (also scaled by `1/sqrt(d_k)`) and k, after the conv.
    qn: Vec<f32>,
    kn: Vec<f32>,
}

impl TokenInputs {
    pub fn new(d: &DeltaNetSpec) -> TokenInputs {
        TokenInputs {
            qkv: vec![0.0; d.conv_dim()],
            z: vec![0.0; d.value_dim()],
            b: vec![0.0; d.n_v_heads],
            a: vec![0.0; d.n_v_heads],
            qn: vec![0.0; d.key_dim()],
            kn: vec![0.0; d.key_dim()],
        }
    }

    /// Fill from token `t`'s rows of the projections' outputs (`outputs[i]` holds every token's
    /// row of input projection `i`, in the order [`DeltaNetProjections`] lists them).
    pub fn gather(&mut self, d: &DeltaNetSpec, outputs: &[Vec<f32>], t: usize) {
        let (vd, nv) = (d.value_dim(), d.n_v_heads);
        let row = |i: usize, width: usize| &outputs[i][t * width..(t + 1) * width];
        let per_k = nv / d.n_k_heads;
        match d.projections {
            DeltaNetProjections::Split | DeltaNetProjections::SplitGroupedBa => {
                self.qkv.copy_from_slice(row(0, d.conv_dim()));
                self.z.copy_from_slice(row(1, vd));
            }
            DeltaNetProjections::Grouped => {
                let dk = d.k_head_dim;
                let vw = per_k * d.v_head_dim;
                let kd = d.key_dim();
                let qkvz = row(0, d.conv_dim() + vd);
                for (h, group) in qkvz.chunks_exact(2 * dk + 2 * vw).enumerate() {
                    self.qkv[h * dk..][..dk].copy_from_slice(&group[..dk]);
                    self.qkv[kd + h * dk..][..dk].copy_from_slice(&group[dk..2 * dk]);
                    self.qkv[2 * kd + h * vw..][..vw].copy_from_slice(&group[2 * dk..2 * dk + vw]);
                    self.z[h * vw..][..vw].copy_from_slice(&group[2 * dk + vw..]);
                }
            }
        }
        match d.projections {
            DeltaNetProjections::Split => {
                self.b.copy_from_slice(row(2, nv));
                self.a.copy_from_slice(row(3, nv));
            }
            DeltaNetProjections::Grouped | DeltaNetProjections::SplitGroupedBa => {
                let ba_at = crate::model::naming::delta_input_roles(d.projections).len() - 1;
                for (h, group) in row(ba_at, 2 * nv).chunks_exact(2 * per_k).enumerate() {
                    self.b[h * per_k..][..per_k].copy_from_slice(&group[..per_k]);
                    self.a[h * per_k..][..per_k].copy_from_slice(&group[per_k..]);
                }
            }
        }
    }
}

/// The causal conv and SiLU over `qkv` in place, moving the conv state on by this input.
pub(crate) fn conv_step(d: &DeltaNetSpec, weight: &[f32], state: &mut DeltaNetState, qkv: &mut [f32]) {
    let (channels, kernel) = (d.conv_dim(), d.conv_kernel);
    let past = kernel - 1;
    for ch in 0..channels {
        let w = &weight[ch * kernel..][..kernel];
        let mut acc = w[past] * qkv[ch];
        for (j, wj) in w[..past].iter().enumerate() {
            acc += wj * state.conv[j * channels + ch];
        }
        // Keep the raw input for the state before overwriting it with the conv's output.
        let input = qkv[ch];
        qkv[ch] = silu(acc);
        // Shift this channel's history by one (oldest dropped), newest last.
        for j in 0..past.saturating_sub(1) {
            state.conv[j * channels + ch] = state.conv[(j + 1) * channels + ch];
        }
        state.conv[(past - 1) * channels + ch] = input;
    }
}

/// The delta-rule step of every value head for one token, then the gated norm: writes
/// `value_dim` values to `out`. `inputs.qkv` holds the conv's output. The heads are independent:
/// on the dense stage's pool when a step is worth waking it ([`PAR_MIN_MACS`]); the same
/// arithmetic per head either way, so the same bits.
pub(crate) fn recurrent_step(
    d: &DeltaNetSpec,
    vectors: &DeltaNetVectors,
    state: &mut DeltaNetState,
    inputs: &mut TokenInputs,
    eps: f32,
    pool: &mut ColdPool,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let (dk, dv, kd) = (d.k_head_dim, d.v_head_dim, d.key_dim());
    let q_scale = 1.0 / (dk as f32).sqrt();
    for h in 0..d.n_k_heads {
        l2_normalize(&inputs.qkv[h * dk..][..dk], &mut inputs.qn[h * dk..][..dk]);
        inputs.qn[h * dk..][..dk].iter_mut().for_each(|x| *x *= q_scale);
        l2_normalize(&inputs.qkv[kd + h * dk..][..dk], &mut inputs.kn[h * dk..][..dk]);
    }
    let inputs = &*inputs;
    let head = |j: usize, chunk: &mut [f32]| {
        let kh = d.k_head_of(j);
        let (s, rest) = chunk.split_at_mut(dk * dv);
        let (o, delta) = rest.split_at_mut(dv);
        let v = &inputs.qkv[2 * kd + j * dv..][..dv];
        let beta = sigmoid(inputs.b[j]);
        let g = vectors.neg_a[j] * softplus(inputs.a[j] + vectors.dt_bias[j]);
        let (q, k) = (&inputs.qn[kh * dk..][..dk], &inputs.kn[kh * dk..][..dk]);
        head_step(s, q, k, v, (g.exp(), beta), delta, o);
        gated_norm(o, &vectors.norm, &inputs.z[j * dv..][..dv], eps);
    };
    let stride = head_stride(d);
    // Each state value: decay, the k dot, the update and the q dot.
    let macs = 4 * d.n_v_heads * dk * dv;
    if pool.n_threads() > 1 && macs >= PAR_MIN_MACS {
        par_chunks_mut(pool, &mut state.heads, stride, &head)?;
    } else {
        state.heads.chunks_exact_mut(stride).enumerate().for_each(|(j, chunk)| head(j, chunk));
    }
    for (o, chunk) in out.chunks_exact_mut(dv).zip(state.heads.chunks_exact(stride)) {
        o.copy_from_slice(&chunk[dk * dv..][..dv]);
    }
    Ok(())
}

/// One head: decay, delta update and read-out over its `[d_k, d_v]` state (`delta`: `d_v` of
/// scratch).
fn head_step(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    (decay, beta): (f32, f32),
    delta: &mut [f32],
    o: &mut [f32],
) {
    let dv = v.len();
    delta.copy_from_slice(v);
    for (row, ki) in s.chunks_exact_mut(dv).zip(k) {
        for (r, dl) in row.iter_mut().zip(delta.iter_mut()) {
            *r *= decay;
            *dl -= ki * *r;
        }
    }
    delta.iter_mut().for_each(|x| *x *= beta);
    o.fill(0.0);
    for ((row, ki), qi) in s.chunks_exact_mut(dv).zip(k).zip(q) {
        for ((r, dl), oi) in row.iter_mut().zip(&*delta).zip(o.iter_mut()) {
            *r += ki * dl;
            *oi += qi * *r;
        }
    }
}

/// Where a token's projections live in the input projections' outputs (`outputs[i]` holds every
/// token's row of input projection `i`), for either projection layout.
#[derive(Clone, Copy)]
struct ProjectionRows<'a> {
    d: &'a DeltaNetSpec,
    outputs: &'a [Vec<f32>],
}

impl<'a> ProjectionRows<'a> {
    fn row(&self, i: usize, width: usize, t: usize) -> &'a [f32] {
        &self.outputs[i][t * width..(t + 1) * width]
    }

    /// Value heads per key head, and the width of a grouped checkpoint's per-key-head group.
    fn groups(&self) -> (usize, usize) {
        let d = self.d;
        let per_k = d.n_v_heads / d.n_k_heads;
        (per_k, 2 * d.k_head_dim + 2 * per_k * d.v_head_dim)
    }

    /// Token `t`'s raw conv inputs `ch0..ch0 + len` (conv order), inside one head's q, k or v.
    fn qkv(&self, t: usize, ch0: usize, len: usize) -> &'a [f32] {
        let d = self.d;
        let (kd, dk, vd) = (d.key_dim(), d.k_head_dim, d.value_dim());
        let at = match d.projections {
            DeltaNetProjections::Split | DeltaNetProjections::SplitGroupedBa => {
                return &self.row(0, d.conv_dim(), t)[ch0..ch0 + len]
            }
            DeltaNetProjections::Grouped => {
                let (per_k, group) = self.groups();
                let vw = per_k * d.v_head_dim;
                if ch0 < kd {
                    (ch0 / dk) * group + ch0 % dk
                } else if ch0 < 2 * kd {
                    ((ch0 - kd) / dk) * group + dk + (ch0 - kd) % dk
                } else {
                    ((ch0 - 2 * kd) / vw) * group + 2 * dk + (ch0 - 2 * kd) % vw
                }
            }
        };
        &self.row(0, d.conv_dim() + vd, t)[at..at + len]
    }

    /// Token `t`'s `z` of value head `j`.
    fn z(&self, t: usize, j: usize) -> &'a [f32] {
        let d = self.d;
        let dv = d.v_head_dim;
        match d.projections {
            DeltaNetProjections::Split | DeltaNetProjections::SplitGroupedBa => {
                &self.row(1, d.value_dim(), t)[j * dv..(j + 1) * dv]
            }
            DeltaNetProjections::Grouped => {
                let (per_k, group) = self.groups();
                let at = (j / per_k) * group + 2 * d.k_head_dim + per_k * dv + (j % per_k) * dv;
                &self.row(0, d.conv_dim() + d.value_dim(), t)[at..at + dv]
            }
        }
    }

    /// Token `t`'s `(b, a)` of value head `j`.
    fn ba(&self, t: usize, j: usize) -> (f32, f32) {
        let nv = self.d.n_v_heads;
        match self.d.projections {
            DeltaNetProjections::Split => (self.row(2, nv, t)[j], self.row(3, nv, t)[j]),
            DeltaNetProjections::Grouped | DeltaNetProjections::SplitGroupedBa => {
                let per_k = self.groups().0;
                let ba_at = crate::model::naming::delta_input_roles(self.d.projections).len() - 1;
                let row = self.row(ba_at, 2 * nv, t);
                let at = (j / per_k) * 2 * per_k + j % per_k;
                (row[at], row[at + per_k])
            }
        }
    }
}

/// The chunked prefill's workspace, sized once for the widest DeltaNet layer of a plan and
/// `max_tokens`: per value head its chunk's inputs, the kernel's scratch and its outputs for the
/// whole call, and the conv history the call started from.
pub(crate) struct PrefillWork {
    heads: Vec<f32>,
    conv_prev: Vec<f32>,
    level: SimdLevel,
    chunk: usize,
    max_tokens: usize,
}

impl PrefillWork {
    pub fn new<'s>(
        specs: impl Iterator<Item = &'s DeltaNetSpec> + Clone,
        level: SimdLevel,
        max_tokens: usize,
    ) -> Self {
        let chunk = delta_chunk_len(level);
        let heads = specs.clone().map(|d| d.n_v_heads * work_stride(d, chunk, max_tokens)).max().unwrap_or(0);
        let conv_prev = specs.map(|d| d.conv_state_len()).max().unwrap_or(0);
        PrefillWork { heads: vec![0.0; heads], conv_prev: vec![0.0; conv_prev], level, chunk, max_tokens }
    }
}

fn head_shape(d: &DeltaNetSpec, chunk: usize) -> DeltaHeadShape {
    DeltaHeadShape { k_dim: d.k_head_dim, v_dim: d.v_head_dim, chunk }
}

/// One value head's floats of [`PrefillWork::heads`]: q, k, v, g and beta of a chunk, the
/// kernel's scratch, then `max_tokens` rows of output.
fn work_stride(d: &DeltaNetSpec, chunk: usize, max_tokens: usize) -> usize {
    let (dk, dv) = (d.k_head_dim, d.v_head_dim);
    chunk * (2 * dk + dv + 2) + head_shape(d, chunk).scratch_floats() + max_tokens * dv
}

/// A DeltaNet layer over `n > 1` tokens (`outputs`: the input projections' rows, see
/// [`ProjectionRows`]), moving `state` on; writes `value_dim` values a token to `out`. The same
/// arithmetic per head on any number of threads, so the same bits.
#[allow(clippy::too_many_arguments)]
pub(crate) fn prefill(
    d: &DeltaNetSpec,
    vectors: &DeltaNetVectors,
    state: &mut DeltaNetState,
    outputs: &[Vec<f32>],
    n: usize,
    eps: f32,
    work: &mut PrefillWork,
    pool: &mut ColdPool,
    out: &mut [f32],
) -> Result<(), KernelError> {
    assert!(n <= work.max_tokens, "prefill of {n} tokens, workspace for {}", work.max_tokens);
    let rows = ProjectionRows { d, outputs };
    let conv_prev = &mut work.conv_prev[..d.conv_state_len()];
    conv_prev.copy_from_slice(&state.conv);
    advance_conv_state(rows, conv_prev, n, &mut state.conv);
    let (chunk, level) = (work.chunk, work.level);
    let stride = work_stride(d, chunk, work.max_tokens);
    let heads = &mut work.heads[..d.n_v_heads * stride];
    let ctx = HeadPrefill { rows, vectors, conv_prev, n, eps, chunk, level };
    let job = |j: usize, head: &mut [f32], w: &mut [f32]| ctx.run(j, head, w);
    let (dk, dv, vd) = (d.k_head_dim, d.v_head_dim, d.value_dim());
    // The state products alone: three multiply-adds per state value and token.
    let parallel = pool.n_threads() > 1 && 3 * n * d.n_v_heads * dk * dv >= PAR_MIN_MACS;
    if parallel {
        par_chunk_pairs_mut(pool, (&mut state.heads, head_stride(d)), (heads, stride), &job)?;
    } else {
        let pairs = state.heads.chunks_exact_mut(head_stride(d)).zip(heads.chunks_exact_mut(stride));
        pairs.enumerate().for_each(|(j, (head, w))| job(j, head, w));
    }
    // Head-major outputs to token-major rows.
    let heads = &work.heads[..d.n_v_heads * stride];
    let gather = |t: usize, row: &mut [f32]| {
        for (j, o) in row.chunks_exact_mut(dv).enumerate() {
            let outs = &heads[j * stride + stride - work.max_tokens * dv..];
            o.copy_from_slice(&outs[t * dv..(t + 1) * dv]);
        }
    };
    if parallel {
        par_chunks_mut(pool, &mut out[..n * vd], vd, &gather)?;
    } else {
        out[..n * vd].chunks_exact_mut(vd).enumerate().for_each(|(t, row)| gather(t, row));
    }
    Ok(())
}

/// The conv state after `n` more inputs: the last `kernel - 1` of the old history followed by
/// the call's raw inputs.
fn advance_conv_state(rows: ProjectionRows<'_>, prev: &[f32], n: usize, conv: &mut [f32]) {
    let d = rows.d;
    let (channels, past) = (d.conv_dim(), d.conv_kernel - 1);
    for (j, dst) in conv.chunks_exact_mut(channels).enumerate() {
        // Position j + n of (history, inputs).
        match (j + n).checked_sub(past) {
            None => dst.copy_from_slice(&prev[(j + n) * channels..(j + n + 1) * channels]),
            Some(t) => {
                for (ch0, len) in segments(d) {
                    dst[ch0..ch0 + len].copy_from_slice(rows.qkv(t, ch0, len));
                }
            }
        }
    }
}

/// The conv channels head by head: `(first channel, count)` of every q, k and v head.
fn segments(d: &DeltaNetSpec) -> impl Iterator<Item = (usize, usize)> {
    let (dk, dv, kd) = (d.k_head_dim, d.v_head_dim, d.key_dim());
    let qk = (0..2 * d.n_k_heads).map(move |h| (h * dk, dk));
    qk.chain((0..d.n_v_heads).map(move |j| (2 * kd + j * dv, dv)))
}

/// What every head's prefill job reads.
struct HeadPrefill<'a> {
    rows: ProjectionRows<'a>,
    vectors: &'a DeltaNetVectors,
    conv_prev: &'a [f32],
    n: usize,
    eps: f32,
    chunk: usize,
    level: SimdLevel,
}

impl HeadPrefill<'_> {
    /// Value head `j` over the call: `head` is its chunk of the state, `w` of the workspace.
    fn run(&self, j: usize, head: &mut [f32], w: &mut [f32]) {
        let d = self.rows.d;
        let (dk, dv, kd, c) = (d.k_head_dim, d.v_head_dim, d.key_dim(), self.chunk);
        let kh = d.k_head_of(j);
        let shape = head_shape(d, c);
        let (q, w) = w.split_at_mut(c * dk);
        let (k, w) = w.split_at_mut(c * dk);
        let (v, w) = w.split_at_mut(c * dv);
        let (g, w) = w.split_at_mut(c);
        let (beta, w) = w.split_at_mut(c);
        let (scratch, outs) = w.split_at_mut(shape.scratch_floats());
        let s = &mut head[..dk * dv];
        let q_scale = 1.0 / (dk as f32).sqrt();
        let (dt_bias, neg_a) = (self.vectors.dt_bias[j], self.vectors.neg_a[j]);
        for t0 in (0..self.n).step_by(c) {
            let len = c.min(self.n - t0);
            for r in 0..len {
                let t = t0 + r;
                let (qr, kr) = (&mut q[r * dk..(r + 1) * dk], &mut k[r * dk..(r + 1) * dk]);
                self.conv(t, kh * dk, qr);
                self.conv(t, kd + kh * dk, kr);
                self.conv(t, 2 * kd + j * dv, &mut v[r * dv..(r + 1) * dv]);
                l2_normalize_in_place(qr, q_scale);
                l2_normalize_in_place(kr, 1.0);
                let (b, a) = self.rows.ba(t, j);
                beta[r] = sigmoid(b);
                g[r] = neg_a * softplus(a + dt_bias);
            }
            let inputs = DeltaHeadInputs {
                q: &q[..len * dk],
                k: &k[..len * dk],
                v: &v[..len * dv],
                g: &g[..len],
                beta: &beta[..len],
            };
            let o = &mut outs[t0 * dv..(t0 + len) * dv];
            delta_rule_chunked(self.level, shape, inputs, s, scratch, o);
            for (r, orow) in o.chunks_exact_mut(dv).enumerate() {
                gated_norm(orow, &self.vectors.norm, self.rows.z(t0 + r, j), self.eps);
            }
        }
    }

    /// The causal conv and SiLU of token `t`'s channels `ch0..ch0 + dst.len()` (one head's).
    fn conv(&self, t: usize, ch0: usize, dst: &mut [f32]) {
        let d = self.rows.d;
        let (channels, kernel, len) = (d.conv_dim(), d.conv_kernel, dst.len());
        let past = kernel - 1;
        dst.fill(0.0);
        for tap in 0..kernel {
            let w = &self.vectors.conv_taps[tap * channels + ch0..tap * channels + ch0 + len];
            // Input t - past + tap: from the history before the call or from the call's rows.
            let x = match (t + tap).checked_sub(past) {
                Some(u) => self.rows.qkv(u, ch0, len),
                None => &self.conv_prev[(t + tap) * channels + ch0..(t + tap) * channels + ch0 + len],
            };
            for ((o, &wv), &xv) in dst.iter_mut().zip(w).zip(x) {
                *o += wv * xv;
            }
        }
        dst.iter_mut().for_each(|v| *v = silu(*v));
    }
}

fn l2_normalize_in_place(x: &mut [f32], scale: f32) {
    let inv = scale / (x.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

fn gated_norm(o: &mut [f32], weight: &[f32], z: &[f32], eps: f32) {
    let ms = o.iter().map(|x| x * x).sum::<f32>() / o.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    for ((x, w), zv) in o.iter_mut().zip(weight).zip(z) {
        *x = *x * inv * w * silu(*zv);
    }
}

fn l2_normalize(x: &[f32], out: &mut [f32]) {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
    for (o, v) in out.iter_mut().zip(x) {
        *o = v * inv;
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `ln(1 + e^x)`, linear above 20 as torch's.
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::arch::VHeadOrder;
    use crate::model::naming::delta_input_roles;

    fn noise(seed: u64, n: usize) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
            })
            .collect()
    }

    fn spec(projections: DeltaNetProjections, v_heads: VHeadOrder, dk: usize, dv: usize) -> DeltaNetSpec {
        DeltaNetSpec {
            n_k_heads: 2,
            n_v_heads: 4,
            k_head_dim: dk,
            v_head_dim: dv,
            conv_kernel: 4,
            projections,
            v_heads,
        }
    }

    /// Every token's rows of the input projections, as the dense stage leaves them.
    fn rows_of(d: &DeltaNetSpec, n: usize, seed: u64) -> Vec<Vec<f32>> {
        let (cd, vd, nv) = (d.conv_dim(), d.value_dim(), d.n_v_heads);
        let widths: Vec<usize> = match d.projections {
            DeltaNetProjections::Grouped => vec![cd + vd, 2 * nv],
            DeltaNetProjections::Split => vec![cd, vd, nv, nv],
            DeltaNetProjections::SplitGroupedBa => vec![cd, vd, 2 * nv],
        };
        assert_eq!(widths.len(), delta_input_roles(d.projections).len());
        widths
            .iter()
            .enumerate()
            .map(|(i, w)| noise(seed + i as u64, n * w).iter().map(|x| 2.0 * x).collect())
            .collect()
    }

    fn vectors(d: &DeltaNetSpec) -> DeltaNetVectors {
        let conv: Vec<f32> = noise(90, d.conv_dim() * d.conv_kernel).iter().map(|x| 0.6 * x).collect();
        let channels = d.conv_dim();
        let conv_taps =
            (0..conv.len()).map(|i| conv[(i % channels) * d.conv_kernel + i / channels]).collect();
        DeltaNetVectors {
            conv,
            conv_taps,
            dt_bias: noise(91, d.n_v_heads),
            neg_a: noise(92, d.n_v_heads).iter().map(|a| -(a + 0.2).exp()).collect(),
            norm: noise(93, d.v_head_dim).iter().map(|x| 1.0 + 0.3 * x).collect(),
        }
    }

    /// The recurrent path over `n` tokens, as decode runs it.
    fn stepped(
        d: &DeltaNetSpec,
        v: &DeltaNetVectors,
        state: &mut DeltaNetState,
        outputs: &[Vec<f32>],
        n: usize,
    ) -> Vec<f32> {
        let (mut pool, mut token, vd) = (ColdPool::new(1), TokenInputs::new(d), d.value_dim());
        let mut out = vec![0.0; n * vd];
        for t in 0..n {
            token.gather(d, outputs, t);
            conv_step(d, &v.conv, state, &mut token.qkv);
            recurrent_step(d, v, state, &mut token, 1e-6, &mut pool, &mut out[t * vd..(t + 1) * vd]).unwrap();
        }
        out
    }

    fn max_err(a: &[f32], b: &[f32]) -> f32 {
        let scale = b.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
        a.iter().zip(b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs())) / scale
    }

    /// The chunked prefill and the token-by-token steps agree on outputs, the matrix state and
    /// the conv state, for every projection layout and value-head order, calls shorter than the
    /// conv window and than a chunk, a chunk's multiple and with a tail, starting from the state an
    /// earlier call left (a second prompt chunk), on one thread and on a pool.
    #[test]
    fn chunked_prefill_equals_the_recurrent_steps() {
        let layouts = [
            (DeltaNetProjections::Grouped, VHeadOrder::Grouped, 16, 12),
            (DeltaNetProjections::Split, VHeadOrder::Grouped, 8, 10),
            (DeltaNetProjections::SplitGroupedBa, VHeadOrder::Tiled, 32, 40),
        ];
        let level = SimdLevel::detect();
        let c = delta_chunk_len(level);
        for (projections, order, dk, dv) in layouts {
            let d = spec(projections, order, dk, dv);
            let v = vectors(&d);
            for threads in [1, 3] {
                let mut pool = ColdPool::new(threads);
                let mut work = PrefillWork::new([d].iter(), level, 4 * c);
                for (first, second) in [(2, 3), (c - 1, c), (2 * c, 2 * c + 5), (5, 3 * c + 1)] {
                    let (a, b) = (rows_of(&d, first, 1), rows_of(&d, second, 7));
                    let (mut s1, mut s2) = (DeltaNetState::new(&d), DeltaNetState::new(&d));
                    let want = [stepped(&d, &v, &mut s1, &a, first), stepped(&d, &v, &mut s1, &b, second)];
                    let mut got = Vec::new();
                    for (outputs, n) in [(&a, first), (&b, second)] {
                        let mut out = vec![0.0; n * d.value_dim()];
                        prefill(&d, &v, &mut s2, outputs, n, 1e-6, &mut work, &mut pool, &mut out).unwrap();
                        got.push(out);
                    }
                    let what =
                        format!("{projections:?} {order:?} {first}+{second} tokens, {threads} threads");
                    for (g, w) in got.iter().zip(&want) {
                        assert!(max_err(g, w) < 1e-4, "{what}: out {}", max_err(g, w));
                    }
                    assert_eq!(s2.conv, s1.conv, "{what}: conv state");
                    let matrix = |s: &DeltaNetState| -> Vec<f32> {
                        s.heads.chunks_exact(head_stride(&d)).flat_map(|h| h[..dk * dv].to_vec()).collect()
                    };
                    assert!(max_err(&matrix(&s2), &matrix(&s1)) < 1e-4, "{what}: state");
                }
            }
        }
    }
}
