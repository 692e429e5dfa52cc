//! `ToolCallFormat::detect` on real chat templates and on model types.

use super::ToolCallFormat::*;
use super::*;

// ---- detect -----------------------------------------------------------------

fn template(rel: &str) -> String {
    let path = format!(
        "{}/../../tests/fixtures/templates/{rel}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn detect_from_the_fixture_templates() {
    let cases = [
        ("qwen3_5.jinja", "qwen3_5", Qwen3Xml),
        ("lfm2.jinja", "lfm2", Pythonic),
        ("tool_formats/LFM2.5-8B-A1B.jinja", "lfm2_moe", Pythonic),
        (
            "tool_formats/Mistral-Small-3.2-24B-Instruct-2506.jinja",
            "mistral3",
            Mistral,
        ),
        (
            "tool_formats/mistralai-Mistral-Nemo-Instruct-2407.jinja",
            "mistral",
            Mistral,
        ),
        (
            "tool_formats/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja",
            "nemotron_h",
            Qwen3Xml,
        ),
        (
            "tool_formats/NVIDIA-Nemotron-Nano-v2.jinja",
            "nemotron_h",
            Nemotron,
        ),
        (
            "tool_formats/NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
            "llama",
            Hermes,
        ),
        (
            "tool_formats/Qwen-Qwen2.5-7B-Instruct.jinja",
            "qwen2",
            Hermes,
        ),
        ("tool_formats/Qwen-Qwen3-0.6B.jinja", "qwen3", Hermes),
        ("tool_formats/Qwen3-Coder.jinja", "qwen3_moe", Qwen3Xml),
        (
            "tool_formats/ibm-granite-granite-3.3-2B-Instruct.jinja",
            "granite",
            Granite,
        ),
        (
            "tool_formats/ibm-granite-granite-4.0.jinja",
            "granitemoehybrid",
            Granite,
        ),
        (
            "tool_formats/meta-llama-Llama-3.1-8B-Instruct.jinja",
            "llama",
            Llama3Json,
        ),
        (
            "tool_formats/meta-llama-Llama-3.2-3B-Instruct.jinja",
            "llama",
            Llama3Json,
        ),
    ];
    for (file, model_type, want) in cases {
        let t = template(file);
        assert_eq!(
            ToolCallFormat::detect(model_type, Some(&t)),
            Some(want),
            "{file}"
        );
        // The template alone decides, whatever the model type says.
        assert!(
            ToolCallFormat::detect("unknown", Some(&t)).is_some(),
            "{file}"
        );
    }
}

#[test]
fn detect_from_model_type_where_the_template_says_nothing() {
    // The unit-test fixtures' tokenizer_config.json carry plain ChatML.
    let chatml = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + \
                  message['content'] + '<|im_end|>' + '\n'}}{% endfor %}";
    let cases = [
        ("qwen3_5", Some(Qwen3Xml)),
        ("qwen3_5_moe_text", Some(Qwen3Xml)),
        ("qwen2", Some(Hermes)),
        ("qwen3", Some(Hermes)),
        ("qwen3_next", Some(Hermes)),
        ("llama", Some(Llama3Json)),
        ("mistral", Some(Mistral)),
        ("granitemoehybrid", Some(Granite)),
        ("granite", Some(Granite)),
        ("nemotron_h", Some(Nemotron)),
        ("lfm2", Some(Pythonic)),
        ("lfm2_moe", Some(Pythonic)),
        ("lfm2_vl", Some(Pythonic)),
        ("mamba2", None),
        ("bamba", None),
        ("", None),
    ];
    for (model_type, want) in cases {
        assert_eq!(
            ToolCallFormat::detect(model_type, None),
            want,
            "{model_type}"
        );
        assert_eq!(
            ToolCallFormat::detect(model_type, Some(chatml)),
            want,
            "{model_type}"
        );
    }
    assert_eq!(
        ToolCallFormat::detect("mamba2", Some("... <tool_call> ...")),
        Some(Hermes)
    );
}
