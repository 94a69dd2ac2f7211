//! `moe-lanes quantize` and `synth --quant` through the real binary: a quantised file runs on
//! the pipeline engine with the reference's greedy tokens and logits within 1e-4 (normwise
//! relative, per row) with `--activations f32`, within 4e-2 with `q8` and `auto` (8-bit
//! activations where the CPU has AVX-512 VNNI, in the experts and the dense stage's quantised
//! matrices: about 1e-2 here; the bound's reasons are in tests/quant_engine.rs); bad input fails
//! cleanly and leaves no output file behind.

#[path = "../../tests/common/mod.rs"]
mod common;

mod bin;

use bin::{failure, ok_stdout, p};

const WIDE: [&str; 6] = ["--hidden", "256", "--expert-ff", "256", "--head-dim", "64"];

/// `engine`: the engine's flags (`--engine E`, `--activations A`).
fn logits(model: &str, engine: &[&str]) -> Vec<Vec<f32>> {
    let mut args = vec!["logits", "--model", model, "--tokens", "5,17,200,3"];
    args.extend(engine);
    let json: serde_json::Value = serde_json::from_str(&ok_stdout(&args)).unwrap();
    json["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| row.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect())
        .collect()
}

fn generate(model: &str, engine: &[&str]) -> serde_json::Value {
    let mut args = vec!["generate", "--model", model, "--tokens", "9,8,7", "--max-new-tokens", "6"];
    args.extend(engine);
    let json: serde_json::Value = serde_json::from_str(&ok_stdout(&args)).unwrap();
    json["tokens"].clone()
}

#[test]
fn quantize_then_run_on_the_pipeline_like_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let float = dir.path().join("f.gguf");
    let mut args = vec!["synth", "--out", p(&float), "--seed", "3"];
    args.extend(WIDE);
    ok_stdout(&args);
    for mix in ["q4_k_m", "q8_0", "mxfp4_moe", "q5_0", "iq4_nl"] {
        let out = dir.path().join(format!("{mix}.gguf"));
        let report: serde_json::Value =
            serde_json::from_str(&ok_stdout(&["quantize", p(&float), p(&out), "--type", mix, "--json"]))
                .unwrap();
        assert_eq!(report["mix"], mix);
        assert!(report["output_bytes"].as_u64().unwrap() < report["input_bytes"].as_u64().unwrap());
        let text = ok_stdout(&["inspect", p(&out)]);
        let block_type = match mix {
            "q8_0" => "Q8_0",
            "mxfp4_moe" => "MXFP4",
            "q5_0" => "Q5_0",
            "iq4_nl" => "IQ4_NL",
            _ => "Q4_K",
        };
        assert!(text.contains(block_type), "{text}");
        // expert bytes summed per layer (a _M mix keeps some layers' down projections in Q6_K)
        let sizes: serde_json::Value =
            serde_json::from_str(&ok_stdout(&["inspect", p(&out), "--json"])).unwrap();
        let (all, other) =
            (sizes["all_experts_bytes"].as_u64().unwrap(), sizes["other_bytes"].as_u64().unwrap());
        assert!(all + other <= report["output_bytes"].as_u64().unwrap(), "{mix}: {sizes}");
        let reference = ["--engine", "reference"];
        let want = logits(p(&out), &reference);
        for (activations, tolerance) in [("f32", 1e-4), ("q8", 4e-2), ("auto", 4e-2)] {
            let pipeline = ["--engine", "pipeline", "--activations", activations];
            for (w, g) in want.iter().zip(&logits(p(&out), &pipeline)) {
                let diff: f64 = w.iter().zip(g).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
                let norm: f64 = w.iter().map(|a| (*a as f64).powi(2)).sum();
                let error = (diff / norm).sqrt();
                assert!(error <= tolerance, "{mix} {activations}: {error}");
            }
            assert_eq!(generate(p(&out), &pipeline), generate(p(&out), &reference), "{mix} {activations}");
        }
    }
}

#[test]
fn synth_quant_writes_a_quantized_model_and_no_float_leftover() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("q.gguf");
    let mut args = vec!["synth", "--out", p(&out), "--quant", "q6_k"];
    args.extend(WIDE);
    ok_stdout(&args);
    let report: serde_json::Value =
        serde_json::from_str(&ok_stdout(&["inspect", p(&out), "--json"])).unwrap();
    assert_eq!(report["expert_dtype"], "Q6_K");
    let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, vec![std::ffi::OsString::from("q.gguf")]);
}

#[test]
fn bad_type_and_unreadable_input_fail_cleanly_without_output() {
    let dir = tempfile::tempdir().unwrap();
    let float = dir.path().join("f.gguf");
    ok_stdout(&["synth", "--out", p(&float)]);
    let out = dir.path().join("out.gguf");
    let err = failure(&["quantize", p(&float), p(&out), "--type", "q3_k"]);
    assert!(err.contains("--type q3_k: expected one of q8_0, q4_0, q4_k_m, q5_k_m, q6_k"), "{err}");
    let garbage = dir.path().join("garbage.gguf");
    std::fs::write(&garbage, b"not a gguf file at all").unwrap();
    let err = failure(&["quantize", p(&garbage), p(&out), "--type", "q8_0"]);
    assert!(err.contains("garbage.gguf"), "{err}");
    let missing = dir.path().join("missing.gguf");
    let err = failure(&["quantize", p(&missing), p(&out), "--type", "q8_0"]);
    assert!(err.contains("missing.gguf"), "{err}");
    let err = failure(&["synth", "--out", p(&out), "--format", "safetensors", "--quant", "q8_0"]);
    assert!(err.contains("--quant q8_0"), "{err}");
    let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), 2, "only the inputs remain: {names:?}");
}
