//! OpenAI's request and response types (the parts this server speaks), and
//! the mapping of a request's sampling fields onto [`SamplingParams`].

use crate::{Finish, GenerationDefaults, SamplingOverrides, SamplingParams, Usage};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::server::error::ApiError;

/// A string or a list of strings (`stop`).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum StringOrList {
    One(String),
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The fields completions and chat share.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// vLLM's extension.
    pub top_k: Option<i64>,
    /// vLLM's extension.
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// vLLM's extension.
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<StringOrList>,
    pub max_tokens: Option<i64>,
    pub n: Option<i64>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    /// vLLM's extension: keep generating past the model's end of sequence.
    #[serde(default)]
    pub ignore_eos: bool,
    /// vLLM's extension: token ids that end generation.
    #[serde(default)]
    pub stop_token_ids: Vec<u32>,
    /// vLLM's extension: special tokens in the text (default: left out).
    pub skip_special_tokens: Option<bool>,
    /// A label: who asked. No effect.
    pub user: Option<String>,
}

/// The most choices one request may ask for.
pub const MAX_N: i64 = 128;

impl Sampling {
    /// The engine's parameters: the request's fields over the checkpoint's
    /// `defaults` (its generation_config.json: temperature, top_p, top_k,
    /// min_p, repetition_penalty; else temperature 1, top_p 1).
    /// `max_tokens` is the request's or, when it gives none, `default_max`
    /// (the route's, or the checkpoint's max_new_tokens): at most
    /// `context_limit` (the engine refuses more than the prompt leaves of
    /// it, a 400 too). `logprobs`: whether log-probabilities are reported,
    /// with `top_logprobs` alternatives per token (at most
    /// `MAX_TOP_LOGPROBS`).
    pub fn params(
        &self,
        max_tokens: Option<i64>,
        default_max: Option<usize>,
        logprobs: bool,
        top_logprobs: usize,
        context_limit: usize,
        defaults: &GenerationDefaults,
    ) -> Result<SamplingParams, ApiError> {
        let top_k = match self.top_k {
            None => None,
            Some(-1) | Some(0) => Some(0),
            Some(k) if k > 0 => Some(k as usize),
            Some(k) => {
                return Err(ApiError::bad_param(
                    "top_k",
                    format!("top_k must be -1 (off) or positive, got {k}"),
                ));
            }
        };
        let max_tokens = match max_tokens {
            Some(n) if n < 1 => {
                return Err(ApiError::bad_param(
                    "max_tokens",
                    format!("max_tokens must be at least 1, got {n}"),
                ));
            }
            Some(n) if n as u64 > context_limit as u64 => {
                return Err(ApiError::bad_param(
                    "max_tokens",
                    format!(
                        "max_tokens ({n}) is more than the model's context of {context_limit} tokens"
                    ),
                ));
            }
            Some(n) => Some(n as usize),
            None => default_max,
        };
        let stop = match &self.stop {
            None => Vec::new(),
            Some(StringOrList::One(s)) => vec![s.clone()],
            Some(StringOrList::Many(v)) => v.clone(),
        };
        let d = defaults.apply(&SamplingOverrides {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            max_tokens,
        });
        let params = SamplingParams {
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            seed: self.seed,
            max_tokens,
            stop,
            stop_token_ids: self.stop_token_ids.clone(),
            ignore_eos: self.ignore_eos,
            logprobs,
            top_logprobs,
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
            ..d
        };
        if let Err(e) = params.validate() {
            return Err(ApiError::from_submit(e.into()));
        }
        Ok(params)
    }

    /// The `default_max` of [`params`](Self::params) for a route whose own
    /// default is `route_default`: the checkpoint's max_new_tokens when it
    /// has one, cut to `room` (the fewest tokens any of the request's
    /// prompts leaves of the context, as vLLM cuts it), else the route's.
    pub fn default_max(
        defaults: &GenerationDefaults,
        route_default: Option<usize>,
        room: usize,
    ) -> Option<usize> {
        match defaults.max_new_tokens {
            Some(n) => Some(n.min(room).max(1)),
            None => route_default,
        }
    }

    /// `n`, checked.
    pub fn n(&self) -> Result<usize, ApiError> {
        match self.n.unwrap_or(1) {
            n if n < 1 => Err(ApiError::bad_param(
                "n",
                format!("n must be at least 1, got {n}"),
            )),
            n if n > MAX_N => Err(ApiError::bad_param(
                "n",
                format!("n must be at most {MAX_N}"),
            )),
            n => Ok(n as usize),
        }
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

/// A completions prompt: text, token ids, or a list of either.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

impl Prompt {
    /// How many prompts.
    pub fn count(&self) -> usize {
        match self {
            Prompt::Text(_) | Prompt::Ids(_) => 1,
            Prompt::Texts(v) => v.len(),
            Prompt::IdLists(v) => v.len(),
        }
    }

    /// The bytes the prompts hold: their text, or four a token id.
    pub fn bytes(&self) -> usize {
        match self {
            Prompt::Text(t) => t.len(),
            Prompt::Texts(v) => v.iter().map(String::len).sum(),
            Prompt::Ids(ids) => ids.len() * 4,
            Prompt::IdLists(v) => v.iter().map(|ids| ids.len() * 4).sum(),
        }
    }
}

/// `POST /v1/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Prompt,
    #[serde(flatten)]
    pub sampling: Sampling,
    /// Only 0 (or absent) for now; see [`crate::server::routes::completions`].
    pub logprobs: Option<u64>,
    #[serde(default)]
    pub echo: bool,
    pub suffix: Option<String>,
    pub best_of: Option<u64>,
    /// vLLM's: each prompt token's log-probability, rank and this many
    /// alternatives, in `choices[].prompt_logprobs`.
    pub prompt_logprobs: Option<u64>,
    /// Every field not declared above ([`fields::check`](crate::server::fields::check)).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
}

/// A message's content: text, or a list of parts of which only text parts
/// are taken.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Clone, Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
    /// Every other field of the message ([`fields::check_message`](crate::server::fields::check_message)).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
}

/// `POST /v1/chat/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<Message>,
    #[serde(flatten)]
    pub sampling: Sampling,
    pub max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<u64>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    /// Whether a reply may make more than one call (default true).
    pub parallel_tool_calls: Option<Value>,
    /// vLLM's: extra variables for the chat template, such as
    /// `{"enable_thinking": false}`.
    pub chat_template_kwargs: Option<Value>,
    pub functions: Option<Value>,
    pub function_call: Option<Value>,
    /// vLLM's: whether the template opens the assistant's turn (default
    /// true; false renders the conversation as it stands).
    pub add_generation_prompt: Option<bool>,
    /// Every field not declared above ([`fields::check`](crate::server::fields::check)).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
}

/// `usage`.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct UsageInfo {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details`: the prompt tokens the prefix cache saved
/// computing, as OpenAI and vLLM report them.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

impl UsageInfo {
    pub fn add(&mut self, usage: &Usage) {
        self.prompt_tokens += usage.prompt_tokens;
        self.completion_tokens += usage.completion_tokens;
        self.total_tokens = self.prompt_tokens + self.completion_tokens;
        self.prompt_tokens_details.cached_tokens += usage.cached_tokens;
    }
}

/// OpenAI's `finish_reason`.
pub fn finish_reason(finish: &Finish) -> &'static str {
    match finish {
        Finish::Length => "length",
        Finish::Eos(_) | Finish::StopToken(_) | Finish::StopString(_) | Finish::Grammar => "stop",
    }
}
