//! The CUDA backend the GPU kernel tests share: created once, `None` (and `SKIP:` printed) when
//! no device is usable, a panic instead when `MOE_LANES_REQUIRE_GPU` is set (the GPU machine).

use moe_lanes_kernels::cuda::{CudaBackend, CudaConfig, DeviceBuffer, Q8Rows};
use moe_lanes_kernels::q8::Q8Activations;
use std::sync::OnceLock;

/// The shared backend, bound to the calling thread, or `None` without a usable CUDA device. Its
/// cubins are kept in `MOE_LANES_NVRTC_CACHE` where set (as the library's engines keep them: the
/// GPU machine's packed cache then serves every test binary).
pub fn backend() -> Option<&'static CudaBackend> {
    static B: OnceLock<Option<CudaBackendBox>> = OnceLock::new();
    let config = CudaConfig {
        nvrtc_cache_dir: std::env::var_os("MOE_LANES_NVRTC_CACHE").map(std::path::PathBuf::from),
        ..CudaConfig::default()
    };
    let b = B.get_or_init(|| match CudaBackend::with_config(&config) {
        Ok(b) => {
            eprintln!("CUDA device: {:?}; kernels: {:?}", b.info(), b.compile_report());
            Some(CudaBackendBox(b))
        }
        Err(e) => {
            if std::env::var_os("MOE_LANES_REQUIRE_GPU").is_some() {
                panic!("MOE_LANES_REQUIRE_GPU is set but CUDA is not usable: {e}");
            }
            eprintln!("SKIP: no CUDA device: {e}");
            // Plain `cargo test` shows this one (written past the harness's capture of eprintln!).
            use std::io::Write;
            let exe = std::env::current_exe().ok();
            let stem = exe.as_deref().and_then(|p| p.file_stem()).map(|s| s.to_string_lossy().into_owned());
            let name = stem.map(|n| n.rsplit_once('-').map_or(n.clone(), |(b, _)| b.to_string())).unwrap_or_default();
            let line = format!(
                "GPU tests skipped ({name}): no CUDA device: {e}; they pass without running (MOE_LANES_REQUIRE_GPU=1 fails them instead)\n"
            );
            let _ = std::io::stderr().lock().write_all(line.as_bytes());
            None
        }
    });
    match b {
        Some(bb) => {
            bb.0.bind_to_thread().unwrap();
            Some(&bb.0)
        }
        None => {
            eprintln!("SKIP: no CUDA device");
            None
        }
    }
}

/// Device room for rows of 8-bit activations ([`Q8Rows`]), and their check against the CPU.
pub struct DeviceQ8 {
    pub q: DeviceBuffer<i8>,
    pub d: DeviceBuffer<f32>,
}

impl DeviceQ8 {
    /// Zeroed room for `n` values.
    pub fn zeroed(be: &CudaBackend, n: usize) -> DeviceQ8 {
        DeviceQ8 { q: be.alloc_zeros::<i8>(n).unwrap(), d: be.alloc_zeros::<f32>(n / 32).unwrap() }
    }

    pub fn rows(&self) -> Q8Rows {
        Q8Rows { q: self.q.ptr(), d: self.d.ptr() }
    }

    /// The values the integer dots see, `d * q`, asserted bit-equal to the CPU's
    /// `Q8Activations` of `values` (rows of `k`): what the device quantized is `values`, exactly.
    pub fn seen(&self, be: &CudaBackend, values: &[f32], k: usize, what: &str) -> Vec<f32> {
        let (qs, ds) = (be.read_vec(self.q.ptr()).unwrap(), be.read_vec(self.d.ptr()).unwrap());
        let seen: Vec<f32> = (0..values.len()).map(|i| ds[i / 32] * qs[i] as f32).collect();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for (row, got) in seen.chunks_exact(k).enumerate() {
            let want = Q8Activations::quantize(&values[row * k..][..k]).unwrap().dequantized(0);
            assert_eq!(bits(got), bits(&want), "{what} row {row}: 8-bit rows against the CPU");
        }
        seen
    }
}

struct CudaBackendBox(CudaBackend);
// SAFETY: tests share one backend; every call binds the context to the calling thread
// first and the tests run one at a time on it (`--test-threads=1` on the GPU machine),
// so no two threads drive the stream at once.
unsafe impl Sync for CudaBackendBox {}
// SAFETY: the backend's handles (context, streams, cuBLAS, module) may be used from any thread
// once the context is bound there, which every call does; the box owns the backend outright.
unsafe impl Send for CudaBackendBox {}

/// Deterministic pseudo-random values in [-1, 1).
pub fn rnd(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// `v` rounded to bf16: the bits and their f32 values.
pub fn to_bf16(v: &[f32]) -> (Vec<u16>, Vec<f32>) {
    let bits: Vec<u16> = v.iter().map(|x| half::bf16::from_f32(*x).to_bits()).collect();
    let back = bits.iter().map(|b| half::bf16::from_bits(*b).to_f32()).collect();
    (bits, back)
}

/// The largest |a - b| of two equal-length slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Microseconds a launch takes, the mean of `runs` after `warmups`, the device synchronised
/// before the clock starts and before it stops (the timing tests' prints).
pub fn mean_launch_us(be: &CudaBackend, warmups: usize, runs: usize, launch: impl Fn()) -> f64 {
    for _ in 0..warmups {
        launch();
    }
    be.synchronize().unwrap();
    let start = std::time::Instant::now();
    for _ in 0..runs {
        launch();
    }
    be.synchronize().unwrap();
    start.elapsed().as_secs_f64() * 1e6 / runs as f64
}

/// `tiles` (`(slot, first row, rows)` triples) with each cut into tiles of at most `rows` rows.
pub fn tiles_of_at_most(tiles: &[i32], rows: usize) -> Vec<i32> {
    let mut out = Vec::new();
    for t in tiles.chunks(3) {
        for first in (0..t[2]).step_by(rows) {
            out.extend([t[0], t[1] + first, (t[2] - first).min(rows as i32)]);
        }
    }
    out
}
