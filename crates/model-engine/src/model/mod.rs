//! The model: its owned resources ([`types::TransformerModel`]), the weights
//! it resolves from the plan, and the forward pass.

pub mod derived;
mod experts;
pub mod forward;
mod load;
pub mod memory;
pub mod prefix;
mod resolve;
pub mod rope;
pub mod types;
pub(crate) mod weights;

pub use forward::{GraphStats, Logits, Sequence, Step};
pub use memory::MemoryPlan;
pub use prefix::{PrefixCacheOptions, PrefixHit};
pub use types::{ModelOptions, TransformerModel};
