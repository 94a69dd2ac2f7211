//! The latent attention kernels (`kernels/cuda/mla.cu`) against a plain CPU computation of the
//! absorbed form: the prep (q's rope parts rotated and scaled into the absorbed queries; the new
//! latent rows RMS-normed, rotated and appended in the cache's type), the per-head `k_b` / `v_b`
//! products and the split attention over the latent cache. A decode shape at DeepSeek-V3's sizes
//! (rank 512, rope 64, nope 128; a context of several spans) and a prefill shape at the fixture's
//! (rank 32, rope 8; heads not a multiple of the block's 8); at DeepSeek's latent with 4 heads, a
//! 40-row chunk after 30 positions and decode, under a YaRN-like table and attention factor;
//! over f32 and f16 caches (and bf16 and q8_0 where rows are whole blocks); the decode graph's
//! form (position from device memory, the grid sized for more positions) equal to the
//! host-position form. f16 and bf16 caches of whole 16-value rows and 32-column latents take the
//! tensor-core pass (`mla_attention_mma_*`): DeepSeek's sizes (decode at 3001 positions too) and a
//! 6-head rank-64 shape whose row groups span tokens. Skips without a GPU.

mod common;

use common::cuda::{backend, max_abs_diff, mean_launch_us, rnd, to_bf16};
use moe_lanes_kernels::cuda::mla::{MlaRope, MlaShape};
use moe_lanes_kernels::cuda::ops::{DevicePos, KvPtr, RopeScaling};
use moe_lanes_kernels::cuda::{CudaBackend, DeviceBuffer};
use moe_lanes_kernels::{KvRows, KvType};

/// The inverse frequency of pair `i` of `rope` values: YaRN-like (`yarn`: the upper half of the
/// pairs interpolated by 40, as DeepSeek-V3's factor) or plain.
fn inv_freq(i: usize, rope: usize, theta: f32, yarn: bool) -> f64 {
    let plain = 1.0 / (theta as f64).powf(2.0 * i as f64 / rope as f64);
    if yarn && i >= rope / 4 {
        plain / 40.0
    } else {
        plain
    }
}

/// sin and cos times this under `yarn` (an attention factor other than 1, so a kernel that
/// drops it, or applies it twice, is seen).
const YARN_FACTOR: f32 = 1.25;

fn rope_cpu(x: &mut [f32], pos: usize, theta: f32, interleaved: bool, yarn: bool) {
    let half = x.len() / 2;
    let f = if yarn { YARN_FACTOR as f64 } else { 1.0 };
    for i in 0..half {
        let ang = pos as f64 * inv_freq(i, x.len(), theta, yarn);
        let (s, c) = ((ang.sin() * f) as f32, (ang.cos() * f) as f32);
        let (a, b) = if interleaved { (2 * i, 2 * i + 1) } else { (i, i + half) };
        let (x0, x1) = (x[a], x[b]);
        x[a] = x0 * c - x1 * s;
        x[b] = x1 * c + x0 * s;
    }
}

/// A cache of `values` in type `t` on the device.
fn upload_cache(be: &CudaBackend, t: KvType, values: &[f32]) -> DeviceBuffer<u8> {
    let bytes: Vec<u8> = match KvRows::converted(t, values).unwrap() {
        KvRows::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        KvRows::F16(v) | KvRows::Bf16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        KvRows::Q8_0(b) => b,
    };
    be.upload(&bytes).unwrap()
}

fn cache_ptr(t: KvType, d: &DeviceBuffer<u8>) -> KvPtr {
    let p = d.ptr();
    match t {
        KvType::F32 => KvPtr::F32(p.as_f32()),
        KvType::F16 => KvPtr::F16(p.as_u16()),
        KvType::Bf16 => KvPtr::Bf16(p.as_u16()),
        KvType::Q8_0 => KvPtr::Q8_0(p),
    }
}

/// The cache's values as f32 (read back and decoded).
fn read_cache(be: &CudaBackend, t: KvType, d: &DeviceBuffer<u8>) -> Vec<f32> {
    let bytes: Vec<u8> = be.read_vec(d.ptr()).unwrap();
    let u16s = || bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
    let rows = match t {
        KvType::F32 => {
            KvRows::F32(bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect())
        }
        KvType::F16 => KvRows::F16(u16s()),
        KvType::Bf16 => KvRows::Bf16(u16s()),
        KvType::Q8_0 => KvRows::Q8_0(bytes.clone()),
    };
    rows.to_f32_vec()
}

/// Bound on a value's rounding into the cache type (values of size ~1-3).
fn type_bound(t: KvType) -> f32 {
    match t {
        KvType::F32 => 1e-5,
        KvType::F16 => 4e-3,
        KvType::Bf16 => 2e-2,
        KvType::Q8_0 => 4e-2,
    }
}

/// How far the latents may be from the CPU's over the same cache rows: f32 accumulation in
/// another order; the tensor-core pass over a bf16 cache splits q and p into bf16 hi + lo, 16
/// significant bits against f32's 24 (on H100: 1.05e-4 at DeepSeek's latent, a short prefill),
/// still well under that cache's own rounding of each latent value (2^-9).
fn attention_bound(t: KvType) -> f32 {
    match t {
        KvType::Bf16 => 4e-4,
        KvType::F32 | KvType::F16 | KvType::Q8_0 => 1e-4,
    }
}

struct Case {
    shape: MlaShape,
    t: usize,
    pos0: usize,
    interleaved: bool,
    /// A YaRN-like frequency table and attention factor ([`inv_freq`], [`YARN_FACTOR`]).
    yarn: bool,
}

/// What the CPU computes for a case before attention: the new cache rows (f32) and the absorbed
/// queries.
struct Cpu {
    rows: Vec<f32>,
    q_abs: Vec<f32>,
}

fn cpu_prep(
    c: &Case,
    q: &[f32],
    kv: &[f32],
    kv_norm: &[f32],
    k_b: &[f32],
    [scale, theta, eps]: [f32; 3],
) -> Cpu {
    let s = c.shape;
    let (w, qw) = (s.width(), s.nope + s.rope);
    let mut rows = vec![0f32; c.t * w];
    let mut q_abs = vec![0f32; c.t * s.abs_dim()];
    for t in 0..c.t {
        let pos = c.pos0 + t;
        let x = &kv[t * w..(t + 1) * w];
        let ss: f32 = x[..s.rank].iter().map(|v| v * v).sum();
        let inv = 1.0 / (ss / s.rank as f32 + eps).sqrt();
        let row = &mut rows[t * w..(t + 1) * w];
        for i in 0..s.rank {
            row[i] = x[i] * inv * kv_norm[i];
        }
        row[s.rank..].copy_from_slice(&x[s.rank..]);
        rope_cpu(&mut row[s.rank..], pos, theta, c.interleaved, c.yarn);
        for h in 0..s.heads {
            let qh = &q[t * s.q_dim() + h * qw..][..qw];
            let dst = &mut q_abs[(t * s.heads + h) * w..][..w];
            for r in 0..s.rank {
                let kr = &k_b[(h * s.rank + r) * s.nope..][..s.nope];
                dst[r] = scale * kr.iter().zip(&qh[..s.nope]).map(|(a, b)| a * b).sum::<f32>();
            }
            let mut qr = qh[s.nope..].to_vec();
            rope_cpu(&mut qr, pos, theta, c.interleaved, c.yarn);
            for (d, v) in dst[s.rank..].iter_mut().zip(qr) {
                *d = v * scale;
            }
        }
    }
    Cpu { rows, q_abs }
}

/// Causal attention of the absorbed queries over the cache rows, then `v_b`: (latents, values).
fn cpu_attention(c: &Case, q_abs: &[f32], cache: &[f32], v_b: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let s = c.shape;
    let w = s.width();
    let mut lat = vec![0f32; c.t * s.heads * s.rank];
    let mut values = vec![0f32; c.t * s.heads * s.v_dim];
    for t in 0..c.t {
        for h in 0..s.heads {
            let qa = &q_abs[(t * s.heads + h) * w..][..w];
            let n = c.pos0 + t + 1;
            let sc: Vec<f64> = (0..n)
                .map(|j| qa.iter().zip(&cache[j * w..(j + 1) * w]).map(|(a, b)| (a * b) as f64).sum())
                .collect();
            let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = sc.iter().map(|v| (v - m).exp()).collect();
            let l: f64 = p.iter().sum();
            let out = &mut lat[(t * s.heads + h) * s.rank..][..s.rank];
            for (r, o) in out.iter_mut().enumerate() {
                *o = ((0..n).map(|j| p[j] * cache[j * w + r] as f64).sum::<f64>() / l) as f32;
            }
            for vi in 0..s.v_dim {
                let vr = &v_b[(h * s.v_dim + vi) * s.rank..][..s.rank];
                values[t * s.heads * s.v_dim + h * s.v_dim + vi] =
                    vr.iter().zip(out.iter()).map(|(a, b)| a * b).sum();
            }
        }
    }
    (lat, values)
}

/// One case over one cache type: every kernel against the CPU; with `graph`, the decode graph's
/// form (positions from device memory, the grid sized for `capacity`) instead of the host's.
fn run_case(be: &CudaBackend, c: &Case, kv_type: KvType, graph: bool) {
    let s = c.shape;
    let (w, cap) = (s.width(), c.pos0 + c.t + 7);
    let (theta, eps, scale) = (10000.0f32, 1e-6f32, 0.37f32);
    let q = rnd(c.t * s.q_dim(), 11);
    let kv: Vec<f32> = rnd(c.t * w, 12).iter().map(|v| 2.0 * v).collect();
    let kv_norm: Vec<f32> = rnd(s.rank, 13).iter().map(|v| 1.0 + 0.5 * v).collect();
    let (k_bits, k_b) = to_bf16(&rnd(s.heads * s.rank * s.nope, 14));
    let (v_bits, v_b) = to_bf16(&rnd(s.heads * s.v_dim * s.rank, 15));
    let mut old = rnd(cap * w, 16);
    old[c.pos0 * w..].iter_mut().for_each(|v| *v = 0.0);
    let cache = upload_cache(be, kv_type, &old);
    let up = |v: &[f32]| be.upload(v).unwrap();
    let (dq, dkv, dnorm) = (up(&q), up(&kv), up(&kv_norm));
    let (dk, dv) = (be.upload(&k_bits).unwrap(), be.upload(&v_bits).unwrap());
    let dabs = be.alloc_zeros::<f32>(c.t * s.abs_dim()).unwrap();
    let dout = be.alloc_zeros::<f32>(c.t * s.heads * s.rank).unwrap();
    let dvals = be.alloc_zeros::<f32>(c.t * s.heads * s.v_dim).unwrap();
    let part =
        be.alloc_zeros::<f32>(CudaBackend::mla_attention_scratch(c.t, s.heads, s.rank, cap + c.t)).unwrap();
    let dpos = be.upload(&[c.pos0 as i32]).unwrap();
    let (pos0, pos, at) = match graph {
        true => (0, Some(dpos.ptr()), Some(DevicePos { pos: dpos.ptr(), max_positions: cap - c.t })),
        false => (c.pos0, None, None),
    };
    let freqs: Vec<f64> = (0..s.rope / 2).map(|i| inv_freq(i, s.rope, theta, c.yarn)).collect();
    let dfreqs = be.upload(&freqs).unwrap();
    let scaling = c.yarn.then(|| RopeScaling { freqs: dfreqs.ptr(), scale: YARN_FACTOR });
    let rope = MlaRope { theta, interleaved: c.interleaved, scaling };
    let kc = cache_ptr(kv_type, &cache);
    be.mla_prep(s, dq.ptr(), dkv.ptr(), dnorm.ptr(), dabs.ptr(), kc, c.t, pos0, pos, rope, eps, scale)
        .unwrap();
    be.mla_absorb(s, dq.ptr(), dk.ptr(), dabs.ptr(), c.t, scale).unwrap();
    be.mla_attention(s, dabs.ptr(), kc, dout.ptr(), part.ptr(), c.t, pos0, at).unwrap();
    be.mla_values(s, dout.ptr(), dv.ptr(), dvals.ptr(), c.t).unwrap();
    let what = format!(
        "rank {} heads {} t {} pos0 {} yarn {} {kv_type} graph {graph}",
        s.rank, s.heads, c.t, c.pos0, c.yarn
    );
    let want = cpu_prep(c, &q, &kv, &kv_norm, &k_b, [scale, theta, eps]);
    let got_cache = read_cache(be, kv_type, &cache);
    let new_rows = &got_cache[c.pos0 * w..(c.pos0 + c.t) * w];
    let err = max_abs_diff(new_rows, &want.rows);
    eprintln!("{what}: appended rows {err:e}");
    assert!(err < type_bound(kv_type) * 3.0, "{what}: appended rows {err}");
    let got_abs: Vec<f32> = be.read_vec(dabs.ptr()).unwrap();
    let err = max_abs_diff(&got_abs, &want.q_abs);
    assert!(err < 1e-4 * (s.nope as f32).sqrt(), "{what}: absorbed q {err}");
    // Attention over the cache as the device holds it (its type's rounding is not the kernel's).
    let (lat, values) = cpu_attention(c, &got_abs, &got_cache, &v_b);
    let got_lat: Vec<f32> = be.read_vec(dout.ptr()).unwrap();
    let got_vals: Vec<f32> = be.read_vec(dvals.ptr()).unwrap();
    let (e1, e2) = (max_abs_diff(&got_lat, &lat), max_abs_diff(&got_vals, &values));
    eprintln!("{what}: latents {e1:e}, values {e2:e}");
    let bound = attention_bound(kv_type);
    assert!(e1 < bound && e2 < bound * (s.rank as f32).sqrt(), "{what}: {e1} {e2}");
}

fn cases() -> Vec<Case> {
    let deepseek = MlaShape { heads: 16, rank: 512, nope: 128, rope: 64, v_dim: 128 };
    let fixture = MlaShape { heads: 10, rank: 32, nope: 16, rope: 8, v_dim: 12 };
    let few_heads = MlaShape { heads: 4, ..deepseek };
    let odd = MlaShape { heads: 6, rank: 64, nope: 32, rope: 16, v_dim: 24 };
    vec![
        // decode: one token after 300 positions (several spans of 32)
        Case { shape: deepseek, t: 1, pos0: 300, interleaved: true, yarn: false },
        // prefill: 37 tokens after 3, half-split pairs, heads past the block's 8
        Case { shape: fixture, t: 37, pos0: 3, interleaved: false, yarn: false },
        // a short prefill at DeepSeek's sizes
        Case { shape: deepseek, t: 9, pos0: 0, interleaved: true, yarn: false },
        // the preset GPU test's shape: 4 heads (half a block) at DeepSeek's latent, a 40-row
        // chunk after 30 positions (5 tiles of the per-head products), YaRN's table and factor
        Case { shape: few_heads, t: 40, pos0: 30, interleaved: true, yarn: true },
        // decode under YaRN at DeepSeek's sizes
        Case { shape: deepseek, t: 1, pos0: 200, interleaved: true, yarn: true },
        // the tensor-core pass over 16-bit caches: rows of 5 dim steps (warp 0 takes two, the
        // others one), 6 heads (a group of 16 rows spans three tokens), a prefill after 50
        Case { shape: odd, t: 23, pos0: 50, interleaved: false, yarn: false },
        // decode deep enough that every span holds several tiles, and a span ends mid-tile
        Case { shape: deepseek, t: 1, pos0: 3001, interleaved: true, yarn: false },
    ]
}

#[test]
fn mla_kernels_match_cpu_over_f32_and_f16_caches() {
    let Some(be) = backend() else { return };
    for c in &cases() {
        for kv_type in [KvType::F32, KvType::F16] {
            run_case(be, c, kv_type, false);
        }
    }
}

#[test]
fn mla_kernels_match_cpu_over_bf16_and_q8_0_caches() {
    let Some(be) = backend() else { return };
    for c in cases().iter().filter(|c| c.shape.width().is_multiple_of(32)) {
        for kv_type in [KvType::Bf16, KvType::Q8_0] {
            run_case(be, c, kv_type, false);
        }
    }
}

/// The decode graph's form: the position from device memory and a grid for more positions than
/// the call sees give what the host's position gives.
#[test]
fn mla_kernels_read_the_position_from_the_device() {
    let Some(be) = backend() else { return };
    for c in &cases() {
        run_case(be, c, KvType::F16, true);
    }
}

/// Shapes past the kernels' registers and shared memory, and q8_0 rows that split a block, are
/// refused by name (no device needed for the shape check).
#[test]
fn mla_shapes_the_kernels_cannot_take_are_refused() {
    let ok = MlaShape { heads: 128, rank: 512, nope: 128, rope: 64, v_dim: 128 };
    assert!(ok.fits());
    assert!(!MlaShape { rank: 1024, ..ok }.fits());
    assert!(!MlaShape { rope: 65, ..ok }.fits());
    assert!(!MlaShape { rope: 128, ..ok }.fits());
    let Some(be) = backend() else { return };
    let fixture = MlaShape { heads: 4, rank: 32, nope: 16, rope: 8, v_dim: 12 };
    let cache = be.alloc_zeros::<u8>(34 * 40).unwrap();
    let buf = be.alloc_zeros::<f32>(4096).unwrap();
    let rope = MlaRope { theta: 1e4, interleaved: true, scaling: None };
    let p = buf.ptr();
    let err =
        be.mla_prep(fixture, p, p, p, p, KvPtr::Q8_0(cache.ptr()), 1, 0, None, rope, 1e-6, 1.0).unwrap_err();
    assert!(err.to_string().contains("blocks of 32"), "{err}");
    let big = MlaShape { rank: 1024, ..ok };
    let err = be.mla_absorb(big, p, be.alloc_zeros::<u16>(1).unwrap().ptr(), p, 1, 1.0).unwrap_err();
    assert!(err.to_string().contains("rank 1024"), "{err}");
}

/// Latent attention over an f16 cache at DeepSeek-V3's sizes (128 heads, rank 512, rope 64),
/// one decode token and a 64-row prefill chunk after 8192 and 32768 positions (not a test of
/// speed: prints, for the lead's measurements), the mean of 20 launches after 3 warm-ups.
#[test]
#[ignore]
fn mla_attention_depth_timing() {
    let Some(be) = backend() else { return };
    let s = MlaShape { heads: 128, rank: 512, nope: 128, rope: 64, v_dim: 128 };
    for depth in [8192usize, 32768] {
        let cache = upload_cache(be, KvType::F16, &rnd((depth + 64) * s.width(), 21));
        let kc = cache_ptr(KvType::F16, &cache);
        for t in [1usize, 64] {
            let q = be.upload(&rnd(t * s.abs_dim(), 22)).unwrap();
            let out = be.alloc_zeros::<f32>(t * s.heads * s.rank).unwrap();
            let part = be
                .alloc_zeros::<f32>(CudaBackend::mla_attention_scratch(t, s.heads, s.rank, depth + t))
                .unwrap();
            let launch = || be.mla_attention(s, q.ptr(), kc, out.ptr(), part.ptr(), t, depth, None).unwrap();
            let us = mean_launch_us(be, 3, 20, launch);
            let flop = 2.0 * (t * s.heads) as f64 * (depth + t) as f64 * (s.width() + s.rank) as f64;
            let gbs = ((depth + t) * s.width() * 2) as f64 / us / 1e3;
            eprintln!(
                "TIMING mla attention f16 depth {depth} t {t} heads {}: {us:.1} us, {:.1} TFLOP/s, cache {gbs:.0} GB/s",
                s.heads,
                flop / us / 1e6
            );
        }
    }
}
