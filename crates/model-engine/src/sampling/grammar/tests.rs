use proptest::prelude::*;
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
        (
            OutputConstraint::Lark("root ::= \"a".into()),
            "the GBNF grammar does not compile: line 1, column 10: the string literal is not closed",
        ),
        (
            OutputConstraint::Lark("root ::= <think> \"a\"".into()),
            "line 1, column 10: token references",
        ),
        (
            OutputConstraint::Lark("root ::= x".into()),
            "`x` is not defined",
        ),
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

/// One of llama.cpp's grammars in `tests/fixtures/grammars`.
fn gbnf_fixture(name: &str) -> OutputConstraint {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/grammars")
        .join(name);
    OutputConstraint::Lark(std::fs::read_to_string(path).unwrap())
}

/// Whether `text`, fed a token at a time, leaves `c` complete.
fn accepts(t: &Tokenizer, factory: &GrammarFactory, c: &OutputConstraint, text: &str) -> bool {
    let mut g = factory.compile(c).unwrap();
    for id in t.encode(text, false).unwrap() {
        if g.accept(id).is_err() {
            return false;
        }
    }
    g.is_accepting()
}

/// Whether `s` is one JSON value (checked by serde_json without building
/// it: walks write numbers such as `9e8471`, valid JSON past an f64).
fn json_ok(s: &str) -> bool {
    serde_json::from_str::<serde::de::IgnoredAny>(s).is_ok()
}

/// arithmetic.gbnf, as a set-of-positions recursive descent.
fn arithmetic_ok(s: &str) -> bool {
    use std::collections::BTreeSet;
    let b = s.as_bytes();
    let ws = |i: usize| -> BTreeSet<usize> {
        let mut out = BTreeSet::from([i]);
        let mut j = i;
        while j < b.len() && b" \t\n".contains(&b[j]) {
            j += 1;
            out.insert(j);
        }
        out
    };
    fn term(b: &[u8], i: usize, ws: &dyn Fn(usize) -> BTreeSet<usize>) -> BTreeSet<usize> {
        match b.get(i) {
            Some(c) if c.is_ascii_lowercase() => {
                let mut j = i + 1;
                while j < b.len()
                    && (b[j].is_ascii_lowercase() || b[j].is_ascii_digit() || b[j] == b'_')
                {
                    j += 1;
                }
                ws(j)
            }
            Some(c) if c.is_ascii_digit() => {
                let mut j = i + 1;
                while j < b.len() && b[j].is_ascii_digit() {
                    j += 1;
                }
                ws(j)
            }
            Some(b'(') => {
                let mut out = BTreeSet::new();
                for w in ws(i + 1) {
                    for e in expr(b, w, ws) {
                        if b.get(e) == Some(&b')') {
                            out.extend(ws(e + 1));
                        }
                    }
                }
                out
            }
            _ => BTreeSet::new(),
        }
    }
    fn expr(b: &[u8], i: usize, ws: &dyn Fn(usize) -> BTreeSet<usize>) -> BTreeSet<usize> {
        let mut all = BTreeSet::new();
        let mut frontier = term(b, i, ws);
        while !frontier.is_empty() {
            all.extend(frontier.iter().copied());
            let mut next = BTreeSet::new();
            for &e in &frontier {
                if b.get(e).is_some_and(|c| b"-+*/".contains(c)) {
                    next.extend(term(b, e + 1, ws).into_iter().filter(|p| !all.contains(p)));
                }
            }
            frontier = next;
        }
        all
    }
    let mut starts = BTreeSet::from([0]);
    loop {
        let mut next = BTreeSet::new();
        for &p in &starts {
            for e in expr(b, p, &ws) {
                if b.get(e) != Some(&b'=') {
                    continue;
                }
                for w in ws(e + 1) {
                    for t in term(b, w, &ws) {
                        if b.get(t) == Some(&b'\n') {
                            next.insert(t + 1);
                        }
                    }
                }
            }
        }
        if next.is_empty() {
            return false;
        }
        if next.contains(&b.len()) {
            return true;
        }
        starts = next;
    }
}

/// list.gbnf: lines `- ` and at least one character that breaks no line.
fn list_ok(s: &str) -> bool {
    let Some(body) = s.strip_suffix('\n') else {
        return false;
    };
    body.split('\n').all(|line| {
        line.strip_prefix("- ").is_some_and(|item| {
            !item.is_empty()
                && !item.chars().any(|c| {
                    [
                        '\r', '\n', '\u{b}', '\u{c}', '\u{85}', '\u{2028}', '\u{2029}',
                    ]
                    .contains(&c)
                })
        })
    })
}

/// chess.gbnf: `1. m m` then numbered lines of two moves.
fn chess_ok(s: &str) -> bool {
    fn mv(m: &str) -> bool {
        let m = m.strip_suffix(['+', '#']).unwrap_or(m);
        let file = |c: u8| (b'a'..=b'h').contains(&c);
        let rank = |c: u8| (b'1'..=b'8').contains(&c);
        let piece = |c: u8| b"NBKQR".contains(&c);
        let b = m.as_bytes();
        let square = |b: &[u8]| b.len() == 2 && file(b[0]) && rank(b[1]);
        if m == "O-O" || m == "O-O-O" {
            return true;
        }
        // pawn: ([a-h] "x")? [a-h] [1-8] ("=" [NBKQR])?
        let pawn = {
            let b = if b.len() >= 2 && b[b.len() - 2] == b'=' && piece(b[b.len() - 1]) {
                &b[..b.len() - 2]
            } else {
                b
            };
            square(b) || (b.len() == 4 && file(b[0]) && b[1] == b'x' && square(&b[2..]))
        };
        // nonpawn: [NBKQR] [a-h]? [1-8]? "x"? [a-h] [1-8]
        let nonpawn = b.len() >= 3 && piece(b[0]) && square(&b[b.len() - 2..]) && {
            let mut mid = &b[1..b.len() - 2];
            if mid.first().is_some_and(|&c| file(c)) {
                mid = &mid[1..];
            }
            if mid.first().is_some_and(|&c| rank(c)) {
                mid = &mid[1..];
            }
            mid.is_empty() || mid == b"x"
        };
        pawn || nonpawn
    }
    let Some(body) = s.strip_suffix('\n') else {
        return false;
    };
    let lines: Vec<&str> = body.split('\n').collect();
    lines.len() >= 2
        && lines.iter().enumerate().all(|(i, line)| {
            let Some((n, moves)) = line.split_once(". ") else {
                return false;
            };
            let number_ok = if i == 0 {
                n == "1"
            } else {
                let d = n.as_bytes();
                matches!(d.len(), 1 | 2)
                    && (b'1'..=b'9').contains(&d[0])
                    && d.iter().all(u8::is_ascii_digit)
            };
            let parts: Vec<&str> = moves.split(' ').collect();
            number_ok && parts.len() == 2 && parts.iter().all(|m| mv(m))
        })
}

#[test]
fn llama_cpp_grammars_compile_and_random_walks_hold() {
    let t = tokenizer();
    let factory = GrammarFactory::new(&t).unwrap();
    type Holds = fn(&str) -> bool;
    // The least number of the 64 walks that end (uniform draws wander in
    // arithmetic.gbnf's free whitespace and identifiers, and rarely end).
    let cases: [(&str, Holds, usize); 5] = [
        ("json.gbnf", |s| json_ok(s) && s.starts_with('{'), 20),
        ("json_arr.gbnf", |s| json_ok(s) && s.starts_with('['), 20),
        ("arithmetic.gbnf", arithmetic_ok, 1),
        ("list.gbnf", list_ok, 8),
        ("chess.gbnf", chess_ok, 32),
    ];
    for (file, holds, least) in cases {
        let c = gbnf_fixture(file);
        let mut ended = 0;
        for seed in 0..64 {
            let mut g = factory.compile(&c).unwrap();
            let (text, done) = walk(&t, &mut g, seed, 400);
            if done {
                ended += 1;
                assert!(holds(&text), "{file} seed {seed}: {text:?}");
            }
        }
        assert!(ended >= least, "{file}: {ended} of 64 walks ended");
    }
}

#[test]
fn llama_cpp_grammars_accept_and_reject_texts() {
    let t = tokenizer();
    let factory = GrammarFactory::new(&t).unwrap();
    let cases: [(&str, &[&str], &[&str]); 4] = [
        (
            "json.gbnf",
            &[
                "{}",
                "{\"a\": [1, true, null, \"x\\u00e9\\n\"], \"b\": {\"c\": -0.5e3}}",
                "{\n  \"k\": \"v\"}\n",
            ],
            &[
                "[1]",
                "{\"a\":}",
                "{'a': 1}",
                "{\"a\": 01}",
                "{\"a\":  1}",
                "{\"a\": 1",
                "{\"a\": \"\u{1}\"}",
            ],
        ),
        (
            "arithmetic.gbnf",
            &["x=1\n", "(a+b)*2 = c\n", "x1_ = y\nz=(1/3)\n"],
            &["x=\n", "1+=2\n", "X=1\n", "x=1", "x==1\n"],
        ),
        (
            "list.gbnf",
            &["- a\n", "- a b\n- ü\n"],
            &["- \n", "-a\n", "- a\u{2028}b\n", "- a", "- a\n\n"],
        ),
        (
            "chess.gbnf",
            &["1. e4 e5\n2. Nf3 Nc6\n", "1. d4 d5\n12. exd5 O-O-O+\n"],
            &[
                "1. e4 e5\n",
                "2. e4 e5\n3. d4 d5\n",
                "1. e9 e5\n2. d4 d5\n",
                "1. e4  e5\n2. d4 d5\n",
            ],
        ),
    ];
    for (file, good, bad) in cases {
        let c = gbnf_fixture(file);
        for text in good {
            assert!(accepts(&t, &factory, &c, text), "{file} refuses {text:?}");
        }
        for text in bad {
            assert!(!accepts(&t, &factory, &c, text), "{file} accepts {text:?}");
        }
    }
    // The checkers agree with the grammars on these texts too.
    assert!(arithmetic_ok("(a+b)*2 = c\n") && !arithmetic_ok("x=1"));
    assert!(list_ok("- a b\n- ü\n") && !list_ok("- a\u{2028}b\n"));
    assert!(chess_ok("1. d4 d5\n12. exd5 O-O-O+\n") && !chess_ok("1. e9 e5\n2. d4 d5\n"));
}

/// GBNF matches code points, with no lexer: terminals that a greedy lexer
/// would cut differently (`"ab"` against `[a-z] [a-z] [a-z]`) still take
/// every text the GBNF takes.
#[test]
fn gbnf_grammars_match_character_by_character() {
    let t = tokenizer();
    let factory = GrammarFactory::new(&t).unwrap();
    let cases: [(&str, &[&str], &[&str]); 9] = [
        (
            "root ::= \"\" | \"a\" root",
            &["", "a", "aaa"],
            &["b", "ab"],
        ),
        ("root ::= x\nx ::=", &[""], &["a"]),
        (
            "root ::= [a-z] [a-z] [a-z] | \"ab\"",
            &["abc", "ab"],
            &["a", "abcd", "aB"],
        ),
        (
            "root ::= \"ab\" \"c\"? | \"abc\" \"d\"",
            &["ab", "abc", "abcd"],
            &["abd", "abcc"],
        ),
        ("root ::= [a-z]+ \"b\"", &["ab", "abb", "bb"], &["b", "ba"]),
        ("root ::= \"a\"* \"a\" \"b\"", &["ab", "aaab"], &["b", "aa"]),
        (
            "root ::= [^a] \"é\" | \"éé\" \"x\"",
            &["éé", "ééx", "bé"],
            &["aé", "éx"],
        ),
        (
            "root ::= . \"x\" | \"\\u00e9\"{2,3}",
            &["\nx", "😀x", "éé", "ééé"],
            &["x", "é", "éééé"],
        ),
        (
            "root ::= ws \"a\" ws\nws ::= [ \\t\\n]*",
            &["a", " \n\ta  "],
            &["a b"],
        ),
    ];
    for (gbnf, good, bad) in cases {
        let c = OutputConstraint::Lark(gbnf.into());
        for text in good {
            assert!(accepts(&t, &factory, &c, text), "{gbnf:?} refuses {text:?}");
        }
        for text in bad {
            assert!(
                !accepts(&t, &factory, &c, text),
                "{gbnf:?} accepts {text:?}"
            );
        }
    }
    // `::=` inside a Lark grammar's string is Lark's.
    let c = OutputConstraint::Lark("start: \"a ::= b\"".into());
    assert!(accepts(&t, &factory, &c, "a ::= b"));
}

#[test]
fn gbnf_rule_names_differing_by_dash_underscore_or_case_stay_apart() {
    let t = tokenizer();
    let factory = GrammarFactory::new(&t).unwrap();
    let c = OutputConstraint::Lark(
        "root ::= a-b a_b A-B ab AB Ab\na-b ::= \"1\"\na_b ::= \"2\"\nA-B ::= \"3\"\n\
         ab ::= \"4\"\nAB ::= \"5\"\nAb ::= \"6\"\n"
            .into(),
    );
    for seed in 0..5 {
        let mut g = factory.compile(&c).unwrap();
        let (text, done) = walk(&t, &mut g, seed, 20);
        assert!(done && text == "123456", "seed {seed}: {text:?}");
    }
    assert!(!accepts(&t, &factory, &c, "111111"));
}

/// GBNF expressions built from every construct the translation takes.
fn gbnf_expr() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        Just("\"ab\"".to_string()),
        Just("\"\"".to_string()),
        Just("\"\\n\\u00e9\"".to_string()),
        Just("[a-c]".to_string()),
        Just("[^b\\]]".to_string()),
        Just(".".to_string()),
        Just("a".to_string()),
        Just("B-c".to_string()),
    ];
    leaf.prop_recursive(4, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 1..4).prop_map(|v| v.join(" ")),
            prop::collection::vec(inner.clone(), 2..4).prop_map(|v| format!("({})", v.join(" | "))),
            (
                inner,
                prop_oneof![
                    Just("*"),
                    Just("+"),
                    Just("?"),
                    Just("{0}"),
                    Just("{2}"),
                    Just("{1,}"),
                    Just("{0,3}")
                ]
            )
                .prop_map(|(e, op)| format!("({e}){op}")),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Every GBNF grammar built of these constructs translates, and
    /// llguidance compiles the translation and can compute its first mask.
    #[test]
    fn translated_gbnf_compiles(root in gbnf_expr(), a in gbnf_expr()) {
        let text = format!("root ::= {root}\na ::= \"x\" | {a}\nB-c ::= [b]\n");
        let lark = gbnf::gbnf_to_lark(&text);
        prop_assert!(lark.is_ok(), "{text:?}: {lark:?}");
        let t = tokenizer();
        let factory = GrammarFactory::new(&t).unwrap();
        match factory.compile(&OutputConstraint::Lark(text.clone())) {
            Ok(mut g) => prop_assert!(g.mask().is_ok(), "{text:?}"),
            Err(e) => prop_assert!(false, "{text:?} -> {lark:?}: {e}"),
        }
    }
}

#[test]
fn schemas_embedded_in_lark_take_the_compact_layout() {
    let t = tokenizer();
    let factory = GrammarFactory::new(&t).unwrap();
    let schema = compact(
        json!({"type": "object", "properties": {"a": {"type": "integer",
        "minimum": 0, "maximum": 9}, "b": {"type": "boolean"}}, "required": ["a", "b"],
        "additionalProperties": false}),
    );
    let c = OutputConstraint::Lark(format!("start: \"<c>\" %json {schema}"));
    for seed in 0..20 {
        let mut g = factory.compile(&c).unwrap();
        let (text, done) = walk(&t, &mut g, seed, 200);
        assert!(done, "{text:?}");
        let body = text.strip_prefix("<c>").unwrap();
        let v: Value = serde_json::from_str(body).unwrap();
        assert_eq!(
            body,
            format!("{{\"a\": {}, \"b\": {}}}", v["a"], v["b"]),
            "{text:?}"
        );
    }
}

/// Constraints a hostile client could send (the server's JSON parser caps
/// nesting at 128 levels, its body limit the sizes): each compiles or is
/// refused, and gives a mask; none panics. Their compile times, measured
/// once on this crate's fixture vocabulary: a 60-deep schema 8 ms,
/// `a{1000000}` 0.5 s, 100,000 choices 1.6 s (why the server compiles
/// off its async workers).
#[test]
fn hostile_constraints_compile_or_are_refused() {
    let t = tokenizer();
    let factory = GrammarFactory::new(&t).unwrap();
    let mut deep = json!({"type": "integer"});
    for _ in 0..60 {
        deep = json!({"type": "object", "properties": {"a": deep}, "required": ["a"]});
    }
    let cases = vec![
        OutputConstraint::JsonSchema(deep),
        OutputConstraint::Regex("a{100000}".into()),
        OutputConstraint::Regex("(a|b){1000}(c|d){1000}[0-9]{5000}".into()),
        OutputConstraint::Regex("(a*)*b".into()),
        OutputConstraint::Choice((0..5000).map(|i| format!("choice {i}")).collect()),
        OutputConstraint::Lark(format!(
            "start: {}",
            (0..2000)
                .map(|i| format!("\"x{i}\""))
                .collect::<Vec<_>>()
                .join(" | ")
        )),
        OutputConstraint::JsonSchema(json!({"type": "string", "pattern": "^(a+)+$"})),
        OutputConstraint::JsonSchema(
            json!({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}),
        ),
        OutputConstraint::JsonSchema(json!({"type": "integer", "minimum": 5, "maximum": 1})),
    ];
    for c in cases {
        if let Ok(mut g) = factory.compile(&c) {
            // A grammar with no instance gives an error or an empty mask.
            let _ = g.mask();
        }
    }
}
