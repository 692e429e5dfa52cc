//! What a structured output costs: decode steps with every sequence held
//! to a JSON schema against the same steps unconstrained, and the time of
//! one token mask on its own.
//!
//! ```text
//! cargo run --release -p metrale --example structured -- \
//!     --tokenizer-gguf PATH/ggml-vocab-llama-bpe.gguf \
//!     [--config benches/configs/granite-4.0-h-350m.json] [--threads 2] \
//!     [--batch 1,16] [--rounds 3] [--steps 48] \
//!     [--schema tests/fixtures/schemas/corpus.json | --grammar FILE] \
//!     [--temperature 1]
//! ```
//!
//! The config's random-weight model (seed 0, bf16) is written under
//! `target/structured-bench/` with the tokenizer of a GGUF vocabulary file
//! (llama.cpp ships them in `models/ggml-vocab-*.gguf`: a real vocabulary,
//! so the masks cost what they cost on a real model); the config's
//! `vocab_size` becomes the tokenizer's. The schema is the corpus's entry
//! with the largest `max_chars` (its most complex instance) unless
//! `--schema` names a schema file.
//!
//! Each round runs, interleaved, both modes at each batch size: `batch`
//! requests (16-token prompts, temperature 1, seeded) are prefilled, then
//! the engine steps while every one of them is still decoding, up to
//! `--steps` steps; the figure is decode tokens per second over those
//! steps (the batch size over the mean step time). A constrained sequence
//! that completes its schema ends its run early; its steps are not
//! counted, so both modes are compared at the same batch. The masks are
//! computed beside the forward pass (`engine/masks.rs`); the mask figure
//! is a random walk through the schema's grammar outside the engine,
//! median and p99 per mask.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use metrale::core::DType;
use metrale::engine::config::parse_config;
use metrale::engine::engine::{Engine, Event};
use metrale::engine::model::{ModelOptions, TransformerModel};
use metrale::engine::random::write_random_checkpoint;
use metrale::engine::sampling::GrammarFactory;
use metrale::gpu_runtime::cpu::CpuBackend;
use metrale::gpu_runtime::gpu::GpuBackend;
use metrale::weights::loader::WeightDType;
use metrale::{EngineConfig, OutputConstraint, SamplingParams, Tokenizer};
use serde_json::Value;

#[derive(Parser)]
struct Args {
    /// The config.json of the shape (random weights).
    #[arg(long, default_value = "benches/configs/granite-4.0-h-350m.json")]
    config: PathBuf,
    /// A GGUF file whose tokenizer the model gets (llama.cpp's
    /// `models/ggml-vocab-*.gguf`).
    #[arg(long)]
    tokenizer_gguf: PathBuf,
    /// A schema file, or the corpus (its most complex entry).
    #[arg(long, default_value = "tests/fixtures/schemas/corpus.json")]
    schema: PathBuf,
    /// A grammar file (Lark or GBNF) instead of the schema.
    #[arg(long)]
    grammar: Option<PathBuf>,
    #[arg(long, default_value_t = 2)]
    threads: usize,
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    batch: Vec<usize>,
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Most decode steps measured per run.
    #[arg(long, default_value_t = 48)]
    steps: usize,
    /// Sampling temperature of both modes (0: greedy, which takes the
    /// sampler's own cost, a pass over the vocabulary, out of the
    /// comparison).
    #[arg(long, default_value_t = 1.0)]
    temperature: f32,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let at_root = |p: &Path| {
        if p.exists() {
            p.to_path_buf()
        } else {
            root.join(p)
        }
    };
    let constraint = match &args.grammar {
        Some(path) => OutputConstraint::Lark(std::fs::read_to_string(at_root(path))?),
        None => OutputConstraint::JsonSchema(load_schema(&at_root(&args.schema))?),
    };
    let tokenizer = {
        let file = metrale::weights::gguf::GgufFile::open(&args.tokenizer_gguf)
            .with_context(|| format!("opening {}", args.tokenizer_gguf.display()))?;
        Tokenizer::from_gguf(&file)?
    };
    let began = Instant::now();
    let factory = GrammarFactory::new(&tokenizer)?;
    let setup = began.elapsed();
    let (p50, p99, walked) = mask_times(&factory, &tokenizer, &constraint)?;
    println!(
        "vocabulary {} ({}), compiler set up in {:.0} ms; one mask: median {:.1} us, p99 {:.1} us over {walked} tokens of a random walk",
        tokenizer.vocab_size(),
        args.tokenizer_gguf.display(),
        setup.as_secs_f64() * 1e3,
        p50,
        p99
    );
    let dir = checkpoint(&root, &at_root(&args.config), &tokenizer)?;
    let max_batch = args.batch.iter().copied().max().unwrap_or(1);
    let mut engine = load(&dir, &tokenizer, args.threads, max_batch)?;
    println!("round | batch | free tok/s | constrained tok/s | ratio");
    let mut ratios: Vec<(usize, Vec<(f64, f64)>)> =
        args.batch.iter().map(|&b| (b, Vec::new())).collect();
    for round in 0..args.rounds {
        for (batch, figures) in &mut ratios {
            let free = run(&mut engine, *batch, None, &args, round)?;
            let held = run(&mut engine, *batch, Some(&constraint), &args, round)?;
            println!(
                "{round} | {batch} | {free:.1} | {held:.1} | {:.3}",
                held / free
            );
            figures.push((free, held));
        }
    }
    println!("medians over {} rounds:", args.rounds);
    for (batch, figures) in &ratios {
        let med = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let free = med(figures.iter().map(|f| f.0).collect());
        let held = med(figures.iter().map(|f| f.1).collect());
        let ratio = med(figures.iter().map(|f| f.1 / f.0).collect());
        let (lo, hi) = figures
            .iter()
            .map(|f| f.1 / f.0)
            .fold((f64::MAX, f64::MIN), |(lo, hi), r| (lo.min(r), hi.max(r)));
        println!(
            "batch {batch}: free {free:.1} tok/s, constrained {held:.1} tok/s, paired ratio {ratio:.3} ({lo:.3}-{hi:.3})"
        );
    }
    engine.shutdown()
}

/// The schema file, or the corpus entry with the largest `max_chars`.
fn load_schema(path: &Path) -> Result<Value> {
    let v: Value = serde_json::from_slice(&std::fs::read(path)?)
        .with_context(|| format!("{} is not JSON", path.display()))?;
    match v {
        Value::Array(entries) => entries
            .into_iter()
            .max_by_key(|e| e["max_chars"].as_u64().unwrap_or(0))
            .map(|e| e["schema"].clone())
            .context("the corpus is empty"),
        schema => Ok(schema),
    }
}

/// Median and p99 microseconds per mask along random walks through the
/// grammar (uniform among allowed ids), and the tokens walked.
fn mask_times(
    factory: &GrammarFactory,
    tokenizer: &Tokenizer,
    constraint: &OutputConstraint,
) -> Result<(f64, f64, usize)> {
    let mut times = Vec::new();
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for _ in 0..20 {
        let mut grammar = factory.compile(constraint)?;
        for _ in 0..600 {
            let t = Instant::now();
            let mask = grammar.mask()?;
            times.push(t.elapsed().as_secs_f64() * 1e6);
            let allowed: Vec<u32> = (0..tokenizer.vocab_size() as u32)
                .filter(|&i| mask.allows(i) && !tokenizer.eos_ids().contains(&i))
                .collect();
            if allowed.is_empty() {
                break;
            }
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            if grammar.accept(allowed[(state % allowed.len() as u64) as usize])? {
                break;
            }
        }
    }
    times.sort_by(f64::total_cmp);
    let at = |q: f64| times[((times.len() - 1) as f64 * q) as usize];
    Ok((at(0.5), at(0.99), times.len()))
}

/// Decode tokens per second of `batch` sequences while all of them decode.
fn run(
    engine: &mut Engine,
    batch: usize,
    constraint: Option<&OutputConstraint>,
    args: &Args,
    round: usize,
) -> Result<f64> {
    let steps = args.steps;
    let vocab = 1000u32;
    for i in 0..batch {
        let prompt: Vec<u32> = (0..16)
            .map(|j| 100 + (i as u32 * 31 + j * 7) % vocab)
            .collect();
        let params = SamplingParams {
            temperature: args.temperature,
            seed: Some((round * 1000 + i) as u64),
            max_tokens: Some(steps + 8),
            ignore_eos: constraint.is_none(),
            constraint: constraint.cloned(),
            ..SamplingParams::default()
        };
        engine.add_request(prompt, params)?;
    }
    // Prefill: until every sequence has its first token.
    let mut started = 0;
    while started < batch {
        for e in engine.step()? {
            match e {
                Event::Token { .. } => started += 1,
                Event::Error { message, .. } => bail!("{message}"),
                _ => {}
            }
        }
    }
    let (mut measured, mut elapsed) = (0usize, 0.0f64);
    while measured < steps {
        let t = Instant::now();
        let events = engine.step()?;
        let dt = t.elapsed().as_secs_f64();
        if events
            .iter()
            .any(|e| matches!(e, Event::Finished { .. } | Event::Error { .. }))
        {
            break;
        }
        measured += 1;
        elapsed += dt;
    }
    engine.cancel_all();
    if measured == 0 {
        bail!("no step ran with all {batch} sequences decoding");
    }
    Ok(batch as f64 * measured as f64 / elapsed)
}

fn load(dir: &Path, tokenizer: &Tokenizer, threads: usize, batch: usize) -> Result<Engine> {
    let cpu: std::sync::Arc<dyn GpuBackend> =
        std::sync::Arc::new(CpuBackend::with_threads(threads));
    let options = ModelOptions {
        kv_blocks: (batch * 128).div_ceil(16) + 8,
        kv_block_size: 16,
        max_seqs: batch + 1,
        ..ModelOptions::default()
    };
    let model = TransformerModel::load(dir, cpu, options, WeightDType::AsStored, &mut |_| {})?;
    Ok(Engine::new(
        model,
        Some(tokenizer.clone()),
        EngineConfig::default(),
    ))
}

/// The random checkpoint of `config_path` with `tokenizer`'s vocabulary.
fn checkpoint(root: &Path, config_path: &Path, tokenizer: &Tokenizer) -> Result<PathBuf> {
    let mut config: Value = serde_json::from_slice(&std::fs::read(config_path)?)?;
    config["vocab_size"] = tokenizer.vocab_size().into();
    let text = serde_json::to_string_pretty(&config)?;
    let stem = config_path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("model");
    let dir = root
        .join("target/structured-bench")
        .join(format!("{stem}-v{}-bf16-seed0", tokenizer.vocab_size()));
    let done = dir.join("config.json");
    if !(done.exists() && std::fs::read_to_string(&done)? == text) {
        eprintln!("writing the random checkpoint {}", dir.display());
        let parsed = parse_config(&text, config_path)?;
        write_random_checkpoint(&dir, &text, &parsed, 0, DType::BF16)?;
    }
    Ok(dir)
}
