//! Loading a Hugging Face safetensors checkpoint into a [`WeightStore`].
//!
//! The loader knows nothing about architectures: the caller says which
//! tensors it expects and with which shapes ([`ExpectedTensor`]). Every
//! expected tensor is checked (present, shape, a float dtype) before anything
//! is allocated; stored tensors nobody expects are reported as warnings.
//! Then each tensor is converted to the dtype the [`WeightDType`] policy asks
//! for and uploaded, one owned allocation per tensor, all on the backend's
//! ledger. If anything fails, everything allocated so far is freed.

mod aside;
mod checkpoint;
mod convert;
mod gguf;
mod header;
mod quantize;

use std::borrow::Cow;
use std::collections::HashSet;
use std::path::{Path, PathBuf};

use metrale_core::quant::GgmlType;
use metrale_gpu_runtime::gpu::GpuBackend;

pub use aside::SetAside;
pub use checkpoint::{Checkpoint, INDEX_FILE, SINGLE_FILE, quantized};
pub use convert::{WeightDType, WeightFormat, convert, widen};
pub use gguf::{GgufExpected, GgufTransform, RowRun, device_dtype, load_gguf, load_gguf_with};
pub use header::{
    MAX_HEADER_BYTES, SafetensorsFile, StoredDType, TensorEntry, parse as parse_safetensors,
};
pub use quantize::quant_dtype;

use crate::error::WeightsError;
use crate::weights::{DeviceTensor, WeightStore};

/// A tensor the caller expects, with its shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpectedTensor {
    pub name: String,
    pub shape: Vec<usize>,
    /// Quantize it on load to this block format (its rows, the last
    /// dimension, a whole number of blocks), or hold it as the
    /// [`WeightDType`] policy says (`None`).
    pub quantize: Option<GgmlType>,
}

/// A tensor as the checkpoint stores it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredTensor {
    pub name: String,
    /// The safetensors dtype name (`F32`, `BF16`, ...).
    pub dtype: String,
    pub shape: Vec<usize>,
    pub bytes: usize,
    pub file: PathBuf,
}

/// What the loader reports while it works.
#[derive(Clone, Debug, PartialEq)]
pub enum LoadProgress {
    /// Checks passed; `tensors` tensors of `bytes` stored bytes will be uploaded.
    Start { tensors: usize, bytes: u64 },
    /// Tensor `index` (0-based) of `tensors` is on the device.
    Tensor {
        name: String,
        index: usize,
        tensors: usize,
        bytes_done: u64,
        bytes_total: u64,
    },
    /// Something the user should know that does not stop the load
    /// (a tensor in the checkpoint that the model does not use; the engine
    /// sends its config's warnings this way too).
    Warning(String),
    /// Something worth knowing that is not a problem (a part of the
    /// checkpoint set aside as expected, [`SetAside`]).
    Notice(String),
    /// Every tensor is on the device.
    Done { tensors: usize, bytes: u64 },
}

/// Every tensor stored in `dir`'s checkpoint (headers only; nothing is loaded).
pub fn scan_safetensors(dir: &Path) -> Result<Vec<StoredTensor>, WeightsError> {
    let checkpoint = Checkpoint::open(dir)?;
    let mut out: Vec<StoredTensor> = checkpoint
        .entries()
        .map(|(file, t)| StoredTensor {
            name: t.name.clone(),
            dtype: t.dtype.name().to_string(),
            shape: t.shape.clone(),
            bytes: t.end - t.start,
            file: file.path.clone(),
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Loads the `expected` tensors of the checkpoint in `dir` onto `gpu`.
///
/// `dir` holds `model.safetensors.index.json` and its shards, or a single
/// `model.safetensors`. Errors name the file and the tensor; on any error
/// nothing stays allocated.
pub fn load_safetensors(
    dir: &Path,
    expected: &[ExpectedTensor],
    gpu: &dyn GpuBackend,
    policy: WeightDType,
    progress: &mut dyn FnMut(LoadProgress),
) -> Result<WeightStore, WeightsError> {
    load_safetensors_with(dir, expected, &[], gpu, policy, progress)
}

/// [`load_safetensors`], with parts of the checkpoint that are not loaded
/// (`aside`): each reported once ([`SetAside`]), not tensor by tensor.
pub fn load_safetensors_with(
    dir: &Path,
    expected: &[ExpectedTensor],
    aside: &[SetAside],
    gpu: &dyn GpuBackend,
    policy: WeightDType,
    progress: &mut dyn FnMut(LoadProgress),
) -> Result<WeightStore, WeightsError> {
    let checkpoint = Checkpoint::open(dir)?;

    // Check everything before allocating anything.
    let mut seen = HashSet::new();
    let mut plan = Vec::with_capacity(expected.len());
    for e in expected {
        if !seen.insert(e.name.as_str()) {
            continue;
        }
        let Some((file, entry)) = checkpoint.find(&e.name) else {
            return Err(WeightsError::MissingTensor {
                path: checkpoint.source.clone(),
                tensor: e.name.clone(),
            });
        };
        let Some(dtype) = entry.dtype.weight_dtype() else {
            return Err(WeightsError::UnsupportedDType {
                path: file.path.clone(),
                tensor: e.name.clone(),
                dtype: entry.dtype.name().to_string(),
            });
        };
        if entry.shape != e.shape {
            return Err(WeightsError::WrongShape {
                path: file.path.clone(),
                tensor: e.name.clone(),
                expected: e.shape.clone(),
                found: entry.shape.clone(),
            });
        }
        let target = match e.quantize {
            Some(ty) => quant_dtype(ty, &e.name, &e.shape, gpu).map_err(|detail| {
                WeightsError::Quantize {
                    path: file.path.clone(),
                    tensor: e.name.clone(),
                    detail,
                }
            })?,
            None => policy.target(dtype),
        };
        plan.push((file, entry, dtype, target));
    }
    let stored: Vec<aside::Stored<'_>> = checkpoint
        .entries()
        .map(|(_, t)| aside::Stored {
            name: &t.name,
            shape: &t.shape,
            bytes: t.end - t.start,
        })
        .collect();
    let mut aside = aside::report(&checkpoint.source, &stored, &seen, aside);
    aside.send(progress);
    let mut extra: Vec<(&Path, &str)> = checkpoint
        .entries()
        .filter(|(_, t)| !seen.contains(t.name.as_str()) && !aside.names.contains(&t.name))
        .map(|(f, t)| (f.path.as_path(), t.name.as_str()))
        .collect();
    extra.sort();
    for (file, name) in extra {
        let message = format!(
            "{}: tensor {name:?} is not used by this model and is not loaded",
            file.display()
        );
        tracing::warn!("{message}");
        progress(LoadProgress::Warning(message));
    }

    let total_bytes: u64 = plan
        .iter()
        .map(|(_, t, _, _)| (t.end - t.start) as u64)
        .sum();
    progress(LoadProgress::Start {
        tensors: plan.len(),
        bytes: total_bytes,
    });
    let mut store = WeightStore::new();
    let mut done = 0u64;
    let mut buf = Vec::new();
    for (index, &(file, entry, stored, target)) in plan.iter().enumerate() {
        match upload(gpu, file, entry, stored, target, &mut buf) {
            Ok(tensor) => {
                store.insert(entry.name.clone(), tensor);
            }
            Err(e) => {
                discard(store, gpu);
                return Err(e);
            }
        }
        done += (entry.end - entry.start) as u64;
        progress(LoadProgress::Tensor {
            name: entry.name.clone(),
            index,
            tensors: plan.len(),
            bytes_done: done,
            bytes_total: total_bytes,
        });
    }
    progress(LoadProgress::Done {
        tensors: plan.len(),
        bytes: total_bytes,
    });
    Ok(store)
}

/// Bytes of a tensor read, converted and uploaded at a time: a load's peak
/// memory is the backend's copy of the weights plus this, however large a
/// tensor is.
const CHUNK_BYTES: usize = 16 << 20;

/// Reads `entry` from `file` chunk by chunk (through `buf`), converts it from
/// `stored` to `target` and uploads it into a new allocation; on failure
/// that allocation is freed again.
fn upload(
    gpu: &dyn GpuBackend,
    file: &SafetensorsFile,
    entry: &TensorEntry,
    stored: metrale_core::DType,
    target: metrale_core::DType,
    buf: &mut Vec<u8>,
) -> Result<DeviceTensor, WeightsError> {
    let device = |source| WeightsError::Device {
        name: entry.name.clone(),
        source,
    };
    let elements: usize = entry.shape.iter().product();
    let slice = gpu
        .alloc_slice(target, elements, &format!("weights: {}", entry.name))
        .map_err(device)?;
    let len = entry.end - entry.start;
    // A chunk is whole rows when the rows are quantized on the way.
    let row = match target {
        metrale_core::DType::Quant(_) => entry.shape.last().copied().unwrap_or(1).max(1),
        _ => 1,
    };
    let unit = row * stored.size_of();
    let step = (CHUNK_BYTES / unit).max(1) * unit;
    let filled = (|| {
        let (mut read, mut written) = (0, 0);
        while read < len {
            let n = step.min(len - read);
            buf.resize(n, 0);
            file.read(entry, read, buf)?;
            let chunk = match target {
                metrale_core::DType::Quant(q) => {
                    Cow::Owned(quantize::rows(buf, stored, q.ggml(), row))
                }
                _ => convert(buf, stored, target),
            };
            gpu.copy_h2d(&chunk, slice.ptr(), written).map_err(device)?;
            (read, written) = (read + n, written + chunk.len());
        }
        Ok(())
    })();
    if let Err(e) = filled {
        let _ = gpu.free(slice.ptr());
        return Err(e);
    }
    Ok(DeviceTensor {
        slice,
        shape: entry.shape.clone(),
    })
}

/// Frees every tensor of a partly built store (attempting all).
fn discard(store: WeightStore, gpu: &dyn GpuBackend) {
    for name in store.names() {
        if let Ok(t) = store.get(name)
            && let Err(e) = gpu.free(t.slice.ptr())
        {
            tracing::warn!("freeing {name} after a failed load: {e}");
        }
    }
}
