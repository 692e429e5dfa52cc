//! A model's memory plan: every byte it will allocate on its backend, by
//! owner, known from the config and the options before anything is
//! allocated, and checked against what the backend has left. A model that
//! cannot fit is refused at once with the sizes involved, instead of filling
//! memory for minutes and then failing (or meeting the OOM killer).

use metrale_core::DType;
use metrale_gpu_runtime::gpu::GpuBackend;

use super::types::{ModelOptions, arena_plan, kv_spec, recurrent_state_shapes};
use crate::config::{DeltaProjNames, FfnNames, MixerKind, MixerNames, ModelConfig, TensorSpec};
use crate::error::{EngineError, Result};

/// Bytes per owner. Sizes saturate instead of overflowing, so an absurd
/// config or option gives a plan that is simply too large.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryPlan {
    pub weights: usize,
    /// Row-permuted copies made at load (`derived.rs`).
    pub derived: usize,
    pub kv_cache: usize,
    pub ssm_state: usize,
    pub activations: usize,
    /// The prefix cache's budget for recurrent-state snapshots, allocated
    /// as requests run (none at load).
    pub snapshots: usize,
}

impl MemoryPlan {
    /// The plan of `config` with `options` on `gpu` (whose layouts size the
    /// caches); `weight_dtype` gives the dtype the backend holds each
    /// expected tensor in. An error: the backend cannot lay out the caches
    /// as asked (a KV dtype it does not store).
    pub fn new(
        gpu: &dyn GpuBackend,
        config: &ModelConfig,
        options: &ModelOptions,
        weight_dtype: &dyn Fn(&TensorSpec) -> DType,
    ) -> Result<Self> {
        let derived_names = derived_tensors(config);
        let (mut weights, mut derived) = (0usize, 0usize);
        let mut seen = std::collections::HashSet::new();
        for spec in config.expected_tensors() {
            if !seen.insert(spec.name.clone()) {
                continue;
            }
            let elements = spec.shape.iter().fold(1usize, |a, &d| a.saturating_mul(d));
            let dtype = weight_dtype(&spec);
            // Quantized weights take whole blocks.
            let bytes = dtype
                .bytes_for(elements)
                .unwrap_or(elements.saturating_mul(dtype.size_of()));
            weights = weights.saturating_add(bytes);
            if derived_names.contains(&spec.name) {
                derived = derived.saturating_add(bytes);
            }
        }
        derived = derived.saturating_add(derived_tables(config));
        let f32s = |n: usize| n.saturating_mul(4);
        let layout = gpu
            .kv_layout(kv_spec(config, options))
            .map_err(EngineError::device("laying out the KV cache"))?;
        let kv_cache = layout
            .block_bytes()
            .saturating_mul(options.kv_blocks)
            .saturating_mul(config.attention_layers().count());
        let ssm_state = recurrent_state_shapes(config)
            .iter()
            .map(|s| {
                s.slot_bytes(gpu, options.ssm_state_dtype)
                    .saturating_mul(options.max_seqs)
            })
            .fold(0usize, usize::saturating_add);
        Ok(Self {
            weights,
            derived,
            kv_cache,
            ssm_state,
            activations: f32s(arena_plan(config, options).total_elements()),
            snapshots: snapshot_budget(gpu, config, options),
        })
    }

    /// Bytes a load allocates (everything but the snapshots, which are
    /// taken as requests run).
    pub fn at_load(&self) -> usize {
        self.total().saturating_sub(self.snapshots)
    }

    pub fn total(&self) -> usize {
        [
            self.weights,
            self.derived,
            self.kv_cache,
            self.ssm_state,
            self.activations,
            self.snapshots,
        ]
        .iter()
        .fold(0usize, |a, &b| a.saturating_add(b))
    }

    /// Refuses the plan when the backend says it has less memory left.
    pub fn check(&self, gpu: &dyn GpuBackend) -> Result<()> {
        let Some(available) = gpu.available_memory() else {
            return Ok(());
        };
        if self.total() <= available {
            return Ok(());
        }
        Err(EngineError::Exhausted {
            resource: "memory",
            detail: format!(
                "the model needs {} ({}), but {} has {} available (the lower of the \
                 host's available memory, its cgroup limit and any --memory-limit); \
                 fewer KV blocks, sequences or batch tokens, or a smaller dtype, need less",
                human(self.total()),
                self.breakdown(),
                gpu.name(),
                human(available)
            ),
        })
    }

    /// "weights 1.2 GiB, KV cache 64.0 MiB, ..." (owners with any bytes).
    pub fn breakdown(&self) -> String {
        [
            ("weights", self.weights),
            ("derived weights", self.derived),
            ("KV cache", self.kv_cache),
            ("SSM state", self.ssm_state),
            ("activations", self.activations),
            ("prefix snapshots", self.snapshots),
        ]
        .iter()
        .filter(|(_, b)| *b > 0)
        .map(|(what, b)| format!("{what} {}", human(*b)))
        .collect::<Vec<_>>()
        .join(", ")
    }
}

/// The expected tensors that `derived.rs` copies at load (row-permuted).
fn derived_tensors(config: &ModelConfig) -> Vec<String> {
    let gated = config.attention.as_ref().is_some_and(|a| a.output_gate);
    let mut names = Vec::new();
    for layer in &config.layers {
        match (&layer.names.mixer, layer.mixer) {
            (MixerNames::Attention(a), MixerKind::Attention) if gated => {
                names.push(a.q.clone());
                names.extend(a.q_bias.clone());
            }
            (MixerNames::GatedDeltaNet(d), MixerKind::GatedDeltaNet) => {
                if let DeltaProjNames::Grouped { qkvz, ba } = &d.proj {
                    names.push(qkvz.clone());
                    names.push(ba.clone());
                }
            }
            _ => {}
        }
    }
    names
}

/// Bytes of the small tables derived at load: RoPE's inverse frequencies
/// and, per MoE layer, one table of expert weight addresses per projection.
fn derived_tables(config: &ModelConfig) -> usize {
    let rope = config
        .attention
        .as_ref()
        .and_then(|a| a.rope.as_ref())
        .map_or(0, |r| (r.rotary_dim / 2).max(1) * 4);
    let experts: usize = config
        .layers
        .iter()
        .filter_map(|l| match (&l.names.ffn, &config.moe) {
            (FfnNames::Moe(n), Some(m)) => {
                Some(super::experts::tables_per_layer(&n.experts) * m.n_experts.max(1) * 8)
            }
            _ => None,
        })
        .sum();
    rope + experts
}

/// Bytes in binary units, e.g. "1.5 GiB".
pub fn human(bytes: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// Bytes the prefix cache may keep in recurrent-state snapshots: the
/// option's, else twice the SSM state pool (0 without recurrent layers or
/// with prefix caching off).
pub fn snapshot_budget(
    gpu: &dyn GpuBackend,
    config: &ModelConfig,
    options: &ModelOptions,
) -> usize {
    let p = &options.prefix_cache;
    let shapes = recurrent_state_shapes(config);
    if !p.enabled || shapes.is_empty() {
        return 0;
    }
    p.snapshot_budget.unwrap_or_else(|| {
        let slot: usize = shapes
            .iter()
            .map(|s| s.slot_bytes(gpu, options.ssm_state_dtype))
            .fold(0, usize::saturating_add);
        slot.saturating_mul(options.max_seqs).saturating_mul(2)
    })
}
