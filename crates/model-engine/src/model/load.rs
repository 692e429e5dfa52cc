//! Loading a model directory into a ready [`TransformerModel`].

use std::path::Path;
use std::sync::Arc;

use metrale_core::scope::ModelResource;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_weights::loader::{LoadProgress, WeightDType};

use super::{ModelOptions, TransformerModel};
use crate::config::load_config;
use crate::error::Result;
use crate::loader::load_weights;

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
        dtype: WeightDType,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Self> {
        let config = load_config(model_dir)?;
        for warning in &config.warnings {
            progress(LoadProgress::Warning(warning.clone()));
        }
        let mut store = load_weights(model_dir, &config, gpu.as_ref(), dtype, progress)?;
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
