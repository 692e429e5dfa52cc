//! Admission by cost: what a request may cost the server is checked before
//! anything proportional to it is allocated or submitted.
//!
//! Three bounds, each a [`Limits`] field a user sets on the command line:
//! - the work a request asks for: prompts × n × (prompt tokens +
//!   max_tokens) (`--max-request-tokens`, 400 past it);
//! - the response it implies: n × max_tokens × (1 + top log-probabilities)
//!   entries at [`RESPONSE_BYTES_PER_ENTRY`] each (`--max-response-bytes`,
//!   400 past it): every generated token and every alternative reported is
//!   held until it is sent (and, not streamed, until the whole reply is
//!   built);
//! - the prompt text held by requests not yet generating, being tokenized
//!   or queued (`--max-queued-prompt-bytes`, 429 past it): a
//!   [`PromptBytes`] permit, given back when every choice of the request
//!   has its first token, or has ended.
//!
//! The number of requests waiting (`--max-waiting`, 429) is counted in
//! [`Metrics`](crate::server::metrics::Metrics) and checked for all the choices of
//! a request at once, before any is submitted.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::server::error::ApiError;

/// What one reported token or alternative is taken to cost in a response:
/// a chat reply's log-probability entry (`{"token", "logprob", "bytes",
/// ...}`) measures 60 to 70 bytes of JSON; a completion's about 30.
pub const RESPONSE_BYTES_PER_ENTRY: u64 = 80;

/// The bounds a request is admitted within.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most tokens one request may ask the engine to hold: prompts × n ×
    /// (prompt + max_tokens).
    pub max_request_tokens: u64,
    /// Most bytes the response of one request may imply.
    pub max_response_bytes: u64,
    /// Most prompt bytes held by requests not yet generating, all together.
    pub max_queued_prompt_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_request_tokens: 1 << 20,
            max_response_bytes: 32 << 20,
            max_queued_prompt_bytes: 64 << 20,
        }
    }
}

/// What a request asks for, as admission counts it.
#[derive(Clone, Copy, Debug)]
pub struct Cost {
    /// Tokens of every prompt, summed.
    pub prompt_tokens: u64,
    pub prompts: u64,
    /// Choices per prompt.
    pub n: u64,
    pub max_tokens: u64,
    /// Alternatives reported per token (0 when only the token's own
    /// log-probability, or none, is).
    pub top_logprobs: u64,
}

impl Limits {
    /// 400 naming the limit when `cost` is over one of the per-request
    /// bounds.
    pub fn check(&self, cost: &Cost) -> Result<(), ApiError> {
        let tokens = cost.n.saturating_mul(cost.prompt_tokens).saturating_add(
            cost.prompts
                .saturating_mul(cost.n)
                .saturating_mul(cost.max_tokens),
        );
        if tokens > self.max_request_tokens {
            return Err(ApiError::OverLimit {
                limit: "--max-request-tokens",
                message: format!(
                    "the request asks for {tokens} tokens (prompts × n × (prompt + max_tokens)), \
                     more than this server's --max-request-tokens of {}",
                    self.max_request_tokens
                ),
            });
        }
        let bytes = cost
            .prompts
            .saturating_mul(cost.n)
            .saturating_mul(cost.max_tokens)
            .saturating_mul(1 + cost.top_logprobs)
            .saturating_mul(RESPONSE_BYTES_PER_ENTRY);
        if bytes > self.max_response_bytes {
            return Err(ApiError::OverLimit {
                limit: "--max-response-bytes",
                message: format!(
                    "the response could take {bytes} bytes (n × max_tokens × (1 + top \
                     log-probabilities) × {RESPONSE_BYTES_PER_ENTRY}), more than this server's \
                     --max-response-bytes of {}; ask for fewer choices, tokens or \
                     log-probabilities",
                    self.max_response_bytes
                ),
            });
        }
        Ok(())
    }
}

/// The prompt bytes of the requests not yet generating.
#[derive(Debug)]
pub struct PromptBudget {
    held: AtomicUsize,
    limit: usize,
}

impl PromptBudget {
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            held: AtomicUsize::new(0),
            limit,
        })
    }

    /// Bytes held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }

    /// Takes `bytes` of the budget, or answers 429 naming the limit. A
    /// request larger than the whole budget is a 400: it would never fit.
    pub fn take(self: &Arc<Self>, bytes: usize) -> Result<PromptBytes, ApiError> {
        if bytes > self.limit {
            return Err(ApiError::OverLimit {
                limit: "--max-queued-prompt-bytes",
                message: format!(
                    "the prompt takes {bytes} bytes, more than this server's \
                     --max-queued-prompt-bytes of {}",
                    self.limit
                ),
            });
        }
        let taken = self
            .held
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |held| {
                held.checked_add(bytes).filter(|&total| total <= self.limit)
            });
        match taken {
            Ok(_) => Ok(PromptBytes {
                budget: self.clone(),
                bytes,
            }),
            Err(_) => Err(ApiError::Busy(format!(
                "the prompts waiting to be processed already hold this server's \
                 --max-queued-prompt-bytes of {} bytes; retry later",
                self.limit
            ))),
        }
    }
}

/// A request's share of the [`PromptBudget`], given back when dropped.
#[derive(Debug)]
pub struct PromptBytes {
    budget: Arc<PromptBudget>,
    bytes: usize,
}

impl Drop for PromptBytes {
    fn drop(&mut self) {
        self.budget.held.fetch_sub(self.bytes, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost(prompts: u64, n: u64, max_tokens: u64, top: u64) -> Cost {
        Cost {
            prompt_tokens: prompts,
            prompts,
            n,
            max_tokens,
            top_logprobs: top,
        }
    }

    #[test]
    fn the_request_tokens_bound_counts_every_choice() {
        let limits = Limits::default();
        assert!(limits.check(&cost(1, 128, 480, 0)).is_ok());
        // A million one-token prompts with n 128: refused before anything
        // is allocated for them.
        let e = limits.check(&cost(1_000_000, 128, 16, 0)).unwrap_err();
        assert!(e.to_string().contains("--max-request-tokens"), "{e}");
        // Saturating, not wrapping.
        assert!(
            limits
                .check(&cost(u64::MAX, u64::MAX, u64::MAX, 0))
                .is_err()
        );
    }

    #[test]
    fn the_response_bound_counts_the_alternatives() {
        let limits = Limits::default();
        assert!(limits.check(&cost(1, 128, 500, 0)).is_ok());
        assert!(limits.check(&cost(1, 1, 8192, 20)).is_ok());
        let e = limits.check(&cost(1, 128, 500, 20)).unwrap_err();
        assert_eq!(e.status(), axum::http::StatusCode::BAD_REQUEST);
        assert!(e.to_string().contains("--max-response-bytes"), "{e}");
    }

    #[test]
    fn the_prompt_budget_is_given_back() {
        let budget = PromptBudget::new(100);
        let a = budget.take(60).unwrap();
        let e = budget.take(50).unwrap_err();
        assert_eq!(e.status(), axum::http::StatusCode::TOO_MANY_REQUESTS);
        assert!(
            budget
                .take(101)
                .unwrap_err()
                .to_string()
                .contains("more than")
        );
        drop(a);
        assert_eq!(budget.held(), 0);
        let _b = budget.take(100).unwrap();
    }
}
