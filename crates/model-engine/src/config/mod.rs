//! Model configuration: `config.json` to a validated, typed [`ModelConfig`]
//! with its layer plan and the names of every tensor it needs.
//!
//! The architecture families live in `crate::arch`, one file each; this module
//! holds the types they all produce, the JSON quirks every family shares
//! ([`json`], [`rope`]) and the entry points [`load_config`] and
//! [`parse_config`]. The plan, not the architecture name, drives the forward
//! pass, the cache sizes and the memory estimate.

pub mod json;
pub mod limits;
mod load;
pub mod rope;
mod tensors;
mod types;

pub use load::{load_config, parse_config};
pub use types::*;
