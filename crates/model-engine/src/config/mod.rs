//! Model configuration: `config.json` to a validated, typed [`ModelConfig`]
//! with its layer plan and the names of every tensor it needs.
//!
//! The architecture families live in `crate::arch`, one file each; this module
//! holds the types they all produce. The plan, not the architecture name,
//! drives the forward pass, the cache sizes and the memory estimate.

mod types;

pub use types::*;
