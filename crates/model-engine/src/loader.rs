//! Loading a model directory's weights for a [`ModelConfig`].

use std::path::Path;

use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_weights::loader::{ExpectedTensor, LoadProgress, WeightFormat, load_safetensors};
use metrale_model_weights::weights::WeightStore;

use crate::config::ModelConfig;
use crate::error::Result;

/// Loads every tensor `config` expects from the safetensors checkpoint in
/// `model_dir` onto `gpu`, held as `format` says (quantized on load by
/// llama.cpp's rules when it names a file type). Shapes are checked
/// against the config; tensors the model does not use are reported as
/// warnings through `progress`. On error nothing stays allocated.
pub fn load_weights(
    model_dir: &Path,
    config: &ModelConfig,
    gpu: &dyn GpuBackend,
    format: impl Into<WeightFormat>,
    progress: &mut dyn FnMut(LoadProgress),
) -> Result<WeightStore> {
    let format = format.into();
    let expected = expected_weights(config, format)?;
    Ok(load_safetensors(
        model_dir,
        &expected,
        gpu,
        format.dtype,
        progress,
    )?)
}

/// The tensors `config` expects, each with the block format `format`'s
/// file type quantizes it to (none without one).
pub fn expected_weights(config: &ModelConfig, format: WeightFormat) -> Result<Vec<ExpectedTensor>> {
    let mut quant = match format.quant {
        Some(ftype) => crate::gguf::quant_types(config, ftype)?,
        None => Default::default(),
    };
    Ok(config
        .expected_tensors()
        .into_iter()
        .map(|t| ExpectedTensor {
            quantize: quant.remove(&t.name),
            name: t.name,
            shape: t.shape,
        })
        .collect())
}
