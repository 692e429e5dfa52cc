//! Qwen3.5 and Qwen3.6 (`qwen3_5`, `qwen3_5_moe`): Qwen team, "Qwen3.5"
//! (model cards Qwen/Qwen3.5-0.8B … Qwen/Qwen3.5-397B-A17B), the successor
//! of Qwen3-Next (`qwen3_next.rs`): Gated DeltaNet layers (Yang, Kautz &
//! Hatamizadeh, arXiv:2412.06464) with every `full_attention_interval`-th
//! layer gated full attention; a dense SwiGLU MLP in every layer
//! (`qwen3_5`) or a sparse MoE with a sigmoid-gated shared expert in every
//! layer (`qwen3_5_moe`).
//!
//! Two nestings, both read:
//! - the published checkpoints are vision-language models
//!   (`Qwen3_5ForConditionalGeneration`): `model_type` `qwen3_5`, the
//!   language model's settings under `text_config` (`qwen3_5_text`), its
//!   weights under `model.language_model.*` beside the vision tower's
//!   `model.visual.*`; `lm_head` and `tie_word_embeddings` at the top level
//!   (transformers ties by the top-level key and ignores `text_config`'s,
//!   and itself saves the two differing);
//! - the language model alone (`Qwen3_5ForCausalLM`): `model_type`
//!   `qwen3_5_text`, flat, weights under `model.*`.
//!
//! Details the forward pass needs, beyond Qwen3-Next's (zero-centred norms,
//! gated attention, partial RoPE, the DeltaNet's gated output norm):
//! - The DeltaNet's projections are four tensors: `in_proj_qkv` (q, k and v
//!   of all heads, already in the conv's channel order), `in_proj_z`,
//!   `in_proj_b` and `in_proj_a`, not Qwen3-Next's per-key-head groups.
//! - RoPE is multimodal (`rope_parameters.mrope_section`, interleaved): the
//!   rotated frequencies are split into three sections driven by a
//!   temporal, a height and a width position. For text all three positions
//!   are the token's index, so every frequency turns by the same position:
//!   plain RoPE over the rotated channels, which is what runs here (the
//!   fixtures, made with sections that split the frequencies, prove it).
//! - The MoE router softmaxes over all experts and always renormalises the
//!   top k (`norm_topk_prob` is not read by transformers); the experts are
//!   stored one MLP each (`experts.{e}.{gate,up,down}_proj`), as
//!   transformers saves them (it fuses them in memory).

use super::qwen3_next::{deltanet, gated_attention, layer_mixers};
use super::{Common, attention_names, split_mlp};
use crate::config::json::{Obj, as_f64};
use crate::config::limits;
use crate::config::{
    Activation, AsideWeights, AttentionConfig, DeltaProjNames, FfnKind, FfnNames, LayerNames,
    LayerPlan, MixerKind, MixerNames, MlpConfig, ModelConfig, ModelNames, ModelType, MoeConfig,
    Routing, TensorSpec,
};
use crate::error::Result;

/// Where the language model's settings and weights live.
struct Nesting<'a> {
    /// The language model's settings: `text_config`, or the file itself.
    text: Obj<'a>,
    /// The prefix of the language model's weights (`model.language_model`
    /// or `model`).
    root: &'static str,
    tie_word_embeddings: bool,
}

/// The wrapper's `model_type` and its language model's.
fn type_names(model_type: ModelType) -> (&'static str, &'static str) {
    match model_type {
        ModelType::Qwen35Moe => ("qwen3_5_moe", "qwen3_5_moe_text"),
        _ => ("qwen3_5", "qwen3_5_text"),
    }
}

fn nesting<'a>(model_type: ModelType, o: &Obj<'a>) -> Result<Nesting<'a>> {
    let (wrapper, text_type) = type_names(model_type);
    let declared = o.opt_str(&["model_type"])?.unwrap_or(wrapper);
    if declared == text_type {
        return Ok(Nesting {
            text: *o,
            root: "model",
            tie_word_embeddings: o.bool_or(&["tie_word_embeddings"], false)?,
        });
    }
    let text = super::text_config(o, wrapper, text_type)?;
    Ok(Nesting {
        text,
        root: "model.language_model",
        tie_word_embeddings: super::wrapper_tie(o, &text, false)?,
    })
}

/// Checks `rope_parameters.mrope_section` (for text, any sections give
/// plain RoPE; see the module docs): whole numbers that share out the
/// rotated frequencies, else a warning.
fn check_mrope(t: &Obj<'_>, a: &AttentionConfig, warnings: &mut Vec<String>) -> Result<()> {
    let Some(params) = t.opt_obj("rope_parameters")? else {
        return Ok(());
    };
    let Some((key, list)) = params.opt_list(&["mrope_section"])? else {
        return Ok(());
    };
    let sections: Option<Vec<f64>> = list.iter().map(as_f64).collect();
    let Some(sections) = sections.filter(|s| s.iter().all(|x| *x >= 0.0 && x.fract() == 0.0))
    else {
        return Err(t.err(format!(
            "key `rope_parameters.{key}`: expected a list of whole numbers"
        )));
    };
    let frequencies = a.rope.as_ref().map_or(0, |r| r.rotary_dim / 2);
    let sum: f64 = sections.iter().sum();
    if sum != frequencies as f64 {
        warnings.push(t.warning(format_args!(
            "key `rope_parameters.{key}` shares out {sum} frequencies, but the rotated \
             channels have {frequencies}; text positions are rotated by plain RoPE either way"
        )));
    }
    Ok(())
}

/// The MoE of `qwen3_5_moe` (every layer).
fn moe_config(t: &Obj<'_>, layers: usize, warnings: &mut Vec<String>) -> Result<MoeConfig> {
    let n_experts = t.count_or(&["num_experts"], 256, limits::EXPERTS)?;
    let top_k = t.count_or(&["num_experts_per_tok"], 8, limits::EXPERTS)?;
    super::check_expert_total(t, &["num_experts"], n_experts, layers)?;
    if top_k > n_experts {
        return Err(t.err(format!(
            "num_experts_per_tok ({top_k}) exceeds num_experts ({n_experts})"
        )));
    }
    let ignored = [
        ("norm_topk_prob", "the router always renormalises its top k"),
        ("decoder_sparse_step", "every layer is MoE"),
        ("mlp_only_layers", "every layer is MoE"),
    ];
    for (key, why) in ignored {
        let neutral = match key {
            "norm_topk_prob" => t.bool_or(&[key], true)?,
            "decoder_sparse_step" => t.size_or(&[key], 1)? == 1,
            _ => t.opt_usize_list(&[key])?.unwrap_or_default().is_empty(),
        };
        if !neutral {
            warnings.push(t.warning(format_args!(
                "key `{}` is ignored by transformers for this model type ({why})",
                t.key_name(key)
            )));
        }
    }
    let shared = t.count_or_zero(&["shared_expert_intermediate_size"], 512, limits::WIDTH)?;
    Ok(MoeConfig {
        n_experts,
        top_k,
        routing: Routing::Softmax,
        expert_intermediate: t.count_or(&["moe_intermediate_size"], 512, limits::WIDTH)?,
        norm_topk_prob: true,
        shared_intermediate: (shared > 0).then_some(shared),
        shared_expert_gate: shared > 0,
    })
}

pub(super) fn build(model_type: ModelType, o: &Obj<'_>) -> Result<ModelConfig> {
    let n = nesting(model_type, o)?;
    let t = &n.text;
    let mut common = Common::read(t)?;
    common.tie_word_embeddings = n.tie_word_embeddings;
    super::require_act(t, &["hidden_act"], &["silu"], "silu")?;
    let num_layers = super::num_layers(t, &["num_hidden_layers"])?;
    let mixers = layer_mixers(t, num_layers)?;
    let eps = t.pos_f32_or(&["rms_norm_eps"], 1e-6)?;
    let attention = gated_attention(t, &mixers, common.hidden_size)?;
    if let Some(a) = &attention {
        check_mrope(t, a, &mut common.warnings)?;
    }
    let deltanet = deltanet(t, &mixers, eps)?;
    let ffn = match model_type {
        ModelType::Qwen35Moe => FfnKind::Moe,
        _ => FfnKind::Mlp,
    };
    let moe = match ffn {
        FfnKind::Moe => Some(moe_config(t, num_layers, &mut common.warnings)?),
        _ => None,
    };
    let names = ModelNames {
        embed: format!("{}.embed_tokens.weight", n.root),
        final_norm: format!("{}.norm.weight", n.root),
        lm_head: (!common.tie_word_embeddings).then(|| "lm_head.weight".into()),
    };
    let max_pos = t.size_or(&["max_position_embeddings"], 32768)?;
    let mut config = common.base(model_type, eps, max_pos, names);
    config.norm_weight_offset = 1.0;
    config.layers = mixers
        .iter()
        .enumerate()
        .map(|(i, &mixer)| LayerPlan {
            mixer,
            ffn,
            names: layer_names(
                &format!("{}.layers.{i}", n.root),
                mixer,
                ffn,
                &attention,
                &moe,
            ),
            sliding_window: None,
        })
        .collect();
    if ffn == FfnKind::Mlp {
        config.mlp = Some(MlpConfig {
            intermediate_size: t.count_or(&["intermediate_size"], 12288, limits::WIDTH)?,
            activation: Activation::SwiGlu,
        });
    }
    config.attention = attention;
    config.deltanet = deltanet;
    config.moe = moe;
    let mtp_layers = t.usize_or(&["mtp_num_hidden_layers"], 0)?;
    let vision = match o.opt_obj("vision_config")? {
        Some(v) if n.root != "model" => vision_tensors(&v)?,
        _ => Vec::new(),
    };
    config.aside = vec![vision_aside(vision), mtp_aside(&config, mtp_layers, ffn)];
    Ok(config)
}

/// The vision tower of the published checkpoints (`model.visual.*`), with
/// the tensors its `vision_config` describes (none without one).
fn vision_aside(expected: Vec<TensorSpec>) -> AsideWeights {
    AsideWeights {
        what: "vision tower",
        prefixes: vec!["model.visual.".into()],
        why: "metrale runs this model text-only (no image or video input)",
        expected,
        warn: true,
    }
}

/// The vision tower's tensors as transformers' `Qwen3_5VisionModel` holds
/// them (defaults: its config class's): a 3-D patch embedding, learned
/// position embeddings, `depth` pre-LayerNorm blocks (fused qkv, GELU MLP,
/// all with biases), and the merger that folds `spatial_merge_size²`
/// patches into one token of `out_hidden_size`. Listed so that `inspect`
/// counts the tower and a load checks it, not to run it.
fn vision_tensors(v: &Obj<'_>) -> Result<Vec<TensorSpec>> {
    let h = v.count_or(&["hidden_size"], 1152, limits::WIDTH)?;
    let inter = v.count_or(&["intermediate_size"], 4304, limits::WIDTH)?;
    let depth = v.count_or(&["depth"], 27, limits::LAYERS)?;
    let channels = v.count_or(&["in_channels"], 3, limits::HEADS)?;
    let patch = v.count_or(&["patch_size"], 16, limits::HEAD_DIM)?;
    let temporal = v.count_or(&["temporal_patch_size"], 2, limits::HEAD_DIM)?;
    let merge = v.count_or(&["spatial_merge_size"], 2, limits::HEAD_DIM)?;
    let out = v.count_or(&["out_hidden_size"], 3584, limits::WIDTH)?;
    let positions = v.count_or(&["num_position_embeddings"], 2304, limits::VOCAB)?;
    let merged = h * merge * merge;
    let p = "model.visual";
    let mut specs = Vec::new();
    let mut push = |name: String, shape: Vec<usize>| specs.push(TensorSpec { name, shape });
    push(
        format!("{p}.patch_embed.proj.weight"),
        vec![h, channels, temporal, patch, patch],
    );
    push(format!("{p}.patch_embed.proj.bias"), vec![h]);
    push(format!("{p}.pos_embed.weight"), vec![positions, h]);
    // A layer's weight (`shape`) and its bias (the first dimension).
    let mut layer = |name: String, shape: Vec<usize>| {
        push(format!("{name}.bias"), vec![shape[0]]);
        push(format!("{name}.weight"), shape);
    };
    for i in 0..depth {
        let b = format!("{p}.blocks.{i}");
        layer(format!("{b}.norm1"), vec![h]);
        layer(format!("{b}.norm2"), vec![h]);
        layer(format!("{b}.attn.qkv"), vec![3 * h, h]);
        layer(format!("{b}.attn.proj"), vec![h, h]);
        layer(format!("{b}.mlp.linear_fc1"), vec![inter, h]);
        layer(format!("{b}.mlp.linear_fc2"), vec![h, inter]);
    }
    layer(format!("{p}.merger.norm"), vec![h]);
    layer(format!("{p}.merger.linear_fc1"), vec![merged, merged]);
    layer(format!("{p}.merger.linear_fc2"), vec![out, merged]);
    Ok(specs)
}

/// The multi-token prediction layers (`mtp.*`, `layers` of them as
/// `mtp_num_hidden_layers` says): each a full-attention decoder layer with
/// the model's feed-forward, fed by `fc` from the normed embedding and
/// hidden state (`pre_fc_norm_embedding`, `pre_fc_norm_hidden`), and a
/// final `norm`. Checked at load for speculative decoding to use later; not
/// in the memory plan. With no layer count (Qwen3-Next's configs) the
/// tensors are only set aside.
pub(super) fn mtp_aside(config: &ModelConfig, layers: usize, ffn: FfnKind) -> AsideWeights {
    let h = config.hidden_size;
    let mut expected = Vec::new();
    if layers > 0 && config.attention.is_some() {
        let spec = |name: &str, shape: Vec<usize>| TensorSpec {
            name: format!("mtp.{name}"),
            shape,
        };
        expected.push(spec("fc.weight", vec![h, 2 * h]));
        for norm in ["pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"] {
            expected.push(spec(&format!("{norm}.weight"), vec![h]));
        }
        for i in 0..layers {
            let p = format!("mtp.layers.{i}");
            let names = layer_names(
                &p,
                MixerKind::Attention,
                ffn,
                &config.attention,
                &config.moe,
            );
            expected.extend(config.layer_specs(&names));
        }
    }
    AsideWeights {
        what: "multi-token prediction layers",
        prefixes: vec!["mtp.".into()],
        why: "they are for speculative decoding, which does not use them yet",
        expected,
        warn: false,
    }
}

/// The family's tensor-name table, for the layer under `p`.
fn layer_names(
    p: &str,
    mixer: MixerKind,
    ffn: FfnKind,
    attention: &Option<AttentionConfig>,
    moe: &Option<MoeConfig>,
) -> LayerNames {
    let mixer = match (mixer, attention) {
        (MixerKind::Attention, Some(a)) => {
            MixerNames::Attention(attention_names(&format!("{p}.self_attn"), a))
        }
        _ => {
            let l = format!("{p}.linear_attn");
            let proj = DeltaProjNames::Split {
                qkv: format!("{l}.in_proj_qkv.weight"),
                z: format!("{l}.in_proj_z.weight"),
                b: format!("{l}.in_proj_b.weight"),
                a: format!("{l}.in_proj_a.weight"),
            };
            super::qwen3_next::deltanet_names(&l, proj)
        }
    };
    let ffn = match (ffn, moe) {
        (FfnKind::Moe, Some(m)) => FfnNames::Moe(super::qwen3_next::moe_names(
            p,
            m.n_experts,
            m.shared_intermediate.is_some(),
        )),
        _ => FfnNames::Mlp(split_mlp(&format!("{p}.mlp"), false)),
    };
    super::qwen3_next::layer(p, mixer, ffn)
}

use crate::gguf::GgufName::{NegExp, PlusOne, Same};

/// A Qwen3.5 layer as llama.cpp's converter writes it (`qwen35`,
/// `qwen35moe`): norm weights stored as `w + 1` (but the gated norm's),
/// `A_log` as `A = -exp(A_log)`, the experts stacked. Where the value heads
/// outnumber the key heads the converter also reorders the value heads
/// (grouped by key head to tiled), which reading such a file would have to
/// undo; the table serves the quantization rules, by name.
const GGUF_LAYER: &[(&str, crate::gguf::GgufGroup)] = &[
    (
        "",
        &[
            ("input_layernorm.weight", PlusOne("attn_norm.weight")),
            (
                "post_attention_layernorm.weight",
                PlusOne("post_attention_norm.weight"),
            ),
        ],
    ),
    (
        "linear_attn.",
        &[
            ("in_proj_qkv.weight", Same("attn_qkv.weight")),
            ("in_proj_z.weight", Same("attn_gate.weight")),
            ("in_proj_b.weight", Same("ssm_beta.weight")),
            ("in_proj_a.weight", Same("ssm_alpha.weight")),
            ("conv1d.weight", Same("ssm_conv1d.weight")),
            ("dt_bias", Same("ssm_dt.bias")),
            ("A_log", NegExp("ssm_a")),
            ("norm.weight", Same("ssm_norm.weight")),
            ("out_proj.weight", Same("ssm_out.weight")),
        ],
    ),
    ("self_attn.", crate::gguf::ATTENTION),
    (
        "self_attn.",
        &[
            ("q_norm.weight", PlusOne("attn_q_norm.weight")),
            ("k_norm.weight", PlusOne("attn_k_norm.weight")),
        ],
    ),
    ("mlp.", super::qwen3_next::GGUF_MOE),
    ("mlp.", crate::gguf::GATED_MLP),
];

/// The language model alone (`model.*`).
pub(crate) const GGUF_TEXT: crate::gguf::GgufTable = crate::gguf::GgufTable {
    layer_prefix: "model.layers.",
    globals: &[
        ("model.embed_tokens.weight", Same("token_embd.weight")),
        ("model.norm.weight", PlusOne("output_norm.weight")),
        ("lm_head.weight", Same("output.weight")),
    ],
    layer: GGUF_LAYER,
};

/// The vision-language wrapper (`model.language_model.*`).
pub(crate) const GGUF_WRAPPED: crate::gguf::GgufTable = crate::gguf::GgufTable {
    layer_prefix: "model.language_model.layers.",
    globals: &[
        (
            "model.language_model.embed_tokens.weight",
            Same("token_embd.weight"),
        ),
        (
            "model.language_model.norm.weight",
            PlusOne("output_norm.weight"),
        ),
        ("lm_head.weight", Same("output.weight")),
    ],
    layer: GGUF_LAYER,
};
