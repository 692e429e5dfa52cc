//! One module per subcommand.

pub mod bench;
mod bench_probe;
pub mod chat;
pub mod generate;
pub mod inspect;
pub mod logits;

/// `--memory-limit`'s parser: a size such as `8GiB` or `512MiB` (see
/// [`inspect::parse_bytes`]).
pub fn parse_memory(text: &str) -> Result<usize, String> {
    let bytes = inspect::parse_bytes(text).map_err(|e| format!("{e:#}"))?;
    usize::try_from(bytes).map_err(|_| format!("{text} is more than this machine can address"))
}

/// Logs to stderr, filtered by `RUST_LOG` (default: warnings).
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
