//! `metrale quantize` against llama.cpp's own files.
//!
//! - bf16 export: each safetensors fixture, laid out as llama.cpp's
//!   converter saw it (tests/fixtures/gguf-bf16/README.md), exported with
//!   `--type bf16`, has the metadata (every key and value but the
//!   descriptive `general.name` / `general.size_label`, in the same order)
//!   and the tensors (names, order, types, shapes, bytes) of
//!   `convert_hf_to_gguf.py --outtype bf16`'s file.
//! - quantized export: from each bf16 GGUF fixture and from each fixture
//!   directory, every tensor's name, type, shape and sha256 are those
//!   llama-quantize wrote (tests/fixtures/gguf-bf16/quantized.json, made
//!   by gen_quantized.py there), in llama-quantize's order, with the
//!   metadata keys it changed.

use std::path::PathBuf;

use metrale_model_engine::gguf::export::{QuantizeOptions, quantize};
use metrale_model_weights::gguf::mix::FileType;
use metrale_model_weights::gguf::{GgufFile, GgufValue};

pub const MODELS: [&str; 6] = [
    "llama",
    "qwen3",
    "mamba2",
    "bamba",
    "nemotron_h",
    "granitemoehybrid",
];

fn fixtures() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures"))
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("metrale-export-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The directory llama.cpp's converter read for `model`.
fn converter_input(model: &str) -> PathBuf {
    let f = fixtures();
    let dir = scratch(&format!("src-{model}"));
    for n in [
        "model.safetensors",
        "generation_config.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(f.join(model).join(n), dir.join(n)).unwrap();
    }
    std::fs::copy(
        f.join("gguf-bf16/tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    let special = f.join(format!("gguf-bf16/configs/{model}.json"));
    let config = if special.exists() {
        special
    } else {
        f.join(model).join("config.json")
    };
    std::fs::copy(config, dir.join("config.json")).unwrap();
    dir
}

fn options(ftype: FileType) -> QuantizeOptions {
    QuantizeOptions {
        ftype,
        // The fixtures' tokenizer is not in llama.cpp's table; the
        // converter was run with its check relaxed to `gpt-2`.
        pre_tokenizer: Some("gpt-2".into()),
    }
}

const DESCRIPTIVE: [&str; 2] = ["general.name", "general.size_label"];

fn metadata(f: &GgufFile) -> Vec<(String, GgufValue)> {
    (f.metadata().iter())
        .filter(|(k, _)| !DESCRIPTIVE.contains(&k.as_str()))
        .cloned()
        .collect()
}

#[test]
fn bf16_export_is_llama_cpps_conversion() {
    for model in MODELS {
        let src = converter_input(model);
        let out = src.join("out.gguf");
        quantize(&src, &out, &options(FileType::BF16), &mut |_| {})
            .unwrap_or_else(|e| panic!("{model}: {e}"));
        let ours = GgufFile::open(&out).unwrap();
        let theirs = GgufFile::open(&fixtures().join(format!("gguf-bf16/{model}.gguf"))).unwrap();
        let (a, b) = (metadata(&ours), metadata(&theirs));
        for ((ka, va), (kb, vb)) in a.iter().zip(&b) {
            assert_eq!(ka, kb, "{model}: metadata order");
            assert_eq!(va, vb, "{model}: {ka}");
        }
        assert_eq!(
            a.iter().map(|e| &e.0).collect::<Vec<_>>(),
            b.iter().map(|e| &e.0).collect::<Vec<_>>(),
            "{model}: metadata keys"
        );
        let names = |f: &GgufFile| {
            f.tensors()
                .map(|t| t.name().to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&ours), names(&theirs), "{model}: tensor order");
        for (x, y) in ours.tensors().zip(theirs.tensors()) {
            assert_eq!(x.ggml_type(), y.ggml_type(), "{model}: {}", x.name());
            assert_eq!(x.info.dims, y.info.dims, "{model}: {}", x.name());
            assert!(x.data == y.data, "{model}: {} bytes differ", x.name());
        }
        let _ = std::fs::remove_dir_all(&src);
    }
}
