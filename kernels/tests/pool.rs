//! The cold pool against the single-thread scalar oracle `ColdPool::run_reference`: random
//! jobs with tokens repeated across experts, experts with zero tokens, more threads than rows,
//! every level and dtype, one pool reused across jobs of different sizes.

mod common;

use common::{relative_error, tolerance, MisalignedBytes, QuantBytes, Rng, Q8_ACTIVATION_TOLERANCE};
use moe_lanes_kernels::pool::ColdSchedule;
use moe_lanes_kernels::{
    available, Activation, ColdExpertWork, ColdJob, ColdPool, DecodeActivations, ExpertWeights, KernelError,
    SimdLevel, WeightDType, Q8_MAX_TOKENS,
};

struct RandomJob {
    hidden: usize,
    ff: usize,
    dtype: WeightDType,
    down_dtype: WeightDType,
    x: Vec<f32>,
    weights: Vec<[MisalignedBytes; 3]>,
    token_idx: Vec<Vec<u32>>,
    token_weight: Vec<Vec<f32>>,
}

impl RandomJob {
    fn new(
        rng: &mut Rng,
        dtype: WeightDType,
        hidden: usize,
        ff: usize,
        n_tokens: usize,
        n_experts: usize,
    ) -> RandomJob {
        let mut job = RandomJob {
            hidden,
            ff,
            dtype,
            down_dtype: dtype,
            x: rng.vec(n_tokens * hidden, 1.0),
            weights: Vec::new(),
            token_idx: Vec::new(),
            token_weight: Vec::new(),
        };
        for expert in 0..n_experts {
            job.weights.push([
                MisalignedBytes::new(dtype, &rng.vec(ff * hidden, 0.3)),
                MisalignedBytes::new(dtype, &rng.vec(ff * hidden, 0.3)),
                MisalignedBytes::new(dtype, &rng.vec(hidden * ff, 0.3)),
            ]);
            // Expert 0 always has no tokens; others get a random subset (tokens repeat across experts).
            let tokens: Vec<u32> = if expert == 0 {
                Vec::new()
            } else {
                (0..n_tokens as u32).filter(|_| rng.below(3) != 0).collect()
            };
            job.token_weight.push(rng.vec(tokens.len(), 1.0));
            job.token_idx.push(tokens);
        }
        job
    }

    /// As [`RandomJob::new`] with random quantised blocks: gate/up of `dtype`, down of
    /// `down_dtype`.
    fn quantized(
        rng: &mut Rng,
        (dtype, down_dtype): (WeightDType, WeightDType),
        (hidden, ff): (usize, usize),
        n_tokens: usize,
        n_experts: usize,
    ) -> RandomJob {
        let mut job = RandomJob::new(rng, WeightDType::F32, 1, 1, n_tokens, n_experts);
        (job.dtype, job.down_dtype, job.hidden, job.ff) = (dtype, down_dtype, hidden, ff);
        job.x = rng.vec(n_tokens * hidden, 1.0);
        for weights in &mut job.weights {
            *weights = [
                QuantBytes::random(rng, dtype, ff, hidden, 0.01).into(),
                QuantBytes::random(rng, dtype, ff, hidden, 0.01).into(),
                QuantBytes::random(rng, down_dtype, hidden, ff, 0.01).into(),
            ];
        }
        job
    }

    fn work(&self) -> Vec<ColdExpertWork<'_>> {
        (0..self.weights.len())
            .map(|e| ColdExpertWork {
                weights: ExpertWeights {
                    gate: self.weights[e][0].bytes(),
                    up: self.weights[e][1].bytes(),
                    down: self.weights[e][2].bytes(),
                    dtype: self.dtype,
                    down_dtype: self.down_dtype,
                    hidden: self.hidden,
                    ff: self.ff,
                    bias: None,
                },
                token_idx: &self.token_idx[e],
                token_weight: &self.token_weight[e],
            })
            .collect()
    }
}

#[test]
fn pool_matches_reference_on_random_jobs() {
    let mut rng = Rng(0xC01D);
    for n_threads in [1, 2, 3, 8] {
        let mut pool = ColdPool::new(n_threads);
        assert_eq!(pool.n_threads(), n_threads);
        for (hidden, ff, n_tokens, n_experts) in
            [(5, 3, 2, 3), (37, 53, 7, 5), (64, 40, 1, 4), (130, 21, 19, 6)]
        {
            for dtype in WeightDType::FLOATS {
                let random = RandomJob::new(&mut rng, dtype, hidden, ff, n_tokens, n_experts);
                let work = random.work();
                let initial = rng.vec(n_tokens * hidden, 1.0);
                for act in [Activation::Silu, Activation::Gelu] {
                    let mut reference = initial.clone();
                    let job = ColdJob {
                        level: SimdLevel::Scalar,
                        activations: DecodeActivations::F32,
                        act,
                        hidden,
                        ff,
                        x: &random.x,
                        experts: &work,
                    };
                    ColdPool::run_reference(&job, &mut reference).unwrap();
                    for level in available() {
                        let mut out = initial.clone();
                        pool.run(&ColdJob { level, ..job }, &mut out).unwrap();
                        let error = relative_error(&out, &reference);
                        assert!(
                            error <= tolerance(level, dtype),
                            "threads={n_threads} {level} {dtype:?} {act:?} {hidden}x{ff} tokens={n_tokens}: {error:e}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn pool_decode_2048x768_matches_reference() {
    let mut rng = Rng(0xBEEF);
    let random = RandomJob::new(&mut rng, WeightDType::BF16, 2048, 768, 1, 4);
    let work = random.work();
    let mut pool = ColdPool::new(2);
    let job = ColdJob {
        level: SimdLevel::Scalar,
        activations: DecodeActivations::F32,
        act: Activation::Silu,
        hidden: 2048,
        ff: 768,
        x: &random.x,
        experts: &work,
    };
    let mut reference = vec![0.0; 2048];
    ColdPool::run_reference(&job, &mut reference).unwrap();
    for level in available() {
        let mut out = vec![0.0; 2048];
        pool.run(&ColdJob { level, ..job }, &mut out).unwrap();
        let error = relative_error(&out, &reference);
        assert!(error <= tolerance(level, WeightDType::BF16), "{level}: {error:e}");
    }
}

#[test]
fn pool_rejects_bad_jobs() {
    let mut rng = Rng(5);
    let random = RandomJob::new(&mut rng, WeightDType::F32, 8, 4, 2, 2);
    let mut work = random.work();
    let bad_tokens = [7u32];
    work[1].token_idx = &bad_tokens;
    work[1].token_weight = &[1.0];
    let job = ColdJob {
        level: SimdLevel::Scalar,
        activations: DecodeActivations::F32,
        act: Activation::Silu,
        hidden: 8,
        ff: 4,
        x: &random.x,
        experts: &work,
    };
    let mut pool = ColdPool::new(2);
    assert_eq!(
        pool.run(&job, &mut [0.0; 16]),
        Err(KernelError::TokenIndexOutOfBounds { index: 7, n_tokens: 2 })
    );
    assert!(pool.run(&job, &mut [0.0; 15]).is_err());
}

#[test]
fn empty_job_is_a_no_op() {
    let mut pool = ColdPool::new(3);
    let x = [1.0f32; 6];
    let job = ColdJob {
        level: SimdLevel::detect(),
        activations: DecodeActivations::F32,
        act: Activation::Silu,
        hidden: 3,
        ff: 2,
        x: &x,
        experts: &[],
    };
    let mut out = vec![2.0; 6];
    pool.run(&job, &mut out).unwrap();
    assert_eq!(out, vec![2.0; 6]);
}

/// Skewed routing (one expert takes every token, others one or two, one none) under the phased
/// schedule, whose phase 1 orders experts by tokens and sizes claims by cost: same bits for
/// every thread count and as the pipelined schedule, and close to the reference.
#[test]
fn phased_skewed_routing_is_exact_across_threads() {
    let mut rng = Rng(0x5CE3);
    let (hidden, ff, n_tokens, n_experts) = (72, 45, 23, 7);
    for dtype in [WeightDType::F32, WeightDType::BF16] {
        let mut random = RandomJob::new(&mut rng, dtype, hidden, ff, n_tokens, n_experts);
        for e in 1..n_experts {
            random.token_idx[e] = match e {
                3 => (0..n_tokens as u32).collect(),
                5 => (0..n_tokens as u32).rev().step_by(2).collect(),
                _ => vec![(e * 5 % n_tokens) as u32; 1 + e % 2],
            };
            random.token_weight[e] = rng.vec(random.token_idx[e].len(), 1.0);
        }
        let work = random.work();
        let initial = rng.vec(n_tokens * hidden, 1.0);
        let job = ColdJob {
            level: SimdLevel::Scalar,
            activations: DecodeActivations::F32,
            act: Activation::Silu,
            hidden,
            ff,
            x: &random.x,
            experts: &work,
        };
        let mut reference = initial.clone();
        ColdPool::run_reference(&job, &mut reference).unwrap();
        for level in available() {
            let mut results = Vec::new();
            for n_threads in [1, 2, 5, 16] {
                let mut pool = ColdPool::new(n_threads);
                for schedule in [ColdSchedule::Phased, ColdSchedule::Pipelined] {
                    pool.set_schedule(schedule);
                    let mut out = initial.clone();
                    pool.run(&ColdJob { level, ..job }, &mut out).unwrap();
                    results.push(out);
                }
            }
            for out in &results[1..] {
                assert!(
                    out.iter().zip(&results[0]).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{level} {dtype:?}: schedules or thread counts differ"
                );
            }
            let error = relative_error(&results[0], &reference);
            assert!(error <= tolerance(level, dtype), "{level} {dtype:?}: {error:e}");
        }
    }
}

/// 8-bit activations (a no-op on levels without VNNI) on quantised experts, gate/up and down
/// types mixed: one token (decode, every expert one token) and three (experts with one token and
/// with several) against the f32 oracle within the activation rounding, and the same bits
/// under both schedules and any thread count.
#[test]
fn pool_q8_activations_match_reference_within_the_rounding() {
    use WeightDType::*;
    let mut rng = Rng(0x0008_9001);
    let mixes = [(Q4_K, Q6_K), (Q5_K, Q8_0), (Q6_K, Q4_K), (Q8_0, Q4_0), (Q4_0, Q5_K)];
    let mut pools: Vec<ColdPool> = [1, 3].into_iter().map(ColdPool::new).collect();
    for (mix, n_tokens) in mixes.into_iter().zip([1, 3, 1, 3, 1]) {
        let random = RandomJob::quantized(&mut rng, mix, (512, 256), n_tokens, 5);
        let work = random.work();
        let job = ColdJob {
            level: SimdLevel::Scalar,
            activations: DecodeActivations::Q8,
            act: Activation::Silu,
            hidden: 512,
            ff: 256,
            x: &random.x,
            experts: &work,
        };
        let mut reference = vec![0.0; n_tokens * 512];
        ColdPool::run_reference(&job, &mut reference).unwrap();
        for level in available() {
            let mut first: Option<Vec<f32>> = None;
            let runs = pools
                .iter_mut()
                .flat_map(|p| [ColdSchedule::Phased, ColdSchedule::Pipelined].map(|s| (p.n_threads(), s)));
            for (threads, schedule) in runs.collect::<Vec<_>>() {
                let pool = &mut pools[usize::from(threads > 1)];
                pool.set_schedule(schedule);
                let mut out = vec![0.0; n_tokens * 512];
                pool.run(&ColdJob { level, ..job }, &mut out).unwrap();
                let error = relative_error(&out, &reference);
                assert!(error <= Q8_ACTIVATION_TOLERANCE, "{level} {mix:?} tokens={n_tokens}: {error:e}");
                let first = first.get_or_insert_with(|| out.clone());
                assert!(
                    first.iter().zip(&out).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{level} {mix:?} {schedule:?} threads={}",
                    pool.n_threads()
                );
            }
        }
    }
}

/// `random` (hidden 512, ff 256, SiLU) run on `pool` at `level` with `activations`; `None`:
/// the f32 oracle (`run_reference`).
fn run_512(
    pool: &mut ColdPool,
    random: &RandomJob,
    level: SimdLevel,
    activations: Option<DecodeActivations>,
) -> Vec<f32> {
    let work = random.work();
    let job = ColdJob {
        level,
        activations: activations.unwrap_or(DecodeActivations::F32),
        act: Activation::Silu,
        hidden: 512,
        ff: 256,
        x: &random.x,
        experts: &work,
    };
    let mut out = vec![0.0f32; random.x.len()];
    match activations {
        Some(_) => pool.run(&job, &mut out).unwrap(),
        None => ColdPool::run_reference(&job, &mut out).unwrap(),
    }
    out
}

/// An expert of up to `Q8_MAX_TOKENS` tokens takes the 8-bit tiles (its result moves off F32's
/// by the rounding, within the tolerance); one of more tokens takes them where the many-token
/// VNNI tiles take its gate/up's or down's type (Q4_K, Q6_K; Q5_K, Q8_0 and MXFP4 off AMX hosts;
/// Auto as Q8, so Q8_0 too) and keeps F32's bits exactly otherwise (Q4_0; the AMX tiles).
#[test]
fn experts_take_8_bits_where_their_tiles_do() {
    use WeightDType::*;
    let level = SimdLevel::detect();
    if !level.has_q8_dot() {
        eprintln!("skipped: no AVX-512 VNNI here");
        return;
    }
    let mut rng = Rng(0x0008_F3A7);
    let mut pool = ColdPool::new(2);
    let off_amx = level != SimdLevel::Amx;
    let many_token_tiles = |t| matches!(t, Q4_K | Q6_K) || (off_amx && matches!(t, Q5_K | Q8_0 | Mxfp4));
    let mixes = [(Q4_K, Q6_K), (Q6_K, Q6_K), (Q5_K, Q8_0), (Q8_0, Q8_0), (Mxfp4, Q4_0), (Q4_0, Q4_0)];
    for mix in mixes {
        for n_tokens in [2, Q8_MAX_TOKENS, Q8_MAX_TOKENS + 1, 19] {
            let mut random = RandomJob::quantized(&mut rng, mix, (512, 256), n_tokens, 2);
            random.token_idx[1] = (0..n_tokens as u32).collect(); // expert 1 takes every token
            random.token_weight[1] = rng.vec(n_tokens, 1.0);
            let mut run = |a| run_512(&mut pool, &random, level, a);
            let (q8, f32) = (run(Some(DecodeActivations::Q8)), run(Some(DecodeActivations::F32)));
            let error = relative_error(&q8, &run(None));
            assert!(error <= Q8_ACTIVATION_TOLERANCE, "{mix:?}, {n_tokens} tokens: {error:e}");
            if n_tokens <= Q8_MAX_TOKENS || many_token_tiles(mix.0) || many_token_tiles(mix.1) {
                assert!(q8 != f32, "{mix:?}, {n_tokens} tokens: 8-bit activations expected");
            } else {
                assert_eq!(q8, f32, "{mix:?}, {n_tokens} tokens: f32 expected");
            }
            if n_tokens > Q8_MAX_TOKENS {
                assert_eq!(run(Some(DecodeActivations::Auto)), q8, "{mix:?}, {n_tokens} tokens: Auto as Q8");
            }
        }
    }
}

/// `Auto` takes 8-bit activations for every quantised type but Q8_0, per matrix: all-Q8_0
/// experts give F32's bits, K-quant experts Q8's, and a Q8_0 gate/up with a Q4_K down (gate/up
/// f32, down 8-bit) stays within the rounding of the reference.
#[test]
fn auto_activations_take_8_bits_for_every_type_but_q8_0() {
    use WeightDType::*;
    let mut rng = Rng(0x0008_A070);
    let mut pool = ColdPool::new(2);
    let level = SimdLevel::detect();
    for mix in [(Q8_0, Q8_0), (Q4_K, Q6_K), (Q8_0, Q4_K)] {
        let random = RandomJob::quantized(&mut rng, mix, (512, 256), 1, 3);
        let mut run = |a| run_512(&mut pool, &random, level, a);
        let (auto, f32, q8) = (
            run(Some(DecodeActivations::Auto)),
            run(Some(DecodeActivations::F32)),
            run(Some(DecodeActivations::Q8)),
        );
        let error = relative_error(&auto, &run(None));
        assert!(error <= Q8_ACTIVATION_TOLERANCE, "{mix:?}: {error:e}");
        match mix {
            (Q8_0, Q8_0) => assert_eq!(auto, f32, "{mix:?}"),
            (Q4_K, Q6_K) => assert_eq!(auto, q8, "{mix:?}"),
            _ if level.has_q8_dot() => assert!(auto != f32 && auto != q8, "{mix:?}: down 8-bit only"),
            // AVX2's tiles take Q4_K, not Q8_0: Q8 and Auto both run the down alone 8-bit
            _ if level.has_q8_tiles() => assert!(auto != f32 && auto == q8, "{mix:?}: down 8-bit only"),
            _ => assert_eq!(auto, f32, "{mix:?}"),
        }
    }
    assert_eq!("auto".parse::<DecodeActivations>().unwrap(), DecodeActivations::Auto);
    assert!("q4".parse::<DecodeActivations>().is_err());
}
