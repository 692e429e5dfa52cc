use rand::rngs::ChaCha8Rng;
use rand::{Rng, SeedableRng};
use serde_json::json;

use super::*;

fn tokenizer() -> Tokenizer {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    Tokenizer::from_dir(dir.join("tokenizer")).unwrap()
}

/// Draws uniformly among the allowed ids until the grammar completes or
/// EOS is drawn; returns the text and whether it ended by itself.
fn walk(t: &Tokenizer, grammar: &mut Grammar, seed: u64, limit: usize) -> (String, bool) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut ids = Vec::new();
    for _ in 0..limit {
        let mask = grammar.mask().unwrap();
        let allowed: Vec<u32> = (0..t.vocab_size() as u32)
            .filter(|&i| mask.allows(i))
            .collect();
        assert!(!allowed.is_empty(), "nothing allowed after {ids:?}");
        let id = allowed[(rng.next_u64() % allowed.len() as u64) as usize];
        if t.eos_ids().contains(&id) {
            assert!(grammar.is_accepting(), "EOS allowed before the end");
            return (t.decode(&ids).unwrap(), true);
        }
        ids.push(id);
        if grammar.accept(id).unwrap() {
            return (t.decode(&ids).unwrap(), true);
        }
    }
    (t.decode(&ids).unwrap(), false)
}

#[test]
fn random_walks_under_a_schema_give_valid_instances() {
    let t = tokenizer();
    let factory = GrammarFactory::new(&t).unwrap();
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
            "ok": {"type": "boolean"}
        },
        "required": ["name", "age", "tags", "ok"],
        "additionalProperties": false
    });
    let c = OutputConstraint::JsonSchema(schema);
    for seed in 0..20 {
        let mut g = factory.compile(&c).unwrap();
        let (text, done) = walk(&t, &mut g, seed, 400);
        assert!(done, "seed {seed}: did not end: {text:?}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(v["name"].as_str().unwrap().chars().count() <= 6, "{text}");
        let age = v["age"].as_i64().unwrap();
        assert!((0..=120).contains(&age), "{text}");
        assert!(v["tags"].as_array().unwrap().len() <= 3, "{text}");
        assert!(v["ok"].is_boolean(), "{text}");
        assert_eq!(v.as_object().unwrap().len(), 4, "{text}");
    }
}

#[test]
fn regex_choice_and_lark_hold() {
    let t = tokenizer();
    let factory = GrammarFactory::new(&t).unwrap();
    type Holds = fn(&str) -> bool;
    let cases: Vec<(OutputConstraint, Holds)> = vec![
        (OutputConstraint::Regex("[0-9]{3}-[a-z]{2}".into()), |s| {
            s.len() == 6
                && s[..3].bytes().all(|b| b.is_ascii_digit())
                && &s[3..4] == "-"
                && s[4..].bytes().all(|b| b.is_ascii_lowercase())
        }),
        (
            OutputConstraint::Choice(vec!["yes".into(), "no".into(), "a.b|c".into()]),
            |s| ["yes", "no", "a.b|c"].contains(&s),
        ),
        (
            OutputConstraint::Lark("start: \"ab\" | \"cd\" NUM\nNUM: /[0-9]{1,3}/".into()),
            |s| s == "ab" || (s.starts_with("cd") && s.len() <= 5),
        ),
        (OutputConstraint::JsonObject, |s| {
            serde_json::from_str::<Value>(s).is_ok_and(|v| v.is_object())
        }),
    ];
    for (c, holds) in cases {
        for seed in 0..10 {
            let mut g = factory.compile(&c).unwrap();
            let (text, done) = walk(&t, &mut g, seed, 300);
            if matches!(c, OutputConstraint::JsonObject) && !done {
                continue; // an unbounded object may outgrow the walk
            }
            assert!(done, "{c:?} seed {seed}: {text:?}");
            assert!(holds(&text), "{c:?} seed {seed}: {text:?}");
        }
    }
}

#[test]
fn bad_constraints_are_request_errors() {
    let t = tokenizer();
    let factory = GrammarFactory::new(&t).unwrap();
    for (c, needle) in [
        (
            OutputConstraint::JsonSchema(json!({"type": "object", "properties": 5})),
            "JSON schema",
        ),
        (OutputConstraint::JsonSchema(json!("object")), "a string"),
        (OutputConstraint::Regex("(".into()), "regex"),
        (OutputConstraint::Choice(vec![]), "empty"),
        (OutputConstraint::Lark("root ::= \"a\"".into()), "GBNF"),
        (
            OutputConstraint::Lark("start: undefined_rule".into()),
            "grammar",
        ),
    ] {
        let e = factory.compile(&c).expect_err("refused").to_string();
        assert!(e.contains(needle), "{c:?}: {e}");
    }
}

#[test]
fn rollback_returns_to_the_earlier_state() {
    let t = tokenizer();
    let factory = GrammarFactory::new(&t).unwrap();
    let c = OutputConstraint::Regex("abc|abd".into());
    let mut g = factory.compile(&c).unwrap();
    let before = g.mask().unwrap();
    let a = t.encode("a", false).unwrap();
    for &id in &a {
        g.accept(id).unwrap();
    }
    g.rollback(a.len()).unwrap();
    let after = g.mask().unwrap();
    let ids = |m: &TokenMask| {
        (0..t.vocab_size() as u32)
            .filter(|&i| m.allows(i))
            .collect::<Vec<_>>()
    };
    assert_eq!(ids(&before), ids(&after));
    assert!(g.rollback(1).is_err());
    // A token outside the mask is refused, naming it.
    let z = t.encode("z", false).unwrap()[0];
    let e = g.accept(z).unwrap_err().to_string();
    assert!(e.contains(&format!("token {z}")), "{e}");
}

#[test]
fn apply_masks_exactly_the_disallowed_ids() {
    let t = tokenizer();
    let factory = GrammarFactory::new(&t).unwrap();
    let mut g = factory
        .compile(&OutputConstraint::Regex("[a-f0-9 ]{0,8}x".into()))
        .unwrap();
    for step in 0..3 {
        let mask = g.mask().unwrap();
        // Longer than the vocabulary: ids past it are masked too.
        let mut logits = vec![0.5f32; t.vocab_size() + 37];
        mask.apply(&mut logits);
        for (id, &v) in logits.iter().enumerate() {
            assert_eq!(
                v == f32::NEG_INFINITY,
                !mask.allows(id as u32),
                "step {step} id {id}"
            );
        }
        assert_eq!(
            logits.iter().filter(|v| v.is_finite()).count(),
            mask.count()
        );
        let first =
            (0..t.vocab_size() as u32).find(|&i| mask.allows(i) && !t.eos_ids().contains(&i));
        g.accept(first.unwrap()).unwrap();
    }
}

/// A SentencePiece-style tokenizer (byte fallback, a Metaspace prefix
/// space): `{` and `▁{` are both tokens, and only `{` may open an output
/// that must start with `{` (the prefix space is a prompt's, not a
/// piece's).
#[test]
fn sentencepiece_vocabularies_start_without_the_prefix_space() {
    let dir = std::env::temp_dir().join(format!("metrale-spm-grammar-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let mut vocab = serde_json::Map::new();
    for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
        vocab.insert(t.to_string(), json!(i));
    }
    for b in 0..256u32 {
        vocab.insert(format!("<0x{b:02X}>"), json!(3 + b));
    }
    for (i, t) in ["▁", "{", "}", "▁{", "a", "{}"].iter().enumerate() {
        vocab.insert(t.to_string(), json!(259 + i));
    }
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false},
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true,
            "byte_fallback": true, "ignore_merges": false, "vocab": vocab,
            "merges": ["▁ {", "{ }"]}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"eos_token": "</s>"}"#,
    )
    .unwrap();
    let t = Tokenizer::from_dir(&dir).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(
        t.encode("{", false).unwrap(),
        [262],
        "the prompt encoder adds ▁"
    );
    let factory = GrammarFactory::new(&t).unwrap();
    let c = OutputConstraint::Regex("\\{a?\\}".into());
    let mask = factory.compile(&c).unwrap().mask().unwrap();
    assert!(
        mask.allows(260) && mask.allows(264),
        "{{ and {{}} open the output"
    );
    assert!(!mask.allows(262), "▁{{ does not");
    for seed in 0..20 {
        let mut g = factory.compile(&c).unwrap();
        let (text, done) = walk(&t, &mut g, seed, 10);
        assert!(
            done && (text == "{}" || text == "{a}"),
            "seed {seed}: {text:?}"
        );
    }
}
