//! Errors of the kernel crate: bad shapes, unsupported SIMD levels, bad environment settings.

use thiserror::Error;

/// Everything that can go wrong when calling a kernel, the cold pool or the kernel bench.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum KernelError {
    /// `MOE_LANES_SIMD` (or a parsed name) is not one of `scalar|avx2|avx512|avx512bf16|amx`.
    #[error("unknown SIMD level name {name:?} (expected scalar, avx2, avx512, avx512bf16 or amx)")]
    UnknownSimdLevel { name: String },
    /// A decode-activations name (`--activations`) is not `f32`, `q8` or `auto`.
    #[error("unknown activations {name:?} (expected f32, q8 or auto)")]
    UnknownActivations { name: String },
    /// A SIMD level was requested that this CPU (or this build target) cannot run.
    #[error("SIMD level {level} is not supported by this CPU (available: {available})")]
    UnsupportedSimdLevel { level: &'static str, available: String },
    /// A slice does not have the length its shape implies.
    #[error("shape mismatch for {what}: expected {expected} elements/bytes, got {actual}")]
    ShapeMismatch { what: &'static str, expected: usize, actual: usize },
    /// A row range lies outside the matrix.
    #[error("row range {start}..{end} out of bounds for {what} with {rows} rows")]
    RowRangeOutOfBounds { what: &'static str, start: usize, end: usize, rows: usize },
    /// A token index points past the end of the activation rows.
    #[error("token index {index} out of bounds for {n_tokens} tokens")]
    TokenIndexOutOfBounds { index: usize, n_tokens: usize },
    /// A pool worker panicked while running a job; the output is unspecified.
    #[error("a cold pool worker panicked while running a job")]
    WorkerPanicked,
    /// Invalid bench or pool option.
    #[error("invalid option: {0}")]
    InvalidOption(String),
    /// The operating system refused a pool worker thread (a process or memory limit).
    #[error("cannot start cold pool thread {index} of {n_threads}: {reason}")]
    Spawn { index: usize, n_threads: usize, reason: String },
}
