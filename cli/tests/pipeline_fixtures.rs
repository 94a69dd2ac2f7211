//! The pipeline on the golden fixtures (transformers logits): every fixture, hot fractions
//! 0, 0.5 and 1, logits within 1e-3 of golden.json and identical greedy tokens — through the
//! library and through the real `moe-lanes` binary (the pipeline engine: CI has no GPU).

#[path = "../../tests/common/mod.rs"]
mod common;
use moe_lanes::hot_set::HotSet;
use moe_lanes::model::Model;
use moe_lanes::phase::Phase;
use moe_lanes::pipeline::{Pipeline, PipelineOptions};
use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

const FRACTIONS: [f64; 3] = [0.0, 0.5, 1.0];

fn dir(name: &str) -> PathBuf {
    common::repo_root().join("tests/fixtures").join(name)
}

struct Golden {
    prompt: Vec<u32>,
    logits: Vec<Vec<f32>>,
    greedy: Vec<u32>,
}

fn golden(name: &str) -> Golden {
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(dir(name).join("golden.json")).unwrap()).unwrap();
    let ids =
        |key: &str| v[key].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect::<Vec<_>>();
    Golden {
        prompt: ids("prompt"),
        greedy: ids("greedy_new_tokens"),
        logits: v["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|row| row.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect())
            .collect(),
    }
}

fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs())).fold(0.0, f32::max)
}

#[test]
fn library_pipeline_matches_golden_for_every_fixture_and_fraction() {
    for name in &common::fixture_names() {
        let g = golden(name);
        let model = Arc::new(Model::open(&dir(name)).unwrap());
        let c = model.config().clone();
        // Dense FFN layers (DeepSeek-V3's first) hold no experts, hot or cold.
        let has_experts = model.plan().expert_layers();
        for f in FRACTIONS {
            for n_lanes in [1, 3] {
                let n_hot = ((f * c.n_experts as f64) - 1e-9).ceil().max(0.0) as usize;
                let lists: Vec<Vec<usize>> = has_experts
                    .iter()
                    .map(|&has| if has { (0..n_hot).collect() } else { Vec::new() })
                    .collect();
                let hot = HotSet::from_lists(c.n_layers, c.n_experts, n_lanes, &lists);
                let opts = PipelineOptions { hot_set: Some(hot), n_cold_workers: 2, ..Default::default() };
                let mut p = Pipeline::new(model.clone(), opts).unwrap();
                let logits = p.forward(&mut p.new_cache(), &g.prompt, Phase::Prefill).unwrap();
                let diff = max_abs_diff(&logits, &g.logits);
                assert!(diff <= 1e-3, "{name} F={f} lanes={n_lanes}: max |diff| {diff}");
                let tokens = p.generate(&g.prompt, g.greedy.len()).unwrap();
                assert_eq!(tokens, g.greedy, "{name} F={f} lanes={n_lanes}");
            }
        }
    }
}

fn run(args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_moe-lanes")).args(args).output().unwrap();
    assert!(out.status.success(), "moe-lanes {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn binary_logits_and_generate_agree_with_golden_with_the_default_engine() {
    let tmp = tempfile::tempdir().unwrap();
    for name in &common::fixture_names() {
        let g = golden(name);
        let model = dir(name);
        let model = model.to_str().unwrap();
        let prompt = g.prompt.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        let n_new = g.greedy.len().to_string();
        for f in ["0", "0.5", "1"] {
            let perf = tmp.path().join(format!("{name}-{f}.json"));
            let perf = perf.to_str().unwrap();
            let v = run(&[
                "logits",
                "--model",
                model,
                "--tokens",
                &prompt,
                "--hot-fraction",
                f,
                "--perf-json",
                perf,
            ]);
            let logits: Vec<Vec<f32>> = serde_json::from_value(v["logits"].clone()).unwrap();
            let diff = max_abs_diff(&logits, &g.logits);
            assert!(diff <= 1e-3, "{name} F={f}: max |diff| {diff}");
            let report: Value = serde_json::from_str(&std::fs::read_to_string(perf).unwrap()).unwrap();
            // The first layer with experts (DeepSeek-V3's first layer is dense).
            let first_moe =
                Model::open(&dir(name)).unwrap().plan().expert_layers().iter().position(|&h| h).unwrap();
            let hits = report["layers"][first_moe]["expert_hits_total"].as_u64().unwrap();
            assert_eq!(hits as usize, g.prompt.len() * report["n_expert_used"].as_u64().unwrap() as usize);
            let v = run(&[
                "generate",
                "--model",
                model,
                "--tokens",
                &prompt,
                "--max-new-tokens",
                &n_new,
                "--hot-fraction",
                f,
            ]);
            let tokens: Vec<u32> = serde_json::from_value(v["tokens"].clone()).unwrap();
            assert_eq!(tokens, g.greedy, "{name} F={f}");
        }
    }
}

#[test]
fn binary_learn_then_hot_fraction_from_the_learn_file() {
    let tmp = tempfile::tempdir().unwrap();
    let g = golden("qwen3_moe_a");
    let model = dir("qwen3_moe_a");
    let model = model.to_str().unwrap();
    let learn = tmp.path().join("learn.json");
    let out = Command::new(env!("CARGO_BIN_EXE_moe-lanes"))
        .args(["learn", "--model", model, "--n-tokens", "64", "--out", learn.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&learn).unwrap()).unwrap();
    assert_eq!(
        report["layers"][0]["cold_slots_total"].as_u64().unwrap(),
        64 * 3,
        "learn runs with the cache off"
    );
    let prompt = g.prompt.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let v = run(&[
        "logits",
        "--model",
        model,
        "--tokens",
        &prompt,
        "--hot-fraction",
        "0.5",
        "--learn",
        learn.to_str().unwrap(),
    ]);
    let logits: Vec<Vec<f32>> = serde_json::from_value(v["logits"].clone()).unwrap();
    assert!(max_abs_diff(&logits, &g.logits) <= 1e-3);
    // An explicit hot set over two hot lanes.
    let hot = tmp.path().join("hot.json");
    std::fs::write(&hot, r#"{"layers": {"0": [0, 3, 5], "1": [7, 1]}}"#).unwrap();
    let v = run(&[
        "logits",
        "--model",
        model,
        "--tokens",
        &prompt,
        "--hot-experts",
        hot.to_str().unwrap(),
        "--hot-lanes",
        "2",
    ]);
    let logits: Vec<Vec<f32>> = serde_json::from_value(v["logits"].clone()).unwrap();
    assert!(max_abs_diff(&logits, &g.logits) <= 1e-3);
    // The plain cold kernels.
    let v = run(&[
        "logits",
        "--model",
        model,
        "--tokens",
        &prompt,
        "--hot-fraction",
        "0.5",
        "--cold-kernels",
        "plain",
    ]);
    let logits: Vec<Vec<f32>> = serde_json::from_value(v["logits"].clone()).unwrap();
    assert!(max_abs_diff(&logits, &g.logits) <= 1e-3);
    // The reference engine is still there.
    let v = run(&["logits", "--model", model, "--tokens", &prompt, "--engine", "reference"]);
    let logits: Vec<Vec<f32>> = serde_json::from_value(v["logits"].clone()).unwrap();
    assert!(max_abs_diff(&logits, &g.logits) <= 1e-3);
    // A malformed learn file is a clear error naming the file and the field.
    std::fs::write(&learn, r#"{"layers": [{"layer": 0, "experts": "many"}]}"#).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_moe-lanes"))
        .args([
            "logits",
            "--model",
            model,
            "--tokens",
            "1,2",
            "--hot-fraction",
            "0.5",
            "--learn",
            learn.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("learn.json") && err.contains("layers[0].experts"), "{err}");
}
