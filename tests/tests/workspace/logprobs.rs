//! Top-N log-probabilities through the engine on every fixture architecture:
//! golden prompts run concurrently and greedy; each token's first
//! alternative is the sampled token with the same log-probability, and the
//! reported values are the log-softmax of the logits the model gives for the
//! same prefix (within 1e-4) and of the golden reference logits (within
//! 1e-3).

use std::collections::HashMap;

use anyhow::{Result, bail, ensure};
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_engine::engine::{Engine, EngineConfig, Event, RequestId};
use metrale_model_engine::sampling::SamplingParams;
use metrale_model_engine::tokenizer::Tokenizer;
use metrale_tests::{MODELS, fixture_dir, golden, load, run_chunked};

const TOP: usize = 5;
const STEPS: usize = 6;

type Reported = Vec<(u32, f32, Vec<(u32, f32)>)>;

/// log-softmax of one row of logits, in f64.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row
        .iter()
        .fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
    let lse = row
        .iter()
        .map(|&x| (f64::from(x) - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    row.iter().map(|&x| f64::from(x) - lse).collect()
}

/// Checks one step's alternatives against a reference log-softmax.
fn check_step(what: &str, top: &[(u32, f32)], expected: &[f64], tolerance: f64) -> Result<()> {
    for &(id, lp) in top {
        let want = expected[id as usize];
        ensure!(
            (f64::from(lp) - want).abs() < tolerance,
            "{what}: id {id}: {lp} vs {want}"
        );
    }
    let least = f64::from(top[top.len() - 1].1);
    for (id, &v) in expected.iter().enumerate() {
        ensure!(
            top.iter().any(|e| e.0 as usize == id) || v <= least + tolerance,
            "{what}: id {id} ({v}) is more likely than the listed {least}"
        );
    }
    Ok(())
}

fn check(name: &str) -> Result<()> {
    let cases: Vec<_> = golden(name)?.into_iter().take(3).collect();
    let (cpu, model) = load(name)?;
    let tokenizer = Tokenizer::from_dir(fixture_dir(name))?;
    let mut engine = Engine::new(model, Some(tokenizer), EngineConfig::default());
    let params = SamplingParams {
        max_tokens: Some(STEPS),
        ignore_eos: true,
        top_logprobs: TOP,
        ..SamplingParams::greedy()
    };
    let ids: Vec<RequestId> = cases
        .iter()
        .map(|c| engine.add_request(c.prompt.clone(), params.clone()))
        .collect::<Result<_, _>>()?;
    let mut out: HashMap<RequestId, Reported> = HashMap::new();
    while engine.has_unfinished() {
        for event in engine.step()? {
            match event {
                Event::Token {
                    id,
                    token,
                    logprob,
                    top_logprobs,
                    ..
                } => out
                    .entry(id)
                    .or_default()
                    .push((token, logprob, top_logprobs)),
                Event::Finished { .. } | Event::PromptLogprobs { .. } => {}
                Event::Error { id, message } => bail!("{name} {id}: {message}"),
            }
        }
    }

    let vocab = engine.model().config().vocab_size;
    for (case, id) in cases.iter().zip(&ids) {
        let steps = &out[id];
        ensure!(steps.len() == STEPS, "{name}: {} tokens", steps.len());
        let generated: Vec<u32> = steps.iter().map(|s| s.0).collect();
        let golden_new = &case.tokens[case.prompt.len()..];
        let shared = golden_new.len().min(STEPS);
        ensure!(
            golden_new[..shared] == generated[..shared],
            "{name}: greedy tokens {generated:?} differ from the golden ones"
        );
        let mut prefix = case.prompt.clone();
        prefix.extend_from_slice(&generated[..STEPS - 1]);
        let mut seq = engine.model().new_sequence()?;
        let logits = run_chunked(engine.model(), &mut seq, &prefix, 16);
        engine.model().free_sequence(seq);
        let logits = logits?;
        for (step, (token, logprob, top)) in steps.iter().enumerate() {
            let what = format!("{name} {id} step {step}");
            ensure!(top.len() == TOP, "{what}: {} alternatives", top.len());
            ensure!(top[0] == (*token, *logprob), "{what}: {top:?} vs {token}");
            ensure!(top.windows(2).all(|w| w[0].1 >= w[1].1), "{what}: unsorted");
            let mass: f64 = top.iter().map(|e| f64::from(e.1).exp()).sum();
            ensure!(mass <= 1.0 + 1e-6, "{what}: mass {mass}");
            let pos = case.prompt.len() - 1 + step;
            let row = &logits[pos * vocab..(pos + 1) * vocab];
            check_step(&what, top, &log_softmax(row), 1e-4)?;
            // The golden logits cover the golden tokens' positions.
            if pos + 1 < case.tokens.len() && step <= shared {
                let golden = &case.logits[pos * case.vocab..(pos + 1) * case.vocab];
                check_step(&format!("{what} (golden)"), top, &log_softmax(golden), 1e-3)?;
            }
        }
    }
    engine.shutdown()?;
    ensure!(cpu.live_bytes() == 0, "{name}: the ledger is not empty");
    Ok(())
}

#[test]
fn top_logprobs_match_the_log_softmax_for_every_model() -> Result<()> {
    for name in MODELS {
        check(name)?;
    }
    Ok(())
}
