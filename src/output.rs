//! The one rule for every file the CLI and the server write (`synth`, `quantize`, `learn --out`,
//! `--perf-json`, `--trace`): checked before any work, written under a temporary name in the
//! same directory and renamed into place when complete.
//!
//! [`check_output`] refuses
//! - a path whose directory does not exist,
//! - an existing path that is not a regular file (a device node, a FIFO, a socket, a symlink):
//!   the rename would put a regular file in its place,
//! - an existing file without `force` (`--force`),
//! - one of the command's inputs (the model it reads, under any name: compared by device and
//!   inode, so a hard link to the model is caught too; a file inside a model directory counts as
//!   the model).

use crate::format::write_util::tmp_path_of;
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    #[error("{path}: {reason}")]
    Refused { path: PathBuf, reason: String },
    #[error("{path}: cannot write: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

/// What may already be at an output path besides a regular file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputKind {
    /// A file: an existing directory is refused.
    File,
    /// A file or a directory (safetensors checkpoints are directories).
    FileOrDir,
}

/// Check that `path` may be written (the module's rule); `inputs` are the files the command
/// reads (never overwritten, `force` or not).
pub fn check_output(path: &Path, force: bool, inputs: &[&Path], kind: OutputKind) -> Result<(), OutputError> {
    let refused = |reason: String| Err(OutputError::Refused { path: path.into(), reason });
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if !parent.is_dir() {
        return refused(format!("directory {} does not exist", parent.display()));
    }
    let Ok(meta) = std::fs::symlink_metadata(path) else { return Ok(()) };
    if meta.is_dir() && kind == OutputKind::File {
        return refused("is a directory".into());
    }
    if !meta.is_file() && !meta.is_dir() {
        return refused(
            "exists and is not a regular file (a device, FIFO, socket or symlink); refusing to replace it"
                .into(),
        );
    }
    if let Some(input) = inputs.iter().find(|i| same_file(path, i) || in_dir(path, i)) {
        return refused(format!("is the input {}; refusing to overwrite it", input.display()));
    }
    if !force {
        return refused("already exists (pass --force to replace it)".into());
    }
    Ok(())
}

/// Whether `a` and `b` name the same file (device and inode; false when either is missing).
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Whether `path` names a file directly inside the directory `dir` (a safetensors model's files).
fn in_dir(path: &Path, dir: &Path) -> bool {
    match (path.canonicalize(), dir.canonicalize()) {
        (Ok(p), Ok(d)) => d.is_dir() && p.parent() == Some(d.as_path()),
        _ => false,
    }
}

/// Bytes free to an unprivileged writer on the filesystem of `dir` (`None` when unknown).
pub fn free_bytes(dir: &Path) -> Option<u64> {
    moe_lanes_kernels::sys::free_disk_bytes(dir)
}

/// Write `bytes` to `path`: a temporary file in the same directory, synced, then renamed (never
/// a partial file at `path`; the temporary file is removed on error). Check the path first with
/// [`check_output`].
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), OutputError> {
    let mut file = AtomicFile::create(path)?;
    file.write_all(bytes).map_err(|source| OutputError::Io { path: path.into(), source })?;
    file.commit()
}

/// A file written under a temporary name and renamed to its path by [`AtomicFile::commit`]
/// (dropped uncommitted, the temporary file is removed; an interrupt removes it too,
/// [`crate::format::remove_partial_files`]).
pub struct AtomicFile {
    path: PathBuf,
    tmp: PathBuf,
    file: Option<std::fs::File>,
}

impl AtomicFile {
    pub fn create(path: &Path) -> Result<AtomicFile, OutputError> {
        let tmp = tmp_path_of(path);
        let file =
            std::fs::File::create(&tmp).map_err(|source| OutputError::Io { path: path.into(), source })?;
        Ok(AtomicFile { path: path.into(), tmp, file: Some(file) })
    }

    /// Sync and rename into place.
    pub fn commit(mut self) -> Result<(), OutputError> {
        let file = self.file.take().expect("committed once");
        let err = |source| OutputError::Io { path: self.path.clone(), source };
        let done = file.sync_all().and_then(|_| std::fs::rename(&self.tmp, &self.path)).map_err(err);
        if done.is_err() {
            let _ = std::fs::remove_file(&self.tmp);
        }
        done
    }

    /// The path the file is renamed to.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.file.as_mut().expect("not committed").write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.file.as_mut().expect("not committed").flush()
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rule() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("m.gguf");
        std::fs::write(&model, b"model").unwrap();
        let link = dir.path().join("link.gguf");
        std::fs::hard_link(&model, &link).unwrap();
        let out = dir.path().join("out.json");
        assert!(check_output(&out, false, &[&model], OutputKind::File).is_ok());
        for p in [&model, &link] {
            let e = check_output(p, true, &[&model], OutputKind::File).unwrap_err().to_string();
            assert!(e.contains("is the input"), "{e}");
        }
        write_atomic(&out, b"x").unwrap();
        assert!(check_output(&out, false, &[&model], OutputKind::File).is_err());
        assert!(check_output(&out, true, &[&model], OutputKind::File).is_ok());
        assert!(check_output(dir.path(), true, &[], OutputKind::File).is_err());
        assert!(check_output(dir.path(), true, &[], OutputKind::FileOrDir).is_ok());
        assert!(check_output(Path::new("/dev/null"), true, &[], OutputKind::File).is_err());
        assert!(check_output(&dir.path().join("no/such"), true, &[], OutputKind::File).is_err());
        drop(AtomicFile::create(&dir.path().join("dropped")).unwrap());
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(names.len(), 3, "no temporary file left: {names:?}");
    }
}
