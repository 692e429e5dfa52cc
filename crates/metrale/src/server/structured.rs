//! A request's structured-output fields, read into one
//! [`OutputConstraint`]: OpenAI's `response_format` (`json_object`,
//! `json_schema`), and vLLM's spellings, `structured_outputs: {json |
//! json_object | regex | choice | grammar}` and the older `guided_json`,
//! `guided_regex`, `guided_choice`, `guided_grammar`. At most one may ask
//! for a constraint; two are refused, naming both, rather than one
//! silently winning. What none of them can express (a structural tag, a
//! whitespace pattern) is refused by name.

use serde_json::{Map, Value};

use crate::OutputConstraint;
use crate::server::error::ApiError;

/// The fields read here (the field rules in `fields.rs` let them through).
pub const FIELDS: [&str; 8] = [
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
];

fn bad(param: &'static str, message: impl Into<String>) -> ApiError {
    ApiError::bad_param(param, message)
}

/// The constraint the request's fields (in `extra`, the fields the request
/// types do not declare) ask for; `None` for free text.
pub fn constraint(extra: &Map<String, Value>) -> Result<Option<OutputConstraint>, ApiError> {
    let mut found: Option<(&'static str, OutputConstraint)> = None;
    let mut put = |field: &'static str, c: Option<OutputConstraint>| match (&found, c) {
        (_, None) => Ok(()),
        (Some((first, _)), Some(_)) => Err(bad(
            field,
            format!("`{first}` and `{field}` both ask for a structured output; give one"),
        )),
        (None, Some(c)) => {
            found = Some((field, c));
            Ok(())
        }
    };
    let get = |name: &str| extra.get(name).filter(|v| !v.is_null());
    if let Some(v) = get("response_format") {
        put("response_format", response_format(v)?)?;
    }
    if let Some(v) = get("structured_outputs") {
        put("structured_outputs", structured_outputs(v)?)?;
    }
    if let Some(v) = get("guided_json") {
        put("guided_json", Some(json_schema("guided_json", v)?))?;
    }
    if let Some(v) = get("guided_regex") {
        put(
            "guided_regex",
            Some(OutputConstraint::Regex(string("guided_regex", v)?)),
        )?;
    }
    if let Some(v) = get("guided_choice") {
        put(
            "guided_choice",
            Some(OutputConstraint::Choice(choices("guided_choice", v)?)),
        )?;
    }
    if let Some(v) = get("guided_grammar") {
        put(
            "guided_grammar",
            Some(OutputConstraint::Lark(string("guided_grammar", v)?)),
        )?;
    }
    if let Some(v) = get("guided_whitespace_pattern") {
        return Err(bad(
            "guided_whitespace_pattern",
            format!("a whitespace pattern is not supported (got {v}); JSON is written on one line"),
        ));
    }
    Ok(found.map(|(_, c)| c))
}

/// OpenAI's `response_format`.
fn response_format(v: &Value) -> Result<Option<OutputConstraint>, ApiError> {
    const P: &str = "response_format";
    let kind = v.get("type").and_then(Value::as_str).ok_or_else(|| {
        bad(
            P,
            "response_format needs a `type`: text, json_object or json_schema",
        )
    })?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(OutputConstraint::JsonObject)),
        "json_schema" => {
            let spec = v.get("json_schema").ok_or_else(|| {
                bad(
                    P,
                    "response_format of type json_schema needs a `json_schema` object",
                )
            })?;
            let schema = spec.get("schema").ok_or_else(|| {
                bad(
                    P,
                    "response_format.json_schema needs a `schema` (the JSON schema)",
                )
            })?;
            // `strict: false` is a permission, not a request: the schema is
            // held either way (as vLLM does).
            Ok(Some(json_schema(P, schema)?))
        }
        other => Err(bad(
            P,
            format!("response_format type {other:?} is not one of text, json_object, json_schema"),
        )),
    }
}

/// vLLM's `structured_outputs` object: exactly one of its kinds.
fn structured_outputs(v: &Value) -> Result<Option<OutputConstraint>, ApiError> {
    const P: &str = "structured_outputs";
    let map = v
        .as_object()
        .ok_or_else(|| bad(P, "structured_outputs must be an object"))?;
    let mut kinds = Vec::new();
    for (key, value) in map {
        if value.is_null() || value == &Value::Bool(false) {
            continue;
        }
        let c = match key.as_str() {
            "json" => json_schema(P, value)?,
            "json_object" => OutputConstraint::JsonObject,
            "regex" => OutputConstraint::Regex(string(P, value)?),
            "choice" => OutputConstraint::Choice(choices(P, value)?),
            "grammar" => OutputConstraint::Lark(string(P, value)?),
            // Labels: which engine; this server has one.
            "backend" | "_backend" | "backend_was_auto" => continue,
            "disable_any_whitespace" | "disable_fallback" | "disable_additional_properties" => {
                continue;
            }
            "whitespace_pattern" | "structural_tag" => {
                return Err(bad(P, format!("structured_outputs.{key} is not supported")));
            }
            other => {
                return Err(bad(
                    P,
                    format!("structured_outputs.{other} is not a kind this server knows"),
                ));
            }
        };
        kinds.push((key.clone(), c));
    }
    match kinds.len() {
        0 => Ok(None),
        1 => Ok(kinds.pop().map(|(_, c)| c)),
        _ => Err(bad(
            P,
            format!(
                "structured_outputs gives {} kinds ({}); give one",
                kinds.len(),
                kinds
                    .iter()
                    .map(|(k, _)| k.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )),
    }
}

/// A schema given as an object (or a string holding one, as vLLM takes).
fn json_schema(param: &'static str, v: &Value) -> Result<OutputConstraint, ApiError> {
    let schema = match v {
        Value::String(s) => serde_json::from_str(s)
            .map_err(|e| bad(param, format!("the JSON schema is not valid JSON: {e}")))?,
        Value::Object(_) | Value::Bool(_) => v.clone(),
        _ => return Err(bad(param, "a JSON schema is an object")),
    };
    Ok(OutputConstraint::JsonSchema(schema))
}

fn string(param: &'static str, v: &Value) -> Result<String, ApiError> {
    v.as_str()
        .map(str::to_owned)
        .ok_or_else(|| bad(param, format!("expected a string, got {v}")))
}

fn choices(param: &'static str, v: &Value) -> Result<Vec<String>, ApiError> {
    let list = v
        .as_array()
        .ok_or_else(|| bad(param, "choices are a list of strings"))?;
    let out: Option<Vec<String>> = list.iter().map(|c| c.as_str().map(str::to_owned)).collect();
    match out {
        Some(c) if !c.is_empty() => Ok(c),
        Some(_) => Err(bad(param, "the list of choices is empty")),
        None => Err(bad(param, "choices are a list of strings")),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn of(v: Value) -> Result<Option<OutputConstraint>, ApiError> {
        constraint(v.as_object().unwrap())
    }

    #[test]
    fn every_spelling_reads_to_one_constraint() {
        let schema = json!({"type": "object"});
        let cases = [
            (json!({"response_format": {"type": "text"}}), None),
            (
                json!({"response_format": {"type": "json_object"}}),
                Some(OutputConstraint::JsonObject),
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
                Some(OutputConstraint::JsonSchema(schema.clone())),
            ),
            (
                json!({"guided_json": "{\"type\": \"object\"}"}),
                Some(OutputConstraint::JsonSchema(schema.clone())),
            ),
            (
                json!({"guided_regex": "a+"}),
                Some(OutputConstraint::Regex("a+".into())),
            ),
            (
                json!({"guided_choice": ["a", "b"]}),
                Some(OutputConstraint::Choice(vec!["a".into(), "b".into()])),
            ),
            (
                json!({"structured_outputs": {"grammar": "start: \"a\""}}),
                Some(OutputConstraint::Lark("start: \"a\"".into())),
            ),
            (
                json!({"structured_outputs": {"json_object": true, "backend": "guidance"}}),
                Some(OutputConstraint::JsonObject),
            ),
            (json!({"guided_decoding_backend": "xgrammar"}), None),
        ];
        for (fields, want) in cases {
            assert_eq!(
                of(fields.clone()).unwrap_or_else(|e| panic!("{fields}: {e}")),
                want,
                "{fields}"
            );
        }
    }

    #[test]
    fn contradictions_and_unknown_kinds_are_refused_by_name() {
        for (fields, needle) in [
            (
                json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}),
                "`response_format` and `guided_regex`",
            ),
            (
                json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}),
                "2 kinds",
            ),
            (
                json!({"structured_outputs": {"structural_tag": "{}"}}),
                "structural_tag",
            ),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "json_schema",
            ),
            (json!({"response_format": {"type": "yaml"}}), "yaml"),
            (json!({"guided_json": "{not json"}), "not valid JSON"),
            (json!({"guided_choice": []}), "empty"),
            (json!({"guided_whitespace_pattern": " *"}), "whitespace"),
        ] {
            let e = of(fields.clone()).expect_err("refused").to_string();
            assert!(e.contains(needle), "{fields}: {e}");
        }
    }
}
