//! A model's side of the backend conformance suite
//! ([`metrale_gpu_runtime::conformance`]): the op shapes of its
//! architecture, which the suite runs every op at, and the ops its forward
//! pass calls, which a backend must support to run it.

use metrale_gpu_runtime::GpuError;
use metrale_gpu_runtime::conformance::{
    ArchShapes, AttnShapes, DeltaShapes, MambaShapes, MlpShapes, MoeShapes,
};
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_gpu_runtime::ops::Op;

use crate::cache::kv::DEFAULT_BLOCK_SIZE;
use crate::config::{Activation, ExpertNames, FfnNames, MixerKind, MlpNames, ModelConfig, Routing};
use crate::error::{EngineError, Result};

/// The chunk size the forward pass gives the gated delta rule (HF's).
const DELTA_CHUNK: usize = 64;

/// Whether an MLP of these names runs SwiGLU (rather than relu²).
fn gated(names: &MlpNames) -> bool {
    !matches!(names, MlpNames::Plain { .. })
}

/// The names of the first MoE block, where the model has one.
fn first_moe(config: &ModelConfig) -> Option<&crate::config::MoeNames> {
    config.layers.iter().find_map(|l| match &l.names.ffn {
        FfnNames::Moe(m) => Some(m),
        _ => None,
    })
}

/// The op shapes of `config`'s architecture, at the engine's default KV
/// block size. Named after the model type (a caller may rename it).
pub fn arch_shapes(config: &ModelConfig) -> ArchShapes {
    let moe_names = first_moe(config);
    ArchShapes {
        name: config.model_type.as_str().to_string(),
        hidden: config.hidden_size,
        vocab: config.vocab_size,
        mlp: config.mlp.as_ref().map(|m| MlpShapes {
            intermediate: m.intermediate_size,
            gated: m.activation == Activation::SwiGlu,
        }),
        attention: config.attention.as_ref().map(|a| AttnShapes {
            n_heads: a.n_heads,
            n_kv_heads: a.n_kv_heads,
            head_dim: a.head_dim,
            rotary_dim: a.rope.as_ref().map_or(0, |r| r.rotary_dim),
            sliding_window: config.layers.iter().find_map(|l| l.sliding_window),
        }),
        block_size: DEFAULT_BLOCK_SIZE,
        short_conv: config.short_conv.as_ref().map(|c| c.kernel),
        mamba: config.mamba.as_ref().map(|m| MambaShapes {
            n_heads: m.n_heads,
            head_dim: m.head_dim,
            d_state: m.d_state,
            n_groups: m.n_groups,
            conv_kernel: m.conv_kernel,
            chunk_size: m.chunk_size,
            norm_group_size: m.d_inner() / m.norm_groups.max(1),
            dt_limit: m.time_step_limit,
        }),
        deltanet: config.deltanet.as_ref().map(|d| DeltaShapes {
            n_k_heads: d.n_k_heads,
            n_v_heads: d.n_v_heads,
            k_head_dim: d.k_head_dim,
            v_head_dim: d.v_head_dim,
            conv_kernel: d.conv_kernel,
            chunk_size: DELTA_CHUNK,
        }),
        moe: config.moe.as_ref().map(|m| MoeShapes {
            n_experts: m.n_experts,
            top_k: m.top_k,
            intermediate: m.expert_intermediate,
            gated: moe_names.is_none_or(|n| match &n.experts {
                ExpertNames::Separate(list) => list.first().is_none_or(gated),
                ExpertNames::Fused { .. } => true,
            }),
            shared_intermediate: m.shared_intermediate,
            groups: match m.routing {
                Routing::SigmoidGrouped {
                    n_group,
                    topk_group,
                    ..
                } => Some((n_group, topk_group)),
                Routing::Softmax => None,
            },
        }),
    }
}

/// The ops an MLP of these names runs.
fn mlp_ops(names: &MlpNames) -> Vec<Op> {
    match names {
        MlpNames::Split { bias: true, .. } => vec![Op::Matmul, Op::SiluMul],
        MlpNames::Split { .. } | MlpNames::Fused { .. } => vec![Op::MatmulSwiglu, Op::Matmul],
        MlpNames::Plain { .. } => vec![Op::Matmul, Op::Relu2],
    }
}

/// Every op `config`'s forward pass (and its load) calls, in [`Op::ALL`]
/// order.
pub fn required_ops(config: &ModelConfig) -> Vec<Op> {
    let mut ops = vec![
        Op::Embedding,
        Op::Matmul,
        Op::RmsNorm,
        Op::AddScaled,
        // The logit rows are gathered before the final norm.
        Op::GatherRows,
    ];
    if config.embedding_multiplier != 1.0 {
        ops.push(Op::Scale);
    }
    for layer in &config.layers {
        match layer.mixer {
            MixerKind::Attention => {
                ops.extend([Op::KvStore, Op::PagedAttention]);
                if let Some(a) = &config.attention {
                    if a.rope.is_some() {
                        ops.push(Op::Rope);
                    }
                    if a.output_gate {
                        ops.push(Op::SigmoidMul);
                    }
                }
            }
            MixerKind::Mamba2 => ops.extend([Op::CausalConv1d, Op::SsdScan, Op::GatedRmsNorm]),
            MixerKind::GatedDeltaNet => ops.extend([
                Op::CausalConv1d,
                Op::CopyCols,
                Op::GatedDeltaRule,
                Op::GatedRmsNorm,
            ]),
            MixerKind::ShortConv => ops.push(Op::CausalConv1d),
            MixerKind::None => {}
        }
        match &layer.names.ffn {
            FfnNames::Mlp(names) => ops.extend(mlp_ops(names)),
            FfnNames::Moe(names) => {
                if let Some(m) = &config.moe {
                    ops.push(match m.routing {
                        Routing::Softmax => Op::SoftmaxTopk,
                        Routing::SigmoidGrouped { .. } => Op::SigmoidTopk,
                    });
                }
                ops.extend([Op::MoeGroup, Op::ScatterAddRows, Op::GroupedMatmul]);
                let plain = match &names.experts {
                    ExpertNames::Separate(list) => list.first().is_some_and(|n| !gated(n)),
                    ExpertNames::Fused { .. } => false,
                };
                ops.push(if plain {
                    Op::Relu2
                } else {
                    Op::GroupedMatmulSwiglu
                });
                if let Some(shared) = &names.shared {
                    ops.extend(mlp_ops(shared));
                    ops.push(match names.shared_gate {
                        Some(_) => Op::SigmoidGateAdd,
                        None => Op::AddScaled,
                    });
                }
            }
            FfnNames::None => {}
        }
    }
    ops.sort();
    ops.dedup();
    ops
}

/// An error naming every op `config` needs that `gpu` does not support: a
/// model is refused on such a backend, never run with a fallback.
pub fn check_supported(gpu: &dyn GpuBackend, config: &ModelConfig) -> Result<()> {
    let missing: Vec<&str> = required_ops(config)
        .into_iter()
        .filter(|&op| !gpu.supports(op))
        .map(Op::name)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(EngineError::Device {
        context: format!("a {} model", config.model_type.as_str()),
        source: GpuError::Unavailable(format!(
            "the {} backend does not implement {}",
            gpu.name(),
            missing.join(", ")
        )),
    })
}
