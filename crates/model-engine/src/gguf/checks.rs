//! Checks on a GGUF file's metadata and tensor table made before the
//! config is built from them: the file may be hostile, and what the config
//! builder (and then the config's parser) turns into allocations and loops
//! (layers, experts, key groups) must be bounded by the file's own size,
//! floats must be numbers, and the tensors read for sizes must have them.
//!
//! The bounds hold for every file metrale can load: each counted item
//! needs tensor bytes of its own (an expert of a MoE layer at least two
//! matrices of at least one row of at least two bytes), so a count the
//! tensor data cannot hold is refused, naming the key, before the config
//! allocates anything for it.

use metrale_model_weights::WeightsError;
use metrale_model_weights::gguf::{GgufFile, GgufTensor, GgufValue};

use crate::error::{EngineError, Result};

pub(super) fn meta_err(file: &GgufFile, key: &str, detail: impl Into<String>) -> EngineError {
    EngineError::Weights(WeightsError::GgufMetadata {
        path: file.path().to_path_buf(),
        key: key.to_string(),
        detail: detail.into(),
    })
}

fn tensor_err(file: &GgufFile, tensor: &str, detail: impl Into<String>) -> EngineError {
    EngineError::Weights(WeightsError::GgufTensor {
        path: file.path().to_path_buf(),
        tensor: tensor.to_string(),
        detail: detail.into(),
    })
}

/// The float under `key`, if present: f32 or f64 (rounded), and finite. A
/// NaN once became JSON `null` in the rebuilt config, which reads as an
/// absent key: the default, silently.
pub(super) fn opt_finite(file: &GgufFile, key: &str) -> Result<Option<f32>> {
    let Some(v) = file.get(key) else {
        return Ok(None);
    };
    let f = file.get_f32(key)?;
    if !f.is_finite() {
        let stored = match v {
            GgufValue::F64(d) => format!("{d}"),
            _ => format!("{f}"),
        };
        let detail = format!("{stored} is not a finite number (as f32)");
        return Err(meta_err(file, key, detail));
    }
    Ok(Some(f))
}

/// The layer count under `key`: at least one, at most the engine's
/// [`MAX_LAYERS`](crate::arch::MAX_LAYERS) (per-layer keys become
/// `block_count`-long lists, and every layer is looked up by name).
pub(super) fn layer_count(file: &GgufFile, key: &str) -> Result<usize> {
    let n = file.get_u32(key)? as usize;
    let max = crate::arch::MAX_LAYERS;
    if n == 0 || n > max {
        return Err(meta_err(
            file,
            key,
            format!("{n} layers: a model has 1 to {max} layers"),
        ));
    }
    Ok(n)
}

/// Bytes of tensor data the file holds (what bounds every count).
fn tensor_bytes(file: &GgufFile) -> u64 {
    (file.tensor_infos().iter())
        .map(|t| t.byte_len as u64)
        .sum()
}

/// Refuses `count` items (the value of `key`) in each of `layers` layers
/// when they would need more than the file's tensor bytes at
/// `bytes_each` bytes an item.
pub(super) fn fits(
    file: &GgufFile,
    key: &str,
    count: usize,
    layers: usize,
    bytes_each: u64,
) -> Result<()> {
    let need = (count as u64)
        .saturating_mul(layers as u64)
        .saturating_mul(bytes_each);
    let have = tensor_bytes(file);
    if need > have {
        return Err(meta_err(
            file,
            key,
            format!(
                "{count} in each of {layers} layers needs at least {need} bytes of tensor data; \
                 the file's tensors hold {have}"
            ),
        ));
    }
    Ok(())
}

/// The tensor `name`'s shape, which must have `dims` dimensions, none of
/// them zero: the config reads sizes from it.
pub(super) fn sized<'a>(t: GgufTensor<'a>, file: &GgufFile, dims: usize) -> Result<&'a [usize]> {
    let shape = t.shape();
    if shape.len() != dims || shape.contains(&0) {
        return Err(tensor_err(
            file,
            t.name(),
            format!(
                "has shape {shape:?}; a {dims}-dimensional tensor with no zero dimension is \
                 expected"
            ),
        ));
    }
    Ok(shape)
}

#[cfg(test)]
mod tests {
    use metrale_core::quant::GgmlType;
    use metrale_model_weights::gguf::GgufWriter;

    use super::*;

    /// A file with `meta` and one F32 `[2, 4]` tensor (32 bytes of data).
    fn file(meta: &[(&str, GgufValue)], shape: &[usize]) -> GgufFile {
        let mut w = GgufWriter::new();
        for (k, v) in meta {
            w.add(*k, v.clone());
        }
        let bytes = 4 * shape.iter().product::<usize>();
        w.add_tensor("t", GgmlType::F32, shape, vec![0u8; bytes]);
        GgufFile::from_bytes("c.gguf", w.to_bytes().unwrap()).unwrap()
    }

    #[test]
    fn floats_must_be_finite_as_f32() {
        let f = file(
            &[
                ("ok", GgufValue::F64(1e-6)),
                ("nan", GgufValue::F32(f32::NAN)),
                ("big", GgufValue::F64(1e300)),
            ],
            &[2, 4],
        );
        assert_eq!(opt_finite(&f, "ok").unwrap(), Some(1e-6));
        assert_eq!(opt_finite(&f, "absent").unwrap(), None);
        for key in ["nan", "big"] {
            let e = opt_finite(&f, key).unwrap_err().to_string();
            assert!(
                e.starts_with("c.gguf: ") && e.contains(&format!("{key:?}")),
                "{e}"
            );
        }
    }

    #[test]
    fn layer_counts_are_bounded() {
        let f = file(
            &[
                ("one", GgufValue::U32(1)),
                ("zero", GgufValue::U32(0)),
                ("max", GgufValue::U32(4096)),
                ("more", GgufValue::U32(4097)),
            ],
            &[2, 4],
        );
        assert_eq!(layer_count(&f, "one").unwrap(), 1);
        assert_eq!(layer_count(&f, "max").unwrap(), 4096);
        for key in ["zero", "more"] {
            let e = layer_count(&f, key).unwrap_err().to_string();
            assert!(
                e.contains(&format!("{key:?}")) && e.contains("1 to 4096"),
                "{e}"
            );
        }
    }

    #[test]
    fn counts_must_fit_the_tensor_bytes() {
        let f = file(&[], &[2, 4]);
        fits(&f, "k", 4, 2, 4).unwrap();
        let e = fits(&f, "k", 5, 2, 4).unwrap_err().to_string();
        assert!(
            e.contains("\"k\"") && e.contains("40 bytes") && e.contains("32"),
            "{e}"
        );
        fits(&f, "k", usize::MAX, usize::MAX, 4).unwrap_err();
    }

    #[test]
    fn size_tensors_need_their_dimensions() {
        let f = file(&[], &[2, 4]);
        assert_eq!(sized(f.tensor("t").unwrap(), &f, 2).unwrap(), [2, 4]);
        sized(f.tensor("t").unwrap(), &f, 1).unwrap_err();
        for shape in [&[][..], &[0, 4], &[2, 0]] {
            let f = file(&[], shape);
            let e = sized(f.tensor("t").unwrap(), &f, 2)
                .unwrap_err()
                .to_string();
            assert!(e.starts_with("c.gguf: GGUF tensor \"t\""), "{e}");
        }
    }
}
