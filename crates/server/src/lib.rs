//! `metrale serve`: an OpenAI-compatible HTTP server over a
//! [`GeneratorHandle`](metrale::GeneratorHandle), the engine on a thread of
//! its own batching every request in flight (continuous batching; no
//! request waits behind another's lock).
//!
//! Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both
//! streamed as server-sent events or not), `GET /v1/models`, `GET /health`,
//! `GET /metrics`. Errors come in OpenAI's JSON shape ([`ApiError`]).
//!
//! Start one with [`router`] and [`serve`] (what the `metrale-serve` binary
//! and the tests do).

pub mod cli;
pub mod error;
pub mod metrics;
pub mod openai;
pub mod routes;
pub mod sse;
pub mod state;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};

pub use error::ApiError;
pub use state::{AppState, ServerConfig};

/// The app: every route over `state`, under the server's layers.
pub fn router(state: Arc<AppState>) -> Router {
    layered(api_routes(state.clone()), state)
}

/// The routes (the API-key check on `/v1`), without the layers.
pub fn api_routes(state: Arc<AppState>) -> Router<Arc<AppState>> {
    let v1 = Router::new()
        .route("/v1/completions", post(routes::completions::handler))
        .route("/v1/chat/completions", post(routes::chat::handler))
        .route("/v1/models", get(routes::models))
        .route_layer(axum::middleware::from_fn_with_state(
            state,
            routes::require_key,
        ));
    Router::new()
        .merge(v1)
        .route("/health", get(routes::health))
        .route("/metrics", get(routes::metrics))
        .fallback(routes::fallback)
}

/// `app` (see [`api_routes`]) under the server's layers, innermost first: a handler that
/// panics answers an OpenAI-shaped 500 (the server goes on), the body size
/// limit (413), and the request counter of `/metrics`. [`router`] is
/// `layered(api_routes(state), state)`; tests add routes of their own.
pub fn layered(app: Router<Arc<AppState>>, state: Arc<AppState>) -> Router {
    app.layer(axum::middleware::from_fn(routes::catch_panic))
        .layer(DefaultBodyLimit::max(state.config.body_limit))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            routes::count,
        ))
        .with_state(state)
}

/// Serves `app` on `listener` until `shutdown` completes; then stops
/// accepting and waits for the requests in flight (streams included) to
/// end.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

/// A number for response ids, unique in this process.
pub(crate) fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
