//! Tool calls in a reply that arrives in pieces.

use serde_json::Value;

use super::{
    Body, Marker, ToolCallFormat, find_start, first_non_whitespace, parse_body, partial_start,
};

/// What a streamed reply turned out to hold, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StreamEvent {
    /// Text outside calls.
    Content(String),
    /// Call `index` (counted from 0 over the reply) begins; its name.
    CallStart { index: usize, name: String },
    /// A piece of call `index`'s arguments text; a call's pieces joined are
    /// its whole arguments (here always one piece, after its `CallStart`).
    ArgsDelta { index: usize, text: String },
}

#[derive(Clone, Copy, Debug)]
enum State {
    /// Outside calls; the buffer holds text that may open a call.
    Text,
    /// Inside a call opened by `markers[i]` (`None`: Llama 3's leading `{`);
    /// the buffer holds the call from its start marker on.
    Call(Option<usize>),
}

/// [`parse`](super::parse) for a reply fed as text deltas.
///
/// Text outside calls comes out as soon as it is known not to open a call:
/// only an ending that could be the start of a start marker (`<tool_c`) is
/// held back. A call is held from its start marker to its end marker (to
/// the end of the reply for formats without one), then comes out as
/// [`StreamEvent::CallStart`] and one [`StreamEvent::ArgsDelta`], or as
/// text if it is malformed. Joined, the events say what `parse` says of the
/// whole reply: the same calls, and the same content but for whitespace at
/// its ends (which `parse` trims where there are calls).
#[derive(Debug)]
pub struct ToolCallStream {
    format: ToolCallFormat,
    tools: Vec<Value>,
    buf: String,
    state: State,
    /// In a call with an end marker: how much of `buf` is known not to hold
    /// the start of the end marker.
    scanned: usize,
    /// Llama 3: nothing but whitespace has come yet.
    at_start: bool,
    next_index: usize,
    finished: bool,
}

impl ToolCallStream {
    /// A stream for one reply; `tools` are the request's OpenAI tool
    /// definitions (the Qwen3Xml format types its parameters by them).
    pub fn new(format: ToolCallFormat, tools: Vec<Value>) -> Self {
        Self {
            format,
            tools,
            buf: String::new(),
            state: State::Text,
            scanned: 0,
            at_start: format.opens_with_json(),
            next_index: 0,
            finished: false,
        }
    }

    /// The next piece of the reply; the events it completes.
    pub fn push(&mut self, delta: &str) -> Vec<StreamEvent> {
        let mut events = Vec::new();
        if self.finished {
            // Text after the end: never held, never parsed as a call.
            if !delta.is_empty() {
                events.push(StreamEvent::Content(delta.to_string()));
            }
            return events;
        }
        self.buf.push_str(delta);
        self.drain(&mut events, false);
        events
    }

    /// The reply has ended: what was held back comes out, a call still
    /// open is parsed (formats without an end marker) or comes out as text.
    pub fn finish(&mut self) -> Vec<StreamEvent> {
        let mut events = Vec::new();
        if !self.finished {
            self.drain(&mut events, true);
            self.finished = true;
        }
        events
    }

    /// The number of calls that have come out so far.
    pub fn calls_emitted(&self) -> usize {
        self.next_index
    }

    fn markers(&self) -> &'static [Marker] {
        self.format.markers()
    }

    fn content(events: &mut Vec<StreamEvent>, text: &str) {
        if text.is_empty() {
            return;
        }
        if let Some(StreamEvent::Content(last)) = events.last_mut() {
            last.push_str(text);
        } else {
            events.push(StreamEvent::Content(text.to_string()));
        }
    }

    /// Emits the first `n` bytes of the buffer as text.
    fn emit_text(&mut self, events: &mut Vec<StreamEvent>, n: usize) {
        Self::content(events, &self.buf[..n]);
        self.buf.drain(..n);
    }

    /// Emits the call `raw` (the whole call as written) with body `body`:
    /// its calls, or `raw` as text when malformed.
    fn emit_call(
        &mut self,
        events: &mut Vec<StreamEvent>,
        kind: Body,
        raw: &str,
        body: Option<&str>,
    ) {
        match body.and_then(|b| parse_body(kind, b, &self.tools)) {
            Some(calls) => {
                for call in calls {
                    let index = self.next_index;
                    self.next_index += 1;
                    events.push(StreamEvent::CallStart {
                        index,
                        name: call.name,
                    });
                    events.push(StreamEvent::ArgsDelta {
                        index,
                        text: call.arguments,
                    });
                }
            }
            None => Self::content(events, raw),
        }
    }

    fn drain(&mut self, events: &mut Vec<StreamEvent>, eos: bool) {
        loop {
            match self.state {
                State::Text => {
                    if self.at_start {
                        let Some(f) = first_non_whitespace(&self.buf) else {
                            if eos {
                                let n = self.buf.len();
                                self.emit_text(events, n);
                            }
                            return;
                        };
                        self.at_start = false;
                        if self.buf[f..].starts_with('{') {
                            self.emit_text(events, f);
                            self.state = State::Call(None);
                            continue;
                        }
                    }
                    let full = find_start(self.markers(), &self.buf);
                    let partial = if eos {
                        None
                    } else {
                        partial_start(self.markers(), &self.buf)
                    };
                    match (full, partial) {
                        (Some((at, m)), p) if p.is_none_or(|p| at < p) => {
                            self.emit_text(events, at);
                            self.state = State::Call(Some(m));
                            self.scanned = self.markers()[m].start.len();
                        }
                        (_, Some(p)) => {
                            self.emit_text(events, p);
                            return;
                        }
                        _ => {
                            let n = self.buf.len();
                            self.emit_text(events, n);
                            return;
                        }
                    }
                }
                State::Call(None) => {
                    if eos {
                        let raw = std::mem::take(&mut self.buf);
                        self.emit_call(events, Body::Json, &raw, Some(&raw));
                    }
                    return;
                }
                State::Call(Some(m)) => {
                    let marker = self.markers()[m];
                    let start = marker.start.len();
                    let Some(end) = marker.end else {
                        if eos {
                            let raw = std::mem::take(&mut self.buf);
                            self.emit_call(events, marker.body, &raw, raw.get(start..));
                        }
                        return;
                    };
                    match self.buf[self.scanned..].find(end) {
                        Some(e) => {
                            let body_end = self.scanned + e;
                            let rest = self.buf.split_off(body_end + end.len());
                            let raw = std::mem::replace(&mut self.buf, rest);
                            self.emit_call(events, marker.body, &raw, raw.get(start..body_end));
                            self.state = State::Text;
                        }
                        None if eos => {
                            let raw = std::mem::take(&mut self.buf);
                            let body = marker.end_optional.then(|| raw.get(start..)).flatten();
                            self.emit_call(events, marker.body, &raw, body);
                            return;
                        }
                        None => {
                            // The end marker may begin in the last bytes.
                            let mut keep = self.buf.len().saturating_sub(end.len() - 1).max(start);
                            while !self.buf.is_char_boundary(keep) {
                                keep -= 1;
                            }
                            self.scanned = keep.max(start);
                            return;
                        }
                    }
                }
            }
        }
    }
}
