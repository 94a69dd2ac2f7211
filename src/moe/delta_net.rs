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

use crate::model::arch::{DeltaNetProjections, DeltaNetSpec};
use crate::moe::dense::{DeltaNetVectors, PAR_MIN_MACS};
use moe_lanes_kernels::{par_chunks_mut, ColdPool, KernelError};

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
