//! The integration tests of this crate, one binary: each module was
//! its own test binary, linked against every dependency again; one
//! link is most of a cold test build saved (`cargo test --test weights
//! <module>::` runs one module).

mod bad_input;
mod common;
mod faults;
mod fuzz;
mod gguf_compat;
mod gguf_fuzz;
mod sharded;
mod special_files;
mod tokenizer_limits;
