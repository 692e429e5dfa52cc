//! metrale: LLM inference for hybrid transformer / state-space models.
//!
//! The facade: load a Hugging Face model, generate from it, tear it down.
//! Most programs need only [`Generator`]:
//!
//! ```
//! # fn main() -> anyhow::Result<()> {
//! use metrale::{Generator, SamplingParams, StreamEvent};
//!
//! // A model directory, a .safetensors file or a hub id in the local cache;
//! // here the tiny model bundled into this build (trained on quotations).
//! let mut generator = Generator::from_dir(metrale::bundled_model_dir()?)?;
//!
//! // The checkpoint's own sampling defaults (generation_config.json) ...
//! let mut params = generator.default_params();
//! // ... with what this call needs changed.
//! params.max_tokens = Some(16);
//! params.seed = Some(7);
//! let out = generator.generate("The capital of France is", &params)?;
//! println!("{} ({:?}, {} tokens)", out.text, out.finish_reason, out.usage.completion_tokens);
//!
//! // Streamed: tokens as they come; dropping the stream cancels the request.
//! for event in generator.stream("Once upon a time", &SamplingParams::greedy())? {
//!     match event? {
//!         StreamEvent::Token { text, .. } => print!("{text}"),
//!         StreamEvent::Finished { reason, .. } => println!(" [{reason:?}]"),
//!         // Only with `prompt_logprobs`.
//!         StreamEvent::PromptLogprobs { .. } => {}
//!     }
//! }
//!
//! // Several prompts at once, batched by the engine.
//! let outs = generator.generate_batch(&["a", "b", "c"], &params)?;
//! assert_eq!(outs.len(), 3);
//!
//! // Teardown in the specified order, reporting every failure.
//! generator.shutdown()?;
//! # Ok(())
//! # }
//! ```
//!
//! [`Generator::builder`] chooses the device, threads, memory limit and
//! context length; [`Generator::spawn`] moves a generator to a thread of
//! its own for requests from many threads; [`Model`] is the level below
//! (logits for token ids). The crates behind the facade can be used one by
//! one: [`metrale_core`], [`metrale_gpu_runtime`], [`metrale_model_weights`],
//! [`metrale_model_engine`]. `examples/` has runnable programs (`cargo run
//! --example generate | stream | batch | chat`).
//!
//! A model is named by [`resolve_model`] (a directory, a `.safetensors`
//! file, or a Hugging Face hub id in the local cache); its sampling
//! defaults are the checkpoint's `generation_config.json`
//! ([`GenerationDefaults`], [`Generator::default_params`]), for the
//! library, the CLI and the server alike.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};

pub use metrale_core as core;
pub use metrale_gpu_runtime as gpu_runtime;
pub use metrale_model_engine as engine;
pub use metrale_model_weights as weights;

mod builder;
pub use builder::GeneratorBuilder;
mod bundled;
mod chat_tokens;
pub use bundled::{CACHE_ENV, bundled_model_dir, cache_root, has_bundled_model};
pub use chat_tokens::ChatTokens;
mod device;
pub mod flags;
pub use device::{
    Backend, BackendOptions, CPU_KERNEL_ENV, Device, DeviceInfo, ParseDeviceError,
    announce_device_choice, open_backend, parse_cpu_kernel,
};
pub use metrale_gpu_runtime::cpu::{Bf16Kernel, OpTime, amx_peak_block};
mod generate;
pub use generate::{
    Generation, GenerationStream, Generator, MODEL_ENV, StreamEvent, Timings, default_model_dir,
};
pub use metrale_core::DType;
pub use metrale_model_engine::chat::{ChatMessage, ChatTemplate, RenderedChat, encode_chat};
pub use metrale_model_engine::engine::{EngineConfig, PromptLogprob, RequestId, Usage};
pub use metrale_model_engine::model::{ModelOptions, PrefixCacheOptions};
pub use metrale_model_engine::sampling::{
    Finish, GenerationDefaults, OutputConstraint, SamplingOverrides, SamplingParams,
};
pub use metrale_model_engine::tokenizer::Tokenizer;
pub use metrale_model_weights::gguf::mix::FileType;
pub use metrale_model_weights::loader::{LoadProgress, WeightDType, WeightFormat};
mod hub;
pub use hub::{
    DEFAULT_REVISION, hub_cache_dir, hub_cache_dir_from, is_hub_id, model_dir, resolve_model,
    resolve_model_in,
};
mod report;
pub use report::format_error;
mod runner;
/// The OpenAI-compatible HTTP server (`metrale serve`).
#[cfg(feature = "server")]
pub mod server;
pub use runner::{CancelOnDrop, EventSink, GeneratorHandle, RequestStream};

use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_engine::gguf::ModelSource;
use metrale_model_engine::model::{Logits, Step, TransformerModel};

/// How to load a model.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// The backend to load onto (default: [`Device::Auto`], the best this
    /// build has).
    pub device: Device,
    /// CPU worker threads (0: one per core).
    pub threads: usize,
    /// How weights are held in memory.
    pub dtype: WeightDType,
    /// Quantize the float weights on load to this llama.cpp file type
    /// (`Q4_K_M`: llama.cpp's mix of Q4_K and Q6_K, chosen per tensor by
    /// its rules); `None` (the default): as `dtype` says.
    pub quant: Option<FileType>,
    /// KV cache, SSM slots and step size.
    pub model: ModelOptions,
    /// The most bytes the backend may hold (None: what the host has). The
    /// model's memory plan is checked against it before anything is
    /// allocated.
    pub memory_limit: Option<usize>,
    /// The arithmetic: matmuls with bf16 weights round their activations
    /// to bf16 and use bf16 dot products where the hardware has them
    /// ([`BackendOptions::bf16_dot_products`]; the CLI's `--dtype bf16`).
    /// Off (the default): f32 arithmetic throughout.
    pub bf16_dot_products: bool,
    /// Hold the SSM and delta-rule states in bf16
    /// ([`BackendOptions::bf16_ssm_state`]; the CLI's `--ssm-state-dtype bf16`).
    pub bf16_ssm_state: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            device: Device::Auto,
            threads: 0,
            dtype: WeightDType::AsStored,
            quant: None,
            model: ModelOptions::default(),
            memory_limit: None,
            bf16_dot_products: false,
            bf16_ssm_state: false,
        }
    }
}

/// A loaded model on its backend.
pub struct Model {
    dir: PathBuf,
    gpu: Arc<dyn GpuBackend>,
    model: TransformerModel,
}

impl Model {
    /// Loads `dir` (a checkpoint directory, or a `.gguf` file) on the
    /// backend `options.device` names, opened with
    /// `options.threads` and `options.memory_limit` ([`open_backend`]).
    pub fn load(
        dir: &Path,
        options: &LoadOptions,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Self> {
        let backend = open_backend(
            options.device,
            &BackendOptions {
                threads: options.threads,
                memory_limit: options.memory_limit,
                bf16_dot_products: options.bf16_dot_products,
                bf16_ssm_state: options.bf16_ssm_state,
                ..BackendOptions::default()
            },
        )?;
        Self::load_on(dir, backend.gpu().clone(), options, progress)
    }

    /// Loads `dir` on a given backend (`options.device`, `threads`,
    /// `memory_limit` and `bf16_dot_products` are the backend's business
    /// then, not read).
    pub fn load_on(
        dir: &Path,
        gpu: Arc<dyn GpuBackend>,
        options: &LoadOptions,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Self> {
        let source = ModelSource::from_path(dir);
        let format = WeightFormat {
            dtype: options.dtype,
            quant: options.quant,
        };
        let model =
            TransformerModel::load_source(&source, gpu.clone(), options.model, format, progress)
                .with_context(|| format!("loading {}", dir.display()))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            gpu,
            model,
        })
    }

    /// The model's path: its directory, or its GGUF file.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the model was read from.
    pub fn source(&self) -> ModelSource {
        ModelSource::from_path(&self.dir)
    }

    pub fn engine(&self) -> &TransformerModel {
        &self.model
    }

    pub fn backend(&self) -> &Arc<dyn GpuBackend> {
        &self.gpu
    }

    /// Logits `[ids.len(), vocab]` for every position of `ids`, computed by
    /// prefilling the first `decode_from` ids in one pass (all of them when
    /// `None`) and feeding the rest one token at a time through the decode path.
    /// More ids than the model's context (`max_position_embeddings`, the
    /// limit `generate` applies too) are refused, and so are logits that come
    /// out NaN or infinite (the error names the position).
    pub fn logits(&self, ids: &[u32], decode_from: Option<usize>) -> Result<Vec<f32>> {
        let config = self.model.config();
        let limit = config.max_position_embeddings;
        if ids.len() > limit {
            anyhow::bail!(
                "{} ids are more than the model's context of {limit} positions (max_position_embeddings)",
                ids.len()
            );
        }
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= config.vocab_size) {
            anyhow::bail!(
                "token id {bad} is outside the vocabulary of {}",
                config.vocab_size
            );
        }
        let logits = self.compute_logits(ids, decode_from)?;
        let vocab = config.vocab_size.max(1);
        if let Some(i) = logits.iter().position(|v| !v.is_finite()) {
            anyhow::bail!(
                "the logits at position {} (token id {}) are {}: the weights or the arithmetic overflowed",
                i / vocab,
                i % vocab,
                logits[i]
            );
        }
        Ok(logits)
    }

    fn compute_logits(&self, ids: &[u32], decode_from: Option<usize>) -> Result<Vec<f32>> {
        let prefill = decode_from.unwrap_or(ids.len()).min(ids.len());
        let chunk = self.model.options().max_batch_tokens;
        let mut seq = self.model.new_sequence()?;
        let result = (|| {
            let mut out = Vec::with_capacity(ids.len() * self.model.config().vocab_size);
            for piece in ids[..prefill].chunks(chunk) {
                out.extend(
                    self.model
                        .forward(&mut [Step {
                            seq: &mut seq,
                            tokens: piece,
                            logits: Logits::All,
                        }])?
                        .remove(0),
                );
            }
            for id in &ids[prefill..] {
                out.extend(
                    self.model
                        .forward(&mut [Step {
                            seq: &mut seq,
                            tokens: std::slice::from_ref(id),
                            logits: Logits::All,
                        }])?
                        .remove(0),
                );
            }
            Ok(out)
        })();
        self.model.free_sequence(seq);
        result
    }

    /// Tears the model down, reporting any failure.
    pub fn shutdown(self) -> Result<()> {
        self.model.shutdown()
    }
}
