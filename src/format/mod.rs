//! File formats and raw tensors: element types, zero-copy tensor views, the GGUF and safetensors
//! readers and writers. Knows nothing of models or engines.

pub mod dtype;
pub mod gguf;
pub mod quant;
pub mod safetensors;
pub mod tensor;
mod write_util;

pub use write_util::remove_partial_files;
