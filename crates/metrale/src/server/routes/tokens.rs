//! `POST /tokenize` and `POST /detokenize`, in vLLM's shapes: the ids the
//! server would run for a prompt (or for a conversation rendered by the
//! model's chat template, exactly as `/v1/chat/completions` renders it),
//! and the text of ids. Evaluation harnesses use them to count and align
//! tokens; both answer from the tokenizer alone, never the engine.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::server::error::ApiError;
use crate::server::fields::{self, Route};
use crate::server::openai::Message;
use crate::server::state::{AppState, off_the_workers};

/// `POST /tokenize`: a `prompt`, or chat `messages`.
#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<Message>>,
    /// For a prompt (default true): BOS/EOS where the tokenizer adds them,
    /// as `/v1/completions` encodes. A conversation's special tokens are
    /// its template's.
    add_special_tokens: Option<bool>,
    /// For messages (default true): the template opens the assistant's turn.
    add_generation_prompt: Option<bool>,
    /// For messages: extra template variables, as on the chat route.
    chat_template_kwargs: Option<Value>,
    /// For messages: tools for the template, as on the chat route.
    tools: Option<Value>,
    /// Each id's text beside it (`token_strs`).
    #[serde(default)]
    return_token_strs: bool,
    #[serde(flatten)]
    extra: Map<String, Value>,
}

/// `POST /detokenize`.
#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u32>,
    #[serde(flatten)]
    extra: Map<String, Value>,
}

pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Json<TokenizeRequest>, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let Json(request) = body?;
    state.check_model(request.model.as_deref())?;
    let route = if request.messages.is_some() {
        Route::Chat
    } else {
        Route::Completions
    };
    fields::check(route, &request.extra)?;
    let ids = {
        let state = state.clone();
        match (request.prompt, request.messages) {
            (Some(prompt), None) => {
                if request.chat_template_kwargs.is_some() || request.tools.is_some() {
                    return Err(ApiError::bad(
                        "chat_template_kwargs and tools are for `messages`, not a `prompt`",
                    ));
                }
                let special = request.add_special_tokens.unwrap_or(true);
                off_the_workers(move || {
                    state.tokenizer().encode(&prompt, special).map_err(|e| {
                        ApiError::bad_param("prompt", format!("cannot tokenize the prompt: {e}"))
                    })
                })
                .await?
            }
            (None, Some(messages)) => {
                if request.add_special_tokens == Some(true) {
                    return Err(ApiError::bad_param(
                        "add_special_tokens",
                        "a conversation's special tokens are its chat template's",
                    ));
                }
                let messages = super::chat::messages_of(&messages)?;
                let mut vars = super::chat::template_vars(request.chat_template_kwargs.as_ref())?;
                if let Some(t) = crate::server::tools::read(request.tools.as_ref(), None, None)? {
                    vars.push(("tools".into(), Value::Array(t.list)));
                }
                let open = request.add_generation_prompt.unwrap_or(true);
                off_the_workers(move || super::chat::render(&state, &messages, open, &vars))
                    .await?
                    .0
            }
            _ => {
                return Err(ApiError::bad(
                    "give either `prompt` (text) or `messages` (a conversation)",
                ));
            }
        }
    };
    let token_strs = if request.return_token_strs {
        let tokenizer = state.tokenizer();
        let strs = (ids.iter())
            .map(|&id| tokenizer.token_text(id).unwrap_or_default())
            .collect::<Vec<_>>();
        json!(strs)
    } else {
        Value::Null
    };
    Ok(Json(json!({
        "count": ids.len(),
        "max_model_len": state.context_limit,
        "tokens": ids,
        "token_strs": token_strs,
    })))
}

pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Json<DetokenizeRequest>, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let Json(request) = body?;
    state.check_model(request.model.as_deref())?;
    fields::check(Route::Completions, &request.extra)?;
    let tokenizer = state.tokenizer();
    if let Some(bad) = (request.tokens.iter()).find(|&&id| !tokenizer.can_decode(id)) {
        return Err(ApiError::bad_param(
            "tokens",
            format!("token id {bad} is not in the vocabulary"),
        ));
    }
    let text = {
        let state = state.clone();
        let tokens = request.tokens;
        off_the_workers(move || {
            state
                .tokenizer()
                .decode(&tokens)
                .map_err(|e| ApiError::bad_param("tokens", format!("cannot decode: {e}")))
        })
        .await?
    };
    Ok(Json(json!({ "prompt": text })))
}
