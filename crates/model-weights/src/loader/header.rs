//! One safetensors file: its header parsed and checked, its tensors read on
//! demand with positioned reads.
//!
//! Layout (<https://github.com/huggingface/safetensors>): an 8-byte
//! little-endian header length `N`, `N` bytes of JSON mapping each tensor
//! name to `{dtype, shape, data_offsets: [begin, end]}` (offsets relative to
//! the data section that follows the header), and an optional
//! `__metadata__` entry. The `safetensors` crate parses this too, but its
//! errors do not say which tensor is wrong, so the header is checked here:
//! every entry well formed, each tensor's byte range matching its shape,
//! inside the file, and overlapping no other.
//!
//! The file is read, not memory-mapped: a file that shrinks while it is
//! loaded (another process rewriting a checkpoint) must be an error naming
//! it, and through a map it would be a SIGBUS that kills the process.

use std::fs::File;
use std::path::{Path, PathBuf};

use metrale_core::DType;
use serde_json::Value;

use crate::error::WeightsError;

/// Headers larger than this are refused before parsing (the `safetensors`
/// crate uses the same bound).
pub const MAX_HEADER_BYTES: u64 = 100 * 1024 * 1024;

/// A tensor dtype as safetensors spells it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoredDType {
    Known {
        name: &'static str,
        size: usize,
    },
    /// A dtype this loader does not know; its size cannot be checked.
    Other(String),
}

const KNOWN: [(&str, usize); 16] = [
    ("F64", 8),
    ("F32", 4),
    ("F16", 2),
    ("BF16", 2),
    ("I64", 8),
    ("I32", 4),
    ("I16", 2),
    ("I8", 1),
    ("U64", 8),
    ("U32", 4),
    ("U16", 2),
    ("U8", 1),
    ("BOOL", 1),
    ("F8_E4M3", 1),
    ("F8_E5M2", 1),
    ("F8_E8M0", 1),
];

impl StoredDType {
    pub fn parse(s: &str) -> Self {
        KNOWN.iter().find(|(n, _)| *n == s).map_or_else(
            || StoredDType::Other(s.to_string()),
            |&(name, size)| StoredDType::Known { name, size },
        )
    }

    pub fn name(&self) -> &str {
        match self {
            StoredDType::Known { name, .. } => name,
            StoredDType::Other(s) => s,
        }
    }

    pub fn size(&self) -> Option<usize> {
        match self {
            StoredDType::Known { size, .. } => Some(*size),
            StoredDType::Other(_) => None,
        }
    }

    /// The weight dtype this is, if weights may be loaded from it.
    pub fn weight_dtype(&self) -> Option<DType> {
        match self.name() {
            "F32" => Some(DType::F32),
            "BF16" => Some(DType::BF16),
            "F16" => Some(DType::F16),
            _ => None,
        }
    }
}

/// One tensor's header entry; `start..end` is relative to the data section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: StoredDType,
    pub shape: Vec<usize>,
    pub start: usize,
    pub end: usize,
}

/// A safetensors file with a checked header.
pub struct SafetensorsFile {
    pub path: PathBuf,
    file: File,
    data_start: usize,
    pub tensors: Vec<TensorEntry>,
}

impl SafetensorsFile {
    /// Opens `path` and reads and checks its header.
    pub fn open(path: &Path) -> Result<Self, WeightsError> {
        let io = |source| WeightsError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = crate::open_regular(path)?;
        let len = file.metadata().map_err(io)?.len();
        let mut prefix = vec![0u8; len.min(8) as usize];
        read_at(&file, &mut prefix, 0).map_err(io)?;
        if let Some(field) = prefix.get(..8) {
            let header_len = u64::from_le_bytes(field.try_into().unwrap_or([0; 8]));
            if header_len <= (len - 8).min(MAX_HEADER_BYTES) {
                prefix.resize(8 + header_len as usize, 0);
                read_at(&file, &mut prefix[8..], 8).map_err(io)?;
            }
        }
        let (data_start, tensors) = parse_prefix(path, &prefix, len)?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
            data_start,
            tensors,
        })
    }

    /// Reads `buf.len()` bytes of `entry`'s data (an entry of this file),
    /// starting `offset` bytes into it. A file that has become shorter than
    /// its header said is an error naming the file and the tensor.
    pub fn read(
        &self,
        entry: &TensorEntry,
        offset: usize,
        buf: &mut [u8],
    ) -> Result<(), WeightsError> {
        let at = self.data_start + entry.start + offset;
        read_at(&self.file, buf, at as u64).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                WeightsError::Truncated {
                    path: self.path.clone(),
                    detail: format!(
                        "the file ends before the bytes of tensor {:?} (it changed while loading)",
                        entry.name
                    ),
                }
            } else {
                WeightsError::Io {
                    path: self.path.clone(),
                    source: e,
                }
            }
        })
    }
}

/// Fills `buf` from `file` at `offset`; a short file is `UnexpectedEof`.
fn read_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
    }
    #[cfg(windows)]
    {
        use std::os::windows::fs::FileExt;
        let mut done = 0;
        while done < buf.len() {
            match file.seek_read(&mut buf[done..], offset + done as u64)? {
                0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                n => done += n,
            }
        }
        Ok(())
    }
}

/// Parses and checks a whole file image; returns where the data section
/// starts and the tensor entries.
pub fn parse(path: &Path, file: &[u8]) -> Result<(usize, Vec<TensorEntry>), WeightsError> {
    parse_prefix(path, file, file.len() as u64)
}

/// Parses and checks the header of a file of `file_len` bytes from the
/// file's first bytes (`prefix`: at least the length field and the header).
fn parse_prefix(
    path: &Path,
    prefix: &[u8],
    file_len: u64,
) -> Result<(usize, Vec<TensorEntry>), WeightsError> {
    let path_buf = || path.to_path_buf();
    let Some(len_bytes) = prefix.get(..8) else {
        return Err(WeightsError::Truncated {
            path: path_buf(),
            detail: format!("{file_len} bytes, shorter than the 8-byte header length field"),
        });
    };
    let mut raw = [0u8; 8];
    raw.copy_from_slice(len_bytes);
    let header_len = u64::from_le_bytes(raw);
    let available = file_len.saturating_sub(8);
    if header_len > available || header_len > MAX_HEADER_BYTES {
        return Err(WeightsError::HeaderTooLarge {
            path: path_buf(),
            header_len,
            available: available.min(MAX_HEADER_BYTES),
        });
    }
    let data_start = 8 + header_len as usize;
    let Some(header) = prefix.get(8..data_start) else {
        return Err(WeightsError::Truncated {
            path: path_buf(),
            detail: "the header could not be read whole".to_string(),
        });
    };
    let data_len = usize::try_from(file_len).unwrap_or(usize::MAX) - data_start;
    let invalid = |detail: String| WeightsError::InvalidHeader {
        path: path_buf(),
        detail,
    };

    let text = std::str::from_utf8(header).map_err(|e| invalid(format!("not UTF-8: {e}")))?;
    let json: Value =
        serde_json::from_str(text).map_err(|e| invalid(format!("not valid JSON: {e}")))?;
    let Value::Object(map) = json else {
        return Err(invalid("the header is not a JSON object".to_string()));
    };

    let mut tensors = Vec::with_capacity(map.len());
    for (name, value) in &map {
        if name == "__metadata__" {
            continue;
        }
        tensors.push(entry(name, value).map_err(|d| invalid(format!("tensor {name:?}: {d}")))?);
    }

    for t in &tensors {
        if t.start > t.end {
            return Err(out_of_range(
                path,
                t,
                format!("begin {} is after end {}", t.start, t.end),
            ));
        }
        if let Some(size) = t.dtype.size() {
            let needed = t.shape.iter().try_fold(size, |acc, &d| acc.checked_mul(d));
            if needed != Some(t.end - t.start) {
                let needed =
                    needed.map_or_else(|| "more than usize::MAX".to_string(), |n| n.to_string());
                return Err(out_of_range(
                    path,
                    t,
                    format!(
                        "[{}, {}] spans {} bytes, but shape {:?} of {} needs {needed}",
                        t.start,
                        t.end,
                        t.end - t.start,
                        t.shape,
                        t.dtype.name()
                    ),
                ));
            }
        }
    }

    let mut order: Vec<&TensorEntry> = tensors.iter().collect();
    order.sort_by_key(|t| (t.start, t.end));
    let mut furthest: Option<&TensorEntry> = None;
    for t in order.iter().copied().filter(|t| t.end > t.start) {
        if let Some(prev) = furthest
            && t.start < prev.end
        {
            return Err(WeightsError::Overlap {
                path: path_buf(),
                first: prev.name.clone(),
                second: t.name.clone(),
            });
        }
        if furthest.is_none_or(|p| t.end > p.end) {
            furthest = Some(t);
        }
    }

    let extent = order.iter().map(|t| t.end).max().unwrap_or(0);
    if extent > data_len {
        // A header whose tensors tile the data section without gaps, in a
        // file that simply ends too early, is a truncated file; anything
        // else is a tensor whose offsets point past the end.
        let mut cursor = 0;
        let contiguous = order.iter().all(|t| {
            let ok = t.start == cursor;
            cursor = t.end;
            ok
        });
        if contiguous {
            return Err(WeightsError::Truncated {
                path: path_buf(),
                detail: format!(
                    "the header describes {extent} bytes of tensor data, the file holds {data_len}"
                ),
            });
        }
        if let Some(t) = order.iter().find(|t| t.end > data_len) {
            return Err(out_of_range(
                path,
                t,
                format!(
                    "[{}, {}] ends beyond the {data_len} bytes of data in the file",
                    t.start, t.end
                ),
            ));
        }
    }
    Ok((data_start, tensors))
}

fn out_of_range(path: &Path, t: &TensorEntry, detail: String) -> WeightsError {
    WeightsError::OffsetsOutOfRange {
        path: path.to_path_buf(),
        tensor: t.name.clone(),
        detail,
    }
}

/// One header entry, or what is wrong with it.
fn entry(name: &str, value: &Value) -> Result<TensorEntry, String> {
    let Value::Object(fields) = value else {
        return Err("entry is not a JSON object".to_string());
    };
    let dtype = match fields.get("dtype") {
        Some(Value::String(s)) => StoredDType::parse(s),
        Some(_) => return Err("`dtype` is not a string".to_string()),
        None => return Err("`dtype` is missing".to_string()),
    };
    let shape = match fields.get("shape") {
        Some(Value::Array(dims)) => dims
            .iter()
            .map(as_usize)
            .collect::<Option<Vec<_>>>()
            .ok_or("`shape` is not a list of non-negative integers")?,
        Some(_) => return Err("`shape` is not a list".to_string()),
        None => return Err("`shape` is missing".to_string()),
    };
    let (start, end) = match fields.get("data_offsets") {
        Some(Value::Array(o)) if o.len() == 2 => match (as_usize(&o[0]), as_usize(&o[1])) {
            (Some(s), Some(e)) => (s, e),
            _ => return Err("`data_offsets` are not non-negative integers".to_string()),
        },
        Some(_) => return Err("`data_offsets` is not a list of two integers".to_string()),
        None => return Err("`data_offsets` is missing".to_string()),
    };
    Ok(TensorEntry {
        name: name.to_string(),
        dtype,
        shape,
        start,
        end,
    })
}

fn as_usize(v: &Value) -> Option<usize> {
    v.as_u64().and_then(|n| usize::try_from(n).ok())
}
