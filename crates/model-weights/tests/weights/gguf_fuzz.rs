//! Damaged GGUF files: the reader (and the tokenizer rebuilt from the
//! metadata) returns an error or a checked file, never panics, and every
//! error names the file, and the key or tensor when one is at fault.
//! Truncation at every offset and byte changes at every offset are tried
//! exhaustively; proptest tries random combinations of damage.
//!
//! What comes after the reader (the config rebuilt from the metadata, the
//! tensors it expects) is fuzzed from the same kinds of damage in
//! model-engine's tests/gguf_fuzz.rs, in a child process with a bounded
//! address space.

use metrale_core::quant::GgmlType;
use metrale_model_weights::WeightsError;
use metrale_model_weights::gguf::{
    GgufArray, GgufFile, GgufValue, GgufWriter, special_tokens, tokenizer_json,
};
use proptest::prelude::*;

const NAME: &str = "fuzz.gguf";

fn strings(v: &[&str]) -> GgufValue {
    GgufValue::Array(GgufArray::String(v.iter().map(|s| s.to_string()).collect()))
}

/// A small file with metadata of several types, a tokenizer and tensors.
fn base() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add("general.architecture", GgufValue::String("llama".into()))
        .add("llama.context_length", GgufValue::U32(64))
        .add("llama.rope.freq_base", GgufValue::F32(10000.0))
        .add("tokenizer.ggml.model", GgufValue::String("gpt2".into()))
        .add("tokenizer.ggml.pre", GgufValue::String("gpt-2".into()))
        .add("tokenizer.ggml.tokens", strings(&["a", "b", "ab", "<s>"]))
        .add("tokenizer.ggml.merges", strings(&["a b"]))
        .add(
            "tokenizer.ggml.token_type",
            GgufValue::Array(GgufArray::I32(vec![1, 1, 1, 3])),
        )
        .add("tokenizer.ggml.bos_token_id", GgufValue::U32(3))
        .add("tokenizer.ggml.add_bos_token", GgufValue::Bool(true))
        .add(
            "x.nested",
            GgufValue::Array(GgufArray::Array(vec![GgufArray::U16(vec![1, 2])])),
        )
        .add_tensor("tok.weight", GgmlType::F32, &[2, 3], vec![1; 24])
        .add_tensor("blk.q8", GgmlType::Q8_0, &[1, 32], vec![2; 34])
        .add_tensor("norm", GgmlType::F16, &[4], vec![3; 8]);
    w.to_bytes().expect("the base file encodes")
}

/// Opens `image`; on success uses everything the file offers, on failure
/// checks the error names the file (and the key or tensor at fault).
fn check(image: Vec<u8>) {
    match GgufFile::from_bytes(NAME, image) {
        Ok(file) => {
            for t in file.tensors() {
                assert_eq!(t.data.len(), t.info.byte_len);
                assert_eq!(t.info.elems(), t.info.dims.iter().product::<u64>() as usize);
            }
            let _ = file.get_u32("llama.context_length");
            let _ = file.get_f32("llama.rope.freq_base");
            let _ = file.get_str_array("tokenizer.ggml.tokens");
            let _ = file.get_i32_array("tokenizer.ggml.token_type");
            match tokenizer_json(&file) {
                // What the checks let through must load.
                Ok(json) => {
                    let bytes = serde_json::to_vec(&json).unwrap();
                    if let Err(e) = tokenizers::Tokenizer::from_bytes(bytes) {
                        panic!("{e}: {json}");
                    }
                }
                Err(e) => named(&e),
            }
            if let Err(e) = special_tokens(&file) {
                named(&e);
            }
        }
        Err(e) => named(&e),
    }
}

fn named(e: &WeightsError) {
    let text = e.to_string();
    assert!(text.starts_with(&format!("{NAME}: ")), "{text}");
    match e {
        WeightsError::GgufMetadata { key, .. } | WeightsError::GgufWrongType { key, .. } => {
            assert!(!key.is_empty(), "{text}")
        }
        WeightsError::GgufTensor { tensor, .. } => assert!(!tensor.is_empty(), "{text}"),
        _ => {}
    }
}

#[test]
fn the_base_file_is_valid() {
    let file = GgufFile::from_bytes(NAME, base()).unwrap();
    assert_eq!(file.tensor_infos().len(), 3);
    tokenizer_json(&file).unwrap();
}

#[test]
fn every_truncation_is_an_error_naming_the_file() {
    let image = base();
    for len in 0..image.len() {
        let mut cut = image.clone();
        cut.truncate(len);
        // Cutting only the last tensor's padding leaves a valid file.
        match GgufFile::from_bytes(NAME, cut) {
            Ok(_) => assert!(len >= image.len() - 24, "cut at {len} of {}", image.len()),
            Err(e) => named(&e),
        }
    }
}

#[test]
fn every_byte_changed_is_handled() {
    let image = base();
    for at in 0..image.len() {
        for value in [0u8, 1, 0x7f, 0xff, image[at].wrapping_add(1)] {
            let mut changed = image.clone();
            changed[at] = value;
            check(changed);
        }
    }
}

/// One way to damage a file.
#[derive(Clone, Debug)]
enum Damage {
    Byte(usize, u8),
    U32(usize, u32),
    U64(usize, u64),
    Truncate(usize),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
}

fn interesting_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(u64::MAX),
        Just(1 << 63),
        Just(u32::MAX as u64),
        0u64..64,
        (0u64..16).prop_map(|n| n * 32),
        any::<u64>(),
    ]
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        3 => (any::<usize>(), any::<u8>()).prop_map(|(p, b)| Damage::Byte(p, b)),
        2 => (any::<usize>(), prop_oneof![0u32..16, Just(u32::MAX), any::<u32>()])
            .prop_map(|(p, v)| Damage::U32(p, v)),
        2 => (any::<usize>(), interesting_u64()).prop_map(|(p, v)| Damage::U64(p, v)),
        1 => any::<usize>().prop_map(Damage::Truncate),
        1 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..12))
            .prop_map(|(p, b)| Damage::Insert(p, b)),
        1 => (any::<usize>(), 1usize..16).prop_map(|(p, n)| Damage::Remove(p, n)),
    ]
}

fn apply(image: &mut Vec<u8>, d: &Damage) {
    let len = image.len().max(1);
    match d {
        Damage::Byte(p, b) => {
            if let Some(x) = image.get_mut(p % len) {
                *x = *b;
            }
        }
        Damage::U32(p, v) => {
            let at = p % len;
            for (i, b) in v.to_le_bytes().into_iter().enumerate() {
                if let Some(x) = image.get_mut(at + i) {
                    *x = b;
                }
            }
        }
        Damage::U64(p, v) => {
            let at = p % len;
            for (i, b) in v.to_le_bytes().into_iter().enumerate() {
                if let Some(x) = image.get_mut(at + i) {
                    *x = b;
                }
            }
        }
        Damage::Truncate(p) => image.truncate(p % len),
        Damage::Insert(p, bytes) => {
            let at = (p % len).min(image.len());
            image.splice(at..at, bytes.iter().copied());
        }
        Damage::Remove(p, n) => {
            let at = (p % len).min(image.len());
            let end = (at + n).min(image.len());
            image.drain(at..end);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_damage_never_panics(damages in prop::collection::vec(damage(), 1..5)) {
        let mut image = base();
        for d in &damages {
            apply(&mut image, d);
        }
        check(image);
    }
}

/// Offset of the field after tensor `name`'s name in `image`.
fn after_name(image: &[u8], name: &str) -> usize {
    let mut needle = (name.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(name.as_bytes());
    image
        .windows(needle.len())
        .rposition(|w| w == needle)
        .expect("the tensor is in the base file")
        + needle.len()
}

/// One field of one tensor-info entry.
#[derive(Clone, Copy, Debug)]
enum Field {
    NDims,
    Dim(usize),
    Type,
    Offset,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// The tensor table damaged field by field: n_dims, dims, type ids and
    /// offsets set to edge values.
    #[test]
    fn damaged_tensor_tables_are_refused_by_name(
        fields in prop::collection::vec(
            (
                prop::sample::select(vec!["tok.weight", "blk.q8", "norm"]),
                prop_oneof![
                    Just(Field::NDims),
                    (0usize..2).prop_map(Field::Dim),
                    Just(Field::Type),
                    Just(Field::Offset),
                ],
                interesting_u64(),
            ),
            1..4,
        )
    ) {
        let mut image = base();
        for (name, field, value) in fields {
            // Field positions in the undamaged file: damage never moves them.
            let pristine = base();
            let at = after_name(&pristine, name);
            let n_dims = u32::from_le_bytes(pristine[at..at + 4].try_into().unwrap()) as usize;
            match field {
                Field::NDims => image[at..at + 4].copy_from_slice(&(value as u32).to_le_bytes()),
                Field::Dim(k) if k < n_dims => {
                    let p = at + 4 + 8 * k;
                    image[p..p + 8].copy_from_slice(&value.to_le_bytes());
                }
                Field::Dim(_) => {}
                Field::Type => {
                    let p = at + 4 + 8 * n_dims;
                    image[p..p + 4].copy_from_slice(&(value as u32 % 48).to_le_bytes());
                }
                Field::Offset => {
                    let p = at + 4 + 8 * n_dims + 4;
                    image[p..p + 8].copy_from_slice(&value.to_le_bytes());
                }
            }
        }
        check(image);
    }
}

fn value_strategy() -> impl Strategy<Value = GgufValue> {
    let leaf = prop_oneof![
        any::<u8>().prop_map(GgufValue::U8),
        any::<i8>().prop_map(GgufValue::I8),
        any::<u16>().prop_map(GgufValue::U16),
        any::<i16>().prop_map(GgufValue::I16),
        any::<u32>().prop_map(GgufValue::U32),
        any::<i32>().prop_map(GgufValue::I32),
        any::<u64>().prop_map(GgufValue::U64),
        any::<i64>().prop_map(GgufValue::I64),
        (-1e30f32..1e30).prop_map(GgufValue::F32),
        (-1e300f64..1e300).prop_map(GgufValue::F64),
        any::<bool>().prop_map(GgufValue::Bool),
        ".{0,12}".prop_map(GgufValue::String),
    ];
    let array = array_strategy().prop_map(GgufValue::Array);
    prop_oneof![3 => leaf, 1 => array]
}

fn array_strategy() -> impl Strategy<Value = GgufArray> {
    let flat = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..6).prop_map(GgufArray::U8),
        prop::collection::vec(any::<i16>(), 0..6).prop_map(GgufArray::I16),
        prop::collection::vec(any::<i32>(), 0..6).prop_map(GgufArray::I32),
        prop::collection::vec(-1e30f32..1e30, 0..6).prop_map(GgufArray::F32),
        prop::collection::vec(any::<bool>(), 0..6).prop_map(GgufArray::Bool),
        prop::collection::vec(".{0,6}", 0..6).prop_map(GgufArray::String),
        prop::collection::vec(any::<u64>(), 0..6).prop_map(GgufArray::U64),
    ];
    flat.prop_recursive(3, 24, 4, |inner| {
        prop::collection::vec(inner, 1..4).prop_map(GgufArray::Array)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// reader(writer(x)) == x for any metadata and tensors.
    #[test]
    fn writer_then_reader_is_identity(
        metadata in prop::collection::btree_map("[a-z.]{1,10}", value_strategy(), 0..8),
        tensors in prop::collection::vec(
            (
                prop::sample::select(vec![GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::I8]),
                prop::collection::vec(0usize..3, 0..3),
                any::<u8>(),
            ),
            0..5,
        ),
        alignment in prop::sample::select(vec![None, Some(1u32), Some(8), Some(64)]),
    ) {
        let mut w = GgufWriter::new();
        if let Some(a) = alignment {
            w.set_alignment(a);
        }
        let metadata: Vec<(String, GgufValue)> = metadata
            .into_iter()
            .filter(|(k, _)| k != "general.alignment")
            .collect();
        for (k, v) in &metadata {
            w.add(k.clone(), v.clone());
        }
        let mut expected = Vec::new();
        for (i, (ty, outer, seed)) in tensors.into_iter().enumerate() {
            let mut shape = outer;
            shape.push(ty.block_elems() * (1 + i % 2));
            let rows: usize = shape[..shape.len() - 1].iter().product();
            let len = rows * ty.row_bytes(shape[shape.len() - 1]).unwrap();
            let data: Vec<u8> = (0..len).map(|j| (j as u8).wrapping_add(seed)).collect();
            w.add_tensor(format!("t{i}"), ty, &shape, data.clone());
            expected.push((format!("t{i}"), ty, shape, data));
        }
        let file = GgufFile::from_bytes(NAME, w.to_bytes().unwrap()).unwrap();
        let found: Vec<&(String, GgufValue)> = file
            .metadata()
            .iter()
            .filter(|(k, _)| k != "general.alignment")
            .collect();
        prop_assert_eq!(found, metadata.iter().collect::<Vec<_>>());
        prop_assert_eq!(file.alignment(), alignment.map_or(32, |a| a as usize));
        let got: Vec<(String, GgmlType, Vec<usize>, Vec<u8>)> = file
            .tensors()
            .map(|t| (t.name().to_string(), t.ggml_type(), t.shape().to_vec(), t.data.to_vec()))
            .collect();
        prop_assert_eq!(got, expected);
    }
}
