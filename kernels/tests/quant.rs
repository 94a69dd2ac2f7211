//! Quantised weights in the kernels: block dequantisation equal to gguf-py's on the committed
//! fixtures (tests/fixtures/quant, made by tests/fixtures/make_quant.py), and every SIMD level's
//! expert FFN and GEMV/GEMM over quantised rows against the scalar kernel (tolerance
//! `F32_ACCUMULATION_TOLERANCE`: activations stay f32, so only the summation order differs),
//! and the scalar quantised kernel against a plain f32 product over the dequantised rows; the
//! 8-bit-activation decode tiles (VNNI) within the activation rounding bound of
//! `moe_lanes_kernels::q8` of the exact product, and equal (to f32 rounding) to the exact
//! product with the rounded activations.

mod common;

use common::{q8_rounding_bound, relative_error, QuantBytes, Rng, F32_ACCUMULATION_TOLERANCE};
use moe_lanes_kernels::{
    available, expert_ffn_accumulate, gemv_rows_q8, has_avx512_vnni, matmul_rows, matmul_rows_q8, quant,
    Activation, ExpertWeights, Q8Activations, SimdLevel, WeightDType,
};
use std::path::PathBuf;

fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/quant").join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

#[test]
fn block_dequantization_equals_gguf_py() {
    for dtype in WeightDType::QUANTIZED {
        let blocks = fixture(&format!("{}.blocks", dtype.name()));
        let expected = floats(&fixture(&format!("{}.dequant.f32", dtype.name())));
        let (n, bb) = (dtype.block_elems(), dtype.block_bytes());
        for (i, (block, want)) in blocks.chunks_exact(bb).zip(expected.chunks_exact(n)).enumerate() {
            let mut got = vec![0.0f32; n];
            quant::dequantize_block(dtype, block, &mut got);
            assert!(got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()), "{dtype:?} block {i}");
        }
        let mut row = vec![0.0f32; expected.len()];
        dtype.decode_row(&blocks, &mut row);
        assert_eq!(row, expected, "{dtype:?} decode_row");
        assert_eq!(dtype.load_f32(&blocks, n + 3), expected[n + 3], "{dtype:?} load_f32");
    }
}

#[test]
fn matmul_over_quantized_rows_matches_scalar_and_dequantized_f32() {
    let mut rng = Rng(0x0051_7A7E);
    for dtype in WeightDType::QUANTIZED {
        for (rows, cols) in [(19, 256), (8, 512), (33, 768), (16, 2048)] {
            let matrix = QuantBytes::random(&mut rng, dtype, rows, cols, 0.02);
            let mut dense = vec![0.0f32; rows * cols];
            dtype.decode_row(matrix.bytes(), &mut dense);
            let dense_bytes = WeightDType::F32.encode(&dense);
            for n_tokens in [1, 5, 13, 40] {
                let x = rng.vec(n_tokens * cols, 1.0);
                let mut plain = vec![0.0; n_tokens * rows];
                matmul_rows(SimdLevel::Scalar, WeightDType::F32, &dense_bytes, cols, &x, 0..rows, &mut plain)
                    .unwrap();
                let mut reference = vec![0.0; n_tokens * rows];
                matmul_rows(SimdLevel::Scalar, dtype, matrix.bytes(), cols, &x, 0..rows, &mut reference)
                    .unwrap();
                let error = relative_error(&reference, &plain);
                assert!(error <= F32_ACCUMULATION_TOLERANCE, "scalar {dtype:?} vs f32: {error:e}");
                for level in available() {
                    for range in [0..rows, 3..rows - 1] {
                        let mut y = vec![f32::NAN; n_tokens * range.len()];
                        matmul_rows(level, dtype, matrix.bytes(), cols, &x, range.clone(), &mut y).unwrap();
                        let want: Vec<f32> = (0..n_tokens)
                            .flat_map(|t| reference[t * rows + range.start..t * rows + range.end].to_vec())
                            .collect();
                        let error = relative_error(&y, &want);
                        assert!(
                            error <= F32_ACCUMULATION_TOLERANCE,
                            "{level} {dtype:?} {rows}x{cols}: {error:e}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn expert_ffn_over_mixed_quantized_types_matches_scalar_for_every_level() {
    let mut rng = Rng(0xFF7_0001);
    // gate/up in one block type, down in another (as a Q4_K_M file mixes them).
    let mixes = [
        (WeightDType::Q4_K, WeightDType::Q6_K),
        (WeightDType::Q5_K, WeightDType::Q5_K),
        (WeightDType::Q8_0, WeightDType::Q4_0),
        (WeightDType::Q4_0, WeightDType::Q8_0),
        (WeightDType::Q6_K, WeightDType::Q4_K),
    ];
    let (hidden, ff) = (512, 256);
    for (dtype, down_dtype) in mixes {
        let gate = QuantBytes::random(&mut rng, dtype, ff, hidden, 0.004);
        let up = QuantBytes::random(&mut rng, dtype, ff, hidden, 0.004);
        let down = QuantBytes::random(&mut rng, down_dtype, hidden, ff, 0.006);
        let weights = ExpertWeights {
            gate: gate.bytes(),
            up: up.bytes(),
            down: down.bytes(),
            dtype,
            down_dtype,
            hidden,
            ff,
            bias: None,
        };
        for n_tokens in [1, 2, 7, 8, 21, 40] {
            let x = rng.vec(n_tokens * hidden, 1.0);
            let token_weight = rng.vec(n_tokens, 1.0);
            let mut reference = vec![0.0; n_tokens * hidden];
            expert_ffn_accumulate(
                SimdLevel::Scalar,
                &weights,
                Activation::Silu,
                &x,
                &token_weight,
                &mut reference,
            )
            .unwrap();
            assert!(reference.iter().any(|v| *v != 0.0) && reference.iter().all(|v| v.is_finite()));
            for level in available() {
                let mut out = vec![0.0; n_tokens * hidden];
                expert_ffn_accumulate(level, &weights, Activation::Silu, &x, &token_weight, &mut out)
                    .unwrap();
                let error = relative_error(&out, &reference);
                assert!(
                    error <= F32_ACCUMULATION_TOLERANCE,
                    "{level} {dtype:?}/{down_dtype:?} n={n_tokens}: {error:e}"
                );
            }
        }
    }
}

#[test]
fn quantized_rows_that_are_not_whole_blocks_are_refused() {
    let bytes = vec![0u8; 2 * 34];
    let mut y = vec![0.0; 1];
    assert!(matmul_rows(SimdLevel::Scalar, WeightDType::Q8_0, &bytes, 48, &[0.0; 48], 0..1, &mut y).is_err());
    let weights = ExpertWeights {
        gate: &bytes,
        up: &bytes,
        down: &bytes,
        dtype: WeightDType::Q8_0,
        down_dtype: WeightDType::Q8_0,
        hidden: 64,
        ff: 1,
        bias: None,
    };
    assert!(weights.validate().is_err(), "down rows of 1 value are not whole Q8_0 blocks");
}

/// Activations with a different magnitude per block of 32 (up to 1000x apart) and some
/// all-zero blocks, so per-block scales matter.
fn uneven_activations(rng: &mut Rng, cols: usize) -> Vec<f32> {
    let mut x = rng.vec(cols, 1.0);
    for block in x.chunks_mut(32) {
        let magnitude = match rng.below(8) {
            0 => 0.0,
            1 => 1e-3,
            2 => 30.0,
            _ => 1.0,
        };
        block.iter_mut().for_each(|v| *v *= magnitude);
    }
    x
}

#[test]
fn q8_decode_tiles_stay_within_the_activation_rounding_bound() {
    let mut rng = Rng(0x0008_AC71);
    for dtype in WeightDType::QUANTIZED {
        // 1 and 8 rows: one tile of each; 19: two 8-row tiles and three 1-row tiles.
        for (rows, cols) in [(1, 256), (8, 512), (19, 768), (8, 2048)] {
            let matrix = QuantBytes::random(&mut rng, dtype, rows, cols, 0.05);
            let mut w = vec![0.0f32; rows * cols];
            dtype.decode_row(matrix.bytes(), &mut w);
            let x = uneven_activations(&mut rng, cols);
            let q8 = Q8Activations::quantize(&x).unwrap();
            let x_rounded = q8.dequantized(0);
            for level in available() {
                let mut y = vec![f32::NAN; rows];
                gemv_rows_q8(level, dtype, matrix.bytes(), cols, &q8, 0..rows, &mut y).unwrap();
                for (r, &got) in y.iter().enumerate() {
                    let w = &w[r * cols..][..cols];
                    let exact: f64 = w.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let rounded: f64 = w.iter().zip(&x_rounded).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let abs_sum: f64 = w.iter().zip(&x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                    let f32_slack = 1e-5 * abs_sum + 1e-30;
                    let what = format!("{level} {dtype:?} {rows}x{cols} row {r}");
                    assert!((got as f64 - rounded).abs() <= f32_slack, "{what}: {got} vs rounded {rounded}");
                    let bound = q8_rounding_bound(w, &x) + f32_slack;
                    assert!((got as f64 - exact).abs() <= bound, "{what}: {got} vs {exact}, bound {bound}");
                }
            }
        }
    }
}

/// A few tokens at once (the cold lane's experts of 2-4 tokens; VNNI runs 8 Q4_K / Q5_K rows
/// two tokens at a time) give each token what it gets alone, to f32 summation order.
#[test]
fn q8_tiles_of_a_few_tokens_give_each_token_its_own_result() {
    let mut rng = Rng(0x0008_70C5);
    for dtype in WeightDType::QUANTIZED {
        for (rows, cols) in [(8, 512), (19, 768), (16, 2048)] {
            let matrix = QuantBytes::random(&mut rng, dtype, rows, cols, 0.05);
            for n_tokens in 1..=4 {
                let xs: Vec<Vec<f32>> = (0..n_tokens).map(|_| uneven_activations(&mut rng, cols)).collect();
                let mut q8 = Q8Activations::new();
                q8.reserve_rows(n_tokens, cols).unwrap();
                xs.iter().enumerate().for_each(|(t, x)| q8.quantize_row(t, x));
                for level in available() {
                    let mut y = vec![f32::NAN; rows * n_tokens];
                    matmul_rows_q8(level, dtype, matrix.bytes(), cols, (&q8, n_tokens), 0..rows, &mut y)
                        .unwrap();
                    for (t, x) in xs.iter().enumerate() {
                        let one = Q8Activations::quantize(x).unwrap();
                        let mut alone = vec![f32::NAN; rows];
                        gemv_rows_q8(level, dtype, matrix.bytes(), cols, &one, 0..rows, &mut alone).unwrap();
                        let scale = alone.iter().fold(1e-30f32, |m, v| m.max(v.abs()));
                        for (r, &want) in alone.iter().enumerate() {
                            let got = y[t * rows + r];
                            let what = format!(
                                "{level} {dtype:?} {rows}x{cols}, {n_tokens} tokens, token {t} row {r}"
                            );
                            assert!((got - want).abs() <= 1e-5 * scale, "{what}: {got} vs alone {want}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn q8_activations_round_to_nearest_with_one_scale_per_32() {
    let mut x: Vec<f32> = (0..64).map(|i| i as f32 - 20.0).collect();
    x[40] = -127.0; // the second block's max |x|: its step is exactly 1.
    let q8 = Q8Activations::quantize(&x).unwrap();
    let back = q8.dequantized(0);
    assert_eq!(&back[32..], &x[32..]);
    let step = 20.0f32 / 127.0;
    assert!(back[..32].iter().zip(&x).all(|(b, v)| (b - v).abs() <= step / 2.0 * 1.0001));
    assert_eq!(back[0], -20.0);
    assert!(Q8Activations::quantize(&x[..40]).is_err());
    assert_eq!(Q8Activations::quantize(&[0.0; 32]).unwrap().dequantized(0), vec![0.0; 32]);
    println!("vnni: {}", has_avx512_vnni());
}
