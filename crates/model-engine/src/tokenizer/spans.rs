//! Encoding text some of whose bytes must not become special tokens: the
//! message content of a rendered chat.
//!
//! The text is encoded once as a whole, as it always was; when no special
//! token found there overlaps a plain range, those are the ids (so a normal
//! conversation tokenizes exactly as its rendered text). Otherwise the text
//! is cut at the special tokens that lie outside the plain ranges (where the
//! tokenizer cuts it anyway), those keep their ids, and the pieces between
//! are encoded with special-token matching off.

use std::ops::Range;

use super::Tokenizer;
use crate::chat::RenderedChat;
use crate::error::{EngineError, Result};

/// A byte range as `(start, end)`, as `tokenizers` gives offsets.
type Span = (usize, usize);

impl Tokenizer {
    /// Token ids of a rendered chat ([`ChatTemplate::render_spans`]
    /// (crate::chat::ChatTemplate::render_spans)): special tokens in its
    /// message content are text, the template's are special tokens. A role,
    /// or a content the template changed, holding a special token is an
    /// error.
    pub fn encode_rendered(&self, rendered: &RenderedChat) -> Result<Vec<u32>> {
        self.encode_rendered_from(rendered, 0)
    }

    /// Like [`encode_rendered`](Self::encode_rendered), for the text from
    /// byte `from` on (a chat that kept the ids of what came before).
    pub fn encode_rendered_from(&self, rendered: &RenderedChat, from: usize) -> Result<Vec<u32>> {
        for (what, text) in rendered.loose() {
            if let Some(token) = self.special_token_in(text)? {
                return Err(EngineError::Request(format!(
                    "{what} holds the special token {token:?}, and the chat template does \
                     not write it as given, so it cannot be kept as text"
                )));
            }
        }
        let text = rendered.text().get(from..).ok_or_else(|| {
            EngineError::Internal(format!(
                "byte {from} is not a character boundary of the rendered chat"
            ))
        })?;
        let plain: Vec<Range<usize>> = rendered
            .content()
            .iter()
            .filter(|r| r.end > from)
            .map(|r| r.start.max(from) - from..r.end - from)
            .collect();
        self.encode_spans(text, &plain)
    }

    /// Token ids of `text` (no BOS or EOS added) in which the bytes of the
    /// `plain` ranges never become special tokens: a special token written
    /// there is tokenized as text.
    pub fn encode_spans(&self, text: &str, plain: &[Range<usize>]) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| EngineError::Tokenizer(format!("encoding failed: {e}")))?;
        let overlaps = |(s, e): (usize, usize)| plain.iter().any(|r| s < r.end && r.start < e);
        // (id, the bytes it stands for, the bytes of its own text): a token
        // that strips whitespace next to it (`lstrip` / `rstrip`) takes
        // that whitespace too, which may be content; it is the token's own
        // text that must not be.
        let special: Vec<(u32, Span, Span)> = encoding
            .get_ids()
            .iter()
            .zip(encoding.get_offsets())
            .filter(|(id, _)| self.is_special(**id))
            .map(|(&id, &(s, e))| (id, (s, e), self.own_text(id, text, s, e)))
            .collect();
        if !special.iter().any(|&(_, _, own)| overlaps(own)) {
            return Ok(encoding.get_ids().to_vec());
        }
        let mut ids = Vec::with_capacity(encoding.len());
        let mut at = 0;
        for (id, (start, end), _) in special.into_iter().filter(|&(_, _, own)| !overlaps(own)) {
            self.encode_plain(&text[at..start], &mut ids)?;
            ids.push(id);
            at = end;
        }
        self.encode_plain(&text[at..], &mut ids)?;
        Ok(ids)
    }

    /// The first special token `text` holds, as the tokenizer matches them.
    pub fn special_token_in(&self, text: &str) -> Result<Option<String>> {
        let encoding = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| EngineError::Tokenizer(format!("encoding failed: {e}")))?;
        Ok(encoding
            .get_ids()
            .iter()
            .find(|&&id| self.is_special(id))
            .and_then(|&id| self.inner.id_to_token(id)))
    }

    /// Where the text of special token `id` is within the bytes `s..e`
    /// it was matched on (all of them where it is not found as written).
    fn own_text(&self, id: u32, text: &str, s: usize, e: usize) -> Span {
        let token = self.inner.id_to_token(id).unwrap_or_default();
        match text.get(s..e).and_then(|span| span.find(token.as_str())) {
            Some(at) if !token.is_empty() => (s + at, s + at + token.len()),
            _ => (s, e),
        }
    }

    fn is_special(&self, id: u32) -> bool {
        self.special_ids.binary_search(&id).is_ok()
    }

    /// Appends the ids of `text` encoded with special tokens as text.
    fn encode_plain(&self, text: &str, ids: &mut Vec<u32>) -> Result<()> {
        if text.is_empty() {
            return Ok(());
        }
        let plain = self.plain.get_or_init(|| {
            let mut plain = (*self.inner).clone();
            plain.set_encode_special_tokens(true);
            plain
        });
        let encoding = plain
            .encode_fast(text, false)
            .map_err(|e| EngineError::Tokenizer(format!("encoding failed: {e}")))?;
        ids.extend_from_slice(encoding.get_ids());
        Ok(())
    }
}
