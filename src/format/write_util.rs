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
    let tmp = PathBuf::from(name);
    PARTIAL.lock().unwrap_or_else(|e| e.into_inner()).push(tmp.clone());
    tmp
}

/// Every temporary path handed out by [`tmp_path_of`] in this process. After a rename or a
/// clean-up the path no longer exists, so removing it again is harmless.
static PARTIAL: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// Remove every temporary file or directory this process's writers have not finished (for an
/// interrupt handler: ctrl-c during `synth` leaves nothing that looks like a model).
pub fn remove_partial_files() {
    let paths = std::mem::take(&mut *PARTIAL.lock().unwrap_or_else(|e| e.into_inner()));
    for p in paths {
        if p.is_dir() {
            let _ = std::fs::remove_dir_all(&p);
        } else {
            let _ = std::fs::remove_file(&p);
        }
    }
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
