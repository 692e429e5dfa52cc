use super::*;

fn fixture(path: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(path)
}

#[test]
fn pre_tokenizer_hash_is_the_converters() {
    // The hash llama.cpp's converter computes for the GGUF fixtures'
    // tokenizer (transformers' AutoTokenizer, `str(tokenizer.encode(chktxt))`),
    // printed by hand with the venv of benches/compare.
    let t = tokenizers::Tokenizer::from_file(fixture("gguf-bf16/tokenizer.json")).unwrap();
    assert_eq!(
        pre_tokenizer_hash(&t).unwrap(),
        "f882f46b86a4d2918f633af336b09d801de57a9d3130d838c5e9bcedfe939723"
    );
    // Not in llama.cpp's table (the fixtures were converted with the
    // check relaxed to `gpt-2`), unlike GPT-2's own.
    assert_eq!(
        known_pre_tokenizer("f882f46b86a4d2918f633af336b09d801de57a9d3130d838c5e9bcedfe939723"),
        None
    );
    assert_eq!(
        known_pre_tokenizer("3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454"),
        Some("gpt-2")
    );
}

#[test]
fn metadata_keys_keep_their_place_unless_llama_quantize_sets_them() {
    let mut m = Meta {
        arch: "llama".into(),
        ..Meta::default()
    };
    m.put("block_count", GgufValue::U32(1));
    m.put_full("general.file_type", GgufValue::U32(0));
    m.put("context_length", GgufValue::U32(2));
    m.put("block_count", GgufValue::U32(3));
    let keys = |m: &Meta| m.entries.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>();
    assert_eq!(
        keys(&m),
        [
            "llama.block_count",
            "general.file_type",
            "llama.context_length"
        ]
    );
    assert!(matches!(m.entries[0].1, GgufValue::U32(3)));
    m.set_last("general.file_type", GgufValue::U32(15));
    assert_eq!(
        keys(&m),
        [
            "llama.block_count",
            "llama.context_length",
            "general.file_type"
        ]
    );
}

#[test]
fn named_chat_templates_are_written_as_gguf_py_does() {
    let mut m = Meta::default();
    let list: Value = serde_json::json!([
        {"name": "tool use", "template": "B"},
        {"name": "default", "template": "A"},
        {"name": "rag", "template": "C"},
        {"template": "no name: skipped"}
    ]);
    vocab::named_templates(&mut m, list.as_array().unwrap());
    let s = |x: &str| GgufValue::String(x.into());
    assert_eq!(
        m.entries,
        [
            ("tokenizer.chat_template.tool_use".to_string(), s("B")),
            ("tokenizer.chat_template.rag".to_string(), s("C")),
            (
                "tokenizer.chat_templates".to_string(),
                GgufValue::Array(metrale_model_weights::gguf::GgufArray::String(vec![
                    "tool_use".into(),
                    "rag".into()
                ]))
            ),
            ("tokenizer.chat_template".to_string(), s("A")),
        ]
    );
}

#[test]
fn sha256_hex_is_lowercase_hex() {
    assert_eq!(
        super::sha256_hex(b"abc"),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
}

#[test]
fn tensors_without_elements_are_not_written() {
    let p = Path::new("in.gguf");
    check_shape(p, "a", &[2, 32]).unwrap();
    check_shape(p, "a", &[1]).unwrap();
    for shape in [&[][..], &[0], &[4, 0, 2]] {
        let e = check_shape(p, "a.weight", shape).unwrap_err();
        assert!(matches!(e, EngineError::Export { .. }), "{e}");
        let e = e.to_string();
        assert!(e.starts_with("in.gguf: tensor \"a.weight\""), "{e}");
    }
}
