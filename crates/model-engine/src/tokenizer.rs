//! Tokenizer glue: a Hugging Face `tokenizer.json` through the `tokenizers`
//! crate, the special tokens a model directory declares, and incremental
//! detokenization for streaming.
//!
//! Where the special tokens come from, in order of precedence:
//! - EOS ids: `generation_config.json` `eos_token_id` (an int or a list), then
//!   `tokenizer_config.json` `eos_token`, then `config.json` `eos_token_id`. All
//!   of them count (their union, in that order, without duplicates): a model
//!   stops on any of them.
//! - BOS id: `tokenizer_config.json` `bos_token`, else `generation_config.json`
//!   `bos_token_id`, else `config.json` `bos_token_id`.
//!
//! In `tokenizer_config.json` a special token may be a string or an
//! `AddedToken` object (`{"content": "<s>", ...}`). Only `tokenizer.json` is
//! required; the other files are read when present and an error names any
//! that is present but malformed.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use serde_json::Value;

use crate::config::json::read_json;
use crate::error::{EngineError, Result};

mod bytes;
mod spans;

pub use bytes::{byte_level_byte, fallback_byte};

/// A loaded tokenizer with its special tokens. Cloning is cheap (the
/// vocabulary is shared).
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    bos_id: Option<u32>,
    bos_token: Option<String>,
    eos_ids: Vec<u32>,
    eos_token: Option<String>,
    add_bos_token: bool,
    vocab_size: usize,
    /// Ids below `vocab_size` that name no token (holes in the vocabulary).
    holes: Arc<[u32]>,
    /// The ids of the special added tokens, sorted.
    special_ids: Arc<[u32]>,
    /// The tokenizer with special-token matching off, made when first
    /// needed (see `spans`).
    plain: Arc<OnceLock<tokenizers::Tokenizer>>,
    source: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("source", &self.source)
            .field("vocab_size", &self.vocab_size)
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .finish()
    }
}

/// The most ids below the largest that may name no token. Real
/// vocabularies have none or a few (reserved ids); the holes are listed
/// (sampling masks them), so their number is bounded.
pub const MAX_VOCAB_HOLES: usize = 1 << 20;

fn file_error(path: &Path, detail: String) -> EngineError {
    EngineError::Config {
        path: path.to_path_buf(),
        detail,
    }
}

/// A special token as `tokenizer_config.json` writes it: a string, an
/// `AddedToken` object with `content`, or null.
pub(crate) fn special_token_text(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::String(s) => Some(s.clone()),
        Value::Object(map) => map.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// Token ids from a config field that is an int or a list of ints.
fn id_list(value: Option<&Value>) -> Vec<u32> {
    match value {
        Some(Value::Number(n)) => n
            .as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .into_iter()
            .collect(),
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(|v| v.as_u64().and_then(|v| u32::try_from(v).ok()))
            .collect(),
        _ => Vec::new(),
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` from a model directory, with the special tokens
    /// from `tokenizer_config.json`, `generation_config.json` and `config.json`
    /// where present.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let tok_path = dir.join("tokenizer.json");
        let inner = load_tokenizer_json(&tok_path)?;
        let tok_config = read_json(&dir.join("tokenizer_config.json"))?;
        let gen_config = read_json(&dir.join("generation_config.json"))?;
        let model_config = read_json(&dir.join("config.json"))?;
        Self::assemble(
            inner,
            tok_path,
            tok_config.as_ref(),
            gen_config.as_ref(),
            model_config.as_ref(),
        )
    }

    /// Loads a bare `tokenizer.json` (no special-token configs).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let inner = load_tokenizer_json(path)?;
        Self::assemble(inner, path.to_path_buf(), None, None, None)
    }

    /// The tokenizer a GGUF file's metadata describes (`tokenizer.ggml.*`,
    /// rebuilt as a `tokenizer.json` by
    /// [`tokenizer_json`](metrale_model_weights::gguf::tokenizer_json)), with
    /// its special tokens (BOS, EOS and end of turn as stop tokens, whether
    /// BOS is added).
    pub fn from_gguf(file: &metrale_model_weights::gguf::GgufFile) -> Result<Self> {
        use metrale_model_weights::gguf::{special_tokens, tokenizer_json};
        let path = file.path();
        let json = tokenizer_json(file)?;
        let bytes = serde_json::to_vec(&json)
            .map_err(|e| file_error(path, format!("cannot serialize its tokenizer: {e}")))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
            file_error(
                path,
                format!("its tokenizer metadata is not a valid tokenizer: {e}"),
            )
        })?;
        let special = special_tokens(file)?;
        let eos: Vec<u32> = special.eos.into_iter().chain(special.eot).collect();
        let tok_config = serde_json::json!({ "add_bos_token": special.add_bos });
        let gen_config = serde_json::json!({ "eos_token_id": eos });
        let model_config = serde_json::json!({ "bos_token_id": special.bos });
        Self::assemble(
            inner,
            path.to_path_buf(),
            Some(&tok_config),
            Some(&gen_config),
            Some(&model_config),
        )
    }

    fn assemble(
        inner: tokenizers::Tokenizer,
        source: PathBuf,
        tok_config: Option<&Value>,
        gen_config: Option<&Value>,
        model_config: Option<&Value>,
    ) -> Result<Self> {
        let field = |cfg: Option<&Value>, key: &str| cfg.and_then(|c| c.get(key)).cloned();

        let bos_token = special_token_text(field(tok_config, "bos_token").as_ref());
        let eos_token = special_token_text(field(tok_config, "eos_token").as_ref());

        let bos_id = bos_token
            .as_deref()
            .and_then(|t| inner.token_to_id(t))
            .or_else(|| {
                id_list(field(gen_config, "bos_token_id").as_ref())
                    .first()
                    .copied()
            })
            .or_else(|| {
                id_list(field(model_config, "bos_token_id").as_ref())
                    .first()
                    .copied()
            });

        let mut eos_ids = id_list(field(gen_config, "eos_token_id").as_ref());
        eos_ids.extend(eos_token.as_deref().and_then(|t| inner.token_to_id(t)));
        eos_ids.extend(id_list(field(model_config, "eos_token_id").as_ref()));
        let mut seen = Vec::with_capacity(eos_ids.len());
        eos_ids.retain(|id| {
            let fresh = !seen.contains(id);
            seen.push(*id);
            fresh
        });

        let add_bos_token = field(tok_config, "add_bos_token")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);

        let bos_token = bos_token.or_else(|| bos_id.and_then(|id| inner.id_to_token(id)));
        let vocab = inner.get_vocab(true);
        let vocab_size = vocab
            .values()
            .map(|&id| id as usize + 1)
            .max()
            .unwrap_or(0)
            .max(vocab.len());
        // The holes are listed: a file whose ids skip billions is refused
        // rather than listed.
        if vocab_size - vocab.len() > MAX_VOCAB_HOLES {
            return Err(file_error(
                &source,
                format!(
                    "token ids run to {} but there are {} tokens: more than {MAX_VOCAB_HOLES} \
                     ids in between name no token",
                    vocab_size - 1,
                    vocab.len()
                ),
            ));
        }
        let mut named = vec![false; vocab_size];
        vocab.values().for_each(|&id| named[id as usize] = true);
        let holes: Arc<[u32]> = (0..vocab_size as u32)
            .filter(|&id| !named[id as usize])
            .collect();

        let mut special_ids: Vec<u32> = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| id)
            .collect();
        special_ids.sort_unstable();
        Ok(Self {
            special_ids: special_ids.into(),
            plain: Arc::default(),
            inner: Arc::new(inner),
            bos_id,
            bos_token,
            eos_ids,
            eos_token,
            add_bos_token,
            vocab_size,
            holes,
            source,
        })
    }

    /// Token ids of `text`. With `add_special_tokens` the tokenizer's post
    /// processor runs (it adds BOS/EOS where `tokenizer.json` says so), and
    /// where `tokenizer_config.json` sets `add_bos_token` but the post
    /// processor added none, BOS is prepended.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| EngineError::Tokenizer(format!("encoding failed: {e}")))?;
        let mut ids = encoding.get_ids().to_vec();
        if let Some(bos) = self.bos_id
            && add_special_tokens
            && self.add_bos_token
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        Ok(ids)
    }

    /// Text of `ids`, keeping special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.decode_with(ids, false)
    }

    /// Text of `ids`; special tokens are left out with `skip_special_tokens`.
    pub fn decode_with(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| EngineError::Tokenizer(format!("decoding failed: {e}")))
    }

    /// The text of one token id on its own, special tokens kept, as a
    /// token is reported with its log-probability (vLLM decodes each id of
    /// its logprobs alone the same way): `decode(&[id])`, so a byte-level
    /// token reads as text (`" the"`, not `"Ġthe"`). A token that holds
    /// only part of a UTF-8 character decodes as U+FFFD. An id the
    /// tokenizer cannot decode (past its vocabulary, or a hole) is an
    /// error.
    pub fn token_text(&self, id: u32) -> Result<String> {
        if !self.can_decode(id) {
            return Err(EngineError::Tokenizer(format!(
                "token id {id} is not in the vocabulary"
            )));
        }
        self.decode(&[id])
    }

    /// Whether `id` is one the tokenizer can decode: below its vocabulary
    /// size and not a hole in it.
    pub fn can_decode(&self, id: u32) -> bool {
        (id as usize) < self.vocab_size && self.holes.binary_search(&id).is_err()
    }

    /// The ids that end generation (see the module docs for their sources).
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The BOS id, if the model has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// The BOS token's text, if any (for chat templates).
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The EOS token's text from `tokenizer_config.json`, or else the text of
    /// the first EOS id.
    pub fn eos_token(&self) -> Option<String> {
        self.eos_token.clone().or_else(|| {
            self.eos_ids
                .first()
                .and_then(|&id| self.inner.id_to_token(id))
        })
    }

    /// The number of token ids, added tokens included: one more than the
    /// largest id. A model's `vocab_size` may be larger (padded).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Ids below [`vocab_size`](Self::vocab_size) that name no token: with
    /// the ids from `vocab_size` on, the ids sampling must never pick.
    pub fn holes(&self) -> &Arc<[u32]> {
        &self.holes
    }

    /// The id of a token's exact text (added tokens included).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The text of a token id as stored in the vocabulary (byte-level
    /// tokenizers store mapped bytes, e.g. `Ġ` for a space).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The `tokenizer.json` this was loaded from.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// A streaming detokenizer for a new sequence.
    pub fn detokenizer(&self, skip_special_tokens: bool) -> Detokenizer {
        Detokenizer::new(self.clone(), skip_special_tokens)
    }
}

fn load_tokenizer_json(path: &Path) -> Result<tokenizers::Tokenizer> {
    let bytes = std::fs::read(path).map_err(|e| {
        let what = if e.kind() == std::io::ErrorKind::NotFound {
            "missing".to_owned()
        } else {
            format!("cannot read: {e}")
        };
        file_error(path, what)
    })?;
    tokenizers::Tokenizer::from_bytes(&bytes)
        .map_err(|e| file_error(path, format!("not a valid tokenizer.json: {e}")))
}

/// Tokens of the prompt used as decoding context by
/// [`Detokenizer::with_prompt`] (as vLLM does).
const PROMPT_CONTEXT_TOKENS: usize = 5;

/// Incremental detokenizer: feed token ids one at a time; it returns only
/// complete text, holding back the bytes of a character split across tokens.
///
/// It keeps two offsets into its token list (the prefix/read-offset technique
/// of TGI and vLLM): the text of `ids[prefix..read]` was already emitted, and a
/// new step decodes `ids[prefix..]` and emits what extends it, unless that ends
/// in U+FFFD (an incomplete UTF-8 sequence), in which case it waits. Decoding a
/// short window rather than a single token keeps decoders that treat the
/// first token specially (SentencePiece's leading space) right.
///
/// Without prompt context, the concatenated output of [`step`](Self::step)
/// and [`finish`](Self::finish) equals `decode(all ids)`.
#[derive(Debug, Clone)]
pub struct Detokenizer {
    tokenizer: Tokenizer,
    skip_special_tokens: bool,
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl Detokenizer {
    /// A detokenizer for a sequence whose output starts from scratch.
    pub fn new(tokenizer: Tokenizer, skip_special_tokens: bool) -> Self {
        Self {
            tokenizer,
            skip_special_tokens,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// A detokenizer that decodes generated tokens in the context of the
    /// prompt's last few tokens (so a generated token that starts a word gets
    /// its leading space with SentencePiece decoders). Prompt text is never
    /// emitted.
    pub fn with_prompt(tokenizer: Tokenizer, prompt: &[u32], skip_special_tokens: bool) -> Self {
        let tail = &prompt[prompt.len().saturating_sub(PROMPT_CONTEXT_TOKENS)..];
        Self {
            tokenizer,
            skip_special_tokens,
            ids: tail.to_vec(),
            prefix_offset: 0,
            read_offset: tail.len(),
        }
    }

    /// Feeds one token; returns the new complete text, if any.
    pub fn step(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let prefix = self.decode_window(self.prefix_offset, self.read_offset)?;
        let full = self.decode_window(self.prefix_offset, self.ids.len())?;
        if full.len() <= prefix.len() || full.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        // The window's text normally extends the prefix's; where a decoder
        // rewrites earlier text, wait for more tokens rather than emit a
        // wrong delta.
        match full.strip_prefix(prefix.as_str()) {
            Some(delta) => {
                let delta = delta.to_owned();
                self.prefix_offset = self.read_offset;
                self.read_offset = self.ids.len();
                Ok(Some(delta))
            }
            None => Ok(None),
        }
    }

    /// Whatever text is still held back (e.g. a trailing incomplete
    /// character, decoded as U+FFFD), at the end of the sequence.
    pub fn finish(&mut self) -> Result<Option<String>> {
        let prefix = self.decode_window(self.prefix_offset, self.read_offset)?;
        let full = self.decode_window(self.prefix_offset, self.ids.len())?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        let common = common_prefix_len(&prefix, &full);
        let delta = full.get(common..).unwrap_or_default().to_owned();
        Ok((!delta.is_empty()).then_some(delta))
    }

    fn decode_window(&self, from: usize, to: usize) -> Result<String> {
        match self.ids.get(from..to) {
            Some([]) | None => Ok(String::new()),
            Some(window) => self.tokenizer.decode_with(window, self.skip_special_tokens),
        }
    }
}

/// The length in bytes of the longest common prefix of `a` and `b` that ends
/// on a character boundary.
fn common_prefix_len(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, ca), cb)| ca != cb)
        .map(|((i, _), _)| i)
        .unwrap_or_else(|| a.len().min(b.len()))
}
