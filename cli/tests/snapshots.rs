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
        "chat",
        "tokenize",
        "detokenize",
        "plan",
        "quantize",
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
    for phase in value["phases"].as_object_mut().unwrap().values_mut() {
        for (key, v) in phase.as_object_mut().unwrap() {
            if key.ends_with("_us") {
                *v = serde_json::json!("[us]");
            }
        }
        // The lane-cost sums: the wall-time moments vary, the counts do not.
        for (key, v) in phase["lane_cost"].as_object_mut().unwrap() {
            if key.contains("wall") {
                *v = serde_json::json!("[us]");
            }
        }
    }
    insta::assert_snapshot!("perf_json", serde_json::to_string_pretty(&value).unwrap());
}

/// A model big enough for MiB budgets to matter (16 experts of 768 KiB per layer), its learn
/// file with every timing replaced by fixed figures, so the plan's predictions are stable:
/// decode with per-layer-call lane costs (the fitted model), prefill without (the per-slot
/// fallback of older files).
fn plan_fixture(dir: &std::path::Path) -> (String, String) {
    let model = dir.join("plan.gguf");
    let model_str = model.to_str().unwrap().to_string();
    moe_lanes(&[
        "synth",
        "--arch",
        "qwen3_moe",
        "--seed",
        "3",
        "--hidden",
        "256",
        "--expert-ff",
        "512",
        "--experts",
        "16",
        "--out",
        &model_str,
    ]);
    let learn = dir.join("learn.json");
    let learn_str = learn.to_str().unwrap().to_string();
    moe_lanes(&[
        "learn",
        "--model",
        &model_str,
        "--n-tokens",
        "128",
        "--engine",
        "pipeline",
        "--out",
        &learn_str,
    ]);
    let mut value: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&learn).unwrap()).unwrap();
    for layer in value["layers"].as_array_mut().unwrap() {
        for (key, v) in layer.as_object_mut().unwrap() {
            if key.ends_with("_us") {
                *v = serde_json::json!(0);
            }
        }
    }
    value["phases"] = serde_json::json!({
        "prefill": {"calls": 1, "tokens": 128, "wall_time_us": 64000, "lane_wall_time_us": 48000,
                    "hot_slots": 0, "cold_slots": 512, "hot_time_us": 0, "cold_time_us": 48000},
        "decode": {"calls": 64, "tokens": 64, "wall_time_us": 64000, "lane_wall_time_us": 44800,
                   "hot_slots": 128, "cold_slots": 128, "hot_time_us": 1280, "cold_time_us": 41600,
                   // 2 layers x 64 calls: 32 without cold work at 100 us, 64 with 1 cold slot at
                   // 400 us, 32 with 2 at 500 us: W0 = 100, F = 300, S = 100.
                   "lane_cost": {"calls_no_cold": 32, "wall_no_cold_us": 3200, "tokens": 128,
                                 "calls_cold": 96, "cold_experts": 128, "cold_slots": 128,
                                 "wall_cold_us": 41600, "cold_experts_sq": 192, "cold_slots_sq": 192,
                                 "experts_x_slots": 192, "experts_x_wall_us": 57600,
                                 "slots_x_wall_us": 57600, "wall_sq_us2": 18240000}}
    });
    std::fs::write(&learn, value.to_string()).unwrap();
    (model_str, learn_str)
}

#[test]
fn plan_text_json_and_sweep() {
    let dir = tempfile::tempdir().unwrap();
    let (model, learn) = plan_fixture(dir.path());
    let base = ["plan", "--model", &model, "--learn", &learn, "--hot-budget-mib", "6"];
    insta::assert_snapshot!("plan_text", moe_lanes(&base));
    let json = moe_lanes(&[&base[..], &["--json"]].concat());
    insta::assert_snapshot!("plan_json", json);
    let sweep =
        moe_lanes(&[&base[..], &["--sweep", "--weighting", "balanced", "--layer-curve", "1"]].concat());
    insta::assert_snapshot!("plan_sweep_text", sweep);
    let sweep_json: serde_json::Value =
        serde_json::from_str(&moe_lanes(&[&base[..], &["--sweep", "--json"]].concat())).unwrap();
    let points = sweep_json["sweep"].as_array().unwrap();
    assert_eq!(points.len(), 11);
    assert_eq!(points[10]["hit_rate"], 1.0);
}
