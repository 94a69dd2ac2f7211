//! The latent attention's per-head key and value projections in the one form every engine
//! reads: llama.cpp's split, `k_b` `[heads, kv_lora_rank, nope]` (a head's query absorbed into
//! the latent is `k_b[h] · q_nope`) and `v_b` `[heads, v, kv_lora_rank]` (its value is
//! `v_b[h] · latent`). GGUF files from llama.cpp's converter store them so; transformers'
//! checkpoints (and older GGUF files) store one `kv_b_proj` `[heads * (nope + v), kv_lora_rank]`,
//! which is rewritten here once at open (float types only: a transposition of elements).

use crate::format::dtype::DType;
use crate::format::tensor::TensorRef;
use crate::model::arch::LatentAttentionSpec;
use crate::model::ModelError;
use std::path::Path;

/// One layer's `k_b` and `v_b` made from a fused `kv_b` (their bytes and shapes).
pub struct OwnedKvB {
    pub dtype: DType,
    pub k_b: Vec<u8>,
    pub v_b: Vec<u8>,
    pub k_shape: [usize; 3],
    pub v_shape: [usize; 3],
}

impl OwnedKvB {
    pub fn views(&self) -> (TensorRef<'_>, TensorRef<'_>) {
        let k = TensorRef {
            name: "k_b (from kv_b_proj)",
            dtype: self.dtype,
            shape: &self.k_shape,
            data: &self.k_b,
        };
        let v = TensorRef {
            name: "v_b (from kv_b_proj)",
            dtype: self.dtype,
            shape: &self.v_shape,
            data: &self.v_b,
        };
        (k, v)
    }
}

/// The shapes of `k_b` and `v_b` for a layer of kind `m`.
pub fn split_shapes(m: &LatentAttentionSpec) -> ([usize; 3], [usize; 3]) {
    ([m.n_heads, m.kv_lora_rank, m.nope_dim], [m.n_heads, m.v_dim, m.kv_lora_rank])
}

/// Split a fused `kv_b` (`[heads * (nope + v), kv_lora_rank]`, checked by the caller) into
/// `k_b` (each head's key rows transposed) and `v_b` (each head's value rows as they are).
pub fn split_kv_b(path: &Path, kv_b: TensorRef<'_>, m: &LatentAttentionSpec) -> Result<OwnedKvB, ModelError> {
    if !kv_b.dtype.is_float() {
        return Err(ModelError::DTypeMismatch {
            path: path.into(),
            tensor: kv_b.name.into(),
            dtype: kv_b.dtype,
            allowed: "F32, F16 or BF16 (a quantised fused kv_b cannot be split: convert with a llama.cpp that writes attn_k_b and attn_v_b)",
        });
    }
    let es = kv_b.dtype.bytes_for(1).expect("float types have an element size");
    let (rank, nope, v) = (m.kv_lora_rank, m.nope_dim, m.v_dim);
    let row = rank * es;
    let (mut k_b, mut v_b) =
        (vec![0u8; m.n_heads * rank * nope * es], Vec::with_capacity(m.n_heads * v * row));
    for h in 0..m.n_heads {
        let head = &kv_b.data[h * (nope + v) * row..(h + 1) * (nope + v) * row];
        for i in 0..nope {
            for c in 0..rank {
                let to = ((h * rank + c) * nope + i) * es;
                k_b[to..to + es].copy_from_slice(&head[i * row + c * es..][..es]);
            }
        }
        v_b.extend_from_slice(&head[nope * row..]);
    }
    let (k_shape, v_shape) = split_shapes(m);
    Ok(OwnedKvB { dtype: kv_b.dtype, k_b, v_b, k_shape, v_shape })
}
