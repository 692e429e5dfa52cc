//! The tensors of a Hugging Face checkpoint as llama.cpp's converter
//! writes them: renamed and changed by the family's [`GgufTable`] read
//! forwards (the loader reads it backwards), in the converter's order (the
//! shard files by name, each file's tensor names sorted, each giving its
//! GGUF tensors in turn; a layer's per-expert tensors held back and written
//! as stacked `ffn_*_exps` where its last one comes), with the converter's
//! shapes and float types.

use std::path::Path;

use metrale_core::quant::GgmlType;
use metrale_model_weights::loader::{Checkpoint, GgufTransform, RowRun};

use crate::config::{ModelConfig, ModelType};
use crate::error::{EngineError, Result};
use crate::gguf::GgufTable;

/// One GGUF tensor made from one checkpoint tensor, or from one per expert
/// (a stacked `ffn_*_exps`).
#[derive(Clone, Debug)]
pub(super) struct HfTensor {
    /// The GGUF name.
    pub name: String,
    /// Row-major, as the converter stores it.
    pub shape: Vec<usize>,
    /// The checkpoint tensors it comes from: one, or every expert's in
    /// expert order (stacked along a new outermost axis, `torch.stack`).
    pub hf: Vec<String>,
    /// The shape of each of `hf`.
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
    /// `w + 1` (Qwen3-Next's zero-centred norm weights).
    PlusOne,
    /// Part `index` of `parts` equal parts along `axis` (`torch.split`).
    Part {
        axis: usize,
        index: usize,
        parts: usize,
    },
    /// Output `part` of a regrouped fused projection: the source's rows are
    /// `runs` in order, and the runs of this part go to their `start`
    /// (the inverse of the loader's [`GgufTransform::Gather`]).
    Scatter { part: usize, runs: Vec<RowRun> },
}

/// Checkpoint names the converter drops.
fn skipped(name: &str) -> bool {
    name.ends_with(".attention.masked_bias")
        || name.ends_with(".attention.bias")
        || name.ends_with(".rotary_emb.inv_freq")
}

/// The converter's shape for a tensor it stores under `gguf` (Mamba-2's
/// `modify_tensors`: the conv weight squeezed, `A` and `D` given a trailing
/// 1, the norm weight as `[n_groups, d_inner / n_groups]`; Qwen3-Next
/// squeezes the conv weight only).
fn converted_shape(gguf: &str, shape: &[usize], c: &ModelConfig) -> Vec<usize> {
    let base = gguf.rsplit_once('.').map_or(gguf, |(_, b)| b);
    if gguf.ends_with("ssm_conv1d.weight") {
        return shape.iter().copied().filter(|&d| d != 1).collect();
    }
    let mamba2 = c.model_type != ModelType::Qwen3Next;
    if mamba2 && (base == "ssm_a" || base == "ssm_d") {
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

fn config_err(dir: &Path, detail: String) -> EngineError {
    EngineError::Config {
        path: dir.to_path_buf(),
        detail,
    }
}

/// Every GGUF tensor the checkpoint gives, in the converter's order.
pub(super) fn plan(
    ckpt: &Checkpoint,
    table: &GgufTable,
    config: &ModelConfig,
    dir: &Path,
) -> Result<Vec<HfTensor>> {
    // The converter's order: the shard files by name, then each file's
    // tensors by name.
    let mut names: Vec<(std::path::PathBuf, String, Vec<usize>)> = ckpt
        .entries()
        .map(|(f, e)| (f.path.clone(), e.name.clone(), e.shape.clone()))
        .collect();
    names.sort();
    let mut out = Vec::new();
    let mut stacks = Stacks::default();
    for (_, hf, hf_shape) in names {
        if skipped(&hf) {
            continue;
        }
        let Some((gguf, transform)) = table.source(&hf, config) else {
            return Err(config_err(
                dir,
                format!(
                    "tensor {hf:?}: no GGUF name is known for it in a {} model",
                    config.model_type.as_str()
                ),
            ));
        };
        if let GgufTransform::Slice { index, count } = transform {
            // The converter holds a layer's experts back until it has them
            // all, then writes the stacks where the last one came.
            let name = gguf.into_iter().next().unwrap_or_default();
            stacks.add(&name, &hf, &hf_shape, index, count, dir)?;
            out.extend(stacks.take_complete(&name));
            continue;
        }
        let parts = gguf.len();
        for (index, name) in gguf.into_iter().enumerate() {
            let forward = forward(&transform, index, parts, &hf, &hf_shape, dir)?;
            let shape = forward_shape(&forward, &hf_shape);
            let shape = converted_shape(&name, &shape, config);
            out.push(HfTensor {
                name,
                shape,
                hf: vec![hf.clone()],
                hf_shape: hf_shape.clone(),
                forward,
            });
        }
    }
    stacks.finish(dir)?;
    Ok(out)
}

/// The forward change of part `index` of `parts` for the loader's
/// `transform` of checkpoint tensor `hf`.
fn forward(
    transform: &GgufTransform,
    index: usize,
    parts: usize,
    hf: &str,
    hf_shape: &[usize],
    dir: &Path,
) -> Result<Forward> {
    let rows = hf_shape.first().copied().unwrap_or(0);
    Ok(match transform {
        GgufTransform::Identity | GgufTransform::Reshape => Forward::Same,
        GgufTransform::UnpermuteRows { n_heads } => {
            if *n_heads == 0 || !rows.is_multiple_of(2 * n_heads) {
                return Err(config_err(
                    dir,
                    format!(
                        "tensor {hf:?}: {rows} rows cannot be split into {n_heads} heads of two \
                         rope halves"
                    ),
                ));
            }
            Forward::PermuteRows { n_heads: *n_heads }
        }
        GgufTransform::ALogFromA => Forward::NegExp,
        GgufTransform::MinusOne => Forward::PlusOne,
        GgufTransform::Concat { axis } => {
            let fits = hf_shape.get(*axis).is_some_and(|d| d.is_multiple_of(parts));
            if !fits {
                return Err(config_err(
                    dir,
                    format!(
                        "tensor {hf:?} of shape {hf_shape:?} cannot be split into {parts} parts \
                         along axis {axis}"
                    ),
                ));
            }
            Forward::Part {
                axis: *axis,
                index,
                parts,
            }
        }
        GgufTransform::Gather(runs) => {
            let total: usize = runs.iter().map(|r| r.len).sum();
            if total != rows || hf_shape.len() != 2 {
                return Err(config_err(
                    dir,
                    format!(
                        "tensor {hf:?} of shape {hf_shape:?}: the config gives {total} fused rows"
                    ),
                ));
            }
            Forward::Scatter {
                part: index,
                runs: runs.clone(),
            }
        }
        // Handled by the caller (the stacks).
        GgufTransform::Slice { .. } => {
            return Err(EngineError::Internal(format!(
                "tensor {hf:?}: an expert slice planned as a tensor"
            )));
        }
    })
}

/// The shape of a forward change's output, before the converter's reshapes.
fn forward_shape(forward: &Forward, hf_shape: &[usize]) -> Vec<usize> {
    let mut shape = hf_shape.to_vec();
    match forward {
        Forward::Part { axis, parts, .. } => shape[*axis] /= parts,
        Forward::Scatter { part, runs } => {
            shape[0] = (runs.iter().filter(|r| r.source == *part))
                .map(|r| r.start + r.len)
                .max()
                .unwrap_or(0);
        }
        _ => {}
    }
    shape
}

/// Experts waiting to be stacked, per GGUF name.
#[derive(Default)]
struct Stacks {
    pending: Vec<Stack>,
}

struct Stack {
    name: String,
    hf: Vec<Option<String>>,
    hf_shape: Vec<usize>,
}

impl Stacks {
    fn add(
        &mut self,
        name: &str,
        hf: &str,
        hf_shape: &[usize],
        index: usize,
        count: usize,
        dir: &Path,
    ) -> Result<()> {
        let i = match self.pending.iter().position(|s| s.name == name) {
            Some(i) => i,
            None => {
                self.pending.push(Stack {
                    name: name.to_string(),
                    hf: vec![None; count],
                    hf_shape: hf_shape.to_vec(),
                });
                self.pending.len() - 1
            }
        };
        let s = &mut self.pending[i];
        if s.hf_shape != hf_shape {
            return Err(config_err(
                dir,
                format!(
                    "tensor {hf:?} of shape {hf_shape:?}: the other experts of {name} are {:?}",
                    s.hf_shape
                ),
            ));
        }
        match s.hf.get_mut(index) {
            Some(slot @ None) => *slot = Some(hf.to_string()),
            Some(Some(other)) => {
                return Err(config_err(
                    dir,
                    format!("tensors {other:?} and {hf:?} are the same expert of {name}"),
                ));
            }
            None => {
                return Err(config_err(
                    dir,
                    format!("tensor {hf:?}: expert {index} of a model of {count} experts"),
                ));
            }
        }
        Ok(())
    }

    /// The stacks of `name`'s layer, once every one of them is complete
    /// (as the converter: all the layer's expert tensors seen), in the
    /// converter's order (by matrix name: down, gate, up).
    fn take_complete(&mut self, name: &str) -> Vec<HfTensor> {
        let layer = layer_of(name);
        let mine = |s: &Stack| layer_of(&s.name) == layer;
        let done = |s: &Stack| s.hf.iter().all(Option::is_some);
        if !self.pending.iter().filter(|s| mine(s)).all(done) {
            return Vec::new();
        }
        let (mut ready, rest): (Vec<Stack>, Vec<Stack>) =
            self.pending.drain(..).partition(|s| mine(s));
        self.pending = rest;
        ready.sort_by(|a, b| a.name.cmp(&b.name));
        (ready.into_iter())
            .map(|s| HfTensor {
                shape: [s.hf.len()].into_iter().chain(s.hf_shape.clone()).collect(),
                name: s.name,
                hf: s.hf.into_iter().flatten().collect(),
                hf_shape: s.hf_shape,
                forward: Forward::Same,
            })
            .collect()
    }

    /// Fails if some experts were never completed (the converter's
    /// "Unprocessed experts").
    fn finish(self, dir: &Path) -> Result<()> {
        match self.pending.first() {
            None => Ok(()),
            Some(s) => {
                let missing: Vec<usize> = (s.hf.iter().enumerate())
                    .filter(|(_, h)| h.is_none())
                    .map(|(i, _)| i)
                    .collect();
                Err(config_err(
                    dir,
                    format!("{}: experts {missing:?} are missing", s.name),
                ))
            }
        }
    }
}

/// `blk.{i}.` of a GGUF tensor name.
fn layer_of(name: &str) -> &str {
    let end = (name.match_indices('.').nth(1)).map_or(name.len(), |(i, _)| i + 1);
    &name[..end]
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

/// A tensor to be written must have dimensions, none of them zero: a
/// scalar or an empty tensor is no weight llama.cpp (or metrale) loads.
pub(super) fn check_shape(path: &Path, name: &str, shape: &[usize]) -> Result<()> {
    let problem = if shape.is_empty() {
        "has no dimensions"
    } else if shape.contains(&0) {
        "has no elements"
    } else {
        return Ok(());
    };
    Err(super::export_err(
        path,
        format!("tensor {name:?} {problem} (shape {shape:?}); it is not written"),
    ))
}

/// Applies `t.forward` to the checkpoint tensors' values `src` (f32, of
/// `t.hf_shape`, the experts one after the other).
pub(super) fn apply(t: &HfTensor, mut src: Vec<f32>) -> Vec<f32> {
    match &t.forward {
        Forward::Same => src,
        Forward::NegExp => {
            src.iter_mut().for_each(|x| *x = -x.exp());
            src
        }
        Forward::PlusOne => {
            src.iter_mut().for_each(|x| *x += 1.0);
            src
        }
        Forward::Scatter { part, runs } => {
            scatter(&src, t.hf_shape.first().copied().unwrap_or(1), *part, runs)
        }
        &Forward::PermuteRows { n_heads } => {
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
        &Forward::Part { axis, index, parts } => {
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

/// The rows of output `part` of a fused `rows`-row tensor whose rows are
/// `runs` in order.
fn scatter(src: &[f32], rows: usize, part: usize, runs: &[RowRun]) -> Vec<f32> {
    let row = src.len() / rows.max(1);
    let out_rows = (runs.iter().filter(|r| r.source == part))
        .map(|r| r.start + r.len)
        .max()
        .unwrap_or(0);
    let mut out = vec![0f32; out_rows * row];
    let mut at = 0;
    for r in runs {
        if r.source == part {
            out[r.start * row..(r.start + r.len) * row]
                .copy_from_slice(&src[at * row..(at + r.len) * row]);
        }
        at += r.len;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(forward: Forward, hf_shape: Vec<usize>) -> HfTensor {
        HfTensor {
            name: "x".into(),
            shape: vec![],
            hf: vec!["x".into()],
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
        assert_eq!(apply(&t(Forward::PlusOne, vec![1]), vec![0.5]), [1.5]);
    }

    #[test]
    fn qkvz_rows_regroup_as_the_converter_does() {
        // Two key groups of one-row q, k, v, z: HF rows [q0 k0 v0 z0 q1 k1
        // v1 z1] become attn_qkv [q0 q1 k0 k1 v0 v1] and attn_gate [z0 z1].
        let run = |source, start| RowRun {
            source,
            start,
            len: 1,
        };
        let runs: Vec<RowRun> = (0..2)
            .flat_map(|g| [run(0, g), run(0, 2 + g), run(0, 4 + g), run(1, g)])
            .collect();
        let hf: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let part = |part| Forward::Scatter {
            part,
            runs: runs.clone(),
        };
        let qkv = apply(&t(part(0), vec![8, 1]), hf.clone());
        assert_eq!(qkv, [0., 4., 1., 5., 2., 6.]);
        assert_eq!(forward_shape(&part(0), &[8, 1]), [6, 1]);
        assert_eq!(apply(&t(part(1), vec![8, 1]), hf), [3., 7.]);
    }

    #[test]
    fn experts_are_stacked_once_the_layer_has_them_all() {
        let dir = Path::new("x");
        let mut s = Stacks::default();
        // The converter's order: by name, so expert by expert.
        for e in 0..2 {
            for m in ["down", "up"] {
                let name = format!("blk.3.ffn_{m}_exps.weight");
                let hf = format!("backbone.layers.3.mixer.experts.{e}.{m}_proj.weight");
                s.add(&name, &hf, &[4, 2], e, 2, dir).unwrap();
                let ready = s.take_complete(&name);
                if (e, m) != (1, "up") {
                    assert!(ready.is_empty(), "{e} {m}");
                    continue;
                }
                let names: Vec<&str> = ready.iter().map(|t| t.name.as_str()).collect();
                assert_eq!(
                    names,
                    ["blk.3.ffn_down_exps.weight", "blk.3.ffn_up_exps.weight"]
                );
                assert_eq!(ready[0].shape, [2, 4, 2]);
                assert_eq!(ready[1].hf.len(), 2);
            }
        }
        s.finish(dir).unwrap();
        let mut s = Stacks::default();
        s.add("blk.0.ffn_up_exps.weight", "a", &[1], 1, 2, dir)
            .unwrap();
        let e = s.finish(dir).unwrap_err().to_string();
        assert!(e.contains("experts [0] are missing"), "{e}");
        assert_eq!(layer_of("blk.12.ffn_up_exps.weight"), "blk.12.");
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
