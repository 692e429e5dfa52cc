//! `metrale bench --shared-prefix N`: what the prefix cache saves. Times
//! the first token of prompts of N shared tokens and M new ones through the
//! engine: a miss (the N-token prefix was never seen) against hits (the
//! same prefix, a new suffix each time). Every round takes a new prefix, so
//! misses and hits interleave and drift in the machine's speed (a shared
//! host, thermal limits) touches both alike.

use std::time::Instant;

use anyhow::{Result, bail};
use metrale::SamplingParams;
use metrale::engine::config::ModelConfig;
use metrale::engine::engine::{Engine, EngineConfig, Event};
use metrale::engine::model::TransformerModel;

use super::bench::Args;

/// Hits timed after each round's miss.
pub const HITS_PER_ROUND: usize = 3;

/// Checks the sizes of a shared-prefix run against `limit` (the context)
/// and returns the KV blocks it needs: room for the running prompt and the
/// cached blocks of a whole round (more is evicted as needed).
pub fn check_sizes(args: &Args, shared: usize, limit: usize, block_size: usize) -> Result<usize> {
    let m = args.suffix;
    if shared == 0 || m == 0 || args.repeat == 0 {
        bail!("--shared-prefix, --suffix and --repeat must be at least 1");
    }
    // The prompt and the one token generated.
    match shared.checked_add(m).and_then(|n| n.checked_add(1)) {
        Some(len) if len <= limit => {}
        _ => bail!(
            "--shared-prefix {shared} plus --suffix {m} tokens is more than the context of {limit} positions"
        ),
    }
    let per_prompt = (shared + m + 1).div_ceil(block_size) + 1;
    Ok(per_prompt * (HITS_PER_ROUND + 2))
}

/// Prompt ids: seeded random ones (an LCG: any valid ids will do), except
/// that each prefix and each suffix starts with an id no other one started
/// with, so a new prefix cannot match an old one and a suffix cannot match
/// another beyond the prefix.
struct Ids {
    state: u64,
    fresh: u64,
    vocab: u64,
}

impl Ids {
    fn new(seed: u64, vocab: usize) -> Self {
        Self {
            state: seed.wrapping_mul(6364136223846793005),
            fresh: 0,
            vocab: vocab.max(1) as u64,
        }
    }

    fn random(&mut self) -> u32 {
        self.state = self
            .state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.state >> 33) % self.vocab) as u32
    }

    /// `n` ids, the first one not used to start any other run of ids.
    fn run(&mut self, n: usize) -> Vec<u32> {
        let first = (self.fresh % self.vocab) as u32;
        self.fresh += 1;
        std::iter::once(first)
            .chain((1..n).map(|_| self.random()))
            .take(n)
            .collect()
    }
}

/// What the rounds measured.
pub struct PrefixMeasured {
    pub miss_ttft_ms: f64,
    pub hit_ttft_ms: f64,
    /// The first hit of each round: a recurrent model restores the nearest
    /// interval snapshot and recomputes up to the end of the match; it
    /// leaves a snapshot there, which the later hits start from.
    pub first_hit_ttft_ms: f64,
    pub hits: usize,
    /// Prompt tokens the hits reused, and those matched but recomputed.
    pub hit_tokens: u64,
    pub recomputed_tokens: u64,
}

impl PrefixMeasured {
    /// How many times faster a hit's first token comes.
    pub fn speedup(&self) -> f64 {
        self.miss_ttft_ms / self.hit_ttft_ms.max(f64::MIN_POSITIVE)
    }
}

/// Runs the rounds on `model` (torn down after).
pub fn measure(model: TransformerModel, args: &Args, shared: usize) -> Result<PrefixMeasured> {
    let vocab = model.config().vocab_size;
    let mut engine = Engine::new(model, None, EngineConfig::default());
    let result = rounds(&mut engine, args, shared, vocab);
    let shutdown = engine.shutdown();
    let measured = result?;
    shutdown?;
    Ok(measured)
}

fn rounds(engine: &mut Engine, args: &Args, shared: usize, vocab: usize) -> Result<PrefixMeasured> {
    let mut ids = Ids::new(args.seed, vocab);
    // Warm-up: thread pool, page faults of the scratch, first-call costs.
    first_token_ms(engine, ids.run(shared + args.suffix))?;
    let (mut misses, mut hits, mut first_hits) = (Vec::new(), Vec::new(), Vec::new());
    let (mut hit_tokens, mut recomputed_tokens) = (0, 0);
    for _ in 0..args.repeat {
        let prefix = ids.run(shared);
        let prompt = |ids: &mut Ids| [prefix.clone(), ids.run(args.suffix)].concat();
        misses.push(first_token_ms(engine, prompt(&mut ids))?);
        for hit in 0..HITS_PER_ROUND {
            let before = engine.stats();
            let ms = first_token_ms(engine, prompt(&mut ids))?;
            hits.push(ms);
            if hit == 0 {
                first_hits.push(ms);
            }
            let after = engine.stats();
            hit_tokens += after
                .prefix_hit_tokens
                .saturating_sub(before.prefix_hit_tokens);
            recomputed_tokens +=
                (after.prefix_recomputed_tokens).saturating_sub(before.prefix_recomputed_tokens);
        }
    }
    Ok(PrefixMeasured {
        miss_ttft_ms: median(&mut misses),
        hit_ttft_ms: median(&mut hits),
        first_hit_ttft_ms: median(&mut first_hits),
        hits: hits.len(),
        hit_tokens,
        recomputed_tokens,
    })
}

/// Milliseconds from submitting `prompt` to its first token; the request
/// ends there (one token), so the engine caches it for the next.
fn first_token_ms(engine: &mut Engine, prompt: Vec<u32>) -> Result<f64> {
    let params = SamplingParams {
        max_tokens: Some(1),
        ignore_eos: true,
        ..SamplingParams::greedy()
    };
    let start = Instant::now();
    let id = engine.add_request(prompt, params)?;
    let mut first = None;
    while engine.contains(id) {
        for event in engine.step()? {
            match event {
                Event::Token { .. } => {
                    first.get_or_insert_with(|| start.elapsed().as_secs_f64() * 1e3);
                }
                Event::Error { message, .. } => bail!("{id}: {message}"),
                Event::Finished { .. } | Event::PromptLogprobs { .. } => {}
            }
        }
    }
    first.ok_or_else(|| anyhow::anyhow!("{id} ended without a token"))
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// The lines (or the JSON object) `metrale bench --shared-prefix` prints.
pub fn report(
    config: &ModelConfig,
    name: &str,
    args: &Args,
    shared: usize,
    m: &PrefixMeasured,
) -> String {
    if args.json {
        let v = serde_json::json!({
            "model": name,
            "model_type": config.model_type.as_str(),
            "params": config.parameter_count(),
            "shared_prefix": shared,
            "suffix": args.suffix,
            "rounds": args.repeat,
            "hits": m.hits,
            "miss_ttft_ms": m.miss_ttft_ms,
            "hit_ttft_ms": m.hit_ttft_ms,
            "first_hit_ttft_ms": m.first_hit_ttft_ms,
            "speedup": m.speedup(),
            "first_hit_speedup": m.miss_ttft_ms / m.first_hit_ttft_ms.max(f64::MIN_POSITIVE),
            "prefix_hit_tokens": m.hit_tokens,
            "prefix_recomputed_tokens": m.recomputed_tokens,
            "prefix_cache": !args.prefix.no_prefix_cache,
        });
        return format!("{v}\n");
    }
    let cache = if args.prefix.no_prefix_cache {
        " (--no-prefix-cache)"
    } else {
        ""
    };
    format!(
        "model        {name} ({}, {:.1}M parameters)\n\
         prompt       {shared} shared + {} new tokens; {} rounds of 1 miss and {HITS_PER_ROUND} hits{cache}\n\
         miss ttft    {:>10.1} ms (median)\n\
         hit ttft     {:>10.1} ms (median), {:.2}x faster\n\
         first hits   {:>10.1} ms (median of each round's first), {:.2}x faster\n\
         prefix hits  {} tokens reused, {} recomputed over {} hits\n",
        config.model_type.as_str(),
        config.parameter_count() as f64 / 1e6,
        args.suffix,
        args.repeat,
        m.miss_ttft_ms,
        m.hit_ttft_ms,
        m.speedup(),
        m.first_hit_ttft_ms,
        m.miss_ttft_ms / m.first_hit_ttft_ms.max(f64::MIN_POSITIVE),
        m.hit_tokens,
        m.recomputed_tokens,
        m.hits,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_start_with_fresh_ids() {
        let mut ids = Ids::new(3, 512);
        let (a, b) = (ids.run(5), ids.run(5));
        assert_eq!(a.len(), 5);
        assert_ne!(a[0], b[0]);
        assert!(a.iter().chain(&b).all(|&t| t < 512));
    }

    #[test]
    fn medians() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&mut []), 0.0);
    }
}
