//! Prefix caching changes what is computed, never what is generated: for
//! every fixture model, greedy outputs with the cache on equal those with
//! it off (a difference must be a near-tie: the reference run's top-2
//! log-probabilities within 1e-4 where the tokens part), over a multi-turn
//! chat and over many requests sharing a system prompt, with chunked
//! prefill, cancellations and budgets too small for the workload; chat
//! turns reuse everything the previous turn computed; nothing leaks.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{Result, bail, ensure};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_engine::engine::{Engine, EngineConfig, Event, RequestId};
use metrale_model_engine::model::{ModelOptions, PrefixCacheOptions, TransformerModel};
use metrale_model_engine::sampling::SamplingParams;
use metrale_model_weights::loader::WeightDType;
use metrale_tests::{MODELS, fixture_dir, golden, teardown_engine};

/// Where the reference run's top two tokens are this close, either may be
/// the greedy choice.
const NEAR_TIE: f32 = 1e-4;

/// One request's greedy tokens and, per token, the top-2 log-probabilities.
#[derive(Clone, Debug, Default)]
struct Run {
    tokens: Vec<u32>,
    top2: Vec<(f32, f32)>,
}

fn options(prefix_cache: PrefixCacheOptions, kv_blocks: usize) -> ModelOptions {
    ModelOptions {
        // Small blocks: reuse ends inside blocks and paths are several deep.
        kv_block_size: 4,
        kv_blocks,
        max_seqs: 4,
        max_batch_tokens: 64,
        kv_dtype: None,
        kv_follows_weights: false,
        ssm_state_dtype: None,
        ssm_state_follows_weights: false,
        cuda_graphs: true,
        prefix_cache,
    }
}

fn chunked() -> EngineConfig {
    EngineConfig {
        step_tokens: 24,
        prefill_chunk: 7,
        ..EngineConfig::default()
    }
}

fn load(name: &str, options: ModelOptions) -> Result<(Arc<CpuBackend>, Engine)> {
    let cpu = Arc::new(CpuBackend::with_threads(2));
    let gpu: Arc<dyn GpuBackend> = cpu.clone();
    let model = TransformerModel::load(
        &fixture_dir(name),
        gpu,
        options,
        WeightDType::AsStored,
        &mut |_| {},
    )?;
    Ok((cpu, Engine::new(model, None, chunked())))
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        top_logprobs: 2,
        ..SamplingParams::greedy()
    }
}

fn record(out: &mut HashMap<RequestId, Run>, event: Event) -> Result<()> {
    match event {
        Event::Token {
            id,
            token,
            top_logprobs,
            ..
        } => {
            let run = out.entry(id).or_default();
            run.tokens.push(token);
            let lp = |i: usize| top_logprobs.get(i).map_or(f32::NEG_INFINITY, |t| t.1);
            run.top2.push((lp(0), lp(1)));
        }
        Event::Finished { .. } | Event::PromptLogprobs { .. } => {}
        Event::Error { id, message } => bail!("{id} failed: {message}"),
    }
    Ok(())
}

/// Steps until `done` says so (or nothing is left), recording outputs.
fn step_until(
    engine: &mut Engine,
    out: &mut HashMap<RequestId, Run>,
    mut done: impl FnMut(&Engine) -> bool,
) -> Result<()> {
    for _ in 0..100_000 {
        if !engine.has_unfinished() || done(engine) {
            return Ok(());
        }
        for event in engine.step()? {
            record(out, event)?;
        }
    }
    bail!("the engine made no progress")
}

/// Prompt material from the fixture's golden prompts, `len` tokens from
/// `offset` on (cycling).
fn tokens(name: &str, offset: usize, len: usize) -> Result<Vec<u32>> {
    let all: Vec<u32> = golden(name)?.into_iter().flat_map(|c| c.prompt).collect();
    Ok((0..len).map(|i| all[(offset + i) % all.len()]).collect())
}

/// Twelve requests sharing a 30-token system prompt, with suffixes of 1 to
/// 9 tokens, in waves that overlap (a wave joins while the previous one
/// runs, so blocks are shared as soon as they fill); one request of each
/// wave is cancelled after a step. Returns the completed runs in order.
fn shared_system_prompt(name: &str, engine: &mut Engine) -> Result<Vec<Run>> {
    let system = tokens(name, 0, 30)?;
    let mut out = HashMap::new();
    let (mut order, mut cancelled) = (Vec::new(), Vec::new());
    for wave in 0..3 {
        for i in 0..4 {
            let n = wave * 4 + i;
            let mut prompt = system.clone();
            prompt.extend(tokens(name, 31 + 5 * n, 1 + n % 9)?);
            let id = engine.add_request(prompt, greedy(6))?;
            if i == 1 {
                cancelled.push(id);
            } else {
                order.push(id);
            }
        }
        let start = engine.stats().steps;
        step_until(engine, &mut out, |e| e.stats().steps >= start + 1)?;
        engine.cancel(*cancelled.last().expect("one per wave"));
        step_until(engine, &mut out, |e| e.stats().steps >= start + 4)?;
    }
    step_until(engine, &mut out, |_| false)?;
    order
        .iter()
        .map(|id| {
            out.remove(id)
                .ok_or_else(|| anyhow::anyhow!("{id}: no output"))
        })
        .collect()
}

/// A four-turn chat: each prompt is the previous prompt, its reply and a
/// new user message. Returns the runs and, per turn, the prompt tokens the
/// cache saved and the prompt tokens the previous turn fed the model.
fn chat(name: &str, engine: &mut Engine) -> Result<(Vec<Run>, Vec<(u64, usize)>)> {
    let mut history = tokens(name, 3, 11)?;
    let (mut runs, mut reuse) = (Vec::new(), Vec::new());
    let mut fed_before = 0;
    for turn in 0..4 {
        let hits = engine.stats().prefix_hit_tokens;
        let id = engine.add_request(history.clone(), greedy(5))?;
        let mut out = HashMap::new();
        step_until(engine, &mut out, |_| false)?;
        let run = out
            .remove(&id)
            .ok_or_else(|| anyhow::anyhow!("no output"))?;
        reuse.push((engine.stats().prefix_hit_tokens - hits, fed_before));
        // Fed: the prompt and every generated token but the last.
        fed_before = history.len() + run.tokens.len() - 1;
        history.extend(&run.tokens);
        history.extend(tokens(name, 17 + 3 * turn, 2 + turn)?);
        runs.push(run);
    }
    Ok((runs, reuse))
}

/// Compares runs with the cache on against the reference runs; returns
/// the near-ties where the tokens parted.
fn compare(what: &str, on: &[Run], off: &[Run]) -> Result<usize> {
    ensure!(
        on.len() == off.len(),
        "{what}: {} runs against {}",
        on.len(),
        off.len()
    );
    let mut near_ties = 0;
    for (i, (a, b)) in on.iter().zip(off).enumerate() {
        let Some(j) = (0..a.tokens.len().min(b.tokens.len())).find(|&j| a.tokens[j] != b.tokens[j])
        else {
            ensure!(a.tokens == b.tokens, "{what} #{i}: lengths differ");
            continue;
        };
        let (first, second) = b.top2[j];
        ensure!(
            first - second <= NEAR_TIE,
            "{what} #{i}: token {j} is {} with the cache and {} without, top-2 gap {}",
            a.tokens[j],
            b.tokens[j],
            first - second
        );
        near_ties += 1;
    }
    Ok(near_ties)
}

/// Both workloads on one engine; the outputs and the chat's reuse.
fn workloads(
    name: &str,
    options: ModelOptions,
) -> Result<(
    Vec<Run>,
    Vec<Run>,
    Vec<(u64, usize)>,
    Engine,
    Arc<CpuBackend>,
)> {
    let (cpu, mut engine) = load(name, options)?;
    let shared = shared_system_prompt(name, &mut engine)?;
    let (chat, reuse) = chat(name, &mut engine)?;
    Ok((shared, chat, reuse, engine, cpu))
}

#[test]
fn greedy_outputs_are_the_same_with_the_cache_on_and_off() -> Result<()> {
    let mut report = Vec::new();
    for name in MODELS {
        let (off_shared, off_chat, _, engine, cpu) =
            workloads(name, options(PrefixCacheOptions::disabled(), 256))?;
        teardown_engine(&cpu, engine)?;
        let on = PrefixCacheOptions {
            snapshot_interval: 8,
            ..PrefixCacheOptions::default()
        };
        let (shared, chat, reuse, engine, cpu) = workloads(name, options(on, 256))?;
        let stats = engine.stats();
        let usage = engine.model().prefix_cache_usage();
        teardown_engine(&cpu, engine)?;
        let ties = compare(&format!("{name} shared prompt"), &shared, &off_shared)?
            + compare(&format!("{name} chat"), &chat, &off_chat)?;
        // Turn N starts from all that turn N-1 fed the model.
        for (turn, &(hit, fed)) in reuse.iter().enumerate().skip(1) {
            ensure!(
                hit == fed as u64,
                "{name}: chat turn {turn} reused {hit} tokens, the previous turn fed {fed}"
            );
        }
        ensure!(stats.prefix_hit_tokens > 0, "{name}: no hits");
        report.push(format!(
            "{name}: hit {} recomputed {} tokens, {} cached blocks, {} snapshots ({} B), near-ties {ties}",
            stats.prefix_hit_tokens,
            stats.prefix_recomputed_tokens,
            usage.cached_blocks,
            usage.snapshots,
            usage.snapshot_bytes
        ));
    }
    eprintln!("{}", report.join("\n"));
    Ok(())
}

/// KV blocks for barely four sequences and room for three snapshots: the
/// cache evicts as the workload goes, stays within both budgets after every
/// step, and the outputs are still those of an uncached run.
#[test]
fn budgets_hold_under_a_workload_that_exceeds_them() -> Result<()> {
    for name in MODELS {
        let (off, _, _, engine, cpu) =
            workloads(name, options(PrefixCacheOptions::disabled(), 256))?;
        teardown_engine(&cpu, engine)?;
        let (cpu, probe) = load(name, options(PrefixCacheOptions::default(), 256))?;
        let slot_bytes = snapshot_size(&probe);
        teardown_engine(&cpu, probe)?;
        let budget = 3 * slot_bytes;
        let tight = PrefixCacheOptions {
            snapshot_interval: 4,
            snapshot_budget: Some(budget),
            ..PrefixCacheOptions::default()
        };
        let (cpu, mut engine) = load(name, options(tight, 48))?;
        let blocks = engine.model().kv_cache().num_blocks();
        let mut peak_cached = 0;
        let on = {
            let system = tokens(name, 0, 30)?;
            let mut out = HashMap::new();
            let mut order = Vec::new();
            for n in 0..12 {
                let mut prompt = system.clone();
                prompt.extend(tokens(name, 31 + 5 * n, 1 + n % 9)?);
                if n % 4 != 1 {
                    order.push(engine.add_request(prompt, greedy(6))?);
                } else {
                    // Stand-ins for the cancelled ones: same prompts, not compared.
                    let id = engine.add_request(prompt, greedy(1))?;
                    let _ = id;
                }
                while engine.num_running() + engine.num_waiting() >= 4 {
                    for event in engine.step()? {
                        record(&mut out, event)?;
                    }
                    let usage = engine.model().prefix_cache_usage();
                    ensure!(
                        usage.snapshot_bytes <= budget,
                        "{name}: snapshots over budget"
                    );
                    ensure!(
                        usage.cached_blocks <= blocks,
                        "{name}: more cached blocks than blocks"
                    );
                    peak_cached = peak_cached.max(usage.cached_blocks);
                }
            }
            step_until(&mut engine, &mut out, |_| false)?;
            order
                .iter()
                .map(|id| {
                    out.remove(id)
                        .ok_or_else(|| anyhow::anyhow!("{id}: no output"))
                })
                .collect::<Result<Vec<_>>>()?
        };
        let paged = engine.model().config().attention_layers().next().is_some();
        ensure!(!paged || peak_cached > 0, "{name}: nothing was cached");
        teardown_engine(&cpu, engine)?;
        compare(&format!("{name} under budgets"), &on, &off)?;
    }
    Ok(())
}

/// Bytes of one snapshot of `engine`'s model (0 without recurrent layers).
fn snapshot_size(engine: &Engine) -> usize {
    let pool = engine.model().ssm_pool();
    (0..pool.layers())
        .filter_map(|l| pool.shape(l))
        .map(|s| 4 * (s.conv + s.ssm))
        .sum()
}
