//! config.json (and generation_config.json) to a [`ModelConfig`].

use std::path::Path;

use super::ModelConfig;
use super::ModelType;
use super::json::{Obj, parse_json};
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

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| {
        let detail = if e.kind() == std::io::ErrorKind::NotFound {
            "file not found".to_string()
        } else {
            format!("cannot read: {e}")
        };
        EngineError::Config {
            path: path.to_path_buf(),
            detail,
        }
    })
}
