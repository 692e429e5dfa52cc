//! Turning a request's engine events into a response: collected into one
//! JSON body, or streamed as server-sent events (`data: {chunk}\n\n` ...
//! `data: [DONE]\n\n`) in the shape a [`Format`] gives.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event, Sse};
use futures_util::Stream;
use metrale::engine::tokenizer::Tokenizer;
use metrale::{Finish, StreamEvent};
use serde_json::Value;
use tokio::sync::mpsc;

use crate::error::ApiError;
use crate::openai::UsageInfo;

/// One generated token with its log-probability under the model (the
/// log-softmax of the raw logits) and, when asked, the most likely tokens
/// at its position with theirs.
#[derive(Clone, Debug)]
pub struct TokenLogprob {
    pub token: u32,
    /// The token on its own, decoded with special tokens kept.
    pub text: String,
    pub logprob: f32,
    /// `(text, logprob)` of the most likely tokens, best first.
    pub top: Vec<(String, f32)>,
}

/// A finished choice.
#[derive(Clone, Debug, Default)]
pub struct Choice {
    pub text: String,
    /// Filled only when log-probabilities were asked for.
    pub logprobs: Vec<TokenLogprob>,
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
    /// The last chunk of a choice.
    fn finish(&self, index: usize, reason: &Finish) -> Value;
    /// The chunk with the usage (`stream_options.include_usage`).
    fn usage(&self, usage: &UsageInfo) -> Value;
    /// The whole non-streamed response.
    fn response(&self, choices: Vec<Choice>, usage: &UsageInfo) -> Value;
}

/// What the events of a request are read with.
pub struct Events {
    pub rx: mpsc::Receiver<(usize, anyhow::Result<StreamEvent>)>,
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
        let text = |id: u32| self.tokenizer.token_text(id).unwrap_or_default();
        self.logprobs.then(|| TokenLogprob {
            token,
            text: text(token),
            logprob,
            top: top.iter().map(|&(id, lp)| (text(id), lp)).collect(),
        })
    }

    /// Reads every choice to its end.
    pub async fn collect(mut self, format: &dyn Format) -> Result<Value, ApiError> {
        let mut choices = vec![Choice::default(); self.choices];
        let mut usage = UsageInfo::default();
        let mut left = self.choices;
        while left > 0 {
            let Some((index, event)) = self.rx.recv().await else {
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
                StreamEvent::Finished {
                    reason, usage: u, ..
                } => {
                    add_usage(&mut usage, &u, index, self.n);
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
                    let Some((index, event)) = state.events.rx.recv().await else {
                        let e = ApiError::Internal("the engine stopped".into());
                        state.pending.push_back(data(&e.body()));
                        state.done = true;
                        continue;
                    };
                    match event {
                        Ok(StreamEvent::Token {
                            token,
                            text,
                            logprob,
                            top_logprobs,
                        }) => {
                            let lp = state.events.logprob(token, logprob, &top_logprobs);
                            if !text.is_empty() || lp.is_some() {
                                let chunk = state.format.delta(index, &text, lp.as_ref());
                                state.pending.push_back(data(&chunk));
                            }
                        }
                        Ok(StreamEvent::Finished { reason, usage, .. }) => {
                            add_usage(&mut state.usage, &usage, index, state.events.n);
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
    events: Events,
    format: Arc<dyn Format>,
    include_usage: bool,
    usage: UsageInfo,
    pending: VecDeque<Event>,
    done: bool,
}

fn data(value: &Value) -> Event {
    Event::default().data(value.to_string())
}

/// Adds a choice's usage: its completion tokens, and its prompt's tokens
/// once per prompt (for the first of its `n` choices).
fn add_usage(total: &mut UsageInfo, usage: &metrale::Usage, index: usize, n: usize) {
    let mut u = *usage;
    if !index.is_multiple_of(n.max(1)) {
        u.prompt_tokens = 0;
    }
    total.add(&u);
}
