//! Qwen3-Coder / Qwen3.5 calls: `<function=NAME><parameter=P>VALUE</parameter></function>`.

use serde_json::{Map, Number, Value};

use super::{ToolCall, arguments_text, pythonic};

const FUNCTION: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAMETER: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";

/// The functions inside one `<tool_call>` block: one or more
/// `<function=NAME>...</function>`, whitespace around them and nothing else.
pub(super) fn parse_xml(text: &str, tools: &[Value]) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = text.trim_start();
    while !rest.is_empty() {
        let r = rest.strip_prefix(FUNCTION)?;
        let (name, r) = tag_name(r)?;
        let end = r.find(FUNCTION_END)?;
        let properties = parameter_types(tools, name);
        let args = parse_parameters(&r[..end], properties)?;
        calls.push(ToolCall {
            name: name.to_string(),
            arguments: arguments_text(&args),
        });
        rest = r[end + FUNCTION_END.len()..].trim_start();
    }
    Some(calls)
}

/// `NAME>` at the start of `text`: the name (trimmed, not empty, on one line,
/// without `<`) and the text after `>`.
fn tag_name(text: &str) -> Option<(&str, &str)> {
    let close = text.find('>')?;
    let name = text[..close].trim();
    if name.is_empty() || name.contains(['\n', '<']) {
        return None;
    }
    Some((name, &text[close + 1..]))
}

fn parse_parameters(
    text: &str,
    properties: Option<&Map<String, Value>>,
) -> Option<Map<String, Value>> {
    let mut args = Map::new();
    let mut rest = text.trim_start();
    while !rest.is_empty() {
        let r = rest.strip_prefix(PARAMETER)?;
        let (name, r) = tag_name(r)?;
        // The value ends at `</parameter>`, or (as vLLM reads a model that
        // forgot it) at the next `<parameter=` or the end of the function.
        let (value, after) = match (r.find(PARAMETER_END), r.find(PARAMETER)) {
            (Some(e), next) if next.is_none_or(|n| e < n) => {
                (&r[..e], &r[e + PARAMETER_END.len()..])
            }
            (_, Some(n)) => (&r[..n], &r[n..]),
            _ => (r, ""),
        };
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        let ty = properties.and_then(|p| p.get(name)).map(schema_type);
        args.insert(name.to_string(), convert(value, ty.flatten()));
        rest = after.trim_start();
    }
    Some(args)
}

/// The `properties` of function `name`'s parameters in OpenAI `tools`
/// (`{"type": "function", "function": {"name", "parameters"}}`, or the
/// inner object alone).
fn parameter_types<'a>(tools: &'a [Value], name: &str) -> Option<&'a Map<String, Value>> {
    tools.iter().find_map(|tool| {
        let f = tool.get("function").unwrap_or(tool);
        if f.get("name")?.as_str()? != name {
            return None;
        }
        f.get("parameters")?.get("properties")?.as_object()
    })
}

/// A parameter's JSON Schema type, lowercase: `"type": "x"`, or the first
/// type other than `null` of `"type": ["x", "null"]`; `None` without one.
fn schema_type(schema: &Value) -> Option<String> {
    let ty = match schema.get("type")? {
        Value::String(s) => s.as_str(),
        Value::Array(types) => types
            .iter()
            .filter_map(Value::as_str)
            .find(|t| !t.eq_ignore_ascii_case("null"))?,
        _ => return None,
    };
    Some(ty.trim().to_ascii_lowercase())
}

/// A parameter's text as JSON, by its schema type (see the module docs of
/// `chat::tools`); text where it does not convert.
fn convert(value: &str, ty: Option<String>) -> Value {
    let text = || Value::String(value.to_string());
    let Some(ty) = ty else {
        return serde_json::from_str(value).unwrap_or_else(|_| text());
    };
    let t = ty.as_str();
    if matches!(t, "string" | "str" | "text" | "varchar" | "char" | "enum") {
        return text();
    }
    let trimmed = value.trim();
    if trimmed.eq_ignore_ascii_case("null") {
        return Value::Null;
    }
    if ["int", "uint", "long", "short", "unsigned"]
        .iter()
        .any(|p| t.starts_with(p))
    {
        return trimmed
            .parse::<i64>()
            .map(Value::from)
            .or_else(|_| trimmed.parse::<u64>().map(Value::from))
            .unwrap_or_else(|_| text());
    }
    if ["num", "float", "double"].iter().any(|p| t.starts_with(p)) {
        return match serde_json::from_str::<Value>(trimmed) {
            Ok(n @ Value::Number(_)) => n,
            _ => trimmed
                .parse::<f64>()
                .ok()
                .and_then(Number::from_f64)
                .map_or_else(text, Value::Number),
        };
    }
    if matches!(t, "boolean" | "bool" | "binary") {
        return match trimmed.to_ascii_lowercase().as_str() {
            "true" => Value::Bool(true),
            "false" => Value::Bool(false),
            _ => text(),
        };
    }
    if matches!(t, "object" | "array" | "arr") || t.starts_with("dict") || t.starts_with("list") {
        return serde_json::from_str(trimmed)
            .ok()
            .or_else(|| pythonic::literal(trimmed))
            .unwrap_or_else(text);
    }
    serde_json::from_str(value).unwrap_or_else(|_| text())
}
