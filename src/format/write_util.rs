//! Pieces shared by the atomic file writers (GGUF, safetensors): the temporary name a file is
//! written under before the rename, and a writer that counts what passes through it (so a `fill`
//! callback that writes too few or too many bytes is caught).

use std::io::Write;
use std::path::{Path, PathBuf};

/// `<path>.tmp`, in the same directory as `path` (so the final rename stays on one filesystem).
pub(crate) fn tmp_path_of(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_os_string();
    name.push(".tmp");
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
