//! Keys that describe the layers twice must agree, layer indices must name
//! layers that exist, and two spellings of one setting must say the same:
//! each case is an error naming the file and both keys (transformers
//! silently uses one key, or errors itself). Property tests check the rule
//! against an oracle per family.

use crate::common;

use std::path::Path;

use common::*;
use metrale_model_engine::config::{FfnKind, ModelConfig, parse_config};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use serde_json::{Map, Value, json};

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
