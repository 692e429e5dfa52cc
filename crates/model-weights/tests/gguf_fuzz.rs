//! Damaged GGUF files: the reader (and the tokenizer rebuilt from the
//! metadata) returns an error or a checked file, never panics, and every
//! error names the file, and the key or tensor when one is at fault.
//! Truncation at every offset and byte changes at every offset are tried
//! exhaustively; proptest tries random combinations of damage.

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
