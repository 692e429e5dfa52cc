//! Tokenizer glue on the fixture byte-level BPE tokenizer: round trips,
//! special tokens from the config files, errors, and streaming
//! detokenization of multi-byte UTF-8.

use std::path::{Path, PathBuf};

use metrale_model_engine::tokenizer::{Detokenizer, Tokenizer};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn fixture_tokenizer() -> Tokenizer {
    Tokenizer::from_dir(fixtures().join("tokenizer")).expect("fixture tokenizer loads")
}

/// A fresh directory holding a copy of the fixture tokenizer.json.
fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("metrale-tok-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    std::fs::copy(
        fixtures().join("tokenizer/tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .expect("copy tokenizer.json");
    dir
}

const MIXED: &str = "Hello, 世界! Déjà vu 🦀🚀 naïve — 你好吗？ 👩‍👩‍👧";

#[test]
fn encode_decode_round_trip() {
    let tok = fixture_tokenizer();
    for text in [
        "Hello world",
        "  leading and trailing  ",
        "line\nbreaks\ttabs",
        MIXED,
        "",
    ] {
        let ids = tok.encode(text, false).expect("encode");
        assert!(ids.iter().all(|&id| (id as usize) < tok.vocab_size()));
        assert_eq!(tok.decode(&ids).expect("decode"), text, "ids {ids:?}");
    }
    // Real BPE merges: a common word is fewer tokens than bytes.
    let ids = tok.encode("Hello world", false).expect("encode");
    assert!(ids.len() < "Hello world".len(), "{ids:?}");
}

#[test]
fn special_tokens_in_text_are_single_ids() {
    let tok = fixture_tokenizer();
    let ids = tok
        .encode("<|im_start|>user\nhi<|im_end|>", true)
        .expect("encode");
    assert_eq!(ids.first(), Some(&1));
    assert_eq!(ids.last(), Some(&2));
    assert_eq!(
        tok.decode(&ids).expect("decode"),
        "<|im_start|>user\nhi<|im_end|>"
    );
    assert_eq!(tok.decode_with(&ids, true).expect("decode"), "user\nhi");
}

#[test]
fn token_text_decodes_one_id_keeping_specials() {
    let tok = fixture_tokenizer();
    assert_eq!(tok.token_text(2).expect("special"), "<|im_end|>");
    let ids = tok.encode("Hello world", false).expect("encode");
    let pieces: Vec<String> = ids
        .iter()
        .map(|&id| tok.token_text(id).expect("token text"))
        .collect();
    assert_eq!(pieces.concat(), "Hello world", "{pieces:?}");
    assert!(
        pieces.iter().all(|p| !p.contains('\u{120}')),
        "bytes, not the byte-level alphabet: {pieces:?}"
    );
    assert!(tok.token_text(512).is_err());
}

#[test]
fn fixture_special_tokens() {
    let tok = fixture_tokenizer();
    assert_eq!(tok.vocab_size(), 512);
    assert_eq!(tok.eos_ids(), &[2]);
    assert_eq!(tok.eos_token().as_deref(), Some("<|im_end|>"));
    assert_eq!(tok.bos_id(), None);
    assert_eq!(tok.token_to_id("<|endoftext|>"), Some(0));

    // A model folder: eos from generation_config.json, tokenizer_config.json
    // and config.json all agree on id 2.
    let tok = Tokenizer::from_dir(fixtures().join("qwen3")).expect("model dir loads");
    assert_eq!(tok.eos_ids(), &[2]);
    assert_eq!(tok.bos_id(), None);
}

#[test]
fn special_tokens_from_objects_lists_and_add_bos() {
    let dir = scratch_dir("objects");
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"bos_token": {"content": "<|im_start|>", "lstrip": false},
            "eos_token": {"__type": "AddedToken", "content": "<|im_end|>"},
            "add_bos_token": true}"#,
    )
    .expect("write");
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"eos_token_id": [0, 2], "bos_token_id": 7}"#,
    )
    .expect("write");
    std::fs::write(dir.join("config.json"), r#"{"eos_token_id": 5}"#).expect("write");
    let tok = Tokenizer::from_dir(&dir).expect("loads");
    // tokenizer_config's bos_token wins over generation_config's id.
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.bos_token(), Some("<|im_start|>"));
    // The union, generation_config first, without duplicates.
    assert_eq!(tok.eos_ids(), &[0, 2, 5]);

    let with = tok.encode("hi", true).expect("encode");
    let without = tok.encode("hi", false).expect("encode");
    assert_eq!(with[0], 1);
    assert_eq!(&with[1..], &without[..]);
    assert_ne!(without[0], 1);
    // Already starting with BOS: not doubled.
    let ids = tok.encode("<|im_start|>hi", true).expect("encode");
    assert_eq!(ids.iter().filter(|&&id| id == 1).count(), 1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bos_and_eos_ids_from_generation_config_ints() {
    let dir = scratch_dir("ints");
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"eos_token_id": 0, "bos_token_id": 1}"#,
    )
    .expect("write");
    let tok = Tokenizer::from_dir(&dir).expect("loads");
    assert_eq!(tok.eos_ids(), &[0]);
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.bos_token(), Some("<|im_start|>"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn errors_name_the_file() {
    let missing = std::env::temp_dir().join(format!("metrale-tok-{}-none", std::process::id()));
    let err = Tokenizer::from_dir(&missing)
        .expect_err("no tokenizer.json")
        .to_string();
    assert!(
        err.contains("tokenizer.json") && err.contains("missing"),
        "{err}"
    );

    let dir = scratch_dir("malformed");
    std::fs::write(dir.join("tokenizer.json"), "{\"model\": 3").expect("write");
    let err = Tokenizer::from_dir(&dir)
        .expect_err("bad tokenizer.json")
        .to_string();
    assert!(err.contains("tokenizer.json"), "{err}");

    let dir = scratch_dir("badgen");
    std::fs::write(dir.join("generation_config.json"), "{oops").expect("write");
    let err = Tokenizer::from_dir(&dir)
        .expect_err("bad generation_config")
        .to_string();
    assert!(
        err.contains("generation_config.json") && err.contains("malformed"),
        "{err}"
    );

    let dir = scratch_dir("badtokcfg");
    std::fs::write(dir.join("tokenizer_config.json"), "[1,").expect("write");
    let err = Tokenizer::from_dir(&dir)
        .expect_err("bad tokenizer_config")
        .to_string();
    assert!(err.contains("tokenizer_config.json"), "{err}");
    for name in ["malformed", "badgen", "badtokcfg"] {
        let _ = std::fs::remove_dir_all(
            std::env::temp_dir().join(format!("metrale-tok-{}-{name}", std::process::id())),
        );
    }
}

fn stream(detok: &mut Detokenizer, ids: &[u32]) -> Vec<String> {
    let mut deltas = Vec::new();
    for &id in ids {
        if let Some(delta) = detok.step(id).expect("step") {
            deltas.push(delta);
        }
    }
    deltas.extend(detok.finish().expect("finish"));
    deltas
}

#[test]
fn detokenizer_holds_back_split_characters() {
    let tok = fixture_tokenizer();
    let ids = tok.encode(MIXED, false).expect("encode");
    // The test means something only if some character is split across
    // tokens: some single token must decode to an incomplete sequence.
    let split = ids
        .iter()
        .filter(|&&id| tok.decode(&[id]).expect("decode").contains('\u{FFFD}'))
        .count();
    assert!(split > 4, "fixture no longer splits multi-byte characters");

    let mut detok = tok.detokenizer(false);
    let deltas = stream(&mut detok, &ids);
    for delta in &deltas {
        assert!(
            !delta.contains('\u{FFFD}'),
            "incomplete UTF-8 let out: {delta:?} in {deltas:?}"
        );
    }
    assert!(deltas.len() < ids.len(), "nothing was held back");
    assert_eq!(deltas.concat(), MIXED);
    assert_eq!(deltas.concat(), tok.decode(&ids).expect("decode"));
}

#[test]
fn detokenizer_matches_decode_for_every_prefix() {
    let tok = fixture_tokenizer();
    let text = "日本語のテキスト and emoji 🎉🎊 mixed ✓";
    let ids = tok.encode(text, false).expect("encode");
    for end in 0..=ids.len() {
        let mut detok = tok.detokenizer(false);
        let deltas = stream(&mut detok, &ids[..end]);
        assert_eq!(
            deltas.concat(),
            tok.decode(&ids[..end]).expect("decode"),
            "prefix {end}"
        );
    }
}

#[test]
fn detokenizer_finish_flushes_an_incomplete_tail() {
    let tok = fixture_tokenizer();
    let ids = tok.encode("a🦀", false).expect("encode");
    let cut = &ids[..ids.len() - 1];
    let mut detok = tok.detokenizer(false);
    let mut text = String::new();
    for &id in cut {
        text.extend(detok.step(id).expect("step"));
    }
    assert_eq!(text, "a");
    let tail = detok
        .finish()
        .expect("finish")
        .expect("held bytes come out at the end");
    assert!(tail.contains('\u{FFFD}'));
    assert_eq!(text + &tail, tok.decode(cut).expect("decode"));
}

#[test]
fn detokenizer_skips_special_tokens_and_prompt() {
    let tok = fixture_tokenizer();
    let prompt = tok
        .encode("<|im_start|>user\nSay 世界<|im_end|>\n", false)
        .expect("encode");
    let output = tok.encode("世界 done<|im_end|>", false).expect("encode");
    let mut detok = Detokenizer::with_prompt(tok.clone(), &prompt, true);
    assert_eq!(stream(&mut detok, &output).concat(), "世界 done");
    let mut detok = Detokenizer::with_prompt(tok, &prompt, false);
    assert_eq!(stream(&mut detok, &output).concat(), "世界 done<|im_end|>");
}
