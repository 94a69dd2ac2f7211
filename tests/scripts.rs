//! The helper scripts that recipes call: `scripts/bench-table.py` formats bench reports and
//! names the file that is not one; `scripts/argmax-agreement.py` compares llama.cpp's argmax
//! with moe-lanes' logits. Skips (saying so) where python3 is missing.

use std::process::Command;

fn python() -> Option<Command> {
    let ok = Command::new("python3").arg("--version").output().is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("SKIP: python3 not found");
    }
    ok.then(|| Command::new("python3"))
}

#[test]
fn bench_table_formats_reports_and_names_a_bad_file() {
    let Some(mut py) = python() else { return };
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/bench-table.py");
    let out = py.args([script, "--self-test"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bench-hot.json");
    std::fs::write(&bad, r#"{"engine": "gpu"}"#).unwrap();
    let out = Command::new("python3").args([script, bad.to_str().unwrap()]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bench-hot.json") && err.contains("missing"), "{err}");
}

/// `scripts/argmax-agreement.py` (llama.cpp's `llama-argmax` JSON against `moe-lanes logits`):
/// passes when the clear-lead positions agree, fails and says so when they do not or when the
/// position counts differ.
#[test]
fn argmax_agreement_counts_clear_positions() {
    let Some(_) = python() else { return };
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/argmax-agreement.py");
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_string()
    };
    let ours = write("moe.json", r#"{"tokens": [1, 2], "logits": [[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]]}"#);
    let run = |theirs: &str| {
        let theirs = write("llama.json", theirs);
        Command::new("python3").args([script, &theirs, &ours, "q8_0"]).output().unwrap()
    };
    let same = run(r#"{"argmax": [1, 0], "gap": [4.0, 3.0]}"#);
    let text = String::from_utf8_lossy(&same.stdout);
    assert!(
        same.status.success() && text.contains("2/2 positions; 2/2 where the lead is clear (ok)"),
        "{text}"
    );
    let differ = run(r#"{"argmax": [0, 0], "gap": [4.0, 3.0]}"#);
    let text = String::from_utf8_lossy(&differ.stdout);
    assert!(!differ.status.success() && text.contains("1/2 where the lead is clear (FAIL)"), "{text}");
    let short = run(r#"{"argmax": [1], "gap": [4.0]}"#);
    assert!(
        !short.status.success() && String::from_utf8_lossy(&short.stdout).contains("position count differs")
    );
}

/// `scripts/gguf-layout-check.py --self-test`: a deepseek2 file in the mixed form this
/// repository's writer once made (`key_length_mla` beside a fused `attn_kv_b`, no
/// `q_lora_rank`, an unknown tensor) fails, each problem named. Skips where gguf-py is missing.
#[test]
fn gguf_layout_check_names_what_llama_cpp_would_refuse() {
    let Some(_) = python() else { return };
    let probe = Command::new("python3").args(["-c", "import gguf, numpy"]).output().unwrap();
    if !probe.status.success() {
        eprintln!("SKIP: gguf-py (pip install gguf) not found");
        return;
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/gguf-layout-check.py");
    let out = Command::new("python3").args([script, "--self-test"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("self-test: ok"), "{text}");
}
