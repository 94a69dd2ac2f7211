//! CUDA backend: device selection, NVRTC compilation of `kernels/cuda/*.cu` for the device's own
//! architecture (with an on-disk cubin cache; [`compile_for_arch`] needs no device), a cuBLAS
//! handle, a compute stream and a side (copy) stream, device and pinned host buffers, CUDA events,
//! and typed launchers for every kernel ([`ops`]; the quantized-block kernels in [`quant`]), looked
//! up by [`Kernel`] id.
//!
//! Everything is loaded at run time (cudarc `fallback-dynamic-loading`), so this crate builds and
//! its tests run on machines without CUDA: [`CudaBackend::try_new`] then returns
//! [`CudaError::NoDriver`] and callers fall back to the CPU (and say so).
//!
//! Memory model: [`DeviceBuffer`] owns an allocation; [`DPtr`] is a copyable (pointer, length)
//! view of part of one, checked against kernel shapes by every launcher (sub-views are checked
//! against the view they come from). Compute goes to the backend's compute stream, in order; the
//! side stream only writes hot-cache slots, and the compute stream waits for those copies through
//! an event ([`CudaBackend::record_side`], [`CudaBackend::wait_event`]; the same for the Post-Fetch
//! [`CopyStream`]s), so cudarc's per-slice
//! event tracking is switched off. A `DPtr` must not outlive its buffer (a stale one faults on
//! the device). [`PinnedBuffer`]s fence their own asynchronous copies, so those copies are safe.
//! A [`PagedBuffer`] ([`vmm`]) is a device allocation whose address range is reserved whole and
//! whose physical pages are committed on demand (the KV caches), a `DPtr` into it valid over the
//! committed front.

pub mod epilogue;
mod gate;
mod gemma;
pub mod kernel;
pub mod mla;
pub mod ops;
pub mod quant;
pub mod registered;
pub mod vmm;

pub use epilogue::{GateUpEpilogue, Glu};
pub use kernel::{kernel_source, Family, Kernel};
pub use quant::{Q8Rows, TypedWeights};
pub use registered::HostRegistration;
pub use vmm::PagedBuffer;

use crate::panic_message;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    result as drv, sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
};
use std::marker::PhantomData;
use std::path::PathBuf;
use std::sync::Arc;

/// Every way the CUDA backend can fail.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver or library: {0}")]
    NoDriver(String),
    #[error("CUDA device {ordinal} not usable: {source}")]
    Device { ordinal: usize, source: drv::DriverError },
    #[error("CUDA driver call '{what}' failed: {source}")]
    Driver { what: &'static str, source: drv::DriverError },
    #[error("NVRTC compile of {name} for {arch} failed: {message}")]
    Compile { name: String, arch: String, message: String },
    #[error("cuBLAS call '{what}' failed: {source}")]
    Cublas { what: &'static str, source: cudarc::cublas::result::CublasError },
    #[error("kernel '{kernel}': {reason}")]
    Shape { kernel: &'static str, reason: String },
    #[error("CUDA library panicked in {what}: {message}")]
    Panic { what: &'static str, message: String },
    #[error("CUDA device {ordinal} has no virtual memory management: paged buffers need it")]
    NoVirtualMemory { ordinal: usize },
}

pub type Result<T, E = CudaError> = std::result::Result<T, E>;

impl CudaError {
    /// Whether a driver call failed for want of device memory (the device itself still works).
    pub fn is_out_of_memory(&self) -> bool {
        let oom = sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY;
        matches!(self, CudaError::Driver { source, .. } | CudaError::Device { source, .. } if source.0 == oom)
    }
}

trait DrvCtx<T> {
    fn ctx(self, what: &'static str) -> Result<T>;
}

impl<T> DrvCtx<T> for std::result::Result<T, drv::DriverError> {
    fn ctx(self, what: &'static str) -> Result<T> {
        self.map_err(|source| CudaError::Driver { what, source })
    }
}

/// What the backend knows about its device.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_mem_bytes: usize,
    pub multiprocessors: i32,
}

impl DeviceInfo {
    /// NVRTC target, e.g. `sm_90`.
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.compute_capability.0, self.compute_capability.1)
    }

    /// Compute capability 8.0 or later: bf16 `mma.sync` and `cp.async`, which the tensor-core
    /// attention and the pipelined grouped GEMMs need.
    pub fn has_sm80(&self) -> bool {
        self.compute_capability.0 >= 8
    }
}

/// How the kernels were obtained at start-up.
#[derive(Debug, Clone)]
pub struct CompileReport {
    pub arch: String,
    /// The cubin came from the on-disk cache.
    pub cache_hit: bool,
    /// Cache file used (or that would have been used), if a cache directory exists.
    pub cache_path: Option<PathBuf>,
    pub compile_ms: f64,
    /// Why the cache was not used, when it was not (informational; never fatal).
    pub cache_note: Option<String>,
}

/// A copyable view of `len` elements of device memory.
pub struct DPtr<T> {
    raw: u64,
    len: usize,
    _m: PhantomData<T>,
}

impl<T> Clone for DPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for DPtr<T> {}

impl<T> std::fmt::Debug for DPtr<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DPtr({:#x}, {})", self.raw, self.len)
    }
}

impl<T> DPtr<T> {
    pub fn raw(&self) -> u64 {
        self.raw
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Sub-view `[offset, offset + len)`; panics when out of range (a programming error).
    pub fn sub(&self, offset: usize, len: usize) -> DPtr<T> {
        let in_range = offset.checked_add(len).is_some_and(|end| end <= self.len);
        assert!(in_range, "DPtr::sub out of range: {offset}+{len} > {}", self.len);
        DPtr { raw: self.raw + (offset * std::mem::size_of::<T>()) as u64, len, _m: PhantomData }
    }
    /// From `offset` to the end; panics when `offset > len` (a programming error).
    pub fn from(&self, offset: usize) -> DPtr<T> {
        assert!(offset <= self.len, "DPtr::from out of range: {offset} > {}", self.len);
        self.sub(offset, self.len - offset)
    }
    /// The same device bytes seen as another plain type of the same size (e.g. f32 as u32 bits).
    pub fn cast<U: bytemuck::Pod>(&self) -> DPtr<U>
    where
        T: bytemuck::Pod,
    {
        assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<U>(), "DPtr::cast between sizes");
        DPtr { raw: self.raw, len: self.len, _m: PhantomData }
    }
}

impl DPtr<u8> {
    /// The bytes seen as 16-bit elements (bf16 bit patterns); panics on an odd length or
    /// address (a programming error).
    pub fn as_u16(&self) -> DPtr<u16> {
        assert!(self.len.is_multiple_of(2) && self.raw.is_multiple_of(2), "DPtr::as_u16 of {self:?}");
        DPtr { raw: self.raw, len: self.len / 2, _m: PhantomData }
    }

    /// The bytes seen as f32 elements; panics on a length or address not a multiple of 4 (a
    /// programming error).
    pub fn as_f32(&self) -> DPtr<f32> {
        assert!(self.len.is_multiple_of(4) && self.raw.is_multiple_of(4), "DPtr::as_f32 of {self:?}");
        DPtr { raw: self.raw, len: self.len / 4, _m: PhantomData }
    }
}

/// An owned device allocation of `len` elements.
pub struct DeviceBuffer<T> {
    _slice: CudaSlice<T>,
    ptr: DPtr<T>,
    serial: u64,
}

/// Serial numbers of device allocations, never reused in a process.
static NEXT_SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl<T> DeviceBuffer<T> {
    pub fn ptr(&self) -> DPtr<T> {
        self.ptr
    }
    /// This allocation's serial number, unique for the process's life. An address is not: the
    /// stream-ordered allocator hands a freed address to the next allocation that fits, so a
    /// captured graph that remembered addresses must compare serials to know its buffers live.
    pub fn serial(&self) -> u64 {
        self.serial
    }
    pub fn len(&self) -> usize {
        self.ptr.len
    }
    pub fn is_empty(&self) -> bool {
        self.ptr.len == 0
    }
    pub fn bytes(&self) -> usize {
        self.ptr.len * std::mem::size_of::<T>()
    }
}

/// Page-locked host memory for asynchronous copies.
///
/// Safe to use with [`CudaBackend::read_async`] / [`CudaBackend::write_async`]: every
/// asynchronous copy into or out of the buffer records the buffer's own fence event after it,
/// and every host access ([`PinnedBuffer::as_slice`], [`PinnedBuffer::as_mut_slice`]) and the
/// drop wait for that fence first, so the host never touches (or frees) memory a copy is using.
pub struct PinnedBuffer<T: Copy + Default> {
    ptr: *mut T,
    len: usize,
    ctx: Arc<CudaContext>,
    fence: sys::CUevent,
    in_flight: std::cell::Cell<bool>,
}

// SAFETY: the buffer is plain host memory whose raw pointer is owned exclusively by this value,
// and the fence event is only used through it; moving it to another thread moves the ownership.
unsafe impl<T: Copy + Default + Send> Send for PinnedBuffer<T> {}

impl<T: Copy + Default> PinnedBuffer<T> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Wait for the last asynchronous copy that touched the buffer.
    fn settle(&self) -> Result<()> {
        if self.in_flight.get() {
            // SAFETY: `fence` is a live event created with the buffer and destroyed in `drop`.
            unsafe { drv::event::synchronize(self.fence) }.ctx("cuEventSynchronize")?;
            self.in_flight.set(false);
        }
        Ok(())
    }
    /// The host data, once any asynchronous copy into or out of it is done.
    pub fn as_slice(&self) -> Result<&[T]> {
        self.settle()?;
        // SAFETY: `ptr` points to `len` initialised elements (filled at allocation) owned by
        // this buffer, and no copy is in flight (settled above), so nothing writes them meanwhile.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr, self.len) })
    }
    /// The host data for writing, once any asynchronous copy into or out of it is done.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.settle()?;
        // SAFETY: as in `as_slice`; `&mut self` makes this the only view.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }
    /// Mark a copy queued on `stream` as using the buffer until the fence recorded now. While
    /// the stream is captured (`captured`) the record is a node of the graph (an external
    /// record), so every replay records the fence after its copies; see
    /// [`PinnedBuffer::fence_replayed`].
    fn fence_after(&self, stream: sys::CUstream, captured: bool) -> Result<()> {
        if captured {
            let flags = sys::CUevent_record_flags_enum::CU_EVENT_RECORD_EXTERNAL as u32;
            // SAFETY: `fence` is a live event of this context; `stream` is the caller's live stream.
            unsafe { sys::cuEventRecordWithFlags(self.fence, stream, flags) }
                .result()
                .ctx("cuEventRecordWithFlags")?;
        } else {
            // SAFETY: `fence` is a live event of this context; `stream` is the caller's live stream.
            unsafe { drv::event::record(self.fence, stream) }.ctx("cuEventRecord")?;
        }
        self.in_flight.set(true);
        Ok(())
    }
    /// A graph whose capture copied into or out of this buffer was launched: the host accessors
    /// wait for the fence that launch records.
    pub fn fence_replayed(&self) {
        self.in_flight.set(true);
    }
}

impl<T: Copy + Default> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let _ = self.settle();
        // SAFETY: no copy is in flight any more (settled above, or the context is gone and with
        // it every copy); `ptr` came from `cuMemHostAlloc` and `fence` from `cuEventCreate`, and
        // neither is used after this.
        unsafe {
            let _ = drv::event::destroy(self.fence);
            gate::exclusive(|| drv::free_host(self.ptr as *mut std::ffi::c_void)).ok();
        }
    }
}

/// A CUDA event with timing enabled.
pub struct GpuEvent {
    ev: sys::CUevent,
    ctx: Arc<CudaContext>,
}

// SAFETY: a CUevent is a handle the driver lets any thread use once its context is bound
// (every method binds or uses it through the backend); this value owns it exclusively.
unsafe impl Send for GpuEvent {}

impl GpuEvent {
    /// Block the calling thread until the work recorded before this event is done.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: `ev` is a live event of this context (destroyed only in `drop`).
        unsafe { drv::event::synchronize(self.ev) }.ctx("cuEventSynchronize")
    }
    /// Whether the recorded work is done (non-blocking).
    pub fn is_done(&self) -> bool {
        // SAFETY: `ev` is a live event of this context (destroyed only in `drop`).
        unsafe { drv::event::query(self.ev) }.is_ok()
    }
    /// Milliseconds from `self` to `end` (both recorded and complete).
    pub fn elapsed_ms(&self, end: &GpuEvent) -> Result<f32> {
        // SAFETY: both events are live events of this context; the driver checks that both were
        // recorded and completed and reports an error otherwise.
        unsafe { drv::event::elapsed(self.ev, end.ev) }.ctx("cuEventElapsedTime")
    }
}

impl Drop for GpuEvent {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ev` is owned by this value and is not used after this.
        unsafe {
            let _ = drv::event::destroy(self.ev);
        }
    }
}

/// A captured and instantiated sequence of the compute stream's work (the decode graph).
pub struct StreamGraph {
    graph: std::mem::ManuallyDrop<cudarc::driver::CudaGraph>,
}

impl Drop for StreamGraph {
    /// Destroyed through the capture gate (not while another thread captures).
    fn drop(&mut self) {
        // SAFETY: `graph` is dropped once, here, and never used after.
        gate::exclusive(|| unsafe { std::mem::ManuallyDrop::drop(&mut self.graph) });
    }
}

// SAFETY: a graph and its executable are driver handles that any thread may use once the
// context is bound (`CudaGraph::launch` binds it); this value owns them exclusively and `&mut`/
// ownership serialise every use, as the driver requires of graph objects.
unsafe impl Send for StreamGraph {}

/// A dedicated copy stream made by [`CudaBackend::copy_stream`] (Post-Fetch's host-to-device
/// copies of cold experts); it only writes buffers the compute stream reads after an event.
pub struct CopyStream {
    stream: Arc<CudaStream>,
}

impl CopyStream {
    /// Wait on the host until every copy queued on this stream is done.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().ctx("cuStreamSynchronize(copy)")
    }
}

/// One GPU: context, dedicated stream, cuBLAS handle and the compiled kernels.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Side stream for hot-cache exchanges: copies there run beside the compute stream, which
    /// waits for them only where it uses what they wrote ([`CudaBackend::wait_event`]).
    side: Arc<CudaStream>,
    /// Dropped through the capture gate ([`CudaBackend`]'s drop), as it was made.
    blas: std::mem::ManuallyDrop<CudaBlas>,
    /// Indexed by [`Kernel`] id; their module is unloaded through the capture gate.
    functions: std::mem::ManuallyDrop<Vec<CudaFunction>>,
    info: DeviceInfo,
    compile: CompileReport,
    /// The compute stream is being captured into a graph (event records become graph nodes).
    capturing: std::sync::atomic::AtomicBool,
    /// Kernels are launched with programmatic stream serialization ([`CudaConfig`]).
    programmatic: bool,
    /// The grouped expert GEMMs (bf16 and quantized caches) take the pipelined kernels where the
    /// shapes allow (sm_80 and later; [`CudaBackend::set_grouped_pipeline`] turns them off for
    /// the tests that compare them with the synchronous ones, which unaligned shapes and older
    /// devices take anyway).
    grouped_pipeline: std::sync::atomic::AtomicBool,
    /// The page size of [`PagedBuffer`]s on this device (`None`: no virtual memory management).
    page_bytes: Option<usize>,
}

/// The kernels of `cubin` loaded into `ctx` (their pipelined shared memory allowed where
/// `pipelined`) and a cuBLAS handle on `stream`, through the capture gate: loading a module and
/// creating the handle (its workspace) may synchronize the context, which would break a capture
/// another thread has in progress (another engine of the process capturing its decode graph).
fn load_kernels(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    cubin: Vec<u8>,
    pipelined: bool,
) -> Result<(Vec<CudaFunction>, CudaBlas)> {
    // The gate outside the guard: a panic inside must not leave it shut.
    gate::exclusive(|| {
        guard("module load", || {
            let module = ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)).ctx("cuModuleLoadData")?;
            let functions = Kernel::ALL
                .iter()
                .map(|k| module.load_function(k.symbol()).ctx("cuModuleGetFunction"))
                .collect::<Result<Vec<_>>>()?;
            if pipelined {
                allow_pipe_shared(&functions)?;
            }
            let blas = CudaBlas::new(stream.clone())
                .map_err(|source| CudaError::Cublas { what: "cublasCreate", source })?;
            Ok((functions, blas))
        })
    })
}

impl Drop for CudaBackend {
    /// The cuBLAS handle (its workspace freed) and the kernels' module (unloaded) go through
    /// the capture gate, as `load_kernels` made them: either may synchronize the context.
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let (blas, functions) = (&mut self.blas, &mut self.functions);
        // SAFETY: both are dropped once, here, and never used after (the backend is going).
        gate::exclusive(|| unsafe {
            std::mem::ManuallyDrop::drop(blas);
            std::mem::ManuallyDrop::drop(functions);
        });
    }
}

/// Run a closure that may panic inside cudarc's dynamic loader (missing library or symbol).
fn guard<T>(what: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => Err(CudaError::Panic { what, message: panic_message(p) }),
    }
}

/// Where and how to open a device. The caller fills it (the library's `env` module reads
/// `MOE_LANES_CUDA_DEVICE`, `MOE_LANES_NVRTC_CACHE`, `MOE_LANES_PDL` and `CUDA_HOME` at the edge).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaConfig {
    pub device_ordinal: usize,
    /// Keep compiled cubins here (none: compile once per process).
    pub nvrtc_cache_dir: Option<PathBuf>,
    /// CUDA headers for NVRTC (default `/usr/local/cuda/include`).
    pub cuda_include_dir: Option<PathBuf>,
    /// Launch kernels with programmatic stream serialization where the device has it (compute
    /// capability 9.0 and later): a kernel's blocks may be scheduled while the kernel before it
    /// finishes, and wait there (`pdl_enter` in common.cuh). Default on.
    pub programmatic_launch: bool,
}

impl Default for CudaConfig {
    fn default() -> Self {
        CudaConfig {
            device_ordinal: 0,
            nvrtc_cache_dir: None,
            cuda_include_dir: None,
            programmatic_launch: true,
        }
    }
}

impl CudaBackend {
    /// Device 0 without a cubin cache, or an error saying why there is none — callers fall back
    /// to the CPU and report the error.
    pub fn try_new() -> Result<CudaBackend> {
        CudaBackend::with_config(&CudaConfig::default())
    }

    /// Open the configured device: context, stream, cuBLAS, and the kernels compiled for its
    /// architecture (or loaded from the cubin cache).
    pub fn with_config(config: &CudaConfig) -> Result<CudaBackend> {
        let ordinal = config.device_ordinal;
        probe_libraries()?;
        guard("device start-up", || {
            let count = CudaContext::device_count()
                .map_err(|e| CudaError::NoDriver(format!("cuInit/cuDeviceGetCount: {e}")))?;
            if count <= 0 {
                return Err(CudaError::NoDriver("the driver reports no CUDA devices".into()));
            }
            let ctx = CudaContext::new(ordinal).map_err(|source| CudaError::Device { ordinal, source })?;
            // SAFETY: cudarc's per-slice events order streams that share a `CudaSlice`; here the
            // ordering is ours: the compute stream orders every use of every buffer, the side
            // stream only writes hot-cache slots that the compute stream reads after
            // `wait_event`, copy streams ([`CopyStream`]) only write Post-Fetch scratch slots that
            // the compute stream reads after `wait_event` and that they overwrite only after
            // `wait_event_on` an event the compute stream recorded after its last read, and pinned
            // buffers fence their own copies (`PinnedBuffer::fence_after`).
            unsafe { ctx.disable_event_tracking() };
            let stream = ctx.new_stream().ctx("cuStreamCreate")?;
            let side = ctx.new_stream().ctx("cuStreamCreate(side)")?;
            let info = DeviceInfo {
                ordinal,
                name: ctx.name().ctx("cuDeviceGetName")?,
                compute_capability: ctx.compute_capability().ctx("cuDeviceGetAttribute(cc)")?,
                total_mem_bytes: ctx.total_mem().ctx("cuDeviceTotalMem")?,
                multiprocessors: ctx
                    .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                    .ctx("cuDeviceGetAttribute(sm count)")?,
            };
            let programmatic = config.programmatic_launch && info.compute_capability.0 >= 9;
            let (cubin, compile) = compile_for_arch(&info.arch(), config)?;
            let pipelined = info.has_sm80();
            let (functions, blas) = load_kernels(&ctx, &stream, cubin, pipelined)?;
            let (functions, blas) =
                (std::mem::ManuallyDrop::new(functions), std::mem::ManuallyDrop::new(blas));
            let page_bytes = vmm::device_page_bytes(&ctx);
            Ok(CudaBackend {
                ctx,
                stream,
                side,
                blas,
                functions,
                info,
                compile,
                capturing: Default::default(),
                programmatic,
                grouped_pipeline: pipelined.into(),
                page_bytes,
            })
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    pub fn compile_report(&self) -> &CompileReport {
        &self.compile
    }

    /// Make this backend's context current on the calling thread (needed once per thread).
    pub fn bind_to_thread(&self) -> Result<()> {
        self.ctx.bind_to_thread().ctx("cuCtxSetCurrent")
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().ctx("cuMemGetInfo")
    }

    fn stream_raw(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }

    /// Wait until all queued work is done.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().ctx("cuStreamSynchronize")
    }

    /// A zero-filled device buffer.
    pub fn alloc_zeros<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<DeviceBuffer<T>> {
        let slice = self.stream.alloc_zeros::<T>(len.max(1)).ctx("cuMemAlloc")?;
        let raw = {
            let (raw, _g) = slice.device_ptr(&self.stream);
            raw
        };
        let serial = NEXT_SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(DeviceBuffer { ptr: DPtr { raw, len, _m: PhantomData }, _slice: slice, serial })
    }

    /// A device buffer holding `data`.
    pub fn upload<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        data: &[T],
    ) -> Result<DeviceBuffer<T>> {
        let buf = self.alloc_zeros::<T>(data.len())?;
        self.write(data, buf.ptr())?;
        Ok(buf)
    }

    /// Queue a copy of host `src` into `dst` (pageable memory: `src` is staged before return,
    /// so it may be dropped at once).
    pub fn write<T>(&self, src: &[T], dst: DPtr<T>) -> Result<()> {
        assert!(src.len() <= dst.len, "write: {} elements into {}", src.len(), dst.len);
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` is a live device range of at least `src.len()` elements (checked above),
        // and `src` is borrowed for the call; the async copy from pageable memory is staged by the
        // driver before this call returns.
        unsafe { drv::memcpy_htod_async(dst.raw, src, self.stream_raw()) }.ctx("cuMemcpyHtoDAsync")
    }

    /// Copy `src` to host `dst` and wait for it (and everything queued before it).
    pub fn read<T>(&self, src: DPtr<T>, dst: &mut [T]) -> Result<()> {
        assert!(dst.len() <= src.len, "read: {} elements from {}", dst.len(), src.len);
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: `src` is a live device range of at least `dst.len()` elements (checked above);
        // the stream is synchronised right after, before `dst` is released to the caller.
        unsafe { drv::memcpy_dtoh_async(dst, src.raw, self.stream_raw()) }.ctx("cuMemcpyDtoHAsync")?;
        self.synchronize()
    }

    /// Convenience: copy a whole view back into a new Vec (synchronous).
    pub fn read_vec<T: Copy + Default>(&self, src: DPtr<T>) -> Result<Vec<T>> {
        let mut v = vec![T::default(); src.len];
        self.read(src, &mut v)?;
        Ok(v)
    }

    /// Queue a fill of `dst` with zero bytes.
    pub fn zero<T>(&self, dst: DPtr<T>) -> Result<()> {
        if dst.len == 0 {
            return Ok(());
        }
        // SAFETY: `dst` is a live device range of `dst.len` elements (a `DPtr` cannot outrun its
        // buffer: `sub` checks bounds).
        unsafe { drv::memset_d8_async(dst.raw, 0, dst.len * std::mem::size_of::<T>(), self.stream_raw()) }
            .ctx("cuMemsetD8Async")
    }

    /// Queue a device-to-device copy.
    pub fn copy<T>(&self, src: DPtr<T>, dst: DPtr<T>) -> Result<()> {
        assert!(src.len <= dst.len);
        if src.len == 0 {
            return Ok(());
        }
        // SAFETY: both ranges are live device ranges, `src.len <= dst.len` (checked above).
        unsafe {
            drv::memcpy_dtod_async(dst.raw, src.raw, src.len * std::mem::size_of::<T>(), self.stream_raw())
        }
        .ctx("cuMemcpyDtoDAsync")
    }

    /// Page-locked host memory (not write-combined: the CPU reads it), zero-filled.
    pub fn alloc_pinned<T: Copy + Default>(&self, len: usize) -> Result<PinnedBuffer<T>> {
        self.bind_to_thread()?;
        let bytes = len.max(1) * std::mem::size_of::<T>();
        // SAFETY: a plain allocation call; the result is checked before use.
        let ptr = gate::exclusive(|| unsafe { drv::malloc_host(bytes, 0) }).ctx("cuMemHostAlloc")? as *mut T;
        let fence = drv::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).ctx("cuEventCreate")?;
        // SAFETY: `ptr` is a fresh allocation of at least `len` elements; writing defaults
        // initialises every element before any slice of it is formed.
        unsafe { (0..len).for_each(|i| ptr.add(i).write(T::default())) };
        Ok(PinnedBuffer { ptr, len, ctx: self.ctx.clone(), fence, in_flight: std::cell::Cell::new(false) })
    }

    /// Queue a copy of the first `n` elements of `src` into pinned `dst`. Safe: `dst`'s host
    /// accessors wait until the copy is done.
    pub fn read_async<T: Copy + Default>(
        &self,
        src: DPtr<T>,
        dst: &mut PinnedBuffer<T>,
        n: usize,
    ) -> Result<()> {
        assert!(n <= src.len && n <= dst.len);
        if n == 0 {
            return Ok(());
        }
        // SAFETY: `dst.ptr` holds `dst.len >= n` elements owned by `dst`; the host cannot read,
        // write or free them before the fence recorded right after the copy completes (every
        // accessor and the drop wait for it), and copies on the one stream run in order.
        unsafe {
            let host = std::slice::from_raw_parts_mut(dst.ptr, n);
            drv::memcpy_dtoh_async(host, src.raw, self.stream_raw()).ctx("cuMemcpyDtoHAsync")?;
        }
        dst.fence_after(self.stream_raw(), self.is_capturing())
    }

    /// Queue several copies into ranges of one pinned buffer, `(src, dst_offset)` each copying all
    /// of `src`, fenced once after the last (one event record, one host wait for the batch).
    pub fn read_async_many<T: Copy + Default>(
        &self,
        copies: &[(DPtr<T>, usize)],
        dst: &mut PinnedBuffer<T>,
    ) -> Result<()> {
        for &(src, offset) in copies {
            assert!(offset + src.len <= dst.len, "read_async_many: {}+{} > {}", offset, src.len, dst.len);
            if src.len == 0 {
                continue;
            }
            // SAFETY: as in `read_async`: the range lies inside `dst` (checked above), and the
            // host cannot touch `dst` before the fence recorded after the batch completes.
            unsafe {
                let host = std::slice::from_raw_parts_mut(dst.ptr.add(offset), src.len);
                drv::memcpy_dtoh_async(host, src.raw, self.stream_raw()).ctx("cuMemcpyDtoHAsync")?;
            }
        }
        dst.fence_after(self.stream_raw(), self.is_capturing())
    }

    /// Queue a copy of the first `n` elements of pinned `src` into `dst`. Safe: `src`'s host
    /// accessors wait until the copy is done, so the host cannot change the data under it.
    pub fn write_async<T: Copy + Default>(
        &self,
        src: &PinnedBuffer<T>,
        n: usize,
        dst: DPtr<T>,
    ) -> Result<()> {
        self.htod_async(self.stream_raw(), src, 0..n, dst, "cuMemcpyHtoDAsync")
    }

    /// Queue a copy of `src[range]` (pinned) into `dst` on `stream`, then `src`'s fence: its host
    /// accessors wait until the copy is done. The one body of the `write_async*` copies.
    fn htod_async<T: Copy + Default>(
        &self,
        stream: sys::CUstream,
        src: &PinnedBuffer<T>,
        range: std::ops::Range<usize>,
        dst: DPtr<T>,
        what: &'static str,
    ) -> Result<()> {
        assert!(range.end <= src.len && range.len() <= dst.len);
        if range.is_empty() {
            return Ok(());
        }
        // SAFETY: `src.ptr + range.start` holds `range.len()` initialised elements owned by
        // `src`, kept alive and unchanged until its fence, recorded right after on the same stream;
        // `dst` is a live device range of at least `range.len()` elements (asserted above);
        // `stream` is a live stream of this context (the caller's).
        unsafe {
            let host = std::slice::from_raw_parts(src.ptr.add(range.start), range.len());
            drv::memcpy_htod_async(dst.raw, host, stream).ctx(what)?;
        }
        src.fence_after(stream, stream == self.stream_raw() && self.is_capturing())
    }

    /// Queue a copy of `src[range]` (pinned) into `dst` on the side stream. Safe like
    /// [`CudaBackend::write_async`]: `src`'s host accessors wait until the copy is done.
    pub fn write_async_side<T: Copy + Default>(
        &self,
        src: &PinnedBuffer<T>,
        range: std::ops::Range<usize>,
        dst: DPtr<T>,
    ) -> Result<()> {
        self.htod_async(self.side.cu_stream(), src, range, dst, "cuMemcpyHtoDAsync(side)")
    }

    /// A dedicated host-to-device copy stream (Post-Fetch of cold experts), beside the compute
    /// and side streams; ordered against them only through events.
    pub fn copy_stream(&self) -> Result<CopyStream> {
        self.bind_to_thread()?;
        Ok(CopyStream { stream: self.ctx.new_stream().ctx("cuStreamCreate(copy)")? })
    }

    /// Queue a copy of `src[range]` (pinned) into `dst` on copy stream `cs`. Safe like
    /// [`CudaBackend::write_async`]: `src`'s host accessors wait until the copy is done.
    pub fn write_async_on<T: Copy + Default>(
        &self,
        cs: &CopyStream,
        src: &PinnedBuffer<T>,
        range: std::ops::Range<usize>,
        dst: DPtr<T>,
    ) -> Result<()> {
        self.htod_async(cs.stream.cu_stream(), src, range, dst, "cuMemcpyHtoDAsync(copy)")
    }

    /// Record `ev` on copy stream `cs`: it completes when every copy queued there so far has.
    pub fn record_on(&self, cs: &CopyStream, ev: &GpuEvent) -> Result<()> {
        // SAFETY: `ev` is a live event of this context and `cs` a live stream of it.
        unsafe { drv::event::record(ev.ev, cs.stream.cu_stream()) }.ctx("cuEventRecord(copy)")
    }

    /// Make copy stream `cs` wait (on the GPU, the host goes on) until `ev` completes.
    pub fn wait_event_on(&self, cs: &CopyStream, ev: &GpuEvent) -> Result<()> {
        wait_on(cs.stream.cu_stream(), ev).ctx("cuStreamWaitEvent(copy)")
    }

    /// Copy a small pageable `src` into `dst` on the side stream (the driver stages pageable
    /// memory before returning, so `src` may change afterwards).
    pub fn write_side<T>(&self, src: &[T], dst: DPtr<T>) -> Result<()> {
        assert!(src.len() <= dst.len, "write_side: {} elements into {}", src.len(), dst.len);
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` is a live device range of at least `src.len()` elements (checked above);
        // a copy from pageable memory is staged by the driver before this call returns.
        unsafe { drv::memcpy_htod_async(dst.raw, src, self.side.cu_stream()) }.ctx("cuMemcpyHtoDAsync(side)")
    }

    /// Record `ev` on the side stream: it completes when every side copy queued so far has.
    pub fn record_side(&self, ev: &GpuEvent) -> Result<()> {
        // SAFETY: `ev` is a live event of this context and the side stream is this backend's.
        unsafe { drv::event::record(ev.ev, self.side.cu_stream()) }.ctx("cuEventRecord(side)")
    }

    /// Make the compute stream wait (on the GPU, the host goes on) until `ev` completes.
    pub fn wait_event(&self, ev: &GpuEvent) -> Result<()> {
        wait_on(self.stream_raw(), ev).ctx("cuStreamWaitEvent")
    }

    /// Make the side stream wait (on the GPU, the host goes on) until `ev` completes.
    pub fn wait_event_side(&self, ev: &GpuEvent) -> Result<()> {
        wait_on(self.side.cu_stream(), ev).ctx("cuStreamWaitEvent(side)")
    }

    /// Wait on the host until every side-stream copy is done.
    pub fn synchronize_side(&self) -> Result<()> {
        self.side.synchronize().ctx("cuStreamSynchronize(side)")
    }

    /// A new timing event.
    pub fn event(&self) -> Result<GpuEvent> {
        self.bind_to_thread()?;
        let ev = drv::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).ctx("cuEventCreate")?;
        Ok(GpuEvent { ev, ctx: self.ctx.clone() })
    }

    /// Record `ev` on the stream: it completes when everything queued so far has. While the
    /// stream is being captured ([`CudaBackend::begin_capture`]) the record becomes a node of the
    /// graph (an external record), so the event times every replay.
    pub fn record(&self, ev: &GpuEvent) -> Result<()> {
        if self.is_capturing() {
            let flags = sys::CUevent_record_flags_enum::CU_EVENT_RECORD_EXTERNAL as u32;
            // SAFETY: `ev` is a live event of this context and the stream is this backend's.
            return unsafe { sys::cuEventRecordWithFlags(ev.ev, self.stream_raw(), flags) }
                .result()
                .ctx("cuEventRecordWithFlags");
        }
        // SAFETY: `ev` is a live event of this context and the stream is this backend's.
        unsafe { drv::event::record(ev.ev, self.stream_raw()) }.ctx("cuEventRecord")
    }

    fn is_capturing(&self) -> bool {
        self.capturing.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Start capturing the compute stream's work into a graph instead of running it (this
    /// thread's calls only). Nothing captured may wait on the host: no synchronous copies, no
    /// host access to a pinned buffer, no allocations (asynchronous copies to or from pinned
    /// buffers are captured with their fences: see [`PinnedBuffer::fence_replayed`]);
    /// [`CudaBackend::end_capture`] ends it either way.
    pub fn begin_capture(&self) -> Result<()> {
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        gate::enter_capture();
        if let Err(e) = self.stream.begin_capture(mode).ctx("cuStreamBeginCapture") {
            gate::leave_capture();
            return Err(e);
        }
        self.capturing.store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// End the capture begun by [`CudaBackend::begin_capture`] and instantiate what it holds.
    pub fn end_capture(&self) -> Result<StreamGraph> {
        self.capturing.store(false, std::sync::atomic::Ordering::Relaxed);
        let flags = sys::CUgraphInstantiate_flags(0);
        let ended = self.stream.end_capture(flags).ctx("cuStreamEndCapture");
        gate::leave_capture();
        match ended? {
            Some(graph) => Ok(StreamGraph { graph: std::mem::ManuallyDrop::new(graph) }),
            None => Err(CudaError::Shape { kernel: "graph", reason: "the capture holds no work".into() }),
        }
    }

    /// Queue a replay of `graph` on the compute stream.
    pub fn launch_graph(&self, graph: &StreamGraph) -> Result<()> {
        graph.graph.launch().ctx("cuGraphLaunch")
    }

    fn function(&self, kernel: Kernel) -> &CudaFunction {
        &self.functions[kernel as usize]
    }

    /// Launch `kernel` on the stream. `args` point at the kernel's parameters in order.
    fn launch(
        &self,
        kernel: Kernel,
        grid: (u32, u32, u32),
        block: u32,
        shared_bytes: u32,
        args: &mut [*mut std::ffi::c_void],
    ) -> Result<()> {
        self.launch_on(false, kernel, grid, block, shared_bytes, args)
    }

    /// Launch `kernel` on the side stream (`side`) or the compute stream.
    fn launch_on(
        &self,
        side: bool,
        kernel: Kernel,
        grid: (u32, u32, u32),
        block: u32,
        shared_bytes: u32,
        args: &mut [*mut std::ffi::c_void],
    ) -> Result<()> {
        let stream = if side { self.side.cu_stream() } else { self.stream_raw() };
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        // Programmatic stream serialization (`CudaConfig::programmatic_launch`): the kernel may be
        // scheduled while the kernel before it on `stream` runs; it waits for that kernel
        // (`pdl_enter` in common.cuh) before it touches memory. Without the attribute
        // (`numAttrs` 0) this is a plain launch.
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue { programmaticStreamSerializationAllowed: 1 },
        };
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared_bytes,
            hStream: stream,
            attrs: &mut attr,
            numAttrs: self.programmatic as u32,
        };
        let function = self.function(kernel).cu_function();
        // SAFETY: the kernel was compiled from `kernels/cuda` with the argument list its launcher
        // built in `args` (one pointer per parameter, in order, checked by the typed launchers in
        // `ops.rs`), every device pointer in it is a checked `DPtr` into a live buffer, and
        // `config` and the attribute it points at live on this frame for the whole call.
        unsafe { sys::cuLaunchKernelEx(&config, function, args.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .ctx("cuLaunchKernelEx")
    }
}

/// The driver and the libraries the backend loads (libcuda, libnvrtc, libcublas) are present, or
/// which one is missing.
fn probe_libraries() -> Result<()> {
    let present = guard("library probe", || {
        // SAFETY: probing symbols of dynamically loaded libraries has no preconditions; the
        // calls are guarded (`guard`) so a missing symbol is an error, not a crash.
        Ok(unsafe {
            (
                cudarc::driver::sys::is_culib_present(),
                cudarc::nvrtc::sys::is_culib_present(),
                cudarc::cublas::sys::is_culib_present(),
            )
        })
    })?;
    match present {
        (false, _, _) => return Err(CudaError::NoDriver("libcuda (the NVIDIA driver) was not found".into())),
        (_, false, _) => {
            return Err(CudaError::NoDriver(
                "libnvrtc was not found (add the CUDA lib64 directory to LD_LIBRARY_PATH)".into(),
            ))
        }
        (_, _, false) => {
            return Err(CudaError::NoDriver(
                "libcublas was not found (add the CUDA lib64 directory to LD_LIBRARY_PATH)".into(),
            ))
        }
        _ => {}
    }
    Ok(())
}

/// How many CUDA devices the driver reports (the ordinals `0..n`), or why none is usable, as
/// [`CudaBackend::with_config`] would say.
pub fn device_count() -> Result<usize> {
    probe_libraries()?;
    guard("device count", || {
        let count = CudaContext::device_count()
            .map_err(|e| CudaError::NoDriver(format!("cuInit/cuDeviceGetCount: {e}")))?;
        if count <= 0 {
            return Err(CudaError::NoDriver("the driver reports no CUDA devices".into()));
        }
        Ok(count as usize)
    })
}

/// Let the pipelined grouped GEMMs, the tiled prefill attention over the widest heads, the
/// wide-head tensor-core attention and the tensor-core latent attention take their dynamic
/// shared memory (past the default 48 KiB).
fn allow_pipe_shared(functions: &[CudaFunction]) -> Result<()> {
    let tiles = kernel::attention_tile_shared_bytes(kernel::ATTENTION_TILE_MAX_HEAD_DIM);
    let (rows, decode_rows) = (kernel::GROUPED_TILE_ROWS, kernel::GROUPED_DECODE_TILE_ROWS);
    let pipes = [
        (Kernel::GroupedGateUpBf16Pipe, 2, rows),
        (Kernel::GroupedGemmBf16Pipe, 1, rows),
        (Kernel::GroupedGateUpBf16PipeEpi, 2, rows),
        (Kernel::GroupedGemmBf16PipeBias, 1, rows),
        (Kernel::GroupedGateUpQPipe, 2, rows),
        (Kernel::GroupedGemmQPipe, 1, rows),
        (Kernel::GroupedGateUpQ8_0Pipe, 2, rows),
        (Kernel::GroupedGateUpQ4KPipe, 2, rows),
        (Kernel::GroupedGateUpQ5KPipe, 2, rows),
        (Kernel::GroupedGateUpQ6KPipe, 2, rows),
        (Kernel::GroupedGemmQ8_0Pipe, 1, rows),
        (Kernel::GroupedGemmQ4KPipe, 1, rows),
        (Kernel::GroupedGemmQ5KPipe, 1, rows),
        (Kernel::GroupedGemmQ6KPipe, 1, rows),
        (Kernel::GroupedGateUpMxfp4Pipe, 2, rows),
        (Kernel::GroupedGemmMxfp4Pipe, 1, rows),
        (Kernel::GroupedGateUpBf16Dec, 2, decode_rows),
        (Kernel::GroupedGemmBf16Dec, 1, decode_rows),
        (Kernel::GroupedGateUpBf16DecEpi, 2, decode_rows),
        (Kernel::GroupedGemmBf16DecBias, 1, decode_rows),
        (Kernel::GroupedGateUpQDec, 2, decode_rows),
        (Kernel::GroupedGemmQDec, 1, decode_rows),
        (Kernel::GroupedGateUpQ8_0Dec, 2, decode_rows),
        (Kernel::GroupedGateUpQ4KDec, 2, decode_rows),
        (Kernel::GroupedGateUpQ5KDec, 2, decode_rows),
        (Kernel::GroupedGateUpQ6KDec, 2, decode_rows),
        (Kernel::GroupedGemmQ8_0Dec, 1, decode_rows),
        (Kernel::GroupedGemmQ4KDec, 1, decode_rows),
        (Kernel::GroupedGemmQ5KDec, 1, decode_rows),
        (Kernel::GroupedGemmQ6KDec, 1, decode_rows),
        (Kernel::GroupedGateUpMxfp4Dec, 2, decode_rows),
        (Kernel::GroupedGemmMxfp4Dec, 1, decode_rows),
    ];
    let wide = kernel::attention_mma_wide_shared_bytes(
        kernel::ATTENTION_MMA_WIDE_MAX_HEAD_DIM,
        kernel::ATTENTION_MMA_WARPS as usize,
    );
    // Every KV cache type's instance of the tiled attention; the wide-head and latent
    // tensor-core kernels.
    let large = pipes
        .into_iter()
        .map(|(k, matrices, tile_rows)| (k, kernel::grouped_pipe_shared_bytes(matrices, tile_rows)))
        .chain([
            (Kernel::GroupedGateUpMxfp4Q8, kernel::grouped_q8_shared_bytes(2)),
            (Kernel::GroupedGemmMxfp4Q8, kernel::grouped_q8_shared_bytes(1)),
        ])
        .chain(Kernel::ATTENTION_TILED.map(|k| (k, tiles)))
        .chain(Kernel::ATTENTION_MMA_WIDE.map(|k| (k, wide)))
        .chain(Kernel::MLA_ATTENTION_MMA.map(|k| (k, kernel::mla_mma_shared_bytes())))
        .chain([(Kernel::DeltaChunkScanF32, kernel::delta_scan_shared_bytes())]);
    for (k, bytes) in large {
        let bytes = bytes as i32;
        functions[k as usize]
            .set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes)
            .ctx("cuFuncSetAttribute(max dynamic shared)")?;
    }
    Ok(())
}

/// Make `stream` (a live stream of the backend's context: the callers pass its compute, side or
/// copy streams) wait on the GPU until `ev` completes.
fn wait_on(stream: sys::CUstream, ev: &GpuEvent) -> std::result::Result<(), drv::DriverError> {
    // SAFETY: `ev` is a live event of the context `stream` belongs to (both outlive the call).
    unsafe { drv::stream::wait_event(stream, ev.ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
}

/// FNV-1a 64: a stable hash for the cache key (std's hasher may change between Rust releases).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: `nvrtcVersion` writes two ints through valid pointers.
    unsafe {
        let _ = cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor);
    }
    (major, minor)
}

/// The name NVRTC gives the whole kernel program (and the stem of its cache files).
pub const PROGRAM_NAME: &str = "moe-lanes.cu";

/// Whether libnvrtc can be loaded (no driver or device needed).
pub fn nvrtc_available() -> bool {
    // SAFETY: probing a dynamically loaded library has no preconditions; `guard` turns a panic of
    // the loader into an error.
    guard("nvrtc probe", || Ok(unsafe { cudarc::nvrtc::sys::is_culib_present() })).unwrap_or(false)
}

/// Every kernel ([`kernel_source`]) compiled for `arch` (e.g. `sm_90`), or taken from the
/// configured cubin cache. Needs libnvrtc and the CUDA headers, but no driver or device.
pub fn compile_for_arch(arch: &str, config: &CudaConfig) -> Result<(Vec<u8>, CompileReport)> {
    compile_cached(&kernel_source(), PROGRAM_NAME, arch, config)
}

/// Compile `src` to a cubin for `arch`, or take it from the cache keyed by source hash, options,
/// NVRTC version and arch. The headers' location is not part of the key (their version is
/// NVRTC's), so a cache compiled on a machine without a GPU, with the same NVRTC release's
/// headers elsewhere, serves the GPU machine (`examples/nvrtc_prebuild.rs`). Cache problems are
/// reported in the [`CompileReport`], never fatal.
/// Needs no device; without libnvrtc it is [`CudaError::NoDriver`].
pub fn compile_cached(
    src: &str,
    name: &str,
    arch: &str,
    config: &CudaConfig,
) -> Result<(Vec<u8>, CompileReport)> {
    if !nvrtc_available() {
        return Err(CudaError::NoDriver(
            "libnvrtc was not found (add the CUDA lib64 directory to LD_LIBRARY_PATH)".into(),
        ));
    }
    let options = nvrtc_options(arch, config);
    let (vmaj, vmin) = nvrtc_version();
    let version = format!("nvrtc {vmaj}.{vmin}");
    let keyed: Vec<&str> =
        options.iter().map(String::as_str).filter(|o| !o.starts_with(INCLUDE_OPTION)).collect();
    let key = fnv1a(&[src.as_bytes(), keyed.join(" ").as_bytes(), version.as_bytes(), arch.as_bytes()]);
    let stem = name.trim_end_matches(".cu");
    let cache_path =
        config.nvrtc_cache_dir.as_ref().map(|d| d.join(format!("{stem}-{key:016x}-{arch}.cubin")));
    let (cached, mut cache_note) = cache_path.as_deref().map(read_cached).unwrap_or((None, None));
    if let Some(bytes) = cached {
        let report =
            CompileReport { arch: arch.into(), cache_hit: true, cache_path, compile_ms: 0.0, cache_note };
        return Ok((bytes, report));
    }
    let start = std::time::Instant::now();
    let cubin = nvrtc_compile_cubin(src, name, arch, &options)?;
    let compile_ms = start.elapsed().as_secs_f64() * 1e3;
    if let Some(path) = &cache_path {
        if let Err(e) = write_cached(path, &cubin) {
            cache_note = Some(format!("could not write {}: {e}", path.display()));
        }
    }
    Ok((cubin, CompileReport { arch: arch.into(), cache_hit: false, cache_path, compile_ms, cache_note }))
}

/// The NVRTC option naming the CUDA headers' directory.
const INCLUDE_OPTION: &str = "--include-path=";

/// NVRTC options: target, CUDA headers, language, and the shared `-D` constants.
fn nvrtc_options(arch: &str, config: &CudaConfig) -> Vec<String> {
    let include = config.cuda_include_dir.clone().unwrap_or_else(|| PathBuf::from("/usr/local/cuda/include"));
    vec![
        format!("--gpu-architecture={arch}"),
        format!("{INCLUDE_OPTION}{}", include.display()),
        "--std=c++17".to_string(),
        "--fmad=true".to_string(),
    ]
    .into_iter()
    .chain(kernel::shared_defines())
    .collect()
}

/// A cached cubin, or why the cache file was not used (none when it does not exist yet).
fn read_cached(path: &std::path::Path) -> (Option<Vec<u8>>, Option<String>) {
    match std::fs::read(path) {
        Ok(bytes) if !bytes.is_empty() => (Some(bytes), None),
        Ok(_) => (None, Some(format!("{}: empty cache file ignored", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => (None, None),
        Err(e) => (None, Some(format!("{}: {e}", path.display()))),
    }
}

/// Write a cubin to the cache atomically (temporary file, then rename).
fn write_cached(path: &std::path::Path, cubin: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(path.parent().expect("cache file has a parent"))?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, cubin)?;
    std::fs::rename(&tmp, path)
}

fn nvrtc_compile_cubin(src: &str, name: &str, arch: &str, options: &[String]) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result as nr, sys as ns};
    use std::ffi::{CStr, CString};
    let err = |message: String| CudaError::Compile { name: name.into(), arch: arch.into(), message };
    let c_src = CString::new(src).map_err(|e| err(e.to_string()))?;
    let c_name = CString::new(name).map_err(|e| err(e.to_string()))?;
    let prog = nr::create_program(&c_src, Some(&c_name)).map_err(|e| err(format!("create: {e}")))?;
    // SAFETY: `prog` is the live program created above; it is destroyed once, below.
    let result = (|| unsafe {
        if let Err(e) = nr::compile_program(prog, options) {
            let log = nr::get_program_log(prog).unwrap_or_default();
            let log = CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned();
            return Err(err(format!("{e}; options {options:?}; log:\n{log}")));
        }
        let mut size = 0usize;
        ns::nvrtcGetCUBINSize(prog, &mut size)
            .result()
            .map_err(|e| err(format!("nvrtcGetCUBINSize: {e}")))?;
        let mut cubin = vec![0u8; size];
        ns::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut std::ffi::c_char)
            .result()
            .map_err(|e| err(format!("nvrtcGetCUBIN: {e}")))?;
        Ok(cubin)
    })();
    // SAFETY: `prog` is live and not used after this.
    unsafe {
        let _ = nr::destroy_program(prog);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn try_new_returns_instead_of_panicking() {
        match CudaBackend::try_new() {
            Ok(b) => eprintln!("CUDA device: {:?}", b.info()),
            Err(e) => eprintln!("no CUDA (expected on CI): {e}"),
        }
    }

    fn view(len: usize) -> DPtr<f32> {
        DPtr { raw: 0x1000, len, _m: PhantomData }
    }

    #[test]
    fn sub_views_stay_inside_their_view() {
        let v = view(10);
        assert_eq!((v.sub(2, 8).raw(), v.sub(2, 8).len()), (0x1008, 8));
        assert_eq!((v.from(10).raw(), v.from(10).len()), (0x1028, 0));
        assert_eq!(v.sub(0, 0).len(), 0);
    }

    #[test]
    #[should_panic(expected = "DPtr::sub out of range")]
    fn sub_past_the_end_panics() {
        view(10).sub(3, 8);
    }

    #[test]
    #[should_panic(expected = "DPtr::sub out of range")]
    fn sub_with_an_overflowing_end_panics() {
        view(10).sub(1, usize::MAX);
    }

    #[test]
    #[should_panic(expected = "DPtr::from out of range")]
    fn from_past_the_end_panics() {
        view(10).from(11);
    }

    #[test]
    fn cache_key_is_stable() {
        assert_eq!(fnv1a(&[b"abc"]), fnv1a(&[b"abc"]));
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
    }
}
