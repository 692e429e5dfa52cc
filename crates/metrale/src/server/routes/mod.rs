//! The routes, and the layers around them (API key, request counting).

pub mod chat;
mod chat_format;
pub mod completions;
pub mod tokens;

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use crate::SamplingParams;
use axum::Json;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::FutureExt;
use http_body_util::BodyExt;
use serde_json::json;

use crate::server::admission::Cost;
use crate::server::error::ApiError;
use crate::server::state::AppState;

/// `GET /v1/models`: the one model served.
pub async fn models(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "metrale",
            // The served name, never the model's path on this host.
            "root": state.model_name,
            "max_model_len": state.context_limit,
        }],
    }))
}

/// `GET /health`: 200 while the server runs.
pub async fn health() -> &'static str {
    "ok"
}

/// `GET /metrics`: Prometheus text.
pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(&state.gauges.read()),
    )
        .into_response()
}

/// A route asked with another method: an OpenAI-shaped 405.
pub async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::MethodNotAllowed(format!("{} does not take {method}", uri.path()))
}

/// 403 unless the Host header names a host the server answers for
/// ([`HostPolicy`](crate::server::HostPolicy)).
pub async fn check_host(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .or_else(|| request.uri().authority().map(|a| a.as_str()));
    if state.config.hosts.allows(host) {
        return next.run(request).await;
    }
    let mut response = ApiError::HostNotAllowed(format!(
        "this server does not answer for the host {:?}; a server bound to a loopback address \
         answers localhost and loopback addresses only (--allowed-hosts names others)",
        host.unwrap_or("")
    ))
    .into_response();
    close(&mut response);
    response
}

/// Reads the whole body first, within the body limit and
/// `body_timeout`: a client that sends part of a body and stalls gets a
/// 408 and the connection closes, holding nothing longer.
pub async fn read_body(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let (parts, body) = request.into_parts();
    let limited = http_body_util::Limited::new(body, state.config.body_limit);
    let read = tokio::time::timeout(state.config.body_timeout, limited.collect()).await;
    let error = match read {
        Ok(Ok(collected)) => {
            let body = axum::body::Body::from(collected.to_bytes());
            return next.run(Request::from_parts(parts, body)).await;
        }
        Err(_) => ApiError::Timeout(format!(
            "the request body did not arrive within {:?}",
            state.config.body_timeout
        )),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => ApiError::TooLarge(format!(
            "the request body is too large: more than {} bytes",
            state.config.body_limit
        )),
        Ok(Err(e)) => ApiError::bad(format!("reading the request body: {e}")),
    };
    let mut response = error.into_response();
    close(&mut response);
    response
}

/// Asks the connection to close after `response` (a request whose body was
/// left unread, or a client not to be served).
fn close(response: &mut Response) {
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
}

/// 400 when a request, its prompts tokenized and its sampling resolved,
/// costs more than the server's [`Limits`](crate::server::Limits) allow.
pub(crate) fn admit(
    state: &AppState,
    prompts: &[Vec<u32>],
    n: usize,
    params: &SamplingParams,
) -> Result<(), ApiError> {
    let shortest = prompts.iter().map(Vec::len).min().unwrap_or(0);
    let max_tokens = params
        .max_tokens
        .unwrap_or_else(|| state.context_limit.saturating_sub(shortest));
    state.config.limits.check(&Cost {
        prompt_tokens: prompts.iter().map(|p| p.len() as u64).sum(),
        prompts: prompts.len() as u64,
        n: n as u64,
        max_tokens: max_tokens as u64,
        top_logprobs: if params.logprobs {
            params.top_logprobs as u64
        } else {
            0
        },
    })
}

/// Anything else: an OpenAI-shaped 404.
pub async fn fallback(uri: Uri) -> ApiError {
    ApiError::NoRoute(uri.path().to_owned())
}

/// With `--api-key`: 401 unless `Authorization: Bearer <key>`.
pub async fn require_key(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    request: Request,
    next: Next,
) -> Response {
    if let Some(key) = &state.config.api_key {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let refusal = match given {
            None => Some("missing API key: send Authorization: Bearer <key>"),
            Some(g) if !same(g.trim().as_bytes(), key.as_bytes()) => Some("incorrect API key"),
            Some(_) => None,
        };
        if let Some(message) = refusal {
            // The body is already read (`read_body` runs first), so the
            // connection stays usable for a keep-alive client's next
            // request.
            return ApiError::Unauthorized(message).into_response();
        }
    }
    next.run(request).await
}

/// Compares without stopping at the first difference.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A handler that panics answers 500 in OpenAI's error shape instead of
/// dropping the connection; the panic is logged and the server goes on
/// (the handler's state is per request; the engine runs on its own
/// thread). A panic while a streamed body is being sent cannot become a
/// status any more: that stream just ends.
pub async fn catch_panic(request: Request, next: Next) -> Response {
    match AssertUnwindSafe(next.run(request)).catch_unwind().await {
        Ok(response) => response,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".to_owned());
            tracing::error!("a request handler panicked: {what}");
            ApiError::Internal(format!(
                "internal error: the request handler panicked ({what})"
            ))
            .into_response()
        }
    }
}

/// Counts every request by route and response status.
pub async fn count(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "other".to_owned(), |p| p.as_str().to_owned());
    let response = next.run(request).await;
    state.metrics.request(&route, response.status().as_u16());
    response
}
