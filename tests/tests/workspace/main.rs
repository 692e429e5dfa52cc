//! The integration tests of this crate, one binary: each module was
//! its own test binary, linked against every dependency again; one
//! link is most of a cold test build saved (`cargo test --test workspace
//! <module>::` runs one module).

mod arithmetic;
mod batching;
mod bf16_ssm_state;
mod decode_invariance;
mod default_model;
mod generation;
mod gguf_every_token;
mod gguf_llamacpp;
mod kv_dtype;
mod logprobs;
mod parity;
mod prefix_cache;
mod sweep;
mod threads;
mod transfers;
