//! (In the server package: it alone depends on every parser a target reaches.)
//! Replays the fuzz corpora through the fuzz targets in plain `cargo test` (no AFL++ needed):
//! every seed (real files: synthetic GGUF and safetensors models, learn files, perf snapshots,
//! hot-expert lists) and every input the fuzzer ever crashed on (`fuzz/regressions/<target>/`,
//! kept after the fix) must run through its parser without a panic.

#[path = "../../fuzz/targets.rs"]
mod targets;

use std::path::PathBuf;

fn inputs(kind: &str, target: &str) -> Vec<PathBuf> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("server/ is in the repository");
    let dir = root.join("fuzz").join(kind).join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().is_some_and(|n| n != ".keep"))
        .collect();
    files.sort();
    files
}

#[test]
fn every_seed_and_every_past_crash_runs_clean() {
    for (target, run) in targets::TARGETS {
        let seeds = inputs("seeds", target);
        assert!(!seeds.is_empty(), "{target}: the seed corpus is empty");
        for path in seeds.iter().chain(&inputs("regressions", target)) {
            let data = std::fs::read(path).unwrap();
            run(&data);
        }
    }
}

#[test]
fn truncations_of_every_seed_run_clean() {
    // A cheap stand-in for the fuzzer in CI: every prefix length at a stride, and each byte flipped.
    for (target, run) in targets::TARGETS {
        for path in inputs("seeds", target) {
            let data = std::fs::read(&path).unwrap();
            let stride = (data.len() / 512).max(1);
            for len in (0..data.len()).step_by(stride) {
                run(&data[..len]);
            }
            for i in (0..data.len()).step_by(stride) {
                let mut flipped = data.clone();
                flipped[i] ^= 0xff;
                run(&flipped);
            }
        }
    }
}
