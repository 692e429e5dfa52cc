//! One module per subcommand.

pub mod bench;
mod bench_probe;
pub mod chat;
pub mod generate;
pub mod inspect;
pub mod logits;

/// Logs to stderr, filtered by `RUST_LOG` (default: warnings).
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
