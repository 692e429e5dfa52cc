//! Calls written as JSON: Hermes, Llama 3, Granite, Nemotron, Mistral.

use serde_json::{Map, Value};

use super::{ToolCall, arguments_text};

/// One JSON value at the start of `text` and the bytes it takes; `None`
/// where `text` does not open with a complete JSON value.
fn json_prefix(text: &str) -> Option<(Value, usize)> {
    let mut values = serde_json::Deserializer::from_str(text).into_iter::<Value>();
    let value = values.next()?.ok()?;
    Some((value, values.byte_offset()))
}

/// JSON objects `{"name": ..., "arguments": {...}}` (or `"parameters"`), or
/// lists of them, separated by whitespace and at most one `,` or `;`
/// between two. `None` if anything else is there.
pub(super) fn parse_json_calls(text: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = text.trim_start();
    let mut first = true;
    while !rest.is_empty() {
        if !first && let Some(r) = rest.strip_prefix([',', ';']) {
            rest = r.trim_start();
            if rest.is_empty() {
                break;
            }
        }
        first = false;
        let (value, len) = json_prefix(rest)?;
        match value {
            Value::Object(o) => calls.push(call_from_object(&o)?),
            Value::Array(items) => {
                for item in items {
                    calls.push(call_from_object(item.as_object()?)?);
                }
            }
            _ => return None,
        }
        rest = rest[len..].trim_start();
    }
    Some(calls)
}

/// A call from `{"name": "...", "arguments": {...}}`; `"parameters"` (Llama 3)
/// is taken for `"arguments"`, and arguments written as a JSON string
/// holding an object are read as that object.
fn call_from_object(o: &Map<String, Value>) -> Option<ToolCall> {
    let name = o.get("name")?.as_str()?;
    if name.is_empty() {
        return None;
    }
    let args = match (o.get("arguments"), o.get("parameters")) {
        (Some(a), None) | (None, Some(a)) => a,
        _ => return None,
    };
    Some(ToolCall {
        name: name.to_string(),
        arguments: arguments_from(args)?,
    })
}

fn arguments_from(args: &Value) -> Option<String> {
    match args {
        Value::Object(o) => Some(arguments_text(o)),
        Value::String(s) => match serde_json::from_str::<Value>(s).ok()? {
            Value::Object(o) => Some(arguments_text(&o)),
            _ => None,
        },
        _ => None,
    }
}

const TOOL_CALLS: &str = "[TOOL_CALLS]";

/// Mistral: the text after the first `[TOOL_CALLS]`, to the end of the
/// reply. Each `[TOOL_CALLS]` opens either a JSON list of calls (v0.3,
/// Nemo) or calls written `name[CALL_ID]id[ARGS]{...}`, `[CALL_ID]...` and
/// `[ARGS]` optional (tokenizer v11+).
pub(super) fn parse_mistral(text: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    for segment in text.split(TOOL_CALLS) {
        let t = segment.trim_start();
        let mut found = if t.starts_with(['[', '{']) {
            parse_json_calls(t)?
        } else {
            parse_named_calls(t)?
        };
        if found.is_empty() {
            return None;
        }
        calls.append(&mut found);
    }
    Some(calls)
}

/// `name[ARGS]{...}` calls, one after another (whitespace or `,` between).
fn parse_named_calls(text: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = text.trim_start();
    while !rest.is_empty() {
        if !calls.is_empty()
            && let Some(r) = rest.strip_prefix(',')
        {
            rest = r.trim_start();
        }
        let name_len = rest
            .find(|c: char| !(c.is_alphanumeric() || matches!(c, '_' | '-' | '.')))
            .unwrap_or(rest.len());
        if name_len == 0 {
            return None;
        }
        let name = &rest[..name_len];
        rest = &rest[name_len..];
        if let Some(r) = rest.strip_prefix("[CALL_ID]") {
            let id_len = r.find(|c: char| !c.is_alphanumeric()).unwrap_or(r.len());
            rest = &r[id_len..];
        }
        if let Some(r) = rest.strip_prefix("[ARGS]") {
            rest = r;
        }
        let (value, len) = json_prefix(rest)?;
        let Value::Object(args) = value else {
            return None;
        };
        calls.push(ToolCall {
            name: name.to_string(),
            arguments: arguments_text(&args),
        });
        rest = rest[len..].trim_start();
    }
    Some(calls)
}
