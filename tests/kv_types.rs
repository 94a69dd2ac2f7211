//! KV cache types on the CPU pipeline (`PipelineOptions::kv_type`, `--cache-type-k/v`): every
//! type against the f32 reference oracle over the transformers fixtures (prefill, a second chunk
//! on the same session, decode steps), greedy tokens at f16 equal to transformers', a long
//! context at f16 with greedy tokens equal to the oracle's, the cache's bytes as the memory
//! accounting counts them, and the refusals (q8_0 heads that split blocks, the oracle asked for
//! another type).
//!
//! Bounds on logits, `max |ours - ref| / max |ref|` of a row, held by the 90th-percentile row
//! ([`row_errors`]; measured on these fixtures, worst fixture): f32 1e-4 (summation order only;
//! 8e-6), f16 2e-3 (issue 44's bound; 1.6e-3 on gpt_oss_a, worst row 2.6e-3), bf16 2e-2 (8
//! significant bits, 8x f16's step; 1.6e-2 on gpt_oss_a, 3e-3 on the others), q8_0 2e-2 (1.2e-2:
//! each key and value carries up to half a step of max|x| / 127 of its 32-value block). Issue
//! 44's 2e-3 holds for f16; bf16 cannot meet it on logits (its own step is 2^-9 = 2e-3). The attention outputs themselves, against the f32
//! cache's, are bounded per type in kernels/tests/dense.rs.

mod common;
#[path = "fixture_checks/mod.rs"]
mod fixture_checks;

use common::{fixtures_root, max_rel_err};
use moe_lanes::engine::{build_engine, EngineError, EngineKind, EngineOptions};
use moe_lanes::model::context::{kv_bytes_per_position_of, KvType};
use moe_lanes::model::Model;
use moe_lanes::phase::Phase;
use moe_lanes::pipeline::{Pipeline, PipelineError, PipelineOptions};
use moe_lanes::reference::{NoObserver, Reference};
use std::sync::Arc;

/// The bound on logits of a cache of `t` against the f32 oracle.
fn bound(t: KvType) -> f32 {
    match t {
        KvType::F32 => 1e-4,
        KvType::F16 => 2e-3,
        KvType::Bf16 | KvType::Q8_0 => 2e-2,
    }
}

/// Fixtures with attention heads (or latents) of every kind the pipeline runs: GQA with q/k norms
/// (qwen3_moe), sliding windows and sinks (gpt_oss), latent attention (deepseek_v3), a hybrid
/// with its full-attention layers (qwen3_next, heads of 32: q8_0 too), heads of 32 (qwen2_moe_b).
const FIXTURES: [&str; 7] =
    ["qwen3_moe_a", "gpt_oss_a", "deepseek_v3_a", "qwen3_next_a", "qwen2_moe_b", "glm4_moe_a", "mixtral_a"];

/// A fixture's prompt, its optional second chunk and transformers' greedy tokens (every
/// golden.json holds these; the older ones have no second chunk).
#[derive(serde::Deserialize)]
struct Golden {
    prompt: Vec<u32>,
    #[serde(default)]
    second_chunk: Vec<u32>,
    greedy_new_tokens: Vec<u32>,
}

fn open(name: &str) -> (Arc<Model>, Golden) {
    let dir = fixtures_root().join(name);
    let golden = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    (Arc::new(Model::open(&dir).unwrap()), golden)
}

fn pipeline(model: &Arc<Model>, kv_type: KvType) -> Result<Pipeline, PipelineError> {
    let opts = PipelineOptions {
        hot_set: Some(fixture_checks::hot_set(model, 0.5)),
        n_cold_workers: 2,
        n_dense_threads: 2,
        kv_type,
        ..Default::default()
    };
    Pipeline::new(model.clone(), opts)
}

/// Whether a model's cached rows are whole blocks of `t` (q8_0 needs heads of a multiple of 32).
fn fits(model: &Model, t: KvType) -> bool {
    let c = model.config();
    let width = c.mla.as_ref().map_or(c.head_dim, |m| m.kv_lora_rank + m.qk_rope_head_dim);
    width.is_multiple_of(t.block_len())
}

#[test]
fn every_kv_type_matches_the_f32_oracle() {
    for name in FIXTURES {
        let (model, g) = open(name);
        let oracle = Reference::new(&model).unwrap();
        let mut rc = oracle.new_cache();
        let mut want = oracle.forward(&mut rc, &g.prompt, &mut NoObserver).unwrap();
        if !g.second_chunk.is_empty() {
            want.extend(oracle.forward(&mut rc, &g.second_chunk, &mut NoObserver).unwrap());
        }
        let steps = &g.greedy_new_tokens[..g.greedy_new_tokens.len().min(4)];
        for &t in steps {
            want.extend(oracle.forward(&mut rc, &[t], &mut NoObserver).unwrap());
        }
        for kv_type in KvType::ALL {
            let Ok(mut p) = pipeline(&model, kv_type) else {
                assert!(!fits(&model, kv_type), "{name} {kv_type}: refused though its heads fit");
                continue;
            };
            let mut cache = p.new_cache();
            let mut got = p.forward(&mut cache, &g.prompt, Phase::Prefill).unwrap();
            if !g.second_chunk.is_empty() {
                got.extend(p.forward(&mut cache, &g.second_chunk, Phase::Prefill).unwrap());
            }
            for &t in steps {
                got.extend(p.forward(&mut cache, &[t], Phase::Decode).unwrap());
            }
            let (typical, worst) = row_errors(&got, &want);
            println!("{name} {kv_type}: 90th percentile row {typical:.2e}, worst row {worst:.2e} against the f32 oracle");
            assert!(typical < bound(kv_type), "{name} {kv_type}: {typical}");
            assert!(worst < 1.0, "{name} {kv_type}: a row off by {worst}");
            assert_eq!(cache.kv_type(), kv_type);
        }
    }
}

/// At f16 (llama.cpp's default cache type) the pipeline's greedy continuation is still
/// transformers' on every fixture.
#[test]
fn f16_greedy_tokens_are_transformers() {
    for name in FIXTURES {
        let (model, g) = open(name);
        let got =
            pipeline(&model, KvType::F16).unwrap().generate(&g.prompt, g.greedy_new_tokens.len()).unwrap();
        assert_eq!(got, g.greedy_new_tokens, "{name} f16");
    }
}

/// At depth: a prompt filling most of the fixture's trained context (256), then greedy decode
/// with an f16 cache against the f32 oracle: every token equal where the oracle's top-1 / top-2
/// gap exceeds twice the f16 bound (the engines' greedy rule of tests/gpu_parity.rs), and the
/// logits of the whole session within the bound.
#[test]
fn f16_greedy_at_depth_matches_the_oracle() {
    for name in ["qwen3_moe_a", "qwen3_next_a"] {
        let (model, _) = open(name);
        let c = model.config().clone();
        let n = c.max_positions - 24;
        let prompt: Vec<u32> = (0..n).map(|i| ((i * 13 + 5) % c.vocab) as u32).collect();
        let oracle = Reference::new(&model).unwrap();
        let mut p = pipeline(&model, KvType::F16).unwrap();
        let (mut rc, mut pc) = (oracle.new_cache(), p.new_cache());
        let mut want = oracle.forward(&mut rc, &prompt, &mut NoObserver).unwrap();
        let mut got = p.forward(&mut pc, &prompt, Phase::Prefill).unwrap();
        for step in 0..16 {
            let (w, o) = (want.last().unwrap().clone(), got.last().unwrap().clone());
            let (wt, ot) = (argmax(&w), argmax(&o));
            let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
            let mut sorted = w.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            if sorted[0] - sorted[1] > 2.0 * bound(KvType::F16) * scale {
                assert_eq!(ot, wt, "{name}: greedy token {step} at depth {}", n + step);
            }
            want.extend(oracle.forward(&mut rc, &[wt as u32], &mut NoObserver).unwrap());
            got.extend(p.forward(&mut pc, &[wt as u32], Phase::Decode).unwrap());
        }
        let err = max_rel_err(&got, &want);
        println!("{name} f16 at depth {n}: {err:.2e}");
        assert!(err < bound(KvType::F16), "{name}: {err}");
    }
}

/// The 90th-percentile and the worst row of `max |ours - ref| / max |ref|`. The percentile is
/// what the bound holds for: on these tiny random MoE fixtures a rounding of the cache can tip a
/// near-tied top-k routing choice, which changes that row (and its session's later rows) by far
/// more than the rounding (seen: 1 to 3 rows in 30 at bf16, up to 0.6 relative; none at f16
/// past 2.6e-3); the worst row is printed and checked to be no garbage.
fn row_errors(got: &[Vec<f32>], want: &[Vec<f32>]) -> (f32, f32) {
    let mut rows: Vec<f32> = got
        .iter()
        .zip(want)
        .map(|(a, b)| max_rel_err(std::slice::from_ref(a), std::slice::from_ref(b)))
        .collect();
    rows.sort_by(f32::total_cmp);
    (rows[(rows.len() - 1) * 9 / 10], *rows.last().unwrap())
}

fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().fold(0, |best, (i, v)| if *v > row[best] { i } else { best })
}

/// The cache holds what the memory accounting counts: `kv_bytes_per_position_of` per position,
/// f16 and bf16 half of f32, q8_0 34 bytes per 32 values.
#[test]
fn the_cache_holds_the_bytes_the_accounting_counts() {
    for name in ["qwen3_next_a", "deepseek_v3_a"] {
        let (model, g) = open(name);
        for kv_type in KvType::ALL.into_iter().filter(|t| fits(&model, *t)) {
            let mut p = pipeline(&model, kv_type).unwrap();
            let mut cache = p.new_cache();
            p.forward(&mut cache, &g.prompt, Phase::Prefill).unwrap();
            let per = kv_bytes_per_position_of(model.config(), kv_type);
            assert_eq!(cache.kv_bytes() as u64, per * g.prompt.len() as u64, "{name} {kv_type}");
        }
    }
}

/// A q8_0 cache needs rows of whole 32-value blocks: a model whose heads (or latents) are not is
/// refused when the engine is built, by name; the oracle takes f32 only.
#[test]
fn kv_types_are_refused_where_they_cannot_run() {
    let (model, _) = open("gpt_oss_a"); // heads of 16
    let err = pipeline(&model, KvType::Q8_0).err().expect("q8_0 refused");
    assert!(matches!(err, PipelineError::KvBlocks { block: 32, width: 16, .. }), "{err}");
    assert!(err.to_string().contains("q8_0") && err.to_string().contains("choose another type"), "{err}");
    let (model, _) = open("deepseek_v3_a"); // latents of 32 + 8
    let err = pipeline(&model, KvType::Q8_0).err().expect("q8_0 refused");
    assert!(matches!(err, PipelineError::KvBlocks { width: 40, .. }), "{err}");
    let options = |kind, kv_type| {
        let mut o = EngineOptions::new(32);
        o.kind = Some(kind);
        o.kv_type = Some(kv_type);
        o.cold_threads = moe_lanes::threads::ColdThreads::Fixed(2);
        o
    };
    let err = build_engine(&model, options(EngineKind::Pipeline, KvType::Q8_0)).err().expect("refused");
    assert!(err.to_string().contains("blocks of 32"), "{err}");
    let (engine, _) = build_engine(&model, options(EngineKind::Pipeline, KvType::Bf16)).unwrap();
    assert_eq!(engine.kind(), EngineKind::Pipeline);
    let err = build_engine(&model, options(EngineKind::Reference, KvType::F16)).err().expect("refused");
    assert!(
        matches!(err, EngineError::KvType { engine: EngineKind::Reference, asked: KvType::F16 }),
        "{err}"
    );
}
