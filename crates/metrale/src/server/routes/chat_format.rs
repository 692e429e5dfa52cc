//! The JSON shapes of `/v1/chat/completions`: the response's `message` and
//! the stream's `delta`s, with the reply's reasoning and tool calls split
//! out where the request asks for them ([`reply`](crate::server::reply)).
//!
//! A reply with calls has `message.tool_calls: [{id, type: "function",
//! function: {name, arguments}}]`, `content` null where no text is left,
//! and `finish_reason: "tool_calls"` (unless it ran out of tokens:
//! `length`). Streamed, a call comes as OpenAI streams it: a first
//! `delta.tool_calls: [{index, id, type, function: {name, arguments: ""}}]`,
//! then `[{index, function: {arguments}}]` pieces.

use std::sync::Mutex;

use serde_json::{Value, json};

use crate::Finish;
use crate::server::openai::{UsageInfo, finish_reason};
use crate::server::reply::{Piece, ReplyStream, Shape, whole};
use crate::server::sse::{Choice, Format, TokenLogprob};

pub(super) struct Chat {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub include_usage: bool,
    pub shape: Shape,
    /// Each choice's reply being read, and its calls' ids (streamed).
    pub choices: Mutex<Vec<(ReplyStream, Vec<String>)>>,
}

impl Chat {
    pub fn new(id: String, created: u64, model: String, include_usage: bool) -> Self {
        Self {
            id,
            created,
            model,
            include_usage,
            shape: Shape::default(),
            choices: Mutex::new(Vec::new()),
        }
    }

    /// Reads replies for `shape`, over `n` choices.
    pub fn reading(mut self, shape: Shape, n: usize) -> Self {
        self.choices = Mutex::new((0..n).map(|_| (ReplyStream::new(&shape), vec![])).collect());
        self.shape = shape;
        self
    }

    fn chunk(&self, choices: Value) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    fn delta_chunk(&self, index: usize, delta: Value, lp: Value) -> Value {
        self.chunk(json!([{
            "index": index,
            "delta": delta,
            "logprobs": lp,
            "finish_reason": null,
        }]))
    }

    /// The chunks of pieces of choice `index`; its calls' ids kept in `ids`.
    fn piece_chunks(
        &self,
        index: usize,
        pieces: Vec<Piece>,
        ids: &mut Vec<String>,
        mut lp: Value,
    ) -> Vec<Value> {
        let mut out = Vec::new();
        for p in pieces {
            let delta = match p {
                Piece::Reasoning(t) => json!({"reasoning_content": t}),
                Piece::Content(t) => json!({"content": t}),
                Piece::CallStart { index: i, name } => {
                    let id = call_id();
                    ids.push(id.clone());
                    json!({"tool_calls": [{"index": i, "id": id, "type": "function",
                        "function": {"name": name, "arguments": ""}}]})
                }
                Piece::Args { index: i, text } => {
                    json!({"tool_calls": [{"index": i, "function": {"arguments": text}}]})
                }
            };
            out.push(self.delta_chunk(index, delta, std::mem::take(&mut lp)));
        }
        if !lp.is_null() {
            out.push(self.delta_chunk(index, json!({}), lp));
        }
        out
    }
}

/// A call's id: `call_` and 24 characters no other call of this server
/// shares.
fn call_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("call_{nanos:08x}{:016x}", crate::server::next_id())
}

fn logprobs_json(lps: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = lps
        .iter()
        .map(|l| {
            json!({
                "token": l.text,
                "logprob": l.logprob,
                "bytes": l.bytes,
                "top_logprobs": l.top.iter().map(|t| json!({
                    "token": t.text,
                    "logprob": t.logprob,
                    "bytes": t.bytes,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({ "content": content })
}

/// `finish_reason` of a reply that made `calls` calls.
fn reason(finish: &Finish, calls: usize) -> &'static str {
    match finish {
        Finish::Length => "length",
        _ if calls > 0 => "tool_calls",
        other => finish_reason(other),
    }
}

impl Format for Chat {
    fn opening(&self, choices: usize) -> Vec<Value> {
        (0..choices)
            .map(|index| {
                self.chunk(json!([{
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": null,
                    "finish_reason": null,
                }]))
            })
            .collect()
    }

    fn delta(&self, index: usize, text: &str, logprob: Option<&TokenLogprob>) -> Value {
        let lp = logprob.map_or(Value::Null, |l| logprobs_json(std::slice::from_ref(l)));
        self.delta_chunk(index, json!({"content": text}), lp)
    }

    fn deltas(&self, index: usize, text: &str, logprob: Option<&TokenLogprob>) -> Vec<Value> {
        if !self.shape.reads() {
            return vec![self.delta(index, text, logprob)];
        }
        let lp = logprob.map_or(Value::Null, |l| logprobs_json(std::slice::from_ref(l)));
        let mut choices = self.choices.lock().unwrap_or_else(|e| e.into_inner());
        let Some((stream, ids)) = choices.get_mut(index) else {
            return vec![self.delta(index, text, logprob)];
        };
        let pieces = stream.push(text);
        self.piece_chunks(index, pieces, ids, lp)
    }

    fn flush(&self, index: usize) -> Vec<Value> {
        let mut choices = self.choices.lock().unwrap_or_else(|e| e.into_inner());
        match choices.get_mut(index) {
            Some((stream, ids)) => {
                let pieces = stream.finish();
                self.piece_chunks(index, pieces, ids, Value::Null)
            }
            None => Vec::new(),
        }
    }

    fn finish(&self, index: usize, finish: &Finish) -> Value {
        let calls = {
            let choices = self.choices.lock().unwrap_or_else(|e| e.into_inner());
            choices.get(index).map_or(0, |(_, ids)| ids.len())
        };
        self.chunk(json!([{
            "index": index,
            "delta": {},
            "logprobs": null,
            "finish_reason": reason(finish, calls),
        }]))
    }

    fn usage(&self, usage: &UsageInfo) -> Value {
        let mut v = self.chunk(json!([]));
        v["usage"] = json!(usage);
        v
    }

    fn response(&self, choices: Vec<Choice>, usage: &UsageInfo) -> Value {
        let choices: Vec<Value> = choices
            .into_iter()
            .enumerate()
            .map(|(index, c)| {
                let lp = if c.logprobs.is_empty() {
                    Value::Null
                } else {
                    logprobs_json(&c.logprobs)
                };
                let mut message = json!({"role": "assistant", "content": c.text});
                let mut calls = 0;
                if self.shape.reads() {
                    let reply = whole(&self.shape, &c.text);
                    calls = reply.calls.len();
                    let empty =
                        reply.content.is_empty() && (calls > 0 || reply.reasoning.is_some());
                    message["content"] = if empty {
                        Value::Null
                    } else {
                        json!(reply.content)
                    };
                    if self.shape.reasoning.is_some() {
                        message["reasoning_content"] = json!(reply.reasoning);
                    }
                    if calls > 0 {
                        let list: Vec<Value> = (reply.calls.into_iter())
                            .map(|(name, arguments)| {
                                json!({"id": call_id(), "type": "function",
                                    "function": {"name": name, "arguments": arguments}})
                            })
                            .collect();
                        message["tool_calls"] = json!(list);
                    }
                }
                json!({
                    "index": index,
                    "message": message,
                    "logprobs": lp,
                    "finish_reason": c.finish.as_ref().map(|f| reason(f, calls)),
                })
            })
            .collect();
        json!({
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        })
    }
}
