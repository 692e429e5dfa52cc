//! The checks themselves. Each returns the detail of its `PASS` line, or an
//! error that becomes its `FAIL` line; detail lines are printed indented
//! as they go.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use metrale_core::DType;
use metrale_gpu_runtime::conformance::{self, Status};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_engine::config::{FfnNames, MixerKind, ModelConfig, load_config};
use metrale_model_engine::conformance::{arch_shapes, required_ops};
use metrale_model_engine::engine::{Engine, EngineConfig, Event, RequestId};
use metrale_model_engine::model::{ModelOptions, TransformerModel};
use metrale_model_engine::sampling::SamplingParams;
use metrale_model_engine::tokenizer::Tokenizer;
use metrale_model_weights::loader::WeightDType;
use metrale_tests::{GoldenCase, argmax, golden_file, max_abs_diff, run_chunked};

use crate::{Args, BackendKind};

/// Every fixture architecture: conformance at its shapes, then golden
/// parity where the backend has every op it needs, else its refusal.
pub const FIXTURES: [&str; 11] = [
    "llama",
    "qwen3",
    "mamba2",
    "bamba",
    "nemotron_h",
    "granitemoehybrid",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "lfm2",
    "lfm2_moe",
];
/// Concurrent requests of the generation check.
const CONCURRENT: usize = 16;

/// The line the device check prints with the device's name.
pub const DEVICE_NAME_PREFIX: &str = "info device-name: ";

static DEVICE_NAME: OnceLock<String> = OnceLock::new();

/// The device name the device check printed, in this process.
pub fn device_name_seen() -> Option<String> {
    DEVICE_NAME.get().cloned()
}

/// Every check, in the order they run.
pub fn names(args: &Args) -> Vec<String> {
    let mut names = vec!["device".to_string()];
    let (runnable, refused): (Vec<&str>, Vec<&str>) =
        FIXTURES.iter().partition(|f| runs_here(args, f));
    names.extend(runnable.iter().map(|f| format!("conformance/{f}")));
    names.extend(runnable.iter().map(|f| format!("parity/{f}")));
    names.extend(refused.iter().map(|f| format!("refusal/{f}")));
    for f in ["llama", "granitemoehybrid"] {
        if runs_here(args, f) {
            names.push(format!("generation/{f}"));
            names.push(format!("teardown/{f}"));
        }
    }
    if !args.no_bench {
        // Each shape at each batch, with CUDA graphs and without.
        for shape in ["llama", "granite"] {
            for b in &args.bench_batches {
                names.push(format!("bench/{shape}/b{b}"));
                names.push(format!("bench/{shape}/b{b}/eager"));
            }
        }
    }
    if args.selftests {
        names.extend(SELFTESTS.iter().map(|s| s.to_string()));
    }
    names
}

/// Whether the backend under test has every op fixture `name` needs (the
/// CUDA backend's list; the CPU stand-in lacks what it lacks). A fixture
/// whose config cannot be read counts as runnable: its parity check then
/// fails saying why.
fn runs_here(args: &Args, name: &str) -> bool {
    let Ok(config) = fixture(args, name).and_then(|dir| Ok(load_config(&dir)?)) else {
        return true;
    };
    required_ops(&config)
        .into_iter()
        .all(|op| metrale_gpu_runtime::cuda::SUPPORTED_OPS.contains(&op))
}

/// Checks that fail on purpose, each in its own way (hidden
/// `--with-selftests`): the runner must report each and carry on.
const SELFTESTS: [&str; 4] = [
    "selftest/panic",
    "selftest/abort",
    "selftest/hang",
    "selftest/error",
];

fn selftest(kind: &str) -> Result<String> {
    match kind {
        "panic" => panic!("a planted panic"),
        "abort" => std::process::abort(),
        "hang" => loop {
            std::thread::sleep(Duration::from_secs(1));
        },
        _ => bail!("a planted error"),
    }
}

/// How long a check may take (the run's budget bounds them all).
pub fn time_limit(name: &str) -> Duration {
    let s = match name.split('/').next().unwrap_or(name) {
        // Seconds each takes on an H200 once the kernels are there; a hang
        // in one leaves time for the rest.
        "device" => 45,
        "conformance" => 60,
        "parity" => 60,
        "refusal" => 20,
        "generation" => 60,
        "teardown" => 30,
        "bench" => 40,
        // The hang is meant to time out, and quickly; the others end at
        // once, but a loaded machine (a `cargo test` running other test
        // binaries' threads) once took a planted panic past 3 s.
        "selftest" if name == "selftest/hang" => 3,
        "selftest" => 30,
        _ => 60,
    };
    Duration::from_secs(s)
}

/// Runs check `name`.
pub fn run(args: &Args, name: &str) -> Result<String> {
    let (family, fixture) = match name.split_once('/') {
        Some((f, x)) => (f, x),
        None => (name, ""),
    };
    match family {
        "device" => device(args),
        "conformance" => conformance_check(args, fixture),
        "parity" => parity(args, fixture),
        "refusal" => refusal(args, fixture),
        "generation" => generation(args, fixture),
        "teardown" => teardown(args, fixture),
        "bench" => bench(args, fixture),
        "selftest" => selftest(fixture),
        _ => bail!("no check named {name} (see --list)"),
    }
}

// ---------------------------------------------------------------------------
// The device.

/// The backend under test.
struct Device {
    gpu: Arc<dyn GpuBackend>,
    kind: BackendKind,
    /// One line: name, compute capability, driver, memory.
    info: String,
    name: String,
}

fn threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(1, 8)
}

fn open_cuda() -> Result<Device> {
    use metrale_gpu_runtime::cuda::{CudaBackend, MIN_DRIVER_VERSION};
    let cuda = CudaBackend::try_new(0).map_err(|e| anyhow!("{e}"))?;
    let (cc_major, cc_minor) = cuda.compute_capability();
    let v = cuda.driver_version();
    let memory = match cuda.memory_info() {
        Ok((free, total)) => format!(
            "{:.1} GiB total, {:.1} GiB free",
            total as f64 / (1u64 << 30) as f64,
            free as f64 / (1u64 << 30) as f64
        ),
        Err(e) => format!("memory unknown ({e})"),
    };
    let name = cuda.device_name().to_string();
    let info = format!(
        "{name}, compute capability {cc_major}.{cc_minor}, {} SMs, driver CUDA {}.{} \
         (this build needs {}.{}), {memory}",
        cuda.multiprocessors(),
        v / 1000,
        v % 1000 / 10,
        MIN_DRIVER_VERSION / 1000,
        MIN_DRIVER_VERSION % 1000 / 10,
    );
    Ok(Device {
        gpu: Arc::new(cuda),
        kind: BackendKind::Cuda,
        info,
        name,
    })
}

fn open(args: &Args) -> Result<Device> {
    open_as(args, true)
}

/// The device; the CPU standing in for it computes as the CUDA backend
/// does where `bf16_like` (the model checks), in f32 where not (the
/// conformance suite, whose GEMM tolerance is f32's).
fn open_as(args: &Args, bf16_like: bool) -> Result<Device> {
    match args.backend {
        BackendKind::Cuda => open_cuda(),
        BackendKind::Cpu => {
            // The CPU configured as the CUDA backend computes: bf16 weights
            // (at load), activations rounded to bf16 into the GEMMs, a bf16
            // KV cache (`device_options`).
            // It lacks the ops the CUDA backend lacks, so that models
            // needing them are refused as they are there.
            let lacking: Vec<conformance::Op> = conformance::Op::ALL
                .iter()
                .copied()
                .filter(|op| !metrale_gpu_runtime::cuda::SUPPORTED_OPS.contains(op))
                .collect();
            let cpu = CpuBackend::with_threads(threads())
                .with_bf16_dot_products(bf16_like)
                .lacking(&lacking);
            let dot = match (bf16_like, cpu.bf16_dot_products()) {
                (false, _) => "f32 arithmetic",
                (true, true) => "bf16 dot products (AVX512-BF16)",
                (true, false) => "f32 dot products (no AVX512-BF16 here)",
            };
            Ok(Device {
                info: format!(
                    "cpu in the device's place: bf16 weights, bf16 KV cache, {dot}, {} threads, \
                     lacking the {} ops the CUDA backend lacks",
                    threads(),
                    lacking.len()
                ),
                name: "cpu (standing in for cuda)".into(),
                gpu: Arc::new(cpu),
                kind: BackendKind::Cpu,
            })
        }
    }
}

fn device(args: &Args) -> Result<String> {
    let dev = open(args).context("opening device 0")?;
    println!("{DEVICE_NAME_PREFIX}{}", dev.name);
    let _ = DEVICE_NAME.set(dev.name.clone());
    let supported: Vec<&str> = conformance::Op::ALL
        .iter()
        .filter(|&&op| dev.gpu.supports(op))
        .map(|op| op.name())
        .collect();
    let lacking: Vec<&str> = conformance::Op::ALL
        .iter()
        .filter(|&&op| !dev.gpu.supports(op))
        .map(|op| op.name())
        .collect();
    println!("    backend {}: {}", dev.gpu.name(), dev.info);
    println!(
        "    supports {} ops: {}",
        supported.len(),
        supported.join(", ")
    );
    if !lacking.is_empty() {
        println!("    lacks {} ops: {}", lacking.len(), lacking.join(", "));
    }
    Ok(dev.info)
}

// ---------------------------------------------------------------------------
// Loading.

fn fixture(args: &Args, name: &str) -> Result<PathBuf> {
    let dir = args.fixtures.join(name);
    ensure!(
        dir.join("config.json").is_file(),
        "no fixture {} (is --fixtures right?)",
        dir.display()
    );
    Ok(dir)
}

fn options(kv_dtype: Option<DType>) -> ModelOptions {
    ModelOptions {
        kv_block_size: 16,
        kv_blocks: 128,
        max_seqs: CONCURRENT,
        max_batch_tokens: 256,
        kv_dtype,
        kv_follows_weights: false,
        ssm_state_dtype: None,
        ssm_state_follows_weights: false,
        cuda_graphs: true,
        prefix_cache: Default::default(),
    }
}

/// The device's model options: the backend's own KV dtype (bf16 on CUDA);
/// bf16 on the CPU standing in for it.
fn device_options(dev: &Device) -> ModelOptions {
    options(match dev.kind {
        BackendKind::Cuda => None,
        BackendKind::Cpu => Some(DType::BF16),
    })
}

fn load_on_device(dev: &Device, dir: &Path) -> Result<TransformerModel> {
    Ok(TransformerModel::load(
        dir,
        dev.gpu.clone(),
        device_options(dev),
        // As the checkpoint stores them: bf16 checkpoints run bf16 GEMMs
        // (activations rounded to bf16); f32 ones f32 GEMMs, as a user's
        // would (rounding them at load is not what anyone runs).
        WeightDType::AsStored,
        &mut |_| {},
    )?)
}

/// The reference: the CPU backend in f32, weights as stored (it matches the
/// golden logits to 1e-4).
fn load_reference(dir: &Path) -> Result<(Arc<CpuBackend>, TransformerModel)> {
    let cpu = Arc::new(CpuBackend::with_threads(threads()));
    let gpu: Arc<dyn GpuBackend> = cpu.clone();
    let model =
        TransformerModel::load(dir, gpu, options(None), WeightDType::AsStored, &mut |_| {})?;
    Ok((cpu, model))
}

/// Shuts `model` down; an error unless the ledger of `gpu` is then empty.
fn shutdown_empty(what: &str, model: TransformerModel, gpu: &dyn GpuBackend) -> Result<()> {
    model
        .shutdown()
        .with_context(|| format!("{what}: ordered teardown"))?;
    ensure_empty(what, gpu)
}

fn ensure_empty(what: &str, gpu: &dyn GpuBackend) -> Result<()> {
    let live = gpu.live_bytes();
    let report = gpu.ledger_report();
    ensure!(
        live == 0 && report.owners.is_empty(),
        "{what}: {live} bytes still on the {} ledger after teardown: {}",
        gpu.name(),
        report.to_string().replace('\n', "; ")
    );
    Ok(())
}

// ---------------------------------------------------------------------------
// Tolerance.

/// bf16's unit roundoff: 8 significant bits, round to nearest.
pub const BF16_U: f64 = 1.0 / 512.0;

/// How much more a gated DeltaNet layer's bf16 roundings move the logits
/// than the first-order count says: the delta rule carries a rounding of
/// its keys and values through the state to every later token. Measured
/// outside metrale: transformers' own logits on the qwen3_5 fixture, with
/// every matmul input rounded to bf16, move 0.52 from its f32 ones, 3.2
/// times the count without this gain; 6 leaves room for the other
/// roundings of a device.
pub const DELTANET_GAIN: usize = 6;

/// The logit tolerance of a bf16 device against the f32 reference, and the
/// number of bf16 roundings it counts (docs/GPU-CHECK.md).
///
/// Each rounding of an operand to bf16 perturbs it by at most `u = 2^-9`
/// relative. To first order those perturbations add up along the path from
/// the embedding to the logits, each moving the logits by at most `u`
/// times their scale `M` (the largest |golden logit|: the layers are
/// RMS-normalised, so no stage amplifies the scale). Counted per layer:
/// activations into the mixer's input GEMM, Q/K/V into attention (the KV
/// cache), the softmax probabilities into P·V, the mixer's output GEMM
/// input, the MLP's two GEMM inputs; and the final hidden state into the
/// LM head. Weights stored in f32 are rounded once each at load (every
/// GEMM weight, every norm weight, the embedding and the head); bf16-stored
/// ones are exact. `tol = N·u·M`, a worst case in which every rounding
/// pushes the same way. A gated DeltaNet layer is the exception to "no
/// stage amplifies": its roundings count [`DELTANET_GAIN`] times.
pub fn bf16_tolerance(config: &ModelConfig, weights_f32: bool, scale: f64) -> (f64, usize) {
    let mut activations = 1; // the LM head's input
    let mut weights = 3; // embedding, final norm, LM head
    for layer in &config.layers {
        match layer.mixer {
            MixerKind::Attention => {
                activations += 4;
                weights += 3; // norm, qkv, o
            }
            MixerKind::None => {}
            MixerKind::GatedDeltaNet => {
                activations += 4 * DELTANET_GAIN;
                weights += 3;
            }
            _ => {
                activations += 4;
                weights += 3;
            }
        }
        match &layer.names.ffn {
            FfnNames::None => {}
            _ => {
                activations += 2;
                weights += 3; // norm, gate/up, down
            }
        }
    }
    let n = activations + if weights_f32 { weights } else { 0 };
    (n as f64 * BF16_U * scale, n)
}

/// The golden file's metadata entry `key`.
fn golden_metadata(path: &Path, key: &str) -> Result<Option<String>> {
    let bytes = std::fs::read(path).with_context(|| path.display().to_string())?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)?;
    Ok(meta.metadata().as_ref().and_then(|m| m.get(key).cloned()))
}

/// The top-1 minus top-2 logit.
fn margin(row: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in row {
        if x > a {
            b = a;
            a = x;
        } else if x > b {
            b = x;
        }
    }
    a - b
}

fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0.0, |m, x| m.max(x.abs()))
}

/// The fixture's cases and tolerance: `(cases, tol per case, roundings)`.
fn golden_with_tolerance(dir: &Path) -> Result<(Vec<GoldenCase>, Vec<f64>, usize, bool)> {
    let path = dir.join("golden.safetensors");
    let cases = golden_file(&path)?;
    ensure!(!cases.is_empty(), "{}: no golden cases", path.display());
    let weights_f32 = golden_metadata(&path, "weight_dtype")?.is_none_or(|d| d != "bfloat16");
    let config = load_config(dir)?;
    let mut tols = Vec::new();
    let mut n = 0;
    for case in &cases {
        // Weights are used as stored (`load_on_device`): none is rounded.
        let (tol, count) = bf16_tolerance(&config, false, max_abs(&case.logits) as f64);
        tols.push(tol);
        n = count;
    }
    Ok((cases, tols, n, weights_f32))
}

// ---------------------------------------------------------------------------
// b. Conformance.

fn conformance_check(args: &Args, fixture_name: &str) -> Result<String> {
    let dir = fixture(args, fixture_name)?;
    let dev = open_as(args, false)?;
    let config = load_config(&dir)?;
    let mut shapes = arch_shapes(&config);
    shapes.name = fixture_name.to_string();
    let report = conformance::run(dev.gpu.as_ref(), &shapes);
    for line in report.to_string().lines() {
        println!("    {line}");
    }
    for op in report.unsupported() {
        println!("UNSUPPORTED {op}");
    }
    let failures = report.failures();
    let needed_not_passed: Vec<&str> = required_ops(&config)
        .into_iter()
        .filter(|&op| report.status(op) != Some(&Status::Passed))
        .map(|op| op.name())
        .collect();
    let passed = report.with_status(|s| *s == Status::Passed);
    if !failures.is_empty() || report.leaked_bytes > 0 || !needed_not_passed.is_empty() {
        let list: Vec<String> = failures
            .iter()
            .map(|(op, why)| format!("{op} ({})", why.replace('\n', " ")))
            .collect();
        bail!(
            "{} of {} ops failed: {}; {} bytes leaked; ops the {fixture_name} model needs \
             that did not pass: [{}]",
            failures.len(),
            failures.len() + passed.len(),
            list.join("; "),
            report.leaked_bytes,
            needed_not_passed.join(", ")
        );
    }
    let worst = report
        .ops
        .iter()
        .filter(|r| r.status == Status::Passed && r.tolerance > 0.0)
        .max_by(|a, b| (a.max_rel / a.tolerance).total_cmp(&(b.max_rel / b.tolerance)));
    let cases: usize = report.ops.iter().map(|r| r.cases).sum();
    Ok(format!(
        "{} ops passed in {cases} cases at {fixture_name}'s shapes, {} unsupported, {} not \
         used, nothing leaked{}",
        passed.len(),
        report.unsupported().len(),
        report.with_status(|s| *s == Status::NotUsed).len(),
        worst.map_or(String::new(), |w| format!(
            "; closest to its tolerance: {} (rel {:.1e} of {:.1e})",
            w.op, w.max_rel, w.tolerance
        ))
    ))
}

// ---------------------------------------------------------------------------
// c. Golden parity.

/// Logits of one prefill over `tokens`, and of the prompt's prefill then
/// one-token decode steps.
fn prefill_and_decode(model: &TransformerModel, case: &GoldenCase) -> Result<(Vec<f32>, Vec<f32>)> {
    let mut seq = model.new_sequence()?;
    let one = run_chunked(model, &mut seq, &case.tokens, case.tokens.len());
    model.free_sequence(seq);
    let one = one.context("one prefill")?;
    let mut seq = model.new_sequence()?;
    let p = case.prompt.len();
    let stepped = run_chunked(model, &mut seq, &case.prompt, p).and_then(|mut got| {
        got.extend(run_chunked(model, &mut seq, &case.tokens[p..], 1)?);
        Ok(got)
    });
    model.free_sequence(seq);
    Ok((one, stepped.context("prefill then decode")?))
}

fn parity(args: &Args, name: &str) -> Result<String> {
    let dir = fixture(args, name)?;
    let (cases, tols, roundings, weights_f32) = golden_with_tolerance(&dir)?;
    let dev = open(args)?;
    let (cpu, reference) = load_reference(&dir)?;
    let model = load_on_device(&dev, &dir).context("loading on the device")?;
    println!(
        "    tolerance: N·u·M with u = 2^-9, N = {roundings} bf16 roundings ({} weights), \
         M = max|golden logit| per prompt; greedy near-tie: golden top-2 margin < 2·tol",
        if weights_f32 {
            "f32-stored: f32 GEMMs, a bound to spare"
        } else {
            "bf16-stored, exact"
        }
    );
    // A MoE router picks its experts by comparing scores: where two are
    // closer than bf16 rounding moves them, the device may pick the other
    // expert and that token's logits move by a whole expert's share, past
    // any elementwise bound. Such a prompt is allowed (and counted) when its
    // greedy tokens still agree except at near-ties, for at most half the
    // prompts.
    let moe = load_config(&dir)?
        .layers
        .iter()
        .any(|l| matches!(l.names.ffn, FfnNames::Moe(_)));
    let mut routing_flips = Vec::new();
    let mut worst_ratio = 0.0f64;
    let mut worst = (0.0f32, 0.0f64);
    let (mut positions, mut near_tie, mut hard) = (0usize, 0usize, Vec::new());
    let mut errors = Vec::new();
    for (i, (case, &tol)) in cases.iter().zip(&tols).enumerate() {
        let vocab = case.vocab;
        let (one, stepped) = match prefill_and_decode(&model, case) {
            Ok(x) => x,
            Err(e) => {
                errors.push(format!("prompt {i}: {}", crate::runner::one_line(&e)));
                println!("    prompt {i}: ERROR {}", crate::runner::one_line(&e));
                continue;
            }
        };
        let mut seq = reference.new_sequence()?;
        let cpu_logits = run_chunked(&reference, &mut seq, &case.tokens, case.tokens.len());
        reference.free_sequence(seq);
        let cpu_logits = cpu_logits?;
        let d_one = max_abs_diff(&one, &case.logits);
        let d_step = max_abs_diff(&stepped, &case.logits);
        let d_cpu = max_abs_diff(&one, &cpu_logits).max(max_abs_diff(&stepped, &cpu_logits));
        let d_cpu_golden = max_abs_diff(&cpu_logits, &case.logits);
        let d = d_one.max(d_step).max(d_cpu);
        let nonfinite = one
            .iter()
            .chain(&stepped)
            .filter(|x| !x.is_finite())
            .count();
        if nonfinite > 0 {
            errors.push(format!("prompt {i}: {nonfinite} non-finite logits"));
        }
        let over = d as f64 > tol || d.is_nan();
        let ratio = d as f64 / tol;
        if ratio > worst_ratio {
            worst_ratio = ratio;
            worst = (d, tol);
        }
        // Greedy, teacher-forced along the golden tokens: the argmax of the
        // decode path's logits at each generated position.
        let p = case.prompt.len();
        let (mut agree, mut n, mut ties) = (0, 0, 0);
        for j in p - 1..case.tokens.len() - 1 {
            let row = &stepped[j * vocab..(j + 1) * vocab];
            let want = case.tokens[j + 1];
            n += 1;
            if argmax(row) == want {
                agree += 1;
                continue;
            }
            let m = margin(&case.logits[j * vocab..(j + 1) * vocab]);
            if (m as f64) < 2.0 * tol {
                ties += 1;
            } else {
                hard.push(format!(
                    "prompt {i} position {j}: {} instead of {want} (golden margin {m:.3})",
                    argmax(row)
                ));
            }
        }
        let hard_here = hard.iter().any(|h| h.starts_with(&format!("prompt {i} ")));
        if over && moe && !hard_here && !d.is_nan() {
            routing_flips.push(format!("prompt {i}: max |Δ| {d:.3e} > tol {tol:.3e}"));
        } else if over {
            errors.push(format!("prompt {i}: max |Δ| {d:.3e} > tol {tol:.3e}"));
        }
        positions += n;
        near_tie += ties;
        println!(
            "    prompt {i} ({p}+{} tokens): max|Δ| vs golden: prefill {d_one:.2e}, \
             prefill+decode {d_step:.2e}; vs cpu {d_cpu:.2e} (cpu vs golden {d_cpu_golden:.1e}); \
             tol {tol:.2e}; greedy {agree}/{n} agree, {ties} near-tie mismatches",
            case.tokens.len() - p
        );
    }
    let teardown = shutdown_empty("device", model, dev.gpu.as_ref());
    let ref_teardown = shutdown_empty("cpu reference", reference, cpu.as_ref());
    if let Err(e) = teardown {
        errors.push(crate::runner::one_line(&e));
    }
    if let Err(e) = ref_teardown {
        errors.push(crate::runner::one_line(&e));
    }
    if !hard.is_empty() {
        errors.push(format!(
            "{} greedy mismatches at clear margins: {}",
            hard.len(),
            hard.join("; ")
        ));
    }
    if routing_flips.len() > cases.len() / 2 {
        errors.push(format!(
            "{} of {} prompts beyond the bound (at most half may be MoE routing flips): {}",
            routing_flips.len(),
            cases.len(),
            routing_flips.join("; ")
        ));
    }
    ensure!(errors.is_empty(), "{}", errors.join("; "));
    let flips = if routing_flips.is_empty() {
        String::new()
    } else {
        format!(
            "; {} MoE routing flip(s) beyond the bound, greedy intact: {}",
            routing_flips.len(),
            routing_flips.join("; ")
        )
    };
    Ok(format!(
        "{} prompts, max |Δ| {:.2e} against tol {:.2e} ({:.0}% of it); greedy: {} of {positions} \
         positions agree, {near_tie} near-tie mismatches allowed; ledger empty after \
         teardown{flips}",
        cases.len(),
        worst.0,
        worst.1,
        worst_ratio * 100.0,
        positions - near_tie,
    ))
}

// ---------------------------------------------------------------------------
// d. Refusal of models needing ops the backend lacks.

fn refusal(args: &Args, name: &str) -> Result<String> {
    let dir = fixture(args, name)?;
    let dev = open(args)?;
    let config = load_config(&dir)?;
    let missing: Vec<&str> = required_ops(&config)
        .into_iter()
        .filter(|&op| !dev.gpu.supports(op))
        .map(|op| op.name())
        .collect();
    let loaded = load_on_device(&dev, &dir);
    match (loaded, missing.is_empty()) {
        (Ok(model), true) => {
            shutdown_empty("device", model, dev.gpu.as_ref())?;
            Ok(format!(
                "the backend supports every op {name} needs: it loads (parity for it is \
                 part 2's check)"
            ))
        }
        (Ok(model), false) => {
            let _ = model.shutdown();
            bail!(
                "loaded although the backend lacks {}: it must be refused",
                missing.join(", ")
            )
        }
        (Err(e), false) => {
            let text = crate::runner::one_line(&e);
            // Each op by its whole name (not `matmul` inside `grouped_matmul`).
            let words: Vec<&str> = text
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .collect();
            let unnamed: Vec<&&str> = missing.iter().filter(|op| !words.contains(op)).collect();
            ensure!(
                unnamed.is_empty(),
                "refused, but the error does not name {unnamed:?}: {text}"
            );
            ensure_empty("after the refusal", dev.gpu.as_ref())?;
            Ok(format!(
                "refused, naming {}: \"{text}\"",
                missing.join(", ")
            ))
        }
        (Err(e), true) => Err(e.context(format!(
            "the backend supports every op {name} needs, but loading failed"
        ))),
    }
}

// ---------------------------------------------------------------------------
// e. Generation through the engine.

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        ..SamplingParams::greedy()
    }
}

/// Submits every request at once and steps until all are done: each
/// request's tokens in order, the steps taken.
fn generate_all(
    engine: &mut Engine,
    requests: &[(Vec<u32>, usize)],
) -> Result<(Vec<Vec<u32>>, usize)> {
    let mut ids: Vec<RequestId> = Vec::new();
    for (prompt, n) in requests {
        ids.push(engine.add_request(prompt.clone(), greedy(*n))?);
    }
    let mut out: std::collections::HashMap<RequestId, Vec<u32>> = Default::default();
    let mut steps = 0;
    while engine.has_unfinished() {
        ensure!(steps < 100_000, "the engine made no progress");
        steps += 1;
        for event in engine.step()? {
            match event {
                Event::Token { id, token, .. } => out.entry(id).or_default().push(token),
                Event::Finished { .. } | Event::PromptLogprobs { .. } => {}
                Event::Error { id, message } => bail!("request {id}: {message}"),
            }
        }
    }
    Ok((
        ids.iter()
            .map(|id| out.remove(id).unwrap_or_default())
            .collect(),
        steps,
    ))
}

fn engine_teardown(what: &str, engine: Engine, gpu: &dyn GpuBackend) -> Result<()> {
    ensure!(
        engine.model().kv_cache().used_blocks() == 0,
        "{what}: KV blocks left in use after every request finished"
    );
    engine
        .shutdown()
        .with_context(|| format!("{what}: ordered teardown"))?;
    ensure_empty(what, gpu)
}

fn generation(args: &Args, name: &str) -> Result<String> {
    let dir = fixture(args, name)?;
    let (cases, tols, _, _) = golden_with_tolerance(&dir)?;
    let requests: Vec<(Vec<u32>, usize)> = (0..CONCURRENT)
        .map(|i| {
            let c = &cases[i % cases.len()];
            (c.prompt.clone(), c.tokens.len() - c.prompt.len())
        })
        .collect();
    let dev = open(args)?;
    let model = load_on_device(&dev, &dir).context("loading on the device")?;
    let mut engine = Engine::new(
        model,
        Some(Tokenizer::from_dir(&dir)?),
        EngineConfig::default(),
    );
    let started = Instant::now();
    let got = generate_all(&mut engine, &requests);
    let secs = started.elapsed().as_secs_f64();
    let teardown = engine_teardown("device", engine, dev.gpu.as_ref());
    let (got, steps) = got.context("generating on the device")?;
    teardown?;

    let (cpu, reference) = load_reference(&dir)?;
    let mut ref_engine = Engine::new(
        reference,
        Some(Tokenizer::from_dir(&dir)?),
        EngineConfig::default(),
    );
    let (want, _) = generate_all(&mut ref_engine, &requests).context("generating on the cpu")?;

    let total: usize = got.iter().map(Vec::len).sum();
    let (mut same, mut ties, mut hard) = (0, 0, Vec::new());
    let mut golden_same = 0;
    for (i, ((g, w), (prompt, _))) in got.iter().zip(&want).zip(&requests).enumerate() {
        let case = &cases[i % cases.len()];
        if *w == case.tokens[case.prompt.len()..] {
            golden_same += 1;
        }
        if g == w {
            same += 1;
            continue;
        }
        let k = g.iter().zip(w).take_while(|(a, b)| a == b).count();
        if k >= w.len() || k >= g.len() {
            hard.push(format!(
                "request {i}: {} tokens instead of {}",
                g.len(),
                w.len()
            ));
            continue;
        }
        // The reference's margin where they part.
        let model = ref_engine.model();
        let mut prefix = prompt.clone();
        prefix.extend(&w[..k]);
        let mut seq = model.new_sequence()?;
        let logits = run_chunked(model, &mut seq, &prefix, prefix.len());
        model.free_sequence(seq);
        let logits = logits?;
        let vocab = logits.len() / prefix.len();
        let m = margin(&logits[logits.len() - vocab..]);
        let tol = tols[i % cases.len()];
        if (m as f64) < 2.0 * tol {
            ties += 1;
            println!(
                "    request {i}: parts from the cpu at token {k} ({} vs {}), a near-tie (margin {m:.4} < {:.4})",
                g[k],
                w[k],
                2.0 * tol
            );
        } else {
            hard.push(format!(
                "request {i}: token {k} is {} instead of {} (cpu margin {m:.3})",
                g[k], w[k]
            ));
        }
    }
    engine_teardown("cpu reference", ref_engine, cpu.as_ref())?;
    ensure!(
        hard.is_empty(),
        "{} of {CONCURRENT} requests differ from the cpu at clear margins: {}",
        hard.len(),
        hard.join("; ")
    );
    Ok(format!(
        "{CONCURRENT} concurrent greedy requests, {total} tokens in {steps} steps, {secs:.2} s \
         ({:.0} tok/s); {same}/{CONCURRENT} identical to the cpu backend, {ties} parted at \
         near-ties; cpu matches golden in {golden_same}/{CONCURRENT}; ledger empty after teardown",
        total as f64 / secs.max(1e-9)
    ))
}

// ---------------------------------------------------------------------------
// f. Teardown.

fn teardown(args: &Args, name: &str) -> Result<String> {
    let dir = fixture(args, name)?;
    let dev = open(args)?;
    let before = dev.gpu.live_bytes();
    ensure!(before == 0, "{before} bytes live on a fresh backend");
    let model = load_on_device(&dev, &dir).context("loading on the device")?;
    let loaded = dev.gpu.live_bytes();
    let mut engine = Engine::new(
        model,
        Some(Tokenizer::from_dir(&dir)?),
        EngineConfig::default(),
    );
    let cases = golden_file(&dir.join("golden.safetensors"))?;
    let requests: Vec<(Vec<u32>, usize)> = cases.iter().map(|c| (c.prompt.clone(), 4)).collect();
    let run = generate_all(&mut engine, &requests);
    let report = dev.gpu.ledger_report();
    println!(
        "    before teardown: {} bytes live in {} owners:",
        dev.gpu.live_bytes(),
        report.owners.len()
    );
    for (owner, total) in &report.owners {
        println!(
            "      {owner}: {} bytes in {} allocations",
            total.bytes, total.allocations
        );
    }
    let done = engine_teardown("device", engine, dev.gpu.as_ref());
    run.context("generating before teardown")?;
    done?;
    let t = dev.gpu.hooks().transfers();
    Ok(format!(
        "{loaded} bytes after load, {} owners; after the ordered teardown live_bytes() = 0 and \
         the ledger report is empty ({} op launches, {} + {} bytes up and down)",
        report.owners.len(),
        t.op_launches,
        t.h2d_bytes,
        t.d2h_bytes
    ))
}

// ---------------------------------------------------------------------------
// g. `metrale bench`.

fn bench(args: &Args, spec: &str) -> Result<String> {
    let mut parts = spec.split('/');
    let (shape, batch, eager) = (parts.next(), parts.next(), parts.next() == Some("eager"));
    let batch: usize = batch
        .and_then(|b| b.strip_prefix('b'))
        .and_then(|b| b.parse().ok())
        .ok_or_else(|| anyhow!("bench/{spec}: want bench/<shape>/b<batch>[/eager]"))?;
    let config = match shape {
        Some("llama") => args.bench_config.as_ref(),
        Some("granite") => args.bench_hybrid_config.as_ref(),
        other => bail!("bench/{spec}: no bench shape {other:?}"),
    }
    .ok_or_else(|| anyhow!("bench/{spec}: no bench config given"))?;
    ensure!(config.is_file(), "no bench config {}", config.display());
    ensure!(
        args.metrale.is_file(),
        "no metrale binary at {} (--metrale)",
        args.metrale.display()
    );
    let mut cmd = Command::new(&args.metrale);
    cmd.arg("bench")
        .arg("--config")
        .arg(config)
        .args(["--device", args.backend.name()])
        .args(["--prompt-len", &args.bench_prompt.to_string()])
        .args(["--gen-len", &args.bench_gen.to_string()])
        .args(["--batch", &batch.to_string()])
        .arg("--json");
    if eager {
        cmd.arg("--no-cuda-graphs");
    }
    println!("    $ {cmd:?}");
    let limit = args
        .budget
        .min(time_limit("bench"))
        .saturating_sub(Duration::from_secs(2));
    let (status, stdout, stderr) = run_with_timeout(cmd, limit)?;
    for line in stderr.lines().chain(stdout.lines()) {
        println!("    | {line}");
    }
    let status = status.ok_or_else(|| anyhow!("timed out after {:.0} s", limit.as_secs_f64()))?;
    ensure!(status.success(), "metrale bench failed ({status})");
    let json: serde_json::Value = stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .ok_or_else(|| anyhow!("no JSON line in metrale bench's output"))?;
    let num = |k: &str| json.get(k).and_then(|v| v.as_f64());
    let device = json.get("device").and_then(|v| v.as_str()).unwrap_or("?");
    ensure!(
        device.starts_with(args.backend.name()),
        "metrale bench ran on {device}, not {}",
        args.backend.name()
    );
    Ok(format!(
        "{} on {device}: batch {batch}{}, prompt {} gen {}: prefill {:.0} tok/s, decode {:.1} \
         tok/s, ttft {:.1} ms, load {:.2} s{}",
        json.get("model").and_then(|v| v.as_str()).unwrap_or("?"),
        if eager { " without CUDA graphs" } else { "" },
        args.bench_prompt,
        args.bench_gen,
        num("prefill_tok_s").unwrap_or(f64::NAN),
        num("decode_tok_s").unwrap_or(f64::NAN),
        num("ttft_ms").unwrap_or(f64::NAN),
        num("load_s").unwrap_or(f64::NAN),
        match (num("bandwidth_bytes_s"), num("roofline_fraction")) {
            (Some(bw), Some(f)) => format!(
                ", bandwidth {:.0} GB/s, {:.0}% of the decode roofline",
                bw / 1e9,
                f * 100.0
            ),
            _ => String::new(),
        }
    ))
}

/// Runs `cmd` to completion or `limit`: status (`None`: killed at the
/// limit), stdout, stderr.
fn run_with_timeout(
    mut cmd: Command,
    limit: Duration,
) -> Result<(Option<std::process::ExitStatus>, String, String)> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {cmd:?}"))?;
    let mut out = child.stdout.take().context("stdout")?;
    let mut err = child.stderr.take().context("stderr")?;
    let out_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let started = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break Some(s);
        }
        if started.elapsed() >= limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stdout = out_t.join().unwrap_or_default();
    let stderr = err_t.join().unwrap_or_default();
    Ok((status, stdout, stderr))
}
