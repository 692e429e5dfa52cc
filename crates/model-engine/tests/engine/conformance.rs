//! The conformance suite on the CPU backend at the shapes of every fixture
//! model: each top-level fixture and each architecture's sweep base (which
//! adds qwen2, mistral and Nemotron-H's MoE). Every op a model needs passes.

use std::path::{Path, PathBuf};
use std::time::Instant;

use metrale_gpu_runtime::conformance::{self, Op, Status};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_engine::config::load_config;
use metrale_model_engine::conformance::{arch_shapes, check_supported, required_ops};

fn fixtures_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures"))
}

/// The model folders (with a config.json) directly under `dir`, sorted.
fn model_dirs(dir: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("config.json").is_file())
        .collect();
    dirs.sort();
    dirs
}

/// The fixtures: `(name, folder)`.
fn fixtures() -> Vec<(String, PathBuf)> {
    let root = fixtures_dir();
    let mut all: Vec<(String, PathBuf)> = model_dirs(&root)
        .into_iter()
        .map(|d| (d.file_name().unwrap().to_string_lossy().into_owned(), d))
        .collect();
    let sweep = root.join("sweep");
    let mut bases: Vec<PathBuf> = std::fs::read_dir(&sweep)
        .unwrap()
        .map(|e| e.unwrap().path().join("base"))
        .filter(|p| p.join("config.json").is_file())
        .collect();
    bases.sort();
    for b in bases {
        let arch = b.parent().unwrap().file_name().unwrap().to_string_lossy();
        all.push((format!("sweep/{arch}/base"), b));
    }
    all
}

#[test]
fn every_fixture_architecture_conforms_on_the_cpu() {
    let fixtures = fixtures();
    assert!(fixtures.len() >= 7, "{fixtures:?}");
    let cpu = CpuBackend::with_threads(2);
    let mut passed = Vec::new();
    let started = Instant::now();
    for (name, dir) in &fixtures {
        let config = load_config(dir).unwrap();
        let mut shapes = arch_shapes(&config);
        shapes.name = name.clone();
        let report = conformance::run(&cpu, &shapes);
        println!("{report}");
        report.assert_all_passed();
        // Every op the model calls ran at its shapes and passed.
        for op in required_ops(&config) {
            assert_eq!(report.status(op), Some(&Status::Passed), "{name}: {op}");
        }
        check_supported(&cpu, &config).unwrap();
        passed.extend(report.with_status(|s| *s == Status::Passed));
    }
    for op in Op::ALL {
        assert!(passed.contains(&op), "{op} ran at no fixture's shapes");
    }
    assert_eq!(cpu.live_bytes(), 0);
    println!(
        "{} fixtures in {:.2} s",
        fixtures.len(),
        started.elapsed().as_secs_f64()
    );
}

/// What a model needs follows its layers: llama's SwiGLU attention layers,
/// Qwen3-Next's gated attention, delta rule and gated shared expert,
/// Nemotron-H's relu² experts behind grouped sigmoid routing.
#[test]
fn required_ops_follow_the_layers() {
    let ops = |dir: &str| required_ops(&load_config(&fixtures_dir().join(dir)).unwrap());
    let llama = ops("llama");
    for op in [
        Op::MatmulSwiglu,
        Op::Rope,
        Op::PagedAttention,
        Op::GatherRows,
    ] {
        assert!(llama.contains(&op), "llama: {op}");
    }
    for op in [Op::SsdScan, Op::SoftmaxTopk, Op::SigmoidMul, Op::Scale] {
        assert!(!llama.contains(&op), "llama: {op}");
    }
    let next = ops("qwen3_next");
    for op in [
        Op::GatedDeltaRule,
        Op::CopyCols,
        Op::SigmoidMul,
        Op::SoftmaxTopk,
        Op::GroupedMatmulSwiglu,
        Op::SigmoidGateAdd,
    ] {
        assert!(next.contains(&op), "qwen3_next: {op}");
    }
    let moe = ops("sweep/nemotron_h_moe/base");
    for op in [Op::SigmoidTopk, Op::Relu2, Op::GroupedMatmul, Op::SsdScan] {
        assert!(moe.contains(&op), "nemotron_h_moe: {op}");
    }
    assert!(!moe.contains(&Op::GroupedMatmulSwiglu));
    assert!(
        ops("mamba2")
            .iter()
            .all(|op| !matches!(op, Op::Rope | Op::KvStore))
    );
}

/// A backend without an op a model needs refuses the model at load, naming
/// the op, before allocating anything; a model that does not need the op
/// loads on it. Called anyway, the op errs (no silent fallback).
#[test]
fn a_model_needing_an_op_the_backend_lacks_is_refused_at_load() {
    use std::sync::Arc;

    use metrale_model_engine::model::{ModelOptions, TransformerModel};
    use metrale_model_weights::loader::WeightDType;

    let load = |dir: &str, cpu: &Arc<CpuBackend>| {
        let gpu: Arc<dyn GpuBackend> = cpu.clone();
        TransformerModel::load(
            &fixtures_dir().join(dir),
            gpu,
            ModelOptions::default(),
            WeightDType::AsStored,
            &mut |_| {},
        )
    };
    let cpu = Arc::new(CpuBackend::with_threads(1).lacking(&[Op::SsdScan]));
    let err = load("mamba2", &cpu).err().expect("refused");
    let text = format!("{err:#}");
    assert!(
        text.contains("ssd_scan") && text.contains("mamba2"),
        "{text}"
    );
    assert_eq!(cpu.live_bytes(), 0, "nothing allocated");
    // llama has no SSD scan: it loads and runs on the same backend.
    let llama = load("llama", &cpu).expect("llama needs no ssd_scan");
    llama.shutdown().unwrap();
    assert_eq!(cpu.live_bytes(), 0);
    assert!(!cpu.supports(Op::SsdScan));
}
