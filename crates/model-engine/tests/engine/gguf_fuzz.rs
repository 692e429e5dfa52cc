//! The GGUF fuzz target carried through everything done with a model file
//! before its weights are read: the reader (model-weights'
//! tests/gguf_fuzz.rs fuzzes it alone), the config rebuilt from the
//! metadata and parsed, the expected tensors listed, the tokenizer built.
//!
//! Each fixture of tests/fixtures/gguf-bf16 is damaged in two ways:
//! - every metadata key set to edge values (0, 4097, 2^26, u32::MAX,
//!   u64::MAX, -1, NaN, infinities, empty and 2^20-long arrays, another
//!   type), removed, and tensors the config reads sizes from left without
//!   dimensions or elements;
//! - random bytes of the header (metadata and tensor table) changed.
//!
//! Every mutation must end in a success or an error naming the file; the
//! whole run happens in a child process limited to 2 GiB of address space
//! and a deadline (tests/limited), so that an allocation sized by the
//! metadata aborts it and a loop sized by it times out: both fail the test.

use crate::hostile;
use crate::limited;

use std::time::Duration;

use hostile::*;
use limited::run_limited;
use metrale_model_weights::gguf::{GgufArray, GgufFile, GgufValue};

const DEADLINE: Duration = Duration::from_secs(120);

/// Random header damages per fixture.
const RANDOM: usize = 150;

/// Elements of a "huge" array: far more than layers or a vocabulary's
/// share of a small file, small enough to stay quick.
const HUGE: usize = 1 << 20;

fn ints() -> Vec<GgufValue> {
    vec![
        GgufValue::U32(0),
        GgufValue::U32(1),
        GgufValue::U32(4097),
        GgufValue::U32(1 << 26),
        GgufValue::U32(u32::MAX),
        GgufValue::U64(u64::MAX),
        GgufValue::I32(-1),
    ]
}

fn floats() -> Vec<GgufValue> {
    vec![
        GgufValue::F32(0.0),
        GgufValue::F32(f32::NAN),
        GgufValue::F32(f32::NEG_INFINITY),
        GgufValue::F64(1e300),
    ]
}

/// `a` repeated (its first element) to `n` elements, or emptied.
fn resized(a: &GgufArray, n: usize) -> GgufArray {
    fn fill<T: Clone>(v: &[T], n: usize) -> Vec<T> {
        v.first().map_or(Vec::new(), |x| vec![x.clone(); n])
    }
    match a {
        GgufArray::U8(v) => GgufArray::U8(fill(v, n)),
        GgufArray::I8(v) => GgufArray::I8(fill(v, n)),
        GgufArray::U16(v) => GgufArray::U16(fill(v, n)),
        GgufArray::I16(v) => GgufArray::I16(fill(v, n)),
        GgufArray::U32(v) => GgufArray::U32(fill(v, n)),
        GgufArray::I32(v) => GgufArray::I32(fill(v, n)),
        GgufArray::F32(v) => GgufArray::F32(fill(v, n)),
        GgufArray::Bool(v) => GgufArray::Bool(fill(v, n)),
        // Strings: each is a token the tokenizer builds; fewer of them.
        GgufArray::String(v) => GgufArray::String(fill(v, n / 16)),
        GgufArray::Array(v) => GgufArray::Array(fill(v, n)),
        GgufArray::U64(v) => GgufArray::U64(fill(v, n)),
        GgufArray::I64(v) => GgufArray::I64(fill(v, n)),
        GgufArray::F64(v) => GgufArray::F64(fill(v, n)),
    }
}

/// The edge values tried for a key holding `v`.
fn edge_values(v: &GgufValue) -> Vec<GgufValue> {
    let mut out = match v {
        GgufValue::F32(_) | GgufValue::F64(_) => floats(),
        GgufValue::Bool(b) => vec![GgufValue::Bool(!b)],
        GgufValue::String(_) => vec![GgufValue::String(String::new())],
        GgufValue::Array(a) => {
            let mut v = vec![
                GgufValue::Array(resized(a, 0)),
                GgufValue::Array(resized(a, 1)),
                GgufValue::Array(resized(a, HUGE)),
                GgufValue::Array(GgufArray::U8(vec![1; a.len()])),
            ];
            if let GgufArray::String(s) = a {
                v.push(GgufValue::Array(GgufArray::String(vec![
                    String::new();
                    s.len()
                ])));
            }
            v
        }
        _ => ints(),
    };
    // Another type altogether.
    out.push(match v {
        GgufValue::String(_) => GgufValue::U32(7),
        _ => GgufValue::String("x".into()),
    });
    out
}

/// The structured mutations of `file`: each key at its edge values and
/// removed, size tensors without dimensions or elements.
fn mutations(file: &GgufFile) -> Vec<(String, Vec<Edit>)> {
    let mut out = Vec::new();
    for (key, v) in file.metadata() {
        if key == "general.alignment" {
            continue;
        }
        for (i, e) in edge_values(v).into_iter().enumerate() {
            out.push((format!("{key}={i}"), vec![Edit::Set(key.clone(), e)]));
        }
        out.push((format!("-{key}"), vec![Edit::Remove(key.clone())]));
    }
    // The layer count with every per-layer key a scalar, and Qwen3-Next's
    // layer kinds from the interval (the loop once bounded by neither).
    let per_layer = [".attention.head_count_kv", ".feed_forward_length"];
    for n in [4097, u32::MAX] {
        let mut edits: Vec<Edit> = (per_layer.iter())
            .map(|k| set(k, GgufValue::U32(2)))
            .collect();
        edits.push(set(".block_count", GgufValue::U32(n)));
        edits.push(remove(".attention.recurrent_layers"));
        out.push((format!("scalar layers {n}"), edits));
    }
    let embd = "token_embd.weight";
    let blk0: Vec<String> = (file.tensor_infos().iter())
        .filter(|t| t.name.starts_with("blk.0.") || t.name == embd)
        .map(|t| t.name.clone())
        .collect();
    for name in blk0 {
        out.push((format!("{name} []"), vec![reshape(&name, &[])]));
        out.push((format!("{name} [0, 64]"), vec![reshape(&name, &[0, 64])]));
    }
    out
}

/// A small deterministic generator (xorshift64*): the same damages every
/// run, so a failure reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// `image` with 1 to 4 random changes in its first `header` bytes: a byte,
/// or a u32 / u64 set to an edge value (counts and lengths are u64).
fn damaged(image: &[u8], header: usize, rng: &mut Rng) -> Vec<u8> {
    let mut out = image.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(header);
        let edge = [0u64, 1, 4097, 1 << 26, u32::MAX as u64, u64::MAX][rng.below(6)];
        let bytes: Vec<u8> = match rng.below(3) {
            0 => vec![rng.next() as u8],
            1 => (edge as u32).to_le_bytes().to_vec(),
            _ => edge.to_le_bytes().to_vec(),
        };
        for (i, b) in bytes.into_iter().enumerate() {
            if let Some(x) = out.get_mut(at + i) {
                *x = b;
            }
        }
    }
    out
}

/// Runs `prepare` on `image`; an error must name the file.
fn check(stem: &str, what: &str, image: Vec<u8>) {
    let name = format!("{stem}.gguf");
    eprintln!("{what}");
    if let Err(e) = prepare(&name, image) {
        assert!(
            e.contains(&name),
            "{what}: the error does not name the file: {e}"
        );
    }
}

fn fuzz(stem: &str) {
    let file = fixture(stem);
    for (what, edits) in mutations(&file) {
        check(stem, &what, rewrite(&file, &edits));
    }
    let image = std::fs::read(fixture_path(stem)).expect("the fixture reads");
    let seed = (stem.bytes()).fold(0x9e37_79b9_7f4a_7c15u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    let mut rng = Rng(seed);
    for i in 0..RANDOM {
        check(
            stem,
            &format!("random {i}"),
            damaged(&image, file.data_start(), &mut rng),
        );
    }
}

macro_rules! fuzz_tests {
    ($($stem:ident),*) => {$(
        #[test]
        fn $stem() {
            run_limited(stringify!($stem), DEADLINE, || fuzz(stringify!($stem)));
        }
    )*};
}

fuzz_tests!(
    llama,
    qwen3,
    mamba2,
    bamba,
    granitemoehybrid,
    nemotron_h,
    nemotron_h_moe,
    qwen3_next
);
