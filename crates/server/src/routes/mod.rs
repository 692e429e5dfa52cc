//! The routes, and the layers around them (API key, request counting).

pub mod chat;
pub mod completions;

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use axum::Json;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderMap, HeaderValue, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::FutureExt;
use serde_json::json;

use crate::error::ApiError;
use crate::state::AppState;

/// `GET /v1/models`: the one model served.
pub async fn models(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "metrale",
            "root": state.model_dir.display().to_string(),
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
            // Read the body first (within the body limit): a connection
            // whose request body was left unread is closed after the
            // response, and a keep-alive client (the openai package's)
            // that sends its next request on it meets a reset instead.
            let drained = axum::body::to_bytes(request.into_body(), state.config.body_limit)
                .await
                .is_ok();
            let mut response = ApiError::Unauthorized(message).into_response();
            if !drained {
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            return response;
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
