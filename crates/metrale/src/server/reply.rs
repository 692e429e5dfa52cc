//! A chat reply read for what it holds beside its answer: the model's
//! reasoning (`<think>…</think>`) and its tool calls.
//!
//! Reasoning is split out where the chat template speaks of it (its source
//! holds `<think>` or `reasoning_content`) and the request did not turn
//! thinking off (`chat_template_kwargs: {"enable_thinking": false}`).
//! A reply is in its reasoning from the start where the rendered prompt
//! ends inside an open `<think>` (Qwen3 and Qwen3.5 templates open it in
//! the generation prompt), or from a `<think>` it opens with; the
//! reasoning ends at `</think>`. Whitespace right after `<think>` and after
//! `</think>` belongs to neither part (the templates write newlines
//! there). A reply that never closes its reasoning is all reasoning.
//!
//! The text after the reasoning is read for calls by
//! [`ToolCallStream`] when the request's tools are parsed. Streamed and
//! whole replies go through the same state machine, so a streamed reply
//! joined says what the whole one does.

use serde_json::Value;

use crate::engine::chat::tools::{StreamEvent, ToolCallFormat, ToolCallStream};

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// What to read a reply for.
#[derive(Clone, Debug, Default)]
pub struct Shape {
    /// Split reasoning out; `Some(true)`: the prompt opened it.
    pub reasoning: Option<bool>,
    /// Read calls in this format, with these tool definitions.
    pub tools: Option<(ToolCallFormat, Vec<Value>)>,
}

impl Shape {
    /// Whether the reply is read at all (else its text is the content).
    pub fn reads(&self) -> bool {
        self.reasoning.is_some() || self.tools.is_some()
    }
}

/// Whether the template speaks of reasoning.
pub fn template_reasons(source: &str) -> bool {
    source.contains(OPEN) || source.contains("reasoning_content")
}

/// Whether `prompt` (rendered) ends inside an open `<think>`.
pub fn prompt_opens_reasoning(prompt: &str) -> bool {
    prompt
        .rfind(OPEN)
        .is_some_and(|at| !prompt[at..].contains(CLOSE))
}

/// A piece of a reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
    /// Call `index` begins: its name.
    CallStart {
        index: usize,
        name: String,
    },
    /// A piece of call `index`'s arguments text.
    Args {
        index: usize,
        text: String,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    /// Not yet known whether the reply opens with `<think>`.
    Before,
    /// In the reasoning; `lead`: whitespace is still dropped.
    Reasoning { lead: bool },
    /// After it (or without any).
    Content { lead: bool },
}

/// Splits a reply arriving in pieces.
pub struct ReplyStream {
    part: Part,
    buf: String,
    calls: Option<ToolCallStream>,
    reasoning: bool,
}

impl ReplyStream {
    pub fn new(shape: &Shape) -> Self {
        let part = match shape.reasoning {
            Some(true) => Part::Reasoning { lead: true },
            Some(false) => Part::Before,
            None => Part::Content { lead: false },
        };
        Self {
            part,
            buf: String::new(),
            calls: (shape.tools.clone()).map(|(f, tools)| ToolCallStream::new(f, tools)),
            reasoning: shape.reasoning.is_some(),
        }
    }

    /// Whether reasoning is split out of this reply.
    pub fn splits_reasoning(&self) -> bool {
        self.reasoning
    }

    pub fn push(&mut self, delta: &str) -> Vec<Piece> {
        self.buf.push_str(delta);
        let mut out = Vec::new();
        self.drain(&mut out, false);
        out
    }

    /// The reply has ended: what was held back.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        self.drain(&mut out, true);
        if let Some(calls) = &mut self.calls {
            let events = calls.finish();
            out.extend(events.into_iter().map(piece));
        }
        out
    }

    fn drain(&mut self, out: &mut Vec<Piece>, end: bool) {
        loop {
            match self.part {
                Part::Before => {
                    let t = self.buf.trim_start();
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.buf = rest.to_owned();
                        self.part = Part::Reasoning { lead: true };
                    } else if !end && OPEN.starts_with(t) {
                        return;
                    } else {
                        self.part = Part::Content { lead: false };
                    }
                }
                Part::Reasoning { lead } => {
                    if lead {
                        self.buf = self.buf.trim_start().to_owned();
                        if self.buf.is_empty() {
                            return;
                        }
                        self.part = Part::Reasoning { lead: false };
                    }
                    if let Some(at) = self.buf.find(CLOSE) {
                        let text: String = self.buf.drain(..at).collect();
                        self.buf.drain(..CLOSE.len());
                        reasoning(out, text);
                        self.part = Part::Content { lead: true };
                        continue;
                    }
                    let keep = if end { 0 } else { partial(&self.buf, CLOSE) };
                    let text: String = self.buf.drain(..self.buf.len() - keep).collect();
                    reasoning(out, text);
                    return;
                }
                Part::Content { lead } => {
                    if lead {
                        self.buf = self.buf.trim_start().to_owned();
                        if self.buf.is_empty() {
                            return;
                        }
                        self.part = Part::Content { lead: false };
                    }
                    let text = std::mem::take(&mut self.buf);
                    if text.is_empty() {
                        return;
                    }
                    match &mut self.calls {
                        Some(calls) => out.extend(calls.push(&text).into_iter().map(piece)),
                        None => out.push(Piece::Content(text)),
                    }
                    return;
                }
            }
        }
    }
}

fn reasoning(out: &mut Vec<Piece>, text: String) {
    if !text.is_empty() {
        out.push(Piece::Reasoning(text));
    }
}

fn piece(e: StreamEvent) -> Piece {
    match e {
        StreamEvent::Content(t) => Piece::Content(t),
        StreamEvent::CallStart { index, name } => Piece::CallStart { index, name },
        StreamEvent::ArgsDelta { index, text } => Piece::Args { index, text },
    }
}

/// How many bytes at the end of `text` are a proper prefix of `marker`
/// (ASCII, so the cut is a character boundary).
fn partial(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&k| text.as_bytes().ends_with(&marker.as_bytes()[..k]))
        .unwrap_or(0)
}

/// A whole reply, read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reply {
    pub reasoning: Option<String>,
    pub content: String,
    /// `(name, arguments)`.
    pub calls: Vec<(String, String)>,
}

/// Reads a whole reply (the same machine as a stream, fed at once).
pub fn whole(shape: &Shape, text: &str) -> Reply {
    let mut s = ReplyStream::new(shape);
    let mut pieces = s.push(text);
    pieces.extend(s.finish());
    let mut reply = Reply::default();
    for p in pieces {
        match p {
            Piece::Reasoning(t) => reply.reasoning.get_or_insert_default().push_str(&t),
            Piece::Content(t) => reply.content.push_str(&t),
            Piece::CallStart { name, .. } => reply.calls.push((name, String::new())),
            Piece::Args { text, .. } => {
                if let Some(last) = reply.calls.last_mut() {
                    last.1.push_str(&text);
                }
            }
        }
    }
    if !reply.calls.is_empty() {
        reply.content = reply.content.trim().to_owned();
    }
    reply
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn shape(open: Option<bool>, tools: bool) -> Shape {
        Shape {
            reasoning: open,
            tools: tools.then(|| {
                (
                    ToolCallFormat::Qwen3Xml,
                    vec![json!({"type": "function",
                "function": {"name": "f", "parameters": {"type": "object",
                "properties": {"x": {"type": "integer"}}}}})],
                )
            }),
        }
    }

    /// Every split of `text` into two deltas reads as the whole does.
    fn streamed_equals_whole(shape: &Shape, text: &str) -> Reply {
        let w = whole(shape, text);
        for cut in (0..=text.len()).filter(|&c| text.is_char_boundary(c)) {
            let mut s = ReplyStream::new(shape);
            let mut pieces = s.push(&text[..cut]);
            pieces.extend(s.push(&text[cut..]));
            pieces.extend(s.finish());
            let mut r = Reply::default();
            for p in pieces {
                match p {
                    Piece::Reasoning(t) => r.reasoning.get_or_insert_default().push_str(&t),
                    Piece::Content(t) => r.content.push_str(&t),
                    Piece::CallStart { name, .. } => r.calls.push((name, String::new())),
                    Piece::Args { text, .. } => r.calls.last_mut().unwrap().1.push_str(&text),
                }
            }
            if !r.calls.is_empty() {
                r.content = r.content.trim().to_owned();
            }
            assert_eq!(r, w, "cut at {cut} of {text:?}");
        }
        w
    }

    #[test]
    fn reasoning_is_split_out() {
        let r = streamed_equals_whole(&shape(Some(true), false), "\nhmm</think>\n\nhi");
        assert_eq!(r.reasoning.as_deref(), Some("hmm"));
        assert_eq!(r.content, "hi");
        let r = streamed_equals_whole(&shape(Some(false), false), " <think>\nso</think>yes");
        assert_eq!(
            (r.reasoning.as_deref(), r.content.as_str()),
            (Some("so"), "yes")
        );
        let r = streamed_equals_whole(&shape(Some(false), false), "<thin");
        assert_eq!((r.reasoning, r.content.as_str()), (None, "<thin"));
        let r = streamed_equals_whole(&shape(Some(true), false), "never closed </thi");
        assert_eq!(r.reasoning.as_deref(), Some("never closed </thi"));
        let r = streamed_equals_whole(&shape(None, false), "<think>a</think>b");
        assert_eq!(
            (r.reasoning, r.content.as_str()),
            (None, "<think>a</think>b")
        );
    }

    #[test]
    fn calls_after_reasoning() {
        let text = "plan</think>\n\n<tool_call>\n<function=f>\n<parameter=x>\n3\n</parameter>\n\
                    </function>\n</tool_call>";
        let r = streamed_equals_whole(&shape(Some(true), true), text);
        assert_eq!(r.reasoning.as_deref(), Some("plan"));
        assert_eq!(r.calls, [("f".to_string(), "{\"x\":3}".to_string())]);
        assert_eq!(r.content, "");
    }

    #[test]
    fn prompts_that_open_reasoning() {
        assert!(prompt_opens_reasoning("<|im_start|>assistant\n<think>\n"));
        assert!(!prompt_opens_reasoning(
            "assistant\n<think>\n\n</think>\n\n"
        ));
        assert!(!prompt_opens_reasoning("<|im_start|>assistant\n"));
    }
}
