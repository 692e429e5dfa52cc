//! Helpers shared by the test files: the fixtures, edited copies of their
//! config.json, and small model options.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use metrale_model_engine::EngineError;
use metrale_model_engine::config::parse_config;
use serde_json::{Map, Value};

pub const FIXTURES: [&str; 12] = [
    "llama",
    "qwen3",
    "mamba2",
    "bamba",
    "nemotron_h",
    "granitemoehybrid",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "lfm2",
    "lfm2_moe",
    "lfm2_vl",
];

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(name)
}

pub fn config_map(name: &str) -> Map<String, Value> {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap())
        .unwrap()
}

/// Parses an edited fixture config, expecting an error that names each of `words`.
pub fn config_err(
    name: &str,
    edit: impl FnOnce(&mut Map<String, Value>),
    words: &[&str],
) -> EngineError {
    let mut map = config_map(name);
    edit(&mut map);
    let err = parse_config(
        &Value::Object(map).to_string(),
        Path::new("/models/x/config.json"),
    )
    .expect_err("should fail");
    let message = err.to_string();
    assert!(message.contains("/models/x/config.json"), "{message}");
    for w in words {
        assert!(message.contains(w), "{message:?} should name {w:?}");
    }
    err
}

/// A small model: 8 KV blocks of 16, 2 sequences, 32-token steps.
pub fn small_options() -> metrale_model_engine::model::ModelOptions {
    metrale_model_engine::model::ModelOptions {
        kv_block_size: 16,
        kv_blocks: 8,
        max_seqs: 2,
        max_batch_tokens: 32,
        kv_dtype: None,
        kv_follows_weights: false,
        ssm_state_dtype: None,
        ssm_state_follows_weights: false,
        cuda_graphs: false,
        prefix_cache: Default::default(),
    }
}
