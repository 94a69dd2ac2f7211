//! Device memory committed on demand behind an address that never moves ([`PagedBuffer`]), as
//! vAttention does for KV caches: the buffer reserves a contiguous range of device virtual
//! addresses for its whole size once (`cuMemAddressReserve`), and physical pages are created and
//! mapped into it front to back as the owner asks for them ([`CudaBackend::commit_paged`]:
//! `cuMemCreate`, `cuMemMap`, `cuMemSetAccess`). Kernels and captured graphs see one plain
//! pointer, as into a [`super::DeviceBuffer`]; they must only touch the committed front.
//!
//! Pages are the device's minimum allocation granularity (2 MiB on the H100 and H200,
//! [`CudaBackend::page_bytes`]); each commit maps one chunk of whole pages and zeroes it on the
//! compute stream, so fresh bytes read as zero, as a buffer from `alloc_zeros` does. Where the
//! device or driver has no virtual memory management, [`CudaBackend::page_bytes`] is `None` and
//! [`CudaBackend::reserve_paged`] fails: the callers fall back to whole buffers. The mapping
//! calls pass the capture gate (`gate.rs`), as the other calls that may synchronize the context.

use super::{gate, guard, CudaBackend, CudaError, DPtr, DrvCtx, Result, NEXT_SERIAL};
use cudarc::driver::{sys, CudaContext, CudaStream};
use std::marker::PhantomData;
use std::sync::Arc;

/// One chunk of physical pages mapped at `offset` bytes into the reserved range.
struct Chunk {
    offset: usize,
    bytes: usize,
    handle: sys::CUmemGenericAllocationHandle,
}

/// A device allocation of `len_bytes` whose virtual addresses are reserved whole and whose
/// physical pages are committed front to back on demand ([`CudaBackend::commit_paged`]).
pub struct PagedBuffer {
    /// Start of the reserved range.
    base: sys::CUdeviceptr,
    /// The bytes asked for; the pointer's length.
    len_bytes: usize,
    /// The reserved range: `len_bytes` rounded up to whole pages.
    reserved_bytes: usize,
    page_bytes: usize,
    /// Mapped chunks, in address order, covering `[0, committed_bytes)`.
    chunks: Vec<Chunk>,
    committed_bytes: usize,
    /// The compute stream of the backend that made it: the zeroing runs there, and the drop
    /// waits for it before unmapping.
    stream: Arc<CudaStream>,
    serial: u64,
}

impl PagedBuffer {
    /// The whole buffer as bytes (only the committed front may be touched).
    pub fn ptr(&self) -> DPtr<u8> {
        DPtr { raw: self.base, len: self.len_bytes, _m: PhantomData }
    }
    /// Bytes backed by physical pages (whole pages).
    pub fn committed_bytes(&self) -> usize {
        self.committed_bytes
    }
    /// Bytes of the reserved address range (whole pages): what committing everything costs.
    pub fn reserved_bytes(&self) -> usize {
        self.reserved_bytes
    }
    /// The bytes asked for at reservation.
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }
    /// The page size it commits in.
    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }
    /// This allocation's serial number, from the counter [`super::DeviceBuffer::serial`] uses.
    pub fn serial(&self) -> u64 {
        self.serial
    }
}

/// The properties of pinned device memory on `device` (the only kind the KV caches commit).
fn device_prop(device: sys::CUdevice) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// The device's page size for mapped memory (its minimum allocation granularity), or `None`
/// where it has no virtual memory management (or the driver lacks the calls).
pub(super) fn device_page_bytes(ctx: &CudaContext) -> Option<usize> {
    let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED;
    if ctx.attribute(attr).ok()? == 0 {
        return None;
    }
    let prop = device_prop(ctx.cu_device());
    let flag = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
    let mut bytes = 0usize;
    let found = guard("cuMemGetAllocationGranularity", || {
        // SAFETY: `bytes` and `prop` are live locals the call reads and writes for its duration.
        unsafe { sys::cuMemGetAllocationGranularity(&mut bytes, &prop, flag) }
            .result()
            .ctx("cuMemGetAllocationGranularity")
    });
    found.ok().filter(|_| bytes > 0).map(|_| bytes)
}

impl CudaBackend {
    /// The page size [`PagedBuffer`]s commit in on this device, or `None` where the device or
    /// driver has no virtual memory management (whole buffers then).
    pub fn page_bytes(&self) -> Option<usize> {
        self.page_bytes
    }

    /// Reserve device addresses for `bytes` (rounded up to whole pages) with nothing committed
    /// yet. Fails where the device has no virtual memory management or the driver refuses.
    pub fn reserve_paged(&self, bytes: usize) -> Result<PagedBuffer> {
        let Some(page_bytes) = self.page_bytes else {
            return Err(CudaError::NoVirtualMemory { ordinal: self.info.ordinal });
        };
        self.bind_to_thread()?;
        let reserved_bytes = bytes.max(1).div_ceil(page_bytes) * page_bytes;
        let mut base: sys::CUdeviceptr = 0;
        guard("cuMemAddressReserve", || {
            // SAFETY: `base` is a live local the call writes; a zero address and alignment let
            // the driver choose (aligned to the granularity).
            unsafe { sys::cuMemAddressReserve(&mut base, reserved_bytes, 0, 0, 0) }
                .result()
                .ctx("cuMemAddressReserve")
        })?;
        Ok(PagedBuffer {
            base,
            len_bytes: bytes,
            reserved_bytes,
            page_bytes,
            chunks: Vec::new(),
            committed_bytes: 0,
            stream: self.stream.clone(),
            serial: NEXT_SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        })
    }

    /// Commit `buf`'s first `bytes` (rounded up to whole pages, at most the reservation): the
    /// pages past what is committed are mapped as one chunk and zeroed on the compute stream
    /// (queued: later work on the stream sees zeros). Whether it grew.
    pub fn commit_paged(&self, buf: &mut PagedBuffer, bytes: usize) -> Result<bool> {
        assert!(Arc::ptr_eq(&buf.stream, &self.stream), "a paged buffer commits on the backend that made it");
        let target = bytes.div_ceil(buf.page_bytes).saturating_mul(buf.page_bytes).min(buf.reserved_bytes);
        if target <= buf.committed_bytes {
            return Ok(false);
        }
        self.bind_to_thread()?;
        let (offset, size) = (buf.committed_bytes, target - buf.committed_bytes);
        let handle = self.map_chunk(buf.base + offset as u64, size)?;
        buf.chunks.push(Chunk { offset, bytes: size, handle });
        buf.committed_bytes = target;
        self.zero(DPtr::<u8> { raw: buf.base + offset as u64, len: size, _m: PhantomData })?;
        Ok(true)
    }

    /// Create `size` bytes of physical pages on this device, map them at `at` (inside a
    /// reservation, not mapped yet) and make them readable and writable by the device; the
    /// handle, to unmap and release at the end. Nothing is left behind on failure.
    fn map_chunk(&self, at: sys::CUdeviceptr, size: usize) -> Result<sys::CUmemGenericAllocationHandle> {
        let prop = device_prop(self.ctx.cu_device());
        // The gate outside the guard: a panic inside (a missing symbol) must not leave it shut.
        gate::exclusive(|| {
            guard("cuMemCreate/cuMemMap", || {
                let handle = create(&prop, size)?;
                map_read_write(at, size, handle, prop.location).inspect_err(|_| release(handle))?;
                Ok(handle)
            })
        })
    }
}

/// A physical allocation of `size` bytes (whole pages) with `prop`'s properties.
fn create(prop: &sys::CUmemAllocationProp, size: usize) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: `handle` is a live local the call writes and `prop` a live reference; `size` is
    // whole pages of the device's granularity (the caller rounds it).
    unsafe { sys::cuMemCreate(&mut handle, size, prop, 0) }.result().ctx("cuMemCreate")?;
    Ok(handle)
}

/// Map `handle`'s `size` bytes at `at` and let the device at `location` read and write them;
/// unmapped again where the access cannot be set.
fn map_read_write(
    at: sys::CUdeviceptr,
    size: usize,
    handle: sys::CUmemGenericAllocationHandle,
    location: sys::CUmemLocation,
) -> Result<()> {
    // SAFETY: `[at, at + size)` lies inside a reservation of the current context and is not
    // mapped (the caller maps past its committed front); `handle` is a live allocation of
    // `size` bytes.
    unsafe { sys::cuMemMap(at, size, 0, handle, 0) }.result().ctx("cuMemMap")?;
    let access =
        sys::CUmemAccessDesc { location, flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
    // SAFETY: the range was mapped just above; `access` is a live local the call reads.
    unsafe { sys::cuMemSetAccess(at, size, &access, 1) }
        .result()
        .ctx("cuMemSetAccess")
        .inspect_err(|_| unmap(at, size))
}

/// Unmap `[at, at + size)`, a whole mapped chunk, ignoring errors (teardown and failure paths).
fn unmap(at: sys::CUdeviceptr, size: usize) {
    // SAFETY: the callers pass a chunk they mapped whole and that no queued work uses any more.
    let _ = unsafe { sys::cuMemUnmap(at, size) };
}

/// Release a physical allocation handle, ignoring errors (teardown and failure paths).
fn release(handle: sys::CUmemGenericAllocationHandle) {
    // SAFETY: the callers pass a handle they created and release once; its mappings, if any,
    // keep the memory until they are unmapped.
    let _ = unsafe { sys::cuMemRelease(handle) };
}

impl Drop for PagedBuffer {
    /// Waits for the compute stream (queued work may still read the pages), then unmaps and
    /// releases every chunk and frees the reserved range, through the capture gate.
    fn drop(&mut self) {
        let _ = self.stream.context().bind_to_thread();
        let _ = self.stream.synchronize();
        let (base, reserved_bytes, chunks) =
            (self.base, self.reserved_bytes, std::mem::take(&mut self.chunks));
        let _ = gate::exclusive(|| {
            guard("paged buffer teardown", || {
                for c in &chunks {
                    unmap(base + c.offset as u64, c.bytes);
                    release(c.handle);
                }
                // SAFETY: the range was reserved by `reserve_paged` with this size, nothing is
                // mapped in it any more (unmapped above), and it is freed once, here.
                let _ = unsafe { sys::cuMemAddressFree(base, reserved_bytes) };
                Ok(())
            })
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_prop_names_pinned_memory_on_the_device() {
        let p = device_prop(3);
        assert_eq!(p.type_, sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED);
        assert_eq!(
            (p.location.type_, p.location.id),
            (sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, 3)
        );
        assert_eq!(p.requestedHandleTypes, sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE);
    }
}
