//! metrale-model-weights: a model's weights on a device.
//!
//! [`weights::WeightStore`] maps Hugging Face tensor names to device tensors
//! and owns their memory; it is the only crate that reads weight files.

pub mod error;
pub mod weights;

pub use error::WeightsError;
pub use weights::{DeviceTensor, WeightStore};
