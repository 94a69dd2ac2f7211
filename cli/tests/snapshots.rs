//! Snapshot tests of text outputs: CLI help, `inspect` (text and JSON) and the perf JSON written
//! by `--perf-json`. A change to any of them must be deliberate: review with `cargo insta review`
//! or set `INSTA_UPDATE=always` and inspect the diff.

use std::process::Command;

fn moe_lanes(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_moe-lanes")).args(args).output().expect("binary runs");
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn cli_help() {
    insta::assert_snapshot!("help", moe_lanes(&["--help"]));
    for cmd in [
        "synth",
        "inspect",
        "logits",
        "generate",
        "learn",
        "bench",
        "bench-kernels",
        "demo",
        "serve",
        "run",
        "tokenize",
        "detokenize",
    ] {
        insta::assert_snapshot!(format!("help_{}", cmd.replace('-', "_")), moe_lanes(&[cmd, "--help"]));
    }
}

/// A tiny deterministic model; the temp path is replaced so snapshots are stable.
fn tiny_model(dir: &std::path::Path) -> (String, String) {
    let path = dir.join("snap.gguf");
    let path_str = path.to_str().unwrap().to_string();
    moe_lanes(&["synth", "--arch", "qwen2_moe", "--seed", "1", "--out", &path_str]);
    (path_str, "[MODEL]".to_string())
}

#[test]
fn inspect_text_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let (path, placeholder) = tiny_model(dir.path());
    insta::assert_snapshot!("inspect_text", moe_lanes(&["inspect", &path]).replace(&path, &placeholder));
    insta::assert_snapshot!(
        "inspect_json",
        moe_lanes(&["inspect", &path, "--json"]).replace(&path, &placeholder)
    );
}

#[test]
fn perf_json_shape() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = tiny_model(dir.path());
    let perf = dir.path().join("perf.json");
    moe_lanes(&[
        "logits",
        "--model",
        &path,
        "--tokens",
        "1,2,3,4",
        "--hot-fraction",
        "0.5",
        "--perf-json",
        perf.to_str().unwrap(),
    ]);
    let mut value: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&perf).unwrap()).unwrap();
    // Thread counts follow the machine's cores (`--cold-threads auto`): checked, then masked.
    for key in ["cold", "dense"] {
        assert!(value["threads"][key].as_u64().unwrap() >= 1, "threads.{key}");
        value["threads"][key] = serde_json::json!("[n]");
    }
    // Timings vary run to run; everything else (counts, field names, structure) is deterministic.
    for layer in value["layers"].as_array_mut().unwrap() {
        for (key, v) in layer.as_object_mut().unwrap() {
            if key.ends_with("_us") {
                *v = serde_json::json!("[us]");
            }
        }
    }
    insta::assert_snapshot!("perf_json", serde_json::to_string_pretty(&value).unwrap());
}
