//! Where an export departs from llama.cpp's converter so that the file runs
//! as the checkpoint does.
//!
//! [`super::meta`] writes what `convert_hf_to_gguf.py` writes. For some
//! configs the converter reads `config.json` otherwise than transformers
//! (and metrale) do, and its file would run differently in llama.cpp than
//! the checkpoint runs in transformers: a silent wrong answer. Here the
//! metadata is set from metrale's own reading of the config, with keys
//! llama.cpp honours, and each change is reported as a note. What no key
//! can say is refused before anything is written.

use metrale_model_weights::gguf::GgufValue;

use super::meta::{Hparams, i32_array};
use super::{Meta, export_err};
use crate::config::{MixerKind, ModelConfig};
use crate::error::Result;

/// The converter's rule for the granitehybrid context length of a file
/// without rope (`GraniteHybridModel.set_gguf_parameters`).
const NOPE_CONTEXT: u64 = 1 << 20;

/// A Granite hybrid's (Bamba, granitemoehybrid) layer list, positional
/// encoding and attention scale as metrale reads the checkpoint.
/// `converter_attn` is the converter's reading of the attention layers.
pub(super) fn granite_hybrid(
    m: &mut Meta,
    config: &ModelConfig,
    hp: &Hparams,
    converter_attn: &[u64],
) -> Result<()> {
    let Some(att) = &config.attention else {
        return Ok(());
    };
    let ours: Vec<u64> = (config.layers.iter().enumerate())
        .filter(|(_, l)| l.mixer == MixerKind::Attention)
        .map(|(i, _)| i as u64)
        .collect();
    if ours != converter_attn {
        // llama.cpp takes a layer whose `head_count_kv` is 0 for a Mamba one.
        let kv = (0..config.num_layers() as u64)
            .map(|i| u64::from(ours.contains(&i)) * att.n_kv_heads as u64)
            .collect();
        m.put("attention.head_count_kv", i32_array(kv));
        m.notes.push(format!(
            "attention layers written as {ours:?}, as transformers reads config.json's \
             layer_types; llama.cpp's converter would read {converter_attn:?} (it takes only \
             entries spelled \"attention\")"
        ));
    }
    // llama.cpp's granitehybrid graph applies rope exactly when
    // `rope.scaling.finetuned` is true; the converter writes it true only
    // for Bamba or a model without Mamba layers.
    let rope = att.rope.is_some();
    let key = format!("{}.rope.scaling.finetuned", m.arch);
    if m.get(&key) != Some(&GgufValue::Bool(rope)) {
        m.put("rope.scaling.finetuned", GgufValue::Bool(rope));
        let context = if rope {
            config.max_position_embeddings as u64
        } else {
            NOPE_CONTEXT
        };
        m.put(
            "context_length",
            GgufValue::U32(context.min(u32::MAX as u64) as u32),
        );
        let how = if rope { "with" } else { "without" };
        m.notes.push(format!(
            "attention written {how} rope (rope.scaling.finetuned = {rope}), as \
             config.json's position_embedding_type says; llama.cpp's converter would write \
             {} (it keeps rope for Bamba only)",
            !rope
        ));
    }
    // Without `attention.scale` (or with 0) llama.cpp scales q·k by
    // head_dim^-0.5; transformers' Granite default multiplier is 1.
    let key = format!("{}.attention.scale", m.arch);
    let written = match m.get(&key) {
        Some(GgufValue::F32(v)) if *v != 0.0 => *v,
        _ => 1.0 / (att.head_dim as f32).sqrt(),
    };
    if written != att.scale {
        if att.scale == 0.0 {
            return Err(export_err(
                hp.path,
                "attention_multiplier 0 cannot be written: llama.cpp reads a zero \
                 attention.scale as head_dim^-0.5",
            ));
        }
        m.put("attention.scale", GgufValue::F32(att.scale));
        m.notes.push(format!(
            "attention.scale written as {} (llama.cpp's default would be {written})",
            att.scale
        ));
    }
    Ok(())
}
