//! What a bf16 recurrent state would cost in accuracy: every model with
//! Mamba-2 or gated-delta layers run twice on the CPU in f32 arithmetic,
//! once with its f32 state and once with the state rounded to bf16 after
//! every update (`CpuBackend::with_bf16_state_rounding`, the values a bf16
//! state holds), over 512 positions:
//!
//! - teacher-forced: a 32-token prompt, then the given text one token per
//!   decode step; the largest logit difference over all steps (absolute,
//!   and relative to the step's logit range) and how often the argmax
//!   differs;
//! - greedy: 480 tokens generated from the same prompt by each; the first
//!   position where they part (none: equal to the end).
//!
//! The bundled default model (trained; its text is the corpus it learnt)
//! and the recurrent fixture families (random weights; golden prompts
//! cycled). Run by hand: `cargo run -p metrale-tests --example bf16_state`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_engine::model::{Logits, Sequence, Step, TransformerModel};
use metrale_model_engine::tokenizer::Tokenizer;
use metrale_model_weights::loader::WeightDType;
use metrale_tests::{argmax, fixture_dir, golden, options};

const PROMPT: usize = 32;
const POSITIONS: usize = 512;

fn load(dir: &Path, round: bool) -> Result<(Arc<CpuBackend>, TransformerModel)> {
    let cpu = Arc::new(CpuBackend::with_threads(2).with_bf16_state_rounding(round));
    let gpu: Arc<dyn GpuBackend> = cpu.clone();
    let model = TransformerModel::load(dir, gpu, options(), WeightDType::AsStored, &mut |_| {})?;
    Ok((cpu, model))
}

fn step(model: &TransformerModel, seq: &mut Sequence, tokens: &[u32]) -> Result<Vec<f32>> {
    Ok(model
        .forward(&mut [Step {
            seq,
            tokens,
            logits: Logits::Last,
        }])?
        .remove(0))
}

#[derive(Default)]
struct Forced {
    max_abs: f32,
    max_rel: f32,
    argmax_differs: usize,
    steps: usize,
}

impl Forced {
    fn add(&mut self, a: &[f32], b: &[f32]) {
        let diff = metrale_tests::max_abs_diff(a, b);
        let range =
            a.iter().fold(f32::MIN, |m, v| m.max(*v)) - a.iter().fold(f32::MAX, |m, v| m.min(*v));
        self.max_abs = self.max_abs.max(diff);
        self.max_rel = self.max_rel.max(diff / range.max(f32::MIN_POSITIVE));
        self.argmax_differs += usize::from(argmax(a) != argmax(b));
        self.steps += 1;
    }
}

fn teacher_forced(models: [&TransformerModel; 2], text: &[u32]) -> Result<Forced> {
    let mut seqs = [models[0].new_sequence()?, models[1].new_sequence()?];
    let mut stats = Forced::default();
    let mut last = [Vec::new(), Vec::new()];
    for (i, (m, s)) in models.iter().zip(seqs.iter_mut()).enumerate() {
        last[i] = step(m, s, &text[..PROMPT])?;
    }
    stats.add(&last[0], &last[1]);
    for t in PROMPT..text.len() {
        for (i, (m, s)) in models.iter().zip(seqs.iter_mut()).enumerate() {
            last[i] = step(m, s, &text[t..t + 1])?;
        }
        stats.add(&last[0], &last[1]);
    }
    let [a, b] = seqs;
    models[0].free_sequence(a);
    models[1].free_sequence(b);
    Ok(stats)
}

/// The first generated position where the two greedy runs differ.
fn greedy_parting(models: [&TransformerModel; 2], prompt: &[u32]) -> Result<Option<usize>> {
    let mut runs = Vec::new();
    for m in models {
        let mut seq = m.new_sequence()?;
        let mut out = vec![argmax(&step(m, &mut seq, prompt)?)];
        while prompt.len() + out.len() < POSITIONS {
            let next = [*out.last().context("one token")?];
            out.push(argmax(&step(m, &mut seq, &next)?));
        }
        m.free_sequence(seq);
        runs.push(out);
    }
    Ok(runs[0].iter().zip(&runs[1]).position(|(a, b)| a != b))
}

fn measure(label: &str, dir: &Path, text: &[u32]) -> Result<()> {
    let (_, f32_state) = load(dir, false)?;
    let (_, bf16_state) = load(dir, true)?;
    let models = [&f32_state, &bf16_state];
    let forced = teacher_forced(models, &text[..POSITIONS])?;
    let parting = greedy_parting(models, &text[..PROMPT])?;
    println!(
        "| {label} | {} | {:.2e} | {:.2e} | {} | {} |",
        forced.steps,
        forced.max_abs,
        forced.max_rel,
        forced.argmax_differs,
        parting.map_or("none (equal)".to_string(), |p| format!("token {p}")),
    );
    f32_state.shutdown()?;
    bf16_state.shutdown()?;
    Ok(())
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

fn main() -> Result<()> {
    println!(
        "| model | steps | max abs logit diff | max diff / logit range | argmax differs | greedy runs part at |"
    );
    println!("|---|---|---|---|---|---|");
    let default = root().join("models").join("default");
    let tokenizer = Tokenizer::from_file(default.join("tokenizer.json"))?;
    let corpus = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("data/fortunes-corpus.txt"),
    )?;
    let text = tokenizer.encode(&corpus[..corpus.len().min(20_000)], false)?;
    measure("default (trained)", &default, &text)?;
    for name in [
        "bamba",
        "granitemoehybrid",
        "mamba2",
        "nemotron_h",
        "qwen3_next",
    ] {
        let prompts: Vec<u32> = golden(name)?.into_iter().flat_map(|c| c.prompt).collect();
        let cycled: Vec<u32> = prompts.iter().copied().cycle().take(POSITIONS).collect();
        measure(name, &fixture_dir(name), &cycled)?;
    }
    Ok(())
}
