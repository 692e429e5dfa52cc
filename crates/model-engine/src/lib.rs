//! metrale-model-engine: configs and layer plans, the forward pass, the KV
//! cache and SSM state pool, and `TransformerModel` with its ordered teardown.

pub mod arch;
pub mod config;
pub mod error;
pub mod gguf;
pub mod loader;

pub use error::EngineError;
pub mod cache;
pub mod chat;
pub mod conformance;
pub mod engine;
pub mod model;
pub mod random;
pub mod sampling;
pub mod tokenizer;
