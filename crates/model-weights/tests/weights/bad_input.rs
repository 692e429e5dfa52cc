//! Each kind of broken checkpoint gives its own error, naming the file and
//! the tensor, and leaves nothing allocated.

use crate::common;

use std::path::Path;

use common::*;
use metrale_gpu_runtime::GpuBackend;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_model_weights::WeightsError;
use metrale_model_weights::loader::{ExpectedTensor, LoadProgress, WeightDType, load_safetensors};

/// Loads `dir` expecting `expected`; returns the error, checking that the
/// message names `must_name` and that nothing stays allocated.
fn load_err(dir: &Path, expected: &[ExpectedTensor], must_name: &[&str]) -> WeightsError {
    let gpu = CpuBackend::new();
    let err = match load_safetensors(dir, expected, &gpu, WeightDType::AsStored, &mut |_| {}) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e,
    };
    let message = err.to_string();
    for word in must_name {
        assert!(message.contains(word), "{message:?} should name {word:?}");
    }
    assert_eq!(gpu.live_bytes(), 0, "{message}");
    err
}

fn two_tensors() -> Vec<u8> {
    image(&[
        f32_spec("a.weight", vec![2, 3]),
        f32_spec("b.weight", vec![4]),
    ])
}

fn expect_two() -> Vec<ExpectedTensor> {
    vec![
        expected("a.weight", vec![2, 3]),
        expected("b.weight", vec![4]),
    ]
}

#[test]
fn a_good_file_loads() {
    let dir = scratch("good");
    write_model(&dir, &two_tensors());
    let gpu = CpuBackend::new();
    let mut store = load_safetensors(
        &dir,
        &expect_two(),
        &gpu,
        WeightDType::AsStored,
        &mut |_| {},
    )
    .unwrap();
    let a = store.get("a.weight").unwrap().clone();
    let g: &dyn GpuBackend = &gpu;
    assert_eq!(
        g.download_f32(a.slice).unwrap(),
        vec![-1.0, -0.5, 0.0, 0.5, 1.0, 1.5]
    );
    metrale_core::scope::ModelResource::release(&mut store, &gpu).unwrap();
    assert_eq!(gpu.live_bytes(), 0);
}

#[test]
fn truncated_file() {
    let dir = scratch("truncated");
    let mut bytes = std::fs::read(fixture("llama").join("model.safetensors")).unwrap();
    bytes.truncate(bytes.len() - 100);
    write_model(&dir, &bytes);
    let expected = vec![expected("model.norm.weight", vec![64])];
    let err = load_err(&dir, &expected, &["model.safetensors", "truncated"]);
    assert!(matches!(err, WeightsError::Truncated { .. }), "{err:?}");

    write_model(&dir, &[1, 2, 3]);
    let err = load_err(&dir, &expected, &["model.safetensors"]);
    assert!(matches!(err, WeightsError::Truncated { .. }), "{err:?}");
}

#[test]
fn header_length_beyond_the_file() {
    let dir = scratch("header-len");
    let mut bytes = two_tensors();
    let len = bytes.len() as u64;
    bytes[..8].copy_from_slice(&len.to_le_bytes());
    write_model(&dir, &bytes);
    let err = load_err(&dir, &expect_two(), &["model.safetensors", "header length"]);
    assert!(
        matches!(err, WeightsError::HeaderTooLarge { .. }),
        "{err:?}"
    );
}

#[test]
fn invalid_header_json() {
    let dir = scratch("bad-json");
    write_model(
        &dir,
        &image_with_header("{\"a.weight\": {\"dtype\": \"F32\",", &[0; 8]),
    );
    let err = load_err(&dir, &expect_two(), &["model.safetensors", "JSON"]);
    assert!(matches!(err, WeightsError::InvalidHeader { .. }), "{err:?}");

    // Well-formed JSON, malformed entry: the message names the tensor.
    write_model(
        &dir,
        &image_with_header(
            r#"{"a.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}"#,
            &[0; 8],
        ),
    );
    let err = load_err(
        &dir,
        &expect_two(),
        &["model.safetensors", "a.weight", "data_offsets"],
    );
    assert!(matches!(err, WeightsError::InvalidHeader { .. }), "{err:?}");
}

#[test]
fn offsets_out_of_range() {
    let dir = scratch("offsets");
    // b's range lies past the end of the data, with a gap before it.
    let header = r#"{"a.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                     "b.weight": {"dtype": "F32", "shape": [2], "data_offsets": [1000, 1008]}}"#;
    write_model(&dir, &image_with_header(header, &[0; 16]));
    let err = load_err(
        &dir,
        &[expected("a.weight", vec![2])],
        &["model.safetensors", "b.weight"],
    );
    assert!(
        matches!(err, WeightsError::OffsetsOutOfRange { .. }),
        "{err:?}"
    );

    // A range that disagrees with the shape.
    let header = r#"{"a.weight": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}"#;
    write_model(&dir, &image_with_header(header, &[0; 8]));
    let err = load_err(
        &dir,
        &[expected("a.weight", vec![3])],
        &["model.safetensors", "a.weight"],
    );
    assert!(
        matches!(err, WeightsError::OffsetsOutOfRange { .. }),
        "{err:?}"
    );

    // Reversed offsets.
    let header = r#"{"a.weight": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}}"#;
    write_model(&dir, &image_with_header(header, &[0; 8]));
    let err = load_err(&dir, &[expected("a.weight", vec![0])], &["a.weight"]);
    assert!(
        matches!(err, WeightsError::OffsetsOutOfRange { .. }),
        "{err:?}"
    );
}

#[test]
fn overlapping_tensors() {
    let dir = scratch("overlap");
    let header = r#"{"a.weight": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                     "b.weight": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}"#;
    write_model(&dir, &image_with_header(header, &[0; 16]));
    let err = load_err(
        &dir,
        &[expected("a.weight", vec![4])],
        &["model.safetensors", "a.weight", "b.weight", "overlap"],
    );
    assert!(matches!(err, WeightsError::Overlap { .. }), "{err:?}");
}

#[test]
fn unsupported_dtype() {
    let dir = scratch("dtype");
    let specs = [Spec {
        name: "a.weight",
        dtype: "I64",
        shape: vec![2],
        data: vec![0; 16],
    }];
    write_model(&dir, &image(&specs));
    let err = load_err(
        &dir,
        &[expected("a.weight", vec![2])],
        &["model.safetensors", "a.weight", "I64"],
    );
    assert!(
        matches!(err, WeightsError::UnsupportedDType { .. }),
        "{err:?}"
    );

    // An unknown dtype name on a needed tensor is refused too.
    let header = r#"{"a.weight": {"dtype": "Q4_K", "shape": [2], "data_offsets": [0, 3]}}"#;
    write_model(&dir, &image_with_header(header, &[0; 3]));
    let err = load_err(
        &dir,
        &[expected("a.weight", vec![2])],
        &["a.weight", "Q4_K"],
    );
    assert!(
        matches!(err, WeightsError::UnsupportedDType { .. }),
        "{err:?}"
    );
}

#[test]
fn missing_tensor() {
    let dir = scratch("missing");
    write_model(&dir, &two_tensors());
    let mut expected_tensors = expect_two();
    expected_tensors.push(expected("c.weight", vec![1]));
    let err = load_err(
        &dir,
        &expected_tensors,
        &["model.safetensors", "c.weight", "missing"],
    );
    assert!(matches!(err, WeightsError::MissingTensor { .. }), "{err:?}");
}

#[test]
fn wrong_shape() {
    let dir = scratch("shape");
    write_model(&dir, &two_tensors());
    let err = load_err(
        &dir,
        &[expected("a.weight", vec![3, 2])],
        &["model.safetensors", "a.weight", "[2, 3]", "[3, 2]"],
    );
    assert!(matches!(err, WeightsError::WrongShape { .. }), "{err:?}");
}

#[test]
fn no_weights_at_all() {
    let dir = scratch("empty");
    let err = load_err(&dir, &expect_two(), &["no weights"]);
    assert!(matches!(err, WeightsError::NoWeights { .. }), "{err:?}");
}

#[test]
fn extra_tensors_are_warnings() {
    let dir = scratch("extra");
    let specs = [
        f32_spec("a.weight", vec![2, 3]),
        f32_spec("b.weight", vec![4]),
        Spec {
            name: "step",
            dtype: "I64",
            shape: vec![],
            data: vec![0; 8],
        },
    ];
    write_model(&dir, &image(&specs));
    let gpu = CpuBackend::new();
    let mut events = Vec::new();
    let mut store = load_safetensors(
        &dir,
        &[expected("a.weight", vec![2, 3])],
        &gpu,
        WeightDType::AsStored,
        &mut |e| events.push(e),
    )
    .unwrap();
    let warnings: Vec<String> = events
        .iter()
        .filter_map(|e| {
            if let LoadProgress::Warning(w) = e {
                Some(w.clone())
            } else {
                None
            }
        })
        .collect();
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(
        warnings.iter().any(|w| w.contains("b.weight"))
            && warnings.iter().any(|w| w.contains("\"step\""))
    );
    assert_eq!(store.len(), 1);
    metrale_core::scope::ModelResource::release(&mut store, &gpu).unwrap();
    assert_eq!(gpu.live_bytes(), 0);
}

#[test]
fn broken_shard_index() {
    let dir = scratch("index");
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        "{\"weight_map\": {\"a.weight\": \"model-00001-of-00002.safetensors\"}}",
    )
    .unwrap();
    let err = load_err(
        &dir,
        &expect_two(),
        &[
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
        ],
    );
    assert!(matches!(err, WeightsError::MissingShard { .. }), "{err:?}");

    std::fs::write(
        dir.join("model.safetensors.index.json"),
        "{\"weight_map\": [1, 2]}",
    )
    .unwrap();
    let err = load_err(
        &dir,
        &expect_two(),
        &["model.safetensors.index.json", "weight_map"],
    );
    assert!(matches!(err, WeightsError::InvalidIndex { .. }), "{err:?}");

    std::fs::write(
        dir.join("model.safetensors.index.json"),
        "{\"weight_map\": {\"a.weight\": \"../x.safetensors\"}}",
    )
    .unwrap();
    let err = load_err(
        &dir,
        &expect_two(),
        &["model.safetensors.index.json", "a.weight"],
    );
    assert!(matches!(err, WeightsError::InvalidIndex { .. }), "{err:?}");

    // Two shards both storing a.weight.
    std::fs::write(
        dir.join("s1.safetensors"),
        image(&[f32_spec("a.weight", vec![2, 3])]),
    )
    .unwrap();
    std::fs::write(
        dir.join("s2.safetensors"),
        image(&[
            f32_spec("a.weight", vec![2, 3]),
            f32_spec("b.weight", vec![4]),
        ]),
    )
    .unwrap();
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"weight_map": {"a.weight": "s1.safetensors", "b.weight": "s2.safetensors"}}"#,
    )
    .unwrap();
    let err = load_err(
        &dir,
        &expect_two(),
        &["a.weight", "s1.safetensors", "s2.safetensors"],
    );
    assert!(
        matches!(err, WeightsError::DuplicateTensor { .. }),
        "{err:?}"
    );

    // The index maps a tensor to a shard that does not hold it.
    std::fs::write(
        dir.join("s2.safetensors"),
        image(&[f32_spec("b.weight", vec![4])]),
    )
    .unwrap();
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"weight_map": {"a.weight": "s2.safetensors", "b.weight": "s1.safetensors"}}"#,
    )
    .unwrap();
    let err = load_err(
        &dir,
        &expect_two(),
        &["model.safetensors.index.json", "a.weight"],
    );
    assert!(matches!(err, WeightsError::InvalidIndex { .. }), "{err:?}");
}

/// A file truncated after its header was checked (another process rewriting
/// the checkpoint while it loads): an error naming the file and the tensor
/// whose bytes are gone, never a signal, and nothing left allocated.
#[test]
fn a_file_truncated_while_loading() {
    let dir = scratch("truncated-while-loading");
    let file = dir.join("model.safetensors");
    let bytes = image(&[
        f32_spec("a.weight", vec![256, 64]),
        f32_spec("b.weight", vec![64]),
    ]);
    write_model(&dir, &bytes);
    let expected = [
        expected("a.weight", vec![256, 64]),
        expected("b.weight", vec![64]),
    ];
    let gpu = CpuBackend::new();
    let mut truncate = |p: LoadProgress| {
        if matches!(p, LoadProgress::Start { .. }) {
            // The header has been read and checked; cut the data short.
            let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
            f.set_len(bytes.len() as u64 / 4).unwrap();
        }
    };
    let err = match load_safetensors(&dir, &expected, &gpu, WeightDType::AsStored, &mut truncate) {
        Ok(_) => panic!("a truncated file should not load"),
        Err(e) => e,
    };
    let message = err.to_string();
    assert!(message.contains("model.safetensors"), "{message}");
    assert!(message.contains("a.weight"), "{message}");
    assert!(message.contains("changed while loading"), "{message}");
    assert_eq!(gpu.live_bytes(), 0, "{message}");
}

/// A GPTQ / AWQ / bitsandbytes / FP8 checkpoint is refused by its method
/// (from the tensor names), before the tensor the model expects in its
/// place (`q_proj.weight`) is reported missing, by a load and by a scan.
#[test]
fn quantized_tensor_names_are_refused_as_such() {
    let i32_spec = |name: &'static str| Spec {
        name,
        dtype: "I32",
        shape: vec![2, 2],
        data: vec![0; 16],
    };
    let cases: [(&str, Vec<Spec<'static>>, &str); 5] = [
        (
            "gptq",
            vec![
                i32_spec("model.layers.0.self_attn.q_proj.qweight"),
                i32_spec("model.layers.0.self_attn.q_proj.qzeros"),
                f32_spec("model.layers.0.self_attn.q_proj.scales", vec![2]),
                i32_spec("model.layers.0.self_attn.q_proj.g_idx"),
            ],
            "GPTQ",
        ),
        (
            "awq",
            vec![
                i32_spec("model.layers.0.self_attn.q_proj.qweight"),
                i32_spec("model.layers.0.self_attn.q_proj.qzeros"),
                f32_spec("model.layers.0.self_attn.q_proj.scales", vec![2]),
            ],
            "AWQ",
        ),
        (
            "bnb",
            vec![
                f32_spec("model.layers.0.self_attn.q_proj.weight", vec![2, 2]),
                f32_spec("model.layers.0.self_attn.q_proj.weight.absmax", vec![2]),
            ],
            "bitsandbytes",
        ),
        (
            "fp8",
            vec![
                f32_spec("model.layers.0.self_attn.q_proj.weight", vec![2, 2]),
                f32_spec("model.layers.0.self_attn.q_proj.weight_scale_inv", vec![1]),
            ],
            "FP8",
        ),
        (
            "plain",
            vec![f32_spec(
                "model.layers.0.self_attn.o_proj.weight",
                vec![2, 2],
            )],
            "",
        ),
    ];
    let wanted = vec![expected(
        "model.layers.0.self_attn.q_proj.weight",
        vec![4, 4],
    )];
    for (tag, specs, method) in cases {
        let dir = scratch(&format!("quantized-{tag}"));
        write_model(&dir, &image(&specs));
        if method.is_empty() {
            // Nothing quantized: the missing tensor is what is reported.
            let err = load_err(&dir, &wanted, &["q_proj.weight"]);
            assert!(matches!(err, WeightsError::MissingTensor { .. }), "{err:?}");
            continue;
        }
        let err = load_err(&dir, &wanted, &[method, "quantized", "model.safetensors"]);
        assert!(
            matches!(err, WeightsError::Quantized { .. }),
            "{tag}: {err:?}"
        );
        let scan = metrale_model_weights::loader::scan_safetensors(&dir).expect_err(tag);
        assert!(scan.to_string().contains(method), "{scan}");
    }
}
