//! SSM and delta-rule states held in bf16 (`CpuBackend::with_bf16_ssm_state`)
//! give, bit for bit, the logits of f32 states rounded to bf16 after every
//! update (`with_bf16_state_rounding`, whose accuracy
//! `tests/examples/bf16_state.rs` measures): chunked and whole prefills,
//! then batched decode steps, for every fixture family with recurrent
//! layers; and through the engine with the prefix cache on (bf16 states
//! snapshotted and restored), the same tokens and log-probabilities. The
//! narrow pool takes less memory, and teardown leaves the ledger empty.

use std::sync::Arc;

use anyhow::{Result, bail, ensure};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_engine::engine::{Engine, EngineConfig, Event};
use metrale_model_engine::model::{Logits, PrefixCacheOptions, Step, TransformerModel};
use metrale_model_engine::sampling::SamplingParams;
use metrale_model_weights::loader::WeightDType;
use metrale_tests::{fixture_dir, golden, load_on, options, run_chunked, teardown_engine};

const RECURRENT: [&str; 6] = [
    "mamba2",
    "bamba",
    "granitemoehybrid",
    "nemotron_h",
    "nemotron_h_moe",
    "qwen3_next",
];
const DECODE_STEPS: usize = 4;

/// Two prompts prefilled (one in chunks of 5, one whole), then decoded
/// together greedily: every logit, in order.
fn run(model: &TransformerModel, prompts: [&[u32]; 2]) -> Result<Vec<Vec<f32>>> {
    let mut seqs = [model.new_sequence()?, model.new_sequence()?];
    let mut all = vec![run_chunked(model, &mut seqs[0], prompts[0], 5)?];
    all.push(run_chunked(
        model,
        &mut seqs[1],
        prompts[1],
        prompts[1].len(),
    )?);
    let vocab = model.config().vocab_size;
    let mut next: Vec<u32> = all
        .iter()
        .map(|l| metrale_tests::argmax(&l[l.len() - vocab..]))
        .collect();
    for _ in 0..DECODE_STEPS {
        let tokens: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let [a, b] = &mut seqs;
        let mut steps = [
            Step {
                seq: a,
                tokens: &tokens[0],
                logits: Logits::Last,
            },
            Step {
                seq: b,
                tokens: &tokens[1],
                logits: Logits::Last,
            },
        ];
        let logits = model.forward(&mut steps)?;
        next = logits.iter().map(|l| metrale_tests::argmax(l)).collect();
        all.extend(logits);
    }
    for seq in seqs {
        model.free_sequence(seq);
    }
    Ok(all)
}

#[test]
fn bf16_states_give_the_bits_of_rounded_f32_states() -> Result<()> {
    for name in RECURRENT {
        let cases = golden(name)?;
        let tokens: Vec<u32> = cases.iter().flat_map(|c| c.prompt.clone()).collect();
        let prompts = [&tokens[..tokens.len().min(17)], &tokens[tokens.len() / 2..]];
        let rounded = CpuBackend::with_threads(2).with_bf16_state_rounding(true);
        let (cpu_f32, f32_states) = load_on(name, rounded)?;
        let (cpu_bf16, bf16_states) =
            load_on(name, CpuBackend::with_threads(2).with_bf16_ssm_state(true))?;
        ensure!(
            cpu_bf16.live_bytes() < cpu_f32.live_bytes(),
            "{name}: bf16 states hold {} bytes, f32 {}",
            cpu_bf16.live_bytes(),
            cpu_f32.live_bytes()
        );
        // Twice: the second run restores the prefix cache's snapshots.
        for round in 0..2 {
            let want = run(&f32_states, prompts)?;
            let got = run(&bf16_states, prompts)?;
            for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                let same =
                    w.len() == g.len() && w.iter().zip(g).all(|(a, b)| a.to_bits() == b.to_bits());
                ensure!(
                    same,
                    "{name}, round {round}: logits {i} differ (max {})",
                    metrale_tests::max_abs_diff(w, g)
                );
            }
        }
        f32_states.shutdown()?;
        bf16_states.shutdown()?;
        ensure!(
            cpu_f32.live_bytes() == 0 && cpu_bf16.live_bytes() == 0,
            "{name}: leaked"
        );
    }
    Ok(())
}

/// Six requests sharing a 24-token prefix, in two waves (the second
/// restores the first's snapshots), prefill in chunks of 7: every token and
/// its log-probability, in event order, and the tokens the cache served.
fn served(cpu: CpuBackend, name: &str) -> Result<(Vec<(u32, u32)>, usize)> {
    let cpu = Arc::new(cpu);
    let gpu: Arc<dyn GpuBackend> = cpu.clone();
    let mut model_options = options();
    model_options.kv_block_size = 4;
    model_options.prefix_cache = PrefixCacheOptions {
        snapshot_interval: 8,
        ..PrefixCacheOptions::default()
    };
    let model = TransformerModel::load(
        &fixture_dir(name),
        gpu,
        model_options,
        WeightDType::AsStored,
        &mut |_| {},
    )?;
    let config = EngineConfig {
        step_tokens: 24,
        prefill_chunk: 7,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(model, None, config);
    let all: Vec<u32> = golden(name)?.into_iter().flat_map(|c| c.prompt).collect();
    let shared: Vec<u32> = all.iter().copied().cycle().take(24).collect();
    let mut out = Vec::new();
    for wave in 0..2 {
        for i in 0..3 {
            let mut prompt = shared.clone();
            prompt.extend(
                all.iter()
                    .copied()
                    .cycle()
                    .skip(7 * (3 * wave + i) + 1)
                    .take(1 + i),
            );
            let params = SamplingParams {
                max_tokens: Some(5),
                ignore_eos: true,
                top_logprobs: 1,
                ..SamplingParams::greedy()
            };
            engine.add_request(prompt, params)?;
        }
        while engine.has_unfinished() {
            for event in engine.step()? {
                match event {
                    Event::Token {
                        token,
                        top_logprobs,
                        ..
                    } => out.push((token, top_logprobs.first().map_or(0, |t| t.1.to_bits()))),
                    Event::Finished { .. } | Event::PromptLogprobs { .. } => {}
                    Event::Error { id, message } => bail!("{name}: {id} failed: {message}"),
                }
            }
        }
    }
    let hits = engine.gauges().read().prefix_hit_tokens;
    teardown_engine(&cpu, engine)?;
    Ok((out, hits))
}

#[test]
fn bf16_states_snapshot_and_restore_through_the_prefix_cache() -> Result<()> {
    for name in RECURRENT {
        let rounded = CpuBackend::with_threads(2).with_bf16_state_rounding(true);
        let (want, _) = served(rounded, name)?;
        let (got, hits) = served(CpuBackend::with_threads(2).with_bf16_ssm_state(true), name)?;
        ensure!(hits > 0, "{name}: the prefix cache served nothing");
        ensure!(want == got, "{name}: tokens or log-probabilities differ");
    }
    Ok(())
}
