//! Loading the tensors of a GGUF file into a [`WeightStore`], under the
//! names and layouts of the Hugging Face checkpoint it was converted from.
//!
//! llama.cpp's converter renames every tensor (`model.layers.0.mlp.up_proj`
//! becomes `blk.0.ffn_up`) and changes some of them (Q/K rows permuted for
//! its rope, Mamba's `A_log` stored as `A = -exp(A_log)`, fused tensors
//! split, size-1 dimensions dropped or added). The caller (the engine, which
//! knows the architectures) says for each tensor it expects where it lies in
//! the file and which [`GgufTransform`] undoes the converter's change; this
//! module checks everything before allocating, then reads, undoes and
//! uploads each tensor, with the same guarantees as
//! [`load_safetensors`](super::load_safetensors).

use std::collections::HashSet;

use metrale_core::DType;
use metrale_core::quant::GgmlType;
use metrale_gpu_runtime::gpu::GpuBackend;

use super::{LoadProgress, WeightDType, convert, discard};
use crate::error::WeightsError;
use crate::gguf::{GgufFile, GgufTensor};
use crate::weights::{DeviceTensor, WeightStore};

/// How a tensor was changed by the converter; loading undoes it.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufTransform {
    /// Stored as is (size-1 dimensions may have been added or dropped: the
    /// shapes must agree once those are ignored).
    Identity,
    /// Stored with the same elements in the same order under another shape
    /// (Mamba-2's grouped norm weight, `[n_groups, d_inner / n_groups]`):
    /// only the element counts must agree.
    Reshape,
    /// llama.cpp's `LlamaModel.permute(w, n_head)`: within each of
    /// `n_heads` row blocks, the two rope halves were interleaved.
    UnpermuteRows { n_heads: usize },
    /// Mamba-2's `A_log` stored as `A = -exp(A_log)`: loaded as `ln(-A)`.
    ALogFromA,
    /// The expected tensor is the concatenation of the sources (in order)
    /// along `axis` of the expected shape; the sources have equal shapes.
    Concat { axis: usize },
    /// Stored as `w + 1` (Qwen3-Next's zero-centred norm weights): loaded
    /// as `stored - 1`.
    MinusOne,
    /// The expected tensor's rows, in order, are these runs of the
    /// sources' rows (a fused projection the converter split and
    /// regrouped, such as Qwen3-Next's `in_proj_qkvz`).
    Gather(Vec<RowRun>),
    /// The expected tensor is slice `index` of `count` equal slices of the
    /// source's outermost dimension (one expert of a stacked
    /// `ffn_*_exps`).
    Slice { index: usize, count: usize },
}

/// `len` consecutive rows of source `source` from row `start`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowRun {
    pub source: usize,
    pub start: usize,
    pub len: usize,
}

/// A tensor the caller expects, and where it comes from in the file.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufExpected {
    /// The name it gets in the store (the Hugging Face name).
    pub name: String,
    /// Its row-major shape in the store.
    pub shape: Vec<usize>,
    /// The GGUF tensors it is made of (one, or several for `Concat`).
    pub sources: Vec<String>,
    pub transform: GgufTransform,
    /// Quantize it on load to this block format (its sources must be
    /// floats), or hold it as the [`WeightDType`] policy says (`None`).
    pub quantize: Option<GgmlType>,
}

/// The device dtype a GGUF tensor type is held in before the load policy
/// applies, or `None` when metrale cannot load it. The one place that says
/// which GGUF types load: the floats, and every block-quantized format
/// metrale can decode (held as blocks, [`DType::Quant`]; whether the
/// backend multiplies them is [`GpuBackend::supports_weights`], checked at
/// load).
pub fn device_dtype(ty: GgmlType) -> Option<DType> {
    match ty {
        GgmlType::F32 => Some(DType::F32),
        GgmlType::F16 => Some(DType::F16),
        GgmlType::BF16 => Some(DType::BF16),
        ty if metrale_core::quant::can_dequantize(ty) => {
            metrale_core::QuantFormat::new(ty).map(DType::Quant)
        }
        _ => None,
    }
}

fn squeezed(shape: &[usize]) -> Vec<usize> {
    shape.iter().copied().filter(|&d| d != 1).collect()
}

/// One expected tensor, checked: its sources and the dtype they share.
struct Planned<'a> {
    expected: &'a GgufExpected,
    sources: Vec<GgufTensor<'a>>,
    /// Each source's dtype: `stored`, or another when the parts were
    /// widened to f32 (`stored` is F32 then).
    dtypes: Vec<DType>,
    stored: DType,
    /// How it is held on the device.
    target: DType,
}

impl Planned<'_> {
    /// Bytes read from the file for this tensor.
    fn bytes(&self) -> u64 {
        let all: u64 = self.sources.iter().map(|s| s.data.len() as u64).sum();
        match self.expected.transform {
            GgufTransform::Slice { count, .. } => all / count.max(1) as u64,
            _ => all,
        }
    }
}

/// Checks that `expected`'s sources exist, are of a loadable type, and have
/// the shape the transform needs.
fn plan<'a>(
    file: &'a GgufFile,
    e: &'a GgufExpected,
    gpu: &dyn GpuBackend,
    policy: WeightDType,
) -> Result<Planned<'a>, WeightsError> {
    let path = file.path().to_path_buf();
    let mut sources = Vec::with_capacity(e.sources.len());
    let mut dtypes = Vec::with_capacity(e.sources.len());
    let mut stored = None;
    for name in &e.sources {
        let t = file.tensor(name)?;
        let Some(dtype) = device_dtype(t.ggml_type()) else {
            return Err(WeightsError::GgufUnsupportedType {
                path,
                tensor: name.clone(),
                ggml_type: t.ggml_type().name().to_string(),
            });
        };
        // Parts of one tensor in different formats (llama.cpp's mixes may
        // quantize the halves of a split projection differently) are
        // widened to f32 and joined as floats.
        let mixed = stored.is_some_and(|s| s != dtype);
        dtypes.push(dtype);
        if mixed {
            stored = Some(DType::F32);
            sources.push(t);
            continue;
        }
        if dtype.quant().is_some() && !gpu.supports_weights(policy.target(dtype)) {
            return Err(WeightsError::GgufTensor {
                path,
                tensor: name.clone(),
                detail: format!(
                    "is {} and the {} backend has no kernels for {} weights (the CPU has)",
                    t.ggml_type().name(),
                    gpu.name(),
                    t.ggml_type().name()
                ),
            });
        }
        if stored.is_none() {
            stored = Some(dtype);
        }
        sources.push(t);
    }
    let Some(stored) = stored else {
        return Err(WeightsError::MissingTensor {
            path,
            tensor: e.name.clone(),
        });
    };
    let wrong = |t: &GgufTensor, expected: Vec<usize>| WeightsError::WrongShape {
        path: path.clone(),
        tensor: t.name().to_string(),
        expected,
        found: t.shape().to_vec(),
    };
    // Quantized blocks move as whole rows only: they are not rewritten
    // element by element, nor cut inside a row.
    let in_rows = match &e.transform {
        GgufTransform::ALogFromA | GgufTransform::MinusOne => false,
        GgufTransform::Concat { axis } => *axis + 1 < e.shape.len(),
        _ => true,
    };
    if stored.quant().is_some() && !in_rows {
        return Err(WeightsError::GgufTensor {
            path,
            tensor: e.name.clone(),
            detail: format!(
                "is quantized ({}) where the converter's change must be undone element by \
                 element ({:?})",
                stored, e.transform
            ),
        });
    }
    match &e.transform {
        GgufTransform::Concat { axis } => {
            let n = sources.len();
            let mut part = e.shape.clone();
            if *axis >= part.len() || !part[*axis].is_multiple_of(n) {
                return Err(WeightsError::GgufTensor {
                    path,
                    tensor: e.name.clone(),
                    detail: format!("cannot be split into {n} parts along axis {axis}"),
                });
            }
            part[*axis] /= n;
            for t in &sources {
                if squeezed(t.shape()) != squeezed(&part) {
                    return Err(wrong(t, part));
                }
            }
        }
        GgufTransform::Gather(runs) => {
            let row = e.shape.last().copied().unwrap_or(1);
            let rows: usize = e.shape.iter().rev().skip(1).product();
            let fits = |r: &RowRun| {
                let t = &sources[r.source.min(sources.len() - 1)];
                let t_row = t.shape().last().copied().unwrap_or(1);
                let t_rows = t.shape().iter().rev().skip(1).product::<usize>();
                r.source < sources.len() && t_row == row && r.start + r.len <= t_rows
            };
            let total: usize = runs.iter().map(|r| r.len).sum();
            if total != rows || !runs.iter().all(fits) {
                return Err(WeightsError::GgufTensor {
                    path,
                    tensor: e.name.clone(),
                    detail: format!(
                        "its {rows} rows of {row} cannot be gathered from {}",
                        sources
                            .iter()
                            .map(|t| format!("{} {:?}", t.name(), t.shape()))
                            .collect::<Vec<_>>()
                            .join(" and ")
                    ),
                });
            }
        }
        GgufTransform::Slice { index, count } => {
            let t = &sources[0];
            let mut whole = vec![*count];
            whole.extend_from_slice(&e.shape);
            if index >= count || squeezed(t.shape()) != squeezed(&whole) {
                return Err(wrong(t, whole));
            }
        }
        transform => {
            let t = &sources[0];
            let reshape = *transform == GgufTransform::Reshape;
            let elems = |s: &[usize]| s.iter().product::<usize>();
            if (reshape && elems(t.shape()) != elems(&e.shape))
                || (!reshape && squeezed(t.shape()) != squeezed(&e.shape))
            {
                return Err(wrong(t, e.shape.clone()));
            }
            if let GgufTransform::UnpermuteRows { n_heads } = transform {
                let rows = e.shape.first().copied().unwrap_or(0);
                if *n_heads == 0 || !rows.is_multiple_of(2 * n_heads) {
                    return Err(WeightsError::GgufTensor {
                        path,
                        tensor: t.name().to_string(),
                        detail: format!(
                            "{rows} rows cannot be split into {n_heads} heads of two rope halves"
                        ),
                    });
                }
            }
        }
    }
    let target = match e.quantize {
        None => policy.target(stored),
        Some(ty) => {
            let refuse = |detail: String| WeightsError::Quantize {
                path: path.clone(),
                tensor: e.name.clone(),
                detail,
            };
            if let DType::Quant(q) = stored {
                return Err(refuse(format!(
                    "it is stored quantized ({}); only float tensors are quantized on load",
                    q.ggml().name()
                )));
            }
            if !in_rows {
                return Err(refuse(format!(
                    "the converter's change ({:?}) is undone element by element",
                    e.transform
                )));
            }
            super::quant_dtype(ty, &e.name, &e.shape, gpu).map_err(refuse)?
        }
    };
    Ok(Planned {
        expected: e,
        sources,
        dtypes,
        stored,
        target,
    })
}

/// Loads the `expected` tensors of `file` onto `gpu`, held as `policy` says
/// (the dtype of a GGUF tensor is [`device_dtype`] of its type).
///
/// Everything is checked before anything is allocated: each source exists,
/// has a type [`device_dtype`] accepts, and the shape the transform needs.
/// GGUF tensors no expected tensor uses are reported as warnings. Errors
/// name the file and the tensor; on any error nothing stays allocated.
pub fn load_gguf(
    file: &GgufFile,
    expected: &[GgufExpected],
    gpu: &dyn GpuBackend,
    policy: WeightDType,
    progress: &mut dyn FnMut(LoadProgress),
) -> Result<WeightStore, WeightsError> {
    load_gguf_with(file, expected, &[], gpu, policy, progress)
}

/// [`load_gguf`], with parts of the file that are not loaded (`aside`,
/// named by GGUF tensor names): each reported once ([`SetAside`]), not
/// tensor by tensor.
pub fn load_gguf_with(
    file: &GgufFile,
    expected: &[GgufExpected],
    aside: &[super::SetAside],
    gpu: &dyn GpuBackend,
    policy: WeightDType,
    progress: &mut dyn FnMut(LoadProgress),
) -> Result<WeightStore, WeightsError> {
    let mut seen = HashSet::new();
    let mut used = HashSet::new();
    let mut planned = Vec::with_capacity(expected.len());
    for e in expected {
        if !seen.insert(e.name.as_str()) {
            continue;
        }
        let p = plan(file, e, gpu, policy)?;
        used.extend(e.sources.iter().map(String::as_str));
        planned.push(p);
    }
    let stored: Vec<super::aside::Stored<'_>> = file
        .tensor_infos()
        .iter()
        .map(|t| super::aside::Stored {
            name: &t.name,
            shape: &t.shape,
            bytes: t.byte_len,
        })
        .collect();
    let mut aside = super::aside::report(file.path(), &stored, &used, aside);
    aside.send(progress);
    for t in file.tensor_infos() {
        if !used.contains(t.name.as_str()) && !aside.names.contains(&t.name) {
            let message = format!(
                "{}: tensor {:?} is not used by this model and is not loaded",
                file.path().display(),
                t.name
            );
            tracing::warn!("{message}");
            progress(LoadProgress::Warning(message));
        }
    }

    let total_bytes: u64 = planned.iter().map(Planned::bytes).sum();
    progress(LoadProgress::Start {
        tensors: planned.len(),
        bytes: total_bytes,
    });
    let mut store = WeightStore::new();
    let mut done = 0u64;
    for (index, p) in planned.iter().enumerate() {
        match upload(gpu, p) {
            Ok(tensor) => {
                store.insert(p.expected.name.clone(), tensor);
                // The file's pages of it are no longer needed resident.
                p.sources.iter().for_each(|s| file.release(s));
            }
            Err(e) => {
                discard(store, gpu);
                return Err(e);
            }
        }
        done += p.bytes();
        progress(LoadProgress::Tensor {
            name: p.expected.name.clone(),
            index,
            tensors: planned.len(),
            bytes_done: done,
            bytes_total: total_bytes,
        });
    }
    progress(LoadProgress::Done {
        tensors: planned.len(),
        bytes: total_bytes,
    });
    Ok(store)
}

/// The tensor's bytes in `stored` dtype, with the converter's change undone.
/// Tensors stored as is are borrowed from the file; the others are rebuilt
/// in host memory (one tensor at a time).
fn host_bytes<'a>(p: &Planned<'a>) -> std::borrow::Cow<'a, [u8]> {
    use std::borrow::Cow;
    let e = p.expected;
    let size = p.stored.size_of();
    match &e.transform {
        GgufTransform::Identity | GgufTransform::Reshape => Cow::Borrowed(p.sources[0].data),
        GgufTransform::UnpermuteRows { n_heads } => {
            // Stored row r of head h was `h*rows_per_head + (i*2 + half)`
            // for original row `h*rows_per_head + half*(rows_per_head/2) + i`.
            let data = p.sources[0].data;
            let rows = e.shape[0];
            let row_bytes = data.len() / rows;
            let per_head = rows / n_heads;
            let half = per_head / 2;
            let mut out = vec![0u8; data.len()];
            for h in 0..*n_heads {
                for j in 0..2 {
                    for i in 0..half {
                        let src = h * per_head + i * 2 + j;
                        let dst = h * per_head + j * half + i;
                        out[dst * row_bytes..(dst + 1) * row_bytes]
                            .copy_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
                    }
                }
            }
            Cow::Owned(out)
        }
        GgufTransform::ALogFromA => {
            let a = convert(p.sources[0].data, p.stored, DType::F32);
            let ln: Vec<u8> = (a.chunks_exact(4))
                .flat_map(|c| {
                    (-f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .ln()
                        .to_le_bytes()
                })
                .collect();
            Cow::Owned(convert(&ln, DType::F32, p.stored).into_owned())
        }
        GgufTransform::MinusOne => {
            let w = convert(p.sources[0].data, p.stored, DType::F32);
            let less: Vec<u8> = (w.chunks_exact(4))
                .flat_map(|c| (f32::from_le_bytes([c[0], c[1], c[2], c[3]]) - 1.0).to_le_bytes())
                .collect();
            Cow::Owned(convert(&less, DType::F32, p.stored).into_owned())
        }
        GgufTransform::Gather(runs) => {
            // The sources share the row length (checked) and, as parts,
            // the dtype.
            let parts: Vec<Cow<[u8]>> = (0..p.sources.len()).map(|i| part(p, i)).collect();
            let first_rows: usize = p.sources[0].shape().iter().rev().skip(1).product();
            let row_bytes = parts[0].len() / first_rows.max(1);
            let mut out = Vec::new();
            for r in runs {
                let data = &parts[r.source];
                out.extend_from_slice(&data[r.start * row_bytes..(r.start + r.len) * row_bytes]);
            }
            Cow::Owned(out)
        }
        GgufTransform::Slice { index, count } => {
            let data = p.sources[0].data;
            let part = data.len() / count;
            Cow::Borrowed(&data[index * part..(index + 1) * part])
        }
        GgufTransform::Concat { axis } => {
            let outer: usize = e.shape[..*axis].iter().product();
            let parts: Vec<Cow<[u8]>> = (0..p.sources.len()).map(|i| part(p, i)).collect();
            let total: usize = parts.iter().map(|s| s.len()).sum();
            let mut out = Vec::with_capacity(total);
            for o in 0..outer {
                for s in &parts {
                    let chunk = s.len() / outer;
                    out.extend_from_slice(&s[o * chunk..(o + 1) * chunk]);
                }
            }
            debug_assert_eq!(out.len() % size, 0);
            Cow::Owned(out)
        }
    }
}

/// Source `i`'s bytes in the tensor's `stored` dtype (widened to f32 when
/// the parts came in different formats).
fn part<'a>(p: &Planned<'a>, i: usize) -> std::borrow::Cow<'a, [u8]> {
    convert(p.sources[i].data, p.dtypes[i], p.stored)
}

fn upload(gpu: &dyn GpuBackend, p: &Planned<'_>) -> Result<DeviceTensor, WeightsError> {
    let target = p.target;
    let name = &p.expected.name;
    let device = |source| WeightsError::Device {
        name: name.clone(),
        source,
    };
    let elements: usize = p.expected.shape.iter().product();
    let bytes = host_bytes(p);
    let data = match target {
        DType::Quant(q) if p.stored.quant().is_none() => {
            let row = p.expected.shape.last().copied().unwrap_or(1);
            std::borrow::Cow::Owned(super::quantize::rows(&bytes, p.stored, q.ggml(), row))
        }
        _ => convert(&bytes, p.stored, target),
    };
    let slice = gpu
        .alloc_slice(target, elements, &format!("weights: {name}"))
        .map_err(device)?;
    if let Err(e) = gpu.copy_h2d(&data, slice.ptr(), 0) {
        let _ = gpu.free(slice.ptr());
        return Err(device(e));
    }
    Ok(DeviceTensor {
        slice,
        shape: p.expected.shape.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufWriter;

    /// llama.cpp's `permute(w, n_head)`, for 1-element rows.
    fn permute(rows: &[f32], n_head: usize) -> Vec<f32> {
        let per = rows.len() / n_head;
        let mut out = Vec::new();
        for h in 0..n_head {
            for i in 0..per / 2 {
                for j in 0..2 {
                    out.push(rows[h * per + j * (per / 2) + i]);
                }
            }
        }
        out
    }

    fn bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn floats(b: &[u8]) -> Vec<f32> {
        (b.chunks_exact(4))
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    #[test]
    fn transforms_undo_the_converter() {
        let rows: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let a_log = [0.5f32, -1.0];
        let mut w = GgufWriter::new();
        w.add_tensor("q", GgmlType::F32, &[12], bytes(&permute(&rows, 3)));
        let a: Vec<f32> = a_log.iter().map(|x| -x.exp()).collect();
        w.add_tensor("a", GgmlType::F32, &[2, 1], bytes(&a));
        w.add_tensor("g", GgmlType::F32, &[2, 1, 2], bytes(&[1., 2., 3., 4.]));
        w.add_tensor("u", GgmlType::F32, &[2, 1, 2], bytes(&[5., 6., 7., 8.]));
        let file = GgufFile::from_bytes("t.gguf", w.to_bytes().unwrap()).unwrap();
        let plan_of = |name: &str, shape: Vec<usize>, sources: &[&str], transform| {
            let e = GgufExpected {
                name: name.into(),
                shape,
                sources: sources.iter().map(|s| s.to_string()).collect(),
                transform,
                quantize: None,
            };
            let cpu = metrale_gpu_runtime::cpu::CpuBackend::with_threads(1);
            let p = plan(&file, &e, &cpu, WeightDType::AsStored).unwrap();
            floats(&host_bytes(&p))
        };
        let q = plan_of(
            "q",
            vec![12],
            &["q"],
            GgufTransform::UnpermuteRows { n_heads: 3 },
        );
        assert_eq!(q, rows);
        let a = plan_of("a", vec![2], &["a"], GgufTransform::ALogFromA);
        for (x, y) in a.iter().zip(a_log) {
            assert!((x - y).abs() < 1e-6);
        }
        let gu = plan_of(
            "gu",
            vec![2, 2, 2],
            &["g", "u"],
            GgufTransform::Concat { axis: 1 },
        );
        assert_eq!(gu, [1., 2., 5., 6., 3., 4., 7., 8.]);
    }

    #[test]
    fn regrouped_sliced_and_offset_tensors_are_undone() {
        let mut w = GgufWriter::new();
        // Two sources of 2-element rows: "x" rows 0..3, "y" rows 0..2.
        w.add_tensor(
            "x",
            GgmlType::F32,
            &[3, 2],
            bytes(&[0., 1., 2., 3., 4., 5.]),
        );
        w.add_tensor("y", GgmlType::F32, &[2, 2], bytes(&[6., 7., 8., 9.]));
        w.add_tensor("n", GgmlType::F32, &[3], bytes(&[1.5, 0.75, 2.0]));
        // Three experts of [2, 2], stacked.
        let experts: Vec<f32> = (0..12).map(|i| i as f32).collect();
        w.add_tensor("e", GgmlType::F32, &[3, 2, 2], bytes(&experts));
        let file = GgufFile::from_bytes("t.gguf", w.to_bytes().unwrap()).unwrap();
        let cpu = metrale_gpu_runtime::cpu::CpuBackend::with_threads(1);
        let load = |shape: Vec<usize>, sources: &[&str], transform| {
            let e = GgufExpected {
                name: "t".into(),
                shape,
                sources: sources.iter().map(|s| s.to_string()).collect(),
                transform,
                quantize: None,
            };
            plan(&file, &e, &cpu, WeightDType::AsStored).map(|p| floats(&host_bytes(&p)))
        };
        let run = |source, start, len| RowRun { source, start, len };
        let runs = vec![run(0, 2, 1), run(1, 0, 2), run(0, 0, 2)];
        let g = load(vec![5, 2], &["x", "y"], GgufTransform::Gather(runs)).unwrap();
        assert_eq!(g, [4., 5., 6., 7., 8., 9., 0., 1., 2., 3.]);
        let too_many = vec![run(0, 2, 2)];
        assert!(load(vec![2, 2], &["x"], GgufTransform::Gather(too_many)).is_err());
        let n = load(vec![3], &["n"], GgufTransform::MinusOne).unwrap();
        assert_eq!(n, [0.5, -0.25, 1.0]);
        let slice = |index| GgufTransform::Slice { index, count: 3 };
        assert_eq!(
            load(vec![2, 2], &["e"], slice(1)).unwrap(),
            [4., 5., 6., 7.]
        );
        assert!(load(vec![2, 2], &["e"], slice(3)).is_err());
        assert!(load(vec![2, 3], &["e"], slice(0)).is_err());
    }

    /// Parts in different block formats are joined as f32.
    #[test]
    fn parts_in_different_formats_are_widened() {
        let row: Vec<f32> = (0..32).map(|i| i as f32 / 8.0).collect();
        let q = |ty: GgmlType| {
            let mut b = vec![0u8; ty.row_bytes(32).unwrap()];
            metrale_core::quant::quantize_row(ty, &row, &mut b).unwrap();
            b
        };
        let mut w = GgufWriter::new();
        w.add_tensor("a", GgmlType::Q8_0, &[1, 32], q(GgmlType::Q8_0));
        w.add_tensor("b", GgmlType::Q4_0, &[1, 32], q(GgmlType::Q4_0));
        let file = GgufFile::from_bytes("t.gguf", w.to_bytes().unwrap()).unwrap();
        let cpu = metrale_gpu_runtime::cpu::CpuBackend::with_threads(1);
        let e = GgufExpected {
            name: "ab".into(),
            shape: vec![2, 32],
            sources: vec!["a".into(), "b".into()],
            transform: GgufTransform::Concat { axis: 0 },
            quantize: None,
        };
        let p = plan(&file, &e, &cpu, WeightDType::AsStored).unwrap();
        assert_eq!(p.stored, DType::F32);
        let v = floats(&host_bytes(&p));
        assert_eq!(v.len(), 64);
        for (x, y) in v.iter().zip(row.iter().chain(&row)) {
            assert!((x - y).abs() < 0.3, "{x} {y}");
        }
    }
}
