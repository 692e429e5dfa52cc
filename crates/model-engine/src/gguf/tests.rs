use metrale_core::quant::GgmlType;
use metrale_model_weights::gguf::{GgufFile, GgufValue, GgufWriter};

use super::*;

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
    for arch in ["qwen3next", "nemotron_h_moe", "gemma3", "qwen3moe"] {
        let err = config_json(&file(arch, &[])).unwrap_err().to_string();
        assert!(err.contains(&format!("{arch:?}")), "{err}");
        assert!(
            err.contains("not supported") && err.contains("test.gguf"),
            "{err}"
        );
        assert!(err.contains("llama, qwen2, qwen3, mamba2"), "{err}");
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
