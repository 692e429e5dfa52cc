//! One module per subcommand.

pub mod bench;
mod bench_probe;
pub mod chat;
pub mod generate;
pub mod inspect;
pub mod logits;
pub mod serve;

use std::io::IsTerminal;

use metrale::Device;

/// `--device`, the same on every subcommand that runs a model.
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct DeviceArgs {
    /// Where to run: cpu, auto (the best backend this build has: with the
    /// `cuda` feature CUDA device 0 when one opens, else the CPU), or
    /// cuda / cuda:N (needs a build with the `cuda` feature).
    #[arg(long, value_name = DEVICE_VALUES, default_value_t = Device::Auto)]
    pub device: Device,
    /// Run every decode step eagerly instead of replaying it as a captured
    /// CUDA graph (graphs are on by default on a CUDA device; the CPU
    /// backend has none).
    #[arg(long)]
    pub no_cuda_graphs: bool,
}

/// `--device`'s value name in `--help`.
#[cfg(not(feature = "cuda"))]
const DEVICE_VALUES: &str = "cpu|auto";
#[cfg(feature = "cuda")]
const DEVICE_VALUES: &str = "cpu|auto|cuda[:N]";

/// `--kv-dtype`: the KV cache's element type.
#[derive(clap::ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KvDType {
    /// The backend's default (f32 on the CPU).
    #[default]
    Auto,
    F32,
    /// Half the bytes per cached token; logits move by up to about 1e-2
    /// (measured on the fixtures: tests/tests/kv_dtype.rs).
    Bf16,
}

impl KvDType {
    pub fn dtype(self) -> Option<metrale::core::DType> {
        match self {
            KvDType::Auto => None,
            KvDType::F32 => Some(metrale::core::DType::F32),
            KvDType::Bf16 => Some(metrale::core::DType::BF16),
        }
    }
}

/// `--memory-limit`'s parser: a size such as `8GiB` or `512MiB` (see
/// [`inspect::parse_bytes`]).
pub fn parse_memory(text: &str) -> Result<usize, String> {
    let bytes = inspect::parse_bytes(text).map_err(|e| format!("{e:#}"))?;
    usize::try_from(bytes).map_err(|_| format!("{text} is more than this machine can address"))
}

/// Logs to stderr: with `verbose` (`-v`) 1, info and up (the device chosen,
/// ...), with 2 or more, debug; otherwise filtered by `RUST_LOG` (default:
/// warnings).
pub fn init_tracing(verbose: u8) {
    let filter = match verbose {
        0 => tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        1 => tracing_subscriber::EnvFilter::new("info"),
        _ => tracing_subscriber::EnvFilter::new("debug"),
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}
