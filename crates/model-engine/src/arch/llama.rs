//! Dense decoder-only transformers: `llama`, `qwen2`, `qwen3`, `mistral`.
//!
//! Llama (Touvron et al., 2023, arXiv:2302.13971; Llama 3: arXiv:2407.21783):
//! pre-RMSNorm, grouped-query attention with RoPE, SwiGLU MLP. The others
//! differ only in details, all read from config.json:
//! - Qwen2 (arXiv:2407.10671): biases on q/k/v (not o).
//! - Qwen3 (arXiv:2505.09388): RMSNorm over each head of q and k before RoPE;
//!   `head_dim` independent of `hidden_size` (default 128).
//! - Qwen2/3 with `use_sliding_window`: a sliding window on the layers from
//!   `max_window_layers` on (or those `layer_types` marks `sliding_attention`;
//!   given both, they must agree).
//! - Mistral (arXiv:2310.06825): sliding-window attention on every layer
//!   (`sliding_window`, 4096 when the key is absent, none when it is `null`;
//!   a `layer_types` list is ignored with a warning, as transformers does).
//!
//! `attention_bias` adds biases to q, k, v and o; `mlp_bias` to the MLP's
//! three projections. Layer norms compute `x * rsqrt(mean(x^2) + rms_norm_eps) * w`.

use super::{Common, attention_heads, attention_names, mlp_bias, require_act, split_mlp};
use crate::config::json::Obj;
use crate::config::limits;
use crate::config::rope::{RopeDefaults, parse_rope};
use crate::config::{
    Activation, AttentionConfig, FfnKind, FfnNames, LayerNames, LayerPlan, MixerKind, MixerNames,
    MlpConfig, ModelConfig, ModelNames, ModelType,
};
use crate::error::Result;

/// config.json of the llama family, as read (either spelling).
struct RawLlama {
    common: Common,
    num_layers: usize,
    intermediate_size: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    rms_norm_eps: f32,
    max_position_embeddings: usize,
    attention_bias: bool,
    mlp_bias: bool,
    /// Each layer's sliding window (None: full attention).
    windows: Vec<Option<usize>>,
}

impl RawLlama {
    fn read(t: ModelType, o: &Obj<'_>) -> Result<Self> {
        let mut common = Common::read(o)?;
        let default_head_dim = (t == ModelType::Qwen3).then_some(128);
        let (n_heads, n_kv_heads, head_dim) =
            attention_heads(o, common.hidden_size, default_head_dim)?;
        require_act(o, &["hidden_act"], &["silu"], "silu")?;
        let max_pos_default = match t {
            ModelType::Llama => 2048,
            ModelType::Mistral => 4096 * 32,
            _ => 32768,
        };
        let num_layers = super::num_layers(o, &["num_hidden_layers"])?;
        let windows = windows(t, o, num_layers, &mut common.warnings)?;
        Ok(Self {
            num_layers,
            intermediate_size: o.count(&["intermediate_size"], limits::WIDTH)?,
            n_heads,
            n_kv_heads,
            head_dim,
            rms_norm_eps: o.pos_f32_or(&["rms_norm_eps"], 1e-6)?,
            max_position_embeddings: o.size_or(&["max_position_embeddings"], max_pos_default)?,
            attention_bias: o.bool_or(&["attention_bias"], false)?,
            mlp_bias: mlp_bias(o)?,
            windows,
            common,
        })
    }
}

pub(super) fn build(t: ModelType, o: &Obj<'_>) -> Result<ModelConfig> {
    let raw = RawLlama::read(t, o)?;
    let rope = parse_rope(o, raw.head_dim, RopeDefaults::default())?;
    let attention = AttentionConfig {
        n_heads: raw.n_heads,
        n_kv_heads: raw.n_kv_heads,
        head_dim: raw.head_dim,
        rope: Some(rope),
        scale: (raw.head_dim as f32).powf(-0.5),
        qk_norm: t == ModelType::Qwen3,
        output_gate: false,
        qkv_bias: t == ModelType::Qwen2 || raw.attention_bias,
        o_bias: raw.attention_bias,
    };
    let mut config = raw.common.base(
        t,
        raw.rms_norm_eps,
        raw.max_position_embeddings,
        model_names(raw.common.tie_word_embeddings),
    );
    config.layers = (0..raw.num_layers)
        .map(|i| LayerPlan {
            mixer: MixerKind::Attention,
            ffn: FfnKind::Mlp,
            names: layer_names(i, &attention, raw.mlp_bias),
            sliding_window: raw.windows[i],
        })
        .collect();
    config.attention = Some(attention);
    config.mlp = Some(MlpConfig {
        intermediate_size: raw.intermediate_size,
        activation: Activation::SwiGlu,
    });
    Ok(config)
}

/// Each layer's sliding window, as transformers derives it:
/// - Mistral: `sliding_window` on every layer (4096 when the key is absent,
///   none when it is `null`); transformers ignores `layer_types` here with a
///   warning, and so does metrale.
/// - Qwen2 / Qwen3: only with `use_sliding_window`, then `sliding_window` on
///   the layers that `layer_types` marks `sliding_attention`, or when that
///   list is absent on every layer from `max_window_layers` on. When both
///   keys are given they must agree (transformers keeps the list silently).
/// - Llama: none; `layer_types` may only list `full_attention`.
fn windows(
    t: ModelType,
    o: &Obj<'_>,
    layers: usize,
    warnings: &mut Vec<String>,
) -> Result<Vec<Option<usize>>> {
    let window = |o: &Obj<'_>| match o.raw("sliding_window") {
        Some(v) if !v.is_null() => o.size(&["sliding_window"]).map(Some),
        _ => Ok(None),
    };
    let types = o.opt_str_list(&["layer_types"])?;
    if let Some((k, types)) = &types {
        super::check_layer_count(o, k, types.len())?;
        let known: &[&str] = match t {
            ModelType::Qwen2 | ModelType::Qwen3 | ModelType::Mistral => {
                &["full_attention", "sliding_attention"]
            }
            _ => &["full_attention"],
        };
        if let Some((i, bad)) = types.iter().enumerate().find(|(_, t)| !known.contains(t)) {
            return Err(super::unknown_layer_type(o, k, i, bad, known));
        }
    }
    Ok(match t {
        ModelType::Mistral => {
            let w = if o.raw("sliding_window").is_none() {
                Some(4096)
            } else {
                window(o)?
            };
            if let Some((k, _)) = &types {
                warnings.push(o.warning(format_args!(
                    "key `{k}` is ignored: a mistral model applies `sliding_window` to every \
                     layer (transformers ignores it too, with a warning)"
                )));
            }
            vec![w; layers]
        }
        ModelType::Qwen2 | ModelType::Qwen3 => {
            let w = if o.bool_or(&["use_sliding_window"], false)? {
                window(o)?
            } else {
                None
            };
            let from = o.usize_or(&["max_window_layers"], 28)?;
            let from_max = |i: usize| i >= from;
            let sliding: Vec<bool> = match &types {
                Some((k, types)) => {
                    let listed: Vec<bool> =
                        types.iter().map(|t| *t == "sliding_attention").collect();
                    // The two keys only matter, and so only contradict, when
                    // windows are on.
                    if w.is_some() && o.get(&["max_window_layers"]).is_some() {
                        let derived: Vec<bool> = (0..layers).map(from_max).collect();
                        super::check_same_layers(
                            o,
                            (k, &listed),
                            ("max_window_layers", &derived),
                            attention_name,
                        )?;
                    }
                    listed
                }
                None => (0..layers).map(from_max).collect(),
            };
            sliding.iter().map(|&s| w.filter(|_| s)).collect()
        }
        _ => vec![None; layers],
    })
}

/// The `layer_types` name of a layer that slides or not, for messages.
fn attention_name(sliding: &bool) -> &'static str {
    if *sliding {
        "sliding_attention"
    } else {
        "full_attention"
    }
}

/// The family's tensor-name table: every layer is attention + SwiGLU MLP.
fn layer_names(i: usize, a: &AttentionConfig, mlp_bias: bool) -> LayerNames {
    let p = format!("model.layers.{i}");
    LayerNames {
        input_norm: format!("{p}.input_layernorm.weight"),
        ffn_norm: Some(format!("{p}.post_attention_layernorm.weight")),
        mixer: MixerNames::Attention(attention_names(&format!("{p}.self_attn"), a)),
        ffn: FfnNames::Mlp(split_mlp(&format!("{p}.mlp"), mlp_bias)),
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
/// llama.cpp's names for the family (`convert_hf_to_gguf.py`'s
/// `LlamaModel`, `Qwen2Model`, `Qwen3Model`). `LlamaModel` (llama, mistral)
/// permutes the rows of q_proj and k_proj (weights and biases) for its rope
/// (`permute(w, n_head)`); the Qwen classes store them as is.
const LLAMA_GLOBALS: &[(&str, crate::gguf::GgufName)] = &[
    ("model.embed_tokens.weight", Same("token_embd.weight")),
    ("model.norm.weight", Same("output_norm.weight")),
    ("lm_head.weight", Same("output.weight")),
];

pub(crate) const GGUF_LLAMA: GgufTable = GgufTable {
    layer_prefix: "model.layers.",
    globals: LLAMA_GLOBALS,
    layer: &[
        ("", LLAMA_NORMS),
        ("self_attn.", crate::gguf::ATTENTION_PERMUTED),
        ("mlp.", crate::gguf::GATED_MLP),
    ],
};

/// Qwen 2/3: as Llama without the q/k permutation, plus Qwen 3's q/k norms.
pub(crate) const GGUF_QWEN: GgufTable = GgufTable {
    layer_prefix: "model.layers.",
    globals: LLAMA_GLOBALS,
    layer: &[
        ("", LLAMA_NORMS),
        ("self_attn.", crate::gguf::ATTENTION),
        (
            "self_attn.",
            &[
                ("q_norm.weight", Same("attn_q_norm.weight")),
                ("k_norm.weight", Same("attn_k_norm.weight")),
            ],
        ),
        ("mlp.", crate::gguf::GATED_MLP),
    ],
};

const LLAMA_NORMS: crate::gguf::GgufGroup = &[
    ("input_layernorm.weight", Same("attn_norm.weight")),
    ("post_attention_layernorm.weight", Same("ffn_norm.weight")),
];
