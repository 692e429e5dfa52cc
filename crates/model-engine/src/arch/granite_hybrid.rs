//! Granite 4.0-H (`granitemoehybrid`): IBM, "IBM Granite 4.0: hyper-efficient,
//! high performance hybrid models", model cards ibm-granite/granite-4.0-h-tiny,
//! -h-small, -h-micro.
//!
//! Decoder layers whose mixer is Mamba-2 or attention (`layer_types`:
//! `mamba` / `attention`, or transformers 5's `linear_attention` /
//! `full_attention`; all Mamba when absent; its alias `layers_block_type`
//! may stand beside it only if the two agree, and either must list
//! `num_hidden_layers` layers), then a feed-forward: a sparse
//! mixture of experts plus an always-on shared MLP when `num_local_experts >
//! 0`, else only the shared MLP (dense Granite 4.0-H Micro).
//!
//! Granite's scalings: embeddings times `embedding_multiplier`, every
//! sub-block output times `residual_multiplier` before its residual add,
//! attention scores times `attention_multiplier` (instead of
//! `head_dim^-0.5`), logits divided by `logits_scaling`. Attention uses RoPE
//! only when `position_embedding_type` is `"rope"` (4.0-H uses none).
//!
//! Weights: experts fused as `block_sparse_moe.input_linear` `[E, 2I, H]`
//! (gate rows first, then up) and `output_linear` `[E, H, I]`; the router
//! `block_sparse_moe.router.layer` `[E, H]` picks the top k logits and
//! softmaxes over those k (the same as softmax over all, renormalised); the
//! shared MLP `shared_mlp.input_linear` `[2Is, H]` (gate first) and
//! `output_linear` `[H, Is]`. The Mamba gated norm is Bamba's: per group of
//! `d_inner / mamba_n_groups` channels, epsilon `rms_norm_eps` like every
//! other norm.

use super::bamba::read_mamba_keys;
use super::{
    Common, attention_heads, attention_names, check_layer_count, check_same_layers, mamba_names,
    mixer_name, require_act, unknown_layer_type,
};
use crate::config::json::Obj;
use crate::config::limits;
use crate::config::rope::{RopeDefaults, parse_rope};
use crate::config::{
    Activation, AttentionConfig, ExpertNames, FfnKind, FfnNames, LayerNames, LayerPlan,
    MambaConfig, MixerKind, MixerNames, MlpConfig, MlpNames, ModelConfig, ModelNames, ModelType,
    MoeConfig, MoeNames, Routing,
};
use crate::error::Result;

/// config.json of `granitemoehybrid`, as read (both spellings).
struct RawGranite {
    common: Common,
    mixers: Vec<MixerKind>,
    rms_norm_eps: f32,
    max_position_embeddings: usize,
    embedding_multiplier: f32,
    residual_multiplier: f32,
    attention_multiplier: f32,
    logits_scaling: f32,
    rope: bool,
    num_local_experts: usize,
    num_experts_per_tok: usize,
    intermediate_size: usize,
    shared_intermediate_size: usize,
}

impl RawGranite {
    fn read(o: &Obj<'_>) -> Result<Self> {
        let common = Common::read(o)?;
        require_act(o, &["hidden_act"], &["silu"], "silu")?;
        let num_layers = super::num_layers(o, &["num_hidden_layers"])?;
        let mut lists = Vec::new();
        for key in ["layer_types", "layers_block_type"] {
            if let Some((key, types)) = o.opt_str_list(&[key])? {
                lists.push((key, mixers(o, key, &types)?));
            }
        }
        let mixers = match lists.as_slice() {
            [] => vec![MixerKind::Mamba2; num_layers],
            [(key, mixers), rest @ ..] => {
                // transformers keeps `layers_block_type` (its alias of
                // `layer_types`) when both are given.
                for (other, theirs) in rest {
                    check_same_layers(o, (key, mixers), (other, theirs), mixer_name)?;
                }
                mixers.clone()
            }
        };
        let rope = match o.opt_str(&["position_embedding_type"])? {
            Some("rope") => true,
            None | Some("nope") => false,
            Some(other) => {
                return Err(o.err(format!(
                    "key `position_embedding_type` = {other:?} is not supported (rope or nope)"
                )));
            }
        };
        let num_local_experts = o.count_or_zero(&["num_local_experts"], 8, limits::EXPERTS)?;
        Ok(Self {
            mixers,
            rms_norm_eps: o.pos_f32_or(&["rms_norm_eps"], 1e-6)?,
            max_position_embeddings: o.size_or(&["max_position_embeddings"], 2048)?,
            embedding_multiplier: o.f32_or(&["embedding_multiplier"], 1.0)?,
            residual_multiplier: o.f32_or(&["residual_multiplier"], 1.0)?,
            attention_multiplier: o.f32_or(&["attention_multiplier"], 1.0)?,
            logits_scaling: o.f32_or(&["logits_scaling"], 1.0)?,
            rope,
            num_local_experts,
            num_experts_per_tok: if num_local_experts > 0 {
                o.size_or(&["num_experts_per_tok"], 2)?
            } else {
                0
            },
            intermediate_size: if num_local_experts > 0 {
                o.count(&["intermediate_size"], limits::WIDTH)?
            } else {
                0
            },
            shared_intermediate_size: o.count_or(
                &["shared_intermediate_size"],
                1024,
                limits::WIDTH,
            )?,
            common,
        })
    }
}

/// The mixers a layer list (`layer_types` or `layers_block_type`) names;
/// its length must match `num_hidden_layers`.
fn mixers(o: &Obj<'_>, key: &str, types: &[&str]) -> Result<Vec<MixerKind>> {
    check_layer_count(o, key, types.len())?;
    types
        .iter()
        .enumerate()
        .map(|(i, t)| match *t {
            "mamba" | "linear_attention" => Ok(MixerKind::Mamba2),
            "attention" | "full_attention" => Ok(MixerKind::Attention),
            other => Err(unknown_layer_type(
                o,
                key,
                i,
                other,
                &["mamba", "attention", "linear_attention", "full_attention"],
            )),
        })
        .collect()
}

pub(super) fn build(o: &Obj<'_>) -> Result<ModelConfig> {
    let raw = RawGranite::read(o)?;
    if raw.logits_scaling == 0.0 {
        return Err(o.err("key `logits_scaling` must not be zero (logits are divided by it)"));
    }
    if raw.num_experts_per_tok > raw.num_local_experts {
        return Err(o.err(format!(
            "num_experts_per_tok ({}) exceeds num_local_experts ({})",
            raw.num_experts_per_tok, raw.num_local_experts
        )));
    }
    let attention = if raw.mixers.contains(&MixerKind::Attention) {
        let (n_heads, n_kv_heads, head_dim) = attention_heads(o, raw.common.hidden_size, None)?;
        let bias = o.bool_or(&["attention_bias"], false)?;
        Some(AttentionConfig {
            n_heads,
            n_kv_heads,
            head_dim,
            rope: if raw.rope {
                Some(parse_rope(o, head_dim, RopeDefaults::default())?)
            } else {
                None
            },
            scale: raw.attention_multiplier,
            qk_norm: false,
            output_gate: false,
            qkv_bias: bias,
            o_bias: bias,
        })
    } else {
        None
    };
    let mamba = if raw.mixers.contains(&MixerKind::Mamba2) {
        Some(read_mamba_keys(
            o,
            raw.common.hidden_size,
            raw.rms_norm_eps,
        )?)
    } else {
        None
    };
    let ffn = if raw.num_local_experts > 0 {
        FfnKind::Moe
    } else {
        FfnKind::Mlp
    };

    let names = model_names(raw.common.tie_word_embeddings);
    let mut config = raw.common.base(
        ModelType::GraniteMoeHybrid,
        raw.rms_norm_eps,
        raw.max_position_embeddings,
        names,
    );
    config.embedding_multiplier = raw.embedding_multiplier;
    config.residual_multiplier = raw.residual_multiplier;
    config.logits_divisor = raw.logits_scaling;
    config.layers = raw
        .mixers
        .iter()
        .enumerate()
        .map(|(i, &mixer)| LayerPlan {
            mixer,
            ffn,
            names: layer_names(i, mixer, ffn, attention.as_ref(), mamba.as_ref()),
            sliding_window: None,
        })
        .collect();
    config.attention = attention;
    config.mamba = mamba;
    if ffn == FfnKind::Moe {
        config.moe = Some(MoeConfig {
            n_experts: raw.num_local_experts,
            top_k: raw.num_experts_per_tok,
            routing: Routing::Softmax,
            expert_intermediate: raw.intermediate_size,
            norm_topk_prob: true,
            shared_intermediate: Some(raw.shared_intermediate_size),
            shared_expert_gate: false,
        });
    } else {
        config.mlp = Some(MlpConfig {
            intermediate_size: raw.shared_intermediate_size,
            activation: Activation::SwiGlu,
        });
    }
    Ok(config)
}

/// The family's tensor-name table.
fn layer_names(
    i: usize,
    mixer: MixerKind,
    ffn: FfnKind,
    a: Option<&AttentionConfig>,
    m: Option<&MambaConfig>,
) -> LayerNames {
    let p = format!("model.layers.{i}");
    let shared = MlpNames::Fused {
        gate_up: format!("{p}.shared_mlp.input_linear.weight"),
        down: format!("{p}.shared_mlp.output_linear.weight"),
    };
    LayerNames {
        input_norm: format!("{p}.input_layernorm.weight"),
        ffn_norm: Some(format!("{p}.post_attention_layernorm.weight")),
        mixer: match (mixer, a, m) {
            (MixerKind::Attention, Some(a), _) => {
                MixerNames::Attention(attention_names(&format!("{p}.self_attn"), a))
            }
            (_, _, Some(m)) => MixerNames::Mamba2(mamba_names(&format!("{p}.mamba"), m)),
            _ => MixerNames::None,
        },
        ffn: match ffn {
            FfnKind::Moe => FfnNames::Moe(MoeNames {
                router: format!("{p}.block_sparse_moe.router.layer.weight"),
                router_bias: None,
                experts: ExpertNames::Fused {
                    gate_up: format!("{p}.block_sparse_moe.input_linear.weight"),
                    down: format!("{p}.block_sparse_moe.output_linear.weight"),
                },
                shared: Some(shared),
                shared_gate: None,
            }),
            _ => FfnNames::Mlp(shared),
        },
    }
}

fn model_names(tied: bool) -> ModelNames {
    ModelNames {
        embed: "model.embed_tokens.weight".into(),
        final_norm: "model.norm.weight".into(),
        lm_head: (!tied).then(|| "lm_head.weight".into()),
    }
}

use crate::gguf::GgufName::*;
use crate::gguf::GgufTable;
/// llama.cpp's names for Granite 4.0-H (`convert_hf_to_gguf.py`'s
/// `GraniteHybridModel`, architecture `granitehybrid`): Mamba-2 layers as
/// `Mamba2Model` stores them, attention q/k rows permuted as `LlamaModel`'s,
/// and the fused `input_linear` tensors split in two (gate, up): the
/// experts' `[n_experts, 2 * inter, hidden]` into `ffn_gate_exps` and
/// `ffn_up_exps`, the shared MLP's into `ffn_gate_shexp`/`ffn_up_shexp`
/// (or `ffn_gate`/`ffn_up` in a model without experts).
const GGUF_GLOBALS: &[(&str, crate::gguf::GgufName)] = &[
    ("model.embed_tokens.weight", Same("token_embd.weight")),
    ("model.norm.weight", Same("output_norm.weight")),
    ("lm_head.weight", Same("output.weight")),
];

const GRANITE_NORMS: crate::gguf::GgufGroup = &[
    ("input_layernorm.weight", Same("attn_norm.weight")),
    ("post_attention_layernorm.weight", Same("ffn_norm.weight")),
];

pub(crate) const GGUF_MOE: GgufTable = GgufTable {
    layer_prefix: "model.layers.",
    globals: GGUF_GLOBALS,
    layer: &[
        ("", GRANITE_NORMS),
        ("mamba.", crate::gguf::MAMBA2),
        ("self_attn.", crate::gguf::ATTENTION_PERMUTED),
        (
            "block_sparse_moe.",
            &[
                ("router.layer.weight", Same("ffn_gate_inp.weight")),
                (
                    "input_linear.weight",
                    Split(&["ffn_gate_exps.weight", "ffn_up_exps.weight"], 1),
                ),
                ("output_linear.weight", Same("ffn_down_exps.weight")),
            ],
        ),
        (
            "shared_mlp.",
            &[
                (
                    "input_linear.weight",
                    Split(&["ffn_gate_shexp.weight", "ffn_up_shexp.weight"], 0),
                ),
                ("output_linear.weight", Same("ffn_down_shexp.weight")),
            ],
        ),
    ],
};

pub(crate) const GGUF_DENSE: GgufTable = GgufTable {
    layer_prefix: "model.layers.",
    globals: GGUF_GLOBALS,
    layer: &[
        ("", GRANITE_NORMS),
        ("mamba.", crate::gguf::MAMBA2),
        ("self_attn.", crate::gguf::ATTENTION_PERMUTED),
        (
            "shared_mlp.",
            &[
                (
                    "input_linear.weight",
                    Split(&["ffn_gate.weight", "ffn_up.weight"], 0),
                ),
                ("output_linear.weight", Same("ffn_down.weight")),
            ],
        ),
    ],
};
