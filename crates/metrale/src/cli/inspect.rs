//! `metrale inspect`: what a model directory holds and what fits in memory.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use metrale::{BackendOptions, open_backend};
use metrale_core::DType;
use metrale_core::scope::ModelResource;
use metrale_model_engine::config::{MixerKind, ModelConfig, RopeScaling};
use metrale_model_engine::gguf::{GgufModel, ModelSource};
use metrale_model_engine::loader::load_weights;
use metrale_model_engine::model::ModelOptions;
use metrale_model_engine::model::types::kv_spec;
use metrale_model_weights::loader::{WeightDType, load_gguf, scan_safetensors};

#[derive(clap::Args)]
pub struct Args {
    /// The model: a directory (config.json, *.safetensors), a .safetensors
    /// file in one, a .gguf file, or a Hugging Face hub id org/name in the
    /// local cache. Default: $METRALE_MODEL, else the bundled model.
    #[arg(value_name = "MODEL")]
    pub model: Option<PathBuf>,
    /// The model `model` names, resolved.
    #[arg(skip)]
    pub model_dir: PathBuf,
    /// The revision of a hub id model: a branch, tag or commit hash
    /// (default: main).
    #[arg(long, value_name = "REV")]
    pub revision: Option<String>,
    /// A memory budget, e.g. 8GiB, 512MiB, 16GB or a byte count, to report what fits.
    /// `--memory` alone (or `--memory free`): the free memory of the device
    /// `--device` opens (a GPU's free memory; on the CPU, the host's).
    #[arg(long, value_name = "SIZE", num_args = 0..=1, default_missing_value = "free")]
    pub memory: Option<String>,
    /// Tokens per sequence assumed when counting concurrent sequences
    /// (default: 4096, or the model's maximum if smaller).
    #[arg(long)]
    pub context: Option<usize>,
    /// Read only the safetensors headers instead of loading the weights
    /// (for checkpoints larger than this machine's memory); with no weight
    /// files in the directory, only config.json (sizes from the config).
    #[arg(long)]
    pub no_load: bool,
    // The backend the weights are loaded onto, whose cache layouts size the
    // KV cache and the recurrent state.
    #[command(flatten)]
    pub device: super::DeviceArgs,
    /// The arithmetic the sizes assume, as `run` and `serve` take it: auto
    /// (bf16 caches and states unless asked otherwise), f32 or bf16.
    #[arg(long, value_enum, default_value_t = super::ArithDType::Auto)]
    pub dtype: super::ArithDType,
    /// The KV cache's element type the sizes assume: auto (as `run` takes
    /// it: bf16 for weights narrower than f32 unless `--dtype f32`, else the
    /// backend's default), f32 or bf16.
    #[arg(long, value_enum, default_value_t = super::KvDType::Auto)]
    pub kv_dtype: super::KvDType,
    /// The recurrent states' element type the sizes assume: auto (as the
    /// arithmetic), f32 or bf16.
    #[arg(long, value_enum, default_value_t = super::StateDType::Auto)]
    pub ssm_state_dtype: super::StateDType,
}

/// Per-token KV and per-sequence recurrent bytes as the backend lays them out.
struct CacheSizes {
    kv_per_token: usize,
    kv_dtype: DType,
    rec_per_seq: usize,
    /// The conv windows' and the SSM (or delta-rule) states' element types.
    conv_dtype: DType,
    ssm_dtype: DType,
    /// The device it was asked of, and the memory it has free (None: it
    /// does not know).
    device: metrale::Device,
    available: Option<usize>,
}

fn cache_sizes(args: &Args, config: &ModelConfig, narrow_weights: bool) -> Result<CacheSizes> {
    let bf16 = args.dtype != super::ArithDType::F32;
    let backend = open_backend(
        args.device.device,
        &BackendOptions {
            bf16_ssm_state: args.ssm_state_dtype.is_bf16(bf16),
            ..BackendOptions::default()
        },
    )?;
    let gpu = backend.gpu().as_ref();
    // What `ModelOptions::for_weights` resolves `auto` to once loaded.
    let mut options = ModelOptions {
        ssm_state_follows_weights: args.ssm_state_dtype == super::StateDType::Auto && bf16,
        ..ModelOptions::default()
    };
    args.kv_dtype.apply(bf16, &mut options);
    options.resolve_follows(narrow_weights);
    let layout = gpu.kv_layout(kv_spec(config, &options))?;
    let traffic = super::bench_probe::cache_traffic(config, gpu, &options)?;
    Ok(CacheSizes {
        kv_per_token: traffic.kv_per_token,
        kv_dtype: layout.dtype,
        rec_per_seq: traffic.state_per_seq,
        conv_dtype: gpu.state_layout(1).dtype,
        ssm_dtype: options
            .ssm_state_dtype
            .unwrap_or(gpu.ssm_state_layout(1).dtype),
        device: backend.device(),
        available: gpu.available_memory(),
    })
}

/// Parameter and byte totals of the weights as stored.
struct Totals {
    parameters: usize,
    /// Those held in f32 (`--kv-dtype auto` caches in f16 where they are
    /// fewer than half, as `ModelOptions::for_weights` does).
    f32_parameters: usize,
    bytes: usize,
    dtypes: Vec<String>,
    /// The sizes come from config.json alone (no weight files were read).
    from_config: bool,
}

pub fn run(mut args: Args) -> Result<()> {
    args.model_dir = metrale::model_dir(args.model.as_deref(), args.revision.as_deref())?;
    let free_budget = args
        .memory
        .as_deref()
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("free"));
    let mut budget = match &args.memory {
        Some(_) if free_budget => None,
        memory => memory.as_deref().map(parse_bytes).transpose()?,
    };
    let source = ModelSource::from_path(&args.model_dir);
    let gguf = matches!(source, ModelSource::Gguf(_));
    let config = source.config()?;
    let has_weights = gguf
        || ["model.safetensors", "model.safetensors.index.json"]
            .iter()
            .any(|f| args.model_dir.join(f).is_file());
    if !args.no_load && !has_weights {
        bail!(
            "{}: no weights found (model.safetensors or model.safetensors.index.json); \
             `metrale inspect --no-load` reports the plan and sizes from config.json alone",
            args.model_dir.display()
        );
    }
    let totals = if !has_weights {
        from_config(&config)
    } else if args.no_load {
        from_headers(&args, &config)?
    } else {
        load(&args, &config)?
    };
    // `--kv-dtype auto` follows the weights: most held narrower than f32.
    let narrow = totals.parameters > 2 * totals.f32_parameters;
    let sizes = cache_sizes(&args, &config, narrow)?;
    if free_budget {
        let free = sizes.available.ok_or_else(|| {
            anyhow::anyhow!(
                "--memory free: the {} backend does not know its free memory; give a size \
                 (e.g. --memory 8GiB)",
                sizes.device
            )
        })?;
        budget = Some(free as u64);
    }
    let mut text = report(&args, &config, &totals, &sizes, budget);
    if let Some(aside) = aside_line(&args, &config, has_weights && !gguf) {
        // After the parameters: counted apart from them.
        let at = text.find("\nweights").map_or(text.len(), |i| i + 1);
        text.insert_str(at, &format!("{:<18}{aside}\n", "not loaded"));
    }
    print!("{text}");
    Ok(())
}

/// The parts of the checkpoint the model sets aside (a vision tower, MTP
/// layers), each with its parameters: from the config where it describes
/// them, else from the checkpoint's headers (`headers`: there are some).
fn aside_line(args: &Args, c: &ModelConfig, headers: bool) -> Option<String> {
    let stored = headers
        .then(|| scan_safetensors(&args.model_dir).ok())
        .flatten()
        .unwrap_or_default();
    let parts: Vec<String> = c
        .aside
        .iter()
        .filter_map(|part| {
            let prefixes = part.prefixes.join(", ");
            if !part.expected.is_empty() {
                // Saturating: the vision tower's sizes come from a config
                // that nothing else bounds as a whole.
                let n = part
                    .expected
                    .iter()
                    .map(|t| t.shape.iter().fold(1usize, |a, &d| a.saturating_mul(d)))
                    .fold(0usize, usize::saturating_add);
                return Some(format!("{} ({prefixes}) {}", part.what, human_count(n)));
            }
            let held = stored
                .iter()
                .filter(|t| part.prefixes.iter().any(|p| t.name.starts_with(p.as_str())));
            let (count, n) = held.fold((0usize, 0usize), |(k, n), t| {
                let size = t.shape.iter().fold(1usize, |a, &d| a.saturating_mul(d));
                (k + 1, n.saturating_add(size))
            });
            (count > 0).then(|| format!("{} ({prefixes}) {}", part.what, human_count(n)))
        })
        .collect();
    (!parts.is_empty()).then(|| parts.join("; "))
}

/// Loads every weight onto the backend of `--device` (checking the whole
/// checkpoint), counts it, and frees it again.
fn load(args: &Args, config: &ModelConfig) -> Result<Totals> {
    let backend = open_backend(args.device.device, &BackendOptions::default())?;
    let gpu = backend.gpu().as_ref();
    let mut progress = super::load_progress();
    let result = match ModelSource::from_path(&args.model_dir) {
        ModelSource::Gguf(path) => GgufModel::open(&path).and_then(|g| {
            let expected = g.expected_tensors()?;
            Ok(load_gguf(
                &g.file,
                &expected,
                gpu,
                WeightDType::AsStored,
                &mut progress,
            )?)
        }),
        ModelSource::Dir(dir) => {
            load_weights(&dir, config, gpu, WeightDType::AsStored, &mut progress)
        }
    };
    // The bar is cleared by `Done`; after an error it is dropped with
    // `progress` (indicatif clears a dropped bar's line).
    drop(progress);
    let mut store = result?;
    let mut dtypes: Vec<String> = store
        .names()
        .filter_map(|n| store.get(n).ok())
        .map(|t| t.dtype().to_string())
        .collect();
    dtypes.sort();
    dtypes.dedup();
    let f32_parameters = store
        .names()
        .filter_map(|n| store.get(n).ok())
        .filter(|t| t.dtype() == DType::F32)
        .map(|t| t.elements())
        .sum();
    let totals = Totals {
        parameters: store.parameters(),
        f32_parameters,
        bytes: store.bytes(),
        dtypes,
        from_config: false,
    };
    store.release(gpu).context("freeing the weights")?;
    Ok(totals)
}

/// Counts from the safetensors headers only.
fn from_headers(args: &Args, config: &ModelConfig) -> Result<Totals> {
    if let ModelSource::Gguf(path) = ModelSource::from_path(&args.model_dir) {
        return from_gguf_headers(&path);
    }
    let stored = scan_safetensors(&args.model_dir)?;
    let mut totals = Totals {
        parameters: 0,
        f32_parameters: 0,
        bytes: 0,
        dtypes: Vec::new(),
        from_config: false,
    };
    for spec in config.expected_tensors() {
        let Some(t) = stored.iter().find(|t| t.name == spec.name) else {
            bail!(
                "{}: tensor {:?} is missing",
                args.model_dir.display(),
                spec.name
            );
        };
        if t.shape != spec.shape {
            bail!(
                "{}: tensor {:?} has shape {:?}, expected {:?}",
                t.file.display(),
                t.name,
                t.shape,
                spec.shape
            );
        }
        let n = spec.shape.iter().product::<usize>();
        totals.parameters += n;
        if t.dtype.eq_ignore_ascii_case("F32") {
            totals.f32_parameters += n;
        }
        totals.bytes += t.bytes;
        if !totals.dtypes.contains(&t.dtype.to_ascii_lowercase()) {
            totals.dtypes.push(t.dtype.to_ascii_lowercase());
        }
    }
    totals.dtypes.sort();
    Ok(totals)
}

/// Counts from a GGUF file's tensor table only: each expected tensor's
/// sources, as stored.
fn from_gguf_headers(path: &std::path::Path) -> Result<Totals> {
    let g = GgufModel::open(path)?;
    let mut totals = Totals {
        parameters: 0,
        f32_parameters: 0,
        bytes: 0,
        dtypes: Vec::new(),
        from_config: false,
    };
    for e in g.expected_tensors()? {
        let n = e.shape.iter().product::<usize>();
        totals.parameters += n;
        for name in &e.sources {
            let t = g.file.tensor(name)?;
            totals.bytes += t.data.len();
            let ty = t.ggml_type().name().to_ascii_lowercase();
            if ty == "f32" {
                // A tensor read from several sources: each its share.
                totals.f32_parameters += n / e.sources.len().max(1);
            }
            if !totals.dtypes.contains(&ty) {
                totals.dtypes.push(ty);
            }
        }
    }
    totals.dtypes.sort();
    Ok(totals)
}

/// Counts from config.json alone: every tensor the plan expects, in the
/// dtype the config declares (bf16 when it declares none).
fn from_config(config: &ModelConfig) -> Totals {
    let dtype = config.declared_dtype.unwrap_or(DType::BF16);
    let parameters = config.parameter_count();
    Totals {
        parameters,
        f32_parameters: if dtype == DType::F32 { parameters } else { 0 },
        bytes: parameters * dtype.size_of(),
        dtypes: vec![dtype.to_string()],
        from_config: true,
    }
}

fn report(
    args: &Args,
    c: &ModelConfig,
    t: &Totals,
    sizes: &CacheSizes,
    budget: Option<u64>,
) -> String {
    let mut out = String::new();
    let mut line = |key: &str, value: String| out.push_str(&format!("{key:<18}{value}\n"));
    line("model", args.model_dir.display().to_string());
    line("model type", c.model_type.as_str().to_string());
    line("layers", c.num_layers().to_string());
    line("layer plan", c.plan_line());
    line(
        "",
        "(* attention, M Mamba-2, G gated DeltaNet, C short conv, - MLP only, E MoE only)"
            .to_string(),
    );
    if let Some(a) = &c.attention {
        let pos = match &a.rope {
            None => "no positional encoding".to_string(),
            Some(r) => {
                let scaling = match &r.scaling {
                    RopeScaling::Default => String::new(),
                    other => format!(", {other:?}"),
                };
                format!(
                    "RoPE theta {} on {} of {} channels{scaling}",
                    r.theta, r.rotary_dim, a.head_dim
                )
            }
        };
        line(
            "attention",
            format!(
                "{} heads, {} KV heads, head dim {}, {pos}",
                a.n_heads, a.n_kv_heads, a.head_dim
            ),
        );
    }
    if let Some(m) = &c.mamba {
        line(
            "mamba-2",
            format!(
                "{} heads x {}, state {}, {} groups, conv {}, chunk {}",
                m.n_heads, m.head_dim, m.d_state, m.n_groups, m.conv_kernel, m.chunk_size
            ),
        );
    }
    if let Some(d) = &c.deltanet {
        line(
            "gated deltanet",
            format!(
                "{} key heads x {}, {} value heads x {}, conv {}",
                d.n_k_heads, d.k_head_dim, d.n_v_heads, d.v_head_dim, d.conv_kernel
            ),
        );
    }
    if let Some(m) = &c.moe {
        let shared = m
            .shared_intermediate
            .map_or(String::new(), |s| format!(", shared expert {s}"));
        line(
            "experts",
            format!(
                "{} experts, top {}, intermediate {}{shared}",
                m.n_experts, m.top_k, m.expert_intermediate
            ),
        );
    }
    line(
        "parameters",
        format!("{} ({})", t.parameters, human_count(t.parameters)),
    );
    let stored = if t.from_config {
        "as config.json declares (no weight files read)"
    } else {
        "as stored"
    };
    line(
        "weights",
        format!(
            "{} bytes ({}), {} {stored}",
            t.bytes,
            human_bytes(t.bytes as u64),
            t.dtypes.join("/")
        ),
    );

    let kv = sizes.kv_per_token;
    let n_attn = c.attention_layers().count();
    let kv_detail = c.attention.as_ref().map_or(String::new(), |a| {
        format!(
            " ({}: {n_attn} attention layers x 2 (K, V) x {} KV heads x {} dims x {} bytes)",
            sizes.kv_dtype,
            a.n_kv_heads,
            a.head_dim,
            sizes.kv_dtype.size_of()
        )
    });
    line("kv cache", format!("{kv} bytes per token{kv_detail}"));
    let rec = sizes.rec_per_seq;
    let n_mamba = c
        .layers
        .iter()
        .filter(|l| l.mixer == MixerKind::Mamba2)
        .count();
    let n_delta = c
        .layers
        .iter()
        .filter(|l| l.mixer == MixerKind::GatedDeltaNet)
        .count();
    let n_conv = c
        .layers
        .iter()
        .filter(|l| l.mixer == MixerKind::ShortConv)
        .count();
    let convs = match n_conv {
        0 => String::new(),
        n => format!(", {n} short conv"),
    };
    line(
        "recurrent state",
        format!(
            "{rec} bytes per sequence ({}) ({} conv + {} SSM state: {n_mamba} Mamba-2, {n_delta} DeltaNet{convs} layers)",
            human_bytes(rec as u64),
            sizes.conv_dtype,
            sizes.ssm_dtype
        ),
    );

    if let Some(budget) = budget {
        let context = args
            .context
            .unwrap_or(4096)
            .min(c.max_position_embeddings)
            .max(1);
        let whose = match args.memory.as_deref() {
            Some(m) if m.trim().eq_ignore_ascii_case("free") => {
                format!(", the free memory of {}", sizes.device)
            }
            _ => String::new(),
        };
        line(
            "memory budget",
            format!("{budget} bytes ({}{whose})", human_bytes(budget)),
        );
        let weights = t.bytes as u64;
        let Some(free) = budget.checked_sub(weights) else {
            line(
                "does not fit",
                format!(
                    "the weights alone need {} more",
                    human_bytes(weights - budget)
                ),
            );
            return out;
        };
        line(
            "after weights",
            format!(
                "{free} bytes ({}) for caches and activations",
                human_bytes(free)
            ),
        );
        let kv = kv as u64;
        match free.checked_div(kv) {
            None => line("kv tokens", "unlimited (no attention layers)".to_string()),
            Some(tokens) => line(
                "kv tokens",
                format!("{tokens} (= (budget - weights) / kv bytes per token)"),
            ),
        }
        let per_seq = rec as u64 + context as u64 * kv;
        line(
            "sequences",
            format!(
                "{} of {context} tokens (= (budget - weights) / (recurrent bytes per sequence + {context} x kv bytes per token); activations not counted)",
                free.checked_div(per_seq).unwrap_or(0)
            ),
        );
    }
    out
}

/// `8GiB`, `8 GiB`, `1.5GB`, `512MiB`, `4096` (bytes). Binary units: KiB,
/// MiB, GiB, TiB and K, M, G, T; decimal: KB, MB, GB, TB.
pub fn parse_bytes(text: &str) -> Result<u64> {
    super::parse_bytes(text).map_err(anyhow::Error::msg)
}

fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[unit])
    }
}

fn human_count(n: usize) -> String {
    let v = n as f64;
    match n {
        0..1_000 => format!("{n}"),
        1_000..1_000_000 => format!("{:.1} K", v / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1} M", v / 1e6),
        _ => format!("{:.2} B", v / 1e9),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_sizes_are_the_shared_parsers() {
        // The units are `metrale::flags`' (tested there).
        assert_eq!(parse_bytes("2G").unwrap(), 2 << 30);
        let err = parse_bytes("8 parsecs").unwrap_err().to_string();
        assert!(err.contains("unknown unit"), "{err}");
    }

    #[test]
    fn human_units() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 << 30), "3.00 GiB");
        assert_eq!(human_count(1_234_567), "1.2 M");
    }
}
