//! config.json (and generation_config.json) to a [`ModelConfig`].

use std::path::Path;

use super::ModelConfig;
use super::ModelType;
use super::json::{Obj, parse_json, read_text};
use crate::arch;
use crate::error::{EngineError, Result};

/// Reads `model_dir/config.json` and, when present, the EOS ids of
/// `model_dir/generation_config.json` (merged after the config's own).
pub fn load_config(model_dir: &Path) -> Result<ModelConfig> {
    let path = model_dir.join("config.json");
    let text = read(&path)?;
    let mut config = parse_config(&text, &path)?;
    let generation = model_dir.join("generation_config.json");
    if generation.is_file() {
        let text = read(&generation)?;
        let map = parse_json(&text, &generation)?;
        for id in Obj::new(&map, &generation).token_ids("eos_token_id")? {
            if !config.eos_token_ids.contains(&id) {
                config.eos_token_ids.push(id);
            }
        }
    }
    Ok(config)
}

/// Parses the text of a config.json; `path` is named in errors. What the
/// user should know but does not stop the load is logged (`warn`) and kept
/// in [`ModelConfig::warnings`].
pub fn parse_config(json: &str, path: &Path) -> Result<ModelConfig> {
    let map = parse_json(json, path)?;
    let o = Obj::new(&map, path);
    refuse_quantized(&o)?;
    let Some(name) = o.opt_str(&["model_type"])? else {
        // state-spaces/mamba2-* publish mamba_ssm's own config (and
        // pytorch_model.bin weights), not a transformers checkpoint.
        if o.has("ssm_cfg") && o.has("d_model") {
            return Err(o.err(
                "key `model_type` is missing: this is a mamba_ssm config (d_model, n_layer, \
                 ssm_cfg), not a Hugging Face transformers one; use a transformers conversion \
                 of the checkpoint (model_type mamba2, safetensors weights)",
            ));
        }
        return Err(o.err("key `model_type` is missing"));
    };
    let Some(model_type) = ModelType::from_model_type(name) else {
        let supported: Vec<&str> = ModelType::ALL.iter().map(|t| t.as_str()).collect();
        return Err(EngineError::UnknownModelType {
            path: path.to_path_buf(),
            found: name.to_string(),
            supported: supported.join(", "),
        });
    };
    let config = arch::build(model_type, &o)?;
    if config.vocab_size > u32::MAX as usize {
        return Err(o.err("key `vocab_size` is larger than token ids can address"));
    }
    for warning in &config.warnings {
        tracing::warn!("{warning}");
    }
    Ok(config)
}

/// A quantized checkpoint (a `quantization_config`, or the older
/// `compression_config` of compressed-tensors) is refused by its method's
/// name before anything else is read, so the user does not meet it as a
/// missing tensor later.
fn refuse_quantized(o: &Obj) -> Result<()> {
    let Some((key, value)) = o.get(&["quantization_config", "compression_config"]) else {
        return Ok(());
    };
    let method = value
        .get("quant_method")
        .and_then(|m| m.as_str())
        .map(str::to_string)
        .or_else(|| {
            let bnb = ["load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type"];
            bnb.iter()
                .any(|k| value.get(k).is_some())
                .then(|| "bitsandbytes".to_string())
        })
        .or_else(|| (key == "compression_config").then(|| "compressed-tensors".to_string()));
    let detail = match method {
        Some(method) => format!(
            "this checkpoint is quantized with {} (`{key}.quant_method` {method:?}); metrale does \
             not load quantized safetensors yet: use the unquantized (f32, bf16 or f16) checkpoint",
            quant_method_name(&method)
        ),
        None => format!(
            "this checkpoint is quantized (it has a `{key}`); metrale does not load quantized \
             safetensors yet: use the unquantized (f32, bf16 or f16) checkpoint"
        ),
    };
    Err(o.err(detail))
}

/// How people write a `quant_method`'s name.
fn quant_method_name(method: &str) -> String {
    match method.to_ascii_lowercase().as_str() {
        "gptq" => "GPTQ".into(),
        "awq" => "AWQ".into(),
        "fp8" => "FP8".into(),
        "bitsandbytes" => "bitsandbytes".into(),
        "compressed-tensors" | "compressed_tensors" => "compressed-tensors".into(),
        "marlin" | "gptq_marlin" => "GPTQ (Marlin)".into(),
        "exl2" | "exllamav2" => "EXL2".into(),
        "hqq" => "HQQ".into(),
        "aqlm" => "AQLM".into(),
        "eetq" => "EETQ".into(),
        "mxfp4" => "MXFP4".into(),
        "torchao" => "torchao".into(),
        "bitnet" => "BitNet".into(),
        _ => method.to_string(),
    }
}

fn read(path: &Path) -> Result<String> {
    read_text(path)?.ok_or_else(|| EngineError::Config {
        path: path.to_path_buf(),
        detail: "file not found".to_string(),
    })
}
