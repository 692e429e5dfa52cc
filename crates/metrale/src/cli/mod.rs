//! One module per subcommand.

pub mod bench;
mod bench_prefix;
mod bench_probe;
mod bench_report;
pub mod chat;
pub mod generate;
pub mod inspect;
pub mod logits;
pub mod quantize;
pub mod serve;
mod signals;

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};

use indicatif::{ProgressBar, ProgressStyle};
use metrale::Device;
use metrale::engine::model::ModelOptions;
use metrale::weights::loader::LoadProgress;

pub use metrale::flags::{
    ArithDType, KvDType, PrefixCacheArgs, StateDType, parse_bytes, parse_memory,
};

/// `--device`, the same on every subcommand that runs a model.
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct DeviceArgs {
    /// Where to run: cpu, auto (the best backend this build has: with the
    /// `cuda` feature CUDA device 0 when one opens, else the CPU), or
    /// cuda / cuda:N (needs a build with the `cuda` feature).
    #[arg(long, value_name = metrale::flags::DEVICE_VALUES, default_value_t = Device::Auto)]
    pub device: Device,
    /// Run every decode step eagerly instead of replaying it as a captured
    /// CUDA graph (graphs are on by default on a CUDA device; the CPU
    /// backend has none).
    #[arg(long)]
    pub no_cuda_graphs: bool,
}

/// `--dtype` (and its old spelling, the hidden `--bf16-dot`).
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct DTypeArgs {
    /// The arithmetic (docs/ACCURACY.md measures each choice).
    #[arg(long, value_enum, default_value_t = ArithDType::Auto)]
    pub dtype: ArithDType,
    /// The old spelling of `--dtype bf16`.
    #[arg(long, hide = true)]
    pub bf16_dot: bool,
    /// Quantize the float weights on load, as llama.cpp's llama-quantize
    /// would: q8_0, q4_k_m, q5_k_m, q6_k (the `_m` mixes choose the type
    /// of each tensor by llama.cpp's rules), or q4_0, q4_1, q5_0, q5_1,
    /// q4_k_s, q5_k_s. Quantized weights run on the CPU.
    #[arg(long, value_parser = metrale::FileType::parse_quantized, value_name = "TYPE")]
    pub quant: Option<metrale::FileType>,
    /// How the Mamba-2 and gated-delta layers' running states are held
    /// (docs/ACCURACY.md measures each).
    #[arg(long, value_enum, default_value_t = StateDType::Auto)]
    pub ssm_state_dtype: StateDType,
}

impl DTypeArgs {
    /// Whether bf16 dot products are asked for.
    pub fn bf16_dot_products(&self) -> bool {
        self.bf16_dot || self.dtype != ArithDType::F32
    }

    /// Whether SSM states are to be held in bf16: asked for, or `auto`
    /// under bf16 arithmetic (the backend's setting; see [`Self::apply`]).
    pub fn bf16_ssm_state(&self) -> bool {
        self.ssm_state_dtype.is_bf16(self.bf16_dot_products())
    }

    /// Sets what `options` take from these flags besides the backend: under
    /// `--ssm-state-dtype auto` and bf16 arithmetic the states follow the
    /// weights (`ModelOptions::ssm_state_follows_weights`: f32 weights,
    /// which multiply in f32, keep f32 states), and `kv` the KV cache's.
    pub fn apply(&self, kv: KvDType, options: &mut ModelOptions) {
        let bf16 = self.bf16_dot_products();
        kv.apply(bf16, options);
        options.ssm_state_follows_weights = self.ssm_state_dtype == StateDType::Auto && bf16;
    }
}

/// `-q`: no progress bars and no summary lines (errors still print).
static QUIET: AtomicBool = AtomicBool::new(false);

pub fn quiet() -> bool {
    QUIET.load(Ordering::Relaxed)
}

/// The progress callback of a model load: a bar on stderr counting the
/// bytes uploaded when stderr is a terminal (and not `-q`), nothing
/// otherwise. The load's warnings (unused tensors, config defaults) are
/// logged at warn level, which shows by default.
pub fn load_progress() -> impl FnMut(LoadProgress) {
    let show = std::io::stderr().is_terminal() && !quiet();
    let mut bar: Option<ProgressBar> = None;
    move |p: LoadProgress| match p {
        LoadProgress::Start { bytes, .. } if show => {
            // Cleared when done, and when dropped after a failed load.
            let b = ProgressBar::new(bytes).with_finish(indicatif::ProgressFinish::AndClear);
            if let Ok(style) =
                ProgressStyle::with_template("loading {bar:40} {bytes}/{total_bytes} {msg}")
            {
                b.set_style(style);
            }
            bar = Some(b);
        }
        LoadProgress::Tensor {
            bytes_done, name, ..
        } => {
            if let Some(b) = &bar {
                b.set_position(bytes_done);
                b.set_message(name);
            }
        }
        LoadProgress::Done { .. } => {
            if let Some(b) = bar.take() {
                b.finish_and_clear();
            }
        }
        // Already in the log at warn level (the config reader's and the
        // weight loader's), before the bar starts.
        LoadProgress::Warning(_) => {}
        _ => {}
    }
}

/// Logs to stderr: `-q` errors only, `-v` info and up (the device chosen,
/// the defaults applied, ...), `-vv` debug, `-vvv` trace; with neither,
/// what `RUST_LOG` says, else warnings (a load's warnings among them).
pub fn init_tracing(verbose: u8, quiet: bool) {
    QUIET.store(quiet, Ordering::Relaxed);
    metrale::announce_device_choice(!quiet);
    let filter = match (quiet, verbose) {
        (true, _) => tracing_subscriber::EnvFilter::new("error"),
        (false, 0) => tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        (false, 1) => tracing_subscriber::EnvFilter::new("info"),
        (false, 2) => tracing_subscriber::EnvFilter::new("debug"),
        _ => tracing_subscriber::EnvFilter::new("trace"),
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .without_time()
        .try_init();
}

pub use metrale::format_error;
