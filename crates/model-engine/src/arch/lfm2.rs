//! LFM2, LFM2.5 and LFM2-MoE (`lfm2`, `lfm2_moe`): Liquid AI, "LFM2
//! Technical Report" (arXiv:2511.23404; model cards LiquidAI/LFM2-350M …
//! LFM2-2.6B, LFM2.5-1.2B, LFM2-8B-A1B, LFM2-24B-A2B). LFM2-VL's language
//! model is the same `lfm2`: its wrapper (`lfm2_vl`, the language model
//! under `text_config` and `model.language_model.*`, the head tied by the
//! top-level key) is read, its vision tower and projector set aside.
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
//! - `lfm2_moe`: `layer_types` is required (transformers reads nothing
//!   else); the first `num_dense_layers` layers have a dense MLP of
//!   `intermediate_size` (not adjusted), the others a sparse MoE: sigmoid
//!   scores, the top `num_experts_per_tok` chosen by score plus
//!   `expert_bias` (`use_expert_bias`), weighted by their scores over their
//!   sum plus 1e-6 (`norm_topk_prob`), times `routed_scaling_factor`; no
//!   shared expert. Experts are stored one MLP each (`experts.{e}.w1/w3/w2`).

use super::{Common, attention_heads, check_layer_count, check_same_layers, mixer_name};
use crate::config::json::Obj;
use crate::config::limits;
use crate::config::rope::{RopeDefaults, parse_rope};
use crate::config::{
    Activation, AsideWeights, AttentionConfig, AttentionNames, ExpertNames, FfnKind, FfnNames,
    LayerNames, LayerPlan, MixerKind, MixerNames, MlpConfig, MlpNames, ModelConfig, ModelNames,
    ModelType, MoeConfig, MoeNames, Routing, ShortConvConfig, ShortConvNames,
};
use crate::error::Result;

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
    // Two spellings of one setting; `Obj` refuses them given differently.
    let keys = ["intermediate_size", "block_ff_dim"];
    let ff = o.within(&keys, o.usize_or(&keys, 12288)?, limits::WIDTH)?;
    if !o.bool_or(&["block_auto_adjust_ff_dim"], true)? {
        return Ok(ff);
    }
    let mut ff = 2 * ff / 3;
    // A `null` multiplier skips the multiple too, as in transformers.
    if let Some(m) = o.opt_f64(&["block_ffn_dim_multiplier"])? {
        let multiple = o.size_or(&["block_multiple_of"], 256)?.max(1);
        // `as` saturates (and makes NaN 0); the rounding up may not fit.
        ff = (m * ff as f64) as usize;
        ff = ff.div_ceil(multiple).checked_mul(multiple).ok_or_else(|| {
            o.err(format!(
                "the MLP's adjusted width (block_ff_dim times block_ffn_dim_multiplier {m}, \
                     rounded up to block_multiple_of {multiple}) overflows"
            ))
        })?;
    }
    if ff == 0 {
        return Err(o.err("the MLP's adjusted width (block_ff_dim) is zero"));
    }
    o.within(&["block_ff_dim"], ff, limits::WIDTH)
}

/// LFM2-MoE's sparse layers.
fn moe_config(o: &Obj<'_>, moe_layers: usize) -> Result<MoeConfig> {
    let n_experts = o.count_or(&["num_experts"], 32, limits::EXPERTS)?;
    let top_k = o.count_or(&["num_experts_per_tok"], 4, limits::EXPERTS)?;
    super::check_expert_total(o, &["num_experts"], n_experts, moe_layers)?;
    if top_k > n_experts {
        return Err(o.err(format!(
            "num_experts_per_tok ({top_k}) exceeds num_experts ({n_experts})"
        )));
    }
    Ok(MoeConfig {
        n_experts,
        top_k,
        routing: Routing::SigmoidGrouped {
            n_group: 1,
            topk_group: 1,
            scale: o.f32_or(&["routed_scaling_factor"], 1.0)?,
            renorm_eps: 1e-6,
        },
        expert_intermediate: o.count_or(&["moe_intermediate_size"], 1792, limits::WIDTH)?,
        norm_topk_prob: o.bool_or(&["norm_topk_prob"], true)?,
        shared_intermediate: None,
        shared_expert_gate: false,
    })
}

/// Each layer's feed-forward: LFM2's dense MLP everywhere, LFM2-MoE's
/// after its `num_dense_layers`.
fn ffn_kinds(t: ModelType, o: &Obj<'_>, layers: usize) -> Result<Vec<FfnKind>> {
    if t == ModelType::Lfm2 {
        return Ok(vec![FfnKind::Mlp; layers]);
    }
    let dense = o.usize_or(&["num_dense_layers"], 2)?;
    Ok((0..layers)
        .map(|i| match i < dense {
            true => FfnKind::Mlp,
            false => FfnKind::Moe,
        })
        .collect())
}

/// Where the language model's settings and weights are: the file itself
/// and `model.*`, or LFM2-VL's (`lfm2_vl`) `text_config` and
/// `model.language_model.*`.
fn nesting<'a>(o: &Obj<'a>) -> Result<(Obj<'a>, &'static str)> {
    if o.opt_str(&["model_type"])? != Some("lfm2_vl") {
        return Ok((*o, "model"));
    }
    let text = super::text_config(o, "lfm2_vl", "lfm2")?;
    Ok((text, "model.language_model"))
}

/// LFM2-VL's vision tower and projector, read but not loaded.
fn vision_aside() -> AsideWeights {
    AsideWeights {
        what: "vision tower",
        prefixes: vec![
            "model.vision_tower.".into(),
            "model.multi_modal_projector.".into(),
        ],
        why: "metrale runs this model text-only (no image input)",
        expected: Vec::new(),
        warn: true,
    }
}

pub(super) fn build(t: ModelType, outer: &Obj<'_>) -> Result<ModelConfig> {
    let (text, root) = nesting(outer)?;
    let o = &text;
    let mut common = Common::read(o)?;
    common.tie_word_embeddings = if root == "model" {
        o.bool_or(&["tie_word_embeddings", "tie_embedding"], true)?
    } else {
        super::wrapper_tie(outer, o, true)?
    };
    let num_layers = super::num_layers(o, &["num_hidden_layers"])?;
    if t == ModelType::Lfm2Moe && o.opt_str_list(&["layer_types"])?.is_none() {
        return Err(o.err(
            "key `layer_types` is missing: lfm2_moe configs list every layer (transformers \
             reads nothing else)",
        ));
    }
    let mixers = layer_mixers(o, num_layers, &mut common.warnings)?;
    let ffns = ffn_kinds(t, o, num_layers)?;
    let use_bias = o.bool_or(&["use_expert_bias"], true)?;
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
        embed: format!("{root}.embed_tokens.weight"),
        final_norm: format!("{root}.embedding_norm.weight"),
        lm_head: (!common.tie_word_embeddings).then(|| "lm_head.weight".into()),
    };
    let max_pos = o.size_or(&["max_position_embeddings"], 128_000)?;
    let moe_layers = ffns.iter().filter(|f| **f == FfnKind::Moe).count();
    let moe = (moe_layers > 0)
        .then(|| moe_config(o, moe_layers))
        .transpose()?;
    let mut config = common.base(t, eps, max_pos, names);
    config.layers = mixers
        .iter()
        .zip(&ffns)
        .enumerate()
        .map(|(i, (&mixer, &ffn))| LayerPlan {
            mixer,
            ffn,
            names: layer_names(
                &format!("{root}.layers.{i}"),
                mixer,
                bias,
                ffn,
                moe.as_ref().map(|m| (m, use_bias)),
            ),
            sliding_window: None,
        })
        .collect();
    config.attention = attention;
    if mixers.contains(&MixerKind::ShortConv) {
        config.short_conv = Some(ShortConvConfig { kernel, bias });
    }
    if ffns.contains(&FfnKind::Mlp) {
        let width = match t {
            ModelType::Lfm2 => ffn_width(o)?,
            _ => o.count_or(&["intermediate_size"], 7168, limits::WIDTH)?,
        };
        config.mlp = Some(MlpConfig {
            intermediate_size: width,
            activation: Activation::SwiGlu,
        });
    }
    config.moe = moe;
    if root != "model" {
        config.aside = vec![vision_aside()];
    }
    Ok(config)
}

/// The MLP under `p` (`w1` gate, `w3` up, `w2` down).
fn mlp_names(p: &str) -> MlpNames {
    MlpNames::Split {
        gate: format!("{p}.w1.weight"),
        up: format!("{p}.w3.weight"),
        down: format!("{p}.w2.weight"),
        bias: false,
    }
}

/// The family's tensor-name table (`moe`: the MoE settings and whether
/// there is an expert bias).
fn layer_names(
    p: &str,
    mixer: MixerKind,
    bias: bool,
    ffn: FfnKind,
    moe: Option<(&MoeConfig, bool)>,
) -> LayerNames {
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
    let f = format!("{p}.feed_forward");
    let ffn = match (ffn, moe) {
        (FfnKind::Moe, Some((m, expert_bias))) => FfnNames::Moe(MoeNames {
            router: format!("{f}.gate.weight"),
            router_bias: expert_bias.then(|| format!("{f}.expert_bias")),
            experts: ExpertNames::Separate(
                (0..m.n_experts)
                    .map(|e| mlp_names(&format!("{f}.experts.{e}")))
                    .collect(),
            ),
            shared: None,
            shared_gate: None,
        }),
        _ => FfnNames::Mlp(mlp_names(&f)),
    };
    LayerNames {
        input_norm: format!("{p}.operator_norm.weight"),
        ffn_norm: Some(format!("{p}.ffn_norm.weight")),
        mixer,
        ffn,
    }
}

use crate::gguf::GgufName::{Expert, Same};

const GGUF_GLOBALS: crate::gguf::GgufGroup = &[
    ("model.embed_tokens.weight", Same("token_embd.weight")),
    (
        "model.embedding_norm.weight",
        Same("token_embd_norm.weight"),
    ),
    ("lm_head.weight", Same("output.weight")),
];

const GGUF_LAYER: &[(&str, crate::gguf::GgufGroup)] = &[
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
];

/// LFM2 as llama.cpp's converter writes it (`lfm2`): every tensor as it
/// is (the conv weight squeezed to `[hidden, kernel]`), the final norm as
/// `token_embd_norm`.
pub(crate) const GGUF: crate::gguf::GgufTable = crate::gguf::GgufTable {
    layer_prefix: "model.layers.",
    globals: GGUF_GLOBALS,
    layer: GGUF_LAYER,
};

/// LFM2-VL's language model (`model.language_model.*`), for the
/// quantization rules by name (llama.cpp converts it to `lfm2`).
pub(crate) const GGUF_VL: crate::gguf::GgufTable = crate::gguf::GgufTable {
    layer_prefix: "model.language_model.layers.",
    globals: &[
        (
            "model.language_model.embed_tokens.weight",
            Same("token_embd.weight"),
        ),
        (
            "model.language_model.embedding_norm.weight",
            Same("token_embd_norm.weight"),
        ),
        ("lm_head.weight", Same("output.weight")),
    ],
    layer: GGUF_LAYER,
};

/// LFM2-MoE (`lfm2moe`): LFM2's names, the experts stacked
/// (`ffn_*_exps`), the router `ffn_gate_inp`, the expert bias
/// `exp_probs_b.bias`.
pub(crate) const GGUF_MOE: crate::gguf::GgufTable = crate::gguf::GgufTable {
    layer_prefix: "model.layers.",
    globals: GGUF_GLOBALS,
    layer: &[
        GGUF_LAYER[0],
        GGUF_LAYER[1],
        GGUF_LAYER[2],
        GGUF_LAYER[3],
        (
            "feed_forward.",
            &[
                ("gate.weight", Same("ffn_gate_inp.weight")),
                ("expert_bias", Same("exp_probs_b.bias")),
                ("experts.*.w1.weight", Expert("ffn_gate_exps.weight")),
                ("experts.*.w3.weight", Expert("ffn_up_exps.weight")),
                ("experts.*.w2.weight", Expert("ffn_down_exps.weight")),
            ],
        ),
    ],
};
