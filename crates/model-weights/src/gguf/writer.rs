//! Writing GGUF v3 files that llama.cpp reads: the same layout gguf-py's
//! `GGUFWriter` produces (metadata, tensor infos with offsets padded to the
//! alignment, padding, then each tensor's bytes padded to the alignment).
//!
//! Everything is checked when the file is encoded, with errors naming the
//! tensor or key, so that a tool never writes a file the reader (or
//! llama.cpp, whose limits are stricter: names under 64 bytes, at most four
//! dimensions) would refuse.

use std::collections::HashSet;
use std::io::Write;
use std::path::Path;

use metrale_core::quant::GgmlType;

use super::parse::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS, align_up};
use super::value::{GgufArray, GgufValue};
use crate::error::WeightsError;

/// ggml's `GGML_MAX_NAME`: a tensor name and its NUL must fit 64 bytes.
pub const MAX_TENSOR_NAME: usize = 63;

struct PendingTensor {
    name: String,
    ggml_type: GgmlType,
    /// Row-major, as the reader's `shape`.
    shape: Vec<usize>,
    /// The bytes, or `None` for a tensor whose bytes are streamed later
    /// ([`GgufWriter::add_tensor_info`], [`GgufStream`]).
    data: Option<Vec<u8>>,
}

/// Builds a GGUF v3 file in memory.
#[derive(Default)]
pub struct GgufWriter {
    alignment: Option<usize>,
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<PendingTensor>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the data alignment (a power of two) and records it as
    /// `general.alignment`, as gguf-py does for a non-default alignment.
    pub fn set_alignment(&mut self, alignment: u32) -> &mut Self {
        self.alignment = Some(alignment as usize);
        self.add(ALIGNMENT_KEY, GgufValue::U32(alignment))
    }

    /// Adds metadata `key`, replacing an earlier value of the same key.
    pub fn add(&mut self, key: impl Into<String>, value: GgufValue) -> &mut Self {
        let key = key.into();
        match self.metadata.iter_mut().find(|(k, _)| *k == key) {
            Some(entry) => entry.1 = value,
            None => self.metadata.push((key, value)),
        }
        self
    }

    /// Adds a tensor of `ggml_type` with row-major `shape` (outermost
    /// first, as the reader reports it) and its bytes in ggml's layout.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        ggml_type: GgmlType,
        shape: &[usize],
        data: impl Into<Vec<u8>>,
    ) -> &mut Self {
        self.tensors.push(PendingTensor {
            name: name.into(),
            ggml_type,
            shape: shape.to_vec(),
            data: Some(data.into()),
        });
        self
    }

    /// Adds a tensor whose bytes are not held here: [`Self::stream`] writes
    /// the header from the shapes and types, then the caller hands each
    /// tensor's bytes to the [`GgufStream`] in order, so that a file larger
    /// than memory can be written one tensor at a time.
    pub fn add_tensor_info(
        &mut self,
        name: impl Into<String>,
        ggml_type: GgmlType,
        shape: &[usize],
    ) -> &mut Self {
        self.tensors.push(PendingTensor {
            name: name.into(),
            ggml_type,
            shape: shape.to_vec(),
            data: None,
        });
        self
    }

    /// Checks everything, creates `path` and writes the header; every
    /// tensor must have been added with [`Self::add_tensor_info`]. The
    /// returned stream takes their bytes in order. `path` (a temporary file
    /// under a guessable name, in the output's directory) must not exist:
    /// whatever is there, a link to another file above all, is refused
    /// ([`WeightsError::AlreadyExists`]) rather than followed or truncated.
    pub fn stream(&self, path: &Path) -> Result<GgufStream, WeightsError> {
        if let Some(t) = self.tensors.iter().find(|t| t.data.is_some()) {
            return Err(WeightsError::GgufWrite {
                path: path.to_path_buf(),
                item: t.name.clone(),
                detail: "a streamed file takes every tensor's bytes from the stream".into(),
            });
        }
        let (header, alignment) = self.header(path)?;
        let io = |source| WeightsError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut out = std::io::BufWriter::new(crate::open::create_new(path)?);
        out.write_all(&header).map_err(io)?;
        let pending = (self.tensors.iter())
            .map(|t| Ok((t.name.clone(), tensor_bytes(t)?)))
            .collect::<Result<Vec<_>, String>>()
            .map_err(|d| WeightsError::GgufWrite {
                path: path.to_path_buf(),
                item: String::new(),
                detail: d,
            })?;
        Ok(GgufStream {
            path: path.to_path_buf(),
            out,
            alignment,
            pending,
            next: 0,
        })
    }

    /// Checks everything, then writes the file to `path`, streaming the
    /// tensor data rather than assembling the file in memory.
    pub fn write(&self, path: &Path) -> Result<(), WeightsError> {
        let (header, alignment) = self.header(path)?;
        let io = |source| WeightsError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut out = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
        out.write_all(&header).map_err(io)?;
        self.write_data(&mut out, alignment).map_err(io)?;
        out.into_inner()
            .map_err(|e| io(e.into_error()))?
            .sync_all()
            .map_err(io)
    }

    /// The file's bytes; errors name the file as `<memory>`.
    pub fn to_bytes(&self) -> Result<Vec<u8>, WeightsError> {
        let (mut out, alignment) = self.header(Path::new("<memory>"))?;
        self.write_data(&mut out, alignment)
            .map_err(|source| WeightsError::Io {
                path: "<memory>".into(),
                source,
            })?;
        Ok(out)
    }

    /// The data section: each tensor's bytes padded to the alignment (the
    /// header ends aligned, so each tensor starts at its recorded offset).
    fn write_data(&self, out: &mut impl Write, alignment: usize) -> std::io::Result<()> {
        let zeros = vec![0u8; alignment];
        for t in &self.tensors {
            let data = t.data.as_deref().unwrap_or_default();
            out.write_all(data)?;
            let padded = data.len().div_ceil(alignment) * alignment;
            out.write_all(&zeros[..padded - data.len()])?;
        }
        Ok(())
    }

    /// Checks everything and encodes the header up to the data section
    /// (padded); returns it with the alignment.
    fn header(&self, path: &Path) -> Result<(Vec<u8>, usize), WeightsError> {
        let fail = |item: &str, detail: String| WeightsError::GgufWrite {
            path: path.to_path_buf(),
            item: item.to_string(),
            detail,
        };
        let alignment = self.alignment.unwrap_or(DEFAULT_ALIGNMENT);
        if !alignment.is_power_of_two() {
            return Err(fail(
                ALIGNMENT_KEY,
                format!("{alignment} is not a power of two"),
            ));
        }
        match self.metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
            Some((_, GgufValue::U32(a))) if *a as usize == alignment => {}
            Some((_, v)) => {
                return Err(fail(
                    ALIGNMENT_KEY,
                    format!("set it with set_alignment, not as {v:?}"),
                ));
            }
            None => {}
        }

        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            if key.is_empty() {
                return Err(fail(key, "the key is empty".into()));
            }
            write_string(&mut out, key);
            out.extend_from_slice(&value.value_type().id().to_le_bytes());
            write_value(&mut out, value).map_err(|d| fail(key, d))?;
        }

        let mut names = HashSet::new();
        let mut offset = 0usize;
        for t in &self.tensors {
            check_tensor(t).map_err(|d| fail(&t.name, d))?;
            if !names.insert(t.name.as_str()) {
                return Err(fail(&t.name, "two tensors have this name".into()));
            }
            write_string(&mut out, &t.name);
            out.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
            for &d in t.shape.iter().rev() {
                out.extend_from_slice(&(d as u64).to_le_bytes());
            }
            out.extend_from_slice(&t.ggml_type.id().to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            let bytes = tensor_bytes(t).map_err(|d| fail(&t.name, d))?;
            offset = align_up(offset + bytes, alignment)
                .ok_or_else(|| fail(&t.name, "the data section overflows".into()))?;
        }
        pad(&mut out, alignment);
        Ok((out, alignment))
    }
}

/// The byte count a tensor's shape and type need.
fn tensor_bytes(t: &PendingTensor) -> Result<usize, String> {
    let row_len = t.shape.last().copied().unwrap_or(1);
    let row_bytes = t.ggml_type.row_bytes(row_len).ok_or_else(|| {
        format!(
            "row length {row_len} is not a whole number of {} blocks of {} elements",
            t.ggml_type,
            t.ggml_type.block_elems()
        )
    })?;
    (t.shape.iter().rev().skip(1))
        .try_fold(row_bytes, |a, &d| a.checked_mul(d))
        .ok_or_else(|| format!("shape {:?} overflows", t.shape))
}

/// Checks a tensor's name, dimensions and byte count.
fn check_tensor(t: &PendingTensor) -> Result<(), String> {
    if t.name.len() > MAX_TENSOR_NAME {
        return Err(format!(
            "the name is {} bytes; llama.cpp allows at most {MAX_TENSOR_NAME}",
            t.name.len()
        ));
    }
    if t.shape.len() > MAX_DIMS {
        return Err(format!("{} dimensions (at most {MAX_DIMS})", t.shape.len()));
    }
    let bytes = tensor_bytes(t)?;
    if let Some(data) = &t.data
        && data.len() != bytes
    {
        return Err(format!(
            "shape {:?} of {} needs {bytes} bytes, {} were given",
            t.shape,
            t.ggml_type,
            data.len()
        ));
    }
    Ok(())
}

/// A GGUF file being written: the header is on disk, the tensors' bytes
/// follow in the order they were added ([`GgufWriter::stream`]).
pub struct GgufStream {
    path: std::path::PathBuf,
    out: std::io::BufWriter<std::fs::File>,
    alignment: usize,
    /// Each tensor's name and byte count, in file order.
    pending: Vec<(String, usize)>,
    next: usize,
}

impl GgufStream {
    /// Writes the next tensor's bytes; `name` must be the next tensor's and
    /// `data` exactly as long as its shape and type need.
    pub fn write_tensor(&mut self, name: &str, data: &[u8]) -> Result<(), WeightsError> {
        let fail = |detail: String| WeightsError::GgufWrite {
            path: self.path.clone(),
            item: name.to_string(),
            detail,
        };
        let Some((expected, bytes)) = self.pending.get(self.next) else {
            return Err(fail("every tensor has been written already".into()));
        };
        if expected != name {
            return Err(fail(format!("the next tensor is {expected:?}")));
        }
        if *bytes != data.len() {
            return Err(fail(format!(
                "needs {bytes} bytes, {} were given",
                data.len()
            )));
        }
        let padded = data.len().div_ceil(self.alignment) * self.alignment;
        let io = |source| WeightsError::Io {
            path: self.path.clone(),
            source,
        };
        self.out.write_all(data).map_err(io)?;
        self.out
            .write_all(&vec![0u8; padded - data.len()])
            .map_err(io)?;
        self.next += 1;
        Ok(())
    }

    /// Checks that every tensor was written, then flushes and syncs.
    pub fn finish(self) -> Result<(), WeightsError> {
        if let Some((name, _)) = self.pending.get(self.next) {
            return Err(WeightsError::GgufWrite {
                path: self.path.clone(),
                item: name.clone(),
                detail: "the file was finished before this tensor was written".into(),
            });
        }
        let path = self.path;
        let io = |source| WeightsError::Io {
            path: path.clone(),
            source,
        };
        self.out
            .into_inner()
            .map_err(|e| io(e.into_error()))?
            .sync_all()
            .map_err(io)
    }
}

fn pad(out: &mut Vec<u8>, alignment: usize) {
    let to = out.len().div_ceil(alignment) * alignment;
    out.resize(to, 0);
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn write_value(out: &mut Vec<u8>, value: &GgufValue) -> Result<(), String> {
    match value {
        GgufValue::U8(v) => out.push(*v),
        GgufValue::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::Bool(v) => out.push(u8::from(*v)),
        GgufValue::String(s) => write_string(out, s),
        GgufValue::Array(a) => write_array(out, a, 1)?,
        GgufValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
    }
    Ok(())
}

fn write_array(out: &mut Vec<u8>, a: &GgufArray, depth: usize) -> Result<(), String> {
    if depth > super::parse::MAX_ARRAY_DEPTH {
        return Err(format!(
            "arrays nest deeper than {} levels",
            super::parse::MAX_ARRAY_DEPTH
        ));
    }
    out.extend_from_slice(&a.elem_type().id().to_le_bytes());
    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! each {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        GgufArray::U8(v) => out.extend_from_slice(v),
        GgufArray::I8(v) => each!(v),
        GgufArray::U16(v) => each!(v),
        GgufArray::I16(v) => each!(v),
        GgufArray::U32(v) => each!(v),
        GgufArray::I32(v) => each!(v),
        GgufArray::F32(v) => each!(v),
        GgufArray::U64(v) => each!(v),
        GgufArray::I64(v) => each!(v),
        GgufArray::F64(v) => each!(v),
        GgufArray::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        GgufArray::String(v) => v.iter().for_each(|s| write_string(out, s)),
        GgufArray::Array(v) => {
            // Each inner array carries its own element type.
            for x in v {
                write_array(out, x, depth + 1)?;
            }
        }
    }
    Ok(())
}
