//! Operating-system queries the crates need, kept here with the workspace's other FFI.

use std::path::Path;

/// Bytes free to an unprivileged writer on the filesystem of `dir` (`None` when unknown).
pub fn free_disk_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c_path` is a NUL-terminated path and `stat` points to writable memory of the
    // struct's size; statvfs writes nothing else.
    let rc = unsafe { libc::statvfs(c_path.as_ptr(), stat.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it filled the struct.
    let stat = unsafe { stat.assume_init() };
    #[allow(clippy::unnecessary_cast)] // u64 on some targets, u32/u64 mixes on others
    (stat.f_bavail as u64).checked_mul(stat.f_frsize as u64)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_current_directory_has_a_size() {
        assert!(super::free_disk_bytes(std::path::Path::new(".")).is_some());
        assert!(super::free_disk_bytes(std::path::Path::new("/no/such/dir")).is_none());
    }
}
