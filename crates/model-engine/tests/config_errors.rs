//! Broken configs give clear errors naming the file and the key; mutated
//! configs never panic, and whatever loads is released completely.

use std::path::{Path, PathBuf};

use metrale_core::scope::ModelResource;
use metrale_gpu_runtime::GpuBackend;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_model_engine::EngineError;
use metrale_model_engine::config::{FfnKind, ModelConfig, ModelType, load_config, parse_config};
use metrale_model_engine::loader::load_weights;
use metrale_model_weights::WeightsError;
use metrale_model_weights::loader::WeightDType;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
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
fn two_spellings_of_one_setting_that_disagree() {
    // Nemotron-H's `mamba_*` spellings: transformers lets them override the
    // short keys, metrale read the short keys first.
    config_err(
        "nemotron_h",
        |m| drop(m.insert("mamba_n_groups".into(), json!(4))),
        &["n_groups", "mamba_n_groups", "(2)", "(4)"],
    );
    // `num_local_experts` is transformers' alias of `n_routed_experts`
    // (and the one it keeps).
    config_err(
        "nemotron_h",
        |m| {
            m.insert("layers_block_type".into(), json!(["moe"]));
            m.insert("num_local_experts".into(), json!(4));
        },
        &["n_routed_experts", "num_local_experts"],
    );
    config_err(
        "nemotron_h",
        |m| drop(m.insert("attention_head_dim".into(), json!(8))),
        &["head_dim", "attention_head_dim"],
    );
    // mamba_ssm's spellings, which transformers does not read at all.
    config_err(
        "mamba2",
        |m| drop(m.insert("d_state".into(), json!(8))),
        &["state_size", "d_state"],
    );
    config_err(
        "mamba2",
        |m| drop(m.insert("d_model".into(), json!(128))),
        &["hidden_size", "d_model"],
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
const LAYER_KEYS: [&str; 12] = [
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
    let n = c.num_layers();
    let (lists, indices): (&[&str], &[&str]) = match c.model_type {
        ModelType::NemotronH => (&["layers_block_type", "layer_types"], &[]),
        ModelType::GraniteMoeHybrid => (&["layer_types", "layers_block_type"], &[]),
        ModelType::Bamba => (
            &["layer_types", "layers_block_type"],
            &["attn_layer_indices"],
        ),
        ModelType::Qwen3Next => (&["layer_types"], &["mlp_only_layers"]),
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

/// A config edited by `edit`, parsed.
fn parse_edited(
    name: &str,
    edit: impl FnOnce(&mut Map<String, Value>),
) -> Result<ModelConfig, String> {
    let mut map = config_map(name);
    edit(&mut map);
    parse_config(&Value::Object(map).to_string(), Path::new("/m/config.json"))
        .map_err(|e| e.to_string())
}

/// Asserts an error that names the file and every one of `keys`.
fn names_all(result: &Result<ModelConfig, String>, keys: &[&str]) -> Result<(), TestCaseError> {
    match result {
        Ok(c) => prop_assert!(false, "accepted, plan {}", c.plan_line()),
        Err(e) => {
            prop_assert!(e.contains("/m/config.json"), "{}", e);
            for k in keys {
                prop_assert!(e.contains(k), "{:?} should name {:?}", e, k);
            }
        }
    }
    Ok(())
}

/// Fixture, key, and another spelling of it that metrale also reads.
const SPELLINGS: [(&str, &str, &str); 10] = [
    ("nemotron_h", "n_groups", "mamba_n_groups"),
    ("nemotron_h", "conv_kernel", "mamba_d_conv"),
    ("nemotron_h", "chunk_size", "mamba_chunk_size"),
    ("nemotron_h", "layer_norm_epsilon", "rms_norm_eps"),
    ("nemotron_h", "head_dim", "attention_head_dim"),
    ("mamba2", "state_size", "d_state"),
    ("mamba2", "n_groups", "ngroups"),
    ("mamba2", "conv_kernel", "d_conv"),
    ("mamba2", "hidden_size", "d_model"),
    ("mamba2", "num_hidden_layers", "n_layer"),
];

const BLOCKS: [(&str, &str, char); 4] = [
    ("linear_attention", "mamba", 'M'),
    ("full_attention", "attention", '*'),
    ("mlp", "mlp", '-'),
    ("moe", "moe", 'E'),
];

fn blocks() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(0usize..4, 1..6)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Nemotron-H: a second spelling of the block list (the alias in the old
    /// names, or the pattern) is accepted exactly when it describes the same
    /// layers; a stale num_hidden_layers only warns.
    #[test]
    fn nemotron_h_second_spelling(a in blocks(), b in blocks(), same in any::<bool>(), pattern in any::<bool>(), n in 1usize..8) {
        let b = if same { a.clone() } else { b };
        let other = if pattern { "hybrid_override_pattern" } else { "layer_types" };
        let result = parse_edited("nemotron_h", |m| {
            m.insert("layers_block_type".into(), json!(a.iter().map(|&k| BLOCKS[k].0).collect::<Vec<_>>()));
            m.insert("num_hidden_layers".into(), json!(n));
            if pattern {
                m.insert(other.into(), json!(b.iter().map(|&k| BLOCKS[k].2).collect::<String>()));
            } else {
                m.insert(other.into(), json!(b.iter().map(|&k| BLOCKS[k].1).collect::<Vec<_>>()));
            }
        });
        if a == b {
            let c = result.map_err(TestCaseError::fail)?;
            prop_assert_eq!(c.plan_line(), a.iter().map(|&k| match BLOCKS[k].2 { 'M' => "M", '*' => "*", '-' => "-", _ => "E" }).collect::<Vec<_>>().join(" "));
            prop_assert_eq!(c.warnings.len(), usize::from(n != a.len()));
        } else {
            names_all(&result, &["layers_block_type", other])?;
        }
    }

    /// granitemoehybrid: `layer_types` and `layers_block_type` must each list
    /// num_hidden_layers layers and agree.
    #[test]
    fn granite_alias(a in prop::collection::vec(0usize..2, 1..5), b in prop::collection::vec(0usize..2, 1..5), same in any::<bool>()) {
        let b = if same { a.clone() } else { b };
        let spell = |v: &[usize], old: bool| json!(v.iter().map(|&k| if old { BLOCKS[k].1 } else { BLOCKS[k].0 }).collect::<Vec<_>>());
        let result = parse_edited("granitemoehybrid", |m| {
            m.insert("layer_types".into(), spell(&a, false));
            m.insert("layers_block_type".into(), spell(&b, true));
        });
        if a.len() != 3 {
            names_all(&result, &["layer_types", "num_hidden_layers"])?;
        } else if b.len() != 3 {
            names_all(&result, &["layers_block_type", "num_hidden_layers"])?;
        } else if a != b {
            names_all(&result, &["layer_types", "layers_block_type"])?;
        } else {
            prop_assert!(result.is_ok(), "{:?}", result.err());
        }
    }

    /// qwen3_next: `layer_types` beside `full_attention_interval`, and
    /// `mlp_only_layers` indices (4 layers).
    #[test]
    fn qwen3_next_interval_and_indices(a in prop::collection::vec(0usize..2, 4), interval in 1usize..6, mlp_only in prop::collection::vec(0usize..6, 0..4)) {
        let result = parse_edited("qwen3_next", |m| {
            m.insert("layer_types".into(), json!(a.iter().map(|&k| BLOCKS[k].0).collect::<Vec<_>>()));
            m.insert("full_attention_interval".into(), json!(interval));
            m.insert("mlp_only_layers".into(), json!(mlp_only));
        });
        let derived: Vec<usize> = (0..4).map(|i| usize::from((i + 1) % interval == 0)).collect();
        if a != derived {
            names_all(&result, &["layer_types", "full_attention_interval"])?;
        } else if mlp_only.iter().any(|&i| i >= 4) {
            names_all(&result, &["mlp_only_layers", "num_hidden_layers"])?;
        } else {
            let c = result.map_err(TestCaseError::fail)?;
            // One warning per index listed more than once.
            let repeated = (0..4).filter(|i| mlp_only.iter().filter(|&j| j == i).count() > 1).count();
            prop_assert_eq!(c.warnings.len(), repeated);
            for (i, l) in c.layers.iter().enumerate() {
                prop_assert_eq!(l.ffn == FfnKind::Mlp, mlp_only.contains(&i));
            }
        }
    }

    /// bamba: `attn_layer_indices` within the 3 layers, and a layer list
    /// beside it only when it agrees.
    #[test]
    fn bamba_indices_and_list(attn in prop::collection::vec(0usize..5, 0..4), list in prop::option::of(prop::collection::vec(0usize..2, 3)), key in prop::sample::select(vec!["layer_types", "layers_block_type"])) {
        let result = parse_edited("bamba", |m| {
            m.insert("attn_layer_indices".into(), json!(attn));
            if let Some(list) = &list {
                m.insert(key.into(), json!(list.iter().map(|&k| BLOCKS[k].1).collect::<Vec<_>>()));
            }
        });
        let derived: Vec<usize> = (0..3).map(|i| usize::from(attn.contains(&i))).collect();
        if attn.iter().any(|&i| i >= 3) {
            names_all(&result, &["attn_layer_indices", "num_hidden_layers"])?;
        } else if list.as_ref().is_some_and(|l| *l != derived) {
            names_all(&result, &[key, "attn_layer_indices"])?;
        } else {
            let c = result.map_err(TestCaseError::fail)?;
            let plan: Vec<&str> = derived.iter().map(|&k| if k == 1 { "*" } else { "M" }).collect();
            prop_assert_eq!(c.plan_line(), plan.join(" "));
        }
    }

    /// qwen2 / qwen3: with windows on, `layer_types` and `max_window_layers`
    /// must agree; with windows off neither has an effect.
    #[test]
    fn qwen_windows(a in prop::collection::vec(any::<bool>(), 2), from in 0usize..4, on in any::<bool>(), qwen2 in any::<bool>()) {
        let result = parse_edited("qwen3", |m| {
            m.insert("model_type".into(), json!(if qwen2 { "qwen2" } else { "qwen3" }));
            m.insert("use_sliding_window".into(), json!(on));
            m.insert("sliding_window".into(), json!(8));
            m.insert("max_window_layers".into(), json!(from));
            m.insert("layer_types".into(), json!(a.iter().map(|&s| if s { "sliding_attention" } else { "full_attention" }).collect::<Vec<_>>()));
        });
        let derived: Vec<bool> = (0..2).map(|i| i >= from).collect();
        if on && a != derived {
            names_all(&result, &["layer_types", "max_window_layers"])?;
        } else {
            let c = result.map_err(TestCaseError::fail)?;
            let windows: Vec<Option<usize>> = c.layers.iter().map(|l| l.sliding_window).collect();
            let expected: Vec<Option<usize>> = a.iter().map(|&s| (on && s).then_some(8)).collect();
            prop_assert_eq!(windows, expected);
        }
    }

    /// Two spellings of one setting: accepted when they agree (however the
    /// number is written), an error naming both otherwise.
    #[test]
    fn two_spellings(pair in 0usize..SPELLINGS.len(), same in any::<bool>(), delta in 1u32..4) {
        let (name, a, b) = SPELLINGS[pair];
        let x = config_map(name)[a].as_f64().expect("a number");
        let y = if same { x } else { x + f64::from(delta) };
        let result = parse_edited(name, |m| drop(m.insert(b.into(), json!(y))));
        if same {
            prop_assert!(result.is_ok(), "{:?}", result.err());
        } else {
            names_all(&result, &[a, b])?;
        }
    }

    /// mamba2: `n_layer` beside `num_hidden_layers` (2).
    #[test]
    fn mamba2_layer_count(n in 0usize..5) {
        let result = parse_edited("mamba2", |m| drop(m.insert("n_layer".into(), json!(n))));
        if n == 2 {
            prop_assert!(result.is_ok(), "{:?}", result.err());
        } else {
            names_all(&result, &["num_hidden_layers", "n_layer"])?;
        }
    }
}
