//! GGUF files (llama.cpp's checkpoint format): a checked, memory-mapped
//! reader, a writer, and the tokenizer their metadata describes.
//!
//! Layout (ggml's `docs/gguf.md`), all little-endian: the magic `GGUF`, a
//! u32 version (2 or 3; version 1 used 32-bit counts and is not read), u64
//! tensor and metadata counts, the metadata entries (a string key, a u32
//! value type, the value), the tensor infos (a string name, a u32 dimension
//! count, u64 dimensions innermost first, a u32 ggml type, a u64 offset into
//! the data section), padding to `general.alignment` (default 32), then the
//! data section. Strings are a u64 length and UTF-8 bytes.
//!
//! **Shapes.** GGUF stores dimensions innermost first (ggml's `ne[0]` is
//! the row length); [`GgufTensorInfo::shape`] reverses them into the
//! row-major order safetensors uses, so a Hugging Face `[out, in]` weight
//! has shape `[out, in]` whichever file it came from.
//! [`GgufTensorInfo::dims`] keeps GGUF's order.
//!
//! **Mapping.** [`GgufFile::open`] maps the file and the tensor views borrow
//! the map, so quantized weights reach the device without a copy through
//! host memory. The cost: if another process truncates the file while it is
//! mapped, touching the lost pages is a SIGBUS, not an error (the
//! safetensors loader reads instead of mapping for this reason). Model files
//! are not rewritten in place in practice; [`GgufFile::from_bytes`] is there
//! for callers that prefer to read.

pub mod mix;
mod parse;
mod tokenizer;
mod value;
mod writer;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use metrale_core::quant::GgmlType;

use crate::error::WeightsError;
pub use parse::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GgufTensorInfo, MAX_DIMS};
pub use tokenizer::{GgufSpecialTokens, chat_template, special_tokens, tokenizer_json};
pub use value::{GgufArray, GgufValue, GgufValueType};
pub use writer::{GgufStream, GgufWriter};

/// Files smaller than this are read rather than mapped (and an empty file
/// cannot be mapped at all).
const MAP_THRESHOLD: u64 = 64 * 1024;

enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// One tensor's data: a view into the file.
#[derive(Clone, Copy, Debug)]
pub struct GgufTensor<'a> {
    pub info: &'a GgufTensorInfo,
    /// The tensor's bytes, `info.byte_len` of them, in ggml's layout for
    /// `info.ggml_type` (rows of blocks).
    pub data: &'a [u8],
}

impl<'a> GgufTensor<'a> {
    pub fn name(&self) -> &'a str {
        &self.info.name
    }

    pub fn ggml_type(&self) -> GgmlType {
        self.info.ggml_type
    }

    /// Row-major shape (outermost first); see the module docs.
    pub fn shape(&self) -> &'a [usize] {
        &self.info.shape
    }
}

/// A GGUF file whose header, metadata and tensor table have been checked.
pub struct GgufFile {
    path: PathBuf,
    bytes: Bytes,
    version: u32,
    alignment: usize,
    data_start: usize,
    metadata: Vec<(String, GgufValue)>,
    keys: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    names: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps `path` and checks it; anything but a regular file (a FIFO, a
    /// device, a directory) is refused before it is opened.
    pub fn open(path: &Path) -> Result<Self, WeightsError> {
        let io = |source| WeightsError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut file = crate::open_regular(path)?;
        let len = file.metadata().map_err(io)?.len();
        let bytes = if len < MAP_THRESHOLD {
            // Read through the checked handle, not the path again.
            let mut bytes = Vec::with_capacity(len as usize);
            std::io::Read::read_to_end(&mut file, &mut bytes).map_err(io)?;
            Bytes::Owned(bytes)
        } else {
            // SAFETY: the map is read-only and lives as long as `self`; the
            // one hazard, another process truncating the file while it is
            // mapped, is documented in the module docs.
            Bytes::Mapped(unsafe { memmap2::Mmap::map(&file) }.map_err(io)?)
        };
        Self::new(path.to_path_buf(), bytes)
    }

    /// Checks a GGUF image already in memory; `path` names it in errors.
    pub fn from_bytes(path: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<Self, WeightsError> {
        Self::new(path.into(), Bytes::Owned(bytes))
    }

    fn new(path: PathBuf, bytes: Bytes) -> Result<Self, WeightsError> {
        let parsed = parse::parse(&path, bytes.as_slice())?;
        let keys = (parsed.metadata.iter().enumerate())
            .map(|(i, (k, _))| (k.clone(), i))
            .collect();
        let names = (parsed.tensors.iter().enumerate())
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(Self {
            path,
            bytes,
            version: parsed.version,
            alignment: parsed.alignment,
            data_start: parsed.data_start,
            metadata: parsed.metadata,
            keys,
            tensors: parsed.tensors,
            names,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The alignment of tensor data (`general.alignment`, default 32).
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// The file offset where the data section starts.
    pub fn data_start(&self) -> usize {
        self.data_start
    }

    /// Every metadata entry, in file order.
    pub fn metadata(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.keys.get(key).map(|&i| &self.metadata[i].1)
    }

    /// The value of `key`, or an error naming the file and the key.
    pub fn value(&self, key: &str) -> Result<&GgufValue, WeightsError> {
        self.get(key).ok_or_else(|| WeightsError::GgufMissingKey {
            path: self.path.clone(),
            key: key.to_string(),
        })
    }

    fn wrong_type(&self, key: &str, expected: &str, found: &GgufValue) -> WeightsError {
        WeightsError::GgufWrongType {
            path: self.path.clone(),
            key: key.to_string(),
            expected: expected.to_string(),
            found: found.type_name(),
        }
    }

    /// An integer of any width that fits in a u32 (writers disagree on
    /// widths: gguf-py writes u32, other tools u64 or i32).
    pub fn get_u32(&self, key: &str) -> Result<u32, WeightsError> {
        let v = self.value(key)?;
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| self.wrong_type(key, "an integer in u32 range", v))
    }

    /// A non-negative integer of any width.
    pub fn get_u64(&self, key: &str) -> Result<u64, WeightsError> {
        let v = self.value(key)?;
        v.as_u64()
            .ok_or_else(|| self.wrong_type(key, "a non-negative integer", v))
    }

    /// A float (f32 or f64; f64 is rounded) — integers are refused, since
    /// a float key holding one is more likely a misnamed key.
    pub fn get_f32(&self, key: &str) -> Result<f32, WeightsError> {
        match self.value(key)? {
            GgufValue::F32(f) => Ok(*f),
            GgufValue::F64(f) => Ok(*f as f32),
            v => Err(self.wrong_type(key, "f32", v)),
        }
    }

    pub fn get_bool(&self, key: &str) -> Result<bool, WeightsError> {
        match self.value(key)? {
            GgufValue::Bool(b) => Ok(*b),
            v => Err(self.wrong_type(key, "bool", v)),
        }
    }

    pub fn get_str(&self, key: &str) -> Result<&str, WeightsError> {
        match self.value(key)? {
            GgufValue::String(s) => Ok(s),
            v => Err(self.wrong_type(key, "string", v)),
        }
    }

    pub fn get_array(&self, key: &str) -> Result<&GgufArray, WeightsError> {
        match self.value(key)? {
            GgufValue::Array(a) => Ok(a),
            v => Err(self.wrong_type(key, "array", v)),
        }
    }

    pub fn get_str_array(&self, key: &str) -> Result<&[String], WeightsError> {
        match self.value(key)? {
            GgufValue::Array(GgufArray::String(v)) => Ok(v),
            GgufValue::Array(a) if a.is_empty() => Ok(&[]),
            v => Err(self.wrong_type(key, "array of string", v)),
        }
    }

    pub fn get_f32_array(&self, key: &str) -> Result<&[f32], WeightsError> {
        match self.value(key)? {
            GgufValue::Array(GgufArray::F32(v)) => Ok(v),
            GgufValue::Array(a) if a.is_empty() => Ok(&[]),
            v => Err(self.wrong_type(key, "array of f32", v)),
        }
    }

    pub fn get_i32_array(&self, key: &str) -> Result<&[i32], WeightsError> {
        match self.value(key)? {
            GgufValue::Array(GgufArray::I32(v)) => Ok(v),
            GgufValue::Array(a) if a.is_empty() => Ok(&[]),
            v => Err(self.wrong_type(key, "array of i32", v)),
        }
    }

    /// Like [`Self::get_u32`], `None` when the key is absent.
    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>, WeightsError> {
        self.get(key).map(|_| self.get_u32(key)).transpose()
    }

    /// Like [`Self::get_bool`], `None` when the key is absent.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, WeightsError> {
        self.get(key).map(|_| self.get_bool(key)).transpose()
    }

    /// Like [`Self::get_str`], `None` when the key is absent.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>, WeightsError> {
        self.get(key).map(|_| self.get_str(key)).transpose()
    }

    /// `general.architecture` (`llama`, `qwen2`, ...), which prefixes the
    /// model's hyper-parameter keys (`llama.context_length`).
    pub fn architecture(&self) -> Result<&str, WeightsError> {
        self.get_str("general.architecture")
    }

    /// Every tensor's info, in file order.
    pub fn tensor_infos(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    /// Every tensor with its data, in file order.
    pub fn tensors(&self) -> impl Iterator<Item = GgufTensor<'_>> {
        self.tensors.iter().map(|info| self.view(info))
    }

    /// The tensor `name`, if the file has it.
    pub fn get_tensor(&self, name: &str) -> Option<GgufTensor<'_>> {
        self.names.get(name).map(|&i| self.view(&self.tensors[i]))
    }

    /// The tensor `name`, or an error naming the file and the tensor.
    pub fn tensor(&self, name: &str) -> Result<GgufTensor<'_>, WeightsError> {
        self.get_tensor(name)
            .ok_or_else(|| WeightsError::MissingTensor {
                path: self.path.clone(),
                tensor: name.to_string(),
            })
    }

    /// Lets the OS take back this process's pages of `t`'s data where the
    /// file is mapped; the loader calls it once `t` is on the device. A
    /// mapped file's pages count toward the process's resident memory, so
    /// without it a load held the whole file beside its copies (a peak RSS
    /// of twice the weights). Reading `t` again maps them back in. Best
    /// effort: the OS's refusal changes nothing but the memory.
    pub fn release(&self, t: &GgufTensor<'_>) {
        #[cfg(unix)]
        if let Bytes::Mapped(m) = &self.bytes {
            let Some(offset) = (t.data.as_ptr() as usize).checked_sub(m.as_ptr() as usize) else {
                return;
            };
            if offset
                .checked_add(t.data.len())
                .is_none_or(|end| end > m.len())
            {
                return;
            }
            // SAFETY: the map is shared and read-only, so MADV_DONTNEED
            // drops only this process's view of the file's pages, and the
            // next read maps the same (unchanged) bytes back: every live
            // borrow of the map keeps reading what it read before.
            let _ = unsafe {
                m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, t.data.len())
            };
        }
        #[cfg(not(unix))]
        let _ = t;
    }

    fn view<'a>(&'a self, info: &'a GgufTensorInfo) -> GgufTensor<'a> {
        let start = self.data_start + info.offset;
        // Parsing checked the range against the file; `get` keeps even a
        // broken invariant from panicking.
        let data = (self.bytes.as_slice())
            .get(start..start + info.byte_len)
            .unwrap_or_default();
        GgufTensor { info, data }
    }
}

#[cfg(test)]
mod tests;
