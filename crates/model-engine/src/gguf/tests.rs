use metrale_core::quant::GgmlType;
use metrale_model_weights::gguf::{GgufFile, GgufValue, GgufWriter};

use super::*;
use metrale_model_weights::gguf::mix::FileType;

fn file(arch: &str, extra: &[(&str, GgufValue)]) -> GgufFile {
    let mut w = GgufWriter::new();
    w.add("general.architecture", GgufValue::String(arch.into()));
    for (k, v) in extra {
        w.add(k.replace("{a}", arch), v.clone());
    }
    w.add_tensor("token_embd.weight", GgmlType::F32, &[8, 4], vec![0u8; 128]);
    GgufFile::from_bytes("test.gguf", w.to_bytes().unwrap()).unwrap()
}

#[test]
fn architectures_metrale_lacks_are_refused_by_name() {
    for arch in ["deepseek2", "gemma3", "qwen3moe"] {
        let err = config_json(&file(arch, &[])).unwrap_err().to_string();
        assert!(err.contains(&format!("{arch:?}")), "{err}");
        assert!(
            err.contains("not supported") && err.contains("test.gguf"),
            "{err}"
        );
        assert!(
            err.contains(
                "llama, qwen2, qwen3, qwen3next, qwen35, qwen35moe, lfm2, lfm2moe, mamba2"
            ),
            "{err}"
        );
    }
}

#[test]
fn llama_metadata_reads_as_its_config_json() {
    let u = |n: u32| GgufValue::U32(n);
    let f = file(
        "llama",
        &[
            ("{a}.block_count", u(2)),
            ("{a}.embedding_length", u(4)),
            ("{a}.feed_forward_length", u(16)),
            ("{a}.context_length", u(128)),
            ("{a}.attention.head_count", u(2)),
            ("{a}.attention.head_count_kv", u(1)),
            ("{a}.rope.freq_base", GgufValue::F32(5e5)),
            ("{a}.rope.dimension_count", u(2)),
            ("{a}.attention.layer_norm_rms_epsilon", GgufValue::F32(1e-5)),
            ("tokenizer.ggml.eos_token_id", u(3)),
        ],
    );
    let c = config_json(&f).unwrap();
    assert_eq!(c["model_type"], "llama");
    assert_eq!(c["vocab_size"], 8);
    assert_eq!(c["hidden_size"], 4);
    assert_eq!(c["num_key_value_heads"], 1);
    assert_eq!(c["head_dim"], 2);
    assert_eq!(c["tie_word_embeddings"], true);
    assert_eq!(c["eos_token_id"], 3);
    assert_eq!(c["max_position_embeddings"], 128);
    assert_eq!(c["rope_parameters"]["rope_theta"], 5e5);
    assert!(c["rope_parameters"].get("partial_rotary_factor").is_none());
}

#[test]
fn qwen2_qkv_biases_do_not_ask_for_an_output_bias() {
    // Qwen 2's q/k/v biases come with its model type; attention_bias would
    // add o_proj's, which Qwen 2 files lack (and Llama's with biases hold).
    for (arch, o_bias) in [("qwen2", false), ("llama", true)] {
        let u = |n: u32| GgufValue::U32(n);
        let mut w = GgufWriter::new();
        w.add("general.architecture", GgufValue::String(arch.into()));
        for (k, v) in [
            ("block_count", u(1)),
            ("embedding_length", u(4)),
            ("feed_forward_length", u(8)),
            ("attention.head_count", u(2)),
        ] {
            w.add(format!("{arch}.{k}"), v);
        }
        w.add_tensor("token_embd.weight", GgmlType::F32, &[8, 4], vec![0u8; 128]);
        w.add_tensor("blk.0.attn_q.bias", GgmlType::F32, &[4], vec![0u8; 16]);
        if o_bias {
            w.add_tensor("blk.0.attn_output.bias", GgmlType::F32, &[4], vec![0u8; 16]);
        }
        let f = GgufFile::from_bytes("test.gguf", w.to_bytes().unwrap()).unwrap();
        let c = config_json(&f).unwrap();
        assert_eq!(c["attention_bias"], o_bias, "{arch}");
        let config = parse_config(&c.to_string(), Path::new("test.gguf")).unwrap();
        let names: Vec<String> = (config.expected_tensors().into_iter())
            .map(|t| t.name)
            .collect();
        assert!(names.iter().any(|n| n.ends_with("q_proj.bias")), "{arch}");
        assert_eq!(
            names.iter().any(|n| n.ends_with("o_proj.bias")),
            o_bias,
            "{arch}"
        );
    }
}

#[test]
fn a_missing_hyper_parameter_is_named() {
    let err = config_json(&file(
        "mamba2",
        &[("{a}.embedding_length", GgufValue::U32(4))],
    ))
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("mamba2.block_count") && err.contains("test.gguf"),
        "{err}"
    );
}

#[test]
fn expert_and_pattern_names_match() {
    assert_eq!(name_match("gate.weight", "gate.weight"), Some(None));
    assert_eq!(
        name_match("experts.*.up_proj.weight", "experts.12.up_proj.weight"),
        Some(Some(12))
    );
    assert_eq!(
        name_match("experts.*.up_proj.weight", "experts..up_proj.weight"),
        None
    );
    assert_eq!(
        name_match("experts.*.up_proj.weight", "experts.x.up_proj.weight"),
        None
    );
    assert_eq!(
        name_match("experts.*.up_proj.weight", "experts.1.down_proj.weight"),
        None
    );
}

/// `in_proj_qkvz` per key group [q, k, v, z] from the converter's
/// [all q, all k, all v] and [all z]: two groups, dk 2, two value heads of
/// 1 per group.
#[test]
fn qkvz_rows_are_regrouped() {
    let d = crate::config::DeltaNetConfig {
        n_k_heads: 2,
        n_v_heads: 4,
        k_head_dim: 2,
        v_head_dim: 1,
        conv_kernel: 4,
        norm_eps: 1e-6,
        tiled_v_heads: false,
    };
    let rows: Vec<(usize, usize)> = qkvz_runs(&d)
        .iter()
        .flat_map(|r| (r.start..r.start + r.len).map(move |i| (r.source, i)))
        .collect();
    // qkv rows: q0 q0 q1 q1 | k0 k0 k1 k1 | v0 v0 v1 v1; gate: z0 z0 z1 z1.
    assert_eq!(
        rows,
        [
            (0, 0),
            (0, 1),
            (0, 4),
            (0, 5),
            (0, 8),
            (0, 9),
            (1, 0),
            (1, 1),
            (0, 2),
            (0, 3),
            (0, 6),
            (0, 7),
            (0, 10),
            (0, 11),
            (1, 2),
            (1, 3),
        ]
    );
}

/// Layer 2's `attn_qkv` is a "more bits" attn_v for the Q4_K_M mix (Q6_K,
/// falling back to Q8_0 on these 64-wide rows) while its `attn_gate` is
/// not (Q4_K, falling back to Q5_0): their `in_proj_qkvz` takes the wider.
#[test]
fn split_parts_of_different_types_take_the_wider() {
    let dir = std::path::PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/qwen3_next"
    ));
    let config = crate::config::load_config(&dir).unwrap();
    let types = quant_types(&config, FileType::Q4_K_M).unwrap();
    let qkvz = |i: usize| types[&format!("model.layers.{i}.linear_attn.in_proj_qkvz.weight")];
    assert_eq!(qkvz(0), GgmlType::Q5_0);
    assert_eq!(qkvz(1), GgmlType::Q5_0);
    assert_eq!(qkvz(2), GgmlType::Q8_0);
    assert_eq!(
        types["model.layers.3.self_attn.v_proj.weight"],
        GgmlType::Q8_0
    );
    assert_eq!(types["lm_head.weight"], GgmlType::Q8_0);
    assert!(
        !types
            .keys()
            .any(|n| n.contains("norm") || n.contains("mlp.gate.weight"))
    );
}
