//! The grammar that forces a call (`tool_choice: "required"` or a named
//! function): a Lark grammar in llguidance's dialect for the model's own
//! call syntax, so that a forced reply is always a call the parser reads
//! back, to a function among the tools, with arguments of the function's
//! `parameters` schema.
//!
//! - The JSON formats embed the call as a schema (`%json {...}`, on one
//!   line with `", "` and `": "` as Python's `json.dumps` writes it):
//!   `{"name": {"const": NAME}, "arguments": PARAMETERS}` with both
//!   required and nothing else (`anyOf` over the tools for `required`;
//!   Llama 3 spells `arguments` `parameters`), between the format's
//!   markers: Hermes `<tool_call>\n{...}\n</tool_call>`, Granite
//!   `<|tool_call|>[...]`, Nemotron `<TOOLCALL>[...]</TOOLCALL>`, Mistral
//!   `[TOOL_CALLS][...]`, Llama 3 bare objects separated by `; `.
//! - Qwen3Xml (Qwen3-Coder, Qwen3.5) writes parameters as tags; each
//!   parameter of the schema's `properties` is written in order (the
//!   `required` ones always, the others optionally). A value with an
//!   `enum` of strings is one of them; another string is any text without
//!   `<` (so it cannot end the tag early); any other type is JSON held to
//!   the parameter's schema (the parser reads it back as JSON).
//! - Pythonic (LFM2) writes `[f(a=1, b="x")]` between its markers: each
//!   parameter of the schema's `properties` in order (the `required` ones
//!   always), its value JSON of its schema (the parser reads JSON's
//!   literals beside Python's).
//!
//! `parallel_tool_calls: false` allows one call; true, one or more.
//! Where the prompt left the model inside its reasoning (`<think>` opened
//! by the template), the grammar lets it finish reasoning first: any text
//! up to `</think>`, then the call.

use serde_json::{Value, json};

use crate::engine::chat::tools::ToolCallFormat;
use crate::engine::sampling::grammar::{compact, regex_escape};
use crate::engine::tokenizer::Tokenizer;
use crate::server::tools::{ToolChoice, Tools};

/// How the reply begins with respect to reasoning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Think {
    /// No reasoning before the call.
    No,
    /// The prompt opened `<think>`: reasoning, `</think>`, then the call.
    Open,
}

/// The Lark grammar of a forced call for `tools` in `format`.
pub fn grammar(
    format: ToolCallFormat,
    tools: &Tools,
    think: Think,
    tokenizer: &Tokenizer,
) -> String {
    let Forced {
        calls, mut rules, ..
    } = forced(format, tools, tokenizer);
    rules.insert(0, format!("start: {}{calls}", think_prefix(think)));
    finish(rules, think, tokenizer)
}

/// The grammar of a reply under `tool_choice: "auto"` with a `strict`
/// tool: free text without the format's opening marker, or free text up
/// to its first marker and then calls held as a forced call's are (every
/// tool's schema holds, strict or not: the reply's calls always parse).
/// `None` where a call has no opening marker to be told by (Llama 3's
/// bare JSON).
pub fn strict_auto(
    format: ToolCallFormat,
    tools: &Tools,
    think: Think,
    tokenizer: &Tokenizer,
) -> Option<String> {
    let Forced {
        after, mut rules, ..
    } = forced(format, tools, tokenizer);
    let (after, marker) = (after?, format.start_marker()?);
    // The lead ends with the first marker; the rest of the calls follow.
    let (plain, lead) = match special_id(tokenizer, marker) {
        Some(id) => (format!("<[^{id}]>*"), format!("<[^{id}]>* <[{id}]>")),
        None => {
            let m = regex_escape(marker);
            rules.push(format!("PLAIN: /(?s:.*)/ & ~/(?s:.*){m}(?s:.*)/"));
            rules.push(format!("LEAD: /(?s:.*){m}/ & ~/(?s:.*){m}(?s:.+)/"));
            ("PLAIN".to_owned(), "LEAD".to_owned())
        }
    };
    rules.insert(
        0,
        format!("start: {}({plain} | {lead} {after})", think_prefix(think)),
    );
    Some(finish(rules, think, tokenizer))
}

/// A forced call's grammar, without reasoning.
struct Forced {
    /// The expression of one call or more (or of the one list of calls).
    calls: String,
    /// What follows the format's opening marker in `calls`: the calls,
    /// the first one's marker taken as written. `None` for a format whose
    /// calls open with no marker (Llama 3's bare JSON).
    after: Option<String>,
    /// The rules both refer to.
    rules: Vec<String>,
}

fn forced(format: ToolCallFormat, tools: &Tools, tokenizer: &Tokenizer) -> Forced {
    let functions: Vec<(&str, Value)> = tools
        .functions()
        .filter(|f| match &tools.choice {
            ToolChoice::Named(n) => f.get("name").and_then(Value::as_str) == Some(n),
            _ => true,
        })
        .map(|f| {
            let name = f.get("name").and_then(Value::as_str).unwrap_or("");
            let params = match f.get("parameters") {
                Some(p @ Value::Object(_)) => p.clone(),
                _ => json!({"type": "object"}),
            };
            (name, params)
        })
        .collect();
    let atom = |text: &str| marker_atom(tokenizer, text);
    let mut rules = Vec::new();
    // Formats that write one list of calls after their marker.
    let list = |open: String, after: String, rules: Vec<String>| Forced {
        calls: format!("{open} {after}"),
        after: Some(after),
        rules,
    };
    // Otherwise a call is `open call_body` (no `open` for Llama 3).
    let (open, body) = match format {
        ToolCallFormat::Hermes => (
            Some(atom("<tool_call>")),
            format!(
                "\"\\n\" %json {} \"\\n\" {}",
                call_schema(&functions, "arguments"),
                atom("</tool_call>")
            ),
        ),
        ToolCallFormat::Llama3Json => (
            None,
            format!("%json {}", call_schema(&functions, "parameters")),
        ),
        ToolCallFormat::Granite | ToolCallFormat::Mistral | ToolCallFormat::Nemotron => {
            let start = format.start_marker().unwrap_or_default();
            let end = match format {
                ToolCallFormat::Nemotron => atom("</TOOLCALL>"),
                _ => String::new(),
            };
            let calls = list_schema(&functions, tools.parallel);
            return list(atom(start), format!("%json {calls} {end}"), rules);
        }
        ToolCallFormat::Qwen3Xml => {
            let mut alts = Vec::new();
            for (i, (name, params)) in functions.iter().enumerate() {
                rules.push(xml_call(i, name, params, &mut Vec::new()));
                alts.push(format!("call_{i}"));
            }
            (Some(quote("<tool_call>")), alts.join(" | "))
        }
        ToolCallFormat::Pythonic => {
            let mut alts = Vec::new();
            for (i, (name, params)) in functions.iter().enumerate() {
                rules.push(format!("call_{i}: {}", python_call(name, params)));
                alts.push(format!("call_{i}"));
            }
            rules.push(format!("call: {}", alts.join(" | ")));
            let calls = if tools.parallel {
                "call (\", \" call)*"
            } else {
                "call"
            };
            let after = format!("\"[\" {calls} \"]\" {}", atom("<|tool_call_end|>"));
            return list(atom("<|tool_call_start|>"), after, rules);
        }
    };
    let sep = match format {
        ToolCallFormat::Llama3Json => "\"; \"",
        _ => "\"\\n\"",
    };
    rules.push(format!("call_body: {body}"));
    rules.push(match &open {
        Some(open) => format!("call: {open} call_body"),
        None => "call: call_body".to_owned(),
    });
    let more = if tools.parallel {
        format!(" ({sep} call)*")
    } else {
        String::new()
    };
    Forced {
        calls: format!("call{more}"),
        after: open.map(|_| format!("call_body{more}")),
        rules,
    }
}

fn think_prefix(think: Think) -> &'static str {
    match think {
        Think::No => "",
        Think::Open => "think \"\\n\\n\" ",
    }
}

/// The rules joined, with the reasoning rule where the reply opens in it.
fn finish(mut rules: Vec<String>, think: Think, tokenizer: &Tokenizer) -> String {
    if think == Think::Open {
        let end = "</think>";
        rules.push(match special_id(tokenizer, end) {
            // Any tokens but the end, then the end.
            Some(id) => format!("think: <[^{id}]>* <[{id}]>"),
            // Any text, lazily, up to and with the end.
            None => format!("think[suffix={}]: /(?s:.*)/", quote(end)),
        });
    }
    rules.join("\n")
}

/// The schema of one call object: `name` one of the functions' (each with
/// its own arguments schema under `args_key`).
fn call_schema(functions: &[(&str, Value)], args_key: &str) -> Value {
    let alts: Vec<Value> = functions
        .iter()
        .map(|(name, params)| {
            json!({
                "type": "object",
                "properties": {"name": {"const": name}, args_key: params},
                "required": ["name", args_key],
                "additionalProperties": false,
            })
        })
        .collect();
    compact(match <[Value; 1]>::try_from(alts) {
        Ok([one]) => one,
        Err(alts) => json!({"anyOf": alts}),
    })
}

fn list_schema(functions: &[(&str, Value)], parallel: bool) -> Value {
    let mut list = json!({
        "type": "array",
        "items": call_schema(functions, "arguments"),
        "minItems": 1,
    });
    if !parallel {
        list["maxItems"] = json!(1);
    }
    compact(list)
}

/// Rule `call_{i}` (and the rules of its parameters, pushed to `extra`,
/// returned joined after it): a Qwen3Xml call of `name`.
fn xml_call(i: usize, name: &str, params: &Value, extra: &mut Vec<String>) -> String {
    let props = params.get("properties").and_then(Value::as_object);
    let required: Vec<&str> = params
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    // The opening `<tool_call>` is the caller's (`forced`).
    let mut body = vec![quote(&format!("\n<function={name}>\n"))];
    for (j, (param, schema)) in props.into_iter().flatten().enumerate() {
        let rule = format!("p_{i}_{j}");
        let open = quote(&format!("<parameter={param}>\n"));
        extra.push(format!("{rule}: {open} {}", xml_value(schema)));
        body.push(if required.contains(&param.as_str()) {
            rule
        } else {
            format!("{rule}?")
        });
    }
    body.push(quote("</function>\n</tool_call>"));
    let mut out = format!("call_{i}: {}", body.join(" "));
    for r in extra.drain(..) {
        out.push('\n');
        out.push_str(&r);
    }
    out
}

/// A Pythonic call of `name`: `name(a=1, b="x")`, each parameter of the
/// schema's `properties` in order (`required` ones always, the others
/// optionally), `, ` between those written, each value JSON of its schema
/// (a Python literal too: the parser takes JSON's `true`, `false` and
/// `null` beside Python's).
fn python_call(name: &str, params: &Value) -> String {
    let props: Vec<(&String, &Value)> = params
        .get("properties")
        .and_then(Value::as_object)
        .map(|p| p.iter().collect())
        .unwrap_or_default();
    let required: Vec<&str> = params
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let item = |j: usize| {
        let (param, schema) = props[j];
        format!(
            "{} %json {}",
            quote(&format!("{param}=")),
            compact(schema.clone())
        )
    };
    let is_required = |j: usize| required.contains(&props[j].0.as_str());
    // After something was written: `, p` for each parameter left.
    let mut tail = String::new();
    // Before anything was written: the first parameter written, then the tail.
    let mut head = String::new();
    for j in (0..props.len()).rev() {
        let next_tail = tail.clone();
        tail = if is_required(j) {
            format!("\", \" {} {next_tail}", item(j))
        } else {
            format!("(\", \" {})? {next_tail}", item(j))
        };
        head = if is_required(j) {
            format!("{} {next_tail}", item(j))
        } else if head.trim().is_empty() {
            format!("({} {next_tail})?", item(j))
        } else {
            format!("({} {next_tail} | {head})", item(j))
        };
    }
    format!("{} {head} \")\"", quote(&format!("{name}(")))
}

/// A parameter's value and its closing tag.
fn xml_value(schema: &Value) -> String {
    const CLOSE: &str = "\n</parameter>\n";
    let types: Vec<&str> = match schema.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    if let Some(Value::Array(values)) = schema.get("enum")
        && !values.is_empty()
        && values.iter().all(Value::is_string)
    {
        let alts: Vec<String> = values
            .iter()
            .filter_map(Value::as_str)
            .map(|v| quote(&format!("{v}{CLOSE}")))
            .collect();
        return format!("({})", alts.join(" | "));
    }
    if types.contains(&"string") {
        let min = schema.get("minLength").and_then(Value::as_u64).unwrap_or(0);
        let count = match schema.get("maxLength").and_then(Value::as_u64) {
            Some(max) => format!("{{{min},{max}}}"),
            None if min > 0 => format!("{{{min},}}"),
            None => "*".into(),
        };
        // One lexeme: the text and its closing tag, so that where the text
        // ends is never ambiguous.
        return format!("/[^<]{count}\\n<\\/parameter>\\n/");
    }
    format!("%json {} {}", compact(schema.clone()), quote(CLOSE))
}

/// A Lark string literal.
fn quote(text: &str) -> String {
    serde_json::to_string(text).unwrap_or_default()
}

/// `text` as a grammar item: its special token (`<[id]>`) where the
/// tokenizer has it as one, else the text.
fn marker_atom(tokenizer: &Tokenizer, text: &str) -> String {
    match special_id(tokenizer, text) {
        Some(id) => format!("<[{id}]>"),
        None => quote(text),
    }
}

/// The id of `text` where it is one special token of the tokenizer.
fn special_id(tokenizer: &Tokenizer, text: &str) -> Option<u32> {
    match tokenizer.special_token_in(text) {
        Ok(Some(t)) if t == text => tokenizer.token_to_id(text),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::tools::read;

    fn tokenizer() -> Tokenizer {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/qwen3_5");
        Tokenizer::from_dir(dir).unwrap()
    }

    fn weather(choice: Value, parallel: bool) -> Tools {
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "note": {"type": "string", "maxLength": 8}},
            "required": ["city", "days"]}}},
            {"type": "function", "function": {"name": "now"}}]);
        read(Some(&tools), Some(&choice), Some(&json!(parallel)))
            .unwrap()
            .unwrap()
    }

    #[test]
    fn grammars_compile() {
        let tok = tokenizer();
        let factory = crate::engine::sampling::grammar::GrammarFactory::new(&tok).unwrap();
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        for format in ToolCallFormat::ALL {
            for (choice, parallel) in [(json!("required"), true), (named.clone(), false)] {
                for think in [Think::No, Think::Open] {
                    let tools = weather(choice.clone(), parallel);
                    let g = grammar(format, &tools, think, &tok);
                    let c = crate::OutputConstraint::Lark(g.clone());
                    factory
                        .compile(&c)
                        .unwrap_or_else(|e| panic!("{format} {think:?}: {e}\n{g}"));
                }
            }
        }
    }

    #[test]
    fn xml_parameters_follow_the_schema() {
        let tools = weather(json!("required"), false);
        let g = grammar(ToolCallFormat::Qwen3Xml, &tools, Think::No, &tokenizer());
        assert!(
            g.contains(r#""Paris\n</parameter>\n" | "Tokyo\n</parameter>\n""#),
            "{g}"
        );
        assert!(
            g.contains(r#"%json {"type":"integer","minimum":1,"maximum":7,"x-guidance":"#),
            "{g}"
        );
        assert!(g.contains(r"/[^<]{0,8}\n<\/parameter>\n/"), "{g}");
        assert!(g.contains("p_0_0 p_0_1 p_0_2?"), "{g}");
        assert!(g.starts_with("start: call\n"), "{g}");
    }
}

#[cfg(test)]
mod strict_tests {
    use serde_json::json;

    use super::*;
    use crate::engine::chat::tools::parse;
    use crate::server::tools::read;

    /// Random walks (uniform among the allowed ids) through the grammar
    /// after `lead`'s tokens; each finished reply's text.
    fn walks(tok: &Tokenizer, grammar: &str, lead: &str, n: u64) -> Vec<String> {
        let factory = crate::engine::sampling::grammar::GrammarFactory::new(tok).unwrap();
        let c = crate::OutputConstraint::Lark(grammar.to_owned());
        let mut out = Vec::new();
        for seed in 0..n {
            let mut g = factory
                .compile(&c)
                .unwrap_or_else(|e| panic!("{e}\n{grammar}"));
            let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let mut ids = tok.encode(lead, false).unwrap();
            for &id in &ids {
                g.accept(id).unwrap();
            }
            for _ in 0..300 {
                let mask = g.mask().unwrap();
                let allowed: Vec<u32> = (0..tok.vocab_size() as u32)
                    .filter(|&i| mask.allows(i))
                    .collect();
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let id = allowed[(state % allowed.len() as u64) as usize];
                if tok.eos_ids().contains(&id) {
                    out.push(tok.decode_with(&ids, false).unwrap());
                    break;
                }
                ids.push(id);
                if g.accept(id).unwrap() {
                    out.push(tok.decode_with(&ids, false).unwrap());
                    break;
                }
            }
        }
        out
    }

    #[test]
    fn strict_auto_replies_are_text_or_calls_that_hold() {
        let tok = Tokenizer::from_dir(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/qwen3_5"
        ))
        .unwrap();
        let list = json!([{"type": "function", "function": {"name": "pick", "strict": true,
            "parameters": {"type": "object", "properties": {
                "n": {"type": "integer", "minimum": 1, "maximum": 3}},
            "required": ["n"], "additionalProperties": false}}}]);
        let tools = read(Some(&list), Some(&json!("auto")), Some(&json!(false)))
            .unwrap()
            .unwrap();
        for format in ToolCallFormat::ALL {
            let Some(g) = strict_auto(format, &tools, Think::No, &tok) else {
                assert_eq!(format, ToolCallFormat::Llama3Json);
                continue;
            };
            let marker = format.start_marker().unwrap();
            let (mut texts, mut calls) = (0, 0);
            // The marker is rare in a uniform walk: half the walks start with it.
            let replies = walks(&tok, &g, "", 20).into_iter().chain(walks(
                &tok,
                &g,
                &format!("ok {marker}"),
                20,
            ));
            for reply in replies {
                let parsed = parse(format, &reply, &tools.list);
                if reply.contains(marker) {
                    calls += 1;
                    assert_eq!(parsed.calls.len(), 1, "{format}: {reply:?}\n{g}");
                    let args: serde_json::Value =
                        serde_json::from_str(&parsed.calls[0].arguments).unwrap();
                    let n = args["n"].as_i64().unwrap();
                    assert!((1..=3).contains(&n), "{format}: {reply:?}");
                } else {
                    texts += 1;
                    assert!(parsed.calls.is_empty(), "{format}: {reply:?}");
                }
            }
            assert!(
                texts > 0 && calls > 10,
                "{format}: {texts} texts, {calls} calls"
            );
        }
    }

    /// Every format's forced grammar: every walk is one call or more that
    /// the format's parser reads back, with arguments of the schema
    /// (an enum, a bounded integer, an optional bounded string).
    #[test]
    fn forced_calls_parse_back_with_valid_arguments_in_every_format() {
        let tok = Tokenizer::from_dir(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/qwen3_5"
        ))
        .unwrap();
        let list = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "note": {"type": "string", "maxLength": 8}},
            "required": ["city", "days"], "additionalProperties": false}}}]);
        for parallel in [false, true] {
            let tools = read(
                Some(&list),
                Some(&json!("required")),
                Some(&json!(parallel)),
            )
            .unwrap()
            .unwrap();
            for format in ToolCallFormat::ALL {
                let g = grammar(format, &tools, Think::No, &tok);
                let replies = walks(&tok, &g, "", 12);
                assert!(
                    replies.len() >= 6,
                    "{format}: {} walks ended",
                    replies.len()
                );
                for reply in replies {
                    let parsed = parse(format, &reply, &tools.list);
                    assert!(!parsed.calls.is_empty(), "{format}: {reply:?}\n{g}");
                    assert!(parallel || parsed.calls.len() == 1, "{format}: {reply:?}");
                    for call in &parsed.calls {
                        assert_eq!(call.name, "get_weather");
                        let a: serde_json::Value = serde_json::from_str(&call.arguments).unwrap();
                        assert!(
                            ["Paris", "Tokyo"].contains(&a["city"].as_str().unwrap()),
                            "{format}: {reply:?}"
                        );
                        assert!(
                            (1..=7).contains(&a["days"].as_i64().unwrap()),
                            "{format}: {reply:?}"
                        );
                        if let Some(note) = a.get("note") {
                            assert!(
                                note.as_str().unwrap().chars().count() <= 8,
                                "{format}: {reply:?}"
                            );
                        }
                    }
                }
            }
        }
    }
}
