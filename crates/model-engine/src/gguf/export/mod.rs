//! Writing GGUF files llama.cpp loads: `metrale quantize`.
//!
//! From a Hugging Face checkpoint directory, a float target (`f32`, `f16`,
//! `bf16`) gives the file llama.cpp's `convert_hf_to_gguf.py --outtype
//! <T>` writes: its metadata ([`meta`], [`vocab`]), its tensor names,
//! changes, order and types ([`tensors`]). A quantized target gives what
//! `convert_hf_to_gguf.py --outtype f32` followed by `llama-quantize <T>`
//! gives: every quantizable tensor quantized from the f32 values with the
//! type [`choose_types`] picks, in llama-quantize's order, with its
//! `general.file_type`. From a float GGUF file, any target is
//! llama-quantize's requantization: metadata copied, the file type updated.
//!
//! The output is written tensor by tensor to a temporary file beside
//! `OUT`, renamed to `OUT` only once complete: a failed run leaves no
//! partial file.
//!
//! `general.name` is the checkpoint directory's name and
//! `general.size_label` is not written (the converter derives both from
//! the model card and the parameter count; llama.cpp reads neither).

mod faithful;
mod meta;
mod pre_hashes;
mod tensors;
mod vocab;

use std::path::{Path, PathBuf};

use metrale_core::quant::{GgmlType, dequantize_row};
use metrale_model_weights::gguf::mix::{FileType, MixParams, MixTensor, choose_types, llama_order};
use metrale_model_weights::gguf::{ALIGNMENT_KEY, GgufFile, GgufValue, GgufWriter};
use metrale_model_weights::loader::Checkpoint;
use serde_json::{Map, Value};

pub use vocab::{known_pre_tokenizer, pre_tokenizer_hash};

use crate::config::{ModelConfig, ModelType};

/// The SHA-256 digest of `data` as 64 lowercase hex digits (llama.cpp's
/// converter names pre-tokenizers by such a hash; the tests compare tensors
/// with recorded ones).
pub fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
use crate::error::{EngineError, Result};
use tensors::{HfTensor, check_shape};

/// Metadata in file order, with gguf-py's rule: a key written again keeps
/// its place.
#[derive(Default)]
pub(crate) struct Meta {
    arch: String,
    entries: Vec<(String, GgufValue)>,
    /// Where the file departs from what llama.cpp's converter would write
    /// ([`faithful`]), for [`QuantizeSummary::notes`].
    notes: Vec<String>,
}

impl Meta {
    /// Sets `{arch}.{key}`.
    fn put(&mut self, key: &str, v: GgufValue) {
        let key = format!("{}.{key}", self.arch);
        self.put_full(&key, v);
    }

    fn get(&self, key: &str) -> Option<&GgufValue> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    fn put_full(&mut self, key: &str, v: GgufValue) {
        match self.entries.iter_mut().find(|(k, _)| k == key) {
            Some(e) => e.1 = v,
            None => self.entries.push((key.to_string(), v)),
        }
    }

    /// llama.cpp's `gguf_set_val_*`: the key moves to the end.
    fn set_last(&mut self, key: &str, v: GgufValue) {
        self.entries.retain(|(k, _)| k != key);
        self.entries.push((key.to_string(), v));
    }
}

/// What to write.
#[derive(Clone, Debug)]
pub struct QuantizeOptions {
    pub ftype: FileType,
    /// The `tokenizer.ggml.pre` to write when exporting a checkpoint whose
    /// pre-tokenizer llama.cpp's table does not know (or to override it).
    pub pre_tokenizer: Option<String>,
}

/// Progress of [`quantize`].
#[derive(Clone, Debug)]
pub enum QuantizeEvent {
    Start {
        tensors: usize,
        elements: u64,
    },
    Tensor {
        index: usize,
        tensors: usize,
        name: String,
        ty: GgmlType,
        elements: u64,
    },
}

/// What [`quantize`] wrote.
#[derive(Clone, Debug)]
pub struct QuantizeSummary {
    pub tensors: usize,
    pub bytes: u64,
    /// How many tensors of each type.
    pub types: Vec<(GgmlType, usize)>,
    /// Where the file departs from what llama.cpp's converter would write,
    /// so that it runs as the checkpoint does (each says what and why).
    pub notes: Vec<String>,
}

enum Src {
    Hf(HfTensor),
    Gguf,
}

struct Planned {
    name: String,
    /// Row-major.
    shape: Vec<usize>,
    from: GgmlType,
    to: GgmlType,
    src: Src,
}

fn export_err(path: &Path, detail: impl Into<String>) -> EngineError {
    EngineError::Export {
        path: path.to_path_buf(),
        detail: detail.into(),
    }
}

/// The `general.architecture` llama.cpp's converter gives a model type
/// (`moe_keys`: the config has `num_experts_per_tok`, which makes the
/// converter take a Nemotron-H for `nemotron_h_moe`).
fn gguf_arch(t: ModelType, moe_keys: bool) -> Option<&'static str> {
    Some(match t {
        ModelType::Qwen35 | ModelType::Qwen35Moe | ModelType::Lfm2 | ModelType::Lfm2Moe => {
            return None;
        }
        ModelType::Llama | ModelType::Mistral => "llama",
        ModelType::Qwen2 => "qwen2",
        ModelType::Qwen3 => "qwen3",
        ModelType::Mamba2 => "mamba2",
        ModelType::Bamba | ModelType::GraniteMoeHybrid => "granitehybrid",
        ModelType::NemotronH if moe_keys => "nemotron_h_moe",
        ModelType::NemotronH => "nemotron_h",
        ModelType::Qwen3Next => "qwen3next",
    })
}

fn ne(shape: &[usize]) -> Vec<usize> {
    shape.iter().rev().copied().collect()
}

/// Writes `output` from `input` (a checkpoint directory or a float GGUF
/// file) as `opts` says; see the module docs.
pub fn quantize(
    input: &Path,
    output: &Path,
    opts: &QuantizeOptions,
    progress: &mut dyn FnMut(QuantizeEvent),
) -> Result<QuantizeSummary> {
    // Anything but a directory is read as a GGUF file, whose opening
    // refuses a FIFO or a device by name (`is_file` sent them to the
    // directory reader, to fail on a missing config.json).
    let gguf_in = !input.is_dir();
    let file = if gguf_in {
        Some(GgufFile::open(input)?)
    } else {
        None
    };
    let (meta, plan, ckpt) = match &file {
        Some(f) => {
            let (m, p) = plan_gguf(f, opts)?;
            (m, p, None)
        }
        None => {
            let (m, p, c) = plan_dir(input, opts)?;
            (m, p, Some(c))
        }
    };
    let mut w = GgufWriter::new();
    let notes = meta.notes;
    for (k, v) in meta.entries {
        match (k.as_str(), &v) {
            (ALIGNMENT_KEY, GgufValue::U32(a)) => w.set_alignment(*a),
            _ => w.add(k, v),
        };
    }
    for t in &plan {
        w.add_tensor_info(&t.name, t.to, &t.shape);
    }
    let tmp = temp_path(output);
    let result = write(&w, &plan, &tmp, file.as_ref(), ckpt.as_ref(), progress);
    match result {
        Ok(summary) => {
            let summary = QuantizeSummary { notes, ..summary };
            std::fs::rename(&tmp, output).map_err(|source| {
                let _ = std::fs::remove_file(&tmp);
                EngineError::Weights(metrale_model_weights::WeightsError::Io {
                    path: output.to_path_buf(),
                    source,
                })
            })?;
            Ok(summary)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// The temporary file [`quantize`] writes before renaming it to `output`:
/// `.OUT.tmp-<pid>` beside it (a caller interrupted mid-write removes it).
pub fn temp_path(output: &Path) -> PathBuf {
    let name = output
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out.gguf".into());
    output.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

fn write(
    w: &GgufWriter,
    plan: &[Planned],
    tmp: &Path,
    file: Option<&GgufFile>,
    ckpt: Option<&Checkpoint>,
    progress: &mut dyn FnMut(QuantizeEvent),
) -> Result<QuantizeSummary> {
    let elements = |t: &Planned| t.shape.iter().product::<usize>() as u64;
    progress(QuantizeEvent::Start {
        tensors: plan.len(),
        elements: plan.iter().map(elements).sum(),
    });
    let mut stream = w.stream(tmp)?;
    let mut bytes = 0u64;
    let mut types: Vec<(GgmlType, usize)> = Vec::new();
    for (index, t) in plan.iter().enumerate() {
        let data = tensor_bytes(t, file, ckpt)?;
        stream.write_tensor(&t.name, &data)?;
        bytes += data.len() as u64;
        match types.iter_mut().find(|(ty, _)| *ty == t.to) {
            Some(e) => e.1 += 1,
            None => types.push((t.to, 1)),
        }
        progress(QuantizeEvent::Tensor {
            index,
            tensors: plan.len(),
            name: t.name.clone(),
            ty: t.to,
            elements: elements(t),
        });
    }
    stream.finish()?;
    Ok(QuantizeSummary {
        tensors: plan.len(),
        bytes,
        types,
        notes: Vec::new(),
    })
}

/// The bytes of one output tensor (borrowed from the input file when it
/// keeps its type).
fn tensor_bytes<'a>(
    t: &Planned,
    file: Option<&'a GgufFile>,
    ckpt: Option<&Checkpoint>,
) -> Result<std::borrow::Cow<'a, [u8]>> {
    use std::borrow::Cow;
    let (values, path) = match (&t.src, file, ckpt) {
        (Src::Gguf, Some(f), _) => {
            let src = f.tensor(&t.name)?;
            if t.from == t.to {
                return Ok(Cow::Borrowed(src.data));
            }
            let mut v = vec![0f32; t.shape.iter().product()];
            dequantize_row(t.from, src.data, &mut v)
                .map_err(|e| export_err(f.path(), format!("tensor {:?}: {e}", t.name)))?;
            (v, f.path())
        }
        (Src::Hf(h), _, Some(c)) => {
            // Stacked experts: the experts' values one after the other.
            let mut values = Vec::new();
            for name in &h.hf {
                values.extend(read_f32(c, name)?);
            }
            (tensors::apply(h, values), c.source.as_path())
        }
        _ => return Err(EngineError::Internal("tensor source mismatch".into())),
    };
    encode(path, &t.name, &t.shape, t.to, &values).map(Cow::Owned)
}

/// `values` as rows of `ty` (rows are `shape`'s last dimension), quantized
/// on every core. A row that is not a whole number of blocks is the
/// input's fault (`path`), not an internal error.
fn encode(
    path: &Path,
    name: &str,
    shape: &[usize],
    ty: GgmlType,
    values: &[f32],
) -> Result<Vec<u8>> {
    let row = shape.last().copied().unwrap_or(1);
    metrale_core::quant::quantize_rows(ty, values, row)
        .map_err(|e| export_err(path, format!("tensor {name:?}: {e}")))
}

/// A checkpoint tensor's values as f32.
fn read_f32(ckpt: &Checkpoint, name: &str) -> Result<Vec<f32>> {
    let Some((file, entry)) = ckpt.find(name) else {
        return Err(EngineError::Internal(format!("tensor {name:?} vanished")));
    };
    let Some(dtype) = entry.dtype.weight_dtype() else {
        return Err(export_err(
            &file.path,
            format!(
                "tensor {name:?} is {}; only F32, F16 and BF16 tensors are exported",
                entry.dtype.name()
            ),
        ));
    };
    let mut buf = vec![0u8; entry.end - entry.start];
    file.read(entry, 0, &mut buf)?;
    // Decoded in one pass (a large tensor is held twice at most: its bytes
    // and its f32 values).
    Ok(metrale_model_weights::loader::widen(&buf, dtype))
}

fn read_config_json(dir: &Path) -> Result<Map<String, Value>> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|source| {
        EngineError::Weights(metrale_model_weights::WeightsError::Io {
            path: path.clone(),
            source,
        })
    })?;
    match serde_json::from_str(&text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(export_err(&path, "is not a JSON object")),
        Err(e) => Err(export_err(&path, e.to_string())),
    }
}

/// The token count the family's converter writes: the config's vocab
/// size, padded by the Mamba-2 family's converters.
fn padded_vocab(c: &ModelConfig, hp: &Map<String, Value>, has_ssm: bool) -> usize {
    let pad = match c.model_type {
        ModelType::Mamba2 => hp
            .get("pad_vocab_size_multiple")
            .and_then(Value::as_u64)
            .unwrap_or(16) as usize,
        ModelType::Bamba | ModelType::GraniteMoeHybrid if has_ssm => 8,
        ModelType::NemotronH => 8,
        _ => 1,
    };
    c.vocab_size.div_ceil(pad.max(1)) * pad.max(1)
}

/// A Nemotron-H config with MoE keys is converted as `nemotron_h_moe`,
/// where llama.cpp's converter takes only `E` layers for feed-forward
/// layers: a dense (`-`) layer there would be written as no layer at all.
fn nemotron_moe_check(config: &ModelConfig, path: &Path) -> Result<()> {
    let dense = (config.layers.iter().enumerate())
        .filter(|(_, l)| l.ffn == crate::config::FfnKind::Mlp)
        .map(|(i, _)| i)
        .collect::<Vec<_>>();
    if config.moe.is_none() || !dense.is_empty() {
        return Err(export_err(
            path,
            format!(
                "a Nemotron-H config with MoE keys (num_experts_per_tok) is converted by \
                 llama.cpp as nemotron_h_moe, which takes only MoE feed-forward layers; this one \
                 has dense feed-forward layers {dense:?} (drop the MoE keys to export it as \
                 nemotron_h)"
            ),
        ));
    }
    Ok(())
}

/// The metadata and tensors of a checkpoint directory's export.
fn plan_dir(dir: &Path, opts: &QuantizeOptions) -> Result<(Meta, Vec<Planned>, Checkpoint)> {
    let config = crate::config::load_config(dir)?;
    let hp_map = read_config_json(dir)?;
    let config_path = dir.join("config.json");
    let moe_keys = hp_map.contains_key("num_experts_per_tok");
    let Some(arch) = gguf_arch(config.model_type, moe_keys) else {
        return Err(export_err(
            &config_path,
            format!(
                "{} models are not exported to GGUF yet",
                config.model_type.as_str()
            ),
        ));
    };
    if config.model_type == ModelType::NemotronH && moe_keys {
        nemotron_moe_check(&config, &config_path)?;
    }
    let has_ssm = config.mamba.is_some();
    if matches!(
        config.model_type,
        ModelType::Bamba | ModelType::GraniteMoeHybrid
    ) && !has_ssm
    {
        return Err(export_err(
            &config_path,
            "a Granite hybrid without Mamba layers is converted as granite/granitemoe, which \
             metrale does not export",
        ));
    }
    let prefixes: &'static [&'static str] = match config.model_type {
        ModelType::Bamba | ModelType::GraniteMoeHybrid | ModelType::NemotronH => &["mamba"],
        _ => &[],
    };
    let hp = meta::Hparams {
        map: &hp_map,
        prefixes,
        path: &config_path,
    };
    let outtype = match opts.ftype {
        FileType::F16 => GgmlType::F16,
        FileType::BF16 => GgmlType::BF16,
        _ => GgmlType::F32,
    };
    // A quantized target is `--outtype f32` then llama-quantize.
    let convert_ftype = if opts.ftype.is_quantized() {
        FileType::F32
    } else {
        opts.ftype
    };
    let mut m = Meta {
        arch: arch.to_string(),
        ..Meta::default()
    };
    m.put_full("general.architecture", GgufValue::String(arch.into()));
    m.put_full("general.type", GgufValue::String("model".into()));
    let name = dir
        .canonicalize()
        .ok()
        .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_default();
    m.put_full("general.name", GgufValue::String(name));
    meta::arch_keys(&mut m, config.model_type, &hp, convert_ftype.ftype_id())?;
    if matches!(
        config.model_type,
        ModelType::Bamba | ModelType::GraniteMoeHybrid
    ) {
        let theirs = meta::granite_attention_layers(&hp, config.num_layers() as u64)?;
        faithful::granite_hybrid(&mut m, &config, &hp, &theirs)?;
    }
    m.put_full("general.quantization_version", GgufValue::U32(2));
    if matches!(config.model_type, ModelType::Llama | ModelType::Mistral)
        && let Ok(text) = std::fs::read_to_string(dir.join("tokenizer_config.json"))
        && let Ok(tc) = serde_json::from_str::<Value>(&text)
        && let Some(b) = tc.get("add_prefix_space").and_then(Value::as_bool)
    {
        m.put_full("tokenizer.ggml.add_space_prefix", GgufValue::Bool(b));
    }
    let vocab = padded_vocab(&config, &hp_map, has_ssm);
    vocab::tokenizer_keys(&mut m, dir, vocab, opts.pre_tokenizer.as_deref())?;

    let ckpt = Checkpoint::open(dir)?;
    let table = super::table(&config)?;
    let hf = tensors::plan(&ckpt, table, &config, dir)?;
    for h in &hf {
        let file =
            h.hf.first()
                .and_then(|n| ckpt.find(n))
                .map(|(f, _)| &f.path);
        check_shape(file.unwrap_or(&ckpt.source), &h.name, &h.shape)?;
    }
    let mut plan: Vec<Planned> = hf
        .into_iter()
        .map(|h| {
            let ty = tensors::converter_type(&h.name, &h.shape, outtype);
            Planned {
                name: h.name.clone(),
                shape: h.shape.clone(),
                from: ty,
                to: ty,
                src: Src::Hf(h),
            }
        })
        .collect();
    if opts.ftype.is_quantized() {
        let params = MixParams {
            n_layer: config.num_layers(),
            n_expert: config.moe.as_ref().map_or(0, |m| m.n_experts),
        };
        requantize(&mut m, &mut plan, &params, opts.ftype, &config_path)?;
    }
    Ok((m, plan, ckpt))
}

/// llama-quantize on a planned file: types chosen, llama.cpp's order, the
/// file type and quantization version set.
fn requantize(
    m: &mut Meta,
    plan: &mut [Planned],
    params: &MixParams,
    ftype: FileType,
    path: &Path,
) -> Result<()> {
    // llama.cpp writes `ggml_n_dims` dimensions: trailing (outermost)
    // sizes of 1 are dropped.
    for t in plan.iter_mut() {
        while t.shape.len() > 1 && t.shape[0] == 1 {
            t.shape.remove(0);
        }
    }
    let nes: Vec<Vec<usize>> = plan.iter().map(|t| ne(&t.shape)).collect();
    let mix: Vec<MixTensor> = (plan.iter().zip(&nes))
        .map(|(t, ne)| MixTensor {
            name: &t.name,
            ne,
            ty: t.from,
        })
        .collect();
    let types = choose_types(&mix, params, ftype);
    for (t, to) in plan.iter_mut().zip(types) {
        if to != t.from && t.from.is_quantized() {
            return Err(export_err(
                path,
                format!(
                    "tensor {:?} is already quantized ({}); it is not requantized to {} (only \
                     float tensors are quantized)",
                    t.name,
                    t.from.name(),
                    to.name()
                ),
            ));
        }
        t.to = to;
    }
    plan.sort_by(|a, b| llama_order(&a.name, &b.name));
    m.set_last("general.quantization_version", GgufValue::U32(2));
    m.set_last("general.file_type", GgufValue::U32(ftype.ftype_id()));
    for k in ["split.no", "split.count", "split.tensors.count"] {
        m.entries.retain(|(key, _)| key != k);
    }
    Ok(())
}

/// Requantizing a GGUF file.
fn plan_gguf(f: &GgufFile, opts: &QuantizeOptions) -> Result<(Meta, Vec<Planned>)> {
    let arch = f.architecture()?.to_string();
    let mut m = Meta {
        arch: arch.clone(),
        entries: f.metadata().to_vec(),
        notes: Vec::new(),
    };
    let params = MixParams {
        n_layer: f.get_u32(&format!("{arch}.block_count"))? as usize,
        n_expert: f.opt_u32(&format!("{arch}.expert_count"))?.unwrap_or(0) as usize,
    };
    let mut plan: Vec<Planned> = (f.tensor_infos().iter())
        .map(|t| Planned {
            name: t.name.clone(),
            shape: t.shape.clone(),
            from: t.ggml_type,
            to: t.ggml_type,
            src: Src::Gguf,
        })
        .collect();
    for t in &plan {
        check_shape(f.path(), &t.name, &t.shape)?;
        if !matches!(t.from, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
            && !t.from.is_quantized()
        {
            return Err(export_err(
                f.path(),
                format!(
                    "tensor {:?} is {}, which is not quantized",
                    t.name,
                    t.from.name()
                ),
            ));
        }
    }
    requantize(&mut m, &mut plan, &params, opts.ftype, f.path())?;
    Ok((m, plan))
}

#[cfg(test)]
mod tests;
