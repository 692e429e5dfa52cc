//! The metadata of llama.cpp's 2026 hybrids read back as `config.json`
//! keys: LFM2 and LFM2-MoE (`lfm2`, `lfm2moe`) and what Qwen3.5
//! (`qwen35`, `qwen35moe`) has beyond Qwen3-Next's keys (`config.rs`).
//!
//! - LFM2: the layer kinds from the per-layer `attention.head_count_kv`
//!   (0 for a short-conv layer), the conv's taps from `shortconv.l_cache`,
//!   its biases from the `shortconv.in_proj.bias` tensors; the MLP width
//!   (`feed_forward_length`) is the adjusted one, so no adjustment is asked
//!   for again. LFM2-MoE: the experts, `leading_dense_block_count` dense
//!   layers first, an expert bias where `exp_probs_b.bias` tensors are.
//! - Qwen3.5: `nextn_predict_layers` multi-token prediction blocks after
//!   the text layers (counted in `block_count`), and the multimodal RoPE
//!   sections (`rope.dimension_sections`).

use metrale_model_weights::gguf::{GgufArray, GgufFile, GgufValue};
use serde_json::{Map, Value, json};

use super::checks::{fits, meta_err, opt_finite};
use crate::error::Result;

/// The text layers of a Qwen3.5 file: `block_count` less its
/// `nextn_predict_layers`.
pub(super) fn text_layers(file: &GgufFile, arch: &str, blocks: usize) -> Result<usize> {
    let key = format!("{arch}.nextn_predict_layers");
    let mtp = file.opt_u32(&key)?.unwrap_or(0) as usize;
    if mtp >= blocks {
        return Err(meta_err(
            file,
            &key,
            format!("{mtp} prediction layers of {blocks} blocks leave no text layer"),
        ));
    }
    Ok(blocks - mtp)
}

/// `rope.dimension_sections` as `rope_parameters.mrope_section` (trailing
/// empty sections dropped; transformers' configs list three).
pub(super) fn mrope(file: &GgufFile, arch: &str, c: &mut Map<String, Value>) -> Result<()> {
    let key = format!("{arch}.rope.dimension_sections");
    let sections: Vec<u64> = match file.get(&key) {
        None => return Ok(()),
        Some(GgufValue::Array(GgufArray::I32(v))) if v.iter().all(|&n| n >= 0) => {
            v.iter().map(|&n| n as u64).collect()
        }
        Some(GgufValue::Array(GgufArray::U32(v))) => v.iter().map(|&n| n as u64).collect(),
        Some(_) => return Err(meta_err(file, &key, "expected an array of integers")),
    };
    let mut sections = sections;
    while sections.len() > 3 && sections.last() == Some(&0) {
        sections.pop();
    }
    if let Some(Value::Object(rope)) = c.get_mut("rope_parameters") {
        rope.insert("mrope_section".into(), json!(sections));
        rope.insert("mrope_interleaved".into(), json!(true));
    }
    Ok(())
}

/// LFM2's and LFM2-MoE's keys beyond attention's; `kv` is each layer's
/// KV head count.
pub(super) fn lfm2(
    file: &GgufFile,
    arch: &str,
    c: &mut Map<String, Value>,
    kv: &[usize],
) -> Result<()> {
    let k = |s: &str| format!("{arch}.{s}");
    let has = |t: &str| file.get_tensor(t).is_some();
    let types: Vec<&str> = kv
        .iter()
        .map(|&n| if n > 0 { "full_attention" } else { "conv" })
        .collect();
    c.insert("layer_types".into(), json!(types));
    c.insert(
        "conv_L_cache".into(),
        json!(file.get_u32(&k("shortconv.l_cache"))?),
    );
    let conv_bias = (0..kv.len()).any(|i| has(&format!("blk.{i}.shortconv.in_proj.bias")));
    c.insert("conv_bias".into(), json!(conv_bias));
    c.insert(
        "intermediate_size".into(),
        json!(file.get_u32(&k("feed_forward_length"))?),
    );
    c.insert("block_auto_adjust_ff_dim".into(), json!(false));
    if arch != "lfm2moe" {
        return Ok(());
    }
    let dense = file.opt_u32(&k("leading_dense_block_count"))?.unwrap_or(0) as usize;
    c.insert("num_dense_layers".into(), json!(dense));
    let experts = file.get_u32(&k("expert_count"))? as usize;
    fits(
        file,
        &k("expert_count"),
        experts,
        kv.len().saturating_sub(dense),
        4,
    )?;
    c.insert("num_experts".into(), json!(experts));
    c.insert(
        "num_experts_per_tok".into(),
        json!(file.get_u32(&k("expert_used_count"))?),
    );
    c.insert(
        "moe_intermediate_size".into(),
        json!(file.get_u32(&k("expert_feed_forward_length"))?),
    );
    let bias = (0..kv.len()).any(|i| has(&format!("blk.{i}.exp_probs_b.bias")));
    c.insert("use_expert_bias".into(), json!(bias));
    if let Some(scale) = opt_finite(file, &k("expert_weights_scale"))? {
        c.insert("routed_scaling_factor".into(), json!(scale));
    }
    if let Some(norm) = file.opt_bool(&k("expert_weights_norm"))? {
        c.insert("norm_topk_prob".into(), json!(norm));
    }
    Ok(())
}
