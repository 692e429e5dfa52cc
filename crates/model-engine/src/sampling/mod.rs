//! Sampling: the per-request parameters, a per-sequence [`Sampler`] that turns
//! logits into the next token, and stop conditions ([`StopChecker`] for stop
//! strings across token boundaries, [`SamplingParams::token_finish`] for EOS,
//! stop token ids and `max_tokens`).

mod params;
mod sampler;
mod stop;

pub use params::{MAX_TOP_LOGPROBS, SamplingParams};
pub use sampler::{Sampled, Sampler};
pub use stop::{Finish, StopChecker, StopOutput};
