//! `POST /v1/chat/completions`: the conversation is rendered by the model
//! directory's chat template (ready for the assistant's reply).
//!
//! `logprobs: true` reports, per choice, `logprobs.content` as
//! `[{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]`: the
//! sampled token's log-probability under the model (log-softmax of the raw
//! logits) and the `top_logprobs` (at most 20) most likely tokens. `bytes`
//! are the token's own ([`token_bytes`](crate::server::sse::token_bytes)): for a
//! token that is part of a UTF-8 character, whose `token` text shows
//! U+FFFD, they are the bytes it stands for.
//! `tools` / `functions` (and their
//! `*_choice`) are refused with a 400: no tool calling yet.

use std::sync::Arc;

use crate::engine::sampling::MAX_TOP_LOGPROBS;

use crate::engine::chat::max_rendered_bytes;
use crate::{ChatMessage, Finish, encode_chat};
use axum::Json;
use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::admit;
use crate::server::admission::Cost;
use crate::server::error::ApiError;
use crate::server::openai::{ChatRequest, Content, Message, Sampling, UsageInfo, finish_reason};
use crate::server::sse::{Choice, Events, Format, TokenLogprob};
use crate::server::state::{AppState, off_the_workers, unix_now};

pub async fn handler(
    State(state): State<Arc<AppState>>,
    body: Result<Json<ChatRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(request) = body?;
    state.check_model(request.model.as_deref())?;
    crate::server::fields::check(crate::server::fields::Route::Chat, &request.extra)?;
    let constraint = crate::server::structured::constraint(&request.extra)?;
    for (name, value) in [
        ("tools", &request.tools),
        ("tool_choice", &request.tool_choice),
        ("functions", &request.functions),
        ("function_call", &request.function_call),
    ] {
        if value.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(ApiError::BadRequest {
                message: format!(
                    "{name}: tool and function calling is not supported by this server"
                ),
                param: Some(name),
                code: Some("tools_not_supported"),
            });
        }
    }
    let top = request.top_logprobs.unwrap_or(0);
    if top > MAX_TOP_LOGPROBS as u64 {
        return Err(ApiError::bad_param(
            "top_logprobs",
            format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {top}"),
        ));
    }
    if top > 0 && !request.logprobs {
        return Err(ApiError::bad_param(
            "top_logprobs",
            "top_logprobs needs logprobs: true",
        ));
    }
    if request.messages.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "messages must not be empty",
        ));
    }
    let n = request.sampling.n()?;
    let messages = messages_of(&request.messages)?;
    // Before rendering: the messages' bytes from the shared budget, and
    // what the request's shape alone already costs.
    let bytes = messages
        .iter()
        .map(|m| m.role.len() + m.content.len())
        .sum();
    let prompt_bytes = state.prompt_budget.take(bytes)?;
    let max_tokens = request
        .max_completion_tokens
        .or(request.sampling.max_tokens);
    state.config.limits.check(&Cost {
        prompt_tokens: 1,
        prompts: 1,
        n: n as u64,
        max_tokens: max_tokens.unwrap_or(1).max(1) as u64,
        top_logprobs: top,
    })?;
    let prompt = {
        let state = state.clone();
        let open = request.add_generation_prompt.unwrap_or(true);
        off_the_workers(move || render(&state, &messages, open)).await?
    };
    let sampling = &request.sampling;
    let defaults = state.handle.defaults();
    let room = state.context_limit.saturating_sub(prompt.len());
    let mut params = sampling.params(
        max_tokens,
        Sampling::default_max(defaults, None, room),
        request.logprobs,
        top as usize,
        state.context_limit,
        defaults,
    )?;
    params.constraint = constraint;
    let prompts = vec![prompt];
    admit(&state, &prompts, n, &params)?;
    let submitted = state.submit(prompts, &params, n, prompt_bytes)?;
    let events = Events {
        submitted,
        choices: n,
        n,
        logprobs: request.logprobs,
        tokenizer: state.tokenizer().clone(),
    };
    let format = Chat {
        id: format!("chatcmpl-{}", crate::server::next_id()),
        created: unix_now(),
        model: state.model_name.clone(),
        include_usage: sampling.include_usage(),
    };
    if sampling.stream {
        Ok(events
            .stream(Arc::new(format), sampling.include_usage())
            .into_response())
    } else {
        Ok(Json(events.collect(&format).await?).into_response())
    }
}

/// The conversation rendered by the model's chat template, ready for the
/// assistant's reply (`add_generation_prompt`; else as it stands), and
/// tokenized: the template's own text keeps its
/// control tokens, a special token typed inside a message is tokenized as
/// text ([`encode_chat`]). A rendering longer than the context could hold
/// is refused before it is tokenized.
pub(super) fn render(
    state: &AppState,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
) -> Result<Vec<u32>, ApiError> {
    let template = state
        .template
        .as_ref()
        .map_err(|e| ApiError::bad(format!("the model has no usable chat template: {e}")))?;
    let most = max_rendered_bytes(state.context_limit);
    encode_chat(
        template,
        state.tokenizer(),
        messages,
        add_generation_prompt,
        most,
    )
    .map_err(|e| ApiError::bad_param("messages", format!("rendering the conversation: {e:#}")))
}

/// A message's text: its string, or its text parts joined.
/// The request's messages as the template takes them, each checked
/// ([`check_message`](crate::server::fields::check_message)).
pub(super) fn messages_of(messages: &[Message]) -> Result<Vec<ChatMessage>, ApiError> {
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        crate::server::fields::check_message(i, m)?;
        out.push(ChatMessage::new(
            m.role.as_str(),
            text_of(m.content.as_ref()),
        ));
    }
    Ok(out)
}

fn text_of(content: Option<&Content>) -> String {
    match content {
        None => String::new(),
        Some(Content::Text(t)) => t.clone(),
        Some(Content::Parts(parts)) => parts
            .iter()
            .filter(|p| p.kind == "text")
            .filter_map(|p| p.text.as_deref())
            .collect(),
    }
}

struct Chat {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
}

impl Chat {
    fn chunk(&self, choices: Value) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }
}

fn logprobs_json(lps: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = lps
        .iter()
        .map(|l| {
            json!({
                "token": l.text,
                "logprob": l.logprob,
                "bytes": l.bytes,
                "top_logprobs": l.top.iter().map(|t| json!({
                    "token": t.text,
                    "logprob": t.logprob,
                    "bytes": t.bytes,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({ "content": content })
}

impl Format for Chat {
    fn opening(&self, choices: usize) -> Vec<Value> {
        (0..choices)
            .map(|index| {
                self.chunk(json!([{
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": null,
                    "finish_reason": null,
                }]))
            })
            .collect()
    }

    fn delta(&self, index: usize, text: &str, logprob: Option<&TokenLogprob>) -> Value {
        let lp = logprob.map_or(Value::Null, |l| logprobs_json(std::slice::from_ref(l)));
        self.chunk(json!([{
            "index": index,
            "delta": {"content": text},
            "logprobs": lp,
            "finish_reason": null,
        }]))
    }

    fn finish(&self, index: usize, reason: &Finish) -> Value {
        self.chunk(json!([{
            "index": index,
            "delta": {},
            "logprobs": null,
            "finish_reason": finish_reason(reason),
        }]))
    }

    fn usage(&self, usage: &UsageInfo) -> Value {
        let mut v = self.chunk(json!([]));
        v["usage"] = json!(usage);
        v
    }

    fn response(&self, choices: Vec<Choice>, usage: &UsageInfo) -> Value {
        let choices: Vec<Value> = choices
            .into_iter()
            .enumerate()
            .map(|(index, c)| {
                let lp = if c.logprobs.is_empty() {
                    Value::Null
                } else {
                    logprobs_json(&c.logprobs)
                };
                json!({
                    "index": index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": lp,
                    "finish_reason": c.finish.as_ref().map(finish_reason),
                })
            })
            .collect();
        json!({
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        })
    }
}
