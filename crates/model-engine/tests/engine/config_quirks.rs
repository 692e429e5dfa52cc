//! The spellings real configs use: older keys, bare non-finite numbers,
//! left-out defaults, and the per-family options the fixtures do not cover.

use crate::common;

use std::path::Path;

use common::{FIXTURES, fixture};
use metrale_core::DType;
use metrale_model_engine::config::{
    Activation, ExpertNames, FfnKind, FfnNames, MixerKind, MlpNames, ModelConfig, RopeScaling,
    load_config, parse_config,
};
use serde_json::{Map, Value, json};

/// A fixture's config.json with `edit` applied, as text. The string
/// `"__INF__"` becomes a bare `Infinity` and `"__NAN__"` a bare `NaN`.
fn variant_text(name: &str, edit: impl FnOnce(&mut Map<String, Value>)) -> String {
    let text = std::fs::read_to_string(fixture(name).join("config.json")).unwrap();
    let mut map: Map<String, Value> = serde_json::from_str(&text).unwrap();
    edit(&mut map);
    serde_json::to_string_pretty(&Value::Object(map))
        .unwrap()
        .replace("\"__INF__\"", "Infinity")
        .replace("\"__NAN__\"", "NaN")
}

fn variant(name: &str, edit: impl FnOnce(&mut Map<String, Value>)) -> ModelConfig {
    let text = variant_text(name, edit);
    parse_config(&text, Path::new("variant/config.json")).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

#[test]
fn older_llama_spelling_with_llama3_scaling() {
    let c = variant("llama", |m| {
        m.remove("rope_parameters");
        m.remove("dtype");
        m.insert("torch_dtype".into(), json!("bfloat16"));
        m.insert("rope_theta".into(), json!(500000.0));
        m.insert(
            "rope_scaling".into(),
            json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        );
        m.insert("eos_token_id".into(), json!([2, 9]));
        m.insert("bos_token_id".into(), json!(1));
    });
    let rope = c.attention.as_ref().unwrap().rope.clone().unwrap();
    assert_eq!(rope.theta, 500000.0);
    assert_eq!(
        rope.scaling,
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192
        }
    );
    assert_eq!(c.declared_dtype, Some(DType::BF16));
    assert_eq!(
        (c.bos_token_id, c.eos_token_ids.clone()),
        (Some(1), vec![2, 9])
    );
}

#[test]
fn linear_and_yarn_scaling() {
    let c = variant("llama", |m| {
        m.insert(
            "rope_parameters".into(),
            json!({"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
        );
    });
    assert_eq!(
        c.attention.unwrap().rope.unwrap().scaling,
        RopeScaling::Linear { factor: 2.0 }
    );
    let c = variant("qwen3", |m| {
        m.remove("rope_parameters");
        m.insert(
            "rope_scaling".into(),
            json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
        );
    });
    match c.attention.unwrap().rope.unwrap().scaling {
        RopeScaling::Yarn {
            factor,
            original_max_position,
            beta_fast,
            beta_slow,
            ..
        } => {
            assert_eq!(
                (factor, original_max_position, beta_fast, beta_slow),
                (4.0, 32768, 32.0, 1.0)
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn qwen2_and_mistral() {
    let q2 = variant("llama", |m| {
        m.insert("model_type".into(), json!("qwen2"));
        m.insert("use_sliding_window".into(), json!(false));
        m.insert("sliding_window".into(), json!(4096));
    });
    let a = q2.attention.as_ref().unwrap();
    assert!(a.qkv_bias && !a.o_bias);
    assert!(q2.layers.iter().all(|l| l.sliding_window.is_none()));
    let names = q2.expected_tensors();
    assert!(
        names
            .iter()
            .any(|t| t.name == "model.layers.0.self_attn.q_proj.bias" && t.shape == vec![64])
    );
    assert!(!names.iter().any(|t| t.name.ends_with("o_proj.bias")));

    let mistral = variant("llama", |m| {
        m.insert("model_type".into(), json!("mistral"));
    });
    let windows = |c: &ModelConfig| {
        c.layers
            .iter()
            .map(|l| l.sliding_window)
            .collect::<Vec<_>>()
    };
    assert_eq!(windows(&mistral), vec![Some(4096); 2]);
    let mistral = variant("llama", |m| {
        m.insert("model_type".into(), json!("mistral"));
        m.insert("sliding_window".into(), Value::Null);
    });
    assert_eq!(windows(&mistral), vec![None; 2]);

    // Qwen windows: from max_window_layers on, or where layer_types says so,
    // and only with use_sliding_window.
    let qwen = |edit: &dyn Fn(&mut serde_json::Map<String, Value>)| {
        variant("llama", |m| {
            m.insert("model_type".into(), json!("qwen3"));
            m.insert("head_dim".into(), json!(16));
            m.insert("sliding_window".into(), json!(8));
            m.insert("max_window_layers".into(), json!(1));
            edit(m);
        })
    };
    assert_eq!(windows(&qwen(&|_| {})), vec![None; 2]);
    let on = qwen(&|m| {
        m.insert("use_sliding_window".into(), json!(true));
    });
    assert_eq!(windows(&on), vec![None, Some(8)]);
    let listed = qwen(&|m| {
        m.insert("use_sliding_window".into(), json!(true));
        m.remove("max_window_layers");
        m.insert(
            "layer_types".into(),
            json!(["sliding_attention", "full_attention"]),
        );
    });
    assert_eq!(windows(&listed), vec![Some(8), None]);
    // Both keys, agreeing.
    let both = qwen(&|m| {
        m.insert("use_sliding_window".into(), json!(true));
        m.insert(
            "layer_types".into(),
            json!(["full_attention", "sliding_attention"]),
        );
    });
    assert_eq!(windows(&both), vec![None, Some(8)]);
    // Without windows neither key has an effect, so they cannot contradict.
    let off = qwen(&|m| {
        m.insert(
            "layer_types".into(),
            json!(["sliding_attention", "full_attention"]),
        );
    });
    assert_eq!(windows(&off), vec![None; 2]);
    assert!(on.warnings.is_empty() && both.warnings.is_empty());

    // Mistral applies its window to every layer whatever `layer_types`
    // says; transformers warns that it ignores the list, and so do we.
    let mistral = variant("llama", |m| {
        m.insert("model_type".into(), json!("mistral"));
        m.insert(
            "layer_types".into(),
            json!(["full_attention", "sliding_attention"]),
        );
    });
    assert_eq!(windows(&mistral), vec![Some(4096); 2]);
    assert_eq!(mistral.warnings.len(), 1, "{:?}", mistral.warnings);
    let w = &mistral.warnings[0];
    assert!(
        w.starts_with("variant/config.json: ")
            && w.contains("layer_types")
            && w.contains("ignored"),
        "{w}"
    );
    let text = variant_text("llama", |m| {
        m.insert("model_type".into(), json!("qwen2"));
        m.insert(
            "layer_types".into(),
            json!(["full_attention", "chunked_attention"]),
        );
    });
    let err = parse_config(&text, Path::new("q/config.json"))
        .expect_err("an unknown layer type")
        .to_string();
    assert!(err.contains("chunked_attention"), "{err}");
}

#[test]
fn nemotron_h_hybrid_override_pattern() {
    let c = variant("nemotron_h", |m| {
        m.remove("layers_block_type");
        m.remove("head_dim");
        m.remove("dtype");
        m.insert("hybrid_override_pattern".into(), json!("M-M*-"));
        m.insert("num_hidden_layers".into(), json!(5));
        m.insert("attention_head_dim".into(), json!(16));
        m.insert("torch_dtype".into(), json!("bfloat16"));
        m.insert("time_step_limit".into(), json!([0.0, "__INF__"]));
    });
    assert_eq!(c.plan_line(), "M - M * -");
    assert_eq!(c.attention.as_ref().unwrap().head_dim, 16);
    // Nemotron-H's HF mixer clamps dt at time_step_min from below only.
    assert_eq!(
        c.mamba.as_ref().unwrap().time_step_limit,
        (0.001, f32::INFINITY)
    );
    assert_eq!(c.declared_dtype, Some(DType::BF16));
    assert_eq!(
        (c.layers[1].mixer, c.layers[1].ffn),
        (MixerKind::None, FfnKind::Mlp)
    );

    // The older list spelling.
    let c = variant("nemotron_h", |m| {
        m.insert(
            "layers_block_type".into(),
            json!(["mamba", "attention", "mamba", "mlp"]),
        );
    });
    assert_eq!(c.plan_line(), "M * M -");
}

#[test]
fn nemotron_h_spellings_that_agree() {
    // All three spellings at once, old and new names: they describe the
    // same layers, so the config is fine.
    let c = variant("nemotron_h", |m| {
        m.insert(
            "layer_types".into(),
            json!(["mamba", "attention", "mamba", "mlp"]),
        );
        m.insert("hybrid_override_pattern".into(), json!("M*M-"));
        m.insert("num_hidden_layers".into(), json!(4));
    });
    assert_eq!(c.plan_line(), "M * M -");
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
}

#[test]
fn nemotron_h_stale_num_hidden_layers_warns_and_the_list_wins() {
    // transformers 5 takes the layer count from the block list and ignores
    // `num_hidden_layers`; metrale does the same and says so.
    let c = variant("nemotron_h", |m| {
        m.insert("num_hidden_layers".into(), json!(9));
    });
    assert_eq!(c.plan_line(), "M * M -");
    assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
    let w = &c.warnings[0];
    for needle in [
        "variant/config.json: ",
        "num_hidden_layers is 9",
        "`layers_block_type` describes 4 layers",
    ] {
        assert!(w.contains(needle), "{needle:?} missing from {w:?}");
    }
    let c = variant("nemotron_h", |m| {
        m.remove("layers_block_type");
        m.insert("hybrid_override_pattern".into(), json!("M*M-E"));
        m.insert("num_hidden_layers".into(), json!(4));
    });
    assert_eq!(c.plan_line(), "M * M - E");
    assert!(
        c.warnings.len() == 1 && c.warnings[0].contains("`hybrid_override_pattern` describes 5"),
        "{:?}",
        c.warnings
    );
}

#[test]
fn layer_lists_beside_what_they_could_be_derived_from() {
    // granitemoehybrid: `layer_types` and its alias, agreeing.
    let c = variant("granitemoehybrid", |m| {
        m.insert(
            "layers_block_type".into(),
            json!(["mamba", "attention", "mamba"]),
        );
    });
    assert_eq!(c.plan_line(), "M * M");
    // qwen3_next: the list and the interval it follows.
    let c = variant("qwen3_next", |m| {
        m.insert("full_attention_interval".into(), json!(4));
    });
    assert_eq!(c.plan_line(), "G G G *");
    // bamba: a list saying what attn_layer_indices says.
    let c = variant("bamba", |m| {
        m.insert(
            "layers_block_type".into(),
            json!(["linear_attention", "full_attention", "linear_attention"]),
        );
    });
    assert_eq!(c.plan_line(), "M * M");
    // mamba2: mamba_ssm's layer count beside transformers', and a list of Mamba layers.
    let c = variant("mamba2", |m| {
        m.insert("n_layer".into(), json!(2));
        m.insert("layer_types".into(), json!(["mamba", "linear_attention"]));
    });
    assert_eq!(c.plan_line(), "M M");
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
}

#[test]
fn layer_indices_listed_twice_count_once_with_a_warning() {
    let c = variant("bamba", |m| {
        m.insert("attn_layer_indices".into(), json!([1, 1, 1]));
    });
    assert_eq!(c.plan_line(), "M * M");
    assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
    assert!(
        c.warnings[0].contains("attn_layer_indices") && c.warnings[0].contains("layer 1"),
        "{:?}",
        c.warnings
    );
    let c = variant("qwen3_next", |m| {
        m.insert("mlp_only_layers".into(), json!([3, 1, 3]));
    });
    let ffns: Vec<FfnKind> = c.layers.iter().map(|l| l.ffn).collect();
    assert_eq!(
        ffns,
        vec![FfnKind::Moe, FfnKind::Mlp, FfnKind::Moe, FfnKind::Mlp]
    );
    assert!(
        c.warnings.len() == 1 && c.warnings[0].contains("mlp_only_layers"),
        "{:?}",
        c.warnings
    );
}

#[test]
fn unknown_dtype_is_a_warning() {
    let c = variant("llama", |m| {
        m.insert("dtype".into(), json!("float8_e4m3fn"));
    });
    assert_eq!(c.declared_dtype, None);
    assert!(
        c.warnings.len() == 1 && c.warnings[0].contains("float8_e4m3fn"),
        "{:?}",
        c.warnings
    );
}

#[test]
fn fixtures_have_no_warnings() {
    for name in FIXTURES {
        let c = load_config(&fixture(name)).unwrap();
        assert!(c.warnings.is_empty(), "{name}: {:?}", c.warnings);
    }
}

#[test]
fn two_spellings_of_one_setting_that_agree() {
    // Published Nemotron-H configs carry both epsilons; values are compared
    // as numbers, however written.
    let c = variant("nemotron_h", |m| {
        m.insert("rms_norm_eps".into(), json!(0.00001));
        m.insert("mamba_n_groups".into(), json!(2.0));
        m.insert("mamba_dt_limit".into(), json!([0.0, "Infinity"]));
        m.insert("attention_head_dim".into(), json!(16));
    });
    assert_eq!(c.norm_eps, 1e-5);
    assert_eq!(c.mamba.as_ref().unwrap().n_groups, 2);
    let c = variant("mamba2", |m| {
        m.insert("d_state".into(), json!(16));
        m.insert("ngroups".into(), json!(2));
        m.insert("d_model".into(), json!(64));
    });
    assert_eq!(c.mamba.as_ref().unwrap().d_state, 16);
}

#[test]
fn granite_older_spelling_nope_and_bare_infinity() {
    let c = variant("granitemoehybrid", |m| {
        m.insert("layer_types".into(), json!(["mamba", "attention", "mamba"]));
        m.insert("position_embedding_type".into(), json!("nope"));
        m.insert("time_step_limit".into(), json!([0.0, "__INF__"]));
        m.insert("initializer_range".into(), json!("__NAN__"));
    });
    assert_eq!(c.plan_line(), "M * M");
    assert!(c.attention.as_ref().unwrap().rope.is_none());
    assert_eq!(c.mamba.as_ref().unwrap().time_step_limit.1, f32::INFINITY);
}

#[test]
fn granite_dense_without_experts() {
    let c = variant("granitemoehybrid", |m| {
        m.insert("num_local_experts".into(), json!(0));
    });
    assert!(c.moe.is_none());
    assert_eq!(c.mlp.as_ref().unwrap().intermediate_size, 96);
    assert_eq!(c.mlp.as_ref().unwrap().activation, Activation::SwiGlu);
    assert!(c.layers.iter().all(|l| l.ffn == FfnKind::Mlp));
    match &c.layers[0].names.ffn {
        FfnNames::Mlp(MlpNames::Fused { gate_up, .. }) => {
            assert_eq!(gate_up, "model.layers.0.shared_mlp.input_linear.weight")
        }
        other => panic!("{other:?}"),
    }
    let shapes = c.expected_tensors();
    assert!(shapes.iter().any(
        |t| t.name == "model.layers.0.shared_mlp.input_linear.weight" && t.shape == vec![192, 64]
    ));
    assert!(!shapes.iter().any(|t| t.name.contains("block_sparse_moe")));
}

#[test]
fn granite_moe_layout() {
    let c = load_config(&fixture("granitemoehybrid")).unwrap();
    match &c.layers[2].names.ffn {
        FfnNames::Moe(m) => {
            assert!(matches!(m.experts, ExpertNames::Fused { .. }));
            assert!(matches!(m.shared, Some(MlpNames::Fused { .. })));
            assert_eq!(
                m.router,
                "model.layers.2.block_sparse_moe.router.layer.weight"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn bamba_default_partial_rotary() {
    // Older Bamba configs state neither rope_parameters nor the factor.
    let c = variant("bamba", |m| {
        m.remove("rope_parameters");
        m.insert("rope_theta".into(), json!(10000.0));
        m.remove("time_step_limit");
    });
    let rope = c.attention.as_ref().unwrap().rope.clone().unwrap();
    assert_eq!(rope.rotary_dim, 8, "half of head_dim 16");
    assert_eq!(
        c.mamba.as_ref().unwrap().time_step_limit,
        (0.0, f32::INFINITY)
    );
}

#[test]
fn qwen3_next_older_spelling_and_defaults() {
    let c = variant("qwen3_next", |m| {
        m.remove("layer_types");
        m.remove("rope_parameters");
        m.insert("rope_theta".into(), json!(10000000));
        m.insert("full_attention_interval".into(), json!(4));
        m.insert("decoder_sparse_step".into(), json!(2));
        m.insert("mlp_only_layers".into(), json!([3]));
    });
    assert_eq!(c.plan_line(), "G G G *");
    let rope = c.attention.as_ref().unwrap().rope.clone().unwrap();
    assert_eq!(
        (rope.theta, rope.rotary_dim),
        (1e7, 4),
        "partial_rotary_factor defaults to 0.25"
    );
    let ffns: Vec<FfnKind> = c.layers.iter().map(|l| l.ffn).collect();
    assert_eq!(
        ffns,
        vec![FfnKind::Mlp, FfnKind::Moe, FfnKind::Mlp, FfnKind::Mlp]
    );
    assert_eq!(c.mlp.as_ref().unwrap().intermediate_size, 128);
}

#[test]
fn generation_config_eos_ids_are_merged() {
    let dir = std::env::temp_dir().join(format!("metrale-quirks-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        fixture("llama").join("config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"eos_token_id": [2, 7], "bos_token_id": 1}"#,
    )
    .unwrap();
    let c = load_config(&dir).unwrap();
    assert_eq!(c.eos_token_ids, vec![2, 7]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn mamba2_bare_nonfinite_numbers() {
    let c = variant("mamba2", |m| {
        m.insert("time_step_limit".into(), json!([0.0, "__INF__"]));
        m.insert("time_step_floor".into(), json!("__NAN__"));
    });
    assert_eq!(
        c.mamba.as_ref().unwrap().time_step_limit,
        (0.0, f32::INFINITY)
    );
    let c = variant("mamba2", |m| {
        m.insert("time_step_limit".into(), json!([0.001, 0.1]));
    });
    assert_eq!(c.mamba.as_ref().unwrap().time_step_limit, (0.001, 0.1));
}
