//! `metrale serve` (also the `metrale-serve` binary of the
//! metrale-server package): an OpenAI-compatible HTTP server for one model.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::engine::chat::tools::ToolCallFormat;
use crate::flags::{ArithDType, KvDType, PrefixCacheArgs, StateDType, parse_memory};
use crate::server::{AppState, ConnConfig, HostPolicy, Limits, ServerConfig};
use crate::{Device, EngineConfig, Generator, LoadOptions};
use anyhow::{Context, Result};
use clap::Parser;

/// The blocking pool's size (tokenizing and template rendering).
const BLOCKING_THREADS: usize = 8;

#[derive(Parser, Debug)]
#[command(
    name = "metrale serve",
    bin_name = "metrale serve",
    version,
    about = "Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /metrics)"
)]
struct Args {
    /// Model: a directory (config.json, *.safetensors, tokenizer.json), a
    /// .safetensors file in one, or a Hugging Face hub id org/name in the
    /// local cache (HF_HUB_CACHE, else HF_HOME/hub, else
    /// ~/.cache/huggingface/hub; nothing is downloaded). Default:
    /// $METRALE_MODEL, else the model bundled into the binary (a tiny hybrid
    /// trained on Debian's fortune quotations).
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// The revision of a hub id --model: a branch, tag or commit hash
    /// (default: main).
    #[arg(long, value_name = "REV")]
    revision: Option<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on every /v1 route.
    #[arg(long, value_name = "KEY")]
    api_key: Option<String>,
    /// The model's id in /v1/models and requests (default: the hub id
    /// --model names, else the directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Where to run: cpu, auto (the best backend this build has: with the
    /// `cuda` feature CUDA device 0 when one opens, else the CPU), or
    /// cuda / cuda:N (needs a build with the `cuda` feature).
    #[arg(long, value_name = crate::flags::DEVICE_VALUES, default_value_t = Device::Auto)]
    device: Device,
    /// CPU worker threads (0: one per core).
    #[arg(short, long, default_value_t = 0)]
    threads: usize,
    /// The context: the most tokens one request (prompt plus output) may
    /// hold (default: the model's max_position_embeddings, within the KV
    /// cache).
    #[arg(long, visible_alias = "max-model-len", value_name = "TOKENS")]
    ctx_size: Option<usize>,
    /// The arithmetic (docs/ACCURACY.md measures each choice).
    #[arg(long, value_enum, default_value_t = ArithDType::Auto)]
    dtype: ArithDType,
    /// Quantize the float weights on load, as llama.cpp's llama-quantize
    /// would: q8_0, q4_k_m, q5_k_m, q6_k (the `_m` mixes choose each
    /// tensor's type by llama.cpp's rules), or q4_0, q4_1, q5_0, q5_1,
    /// q4_k_s, q5_k_s. Quantized weights run on the CPU.
    #[arg(long, value_parser = crate::FileType::parse_quantized, value_name = "TYPE")]
    quant: Option<crate::FileType>,
    /// The most memory the model may take, e.g. 8GiB (default: what the
    /// host and its cgroup have available); checked before loading.
    #[arg(long, value_parser = parse_memory)]
    memory_limit: Option<usize>,
    /// The KV cache's element type (docs/ACCURACY.md measures each).
    #[arg(long, value_enum, default_value_t = KvDType::Auto)]
    kv_dtype: KvDType,
    /// How the Mamba-2 and gated-delta layers' running states are held
    /// (docs/ACCURACY.md measures each).
    #[arg(long, value_enum, default_value_t = StateDType::Auto)]
    ssm_state_dtype: StateDType,
    #[command(flatten)]
    prefix: PrefixCacheArgs,
    /// Most requests the engine runs at once (sequences in the batch).
    #[arg(long)]
    max_seqs: Option<usize>,
    /// Most requests waiting for their first token; more are answered 429
    /// (a request of n choices counts n).
    #[arg(long, default_value_t = 256)]
    max_waiting: usize,
    #[command(flatten)]
    limits: LimitArgs,
    /// The syntax the model writes tool calls in: hermes, qwen3_xml,
    /// llama3_json, mistral, granite, nemotron, pythonic (default: detected
    /// from the chat template, else the model type; requests with tools
    /// are refused when neither shows one).
    #[arg(long, value_name = "NAME", value_parser = parse_tool_format)]
    tool_call_parser: Option<ToolCallFormat>,
    /// Log more to stderr (-v info, -vv debug).
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
    /// Only errors on stderr.
    #[arg(short, long, conflicts_with = "verbose")]
    quiet: bool,
}

/// What a request and a connection may cost, and for how long.
#[derive(clap::Args, Debug)]
struct LimitArgs {
    /// Most tokens one request may ask for: prompts × n × (prompt tokens +
    /// max_tokens); more is answered 400.
    #[arg(long, value_name = "TOKENS", default_value_t = Limits::default().max_request_tokens)]
    max_request_tokens: u64,
    /// Most bytes one response may imply: n × max_tokens × (1 + top
    /// log-probabilities) × 80 bytes; more is answered 400. Default 32MiB.
    #[arg(long, value_name = "SIZE", value_parser = parse_memory)]
    max_response_bytes: Option<usize>,
    /// Most prompt bytes held by requests not yet generating (being
    /// tokenized or queued), all together; more is answered 429. Default
    /// 64MiB.
    #[arg(long, value_name = "SIZE", value_parser = parse_memory)]
    max_queued_prompt_bytes: Option<usize>,
    /// Largest request body; more is answered 413. Default 4MiB.
    #[arg(long, value_name = "SIZE", value_parser = parse_memory)]
    max_body_bytes: Option<usize>,
    /// Most connections served at once; one more is answered 503 (default:
    /// 4096, or the descriptor limit less 64 when that is lower; the soft
    /// descriptor limit is first raised to the hard one, at most 65536).
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// Seconds a client has to send a request's headers, counted from the
    /// connection's opening or the end of its previous response (so also
    /// the idle keep-alive timeout); then the connection is closed.
    #[arg(long, value_name = "SECS", default_value_t = 15.0)]
    header_timeout: f64,
    /// Seconds a request's body may take to arrive; then 408.
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    body_timeout: f64,
    /// Seconds a response may wait on a client that reads nothing; then the
    /// connection is closed and its requests cancelled.
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    write_timeout: f64,
    /// Seconds requests in flight may take to finish after SIGTERM or
    /// SIGINT; then every connection left is closed (a second signal closes
    /// them at once).
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    shutdown_timeout: f64,
    /// Host names the Host header may carry (comma-separated, any port; `*`
    /// for any). Default: when bound to a loopback address, loopback names
    /// only (localhost, 127.0.0.0/8, [::1]: a web page cannot reach the
    /// server by DNS rebinding); otherwise any.
    #[arg(long, value_name = "HOSTS")]
    allowed_hosts: Option<String>,
}

impl LimitArgs {
    fn limits(&self) -> Limits {
        let d = Limits::default();
        Limits {
            max_request_tokens: self.max_request_tokens,
            max_response_bytes: self
                .max_response_bytes
                .map_or(d.max_response_bytes, |b| b as u64),
            max_queued_prompt_bytes: self
                .max_queued_prompt_bytes
                .unwrap_or(d.max_queued_prompt_bytes),
        }
    }

    fn connections(&self) -> Result<ConnConfig> {
        Ok(ConnConfig {
            max_connections: self
                .max_connections
                .unwrap_or_else(crate::server::listen::default_max_connections),
            header_timeout: seconds("--header-timeout", self.header_timeout)?,
            write_timeout: seconds("--write-timeout", self.write_timeout)?,
            shutdown_timeout: seconds("--shutdown-timeout", self.shutdown_timeout)?,
        })
    }
}

fn parse_tool_format(name: &str) -> std::result::Result<ToolCallFormat, String> {
    ToolCallFormat::from_name(name).ok_or_else(|| {
        let names: Vec<&str> = ToolCallFormat::ALL.iter().map(|f| f.name()).collect();
        format!("not a tool-call format; one of {}", names.join(", "))
    })
}

/// A positive, finite number of seconds.
fn seconds(flag: &str, secs: f64) -> Result<Duration> {
    if !(secs.is_finite() && secs > 0.0 && secs < 1e9) {
        anyhow::bail!("{flag} {secs} is not a positive number of seconds");
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Runs the server with the command line `args` (the first is the
/// program's name, as in `std::env::args_os`): what `metrale serve` and
/// `metrale-serve` do. A usage error exits the process, as clap does.
pub fn main<I, T>(args: I) -> std::process::ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let args = Args::parse_from(args);
    init_tracing(args.verbose, args.quiet);
    match run(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", crate::format_error(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<()> {
    let dir = crate::model_dir(args.model.as_deref(), args.revision.as_deref())?;
    // A hub id is the model's name, as vLLM serves it (a snapshot
    // directory's name is a commit hash); the bundled model is `default`
    // (its cache directory's name carries a content hash).
    let bundled =
        args.model.is_none() && std::env::var_os(crate::MODEL_ENV).is_none_or(|v| v.is_empty());
    let hub_name = match &args.model {
        Some(spec) if !spec.exists() => spec.to_str().map(str::to_string),
        Some(_) => None,
        None => bundled.then(|| "default".to_string()),
    };
    let mut options = LoadOptions {
        device: args.device,
        threads: args.threads,
        memory_limit: args.memory_limit,
        bf16_dot_products: args.dtype != ArithDType::F32,
        bf16_ssm_state: args.ssm_state_dtype.is_bf16(args.dtype != ArithDType::F32),
        quant: args.quant,
        ..LoadOptions::default()
    };
    options.model.kv_dtype = args.kv_dtype.dtype();
    options.model.kv_follows_weights = args.kv_dtype.follows_weights(args.dtype != ArithDType::F32);
    // f32 weights keep f32 states under `auto`, as they keep an f32 KV cache.
    options.model.ssm_state_follows_weights =
        args.ssm_state_dtype == StateDType::Auto && args.dtype != ArithDType::F32;
    options.model.prefix_cache = args.prefix.options();
    if let Some(n) = args.max_seqs {
        options.model.max_seqs = n;
    }
    let mut engine = EngineConfig::default();
    if let Some(ctx) = args.ctx_size {
        let most = crate::engine::gguf::ModelSource::from_path(&dir)
            .config()?
            .max_position_embeddings;
        if ctx == 0 || ctx > most {
            anyhow::bail!(
                "--ctx-size {ctx} is not within 1 and the model's context of {most} positions \
                 (max_position_embeddings)"
            );
        }
        engine.max_model_len = ctx;
        // The KV cache holds at least one whole context.
        let blocks = ctx.div_ceil(options.model.kv_block_size);
        options.model.kv_blocks = options.model.kv_blocks.max(blocks);
    }
    crate::server::listen::raise_descriptor_limit();
    let connections = args.limits.connections()?;
    let body_timeout = seconds("--body-timeout", args.limits.body_timeout)?;
    if args.limits.max_connections == Some(0) {
        anyhow::bail!("--max-connections 0 would answer nobody");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        // Tokenizing and template rendering run there, bounded in bytes by
        // --max-queued-prompt-bytes; a few threads keep them off the
        // workers that answer connections.
        .max_blocking_threads(BLOCKING_THREADS)
        .build()?;
    let listener = runtime.block_on(async {
        tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("listening on {}:{}", args.host, args.port))
    })?;
    let bound = listener.local_addr()?;
    let generator = Generator::load(&dir, &options, engine, &mut |_| {})?;
    let config = ServerConfig {
        served_model_name: args.served_model_name.clone().or(hub_name),
        api_key: args.api_key.clone(),
        max_waiting: args.max_waiting,
        body_limit: args
            .limits
            .max_body_bytes
            .unwrap_or(ServerConfig::default().body_limit),
        body_timeout,
        limits: args.limits.limits(),
        hosts: HostPolicy::new(bound.ip(), args.limits.allowed_hosts.as_deref()),
        tool_call_parser: args.tool_call_parser,
    };
    let state = Arc::new(AppState::new(generator, config)?);
    runtime.block_on(async {
        eprintln!(
            "metrale serve: {} (model `{}`, context {} tokens) on http://{}",
            dir.display(),
            state.model_name,
            state.context_limit,
            bound
        );
        let app = crate::server::router(state.clone());
        let (first, second) = crate::server::shutdown_signals();
        crate::server::serve(listener, app, connections, first, second).await?;
        eprintln!("metrale serve: shutting down");
        anyhow::Ok(())
    })?;
    // The requests have ended or been closed; the last handle stops the
    // engine thread.
    runtime.shutdown_timeout(Duration::from_secs(1));
    match Arc::try_unwrap(state) {
        Ok(state) => state.handle.shutdown(),
        Err(_) => Ok(()),
    }
}

fn init_tracing(verbose: u8, quiet: bool) {
    let filter = match (quiet, verbose) {
        (true, _) => tracing_subscriber::EnvFilter::new("error"),
        (false, 0) => tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        (false, 1) => tracing_subscriber::EnvFilter::new("info"),
        _ => tracing_subscriber::EnvFilter::new("debug"),
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
