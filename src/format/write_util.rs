//! Pieces shared by the atomic file writers (GGUF, safetensors): the temporary name a file is
//! written under before the rename, and a writer that counts what passes through it (so a `fill`
//! callback that writes too few or too many bytes is caught).

use std::io::Write;
use std::path::{Path, PathBuf};

/// `<path>.tmp`, in the same directory as `path` (so the final rename stays on one filesystem).
pub(crate) fn tmp_path_of(path: &Path) -> PathBuf {
    // Unique per process and call, so concurrent writers of one target (four first-run demos,
    // say) each write their own file and the atomic renames cannot trip over each other.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut name = path.as_os_str().to_os_string();
    name.push(format!(".{}.{n}.tmp", std::process::id()));
    PathBuf::from(name)
}

/// Passes writes through and counts the bytes.
pub(crate) struct CountingWriter<'a> {
    pub inner: &'a mut dyn Write,
    pub n_bytes: u64,
}

impl Write for CountingWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.n_bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}
