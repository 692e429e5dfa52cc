//! The config sweep (`tests/fixtures/sweep`): for each supported model
//! type, small random-weight checkpoints varying one semantic config field at
//! a time (spec.json says which fields and values), each with transformers'
//! logits and greedy continuations. Every variant runs on the exact f32 path
//! in one prefill, prefill then decode, and chunked prefill (within the
//! fixtures' 1e-4), and through the facade's `generate` (the same tokens as
//! transformers' greedy decoding wherever its top-1 margin is above 1e-4).
//! A spec entry without its variant fails the coverage test, so no variant
//! can be quietly left out.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail, ensure};
use metrale::gpu_runtime::cpu::CpuBackend;
use metrale::gpu_runtime::gpu::GpuBackend;
use metrale::{EngineConfig, LoadOptions, Model, SamplingParams};
use metrale_model_engine::config::ModelType;
use metrale_model_engine::model::{ModelOptions, TransformerModel};
use metrale_tests::{GoldenCase, TOLERANCE, golden_file, max_abs_diff, run_chunked};
use serde_json::Value;

/// A greedy difference is a bug only where transformers' top-1 margin is
/// larger than this (else it is a question of rounding).
const MARGIN: f32 = 1e-4;

fn sweep_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/sweep")
}

fn read_json(name: &str) -> Result<Value> {
    let path = sweep_dir().join(name);
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    serde_json::from_str(&text).with_context(|| path.display().to_string())
}

/// Every variant folder of `arch` (relative to the sweep), base first.
fn variant_dirs(arch: &str) -> Result<Vec<String>> {
    let index = read_json("index.json")?;
    let fields = index[arch]
        .as_object()
        .with_context(|| format!("index.json has no {arch}"))?;
    let base = format!("{arch}/base");
    let rest: BTreeSet<String> = fields
        .values()
        .flat_map(|v| v.as_array().into_iter().flatten())
        .filter_map(|d| d.as_str().map(str::to_owned))
        .collect();
    let mut dirs = vec![base.clone()];
    dirs.extend(rest.into_iter().filter(|d| *d != base));
    Ok(dirs)
}

#[test]
fn every_spec_entry_has_its_variant() -> Result<()> {
    let spec = read_json("spec.json")?;
    let index = read_json("index.json")?;
    let archs = spec["architectures"]
        .as_object()
        .context("spec.json: architectures")?;
    // An entry is a model type, or names the model type it is a second base of.
    let model_type =
        |(name, entry): (&String, &Value)| entry["model_type"].as_str().unwrap_or(name).to_owned();
    let covered: BTreeSet<String> = archs.iter().map(model_type).collect();
    for t in ModelType::ALL {
        ensure!(
            covered.contains(t.as_str()),
            "spec.json has no entry for model type {}",
            t.as_str()
        );
    }
    let mut total = 0;
    for (arch, entry) in archs {
        let fields = entry["fields"].as_object().context("fields")?;
        let mut listed = BTreeSet::from([format!("{arch}/base")]);
        for (field, f) in fields {
            let values = f["values"].as_array().context("values")?;
            let dirs = index[arch][field]
                .as_array()
                .with_context(|| format!("index.json has no variants for {arch}.{field}"))?;
            ensure!(
                dirs.len() == values.len(),
                "{arch}.{field}: spec.json lists {} values, index.json {} variants",
                values.len(),
                dirs.len()
            );
            for d in dirs {
                let d = d.as_str().context("variant folder")?;
                listed.insert(d.to_owned());
            }
        }
        for d in &listed {
            for file in ["config.json", "model.safetensors", "golden.safetensors"] {
                let path = sweep_dir().join(d).join(file);
                ensure!(path.is_file(), "{} is missing", path.display());
            }
        }
        // Nothing on disk that the spec does not ask for (a stale variant).
        for e in std::fs::read_dir(sweep_dir().join(arch))? {
            let name = format!("{arch}/{}", e?.file_name().to_string_lossy());
            ensure!(listed.contains(&name), "{name} is not in index.json");
        }
        eprintln!("{arch}: {} variants", listed.len());
        total += listed.len();
    }
    eprintln!("sweep: {total} variants");
    Ok(())
}

/// The worst |Δlogit| of one variant over every path and prompt.
fn check_variant(rel: &str, scratch: &Path) -> Result<f32> {
    let src = sweep_dir().join(rel);
    let cases = golden_file(&src.join("golden.safetensors"))?;
    let margins = margins(&src.join("golden.safetensors"), cases.len())?;
    let prompts: Vec<String> = read_json("spec.json")?["prompts"]
        .as_array()
        .context("prompts")?
        .iter()
        .filter_map(|p| p.as_str().map(str::to_owned))
        .collect();
    // A model folder as users have it: the variant plus the shared tokenizer.
    let dir = scratch.join(rel);
    std::fs::create_dir_all(&dir)?;
    for (from, names) in [
        (
            &src,
            &["config.json", "model.safetensors", "generation_config.json"][..],
        ),
        (
            &sweep_dir().join("tokenizer"),
            &["tokenizer.json", "tokenizer_config.json"][..],
        ),
    ] {
        for name in names {
            if from.join(name).is_file() {
                std::fs::copy(from.join(name), dir.join(name))?;
            }
        }
    }
    let cpu = Arc::new(CpuBackend::with_threads(2));
    let gpu: Arc<dyn GpuBackend> = cpu.clone();
    let options = LoadOptions {
        model: ModelOptions {
            kv_block_size: 16,
            kv_blocks: 64,
            max_seqs: 4,
            max_batch_tokens: 128,
            kv_dtype: None,
            kv_follows_weights: false,
            ssm_state_dtype: None,
            ssm_state_follows_weights: false,
            cuda_graphs: true,
            prefix_cache: Default::default(),
        },
        ..LoadOptions::default()
    };
    let model = Model::load_on(&dir, gpu, &options, &mut |_| {})?;
    let worst = logits_paths(model.engine(), &cases);
    let mut generator = model.into_generator(EngineConfig::default())?;
    let greedy = (|| -> Result<()> {
        for (i, (case, prompt)) in cases.iter().zip(&prompts).enumerate() {
            ensure!(
                generator.encode(prompt)? == case.prompt,
                "prompt {i}: the tokenizer disagrees with transformers'"
            );
            let params = SamplingParams {
                max_tokens: Some(case.tokens.len() - case.prompt.len()),
                ignore_eos: true,
                ..SamplingParams::greedy()
            };
            let out = generator.generate(prompt, &params)?;
            if margins[i] > MARGIN {
                ensure!(
                    out.tokens == case.tokens[case.prompt.len()..],
                    "prompt {i}: generate gave {:?}, transformers {:?} (margin {})",
                    out.tokens,
                    &case.tokens[case.prompt.len()..],
                    margins[i]
                );
            }
        }
        Ok(())
    })();
    let shutdown = generator.shutdown();
    let worst = worst?;
    greedy?;
    shutdown?;
    ensure!(cpu.live_bytes() == 0, "teardown left memory on the ledger");
    std::fs::remove_dir_all(&dir).ok();
    Ok(worst)
}

/// One prefill, prefill then decode, chunks of 3 and 5: the worst |Δlogit|,
/// or an error naming the first path beyond the tolerance.
fn logits_paths(model: &TransformerModel, cases: &[GoldenCase]) -> Result<f32> {
    let mut worst = 0f32;
    for (i, case) in cases.iter().enumerate() {
        let n = case.tokens.len();
        let p = case.prompt.len();
        let paths: [(&str, Vec<(usize, usize)>); 4] = [
            ("one prefill", vec![(n, n)]),
            ("prefill then decode", vec![(p, p), (n - p, 1)]),
            ("chunks of 3", vec![(n, 3)]),
            ("chunks of 5", vec![(n, 5)]),
        ];
        for (name, plan) in paths {
            let mut seq = model.new_sequence()?;
            let mut got = Vec::new();
            let mut start = 0;
            let run = (|| -> Result<()> {
                for (len, chunk) in plan {
                    let part = &case.tokens[start..start + len];
                    got.extend(run_chunked(model, &mut seq, part, chunk)?);
                    start += len;
                }
                Ok(())
            })();
            model.free_sequence(seq);
            run?;
            let d = max_abs_diff(&got, &case.logits);
            ensure!(
                d <= TOLERANCE,
                "prompt {i}: {name} differs from transformers by {d:.3e}"
            );
            worst = worst.max(d);
        }
    }
    Ok(worst)
}

/// `min_top1_margin_{i}` of each prompt, from the golden file's metadata.
fn margins(path: &Path, n: usize) -> Result<Vec<f32>> {
    let bytes = std::fs::read(path)?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)?;
    let meta = meta.metadata().clone().unwrap_or_default();
    (0..n)
        .map(|i| {
            let key = format!("min_top1_margin_{i}");
            meta.get(&key)
                .with_context(|| format!("{}: no {key}", path.display()))?
                .parse::<f32>()
                .with_context(|| format!("{}: {key}", path.display()))
        })
        .collect()
}

/// Runs every variant of `arch`; fails listing every variant that failed.
fn check_arch(arch: &str) -> Result<()> {
    let scratch = std::env::temp_dir().join(format!("metrale-sweep-{}", std::process::id()));
    let mut failures = Vec::new();
    let mut worst = (0f32, String::new());
    let dirs = variant_dirs(arch)?;
    for rel in &dirs {
        match check_variant(rel, &scratch) {
            Ok(d) => {
                if d >= worst.0 {
                    worst = (d, rel.clone());
                }
            }
            Err(e) => failures.push(format!("{rel}: {e:#}")),
        }
    }
    eprintln!(
        "{arch}: {} variants, {} failed; worst |Δlogit| of the passing ones {:.2e} ({})",
        dirs.len(),
        failures.len(),
        worst.0,
        worst.1
    );
    if !failures.is_empty() {
        bail!(
            "{} variant(s) failed:\n{}",
            failures.len(),
            failures.join("\n")
        );
    }
    Ok(())
}

#[test]
fn sweep_llama() -> Result<()> {
    check_arch("llama")
}

#[test]
fn sweep_qwen2() -> Result<()> {
    check_arch("qwen2")
}

#[test]
fn sweep_qwen3() -> Result<()> {
    check_arch("qwen3")
}

#[test]
fn sweep_mistral() -> Result<()> {
    check_arch("mistral")
}

#[test]
fn sweep_mamba2() -> Result<()> {
    check_arch("mamba2")
}

#[test]
fn sweep_bamba() -> Result<()> {
    check_arch("bamba")
}

#[test]
fn sweep_nemotron_h() -> Result<()> {
    check_arch("nemotron_h")
}

#[test]
fn sweep_nemotron_h_moe() -> Result<()> {
    check_arch("nemotron_h_moe")
}

#[test]
fn sweep_granitemoehybrid() -> Result<()> {
    check_arch("granitemoehybrid")
}

#[test]
fn sweep_qwen3_next() -> Result<()> {
    check_arch("qwen3_next")
}

#[test]
fn sweep_qwen3_5() -> Result<()> {
    check_arch("qwen3_5")
}

#[test]
fn sweep_qwen3_5_moe() -> Result<()> {
    check_arch("qwen3_5_moe")
}

#[test]
fn sweep_lfm2() -> Result<()> {
    check_arch("lfm2")
}

#[test]
fn sweep_lfm2_moe() -> Result<()> {
    check_arch("lfm2_moe")
}
