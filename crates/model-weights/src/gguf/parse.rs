//! Parsing and checking a GGUF image: everything is validated here, before a
//! [`super::GgufFile`] hands out a single value or tensor byte.
//!
//! The file may be hostile: every count is checked against the bytes left
//! before anything is allocated for it (a count of 2^60 strings in a 1 KiB
//! file is an error, not an allocation), nesting of arrays is bounded (no
//! stack overflow), strings must be UTF-8, and each tensor's byte range must
//! lie inside the file, be aligned and overlap no other.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use metrale_core::quant::GgmlType;

use super::value::{GgufArray, GgufValue, GgufValueType};
use crate::error::WeightsError;

/// `GGUF` as the first four bytes of the file.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// The alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: usize = 32;
/// The metadata key that sets the alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// ggml's `GGML_MAX_DIMS`: llama.cpp refuses tensors with more dimensions.
pub const MAX_DIMS: usize = 4;
/// How deep arrays of arrays may nest; GGUF sets no bound, a hostile file
/// could otherwise exhaust the stack.
pub const MAX_ARRAY_DEPTH: usize = 8;
/// The fewest bytes one tensor-info entry takes (name length, n_dims, type,
/// offset), which bounds the tensor count.
const MIN_TENSOR_INFO: usize = 8 + 4 + 4 + 8;
/// The fewest bytes one metadata entry takes (key length, type, a u8).
const MIN_KV: usize = 8 + 4 + 1;

/// One tensor of a GGUF file, checked against the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufTensorInfo {
    pub name: String,
    pub ggml_type: GgmlType,
    /// The dimensions as GGUF stores them, innermost first: `dims[0]` is
    /// the row length (ggml's `ne[0]`).
    pub dims: Vec<u64>,
    /// The same dimensions row-major, outermost first, as safetensors and
    /// PyTorch write them: a `[n_rows, row_len]` matrix for a 2-D tensor.
    /// A tensor with no dimensions has shape `[]` and one element.
    pub shape: Vec<usize>,
    /// Byte offset of the data from the start of the data section.
    pub offset: usize,
    /// Bytes of data.
    pub byte_len: usize,
}

impl GgufTensorInfo {
    /// Number of elements.
    pub fn elems(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A parsed and checked GGUF image.
#[derive(Debug)]
pub struct Parsed {
    pub version: u32,
    pub alignment: usize,
    /// Absolute offset of the data section (the end of the header, aligned).
    pub data_start: usize,
    pub metadata: Vec<(String, GgufValue)>,
    pub tensors: Vec<GgufTensorInfo>,
}

/// What is being read, for error messages.
#[derive(Clone, Copy)]
enum At<'s> {
    Header,
    /// The key of metadata entry #n (its name is not known yet).
    KeyNo(usize),
    Key(&'s str),
    /// The name of tensor-info entry #n.
    TensorNo(usize),
    Tensor(&'s str),
}

impl fmt::Display for At<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            At::Header => write!(f, "the header"),
            At::KeyNo(n) => write!(f, "the key of metadata entry #{n}"),
            At::Key(k) => write!(f, "metadata key {k:?}"),
            At::TensorNo(n) => write!(f, "the name of tensor #{n}"),
            At::Tensor(t) => write!(f, "tensor {t:?}"),
        }
    }
}

struct Reader<'a> {
    path: &'a Path,
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn left(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// The error for something wrong at `at`, as the variant that names it.
    fn err(&self, at: At<'_>, detail: String) -> WeightsError {
        let path = self.path.to_path_buf();
        match at {
            At::Header => WeightsError::GgufHeader { path, detail },
            At::KeyNo(n) => WeightsError::GgufMetadata {
                path,
                key: format!("#{n}"),
                detail,
            },
            At::Key(k) => WeightsError::GgufMetadata {
                path,
                key: k.to_string(),
                detail,
            },
            At::TensorNo(n) => WeightsError::GgufTensor {
                path,
                tensor: format!("#{n}"),
                detail,
            },
            At::Tensor(t) => WeightsError::GgufTensor {
                path,
                tensor: t.to_string(),
                detail,
            },
        }
    }

    fn take(&mut self, n: usize, at: At<'_>) -> Result<&'a [u8], WeightsError> {
        if n > self.left() {
            return Err(WeightsError::Truncated {
                path: self.path.to_path_buf(),
                detail: format!(
                    "{at} needs {n} bytes at offset {}, the file has {} bytes",
                    self.pos,
                    self.buf.len()
                ),
            });
        }
        let bytes = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self, at: At<'_>) -> Result<[u8; N], WeightsError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, at)?);
        Ok(out)
    }

    fn u32(&mut self, at: At<'_>) -> Result<u32, WeightsError> {
        Ok(u32::from_le_bytes(self.array(at)?))
    }

    fn u64(&mut self, at: At<'_>) -> Result<u64, WeightsError> {
        Ok(u64::from_le_bytes(self.array(at)?))
    }

    /// A length or count that must fit what is left of the file when each
    /// item takes at least `min_size` bytes.
    fn count(&mut self, min_size: usize, what: &str, at: At<'_>) -> Result<usize, WeightsError> {
        let n = self.u64(at)?;
        let fits = self.left() / min_size.max(1);
        match usize::try_from(n) {
            Ok(n) if n <= fits => Ok(n),
            _ => Err(self.err(
                at,
                format!(
                    "{what} count {n} cannot fit in the {} bytes left of the file",
                    self.left()
                ),
            )),
        }
    }

    fn string(&mut self, at: At<'_>) -> Result<String, WeightsError> {
        let len = self.count(1, "string byte", at)?;
        let bytes = self.take(len, at)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_string()),
            Err(e) => Err(self.err(at, format!("string is not valid UTF-8: {e}"))),
        }
    }

    fn value_type(&mut self, at: At<'_>) -> Result<GgufValueType, WeightsError> {
        let id = self.u32(at)?;
        GgufValueType::from_id(id)
            .ok_or_else(|| self.err(at, format!("unknown GGUF value type id {id}")))
    }

    fn value(&mut self, ty: GgufValueType, at: At<'_>) -> Result<GgufValue, WeightsError> {
        Ok(match ty {
            GgufValueType::U8 => GgufValue::U8(u8::from_le_bytes(self.array(at)?)),
            GgufValueType::I8 => GgufValue::I8(i8::from_le_bytes(self.array(at)?)),
            GgufValueType::U16 => GgufValue::U16(u16::from_le_bytes(self.array(at)?)),
            GgufValueType::I16 => GgufValue::I16(i16::from_le_bytes(self.array(at)?)),
            GgufValueType::U32 => GgufValue::U32(self.u32(at)?),
            GgufValueType::I32 => GgufValue::I32(i32::from_le_bytes(self.array(at)?)),
            GgufValueType::F32 => GgufValue::F32(f32::from_le_bytes(self.array(at)?)),
            GgufValueType::Bool => GgufValue::Bool(self.bool(at)?),
            GgufValueType::String => GgufValue::String(self.string(at)?),
            GgufValueType::Array => GgufValue::Array(self.array_value(at, 1)?),
            GgufValueType::U64 => GgufValue::U64(self.u64(at)?),
            GgufValueType::I64 => GgufValue::I64(i64::from_le_bytes(self.array(at)?)),
            GgufValueType::F64 => GgufValue::F64(f64::from_le_bytes(self.array(at)?)),
        })
    }

    fn bool(&mut self, at: At<'_>) -> Result<bool, WeightsError> {
        match self.array::<1>(at)?[0] {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(self.err(at, format!("bool byte is {b}, not 0 or 1"))),
        }
    }

    /// An array (element type, count, elements); `depth` is its nesting.
    fn array_value(&mut self, at: At<'_>, depth: usize) -> Result<GgufArray, WeightsError> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(self.err(
                at,
                format!("arrays nest deeper than {MAX_ARRAY_DEPTH} levels"),
            ));
        }
        let ty = self.value_type(at)?;
        let n = self.count(ty.min_size(), &format!("array of {ty}: element"), at)?;
        // Each element consumes at least one byte of the file, so growing
        // the vectors as elements are read bounds memory by the file size.
        macro_rules! fixed {
            ($variant:ident, $t:ty) => {{
                let bytes = self.take(n * std::mem::size_of::<$t>(), at)?;
                GgufArray::$variant(
                    bytes
                        .chunks_exact(std::mem::size_of::<$t>())
                        .map(|c| <$t>::from_le_bytes(c.try_into().unwrap_or_default()))
                        .collect(),
                )
            }};
        }
        Ok(match ty {
            GgufValueType::U8 => fixed!(U8, u8),
            GgufValueType::I8 => fixed!(I8, i8),
            GgufValueType::U16 => fixed!(U16, u16),
            GgufValueType::I16 => fixed!(I16, i16),
            GgufValueType::U32 => fixed!(U32, u32),
            GgufValueType::I32 => fixed!(I32, i32),
            GgufValueType::F32 => fixed!(F32, f32),
            GgufValueType::U64 => fixed!(U64, u64),
            GgufValueType::I64 => fixed!(I64, i64),
            GgufValueType::F64 => fixed!(F64, f64),
            GgufValueType::Bool => {
                let mut v = Vec::with_capacity(n.min(1 << 16));
                for _ in 0..n {
                    v.push(self.bool(at)?);
                }
                GgufArray::Bool(v)
            }
            GgufValueType::String => {
                let mut v = Vec::new();
                for _ in 0..n {
                    v.push(self.string(at)?);
                }
                GgufArray::String(v)
            }
            GgufValueType::Array => {
                let mut v = Vec::new();
                for _ in 0..n {
                    v.push(self.array_value(at, depth + 1)?);
                }
                GgufArray::Array(v)
            }
        })
    }
}

/// Rounds `n` up to a multiple of `align` (a power of two).
pub fn align_up(n: usize, align: usize) -> Option<usize> {
    Some(n.checked_add(align - 1)? & !(align - 1))
}

/// Parses and checks the GGUF image `buf` read from `path`.
pub fn parse(path: &Path, buf: &[u8]) -> Result<Parsed, WeightsError> {
    let mut r = Reader { path, buf, pos: 0 };
    let magic: [u8; 4] = r.array(At::Header)?;
    if magic != MAGIC {
        return Err(r.err(
            At::Header,
            format!("not a GGUF file: the first bytes are {magic:02x?}, not \"GGUF\""),
        ));
    }
    let version = r.u32(At::Header)?;
    match version {
        2 | 3 => {}
        1 => {
            return Err(r.err(
                At::Header,
                "GGUF version 1 is not supported (2 and 3 are): re-convert the model with a recent llama.cpp".into(),
            ));
        }
        v if matches!(v.swap_bytes(), 1..=3) => {
            return Err(r.err(
                At::Header,
                "the file is big-endian GGUF; only little-endian files are supported".into(),
            ));
        }
        v => {
            return Err(r.err(
                At::Header,
                format!("unsupported GGUF version {v} (2 and 3 are supported)"),
            ));
        }
    }
    let n_tensors = r.count(MIN_TENSOR_INFO, "tensor", At::Header)?;
    let n_kv = r.count(MIN_KV, "metadata entry", At::Header)?;

    // Counts are bounded by the file, whose tensor data may be gigabytes:
    // grow the tables as entries are read rather than reserving up front.
    let mut metadata = Vec::with_capacity(n_kv.min(1024));
    let mut keys: HashMap<String, usize> = HashMap::with_capacity(n_kv.min(1024));
    for i in 0..n_kv {
        let key = r.string(At::KeyNo(i))?;
        if key.is_empty() {
            return Err(r.err(At::KeyNo(i), "the key is empty".into()));
        }
        if let Some(first) = keys.get(&key) {
            return Err(r.err(
                At::Key(&key),
                format!("the key appears twice (metadata entries #{first} and #{i})"),
            ));
        }
        let ty = r.value_type(At::Key(&key))?;
        let value = r.value(ty, At::Key(&key))?;
        keys.insert(key.clone(), i);
        metadata.push((key, value));
    }

    let alignment = match keys.get(ALIGNMENT_KEY).map(|&i| &metadata[i].1) {
        None => DEFAULT_ALIGNMENT,
        Some(GgufValue::U32(a)) if a.is_power_of_two() => *a as usize,
        Some(v) => {
            return Err(r.err(
                At::Key(ALIGNMENT_KEY),
                format!("must be a u32 power of two, found {} {v:?}", v.type_name()),
            ));
        }
    };

    let mut tensors: Vec<GgufTensorInfo> = Vec::with_capacity(n_tensors.min(1024));
    let mut names: HashMap<String, usize> = HashMap::with_capacity(n_tensors.min(1024));
    for i in 0..n_tensors {
        let name = r.string(At::TensorNo(i))?;
        if name.is_empty() {
            return Err(r.err(At::TensorNo(i), "the name is empty".into()));
        }
        if let Some(first) = names.get(&name) {
            return Err(r.err(
                At::Tensor(&name),
                format!("the name appears twice (tensors #{first} and #{i})"),
            ));
        }
        let info = tensor_info(&mut r, name.clone())?;
        names.insert(name, i);
        tensors.push(info);
    }

    let data_start = align_up(r.pos, alignment)
        .ok_or_else(|| r.err(At::Header, "the data section offset overflows".into()))?;
    check_ranges(&r, data_start, alignment, &tensors)?;
    Ok(Parsed {
        version,
        alignment,
        data_start,
        metadata,
        tensors,
    })
}

/// Reads the rest of one tensor-info entry (after its name) and checks its
/// type and dimensions.
fn tensor_info(r: &mut Reader<'_>, name: String) -> Result<GgufTensorInfo, WeightsError> {
    let at = At::Tensor(&name);
    let n_dims = r.u32(at)? as usize;
    if n_dims > MAX_DIMS {
        return Err(r.err(
            at,
            format!("{n_dims} dimensions (at most {MAX_DIMS} are allowed)"),
        ));
    }
    let mut dims = Vec::with_capacity(n_dims);
    for _ in 0..n_dims {
        dims.push(r.u64(at)?);
    }
    let type_id = r.u32(at)?;
    let offset = r.u64(at)?;
    let ggml_type = GgmlType::from_id(type_id)
        .ok_or_else(|| r.err(at, format!("unknown ggml type id {type_id}")))?;
    // ggml counts elements in int64: every dimension and their product must fit.
    let mut elems: u64 = 1;
    for &d in &dims {
        elems = elems
            .checked_mul(d)
            .filter(|&e| e <= i64::MAX as u64)
            .ok_or_else(|| {
                r.err(
                    at,
                    format!("dimensions {dims:?} overflow the element count"),
                )
            })?;
    }
    let shape: Vec<usize> = dims.iter().rev().map(|&d| d as usize).collect();
    let row_len = shape.last().copied().unwrap_or(1);
    let too_big = || {
        r.err(
            at,
            format!("dimensions {dims:?} are too large for this machine"),
        )
    };
    let elems = usize::try_from(elems).map_err(|_| too_big())?;
    let rows = elems.checked_div(row_len).unwrap_or(0);
    let row_bytes = ggml_type.row_bytes(row_len).ok_or_else(|| {
        r.err(
            at,
            format!(
                "row length {row_len} is not a whole number of {ggml_type} blocks of {} elements",
                ggml_type.block_elems()
            ),
        )
    })?;
    let byte_len = rows.checked_mul(row_bytes).ok_or_else(too_big)?;
    let offset = usize::try_from(offset)
        .map_err(|_| r.err(at, format!("data offset {offset} is beyond the file")))?;
    Ok(GgufTensorInfo {
        name,
        ggml_type,
        dims,
        shape,
        offset,
        byte_len,
    })
}

/// Checks that every tensor's bytes are aligned, inside the file, and
/// overlap no other tensor's.
fn check_ranges(
    r: &Reader<'_>,
    data_start: usize,
    alignment: usize,
    tensors: &[GgufTensorInfo],
) -> Result<(), WeightsError> {
    let file_len = r.buf.len();
    for t in tensors {
        let at = At::Tensor(&t.name);
        if t.offset % alignment != 0 {
            return Err(r.err(
                at,
                format!(
                    "data offset {} is not a multiple of the alignment {alignment}",
                    t.offset
                ),
            ));
        }
        let end = data_start
            .checked_add(t.offset)
            .and_then(|s| s.checked_add(t.byte_len));
        if end.is_none_or(|end| end > file_len) {
            return Err(r.err(
                at,
                format!(
                    "its {} bytes at data offset {} (file offset {}) extend beyond the end of the file ({file_len} bytes)",
                    t.byte_len,
                    t.offset,
                    data_start as u128 + t.offset as u128
                ),
            ));
        }
    }
    let mut order: Vec<&GgufTensorInfo> = tensors.iter().filter(|t| t.byte_len > 0).collect();
    order.sort_by_key(|t| t.offset);
    for pair in order.windows(2) {
        if pair[0].offset + pair[0].byte_len > pair[1].offset {
            return Err(WeightsError::Overlap {
                path: r.path.to_path_buf(),
                first: pair[0].name.clone(),
                second: pair[1].name.clone(),
            });
        }
    }
    Ok(())
}
