//! The dense kernels (row-split GEMV/GEMM, attention) at every SIMD level this CPU runs,
//! against plain scalar loops, and the same bits whatever the pool's thread count.

mod common;

use common::{q8_rounding_bound, relative_error, tolerance, MisalignedBytes, QuantBytes, Rng};
use moe_lanes_kernels::{
    attention, attention_reference, available, dot_row, matmul, par_attention, par_matmul, AttentionInput,
    AttentionScratch, AttentionShape, ColdPool, DecodeActivations, DenseMatrix, KvRows, KvType, MatmulPart,
    SimdLevel, WeightDType,
};

/// `y[t * rows + r] = Σ_c w[r, c] x[t, c]`, sequential.
fn reference_matmul(w: &DenseMatrix<'_>, x: &[f32]) -> Vec<f32> {
    let n_tokens = x.len() / w.cols;
    let mut y = vec![0.0; n_tokens * w.rows];
    for t in 0..n_tokens {
        for r in 0..w.rows {
            y[t * w.rows + r] = dot_row(w.dtype, w.row(r), &x[t * w.cols..(t + 1) * w.cols]);
        }
    }
    y
}

/// Three matrices sharing `cols` (as q, k, v do), every token count from decode to a prefill
/// block of several tiles, at every level and 1..=3 threads.
#[test]
fn par_matmul_matches_scalar_for_every_level_dtype_and_thread_count() {
    let mut rng = Rng(0x5eed_d3e5);
    let mut pools: Vec<ColdPool> = (1..=3).map(ColdPool::new).collect();
    for (cols, rows) in [(53, [37, 8, 1]), (64, [128, 24, 17]), (9, [3, 70, 5])] {
        for dtype in WeightDType::FLOATS {
            let mats: Vec<MisalignedBytes> =
                rows.iter().map(|&r| MisalignedBytes::new(dtype, &rng.vec(r * cols, 1.0))).collect();
            let views: Vec<DenseMatrix<'_>> = mats
                .iter()
                .zip(rows)
                .map(|(m, r)| DenseMatrix::new(m.bytes(), dtype, r, cols).unwrap())
                .collect();
            for n_tokens in [1, 2, 5, 7, 13] {
                let x = rng.vec(n_tokens * cols, 1.0);
                let expected: Vec<Vec<f32>> = views.iter().map(|w| reference_matmul(w, &x)).collect();
                for level in available() {
                    // float weights never take 8-bit activations
                    let single = check_level((level, DecodeActivations::Q8), &views, &x, &mut pools);
                    assert_f32_tolerance(level, dtype, &single, &expected);
                }
            }
        }
    }
}

/// The product on the calling thread, checked to give the same bits on every pool.
fn check_level(
    kernels: (SimdLevel, DecodeActivations),
    views: &[DenseMatrix<'_>],
    x: &[f32],
    pools: &mut [ColdPool],
) -> Vec<Vec<f32>> {
    let n_tokens = x.len() / views[0].cols;
    let mut single: Vec<Vec<f32>> = views.iter().map(|w| vec![f32::NAN; n_tokens * w.rows]).collect();
    let mut parts: Vec<MatmulPart<'_, '_>> =
        views.iter().zip(single.iter_mut()).map(|(&w, y)| MatmulPart { w, y }).collect();
    matmul(kernels, x, &mut parts).unwrap();
    for pool in pools.iter_mut() {
        let mut ys: Vec<Vec<f32>> = views.iter().map(|w| vec![f32::NAN; n_tokens * w.rows]).collect();
        let mut parts: Vec<MatmulPart<'_, '_>> =
            views.iter().zip(ys.iter_mut()).map(|(&w, y)| MatmulPart { w, y }).collect();
        par_matmul(pool, kernels, x, &mut parts).unwrap();
        let (level, act) = kernels;
        assert_eq!(
            ys,
            single,
            "{level} {act} tokens={n_tokens} {} threads: not the single-thread bits",
            pool.n_threads()
        );
    }
    single
}

fn assert_f32_tolerance(level: SimdLevel, dtype: WeightDType, got: &[Vec<f32>], expected: &[Vec<f32>]) {
    for (got, want) in got.iter().zip(expected) {
        let error = relative_error(got, want);
        assert!(error <= tolerance(level, dtype), "{level} {dtype:?}: {error:e}");
    }
}

/// Every output within the 8-bit activation bound of its exact value (`q8_rounding_bound` over
/// the dequantised row, plus f32 accumulation of `Σ |w||x|`).
fn assert_q8_bound(views: &[DenseMatrix<'_>], x: &[f32], got: &[Vec<f32>], expected: &[Vec<f32>]) {
    let cols = views[0].cols;
    for ((w, got), want) in views.iter().zip(got).zip(expected) {
        let mut row = vec![0.0f32; cols];
        for r in 0..w.rows {
            w.dtype.decode_row(w.row(r), &mut row);
            for (t, xt) in x.chunks(cols).enumerate() {
                let magnitude: f64 = row.iter().zip(xt).map(|(a, b)| (a * b).abs() as f64).sum();
                let bound = q8_rounding_bound(&row, xt) + 1e-5 * magnitude;
                let (g, e) = (got[t * w.rows + r] as f64, want[t * w.rows + r] as f64);
                assert!(
                    (g - e).abs() <= bound,
                    "{:?} row {r} token {t}: {g} vs {e}, bound {bound:e}",
                    w.dtype
                );
            }
        }
    }
}

/// Quantised q/k/v-like matrices (a Q4_K_M file's dense stage) for decode and prefill token
/// counts, prefill past one AMX tile and past the pool's quantising threshold, with a partial
/// last tile of rows: every level against the scalar loops, the same bits at every thread count;
/// with f32 activations within f32 accumulation, with 8-bit ones (where the level has VNNI and
/// the type takes them) within the activation rounding bound of every output, and not the f32
/// run's bits (the 8-bit tiles ran: VNNI's, or AVX2's for Q4_0, Q4_K, Q5_K and Q6_K).
#[test]
fn par_matmul_over_quantized_rows_matches_scalar_for_every_level_and_thread_count() {
    let mut rng = Rng(0x0de5_e0a1);
    let mut pools: Vec<ColdPool> = (1..=3).map(ColdPool::new).collect();
    for dtype in WeightDType::QUANTIZED {
        for (cols, rows) in [(512, [40, 16, 33]), (256, [64, 9, 300])] {
            let mats: Vec<QuantBytes> =
                rows.iter().map(|&r| QuantBytes::random(&mut rng, dtype, r, cols, 0.02)).collect();
            let views: Vec<DenseMatrix<'_>> = mats
                .iter()
                .zip(rows)
                .map(|(m, r)| DenseMatrix::new(m.bytes(), dtype, r, cols).unwrap())
                .collect();
            for n_tokens in [1, 3, 7, 8, 21, 40] {
                let x = rng.vec(n_tokens * cols, 1.0);
                let expected: Vec<Vec<f32>> = views.iter().map(|w| reference_matmul(w, &x)).collect();
                for level in available() {
                    let f32_run = check_level((level, DecodeActivations::F32), &views, &x, &mut pools);
                    assert_f32_tolerance(level, dtype, &f32_run, &expected);
                    let q8_run = check_level((level, DecodeActivations::Q8), &views, &x, &mut pools);
                    // AMX hosts keep their tiles for many tokens of the types the VNNI tiles lack
                    let takes = match n_tokens <= 4 {
                        true => level.has_q8_tile(dtype) && (n_tokens == 1 || level.has_q8_dot()),
                        false => level.has_q8_dot() && many_token_tiles(level, dtype),
                    };
                    assert_eq!(
                        q8_run != f32_run,
                        takes,
                        "{level} {dtype:?} tokens={n_tokens}: 8-bit tiles taken"
                    );
                    assert_q8_bound(&views, &x, &q8_run, &expected);
                }
            }
        }
    }
}

/// The types whose many-token VNNI tiles take 8-bit activations at `level` (the kernels'
/// `ffn::q8_many_tokens`).
fn many_token_tiles(level: SimdLevel, dtype: WeightDType) -> bool {
    use WeightDType::*;
    let tiles = matches!(dtype, Q4_K | Q5_K | Q6_K | Q8_0 | Mxfp4);
    tiles && (level != SimdLevel::Amx || matches!(dtype, Q4_K | Q6_K))
}

#[test]
fn par_matmul_rejects_bad_shapes_and_changes_nothing() {
    let mut pool = ColdPool::new(2);
    let bytes = WeightDType::BF16.encode(&[1.0; 12]);
    let w = DenseMatrix::new(&bytes, WeightDType::BF16, 3, 4).unwrap();
    let mut y = vec![7.0f32; 6];
    let err = par_matmul(
        &mut pool,
        (SimdLevel::Scalar, DecodeActivations::Auto),
        &[1.0; 5],
        &mut [MatmulPart { w, y: &mut y }],
    );
    assert!(err.is_err());
    assert_eq!(y, vec![7.0; 6]);
    let wrong = DenseMatrix { bytes: &bytes[..10], ..w };
    assert!(par_matmul(
        &mut pool,
        (SimdLevel::Scalar, DecodeActivations::Auto),
        &[1.0; 8],
        &mut [MatmulPart { w: wrong, y: &mut y }]
    )
    .is_err());
    assert!(par_matmul(&mut pool, (SimdLevel::Scalar, DecodeActivations::Auto), &[1.0; 8], &mut []).is_err());
}

struct Kv {
    keys: Vec<KvRows>,
    values: Vec<KvRows>,
}

fn random_kv(rng: &mut Rng, n_kv_heads: usize, positions: usize, head_dim: usize) -> Kv {
    let mut head = || KvRows::from_f32(rng.vec(positions * head_dim, 1.0));
    Kv { keys: (0..n_kv_heads).map(|_| head()).collect(), values: (0..n_kv_heads).map(|_| head()).collect() }
}

impl Kv {
    /// The same values in a cache of `t`.
    fn converted(&self, t: KvType) -> Kv {
        let conv = |rows: &Vec<KvRows>| {
            rows.iter().map(|r| KvRows::converted(t, r.as_f32().unwrap()).unwrap()).collect()
        };
        Kv { keys: conv(&self.keys), values: conv(&self.values) }
    }
}

/// Every KV type: the fast kernels read the typed cache as the oracle reads its decoded values
/// (the same tolerance as f32: the reading is exact, only the summation order differs), on every
/// thread count with the same bits; decode's key-range splits and prefill's tiles both.
#[test]
fn par_attention_reads_every_kv_type() {
    let mut rng = Rng(0xa77e_0002);
    let mut pools: Vec<ColdPool> = (1..=3).map(ColdPool::new).collect();
    let mut scratch = AttentionScratch::default();
    let shape = AttentionShape { n_heads: 8, n_kv_heads: 2, head_dim: 64 };
    for (first_pos, n_tokens, window) in [(0, 1, None), (300, 1, None), (300, 1, Some(100)), (260, 20, None)]
    {
        let f32_kv = random_kv(&mut rng, shape.n_kv_heads, first_pos + n_tokens, shape.head_dim);
        let q = rng.vec(n_tokens * shape.n_heads * shape.head_dim, 1.0);
        let f32_input = AttentionInput {
            shape,
            q: &q,
            keys: &f32_kv.keys,
            values: &f32_kv.values,
            first_pos,
            kv_start: 0,
            window,
            sinks: None,
        };
        let mut exact = vec![0.0; q.len()];
        attention_reference(&f32_input, &mut exact).unwrap();
        for t in KvType::ALL {
            let kv = f32_kv.converted(t);
            let input = AttentionInput {
                shape,
                q: &q,
                keys: &kv.keys,
                values: &kv.values,
                first_pos,
                kv_start: 0,
                window,
                sinks: None,
            };
            let mut expected = vec![0.0; q.len()];
            attention_reference(&input, &mut expected).unwrap();
            // Against the f32 cache: the type's rounding of keys and values (values ~U(-1, 1)).
            let rounding = exact.iter().zip(&expected).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            println!("{t} pos={first_pos} n={n_tokens} window={window:?}: |typed - f32| {rounding:.1e}");
            assert!(rounding <= kv_bound(t), "{t}: {rounding} against the f32 cache");
            for level in available() {
                let mut single = vec![f32::NAN; q.len()];
                attention(level, &input, &mut scratch, &mut single).unwrap();
                let error = relative_error(&single, &expected);
                assert!(
                    error <= tolerance(level, WeightDType::F32),
                    "{t} {level} pos={first_pos}: {error:e}"
                );
                for pool in pools.iter_mut() {
                    let mut out = vec![f32::NAN; q.len()];
                    par_attention(pool, level, &input, &mut scratch, &mut out).unwrap();
                    assert_eq!(out, single, "{t} {level}: thread count changed the bits");
                }
            }
        }
    }
}

/// The most a cache of `t` moves attention outputs of size ~1 from the f32 cache's (measured
/// worst: f16 2.4e-4, bf16 1.9e-3, q8_0 3.9e-3, at one position; printed by the test).
fn kv_bound(t: KvType) -> f32 {
    match t {
        KvType::F32 => 0.0,
        KvType::F16 => 1e-3,
        KvType::Bf16 | KvType::Q8_0 => 8e-3,
    }
}

/// A q8_0 cache needs heads of whole 32-value blocks: refused by name, not misread.
#[test]
fn attention_refuses_q8_0_heads_that_split_blocks() {
    let shape = AttentionShape { n_heads: 2, n_kv_heads: 1, head_dim: 48 };
    let kv = vec![KvRows::converted(KvType::Q8_0, &[0.5; 96]).unwrap()];
    let q = vec![1.0; 96];
    let input = AttentionInput {
        shape,
        q: &q,
        keys: &kv,
        values: &kv,
        first_pos: 1,
        kv_start: 0,
        window: None,
        sinks: None,
    };
    let err =
        attention(SimdLevel::Scalar, &input, &mut AttentionScratch::default(), &mut [0.0; 96]).unwrap_err();
    assert!(err.to_string().contains("head_dim (a multiple of the KV type's block)"), "{err}");
}

/// GQA shapes, decode and prefill after a prefix, with and without a sliding window.
#[test]
fn par_attention_matches_scalar_for_every_level_and_thread_count() {
    let mut rng = Rng(0xa77e_0001);
    let mut pools: Vec<ColdPool> = (1..=3).map(ColdPool::new).collect();
    let mut scratch = AttentionScratch::default();
    for shape in [
        AttentionShape { n_heads: 4, n_kv_heads: 2, head_dim: 64 },
        AttentionShape { n_heads: 3, n_kv_heads: 3, head_dim: 9 },
        AttentionShape { n_heads: 8, n_kv_heads: 1, head_dim: 128 },
    ] {
        for (first_pos, n_tokens, window) in
            // key chunks of 256 (260 + 9 crosses one); decode (< 4 tokens) splits keys by 128
            [
                (0, 1, None),
                (0, 7, None),
                (5, 1, None),
                (5, 6, Some(3)),
                (40, 1, Some(16)),
                (0, 33, None),
                (260, 9, None),
                (260, 9, Some(200)),
            ]
        {
            let kv = random_kv(&mut rng, shape.n_kv_heads, first_pos + n_tokens, shape.head_dim);
            let q = rng.vec(n_tokens * shape.n_heads * shape.head_dim, 1.0);
            let input = AttentionInput {
                shape,
                q: &q,
                keys: &kv.keys,
                values: &kv.values,
                first_pos,
                kv_start: 0,
                window,
                sinks: None,
            };
            let mut expected = vec![0.0; q.len()];
            attention_reference(&input, &mut expected).unwrap();
            for level in available() {
                let mut first: Option<Vec<f32>> = None;
                let mut single = vec![f32::NAN; q.len()];
                attention(level, &input, &mut scratch, &mut single).unwrap();
                assert!(relative_error(&single, &expected) <= tolerance(level, WeightDType::F32));
                for pool in pools.iter_mut() {
                    let mut out = vec![f32::NAN; q.len()];
                    par_attention(pool, level, &input, &mut scratch, &mut out).unwrap();
                    let error = relative_error(&out, &expected);
                    assert!(
                        error <= tolerance(level, WeightDType::F32),
                        "{level} {shape:?} pos={first_pos} n={n_tokens}: {error:e}"
                    );
                    match &first {
                        None => first = Some(out),
                        Some(bits) => assert_eq!(&out, bits, "{level}: thread count changed the bits"),
                    }
                }
                assert_eq!(Some(single), first, "{level}: the calling-thread form differs");
            }
        }
    }
}

/// A call with no tokens writes nothing and does not fail.
#[test]
fn attention_of_no_tokens_is_empty() {
    let mut pool = ColdPool::new(2);
    let shape = AttentionShape { n_heads: 4, n_kv_heads: 2, head_dim: 8 };
    let kv: Vec<KvRows> = vec![KvRows::from_f32(vec![0.5; 3 * 8]); 2];
    let input = AttentionInput {
        shape,
        q: &[],
        keys: &kv,
        values: &kv,
        first_pos: 3,
        kv_start: 0,
        window: None,
        sinks: None,
    };
    let mut scratch = AttentionScratch::default();
    par_attention(&mut pool, SimdLevel::Scalar, &input, &mut scratch, &mut []).unwrap();
    attention(SimdLevel::Scalar, &input, &mut scratch, &mut []).unwrap();
}

#[test]
fn par_attention_rejects_a_short_cache() {
    let mut pool = ColdPool::new(2);
    let shape = AttentionShape { n_heads: 2, n_kv_heads: 1, head_dim: 4 };
    let (keys, values) = (vec![KvRows::from_f32(vec![0.0; 8])], vec![KvRows::from_f32(vec![0.0; 8])]);
    let q = vec![1.0; 8];
    let input = AttentionInput {
        shape,
        q: &q,
        keys: &keys,
        values: &values,
        first_pos: 2,
        kv_start: 0,
        window: None,
        sinks: None,
    };
    let mut out = vec![0.0; 8];
    let err = par_attention(&mut pool, SimdLevel::Scalar, &input, &mut AttentionScratch::default(), &mut out);
    assert!(err.is_err(), "position 2 of a 2-position cache holds no room for the call's token");
}
