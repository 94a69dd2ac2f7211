//! GGUF model files: a validating, zero-copy reader ([`GgufFile`]) and a streaming writer
//! ([`GgufWriter`]).
//!
//! Layout (little-endian): magic `GGUF`, `u32` version, `u64` tensor count, `u64` metadata count,
//! the metadata key/value pairs, the tensor infos, then the tensor data section, which starts at
//! the header end rounded up to `general.alignment` (default 32). Versions 2 and 3 are read; the
//! writer always produces version 3.
//!
//! GGUF stores tensor dimensions innermost first (`ne[0]` is the row length); this module reverses
//! them, so every [`GgufTensorInfo::shape`] is row-major, outermost first, like the rest of the crate.
//!
//! The reader never panics and never allocates more than the file could describe: every count is
//! checked against the bytes that remain before anything is allocated, all offsets use checked
//! arithmetic, and every failure is a [`GgufError`] naming the file and the offending key, tensor
//! or byte offset.

use super::write_util::{tmp_path_of, CountingWriter};
use crate::format::dtype::DType;
use crate::format::tensor::TensorRef;
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const MAGIC: [u8; 4] = *b"GGUF";
const WRITE_VERSION: u32 = 3;
const DEFAULT_ALIGNMENT: u64 = 32;
const ALIGNMENT_KEY: &str = "general.alignment";
const MAX_DIMS: usize = 4;
/// Deepest nesting of arrays inside arrays the reader follows (guards the stack against corrupt files).
const MAX_ARRAY_DEPTH: usize = 64;
/// Smallest possible encoded tensor info: empty name, zero dims, type, offset.
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8;
/// Smallest possible encoded key/value pair: empty key, type, one-byte value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
const WRITE_BUFFER_BYTES: usize = 8 << 20;

/// The type tag of a metadata value, with its GGUF id (`U8` = 0 … `F64` = 12).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl GgufValueType {
    const ALL: [GgufValueType; 13] = [
        GgufValueType::U8,
        GgufValueType::I8,
        GgufValueType::U16,
        GgufValueType::I16,
        GgufValueType::U32,
        GgufValueType::I32,
        GgufValueType::F32,
        GgufValueType::Bool,
        GgufValueType::String,
        GgufValueType::Array,
        GgufValueType::U64,
        GgufValueType::I64,
        GgufValueType::F64,
    ];

    /// The id GGUF stores for this type.
    pub fn id(self) -> u32 {
        self as u32
    }

    pub fn from_id(id: u32) -> Option<GgufValueType> {
        Self::ALL.get(usize::try_from(id).ok()?).copied()
    }

    /// Fewest bytes one value of this type can occupy (used to reject absurd array counts).
    fn min_encoded_bytes(self) -> u64 {
        match self {
            GgufValueType::U8 | GgufValueType::I8 | GgufValueType::Bool => 1,
            GgufValueType::U16 | GgufValueType::I16 => 2,
            GgufValueType::U32 | GgufValueType::I32 | GgufValueType::F32 => 4,
            GgufValueType::U64 | GgufValueType::I64 | GgufValueType::F64 | GgufValueType::String => 8,
            GgufValueType::Array => 4 + 8,
        }
    }
}

/// One metadata value.
/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`): the one definition,
/// read by the GGUF tokenizer (`crate::text`) and written by the synthetic vocabulary
/// ([`crate::vocab`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenType {
    Undefined = 0,
    Normal = 1,
    Unknown = 2,
    Control = 3,
    UserDefined = 4,
    Unused = 5,
    Byte = 6,
}

impl TokenType {
    /// The value a GGUF file stores for this type.
    pub fn gguf_value(self) -> i32 {
        self as i32
    }

    /// The type a GGUF file's value names, if any.
    pub fn from_i64(v: i64) -> Option<TokenType> {
        Some(match v {
            0 => TokenType::Undefined,
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => return None,
        })
    }

    /// Control and unknown tokens: matched in text only with `parse_special`, dropped by
    /// `decode(.., skip_special = true)`.
    pub fn is_special(self) -> bool {
        matches!(self, TokenType::Control | TokenType::Unknown)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(MetaArray),
}

/// A typed metadata array; its elements may themselves be arrays.
#[derive(Debug, Clone, PartialEq)]
pub struct MetaArray {
    pub elem_type: GgufValueType,
    pub values: Vec<MetaValue>,
}

impl MetaValue {
    /// Any integer value that is `>= 0`.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer value that fits in an `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => i64::try_from(v).ok(),
            MetaValue::I8(v) => Some(v.into()),
            MetaValue::I16(v) => Some(v.into()),
            MetaValue::I32(v) => Some(v.into()),
            MetaValue::I64(v) => Some(v),
            _ => None,
        }
    }

    /// Float values, and integers converted to `f64` (64-bit integers may round).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            MetaValue::U64(v) => Some(v as f64),
            MetaValue::I64(v) => Some(v as f64),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&MetaArray> {
        match self {
            MetaValue::Array(v) => Some(v),
            _ => None,
        }
    }

    pub fn value_type(&self) -> GgufValueType {
        match self {
            MetaValue::U8(_) => GgufValueType::U8,
            MetaValue::I8(_) => GgufValueType::I8,
            MetaValue::U16(_) => GgufValueType::U16,
            MetaValue::I16(_) => GgufValueType::I16,
            MetaValue::U32(_) => GgufValueType::U32,
            MetaValue::I32(_) => GgufValueType::I32,
            MetaValue::U64(_) => GgufValueType::U64,
            MetaValue::I64(_) => GgufValueType::I64,
            MetaValue::F32(_) => GgufValueType::F32,
            MetaValue::F64(_) => GgufValueType::F64,
            MetaValue::Bool(_) => GgufValueType::Bool,
            MetaValue::String(_) => GgufValueType::String,
            MetaValue::Array(_) => GgufValueType::Array,
        }
    }

    pub fn string_array(values: Vec<String>) -> MetaValue {
        Self::array_of(GgufValueType::String, values.into_iter().map(MetaValue::String).collect())
    }

    pub fn i32_array(values: Vec<i32>) -> MetaValue {
        Self::array_of(GgufValueType::I32, values.into_iter().map(MetaValue::I32).collect())
    }

    pub fn f32_array(values: Vec<f32>) -> MetaValue {
        Self::array_of(GgufValueType::F32, values.into_iter().map(MetaValue::F32).collect())
    }

    fn array_of(elem_type: GgufValueType, values: Vec<MetaValue>) -> MetaValue {
        MetaValue::Array(MetaArray { elem_type, values })
    }
}

/// Where one tensor lies in a GGUF file.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// Row-major, outermost dimension first (GGUF's `ne[]` reversed).
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// Offset of the tensor's bytes, relative to the start of the data section.
    pub offset: u64,
    pub n_bytes: usize,
}

/// Everything that can go wrong reading or writing a GGUF file. Each variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{}: I/O error: {source}", .path.display())]
    Io { path: PathBuf, source: std::io::Error },

    #[error("{}: not a GGUF file: magic bytes are {found:02x?} ({:?}), expected \"GGUF\"", .path.display(), String::from_utf8_lossy(found))]
    BadMagic { path: PathBuf, found: [u8; 4] },

    #[error("{}: unsupported GGUF version {version} (versions 2 and 3, little-endian, are supported)", .path.display())]
    UnsupportedVersion { path: PathBuf, version: u32 },

    #[error("{}: truncated at byte offset {offset} while reading {what}: needs {needed_bytes} bytes, file is {file_len} bytes", .path.display())]
    Truncated { path: PathBuf, offset: u64, needed_bytes: u64, file_len: u64, what: String },

    #[error("{}: unknown metadata value type id {type_id} at byte offset {offset} in {what}", .path.display())]
    UnknownValueType { path: PathBuf, offset: u64, type_id: u32, what: String },

    #[error(
        "{}: tensor '{tensor}' has ggml type id {type_id}{}, which moe-lanes does not read (it reads {})",
        .path.display(),
        crate::format::dtype::ggml_type_name(*type_id).map_or(String::new(), |n| format!(" ({n})")),
        crate::format::dtype::readable_type_names()
    )]
    UnknownTensorType { path: PathBuf, tensor: String, type_id: u32 },

    #[error("{}: invalid UTF-8 in string at byte offset {offset} in {what}", .path.display())]
    InvalidUtf8 { path: PathBuf, offset: u64, what: String },

    #[error("{}: tensor '{tensor}' has {n_dims} dimensions (at most 4 are allowed)", .path.display())]
    TooManyDims { path: PathBuf, tensor: String, n_dims: u64 },

    #[error("{}: tensor '{tensor}' of {dtype} with shape {shape:?}: row length {row_elems} is not a multiple of the block size {block_elems}", .path.display())]
    NotWholeBlocks {
        path: PathBuf,
        tensor: String,
        dtype: DType,
        shape: Vec<usize>,
        row_elems: usize,
        block_elems: usize,
    },

    #[error("{}: tensor '{tensor}' with dims {dims:?} (innermost first) is too large to address", .path.display())]
    TensorTooLarge { path: PathBuf, tensor: String, dims: Vec<u64> },

    #[error("{}: tensor '{tensor}' data at byte offset {offset} ({n_bytes} bytes) runs past the end of the file ({file_len} bytes)", .path.display())]
    TensorPastEnd { path: PathBuf, tensor: String, offset: u64, n_bytes: u64, file_len: u64 },

    #[error("{}: tensor '{tensor}' offset {offset} is not a multiple of the alignment {alignment}", .path.display())]
    MisalignedTensor { path: PathBuf, tensor: String, offset: u64, alignment: u64 },

    #[error("{}: bad '{ALIGNMENT_KEY}' value {found} (must be a u32 that is a nonzero power of two)", .path.display())]
    BadAlignment { path: PathBuf, found: String },

    #[error("{}: duplicate tensor name '{tensor}'", .path.display())]
    DuplicateTensor { path: PathBuf, tensor: String },

    #[error("{}: duplicate metadata key '{key}'", .path.display())]
    DuplicateKey { path: PathBuf, key: String },

    #[error("{}: absurd count {count} for {what} at byte offset {offset}: only {remaining_bytes} bytes remain", .path.display())]
    AbsurdCount { path: PathBuf, offset: u64, count: u64, what: String, remaining_bytes: u64 },

    #[error("{}: arrays nested deeper than {MAX_ARRAY_DEPTH} levels at byte offset {offset} in {what}", .path.display())]
    NestingTooDeep { path: PathBuf, offset: u64, what: String },

    #[error("{}: cannot write metadata '{key}': {reason}", .path.display())]
    InvalidMetadata { path: PathBuf, key: String, reason: String },

    #[error("{}: filling tensor '{tensor}' failed: {source}", .path.display())]
    FillFailed { path: PathBuf, tensor: String, source: std::io::Error },

    #[error("{}: filling tensor '{tensor}' wrote {written_bytes} bytes, expected {expected_bytes}", .path.display())]
    FillSizeMismatch { path: PathBuf, tensor: String, expected_bytes: u64, written_bytes: u64 },
}

/// A GGUF file, memory-mapped and validated; tensors are borrowed straight from the map.
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    mmap: Arc<memmap2::Mmap>,
    version: u32,
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

impl GgufFile {
    /// Fault the whole mapping into this process's page tables now (`MADV_POPULATE_READ`,
    /// reading from disk what is not in the page cache): see [`crate::model::Model::populate`].
    pub fn populate(&self) -> std::io::Result<()> {
        super::populate_map(&self.mmap)
    }

    /// The file's read-only map (every tensor's bytes borrow from it).
    pub fn mapping(&self) -> &Arc<memmap2::Mmap> {
        &self.mmap
    }

    /// Map and validate `path`: header, metadata, tensor infos, and that every tensor's bytes lie
    /// inside the file at an aligned offset.
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        let io_err = |source| GgufError::Io { path: path.to_path_buf(), source };
        let file = File::open(path).map_err(io_err)?;
        // SAFETY: the map is read-only and lives inside `GgufFile`. Model files are not expected to
        // be modified while open; if another process truncates one, reads fault (as with any mmap).
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(io_err)?;
        let header = Parser::new(path, &mmap).parse_header()?;
        let mmap = Arc::new(mmap);
        let tensor_index = header.tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(GgufFile {
            path: path.to_path_buf(),
            mmap,
            version: header.version,
            metadata: header.metadata,
            tensors: header.tensors,
            tensor_index,
            alignment: header.alignment,
            data_offset: header.data_offset,
        })
    }

    /// Validate a GGUF image held in memory exactly as [`GgufFile::open`] validates a file
    /// (`path` only names it in errors). Returns the tensor infos; the fuzz target's entry point.
    pub fn check_bytes(path: &Path, bytes: &[u8]) -> Result<Vec<GgufTensorInfo>, GgufError> {
        Ok(Parser::new(path, bytes).parse_header()?.tensors)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute file offset of the tensor data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Metadata pairs in file order.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Tensor infos in file order.
    pub fn tensor_infos(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    /// Zero-copy view of the named tensor's bytes inside the map.
    pub fn tensor(&self, name: &str) -> Option<TensorRef<'_>> {
        let info = &self.tensors[*self.tensor_index.get(name)?];
        let start = usize::try_from(self.data_offset.checked_add(info.offset)?).ok()?;
        let data = self.mmap.get(start..start.checked_add(info.n_bytes)?)?;
        Some(TensorRef { name: &info.name, dtype: info.dtype, shape: &info.shape, data })
    }
}

/// The parsed header of a GGUF file.
struct Header {
    version: u32,
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<GgufTensorInfo>,
    alignment: u64,
    data_offset: u64,
}

/// A bounds-checked cursor over the file bytes that knows what it is reading (for error messages).
struct Parser<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    pos: usize,
    /// What is being read now, e.g. "metadata key 12 'llama.block_count'".
    what: String,
}

impl<'a> Parser<'a> {
    fn new(path: &'a Path, bytes: &'a [u8]) -> Self {
        Parser { path, bytes, pos: 0, what: String::new() }
    }

    fn parse_header(mut self) -> Result<Header, GgufError> {
        let version = self.read_preamble()?;
        self.what = "tensor count".into();
        let n_tensors = self.read_u64()?;
        self.what = "metadata count".into();
        let n_kv = self.read_u64()?;
        self.what = "header".into();
        let metadata = self.read_metadata(n_kv)?;
        let alignment = alignment_from(self.path, &metadata)?;
        let tensors = self.read_tensor_infos(n_tensors)?;
        let data_offset = align_up(self.pos as u64, alignment).ok_or_else(|| self.too_large_err())?;
        for tensor in &tensors {
            self.check_tensor_placement(tensor, alignment, data_offset)?;
        }
        Ok(Header { version, metadata, tensors, alignment, data_offset })
    }

    fn read_preamble(&mut self) -> Result<u32, GgufError> {
        self.what = "magic".into();
        let found: [u8; 4] = self.read_fixed()?;
        if found != MAGIC {
            return Err(GgufError::BadMagic { path: self.path.to_path_buf(), found });
        }
        self.what = "version".into();
        let version = self.read_u32()?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion { path: self.path.to_path_buf(), version });
        }
        Ok(version)
    }

    fn read_metadata(&mut self, n_kv: u64) -> Result<Vec<(String, MetaValue)>, GgufError> {
        let n_kv = self.check_count(n_kv, MIN_KV_BYTES, "metadata pairs")?;
        let mut metadata = Vec::with_capacity(n_kv);
        let mut seen = HashSet::with_capacity(n_kv);
        for i in 0..n_kv {
            self.what = format!("metadata key {i}");
            let key = self.read_string()?;
            self.what = format!("metadata key {i} '{key}'");
            let value_type = self.read_value_type()?;
            let value = self.read_value(value_type, 0)?;
            if !seen.insert(key.clone()) {
                return Err(GgufError::DuplicateKey { path: self.path.to_path_buf(), key });
            }
            metadata.push((key, value));
        }
        Ok(metadata)
    }

    fn read_tensor_infos(&mut self, n_tensors: u64) -> Result<Vec<GgufTensorInfo>, GgufError> {
        self.what = "header".into();
        let n_tensors = self.check_count(n_tensors, MIN_TENSOR_INFO_BYTES, "tensor infos")?;
        let mut tensors = Vec::with_capacity(n_tensors);
        let mut seen = HashSet::with_capacity(n_tensors);
        for i in 0..n_tensors {
            self.what = format!("tensor info {i}");
            let name = self.read_string()?;
            self.what = format!("tensor info {i} '{name}'");
            let tensor = self.read_tensor_info(name)?;
            if !seen.insert(tensor.name.clone()) {
                return Err(GgufError::DuplicateTensor {
                    path: self.path.to_path_buf(),
                    tensor: tensor.name,
                });
            }
            tensors.push(tensor);
        }
        Ok(tensors)
    }

    /// Reads the rest of one tensor info after its name.
    fn read_tensor_info(&mut self, name: String) -> Result<GgufTensorInfo, GgufError> {
        let n_dims = self.read_u32()?;
        if n_dims as usize > MAX_DIMS {
            return Err(GgufError::TooManyDims {
                path: self.path.to_path_buf(),
                tensor: name,
                n_dims: n_dims.into(),
            });
        }
        let dims = (0..n_dims).map(|_| self.read_u64()).collect::<Result<Vec<u64>, _>>()?;
        let type_id = self.read_u32()?;
        let offset = self.read_u64()?;
        let Some(dtype) = DType::from_ggml_type_id(type_id) else {
            return Err(GgufError::UnknownTensorType {
                path: self.path.to_path_buf(),
                tensor: name,
                type_id,
            });
        };
        let shape = row_major_shape(&dims).ok_or_else(|| GgufError::TensorTooLarge {
            path: self.path.to_path_buf(),
            tensor: name.clone(),
            dims,
        })?;
        let n_bytes = tensor_n_bytes(self.path, &name, dtype, &shape)?;
        Ok(GgufTensorInfo { name, shape, dtype, offset, n_bytes })
    }

    fn check_tensor_placement(
        &self,
        tensor: &GgufTensorInfo,
        alignment: u64,
        data_offset: u64,
    ) -> Result<(), GgufError> {
        let path = self.path.to_path_buf();
        // `alignment` is a power of two; a mask keeps this MSRV-1.85 friendly (no `is_multiple_of`).
        if tensor.offset & (alignment - 1) != 0 {
            let (tensor, offset) = (tensor.name.clone(), tensor.offset);
            return Err(GgufError::MisalignedTensor { path, tensor, offset, alignment });
        }
        let n_bytes = tensor.n_bytes as u64;
        let file_len = self.bytes.len() as u64;
        let start = data_offset.checked_add(tensor.offset);
        let end = start.and_then(|s| s.checked_add(n_bytes));
        if end.is_none_or(|end| end > file_len) {
            let offset = start.unwrap_or(u64::MAX);
            return Err(GgufError::TensorPastEnd {
                path,
                tensor: tensor.name.clone(),
                offset,
                n_bytes,
                file_len,
            });
        }
        Ok(())
    }

    fn read_value_type(&mut self) -> Result<GgufValueType, GgufError> {
        let offset = self.pos as u64;
        let type_id = self.read_u32()?;
        GgufValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
            path: self.path.to_path_buf(),
            offset,
            type_id,
            what: self.what.clone(),
        })
    }

    fn read_value(&mut self, value_type: GgufValueType, depth: usize) -> Result<MetaValue, GgufError> {
        Ok(match value_type {
            GgufValueType::U8 => MetaValue::U8(u8::from_le_bytes(self.read_fixed()?)),
            GgufValueType::I8 => MetaValue::I8(i8::from_le_bytes(self.read_fixed()?)),
            GgufValueType::U16 => MetaValue::U16(u16::from_le_bytes(self.read_fixed()?)),
            GgufValueType::I16 => MetaValue::I16(i16::from_le_bytes(self.read_fixed()?)),
            GgufValueType::U32 => MetaValue::U32(self.read_u32()?),
            GgufValueType::I32 => MetaValue::I32(i32::from_le_bytes(self.read_fixed()?)),
            GgufValueType::U64 => MetaValue::U64(self.read_u64()?),
            GgufValueType::I64 => MetaValue::I64(i64::from_le_bytes(self.read_fixed()?)),
            GgufValueType::F32 => MetaValue::F32(f32::from_le_bytes(self.read_fixed()?)),
            GgufValueType::F64 => MetaValue::F64(f64::from_le_bytes(self.read_fixed()?)),
            GgufValueType::Bool => MetaValue::Bool(u8::from_le_bytes(self.read_fixed()?) != 0),
            GgufValueType::String => MetaValue::String(self.read_string()?),
            GgufValueType::Array => MetaValue::Array(self.read_array(depth + 1)?),
        })
    }

    fn read_array(&mut self, depth: usize) -> Result<MetaArray, GgufError> {
        if depth > MAX_ARRAY_DEPTH {
            let (path, offset, what) = (self.path.to_path_buf(), self.pos as u64, self.what.clone());
            return Err(GgufError::NestingTooDeep { path, offset, what });
        }
        let elem_type = self.read_value_type()?;
        let count = self.read_u64()?;
        let count = self.check_count(count, elem_type.min_encoded_bytes(), "array elements")?;
        let mut values = Vec::with_capacity(count);
        for _ in 0..count {
            values.push(self.read_value(elem_type, depth)?);
        }
        Ok(MetaArray { elem_type, values })
    }

    fn read_string(&mut self) -> Result<String, GgufError> {
        let n_bytes = self.read_u64()?;
        let offset = self.pos as u64;
        let bytes = self.take(n_bytes)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::InvalidUtf8 {
            path: self.path.to_path_buf(),
            offset,
            what: self.what.clone(),
        })
    }

    fn read_u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.read_fixed()?))
    }

    fn read_u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.read_fixed()?))
    }

    fn read_fixed<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64)?);
        Ok(out)
    }

    /// The next `n_bytes` bytes, or a `Truncated` error naming what was being read.
    fn take(&mut self, n_bytes: u64) -> Result<&'a [u8], GgufError> {
        let end = usize::try_from(n_bytes).ok().and_then(|n| self.pos.checked_add(n));
        match end.and_then(|end| self.bytes.get(self.pos..end)) {
            Some(slice) => {
                self.pos += slice.len();
                Ok(slice)
            }
            None => Err(GgufError::Truncated {
                path: self.path.to_path_buf(),
                offset: self.pos as u64,
                needed_bytes: n_bytes,
                file_len: self.bytes.len() as u64,
                what: self.what.clone(),
            }),
        }
    }

    fn remaining_bytes(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    /// Rejects a count whose items could not fit in the rest of the file even at their smallest.
    fn check_count(&self, count: u64, min_item_bytes: u64, items: &str) -> Result<usize, GgufError> {
        let remaining_bytes = self.remaining_bytes();
        let fits = count.checked_mul(min_item_bytes).is_some_and(|n| n <= remaining_bytes);
        match usize::try_from(count) {
            Ok(count) if fits => Ok(count),
            _ => Err(GgufError::AbsurdCount {
                path: self.path.to_path_buf(),
                offset: self.pos as u64,
                count,
                what: format!("{items} in {}", self.what),
                remaining_bytes,
            }),
        }
    }

    fn too_large_err(&self) -> GgufError {
        GgufError::Truncated {
            path: self.path.to_path_buf(),
            offset: self.pos as u64,
            needed_bytes: u64::MAX,
            file_len: self.bytes.len() as u64,
            what: "data section start".into(),
        }
    }
}

/// The alignment named by `general.alignment`, or the default.
fn alignment_from(path: &Path, metadata: &[(String, MetaValue)]) -> Result<u64, GgufError> {
    let Some((_, value)) = metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY) else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    match value {
        MetaValue::U32(v) if v.is_power_of_two() => Ok((*v).into()),
        other => Err(GgufError::BadAlignment { path: path.to_path_buf(), found: format!("{other:?}") }),
    }
}

/// GGUF `ne[]` (innermost first) to a row-major shape, if every dim and the product fit a `usize`.
fn row_major_shape(dims: &[u64]) -> Option<Vec<usize>> {
    let shape = dims.iter().rev().map(|&d| usize::try_from(d).ok()).collect::<Option<Vec<usize>>>()?;
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))?;
    Some(shape)
}

/// Byte size of a tensor; rows (the innermost dimension) must be whole blocks.
fn tensor_n_bytes(path: &Path, name: &str, dtype: DType, shape: &[usize]) -> Result<usize, GgufError> {
    let row_elems = shape.last().copied().unwrap_or(1);
    let block_elems = dtype.block_elems();
    if row_elems % block_elems != 0 {
        let (path, tensor, shape) = (path.to_path_buf(), name.to_string(), shape.to_vec());
        return Err(GgufError::NotWholeBlocks { path, tensor, dtype, shape, row_elems, block_elems });
    }
    let n_elems = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
    n_elems.and_then(|n| dtype.bytes_for(n)).ok_or_else(|| GgufError::TensorTooLarge {
        path: path.to_path_buf(),
        tensor: name.to_string(),
        dims: shape.iter().rev().map(|&d| d as u64).collect(),
    })
}

fn align_up(offset: u64, alignment: u64) -> Option<u64> {
    offset.checked_next_multiple_of(alignment)
}

/// A tensor announced to the writer; its bytes come from `fill` at write time.
#[derive(Debug, Clone)]
struct PendingTensor {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
}

impl PendingTensor {
    /// Byte size, or 0 for a shape the writer will reject (see `GgufWriter::validate`).
    fn n_bytes(&self) -> u64 {
        let n_elems = self.shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
        n_elems.and_then(|n| self.dtype.bytes_for(n)).map_or(0, |n| n as u64)
    }
}

/// Builds a GGUF v3 file: metadata and tensor shapes first, then tensor bytes streamed by `fill`.
#[derive(Debug, Clone)]
pub struct GgufWriter {
    alignment: u64,
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<PendingTensor>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// An empty writer with the default alignment of 32 bytes.
    pub fn new() -> Self {
        GgufWriter { alignment: DEFAULT_ALIGNMENT, metadata: Vec::new(), tensors: Vec::new() }
    }

    /// Sets the data alignment; when it is not 32, `general.alignment` (u32) is written too.
    ///
    /// # Panics
    /// If `alignment` is not a power of two that fits a `u32` (a programming error).
    pub fn set_alignment(&mut self, alignment: u64) {
        assert!(
            alignment.is_power_of_two() && u32::try_from(alignment).is_ok(),
            "GGUF alignment must be a power of two that fits a u32, got {alignment}"
        );
        self.alignment = alignment;
    }

    /// Adds a metadata pair; a key added again replaces the earlier value. `general.alignment` is
    /// ignored here: it is written from [`GgufWriter::set_alignment`].
    pub fn add_metadata(&mut self, key: impl Into<String>, value: MetaValue) {
        let key = key.into();
        match self.metadata.iter_mut().find(|(k, _)| *k == key) {
            Some((_, existing)) => *existing = value,
            None => self.metadata.push((key, value)),
        }
    }

    /// Announces a tensor with a row-major `shape`; its bytes are produced by `fill` in `write`.
    /// Invalid shapes (more than 4 dims, rows not whole blocks) and duplicate names make `write` fail.
    pub fn add_tensor(&mut self, name: impl Into<String>, dtype: DType, shape: &[usize]) {
        self.tensors.push(PendingTensor { name: name.into(), dtype, shape: shape.to_vec() });
    }

    /// Exact size in bytes of the file `write` produces.
    pub fn total_bytes(&self) -> u64 {
        let offsets = self.tensor_offsets();
        let data_n_bytes = offsets.last().map_or(0, |&last| last);
        self.data_offset() + data_n_bytes
    }

    /// Writes `<path>.tmp` (same directory) then renames it to `path`, so an interrupted run never
    /// leaves a file that looks whole. `fill(tensor_idx, out)` must write exactly that tensor's byte
    /// size (checked); the writer pads data to the alignment. `progress(bytes_written_so_far)` is
    /// called after the header and after every tensor.
    pub fn write(
        &self,
        path: &Path,
        fill: &mut dyn FnMut(usize, &mut dyn Write) -> std::io::Result<()>,
        progress: &mut dyn FnMut(u64),
    ) -> Result<(), GgufError> {
        self.validate(path)?;
        let tmp_path = no_file_name_check(path)
            .map(|_| tmp_path_of(path))
            .map_err(|source| GgufError::Io { path: path.to_path_buf(), source })?;
        let result = self.write_to(&tmp_path, fill, progress);
        let result = result.and_then(|()| {
            std::fs::rename(&tmp_path, path)
                .map_err(|source| GgufError::Io { path: path.to_path_buf(), source })
        });
        if result.is_err() {
            // Best effort: the original error is what matters.
            let _ = std::fs::remove_file(&tmp_path);
        }
        result
    }

    fn write_to(
        &self,
        tmp_path: &Path,
        fill: &mut dyn FnMut(usize, &mut dyn Write) -> std::io::Result<()>,
        progress: &mut dyn FnMut(u64),
    ) -> Result<(), GgufError> {
        let io_err = |source| GgufError::Io { path: tmp_path.to_path_buf(), source };
        let file = File::create(tmp_path).map_err(io_err)?;
        let mut out = BufWriter::with_capacity(WRITE_BUFFER_BYTES, file);
        let header = self.encode_header();
        out.write_all(&header).map_err(io_err)?;
        let mut n_written = header.len() as u64;
        n_written += write_padding(&mut out, n_written, self.alignment).map_err(io_err)?;
        progress(n_written);
        for (idx, tensor) in self.tensors.iter().enumerate() {
            n_written += self.write_tensor_data(tmp_path, &mut out, idx, tensor, fill)?;
            n_written += write_padding(&mut out, n_written, self.alignment).map_err(io_err)?;
            progress(n_written);
        }
        let file = out.into_inner().map_err(|e| io_err(e.into_error()))?;
        file.sync_all().map_err(io_err)
    }

    /// Streams one tensor's bytes from `fill` and checks their count; returns the bytes written.
    fn write_tensor_data(
        &self,
        tmp_path: &Path,
        out: &mut dyn Write,
        idx: usize,
        tensor: &PendingTensor,
        fill: &mut dyn FnMut(usize, &mut dyn Write) -> std::io::Result<()>,
    ) -> Result<u64, GgufError> {
        let mut counting = CountingWriter { inner: out, n_bytes: 0 };
        fill(idx, &mut counting).map_err(|source| GgufError::FillFailed {
            path: tmp_path.to_path_buf(),
            tensor: tensor.name.clone(),
            source,
        })?;
        let expected_bytes = tensor.n_bytes();
        if counting.n_bytes != expected_bytes {
            return Err(GgufError::FillSizeMismatch {
                path: tmp_path.to_path_buf(),
                tensor: tensor.name.clone(),
                expected_bytes,
                written_bytes: counting.n_bytes,
            });
        }
        Ok(counting.n_bytes)
    }

    /// Checks everything `write` relies on before any file is created.
    fn validate(&self, path: &Path) -> Result<(), GgufError> {
        let mut seen = HashSet::new();
        for tensor in &self.tensors {
            self.validate_tensor(path, tensor)?;
            if !seen.insert(tensor.name.as_str()) {
                return Err(GgufError::DuplicateTensor {
                    path: path.to_path_buf(),
                    tensor: tensor.name.clone(),
                });
            }
        }
        for (key, value) in &self.metadata {
            if let Err(reason) = check_array_types(value) {
                return Err(GgufError::InvalidMetadata {
                    path: path.to_path_buf(),
                    key: key.clone(),
                    reason,
                });
            }
        }
        Ok(())
    }

    fn validate_tensor(&self, path: &Path, tensor: &PendingTensor) -> Result<(), GgufError> {
        if tensor.shape.len() > MAX_DIMS {
            let (tensor, n_dims) = (tensor.name.clone(), tensor.shape.len() as u64);
            return Err(GgufError::TooManyDims { path: path.to_path_buf(), tensor, n_dims });
        }
        tensor_n_bytes(path, &tensor.name, tensor.dtype, &tensor.shape).map(|_| ())
    }

    /// Encodes the metadata pairs as written: the user's (minus any `general.alignment`), then the
    /// alignment if it is not the default.
    fn encode_metadata(&self, out: &mut Vec<u8>) {
        // set_alignment guarantees the value fits a u32.
        let alignment_value = MetaValue::U32(self.alignment as u32);
        let user = self.metadata.iter().filter(|(k, _)| k != ALIGNMENT_KEY).map(|(k, v)| (k.as_str(), v));
        let extra = (self.alignment != DEFAULT_ALIGNMENT).then_some((ALIGNMENT_KEY, &alignment_value));
        let pairs: Vec<(&str, &MetaValue)> = user.chain(extra).collect();
        out.extend_from_slice(&(pairs.len() as u64).to_le_bytes());
        for (key, value) in pairs {
            encode_string(out, key);
            out.extend_from_slice(&value.value_type().id().to_le_bytes());
            encode_value(out, value);
        }
    }

    /// Aligned end offset of every tensor's data, relative to the data section.
    fn tensor_offsets(&self) -> Vec<u64> {
        let mut end = 0u64;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for tensor in &self.tensors {
            end = (end + tensor.n_bytes()).next_multiple_of(self.alignment);
            offsets.push(end);
        }
        offsets
    }

    fn data_offset(&self) -> u64 {
        (self.encode_header().len() as u64).next_multiple_of(self.alignment)
    }

    fn encode_header(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&WRITE_VERSION.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        self.encode_metadata(&mut out);
        let mut start = 0u64;
        for (tensor, end) in self.tensors.iter().zip(self.tensor_offsets()) {
            encode_tensor_info(&mut out, tensor, start);
            start = end;
        }
        out
    }
}

fn encode_tensor_info(out: &mut Vec<u8>, tensor: &PendingTensor, offset: u64) {
    encode_string(out, &tensor.name);
    out.extend_from_slice(&(tensor.shape.len() as u32).to_le_bytes());
    for &dim in tensor.shape.iter().rev() {
        out.extend_from_slice(&(dim as u64).to_le_bytes());
    }
    out.extend_from_slice(&tensor.dtype.ggml_type_id().to_le_bytes());
    out.extend_from_slice(&offset.to_le_bytes());
}

fn encode_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn encode_value(out: &mut Vec<u8>, value: &MetaValue) {
    match value {
        MetaValue::U8(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::Bool(v) => out.push(u8::from(*v)),
        MetaValue::String(v) => encode_string(out, v),
        MetaValue::Array(array) => {
            out.extend_from_slice(&array.elem_type.id().to_le_bytes());
            out.extend_from_slice(&(array.values.len() as u64).to_le_bytes());
            array.values.iter().for_each(|v| encode_value(out, v));
        }
    }
}

/// Every array's elements must have the array's `elem_type` (checked recursively).
fn check_array_types(value: &MetaValue) -> Result<(), String> {
    let Some(array) = value.as_array() else { return Ok(()) };
    for elem in &array.values {
        if elem.value_type() != array.elem_type {
            return Err(format!("array of {:?} holds a {:?} element", array.elem_type, elem.value_type()));
        }
        check_array_types(elem)?;
    }
    Ok(())
}

/// Zero bytes up to the next multiple of `alignment`; returns how many were written.
fn write_padding(out: &mut dyn Write, n_written: u64, alignment: u64) -> std::io::Result<u64> {
    let n_padding = n_written.next_multiple_of(alignment) - n_written;
    let zeros = [0u8; 256];
    let mut left = n_padding;
    while left > 0 {
        let chunk = left.min(zeros.len() as u64) as usize;
        out.write_all(&zeros[..chunk])?;
        left -= chunk as u64;
    }
    Ok(n_padding)
}

/// A path without a file name (`/`, `..`) cannot be written.
fn no_file_name_check(path: &Path) -> std::io::Result<()> {
    match path.file_name() {
        Some(_) => Ok(()),
        None => Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "output path has no file name")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_file(
        writer: &GgufWriter,
        path: &Path,
        fill: &mut dyn FnMut(usize, &mut dyn Write) -> std::io::Result<()>,
    ) {
        writer.write(path, fill, &mut |_| {}).unwrap();
    }

    /// Byte `j` of tensor `idx` in the test pattern.
    fn pattern_byte(idx: usize, j: usize) -> u8 {
        (idx * 31 + j * 7) as u8
    }

    fn fill_pattern(sizes: Vec<usize>) -> impl FnMut(usize, &mut dyn Write) -> std::io::Result<()> {
        move |idx, out| out.write_all(&(0..sizes[idx]).map(|j| pattern_byte(idx, j)).collect::<Vec<u8>>())
    }

    fn every_value_type() -> Vec<(String, MetaValue)> {
        let nested = MetaValue::Array(MetaArray {
            elem_type: GgufValueType::Array,
            values: vec![
                MetaValue::i32_array(vec![1, -2, 3]),
                MetaValue::string_array(vec!["a".into(), "βγ".into()]),
                MetaValue::Array(MetaArray { elem_type: GgufValueType::U8, values: vec![] }),
            ],
        });
        vec![
            ("t.u8".into(), MetaValue::U8(200)),
            ("t.i8".into(), MetaValue::I8(-100)),
            ("t.u16".into(), MetaValue::U16(60_000)),
            ("t.i16".into(), MetaValue::I16(-30_000)),
            ("t.u32".into(), MetaValue::U32(4_000_000_000)),
            ("t.i32".into(), MetaValue::I32(-2_000_000_000)),
            ("t.u64".into(), MetaValue::U64(u64::MAX)),
            ("t.i64".into(), MetaValue::I64(i64::MIN)),
            ("t.f32".into(), MetaValue::F32(1.5)),
            ("t.f64".into(), MetaValue::F64(-2.25e300)),
            ("t.bool".into(), MetaValue::Bool(true)),
            ("t.false".into(), MetaValue::Bool(false)),
            ("t.string".into(), MetaValue::String("héllo".into())),
            ("t.empty_string".into(), MetaValue::String(String::new())),
            ("t.f32s".into(), MetaValue::f32_array(vec![0.5, -1.0])),
            ("t.nested".into(), nested),
        ]
    }

    #[test]
    fn metadata_round_trips_every_value_type() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta.gguf");
        let mut writer = GgufWriter::new();
        for (key, value) in every_value_type() {
            writer.add_metadata(key, value);
        }
        write_file(&writer, &path, &mut |_, _| Ok(()));
        let file = GgufFile::open(&path).unwrap();
        assert_eq!(file.version(), 3);
        assert_eq!(file.metadata(), every_value_type().as_slice());
        assert_eq!(file.get("t.u16"), Some(&MetaValue::U16(60_000)));
        assert_eq!(file.get("missing"), None);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), writer.total_bytes());
    }

    #[test]
    fn adding_a_key_again_replaces_its_value() {
        let mut writer = GgufWriter::new();
        writer.add_metadata("k", MetaValue::U32(1));
        writer.add_metadata("k", MetaValue::U32(2));
        assert_eq!(writer.metadata, vec![("k".to_string(), MetaValue::U32(2))]);
    }

    #[test]
    fn tensors_round_trip_every_dtype_with_block_sizes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tensors.gguf");
        let mut writer = GgufWriter::new();
        writer.add_metadata("general.name", MetaValue::String("t".into()));
        let mut sizes = Vec::new();
        for dtype in DType::ALL {
            let shape = [3, 2, 256];
            writer.add_tensor(format!("w.{dtype}"), dtype, &shape);
            sizes.push(6 * dtype.block_bytes() * (256 / dtype.block_elems()));
        }
        writer.add_tensor("scalar", DType::F32, &[]);
        sizes.push(4);
        write_file(&writer, &path, &mut fill_pattern(sizes.clone()));

        let file = GgufFile::open(&path).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), writer.total_bytes());
        assert_eq!(file.data_offset() % 32, 0);
        // DType::ALL's order: F32, F16, Q4_0, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, BF16, MXFP4.
        let expected_n_bytes = [
            6 * 1024,
            6 * 512,
            6 * 144,
            48 * 22,
            48 * 24,
            6 * 272,
            6 * 144,
            6 * 176,
            6 * 210,
            48 * 18,
            6 * 512,
            48 * 17,
        ];
        assert_eq!(expected_n_bytes.len(), DType::ALL.len());
        for (idx, info) in file.tensor_infos().iter().enumerate() {
            assert_eq!(info.n_bytes, sizes[idx]);
            assert_eq!(info.offset % 32, 0);
            let tensor = file.tensor(&info.name).unwrap();
            assert_eq!(tensor.dtype, info.dtype);
            assert!(tensor.data.iter().enumerate().all(|(j, &b)| b == pattern_byte(idx, j)));
        }
        for (dtype, n_bytes) in DType::ALL.into_iter().zip(expected_n_bytes) {
            let tensor = file.tensor(&format!("w.{dtype}")).unwrap();
            assert_eq!((tensor.dtype, tensor.shape, tensor.data.len()), (dtype, &[3, 2, 256][..], n_bytes));
        }
        assert_eq!(file.tensor("scalar").unwrap().shape, &[] as &[usize]);
        assert!(file.tensor("absent").is_none());
    }

    #[test]
    fn non_default_alignment_is_written_and_honoured() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("aligned.gguf");
        let mut writer = GgufWriter::new();
        writer.set_alignment(256);
        writer.add_metadata(ALIGNMENT_KEY, MetaValue::U32(8)); // ignored: set_alignment wins
        writer.add_tensor("a", DType::F16, &[3]);
        writer.add_tensor("b", DType::Q8_0, &[1, 32]);
        let mut progress_calls = Vec::new();
        writer.write(&path, &mut fill_pattern(vec![6, 34]), &mut |n| progress_calls.push(n)).unwrap();

        let file = GgufFile::open(&path).unwrap();
        assert_eq!(file.alignment(), 256);
        assert_eq!(file.get(ALIGNMENT_KEY), Some(&MetaValue::U32(256)));
        assert_eq!(file.data_offset() % 256, 0);
        let offsets: Vec<u64> = file.tensor_infos().iter().map(|t| t.offset).collect();
        assert_eq!(offsets, vec![0, 256]);
        assert_eq!(file.tensor("b").unwrap().data, (0..34).map(|j| pattern_byte(1, j)).collect::<Vec<_>>());
        assert_eq!(progress_calls.len(), 3);
        assert_eq!(progress_calls.last(), Some(&writer.total_bytes()));
        assert_eq!(std::fs::metadata(&path).unwrap().len(), writer.total_bytes());
    }

    #[test]
    fn default_alignment_writes_no_alignment_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plain.gguf");
        let writer = GgufWriter::new();
        write_file(&writer, &path, &mut |_, _| Ok(()));
        let file = GgufFile::open(&path).unwrap();
        assert!(file.metadata().is_empty() && file.tensor_infos().is_empty());
        assert_eq!(file.alignment(), 32);
        assert_eq!(file.data_offset(), 32);
    }

    /// A GGUF v2 file built by hand: one u32 key and one F32 tensor with `ne = [4, 2]`.
    fn hand_built_v2() -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes()); // tensors
        b.extend_from_slice(&1u64.to_le_bytes()); // kv pairs
        encode_string(&mut b, "llama.block_count");
        b.extend_from_slice(&GgufValueType::U32.id().to_le_bytes());
        b.extend_from_slice(&7u32.to_le_bytes());
        encode_string(&mut b, "w");
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&4u64.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        b.extend_from_slice(&DType::F32.ggml_type_id().to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        b.resize(b.len().next_multiple_of(32), 0);
        (0..8).for_each(|i| b.extend_from_slice(&(i as f32).to_le_bytes()));
        b
    }

    #[test]
    fn reads_hand_built_v2_file_and_reverses_dims() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v2.gguf");
        std::fs::write(&path, hand_built_v2()).unwrap();
        let file = GgufFile::open(&path).unwrap();
        assert_eq!(file.version(), 2);
        assert_eq!(file.path(), path.as_path());
        assert_eq!(file.get("llama.block_count").and_then(MetaValue::as_u64), Some(7));
        let tensor = file.tensor("w").unwrap();
        assert_eq!(tensor.shape, &[2, 4]);
        assert_eq!(tensor.to_f32_vec().unwrap(), (0..8).map(|i| i as f32).collect::<Vec<_>>());
    }

    #[test]
    fn accessors_convert_between_numeric_types() {
        assert_eq!(MetaValue::I8(-1).as_u64(), None);
        assert_eq!(MetaValue::I32(5).as_u64(), Some(5));
        assert_eq!(MetaValue::U64(u64::MAX).as_i64(), None);
        assert_eq!(MetaValue::U16(9).as_i64(), Some(9));
        assert_eq!(MetaValue::U32(3).as_f64(), Some(3.0));
        assert_eq!(MetaValue::F32(0.5).as_f64(), Some(0.5));
        assert_eq!(MetaValue::F32(0.5).as_u64(), None);
        assert_eq!(MetaValue::Bool(true).as_bool(), Some(true));
        assert_eq!(MetaValue::Bool(true).as_u64(), None);
        assert_eq!(MetaValue::String("x".into()).as_str(), Some("x"));
        let array = MetaValue::string_array(vec!["x".into()]);
        assert_eq!(array.as_array().map(|a| a.elem_type), Some(GgufValueType::String));
        assert_eq!(array.value_type(), GgufValueType::Array);
        assert_eq!(GgufValueType::from_id(12), Some(GgufValueType::F64));
        assert_eq!(GgufValueType::from_id(13), None);
    }

    #[test]
    fn writer_rejects_mistyped_array_before_creating_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.gguf");
        let mut writer = GgufWriter::new();
        let values = vec![MetaValue::U8(1)];
        writer.add_metadata("k", MetaValue::Array(MetaArray { elem_type: GgufValueType::I32, values }));
        let err = writer.write(&path, &mut |_, _| Ok(()), &mut |_| {}).unwrap_err();
        assert!(matches!(err, GgufError::InvalidMetadata { ref key, .. } if key == "k"), "{err}");
        assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none());
    }
}
