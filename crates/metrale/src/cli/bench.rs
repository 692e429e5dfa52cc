//! `metrale bench`: prefill and decode throughput, time to first token and
//! peak memory of a model directory, or of a random-weight model built from
//! a config.json alone (real shapes without the weights). Beside the decode
//! figure it prints the decode roofline: the weight bytes a decode step
//! reads divided by the memory bandwidth the machine sustains (on a GPU,
//! the device memory's, from a timed device-to-device copy; on the CPU, the
//! host's, probed right before and after each decode window: a shared
//! host's bandwidth moves from one second to the next). On a GPU it also
//! reports the device: name, compute capability, memory.
//!
//! `--batch` takes a list (1,4,16,64): each batch size runs in turn on the
//! model loaded once, and each reports its decode throughput, per sequence
//! and in all, with the FLOP/s and weight bytes/s of its decode steps
//! against the machine's peaks (`bench_report.rs`; on the CPU a short
//! compute probe measures the arithmetic peak, `bench_probe.rs`).
//!
//! With `--shared-prefix N` it measures the prefix cache instead: the time
//! to first token of a cached N-token prefix against an uncached one
//! (`bench_prefix.rs`).
//!
//! Also the hidden `metrale export-random`, which writes the random model of
//! a config as a Hugging Face checkpoint (for comparisons with other engines).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use metrale::core::DType;
use metrale::engine::config::{ModelConfig, parse_config};
use metrale::engine::model::{Logits, ModelOptions, Sequence, Step, TransformerModel};
use metrale::engine::random::write_random_checkpoint;
use metrale::weights::loader::WeightDType;
use metrale::{Backend, BackendOptions, OpTime, open_backend};

use super::bench_probe::{
    ComputePeaks, NearProbe, compute_peaks, decode_bytes_per_token, median, peak_rss_bytes,
    read_bandwidth,
};
use super::bench_report::Report;

/// How weights are held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchDType {
    Bf16,
    F32,
}

impl BenchDType {
    fn dtype(self) -> DType {
        match self {
            BenchDType::Bf16 => DType::BF16,
            BenchDType::F32 => DType::F32,
        }
    }
}

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("source").args(["model", "config"])))]
pub struct Args {
    /// A model: a directory (config.json, *.safetensors), a .safetensors
    /// file in one, a .gguf file (quantized tensors stay quantized), or a
    /// Hugging Face hub id org/name in the local cache. Default (without
    /// --config): $METRALE_MODEL, else the bundled model.
    #[arg(short, long)]
    pub model: Option<PathBuf>,
    /// The revision of a hub id model: a branch, tag or commit hash
    /// (default: main).
    #[arg(long, value_name = "REV")]
    pub revision: Option<String>,
    /// A config.json alone: the model gets seeded random weights.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Prompt tokens per sequence (default: 512, or what the context leaves
    /// beside --gen-len where that is less, as on the bundled model).
    #[arg(long = "prompt-len", id = "prompt_len", value_name = "TOKENS")]
    pub prompt_len_flag: Option<usize>,
    /// The prompt length run: `--prompt-len`, else the default.
    #[arg(skip)]
    pub prompt_len: usize,
    /// Tokens generated per sequence after the prompt.
    #[arg(long, default_value_t = 32)]
    pub gen_len: usize,
    /// Sequences run together (decode steps batch them); a comma-separated
    /// list (1,4,16) runs each batch size in turn on the model loaded once.
    #[arg(long, value_delimiter = ',', num_args = 1, default_value = "1")]
    pub batch: Vec<usize>,
    #[command(flatten)]
    pub device: super::DeviceArgs,
    #[command(flatten)]
    pub dtype: super::DTypeArgs,
    /// CPU worker threads (0: one per core; at most 4 per core).
    #[arg(short, long, default_value_t = 0)]
    pub threads: usize,
    /// Force the CPU's bf16 matmul kernel: amx (Intel AMX tiles), dot
    /// (AVX512-BF16 dot products, what a Zen 4 host runs) or fma (f32 FMAs
    /// on the widened weights). Default: $METRALE_CPU_KERNEL, else the
    /// fastest this CPU runs. Refused where the CPU does not run it.
    #[arg(long, value_name = "amx|dot|fma", value_parser = metrale::parse_cpu_kernel)]
    pub cpu_kernel: Option<metrale::Bf16Kernel>,
    /// The context the run must fit: --prompt-len plus --gen-len at most
    /// this (default: the model's max_position_embeddings).
    #[arg(long, visible_alias = "max-model-len", value_name = "TOKENS")]
    pub ctx_size: Option<usize>,
    /// The most memory the model may take, e.g. 8GiB (default: what the
    /// host and its cgroup have available); checked before loading.
    #[arg(long, value_parser = super::parse_memory)]
    pub memory_limit: Option<usize>,
    /// The KV cache's element type (docs/ACCURACY.md measures each).
    #[arg(long, value_enum, default_value_t = super::KvDType::Auto)]
    pub kv_dtype: super::KvDType,
    #[command(flatten)]
    pub prefix: super::PrefixCacheArgs,
    /// How weights are held in memory (converted on load). Default: bf16,
    /// but a .gguf file's tensors as it stores them (quantized ones stay
    /// quantized and take the integer dot products).
    #[arg(long, value_enum)]
    pub weight_dtype: Option<BenchDType>,
    /// Seed of the random weights (with --config) and of the prompt.
    #[arg(short, long, default_value_t = 0)]
    pub seed: u64,
    /// Skip the probes (no roofline nor compute peak then). On a GPU the
    /// bandwidth probe times copies of device memory, on the CPU reads of
    /// host memory right before and after each decode window (the roofline
    /// takes their median); the compute probe (CPU only) times f32 FMA and, where
    /// the CPU has AVX512-BF16, bf16 dot-product loops.
    #[arg(long)]
    pub no_probe: bool,
    /// Measure the prefix cache instead: the time to first token of a
    /// prompt of this many shared tokens plus --suffix new ones, on a miss
    /// (a prefix never seen) and on hits (the same prefix, a new suffix),
    /// interleaved over --repeat rounds of one miss and three hits, with
    /// the prompt tokens the hits reused and recomputed.
    #[arg(long, value_name = "TOKENS", conflicts_with_all = ["batch", "prompt_len", "gen_len", "profile"])]
    pub shared_prefix: Option<usize>,
    /// New tokens after the shared prefix (with --shared-prefix).
    #[arg(
        long,
        value_name = "TOKENS",
        default_value_t = 16,
        requires = "shared_prefix"
    )]
    pub suffix: usize,
    /// Rounds of --shared-prefix (each a new prefix: one miss, then hits).
    #[arg(long, default_value_t = 5, requires = "shared_prefix")]
    pub repeat: usize,
    /// Print one JSON object instead of a table (an array of one per batch
    /// size for a list of them).
    #[arg(long)]
    pub json: bool,
    /// Also report the wall time of each op in the prefill and in the
    /// decode steps (`prefill_ops` / `decode_ops` with --json).
    #[arg(long)]
    pub profile: bool,
}

#[derive(clap::Args)]
pub struct ExportArgs {
    /// The config.json of the model.
    #[arg(long)]
    pub config: PathBuf,
    /// The directory to write (config.json, model.safetensors).
    #[arg(long)]
    pub out: PathBuf,
    /// How the weights are stored.
    #[arg(long, visible_alias = "dtype", value_enum, default_value_t = BenchDType::Bf16)]
    pub weight_dtype: BenchDType,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// What one run measured.
pub(super) struct Measured {
    pub(super) load_s: f64,
    pub(super) prefill_s: f64,
    pub(super) ttft_s: f64,
    pub(super) decode_s: f64,
    pub(super) decoded: usize,
    /// Per-op wall times (with --profile; empty otherwise).
    pub(super) prefill_ops: Vec<OpTime>,
    pub(super) decode_ops: Vec<OpTime>,
    /// The bandwidth probe's passes right before and after the decode
    /// window, bytes/s (empty: no probe next to it).
    pub(super) near_bandwidth: Vec<f64>,
}

pub fn export_random(args: ExportArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.config)
        .with_context(|| format!("reading {}", args.config.display()))?;
    let config = parse_config(&text, &args.config)?;
    write_random_checkpoint(
        &args.out,
        &text,
        &config,
        args.seed,
        args.weight_dtype.dtype(),
    )?;
    eprintln!(
        "wrote {} ({} parameters, {})",
        args.out.display(),
        config.parameter_count(),
        args.weight_dtype.dtype()
    );
    Ok(())
}

/// `--prompt-len` unless the context is shorter (PERF-TARGETS' prompt).
const DEFAULT_PROMPT_LEN: usize = 512;

/// The most sequences `bench --batch` runs together.
const MAX_BATCH: usize = 4096;

/// Refuses lengths and batches that are zero, would overflow, or do not fit
/// the model's context (`max_position_embeddings`, the limit `generate`
/// applies too); returns the KV blocks the run needs.
fn check_sizes(args: &Args, config: &ModelConfig, block_size: usize) -> Result<usize> {
    let (n, m) = (args.prompt_len, args.gen_len);
    if let Some(shared) = args.shared_prefix {
        let limit = args.ctx_size.unwrap_or(usize::MAX);
        let limit = limit.min(config.max_position_embeddings);
        return super::bench_prefix::check_sizes(args, shared, limit, block_size);
    }
    if n == 0 || args.batch.contains(&0) {
        bail!("--prompt-len and --batch must be at least 1");
    }
    let b = max_batch(args);
    if b > MAX_BATCH {
        bail!("--batch {b} is more than {MAX_BATCH} sequences");
    }
    let most = config.max_position_embeddings;
    let (limit, what) = match args.ctx_size {
        Some(0) => bail!("--ctx-size must be at least 1"),
        Some(ctx) if ctx > most => bail!(
            "--ctx-size {ctx} is more than the model's context of {most} positions \
             (max_position_embeddings)"
        ),
        Some(ctx) => (ctx, format!("the context of {ctx} positions (--ctx-size)")),
        None => (
            most,
            format!("the model's context of {most} positions (max_position_embeddings)"),
        ),
    };
    match n.checked_add(m) {
        Some(len) if len <= limit => {}
        _ => bail!("--prompt-len {n} plus --gen-len {m} tokens is more than {what}"),
    }
    // Within the context, so these products cannot overflow.
    Ok(b * ((n + m).div_ceil(block_size) + 1))
}

/// The largest of the --batch sizes: what the model's scheduler must hold.
fn max_batch(args: &Args) -> usize {
    args.batch.iter().copied().max().unwrap_or(1)
}

pub fn run(mut args: Args) -> Result<()> {
    if args.config.is_none() {
        let model = metrale::model_dir(args.model.as_deref(), args.revision.as_deref())?;
        args.model = Some(model);
    }
    let config = match (&args.model, &args.config) {
        (Some(dir), _) => metrale::engine::gguf::ModelSource::from_path(dir).config()?,
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            parse_config(&text, path)?
        }
        (None, None) => bail!("give --model DIR or --config FILE"),
    };
    args.prompt_len = args.prompt_len_flag.unwrap_or_else(|| {
        let context = args.ctx_size.unwrap_or(config.max_position_embeddings);
        match context.checked_sub(args.gen_len) {
            Some(room) if room > 0 => DEFAULT_PROMPT_LEN.min(room),
            // Let check_sizes say why nothing fits.
            _ => DEFAULT_PROMPT_LEN,
        }
    });
    let (b, n) = (max_batch(&args), args.prompt_len);
    let kv_blocks = check_sizes(&args, &config, ModelOptions::default().kv_block_size)?;
    let backend = open_backend(
        args.device.device,
        &BackendOptions {
            threads: args.threads,
            memory_limit: args.memory_limit,
            bf16_dot_products: args.dtype.bf16_dot_products(),
            bf16_ssm_state: args.dtype.bf16_ssm_state(),
            op_profile: args.profile,
            cpu_kernel: args.cpu_kernel,
        },
    )?;
    // Host threads (the bandwidth probe reads with as many).
    let threads = backend.threads().unwrap_or(1);
    // On the CPU the bandwidth is probed next to each decode window.
    let mut near = match (args.no_probe, backend.threads()) {
        (false, Some(threads)) => NearProbe::new(threads),
        _ => None,
    };
    // The accelerator, before the model takes its memory.
    let device_info = backend.device_info();
    let bf16_dot = backend.bf16_dot_products();
    let bf16_kernel = backend.bf16_kernel();
    let int8_tiles = backend.int8_tiles();
    let gpu = backend.gpu().clone();
    let prompt_tokens = args
        .shared_prefix
        .map_or(n, |s| s.saturating_add(args.suffix));
    let max_batch_tokens = prompt_tokens.min(2048).max(b);
    let mut options = ModelOptions {
        max_batch_tokens,
        max_seqs: b,
        kv_blocks,
        cuda_graphs: !args.device.no_cuda_graphs,
        prefix_cache: args.prefix.options(),
        ..ModelOptions::default()
    };
    args.dtype.apply(args.kv_dtype, &mut options);
    let mut dtype = args.weight_dtype.unwrap_or(BenchDType::Bf16).dtype();
    // Bytes per element of a tensor the store does not know (none today).
    let fallback_size = dtype.size_of();
    let start = Instant::now();
    let mut as_stored = false;
    let (model, name) = match (&args.model, &args.config) {
        (Some(dir), _) => {
            let gguf = matches!(
                metrale::engine::gguf::ModelSource::from_path(dir),
                metrale::engine::gguf::ModelSource::Gguf(_)
            );
            let wd = match args.weight_dtype {
                Some(BenchDType::Bf16) => WeightDType::BF16,
                Some(BenchDType::F32) => WeightDType::F32,
                None if gguf || args.dtype.quant.is_some() => {
                    as_stored = true;
                    WeightDType::AsStored
                }
                None => WeightDType::BF16,
            };
            // A checkpoint directory or a GGUF file (its quantized tensors
            // stay quantized); --quant quantizes float weights on load.
            let source = metrale::engine::gguf::ModelSource::from_path(dir);
            let format = metrale::WeightFormat {
                dtype: wd,
                quant: args.dtype.quant,
            };
            let model = TransformerModel::load_source(
                &source,
                gpu.clone(),
                options,
                format,
                &mut super::load_progress(),
            )
            .with_context(|| format!("loading {}", dir.display()))?;
            (model, dir.display().to_string())
        }
        (None, Some(_)) if args.dtype.quant.is_some() => {
            bail!("--quant quantizes a checkpoint's weights on load: give --model, not --config")
        }
        (None, Some(path)) => (
            TransformerModel::random(gpu.clone(), config, options, args.seed, dtype)?,
            path.display().to_string(),
        ),
        (None, None) => bail!("give --model DIR or --config FILE"),
    };
    let load_s = start.elapsed().as_secs_f64();
    if let Some(shared) = args.shared_prefix {
        let config = model.config().clone();
        let measured = super::bench_prefix::measure(model, &args, shared)?;
        print!(
            "{}",
            super::bench_prefix::report(&config, &name, &args, shared, &measured)
        );
        return Ok(());
    }
    let op_times = || backend.take_op_times().unwrap_or_default();
    // Each batch size in turn (stopping at the first that fails).
    let measured: Result<Vec<Measured>> = args
        .batch
        .iter()
        .map(|&b| measure(&model, &args, b, load_s, &op_times, near.as_mut()))
        .collect();
    let config = model.config().clone();
    let weight_bytes = model.weight_store().map_or(0, |s| s.bytes());
    if let (true, Some(store)) = (as_stored, model.weight_store()) {
        // As a GGUF file stores them: the dtype that holds most of the
        // bytes (Q6_K or Q4_K for a Q4_K_M file, whose tied head is Q6_K).
        let mut by_dtype: Vec<(DType, usize)> = Vec::new();
        for t in store.names().filter_map(|n| store.get(n).ok()) {
            match by_dtype.iter_mut().find(|(d, _)| *d == t.dtype()) {
                Some((_, b)) => *b += t.bytes(),
                None => by_dtype.push((t.dtype(), t.bytes())),
            }
        }
        if let Some(&(d, _)) = by_dtype.iter().max_by_key(|(_, b)| *b) {
            dtype = d;
        }
    }
    // What a decode step streams, from the tensors as loaded (a quantized
    // GGUF's blocks, f32 norms), not parameters times --weight-dtype.
    let decode_bytes = decode_bytes_per_token(
        &config,
        &|name| {
            model
                .weight_store()
                .and_then(|s| s.get(name).ok())
                .map(|t| t.bytes())
        },
        fallback_size,
    );
    // The caches a decode step also moves (the memory floor; a backend
    // that cannot lay them out gets no floor).
    let cache = super::bench_probe::cache_traffic(&config, &*gpu, model.options()).ok();
    // Decode graphs: whether they were on, and what they did (warm-up included).
    let graphs = gpu
        .graphs_supported()
        .then(|| (options.cuda_graphs, model.graph_stats()));
    let shutdown = model.shutdown();
    let measured = measured?;
    shutdown?;
    // Before the probe, whose buffer would count otherwise.
    let peak_rss = near
        .as_ref()
        .map_or_else(peak_rss_bytes, NearProbe::peak_rss);
    // The bandwidth once more only where a decode window had no probe
    // next to it.
    let probed = measured.iter().all(|m| !m.near_bandwidth.is_empty());
    let (bandwidth, compute) = probe(&args, &backend, threads, !probed);
    let reports: Vec<Report> = args
        .batch
        .iter()
        .zip(&measured)
        .map(|(&b, m)| {
            // The probes next to this decode where there were some.
            let bandwidth = match m.near_bandwidth.is_empty() {
                true => bandwidth,
                false => Some(median(m.near_bandwidth.clone())),
            };
            let mut report = Report::new(
                &config,
                name.clone(),
                &args,
                b,
                threads,
                dtype,
                weight_bytes,
                m,
                bandwidth,
            );
            report.peak_rss = peak_rss;
            report.decode_bytes = decode_bytes;
            report.cache = cache;
            report.bf16_dot = bf16_dot;
            report.bf16_kernel = bf16_kernel;
            report.int8_tiles = int8_tiles;
            report.bf16_state = args.dtype.bf16_ssm_state();
            report.compute = compute;
            report.device = backend.device();
            report.device_info = device_info.clone();
            report.graphs = graphs;
            report
        })
        .collect();
    print!("{}", super::bench_report::render(&reports, args.json)?);
    Ok(())
}

/// The machine's peaks: the memory bandwidth (the device's on a GPU; the
/// host's where `host_bandwidth`, when some decode had no probe next to
/// it) and, on the CPU, the arithmetic peaks; none with --no-probe.
fn probe(
    args: &Args,
    backend: &Backend,
    threads: usize,
    host_bandwidth: bool,
) -> (Option<f64>, Option<ComputePeaks>) {
    if args.no_probe {
        return (None, None);
    }
    match backend.device_bandwidth() {
        None => (
            host_bandwidth.then(|| read_bandwidth(threads)),
            Some(compute_peaks(threads)),
        ),
        Some(Ok(bw)) => (Some(bw), None),
        Some(Err(e)) => {
            eprintln!("metrale bench: the device bandwidth probe failed, no roofline: {e:#}");
            (None, None)
        }
    }
}

/// Runs `b` sequences: their prompts, then --gen-len batched decode steps.
/// `op_times` returns (and resets) the backend's per-op times; `near`, the
/// bandwidth probe to take either side of the decode window.
fn measure(
    model: &TransformerModel,
    args: &Args,
    b: usize,
    load_s: f64,
    op_times: &dyn Fn() -> Vec<OpTime>,
    mut near: Option<&mut NearProbe>,
) -> Result<Measured> {
    let (n, m) = (args.prompt_len, args.gen_len);
    let vocab = model.config().vocab_size as u64;
    let chunk = model.options().max_batch_tokens;
    // Seeded prompts (an LCG: any ids will do, they only need to be valid).
    let mut state = args
        .seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next_id = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 33) % vocab) as u32
    };
    let prompts: Vec<Vec<u32>> = (0..b)
        .map(|_| (0..n).map(|_| next_id()).collect())
        .collect();
    // Warm-up: thread pool, page faults of the scratch, first-call costs.
    {
        let mut seq = model.new_sequence()?;
        let warm = &prompts[0][..n.min(16)];
        let r = model
            .forward(&mut [Step {
                seq: &mut seq,
                tokens: warm,
                logits: Logits::Last,
            }])
            .and_then(|_| {
                model.forward(&mut [Step {
                    seq: &mut seq,
                    tokens: &warm[..1],
                    logits: Logits::Last,
                }])
            });
        model.free_sequence(seq);
        r?;
    }
    let mut seqs: Vec<Sequence> = Vec::with_capacity(b);
    let result = (|| {
        for _ in 0..b {
            seqs.push(model.new_sequence()?);
        }
        let mut next: Vec<u32> = vec![0; b];
        op_times(); // Not the warm-up's.
        let start = Instant::now();
        let mut ttft_s = 0.0;
        for (i, (seq, prompt)) in seqs.iter_mut().zip(&prompts).enumerate() {
            let pieces = prompt.chunks(chunk).count();
            for (p, piece) in prompt.chunks(chunk).enumerate() {
                let want = if p + 1 == pieces {
                    Logits::Last
                } else {
                    Logits::None
                };
                let out = model.forward(&mut [Step {
                    seq,
                    tokens: piece,
                    logits: want,
                }])?;
                if p + 1 == pieces {
                    next[i] = argmax(&out[0]);
                }
            }
            if i == 0 {
                ttft_s = start.elapsed().as_secs_f64();
            }
        }
        let prefill_s = start.elapsed().as_secs_f64();
        let prefill_ops = op_times();
        let mut near_bandwidth = near.as_deref_mut().map(NearProbe::read).unwrap_or_default();
        let start = Instant::now();
        for _ in 0..m {
            let ids = next.clone();
            let mut steps: Vec<Step<'_>> = seqs
                .iter_mut()
                .zip(&ids)
                .map(|(seq, id)| Step {
                    seq,
                    tokens: std::slice::from_ref(id),
                    logits: Logits::Last,
                })
                .collect();
            let out = model.forward(&mut steps)?;
            for (n, o) in next.iter_mut().zip(&out) {
                *n = argmax(o);
            }
        }
        let decode_s = start.elapsed().as_secs_f64();
        if let Some(near) = near.as_deref_mut() {
            near_bandwidth.extend(near.read());
        }
        Ok(Measured {
            load_s,
            prefill_s,
            ttft_s,
            decode_s,
            decoded: b * m,
            prefill_ops,
            decode_ops: op_times(),
            near_bandwidth,
        })
    })();
    for seq in seqs {
        model.free_sequence(seq);
    }
    result
}

fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .fold((0usize, f32::NEG_INFINITY), |best, (i, &x)| {
            if x > best.1 { (i, x) } else { best }
        })
        .0 as u32
}
