//! Running the real `moe-lanes` binary from tests (shared by the CLI test files).
#![allow(dead_code)]

pub mod server;

use std::path::Path;
use std::process::{Command, Output};

pub fn command() -> Command {
    Command::new(env!("CARGO_BIN_EXE_moe-lanes"))
}

pub fn moe_lanes(args: &[&str]) -> Output {
    command().args(args).output().expect("binary runs")
}

pub fn ok_stdout(args: &[&str]) -> String {
    let out = moe_lanes(args);
    assert!(out.status.success(), "{args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// Run, expect a clean failure (non-zero exit, no panic); returns stderr.
pub fn failure_of(out: Output, what: &str) -> String {
    assert!(!out.status.success(), "{what} should fail");
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!stderr.contains("panicked"), "{what} panicked: {stderr}");
    assert_eq!(out.status.code(), Some(1), "{what}: exit code 1 (an error), not a crash: {stderr}");
    stderr
}

pub fn failure(args: &[&str]) -> String {
    failure_of(moe_lanes(args), &format!("{args:?}"))
}

pub fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}
