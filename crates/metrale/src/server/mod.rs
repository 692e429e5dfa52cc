//! `metrale serve`: an OpenAI-compatible HTTP server over a
//! [`GeneratorHandle`](crate::GeneratorHandle), the engine on a thread of
//! its own batching every request in flight (continuous batching; no
//! request waits behind another's lock).
//!
//! Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both
//! streamed as server-sent events or not), `GET /v1/models`, `POST
//! /tokenize` and `POST /detokenize` (vLLM's), `GET /health`, `GET
//! /metrics`. Errors come in OpenAI's JSON shape ([`ApiError`]).
//!
//! In the `metrale` package behind its `server` feature (on by default),
//! so that the one installed binary serves: `metrale serve` runs
//! [`cli::main`] in its own process (the metrale-server package's
//! `metrale-serve` binary does the same).
//!
//! Start one with [`router`] and [`serve`] (what [`cli::main`] and the
//! tests do). No client can hold more than its own request: the
//! engine thread never waits on one ([`state`]), a request is admitted by
//! its cost before anything proportional to it is allocated
//! ([`admission`]), and connections are bounded in number and time
//! ([`listen`]).

pub mod admission;
pub mod cli;
pub mod error;
pub mod fields;
pub mod listen;
pub mod metrics;
pub mod openai;
pub mod reply;
pub mod routes;
pub mod sse;
pub mod state;
pub mod structured;
pub mod tool_grammar;
pub mod tools;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};

pub use admission::Limits;
pub use error::ApiError;
pub use listen::{ConnConfig, serve};
pub use state::{AppState, HostPolicy, ServerConfig};

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
        .route("/tokenize", post(routes::tokens::tokenize))
        .route("/detokenize", post(routes::tokens::detokenize))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            routes::require_key,
        ))
        .route_layer(axum::middleware::from_fn_with_state(
            state,
            routes::read_body,
        ));
    Router::new()
        .merge(v1)
        .route("/health", get(routes::health))
        .route("/metrics", get(routes::metrics))
        .fallback(routes::fallback)
        .method_not_allowed_fallback(routes::method_not_allowed)
}

/// `app` (see [`api_routes`]) under the server's layers, innermost first:
/// a handler that panics answers an OpenAI-shaped 500 (the server goes
/// on), the body size limit (413), the request counter of `/metrics`, and
/// the Host check (403, [`HostPolicy`]). [`router`] is
/// `layered(api_routes(state), state)`; tests add routes of their own.
pub fn layered(app: Router<Arc<AppState>>, state: Arc<AppState>) -> Router {
    app.layer(axum::middleware::from_fn(routes::catch_panic))
        .layer(DefaultBodyLimit::max(state.config.body_limit))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            routes::count,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            routes::check_host,
        ))
        .with_state(state)
}

/// Two futures: the first resolves on the first SIGINT (Ctrl-C) or
/// SIGTERM, the second on the next one (for [`serve`]'s `force`). Call
/// within a Tokio runtime: the signals are listened for from then on.
pub fn shutdown_signals() -> (
    impl std::future::Future<Output = ()> + Send + 'static,
    impl std::future::Future<Output = ()> + Send + 'static,
) {
    let (first_tx, first_rx) = tokio::sync::oneshot::channel::<()>();
    let (second_tx, second_rx) = tokio::sync::oneshot::channel::<()>();
    let signals = Signals::new();
    tokio::spawn(async move {
        let mut signals = signals;
        signals.next().await;
        let _ = first_tx.send(());
        signals.next().await;
        let _ = second_tx.send(());
    });
    let wait = |rx: tokio::sync::oneshot::Receiver<()>| async move {
        if rx.await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    (wait(first_rx), wait(second_rx))
}

/// SIGINT and SIGTERM, listened for from their creation on.
struct Signals {
    #[cfg(unix)]
    streams: Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>,
}

impl Signals {
    #[cfg(unix)]
    fn new() -> Self {
        use tokio::signal::unix::{SignalKind, signal};
        let streams = signal(SignalKind::interrupt())
            .and_then(|int| Ok((int, signal(SignalKind::terminate())?)));
        if let Err(e) = &streams {
            tracing::error!("cannot listen for SIGINT and SIGTERM: {e}");
        }
        Self {
            streams: streams.ok(),
        }
    }

    #[cfg(not(unix))]
    fn new() -> Self {
        Self {}
    }

    /// The next signal (never, when they cannot be listened for).
    async fn next(&mut self) {
        #[cfg(unix)]
        if let Some((int, term)) = &mut self.streams {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
            return;
        }
        #[cfg(not(unix))]
        if tokio::signal::ctrl_c().await.is_ok() {
            return;
        }
        std::future::pending::<()>().await
    }
}

/// A number for response ids, unique in this process.
pub(crate) fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
