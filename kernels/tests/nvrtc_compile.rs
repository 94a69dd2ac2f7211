//! Every CUDA source compiles through the backend's NVRTC path for a fixed architecture without a
//! device: the whole program (through the on-disk cubin cache) and each op family by itself.
//! Runs where libnvrtc loads (`LD_LIBRARY_PATH`) and the CUDA headers are found (`CUDA_HOME`,
//! `CUDA_PATH`, `CUDA_ROOT` or `/usr/local/cuda`); prints `SKIP:` otherwise, and fails instead
//! when `MOE_LANES_REQUIRE_NVRTC=1` (`.ci/run` installs NVRTC and the headers from PyPI and sets it).

use moe_lanes_kernels::cuda::{
    compile_cached, compile_for_arch, nvrtc_available, CudaConfig, Family, Kernel,
};
use std::path::PathBuf;

const ARCH: &str = "sm_90";

/// The first include directory that holds `cuda_bf16.h`.
fn include_dir() -> Option<PathBuf> {
    ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"]
        .iter()
        .filter_map(std::env::var_os)
        .map(|d| PathBuf::from(d).join("include"))
        .chain([PathBuf::from("/usr/local/cuda/include")])
        .find(|d| d.join("cuda_bf16.h").exists())
}

/// Skip with `why`, or fail where NVRTC is required.
fn skip(why: &str) -> Option<CudaConfig> {
    assert!(std::env::var("MOE_LANES_REQUIRE_NVRTC").as_deref() != Ok("1"), "NVRTC required: {why}");
    eprintln!("SKIP: {why}");
    None
}

fn config() -> Option<CudaConfig> {
    if !nvrtc_available() {
        return skip("libnvrtc is not loadable (add its directory to LD_LIBRARY_PATH)");
    }
    let Some(include) = include_dir() else {
        return skip("no cuda_bf16.h under $CUDA_HOME/include or /usr/local/cuda/include");
    };
    Some(CudaConfig { cuda_include_dir: Some(include), ..Default::default() })
}

/// The cubin's symbol table names `symbol` (string table entries are NUL-separated).
fn defines_symbol(cubin: &[u8], symbol: &str) -> bool {
    let entry = [b"\0", symbol.as_bytes(), b"\0"].concat();
    cubin.windows(entry.len()).any(|w| w == entry.as_slice())
}

#[test]
fn every_kernel_compiles_for_sm90_without_a_device_and_is_cached() {
    let Some(config) = config() else { return };
    let dir = std::env::temp_dir().join(format!("moe-lanes-nvrtc-arch-test-{}", std::process::id()));
    let config = CudaConfig { nvrtc_cache_dir: Some(dir.clone()), ..config };
    let first = compile_for_arch(ARCH, &config);
    let second = compile_for_arch(ARCH, &config);
    let _ = std::fs::remove_dir_all(&dir);
    let ((cubin, first), (again, second)) = (first.unwrap(), second.unwrap());
    eprintln!("{ARCH}: {} bytes in {:.0} ms", cubin.len(), first.compile_ms);
    assert!(cubin.starts_with(b"\x7fELF"), "a cubin is an ELF image");
    for k in Kernel::ALL {
        assert!(defines_symbol(&cubin, k.symbol()), "{k:?} ({}) missing from the cubin", k.symbol());
    }
    assert!(!first.cache_hit && second.cache_hit, "{first:?} then {second:?}");
    assert_eq!(cubin, again);
}

#[test]
fn each_op_family_compiles_by_itself() {
    let Some(config) = config() else { return };
    for family in Family::ALL {
        let (cubin, _) = compile_cached(&family.standalone_source(), family.file_name(), ARCH, &config)
            .unwrap_or_else(|e| panic!("{}: {e}", family.file_name()));
        for k in Kernel::ALL.into_iter().filter(|k| k.family() == family) {
            assert!(defines_symbol(&cubin, k.symbol()), "{k:?} missing from {}", family.file_name());
        }
    }
}
