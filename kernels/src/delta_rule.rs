//! The gated delta rule of one value head over a run of tokens in its chunked form (the WY / UT
//! transform of flash-linear-attention's `chunk_gated_delta_rule` and transformers'
//! `torch_chunk_gated_delta_rule`), register-blocked matrix products at the caller's SIMD level.
//!
//! The recurrence it equals, token by token (`S` the head's `[d_k, d_v]` state, `q` already
//! L2-normalised and scaled, `k` L2-normalised, `g <= 0` the log decay, `beta` in (0, 1)):
//!
//! ```text
//! S <- e^g S;  u = beta (v - S^T k);  S += k u^T;  o = S^T q
//! ```
//!
//! Over a chunk of `c` tokens with `G_r = g_0 + ... + g_r` and `S0` the state before it, the
//! deltas `u` solve the unit lower-triangular system
//! `u_r + sum_{s<r} beta_r e^(G_r - G_s) (k_r . k_s) u_s = beta_r (v_r - e^(G_r) S0^T k_r)`
//! (forward substitution), then
//! `o_r = e^(G_r) S0^T q_r + sum_{s<=r} e^(G_r - G_s) (q_r . k_s) u_s` and
//! `S = e^(G_last) S0 + sum_r e^(G_last - G_r) k_r u_r^T`. Every exponent is `<= 0`, so nothing
//! overflows. The products with the state (`K S0`, `Q S0` and the update) are the bulk of the work
//! and run as small GEMMs whose accumulators stay in registers.

use crate::attention_tiled::exp_nonpositive;
use crate::simd::SimdLevel;

/// The chunk length for a SIMD level, by measurement (one 128 x 128 head over 512 tokens, one
/// thread of a Sapphire-Rapids-class core: chunks of 8 / 16 / 32 / 64 / 128 took 0.86 / 0.82 /
/// 0.49 / 0.60 / 1.05 ms at AVX-512 and 1.06 / 0.60 / 0.67 / 0.83 / 1.27 ms at AVX2, against 1.82
/// ms token by token): the products with the state want long chunks, the `c x c` parts short ones.
pub fn delta_chunk_len(level: SimdLevel) -> usize {
    match level {
        SimdLevel::Avx512 | SimdLevel::Avx512Bf16 | SimdLevel::Amx => 32,
        SimdLevel::Scalar | SimdLevel::Avx2 => 16,
    }
}

/// One value head's sizes: key and value head dims and the chunk length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaHeadShape {
    pub k_dim: usize,
    pub v_dim: usize,
    pub chunk: usize,
}

impl DeltaHeadShape {
    /// Floats of scratch [`delta_rule_chunked`] needs (reused across chunks and calls).
    pub fn scratch_floats(&self) -> usize {
        let (dk, dv, c) = (self.k_dim, self.v_dim, self.chunk);
        dk * c + 2 * c * c + 3 * c * dv + c
    }
}

/// One value head's inputs over `T` tokens, token-major.
#[derive(Debug, Clone, Copy)]
pub struct DeltaHeadInputs<'a> {
    /// `T x d_k`, L2-normalised and scaled by `1/sqrt(d_k)`.
    pub q: &'a [f32],
    /// `T x d_k`, L2-normalised.
    pub k: &'a [f32],
    /// `T x d_v`.
    pub v: &'a [f32],
    /// `T` log decays (`<= 0`).
    pub g: &'a [f32],
    /// `T` write strengths.
    pub beta: &'a [f32],
}

/// Runs the delta rule of one head over `inputs.g.len()` tokens in chunks of `shape.chunk`,
/// moving `state` (`d_k x d_v`, row-major) on and writing each token's read-out (`d_v` values,
/// before any norm) to `out` (`T x d_v`). `scratch` holds at least
/// [`DeltaHeadShape::scratch_floats`]. `level` must be supported by this CPU (callers resolve it
/// with [`SimdLevel::resolve`]).
pub fn delta_rule_chunked(
    level: SimdLevel,
    shape: DeltaHeadShape,
    inputs: DeltaHeadInputs<'_>,
    state: &mut [f32],
    scratch: &mut [f32],
    out: &mut [f32],
) {
    let (dk, dv, t) = (shape.k_dim, shape.v_dim, inputs.g.len());
    assert!(shape.chunk > 0 && dk > 0 && dv > 0, "delta_rule_chunked: empty shape {shape:?}");
    assert!(inputs.q.len() >= t * dk && inputs.k.len() >= t * dk && inputs.v.len() >= t * dv);
    assert!(inputs.beta.len() >= t && out.len() >= t * dv && state.len() == dk * dv);
    assert!(scratch.len() >= shape.scratch_floats(), "delta_rule_chunked: scratch too small");
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller resolved the level, so the CPU supports its features.
        SimdLevel::Avx512 | SimdLevel::Avx512Bf16 | SimdLevel::Amx => unsafe {
            chunked_avx512(shape, inputs, state, scratch, out)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        SimdLevel::Avx2 => unsafe { chunked_avx2(shape, inputs, state, scratch, out) },
        _ => chunked::<false, 8>(shape, inputs, state, scratch, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
// SAFETY (callers): the CPU has these features; the body is safe code, compiled for them.
unsafe fn chunked_avx512(
    s: DeltaHeadShape,
    x: DeltaHeadInputs<'_>,
    st: &mut [f32],
    sc: &mut [f32],
    o: &mut [f32],
) {
    chunked::<true, 32>(s, x, st, sc, o)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
// SAFETY (callers): the CPU has these features; the body is safe code, compiled for them.
unsafe fn chunked_avx2(
    s: DeltaHeadShape,
    x: DeltaHeadInputs<'_>,
    st: &mut [f32],
    sc: &mut [f32],
    o: &mut [f32],
) {
    chunked::<true, 16>(s, x, st, sc, o)
}

/// The whole computation, inlined into the feature-enabled callers (`F`: fused multiply-add;
/// `NC`: columns of a register block).
#[inline(always)]
fn chunked<const F: bool, const NC: usize>(
    shape: DeltaHeadShape,
    x: DeltaHeadInputs<'_>,
    state: &mut [f32],
    scratch: &mut [f32],
    out: &mut [f32],
) {
    let (dk, dv, cmax) = (shape.k_dim, shape.v_dim, shape.chunk);
    let (kt, rest) = scratch.split_at_mut(dk * cmax);
    let (kk, rest) = rest.split_at_mut(cmax * cmax);
    let (qk, rest) = rest.split_at_mut(cmax * cmax);
    let (ks, rest) = rest.split_at_mut(cmax * dv);
    let (qs, rest) = rest.split_at_mut(cmax * dv);
    let (u, rest) = rest.split_at_mut(cmax * dv);
    let gc = &mut rest[..cmax];
    let total = x.g.len();
    for t0 in (0..total).step_by(cmax) {
        let c = cmax.min(total - t0);
        let (q, k) = (&x.q[t0 * dk..(t0 + c) * dk], &x.k[t0 * dk..(t0 + c) * dk]);
        let (v, beta) = (&x.v[t0 * dv..(t0 + c) * dv], &x.beta[t0..t0 + c]);
        let mut acc = 0.0;
        for (gr, &g) in gc.iter_mut().zip(&x.g[t0..t0 + c]) {
            acc += g;
            *gr = acc;
        }
        let gc = &gc[..c];
        // K^T (d_k x c) for the Gram matrices and the state update.
        let kt = &mut kt[..dk * c];
        for (r, krow) in k.chunks_exact(dk).enumerate() {
            for (i, &kv) in krow.iter().enumerate() {
                kt[i * c + r] = kv;
            }
        }
        let (kk, qk) = (&mut kk[..c * c], &mut qk[..c * c]);
        kk.fill(0.0);
        qk.fill(0.0);
        gemm_acc::<F, NC>(Mat(k, dk), Mat(kt, c), kk, c, c, dk);
        gemm_acc::<F, NC>(Mat(q, dk), Mat(kt, c), qk, c, c, dk);
        // Decay and causal masks: kk becomes minus the strictly lower system, qk the causal
        // read-out weights (diagonal included).
        for r in 0..c {
            let (kr, qr) = (&mut kk[r * c..(r + 1) * c], &mut qk[r * c..(r + 1) * c]);
            for s in 0..=r {
                let e = exp_nonpositive(gc[r] - gc[s]);
                kr[s] *= -beta[r] * e;
                qr[s] *= e;
            }
            kr[r..].fill(0.0);
            qr[r + 1..].fill(0.0);
        }
        // The state's reads: K S0 and Q S0.
        let (ks, qs) = (&mut ks[..c * dv], &mut qs[..c * dv]);
        ks.fill(0.0);
        qs.fill(0.0);
        gemm_acc::<F, NC>(Mat(k, dk), Mat(state, dv), ks, dv, c, dk);
        gemm_acc::<F, NC>(Mat(q, dk), Mat(state, dv), qs, dv, c, dk);
        // Forward substitution, row by row: u_r = beta_r (v_r - e^G_r ks_r) - sum_{s<r} A_rs u_s.
        let u = &mut u[..c * dv];
        for r in 0..c {
            let eg = exp_nonpositive(gc[r]);
            let (done, row) = u.split_at_mut(r * dv);
            let row = &mut row[..dv];
            for ((ur, &vr), &kr) in
                row.iter_mut().zip(&v[r * dv..(r + 1) * dv]).zip(&ks[r * dv..(r + 1) * dv])
            {
                *ur = beta[r] * (vr - eg * kr);
            }
            gemm_acc::<F, NC>(Mat(&kk[r * c..r * c + r], r), Mat(done, dv), row, dv, 1, r);
        }
        // Read-out: o = e^G qs + (causal qk) u, in blocks of 4 rows over the rows they see.
        let o = &mut out[t0 * dv..(t0 + c) * dv];
        for r in 0..c {
            let eg = exp_nonpositive(gc[r]);
            for (or, &qr) in o[r * dv..(r + 1) * dv].iter_mut().zip(&qs[r * dv..(r + 1) * dv]) {
                *or = eg * qr;
            }
        }
        for r0 in (0..c).step_by(4) {
            let m = 4.min(c - r0);
            let seen = r0 + m;
            gemm_acc::<F, NC>(Mat(&qk[r0 * c..], c), Mat(u, dv), &mut o[r0 * dv..(r0 + m) * dv], dv, m, seen);
        }
        // State: S = e^G_last S0 + (e^(G_last - G) k)^T u.
        let last = gc[c - 1];
        for krow in kt.chunks_exact_mut(c) {
            for (kv, &g) in krow.iter_mut().zip(gc) {
                *kv *= exp_nonpositive(last - g);
            }
        }
        let decay = exp_nonpositive(last);
        state.iter_mut().for_each(|s| *s *= decay);
        gemm_acc::<F, NC>(Mat(kt, c), Mat(u, dv), state, dv, dk, c);
    }
}

/// A row-major matrix view: its data and row stride.
#[derive(Clone, Copy)]
struct Mat<'a>(&'a [f32], usize);

#[inline(always)]
fn fmadd<const F: bool>(a: f32, b: f32, acc: f32) -> f32 {
    if F {
        a.mul_add(b, acc)
    } else {
        a * b + acc
    }
}

/// `out[m x n] += a[m x k] @ b[k x n]` (`out`'s row stride `ldo`), rows four at a time.
#[inline(always)]
fn gemm_acc<const F: bool, const NC: usize>(
    a: Mat<'_>,
    b: Mat<'_>,
    out: &mut [f32],
    ldo: usize,
    m: usize,
    k: usize,
) {
    let mut r = 0;
    while r + 4 <= m {
        rows::<F, NC, 4>(a, b, &mut out[r * ldo..], ldo, r, k);
        r += 4;
    }
    while r < m {
        rows::<F, NC, 1>(a, b, &mut out[r * ldo..], ldo, r, k);
        r += 1;
    }
}

/// `R` rows of the product from row `r0` of `a`: blocks of `NC` columns kept in registers over
/// all of `k`, the tail columns one at a time. `n` is `out`'s row width (`ldo`). Indexed loops on
/// purpose: fixed trip counts over fixed-size arrays are what keeps the block in registers.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn rows<const F: bool, const NC: usize, const R: usize>(
    a: Mat<'_>,
    b: Mat<'_>,
    out: &mut [f32],
    ldo: usize,
    r0: usize,
    k: usize,
) {
    let n = ldo;
    let arows: [&[f32]; R] = std::array::from_fn(|rr| &a.0[(r0 + rr) * a.1..(r0 + rr) * a.1 + k]);
    let blocks = n / NC * NC;
    for j in (0..blocks).step_by(NC) {
        let mut acc = [[0.0f32; NC]; R];
        for i in 0..k {
            let brow: &[f32; NC] = b.0[i * b.1 + j..i * b.1 + j + NC].try_into().expect("block");
            for rr in 0..R {
                let x = arows[rr][i];
                for cc in 0..NC {
                    acc[rr][cc] = fmadd::<F>(x, brow[cc], acc[rr][cc]);
                }
            }
        }
        for (rr, accr) in acc.iter().enumerate() {
            for (o, &v) in out[rr * ldo + j..rr * ldo + j + NC].iter_mut().zip(accr) {
                *o += v;
            }
        }
    }
    if blocks < n {
        for (rr, arow) in arows.iter().enumerate() {
            let orow = &mut out[rr * ldo + blocks..rr * ldo + n];
            for (i, &x) in arow.iter().enumerate() {
                for (o, &bv) in orow.iter_mut().zip(&b.0[i * b.1 + blocks..i * b.1 + n]) {
                    *o = fmadd::<F>(x, bv, *o);
                }
            }
        }
    }
}

/// The recurrence itself, token by token in plain f32: the oracle the chunked form is tested
/// against (it allocates one `d_v` row per call).
pub fn delta_rule_recurrent(
    shape: DeltaHeadShape,
    inputs: DeltaHeadInputs<'_>,
    state: &mut [f32],
    out: &mut [f32],
) {
    let (dk, dv) = (shape.k_dim, shape.v_dim);
    let mut delta = vec![0.0f32; dv];
    for t in 0..inputs.g.len() {
        let (q, k) = (&inputs.q[t * dk..(t + 1) * dk], &inputs.k[t * dk..(t + 1) * dk]);
        let decay = inputs.g[t].exp();
        delta.copy_from_slice(&inputs.v[t * dv..(t + 1) * dv]);
        for (row, &ki) in state.chunks_exact_mut(dv).zip(k) {
            for (s, d) in row.iter_mut().zip(delta.iter_mut()) {
                *s *= decay;
                *d -= ki * *s;
            }
        }
        delta.iter_mut().for_each(|d| *d *= inputs.beta[t]);
        let o = &mut out[t * dv..(t + 1) * dv];
        o.fill(0.0);
        for ((row, &ki), &qi) in state.chunks_exact_mut(dv).zip(k).zip(q) {
            for ((s, &d), oi) in row.iter_mut().zip(&delta).zip(o.iter_mut()) {
                *s += ki * d;
                *oi += qi * *s;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SplitMix-style generator: deterministic inputs without a dependency.
    fn noise(seed: u64, n: usize) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
            })
            .collect()
    }

    fn normalized(mut x: Vec<f32>, dim: usize, scale: f32) -> Vec<f32> {
        for row in x.chunks_exact_mut(dim) {
            let inv = scale / row.iter().map(|v| v * v).sum::<f32>().sqrt();
            row.iter_mut().for_each(|v| *v *= inv);
        }
        x
    }

    struct Case {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        g: Vec<f32>,
        beta: Vec<f32>,
    }

    fn case(dk: usize, dv: usize, t: usize, seed: u64) -> Case {
        Case {
            q: normalized(noise(seed, t * dk), dk, 1.0 / (dk as f32).sqrt()),
            k: normalized(noise(seed + 1, t * dk), dk, 1.0),
            v: noise(seed + 2, t * dv),
            // Decays from strong to none, write strengths across (0, 1).
            g: noise(seed + 3, t).iter().map(|x| -(x + 1.0) * 1.5).collect(),
            beta: noise(seed + 4, t).iter().map(|x| 0.5 + 0.49 * x).collect(),
        }
    }

    fn inputs(c: &Case) -> DeltaHeadInputs<'_> {
        DeltaHeadInputs { q: &c.q, k: &c.k, v: &c.v, g: &c.g, beta: &c.beta }
    }

    fn max_err(a: &[f32], b: &[f32]) -> f32 {
        let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-6);
        a.iter().zip(b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs())) / scale
    }

    /// Chunked equals token by token: several lengths (shorter than a chunk, a multiple, one with
    /// a tail), chunk sizes, head shapes with and without full register blocks, a nonzero state
    /// coming in (a second prompt chunk), at every SIMD level this CPU has.
    #[test]
    fn chunked_equals_the_recurrence() {
        for (dk, dv) in [(16, 12), (8, 10), (128, 128), (64, 48)] {
            for chunk in [16, 32, 64] {
                for t in [1, 5, chunk, 2 * chunk + 7] {
                    let shape = DeltaHeadShape { k_dim: dk, v_dim: dv, chunk };
                    let c = case(dk, dv, t, (dk * 1000 + t) as u64);
                    let s0: Vec<f32> = noise(7, dk * dv).iter().map(|x| 0.3 * x).collect();
                    let (mut want_s, mut want) = (s0.clone(), vec![0.0; t * dv]);
                    delta_rule_recurrent(shape, inputs(&c), &mut want_s, &mut want);
                    for level in crate::simd::available() {
                        let (mut s, mut got) = (s0.clone(), vec![0.0; t * dv]);
                        let mut scratch = vec![f32::NAN; shape.scratch_floats()];
                        delta_rule_chunked(level, shape, inputs(&c), &mut s, &mut scratch, &mut got);
                        let (eo, es) = (max_err(&got, &want), max_err(&s, &want_s));
                        assert!(eo < 2e-5 && es < 2e-5, "{shape:?} t {t} {level:?}: out {eo:e} state {es:e}");
                    }
                }
            }
        }
    }

    /// Two calls (the second on the state the first left) equal one over the whole run.
    #[test]
    fn a_run_split_in_two_calls_equals_one_call() {
        let (dk, dv, t, cut) = (32, 24, 100, 45);
        let shape = DeltaHeadShape { k_dim: dk, v_dim: dv, chunk: 32 };
        let c = case(dk, dv, t, 11);
        let level = SimdLevel::detect();
        let mut scratch = vec![0.0; shape.scratch_floats()];
        let (mut s1, mut o1) = (vec![0.0; dk * dv], vec![0.0; t * dv]);
        delta_rule_chunked(level, shape, inputs(&c), &mut s1, &mut scratch, &mut o1);
        let part = |lo: usize, hi: usize| DeltaHeadInputs {
            q: &c.q[lo * dk..hi * dk],
            k: &c.k[lo * dk..hi * dk],
            v: &c.v[lo * dv..hi * dv],
            g: &c.g[lo..hi],
            beta: &c.beta[lo..hi],
        };
        let (mut s2, mut o2) = (vec![0.0; dk * dv], vec![0.0; t * dv]);
        delta_rule_chunked(level, shape, part(0, cut), &mut s2, &mut scratch, &mut o2[..cut * dv]);
        delta_rule_chunked(level, shape, part(cut, t), &mut s2, &mut scratch, &mut o2[cut * dv..]);
        assert!(max_err(&o2, &o1) < 2e-5 && max_err(&s2, &s1) < 2e-5);
    }
}
