//! Criterion bench of the cold-lane CPU kernels: BF16 GEMV (2048 columns, 768 rows) at every
//! SIMD level this CPU runs, and a pool decode job (1 token x 8 experts of 2048x768 BF16).
//! The full bandwidth comparison is `moe-lanes bench-kernels` (`run_kernel_bench`).
//! `attention_decode_*`: one decode token's attention (Qwen3-30B-A3B heads: 32 query, 4 KV, 128
//! dims) at each KV cache type and context length, on the calling thread (`attention`) and split
//! over the pool (`par_attention`): where the pool starts to pay is the dense stage's
//! `ATTENTION_PAR_MIN_POSITIONS` (src/moe/dense.rs; numbers in benches/RESULTS.md).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use moe_lanes_kernels::{
    attention, available, gemv_rows, par_attention, Activation, AttentionInput, AttentionScratch,
    AttentionShape, ColdExpertWork, ColdJob, ColdPool, ExpertWeights, KvRows, KvType, SimdLevel, WeightDType,
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

fn bench_attention_decode(c: &mut Criterion) {
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let mut pool = ColdPool::new(threads);
    let level = SimdLevel::resolve(moe_lanes::env::simd_override().expect("MOE_LANES_SIMD is a level name"))
        .expect("MOE_LANES_SIMD names a supported level");
    let shape = AttentionShape { n_heads: 32, n_kv_heads: 4, head_dim: 128 };
    let q = pseudo_random_f32(shape.n_heads * shape.head_dim, 5);
    let mut out = vec![0.0f32; q.len()];
    let mut scratch = AttentionScratch::default();
    for kv_type in KvType::ALL {
        let mut group = c.benchmark_group(format!("attention_decode_{kv_type}"));
        group.sample_size(20);
        group.warm_up_time(std::time::Duration::from_millis(300));
        group.measurement_time(std::time::Duration::from_millis(800));
        for n in [16, 32, 64, 128, 256, 512, 1024, 8192] {
            let head =
                |seed| KvRows::converted(kv_type, &pseudo_random_f32(n * shape.head_dim, seed)).unwrap();
            let keys: Vec<KvRows> = (0..shape.n_kv_heads).map(|h| head(100 + h as u32)).collect();
            let values: Vec<KvRows> = (0..shape.n_kv_heads).map(|h| head(200 + h as u32)).collect();
            let input = AttentionInput {
                shape,
                q: &q,
                keys: &keys,
                values: &values,
                first_pos: n - 1,
                kv_start: 0,
                window: None,
                sinks: None,
            };
            group.bench_function(format!("{n}pos_1thread"), |b| {
                b.iter(|| attention(level, &input, &mut scratch, &mut out).unwrap())
            });
            group.bench_function(format!("{n}pos_pool{threads}"), |b| {
                b.iter(|| par_attention(&mut pool, level, &input, &mut scratch, &mut out).unwrap())
            });
        }
        group.finish();
    }
}

criterion_group!(benches, bench_gemv, bench_pool_decode, bench_attention_decode);
criterion_main!(benches);
