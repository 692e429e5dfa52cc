//! What a flag or a file can ask for is bounded, and every entry point says
//! so clearly instead of panicking, stalling, filling memory or writing out
//! numbers that are not numbers: thread counts, lengths, the memory plan,
//! the context limit, NaN logits.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};

fn root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

fn metrale(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args(args)
        .env_remove("METRALE_MODEL")
        .env("RUST_LOG", "error")
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("the metrale binary runs")
}

/// Fails with a message holding every one of `words`, and no panic.
fn refused(out: &Output, words: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "should fail: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    for w in words {
        assert!(stderr.contains(w), "{stderr:?} should say {w:?}");
    }
}

fn bench_config() -> String {
    root()
        .join("benches/configs/granite-4.0-h-350m.json")
        .to_string_lossy()
        .into_owned()
}

#[test]
fn thread_counts_beyond_the_machine_are_refused() {
    refused(
        &metrale(&["generate", "--threads", "100000", "Hi"]),
        &["100000 threads", "per core"],
    );
    let bench = bench_config();
    let out = metrale(&[
        "bench",
        "--config",
        &bench,
        "--threads",
        "100000",
        "--no-probe",
    ]);
    refused(&out, &["100000 threads"]);
}

#[test]
fn bench_lengths_are_checked_before_anything_runs() {
    let bench = bench_config();
    let huge = u64::MAX.to_string();
    for flag in ["--prompt-len", "--gen-len"] {
        let out = metrale(&["bench", "--config", &bench, flag, &huge, "--no-probe"]);
        refused(&out, &["context", "max_position_embeddings"]);
    }
    let out = metrale(&["bench", "--config", &bench, "--batch", "0", "--no-probe"]);
    refused(&out, &["--batch"]);
}

#[test]
fn a_model_larger_than_the_memory_is_refused_with_its_sizes() {
    // Llama 3.1 70B's config with random weights: 131 GiB of bf16 weights
    // against an 8 GiB limit, refused before any of it is allocated.
    let config = root().join("tests/fixtures/published/llama-3.1-70b-instruct/config.json");
    let config = config.to_string_lossy();
    let out = metrale(&[
        "bench",
        "--config",
        &config,
        "--memory-limit",
        "8GiB",
        "--prompt-len",
        "8",
        "--gen-len",
        "1",
        "--no-probe",
    ]);
    refused(
        &out,
        &["needs 131.4 GiB", "weights 131.4 GiB", "8.0 GiB available"],
    );
    // The bundled model within 1 MiB.
    let out = metrale(&["generate", "--memory-limit", "1MiB", "Hi"]);
    refused(&out, &["needs", "1.0 MiB available", "KV cache"]);
    let out = metrale(&["generate", "--memory-limit", "lots", "Hi"]);
    refused(&out, &["lots"]);
}

#[test]
fn logits_keep_to_the_context() {
    // The bundled model takes 512 positions, like generate.
    let ids = vec!["1"; 600].join(",");
    let out_file = std::env::temp_dir().join(format!("metrale-ctx-{}.st", std::process::id()));
    let out = metrale(&[
        "logits",
        "--model",
        &root().join("models/default").to_string_lossy(),
        "--ids",
        &ids,
        "--out",
        &out_file.to_string_lossy(),
    ]);
    refused(&out, &["600 ids", "512 positions"]);
    assert!(!out_file.exists(), "nothing written");
}

/// A copy of the llama fixture whose final norm weight is NaN.
fn nan_model(tag: &str) -> PathBuf {
    let src = root().join("tests/fixtures/llama");
    let dir = std::env::temp_dir().join(format!("metrale-nan-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let nan: Vec<u8> = f32::NAN.to_le_bytes().repeat(64);
    let mut views = Vec::new();
    for (name, view) in st.tensors() {
        let data = if name == "model.norm.weight" {
            nan.as_slice()
        } else {
            view.data()
        };
        views.push((
            name,
            TensorView::new(Dtype::F32, view.shape().to_vec(), data).unwrap(),
        ));
    }
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    dir
}

#[test]
fn logits_that_are_not_numbers_are_reported() {
    let dir = nan_model("logits");
    let out_file = dir.join("logits.st");
    let out = metrale(&[
        "logits",
        "--model",
        &dir.to_string_lossy(),
        "--ids",
        "1,2,3",
        "--out",
        &out_file.to_string_lossy(),
    ]);
    refused(&out, &["logits at position 0", "NaN"]);
    assert!(!out_file.exists(), "nothing written");

    let out = metrale(&[
        "generate",
        "--model",
        &dir.to_string_lossy(),
        "--max-tokens",
        "3",
        "Hello",
    ]);
    refused(&out, &["not finite", "after position"]);
    std::fs::remove_dir_all(Path::new(&dir)).ok();
}
