//! `TransformerModel`: the backend and every resource a loaded model owns.

mod teardown;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use metrale_core::DType;
use metrale_core::scope::ModelResource;
use metrale_gpu_runtime::arena::{ArenaPlan, BufferArena};
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_gpu_runtime::ops::KvSpec;
use metrale_model_weights::weights::WeightStore;
use parking_lot::{Mutex, MutexGuard};

use crate::cache::kv::DEFAULT_BLOCK_SIZE;
use crate::cache::{KvCache, SsmSnapshots, SsmStatePool, StateShape};
use crate::config::{MixerKind, ModelConfig};
use crate::error::{EngineError, Result};
use crate::model::derived::DerivedWeights;
use crate::model::forward::{DecodeGraphs, step_meta_words};
use crate::model::memory::snapshot_budget;
use crate::model::prefix::PrefixCacheOptions;
use crate::model::resolve::resolve;
use crate::model::weights::ModelWeights;

/// How much per-sequence memory to set aside.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelOptions {
    /// Tokens per KV block.
    pub kv_block_size: usize,
    /// KV blocks in the cache (shared by all sequences).
    pub kv_blocks: usize,
    /// Concurrent sequences (SSM state slots).
    pub max_seqs: usize,
    /// Most tokens one forward step processes (sizes the activation arena).
    pub max_batch_tokens: usize,
    /// The KV cache's element type; `None`: the backend's default (f32 on
    /// the CPU), or see `kv_follows_weights`. See `GpuBackend::kv_layout`.
    pub kv_dtype: Option<DType>,
    /// With `kv_dtype` `None`: cache in f16 when most of the weights (by
    /// parameters) are held in a narrower type than f32 (bf16, f16 or
    /// quantized), as llama.cpp caches in f16 and vLLM's `kv_cache_dtype =
    /// "auto"` takes a narrow type for a narrow model; f32 weights keep the
    /// backend's default. f16 rather than bf16: the same bytes, and on the
    /// fixtures it moves the logits 4 to 10 times less (docs/ACCURACY.md). Resolved when the
    /// weights are loaded ([`ModelOptions::for_weights`]). The CLI's
    /// `--kv-dtype auto` under `--dtype auto|bf16`.
    pub kv_follows_weights: bool,
    /// The Mamba-2 and gated-delta layers' SSM states' element type; `None`:
    /// the backend's (`GpuBackend::ssm_state_layout`: bf16 on a CPU
    /// backend made `with_bf16_ssm_state`, else f32), or see
    /// `ssm_state_follows_weights`.
    pub ssm_state_dtype: Option<DType>,
    /// With `ssm_state_dtype` `None`: hold the SSM states in f32 when most
    /// of the weights (by parameters) are held in f32, whatever narrower
    /// type the backend was made with, so that an f32 checkpoint runs as
    /// exactly under the defaults as its f32 arithmetic does. Resolved with
    /// `kv_follows_weights` ([`ModelOptions::for_weights`]). The CLI's
    /// `--ssm-state-dtype auto` under `--dtype auto|bf16`.
    pub ssm_state_follows_weights: bool,
    /// Replay decode steps as captured device graphs where the backend
    /// supports them (CUDA): a step of B single-token sequences runs as one
    /// graph launch instead of hundreds of kernel launches. Off: every step
    /// runs eagerly (what a backend without graphs always does).
    pub cuda_graphs: bool,
    /// Reuse of cached prefixes across sequences (`model/prefix.rs`).
    pub prefix_cache: PrefixCacheOptions,
}

impl Default for ModelOptions {
    fn default() -> Self {
        Self {
            kv_block_size: DEFAULT_BLOCK_SIZE,
            kv_blocks: 256,
            max_seqs: 16,
            max_batch_tokens: 512,
            kv_dtype: None,
            kv_follows_weights: false,
            ssm_state_dtype: None,
            ssm_state_follows_weights: false,
            cuda_graphs: true,
            prefix_cache: PrefixCacheOptions::default(),
        }
    }
}

impl ModelOptions {
    /// These options with [`kv_follows_weights`](Self::kv_follows_weights)
    /// and [`ssm_state_follows_weights`](Self::ssm_state_follows_weights)
    /// resolved against the weights in `store`: `kv_dtype` f16 where most
    /// of their parameters are held narrower than f32, `ssm_state_dtype`
    /// f32 where they are not.
    pub fn for_weights(mut self, store: &WeightStore) -> Self {
        let (mut wide, mut narrow) = (0usize, 0usize);
        for t in store.names().filter_map(|n| store.get(n).ok()) {
            match t.dtype() {
                DType::F32 => wide += t.elements(),
                _ => narrow += t.elements(),
            }
        }
        self.resolve_follows(narrow > wide);
        self
    }

    /// Resolves the `*_follows_weights` options, given whether most of the
    /// weights' parameters are held narrower than f32 (`metrale inspect`
    /// counts them without loading).
    pub fn resolve_follows(&mut self, narrow_weights: bool) {
        if self.kv_dtype.is_none() && self.kv_follows_weights && narrow_weights {
            self.kv_dtype = Some(DType::F16);
        }
        if self.ssm_state_dtype.is_none() && self.ssm_state_follows_weights && !narrow_weights {
            self.ssm_state_dtype = Some(DType::F32);
        }
    }
}

/// A model and everything it owns on its backend. Teardown order and error
/// behaviour: see `teardown.rs`.
pub struct TransformerModel {
    pub(crate) gpu: Arc<dyn GpuBackend>,
    pub(crate) config: ModelConfig,
    pub(crate) options: ModelOptions,
    pub(crate) derived: DerivedWeights,
    pub(crate) ssm_snapshots: SsmSnapshots,
    pub(crate) ssm_pool: Arc<SsmStatePool>,
    pub(crate) kv_cache: Mutex<KvCache>,
    pub(crate) buffers: BufferArena,
    pub(crate) weight_store: Option<WeightStore>,
    /// Device handles of the weights the plan uses (into the store and `derived`).
    pub(crate) weights: Option<ModelWeights>,
    /// Forward steps share the arena: one at a time.
    pub(crate) forward_lock: Mutex<()>,
    /// Captured decode graphs, by batch size (`forward/graphs.rs`).
    pub(crate) graphs: Mutex<DecodeGraphs>,
    released: bool,
}

impl TransformerModel {
    /// Builds the model's pools (KV cache, SSM state pool, activation arena)
    /// on `gpu`. Weights come later (`adopt_weight_store`). On failure every
    /// allocation made here is freed.
    pub fn new(
        gpu: Arc<dyn GpuBackend>,
        config: ModelConfig,
        options: ModelOptions,
    ) -> Result<Self> {
        let g: &dyn GpuBackend = gpu.as_ref();
        // A backend without an op the plan needs refuses the model here,
        // before anything is allocated.
        crate::conformance::check_supported(g, &config)?;
        let shapes = recurrent_state_shapes(&config);
        let mut pool =
            SsmStatePool::allocate(g, &shapes, options.max_seqs, options.ssm_state_dtype)?;
        let n_attn = config.attention_layers().count();
        let mut kv =
            match KvCache::allocate(g, n_attn, kv_spec(&config, &options), options.kv_blocks) {
                Ok(kv) => kv,
                Err(e) => {
                    let _ = pool.release(g);
                    return Err(e);
                }
            };
        kv.set_prefix_cache(options.prefix_cache.enabled);
        let snapshots = SsmSnapshots::with_budget(snapshot_budget(g, &config, &options));
        let buffers = match BufferArena::allocate(g, arena_plan(&config, &options)) {
            Ok(b) => b,
            Err(source) => {
                let _ = kv.release(g);
                let _ = pool.release(g);
                return Err(EngineError::Device {
                    context: "allocating the activation arena".into(),
                    source,
                });
            }
        };
        Ok(Self {
            gpu,
            config,
            options,
            derived: DerivedWeights::new(),
            ssm_snapshots: snapshots,
            ssm_pool: Arc::new(pool),
            kv_cache: Mutex::new(kv),
            buffers,
            weight_store: None,
            weights: None,
            forward_lock: Mutex::new(()),
            graphs: Mutex::new(DecodeGraphs::default()),
            released: false,
        })
    }

    pub fn gpu(&self) -> &dyn GpuBackend {
        self.gpu.as_ref()
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn options(&self) -> &ModelOptions {
        &self.options
    }

    pub fn ssm_pool(&self) -> &Arc<SsmStatePool> {
        &self.ssm_pool
    }

    pub fn kv_cache(&self) -> MutexGuard<'_, KvCache> {
        self.kv_cache.lock()
    }

    pub fn snapshots(&mut self) -> &mut SsmSnapshots {
        &mut self.ssm_snapshots
    }

    /// Adopts `store` and resolves the plan's weights from it (making the
    /// derived copies the kernels need). On failure the store is still
    /// adopted, so teardown frees it.
    pub fn attach_weights(&mut self, store: WeightStore) -> Result<()> {
        // Graphs captured before point at the weights being replaced.
        if let Err(e) = self.graphs.get_mut().release(self.gpu.as_ref()) {
            tracing::warn!("releasing decode graphs before new weights: {e}");
        }
        self.adopt_weight_store(store);
        let store = self
            .weight_store
            .as_mut()
            .ok_or_else(|| EngineError::Internal("no weight store".into()))?;
        let weights = resolve(&self.config, store, &mut self.derived, self.gpu.as_ref())?;
        self.weights = Some(weights);
        Ok(())
    }

    pub fn weight_store(&self) -> Option<&WeightStore> {
        self.weight_store.as_ref()
    }

    /// Releases everything this model owns, in the specified order, and
    /// reports the first failure. See `teardown.rs`.
    pub fn shutdown(mut self) -> anyhow::Result<()> {
        self.released = true;
        self.release_pools()
    }
}

impl Drop for TransformerModel {
    /// A safety net for models dropped without `shutdown`: the same ordered
    /// release, with failures logged since `Drop` cannot return them.
    fn drop(&mut self) {
        if !self.released {
            self.released = true;
            if let Err(e) = self.release_pools() {
                tracing::error!("model dropped without shutdown; teardown failed: {e:#}");
            }
        }
    }
}

/// What the KV cache asks the backend to lay out.
pub fn kv_spec(config: &ModelConfig, options: &ModelOptions) -> KvSpec {
    KvSpec {
        kv_width: config.attention.as_ref().map_or(0, |a| a.kv_width()),
        block_size: options.kv_block_size,
        dtype: options.kv_dtype,
    }
}

/// Per recurrent layer (in layer order), the state it keeps per sequence.
pub fn recurrent_state_shapes(config: &ModelConfig) -> Vec<StateShape> {
    config
        .layers
        .iter()
        .filter_map(|l| match l.mixer {
            MixerKind::Mamba2 => config.mamba.as_ref().map(|m| StateShape {
                conv: m.conv_dim() * (m.conv_kernel - 1),
                ssm: m.n_heads * m.head_dim * m.d_state,
            }),
            MixerKind::GatedDeltaNet => config.deltanet.as_ref().map(|d| StateShape {
                conv: d.conv_dim() * (d.conv_kernel - 1),
                ssm: d.n_v_heads * d.k_head_dim * d.v_head_dim,
            }),
            // The conv window alone (the pool keeps a one-element SSM part).
            MixerKind::ShortConv => config.short_conv.as_ref().map(|c| StateShape {
                conv: c.state_elements(config.hidden_size),
                ssm: 0,
            }),
            _ => None,
        })
        .collect()
}

/// Rows of logits computed per LM-head pass.
pub const LOGIT_ROWS: usize = 64;
/// Generic scratch regions each mixer maps its intermediates onto.
pub const SCRATCH_REGIONS: [&str; 10] =
    ["r0", "r1", "r2", "r3", "r4", "r5", "r6", "r7", "r8", "r9"];

/// Widest per-token intermediate of any mixer or router.
pub fn widest_intermediate(config: &ModelConfig) -> usize {
    let mut widest = config.hidden_size;
    if let Some(a) = &config.attention {
        widest = widest.max(2 * a.q_width()).max(a.kv_width());
    }
    if let Some(m) = &config.mamba {
        widest = widest.max(m.in_proj_dim());
    }
    if let Some(d) = &config.deltanet {
        widest = widest
            .max(2 * d.key_dim() + 2 * d.value_dim())
            .max(2 * d.n_v_heads);
    }
    if let Some(m) = &config.moe {
        widest = widest.max(m.n_experts);
    }
    widest
}

/// Widest MLP intermediate (dense, expert or shared).
pub fn widest_ffn(config: &ModelConfig) -> usize {
    let mut inter = config.mlp.as_ref().map_or(0, |m| m.intermediate_size);
    if let Some(m) = &config.moe {
        inter = inter
            .max(m.expert_intermediate)
            .max(m.shared_intermediate.unwrap_or(0));
    }
    inter.max(1)
}

/// Activation scratch for steps of up to `options.max_batch_tokens` rows.
/// Sizes saturate: absurd options give a plan too large to allocate (and
/// refused by the memory plan), never an overflow.
pub fn arena_plan(config: &ModelConfig, options: &ModelOptions) -> ArenaPlan {
    let t = options.max_batch_tokens.max(1);
    // With prefix caching, sequences share blocks, so a step's block tables
    // can list a block once per sequence.
    let table_entries = if options.prefix_cache.enabled {
        options
            .kv_blocks
            .saturating_mul(t.min(options.max_seqs.max(1)))
    } else {
        options.kv_blocks
    };
    let rows = |width: usize| t.saturating_mul(width);
    let h = config.hidden_size;
    let (widest, inter) = (widest_intermediate(config), widest_ffn(config));
    let mut plan = ArenaPlan::new()
        .region("residual", rows(h))
        .region("normed", rows(h))
        .region("mixed", rows(h));
    for r in SCRATCH_REGIONS {
        plan = plan.region(r, rows(widest));
    }
    // A MoE layer's grouped experts see every (token, expert) pair as a row.
    let (n_experts, top_k) = config
        .moe
        .as_ref()
        .map_or((0, 0), |m| (m.n_experts, m.top_k));
    let routed = t.saturating_mul(top_k);
    let ffn_rows = t.max(routed);
    let ffn = |width: usize| ffn_rows.saturating_mul(width);
    plan.region("ffn_a", ffn(2 * inter))
        .region("ffn_b", ffn(2 * inter))
        .region("ffn_out", ffn(h))
        .region("expert_in", ffn(h))
        .region("logits", t.min(LOGIT_ROWS) * config.vocab_size)
        .region("route_experts", routed)
        .region("route_weights", routed)
        .region("group_offsets", n_experts + 1)
        .region("group_rows", routed)
        .region("group_weights", routed)
        .region("step_meta", step_meta_words(t, table_entries))
}
