//! Hugging Face safetensors: reading single files and model directories (zero-copy through
//! `memmap2`), and writing them atomically (`<path>.tmp` + rename).
//!
//! A `.safetensors` file is an 8-byte little-endian `u64` header length `N`, then `N` bytes of
//! UTF-8 JSON, then the data section. The JSON maps each tensor name to
//! `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets relative to the data section) and may
//! hold a `"__metadata__"` object of string values. Only `F32`, `F16` and `BF16` tensors are
//! accepted. Every malformed input is a [`SafetensorsError`] naming the file and the tensor, key or
//! byte offset at fault; no input makes the reader panic.
//!
//! A model directory holds `config.json` plus either `model.safetensors` or
//! `model.safetensors.index.json` (`{"metadata": {...}, "weight_map": {tensor: shard}}`) and its
//! shards (if both are present the index wins). The index and the shards must agree exactly: every
//! listed shard exists, holds the tensors mapped to it and no others, and no tensor is in two shards.

use super::write_util::{tmp_path_of, CountingWriter};
use crate::format::dtype::DType;
use crate::format::tensor::TensorRef;
use memmap2::Mmap;
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Headers larger than this are rejected as corrupt (real headers are a few MB at most).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;
const METADATA_KEY: &str = "__metadata__";
const CONFIG_FILE: &str = "config.json";
const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";

/// Everything that can go wrong reading or writing safetensors files and model directories.
#[derive(Debug, thiserror::Error)]
pub enum SafetensorsError {
    #[error("{}: {source}", .path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{}: file is {n_bytes} bytes, shorter than the 8-byte header length", .path.display())]
    FileTooShort { path: PathBuf, n_bytes: u64 },
    #[error(
        "{}: header length {header_n_bytes} at byte 0 exceeds the limit of {MAX_HEADER_BYTES} bytes",
        .path.display()
    )]
    HeaderTooLarge { path: PathBuf, header_n_bytes: u64 },
    #[error(
        "{}: header length {header_n_bytes} at byte 0 runs past the end of the {file_n_bytes}-byte file",
        .path.display()
    )]
    HeaderPastEnd { path: PathBuf, header_n_bytes: u64, file_n_bytes: u64 },
    #[error("{}: header is not valid UTF-8 at byte offset {offset}", .path.display())]
    HeaderNotUtf8 { path: PathBuf, offset: usize },
    #[error(
        "{}: header is not valid JSON at line {line} column {column} (byte offset {offset}): {message}",
        .path.display()
    )]
    HeaderNotJson { path: PathBuf, line: usize, column: usize, offset: usize, message: String },
    #[error("{}: tensor '{tensor}': entry must be a JSON object, found {found}", .path.display())]
    EntryNotObject { path: PathBuf, tensor: String, found: String },
    #[error("{}: tensor '{tensor}': missing key \"{key}\"", .path.display())]
    MissingKey { path: PathBuf, tensor: String, key: &'static str },
    #[error("{}: tensor '{tensor}': key \"{key}\" must be {expected}, found {found}", .path.display())]
    WrongType { path: PathBuf, tensor: String, key: &'static str, expected: &'static str, found: String },
    #[error("{}: \"__metadata__\" key '{key}' must map to a string, found {found}", .path.display())]
    MetadataNotString { path: PathBuf, key: String, found: String },
    #[error("{}: \"__metadata__\" must be a JSON object, found {found}", .path.display())]
    MetadataNotObject { path: PathBuf, found: String },
    #[error("{}: tensor '{tensor}': dtype {dtype} is not supported (only F32, F16, BF16)", .path.display())]
    UnsupportedDType { path: PathBuf, tensor: String, dtype: String },
    #[error("{}: tensor '{tensor}': shape {shape:?} has more elements than fit in memory", .path.display())]
    ShapeOverflow { path: PathBuf, tensor: String, shape: Vec<usize> },
    #[error("{}: tensor '{tensor}': data_offsets begin {begin} > end {end}", .path.display())]
    OffsetsReversed { path: PathBuf, tensor: String, begin: usize, end: usize },
    #[error(
        "{}: tensor '{tensor}': data_offsets [{begin}, {end}] run past the end of the {data_n_bytes}-byte \
         data section",
        .path.display()
    )]
    OffsetsPastEnd { path: PathBuf, tensor: String, begin: usize, end: usize, data_n_bytes: usize },
    #[error(
        "{}: tensor '{tensor}': {n_bytes} bytes at data_offsets [{begin}, {end}] do not hold shape {shape:?} \
         of {dtype} ({expected_n_bytes} bytes)",
        .path.display()
    )]
    SizeMismatch {
        path: PathBuf,
        tensor: String,
        dtype: DType,
        shape: Vec<usize>,
        begin: usize,
        end: usize,
        n_bytes: usize,
        expected_n_bytes: usize,
    },
    #[error(
        "{}: tensor '{second}' at data_offsets [{second_begin}, {second_end}] overlaps tensor '{first}' at \
         [{first_begin}, {first_end}]",
        .path.display()
    )]
    OverlappingTensors {
        path: PathBuf,
        first: String,
        first_begin: usize,
        first_end: usize,
        second: String,
        second_begin: usize,
        second_end: usize,
    },
    #[error("{}: tensor '{tensor}' appears more than once", .path.display())]
    DuplicateTensor { path: PathBuf, tensor: String },
    #[error("{}: missing config.json", .dir.display())]
    MissingConfig { dir: PathBuf },
    #[error("{}: not valid JSON at line {line} column {column}: {message}", .path.display())]
    ConfigNotJson { path: PathBuf, line: usize, column: usize, message: String },
    #[error(
        "{}: neither model.safetensors nor model.safetensors.index.json, but found {found:?}",
        .dir.display()
    )]
    NoSingleFileOrIndex { dir: PathBuf, found: Vec<String> },
    #[error("{}: no weight files (*.safetensors) at all", .dir.display())]
    NoWeightFiles { dir: PathBuf },
    #[error("{}: not a valid index at line {line} column {column}: {message}", .path.display())]
    IndexNotJson { path: PathBuf, line: usize, column: usize, message: String },
    #[error("{}: index has no \"weight_map\"", .path.display())]
    IndexWithoutWeightMap { path: PathBuf },
    #[error("{}: index \"weight_map\" is empty", .path.display())]
    IndexEmpty { path: PathBuf },
    #[error("{}: weight_map entry '{tensor}' must be a shard file name, found {found}", .path.display())]
    IndexBadShardName { path: PathBuf, tensor: String, found: String },
    #[error("{}: weight_map lists tensor '{tensor}' more than once", .path.display())]
    IndexDuplicateTensor { path: PathBuf, tensor: String },
    #[error(
        "{}: shard '{shard}' (holding tensor '{tensor}') does not exist in {}",
        .index_path.display(), .dir.display()
    )]
    MissingShard { index_path: PathBuf, dir: PathBuf, shard: String, tensor: String },
    #[error("{}: tensor '{tensor}' is mapped to shard {}, which does not contain it", .index_path.display(), .shard.display())]
    TensorNotInShard { index_path: PathBuf, tensor: String, shard: PathBuf },
    #[error("{}: tensor '{tensor}' is absent from the index {}", .shard.display(), .index_path.display())]
    TensorNotInIndex { index_path: PathBuf, tensor: String, shard: PathBuf },
    #[error("tensor '{tensor}' is in two shards: {} and {}", .first.display(), .second.display())]
    TensorInTwoShards { tensor: String, first: PathBuf, second: PathBuf },
    #[error("{}: writing tensor '{tensor}': {source}", .path.display())]
    FillFailed { path: PathBuf, tensor: String, source: std::io::Error },
    #[error("{}: tensor '{tensor}': fill wrote {written_n_bytes} bytes, expected {expected_n_bytes}", .path.display())]
    FillWrongSize { path: PathBuf, tensor: String, written_n_bytes: u64, expected_n_bytes: u64 },
}

type Result<T> = std::result::Result<T, SafetensorsError>;

/// Where one tensor lies in a file; `begin`/`end` are byte offsets relative to the data section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StTensorInfo {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub begin: usize,
    pub end: usize,
}

/// One memory-mapped, fully validated `.safetensors` file.
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    mmap: Arc<Mmap>,
    metadata: BTreeMap<String, String>,
    /// Sorted by `begin` (file order).
    tensors: Vec<StTensorInfo>,
    index_of_name: HashMap<String, usize>,
    data_start: usize,
}

impl SafetensorsFile {
    /// Map and validate `path`.
    pub fn open(path: &Path) -> Result<SafetensorsFile> {
        let io_err = |source| SafetensorsError::Io { path: path.to_path_buf(), source };
        let file = File::open(path).map_err(io_err)?;
        let file_n_bytes = file.metadata().map_err(io_err)?.len();
        if file_n_bytes < 8 {
            return Err(SafetensorsError::FileTooShort { path: path.to_path_buf(), n_bytes: file_n_bytes });
        }
        // SAFETY: the map is read-only; moe-lanes never writes model files in place (writers go
        // through `<path>.tmp` + rename), so the mapped bytes do not change while we hold them.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io_err)?;
        let header = parse_header(path, &mmap)?;
        let mmap = Arc::new(mmap);
        let mut index_of_name = HashMap::new();
        for (i, info) in header.tensors.iter().enumerate() {
            index_of_name.insert(info.name.clone(), i);
        }
        Ok(SafetensorsFile {
            path: path.to_path_buf(),
            mmap,
            metadata: header.metadata,
            tensors: header.tensors,
            index_of_name,
            data_start: header.data_start,
        })
    }

    /// Validate a `.safetensors` image held in memory exactly as [`SafetensorsFile::open`]
    /// validates a file (`path` only names it in errors). Returns the tensor infos; the fuzz
    /// target's entry point.
    pub fn check_bytes(path: &Path, bytes: &[u8]) -> Result<Vec<StTensorInfo>> {
        if bytes.len() < 8 {
            return Err(SafetensorsError::FileTooShort {
                path: path.to_path_buf(),
                n_bytes: bytes.len() as u64,
            });
        }
        Ok(parse_header(path, bytes)?.tensors)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// All tensors in file order (ascending `begin`).
    pub fn tensors(&self) -> &[StTensorInfo] {
        &self.tensors
    }

    /// The `"__metadata__"` entry (empty when absent).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// Zero-copy view of tensor `name`, borrowing the mapped file.
    pub fn tensor(&self, name: &str) -> Option<TensorRef<'_>> {
        let info = &self.tensors[*self.index_of_name.get(name)?];
        let data = &self.mmap[self.data_start + info.begin..self.data_start + info.end];
        Some(TensorRef { name: &info.name, dtype: info.dtype, shape: &info.shape, data })
    }
}

/// The validated contents of a header.
struct Header {
    metadata: BTreeMap<String, String>,
    tensors: Vec<StTensorInfo>,
    data_start: usize,
}

/// JSON object entries in file order, duplicates kept (serde_json's `Map` would drop them).
struct OrderedEntries(Vec<(String, Value)>);

impl<'de> Deserialize<'de> for OrderedEntries {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        deserializer.deserialize_map(OrderedEntriesVisitor)
    }
}

struct OrderedEntriesVisitor;

impl<'de> Visitor<'de> for OrderedEntriesVisitor {
    type Value = OrderedEntries;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<OrderedEntries, A::Error> {
        let mut entries = Vec::new();
        while let Some(entry) = map.next_entry::<String, Value>()? {
            entries.push(entry);
        }
        Ok(OrderedEntries(entries))
    }
}

fn parse_header(path: &Path, bytes: &[u8]) -> Result<Header> {
    let header_text = header_text(path, bytes)?;
    let data_start = 8 + header_text.len();
    let data_n_bytes = bytes.len() - data_start;
    let entries: OrderedEntries =
        serde_json::from_str(header_text).map_err(|e| SafetensorsError::HeaderNotJson {
            path: path.to_path_buf(),
            line: e.line(),
            column: e.column(),
            offset: 8 + text_offset(header_text, e.line(), e.column()),
            message: json_message(&e),
        })?;
    reject_duplicate_keys(path, &entries)?;
    let mut metadata = BTreeMap::new();
    let mut tensors = Vec::new();
    for (name, value) in &entries.0 {
        if name == METADATA_KEY {
            metadata = parse_metadata(path, value)?;
        } else {
            tensors.push(parse_tensor_entry(path, name, value, data_n_bytes)?);
        }
    }
    tensors.sort_by(|a, b| (a.begin, a.end, &a.name).cmp(&(b.begin, b.end, &b.name)));
    reject_overlaps(path, &tensors)?;
    Ok(Header { metadata, tensors, data_start })
}

/// The header's JSON text, after checking the length prefix and UTF-8.
fn header_text<'a>(path: &Path, bytes: &'a [u8]) -> Result<&'a str> {
    let file_n_bytes = bytes.len() as u64;
    let mut length_prefix = [0u8; 8];
    length_prefix.copy_from_slice(&bytes[..8]);
    let header_n_bytes = u64::from_le_bytes(length_prefix);
    if header_n_bytes > MAX_HEADER_BYTES {
        return Err(SafetensorsError::HeaderTooLarge { path: path.to_path_buf(), header_n_bytes });
    }
    if header_n_bytes > file_n_bytes - 8 {
        return Err(SafetensorsError::HeaderPastEnd {
            path: path.to_path_buf(),
            header_n_bytes,
            file_n_bytes,
        });
    }
    let header_bytes = &bytes[8..8 + header_n_bytes as usize];
    std::str::from_utf8(header_bytes).map_err(|e| SafetensorsError::HeaderNotUtf8 {
        path: path.to_path_buf(),
        offset: 8 + e.valid_up_to(),
    })
}

/// serde_json's message without its trailing " at line L column C" (our messages place those).
fn json_message(error: &serde_json::Error) -> String {
    let text = error.to_string();
    let suffix = format!(" at line {} column {}", error.line(), error.column());
    text.strip_suffix(&suffix).unwrap_or(&text).to_string()
}

/// Byte offset of serde_json's 1-based `line`/`column` in `text` (clamped to its length).
fn text_offset(text: &str, line: usize, column: usize) -> usize {
    let line_start: usize = text.split_inclusive('\n').take(line.saturating_sub(1)).map(|l| l.len()).sum();
    (line_start + column.saturating_sub(1)).min(text.len())
}

fn reject_duplicate_keys(path: &Path, entries: &OrderedEntries) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for (name, _) in &entries.0 {
        if !seen.insert(name.as_str()) {
            return Err(SafetensorsError::DuplicateTensor { path: path.to_path_buf(), tensor: name.clone() });
        }
    }
    Ok(())
}

fn parse_metadata(path: &Path, value: &Value) -> Result<BTreeMap<String, String>> {
    let Value::Object(object) = value else {
        return Err(SafetensorsError::MetadataNotObject { path: path.to_path_buf(), found: snippet(value) });
    };
    let mut metadata = BTreeMap::new();
    for (key, value) in object {
        let Value::String(text) = value else {
            return Err(SafetensorsError::MetadataNotString {
                path: path.to_path_buf(),
                key: key.clone(),
                found: snippet(value),
            });
        };
        metadata.insert(key.clone(), text.clone());
    }
    Ok(metadata)
}

/// A short rendering of a JSON value for error messages.
fn snippet(value: &Value) -> String {
    let text = value.to_string();
    match text.char_indices().nth(40) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text,
    }
}

/// Parses one tensor entry and checks it against the data section.
fn parse_tensor_entry(path: &Path, name: &str, value: &Value, data_n_bytes: usize) -> Result<StTensorInfo> {
    let entry = EntryParser { path, name, value };
    let dtype = entry.dtype()?;
    let shape = entry.shape()?;
    let (begin, end) = entry.data_offsets()?;
    let info = StTensorInfo { name: name.to_string(), dtype, shape, begin, end };
    check_offsets(path, &info, data_n_bytes)?;
    check_n_bytes(path, &info)?;
    Ok(info)
}

struct EntryParser<'a> {
    path: &'a Path,
    name: &'a str,
    value: &'a Value,
}

impl EntryParser<'_> {
    fn field(&self, key: &'static str) -> Result<&Value> {
        let Value::Object(object) = self.value else {
            return Err(SafetensorsError::EntryNotObject {
                path: self.path.to_path_buf(),
                tensor: self.name.to_string(),
                found: snippet(self.value),
            });
        };
        object.get(key).ok_or_else(|| SafetensorsError::MissingKey {
            path: self.path.to_path_buf(),
            tensor: self.name.to_string(),
            key,
        })
    }

    fn wrong_type(&self, key: &'static str, expected: &'static str, found: &Value) -> SafetensorsError {
        SafetensorsError::WrongType {
            path: self.path.to_path_buf(),
            tensor: self.name.to_string(),
            key,
            expected,
            found: snippet(found),
        }
    }

    fn dtype(&self) -> Result<DType> {
        let value = self.field("dtype")?;
        let name = value.as_str().ok_or_else(|| self.wrong_type("dtype", "a string", value))?;
        DType::from_safetensors_name(name).ok_or_else(|| SafetensorsError::UnsupportedDType {
            path: self.path.to_path_buf(),
            tensor: self.name.to_string(),
            dtype: name.to_string(),
        })
    }

    fn shape(&self) -> Result<Vec<usize>> {
        let value = self.field("shape")?;
        self.usize_array(value)
            .ok_or_else(|| self.wrong_type("shape", "an array of unsigned integers", value))
    }

    fn data_offsets(&self) -> Result<(usize, usize)> {
        let value = self.field("data_offsets")?;
        match self.usize_array(value).as_deref() {
            Some(&[begin, end]) => Ok((begin, end)),
            _ => Err(self.wrong_type("data_offsets", "[begin, end] (two unsigned integers)", value)),
        }
    }

    fn usize_array(&self, value: &Value) -> Option<Vec<usize>> {
        value.as_array()?.iter().map(|v| v.as_u64().and_then(|n| usize::try_from(n).ok())).collect()
    }
}

fn check_offsets(path: &Path, info: &StTensorInfo, data_n_bytes: usize) -> Result<()> {
    let (begin, end) = (info.begin, info.end);
    if begin > end {
        let tensor = info.name.clone();
        return Err(SafetensorsError::OffsetsReversed { path: path.to_path_buf(), tensor, begin, end });
    }
    if end > data_n_bytes {
        let tensor = info.name.clone();
        return Err(SafetensorsError::OffsetsPastEnd {
            path: path.to_path_buf(),
            tensor,
            begin,
            end,
            data_n_bytes,
        });
    }
    Ok(())
}

fn check_n_bytes(path: &Path, info: &StTensorInfo) -> Result<()> {
    let expected_n_bytes =
        tensor_n_bytes(info.dtype, &info.shape).ok_or_else(|| SafetensorsError::ShapeOverflow {
            path: path.to_path_buf(),
            tensor: info.name.clone(),
            shape: info.shape.clone(),
        })?;
    let n_bytes = info.end - info.begin;
    if n_bytes != expected_n_bytes {
        return Err(SafetensorsError::SizeMismatch {
            path: path.to_path_buf(),
            tensor: info.name.clone(),
            dtype: info.dtype,
            shape: info.shape.clone(),
            begin: info.begin,
            end: info.end,
            n_bytes,
            expected_n_bytes,
        });
    }
    Ok(())
}

/// Bytes of a dense tensor, `None` on overflow.
fn tensor_n_bytes(dtype: DType, shape: &[usize]) -> Option<usize> {
    let n_elems = shape.iter().try_fold(1usize, |acc, &dim| acc.checked_mul(dim))?;
    dtype.bytes_for(n_elems)
}

/// Tensors must be sorted by `begin`; empty tensors never overlap anything.
fn reject_overlaps(path: &Path, tensors: &[StTensorInfo]) -> Result<()> {
    let mut previous: Option<&StTensorInfo> = None;
    for info in tensors.iter().filter(|t| t.end > t.begin) {
        if let Some(first) = previous.filter(|p| info.begin < p.end) {
            return Err(SafetensorsError::OverlappingTensors {
                path: path.to_path_buf(),
                first: first.name.clone(),
                first_begin: first.begin,
                first_end: first.end,
                second: info.name.clone(),
                second_begin: info.begin,
                second_end: info.end,
            });
        }
        if previous.is_none_or(|p| info.end > p.end) {
            previous = Some(info);
        }
    }
    Ok(())
}

/// A model directory: config.json plus `model.safetensors`, or `model.safetensors.index.json` and its shards.
#[derive(Debug)]
pub struct SafetensorsModel {
    dir: PathBuf,
    config: Value,
    files: Vec<SafetensorsFile>,
    /// Tensor name -> index into `files`.
    file_of_tensor: BTreeMap<String, usize>,
}

impl SafetensorsModel {
    /// Fault every weight file's mapping into this process's page tables now (see
    /// [`crate::model::Model::populate`]).
    pub fn populate(&self) -> std::io::Result<()> {
        self.files.iter().try_for_each(|f| super::populate_map(&f.mmap))
    }

    /// Every weight file's read-only map (every tensor's bytes borrow from one of them).
    pub fn mappings(&self) -> Vec<Arc<Mmap>> {
        self.files.iter().map(|f| f.mmap.clone()).collect()
    }

    /// Read `dir/config.json` and map and cross-check every weight file.
    pub fn open(dir: &Path) -> Result<SafetensorsModel> {
        let config = read_config(dir)?;
        let files = open_weight_files(dir)?;
        let file_of_tensor = locate_tensors(&files)?;
        Ok(SafetensorsModel { dir: dir.to_path_buf(), config, files, file_of_tensor })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The parsed config.json.
    pub fn config(&self) -> &Value {
        &self.config
    }

    pub fn config_path(&self) -> PathBuf {
        self.dir.join(CONFIG_FILE)
    }

    pub fn tensor(&self, name: &str) -> Option<TensorRef<'_>> {
        self.files[*self.file_of_tensor.get(name)?].tensor(name)
    }

    /// All tensor names, sorted.
    pub fn tensor_names(&self) -> Vec<&str> {
        self.file_of_tensor.keys().map(String::as_str).collect()
    }

    /// The file holding tensor `name`.
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        Some(self.files[*self.file_of_tensor.get(name)?].path())
    }
}

fn read_config(dir: &Path) -> Result<Value> {
    let path = dir.join(CONFIG_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(SafetensorsError::MissingConfig { dir: dir.to_path_buf() })
        }
        Err(source) => return Err(SafetensorsError::Io { path, source }),
    };
    serde_json::from_str(&text).map_err(|e| SafetensorsError::ConfigNotJson {
        line: e.line(),
        column: e.column(),
        message: json_message(&e),
        path,
    })
}

/// The single file, or every shard the index names (each checked against the index).
fn open_weight_files(dir: &Path) -> Result<Vec<SafetensorsFile>> {
    let index_path = dir.join(INDEX_FILE);
    if index_path.is_file() {
        return open_shards(dir, &index_path);
    }
    let single_path = dir.join(SINGLE_FILE);
    if single_path.is_file() {
        return Ok(vec![SafetensorsFile::open(&single_path)?]);
    }
    let found = list_safetensors_files(dir)?;
    if found.is_empty() {
        return Err(SafetensorsError::NoWeightFiles { dir: dir.to_path_buf() });
    }
    Err(SafetensorsError::NoSingleFileOrIndex { dir: dir.to_path_buf(), found })
}

/// Names of `*.safetensors` files in `dir`, sorted.
fn list_safetensors_files(dir: &Path) -> Result<Vec<String>> {
    let io_err = |source| SafetensorsError::Io { path: dir.to_path_buf(), source };
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_err)? {
        let name = entry.map_err(io_err)?.file_name().to_string_lossy().into_owned();
        if name.ends_with(".safetensors") {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

#[derive(serde::Deserialize)]
struct RawIndex {
    weight_map: Option<OrderedEntries>,
}

/// Read the index into tensor name -> shard file name.
fn read_index(index_path: &Path) -> Result<BTreeMap<String, String>> {
    let path = index_path.to_path_buf();
    let text = std::fs::read_to_string(index_path).map_err(|source| SafetensorsError::Io { path, source })?;
    parse_index(index_path, &text)
}

/// Parse `model.safetensors.index.json` text (`index_path` names it in errors) into tensor name
/// -> shard file name: every shard a plain file name, no tensor twice. The fuzz target's entry.
pub fn parse_index(index_path: &Path, text: &str) -> Result<BTreeMap<String, String>> {
    let raw: RawIndex = serde_json::from_str(text).map_err(|e| SafetensorsError::IndexNotJson {
        path: index_path.to_path_buf(),
        line: e.line(),
        column: e.column(),
        message: json_message(&e),
    })?;
    let entries = raw
        .weight_map
        .ok_or_else(|| SafetensorsError::IndexWithoutWeightMap { path: index_path.to_path_buf() })?;
    if entries.0.is_empty() {
        return Err(SafetensorsError::IndexEmpty { path: index_path.to_path_buf() });
    }
    let mut shard_of_tensor = BTreeMap::new();
    for (tensor, value) in entries.0 {
        let shard = shard_name(index_path, &tensor, &value)?;
        if shard_of_tensor.insert(tensor.clone(), shard).is_some() {
            return Err(SafetensorsError::IndexDuplicateTensor { path: index_path.to_path_buf(), tensor });
        }
    }
    Ok(shard_of_tensor)
}

/// A weight_map value: a plain file name inside the model directory.
fn shard_name(index_path: &Path, tensor: &str, value: &Value) -> Result<String> {
    let is_plain_name =
        |name: &str| !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\\']);
    match value.as_str() {
        Some(name) if is_plain_name(name) => Ok(name.to_string()),
        _ => Err(SafetensorsError::IndexBadShardName {
            path: index_path.to_path_buf(),
            tensor: tensor.to_string(),
            found: snippet(value),
        }),
    }
}

fn open_shards(dir: &Path, index_path: &Path) -> Result<Vec<SafetensorsFile>> {
    let shard_of_tensor = read_index(index_path)?;
    let mut first_tensor_of_shard: BTreeMap<&str, &str> = BTreeMap::new();
    for (tensor, shard) in &shard_of_tensor {
        first_tensor_of_shard.entry(shard).or_insert(tensor);
    }
    let mut files = Vec::new();
    for (shard, tensor) in first_tensor_of_shard {
        let shard_path = dir.join(shard);
        if !shard_path.is_file() {
            return Err(SafetensorsError::MissingShard {
                index_path: index_path.to_path_buf(),
                dir: dir.to_path_buf(),
                shard: shard.to_string(),
                tensor: tensor.to_string(),
            });
        }
        files.push(SafetensorsFile::open(&shard_path)?);
    }
    check_index_matches_shards(index_path, &shard_of_tensor, &files)?;
    Ok(files)
}

fn check_index_matches_shards(
    index_path: &Path,
    shard_of_tensor: &BTreeMap<String, String>,
    files: &[SafetensorsFile],
) -> Result<()> {
    let file_of_tensor = locate_tensors(files)?;
    for (tensor, shard) in shard_of_tensor {
        let holder = file_of_tensor.get(tensor).map(|&i| files[i].path());
        if holder.and_then(Path::file_name) != Some(std::ffi::OsStr::new(shard)) {
            let shard = index_path.with_file_name(shard);
            let tensor = tensor.clone();
            return Err(SafetensorsError::TensorNotInShard {
                index_path: index_path.to_path_buf(),
                tensor,
                shard,
            });
        }
    }
    for (tensor, &i) in &file_of_tensor {
        if !shard_of_tensor.contains_key(tensor) {
            return Err(SafetensorsError::TensorNotInIndex {
                index_path: index_path.to_path_buf(),
                tensor: tensor.clone(),
                shard: files[i].path().to_path_buf(),
            });
        }
    }
    Ok(())
}

/// Tensor name -> index of the file holding it; a name in two files is an error.
fn locate_tensors(files: &[SafetensorsFile]) -> Result<BTreeMap<String, usize>> {
    let mut file_of_tensor = BTreeMap::new();
    for (i, file) in files.iter().enumerate() {
        for info in file.tensors() {
            if let Some(first) = file_of_tensor.insert(info.name.clone(), i) {
                return Err(SafetensorsError::TensorInTwoShards {
                    tensor: info.name.clone(),
                    first: files[first].path().to_path_buf(),
                    second: file.path().to_path_buf(),
                });
            }
        }
    }
    Ok(file_of_tensor)
}

/// Name, element type and shape of a tensor to write.
#[derive(Debug, Clone)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

/// Data bytes of a tensor to write; only float dtypes can be written. Errors name `path`.
fn spec_n_bytes(path: &Path, spec: &TensorSpec) -> Result<usize> {
    if !spec.dtype.is_float() {
        return Err(SafetensorsError::UnsupportedDType {
            path: path.to_path_buf(),
            tensor: spec.name.clone(),
            dtype: spec.dtype.name().to_string(),
        });
    }
    tensor_n_bytes(spec.dtype, &spec.shape).ok_or_else(|| SafetensorsError::ShapeOverflow {
        path: path.to_path_buf(),
        tensor: spec.name.clone(),
        shape: spec.shape.clone(),
    })
}

/// Write one .safetensors file via `<path>.tmp` + rename. `fill(idx, out)` must write exactly that tensor's bytes (checked).
/// Header: JSON with "__metadata__" and each tensor {dtype, shape, data_offsets}, header length padded with spaces to a multiple of 8.
///
/// Tensors are laid out in the order given. `progress(n_bytes)` is called after each tensor with
/// the number of data bytes just written (an increment, not a running total). On any error the
/// `.tmp` file is removed and `path` is left untouched.
pub fn write_file(
    path: &Path,
    tensors: &[TensorSpec],
    metadata: &BTreeMap<String, String>,
    fill: &mut dyn FnMut(usize, &mut dyn Write) -> std::io::Result<()>,
    progress: &mut dyn FnMut(u64),
) -> Result<()> {
    let header = header_bytes(path, tensors, metadata)?;
    let tmp_path = tmp_path_of(path);
    let written =
        write_tmp(&tmp_path, path, &header, tensors, fill, progress).and_then(|()| rename(&tmp_path, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp_path);
    }
    written
}

fn rename(from: &Path, to: &Path) -> Result<()> {
    std::fs::rename(from, to).map_err(|source| SafetensorsError::Io { path: to.to_path_buf(), source })
}

/// The 8-byte length prefix plus the space-padded JSON header.
fn header_bytes(path: &Path, tensors: &[TensorSpec], metadata: &BTreeMap<String, String>) -> Result<Vec<u8>> {
    let mut object = serde_json::Map::new();
    object.insert(METADATA_KEY.to_string(), serde_json::to_value(metadata).unwrap_or_default());
    let mut begin = 0usize;
    for spec in tensors {
        let end = begin + spec_n_bytes(path, spec)?;
        let entry = serde_json::json!({
            "dtype": spec.dtype.name(),
            "shape": spec.shape,
            "data_offsets": [begin, end],
        });
        if object.insert(spec.name.clone(), entry).is_some() {
            return Err(SafetensorsError::DuplicateTensor {
                path: path.to_path_buf(),
                tensor: spec.name.clone(),
            });
        }
        begin = end;
    }
    let mut json = Value::Object(object).to_string().into_bytes();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&json);
    Ok(bytes)
}

/// Write header and data to `tmp_path` and sync it; errors name `final_path`.
fn write_tmp(
    tmp_path: &Path,
    final_path: &Path,
    header: &[u8],
    tensors: &[TensorSpec],
    fill: &mut dyn FnMut(usize, &mut dyn Write) -> std::io::Result<()>,
    progress: &mut dyn FnMut(u64),
) -> Result<()> {
    let io_err = |source| SafetensorsError::Io { path: tmp_path.to_path_buf(), source };
    let file = File::create(tmp_path).map_err(io_err)?;
    let mut out = BufWriter::with_capacity(1 << 20, file);
    out.write_all(header).map_err(io_err)?;
    for (idx, spec) in tensors.iter().enumerate() {
        let n_bytes = write_tensor(final_path, &mut out, idx, spec, fill)?;
        progress(n_bytes);
    }
    let file = out.into_inner().map_err(|e| io_err(e.into_error()))?;
    file.sync_all().map_err(io_err)
}

/// Run `fill` for one tensor and check it wrote exactly the tensor's bytes.
fn write_tensor(
    path: &Path,
    out: &mut dyn Write,
    idx: usize,
    spec: &TensorSpec,
    fill: &mut dyn FnMut(usize, &mut dyn Write) -> std::io::Result<()>,
) -> Result<u64> {
    let expected_n_bytes = spec_n_bytes(path, spec)? as u64;
    let mut counter = CountingWriter { inner: out, n_bytes: 0 };
    fill(idx, &mut counter).map_err(|source| SafetensorsError::FillFailed {
        path: path.to_path_buf(),
        tensor: spec.name.clone(),
        source,
    })?;
    if counter.n_bytes != expected_n_bytes {
        return Err(SafetensorsError::FillWrongSize {
            path: path.to_path_buf(),
            tensor: spec.name.clone(),
            written_n_bytes: counter.n_bytes,
            expected_n_bytes,
        });
    }
    Ok(expected_n_bytes)
}

/// Write a model directory (created if missing): config.json (pretty), and either model.safetensors (max_shard_bytes None or all fits)
/// or shards `model-00001-of-0000N.safetensors` of at most max_shard_bytes each (a tensor never split) plus model.safetensors.index.json
/// ({"metadata": {"total_size": N}, "weight_map": {name: shard}}). Every file goes through tmp + rename; config.json is written last.
/// `fill` gets the index into `tensors`. metadata {"format": "pt"} in every file.
///
/// `max_shard_bytes` bounds each shard's tensor data (headers are not counted, as in
/// `transformers`); a tensor larger than the bound gets a shard of its own. A stale
/// `model.safetensors` or index left from an earlier layout is removed, so `open` sees one layout.
pub fn write_model_dir(
    dir: &Path,
    config: &Value,
    tensors: &[TensorSpec],
    max_shard_bytes: Option<u64>,
    fill: &mut dyn FnMut(usize, &mut dyn Write) -> std::io::Result<()>,
    progress: &mut dyn FnMut(u64),
) -> Result<()> {
    if dir.exists() {
        return write_model_dir_in(dir, config, tensors, max_shard_bytes, fill, progress);
    }
    // A new directory is built under a temporary name and renamed into place when complete, so
    // an interrupted or failed write never leaves a half-made model at `dir`.
    let tmp = tmp_path_of(dir);
    let result = write_model_dir_in(&tmp, config, tensors, max_shard_bytes, fill, progress)
        .and_then(|()| rename(&tmp, dir));
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

fn write_model_dir_in(
    dir: &Path,
    config: &Value,
    tensors: &[TensorSpec],
    max_shard_bytes: Option<u64>,
    fill: &mut dyn FnMut(usize, &mut dyn Write) -> std::io::Result<()>,
    progress: &mut dyn FnMut(u64),
) -> Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|source| SafetensorsError::Io { path: dir.to_path_buf(), source })?;
    let mut sizes = Vec::with_capacity(tensors.len());
    for spec in tensors {
        sizes.push(spec_n_bytes(&dir.join(SINGLE_FILE), spec)? as u64);
    }
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let shards = plan_shards(&sizes, max_shard_bytes);
    if shards.len() <= 1 {
        write_file(&dir.join(SINGLE_FILE), tensors, &metadata, fill, progress)?;
        remove_stale(&dir.join(INDEX_FILE))?;
    } else {
        write_shards(dir, tensors, &shards, &metadata, fill, progress)?;
        write_index(dir, tensors, &sizes, &shards)?;
        remove_stale(&dir.join(SINGLE_FILE))?;
    }
    let config_text = serde_json::to_string_pretty(config).unwrap_or_default() + "\n";
    write_small_file(&dir.join(CONFIG_FILE), config_text.as_bytes())
}

/// Group tensor indices into shards of at most `max_shard_bytes` data bytes, in order.
fn plan_shards(sizes: &[u64], max_shard_bytes: Option<u64>) -> Vec<Vec<usize>> {
    let Some(max_n_bytes) = max_shard_bytes else {
        return vec![(0..sizes.len()).collect()];
    };
    let mut shards: Vec<Vec<usize>> = Vec::new();
    let mut current_n_bytes = 0u64;
    for (idx, &n_bytes) in sizes.iter().enumerate() {
        match shards.last_mut() {
            Some(shard) if current_n_bytes + n_bytes <= max_n_bytes => {
                shard.push(idx);
                current_n_bytes += n_bytes;
            }
            _ => {
                shards.push(vec![idx]);
                current_n_bytes = n_bytes;
            }
        }
    }
    shards
}

fn shard_file_name(shard_idx: usize, n_shards: usize) -> String {
    format!("model-{:05}-of-{n_shards:05}.safetensors", shard_idx + 1)
}

fn write_shards(
    dir: &Path,
    tensors: &[TensorSpec],
    shards: &[Vec<usize>],
    metadata: &BTreeMap<String, String>,
    fill: &mut dyn FnMut(usize, &mut dyn Write) -> std::io::Result<()>,
    progress: &mut dyn FnMut(u64),
) -> Result<()> {
    for (shard_idx, members) in shards.iter().enumerate() {
        let specs: Vec<TensorSpec> = members.iter().map(|&i| tensors[i].clone()).collect();
        let mut shard_fill = |local: usize, out: &mut dyn Write| fill(members[local], out);
        let path = dir.join(shard_file_name(shard_idx, shards.len()));
        write_file(&path, &specs, metadata, &mut shard_fill, progress)?;
    }
    Ok(())
}

fn write_index(dir: &Path, tensors: &[TensorSpec], sizes: &[u64], shards: &[Vec<usize>]) -> Result<()> {
    let mut weight_map = BTreeMap::new();
    for (shard_idx, members) in shards.iter().enumerate() {
        for &i in members {
            weight_map.insert(tensors[i].name.clone(), shard_file_name(shard_idx, shards.len()));
        }
    }
    let total_size: u64 = sizes.iter().sum();
    let index = serde_json::json!({ "metadata": { "total_size": total_size }, "weight_map": weight_map });
    let text = serde_json::to_string_pretty(&index).unwrap_or_default() + "\n";
    write_small_file(&dir.join(INDEX_FILE), text.as_bytes())
}

/// Write `bytes` to `path` via `<path>.tmp` + rename.
fn write_small_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp_path = tmp_path_of(path);
    let written = std::fs::write(&tmp_path, bytes)
        .map_err(|source| SafetensorsError::Io { path: tmp_path.clone(), source })
        .and_then(|()| rename(&tmp_path, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp_path);
    }
    written
}

fn remove_stale(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(SafetensorsError::Io { path: path.to_path_buf(), source: e })
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, dtype: DType, shape: &[usize]) -> TensorSpec {
        TensorSpec { name: name.to_string(), dtype, shape: shape.to_vec() }
    }

    /// Tensors of all three dtypes and 0-d, 1-d and 3-d shapes.
    fn sample_specs() -> Vec<TensorSpec> {
        vec![
            spec("scalar", DType::F32, &[]),
            spec("bias", DType::F16, &[5]),
            spec("experts.w", DType::BF16, &[2, 3, 4]),
            spec("norm", DType::F32, &[7]),
            spec("empty", DType::F16, &[0, 3]),
        ]
    }

    /// Deterministic, distinct bytes for tensor `idx`.
    fn sample_bytes(specs: &[TensorSpec], idx: usize) -> Vec<u8> {
        let n_bytes = tensor_n_bytes(specs[idx].dtype, &specs[idx].shape).unwrap();
        (0..n_bytes).map(|i| (i * 7 + idx * 31 + 1) as u8).collect()
    }

    fn fill_from(specs: &[TensorSpec]) -> impl FnMut(usize, &mut dyn Write) -> std::io::Result<()> + '_ {
        move |idx, out| out.write_all(&sample_bytes(specs, idx))
    }

    fn assert_tensors_match<'a>(specs: &[TensorSpec], get: impl Fn(&str) -> Option<TensorRef<'a>>) {
        for (idx, spec) in specs.iter().enumerate() {
            let tensor = get(&spec.name).unwrap_or_else(|| panic!("missing {}", spec.name));
            assert_eq!(tensor.name, spec.name);
            assert_eq!(tensor.dtype, spec.dtype);
            assert_eq!(tensor.shape, spec.shape.as_slice());
            assert_eq!(tensor.data, sample_bytes(specs, idx).as_slice(), "{}", spec.name);
        }
    }

    #[test]
    fn single_file_round_trip_keeps_bytes_shapes_and_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let specs = sample_specs();
        let metadata = BTreeMap::from([("format".to_string(), "pt".to_string()), ("k".into(), "v".into())]);
        let mut progress_n_bytes = 0u64;
        write_file(&path, &specs, &metadata, &mut fill_from(&specs), &mut |n| progress_n_bytes += n).unwrap();
        let file = SafetensorsFile::open(&path).unwrap();
        assert_eq!(file.path(), path);
        assert_eq!(file.metadata(), &metadata);
        assert_eq!(file.tensors().len(), specs.len());
        assert_eq!(progress_n_bytes, file.tensors().iter().map(|t| (t.end - t.begin) as u64).sum::<u64>());
        assert_tensors_match(&specs, |name| file.tensor(name));
        assert!(file.tensor("nope").is_none());
        assert!(!tmp_path_of(&path).exists());
    }

    #[test]
    fn header_is_padded_to_a_multiple_of_8_and_tensors_are_in_spec_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let specs = sample_specs();
        write_file(&path, &specs, &BTreeMap::new(), &mut fill_from(&specs), &mut |_| {}).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let header_n_bytes = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        assert_eq!(header_n_bytes % 8, 0);
        let file = SafetensorsFile::open(&path).unwrap();
        let names: Vec<&str> = file.tensors().iter().filter(|t| t.end > t.begin).map(|t| &*t.name).collect();
        assert_eq!(names, ["scalar", "bias", "experts.w", "norm"]);
        assert!(file.metadata().is_empty());
    }

    #[test]
    fn model_dir_single_file_round_trip_is_byte_identical() {
        let dir = tempfile::tempdir().unwrap();
        let model_dir = dir.path().join("model");
        let specs = sample_specs();
        let config = serde_json::json!({"model_type": "qwen3_moe", "num_experts": 4});
        write_model_dir(&model_dir, &config, &specs, None, &mut fill_from(&specs), &mut |_| {}).unwrap();
        assert!(!model_dir.join(INDEX_FILE).exists());
        let model = SafetensorsModel::open(&model_dir).unwrap();
        assert_eq!(model.dir(), model_dir);
        assert_eq!(model.config(), &config);
        assert_eq!(model.config_path(), model_dir.join("config.json"));
        assert_tensors_match(&specs, |name| model.tensor(name));
        let mut expected: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        expected.sort();
        assert_eq!(model.tensor_names(), expected);
        assert_eq!(model.file_of("bias"), Some(model_dir.join(SINGLE_FILE).as_path()));
        let file = SafetensorsFile::open(&model_dir.join(SINGLE_FILE)).unwrap();
        assert_eq!(file.metadata().get("format").map(String::as_str), Some("pt"));
    }

    #[test]
    fn model_dir_sharded_round_trip_is_byte_identical() {
        let dir = tempfile::tempdir().unwrap();
        let specs = sample_specs();
        let config = serde_json::json!({"hidden_size": 8});
        let mut progress_n_bytes = 0u64;
        let mut progress = |n| progress_n_bytes += n;
        write_model_dir(dir.path(), &config, &specs, Some(32), &mut fill_from(&specs), &mut progress)
            .unwrap();
        // 4 + 10 | 48 (larger than the bound: own shard) | 28 + 0
        let shard_names: Vec<String> = (0..3).map(|i| shard_file_name(i, 3)).collect();
        assert_eq!(shard_names[0], "model-00001-of-00003.safetensors");
        for name in &shard_names {
            assert!(dir.path().join(name).is_file(), "{name}");
        }
        assert!(!dir.path().join(SINGLE_FILE).exists());
        let index: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join(INDEX_FILE)).unwrap()).unwrap();
        assert_eq!(index["metadata"]["total_size"], 90);
        assert_eq!(progress_n_bytes, 90);
        assert_eq!(index["weight_map"]["experts.w"], shard_names[1]);
        let model = SafetensorsModel::open(dir.path()).unwrap();
        assert_tensors_match(&specs, |name| model.tensor(name));
        assert_eq!(model.file_of("norm"), Some(dir.path().join(&shard_names[2]).as_path()));
        assert_eq!(model.config(), &config);
        let shard = SafetensorsFile::open(&dir.path().join(&shard_names[0])).unwrap();
        assert_eq!(shard.metadata().get("format").map(String::as_str), Some("pt"));
    }

    #[test]
    fn rewriting_a_model_dir_as_one_file_removes_the_stale_index() {
        let dir = tempfile::tempdir().unwrap();
        let specs = sample_specs();
        let config = serde_json::json!({});
        write_model_dir(dir.path(), &config, &specs, Some(16), &mut fill_from(&specs), &mut |_| {}).unwrap();
        write_model_dir(dir.path(), &config, &specs, Some(1 << 20), &mut fill_from(&specs), &mut |_| {})
            .unwrap();
        assert!(!dir.path().join(INDEX_FILE).exists());
        let model = SafetensorsModel::open(dir.path()).unwrap();
        assert_tensors_match(&specs, |name| model.tensor(name));
    }

    #[test]
    fn plan_shards_never_splits_and_respects_the_bound() {
        assert_eq!(plan_shards(&[4, 4, 4], None), vec![vec![0, 1, 2]]);
        assert_eq!(plan_shards(&[4, 4, 4], Some(8)), vec![vec![0, 1], vec![2]]);
        assert_eq!(plan_shards(&[10, 1, 1], Some(4)), vec![vec![0], vec![1, 2]]);
        assert_eq!(plan_shards(&[], Some(4)), Vec::<Vec<usize>>::new());
    }

    #[test]
    fn write_rejects_duplicate_names_and_quantised_dtypes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let twice = [spec("a", DType::F32, &[1]), spec("a", DType::F32, &[1])];
        let err = write_file(&path, &twice, &BTreeMap::new(), &mut |_, _| Ok(()), &mut |_| {}).unwrap_err();
        assert!(matches!(err, SafetensorsError::DuplicateTensor { .. }), "{err}");
        let quantised = [spec("q", DType::Q8_0, &[32])];
        let err =
            write_file(&path, &quantised, &BTreeMap::new(), &mut |_, _| Ok(()), &mut |_| {}).unwrap_err();
        assert!(err.to_string().contains("Q8_0"), "{err}");
        assert!(!path.exists() && !tmp_path_of(&path).exists());
    }

    #[test]
    fn no_truncation_or_byte_flip_of_a_valid_file_panics() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let specs = sample_specs();
        write_file(&path, &specs, &BTreeMap::new(), &mut fill_from(&specs), &mut |_| {}).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let bad_path = dir.path().join("bad.safetensors");
        for n_bytes in 0..bytes.len() {
            std::fs::write(&bad_path, &bytes[..n_bytes]).unwrap();
            let _ = SafetensorsFile::open(&bad_path);
        }
        for offset in 0..bytes.len() {
            for flip in [0x01u8, 0x20, 0x80, 0xff] {
                let mut corrupt = bytes.clone();
                corrupt[offset] ^= flip;
                std::fs::write(&bad_path, &corrupt).unwrap();
                let _ = SafetensorsFile::open(&bad_path);
            }
        }
    }

    #[test]
    fn text_offset_follows_lines_and_columns() {
        assert_eq!(text_offset("ab\ncd", 2, 2), 4);
        assert_eq!(text_offset("ab", 1, 1), 0);
        assert_eq!(text_offset("ab", 9, 9), 2);
    }
}
