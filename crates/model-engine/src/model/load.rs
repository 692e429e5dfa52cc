//! Loading a model directory into a ready [`TransformerModel`].

use std::path::Path;
use std::sync::Arc;

use metrale_core::scope::ModelResource;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_weights::loader::{
    ExpectedTensor, LoadProgress, StoredDType, WeightFormat, device_dtype, load_gguf_with,
    load_safetensors_with,
};
use metrale_model_weights::weights::WeightStore;

use super::memory::MemoryPlan;
use super::{ModelOptions, TransformerModel};
use crate::config::{ModelConfig, load_config};
use crate::error::Result;
use crate::loader::expected_weights;

impl TransformerModel {
    /// Reads `model_dir`'s config and weights onto `gpu` and builds the
    /// model's pools. On failure nothing stays allocated. The config's
    /// warnings ([`ModelConfig::warnings`](crate::config::ModelConfig::warnings),
    /// already in the log) come first through `progress`, as
    /// `LoadProgress::Warning` like the weight loader's.
    pub fn load(
        model_dir: &Path,
        gpu: Arc<dyn GpuBackend>,
        options: ModelOptions,
        weights: impl Into<WeightFormat>,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Self> {
        let format = weights.into();
        let config = load_config(model_dir)?;
        for warning in &config.warnings {
            progress(LoadProgress::Warning(warning.clone()));
        }
        let expected = expected_weights(&config, format)?;
        check_plan(
            model_dir,
            &config,
            &options,
            &expected,
            format,
            gpu.as_ref(),
        )?;
        let aside = crate::loader::set_aside(&config);
        let store = load_safetensors_with(
            model_dir,
            &expected,
            &aside,
            gpu.as_ref(),
            format.dtype,
            progress,
        )?;
        Self::assemble(gpu, config, options, store)
    }

    /// The model for `config` owning `store`; on failure the store is
    /// released.
    fn assemble(
        gpu: Arc<dyn GpuBackend>,
        config: ModelConfig,
        options: ModelOptions,
        mut store: WeightStore,
    ) -> Result<Self> {
        let options = options.for_weights(&store);
        let mut model = match TransformerModel::new(gpu.clone(), config, options) {
            Ok(m) => m,
            Err(e) => {
                let _ = store.release(gpu.as_ref());
                return Err(e);
            }
        };
        // From here the model owns the store; dropping it on error runs the
        // ordered teardown.
        model.attach_weights(store)?;
        Ok(model)
    }
}

impl TransformerModel {
    /// Like [`Self::load`], from a GGUF file: the config is rebuilt from its
    /// metadata ([`crate::gguf`]) and each tensor read under its Hugging
    /// Face name, the converter's transforms undone.
    pub fn load_gguf(
        path: &Path,
        gpu: Arc<dyn GpuBackend>,
        options: ModelOptions,
        weights: impl Into<WeightFormat>,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Self> {
        let gguf = crate::gguf::GgufModel::open(path)?;
        Self::from_gguf(&gguf, gpu, options, weights, progress)
    }

    /// Loads a model from `source`, a checkpoint directory or a GGUF file.
    pub fn load_source(
        source: &crate::gguf::ModelSource,
        gpu: Arc<dyn GpuBackend>,
        options: ModelOptions,
        weights: impl Into<WeightFormat>,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Self> {
        match source {
            crate::gguf::ModelSource::Dir(dir) => Self::load(dir, gpu, options, weights, progress),
            crate::gguf::ModelSource::Gguf(path) => {
                Self::load_gguf(path, gpu, options, weights, progress)
            }
        }
    }

    /// Loads an opened [`GgufModel`](crate::gguf::GgufModel).
    pub fn from_gguf(
        gguf: &crate::gguf::GgufModel,
        gpu: Arc<dyn GpuBackend>,
        options: ModelOptions,
        weights: impl Into<WeightFormat>,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Self> {
        let format = weights.into();
        let config = gguf.config.clone();
        for warning in &config.warnings {
            progress(LoadProgress::Warning(warning.clone()));
        }
        let mut expected = gguf.expected_tensors()?;
        if let Some(ftype) = format.quant {
            let changed = crate::gguf::file_quant_types(&gguf.file, &config, ftype);
            for e in &mut expected {
                e.quantize = e.sources.first().and_then(|s| changed.get(s)).copied();
            }
        }
        let stored: std::collections::HashMap<&str, metrale_core::DType> = expected
            .iter()
            .filter_map(|e| {
                let t = gguf.file.get_tensor(e.sources.first()?)?;
                Some((e.name.as_str(), device_dtype(t.ggml_type())?))
            })
            .collect();
        let quantized: std::collections::HashMap<&str, metrale_core::DType> = expected
            .iter()
            .filter_map(|e| Some((e.name.as_str(), quant_dtype(e.quantize?)?)))
            .collect();
        let held = |spec: &crate::config::TensorSpec| {
            let name = spec.name.as_str();
            quantized.get(name).copied().unwrap_or_else(|| {
                format.dtype.target(
                    stored
                        .get(name)
                        .copied()
                        .unwrap_or(metrale_core::DType::F32),
                )
            })
        };
        MemoryPlan::new(gpu.as_ref(), &config, &options, &held)?.check(gpu.as_ref())?;
        let aside = crate::loader::set_aside(&config);
        let store = load_gguf_with(
            &gguf.file,
            &expected,
            &aside,
            gpu.as_ref(),
            format.dtype,
            progress,
        )?;
        Self::assemble(gpu, config, options, store)
    }
}

/// Checks the model's memory plan against what `gpu` has left, with each
/// tensor held as the checkpoint's headers and `format` say (at its block
/// format when `expected` quantizes it). Headers that
/// cannot be read are left to the loader, which names what is wrong.
fn check_plan(
    dir: &Path,
    config: &ModelConfig,
    options: &ModelOptions,
    expected: &[ExpectedTensor],
    format: WeightFormat,
    gpu: &dyn GpuBackend,
) -> Result<()> {
    let Ok(stored) = metrale_model_weights::loader::scan_safetensors(dir) else {
        return Ok(());
    };
    let stored: std::collections::HashMap<&str, &str> = stored
        .iter()
        .map(|t| (t.name.as_str(), t.dtype.as_str()))
        .collect();
    let quantized: std::collections::HashMap<&str, metrale_core::DType> = expected
        .iter()
        .filter_map(|e| Some((e.name.as_str(), quant_dtype(e.quantize?)?)))
        .collect();
    let held = |spec: &crate::config::TensorSpec| {
        if let Some(&q) = quantized.get(spec.name.as_str()) {
            return q;
        }
        let as_stored = stored
            .get(spec.name.as_str())
            .and_then(|name| StoredDType::parse(name).weight_dtype())
            .unwrap_or(metrale_core::DType::F32);
        format.dtype.target(as_stored)
    };
    MemoryPlan::new(gpu, config, options, &held)?.check(gpu)
}

/// The device dtype of weights quantized to `ty`.
fn quant_dtype(ty: metrale_core::quant::GgmlType) -> Option<metrale_core::DType> {
    metrale_core::QuantFormat::new(ty).map(metrale_core::DType::Quant)
}
