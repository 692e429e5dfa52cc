//! The token ids of a conversation as the model saw them, kept across the
//! turns of a chat so that the prefix cache matches every earlier turn.
//!
//! A chat re-renders its whole conversation through the chat template each
//! turn. Re-tokenizing that text need not give back the ids the model
//! generated (a reply's text has more than one tokenization), and the
//! prefix cache matches ids, so the next turn would prefill the reply
//! again. [`ChatTokens`] keeps the rendered prompt and the reply as
//! generated, text and ids side by side, and tokenizes only what a new
//! render adds after them.

use anyhow::Result;
use metrale_model_engine::chat::RenderedChat;
use metrale_model_engine::sampling::Finish;
use metrale_model_engine::tokenizer::Tokenizer;

/// A conversation's rendered text and the ids that stand for it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChatTokens {
    text: String,
    ids: Vec<u32>,
}

impl ChatTokens {
    pub fn new() -> Self {
        Self::default()
    }

    /// The ids kept (the last prompt and the reply recorded after it).
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The prompt ids of `rendered`, a render of the conversation ready for
    /// the reply ([`Generator::chat_text`](crate::Generator::chat_text)),
    /// which become the kept text and ids. When `rendered` starts with the
    /// kept text, only the rest is tokenized and appended to the kept ids;
    /// otherwise (a template that renders earlier turns differently once
    /// more follow, a dropped turn, nothing kept) the whole render is
    /// tokenized. Special tokens in message content are text either way
    /// ([`Tokenizer::encode_rendered`]).
    pub fn prompt(&mut self, tokenizer: &Tokenizer, rendered: &RenderedChat) -> Result<Vec<u32>> {
        let text = rendered.text();
        match text.strip_prefix(self.text.as_str()) {
            Some(_) if !self.text.is_empty() => {
                let more = tokenizer.encode_rendered_from(rendered, self.text.len())?;
                self.ids.extend(more);
            }
            _ => self.ids = tokenizer.encode_rendered(rendered)?,
        }
        self.text = text.to_string();
        Ok(self.ids.clone())
    }

    /// Records the reply to the last prompt: its text as shown and the
    /// ids generated, ended by `reason`. An end-of-sequence id is left out:
    /// its text is not in the reply, and the template renders its own
    /// end-of-turn markup after it. A reply cut by a stop string or a stop
    /// token id holds ids whose text was left out of it, so nothing is
    /// kept then and the next prompt is tokenized whole.
    pub fn push_reply(&mut self, text: &str, ids: &[u32], reason: &Finish) {
        let ids = match reason {
            Finish::Length | Finish::Grammar => ids,
            Finish::Eos(eos) => match ids.split_last() {
                Some((last, rest)) if last == eos => rest,
                _ => ids,
            },
            Finish::StopString(_) | Finish::StopToken(_) => return self.clear(),
        };
        self.text.push_str(text);
        self.ids.extend_from_slice(ids);
    }

    /// Forgets everything (a reset conversation, a stopped or failed reply):
    /// the next prompt is tokenized whole.
    pub fn clear(&mut self) {
        self.text.clear();
        self.ids.clear();
    }
}
