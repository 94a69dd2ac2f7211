//! One test per CUDA kernel against a plain CPU scalar computation. Every test skips (and says
//! so) when no CUDA device is usable, so CI without a GPU passes.

mod common;

use common::cuda::{backend, max_abs_diff, mean_launch_us, rnd, tiles_of_at_most, to_bf16};
use half::bf16;
use moe_lanes_kernels::cuda::kernel::{GROUPED_DECODE_TILE_ROWS, GROUPED_TILE_ROWS};
use moe_lanes_kernels::cuda::ops::{KvPtr, RouteVariant};
use moe_lanes_kernels::cuda::{CudaBackend, DPtr, GateUpEpilogue};

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[test]
fn gemv_bf16_matches_cpu() {
    let Some(be) = backend() else { return };
    for &(t, n, k) in &[(1usize, 37usize, 64usize), (3, 50, 44), (2, 9, 1000)] {
        let (wb, w) = to_bf16(&rnd(n * k, 1));
        let x = rnd(t * k, 2);
        let dw = be.upload(&wb).unwrap();
        let dx = be.upload(&x).unwrap();
        let dy = be.upload(&vec![1.0f32; t * n]).unwrap();
        be.gemv_bf16(dw.ptr(), dx.ptr(), dy.ptr(), t, n, k, true).unwrap();
        let y = be.read_vec(dy.ptr()).unwrap();
        let want: Vec<f32> = (0..t)
            .flat_map(|ti| {
                (0..n).map(|ni| 1.0 + dot(&w[ni * k..][..k], &x[ti * k..][..k])).collect::<Vec<_>>()
            })
            .collect();
        let err = max_abs_diff(&y, &want);
        eprintln!("gemv t={t} n={n} k={k}: max err {err:e}");
        assert!(err < 1e-4 * (k as f32).sqrt(), "{err}");
    }
}

#[test]
fn gemm_bf16_split_matches_cpu() {
    let Some(be) = backend() else { return };
    let (t, n, k) = (7, 33, 48);
    let (wb, w) = to_bf16(&rnd(n * k, 3));
    let x = rnd(t * k, 4);
    let dw = be.upload(&wb).unwrap();
    let dx = be.upload(&x).unwrap();
    let hi = be.alloc_zeros::<u16>(t * k).unwrap();
    let lo = be.alloc_zeros::<u16>(t * k).unwrap();
    be.gather_split_bf16(dx.ptr(), None, hi.ptr(), Some(lo.ptr()), t, k).unwrap();
    let dy = be.alloc_zeros::<f32>(t * n).unwrap();
    be.gemm_bf16(dw.ptr(), hi.ptr(), Some(lo.ptr()), dy.ptr(), t, n, k, false).unwrap();
    let y = be.read_vec(dy.ptr()).unwrap();
    let want: Vec<f32> = (0..t)
        .flat_map(|ti| (0..n).map(|ni| dot(&w[ni * k..][..k], &x[ti * k..][..k])).collect::<Vec<_>>())
        .collect();
    let err = max_abs_diff(&y, &want);
    eprintln!("gemm split: max err {err:e}");
    assert!(err < 1e-4, "{err}");
    // hi only: bf16 activations, looser.
    be.gemm_bf16(dw.ptr(), hi.ptr(), None, dy.ptr(), t, n, k, false).unwrap();
    let y = be.read_vec(dy.ptr()).unwrap();
    let err = max_abs_diff(&y, &want);
    eprintln!("gemm hi only: max err {err:e}");
    assert!(err < 3e-2, "{err}");
}

#[test]
fn rmsnorm_matches_cpu() {
    let Some(be) = backend() else { return };
    let (rows, dim) = (5, 24);
    let x = rnd(rows * dim, 5);
    let w = rnd(dim, 6);
    let dx = be.upload(&x).unwrap();
    let dw = be.upload(&w).unwrap();
    be.rmsnorm(dx.ptr(), dw.ptr(), dx.ptr(), rows, dim, 1e-6).unwrap();
    let y = be.read_vec(dx.ptr()).unwrap();
    let mut want = Vec::new();
    for r in x.chunks(dim) {
        let inv = 1.0 / (r.iter().map(|v| v * v).sum::<f32>() / dim as f32 + 1e-6).sqrt();
        want.extend(r.iter().zip(&w).map(|(v, w)| v * inv * w));
    }
    assert!(max_abs_diff(&y, &want) < 1e-5);
}

#[test]
fn elementwise_kernels_match_cpu() {
    let Some(be) = backend() else { return };
    let (rows, dim) = (3, 10);
    let x = rnd(rows * dim, 7);
    let b = rnd(dim, 8);
    let dx = be.upload(&x).unwrap();
    let db = be.upload(&b).unwrap();
    be.add_bias_rows(dx.ptr(), db.ptr(), rows, dim).unwrap();
    let got = be.read_vec(dx.ptr()).unwrap();
    let want: Vec<f32> = x.iter().enumerate().map(|(i, v)| v + b[i % dim]).collect();
    assert!(max_abs_diff(&got, &want) < 1e-6, "add_bias_rows");

    be.clamp(dx.ptr(), rows * dim, 0.5).unwrap();
    let got = be.read_vec(dx.ptr()).unwrap();
    let want2: Vec<f32> = want.iter().map(|v| v.clamp(-0.5, 0.5)).collect();
    assert!(max_abs_diff(&got, &want2) < 1e-6, "clamp");

    let y = rnd(rows * dim, 9);
    let dy = be.upload(&y).unwrap();
    be.add(dx.ptr(), dy.ptr(), rows * dim).unwrap();
    let got = be.read_vec(dx.ptr()).unwrap();
    let want3: Vec<f32> = want2.iter().zip(&y).map(|(a, b)| a + b).collect();
    assert!(max_abs_diff(&got, &want3) < 1e-6, "add");

    let out = be.alloc_zeros::<f32>(rows * dim).unwrap();
    be.silu_mul(dx.ptr(), dy.ptr(), out.ptr(), rows * dim).unwrap();
    let got = be.read_vec(out.ptr()).unwrap();
    let want4: Vec<f32> = want3.iter().zip(&y).map(|(g, u)| silu(*g) * u).collect();
    assert!(max_abs_diff(&got, &want4) < 1e-6, "silu_mul");

    let gate = rnd(rows, 10);
    let dg = be.upload(&gate).unwrap();
    let acc = be.upload(&y).unwrap();
    be.add_sigmoid_scaled_rows(acc.ptr(), dx.ptr(), dg.ptr(), rows, dim).unwrap();
    let got = be.read_vec(acc.ptr()).unwrap();
    let want5: Vec<f32> = (0..rows * dim).map(|i| y[i] + want3[i] / (1.0 + (-gate[i / dim]).exp())).collect();
    assert!(max_abs_diff(&got, &want5) < 1e-6, "add_sigmoid_scaled_rows");

    let rows_idx = vec![2i32, 0];
    let di = be.upload(&rows_idx).unwrap();
    let g = be.alloc_zeros::<f32>(2 * dim).unwrap();
    be.gather_rows(dx.ptr(), di.ptr(), g.ptr(), 2, dim).unwrap();
    let got = be.read_vec(g.ptr()).unwrap();
    let want6: Vec<f32> = want3[2 * dim..3 * dim].iter().chain(&want3[..dim]).copied().collect();
    assert!(max_abs_diff(&got, &want6) < 1e-7, "gather_rows");
    let dst = be.upload(&y).unwrap();
    be.scatter_add_rows(g.ptr(), di.ptr(), dst.ptr(), 2, dim).unwrap();
    let got = be.read_vec(dst.ptr()).unwrap();
    let mut want7 = y.clone();
    for d in 0..dim {
        want7[2 * dim + d] += want6[d];
        want7[d] += want6[dim + d];
    }
    assert!(max_abs_diff(&got, &want7) < 1e-6, "scatter_add_rows");
}

fn rope_cpu(head: &mut [f32], pos: usize, theta: f32, interleaved: bool) {
    let d = head.len();
    let half = d / 2;
    for i in 0..half {
        let ang = pos as f64 / (theta as f64).powf(2.0 * i as f64 / d as f64);
        let (s, c) = (ang.sin() as f32, ang.cos() as f32);
        let (a, b) = if interleaved { (2 * i, 2 * i + 1) } else { (i, i + half) };
        let (x0, x1) = (head[a], head[b]);
        head[a] = x0 * c - x1 * s;
        head[b] = x1 * c + x0 * s;
    }
}

#[test]
fn rope_both_styles_match_cpu() {
    let Some(be) = backend() else { return };
    let (t, heads, hd, pos0) = (3, 2, 14, 5);
    for interleaved in [false, true] {
        let x = rnd(t * heads * hd, 11);
        let dx = be.upload(&x).unwrap();
        be.rope(dx.ptr(), t, heads, heads * hd, hd, hd, pos0, 10000.0, interleaved, None).unwrap();
        let got = be.read_vec(dx.ptr()).unwrap();
        let mut want = x.clone();
        for (r, row) in want.chunks_mut(heads * hd).enumerate() {
            for head in row.chunks_mut(hd) {
                rope_cpu(head, pos0 + r, 10000.0, interleaved);
            }
        }
        assert!(max_abs_diff(&got, &want) < 1e-5, "interleaved={interleaved}");
    }
}

#[test]
fn attention_causal_gqa_matches_cpu() {
    let Some(be) = backend() else { return };
    // small odd shapes, and Qwen3-like decode/prefill shapes (hd 128, long context)
    for (n_heads, n_kv, hd, pos0, t) in [
        (4, 2, 20, 6, 3),
        (8, 2, 128, 700, 1),
        (4, 4, 64, 37, 5),
        (2, 1, 256, 3, 1),
        (32, 4, 128, 0, 70),
        (32, 4, 128, 45, 19),
        (16, 2, 128, 0, 150),
        (8, 8, 64, 30, 41),
        (6, 1, 16, 2, 33),
        (4, 2, 64, 2100, 1),
        // Qwen3.5/3.6 gated attention: 256-dim heads through the tiled prefill kernel
        (16, 2, 256, 0, 40),
        (8, 1, 256, 300, 33),
    ] {
        let total = pos0 + t;
        let kv_dim = n_kv * hd;
        let q = rnd(t * n_heads * hd, 12);
        let kc = rnd(total * kv_dim, 13);
        let vc = rnd(total * kv_dim, 14);
        for window in [0usize, 4, 100] {
            let (dk, dv) =
                (be.upload(&ring_layout(&kc, kv_dim, window)), be.upload(&ring_layout(&vc, kv_dim, window)));
            let (dq, dk, dv) = (be.upload(&q).unwrap(), dk.unwrap(), dv.unwrap());
            let out = be.alloc_zeros::<f32>(t * n_heads * hd).unwrap();
            be.attention(dq.ptr(), dk.ptr(), dv.ptr(), out.ptr(), t, pos0, n_heads, n_kv, hd, window)
                .unwrap();
            let got = be.read_vec(out.ptr()).unwrap();
            // split-position version (decode path)
            let part =
                be.alloc_zeros::<f32>(CudaBackend::attention_split_scratch(t, n_heads, hd, total)).unwrap();
            let out2 = be.alloc_zeros::<f32>(t * n_heads * hd).unwrap();
            be.attention_split(
                dq.ptr(),
                dk.ptr(),
                dv.ptr(),
                out2.ptr(),
                part.ptr(),
                t,
                pos0,
                n_heads,
                n_kv,
                hd,
                window,
                None,
            )
            .unwrap();
            let got2 = be.read_vec(out2.ptr()).unwrap();
            // a prefill kernel's output: launched into a fresh buffer, read back
            let run = |launch: &dyn Fn(DPtr<f32>)| {
                let o = be.alloc_zeros::<f32>(t * n_heads * hd).unwrap();
                launch(o.ptr());
                be.read_vec(o.ptr()).unwrap()
            };
            let (q_, k_, v_) = (dq.ptr(), dk.ptr(), dv.ptr());
            // tiled prefill version (heads up to 256 dims)
            let got3 = CudaBackend::attention_tiled_fits(hd).then(|| {
                run(&|o| be.attention_tiled(q_, k_, v_, o, t, pos0, n_heads, n_kv, hd, window).unwrap())
            });
            // tensor-core prefill version (heads of a multiple of 16 up to 128 over f32 on sm_80+)
            let got4 = be.attention_mma_fits(hd, moe_lanes_kernels::KvType::F32).then(|| {
                run(&|o| be.attention_mma(q_, k_, v_, o, t, pos0, n_heads, n_kv, hd, window).unwrap())
            });
            let mut want = vec![0.0; t * n_heads * hd];
            for ti in 0..t {
                let pos = pos0 + ti;
                let first = if window > 0 { (pos + 1).saturating_sub(window) } else { 0 };
                for h in 0..n_heads {
                    let kvh = h / (n_heads / n_kv);
                    let qh = &q[(ti * n_heads + h) * hd..][..hd];
                    let scores: Vec<f32> = (first..=pos)
                        .map(|p| dot(qh, &kc[p * kv_dim + kvh * hd..][..hd]) / (hd as f32).sqrt())
                        .collect();
                    let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let e: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
                    let sum: f32 = e.iter().sum();
                    for (j, p) in (first..=pos).enumerate() {
                        for i in 0..hd {
                            want[(ti * n_heads + h) * hd + i] += e[j] / sum * vc[p * kv_dim + kvh * hd + i];
                        }
                    }
                }
            }
            let err = max_abs_diff(&got, &want);
            assert!(err < 1e-5, "hd={hd} pos0={pos0} t={t} window={window}: {err}");
            let err2 = max_abs_diff(&got2, &want);
            assert!(err2 < 1e-5, "split: hd={hd} pos0={pos0} t={t} window={window}: {err2}");
            if let Some(got3) = got3 {
                let err3 = max_abs_diff(&got3, &want);
                assert!(err3 < 1e-5, "tiled: hd={hd} pos0={pos0} t={t} window={window}: {err3}");
            }
            if let Some(got4) = got4 {
                let err4 = max_abs_diff(&got4, &want);
                assert!(err4 < 1e-5, "mma: hd={hd} pos0={pos0} t={t} window={window}: {err4}");
            }
        }
    }
}

/// Causal GQA attention on the CPU in f64 (the kernels' oracle): `t` query rows at `pos0..`
/// ([`attention_masked_cpu`] without sinks).
#[allow(clippy::too_many_arguments)]
fn attention_cpu(
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    t: usize,
    pos0: usize,
    n_heads: usize,
    n_kv: usize,
    hd: usize,
    window: usize,
) -> Vec<f32> {
    attention_masked_cpu((q, kc, vc), None, (t, pos0, n_heads, n_kv, hd, window))
}

/// Every attention kernel over an f16 KV cache: against the CPU over the same f16 values
/// (1e-5: the kernels widen each value to f32 exactly, so only the f32 summation differs; the
/// tensor-core prefill 2.5e-4, as it rounds the softmax weights to f16 for p . V), and
/// against the f32 cache's result within f16's rounding (2e-3 absolute on outputs of size ~1:
/// each key and value rounded to 11 significant bits, relative 2^-12 = 2.4e-4; the measured
/// worst case is printed). Long decode contexts take the split kernel's multi-chunk spans, also
/// with the position read from the device under a grid sized for more positions (the decode
/// graph's fixed grid).
#[test]
fn attention_f16_cache_matches_cpu() {
    use half::f16;
    use moe_lanes_kernels::cuda::ops::DevicePos;
    let Some(be) = backend() else { return };
    let mut worst_vs_f32 = 0f32;
    for (n_heads, n_kv, hd, pos0, t) in [
        (4, 2, 20, 6, 3),
        (8, 2, 128, 700, 1),
        (2, 1, 256, 3, 1),
        (32, 4, 128, 45, 19),
        (16, 2, 128, 0, 150),
        (32, 4, 128, 9000, 1),
        (8, 2, 128, 33000, 1),
        (4, 2, 64, 2100, 2),
        (32, 4, 128, 5000, 40),
        (8, 1, 64, 333, 77),
    ] {
        let total = pos0 + t;
        let kv_dim = n_kv * hd;
        let q = rnd(t * n_heads * hd, 21);
        let (kc, vc) = (rnd(total * kv_dim, 22), rnd(total * kv_dim, 23));
        let half_bits = |x: &[f32]| x.iter().map(|v| f16::from_f32(*v).to_bits()).collect::<Vec<u16>>();
        let widened = |x: &[f32]| x.iter().map(|v| f16::from_f32(*v).to_f32()).collect::<Vec<f32>>();
        let (kh, vh) = (widened(&kc), widened(&vc));
        let dq = be.upload(&q).unwrap();
        for window in [0usize, 100] {
            let ringed = |x: &[f32]| be.upload(&half_bits(&ring_layout(x, kv_dim, window))).unwrap();
            let (dk, dv) = (ringed(&kc), ringed(&vc));
            let (k16, v16) = (KvPtr::F16(dk.ptr()), KvPtr::F16(dv.ptr()));
            let want = attention_cpu(&q, &kh, &vh, t, pos0, n_heads, n_kv, hd, window);
            let want32 = attention_cpu(&q, &kc, &vc, t, pos0, n_heads, n_kv, hd, window);
            let run = |launch: &dyn Fn(DPtr<f32>)| {
                let o = be.alloc_zeros::<f32>(t * n_heads * hd).unwrap();
                launch(o.ptr());
                be.read_vec(o.ptr()).unwrap()
            };
            let what = format!("hd={hd} heads={n_heads}/{n_kv} pos0={pos0} t={t} window={window}");
            let mut outs = Vec::new();
            let visible = if window > 0 { window.min(total) } else { total };
            if visible <= moe_lanes_kernels::cuda::ops::ATTENTION_MAX_POSITIONS {
                let o = run(&|o| {
                    be.attention(dq.ptr(), k16, v16, o, t, pos0, n_heads, n_kv, hd, window).unwrap()
                });
                outs.push(("per-row", o));
            }
            let part =
                be.alloc_zeros::<f32>(CudaBackend::attention_split_scratch(t, n_heads, hd, total)).unwrap();
            let o = run(&|o| {
                be.attention_split(
                    dq.ptr(),
                    k16,
                    v16,
                    o,
                    part.ptr(),
                    t,
                    pos0,
                    n_heads,
                    n_kv,
                    hd,
                    window,
                    None,
                )
                .unwrap()
            });
            outs.push(("split", o));
            // the decode graph's form: position from the device, grid for 5000 more positions
            let max_positions = pos0 + 5000;
            let dpos = be.upload(&[pos0 as i32]).unwrap();
            let at = Some(DevicePos { pos: dpos.ptr(), max_positions });
            let part2 = be
                .alloc_zeros::<f32>(CudaBackend::attention_split_scratch(t, n_heads, hd, max_positions + t))
                .unwrap();
            let big = be.alloc_zeros::<u16>((max_positions + t) * kv_dim).unwrap();
            let bigv = be.alloc_zeros::<u16>((max_positions + t) * kv_dim).unwrap();
            be.copy(dk.ptr(), big.ptr().sub(0, dk.len())).unwrap();
            be.copy(dv.ptr(), bigv.ptr().sub(0, dv.len())).unwrap();
            let (kb, vb) = (KvPtr::F16(big.ptr()), KvPtr::F16(bigv.ptr()));
            let o = run(&|o| {
                be.attention_split(dq.ptr(), kb, vb, o, part2.ptr(), t, 0, n_heads, n_kv, hd, window, at)
                    .unwrap()
            });
            outs.push(("split, device position", o));
            if CudaBackend::attention_tiled_fits(hd) {
                let o = run(&|o| {
                    be.attention_tiled(dq.ptr(), k16, v16, o, t, pos0, n_heads, n_kv, hd, window).unwrap()
                });
                outs.push(("tiled", o));
            }
            if be.attention_mma_fits(hd, moe_lanes_kernels::KvType::F16) {
                let o = run(&|o| {
                    be.attention_mma(dq.ptr(), k16, v16, o, t, pos0, n_heads, n_kv, hd, window).unwrap()
                });
                outs.push(("mma", o));
            }
            for (kernel, got) in &outs {
                let err = max_abs_diff(got, &want);
                // the tensor-core prefill rounds each softmax weight to f16 for p . V: at most
                // 2^-12 of itself, so the output moves by at most 2^-12 x max |v| (values in -1..1)
                let bound = if *kernel == "mma" { 2.5e-4 } else { 1e-5 };
                assert!(err < bound, "{kernel} f16: {what}: {err} against the CPU over the f16 values");
                let err32 = max_abs_diff(got, &want32);
                assert!(err32 < 2e-3, "{kernel} f16: {what}: {err32} against the f32 cache's result");
                worst_vs_f32 = worst_vs_f32.max(err32);
            }
        }
    }
    eprintln!("f16 KV cache: worst |f16 - f32 cache| over the attention kernels {worst_vs_f32:e}");
}

/// `kv_store_rows` and the fused q/k norm + RoPE append write keys and values converted to the
/// cache's type (f16: round to nearest, as `half` does), at the call's position.
#[test]
fn kv_appends_convert_to_the_cache_type() {
    use half::f16;
    use moe_lanes_kernels::cuda::ops::KvAppend;
    let Some(be) = backend() else { return };
    let (t, nh, nkv, hd, pos0) = (3, 4, 2, 64, 5);
    let kvd = nkv * hd;
    let (k, v) = (rnd(t * kvd, 31), rnd(t * kvd, 32));
    let (dk, dv) = (be.upload(&k).unwrap(), be.upload(&v).unwrap());
    let (kc, vc) =
        (be.alloc_zeros::<u16>((pos0 + t) * kvd).unwrap(), be.alloc_zeros::<u16>((pos0 + t) * kvd).unwrap());
    be.kv_store_rows(dk.ptr(), dv.ptr(), KvPtr::F16(kc.ptr()), KvPtr::F16(vc.ptr()), t, pos0, kvd, 0)
        .unwrap();
    let bits = |x: &[f32]| x.iter().map(|v| f16::from_f32(*v).to_bits()).collect::<Vec<u16>>();
    let (gk, gv) = (be.read_vec(kc.ptr()).unwrap(), be.read_vec(vc.ptr()).unwrap());
    assert!(gk[..pos0 * kvd].iter().all(|b| *b == 0), "rows before pos0 untouched");
    assert_eq!(gk[pos0 * kvd..], bits(&k)[..], "keys");
    assert_eq!(gv[pos0 * kvd..], bits(&v)[..], "values");
    // the fused append: roped keys into an f16 cache equal the f32 cache's keys, rounded
    let q = rnd(t * nh * hd, 33);
    let mut caches = Vec::new();
    for half in [false, true] {
        let (dq, dk) = (be.upload(&q).unwrap(), be.upload(&k).unwrap());
        let (k32, v32) = (
            be.alloc_zeros::<f32>((pos0 + t) * kvd).unwrap(),
            be.alloc_zeros::<f32>((pos0 + t) * kvd).unwrap(),
        );
        let (k16, v16) = (
            be.alloc_zeros::<u16>((pos0 + t) * kvd).unwrap(),
            be.alloc_zeros::<u16>((pos0 + t) * kvd).unwrap(),
        );
        let (k_cache, v_cache) = if half {
            (KvPtr::F16(k16.ptr()), KvPtr::F16(v16.ptr()))
        } else {
            (KvPtr::F32(k32.ptr()), KvPtr::F32(v32.ptr()))
        };
        let append = KvAppend { pos: None, v: dv.ptr(), k_cache, v_cache, window: 0 };
        be.qk_norm_rope(
            dq.ptr(),
            dk.ptr(),
            None,
            t,
            nh,
            nkv,
            nh * hd,
            kvd,
            hd,
            hd,
            pos0,
            1e6,
            false,
            1e-6,
            Some(append),
            None,
        )
        .unwrap();
        if half {
            let widen = |b: Vec<u16>| b.into_iter().map(|x| f16::from_bits(x).to_f32()).collect::<Vec<f32>>();
            caches.push((widen(be.read_vec(k16.ptr()).unwrap()), widen(be.read_vec(v16.ptr()).unwrap())));
        } else {
            caches.push((be.read_vec(k32.ptr()).unwrap(), be.read_vec(v32.ptr()).unwrap()));
        }
    }
    let round = |x: &[f32]| x.iter().map(|v| f16::from_f32(*v).to_f32()).collect::<Vec<f32>>();
    assert_eq!(caches[1].0, round(&caches[0].0), "roped keys, rounded to f16");
    assert_eq!(caches[1].1, round(&caches[0].1), "values, rounded to f16");
    assert!(caches[0].0[pos0 * kvd..].iter().any(|x| *x != 0.0), "keys written at pos0");
}

/// A sliding-window layer's appends go through its mirrored ring: consecutive calls (the last
/// ones past twice the ring of 8 + `KV_RING_CHUNK_POSITIONS` positions) through `kv_store_rows`
/// and the fused q/k norm + RoPE append leave the ring exactly as `ring_layout` lays out a full
/// layer's cache of the same calls (f32 and q8_0 caches).
#[test]
fn window_appends_fill_the_mirrored_ring() {
    use moe_lanes_kernels::cuda::ops::KvAppend;
    use moe_lanes_kernels::kv::kv_ring_rows;
    use moe_lanes_kernels::KvType;
    let Some(be) = backend() else { return };
    let (nh, nkv, hd, window, total) = (4, 2, 64, 8, 1190);
    let kvd = nkv * hd;
    let calls: Vec<(usize, usize)> = (0..total).step_by(170).map(|p| (p, 170.min(total - p))).collect();
    for kv_type in [KvType::F32, KvType::Q8_0] {
        let mut got = Vec::new();
        for (fused, w) in [(false, 0), (false, window), (true, 0), (true, window)] {
            let rows = kv_ring_rows(w, total);
            let zeros = vec![0f32; rows * kvd];
            let ((kc, _), (vc, _)) = (typed_cache(be, kv_type, &zeros), typed_cache(be, kv_type, &zeros));
            let (k_cache, v_cache) = (typed_ptr(kv_type, &kc), typed_ptr(kv_type, &vc));
            for &(pos0, t) in &calls {
                let (k, v, q) =
                    (rnd(t * kvd, pos0 as u64), rnd(t * kvd, 7 + pos0 as u64), rnd(t * nh * hd, 9));
                let (dk, dv, dq) = (be.upload(&k).unwrap(), be.upload(&v).unwrap(), be.upload(&q).unwrap());
                if fused {
                    let append = KvAppend { pos: None, v: dv.ptr(), k_cache, v_cache, window: w };
                    let heads = (nh, nkv, nh * hd, kvd, hd, hd);
                    be.qk_norm_rope(
                        dq.ptr(),
                        dk.ptr(),
                        None,
                        t,
                        heads.0,
                        heads.1,
                        heads.2,
                        heads.3,
                        heads.4,
                        heads.5,
                        pos0,
                        1e4,
                        false,
                        1e-6,
                        Some(append),
                        None,
                    )
                    .unwrap();
                } else {
                    be.kv_store_rows(dk.ptr(), dv.ptr(), k_cache, v_cache, t, pos0, kvd, w).unwrap();
                }
            }
            got.push((be.read_vec(kc.ptr()).unwrap(), be.read_vec(vc.ptr()).unwrap()));
        }
        let row_bytes = kv_type.bytes_of(kvd as u64) as usize;
        for (full, ring, what) in [(0, 1, "kv_store_rows"), (2, 3, "fused append")] {
            for (side, (a, b)) in
                [("keys", (&got[full].0, &got[ring].0)), ("values", (&got[full].1, &got[ring].1))]
            {
                assert_eq!(&ring_layout(a, row_bytes, window), b, "{kv_type} {what} {side}");
            }
        }
    }
}

/// A cache of `t` on the device (its bytes as `KvRows` holds them), and the values it holds.
/// `x` (`[positions, kv_dim]`, position-major) as a sliding-window layer's cache holds it: its
/// mirrored ring of `kv_ring_rows(window, positions)` rows, position p at row p % R and, from
/// p >= R on, at p % R + R too (`kv_ring_positions`); unchanged for a full layer (window 0).
fn ring_layout<T: Copy + Default>(x: &[T], kv_dim: usize, window: usize) -> Vec<T> {
    use moe_lanes_kernels::kv::{kv_ring_positions, kv_ring_rows};
    let (positions, ring) = (x.len() / kv_dim, kv_ring_positions(window));
    if ring == 0 {
        return x.to_vec();
    }
    let mut out = vec![T::default(); kv_ring_rows(window, positions) * kv_dim];
    for (p, row) in x.chunks(kv_dim).enumerate() {
        out[(p % ring) * kv_dim..][..kv_dim].copy_from_slice(row);
        if p >= ring {
            out[(p % ring + ring) * kv_dim..][..kv_dim].copy_from_slice(row);
        }
    }
    out
}

fn typed_cache(
    be: &CudaBackend,
    t: moe_lanes_kernels::KvType,
    values: &[f32],
) -> (moe_lanes_kernels::cuda::DeviceBuffer<u8>, Vec<f32>) {
    use moe_lanes_kernels::KvRows;
    let rows = KvRows::converted(t, values).unwrap();
    let bytes: Vec<u8> = match &rows {
        KvRows::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        KvRows::F16(v) | KvRows::Bf16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        KvRows::Q8_0(b) => b.clone(),
    };
    (be.upload(&bytes).unwrap(), rows.to_f32_vec())
}

/// The device pointer of a typed cache's bytes.
fn typed_ptr(t: moe_lanes_kernels::KvType, d: &moe_lanes_kernels::cuda::DeviceBuffer<u8>) -> KvPtr {
    use moe_lanes_kernels::KvType;
    let p = d.ptr();
    match t {
        KvType::F16 => KvPtr::F16(p.as_u16()),
        KvType::Bf16 => KvPtr::Bf16(p.as_u16()),
        KvType::Q8_0 => KvPtr::Q8_0(p),
        KvType::F32 => KvPtr::F32(p.as_f32()),
    }
}

/// Every attention kernel over bf16 and q8_0 caches (the one code path per kernel, its load
/// templated on the type): against the CPU over the values the cache holds (1e-5: each value is
/// widened to f32 exactly, only the summation differs), and against the f32 cache's result
/// within the type's rounding (bf16: 8 significant bits, 1e-2 absolute on outputs of size ~1;
/// q8_0: a block's step is max|x| / 127, 2e-2). Decode contexts long enough for multi-chunk
/// spans, the grouped decode kernel (8 heads per kv head, hd 128), prefill tiles and mma.
#[test]
fn attention_bf16_and_q8_0_caches_match_cpu() {
    use moe_lanes_kernels::KvType;
    let Some(be) = backend() else { return };
    for (n_heads, n_kv, hd, pos0, t) in [
        (8, 2, 128, 700, 1),
        (16, 2, 128, 3000, 1),
        (32, 4, 128, 45, 19),
        (16, 2, 64, 0, 150),
        (4, 2, 256, 3, 2),
    ] {
        let total = pos0 + t;
        let kv_dim = n_kv * hd;
        let q = rnd(t * n_heads * hd, 41);
        let (kc, vc) = (rnd(total * kv_dim, 42), rnd(total * kv_dim, 43));
        let dq = be.upload(&q).unwrap();
        for (kv_type, bound) in [(KvType::Bf16, 1e-2f32), (KvType::Q8_0, 2e-2)] {
            let ((_, kh), (_, vh)) = (typed_cache(be, kv_type, &kc), typed_cache(be, kv_type, &vc));
            let mut worst = 0f32;
            for window in [0usize, 100] {
                let ringed = |x: &[f32]| typed_cache(be, kv_type, &ring_layout(x, kv_dim, window)).0;
                let (dk, dv) = (ringed(&kc), ringed(&vc));
                let (kp, vp) = (typed_ptr(kv_type, &dk), typed_ptr(kv_type, &dv));
                let want = attention_cpu(&q, &kh, &vh, t, pos0, n_heads, n_kv, hd, window);
                let want32 = attention_cpu(&q, &kc, &vc, t, pos0, n_heads, n_kv, hd, window);
                let run = |launch: &dyn Fn(DPtr<f32>)| {
                    let o = be.alloc_zeros::<f32>(t * n_heads * hd).unwrap();
                    launch(o.ptr());
                    be.read_vec(o.ptr()).unwrap()
                };
                let mut outs = Vec::new();
                let visible = if window > 0 { window.min(total) } else { total };
                if visible <= moe_lanes_kernels::cuda::ops::ATTENTION_MAX_POSITIONS {
                    let o = run(&|o| {
                        be.attention(dq.ptr(), kp, vp, o, t, pos0, n_heads, n_kv, hd, window).unwrap()
                    });
                    outs.push(("per-row", o));
                }
                let part = be
                    .alloc_zeros::<f32>(CudaBackend::attention_split_scratch(t, n_heads, hd, total))
                    .unwrap();
                let o = run(&|o| {
                    be.attention_split(
                        dq.ptr(),
                        kp,
                        vp,
                        o,
                        part.ptr(),
                        t,
                        pos0,
                        n_heads,
                        n_kv,
                        hd,
                        window,
                        None,
                    )
                    .unwrap()
                });
                outs.push(("split", o));
                if CudaBackend::attention_tiled_fits(hd) {
                    let o = run(&|o| {
                        be.attention_tiled(dq.ptr(), kp, vp, o, t, pos0, n_heads, n_kv, hd, window).unwrap()
                    });
                    outs.push(("tiled", o));
                }
                if be.attention_mma_fits(hd, kv_type) {
                    let o = run(&|o| {
                        be.attention_mma(dq.ptr(), kp, vp, o, t, pos0, n_heads, n_kv, hd, window).unwrap()
                    });
                    outs.push(("mma", o));
                }
                let what = format!("hd={hd} heads={n_heads}/{n_kv} pos0={pos0} t={t} window={window}");
                for (kernel, got) in &outs {
                    // mma stages each value as bf16 hi + lo: a q8_0 value (f16 scale x int8) keeps
                    // 16 of its up to 18 significant bits there.
                    let exact = if *kernel == "mma" && kv_type == KvType::Q8_0 { 1e-4 } else { 1e-5 };
                    let err = max_abs_diff(got, &want);
                    assert!(
                        err < exact,
                        "{kernel} {kv_type}: {what}: {err} against the CPU over the cache's values"
                    );
                    let err32 = max_abs_diff(got, &want32);
                    assert!(
                        err32 < bound,
                        "{kernel} {kv_type}: {what}: {err32} against the f32 cache's result"
                    );
                    worst = worst.max(err32);
                }
            }
            eprintln!("{kv_type} KV cache, {n_heads}/{n_kv} heads of {hd}, pos0 {pos0}: worst |typed - f32 cache| {worst:e}");
        }
    }
}

/// `kv_store_rows` and the fused q/k norm + RoPE append into bf16 and q8_0 caches: the bytes
/// `KvRows` writes for the same rows (bf16: round to nearest even; q8_0: llama.cpp's block
/// quantization, the scale d = max|x| / 127 as f16), at the call's position; the fused append's
/// rows are the f32 path's rows so converted.
#[test]
fn kv_appends_quantize_to_bf16_and_q8_0() {
    use moe_lanes_kernels::cuda::ops::KvAppend;
    use moe_lanes_kernels::{KvRows, KvType};
    let Some(be) = backend() else { return };
    let (t, nh, nkv, hd, pos0) = (3, 4, 2, 64, 5);
    let kvd = nkv * hd;
    let (k, v) = (rnd(t * kvd, 51), rnd(t * kvd, 52));
    let q = rnd(t * nh * hd, 53);
    // The f32 path's roped keys and values, the reference rows.
    let fused = |k_cache: KvPtr, v_cache: KvPtr| {
        let (dq, dk, dv) = (be.upload(&q).unwrap(), be.upload(&k).unwrap(), be.upload(&v).unwrap());
        let append = KvAppend { pos: None, v: dv.ptr(), k_cache, v_cache, window: 0 };
        be.qk_norm_rope(
            dq.ptr(),
            dk.ptr(),
            None,
            t,
            nh,
            nkv,
            nh * hd,
            kvd,
            hd,
            hd,
            pos0,
            1e6,
            false,
            1e-6,
            Some(append),
            None,
        )
        .unwrap();
    };
    let (k32, v32) =
        (be.alloc_zeros::<f32>((pos0 + t) * kvd).unwrap(), be.alloc_zeros::<f32>((pos0 + t) * kvd).unwrap());
    fused(KvPtr::F32(k32.ptr()), KvPtr::F32(v32.ptr()));
    let (rk, rv) = (be.read_vec(k32.ptr()).unwrap(), be.read_vec(v32.ptr()).unwrap());
    for kv_type in [KvType::Bf16, KvType::Q8_0] {
        let bytes = kv_type.bytes_of(((pos0 + t) * kvd) as u64) as usize;
        let expect = |rows: &[f32]| {
            let mut all = vec![0.0f32; pos0 * kvd];
            all.extend_from_slice(rows);
            KvRows::converted(kv_type, &all).unwrap()
        };
        let read =
            |d: &moe_lanes_kernels::cuda::DeviceBuffer<u8>| -> Vec<u8> { be.read_vec(d.ptr()).unwrap() };
        let as_bytes = |r: KvRows| -> Vec<u8> {
            match r {
                KvRows::Bf16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                KvRows::Q8_0(b) => b,
                _ => unreachable!(),
            }
        };
        let (kc, vc) = (be.alloc_zeros::<u8>(bytes).unwrap(), be.alloc_zeros::<u8>(bytes).unwrap());
        let (dk, dv) = (be.upload(&k).unwrap(), be.upload(&v).unwrap());
        be.kv_store_rows(
            dk.ptr(),
            dv.ptr(),
            typed_ptr(kv_type, &kc),
            typed_ptr(kv_type, &vc),
            t,
            pos0,
            kvd,
            0,
        )
        .unwrap();
        assert_eq!(read(&kc), as_bytes(expect(&k)), "{kv_type}: kv_store_rows keys");
        assert_eq!(read(&vc), as_bytes(expect(&v)), "{kv_type}: kv_store_rows values");
        let (kc, vc) = (be.alloc_zeros::<u8>(bytes).unwrap(), be.alloc_zeros::<u8>(bytes).unwrap());
        fused(typed_ptr(kv_type, &kc), typed_ptr(kv_type, &vc));
        assert_eq!(read(&kc), as_bytes(expect(&rk[pos0 * kvd..])), "{kv_type}: fused append, roped keys");
        assert_eq!(read(&vc), as_bytes(expect(&rv[pos0 * kvd..])), "{kv_type}: fused append, values");
    }
}

/// A q8_0 cache whose heads split blocks is refused by the launchers, not misread.
#[test]
fn q8_0_caches_need_whole_blocks() {
    let Some(be) = backend() else { return };
    let (n_heads, n_kv, hd, t) = (2, 1, 48, 1);
    let q = be.alloc_zeros::<f32>(t * n_heads * hd).unwrap();
    let c = be.alloc_zeros::<u8>(34 * 8).unwrap();
    let o = be.alloc_zeros::<f32>(t * n_heads * hd).unwrap();
    let (kp, vp) = (KvPtr::Q8_0(c.ptr()), KvPtr::Q8_0(c.ptr()));
    let err = be.attention(q.ptr(), kp, vp, o.ptr(), t, 0, n_heads, n_kv, hd, 0).unwrap_err().to_string();
    assert!(err.contains("blocks of 32"), "{err}");
    let err =
        be.attention(q.ptr(), kp, KvPtr::F32(o.ptr()), o.ptr(), t, 0, n_heads, n_kv, 32, 0).unwrap_err();
    assert!(err.to_string().contains("differ in type"), "{err}");
}

#[test]
fn argmax_and_embed_match_cpu() {
    let Some(be) = backend() else { return };
    for (rows, n) in [(3usize, 1000usize), (2, 151936)] {
        let mut x = rnd(rows * n, 15);
        x[n + 17] = 5.0;
        x[n + 900] = 5.0; // tie: first wins
        x[n - 1] = 6.0; // row 0: the last element
        let dx = be.upload(&x).unwrap();
        let out = be.alloc_zeros::<i32>(rows).unwrap();
        be.argmax(dx.ptr(), rows, n, out.ptr()).unwrap();
        let got = be.read_vec(out.ptr()).unwrap();
        let part = be.alloc_zeros::<f32>(CudaBackend::argmax_split_scratch(rows)).unwrap();
        let out2 = be.alloc_zeros::<i32>(rows).unwrap();
        be.argmax_split(dx.ptr(), rows, n, out2.ptr(), part.ptr()).unwrap();
        assert_eq!(be.read_vec(out2.ptr()).unwrap(), got, "argmax_split vs argmax n={n}");
        for r in 0..rows {
            let row = &x[r * n..][..n];
            let mut best = 0;
            for (i, v) in row.iter().enumerate() {
                if *v > row[best] {
                    best = i;
                }
            }
            assert_eq!(got[r] as usize, best, "n {n} row {r}");
        }
    }
    // fewer values than blocks (empty slices), ties across slices, NaNs and an all -inf row
    let n = 50;
    let mut x = rnd(2 * n, 17);
    x[3] = f32::NAN;
    x[10] = 2.0;
    x[40] = 2.0;
    x[n..].fill(f32::NEG_INFINITY);
    let dx = be.upload(&x).unwrap();
    let part = be.alloc_zeros::<f32>(CudaBackend::argmax_split_scratch(2)).unwrap();
    let out = be.alloc_zeros::<i32>(2).unwrap();
    be.argmax_split(dx.ptr(), 2, n, out.ptr(), part.ptr()).unwrap();
    assert_eq!(be.read_vec(out.ptr()).unwrap(), vec![10, 0]);
    let (vocab, hidden) = (11, 6);
    let (tb, table) = to_bf16(&rnd(vocab * hidden, 16));
    let dt = be.upload(&tb).unwrap();
    let toks = vec![3i32, 0, 10];
    let dtok = be.upload(&toks).unwrap();
    let e = be.alloc_zeros::<f32>(3 * hidden).unwrap();
    be.embed(dt.ptr(), dtok.ptr(), e.ptr(), 3, hidden).unwrap();
    let got = be.read_vec(e.ptr()).unwrap();
    let want: Vec<f32> = toks.iter().flat_map(|&t| table[t as usize * hidden..][..hidden].to_vec()).collect();
    assert_eq!(got, want);
}

#[test]
fn gather_split_bf16_reconstructs() {
    let Some(be) = backend() else { return };
    let (rows, dim) = (4, 9);
    let x = rnd(rows * dim, 17);
    let dx = be.upload(&x).unwrap();
    let idx = be.upload(&[3i32, 1]).unwrap();
    let hi = be.alloc_zeros::<u16>(2 * dim).unwrap();
    let lo = be.alloc_zeros::<u16>(2 * dim).unwrap();
    be.gather_split_bf16(dx.ptr(), Some(idx.ptr()), hi.ptr(), Some(lo.ptr()), 2, dim).unwrap();
    let (h, l) = (be.read_vec(hi.ptr()).unwrap(), be.read_vec(lo.ptr()).unwrap());
    for (j, &r) in [3usize, 1].iter().enumerate() {
        for d in 0..dim {
            let v = bf16::from_bits(h[j * dim + d]).to_f32() + bf16::from_bits(l[j * dim + d]).to_f32();
            let want = x[r * dim + d];
            assert!((v - want).abs() <= want.abs() * 1e-4 + 1e-7, "{v} vs {want}");
            assert_eq!(h[j * dim + d], bf16::from_f32(want).to_bits());
        }
    }
}

fn route_cpu(l: &[f32], k: usize, variant: RouteVariant, norm: bool) -> Vec<(usize, f32)> {
    let mut order: Vec<usize> = (0..l.len()).collect();
    order.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
    let top = &order[..k];
    let m = l[top[0]];
    match variant {
        RouteVariant::SoftmaxThenTopK => {
            let sum: f32 = l.iter().map(|v| (v - m).exp()).sum();
            let mut c: Vec<(usize, f32)> = top.iter().map(|&e| (e, (l[e] - m).exp() / sum)).collect();
            if norm {
                let s: f32 = c.iter().map(|x| x.1).sum();
                c.iter_mut().for_each(|x| x.1 /= s);
            }
            c
        }
        RouteVariant::TopKThenSoftmax => {
            let sum: f32 = top.iter().map(|&e| (l[e] - m).exp()).sum();
            top.iter().map(|&e| (e, (l[e] - m).exp() / sum)).collect()
        }
    }
}

#[test]
fn route_topk_matches_cpu() {
    let Some(be) = backend() else { return };
    for (t, e, k) in [(70usize, 10usize, 3usize), (19, 128, 8), (9, 40, 40), (3, 64, 1)] {
        let mut l = rnd(t * e, 18);
        l[5] = l[7]; // a tie: lower id first
        l[e + 3] = l[e + 60 % e]; // another (or the same element)
        let dl = be.upload(&l).unwrap();
        let ids = be.alloc_zeros::<i32>(t * k).unwrap();
        let w = be.alloc_zeros::<f32>(t * k).unwrap();
        for (variant, norm) in [
            (RouteVariant::SoftmaxThenTopK, true),
            (RouteVariant::SoftmaxThenTopK, false),
            (RouteVariant::TopKThenSoftmax, false),
        ] {
            be.route_topk(dl.ptr(), t, e, k, variant, norm, ids.ptr(), w.ptr()).unwrap();
            let (gi, gw) = (be.read_vec(ids.ptr()).unwrap(), be.read_vec(w.ptr()).unwrap());
            for ti in 0..t {
                let want = route_cpu(&l[ti * e..][..e], k, variant, norm);
                for j in 0..k {
                    assert_eq!(gi[ti * k + j] as usize, want[j].0, "{variant:?} token {ti}");
                    assert!((gw[ti * k + j] - want[j].1).abs() < 1e-6, "E {e} k {k} token {ti} slot {j}");
                }
            }
        }
    }
}

/// The fused decode routing gives the bits of rmsnorm, gemv_bf16, route_topk and
/// hot_worklist_tokens in turn (for the normed rows, the logits, the top-k and the worklist),
/// and leaves its per-row counter at zero so the next call (or a graph replay) starts clean.
#[test]
fn route_decode_matches_unfused_bit_for_bit() {
    use moe_lanes_kernels::cuda::ops::{HotWorklist, NormRows};
    let Some(be) = backend() else { return };
    // The last case's router rows are all one row but two (scaled by -1 and 2): most logits tie
    // exactly, and ties go to the lower id in both.
    for (t, h, e, k) in [
        (1usize, 2048usize, 128usize, 8usize),
        (3, 200, 10, 3),
        (2, 64, 60, 60),
        (2, 256, 16, 5),
        (1, 4104, 24, 4),
    ] {
        let x = rnd(t * h, 40);
        let nw: Vec<f32> = rnd(h, 41).iter().map(|v| 1.0 + 0.5 * v).collect();
        let mut router = rnd(e * h, 42);
        if e == 16 {
            let row: Vec<f32> = router[..h].to_vec();
            for (j, r) in router.chunks_mut(h).enumerate() {
                let scale = [(3, -1.0), (7, 2.0)].iter().find(|(i, _)| *i == j).map_or(1.0, |(_, s)| *s);
                r.iter_mut().zip(&row).for_each(|(v, w)| *v = scale * w);
            }
        }
        let (rb, _) = to_bf16(&router);
        let mut map = vec![-1i32; e];
        for (j, m) in map.iter_mut().enumerate().filter(|(j, _)| j % 3 != 1) {
            *m = (j / 2) as i32;
        }
        let (dx, dnw, dr, dm) = (
            be.upload(&x).unwrap(),
            be.upload(&nw).unwrap(),
            be.upload(&rb).unwrap(),
            be.upload(&map).unwrap(),
        );
        let bufs = |n: usize| (be.alloc_zeros::<f32>(n).unwrap(), be.alloc_zeros::<f32>(n).unwrap());
        let (normed_a, normed_b) = bufs(t * h);
        let (logit_a, logit_b) = bufs(t * e);
        let (w_a, w_b) = bufs(t * k);
        let ints = |n: usize| (be.alloc_zeros::<i32>(n).unwrap(), be.alloc_zeros::<i32>(n).unwrap());
        let (ids_a, ids_b) = ints(t * k);
        let (sl_a, sl_b) = ints(t * k);
        let (tk_a, tk_b) = ints(t * k);
        let (off_a, off_b) = ints(t + 1);
        let (rows_a, rows_b) = ints(t);
        let counter = be.alloc_zeros::<u32>(t).unwrap();
        for (variant, norm) in [(RouteVariant::SoftmaxThenTopK, true), (RouteVariant::TopKThenSoftmax, false)]
        {
            be.rmsnorm(dx.ptr(), dnw.ptr(), normed_a.ptr(), t, h, 1e-6).unwrap();
            be.gemv_bf16(dr.ptr(), normed_a.ptr(), logit_a.ptr(), t, e, h, false).unwrap();
            be.route_topk(logit_a.ptr(), t, e, k, variant, norm, ids_a.ptr(), w_a.ptr()).unwrap();
            be.hot_worklist_tokens(
                dm.ptr(),
                ids_a.ptr(),
                t,
                k,
                e,
                sl_a.ptr(),
                tk_a.ptr(),
                off_a.ptr(),
                rows_a.ptr(),
            )
            .unwrap();
            let rows = NormRows {
                x: dx.ptr(),
                weight: dnw.ptr(),
                normed: normed_b.ptr(),
                n_rows: t,
                dim: h,
                eps: 1e-6,
            };
            let wl = HotWorklist {
                map: dm.ptr(),
                slots: sl_b.ptr(),
                tokens: tk_b.ptr(),
                tok_off: off_b.ptr(),
                tok_rows: rows_b.ptr(),
            };
            for _ in 0..2 {
                be.route_decode(
                    rows,
                    dr.ptr(),
                    e,
                    k,
                    variant,
                    norm,
                    logit_b.ptr(),
                    ids_b.ptr(),
                    w_b.ptr(),
                    counter.ptr(),
                    Some(wl),
                )
                .unwrap();
            }
            let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
            let read_f = |p: &moe_lanes_kernels::cuda::DeviceBuffer<f32>| bits(be.read_vec(p.ptr()).unwrap());
            let read_i = |p: &moe_lanes_kernels::cuda::DeviceBuffer<i32>| be.read_vec(p.ptr()).unwrap();
            let case = format!("t {t} h {h} e {e} k {k} {variant:?}");
            assert_eq!(read_f(&normed_a), read_f(&normed_b), "normed rows, {case}");
            assert_eq!(read_f(&logit_a), read_f(&logit_b), "logits, {case}");
            assert_eq!(read_i(&ids_a), read_i(&ids_b), "ids, {case}");
            assert_eq!(read_f(&w_a), read_f(&w_b), "weights, {case}");
            for (a, b, what) in
                [(&sl_a, &sl_b, "slots"), (&tk_a, &tk_b, "tokens"), (&off_a, &off_b, "tok_off")]
            {
                assert_eq!(read_i(a), read_i(b), "{what}, {case}");
            }
            assert_eq!(read_i(&rows_a), read_i(&rows_b), "tok_rows, {case}");
            assert_eq!(be.read_vec(counter.ptr()).unwrap(), vec![0u32; t], "counter reset, {case}");
        }
    }
    assert!(!CudaBackend::route_decode_fits(12 * 1024, 128), "a row past shared memory is refused");
}

/// The split one-token GEMV (several warps a row) against gemv_bf16, accumulating and not, an
/// odd row count; misaligned views are refused; the choice takes short matrices only.
#[test]
fn split_gemv_matches_the_row_gemv() {
    let Some(be) = backend() else { return };
    let (n, k) = (37usize, 4096usize + 8);
    let (wb, _) = to_bf16(&rnd(n * k, 61));
    let x = rnd(k + 4, 62);
    let (dw, dx) = (be.upload(&wb).unwrap(), be.upload(&x).unwrap());
    for accumulate in [false, true] {
        let y0 = rnd(n, 63);
        let (ya, yb) = (be.upload(&y0).unwrap(), be.upload(&y0).unwrap());
        be.gemv_bf16(dw.ptr(), dx.ptr(), ya.ptr(), 1, n, k, accumulate).unwrap();
        be.gemv_bf16_split(dw.ptr(), dx.ptr(), yb.ptr(), n, k, accumulate).unwrap();
        let (a, b) = (be.read_vec(ya.ptr()).unwrap(), be.read_vec(yb.ptr()).unwrap());
        let err = max_abs_diff(&a, &b);
        assert!(err < 1e-4, "split GEMV (accumulate {accumulate}): {err}");
    }
    assert!(be.gemv_bf16_split(dw.ptr(), dx.ptr().from(1), dx.ptr(), 1, k, false).is_err(), "x misaligned");
    assert!(
        be.gemv_bf16_split(dw.ptr(), dx.ptr(), dx.ptr(), 1, k - 4, false).is_err(),
        "k not a multiple of 8"
    );
    assert!(be.split_gemv_pays(dw.ptr(), dx.ptr(), n, k));
    assert!(!be.split_gemv_pays(dw.ptr(), dx.ptr(), 1 << 20, k), "tall matrices keep a warp a row");
    assert!(!be.split_gemv_pays(dw.ptr(), dx.ptr(), n, 256), "short rows keep a warp a row");
}

/// The decode down accumulation over more entries than a block has warps (two rounds), cold
/// entries among them, an odd hidden size (the last block half full) and vector-width rows:
/// against the scalar sum in entry order.
#[test]
fn hot_down_accum_takes_many_entries_and_odd_rows() {
    let Some(be) = backend() else { return };
    let (n_slots, ff, hidden) = (5usize, 64usize, 17usize);
    let (db, d) = to_bf16(&rnd(n_slots * hidden * ff, 31));
    let tok_off = vec![0i32, 11, 14];
    let slots: Vec<i32> = (0..14).map(|e| if e % 4 == 3 { -1 } else { (e % n_slots) as i32 }).collect();
    let weights: Vec<f32> = (0..14).map(|e| 0.1 + 0.05 * e as f32).collect();
    let tok_rows = vec![1i32, 0];
    let h = rnd(14 * ff, 32);
    let mut want = vec![0.5f32; 2 * hidden];
    for (i, w) in tok_off.windows(2).enumerate() {
        for r in 0..hidden {
            let mut acc = 0f32;
            for e in w[0] as usize..w[1] as usize {
                if slots[e] >= 0 {
                    let row = &d[(slots[e] as usize * hidden + r) * ff..][..ff];
                    acc += weights[e] * dot(row, &h[e * ff..][..ff]);
                }
            }
            want[tok_rows[i] as usize * hidden + r] += acc;
        }
    }
    let (dd, dh) = (be.upload(&db).unwrap(), be.upload(&h).unwrap());
    let (ds, dw) = (be.upload(&slots).unwrap(), be.upload(&weights).unwrap());
    let (doff, drows) = (be.upload(&tok_off).unwrap(), be.upload(&tok_rows).unwrap());
    let out = be.upload(&vec![0.5f32; 2 * hidden]).unwrap();
    be.moe_down_accum(
        dd.ptr(),
        dh.ptr(),
        ds.ptr(),
        dw.ptr(),
        doff.ptr(),
        drows.ptr(),
        out.ptr(),
        2,
        hidden,
        ff,
        None,
    )
    .unwrap();
    let err = max_abs_diff(&be.read_vec(out.ptr()).unwrap(), &want);
    assert!(err < 1e-4, "down accumulation over 11 entries: {err}");
}

/// Hot-lane kernels: gathered gate/up GEMV from a slot cache, then weighted down accumulation into
/// token rows; and the prefill path (grouped cuBLAS GEMMs + scatter), both against scalar FFNs.
#[test]
fn hot_expert_kernels_match_cpu() {
    let Some(be) = backend() else { return };
    let (n_slots, ff, hidden, t) = (3, 20, 16, 2);
    let (gb, g) = to_bf16(&rnd(n_slots * ff * hidden, 19));
    let (ub, u) = to_bf16(&rnd(n_slots * ff * hidden, 20));
    let (db, d) = to_bf16(&rnd(n_slots * hidden * ff, 21));
    let x = rnd(t * hidden, 22);
    // token-major entries: token 0 -> slots 2, 0; token 1 -> slot 1
    let slots = vec![2i32, 0, 1];
    let toks = vec![0i32, 0, 1];
    let weights = vec![0.7f32, 0.2, 0.5];
    let tok_off = vec![0i32, 2, 3];
    let tok_rows = vec![0i32, 1];
    let ffn = |s: usize, xt: &[f32]| -> Vec<f32> {
        let h: Vec<f32> = (0..ff)
            .map(|r| {
                silu(dot(&g[(s * ff + r) * hidden..][..hidden], xt))
                    * dot(&u[(s * ff + r) * hidden..][..hidden], xt)
            })
            .collect();
        (0..hidden).map(|r| dot(&d[(s * hidden + r) * ff..][..ff], &h)).collect()
    };
    let mut want = vec![0.25f32; t * hidden];
    for e in 0..3 {
        let y = ffn(slots[e] as usize, &x[toks[e] as usize * hidden..][..hidden]);
        for c in 0..hidden {
            want[toks[e] as usize * hidden + c] += weights[e] * y[c];
        }
    }
    let (dg, du, dd) = (be.upload(&gb).unwrap(), be.upload(&ub).unwrap(), be.upload(&db).unwrap());
    let dx = be.upload(&x).unwrap();
    let (ds, dt, dw) = (be.upload(&slots).unwrap(), be.upload(&toks).unwrap(), be.upload(&weights).unwrap());
    let (doff, drows) = (be.upload(&tok_off).unwrap(), be.upload(&tok_rows).unwrap());
    let h = be.alloc_zeros::<f32>(3 * ff).unwrap();
    let out = be.upload(&vec![0.25f32; t * hidden]).unwrap();
    be.moe_gate_up_gemv(
        dg.ptr(),
        du.ptr(),
        dx.ptr(),
        ds.ptr(),
        dt.ptr(),
        h.ptr(),
        3,
        ff,
        hidden,
        &GateUpEpilogue::SILU,
    )
    .unwrap();
    be.moe_down_accum(
        dd.ptr(),
        h.ptr(),
        ds.ptr(),
        dw.ptr(),
        doff.ptr(),
        drows.ptr(),
        out.ptr(),
        2,
        hidden,
        ff,
        None,
    )
    .unwrap();
    let got = be.read_vec(out.ptr()).unwrap();
    let err = max_abs_diff(&got, &want);
    eprintln!("hot decode kernels: max err {err:e}");
    assert!(err < 1e-4, "decode {err}");

    // The same decode step from a worklist built on the GPU out of router ids (k = 2 per token):
    // experts 5, 3 | 4, 6 with map 5->2, 3->0, 4->1 and 6 cold: the cold entry is skipped and
    // everything else matches the host-built worklist above.
    let (k, n_exp) = (2usize, 8usize);
    let mut map = vec![-1i32; n_exp];
    map[5] = 2;
    map[3] = 0;
    map[4] = 1;
    let ids = vec![5i32, 3, 4, 6];
    let rw = vec![0.7f32, 0.2, 0.5, 0.9];
    let (dmap, dids, drw) = (be.upload(&map).unwrap(), be.upload(&ids).unwrap(), be.upload(&rw).unwrap());
    let ws = be.alloc_zeros::<i32>(t * k).unwrap();
    let wt = be.alloc_zeros::<i32>(t * k).unwrap();
    let woff = be.alloc_zeros::<i32>(t + 1).unwrap();
    let wrows = be.alloc_zeros::<i32>(t).unwrap();
    be.hot_worklist_tokens(dmap.ptr(), dids.ptr(), t, k, n_exp, ws.ptr(), wt.ptr(), woff.ptr(), wrows.ptr())
        .unwrap();
    assert_eq!(be.read_vec(ws.ptr()).unwrap(), vec![2, 0, 1, -1]);
    assert_eq!(be.read_vec(wt.ptr()).unwrap(), vec![0, 0, 1, 1]);
    assert_eq!(be.read_vec(woff.ptr()).unwrap(), vec![0, 2, 4]);
    assert_eq!(be.read_vec(wrows.ptr()).unwrap(), vec![0, 1]);
    let h2 = be.alloc_zeros::<f32>(t * k * ff).unwrap();
    let out2 = be.upload(&vec![0.25f32; t * hidden]).unwrap();
    be.moe_gate_up_gemv(
        dg.ptr(),
        du.ptr(),
        dx.ptr(),
        ws.ptr(),
        wt.ptr(),
        h2.ptr(),
        t * k,
        ff,
        hidden,
        &GateUpEpilogue::SILU,
    )
    .unwrap();
    be.moe_down_accum(
        dd.ptr(),
        h2.ptr(),
        ws.ptr(),
        drw.ptr(),
        woff.ptr(),
        wrows.ptr(),
        out2.ptr(),
        t,
        hidden,
        ff,
        None,
    )
    .unwrap();
    let got2 = be.read_vec(out2.ptr()).unwrap();
    let err2 = max_abs_diff(&got2, &want);
    assert!(err2 < 1e-4, "device worklist decode {err2}");
    // one token, k = 3, ids out of range map to -1 as well
    let ids1 = vec![7i32, 9, -1];
    let d1 = be.upload(&ids1).unwrap();
    let s1 = be.alloc_zeros::<i32>(3).unwrap();
    let t1 = be.alloc_zeros::<i32>(3).unwrap();
    let o1 = be.alloc_zeros::<i32>(2).unwrap();
    let r1 = be.alloc_zeros::<i32>(1).unwrap();
    let mut map1 = vec![-1i32; n_exp];
    map1[7] = 4;
    let dm1 = be.upload(&map1).unwrap();
    be.hot_worklist_tokens(dm1.ptr(), d1.ptr(), 1, 3, n_exp, s1.ptr(), t1.ptr(), o1.ptr(), r1.ptr()).unwrap();
    assert_eq!(be.read_vec(s1.ptr()).unwrap(), vec![4, -1, -1]);
    assert_eq!(be.read_vec(o1.ptr()).unwrap(), vec![0, 3]);

    // Prefill: expert-major entries (slot 0: e0 token 0; slot 1: e1 token 1; slot 2: e2 token 0).
    let em_slots = [0usize, 1, 2];
    let em_toks = vec![0i32, 1, 0];
    let em_w = vec![0.2f32, 0.5, 0.7];
    let dtoks = be.upload(&em_toks).unwrap();
    let dw2 = be.upload(&em_w).unwrap();
    let xh = be.alloc_zeros::<u16>(3 * hidden.max(ff)).unwrap();
    let xl = be.alloc_zeros::<u16>(3 * hidden.max(ff)).unwrap();
    be.gather_split_bf16(dx.ptr(), Some(dtoks.ptr()), xh.ptr(), Some(xl.ptr()), 3, hidden).unwrap();
    let gg = be.alloc_zeros::<f32>(3 * ff).unwrap();
    let uu = be.alloc_zeros::<f32>(3 * ff).unwrap();
    for (e, &s) in em_slots.iter().enumerate() {
        let xs = xh.ptr().sub(e * hidden, hidden);
        let xls = xl.ptr().sub(e * hidden, hidden);
        be.gemm_bf16(
            dg.ptr().sub(s * ff * hidden, ff * hidden),
            xs,
            Some(xls),
            gg.ptr().sub(e * ff, ff),
            1,
            ff,
            hidden,
            false,
        )
        .unwrap();
        be.gemm_bf16(
            du.ptr().sub(s * ff * hidden, ff * hidden),
            xs,
            Some(xls),
            uu.ptr().sub(e * ff, ff),
            1,
            ff,
            hidden,
            false,
        )
        .unwrap();
    }
    be.silu_mul(gg.ptr(), uu.ptr(), h.ptr(), 3 * ff).unwrap();
    be.gather_split_bf16(h.ptr(), None, xh.ptr(), Some(xl.ptr()), 3, ff).unwrap();
    let y = be.alloc_zeros::<f32>(3 * hidden).unwrap();
    for (e, &s) in em_slots.iter().enumerate() {
        be.gemm_bf16(
            dd.ptr().sub(s * hidden * ff, hidden * ff),
            xh.ptr().sub(e * ff, ff),
            Some(xl.ptr().sub(e * ff, ff)),
            y.ptr().sub(e * hidden, hidden),
            1,
            hidden,
            ff,
            false,
        )
        .unwrap();
    }
    // token 0 has entries 0 and 2; token 1 has entry 1.
    let entries = be.upload(&[0i32, 2, 1]).unwrap();
    let out2 = be.upload(&vec![0.25f32; t * hidden]).unwrap();
    be.moe_scatter_accum(y.ptr(), entries.ptr(), dw2.ptr(), doff.ptr(), drows.ptr(), out2.ptr(), 2, hidden)
        .unwrap();
    let got = be.read_vec(out2.ptr()).unwrap();
    let err = max_abs_diff(&got, &want);
    eprintln!("hot prefill kernels: max err {err:e}");
    assert!(err < 1e-4, "prefill {err}");
}

#[test]
fn pinned_async_round_trip_and_events() {
    let Some(be) = backend() else { return };
    let n = 1000;
    let x = rnd(n, 23);
    let d = be.upload(&x).unwrap();
    let mut p = be.alloc_pinned::<f32>(n).unwrap();
    let (a, b) = (be.event().unwrap(), be.event().unwrap());
    be.record(&a).unwrap();
    be.read_async(d.ptr(), &mut p, n).unwrap();
    be.record(&b).unwrap();
    b.synchronize().unwrap();
    assert_eq!(p.as_slice().unwrap(), &x[..]);
    assert!(a.elapsed_ms(&b).unwrap() >= 0.0);
    p.as_mut_slice().unwrap().iter_mut().for_each(|v| *v *= 2.0);
    let d2 = be.alloc_zeros::<f32>(n).unwrap();
    be.write_async(&p, n, d2.ptr()).unwrap();
    let back = be.read_vec(d2.ptr()).unwrap();
    assert_eq!(back, x.iter().map(|v| v * 2.0).collect::<Vec<_>>());
    // No synchronisation by the caller: the buffer's own fence makes host access wait.
    let m = 1 << 22;
    let big = rnd(m, 29);
    let d_big = be.upload(&big).unwrap();
    let mut p_big = be.alloc_pinned::<f32>(m).unwrap();
    be.read_async(d_big.ptr(), &mut p_big, m).unwrap();
    assert_eq!(p_big.as_slice().unwrap(), &big[..]);
}

#[test]
fn nvrtc_cubin_cache_hits_on_second_compile() {
    let Some(be) = backend() else { return };
    let dir = std::env::temp_dir().join(format!("moe-lanes-nvrtc-test-{}", std::process::id()));
    let config =
        moe_lanes_kernels::cuda::CudaConfig { nvrtc_cache_dir: Some(dir.clone()), ..Default::default() };
    let arch = be.info().arch();
    // a small program (the cache does not care what it holds): the kernels' own compile is the
    // backend's, from the packed cache on the GPU machine, and takes minutes where it is not
    let src = "extern \"C\" __global__ void bump(float* x) { x[threadIdx.x] += 1.f; }";
    let compile = || moe_lanes_kernels::cuda::compile_cached(src, "cache_test.cu", &arch, &config).unwrap();
    let ((a, first), (b, second)) = (compile(), compile());
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!("first: {first:?}\nsecond: {second:?}");
    assert!(!first.cache_hit, "fresh directory");
    assert!(second.cache_hit, "second compile comes from the cache");
    assert_eq!(a, b);
    assert!(first.cache_note.is_none(), "{:?}", first.cache_note);
}

/// Random bf16 matrices `[n, k]` for each of `ns` (seeds `seed`, `seed + 1`, ..) on the device,
/// and their values as f32.
fn bf16_matrices(
    be: &CudaBackend,
    ns: &[usize],
    k: usize,
    seed: u64,
) -> (Vec<moe_lanes_kernels::cuda::DeviceBuffer<u16>>, Vec<Vec<f32>>) {
    ns.iter()
        .enumerate()
        .map(|(j, &n)| {
            let (bits, back) = to_bf16(&rnd(n * k, seed + j as u64));
            (be.upload(&bits).unwrap(), back)
        })
        .unzip()
}

#[test]
fn gemv3_matches_three_gemvs() {
    let Some(be) = backend() else { return };
    let (t, k) = (2, 40);
    let ns = [24usize, 8, 13];
    let x = rnd(t * k, 41);
    let dx = be.upload(&x).unwrap();
    let (ws, backs) = bf16_matrices(be, &ns, k, 42);
    // overwritten, not accumulated
    let ys: Vec<_> =
        ns.iter().enumerate().map(|(j, &n)| be.upload(&rnd(t * n, 50 + j as u64)).unwrap()).collect();
    be.gemv3_bf16(
        [ws[0].ptr(), ws[1].ptr(), ws[2].ptr()],
        dx.ptr(),
        [ys[0].ptr(), ys[1].ptr(), ys[2].ptr()],
        ns,
        t,
        k,
    )
    .unwrap();
    for (j, &n) in ns.iter().enumerate() {
        let got = be.read_vec(ys[j].ptr()).unwrap();
        let want: Vec<f32> =
            (0..t * n).map(|i| dot(&backs[j][(i % n) * k..][..k], &x[(i / n) * k..][..k])).collect();
        assert!(max_abs_diff(&got, &want) < 1e-4, "output {j}");
        // bit-identical to the single GEMV kernel
        let single = be.alloc_zeros::<f32>(t * n).unwrap();
        be.gemv_bf16(ws[j].ptr(), dx.ptr(), single.ptr(), t, n, k, false).unwrap();
        assert_eq!(got, be.read_vec(single.ptr()).unwrap(), "output {j} vs gemv_bf16");
    }
}

/// The batched-decode tensor-core GEMV against f32 dots: q/k/v-like triples with row counts off
/// 16 (tails), a k of 10 slabs (not a multiple of the block's 8 warps), one to three 32-token
/// grid rows (tokens off 8), and one matrix accumulating into y.
#[test]
fn gemv_mma_matches_cpu_for_batched_rows() {
    let Some(be) = backend() else { return };
    let ns = [200usize, 24, 13];
    // k of 10 slabs (fewer than the warps), then 65 (several unrolled batches a warp, the last
    // one partial)
    for k in [320, 2080] {
        let (ws, backs) = bf16_matrices(be, &ns, k, 60);
        let want = |x: &[f32], j: usize, t: usize| -> Vec<f32> {
            (0..t * ns[j])
                .map(|i| dot(&backs[j][(i % ns[j]) * k..][..k], &x[(i / ns[j]) * k..][..k]))
                .collect()
        };
        for t in [2usize, 5, 8, 17, 32, 33, 64, 70] {
            let x = rnd(t * k, 70 + t as u64);
            let dx = be.upload(&x).unwrap();
            let (hi, lo) = (be.alloc_zeros::<u16>(t * k).unwrap(), be.alloc_zeros::<u16>(t * k).unwrap());
            be.gather_split_bf16(dx.ptr(), None, hi.ptr(), Some(lo.ptr()), t, k).unwrap();
            let ys: Vec<_> = ns.iter().map(|&n| be.upload(&rnd(t * n, 80 + n as u64)).unwrap()).collect();
            let (wp, yp): (Vec<_>, Vec<_>) = ws.iter().zip(&ys).map(|(w, y)| (w.ptr(), y.ptr())).unzip();
            // every block (16 rows on 8 warps or 16, 32 rows), then the launcher's choice; the
            // outputs NaN before, so each must be written
            use moe_lanes_kernels::cuda::ops::GemvMmaBlock;
            for block in
                [Some(GemvMmaBlock::Rows16), Some(GemvMmaBlock::Wide), Some(GemvMmaBlock::RowPairs), None]
            {
                for y in &ys {
                    be.write(&vec![f32::NAN; y.len()], y.ptr()).unwrap();
                }
                let xs = (hi.ptr(), lo.ptr());
                match block {
                    Some(b) => be.gemv_mma_bf16_blocks(b, &wp, xs, &yp, &ns, t, k, false).unwrap(),
                    None => be.gemv_mma_bf16(&wp, xs, &yp, &ns, t, k, false).unwrap(),
                }
                for (j, y) in ys.iter().enumerate() {
                    let got = be.read_vec(y.ptr()).unwrap();
                    assert!(got.iter().all(|v| v.is_finite()), "t {t} output {j} {block:?}: unwritten rows");
                    let err = max_abs_diff(&got, &want(&x, j, t));
                    assert!(err < 1e-4 * (k as f32).sqrt(), "t {t} output {j} {block:?}: {err:e}");
                }
            }
            // one matrix, accumulating
            let base = rnd(t * ns[0], 90);
            let y = be.upload(&base).unwrap();
            be.gemv_mma_bf16(&wp[..1], (hi.ptr(), lo.ptr()), &[y.ptr()], &ns[..1], t, k, true).unwrap();
            let acc: Vec<f32> = want(&x, 0, t).iter().zip(&base).map(|(w, b)| w + b).collect();
            let err = max_abs_diff(&be.read_vec(y.ptr()).unwrap(), &acc);
            assert!(err < 1e-4 * (k as f32).sqrt(), "t {t} accumulating: {err:e}");
        }
    }
    let (x, y) = (be.alloc_zeros::<u16>(2 * 40).unwrap(), be.alloc_zeros::<f32>(400).unwrap());
    let w = be.alloc_zeros::<u16>(400).unwrap();
    let err = be.gemv_mma_bf16(&[w.ptr()], (x.ptr(), x.ptr()), &[y.ptr()], &[10], 2, 40, false);
    assert!(err.is_err(), "k = 40 is not whole 32-column slabs");
}

#[test]
fn qk_norm_rope_matches_norm_then_rope() {
    let Some(be) = backend() else { return };
    let (t, nh, nkv, hd, pos0) = (3, 4, 2, 128, 37);
    let (qs, ks) = (nh * hd, nkv * hd + 8); // k rows with a stride larger than the heads
    for interleaved in [false, true] {
        for with_norm in [false, true] {
            let q = rnd(t * qs, 60);
            let k = rnd(t * ks, 61);
            let (qw, kw) = (rnd(hd, 62), rnd(hd, 63));
            let (dq, dk) = (be.upload(&q).unwrap(), be.upload(&k).unwrap());
            let (dqw, dkw) = (be.upload(&qw).unwrap(), be.upload(&kw).unwrap());
            let norm = with_norm.then(|| (dqw.ptr(), dkw.ptr()));
            be.qk_norm_rope(
                dq.ptr(),
                dk.ptr(),
                norm,
                t,
                nh,
                nkv,
                qs,
                ks,
                hd,
                hd,
                pos0,
                1e6,
                interleaved,
                1e-6,
                None,
                None,
            )
            .unwrap();
            let (gq, gk) = (be.read_vec(dq.ptr()).unwrap(), be.read_vec(dk.ptr()).unwrap());
            // reference: the separate kernels
            let (rq, rk) = (be.upload(&q).unwrap(), be.upload(&k).unwrap());
            for r in 0..t {
                if with_norm {
                    be.rmsnorm(
                        rq.ptr().sub(r * qs, nh * hd),
                        dqw.ptr(),
                        rq.ptr().sub(r * qs, nh * hd),
                        nh,
                        hd,
                        1e-6,
                    )
                    .unwrap();
                    be.rmsnorm(
                        rk.ptr().sub(r * ks, nkv * hd),
                        dkw.ptr(),
                        rk.ptr().sub(r * ks, nkv * hd),
                        nkv,
                        hd,
                        1e-6,
                    )
                    .unwrap();
                }
            }
            be.rope(rq.ptr(), t, nh, qs, hd, hd, pos0, 1e6, interleaved, None).unwrap();
            be.rope(rk.ptr(), t, nkv, ks, hd, hd, pos0, 1e6, interleaved, None).unwrap();
            assert_eq!(gq, be.read_vec(rq.ptr()).unwrap(), "q il={interleaved} norm={with_norm}");
            assert_eq!(gk, be.read_vec(rk.ptr()).unwrap(), "k il={interleaved} norm={with_norm}");
            // and the CPU
            let mut want = q.clone();
            for row in want.chunks_mut(qs) {
                for head in row.chunks_mut(hd) {
                    if with_norm {
                        let inv = 1.0 / (head.iter().map(|v| v * v).sum::<f32>() / hd as f32 + 1e-6).sqrt();
                        head.iter_mut().zip(&qw).for_each(|(v, w)| *v = *v * inv * w);
                    }
                }
            }
            for (r, row) in want.chunks_mut(qs).enumerate() {
                for head in row.chunks_mut(hd) {
                    rope_cpu(head, pos0 + r, 1e6, interleaved);
                }
            }
            assert!(max_abs_diff(&gq, &want) < 1e-4, "cpu q il={interleaved} norm={with_norm}");
        }
    }
}

/// Expert-major slots of the grouped-GEMM cases: runs of one slot, uneven, a slot with no rows
/// (slot 2 of 6), one longer than a tile (70 > 64 rows), a run of 1.
fn grouped_case_slots() -> Vec<u32> {
    [(3u32, 70usize), (0, 5), (4, 1), (1, 17), (5, 64)].iter().flat_map(|&(s, n)| vec![s; n]).collect()
}

/// `sum_i w_i x_i` in f64 and `sum_i |w_i x_i|`, the scale of its rounding error.
fn dot_and_scale(w: &[f32], x: &[f32]) -> (f64, f64) {
    w.iter().zip(x).fold((0.0, 0.0), |(d, a), (w, x)| {
        let p = *w as f64 * *x as f64;
        (d + p, a + p.abs())
    })
}

#[test]
fn grouped_tiles_cut_runs_into_tiles_of_one_slot() {
    use moe_lanes_kernels::cuda::ops::grouped_tiles;
    let slots = grouped_case_slots();
    let mut tiles = vec![0i32; 3 * slots.len()];
    let n = grouped_tiles(&slots, &mut tiles).unwrap();
    assert_eq!(GROUPED_TILE_ROWS, 64);
    let want = [[3, 0, 64], [3, 64, 6], [0, 70, 5], [4, 75, 1], [1, 76, 17], [5, 93, 64]];
    assert_eq!(n, want.len());
    for (t, w) in tiles.chunks(3).zip(want) {
        assert_eq!(t, w);
    }
    assert_eq!(grouped_tiles(&[], &mut []).unwrap(), 0);
    assert!(grouped_tiles(&slots, &mut tiles[..3 * 5]).is_err(), "too short a tile buffer is refused");
}

/// Grouped gate+up (+SiLU) and the grouped down GEMM against a plain CPU computation from the
/// same bf16 weights and f32 inputs, with split (hi + lo) activations and with hi only.
/// Tolerance per element, from the magnitude sum `A = sum |w_i x_i|`: split `A * 2^-15` (input
/// carried to ~2^-17, f32 accumulation); hi only `A * 2^-7` (bf16 inputs, 2^-9 relative).
/// Where the shapes allow the pipelined kernels (k a multiple of 8), they give the synchronous
/// kernels' bits: the same MMAs in the same order.
#[test]
fn grouped_expert_gemms_match_cpu() {
    let Some(be) = backend() else { return };
    use moe_lanes_kernels::cuda::ops::grouped_tiles;
    // (hidden, ff): not multiples of the tile or of 8 (scalar loads), then multiples of 8 that
    // are not multiples of the pipelined stage (a partial last stage), then the tile itself; the
    // last: the decode shape's register-direct down (ff whole 32-column slabs) over a hidden that
    // ends in half a 32-column block, after the pipelined gate/up
    for &(hidden, ff, n_slots, t) in &[
        (100usize, 70usize, 6usize, 9usize),
        (136, 200, 6, 31),
        (64, 64, 6, 1),
        (288, 96, 6, 13),
        (80, 64, 6, 5),
    ] {
        let slots = grouped_case_slots();
        let n_rows = slots.len();
        let (gb, g) = to_bf16(&rnd(n_slots * ff * hidden, 40));
        let (ub, u) = to_bf16(&rnd(n_slots * ff * hidden, 41));
        let (db, d) = to_bf16(&rnd(n_slots * hidden * ff, 42));
        let x = rnd(t * hidden, 43);
        let toks: Vec<i32> = (0..n_rows).map(|r| ((r * 7 + 3) % t) as i32).collect();
        let mut tiles = vec![0i32; 3 * n_rows];
        let n_tiles = grouped_tiles(&slots, &mut tiles).unwrap();
        let (dg, du, dd) = (be.upload(&gb).unwrap(), be.upload(&ub).unwrap(), be.upload(&db).unwrap());
        let (dx, dtok, dtiles) =
            (be.upload(&x).unwrap(), be.upload(&toks).unwrap(), be.upload(&tiles).unwrap());
        let dh = be.alloc_zeros::<f32>(n_rows * ff).unwrap();
        let dy = be.alloc_zeros::<f32>(n_rows * hidden).unwrap();
        // the same rows cut into the decode shape's tiles (16 rows at most)
        let dec = tiles_of_at_most(&tiles[..3 * n_tiles], GROUPED_DECODE_TILE_ROWS);
        let ddec = be.upload(&dec).unwrap();
        // gate/up into h, then down over that h (rows in order): both results read back
        let run = |split: bool, decode: bool| {
            let (tp, n_tiles, tile_rows) = match decode {
                false => (dtiles.ptr().sub(0, 3 * n_tiles), n_tiles, GROUPED_TILE_ROWS),
                true => (ddec.ptr(), dec.len() / 3, GROUPED_DECODE_TILE_ROWS),
            };
            let (g, u, d) = (dg.ptr(), du.ptr(), dd.ptr());
            be.grouped_gate_up(
                g,
                u,
                n_slots,
                dx.ptr(),
                dtok.ptr(),
                t,
                tp,
                n_tiles,
                tile_rows,
                dh.ptr(),
                n_rows,
                ff,
                hidden,
                split,
                &GateUpEpilogue::SILU,
            )
            .unwrap();
            be.grouped_gemm(
                d,
                n_slots,
                dh.ptr(),
                None,
                n_rows,
                tp,
                n_tiles,
                tile_rows,
                dy.ptr(),
                n_rows,
                hidden,
                ff,
                split,
                None,
            )
            .unwrap();
            (be.read_vec(dh.ptr()).unwrap(), be.read_vec(dy.ptr()).unwrap())
        };
        for split in [true, false] {
            let rel = if split { 2f64.powi(-15) } else { 2f64.powi(-7) };
            be.set_grouped_pipeline(false);
            let sync = run(split, false);
            be.set_grouped_pipeline(true);
            let (h, y) = run(split, false);
            // the decode shape: its own kernels where pipelined, else the synchronous ones
            let dec = run(split, true);
            let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
            if hidden % 8 == 0 && ff % 8 == 0 && be.grouped_pipeline() {
                assert!(
                    same(&h, &sync.0) && same(&y, &sync.1),
                    "pipelined ({hidden},{ff}) split={split}: bits differ"
                );
            }
            // the decode shape's register-direct kernels (k whole 32-column slabs: hidden for
            // gate/up, ff for the down) sum in another order, and a down after such a gate/up
            // reads other h bits: checked against the CPU below; the pipelined _dec kernels give
            // the bits
            let gate_rows = be.grouped_pipeline() && hidden % 32 == 0;
            let down_rows = be.grouped_pipeline() && ff % 32 == 0;
            let rows_kernels = gate_rows || down_rows;
            assert!(
                gate_rows || same(&h, &dec.0),
                "decode gate/up ({hidden},{ff}) split={split}: bits differ"
            );
            assert!(
                rows_kernels || same(&y, &dec.1),
                "decode down ({hidden},{ff}) split={split}: bits differ"
            );
            let mut worst = 0f64;
            let runs: &[(&[f32], &[f32])] =
                if rows_kernels { &[(&h, &y), (&dec.0, &dec.1)] } else { &[(&h, &y)] };
            for &(h, y) in runs {
                for r in 0..n_rows {
                    let (s, xt) = (slots[r] as usize, &x[toks[r] as usize * hidden..][..hidden]);
                    for c in 0..ff {
                        let (gv, ga) = dot_and_scale(&g[(s * ff + c) * hidden..][..hidden], xt);
                        let (uv, ua) = dot_and_scale(&u[(s * ff + c) * hidden..][..hidden], xt);
                        let sg = gv / (1.0 + (-gv).exp());
                        let want = sg * uv;
                        let tol =
                            1.1 * ga * rel * uv.abs() + sg.abs() * ua * rel + ga * ua * rel * rel + 1e-6;
                        let err = (h[r * ff + c] as f64 - want).abs();
                        assert!(
                            err <= tol,
                            "gate_up split={split} ({hidden},{ff}) row {r} col {c}: {err:e} > {tol:e}"
                        );
                        worst = worst.max(err / tol);
                    }
                }
                for r in 0..n_rows {
                    let s = slots[r] as usize;
                    for c in 0..hidden {
                        let (want, a) = dot_and_scale(&d[(s * hidden + c) * ff..][..ff], &h[r * ff..][..ff]);
                        let (err, tol) = ((y[r * hidden + c] as f64 - want).abs(), a * rel + 1e-6);
                        assert!(
                            err <= tol,
                            "down split={split} ({hidden},{ff}) row {r} col {c}: {err:e} > {tol:e}"
                        );
                        worst = worst.max(err / tol);
                    }
                }
            }
            eprintln!("grouped ({hidden},{ff}) t={t} split={split}: worst error / tolerance {worst:.3}");
        }
    }
}

/// The grouped GEMM with gathered rows, and a tile it must refuse (slot out of range, rows past
/// the end, more rows than a tile): refused tiles leave their output untouched.
#[test]
fn grouped_gemm_gathers_rows_and_skips_bad_tiles() {
    let Some(be) = backend() else { return };
    let (n_slots, n, k, n_x) = (2usize, 24usize, 40usize, 5usize);
    let (wb, w) = to_bf16(&rnd(n_slots * n * k, 50));
    let x = rnd(n_x * k, 51);
    let rows = vec![4i32, 0, 2, 2];
    // tile 0: slot 1, rows 0..3; bad: slot 2 (of 2), rows 3..4 past n_rows 4 at 3+2, 65 rows
    let tiles = vec![1i32, 0, 3, 2, 3, 1, 0, 3, 2, 0, 0, 65];
    let (dw, dx, dr, dt) = (
        be.upload(&wb).unwrap(),
        be.upload(&x).unwrap(),
        be.upload(&rows).unwrap(),
        be.upload(&tiles).unwrap(),
    );
    let sentinel = vec![7.5f32; 4 * n];
    let dy = be.upload(&sentinel).unwrap();
    be.grouped_gemm(
        dw.ptr(),
        n_slots,
        dx.ptr(),
        Some(dr.ptr()),
        n_x,
        dt.ptr(),
        4,
        GROUPED_TILE_ROWS,
        dy.ptr(),
        4,
        n,
        k,
        true,
        None,
    )
    .unwrap();
    let y = be.read_vec(dy.ptr()).unwrap();
    for r in 0..3 {
        for c in 0..n {
            let (want, a) = dot_and_scale(&w[(n + c) * k..][..k], &x[rows[r] as usize * k..][..k]);
            let err = (y[r * n + c] as f64 - want).abs();
            assert!(err <= a * 2f64.powi(-15) + 1e-6, "row {r} col {c}: {err:e}");
        }
    }
    assert!(y[3 * n..].iter().all(|&v| v == 7.5), "refused tiles wrote row 3");
    // shape checks: a tile buffer shorter than n_tiles, an output too small
    assert!(be
        .grouped_gemm(
            dw.ptr(),
            n_slots,
            dx.ptr(),
            Some(dr.ptr()),
            n_x,
            dt.ptr(),
            5,
            GROUPED_TILE_ROWS,
            dy.ptr(),
            4,
            n,
            k,
            true,
            None
        )
        .is_err());
    assert!(be
        .grouped_gemm(
            dw.ptr(),
            3,
            dx.ptr(),
            Some(dr.ptr()),
            n_x,
            dt.ptr(),
            4,
            64,
            dy.ptr(),
            4,
            n,
            k,
            true,
            None
        )
        .is_err());
    // tiles longer than any kernel's shape are refused by name
    assert!(be
        .grouped_gemm(
            dw.ptr(),
            3,
            dx.ptr(),
            Some(dr.ptr()),
            n_x,
            dt.ptr(),
            4,
            65,
            dy.ptr(),
            4,
            n,
            k,
            true,
            None
        )
        .is_err());
}

/// A freed address may come back for the next allocation (the stream-ordered allocator reuses
/// it); its serial never does, which is what a captured graph's key relies on.
#[test]
fn allocation_serials_differ_where_addresses_repeat() {
    let Some(be) = backend() else { return };
    let mut seen_addresses = Vec::new();
    let mut seen_serials = std::collections::HashSet::new();
    for _ in 0..8 {
        let b = be.alloc_zeros::<f32>(1 << 16).unwrap();
        seen_addresses.push(b.ptr().raw());
        assert!(seen_serials.insert(b.serial()), "serial {} handed out twice", b.serial());
    }
    let distinct: std::collections::HashSet<_> = seen_addresses.iter().collect();
    eprintln!("8 allocations, freed in turn, took {} distinct addresses", distinct.len());
}

/// Timing, not a check (`--ignored`): one decode token's split attention over a Qwen3-30B-A3B
/// layer (32 query heads, 4 kv heads of 128) at depths 8192 and 32768, f32 and f16 caches, the
/// grouped kernel and the per-head one (the GQA shape forced through a 4-head group), the mean
/// of 50 launches after 5 warm-ups.
#[test]
#[ignore]
fn attention_split_decode_timing() {
    use moe_lanes_kernels::cuda::ops::KvPtr;
    let Some(be) = backend() else { return };
    let (hd, n_kv) = (128usize, 4usize);
    for depth in [8192usize, 32768] {
        let kv_dim = n_kv * hd;
        for half in [false, true] {
            let k32 = be.alloc_zeros::<f32>((depth + 1) * kv_dim).unwrap();
            let v32 = be.alloc_zeros::<f32>((depth + 1) * kv_dim).unwrap();
            let k16 = be.alloc_zeros::<u16>((depth + 1) * kv_dim).unwrap();
            let v16 = be.alloc_zeros::<u16>((depth + 1) * kv_dim).unwrap();
            let (kc, vc) = if half {
                (KvPtr::F16(k16.ptr()), KvPtr::F16(v16.ptr()))
            } else {
                (KvPtr::F32(k32.ptr()), KvPtr::F32(v32.ptr()))
            };
            // 32 heads over 4 kv heads: grouped; 16 heads over 4: the per-head kernel (x2 for 32)
            for n_heads in [32usize, 16] {
                let q = be.upload(&rnd(n_heads * hd, 41)).unwrap();
                let out = be.alloc_zeros::<f32>(n_heads * hd).unwrap();
                let part = be
                    .alloc_zeros::<f32>(CudaBackend::attention_split_scratch(1, n_heads, hd, depth + 1))
                    .unwrap();
                let launch = || {
                    be.attention_split(
                        q.ptr(),
                        kc,
                        vc,
                        out.ptr(),
                        part.ptr(),
                        1,
                        depth,
                        n_heads,
                        n_kv,
                        hd,
                        0,
                        None,
                    )
                    .unwrap()
                };
                let us = mean_launch_us(be, 5, 50, launch);
                let grouped = CudaBackend::attention_split_grouped(n_heads, n_kv, hd);
                eprintln!(
                    "TIMING split attention depth {depth} {} heads {n_heads}/{n_kv} {}: {us:.1} us",
                    if half { "f16" } else { "f32" },
                    if grouped { "grouped" } else { "per-head" }
                );
            }
        }
    }
}

/// Tensor-core prefill attention at depth (not a test of speed: prints, for the lead's
/// measurements): 512 query rows of 32 heads over 4 kv heads of 128 after 8192 and 32768 cached
/// positions, per cache type, the mean of 10 launches after 2 warm-ups.
#[test]
#[ignore]
fn attention_mma_prefill_depth_timing() {
    use moe_lanes_kernels::cuda::ops::KvPtr;
    let Some(be) = backend() else { return };
    let (hd, n_kv, n_heads, t) = (128usize, 4usize, 32usize, 512usize);
    let q = be.upload(&rnd(t * n_heads * hd, 41)).unwrap();
    let out = be.alloc_zeros::<f32>(t * n_heads * hd).unwrap();
    for depth in [0usize, 8192, 32768] {
        let n = (depth + t) * n_kv * hd;
        let (k32, v32) = (be.upload(&rnd(n, 42)).unwrap(), be.upload(&rnd(n, 43)).unwrap());
        let bits = |x: Vec<f32>, f: fn(f32) -> u16| x.into_iter().map(f).collect::<Vec<u16>>();
        let f16 = |x: f32| half::f16::from_f32(x).to_bits();
        let bf16 = |x: f32| half::bf16::from_f32(x).to_bits();
        let (k16, v16) =
            (be.upload(&bits(rnd(n, 42), f16)).unwrap(), be.upload(&bits(rnd(n, 43), f16)).unwrap());
        let (kb, vb) =
            (be.upload(&bits(rnd(n, 42), bf16)).unwrap(), be.upload(&bits(rnd(n, 43), bf16)).unwrap());
        let caches = [
            ("f32", KvPtr::F32(k32.ptr()), KvPtr::F32(v32.ptr())),
            ("f16", KvPtr::F16(k16.ptr()), KvPtr::F16(v16.ptr())),
            ("bf16", KvPtr::Bf16(kb.ptr()), KvPtr::Bf16(vb.ptr())),
        ];
        for (name, kc, vc) in caches {
            let launch =
                || be.attention_mma(q.ptr(), kc, vc, out.ptr(), t, depth, n_heads, n_kv, hd, 0).unwrap();
            let us = mean_launch_us(be, 2, 10, launch);
            let tflops = 4.0 * (t * n_heads * hd) as f64 * (depth + t / 2) as f64 / us / 1e6;
            eprintln!("TIMING mma prefill attention depth {depth} {name} t {t} heads {n_heads}/{n_kv}: {us:.1} us, {tflops:.1} TFLOP/s");
        }
    }
}

/// The chunked DeltaNet prefill kernels equal the recurrent kernel on the same input: lengths
/// below one chunk, a multiple of it and with a tail, a nonzero state coming in, shapes with
/// value heads narrower and wider than a 32-column block, both value-head orders (the prep reads p
/// after the conv, so the conv is left out here; both paths read the same rows).
#[test]
fn delta_rule_chunked_equals_the_recurrent_kernel() {
    use moe_lanes_kernels::cuda::kernel::DELTA_CHUNK;
    use moe_lanes_kernels::cuda::ops::DeltaShape;
    let Some(be) = backend() else { return };
    let shapes = [(2, 4, 16, 12, false), (1, 3, 8, 10, false), (2, 4, 128, 128, true), (1, 2, 64, 48, false)];
    for (seed, &(nk, nv, dk, dv, tiled_v_heads)) in shapes.iter().enumerate() {
        let d = DeltaShape {
            n_k_heads: nk,
            n_v_heads: nv,
            k_head_dim: dk,
            v_head_dim: dv,
            conv_kernel: 4,
            tiled_v_heads,
        };
        for t in [3, DELTA_CHUNK - 1, 2 * DELTA_CHUNK, 2 * DELTA_CHUNK + 7, 70] {
            let seed = 100 * seed as u64 + t as u64;
            let p = rnd(t * d.p_stride(), seed);
            let ba: Vec<f32> = rnd(t * 2 * nv, seed + 1).iter().map(|x| 3.0 * x).collect();
            let state: Vec<f32> = rnd(nv * dk * dv, seed + 2).iter().map(|x| 0.5 * x).collect();
            let (dt_bias, a_log, norm) = (rnd(nv, seed + 3), rnd(nv, seed + 4), rnd(dv, seed + 5));
            let neg_a: Vec<f32> = a_log.iter().map(|a| -a.exp()).collect();
            let up = |v: &[f32]| be.upload(v).unwrap();
            let (dp, dba, dt, na, nw) = (up(&p), up(&ba), up(&dt_bias), up(&neg_a), up(&norm));
            let vectors = [dt.ptr(), na.ptr(), nw.ptr()];
            let (s1, s2) = (up(&state), up(&state));
            let (o1, o2) = (up(&vec![0.0; t * nv * dv]), up(&vec![0.0; t * nv * dv]));
            let work = be.alloc_zeros::<f32>(d.chunk_work_floats(t)).unwrap();
            be.delta_rule(d, dp.ptr(), dba.ptr(), s1.ptr(), vectors, o1.ptr(), t, 1e-6).unwrap();
            be.delta_rule_chunked(d, dp.ptr(), dba.ptr(), s2.ptr(), vectors, work.ptr(), o2.ptr(), t, 1e-6)
                .unwrap();
            let (want_o, got_o) = (be.read_vec(o1.ptr()).unwrap(), be.read_vec(o2.ptr()).unwrap());
            let (want_s, got_s) = (be.read_vec(s1.ptr()).unwrap(), be.read_vec(s2.ptr()).unwrap());
            let scale = |v: &[f32]| v.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
            let eo = max_abs_diff(&got_o, &want_o) / scale(&want_o);
            let es = max_abs_diff(&got_s, &want_s) / scale(&want_s);
            eprintln!("delta chunked {d:?} t={t}: out {eo:e}, state {es:e}");
            assert!(eo < 1e-4 && es < 1e-4, "{d:?} t={t}: out {eo:e} state {es:e}");
        }
    }
}

/// Timing, not a check (`--ignored`): the chunked DeltaNet prefill and its conv over 128, 512 and
/// 2048 tokens of a Qwen3.6-35B-A3B DeltaNet layer (16 key heads, 32 value heads, both of 128), the
/// mean of 10 calls after 2 warm-ups; then one decode token's rule and conv (50 calls).
#[test]
#[ignore]
fn delta_rule_chunked_timing() {
    use moe_lanes_kernels::cuda::ops::DeltaShape;
    let Some(be) = backend() else { return };
    let d = DeltaShape {
        n_k_heads: 16,
        n_v_heads: 32,
        k_head_dim: 128,
        v_head_dim: 128,
        conv_kernel: 4,
        tiled_v_heads: false,
    };
    for t in [128usize, 512, 2048] {
        let up = |v: &[f32]| be.upload(v).unwrap();
        let (p, ba) = (up(&rnd(t * d.p_stride(), 1)), up(&rnd(t * 2 * d.n_v_heads, 2)));
        let state = up(&rnd(d.n_v_heads * 128 * 128, 3));
        let (dt, na, nw) = (up(&rnd(32, 4)), up(&[-1.0; 32]), up(&rnd(128, 5)));
        let out = be.alloc_zeros::<f32>(t * 32 * 128).unwrap();
        let work = be.alloc_zeros::<f32>(d.chunk_work_floats(t)).unwrap();
        let vectors = [dt.ptr(), na.ptr(), nw.ptr()];
        let launch = || {
            be.delta_rule_chunked(d, p.ptr(), ba.ptr(), state.ptr(), vectors, work.ptr(), out.ptr(), t, 1e-6)
                .unwrap()
        };
        let us = mean_launch_us(be, 2, 10, launch);
        let conv_w = up(&rnd(d.conv_dim() * 4, 6));
        let conv_state = up(&rnd(d.conv_dim() * 3, 7));
        let raw = be.alloc_zeros::<f32>((t + 3) * d.conv_dim()).unwrap();
        let conv = || be.delta_conv_rows(d, p.ptr(), conv_state.ptr(), conv_w.ptr(), raw.ptr(), t).unwrap();
        let conv_us = mean_launch_us(be, 2, 10, conv);
        eprintln!("TIMING delta chunked t {t}: rule {us:.1} us, conv {conv_us:.1} us");
    }
    // decode: one token through the recurrent kernels
    let up = |v: &[f32]| be.upload(v).unwrap();
    let (p, ba) = (up(&rnd(d.p_stride(), 1)), up(&rnd(2 * d.n_v_heads, 2)));
    let state = up(&rnd(d.n_v_heads * 128 * 128, 3));
    let (dt, na, nw) = (up(&rnd(32, 4)), up(&[-1.0; 32]), up(&rnd(128, 5)));
    let out = be.alloc_zeros::<f32>(32 * 128).unwrap();
    let vectors = [dt.ptr(), na.ptr(), nw.ptr()];
    let rule = || be.delta_rule(d, p.ptr(), ba.ptr(), state.ptr(), vectors, out.ptr(), 1, 1e-6).unwrap();
    let us = mean_launch_us(be, 5, 50, rule);
    let (conv_w, conv_state) = (up(&rnd(d.conv_dim() * 4, 6)), up(&rnd(d.conv_dim() * 3, 7)));
    let conv = || be.delta_conv(d, p.ptr(), conv_state.ptr(), conv_w.ptr(), 1).unwrap();
    let conv_us = mean_launch_us(be, 5, 50, conv);
    eprintln!("TIMING delta decode t 1: rule {us:.1} us, conv {conv_us:.1} us");
}

/// The prefill conv over every (token, channel) at once equals the token-by-token conv: outputs
/// and the state it leaves, calls shorter than the conv's history and longer, from a nonzero state.
#[test]
fn delta_conv_rows_equals_the_sequential_conv() {
    use moe_lanes_kernels::cuda::ops::DeltaShape;
    let Some(be) = backend() else { return };
    let d = DeltaShape {
        n_k_heads: 2,
        n_v_heads: 4,
        k_head_dim: 16,
        v_head_dim: 12,
        conv_kernel: 4,
        tiled_v_heads: false,
    };
    let (cd, past) = (d.conv_dim(), d.conv_kernel - 1);
    for t in [1, 2, 3, 5, 70] {
        let p = rnd(t * d.p_stride(), 40 + t as u64);
        let (state, w) = (rnd(past * cd, 41), rnd(d.conv_kernel * cd, 42));
        let up = |v: &[f32]| be.upload(v).unwrap();
        let (p1, p2, s1, s2, dw) = (up(&p), up(&p), up(&state), up(&state), up(&w));
        let raw = be.alloc_zeros::<f32>(d.prefill_work_floats(t)).unwrap();
        be.delta_conv(d, p1.ptr(), s1.ptr(), dw.ptr(), t).unwrap();
        be.delta_conv_rows(d, p2.ptr(), s2.ptr(), dw.ptr(), raw.ptr(), t).unwrap();
        let (want, got) = (be.read_vec(p1.ptr()).unwrap(), be.read_vec(p2.ptr()).unwrap());
        let (want_s, got_s) = (be.read_vec(s1.ptr()).unwrap(), be.read_vec(s2.ptr()).unwrap());
        let (e, es) = (max_abs_diff(&got, &want), max_abs_diff(&got_s, &want_s));
        eprintln!("delta conv rows t={t}: out {e:e}, state {es:e}");
        assert!(e < 1e-6 && es == 0.0, "t={t}: out {e:e} state {es:e}");
    }
}

/// Causal GQA attention on the CPU with one sink logit per head joining each row's softmax
/// (GPT-OSS): the sink takes probability and attends nothing.
#[allow(clippy::too_many_arguments)]
fn attention_sinks_cpu(
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    sinks: &[f32],
    (t, pos0, n_heads, n_kv, hd, window): (usize, usize, usize, usize, usize, usize),
) -> Vec<f32> {
    let kv_dim = n_kv * hd;
    let mut want = vec![0.0; t * n_heads * hd];
    for ti in 0..t {
        let pos = pos0 + ti;
        let first = if window > 0 { (pos + 1).saturating_sub(window) } else { 0 };
        for h in 0..n_heads {
            let kvh = h / (n_heads / n_kv);
            let qh = &q[(ti * n_heads + h) * hd..][..hd];
            let scores: Vec<f32> = (first..=pos)
                .map(|p| dot(qh, &kc[p * kv_dim + kvh * hd..][..hd]) / (hd as f32).sqrt())
                .collect();
            let m = scores.iter().copied().fold(sinks[h], f32::max);
            let e: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
            let sum: f32 = e.iter().sum::<f32>() + (sinks[h] - m).exp();
            for (j, p) in (first..=pos).enumerate() {
                for i in 0..hd {
                    want[(ti * n_heads + h) * hd + i] += e[j] / sum * vc[p * kv_dim + kvh * hd + i];
                }
            }
        }
    }
    want
}

#[test]
fn attention_sinks_match_cpu_on_every_kernel() {
    use moe_lanes_kernels::cuda::ops::AttentionMask;
    let Some(be) = backend() else { return };
    // GPT-OSS-like (64-dim heads, 8 query heads per kv head), decode and prefill, with windows;
    // the last two past twice the window's ring (528 positions): rows wrapped and mirrored
    for (n_heads, n_kv, hd, pos0, t) in [
        (8, 1, 64, 0, 40),
        (16, 2, 64, 300, 1),
        (8, 2, 32, 20, 9),
        (4, 2, 20, 6, 3),
        (8, 1, 64, 1100, 40),
        (16, 2, 64, 1590, 1),
    ] {
        let total = pos0 + t;
        let (q, kc, vc) = (rnd(t * n_heads * hd, 31), rnd(total * n_kv * hd, 32), rnd(total * n_kv * hd, 33));
        // sinks from far below the scores to far above them: each side of the row's max
        let sinks: Vec<f32> = (0..n_heads).map(|h| -6.0 + 12.0 * h as f32 / (n_heads - 1) as f32).collect();
        let (dq, ds) = (be.upload(&q).unwrap(), be.upload(&sinks).unwrap());
        for window in [0usize, 8] {
            let ringed = |x: &[f32]| be.upload(&ring_layout(x, n_kv * hd, window)).unwrap();
            let (dk, dv) = (ringed(&kc), ringed(&vc));
            let (q_, k_, v_) = (dq.ptr(), dk.ptr(), dv.ptr());
            let want = attention_sinks_cpu(&q, &kc, &vc, &sinks, (t, pos0, n_heads, n_kv, hd, window));
            let mask = AttentionMask { window, sinks: Some(ds.ptr()) };
            let run = |launch: &dyn Fn(DPtr<f32>)| {
                let o = be.alloc_zeros::<f32>(t * n_heads * hd).unwrap();
                launch(o.ptr());
                be.read_vec(o.ptr()).unwrap()
            };
            let mut outs = vec![(
                "per-row",
                run(&|o| be.attention(q_, k_, v_, o, t, pos0, n_heads, n_kv, hd, mask).unwrap()),
            )];
            let part =
                be.alloc_zeros::<f32>(CudaBackend::attention_split_scratch(t, n_heads, hd, total)).unwrap();
            let split = |o| {
                be.attention_split(q_, k_, v_, o, part.ptr(), t, pos0, n_heads, n_kv, hd, mask, None).unwrap()
            };
            outs.push(("split", run(&split)));
            if CudaBackend::attention_tiled_fits(hd) {
                outs.push((
                    "tiled",
                    run(&|o| be.attention_tiled(q_, k_, v_, o, t, pos0, n_heads, n_kv, hd, mask).unwrap()),
                ));
            }
            if be.attention_mma_fits(hd, moe_lanes_kernels::KvType::F32) {
                outs.push((
                    "mma",
                    run(&|o| be.attention_mma(q_, k_, v_, o, t, pos0, n_heads, n_kv, hd, mask).unwrap()),
                ));
            }
            for (name, got) in outs {
                let err = max_abs_diff(&got, &want);
                assert!(err < 1e-5, "{name}: hd={hd} pos0={pos0} t={t} window={window}: {err}");
            }
        }
    }
}

#[test]
fn rope_with_a_frequency_table_and_scale_matches_cpu() {
    use moe_lanes_kernels::cuda::ops::RopeScaling;
    let Some(be) = backend() else { return };
    let (t, nh, nkv, hd, pos0, scale) = (5, 4, 2, 16, 37, 1.3465736f32);
    // a YaRN-like table: interpolated low frequencies, extrapolated high ones
    let freqs: Vec<f64> = (0..hd / 2)
        .map(|i| {
            let f = 150000f64.powf(-2.0 * i as f64 / hd as f64);
            if i < 3 {
                f
            } else {
                f / 32.0
            }
        })
        .collect();
    let dfreqs = be.upload(&freqs).unwrap();
    let scaling = Some(RopeScaling { freqs: dfreqs.ptr(), scale });
    let rope_cpu_table = |head: &mut [f32], pos: usize, interleaved: bool| {
        let half = head.len() / 2;
        for (i, f) in freqs.iter().enumerate() {
            let ang = pos as f64 * f;
            let (s, c) = ((ang.sin() * scale as f64) as f32, (ang.cos() * scale as f64) as f32);
            let (a, b) = if interleaved { (2 * i, 2 * i + 1) } else { (i, i + half) };
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * c - x1 * s;
            head[b] = x1 * c + x0 * s;
        }
    };
    for interleaved in [false, true] {
        let (q, k) = (rnd(t * nh * hd, 41), rnd(t * nkv * hd, 42));
        let (dq, dk) = (be.upload(&q).unwrap(), be.upload(&k).unwrap());
        be.qk_norm_rope(
            dq.ptr(),
            dk.ptr(),
            None,
            t,
            nh,
            nkv,
            nh * hd,
            nkv * hd,
            hd,
            hd,
            pos0,
            150000.0,
            interleaved,
            1e-6,
            None,
            scaling,
        )
        .unwrap();
        let dq2 = be.upload(&q).unwrap();
        be.rope(dq2.ptr(), t, nh, nh * hd, hd, hd, pos0, 150000.0, interleaved, scaling).unwrap();
        let (mut wq, mut wk) = (q.clone(), k.clone());
        for (r, row) in wq.chunks_mut(nh * hd).enumerate() {
            row.chunks_mut(hd).for_each(|h| rope_cpu_table(h, pos0 + r, interleaved));
        }
        for (r, row) in wk.chunks_mut(nkv * hd).enumerate() {
            row.chunks_mut(hd).for_each(|h| rope_cpu_table(h, pos0 + r, interleaved));
        }
        let got =
            [be.read_vec(dq.ptr()).unwrap(), be.read_vec(dk.ptr()).unwrap(), be.read_vec(dq2.ptr()).unwrap()];
        for (name, got, want) in
            [("fused q", &got[0], &wq), ("fused k", &got[1], &wk), ("rope q", &got[2], &wq)]
        {
            assert!(max_abs_diff(got, want) < 1e-5, "{name}, interleaved={interleaved}");
        }
    }
}

/// The CPU router's sigmoid routing (src/moe/routing.rs), for one token.
fn route_sigmoid_cpu(
    logits: &[f32],
    bias: &[f32],
    (k, n_group, topk_group, norm, scale): (usize, usize, usize, bool, f32),
) -> (Vec<i32>, Vec<f32>) {
    let n = logits.len();
    let top = |v: &[f32], k: usize| -> Vec<usize> {
        let mut idx: Vec<usize> = (0..v.len()).collect();
        idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
        idx.truncate(k);
        idx
    };
    let p: Vec<f32> = logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect();
    let mut c: Vec<f32> =
        p.iter().zip(bias.iter().chain(std::iter::repeat(&0.0))).map(|(p, b)| p + b).collect();
    if n_group > 1 {
        let per = n / n_group;
        let gs: Vec<f32> = (0..n_group)
            .map(|g| {
                let mut v = c[g * per..(g + 1) * per].to_vec();
                v.sort_by(|a, b| b.total_cmp(a));
                v[0] + v[1]
            })
            .collect();
        let kept = top(&gs, topk_group);
        for (g, chunk) in c.chunks_mut(per).enumerate() {
            if !kept.contains(&g) {
                chunk.fill(f32::NEG_INFINITY);
            }
        }
    }
    let chosen = top(&c, k);
    let sum: f32 = chosen.iter().map(|&e| p[e]).sum();
    let f = if norm { 1.0 / (sum + 1e-20) } else { 1.0 };
    (chosen.iter().map(|&e| e as i32).collect(), chosen.iter().map(|&e| p[e] * f * scale).collect())
}

#[test]
fn sigmoid_routing_matches_the_cpu_router() {
    use moe_lanes_kernels::cuda::ops::SigmoidRoute;
    let Some(be) = backend() else { return };
    // DeepSeek-V3 (256 experts, 8 groups keep 4, top-8, scale 2.5), Kimi K2 (384, no groups),
    // GLM-4.5-Air (128, no groups, top-8), a small odd case without bias or renormalisation
    for (n, k, n_group, topk_group, with_bias, norm, scale) in [
        (256, 8, 8, 4, true, true, 2.5f32),
        (384, 8, 1, 1, true, true, 2.827),
        (128, 8, 1, 1, true, true, 1.0),
        (12, 3, 4, 2, false, false, 1.0),
    ] {
        let t = 5;
        let logits: Vec<f32> = rnd(t * n, 51).iter().map(|x| x * 4.0).collect();
        let bias: Vec<f32> =
            if with_bias { rnd(n, 52).iter().map(|x| x * 0.5).collect() } else { Vec::new() };
        let dl = be.upload(&logits).unwrap();
        let db = be.upload(&bias).unwrap();
        let ids = be.alloc_zeros::<i32>(t * k).unwrap();
        let wts = be.alloc_zeros::<f32>(t * k).unwrap();
        let r =
            SigmoidRoute { selection_bias: with_bias.then(|| db.ptr()), n_group, topk_group, norm, scale };
        be.route_sigmoid(dl.ptr(), t, n, k, r, ids.ptr(), wts.ptr()).unwrap();
        let (got_ids, got_w) = (be.read_vec(ids.ptr()).unwrap(), be.read_vec(wts.ptr()).unwrap());
        for ti in 0..t {
            let (want_ids, want_w) =
                route_sigmoid_cpu(&logits[ti * n..][..n], &bias, (k, n_group, topk_group, norm, scale));
            assert_eq!(&got_ids[ti * k..][..k], &want_ids[..], "n={n} token {ti}");
            assert!(max_abs_diff(&got_w[ti * k..][..k], &want_w) < 1e-6, "n={n} token {ti}");
        }
    }
    // groups that do not divide the experts are refused by name
    let dl = be.upload(&[0f32; 10]).unwrap();
    let (ids, wts) = (be.alloc_zeros::<i32>(2).unwrap(), be.alloc_zeros::<f32>(2).unwrap());
    let r = SigmoidRoute { selection_bias: None, n_group: 3, topk_group: 1, norm: true, scale: 1.0 };
    let err = be.route_sigmoid(dl.ptr(), 1, 10, 2, r, ids.ptr(), wts.ptr()).unwrap_err();
    assert!(err.to_string().contains("route_sigmoid"), "{err}");
}

/// A test cache on the device: the buffer that holds it (f32 or bytes), its pointer, and the
/// values it holds.
struct AnyCache {
    _f32: Option<moe_lanes_kernels::cuda::DeviceBuffer<f32>>,
    _bytes: Option<moe_lanes_kernels::cuda::DeviceBuffer<u8>>,
    ptr: KvPtr,
}

/// One sequence's cache of `kv_type` holding `values` (f32 uploaded as is).
fn any_cache(be: &CudaBackend, kv_type: moe_lanes_kernels::KvType, values: &[f32]) -> AnyCache {
    if kv_type == moe_lanes_kernels::KvType::F32 {
        let d = be.upload(values).unwrap();
        let ptr = KvPtr::F32(d.ptr());
        return AnyCache { _f32: Some(d), _bytes: None, ptr };
    }
    let (d, _) = typed_cache(be, kv_type, values);
    let ptr = typed_ptr(kv_type, &d);
    AnyCache { _f32: None, _bytes: Some(d), ptr }
}

/// The batched step's one-launch kernels against the per-sequence ones and the CPU: sequences
/// of mixed lengths (1..2000 positions) with their own caches (f32, f16, q8_0), per-head and
/// grouped (8 query heads a kv head) decode attention, a window, sinks; the launch rows a subset
/// of the call's rows in another order. The q/k norm + RoPE + append writes what the
/// per-sequence launch writes, bit for bit (queries and cache bytes).
#[test]
fn batched_attention_and_append_match_the_per_sequence_kernels() {
    use moe_lanes_kernels::cuda::ops::{AttentionMask, BatchKv, KvAppend};
    use moe_lanes_kernels::KvType;
    let Some(be) = backend() else { return };
    let lens = [1usize, 37, 700, 2000, 64];
    for (n_heads, n_kv, hd) in [(32usize, 4usize, 128usize), (8, 2, 64)] {
        let (kv_dim, q_dim, n) = (n_kv * hd, n_heads * hd, lens.len());
        let cap = 2048;
        for kv_type in [KvType::F32, KvType::F16, KvType::Q8_0] {
            // caches: positions 0..len hold values; the step's new row goes at position len
            // two sets of the same caches: the per-sequence launches append to one, the batched
            // launch to the other
            let mut keep = Vec::new();
            let (mut caches, mut ref_caches) = (Vec::new(), Vec::new()); // (k ptr, v ptr, values, len)
            for (i, &len) in lens.iter().enumerate() {
                let (kc, vc) = (rnd(cap * kv_dim, 100 + i as u64), rnd(cap * kv_dim, 200 + i as u64));
                for set in [&mut caches, &mut ref_caches] {
                    let (a, b) = (any_cache(be, kv_type, &kc), any_cache(be, kv_type, &vc));
                    set.push((a.ptr, b.ptr, cap * kv_dim, len));
                    keep.push((a, b));
                }
            }
            // the append: per sequence (reference) and batched, into copies of the same caches
            let q = rnd(n * q_dim, 7);
            let (k_new, v_new) = (rnd(n * kv_dim, 8), rnd(n * kv_dim, 9));
            let (qw, kw) = (rnd(hd, 10), rnd(hd, 11));
            let (dqw, dkw) = (be.upload(&qw).unwrap(), be.upload(&kw).unwrap());
            let norm = Some((dqw.ptr(), dkw.ptr()));
            let pos: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
            let dpos = be.upload(&pos).unwrap();
            let kptrs: Vec<u64> = caches.iter().map(|c| c.0.raw()).collect();
            let vptrs: Vec<u64> = caches.iter().map(|c| c.1.raw()).collect();
            let (dk, dv) = (be.upload(&kptrs).unwrap(), be.upload(&vptrs).unwrap());
            let max_positions = lens.iter().max().unwrap() + 1;
            let kv = BatchKv {
                pos: dpos.ptr(),
                k: dk.ptr(),
                v: dv.ptr(),
                kv_type,
                n_rows: n,
                max_positions,
                window: 0,
            };
            // reference: one launch per sequence into scratch copies of the caches
            let snapshot = |p: KvPtr| -> Vec<u8> {
                match p {
                    KvPtr::F32(d) => be.read_vec(d).unwrap().iter().flat_map(|x| x.to_le_bytes()).collect(),
                    KvPtr::F16(d) | KvPtr::Bf16(d) => {
                        be.read_vec(d).unwrap().iter().flat_map(|x| x.to_le_bytes()).collect()
                    }
                    KvPtr::Q8_0(d) => be.read_vec(d).unwrap(),
                }
            };
            let (dq1, dk1, dv1) =
                (be.upload(&q).unwrap(), be.upload(&k_new).unwrap(), be.upload(&v_new).unwrap());
            for (i, c) in ref_caches.iter().enumerate() {
                let append = KvAppend {
                    pos: None,
                    v: dv1.ptr().sub(i * kv_dim, kv_dim),
                    k_cache: c.0,
                    v_cache: c.1,
                    window: 0,
                };
                be.qk_norm_rope(
                    dq1.ptr().sub(i * q_dim, q_dim),
                    dk1.ptr().sub(i * kv_dim, kv_dim),
                    norm,
                    1,
                    n_heads,
                    n_kv,
                    q_dim,
                    kv_dim,
                    hd,
                    hd,
                    c.3,
                    1e6,
                    false,
                    1e-6,
                    Some(append),
                    None,
                )
                .unwrap();
            }
            let want_q = be.read_vec(dq1.ptr()).unwrap();
            let want_caches: Vec<(Vec<u8>, Vec<u8>)> =
                ref_caches.iter().map(|c| (snapshot(c.0), snapshot(c.1))).collect();
            // batched: the same rows into the other set
            let (dq2, dk2, dv2) =
                (be.upload(&q).unwrap(), be.upload(&k_new).unwrap(), be.upload(&v_new).unwrap());
            let heads = (n_heads, n_kv, q_dim, kv_dim);
            be.qk_norm_rope_rows(
                (dq2.ptr(), dk2.ptr(), dv2.ptr()),
                norm,
                kv,
                heads,
                (hd, hd),
                (1e6, false, 1e-6),
                None,
            )
            .unwrap();
            assert_eq!(
                be.read_vec(dq2.ptr()).unwrap(),
                want_q,
                "{kv_type} {n_heads}/{n_kv}x{hd}: roped queries"
            );
            for (i, c) in caches.iter().enumerate() {
                assert!(snapshot(c.0) == want_caches[i].0, "{kv_type} {n_heads}/{n_kv}x{hd}: key cache {i}");
                assert!(
                    snapshot(c.1) == want_caches[i].1,
                    "{kv_type} {n_heads}/{n_kv}x{hd}: value cache {i}"
                );
            }
            // attention: launch rows 3, 0, 4, 1 (row 2 left out), every sequence over len + 1
            let held: Vec<(Vec<f32>, Vec<f32>)> = caches
                .iter()
                .map(|c| {
                    let widen = |p: KvPtr, n_values: usize| -> Vec<f32> {
                        let b = match p {
                            KvPtr::F32(d) => return be.read_vec(d).unwrap(),
                            _ => snapshot(p),
                        };
                        use moe_lanes_kernels::KvRows;
                        let u16s = || b.chunks(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
                        let rows = match kv_type {
                            KvType::F16 => KvRows::F16(u16s()),
                            KvType::Bf16 => KvRows::Bf16(u16s()),
                            KvType::Q8_0 => KvRows::Q8_0(b),
                            KvType::F32 => unreachable!("read as f32 above"),
                        };
                        let v = rows.to_f32_vec();
                        assert_eq!(v.len(), n_values);
                        v
                    };
                    (widen(c.0, c.2), widen(c.1, c.2))
                })
                .collect();
            let launch: Vec<i32> = vec![3, 0, 4, 1];
            let drows = be.upload(&launch).unwrap();
            let sinks: Vec<f32> = (0..n_heads).map(|h| -3.0 + 6.0 * h as f32 / n_heads as f32).collect();
            let dsinks = be.upload(&sinks).unwrap();
            // windows whose rings pass every length (plain caches are their layout), one of
            // them masking the longest sequence
            for (window, with_sinks) in [(0usize, false), (1600, false), (0, true), (1900, true)] {
                let mask = AttentionMask { window, sinks: with_sinks.then(|| dsinks.ptr()) };
                let kv = BatchKv { window, ..kv };
                let part = be
                    .alloc_zeros::<f32>(CudaBackend::attention_split_scratch(
                        launch.len(),
                        n_heads,
                        hd,
                        max_positions,
                    ))
                    .unwrap();
                let out = be.alloc_zeros::<f32>(n * q_dim).unwrap();
                be.attention_split_rows(
                    dq2.ptr(),
                    out.ptr(),
                    part.ptr(),
                    (drows.ptr(), launch.len()),
                    kv,
                    n_heads,
                    n_kv,
                    hd,
                    mask,
                )
                .unwrap();
                let got = be.read_vec(out.ptr()).unwrap();
                for (i, c) in caches.iter().enumerate() {
                    let row = &got[i * q_dim..][..q_dim];
                    if !launch.contains(&(i as i32)) {
                        assert!(row.iter().all(|&x| x == 0.0), "row {i} is not a launch row: untouched");
                        continue;
                    }
                    let qi = &want_q[i * q_dim..][..q_dim];
                    let (kh, vh) = &held[i];
                    let want = match with_sinks {
                        true => attention_sinks_cpu(qi, kh, vh, &sinks, (1, c.3, n_heads, n_kv, hd, window)),
                        false => attention_cpu(qi, kh, vh, 1, c.3, n_heads, n_kv, hd, window),
                    };
                    // the per-sequence split kernel over the same cache
                    let one = be.alloc_zeros::<f32>(q_dim).unwrap();
                    let part1 = be
                        .alloc_zeros::<f32>(CudaBackend::attention_split_scratch(1, n_heads, hd, c.3 + 1))
                        .unwrap();
                    let qrow = dq2.ptr().sub(i * q_dim, q_dim);
                    be.attention_split(
                        qrow,
                        c.0,
                        c.1,
                        one.ptr(),
                        part1.ptr(),
                        1,
                        c.3,
                        n_heads,
                        n_kv,
                        hd,
                        mask,
                        None,
                    )
                    .unwrap();
                    let alone = be.read_vec(one.ptr()).unwrap();
                    let what = format!(
                        "{kv_type} {n_heads}/{n_kv}x{hd} seq {i} len {} window {window} sinks {with_sinks}",
                        c.3
                    );
                    let tol = 1e-5;
                    assert!(
                        max_abs_diff(row, &want) < tol,
                        "{what}: {} against the CPU",
                        max_abs_diff(row, &want)
                    );
                    assert!(
                        max_abs_diff(row, &alone) < tol,
                        "{what}: {} against the per-sequence kernel",
                        max_abs_diff(row, &alone)
                    );
                }
            }
            drop(keep);
        }
    }
}

/// The grouped decode worklist built on the device: entries sorted by slot (stable), each routed
/// entry's sorted row (-1 cold), token rows, and the tiles `grouped_tiles` cuts from the sorted
/// slots, then empty tiles up to the bound.
#[test]
fn hot_worklist_grouped_sorts_entries_by_slot() {
    use moe_lanes_kernels::cuda::ops::grouped_tiles;
    let Some(be) = backend() else { return };
    // a batched decode step, small ones, and an all-hot prefill call of 512 tokens
    let cases = [
        (16usize, 8usize, 128usize, 16usize),
        (3, 2, 8, 16),
        (70, 8, 64, 16),
        (70, 8, 64, 64),
        (512, 8, 128, 64),
    ];
    for (t, k, e_n, tile_rows) in cases {
        // experts e % 3 == 2 are cold; the others take slots in reverse order
        let map: Vec<i32> =
            (0..e_n).map(|e| if e % 3 == 2 { -1 } else { ((e_n - 1 - e) / 3 * 2 + e % 3) as i32 }).collect();
        let n_slots = (*map.iter().max().unwrap() + 1) as usize;
        let mut ids: Vec<i32> = (0..t * k).map(|e| ((e * 37 + e / k * 11) % e_n) as i32).collect();
        ids[1] = e_n as i32 + 5; // out of range: cold
                                 // many rows on one expert: a run longer than one tile
        for r in 0..t.min(70) {
            ids[r * k] = 0;
        }
        let weights = rnd(t * k, 5);
        let n = t * k;
        let nt = CudaBackend::hot_grouped_max_tiles(n, n_slots, tile_rows);
        let (dmap, dids, dw) =
            (be.upload(&map).unwrap(), be.upload(&ids).unwrap(), be.upload(&weights).unwrap());
        let (toks, ws, ent) = (
            be.alloc_zeros::<i32>(n).unwrap(),
            be.alloc_zeros::<f32>(n).unwrap(),
            be.alloc_zeros::<i32>(n).unwrap(),
        );
        let (off, rows, tiles) = (
            be.alloc_zeros::<i32>(t + 1).unwrap(),
            be.alloc_zeros::<i32>(t).unwrap(),
            be.alloc_zeros::<i32>(3 * nt).unwrap(),
        );
        be.hot_worklist_grouped(
            (dmap.ptr(), dids.ptr(), dw.ptr()),
            (t, k, e_n, n_slots, tile_rows),
            (toks.ptr(), ws.ptr(), ent.ptr()),
            (off.ptr(), rows.ptr(), tiles.ptr()),
        )
        .unwrap();
        // the CPU's: hot entries stably sorted by slot
        let slot = |e: usize| {
            let id = ids[e];
            if id < 0 || id as usize >= e_n {
                -1
            } else {
                map[id as usize]
            }
        };
        let mut hot: Vec<usize> = (0..n).filter(|&e| slot(e) >= 0).collect();
        hot.sort_by_key(|&e| slot(e));
        let mut want_ent = vec![-1i32; n];
        let (mut want_toks, mut want_ws) = (vec![0i32; n], vec![0f32; n]);
        for (p, &e) in hot.iter().enumerate() {
            want_ent[e] = p as i32;
            want_toks[p] = (e / k) as i32;
            want_ws[p] = weights[e];
        }
        let sorted: Vec<u32> = hot.iter().map(|&e| slot(e) as u32).collect();
        let mut cut = vec![0i32; 3 * n];
        let used = grouped_tiles(&sorted, &mut cut).unwrap();
        let mut want_tiles = tiles_of_at_most(&cut[..3 * used], tile_rows);
        let used = want_tiles.len() / 3;
        assert!(used <= nt, "{used} tiles within the bound {nt}");
        want_tiles.resize(3 * nt, 0);
        for i in used..nt {
            want_tiles[3 * i..3 * i + 3].copy_from_slice(&[-1, 0, 0]);
        }
        let what = format!("T={t} k={k} E={e_n} tiles of {tile_rows}");
        assert_eq!(be.read_vec(ent.ptr()).unwrap(), want_ent, "{what}: entries");
        assert_eq!(be.read_vec(toks.ptr()).unwrap(), want_toks, "{what}: tokens");
        assert_eq!(be.read_vec(ws.ptr()).unwrap(), want_ws, "{what}: weights");
        assert_eq!(be.read_vec(tiles.ptr()).unwrap(), want_tiles, "{what}: tiles");
        assert_eq!(be.read_vec(off.ptr()).unwrap(), (0..=t).map(|r| (r * k) as i32).collect::<Vec<_>>());
        assert_eq!(be.read_vec(rows.ptr()).unwrap(), (0..t).map(|r| r as i32).collect::<Vec<_>>());
    }
    // too many entries for the one block's shared memory: refused by name
    assert!(!CudaBackend::hot_worklist_grouped_fits(4096, 8, 128));
}

/// Gemma 4's small kernels (gemma.cu) against the CPU: the scalar scale, the soft cap
/// `cap * tanh(x / cap)`, the per-expert scale on routed weights (an id out of range leaves its
/// weight) and the dense GeGLU's `gelu_tanh(g) * u` (with SiLU through the same launcher); a
/// soft cap that is not a positive number is refused before any launch.
#[test]
fn gemma_kernels_match_cpu() {
    use moe_lanes_kernels::cuda::Glu;
    use moe_lanes_kernels::weights::Activation;
    let Some(be) = backend() else { return };
    let n = 1000;
    let x: Vec<f32> = rnd(n, 71).iter().map(|v| v * 12.0).collect();
    let dx = be.upload(&x).unwrap();
    be.scale(dx.ptr(), n, 8.0).unwrap();
    let want: Vec<f32> = x.iter().map(|v| v * 8.0).collect();
    assert_eq!(be.read_vec(dx.ptr()).unwrap(), want, "scale is one multiply");
    let dx = be.upload(&x).unwrap();
    be.softcap(dx.ptr(), n, 3.0).unwrap();
    let want: Vec<f32> = x.iter().map(|v| 3.0 * (v / 3.0).tanh()).collect();
    let err = max_abs_diff(&be.read_vec(dx.ptr()).unwrap(), &want);
    assert!(err < 1e-6, "softcap: {err}");
    assert!(be.softcap(dx.ptr(), n, 0.0).is_err() && be.softcap(dx.ptr(), n, f32::NAN).is_err());
    let (ids, w, scale) = (vec![3i32, 0, 7, 9, -1], vec![0.5f32, 0.25, 0.125, 1.0, 2.0], rnd(8, 72));
    let (di, dw, ds) = (be.upload(&ids).unwrap(), be.upload(&w).unwrap(), be.upload(&scale).unwrap());
    be.route_expert_scale(di.ptr(), dw.ptr(), ds.ptr(), ids.len(), 8).unwrap();
    let want = vec![0.5 * scale[3], 0.25 * scale[0], 0.125 * scale[7], 1.0, 2.0];
    assert_eq!(be.read_vec(dw.ptr()).unwrap(), want);
    let (g, u) = (rnd(n, 73).iter().map(|v| v * 6.0).collect::<Vec<f32>>(), rnd(n, 74));
    let (dg, du, dout) = (be.upload(&g).unwrap(), be.upload(&u).unwrap(), be.alloc_zeros::<f32>(n).unwrap());
    for (glu, act) in [(Glu::GeluTanh, Activation::GeluTanh), (Glu::Silu, Activation::Silu)] {
        be.glu_mul(glu, dg.ptr(), du.ptr(), dout.ptr(), n).unwrap();
        let want: Vec<f32> = g.iter().zip(&u).map(|(g, u)| act.apply(*g) * u).collect();
        let err = max_abs_diff(&be.read_vec(dout.ptr()).unwrap(), &want);
        eprintln!("glu_mul {glu:?}: max err {err:e}");
        assert!(err < 1e-5, "{glu:?}: {err}");
    }
}

/// Causal GQA attention on the CPU in f64 with an optional sink logit per head (the oracle of
/// [`attention_cpu`] and the wide-head tests): `t` query rows at `pos0..`.
fn attention_masked_cpu(
    (q, kc, vc): (&[f32], &[f32], &[f32]),
    sinks: Option<&[f32]>,
    (t, pos0, n_heads, n_kv, hd, window): (usize, usize, usize, usize, usize, usize),
) -> Vec<f32> {
    let kv_dim = n_kv * hd;
    let mut want = vec![0.0; t * n_heads * hd];
    for ti in 0..t {
        let pos = pos0 + ti;
        let first = if window > 0 { (pos + 1).saturating_sub(window) } else { 0 };
        for h in 0..n_heads {
            let kvh = h / (n_heads / n_kv);
            let qh = &q[(ti * n_heads + h) * hd..][..hd];
            let scores: Vec<f64> = (first..=pos)
                .map(|p| {
                    let kr = &kc[p * kv_dim + kvh * hd..][..hd];
                    qh.iter().zip(kr).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() / (hd as f64).sqrt()
                })
                .collect();
            let sink = sinks.map(|s| s[h] as f64);
            let m = scores.iter().copied().fold(sink.unwrap_or(f64::NEG_INFINITY), f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let sum: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - m).exp());
            for i in 0..hd {
                let a: f64 =
                    (first..=pos).zip(&e).map(|(p, w)| w * vc[p * kv_dim + kvh * hd + i] as f64).sum();
                want[(ti * n_heads + h) * hd + i] = (a / sum) as f32;
            }
        }
    }
    want
}

/// The masks the wide-head tests run: (window, with sinks): none, a window, sinks, both.
const WIDE_MASKS: [(usize, bool); 4] = [(0, false), (100, false), (0, true), (700, true)];

/// The batched tests' masks: their windows' rings (window + `KV_RING_CHUNK_POSITIONS`) pass
/// every sequence's length, so plain caches are the rings' layout.
const BATCHED_MASKS: [(usize, bool); 4] = [(0, false), (2100, false), (0, true), (2500, true)];

/// The bounds of a wide-head tensor-core result over a 16-bit cache, as the narrow kernels'
/// tests set them: against the CPU over the cache's values 1e-5 (q and p split hi + lo, K and V
/// exact, f32 accumulation), but 2.5e-4 for the f16 prefill (p rounded to f16 for p . V: at
/// most 2^-12 of each weight); against the f32 cache's result the type's rounding of K and V
/// (f16: 2e-3, bf16: 1e-2).
fn wide_bounds(kv_type: moe_lanes_kernels::KvType, prefill: bool) -> (f32, f32) {
    use moe_lanes_kernels::KvType;
    match kv_type {
        KvType::F16 if prefill => (2.5e-4, 2e-3),
        KvType::F16 => (1e-5, 2e-3),
        _ => (1e-5, 1e-2),
    }
}

/// Heads of 192 and 256 (Qwen3.5/3.6, Qwen3-Next, Gemma 4 sliding layers) on the wide-head
/// tensor-core kernels over f16 and bf16 caches: prefill (`attention_mma`: several 64-row blocks
/// and 16-key tiles, positions past 2000) and split decode (`attention_split`: several spans),
/// GQA groups of 8 and 1, a window, sinks; against the CPU in f64 over the cache's values and
/// over the f32 values (bounds: [`wide_bounds`]).
#[test]
fn wide_head_tensor_core_attention_matches_cpu() {
    use moe_lanes_kernels::cuda::ops::AttentionMask;
    use moe_lanes_kernels::KvType;
    let Some(be) = backend() else { return };
    if !be.attention_mma_fits(256, KvType::F16) {
        eprintln!("SKIP: the tensor-core attention needs sm_80+");
        return;
    }
    for (n_heads, n_kv, hd, pos0, t) in [
        (16, 2, 256, 0, 130),
        (16, 2, 256, 2100, 20),
        (4, 4, 192, 2050, 9),
        (16, 2, 256, 2500, 1),
        (4, 4, 192, 3000, 2),
    ] {
        let total = pos0 + t;
        let (q, kc, vc) = (rnd(t * n_heads * hd, 51), rnd(total * n_kv * hd, 52), rnd(total * n_kv * hd, 53));
        let sinks: Vec<f32> = (0..n_heads).map(|h| -4.0 + 8.0 * h as f32 / n_heads as f32).collect();
        let (dq, ds) = (be.upload(&q).unwrap(), be.upload(&sinks).unwrap());
        for kv_type in [KvType::F16, KvType::Bf16] {
            assert!(be.attention_split_mma_fits(n_heads, n_kv, hd, kv_type), "{kv_type} {hd}: split on mma");
            let ((_, kh), (_, vh)) = (typed_cache(be, kv_type, &kc), typed_cache(be, kv_type, &vc));
            let part =
                be.alloc_zeros::<f32>(CudaBackend::attention_split_scratch(t, n_heads, hd, total)).unwrap();
            for (window, with_sinks) in WIDE_MASKS {
                let ringed = |x: &[f32]| typed_cache(be, kv_type, &ring_layout(x, n_kv * hd, window)).0;
                let (dk, dv) = (ringed(&kc), ringed(&vc));
                let (kp, vp) = (typed_ptr(kv_type, &dk), typed_ptr(kv_type, &dv));
                let s = with_sinks.then_some(sinks.as_slice());
                let shape = (t, pos0, n_heads, n_kv, hd, window);
                let want = attention_masked_cpu((&q, &kh, &vh), s, shape);
                let want32 = attention_masked_cpu((&q, &kc, &vc), s, shape);
                let mask = AttentionMask { window, sinks: with_sinks.then(|| ds.ptr()) };
                let run = |launch: &dyn Fn(DPtr<f32>)| {
                    let o = be.alloc_zeros::<f32>(t * n_heads * hd).unwrap();
                    launch(o.ptr());
                    be.read_vec(o.ptr()).unwrap()
                };
                let mma = run(&|o| {
                    be.attention_mma(dq.ptr(), kp, vp, o, t, pos0, n_heads, n_kv, hd, mask).unwrap()
                });
                let split = run(&|o| {
                    be.attention_split(
                        dq.ptr(),
                        kp,
                        vp,
                        o,
                        part.ptr(),
                        t,
                        pos0,
                        n_heads,
                        n_kv,
                        hd,
                        mask,
                        None,
                    )
                    .unwrap()
                });
                let what = format!(
                    "{kv_type} {n_heads}/{n_kv}x{hd} pos0={pos0} t={t} window={window} sinks={with_sinks}"
                );
                for (kernel, got, prefill) in [("mma", &mma, true), ("split", &split, false)] {
                    let (exact, typed) = wide_bounds(kv_type, prefill);
                    let (err, err32) = (max_abs_diff(got, &want), max_abs_diff(got, &want32));
                    assert!(err < exact, "{kernel} {what}: {err} against the CPU over the cache's values");
                    assert!(err32 < typed, "{kernel} {what}: {err32} against the f32 cache's result");
                }
            }
        }
    }
}

/// A batched decode step with wide heads (`attention_split_rows` on the wide-head tensor-core
/// kernel): sequences of 1..2600 positions with their own f16 or bf16 caches, GQA groups of 8
/// and 1, heads of 256 and 192, a window, sinks, the launch rows a subset of the call's rows in
/// another order; each launched row against the CPU in f64 (1e-5, as the per-sequence split),
/// the others untouched.
#[test]
fn wide_head_batched_decode_rows_match_cpu() {
    use moe_lanes_kernels::cuda::ops::{AttentionMask, BatchKv};
    use moe_lanes_kernels::KvType;
    let Some(be) = backend() else { return };
    if !be.attention_mma_fits(256, KvType::F16) {
        eprintln!("SKIP: the tensor-core attention needs sm_80+");
        return;
    }
    let lens = [1usize, 37, 2100, 700, 2600];
    let (n, cap) = (lens.len(), 2601);
    for (n_heads, n_kv, hd) in [(16usize, 2usize, 256usize), (4, 4, 192)] {
        let (kv_dim, q_dim) = (n_kv * hd, n_heads * hd);
        let q = rnd(n * q_dim, 61);
        let sinks: Vec<f32> = (0..n_heads).map(|h| -3.0 + 6.0 * h as f32 / n_heads as f32).collect();
        let (dq, ds) = (be.upload(&q).unwrap(), be.upload(&sinks).unwrap());
        let launch: Vec<i32> = vec![3, 0, 4, 2];
        let drows = be.upload(&launch).unwrap();
        let pos: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
        let dpos = be.upload(&pos).unwrap();
        for kv_type in [KvType::F16, KvType::Bf16] {
            let caches: Vec<_> = (0..n)
                .map(|i| {
                    let (kc, vc) = (rnd(cap * kv_dim, 300 + i as u64), rnd(cap * kv_dim, 400 + i as u64));
                    (typed_cache(be, kv_type, &kc), typed_cache(be, kv_type, &vc))
                })
                .collect();
            let kptrs: Vec<u64> = caches.iter().map(|c| typed_ptr(kv_type, &c.0 .0).raw()).collect();
            let vptrs: Vec<u64> = caches.iter().map(|c| typed_ptr(kv_type, &c.1 .0).raw()).collect();
            let (dk, dv) = (be.upload(&kptrs).unwrap(), be.upload(&vptrs).unwrap());
            let max_positions = cap;
            let kv = BatchKv {
                pos: dpos.ptr(),
                k: dk.ptr(),
                v: dv.ptr(),
                kv_type,
                n_rows: n,
                max_positions,
                window: 0,
            };
            let scratch = CudaBackend::attention_split_scratch(launch.len(), n_heads, hd, max_positions);
            let part = be.alloc_zeros::<f32>(scratch).unwrap();
            // windows whose rings (window + KV_RING_CHUNK_POSITIONS) pass every length: the
            // plain caches are their layout (the rings' wrap: the per-sequence tests)
            for (window, with_sinks) in BATCHED_MASKS {
                let mask = AttentionMask { window, sinks: with_sinks.then(|| ds.ptr()) };
                let kv = BatchKv { window, ..kv };
                let out = be.alloc_zeros::<f32>(n * q_dim).unwrap();
                let rows = (drows.ptr(), launch.len());
                be.attention_split_rows(dq.ptr(), out.ptr(), part.ptr(), rows, kv, n_heads, n_kv, hd, mask)
                    .unwrap();
                let got = be.read_vec(out.ptr()).unwrap();
                for (i, ((_, kh), (_, vh))) in caches.iter().enumerate() {
                    let row = &got[i * q_dim..][..q_dim];
                    if !launch.contains(&(i as i32)) {
                        assert!(row.iter().all(|&x| x == 0.0), "row {i} is not a launch row: untouched");
                        continue;
                    }
                    let s = with_sinks.then_some(sinks.as_slice());
                    let qi = &q[i * q_dim..][..q_dim];
                    let want = attention_masked_cpu((qi, kh, vh), s, (1, lens[i], n_heads, n_kv, hd, window));
                    let err = max_abs_diff(row, &want);
                    let what = format!(
                        "{kv_type} {n_heads}/{n_kv}x{hd} seq {i} len {} window {window} sinks {with_sinks}",
                        lens[i]
                    );
                    assert!(err < 1e-5, "{what}: {err} against the CPU");
                }
            }
        }
    }
}

/// Heads past the wide-head limit (272 > 256) are refused by the kernel's name, not launched;
/// f32 caches keep the narrow limit (144 > 128 on `attention_mma_f32`).
#[test]
fn wide_head_launchers_refuse_heads_past_the_limit() {
    use moe_lanes_kernels::KvType;
    let Some(be) = backend() else { return };
    assert_eq!(CudaBackend::attention_mma_max_head_dim(KvType::Bf16), 256);
    assert_eq!(CudaBackend::attention_mma_max_head_dim(KvType::Q8_0), 128);
    let (n_heads, n_kv, t, pos0) = (4usize, 2usize, 2usize, 3usize);
    for (kv_type, hd, symbol) in [
        (KvType::F16, 272usize, "attention_mma_wide_f16"),
        (KvType::Bf16, 272, "attention_mma_wide_bf16"),
        (KvType::F32, 144, "attention_mma_f32"),
    ] {
        assert!(!be.attention_mma_fits(hd, kv_type), "{kv_type} {hd}");
        let (q, kc) = (vec![0.5f32; t * n_heads * hd], vec![0.25f32; (pos0 + t) * n_kv * hd]);
        let dq = be.upload(&q).unwrap();
        let out = be.alloc_zeros::<f32>(t * n_heads * hd).unwrap();
        let err = match kv_type {
            KvType::F32 => {
                let (dk, dv) = (be.upload(&kc).unwrap(), be.upload(&kc).unwrap());
                be.attention_mma(dq.ptr(), dk.ptr(), dv.ptr(), out.ptr(), t, pos0, n_heads, n_kv, hd, 0)
            }
            _ => {
                let ((dk, _), (dv, _)) = (typed_cache(be, kv_type, &kc), typed_cache(be, kv_type, &kc));
                let (kp, vp) = (typed_ptr(kv_type, &dk), typed_ptr(kv_type, &dv));
                be.attention_mma(dq.ptr(), kp, vp, out.ptr(), t, pos0, n_heads, n_kv, hd, 0)
            }
        }
        .unwrap_err()
        .to_string();
        assert!(err.contains(symbol) && err.contains(&format!("head_dim {hd}")), "{kv_type} {hd}: {err}");
    }
    assert!(!be.attention_split_mma_fits(n_heads, n_kv, 272, KvType::F16));
}

/// Wide-head attention at depth (not a test of speed: prints, for the lead's measurements), the
/// Qwen3.6 full-attention shape (16 query heads over 2 kv heads of 256): prefill of 512 rows on
/// the wide tensor-core kernel against the tiled CUDA-core kernel (the path heads of 256 took
/// before) over the same f16 cache, and one decode token's split attention over f16 (the wide
/// tensor-core split) against f32 (the CUDA-core split), after 8192 and 32768 cached positions.
#[test]
#[ignore]
fn attention_wide_heads_timing() {
    use moe_lanes_kernels::cuda::ops::KvPtr;
    let Some(be) = backend() else { return };
    let (hd, n_kv, n_heads, t) = (256usize, 2usize, 16usize, 512usize);
    let q = be.upload(&rnd(t * n_heads * hd, 41)).unwrap();
    let out = be.alloc_zeros::<f32>(t * n_heads * hd).unwrap();
    for depth in [0usize, 8192, 32768] {
        let n = (depth + t) * n_kv * hd;
        let f16 = |x: Vec<f32>| x.into_iter().map(|v| half::f16::from_f32(v).to_bits()).collect::<Vec<u16>>();
        let (k16, v16) = (be.upload(&f16(rnd(n, 42))).unwrap(), be.upload(&f16(rnd(n, 43))).unwrap());
        let (kc, vc) = (KvPtr::F16(k16.ptr()), KvPtr::F16(v16.ptr()));
        let flop = 4.0 * (t * n_heads * hd) as f64 * (depth + t / 2) as f64;
        let mma = || be.attention_mma(q.ptr(), kc, vc, out.ptr(), t, depth, n_heads, n_kv, hd, 0).unwrap();
        let tiled =
            || be.attention_tiled(q.ptr(), kc, vc, out.ptr(), t, depth, n_heads, n_kv, hd, 0).unwrap();
        for (name, us) in
            [("wide mma", mean_launch_us(be, 2, 10, mma)), ("tiled", mean_launch_us(be, 1, 3, tiled))]
        {
            let tflops = flop / us / 1e6;
            eprintln!("TIMING prefill attention f16 depth {depth} t {t} heads {n_heads}/{n_kv}x{hd} {name}: {us:.1} us, {tflops:.1} TFLOP/s");
        }
        if depth == 0 {
            continue;
        }
        let (k32, v32) = (be.upload(&rnd(n, 42)).unwrap(), be.upload(&rnd(n, 43)).unwrap());
        let part =
            be.alloc_zeros::<f32>(CudaBackend::attention_split_scratch(1, n_heads, hd, depth + 1)).unwrap();
        for (name, k, v) in
            [("f16 wide mma", kc, vc), ("f32 CUDA cores", KvPtr::F32(k32.ptr()), KvPtr::F32(v32.ptr()))]
        {
            let split = || {
                be.attention_split(q.ptr(), k, v, out.ptr(), part.ptr(), 1, depth, n_heads, n_kv, hd, 0, None)
                    .unwrap()
            };
            let us = mean_launch_us(be, 5, 50, split);
            eprintln!(
                "TIMING decode split attention depth {depth} heads {n_heads}/{n_kv}x{hd} {name}: {us:.1} us"
            );
        }
    }
}
