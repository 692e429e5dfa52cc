//! Loading a model directory's weights for a [`ModelConfig`].

use std::path::Path;

use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_weights::loader::{
    ExpectedTensor, LoadProgress, SetAside, WeightFormat, load_safetensors_with,
};
use metrale_model_weights::weights::WeightStore;

use crate::config::ModelConfig;
use crate::error::Result;

/// Loads every tensor `config` expects from the safetensors checkpoint in
/// `model_dir` onto `gpu`, held as `format` says (quantized on load by
/// llama.cpp's rules when it names a file type). Shapes are checked
/// against the config; the parts the config sets aside (a vision tower,
/// multi-token prediction layers) are reported once each, other tensors
/// the model does not use as warnings, through `progress`. On error
/// nothing stays allocated.
pub fn load_weights(
    model_dir: &Path,
    config: &ModelConfig,
    gpu: &dyn GpuBackend,
    format: impl Into<WeightFormat>,
    progress: &mut dyn FnMut(LoadProgress),
) -> Result<WeightStore> {
    let format = format.into();
    let expected = expected_weights(config, format)?;
    Ok(load_safetensors_with(
        model_dir,
        &expected,
        &set_aside(config),
        gpu,
        format.dtype,
        progress,
    )?)
}

/// The loader's view of [`ModelConfig::aside`].
pub fn set_aside(config: &ModelConfig) -> Vec<SetAside> {
    config
        .aside
        .iter()
        .map(|a| SetAside {
            what: a.what.to_string(),
            prefixes: a.prefixes.clone(),
            why: a.why.to_string(),
            expected: a
                .expected
                .iter()
                .map(|t| (t.name.clone(), t.shape.clone()))
                .collect(),
            warn: a.warn,
        })
        .collect()
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
