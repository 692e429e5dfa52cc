//! Broken configs give clear errors naming the file and the key; mutated
//! configs never panic, and whatever loads is released completely.

use crate::common;

use std::path::Path;

use common::*;
use metrale_core::scope::ModelResource;
use metrale_gpu_runtime::GpuBackend;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_model_engine::EngineError;
use metrale_model_engine::config::{ModelConfig, ModelType, load_config, parse_config};
use metrale_model_engine::loader::load_weights;
use metrale_model_weights::WeightsError;
use metrale_model_weights::loader::WeightDType;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use serde_json::{Map, Value, json};

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
    /// Set one of the keys that describe layers (present or not).
    Layers(&'static str, Value),
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

/// The keys that describe layers, in any family.
const LAYER_KEYS: [&str; 13] = [
    "num_hidden_layers",
    "n_layer",
    "layers_block_type",
    "layer_types",
    "hybrid_override_pattern",
    "attn_layer_indices",
    "mlp_only_layers",
    "full_attention_interval",
    "decoder_sparse_step",
    "max_window_layers",
    "use_sliding_window",
    "sliding_window",
    "full_attn_idxs",
];

/// Values for those keys: layer lists of any length and spelling, patterns,
/// index lists with duplicates and indices past the end, small counts.
fn layer_value() -> impl Strategy<Value = Value> {
    let kind = prop::sample::select(vec![
        "mamba",
        "attention",
        "linear_attention",
        "full_attention",
        "sliding_attention",
        "mlp",
        "moe",
        "conv",
    ]);
    prop_oneof![
        prop::collection::vec(kind, 0..7).prop_map(|v| json!(v)),
        "[M*E\\-X]{0,7}".prop_map(Value::String),
        prop::collection::vec(0u64..8, 0..5).prop_map(|v| json!(v)),
        (0u64..8).prop_map(|n| json!(n)),
        any::<bool>().prop_map(Value::Bool),
        Just(Value::Null),
    ]
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        2 => any::<usize>().prop_map(Edit::Remove),
        4 => (any::<usize>(), value()).prop_map(|(k, v)| Edit::Replace(k, v)),
        3 => (prop::sample::select(LAYER_KEYS.to_vec()), layer_value()).prop_map(|(k, v)| Edit::Layers(k, v)),
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
            Edit::Layers(k, v) => drop(map.insert(k.to_string(), v.clone())),
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
                if let Ok(Value::Object(map)) = serde_json::from_str::<Value>(&text) {
                    layer_keys_agree(&map, &config)?;
                }
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

/// What an accepted config's layer keys must satisfy, in the families that
/// read them: every layer list describes exactly the plan's layers, and
/// every layer index names one of them.
fn layer_keys_agree(map: &Map<String, Value>, c: &ModelConfig) -> Result<(), TestCaseError> {
    // A vision-language wrapper's layers are described under `text_config`.
    let map = match map.get("text_config") {
        Some(Value::Object(text)) => text,
        _ => map,
    };
    let n = c.num_layers();
    let (lists, indices): (&[&str], &[&str]) = match c.model_type {
        ModelType::NemotronH => (&["layers_block_type", "layer_types"], &[]),
        ModelType::GraniteMoeHybrid => (&["layer_types", "layers_block_type"], &[]),
        ModelType::Bamba => (
            &["layer_types", "layers_block_type"],
            &["attn_layer_indices"],
        ),
        ModelType::Qwen3Next => (&["layer_types"], &["mlp_only_layers"]),
        ModelType::Lfm2 | ModelType::Lfm2Moe => (&["layer_types"], &["full_attn_idxs"]),
        _ => (&["layer_types"], &[]),
    };
    for key in lists {
        if let Some(Value::Array(list)) = map.get(*key) {
            prop_assert_eq!(list.len(), n, "{} beside a plan of {} layers", key, n);
        }
    }
    if c.model_type == ModelType::NemotronH
        && let Some(Value::String(p)) = map.get("hybrid_override_pattern")
    {
        prop_assert_eq!(p.chars().count(), n);
        let plan: String = c.plan_line().split(' ').collect();
        prop_assert_eq!(&plan, p);
    }
    for key in indices {
        if let Some(Value::Array(list)) = map.get(*key) {
            for i in list {
                prop_assert!(
                    i.as_u64().is_some_and(|i| (i as usize) < n),
                    "{} = {}",
                    key,
                    i
                );
            }
        }
    }
    Ok(())
}
