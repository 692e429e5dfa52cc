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
    /// As the weights, under `--dtype auto` or `bf16`: f16 where they are
    /// held in bf16, f16 or quantized (as llama.cpp caches in f16), the
    /// backend's default (f32 on the CPU) for f32 weights and under
    /// `--dtype f32`.
    #[default]
    Auto,
    F32,
    /// Half the bytes per cached token; logits move by up to about 1e-2
    /// (measured on the fixtures: tests/tests/kv_dtype.rs).
    Bf16,
    /// Half the bytes per cached token, three more bits than bf16 (the
    /// cache llama.cpp keeps by default); values beyond ±65504 are held at
    /// 65504.
    F16,
}

impl KvDType {
    /// The cache's dtype asked for outright (None: `auto`).
    pub fn dtype(self) -> Option<metrale::core::DType> {
        match self {
            KvDType::Auto => None,
            KvDType::F32 => Some(metrale::core::DType::F32),
            KvDType::Bf16 => Some(metrale::core::DType::BF16),
            KvDType::F16 => Some(metrale::core::DType::F16),
        }
    }

    /// Sets `options`' cache dtype: asked for, or under `auto` and bf16
    /// arithmetic (`DTypeArgs::bf16_dot_products`) as the weights are held
    /// (`ModelOptions::kv_follows_weights`).
    pub fn apply(self, bf16_arithmetic: bool, options: &mut ModelOptions) {
        options.kv_dtype = self.dtype();
        options.kv_follows_weights = self == KvDType::Auto && bf16_arithmetic;
    }
}

/// `--memory-limit`'s parser: a size such as `8GiB` or `512MiB` (see
/// [`inspect::parse_bytes`]).
pub fn parse_memory(text: &str) -> Result<usize, String> {
    let bytes = inspect::parse_bytes(text).map_err(|e| format!("{e:#}"))?;
    usize::try_from(bytes).map_err(|_| format!("{text} is more than this machine can address"))
}

/// The prefix cache's flags, the same on every subcommand that runs a model
/// (and on `metrale serve`).
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct PrefixCacheArgs {
    /// Turn the prefix cache off: every request prefills its whole prompt
    /// (by default a prompt starting like an earlier request, such as the
    /// next turn of a chat, reuses that request's KV blocks and recurrent
    /// state).
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// Tokens between the snapshots of a running request's recurrent state
    /// (hybrid and recurrent models); a hit recomputes at most this many
    /// tokens of its prefix (0: snapshots only where a request ends or a
    /// match ended). Default: 128.
    #[arg(long, value_name = "TOKENS")]
    pub snapshot_interval: Option<usize>,
    /// The most memory recurrent-state snapshots may take, e.g. 512MiB
    /// (default: twice the recurrent state of the sequences run at once).
    #[arg(long, value_name = "SIZE", value_parser = parse_memory)]
    pub snapshot_budget: Option<usize>,
}

impl PrefixCacheArgs {
    /// The options the flags give, over the defaults.
    pub fn options(&self) -> metrale::PrefixCacheOptions {
        let defaults = metrale::PrefixCacheOptions::default();
        metrale::PrefixCacheOptions {
            enabled: !self.no_prefix_cache,
            snapshot_interval: self.snapshot_interval.unwrap_or(defaults.snapshot_interval),
            snapshot_budget: self.snapshot_budget.or(defaults.snapshot_budget),
        }
    }
}

/// `--dtype`: the arithmetic, the same on every subcommand that runs a model.
#[derive(clap::ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ArithDType {
    /// As the weights suggest, as other engines do: bf16 weights multiply
    /// in the CPU's faster bf16 kernel (bf16 dot products, or f32 FMAs on
    /// the widened weights where those are faster, as on Intel's cores),
    /// f32 weights in f32, quantized (GGUF) weights with integer dot
    /// products on activations quantized per block.
    #[default]
    Auto,
    /// f32 arithmetic wherever the weights allow (exact against the f32
    /// reference; quantized weights still take integer dot products).
    F32,
    /// Matmuls with bf16 weights take the CPU's bf16 kernel where it has
    /// one (AVX512-BF16): bf16 dot products on activations rounded to bf16,
    /// as llama.cpp does, or, on CPUs where they are the slower (Intel's
    /// cores), f32 FMAs on the widened weights; the logits move off the
    /// f32 reference by more than 1e-4. Weights stored in f32 still
    /// multiply in f32. Today the same as `auto`.
    Bf16,
}

/// `--dtype` (and its old spelling, the hidden `--bf16-dot`).
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct DTypeArgs {
    /// The arithmetic: auto (the default: as the weights suggest; bf16
    /// weights take the CPU's bf16 kernel), f32 (exact), or bf16.
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
    /// How the Mamba-2 and gated-delta layers' running states are held:
    /// auto (the default: as the arithmetic, bf16 under `--dtype auto` or
    /// `bf16` unless most of the weights are f32, f32 under `--dtype f32`,
    /// as vLLM's `mamba_ssm_cache_dtype` follows the model's dtype), f32
    /// (exact), or bf16 (half their memory
    /// and decode traffic; the logits move by up to a few 1e-3, a tenth of
    /// what bf16 dot products move them, docs/ACCURACY.md). The CPU backend
    /// only.
    #[arg(long, value_enum, default_value_t = StateDType::Auto)]
    pub ssm_state_dtype: StateDType,
}

/// `--ssm-state-dtype`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateDType {
    /// As the arithmetic: bf16 unless `--dtype f32` or f32 weights.
    Auto,
    F32,
    Bf16,
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

impl StateDType {
    /// Whether states are held in bf16, given whether the arithmetic is.
    pub fn is_bf16(self, bf16_arithmetic: bool) -> bool {
        match self {
            StateDType::Auto => bf16_arithmetic,
            StateDType::F32 => false,
            StateDType::Bf16 => true,
        }
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

/// An error for people: its messages from the outermost in, joined by
/// ": ", leaving out a cause whose text the message before it already
/// holds (a context that repeats its source). Never a backtrace.
pub fn format_error(error: &anyhow::Error) -> String {
    let mut out = String::new();
    let mut last = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        if text.is_empty() || last.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
        last = text;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::format_error;
    use anyhow::Context;

    #[test]
    fn format_error_joins_the_chain_without_repeats() {
        let e = Err::<(), _>(std::io::Error::other("no such file x.json"))
            .context("reading x.json: no such file x.json")
            .context("loading model")
            .unwrap_err();
        assert_eq!(
            format_error(&e),
            "loading model: reading x.json: no such file x.json"
        );
        let e = anyhow::anyhow!("a").context("b");
        assert_eq!(format_error(&e), "b: a");
    }
}
