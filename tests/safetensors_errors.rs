//! One test per malformed safetensors file or model directory: each crafts the bad input in a
//! tempdir and checks the error names the file and the tensor, key or byte offset at fault.

use moe_lanes::dtype::DType;
use moe_lanes::safetensors::{
    write_file, write_model_dir, SafetensorsError, SafetensorsFile, SafetensorsModel, TensorSpec,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tempfile::TempDir;

/// Write a raw safetensors file: length prefix, `header` verbatim, then `data`.
fn write_raw(path: &Path, header: &[u8], data: &[u8]) {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}

fn bad_file(header: &str, data: &[u8]) -> (TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.safetensors");
    write_raw(&path, header.as_bytes(), data);
    (dir, path)
}

/// Open `path`, expect an error, and check its message names the path and every `details`.
fn open_error(path: &Path, details: &[&str]) -> SafetensorsError {
    let err = SafetensorsFile::open(path).expect_err("opening a malformed file must fail");
    assert_message(&err, path, details);
    err
}

fn model_error(dir: &Path, named_path: &Path, details: &[&str]) -> SafetensorsError {
    let err = SafetensorsModel::open(dir).expect_err("opening a malformed model dir must fail");
    assert_message(&err, named_path, details);
    err
}

fn assert_message(err: &SafetensorsError, path: &Path, details: &[&str]) {
    let message = err.to_string();
    assert!(message.contains(&path.display().to_string()), "no path in: {message}");
    for detail in details {
        assert!(message.contains(detail), "no '{detail}' in: {message}");
    }
}

/// A valid one-tensor file: "w", F32 [2] (8 bytes).
fn write_one_tensor(path: &Path, name: &str) {
    let header = format!(r#"{{"{name}":{{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}}}"#);
    write_raw(path, header.as_bytes(), &[0; 8]);
}

fn model_dir_with_config() -> TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), r#"{"hidden_size": 2}"#).unwrap();
    dir
}

fn write_index(dir: &Path, weight_map: &str) -> PathBuf {
    let path = dir.join("model.safetensors.index.json");
    std::fs::write(&path, format!(r#"{{"metadata": {{"total_size": 8}}, "weight_map": {weight_map}}}"#))
        .unwrap();
    path
}

// ---- single files ----

#[test]
fn file_shorter_than_8_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("short.safetensors");
    std::fs::write(&path, [1, 2, 3]).unwrap();
    let err = open_error(&path, &["3 bytes", "8-byte header length"]);
    assert!(matches!(err, SafetensorsError::FileTooShort { n_bytes: 3, .. }));
}

#[test]
fn empty_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("empty.safetensors");
    std::fs::write(&path, []).unwrap();
    open_error(&path, &["0 bytes"]);
}

#[test]
fn header_length_past_end_of_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.safetensors");
    let mut bytes = 1000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(&path, bytes).unwrap();
    let err = open_error(&path, &["header length 1000", "10-byte file"]);
    assert!(matches!(err, SafetensorsError::HeaderPastEnd { header_n_bytes: 1000, file_n_bytes: 10, .. }));
}

#[test]
fn header_length_absurd() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.safetensors");
    let mut bytes = u64::MAX.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(&path, bytes).unwrap();
    let err = open_error(&path, &[&u64::MAX.to_string(), "limit"]);
    assert!(matches!(err, SafetensorsError::HeaderTooLarge { .. }));
}

#[test]
fn header_not_utf8() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.safetensors");
    write_raw(&path, b"{\"a\xff\":1}", &[]);
    let err = open_error(&path, &["UTF-8", "byte offset 11"]);
    assert!(matches!(err, SafetensorsError::HeaderNotUtf8 { offset: 11, .. }));
}

#[test]
fn header_not_json() {
    let (_dir, path) = bad_file("{\n  \"w\": {\"dtype\": \"F32\",,}\n}", &[]);
    let err =
        open_error(&path, &["not valid JSON", "line 2 column 24", "byte offset 33", "key must be a string"]);
    assert!(matches!(err, SafetensorsError::HeaderNotJson { line: 2, column: 24, offset: 33, .. }));
}

#[test]
fn header_not_an_object() {
    let (_dir, path) = bad_file("[1, 2]", &[]);
    open_error(&path, &["not valid JSON", "line 1", "a JSON object"]);
}

#[test]
fn entry_not_an_object() {
    let (_dir, path) = bad_file(r#"{"w": 5}"#, &[]);
    open_error(&path, &["tensor 'w'", "JSON object", "found 5"]);
}

#[test]
fn entry_missing_dtype() {
    let (_dir, path) = bad_file(r#"{"w": {"shape": [2], "data_offsets": [0, 8]}}"#, &[0; 8]);
    let err = open_error(&path, &["tensor 'w'", "missing key \"dtype\""]);
    assert!(matches!(err, SafetensorsError::MissingKey { key: "dtype", .. }));
}

#[test]
fn entry_missing_shape() {
    let (_dir, path) = bad_file(r#"{"w": {"dtype": "F32", "data_offsets": [0, 8]}}"#, &[0; 8]);
    open_error(&path, &["tensor 'w'", "missing key \"shape\""]);
}

#[test]
fn entry_missing_data_offsets() {
    let (_dir, path) = bad_file(r#"{"w": {"dtype": "F32", "shape": [2]}}"#, &[0; 8]);
    open_error(&path, &["tensor 'w'", "missing key \"data_offsets\""]);
}

#[test]
fn entry_dtype_wrong_type() {
    let (_dir, path) = bad_file(r#"{"w": {"dtype": 7, "shape": [2], "data_offsets": [0, 8]}}"#, &[0; 8]);
    open_error(&path, &["tensor 'w'", "\"dtype\" must be a string", "found 7"]);
}

#[test]
fn entry_shape_wrong_type() {
    let (_dir, path) =
        bad_file(r#"{"w": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 8]}}"#, &[0; 8]);
    let err = open_error(&path, &["tensor 'w'", "\"shape\"", "found [2,-1]"]);
    assert!(matches!(err, SafetensorsError::WrongType { key: "shape", .. }));
}

#[test]
fn entry_data_offsets_wrong_type() {
    let (_dir, path) =
        bad_file(r#"{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 9]}}"#, &[0; 9]);
    open_error(&path, &["tensor 'w'", "\"data_offsets\"", "found [0,8,9]"]);
}

#[test]
fn metadata_value_not_a_string() {
    let (_dir, path) = bad_file(r#"{"__metadata__": {"format": 1}}"#, &[]);
    open_error(&path, &["__metadata__", "'format'", "found 1"]);
}

#[test]
fn unsupported_dtype_i64() {
    let (_dir, path) =
        bad_file(r#"{"ids": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}"#, &[0; 8]);
    let err = open_error(&path, &["tensor 'ids'", "dtype I64", "not supported"]);
    assert!(matches!(err, SafetensorsError::UnsupportedDType { .. }));
}

#[test]
fn unsupported_dtype_f8() {
    let header = r#"{"w8": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]}}"#;
    let (_dir, path) = bad_file(header, &[0; 4]);
    open_error(&path, &["tensor 'w8'", "dtype F8_E4M3"]);
}

#[test]
fn data_offsets_begin_after_end() {
    let (_dir, path) = bad_file(r#"{"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}"#, &[0; 8]);
    let err = open_error(&path, &["tensor 'w'", "begin 8 > end 0"]);
    assert!(matches!(err, SafetensorsError::OffsetsReversed { begin: 8, end: 0, .. }));
}

#[test]
fn data_offsets_past_end_of_data() {
    let (_dir, path) = bad_file(r#"{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}"#, &[0; 6]);
    let err = open_error(&path, &["tensor 'w'", "[0, 8]", "6-byte data section"]);
    assert!(matches!(err, SafetensorsError::OffsetsPastEnd { data_n_bytes: 6, .. }));
}

#[test]
fn byte_length_does_not_match_shape() {
    let (_dir, path) =
        bad_file(r#"{"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 8]}}"#, &[0; 8]);
    let err = open_error(&path, &["tensor 'w'", "8 bytes", "[2, 3]", "BF16", "12 bytes"]);
    assert!(matches!(err, SafetensorsError::SizeMismatch { n_bytes: 8, expected_n_bytes: 12, .. }));
}

#[test]
fn shape_overflows() {
    let header = r#"{"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 8]}}"#;
    let (_dir, path) = bad_file(header, &[0; 8]);
    open_error(&path, &["tensor 'w'", "[4294967296, 4294967296]"]);
}

#[test]
fn overlapping_tensors() {
    let header = r#"{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                     "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}"#;
    let (_dir, path) = bad_file(header, &[0; 12]);
    let err = open_error(&path, &["'b'", "[4, 12]", "overlaps tensor 'a'", "[0, 8]"]);
    assert!(matches!(err, SafetensorsError::OverlappingTensors { .. }));
}

#[test]
fn duplicate_tensor_names() {
    let header = r#"{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                     "w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}"#;
    let (_dir, path) = bad_file(header, &[0; 16]);
    let err = open_error(&path, &["tensor 'w'", "more than once"]);
    assert!(matches!(err, SafetensorsError::DuplicateTensor { .. }));
}

// ---- model directories ----

#[test]
fn model_dir_missing_config() {
    let dir = tempfile::tempdir().unwrap();
    write_one_tensor(&dir.path().join("model.safetensors"), "w");
    let err = model_error(dir.path(), dir.path(), &["missing config.json"]);
    assert!(matches!(err, SafetensorsError::MissingConfig { .. }));
}

#[test]
fn model_dir_malformed_config() {
    let dir = tempfile::tempdir().unwrap();
    let config_path = dir.path().join("config.json");
    std::fs::write(&config_path, "{\n  \"hidden_size\": 2,\n  oops\n}").unwrap();
    write_one_tensor(&dir.path().join("model.safetensors"), "w");
    let err = model_error(dir.path(), &config_path, &["line 3", "column 3"]);
    assert!(matches!(err, SafetensorsError::ConfigNotJson { line: 3, .. }));
}

#[test]
fn model_dir_without_single_file_or_index() {
    let dir = model_dir_with_config();
    write_one_tensor(&dir.path().join("model-00001-of-00002.safetensors"), "w");
    let err = model_error(dir.path(), dir.path(), &["neither model.safetensors nor", "model-00001-of-00002"]);
    assert!(matches!(err, SafetensorsError::NoSingleFileOrIndex { .. }));
}

#[test]
fn model_dir_without_any_weight_files() {
    let dir = model_dir_with_config();
    let err = model_error(dir.path(), dir.path(), &["no weight files"]);
    assert!(matches!(err, SafetensorsError::NoWeightFiles { .. }));
}

#[test]
fn index_with_empty_weight_map() {
    let dir = model_dir_with_config();
    let index_path = write_index(dir.path(), "{}");
    let err = model_error(dir.path(), &index_path, &["\"weight_map\" is empty"]);
    assert!(matches!(err, SafetensorsError::IndexEmpty { .. }));
}

#[test]
fn index_malformed_json() {
    let dir = model_dir_with_config();
    let index_path = dir.path().join("model.safetensors.index.json");
    std::fs::write(&index_path, "{\"weight_map\": {\"w\": }}").unwrap();
    let err = model_error(dir.path(), &index_path, &["line 1", "column 22"]);
    assert!(matches!(err, SafetensorsError::IndexNotJson { .. }));
}

#[test]
fn index_without_weight_map() {
    let dir = model_dir_with_config();
    let index_path = dir.path().join("model.safetensors.index.json");
    std::fs::write(&index_path, r#"{"metadata": {"total_size": 8}}"#).unwrap();
    let err = model_error(dir.path(), &index_path, &["no \"weight_map\""]);
    assert!(matches!(err, SafetensorsError::IndexWithoutWeightMap { .. }));
}

#[test]
fn index_names_a_missing_shard() {
    let dir = model_dir_with_config();
    write_one_tensor(&dir.path().join("model-00001-of-00002.safetensors"), "a");
    let weight_map = r#"{"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}"#;
    let index_path = write_index(dir.path(), weight_map);
    let err = model_error(dir.path(), &index_path, &["shard 'model-00002-of-00002.safetensors'", "'b'"]);
    assert!(matches!(err, SafetensorsError::MissingShard { .. }));
}

#[test]
fn index_maps_tensor_to_shard_without_it() {
    let dir = model_dir_with_config();
    write_one_tensor(&dir.path().join("model-00001-of-00002.safetensors"), "a");
    write_one_tensor(&dir.path().join("model-00002-of-00002.safetensors"), "b");
    let weight_map = r#"{"a": "model-00002-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}"#;
    let index_path = write_index(dir.path(), weight_map);
    let err = model_error(dir.path(), &index_path, &["tensor 'a'", "model-00002-of-00002.safetensors"]);
    assert!(matches!(err, SafetensorsError::TensorNotInShard { .. }));
}

#[test]
fn shard_tensor_absent_from_index() {
    let dir = model_dir_with_config();
    let shard_path = dir.path().join("model-00001-of-00001.safetensors");
    let header = r#"{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                     "extra": {"dtype": "F16", "shape": [4], "data_offsets": [8, 16]}}"#;
    write_raw(&shard_path, header.as_bytes(), &[0; 16]);
    let index_path = write_index(dir.path(), r#"{"a": "model-00001-of-00001.safetensors"}"#);
    let err = model_error(dir.path(), &shard_path, &["tensor 'extra'", "absent from the index"]);
    assert_message(&err, &index_path, &[]);
    assert!(matches!(err, SafetensorsError::TensorNotInIndex { .. }));
}

#[test]
fn tensor_in_two_shards() {
    let dir = model_dir_with_config();
    let first = dir.path().join("model-00001-of-00002.safetensors");
    let second = dir.path().join("model-00002-of-00002.safetensors");
    write_one_tensor(&first, "w");
    let header = r#"{"b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                     "w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}"#;
    write_raw(&second, header.as_bytes(), &[0; 16]);
    let weight_map = r#"{"w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}"#;
    write_index(dir.path(), weight_map);
    let err = model_error(dir.path(), &first, &["tensor 'w'", "two shards"]);
    assert_message(&err, &second, &[]);
    assert!(matches!(err, SafetensorsError::TensorInTwoShards { .. }));
}

#[test]
fn malformed_shard_error_names_the_shard() {
    let dir = model_dir_with_config();
    let shard_path = dir.path().join("model-00001-of-00001.safetensors");
    std::fs::write(&shard_path, [0u8; 4]).unwrap();
    write_index(dir.path(), r#"{"a": "model-00001-of-00001.safetensors"}"#);
    model_error(dir.path(), &shard_path, &["4 bytes"]);
}

// ---- writers ----

fn one_spec() -> Vec<TensorSpec> {
    vec![TensorSpec { name: "w".to_string(), dtype: DType::F32, shape: vec![4] }]
}

/// Neither the final file nor any `*.tmp` exists in `dir`.
fn assert_nothing_written(dir: &Path, final_path: &Path) {
    assert!(!final_path.exists(), "{} exists", final_path.display());
    let leftovers: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(leftovers.iter().all(|n| !n.to_string_lossy().ends_with(".tmp")), "{leftovers:?}");
}

#[test]
fn failing_fill_leaves_no_file_and_no_tmp() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    let mut fill = |_: usize, _: &mut dyn std::io::Write| Err(std::io::Error::other("disk on fire"));
    let err = write_file(&path, &one_spec(), &BTreeMap::new(), &mut fill, &mut |_| {}).unwrap_err();
    assert_message(&err, &path, &["tensor 'w'", "disk on fire"]);
    assert_nothing_written(dir.path(), &path);
}

#[test]
fn short_fill_leaves_no_file_and_no_tmp() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    let mut fill = |_: usize, out: &mut dyn std::io::Write| out.write_all(&[0; 15]);
    let err = write_file(&path, &one_spec(), &BTreeMap::new(), &mut fill, &mut |_| {}).unwrap_err();
    assert_message(&err, &path, &["tensor 'w'", "wrote 15 bytes", "expected 16"]);
    assert!(matches!(err, SafetensorsError::FillWrongSize { .. }));
    assert_nothing_written(dir.path(), &path);
}

#[test]
fn long_fill_leaves_no_file_and_no_tmp() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    let mut fill = |_: usize, out: &mut dyn std::io::Write| out.write_all(&[0; 17]);
    let err = write_file(&path, &one_spec(), &BTreeMap::new(), &mut fill, &mut |_| {}).unwrap_err();
    assert_message(&err, &path, &["wrote 17 bytes", "expected 16"]);
    assert_nothing_written(dir.path(), &path);
}

#[test]
fn failing_fill_in_model_dir_leaves_no_config() {
    let dir = tempfile::tempdir().unwrap();
    let mut fill = |_: usize, out: &mut dyn std::io::Write| out.write_all(&[0; 3]);
    let config = serde_json::json!({});
    let err = write_model_dir(dir.path(), &config, &one_spec(), None, &mut fill, &mut |_| {}).unwrap_err();
    assert_message(&err, &dir.path().join("model.safetensors"), &["wrote 3 bytes"]);
    assert_nothing_written(dir.path(), &dir.path().join("model.safetensors"));
    assert!(!dir.path().join("config.json").exists());
}
