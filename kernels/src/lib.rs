//! Compute kernels for moe-lanes. This crate knows nothing of models, files or actors: it takes
//! slices and shapes and computes. CPU kernels pick their SIMD level at run time.
pub mod cuda;
