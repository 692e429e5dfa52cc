//! `metrale quantize` of every fixture family and of the bundled default
//! model, as every export type, read back by metrale's own GGUF loader: the
//! file runs as the checkpoint does. A quantized export holds, tensor for
//! tensor, the blocks metrale's quantize-on-load makes of the checkpoint
//! (the MoE families' stacked experts and regrouped projections included),
//! and runs to the same logits; a float export runs to the logits of the
//! checkpoint loaded in that float type. An export whose metadata said
//! something else than the checkpoint (no rope for a model with rope, a
//! misread layer list) fails here. gguf_export.rs checks the files against
//! llama-quantize's; gguf.rs the converter's bf16 ones against the
//! safetensors model.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use metrale_core::DType;
use metrale_gpu_runtime::GpuBackend;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_model_engine::gguf::ModelSource;
use metrale_model_engine::gguf::export::{QuantizeOptions, quantize};
use metrale_model_engine::model::{Logits, Step, TransformerModel};
use metrale_model_weights::gguf::mix::FileType;
use metrale_model_weights::loader::{WeightDType, WeightFormat};

use crate::common;

/// The fixture families, then the bundled default model.
const MODELS: [&str; 9] = [
    "llama",
    "qwen3",
    "mamba2",
    "bamba",
    "nemotron_h",
    "granitemoehybrid",
    "qwen3_next",
    "nemotron_h_moe",
    "default",
];

/// The checkpoint to export: the fixture with the shared byte-level BPE
/// tokenizer.json llama.cpp's converter accepts (gguf_export.rs's
/// converter_input, but with the fixture's own config.json, whatever its
/// spelling, except nemotron_h's: its config carries the MoE keys
/// transformers adds as defaults, which the export refuses, as
/// gguf_export.rs checks), or the bundled default model as it is.
fn converter_input(model: &str, test: &str) -> PathBuf {
    if model == "default" {
        return PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/default"));
    }
    let dir = std::env::temp_dir().join(format!(
        "metrale-export-rt-{}-{model}-{test}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = if model == "nemotron_h" {
        common::fixture("gguf-bf16/configs/nemotron_h.json")
    } else {
        common::fixture(model).join("config.json")
    };
    super::gguf_export::fixture_for_export(model, &dir, &config);
    dir
}

fn load(path: &Path, format: WeightFormat) -> (TransformerModel, Arc<CpuBackend>) {
    let cpu = Arc::new(CpuBackend::with_threads(1));
    let gpu: Arc<dyn GpuBackend> = cpu.clone();
    let model = TransformerModel::load_source(
        &ModelSource::from_path(path),
        gpu,
        common::small_options(),
        format,
        &mut |_| {},
    )
    .unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
    (model, cpu)
}

/// The quantized weights of a loaded model: device dtype and bytes.
fn quantized(model: &TransformerModel, cpu: &CpuBackend) -> BTreeMap<String, (DType, Vec<u8>)> {
    let store = model.weight_store().expect("weights");
    let mut out = BTreeMap::new();
    for name in store.names() {
        let t = store.get(name).unwrap();
        if !matches!(t.dtype(), DType::Quant(_) | DType::QuantGroups(_)) {
            continue;
        }
        let mut bytes = vec![0u8; t.bytes()];
        cpu.copy_d2h(t.slice.ptr(), 0, &mut bytes).unwrap();
        out.insert(name.to_string(), (t.dtype(), bytes));
    }
    out
}

/// Every position's logits of one prefill.
fn logits(model: &TransformerModel) -> Vec<f32> {
    let prompt = [3u32, 17, 42, 100, 7, 255, 1, 64];
    let mut seq = model.new_sequence().unwrap();
    let out = model
        .forward(&mut [Step {
            seq: &mut seq,
            tokens: &prompt,
            logits: Logits::All,
        }])
        .unwrap()
        .concat();
    model.free_sequence(seq);
    out
}

/// The tensors whose device dtype differs between the two loads: llama.cpp's
/// choices quantize-on-load does not make. Qwen3-Next's shared expert
/// `down_proj` has rows of 48, which llama-quantize stores as F16 (no block
/// type fits; quantize-on-load keeps f32); at Q4_K_M the converter's two
/// parts of `in_proj_qkvz` get different types, which the loader gathers
/// back as f32.
fn explained(name: &str) -> bool {
    name.contains("shared_expert.down_proj") || name.contains("in_proj_qkvz")
}

/// Max and rms of the logit differences.
fn spread(a: &[f32], b: &[f32]) -> (f32, f32) {
    let worst = (a.iter().zip(b)).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    let sq: f32 = (a.iter().zip(b)).map(|(x, y)| (x - y) * (x - y)).sum();
    (worst, (sq / a.len().max(1) as f32).sqrt())
}

/// The f32 values of every float weight of a model (quantized ones left
/// out), by name.
fn floats(model: &TransformerModel, cpu: &CpuBackend) -> BTreeMap<String, Vec<f32>> {
    let store = model.weight_store().expect("weights");
    let mut out = BTreeMap::new();
    for name in store.names() {
        let t = store.get(name).unwrap();
        if t.dtype() != DType::F32 {
            continue;
        }
        let mut bytes = vec![0u8; t.bytes()];
        cpu.copy_d2h(t.slice.ptr(), 0, &mut bytes).unwrap();
        let values = (bytes.chunks_exact(4))
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        out.insert(name.to_string(), values);
    }
    out
}

/// A float export's tensors, widened to f32 on load, against the
/// checkpoint's: each within the rounding of the type it was stored in
/// (`eps`, relative to the tensor's largest element).
fn same_tensors(what: &str, src: &Path, out: &Path, eps: f32) {
    let (gg, cpu_a) = load(out, WeightDType::F32.into());
    let (st, cpu_b) = load(src, WeightDType::F32.into());
    let (a, b) = (floats(&gg, &cpu_a), floats(&st, &cpu_b));
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "{what}"
    );
    for (name, x) in &a {
        let y = &b[name];
        let scale = y.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = (x.iter().zip(y)).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        assert!(
            worst <= eps * scale,
            "{what}: {name}: {worst} > {eps} x {scale}"
        );
    }
    gg.shutdown().unwrap();
    st.shutdown().unwrap();
}

/// Routed MoE families: on random fixtures a weight rounded differently
/// flips an expert choice somewhere, and the logits move far (qwen3_next:
/// up to 1.5 for f16 weights); their exports are held by their tensors.
fn routed(model: &str) -> bool {
    model == "qwen3_next" || model.ends_with("_moe")
}

/// The bound on the logits where some tensors' device dtypes differ from
/// the checkpoint's load (a float export's narrowed matrices, the
/// `explained` ones of a quantized export): the activation-quantization
/// spread tests/fixtures/gguf/README.md suggests (0.25 max, 0.05 rms).
const BOUND: (f32, f32) = (0.25, 0.05);

/// One export of `src` as `ftype`, loaded by metrale, against the
/// checkpoint: a float export's tensors within their type's rounding, a
/// quantized one's blocks those quantize-on-load makes; the logits equal
/// where every device dtype is the checkpoint load's, else within
/// [`BOUND`]. Returns the max and rms of the logits' difference.
fn round_trip(model: &str, src: &Path, out_dir: &Path, ftype: FileType) -> (f32, f32) {
    let what = format!("{model} {}", ftype.name());
    let out = out_dir.join(format!("{model}-{}.gguf", ftype.name()));
    // No --pre-tokenizer: both tokenizers are GPT-2's pipeline, which the
    // export recognises without a hash in llama.cpp's table.
    let opts = QuantizeOptions {
        ftype,
        pre_tokenizer: None,
    };
    quantize(src, &out, &opts, &mut |_| {}).unwrap_or_else(|e| panic!("{what}: {e}"));
    let float = !ftype.is_quantized();
    if float {
        let eps = match ftype {
            FileType::F16 => 2f32.powi(-11),
            FileType::BF16 => 2f32.powi(-8),
            // The converter's `A = -exp(A_log)`, logged back on load, is
            // off by an ulp.
            _ => 2f32.powi(-22),
        };
        same_tensors(&what, src, &out, eps);
    }
    // The checkpoint in f32, quantized on load as llama-quantize does from
    // the converter's f32 file.
    let on_load = WeightFormat {
        dtype: WeightDType::F32,
        quant: (!float).then_some(ftype),
    };
    let (gg, cpu_a) = load(&out, WeightDType::AsStored.into());
    let (st, cpu_b) = load(src, on_load);
    let (sa, sb) = (gg.weight_store().unwrap(), st.weight_store().unwrap());
    let differ: Vec<&str> = (sa.names())
        .filter(|n| sb.get(n).ok().map(|t| t.dtype()) != Some(sa.get(n).unwrap().dtype()))
        .collect();
    if !float {
        assert!(differ.iter().all(|n| explained(n)), "{what}: {differ:?}");
        let (qa, qb) = (quantized(&gg, &cpu_a), quantized(&st, &cpu_b));
        assert!(!qa.is_empty(), "{what}: nothing quantized");
        if routed(model) {
            // Every expert of every stack is quantized, as one block run
            // of the stacked tensor.
            assert!(qa.keys().any(|k| k.contains("experts.3.")), "{what}");
        }
        for (name, a) in &qa {
            if let Some(b) = qb.get(name) {
                assert!(a == b, "{what}: {name}: the blocks differ");
            }
        }
    }
    let (worst, rms) = spread(&logits(&gg), &logits(&st));
    if differ.is_empty() {
        assert_eq!(worst, 0.0, "{what}");
    } else if !routed(model) {
        assert!(worst <= BOUND.0 && rms <= BOUND.1, "{what}: {worst} {rms}");
    }
    let _ = std::fs::remove_file(&out);
    gg.shutdown().unwrap();
    st.shutdown().unwrap();
    assert_eq!(cpu_a.live_bytes() + cpu_b.live_bytes(), 0, "{what}");
    (worst, rms)
}

/// Every family as every export type; prints the table of max |Δlogit|
/// (`--nocapture`).
#[test]
fn every_family_round_trips_through_every_export_type() {
    let out_dir = std::env::temp_dir().join(format!("metrale-export-rt-{}", std::process::id()));
    std::fs::create_dir_all(&out_dir).unwrap();
    let mut table = String::from("family");
    for ftype in FileType::ALL {
        table += &format!(" | {}", ftype.name());
    }
    for model in MODELS {
        let src = converter_input(model, "rt");
        table += &format!("\n{model}");
        for ftype in FileType::ALL {
            let (worst, _) = round_trip(model, &src, &out_dir, ftype);
            table += &format!(" | {worst:.3e}");
        }
        if model != "default" {
            let _ = std::fs::remove_dir_all(&src);
        }
    }
    let _ = std::fs::remove_dir_all(&out_dir);
    eprintln!("max |logit difference|, export against checkpoint:\n{table}");
}

/// Where a key llama.cpp honours says what the converter would have said
/// wrongly, the file says it and the summary's notes name each departure
/// (gguf_export.rs checks the refusals, where no key can).
#[test]
fn departures_from_the_converter_are_noted() {
    // The default model: rope, and layer_types as transformers 5 spells
    // them, both of which the converter would misread.
    let src = converter_input("default", "notes");
    let out = std::env::temp_dir().join(format!("metrale-notes-{}.gguf", std::process::id()));
    let opts = QuantizeOptions {
        ftype: FileType::F32,
        pre_tokenizer: None,
    };
    let summary = quantize(&src, &out, &opts, &mut |_| {}).unwrap();
    let _ = std::fs::remove_file(&out);
    let notes = summary.notes.join("\n");
    assert!(notes.contains("rope.scaling.finetuned = true"), "{notes}");
    assert!(
        notes.contains("attention layers written as [1, 3]"),
        "{notes}"
    );
    assert_eq!(summary.notes.len(), 2, "{notes}");
    // As the converter reads it: nothing to note.
    let src = converter_input("nemotron_h", "notes");
    let summary = quantize(&src, &out, &opts, &mut |_| {}).unwrap();
    let _ = std::fs::remove_file(&out);
    let _ = std::fs::remove_dir_all(&src);
    assert!(summary.notes.is_empty(), "{:?}", summary.notes);
}
