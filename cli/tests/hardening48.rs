//! Issue 48 (what a new user hit), through the real binary: output files follow one rule,
//! `--hot-fraction` plans from a learn pass, sizes and counts are range-checked instead of
//! panicking or wrapping, `--engine gpu` without a GPU is an error, the justfile's recipe docs are
//! what `just --list` shows, and completion logprobs name tokens by their text.

mod bin;

use bin::server::Server;
use bin::{failure, ok_stdout, p};
use serde_json::{json, Value};
use std::path::Path;

fn tiny(dir: &Path) -> String {
    let path = dir.join("t.gguf");
    ok_stdout(&["synth", "--out", p(&path)]);
    p(&path).to_string()
}

fn no_tmp_left(dir: &Path) {
    let names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
}

/// A short pipeline run that writes `flag FILE`.
fn generate_writing(model: &str, flag: &str, file: &str, extra: &[&str]) -> Vec<String> {
    let mut args = vec!["generate", "--model", model, "--tokens", "1,2,3", "--max-new-tokens", "2"];
    args.extend(["--engine", "pipeline", flag, file]);
    args.extend(extra);
    args.into_iter().map(String::from).collect()
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn no_output_overwrites_the_model_an_existing_file_or_a_device() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let before = std::fs::read(&model).unwrap();
    let link = dir.path().join("same-model.gguf");
    std::fs::hard_link(&model, &link).unwrap();
    // the model, under its own name or another, even with --force
    let err = failure(&["learn", "--model", &model, "--n-tokens", "8", "--out", &model, "--force"]);
    assert!(err.contains("is the input"), "{err}");
    for flag in ["--perf-json", "--trace"] {
        for target in [model.as_str(), p(&link)] {
            let err = failure(&refs(&generate_writing(&model, flag, target, &["--force"])));
            assert!(err.contains("is the input"), "{flag} {target}: {err}");
        }
    }
    let err =
        failure(&["bench", "--model", &model, "--engine", "pipeline", "--perf-json", &model, "--force"]);
    assert!(err.contains("is the input"), "{err}");
    let err = failure(&["quantize", &model, &model, "--type", "q8_0", "--force"]);
    assert!(err.contains("is the input"), "{err}");
    assert_eq!(std::fs::read(&model).unwrap(), before, "the model is untouched");
    // an existing file needs --force; a device never
    let out = dir.path().join("learn.json");
    ok_stdout(&["learn", "--model", &model, "--n-tokens", "8", "--out", p(&out)]);
    let err = failure(&["learn", "--model", &model, "--n-tokens", "8", "--out", p(&out)]);
    assert!(err.contains("already exists") && err.contains("--force"), "{err}");
    ok_stdout(&["learn", "--model", &model, "--n-tokens", "8", "--out", p(&out), "--force"]);
    for flag in ["--perf-json", "--trace"] {
        let err = failure(&refs(&generate_writing(&model, flag, p(&out), &[])));
        assert!(err.contains("already exists"), "{flag}: {err}");
        let err = failure(&refs(&generate_writing(&model, flag, "/dev/null", &["--force"])));
        assert!(err.contains("not a regular file"), "{flag}: {err}");
    }
    let err = failure(&["learn", "--model", &model, "--out", "/dev/null", "--force"]);
    assert!(err.contains("not a regular file"), "{err}");
    // and written whole: the trace and perf JSON of a run are there, nothing else
    let (perf, trace) = (dir.path().join("perf.json"), dir.path().join("trace.jsonl"));
    ok_stdout(&refs(&generate_writing(&model, "--perf-json", p(&perf), &["--trace", p(&trace)])));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&perf).unwrap()).unwrap();
    assert!(v.is_object());
    assert!(std::fs::read_to_string(&trace).unwrap().lines().count() > 1);
    let err =
        failure(&refs(&generate_writing(&model, "--perf-json", p(&perf), &["--trace", p(&perf), "--force"])));
    assert!(err.contains("the same file"), "{err}");
    no_tmp_left(dir.path());
}

fn bench(model: &str, extra: &[&str]) -> std::process::Output {
    let mut args =
        vec!["bench", "--model", model, "--engine", "pipeline", "-p", "8", "-n", "2", "--runs", "1"];
    args.extend(extra);
    bin::moe_lanes(&args)
}

#[test]
fn hot_fraction_plans_from_the_learn_pass_and_bench_says_its_plan_in_words() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let out = bench(&model, &["--hot-fraction", "0.5", "--learn-tokens", "64", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["learn_source"], "built-in learn pass", "{v}");
    // the default model routes ~90% of slots to the top half of its experts
    let planned = v["planned_hit_rate"].as_f64().unwrap();
    assert!(planned > 0.7, "planned hit rate {planned} (the lowest ids give about 0.5)");
    let out = bench(&model, &["--hot-fraction", "0.5"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("50% of each layer's experts") && !text.contains("Some("), "{text}");
    let out = bench(&model, &["--hot-budget-mib", "1"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("budget 1.0 MiB"), "{text}");
    // no counts at all: the planned hit rate is unknown, not 0.0%
    let hot = dir.path().join("hot.json");
    std::fs::write(&hot, r#"{"layers": {"0": [1]}}"#).unwrap();
    let out = bench(&model, &["--hot-experts", p(&hot)]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("planned hit rate unknown") && !text.contains("planned hit rate 0.0%"), "{text}");
    let out = bench(&model, &["--hot-experts", p(&hot), "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["planned_hit_rate"].is_null(), "{v}");
}

#[test]
fn huge_thread_counts_and_sizes_are_errors_not_panics_and_leave_nothing() {
    let err = failure(&["bench-kernels", "--quick", "--threads", "100000"]);
    assert!(err.contains("--threads 100000: expected 1 to 256") && !err.contains("panicked"), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("big.gguf");
    let start = std::time::Instant::now();
    let err = failure(&["synth", "--hidden", "99999999999", "--out", p(&out)]);
    assert!(err.contains("hidden") && err.contains("limit") && !err.contains("memory allocation"), "{err}");
    // within every dimension limit, but petabytes: refused against the free disk space
    let err = failure(&["synth", "--hidden", "16000000", "--vocab", "16000000", "--out", p(&out)]);
    assert!(err.contains("the checkpoint needs") && err.contains("free"), "{err}");
    assert!(start.elapsed() < std::time::Duration::from_secs(30), "refused before writing");
    assert!(!out.exists());
    no_tmp_left(dir.path());
}

/// A flag value clap's parser refuses: exit 2 (a usage error), the message, no panic.
fn usage_error(out: std::process::Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

#[test]
fn numbers_are_range_checked() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let out = bench(&model, &["--hot-budget-mib", "99999999999999"]);
    let err = bin::failure_of(out, "a budget that overflows");
    assert!(err.contains("--hot-budget-mib 99999999999999: too large"), "{err}");
    let learn = dir.path().join("learn.json");
    ok_stdout(&["learn", "--model", &model, "--n-tokens", "16", "--out", p(&learn)]);
    let err =
        failure(&["plan", "--model", &model, "--learn", p(&learn), "--hot-budget-mib", "99999999999999"]);
    assert!(err.contains("too large"), "{err}");
    for lanes in ["0", "9", "-1"] {
        let err = usage_error(bench(&model, &["--hot-lanes", lanes]));
        assert!(err.contains("expected 1 to 3"), "--hot-lanes {lanes}: {err}");
    }
    let err = usage_error(bench(&model, &["--hot-budget-mib", "1", "--learn-tokens", "0"]));
    assert!(err.contains("--learn-tokens") && err.contains("at least 1"), "{err}");
    let err = usage_error(bin::moe_lanes(&["inspect", &model, "--coverage-tokens", "0"]));
    assert!(err.contains("at least 1"), "{err}");
    let err = failure(&["inspect", &model, "--coverage-tokens", "99999999"]);
    assert!(err.contains("at most 4096"), "{err}");
    let err = bin::failure_of(bench(&model, &["--hot-fraction", "-0.5"]), "-0.5");
    assert!(err.contains("--hot-fraction -0.5: expected a value in 0..=1"), "{err}");
    for flag in ["-n", "-p", "-d"] {
        let err = usage_error(bin::moe_lanes(&["bench", "--model", &model, flag, "-1"]));
        assert!(err.contains("out of range") && !err.contains("unexpected argument"), "{flag}: {err}");
    }
    // a prompt that leaves no room: say how long it may be, not "at most 0 new tokens"
    let ids: Vec<String> = (1..=9).map(|i| i.to_string()).collect();
    let args = ["generate", "--model", &model, "--engine", "pipeline", "--ctx-size", "8", "--tokens"];
    let mut args: Vec<&str> = args.to_vec();
    let ids = ids.join(",");
    args.push(&ids);
    let err = failure(&args);
    assert!(err.contains("the prompt may be at most 7 tokens") && !err.contains("at most 0 new"), "{err}");
}

#[test]
fn an_explicit_gpu_engine_without_a_gpu_is_an_error() {
    if Path::new("/dev/nvidia0").exists() {
        return eprintln!("SKIP: a GPU device node exists; the fallback cannot be tested here");
    }
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let err = failure(&["generate", "--model", &model, "--tokens", "1,2", "--engine", "gpu"]);
    assert!(err.contains("--engine gpu") && err.contains("cannot run"), "{err}");
    let err =
        failure(&["learn", "--model", &model, "--out", p(&dir.path().join("l.json")), "--engine", "gpu"]);
    assert!(err.contains("--engine gpu"), "{err}");
    // the default still falls back, saying why
    let out = bin::moe_lanes(&["generate", "--model", &model, "--tokens", "1,2", "--max-new-tokens", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && stderr.contains("GPU engine unavailable"), "{stderr}");
}

/// `just --list` shows the one comment line directly above a recipe: every public recipe has
/// one, and it is not the tail of a longer comment (which would show cut off).
#[test]
fn every_just_recipe_has_its_own_one_line_description() {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../justfile")).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let mut recipes = 0;
    for (i, line) in lines.iter().enumerate() {
        let Some(first) = line.chars().next() else { continue };
        let head = line.split(':').next().unwrap_or("");
        let is_recipe = first.is_ascii_lowercase()
            && line.contains(':')
            && !line.contains(":=")
            && !line.starts_with("alias ")
            && head
                .split_whitespace()
                .next()
                .is_some_and(|n| n.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'));
        if !is_recipe || lines[i.saturating_sub(1)] == "[private]" {
            continue;
        }
        recipes += 1;
        let name = head.split_whitespace().next().unwrap();
        let doc = lines.get(i.wrapping_sub(1)).copied().unwrap_or("");
        assert!(doc.starts_with("# "), "recipe {name} has no description line directly above it");
        let above = lines.get(i.wrapping_sub(2)).copied().unwrap_or("");
        assert!(
            !above.starts_with('#'),
            "recipe {name}: `just --list` shows only the last line of: {above}\n{doc}"
        );
    }
    assert!(recipes >= 15, "found {recipes} recipes");
}

#[test]
fn completion_logprobs_name_tokens_by_their_text() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let server = Server::start(&model, &[]);
    let body = json!({"prompt": [4, 8, 15], "max_tokens": 4, "temperature": 0, "logprobs": 2});
    let (status, v) = server.json("POST", "/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let tokens: Vec<&str> = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    let ids: Vec<u64> =
        v["choices"][0]["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    assert_eq!(tokens.len(), ids.len());
    for (i, (name, id)) in tokens.iter().zip(&ids).enumerate() {
        assert!(!name.starts_with("token_id:"), "{lp}");
        // the token's text, as the tokenizer gives it
        let text = ok_stdout(&["detokenize", "--model", &model, "--tokens", &id.to_string(), "--json"]);
        let text: Value = serde_json::from_str(&text).unwrap();
        if !name.contains('\u{fffd}') {
            assert_eq!(text["text"], json!(name), "token {id}");
        }
        // greedy: the chosen token is one of its position's alternatives, under the same name
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert!(top.contains_key(*name), "{name:?} not in {top:?}");
    }
    let (_, text) = server.request("GET", "/metrics", b"", &[]);
    assert!(text.contains("moe_lanes_requests_total{outcome=\"ok\"} 1"), "{text}");
}
