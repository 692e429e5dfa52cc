//! `ToolCallStream`: fed any split of a reply, its events join into what
//! `parse` says of the whole reply; and neither panics on any input.

use proptest::prelude::*;
use serde_json::{Value, json};

use super::ToolCallFormat::*;
use super::tests::call;
use super::*;

fn tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "f", "parameters": {
            "type": "object",
            "properties": {"n": {"type": "integer"}, "s": {"type": "string"}, "o": {"type": "object"}}
        }}}),
    ]
}

/// Replies in every format: calls, text around them, malformed calls.
fn corpus() -> Vec<(ToolCallFormat, String)> {
    let texts: &[(ToolCallFormat, &str)] = &[
        (
            Hermes,
            "Let me check.\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"s\": \"é \\\"q\\\" 😀\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": {\"o\": {\"a\": [1, {}]}}}\n</tool_call>\nDone.",
        ),
        (
            Hermes,
            "<tool_call>{bad}</tool_call> ok <tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call><tool_call>{\"name\"",
        ),
        (
            Hermes,
            "I <3 tags like <tool> and <tool_cal and </tool_call>.",
        ),
        (
            Hermes,
            "<tool_call><tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>",
        ),
        (
            Qwen3Xml,
            "Sure.\n\n<tool_call>\n<function=f>\n<parameter=n>\n12\n</parameter>\n<parameter=s>\nline 1\nline \"2\" ü\n</parameter>\n<parameter=o>\n{\"k\": [true]}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=h>\n</function>\n</tool_call>",
        ),
        (
            Qwen3Xml,
            "<tool_call>\n<function=f>\n<parameter=n>\n1\n</parameter>\n</tool_call> and <tool_call>\n<function=f>",
        ),
        (
            Llama3Json,
            "  {\"name\": \"f\", \"parameters\": {\"n\": 1}}; {\"name\": \"g\", \"arguments\": {\"s\": \"x;y\"}}",
        ),
        (
            Llama3Json,
            "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"s\": \"ü\"}}",
        ),
        (
            Llama3Json,
            "Text first <|python_tag|>{\"name\": \"f\", \"parameters\": {}}",
        ),
        (Llama3Json, "{\"name\": \"f\", \"parameters\": {\"n\": 1}"),
        (Llama3Json, "Just text with a { brace."),
        (
            Mistral,
            "Calling.[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"n\": 1}, \"id\": \"abcdefghi\"}, {\"name\": \"g\", \"arguments\": {}}]",
        ),
        (
            Mistral,
            "[TOOL_CALLS]f[ARGS]{\"s\": \"[TOOL_\"}[TOOL_CALLS]g[CALL_ID]abc123xyz[ARGS]{\"o\": {}}",
        ),
        (Mistral, "[TOOL_CALLS]f[ARGS]{\"s\": 1} trailing text"),
        (Mistral, "No calls, just [brackets] and [TOOL_ words."),
        (
            Granite,
            "<|tool_call|>[{\"name\": \"f\", \"arguments\": {\"n\": 2}}, {\"name\": \"g\", \"arguments\": {}}]",
        ),
        (
            Granite,
            "Checking.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n<tool_call>[{\"name\": \"g\", \"arguments\": {}}]",
        ),
        (Granite, "<|tool_call|>[{\"name\": \"f\""),
        (
            Nemotron,
            "I'll check.\n<TOOLCALL>[{\"name\": \"f\", \"arguments\": {\"n\": 3}}, {\"name\": \"g\", \"arguments\": {\"s\": \"✓\"}}]</TOOLCALL>\n",
        ),
        (
            Nemotron,
            "<TOOLCALL>[{\"name\": \"f\"}]</TOOLCALL> then <TOOLCALL>[{\"name\": \"g\", \"arguments\": {}}]",
        ),
        (
            Pythonic,
            "Let me check.<|tool_call_start|>[f(n=1, s='it\\'s ü', o={\"a\": True}), Calendar.create_event(title=\"demo\")]<|tool_call_end|>",
        ),
        (
            Pythonic,
            "<|tool_call_start|>[f(n=1)]<|tool_call_end|> and <|tool_call_start|>[g(1)]<|tool_call_end|><|tool_call_start|>[h(x=",
        ),
        (Pythonic, "Use [link](url) <|tool_call| <|tool_call_en"),
    ];
    texts.iter().map(|(f, t)| (*f, t.to_string())).collect()
}

fn reassemble(events: Vec<StreamEvent>) -> (String, Vec<ToolCall>) {
    let mut content = String::new();
    let mut calls: Vec<ToolCall> = Vec::new();
    for e in events {
        match e {
            StreamEvent::Content(t) => {
                assert!(!t.is_empty(), "empty content event");
                content.push_str(&t);
            }
            StreamEvent::CallStart { index, name } => {
                assert_eq!(index, calls.len(), "calls are numbered in order");
                calls.push(ToolCall {
                    name,
                    arguments: String::new(),
                });
            }
            StreamEvent::ArgsDelta { index, text } => {
                assert_eq!(
                    index + 1,
                    calls.len(),
                    "arguments follow their call's start"
                );
                calls[index].arguments.push_str(&text);
            }
        }
    }
    (content, calls)
}

fn stream(format: ToolCallFormat, tools: &[Value], chunks: &[&str]) -> (String, Vec<ToolCall>) {
    let mut s = ToolCallStream::new(format, tools.to_vec());
    let mut events = Vec::new();
    for c in chunks {
        events.extend(s.push(c));
    }
    events.extend(s.finish());
    assert!(s.finish().is_empty());
    assert_eq!(s.calls_emitted(), reassemble(events.clone()).1.len());
    reassemble(events)
}

/// The stream fed `chunks` says what `parse` says of them joined.
#[track_caller]
fn check(format: ToolCallFormat, tools: &[Value], chunks: &[&str]) {
    let text: String = chunks.concat();
    let want = parse(format, &text, tools);
    let (content, calls) = stream(format, tools, chunks);
    assert_eq!(calls, want.calls, "{format} {chunks:?}");
    if want.calls.is_empty() {
        assert_eq!(content, want.content, "{format} {chunks:?}");
    } else {
        assert_eq!(content.trim(), want.content, "{format} {chunks:?}");
    }
}

fn boundaries(text: &str) -> Vec<usize> {
    (0..=text.len())
        .filter(|&i| text.is_char_boundary(i))
        .collect()
}

/// Splits `text` at the given byte offsets (each moved back to a char boundary).
fn split_at<'a>(text: &'a str, cuts: &[usize]) -> Vec<&'a str> {
    let mut cuts: Vec<usize> = cuts
        .iter()
        .map(|&c| {
            let mut c = c.min(text.len());
            while !text.is_char_boundary(c) {
                c -= 1;
            }
            c
        })
        .collect();
    cuts.sort_unstable();
    let mut out = Vec::new();
    let mut prev = 0;
    for c in cuts {
        out.push(&text[prev..c]);
        prev = c;
    }
    out.push(&text[prev..]);
    out
}

#[test]
fn corpus_parses_to_calls_where_expected() {
    let with_calls = corpus()
        .iter()
        .filter(|(f, t)| !parse(*f, t, &tools()).calls.is_empty())
        .count();
    assert_eq!(with_calls, 13);
}

#[test]
fn stream_split_in_two_at_every_char_boundary() {
    for (format, text) in corpus() {
        for cut in boundaries(&text) {
            check(format, &tools(), &[&text[..cut], &text[cut..]]);
        }
    }
}

#[test]
fn stream_one_char_at_a_time_and_whole() {
    for (format, text) in corpus() {
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let chunks: Vec<&str> = chars.iter().map(String::as_str).collect();
        check(format, &tools(), &chunks);
        check(format, &tools(), &[&text]);
        check(format, &tools(), &["", &text, ""]);
    }
}

#[test]
fn stream_random_chunk_sizes() {
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for (format, text) in corpus() {
        for _ in 0..50 {
            let mut cuts = Vec::new();
            let mut at = 0;
            while at < text.len() {
                at += 1 + (next() % 12) as usize;
                cuts.push(at);
            }
            check(format, &tools(), &split_at(&text, &cuts));
        }
    }
}

#[test]
fn stream_holds_back_only_what_may_open_a_call() {
    let mut s = ToolCallStream::new(Hermes, vec![]);
    assert_eq!(
        s.push("Hello <tool"),
        [StreamEvent::Content("Hello ".into())]
    );
    assert_eq!(s.push("box>"), [StreamEvent::Content("<toolbox>".into())]);
    assert_eq!(
        s.push("Calling <tool_call>{\"na"),
        [StreamEvent::Content("Calling ".into())]
    );
    assert_eq!(s.push("me\": \"f\", \"arguments\": {\"a\": 1}}</tool_"), []);
    assert_eq!(
        s.push("call> bye <"),
        [
            StreamEvent::CallStart {
                index: 0,
                name: "f".into()
            },
            StreamEvent::ArgsDelta {
                index: 0,
                text: "{\"a\":1}".into()
            },
            StreamEvent::Content(" bye ".into()),
        ]
    );
    assert_eq!(
        s.push("<tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>")
            .len(),
        3
    );
    assert_eq!(s.finish(), []);
    assert_eq!(s.calls_emitted(), 2);
    // After the end nothing is held or parsed.
    assert_eq!(
        s.push("<tool_call>"),
        [StreamEvent::Content("<tool_call>".into())]
    );
}

#[test]
fn stream_without_end_marker_holds_the_call_to_the_end() {
    let mut s = ToolCallStream::new(Mistral, vec![]);
    assert_eq!(
        s.push("Sure. [TOOL_CA"),
        [StreamEvent::Content("Sure. ".into())]
    );
    assert_eq!(s.push("LLS]f[ARGS]{\"a\": 1}"), []);
    assert_eq!(s.push("[TOOL_CALLS]g[ARGS]{}"), []);
    let (_, calls) = reassemble(s.finish());
    assert_eq!(calls, [call("f", r#"{"a":1}"#), call("g", "{}")]);

    let mut s = ToolCallStream::new(Llama3Json, vec![]);
    assert_eq!(s.push(" \n"), []);
    assert_eq!(
        s.push("{\"name\": \"f\", "),
        [StreamEvent::Content(" \n".into())]
    );
    assert_eq!(s.push("\"parameters\": {}}"), []);
    assert_eq!(reassemble(s.finish()).1, [call("f", "{}")]);

    let mut s = ToolCallStream::new(Llama3Json, vec![]);
    assert_eq!(s.push(" "), []);
    assert_eq!(s.push("Hi {"), [StreamEvent::Content(" Hi {".into())]);
}

#[test]
fn stream_an_unfinished_call_comes_out_as_text() {
    let mut s = ToolCallStream::new(Pythonic, vec![]);
    assert_eq!(
        s.push("ok <|tool_call_start|>[f(x="),
        [StreamEvent::Content("ok ".into())]
    );
    assert_eq!(
        s.finish(),
        [StreamEvent::Content("<|tool_call_start|>[f(x=".into())]
    );
    let mut s = ToolCallStream::new(Nemotron, vec![]);
    assert_eq!(s.push("<TOOL"), []);
    assert_eq!(s.finish(), [StreamEvent::Content("<TOOL".into())]);
}

/// Pieces that make text look like calls in every format.
fn fragment() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(vec![
            "<tool_call>", "</tool_call>", "<tool_", "call>", "<function=f>", "</function>",
            "<parameter=n>", "</parameter>", "\n", " ", "{", "}", "[", "]", ";", ",", "(", ")",
            "=", "'", "\"", "\\", "é", "😀", "<", "|", "<|python_tag|>", "[TOOL_CALLS]",
            "[ARGS]", "[CALL_ID]", "<|tool_call|>", "<TOOLCALL>", "</TOOLCALL>",
            "<|tool_call_start|>", "<|tool_call_end|>", "f(n=1)", "g(s='x', o={\"a\": None})",
            "{\"name\": \"f\", \"arguments\": {\"n\": 1}}", "{\"name\": \"g\", \"parameters\": {}}",
            "[{\"name\": \"f\", \"arguments\": {}}]", "f[ARGS]{\"s\": \"x\"}", "True", "null", "1.5e3",
        ])
        .prop_map(String::from),
        1 => ".{0,6}",
    ]
}

fn all_formats_agree(text: &str, cuts: &[usize]) {
    let chunks = split_at(text, cuts);
    for format in ToolCallFormat::ALL {
        check(format, &tools(), &chunks);
    }
}

proptest! {
    #[test]
    fn nothing_panics_on_any_string_and_the_stream_agrees(text in any::<String>(), cuts in prop::collection::vec(0usize..64, 0..6)) {
        all_formats_agree(&text, &cuts);
    }

    #[test]
    fn call_like_text_streams_as_it_parses(
        parts in prop::collection::vec(fragment(), 0..24),
        cuts in prop::collection::vec(0usize..400, 0..12),
    ) {
        all_formats_agree(&parts.concat(), &cuts);
    }

    #[test]
    fn literals_never_panic(text in "[\\[\\]{}()'\"\\\\,:=a-zA-Z0-9_.+\\- \n]{0,40}") {
        let _ = pythonic::literal(&text);
        let _ = pythonic::parse_pythonic(&text);
    }
}
