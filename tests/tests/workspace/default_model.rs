//! The bundled default model (`models/default/`, trained by
//! `scripts/train_default_model.py`): its logits match Hugging Face
//! transformers' golden file within the fixtures' tolerance, and its text is
//! readable English rather than recited training data.
//!
//! Readability: fixed prompts and seeds through `metrale::Generator` with the
//! model's own sampling defaults (generation_config.json); at least 80% of
//! the words of three or more letters must be in Debian's `wamerican` word
//! list (tests/data/american-english). The longest verbatim run of words
//! shared with the training corpus (tests/data/fortunes-corpus.txt) is
//! reported. Run with `--nocapture` to see the texts.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Result;
use metrale::gpu_runtime::cpu::CpuBackend;
use metrale::gpu_runtime::gpu::GpuBackend;
use metrale::{EngineConfig, Generator, LoadOptions, Model};
use metrale_model_engine::model::TransformerModel;
use metrale_model_weights::loader::WeightDType;
use metrale_tests::*;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

fn model_dir() -> PathBuf {
    root().join("models").join("default")
}

fn data(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("data")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn default_model_matches_golden() -> Result<()> {
    let cpu = Arc::new(CpuBackend::with_threads(2));
    let gpu: Arc<dyn GpuBackend> = cpu.clone();
    let model = TransformerModel::load(
        &model_dir(),
        gpu,
        options(),
        WeightDType::AsStored,
        &mut |_| {},
    )?;
    let cases = golden_file(&fixture_dir("default_model").join("golden.safetensors"))?;
    assert_eq!(cases.len(), 4);
    for (i, case) in cases.iter().enumerate() {
        let mut seq = model.new_sequence()?;
        let all = run_chunked(&model, &mut seq, &case.tokens, case.tokens.len())?;
        let d1 = max_abs_diff(&all, &case.logits);
        model.free_sequence(seq);

        let mut seq = model.new_sequence()?;
        let p = case.prompt.len();
        let mut got = run_chunked(&model, &mut seq, &case.prompt, p)?;
        got.extend(run_chunked(&model, &mut seq, &case.tokens[p..], 1)?);
        let d2 = max_abs_diff(&got, &case.logits);
        model.free_sequence(seq);

        let scale = case.logits.iter().fold(0f32, |m, x| m.max(x.abs()));
        eprintln!(
            "default model prompt {i} ({p} + {} tokens, max |logit| {scale:.2}): \
             one prefill max diff {d1:.2e}, prefill+decode max diff {d2:.2e}",
            case.tokens.len() - p
        );
        assert!(d1 <= TOLERANCE, "prompt {i}: one prefill differs by {d1}");
        assert!(
            d2 <= TOLERANCE,
            "prompt {i}: prefill+decode differs by {d2}"
        );

        // Greedy decoding (argmax of the logits) reproduces the continuation.
        for (pos, want) in case.tokens[p..].iter().enumerate() {
            let row = &got[(p - 1 + pos) * case.vocab..(p + pos) * case.vocab];
            assert_eq!(argmax(row), *want, "prompt {i}: greedy token {pos}");
        }
    }
    assert_eq!(model.kv_cache().used_blocks(), 0);
    model.shutdown()?;
    assert_eq!(cpu.live_bytes(), 0, "ledger empty after teardown");
    Ok(())
}

/// Lower-case runs of ASCII letters, digits and apostrophes.
fn words(text: &str) -> Vec<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '\''))
        .map(|w| w.trim_matches('\'').to_ascii_lowercase())
        .filter(|w| !w.is_empty())
        .collect()
}

/// The longest run of consecutive words of `text` that occurs verbatim (as
/// words, ignoring case and punctuation) in `corpus` (its words joined by
/// single spaces, with a space at each end).
fn longest_overlap(text: &[String], corpus: &str) -> Vec<String> {
    let mut best: &[String] = &[];
    for i in 0..text.len() {
        let mut j = i + best.len() + 1;
        while j <= text.len() {
            let needle = format!(" {} ", text[i..j].join(" "));
            if !corpus.contains(&needle) {
                break;
            }
            best = &text[i..j];
            j += 1;
        }
    }
    best.to_vec()
}

const PROMPTS: [&str; 6] = [
    "The meaning of life is",
    "A friend is someone who",
    "The trouble with computers is",
    "Love is",
    "Never trust a man who",
    "The secret of happiness is",
];
const SEEDS: [u64; 3] = [1, 2, 3];

#[test]
fn default_model_writes_readable_english() -> Result<()> {
    let list: HashSet<String> = data("american-english")
        .lines()
        .map(|w| w.to_ascii_lowercase())
        .collect();
    let corpus = format!(" {} ", words(&data("fortunes-corpus.txt")).join(" "));

    let cpu = Arc::new(CpuBackend::with_threads(2));
    let gpu: Arc<dyn GpuBackend> = cpu.clone();
    let model = Model::load_on(&model_dir(), gpu, &LoadOptions::default(), &mut |_| {})?;
    let mut g: Generator = model.into_generator(EngineConfig::default())?;
    let defaults = g.default_params();
    assert!(defaults.temperature > 0.0, "the model's defaults sample");

    let (mut known, mut counted) = (0usize, 0usize);
    let mut longest: Vec<String> = Vec::new();
    let mut longest_at = String::new();
    for prompt in PROMPTS {
        for seed in SEEDS {
            let mut params = defaults.clone();
            params.seed = Some(seed);
            let out = g.generate(prompt, &params)?;
            let ws = words(&out.text);
            let long: Vec<&String> = ws
                .iter()
                .filter(|w| w.chars().filter(|c| c.is_ascii_alphabetic()).count() >= 3)
                .collect();
            let k = long.iter().filter(|w| list.contains(w.as_str())).count();
            known += k;
            counted += long.len();
            let overlap = longest_overlap(&ws, &corpus);
            eprintln!(
                "[seed {seed}] {prompt}|{} ({k}/{} words in the list; longest run in the corpus: {} words)",
                out.text.replace('\n', "\\n"),
                long.len(),
                overlap.len()
            );
            if overlap.len() > longest.len() {
                longest = overlap;
                longest_at = format!("{prompt:?}, seed {seed}");
            }
        }
    }
    g.shutdown()?;
    let share = known as f64 / counted.max(1) as f64;
    eprintln!(
        "words of 3+ letters in the wamerican list: {known}/{counted} = {:.1}%",
        100.0 * share
    );
    eprintln!(
        "longest verbatim overlap with the training corpus: {} words ({longest_at}): {:?}",
        longest.len(),
        longest.join(" ")
    );
    assert!(counted >= 100, "too little text to judge: {counted} words");
    assert!(
        share >= 0.8,
        "only {:.1}% of words are English",
        100.0 * share
    );
    Ok(())
}
