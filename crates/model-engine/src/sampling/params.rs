//! Per-request sampling parameters and their validation.

use serde::{Deserialize, Serialize};

use super::grammar::OutputConstraint;
use super::stop::Finish;
use crate::error::{EngineError, Result};

/// Temperatures below this are treated as greedy (as vLLM does): dividing
/// logits by a tiny temperature only overflows towards argmax anyway.
pub(crate) const GREEDY_EPSILON: f32 = 1e-5;

/// The most alternatives a token may report ([`SamplingParams::top_logprobs`]):
/// OpenAI's chat API allows 20 (its completions API 5).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// How a request wants its tokens chosen and when generation stops. The
/// defaults change nothing: temperature 1, no filters, no penalties.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy (argmax, lowest id on ties).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 turns the filter off.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches
    /// `top_p`; in (0, 1], 1 turns the filter off.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely token's
    /// probability; in [0, 1], 0 turns the filter off.
    pub min_p: f32,
    /// Divides positive logits and multiplies negative ones of every token
    /// seen in the prompt or the output (HF / vLLM); > 0, 1 turns it off.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already generated;
    /// in [-2, 2].
    pub presence_penalty: f32,
    /// Subtracted from a generated token's logit once per time it was
    /// generated; in [-2, 2].
    pub frequency_penalty: f32,
    /// Seed of the sequence's random generator; `None` seeds from the OS.
    pub seed: Option<u64>,
    /// Most tokens to generate; `None` leaves only the context length.
    pub max_tokens: Option<usize>,
    /// Stop strings: the output ends before the first one it contains.
    pub stop: Vec<String>,
    /// Token ids that end generation (besides the model's EOS ids).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past the model's EOS ids (stop token ids still stop).
    pub ignore_eos: bool,
    /// Whether the caller wants the sampled token's log-probability
    /// reported. The engine computes it for every token anyway (one pass
    /// over the logits); the flag is for the layers that report it.
    ///
    /// Every log-probability the engine reports is of the model's raw
    /// distribution: log-softmax of the logits as the model gave them,
    /// before penalties, temperature and the top-k / top-p / min-p filters
    /// (vLLM's default `raw_logprobs`, what OpenAI reports), over the ids
    /// the tokenizer can decode. The sum is taken in f64 around the largest
    /// logit, the result rounded to f32.
    pub logprobs: bool,
    /// How many of the most likely tokens (id, log-probability) to report
    /// with each generated token, besides the sampled one; 0 reports none.
    /// At most [`MAX_TOP_LOGPROBS`]. Above 0 it implies `logprobs`
    /// ([`wants_logprobs`](Self::wants_logprobs)).
    pub top_logprobs: usize,
    /// Whether special tokens are left out of the output text.
    pub skip_special_tokens: bool,
    /// Log-probabilities of the prompt's own tokens (vLLM's
    /// `prompt_logprobs`; what evaluation harnesses score choices with):
    /// every prompt token after the first, under the model given the
    /// tokens before it, with this many most likely alternatives (0: the
    /// token's own only). At most [`MAX_TOP_LOGPROBS`]. Such a request
    /// never starts from a cached prefix (its logits are needed), and may
    /// ask for no output at all (`max_tokens: Some(0)`).
    pub prompt_logprobs: Option<usize>,
    /// What the output must match (a JSON schema, a regex, a grammar):
    /// tokens that could not continue it are masked at every step, and the
    /// output ends ([`Finish::Grammar`]) when nothing may follow it.
    pub constraint: Option<OutputConstraint>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            max_tokens: None,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: false,
            top_logprobs: 0,
            skip_special_tokens: true,
            prompt_logprobs: None,
            constraint: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding, nothing else changed.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Whether tokens are chosen by argmax (temperature 0, or below 1e-5).
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_EPSILON
    }

    /// Whether log-probabilities are to be reported: `logprobs`, or any
    /// `top_logprobs`.
    pub fn wants_logprobs(&self) -> bool {
        self.logprobs || self.top_logprobs > 0
    }

    /// Checks every parameter; the error says which is out of range.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(EngineError::Request(msg));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return bad(format!(
                "repetition_penalty must be a finite number > 0, got {}",
                self.repetition_penalty
            ));
        }
        for (name, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&value) {
                return bad(format!("{name} must be in [-2, 2], got {value}"));
            }
        }
        if self.max_tokens == Some(0) && self.prompt_logprobs.is_none() {
            return bad("max_tokens must be at least 1 (0 only to score the prompt)".into());
        }
        if let Some(n) = self.prompt_logprobs
            && n > MAX_TOP_LOGPROBS
        {
            return bad(format!(
                "prompt_logprobs must be at most {MAX_TOP_LOGPROBS}, got {n}"
            ));
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return bad(format!(
                "top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {}",
                self.top_logprobs
            ));
        }
        if self.stop.iter().any(String::is_empty) {
            return bad("stop strings must not be empty".into());
        }
        if self.ignore_eos && self.constraint.is_some() {
            return bad(
                "ignore_eos cannot be combined with a structured output: the grammar decides \
                 where the output ends"
                    .into(),
            );
        }
        Ok(())
    }

    /// Whether generation ends with `token`, the `num_generated`-th generated
    /// token (counting it): an EOS id (unless `ignore_eos`), a stop token id,
    /// or `max_tokens` reached, checked in that order. The token itself is
    /// part of the output (callers usually leave EOS text out by skipping
    /// special tokens). Stop strings are checked on text by [`StopChecker`].
    ///
    /// [`StopChecker`]: super::StopChecker
    pub fn token_finish(
        &self,
        token: u32,
        eos_ids: &[u32],
        num_generated: usize,
    ) -> Option<Finish> {
        if !self.ignore_eos && eos_ids.contains(&token) {
            return Some(Finish::Eos(token));
        }
        if self.stop_token_ids.contains(&token) {
            return Some(Finish::StopToken(token));
        }
        match self.max_tokens {
            Some(max) if num_generated >= max => Some(Finish::Length),
            _ => None,
        }
    }
}
