//! Qwen3.5's two nestings (the vision-language wrapper with `text_config`,
//! the language model alone), what each reads from where, the parts of the
//! checkpoint set aside, and the contradictions refused.

use crate::common;

use common::*;
use metrale_core::scope::ModelResource;
use metrale_gpu_runtime::GpuBackend;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_model_engine::config::{FfnKind, MixerKind, ModelType, load_config};
use metrale_model_engine::loader::load_weights;
use metrale_model_weights::loader::{LoadProgress, WeightDType};
use serde_json::json;

#[test]
fn the_wrapper_reads_text_config_and_the_language_model_prefix() {
    let c = load_config(&fixture("qwen3_5")).unwrap();
    assert_eq!(c.model_type, ModelType::Qwen35);
    assert_eq!(c.norm_weight_offset, 1.0);
    assert_eq!(c.names.embed, "model.language_model.embed_tokens.weight");
    assert_eq!(c.names.final_norm, "model.language_model.norm.weight");
    assert_eq!(c.names.lm_head.as_deref(), Some("lm_head.weight"));
    let a = c.attention.as_ref().unwrap();
    assert!(a.output_gate && a.qk_norm);
    // A quarter of 32 channels rotated; mrope [2, 1, 1] shares out its 4 frequencies.
    assert_eq!((a.head_dim, a.rope.as_ref().unwrap().rotary_dim), (32, 8));
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    assert!(c.layers.iter().all(|l| l.ffn == FfnKind::Mlp));
    assert_eq!(c.mlp.as_ref().unwrap().intermediate_size, 128);
    // The vision tower and one MTP layer set aside; the MTP layer's tensors named.
    let parts: Vec<&str> = c.aside.iter().map(|p| p.what).collect();
    assert_eq!(parts, ["vision tower", "multi-token prediction layers"]);
    let mtp = &c.aside[1].expected;
    assert!(
        mtp.iter()
            .any(|t| t.name == "mtp.fc.weight" && t.shape == [64, 128])
    );
    assert!(
        mtp.iter()
            .any(|t| t.name == "mtp.layers.0.self_attn.q_proj.weight" && t.shape == [256, 64])
    );
    assert_eq!(mtp.len(), 4 + 11);
}

#[test]
fn the_language_model_alone_is_flat() {
    let c = load_config(&fixture("qwen3_5_moe")).unwrap();
    assert_eq!(c.model_type, ModelType::Qwen35Moe);
    assert_eq!(c.names.embed, "model.embed_tokens.weight");
    assert!(c.tie_word_embeddings && c.names.lm_head.is_none());
    assert_eq!(
        c.layers.iter().map(|l| l.mixer).collect::<Vec<_>>(),
        [
            MixerKind::GatedDeltaNet,
            MixerKind::Attention,
            MixerKind::GatedDeltaNet,
            MixerKind::Attention
        ]
    );
    let moe = c.moe.as_ref().unwrap();
    assert_eq!(
        (
            moe.n_experts,
            moe.top_k,
            moe.expert_intermediate,
            moe.shared_intermediate
        ),
        (4, 2, 32, Some(48))
    );
    assert!(moe.norm_topk_prob && moe.shared_expert_gate);
    assert!(c.mlp.is_none());
}

#[test]
fn contradictions_and_missing_nesting_are_refused() {
    config_err(
        "qwen3_5",
        |m| drop(m.remove("text_config")),
        &["text_config", "qwen3_5_text"],
    );
    config_err(
        "qwen3_5",
        |m| {
            m["text_config"]["model_type"] = json!("qwen3_5_moe_text");
        },
        &["model_type", "text_config.model_type", "qwen3_5_moe_text"],
    );
    config_err(
        "qwen3_5",
        |m| {
            m["text_config"]["full_attention_interval"] = json!(2);
        },
        &["layer_types", "full_attention_interval"],
    );
    config_err(
        "qwen3_5",
        |m| {
            m["text_config"]["rope_parameters"]["mrope_section"] = json!([1, "x"]);
        },
        &["mrope_section"],
    );
}

#[test]
fn what_transformers_ignores_is_a_warning() {
    let mut map = config_map("qwen3_5_moe");
    map.insert("norm_topk_prob".into(), json!(false));
    map.insert("mlp_only_layers".into(), json!([1]));
    map["rope_parameters"]["mrope_section"] = json!([1, 1, 1]);
    let c = metrale_model_engine::config::parse_config(
        &serde_json::Value::Object(map).to_string(),
        std::path::Path::new("/m/config.json"),
    )
    .unwrap();
    let all = c.warnings.join("\n");
    assert!(all.contains("`norm_topk_prob`"), "{all}");
    // The wrapper's two tie keys differing (as transformers itself saves
    // them): the top level's wins, without a word.
    let mut map = config_map("qwen3_5");
    map.insert("tie_word_embeddings".into(), json!(true));
    let wrapped = metrale_model_engine::config::parse_config(
        &serde_json::Value::Object(map).to_string(),
        std::path::Path::new("/m/config.json"),
    )
    .unwrap();
    assert!(wrapped.tie_word_embeddings && wrapped.names.lm_head.is_none());
    assert!(wrapped.warnings.is_empty(), "{:?}", wrapped.warnings);
    assert!(all.contains("`mlp_only_layers`"), "{all}");
    assert!(all.contains("mrope_section") && all.contains("3"), "{all}");
    assert!(c.moe.as_ref().unwrap().norm_topk_prob);
}

/// MTP layers the config counts but the checkpoint lacks are reported (a
/// warning naming the tensor); the model still loads.
#[test]
fn mtp_layers_are_checked_not_loaded() {
    let path = std::env::temp_dir().join(format!("metrale-mtp-{}", std::process::id()));
    std::fs::create_dir_all(&path).unwrap();
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(fixture("qwen3_5").join(f), path.join(f)).unwrap();
    }
    let mut map = config_map("qwen3_5");
    map["text_config"]["mtp_num_hidden_layers"] = json!(2);
    std::fs::write(
        path.join("config.json"),
        serde_json::Value::Object(map).to_string(),
    )
    .unwrap();
    let config = load_config(&path).unwrap();
    let gpu = CpuBackend::new();
    let mut warnings = Vec::new();
    let mut store = load_weights(&path, &config, &gpu, WeightDType::AsStored, &mut |p| {
        if let LoadProgress::Warning(w) = p {
            warnings.push(w);
        }
    })
    .unwrap();
    let mtp: Vec<&String> = warnings.iter().filter(|w| w.contains("mtp.")).collect();
    assert_eq!(mtp.len(), 1, "{warnings:?}");
    assert!(
        mtp[0].contains("11 of the 26 tensors") && mtp[0].contains("mtp.layers.1."),
        "{}",
        mtp[0]
    );
    // Nothing of them is on the device.
    assert_eq!(store.len(), config.expected_tensors().len());
    store.release(&gpu).unwrap();
    assert_eq!(gpu.live_bytes(), 0);
    std::fs::remove_dir_all(&path).unwrap();
}
