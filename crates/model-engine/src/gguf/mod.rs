//! GGUF checkpoints (llama.cpp's format) as a model source.
//!
//! A GGUF file made by llama.cpp's `convert_hf_to_gguf.py` holds the
//! hyper-parameters as `{arch}.*` metadata keys, the tokenizer as
//! `tokenizer.ggml.*` keys, and the tensors under llama.cpp's names, some of
//! them changed. This module turns it back into what a Hugging Face
//! checkpoint directory gives the engine:
//! - [`config_json`]: the metadata as the `config.json` the converter read
//!   (a `serde_json::Value`), fed to the same validation
//!   ([`parse_config`](crate::config::parse_config)) as a directory's;
//! - [`expected_tensors`]: for each tensor the [`ModelConfig`] expects (by
//!   its Hugging Face name), the GGUF tensors it comes from and the
//!   transform that undoes the converter's change, from the family's table
//!   ([`GgufTable`], next to the family's Hugging Face names in `arch/`).
//!
//! Only unquantized tensors (F32, F16, BF16) load for now
//! ([`device_dtype`](metrale_model_weights::loader::device_dtype)).

use std::path::Path;

pub mod export;

use metrale_model_weights::gguf::GgufFile;
use metrale_model_weights::loader::{GgufExpected, GgufTransform};
use serde_json::Value;

use crate::arch;
use crate::config::{ModelConfig, ModelType, parse_config};
use crate::error::{EngineError, Result};

/// Where one Hugging Face tensor lies in a GGUF file.
#[derive(Clone, Copy, Debug)]
pub(crate) enum GgufName {
    /// Stored as is (size-1 dimensions aside).
    Same(&'static str),
    /// Stored reshaped (same elements in the same order, another shape:
    /// Mamba-2's grouped norm weight `[n_groups, d_inner / n_groups]`).
    Reshaped(&'static str),
    /// Rows permuted by `LlamaModel.permute` with the query head count.
    PermutedQ(&'static str),
    /// Rows permuted by `LlamaModel.permute` with the key/value head count.
    PermutedK(&'static str),
    /// `A_log` stored as `A = -exp(A_log)`.
    NegExp(&'static str),
    /// A fused Hugging Face tensor the converter split: the concatenation
    /// of these along `axis`.
    Split(&'static [&'static str], usize),
    /// Stored as `w + 1` (Qwen3-Next's zero-centred norm weights).
    PlusOne(&'static str),
    /// Qwen3-Next's `in_proj_qkvz`, stored regrouped as `attn_qkv` (every
    /// key group's q, then k, then v) and `attn_gate` (z).
    Qkvz {
        qkv: &'static str,
        gate: &'static str,
    },
    /// One expert of a stack (`ffn_gate_exps`): the group's key holds `*`
    /// where the Hugging Face name has the expert's number.
    Expert(&'static str),
}

/// HF name (after a group's prefix) to GGUF name (after `blk.{i}.`).
pub(crate) type GgufGroup = &'static [(&'static str, GgufName)];

/// A family's GGUF tensor names: groups of per-layer tensors, each under
/// the HF prefix its family gives the block (`mamba.`, `mixer.`,
/// `self_attn.`, ...) after the layer prefix (`model.layers.{i}.`), and
/// the whole-model tensors by full name. The blocks several families share
/// are [`MAMBA2`], [`ATTENTION`] and [`ATTENTION_PERMUTED`].
pub(crate) struct GgufTable {
    pub layer_prefix: &'static str,
    pub globals: GgufGroup,
    pub layer: &'static [(&'static str, GgufGroup)],
}

/// A Mamba-2 mixer as `Mamba2Model` stores it: `A_log` as `A =
/// -exp(A_log)` `[n_heads, 1]`, `D` as `[n_heads, 1]`, the conv weight
/// squeezed to `[conv_dim, kernel]`, the gated norm's weight as `[n_groups,
/// d_inner / n_groups]`.
pub(crate) const MAMBA2: GgufGroup = &[
    ("in_proj.weight", GgufName::Same("ssm_in.weight")),
    ("in_proj.bias", GgufName::Same("ssm_in.bias")),
    ("conv1d.weight", GgufName::Same("ssm_conv1d.weight")),
    ("conv1d.bias", GgufName::Same("ssm_conv1d.bias")),
    ("dt_bias", GgufName::Same("ssm_dt.bias")),
    ("A_log", GgufName::NegExp("ssm_a")),
    ("D", GgufName::Same("ssm_d")),
    ("norm.weight", GgufName::Reshaped("ssm_norm.weight")),
    ("out_proj.weight", GgufName::Same("ssm_out.weight")),
    ("out_proj.bias", GgufName::Same("ssm_out.bias")),
];

/// Attention projections stored as they are (Qwen 2/3).
pub(crate) const ATTENTION: GgufGroup = &[
    ("q_proj.weight", GgufName::Same("attn_q.weight")),
    ("k_proj.weight", GgufName::Same("attn_k.weight")),
    ("v_proj.weight", GgufName::Same("attn_v.weight")),
    ("o_proj.weight", GgufName::Same("attn_output.weight")),
    ("q_proj.bias", GgufName::Same("attn_q.bias")),
    ("k_proj.bias", GgufName::Same("attn_k.bias")),
    ("v_proj.bias", GgufName::Same("attn_v.bias")),
    ("o_proj.bias", GgufName::Same("attn_output.bias")),
];

/// Attention projections with q/k rows permuted by `LlamaModel.permute`
/// (Llama, Mistral, and the hybrids that inherit its `modify_tensors`).
pub(crate) const ATTENTION_PERMUTED: GgufGroup = &[
    ("q_proj.weight", GgufName::PermutedQ("attn_q.weight")),
    ("k_proj.weight", GgufName::PermutedK("attn_k.weight")),
    ("v_proj.weight", GgufName::Same("attn_v.weight")),
    ("o_proj.weight", GgufName::Same("attn_output.weight")),
    ("q_proj.bias", GgufName::PermutedQ("attn_q.bias")),
    ("k_proj.bias", GgufName::PermutedK("attn_k.bias")),
    ("v_proj.bias", GgufName::Same("attn_v.bias")),
    ("o_proj.bias", GgufName::Same("attn_output.bias")),
];

/// A gated MLP's three projections (`gate_proj`, `up_proj`, `down_proj`).
pub(crate) const GATED_MLP: GgufGroup = &[
    ("gate_proj.weight", GgufName::Same("ffn_gate.weight")),
    ("up_proj.weight", GgufName::Same("ffn_up.weight")),
    ("down_proj.weight", GgufName::Same("ffn_down.weight")),
    ("gate_proj.bias", GgufName::Same("ffn_gate.bias")),
    ("up_proj.bias", GgufName::Same("ffn_up.bias")),
    ("down_proj.bias", GgufName::Same("ffn_down.bias")),
];

impl GgufTable {
    /// The GGUF source of the Hugging Face tensor `hf`, if the table has it.
    fn source(&self, hf: &str, c: &ModelConfig) -> Option<(Vec<String>, GgufTransform)> {
        let (blk, entry, index) = match self.globals.iter().find(|(n, _)| *n == hf) {
            Some((_, g)) => (String::new(), *g, None),
            None => {
                let rest = hf.strip_prefix(self.layer_prefix)?;
                let (i, suffix) = rest.split_once('.')?;
                let i: usize = i.parse().ok()?;
                let (g, index) = self.layer.iter().find_map(|(prefix, group)| {
                    let name = suffix.strip_prefix(prefix)?;
                    group
                        .iter()
                        .find_map(|(n, g)| name_match(n, name).map(|index| (*g, index)))
                })?;
                (format!("blk.{i}."), g, index)
            }
        };
        let heads = |kv: bool| {
            c.attention
                .as_ref()
                .map_or(0, |a| if kv { a.n_kv_heads } else { a.n_heads })
        };
        let one = |n: &str| vec![format!("{blk}{n}")];
        Some(match entry {
            GgufName::Same(n) => (one(n), GgufTransform::Identity),
            GgufName::Reshaped(n) => (one(n), GgufTransform::Reshape),
            GgufName::PermutedQ(n) => (
                one(n),
                GgufTransform::UnpermuteRows {
                    n_heads: heads(false),
                },
            ),
            GgufName::PermutedK(n) => (
                one(n),
                GgufTransform::UnpermuteRows {
                    n_heads: heads(true),
                },
            ),
            GgufName::NegExp(n) => (one(n), GgufTransform::ALogFromA),
            GgufName::Split(parts, axis) => (
                parts.iter().map(|p| format!("{blk}{p}")).collect(),
                GgufTransform::Concat { axis },
            ),
            GgufName::PlusOne(n) => (one(n), GgufTransform::MinusOne),
            GgufName::Qkvz { qkv, gate } => {
                let d = c.deltanet.as_ref()?;
                (
                    vec![format!("{blk}{qkv}"), format!("{blk}{gate}")],
                    GgufTransform::Gather(qkvz_runs(d)),
                )
            }
            GgufName::Expert(n) => (
                one(n),
                GgufTransform::Slice {
                    index: index?,
                    count: c.moe.as_ref()?.n_experts,
                },
            ),
        })
    }
}

/// Whether the Hugging Face name suffix `name` is the table's `pattern`:
/// `Some(None)` when equal, `Some(Some(e))` when the pattern's `*` stands
/// for the number `e` in `name`.
fn name_match(pattern: &str, name: &str) -> Option<Option<usize>> {
    match pattern.split_once('*') {
        None => (pattern == name).then_some(None),
        Some((head, tail)) => {
            let digits = name.strip_prefix(head)?.strip_suffix(tail)?;
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            Some(Some(digits.parse().ok()?))
        }
    }
}

/// The rows of `in_proj_qkvz` (per key group: q, k, v, z) as runs of the
/// converter's `attn_qkv` (all q, all k, all v) and `attn_gate` (all z).
fn qkvz_runs(d: &crate::config::DeltaNetConfig) -> Vec<metrale_model_weights::loader::RowRun> {
    use metrale_model_weights::loader::RowRun;
    let (groups, dk) = (d.n_k_heads, d.k_head_dim);
    let dv = d.n_v_heads / groups.max(1) * d.v_head_dim;
    let run = |source, start, len| RowRun { source, start, len };
    (0..groups)
        .flat_map(|g| {
            [
                run(0, g * dk, dk),
                run(0, groups * dk + g * dk, dk),
                run(0, 2 * groups * dk + g * dv, dv),
                run(1, g * dv, dv),
            ]
        })
        .collect()
}

/// Where a model is read from: a Hugging Face checkpoint directory
/// (config.json, safetensors, tokenizer.json) or a GGUF file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    Dir(std::path::PathBuf),
    Gguf(std::path::PathBuf),
}

impl ModelSource {
    /// A `.gguf` file is a GGUF source; anything else a directory.
    pub fn from_path(path: &Path) -> Self {
        let gguf = path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
        if gguf && !path.is_dir() {
            Self::Gguf(path.to_path_buf())
        } else {
            Self::Dir(path.to_path_buf())
        }
    }

    pub fn path(&self) -> &Path {
        match self {
            Self::Dir(p) | Self::Gguf(p) => p,
        }
    }

    /// The validated config: a directory's config.json, or a GGUF file's
    /// metadata read as one.
    pub fn config(&self) -> Result<ModelConfig> {
        match self {
            Self::Dir(dir) => crate::config::load_config(dir),
            Self::Gguf(path) => Ok(GgufModel::open(path)?.config),
        }
    }

    /// The tokenizer: a directory's tokenizer.json (with its special-token
    /// configs), or the one a GGUF file's metadata describes.
    pub fn tokenizer(&self) -> Result<crate::tokenizer::Tokenizer> {
        match self {
            Self::Dir(dir) => crate::tokenizer::Tokenizer::from_dir(dir),
            Self::Gguf(path) => crate::tokenizer::Tokenizer::from_gguf(&GgufFile::open(path)?),
        }
    }

    /// The sampling defaults: a directory's generation_config.json; a GGUF
    /// file has none (the plain defaults).
    pub fn generation_defaults(&self) -> Result<crate::sampling::GenerationDefaults> {
        match self {
            Self::Dir(dir) => crate::sampling::GenerationDefaults::from_checkpoint(dir),
            Self::Gguf(_) => Ok(crate::sampling::GenerationDefaults::none()),
        }
    }

    /// The chat template: a directory's (see
    /// [`ChatTemplate::from_model_dir`](crate::chat::ChatTemplate::from_model_dir)),
    /// or a GGUF file's `tokenizer.chat_template` with its BOS/EOS texts.
    pub fn chat_template(&self) -> Result<crate::chat::ChatTemplate> {
        match self {
            Self::Dir(dir) => crate::chat::ChatTemplate::from_model_dir(dir),
            Self::Gguf(path) => {
                let file = GgufFile::open(path)?;
                let Some(source) = metrale_model_weights::gguf::chat_template(&file)? else {
                    return Err(EngineError::ChatTemplate(format!(
                        "{} has no chat template (no tokenizer.chat_template key)",
                        path.display()
                    )));
                };
                let source = source.to_string();
                let tokenizer = crate::tokenizer::Tokenizer::from_gguf(&file)?;
                let mut special = Vec::new();
                if let Some(bos) = tokenizer.bos_token() {
                    special.push(("bos_token".to_string(), bos.to_string()));
                }
                if let Some(eos) = tokenizer.eos_token() {
                    special.push(("eos_token".to_string(), eos));
                }
                crate::chat::ChatTemplate::new(source, special)
            }
        }
    }
}

/// A GGUF file read as a model: its config and where its tensors are.
pub struct GgufModel {
    pub file: GgufFile,
    /// The config.json equivalent of the metadata.
    pub config_json: Value,
    pub config: ModelConfig,
}

impl GgufModel {
    /// Opens `path`, rebuilds and validates its config.
    pub fn open(path: &Path) -> Result<Self> {
        let file = GgufFile::open(path)?;
        let config_json = config_json(&file)?;
        let mut config = parse_config(&config_json.to_string(), path)?;
        if matches!(config.model_type, ModelType::Qwen35 | ModelType::Qwen35Moe) {
            qwen35_layout(&file, &mut config)?;
        }
        Ok(Self {
            file,
            config_json,
            config,
        })
    }

    /// The tensors the config expects, each with its GGUF source.
    pub fn expected_tensors(&self) -> Result<Vec<GgufExpected>> {
        expected_tensors(&self.file, &self.config)
    }
}

/// What llama.cpp's converter changed in a Qwen3.5 file beyond the names:
/// the value heads come tiled over the key heads (`_LinearAttentionVReorderBase`:
/// every value-head-indexed row, column and vector in that order, which the
/// gated delta rule then reads as it is), and the multi-token prediction
/// layers are the blocks past the text layers, set aside.
fn qwen35_layout(file: &GgufFile, config: &mut ModelConfig) -> Result<()> {
    if let Some(d) = config.deltanet.as_mut() {
        d.tiled_v_heads = true;
    }
    let blocks = file.get_u32(&format!("{}.block_count", file.architecture()?))? as usize;
    let prefixes: Vec<String> = (config.num_layers()..blocks)
        .map(|i| format!("blk.{i}."))
        .collect();
    config.aside = vec![crate::config::AsideWeights {
        what: "multi-token prediction layers",
        prefixes,
        why: "they are for speculative decoding, which does not use them yet",
        expected: Vec::new(),
        warn: false,
    }];
    Ok(())
}

/// The family table of a model type.
fn table(c: &ModelConfig) -> Result<&'static GgufTable> {
    Ok(match c.model_type {
        ModelType::Llama | ModelType::Mistral => &arch::llama::GGUF_LLAMA,
        ModelType::Qwen2 | ModelType::Qwen3 => &arch::llama::GGUF_QWEN,
        ModelType::Mamba2 => &arch::mamba2::GGUF,
        ModelType::Bamba => &arch::bamba::GGUF,
        ModelType::NemotronH => &arch::nemotron_h::GGUF,
        ModelType::GraniteMoeHybrid if c.moe.is_some() => &arch::granite_hybrid::GGUF_MOE,
        ModelType::GraniteMoeHybrid => &arch::granite_hybrid::GGUF_DENSE,
        ModelType::Qwen3Next => &arch::qwen3_next::GGUF,
        ModelType::Qwen35 | ModelType::Qwen35Moe
            if c.names.embed.starts_with("model.language_model.") =>
        {
            &arch::qwen3_5::GGUF_WRAPPED
        }
        ModelType::Qwen35 | ModelType::Qwen35Moe => &arch::qwen3_5::GGUF_TEXT,
        ModelType::Lfm2 if c.names.embed.starts_with("model.language_model.") => {
            &arch::lfm2::GGUF_VL
        }
        ModelType::Lfm2 => &arch::lfm2::GGUF,
        ModelType::Lfm2Moe => &arch::lfm2::GGUF_MOE,
    })
}

/// Every tensor `config` expects, with its source in `file`.
pub fn expected_tensors(file: &GgufFile, config: &ModelConfig) -> Result<Vec<GgufExpected>> {
    let table = table(config)?;
    config
        .expected_tensors()
        .into_iter()
        .map(|t| {
            let Some((sources, transform)) = table.source(&t.name, config) else {
                return Err(EngineError::Config {
                    path: file.path().to_path_buf(),
                    detail: format!(
                        "no GGUF name is known for tensor {:?} of a {} model",
                        t.name,
                        config.model_type.as_str()
                    ),
                });
            };
            Ok(GgufExpected {
                name: t.name,
                shape: t.shape,
                sources,
                transform,
                quantize: None,
            })
        })
        .collect()
}

mod checks;
mod config;
mod quant;
pub use config::{SUPPORTED_ARCHITECTURES, config_json};
mod hybrids;
pub use quant::{file_quant_types, quant_types};

#[cfg(test)]
mod tests;
