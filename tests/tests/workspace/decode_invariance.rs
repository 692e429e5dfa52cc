//! A decode row's logits are bitwise the same whatever else its step holds:
//! a sequence decoding alone and the same sequence decoding among 63
//! others, in f32 arithmetic (the GEMV path, up to 64 rows) and with bf16
//! weights and bf16 dot products (`gemm_bf16`, the weights packed in panels
//! at load where their shapes allow and per call elsewhere; invariant at
//! any size), for every fixture architecture. (Past 64 rows f32 takes a
//! blocked GEMM, whose sums depend on the tiling.)

use std::sync::Arc;

use anyhow::{Result, ensure};
use metrale_core::DType;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_engine::model::{
    Logits, ModelOptions, PrefixCacheOptions, Sequence, Step, TransformerModel,
};
use metrale_model_weights::loader::WeightDType;
use metrale_tests::{MODELS, argmax, fixture_dir, golden};

/// Decode steps compared after the prefill.
const STEPS: usize = 3;

/// With bf16 dot products the weights are held in bf16 (what those
/// products multiply); without, as stored.
fn load(name: &str, bf16_dot: bool, batch: usize) -> Result<(Arc<CpuBackend>, TransformerModel)> {
    let cpu = Arc::new(CpuBackend::with_threads(2).with_bf16_dot_products(bf16_dot));
    let gpu: Arc<dyn GpuBackend> = cpu.clone();
    let options = ModelOptions {
        kv_block_size: 16,
        kv_blocks: 4 * 2 * batch,
        // The batch, and as many sequences again decoding alone.
        max_seqs: 2 * batch,
        max_batch_tokens: 256,
        kv_dtype: None,
        kv_follows_weights: false,
        ssm_state_dtype: None,
        ssm_state_follows_weights: false,
        cuda_graphs: true,
        prefix_cache: PrefixCacheOptions::disabled(),
    };
    let model = TransformerModel::load(
        &fixture_dir(name),
        gpu,
        options,
        if bf16_dot {
            WeightDType::BF16
        } else {
            WeightDType::AsStored
        },
        &mut |_| {},
    )?;
    if cpu.bf16_dot_products() {
        // The weights the shapes allow are packed in panels at load.
        let store = model.weight_store().expect("loaded");
        let packed = store
            .names()
            .filter(|n| store.get(n).is_ok_and(|t| t.dtype() == DType::BF16Panels))
            .count();
        ensure!(packed > 0, "{name}: no weight was packed in panels");
    }
    Ok((cpu, model))
}

/// `batch` prompts of 3 to 40 tokens from the golden prompts.
fn prompts(name: &str, batch: usize) -> Result<Vec<Vec<u32>>> {
    let all: Vec<u32> = golden(name)?.into_iter().flat_map(|c| c.prompt).collect();
    Ok((0..batch)
        .map(|i| {
            let len = 3 + (i * 7) % 38;
            (0..len).map(|j| all[(i * 5 + j) % all.len()]).collect()
        })
        .collect())
}

fn prefill(model: &TransformerModel, prompt: &[u32]) -> Result<(Sequence, u32)> {
    let mut seq = model.new_sequence()?;
    let logits = model
        .forward(&mut [Step {
            seq: &mut seq,
            tokens: prompt,
            logits: Logits::Last,
        }])?
        .remove(0);
    Ok((seq, argmax(&logits)))
}

fn check(name: &str, bf16_dot: bool, batch: usize) -> Result<()> {
    let (cpu, model) = load(name, bf16_dot, batch)?;
    let prompts = prompts(name, batch)?;
    // Two copies of every sequence, prefilled alike (each alone).
    let (mut together, mut next): (Vec<Sequence>, Vec<u32>) = (Vec::new(), Vec::new());
    let mut alone = Vec::new();
    for p in &prompts {
        let (seq, token) = prefill(&model, p)?;
        together.push(seq);
        next.push(token);
        alone.push(prefill(&model, p)?.0);
    }
    for step in 0..STEPS {
        let tokens: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let mut steps: Vec<Step<'_>> = together
            .iter_mut()
            .zip(&tokens)
            .map(|(seq, t)| Step {
                seq,
                tokens: t,
                logits: Logits::Last,
            })
            .collect();
        let batched = model.forward(&mut steps)?;
        for (i, seq) in alone.iter_mut().enumerate() {
            let single = model
                .forward(&mut [Step {
                    seq,
                    tokens: &tokens[i],
                    logits: Logits::Last,
                }])?
                .remove(0);
            ensure!(
                single == batched[i],
                "{name} (bf16 dot products: {bf16_dot}): sequence {i} of {batch}, decode step \
                 {step}: max difference {}",
                metrale_tests::max_abs_diff(&single, &batched[i])
            );
        }
        next = batched.iter().map(|l| argmax(l)).collect();
    }
    for seq in together.into_iter().chain(alone) {
        model.free_sequence(seq);
    }
    model.shutdown()?;
    ensure!(cpu.live_bytes() == 0, "{name}: the ledger is not empty");
    Ok(())
}

#[test]
fn f32_decode_rows_do_not_depend_on_the_batch() -> Result<()> {
    for name in MODELS {
        check(name, false, 64)?;
    }
    Ok(())
}

#[test]
fn bf16_decode_rows_do_not_depend_on_the_batch() -> Result<()> {
    for name in MODELS {
        check(name, true, 64)?;
    }
    Ok(())
}
