//! Turning a request's engine events into a response: collected into one
//! JSON body, or streamed as server-sent events (`data: {chunk}\n\n` ...
//! `data: [DONE]\n\n`) in the shape a [`Format`] gives.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use crate::engine::tokenizer::{Tokenizer, byte_level_byte, fallback_byte};
use crate::{Finish, StreamEvent};
use axum::response::sse::{Event, Sse};
use futures_util::Stream;
use serde_json::Value;

use crate::server::error::ApiError;
use crate::server::openai::UsageInfo;
use crate::server::state::Submitted;

/// One generated token with its log-probability under the model (the
/// log-softmax of the raw logits) and, when asked, the most likely tokens
/// at its position with theirs.
#[derive(Clone, Debug)]
pub struct TokenLogprob {
    pub token: u32,
    /// The token on its own, decoded with special tokens kept (U+FFFD where
    /// it holds only part of a UTF-8 character).
    pub text: String,
    /// The token's own bytes ([`token_bytes`]): what `text` cannot show of
    /// a partial UTF-8 character.
    pub bytes: Vec<u8>,
    pub logprob: f32,
    /// A prompt token's rank among the vocabulary (1: the most likely).
    pub rank: Option<u32>,
    /// The most likely tokens, best first.
    pub top: Vec<TopLogprob>,
}

/// One of the most likely tokens at a position.
#[derive(Clone, Debug)]
pub struct TopLogprob {
    pub token: u32,
    pub text: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
}

/// The bytes token `id` stands for. Its decoded text's bytes, unless the
/// text holds U+FFFD (the token is part of a UTF-8 character, or a byte
/// that is not UTF-8 alone): then the vocabulary entry's bytes, read
/// through byte-level BPE's byte-to-character table (`Ġ` is a space) or as
/// a byte-fallback `<0xNN>`. Concatenated over a reply, the bytes of its
/// tokens are the reply's UTF-8.
pub fn token_bytes(tokenizer: &Tokenizer, id: u32, text: &str) -> Vec<u8> {
    if !text.contains('\u{FFFD}') {
        return text.as_bytes().to_vec();
    }
    let Some(raw) = tokenizer.id_to_token(id) else {
        return text.as_bytes().to_vec();
    };
    if let Some(b) = fallback_byte(&raw) {
        return vec![b];
    }
    raw.chars()
        .map(byte_level_byte)
        .collect::<Option<Vec<u8>>>()
        .unwrap_or_else(|| text.as_bytes().to_vec())
}

/// `token`'s log-probability with its text and bytes, and its
/// alternatives'.
pub fn token_logprob(
    tokenizer: &Tokenizer,
    token: u32,
    logprob: f32,
    top: &[(u32, f32)],
) -> TokenLogprob {
    let text = |id: u32| tokenizer.token_text(id).unwrap_or_default();
    let main = text(token);
    TokenLogprob {
        token,
        bytes: token_bytes(tokenizer, token, &main),
        text: main,
        logprob,
        rank: None,
        top: top
            .iter()
            .map(|&(id, logprob)| {
                let text = text(id);
                TopLogprob {
                    token: id,
                    bytes: token_bytes(tokenizer, id, &text),
                    text,
                    logprob,
                }
            })
            .collect(),
    }
}

/// A finished choice.
#[derive(Clone, Debug, Default)]
pub struct Choice {
    pub text: String,
    /// Filled only when log-probabilities were asked for.
    pub logprobs: Vec<TokenLogprob>,
    /// The prompt's tokens from the second on, scored (completions' echo).
    pub prompt_logprobs: Vec<TokenLogprob>,
    pub finish: Option<Finish>,
}

/// The JSON shapes of one route.
pub trait Format: Send + Sync + 'static {
    /// Chunks sent before any token (chat's role deltas).
    fn opening(&self, _choices: usize) -> Vec<Value> {
        Vec::new()
    }
    /// A chunk carrying `text` (and the token's logprob, when asked) of a choice.
    fn delta(&self, index: usize, text: &str, logprob: Option<&TokenLogprob>) -> Value;
    /// The chunks a piece of text makes: [`delta`](Self::delta)'s one,
    /// unless the route reads the text as it comes (chat's reasoning and
    /// tool calls), when a piece may make several or none.
    fn deltas(&self, index: usize, text: &str, logprob: Option<&TokenLogprob>) -> Vec<Value> {
        vec![self.delta(index, text, logprob)]
    }
    /// The chunks of what a choice's reader held back, sent before its
    /// [`finish`](Self::finish).
    fn flush(&self, _index: usize) -> Vec<Value> {
        Vec::new()
    }
    /// The chunk that repeats a choice's prompt before anything else of it
    /// (completions' `echo`), with `prompt`'s log-probabilities (its tokens
    /// from the second on; empty unless asked); `None` where nothing is
    /// echoed.
    fn echo(&self, _index: usize, _prompt: &[TokenLogprob]) -> Option<Value> {
        None
    }
    /// The last chunk of a choice.
    fn finish(&self, index: usize, reason: &Finish) -> Value;
    /// The chunk with the usage (`stream_options.include_usage`).
    fn usage(&self, usage: &UsageInfo) -> Value;
    /// The whole non-streamed response.
    fn response(&self, choices: Vec<Choice>, usage: &UsageInfo) -> Value;
}

/// What the events of a request are read with.
pub struct Events {
    /// The choices' events, and their cancellation when dropped.
    pub submitted: Submitted,
    /// Choices in all.
    pub choices: usize,
    /// Choices per prompt (`n`): the prompt's tokens are counted once.
    pub n: usize,
    /// Whether to report log-probabilities.
    pub logprobs: bool,
    pub tokenizer: Tokenizer,
}

impl Events {
    fn logprob(&self, token: u32, logprob: f32, top: &[(u32, f32)]) -> Option<TokenLogprob> {
        self.logprobs
            .then(|| token_logprob(&self.tokenizer, token, logprob, top))
    }

    /// Choice `index` has ended: dropping the events no longer cancels it.
    fn ended(&mut self, index: usize) {
        if let Some(cancel) = self.submitted.cancels.get_mut(index) {
            cancel.disarm();
        }
    }

    /// Reads every choice to its end.
    pub async fn collect(mut self, format: &dyn Format) -> Result<Value, ApiError> {
        let mut choices = vec![Choice::default(); self.choices];
        let mut usage = UsageInfo::default();
        let mut left = self.choices;
        while left > 0 {
            let Some((index, event)) = self.submitted.recv().await else {
                return Err(ApiError::Internal("the engine stopped".into()));
            };
            match event.map_err(|e| ApiError::Internal(format!("{e:#}")))? {
                StreamEvent::Token {
                    token,
                    text,
                    logprob,
                    top_logprobs,
                } => {
                    let lp = self.logprob(token, logprob, &top_logprobs);
                    let choice = &mut choices[index];
                    choice.text.push_str(&text);
                    choice.logprobs.extend(lp);
                }
                StreamEvent::PromptLogprobs { logprobs, .. } => {
                    let tokenizer = &self.tokenizer;
                    choices[index]
                        .prompt_logprobs
                        .extend(logprobs.iter().map(|p| {
                            let mut lp =
                                token_logprob(tokenizer, p.token, p.logprob, &p.top_logprobs);
                            lp.rank = Some(p.rank);
                            lp
                        }));
                }
                StreamEvent::Finished {
                    reason, usage: u, ..
                } => {
                    add_usage(&mut usage, &u, index, self.n);
                    self.ended(index);
                    choices[index].finish = Some(reason);
                    left -= 1;
                }
            }
        }
        Ok(format.response(choices, &usage))
    }

    /// Streams the choices as server-sent events. Dropping the stream (the
    /// client went away) drops the receiver, which cancels the requests.
    pub fn stream(
        self,
        format: Arc<dyn Format>,
        include_usage: bool,
    ) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
        let pending: VecDeque<Event> = format.opening(self.choices).iter().map(data).collect();
        let state = StreamState {
            prompts: vec![Some(Vec::new()); self.choices],
            events: self,
            format,
            include_usage,
            usage: UsageInfo::default(),
            pending,
            done: false,
        };
        let left = state.events.choices;
        Sse::new(futures_util::stream::unfold(
            (state, left),
            |(mut state, mut left)| async move {
                loop {
                    if let Some(event) = state.pending.pop_front() {
                        return Some((Ok(event), (state, left)));
                    }
                    if state.done {
                        return None;
                    }
                    if left == 0 {
                        if state.include_usage {
                            let chunk = state.format.usage(&state.usage);
                            state.pending.push_back(data(&chunk));
                        }
                        state.pending.push_back(Event::default().data("[DONE]"));
                        state.done = true;
                        continue;
                    }
                    let Some((index, event)) = state.events.submitted.recv().await else {
                        let e = ApiError::Internal("the engine stopped".into());
                        state.pending.push_back(data(&e.body()));
                        state.done = true;
                        continue;
                    };
                    if matches!(
                        event,
                        Ok(StreamEvent::Token { .. } | StreamEvent::Finished { .. })
                    ) {
                        state.echo(index);
                    }
                    match event {
                        Ok(StreamEvent::Token {
                            token,
                            text,
                            logprob,
                            top_logprobs,
                        }) => {
                            let lp = state.events.logprob(token, logprob, &top_logprobs);
                            if !text.is_empty() || lp.is_some() {
                                for chunk in state.format.deltas(index, &text, lp.as_ref()) {
                                    state.pending.push_back(data(&chunk));
                                }
                            }
                        }
                        // Asked for by completions' echo.
                        Ok(StreamEvent::PromptLogprobs { logprobs, .. }) => {
                            let lps = logprobs.iter().filter_map(|p| {
                                state.events.logprob(p.token, p.logprob, &p.top_logprobs)
                            });
                            let lps: Vec<TokenLogprob> = lps.collect();
                            if let Some(Some(prompt)) = state.prompts.get_mut(index) {
                                prompt.extend(lps);
                            }
                        }
                        Ok(StreamEvent::Finished { reason, usage, .. }) => {
                            add_usage(&mut state.usage, &usage, index, state.events.n);
                            state.events.ended(index);
                            for chunk in state.format.flush(index) {
                                state.pending.push_back(data(&chunk));
                            }
                            let chunk = state.format.finish(index, &reason);
                            state.pending.push_back(data(&chunk));
                            left -= 1;
                        }
                        Err(e) => {
                            // OpenAI-shaped, then the stream ends (no [DONE]).
                            let e = ApiError::Internal(format!("{e:#}"));
                            state.pending.push_back(data(&e.body()));
                            state.done = true;
                        }
                    }
                }
            },
        ))
    }
}

struct StreamState {
    /// Per choice, its prompt's log-probabilities until its echo is sent
    /// (`None` after).
    prompts: Vec<Option<Vec<TokenLogprob>>>,
    events: Events,
    format: Arc<dyn Format>,
    include_usage: bool,
    usage: UsageInfo,
    pending: VecDeque<Event>,
    done: bool,
}

impl StreamState {
    /// Sends choice `index`'s echo, the first time only.
    fn echo(&mut self, index: usize) {
        let Some(prompt) = self.prompts.get_mut(index).and_then(Option::take) else {
            return;
        };
        if let Some(chunk) = self.format.echo(index, &prompt) {
            self.pending.push_back(data(&chunk));
        }
    }
}

fn data(value: &Value) -> Event {
    Event::default().data(value.to_string())
}

/// Adds a choice's usage: its completion tokens, and its prompt's tokens
/// once per prompt (for the first of its `n` choices).
fn add_usage(total: &mut UsageInfo, usage: &crate::Usage, index: usize, n: usize) {
    let mut u = *usage;
    if !index.is_multiple_of(n.max(1)) {
        u.prompt_tokens = 0;
    }
    total.add(&u);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On the llama fixture's byte-level tokenizer: a token that is part
    /// of a UTF-8 character has its own bytes, not U+FFFD's; any other has
    /// its text's.
    #[test]
    fn partial_utf8_tokens_have_their_bytes() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/llama");
        let tok = Tokenizer::from_dir(dir).unwrap();
        let mut partial = 0;
        for id in 0..tok.vocab_size() as u32 {
            let Ok(text) = tok.token_text(id) else {
                continue;
            };
            let bytes = token_bytes(&tok, id, &text);
            if text.contains('\u{FFFD}') {
                partial += 1;
                assert_ne!(bytes, text.as_bytes(), "token {id}");
                assert_eq!(
                    String::from_utf8_lossy(&bytes),
                    text,
                    "token {id} ({:?}): {bytes:?}",
                    tok.id_to_token(id)
                );
            } else {
                assert_eq!(bytes, text.as_bytes(), "{id}");
            }
        }
        assert!(
            partial > 0,
            "the fixture has tokens that are parts of characters"
        );
        // The single-byte token of 0xE2 (the first byte of many 3-byte
        // characters) is spelled U+00E2 in the byte-level alphabet.
        let id = tok
            .token_to_id("\u{E2}")
            .expect("a byte-level token for 0xE2");
        assert_eq!(token_bytes(&tok, id, &tok.token_text(id).unwrap()), [0xE2]);
    }
}
