//! Every architecture against the golden logits of Hugging Face transformers:
//! one prefill, prefill-then-decode, chunked prefill, greedy decoding.

use anyhow::Result;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_engine::model::{Logits, Step};
use metrale_tests::*;

fn check_model(name: &str) -> Result<()> {
    let (cpu, model) = load(name)?;
    for (i, case) in golden(name)?.iter().enumerate() {
        // One prefill over every token.
        let mut seq = model.new_sequence()?;
        let all = run_chunked(&model, &mut seq, &case.tokens, case.tokens.len())?;
        let d = max_abs_diff(&all, &case.logits);
        eprintln!("{name} prompt {i}: one prefill max diff {d:.2e}");
        assert!(
            d <= TOLERANCE,
            "{name} prompt {i}: one prefill differs by {d}"
        );
        model.free_sequence(seq);

        // Prefill the prompt, then one token at a time through the decode path.
        let mut seq = model.new_sequence()?;
        let p = case.prompt.len();
        let mut got = run_chunked(&model, &mut seq, &case.prompt, p)?;
        got.extend(run_chunked(&model, &mut seq, &case.tokens[p..], 1)?);
        let d = max_abs_diff(&got, &case.logits);
        assert!(
            d <= TOLERANCE,
            "{name} prompt {i}: prefill+decode differs by {d}"
        );
        model.free_sequence(seq);

        // Chunks of 5.
        let mut seq = model.new_sequence()?;
        let got = run_chunked(&model, &mut seq, &case.tokens, 5)?;
        let d = max_abs_diff(&got, &case.logits);
        assert!(
            d <= TOLERANCE,
            "{name} prompt {i}: chunked prefill differs by {d}"
        );
        model.free_sequence(seq);

        // Greedy decoding reproduces the golden continuation.
        let mut seq = model.new_sequence()?;
        let mut tokens = case.prompt.clone();
        let mut next_input = case.prompt.clone();
        while tokens.len() < case.tokens.len() {
            let mut steps = [Step {
                seq: &mut seq,
                tokens: &next_input,
                logits: Logits::Last,
            }];
            let logits = model.forward(&mut steps)?.remove(0);
            let next = argmax(&logits);
            tokens.push(next);
            next_input = vec![next];
        }
        assert_eq!(
            tokens, case.tokens,
            "{name} prompt {i}: greedy continuation"
        );
        model.free_sequence(seq);
    }
    assert_eq!(model.kv_cache().used_blocks(), 0);
    assert_eq!(model.ssm_pool().in_use(), 0);
    model.shutdown()?;
    assert_eq!(cpu.live_bytes(), 0, "ledger empty after teardown");
    Ok(())
}

#[test]
fn llama_matches_golden() -> Result<()> {
    check_model("llama")
}

#[test]
fn qwen3_matches_golden() -> Result<()> {
    check_model("qwen3")
}

#[test]
fn mamba2_matches_golden() -> Result<()> {
    check_model("mamba2")
}

#[test]
fn bamba_matches_golden() -> Result<()> {
    check_model("bamba")
}

#[test]
fn nemotron_h_matches_golden() -> Result<()> {
    check_model("nemotron_h")
}

#[test]
fn granitemoehybrid_matches_golden() -> Result<()> {
    check_model("granitemoehybrid")
}

#[test]
fn qwen3_next_matches_golden() -> Result<()> {
    check_model("qwen3_next")
}

#[test]
fn nemotron_h_moe_matches_golden() -> Result<()> {
    check_model("nemotron_h_moe")
}

#[test]
fn qwen3_5_matches_golden() -> Result<()> {
    check_model("qwen3_5")
}

#[test]
fn qwen3_5_moe_matches_golden() -> Result<()> {
    check_model("qwen3_5_moe")
}

#[test]
fn lfm2_matches_golden() -> Result<()> {
    check_model("lfm2")
}

#[test]
fn lfm2_moe_matches_golden() -> Result<()> {
    check_model("lfm2_moe")
}

#[test]
fn lfm2_vl_matches_golden() -> Result<()> {
    check_model("lfm2_vl")
}
