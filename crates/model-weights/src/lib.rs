//! metrale-model-weights: a model's weights on a device.
//!
//! [`weights::WeightStore`] maps Hugging Face tensor names to device tensors
//! and owns their memory; it is the only crate that reads weight files.
//! [`loader::load_safetensors`] fills one from a checkpoint directory
//! (single file or sharded), checking every tensor against what the caller
//! expects. [`gguf::GgufFile`] reads llama.cpp's GGUF checkpoints (checked,
//! memory-mapped), [`gguf::GgufWriter`] writes them, and
//! [`gguf::tokenizer_json`] rebuilds the tokenizer their metadata describes.

pub mod error;
pub mod gguf;
pub mod loader;
mod open;
pub mod weights;

pub use error::WeightsError;
pub use loader::{
    ExpectedTensor, GgufExpected, GgufTransform, LoadProgress, WeightDType, load_gguf,
    load_safetensors, scan_safetensors,
};
pub use open::{file_kind, open_regular, read_regular_to_string};
pub use weights::{DeviceTensor, WeightStore};
