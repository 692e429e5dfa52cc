//! The error enum of the engine.

use std::path::PathBuf;

use metrale_gpu_runtime::GpuError;
use metrale_model_weights::WeightsError;

/// What building or running a model can fail with.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{path}: {detail}")]
    Config { path: PathBuf, detail: String },
    #[error("unknown model_type {found:?} in {path}; supported: {supported}")]
    UnknownModelType {
        path: PathBuf,
        found: String,
        supported: String,
    },
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error("{context}: {source}")]
    Device { context: String, source: GpuError },
    #[error("invalid request: {0}")]
    Request(String),
    /// A broken internal invariant (a bug in metrale, not in the input).
    #[error("internal error (a bug in metrale; please report it): {0}")]
    Internal(String),
    #[error("out of {resource}: {detail}")]
    Exhausted {
        resource: &'static str,
        detail: String,
    },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error("sampling: {0}")]
    Sampling(String),
    /// Writing a GGUF file (`metrale quantize`) from the input at `path`.
    #[error("{path}: {detail}")]
    Export { path: PathBuf, detail: String },
}

impl EngineError {
    /// Wraps a device error with what was being done.
    pub fn device(context: impl Into<String>) -> impl FnOnce(GpuError) -> EngineError {
        let context = context.into();
        move |source| EngineError::Device { context, source }
    }
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
