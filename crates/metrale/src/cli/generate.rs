//! `metrale generate`: streams a prompt's continuation to stdout, with a
//! summary (tokens/s, time to first token) on stderr. Also the model and
//! sampling options `metrale chat` shares.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use metrale::{
    EngineConfig, Generator, LoadOptions, SamplingParams, StreamEvent, Timings, default_model_dir,
};
use metrale_model_engine::sampling::Finish;

const DEFAULT_MODEL_NOTE: &str = "Model directory (config.json, *.safetensors, tokenizer.json). Default: $METRALE_MODEL, else the bundled models/default, a tiny model with random weights whose output is gibberish";

/// Which model to load and how.
#[derive(clap::Args, Debug)]
pub struct ModelArgs {
    #[arg(long, help = DEFAULT_MODEL_NOTE)]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub device: super::DeviceArgs,
    /// CPU worker threads (0: one per core; at most 4 per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// The most memory the model may take, e.g. 8GiB (default: what the
    /// host and its cgroup have available); checked before loading.
    #[arg(long, value_parser = super::parse_memory)]
    pub memory_limit: Option<usize>,
    /// The KV cache's element type: auto (the backend's default: f32 on the
    /// CPU), f32, or bf16 (half the memory per cached token).
    #[arg(long, value_enum, default_value_t = super::KvDType::Auto)]
    pub kv_dtype: super::KvDType,
}

impl ModelArgs {
    /// Loads the model for one conversation at a time.
    pub fn load(&self) -> Result<Generator> {
        let dir = self.model.clone().unwrap_or_else(default_model_dir);
        if !dir.join("config.json").is_file() {
            anyhow::bail!(
                "no model at {} (give --model DIR or set {})",
                dir.display(),
                metrale::MODEL_ENV
            );
        }
        let mut options = LoadOptions {
            device: self.device.device,
            threads: self.threads,
            memory_limit: self.memory_limit,
            ..LoadOptions::default()
        };
        options.model.max_seqs = 1;
        options.model.kv_dtype = self.kv_dtype.dtype();
        options.model.cuda_graphs = !self.device.no_cuda_graphs;
        Generator::load(&dir, &options, EngineConfig::default(), &mut |_| {})
    }
}

/// Sampling options.
#[derive(clap::Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Most tokens to generate (fewer if the context runs out first).
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Softmax temperature; 0 means greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Keep only the K most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Keep the most likely tokens up to this total probability (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Drop tokens less likely than this times the most likely one (0: off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Penalise tokens already in the prompt or output (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Random seed, for reproducible sampling.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop before this text (repeatable).
    #[arg(long = "stop", value_name = "TEXT")]
    pub stop: Vec<String>,
    /// Keep going past the model's end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
}

impl SamplingArgs {
    /// The parameters for a prompt of `prompt_len` tokens, `max_tokens`
    /// cut to what the context leaves.
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
        let params = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            max_tokens: Some(self.max_tokens.min(room)),
            stop: self.stop.clone(),
            ignore_eos: self.ignore_eos,
            ..SamplingParams::default()
        };
        params.validate()?;
        Ok(params)
    }
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The prompt (its continuation is printed, not the prompt).
    pub prompt: String,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

pub fn run(args: Args) -> Result<()> {
    let mut generator = args.model.load()?;
    let result = generate(&mut generator, &args);
    let shutdown = generator.shutdown();
    result?;
    shutdown
}

fn generate(generator: &mut Generator, args: &Args) -> Result<()> {
    let ids = generator.encode(&args.prompt)?;
    let params = args.sampling.params(generator, ids.len())?;
    let mut out = std::io::stdout().lock();
    let (text, finish, timings) = stream_to(generator, ids, &params, &mut out)?;
    if !text.ends_with('\n') {
        writeln!(out)?;
    }
    out.flush()?;
    eprintln!("{}", summary(&timings, &finish));
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
    };
    format!("{} | finish: {why}", timings.summary())
}
