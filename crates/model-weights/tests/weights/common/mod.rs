//! Helpers shared by the loader tests: scratch directories and hand-made
//! safetensors files.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use metrale_model_weights::loader::{ExpectedTensor, scan_safetensors};

/// A fresh empty directory under the system temp dir, unique per call.
pub fn scratch(tag: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::SeqCst);
    let dir =
        std::env::temp_dir().join(format!("metrale-weights-{}-{tag}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(name)
}

/// A tensor to write: name, safetensors dtype, shape, data bytes.
pub struct Spec<'a> {
    pub name: &'a str,
    pub dtype: &'a str,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

pub fn f32_spec<'a>(name: &'a str, shape: Vec<usize>) -> Spec<'a> {
    let n: usize = shape.iter().product();
    let data = (0..n)
        .flat_map(|i| (i as f32 * 0.5 - 1.0).to_le_bytes())
        .collect();
    Spec {
        name,
        dtype: "F32",
        shape,
        data,
    }
}

/// A safetensors image with the tensors laid out back to back.
pub fn image(specs: &[Spec<'_>]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut offset = 0;
    for s in specs {
        let end = offset + s.data.len();
        header.insert(
            s.name.to_string(),
            serde_json::json!({"dtype": s.dtype, "shape": s.shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    image_with_header(
        &serde_json::Value::Object(header).to_string(),
        &specs
            .iter()
            .flat_map(|s| s.data.clone())
            .collect::<Vec<_>>(),
    )
}

/// A safetensors image from a raw header text and data section.
pub fn image_with_header(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// Writes `bytes` as `dir/model.safetensors`; returns the file's path.
pub fn write_model(dir: &Path, bytes: &[u8]) -> PathBuf {
    let path = dir.join("model.safetensors");
    std::fs::write(&path, bytes).unwrap();
    path
}

/// What a checkpoint holds, as the expectation of a load.
pub fn expect_all(dir: &Path) -> Vec<ExpectedTensor> {
    scan_safetensors(dir)
        .unwrap()
        .into_iter()
        .map(|t| ExpectedTensor {
            name: t.name,
            shape: t.shape,
            quantize: None,
        })
        .collect()
}

pub fn expected(name: &str, shape: Vec<usize>) -> ExpectedTensor {
    ExpectedTensor {
        name: name.to_string(),
        shape,
        quantize: None,
    }
}
