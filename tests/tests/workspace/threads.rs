//! Thread-count invariance: the CPU backend splits work by rows, heads or
//! output columns, never inside one sum, so a model's logits are bitwise the
//! same on one thread as on three (docs/ARCHITECTURE.md, Invariants). Run for
//! every fixture architecture, with a prefill in chunks (matrix products and
//! chunked scans) followed by single-token decode steps (matrix-vector
//! products and recurrent steps on the spinning team).

use anyhow::Result;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_model_engine::model::TransformerModel;
use metrale_tests::*;

/// All logits of a prompt: a prefill chunk of 40 rows (past the GEMV
/// limit of 32, so the matrix products are GEMMs), one of 9, then decode.
fn logits(model: &TransformerModel, tokens: &[u32]) -> Result<Vec<f32>> {
    let mut seq = model.new_sequence()?;
    let (a, b) = (tokens.len().min(40), tokens.len().min(49));
    let mut out = run_chunked(model, &mut seq, &tokens[..a], 40)?;
    out.extend(run_chunked(model, &mut seq, &tokens[a..b], 9)?);
    out.extend(run_chunked(model, &mut seq, &tokens[b..], 1)?);
    model.free_sequence(seq);
    Ok(out)
}

fn check(name: &str) -> Result<()> {
    let tokens = golden(name)?
        .into_iter()
        .map(|c| c.tokens)
        .max_by_key(Vec::len)
        .unwrap_or_default();
    assert!(
        tokens.len() > 49,
        "{name}: the longest golden prompt has {} tokens",
        tokens.len()
    );
    let mut runs = Vec::new();
    for threads in [1, 3] {
        let (_cpu, model) = load_on(name, CpuBackend::with_threads(threads))?;
        runs.push(logits(&model, &tokens)?);
        model.shutdown()?;
    }
    let (one, three) = (&runs[0], &runs[1]);
    assert_eq!(one.len(), three.len());
    let differing = one
        .iter()
        .zip(three)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(
        differing,
        0,
        "{name}: {differing} of {} logits differ between 1 and 3 threads (max diff {})",
        one.len(),
        max_abs_diff(one, three)
    );
    Ok(())
}

#[test]
fn llama_is_thread_count_invariant() -> Result<()> {
    check("llama")
}

#[test]
fn qwen3_is_thread_count_invariant() -> Result<()> {
    check("qwen3")
}

#[test]
fn mamba2_is_thread_count_invariant() -> Result<()> {
    check("mamba2")
}

#[test]
fn bamba_is_thread_count_invariant() -> Result<()> {
    check("bamba")
}

#[test]
fn nemotron_h_is_thread_count_invariant() -> Result<()> {
    check("nemotron_h")
}

#[test]
fn granitemoehybrid_is_thread_count_invariant() -> Result<()> {
    check("granitemoehybrid")
}

#[test]
fn qwen3_next_is_thread_count_invariant() -> Result<()> {
    check("qwen3_next")
}
