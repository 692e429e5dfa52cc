//! The server's one error type, answered in OpenAI's JSON shape:
//! `{"error": {"message", "type", "param", "code"}}` with a matching status.

use crate::engine::EngineError;
use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// Everything a request can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// 400: a malformed body, a wrong type, a bad parameter, a prompt too long.
    #[error("{message}")]
    BadRequest {
        message: String,
        param: Option<&'static str>,
        code: Option<&'static str>,
    },
    /// 400: a request field that would change the output and that this
    /// server does not honour ([`fields`](crate::server::fields)).
    #[error("{name} is not supported: {why}")]
    UnsupportedField { name: String, why: &'static str },
    /// 404: a `model` this server does not serve.
    #[error("the model `{0}` does not exist")]
    ModelNotFound(String),
    /// 404: no such route.
    #[error("no route for {0}")]
    NoRoute(String),
    /// 401: `--api-key` is set and the Bearer token is missing or wrong.
    #[error("{0}")]
    Unauthorized(&'static str),
    /// 413: the body is over the limit.
    #[error("{0}")]
    TooLarge(String),
    /// 400: the request would cost more than one of the server's
    /// per-request limits allows ([`Limits`](crate::server::admission::Limits)).
    #[error("{message}")]
    OverLimit {
        /// The command-line option that sets the limit.
        limit: &'static str,
        message: String,
    },
    /// 405: the route exists, not with this method.
    #[error("{0}")]
    MethodNotAllowed(String),
    /// 403: the Host header names a host this server does not answer for.
    #[error("{0}")]
    HostNotAllowed(String),
    /// 408: the request's body did not arrive in time.
    #[error("{0}")]
    Timeout(String),
    /// 429: too many requests are waiting for the engine (`--max-waiting`).
    #[error("too many requests are waiting (--max-waiting {0}); retry later")]
    TooManyRequests(usize),
    /// 429: another shared budget is spent for now; the message names it.
    #[error("{0}")]
    Busy(String),
    /// 500: the engine failed.
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    pub fn bad(message: impl Into<String>) -> Self {
        Self::BadRequest {
            message: message.into(),
            param: None,
            code: None,
        }
    }

    pub fn bad_param(param: &'static str, message: impl Into<String>) -> Self {
        Self::BadRequest {
            message: message.into(),
            param: Some(param),
            code: None,
        }
    }

    /// An error from submitting a request: the engine's refusals (a bad
    /// parameter, a prompt or `max_tokens` beyond the context) are 400s,
    /// anything else a 500.
    pub fn from_submit(e: anyhow::Error) -> Self {
        match e.downcast_ref::<EngineError>() {
            Some(EngineError::Request(message)) => Self::bad(message.clone()),
            _ => Self::Internal(format!("{e:#}")),
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Self::BadRequest { .. } | Self::OverLimit { .. } | Self::UnsupportedField { .. } => {
                StatusCode::BAD_REQUEST
            }
            Self::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            Self::HostNotAllowed(_) => StatusCode::FORBIDDEN,
            Self::Timeout(_) => StatusCode::REQUEST_TIMEOUT,
            Self::Busy(_) => StatusCode::TOO_MANY_REQUESTS,
            Self::ModelNotFound(_) | Self::NoRoute(_) => StatusCode::NOT_FOUND,
            Self::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Self::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::TooManyRequests(_) => StatusCode::TOO_MANY_REQUESTS,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The JSON body (also sent as an SSE event when a stream fails).
    pub fn body(&self) -> serde_json::Value {
        let (kind, param, code) = match self {
            Self::BadRequest { param, code, .. } => ("invalid_request_error", *param, *code),
            Self::UnsupportedField { name, .. } => (
                "invalid_request_error",
                Some(name.as_str()),
                Some("unsupported_field"),
            ),
            Self::ModelNotFound(_) => (
                "invalid_request_error",
                Some("model"),
                Some("model_not_found"),
            ),
            Self::NoRoute(_) => ("invalid_request_error", None, Some("not_found")),
            Self::Unauthorized(_) => ("authentication_error", None, Some("invalid_api_key")),
            Self::TooLarge(_) => ("invalid_request_error", None, Some("request_too_large")),
            Self::TooManyRequests(_) | Self::Busy(_) => {
                ("rate_limit_error", None, Some("rate_limit_exceeded"))
            }
            Self::OverLimit { .. } => ("invalid_request_error", None, Some("request_too_costly")),
            Self::MethodNotAllowed(_) => {
                ("invalid_request_error", None, Some("method_not_allowed"))
            }
            Self::HostNotAllowed(_) => ("invalid_request_error", None, Some("host_not_allowed")),
            Self::Timeout(_) => ("invalid_request_error", None, Some("request_timeout")),
            Self::Internal(_) => ("server_error", None, None),
        };
        json!({"error": {"message": self.to_string(), "type": kind, "param": param, "code": code}})
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            Self::TooLarge(format!(
                "the request body is too large: {}",
                rejection.body_text()
            ))
        } else {
            Self::bad(rejection.body_text())
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if let Self::Internal(message) = &self {
            tracing::error!("request failed: {message}");
        }
        (self.status(), Json(self.body())).into_response()
    }
}
