//! A chat request's `tools`, `tool_choice` and `parallel_tool_calls`,
//! checked, and what the template is given of them.
//!
//! Tools are OpenAI function tools, `{"type": "function", "function":
//! {"name", "description"?, "parameters"?, "strict"?}}`, handed to the
//! template as the list of those maps (as transformers'
//! `apply_chat_template(tools=...)` does). A malformed tool is a 400 that
//! names it (`tools[2].function.name`), never a tool quietly left out.
//!
//! `tool_choice`: `none` (the tools are still rendered, as vLLM renders
//! them, but the reply is not read for calls), `auto` (the default with
//! tools: the reply is read for calls), `required` or
//! `{"type": "function", "function": {"name": ...}}` (a call is forced by
//! a grammar: [`tool_grammar`](crate::server::tool_grammar)).

use std::collections::HashSet;

use serde_json::{Map, Value};

use crate::server::error::ApiError;

/// What `tool_choice` asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    /// This function must be called.
    Named(String),
}

/// A request's tools, checked.
#[derive(Clone, Debug)]
pub struct Tools {
    /// `{"type": "function", "function": {...}}` maps, as given.
    pub list: Vec<Value>,
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (default true): more than one call per reply.
    pub parallel: bool,
}

impl Tools {
    /// The tool definitions' `function` maps.
    pub fn functions(&self) -> impl Iterator<Item = &Map<String, Value>> {
        self.list
            .iter()
            .filter_map(|t| t.get("function").and_then(Value::as_object))
    }

    /// Whether the reply must be a call (and a grammar holds it to one).
    pub fn forced(&self) -> bool {
        matches!(self.choice, ToolChoice::Required | ToolChoice::Named(_))
    }

    /// Whether a call is held to its schema although the reply may be
    /// text: `tool_choice: "auto"` with a tool marked `strict: true`.
    pub fn strict_auto(&self) -> bool {
        self.choice == ToolChoice::Auto
            && self
                .functions()
                .any(|f| f.get("strict").and_then(Value::as_bool) == Some(true))
    }

    /// Whether the reply is read for calls.
    pub fn parsed(&self) -> bool {
        self.choice != ToolChoice::None
    }
}

/// The longest function name: OpenAI's limit.
const MAX_NAME: usize = 64;

/// Reads `tools`, `tool_choice` and `parallel_tool_calls`. `None`: no
/// tools (absent, null or empty) and a `tool_choice` that needs none.
pub fn read(
    tools: Option<&Value>,
    choice: Option<&Value>,
    parallel: Option<&Value>,
) -> Result<Option<Tools>, ApiError> {
    let parallel = match parallel {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::bad_param(
                "parallel_tool_calls",
                "parallel_tool_calls must be true or false",
            ));
        }
    };
    let list = match tools {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(list)) => list.clone(),
        Some(_) => {
            return Err(ApiError::bad_param(
                "tools",
                "tools must be a list of {\"type\": \"function\", \"function\": {...}}",
            ));
        }
    };
    let mut names = HashSet::new();
    for (i, tool) in list.iter().enumerate() {
        let name = check_tool(i, tool)?;
        if !names.insert(name.to_owned()) {
            return Err(ApiError::bad_param(
                "tools",
                format!("tools[{i}].function.name: {name:?} names two tools"),
            ));
        }
    }
    let choice = read_choice(choice, &names)?;
    if list.is_empty() {
        return match choice {
            ToolChoice::None | ToolChoice::Auto => Ok(None),
            _ => Err(ApiError::bad_param(
                "tool_choice",
                "tool_choice asks for a call, and the request has no tools",
            )),
        };
    }
    Ok(Some(Tools {
        list,
        choice,
        parallel,
    }))
}

/// Checks tool `i`; its name.
fn check_tool(i: usize, tool: &Value) -> Result<&str, ApiError> {
    let bad = |what: String| Err(ApiError::bad_param("tools", format!("tools[{i}]{what}")));
    let Some(tool) = tool.as_object() else {
        return bad(": a tool is a map {\"type\": \"function\", \"function\": {...}}".into());
    };
    match tool.get("type").and_then(Value::as_str) {
        Some("function") => {}
        Some(other) => {
            return bad(format!(
                ".type: {other:?}: this server calls function tools only"
            ));
        }
        None => return bad(".type: must be \"function\"".into()),
    }
    if let Some(key) = tool.keys().find(|k| *k != "type" && *k != "function") {
        return bad(format!(".{key}: not a field of a function tool"));
    }
    let Some(function) = tool.get("function").and_then(Value::as_object) else {
        return bad(".function: must be a map with a name".into());
    };
    for (key, value) in function {
        let fine = match key.as_str() {
            "name" => true,
            "description" => value.is_string() || value.is_null(),
            "parameters" => value.is_object() || value.is_null(),
            "strict" => value.is_boolean() || value.is_null(),
            _ => return bad(format!(".function.{key}: not a field of a function")),
        };
        if !fine {
            return bad(format!(".function.{key}: of the wrong type"));
        }
    }
    let name = function.get("name").and_then(Value::as_str).unwrap_or("");
    if !valid_name(name) {
        return bad(format!(
            ".function.name: {name:?} is not a name of 1 to {MAX_NAME} letters, digits, \
             `_`, `-` or `.`"
        ));
    }
    Ok(name)
}

/// OpenAI's function names (`^[a-zA-Z0-9_-]{1,64}$`), with `.` for the
/// dotted names some models call.
fn valid_name(name: &str) -> bool {
    (1..=MAX_NAME).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b))
}

fn read_choice(choice: Option<&Value>, names: &HashSet<String>) -> Result<ToolChoice, ApiError> {
    let bad = |message: String| Err(ApiError::bad_param("tool_choice", message));
    match choice {
        None | Some(Value::Null) => Ok(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "none" => Ok(ToolChoice::None),
            "auto" => Ok(ToolChoice::Auto),
            "required" => Ok(ToolChoice::Required),
            other => bad(format!(
                "tool_choice {other:?}: one of \"none\", \"auto\", \"required\", or \
                 {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
            )),
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            match (o.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(name)) if names.contains(name) => {
                    Ok(ToolChoice::Named(name.to_owned()))
                }
                (Some("function"), Some(name)) => bad(format!(
                    "tool_choice names the function {name:?}, which is not among the tools"
                )),
                _ => bad(
                    "tool_choice as a map is {\"type\": \"function\", \"function\": {\"name\": ...}}"
                        .into(),
                ),
            }
        }
        Some(_) => bad("tool_choice is a string or a map".into()),
    }
}

/// An assistant message's `tool_calls` as the template reads them: each
/// call's `arguments` JSON string parsed into a mapping (vLLM does this;
/// the Qwen and Hermes templates iterate over the arguments' items).
/// `index` names the message in errors.
pub fn template_calls(index: usize, calls: &Value) -> Result<Vec<Value>, ApiError> {
    let bad = |what: String| {
        Err(ApiError::bad_param(
            "messages",
            format!("messages[{index}].tool_calls{what}"),
        ))
    };
    let Some(list) = calls.as_array() else {
        return bad(": must be a list of calls".into());
    };
    let mut out = Vec::with_capacity(list.len());
    for (j, call) in list.iter().enumerate() {
        let mut call = call.clone();
        let Some(function) = call.get_mut("function").and_then(Value::as_object_mut) else {
            return bad(format!("[{j}].function: must be a map with a name"));
        };
        if !function.get("name").is_some_and(Value::is_string) {
            return bad(format!("[{j}].function.name: must be a string"));
        }
        if let Some(Value::String(text)) = function.get("arguments") {
            match serde_json::from_str::<Value>(text) {
                Ok(args @ Value::Object(_)) => {
                    function.insert("arguments".into(), args);
                }
                _ => {
                    return bad(format!(
                        "[{j}].function.arguments: must be a JSON object's text"
                    ));
                }
            }
        }
        out.push(call);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn tool(name: &str) -> Value {
        json!({"type": "function", "function": {"name": name, "parameters": {"type": "object"}}})
    }

    #[test]
    fn tools_and_choices_are_checked() {
        let tools = json!([tool("get_weather"), tool("ns.lookup")]);
        let t = read(Some(&tools), Some(&json!("required")), None)
            .unwrap()
            .unwrap();
        assert!(t.forced() && t.parallel && t.parsed());
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let t = read(Some(&tools), Some(&named), Some(&json!(false)))
            .unwrap()
            .unwrap();
        assert_eq!(t.choice, ToolChoice::Named("get_weather".into()));
        assert!(!t.parallel);
        assert!(read(None, Some(&json!("auto")), None).unwrap().is_none());
        for (tools, choice, named) in [
            (json!({"a": 1}), None, "tools"),
            (
                json!([tool("a"), {"type": "retrieval"}]),
                None,
                "tools[1].type",
            ),
            (
                json!([{"type": "function", "function": {}}]),
                None,
                "tools[0].function.name",
            ),
            (json!([tool("a b")]), None, "tools[0].function.name"),
            (
                json!([tool("a"), tool("a")]),
                None,
                "tools[1].function.name",
            ),
            (
                json!([{"type": "function", "function": {"name": "a", "parameters": 3}}]),
                None,
                "tools[0].function.parameters",
            ),
            (
                json!([{"type": "function", "function": {"name": "a", "x": 3}}]),
                None,
                "tools[0].function.x",
            ),
            (json!([tool("a")]), Some(json!("sometimes")), "tool_choice"),
            (
                json!([tool("a")]),
                Some(json!({"type": "function", "function": {"name": "b"}})),
                "tool_choice",
            ),
            (json!([]), Some(json!("required")), "tool_choice"),
        ] {
            let e = read(Some(&tools), choice.as_ref(), None).expect_err(named);
            assert!(e.to_string().contains(named), "{named}: {e}");
        }
    }

    #[test]
    fn call_arguments_become_mappings_for_the_template() {
        let calls = json!([{"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": "{\"x\": 1}"}}]);
        let out = template_calls(2, &calls).unwrap();
        assert_eq!(out[0]["function"]["arguments"], json!({"x": 1}));
        let bad = json!([{"function": {"name": "f", "arguments": "[1]"}}]);
        let e = template_calls(2, &bad).unwrap_err();
        assert!(
            e.to_string()
                .contains("messages[2].tool_calls[0].function.arguments"),
            "{e}"
        );
    }
}
