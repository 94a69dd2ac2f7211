//! The helper scripts that recipes call: `scripts/bench-table.py` formats bench reports and
//! names the file that is not one. Skips (saying so) where python3 is missing.

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
