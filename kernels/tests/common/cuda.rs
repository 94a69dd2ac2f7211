//! The CUDA backend the GPU kernel tests share: created once, `None` (and `SKIP:` printed) when
//! no device is usable, a panic instead when `MOE_LANES_REQUIRE_GPU` is set (the GPU machine).

use moe_lanes_kernels::cuda::CudaBackend;
use std::sync::OnceLock;

/// The shared backend, bound to the calling thread, or `None` without a usable CUDA device.
pub fn backend() -> Option<&'static CudaBackend> {
    static B: OnceLock<Option<CudaBackendBox>> = OnceLock::new();
    let b = B.get_or_init(|| match CudaBackend::try_new() {
        Ok(b) => {
            eprintln!("CUDA device: {:?}; kernels: {:?}", b.info(), b.compile_report());
            Some(CudaBackendBox(b))
        }
        Err(e) => {
            if std::env::var_os("MOE_LANES_REQUIRE_GPU").is_some() {
                panic!("MOE_LANES_REQUIRE_GPU is set but CUDA is not usable: {e}");
            }
            eprintln!("SKIP: no CUDA device: {e}");
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

struct CudaBackendBox(CudaBackend);
// SAFETY: tests share one backend; every call binds the context to the calling thread
// first and the tests run one at a time on it (`--test-threads=1` on the GPU machine),
// so no two threads drive the stream at once.
unsafe impl Sync for CudaBackendBox {}
// SAFETY: the backend's handles (context, streams, cuBLAS, module) may be used from any thread
// once the context is bound there, which every call does; the box owns the backend outright.
unsafe impl Send for CudaBackendBox {}
