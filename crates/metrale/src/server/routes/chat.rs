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
//!
//! `chat_template_kwargs` are extra template variables (as `metrale chat
//! --think` passes `enable_thinking`). `tools`, `tool_choice` and
//! `parallel_tool_calls` are read by [`tools`](crate::server::tools): the
//! tools are rendered by the template, the reply is read for calls in the
//! model's format (`--tool-call-parser`, else detected from the template
//! and model type), and a forced call is held by a grammar
//! ([`tool_grammar`](crate::server::tool_grammar)). The reply's reasoning
//! is split out ([`reply`](crate::server::reply)). The legacy
//! `functions` / `function_call` are refused with a 400.

use std::sync::Arc;

use crate::engine::sampling::MAX_TOP_LOGPROBS;

use crate::engine::chat::max_rendered_bytes;
use crate::{ChatMessage, ChatTemplate, OutputConstraint};
use axum::Json;
use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use super::admit;
use super::chat_format::Chat;
use crate::server::admission::Cost;
use crate::server::error::ApiError;
use crate::server::openai::{ChatRequest, Content, Message, Sampling};
use crate::server::reply::{self, Shape};
use crate::server::sse::Events;
use crate::server::state::{AppState, off_the_workers, unix_now};
use crate::server::tool_grammar::{self, Think};

pub async fn handler(
    State(state): State<Arc<AppState>>,
    body: Result<Json<ChatRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(request) = body?;
    state.check_model(request.model.as_deref())?;
    crate::server::fields::check(crate::server::fields::Route::Chat, &request.extra)?;
    let mut constraint = crate::server::structured::constraint(&request.extra)?;
    for (name, value) in [
        ("functions", &request.functions),
        ("function_call", &request.function_call),
    ] {
        if value.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(ApiError::BadRequest {
                message: format!(
                    "{name}: the legacy function calling is not supported by this server; \
                     give `tools` and `tool_choice`"
                ),
                param: Some(name),
                code: Some("tools_not_supported"),
            });
        }
    }
    let tools = crate::server::tools::read(
        request.tools.as_ref(),
        request.tool_choice.as_ref(),
        request.parallel_tool_calls.as_ref(),
    )?;
    let mut vars = template_vars(request.chat_template_kwargs.as_ref())?;
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
    let template = template_of(&state)?;
    let format = match &tools {
        Some(t) if t.parsed() => Some(state.tool_format.ok_or_else(|| {
            ApiError::bad_param(
                "tools",
                "this model's tool-call format is not known from its chat template or \
                 model type; start the server with --tool-call-parser NAME (hermes, \
                 qwen3_xml, llama3_json, mistral, granite, nemotron, pythonic)",
            )
        })?),
        _ => None,
    };
    if let Some(t) = &tools {
        vars.push(("tools".into(), Value::Array(t.list.clone())));
    }
    let thinking_off = vars
        .iter()
        .any(|(k, v)| k == "enable_thinking" && v == &Value::Bool(false));
    let reasons = reply::template_reasons(template.source()) && !thinking_off;
    // Before rendering: the messages' bytes from the shared budget, and
    // what the request's shape alone already costs.
    let bytes = messages
        .iter()
        .map(|m| {
            let side: usize = m.side_text().iter().map(|(_, t)| t.len()).sum();
            m.role.len() + m.content.len() + side
        })
        .sum::<usize>()
        + vars.iter().map(|(_, v)| v.to_string().len()).sum::<usize>();
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
    let (prompt, text) = {
        let state = state.clone();
        let open = request.add_generation_prompt.unwrap_or(true);
        off_the_workers(move || render(&state, &messages, open, &vars)).await?
    };
    let opens = reasons && reply::prompt_opens_reasoning(&text);
    let shape = Shape {
        reasoning: reasons.then_some(opens),
        tools: match (&tools, format) {
            (Some(t), Some(f)) => Some((f, t.list.clone())),
            _ => None,
        },
    };
    if let (Some(t), Some(f)) = (&tools, format)
        && t.forced()
    {
        if constraint.is_some() {
            return Err(ApiError::bad_param(
                "tool_choice",
                "a forced tool call and response_format (or structured_outputs) both \
                 constrain the reply; give one",
            ));
        }
        let think = if opens { Think::Open } else { Think::No };
        let grammar = tool_grammar::grammar(f, t, think, state.tokenizer());
        constraint = Some(OutputConstraint::Lark(grammar));
    } else if let (Some(t), Some(f)) = (&tools, format)
        && t.strict_auto()
    {
        if constraint.is_some() {
            return Err(ApiError::bad_param(
                "tools",
                "a strict tool under tool_choice \"auto\" and response_format (or \
                 structured_outputs) both constrain the reply; give one",
            ));
        }
        let think = if opens { Think::Open } else { Think::No };
        match tool_grammar::strict_auto(f, t, think, state.tokenizer()) {
            Some(grammar) => constraint = Some(OutputConstraint::Lark(grammar)),
            None => tracing::debug!(
                "strict tools are not held under tool_choice auto in the {f} format \
                 (a call has no opening marker)"
            ),
        }
    }
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
    // Markers that are special tokens must stay in the text to be read.
    if sampling.skip_special_tokens.is_none() && shape.reads() {
        let mut markers = Vec::new();
        if shape.reasoning.is_some() {
            markers.extend(["<think>", "</think>"]);
        }
        if let Some((f, _)) = &shape.tools {
            markers.extend(f.start_marker());
        }
        let tokenizer = state.tokenizer();
        if markers
            .iter()
            .any(|m| tokenizer.special_token_in(m).ok().flatten().is_some())
        {
            params.skip_special_tokens = false;
        }
    }
    let prompts = vec![prompt];
    admit(&state, &prompts, n, &params)?;
    let submitted = state
        .submit_off(prompts, params.clone(), n, prompt_bytes)
        .await?;
    let events = Events {
        submitted,
        choices: n,
        n,
        logprobs: request.logprobs,
        tokenizer: state.tokenizer().clone(),
    };
    let format = Chat::new(
        format!("chatcmpl-{}", crate::server::next_id()),
        unix_now(),
        state.model_name.clone(),
        sampling.include_usage(),
    )
    .reading(shape, n);
    if sampling.stream {
        Ok(events
            .stream(Arc::new(format), sampling.include_usage())
            .into_response())
    } else {
        Ok(Json(events.collect(&format).await?).into_response())
    }
}

/// `chat_template_kwargs` as template variables: a map (null: none).
/// `messages`, `add_generation_prompt` and `tools` come from the request's
/// own fields, so naming them here is a 400 rather than one of the two
/// quietly winning.
pub(super) fn template_vars(kwargs: Option<&Value>) -> Result<Vec<(String, Value)>, ApiError> {
    match kwargs {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Object(map)) => {
            if let Some(k) = map
                .keys()
                .find(|k| ["messages", "add_generation_prompt", "tools"].contains(&k.as_str()))
            {
                return Err(ApiError::bad_param(
                    "chat_template_kwargs",
                    format!("chat_template_kwargs.{k}: give it as the request's own field"),
                ));
            }
            Ok(map.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        }
        Some(_) => Err(ApiError::bad_param(
            "chat_template_kwargs",
            "chat_template_kwargs must be a map of template variables",
        )),
    }
}

fn template_of(state: &AppState) -> Result<&ChatTemplate, ApiError> {
    state
        .template
        .as_ref()
        .map_err(|e| ApiError::bad(format!("the model has no usable chat template: {e}")))
}

/// The conversation rendered by the model's chat template, ready for the
/// assistant's reply (`add_generation_prompt`; else as it stands), with
/// the extra template variables `vars`, and tokenized: the template's own
/// text keeps its control tokens, a special token typed inside a message
/// is tokenized as text ([`encode_chat`](crate::encode_chat)). A rendering
/// longer than the context could hold is refused before it is tokenized.
/// The ids, and the rendered text.
pub(super) fn render(
    state: &AppState,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    vars: &[(String, Value)],
) -> Result<(Vec<u32>, String), ApiError> {
    let template = template_of(state)?;
    let most = max_rendered_bytes(state.context_limit);
    let vars: Vec<(&str, Value)> = vars.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let bad = |e: crate::engine::error::EngineError| {
        ApiError::bad_param("messages", format!("rendering the conversation: {e:#}"))
    };
    let rendered = template
        .render_spans_with(messages, add_generation_prompt, &vars, most)
        .map_err(bad)?;
    let ids = state.tokenizer().encode_rendered(&rendered).map_err(bad)?;
    Ok((ids, rendered.into_text()))
}

/// The request's messages as the template takes them, each checked
/// ([`check_message`](crate::server::fields::check_message)): their text
/// (a string, or the text parts joined), an assistant's `tool_calls`
/// (arguments as mappings), a tool result's `tool_call_id`, and an earlier
/// turn's `reasoning_content`.
pub(super) fn messages_of(messages: &[Message]) -> Result<Vec<ChatMessage>, ApiError> {
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        crate::server::fields::check_message(i, m)?;
        let text = |name: &str| -> Result<Option<String>, ApiError> {
            match m.extra.get(name) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(_) => Err(ApiError::bad_param(
                    "messages",
                    format!("messages[{i}].{name} must be a string"),
                )),
            }
        };
        let tool_calls = match m.extra.get("tool_calls") {
            None | Some(Value::Null) => None,
            Some(calls) => Some(crate::server::tools::template_calls(i, calls)?),
        };
        out.push(ChatMessage {
            role: m.role.clone(),
            content: text_of(m.content.as_ref()),
            reasoning_content: text("reasoning_content")?,
            tool_calls: tool_calls.filter(|c| !c.is_empty()),
            tool_call_id: text("tool_call_id")?,
            name: text("name")?,
        });
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
