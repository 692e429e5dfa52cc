//! LFM2's config: the layer kinds from `layer_types` or `full_attn_idxs`,
//! the MLP width's adjustment, the aliases published configs use, and the
//! contradictions refused.

use crate::common;

use common::*;
use metrale_model_engine::config::{MixerKind, ModelConfig, ModelType, load_config, parse_config};
use serde_json::{Map, Value, json};

fn parse(map: Map<String, Value>) -> ModelConfig {
    parse_config(
        &Value::Object(map).to_string(),
        std::path::Path::new("/m/config.json"),
    )
    .unwrap()
}

#[test]
fn the_fixture_reads_as_transformers_builds_it() {
    let c = load_config(&fixture("lfm2")).unwrap();
    assert_eq!(c.model_type, ModelType::Lfm2);
    assert_eq!(c.plan_line(), "C C * C");
    assert_eq!(c.names.final_norm, "model.embedding_norm.weight");
    assert!(c.tie_word_embeddings && c.names.lm_head.is_none());
    // 2/3 of 144 = 96, already a multiple of 32.
    assert_eq!(c.mlp.as_ref().unwrap().intermediate_size, 96);
    let conv = c.short_conv.as_ref().unwrap();
    assert_eq!((conv.kernel, conv.bias), (3, false));
    let a = c.attention.as_ref().unwrap();
    assert!(a.qk_norm && !a.output_gate);
    assert_eq!(a.rope.as_ref().unwrap().theta, 1_000_000.0);
    assert_eq!(c.norm_eps, 1e-5);
    // Three conv layers of 64 channels keep 2 inputs each.
    assert_eq!(c.recurrent_bytes_per_sequence(), 3 * 64 * 2 * 4);
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
}

#[test]
fn the_published_spellings() {
    // LFM2-350M's keys: `block_ff_dim`, `full_attn_idxs`, no `layer_types`,
    // no `tie_word_embeddings` (tied by default).
    let mut m = config_map("lfm2");
    for k in ["layer_types", "intermediate_size", "tie_word_embeddings"] {
        m.remove(k);
    }
    m.insert("full_attn_idxs".into(), json!([2]));
    m.insert("block_ff_dim".into(), json!(144));
    m.insert("block_multiple_of".into(), json!(256));
    let c = parse(m.clone());
    assert_eq!(c.plan_line(), "C C * C");
    // 96 rounded up to 256.
    assert_eq!(c.mlp.as_ref().unwrap().intermediate_size, 256);
    assert!(c.tie_word_embeddings);
    // No adjustment: the width as given; a null multiplier skips the rounding.
    m.insert("block_auto_adjust_ff_dim".into(), json!(false));
    assert_eq!(parse(m.clone()).mlp.unwrap().intermediate_size, 144);
    m.insert("block_auto_adjust_ff_dim".into(), json!(true));
    m.insert("block_ffn_dim_multiplier".into(), Value::Null);
    assert_eq!(parse(m.clone()).mlp.unwrap().intermediate_size, 96);
    // Neither list: every layer attention, as transformers builds it.
    m.remove("full_attn_idxs");
    let c = parse(m);
    assert!(c.layers.iter().all(|l| l.mixer == MixerKind::Attention));
    assert!(c.short_conv.is_none());
}

#[test]
fn contradictions_are_refused() {
    config_err(
        "lfm2",
        |m| drop(m.insert("full_attn_idxs".into(), json!([1]))),
        &["layer_types", "full_attn_idxs", "layer 1"],
    );
    config_err(
        "lfm2",
        |m| drop(m.insert("block_ff_dim".into(), json!(200))),
        &["intermediate_size", "block_ff_dim"],
    );
    config_err(
        "lfm2",
        |m| drop(m.insert("tie_embedding".into(), json!(false))),
        &["tie_word_embeddings", "tie_embedding"],
    );
    config_err(
        "lfm2",
        |m| {
            drop(m.insert(
                "layer_types".into(),
                json!(["conv", "mamba", "conv", "conv"]),
            ))
        },
        &["layer_types", "\"mamba\""],
    );
    config_err(
        "lfm2",
        |m| drop(m.insert("conv_L_cache".into(), json!(1))),
        &["conv_L_cache"],
    );
}

#[test]
fn lfm2_moe_routes_by_sigmoid_with_the_expert_bias() {
    use metrale_model_engine::config::{FfnKind, Routing};
    let c = load_config(&fixture("lfm2_moe")).unwrap();
    assert_eq!(c.model_type, ModelType::Lfm2Moe);
    assert_eq!(
        c.layers.iter().map(|l| l.ffn).collect::<Vec<_>>(),
        [FfnKind::Mlp, FfnKind::Moe, FfnKind::Moe, FfnKind::Moe]
    );
    // The dense layer's width as given (no LFM2 adjustment).
    assert_eq!(c.mlp.as_ref().unwrap().intermediate_size, 96);
    let m = c.moe.as_ref().unwrap();
    assert_eq!((m.n_experts, m.top_k, m.expert_intermediate), (4, 2, 32));
    assert_eq!(
        m.routing,
        Routing::SigmoidGrouped {
            n_group: 1,
            topk_group: 1,
            scale: 1.5,
            renorm_eps: 1e-6
        }
    );
    assert!(m.norm_topk_prob && m.shared_intermediate.is_none());
    assert!(!c.tie_word_embeddings);
    // transformers reads only `layer_types` here.
    config_err(
        "lfm2_moe",
        |m| drop(m.remove("layer_types")),
        &["layer_types"],
    );
    // Without the expert bias, no bias tensor is named.
    let mut map = config_map("lfm2_moe");
    map.insert("use_expert_bias".into(), json!(false));
    let c = parse(map);
    let names: Vec<String> = c.expected_tensors().into_iter().map(|t| t.name).collect();
    assert!(!names.iter().any(|n| n.ends_with("expert_bias")));
}

#[test]
fn lfm2_vl_reads_its_language_model() {
    let c = load_config(&fixture("lfm2_vl")).unwrap();
    assert_eq!(c.model_type, ModelType::Lfm2);
    assert_eq!(c.names.embed, "model.language_model.embed_tokens.weight");
    assert_eq!(c.names.lm_head.as_deref(), Some("lm_head.weight"));
    assert_eq!(c.aside[0].prefixes.len(), 2);
    config_err(
        "lfm2_vl",
        |m| drop(m.remove("text_config")),
        &["text_config"],
    );
    config_err(
        "lfm2_vl",
        |m| m["text_config"]["model_type"] = json!("lfm2_moe"),
        &["text_config.model_type", "lfm2_moe"],
    );
}
