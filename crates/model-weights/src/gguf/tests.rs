//! Round trips through the writer and reader, and each check of the reader
//! against a file damaged in one place.

use metrale_core::quant::GgmlType;

use super::*;

fn every_value() -> Vec<(&'static str, GgufValue)> {
    vec![
        ("general.architecture", GgufValue::String("llama".into())),
        ("t.u8", GgufValue::U8(200)),
        ("t.i8", GgufValue::I8(-3)),
        ("t.u16", GgufValue::U16(60000)),
        ("t.i16", GgufValue::I16(-30000)),
        ("t.u32", GgufValue::U32(4_000_000_000)),
        ("t.i32", GgufValue::I32(-7)),
        ("t.f32", GgufValue::F32(0.5)),
        ("t.bool", GgufValue::Bool(true)),
        ("t.string", GgufValue::String("h\u{e9}llo".into())),
        ("t.u64", GgufValue::U64(u64::MAX)),
        ("t.i64", GgufValue::I64(i64::MIN)),
        ("t.f64", GgufValue::F64(-1.25)),
        ("t.a.u8", GgufValue::Array(GgufArray::U8(vec![1, 2]))),
        ("t.a.i8", GgufValue::Array(GgufArray::I8(vec![-1]))),
        ("t.a.u16", GgufValue::Array(GgufArray::U16(vec![9]))),
        ("t.a.i16", GgufValue::Array(GgufArray::I16(vec![-9]))),
        ("t.a.u32", GgufValue::Array(GgufArray::U32(vec![5, 6]))),
        ("t.a.i32", GgufValue::Array(GgufArray::I32(vec![1, -2, 3]))),
        (
            "t.a.f32",
            GgufValue::Array(GgufArray::F32(vec![0.25, -1.5])),
        ),
        (
            "t.a.bool",
            GgufValue::Array(GgufArray::Bool(vec![true, false])),
        ),
        (
            "t.a.str",
            GgufValue::Array(GgufArray::String(vec!["a".into(), "".into()])),
        ),
        ("t.a.u64", GgufValue::Array(GgufArray::U64(vec![1 << 40]))),
        (
            "t.a.i64",
            GgufValue::Array(GgufArray::I64(vec![-(1 << 40)])),
        ),
        ("t.a.f64", GgufValue::Array(GgufArray::F64(vec![1e300]))),
        ("t.a.empty", GgufValue::Array(GgufArray::String(vec![]))),
        (
            "t.a.nested",
            GgufValue::Array(GgufArray::Array(vec![
                GgufArray::I32(vec![1, 2]),
                GgufArray::String(vec!["x".into()]),
                GgufArray::Array(vec![GgufArray::F32(vec![3.0])]),
            ])),
        ),
    ]
}

fn bytes(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A writer with every value type and tensors of several types.
fn sample() -> GgufWriter {
    let mut w = GgufWriter::new();
    for (k, v) in every_value() {
        w.add(k, v);
    }
    w.add_tensor("emb", GgmlType::F32, &[3, 4], bytes(48, 1))
        .add_tensor("norm", GgmlType::F16, &[5], bytes(10, 2))
        .add_tensor("q4k", GgmlType::Q4K, &[2, 512], bytes(2 * 288, 3))
        .add_tensor("q80", GgmlType::Q8_0, &[1, 2, 3, 32], bytes(6 * 34, 4))
        .add_tensor("empty", GgmlType::F32, &[0, 7], vec![])
        .add_tensor("scalar", GgmlType::I32, &[], bytes(4, 5));
    w
}

fn parse(image: Vec<u8>) -> Result<GgufFile, WeightsError> {
    GgufFile::from_bytes("test.gguf", image)
}

#[test]
fn round_trip_keeps_every_value_and_tensor() {
    let w = sample();
    let file = parse(w.to_bytes().unwrap()).unwrap();
    assert_eq!(file.version(), 3);
    assert_eq!(file.alignment(), 32);
    assert_eq!(file.data_start() % 32, 0);
    let found: Vec<(&str, &GgufValue)> = file
        .metadata()
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let expected = every_value();
    assert_eq!(
        found,
        expected.iter().map(|(k, v)| (*k, v)).collect::<Vec<_>>()
    );
    let shapes: Vec<(&str, GgmlType, Vec<usize>, usize)> = file
        .tensors()
        .map(|t| (t.name(), t.ggml_type(), t.shape().to_vec(), t.data.len()))
        .collect();
    assert_eq!(
        shapes,
        vec![
            ("emb", GgmlType::F32, vec![3, 4], 48),
            ("norm", GgmlType::F16, vec![5], 10),
            ("q4k", GgmlType::Q4K, vec![2, 512], 576),
            ("q80", GgmlType::Q8_0, vec![1, 2, 3, 32], 204),
            ("empty", GgmlType::F32, vec![0, 7], 0),
            ("scalar", GgmlType::I32, vec![], 4),
        ]
    );
    assert_eq!(file.tensor("q80").unwrap().info.dims, vec![32, 3, 2, 1]);
    assert_eq!(file.tensor("q4k").unwrap().data, &bytes(576, 3)[..]);
    assert_eq!(file.tensor("scalar").unwrap().info.elems(), 1);
    for t in file.tensor_infos() {
        assert_eq!(t.offset % 32, 0, "{}", t.name);
    }
    // Encoding what was read gives the same bytes.
    let mut again = GgufWriter::new();
    for (k, v) in file.metadata() {
        again.add(k.clone(), v.clone());
    }
    for t in file.tensors() {
        again.add_tensor(t.name(), t.ggml_type(), t.shape(), t.data);
    }
    assert_eq!(again.to_bytes().unwrap(), w.to_bytes().unwrap());
}

#[test]
fn version_2_reads_as_version_3() {
    // v3 only added big-endian files; a little-endian v2 file is the same.
    let mut image = sample().to_bytes().unwrap();
    image[4..8].copy_from_slice(&2u32.to_le_bytes());
    let file = parse(image).unwrap();
    assert_eq!(file.version(), 2);
    assert_eq!(file.tensor_infos().len(), 6);
}

#[test]
fn custom_alignment_is_recorded_and_used() {
    let mut w = GgufWriter::new();
    w.set_alignment(64)
        .add_tensor("a", GgmlType::F32, &[3], bytes(12, 0))
        .add_tensor("b", GgmlType::F32, &[3], bytes(12, 1));
    let file = parse(w.to_bytes().unwrap()).unwrap();
    assert_eq!(file.alignment(), 64);
    assert_eq!(file.get_u32(ALIGNMENT_KEY).unwrap(), 64);
    assert_eq!(file.data_start() % 64, 0);
    assert_eq!(file.tensor("b").unwrap().info.offset, 64);
    assert!(GgufWriter::new().set_alignment(48).to_bytes().is_err());
}

#[test]
fn typed_accessors_name_the_key_and_the_type_found() {
    let file = parse(sample().to_bytes().unwrap()).unwrap();
    assert_eq!(file.architecture().unwrap(), "llama");
    assert_eq!(file.get_u32("t.u16").unwrap(), 60000);
    assert_eq!(
        file.get_u32("t.i32").err().unwrap().to_string(),
        "test.gguf: GGUF metadata key \"t.i32\" is i32, expected an integer in u32 range"
    );
    assert_eq!(file.get_u64("t.u64").unwrap(), u64::MAX);
    assert_eq!(file.get_f32("t.f64").unwrap(), -1.25);
    assert!(file.get_bool("t.bool").unwrap());
    assert_eq!(file.get_str("t.string").unwrap(), "h\u{e9}llo");
    assert_eq!(file.get_i32_array("t.a.i32").unwrap(), &[1, -2, 3]);
    assert_eq!(file.get_f32_array("t.a.f32").unwrap(), &[0.25, -1.5]);
    assert_eq!(file.get_str_array("t.a.str").unwrap().len(), 2);
    assert_eq!(file.get_str_array("t.a.empty").unwrap().len(), 0);
    let e = file.get_str_array("t.a.nested").unwrap_err().to_string();
    assert!(
        e.contains("\"t.a.nested\" is array of array of i32, expected array of string"),
        "{e}"
    );
    let e = file.get_f32("t.string").unwrap_err().to_string();
    assert!(e.contains("\"t.string\" is string, expected f32"), "{e}");
    let e = file
        .get_u32("llama.context_length")
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "test.gguf: GGUF metadata key \"llama.context_length\" is missing"
    );
    assert_eq!(file.opt_u32("nope").unwrap(), None);
    assert!(file.opt_bool("t.u8").is_err());
    let e = file.tensor("nope").unwrap_err().to_string();
    assert!(e.contains("\"nope\" is missing"), "{e}");
}

#[test]
fn writer_refuses_what_llama_cpp_would() {
    let cases: Vec<(GgufWriter, &str)> = vec![
        (
            {
                let mut w = GgufWriter::new();
                w.add_tensor("a", GgmlType::F32, &[3], bytes(8, 0));
                w
            },
            "needs 12 bytes, 8 were given",
        ),
        (
            {
                let mut w = GgufWriter::new();
                w.add_tensor("a", GgmlType::Q4K, &[100], vec![]);
                w
            },
            "row length 100 is not a whole number of q4_K blocks of 256 elements",
        ),
        (
            {
                let mut w = GgufWriter::new();
                w.add_tensor("x".repeat(64), GgmlType::F32, &[1], bytes(4, 0));
                w
            },
            "llama.cpp allows at most 63",
        ),
        (
            {
                let mut w = GgufWriter::new();
                w.add_tensor("a", GgmlType::F32, &[1; 5], bytes(4, 0));
                w
            },
            "5 dimensions",
        ),
        (
            {
                let mut w = GgufWriter::new();
                w.add_tensor("a", GgmlType::F32, &[1], bytes(4, 0));
                w.add_tensor("a", GgmlType::F32, &[1], bytes(4, 0));
                w
            },
            "two tensors have this name",
        ),
        (
            {
                let mut w = GgufWriter::new();
                w.add(ALIGNMENT_KEY, GgufValue::U64(32));
                w
            },
            "set it with set_alignment",
        ),
    ];
    for (w, expected) in cases {
        let e = w.to_bytes().unwrap_err().to_string();
        assert!(e.starts_with("<memory>: cannot write GGUF"), "{e}");
        assert!(e.contains(expected), "{e} should say {expected:?}");
    }
}

/// Offsets of the fields of tensor `name`'s info entry in `image`:
/// (n_dims, first dim, type, offset).
fn tensor_fields(image: &[u8], name: &str) -> (usize, usize, usize, usize) {
    let mut needle = (name.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(name.as_bytes());
    let at = image
        .windows(needle.len())
        .rposition(|w| w == needle)
        .unwrap()
        + needle.len();
    let n_dims = u32::from_le_bytes(image[at..at + 4].try_into().unwrap()) as usize;
    let ty = at + 4 + 8 * n_dims;
    (at, at + 4, ty, ty + 4)
}

fn put_u32(image: &mut [u8], at: usize, v: u32) {
    image[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(image: &mut [u8], at: usize, v: u64) {
    image[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// One change to a file image.
type Damage = Box<dyn FnOnce(&mut Vec<u8>)>;

/// `sample()`'s image damaged by `damage`; the error it gives.
fn damaged(damage: impl FnOnce(&mut Vec<u8>)) -> String {
    let mut image = sample().to_bytes().unwrap();
    damage(&mut image);
    let e = parse(image)
        .expect_err("the damage must be found")
        .to_string();
    assert!(e.starts_with("test.gguf: "), "{e}");
    e
}

#[test]
fn each_check_names_the_file_and_what_is_wrong() {
    let cases: Vec<(Damage, &str)> = vec![
        (Box::new(|i| i[0] = b'X'), "not a GGUF file"),
        (
            Box::new(|i| put_u32(i, 4, 1)),
            "GGUF version 1 is not supported",
        ),
        (Box::new(|i| put_u32(i, 4, 3u32.swap_bytes())), "big-endian"),
        (Box::new(|i| put_u32(i, 4, 4)), "unsupported GGUF version 4"),
        (
            Box::new(|i| put_u64(i, 8, u64::MAX)),
            "tensor count 18446744073709551615 cannot fit",
        ),
        (
            Box::new(|i| put_u64(i, 16, 1 << 40)),
            "metadata entry count 1099511627776 cannot fit",
        ),
        (
            Box::new(|i| {
                let (_, _, ty, _) = tensor_fields(i, "q80");
                i.truncate(ty + 2);
            }),
            "file is truncated: tensor \"q80\" needs 4 bytes at offset",
        ),
        (
            Box::new(|i| {
                let at = i.windows(6).position(|w| w == b"t.a.u8").unwrap();
                i[at..at + 6].copy_from_slice(b"t.a.i8");
            }),
            "metadata key \"t.a.i8\": the key appears twice (metadata entries #13 and #14)",
        ),
        (
            Box::new(|i| {
                let at = i.windows(6).position(|w| w == b"t.bool").unwrap();
                i[at + 6 + 4] = 2;
            }),
            "metadata key \"t.bool\": bool byte is 2",
        ),
        (
            Box::new(|i| {
                let at = i.windows(8).position(|w| w == b"t.string").unwrap();
                put_u32(i, at + 8, 13);
            }),
            "metadata key \"t.string\": unknown GGUF value type id 13",
        ),
        (
            Box::new(|i| {
                let at = i.windows(6).position(|w| w == b"h\xc3\xa9llo").unwrap();
                i[at + 1] = 0xff;
            }),
            "metadata key \"t.string\": string is not valid UTF-8",
        ),
        (
            Box::new(|i| {
                let at = i.windows(7).position(|w| w == b"t.a.u32").unwrap();
                put_u64(i, at + 7 + 8, u64::MAX / 2);
            }),
            "metadata key \"t.a.u32\": array of u32: element count",
        ),
        (
            Box::new(|i| {
                let (_, _, ty, _) = tensor_fields(i, "norm");
                put_u32(i, ty, 4);
            }),
            "tensor \"norm\": unknown ggml type id 4",
        ),
        (
            Box::new(|i| {
                let (_, dim, _, _) = tensor_fields(i, "q4k");
                put_u64(i, dim, 300);
            }),
            "tensor \"q4k\": row length 300 is not a whole number of q4_K blocks",
        ),
        (
            Box::new(|i| {
                let (_, dim, _, _) = tensor_fields(i, "q80");
                put_u64(i, dim + 8, u64::MAX / 4);
            }),
            "tensor \"q80\": dimensions",
        ),
        (
            Box::new(|i| {
                let (nd, _, _, _) = tensor_fields(i, "emb");
                put_u32(i, nd, 5);
            }),
            "tensor \"emb\": 5 dimensions",
        ),
        (
            Box::new(|i| {
                let (_, _, _, off) = tensor_fields(i, "norm");
                put_u64(i, off, 8);
            }),
            "tensor \"norm\": data offset 8 is not a multiple of the alignment 32",
        ),
        (
            Box::new(|i| {
                let (_, _, _, off) = tensor_fields(i, "norm");
                put_u64(i, off, 1 << 20);
            }),
            "tensor \"norm\": its 10 bytes at data offset 1048576",
        ),
        (
            Box::new(|i| {
                let (_, _, _, off) = tensor_fields(i, "norm");
                put_u64(i, off, 32);
            }),
            "tensors \"emb\" and \"norm\" overlap",
        ),
        (
            Box::new(|i| {
                let len = i.len();
                i.truncate(len - 32)
            }),
            "tensor \"scalar\": its 4 bytes",
        ),
    ];
    for (damage, expected) in cases {
        let e = damaged(damage);
        assert!(e.contains(expected), "{e} should say {expected:?}");
    }
}

#[test]
fn duplicate_tensor_names_and_deep_nesting_are_refused() {
    let mut w = GgufWriter::new();
    w.add_tensor("aa", GgmlType::F32, &[1], bytes(4, 0))
        .add_tensor("bb", GgmlType::F32, &[1], bytes(4, 0));
    let mut image = w.to_bytes().unwrap();
    let at = image.windows(2).position(|x| x == b"bb").unwrap();
    image[at..at + 2].copy_from_slice(b"aa");
    let e = parse(image).unwrap_err().to_string();
    assert!(
        e.contains("tensor \"aa\": the name appears twice (tensors #0 and #1)"),
        "{e}"
    );

    // Nine levels of arrays: each [array, 1 element] header, innermost u8.
    let mut image = GgufWriter::new().to_bytes().unwrap();
    image.truncate(24);
    put_u64(&mut image, 16, 1);
    image.extend_from_slice(&1u64.to_le_bytes());
    image.push(b'k');
    image.extend_from_slice(&9u32.to_le_bytes());
    for _ in 0..9 {
        image.extend_from_slice(&9u32.to_le_bytes());
        image.extend_from_slice(&1u64.to_le_bytes());
    }
    image.extend_from_slice(&[0; 13]);
    let e = parse(image).unwrap_err().to_string();
    assert!(
        e.contains("key \"k\": arrays nest deeper than 8 levels"),
        "{e}"
    );

    // A bad general.alignment.
    let mut w = GgufWriter::new();
    w.set_alignment(32);
    let mut image = w.to_bytes().unwrap();
    let at = image
        .windows(17)
        .position(|w| w == b"general.alignment")
        .unwrap();
    put_u32(&mut image, at + 17 + 4, 24);
    let e = parse(image).unwrap_err().to_string();
    assert!(
        e.contains("\"general.alignment\": must be a u32 power of two"),
        "{e}"
    );
}

#[test]
fn open_reads_small_files_and_maps_large_ones() {
    let dir = std::env::temp_dir().join(format!("metrale-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, n) in [("small.gguf", 16usize), ("large.gguf", 40_000)] {
        let path = dir.join(name);
        let mut w = GgufWriter::new();
        w.add_tensor("w", GgmlType::F32, &[n], bytes(4 * n, 9));
        w.write(&path).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), w.to_bytes().unwrap());
        let file = GgufFile::open(&path).unwrap();
        assert_eq!(file.tensor("w").unwrap().data, &bytes(4 * n, 9)[..]);
        assert_eq!(file.path(), path);
        // Released pages (what the loader does after each upload) read
        // back the same bytes, through a view taken before and one after.
        let before = file.tensor("w").unwrap();
        file.release(&before);
        assert_eq!(before.data, &bytes(4 * n, 9)[..]);
        assert_eq!(file.tensor("w").unwrap().data, &bytes(4 * n, 9)[..]);
    }
    let e = GgufFile::open(&dir.join("absent.gguf"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("absent.gguf"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_streamed_file_is_the_file_written_at_once() {
    let whole = sample().to_bytes().unwrap();
    let parsed = parse(whole.clone()).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in every_value() {
        w.add(k, v);
    }
    for t in parsed.tensors() {
        w.add_tensor_info(t.name(), t.ggml_type(), t.shape());
    }
    let path = std::env::temp_dir().join(format!("metrale-stream-{}.gguf", std::process::id()));
    let mut s = w.stream(&path).unwrap();
    let mut tensors = parsed.tensors();
    let first = tensors.next().unwrap();
    // Out of order, or of the wrong length: refused, naming the tensor.
    let e = s.write_tensor("norm", &[0; 10]).unwrap_err().to_string();
    assert!(e.contains("\"norm\": the next tensor is \"emb\""), "{e}");
    let e = s.write_tensor("emb", &[0; 47]).unwrap_err().to_string();
    assert!(e.contains("needs 48 bytes, 47 were given"), "{e}");
    s.write_tensor(first.name(), first.data).unwrap();
    for t in tensors {
        s.write_tensor(t.name(), t.data).unwrap();
    }
    s.finish().unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), whole);

    // Finishing early is an error naming the first tensor not written.
    std::fs::remove_file(&path).unwrap();
    let mut s = w.stream(&path).unwrap();
    s.write_tensor(first.name(), first.data).unwrap();
    let e = s.finish().unwrap_err().to_string();
    assert!(e.contains("\"norm\": the file was finished before"), "{e}");
    // A writer holding bytes cannot stream.
    assert!(sample().stream(&path).is_err());
    let _ = std::fs::remove_file(&path);
}

/// A stream's file is a temporary one under a guessable name
/// (`.OUT.tmp-<pid>`): whatever is already at that path (a link planted
/// there to another file, dangling or not, or any file) is neither
/// followed nor truncated, and the error says so.
#[cfg(unix)]
#[test]
fn a_stream_creates_its_file_and_never_opens_an_existing_one() {
    let dir = std::env::temp_dir().join(format!("metrale-stream-link-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let victim = dir.join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let tmp = dir.join(".out.gguf.tmp-1");
    let mut w = GgufWriter::new();
    w.add_tensor_info("w", GgmlType::F32, &[2]);

    let absent = dir.join("absent");
    for target in [&victim, &absent] {
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(target, &tmp).unwrap();
        let e = w.stream(&tmp).err().expect("an existing path is refused");
        let e = e.to_string();
        assert!(
            e.starts_with(&format!("{}: ", tmp.display())) && e.contains("already exists"),
            "{e}"
        );
    }
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert!(
        !absent.exists(),
        "nothing is created through a dangling link"
    );

    // A plain file is kept too; once it is gone the stream is written.
    std::fs::remove_file(&tmp).unwrap();
    std::fs::write(&tmp, b"left over").unwrap();
    assert!(w.stream(&tmp).is_err());
    assert_eq!(std::fs::read(&tmp).unwrap(), b"left over");
    std::fs::remove_file(&tmp).unwrap();
    let mut s = w.stream(&tmp).unwrap();
    s.write_tensor("w", &[0; 8]).unwrap();
    s.finish().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}
