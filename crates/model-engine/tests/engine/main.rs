//! The integration tests of this crate, one binary: each module was
//! its own test binary, linked against every dependency again; one
//! link is most of a cold test build saved (`cargo test --test engine
//! <module>::` runs one module).

mod caches_follow_weights;
mod chat;
mod chat_limits;
mod chat_published;
mod chat_spans;
mod common;
mod config_errors;
mod config_fixtures;
mod config_hostile;
mod config_layer_keys;
mod config_lfm2;
mod config_quirks;
mod config_qwen3_5;
mod conformance;
mod device_faults;
mod gguf;
mod gguf_export;
mod gguf_export_roundtrip;
mod gguf_fuzz;
mod gguf_hostile;
mod hostile;
mod limited;
mod load_faults;
mod memory_plan;
mod quant_on_load;
mod sampling;
mod sampling_stop;
mod tokenizer;
