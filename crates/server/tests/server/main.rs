//! The integration tests of this crate, one binary: each module was
//! its own test binary, linked against every dependency again; one
//! link is most of a cold test build saved (`cargo test --test server
//! <module>::` runs one module).

mod chat_agent;
mod cli;
mod common;
mod errors;
mod generation;
mod hostile;
mod load;
mod openai_client;
mod python;
mod structured;
mod tokens;
