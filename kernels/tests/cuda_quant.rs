//! The quantized-block CUDA kernels (`kernels/cuda/quant.cu`) against the CPU's dequantization
//! (`quant::dequantize_block`) for every type: the dequantizing GEMV within the f32 summation
//! bound of an f64 product over the CPU-dequantized rows, the dequantization to bf16 bit-equal to
//! the CPU values rounded to bf16, a prefill tile (dequantize, then the cuBLAS bf16 GEMM), and bad
//! shapes refused. The 8-bit activation path: `quantize_q8` bit-equal to the CPU's
//! `Q8Activations`, and its integer GEMVs within the same f32 bound of an f64 product over the
//! dequantized rows and the dequantized activations (so the only error beyond f32 order is the
//! rounding of x, which `q8.rs` bounds). Every test skips without a CUDA device (and fails when MOE_LANES_REQUIRE_GPU
//! is set).

mod common;

use common::cuda::{backend, mean_launch_us, tiles_of_at_most, DeviceQ8};
use common::Rng;
use half::bf16;
use moe_lanes_kernels::cuda::kernel::{GROUPED_DECODE_TILE_ROWS, GROUPED_TILE_ROWS};
use moe_lanes_kernels::cuda::quant::TYPED_TAIL_BYTES;
use moe_lanes_kernels::cuda::{CudaBackend, CudaError, GateUpEpilogue, Glu, Q8Rows, TypedWeights};
use moe_lanes_kernels::{quant, WeightDType};

/// Random rows of `dtype` blocks: random bytes (every scale/min/nibble pattern), the f16 scales
/// (`d`, and `dmin` for Q4_K/Q5_K, `m` for Q5_1) set to finite values in [-0.05, 0.05).
fn random_blocks(rng: &mut Rng, dtype: WeightDType, rows: usize, cols: usize) -> Vec<u8> {
    let mut bytes: Vec<u8> = (0..rows * dtype.row_bytes(cols)).map(|_| rng.next_u64() as u8).collect();
    let scale_at: &[usize] = match dtype {
        WeightDType::Q8_0 | WeightDType::Q4_0 | WeightDType::Q5_0 | WeightDType::Iq4Nl => &[0],
        WeightDType::Q4_K | WeightDType::Q5_K | WeightDType::Q5_1 => &[0, 2],
        WeightDType::Q6_K => &[208],
        WeightDType::Mxfp4 => &[],
        float => panic!("{float:?} is not quantized"),
    };
    if dtype == WeightDType::Mxfp4 {
        // E8M0 scales putting the largest values within about [-0.05, 0.05].
        bytes.chunks_exact_mut(dtype.block_bytes()).for_each(|b| b[0] = common::mxfp4_scale_byte(rng, 0.05));
    }
    for block in bytes.chunks_exact_mut(dtype.block_bytes()) {
        for &at in scale_at {
            let d = half::f16::from_f32(rng.symmetric(0.05)).to_bits().to_le_bytes();
            block[at..at + 2].copy_from_slice(&d);
        }
    }
    bytes
}

/// The CPU dequantization, block by block.
fn dequantize(dtype: WeightDType, bytes: &[u8]) -> Vec<f32> {
    let n_blocks = bytes.len() / dtype.block_bytes();
    let mut out = vec![0.0f32; n_blocks * dtype.block_elems()];
    for (block, y) in bytes.chunks_exact(dtype.block_bytes()).zip(out.chunks_exact_mut(dtype.block_elems())) {
        quant::dequantize_block(dtype, block, y);
    }
    out
}

/// `(value, bound)` per output: `y0 + sum_k w x` in f64, and the error bound of an f32 sum of
/// those terms in any order, `(k / 32 + 8) * EPSILON * (|y0| + sum_k |w x|)`: a lane adds
/// `k / 32` products, the warp tree 5 levels, the accumulation one (each rounding at most
/// `EPSILON / 2` relative; the factor 2 is margin). One wrong value of `k` would show as about
/// `1 / k` of the sum, far above the bound.
fn gemv_reference(w: &[f32], x: &[f32], y0: &[f32], n: usize, k: usize) -> Vec<(f64, f64)> {
    let rounds = (k / 32 + 8) as f64 * f32::EPSILON as f64;
    (0..y0.len())
        .map(|o| {
            let (t, r) = (o / n, o % n);
            let terms = w[r * k..][..k].iter().zip(&x[t * k..][..k]).map(|(a, b)| *a as f64 * *b as f64);
            let (sum, abs) =
                terms.fold((y0[o] as f64, (y0[o] as f64).abs()), |(s, a), v| (s + v, a + v.abs()));
            (sum, rounds * abs)
        })
        .collect()
}

/// Block counts per row: one, a partial warp step, and several steps.
fn block_counts(dtype: WeightDType) -> [usize; 3] {
    if dtype.block_elems() == 32 {
        [1, 11, 40]
    } else {
        [1, 3, 11]
    }
}

/// Runs the GEMV on rows `1..=n` of an `n + 1`-row matrix (so the weights start one row in, at
/// an odd block count for the `[.., 11, ..]` shapes) with `x` one f32 into its buffer when
/// `offset_x` (no 16-byte alignment), `y` prefilled with `y0`; returns y.
fn run_gemv(
    be: &CudaBackend,
    dtype: WeightDType,
    matrix: &[u8],
    x: &[f32],
    y0: &[f32],
    (t, n, k): (usize, usize, usize),
    (accumulate, offset_x): (bool, bool),
) -> Vec<f32> {
    let dw = be.upload(matrix).unwrap();
    let pad = offset_x as usize;
    let dx = be.upload(&[vec![0.0f32; pad], x.to_vec()].concat()).unwrap();
    let dy = be.upload(y0).unwrap();
    let w = dw.ptr().from(dtype.row_bytes(k));
    be.gemv_quant(dtype, w, dx.ptr().from(pad), dy.ptr(), t, n, k, accumulate).unwrap();
    be.read_vec(dy.ptr()).unwrap()
}

#[test]
fn gemv_of_every_type_matches_the_cpu_dequantization() {
    let Some(be) = backend() else { return };
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for dtype in WeightDType::QUANTIZED {
        for blocks_per_row in block_counts(dtype) {
            let k = blocks_per_row * dtype.block_elems();
            for (t, n, accumulate, offset_x) in
                [(1, 37, false, false), (3, 9, true, true), (11, 5, true, false)]
            {
                let matrix = random_blocks(&mut rng, dtype, n + 1, k);
                let w = dequantize(dtype, &matrix[dtype.row_bytes(k)..]);
                let x = rng.vec(t * k, 1.0);
                let y0 = rng.vec(t * n, 1.0);
                let y = run_gemv(be, dtype, &matrix, &x, &y0, (t, n, k), (accumulate, offset_x));
                let base = if accumulate { y0.clone() } else { vec![0.0; t * n] };
                let want = gemv_reference(&w, &x, &base, n, k);
                let mut worst = 0.0f64;
                for (o, (got, (value, bound))) in y.iter().zip(&want).enumerate() {
                    let err = (*got as f64 - value).abs();
                    assert!(
                        err <= *bound,
                        "{dtype:?} t={t} n={n} k={k} out {o}: {got} vs {value} (bound {bound:e})"
                    );
                    worst = worst.max(err / bound.max(f64::MIN_POSITIVE));
                }
                eprintln!("gemv {} t={t} n={n} k={k}: worst error {worst:.3} of the bound", dtype.name());
            }
        }
    }
}

/// Rows enough for the one-token GEMV to take two rows a warp (sharing the loads of x).
fn shared_x_rows(be: &CudaBackend) -> usize {
    2 * be.info().multiprocessors as usize * moe_lanes_kernels::cuda::quant::WIDE_MIN_WARPS_PER_SM + 3
}

/// The one-token GEMV takes one row a warp for small matrices and two (sharing the loads of x)
/// for large ones: each row's sum is the same bits either way.
#[test]
fn rows_per_warp_leave_the_sums_unchanged() {
    let Some(be) = backend() else { return };
    let mut rng = Rng(0x51DE_CA75);
    let big = shared_x_rows(be);
    assert_eq!(be.wide_rows_per_warp(37), 1);
    assert!(be.wide_rows_per_warp(big) > 1, "{big} rows take the shared-x form");
    for dtype in WeightDType::QUANTIZED {
        let k = 2 * dtype.block_elems();
        let matrix = random_blocks(&mut rng, dtype, big + 1, k);
        let x = rng.vec(k, 1.0);
        let all = run_gemv(be, dtype, &matrix, &x, &vec![0.0; big], (1, big, k), (false, false));
        let few = run_gemv(be, dtype, &matrix, &x, &[0.0; 37], (1, 37, k), (false, false));
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&all[..37]), bits(&few), "{dtype:?}");
        let w = dequantize(dtype, &matrix[dtype.row_bytes(k)..]);
        for (o, (got, (value, bound))) in
            all.iter().zip(gemv_reference(&w, &x, &vec![0.0; big], big, k)).enumerate()
        {
            assert!((*got as f64 - value).abs() <= bound, "{dtype:?} row {o}: {got} vs {value}");
        }
    }
}

/// `rows` rows of `k` values of x in 8 bits on the device (`quantize_q8` of an upload of `x`)
/// and the values the integer dots see, `d * q` (checked bit-equal to the CPU's).
struct QuantizedX {
    dev: DeviceQ8,
    values: Vec<f32>,
}

impl QuantizedX {
    fn new(be: &CudaBackend, x: &[f32], rows: usize, k: usize) -> QuantizedX {
        let dx = be.upload(x).unwrap();
        let dev = DeviceQ8::zeroed(be, rows * k);
        be.quantize_q8(dx.ptr(), rows, k, dev.rows()).unwrap();
        let values = dev.seen(be, x, k, "quantize_q8");
        QuantizedX { dev, values }
    }

    fn rows(&self) -> Q8Rows {
        self.dev.rows()
    }
}

/// The 8-bit one-token GEMV of every type (`gemv_quant_q8`, one row a warp and two) against an
/// f64 product of the CPU-dequantized rows and the dequantized activations, within the f32 bound
/// of the f32 GEMV; each row's sum the same bits at either rows per warp; a block of zeros in x
/// (d = 0) and an accumulating call included.
#[test]
fn q8_gemv_of_every_type_matches_the_dequantized_activations() {
    let Some(be) = backend() else { return };
    let mut rng = Rng(0x0008_B175);
    let big = shared_x_rows(be);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for dtype in WeightDType::QUANTIZED {
        for blocks_per_row in block_counts(dtype) {
            let k = blocks_per_row * dtype.block_elems();
            let mut x = rng.vec(k, 1.0);
            x[32..64.min(k)].iter_mut().for_each(|v| *v = 0.0);
            let xq = QuantizedX::new(be, &x, 1, k);
            let mut sums = Vec::new();
            for (n, accumulate) in [(37, true), (big, false)] {
                let matrix = random_blocks(&mut rng, dtype, n, k);
                let w = dequantize(dtype, &matrix);
                let y0 = rng.vec(n, 1.0);
                let (dw, dy) = (be.upload(&matrix).unwrap(), be.upload(&y0).unwrap());
                be.gemv_quant_q8(dtype, dw.ptr(), xq.rows(), dy.ptr(), n, k, accumulate).unwrap();
                let y = be.read_vec(dy.ptr()).unwrap();
                let base = if accumulate { y0 } else { vec![0.0; n] };
                for (o, (got, (value, bound))) in
                    y.iter().zip(gemv_reference(&w, &xq.values, &base, n, k)).enumerate()
                {
                    assert!(
                        (*got as f64 - value).abs() <= bound,
                        "{dtype:?} n={n} k={k} row {o}: {got} vs {value}"
                    );
                }
                // the same 37 rows again in the big matrix's first rows: one row a warp there too
                if n == 37 {
                    let dz = be.upload(&vec![0.0f32; n]).unwrap();
                    be.gemv_quant_q8(dtype, dw.ptr(), xq.rows(), dz.ptr(), n, k, false).unwrap();
                    sums.push((matrix, be.read_vec(dz.ptr()).unwrap()));
                }
            }
            let (matrix, few) = sums.pop().unwrap();
            let rows: Vec<u8> = [matrix, random_blocks(&mut rng, dtype, big - 37, k)].concat();
            let (dw, dy) = (be.upload(&rows).unwrap(), be.alloc_zeros::<f32>(big).unwrap());
            be.gemv_quant_q8(dtype, dw.ptr(), xq.rows(), dy.ptr(), big, k, false).unwrap();
            assert_eq!(
                bits(&be.read_vec(dy.ptr()).unwrap()[..37]),
                bits(&few),
                "{dtype:?} k={k}: rows per warp"
            );
        }
    }
}

/// The 8-bit GEMV over a few tokens (`gemv_quant_q8_tokens`: 2 to 11 tokens, one launch or
/// two) against the f64 product of the dequantized rows and each token's dequantized
/// activations, and each token's sums the same bits as the one-token GEMV gives that token alone
/// (one row a warp); accumulating calls included.
#[test]
fn q8_gemv_of_a_few_tokens_gives_each_token_its_one_token_sums() {
    let Some(be) = backend() else { return };
    let mut rng = Rng(0x0008_70C5);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let n = 37;
    for dtype in WeightDType::QUANTIZED {
        for blocks_per_row in block_counts(dtype) {
            let k = blocks_per_row * dtype.block_elems();
            let matrix = random_blocks(&mut rng, dtype, n, k);
            let (w, dw) = (dequantize(dtype, &matrix), be.upload(&matrix).unwrap());
            for (t, accumulate) in [(2, false), (5, true), (8, false), (11, true)] {
                let x = rng.vec(t * k, 1.0);
                let xq = QuantizedX::new(be, &x, t, k);
                let y0 = rng.vec(t * n, 1.0);
                let dy = be.upload(&y0).unwrap();
                be.gemv_quant_q8_tokens(dtype, dw.ptr(), xq.rows(), dy.ptr(), t, n, k, accumulate).unwrap();
                let y = be.read_vec(dy.ptr()).unwrap();
                let base = if accumulate { y0.clone() } else { vec![0.0; t * n] };
                for (o, (got, (value, bound))) in
                    y.iter().zip(gemv_reference(&w, &xq.values, &base, n, k)).enumerate()
                {
                    let at = format!("{dtype:?} k={k} t={t} token {} row {}", o / n, o % n);
                    assert!((*got as f64 - value).abs() <= bound, "{at}: {got} vs {value}");
                }
                for tok in 0..t {
                    let one = QuantizedX::new(be, &x[tok * k..][..k], 1, k);
                    let dz = be.upload(&y0[tok * n..][..n]).unwrap();
                    be.gemv_quant_q8(dtype, dw.ptr(), one.rows(), dz.ptr(), n, k, accumulate).unwrap();
                    assert_eq!(
                        bits(&y[tok * n..][..n]),
                        bits(&be.read_vec(dz.ptr()).unwrap()),
                        "{dtype:?} k={k} t={t}: token {tok} alone"
                    );
                }
            }
        }
    }
}

fn bf16_bits(values: &[f32]) -> Vec<u16> {
    values.iter().map(|v| bf16::from_f32(*v).to_bits()).collect()
}

#[test]
fn dequantize_to_bf16_equals_the_cpu_values_rounded() {
    let Some(be) = backend() else { return };
    let mut rng = Rng(0x00C0_FFEE);
    for dtype in WeightDType::QUANTIZED {
        let (rows, k) = (5, 3 * dtype.block_elems());
        let matrix = random_blocks(&mut rng, dtype, rows, k);
        let want = bf16_bits(&dequantize(dtype, &matrix));
        let dw = be.upload(&matrix).unwrap();
        // The whole matrix, then rows 2..4 into a view one element in (no 8-byte alignment).
        for (row0, n_rows, pad) in [(0, rows, 0), (2, 2, 1), (4, 1, 0)] {
            let out = be.upload(&vec![0xFFFFu16; pad + n_rows * k]).unwrap();
            be.dequantize_bf16(dtype, dw.ptr(), row0, n_rows, k, out.ptr().from(pad)).unwrap();
            let got = be.read_vec(out.ptr()).unwrap();
            assert!(got[..pad].iter().all(|&b| b == 0xFFFF), "{dtype:?}: wrote before the view");
            let expected = &want[row0 * k..(row0 + n_rows) * k];
            if let Some(i) = (0..expected.len()).find(|&i| got[pad + i] != expected[i]) {
                panic!(
                    "{dtype:?} rows {row0}+{n_rows}: value {i} is {:#06x}, want {:#06x}",
                    got[pad + i],
                    expected[i]
                );
            }
        }
    }
}

/// MXFP4's gguf-py fixture (scales 0, 1, 2, 254 and 0xFF among them, the last read as 2^127 by
/// llama.cpp's CPU code and moe-lanes everywhere) dequantized on the device, from a buffer one
/// byte in (17-byte blocks at odd addresses): the CPU's values rounded to bf16, bit for bit (an
/// infinity stays one; the device never makes a NaN scale of 0xFF).
#[test]
fn mxfp4_fixture_blocks_dequantize_on_the_device_like_the_cpu() {
    let Some(be) = backend() else { return };
    let dtype = WeightDType::Mxfp4;
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/quant/mxfp4.blocks");
    let blocks = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let k = 32;
    let rows = blocks.len() / dtype.block_bytes();
    let want = bf16_bits(&dequantize(dtype, &blocks));
    let dw = be.upload(&[vec![0u8], blocks.clone()].concat()).unwrap();
    let out = be.upload(&vec![0xFFFFu16; rows * k]).unwrap();
    be.dequantize_bf16(dtype, dw.ptr().from(1), 0, rows, k, out.ptr()).unwrap();
    assert_eq!(be.read_vec(out.ptr()).unwrap(), want);
}

/// The Q5_0, Q5_1 and IQ4_NL gguf-py fixtures dequantized on the device: the CPU's values (equal
/// to gguf-py's, tests/quant_fixtures.rs) rounded to bf16, bit for bit.
#[test]
fn q5_and_iq4_nl_fixture_blocks_dequantize_on_the_device_like_the_cpu() {
    let Some(be) = backend() else { return };
    for dtype in [WeightDType::Q5_0, WeightDType::Q5_1, WeightDType::Iq4Nl] {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(format!("../tests/fixtures/quant/{}.blocks", dtype.name()));
        let blocks = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let k = 64;
        let rows = blocks.len() / dtype.row_bytes(k);
        let want = bf16_bits(&dequantize(dtype, &blocks));
        let dw = be.upload(&blocks).unwrap();
        let out = be.upload(&vec![0xFFFFu16; rows * k]).unwrap();
        be.dequantize_bf16(dtype, dw.ptr(), 0, rows, k, out.ptr()).unwrap();
        assert_eq!(be.read_vec(out.ptr()).unwrap(), want, "{}", dtype.name());
    }
}

#[test]
fn dequantized_tile_through_gemm_bf16_matches_the_cpu() {
    let Some(be) = backend() else { return };
    let mut rng = Rng(0x7AB1E);
    for dtype in WeightDType::QUANTIZED {
        let (t, n, k) = (13, 19, 2 * dtype.block_elems());
        let matrix = random_blocks(&mut rng, dtype, n, k);
        let w: Vec<f32> =
            bf16_bits(&dequantize(dtype, &matrix)).into_iter().map(|b| bf16::from_bits(b).to_f32()).collect();
        let x = rng.vec(t * k, 1.0);
        let hi = bf16_bits(&x);
        let lo: Vec<u16> = x
            .iter()
            .zip(&hi)
            .map(|(v, h)| bf16::from_f32(v - bf16::from_bits(*h).to_f32()).to_bits())
            .collect();
        let dw = be.upload(&matrix).unwrap();
        let tile = be.alloc_zeros::<u16>(n * k).unwrap();
        be.dequantize_bf16(dtype, dw.ptr(), 0, n, k, tile.ptr()).unwrap();
        let (dhi, dlo) = (be.upload(&hi).unwrap(), be.upload(&lo).unwrap());
        let dy = be.alloc_zeros::<f32>(t * n).unwrap();
        be.gemm_bf16(tile.ptr(), dhi.ptr(), Some(dlo.ptr()), dy.ptr(), t, n, k, false).unwrap();
        let y = be.read_vec(dy.ptr()).unwrap();
        // x = hi + lo leaves 2^-16 of |x|; cuBLAS sums in f32: 1e-4 of sum |w x| bounds both.
        for ((o, got), (value, _)) in
            y.iter().enumerate().zip(gemv_reference(&w, &x, &vec![0.0; t * n], n, k))
        {
            let abs: f64 =
                (0..k).map(|c| (w[(o % n) * k + c] as f64 * x[(o / n) * k + c] as f64).abs()).sum();
            assert!((*got as f64 - value).abs() <= 1e-4 * abs, "{dtype:?} out {o}: {got} vs {value}");
        }
    }
}

fn shape_error(r: Result<(), CudaError>) -> String {
    match r {
        Err(e @ CudaError::Shape { .. }) => e.to_string(),
        other => panic!("expected a shape error, got {other:?}"),
    }
}

#[test]
fn bad_shapes_are_refused_before_launch() {
    let Some(be) = backend() else { return };
    let dtype = WeightDType::Q4_K;
    let (n, k) = (4, 512);
    let dw = be.alloc_zeros::<u8>(n * dtype.row_bytes(k)).unwrap();
    let dx = be.alloc_zeros::<f32>(2 * k).unwrap();
    let dy = be.alloc_zeros::<f32>(2 * n).unwrap();
    let out = be.alloc_zeros::<u16>(n * k).unwrap();
    let (w, x, y) = (dw.ptr(), dx.ptr(), dy.ptr());
    let errors = [
        shape_error(be.gemv_quant(dtype, w, x, y, 2, n, k - 128, false)),
        shape_error(be.gemv_quant(dtype, w, x, y, 2, n + 1, k, false)),
        shape_error(be.gemv_quant(dtype, w, x, y, 3, n, k, false)),
        shape_error(be.gemv_quant(dtype, w.from(2), x, y, 2, n - 1, k, false)),
        shape_error(be.gemv_quant(WeightDType::BF16, w, x, y, 2, n, k, false)),
        shape_error(be.dequantize_bf16(dtype, w, 3, 2, k, out.ptr())),
        shape_error(be.dequantize_bf16(dtype, w, 0, n, k, out.ptr().from(1))),
        shape_error(be.dequantize_bf16(WeightDType::Q8_0, w, 0, 1, 48, out.ptr())),
    ];
    for e in &errors {
        eprintln!("refused: {e}");
    }
    assert!(errors[0].contains("not a multiple") && errors[4].contains("not a quantized"), "{errors:?}");
    assert!(errors[3].contains("aligned") && errors[6].contains("out holds"), "{errors:?}");
    be.synchronize().unwrap();
}

/// A cache of `n_slots` random `[rows, k]` matrices of `dtype` (bf16 bit patterns for
/// [`WeightDType::BF16`]): the bytes and the CPU values.
fn random_cache(
    rng: &mut Rng,
    dtype: WeightDType,
    n_slots: usize,
    rows: usize,
    k: usize,
) -> (Vec<u8>, Vec<f32>) {
    if dtype == WeightDType::BF16 {
        let bits = bf16_bits(&rng.vec(n_slots * rows * k, 0.05));
        let values = bits.iter().map(|b| bf16::from_bits(*b).to_f32()).collect();
        return (bits.iter().flat_map(|b| b.to_le_bytes()).collect(), values);
    }
    let bytes = random_blocks(rng, dtype, n_slots * rows, k);
    let values = dequantize(dtype, &bytes);
    (bytes, values)
}

/// `|got - want| <= 1e-4 * sum |terms|` (f32 sums in any order over at most a few thousand terms).
fn assert_close(what: &str, got: &[f32], want: &[(f64, f64)]) {
    for (i, (g, (value, abs))) in got.iter().zip(want).enumerate() {
        assert!((*g as f64 - value).abs() <= 1e-4 * abs + 1e-30, "{what} [{i}]: {g} vs {value}");
    }
}

/// `(sum, sum |terms|)` of a dot product in f64.
fn dot64(w: &[f32], x: &[f32]) -> (f64, f64) {
    w.iter().zip(x).fold((0.0, 0.0), |(s, a), (w, x)| {
        let p = *w as f64 * *x as f64;
        (s + p, a + p.abs())
    })
}

#[test]
fn typed_hot_lane_kernels_match_the_cpu_for_every_type_and_a_mix() {
    let Some(be) = backend() else { return };
    let mut rng = Rng(0x5107);
    let mixes: Vec<[WeightDType; 3]> = WeightDType::QUANTIZED
        .iter()
        .map(|&d| [d; 3])
        .chain([[WeightDType::Q4_K, WeightDType::Q5_K, WeightDType::Q6_K]])
        .chain([[WeightDType::Q8_0, WeightDType::Q4_0, WeightDType::BF16]])
        .collect();
    // Two tokens, two entries each; entry 1 is cold (slot -1) and skipped.
    let (n_slots, slots, tokens, tok_off) = (3, [2i32, -1, 0, 1], [0i32, 0, 1, 1], [0i32, 2, 4]);
    for (types, q8) in mixes.iter().flat_map(|t| [(*t, false), (*t, true)]) {
        let (hidden, ff) = (2 * 256, 256);
        let caches: Vec<(Vec<u8>, Vec<f32>)> = types
            .iter()
            .zip([(ff, hidden), (ff, hidden), (hidden, ff)])
            .map(|(&d, (rows, k))| random_cache(&mut rng, d, n_slots, rows, k))
            .collect();
        let (x, weights) = (rng.vec(2 * hidden, 1.0), rng.vec(4, 1.0));
        let dev: Vec<_> = caches.iter().map(|(b, _)| be.upload(b).unwrap()).collect();
        let typed = |i: usize| TypedWeights { bytes: dev[i].ptr(), dtype: types[i] };
        let (dx, ds, dt) = (be.upload(&x).unwrap(), be.upload(&slots).unwrap(), be.upload(&tokens).unwrap());
        let dh = be.alloc_zeros::<f32>(4 * ff).unwrap();
        // with q8 the quantized rows see x as d * q (bf16 rows the f32 x)
        let xq = q8.then(|| QuantizedX::new(be, &x, 2, hidden));
        let xr = xq.as_ref().map(QuantizedX::rows);
        let x_of = |d: WeightDType| if d.is_quantized() { xq.as_ref().map_or(&x, |q| &q.values) } else { &x };
        be.moe_gate_up_gemv_typed(
            typed(0),
            typed(1),
            dx.ptr(),
            xr,
            ds.ptr(),
            dt.ptr(),
            dh.ptr(),
            4,
            ff,
            hidden,
            &GateUpEpilogue::SILU,
        )
        .unwrap();
        let h = be.read_vec(dh.ptr()).unwrap();
        let mut want_h = vec![(0.0, 0.0); 4 * ff];
        for e in (0..4).filter(|&e| slots[e] >= 0) {
            let (s, t) = (slots[e] as usize, tokens[e] as usize * hidden);
            for r in 0..ff {
                let row = |i: usize| {
                    dot64(&caches[i].1[(s * ff + r) * hidden..][..hidden], &x_of(types[i])[t..][..hidden])
                };
                let ((g, ga), (u, ua)) = (row(0), row(1));
                let silu = g / (1.0 + (-g).exp());
                want_h[e * ff + r] = (silu * u, ga * (u.abs() + 1.0) + ua * (g.abs() + 1.0));
            }
        }
        let what = format!("{types:?} q8 {q8}");
        assert_close(&format!("{what} gate/up"), &h, &want_h);
        let y0 = rng.vec(2 * hidden, 1.0);
        let (dw, doff, drows) =
            (be.upload(&weights).unwrap(), be.upload(&tok_off).unwrap(), be.upload(&[0i32, 1]).unwrap());
        let dy = be.upload(&y0).unwrap();
        let (hp, sp, op) = (dh.ptr(), ds.ptr(), dy.ptr());
        let hq = (q8 && types[2].is_quantized()).then(|| QuantizedX::new(be, &h, 4, ff));
        let h_seen = hq.as_ref().map_or(&h, |q| &q.values);
        be.moe_down_accum_typed(
            typed(2),
            hp,
            hq.as_ref().map(QuantizedX::rows),
            sp,
            dw.ptr(),
            doff.ptr(),
            drows.ptr(),
            op,
            2,
            hidden,
            ff,
            None,
        )
        .unwrap();
        let y = be.read_vec(dy.ptr()).unwrap();
        let want_y: Vec<(f64, f64)> = (0..2 * hidden)
            .map(|o| {
                let (t, r) = (o / hidden, o % hidden);
                let entries = (tok_off[t] as usize..tok_off[t + 1] as usize).filter(|&e| slots[e] >= 0);
                entries.fold((y0[o] as f64, (y0[o] as f64).abs()), |(s, a), e| {
                    let row = &caches[2].1[(slots[e] as usize * hidden + r) * ff..][..ff];
                    let (d, da) = dot64(row, &h_seen[e * ff..][..ff]);
                    (s + weights[e] as f64 * d, a + (weights[e] as f64).abs() * da)
                })
            })
            .collect();
        assert_close(&format!("{what} down"), &y, &want_y);
    }
    let (raw, zf, zi) = (
        be.alloc_zeros::<u8>(64).unwrap(),
        be.alloc_zeros::<f32>(8).unwrap(),
        be.alloc_zeros::<i32>(8).unwrap(),
    );
    let bad = TypedWeights { bytes: raw.ptr(), dtype: WeightDType::F32 };
    let (z, zi) = (zf.ptr(), zi.ptr());
    let err =
        shape_error(be.moe_gate_up_gemv_typed(bad, bad, z, None, zi, zi, z, 1, 1, 1, &GateUpEpilogue::SILU));
    assert!(err.contains("no hot-lane kernel for f32"), "{err}");
}

/// Decode q/k/v in one launch (`gemv3_typed`) gives the bits of the one-token GEMV of each
/// matrix on its own (`gemv_quant`'s wide kernel, `gemv_bf16` for a bf16 matrix), for a
/// Q4_K_M-like mix and one with bf16 and odd row counts.
#[test]
fn gemv3_typed_matches_one_gemv_per_matrix_bit_for_bit() {
    use WeightDType::{BF16, Q4_K, Q5_K, Q6_K, Q8_0};
    let Some(be) = backend() else { return };
    let mut rng = Rng(0x5EED_0003);
    let k = 512;
    let cases = [([Q4_K, Q4_K, Q6_K], [64usize, 16, 16]), ([BF16, Q8_0, Q5_K], [33, 7, 9])];
    for ((types, n), q8) in cases.iter().flat_map(|c| [(*c, false), (*c, true)]) {
        let mats: Vec<Vec<u8>> = types
            .iter()
            .zip(n)
            .map(|(&d, rows)| match d {
                BF16 => bytemuck::cast_slice(&bf16_bits(&rng.vec(rows * k, 1.0))).to_vec(),
                q => random_blocks(&mut rng, q, rows, k),
            })
            .collect();
        let bufs: Vec<_> = mats.iter().map(|m| be.upload(m).unwrap()).collect();
        let w: [TypedWeights; 3] =
            std::array::from_fn(|j| TypedWeights { bytes: bufs[j].ptr(), dtype: types[j] });
        let x = rng.vec(k, 1.0);
        let dx = be.upload(&x).unwrap();
        let xq = q8.then(|| QuantizedX::new(be, &x, 1, k));
        let xr = xq.as_ref().map(QuantizedX::rows);
        let fused: Vec<_> = n.iter().map(|&rows| be.upload(&vec![7.0f32; rows]).unwrap()).collect();
        let apart: Vec<_> = n.iter().map(|&rows| be.upload(&vec![7.0f32; rows]).unwrap()).collect();
        be.gemv3_typed(w, dx.ptr(), xr, std::array::from_fn(|j| fused[j].ptr()), n, k).unwrap();
        for j in 0..3 {
            match w[j].bf16() {
                Some(bf) => be.gemv_bf16(bf, dx.ptr(), apart[j].ptr(), 1, n[j], k, false).unwrap(),
                None => match xr {
                    Some(q) => {
                        be.gemv_quant_q8(types[j], w[j].bytes, q, apart[j].ptr(), n[j], k, false).unwrap()
                    }
                    None => be
                        .gemv_quant(types[j], w[j].bytes, dx.ptr(), apart[j].ptr(), 1, n[j], k, false)
                        .unwrap(),
                },
            }
            let bits = |b: &moe_lanes_kernels::cuda::DeviceBuffer<f32>| {
                be.read_vec(b.ptr()).unwrap().into_iter().map(f32::to_bits).collect::<Vec<_>>()
            };
            assert_eq!(bits(&fused[j]), bits(&apart[j]), "{types:?} q8 {q8} matrix {j}");
        }
    }
}

/// The grouped prefill GEMMs over typed caches (`grouped_gate_up_typed`, `grouped_gemm_typed`:
/// weight tiles decoded in shared memory) give the bits of dequantizing the whole cache to bf16
/// and running the bf16 kernels, for every type, a Q4_K_M-like mix, a bf16 gate, and shapes whose
/// rows and columns are not multiples of the 64 x 64 tile; split activations on and off; with the
/// pipelined kernels and the synchronous ones (the same bits again).
#[test]
fn grouped_typed_gemms_equal_dequantize_then_bf16_bit_for_bit() {
    use moe_lanes_kernels::cuda::ops::grouped_tiles;
    use WeightDType::{Mxfp4, BF16, Q4_0, Q4_K, Q5_K, Q6_K, Q8_0};
    let Some(be) = backend() else { return };
    let mut rng = Rng(0x6A0D);
    let mut cases: Vec<([WeightDType; 3], usize, usize)> =
        WeightDType::QUANTIZED.iter().map(|&d| ([d; 3], 512, 256)).collect();
    cases.extend([([Q4_K, Q5_K, Q6_K], 512, 256), ([BF16, Q4_K, Q6_K], 256, 256)]);
    cases.extend([([Q8_0, Q8_0, Q4_0], 96, 224), ([Q4_0, Q4_0, Q8_0], 160, 96)]);
    // MXFP4 rows of 51 and 119 bytes: runs at every address modulo 4
    cases.push(([Mxfp4; 3], 96, 224));
    // expert-major runs: a run longer than a tile, a slot without rows (2), runs of 1
    let slots: Vec<u32> =
        [(3u32, 70usize), (0, 5), (4, 1), (1, 17), (5, 9)].iter().flat_map(|&(s, n)| vec![s; n]).collect();
    let (n_slots, n_rows, t) = (6, slots.len(), 13);
    let mut tiles = vec![0i32; 3 * n_rows];
    let n_tiles = grouped_tiles(&slots, &mut tiles).unwrap();
    let toks: Vec<i32> = (0..n_rows).map(|r| ((r * 5 + 2) % t) as i32).collect();
    let (dtiles, dtok) = (be.upload(&tiles[..3 * n_tiles]).unwrap(), be.upload(&toks).unwrap());
    let dec = tiles_of_at_most(&tiles[..3 * n_tiles], GROUPED_DECODE_TILE_ROWS);
    let (ddec, n_dec) = (be.upload(&dec).unwrap(), dec.len() / 3);
    for (types, hidden, ff) in cases {
        let shapes = [(ff, hidden), (ff, hidden), (hidden, ff)];
        let caches: Vec<Vec<u8>> = types
            .iter()
            .zip(shapes)
            .map(|(&d, (rows, k))| random_cache(&mut rng, d, n_slots, rows, k).0)
            .collect();
        // with the tail MXFP4's typed kernels need (the hot cache allocates it), so they run
        // (bf16 caches without it: they are copied whole below)
        let tail = |d: WeightDType| if d == BF16 { 0 } else { TYPED_TAIL_BYTES };
        let padded = |(b, &d): (&Vec<u8>, &WeightDType)| [&b[..], &vec![0; tail(d)]].concat();
        let dev: Vec<_> = caches.iter().zip(&types).map(|c| be.upload(&padded(c)).unwrap()).collect();
        let typed = |i: usize| TypedWeights { bytes: dev[i].ptr(), dtype: types[i] };
        let bf: Vec<_> = (0..3)
            .map(|i| {
                let (rows, k) = shapes[i];
                let out = be.alloc_zeros::<u16>(n_slots * rows * k).unwrap();
                match typed(i).bf16() {
                    Some(b) => be.copy(b, out.ptr()).unwrap(),
                    None => {
                        be.dequantize_bf16(types[i], dev[i].ptr(), 0, n_slots * rows, k, out.ptr()).unwrap()
                    }
                }
                out
            })
            .collect();
        let dx = be.upload(&rng.vec(t * hidden, 1.0)).unwrap();
        let mut sync_bits = Vec::new();
        let variants =
            [(false, true, false), (false, false, false), (true, true, false), (true, false, false)];
        // the decode shape's kernels over the same rows cut into tiles of 16
        let variants = variants.into_iter().chain([(true, true, true), (true, false, true)]);
        for (pipe, split, dec) in variants {
            be.set_grouped_pipeline(pipe);
            let out = |n: usize| [be.alloc_zeros::<f32>(n).unwrap(), be.alloc_zeros::<f32>(n).unwrap()];
            let (h, y) = (out(n_rows * ff), out(n_rows * hidden));
            let (tl, n_tiles, tile_rows) = match dec {
                false => (dtiles.ptr(), n_tiles, GROUPED_TILE_ROWS),
                true => (ddec.ptr(), n_dec, GROUPED_DECODE_TILE_ROWS),
            };
            let (x, tok) = (dx.ptr(), dtok.ptr());
            be.grouped_gate_up(
                bf[0].ptr(),
                bf[1].ptr(),
                n_slots,
                x,
                tok,
                t,
                tl,
                n_tiles,
                tile_rows,
                h[0].ptr(),
                n_rows,
                ff,
                hidden,
                split,
                &GateUpEpilogue::SILU,
            )
            .unwrap();
            be.grouped_gate_up_typed(
                typed(0),
                typed(1),
                n_slots,
                x,
                tok,
                t,
                tl,
                n_tiles,
                tile_rows,
                h[1].ptr(),
                n_rows,
                ff,
                hidden,
                split,
                &GateUpEpilogue::SILU,
            )
            .unwrap();
            let hp = h[0].ptr();
            be.grouped_gemm(
                bf[2].ptr(),
                n_slots,
                hp,
                None,
                n_rows,
                tl,
                n_tiles,
                tile_rows,
                y[0].ptr(),
                n_rows,
                hidden,
                ff,
                split,
                None,
            )
            .unwrap();
            be.grouped_gemm_typed(
                typed(2),
                n_slots,
                hp,
                None,
                n_rows,
                tl,
                n_tiles,
                tile_rows,
                y[1].ptr(),
                n_rows,
                hidden,
                ff,
                split,
                None,
            )
            .unwrap();
            let bits = |b: &moe_lanes_kernels::cuda::DeviceBuffer<f32>| {
                be.read_vec(b.ptr()).unwrap().into_iter().map(f32::to_bits).collect::<Vec<_>>()
            };
            // the bf16 caches' decode-shape kernels are register-direct where k is whole
            // 32-column slabs (hidden for gate/up, ff for the down): another summation order
            // (cuda_kernels checks them against the CPU), so within f32 rounding of the typed
            // kernels here; after such a gate/up both downs read its h bits
            let rows_gate_up = pipe && dec && hidden % 32 == 0;
            let rows_down = pipe && dec && ff % 32 == 0;
            let what = format!("{types:?} ({hidden}, {ff}) split={split} decode tiles {dec}");
            let close = |a: &moe_lanes_kernels::cuda::DeviceBuffer<f32>,
                         b: &moe_lanes_kernels::cuda::DeviceBuffer<f32>| {
                let (a, b) = (be.read_vec(a.ptr()).unwrap(), be.read_vec(b.ptr()).unwrap());
                let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
                let worst = a.iter().zip(&b).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
                assert!(worst <= 1e-4 * scale, "{what}: bf16 rows kernels {worst:e} of {scale:e}");
            };
            match rows_gate_up {
                true => close(&h[0], &h[1]),
                false => assert_eq!(bits(&h[0]), bits(&h[1]), "{what} gate/up"),
            }
            match rows_down {
                true => close(&y[0], &y[1]),
                false => assert_eq!(bits(&y[0]), bits(&y[1]), "{what} down"),
            }
            assert!(bits(&y[1]).iter().any(|&b| b != 0), "{types:?}: the GEMMs wrote something");
            let got = (bits(&h[1]), bits(&y[1]));
            match pipe {
                false => sync_bits.push(got),
                true => {
                    let want = &sync_bits[usize::from(!split)];
                    assert!(got.0 == want.0, "{what}: the pipelined kernels' gate/up bits differ");
                    assert!(
                        rows_gate_up || got.1 == want.1,
                        "{what}: the pipelined kernels' down bits differ"
                    );
                }
            }
        }
        be.set_grouped_pipeline(true);
    }
    // a cache too short for one slot of 256 x 256 Q4_K values is refused before any launch
    let (raw, f) = (be.alloc_zeros::<u8>(64).unwrap(), be.alloc_zeros::<f32>(256).unwrap());
    let short = TypedWeights { bytes: raw.ptr(), dtype: Q4_K };
    let (tl, fp) = (dtiles.ptr(), f.ptr());
    let err =
        shape_error(be.grouped_gemm_typed(short, 1, fp, None, 1, tl, 1, 64, fp, 1, 256, 256, true, None));
    assert!(err.contains("weight cache"), "{err}");
}

/// One case of the hot lane's epilogue tests: `n_slots` experts of `dtype` (gate and up
/// `[ff, hidden]`, down `[hidden, ff]`) on the device, with random per-slot biases (f32) when
/// `biased`, and the CPU kernels' view of each slot.
struct EpilogueCase {
    dtype: WeightDType,
    hidden: usize,
    ff: usize,
    glu: Glu,
    caches: Vec<Vec<u8>>,
    bias: Option<[Vec<f32>; 3]>,
    dev: Vec<moe_lanes_kernels::cuda::DeviceBuffer<u8>>,
    dev_bias: Option<[moe_lanes_kernels::cuda::DeviceBuffer<f32>; 3]>,
}

impl EpilogueCase {
    const N_SLOTS: usize = 3;

    /// The grouped prefill kernels' bound on the gate/up rows: their tiles hold the weights in
    /// bf16 (2e-2 of the largest output). Q8_0's values are not whole bf16 values, and the clamped
    /// SwiGLU caps the largest output the error is measured against (8 * 7) while the rounding of
    /// the rows below the clamp stays as large as SiLU's (measured on the H200: 6.1e-2 with
    /// biases), so that case gets 8e-2, as Q5_1's (`d * q + m`, not whole bf16 values either);
    /// bf16 and MXFP4 weights are exact in bf16.
    fn prefill_tol(&self) -> f32 {
        match (self.dtype, self.glu) {
            (WeightDType::Q8_0 | WeightDType::Q5_1, Glu::SwigluOai) => 8e-2,
            _ => 2e-2,
        }
    }

    fn new(be: &CudaBackend, rng: &mut Rng, dtype: WeightDType, glu: Glu, biased: bool) -> EpilogueCase {
        let (hidden, ff) = (192, 160);
        let shapes = [(ff, hidden), (ff, hidden), (hidden, ff)];
        let caches: Vec<Vec<u8>> =
            shapes.iter().map(|&(rows, k)| random_cache(rng, dtype, Self::N_SLOTS, rows, k).0).collect();
        let dev = caches.iter().map(|b| be.upload(b).unwrap()).collect();
        // gate/up biases of +-10: the clamped SwiGLU's limits (7) are crossed both ways
        let bias = biased.then(|| {
            let n = Self::N_SLOTS;
            [rng.vec(n * ff, 10.0), rng.vec(n * ff, 10.0), rng.vec(n * hidden, 1.0)]
        });
        let dev_bias = bias.as_ref().map(|b| std::array::from_fn(|i| be.upload(&b[i]).unwrap()));
        EpilogueCase { dtype, hidden, ff, glu, caches, bias, dev, dev_bias }
    }

    fn typed(&self, i: usize) -> TypedWeights {
        TypedWeights { bytes: self.dev[i].ptr(), dtype: self.dtype }
    }

    fn gate_up(&self) -> GateUpEpilogue {
        let b = self.dev_bias.as_ref();
        GateUpEpilogue { glu: self.glu, gate_bias: b.map(|b| b[0].ptr()), up_bias: b.map(|b| b[1].ptr()) }
    }

    fn down_bias(&self) -> Option<moe_lanes_kernels::cuda::DPtr<f32>> {
        self.dev_bias.as_ref().map(|b| b[2].ptr())
    }

    /// Slot `s` as the CPU kernels take an expert.
    fn expert(&self, s: usize) -> moe_lanes_kernels::ExpertWeights<'_> {
        let (gu, d) =
            (self.ff * self.dtype.row_bytes(self.hidden), self.hidden * self.dtype.row_bytes(self.ff));
        let bias = self.bias.as_ref().map(|b| moe_lanes_kernels::weights::ExpertBias {
            gate: &b[0][s * self.ff..][..self.ff],
            up: &b[1][s * self.ff..][..self.ff],
            down: &b[2][s * self.hidden..][..self.hidden],
        });
        moe_lanes_kernels::ExpertWeights {
            gate: &self.caches[0][s * gu..][..gu],
            up: &self.caches[1][s * gu..][..gu],
            down: &self.caches[2][s * d..][..d],
            dtype: self.dtype,
            down_dtype: self.dtype,
            hidden: self.hidden,
            ff: self.ff,
            bias,
        }
    }

    fn activation(&self) -> moe_lanes_kernels::weights::Activation {
        match self.glu {
            Glu::Silu => moe_lanes_kernels::weights::Activation::Silu,
            Glu::SwigluOai => moe_lanes_kernels::weights::Activation::SwigluOai,
            Glu::GeluTanh => moe_lanes_kernels::weights::Activation::GeluTanh,
        }
    }

    /// The CPU kernels' `h` of slot `s` for one token row `x`.
    fn cpu_h(&self, s: usize, x: &[f32]) -> Vec<f32> {
        let mut h = vec![0.0; self.ff];
        let level = moe_lanes_kernels::simd::SimdLevel::Scalar;
        moe_lanes_kernels::gate_up_activation(
            level,
            &self.expert(s),
            self.activation(),
            x,
            0..self.ff,
            &mut h,
        )
        .unwrap();
        h
    }

    /// The CPU kernels' `out += weight * (down h + b_down)` of slot `s`.
    fn cpu_down(&self, s: usize, h: &[f32], weight: f32, out: &mut [f32]) {
        let level = moe_lanes_kernels::simd::SimdLevel::Scalar;
        moe_lanes_kernels::down_accumulate(level, &self.expert(s), h, &[weight], 0..self.hidden, out)
            .unwrap();
    }

    fn what(&self) -> String {
        format!("{:?} {:?} biased {}", self.dtype, self.glu, self.bias.is_some())
    }
}

/// `max |got - want| <= tol * max |want|` (and something was written).
fn assert_rel(what: &str, got: &[f32], want: &[f32], tol: f32) {
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let err = got.iter().zip(want).fold(0.0f32, |m, (g, w)| m.max((g - w).abs()));
    eprintln!("{what}: max err {err:.2e} of {scale:.2e}");
    assert!(scale > 0.0 && err <= tol * scale, "{what}: max err {err} of {scale}");
}

/// The epilogues of every case: bf16, Q8_0, MXFP4 and Q5_1 (scale and min) experts; SiLU, the
/// clamped SwiGLU and Gemma 4's tanh GELU; with and without per-slot biases.
fn epilogue_cases(be: &CudaBackend, rng: &mut Rng) -> Vec<EpilogueCase> {
    let mut cases = Vec::new();
    for dtype in [WeightDType::BF16, WeightDType::Q8_0, WeightDType::Mxfp4, WeightDType::Q5_1] {
        for glu in [Glu::Silu, Glu::SwigluOai, Glu::GeluTanh] {
            for biased in [false, true] {
                cases.push(EpilogueCase::new(be, rng, dtype, glu, biased));
            }
        }
    }
    cases
}

/// The decode hot lane with the expert epilogue (the activation, per-slot gate/up biases before
/// it, `weight * down bias` with the weighted rows) against the CPU kernels
/// (`gate_up_activation`, `down_accumulate` with `ExpertWeights::bias`) for bf16 (moe.cu's
/// kernels), Q8_0, MXFP4 and Q5_1 (quant.cu's, f32 and 8-bit activations), SiLU and SwiGLU-OAI, with
/// and without biases; a cold entry (slot -1) adds nothing, its bias neither.
#[test]
fn decode_hot_lane_epilogue_matches_the_cpu_kernels() {
    let Some(be) = backend() else { return };
    let mut rng = Rng(0xB1A5);
    // two tokens, two entries each; entry 1 is cold
    let (slots, tokens, tok_off, weights) =
        ([2i32, -1, 0, 1], [0i32, 0, 1, 1], [0i32, 2, 4], [0.6f32, 0.3, 0.25, 0.75]);
    for case in epilogue_cases(be, &mut rng) {
        let (hidden, ff) = (case.hidden, case.ff);
        let x = rng.vec(2 * hidden, 4.0);
        let quantized = case.dtype.is_quantized();
        for q8 in [false, true].into_iter().filter(|&q| quantized || !q) {
            let xq = q8.then(|| QuantizedX::new(be, &x, 2, hidden));
            let x_seen = xq.as_ref().map_or(&x, |q| &q.values);
            let (dx, ds, dt) =
                (be.upload(&x).unwrap(), be.upload(&slots).unwrap(), be.upload(&tokens).unwrap());
            let dh = be.upload(&vec![9.0f32; 4 * ff]).unwrap();
            let (n_ent, epi) = (4, case.gate_up());
            let launched = match quantized {
                false => {
                    let (g, u) = (case.typed(0).bf16().unwrap(), case.typed(1).bf16().unwrap());
                    be.moe_gate_up_gemv(g, u, dx.ptr(), ds.ptr(), dt.ptr(), dh.ptr(), n_ent, ff, hidden, &epi)
                }
                true => be.moe_gate_up_gemv_typed(
                    case.typed(0),
                    case.typed(1),
                    dx.ptr(),
                    xq.as_ref().map(QuantizedX::rows),
                    ds.ptr(),
                    dt.ptr(),
                    dh.ptr(),
                    n_ent,
                    ff,
                    hidden,
                    &epi,
                ),
            };
            launched.unwrap();
            let h = be.read_vec(dh.ptr()).unwrap();
            let what = format!("{} q8 {q8}", case.what());
            let mut want_y = rng.vec(2 * hidden, 1.0);
            let y0 = want_y.clone();
            for e in (0..4).filter(|&e| slots[e] >= 0) {
                let (s, t) = (slots[e] as usize, tokens[e] as usize);
                let want_h = case.cpu_h(s, &x_seen[t * hidden..][..hidden]);
                assert_rel(&format!("{what} gate/up entry {e}"), &h[e * ff..][..ff], &want_h, 1e-4);
                // the down half from the GPU's h: its own error only
                case.cpu_down(s, &h[e * ff..][..ff], weights[e], &mut want_y[t * hidden..][..hidden]);
            }
            assert!(h[ff..2 * ff].iter().all(|&v| v == 9.0), "{what}: the cold entry's h was written");
            let (dw, doff, drows) =
                (be.upload(&weights).unwrap(), be.upload(&tok_off).unwrap(), be.upload(&[0i32, 1]).unwrap());
            let dy = be.upload(&y0).unwrap();
            let launched = match quantized {
                false => be.moe_down_accum(
                    case.typed(2).bf16().unwrap(),
                    dh.ptr(),
                    ds.ptr(),
                    dw.ptr(),
                    doff.ptr(),
                    drows.ptr(),
                    dy.ptr(),
                    2,
                    hidden,
                    ff,
                    case.down_bias(),
                ),
                true => {
                    // with q8 the down rows read h's 8-bit form: the CPU sees the same values
                    let hq = q8.then(|| QuantizedX::new(be, &h, 4, ff));
                    if let Some(hq) = &hq {
                        want_y.copy_from_slice(&y0);
                        for e in (0..4).filter(|&e| slots[e] >= 0) {
                            let (s, t) = (slots[e] as usize, tokens[e] as usize);
                            let hs = &hq.values[e * ff..][..ff];
                            case.cpu_down(s, hs, weights[e], &mut want_y[t * hidden..][..hidden]);
                        }
                    }
                    be.moe_down_accum_typed(
                        case.typed(2),
                        dh.ptr(),
                        hq.as_ref().map(QuantizedX::rows),
                        ds.ptr(),
                        dw.ptr(),
                        doff.ptr(),
                        drows.ptr(),
                        dy.ptr(),
                        2,
                        hidden,
                        ff,
                        case.down_bias(),
                    )
                }
            };
            launched.unwrap();
            assert_rel(&format!("{what} down"), &be.read_vec(dy.ptr()).unwrap(), &want_y, 1e-4);
        }
    }
}

/// The prefill hot lane's grouped GEMMs with the expert epilogue (gate/up: biases then the
/// activation in the epilogue; down: `down h + b` per entry row, which the weighted scatter then
/// scales) against the CPU kernels, for bf16, Q8_0 and MXFP4 experts (the typed kernels decode
/// the weight tiles to bf16: the tolerance is bf16's), SiLU and SwiGLU-OAI, with and without
/// biases, synchronous and pipelined kernels; tiles of several rows of one slot, rows gathered
/// from token rows, a slot without rows.
#[test]
fn grouped_hot_lane_epilogue_matches_the_cpu_kernels() {
    use moe_lanes_kernels::cuda::ops::grouped_tiles;
    let Some(be) = backend() else { return };
    let mut rng = Rng(0x6B1A5);
    let slot_of_row: Vec<u32> = [(2u32, 70usize), (0, 3)].iter().flat_map(|&(s, n)| vec![s; n]).collect();
    let (n_rows, t) = (slot_of_row.len(), 9);
    let mut tiles = vec![0i32; 3 * n_rows];
    let n_tiles = grouped_tiles(&slot_of_row, &mut tiles).unwrap();
    let toks: Vec<i32> = (0..n_rows).map(|r| ((r * 4 + 1) % t) as i32).collect();
    let (dtiles, dtok) = (be.upload(&tiles[..3 * n_tiles]).unwrap(), be.upload(&toks).unwrap());
    let dec = tiles_of_at_most(&tiles[..3 * n_tiles], GROUPED_DECODE_TILE_ROWS);
    let (ddec, n_dec) = (be.upload(&dec).unwrap(), dec.len() / 3);
    for case in epilogue_cases(be, &mut rng) {
        let (hidden, ff, n_slots) = (case.hidden, case.ff, EpilogueCase::N_SLOTS);
        let x = rng.vec(t * hidden, 4.0);
        let dx = be.upload(&x).unwrap();
        for (pipe, dec) in [(false, false), (true, false), (true, true)] {
            be.set_grouped_pipeline(pipe);
            let (dh, dy) = (
                be.alloc_zeros::<f32>(n_rows * ff).unwrap(),
                be.alloc_zeros::<f32>(n_rows * hidden).unwrap(),
            );
            let (tl, n_tiles, tile_rows) = match dec {
                false => (dtiles.ptr(), n_tiles, GROUPED_TILE_ROWS),
                true => (ddec.ptr(), n_dec, GROUPED_DECODE_TILE_ROWS),
            };
            let tok = dtok.ptr();
            let epi = case.gate_up();
            be.grouped_gate_up_typed(
                case.typed(0),
                case.typed(1),
                n_slots,
                dx.ptr(),
                tok,
                t,
                tl,
                n_tiles,
                tile_rows,
                dh.ptr(),
                n_rows,
                ff,
                hidden,
                true,
                &epi,
            )
            .unwrap();
            let hp = dh.ptr();
            let (y, b) = (dy.ptr(), case.down_bias());
            be.grouped_gemm_typed(
                case.typed(2),
                n_slots,
                hp,
                None,
                n_rows,
                tl,
                n_tiles,
                tile_rows,
                y,
                n_rows,
                hidden,
                ff,
                true,
                b,
            )
            .unwrap();
            let (h, y) = (be.read_vec(dh.ptr()).unwrap(), be.read_vec(dy.ptr()).unwrap());
            let what = format!("{} pipelined {pipe} decode tiles {dec}", case.what());
            for r in 0..n_rows {
                let (s, tk) = (slot_of_row[r] as usize, toks[r] as usize);
                let want_h = case.cpu_h(s, &x[tk * hidden..][..hidden]);
                assert_rel(
                    &format!("{what} gate/up row {r}"),
                    &h[r * ff..][..ff],
                    &want_h,
                    case.prefill_tol(),
                );
                let mut want_y = vec![0.0; hidden];
                case.cpu_down(s, &h[r * ff..][..ff], 1.0, &mut want_y);
                assert_rel(&format!("{what} down row {r}"), &y[r * hidden..][..hidden], &want_y, 2e-2);
            }
        }
        be.set_grouped_pipeline(true);
    }
}

/// A bias shorter than the slots its cache holds is refused before any launch, naming it.
#[test]
fn short_expert_biases_are_refused() {
    let Some(be) = backend() else { return };
    let (ff, hidden, n_slots) = (64usize, 64usize, 2usize);
    let cache = be.alloc_zeros::<u16>(n_slots * ff * hidden).unwrap();
    let (fz, iz) = (be.alloc_zeros::<f32>(4 * ff.max(hidden)).unwrap(), be.alloc_zeros::<i32>(4).unwrap());
    let short = be.alloc_zeros::<f32>(n_slots * ff - 1).unwrap();
    let epi = GateUpEpilogue { glu: Glu::SwigluOai, gate_bias: None, up_bias: Some(short.ptr()) };
    let (c, f, i) = (cache.ptr(), fz.ptr(), iz.ptr());
    let err = shape_error(be.moe_gate_up_gemv(c, c, f, i, i, f, 1, ff, hidden, &epi));
    assert!(err.contains("up bias"), "{err}");
    let err = shape_error(be.moe_down_accum(c, f, i, f, i, i, f, 1, hidden, ff, Some(short.ptr())));
    assert!(err.contains("down bias"), "{err}");
    let err = shape_error(be.grouped_gemm(
        c,
        n_slots,
        f,
        None,
        1,
        i,
        1,
        64,
        f,
        1,
        hidden,
        ff,
        true,
        Some(short.ptr()),
    ));
    assert!(err.contains("bias"), "{err}");
}

/// The 8-bit one-token GEMV over a DeepSeek-V3-sized lm_head (129280 x 7168) and a dense
/// projection (18432 x 7168) in Q6_K and Q4_K (not a test of speed: prints the weights' read
/// rate, for the lead's measurements), the mean of 20 launches after 3 warm-ups. 64 random
/// rows repeated: the kernels read every byte either way.
#[test]
#[ignore]
fn q8_gemv_read_rate_timing() {
    let Some(be) = backend() else { return };
    let mut rng = Rng(0x0008_71AE);
    let k = 7168;
    let xq = QuantizedX::new(be, &rng.vec(k, 1.0), 1, k);
    for dtype in [WeightDType::Q6_K, WeightDType::Q4_K] {
        let block = random_blocks(&mut rng, dtype, 64, k);
        for n in [129280usize, 18432] {
            let bytes: Vec<u8> = block.iter().copied().cycle().take(n * dtype.row_bytes(k)).collect();
            let (dw, dy) = (be.upload(&bytes).unwrap(), be.alloc_zeros::<f32>(n).unwrap());
            let launch = || be.gemv_quant_q8(dtype, dw.ptr(), xq.rows(), dy.ptr(), n, k, false).unwrap();
            let us = mean_launch_us(be, 3, 20, launch);
            let gbs = bytes.len() as f64 / us / 1e3;
            eprintln!("TIMING q8 gemv {dtype:?} {n} x {k}: {us:.1} us, {gbs:.0} GB/s");
        }
    }
}

/// The int8 grouped GEMMs over MXFP4 caches and 8-bit x (`grouped_gemm_q8`,
/// `grouped_gate_up_q8`): each output against the f64 product of the CPU-dequantized rows and
/// the dequantized activations, within the f32 bound of the GEMV tests; gate/up's activation of
/// the two projections' own sums; rows of 3 and 7 blocks (a last stage of one block), runs of
/// a slot longer than a tile, gathered token rows, per-slot biases.
#[test]
fn int8_grouped_gemms_match_the_dequantized_activations() {
    use moe_lanes_kernels::cuda::ops::grouped_tiles;
    let Some(be) = backend() else { return };
    if !be.info().has_sm80() {
        return;
    }
    let mut rng = Rng(0x1D8_6E44);
    let slots: Vec<u32> =
        [(3u32, 70usize), (0, 5), (4, 1), (1, 17), (5, 9)].iter().flat_map(|&(s, n)| vec![s; n]).collect();
    let (n_slots, n_rows, t) = (6, slots.len(), 13);
    let mut tiles = vec![0i32; 3 * n_rows];
    let n_tiles = grouped_tiles(&slots, &mut tiles).unwrap();
    let toks: Vec<i32> = (0..n_rows).map(|r| ((r * 5 + 2) % t) as i32).collect();
    let (dtiles, dtok) = (be.upload(&tiles[..3 * n_tiles]).unwrap(), be.upload(&toks).unwrap());
    let padded = |b: &[u8]| be.upload(&[b, &[0; TYPED_TAIL_BYTES]].concat()).unwrap();
    for (n, k) in [(96, 224), (224, 96), (130, 512)] {
        let x = rng.vec(t * k, 1.0);
        let xq = QuantizedX::new(be, &x, t, k);
        let caches: Vec<Vec<u8>> =
            (0..2).map(|_| random_blocks(&mut rng, WeightDType::Mxfp4, n_slots * n, k)).collect();
        let dev: Vec<_> = caches.iter().map(|c| padded(c)).collect();
        let typed = |i: usize| TypedWeights { bytes: dev[i].ptr(), dtype: WeightDType::Mxfp4 };
        let bias = rng.vec(n_slots * n, 0.5);
        let dbias = be.upload(&bias).unwrap();
        let mut sums = Vec::new();
        for (m, b) in [(0, None), (1, Some(dbias.ptr()))] {
            let dy = be.alloc_zeros::<f32>(n_rows * n).unwrap();
            let x_rows = (xq.rows(), Some(dtok.ptr()), t);
            be.grouped_gemm_q8(
                typed(m),
                n_slots,
                x_rows,
                (dtiles.ptr(), n_tiles),
                (dy.ptr(), n_rows),
                (n, k),
                b,
            )
            .unwrap();
            let y = be.read_vec(dy.ptr()).unwrap();
            let w = dequantize(WeightDType::Mxfp4, &caches[m]);
            for (r, &slot) in slots.iter().enumerate() {
                let xr = &xq.values[toks[r] as usize * k..][..k];
                let base: Vec<f32> = (0..n).map(|o| b.map_or(0.0, |_| bias[slot as usize * n + o])).collect();
                let want = gemv_reference(&w[slot as usize * n * k..][..n * k], xr, &base, n, k);
                for (o, (value, bound)) in want.iter().enumerate() {
                    let got = y[r * n + o] as f64;
                    assert!(
                        (got - value).abs() <= *bound,
                        "n={n} k={k} matrix {m} row {r} col {o}: {got} vs {value}"
                    );
                }
            }
            sums.push(y);
        }
        // gate and up in one launch: silu of the first projection's sums times the second's
        // (with its bias as the up bias)
        let dh = be.alloc_zeros::<f32>(n_rows * n).unwrap();
        let epi = GateUpEpilogue { glu: Glu::Silu, gate_bias: None, up_bias: Some(dbias.ptr()) };
        let x_rows = (xq.rows(), dtok.ptr(), t);
        be.grouped_gate_up_q8(
            (typed(0), typed(1)),
            n_slots,
            x_rows,
            (dtiles.ptr(), n_tiles),
            (dh.ptr(), n_rows),
            (n, k),
            &epi,
        )
        .unwrap();
        for (i, got) in be.read_vec(dh.ptr()).unwrap().iter().enumerate() {
            let (g, u) = (sums[0][i], sums[1][i]);
            let want = g / (1.0 + (-g).exp()) * u;
            assert!(
                (got - want).abs() <= 1e-5 * want.abs() + 1e-6,
                "n={n} k={k} gate/up {i}: {got} vs {want}"
            );
        }
    }
}

/// Timing, not a check (`--ignored --nocapture` on a GPU): gpt-oss-20b's prefill gate/up at
/// pp512 (32 MXFP4 slots of 2880 x 2880, 64 rows each) through the bf16 typed tile
/// (`grouped_gate_up_typed`) and the int8 one (`grouped_gate_up_q8`, with x's quantization).
#[test]
#[ignore]
fn int8_grouped_gate_up_timing() {
    use moe_lanes_kernels::cuda::ops::grouped_tiles;
    let Some(be) = backend() else { return };
    let mut rng = Rng(0x71A1);
    let (n_slots, per_slot, n, k, t) = (32usize, 64usize, 2880usize, 2880usize, 512usize);
    let slots: Vec<u32> = (0..n_slots as u32).flat_map(|s| vec![s; per_slot]).collect();
    let n_rows = slots.len();
    let mut tiles = vec![0i32; 3 * n_rows];
    let n_tiles = grouped_tiles(&slots, &mut tiles).unwrap();
    let toks: Vec<i32> = (0..n_rows).map(|r| (r * 7 % t) as i32).collect();
    let (dtiles, dtok) = (be.upload(&tiles[..3 * n_tiles]).unwrap(), be.upload(&toks).unwrap());
    let block = random_blocks(&mut rng, WeightDType::Mxfp4, 64, k);
    let bytes: Vec<u8> =
        block.iter().copied().cycle().take(n_slots * n * WeightDType::Mxfp4.row_bytes(k)).collect();
    let dev: Vec<_> =
        (0..2).map(|_| be.upload(&[&bytes[..], &[0; TYPED_TAIL_BYTES]].concat()).unwrap()).collect();
    let typed = |i: usize| TypedWeights { bytes: dev[i].ptr(), dtype: WeightDType::Mxfp4 };
    let x = rng.vec(t * k, 1.0);
    let dx = be.upload(&x).unwrap();
    let xq = DeviceQ8::zeroed(be, t * k);
    let dh = be.alloc_zeros::<f32>(n_rows * n).unwrap();
    let epi = GateUpEpilogue::SILU;
    let bf16_tile = || {
        let (x, tl, h) = (dx.ptr(), dtiles.ptr(), dh.ptr());
        be.grouped_gate_up_typed(
            typed(0),
            typed(1),
            n_slots,
            x,
            dtok.ptr(),
            t,
            tl,
            n_tiles,
            64,
            h,
            n_rows,
            n,
            k,
            false,
            &epi,
        )
        .unwrap()
    };
    let int8_tile = || {
        be.quantize_q8(dx.ptr(), t, k, xq.rows()).unwrap();
        let x_rows = (xq.rows(), dtok.ptr(), t);
        be.grouped_gate_up_q8(
            (typed(0), typed(1)),
            n_slots,
            x_rows,
            (dtiles.ptr(), n_tiles),
            (dh.ptr(), n_rows),
            (n, k),
            &epi,
        )
        .unwrap()
    };
    let flop = 2.0 * 2.0 * (n_rows * n * k) as f64;
    for (name, us) in [
        ("bf16 tile", mean_launch_us(be, 3, 20, bf16_tile)),
        ("int8 tile", mean_launch_us(be, 3, 20, int8_tile)),
    ] {
        eprintln!("TIMING gate/up {name}: {us:.1} us, {:.0} TFLOP/s", flop / us / 1e6);
    }
}
