//! `metrale generate`: streams a prompt's continuation to stdout, with a
//! summary (tokens/s, time to first token) on stderr. Also the model and
//! sampling options `metrale chat` shares.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use metrale::{
    EngineConfig, Generator, LoadOptions, SamplingOverrides, SamplingParams, StreamEvent, Timings,
};
use metrale_model_engine::sampling::Finish;

const DEFAULT_MODEL_NOTE: &str = "Model: a directory (config.json, *.safetensors, tokenizer.json), a .safetensors file in one, a .gguf file (F32, F16, BF16 or quantized Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K, Q6_K tensors; quantized ones on the CPU), or a Hugging Face hub id org/name in the local cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub; nothing is downloaded). Default: $METRALE_MODEL, else the model bundled into this binary (models/default, a tiny hybrid trained on Debian's fortune quotations: short, quotation-like English, no knowledge; unpacked once into $METRALE_CACHE_DIR, else $XDG_CACHE_HOME/metrale, else ~/.cache/metrale)";

/// Which model to load and how.
#[derive(clap::Args, Debug)]
pub struct ModelArgs {
    #[arg(short, long, help = DEFAULT_MODEL_NOTE)]
    pub model: Option<PathBuf>,
    /// The revision of a hub id --model: a branch, tag or commit hash
    /// (default: main).
    #[arg(long, value_name = "REV")]
    pub revision: Option<String>,
    #[command(flatten)]
    pub device: super::DeviceArgs,
    #[command(flatten)]
    pub dtype: super::DTypeArgs,
    /// CPU worker threads (0: one per core; at most 4 per core).
    #[arg(short, long, default_value_t = 0)]
    pub threads: usize,
    /// The context: the most tokens a conversation (prompt plus reply) may
    /// hold; the KV cache is sized for it (default: 4096, or the model's
    /// max_position_embeddings if smaller).
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
}

impl ModelArgs {
    /// Loads the model for one conversation at a time.
    pub fn load(&self) -> Result<Generator> {
        let dir = metrale::model_dir(self.model.as_deref(), self.revision.as_deref())?;
        let mut options = LoadOptions {
            device: self.device.device,
            threads: self.threads,
            memory_limit: self.memory_limit,
            bf16_dot_products: self.dtype.bf16_dot_products(),
            bf16_ssm_state: self.dtype.bf16_ssm_state(),
            quant: self.dtype.quant,
            ..LoadOptions::default()
        };
        options.model.max_seqs = 1;
        self.dtype.apply(self.kv_dtype, &mut options.model);
        options.model.cuda_graphs = !self.device.no_cuda_graphs;
        options.model.prefix_cache = self.prefix.options();
        let mut config = EngineConfig::default();
        if let Some(ctx) = self.ctx_size {
            check_ctx_size(ctx, &dir)?;
            options.model.kv_blocks = ctx.div_ceil(options.model.kv_block_size);
            config.max_model_len = ctx;
        }
        tracing::debug!("loading {} with {options:?}, {config:?}", dir.display());
        Generator::load(&dir, &options, config, &mut super::load_progress())
    }
}

/// `--ctx-size`: at least 1 and at most the model's
/// `max_position_embeddings` (vLLM refuses a longer `--max-model-len` too).
pub fn check_ctx_size(ctx: usize, dir: &std::path::Path) -> Result<()> {
    if ctx == 0 {
        anyhow::bail!("--ctx-size must be at least 1");
    }
    let config = metrale::engine::gguf::ModelSource::from_path(dir).config()?;
    let most = config.max_position_embeddings;
    if ctx > most {
        anyhow::bail!(
            "--ctx-size {ctx} is more than the model's context of {most} positions \
             (max_position_embeddings)"
        );
    }
    Ok(())
}

/// Sampling options. Those not given are the checkpoint's defaults: its
/// generation_config.json (temperature, top_p, top_k, min_p,
/// repetition_penalty, max_new_tokens; `do_sample: false` is greedy), else
/// temperature 1 and top_p 1 ([`metrale::GenerationDefaults`]); `-v` logs
/// which applied.
#[derive(clap::Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Most tokens to generate (fewer if the context runs out first).
    /// Default: the checkpoint's max_new_tokens, else 256.
    #[arg(short = 'n', long)]
    pub max_tokens: Option<usize>,
    /// Softmax temperature; 0 means greedy. Default: the checkpoint's
    /// (generation_config.json), else 1.
    #[arg(long, allow_negative_numbers = true)]
    pub temperature: Option<f32>,
    /// Keep only the K most likely tokens (0 or -1: off). Default: the
    /// checkpoint's, else off.
    #[arg(long, value_parser = parse_top_k, allow_negative_numbers = true)]
    pub top_k: Option<usize>,
    /// Keep the most likely tokens up to this total probability (1: off).
    /// Default: the checkpoint's, else 1.
    #[arg(long, allow_negative_numbers = true)]
    pub top_p: Option<f32>,
    /// Drop tokens less likely than this times the most likely one (0:
    /// off). Default: the checkpoint's, else off.
    #[arg(long, allow_negative_numbers = true)]
    pub min_p: Option<f32>,
    /// Penalise tokens already in the prompt or output (1: off). Default:
    /// the checkpoint's, else off.
    #[arg(long, allow_negative_numbers = true)]
    pub repetition_penalty: Option<f32>,
    /// Subtracted once from the logit of every token already generated
    /// (OpenAI's presence penalty); in [-2, 2], 0: off.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated
    /// (OpenAI's frequency penalty); in [-2, 2], 0: off.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Random seed, for reproducible sampling.
    #[arg(short, long)]
    pub seed: Option<u64>,
    /// Stop before this text (repeatable).
    #[arg(long = "stop", value_name = "TEXT")]
    pub stop: Vec<String>,
    /// Keep going past the model's end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Hold the output to the JSON schema in FILE (a structured output:
    /// tokens that could not continue a valid instance are never sampled;
    /// JSON on one line, `", "` and `": "` separators).
    #[arg(long, value_name = "FILE", conflicts_with = "grammar")]
    pub json_schema: Option<std::path::PathBuf>,
    /// Hold the output to the grammar in FILE: Lark (llguidance's dialect:
    /// `start` is the whole output; `%json {...}` embeds a schema) or
    /// llama.cpp's GBNF (`root ::= ...` is the whole output).
    #[arg(long, value_name = "FILE")]
    pub grammar: Option<std::path::PathBuf>,
}

impl SamplingArgs {
    /// The `--json-schema` or `--grammar` file's constraint, compiled once
    /// here so that a bad file is an error naming it before any generation.
    fn constraint(&self, generator: &Generator) -> Result<Option<metrale::OutputConstraint>> {
        use anyhow::Context as _;
        use metrale::OutputConstraint;
        let (path, constraint) = match (&self.json_schema, &self.grammar) {
            (Some(path), _) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading the JSON schema {}", path.display()))?;
                let schema = serde_json::from_str(&text).with_context(|| {
                    format!("the JSON schema {} is not valid JSON", path.display())
                })?;
                (path, OutputConstraint::JsonSchema(schema))
            }
            (None, Some(path)) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading the grammar {}", path.display()))?;
                (path, OutputConstraint::Lark(text))
            }
            (None, None) => return Ok(None),
        };
        let compiled = generator
            .engine()
            .intake()
            .grammars()
            .and_then(|g| g.compile(&constraint));
        if let Err(e) = compiled {
            anyhow::bail!("{}: {e}", path.display());
        }
        Ok(Some(constraint))
    }
}

/// `--top-k`: a count, or -1 for off as vLLM spells it.
fn parse_top_k(text: &str) -> Result<usize, String> {
    match text.trim() {
        "-1" => Ok(0),
        t => t
            .parse()
            .map_err(|_| format!("{t:?} is not a token count (0 or -1 turns top-k off)")),
    }
}

/// The most tokens `generate` and `chat` produce when neither a flag nor
/// the checkpoint says.
pub const DEFAULT_MAX_TOKENS: usize = 256;

impl SamplingArgs {
    /// The flags given, as overrides of the checkpoint's defaults.
    pub fn overrides(&self) -> SamplingOverrides {
        SamplingOverrides {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            max_tokens: self.max_tokens,
        }
    }

    /// The parameters for a prompt of `prompt_len` tokens: the flags over
    /// the checkpoint's defaults, `max_tokens` (else 256) cut to what the
    /// context leaves.
    pub fn params(&self, generator: &Generator, prompt_len: usize) -> Result<SamplingParams> {
        let room = generator
            .engine()
            .context_limit()
            .saturating_sub(prompt_len);
        if room == 0 {
            anyhow::bail!(
                "the prompt ({prompt_len} tokens) fills the model's whole context ({})",
                generator.engine().context_limit()
            );
        }
        let overrides = self.overrides();
        let mut params = generator.params(&overrides);
        tracing::info!(
            "sampling: {}",
            generator.defaults().explain(&overrides, &params)
        );
        params.max_tokens = Some(params.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS).min(room));
        params.seed = self.seed;
        params.presence_penalty = self.presence_penalty;
        params.frequency_penalty = self.frequency_penalty;
        params.stop = self.stop.clone();
        params.ignore_eos = self.ignore_eos;
        params.constraint = self.constraint(generator)?;
        // The engine's wording is a server's ("invalid request"); here the
        // flags are at fault.
        params.validate().map_err(|e| match e {
            metrale::engine::EngineError::Request(why) => {
                anyhow::anyhow!("invalid sampling flags: {why}")
            }
            e => e.into(),
        })?;
        Ok(params)
    }
}

#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["prompt", "prompt_flag", "file"])))]
pub struct Args {
    /// The prompt (its continuation is printed, not the prompt); `-` reads
    /// it from stdin. A prompt that starts with a dash goes after `--` or
    /// with `-p`, so that a mistyped option is an error, not a prompt.
    #[arg(value_name = "PROMPT")]
    pub prompt: Option<String>,
    /// The prompt, as an option (`-` reads it from stdin).
    #[arg(
        short = 'p',
        long = "prompt",
        value_name = "PROMPT",
        allow_hyphen_values = true
    )]
    pub prompt_flag: Option<String>,
    /// Read the prompt from a file (`-`: stdin).
    #[arg(short = 'f', long, value_name = "PATH")]
    pub file: Option<PathBuf>,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

impl Args {
    /// The prompt's text: given, or read from the file or stdin (`-`).
    /// Read before the model loads, so a missing file fails fast.
    fn prompt_text(&self) -> Result<String> {
        let stdin = || -> Result<String> {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)
                .context("reading the prompt from stdin")?;
            Ok(text)
        };
        match (&self.prompt, &self.prompt_flag, &self.file) {
            (Some(p), _, _) | (None, Some(p), _) if p == "-" => stdin(),
            (Some(p), _, _) | (None, Some(p), _) => Ok(p.clone()),
            (None, None, Some(path)) if path.as_os_str() == "-" => stdin(),
            (None, None, Some(path)) => std::fs::read_to_string(path)
                .with_context(|| format!("reading the prompt from {}", path.display())),
            (None, None, None) => anyhow::bail!("give a prompt, -p PROMPT or --file PATH"),
        }
    }
}

pub fn run(args: Args) -> Result<()> {
    let prompt = args.prompt_text()?;
    if prompt.is_empty() {
        anyhow::bail!("the prompt is empty");
    }
    let mut generator = args.model.load()?;
    let result = generate(&mut generator, &args, &prompt);
    let shutdown = generator.shutdown();
    result?;
    shutdown
}

fn generate(generator: &mut Generator, args: &Args, prompt: &str) -> Result<()> {
    let ids = generator.encode(prompt)?;
    let params = args.sampling.params(generator, ids.len())?;
    let mut out = std::io::stdout().lock();
    let (text, finish, timings) = stream_to(generator, ids, &params, &mut out)?;
    if !text.ends_with('\n') {
        writeln!(out)?;
    }
    out.flush()?;
    if !super::quiet() {
        eprintln!("{}", summary(&timings, &finish));
    }
    Ok(())
}

/// Streams a generation to `out` as it comes; returns its text, why it
/// ended and its timings.
pub fn stream_to(
    generator: &mut Generator,
    ids: Vec<u32>,
    params: &SamplingParams,
    out: &mut dyn Write,
) -> Result<(String, Finish, Timings)> {
    let mut text = String::new();
    for event in generator.stream_ids(ids, params)? {
        match event? {
            StreamEvent::Token { text: delta, .. } => {
                out.write_all(delta.as_bytes())
                    .context("writing to stdout")?;
                out.flush().context("writing to stdout")?;
                text.push_str(&delta);
            }
            // Never asked for here.
            StreamEvent::PromptLogprobs { .. } => {}
            StreamEvent::Finished {
                reason, timings, ..
            } => return Ok((text, reason, timings)),
        }
    }
    anyhow::bail!("the generation ended without finishing")
}

/// The stderr summary line.
pub fn summary(timings: &Timings, finish: &Finish) -> String {
    let why = match finish {
        Finish::Eos(_) => "end of sequence".to_owned(),
        Finish::StopToken(id) => format!("stop token {id}"),
        Finish::StopString(s) => format!("stop string {s:?}"),
        Finish::Length => "length".to_owned(),
        Finish::Grammar => "the output completed its grammar".to_owned(),
    };
    format!("{} | finish: {why}", timings.summary())
}
