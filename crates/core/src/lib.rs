//! metrale-core: the types every metrale crate shares.
//!
//! Nothing here touches a device. [`scope`] defines how state that owns device
//! memory is released (explicitly, in order, reporting failures), [`ids`] the
//! newtype ids, [`dtype`] the element types, [`error`] the shared error enum,
//! [`json`] the tolerant reading of checkpoints' JSON files, [`quant`] GGML's
//! tensor types (the block-quantized formats of GGUF files) and their reference
//! codecs.

pub mod dtype;
pub mod error;
pub mod ids;
pub mod json;
pub mod quant;
pub mod scope;

pub use dtype::{DType, PANEL_ROWS, QUANT_GROUP_ROWS, QuantFormat};
pub use error::CoreError;
pub use ids::{BlockId, LayerIdx, SeqId, SlotId};
pub use quant::{GgmlType, QuantError};
