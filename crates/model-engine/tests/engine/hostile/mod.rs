//! Hostile GGUF files made from the small llama.cpp fixtures
//! (tests/fixtures/gguf-bf16): a fixture rewritten with metadata set or
//! removed and tensors reshaped, and the whole path a model file takes
//! before any weight is read (config rebuilt and parsed, expected tensors
//! listed, tokenizer built) run on the result.

#![allow(dead_code)]

use std::path::PathBuf;

use metrale_core::quant::GgmlType;
use metrale_model_engine::config::parse_config;
use metrale_model_engine::gguf::{config_json, expected_tensors};
use metrale_model_engine::tokenizer::Tokenizer;
use metrale_model_weights::gguf::{ALIGNMENT_KEY, GgufFile, GgufValue, GgufWriter};

/// The fixtures, by file stem (two of them are `granitehybrid`).
pub const FIXTURES: [&str; 8] = [
    "llama",
    "qwen3",
    "mamba2",
    "bamba",
    "granitemoehybrid",
    "nemotron_h",
    "nemotron_h_moe",
    "qwen3_next",
];

pub fn fixture_path(stem: &str) -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/gguf-bf16"
    ))
    .join(format!("{stem}.gguf"))
}

pub fn fixture(stem: &str) -> GgufFile {
    GgufFile::open(&fixture_path(stem)).expect("the fixture opens")
}

/// One change to a file.
#[derive(Clone, Debug)]
pub enum Edit {
    /// Sets `{arch}.key` when the key starts with `.`, else the full key.
    Set(String, GgufValue),
    Remove(String),
    /// Replaces a tensor by an F32 one of this row-major shape (zeros).
    Reshape(String, Vec<usize>),
    /// Adds an F32 tensor of this shape (zeros).
    Add(String, Vec<usize>),
}

pub fn set(key: &str, v: GgufValue) -> Edit {
    Edit::Set(key.to_string(), v)
}

pub fn remove(key: &str) -> Edit {
    Edit::Remove(key.to_string())
}

pub fn reshape(tensor: &str, shape: &[usize]) -> Edit {
    Edit::Reshape(tensor.to_string(), shape.to_vec())
}

fn full_key(arch: &str, key: &str) -> String {
    match key.strip_prefix('.') {
        Some(rest) => format!("{arch}.{rest}"),
        None => key.to_string(),
    }
}

fn zeros(shape: &[usize]) -> Vec<u8> {
    vec![0u8; shape.iter().product::<usize>() * 4]
}

/// `file` written again with `edits` applied (metadata in its order, a
/// set key that was absent at the end).
pub fn rewrite(file: &GgufFile, edits: &[Edit]) -> Vec<u8> {
    let arch = file.architecture().unwrap_or("none").to_string();
    let mut meta: Vec<(String, GgufValue)> = file.metadata().to_vec();
    for e in edits {
        match e {
            Edit::Set(k, v) => {
                let k = full_key(&arch, k);
                match meta.iter_mut().find(|(x, _)| *x == k) {
                    Some(entry) => entry.1 = v.clone(),
                    None => meta.push((k, v.clone())),
                }
            }
            Edit::Remove(k) => meta.retain(|(x, _)| *x != full_key(&arch, k)),
            _ => {}
        }
    }
    let mut w = GgufWriter::new();
    for (k, v) in meta {
        match (k.as_str(), &v) {
            (ALIGNMENT_KEY, GgufValue::U32(a)) => w.set_alignment(*a),
            _ => w.add(k, v),
        };
    }
    for t in file.tensors() {
        let new_shape = edits.iter().find_map(|e| match e {
            Edit::Reshape(n, s) if n == t.name() => Some(s),
            _ => None,
        });
        match new_shape {
            Some(s) => w.add_tensor(t.name(), GgmlType::F32, s, zeros(s)),
            None => w.add_tensor(t.name(), t.ggml_type(), t.shape(), t.data.to_vec()),
        };
    }
    for e in edits {
        if let Edit::Add(name, shape) = e {
            w.add_tensor(name.clone(), GgmlType::F32, shape, zeros(shape));
        }
    }
    w.to_bytes().expect("the rewritten file encodes")
}

/// Everything done with a model file before its weights are read; the
/// first error, as text.
pub fn prepare(name: &str, image: Vec<u8>) -> Result<(), String> {
    let file = GgufFile::from_bytes(name, image).map_err(|e| e.to_string())?;
    // The tokenizer is built even when the config fails (`metrale
    // tokenize` needs no config).
    let tokenizer = Tokenizer::from_gguf(&file).map(|_| ());
    let config = (|| {
        let json = config_json(&file)?;
        let config = parse_config(&json.to_string(), file.path())?;
        expected_tensors(&file, &config)?;
        Ok::<_, metrale_model_engine::EngineError>(())
    })();
    config.map_err(|e| e.to_string())?;
    tokenizer.map_err(|e| e.to_string())
}

/// Like [`prepare`], expecting an error that names the file and `what`.
pub fn refused(name: &str, image: Vec<u8>, what: &str) -> String {
    match prepare(name, image) {
        Ok(()) => panic!("{name}: accepted, expected an error naming {what:?}"),
        Err(e) => {
            assert!(
                e.contains(name),
                "{name}: the error does not name the file: {e}"
            );
            assert!(
                e.contains(what),
                "{name}: the error does not name {what:?}: {e}"
            );
            e
        }
    }
}
