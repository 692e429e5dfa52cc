//! Broken configs give clear errors naming the file and the key; mutated
//! configs never panic, and whatever loads is released completely.

use std::path::{Path, PathBuf};

use metrale_core::scope::ModelResource;
use metrale_gpu_runtime::GpuBackend;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_model_engine::EngineError;
use metrale_model_engine::config::{load_config, parse_config};
use metrale_model_engine::loader::load_weights;
use metrale_model_weights::WeightsError;
use metrale_model_weights::loader::WeightDType;
use proptest::prelude::*;
use serde_json::{Map, Value, json};

const FIXTURES: [&str; 7] = [
    "llama",
    "qwen3",
    "mamba2",
    "bamba",
    "nemotron_h",
    "granitemoehybrid",
    "qwen3_next",
];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(name)
}

fn config_map(name: &str) -> Map<String, Value> {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap())
        .unwrap()
}

/// Parses an edited fixture config, expecting an error that names each of `words`.
fn config_err(
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

#[test]
fn missing_config_json() {
    let dir = std::env::temp_dir().join(format!("metrale-noconfig-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let err = load_config(&dir).unwrap_err();
    assert!(matches!(err, EngineError::Config { .. }), "{err:?}");
    assert!(
        err.to_string().contains("config.json") && err.to_string().contains("not found"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn malformed_config_json() {
    let err =
        parse_config("{\"model_type\": \"llama\", ", Path::new("/m/config.json")).unwrap_err();
    assert!(matches!(err, EngineError::Config { .. }), "{err:?}");
    assert!(
        err.to_string().contains("/m/config.json") && err.to_string().contains("malformed JSON"),
        "{err}"
    );
    let err = parse_config("[1, 2]", Path::new("/m/config.json")).unwrap_err();
    assert!(err.to_string().contains("JSON object"), "{err}");
}

#[test]
fn unknown_or_missing_model_type() {
    let err = config_err(
        "llama",
        |m| drop(m.insert("model_type".into(), json!("gpt2"))),
        &["gpt2", "llama", "qwen3_next", "granitemoehybrid"],
    );
    assert!(
        matches!(err, EngineError::UnknownModelType { .. }),
        "{err:?}"
    );
    config_err(
        "llama",
        |m| drop(m.remove("model_type")),
        &["model_type", "missing"],
    );
}

#[test]
fn missing_and_mistyped_keys() {
    config_err(
        "llama",
        |m| drop(m.remove("hidden_size")),
        &["hidden_size", "missing"],
    );
    config_err(
        "llama",
        |m| drop(m.insert("num_attention_heads".into(), json!("four"))),
        &["num_attention_heads", "\"four\""],
    );
    config_err(
        "llama",
        |m| drop(m.insert("num_key_value_heads".into(), json!(3))),
        &["num_key_value_heads"],
    );
    config_err(
        "llama",
        |m| drop(m.insert("rms_norm_eps".into(), json!(-1.0))),
        &["rms_norm_eps", "positive"],
    );
    config_err(
        "llama",
        |m| drop(m.insert("hidden_act".into(), json!("gelu"))),
        &["hidden_act", "gelu"],
    );
    config_err(
        "llama",
        |m| drop(m.insert("num_hidden_layers".into(), json!(1u64 << 40))),
        &["num_hidden_layers", "implausibly large"],
    );
    config_err(
        "llama",
        |m| {
            drop(m.insert(
                "rope_parameters".into(),
                json!({"rope_type": "dynamic", "factor": 2.0}),
            ))
        },
        &["dynamic"],
    );
    config_err(
        "mamba2",
        |m| drop(m.insert("time_step_limit".into(), json!([1.0]))),
        &["time_step_limit"],
    );
    config_err(
        "mamba2",
        |m| drop(m.insert("head_dim".into(), json!(8))),
        &["expand * hidden_size"],
    );
    config_err(
        "nemotron_h",
        |m| drop(m.insert("layers_block_type".into(), json!(["mamba", "conv"]))),
        &["layers_block_type", "[1]", "conv"],
    );
    config_err(
        "nemotron_h",
        |m| {
            m.insert("layers_block_type".into(), json!(["moe"]));
            m.insert("moe_latent_size".into(), json!(64));
        },
        &["moe_latent_size", "not supported"],
    );
    config_err(
        "nemotron_h",
        |m| {
            m.insert("layers_block_type".into(), json!(["moe"]));
            m.insert("n_group".into(), json!(3));
        },
        &["8 experts in 3 groups"],
    );
    config_err(
        "nemotron_h",
        |m| {
            m.insert("layers_block_type".into(), json!(["moe"]));
            m.insert("n_group".into(), json!(4));
            m.insert("num_experts_per_tok".into(), json!(3));
        },
        &["num_experts_per_tok (3)"],
    );
    config_err(
        "granitemoehybrid",
        |m| drop(m.insert("layer_types".into(), json!(["mamba"]))),
        &["layer_types", "num_hidden_layers"],
    );
    config_err(
        "bamba",
        |m| drop(m.insert("attn_layer_indices".into(), json!([7]))),
        &["attn_layer_indices", "7"],
    );
    config_err(
        "qwen3_next",
        |m| drop(m.insert("linear_num_value_heads".into(), json!(3))),
        &["linear_num_value_heads"],
    );
}

// Two keys that describe the layers twice must agree, and layer indices
// must name layers that exist: each case below is an error naming the file
// and both keys (transformers silently uses one key, or errors itself).

#[test]
fn nemotron_h_pattern_against_block_list() {
    // transformers 5 lets the list win silently; the two describe different models.
    config_err(
        "nemotron_h",
        |m| drop(m.insert("hybrid_override_pattern".into(), json!("M*--"))),
        &["hybrid_override_pattern", "layers_block_type", "layer 2"],
    );
    // A pattern of another length.
    config_err(
        "nemotron_h",
        |m| drop(m.insert("hybrid_override_pattern".into(), json!("M*M-M"))),
        &["hybrid_override_pattern", "layers_block_type", "5", "4"],
    );
}

#[test]
fn nemotron_h_layer_types_against_layers_block_type() {
    // `layer_types` is transformers' alias of `layers_block_type` (and the
    // one it keeps when both are given).
    config_err(
        "nemotron_h",
        |m| {
            drop(m.insert(
                "layer_types".into(),
                json!(["linear_attention", "mlp", "linear_attention", "mlp"]),
            ))
        },
        &["layer_types", "layers_block_type", "layer 1"],
    );
    config_err(
        "nemotron_h",
        |m| {
            m.remove("layers_block_type");
            m.insert(
                "layer_types".into(),
                json!(["mamba", "attention", "mamba", "mlp"]),
            );
            m.insert("hybrid_override_pattern".into(), json!("M*M*"));
        },
        &["layer_types", "hybrid_override_pattern", "layer 3"],
    );
}

#[test]
fn granite_layer_types_against_layers_block_type() {
    // transformers keeps `layers_block_type` (its alias), metrale read `layer_types`.
    config_err(
        "granitemoehybrid",
        |m| {
            drop(m.insert(
                "layers_block_type".into(),
                json!(["attention", "mamba", "mamba"]),
            ))
        },
        &["layer_types", "layers_block_type", "layer 0"],
    );
    config_err(
        "granitemoehybrid",
        |m| {
            m.remove("layer_types");
            m.insert("layers_block_type".into(), json!(["mamba", "attention"]));
        },
        &["layers_block_type", "num_hidden_layers"],
    );
}

#[test]
fn qwen3_next_layer_types_against_full_attention_interval() {
    // The fixture's layer_types put attention on layer 3 (interval 4).
    config_err(
        "qwen3_next",
        |m| drop(m.insert("full_attention_interval".into(), json!(2))),
        &["layer_types", "full_attention_interval", "layer 1"],
    );
    config_err(
        "qwen3_next",
        |m| drop(m.insert("layer_types".into(), json!(["linear_attention"]))),
        &["layer_types", "num_hidden_layers"],
    );
}

#[test]
fn qwen3_next_layer_indices_out_of_range() {
    config_err(
        "qwen3_next",
        |m| drop(m.insert("mlp_only_layers".into(), json!([1, 4]))),
        &["mlp_only_layers", "4", "num_hidden_layers"],
    );
    config_err(
        "qwen3_next",
        |m| drop(m.insert("decoder_sparse_step".into(), json!(0))),
        &["decoder_sparse_step", "positive"],
    );
    config_err(
        "qwen3_next",
        |m| {
            m.remove("layer_types");
            m.insert("full_attention_interval".into(), json!(0));
        },
        &["full_attention_interval", "positive"],
    );
}

#[test]
fn qwen_layer_types_against_max_window_layers() {
    // With sliding windows on, `max_window_layers` says which layers slide;
    // transformers silently keeps `layer_types` when both are given.
    for model_type in ["qwen2", "qwen3"] {
        config_err(
            "qwen3",
            |m| {
                m.insert("model_type".into(), json!(model_type));
                m.insert("use_sliding_window".into(), json!(true));
                m.insert("sliding_window".into(), json!(8));
                m.insert("max_window_layers".into(), json!(1));
                m.insert(
                    "layer_types".into(),
                    json!(["sliding_attention", "full_attention"]),
                );
            },
            &["layer_types", "max_window_layers", "layer 0"],
        );
    }
    config_err(
        "qwen3",
        |m| drop(m.insert("layer_types".into(), json!(["full_attention"]))),
        &["layer_types", "num_hidden_layers"],
    );
}

#[test]
fn bamba_layer_list_against_attn_layer_indices() {
    // transformers refuses any `layer_types` / `layers_block_type` key here
    // (a read-only property derived from attn_layer_indices).
    for key in ["layer_types", "layers_block_type"] {
        config_err(
            "bamba",
            |m| drop(m.insert(key.into(), json!(["attention", "mamba", "mamba"]))),
            &[key, "attn_layer_indices", "layer 0"],
        );
    }
    config_err(
        "bamba",
        |m| drop(m.insert("attn_layer_indices".into(), json!([1, 3]))),
        &["attn_layer_indices", "3", "num_hidden_layers"],
    );
}

#[test]
fn mamba2_layer_count_and_types() {
    config_err(
        "mamba2",
        |m| drop(m.insert("n_layer".into(), json!(5))),
        &["num_hidden_layers", "n_layer"],
    );
    // transformers refuses a `layer_types` key (every layer is Mamba-2).
    config_err(
        "mamba2",
        |m| drop(m.insert("layer_types".into(), json!(["mamba", "attention"]))),
        &["layer_types", "[1]", "attention"],
    );
    config_err(
        "mamba2",
        |m| drop(m.insert("layer_types".into(), json!(["mamba"]))),
        &["layer_types", "num_hidden_layers"],
    );
}

#[test]
fn a_config_that_disagrees_with_the_weights() {
    let mut map = config_map("llama");
    map.insert("intermediate_size".into(), json!(96));
    let config = parse_config(
        &Value::Object(map).to_string(),
        &fixture("llama").join("config.json"),
    )
    .unwrap();
    let gpu = CpuBackend::new();
    let Err(err) = load_weights(
        &fixture("llama"),
        &config,
        &gpu,
        WeightDType::AsStored,
        &mut |_| {},
    ) else {
        panic!("shape mismatch")
    };
    assert!(
        matches!(err, EngineError::Weights(WeightsError::WrongShape { .. })),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("model.safetensors") && err.to_string().contains("mlp"),
        "{err}"
    );
    assert_eq!(gpu.live_bytes(), 0);

    // Untied config on a checkpoint without lm_head.
    let mut map = config_map("qwen3");
    map.insert("tie_word_embeddings".into(), json!(false));
    let config = parse_config(&Value::Object(map).to_string(), Path::new("config.json")).unwrap();
    let Err(err) = load_weights(
        &fixture("qwen3"),
        &config,
        &gpu,
        WeightDType::AsStored,
        &mut |_| {},
    ) else {
        panic!("no lm_head")
    };
    assert!(
        matches!(
            err,
            EngineError::Weights(WeightsError::MissingTensor { .. })
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("lm_head.weight"), "{err}");
    assert_eq!(gpu.live_bytes(), 0);
}

/// One way to damage a config.
#[derive(Clone, Debug)]
enum Edit {
    Remove(usize),
    Replace(usize, Value),
    /// Replace a character of the text (JSON-level damage).
    Char(usize, char),
    Truncate(usize),
}

fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        (0u64..300).prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<i64>().prop_map(|n| json!(n)),
        (-4.0f64..4.0).prop_map(|f| json!(f)),
        Just(json!("Infinity")),
        Just(json!({"__float__": "NaN"})),
        Just(json!([
            "mamba",
            "attention",
            "mlp",
            "linear_attention",
            "full_attention"
        ])),
        Just(json!([0, 1, 2])),
        Just(json!({"rope_type": "yarn", "factor": 0.0})),
        "[a-z_]{0,12}".prop_map(Value::String),
    ]
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        2 => any::<usize>().prop_map(Edit::Remove),
        4 => (any::<usize>(), value()).prop_map(|(k, v)| Edit::Replace(k, v)),
        1 => (any::<usize>(), prop::sample::select(vec!['{', '}', '"', ',', '1', 'x', ' ', ':', ']'])).prop_map(|(p, c)| Edit::Char(p, c)),
        1 => any::<usize>().prop_map(Edit::Truncate),
    ]
}

fn damaged(name: &str, edits: &[Edit]) -> String {
    let mut map = config_map(name);
    for e in edits {
        let keys: Vec<String> = map.keys().cloned().collect();
        match e {
            Edit::Remove(k) => drop(map.remove(&keys[k % keys.len()])),
            Edit::Replace(k, v) => drop(map.insert(keys[k % keys.len()].clone(), v.clone())),
            _ => {}
        }
    }
    let mut text: Vec<char> = Value::Object(map).to_string().chars().collect();
    for e in edits {
        match e {
            Edit::Char(p, c) if !text.is_empty() => {
                let i = p % text.len();
                text[i] = *c;
            }
            Edit::Truncate(p) => text.truncate(p % (text.len() + 1)),
            _ => {}
        }
    }
    text.into_iter().collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn mutated_configs_error_or_load(which in 0usize..FIXTURES.len(), edits in prop::collection::vec(edit(), 1..4)) {
        let name = FIXTURES[which];
        let text = damaged(name, &edits);
        let path = fixture(name).join("config.json");
        match parse_config(&text, &path) {
            Err(e) => prop_assert!(e.to_string().contains("config.json")),
            Ok(config) => {
                let _ = (config.plan_line(), config.kv_bytes_per_token(), config.recurrent_bytes_per_sequence(), config.parameter_count());
                let gpu = CpuBackend::new();
                match load_weights(&fixture(name), &config, &gpu, WeightDType::AsStored, &mut |_| {}) {
                    Ok(mut store) => store.release(&gpu).unwrap(),
                    Err(e) => prop_assert!(!e.to_string().is_empty()),
                }
                prop_assert_eq!(gpu.live_bytes(), 0);
            }
        }
    }
}
