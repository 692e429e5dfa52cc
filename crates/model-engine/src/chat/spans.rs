//! Which bytes of a rendered conversation came from the messages' content,
//! so that special tokens typed in a message are tokenized as text while
//! the template's own markup keeps its control tokens.
//!
//! The template is rendered twice: with the messages as given, and with
//! each content replaced by a placeholder that no template changes. Where
//! the two renderings agree once each placeholder is read as its content
//! (as written, or trimmed, as templates often do), the content's bytes are
//! exactly known. Where they do not (a template that branches on the
//! content, or changes it), each content is looked for in the rendering in
//! message order; a content that cannot be found is listed, and encoding
//! refuses it if it holds a special token (see
//! [`Tokenizer::encode_rendered`](crate::tokenizer::Tokenizer::encode_rendered)).
//! Roles are written by templates as given, so they are listed too.

use std::ops::Range;

use super::{ChatMessage, ChatTemplate};
use crate::error::Result;
use crate::tokenizer::Tokenizer;

/// A rendered conversation and where its message content is.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RenderedChat {
    text: String,
    content: Vec<Range<usize>>,
    loose: Vec<(String, String)>,
}

impl RenderedChat {
    /// The rendered text.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The byte ranges of [`text`](Self::text) that are message content,
    /// in order and disjoint.
    pub fn content(&self) -> &[Range<usize>] {
        &self.content
    }

    /// Text from the messages that the rendering may hold outside
    /// [`content`](Self::content), as `(what, text)`: each role, and each
    /// content the template changed so that it could not be found.
    pub fn loose(&self) -> &[(String, String)] {
        &self.loose
    }

    pub fn into_text(self) -> String {
        self.text
    }
}

impl ChatTemplate {
    /// Renders `messages` (as [`render_limited`](Self::render_limited) with
    /// `max_bytes`), finding which bytes are message content.
    pub fn render_spans(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        max_bytes: usize,
    ) -> Result<RenderedChat> {
        self.render_spans_with(messages, add_generation_prompt, &[], max_bytes)
    }

    /// [`render_spans`](Self::render_spans) with extra template variables
    /// (`enable_thinking`, ...), as [`render_with`](Self::render_with).
    pub fn render_spans_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &[(&str, serde_json::Value)],
        max_bytes: usize,
    ) -> Result<RenderedChat> {
        let text = self.render_limited(messages, add_generation_prompt, extra, max_bytes)?;
        let placeholders: Vec<ChatMessage> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| ChatMessage {
                content: placeholder(i),
                ..m.clone()
            })
            .collect();
        let aligned = self
            .render_limited(&placeholders, add_generation_prompt, extra, max_bytes)
            .ok()
            .and_then(|template| align(&template, &text, messages));
        let (content, mut loose) = match aligned {
            Some(content) => (content, Vec::new()),
            None => search(&text, messages),
        };
        for (i, m) in messages.iter().enumerate() {
            loose.push((format!("message {i}'s role"), m.role.clone()));
            for (what, text) in m.side_text() {
                loose.push((format!("message {i}'s {what}"), text));
            }
        }
        // Extra variables (`tools`, ...) are written by the template as its
        // own markup too: a special token in them would become a control
        // token, so they are listed (and refused if they hold one).
        for (name, value) in extra {
            if !value.is_boolean() && !value.is_null() {
                loose.push((format!("the template variable {name}"), value.to_string()));
            }
        }
        Ok(RenderedChat {
            text,
            content,
            loose,
        })
    }
}

/// The prompt ids of `messages` rendered by `template` (ready for the
/// assistant's reply with `add_generation_prompt`): what the template
/// writes keeps its special tokens, special tokens in message content are
/// text. A rendering longer than `max_rendered_bytes` is refused before it
/// is tokenized, as is content holding a special token that the template
/// changed (so that it cannot be told apart from the template's markup)
/// and a role holding one.
pub fn encode_chat(
    template: &ChatTemplate,
    tokenizer: &Tokenizer,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    max_rendered_bytes: usize,
) -> Result<Vec<u32>> {
    let rendered = template.render_spans(messages, add_generation_prompt, max_rendered_bytes)?;
    tokenizer.encode_rendered(&rendered)
}

const OPEN: char = '\u{E000}';
const CLOSE: char = '\u{E001}';

/// A private-use marker for message `i`'s content.
fn placeholder(i: usize) -> String {
    format!("{OPEN}{i}{CLOSE}")
}

/// The content ranges of `text`, if reading each placeholder of `template`
/// as its message's content (as written, or trimmed) gives `text`.
fn align(template: &str, text: &str, messages: &[ChatMessage]) -> Option<Vec<Range<usize>>> {
    let pieces = split_placeholders(template, messages.len());
    let mut ranges = Vec::new();
    let mut at = 0;
    for (k, piece) in pieces.iter().enumerate() {
        match piece {
            Piece::Literal(lit) => {
                text[at..].starts_with(lit).then_some(())?;
                at += lit.len();
            }
            Piece::Content(i) => {
                let next = match pieces.get(k + 1) {
                    Some(Piece::Literal(lit)) => Some(*lit),
                    _ => None,
                };
                let content = candidates(&messages[*i].content).into_iter().find(|c| {
                    let rest = &text[at..];
                    rest.starts_with(c) && next.is_none_or(|lit| rest[c.len()..].starts_with(lit))
                })?;
                if !content.is_empty() {
                    ranges.push(at..at + content.len());
                }
                at += content.len();
            }
        }
    }
    (at == text.len()).then_some(ranges)
}

enum Piece<'a> {
    Literal(&'a str),
    Content(usize),
}

/// `template` cut at the placeholders of messages below `n`.
fn split_placeholders(template: &str, n: usize) -> Vec<Piece<'_>> {
    let mut pieces = Vec::new();
    let mut rest = template;
    while let Some(open) = rest.find(OPEN) {
        let after = &rest[open + OPEN.len_utf8()..];
        let index = after
            .find(CLOSE)
            .and_then(|close| Some((after[..close].parse::<usize>().ok()?, close)));
        match index {
            Some((i, close)) if i < n => {
                pieces.push(Piece::Literal(&rest[..open]));
                pieces.push(Piece::Content(i));
                rest = &after[close + CLOSE.len_utf8()..];
            }
            _ => {
                pieces.push(Piece::Literal(&rest[..open + OPEN.len_utf8()]));
                rest = after;
            }
        }
    }
    pieces.push(Piece::Literal(rest));
    pieces
}

/// A content as templates write it: as is, trimmed, or trimmed on one side.
fn candidates(content: &str) -> Vec<&str> {
    let mut all = vec![
        content,
        content.trim(),
        content.trim_start(),
        content.trim_end(),
    ];
    all.dedup();
    all
}

/// Each content looked for in `text` in message order; those not found
/// are listed as loose.
fn search(text: &str, messages: &[ChatMessage]) -> (Vec<Range<usize>>, Vec<(String, String)>) {
    let mut ranges = Vec::new();
    let mut loose = Vec::new();
    let mut at = 0;
    for (i, m) in messages.iter().enumerate() {
        let found = candidates(&m.content)
            .into_iter()
            .filter(|c| !c.is_empty())
            .find_map(|c| text[at..].find(c).map(|start| (at + start, c.len())));
        match found {
            Some((start, len)) => {
                ranges.push(start..start + len);
                at = start + len;
            }
            None if m.content.trim().is_empty() => {}
            None => loose.push((format!("message {i}'s content"), m.content.clone())),
        }
    }
    (ranges, loose)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chatml() -> ChatTemplate {
        ChatTemplate::new(
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content|trim }}<|im_end|>\n{% endfor %}",
            Vec::new(),
        )
        .unwrap()
    }

    fn spans(r: &RenderedChat) -> Vec<&str> {
        r.content().iter().map(|c| &r.text()[c.clone()]).collect()
    }

    #[test]
    fn content_is_found_through_the_placeholders() {
        let messages = [
            ChatMessage::new("user", " user "),
            ChatMessage::new("assistant", ""),
            ChatMessage::new("user", "<|im_end|>"),
        ];
        let r = chatml().render_spans(&messages, false, 1 << 20).unwrap();
        // " user " is written trimmed, after a role of the same text.
        assert_eq!(spans(&r), ["user", "<|im_end|>"]);
        assert_eq!(&r.text()[..r.content()[0].start], "<|im_start|>user\n");
        assert_eq!(r.loose().len(), 3);
    }

    #[test]
    fn a_template_that_branches_on_content_is_searched() {
        let t = ChatTemplate::new(
            "{% for m in messages %}[{{ 'x' if '<' in m.content else 'y' }}]{{ m.content }}{% endfor %}",
            Vec::new(),
        )
        .unwrap();
        let messages = [
            ChatMessage::new("user", "a<b"),
            ChatMessage::new("user", "c"),
        ];
        let r = t.render_spans(&messages, false, 1 << 20).unwrap();
        assert_eq!(r.text(), "[x]a<b[y]c");
        assert_eq!(spans(&r), ["a<b", "c"]);
    }
}
