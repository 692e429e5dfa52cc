//! Loading a model directory's weights for a [`ModelConfig`].

use std::path::Path;

use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_weights::loader::{ExpectedTensor, LoadProgress, WeightDType, load_safetensors};
use metrale_model_weights::weights::WeightStore;

use crate::config::ModelConfig;
use crate::error::Result;

/// Loads every tensor `config` expects from the safetensors checkpoint in
/// `model_dir` onto `gpu`, held as `dtype` says. Shapes are checked against
/// the config; tensors the model does not use are reported as warnings
/// through `progress`. On error nothing stays allocated.
pub fn load_weights(
    model_dir: &Path,
    config: &ModelConfig,
    gpu: &dyn GpuBackend,
    dtype: WeightDType,
    progress: &mut dyn FnMut(LoadProgress),
) -> Result<WeightStore> {
    let expected: Vec<ExpectedTensor> = config
        .expected_tensors()
        .into_iter()
        .map(|t| ExpectedTensor {
            name: t.name,
            shape: t.shape,
        })
        .collect();
    Ok(load_safetensors(
        model_dir, &expected, gpu, dtype, progress,
    )?)
}
