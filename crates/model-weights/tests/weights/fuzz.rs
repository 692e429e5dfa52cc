//! Randomly mutated safetensors files: the loader returns an error or a
//! store, never panics, and the ledger is empty once the store is released.

use crate::common;

use common::*;
use metrale_core::scope::ModelResource;
use metrale_gpu_runtime::GpuBackend;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_model_weights::loader::{
    ExpectedTensor, LoadProgress, WeightDType, load_safetensors, parse_safetensors,
};
use proptest::prelude::*;
use serde_json::{Value, json};

fn base_specs() -> Vec<Spec<'static>> {
    vec![
        f32_spec("a.weight", vec![2, 3]),
        Spec {
            name: "b.weight",
            dtype: "BF16",
            shape: vec![4],
            data: vec![0x80, 0x3f, 0, 0x40, 0x40, 0x40, 0x80, 0x40],
        },
        Spec {
            name: "c.bias",
            dtype: "F16",
            shape: vec![2, 2],
            data: vec![0, 0x3c, 0, 0x40, 0, 0x42, 0, 0x44],
        },
    ]
}

fn expected_all() -> Vec<ExpectedTensor> {
    vec![
        expected("a.weight", vec![2, 3]),
        expected("b.weight", vec![4]),
        expected("c.bias", vec![2, 2]),
    ]
}

/// One way to damage a file.
#[derive(Clone, Debug)]
enum Mutation {
    /// Overwrite the byte at (position modulo length).
    Byte(usize, u8),
    /// Cut the file at (position modulo length + 1).
    Truncate(usize),
    /// Replace the header length field.
    HeaderLen(u64),
    /// Append bytes.
    Append(Vec<u8>),
    /// Replace one field of one header entry with a JSON value.
    Field(usize, &'static str, Value),
    /// Remove one field of one header entry.
    Remove(usize, &'static str),
    /// Add an entry.
    Entry(String, Value),
}

fn json_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        (0u64..64).prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        prop::sample::select(vec![
            "F32", "BF16", "F16", "I64", "U8", "F8_E4M3", "BOOL", "Q4", ""
        ])
        .prop_map(|s| json!(s)),
        prop::collection::vec(0u64..80, 0..4).prop_map(|v| json!(v)),
        prop::collection::vec(any::<u64>(), 2).prop_map(|v| json!(v)),
        Just(json!({"x": 1})),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let field = prop::sample::select(vec!["dtype", "shape", "data_offsets"]);
    prop_oneof![
        3 => (any::<usize>(), any::<u8>()).prop_map(|(p, b)| Mutation::Byte(p, b)),
        1 => any::<usize>().prop_map(Mutation::Truncate),
        1 => prop_oneof![Just(0u64), Just(1), Just(u64::MAX), 0u64..400, any::<u64>()].prop_map(Mutation::HeaderLen),
        1 => prop::collection::vec(any::<u8>(), 1..16).prop_map(Mutation::Append),
        3 => (0usize..3, field.clone(), json_value()).prop_map(|(i, f, v)| Mutation::Field(i, f, v)),
        1 => (0usize..3, field).prop_map(|(i, f)| Mutation::Remove(i, f)),
        1 => ("[a-z.]{1,8}", json_value()).prop_map(|(n, v)| Mutation::Entry(n, v)),
    ]
}

/// The base file with `mutations` applied in order.
fn mutated(mutations: &[Mutation]) -> Vec<u8> {
    let specs = base_specs();
    let data: Vec<u8> = specs.iter().flat_map(|s| s.data.clone()).collect();
    let mut header: Value = {
        let bytes = image(&specs);
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        serde_json::from_slice(&bytes[8..8 + n]).unwrap()
    };
    let names = ["a.weight", "b.weight", "c.bias"];
    // Header-level mutations first, then the byte-level ones on the image.
    for m in mutations {
        match m {
            Mutation::Field(i, f, v) => {
                if let Some(o) = header[names[*i]].as_object_mut() {
                    o.insert(f.to_string(), v.clone());
                }
            }
            Mutation::Remove(i, f) => {
                if let Some(o) = header[names[*i]].as_object_mut() {
                    o.remove(*f);
                }
            }
            Mutation::Entry(n, v) => header[n.as_str()] = v.clone(),
            _ => {}
        }
    }
    let mut file = image_with_header(&header.to_string(), &data);
    for m in mutations {
        match m {
            // A byte mutation after a truncation to nothing has no byte to hit.
            Mutation::Byte(p, b) if !file.is_empty() => {
                let i = p % file.len();
                file[i] = *b;
            }
            Mutation::Truncate(p) => file.truncate(p % (file.len() + 1)),
            Mutation::HeaderLen(n) if file.len() >= 8 => {
                file[..8].copy_from_slice(&n.to_le_bytes())
            }
            Mutation::Append(extra) => file.extend_from_slice(extra),
            _ => {}
        }
    }
    file
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// Header parsing alone, on in-memory images.
    #[test]
    fn parsing_never_panics(mutations in prop::collection::vec(mutation(), 1..4)) {
        let file = mutated(&mutations);
        if let Ok((start, entries)) = parse_safetensors(std::path::Path::new("fuzz.safetensors"), &file) {
            // A header that passes covers only bytes that exist.
            for e in entries {
                prop_assert!(e.start <= e.end && start + e.end <= file.len());
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// Whole loads from disk, with every policy.
    #[test]
    fn loading_never_panics_nor_leaks(
        mutations in prop::collection::vec(mutation(), 1..4),
        policy in prop::sample::select(vec![WeightDType::AsStored, WeightDType::F32, WeightDType::BF16, WeightDType::F16]),
        cut_while_loading in prop::option::of(any::<usize>()),
    ) {
        let dir = scratch("fuzz");
        let file = write_model(&dir, &mutated(&mutations));
        let gpu = CpuBackend::new();
        // Optionally the file is cut short once its header has been checked
        // (another process rewriting it): an error, never a signal.
        let mut progress = |p: LoadProgress| {
            if let (LoadProgress::Start { .. }, Some(cut)) = (p, cut_while_loading) {
                let len = std::fs::metadata(&file).map_or(0, |m| m.len());
                if let Ok(f) = std::fs::OpenOptions::new().write(true).open(&file) {
                    let _ = f.set_len(cut as u64 % (len + 1));
                }
            }
        };
        match load_safetensors(&dir, &expected_all(), &gpu, policy, &mut progress) {
            Ok(mut store) => {
                prop_assert_eq!(store.len(), 3);
                store.release(&gpu).unwrap();
            }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
        prop_assert_eq!(gpu.live_bytes(), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn the_unmutated_file_loads() {
    let dir = scratch("fuzz-base");
    write_model(&dir, &mutated(&[]));
    let gpu = CpuBackend::new();
    let mut store =
        load_safetensors(&dir, &expected_all(), &gpu, WeightDType::F32, &mut |_| {}).unwrap();
    let g: &dyn GpuBackend = &gpu;
    assert_eq!(
        g.download_f32(store.get("b.weight").unwrap().slice)
            .unwrap(),
        vec![1.0, 2.0, 3.0, 4.0]
    );
    assert_eq!(
        g.download_f32(store.get("c.bias").unwrap().slice).unwrap(),
        vec![1.0, 2.0, 3.0, 4.0]
    );
    store.release(&gpu).unwrap();
    assert_eq!(gpu.live_bytes(), 0);
}
