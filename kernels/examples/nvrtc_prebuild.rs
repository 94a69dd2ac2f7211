//! Compiles every kernel for one architecture into a cubin cache directory on a machine without
//! a GPU, so that the GPU machine's first backend loads the cubin instead of compiling it (about
//! two minutes there, on every fresh machine):
//!
//! `nvrtc_prebuild DIR [ARCH (sm_90)] [CUDA_INCLUDE_DIR]`
//!
//! The cache key is the source, the defines, NVRTC's version and the architecture (not where the
//! headers are), so the cubin serves the GPU machine when this process loads the NVRTC release
//! the GPU machine has (`LD_LIBRARY_PATH`); `scripts/gpu-pack.sh` runs it when `PREBUILD_NVRTC`
//! names such a release's directory (`lib/libnvrtc.so.*` and `include/`).

use moe_lanes_kernels::cuda::{compile_for_arch, CudaConfig};
use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(dir) = args.first() else {
        eprintln!("usage: nvrtc_prebuild DIR [ARCH] [CUDA_INCLUDE_DIR]");
        return ExitCode::from(2);
    };
    let arch = args.get(1).map_or("sm_90", String::as_str);
    let config = CudaConfig {
        nvrtc_cache_dir: Some(PathBuf::from(dir)),
        cuda_include_dir: args.get(2).map(PathBuf::from),
        ..CudaConfig::default()
    };
    match compile_for_arch(arch, &config) {
        Ok((cubin, report)) => {
            let path = report.cache_path.as_ref().map_or("-".into(), |p| p.display().to_string());
            let how =
                if report.cache_hit { "cached".to_string() } else { format!("{:.0} ms", report.compile_ms) };
            println!("{arch}: {} bytes ({how}) -> {path}", cubin.len());
            if let Some(note) = report.cache_note {
                eprintln!("cache: {note}");
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("nvrtc_prebuild: {e}");
            ExitCode::FAILURE
        }
    }
}
