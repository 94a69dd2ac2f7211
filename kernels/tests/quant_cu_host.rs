//! The block decoding of the CUDA quantized kernels (the section of `kernels/cuda/quant.cu`
//! between its "block decoding" markers, shared by the GEMV and the dequantization) compiled for
//! the host by `kernels/tests/host/quant_units.cpp` and run on the gguf-py fixtures
//! (`tests/fixtures/quant`): every value bit-equal to gguf-py's, every column of a block decoded
//! by exactly one unit, the same for the wide 32-value chunks of the one-token GEMVs and the
//! hot lane, and the runs of 8 values of the grouped prefill GEMM's weight tiles (blocks at 16-byte aligned and 2-mod-4 addresses;
//! MXFP4's 17-byte blocks at every offset mod 4; Q5_0, Q5_1 and IQ4_NL included). This checks the device code's indexing without a GPU; the kernels
//! themselves are checked on one by `cuda_quant.rs`. Skips (and says so) without a C++ compiler
//! (`$CXX`, `c++`, `g++` or `clang++`).

use std::path::{Path, PathBuf};
use std::process::Command;

fn compiler() -> Option<String> {
    let candidates = std::env::var("CXX").into_iter().chain(["c++", "g++", "clang++"].map(String::from));
    candidates
        .into_iter()
        .find(|c| Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success()))
}

/// quant.cu's block decoding section (between the marker lines).
fn decode_section(cu: &str) -> &str {
    let begin = cu.find("// ---- block decoding begin").expect("begin marker in quant.cu");
    let body = &cu[begin..];
    let body = &body[body.find('\n').expect("marker line ends") + 1..];
    &body[..body.find("// ---- block decoding end").expect("end marker in quant.cu")]
}

fn run(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{what} failed ({}):\n{text}", out.status);
    text
}

#[test]
fn cuda_block_decoding_equals_gguf_py_on_the_host() {
    let Some(cxx) = compiler() else {
        eprintln!("SKIP: no C++ compiler ($CXX, c++, g++, clang++)");
        return;
    };
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let cu = read(&root.join("cuda/quant.cu"));
    let harness = read(&root.join("tests/host/quant_units.cpp"));
    assert!(harness.contains("// @QUANT_DECODE@"));
    let dir = std::env::temp_dir().join(format!("moe-lanes-quant-units-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (src, exe) = (dir.join("quant_units.cpp"), dir.join("quant_units"));
    std::fs::write(&src, harness.replace("// @QUANT_DECODE@", decode_section(&cu))).unwrap();
    let flags = ["-std=c++17", "-O1", "-ffp-contract=off", "-w", "-o"];
    run(Command::new(&cxx).args(flags).arg(&exe).arg(&src), &cxx);
    let out = run(Command::new(&exe).arg(root.join("../tests/fixtures/quant")), "quant_units");
    let _ = std::fs::remove_dir_all(&dir);
    eprint!("{out}");
    assert_eq!(out.matches(", 0 mismatches").count(), 27, "{out}");
}
