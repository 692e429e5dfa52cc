//! Quantizing on load (`--quant`): a float checkpoint quantized by metrale
//! as it loads holds, tensor for tensor, the blocks llama.cpp's
//! `llama-quantize` writes for the same weights and file type.
//!
//! In CI: a safetensors fixture stored in bf16 and the GGUF file llama.cpp's
//! converter made of it (`tests/fixtures/gguf-bf16`, the same bf16 values)
//! quantize to the same blocks with the same types. By hand (ignored): the
//! checkpoints behind `tests/fixtures/gguf` against llama.cpp's own
//! quantized files, every format.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use metrale_core::DType;
use metrale_gpu_runtime::GpuBackend;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_model_engine::model::{ModelOptions, TransformerModel};
use metrale_model_weights::gguf::mix::FileType;
use metrale_model_weights::loader::{WeightDType, WeightFormat};

use crate::common;

fn fixtures() -> PathBuf {
    common::fixture("")
}

fn options() -> ModelOptions {
    common::small_options()
}

/// Every weight of a loaded model: its device dtype and bytes.
type Weights = BTreeMap<String, (DType, Vec<u8>)>;

fn load(path: &std::path::Path, format: WeightFormat) -> Weights {
    let cpu = Arc::new(CpuBackend::with_threads(1));
    let model = TransformerModel::load_source(
        &metrale_model_engine::gguf::ModelSource::from_path(path),
        cpu.clone(),
        options(),
        format,
        &mut |_| {},
    )
    .unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
    let store = model.weight_store().expect("weights");
    let mut out = Weights::new();
    for name in store.names() {
        let t = store.get(name).unwrap();
        let mut bytes = vec![0u8; t.bytes()];
        cpu.copy_d2h(t.slice.ptr(), 0, &mut bytes).unwrap();
        out.insert(name.to_string(), (t.dtype(), bytes));
    }
    model.shutdown().unwrap();
    assert_eq!(cpu.live_bytes(), 0);
    out
}

fn quantized(w: &Weights) -> BTreeMap<&str, &(DType, Vec<u8>)> {
    w.iter()
        .filter(|(_, (d, _))| d.quant().is_some())
        .map(|(n, v)| (n.as_str(), v))
        .collect()
}

/// The quantized tensors of `a` and `b` are the same tensors, with the same
/// formats and bytes; returns how many.
fn same_blocks(what: &str, a: &Weights, b: &Weights) -> usize {
    let (qa, qb) = (quantized(a), quantized(b));
    let names_a: Vec<&str> = qa.keys().copied().collect();
    let names_b: Vec<&str> = qb.keys().copied().collect();
    assert_eq!(names_a, names_b, "{what}: the tensors quantized");
    for (name, (dtype, bytes)) in &qa {
        let (other, theirs) = qb[name];
        assert_eq!(dtype, other, "{what}: {name}");
        assert!(bytes == theirs, "{what}: {name}: the blocks differ");
    }
    qa.len()
}

fn quant(ftype: FileType) -> WeightFormat {
    WeightFormat {
        dtype: WeightDType::AsStored,
        quant: Some(ftype),
    }
}

#[test]
fn a_bf16_checkpoint_and_its_gguf_quantize_alike() {
    for name in ["qwen3", "bamba", "granitemoehybrid"] {
        for ftype in [
            FileType::Q8_0,
            FileType::Q4_K_M,
            FileType::Q6_K,
            FileType::Q4_0,
        ] {
            let what = format!("{name} {}", ftype.name());
            let dir = load(&fixtures().join(name), quant(ftype));
            let file = fixtures().join("gguf-bf16").join(format!("{name}.gguf"));
            let gguf = load(&file, quant(ftype));
            let n = same_blocks(&what, &dir, &gguf);
            // Every matrix but the routers and Mamba's conv1d is quantized;
            // norms, biases and vectors are not.
            assert!(n >= 8, "{what}: only {n} tensors quantized");
            for (t, (dtype, _)) in &dir {
                let float = t.contains("norm") || t.ends_with("bias") || t.contains("conv1d");
                assert!(
                    !(float && dtype.quant().is_some()),
                    "{what}: {t} is quantized"
                );
            }
        }
    }
}

#[test]
fn quantized_files_are_not_quantized_again() {
    let file = fixtures().join("gguf/llama/Q4_K_M.gguf");
    // The same mix: nothing changes, the file loads as it is.
    let same = load(&file, quant(FileType::Q4_K_M));
    let plain = load(&file, WeightDType::AsStored.into());
    assert_eq!(
        same_blocks("Q4_K_M again", &same, &plain),
        quantized(&plain).len()
    );
    // Another: the load stops at the first tensor it would requantize.
    let err = TransformerModel::load_gguf(
        &file,
        Arc::new(CpuBackend::with_threads(1)),
        options(),
        quant(FileType::Q8_0),
        &mut |_| {},
    )
    .err()
    .expect("requantizing is refused");
    let msg = format!("{err:#}");
    assert!(
        msg.contains("Q4_K_M.gguf") && msg.contains("only float tensors"),
        "{msg}"
    );
}

/// By hand, not in CI: `METRALE_GGUF_GROUND_TRUTH=<dir>` holding the
/// checkpoints (`hf/<model>/`) behind `tests/fixtures/gguf` and llama.cpp's
/// quantized files of them (`gguf/<model>-<FORMAT>.gguf`, made from their
/// F32 conversion): every quantized tensor of every model and format is
/// bitwise what llama-quantize wrote.
#[test]
#[ignore = "by hand: needs METRALE_GGUF_GROUND_TRUTH (llama.cpp's quantized files and their checkpoints)"]
fn quantize_on_load_is_llama_quantize() {
    let root = PathBuf::from(
        std::env::var_os("METRALE_GGUF_GROUND_TRUTH")
            .expect("METRALE_GGUF_GROUND_TRUTH names the directory of hf/ and gguf/"),
    );
    let mut total = 0;
    for name in [
        "llama",
        "llama_fallback",
        "qwen3",
        "mamba2",
        "bamba",
        "nemotron_h",
        "granitemoehybrid",
        "qwen3_next",
        "nemotron_h_moe",
    ] {
        for ftype in [
            FileType::Q8_0,
            FileType::Q4_0,
            FileType::Q4_1,
            FileType::Q5_0,
            FileType::Q5_1,
            FileType::Q4_K_M,
            FileType::Q5_K_M,
            FileType::Q6_K,
        ] {
            let what = format!("{name} {}", ftype.name());
            let ours = load(&root.join("hf").join(name), quant(ftype));
            let file = root
                .join("gguf")
                .join(format!("{name}-{}.gguf", ftype.name()));
            let theirs = load(&file, WeightDType::AsStored.into());
            let n = same_blocks(&what, &ours, &theirs);
            eprintln!("{what}: {n} quantized tensors bitwise equal");
            total += n;
        }
    }
    assert!(total > 300, "{total}");
}

/// Every fixture family runs quantized on load (Qwen3-Next's regrouped
/// `in_proj_qkvz` and its experts are gathered as quantized rows), and its
/// logits stay near the float model's (these 64-wide fixtures, weights
/// and activations both 8-bit: measured 2-2.5% of the logits' rms for
/// Q8_0, 7-17% for Q4_K_M, which falls back to Q5_0 here). Qwen3-Next's
/// gated delta rule makes its random model several times more sensitive
/// (llama.cpp's own Q8_0 and Q4_K_M files of the 256-wide fixture are 2x
/// and 2.5x further off its F32 file than the other families'): 19% for
/// Q8_0; Qwen3.5's, the same layers, 5.5%. That the blocks and the arithmetic are llama.cpp's is shown
/// elsewhere (`quantize_on_load_is_llama_quantize`, and the GGUF fixtures'
/// logits against llama.cpp's to 1e-6).
#[test]
fn every_family_runs_quantized_on_load() {
    use metrale_model_engine::model::{Logits, Step};
    let logits = |name: &str, format: WeightFormat| {
        let cpu = Arc::new(CpuBackend::with_threads(1));
        let model = TransformerModel::load(
            &fixtures().join(name),
            cpu.clone(),
            options(),
            format,
            &mut |_| {},
        )
        .unwrap_or_else(|e| panic!("{name}: {e:#}"));
        let mut seq = model.new_sequence().unwrap();
        let out = model
            .forward(&mut [Step {
                seq: &mut seq,
                tokens: &[3, 17, 42, 10, 7, 55],
                logits: Logits::All,
            }])
            .unwrap()
            .concat();
        model.free_sequence(seq);
        model.shutdown().unwrap();
        assert_eq!(cpu.live_bytes(), 0, "{name}");
        out
    };
    let families = common::FIXTURES.iter().copied();
    for name in families.chain(["sweep/nemotron_h_moe/base"]) {
        let float = logits(name, WeightDType::F32.into());
        let spread = (float.iter().map(|v| v * v).sum::<f32>() / float.len() as f32).sqrt();
        for ftype in [FileType::Q8_0, FileType::Q4_K_M] {
            let q = logits(name, quant(ftype));
            let rms = (q
                .iter()
                .zip(&float)
                .map(|(a, b)| (a - b).powi(2))
                .sum::<f32>()
                / q.len() as f32)
                .sqrt();
            eprintln!(
                "{name} {}: rms off float {rms:.2e} (logit rms {spread:.2})",
                ftype.name()
            );
            assert!(q.iter().all(|v| v.is_finite()), "{name}");
            // The gated DeltaNet families (Qwen3-Next, Qwen3.5).
            let deltanet = name.starts_with("qwen3_next") || name.starts_with("qwen3_5");
            let bound = match (deltanet, ftype) {
                (true, FileType::Q8_0) => 0.25,
                (true, _) => 1.0,
                // LFM2-VL's random language model: measured 5.8% at Q8_0.
                _ if name == "lfm2_vl" && ftype == FileType::Q8_0 => 0.08,
                (_, FileType::Q8_0) => 0.05,
                _ => 0.25,
            };
            assert!(
                rms < bound * spread,
                "{name} {}: {rms} vs {spread}",
                ftype.name()
            );
        }
    }
}
