//! Bamba (`bamba`): IBM / Princeton / CMU / UIUC, "Bamba: an inference-efficient
//! hybrid Mamba2 model", model card ibm-ai-platform/Bamba-9B.
//!
//! Llama-style decoder layers whose mixer is Mamba-2, except at
//! `attn_layer_indices` (each below `num_hidden_layers`; one listed twice
//! counts once, with a warning; a `layer_types` / `layers_block_type` list
//! beside it must agree), where it is grouped-query attention with RoPE over
//! half of each head (`partial_rotary_factor` 0.5: transformers hard-codes it,
//! overriding a top-level key; only one inside `rope_parameters` counts). Every layer has a SwiGLU MLP after
//! `pre_ff_layernorm`. All norms, the Mamba gated norm included, use
//! `rms_norm_eps`; the gated norm normalises each of the `mamba_n_groups`
//! groups of the `d_inner` row on its own. Attention projections have
//! biases when `attention_bias`, MLP projections when `mlp_bias`.

use super::{
    Common, attention_heads, attention_names, check_mamba, mamba_names, mlp_bias, require_act,
    split_mlp, time_step_limit,
};
use crate::config::json::Obj;
use crate::config::limits;
use crate::config::rope::{RopeDefaults, parse_rope};
use crate::config::{
    Activation, AttentionConfig, FfnKind, FfnNames, LayerNames, LayerPlan, MambaConfig, MixerKind,
    MixerNames, MlpConfig, ModelConfig, ModelNames, ModelType,
};
use crate::error::Result;

/// config.json of `bamba`, as read.
struct RawBamba {
    common: Common,
    num_layers: usize,
    attn_layer_indices: Vec<usize>,
    intermediate_size: usize,
    rms_norm_eps: f32,
    max_position_embeddings: usize,
    mamba: MambaConfig,
    mlp_bias: bool,
}

/// The Mamba-2 settings Bamba and Granite 4.0-H share (`mamba_*` keys).
pub(super) fn read_mamba_keys(o: &Obj<'_>, hidden: usize, norm_eps: f32) -> Result<MambaConfig> {
    let n_heads = o.count_or(&["mamba_n_heads"], 128, limits::HEADS)?;
    let expand = o.size_or(&["mamba_expand"], 2)?;
    let inner = expand * hidden;
    let head_dim = match o.get(&["mamba_d_head"]) {
        None => None,
        Some((_, v)) if v.as_str() == Some("auto") => None,
        Some(_) => Some(o.count(&["mamba_d_head"], limits::HEAD_DIM)?),
    };
    let head_dim = match head_dim {
        Some(d) => d,
        None if inner.is_multiple_of(n_heads) => inner / n_heads,
        None => {
            return Err(o.err(format!(
                "mamba_n_heads ({n_heads}) must divide mamba_expand * hidden_size ({inner})"
            )));
        }
    };
    if head_dim * n_heads != inner {
        return Err(o.err(format!(
            "mamba_n_heads * mamba_d_head ({}) must equal mamba_expand * hidden_size ({inner})",
            head_dim * n_heads
        )));
    }
    let n_groups = o.count_or(&["mamba_n_groups"], 1, limits::HEADS)?;
    let mamba = MambaConfig {
        n_heads,
        head_dim,
        d_state: o.count_or(&["mamba_d_state"], 256, limits::HEAD_DIM)?,
        n_groups,
        conv_kernel: o.count_or(&["mamba_d_conv"], 4, limits::CONV_KERNEL)?,
        chunk_size: o.size_or(&["mamba_chunk_size"], 256)?,
        time_step_limit: time_step_limit(o)?,
        conv_bias: o.bool_or(&["mamba_conv_bias"], true)?,
        proj_bias: o.bool_or(&["mamba_proj_bias"], false)?,
        norm_eps,
        // The gated norm normalises each group's `d_inner / n_groups`
        // channels on their own (`BambaRMSNormGated(group_size=...)`, as
        // mamba_ssm's kernel does).
        norm_groups: n_groups,
    };
    check_mamba(o, &mamba)?;
    Ok(mamba)
}

impl RawBamba {
    fn read(o: &Obj<'_>) -> Result<Self> {
        let mut common = Common::read(o)?;
        require_act(o, &["hidden_act"], &["silu"], "silu")?;
        let rms_norm_eps = o.pos_f32_or(&["rms_norm_eps"], 1e-5)?;
        let num_layers = super::num_layers(o, &["num_hidden_layers"])?;
        let attn_layer_indices =
            super::layer_indices(o, "attn_layer_indices", num_layers, &mut common.warnings)?;
        check_layer_lists(o, num_layers, &attn_layer_indices)?;
        let mamba = read_mamba_keys(o, common.hidden_size, rms_norm_eps)?;
        Ok(Self {
            num_layers,
            attn_layer_indices,
            intermediate_size: o.count(&["intermediate_size"], limits::WIDTH)?,
            rms_norm_eps,
            max_position_embeddings: o.size_or(&["max_position_embeddings"], 262_144)?,
            mamba,
            mlp_bias: mlp_bias(o)?,
            common,
        })
    }
}

/// A `layer_types` or `layers_block_type` list in a Bamba config (which
/// transformers refuses outright: both name a read-only property derived
/// from `attn_layer_indices`) is accepted only if it says the same as
/// `attn_layer_indices`.
fn check_layer_lists(o: &Obj<'_>, num_layers: usize, attn: &[usize]) -> Result<()> {
    let derived: Vec<MixerKind> = (0..num_layers)
        .map(|i| {
            if attn.contains(&i) {
                MixerKind::Attention
            } else {
                MixerKind::Mamba2
            }
        })
        .collect();
    for key in ["layer_types", "layers_block_type"] {
        let Some((key, types)) = o.opt_str_list(&[key])? else {
            continue;
        };
        super::check_layer_count(o, key, types.len())?;
        let listed = types
            .iter()
            .enumerate()
            .map(|(i, t)| match *t {
                "mamba" | "linear_attention" => Ok(MixerKind::Mamba2),
                "attention" | "full_attention" => Ok(MixerKind::Attention),
                other => Err(super::unknown_layer_type(
                    o,
                    key,
                    i,
                    other,
                    &["mamba", "attention", "linear_attention", "full_attention"],
                )),
            })
            .collect::<Result<Vec<_>>>()?;
        super::check_same_layers(
            o,
            (key, &listed),
            ("attn_layer_indices", &derived),
            super::mixer_name,
        )?;
    }
    Ok(())
}

pub(super) fn build(o: &Obj<'_>) -> Result<ModelConfig> {
    let raw = RawBamba::read(o)?;
    let attention = if raw.attn_layer_indices.is_empty() {
        None
    } else {
        Some(read_attention(o, raw.common.hidden_size)?)
    };
    let mut config = raw.common.base(
        ModelType::Bamba,
        raw.rms_norm_eps,
        raw.max_position_embeddings,
        model_names(raw.common.tie_word_embeddings),
    );
    config.layers = (0..raw.num_layers)
        .map(|i| {
            let mixer = if attention.is_some() && raw.attn_layer_indices.contains(&i) {
                MixerKind::Attention
            } else {
                MixerKind::Mamba2
            };
            LayerPlan {
                mixer,
                ffn: FfnKind::Mlp,
                names: layer_names(i, mixer, attention.as_ref(), &raw.mamba, raw.mlp_bias),
                sliding_window: None,
            }
        })
        .collect();
    config.attention = attention;
    if config.recurrent_layers().next().is_some() {
        config.mamba = Some(raw.mamba);
    }
    config.mlp = Some(MlpConfig {
        intermediate_size: raw.intermediate_size,
        activation: Activation::SwiGlu,
    });
    Ok(config)
}

fn read_attention(o: &Obj<'_>, hidden: usize) -> Result<AttentionConfig> {
    let (n_heads, n_kv_heads, head_dim) = attention_heads(o, hidden, None)?;
    let defaults = RopeDefaults {
        partial_rotary_factor: 0.5,
        top_level_partial: false,
        ..RopeDefaults::default()
    };
    let bias = o.bool_or(&["attention_bias"], false)?;
    Ok(AttentionConfig {
        n_heads,
        n_kv_heads,
        head_dim,
        rope: Some(parse_rope(o, head_dim, defaults)?),
        scale: (head_dim as f32).powf(-0.5),
        qk_norm: false,
        output_gate: false,
        qkv_bias: bias,
        o_bias: bias,
    })
}

/// The family's tensor-name table: the mixer (`self_attn` or `mamba`)
/// after `input_layernorm`, then `pre_ff_layernorm` and the `feed_forward`
/// SwiGLU MLP.
fn layer_names(
    i: usize,
    mixer: MixerKind,
    a: Option<&AttentionConfig>,
    m: &MambaConfig,
    mlp_bias: bool,
) -> LayerNames {
    let p = format!("model.layers.{i}");
    LayerNames {
        input_norm: format!("{p}.input_layernorm.weight"),
        ffn_norm: Some(format!("{p}.pre_ff_layernorm.weight")),
        mixer: match (mixer, a) {
            (MixerKind::Attention, Some(a)) => {
                MixerNames::Attention(attention_names(&format!("{p}.self_attn"), a))
            }
            _ => MixerNames::Mamba2(mamba_names(&format!("{p}.mamba"), m)),
        },
        ffn: FfnNames::Mlp(split_mlp(&format!("{p}.feed_forward"), mlp_bias)),
    }
}

fn model_names(tied: bool) -> ModelNames {
    ModelNames {
        embed: "model.embed_tokens.weight".into(),
        final_norm: "model.final_layernorm.weight".into(),
        lm_head: (!tied).then(|| "lm_head.weight".into()),
    }
}

use crate::gguf::GgufName::*;
use crate::gguf::GgufTable;
/// llama.cpp's names for Bamba (`convert_hf_to_gguf.py`'s
/// `GraniteHybridModel`, architecture `granitehybrid` with
/// `rope.scaling.finetuned` true): Mamba-2 layers as `Mamba2Model` stores
/// them, attention q/k rows permuted as `LlamaModel`'s.
pub(crate) const GGUF: GgufTable = GgufTable {
    layer_prefix: "model.layers.",
    globals: &[
        ("model.embed_tokens.weight", Same("token_embd.weight")),
        ("model.final_layernorm.weight", Same("output_norm.weight")),
        ("lm_head.weight", Same("output.weight")),
    ],
    layer: &[
        (
            "",
            &[
                ("input_layernorm.weight", Same("attn_norm.weight")),
                ("pre_ff_layernorm.weight", Same("ffn_norm.weight")),
            ],
        ),
        ("mamba.", crate::gguf::MAMBA2),
        ("self_attn.", crate::gguf::ATTENTION_PERMUTED),
        ("feed_forward.", crate::gguf::GATED_MLP),
    ],
};
