//! Quantizing on load (`--quant q4_k_m`): which type each tensor gets, by
//! llama.cpp's rules ([`metrale_model_weights::gguf::mix`]), applied to the
//! tensors under their GGUF names, so that a checkpoint quantized on load
//! holds what llama.cpp's `convert_hf_to_gguf.py` followed by
//! `llama-quantize` would have made of it.

use std::collections::HashMap;

use metrale_core::quant::GgmlType;
use metrale_model_weights::gguf::GgufFile;
use metrale_model_weights::gguf::mix::{FileType, MixParams, MixTensor, choose_types};

use super::table;
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};

fn params(config: &ModelConfig) -> MixParams {
    MixParams {
        n_layer: config.num_layers(),
        n_expert: config.moe.as_ref().map_or(0, |m| m.n_experts),
    }
}

/// Each quantized tensor's block format, by Hugging Face name, for a
/// checkpoint of `config` quantized to `ftype`; tensors the rules keep as
/// floats (norms, biases, Mamba's conv1d and A, routers) are absent. A
/// tensor llama.cpp stores as parts of different types gets the part type
/// with the most bits per weight (its other rows are then better than
/// llama.cpp's).
pub fn quant_types(config: &ModelConfig, ftype: FileType) -> Result<HashMap<String, GgmlType>> {
    let table = table(config)?;
    // Every GGUF tensor the converter would write, with the Hugging Face
    // tensor it comes from. GGUF dimensions are the row-major shape
    // reversed; a split tensor's parts divide its `axis`.
    let mut gguf: Vec<(String, Vec<usize>, usize)> = Vec::new();
    let expected = config.expected_tensors();
    for (i, t) in expected.iter().enumerate() {
        let Some((names, transform)) = table.source(&t.name, config) else {
            return Err(EngineError::Internal(format!(
                "no GGUF name is known for tensor {:?} of a {} model",
                t.name,
                config.model_type.as_str()
            )));
        };
        let mut shape = t.shape.clone();
        if let metrale_model_weights::loader::GgufTransform::Concat { axis } = transform {
            shape[axis] /= names.len().max(1);
        }
        let ne: Vec<usize> = shape.iter().rev().copied().collect();
        gguf.extend(names.into_iter().map(|n| (n, ne.clone(), i)));
    }
    let tensors: Vec<MixTensor> = gguf
        .iter()
        .map(|(name, ne, _)| MixTensor {
            name,
            ne,
            ty: GgmlType::F32,
        })
        .collect();
    let chosen = choose_types(&tensors, &params(config), ftype);
    let mut out: HashMap<String, GgmlType> = HashMap::new();
    for ((_, _, i), ty) in gguf.iter().zip(chosen) {
        if !ty.is_quantized() {
            continue;
        }
        let hf = &expected[*i].name;
        // The parts of a tensor the converter splits may get different
        // types (Qwen3-Next's attn_qkv counts as an attn_v for the mixes,
        // its attn_gate does not); one tensor holds one format: the one
        // with more bits per weight.
        let bits = |t: GgmlType| t.block_bytes() as f64 / t.block_elems() as f64;
        let held = out.entry(hf.clone()).or_insert(ty);
        if bits(ty) > bits(*held) {
            *held = ty;
        }
    }
    Ok(out)
}

/// The tensors of a GGUF `file` that `ftype` quantizes: GGUF name to
/// block format, for the tensors whose type changes.
pub fn file_quant_types(
    file: &GgufFile,
    config: &ModelConfig,
    ftype: FileType,
) -> HashMap<String, GgmlType> {
    let infos = file.tensor_infos();
    let dims: Vec<Vec<usize>> = infos
        .iter()
        .map(|t| t.dims.iter().map(|&d| d as usize).collect())
        .collect();
    let tensors: Vec<MixTensor> = infos
        .iter()
        .zip(&dims)
        .map(|(t, ne)| MixTensor {
            name: &t.name,
            ne,
            ty: t.ggml_type,
        })
        .collect();
    let chosen = choose_types(&tensors, &params(config), ftype);
    tensors
        .iter()
        .zip(chosen)
        .filter(|(t, ty)| ty.is_quantized() && *ty != t.ty)
        .map(|(t, ty)| (t.name.to_string(), ty))
        .collect()
}
