//! The vocabulary as the grammar engine sees it: every token id's bytes,
//! read from the tokenizer's own tables, and an [`llguidance`]
//! `TokenizerEnv` over metrale's [`Tokenizer`].
//!
//! A token's bytes depend on how its tokenizer decodes:
//! - byte-level BPE (GPT-2, Llama 3, Qwen, Granite): each character of the
//!   token's name stands for one byte through GPT-2's byte map;
//! - SentencePiece with byte fallback (Llama 2, Mistral, Gemma): `<0xAB>`
//!   is that byte, and the space character (`▁`, or what the decoder's
//!   `Replace` step turns into a space) is a space;
//! - a Metaspace decoder without byte fallback: `▁` is a space.
//!
//! Special tokens (and ids that name no token) get toktrie's marker byte
//! (0xFF, never in UTF-8 text) before their name, so no grammar matches
//! them as text; the end-of-sequence ids are the grammar's EOS.

use serde_json::Value;
use toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::error::{EngineError, Result};
use crate::tokenizer::{Tokenizer, byte_level_byte, fallback_byte};

/// How a tokenizer's token names map to bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Decoding {
    /// GPT-2's byte map.
    ByteLevel,
    /// `<0xAB>` tokens, and `space` for a space.
    ByteFallback { space: char },
    /// `space` for a space, no byte tokens.
    Metaspace { space: char },
}

/// The decoding of a `tokenizer.json` `decoder` entry, found by its type.
fn decoding(decoder: &Value) -> Option<Decoding> {
    let kind = decoder.get("type").and_then(Value::as_str);
    match kind {
        Some("ByteLevel") => Some(Decoding::ByteLevel),
        Some("Metaspace") => Some(Decoding::Metaspace {
            space: metaspace_char(decoder).unwrap_or('▁'),
        }),
        Some("Sequence") => {
            let parts = decoder.get("decoders")?.as_array()?;
            let mut space = None;
            let mut fallback = false;
            for part in parts {
                match part.get("type").and_then(Value::as_str) {
                    Some("ByteLevel") => return Some(Decoding::ByteLevel),
                    Some("ByteFallback") => fallback = true,
                    Some("Replace") if part.get("content").and_then(Value::as_str) == Some(" ") => {
                        space = part
                            .pointer("/pattern/String")
                            .and_then(Value::as_str)
                            .and_then(single_char);
                    }
                    Some("Metaspace") => space = metaspace_char(part).or(space),
                    _ => {}
                }
            }
            let space = space.unwrap_or('▁');
            Some(if fallback {
                Decoding::ByteFallback { space }
            } else {
                Decoding::Metaspace { space }
            })
        }
        _ => None,
    }
}

fn metaspace_char(decoder: &Value) -> Option<char> {
    decoder
        .get("replacement")
        .and_then(Value::as_str)
        .and_then(single_char)
}

fn single_char(s: &str) -> Option<char> {
    let mut chars = s.chars();
    let c = chars.next()?;
    chars.next().is_none().then_some(c)
}

fn marked(name: &str) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(name.len() + 1);
    bytes.push(TokTrie::SPECIAL_TOKEN_MARKER);
    bytes.extend_from_slice(name.as_bytes());
    bytes
}

/// Every id's bytes, `vocab_size` of them. Fails naming the decoder when
/// the tokenizer's decoding is not one of [`Decoding`]'s.
pub(super) fn token_bytes(tokenizer: &Tokenizer) -> Result<Vec<Vec<u8>>> {
    let inner = tokenizer.inner();
    let decoder = serde_json::to_value(inner.get_decoder()).unwrap_or(Value::Null);
    let decoding = decoding(&decoder).ok_or_else(|| {
        EngineError::Request(format!(
            "structured outputs need a byte-level or SentencePiece tokenizer; this one's \
             decoder is {}",
            decoder.get("type").unwrap_or(&Value::Null)
        ))
    })?;
    let added = inner.get_added_tokens_decoder();
    let vocab_size = tokenizer.vocab_size();
    let mut bytes: Vec<Vec<u8>> = (0..vocab_size)
        .map(|id| marked(&format!("<[{id}]>")))
        .collect();
    for (name, id) in inner.get_vocab(false) {
        let Some(slot) = bytes.get_mut(id as usize) else {
            continue;
        };
        *slot = match decoding {
            Decoding::ByteLevel => match name.chars().map(byte_level_byte).collect() {
                Some(b) => b,
                None => marked(&name),
            },
            Decoding::ByteFallback { space } => match fallback_byte(&name) {
                Some(b) => vec![b],
                None => name.replace(space, " ").into_bytes(),
            },
            Decoding::Metaspace { space } => name.replace(space, " ").into_bytes(),
        };
    }
    for (id, token) in added {
        if let Some(slot) = bytes.get_mut(id as usize) {
            *slot = if token.special {
                marked(&token.content)
            } else {
                token.content.into_bytes()
            };
        }
    }
    Ok(bytes)
}

/// The grammar engine's view of a [`Tokenizer`]: its trie, and its
/// encoder for the text a grammar forces.
pub(super) struct VocabEnv {
    trie: TokTrie,
    /// The tokenizer with nothing prepended to the text: the grammar
    /// engine encodes pieces of the output, not whole prompts.
    encoder: tokenizers::Tokenizer,
}

/// `inner` without what SentencePiece tokenizers put before a text (a
/// `Prepend` normalizer, a Metaspace pre-tokenizer's prefix space): the
/// grammar engine encodes bytes in the middle of an output, where a
/// prefix space would make `{` into `▁{` and break the match.
fn piece_encoder(inner: &tokenizers::Tokenizer) -> tokenizers::Tokenizer {
    use tokenizers::normalizers::{NormalizerWrapper, Sequence as Normalizers};
    use tokenizers::pre_tokenizers::PreTokenizerWrapper;
    use tokenizers::pre_tokenizers::metaspace::PrependScheme;
    use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizers;
    fn normalizer(n: &NormalizerWrapper) -> Option<NormalizerWrapper> {
        match n {
            NormalizerWrapper::Prepend(_) => None,
            NormalizerWrapper::Sequence(seq) => {
                let kept: Vec<_> = seq.as_ref().iter().filter_map(normalizer).collect();
                (!kept.is_empty()).then(|| NormalizerWrapper::Sequence(Normalizers::new(kept)))
            }
            other => Some(other.clone()),
        }
    }
    fn pre_tokenizer(p: &PreTokenizerWrapper) -> PreTokenizerWrapper {
        match p {
            PreTokenizerWrapper::Metaspace(m) => {
                let mut m = m.clone();
                m.set_prepend_scheme(PrependScheme::Never);
                PreTokenizerWrapper::Metaspace(m)
            }
            PreTokenizerWrapper::Sequence(seq) => PreTokenizerWrapper::Sequence(
                PreTokenizers::new(seq.as_ref().iter().map(pre_tokenizer).collect()),
            ),
            other => other.clone(),
        }
    }
    let mut encoder = inner.clone();
    let n = encoder.get_normalizer().and_then(normalizer);
    encoder.with_normalizer(n);
    let p = encoder.get_pre_tokenizer().map(pre_tokenizer);
    encoder.with_pre_tokenizer(p);
    encoder
}

impl VocabEnv {
    /// Fails when the tokenizer has no end-of-sequence id (a grammar could
    /// not end) or its decoding is unknown.
    pub(super) fn new(tokenizer: &Tokenizer) -> Result<Self> {
        let eos = tokenizer.eos_ids();
        let Some(&first) = eos.first() else {
            return Err(EngineError::Request(
                "structured outputs need the tokenizer's end-of-sequence token; it has none".into(),
            ));
        };
        let words = token_bytes(tokenizer)?;
        let vocab_size = u32::try_from(words.len())
            .map_err(|_| EngineError::Request("the vocabulary is too large".into()))?;
        let info = TokRxInfo::new(vocab_size, first);
        let mut trie = TokTrie::from(&info, &words);
        if eos.len() > 1 {
            trie = trie.with_eos_tokens(eos);
        }
        Ok(Self {
            trie,
            encoder: piece_encoder(tokenizer.inner()),
        })
    }
}

impl TokenizerEnv for VocabEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            // The greedy trie walk covers what the tokenizer cannot encode.
            self.encoder
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodings_are_read_from_the_decoder() {
        let seq = serde_json::json!({"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip"}]});
        assert_eq!(decoding(&seq), Some(Decoding::ByteFallback { space: '▁' }));
        assert_eq!(
            decoding(&serde_json::json!({"type": "ByteLevel"})),
            Some(Decoding::ByteLevel)
        );
        assert_eq!(decoding(&serde_json::json!({"type": "WordPiece"})), None);
        assert_eq!(fallback_byte("<0x0A>"), Some(10));
        assert_eq!(fallback_byte("<0xZZ>"), None);
        assert_eq!(fallback_byte("<0x0A0>"), None);
    }

    #[test]
    fn the_fixture_vocabulary_has_every_byte_and_marks_specials() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
        let t = Tokenizer::from_file(dir.join("tokenizer/tokenizer.json")).unwrap();
        let bytes = token_bytes(&t).unwrap();
        assert_eq!(bytes.len(), t.vocab_size());
        for id in 0..t.vocab_size() as u32 {
            let b = &bytes[id as usize];
            if b.first() == Some(&TokTrie::SPECIAL_TOKEN_MARKER) {
                continue;
            }
            // Decoding a plain token alone gives its bytes (lossily).
            let text = t.decode_with(&[id], false).unwrap();
            assert_eq!(text, String::from_utf8_lossy(b), "token {id}");
        }
    }
}
