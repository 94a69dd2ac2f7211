//! What a new user broke (issue "Hardening"), each through the real binary: the output is a
//! clear error (exit 1, no panic, the message says what to do) and nothing is changed.

mod bin;

use bin::{command, failure, failure_of, ok_stdout, p};
use std::path::Path;
use std::time::{Duration, Instant};

fn tiny(dir: &Path) -> String {
    let path = dir.join("t.gguf");
    ok_stdout(&["synth", "--out", p(&path)]);
    p(&path).to_string()
}

#[test]
fn synth_refuses_to_overwrite_without_force_and_never_replaces_a_device() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let before = std::fs::read(&model).unwrap();
    let err = failure(&["synth", "--seed", "9", "--out", &model]);
    assert!(err.contains("already exists") && err.contains("--force"), "{err}");
    assert_eq!(std::fs::read(&model).unwrap(), before, "the existing file is untouched");
    ok_stdout(&["synth", "--seed", "9", "--out", &model, "--force"]);
    assert_ne!(std::fs::read(&model).unwrap(), before, "--force replaces it");
    let err = failure(&["synth", "--out", "/dev/null", "--force"]);
    assert!(err.contains("not a regular file"), "{err}");
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata("/dev/null").unwrap().file_type().is_char_device());
    let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(leftovers.iter().all(|n| !n.to_string_lossy().ends_with(".tmp")), "{leftovers:?}");
}

#[test]
fn generation_past_the_context_is_refused_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    for n in ["18446744073709551615", "100000000000", "5000"] {
        let start = Instant::now();
        let err = failure(&[
            "generate",
            "--model",
            &model,
            "--tokens",
            "1,2,3",
            "--max-new-tokens",
            n,
            "--engine",
            "pipeline",
        ]);
        assert!(err.contains("exceed the context of") && err.contains("ask for at most"), "{n}: {err}");
        assert!(start.elapsed() < Duration::from_secs(20), "{n}: refused before generating");
    }
}

#[test]
fn ctx_size_limits_the_session_and_is_checked() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let run = |ctx: &str, n_new: &str| {
        let args =
            ["generate", "--model", &model, "--tokens", "1,2,3", "--max-new-tokens", n_new, "--engine"];
        let mut args: Vec<&str> = args.to_vec();
        args.extend(["pipeline", "--ctx-size", ctx]);
        args.into_iter().map(String::from).collect::<Vec<_>>()
    };
    fn refs(v: &[String]) -> Vec<&str> {
        v.iter().map(String::as_str).collect()
    }
    let err = failure(&refs(&run("8", "6")));
    assert!(err.contains("3 prompt tokens + 6 new tokens exceed the context of 8 positions"), "{err}");
    assert!(err.contains("ask for at most 5"), "{err}");
    let fits = ok_stdout(&refs(&run("8", "5")));
    let full = ok_stdout(&refs(&run("4096", "5")));
    assert_eq!(fits, full, "a smaller context changes nothing that fits in it");
    let err = failure(&refs(&run("4097", "1")));
    assert!(err.contains("context size 4097 is past the model's trained context of 4096"), "{err}");
    let err = failure(&refs(&run("0", "1")));
    assert!(err.contains("at least one position"), "{err}");
}

#[test]
fn a_fifo_or_a_lone_safetensors_file_as_model_gets_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("model.gguf");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    if made.is_ok_and(|s| s.success()) {
        let mut child =
            command().args(["inspect", p(&fifo)]).stderr(std::process::Stdio::piped()).spawn().unwrap();
        let start = Instant::now();
        while child.try_wait().unwrap().is_none() {
            assert!(start.elapsed() < Duration::from_secs(20), "inspect on a FIFO hangs");
            std::thread::sleep(Duration::from_millis(50));
        }
        let err = failure_of(child.wait_with_output().unwrap(), "inspect FIFO");
        assert!(err.contains("not a regular file or a directory"), "{err}");
    } else {
        eprintln!("SKIP: mkfifo not available");
    }
    let st = dir.path().join("st");
    ok_stdout(&["synth", "--format", "safetensors", "--out", p(&st)]);
    let file = st.join("model.safetensors");
    let err = failure(&["inspect", p(&file)]);
    assert!(err.contains("pass its directory") && err.contains(p(&st)), "{err}");
}

#[test]
fn inputs_that_used_to_be_ignored_or_clamped_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let gen = |extra: &[&str]| {
        let mut args = vec!["generate", "--model", &model, "--tokens", "1,2", "--max-new-tokens", "2"];
        args.extend_from_slice(extra);
        failure(&args)
    };
    for n in ["0", "10000"] {
        let err = gen(&["--cold-threads", n]);
        assert!(err.contains(&format!("--cold-threads {n}: expected auto or 1..=")), "{err}");
    }
    let learn = dir.path().join("learn.json");
    ok_stdout(&["learn", "--model", &model, "--n-tokens", "16", "--out", p(&learn), "--engine", "pipeline"]);
    let err = gen(&["--learn", p(&learn)]);
    assert!(err.contains("--hot-fraction or --hot-budget-mib"), "{err}");
    let empty = dir.path().join("empty.json");
    std::fs::write(&empty, "{}").unwrap();
    let err = gen(&["--learn", p(&empty), "--hot-fraction", "0.5"]);
    assert!(err.contains("empty.json") && err.contains("counts for 0 layers"), "{err}");
    let hot = dir.path().join("hot.json");
    std::fs::write(&hot, r#"{"layers": {"0": [1], "00": [2]}}"#).unwrap();
    let err = gen(&["--hot-experts", p(&hot)]);
    assert!(err.contains("layers.00") && err.contains("written plainly"), "{err}");
    let out = command()
        .args(["generate", "--model", &model, "--tokens", "1,2", "--max-new-tokens", "2"])
        .env("MOE_LANES_ORDER", "sideways")
        .output()
        .unwrap();
    let err = failure_of(out, "MOE_LANES_ORDER=sideways");
    assert!(err.contains("MOE_LANES_ORDER=sideways: expected token or expert"), "{err}");
    let out = command()
        .args(["generate", "--model", &model, "--tokens", "1,2", "--max-new-tokens", "2"])
        .env("MOE_LANES_GPU_ATTENTION", "maybe")
        .output()
        .unwrap();
    let err = failure_of(out, "MOE_LANES_GPU_ATTENTION=maybe");
    assert!(err.contains("MOE_LANES_GPU_ATTENTION=maybe: expected"), "{err}");
}

#[test]
fn concurrent_first_run_demos_all_succeed_and_an_empty_home_is_unset() {
    let home = tempfile::tempdir().unwrap();
    let children: Vec<_> = (0..4)
        .map(|_| {
            command()
                .args(["demo", "--max-new-tokens", "2", "--engine", "pipeline"])
                .env("MOE_LANES_HOME", home.path())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "a concurrent demo failed: {}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains("matches the reference forward pass: yes"));
    }
    let names: Vec<_> = std::fs::read_dir(home.path()).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(names.len(), 1, "one model, no temp files left: {names:?}");
    // MOE_LANES_HOME="" means unset: the model goes under $HOME/.cache, not the current directory.
    let cwd = tempfile::tempdir().unwrap();
    let fake_home = tempfile::tempdir().unwrap();
    let out = command()
        .args(["demo", "--max-new-tokens", "1", "--engine", "pipeline"])
        .env("MOE_LANES_HOME", "")
        .env("HOME", fake_home.path())
        .current_dir(cwd.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read_dir(cwd.path()).unwrap().count(), 0, "nothing written to the current directory");
    assert!(fake_home.path().join(".cache/moe-lanes").is_dir());
}

/// Interrupt `synth` while it writes (SIGINT, then SIGTERM): nothing is left that looks like a
/// model or a temporary file, in both formats.
#[test]
fn an_interrupted_synth_leaves_nothing_behind() {
    for (format, signal) in [("gguf", "-INT"), ("safetensors", "-TERM")] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join(format!("big.{format}"));
        let mut child = command()
            .args([
                "synth",
                "--preset",
                "qwen3-30b-a3b",
                "--layers",
                "2",
                "--format",
                format,
                "--out",
                p(&out),
            ])
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let start = Instant::now();
        let started = loop {
            let names: Vec<String> = std::fs::read_dir(dir.path())
                .unwrap()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into())
                .collect();
            if names.iter().any(|n| n.ends_with(".tmp")) {
                break true;
            }
            if child.try_wait().unwrap().is_some() || start.elapsed() > Duration::from_secs(60) {
                break false;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if !started {
            eprintln!("SKIP: {format}: the write finished before it could be interrupted");
            let _ = child.kill();
            continue;
        }
        let killed =
            std::process::Command::new("kill").args([signal, &child.id().to_string()]).status().unwrap();
        assert!(killed.success());
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(130), "{format}: exits as interrupted");
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().map(|e| e.file_name()).collect();
        assert!(left.is_empty(), "{format}: left behind {left:?}");
    }
}

/// A prompt too long for a command line comes from `--tokens-file`; a bad file is named.
#[test]
fn tokens_file_gives_the_same_answer_as_tokens_and_names_a_bad_entry() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let file = dir.path().join("prompt.txt");
    std::fs::write(&file, "5, 17\n200 3\n").unwrap();
    let args = |extra: &[&str]| {
        let mut a = vec!["generate", "--model", &model, "--max-new-tokens", "3", "--engine", "pipeline"];
        a.extend_from_slice(extra);
        a.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let run = |a: Vec<String>| ok_stdout(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(run(args(&["--tokens-file", p(&file)])), run(args(&["--tokens", "5,17,200,3"])));
    std::fs::write(&file, "5, x7").unwrap();
    let a = args(&["--tokens-file", p(&file)]);
    let err = failure(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(err.contains("prompt.txt: token 2 is 'x7'"), "{err}");
}

/// `--engine-config FILE`: the GPU tuning as JSON; a file that cannot be read or names an unknown
/// field or value stops the command with an error naming the file and what is wrong; a good one
/// runs (the pipeline engine ignores GPU tuning).
#[test]
fn engine_config_files_are_checked_and_used() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let run = |cfg: &Path| -> Vec<String> {
        let base = [
            "generate",
            "--model",
            &model,
            "--tokens",
            "1,2",
            "--max-new-tokens",
            "2",
            "--engine",
            "pipeline",
        ];
        let mut args: Vec<String> = base.iter().map(|s| s.to_string()).collect();
        args.extend(["--engine-config".to_string(), p(cfg).to_string()]);
        args
    };
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let bad_field = write("field.json", r#"{"gpu": {"decode_graphs": false}}"#);
    let args = run(&bad_field);
    let err = failure(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(err.contains("field.json") && err.contains("decode_graphs"), "{err}");
    let bad_value = write("value.json", r#"{"gpu": {"prefill_attention": "fast"}}"#);
    let args = run(&bad_value);
    let err = failure(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(err.contains("value.json") && err.contains("fast"), "{err}");
    let missing = dir.path().join("missing.json");
    let args = run(&missing);
    let err = failure(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(err.contains("missing.json"), "{err}");
    let good = write("good.json", r#"{"gpu": {"prefill_attention": "tiled", "decode_graph": false}}"#);
    let args = run(&good);
    let out = ok_stdout(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(out.contains("\"tokens\""), "{out}");
    let range = write("range.json", r#"{"postfetch": {"streams": 9}}"#);
    let args = run(&range);
    let err = failure(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(err.contains("postfetch.streams") && err.contains("1 to 4"), "{err}");
    // the cpu section reaches the engine: bench reports the SIMD level the file asked for
    let scalar = write("scalar.json", r#"{"cpu": {"simd": "scalar", "cold_schedule": "phased"}}"#);
    let out = ok_stdout(&[
        "bench",
        "--model",
        &model,
        "--engine",
        "pipeline",
        "-p",
        "4",
        "-n",
        "2",
        "--json",
        "--engine-config",
        p(&scalar),
    ]);
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["simd"], "scalar", "{out}");
}
