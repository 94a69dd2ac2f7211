//! Host mappings the device reads in place: a read-only memory map (a model file) registered
//! with the driver (`cuMemHostRegister`, read-only), so host-to-device copies from it run as DMA
//! straight from the mapped pages, as from a pinned buffer, with no staging copy on the host.
//!
//! Soundness: [`HostRegistration`] owns an `Arc` of the map, so the registered pages stay mapped
//! (and never move: a `memmap2::Mmap` is fixed for its life) while any copy may read them; it
//! names the copy streams that may read it when it is made (a copy on any other stream is
//! refused), and its drop waits for those streams before it unregisters, so no copy outlives it. (Not `cuCtxSynchronize`: a context-wide wait
//! while another thread captures a CUDA graph on its own stream breaks that capture.)

use super::{CopyStream, CudaBackend, CudaError, DPtr, DrvCtx, Result};
use cudarc::driver::{result as drv, sys, CudaContext, CudaStream};
use std::ops::Range;
use std::sync::Arc;

/// A read-only memory map registered with a CUDA context for the registration's life.
pub struct HostRegistration {
    map: Arc<memmap2::Mmap>,
    ctx: Arc<CudaContext>,
    /// The streams copies from the map may be queued on (kept alive here; waited for in drop).
    streams: Vec<Arc<CudaStream>>,
}

impl HostRegistration {
    /// Bytes registered (the whole map).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Where `bytes` lie in the registered map (offsets from its start), when they lie in it.
    pub fn range_of(&self, bytes: &[u8]) -> Option<Range<usize>> {
        let (base, at) = (self.map.as_ptr() as usize, bytes.as_ptr() as usize);
        let start = at.checked_sub(base)?;
        (start + bytes.len() <= self.map.len()).then_some(start..start + bytes.len())
    }
}

impl Drop for HostRegistration {
    /// Waits for the streams copies from the map may be queued on, then unregisters; the map
    /// itself goes with the last `Arc`.
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        for s in &self.streams {
            let _ = s.synchronize();
        }
        // SAFETY: the pointer is the one registered in `register_mapping`, and no copy from it
        // is in flight: every stream one may be queued on is idle (waited for above).
        unsafe {
            let ptr = self.map.as_ptr() as *mut std::ffi::c_void;
            let _ = super::gate::exclusive(|| sys::cuMemHostUnregister(ptr).result());
        }
    }
}

impl CudaBackend {
    /// Register the whole of `map` (read-only) for copies straight from its pages on the copy
    /// `streams` ([`CudaBackend::write_registered_on`]). Fails where the driver refuses (no
    /// support for read-only registration, or pages it cannot pin); callers stage through pinned
    /// buffers then.
    pub fn register_mapping(
        &self,
        map: Arc<memmap2::Mmap>,
        streams: &[CopyStream],
    ) -> Result<HostRegistration> {
        if map.is_empty() {
            let reason = "an empty map has nothing to register".to_string();
            return Err(CudaError::Shape { kernel: "cuMemHostRegister", reason });
        }
        self.bind_to_thread()?;
        let (ptr, len) = (map.as_ptr() as *mut std::ffi::c_void, map.len());
        // SAFETY: `ptr..ptr + len` is the whole live map, kept mapped by the `Arc` the returned
        // registration holds until its drop unregisters it; the read-only flag matches the map's
        // protection, so the device never writes it.
        super::gate::exclusive(|| unsafe {
            sys::cuMemHostRegister_v2(ptr, len, sys::CU_MEMHOSTREGISTER_READ_ONLY)
        })
        .result()
        .ctx("cuMemHostRegister")?;
        let streams = streams.iter().map(|cs| cs.stream.clone()).collect();
        Ok(HostRegistration { map, ctx: self.ctx.clone(), streams })
    }

    /// Queue a copy of the registered bytes `range` into `dst` on copy stream `cs` (one the
    /// registration was made for).
    pub fn write_registered_on(
        &self,
        cs: &CopyStream,
        src: &HostRegistration,
        range: Range<usize>,
        dst: DPtr<u8>,
    ) -> Result<()> {
        assert!(range.end <= src.map.len() && range.len() <= dst.len, "registered copy out of range");
        assert!(
            src.streams.iter().any(|s| Arc::ptr_eq(s, &cs.stream)),
            "a stream the registration was made for"
        );
        if range.is_empty() {
            return Ok(());
        }
        // SAFETY: the bytes lie in the registered map, which `src` keeps mapped and registered
        // until its drop, after `cs` (one of its streams, asserted above) is idle; `dst` is a live device range of
        // at least `range.len()` bytes (asserted above); `cs` is a live stream of this context.
        unsafe { drv::memcpy_htod_async(dst.raw, &src.map[range], cs.stream.cu_stream()) }
            .ctx("cuMemcpyHtoDAsync(registered)")
    }
}
