//! The error enum shared by the crates' public types.

use crate::quant::QuantError;

/// Errors of the shared types.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error(
        "unknown dtype {0:?} (expected one of f32, bf16, f16, i64, u64, i32, u32, u8, or a GGML quantized format such as q8_0 or q4_K)"
    )]
    UnknownDType(String),
    #[error(transparent)]
    Quant(#[from] QuantError),
}
