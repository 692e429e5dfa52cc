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
//! - Pythonic (LFM2) has no grammar here: forcing a call there is a 400.
//!
//! `parallel_tool_calls: false` allows one call; true, one or more.
//! Where the prompt left the model inside its reasoning (`<think>` opened
//! by the template), the grammar lets it finish reasoning first: any text
//! up to `</think>`, then the call.

use serde_json::{Value, json};

use crate::engine::chat::tools::ToolCallFormat;
use crate::engine::sampling::grammar::compact;
use crate::engine::tokenizer::Tokenizer;
use crate::server::error::ApiError;
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
) -> Result<String, ApiError> {
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
    let call = match format {
        ToolCallFormat::Hermes => format!(
            "{} \"\\n\" %json {} \"\\n\" {}",
            atom("<tool_call>"),
            call_schema(&functions, "arguments"),
            atom("</tool_call>")
        ),
        ToolCallFormat::Llama3Json => format!("%json {}", call_schema(&functions, "parameters")),
        ToolCallFormat::Granite | ToolCallFormat::Mistral | ToolCallFormat::Nemotron => {
            let start = format.start_marker().unwrap_or_default();
            let list = list_schema(&functions, tools.parallel);
            let end = match format {
                ToolCallFormat::Nemotron => atom("</TOOLCALL>"),
                _ => String::new(),
            };
            // One list holds every call.
            let body = format!("{} %json {} {}", atom(start), list, end);
            rules.push(format!("start: {}{body}", think_prefix(think)));
            return Ok(finish(rules, think, tokenizer));
        }
        ToolCallFormat::Qwen3Xml => {
            let mut alts = Vec::new();
            for (i, (name, params)) in functions.iter().enumerate() {
                rules.push(xml_call(i, name, params, &mut Vec::new()));
                alts.push(format!("call_{i}"));
            }
            alts.join(" | ")
        }
        ToolCallFormat::Pythonic => {
            return Err(ApiError::bad_param(
                "tool_choice",
                "forcing a call (tool_choice \"required\" or a named function) is not \
                 supported for the pythonic tool-call format; use \"auto\"",
            ));
        }
    };
    let sep = match format {
        ToolCallFormat::Llama3Json => "\"; \"",
        _ => "\"\\n\"",
    };
    rules.push(format!("call: {call}"));
    let calls = if tools.parallel {
        format!("call ({sep} call)*")
    } else {
        "call".to_string()
    };
    rules.insert(0, format!("start: {}{calls}", think_prefix(think)));
    Ok(finish(rules, think, tokenizer))
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
    let mut body = vec![quote(&format!("<tool_call>\n<function={name}>\n"))];
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
                    match grammar(format, &tools, think, &tok) {
                        Ok(g) => {
                            let c = crate::OutputConstraint::Lark(g.clone());
                            factory
                                .compile(&c)
                                .unwrap_or_else(|e| panic!("{format} {think:?}: {e}\n{g}"));
                        }
                        Err(e) => assert_eq!(format, ToolCallFormat::Pythonic, "{e}"),
                    }
                }
            }
        }
    }

    #[test]
    fn xml_parameters_follow_the_schema() {
        let tools = weather(json!("required"), false);
        let g = grammar(ToolCallFormat::Qwen3Xml, &tools, Think::No, &tokenizer()).unwrap();
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
