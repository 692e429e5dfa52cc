//! The model: its owned resources ([`types::TransformerModel`]), the weights
//! it resolves from the plan, and the forward pass.

pub mod derived;
pub mod types;

pub use types::{ModelOptions, TransformerModel};
