//! `parse` on LFM2's pythonic calls as llama.cpp's LFM2 tests write them,
//! Python literals, and malformed calls.

use serde_json::json;

use super::ToolCallFormat::*;
use super::tests::{all_text, call, p};
use super::*;

// ---- Pythonic ---------------------------------------------------------------

fn lfm(inner: &str) -> String {
    format!("<|tool_call_start|>{inner}<|tool_call_end|>")
}

#[test]
fn pythonic_calls_from_llama_cpp_lfm2_tests() {
    let cases: &[(&str, &[(&str, &str)])] = &[
        (
            "[special_function(arg1=1)]",
            &[("special_function", r#"{"arg1": 1}"#)],
        ),
        (
            "[get_time(city=\"XYZCITY\")]",
            &[("get_time", r#"{"city": "XYZCITY"}"#)],
        ),
        (
            "[toggle(enabled=True)]",
            &[("toggle", r#"{"enabled": true}"#)],
        ),
        (
            "[set_nullable(value=None)]",
            &[("set_nullable", r#"{"value": null}"#)],
        ),
        (
            "[set_config(config={\"enabled\": True, \"count\": 3})]",
            &[("set_config", r#"{"config": {"enabled": true, "count": 3}}"#)],
        ),
        (
            "[set_config(config={\"enabled\": true, \"note\": null})]",
            &[(
                "set_config",
                r#"{"config": {"enabled": true, "note": null}}"#,
            )],
        ),
        (
            "[Calendar.create_event(title=\"demo\", participants=[\"Alice\", \"Bob\"], \
             metadata={\"priority\": \"high\", \"reminder\": true})]",
            &[(
                "Calendar.create_event",
                r#"{"title": "demo", "participants": ["Alice", "Bob"], "metadata": {"priority": "high", "reminder": true}}"#,
            )],
        ),
        (
            "[python(code=\"def hello():\\n    print('hey')\")]",
            &[("python", r#"{"code": "def hello():\n    print('hey')"}"#)],
        ),
        (
            "[python(code=\"First line\\nSecond line\\tindented\")]",
            &[("python", r#"{"code": "First line\nSecond line\tindented"}"#)],
        ),
        (
            "[python(code=\"print(\\\"hi\\\")\")]",
            &[("python", r#"{"code": "print(\"hi\")"}"#)],
        ),
        (
            "[special_function(arg1=1), special_function_with_opt(arg1=1, arg2=2)]",
            &[
                ("special_function", r#"{"arg1": 1}"#),
                ("special_function_with_opt", r#"{"arg1": 1, "arg2": 2}"#),
            ],
        ),
        ("[empty_args()]", &[("empty_args", "{}")]),
    ];
    for (inner, want) in cases {
        let r = p(Pythonic, &lfm(inner));
        let want: Vec<_> = want.iter().map(|(n, a)| call(n, a)).collect();
        assert_eq!(r.calls, want, "{inner}");
        assert_eq!(r.content, "");
    }
    let r = p(
        Pythonic,
        &format!(
            "Let me check the time.{}",
            lfm("[get_time(city=\"Paris\")]")
        ),
    );
    assert_eq!(r.content, "Let me check the time.");
    assert_eq!(r.calls, [call("get_time", r#"{"city":"Paris"}"#)]);
}

#[test]
fn pythonic_literals() {
    let r = p(
        Pythonic,
        &lfm(
            " [ f ( a = 'it\\'s' , b = -3, c = 2.5e-3, d = 0x1F, e = 1_000, g = (1, 'x',), \
             h = {'k': [None, False], 2: 'two'}, i = r'C:\\dir\\n', j = \"\"\"tri\nple\"\"\", \
             k = 'ab' \"cd\", l = '\\u00e9\\x41\\101\\q', m = .5, n = 'raw\nnewline', o = [], \
             p = {}, q = +7, r = 0b101, s = -0o17, t = 1E3, u = 'ünï 😀',) , g2() ] ",
        ),
    );
    assert_eq!(
        r.calls,
        [
            call(
                "f",
                r#"{"a": "it's", "b": -3, "c": 0.0025, "d": 31, "e": 1000, "g": [1, "x"],
                    "h": {"k": [null, false], "2": "two"}, "i": "C:\\dir\\n", "j": "tri\nple",
                    "k": "abcd", "l": "éAA\\q", "m": 0.5, "n": "raw\nnewline", "o": [], "p": {},
                    "q": 7, "r": 5, "s": -15, "t": 1000.0, "u": "ünï 😀"}"#
            ),
            call("g2", "{}")
        ]
    );
    // A single call without brackets.
    assert_eq!(p(Pythonic, &lfm("f(x=1)")).calls, [call("f", r#"{"x":1}"#)]);
}

#[test]
fn pythonic_malformed_calls_stay_text() {
    for inner in [
        "[special_function(arg1=",
        "[f(1)]",
        "[f(x=foo)]",
        "[f(x=1)",
        "[f(x=1) g(y=2)]",
        "[f(x=1),, g()]",
        "[f(x='unterminated)]",
        "[f(x=007)]",
        "[f(x=1e999)]",
        "[f(x='\\ud800')]",
        "[f(x={[1]: 2})]",
        "[f(x=1)] trailing",
        "[]",
        "",
        "[1f(x=1)]",
        "[f(x=--1)]",
    ] {
        all_text(Pythonic, &lfm(inner));
    }
    all_text(Pythonic, "<|tool_call_start|>[special_function(arg1=");
    all_text(
        Pythonic,
        "Use this format: [link text](url). Example: [Wikipedia](https://www.wikipedia.org).",
    );
}

#[test]
fn pythonic_nesting_is_bounded_without_overflowing_the_stack() {
    let deep = format!("[f(x={}{})]", "[".repeat(100_000), "]".repeat(100_000));
    all_text(Pythonic, &lfm(&deep));
    let ok = format!(
        "[f(x={}{})]",
        "[".repeat(pythonic::MAX_DEPTH - 1),
        "]".repeat(pythonic::MAX_DEPTH - 1)
    );
    assert_eq!(p(Pythonic, &lfm(&ok)).calls.len(), 1);
    assert_eq!(pythonic::literal("(1, [2])"), Some(json!([1, [2]])));
    assert_eq!(pythonic::literal("{'a': 1} x"), None);
    // Deep JSON hits serde_json's recursion limit, not the stack.
    let deep_json = format!(
        "<tool_call>{{\"name\": \"f\", \"arguments\": {{\"a\": {}{}}}}}</tool_call>",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    all_text(Hermes, &deep_json);
}
