//! Criterion bench of the cold-lane CPU kernels: BF16 GEMV (2048 columns, 768 rows) at every
//! SIMD level this CPU runs, and a pool decode job (1 token x 8 experts of 2048x768 BF16).
//! The full bandwidth comparison is `moe-lanes bench-kernels` (`run_kernel_bench`).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use moe_lanes_kernels::{
    available, gemv_rows, Activation, ColdExpertWork, ColdJob, ColdPool, ExpertWeights, SimdLevel,
    WeightDType,
};

const HIDDEN: usize = 2048;
const FF: usize = 768;

fn pseudo_random_f32(n: usize, seed: u32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(2_654_435_761).max(1);
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        })
        .collect()
}

fn bench_gemv(c: &mut Criterion) {
    let mut group = c.benchmark_group("gemv_bf16_768x2048");
    let matrix = WeightDType::BF16.encode(&pseudo_random_f32(FF * HIDDEN, 1));
    let x = pseudo_random_f32(HIDDEN, 2);
    let mut y = vec![0.0f32; FF];
    group.throughput(Throughput::Bytes(matrix.len() as u64));
    for level in available() {
        group.bench_function(level.name(), |b| {
            b.iter(|| gemv_rows(level, WeightDType::BF16, &matrix, HIDDEN, &x, 0..FF, &mut y).unwrap())
        });
    }
    group.finish();
}

fn bench_pool_decode(c: &mut Criterion) {
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let mut pool = ColdPool::new(threads);
    let level = SimdLevel::resolve(moe_lanes::env::simd_override().expect("MOE_LANES_SIMD is a level name"))
        .expect("MOE_LANES_SIMD names a supported level");
    let n_experts = 8;
    let matrices: Vec<Vec<u8>> = (0..3 * n_experts)
        .map(|i| WeightDType::BF16.encode(&pseudo_random_f32(FF * HIDDEN, 10 + i as u32)))
        .collect();
    let x = pseudo_random_f32(HIDDEN, 3);
    let (token_idx, token_weight) = ([0u32], [0.125f32]);
    let work: Vec<ColdExpertWork<'_>> = (0..n_experts)
        .map(|e| ColdExpertWork {
            weights: ExpertWeights {
                gate: &matrices[3 * e],
                up: &matrices[3 * e + 1],
                down: &matrices[3 * e + 2],
                dtype: WeightDType::BF16,
                down_dtype: WeightDType::BF16,
                hidden: HIDDEN,
                ff: FF,
                bias: None,
            },
            token_idx: &token_idx,
            token_weight: &token_weight,
        })
        .collect();
    let job = ColdJob {
        level,
        activations: Default::default(),
        act: Activation::Silu,
        hidden: HIDDEN,
        ff: FF,
        x: &x,
        experts: &work,
    };
    let mut out = vec![0.0f32; HIDDEN];
    let mut group = c.benchmark_group("pool_decode_1tok_8experts");
    group.throughput(Throughput::Bytes(job.weight_bytes() as u64));
    group.bench_function(format!("{level}_{threads}threads"), |b| {
        b.iter(|| pool.run(&job, &mut out).unwrap())
    });
    group.finish();
}

criterion_group!(benches, bench_gemv, bench_pool_decode);
criterion_main!(benches);
