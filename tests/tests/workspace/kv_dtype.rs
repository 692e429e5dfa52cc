//! The narrow KV caches (the backend-owned layout asked for another
//! dtype), bf16 and f16: every fixture architecture with attention, prefill
//! then decode, against the golden logits and against the f32 cache. The
//! errors are printed (docs/ACCURACY.md quotes them); each bound is what
//! rounding keys and values to that dtype (8 significant bits for bf16, 11
//! for f16) may cost on these tiny models.

use std::sync::Arc;

use anyhow::Result;
use metrale_core::DType;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_engine::model::{ModelOptions, TransformerModel};
use metrale_model_weights::loader::WeightDType;
use metrale_tests::*;

/// Largest |logits - golden| allowed with a bf16 cache.
const BF16_KV_TOLERANCE: f32 = 2e-2;
/// Largest |logits - golden| allowed with an f16 cache: an eighth of
/// bf16's rounding.
const F16_KV_TOLERANCE: f32 = 4e-3;
/// With experts, a key rounded to bf16 may tip a router near-tie to another
/// expert for one token (measured: qwen3_5_moe, position 6 of one prompt,
/// 0.48, then 0.07 decaying to 0.01 over the following positions; the
/// argmax flips where the f32 cache's top two were 0.20 apart).
const BF16_KV_MOE_TOLERANCE: f32 = 0.5;

fn load_with(name: &str, kv_dtype: Option<DType>) -> Result<(Arc<CpuBackend>, TransformerModel)> {
    let cpu = Arc::new(CpuBackend::with_threads(2));
    let gpu: Arc<dyn GpuBackend> = cpu.clone();
    let options = ModelOptions {
        kv_dtype,
        ..options()
    };
    let model = TransformerModel::load(
        &fixture_dir(name),
        gpu,
        options,
        WeightDType::AsStored,
        &mut |_| {},
    )?;
    Ok((cpu, model))
}

/// Prefill the prompt, then decode the rest one token at a time.
fn prefill_then_decode(model: &TransformerModel, case: &GoldenCase) -> Result<Vec<f32>> {
    let mut seq = model.new_sequence()?;
    let p = case.prompt.len();
    let mut got = run_chunked(model, &mut seq, &case.prompt, p)?;
    got.extend(run_chunked(model, &mut seq, &case.tokens[p..], 1)?);
    model.free_sequence(seq);
    Ok(got)
}

/// What a narrow cache moved on one fixture, against the f32 cache's run.
struct Moved {
    vs_golden: f32,
    vs_f32: f32,
    argmax_differ: usize,
    rows: usize,
}

/// Every fixture with attention with a `dtype` cache, each held to `bound`.
fn narrow_cache_stays_close(dtype: DType, bound: f32) -> Result<()> {
    for name in MODELS {
        let (cpu, narrow) = load_with(name, Some(dtype))?;
        if narrow.config().attention_layers().next().is_none() {
            narrow.shutdown()?;
            continue;
        }
        assert_eq!(narrow.kv_cache().dtype(), dtype);
        let bound = match narrow.config().moe {
            Some(_) if dtype == DType::BF16 => BF16_KV_MOE_TOLERANCE,
            _ => bound,
        };
        let (_, f32_model) = load_with(name, None)?;
        assert_eq!(
            2 * f32_model.kv_cache().bytes_per_token(),
            4 * narrow.kv_cache().bytes_per_token(),
            "{name}: a {dtype} token takes half the bytes"
        );
        let m = compare(name, &narrow, &f32_model, bound)?;
        eprintln!(
            "{name}: {dtype} KV cache: max |Δ| vs golden {:.2e}, vs the f32 cache {:.2e}; \
             argmax differs on {} of {} rows",
            m.vs_golden, m.vs_f32, m.argmax_differ, m.rows
        );
        assert!(
            m.vs_golden <= bound,
            "{name}: a {dtype} KV cache moves the logits by {}",
            m.vs_golden
        );
        f32_model.shutdown()?;
        narrow.shutdown()?;
        assert_eq!(cpu.live_bytes(), 0);
    }
    Ok(())
}

/// `narrow` against the golden logits and against `f32_model`, every case
/// prefill then decode; an argmax may flip only at a near-tie.
fn compare(
    name: &str,
    narrow: &TransformerModel,
    f32_model: &TransformerModel,
    bound: f32,
) -> Result<Moved> {
    let mut m = Moved {
        vs_golden: 0.0,
        vs_f32: 0.0,
        argmax_differ: 0,
        rows: 0,
    };
    for case in golden(name)? {
        let got = prefill_then_decode(narrow, &case)?;
        let reference = prefill_then_decode(f32_model, &case)?;
        m.vs_golden = m.vs_golden.max(max_abs_diff(&got, &case.logits));
        m.vs_f32 = m.vs_f32.max(max_abs_diff(&got, &reference));
        for (a, b) in got.chunks(case.vocab).zip(reference.chunks(case.vocab)) {
            m.rows += 1;
            if argmax(a) != argmax(b) {
                m.argmax_differ += 1;
                // Only a near-tie may flip: the f32 cache's best two are
                // closer than the rounding moves a logit (twice).
                let gap = b[argmax(b) as usize] - b[argmax(a) as usize];
                assert!(
                    gap <= 2.0 * bound,
                    "{name}: argmax flipped with a top-2 gap of {gap}"
                );
            }
        }
    }
    Ok(m)
}

#[test]
fn a_bf16_kv_cache_stays_close_to_f32_and_golden() -> Result<()> {
    narrow_cache_stays_close(DType::BF16, BF16_KV_TOLERANCE)
}

#[test]
fn an_f16_kv_cache_stays_close_to_f32_and_golden() -> Result<()> {
    narrow_cache_stays_close(DType::F16, F16_KV_TOLERANCE)
}

#[test]
fn a_kv_dtype_the_backend_cannot_store_is_refused_at_load() {
    let err = load_with("llama", Some(DType::I32)).err().expect("refused");
    let text = format!("{err:#}");
    assert!(text.contains("i32") && text.contains("KV cache"), "{text}");
}
