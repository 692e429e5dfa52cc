//! `POST /v1/completions`.
//!
//! `logprobs: N`: absent reports none; otherwise `choices[].logprobs` is
//! `{tokens, token_logprobs, top_logprobs, text_offset}`: each sampled
//! token's log-probability under the model (log-softmax of the raw logits)
//! and, for N > 0 (at most 20), per token a map of the N most likely
//! tokens' texts to their log-probabilities (`null` for N = 0).
//!
//! `echo: true` puts the prompt before each choice's text and, with
//! `logprobs`, the prompt's tokens before the generated ones: the first
//! with `null` (nothing predicts it), each other under the model given the
//! tokens before it, as OpenAI and vLLM report them. `max_tokens: 0` is
//! allowed with echo: the prompt alone is scored (lm-evaluation-harness's
//! log-likelihood requests). Streamed, the prompt (with its
//! log-probabilities) is a choice's first chunk.

use std::sync::Arc;

use crate::Finish;
use crate::engine::sampling::MAX_TOP_LOGPROBS;
use axum::Json;
use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::admit;
use crate::server::admission::Cost;
use crate::server::error::ApiError;
use crate::server::openai::{CompletionRequest, Prompt, Sampling, UsageInfo, finish_reason};
use crate::server::sse::{Choice, Events, Format, TokenLogprob};
use crate::server::state::{AppState, off_the_workers, unix_now};

/// OpenAI's default `max_tokens` for completions.
pub const DEFAULT_MAX_TOKENS: usize = 16;

pub async fn handler(
    State(state): State<Arc<AppState>>,
    body: Result<Json<CompletionRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(request) = body?;
    state.check_model(request.model.as_deref())?;
    crate::server::fields::check(crate::server::fields::Route::Completions, &request.extra)?;
    let constraint = crate::server::structured::constraint(&request.extra)?;
    let echo = request.echo;
    let prompt_top = match request.prompt_logprobs {
        None => None,
        Some(k) if k <= MAX_TOP_LOGPROBS as u64 => Some(k as usize),
        Some(k) => {
            return Err(ApiError::bad_param(
                "prompt_logprobs",
                format!("prompt_logprobs must be at most {MAX_TOP_LOGPROBS}, got {k}"),
            ));
        }
    };
    if prompt_top.is_some() && request.sampling.stream {
        return Err(ApiError::bad_param(
            "prompt_logprobs",
            "prompt_logprobs is not streamed by this server; ask without stream (or use \
             echo with logprobs, which is)",
        ));
    }
    let score_only = echo && request.sampling.max_tokens == Some(0);
    if request.suffix.is_some() {
        return Err(ApiError::bad_param(
            "suffix",
            "suffix is not supported (no fill-in-the-middle)",
        ));
    }
    // best_of = n is plain sampling; more would generate candidates and
    // return the best, which this server does not do.
    let n = request.sampling.n()?;
    match request.best_of {
        Some(b) if b > n as u64 => {
            return Err(ApiError::bad_param(
                "best_of",
                format!("best_of > n is not supported (best_of {b}, n {n})"),
            ));
        }
        Some(b) if b < n as u64 => {
            return Err(ApiError::bad_param(
                "best_of",
                format!("best_of must be at least n (best_of {b}, n {n})"),
            ));
        }
        _ => {}
    }
    let (logprobs, top) = match request.logprobs {
        None => (false, 0),
        Some(n) if n <= MAX_TOP_LOGPROBS as u64 => (true, n as usize),
        Some(n) => {
            return Err(ApiError::bad_param(
                "logprobs",
                format!("logprobs must be at most {MAX_TOP_LOGPROBS}, got {n}"),
            ));
        }
    };
    // Before any tokenizing: the prompts' bytes from the shared budget,
    // and what the request's shape alone already costs (a token a prompt
    // at least).
    let prompt_bytes = state.prompt_budget.take(request.prompt.bytes())?;
    let count = request.prompt.count() as u64;
    state.config.limits.check(&Cost {
        prompt_tokens: count,
        prompts: count,
        n: n as u64,
        max_tokens: request.sampling.max_tokens.unwrap_or(1).max(1) as u64,
        top_logprobs: top as u64,
    })?;
    let (prompts, echoed) = {
        let state = state.clone();
        let prompt = request.prompt;
        off_the_workers(move || encode_prompts(&state, prompt, echo)).await?
    };
    if prompts.is_empty() {
        return Err(ApiError::bad_param("prompt", "the prompt list is empty"));
    }
    let sampling = &request.sampling;
    let room = prompts
        .iter()
        .map(|p| state.context_limit.saturating_sub(p.len()))
        .min()
        .unwrap_or(state.context_limit);
    let defaults = state.handle.defaults();
    let mut params = sampling.params(
        sampling.max_tokens.filter(|_| !score_only),
        Sampling::default_max(defaults, Some(DEFAULT_MAX_TOKENS), room),
        logprobs,
        top,
        state.context_limit,
        defaults,
    )?;
    params.constraint = constraint;
    if score_only {
        params.max_tokens = Some(0);
    }
    // With no tokens to generate, the prompt is run only to be scored.
    if echo && (logprobs || score_only) {
        params.prompt_logprobs = Some(top);
    }
    if let Some(k) = prompt_top {
        params.prompt_logprobs = Some(params.prompt_logprobs.unwrap_or(0).max(k));
    }
    admit(&state, &prompts, n, &params)?;
    let choices = prompts.len() * n;
    let submitted = state
        .submit_off(prompts, params.clone(), n, prompt_bytes)
        .await?;
    let events = Events {
        submitted,
        choices,
        n,
        logprobs,
        tokenizer: state.tokenizer().clone(),
    };
    let format = Completions {
        id: format!("cmpl-{}", crate::server::next_id()),
        created: unix_now(),
        model: state.model_name.clone(),
        echoed,
        n,
        logprobs,
        top,
        prompt_top,
    };
    if sampling.stream {
        Ok(events
            .stream(Arc::new(format), sampling.include_usage())
            .into_response())
    } else {
        Ok(Json(events.collect(&format).await?).into_response())
    }
}

/// The prompts' ids and, with `echo`, each prompt's text and first
/// token (its text as given, or its ids decoded).
fn encode_prompts(
    state: &AppState,
    prompt: Prompt,
    echo: bool,
) -> Result<(Vec<Vec<u32>>, Vec<Echoed>), ApiError> {
    let (ids, texts): (Vec<Vec<u32>>, Vec<Option<String>>) = match prompt {
        Prompt::Text(text) => (vec![encode(state, &text)?], vec![Some(text)]),
        Prompt::Texts(texts) => (
            texts
                .iter()
                .map(|t| encode(state, t))
                .collect::<Result<_, _>>()?,
            texts.into_iter().map(Some).collect(),
        ),
        Prompt::Ids(ids) => (vec![ids], vec![None]),
        Prompt::IdLists(lists) => {
            let n = lists.len();
            (lists, vec![None; n])
        }
    };
    if !echo {
        return Ok((ids, Vec::new()));
    }
    let tokenizer = state.tokenizer();
    let echoed = ids
        .iter()
        .zip(texts)
        .map(|(ids, text)| {
            let text = match text {
                Some(t) => t,
                None => tokenizer.decode(ids).map_err(|e| {
                    ApiError::bad_param("prompt", format!("cannot decode the prompt's ids: {e}"))
                })?,
            };
            let first = ids
                .first()
                .map(|&id| crate::server::sse::token_logprob(tokenizer, id, 0.0, &[]));
            Ok(Echoed { text, first })
        })
        .collect::<Result<_, ApiError>>()?;
    Ok((ids, echoed))
}

pub(super) fn encode(state: &AppState, text: &str) -> Result<Vec<u32>, ApiError> {
    state
        .tokenizer()
        .encode(text, true)
        .map_err(|e| ApiError::bad_param("prompt", format!("cannot tokenize the prompt: {e}")))
}

struct Completions {
    id: String,
    created: u64,
    model: String,
    /// With `echo`, per prompt: what goes before its choices.
    echoed: Vec<Echoed>,
    /// Choices per prompt.
    n: usize,
    /// Whether log-probabilities were asked for, and how many
    /// alternatives (`logprobs: N`).
    logprobs: bool,
    top: usize,
    /// vLLM's `prompt_logprobs: K`.
    prompt_top: Option<usize>,
}

/// A prompt repeated before its choices (`echo`).
struct Echoed {
    text: String,
    /// The first token (its log-probability is reported as `null`).
    first: Option<TokenLogprob>,
}

impl Completions {
    fn chunk(&self, choices: Value, usage: Option<&UsageInfo>) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if let Some(u) = usage {
            v["usage"] = json!(u);
        }
        v
    }
}

fn logprobs_json(lps: &[TokenLogprob], start: usize) -> Value {
    echo_logprobs_json(None, lps, start)
}

/// vLLM's `prompt_logprobs`: `null` for the first token, then per token a
/// map of ids to `{logprob, rank, decoded_token}`: the token itself and
/// its `k` most likely alternatives (ranked 1.. in order).
fn vllm_prompt_logprobs(prompt: &[TokenLogprob], k: usize) -> Value {
    let mut out = vec![Value::Null];
    for p in prompt {
        let mut map = serde_json::Map::new();
        map.insert(
            p.token.to_string(),
            json!({"logprob": p.logprob, "rank": p.rank, "decoded_token": p.text}),
        );
        for (i, t) in p.top.iter().take(k).enumerate() {
            map.entry(t.token.to_string()).or_insert_with(
                || json!({"logprob": t.logprob, "rank": i + 1, "decoded_token": t.text}),
            );
        }
        out.push(Value::Object(map));
    }
    Value::Array(out)
}

/// [`logprobs_json`] after `lead`, a token reported with a `null`
/// log-probability and `null` alternatives (an echoed prompt's first).
fn echo_logprobs_json(lead: Option<&TokenLogprob>, lps: &[TokenLogprob], start: usize) -> Value {
    let all = || lead.into_iter().chain(lps);
    let mut offset = start;
    let mut offsets = Vec::with_capacity(lps.len() + 1);
    for lp in all() {
        offsets.push(offset);
        offset += lp.text.len();
    }
    let mut logprobs: Vec<Value> = lps.iter().map(|l| json!(l.logprob)).collect();
    let mut top = match top_json(lps) {
        Value::Array(maps) => maps,
        _ => Vec::new(),
    };
    if lead.is_some() {
        logprobs.insert(0, Value::Null);
        if !top.is_empty() {
            top.insert(0, Value::Null);
        }
    }
    json!({
        "tokens": all().map(|l| &l.text).collect::<Vec<_>>(),
        "token_logprobs": logprobs,
        "top_logprobs": if top.is_empty() { Value::Null } else { json!(top) },
        "text_offset": offsets,
    })
}

/// Per token, a map of the alternatives' texts to their log-probabilities
/// (the first of equal texts kept); `null` when none were asked for.
fn top_json(lps: &[TokenLogprob]) -> Value {
    if lps.iter().all(|l| l.top.is_empty()) {
        return Value::Null;
    }
    let maps: Vec<Value> = lps
        .iter()
        .map(|l| {
            let mut map = serde_json::Map::new();
            for t in &l.top {
                map.entry(t.text.clone()).or_insert(json!(t.logprob));
            }
            Value::Object(map)
        })
        .collect();
    json!(maps)
}

impl Format for Completions {
    fn delta(&self, index: usize, text: &str, logprob: Option<&TokenLogprob>) -> Value {
        let lp = logprob.map_or(Value::Null, |l| logprobs_json(std::slice::from_ref(l), 0));
        self.chunk(
            json!([{"index": index, "text": text, "logprobs": lp, "finish_reason": null}]),
            None,
        )
    }

    fn echo(&self, index: usize, prompt: &[TokenLogprob]) -> Option<Value> {
        let e = self.echoed.get(index / self.n.max(1))?;
        let lp = if self.logprobs {
            echo_logprobs_json(e.first.as_ref(), prompt, 0)
        } else {
            Value::Null
        };
        Some(self.chunk(
            json!([{"index": index, "text": e.text, "logprobs": lp, "finish_reason": null}]),
            None,
        ))
    }

    fn finish(&self, index: usize, reason: &Finish) -> Value {
        self.chunk(
            json!([{"index": index, "text": "", "logprobs": null, "finish_reason": finish_reason(reason)}]),
            None,
        )
    }

    fn usage(&self, usage: &UsageInfo) -> Value {
        self.chunk(json!([]), Some(usage))
    }

    fn response(&self, choices: Vec<Choice>, usage: &UsageInfo) -> Value {
        let choices: Vec<Value> = choices
            .into_iter()
            .enumerate()
            .map(|(index, c)| {
                let prompt_json = self
                    .prompt_top
                    .map(|k| vllm_prompt_logprobs(&c.prompt_logprobs, k));
                let echoed = self.echoed.get(index / self.n.max(1));
                let (text, lp) = match echoed {
                    Some(e) => {
                        let prompt = c.prompt_logprobs.into_iter().map(|mut p| {
                            p.top.truncate(self.top);
                            p
                        });
                        let lps: Vec<TokenLogprob> = prompt.chain(c.logprobs).collect();
                        let lp = if self.logprobs {
                            echo_logprobs_json(e.first.as_ref(), &lps, 0)
                        } else {
                            Value::Null
                        };
                        (format!("{}{}", e.text, c.text), lp)
                    }
                    None if c.logprobs.is_empty() => (c.text, Value::Null),
                    None => {
                        let lp = logprobs_json(&c.logprobs, 0);
                        (c.text, lp)
                    }
                };
                let mut choice = json!({
                    "index": index,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": c.finish.as_ref().map(finish_reason),
                });
                if let Some(p) = prompt_json {
                    choice["prompt_logprobs"] = p;
                }
                choice
            })
            .collect();
        self.chunk(json!(choices), Some(usage))
    }
}
