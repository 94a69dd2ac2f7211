//! The real `moe-lanes` binary end to end: synth -> inspect -> logits -> generate, and clear
//! errors (non-zero exit, message naming the file) for bad input.

#[path = "../../tests/common/mod.rs"]
mod common;

mod bin;

use bin::{failure, failure_of, moe_lanes, ok_stdout, p};

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

/// `--cache-type-k/v`: an unknown name refused with the supported types, different key and value
/// types refused, every type on the CPU pipeline (q8_0 refused by name where the tiny model's
/// heads of 16 split its 32-value blocks), the reference engine f32 only.
#[test]
fn kv_cache_type_flags_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    ok_stdout(&["synth", "--out", p(&model)]);
    let base = ["logits", "--model", p(&model), "--tokens", "1,2", "--engine", "pipeline"];
    let with =
        |extra: &[&'static str]| base.iter().copied().chain(extra.iter().copied()).collect::<Vec<&str>>();
    let fail = |extra: &[&'static str]| failure(&with(extra));
    let err = fail(&["--cache-type-k", "q4_0"]);
    assert!(err.contains("--cache-type-k q4_0") && err.contains("f32, f16, bf16 and q8_0"), "{err}");
    let err = fail(&["--cache-type-k", "f16", "--cache-type-v", "f32"]);
    assert!(err.contains("share one type"), "{err}");
    let err = fail(&["--cache-type-v", "q8_0"]);
    assert!(err.contains("q8_0 stores blocks of 32 values") && err.contains("16 wide"), "{err}");
    ok_stdout(&with(&["--cache-type-k", "f32", "--cache-type-v", "f32"]));
    ok_stdout(&with(&["--cache-type-k", "f16", "--cache-type-v", "f16"]));
    ok_stdout(&with(&["--cache-type-k", "bf16"]));
    let reference =
        ["logits", "--model", p(&model), "--tokens", "1,2", "--engine", "reference", "--cache-type-k", "f16"];
    let err = failure(&reference);
    assert!(err.contains("reference engine keeps its KV cache in f32"), "{err}");
}

/// `--devices` and `--tensor-split`: values that are not device numbers or positive shares, and
/// a share count that is not the device count, refused by name before any engine runs (the
/// pipeline runs no GPU and ignores good ones); on a GPU, `bench --json` with the layers split
/// over devices 0,0 (two streams on one GPU) reports each device's layers and cache.
#[test]
fn device_flags_are_checked_and_bench_reports_each_device() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    ok_stdout(&["synth", "--out", p(&model)]);
    let base = ["logits", "--model", p(&model), "--tokens", "1,2", "--engine", "pipeline"];
    let with =
        |extra: &[&'static str]| base.iter().copied().chain(extra.iter().copied()).collect::<Vec<&str>>();
    let err = failure(&with(&["--devices", "0,x"]));
    assert!(err.contains("--devices 0,x") && err.contains("CUDA device numbers"), "{err}");
    let err = failure(&with(&["--tensor-split", "3,-1"]));
    assert!(err.contains("--tensor-split 3,-1") && err.contains("positive numbers"), "{err}");
    let err = failure(&with(&["--devices", "0,0", "--tensor-split", "1"]));
    assert!(err.contains("1 shares for 2 devices"), "{err}");
    ok_stdout(&with(&["--devices", "0,0", "--tensor-split", "3,1"]));
    if !common::gpu_usable() {
        return;
    }
    let args = ["bench", "--model", p(&model), "-p", "8", "-n", "4", "--runs", "1", "--engine", "gpu"];
    let split = ["--devices", "0,0", "--hot-fraction", "0.5", "--json"];
    let report: serde_json::Value = serde_json::from_str(&ok_stdout(&[&args[..], &split].concat())).unwrap();
    let devices = report["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 2, "{report}");
    assert_eq!(devices[0]["layers"][0], 0, "{report}");
    assert_eq!(devices[0]["layers"][1], devices[1]["layers"][0], "{report}");
    let cached: u64 = devices.iter().map(|d| d["experts_cached"].as_u64().unwrap()).sum();
    assert_eq!(cached, report["hot_experts"].as_u64().unwrap(), "{report}");
    assert!(devices.iter().all(|d| d["ordinal"] == 0 && d["dense_mib"].as_f64().unwrap() > 0.0), "{report}");
}

#[test]
fn gpu_engine_generates_golden_tokens_or_refuses_and_the_default_falls_back() {
    for dir in common::fixture_dirs() {
        let golden: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
        let prompt: Vec<String> =
            golden["prompt"].as_array().unwrap().iter().map(|t| t.to_string()).collect();
        let n_new = golden["greedy_new_tokens"].as_array().unwrap().len().to_string();
        let prompt = prompt.join(",");
        let args = ["generate", "--model", p(&dir), "--tokens", &prompt, "--max-new-tokens", &n_new];
        let gen = |engine: &[&str]| moe_lanes(&[&args[..], engine, &["--hot-fraction", "0.5"]].concat());
        let mut out = gen(&["--engine", "gpu"]);
        if !out.status.success() {
            // An explicit --engine gpu without a usable GPU is an error that says why; the
            // default (no --engine) falls back to the pipeline, saying why.
            let stderr = String::from_utf8_lossy(&out.stderr).to_string();
            assert!(std::env::var_os("MOE_LANES_REQUIRE_GPU").is_none(), "a GPU is required here: {stderr}");
            assert!(stderr.contains("--engine gpu") && stderr.contains("cannot run"), "{stderr}");
            out = gen(&[]);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success() && stderr.contains("GPU engine unavailable"), "{stderr}");
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

/// `bench --parallel` measures batched throughput per batch size (llama-batched-bench's
/// figures) and the decode steps' lanes; a batch size of 0 is refused.
#[test]
fn bench_parallel_reports_every_batch_size() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("b.gguf");
    ok_stdout(&["synth", "--out", p(&model)]);
    let args = ["bench", "--model", p(&model), "-p", "8", "-n", "4", "--runs", "1", "--engine", "pipeline"];
    let mut json = args.to_vec();
    json.extend(["--parallel", "1,3", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&ok_stdout(&json)).unwrap();
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.iter().map(|r| r["parallel"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 3]);
    for r in rows {
        for key in ["pp_tokens_per_s", "tg_tokens_per_s", "total_tokens_per_s", "step_ms_p50", "step_ms_p99"]
        {
            assert!(r[key].as_f64().unwrap() > 0.0, "{key}: {r}");
        }
        // the decode steps' lanes: the cold lane ran; the pipeline has no ping-pong
        assert!(r["cold_ms_per_step"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["overlap_ms_per_step"].as_f64().unwrap() >= 0.0, "{r}");
        assert_eq!(r["ping_pong_steps"].as_u64(), Some(0), "{r}");
    }
    let mut table = args.to_vec();
    table.extend(["--parallel", "2"]);
    let text = ok_stdout(&table);
    assert!(text.contains("S_TG t/s") && text.contains("ping-pong steps"), "{text}");
    let mut zero = args.to_vec();
    zero.extend(["--parallel", "0"]);
    let err = failure_of(moe_lanes(&zero), "bench --parallel 0");
    assert!(err.contains("batch sizes must be at least 1"), "{err}");
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
    // tg from position 0 by default (llama-bench's tg test); -d prefills that many positions
    assert_eq!(v["depth"], 0);
    let mut deep = args.clone();
    deep.extend(["-d", "16"]);
    let d: serde_json::Value = serde_json::from_str(&ok_stdout(&deep)).unwrap();
    assert_eq!(d["depth"], 16);
    assert!(d["tg_tokens_per_s"].as_f64().unwrap() > 0.0, "{d}");
    let last = deep.len() - 1;
    deep[last] = "1000000";
    assert!(failure(&deep).contains("exceed the model's"), "a depth past the model's positions is refused");
    assert!(v.get("tg_metrics_off_tokens_per_s_spread").is_none(), "only with --metrics-ab");
    // Metrics on vs off in one call: both timed, every run.
    let mut ab = args.clone();
    ab.push("--metrics-ab");
    let m: serde_json::Value = serde_json::from_str(&ok_stdout(&ab)).unwrap();
    let off = &m["tg_metrics_off_tokens_per_s_spread"];
    assert!(off["median"].as_f64().unwrap() > 0.0 && off["min"].as_f64().unwrap() > 0.0, "{m}");
    ab.retain(|a| *a != "--json");
    assert!(ok_stdout(&ab).contains("with metrics off"));
    ab.extend(["--perf-mode", "off"]);
    assert!(failure(&ab).contains("metrics on vs off needs an engine that records"));
    assert!(v["tg_tokens_per_s"].as_f64().unwrap() > 0.0);
    let bad = failure(&["generate", "--model", p(&model), "--tokens", "1", "--engine", "warp"]);
    assert!(bad.contains("unknown engine 'warp'"), "{bad}");
}

#[test]
fn generate_samples_with_flags_reproducibly_and_refuses_bad_ones() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    ok_stdout(&["synth", "--out", p(&model)]);
    let run = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["generate", "--model", p(&model), "--tokens", "3,1,4", "--max-new-tokens", "10"];
        args.extend(["--engine", "pipeline"]);
        args.extend(extra);
        serde_json::from_str(&ok_stdout(&args)).unwrap()
    };
    let greedy = run(&[]);
    assert_eq!(greedy, run(&["--temperature", "0"]), "temperature 0 is greedy");
    assert_eq!(greedy["finish_reason"], "length");
    let sampled = ["--temperature", "1.5", "--top-k", "50", "--top-p", "0.9", "--min-p", "0.02"];
    let with_seed = |seed: &str| {
        let mut a = sampled.to_vec();
        a.extend(["--seed", seed, "--repeat-penalty", "1.1", "--presence-penalty", "0.3"]);
        run(&a)
    };
    assert_eq!(with_seed("5"), with_seed("5"));
    assert_ne!(with_seed("5")["tokens"], with_seed("6")["tokens"]);
    let lp = run(&["--logprobs", "2"]);
    assert_eq!(lp["tokens"], greedy["tokens"]);
    assert_eq!(lp["logprobs"].as_array().unwrap().len(), 10);
    assert_eq!(lp["logprobs"][0]["chosen"]["id"], greedy["tokens"][0]);
    assert_eq!(lp["logprobs"][0]["top"].as_array().unwrap().len(), 2);
    let third = greedy["tokens"][2].to_string();
    let stopped = run(&["--stop-ids", &third]);
    assert_eq!(stopped["finish_reason"], "stop");
    assert!(stopped["tokens"].as_array().unwrap().len() <= 2);
    for (flag, value, want) in [
        ("--temperature", "-1", "--temperature -1: must be a finite number >= 0"),
        ("--top-p", "0", "--top-p 0: must be in (0, 1]"),
        ("--repeat-penalty", "0", "--repeat-penalty 0: must be"),
        ("--logprobs", "30", "--logprobs 30: must be at most 20"),
    ] {
        let bad = failure(&["generate", "--model", p(&model), "--tokens", "1", flag, value]);
        assert!(bad.contains(want), "{flag}: {bad}");
    }
    let bad = failure(&["generate", "--model", p(&model), "--tokens", "1", "--stop-ids", "999999"]);
    assert!(bad.contains("stop id 999999"), "{bad}");
}

#[test]
fn run_streams_the_text_of_the_greedy_tokens_and_a_summary() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("q.gguf");
    let vocab = common::tokenizers().join("ggml-vocab-qwen2.gguf");
    ok_stdout(&["synth", "--out", p(&model), "--vocab-from", p(&vocab)]);
    let prompt = "Hello, wörld! 🦀";
    let base = ["--model", p(&model), "--engine", "pipeline"];
    let out = moe_lanes(&[&["run"][..], &base, &["--prompt", prompt, "-n", "12"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let summary = stderr.lines().last().unwrap();
    assert!(summary.starts_with("prompt ") && summary.contains(" t/s | generated "), "{stderr}");
    assert!(summary.contains("hit rate"), "{summary}");
    // the same tokens through generate, then detokenized: the same text
    let ids: Vec<u32> =
        serde_json::from_str(&ok_stdout(&["tokenize", "--model", p(&model), "--text", prompt, "--special"]))
            .unwrap();
    let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
    let g: serde_json::Value = serde_json::from_str(&ok_stdout(
        &[&["generate"][..], &base, &["--tokens", &ids.join(","), "--max-new-tokens", "12"]].concat(),
    ))
    .unwrap();
    let gen: Vec<String> = g["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .take_while(|&t| t < 151643) // qwen2's special tokens (end of generation among them) start here
        .map(|t| t.to_string())
        .collect();
    let want = ok_stdout(&["detokenize", "--model", p(&model), "--skip-special", "--tokens", &gen.join(",")]);
    assert_eq!(text, want, "run prints the detokenized greedy tokens");
    // the prompt from a file and from standard input; seeded sampling repeats
    let file = dir.path().join("prompt.txt");
    std::fs::write(&file, prompt).unwrap();
    let from_file = ok_stdout(&[&["run"][..], &base, &["--prompt-file", p(&file), "-n", "12"]].concat());
    assert_eq!(from_file, text);
    let sampled = ["-n", "8", "--temperature", "0.9", "--seed", "3"];
    let piped = |args: &[&str]| {
        use std::io::Write;
        let mut child = bin::command()
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(prompt.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let run_args = [&["run"][..], &base, &sampled].concat();
    assert_eq!(piped(&run_args), piped(&run_args));
    let bad = failure(&[&["run"][..], &base, &["--prompt", "x", "--top-p", "2"]].concat());
    assert!(bad.contains("--top-p 2"), "{bad}");
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
    // the learn file is replaced: --force (cli/tests/hardening48.rs checks the rule)
    let relearn = ["learn", "--model", p(&a), "--out", p(&learn), "--force", "--engine", "pipeline"];
    ok_stdout(&[&relearn[..], &["--n-tokens", "32"]].concat());
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
            "--force",
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

/// The what-if planner's per-layer-call cost model end to end on the CPU pipeline: a bench at
/// half the experts hot writes `phases.*.lane_cost` into its perf JSON, and `plan` fits and uses
/// it (no fallback note); the same file without those fields falls back to the per-slot model
/// and says so.
#[test]
fn plan_fits_the_lane_costs_a_bench_records() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    ok_stdout(&["synth", "--arch", "qwen3_moe", "--out", p(&model), "--experts", "16"]);
    let cal = dir.path().join("cal.json");
    // Half of each layer's experts hot, the lowest ids (not the most used, which --hot-fraction
    // plans): layer calls with and without cold experts, a spread the fit needs.
    let hot = dir.path().join("hot.json");
    std::fs::write(&hot, r#"{"layers": {"0": [0, 1, 2, 3, 4, 5, 6, 7], "1": [0, 1, 2, 3, 4, 5, 6, 7]}}"#)
        .unwrap();
    let bench = [
        "bench",
        "--model",
        p(&model),
        "--engine",
        "pipeline",
        "--hot-experts",
        p(&hot),
        "-p",
        "32",
        "-n",
        "24",
        "--runs",
        "1",
        "--perf-json",
        p(&cal),
    ];
    ok_stdout(&bench);
    let perf: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cal).unwrap()).unwrap();
    let n_layers = perf["layers"].as_array().unwrap().len() as u64;
    let decode = &perf["phases"]["decode"]["lane_cost"];
    let prefill = &perf["phases"]["prefill"]["lane_cost"];
    let calls =
        |c: &serde_json::Value| c["calls_cold"].as_u64().unwrap() + c["calls_no_cold"].as_u64().unwrap();
    // Every decode layer call is split on the pipeline, one token each.
    let decode_tokens = perf["phases"]["decode"]["tokens"].as_u64().unwrap();
    assert_eq!(calls(decode), decode_tokens * n_layers, "{decode}");
    assert_eq!(decode["tokens"].as_u64().unwrap(), decode_tokens * n_layers);
    assert!(decode["calls_cold"].as_u64().unwrap() > 0 && decode["calls_no_cold"].as_u64().unwrap() > 0);
    // One-token calls: each cold slot is a distinct expert.
    assert_eq!(decode["cold_slots"], decode["cold_experts"]);
    assert!(decode["wall_cold_us"].as_u64().unwrap() > 0);
    assert!(calls(prefill) >= n_layers && prefill["cold_slots"].as_u64() >= prefill["cold_experts"].as_u64());
    let plan = |learn: &std::path::Path, budget: &str| -> serde_json::Value {
        let out = ok_stdout(&[
            "plan",
            "--model",
            p(&model),
            "--learn",
            p(learn),
            "--hot-budget-mib",
            budget,
            "--json",
        ]);
        serde_json::from_str(&out).unwrap()
    };
    let fitted = plan(&cal, "0");
    let lc = &fitted["cost_model"]["phases"]["decode"]["layer_call"];
    assert_eq!(lc["fit"], "least_squares", "{lc}");
    assert_eq!(lc["tokens_per_call"], 1.0);
    assert_eq!(fitted["cost_model"]["phases"]["prefill"]["layer_call"]["fit"], "least_squares");
    let notes = fitted["notes"].to_string();
    assert!(!notes.contains("prediction:"), "{notes}");
    assert!(fitted["plan"]["tg_tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(fitted["plan"]["pp_tokens_per_s"].as_f64().unwrap() > 0.0);
    // Budget 0 on the fitted model: every layer call has k cold slots, so it costs F + k (D + S).
    let k = perf["n_expert_used"].as_f64().unwrap();
    let c = &fitted["cost_model"]["phases"]["decode"];
    let f = |v: &serde_json::Value| v.as_f64().unwrap();
    let per_layer = f(&lc["fixed_us"]) + k * (f(&lc["per_cold_slot_us"]) + f(&lc["per_cold_expert_us"]));
    let want = 1e6 / (f(&c["other_us_per_token"]) + n_layers as f64 * per_layer);
    let got = f(&fitted["plan"]["tg_tokens_per_s"]);
    assert!((got - want).abs() < 1e-6 * want, "{got} vs {want}");
    // The same file as written before lane_cost existed: the per-slot model, said in the notes.
    let mut old = perf.clone();
    for phase in old["phases"].as_object_mut().unwrap().values_mut() {
        phase.as_object_mut().unwrap().remove("lane_cost");
    }
    let old_path = dir.path().join("old.json");
    std::fs::write(&old_path, old.to_string()).unwrap();
    let fallback = plan(&old_path, "0");
    assert!(fallback["cost_model"]["phases"]["decode"]["layer_call"].is_null());
    assert!(fallback["notes"].to_string().contains("per-slot model"), "{}", fallback["notes"]);
    assert!(fallback["plan"]["tg_tokens_per_s"].as_f64().unwrap() > 0.0);
}
