//! Batch invariance: a sequence's logits are the same alone and batched with
//! other sequences of other lengths at other positions, with prefill chunks
//! and single decode tokens mixed in one step. And per-sequence memory
//! (KV blocks, SSM slots) returns to its pool when a sequence ends.

use anyhow::Result;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_engine::model::{Logits, Sequence, Step, TransformerModel};
use metrale_tests::*;

/// Allowed difference between a sequence alone and batched: none. Every
/// step here has at most 32 rows, where each row's products are summed in
/// one order whatever shares the step (the GEMV path; beyond 32 rows the
/// blocked GEMM sums in an order that depends on the tiling).
const BATCH_TOLERANCE: f32 = 0.0;

/// Chunk lengths for the sequence under test: a prefill in pieces, then decode.
fn schedule(len: usize) -> Vec<usize> {
    let mut out = vec![9, 14];
    let mut used = 23;
    while used < len {
        out.push(1);
        used += 1;
    }
    out
}

fn feed(model: &TransformerModel, seq: &mut Sequence, tokens: &[u32]) -> Result<Vec<f32>> {
    Ok(model
        .forward(&mut [Step {
            seq,
            tokens,
            logits: Logits::All,
        }])?
        .remove(0))
}

fn check(name: &str) -> Result<()> {
    let (cpu, model) = load(name)?;
    let cases = golden(name)?;
    let subject = &cases[1].tokens; // 61 tokens
    let (other_a, other_b) = (&cases[0].tokens, &cases[3].tokens);

    // Alone.
    let mut alone = model.new_sequence()?;
    let mut expected = Vec::new();
    let mut at = 0;
    for n in schedule(subject.len()) {
        expected.push(feed(&model, &mut alone, &subject[at..at + n])?);
        at += n;
    }
    model.free_sequence(alone);

    // Batched: two other sequences already at other positions, advancing by
    // other amounts in the same steps.
    let mut a = model.new_sequence()?;
    let mut b = model.new_sequence()?;
    feed(&model, &mut a, &other_a[..5])?;
    feed(&model, &mut b, &other_b[..30])?;
    let (mut pa, mut pb) = (5, 30);
    let mut seq = model.new_sequence()?;
    let mut at = 0;
    for (step, n) in schedule(subject.len()).into_iter().enumerate() {
        let na = if pa < other_a.len() { 1 } else { 0 };
        let nb = (step % 3 + 1).min(other_b.len() - pb);
        let mut steps = [
            Step {
                seq: &mut a,
                tokens: &other_a[pa..pa + na],
                logits: Logits::Last,
            },
            Step {
                seq: &mut seq,
                tokens: &subject[at..at + n],
                logits: Logits::All,
            },
            Step {
                seq: &mut b,
                tokens: &other_b[pb..pb + nb],
                logits: Logits::All,
            },
        ];
        let out = model.forward(&mut steps)?;
        let d = max_abs_diff(&out[1], &expected[step]);
        assert!(
            d <= BATCH_TOLERANCE,
            "{name}: step {step} differs by {d} when batched"
        );
        at += n;
        pa += na;
        pb += nb;
    }
    for s in [a, b, seq] {
        model.free_sequence(s);
    }
    assert_eq!(
        model.kv_cache().used_blocks(),
        0,
        "{name}: KV blocks returned"
    );
    assert_eq!(model.ssm_pool().in_use(), 0, "{name}: SSM slots returned");
    model.shutdown()?;
    assert_eq!(cpu.live_bytes(), 0);
    Ok(())
}

#[test]
fn llama_is_batch_invariant() -> Result<()> {
    check("llama")
}

#[test]
fn qwen3_is_batch_invariant() -> Result<()> {
    check("qwen3")
}

#[test]
fn mamba2_is_batch_invariant() -> Result<()> {
    check("mamba2")
}

#[test]
fn bamba_is_batch_invariant() -> Result<()> {
    check("bamba")
}

#[test]
fn nemotron_h_is_batch_invariant() -> Result<()> {
    check("nemotron_h")
}

#[test]
fn granitemoehybrid_is_batch_invariant() -> Result<()> {
    check("granitemoehybrid")
}

#[test]
fn qwen3_next_is_batch_invariant() -> Result<()> {
    check("qwen3_next")
}

#[test]
fn nemotron_h_moe_is_batch_invariant() -> Result<()> {
    check("nemotron_h_moe")
}

#[test]
fn kv_blocks_follow_sequence_length_and_return_when_it_ends() -> Result<()> {
    let (cpu, model) = load("llama")?;
    let block = model.options().kv_block_size;
    let mut seq = model.new_sequence()?;
    let tokens: Vec<u32> = (1..=40).collect();
    feed(&model, &mut seq, &tokens[..block])?;
    assert_eq!(seq.kv_blocks(), 1);
    feed(&model, &mut seq, &tokens[block..block + 1])?;
    assert_eq!(seq.kv_blocks(), 2, "one more token opens a second block");
    assert_eq!(model.kv_cache().used_blocks(), 2);
    model.free_sequence(seq);
    let kv = model.kv_cache();
    assert_eq!(kv.used_blocks(), 0);
    assert_eq!(kv.free_blocks(), kv.num_blocks());
    drop(kv);
    model.shutdown()?;
    assert_eq!(cpu.live_bytes(), 0);
    Ok(())
}

#[test]
fn an_exhausted_slot_pool_is_an_error_not_a_panic() -> Result<()> {
    let (_cpu, model) = load("mamba2")?;
    let held: Vec<Sequence> = (0..model.ssm_pool().capacity())
        .map(|_| model.new_sequence())
        .collect::<Result<_, _>>()?;
    let err = model.new_sequence().unwrap_err();
    assert!(err.to_string().contains("SSM state slots"), "{err}");
    for s in held {
        model.free_sequence(s);
    }
    assert_eq!(model.ssm_pool().in_use(), 0);
    model.new_sequence().map(|s| model.free_sequence(s))?;
    model.shutdown()
}
