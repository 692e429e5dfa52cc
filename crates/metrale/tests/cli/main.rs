//! The integration tests of this crate, one binary: each module was
//! its own test binary, linked against every dependency again; one
//! link is most of a cold test build saved (`cargo test --test cli
//! <module>::` runs one module).

mod bench_cli;
mod chat_injection;
mod chat_session;
mod chat_think;
mod chat_tokens;
mod cli_habits;
mod config_warnings;
mod device_cli;
mod generate_api;
mod generate_cli;
mod generation_defaults;
mod gguf;
mod inspect;
mod install;
mod limits;
mod logits_cli;
mod logprobs;
mod models_by_name;
mod published;
mod quantize_cli;
