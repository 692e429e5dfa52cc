//! The rule for every request field, so that nothing is silently ignored.
//!
//! A field the request types declare is honoured (or refused by its route
//! with a reason, as `echo` and the legacy `functions` are). Every other field lands in
//! the request's `extra` map and is judged here:
//!
//! - a field that changes the output (its format, content, sampling or
//!   length) and that this server does not honour is refused with a 400
//!   naming it, unless its value is the one that changes nothing
//!   (`logit_bias: {}`, `min_tokens: 0`, `null`): a client that parses the
//!   reply must never get free text it did not ask for;
//! - the structured-output fields (`response_format`, vLLM's
//!   `structured_outputs` and `guided_*`) are read by
//!   [`structured`](crate::server::structured);
//! - a field that only labels a request (`metadata`, `store: false`,
//!   `service_tier`, ...) is accepted and has no effect;
//! - a field neither OpenAI nor vLLM defines is accepted and logged at the
//!   debug level (gateways add fields of their own).
//!
//! `docs/SERVER.md` lists every field and its rule.

use serde_json::{Map, Value};

use crate::server::error::ApiError;
use crate::server::openai::{Content, Message};

/// Which endpoint a request came to (a few fields exist on one only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Completions,
    Chat,
}

/// What happens to a field.
enum Rule {
    /// Accepted; it labels the request and changes nothing.
    Label,
    /// Honoured: its route reads it (structured outputs: `structured.rs`).
    Read,
    /// Refused unless `inert` holds of its value (the value that changes
    /// nothing); `why` completes "`name` is not supported: ".
    Refuse {
        inert: fn(&Value) -> bool,
        why: &'static str,
    },
}

fn never(_: &Value) -> bool {
    false
}

fn is_false(v: &Value) -> bool {
    v == &Value::Bool(false)
}

fn is_true(v: &Value) -> bool {
    v == &Value::Bool(true)
}

fn is_zero(v: &Value) -> bool {
    v.as_f64() == Some(0.0)
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::String(s) => s.is_empty(),
        _ => false,
    }
}

/// `["text"]`.
fn text_only(v: &Value) -> bool {
    v.as_array()
        .is_some_and(|a| a.iter().all(|m| m.as_str() == Some("text")))
}

const TOKEN_SETS: &str = "this server has no token bias or token sets yet";
const TEMPLATE: &str = "this server renders the model's own chat template as it is";

/// The rule for `name` on `route`, if OpenAI or vLLM define the field.
fn rule(route: Route, name: &str) -> Option<Rule> {
    use Rule::{Label, Read, Refuse};
    let refuse = |inert: fn(&Value) -> bool, why: &'static str| Some(Refuse { inert, why });
    match name {
        // Labels: who asked, what for, how to bill or schedule it.
        "metadata" | "service_tier" | "priority" | "request_id" | "cache_salt"
        | "safety_identifier" | "prompt_cache_key" => Some(Label),
        "store" => refuse(is_false, "this server stores no completions"),
        // OpenAI's predicted outputs speed a reply up; they never change it.
        "prediction" => Some(Label),
        // Output format and structure: `structured::constraint` reads them.
        _ if crate::server::structured::FIELDS.contains(&name) => Some(Read),
        // Token-level control.
        "logit_bias" | "bad_words" | "allowed_token_ids" | "logits_processors" => {
            refuse(is_empty, TOKEN_SETS)
        }
        "min_tokens" => refuse(
            is_zero,
            "a minimum length is not enforced by this server yet",
        ),
        "include_stop_str_in_output" => refuse(is_false, "stop strings are never returned"),
        "spaces_between_special_tokens" => refuse(
            is_true,
            "special tokens are decoded as the tokenizer joins them",
        ),
        // Completions declare `prompt_logprobs`: only chat's reaches here.
        "prompt_logprobs" | "return_tokens_as_token_ids" | "truncate_prompt_tokens" => {
            refuse(never, "not supported by this server yet")
        }
        "use_beam_search" => refuse(is_false, "this server samples; it has no beam search"),
        "length_penalty" => refuse(never, "this server has no beam search"),
        // The chat template and what reaches it.
        // `chat_template_kwargs` is declared and read by the route; a
        // template from the request is code this server does not run.
        "chat_template" | "documents" | "mm_processor_kwargs" if route == Route::Chat => {
            refuse(is_empty, TEMPLATE)
        }
        "continue_final_message" if route == Route::Chat => refuse(is_false, TEMPLATE),
        "echo" if route == Route::Chat => refuse(is_false, "the prompt is never repeated"),
        "reasoning_effort" | "web_search_options" | "audio" if route == Route::Chat => {
            refuse(never, "not supported by this server")
        }
        "modalities" if route == Route::Chat => refuse(text_only, "this server writes text only"),
        _ => None,
    }
}

/// Refuses the first field of `extra` (those the request types do not
/// declare) that would change the output and is not honoured; logs the
/// unknown ones.
pub fn check(route: Route, extra: &Map<String, Value>) -> Result<(), ApiError> {
    for (name, value) in extra {
        match rule(route, name) {
            Some(Rule::Refuse { inert, why }) if !value.is_null() && !inert(value) => {
                return Err(ApiError::UnsupportedField {
                    name: name.clone(),
                    why,
                });
            }
            Some(_) => {}
            None => tracing::debug!("request field {name:?} is not one this server knows; ignored"),
        }
    }
    Ok(())
}

/// Refuses what a chat message holds that the conversation would lose:
/// a content part other than text (an image, audio, a file), or a legacy
/// `function_call`. `tool_calls`, `tool_call_id`, `reasoning_content` and
/// `name` reach the template ([`messages_of`](crate::server::routes::chat)).
pub fn check_message(index: usize, message: &Message) -> Result<(), ApiError> {
    if let Some(Content::Parts(parts)) = &message.content
        && let Some((j, part)) = parts.iter().enumerate().find(|(_, p)| p.kind != "text")
    {
        return Err(ApiError::UnsupportedField {
            name: format!("messages[{index}].content[{j}]"),
            why: if part.kind.is_empty() {
                "a part without a type"
            } else {
                "this server reads text parts only"
            },
        });
    }
    for (name, value) in &message.extra {
        match name.as_str() {
            "name" | "tool_calls" | "tool_call_id" | "reasoning_content" => {}
            _ if value.is_null() || is_empty(value) => {}
            "function_call" => {
                return Err(ApiError::UnsupportedField {
                    name: format!("messages[{index}].{name}"),
                    why: "the legacy function calling is not supported; give `tool_calls`",
                });
            }
            _ => tracing::debug!("message field {name:?} is not one this server knows; ignored"),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn fields(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn output_changing_fields_are_refused_unless_inert() {
        let chat = |v| check(Route::Chat, &fields(v));
        for bad in [
            json!({"logit_bias": {"50256": -100}}),
            json!({"min_tokens": 4}),
            json!({"chat_template": "{{ messages }}"}),
            json!({"store": true}),
            json!({"modalities": ["text", "audio"]}),
        ] {
            let e = chat(bad.clone()).expect_err("refused");
            let name = bad.as_object().unwrap().keys().next().unwrap().clone();
            assert!(e.to_string().contains(&name), "{e}");
        }
        for fine in [
            json!({"response_format": {"type": "json_object"}}),
            json!({"guided_json": {"type": "object"}}),
            json!({"logit_bias": {}, "min_tokens": 0, "store": false, "echo": false}),
            json!({"response_format": null, "metadata": {"a": "b"}, "service_tier": "auto"}),
            json!({"modalities": ["text"]}),
            json!({"x_gateway_trace": "abc"}),
        ] {
            chat(fine.clone()).unwrap_or_else(|e| panic!("{fine}: {e}"));
        }
        // The declared fields (the flattened sampling ones too) never reach
        // `extra`: only what no request type declares is judged here.
        let req: crate::server::openai::ChatRequest = serde_json::from_value(json!({
            "messages": [], "temperature": 0.5, "top_k": 3, "logprobs": true,
            "skip_special_tokens": false, "metadata": {}
        }))
        .unwrap();
        assert_eq!(req.extra.keys().collect::<Vec<_>>(), ["metadata"]);
        // Chat-only fields are unknown to completions: accepted, logged.
        check(Route::Completions, &fields(json!({"chat_template": "x"}))).unwrap();
    }
}
