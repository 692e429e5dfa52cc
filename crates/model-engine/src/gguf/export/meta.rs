//! The `{arch}.*` hyper-parameter keys llama.cpp's `convert_hf_to_gguf.py`
//! writes for each family metrale exports, from the checkpoint's
//! `config.json` as the converter reads it: `TextModel.set_gguf_parameters`
//! and the family classes' additions (`LlamaModel`, `Qwen2Model`,
//! `Mamba2Model`, `GraniteModel` / `GraniteMoeModel` /
//! `GraniteHybridModel`, `NemotronHModel` with and without MoE,
//! `Qwen2MoeModel` / `Qwen3NextModel`), in the order they write them
//! (a key written twice keeps its first place, as in gguf-py's writer).
//!
//! The converter reads `config.json` through transformers' `AutoConfig`,
//! which fills in defaults for keys the file lacks; here only the file's
//! own keys are read, so a config missing a key its class defaults (rare
//! in published checkpoints) gives a file without that key.

use std::path::Path;

use metrale_model_weights::gguf::{GgufArray, GgufValue};
use serde_json::{Map, Value};

use super::Meta;
use crate::config::ModelType;
use crate::error::{EngineError, Result};

/// `config.json` with the converter's `find_hparam`: the first key
/// present (even if null), also under the family's prefixes
/// (`GraniteHybridModel` looks up `mamba_<key>` after `<key>`).
pub(super) struct Hparams<'a> {
    pub map: &'a Map<String, Value>,
    pub prefixes: &'static [&'static str],
    pub path: &'a Path,
}

impl Hparams<'_> {
    fn find(&self, keys: &[&str]) -> Option<&Value> {
        let prefixed = (self.prefixes.iter())
            .flat_map(|p| keys.iter().map(move |k| format!("{p}_{k}")))
            .collect::<Vec<_>>();
        let all = keys.iter().map(|k| k.to_string()).chain(prefixed);
        all.into_iter().find_map(|k| self.map.get(&k))
    }

    pub fn u(&self, keys: &[&str]) -> Option<u64> {
        self.find(keys).and_then(Value::as_u64)
    }

    fn f(&self, keys: &[&str]) -> Option<f64> {
        self.find(keys).and_then(Value::as_f64)
    }

    pub fn need_u(&self, keys: &[&str]) -> Result<u64> {
        self.u(keys).ok_or_else(|| EngineError::Config {
            path: self.path.to_path_buf(),
            detail: format!(
                "the GGUF converter needs an integer {} (none found)",
                keys.join(" or ")
            ),
        })
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }
}

fn u32v(n: u64) -> GgufValue {
    GgufValue::U32(n as u32)
}

fn f32v(x: f64) -> GgufValue {
    GgufValue::F32(x as f32)
}

pub(super) fn i32_array(v: Vec<u64>) -> GgufValue {
    GgufValue::Array(GgufArray::I32(v.into_iter().map(|n| n as i32).collect()))
}

/// `TextModel.set_gguf_parameters`, up to (not including) the file type.
fn text_model(m: &mut Meta, hp: &Hparams) -> Result<()> {
    let layers = hp.need_u(&["num_hidden_layers", "n_layers", "n_layer"])?;
    m.put("block_count", u32v(layers));
    let ctx = [
        "max_position_embeddings",
        "n_ctx",
        "n_positions",
        "max_length",
        "max_sequence_length",
        "model_max_length",
    ];
    if let Some(n) = hp.u(&ctx) {
        m.put("context_length", u32v(n));
    }
    if let Some(n) = hp.u(&["hidden_size", "n_embd", "dim"]) {
        m.put("embedding_length", u32v(n));
    }
    let ff = [
        "prefix_dense_intermediate_size",
        "dense_intermediate_size",
        "intermediate_size",
        "n_inner",
        "hidden_dim",
    ];
    if let Some(n) = hp.u(&ff) {
        m.put("feed_forward_length", u32v(n));
    }
    if let Some(n) = hp.u(&["num_attention_heads", "n_head", "n_heads"]) {
        m.put("attention.head_count", u32v(n));
    }
    if let Some(n) = hp.u(&["num_key_value_heads", "n_kv_heads"]) {
        m.put("attention.head_count_kv", u32v(n));
    }
    // rope_parameters (or the older rope_scaling), with a top-level
    // rope_theta mirrored in.
    let empty = Map::new();
    let rope = (hp.get("rope_parameters").or(hp.get("rope_scaling")))
        .and_then(Value::as_object)
        .unwrap_or(&empty);
    let field = |k: &str| rope.get(k).filter(|v| !v.is_null());
    let rope_type = field("rope_type").or(field("type")).and_then(Value::as_str);
    let factor = field("factor").and_then(Value::as_f64);
    match (rope_type, factor) {
        (Some("linear"), Some(f)) => {
            m.put("rope.scaling.type", GgufValue::String("linear".into()));
            m.put("rope.scaling.factor", f32v(f));
        }
        (Some("yarn"), Some(f)) => {
            m.put("rope.scaling.type", GgufValue::String("yarn".into()));
            m.put("rope.scaling.factor", f32v(f));
            let orig = field("original_max_position_embeddings").and_then(Value::as_u64);
            let Some(orig) = orig else {
                return Err(EngineError::Config {
                    path: hp.path.to_path_buf(),
                    detail: "yarn rope scaling without original_max_position_embeddings".into(),
                });
            };
            m.put("rope.scaling.original_context_length", u32v(orig));
            for (k, keys) in [
                (
                    "rope.scaling.yarn_ext_factor",
                    &["extrapolation_factor"][..],
                ),
                (
                    "rope.scaling.yarn_attn_factor",
                    &["attention_factor", "attn_factor"][..],
                ),
                ("rope.scaling.yarn_beta_fast", &["beta_fast"][..]),
                ("rope.scaling.yarn_beta_slow", &["beta_slow"][..]),
            ] {
                if let Some(v) = keys.iter().find_map(|k| field(k)).and_then(Value::as_f64) {
                    m.put(k, f32v(v));
                }
            }
        }
        (Some("llama3"), _) => {
            return Err(EngineError::Config {
                path: hp.path.to_path_buf(),
                detail: "llama3 rope scaling (the converter's generated rope_freqs tensor) is \
                         not exported yet"
                    .into(),
            });
        }
        (Some("su" | "longrope"), _) => {
            m.put("rope.scaling.type", GgufValue::String("longrope".into()));
        }
        _ => {}
    }
    let theta = field("rope_theta").or(hp.get("rope_theta"));
    if let Some(theta) = theta.and_then(Value::as_f64) {
        m.put("rope.freq_base", f32v(theta));
    }
    if let Some(eps) = hp.f(&["rms_norm_eps", "norm_eps"]) {
        m.put("attention.layer_norm_rms_epsilon", f32v(eps));
    }
    if let Some(eps) = hp.f(&["layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"]) {
        m.put("attention.layer_norm_epsilon", f32v(eps));
    }
    if let Some(n) = hp.u(&["num_local_experts", "num_experts", "n_routed_experts"]) {
        m.put("expert_count", u32v(n));
    }
    let used = [
        "num_experts_per_tok",
        "num_experts_per_token",
        "top_k_experts",
    ];
    if let Some(n) = hp.u(&used) {
        m.put("expert_used_count", u32v(n));
    }
    if let Some(n) = hp.get("n_group").and_then(Value::as_u64) {
        m.put("expert_group_count", u32v(n));
    }
    if let Some(n) = hp.get("topk_group").and_then(Value::as_u64) {
        m.put("expert_group_used_count", u32v(n));
    }
    if let Some(n) = hp.get("head_dim").and_then(Value::as_u64) {
        m.put("attention.key_length", u32v(n));
        m.put("attention.value_length", u32v(n));
    }
    Ok(())
}

/// `LlamaModel.set_gguf_parameters`'s additions after the base (and the
/// file type the base writes last).
fn llama_tail(m: &mut Meta, hp: &Hparams, file_type: u32) -> Result<()> {
    m.put_full("general.file_type", GgufValue::U32(file_type));
    m.put("vocab_size", u32v(hp.need_u(&["vocab_size"])?));
    let rope_dim = match hp.get("head_dim").and_then(Value::as_u64) {
        Some(d) => d,
        None => hp.need_u(&["hidden_size"])? / hp.need_u(&["num_attention_heads"])?.max(1),
    };
    m.put("rope.dimension_count", u32v(rope_dim));
    Ok(())
}

/// The attention layers of a Granite hybrid (`get_attn_layers`).
pub(super) fn granite_attention_layers(hp: &Hparams, layers: u64) -> Result<Vec<u64>> {
    if let Some(types) = hp.get("layer_types").and_then(Value::as_array) {
        return Ok((types.iter().enumerate())
            .filter(|(_, t)| t.as_str() == Some("attention"))
            .map(|(i, _)| i as u64)
            .collect());
    }
    let indices = (hp.get("attn_layer_indices").and_then(Value::as_array))
        .map(|v| v.iter().filter_map(Value::as_u64).collect::<Vec<_>>())
        .unwrap_or_default();
    if !indices.is_empty() {
        return Ok(indices);
    }
    let period = hp.get("attn_layer_period").and_then(Value::as_u64);
    let offset = hp.get("attn_layer_offset").and_then(Value::as_u64);
    match (period, offset) {
        (Some(p), Some(o)) if p > 0 => Ok((0..layers).filter(|i| i % p == o).collect()),
        _ => Err(EngineError::Config {
            path: hp.path.to_path_buf(),
            detail: "no layer_types, attn_layer_indices or attn_layer_period/offset".into(),
        }),
    }
}

/// Adds the `{arch}` keys of a model of `model_type` to `m`, and
/// `general.file_type` (`file_type`) among them, where the converter
/// writes it.
pub(super) fn arch_keys(
    m: &mut Meta,
    model_type: ModelType,
    hp: &Hparams,
    file_type: u32,
) -> Result<()> {
    let layers = hp.need_u(&["num_hidden_layers", "n_layers", "n_layer"])?;
    match model_type {
        ModelType::Llama | ModelType::Mistral => {
            text_model(m, hp)?;
            llama_tail(m, hp, file_type)?;
        }
        ModelType::Qwen2 | ModelType::Qwen3 => {
            text_model(m, hp)?;
            m.put_full("general.file_type", GgufValue::U32(file_type));
        }
        ModelType::Mamba2 => {
            let d_model = hp.need_u(&["hidden_size", "d_model", "dim"])?;
            let expand = hp.u(&["mamba_expand", "expand"]).unwrap_or(2);
            let d_inner = (hp.u(&["mamba_d_ssm", "intermediate_size", "d_inner"]))
                .unwrap_or(expand * d_model);
            let head_dim = hp.u(&["mamba_d_head", "head_dim"]).unwrap_or(64);
            let eps = hp
                .f(&["layer_norm_epsilon", "rms_norm_eps"])
                .unwrap_or(1e-5);
            m.put("context_length", u32v(1 << 20));
            m.put("embedding_length", u32v(d_model));
            m.put("feed_forward_length", u32v(0));
            m.put("attention.head_count", u32v(0));
            m.put("block_count", u32v(layers));
            m.put(
                "ssm.conv_kernel",
                u32v(hp.u(&["conv_kernel", "d_conv"]).unwrap_or(4)),
            );
            m.put("ssm.inner_size", u32v(d_inner));
            m.put(
                "ssm.state_size",
                u32v(hp.u(&["state_size", "d_state"]).unwrap_or(128)),
            );
            m.put("ssm.time_step_rank", u32v(d_inner / head_dim.max(1)));
            m.put("ssm.group_count", u32v(hp.u(&["n_groups"]).unwrap_or(1)));
            m.put("attention.layer_norm_rms_epsilon", f32v(eps));
            m.put_full("general.file_type", GgufValue::U32(file_type));
        }
        ModelType::Bamba | ModelType::GraniteMoeHybrid | ModelType::NemotronH => {
            granite_hybrid(m, model_type, hp, layers, file_type)?;
        }
        ModelType::Qwen3Next => qwen3_next(m, hp, layers, file_type)?,
        ModelType::Qwen35 | ModelType::Qwen35Moe | ModelType::Lfm2 | ModelType::Lfm2Moe => {
            return Err(EngineError::Internal(format!(
                "{} models are not exported to GGUF yet",
                model_type.as_str()
            )));
        }
    }
    Ok(())
}

/// `Qwen2MoeModel` and `Qwen3NextModel.set_gguf_parameters` (without MTP
/// layers: the converter is run with `--no-mtp`, as a config without
/// `mtp_num_hidden_layers` needs).
fn qwen3_next(m: &mut Meta, hp: &Hparams, layers: u64, file_type: u32) -> Result<()> {
    text_model(m, hp)?;
    m.put_full("general.file_type", GgufValue::U32(file_type));
    if let Some(n) = hp.get("moe_intermediate_size").and_then(Value::as_u64) {
        m.put("expert_feed_forward_length", u32v(n));
    }
    if let Some(n) = (hp.get("shared_expert_intermediate_size")).and_then(Value::as_u64) {
        m.put("expert_shared_feed_forward_length", u32v(n));
    }
    let v_heads = hp.need_u(&["linear_num_value_heads"])?;
    m.put(
        "ssm.conv_kernel",
        u32v(hp.need_u(&["linear_conv_kernel_dim"])?),
    );
    m.put("ssm.state_size", u32v(hp.need_u(&["linear_key_head_dim"])?));
    m.put(
        "ssm.group_count",
        u32v(hp.need_u(&["linear_num_key_heads"])?),
    );
    m.put("ssm.time_step_rank", u32v(v_heads));
    let v_dim = hp.need_u(&["linear_value_head_dim"])?;
    m.put("ssm.inner_size", u32v(v_dim * v_heads));
    if let Some(types) = hp.get("layer_types").and_then(Value::as_array) {
        if types.len() as u64 != layers {
            return Err(EngineError::Config {
                path: hp.path.to_path_buf(),
                detail: format!(
                    "layer_types has {} entries for {layers} layers",
                    types.len()
                ),
            });
        }
        let recurrent = (types.iter())
            .map(|t| t.as_str() == Some("linear_attention"))
            .collect();
        m.put(
            "attention.recurrent_layers",
            GgufValue::Array(GgufArray::Bool(recurrent)),
        );
    }
    let interval = hp.get("full_attention_interval").and_then(Value::as_u64);
    m.put("full_attention_interval", u32v(interval.unwrap_or(4)));
    let head_dim = match hp.get("head_dim").and_then(Value::as_u64) {
        Some(d) => d,
        None => hp.need_u(&["hidden_size"])? / hp.need_u(&["num_attention_heads"])?.max(1),
    };
    // `int(head_dim * partial_rotary_factor)`, the factor from
    // rope_parameters (or rope_scaling, or the top level), 0.25 if none.
    let rope = hp.get("rope_parameters").or(hp.get("rope_scaling"));
    let factor = (rope.and_then(|r| r.get("partial_rotary_factor")))
        .filter(|v| !v.is_null())
        .or(hp.get("partial_rotary_factor"))
        .and_then(Value::as_f64)
        .unwrap_or(0.25);
    m.put(
        "rope.dimension_count",
        u32v((head_dim as f64 * factor) as u64),
    );
    Ok(())
}

/// `GraniteHybridModel.set_gguf_parameters` (Bamba, Granite 4.0-H) and
/// `NemotronHModel`'s additions.
fn granite_hybrid(
    m: &mut Meta,
    model_type: ModelType,
    hp: &Hparams,
    layers: u64,
    file_type: u32,
) -> Result<()> {
    let nemotron = model_type == ModelType::NemotronH;
    let pattern = hp.get("hybrid_override_pattern").and_then(Value::as_str);
    let attn: Vec<u64> = if nemotron {
        let Some(p) = pattern else {
            return Err(EngineError::Config {
                path: hp.path.to_path_buf(),
                detail: "nemotron_h export needs hybrid_override_pattern".into(),
            });
        };
        (p.chars().enumerate())
            .filter(|(_, c)| *c == '*')
            .map(|(i, _)| i as u64)
            .collect()
    } else {
        granite_attention_layers(hp, layers)?
    };
    let has_ssm = (attn.len() as u64) < layers;
    // GraniteModel ignores head_dim (pops it); NemotronHModel writes it
    // last as key/value length.
    let head_dim = hp.get("head_dim").and_then(Value::as_u64);
    let mut stripped = hp.map.clone();
    stripped.remove("head_dim");
    let base = Hparams {
        map: &stripped,
        prefixes: hp.prefixes,
        path: hp.path,
    };
    text_model(m, &base)?;
    llama_tail(m, &base, file_type)?;
    for (key, hf) in crate::gguf::config::GRANITE_SCALES {
        // Python truthiness: a zero multiplier is not written.
        if let Some(v) = hp.get(hf).and_then(Value::as_f64).filter(|v| *v != 0.0) {
            m.put(key, f32v(v));
        }
    }
    if let Some(n) = hp.get("shared_intermediate_size").and_then(Value::as_u64)
        && n != 0
    {
        m.put("expert_shared_feed_forward_length", u32v(n));
    }
    let d_model = hp.need_u(&["mamba_head_dim", "hidden_size", "d_model"])?;
    let d_inner = if nemotron {
        hp.need_u(&["num_heads"])? * d_model
    } else {
        hp.need_u(&["expand", "num_heads"])? * d_model
    };
    m.put(
        "ssm.conv_kernel",
        u32v(hp.need_u(&["conv_kernel", "d_conv"])?),
    );
    m.put(
        "ssm.state_size",
        u32v(hp.need_u(&["state_size", "d_state", "state_dim", "ssm_state_size"])?),
    );
    m.put(
        "ssm.group_count",
        u32v(hp.need_u(&["n_groups", "num_groups"])?),
    );
    m.put("ssm.inner_size", u32v(d_inner));
    m.put(
        "ssm.time_step_rank",
        u32v(hp.need_u(&["n_heads", "num_heads"])?),
    );
    let kv = hp.need_u(&["num_key_value_heads", "n_head_kv"])?;
    if let Some(d) = hp.get("attn_rotary_emb").and_then(Value::as_u64) {
        m.put("rope.dimension_count", u32v(d));
    }
    let kv_vec = (0..layers)
        .map(|i| if attn.contains(&i) { kv } else { 0 })
        .collect();
    m.put("attention.head_count_kv", i32_array(kv_vec));
    let bamba = (hp.get("architectures").and_then(Value::as_array))
        .is_some_and(|a| a.iter().any(|x| x.as_str() == Some("BambaForCausalLM")));
    let use_rope = bamba || !has_ssm;
    m.put("rope.scaling.finetuned", GgufValue::Bool(use_rope));
    if !use_rope {
        m.put("context_length", u32v(1 << 20));
    }
    if nemotron {
        let Some(head_dim) = head_dim.or(hp.get("attention_head_dim").and_then(Value::as_u64))
        else {
            return Err(EngineError::Config {
                path: hp.path.to_path_buf(),
                detail: "nemotron_h export needs head_dim".into(),
            });
        };
        m.put("attention.key_length", u32v(head_dim));
        m.put("attention.value_length", u32v(head_dim));
        nemotron_ffn(m, hp, pattern.unwrap_or_default())?;
    }
    Ok(())
}

/// `NemotronHModel`'s feed-forward keys: the per-layer sizes (of the `-`
/// layers, or with MoE keys of the `E` layers) and the MoE keys.
fn nemotron_ffn(m: &mut Meta, hp: &Hparams, pattern: &str) -> Result<()> {
    if !hp.map.contains_key("num_experts_per_tok") {
        let n_ff = hp.need_u(&["intermediate_size", "n_inner", "hidden_dim"])?;
        let ff = (pattern.chars())
            .map(|c| if c == '-' { n_ff } else { 0 })
            .collect();
        m.put("feed_forward_length", i32_array(ff));
        return Ok(());
    }
    let n_ff = hp.need_u(&["moe_intermediate_size"])?;
    let ff = (pattern.chars())
        .map(|c| if c == 'E' { n_ff } else { 0 })
        .collect();
    m.put("feed_forward_length", i32_array(ff));
    m.put(
        "expert_used_count",
        u32v(hp.need_u(&["num_experts_per_tok"])?),
    );
    m.put("expert_feed_forward_length", u32v(n_ff));
    let shared = hp.need_u(&["moe_shared_expert_intermediate_size"])?;
    m.put("expert_shared_feed_forward_length", u32v(shared));
    m.put("expert_count", u32v(hp.need_u(&["n_routed_experts"])?));
    m.put(
        "expert_shared_count",
        u32v(hp.need_u(&["n_shared_experts"])?),
    );
    let norm = hp.get("norm_topk_prob").and_then(Value::as_bool);
    let Some(norm) = norm else {
        return Err(EngineError::Config {
            path: hp.path.to_path_buf(),
            detail: "the GGUF converter needs norm_topk_prob".into(),
        });
    };
    m.put("expert_weights_norm", GgufValue::Bool(norm));
    let scale = hp
        .f(&["routed_scaling_factor"])
        .ok_or_else(|| EngineError::Config {
            path: hp.path.to_path_buf(),
            detail: "the GGUF converter needs routed_scaling_factor".into(),
        })?;
    m.put("expert_weights_scale", f32v(scale));
    m.put("expert_group_count", u32v(hp.need_u(&["n_group"])?));
    if hp.get("moe_latent_size").is_some() {
        return Err(EngineError::Config {
            path: hp.path.to_path_buf(),
            detail: "latent MoE (moe_latent_size) is not exported".into(),
        });
    }
    Ok(())
}
