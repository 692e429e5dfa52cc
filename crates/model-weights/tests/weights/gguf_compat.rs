//! A GGUF file written by llama.cpp's gguf-py (`tests/data/gguf/
//! make_tiny_gpt2.py`), not by metrale: the reader sees what gguf-py wrote,
//! metrale's writer reproduces it byte for byte, and the tokenizer rebuilt
//! from its metadata encodes as the `tokenizer.json` it was made from.

use std::path::PathBuf;

use metrale_core::quant::GgmlType;
use metrale_model_weights::gguf::{
    GgufArray, GgufFile, GgufValue, GgufWriter, chat_template, special_tokens, tokenizer_json,
};

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/gguf")
        .join(name)
}

fn open() -> GgufFile {
    GgufFile::open(&data("tiny_gpt2.gguf")).unwrap()
}

#[test]
fn reads_metadata_of_every_type() {
    let f = open();
    assert_eq!(f.version(), 3);
    assert_eq!(f.architecture().unwrap(), "gpt2");
    assert_eq!(f.get_u32("gpt2.context_length").unwrap(), 128);
    let expect = [
        ("test.u8", GgufValue::U8(200)),
        ("test.i8", GgufValue::I8(-100)),
        ("test.u16", GgufValue::U16(60000)),
        ("test.i16", GgufValue::I16(-30000)),
        ("test.u32", GgufValue::U32(4_000_000_000)),
        ("test.i32", GgufValue::I32(-2_000_000_000)),
        ("test.f32", GgufValue::F32(0.5)),
        ("test.bool", GgufValue::Bool(true)),
        ("test.string", GgufValue::String("h\u{e9}llo".into())),
        ("test.u64", GgufValue::U64((1 << 63) + 5)),
        ("test.i64", GgufValue::I64(-(1 << 62))),
        ("test.f64", GgufValue::F64(-1.25)),
        (
            "test.array_i32",
            GgufValue::Array(GgufArray::I32(vec![1, -2, 3])),
        ),
        (
            "test.array_f32",
            GgufValue::Array(GgufArray::F32(vec![0.25, -1.5])),
        ),
        (
            "test.array_str",
            GgufValue::Array(GgufArray::String(vec![
                "a".into(),
                "".into(),
                "\u{fc}".into(),
            ])),
        ),
        (
            "test.array_nested",
            GgufValue::Array(GgufArray::Array(vec![
                GgufArray::I32(vec![1, 2]),
                GgufArray::I32(vec![3]),
            ])),
        ),
    ];
    for (key, value) in expect {
        assert_eq!(f.value(key).unwrap(), &value, "{key}");
    }
    assert_eq!(f.get_str_array("tokenizer.ggml.tokens").unwrap().len(), 403);
}

#[test]
fn reads_tensors_in_row_major_shape() {
    let f = open();
    let emb = f.tensor("token_embd.weight").unwrap();
    assert_eq!((emb.ggml_type(), emb.shape()), (GgmlType::F32, &[4, 8][..]));
    assert_eq!(emb.info.dims, vec![8, 4]);
    let values: Vec<f32> = emb
        .data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(values, (0..32).map(|i| i as f32).collect::<Vec<_>>());

    let norm = f.tensor("blk.0.attn_norm.weight").unwrap();
    assert_eq!((norm.ggml_type(), norm.shape()), (GgmlType::F16, &[3][..]));
    let halves: Vec<f32> = norm
        .data
        .chunks_exact(2)
        .map(|c| half::f16::from_le_bytes(c.try_into().unwrap()).to_f32())
        .collect();
    assert_eq!(halves, vec![1.0, -2.0, 0.5]);

    let q = f.tensor("blk.0.ffn_up.weight").unwrap();
    assert_eq!((q.ggml_type(), q.shape()), (GgmlType::Q8_0, &[2, 64][..]));
    assert_eq!(q.data.len(), 2 * 2 * 34);
    // Each q8_0 block: an f16 scale then 32 i8; the row ends at +1.0.
    let scale = half::f16::from_le_bytes([q.data[102], q.data[103]]).to_f32();
    assert!((scale * q.data[135] as i8 as f32 - 1.0).abs() < 1e-2);

    let pos = f.tensor("positions").unwrap();
    assert_eq!((pos.ggml_type(), pos.shape()), (GgmlType::I32, &[1, 2][..]));
    assert_eq!(pos.data, [7, 0, 0, 0, 0xf9, 0xff, 0xff, 0xff]);
}

#[test]
fn writer_reproduces_gguf_py_byte_for_byte() {
    let f = open();
    let mut w = GgufWriter::new();
    for (k, v) in f.metadata() {
        w.add(k.clone(), v.clone());
    }
    for t in f.tensors() {
        w.add_tensor(t.name(), t.ggml_type(), t.shape(), t.data);
    }
    let original = std::fs::read(data("tiny_gpt2.gguf")).unwrap();
    assert_eq!(w.to_bytes().unwrap(), original);
}

#[test]
fn tokenizer_from_metadata_encodes_as_the_original() {
    let f = open();
    let json = tokenizer_json(&f).unwrap();
    let rebuilt = tokenizers::Tokenizer::from_bytes(serde_json::to_vec(&json).unwrap()).unwrap();
    let original = tokenizers::Tokenizer::from_file(data("tiny_gpt2_tokenizer.json")).unwrap();
    assert_eq!(rebuilt.get_vocab_size(true), original.get_vocab_size(true));
    for text in [
        "The quick brown fox jumps over the lazy dog.",
        "Hello, world!  Hello again\n\ttokens 12345 don't",
        "<|im_start|>user hi<|im_end|><|endoftext|> <custom>x",
        "unseen w\u{f6}rds: \u{1f600} \u{4e2d}\u{6587}",
        "",
    ] {
        for special in [false, true] {
            let a = original.encode(text, special).unwrap();
            let b = rebuilt.encode(text, special).unwrap();
            assert_eq!(a.get_ids(), b.get_ids(), "{text:?}");
            let round = rebuilt.decode(b.get_ids(), false).unwrap();
            assert_eq!(round, original.decode(a.get_ids(), false).unwrap());
        }
    }
    let special = special_tokens(&f).unwrap();
    assert_eq!(special.bos, Some(0));
    assert_eq!(
        original.id_to_token(special.eos.unwrap()).unwrap(),
        "<|im_end|>"
    );
    assert!(!special.add_bos);
    assert!(
        chat_template(&f)
            .unwrap()
            .unwrap()
            .starts_with("{% for m in messages %}")
    );
}

/// A SentencePiece BPE vocabulary (`make_tiny_llama.py`): the rebuilt
/// tokenizer encodes as SentencePiece itself, byte fallback included, adds
/// BOS as `add_bos_token` says, and decodes back to the text.
#[test]
fn sentencepiece_tokenizer_encodes_as_sentencepiece() {
    let f = GgufFile::open(&data("tiny_llama.gguf")).unwrap();
    let json = tokenizer_json(&f).unwrap();
    let tok = tokenizers::Tokenizer::from_bytes(serde_json::to_vec(&json).unwrap()).unwrap();
    let expected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(data("tiny_llama_expected.json")).unwrap()).unwrap();
    let special = special_tokens(&f).unwrap();
    assert!(special.add_bos && !special.add_eos);
    let cases = expected.as_array().unwrap();
    assert!(cases.len() >= 5);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let bos = case["bos"].as_u64().unwrap() as u32;
        assert_eq!(special.bos, Some(bos));
        let plain = tok.encode(text, false).unwrap();
        assert_eq!(plain.get_ids(), &ids[..], "{text:?}");
        let with_bos = tok.encode(text, true).unwrap();
        assert_eq!(with_bos.get_ids()[0], bos, "{text:?}");
        assert_eq!(&with_bos.get_ids()[1..], &ids[..], "{text:?}");
        assert_eq!(tok.decode(&ids, true).unwrap(), text);
    }
}
