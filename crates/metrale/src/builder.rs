//! The one-line way to a [`Generator`] ([`Generator::from_dir`]) and the
//! builder behind it for everything else ([`Generator::builder`]): which
//! model (a directory, a `.safetensors` file or a hub id in the local
//! cache, as [`resolve_model`](crate::resolve_model) takes them), on which
//! device, with how many threads, how much memory and how long a context.

use std::path::{Path, PathBuf};

use anyhow::Result;
use metrale_core::DType;
use metrale_model_weights::loader::{LoadProgress, WeightDType};

use crate::{Device, EngineConfig, Generator, LoadOptions};

impl Generator {
    /// Loads the model at `path` with every default: the best device of
    /// this build, one thread per core, the checkpoint's sampling defaults.
    ///
    /// ```
    /// # fn main() -> anyhow::Result<()> {
    /// let mut generator = metrale::Generator::from_dir(metrale::bundled_model_dir()?)?;
    /// let params = metrale::SamplingParams {
    ///     max_tokens: Some(8),
    ///     ..metrale::SamplingParams::greedy()
    /// };
    /// let out = generator.generate("The capital of France is", &params)?;
    /// assert!(out.tokens.len() <= 8);
    /// generator.shutdown()?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn from_dir(path: impl AsRef<Path>) -> Result<Generator> {
        Generator::builder(path.as_ref()).build()
    }

    /// Options for loading the model `spec` names: a directory, a
    /// `.safetensors` file in one, or a Hugging Face hub id (`org/name`) in
    /// the local cache.
    ///
    /// ```
    /// # fn main() -> anyhow::Result<()> {
    /// use metrale::{Device, Generator};
    /// let generator = Generator::builder(metrale::bundled_model_dir()?)
    ///     .device(Device::Cpu)
    ///     .threads(2)
    ///     .max_model_len(256)
    ///     .build()?;
    /// assert_eq!(generator.engine().config().max_model_len, 256);
    /// generator.shutdown()?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder(spec: impl Into<PathBuf>) -> GeneratorBuilder {
        GeneratorBuilder {
            spec: spec.into(),
            revision: None,
            options: LoadOptions::default(),
            engine: EngineConfig::default(),
            progress: None,
        }
    }
}

type Progress = Box<dyn FnMut(LoadProgress)>;

/// How to load a [`Generator`]; from [`Generator::builder`].
#[must_use = "a builder does nothing until .build()"]
pub struct GeneratorBuilder {
    spec: PathBuf,
    revision: Option<String>,
    options: LoadOptions,
    engine: EngineConfig,
    progress: Option<Progress>,
}

impl GeneratorBuilder {
    /// The backend (default [`Device::Auto`]: the best of this build).
    pub fn device(mut self, device: Device) -> Self {
        self.options.device = device;
        self
    }

    /// CPU worker threads (default 0: one per core).
    pub fn threads(mut self, threads: usize) -> Self {
        self.options.threads = threads;
        self
    }

    /// The most bytes the backend may hold; the memory plan is checked
    /// against it before anything is allocated.
    pub fn memory_limit(mut self, bytes: usize) -> Self {
        self.options.memory_limit = Some(bytes);
        self
    }

    /// bf16 arithmetic for bf16 weights (the CLI's `--dtype bf16`); the
    /// default is f32 arithmetic throughout.
    pub fn bf16_arithmetic(mut self, on: bool) -> Self {
        self.options.bf16_dot_products = on;
        self
    }

    /// How the weights are held in memory (default: as stored).
    pub fn weight_dtype(mut self, dtype: WeightDType) -> Self {
        self.options.dtype = dtype;
        self
    }

    /// The KV cache's element type (default: the backend's, f32 on the CPU).
    pub fn kv_dtype(mut self, dtype: DType) -> Self {
        self.options.model.kv_dtype = Some(dtype);
        self
    }

    /// The most sequences in flight at once.
    pub fn max_seqs(mut self, seqs: usize) -> Self {
        self.options.model.max_seqs = seqs;
        self
    }

    /// The longest sequence (prompt plus output) a request may have (vLLM's
    /// `max_model_len`, llama.cpp's `--ctx-size`); default: the model's.
    pub fn max_model_len(mut self, tokens: usize) -> Self {
        self.engine.max_model_len = tokens;
        self
    }

    /// The hub revision (branch, tag or commit) when the spec is a hub id.
    pub fn revision(mut self, revision: impl Into<String>) -> Self {
        self.revision = Some(revision.into());
        self
    }

    /// Every other load option at once.
    pub fn load_options(mut self, options: LoadOptions) -> Self {
        self.options = options;
        self
    }

    /// Every engine option at once.
    pub fn engine_config(mut self, config: EngineConfig) -> Self {
        self.engine = config;
        self
    }

    /// Called as the weights load (for a progress bar).
    pub fn on_progress(mut self, progress: impl FnMut(LoadProgress) + 'static) -> Self {
        self.progress = Some(Box::new(progress));
        self
    }

    /// Resolves the model, loads it and puts it under an engine.
    pub fn build(mut self) -> Result<Generator> {
        let dir = crate::resolve_model(&self.spec, self.revision.as_deref())?;
        let mut ignore = |_: LoadProgress| {};
        let progress: &mut dyn FnMut(LoadProgress) = match self.progress.as_mut() {
            Some(f) => f,
            None => &mut ignore,
        };
        Generator::load(&dir, &self.options, self.engine, progress)
    }
}
