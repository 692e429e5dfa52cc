//! The tensors of a Hugging Face checkpoint as llama.cpp's converter
//! writes them: renamed and changed by the family's [`GgufTable`] read
//! forwards (the loader reads it backwards), in the converter's order (the
//! shard files by name, each file's tensor names sorted, each giving its
//! GGUF tensors in turn), with
//! the converter's shapes and float types.

use metrale_core::quant::GgmlType;
use metrale_model_weights::loader::{Checkpoint, GgufTransform};

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::gguf::GgufTable;

/// One GGUF tensor made from one checkpoint tensor.
#[derive(Clone, Debug)]
pub(super) struct HfTensor {
    /// The GGUF name.
    pub name: String,
    /// Row-major, as the converter stores it.
    pub shape: Vec<usize>,
    /// The checkpoint tensor it comes from.
    pub hf: String,
    pub hf_shape: Vec<usize>,
    pub forward: Forward,
}

/// The converter's change, forwards.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Forward {
    /// The same elements in the same order (the shape may differ).
    Same,
    /// `LlamaModel.permute(w, n_heads)`: in each head's block of rows, the
    /// two rope halves interleaved.
    PermuteRows { n_heads: usize },
    /// `A = -exp(A_log)`.
    NegExp,
    /// Part `index` of `parts` equal parts along `axis` (`torch.split`).
    Part {
        axis: usize,
        index: usize,
        parts: usize,
    },
}

/// Checkpoint names the converter drops.
fn skipped(name: &str) -> bool {
    name.ends_with(".attention.masked_bias")
        || name.ends_with(".attention.bias")
        || name.ends_with(".rotary_emb.inv_freq")
}

/// The converter's shape for a tensor it stores under `gguf` (Mamba-2's
/// `modify_tensors`: the conv weight squeezed, `A` and `D` given a trailing
/// 1, the norm weight as `[n_groups, d_inner / n_groups]`).
fn converted_shape(gguf: &str, shape: &[usize], c: &ModelConfig) -> Vec<usize> {
    let base = gguf.rsplit_once('.').map_or(gguf, |(_, b)| b);
    if gguf.ends_with("ssm_conv1d.weight") {
        return shape.iter().copied().filter(|&d| d != 1).collect();
    }
    if base == "ssm_a" || base == "ssm_d" {
        return shape.iter().copied().chain([1]).collect();
    }
    if gguf.ends_with("ssm_norm.weight")
        && let Some(m) = &c.mamba
    {
        let n: usize = shape.iter().product();
        let g = m.n_groups.max(1);
        return vec![g, n / g];
    }
    shape.to_vec()
}

/// Every GGUF tensor the checkpoint gives, in the converter's order.
pub(super) fn plan(
    ckpt: &Checkpoint,
    table: &GgufTable,
    config: &ModelConfig,
    dir: &std::path::Path,
) -> Result<Vec<HfTensor>> {
    // The converter's order: the shard files by name, then each file's
    // tensors by name.
    let mut names: Vec<(std::path::PathBuf, String, Vec<usize>)> = ckpt
        .entries()
        .map(|(f, e)| (f.path.clone(), e.name.clone(), e.shape.clone()))
        .collect();
    names.sort();
    let mut out = Vec::new();
    for (_, hf, hf_shape) in names {
        if skipped(&hf) {
            continue;
        }
        let Some((gguf, transform)) = table.source(&hf, config) else {
            return Err(EngineError::Config {
                path: dir.to_path_buf(),
                detail: format!(
                    "tensor {hf:?}: no GGUF name is known for it in a {} model",
                    config.model_type.as_str()
                ),
            });
        };
        let parts = gguf.len();
        for (index, name) in gguf.into_iter().enumerate() {
            let forward = match &transform {
                GgufTransform::Identity | GgufTransform::Reshape => Forward::Same,
                GgufTransform::UnpermuteRows { n_heads } => {
                    let rows = hf_shape.first().copied().unwrap_or(0);
                    if *n_heads == 0 || !rows.is_multiple_of(2 * n_heads) {
                        return Err(EngineError::Config {
                            path: dir.to_path_buf(),
                            detail: format!(
                                "tensor {hf:?}: {rows} rows cannot be split into {n_heads} heads \
                                 of two rope halves"
                            ),
                        });
                    }
                    Forward::PermuteRows { n_heads: *n_heads }
                }
                GgufTransform::ALogFromA => Forward::NegExp,
                GgufTransform::Concat { axis } => Forward::Part {
                    axis: *axis,
                    index,
                    parts,
                },
                // Qwen3-Next's and the stacked experts' changes: those
                // families are refused before planning.
                other => {
                    return Err(EngineError::Config {
                        path: dir.to_path_buf(),
                        detail: format!(
                            "tensor {hf:?}: the converter's change {other:?} is not exported yet"
                        ),
                    });
                }
            };
            let mut shape = hf_shape.clone();
            if let Forward::Part { axis, .. } = forward {
                if axis >= shape.len() || !shape[axis].is_multiple_of(parts) {
                    return Err(EngineError::Config {
                        path: dir.to_path_buf(),
                        detail: format!(
                            "tensor {hf:?} of shape {hf_shape:?} cannot be split into {parts} \
                             parts along axis {axis}"
                        ),
                    });
                }
                shape[axis] /= parts;
            }
            let shape = converted_shape(&name, &shape, config);
            out.push(HfTensor {
                name,
                shape,
                hf: hf.clone(),
                hf_shape: hf_shape.clone(),
                forward,
            });
        }
    }
    Ok(out)
}

/// The type the converter stores a tensor in when its `--outtype` gives
/// `outtype` (F32, F16 or BF16): 1-D tensors, norms, the MoE router, the
/// SSM conv weight and any tensor not named `*.weight` stay F32.
pub(super) fn converter_type(name: &str, shape: &[usize], outtype: GgmlType) -> GgmlType {
    let forced = shape.len() <= 1
        || name.ends_with("_norm.weight")
        || name.ends_with("ffn_gate_inp.weight")
        || name.ends_with("ffn_gate_inp_shexp.weight")
        || name.ends_with("ssm_conv1d.weight")
        || name == "position_embd.weight"
        || name == "token_types.weight"
        || !name.ends_with(".weight");
    if forced { GgmlType::F32 } else { outtype }
}

/// Applies `t.forward` to the checkpoint tensor's values `src` (f32, of
/// `t.hf_shape`).
pub(super) fn apply(t: &HfTensor, mut src: Vec<f32>) -> Vec<f32> {
    match t.forward {
        Forward::Same => src,
        Forward::NegExp => {
            src.iter_mut().for_each(|x| *x = -x.exp());
            src
        }
        Forward::PermuteRows { n_heads } => {
            let rows = t.hf_shape.first().copied().unwrap_or(1).max(1);
            let row = src.len() / rows;
            let per = rows / n_heads;
            let half = per / 2;
            let mut out = vec![0f32; src.len()];
            for h in 0..n_heads {
                for i in 0..half {
                    for j in 0..2 {
                        let dst = h * per + i * 2 + j;
                        let from = h * per + j * half + i;
                        out[dst * row..(dst + 1) * row]
                            .copy_from_slice(&src[from * row..(from + 1) * row]);
                    }
                }
            }
            out
        }
        Forward::Part { axis, index, parts } => {
            let outer: usize = t.hf_shape[..axis].iter().product();
            let full = src.len() / outer.max(1);
            let chunk = full / parts;
            let mut out = Vec::with_capacity(outer * chunk);
            for o in 0..outer {
                let start = o * full + index * chunk;
                out.extend_from_slice(&src[start..start + chunk]);
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(forward: Forward, hf_shape: Vec<usize>) -> HfTensor {
        HfTensor {
            name: "x".into(),
            shape: vec![],
            hf: "x".into(),
            hf_shape,
            forward,
        }
    }

    #[test]
    fn forward_transforms_match_the_converter() {
        // LlamaModel.permute of 8 one-element rows with 2 heads: per head
        // rows [0 1 2 3] become [0 2 1 3].
        let rows: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let p = apply(&t(Forward::PermuteRows { n_heads: 2 }, vec![8, 1]), rows);
        assert_eq!(p, [0., 2., 1., 3., 4., 6., 5., 7.]);
        // torch.split(2, dim=1) of a [2, 4] tensor: part 1 is columns 2..4.
        let m: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let part = Forward::Part {
            axis: 1,
            index: 1,
            parts: 2,
        };
        assert_eq!(apply(&t(part, vec![2, 4]), m), [2., 3., 6., 7.]);
        let a = apply(&t(Forward::NegExp, vec![2]), vec![0.0, 1.0]);
        assert_eq!(a, [-1.0, -1f32.exp()]);
    }

    #[test]
    fn converter_forces_f32_where_llama_cpp_needs_it() {
        let bf = GgmlType::BF16;
        assert_eq!(converter_type("blk.0.attn_q.weight", &[4, 4], bf), bf);
        for (n, s) in [
            ("blk.0.attn_norm.weight", &[4][..]),
            ("blk.0.ssm_norm.weight", &[2, 4]),
            ("blk.0.ssm_conv1d.weight", &[8, 4]),
            ("blk.0.ffn_gate_inp.weight", &[4, 8]),
            ("blk.0.ssm_a", &[8, 1]),
            ("blk.0.attn_q.bias", &[4]),
        ] {
            assert_eq!(converter_type(n, s, bf), GgmlType::F32, "{n}");
        }
    }
}
