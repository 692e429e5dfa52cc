//! The flags that the `metrale` subcommands and `metrale-serve` share,
//! defined once: the arithmetic (`--dtype`), the KV cache's and the
//! recurrent states' element types (`--kv-dtype`, `--ssm-state-dtype`), the
//! prefix cache's flags, and memory sizes (`--memory-limit`,
//! `--snapshot-budget`). Both binaries resolve them the same way.

use crate::{ModelOptions, PrefixCacheOptions};

/// `--device`'s value name in `--help`: what this build accepts (the
/// library's `cuda` feature decides, whichever binary asks).
#[cfg(not(feature = "cuda"))]
pub const DEVICE_VALUES: &str = "cpu|auto";
#[cfg(feature = "cuda")]
pub const DEVICE_VALUES: &str = "cpu|auto|cuda[:N]";

/// `--dtype`: the arithmetic, the same on every subcommand that runs a model.
#[derive(clap::ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ArithDType {
    /// As the weights suggest, as other engines do: bf16 weights multiply
    /// in the CPU's faster bf16 kernel (bf16 dot products, or f32 FMAs on
    /// the widened weights where those are faster, as on Intel's cores),
    /// f32 weights in f32, quantized (GGUF) weights with integer dot
    /// products on activations quantized per block.
    #[default]
    #[value(
        help = "as the weights suggest: bf16 weights in the CPU's bf16 kernel, f32 in f32, quantized ones in integer dot products"
    )]
    Auto,
    /// f32 arithmetic wherever the weights allow (exact against the f32
    /// reference; quantized weights still take integer dot products).
    #[value(help = "f32 wherever the weights allow (exact)")]
    F32,
    /// Matmuls with bf16 weights take the CPU's bf16 kernel where it has
    /// one (AVX512-BF16): bf16 dot products on activations rounded to bf16,
    /// as llama.cpp does, or, on CPUs where they are the slower (Intel's
    /// cores), f32 FMAs on the widened weights; the logits move off the
    /// f32 reference by more than 1e-4. Weights stored in f32 still
    /// multiply in f32. Today the same as `auto`.
    #[value(help = "bf16 weights in the CPU's bf16 kernel (today the same as auto)")]
    Bf16,
}

/// `--ssm-state-dtype`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum StateDType {
    /// As the arithmetic: bf16 unless `--dtype f32` or most of the weights
    /// are f32 (`ModelOptions::ssm_state_follows_weights`).
    #[default]
    #[value(help = "bf16, unless --dtype f32 or most of the weights are f32")]
    Auto,
    /// Exact.
    #[value(help = "exact")]
    F32,
    /// Half the state's memory and decode traffic; logits move by up to a
    /// few 1e-3 (the CPU backend only).
    #[value(help = "half the memory and decode traffic; logits move by a few 1e-3 (CPU only)")]
    Bf16,
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

/// `--kv-dtype`: the KV cache's element type.
#[derive(clap::ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KvDType {
    /// As the weights, under `--dtype auto` or `bf16`: f16 where they are
    /// held in bf16, f16 or quantized (as llama.cpp caches in f16), the
    /// backend's default (f32 on the CPU) for f32 weights and under
    /// `--dtype f32`.
    #[default]
    #[value(
        help = "f16 for bf16, f16 or quantized weights; f32 for f32 weights or under --dtype f32"
    )]
    Auto,
    #[value(help = "exact")]
    F32,
    /// Half the bytes per cached token; logits move by up to about 1e-2
    /// (measured on the fixtures: tests/tests/workspace/kv_dtype.rs).
    #[value(help = "half the memory per cached token; logits move by up to about 1e-2")]
    Bf16,
    /// Half the bytes per cached token, three more bits than bf16 (the
    /// cache llama.cpp keeps by default); values beyond ±65504 are held at
    /// 65504.
    #[value(
        help = "half the memory, three more mantissa bits than bf16 (llama.cpp's default); values held within ±65504"
    )]
    F16,
}

impl KvDType {
    /// The cache's dtype asked for outright (None: `auto`).
    pub fn dtype(self) -> Option<crate::core::DType> {
        match self {
            KvDType::Auto => None,
            KvDType::F32 => Some(crate::core::DType::F32),
            KvDType::Bf16 => Some(crate::core::DType::BF16),
            KvDType::F16 => Some(crate::core::DType::F16),
        }
    }

    /// Whether the cache follows the weights' dtype
    /// (`ModelOptions::kv_follows_weights`): `auto` under bf16 arithmetic.
    pub fn follows_weights(self, bf16_arithmetic: bool) -> bool {
        self == KvDType::Auto && bf16_arithmetic
    }

    /// Sets `options`' cache dtype: asked for, or under `auto` and bf16
    /// arithmetic as the weights are held (`ModelOptions::kv_follows_weights`).
    pub fn apply(self, bf16_arithmetic: bool, options: &mut ModelOptions) {
        options.kv_dtype = self.dtype();
        options.kv_follows_weights = self.follows_weights(bf16_arithmetic);
    }
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
    pub fn options(&self) -> PrefixCacheOptions {
        let defaults = PrefixCacheOptions::default();
        PrefixCacheOptions {
            enabled: !self.no_prefix_cache,
            snapshot_interval: self.snapshot_interval.unwrap_or(defaults.snapshot_interval),
            snapshot_budget: self.snapshot_budget.or(defaults.snapshot_budget),
        }
    }
}

/// `--memory-limit`: `8GiB`, `8 GiB`, `1.5GB`, `512MiB`, `4096` (bytes).
/// Binary units KiB, MiB, GiB, TiB (and K, M, G, T); decimal KB, MB, GB,
/// TB.
pub fn parse_memory(text: &str) -> Result<usize, String> {
    let bytes = parse_bytes(text)?;
    usize::try_from(bytes).map_err(|_| format!("{text} is more than this machine can address"))
}

/// A memory size in bytes, as [`parse_memory`] reads it.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let s = text.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = (s[..split].trim(), s[split..].trim());
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a memory size (e.g. 8GiB, 512MiB, 16GB)"))?;
    let scale: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tib" => 1024.0f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => {
            return Err(format!(
                "{text:?}: unknown unit {other:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)"
            ));
        }
    };
    let bytes = value * scale;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(format!("{text:?} is not a usable memory size"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::DType;

    #[test]
    fn memory_sizes() {
        assert_eq!(parse_memory("8GiB").unwrap(), 8 << 30);
        assert_eq!(parse_memory("8 gib").unwrap(), 8 << 30);
        assert_eq!(parse_memory("1.5GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_memory("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_memory("4096").unwrap(), 4096);
        assert_eq!(parse_bytes("100MB").unwrap(), 100_000_000);
        assert_eq!(parse_bytes("2G").unwrap(), 2 << 30);
        assert!(parse_bytes("GiB").is_err());
        assert!(parse_bytes("").is_err());
        assert!(parse_memory("lots").is_err());
        assert!(parse_memory("8 parsecs").is_err());
    }

    #[test]
    fn prefix_cache_flags() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            prefix: PrefixCacheArgs,
        }
        let on = Cli::parse_from(["x"]).prefix.options();
        assert_eq!(on, PrefixCacheOptions::default());
        let off = Cli::parse_from([
            "x",
            "--no-prefix-cache",
            "--snapshot-interval",
            "64",
            "--snapshot-budget",
            "1MiB",
        ])
        .prefix
        .options();
        assert!(!off.enabled);
        assert_eq!(off.snapshot_interval, 64);
        assert_eq!(off.snapshot_budget, Some(1 << 20));
    }

    #[test]
    fn kv_dtypes() {
        // `auto` asks for nothing outright, and follows the weights under
        // bf16 arithmetic only.
        assert_eq!(KvDType::Auto.dtype(), None);
        assert!(KvDType::Auto.follows_weights(true));
        assert!(!KvDType::Auto.follows_weights(false));
        assert_eq!(KvDType::F32.dtype(), Some(DType::F32));
        assert!(!KvDType::F32.follows_weights(true));
        assert_eq!(KvDType::Bf16.dtype(), Some(DType::BF16));
        assert_eq!(KvDType::F16.dtype(), Some(DType::F16));
    }
}
