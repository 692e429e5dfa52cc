//! Hostile chat templates and tokenizers cannot make metrale allocate
//! without bound: each runs in a child process whose address space is
//! capped, so a regression fails the test instead of exhausting the
//! machine.

#![cfg(unix)]

use std::time::{Duration, Instant};

use crate::limited;

use limited::run_limited;
use metrale_model_engine::chat::{ChatMessage, ChatTemplate, MAX_RENDERED_BYTES};
use metrale_model_engine::tokenizer::Tokenizer;

/// Long enough for every hostile case on a loaded 2-core machine; a
/// template that loops without end is killed there.
const DEADLINE: Duration = Duration::from_secs(120);

/// Templates that ask for gigabytes, one way or another: each is refused
/// (or renders within the bounds) quickly, in a child that has 2 GiB.
#[test]
fn templates_that_ask_for_gigabytes_are_refused() {
    run_limited(
        "templates_that_ask_for_gigabytes_are_refused",
        DEADLINE,
        templates_that_ask_for_gigabytes_are_refused_body,
    );
}

fn templates_that_ask_for_gigabytes_are_refused_body() {
    // Thirty-six doublings: a list of 2^36 references to one 1 MB string,
    // for the cost of 36 two-item lists.
    let dag = r#"{% set ns = namespace(l=["x" * 1000000]) %}{% for i in range(36) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}"#;
    let formats_the_dag = [
        r#"{{ ("" ~ ns.l)|length }}"#,
        r#"{{ (ns.l ~ "")|length }}"#,
        r#"{{ ns.l }}"#,
        r#"{% set c %}{{ ns.l }}{% endset %}{{ c|length }}"#,
        r#"{{ ns.l|upper|length }}"#,
        r#"{{ ns.l|replace("a", "b")|length }}"#,
        r#"{{ ns.l|string|length }}"#,
        r#"{{ ns.l|join|length }}"#,
        r#"{{ ns.l|trim|length }}"#,
        r#"{{ ns.l|tojson|length }}"#,
        r#"{{ ns.l|pprint|length }}"#,
        r#"{{ "%s"|format(ns.l)|length }}"#,
        r#"{{ "{}".format(ns.l)|length }}"#,
        r#"{{ "".join(ns.l)|length }}"#,
        r#"{{ ns.l|map("string")|list|length }}"#,
        r#"{{ ns.l|select("startingwith", "x")|list|length }}"#,
        r#"{{ ns.l is endingwith("x") }}"#,
        r#"{{ raise_exception(ns.l) }}"#,
        r#"{{ strftime_now(ns.l) }}"#,
    ];
    let mut hostile = vec![
        r#"{{ "x" * 100000000 }}"#.to_string(),
        r#"{% set a = "x" * 100000000 %}{% set b = a ~ a %}{% set c = b ~ b %}{% set d = c ~ c %}{% set e = d ~ d %}{{ e|length }}"#.into(),
        r#"{{ ("x" * 100000000)|list|length }}"#.into(),
        r#"{{ ("\n" * 100000000).splitlines()|length }}"#.into(),
        r#"{{ ("a " * 50000000).split()|length }}"#.into(),
        r#"{{ (",," * 60000000)|split(",")|length }}"#.into(),
        r#"{{ ("\n" * 100000000)|lines|length }}"#.into(),
        r#"{{ "" ~ (["x" * 1000] * 100000000) }}"#.into(),
        r#"{{ ((range(100000)|list) * 1000)|string|length }}"#.into(),
        r#"{{ "{:>3000000000}".format(1) }}"#.into(),
        r#"{{ "{:.3000000000}".format("x") }}"#.into(),
        r#"{{ messages|tojson(indent=3000000000) }}"#.into(),
        r#"{{ "x"|indent(3000000000) }}"#.into(),
        r#"{{ ("x" * 1000000)|replace("x", "y" * 10000) }}"#.into(),
        r#"{{ ("x" * 10000000).replace("x", "yy" * 1000) }}"#.into(),
        r#"{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"#.into(),
        r#"{% macro m() %}{{ "x" * 10000000 }}{% endmacro %}{% set ns = namespace(s=[]) %}{% for i in range(1000) %}{% set ns.s = ns.s + [m()] %}{% endfor %}{{ ns.s|length }}"#.into(),
        r#"{{ strftime_now("%B" * 50000000)|length }}"#.into(),
    ];
    hostile.extend(formats_the_dag.iter().map(|f| format!("{dag}{f}")));

    let messages = [ChatMessage::new("user", "hi")];
    for source in &hostile {
        eprintln!("rendering {source}");
        let template = ChatTemplate::new(source.as_str(), Vec::new()).expect("compiles");
        let start = Instant::now();
        let result = template.render(&messages, true);
        let took = start.elapsed();
        match result {
            Ok(text) => assert!(
                text.len() <= MAX_RENDERED_BYTES,
                "{source}: {} bytes",
                text.len()
            ),
            Err(e) => eprintln!("  {took:?} {e}"),
        }
        assert!(took < Duration::from_secs(5), "{source}: took {took:?}");
    }
    // The first renders 100 MB of output: refused, saying why.
    let err = ChatTemplate::new(hostile[0].as_str(), Vec::new())
        .unwrap()
        .render(&messages, true)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("{MAX_RENDERED_BYTES} bytes")),
        "{err}"
    );
}

/// A `tokenizer.json` whose one id is four billion: the ids between name
/// no token, and the tokenizer is refused rather than listing them.
#[test]
fn a_vocabulary_with_ids_far_past_its_size_is_refused() {
    run_limited(
        "a_vocabulary_with_ids_far_past_its_size_is_refused",
        DEADLINE,
        a_vocabulary_with_ids_far_past_its_size_is_refused_body,
    );
}

fn a_vocabulary_with_ids_far_past_its_size_is_refused_body() {
    let dir = std::env::temp_dir().join(format!("metrale-sparse-vocab-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = serde_json::json!({
        "version": "1.0",
        "model": {"type": "BPE", "vocab": {"a": 0, "b": 4_000_000_000u32}, "merges": []},
    });
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
    let err = Tokenizer::from_file(&path).unwrap_err().to_string();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(err.contains("tokenizer.json"), "{err}");
    assert!(err.contains("4000000000"), "{err}");
}
