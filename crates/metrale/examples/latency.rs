//! Latency isolation of the engine thread: how long the sequences that are
//! decoding wait between tokens while a long prompt arrives, and how long
//! `GeneratorHandle::submit_ids` takes meanwhile.
//!
//! ```text
//! cargo run --release -p metrale --example latency -- \
//!     [--config benches/configs/granite-4.0-h-350m.json] [--threads 2] \
//!     [--decoders 8] [--prompt-len 2000] [--rounds 3] [--step-tokens N] \
//!     [--mixed-prefill-tokens N]
//! ```
//!
//! The config's random-weight model (seed 0, bf16) is written once as a
//! checkpoint under `target/latency-bench/` with the bundled default model's
//! tokenizer, then loaded with the default `LoadOptions` (but `--threads`
//! and enough KV blocks) and the default `EngineConfig` (`--step-tokens` and
//! `--mixed-prefill-tokens` override its fields), and spawned on its
//! thread. Each round:
//!
//! 1. `--decoders` requests with 16-token prompts start decoding (greedy,
//!    EOS ignored); once all of them decode, 32 tokens of each are the
//!    *baseline*: the gaps between consecutive tokens of a sequence.
//! 2. A `--prompt-len` token prompt is submitted; until its first token
//!    (its prefill done), the decoders' gaps are the *during prefill*
//!    figures, and a probe thread submits a one-token request every 10 ms
//!    (dropping it at once, which cancels it) and times each submit.
//! 3. Everything is dropped (cancelled); the next round starts.
//!
//! It prints each round and the medians over the rounds (nearest-rank
//! percentiles within a round).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use metrale::core::DType;
use metrale::engine::config::parse_config;
use metrale::engine::model::ModelOptions;
use metrale::engine::random::write_random_checkpoint;
use metrale::weights::loader::WeightDType;
use metrale::{EngineConfig, Generator, GeneratorHandle, LoadOptions, SamplingParams, StreamEvent};

#[derive(Parser)]
struct Args {
    /// The config.json of the shape (random weights).
    #[arg(long, default_value = "benches/configs/granite-4.0-h-350m.json")]
    config: PathBuf,
    /// CPU worker threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Sequences decoding when the long prompt arrives.
    #[arg(long, default_value_t = 8)]
    decoders: usize,
    /// Tokens of the long prompt.
    #[arg(long, default_value_t = 2000)]
    prompt_len: usize,
    /// Rounds, each with fresh requests.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// `EngineConfig::step_tokens` (default: `EngineConfig::default()`'s).
    #[arg(long)]
    step_tokens: Option<usize>,
    /// `EngineConfig::mixed_prefill_tokens` (default: `EngineConfig::default()`'s).
    #[arg(long)]
    mixed_prefill_tokens: Option<usize>,
}

/// Decode gaps measured before the long prompt.
const BASELINE_TOKENS: usize = 32;
const DECODER_PROMPT: usize = 16;
const PROBE_EVERY: Duration = Duration::from_millis(10);

fn main() -> Result<()> {
    let args = Args::parse();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let config_path = if args.config.is_absolute() || args.config.exists() {
        args.config.clone()
    } else {
        root.join(&args.config)
    };
    let dir = checkpoint(&root, &config_path)?;
    let mut options = LoadOptions {
        threads: args.threads,
        dtype: WeightDType::BF16,
        ..LoadOptions::default()
    };
    let per_seq = DECODER_PROMPT + 4096;
    let tokens = args.prompt_len + 64 + args.decoders * per_seq;
    options.model = ModelOptions {
        kv_blocks: tokens.div_ceil(options.model.kv_block_size),
        max_seqs: options.model.max_seqs.max(args.decoders + 2),
        ..options.model
    };
    let mut config = EngineConfig::default();
    if let Some(n) = args.step_tokens {
        config.step_tokens = n;
    }
    if let Some(n) = args.mixed_prefill_tokens {
        config.mixed_prefill_tokens = n;
    }
    eprintln!("loading {} ({:?})", dir.display(), config);
    let generator = Generator::load(&dir, &options, config, &mut |_| {})?;
    let step_tokens = generator.engine().step_tokens();
    let vocab = generator.engine().model().config().vocab_size as u32;
    let handle = Arc::new(generator.spawn()?);
    println!(
        "shape {}, {} threads, {} decoders, a {}-token prompt, step_tokens {}, mixed_prefill_tokens {}",
        config_path.display(),
        args.threads,
        args.decoders,
        args.prompt_len,
        step_tokens,
        config.mixed_prefill_tokens
    );
    println!(
        "round | baseline gap p50 / p99 ms | during prefill gap p50 / p99 / max ms (n) | p99 / p50 base | submit p50 / p99 / max ms (n) | long prompt TTFT s"
    );
    let mut rounds = Vec::new();
    for round in 0..args.rounds {
        let r = run_round(&handle, &args, vocab, round as u32)?;
        println!(
            "{round} | {:.1} / {:.1} | {:.1} / {:.1} / {:.1} ({}) | {:.2}x | {:.3} / {:.3} / {:.3} ({}) | {:.2}",
            r.base_p50,
            r.base_p99,
            r.busy_p50,
            r.busy_p99,
            r.busy_max,
            r.busy_n,
            r.busy_p99 / r.base_p50,
            r.submit_p50,
            r.submit_p99,
            r.submit_max,
            r.submit_n,
            r.ttft_s
        );
        rounds.push(r);
    }
    let med = |f: fn(&Round) -> f64| {
        let mut v: Vec<f64> = rounds.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "median | {:.1} / {:.1} | {:.1} / {:.1} / {:.1} | {:.2}x | {:.3} / {:.3} / {:.3} | {:.2}",
        med(|r| r.base_p50),
        med(|r| r.base_p99),
        med(|r| r.busy_p50),
        med(|r| r.busy_p99),
        med(|r| r.busy_max),
        med(|r| r.busy_p99 / r.base_p50),
        med(|r| r.submit_p50),
        med(|r| r.submit_p99),
        med(|r| r.submit_max),
        med(|r| r.ttft_s)
    );
    let handle = Arc::try_unwrap(handle)
        .ok()
        .context("the handle is still shared")?;
    handle.shutdown()
}

/// Writes the random checkpoint once (the default model's tokenizer beside it).
fn checkpoint(root: &Path, config_path: &Path) -> Result<PathBuf> {
    let text = std::fs::read_to_string(config_path)
        .with_context(|| format!("reading {}", config_path.display()))?;
    let stem = config_path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("model");
    let dir = root
        .join("target/latency-bench")
        .join(format!("{stem}-bf16-seed0"));
    if dir.join("tokenizer.json").exists() && dir.join("config.json").exists() {
        let old = std::fs::read_to_string(dir.join("config.json"))?;
        if old == text {
            return Ok(dir);
        }
    }
    eprintln!("writing the random checkpoint {}", dir.display());
    let config = parse_config(&text, config_path)?;
    write_random_checkpoint(&dir, &text, &config, 0, DType::BF16)?;
    let tokenizer = root.join("models/default/tokenizer.json");
    std::fs::copy(&tokenizer, dir.join("tokenizer.json"))
        .with_context(|| format!("copying {}", tokenizer.display()))?;
    Ok(dir)
}

struct Round {
    base_p50: f64,
    base_p99: f64,
    busy_p50: f64,
    busy_p99: f64,
    busy_max: f64,
    busy_n: usize,
    submit_p50: f64,
    submit_p99: f64,
    submit_max: f64,
    submit_n: usize,
    ttft_s: f64,
}

fn params(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        ..SamplingParams::greedy()
    }
}

fn prompt(len: usize, vocab: u32, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| {
            (i.wrapping_mul(7919)
                .wrapping_add(salt.wrapping_mul(104_729))
                % (vocab - 1))
                + 1
        })
        .collect()
}

fn run_round(handle: &Arc<GeneratorHandle>, args: &Args, vocab: u32, round: u32) -> Result<Round> {
    let stop = Arc::new(AtomicBool::new(false));
    let counts: Arc<Vec<AtomicUsize>> =
        Arc::new((0..args.decoders).map(|_| AtomicUsize::new(0)).collect());
    let mut decoders = Vec::new();
    for d in 0..args.decoders {
        let stream = handle.submit_ids(
            prompt(DECODER_PROMPT, vocab, round * 100 + d as u32),
            params(4096),
        )?;
        let (stop, counts) = (stop.clone(), counts.clone());
        decoders.push(thread::spawn(move || -> Result<Vec<Instant>> {
            let mut times = Vec::new();
            for event in stream {
                match event? {
                    StreamEvent::Token { .. } => times.push(Instant::now()),
                    StreamEvent::Finished { .. } => bail!("a decoder finished early"),
                    StreamEvent::PromptLogprobs { .. } => continue,
                }
                counts[d].fetch_add(1, Ordering::Relaxed);
                if stop.load(Ordering::Relaxed) {
                    break;
                }
            }
            Ok(times)
        }));
    }
    // Once every decoder has decoded two tokens, the baseline starts.
    let wait_all = |n: usize| -> Result<()> {
        while counts.iter().any(|c| c.load(Ordering::Relaxed) < n) {
            if decoders.iter().any(|d| d.is_finished()) {
                bail!("a decoder stopped");
            }
            thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    };
    wait_all(2)?;
    let t0 = Instant::now();
    wait_all(2 + BASELINE_TOKENS)?;
    let t1 = Instant::now();
    let submits = Arc::new(Mutex::new(Vec::new()));
    let long = prompt(args.prompt_len, vocab, 7777 + round);
    let start = Instant::now();
    let mut stream = handle.submit_ids(long, params(1))?;
    submits
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .push(start.elapsed());
    let probing = Arc::new(AtomicBool::new(true));
    let probe = {
        let (handle, submits, probing) = (handle.clone(), submits.clone(), probing.clone());
        thread::spawn(move || -> Result<()> {
            let tiny = prompt(4, vocab, 1);
            while probing.load(Ordering::Relaxed) {
                let start = Instant::now();
                let stream = handle.submit_ids(tiny.clone(), params(1))?;
                let took = start.elapsed();
                drop(stream);
                submits
                    .lock()
                    .map_err(|_| anyhow::anyhow!("poisoned"))?
                    .push(took);
                thread::sleep(PROBE_EVERY.saturating_sub(took));
            }
            Ok(())
        })
    };
    match stream.next() {
        Some(Ok(StreamEvent::Token { .. })) => {}
        other => bail!("the long prompt did not give a token: {other:?}"),
    }
    let t2 = Instant::now();
    drop(stream);
    probing.store(false, Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    probe
        .join()
        .map_err(|_| anyhow::anyhow!("probe panicked"))??;
    let mut base = Vec::new();
    let mut busy = Vec::new();
    for d in decoders {
        let times = d
            .join()
            .map_err(|_| anyhow::anyhow!("decoder panicked"))??;
        for w in times.windows(2) {
            let gap = (w[1] - w[0]).as_secs_f64() * 1e3;
            if w[0] >= t0 && w[1] <= t1 {
                base.push(gap);
            } else if w[1] > t1 && w[1] <= t2 {
                busy.push(gap);
            }
        }
    }
    let submits: Vec<f64> = submits
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .iter()
        .map(|d| d.as_secs_f64() * 1e3)
        .collect();
    let (b, u, s) = (stats(base), stats(busy), stats(submits));
    Ok(Round {
        base_p50: b.p50,
        base_p99: b.p99,
        busy_p50: u.p50,
        busy_p99: u.p99,
        busy_max: u.max,
        busy_n: u.n,
        submit_p50: s.p50,
        submit_p99: s.p99,
        submit_max: s.max,
        submit_n: s.n,
        ttft_s: (t2 - t1).as_secs_f64(),
    })
}

struct Stats {
    p50: f64,
    p99: f64,
    max: f64,
    n: usize,
}

/// Nearest-rank percentiles (NaN when empty).
fn stats(mut v: Vec<f64>) -> Stats {
    v.sort_by(f64::total_cmp);
    let at = |q: f64| {
        if v.is_empty() {
            f64::NAN
        } else {
            v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1]
        }
    };
    Stats {
        p50: at(0.5),
        p99: at(0.99),
        max: at(1.0),
        n: v.len(),
    }
}
