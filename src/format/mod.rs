//! File formats and raw tensors: element types, zero-copy tensor views, the GGUF and safetensors
//! readers and writers. Knows nothing of models or engines.

pub mod dtype;
pub mod gguf;
pub mod quant;
pub mod safetensors;
pub mod tensor;
pub(crate) mod write_util;

pub use write_util::remove_partial_files;

/// `MADV_POPULATE_READ` over a whole read-only map, for both readers (Linux 5.14 and later;
/// elsewhere, or on an older kernel that refuses the advice, nothing happens and pages fault on
/// first use as before).
pub(crate) fn populate_map(map: &memmap2::Mmap) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        match map.advise(memmap2::Advice::PopulateRead) {
            Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => Ok(()), // EINVAL: no such advice
            other => other,
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = map;
        Ok(())
    }
}
