//! Tidy: the invariants of ARCHITECTURE.md that a reviewer would otherwise have to remember.
//! Each check names the file and line that breaks it.
//! - kernels know nothing of the library (no `moe_lanes::`, no dependency on the root package);
//! - the library knows nothing of the CLI or HTTP (no clap, anyhow, indicatif, axum, hyper in
//!   `src/` or `actors/`, none in the library's dependencies, checked with `cargo tree` too);
//! - only the engines use the actors;
//! - the oracle shares no arithmetic with the fast paths (`src/reference.rs` imports none);
//! - `unsafe` lives in `kernels/` (FFI) and at the two mmap calls, each with a `SAFETY:` comment;
//! - functions stay short enough to see whole (the CLI and the library under 120 lines).

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() && !p.ends_with("target") && !p.ends_with("fixtures") {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

fn rel(p: &Path) -> String {
    p.strip_prefix(root()).unwrap_or(p).display().to_string()
}

/// Lines of `files` (outside comments) that contain any of `needles`, as "file:line: text".
fn offending(files: &[PathBuf], needles: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(f).unwrap();
        for (i, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code.starts_with("//") {
                continue;
            }
            if needles.iter().any(|n| code.contains(n)) {
                out.push(format!("{}:{}: {}", rel(f), i + 1, line.trim()));
            }
        }
    }
    out
}

fn assert_none(what: &str, found: Vec<String>) {
    assert!(found.is_empty(), "{what}:\n{}", found.join("\n"));
}

#[test]
fn kernels_know_nothing_of_the_library() {
    let files = rust_files(&root().join("kernels"));
    assert!(!files.is_empty());
    assert_none("kernels/ uses the library", offending(&files, &["moe_lanes::", "extern crate moe_lanes"]));
    let manifest = std::fs::read_to_string(root().join("kernels/Cargo.toml")).unwrap();
    assert!(
        !manifest.lines().any(|l| l.trim_start().starts_with("moe-lanes ")),
        "kernels/Cargo.toml depends on moe-lanes"
    );
}

#[test]
fn kernels_read_no_environment() {
    let files = rust_files(&root().join("kernels/src"));
    assert_none(
        "kernels/ reads environment variables (read them in src/env.rs and pass config down)",
        offending(&files, &["env::var", "env::set_var"]),
    );
}

#[test]
fn the_library_reads_the_environment_in_one_module() {
    let mut files = rust_files(&root().join("src"));
    files.extend(rust_files(&root().join("actors")));
    let mut found = offending(&files, &["env::var"]);
    found.retain(|l| !l.starts_with("src/env.rs"));
    assert_none("environment read outside src/env.rs", found);
}

#[test]
fn the_library_knows_nothing_of_the_cli_or_http() {
    let mut files = rust_files(&root().join("src"));
    files.extend(rust_files(&root().join("actors")));
    let needles =
        ["clap::", "anyhow::", "indicatif::", "axum::", "hyper::", "use clap", "use anyhow", "use axum"];
    assert_none("the library uses CLI or HTTP crates", offending(&files, &needles));
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let deps = manifest.split("[dependencies]").nth(1).unwrap().split("\n[").next().unwrap();
    for name in ["clap", "anyhow", "indicatif", "axum"] {
        assert!(
            !deps.lines().any(|l| l.trim_start().starts_with(&format!("{name} "))),
            "the library depends on {name}"
        );
    }
}

#[test]
fn cargo_tree_of_the_library_has_no_cli_crates() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args(["tree", "-p", "moe-lanes", "-e", "normal", "--prefix", "none", "--offline"])
        .current_dir(root())
        .output();
    let out = match out {
        Ok(o) if o.status.success() => String::from_utf8(o.stdout).unwrap(),
        Ok(o) => return eprintln!("SKIP: cargo tree failed: {}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => return eprintln!("SKIP: cargo not runnable: {e}"),
    };
    let bad: Vec<&str> =
        out.lines().filter(|l| ["clap ", "anyhow ", "indicatif "].iter().any(|n| l.starts_with(n))).collect();
    assert!(bad.is_empty(), "cargo tree -p moe-lanes -e normal shows {bad:?}");
}

#[test]
fn only_the_engines_use_the_actors() {
    let files = rust_files(&root().join("src"));
    let allowed = ["src/lib.rs", "src/moe/pipeline.rs", "src/engine/"];
    let mut found = offending(&files, &["crate::actors", "moe_lanes::actors"]);
    found.retain(|l| !allowed.iter().any(|a| l.starts_with(a)));
    assert_none("a module outside the engines uses the actors", found);
}

#[test]
fn the_oracle_shares_no_arithmetic_with_the_fast_paths() {
    let files = [root().join("src/reference.rs")];
    let needles = [
        "crate::moe",
        "crate::gpu",
        "crate::engine",
        "crate::actors",
        "moe_lanes_kernels",
        "crate::expert_math",
        "crate::routing",
        "crate::worklist",
        "crate::pipeline",
    ];
    assert_none("src/reference.rs imports a fast path", offending(&files, &needles));
}

#[test]
fn unsafe_only_in_kernels_and_mmap_each_with_a_safety_comment() {
    let mut files = rust_files(&root().join("src"));
    for d in ["actors", "cli", "tests", "benches"] {
        files.extend(rust_files(&root().join(d)));
    }
    let mmap_ok = ["src/format/gguf.rs", "src/format/safetensors.rs"];
    let mut found = offending(&files, &["unsafe {", "unsafe fn", "unsafe impl"]);
    found.retain(|l| !l.starts_with("tests/tidy.rs") && !mmap_ok.iter().any(|ok| l.starts_with(ok)));
    assert_none("`unsafe` outside kernels/ and the mmap calls", found);
    let mut all = rust_files(&root().join("kernels"));
    all.extend(mmap_ok.iter().map(|f| root().join(f)));
    let mut missing = Vec::new();
    for f in &all {
        let text = std::fs::read_to_string(f).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let code = line.trim_start();
            if code.starts_with("//")
                || !["unsafe {", "unsafe fn", "unsafe impl"].iter().any(|n| code.contains(n))
            {
                continue;
            }
            let above = &lines[i.saturating_sub(6)..i];
            if !above.iter().any(|l| l.contains("SAFETY") || l.contains("# Safety"))
                && !code.contains("SAFETY")
            {
                missing.push(format!("{}:{}: {}", rel(f), i + 1, line.trim()));
            }
        }
    }
    assert_none("`unsafe` without a SAFETY comment in the 6 lines above", missing);
}

#[test]
fn functions_are_short_enough_to_see_whole() {
    let mut files = rust_files(&root().join("src"));
    files.extend(rust_files(&root().join("actors")));
    files.extend(rust_files(&root().join("cli/src")));
    let mut long = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let mut i = 0;
        while i < lines.len() {
            let l = lines[i].trim_start();
            let is_fn = ["fn ", "pub fn ", "pub(crate) fn ", "async fn ", "pub async fn "]
                .iter()
                .any(|p| l.starts_with(p));
            if is_fn && !l.trim_end().ends_with(';') {
                let (start, mut depth, mut seen) = (i, 0i64, false);
                while i < lines.len() {
                    depth += lines[i].matches('{').count() as i64 - lines[i].matches('}').count() as i64;
                    seen |= lines[i].contains('{');
                    if seen && depth <= 0 {
                        break;
                    }
                    i += 1;
                }
                if i - start > MAX_FN_LINES && !LONG_FN_ALLOWED.iter().any(|a| rel(f) == *a) {
                    long.push(format!("{}:{} ({} lines)", rel(f), start + 1, i - start));
                }
            }
            i += 1;
        }
    }
    assert_none(&format!("functions over {MAX_FN_LINES} lines (split them into named steps)"), long);
}

const MAX_FN_LINES: usize = 120;
/// Files whose long functions predate this check; to split.
const LONG_FN_ALLOWED: [&str; 0] = [];

fn version(v: &str) -> (u32, u32, u32) {
    let mut parts = v.trim().split('.').map(|x| x.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

/// `rust-version = "…"` of a manifest's text, if it declares one.
fn rust_version_of(manifest: &str) -> Option<(u32, u32, u32)> {
    manifest.lines().find_map(|l| {
        let l = l.trim();
        let rest = l.strip_prefix("rust-version")?.trim_start().strip_prefix('=')?;
        Some(version(rest.trim().trim_matches('"')))
    })
}

/// The stated MSRV is true: no locked registry dependency needs a newer Rust. Reads the
/// dependency sources cargo unpacked for this build (offline; crates not unpacked are skipped).
#[test]
fn the_stated_rust_version_covers_every_locked_dependency() {
    let ours = rust_version_of(&std::fs::read_to_string(root().join("Cargo.toml")).unwrap())
        .expect("workspace rust-version");
    let lock = std::fs::read_to_string(root().join("Cargo.lock")).unwrap();
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    let Some(src) = home.map(|h| h.join("registry/src")) else { return eprintln!("SKIP: no cargo home") };
    let indexes: Vec<PathBuf> =
        std::fs::read_dir(&src).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    let (mut checked, mut newer) = (0, Vec::new());
    for block in lock.split("[[package]]").skip(1) {
        let field = |k: &str| {
            block.lines().find_map(|l| l.strip_prefix(k).map(|v| v.trim().trim_matches('"').to_string()))
        };
        let (Some(name), Some(ver)) = (field("name = "), field("version = ")) else { continue };
        let Some(manifest) =
            indexes.iter().map(|i| i.join(format!("{name}-{ver}/Cargo.toml"))).find(|p| p.exists())
        else {
            continue;
        };
        checked += 1;
        if let Some(need) = rust_version_of(&std::fs::read_to_string(manifest).unwrap()) {
            if need > ours {
                newer.push(format!("{name} {ver} needs {}.{}.{}", need.0, need.1, need.2));
            }
        }
    }
    eprintln!("rust-version {}.{}: {checked} locked dependencies checked", ours.0, ours.1);
    assert!(
        newer.is_empty(),
        "Cargo.toml says rust-version {}.{}, but:\n{}",
        ours.0,
        ours.1,
        newer.join("\n")
    );
}
