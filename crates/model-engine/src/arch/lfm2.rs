//! LFM2 and LFM2.5 (`lfm2`): Liquid AI, "LFM2 Technical Report"
//! (arXiv:2511.23404; model cards LiquidAI/LFM2-350M … LFM2-2.6B,
//! LFM2.5-1.2B). LFM2-VL's language model is the same `lfm2`.
//!
//! Layers: gated short convolutions (`conv`) interleaved with grouped-query
//! attention (`full_attention`), each followed by a SwiGLU MLP; pre-norm
//! (`operator_norm`, `ffn_norm`), and the final norm is named
//! `embedding_norm`. The layer kinds come from `layer_types`, else from
//! `full_attn_idxs` (the attention layers' indices; transformers makes
//! every layer attention when both are absent); both given must agree.
//!
//! Details the forward pass needs:
//! - The short convolution: `in_proj` gives `[b, c, x]` (hidden wide each),
//!   then `y = c ⊙ conv(b ⊙ x)`, a depthwise causal conv of `conv_L_cache`
//!   taps (3) with no activation, and `out_proj`. Its state is the last
//!   `conv_L_cache - 1` values of `b ⊙ x`. `conv_bias` puts biases on all
//!   three.
//! - Attention: q and k RMSNorm over each head (`q_layernorm`,
//!   `k_layernorm`, plain weights), RoPE (theta 1e6 by default) on the whole
//!   head, output `out_proj`.
//! - The MLP (`w1` gate, `w3` up, `w2` down) has `block_ff_dim` (alias of
//!   `intermediate_size`) adjusted when `block_auto_adjust_ff_dim`:
//!   `int(2 * ff / 3)`, times `block_ffn_dim_multiplier`, rounded up to
//!   `block_multiple_of`.
//! - Norms: `x * rsqrt(mean(x^2) + norm_eps) * w`; the head is tied by
//!   default (`tie_word_embeddings`, alias `tie_embedding`).

use super::{Common, attention_heads, check_layer_count, check_same_layers, mixer_name};
use crate::config::json::Obj;
use crate::config::limits;
use crate::config::rope::{RopeDefaults, parse_rope};
use crate::config::{
    Activation, AttentionConfig, AttentionNames, FfnKind, FfnNames, LayerNames, LayerPlan,
    MixerKind, MixerNames, MlpConfig, MlpNames, ModelConfig, ModelNames, ModelType,
    ShortConvConfig, ShortConvNames,
};
use crate::error::Result;

/// Two spellings of one setting: the value of whichever is given; both
/// given must agree (transformers keeps `alias` without a word).
fn aliased<T: PartialEq + std::fmt::Debug>(
    o: &Obj<'_>,
    (key, alias): (&str, &str),
    read: impl Fn(&str) -> Result<Option<T>>,
) -> Result<Option<T>> {
    match (read(key)?, read(alias)?) {
        (Some(a), Some(b)) if a != b => Err(o.err(format!(
            "keys `{key}` ({a:?}) and `{alias}` ({b:?}) disagree (transformers uses `{alias}`)"
        ))),
        (a, b) => Ok(b.or(a)),
    }
}

/// The layers' mixers from `layer_types` and `full_attn_idxs`.
fn layer_mixers(o: &Obj<'_>, layers: usize, warnings: &mut Vec<String>) -> Result<Vec<MixerKind>> {
    let from_indices = match o.opt_list(&["full_attn_idxs"])? {
        None => None,
        Some(_) => {
            let idx = super::layer_indices(o, "full_attn_idxs", layers, warnings)?;
            Some(
                (0..layers)
                    .map(|i| match idx.contains(&i) {
                        true => MixerKind::Attention,
                        false => MixerKind::ShortConv,
                    })
                    .collect::<Vec<_>>(),
            )
        }
    };
    let Some((key, types)) = o.opt_str_list(&["layer_types"])? else {
        return Ok(from_indices.unwrap_or_else(|| vec![MixerKind::Attention; layers]));
    };
    check_layer_count(o, key, types.len())?;
    let mixers = types
        .iter()
        .enumerate()
        .map(|(i, t)| match *t {
            "conv" => Ok(MixerKind::ShortConv),
            "full_attention" => Ok(MixerKind::Attention),
            other => Err(super::unknown_layer_type(
                o,
                key,
                i,
                other,
                &["conv", "full_attention"],
            )),
        })
        .collect::<Result<Vec<_>>>()?;
    if let Some(from_indices) = from_indices {
        check_same_layers(
            o,
            (key, &mixers),
            ("full_attn_idxs", &from_indices),
            mixer_name,
        )?;
    }
    Ok(mixers)
}

/// The MLP's width after `block_auto_adjust_ff_dim`.
fn ffn_width(o: &Obj<'_>) -> Result<usize> {
    let ff = aliased(o, ("intermediate_size", "block_ff_dim"), |k| {
        o.opt_usize(&[k])
    })?
    .unwrap_or(12288);
    let ff = o.within(&["intermediate_size", "block_ff_dim"], ff, limits::WIDTH)?;
    if !o.bool_or(&["block_auto_adjust_ff_dim"], true)? {
        return Ok(ff);
    }
    let mut ff = 2 * ff / 3;
    // A `null` multiplier skips the multiple too, as in transformers.
    if let Some(m) = o.opt_f64(&["block_ffn_dim_multiplier"])? {
        let multiple = o.size_or(&["block_multiple_of"], 256)?.max(1);
        ff = (m * ff as f64) as usize;
        ff = ff.div_ceil(multiple) * multiple;
    }
    if ff == 0 {
        return Err(o.err("the MLP's adjusted width (block_ff_dim) is zero"));
    }
    o.within(&["block_ff_dim"], ff, limits::WIDTH)
}

pub(super) fn build(o: &Obj<'_>) -> Result<ModelConfig> {
    let mut common = Common::read(o)?;
    common.tie_word_embeddings = aliased(o, ("tie_word_embeddings", "tie_embedding"), |k| {
        o.get(&[k]).map(|_| o.bool_or(&[k], true)).transpose()
    })?
    .unwrap_or(true);
    let num_layers = super::num_layers(o, &["num_hidden_layers"])?;
    let mixers = layer_mixers(o, num_layers, &mut common.warnings)?;
    let eps = o.pos_f32_or(&["norm_eps"], 1e-5)?;
    let bias = o.bool_or(&["conv_bias"], false)?;
    let attention = if mixers.contains(&MixerKind::Attention) {
        let (n_heads, n_kv_heads, head_dim) = attention_heads(o, common.hidden_size, None)?;
        let defaults = RopeDefaults {
            theta: 1_000_000.0,
            ..RopeDefaults::default()
        };
        Some(AttentionConfig {
            n_heads,
            n_kv_heads,
            head_dim,
            rope: Some(parse_rope(o, head_dim, defaults)?),
            scale: (head_dim as f32).powf(-0.5),
            qk_norm: true,
            output_gate: false,
            qkv_bias: false,
            o_bias: false,
        })
    } else {
        None
    };
    let kernel = o.count_or(&["conv_L_cache"], 3, limits::CONV_KERNEL)?;
    if kernel < 2 {
        return Err(o.err("key `conv_L_cache` must be at least 2"));
    }
    let names = ModelNames {
        embed: "model.embed_tokens.weight".into(),
        final_norm: "model.embedding_norm.weight".into(),
        lm_head: (!common.tie_word_embeddings).then(|| "lm_head.weight".into()),
    };
    let max_pos = o.size_or(&["max_position_embeddings"], 128_000)?;
    let mut config = common.base(ModelType::Lfm2, eps, max_pos, names);
    config.layers = mixers
        .iter()
        .enumerate()
        .map(|(i, &mixer)| LayerPlan {
            mixer,
            ffn: FfnKind::Mlp,
            names: layer_names(i, mixer, bias),
            sliding_window: None,
        })
        .collect();
    config.attention = attention;
    if mixers.contains(&MixerKind::ShortConv) {
        config.short_conv = Some(ShortConvConfig { kernel, bias });
    }
    config.mlp = Some(MlpConfig {
        intermediate_size: ffn_width(o)?,
        activation: Activation::SwiGlu,
    });
    Ok(config)
}

/// The family's tensor-name table.
fn layer_names(i: usize, mixer: MixerKind, bias: bool) -> LayerNames {
    let p = format!("model.layers.{i}");
    let mixer = match mixer {
        MixerKind::Attention => {
            let a = |n: &str| format!("{p}.self_attn.{n}.weight");
            MixerNames::Attention(AttentionNames {
                q: a("q_proj"),
                k: a("k_proj"),
                v: a("v_proj"),
                o: a("out_proj"),
                q_bias: None,
                k_bias: None,
                v_bias: None,
                o_bias: None,
                q_norm: Some(a("q_layernorm")),
                k_norm: Some(a("k_layernorm")),
            })
        }
        _ => MixerNames::ShortConv(ShortConvNames {
            in_proj: format!("{p}.conv.in_proj.weight"),
            conv_weight: format!("{p}.conv.conv.weight"),
            out_proj: format!("{p}.conv.out_proj.weight"),
            bias,
        }),
    };
    let f = |n: &str| format!("{p}.feed_forward.{n}.weight");
    LayerNames {
        input_norm: format!("{p}.operator_norm.weight"),
        ffn_norm: Some(format!("{p}.ffn_norm.weight")),
        mixer,
        ffn: FfnNames::Mlp(MlpNames::Split {
            gate: f("w1"),
            up: f("w3"),
            down: f("w2"),
            bias: false,
        }),
    }
}

use crate::gguf::GgufName::Same;

/// LFM2 as llama.cpp's converter writes it (`lfm2`): every tensor as it
/// is (the conv weight squeezed to `[hidden, kernel]`), the final norm as
/// `token_embd_norm`.
pub(crate) const GGUF: crate::gguf::GgufTable = crate::gguf::GgufTable {
    layer_prefix: "model.layers.",
    globals: &[
        ("model.embed_tokens.weight", Same("token_embd.weight")),
        (
            "model.embedding_norm.weight",
            Same("token_embd_norm.weight"),
        ),
        ("lm_head.weight", Same("output.weight")),
    ],
    layer: &[
        (
            "",
            &[
                ("operator_norm.weight", Same("attn_norm.weight")),
                ("ffn_norm.weight", Same("ffn_norm.weight")),
            ],
        ),
        (
            "conv.",
            &[
                ("in_proj.weight", Same("shortconv.in_proj.weight")),
                ("in_proj.bias", Same("shortconv.in_proj.bias")),
                ("conv.weight", Same("shortconv.conv.weight")),
                ("conv.bias", Same("shortconv.conv.bias")),
                ("out_proj.weight", Same("shortconv.out_proj.weight")),
                ("out_proj.bias", Same("shortconv.out_proj.bias")),
            ],
        ),
        (
            "self_attn.",
            &[
                ("q_proj.weight", Same("attn_q.weight")),
                ("k_proj.weight", Same("attn_k.weight")),
                ("v_proj.weight", Same("attn_v.weight")),
                ("out_proj.weight", Same("attn_output.weight")),
                ("q_layernorm.weight", Same("attn_q_norm.weight")),
                ("k_layernorm.weight", Same("attn_k_norm.weight")),
            ],
        ),
        (
            "feed_forward.",
            &[
                ("w1.weight", Same("ffn_gate.weight")),
                ("w3.weight", Same("ffn_up.weight")),
                ("w2.weight", Same("ffn_down.weight")),
            ],
        ),
    ],
};
