//! The published chat templates of the newer families, rendered by
//! minijinja as transformers renders them (`tests/fixtures/templates`:
//! the templates, their sources, and each case's rendering by
//! transformers 5.24): Qwen3.5's (tools in its XML call format, reasoning,
//! `enable_thinking`, tool responses grouped) and LFM2's (its tool list).

use std::path::PathBuf;

use metrale_model_engine::chat::ChatTemplate;
use serde_json::Value;

fn templates() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/templates"
    ))
}

/// Renders every case of `cases_file` with `template_file` and compares it
/// with transformers' rendering; a case transformers refused must be
/// refused (an error, not a panic). Returns how many were compared.
fn check(template_file: &str, cases_file: &str) -> usize {
    let source = std::fs::read_to_string(templates().join(template_file)).unwrap();
    let cases: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(templates().join(cases_file)).unwrap())
            .unwrap();
    let mut compared = 0;
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let specials: Vec<(String, String)> = case["bos_token"]
            .as_str()
            .map(|b| ("bos_token".to_string(), b.to_string()))
            .into_iter()
            .collect();
        let template = ChatTemplate::new(&source, specials).expect("compiles");
        let mut extra: Vec<(&str, Value)> = Vec::new();
        if !case["tools"].is_null() {
            extra.push(("tools", case["tools"].clone()));
        }
        if let Some(b) = case["enable_thinking"].as_bool() {
            extra.push(("enable_thinking", Value::Bool(b)));
        }
        let add = case["add_generation_prompt"].as_bool().unwrap_or(false);
        let got = template.render_with(&case["messages"], add, &extra);
        match case["transformers"].as_str() {
            Some(want) => {
                let got = got.unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(got, want, "{name}");
                compared += 1;
            }
            None => assert!(got.is_err(), "{name}: transformers refused it"),
        }
    }
    compared
}

#[test]
fn qwen3_5_renders_as_transformers_renders_it() {
    assert_eq!(check("qwen3_5.jinja", "qwen3_5_expected.json"), 20);
}

#[test]
fn lfm2_renders_as_transformers_renders_it() {
    assert_eq!(check("lfm2.jinja", "lfm2_expected.json"), 3);
}
