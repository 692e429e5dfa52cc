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

use metrale_model_weights::gguf::{GgufArray, GgufFile, GgufValue};
use metrale_model_weights::loader::{GgufExpected, GgufTransform};
use serde_json::{Map, Value, json};

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
        let (blk, entry) = match self.globals.iter().find(|(n, _)| *n == hf) {
            Some((_, g)) => (String::new(), *g),
            None => {
                let rest = hf.strip_prefix(self.layer_prefix)?;
                let (i, suffix) = rest.split_once('.')?;
                let i: usize = i.parse().ok()?;
                let g = self.layer.iter().find_map(|(prefix, group)| {
                    let name = suffix.strip_prefix(prefix)?;
                    group.iter().find(|(n, _)| *n == name).map(|(_, g)| *g)
                })?;
                (format!("blk.{i}."), g)
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
        })
    }
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

/// The `general.architecture` values llama.cpp's converter writes for the
/// families metrale runs.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &[
    "llama",
    "qwen2",
    "qwen3",
    "mamba2",
    "granitehybrid",
    "nemotron_h",
];

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
        let config = parse_config(&config_json.to_string(), path)?;
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

fn meta_err(file: &GgufFile, key: &str, detail: impl Into<String>) -> EngineError {
    EngineError::Weights(metrale_model_weights::WeightsError::GgufMetadata {
        path: file.path().to_path_buf(),
        key: key.to_string(),
        detail: detail.into(),
    })
}

/// A per-layer integer key: a single value for every layer, or an array
/// of `layers` values.
fn per_layer(file: &GgufFile, key: &str, layers: usize) -> Result<Vec<usize>> {
    match file.value(key)? {
        GgufValue::Array(a) => {
            let v: Vec<usize> = match a {
                GgufArray::U32(v) => v.iter().map(|&n| n as usize).collect(),
                GgufArray::I32(v) if v.iter().all(|&n| n >= 0) => {
                    v.iter().map(|&n| n as usize).collect()
                }
                GgufArray::U64(v) => v.iter().map(|&n| n as usize).collect(),
                GgufArray::I64(v) if v.iter().all(|&n| n >= 0) => {
                    v.iter().map(|&n| n as usize).collect()
                }
                _ => return Err(meta_err(file, key, "expected an array of integers")),
            };
            if v.len() != layers {
                return Err(meta_err(
                    file,
                    key,
                    format!("has {} entries for {layers} layers", v.len()),
                ));
            }
            Ok(v)
        }
        _ => Ok(vec![file.get_u32(key)? as usize; layers]),
    }
}

fn set(c: &mut Map<String, Value>, key: &str, v: Value) {
    c.insert(key.to_string(), v);
}

/// The Hugging Face `config.json` the metadata of `file` describes.
pub fn config_json(file: &GgufFile) -> Result<Value> {
    let arch = file.architecture()?.to_string();
    if !SUPPORTED_ARCHITECTURES.contains(&arch.as_str()) {
        return Err(EngineError::Config {
            path: file.path().to_path_buf(),
            detail: format!(
                "GGUF architecture {arch:?} is not supported (metrale loads GGUF files of \
                 architecture {})",
                SUPPORTED_ARCHITECTURES.join(", ")
            ),
        });
    }
    let k = |s: &str| format!("{arch}.{s}");
    let u = |s: &str| -> Result<usize> { Ok(file.get_u32(&k(s))? as usize) };
    let opt_u = |s: &str| -> Result<Option<usize>> { Ok(file.opt_u32(&k(s))?.map(|n| n as usize)) };
    let opt_f = |s: &str| -> Result<Option<f32>> {
        file.get(&k(s))
            .map(|_| file.get_f32(&k(s)))
            .transpose()
            .map_err(Into::into)
    };
    let has = |t: &str| file.get_tensor(t).is_some();
    let embd = file.tensor("token_embd.weight")?;
    let mut c = Map::new();
    set(&mut c, "vocab_size", json!(embd.shape()[0]));
    set(&mut c, "hidden_size", json!(u("embedding_length")?));
    set(&mut c, "tie_word_embeddings", json!(!has("output.weight")));
    let layers = u("block_count")?;
    set(&mut c, "num_hidden_layers", json!(layers));
    if let Some(n) = opt_u("context_length")? {
        set(&mut c, "max_position_embeddings", json!(n));
    }
    for (key, name) in [
        ("eos_token_id", "eos"),
        ("bos_token_id", "bos"),
        ("pad_token_id", "padding"),
    ] {
        if let Some(id) = file.opt_u32(&format!("tokenizer.ggml.{name}_token_id"))? {
            set(&mut c, key, json!(id));
        }
    }
    let rms = opt_f("attention.layer_norm_rms_epsilon")?.or(opt_f("attention.layer_norm_epsilon")?);
    // Attention hyper-parameters, shared by the families that have it.
    let attention = |c: &mut Map<String, Value>, kv: usize| -> Result<()> {
        let heads = u("attention.head_count")?;
        c.insert("num_attention_heads".into(), json!(heads));
        c.insert("num_key_value_heads".into(), json!(kv));
        let hidden = u("embedding_length")?;
        let head_dim = opt_u("attention.key_length")?.unwrap_or(hidden / heads.max(1));
        c.insert("head_dim".into(), json!(head_dim));
        let mut rope = Map::new();
        rope.insert("rope_type".into(), json!("default"));
        rope.insert(
            "rope_theta".into(),
            json!(opt_f("rope.freq_base")?.unwrap_or(10000.0)),
        );
        if let Some(dims) = opt_u("rope.dimension_count")?
            && dims != head_dim
            && head_dim > 0
        {
            rope.insert(
                "partial_rotary_factor".into(),
                json!(dims as f64 / head_dim as f64),
            );
        }
        if let Some(kind) = file.opt_str(&k("rope.scaling.type"))?
            && kind != "none"
        {
            let factor = opt_f("rope.scaling.factor")?.unwrap_or(1.0);
            rope.insert("rope_type".into(), json!(kind));
            rope.insert("factor".into(), json!(factor));
            if let Some(n) = opt_u("rope.scaling.original_context_length")? {
                rope.insert("original_max_position_embeddings".into(), json!(n));
            }
        }
        c.insert("rope_parameters".into(), Value::Object(rope));
        c.insert(
            "attention_bias".into(),
            json!(
                file.tensor_infos()
                    .iter()
                    .any(|t| t.name.ends_with("attn_q.bias"))
            ),
        );
        Ok(())
    };
    // Mamba-2 hyper-parameters under the keys of `prefix` (`""` for
    // mamba2/nemotron_h spellings, `"mamba_"` for Bamba/Granite).
    let mamba = |c: &mut Map<String, Value>, granite: bool| -> Result<()> {
        let inner = u("ssm.inner_size")?;
        let heads = u("ssm.time_step_rank")?;
        let hidden = u("embedding_length")?;
        if heads == 0
            || !inner.is_multiple_of(heads)
            || hidden == 0
            || !inner.is_multiple_of(hidden)
        {
            return Err(meta_err(
                file,
                &k("ssm.inner_size"),
                format!(
                    "{inner} is not a multiple of the head count {heads} and of the width {hidden}"
                ),
            ));
        }
        let conv_bias = file
            .tensor_infos()
            .iter()
            .any(|t| t.name.ends_with("ssm_conv1d.bias"));
        let proj_bias = file
            .tensor_infos()
            .iter()
            .any(|t| t.name.ends_with("ssm_in.bias"));
        let entries = [
            ("n_heads", "num_heads", "mamba_num_heads", json!(heads)),
            ("d_head", "head_dim", "mamba_head_dim", json!(inner / heads)),
            (
                "d_state",
                "state_size",
                "ssm_state_size",
                json!(u("ssm.state_size")?),
            ),
            (
                "n_groups",
                "n_groups",
                "n_groups",
                json!(u("ssm.group_count")?),
            ),
            (
                "d_conv",
                "conv_kernel",
                "conv_kernel",
                json!(u("ssm.conv_kernel")?),
            ),
            ("expand", "expand", "expand", json!(inner / hidden)),
            (
                "conv_bias",
                "use_conv_bias",
                "use_conv_bias",
                json!(conv_bias),
            ),
            ("proj_bias", "use_bias", "use_bias", json!(proj_bias)),
        ];
        for (g, m, n, v) in entries {
            let key = match (granite, arch.as_str()) {
                (true, _) => format!("mamba_{g}"),
                (false, "nemotron_h") => n.to_string(),
                _ => m.to_string(),
            };
            c.insert(key, v);
        }
        Ok(())
    };
    let model_type = match arch.as_str() {
        "llama" | "qwen2" | "qwen3" => {
            if has("rope_freqs.weight") {
                return Err(meta_err(
                    file,
                    "rope_freqs.weight",
                    "the file carries per-dimension rope factors (Llama 3.1-style rope scaling), \
                     which metrale does not read from GGUF yet",
                ));
            }
            set(
                &mut c,
                "intermediate_size",
                json!(u("feed_forward_length")?),
            );
            let heads = u("attention.head_count")?;
            let kv = opt_u("attention.head_count_kv")?.unwrap_or(heads);
            attention(&mut c, kv)?;
            if let Some(eps) = rms {
                set(&mut c, "rms_norm_eps", json!(eps));
            }
            arch.clone()
        }
        "mamba2" => {
            mamba(&mut c, false)?;
            if let Some(eps) = rms {
                set(&mut c, "layer_norm_epsilon", json!(eps));
            }
            "mamba2".into()
        }
        "nemotron_h" => {
            let kv = per_layer(file, &k("attention.head_count_kv"), layers)?;
            let ff = per_layer(file, &k("feed_forward_length"), layers)?;
            let pattern: String = (0..layers)
                .map(|i| match (kv[i] > 0, ff[i] > 0) {
                    (true, _) => '*',
                    (false, true) => '-',
                    _ => 'M',
                })
                .collect();
            set(&mut c, "hybrid_override_pattern", json!(pattern));
            set(
                &mut c,
                "intermediate_size",
                json!(ff.iter().copied().max().unwrap_or(0)),
            );
            set(&mut c, "mlp_hidden_act", json!("relu2"));
            attention(&mut c, kv.iter().copied().max().unwrap_or(0))?;
            mamba(&mut c, false)?;
            if let Some(eps) = rms {
                set(&mut c, "layer_norm_epsilon", json!(eps));
            }
            "nemotron_h".into()
        }
        "granitehybrid" => {
            let kv = per_layer(file, &k("attention.head_count_kv"), layers)?;
            attention(&mut c, kv.iter().copied().max().unwrap_or(0))?;
            mamba(&mut c, true)?;
            // head_dim is not a Granite/Bamba key: the attention's width is
            // the model's.
            c.remove("head_dim");
            if let Some(eps) = rms {
                set(&mut c, "rms_norm_eps", json!(eps));
            }
            let ffn = u("feed_forward_length")?;
            set(&mut c, "intermediate_size", json!(ffn));
            // The converter keeps rope for Bamba only (`rope.scaling.finetuned`
            // is its `use_rope`): Bamba checkpoints carry rope, Granite 4.0-H
            // none.
            if file.opt_bool(&k("rope.scaling.finetuned"))? == Some(true) {
                let indices: Vec<usize> = (0..layers).filter(|&i| kv[i] > 0).collect();
                set(&mut c, "attn_layer_indices", json!(indices));
                "bamba".into()
            } else {
                let types: Vec<&str> = kv
                    .iter()
                    .map(|&n| if n > 0 { "attention" } else { "mamba" })
                    .collect();
                set(&mut c, "layer_types", json!(types));
                set(&mut c, "position_embedding_type", json!("nope"));
                let experts = opt_u("expert_count")?.unwrap_or(0);
                set(&mut c, "num_local_experts", json!(experts));
                if let Some(n) = opt_u("expert_used_count")? {
                    set(&mut c, "num_experts_per_tok", json!(n));
                }
                let shared = match opt_u("expert_shared_feed_forward_length")? {
                    Some(n) => n,
                    None => (file.get_tensor("blk.0.ffn_gate.weight"))
                        .or(file.get_tensor("blk.0.ffn_gate_shexp.weight"))
                        .map_or(ffn, |t| t.shape()[0]),
                };
                set(&mut c, "shared_intermediate_size", json!(shared));
                for (key, hf) in [
                    ("attention.scale", "attention_multiplier"),
                    ("embedding_scale", "embedding_multiplier"),
                    ("residual_scale", "residual_multiplier"),
                    ("logit_scale", "logits_scaling"),
                ] {
                    if let Some(v) = opt_f(key)? {
                        set(&mut c, hf, json!(v));
                    }
                }
                "granitemoehybrid".into()
            }
        }
        other => {
            return Err(EngineError::Config {
                path: file.path().to_path_buf(),
                detail: format!(
                    "GGUF architecture {other:?} is not supported (metrale loads GGUF files of \
                     architecture {})",
                    SUPPORTED_ARCHITECTURES.join(", ")
                ),
            });
        }
    };
    c.insert("model_type".into(), json!(model_type));
    Ok(Value::Object(c))
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
        ModelType::Qwen3Next => {
            return Err(EngineError::Internal(
                "qwen3_next has no GGUF table yet".into(),
            ));
        }
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
            })
        })
        .collect()
}

#[cfg(test)]
mod tests;
