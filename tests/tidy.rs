//! Tidy: the invariants of ARCHITECTURE.md that a reviewer would otherwise have to remember.
//! Each check names the file and line that breaks it.
//! - kernels know nothing of the library (no `moe_lanes` crate, no dependency on the root package);
//! - the library knows nothing of the CLI or HTTP (no clap, anyhow, indicatif, axum, hyper in
//!   `src/` or `actors/`, none in the library's dependencies, checked with `cargo tree` too);
//! - only the engines use the actors;
//! - no import cycles among the top-level modules of `src/` (test code left out);
//! - the oracle shares no arithmetic with the fast paths (`src/reference.rs` imports none);
//! - `unsafe` lives in `kernels/` (FFI, SIMD) and at the two mmap calls, each with a `SAFETY:`
//!   comment just above;
//! - functions stay short enough to see whole (the CLI and the library under 120 lines).
//!
//! The checks read code, not text: comments are dropped and string and char literals blanked
//! first ([`code_lines`]), so a message that says "unsafe" or a `"{"` never counts; names match
//! whole identifiers, so `moe_lanes_kernels` is not `moe_lanes`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `dir`, sorted; build output and test fixtures are skipped.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if p.is_dir() && !["target", "fixtures"].contains(&name.as_str()) && !name.starts_with('.') {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// A source file as the checks see it.
struct Source {
    /// Path relative to the repository root, with `/` separators.
    rel: String,
    /// The lines as written (comments included: the SAFETY check reads them).
    raw: Vec<String>,
    /// The same lines with comments removed and literal contents blanked.
    code: Vec<String>,
}

impl Source {
    fn load(path: &Path) -> Source {
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let rel = path.strip_prefix(root()).unwrap_or(path).components();
        let rel = rel.map(|c| c.as_os_str().to_string_lossy().into_owned()).collect::<Vec<_>>().join("/");
        Source { rel, raw: split_lines(&text), code: code_lines(&text) }
    }

    /// "file:line: text" for the 0-based line `i`.
    fn at(&self, i: usize) -> String {
        format!("{}:{}: {}", self.rel, i + 1, self.raw[i].trim())
    }

    fn file_name(&self) -> &str {
        self.rel.rsplit('/').next().unwrap_or(&self.rel)
    }
}

/// The sources under each of `dirs` (relative to the root).
fn sources(dirs: &[&str]) -> Vec<Source> {
    dirs.iter().flat_map(|d| rust_files(&root().join(d))).map(|p| Source::load(&p)).collect()
}

fn split_lines(text: &str) -> Vec<String> {
    text.split('\n').map(|l| l.trim_end_matches('\r').to_string()).collect()
}

fn assert_none(what: &str, found: Vec<String>) {
    assert!(found.is_empty(), "{what}:\n{}", found.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// Reading code: comments out, literals blanked, identifiers and `crate::` paths.

/// What the scanner is inside of.
#[derive(Clone, Copy, PartialEq)]
enum Lexeme {
    Code,
    LineComment,
    BlockComment(u32),
    Str,
    RawStr(usize),
}

/// `text` split into lines with comments removed and the contents of string and char literals
/// blanked (the quotes stay); line numbers are kept.
fn code_lines(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let (mut out, mut state, mut i) = (String::with_capacity(text.len()), Lexeme::Code, 0);
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            out.push('\n');
            if state == Lexeme::LineComment {
                state = Lexeme::Code;
            }
            i += 1;
            continue;
        }
        (state, i) = match state {
            Lexeme::Code => code_step(&chars, i, &mut out),
            Lexeme::LineComment => (state, i + 1),
            Lexeme::BlockComment(depth) => block_comment_step(&chars, i, depth),
            Lexeme::Str => str_step(&chars, i, &mut out),
            Lexeme::RawStr(hashes) => raw_str_step(&chars, i, hashes, &mut out),
        };
    }
    split_lines(&out)
}

fn code_step(chars: &[char], i: usize, out: &mut String) -> (Lexeme, usize) {
    let at = |k: usize| chars.get(i + k).copied().unwrap_or('\0');
    let is_ident = |k: usize| chars[k].is_alphanumeric() || chars[k] == '_';
    // `r"…"` and `br"…"` open raw strings; `xr"` or `abr"` are identifiers followed by a string.
    let after_ident = i > 0 && is_ident(i - 1) && !(chars[i - 1] == 'b' && (i < 2 || !is_ident(i - 2)));
    match (at(0), at(1)) {
        ('/', '/') => (Lexeme::LineComment, i + 2),
        ('/', '*') => (Lexeme::BlockComment(1), i + 2),
        ('"', _) => {
            out.push('"');
            (Lexeme::Str, i + 1)
        }
        ('r', '#' | '"') if !after_ident => match raw_str_open(chars, i + 1) {
            Some((hashes, next)) => {
                out.push('"');
                (Lexeme::RawStr(hashes), next)
            }
            None => {
                out.push('r');
                (Lexeme::Code, i + 1)
            }
        },
        ('\'', _) => (Lexeme::Code, char_literal(chars, i, out)),
        (c, _) => {
            out.push(c);
            (Lexeme::Code, i + 1)
        }
    }
}

/// After an `r` at `i - 1`: `#`* then `"` opens a raw string; its hash count and first index.
fn raw_str_open(chars: &[char], i: usize) -> Option<(usize, usize)> {
    let hashes = chars[i..].iter().take_while(|&&c| c == '#').count();
    (chars.get(i + hashes) == Some(&'"')).then_some((hashes, i + hashes + 1))
}

/// A `'` at `i`: a char literal (`'x'`, `'\n'`, `'\u{7f}'`) is written as `''`; a lifetime or
/// label (`'a`) is kept. Returns the index after it.
fn char_literal(chars: &[char], i: usize, out: &mut String) -> usize {
    let end = if chars.get(i + 1) == Some(&'\\') {
        chars.get(i + 3..).and_then(|t| t.iter().position(|&c| c == '\'')).map(|p| i + 3 + p)
    } else {
        (chars.get(i + 2) == Some(&'\'')).then_some(i + 2)
    };
    match end {
        Some(end) => {
            out.push_str("''");
            end + 1
        }
        None => {
            out.push('\'');
            i + 1
        }
    }
}

fn block_comment_step(chars: &[char], i: usize, depth: u32) -> (Lexeme, usize) {
    match (chars[i], chars.get(i + 1).copied()) {
        ('*', Some('/')) if depth == 1 => (Lexeme::Code, i + 2),
        ('*', Some('/')) => (Lexeme::BlockComment(depth - 1), i + 2),
        ('/', Some('*')) => (Lexeme::BlockComment(depth + 1), i + 2),
        _ => (Lexeme::BlockComment(depth), i + 1),
    }
}

fn str_step(chars: &[char], i: usize, out: &mut String) -> (Lexeme, usize) {
    match chars[i] {
        '\\' if chars.get(i + 1) == Some(&'\n') => (Lexeme::Str, i + 1),
        '\\' => (Lexeme::Str, i + 2),
        '"' => {
            out.push('"');
            (Lexeme::Code, i + 1)
        }
        _ => (Lexeme::Str, i + 1),
    }
}

fn raw_str_step(chars: &[char], i: usize, hashes: usize, out: &mut String) -> (Lexeme, usize) {
    let closes = chars[i] == '"' && (1..=hashes).all(|k| chars.get(i + k) == Some(&'#'));
    if closes {
        out.push('"');
        (Lexeme::Code, i + 1 + hashes)
    } else {
        (Lexeme::RawStr(hashes), i + 1)
    }
}

/// The identifiers (and keywords) of a code line with their byte offsets.
fn idents(code: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let mut start = None;
    for (i, c) in code.char_indices().chain([(code.len(), ' ')]) {
        let word = c.is_alphanumeric() || c == '_';
        match (word, start) {
            (true, None) => start = Some(i),
            (false, Some(s)) => {
                out.push((s, &code[s..i]));
                start = None;
            }
            _ => {}
        }
    }
    out
}

fn has_ident(code: &str, names: &[&str]) -> bool {
    idents(code).iter().any(|(_, w)| names.contains(w))
}

/// Lines of `files` whose code names any of `names` as a whole identifier, as "file:line: text".
fn naming(files: &[Source], names: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    for s in files {
        out.extend((0..s.code.len()).filter(|&i| has_ident(&s.code[i], names)).map(|i| s.at(i)));
    }
    out
}

/// Lines of `files` whose code contains any of `needles`, as "file:line: text".
fn containing(files: &[Source], needles: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    for s in files {
        let hit = |i: &usize| needles.iter().any(|n| s.code[*i].contains(n));
        out.extend((0..s.code.len()).filter(hit).map(|i| s.at(i)));
    }
    out
}

/// The top-level modules a source reaches through `crate::` paths, with the 0-based line of each:
/// `crate::moe::routing` gives `moe`; `use crate::{format::x, moe::{a, b}}` gives `format` and
/// `moe` (groups may span lines).
fn crate_modules(s: &Source) -> Vec<(usize, String)> {
    let text = s.code.join("\n");
    let line_of = |byte: usize| text[..byte].matches('\n').count();
    let mut out = Vec::new();
    for (at, _) in text.match_indices("crate::") {
        let before = text[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // `moe_lanes_crate::`, not a `crate::` path
        }
        let rest = &text[at + "crate::".len()..];
        let base = at + "crate::".len();
        out.extend(first_segments(rest).into_iter().map(|(off, m)| (line_of(base + off), m)));
    }
    out
}

/// The first path segment(s) at the start of `rest`: one identifier, or for a `{...}` group the
/// identifier that starts each of its top-level items. Offsets are into `rest`.
fn first_segments(rest: &str) -> Vec<(usize, String)> {
    let trimmed = rest.trim_start();
    let skip = rest.len() - trimmed.len();
    if !trimmed.starts_with('{') {
        let name: String = trimmed.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        return vec![(skip, name)];
    }
    let (mut out, mut depth, mut item_start) = (Vec::new(), 0, true);
    for (i, c) in trimmed.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 1 => break,
            '}' => depth -= 1,
            ',' if depth == 1 => item_start = true,
            c if item_start && depth == 1 && (c.is_alphanumeric() || c == '_') => {
                let name: String =
                    trimmed[i..].chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                out.push((skip + i, name));
                item_start = false;
            }
            _ => {}
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Manifests.

/// One dependency a manifest declares: its 1-based line, its table (`dependencies`,
/// `dev-dependencies`, `target.'cfg(unix)'.dependencies`, ...) and the package it names.
struct Dep {
    line: usize,
    table: String,
    package: String,
}

impl Dep {
    /// A dependency of the package's own code (not a dev- or build-dependency).
    fn is_normal(&self) -> bool {
        self.table.rsplit('.').next() == Some("dependencies")
    }
}

/// The dependencies of a Cargo.toml: `name = ...` lines of dependency tables (the package of
/// `alias = { package = "real" }` is `real`) and `[dependencies.name]` headers. The workspace's
/// shared `[workspace.dependencies]` are not dependencies of any package and are left out.
fn dependencies(manifest: &str) -> Vec<Dep> {
    let (mut table, mut out) = (String::new(), Vec::new());
    for (i, line) in manifest.lines().enumerate() {
        let l = line.split('#').next().unwrap_or("").trim();
        if let Some(header) = l.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
            table = header.trim().to_string();
            out.extend(dependency_header(&table, i + 1));
            continue;
        }
        let Some((key, value)) = l.split_once('=') else { continue };
        let key = key.trim().trim_matches('"');
        if is_dependency_table(&table) {
            let package = package_key(value).unwrap_or_else(|| key.to_string());
            out.push(Dep { line: i + 1, table: table.clone(), package });
        } else if key == "package" && dependency_header(&table, 0).is_some() {
            // `[dependencies.alias]` then `package = "real"`: the header's dependency is `real`.
            let last = out.last_mut().expect("the header's dependency");
            last.package = value.trim().trim_matches('"').to_string();
        }
    }
    out
}

/// The dependency a `[dependencies.name]` (or `[target.….dependencies.name]`) header declares.
fn dependency_header(table: &str, line: usize) -> Option<Dep> {
    let (t, name) = table.rsplit_once('.').filter(|(t, _)| is_dependency_table(t))?;
    Some(Dep { line, table: t.to_string(), package: name.trim_matches('"').to_string() })
}

fn is_dependency_table(table: &str) -> bool {
    let last = table.rsplit('.').next().unwrap_or(table);
    !table.starts_with("workspace.")
        && ["dependencies", "dev-dependencies", "build-dependencies"].contains(&last)
}

/// `real` from an inline table `{ package = "real", ... }`.
fn package_key(value: &str) -> Option<String> {
    let (_, after) = value.split_once("package")?;
    let quoted = after.trim_start().strip_prefix('=')?.trim_start().strip_prefix('"')?;
    Some(quoted.split('"').next()?.to_string())
}

fn manifest(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

// ---------------------------------------------------------------------------------------------
// `unsafe` and its SAFETY comments.

/// How far above a group of statements its one SAFETY comment may stand (no blank line between):
/// the SIMD kernels cover a few pointer reads with one comment.
const SAFETY_REACH: usize = 6;

/// The files outside kernels/ that may hold `unsafe`, by file name (wherever src/ puts them), and
/// the call each `unsafe` there must make: memory-mapping a model file.
const MMAP_FILES: [&str; 2] = ["gguf.rs", "safetensors.rs"];
const MMAP_CALL: &str = "Mmap::map";

/// 0-based lines whose code uses the `unsafe` keyword (blocks, fns, impls, traits, attributes).
fn unsafe_lines(s: &Source) -> Vec<usize> {
    (0..s.code.len()).filter(|&i| has_ident(&s.code[i], &["unsafe"])).collect()
}

fn unsafe_allowed(s: &Source, i: usize) -> bool {
    let in_kernels = s.rel.starts_with("kernels/");
    let mmap =
        s.rel.starts_with("src/") && MMAP_FILES.contains(&s.file_name()) && s.code[i].contains(MMAP_CALL);
    in_kernels || mmap
}

fn says_safety(line: &str) -> bool {
    let comment = line.split_once("//").map_or("", |(_, c)| c);
    comment.contains("SAFETY") || comment.contains("# Safety")
}

/// Whether the `unsafe` on line `i` has its SAFETY comment: on the line itself; in the comment
/// and attribute lines directly above it (an `unsafe fn`'s doc `# Safety` section, however long
/// the doc); or at most [`SAFETY_REACH`] lines above with no blank line between (one comment
/// over a group of statements).
fn has_safety_comment(raw: &[String], i: usize) -> bool {
    if says_safety(&raw[i]) {
        return true;
    }
    let annotation = |l: &str| ["//", "#[", "#!["].iter().any(|p| l.trim_start().starts_with(p));
    let block = raw[..i].iter().rev().take_while(|l| annotation(l));
    if block.clone().any(|l| says_safety(l)) {
        return true;
    }
    let paragraph = raw[i.saturating_sub(SAFETY_REACH)..i].iter().rev().take_while(|l| !l.trim().is_empty());
    paragraph.clone().any(|l| says_safety(l))
}

// ---------------------------------------------------------------------------------------------
// Function length.

const MAX_FN_LINES: usize = 120;

/// Files (relative paths) whose long functions predate this check; to split. Empty: keep it so.
const LONG_FN_ALLOWED: [&str; 0] = [];

/// Whether a code line starts a function: `fn`, after any visibility and qualifiers.
fn is_fn_start(code: &str) -> bool {
    let mut rest = code.trim_start();
    if let Some(r) = rest.strip_prefix("pub") {
        rest = r.trim_start();
        if rest.starts_with('(') {
            rest = rest.split_once(')').map_or(rest, |(_, r)| r).trim_start();
        }
    }
    let qualifiers = ["const ", "async ", "unsafe ", "default ", "extern \"\" ", "extern "];
    while let Some(q) = qualifiers.iter().find(|q| rest.starts_with(**q)) {
        rest = rest[q.len()..].trim_start();
    }
    rest.starts_with("fn ")
}

/// The 0-based line that closes the body of the function starting on line `start`, or `None`
/// for a declaration without a body (`fn f();` in a trait or an `extern` block).
fn body_end(code: &[String], start: usize) -> Option<usize> {
    let (mut braces, mut nesting, mut opened) = (0i64, 0i64, false);
    for (i, line) in code.iter().enumerate().skip(start) {
        for c in line.chars() {
            match c {
                '{' => (braces, opened) = (braces + 1, true),
                '}' => braces -= 1,
                '(' | '[' => nesting += 1,
                ')' | ']' => nesting -= 1,
                ';' if !opened && nesting == 0 => return None,
                _ => {}
            }
            if opened && braces == 0 {
                return Some(i);
            }
        }
    }
    None
}

/// (0-based first line, length in lines) of every function with a body; a function nested in
/// another counts as part of it.
fn functions(code: &[String]) -> Vec<(usize, usize)> {
    let (mut out, mut i) = (Vec::new(), 0);
    while i < code.len() {
        if let Some(end) = is_fn_start(&code[i]).then(|| body_end(code, i)).flatten() {
            out.push((i, end - i + 1));
            i = end;
        }
        i += 1;
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The checks.

#[test]
fn kernels_know_nothing_of_the_library() {
    let files = sources(&["kernels"]);
    assert!(files.iter().any(|s| s.rel == "kernels/src/lib.rs"), "kernels/ not found");
    assert_none("kernels/ uses the library (kernels are compute only)", naming(&files, &["moe_lanes"]));
    let deps = dependencies(&manifest("kernels/Cargo.toml"));
    let back: Vec<String> = deps
        .iter()
        .filter(|d| d.package == "moe-lanes")
        .map(|d| format!("kernels/Cargo.toml:{}: [{}] moe-lanes", d.line, d.table))
        .collect();
    assert_none("kernels/ depends on the library", back);
}

#[test]
fn kernels_read_no_environment() {
    let files = sources(&["kernels/src"]);
    assert_none(
        "kernels/ reads environment variables (read them in src/env.rs and pass config down)",
        containing(&files, &["env::var", "env::set_var"]),
    );
}

#[test]
fn the_library_reads_the_environment_in_one_module() {
    let mut found = containing(&sources(&["src", "actors"]), &["env::var"]);
    found.retain(|l| !l.starts_with("src/env.rs:"));
    assert_none("environment read outside src/env.rs", found);
}

/// Crates of the CLI and of HTTP serving, which the library a service embeds must not pull in.
const NOT_IN_THE_LIBRARY: [&str; 5] = ["clap", "anyhow", "indicatif", "axum", "hyper"];

#[test]
fn the_library_knows_nothing_of_the_cli_or_http() {
    let found = naming(&sources(&["src", "actors"]), &NOT_IN_THE_LIBRARY);
    assert_none("the library uses a CLI or HTTP crate (they belong in cli/)", found);
    let deps = dependencies(&manifest("Cargo.toml"));
    let listed: Vec<String> = deps
        .iter()
        .filter(|d| d.is_normal() && NOT_IN_THE_LIBRARY.contains(&d.package.as_str()))
        .map(|d| format!("Cargo.toml:{}: [{}] {}", d.line, d.table, d.package))
        .collect();
    assert_none("the library package depends on a CLI or HTTP crate (move it to cli/Cargo.toml)", listed);
}

#[test]
fn cargo_tree_of_the_library_has_no_cli_crates() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args(["tree", "-p", "moe-lanes", "-e", "normal", "--prefix", "none", "--offline"])
        .current_dir(root())
        .output();
    let out = match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
        Ok(o) => return eprintln!("SKIP: cargo tree failed: {}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => return eprintln!("SKIP: cargo not runnable: {e}"),
    };
    let bad: Vec<&str> =
        out.lines().filter(|l| ["clap ", "anyhow ", "indicatif "].iter().any(|n| l.starts_with(n))).collect();
    assert!(bad.is_empty(), "cargo tree -p moe-lanes -e normal shows {bad:?}");
}

/// The modules that drive the actors: the CPU lane pipeline and the engines (and the crate root,
/// which declares them).
const ACTOR_USERS: [&str; 3] = ["src/lib.rs", "src/moe/pipeline.rs", "src/engine/"];

#[test]
fn only_the_engines_use_the_actors() {
    let mut found = Vec::new();
    for s in sources(&["src"]).iter().filter(|s| !ACTOR_USERS.iter().any(|a| s.rel.starts_with(a))) {
        found.extend(crate_modules(s).into_iter().filter(|(_, m)| m == "actors").map(|(i, _)| s.at(i)));
    }
    assert_none("a module outside the engines uses the actors", found);
}

/// What the oracle may not reach: the fast paths (under `moe/`, with their flat re-exports), the
/// GPU, the engines, the actors and the kernels crate.
const FAST_PATHS: [&str; 9] =
    ["moe", "gpu", "engine", "actors", "expert_math", "phase", "pipeline", "routing", "worklist"];

#[test]
fn the_oracle_shares_no_arithmetic_with_the_fast_paths() {
    let mut files: Vec<Source> = sources(&["src/reference"]);
    if root().join("src/reference.rs").exists() {
        files.push(Source::load(&root().join("src/reference.rs")));
    }
    assert!(!files.is_empty(), "the oracle (src/reference.rs or src/reference/) not found");
    let mut found = naming(&files, &["moe_lanes_kernels", "moe_lanes"]);
    for s in &files {
        let fast = crate_modules(s).into_iter().filter(|(_, m)| FAST_PATHS.contains(&m.as_str()));
        found.extend(fast.map(|(i, _)| s.at(i)));
    }
    assert_none("the oracle imports a fast path (it keeps its own arithmetic)", found);
}

/// The model as data: the engines walk each layer's spec and never ask which architecture they
/// run (`Arch`, the adapter table), so a new architecture made of existing kinds is one file in
/// `src/model/arch/`.
#[test]
fn engines_never_ask_which_architecture_they_run() {
    let mut files = sources(&["src/moe", "src/gpu", "src/engine", "src/cache", "actors"]);
    files.push(Source::load(&root().join("src/reference.rs")));
    let found = naming(&files, &["Arch", "ADAPTERS", "adapter"]);
    assert_none("an engine names an architecture (read the layer's spec from Model::plan instead)", found);
}

/// The GPU engine is a backend below `engine/`: it imports the forward-call vocabulary from
/// `crate::forward`, never from the engine layer above it.
#[test]
fn the_gpu_backend_does_not_import_the_engine_layer() {
    let mut found = Vec::new();
    for s in &sources(&["src/gpu"]) {
        found.extend(crate_modules(s).into_iter().filter(|(_, m)| m == "engine").map(|(i, _)| s.at(i)));
    }
    assert_none("src/gpu imports crate::engine (take the type from crate::forward)", found);
}

/// `unsafe` items that predate the "directly above" rule and have no SAFETY comment or `# Safety`
/// doc of their own: (file, start of the line). To document; kernels/ is edited on its own branch.
const SAFETY_UNDOCUMENTED: [(&str, &str); 1] =
    [("kernels/src/x86_avx512.rs", "unsafe fn tile_bf16dot_shapes(")];

fn undocumented_allowed(s: &Source, i: usize) -> Option<usize> {
    SAFETY_UNDOCUMENTED.iter().position(|(f, l)| s.rel == *f && s.raw[i].trim_start().starts_with(l))
}

#[test]
fn unsafe_only_in_kernels_and_mmap_each_with_a_safety_comment() {
    let (mut misplaced, mut unexplained) = (Vec::new(), Vec::new());
    let mut excused = [false; SAFETY_UNDOCUMENTED.len()];
    for path in rust_files(&root()) {
        let s = Source::load(&path);
        for i in unsafe_lines(&s) {
            if !unsafe_allowed(&s, i) {
                misplaced.push(s.at(i));
            }
            if has_safety_comment(&s.raw, i) {
                continue;
            }
            match undocumented_allowed(&s, i) {
                Some(k) => excused[k] = true,
                None => unexplained.push(s.at(i)),
            }
        }
    }
    assert_none(
        &format!("`unsafe` outside kernels/ and the `{MMAP_CALL}` calls in {MMAP_FILES:?}"),
        misplaced,
    );
    assert_none(
        &format!(
            "`unsafe` without a `// SAFETY:` comment (or `/// # Safety` doc) directly above, or within \
             {SAFETY_REACH} lines above in the same paragraph"
        ),
        unexplained,
    );
    let stale = SAFETY_UNDOCUMENTED.iter().zip(excused).filter(|(_, used)| !used);
    let stale: Vec<String> = stale.map(|((f, l), _)| format!("{f}: {l}")).collect();
    assert_none("SAFETY_UNDOCUMENTED lists items that are documented now or gone (remove them)", stale);
}

#[test]
fn functions_are_short_enough_to_see_whole() {
    let mut long = Vec::new();
    for s in sources(&["src", "actors", "cli/src"]) {
        if LONG_FN_ALLOWED.contains(&s.rel.as_str()) {
            continue;
        }
        let over = functions(&s.code).into_iter().filter(|&(_, n)| n > MAX_FN_LINES);
        long.extend(over.map(|(i, n)| format!("{} ({n} lines)", s.at(i))));
    }
    assert_none(&format!("functions over {MAX_FN_LINES} lines (split them into named steps)"), long);
}

// ---------------------------------------------------------------------------------------------
// Layering: no import cycles among the library's top-level modules.

/// The top-level module a library source belongs to: `src/x.rs` and `src/x/...` are `x`; the
/// actors (`actors/`, compiled as `moe::actors`) are `moe`. `None` for the crate root.
fn own_module(rel: &str) -> Option<String> {
    if rel.starts_with("actors/") {
        return Some("moe".into());
    }
    let rest = rel.strip_prefix("src/")?;
    let first = rest.split('/').next()?;
    (first != "lib.rs").then(|| first.strip_suffix(".rs").unwrap_or(first).to_string())
}

/// The crate root's re-exports (`pub use moe::{actors, pipeline};`, `arch as adapter`): each
/// name a `crate::` path may start with, and the top-level module it stands for.
fn root_reexports() -> Vec<(String, String)> {
    let lib = Source::load(&root().join("src/lib.rs"));
    let mut out = Vec::new();
    for stmt in lib.code.join("\n").split(';') {
        let Some((module, items)) = stmt.trim().strip_prefix("pub use ").and_then(|r| r.split_once("::"))
        else {
            continue;
        };
        let items = items.trim().trim_start_matches('{').trim_end_matches('}');
        for name in items.split(',').filter_map(|i| i.split(" as ").last()).map(str::trim) {
            if !name.is_empty() {
                out.push((name.to_string(), module.trim().to_string()));
            }
        }
    }
    out
}

/// `s` with its test-only code blanked: items under `#[cfg(test)]` or `#[cfg(all(test, ..))]`
/// (a test may reach any module for its fixtures).
fn without_tests(s: &Source) -> Source {
    let mut code = s.code.clone();
    let mut i = 0;
    while i < code.len() {
        let line = code[i].trim_start();
        if !(line.starts_with("#[cfg(test") || line.starts_with("#[cfg(all(test")) {
            i += 1;
            continue;
        }
        let (mut end, mut depth, mut opened) = (i + 1, 0i32, false);
        while end < code.len() {
            depth += code[end].matches('{').count() as i32 - code[end].matches('}').count() as i32;
            opened |= code[end].contains('{');
            end += 1;
            let item_ends = if opened { depth <= 0 } else { code[end - 1].trim_end().ends_with(';') };
            if item_ends {
                break;
            }
        }
        code[i..end].iter_mut().for_each(String::clear);
        i = end;
    }
    Source { rel: s.rel.clone(), raw: s.raw.clone(), code }
}

/// The library's import graph between top-level modules, test code left out: module -> modules
/// it imports, each edge with the first place it is made.
fn module_graph() -> BTreeMap<String, BTreeMap<String, String>> {
    let aliases = root_reexports();
    let files = sources(&["src", "actors"]);
    let modules: BTreeSet<String> = files.iter().filter_map(|s| own_module(&s.rel)).collect();
    let mut graph: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for s in files.iter().filter(|s| s.file_name() != "tests.rs") {
        let Some(from) = own_module(&s.rel) else { continue };
        let s = without_tests(s);
        for (i, name) in crate_modules(&s) {
            let to = aliases.iter().find(|(a, _)| *a == name).map_or(name, |(_, m)| m.clone());
            if to != from && modules.contains(&to) {
                let edges = graph.entry(from.clone()).or_default();
                edges.entry(to).or_insert_with(|| s.at(i));
            }
        }
    }
    graph
}

/// The strongly connected components of more than one module (Tarjan's algorithm).
fn cycles(graph: &BTreeMap<String, BTreeMap<String, String>>) -> Vec<Vec<String>> {
    struct Walk<'g> {
        graph: &'g BTreeMap<String, BTreeMap<String, String>>,
        index: BTreeMap<&'g str, (usize, usize)>,
        stack: Vec<&'g str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'g>(w: &mut Walk<'g>, v: &'g str) {
        let n = w.index.len();
        w.index.insert(v, (n, n));
        w.stack.push(v);
        for to in w.graph.get(v).into_iter().flat_map(|e| e.keys()) {
            let low = match w.index.get(to.as_str()) {
                None => {
                    visit(w, to);
                    w.index[to.as_str()].1
                }
                Some(&(idx, _)) if w.stack.contains(&to.as_str()) => idx,
                Some(_) => continue,
            };
            let entry = w.index.get_mut(v).expect("visited");
            entry.1 = entry.1.min(low);
        }
        if w.index[v].0 == w.index[v].1 {
            let at = w.stack.iter().position(|&m| m == v).expect("on the stack");
            let component: Vec<String> = w.stack.drain(at..).map(str::to_string).collect();
            if component.len() > 1 {
                w.out.push(component);
            }
        }
    }
    let mut w = Walk { graph, index: BTreeMap::new(), stack: Vec::new(), out: Vec::new() };
    for v in graph.keys() {
        if !w.index.contains_key(v.as_str()) {
            visit(&mut w, v);
        }
    }
    w.out
}

/// The top-level modules of `src/` form layers: no module imports, directly or through others,
/// a module that imports it (test code may reach any module). The layers, lowest first, are in
/// ARCHITECTURE.md.
#[test]
fn no_import_cycles_among_the_top_level_modules() {
    let graph = module_graph();
    assert!(graph.get("engine").is_some_and(|e| e.contains_key("moe")), "the graph reads the imports");
    let mut found = Vec::new();
    for component in cycles(&graph) {
        for from in &component {
            let edges = graph[from].iter().filter(|(to, _)| component.contains(to));
            found.extend(edges.map(|(to, at)| format!("{from} -> {to}: {at}")));
        }
    }
    assert_none("an import cycle among the top-level modules of src/ (cut one of these edges)", found);
}

#[test]
fn the_cycle_check_finds_a_cycle_and_skips_test_code() {
    let edge = |a: &str, b: &str| (a.to_string(), BTreeMap::from([(b.to_string(), String::new())]));
    let graph = BTreeMap::from([edge("a", "b"), edge("b", "c"), edge("c", "a"), edge("d", "a")]);
    assert_eq!(cycles(&graph), vec![vec!["a".to_string(), "b".into(), "c".into()]]);
    let text = "use crate::a::X;\n#[cfg(test)]\nmod tests {\n    use crate::b::Y;\n}\n#[cfg(all(test, unix))]\nuse crate::c::Z;\n";
    let s = Source { rel: "src/d.rs".into(), raw: split_lines(text), code: code_lines(text) };
    let reached: Vec<String> = crate_modules(&without_tests(&s)).into_iter().map(|(_, m)| m).collect();
    assert_eq!(reached, ["a"]);
    assert_eq!(own_module("actors/join.rs").as_deref(), Some("moe"));
    assert_eq!(own_module("src/moe/pipeline.rs").as_deref(), Some("moe"));
    assert_eq!(own_module("src/lib.rs"), None);
}

// ---------------------------------------------------------------------------------------------
// The stated MSRV.

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

// ---------------------------------------------------------------------------------------------
// The readers the checks rely on, on small inputs: a reader that misses things passes everything.

#[test]
fn code_lines_drop_comments_and_blank_literals() {
    let text = "let a = \"unsafe { // no\"; // unsafe\n/* unsafe /* nested */ still */ let b = '{';\n\
                let c: &'static str = r#\"clap \"quoted\" {\"#; fn f<'a>(x: &'a u8) {}\n\
                let d = b'}'; let e = '\\''; let g = br\"}\"; let h = \"a\\\"b{\";";
    let code = code_lines(text);
    assert_eq!(code.len(), 4, "line numbers are kept: {code:?}");
    assert_eq!(code[0].trim_end(), "let a = \"\";");
    assert_eq!(code[1].trim(), "let b = '';");
    assert!(
        code[2].contains("&'static str = \"\";") && code[2].contains("fn f<'a>(x: &'a u8) {}"),
        "{}",
        code[2]
    );
    assert_eq!(code[3], "let d = b''; let e = ''; let g = b\"\"; let h = \"\";");
    assert!(!code.iter().any(|l| has_ident(l, &["unsafe", "clap"])), "{code:?}");
    let braces = |c: char| code.iter().map(|l| l.matches(c).count()).sum::<usize>();
    assert_eq!((braces('{'), braces('}')), (1, 1), "only the fn body's braces are code: {code:?}");
}

#[test]
fn identifiers_match_whole_names() {
    assert!(has_ident("use moe_lanes::gguf;", &["moe_lanes"]));
    assert!(has_ident("extern crate moe_lanes as ml;", &["moe_lanes"]));
    assert!(!has_ident("use moe_lanes_kernels::scalar;", &["moe_lanes"]));
    assert!(!has_ident("#![forbid(unsafe_code)]", &["unsafe"]));
    assert!(has_ident("#[unsafe(no_mangle)]", &["unsafe"]));
}

#[test]
fn crate_modules_follow_groups_across_lines() {
    let s = Source {
        rel: "src/x.rs".into(),
        raw: Vec::new(),
        code: split_lines("use crate::format::gguf;\nuse crate::{\n    model::{a, routing},\n    moe::worklist,\n};\nlet x = my_crate::gpu::f(crate::engine::build());"),
    };
    let found: Vec<(usize, String)> = crate_modules(&s);
    let expected = [(0, "format"), (2, "model"), (3, "moe"), (5, "engine")];
    assert_eq!(found, expected.map(|(i, m)| (i, m.to_string())));
}

#[test]
fn dependencies_are_read_from_every_form() {
    let toml = "[package]\nname = \"moe-lanes\"\n[dependencies]\nclap = \"4\"\nlib = { package = \"moe-lanes\", path = \"..\" }\n\
                [dependencies.anyhow]\nversion = \"1\"\n[dev-dependencies.lib2]\npackage = \"moe-lanes\"\n\
                [target.'cfg(unix)'.dependencies]\nindicatif = \"0.17\"\n\
                [dev-dependencies]\n\"hyper\" = \"1\" # for tests\n[workspace.dependencies]\naxum = \"0.7\"\n";
    let deps = dependencies(toml);
    let seen: Vec<(usize, &str, bool)> =
        deps.iter().map(|d| (d.line, d.package.as_str(), d.is_normal())).collect();
    let expected = [
        (4, "clap", true),
        (5, "moe-lanes", true),
        (6, "anyhow", true),
        (8, "moe-lanes", false),
        (11, "indicatif", true),
        (13, "hyper", false),
    ];
    assert_eq!(seen, expected);
}

#[test]
fn safety_comments_are_found_where_they_belong() {
    let raw = split_lines(
        "// SAFETY: one comment over a group\nlet a = unsafe { p.read() };\nlet b = unsafe { q.read() };\n\n\
         let c = unsafe { r.read() };\n/// Reads.\n///\n/// # Safety\n/// `p` is valid.\n#[inline]\n#[target_feature(enable = \"avx2\")]\n\
         unsafe fn f(p: *const u8) {}\nlet d = unsafe { s.read() }; // SAFETY: on the line",
    );
    let has = |i: usize| has_safety_comment(&raw, i);
    assert!(has(1) && has(2), "the group under one comment");
    assert!(!has(4), "a blank line ends the comment's reach");
    assert!(has(11), "a long doc with attributes between");
    assert!(has(12), "the comment on the line itself");
}

#[test]
fn function_lengths_count_code_braces_only() {
    let code = code_lines(
        "pub(crate) const fn a() -> [u8; 2] {\n    [b'{', b'{']\n}\ntrait T {\n    fn decl(&self);\n}\n\
         pub async unsafe fn b() {\n    let s = \"}}}\";\n    fn inner() {}\n}\n",
    );
    assert_eq!(functions(&code), vec![(0, 3), (6, 4)]);
    assert!(is_fn_start("    pub(super) extern \"\" fn c() {"));
    assert!(!is_fn_start("    let f = |x| x; // fn"));
}
