//! The error enum shared by the crates' public types.

/// Errors of the shared types.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("unknown dtype {0:?} (expected one of f32, bf16, f16, i64, i32, u32, u8)")]
    UnknownDType(String),
    #[error("teardown had {} failure(s): {}", .0.len(), .0.iter().map(|(l, e)| format!("{l}: {e:#}")).collect::<Vec<_>>().join("; "))]
    Teardown(Vec<(String, anyhow::Error)>),
}
