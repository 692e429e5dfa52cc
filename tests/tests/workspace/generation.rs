//! Generation through the engine loop on the fixture models: greedy parity
//! with the golden continuations (1, 4 and 16 concurrent requests, chunked
//! prefill, a cache small enough to make requests wait and be preempted),
//! seeded sampling, a check per sampling parameter that fails if the
//! parameter were ignored, stop strings across token boundaries, valid UTF-8
//! streaming, and 200 random requests with random cancellations that leave no
//! slot, no KV block and no allocation behind.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use anyhow::{Result, bail, ensure};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_engine::engine::{Engine, EngineConfig, Event, RequestId};
use metrale_model_engine::model::{ModelOptions, PrefixCacheOptions, TransformerModel};
use metrale_model_engine::sampling::{Finish, SamplingParams};
use metrale_model_engine::tokenizer::Tokenizer;
use metrale_model_weights::loader::WeightDType;
use metrale_tests::{MODELS, fixture_dir, golden, teardown_engine};

/// What one request produced.
#[derive(Clone, Debug, Default)]
struct Output {
    tokens: Vec<u32>,
    deltas: Vec<String>,
    finish: Option<Finish>,
}

impl Output {
    fn text(&self) -> String {
        self.deltas.concat()
    }
}

fn roomy() -> ModelOptions {
    ModelOptions {
        kv_block_size: 16,
        kv_blocks: 128,
        max_seqs: 16,
        max_batch_tokens: 256,
        kv_dtype: None,
        kv_follows_weights: false,
        ssm_state_dtype: None,
        ssm_state_follows_weights: false,
        cuda_graphs: true,
        prefix_cache: Default::default(),
    }
}

fn load(
    name: &str,
    options: ModelOptions,
    config: EngineConfig,
) -> Result<(Arc<CpuBackend>, Engine)> {
    let cpu = Arc::new(CpuBackend::with_threads(2));
    let gpu: Arc<dyn GpuBackend> = cpu.clone();
    let dir = fixture_dir(name);
    let model = TransformerModel::load(&dir, gpu, options, WeightDType::AsStored, &mut |_| {})?;
    let tokenizer = Tokenizer::from_dir(&dir)?;
    Ok((cpu, Engine::new(model, Some(tokenizer), config)))
}

/// Steps until no request is left; every request's output.
fn drain(engine: &mut Engine) -> Result<HashMap<RequestId, Output>> {
    let mut out: HashMap<RequestId, Output> = HashMap::new();
    for _ in 0..100_000 {
        if !engine.has_unfinished() {
            return Ok(out);
        }
        for event in engine.step()? {
            record(&mut out, event)?;
        }
    }
    bail!("the engine made no progress")
}

fn record(out: &mut HashMap<RequestId, Output>, event: Event) -> Result<()> {
    match event {
        Event::Token {
            id, token, text, ..
        } => {
            let o = out.entry(id).or_default();
            ensure!(o.finish.is_none(), "{id}: a token after Finished");
            o.tokens.push(token);
            o.deltas.push(text);
        }
        Event::Finished { id, reason, usage } => {
            let o = out.entry(id).or_default();
            ensure!(
                usage.completion_tokens == o.tokens.len(),
                "{id}: usage {usage:?}"
            );
            o.finish = Some(reason);
        }
        Event::Error { id, message } => bail!("{id}: {message}"),
        Event::PromptLogprobs { id, .. } => bail!("{id}: prompt scores not asked for"),
    }
    Ok(())
}

/// Runs one request alone.
fn run_one(engine: &mut Engine, prompt: &[u32], params: SamplingParams) -> Result<Output> {
    let id = engine.add_request(prompt.to_vec(), params)?;
    drain(engine)?
        .remove(&id)
        .ok_or_else(|| anyhow::anyhow!("no output"))
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        ..SamplingParams::greedy()
    }
}

/// Submits `concurrent` golden prompts at a time (cycling through the
/// cases, `total` in all) and checks each greedy continuation.
fn check_greedy(name: &str, engine: &mut Engine, concurrent: usize, total: usize) -> Result<()> {
    let cases = golden(name)?;
    for wave in 0..total.div_ceil(concurrent) {
        let mut ids = Vec::new();
        for i in wave * concurrent..((wave + 1) * concurrent).min(total) {
            let case = &cases[i % cases.len()];
            let new = case.tokens.len() - case.prompt.len();
            ids.push((
                engine.add_request(case.prompt.clone(), greedy(new))?,
                i % cases.len(),
            ));
        }
        let out = drain(engine)?;
        for (id, case) in ids {
            let want = &cases[case].tokens[cases[case].prompt.len()..];
            ensure!(
                out[&id].tokens == want,
                "{name}: prompt {case}, {concurrent} concurrent: got {:?}, want {want:?}",
                out[&id].tokens
            );
            ensure!(
                out[&id].finish == Some(Finish::Length),
                "{name}: finish {:?}",
                out[&id].finish
            );
        }
    }
    Ok(())
}

fn greedy_parity(name: &str) -> Result<()> {
    // Chunked prefill: the 73-token prompt takes several steps of 7.
    let chunked = EngineConfig {
        step_tokens: 64,
        prefill_chunk: 7,
        ..EngineConfig::default()
    };
    let (cpu, mut engine) = load(name, roomy(), chunked)?;
    check_greedy(name, &mut engine, 1, 4)?;
    check_greedy(name, &mut engine, 4, 4)?;
    check_greedy(name, &mut engine, 16, 16)?;
    teardown_engine(&cpu, engine)?;

    // Whole prompts in one step.
    let (cpu, mut engine) = load(name, roomy(), EngineConfig::default())?;
    check_greedy(name, &mut engine, 16, 16)?;
    teardown_engine(&cpu, engine)?;

    // Too little memory for 16 at once: requests wait, and running ones
    // are preempted and recomputed (without prefix caching, whose sharing
    // of the repeated prompts would save the memory that forces this).
    let tight = ModelOptions {
        kv_block_size: 8,
        kv_blocks: 24,
        max_seqs: 5,
        max_batch_tokens: 64,
        kv_dtype: None,
        kv_follows_weights: false,
        ssm_state_dtype: None,
        ssm_state_follows_weights: false,
        cuda_graphs: true,
        prefix_cache: PrefixCacheOptions::disabled(),
    };
    let (cpu, mut engine) = load(name, tight, chunked)?;
    check_greedy(name, &mut engine, 16, 16)?;
    let paged = engine.model().config().attention_layers().next().is_some();
    ensure!(
        !paged || engine.stats().preemptions > 0,
        "{name}: the tight cache should preempt"
    );
    teardown_engine(&cpu, engine)?;

    // The same with prefix caching: cached blocks are evicted as running
    // sequences need them, and the outputs stay the same.
    let cached = ModelOptions {
        prefix_cache: PrefixCacheOptions::default(),
        ..tight
    };
    let (cpu, mut engine) = load(name, cached, chunked)?;
    check_greedy(name, &mut engine, 16, 16)?;
    teardown_engine(&cpu, engine)
}

#[test]
fn greedy_generation_reproduces_golden_tokens_for_every_model() -> Result<()> {
    for name in MODELS {
        greedy_parity(name)?;
    }
    Ok(())
}

fn sampled(seed: u64, max_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        seed: Some(seed),
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        ..SamplingParams::default()
    }
}

#[test]
fn seeded_sampling_is_reproducible_through_the_engine() -> Result<()> {
    let (cpu, mut engine) = load(
        "granitemoehybrid",
        roomy(),
        EngineConfig {
            step_tokens: 32,
            prefill_chunk: 5,
            ..EngineConfig::default()
        },
    )?;
    let prompt = golden("granitemoehybrid")?[1].prompt.clone();
    let alone = run_one(&mut engine, &prompt, sampled(42, 24))?;
    let again = run_one(&mut engine, &prompt, sampled(42, 24))?;
    ensure!(alone.tokens == again.tokens, "same seed, different tokens");

    // The same request among others, admitted later, prefilled in chunks.
    let others: Vec<_> = (0..5)
        .map(|s| engine.add_request(prompt[..10 + s].to_vec(), sampled(s as u64, 30)))
        .collect::<Result<_, _>>()?;
    let id = engine.add_request(prompt.clone(), sampled(42, 24))?;
    let out = drain(&mut engine)?;
    ensure!(
        out[&id].tokens == alone.tokens,
        "the batch changed a seeded request's tokens"
    );
    ensure!(others.iter().all(|o| out[o].tokens.len() == 30));

    let other_seed = run_one(&mut engine, &prompt, sampled(43, 24))?;
    ensure!(other_seed.tokens != alone.tokens, "the seed is ignored");
    let greedy_out = run_one(&mut engine, &prompt, greedy(24))?;
    ensure!(
        greedy_out.tokens != alone.tokens,
        "temperature 1 samples like greedy"
    );
    let greedy_seeded = run_one(
        &mut engine,
        &prompt,
        SamplingParams {
            seed: Some(42),
            ..greedy(24)
        },
    )?;
    ensure!(
        greedy_seeded.tokens == greedy_out.tokens,
        "temperature 0 is not greedy"
    );
    teardown_engine(&cpu, engine)
}

#[test]
fn each_sampling_parameter_changes_the_output() -> Result<()> {
    let (cpu, mut engine) = load("llama", roomy(), EngineConfig::default())?;
    let prompt = golden("llama")?[0].prompt.clone();
    let base = run_one(&mut engine, &prompt, greedy(24))?.tokens;
    // A hot temperature: without a filter, sampling strays from greedy.
    let hot = |seed| SamplingParams {
        temperature: 5.0,
        ..sampled(seed, 24)
    };
    ensure!(
        run_one(&mut engine, &prompt, hot(1))?.tokens != base,
        "temperature ignored"
    );
    // Each filter at its strictest leaves only the most likely token.
    for (what, params) in [
        ("top_k", SamplingParams { top_k: 1, ..hot(1) }),
        (
            "top_p",
            SamplingParams {
                top_p: 1e-6,
                ..hot(1)
            },
        ),
        (
            "min_p",
            SamplingParams {
                min_p: 1.0,
                ..hot(1)
            },
        ),
    ] {
        ensure!(
            run_one(&mut engine, &prompt, params)?.tokens == base,
            "{what} ignored"
        );
    }
    // A looser filter still samples.
    ensure!(
        run_one(
            &mut engine,
            &prompt,
            SamplingParams {
                top_k: 50,
                ..hot(1)
            }
        )?
        .tokens
            != base
    );

    // Penalties: greedy output repeats itself; a strong repetition penalty
    // stops repeats of anything seen, presence/frequency of generated tokens.
    let repeats = |t: &[u32]| t.len() - t.iter().collect::<HashSet<_>>().len();
    ensure!(
        repeats(&base) > 0,
        "the greedy output should repeat tokens (test precondition): {base:?}"
    );
    let penalised = run_one(
        &mut engine,
        &prompt,
        SamplingParams {
            repetition_penalty: 100.0,
            ..greedy(24)
        },
    )?
    .tokens;
    ensure!(
        repeats(&penalised) == 0 && penalised.iter().all(|t| !prompt.contains(t)),
        "repetition_penalty ignored: {penalised:?}"
    );
    for params in [
        SamplingParams {
            presence_penalty: 2.0,
            ..greedy(24)
        },
        SamplingParams {
            frequency_penalty: 2.0,
            ..greedy(24)
        },
    ] {
        ensure!(
            run_one(&mut engine, &prompt, params)?.tokens != base,
            "presence/frequency penalty ignored"
        );
    }

    // max_tokens, stop token ids.
    let short = run_one(&mut engine, &prompt, greedy(5))?;
    ensure!(short.tokens == base[..5] && short.finish == Some(Finish::Length));
    let stop = base[7];
    let first = base.iter().position(|&t| t == stop).unwrap_or(7);
    let out = run_one(
        &mut engine,
        &prompt,
        SamplingParams {
            stop_token_ids: vec![stop],
            ..greedy(24)
        },
    )?;
    ensure!(out.tokens == base[..=first] && out.finish == Some(Finish::StopToken(stop)));
    teardown_engine(&cpu, engine)
}

/// Byte offsets in `text` where the decoded text of a prefix of `tokens`
/// ends (token boundaries), excluding 0 and the end.
fn token_boundaries(tok: &Tokenizer, tokens: &[u32], text: &str) -> Result<Vec<usize>> {
    let mut out = Vec::new();
    for k in 1..tokens.len() {
        let prefix = tok.decode_with(&tokens[..k], true)?;
        if !prefix.is_empty() && prefix.len() < text.len() && text.starts_with(&prefix) {
            out.push(prefix.len());
        }
    }
    Ok(out)
}

#[test]
fn stop_strings_straddling_token_boundaries_stop_in_the_right_place() -> Result<()> {
    let (cpu, mut engine) = load("granitemoehybrid", roomy(), EngineConfig::default())?;
    let tok = engine
        .tokenizer()
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("no tokenizer"))?;
    let mut checked = 0;
    for case in golden("granitemoehybrid")? {
        let full = run_one(&mut engine, &case.prompt, greedy(40))?;
        let text = full.text();
        ensure!(
            text == tok.decode_with(&full.tokens, true)?,
            "streamed text differs from the decoded tokens"
        );
        for b in token_boundaries(&tok, &full.tokens, &text)? {
            // The last character before the boundary and the first after it.
            let (Some(c1), Some(c2)) = (text[..b].chars().next_back(), text[b..].chars().next())
            else {
                continue;
            };
            let stop = format!("{c1}{c2}");
            let at = b - c1.len_utf8();
            if stop.contains('\u{FFFD}') || text.find(&stop) != Some(at) {
                continue;
            }
            let out = run_one(
                &mut engine,
                &case.prompt,
                SamplingParams {
                    stop: vec![stop.clone(), "never appears".into()],
                    ..greedy(40)
                },
            )?;
            ensure!(
                out.text() == text[..at],
                "stop {stop:?}: got {:?}, want {:?}",
                out.text(),
                &text[..at]
            );
            ensure!(
                out.finish == Some(Finish::StopString(stop.clone())),
                "finish {:?}",
                out.finish
            );
            ensure!(out.tokens.len() < full.tokens.len() && full.tokens.starts_with(&out.tokens));
            checked += 1;
            break;
        }
    }
    ensure!(checked >= 2, "too few token boundaries to test ({checked})");
    teardown_engine(&cpu, engine)
}

#[test]
fn streamed_text_is_valid_utf8_and_matches_the_decoded_tokens() -> Result<()> {
    let (cpu, mut engine) = load("qwen3", roomy(), EngineConfig::default())?;
    let tok = engine
        .tokenizer()
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("no tokenizer"))?;
    let prompt = tok.encode("Déjà vu: 日本語 🦀 naïve", true)?;
    let mut multibyte = 0;
    for seed in 0..12 {
        let out = run_one(
            &mut engine,
            &prompt,
            SamplingParams {
                temperature: 1.5,
                ..sampled(seed, 32)
            },
        )?;
        let decoded = tok.decode_with(&out.tokens, true)?;
        // Text is held back, never split: the deltas add up to the decoded text.
        ensure!(
            out.text() == decoded,
            "seed {seed}: {:?} vs {decoded:?}",
            out.deltas
        );
        multibyte += decoded
            .chars()
            .filter(|c| c.len_utf8() > 1 && *c != '\u{FFFD}')
            .count();
    }
    ensure!(
        multibyte > 0,
        "no multi-byte character was generated; the test proves little"
    );
    teardown_engine(&cpu, engine)
}

/// SplitMix64: a small deterministic generator for the stress test.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn random_request(rng: &mut Rng) -> (Vec<u32>, SamplingParams) {
    let prompt = (0..1 + rng.below(120))
        .map(|_| 3 + rng.below(509) as u32)
        .collect();
    let params = SamplingParams {
        temperature: [0.0, 0.7, 1.2][rng.below(3)],
        seed: Some(rng.next()),
        max_tokens: Some(1 + rng.below(40)),
        stop: if rng.below(4) == 0 {
            vec!["e".into()]
        } else {
            vec![]
        },
        ..SamplingParams::default()
    };
    (prompt, params)
}

fn stress(name: &str) -> Result<()> {
    let options = ModelOptions {
        kv_block_size: 8,
        kv_blocks: 48,
        max_seqs: 6,
        max_batch_tokens: 64,
        kv_dtype: None,
        kv_follows_weights: false,
        ssm_state_dtype: None,
        ssm_state_follows_weights: false,
        cuda_graphs: true,
        prefix_cache: Default::default(),
    };
    let (cpu, mut engine) = load(
        name,
        options,
        EngineConfig {
            step_tokens: 48,
            prefill_chunk: 16,
            ..EngineConfig::default()
        },
    )?;
    let mut rng = Rng(0x5EED ^ name.len() as u64);
    let (mut submitted, mut cancelled, mut finished) = (0, 0, 0);
    let mut live: Vec<RequestId> = Vec::new();
    while submitted < 200 || engine.has_unfinished() {
        if submitted < 200 && rng.below(2) == 0 {
            for _ in 0..1 + rng.below(3) {
                let (prompt, params) = random_request(&mut rng);
                live.push(engine.add_request(prompt, params)?);
                submitted += 1;
            }
        }
        if !live.is_empty() && rng.below(8) == 0 {
            let id = live.swap_remove(rng.below(live.len()));
            ensure!(engine.cancel(id), "{id} should still be live");
            cancelled += 1;
        }
        for event in engine.step()? {
            match event {
                Event::Finished { id, .. } => {
                    live.retain(|x| *x != id);
                    finished += 1;
                }
                Event::Error { id, message } => bail!("{id}: {message}"),
                Event::Token { .. } | Event::PromptLogprobs { .. } => {}
            }
        }
        let m = engine.model();
        ensure!(
            m.kv_cache().used_blocks() <= 48
                && m.ssm_pool().in_use() <= 6
                && engine.num_running() <= 6
        );
    }
    ensure!(
        finished + cancelled == 200,
        "{name}: {finished} finished + {cancelled} cancelled"
    );
    ensure!(
        cancelled > 10 && engine.stats().preemptions > 0,
        "{name}: the test should cancel and preempt: {cancelled}, {:?}",
        engine.stats()
    );
    eprintln!(
        "{name}: {finished} finished, {cancelled} cancelled, {:?}",
        engine.stats()
    );
    teardown_engine(&cpu, engine)
}

#[test]
fn random_requests_and_cancellations_leave_nothing_behind() -> Result<()> {
    stress("granitemoehybrid")?;
    stress("llama")
}
