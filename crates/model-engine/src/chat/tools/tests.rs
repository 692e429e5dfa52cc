//! `parse` on each JSON and XML format's calls as the templates and vLLM's
//! tests write them, and on malformed ones.

use serde_json::{Value, json};

use super::ToolCallFormat::*;
use super::*;

/// A call, its arguments given as any JSON text and compacted.
pub(super) fn call(name: &str, args: &str) -> ToolCall {
    let v: Value = serde_json::from_str(args).expect("test arguments are JSON");
    ToolCall {
        name: name.to_string(),
        arguments: serde_json::to_string(&v).unwrap(),
    }
}

pub(super) fn p(format: ToolCallFormat, text: &str) -> Parsed {
    parse(format, text, &[])
}

/// `text` is all content, nothing taken as a call.
#[track_caller]
pub(super) fn all_text(format: ToolCallFormat, text: &str) {
    assert_eq!(
        p(format, text),
        Parsed {
            content: text.to_string(),
            calls: vec![]
        },
        "{format}: {text:?}"
    );
}

#[test]
fn names_round_trip() {
    for f in ToolCallFormat::ALL {
        assert_eq!(ToolCallFormat::from_name(f.name()), Some(f));
        assert!(f.start_marker().is_some());
    }
    assert_eq!(ToolCallFormat::from_name("qwen3_xml"), Some(Qwen3Xml));
    assert_eq!(ToolCallFormat::from_name("Hermes"), None);
    assert_eq!(Hermes.start_marker(), Some("<tool_call>"));
    assert_eq!(Pythonic.start_marker(), Some("<|tool_call_start|>"));
    assert_eq!(Mistral.start_marker(), Some("[TOOL_CALLS]"));
    assert_eq!(Granite.start_marker(), Some("<|tool_call|>"));
    assert_eq!(Nemotron.start_marker(), Some("<TOOLCALL>"));
    assert_eq!(Llama3Json.start_marker(), Some("<|python_tag|>"));
}

#[test]
fn plain_text_is_untouched() {
    for f in ToolCallFormat::ALL {
        for t in [
            "",
            "  Hello, world!\n",
            "a < b and [x](y) {not json",
            "\n\n",
        ] {
            all_text(f, t);
        }
    }
}

// ---- Hermes -------------------------------------------------------------

#[test]
fn hermes_one_call_as_qwen_templates_write_it() {
    let t = "<tool_call>\n{\"name\": \"get_current_temperature\", \"arguments\": \
             {\"location\": \"San Francisco, CA, USA\", \"unit\": \"celsius\"}}\n</tool_call>";
    let r = p(Hermes, t);
    assert_eq!(r.content, "");
    assert_eq!(
        r.calls,
        [call(
            "get_current_temperature",
            r#"{"location": "San Francisco, CA, USA", "unit": "celsius"}"#
        )]
    );
    assert_eq!(
        r.calls[0].arguments,
        r#"{"location":"San Francisco, CA, USA","unit":"celsius"}"#
    );
}

#[test]
fn hermes_several_calls_and_text_around() {
    let t = "Let me check both.\n\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n\
             <tool_call>\n{\"arguments\": {}, \"name\": \"b\"}\n</tool_call>\nDone.";
    let r = p(Hermes, t);
    assert_eq!(r.calls, [call("a", r#"{"x":1}"#), call("b", "{}")]);
    assert_eq!(r.content, "Let me check both.\n\n\n\nDone.");
}

#[test]
fn hermes_unicode_escapes_and_nesting_survive() {
    let t = r#"<tool_call>{"name": "say", "arguments": {"text": "He said \"héllo\" 😀\n\\", "nested": {"list": [1, 2.5, {"deep": null}], "ok": true}, "ключ": "\u00e9"}}</tool_call>"#;
    let r = p(Hermes, t);
    assert_eq!(
        r.calls[0].arguments,
        r#"{"text":"He said \"héllo\" 😀\n\\","nested":{"list":[1,2.5,{"deep":null}],"ok":true},"ключ":"é"}"#
    );
    assert_eq!(r.content, "");
}

#[test]
fn hermes_arguments_written_as_a_json_string_are_read() {
    let t = r#"<tool_call>{"name": "f", "arguments": "{\"a\": [1]}"}</tool_call>"#;
    assert_eq!(p(Hermes, t).calls, [call("f", r#"{"a":[1]}"#)]);
}

#[test]
fn hermes_malformed_calls_stay_text() {
    for t in [
        // truncated JSON
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}\n</tool_call>",
        // missing end tag
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n",
        "Sure <tool_call>",
        // not JSON / unknown structure
        "<tool_call>get_weather(city=\"Paris\")</tool_call>",
        "<tool_call></tool_call>",
        "<tool_call>[]</tool_call>",
        "<tool_call>{\"name\": \"f\"}</tool_call>",
        "<tool_call>{\"name\": \"\", \"arguments\": {}}</tool_call>",
        "<tool_call>{\"name\": 3, \"arguments\": {}}</tool_call>",
        "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>",
        "<tool_call>{\"name\": \"f\", \"arguments\": \"not json\"}</tool_call>",
        "<tool_call>{\"name\": \"f\", \"arguments\": {}, \"parameters\": {}}</tool_call>",
        "<tool_call>{\"name\": \"f\", \"arguments\": {}} trailing</tool_call>",
        "<tool_call>\"just a string\"</tool_call>",
        "</tool_call><tool_call",
    ] {
        all_text(Hermes, t);
    }
}

#[test]
fn hermes_a_bad_call_stays_text_next_to_a_good_one() {
    let t = "<tool_call>{bad}</tool_call>\n<tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call> <tool_call>{";
    let r = p(Hermes, t);
    assert_eq!(r.calls, [call("g", "{}")]);
    assert_eq!(r.content, "<tool_call>{bad}</tool_call>\n <tool_call>{");
}

// ---- Qwen3Xml -------------------------------------------------------------

fn weather_tools() -> Vec<Value> {
    vec![json!({
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "scale": {"type": "number"},
                    "detailed": {"type": "boolean"},
                    "filter": {"type": "object"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "note": {"type": ["string", "null"]},
                    "count": {"type": ["null", "integer"]},
                    "zip": {"type": "string"}
                },
                "required": ["city"]
            }
        }
    })]
}

#[test]
fn qwen3_xml_one_call_as_the_qwen3_5_template_writes_it() {
    let t = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n\
             <parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
    let r = parse(Qwen3Xml, t, &weather_tools());
    assert_eq!(
        r.calls,
        [call("get_weather", r#"{"city":"Paris","days":3}"#)]
    );
    assert_eq!(r.content, "");
}

#[test]
fn qwen3_xml_values_follow_the_schema() {
    let t = "<tool_call>\n<function=get_weather>\n\
             <parameter=city>\n  São Paulo \"SP\" \\n\n</parameter>\n\
             <parameter=days>\n007\n</parameter>\n\
             <parameter=scale>\n2.5\n</parameter>\n\
             <parameter=detailed>\nTrue\n</parameter>\n\
             <parameter=filter>\n{\"min\": {\"t\": -1}}\n</parameter>\n\
             <parameter=tags>\n['a', \"b\"]\n</parameter>\n\
             <parameter=note>\nnull\n</parameter>\n\
             <parameter=count>\nNULL\n</parameter>\n\
             <parameter=zip>\n01234\n</parameter>\n\
             <parameter=extra>\n[1, {\"x\": true}]\n</parameter>\n\
             <parameter=words>\nhello there\n</parameter>\n\
             </function>\n</tool_call>";
    let r = parse(Qwen3Xml, t, &weather_tools());
    assert_eq!(
        r.calls,
        [call(
            "get_weather",
            r#"{"city": "  São Paulo \"SP\" \\n", "days": 7, "scale": 2.5, "detailed": true,
                "filter": {"min": {"t": -1}}, "tags": ["a", "b"], "note": "null", "count": null,
                "zip": "01234", "extra": [1, {"x": true}], "words": "hello there"}"#
        )]
    );
}

#[test]
fn qwen3_xml_values_that_do_not_convert_stay_text() {
    let t = "<tool_call><function=get_weather><parameter=days>three</parameter>\
             <parameter=detailed>maybe</parameter><parameter=scale>1e999</parameter>\
             <parameter=filter>{not: json</parameter></function></tool_call>";
    let r = parse(Qwen3Xml, t, &weather_tools());
    assert_eq!(
        r.calls,
        [call(
            "get_weather",
            r#"{"days": "three", "detailed": "maybe", "scale": "1e999", "filter": "{not: json"}"#
        )]
    );
}

#[test]
fn qwen3_xml_without_schema_tries_json_then_text() {
    let t = "<tool_call>\n<function=unknown_tool>\n<parameter=n>\n123\n</parameter>\n\
             <parameter=s>\nhello\n</parameter>\n<parameter=b>\ntrue\n</parameter>\n\
             <parameter=code>\ndef f():\n    return \"x\"\n\n</parameter>\n</function>\n</tool_call>";
    let r = parse(Qwen3Xml, t, &weather_tools());
    assert_eq!(
        r.calls,
        [call(
            "unknown_tool",
            r#"{"n": 123, "s": "hello", "b": true, "code": "def f():\n    return \"x\"\n"}"#
        )]
    );
}

#[test]
fn qwen3_xml_multiline_value_from_the_template_instructions() {
    let t = "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n\
             </parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\n\
             that can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>";
    let r = p(Qwen3Xml, t);
    assert_eq!(
        r.calls,
        [call(
            "example_function_name",
            r#"{"example_parameter_1": "value_1", "example_parameter_2":
                "This is the value for the second parameter\nthat can span\nmultiple lines"}"#
        )]
    );
}

#[test]
fn qwen3_xml_several_calls_text_before_and_no_parameters() {
    let t = "I will look.\n\n<tool_call>\n<function=a>\n</function>\n</tool_call>\n\
             <tool_call>\n<function=b>\n<parameter=x>\n1\n</parameter>\n</function>\n\
             <function=c>\n<parameter=y>\n[\"q\"]\n</parameter>\n</function>\n</tool_call>";
    let r = p(Qwen3Xml, t);
    assert_eq!(
        r.calls,
        [
            call("a", "{}"),
            call("b", r#"{"x":1}"#),
            call("c", r#"{"y":["q"]}"#)
        ]
    );
    assert_eq!(r.content, "I will look.");
}

#[test]
fn qwen3_xml_a_missing_parameter_end_is_read_as_vllm_reads_it() {
    let t =
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\nx\n</function>\n</tool_call>";
    assert_eq!(p(Qwen3Xml, t).calls, [call("f", r#"{"a":1,"b":"x"}"#)]);
}

#[test]
fn qwen3_xml_malformed_calls_stay_text() {
    for t in [
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n",
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        "<tool_call>\n<function=f\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\nstray text\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=a\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\n</function>\nafter\n</tool_call>",
        "<tool_call></tool_call>",
        "<function=f>\n</function>",
    ] {
        all_text(Qwen3Xml, t);
    }
}

// ---- Llama3Json -----------------------------------------------------------

#[test]
fn llama3_json_calls() {
    let one = r#"{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}"#;
    assert_eq!(
        p(Llama3Json, one).calls,
        [call("get_weather", r#"{"city":"Paris","days":2}"#)]
    );
    let tagged = format!("<|python_tag|>{one}");
    assert_eq!(p(Llama3Json, &tagged).calls.len(), 1);
    let padded = format!("\n  {one}\n");
    let r = p(Llama3Json, &padded);
    assert_eq!((r.content.as_str(), r.calls.len()), ("", 1));
    let several = r#"{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": "é;}"}}"#;
    assert_eq!(
        p(Llama3Json, several).calls,
        [call("a", "{}"), call("b", r#"{"x":"é;}"}"#)]
    );
    let after_text = format!("Let me call it.<|python_tag|>{one}");
    let r = p(Llama3Json, &after_text);
    assert_eq!((r.content.as_str(), r.calls.len()), ("Let me call it.", 1));
}

#[test]
fn llama3_json_malformed_or_plain_json_stays_text() {
    for t in [
        r#"{"name": "get_weather", "parameters": {"city": "Paris"}"#,
        r#"{"name": "get_weather"}"#,
        r#"{"answer": 42}"#,
        r#"{"name": "f", "parameters": {}} and then some text"#,
        r#"{"name": "f", "parameters": {}};;"#,
        "<|python_tag|>brave_search.call(query=\"weather\")",
        "<|python_tag|>",
        // JSON not at the start of the reply is text (as vLLM streams it)
        r#"Here: {"name": "f", "parameters": {}}"#,
        "{",
    ] {
        all_text(Llama3Json, t);
    }
}

// ---- Mistral --------------------------------------------------------------

#[test]
fn mistral_json_list() {
    let t = r#"[TOOL_CALLS][{"name": "add", "arguments": {"a": 3.5, "b": 4}}]"#;
    assert_eq!(p(Mistral, t).calls, [call("add", r#"{"a":3.5,"b":4}"#)]);
    // as the Mistral-Nemo template writes a turn: ids, several calls
    let t = r#"Computing. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1}, "id": "abcDEF123"}, {"name": "mul", "arguments": {"b": [2, "ü"]}, "id": "xyz987654"}]"#;
    let r = p(Mistral, t);
    assert_eq!(
        r.calls,
        [call("add", r#"{"a":1}"#), call("mul", r#"{"b":[2,"ü"]}"#)]
    );
    assert_eq!(r.content, "Computing.");
}

#[test]
fn mistral_name_args_form() {
    let t = r#"[TOOL_CALLS]add[ARGS]{"a": 3.5, "b": 4}"#;
    assert_eq!(p(Mistral, t).calls, [call("add", r#"{"a":3.5,"b":4}"#)]);
    let t = r#"[TOOL_CALLS]get_weather[ARGS]{"city": "Paris \"FR\""}[TOOL_CALLS]get-time.v2[CALL_ID]a1b2c3d4e[ARGS]{"tz": {"name": "CET"}}"#;
    assert_eq!(
        p(Mistral, t).calls,
        [
            call("get_weather", r#"{"city":"Paris \"FR\""}"#),
            call("get-time.v2", r#"{"tz":{"name":"CET"}}"#)
        ]
    );
    // `[ARGS]` lost in decoding (vLLM's v11 regex form)
    let t = "[TOOL_CALLS]add{\"a\": 1} sub{\"b\": 2}\n";
    assert_eq!(
        p(Mistral, t).calls,
        [call("add", r#"{"a":1}"#), call("sub", r#"{"b":2}"#)]
    );
}

#[test]
fn mistral_malformed_calls_stay_text() {
    for t in [
        r#"[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}"#,
        "[TOOL_CALLS]",
        "[TOOL_CALLS]  ",
        "[TOOL_CALLS]add[ARGS]not json",
        r#"[TOOL_CALLS]add[ARGS]{"a": 1} and some words"#,
        r#"[TOOL_CALLS]add[ARGS][1, 2]"#,
        r#"[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]"#,
        r#"[TOOL_CALLS][]"#,
        r#"[TOOL_CALLS][{"name": "add", "arguments": {}}] then text"#,
    ] {
        all_text(Mistral, t);
    }
}

// ---- Granite --------------------------------------------------------------

#[test]
fn granite_3_tool_call_token_list() {
    let t = r#"<|tool_call|>[{"name": "get_current_weather", "arguments": {"city": "Boston"}}, {"name": "get_time", "arguments": {}}]"#;
    assert_eq!(
        p(Granite, t).calls,
        [
            call("get_current_weather", r#"{"city":"Boston"}"#),
            call("get_time", "{}")
        ]
    );
    let t = "I'll check.<|tool_call|>[{\"name\": \"f\", \"arguments\": {\"q\": \"ü\"}}]\n";
    let r = p(Granite, t);
    assert_eq!((r.content.as_str(), r.calls.len()), ("I'll check.", 1));
}

#[test]
fn granite_4_hermes_tags_and_3_1_open_tag() {
    let t = "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n\
             <tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>";
    assert_eq!(
        p(Granite, t).calls,
        [call("a", r#"{"x":1}"#), call("b", "{}")]
    );
    let t = r#"<tool_call>[{"name": "a", "arguments": {"x": 1}}]"#;
    assert_eq!(p(Granite, t).calls, [call("a", r#"{"x":1}"#)]);
}

#[test]
fn granite_malformed_calls_stay_text() {
    for t in [
        r#"<|tool_call|>[{"name": "x""#,
        r#"<|tool_call|>not json"#,
        "<|tool_call|>",
        r#"<tool_call>{"name": "a"}</tool_call>"#,
        r#"<tool_call>[{"name": "a", "arguments": 1}]"#,
    ] {
        all_text(Granite, t);
    }
}

// ---- Nemotron -------------------------------------------------------------

#[test]
fn nemotron_toolcall_lists() {
    let t = r#"<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>"#;
    assert_eq!(
        p(Nemotron, t).calls,
        [call("get_weather", r#"{"city":"Paris"}"#)]
    );
    let t = "I'll check both.\n<TOOLCALL>[{\"name\": \"a\", \"arguments\": {\"x\": [1, {\"y\": \"✓\"}]}}, \
             {\"name\": \"b\", \"arguments\": \"{\\\"z\\\": null}\"}]</TOOLCALL>\n";
    let r = p(Nemotron, t);
    assert_eq!(
        r.calls,
        [
            call("a", r#"{"x":[1,{"y":"✓"}]}"#),
            call("b", r#"{"z":null}"#)
        ]
    );
    assert_eq!(r.content, "I'll check both.");
}

#[test]
fn nemotron_malformed_calls_stay_text() {
    for t in [
        r#"<TOOLCALL>[{"name": "a", "arguments": {}}]"#,
        r#"<TOOLCALL>[{"name": "a", "arguments": {}]</TOOLCALL>"#,
        "<TOOLCALL>garbage</TOOLCALL>",
        "<TOOLCALL>[]</TOOLCALL>",
        "<TOOLCALL>[1, 2]</TOOLCALL>",
    ] {
        all_text(Nemotron, t);
    }
}
