//! Sampling: the per-request parameters and a checkpoint's defaults for
//! them ([`GenerationDefaults`]), a per-sequence [`Sampler`] that turns
//! logits into the next token, and stop conditions ([`StopChecker`] for stop
//! strings across token boundaries, [`SamplingParams::token_finish`] for EOS,
//! stop token ids and `max_tokens`), and structured outputs ([`grammar`]:
//! token masks that hold the output to a schema or grammar).

mod defaults;
pub mod grammar;
mod params;
mod sampler;
mod stop;

pub use defaults::{GENERATION_CONFIG, GenerationDefaults, SamplingOverrides};
pub use grammar::{Grammar, GrammarFactory, OutputConstraint, TokenMask};
pub use params::{MAX_TOP_LOGPROBS, SamplingParams};
pub use sampler::{Sampled, Sampler, Score, score};
pub use stop::{Finish, StopChecker, StopOutput};
