//! Corrupt and hostile GGUF inputs: every one must produce a `GgufError` whose message names the
//! file and the offending key, tensor or byte offset, and never a panic. Also: failed writes leave
//! nothing behind.

mod common;

use moe_lanes::dtype::DType;
use moe_lanes::gguf::{GgufError, GgufFile, GgufWriter, MetaValue};
use std::io::Write;
use std::path::{Path, PathBuf};

const TYPE_U32: u32 = 4;
const TYPE_STRING: u32 = 8;
const TYPE_ARRAY: u32 = 9;
const GGML_F32: u32 = 0;
const GGML_Q8_0: u32 = 8;

/// Little-endian GGUF bytes, built piece by piece.
struct Raw(Vec<u8>);

impl Raw {
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        Raw(b"GGUF".to_vec()).u32(version).u64(n_tensors).u64(n_kv)
    }

    fn u32(mut self, v: u32) -> Raw {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    fn u64(mut self, v: u64) -> Raw {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    fn bytes(mut self, b: &[u8]) -> Raw {
        self.0.extend_from_slice(b);
        self
    }

    fn str(self, s: &str) -> Raw {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }

    fn kv_u32(self, key: &str, v: u32) -> Raw {
        self.str(key).u32(TYPE_U32).u32(v)
    }

    /// A tensor info; `ne` is innermost first, as GGUF stores it.
    fn tensor(self, name: &str, ne: &[u64], ggml_type: u32, offset: u64) -> Raw {
        let raw = self.str(name).u32(ne.len() as u32);
        ne.iter().fold(raw, |raw, &d| raw.u64(d)).u32(ggml_type).u64(offset)
    }

    fn pad_to(mut self, alignment: usize) -> Raw {
        self.0.resize(self.0.len().next_multiple_of(alignment), 0);
        self
    }

    fn zeros(mut self, n_bytes: usize) -> Raw {
        self.0.resize(self.0.len() + n_bytes, 0);
        self
    }
}

/// Writes `raw` to a fresh file and opens it, expecting failure. Returns the error, its message and the path.
fn open_err(raw: Raw) -> (GgufError, String, PathBuf, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, &raw.0).unwrap();
    let err = GgufFile::open(&path).expect_err("corrupt file must not open");
    let message = err.to_string();
    assert!(message.contains(&path.display().to_string()), "message lacks path: {message}");
    (err, message, path, dir)
}

fn assert_contains(message: &str, parts: &[&str]) {
    for part in parts {
        assert!(message.contains(part), "message lacks {part:?}: {message}");
    }
}

/// The header of `valid_file`: 24 fixed + 66 metadata + 33 + 41 tensor info = 164 bytes.
fn valid_header() -> Raw {
    Raw::header(3, 2, 2)
        .kv_u32("general.alignment", 32)
        .kv_u32("llama.block_count", 2)
        .tensor("a", &[8], GGML_F32, 0)
        .tensor("b", &[4, 2], GGML_F32, 32)
}

/// A valid file: two metadata pairs and two F32 tensors (`a`: 8 values, `b`: 2x4).
fn valid_file() -> Raw {
    valid_header().pad_to(32).zeros(64)
}

#[test]
fn valid_reference_file_opens() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ok.gguf");
    std::fs::write(&path, valid_file().0).unwrap();
    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.tensor("b").unwrap().shape, &[2, 4]);
}

#[test]
fn missing_file_is_io_error_with_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("absent.gguf");
    let err = GgufFile::open(&path).unwrap_err();
    assert!(matches!(err, GgufError::Io { .. }), "{err}");
    assert!(err.to_string().contains(&path.display().to_string()));
}

#[test]
fn wrong_magic_shows_bytes_found() {
    let (err, message, ..) = open_err(Raw(b"GGML".to_vec()).u32(3).u64(0).u64(0));
    assert!(matches!(err, GgufError::BadMagic { found, .. } if &found == b"GGML"), "{err}");
    assert_contains(&message, &["GGML", "47, 47, 4d, 4c"]);
}

#[test]
fn version_1_is_refused() {
    let (err, message, ..) = open_err(Raw::header(1, 0, 0));
    assert!(matches!(err, GgufError::UnsupportedVersion { version: 1, .. }), "{err}");
    assert_contains(&message, &["version 1"]);
}

#[test]
fn empty_file_is_truncated_at_magic() {
    let (err, message, ..) = open_err(Raw(Vec::new()));
    assert!(matches!(err, GgufError::Truncated { offset: 0, .. }), "{err}");
    assert_contains(&message, &["byte offset 0", "magic"]);
}

#[test]
fn truncated_metadata_value_names_key_and_offset() {
    // Header (24) + key "general.alignment" (8 + 17) + type (4) + value (4) = 57; the
    // second key's value starts at 57 + 8 + 17 + 4 = 86. Cut inside it.
    let mut raw = valid_file();
    raw.0.truncate(88);
    let (err, message, ..) = open_err(raw);
    assert!(matches!(err, GgufError::Truncated { offset: 86, .. }), "{err}");
    assert_contains(&message, &["byte offset 86", "metadata key 1 'llama.block_count'"]);
}

#[test]
fn truncated_tensor_info_names_tensor_index_and_name() {
    // Metadata ends at 90; tensor info 0 ('a') takes 33 bytes, so info 1 ('b') starts at 123:
    // name 123..132, n_dims 132..136, ne[0] 136..144, ne[1] 144..152. Cut inside ne[1].
    let mut raw = valid_file();
    raw.0.truncate(150);
    let (err, message, ..) = open_err(raw);
    assert!(matches!(err, GgufError::Truncated { offset: 144, needed_bytes: 8, file_len: 150, .. }), "{err}");
    assert_contains(&message, &["byte offset 144", "tensor info 1 'b'", "150 bytes"]);
}

#[test]
fn truncation_at_every_header_byte_is_an_error_not_a_panic() {
    let header_len = valid_header().0.len();
    assert_eq!(header_len, 164);
    for len in 0..header_len {
        let mut raw = valid_file();
        raw.0.truncate(len);
        let (err, ..) = open_err(raw);
        assert!(
            matches!(err, GgufError::Truncated { .. } | GgufError::AbsurdCount { .. }),
            "len {len}: {err}"
        );
    }
}

#[test]
fn every_single_byte_corruption_of_the_header_is_handled() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("corrupt.gguf");
    for pos in 0..valid_header().0.len() {
        for value in [0x00, 0x01, 0x7f, 0x80, 0xff] {
            let mut raw = valid_file();
            raw.0[pos] = value;
            std::fs::write(&path, &raw.0).unwrap();
            if let Err(err) = GgufFile::open(&path) {
                assert!(err.to_string().contains(&path.display().to_string()), "byte {pos}: {err}");
            }
        }
    }
}

#[test]
fn unknown_value_type_names_key_and_offset() {
    let raw = Raw::header(3, 0, 1).str("general.weird").u32(99).u32(0);
    let (err, message, ..) = open_err(raw);
    assert!(matches!(err, GgufError::UnknownValueType { type_id: 99, offset: 45, .. }), "{err}");
    assert_contains(&message, &["99", "byte offset 45", "'general.weird'"]);
}

#[test]
fn unknown_ggml_type_names_tensor() {
    let raw = Raw::header(3, 1, 0).tensor("blk.0.ffn_up.weight", &[32], 3, 0).pad_to(32).zeros(128);
    let (err, message, ..) = open_err(raw);
    assert!(matches!(err, GgufError::UnknownTensorType { type_id: 3, .. }), "{err}");
    assert_contains(&message, &["'blk.0.ffn_up.weight'", "type id 3 (Q4_1)", "does not read", "Q4_K"]);
}

#[test]
fn invalid_utf8_names_offset_and_key() {
    let raw = Raw::header(3, 0, 1).str("general.name").u32(TYPE_STRING).u64(2).bytes(&[0xff, 0xfe]);
    let (err, message, ..) = open_err(raw);
    assert!(matches!(err, GgufError::InvalidUtf8 { offset: 56, .. }), "{err}");
    assert_contains(&message, &["UTF-8", "byte offset 56", "'general.name'"]);
}

#[test]
fn too_many_dims_names_tensor() {
    let raw = Raw::header(3, 1, 0).tensor("five_d", &[1, 1, 1, 1, 1], GGML_F32, 0).pad_to(32).zeros(32);
    let (err, message, ..) = open_err(raw);
    assert!(matches!(err, GgufError::TooManyDims { n_dims: 5, .. }), "{err}");
    assert_contains(&message, &["'five_d'", "5 dimensions"]);
}

#[test]
fn rows_not_whole_blocks_names_tensor() {
    let raw = Raw::header(3, 1, 0).tensor("q", &[33, 2], GGML_Q8_0, 0).pad_to(32).zeros(256);
    let (err, message, ..) = open_err(raw);
    assert!(matches!(err, GgufError::NotWholeBlocks { row_elems: 33, block_elems: 32, .. }), "{err}");
    assert_contains(&message, &["'q'", "Q8_0", "33", "block size 32"]);
}

#[test]
fn tensor_data_past_end_names_tensor_offset_size_and_length() {
    let mut raw = valid_file();
    raw.0.truncate(raw.0.len() - 4);
    let file_len = raw.0.len();
    let b_offset = file_len + 4 - 32;
    let (err, message, ..) = open_err(raw);
    assert!(matches!(err, GgufError::TensorPastEnd { n_bytes: 32, .. }), "{err}");
    assert_contains(
        &message,
        &["'b'", &format!("offset {b_offset}"), "32 bytes", &format!("{file_len} bytes")],
    );
}

#[test]
fn huge_dims_are_rejected_without_overflow() {
    let raw = Raw::header(3, 1, 0).tensor("huge", &[u64::MAX, 4], GGML_F32, 0).pad_to(32);
    let (err, message, ..) = open_err(raw);
    assert!(matches!(err, GgufError::TensorTooLarge { .. }), "{err}");
    assert_contains(&message, &["'huge'"]);
}

#[test]
fn huge_tensor_offset_is_past_end_without_overflow() {
    let raw = Raw::header(3, 1, 0).tensor("far", &[8], GGML_F32, u64::MAX - 31).pad_to(32);
    let (err, message, ..) = open_err(raw);
    assert!(matches!(err, GgufError::TensorPastEnd { .. }), "{err}");
    assert_contains(&message, &["'far'"]);
}

#[test]
fn misaligned_tensor_offset_names_tensor_and_offset() {
    let raw = Raw::header(3, 1, 0).tensor("m", &[8], GGML_F32, 16).pad_to(32).zeros(64);
    let (err, message, ..) = open_err(raw);
    assert!(matches!(err, GgufError::MisalignedTensor { offset: 16, alignment: 32, .. }), "{err}");
    assert_contains(&message, &["'m'", "offset 16", "alignment 32"]);
}

#[test]
fn alignment_not_power_of_two_is_rejected() {
    let (err, message, ..) = open_err(Raw::header(3, 0, 1).kv_u32("general.alignment", 48));
    assert!(matches!(err, GgufError::BadAlignment { .. }), "{err}");
    assert_contains(&message, &["general.alignment", "48"]);
}

#[test]
fn alignment_zero_or_wrong_type_is_rejected() {
    let (err, ..) = open_err(Raw::header(3, 0, 1).kv_u32("general.alignment", 0));
    assert!(matches!(err, GgufError::BadAlignment { .. }), "{err}");
    let raw = Raw::header(3, 0, 1).str("general.alignment").u32(10).u64(32);
    let (err, message, ..) = open_err(raw);
    assert!(matches!(err, GgufError::BadAlignment { .. }), "{err}");
    assert_contains(&message, &["U64(32)"]);
}

#[test]
fn duplicate_tensor_name_is_rejected() {
    let raw = Raw::header(3, 2, 0)
        .tensor("twice", &[8], GGML_F32, 0)
        .tensor("twice", &[8], GGML_F32, 32)
        .pad_to(32)
        .zeros(64);
    let (err, message, ..) = open_err(raw);
    assert!(matches!(err, GgufError::DuplicateTensor { ref tensor, .. } if tensor == "twice"), "{err}");
    assert_contains(&message, &["'twice'"]);
}

#[test]
fn duplicate_metadata_key_is_rejected() {
    let raw = Raw::header(3, 0, 2).kv_u32("llama.block_count", 1).kv_u32("llama.block_count", 2);
    let (err, message, ..) = open_err(raw);
    assert!(matches!(err, GgufError::DuplicateKey { ref key, .. } if key == "llama.block_count"), "{err}");
    assert_contains(&message, &["'llama.block_count'"]);
}

#[test]
fn absurd_tensor_count_is_rejected_before_allocating() {
    let (err, message, ..) = open_err(Raw::header(3, u64::MAX / 2, 0).zeros(64));
    assert!(matches!(err, GgufError::AbsurdCount { offset: 24, .. }), "{err}");
    assert_contains(&message, &["tensor infos", &(u64::MAX / 2).to_string(), "byte offset 24"]);
}

#[test]
fn absurd_metadata_count_is_rejected_before_allocating() {
    let (err, message, ..) = open_err(Raw::header(3, 0, 1 << 40).zeros(64));
    assert!(matches!(err, GgufError::AbsurdCount { count: 0x100_0000_0000, .. }), "{err}");
    assert_contains(&message, &["metadata pairs", "byte offset 24"]);
}

#[test]
fn absurd_array_count_is_rejected_before_allocating() {
    let raw = Raw::header(3, 0, 1).str("tokenizer.ggml.tokens").u32(TYPE_ARRAY).u32(TYPE_STRING).u64(1 << 50);
    let (err, message, ..) = open_err(raw);
    assert!(matches!(err, GgufError::AbsurdCount { .. }), "{err}");
    assert_contains(&message, &["array elements", "'tokenizer.ggml.tokens'", "byte offset 69"]);
}

#[test]
fn absurd_string_length_is_truncation_not_allocation() {
    let raw = Raw::header(3, 0, 1).str("general.name").u32(TYPE_STRING).u64(u64::MAX);
    let (err, message, ..) = open_err(raw);
    assert!(matches!(err, GgufError::Truncated { offset: 56, .. }), "{err}");
    assert_contains(&message, &["byte offset 56", "'general.name'"]);
}

#[test]
fn deeply_nested_arrays_are_rejected_without_stack_overflow() {
    let mut raw = Raw::header(3, 0, 1).str("deep").u32(TYPE_ARRAY);
    for _ in 0..100_000 {
        raw = raw.u32(TYPE_ARRAY).u64(1);
    }
    let (err, message, ..) = open_err(raw.u32(TYPE_U32).u64(0));
    assert!(matches!(err, GgufError::NestingTooDeep { .. }), "{err}");
    assert_contains(&message, &["'deep'"]);
}

/// A writer with one 8-value F32 tensor (32 bytes).
fn one_tensor_writer() -> GgufWriter {
    let mut writer = GgufWriter::new();
    writer.add_metadata("general.name", MetaValue::String("w".into()));
    writer.add_tensor("t", DType::F32, &[2, 4]);
    writer
}

fn assert_dir_empty(dir: &Path) {
    let left: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.is_empty(), "files left behind: {left:?}");
}

#[test]
fn fill_error_leaves_no_file_and_no_tmp() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.gguf");
    let mut fill = |_: usize, _: &mut dyn Write| Err(std::io::Error::other("source tensor unreadable"));
    let err = one_tensor_writer().write(&path, &mut fill, &mut |_| {}).unwrap_err();
    assert!(matches!(err, GgufError::FillFailed { .. }), "{err}");
    assert_contains(&err.to_string(), &["'t'", "source tensor unreadable"]);
    assert_dir_empty(dir.path());
}

#[test]
fn short_fill_leaves_no_file_and_no_tmp() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.gguf");
    let mut fill = |_: usize, out: &mut dyn Write| out.write_all(&[0u8; 31]);
    let err = one_tensor_writer().write(&path, &mut fill, &mut |_| {}).unwrap_err();
    assert!(
        matches!(err, GgufError::FillSizeMismatch { expected_bytes: 32, written_bytes: 31, .. }),
        "{err}"
    );
    assert_contains(&err.to_string(), &["'t'", "31", "32"]);
    assert_dir_empty(dir.path());
}

#[test]
fn long_fill_leaves_no_file_and_no_tmp() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.gguf");
    let mut fill = |_: usize, out: &mut dyn Write| out.write_all(&[0u8; 33]);
    let err = one_tensor_writer().write(&path, &mut fill, &mut |_| {}).unwrap_err();
    assert!(matches!(err, GgufError::FillSizeMismatch { written_bytes: 33, .. }), "{err}");
    assert_dir_empty(dir.path());
}

#[test]
fn writer_rejects_bad_tensors_before_creating_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.gguf");
    let cases: [(&[usize], DType, &str); 2] =
        [(&[1, 1, 1, 1, 1], DType::F32, "dimensions"), (&[2, 100], DType::Q4_K, "block size 256")];
    for (shape, dtype, expected) in cases {
        let mut writer = GgufWriter::new();
        writer.add_tensor("bad", dtype, shape);
        let err = writer.write(&path, &mut |_, _| Ok(()), &mut |_| {}).unwrap_err();
        assert_contains(&err.to_string(), &["'bad'", expected, &path.display().to_string()]);
        assert_dir_empty(dir.path());
    }
    let mut writer = GgufWriter::new();
    writer.add_tensor("same", DType::F32, &[1]);
    writer.add_tensor("same", DType::F32, &[1]);
    let err = writer.write(&path, &mut |_, out| out.write_all(&[0; 4]), &mut |_| {}).unwrap_err();
    assert!(matches!(err, GgufError::DuplicateTensor { .. }), "{err}");
    assert_dir_empty(dir.path());
}

/// A `gemma4` GGUF file (llama.cpp's layout, from `synth`) with one key or tensor broken at a
/// time: `Model::open` refuses each with an error naming the file and the key or tensor, and
/// what it expected (never a panic, never a wrong model).
#[test]
fn gemma4_bad_or_missing_keys_and_tensors_are_named() {
    use common::{rewrite_gguf, TensorEdit};
    use moe_lanes::gguf::{GgufValueType, MetaArray};
    use moe_lanes::synth::{self, DimOverrides, Preset, Skew, SynthFormat, SynthOptions};
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("g.gguf");
    let opts = SynthOptions {
        adapter: moe_lanes::arch::by_name("gemma4").unwrap(),
        preset: Preset::Tiny,
        dims: DimOverrides { n_layers: Some(4), ..Default::default() },
        dtype: DType::F32,
        seed: 3,
        skew: Skew::Uniform,
        format: SynthFormat::Gguf,
        out: src.clone(),
        vocab_from: None,
    };
    synth::write_synthetic(&opts, &mut |_, _| {}).unwrap();
    moe_lanes::model::Model::open(&src).unwrap();
    let bools = |v: &[bool]| {
        MetaValue::Array(MetaArray {
            elem_type: GgufValueType::Bool,
            values: v.iter().map(|&b| MetaValue::Bool(b)).collect(),
        })
    };
    let u32s = |v: &[u32]| {
        MetaValue::Array(MetaArray {
            elem_type: GgufValueType::U32,
            values: v.iter().map(|&x| MetaValue::U32(x)).collect(),
        })
    };
    type Meta = Option<(&'static str, Option<MetaValue>)>;
    type Tensor = Option<(&'static str, TensorEdit)>;
    let cases: Vec<(Meta, Tensor, &[&str])> = vec![
        (
            Some(("gemma4.attention.sliding_window_pattern", None)),
            None,
            &["missing metadata key", "sliding_window_pattern"],
        ),
        (
            Some(("gemma4.attention.sliding_window_pattern", Some(bools(&[true, false])))),
            None,
            &["sliding_window_pattern", "one per layer"],
        ),
        (
            Some(("gemma4.attention.key_length_swa", None)),
            None,
            &["missing metadata key", "gemma4.attention.key_length_swa"],
        ),
        (
            Some(("gemma4.attention.sliding_window", None)),
            None,
            &["missing metadata key", "gemma4.attention.sliding_window'"],
        ),
        (
            Some(("gemma4.attention.head_count_kv", Some(u32s(&[2, 1, 1, 1])))),
            None,
            &["gemma4.attention.head_count_kv", "every layer of a kind"],
        ),
        (
            Some(("gemma4.attention.head_count_kv", Some(u32s(&[2, 1])))),
            None,
            &["gemma4.attention.head_count_kv", "one per layer"],
        ),
        (
            Some(("gemma4.rope.dimension_count", Some(MetaValue::U32(8)))),
            None,
            &["gemma4.rope.dimension_count", "key_length"],
        ),
        (
            Some(("gemma4.embedding_length_per_layer_input", Some(MetaValue::U32(4)))),
            None,
            &["embedding_length_per_layer_input", "per-layer input embeddings"],
        ),
        (
            Some(("gemma4.attention.shared_kv_layers", Some(MetaValue::U32(2)))),
            None,
            &["shared_kv_layers", "sharing"],
        ),
        (None, Some(("rope_freqs.weight", TensorEdit::Drop)), &["missing tensor 'rope_freqs.weight'"]),
        (
            None,
            Some(("rope_freqs.weight", TensorEdit::Replace { dtype: DType::F32, shape: vec![16] })),
            &["rope_freqs.weight", "holds 0 at 0", "proportional RoPE"],
        ),
        (
            None,
            Some(("rope_freqs.weight", TensorEdit::Replace { dtype: DType::F32, shape: vec![5] })),
            &["rope_freqs.weight", "shape [5]"],
        ),
        (None, Some(("blk.0.attn_v.weight", TensorEdit::Drop)), &["missing tensor 'blk.0.attn_v.weight'"]),
        (
            None,
            Some(("blk.2.ffn_gate_up_exps.weight", TensorEdit::Drop)),
            &["missing tensor 'blk.2.ffn_gate_up_exps.weight'"],
        ),
        (
            None,
            Some(("blk.1.ffn_down.weight", TensorEdit::Drop)),
            &["missing tensor 'blk.1.ffn_down.weight'"],
        ),
        (
            None,
            Some(("blk.3.ffn_gate_inp.scale", TensorEdit::Drop)),
            &["missing tensor 'blk.3.ffn_gate_inp.scale'"],
        ),
        (
            None,
            Some(("blk.3.layer_output_scale.weight", TensorEdit::Drop)),
            &["blk.3.layer_output_scale.weight"],
        ),
    ];
    for (i, (meta, tensor, expected)) in cases.into_iter().enumerate() {
        let dst = dir.path().join(format!("bad{i}.gguf"));
        rewrite_gguf(
            &src,
            &dst,
            |k, v| match &meta {
                Some((key, replacement)) if *key == k => replacement.clone(),
                _ => Some(v.clone()),
            },
            |name| match &tensor {
                Some((t, edit)) if *t == name => edit.clone(),
                _ => TensorEdit::Keep,
            },
        );
        let err = match moe_lanes::model::Model::open(&dst) {
            Ok(_) => panic!("case {i} ({expected:?}) opened"),
            Err(e) => e.to_string(),
        };
        let mut parts = expected.to_vec();
        let name = dst.display().to_string();
        parts.push(&name);
        assert_contains(&err, &parts);
    }
}
