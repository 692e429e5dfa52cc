//! The error enum of weight loading.

use std::path::PathBuf;

use metrale_gpu_runtime::GpuError;

/// What loading or using weights can fail with. Every variant names the file
/// and, where there is one, the tensor.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("tensor {name:?} is not in the weight store")]
    NotLoaded { name: String },
    #[error("device error while handling tensor {name:?}: {source}")]
    Device { name: String, source: GpuError },
}
