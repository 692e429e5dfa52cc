//! The tokenizer a GGUF file's metadata describes, as the `tokenizer.json`
//! Hugging Face's `tokenizers` would load.
//!
//! GGUF has no tokenizer file: llama.cpp converts the vocabulary into
//! `tokenizer.ggml.*` keys and reimplements the tokenizers itself, choosing
//! the pre-tokenizer regex by name (`tokenizer.ggml.pre`). This module goes
//! the other way and rebuilds a `tokenizer.json` value, so that metrale keeps
//! one tokenizer implementation. This crate does not depend on `tokenizers`;
//! the engine loads the value (`Tokenizer::from_bytes`).
//!
//! Two models are rebuilt:
//! - `gpt2`: byte-level BPE (GPT-2, Llama 3, Qwen 2): `tokens`, `merges`,
//!   `token_type`, and the pre-tokenizer named by `tokenizer.ggml.pre`.
//! - `llama`: SentencePiece BPE (Llama 1/2, Mistral): `tokens`, `scores`,
//!   `token_type`. SentencePiece merges the adjacent pair whose merged piece
//!   has the highest score; that is BPE with merges ranked by the merged
//!   piece's score, which is how Hugging Face converts these vocabularies
//!   too. A vocabulary whose merges would outweigh it
//!   `MERGE_BYTES_PER_VOCAB_BYTE` (32) times over is refused (`spm`).
//!
//! A file that carries `tokenizer.huggingface.json` gets that JSON as is.

use serde_json::{Map, Value, json};

use super::GgufFile;
use crate::error::WeightsError;

mod spm;

pub const MODEL_KEY: &str = "tokenizer.ggml.model";
pub const PRE_KEY: &str = "tokenizer.ggml.pre";
pub const TOKENS_KEY: &str = "tokenizer.ggml.tokens";
pub const TOKEN_TYPE_KEY: &str = "tokenizer.ggml.token_type";
pub const SCORES_KEY: &str = "tokenizer.ggml.scores";
pub const MERGES_KEY: &str = "tokenizer.ggml.merges";
pub const HF_JSON_KEY: &str = "tokenizer.huggingface.json";
pub const CHAT_TEMPLATE_KEY: &str = "tokenizer.chat_template";

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
const TYPE_UNKNOWN: i32 = 2;
const TYPE_CONTROL: i32 = 3;
const TYPE_USER_DEFINED: i32 = 4;

/// GPT-2's pre-tokenizer regex is ByteLevel's built-in one; these are the
/// others llama.cpp names, as the models' own `tokenizer.json` spell them.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen3.5's (its tokenizer.json's): Qwen 2's with combining marks
/// (`\p{M}`) kept with the letters they follow.
const QWEN35_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizers llama.cpp reads as Llama 3's (its
/// `LLAMA_VOCAB_PRE_TYPE_LLAMA3`): Llama 3's split, and a piece that is
/// one token of the vocabulary taken whole before any merge (as their
/// tokenizer.json files say with `ignore_merges`).
fn llama3_like(pre: &str) -> bool {
    matches!(
        pre,
        "llama-bpe" | "llama3" | "llama-v3" | "falcon3" | "falcon-h1" | "pixtral" | "lfm2"
    )
}

/// The special tokens and the flags that say where they are added.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GgufSpecialTokens {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// End of turn (chat models that stop on it rather than on EOS).
    pub eot: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`; absent, llama.cpp's default for the
    /// model (true for SentencePiece, false for byte-level BPE).
    pub add_bos: bool,
    pub add_eos: bool,
}

/// Reads the special token ids, checking each against the vocabulary size.
pub fn special_tokens(file: &GgufFile) -> Result<GgufSpecialTokens, WeightsError> {
    let n_tokens = file.get_str_array(TOKENS_KEY)?.len();
    let id = |name: &str| -> Result<Option<u32>, WeightsError> {
        let key = format!("tokenizer.ggml.{name}");
        match file.opt_u32(&key)? {
            Some(id) if id as usize >= n_tokens => Err(WeightsError::GgufMetadata {
                path: file.path().to_path_buf(),
                key,
                detail: format!("token id {id} is outside the vocabulary of {n_tokens} tokens"),
            }),
            other => Ok(other),
        }
    };
    let spm = file.opt_str(MODEL_KEY)? == Some("llama");
    Ok(GgufSpecialTokens {
        bos: id("bos_token_id")?,
        eos: id("eos_token_id")?,
        eot: id("eot_token_id")?,
        unk: id("unknown_token_id")?,
        pad: id("padding_token_id")?,
        add_bos: file
            .opt_bool("tokenizer.ggml.add_bos_token")?
            .unwrap_or(spm),
        add_eos: file
            .opt_bool("tokenizer.ggml.add_eos_token")?
            .unwrap_or(false),
    })
}

/// `tokenizer.chat_template`, if the file has one.
pub fn chat_template(file: &GgufFile) -> Result<Option<&str>, WeightsError> {
    file.opt_str(CHAT_TEMPLATE_KEY)
}

fn bad(file: &GgufFile, key: &str, detail: String) -> WeightsError {
    WeightsError::GgufMetadata {
        path: file.path().to_path_buf(),
        key: key.to_string(),
        detail,
    }
}

/// The `tokenizer.json` value the file's tokenizer metadata describes.
pub fn tokenizer_json(file: &GgufFile) -> Result<Value, WeightsError> {
    if let Some(text) = file.opt_str(HF_JSON_KEY)? {
        return serde_json::from_str(text)
            .map_err(|e| bad(file, HF_JSON_KEY, format!("is not valid JSON: {e}")));
    }
    let tokens = file.get_str_array(TOKENS_KEY)?;
    let types = match file.get(TOKEN_TYPE_KEY) {
        Some(_) => file.get_i32_array(TOKEN_TYPE_KEY)?,
        None => &[],
    };
    if !types.is_empty() && types.len() != tokens.len() {
        return Err(bad(
            file,
            TOKEN_TYPE_KEY,
            format!("{} entries for {} tokens", types.len(), tokens.len()),
        ));
    }
    let special = special_tokens(file)?;
    let model = file.get_str(MODEL_KEY)?;
    let mut json = match model {
        "gpt2" => byte_level_bpe(file, tokens)?,
        "llama" => sentencepiece_bpe(file, tokens, &special)?,
        other => {
            return Err(bad(
                file,
                MODEL_KEY,
                format!("tokenizer model {other:?} is not supported (\"gpt2\" and \"llama\" are)"),
            ));
        }
    };
    json["added_tokens"] = added_tokens(tokens, types);
    json["post_processor"] = post_processor(tokens, &special, json["post_processor"].take());
    Ok(json)
}

/// Control and user-defined tokens: matched in the raw text before the
/// model runs, as the converter's `added_tokens` were.
fn added_tokens(tokens: &[String], types: &[i32]) -> Value {
    let added = types.iter().enumerate().filter_map(|(id, &ty)| {
        let special = match ty {
            TYPE_CONTROL | TYPE_UNKNOWN => true,
            TYPE_USER_DEFINED => false,
            _ => return None,
        };
        Some(json!({
            "id": id,
            "content": tokens[id],
            "single_word": false,
            "lstrip": false,
            "rstrip": false,
            "normalized": false,
            "special": special,
        }))
    });
    Value::Array(added.collect())
}

/// BOS/EOS insertion as `add_bos_token`/`add_eos_token` say; without
/// either, `otherwise` (the model's own post-processor, or none).
fn post_processor(tokens: &[String], special: &GgufSpecialTokens, otherwise: Value) -> Value {
    let bos = special.bos.filter(|_| special.add_bos);
    let eos = special.eos.filter(|_| special.add_eos);
    if bos.is_none() && eos.is_none() {
        return otherwise;
    }
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut specials = Map::new();
    let tok = |id: u32| tokens[id as usize].clone();
    let sp = |id: u32| json!({"SpecialToken": {"id": tok(id), "type_id": 0}});
    if let Some(b) = bos {
        single.push(sp(b));
        pair.push(sp(b));
    }
    single.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
    pair.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
    if let Some(e) = eos {
        single.push(sp(e));
        pair.push(sp(e));
    }
    if let Some(b) = bos {
        pair.push(sp(b));
    }
    pair.push(json!({"Sequence": {"id": "B", "type_id": 0}}));
    if let Some(e) = eos {
        pair.push(sp(e));
    }
    for id in bos.into_iter().chain(eos) {
        specials.insert(
            tok(id),
            json!({"id": tok(id), "ids": [id], "tokens": [tok(id)]}),
        );
    }
    json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials})
}

/// The vocabulary as `{token: id}`; a token listed twice keeps its first id.
fn vocab(tokens: &[String]) -> Map<String, Value> {
    let mut vocab = Map::new();
    for (id, t) in tokens.iter().enumerate().rev() {
        vocab.insert(t.clone(), json!(id));
    }
    vocab
}

fn byte_level_bpe(file: &GgufFile, tokens: &[String]) -> Result<Value, WeightsError> {
    let merges = file.get_str_array(MERGES_KEY)?;
    // `tokenizers` refuses a merge whose halves or result are not in the
    // vocabulary; say so here, naming the file and the merge.
    let known: std::collections::HashSet<&str> = tokens.iter().map(String::as_str).collect();
    for (i, m) in merges.iter().enumerate() {
        let ok = match m.split_once(' ') {
            Some((l, r)) => {
                !r.contains(' ')
                    && known.contains(l)
                    && known.contains(r)
                    && known.contains(format!("{l}{r}").as_str())
            }
            None => false,
        };
        if !ok {
            return Err(bad(
                file,
                MERGES_KEY,
                format!(
                    "merge #{i} {m:?} is not two tokens of the vocabulary (separated by one space) whose concatenation is one too"
                ),
            ));
        }
    }
    let pre = file.opt_str(PRE_KEY)?.unwrap_or("default");
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |regex: &str| {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            byte_level(false),
        ]})
    };
    let pre_tokenizer = match pre {
        "default" | "gpt-2" | "gpt2" => byte_level(true),
        "dbrx" | "smaug-bpe" => split(LLAMA3_REGEX),
        pre if llama3_like(pre) => split(LLAMA3_REGEX),
        "qwen2" | "stablelm2" => split(QWEN2_REGEX),
        "qwen35" => split(QWEN35_REGEX),
        other => {
            return Err(bad(
                file,
                PRE_KEY,
                format!(
                    "pre-tokenizer {other:?} is not supported (default, gpt-2, the Llama 3 family's \
                     (llama-bpe, lfm2, falcon-h1, ...), qwen2 and qwen35 are)"
                ),
            ));
        }
    };
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": byte_level(false),
        "decoder": byte_level(true),
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            // Llama 3's tokenizer.json takes a piece that is one token of
            // the vocabulary whole, before any merge (llama.cpp does the
            // same for these pre-tokenizers); merges alone can cut such a
            // piece elsewhere (" Việt" in three).
            "ignore_merges": llama3_like(pre),
            "vocab": vocab(tokens),
            "merges": merges,
        },
    }))
}

fn sentencepiece_bpe(
    file: &GgufFile,
    tokens: &[String],
    special: &GgufSpecialTokens,
) -> Result<Value, WeightsError> {
    let scores = match file.get(SCORES_KEY) {
        Some(_) => file.get_f32_array(SCORES_KEY)?,
        None => &[],
    };
    if scores.len() != tokens.len() {
        return Err(bad(
            file,
            SCORES_KEY,
            format!("{} scores for {} tokens", scores.len(), tokens.len()),
        ));
    }
    let merges = spm::spm_merges(tokens, scores).map_err(|detail| bad(file, TOKENS_KEY, detail))?;
    let space_prefix = file
        .opt_bool("tokenizer.ggml.add_space_prefix")?
        .unwrap_or(true);
    let replace = |from: &str, to: &str| json!({"type": "Replace", "pattern": {"String": from}, "content": to});
    let mut normalizers = Vec::new();
    if space_prefix {
        normalizers.push(json!({"type": "Prepend", "prepend": "\u{2581}"}));
    }
    normalizers.push(replace(" ", "\u{2581}"));
    let mut decoders = vec![
        replace("\u{2581}", " "),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if space_prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    let unk = special.unk.map(|id| tokens[id as usize].clone());
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": unk,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": true,
            "byte_fallback": true,
            "ignore_merges": false,
            "vocab": vocab(tokens),
            "merges": merges,
        },
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{GgufArray, GgufValue, GgufWriter};

    fn strings(v: &[&str]) -> GgufValue {
        GgufValue::Array(GgufArray::String(v.iter().map(|s| s.to_string()).collect()))
    }

    /// A byte-level vocabulary of digits with merges `1 2` and `12 3`.
    fn digits(pre: &str) -> GgufWriter {
        let mut w = GgufWriter::new();
        w.add(MODEL_KEY, GgufValue::String("gpt2".into()))
            .add(PRE_KEY, GgufValue::String(pre.into()))
            .add(TOKENS_KEY, strings(&["1", "2", "3", "12", "123"]))
            .add(MERGES_KEY, strings(&["1 2", "12 3"]));
        w
    }

    fn load(w: &GgufWriter) -> Result<GgufFile, WeightsError> {
        GgufFile::from_bytes("tok.gguf", w.to_bytes()?)
    }

    fn encode(w: &GgufWriter, text: &str) -> Vec<u32> {
        let json = tokenizer_json(&load(w).unwrap()).unwrap();
        let tok = tokenizers::Tokenizer::from_bytes(serde_json::to_vec(&json).unwrap()).unwrap();
        tok.encode(text, true).unwrap().get_ids().to_vec()
    }

    #[test]
    fn pre_tokenizer_follows_tokenizer_ggml_pre() {
        // GPT-2 keeps a run of digits whole, Llama 3 cuts it into threes,
        // Qwen 2 into single digits; BPE then merges within each piece.
        assert_eq!(encode(&digits("gpt-2"), "3123"), vec![2, 4]);
        assert_eq!(encode(&digits("llama-bpe"), "3123"), vec![2, 3, 2]);
        assert_eq!(encode(&digits("qwen2"), "3123"), vec![2, 0, 1, 2]);
    }

    #[test]
    fn llama3_takes_a_piece_in_the_vocabulary_whole() {
        // "abc" is a token, but the merges alone make "a" + "bc" of it.
        let letters = |pre: &str| {
            let mut w = GgufWriter::new();
            w.add(MODEL_KEY, GgufValue::String("gpt2".into()))
                .add(PRE_KEY, GgufValue::String(pre.into()))
                .add(TOKENS_KEY, strings(&["a", "b", "c", "bc", "ab", "abc"]))
                .add(MERGES_KEY, strings(&["b c", "a b"]));
            w
        };
        assert_eq!(encode(&letters("llama-bpe"), "abc"), vec![5]);
        assert_eq!(encode(&letters("lfm2"), "abc"), vec![5]);
        assert_eq!(encode(&letters("qwen2"), "abc"), vec![0, 3]);
    }

    #[test]
    fn qwen35_keeps_combining_marks_with_their_letter() {
        // "e" + U+0301 (bytes 65 CC 81, byte-level "eÌģ"): one piece for
        // Qwen3.5, merged whole; Qwen 2 cuts the mark off.
        let marks = |pre: &str| {
            let mut w = GgufWriter::new();
            w.add(MODEL_KEY, GgufValue::String("gpt2".into()))
                .add(PRE_KEY, GgufValue::String(pre.into()))
                .add(TOKENS_KEY, strings(&["e", "Ì", "ģ", "Ìģ", "eÌģ"]))
                .add(MERGES_KEY, strings(&["Ì ģ", "e Ìģ"]));
            w
        };
        assert_eq!(encode(&marks("qwen35"), "e\u{301}"), vec![4]);
        assert_eq!(encode(&marks("qwen2"), "e\u{301}"), vec![0, 3]);
    }

    #[test]
    fn bos_is_added_when_the_metadata_says_so() {
        let mut w = digits("gpt-2");
        w.add("tokenizer.ggml.bos_token_id", GgufValue::U32(0))
            .add("tokenizer.ggml.add_bos_token", GgufValue::Bool(true));
        assert_eq!(encode(&w, "3123"), vec![0, 2, 4]);
    }

    #[test]
    fn huggingface_json_is_taken_as_is() {
        let mut w = digits("unknown-pre");
        w.add(
            HF_JSON_KEY,
            GgufValue::String("{\"version\": \"1.0\"}".into()),
        );
        let json = tokenizer_json(&load(&w).unwrap()).unwrap();
        assert_eq!(json, json!({"version": "1.0"}));
    }

    #[test]
    fn bad_tokenizer_metadata_names_the_key() {
        let cases: Vec<(&str, GgufValue, &str)> = vec![
            (
                PRE_KEY,
                GgufValue::String("falcon".into()),
                "key \"tokenizer.ggml.pre\": pre-tokenizer \"falcon\" is not supported",
            ),
            (
                MODEL_KEY,
                GgufValue::String("bert".into()),
                "key \"tokenizer.ggml.model\": tokenizer model \"bert\" is not supported",
            ),
            (
                MERGES_KEY,
                strings(&["1 3"]),
                "key \"tokenizer.ggml.merges\": merge #0 \"1 3\" is not two tokens",
            ),
            (
                "tokenizer.ggml.eos_token_id",
                GgufValue::U32(5),
                "key \"tokenizer.ggml.eos_token_id\": token id 5 is outside the vocabulary of 5 tokens",
            ),
            (
                TOKEN_TYPE_KEY,
                GgufValue::Array(GgufArray::I32(vec![1])),
                "key \"tokenizer.ggml.token_type\": 1 entries for 5 tokens",
            ),
            (
                MODEL_KEY,
                GgufValue::String("llama".into()),
                "key \"tokenizer.ggml.scores\": 0 scores for 5 tokens",
            ),
            (
                TOKENS_KEY,
                GgufValue::Array(GgufArray::F32(vec![1.0])),
                "key \"tokenizer.ggml.tokens\" is array of f32, expected array of string",
            ),
            (
                HF_JSON_KEY,
                GgufValue::String("{".into()),
                "key \"tokenizer.huggingface.json\": is not valid JSON",
            ),
        ];
        for (key, value, expected) in cases {
            let mut w = digits("gpt-2");
            w.add(key, value);
            let e = tokenizer_json(&load(&w).unwrap()).unwrap_err().to_string();
            assert!(e.starts_with("tok.gguf: "), "{e}");
            assert!(e.contains(expected), "{e} should say {expected:?}");
        }
    }
}
