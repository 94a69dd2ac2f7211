//! `moe-lanes quantize`: rewrite a GGUF file with its matrices in GGML quantised blocks, the
//! tensor types chosen per tensor like llama.cpp's `llama_tensor_get_type` for the same mix, in
//! the layout llama.cpp reads (same metadata, `general.file_type`, aligned data, tmp + rename).
//!
//! Type choice for a mix with default type `D` (Q8_0, Q4_0, Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K or
//! Q6_K):
//! - vectors (norms, biases), the router and the shared expert's gate (`ffn_gate_inp*`) keep
//!   their type, as llama.cpp never quantises them;
//! - `output.weight` (or `token_embd.weight` when embeddings are tied): Q6_K unless `D` is Q8_0;
//! - `attn_v`: Q6_K in the layers `use_more_bits` picks for Q4_K_M / Q5_K_M, Q5_K for IQ4_NL when
//!   four or more query heads share a key/value head; Q8_0 in any mix when the model has exactly
//!   8 experts (llama.cpp's rule for 8-expert models);
//! - `attn_k`: Q8_0 when the model has 8 experts;
//! - `attn_output`: Q5_K for Q4_K_M and IQ4_NL when the model has 8 experts;
//! - every `ffn_down*` (experts and shared expert): Q6_K in the `use_more_bits` layers for
//!   Q4_K_M / Q5_K_M, Q5_K in the first eighth of the layers for IQ4_NL (no importance matrix);
//! - everything else `D`.
//!
//! `mxfp4_moe` (llama.cpp's `LLAMA_FTYPE_MOSTLY_MXFP4_MOE`) has rules of its own: every 3-D
//! tensor with more than one matrix (`ne[2] > 1`: the expert stacks, and as in llama.cpp also
//! DeepSeek's 3-D `attn_k_b`/`attn_v_b`) MXFP4, every other quantised matrix (the output and the
//! embedding included) Q8_0; no `use_more_bits` or 8-expert bumps.
//!
//! A row whose length is not a whole number of the chosen type's blocks falls back as llama.cpp's
//! `tensor_type_fallback` does: Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0 (rows of 32s: GLM-4.5-Air's
//! dense FFN of 10944, DeepSeek-V3's 128-wide `attn_k_b`), and to F16 where the row is not whole
//! 32s either. The quantisation itself is `format::quant` (llama.cpp's reference rounding for
//! Q5_0, Q5_1 and MXFP4, and for IQ4_NL its `quantize_row_iq4_nl_ref`, without the scale search
//! `llama-quantize` adds; its own scale/min search for the K types).

use crate::format::dtype::DType;
use crate::format::gguf::{GgufError, GgufFile, GgufWriter, MetaValue};
use crate::format::quant::{check_mxfp4_scales, quantize, QuantError};
use crate::format::tensor::{encode_f32, TensorError, TensorRef};
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// A quantisation mix, as llama.cpp names its file types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[allow(non_camel_case_types)]
pub enum QuantMix {
    #[serde(rename = "q8_0")]
    Q8_0,
    #[serde(rename = "q4_0")]
    Q4_0,
    #[serde(rename = "q4_k_m")]
    Q4_K_M,
    #[serde(rename = "q5_k_m")]
    Q5_K_M,
    #[serde(rename = "q6_k")]
    Q6_K,
    #[serde(rename = "mxfp4_moe")]
    MXFP4_MOE,
    #[serde(rename = "q5_0")]
    Q5_0,
    #[serde(rename = "q5_1")]
    Q5_1,
    #[serde(rename = "iq4_nl")]
    IQ4_NL,
}

impl QuantMix {
    pub const ALL: [QuantMix; 9] = [
        QuantMix::Q8_0,
        QuantMix::Q4_0,
        QuantMix::Q4_K_M,
        QuantMix::Q5_K_M,
        QuantMix::Q6_K,
        QuantMix::MXFP4_MOE,
        QuantMix::Q5_0,
        QuantMix::Q5_1,
        QuantMix::IQ4_NL,
    ];

    /// The name `--type` takes (lower case).
    pub fn name(self) -> &'static str {
        match self {
            QuantMix::Q8_0 => "q8_0",
            QuantMix::Q4_0 => "q4_0",
            QuantMix::Q4_K_M => "q4_k_m",
            QuantMix::Q5_K_M => "q5_k_m",
            QuantMix::Q6_K => "q6_k",
            QuantMix::MXFP4_MOE => "mxfp4_moe",
            QuantMix::Q5_0 => "q5_0",
            QuantMix::Q5_1 => "q5_1",
            QuantMix::IQ4_NL => "iq4_nl",
        }
    }

    /// Parse a `--type` name, case-insensitive.
    pub fn parse(name: &str) -> Option<QuantMix> {
        let lowered = name.trim().to_ascii_lowercase();
        QuantMix::ALL.into_iter().find(|m| m.name() == lowered)
    }

    /// The type of most matrices.
    pub fn default_type(self) -> DType {
        match self {
            QuantMix::Q8_0 => DType::Q8_0,
            QuantMix::Q4_0 => DType::Q4_0,
            QuantMix::Q4_K_M => DType::Q4_K,
            QuantMix::Q5_K_M => DType::Q5_K,
            QuantMix::Q6_K => DType::Q6_K,
            QuantMix::MXFP4_MOE => DType::MXFP4,
            QuantMix::Q5_0 => DType::Q5_0,
            QuantMix::Q5_1 => DType::Q5_1,
            QuantMix::IQ4_NL => DType::IQ4_NL,
        }
    }

    /// llama.cpp's `llama_ftype` id, written as `general.file_type`.
    pub fn file_type(self) -> u32 {
        match self {
            QuantMix::Q4_0 => 2,
            QuantMix::Q8_0 => 7,
            QuantMix::Q4_K_M => 15,
            QuantMix::Q5_K_M => 17,
            QuantMix::Q6_K => 18,
            QuantMix::MXFP4_MOE => 38,
            QuantMix::Q5_0 => 8,
            QuantMix::Q5_1 => 9,
            QuantMix::IQ4_NL => 25,
        }
    }

    fn is_k_mix(self) -> bool {
        matches!(self, QuantMix::Q4_K_M | QuantMix::Q5_K_M)
    }
}

impl std::fmt::Display for QuantMix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What stops a quantisation, naming the file and tensor.
#[derive(Debug, thiserror::Error)]
pub enum QuantizeError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{path}: tensor '{tensor}': {source}")]
    Tensor { path: PathBuf, tensor: String, source: TensorError },
    #[error("{path}: tensor '{tensor}': {source}")]
    Quant { path: PathBuf, tensor: String, source: QuantError },
    #[error("{path}: the output would overwrite the input")]
    SamePath { path: PathBuf },
}

/// What was written.
#[derive(Debug, Clone, Serialize)]
pub struct QuantizeReport {
    pub path: PathBuf,
    pub mix: QuantMix,
    pub n_tensors: usize,
    /// Tensors per element type in the output.
    pub tensor_types: BTreeMap<String, usize>,
    pub input_bytes: u64,
    pub output_bytes: u64,
}

/// Facts about the model the type rules need.
#[derive(Debug, Clone, Copy)]
pub struct ModelFacts {
    pub n_layers: usize,
    pub n_experts: usize,
    /// The file has no `output.weight` (the embedding is the lm_head).
    pub tied_embeddings: bool,
    /// Query heads per key/value head (llama.cpp's `n_gqa`; 1 when unknown).
    pub n_gqa: usize,
}

/// llama.cpp's choice of layers that get more bits: the first and last eighth, and every third
/// layer in between.
pub fn use_more_bits(layer: usize, n_layers: usize) -> bool {
    let first = n_layers / 8;
    layer < first || layer >= 7 * n_layers / 8 || (layer - first) % 3 == 2
}

fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// The element type `name` (row-major `shape`, stored as `source`) gets in `mix`.
pub fn tensor_type(mix: QuantMix, name: &str, shape: &[usize], source: DType, facts: ModelFacts) -> DType {
    let matrix_dims = shape.iter().filter(|&&d| d != 1).count();
    // Routers and DeltaNet convs (a few values per channel) stay as they are, as llama.cpp keeps them.
    let kept = name.contains("ffn_gate_inp") || name.contains("ssm_conv1d");
    if matrix_dims < 2 || kept || !name.ends_with(".weight") {
        return source;
    }
    if mix == QuantMix::MXFP4_MOE {
        let stacked = shape.len() == 3 && shape[0] > 1;
        return fit_blocks(if stacked { DType::MXFP4 } else { DType::Q8_0 }, shape);
    }
    let layer = layer_of(name).unwrap_or(0);
    let more_bits = mix.is_k_mix() && use_more_bits(layer, facts.n_layers);
    let eight_experts = facts.n_experts == 8;
    let mut t = mix.default_type();
    if name == "output.weight" || (facts.tied_embeddings && name == "token_embd.weight") {
        if t != DType::Q8_0 {
            t = DType::Q6_K;
        }
    } else if name.contains("attn_v.weight") {
        if more_bits {
            t = DType::Q6_K;
        }
        if mix == QuantMix::IQ4_NL && facts.n_gqa >= 4 {
            t = DType::Q5_K;
        }
        if eight_experts {
            t = DType::Q8_0;
        }
    } else if name.contains("attn_qkv.weight") {
        t = match mix {
            QuantMix::Q4_K_M => DType::Q5_K,
            QuantMix::Q5_K_M => DType::Q6_K,
            _ => t,
        };
    } else if name.contains("attn_k.weight") {
        if eight_experts {
            t = DType::Q8_0;
        }
    } else if name.contains("attn_output.weight") {
        if eight_experts && matches!(mix, QuantMix::Q4_K_M | QuantMix::IQ4_NL) {
            t = DType::Q5_K;
        }
    } else if name.contains("ffn_down") && more_bits {
        t = DType::Q6_K;
    } else if name.contains("ffn_down") && mix == QuantMix::IQ4_NL && layer < facts.n_layers / 8 {
        t = DType::Q5_K;
    }
    fit_blocks(t, shape)
}

/// `t`, or where a row is not whole blocks of it llama.cpp's fallback (`tensor_type_fallback`):
/// Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0, and F16 where the fallback (or a 32-value `t`) does
/// not fit either.
fn fit_blocks(t: DType, shape: &[usize]) -> DType {
    let cols = *shape.last().expect("a matrix has dims");
    if cols.is_multiple_of(t.block_elems()) {
        return t;
    }
    let fallback = match t {
        DType::Q4_K => DType::Q5_0,
        DType::Q5_K => DType::Q5_1,
        DType::Q6_K => DType::Q8_0,
        other => other,
    };
    if cols.is_multiple_of(fallback.block_elems()) {
        fallback
    } else {
        DType::F16
    }
}

fn model_facts(file: &GgufFile) -> ModelFacts {
    let arch = file.get("general.architecture").and_then(MetaValue::as_str).unwrap_or("");
    let get = |key: &str| file.get(&format!("{arch}.{key}")).and_then(MetaValue::as_u64).map(|v| v as usize);
    let counted = file.tensor_infos().iter().filter_map(|t| layer_of(&t.name)).max().map_or(0, |l| l + 1);
    ModelFacts {
        n_layers: get("block_count").unwrap_or(counted),
        n_experts: get("expert_count").unwrap_or(0),
        tied_embeddings: file.tensor("output.weight").is_none(),
        n_gqa: match (get("attention.head_count"), get("attention.head_count_kv")) {
            (Some(q), Some(kv)) if kv > 0 => q / kv,
            _ => 1,
        },
    }
}

/// Quantise `input` into `output` (written as `<output>.tmp`, renamed when complete).
/// `progress(bytes_done, bytes_total)` follows the output bytes.
pub fn quantize_gguf(
    input: &Path,
    output: &Path,
    mix: QuantMix,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<QuantizeReport, QuantizeError> {
    let same = |a: &Path, b: &Path| {
        std::fs::canonicalize(a).ok().zip(std::fs::canonicalize(b).ok()).is_some_and(|(a, b)| a == b)
    };
    if same(input, output) {
        return Err(QuantizeError::SamePath { path: output.into() });
    }
    let file = GgufFile::open(input)?;
    let facts = model_facts(&file);
    let mut w = GgufWriter::new();
    w.set_alignment(file.alignment());
    for (key, value) in file.metadata() {
        w.add_metadata(key.clone(), value.clone());
    }
    w.add_metadata("general.file_type", MetaValue::U32(mix.file_type()));
    w.add_metadata("general.quantization_version", MetaValue::U32(2));
    let mut types = Vec::with_capacity(file.tensor_infos().len());
    let mut tensor_types = BTreeMap::new();
    for info in file.tensor_infos() {
        let t = tensor_type(mix, &info.name, &info.shape, info.dtype, facts);
        w.add_tensor(info.name.clone(), t, &info.shape);
        *tensor_types.entry(t.name().to_string()).or_insert(0) += 1;
        types.push(t);
    }
    let total = w.total_bytes();
    let mut failure = None;
    let mut fill = |idx: usize, out: &mut dyn Write| -> std::io::Result<()> {
        match write_tensor(&file, idx, types[idx], out) {
            Ok(written) => written,
            Err(e) => {
                failure = Some(e);
                Err(std::io::Error::other("tensor conversion failed"))
            }
        }
    };
    let written = w.write(output, &mut fill, &mut |done| progress(done, total));
    if let Some(e) = failure {
        return Err(e);
    }
    written?;
    let input_bytes = std::fs::metadata(input).map(|m| m.len()).unwrap_or(0);
    let n_tensors = types.len();
    Ok(QuantizeReport { path: output.into(), mix, n_tensors, tensor_types, input_bytes, output_bytes: total })
}

/// Rows one thread converts per batch. A batch (this times the thread count) is converted in
/// parallel and written in row order before the next starts, so memory stays at a few MiB
/// (`threads x 256 rows x row bytes`) while every core quantises (the K-quant search is
/// compute-bound: one thread writes a 20 GiB BF16 model in many minutes).
const BATCH_ROWS_PER_THREAD: usize = 256;

/// Write tensor `idx` of `file` as `target`, row by row. The outer error is the conversion's,
/// the inner the writer's.
fn write_tensor(
    file: &GgufFile,
    idx: usize,
    target: DType,
    out: &mut dyn Write,
) -> Result<std::io::Result<()>, QuantizeError> {
    let info = &file.tensor_infos()[idx];
    let t = file.tensor(&info.name).expect("listed tensors exist");
    if t.dtype == target {
        return Ok(out.write_all(t.data));
    }
    let cols = t.shape.last().copied().unwrap_or(1).max(1);
    let n_rows = t.n_elems() / cols;
    let job = RowJob { t: &t, target, cols, path: file.path(), tensor: &info.name };
    let n_threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut parts = vec![Vec::new(); n_threads];
    for first in (0..n_rows).step_by(BATCH_ROWS_PER_THREAD * n_threads) {
        let last = (first + BATCH_ROWS_PER_THREAD * n_threads).min(n_rows);
        job.convert_batch(first, last, &mut parts)?;
        for part in &parts {
            if let Err(e) = out.write_all(part) {
                return Ok(Err(e));
            }
        }
    }
    Ok(Ok(()))
}

/// One tensor's conversion: rows of `cols` values from `t` to `target` blocks.
struct RowJob<'a> {
    t: &'a TensorRef<'a>,
    target: DType,
    cols: usize,
    path: &'a Path,
    tensor: &'a str,
}

impl RowJob<'_> {
    /// Rows `first..last` split into `parts.len()` contiguous shares, one thread each; part `i`
    /// receives share `i`'s bytes (empty when the batch is short).
    fn convert_batch(&self, first: usize, last: usize, parts: &mut [Vec<u8>]) -> Result<(), QuantizeError> {
        let share = (last - first).div_ceil(parts.len());
        std::thread::scope(|s| {
            let handles: Vec<_> = parts
                .iter_mut()
                .enumerate()
                .map(|(i, part)| {
                    let lo = (first + i * share).min(last);
                    let hi = (lo + share).min(last);
                    s.spawn(move || self.convert_rows(lo, hi, part))
                })
                .collect();
            let results: Vec<_> = handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect();
            results.into_iter().collect()
        })
    }

    fn convert_rows(&self, lo: usize, hi: usize, bytes: &mut Vec<u8>) -> Result<(), QuantizeError> {
        let mut row = vec![0.0f32; self.cols];
        bytes.clear();
        let row_bytes = self.t.dtype.bytes_for(self.cols).unwrap_or(0);
        for r in lo..hi {
            // An MXFP4 source is validated as llama.cpp validates row data: a NaN scale is refused.
            if let Some(bytes) = self.t.data.get(r * row_bytes..(r + 1) * row_bytes) {
                check_mxfp4_scales(self.t.dtype, bytes).map_err(|source| QuantizeError::Quant {
                    path: self.path.into(),
                    tensor: format!("{} row {r}", self.tensor),
                    source,
                })?;
            }
            self.t.read_f32_into(r * self.cols, &mut row).map_err(|source| QuantizeError::Tensor {
                path: self.path.into(),
                tensor: self.tensor.into(),
                source,
            })?;
            if self.target.is_float() {
                encode_f32(self.target, &row, bytes);
            } else {
                quantize(self.target, &row, bytes).map_err(|source| QuantizeError::Quant {
                    path: self.path.into(),
                    tensor: self.tensor.into(),
                    source,
                })?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FACTS: ModelFacts = ModelFacts { n_layers: 16, n_experts: 128, tied_embeddings: false, n_gqa: 1 };

    /// Rows are converted in parallel batches: the file must hold them in row order, across
    /// several batches and a short last one.
    #[test]
    fn parallel_batches_keep_row_order() {
        let dir = std::env::temp_dir().join(format!("moe-lanes-quantize-order-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let (rows, cols) = (BATCH_ROWS_PER_THREAD * threads * 2 + 37, 64);
        let values: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919) % 1013) as f32 / 97.0 - 5.0).collect();
        let mut w = GgufWriter::new();
        w.add_metadata("general.architecture", MetaValue::String("qwen3moe".into()));
        w.add_tensor("blk.0.attn_q.weight", DType::F32, &[rows, cols]);
        let input = dir.join("in.gguf");
        let mut fill = |_: usize, out: &mut dyn Write| out.write_all(bytemuck::cast_slice(&values));
        w.write(&input, &mut fill, &mut |_| {}).unwrap();
        let output = dir.join("out.gguf");
        quantize_gguf(&input, &output, QuantMix::Q8_0, &mut |_, _| {}).unwrap();
        let mut expected = Vec::new();
        quantize(DType::Q8_0, &values, &mut expected).unwrap();
        let file = GgufFile::open(&output).unwrap();
        let t = file.tensor("blk.0.attn_q.weight").unwrap();
        assert_eq!(t.dtype, DType::Q8_0);
        assert!(t.data == expected.as_slice(), "quantized rows differ from the sequential conversion");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// An MXFP4 source tensor with a block scale of 0xFF (NaN in the MX spec) is refused, naming
    /// the tensor, row and block, as llama.cpp's row validation refuses it; no output is left.
    #[test]
    fn an_mxfp4_source_with_a_nan_scale_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (experts, rows, cols) = (2, 3, 64);
        let values: Vec<f32> =
            (0..experts * rows * cols).map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0).collect();
        let mut bytes = Vec::new();
        quantize(DType::MXFP4, &values, &mut bytes).unwrap();
        let write = |bytes: &[u8], path: &Path| {
            let mut w = GgufWriter::new();
            w.add_metadata("general.architecture", MetaValue::String("qwen3moe".into()));
            w.add_tensor("blk.0.ffn_up_exps.weight", DType::MXFP4, &[experts, rows, cols]);
            let mut fill = |_: usize, out: &mut dyn Write| out.write_all(bytes);
            w.write(path, &mut fill, &mut |_| {}).unwrap();
        };
        let (good, bad, out) =
            (dir.path().join("good.gguf"), dir.path().join("bad.gguf"), dir.path().join("o.gguf"));
        write(&bytes, &good);
        quantize_gguf(&good, &out, QuantMix::Q8_0, &mut |_, _| {}).unwrap();
        std::fs::remove_file(&out).unwrap();
        let mut corrupt = bytes.clone();
        corrupt[4 * 17] = 0xFF; // row 2's first block (2 blocks a row)
        write(&corrupt, &bad);
        let err = quantize_gguf(&bad, &out, QuantMix::Q8_0, &mut |_, _| {}).unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(err, QuantizeError::Quant { source: QuantError::NanScale { block: 0, .. }, .. }),
            "{text}"
        );
        assert!(text.contains("blk.0.ffn_up_exps.weight row 2") && text.contains("0xFF"), "{text}");
        assert!(!out.exists());
    }

    #[test]
    fn q4_k_m_follows_llama_cpp_rules() {
        let m = QuantMix::Q4_K_M;
        let t = |name: &str, shape: &[usize]| tensor_type(m, name, shape, DType::F32, FACTS);
        assert_eq!(t("output.weight", &[512, 256]), DType::Q6_K);
        assert_eq!(t("token_embd.weight", &[512, 256]), DType::Q4_K);
        assert_eq!(t("blk.0.attn_norm.weight", &[256]), DType::F32);
        assert_eq!(t("blk.3.ffn_gate_inp.weight", &[128, 256]), DType::F32);
        // use_more_bits(l, 16): l < 2, l >= 14, (l - 2) % 3 == 2 -> 4, 7, 10, 13.
        let downs: Vec<usize> = (0..16)
            .filter(|l| t(&format!("blk.{l}.ffn_down_exps.weight"), &[128, 256, 768]) == DType::Q6_K)
            .collect();
        assert_eq!(downs, vec![0, 1, 4, 7, 10, 13, 14, 15]);
        assert_eq!(t("blk.4.attn_v.weight", &[512, 256]), DType::Q6_K);
        assert_eq!(t("blk.5.attn_v.weight", &[512, 256]), DType::Q4_K);
        assert_eq!(t("blk.5.ffn_up_exps.weight", &[128, 768, 256]), DType::Q4_K);
        // Rows that are not whole super-blocks fall back as llama.cpp's tensor_type_fallback:
        // Q4_K -> Q5_0, Q6_K -> Q8_0 (GLM-4.5-Air's dense FFN of 10944, DeepSeek's attn_k_b of 128).
        assert_eq!(t("blk.5.ffn_up_exps.weight", &[128, 768, 96]), DType::Q5_0);
        assert_eq!(t("blk.5.ffn_up.weight", &[10944, 4096]), DType::Q4_K);
        assert_eq!(t("blk.5.ffn_down.weight", &[4096, 10944]), DType::Q5_0);
        assert_eq!(t("blk.4.ffn_down.weight", &[4096, 10944]), DType::Q8_0, "Q6_K layer");
        assert_eq!(t("blk.5.attn_k_b.weight", &[128, 512, 128]), DType::Q5_0);
        assert_eq!(t("output.weight", &[512, 96]), DType::Q8_0);
        assert_eq!(t("blk.5.ffn_up_exps.weight", &[128, 768, 20]), DType::F16);
        let q5 = |name: &str, shape: &[usize]| tensor_type(QuantMix::Q5_K_M, name, shape, DType::F32, FACTS);
        assert_eq!(q5("blk.5.ffn_up_exps.weight", &[128, 768, 1408]), DType::Q5_1);
        assert_eq!(q5("blk.5.ffn_up_exps.weight", &[128, 768, 20]), DType::F16);
        let q5_0 = |name: &str, shape: &[usize]| tensor_type(QuantMix::Q5_0, name, shape, DType::F32, FACTS);
        assert_eq!(q5_0("blk.5.ffn_up_exps.weight", &[128, 768, 96]), DType::Q5_0);
        assert_eq!(q5_0("output.weight", &[512, 256]), DType::Q6_K);
        assert_eq!(q5_0("output.weight", &[512, 96]), DType::Q8_0);
        assert_eq!(q5_0("blk.5.ffn_up_exps.weight", &[128, 768, 20]), DType::F16);
    }

    #[test]
    fn iq4_nl_follows_llama_cpp_rules() {
        let m = QuantMix::IQ4_NL;
        let gqa4 = ModelFacts { n_gqa: 4, ..FACTS };
        let t = |name: &str, shape: &[usize], f| tensor_type(m, name, shape, DType::F32, f);
        assert_eq!(t("blk.5.ffn_up_exps.weight", &[128, 768, 256], FACTS), DType::IQ4_NL);
        assert_eq!(t("output.weight", &[512, 256], FACTS), DType::Q6_K);
        assert_eq!(t("blk.5.attn_v.weight", &[512, 256], FACTS), DType::IQ4_NL);
        assert_eq!(t("blk.5.attn_v.weight", &[512, 256], gqa4), DType::Q5_K);
        // n_layers / 8 = 2: layers 0 and 1 take Q5_K down projections; rows of 32s fall back to Q5_1.
        assert_eq!(t("blk.1.ffn_down_exps.weight", &[128, 256, 768], FACTS), DType::Q5_K);
        assert_eq!(t("blk.1.ffn_down_exps.weight", &[128, 256, 1408], FACTS), DType::Q5_1);
        assert_eq!(t("blk.2.ffn_down_exps.weight", &[128, 256, 1408], FACTS), DType::IQ4_NL);
        let eight = ModelFacts { n_experts: 8, ..FACTS };
        assert_eq!(t("blk.5.attn_output.weight", &[256, 256], eight), DType::Q5_K);
        assert_eq!(t("blk.5.attn_v.weight", &[512, 256], ModelFacts { n_gqa: 4, ..eight }), DType::Q8_0);
        assert_eq!(t("blk.5.ffn_up_exps.weight", &[128, 768, 20], FACTS), DType::F16);
    }

    #[test]
    fn eight_expert_models_bump_attention_like_llama_cpp() {
        let facts = ModelFacts { n_experts: 8, ..FACTS };
        let t = |m, name: &str| tensor_type(m, name, &[256, 256], DType::F32, facts);
        assert_eq!(t(QuantMix::Q4_K_M, "blk.5.attn_v.weight"), DType::Q8_0);
        assert_eq!(t(QuantMix::Q4_0, "blk.5.attn_k.weight"), DType::Q8_0);
        assert_eq!(t(QuantMix::Q4_K_M, "blk.5.attn_output.weight"), DType::Q5_K);
        assert_eq!(t(QuantMix::Q5_K_M, "blk.5.attn_output.weight"), DType::Q5_K);
        assert_eq!(t(QuantMix::Q8_0, "output.weight"), DType::Q8_0);
        assert_eq!(t(QuantMix::Q4_0, "output.weight"), DType::Q6_K);
    }

    #[test]
    fn mxfp4_moe_puts_expert_stacks_in_mxfp4_and_the_rest_in_q8_0_like_llama_cpp() {
        let t =
            |name: &str, shape: &[usize]| tensor_type(QuantMix::MXFP4_MOE, name, shape, DType::BF16, FACTS);
        for name in ["blk.4.ffn_up_exps.weight", "blk.4.ffn_gate_exps.weight", "blk.4.ffn_down_exps.weight"] {
            assert_eq!(t(name, &[128, 768, 256]), DType::MXFP4, "{name}");
        }
        // DeepSeek's 3-D MLA projections too (llama.cpp matches ne[2] > 1, not the name).
        assert_eq!(t("blk.4.attn_k_b.weight", &[16, 512, 128]), DType::MXFP4);
        assert_eq!(t("blk.4.ffn_up_exps.weight", &[1, 768, 256]), DType::Q8_0);
        for name in
            ["output.weight", "token_embd.weight", "blk.4.attn_v.weight", "blk.0.ffn_down_shexp.weight"]
        {
            assert_eq!(t(name, &[512, 256]), DType::Q8_0, "{name}");
        }
        assert_eq!(t("blk.3.ffn_gate_inp.weight", &[128, 256]), DType::BF16);
        assert_eq!(t("blk.0.attn_norm.weight", &[256]), DType::BF16);
        // Rows that are not whole blocks of 32: F16, as llama.cpp falls back.
        assert_eq!(t("blk.5.ffn_up_exps.weight", &[128, 768, 20]), DType::F16);
        assert_eq!(QuantMix::MXFP4_MOE.file_type(), 38);
    }

    #[test]
    fn mix_names_parse_and_serialize_as_written() {
        for m in QuantMix::ALL {
            assert_eq!(QuantMix::parse(&m.name().to_uppercase()), Some(m));
            assert_eq!(serde_json::to_string(&m).unwrap(), format!("\"{}\"", m.name()));
        }
        assert_eq!(QuantMix::parse("q3_k"), None);
    }
}
