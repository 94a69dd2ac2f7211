//! Kernel bench: the machine's multi-thread read bandwidth (STREAM-like sum) against the cold
//! lane's effective weight bandwidth, measured in one run on the same pinned pool.
//!
//! Shapes follow a Qwen3-30B-A3B-like layer: hidden 2048, expert ff 768, BF16 weights, 128
//! experts, top-8 routing, SiLU.
//! - `read_gbs`: every pool thread sums its share of a buffer far larger than the LLC
//!   (2 GiB, 256 MiB when `quick`) with the best SIMD level of the CPU.
//!
//! Read, decode, layer25 and the dense GEMV are measured in interleaved rounds (8, 3 when `quick`) and each
//! keeps its best round, so the ratios compare the same machine state.
//! - `decode_gbs`: one token routed to 8 experts; effective GB/s = weight bytes of the 8
//!   experts (gate+up+down) / time per call. Calls rotate through all experts of a
//!   weight pool of 2 layers x 128 experts (~2.4 GB; 1 layer when `quick`), so every call
//!   reads weights from DRAM, not cache.
//! - `layer25_gbs`: a decode batch over a whole 128-expert layer at a 25% hit rate: 32 tokens,
//!   each routed to 8 distinct experts (256 slots, seeded), of which exactly 64 slots (25%) are
//!   hot (served by the GPU lane, skipped here) and the other 192 are computed here. Bytes =
//!   the weight bytes of each distinct expert with at least one cold slot, counted once.
//! - `dense_gemv_gbs`: the dense stage's largest GEMV, an lm_head of Qwen3's shape (151936 x
//!   2048 BF16, 622 MB; 16384 rows when `quick`) times one token on the same pool
//!   ([`crate::dense::par_matmul`]), read in place from the expert weight pool's bytes; measured
//!   in the same rounds. Effective GB/s = matrix bytes / time per call.
//! - `prefill_gflops`: 512 tokens routed top-8 over the 128 experts of the first layer, all
//!   cold, expert-major;
//!   FLOPs = 6 * hidden * ff per (token, expert) slot.
//! - `prefill_skewed_gflops`: the same with Zipf-like expert popularity (`1 / (rank + 1)^1.2`
//!   over a seeded permutation of the experts, top-8 distinct per token): the most popular half
//!   of the experts gets ~90% of the slots (`prefill_skewed_top_half_share`), the most popular
//!   expert a few hundred tokens, many experts a handful. Same FLOPs as the uniform case.
//!
//! Ratios are to `read_gbs`.

use std::hint::black_box;
use std::time::Instant;

use serde::Serialize;

use crate::error::KernelError;
use crate::pool::{ColdExpertWork, ColdJob, ColdPool, MAX_POOL_THREADS};
use crate::q8::DecodeActivations;
use crate::simd::SimdLevel;
use crate::weights::{Activation, ExpertWeights, WeightDType};

const HIDDEN: usize = 2048;
const FF: usize = 768;
const N_EXPERTS: usize = 128;
const TOP_K: usize = 8;
const LAYER25_TOKENS: usize = 32;
const LAYER25_HOT_SLOTS: usize = LAYER25_TOKENS * TOP_K / 4;
const PREFILL_TOKENS: usize = 512;
/// Rows of the dense GEMV (Qwen3's vocabulary: its lm_head).
const DENSE_GEMV_ROWS: usize = 151_936;
/// Rows of the dense GEMV when `quick`.
const DENSE_GEMV_ROWS_QUICK: usize = 16_384;
/// Exponent of the skewed prefill's expert popularity `1 / (rank + 1)^s`.
const PREFILL_ZIPF_EXPONENT: f64 = 1.2;

/// What to run the bench with.
#[derive(Debug, Clone, Copy, Default)]
pub struct KernelBenchOptions {
    /// Pool threads; default: every CPU this process may use.
    pub threads: Option<usize>,
    /// SIMD level; default: `MOE_LANES_SIMD` or the detected best.
    pub simd: Option<SimdLevel>,
    /// Smaller read buffer and fewer repetitions (for tests and smoke runs).
    pub quick: bool,
    /// Element type of the expert weights; default BF16. Quantised types get random blocks
    /// with sane f16 scales.
    pub dtype: Option<WeightDType>,
    /// Activations of the quantised one-token tiles; default: Auto where the level has VNNI.
    pub activations: Option<DecodeActivations>,
}

/// Results of [`run_kernel_bench`]; GB are 1e9 bytes.
#[derive(Debug, Clone, Serialize)]
pub struct KernelBenchReport {
    pub simd: SimdLevel,
    /// Activations the one-token tiles of quantised weights ran with (Q8 or Auto only on VNNI
    /// levels).
    pub activations: DecodeActivations,
    /// Element type of the expert weights (bytes/s count the bytes of this type).
    pub dtype: WeightDType,
    pub threads: usize,
    /// Multi-thread read bandwidth of the machine (best pass), GB/s.
    pub read_gbs: f64,
    /// SIMD level used by the read probe (the best detected one).
    pub read_simd: SimdLevel,
    pub read_buffer_bytes: usize,
    /// Decode (1 token, 8 experts of 2048x768 BF16) effective weight bandwidth, GB/s.
    pub decode_gbs: f64,
    pub decode_ratio: f64,
    pub decode_call_us: f64,
    pub decode_weight_bytes: usize,
    /// Whole 128-expert layer, 32 tokens x top-8, 25% of slots hot, GB/s.
    pub layer25_gbs: f64,
    pub layer25_ratio: f64,
    pub layer25_call_us: f64,
    pub layer25_cold_slots: usize,
    pub layer25_cold_experts: usize,
    pub layer25_weight_bytes: usize,
    /// Dense GEMV (lm_head-shaped `rows x hidden` BF16, one token) on the pool, GB/s.
    pub dense_gemv_gbs: f64,
    pub dense_gemv_ratio: f64,
    pub dense_gemv_call_us: f64,
    pub dense_gemv_rows: usize,
    /// Prefill, 512 tokens x top-8 over 128 experts, expert-major, GFLOP/s.
    pub prefill_gflops: f64,
    pub prefill_call_ms: f64,
    /// Prefill as above with Zipf-like expert popularity (same FLOPs), GFLOP/s.
    pub prefill_skewed_gflops: f64,
    pub prefill_skewed_call_ms: f64,
    /// Share of the skewed prefill's slots routed to the most popular half of the experts.
    pub prefill_skewed_top_half_share: f64,
    /// Tokens of the skewed prefill's most popular expert.
    pub prefill_skewed_max_tokens: usize,
    pub hidden: usize,
    pub ff: usize,
    pub weight_pool_bytes: usize,
    pub quick: bool,
}

impl KernelBenchReport {
    /// One JSON object.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a bench report always serializes")
    }

    /// A small human-readable table.
    pub fn to_text(&self) -> String {
        let mut text = String::new();
        text += &format!(
            "cold-lane kernel bench: simd={} activations={} threads={} (read probe simd={}, hidden={} ff={} {})\n",
            self.simd,
            self.activations,
            self.threads,
            self.read_simd,
            self.hidden,
            self.ff,
            self.dtype.name()
        );
        text += &format!("{:<34} {:>12} {:>10} {:>12}\n", "measurement", "value", "ratio", "per call");
        text += &format!(
            "{:<34} {:>8.2} GB/s {:>10} {:>12}\n",
            format!("read bandwidth ({} MiB)", self.read_buffer_bytes >> 20),
            self.read_gbs,
            "1.00",
            "-"
        );
        text += &format!(
            "{:<34} {:>8.2} GB/s {:>10.3} {:>9.1} us\n",
            "decode 1 tok x 8 experts", self.decode_gbs, self.decode_ratio, self.decode_call_us
        );
        text += &format!(
            "{:<34} {:>8.2} GB/s {:>10.3} {:>9.1} us\n",
            format!("layer 25% hot ({} cold exp.)", self.layer25_cold_experts),
            self.layer25_gbs,
            self.layer25_ratio,
            self.layer25_call_us
        );
        text += &format!(
            "{:<34} {:>8.2} GB/s {:>10.3} {:>9.1} us\n",
            format!("dense gemv {}x{} (1 tok)", self.dense_gemv_rows, self.hidden),
            self.dense_gemv_gbs,
            self.dense_gemv_ratio,
            self.dense_gemv_call_us
        );
        text += &format!(
            "{:<34} {:>6.1} GFLOP/s {:>10} {:>9.1} ms\n",
            "prefill 512 tok expert-major", self.prefill_gflops, "-", self.prefill_call_ms
        );
        text += &format!(
            "{:<34} {:>6.1} GFLOP/s {:>10} {:>9.1} ms\n",
            format!("prefill skewed (top half {:.0}%)", 100.0 * self.prefill_skewed_top_half_share),
            self.prefill_skewed_gflops,
            "-",
            self.prefill_skewed_call_ms
        );
        text
    }
}

/// SplitMix64: small deterministic generator for bench data.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in [-scale, scale).
    fn symmetric(&mut self, scale: f32) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
    }
}

/// A raw pointer that may cross to pool threads; each thread writes a disjoint range.
#[derive(Clone, Copy)]
struct SendPtr<T>(*mut T);
// SAFETY: only used to hand disjoint sub-ranges of one buffer to pool threads inside a
// broadcast that completes before the buffer is touched again.
unsafe impl<T> Send for SendPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SendPtr<T> {}

/// Fills `buffer` in parallel (first touch by the threads that will read it).
fn parallel_fill(
    pool: &mut ColdPool,
    buffer: &mut [u8],
    fill: impl Fn(&mut [u8], u64) + Sync,
) -> Result<(), KernelError> {
    let (base, len) = (SendPtr(buffer.as_mut_ptr()), buffer.len());
    pool.broadcast(&|index, n_threads| {
        let (start, end) = (index * len / n_threads, (index + 1) * len / n_threads);
        // Moves the whole SendPtr (Send) into the closure, not its raw-pointer field.
        #[allow(clippy::redundant_locals)]
        let base = base;
        // SAFETY: [start, end) ranges of different threads are disjoint and inside `buffer`,
        // which stays mutably borrowed until the broadcast returns.
        let part = unsafe { std::slice::from_raw_parts_mut(base.0.add(start), end - start) };
        fill(part, index as u64);
    })
}

fn sum_f32(level: SimdLevel, data: &[f32]) -> f32 {
    match level {
        // SAFETY: the level is supported (checked by the caller); the slice is readable.
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 | SimdLevel::Avx512Bf16 | SimdLevel::Amx => unsafe {
            crate::x86_avx512::sum_f32(data.as_ptr(), data.len())
        },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => unsafe { crate::x86_avx2::sum_f32(data.as_ptr(), data.len()) },
        _ => {
            let mut acc = [0.0f32; 16];
            let chunks = data.chunks_exact(16);
            let rest: f32 = chunks.remainder().iter().sum();
            for chunk in chunks {
                for (a, v) in acc.iter_mut().zip(chunk) {
                    *a += v;
                }
            }
            acc.iter().sum::<f32>() + rest
        }
    }
}

/// Best multi-thread read bandwidth over `passes` passes of `buffer`, in GB/s.
fn measure_read_gbs(
    pool: &mut ColdPool,
    level: SimdLevel,
    buffer: &[f32],
    passes: usize,
) -> Result<f64, KernelError> {
    let mut best = 0.0f64;
    for _ in 0..passes {
        let start = Instant::now();
        pool.broadcast(&|index, n_threads| {
            let (lo, hi) = (index * buffer.len() / n_threads, (index + 1) * buffer.len() / n_threads);
            black_box(sum_f32(level, &buffer[lo..hi]));
        })?;
        let seconds = start.elapsed().as_secs_f64();
        best = best.max(std::mem::size_of_val(buffer) as f64 / seconds / 1e9);
    }
    Ok(best)
}

/// The expert weight pool: `bytes` of seeded BF16 values in (-0.05, 0.05), filled by the pool.
fn bench_weight_pool(pool: &mut ColdPool, bytes: usize, dtype: WeightDType) -> Result<Vec<u8>, KernelError> {
    let mut weight_pool = vec![0u8; bytes];
    parallel_fill(pool, &mut weight_pool, |part, seed| {
        let mut rng = SplitMix64(seed.wrapping_mul(0x1234_5678_9ABC_DEF1) ^ 0x5EED);
        for pair in part.chunks_exact_mut(2) {
            let bits = half::bf16::from_f32(rng.symmetric(0.05)).to_bits();
            pair.copy_from_slice(&bits.to_le_bytes());
        }
    })?;
    // Random bytes are valid quantised values; only the f16 scales need sane magnitudes.
    let scale_at: &[usize] = match dtype {
        WeightDType::Q8_0 | WeightDType::Q4_0 | WeightDType::Q5_0 | WeightDType::Iq4Nl => &[0],
        WeightDType::Q4_K | WeightDType::Q5_K | WeightDType::Q5_1 => &[0, 2],
        WeightDType::Q6_K => &[208],
        WeightDType::Mxfp4 | WeightDType::F32 | WeightDType::F16 | WeightDType::BF16 => &[],
    };
    if dtype == WeightDType::Mxfp4 {
        // The E8M0 scale byte: 2^(120 - 128) per doubled level, values up to about 0.05.
        weight_pool.chunks_exact_mut(dtype.block_bytes()).for_each(|block| block[0] = 120);
    }
    let scale = half::f16::from_f32(0.01).to_bits().to_le_bytes();
    if !scale_at.is_empty() {
        for block in weight_pool.chunks_exact_mut(dtype.block_bytes()) {
            scale_at.iter().for_each(|&at| block[at..at + 2].copy_from_slice(&scale));
        }
    }
    Ok(weight_pool)
}

/// `n_layers * N_EXPERTS` experts laid out back to back (gate, up, down) in `weight_pool`.
fn expert_views(
    weight_pool: &[u8],
    n_layers: usize,
    matrix_bytes: usize,
    dtype: WeightDType,
) -> Vec<ExpertWeights<'_>> {
    let expert_bytes = 3 * matrix_bytes;
    (0..n_layers * N_EXPERTS)
        .map(|e| {
            let base = &weight_pool[e * expert_bytes..][..expert_bytes];
            ExpertWeights {
                gate: &base[..matrix_bytes],
                up: &base[matrix_bytes..2 * matrix_bytes],
                down: &base[2 * matrix_bytes..],
                dtype,
                down_dtype: dtype,
                hidden: HIDDEN,
                ff: FF,
                bias: None,
            }
        })
        .collect()
}

/// The layer at 25% hit rate: 32 tokens x top-8 distinct experts, exactly 25% of the slots hot
/// (seeded Fisher-Yates), the rest cold. Returns the cold slots' tokens and weights per expert,
/// and the cold slot count.
fn layer25_routing(rng: &mut SplitMix64) -> (Vec<Vec<u32>>, Vec<Vec<f32>>, usize) {
    let mut slots: Vec<(u32, usize, f32)> = Vec::with_capacity(LAYER25_TOKENS * TOP_K);
    for token in 0..LAYER25_TOKENS {
        let mut chosen: Vec<usize> = Vec::with_capacity(TOP_K);
        while chosen.len() < TOP_K {
            let expert = rng.below(N_EXPERTS);
            if !chosen.contains(&expert) {
                chosen.push(expert);
            }
        }
        slots.extend(chosen.into_iter().map(|expert| (token as u32, expert, 1.0 / TOP_K as f32)));
    }
    for i in (1..slots.len()).rev() {
        slots.swap(i, rng.below(i + 1));
    }
    let cold_slots = &slots[LAYER25_HOT_SLOTS..];
    let (mut tokens, mut weights) = (vec![Vec::new(); N_EXPERTS], vec![Vec::new(); N_EXPERTS]);
    for &(token, expert, weight) in cold_slots {
        tokens[expert].push(token);
        weights[expert].push(weight);
    }
    (tokens, weights, cold_slots.len())
}

/// Zipf-like popularity 1/(rank+1)^1.2 over a seeded permutation of the experts: the top half
/// of the experts gets ~90% of the slots (reported), the most popular ones a few hundred tokens.
fn zipf_popularity(rng: &mut SplitMix64) -> Vec<f64> {
    let mut ranks: Vec<usize> = (0..N_EXPERTS).collect();
    for i in (1..N_EXPERTS).rev() {
        ranks.swap(i, rng.below(i + 1));
    }
    ranks.iter().map(|&rank| 1.0 / ((rank + 1) as f64).powf(PREFILL_ZIPF_EXPONENT)).collect()
}

/// Share of the slots the top half of the experts got, and the largest per-expert count.
fn top_half_share(counts: &[usize]) -> (f64, usize) {
    let mut sorted = counts.to_vec();
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    let top_half: usize = sorted[..N_EXPERTS / 2].iter().sum();
    (top_half as f64 / (PREFILL_TOKENS * TOP_K) as f64, sorted[0])
}

/// Threads of the bench's pool: the given count (1..=[`MAX_POOL_THREADS`]), or every CPU this
/// process may use (at most that).
fn pool_threads(threads: Option<usize>) -> Result<usize, KernelError> {
    let all = || std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(MAX_POOL_THREADS);
    let n = threads.unwrap_or_else(all);
    if !(1..=MAX_POOL_THREADS).contains(&n) {
        return Err(KernelError::InvalidOption(format!("threads {n}: expected 1 to {MAX_POOL_THREADS}")));
    }
    Ok(n)
}

/// Decode work: one token routed to `TOP_K` consecutive experts, one group per `TOP_K` experts.
fn decode_groups<'a>(
    experts: &[ExpertWeights<'a>],
    token: &'a [u32],
    weight: &'a [f32],
) -> Vec<Vec<ColdExpertWork<'a>>> {
    experts
        .chunks_exact(TOP_K)
        .map(|group| {
            group
                .iter()
                .map(|&weights| ColdExpertWork { weights, token_idx: token, token_weight: weight })
                .collect()
        })
        .collect()
}

/// The layer25 routing applied to every layer of the pool (calls alternate between layers).
fn layer_works<'a>(
    experts: &[ExpertWeights<'a>],
    n_layers: usize,
    tokens: &'a [Vec<u32>],
    weights: &'a [Vec<f32>],
) -> Vec<Vec<ColdExpertWork<'a>>> {
    (0..n_layers)
        .map(|layer| {
            (0..N_EXPERTS)
                .map(|e| ColdExpertWork {
                    weights: experts[layer * N_EXPERTS + e],
                    token_idx: &tokens[e],
                    token_weight: &weights[e],
                })
                .collect()
        })
        .collect()
}

/// Prefill figures for uniform and Zipf-skewed routing.
struct PrefillPair {
    uniform_gflops: f64,
    uniform_seconds: f64,
    skewed_gflops: f64,
    skewed_seconds: f64,
    top_half_share: f64,
    max_tokens: usize,
}

/// 512 tokens x top-8, all cold, expert-major: uniform routing, then skewed.
fn measure_prefill_pair(
    pool: &mut ColdPool,
    (level, activations): (SimdLevel, DecodeActivations),
    experts: &[ExpertWeights<'_>],
    rng: &mut SplitMix64,
    calls: usize,
) -> Result<PrefillPair, KernelError> {
    let x: Vec<f32> = (0..PREFILL_TOKENS * HIDDEN).map(|_| rng.symmetric(1.0)).collect();
    let uniform = vec![1.0f64; N_EXPERTS];
    let (uniform_gflops, uniform_seconds, _, _) =
        measure_prefill(pool, (level, activations), experts, &x, &uniform, rng, calls)?;
    let zipf = zipf_popularity(rng);
    let (skewed_gflops, skewed_seconds, counts, _) =
        measure_prefill(pool, (level, activations), experts, &x, &zipf, rng, calls)?;
    let (top_half_share, max_tokens) = top_half_share(&counts);
    Ok(PrefillPair {
        uniform_gflops,
        uniform_seconds,
        skewed_gflops,
        skewed_seconds,
        top_half_share,
        max_tokens,
    })
}

/// A SwiGLU cold job of the bench's shapes over `experts` with inputs `x`.
fn silu_job<'a>(
    (level, activations): (SimdLevel, DecodeActivations),
    x: &'a [f32],
    experts: &'a [ColdExpertWork<'a>],
) -> ColdJob<'a> {
    ColdJob { level, activations, act: Activation::Silu, hidden: HIDDEN, ff: FF, x, experts }
}

/// The read probe's buffer, `bytes` long, filled (so every page is touched) on the pool.
fn read_probe_buffer(pool: &mut ColdPool, bytes: usize) -> Result<Vec<u8>, KernelError> {
    let mut buffer = vec![0u8; bytes];
    parallel_fill(pool, &mut buffer, |part, seed| part.fill((seed % 7) as u8 + 1))?;
    Ok(buffer)
}

/// Runs the whole bench; see the module docs for what each number means.
pub fn run_kernel_bench(opts: KernelBenchOptions) -> Result<KernelBenchReport, KernelError> {
    let level = SimdLevel::resolve(opts.simd)?;
    let activations = DecodeActivations::resolve(opts.activations, level);
    let mut pool = ColdPool::try_new(pool_threads(opts.threads)?)?;
    let read_simd = SimdLevel::detect();
    let BenchMemory { read_buffer, weight_pool, dtype, matrix_bytes, n_layers } =
        bench_memory(&mut pool, &opts)?;
    let read_buffer_bytes = read_buffer.len();
    let experts = expert_views(&weight_pool, n_layers, matrix_bytes, dtype);
    let mut rng = SplitMix64(42);
    let memory = RoundMemory {
        read: (read_simd, bytemuck::cast_slice(&read_buffer)),
        experts: &experts,
        n_layers,
        expert_bytes: 3 * matrix_bytes,
        weight_pool: &weight_pool,
        dtype,
    };
    let r = measure_rounds(&mut pool, (level, activations), &memory, &opts, &mut rng)?;
    drop(read_buffer);
    let best = &r.best;
    let read_gbs = best.read_gbs;
    let dense_gemv_gbs = r.dense_gemv_bytes as f64 / best.gemv_s / 1e9;
    let decode_gbs = r.decode_weight_bytes as f64 / best.decode_s / 1e9;
    let layer25_gbs = r.layer25_weight_bytes as f64 / best.layer25_s / 1e9;

    // 6. Prefill: 512 tokens x top-8, all cold, expert-major; uniform then skewed routing.
    let prefill_calls = if opts.quick { 1 } else { 3 };
    let pf = measure_prefill_pair(
        &mut pool,
        (level, activations),
        &experts[..N_EXPERTS],
        &mut rng,
        prefill_calls,
    )?;

    let mut report = KernelBenchReport {
        simd: level,
        activations,
        threads: pool.n_threads(),
        read_gbs,
        read_simd,
        read_buffer_bytes,
        decode_gbs,
        decode_ratio: decode_gbs / read_gbs,
        decode_call_us: best.decode_s * 1e6,
        decode_weight_bytes: r.decode_weight_bytes,
        layer25_gbs,
        layer25_ratio: layer25_gbs / read_gbs,
        layer25_call_us: best.layer25_s * 1e6,
        layer25_cold_slots: r.layer25_cold_slots,
        layer25_cold_experts: r.layer25_cold_experts,
        layer25_weight_bytes: r.layer25_weight_bytes,
        dense_gemv_gbs,
        dense_gemv_ratio: dense_gemv_gbs / read_gbs,
        dense_gemv_call_us: best.gemv_s * 1e6,
        dense_gemv_rows: r.dense_gemv_rows,
        prefill_gflops: 0.0,
        prefill_call_ms: 0.0,
        prefill_skewed_gflops: 0.0,
        prefill_skewed_call_ms: 0.0,
        prefill_skewed_top_half_share: 0.0,
        prefill_skewed_max_tokens: 0,
        hidden: HIDDEN,
        ff: FF,
        weight_pool_bytes: weight_pool.len(),
        quick: opts.quick,
        dtype,
    };
    report.set_prefill(&pf);
    Ok(report)
}

/// What steps 3-5 read: the read probe's level and buffer, the expert views over the weight
/// pool (`n_layers` layers of experts of `expert_bytes`), the pool's bytes and type.
struct RoundMemory<'a> {
    read: (SimdLevel, &'a [f32]),
    experts: &'a [ExpertWeights<'a>],
    n_layers: usize,
    expert_bytes: usize,
    weight_pool: &'a [u8],
    dtype: WeightDType,
}

/// Steps 3-5's best times and the bytes one call of each reads.
struct RoundFigures {
    best: BestTimes,
    decode_weight_bytes: usize,
    layer25_weight_bytes: usize,
    layer25_cold_slots: usize,
    layer25_cold_experts: usize,
    dense_gemv_bytes: usize,
    dense_gemv_rows: usize,
}

/// Steps 3-5: decode, the layer at 25% hot and the dense GEMV, each run once to warm up, then
/// interleaved with the read probe over rounds.
fn measure_rounds(
    pool: &mut ColdPool,
    (level, activations): (SimdLevel, DecodeActivations),
    m: &RoundMemory<'_>,
    opts: &KernelBenchOptions,
    rng: &mut SplitMix64,
) -> Result<RoundFigures, KernelError> {
    let (experts, n_layers) = (m.experts, m.n_layers);
    let random_x = |rng: &mut SplitMix64, n_tokens: usize| -> Vec<f32> {
        (0..n_tokens * HIDDEN).map(|_| rng.symmetric(1.0)).collect()
    };

    // 3. Decode: 1 token x 8 experts, rotating through the pool.
    let decode_x = random_x(rng, 1);
    let mut decode_out = vec![0.0f32; HIDDEN];
    let token_zero = [0u32];
    let routing_weight = [1.0f32 / TOP_K as f32];
    let decode_groups = decode_groups(experts, &token_zero, &routing_weight);
    let decode_job =
        |group: usize| silu_job((level, activations), &decode_x, &decode_groups[group % decode_groups.len()]);
    for group in 0..decode_groups.len() {
        pool.run(&decode_job(group), &mut decode_out)?;
    }
    // 4. Layer at 25% hit rate: 32 tokens x top-8 distinct experts, 64 of 256 slots hot.
    let layer_x = random_x(rng, LAYER25_TOKENS);
    let (per_expert_tokens, per_expert_weights, layer25_cold_slots) = layer25_routing(rng);
    // The same routing on every layer of the pool; calls alternate between layers.
    let layer_works = layer_works(experts, n_layers, &per_expert_tokens, &per_expert_weights);
    let layer_job = |layer: usize| silu_job((level, activations), &layer_x, &layer_works[layer % n_layers]);
    let mut layer_out = vec![0.0f32; LAYER25_TOKENS * HIDDEN];
    for layer in 0..n_layers {
        pool.run(&layer_job(layer), &mut layer_out)?;
    }

    // 5. Dense GEMV: an lm_head-shaped matrix over the weight pool's first bytes.
    let dense_gemv_rows = if opts.quick { DENSE_GEMV_ROWS_QUICK } else { DENSE_GEMV_ROWS };
    let gemv_bytes = &m.weight_pool[..dense_gemv_rows * m.dtype.row_bytes(HIDDEN)];
    let gemv_w = crate::dense::DenseMatrix::new(gemv_bytes, m.dtype, dense_gemv_rows, HIDDEN)?;
    let mut gemv_y = vec![0.0f32; dense_gemv_rows];
    let gemv = |pool: &mut ColdPool, y: &mut [f32]| {
        let part = crate::dense::MatmulPart { w: gemv_w, y };
        crate::dense::par_matmul(pool, (level, activations), &decode_x, &mut [part])
    };
    gemv(pool, &mut gemv_y)?;

    // Rounds interleave the read probe, decode, layer25 and the dense GEMV so that all see the
    // same machine state (other processes come and go); each keeps its best round.
    let rounds = if opts.quick { 3 } else { 8 };
    let decode_calls_per_round = 2 * decode_groups.len();
    let best = interleaved_rounds(
        pool,
        rounds,
        (m.read.0, m.read.1, if opts.quick { 2 } else { 4 }),
        &mut |pool, round| {
            for call in 0..decode_calls_per_round {
                pool.run(&decode_job(round + call), &mut decode_out)?;
            }
            Ok(decode_calls_per_round)
        },
        &mut |pool, round| pool.run(&layer_job(round), &mut layer_out),
        &mut |pool| gemv(pool, &mut gemv_y),
    )?;
    black_box((&decode_out, &layer_out, &gemv_y));
    let layer25_weight_bytes = layer_job(0).weight_bytes();
    Ok(RoundFigures {
        best,
        decode_weight_bytes: decode_job(0).weight_bytes(),
        layer25_weight_bytes,
        layer25_cold_slots,
        layer25_cold_experts: layer25_weight_bytes / m.expert_bytes,
        dense_gemv_bytes: gemv_w.bytes.len(),
        dense_gemv_rows,
    })
}

impl KernelBenchReport {
    /// Step 6's figures.
    fn set_prefill(&mut self, pf: &PrefillPair) {
        self.prefill_gflops = pf.uniform_gflops;
        self.prefill_call_ms = pf.uniform_seconds * 1e3;
        self.prefill_skewed_gflops = pf.skewed_gflops;
        self.prefill_skewed_call_ms = pf.skewed_seconds * 1e3;
        self.prefill_skewed_top_half_share = pf.top_half_share;
        self.prefill_skewed_max_tokens = pf.max_tokens;
    }
}

/// The bench's memory: the read probe's buffer (step 1) and the expert weight pool (step 2).
struct BenchMemory {
    read_buffer: Vec<u8>,
    weight_pool: Vec<u8>,
    dtype: WeightDType,
    matrix_bytes: usize,
    n_layers: usize,
}

/// Steps 1 and 2: the read probe's buffer, 2 GiB (several times any LLC, so adaptive LLC
/// replacement cannot keep a useful part), and 128 distinct experts per layer, two layers (one
/// when quick), so the cyclic working set is ~2.4 GB in BF16: far past any LLC (the GPU machine's
/// Xeon has 300 MiB of L3, whose adaptive replacement keeps part of a cyclic set only slightly
/// larger than the cache).
fn bench_memory(pool: &mut ColdPool, opts: &KernelBenchOptions) -> Result<BenchMemory, KernelError> {
    let read_buffer_bytes: usize = if opts.quick { 256 << 20 } else { 2 << 30 };
    let read_buffer = read_probe_buffer(pool, read_buffer_bytes)?;
    let dtype = opts.dtype.unwrap_or(WeightDType::BF16);
    let matrix_bytes = FF * dtype.row_bytes(HIDDEN);
    let n_layers = if opts.quick { 1 } else { 2 };
    let weight_pool = bench_weight_pool(pool, n_layers * N_EXPERTS * 3 * matrix_bytes, dtype)?;
    Ok(BenchMemory { read_buffer, weight_pool, dtype, matrix_bytes, n_layers })
}

/// Best of the interleaved rounds: read bandwidth, seconds per decode call, per layer25 call and
/// per dense GEMV.
struct BestTimes {
    read_gbs: f64,
    decode_s: f64,
    layer25_s: f64,
    gemv_s: f64,
}

/// Job closures of one round: decode (returns its call count), layer25, the dense GEMV.
type RoundJob<'a> = dyn FnMut(&mut ColdPool, usize) -> Result<(), KernelError> + 'a;
type DecodeRound<'a> = dyn FnMut(&mut ColdPool, usize) -> Result<usize, KernelError> + 'a;
type GemvRound<'a> = dyn FnMut(&mut ColdPool) -> Result<(), KernelError> + 'a;

/// `rounds` rounds of: one read-probe pass, the decode calls, one layer25 call, one dense GEMV;
/// the read probe first gets `read.2` back-to-back passes. Each part keeps its best round.
fn interleaved_rounds(
    pool: &mut ColdPool,
    rounds: usize,
    read: (SimdLevel, &[f32], usize),
    decode: &mut DecodeRound<'_>,
    layer25: &mut RoundJob<'_>,
    gemv: &mut GemvRound<'_>,
) -> Result<BestTimes, KernelError> {
    let (read_simd, read_floats, first_passes) = read;
    let mut best = BestTimes {
        read_gbs: measure_read_gbs(pool, read_simd, read_floats, first_passes)?,
        decode_s: f64::INFINITY,
        layer25_s: f64::INFINITY,
        gemv_s: f64::INFINITY,
    };
    for round in 0..rounds {
        best.read_gbs = best.read_gbs.max(measure_read_gbs(pool, read_simd, read_floats, 1)?);
        let start = Instant::now();
        let calls = decode(pool, round)?;
        best.decode_s = best.decode_s.min(start.elapsed().as_secs_f64() / calls as f64);
        let start = Instant::now();
        layer25(pool, round)?;
        best.layer25_s = best.layer25_s.min(start.elapsed().as_secs_f64());
        let start = Instant::now();
        gemv(pool)?;
        best.gemv_s = best.gemv_s.min(start.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// Routes `x`'s tokens top-8 (distinct experts drawn with probability proportional to
/// `popularity`) over `experts`, all cold, and times `calls` pool calls after a warm-up.
/// Returns GFLOP/s and seconds of the best call, tokens per expert, and the FLOPs.
fn measure_prefill(
    pool: &mut ColdPool,
    kernels: (SimdLevel, DecodeActivations),
    experts: &[ExpertWeights<'_>],
    x: &[f32],
    popularity: &[f64],
    rng: &mut SplitMix64,
    calls: usize,
) -> Result<(f64, f64, Vec<usize>, f64), KernelError> {
    let n_tokens = x.len() / HIDDEN;
    let total: f64 = popularity.iter().sum();
    let (mut tokens, mut weights) = (vec![Vec::new(); experts.len()], vec![Vec::new(); experts.len()]);
    for token in 0..n_tokens {
        let mut chosen: Vec<usize> = Vec::with_capacity(TOP_K);
        while chosen.len() < TOP_K {
            let mut draw = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
            let mut expert = experts.len() - 1;
            for (e, &p) in popularity.iter().enumerate() {
                if draw < p {
                    expert = e;
                    break;
                }
                draw -= p;
            }
            if !chosen.contains(&expert) {
                chosen.push(expert);
            }
        }
        for expert in chosen {
            tokens[expert].push(token as u32);
            weights[expert].push(1.0 / TOP_K as f32);
        }
    }
    let work: Vec<ColdExpertWork<'_>> = (0..experts.len())
        .map(|e| ColdExpertWork { weights: experts[e], token_idx: &tokens[e], token_weight: &weights[e] })
        .collect();
    let job = silu_job(kernels, x, &work);
    let mut out = vec![0.0f32; x.len()];
    pool.run(&job, &mut out)?;
    let mut best_seconds = f64::INFINITY;
    for _ in 0..calls {
        let start = Instant::now();
        pool.run(&job, &mut out)?;
        best_seconds = best_seconds.min(start.elapsed().as_secs_f64());
    }
    black_box(&out);
    let counts = tokens.iter().map(Vec::len).collect();
    Ok((job.flops() / best_seconds / 1e9, best_seconds, counts, job.flops()))
}
