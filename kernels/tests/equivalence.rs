//! Every SIMD level this CPU runs against the scalar reference: all weight dtypes, all
//! activations, odd and real shapes, decode (1 token) and prefill (many tokens per expert),
//! misaligned weight bytes. Tolerances: see `common::tolerance`.

mod common;

use common::{relative_error, tolerance, MisalignedBytes, Rng};
use moe_lanes_kernels::{
    available, down_accumulate, expert_ffn_accumulate, gate_up_activation, gemv_rows, matmul_rows,
    Activation, ExpertWeights, SimdLevel, WeightDType,
};

struct OwnedExpert {
    gate: MisalignedBytes,
    up: MisalignedBytes,
    down: MisalignedBytes,
    dtype: WeightDType,
    hidden: usize,
    ff: usize,
}

impl OwnedExpert {
    fn random(rng: &mut Rng, dtype: WeightDType, hidden: usize, ff: usize) -> OwnedExpert {
        let scale_in = 1.0 / (hidden as f32).sqrt();
        let scale_down = 1.0 / (ff as f32).sqrt();
        OwnedExpert {
            gate: MisalignedBytes::new(dtype, &rng.vec(ff * hidden, 2.0 * scale_in)),
            up: MisalignedBytes::new(dtype, &rng.vec(ff * hidden, 2.0 * scale_in)),
            down: MisalignedBytes::new(dtype, &rng.vec(hidden * ff, 2.0 * scale_down)),
            dtype,
            hidden,
            ff,
        }
    }
    fn view(&self) -> ExpertWeights<'_> {
        ExpertWeights {
            gate: self.gate.bytes(),
            up: self.up.bytes(),
            down: self.down.bytes(),
            dtype: self.dtype,
            down_dtype: self.dtype,
            hidden: self.hidden,
            ff: self.ff,
            bias: None,
        }
    }
}

const ODD_SHAPES: [(usize, usize); 4] = [(37, 53), (53, 37), (1, 9), (100, 33)];
const ACTIVATIONS: [Activation; 3] = [Activation::Silu, Activation::Gelu, Activation::GeluTanh];

fn check_expert_ffn(rng: &mut Rng, hidden: usize, ff: usize, token_counts: &[usize]) {
    for dtype in WeightDType::FLOATS {
        let expert = OwnedExpert::random(rng, dtype, hidden, ff);
        let weights = expert.view();
        for &n_tokens in token_counts {
            let x = rng.vec(n_tokens * hidden, 1.0);
            let token_weight = rng.vec(n_tokens, 1.0);
            let initial = rng.vec(n_tokens * hidden, 0.5);
            for act in ACTIVATIONS {
                let mut reference = initial.clone();
                expert_ffn_accumulate(SimdLevel::Scalar, &weights, act, &x, &token_weight, &mut reference)
                    .unwrap();
                for level in available() {
                    let mut out = initial.clone();
                    expert_ffn_accumulate(level, &weights, act, &x, &token_weight, &mut out).unwrap();
                    let error = relative_error(&out, &reference);
                    assert!(
                        error <= tolerance(level, dtype),
                        "{level} {dtype:?} {act:?} {hidden}x{ff} tokens={n_tokens}: relative error {error:e}"
                    );
                }
            }
        }
    }
}

#[test]
fn expert_ffn_odd_shapes_match_scalar_for_every_level() {
    let mut rng = Rng(0x1234_5678);
    for (hidden, ff) in ODD_SHAPES {
        // 1 = decode; 2..13 cover every token-tile remainder; 13 > one token block.
        check_expert_ffn(&mut rng, hidden, ff, &[1, 2, 3, 4, 5, 7, 13]);
    }
}

#[test]
fn expert_ffn_2048x768_decode_and_prefill_match_scalar_for_every_level() {
    let mut rng = Rng(0xDEC0DE);
    check_expert_ffn(&mut rng, 2048, 768, &[1, 9, 33]);
}

#[test]
fn expert_ffn_tile_shapes_match_scalar_for_every_level() {
    // Shapes and token counts of the AMX tiles (columns a multiple of 32, 8 or more tokens):
    // whole and partial 16-row blocks, 16-token tiles with and without padding, more than one
    // pass of four token tiles (70 tokens); down over 40 columns stays on the AVX-512 kernels.
    let mut rng = Rng(0xA3A);
    for (hidden, ff) in [(64, 96), (96, 40)] {
        check_expert_ffn(&mut rng, hidden, ff, &[8, 16, 17, 70]);
    }
}

#[test]
fn gemv_and_matmul_row_ranges_match_scalar() {
    let mut rng = Rng(77);
    for dtype in WeightDType::FLOATS {
        for (rows, cols) in [(53, 37), (19, 64), (8, 1), (40, 129)] {
            let matrix = MisalignedBytes::new(dtype, &rng.vec(rows * cols, 1.0));
            for n_tokens in [1, 6, 11] {
                let x = rng.vec(n_tokens * cols, 1.0);
                for range in [0..rows, 3..rows.min(17), rows - 1..rows, 5..5] {
                    let range = range.start.min(rows)..range.end.min(rows).max(range.start.min(rows));
                    let mut reference = vec![0.0; n_tokens * range.len()];
                    matmul_rows(
                        SimdLevel::Scalar,
                        dtype,
                        matrix.bytes(),
                        cols,
                        &x,
                        range.clone(),
                        &mut reference,
                    )
                    .unwrap();
                    for level in available() {
                        let mut y = vec![f32::NAN; n_tokens * range.len()];
                        matmul_rows(level, dtype, matrix.bytes(), cols, &x, range.clone(), &mut y).unwrap();
                        let error = relative_error(&y, &reference);
                        assert!(
                            error <= tolerance(level, dtype),
                            "{level} {dtype:?} {rows}x{cols} {range:?}: {error:e}"
                        );
                        if n_tokens == 1 {
                            let mut y1 = vec![f32::NAN; range.len()];
                            gemv_rows(level, dtype, matrix.bytes(), cols, &x, range.clone(), &mut y1)
                                .unwrap();
                            assert_eq!(y1, y, "gemv_rows equals matmul_rows for one token");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn split_row_ranges_compose_to_the_whole_expert() {
    // gate/up over two ff ranges and down over two hidden ranges equal the whole-expert call.
    let mut rng = Rng(99);
    // (64, 96, 9): the AMX tiles' shape, split inside a 16-row block.
    for (hidden, ff, n_tokens) in [(45, 29, 4), (64, 96, 9)] {
        split_ranges_compose(&mut rng, hidden, ff, n_tokens);
    }
}

fn split_ranges_compose(rng: &mut Rng, hidden: usize, ff: usize, n_tokens: usize) {
    for dtype in WeightDType::FLOATS {
        let expert = OwnedExpert::random(rng, dtype, hidden, ff);
        let weights = expert.view();
        let x = rng.vec(n_tokens * hidden, 1.0);
        let token_weight = rng.vec(n_tokens, 1.0);
        for level in available() {
            let mut whole = vec![0.0; n_tokens * hidden];
            expert_ffn_accumulate(level, &weights, Activation::Silu, &x, &token_weight, &mut whole).unwrap();
            let mut h = vec![f32::NAN; n_tokens * ff];
            gate_up_activation(level, &weights, Activation::Silu, &x, 0..13, &mut h).unwrap();
            gate_up_activation(level, &weights, Activation::Silu, &x, 13..ff, &mut h).unwrap();
            let mut split = vec![0.0; n_tokens * hidden];
            down_accumulate(level, &weights, &h, &token_weight, 0..20, &mut split).unwrap();
            down_accumulate(level, &weights, &h, &token_weight, 20..hidden, &mut split).unwrap();
            assert_eq!(split, whole, "{level} {dtype:?}");
        }
    }
}

#[test]
fn shape_errors_are_reported() {
    let matrix = vec![0u8; 2 * 10 * 4];
    let mut y = vec![0.0; 2];
    assert!(gemv_rows(SimdLevel::Scalar, WeightDType::F32, &matrix, 10, &[0.0; 9], 0..2, &mut y).is_err());
    assert!(gemv_rows(SimdLevel::Scalar, WeightDType::F32, &matrix, 10, &[0.0; 10], 0..3, &mut y).is_err());
    let weights = ExpertWeights {
        gate: &matrix,
        up: &matrix,
        down: &matrix[1..],
        dtype: WeightDType::F32,
        down_dtype: WeightDType::F32,
        hidden: 10,
        ff: 2,
        bias: None,
    };
    assert!(weights.validate().is_err());
}
