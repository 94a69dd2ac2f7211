//! The real `moe-lanes` binary end to end: synth -> inspect -> logits -> generate, and clear
//! errors (non-zero exit, message naming the file) for bad input.

#[path = "../../tests/common/mod.rs"]
mod common;

mod bin;

use bin::{failure, moe_lanes, ok_stdout, p};

#[test]
fn synth_inspect_logits_generate_end_to_end_in_both_formats() {
    let dir = tempfile::tempdir().unwrap();
    for (format, name) in [("gguf", "m.gguf"), ("safetensors", "m-st")] {
        let out = dir.path().join(name);
        ok_stdout(&["synth", "--arch", "olmoe", "--format", format, "--out", p(&out), "--seed", "9"]);
        let report: serde_json::Value =
            serde_json::from_str(&ok_stdout(&["inspect", p(&out), "--json"])).unwrap();
        assert_eq!(report["arch"], "olmoe");
        assert_eq!(report["n_layers"], 2);
        assert_eq!(report["n_experts"], 8);
        assert_eq!(report["expert_bytes"], 3 * 32 * 64 * 2);
        assert_eq!(report["all_experts_bytes"], 2 * 8 * 3 * 32 * 64 * 2);
        let total = report["total_bytes"].as_u64().unwrap();
        assert_eq!(
            total,
            report["all_experts_bytes"].as_u64().unwrap() + report["other_bytes"].as_u64().unwrap()
        );
        let logits: serde_json::Value =
            serde_json::from_str(&ok_stdout(&["logits", "--model", p(&out), "--tokens", "5,17,200"]))
                .unwrap();
        assert_eq!(logits["tokens"], serde_json::json!([5, 17, 200]));
        let rows = logits["logits"].as_array().unwrap();
        assert_eq!(rows.len(), 3);
        assert!(rows.iter().all(|r| r.as_array().unwrap().len() == 512));
        let generated: serde_json::Value = serde_json::from_str(&ok_stdout(&[
            "generate",
            "--model",
            p(&out),
            "--tokens",
            "5,17,200",
            "--max-new-tokens",
            "4",
        ]))
        .unwrap();
        assert_eq!(generated["tokens"].as_array().unwrap().len(), 4);
    }
}

#[test]
fn inspect_text_names_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("q.gguf");
    ok_stdout(&["synth", "--arch", "qwen2_moe", "--out", p(&out)]);
    let text = ok_stdout(&["inspect", p(&out), "--coverage-tokens", "64"]);
    for needle in
        ["qwen2_moe", "shared expert ff", "one expert", "all experts", "everything else", "routing coverage"]
    {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
}

#[test]
fn bad_inputs_fail_with_messages_naming_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.gguf");
    assert!(failure(&["inspect", p(&missing)]).contains("nope.gguf"));

    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"NOTAGGUFFILE....").unwrap();
    let err = failure(&["inspect", p(&junk)]);
    assert!(err.contains("junk.gguf") && err.to_lowercase().contains("magic"), "{err}");

    let model = dir.path().join("m.gguf");
    ok_stdout(&["synth", "--out", p(&model)]);
    let err = failure(&["logits", "--model", p(&model), "--tokens", "1,99999"]);
    assert!(err.contains("99999") && err.contains("vocabulary"), "{err}");

    let err = failure(&["synth", "--arch", "llama4", "--out", p(&dir.path().join("x.gguf"))]);
    assert!(err.contains("llama4") && err.contains("qwen3_moe"), "{err}");
    let err = failure(&["synth", "--skew", "zipf:abc", "--out", p(&dir.path().join("x.gguf"))]);
    assert!(err.contains("zipf:abc"), "{err}");
    let err = failure(&["synth", "--out", "/nonexistent-dir/x.gguf"]);
    assert!(err.contains("/nonexistent-dir"), "{err}");
}

#[test]
fn gpu_engine_generates_golden_tokens_or_falls_back_and_says_so() {
    for dir in common::fixture_dirs() {
        let golden: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
        let prompt: Vec<String> =
            golden["prompt"].as_array().unwrap().iter().map(|t| t.to_string()).collect();
        let n_new = golden["greedy_new_tokens"].as_array().unwrap().len().to_string();
        let out = moe_lanes(&[
            "generate",
            "--model",
            p(&dir),
            "--tokens",
            &prompt.join(","),
            "--max-new-tokens",
            &n_new,
            "--engine",
            "gpu",
            "--hot-fraction",
            "0.5",
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stderr = String::from_utf8_lossy(&out.stderr);
        let fell_back = stderr.contains("falling back to the CPU pipeline engine");
        if std::env::var_os("MOE_LANES_REQUIRE_GPU").is_some() {
            assert!(!fell_back, "a GPU is required here: {stderr}");
        } else if fell_back {
            assert!(stderr.contains("GPU engine unavailable"), "the fallback must say why: {stderr}");
        }
        let tokens: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(tokens["tokens"], golden["greedy_new_tokens"], "{}", dir.display());
    }
}

#[test]
fn demo_creates_the_default_model_on_first_use_and_matches_the_reference() {
    let home = tempfile::tempdir().unwrap();
    for run in 0..2 {
        let out = bin::command()
            .args(["demo", "--max-new-tokens", "6"])
            .env("MOE_LANES_HOME", home.path())
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stdout.contains("matches the reference forward pass: yes"), "{stdout}");
        assert_eq!(stderr.contains("first use"), run == 0, "the model is written once: {stderr}");
    }
    assert!(home.path().join("default-qwen3moe-small.gguf").exists());
}

/// `bench --json` runs on whatever engine is usable (the CPU pipeline without a GPU) and reports
/// the same keys; `fallbacks` counts real fallbacks (an injected corrupted worklist on the
/// pipeline cannot be injected from the CLI, so a clean run must report zero and a learn file
/// must drive the plan).
#[test]
fn bench_json_runs_without_a_gpu_with_the_same_keys() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("b.gguf");
    ok_stdout(&["synth", "--out", p(&model)]);
    let learn = dir.path().join("learn.json");
    ok_stdout(&[
        "learn",
        "--model",
        p(&model),
        "--n-tokens",
        "32",
        "--out",
        p(&learn),
        "--engine",
        "pipeline",
    ]);
    let args = [
        "bench",
        "--model",
        p(&model),
        "-p",
        "8",
        "-n",
        "4",
        "--runs",
        "1",
        "--json",
        "--engine",
        "pipeline",
    ];
    let mut args = args.to_vec();
    args.extend(["--learn", p(&learn), "--hot-budget-mib", "1"]);
    let v: serde_json::Value = serde_json::from_str(&ok_stdout(&args)).unwrap();
    for key in [
        "device",
        "engine",
        "pp_tokens_per_s",
        "tg_tokens_per_s",
        "hit_rate",
        "overlap_us",
        "join_wait_us",
        "fallbacks",
        "hot_bytes",
        "planned_hit_rate",
    ] {
        assert!(v.get(key).is_some(), "bench --json lacks {key}: {v}");
    }
    assert_eq!(v["device"], "cpu");
    assert_eq!(v["engine"], "pipeline");
    assert_eq!(v["fallbacks"], 0);
    assert_eq!(v["learn_source"], "learn file");
    assert_eq!(v["tg_feed"], "random", "random token ids by default, as llama-bench");
    let mut greedy = args.clone();
    greedy.push("--greedy");
    let g: serde_json::Value = serde_json::from_str(&ok_stdout(&greedy)).unwrap();
    assert_eq!(g["tg_feed"], "greedy");
    assert!(v["tg_tokens_per_s"].as_f64().unwrap() > 0.0);
    let bad = failure(&["generate", "--model", p(&model), "--tokens", "1", "--engine", "warp"]);
    assert!(bad.contains("unknown engine 'warp'"), "{bad}");
}

/// `plan` refuses a learn file recorded on another model, naming the field that differs;
/// `generate --update auto` and every weighting run end to end; `bench --scenario shift --json`
/// prints the per-request rows.
#[test]
fn live_cache_commands_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.gguf");
    let b = dir.path().join("b.gguf");
    ok_stdout(&["synth", "--arch", "qwen3_moe", "--out", p(&a), "--skew", "domains:2", "--experts", "16"]);
    ok_stdout(&["synth", "--arch", "qwen3_moe", "--out", p(&b), "--expert-ff", "48"]);
    let learn = dir.path().join("learn.json");
    ok_stdout(&["learn", "--model", p(&b), "--out", p(&learn), "--engine", "pipeline", "--n-tokens", "32"]);
    let err = failure(&["plan", "--model", p(&a), "--learn", p(&learn), "--hot-budget-mib", "1"]);
    assert!(
        err.contains("learn.json") && err.contains("another model") && err.contains("n_experts"),
        "{err}"
    );
    ok_stdout(&["learn", "--model", p(&a), "--out", p(&learn), "--engine", "pipeline", "--n-tokens", "32"]);
    let bad_weighting =
        ["plan", "--model", p(&a), "--learn", p(&learn), "--hot-budget-mib", "1", "--weighting", "hot"];
    let err = failure(&bad_weighting);
    assert!(err.contains("--weighting") && err.contains("smooth_pressure"), "{err}");
    let want = ok_stdout(&[
        "generate",
        "--model",
        p(&a),
        "--tokens",
        "1,2,3",
        "--max-new-tokens",
        "24",
        "--engine",
        "reference",
    ]);
    let perf = dir.path().join("perf.json");
    for w in ["flat", "pressure", "smooth_pressure", "time", "balanced"] {
        let got = ok_stdout(&[
            "generate",
            "--model",
            p(&a),
            "--tokens",
            "1,2,3",
            "--max-new-tokens",
            "24",
            "--engine",
            "pipeline",
            "--hot-fraction",
            "0.5",
            "--learn",
            p(&learn),
            "--weighting",
            w,
            "--update",
            "auto",
            "--update-rate",
            "0.5",
            "--update-every-tokens",
            "8",
            "--perf-json",
            p(&perf),
        ]);
        assert_eq!(got, want, "weighting {w}: output equals the reference");
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&perf).unwrap()).unwrap();
        assert!(
            report["cache_updates"]["auto_updates"].as_u64().unwrap() >= 1,
            "{w}: {}",
            report["cache_updates"]
        );
        assert_eq!(report["model"]["n_experts"], 16);
    }
    let err = failure(&["generate", "--model", p(&a), "--tokens", "1", "--update-rate", "2"]);
    assert!(err.contains("--update-rate") && err.contains("0..=1"), "{err}");
    let out = ok_stdout(&[
        "bench",
        "--model",
        p(&a),
        "--engine",
        "pipeline",
        "--hot-fraction",
        "0.5",
        "--scenario",
        "shift",
        "--requests",
        "2",
        "-p",
        "8",
        "-n",
        "16",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v["requests"].as_array().unwrap();
    assert_eq!(rows.len(), 12);
    let policies: Vec<&str> = rows.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(policies.iter().filter(|&&p| p == "online").count(), 4);
    assert!(rows
        .iter()
        .all(|r| r["tg_tokens_per_s"].as_f64().unwrap() > 0.0 && r.get("exchanges").is_some()));
    let err = failure(&[
        "bench",
        "--model",
        p(&b),
        "--engine",
        "pipeline",
        "--hot-fraction",
        "0.5",
        "--scenario",
        "drift",
    ]);
    assert!(err.contains("--scenario drift"), "{err}");
}
