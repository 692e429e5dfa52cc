//! The `tokenizer.*` keys llama.cpp's converter writes for a byte-level
//! BPE tokenizer (`TextModel._set_vocab_gpt2` and gguf-py's
//! `SpecialVocab`): the token list and types, the pre-tokenizer name found
//! from the hash of `CHK_TXT`'s token ids, the merges, the special token
//! ids, whether BOS/EOS are added, and the chat template.
//!
//! Not handled (an error or, where noted, left out): tokenizers other than
//! byte-level BPE (SentencePiece `llama`, WordPiece); the extra named
//! templates of a `chat_template.jinja`'s `additional_chat_templates/`
//! directory; `TemplateProcessing` post-processors' separator and EOT/EOM
//! rules (their BOS/EOS rules are followed); added
//! tokens that normalize to another text (the converter's
//! `decode(encode(token))`: kept as written); the normalizer's lowercase /
//! strip-accents flags (not written).

use std::path::Path;

use metrale_model_weights::gguf::{GgufArray, GgufValue};
use serde_json::{Map, Value};

use super::Meta;
use super::pre_hashes::{CHK_TXT, KNOWN_PRE};
use super::sha256_hex;
use crate::error::{EngineError, Result};

/// gguf's token types.
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;

fn err(path: &Path, detail: impl Into<String>) -> EngineError {
    EngineError::Tokenizer(format!("{}: {}", path.display(), detail.into()))
}

fn read_json(path: &Path) -> Result<Option<Map<String, Value>>> {
    match std::fs::read_to_string(path) {
        Ok(s) => match serde_json::from_str(&s) {
            Ok(Value::Object(m)) => Ok(Some(m)),
            Ok(_) => Err(err(path, "is not a JSON object")),
            Err(e) => Err(err(path, e.to_string())),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(err(path, e.to_string())),
    }
}

/// `TextModel.does_token_look_special`.
fn looks_special(t: &str) -> bool {
    matches!(t, "<pad>" | "<mask>" | "<2mass>" | "[@BOS@]")
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<\u{ff5c}") && t.ends_with("\u{ff5c}>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

/// The pre-tokenizer name the converter would write for `tokenizer`: the
/// sha256 of its token ids for `CHK_TXT` (special tokens added, as
/// `tokenizer.encode` does) looked up in llama.cpp's table.
pub fn pre_tokenizer_hash(tokenizer: &tokenizers::Tokenizer) -> Result<String> {
    let ids = tokenizer
        .encode(CHK_TXT, true)
        .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
    let list = (ids.get_ids().iter())
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    Ok(sha256_hex(format!("[{list}]").as_bytes()))
}

/// The name llama.cpp's table gives `hash`, if it knows it.
pub fn known_pre_tokenizer(hash: &str) -> Option<&'static str> {
    KNOWN_PRE.iter().find(|(h, _)| *h == hash).map(|(_, n)| *n)
}

/// `gpt-2` for a tokenizer whose hash llama.cpp's table lacks (its own
/// vocabulary, as a model trained from scratch has) but whose text
/// pipeline is GPT-2's to the letter: no normalizer, and one byte-level
/// pre-tokenizer with GPT-2's split regex and no prefix space. llama.cpp's
/// `gpt-2` pre-tokenizer splits with that regex too, so the ids are the
/// same whatever the vocabulary; the hash only names the pipeline for
/// tokenizers whose vocabulary the table has seen.
fn gpt2_by_structure(tj: &Map<String, Value>) -> Option<&'static str> {
    let pre = tj.get("pre_tokenizer")?.as_object()?;
    let flag = |k: &str| pre.get(k).and_then(Value::as_bool);
    let gpt2 = pre.get("type").and_then(Value::as_str) == Some("ByteLevel")
        && flag("add_prefix_space") == Some(false)
        && flag("use_regex") != Some(false)
        && tj.get("normalizer").is_none_or(Value::is_null);
    gpt2.then_some("gpt-2")
}

/// Adds the tokenizer keys for the checkpoint in `dir` to `m`.
/// `vocab_size` is the token count to write (the config's, padded as the
/// family's converter pads it); `pre` overrides the pre-tokenizer name.
pub(super) fn tokenizer_keys(
    m: &mut Meta,
    dir: &Path,
    vocab_size: usize,
    pre: Option<&str>,
) -> Result<()> {
    let tj_path = dir.join("tokenizer.json");
    let Some(tj) = read_json(&tj_path)? else {
        return Err(err(
            &tj_path,
            "not found: GGUF export needs the checkpoint's tokenizer.json",
        ));
    };
    let model = tj.get("model").and_then(Value::as_object);
    let byte_level = |k: &str| {
        let text = tj.get(k).map(Value::to_string).unwrap_or_default();
        text.contains("\"ByteLevel\"")
    };
    if model.and_then(|m| m.get("type")).and_then(Value::as_str) != Some("BPE")
        || !(byte_level("pre_tokenizer") || byte_level("decoder"))
    {
        return Err(err(
            &tj_path,
            "only byte-level BPE tokenizers (llama.cpp's `gpt2` tokenizer model) are exported",
        ));
    }
    let tokenizer =
        tokenizers::Tokenizer::from_file(&tj_path).map_err(|e| err(&tj_path, e.to_string()))?;
    let vocab = tokenizer.get_vocab(true);
    let added = tokenizer.get_added_tokens_decoder();
    if let Some(max) = vocab.values().max()
        && *max as usize >= vocab_size
    {
        return Err(err(
            &tj_path,
            format!("token id {max} is not below the model's vocab_size {vocab_size}"),
        ));
    }
    let pre = match pre {
        Some(p) => p.to_string(),
        None => {
            let hash = pre_tokenizer_hash(&tokenizer)?;
            match known_pre_tokenizer(&hash).or_else(|| gpt2_by_structure(&tj)) {
                Some(name) => name.to_string(),
                None => {
                    return Err(err(
                        &tj_path,
                        format!(
                            "its BPE pre-tokenizer is not one llama.cpp knows (hash {hash}); \
                             name one llama.cpp implements with --pre-tokenizer (e.g. gpt-2, \
                             llama-bpe, qwen2) if you know which it is"
                        ),
                    ));
                }
            }
        }
    };
    let mut reverse = vec![None; vocab_size];
    for (tok, &id) in &vocab {
        reverse[id as usize] = Some(tok.as_str());
    }
    let mut tokens = Vec::with_capacity(vocab_size);
    let mut types = Vec::with_capacity(vocab_size);
    for (i, t) in reverse.iter().enumerate() {
        match t {
            None => {
                tokens.push(format!("[PAD{i}]"));
                types.push(UNUSED);
            }
            Some(t) => match added.get(&(i as u32)).filter(|a| a.content == *t) {
                Some(a) if a.special || looks_special(t) => {
                    tokens.push(t.to_string());
                    types.push(CONTROL);
                }
                Some(_) => {
                    tokens.push(t.replace('\u{2581}', " "));
                    types.push(USER_DEFINED);
                }
                None => {
                    tokens.push(t.to_string());
                    types.push(NORMAL);
                }
            },
        }
    }
    m.put_full("tokenizer.ggml.model", GgufValue::String("gpt2".into()));
    m.put_full("tokenizer.ggml.pre", GgufValue::String(pre));
    m.put_full(
        "tokenizer.ggml.tokens",
        GgufValue::Array(GgufArray::String(tokens)),
    );
    m.put_full(
        "tokenizer.ggml.token_type",
        GgufValue::Array(GgufArray::I32(types)),
    );
    special_vocab(m, dir, &tj, &tj_path, vocab_size)
}

/// gguf-py's `SpecialVocab(dir, load_merges=True).add_to_gguf`.
fn special_vocab(
    m: &mut Meta,
    dir: &Path,
    tj: &Map<String, Value>,
    tj_path: &Path,
    vocab_size: usize,
) -> Result<()> {
    let merges = (tj.get("model"))
        .and_then(|m| m.get("merges"))
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let merges = (merges.iter())
        .map(|e| match e {
            Value::String(s) => Ok(s.clone()),
            Value::Array(pair) if pair.len() == 2 => {
                let part = |v: &Value| {
                    v.as_str().map(|s| {
                        s.chars()
                            .map(|c| if c == ' ' { '\u{120}' } else { c })
                            .collect::<String>()
                    })
                };
                match (part(&pair[0]), part(&pair[1])) {
                    (Some(a), Some(b)) => Ok(format!("{a} {b}")),
                    _ => Err(err(tj_path, "a merge is not two strings")),
                }
            }
            _ => Err(err(tj_path, "unknown merges format")),
        })
        .collect::<Result<Vec<_>>>()?;
    if !merges.is_empty() {
        m.put_full(
            "tokenizer.ggml.merges",
            GgufValue::Array(GgufArray::String(merges)),
        );
    }
    const TYPES: [&str; 7] = ["bos", "eos", "unk", "sep", "pad", "cls", "mask"];
    let tc_path = dir.join("tokenizer_config.json");
    let tc = read_json(&tc_path)?;
    let config = read_json(&dir.join("config.json"))?.unwrap_or_default();
    let added_tokens = (tj.get("added_tokens").and_then(Value::as_array))
        .cloned()
        .unwrap_or_default();
    let mut add: Vec<(&str, bool)> = Vec::new();
    let set_add = |add: &mut Vec<(&str, bool)>, t: &'static str, v: bool, replace: bool| match add
        .iter_mut()
        .find(|(k, _)| *k == t)
    {
        Some(e) if replace => e.1 = v,
        Some(_) => {}
        None => add.push((t, v)),
    };
    let tc_token = |typ: &str| -> Option<String> {
        let entry = tc.as_ref()?.get(&format!("{typ}_token"))?;
        match entry {
            Value::String(s) => Some(s.clone()),
            Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
            _ => None,
        }
    };
    if let Some(pp) = tj.get("post_processor").filter(|v| !v.is_null()) {
        let list = match pp.get("processors").and_then(Value::as_array) {
            Some(l) => l.clone(),
            None => vec![pp.clone()],
        };
        for p in list {
            match p.get("type").and_then(Value::as_str) {
                Some("ByteLevel") => {
                    set_add(&mut add, "bos", false, false);
                    set_add(&mut add, "eos", false, false);
                }
                Some("RobertaProcessing") => {
                    set_add(&mut add, "bos", true, true);
                    set_add(&mut add, "eos", true, true);
                    set_add(&mut add, "sep", true, true);
                }
                Some("TemplateProcessing") => {
                    let single = (p.get("single").and_then(Value::as_array))
                        .cloned()
                        .unwrap_or_default();
                    let special = |v: Option<&Value>| {
                        v.and_then(|v| v.get("SpecialToken"))
                            .and_then(|s| s.get("id"))
                            .and_then(Value::as_str)
                            .map(str::to_string)
                    };
                    if single.len() > 1 {
                        let bos = tc_token("bos").or(tc_token("cls"));
                        if let Some(first) = special(single.first()) {
                            let is_bos = tc.is_none() || bos.as_deref() == Some(first.as_str());
                            set_add(&mut add, "bos", is_bos, true);
                        }
                        if let Some(last) = special(single.last()) {
                            let eos = tc_token("eos").or(tc_token("sep"));
                            let is_eos = tc.is_none() || eos.as_deref() == Some(last.as_str());
                            set_add(&mut add, "eos", is_eos, true);
                        }
                    }
                }
                _ => {}
            }
        }
    }
    let mut ids: Vec<(&str, u64)> = Vec::new();
    let mut chat_template = None;
    if let Some(tc) = &tc {
        // tokenizer_config.json's, else chat_template.jinja, else
        // chat_template.json's (only when the key is absent, as the
        // converter's `dict.get(key, alt)`).
        chat_template = match tc.get("chat_template") {
            Some(v) => Some(v.clone()),
            None => {
                let jinja = dir.join("chat_template.jinja");
                if let Ok(s) = std::fs::read_to_string(&jinja) {
                    Some(Value::String(s))
                } else {
                    read_json(&dir.join("chat_template.json"))?
                        .and_then(|ct| ct.get("chat_template").cloned())
                }
            }
        };
        for typ in TYPES {
            if let Some(Value::Bool(b)) = tc.get(&format!("add_{typ}_token")) {
                set_add(&mut add, typ, *b, false);
            }
            let Some(content) = tc_token(typ).or(match typ {
                "bos" => tc_token("cls"),
                "eos" => tc_token("sep"),
                _ => None,
            }) else {
                continue;
            };
            let id = (added_tokens.iter())
                .find(|a| a.get("content").and_then(Value::as_str) == Some(content.as_str()))
                .and_then(|a| a.get("id"))
                .and_then(Value::as_u64);
            if let Some(id) = id
                && !ids.iter().any(|(k, _)| *k == typ)
            {
                ids.push((typ, id));
            }
        }
    }
    for typ in TYPES {
        let key = format!("{typ}_token_id");
        let id = config
            .get(&key)
            .or_else(|| config.get("text_config").and_then(|t| t.get(&key)));
        if let Some(id) = id.and_then(Value::as_u64)
            && !ids.iter().any(|(k, _)| *k == typ)
        {
            ids.push((typ, id));
        }
    }
    // SpecialVocab is made without a vocab size: ids are not range-checked.
    let _ = vocab_size;
    for (typ, id) in ids {
        let name = match typ {
            "unk" => "unknown",
            "sep" => "seperator",
            "pad" => "padding",
            other => other,
        };
        m.put_full(
            &format!("tokenizer.ggml.{name}_token_id"),
            GgufValue::U32(id as u32),
        );
    }
    for (typ, v) in add {
        m.put_full(
            &format!("tokenizer.ggml.add_{typ}_token"),
            GgufValue::Bool(v),
        );
    }
    match chat_template {
        Some(Value::String(t)) => m.put_full("tokenizer.chat_template", GgufValue::String(t)),
        Some(Value::Array(list)) => named_templates(m, &list),
        _ => {}
    }
    Ok(())
}

/// gguf-py's `add_chat_template` of a list of `{name, template}`: each
/// named one as `tokenizer.chat_template.<name>` (the name's characters
/// other than ASCII letters and digits as `_`), their names as
/// `tokenizer.chat_templates` (in the list's order; gguf-py writes a
/// Python set's), the one named `default` as `tokenizer.chat_template`.
pub(super) fn named_templates(m: &mut Meta, list: &[Value]) {
    let mut default = None;
    let mut names: Vec<String> = Vec::new();
    for choice in list {
        let name = choice.get("name").and_then(Value::as_str).unwrap_or("");
        let name: String = (name.chars())
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let Some(template) = choice.get("template").and_then(Value::as_str) else {
            continue;
        };
        if name.is_empty() {
            continue;
        }
        if name == "default" {
            default = Some(template.to_string());
        } else {
            m.put_full(
                &format!("tokenizer.chat_template.{name}"),
                GgufValue::String(template.to_string()),
            );
            if !names.contains(&name) {
                names.push(name);
            }
        }
    }
    if !names.is_empty() {
        m.put_full(
            "tokenizer.chat_templates",
            GgufValue::Array(GgufArray::String(names)),
        );
    }
    if let Some(t) = default {
        m.put_full("tokenizer.chat_template", GgufValue::String(t));
    }
}
