//! Qwen3-Next (`qwen3_next`): Qwen team, "Qwen3-Next: Towards Ultimate
//! Training & Inference Efficiency" (model card Qwen/Qwen3-Next-80B-A3B),
//! with Gated DeltaNet from Yang, Kautz & Hatamizadeh, "Gated Delta Networks:
//! Improving Mamba2 with Delta Rule", arXiv:2412.06464.
//!
//! Layers: Gated DeltaNet (`linear_attention`) or gated full attention
//! (`full_attention`; by default every `full_attention_interval`-th = 4th
//! layer), each followed by a sparse MoE with a sigmoid-gated shared expert,
//! or by a dense SwiGLU MLP for layers in `mlp_only_layers` or off the
//! `decoder_sparse_step` grid. `layer_types` and `full_attention_interval`
//! may both be given only if they agree; `mlp_only_layers` must name layers
//! that exist (transformers skips the others); `decoder_sparse_step` and
//! `full_attention_interval` must be positive (transformers divides by them).
//!
//! Details the forward pass needs:
//! - Layer, final and q/k norms are zero-centred: `x * rsqrt(mean(x^2) +
//!   eps) * (1 + w)` (`norm_weight_offset` 1.0). The DeltaNet output norm is
//!   NOT: it is `rmsnorm(x) * w * silu(z)` per value head (`head_v_dim`
//!   channels), plain `w`, epsilon `rms_norm_eps`.
//! - Attention: `q_proj` is `[n_heads * 2 * head_dim, H]`, per head the query
//!   then the gate; the output is `attn * sigmoid(gate)` before `o_proj`.
//!   RoPE rotates `partial_rotary_factor` (default 0.25) of each head.
//! - DeltaNet `in_proj_qkvz` rows are grouped per key head: for each of the
//!   `n_k_heads`, `[q (dk), k (dk), v (nv/nk * dv), z (nv/nk * dv)]`; and
//!   `in_proj_ba` per key head `[b (nv/nk), a (nv/nk)]`. The causal conv
//!   (no bias, SiLU) runs over `[q all heads, k all heads, v all heads]`.
//! - The router softmaxes over all experts, keeps the top k, and
//!   renormalises them when `norm_topk_prob`.

use super::{
    Common, attention_heads, attention_names, check_layer_count, check_same_layers, layer_indices,
    mixer_name, require_act, split_mlp, unknown_layer_type,
};
use crate::config::json::Obj;
use crate::config::limits;
use crate::config::rope::{RopeDefaults, parse_rope};
use crate::config::{
    Activation, AttentionConfig, DeltaNetConfig, DeltaNetNames, DeltaProjNames, ExpertNames,
    FfnKind, FfnNames, LayerNames, LayerPlan, MixerKind, MixerNames, MlpConfig, ModelConfig,
    ModelNames, ModelType, MoeConfig, MoeNames, Routing,
};
use crate::error::Result;

/// config.json of `qwen3_next`, as read.
struct RawQwen3Next {
    common: Common,
    mixers: Vec<MixerKind>,
    rms_norm_eps: f32,
    max_position_embeddings: usize,
    intermediate_size: usize,
    num_experts: usize,
    num_experts_per_tok: usize,
    moe_intermediate_size: usize,
    shared_expert_intermediate_size: usize,
    norm_topk_prob: bool,
    decoder_sparse_step: usize,
    mlp_only_layers: Vec<usize>,
}

impl RawQwen3Next {
    fn read(o: &Obj<'_>) -> Result<Self> {
        let mut common = Common::read(o)?;
        require_act(o, &["hidden_act"], &["silu"], "silu")?;
        let num_layers = super::num_layers(o, &["num_hidden_layers"])?;
        let mixers = layer_mixers(o, num_layers)?;
        let mlp_only_layers =
            layer_indices(o, "mlp_only_layers", num_layers, &mut common.warnings)?;
        let num_experts = o.count_or_zero(&["num_experts"], 512, limits::EXPERTS)?;
        Ok(Self {
            mixers,
            rms_norm_eps: o.pos_f32_or(&["rms_norm_eps"], 1e-6)?,
            max_position_embeddings: o.size_or(&["max_position_embeddings"], 32768)?,
            intermediate_size: o.count_or(&["intermediate_size"], 5632, limits::WIDTH)?,
            num_experts,
            num_experts_per_tok: o.size_or(&["num_experts_per_tok"], 10)?,
            moe_intermediate_size: o.count_or(&["moe_intermediate_size"], 512, limits::WIDTH)?,
            shared_expert_intermediate_size: o.count_or_zero(
                &["shared_expert_intermediate_size"],
                512,
                limits::WIDTH,
            )?,
            norm_topk_prob: o.bool_or(&["norm_topk_prob"], true)?,
            decoder_sparse_step: o.size_or(&["decoder_sparse_step"], 1)?,
            mlp_only_layers,
            common,
        })
    }

    /// Whether layer `i` has the sparse MoE (else the dense MLP).
    fn is_moe(&self, i: usize) -> bool {
        !self.mlp_only_layers.contains(&i)
            && self.num_experts > 0
            && (i + 1).is_multiple_of(self.decoder_sparse_step)
    }
}

pub(super) fn build(o: &Obj<'_>) -> Result<ModelConfig> {
    let raw = RawQwen3Next::read(o)?;
    let attention = gated_attention(o, &raw.mixers, raw.common.hidden_size)?;
    let deltanet = deltanet(o, &raw.mixers, raw.rms_norm_eps)?;
    let ffns: Vec<FfnKind> = (0..raw.mixers.len())
        .map(|i| {
            if raw.is_moe(i) {
                FfnKind::Moe
            } else {
                FfnKind::Mlp
            }
        })
        .collect();
    let moe_layers = ffns.iter().filter(|f| **f == FfnKind::Moe).count();
    super::check_expert_total(o, &["num_experts"], raw.num_experts, moe_layers)?;
    if ffns.contains(&FfnKind::Moe) && raw.num_experts_per_tok > raw.num_experts {
        return Err(o.err(format!(
            "num_experts_per_tok ({}) exceeds num_experts ({})",
            raw.num_experts_per_tok, raw.num_experts
        )));
    }

    let names = model_names(raw.common.tie_word_embeddings);
    let mut config = raw.common.base(
        ModelType::Qwen3Next,
        raw.rms_norm_eps,
        raw.max_position_embeddings,
        names,
    );
    config.norm_weight_offset = 1.0;
    config.layers = raw
        .mixers
        .iter()
        .zip(&ffns)
        .enumerate()
        .map(|(i, (&mixer, &ffn))| LayerPlan {
            mixer,
            ffn,
            names: layer_names(i, mixer, ffn, attention.as_ref(), &raw),
            sliding_window: None,
        })
        .collect();
    config.attention = attention;
    config.deltanet = deltanet;
    if ffns.contains(&FfnKind::Moe) {
        let shared = (raw.shared_expert_intermediate_size > 0)
            .then_some(raw.shared_expert_intermediate_size);
        config.moe = Some(MoeConfig {
            n_experts: raw.num_experts,
            top_k: raw.num_experts_per_tok,
            routing: Routing::Softmax,
            expert_intermediate: raw.moe_intermediate_size,
            norm_topk_prob: raw.norm_topk_prob,
            shared_intermediate: shared,
            shared_expert_gate: shared.is_some(),
        });
    }
    if ffns.contains(&FfnKind::Mlp) {
        config.mlp = Some(MlpConfig {
            intermediate_size: raw.intermediate_size,
            activation: Activation::SwiGlu,
        });
    }
    // The published checkpoints hold MTP layers; the config does not count them.
    config.aside = vec![super::qwen3_5::mtp_aside(&config, 0, FfnKind::Moe)];
    Ok(config)
}

/// The layers' mixers: `layer_types`, else every `full_attention_interval`-th
/// (default 4th) layer attention and the others DeltaNet; both given must
/// agree (transformers ignores the interval when the list is given).
pub(super) fn layer_mixers(o: &Obj<'_>, num_layers: usize) -> Result<Vec<MixerKind>> {
    let interval = o.size_or(&["full_attention_interval"], 4)?;
    let from_interval: Vec<MixerKind> = (0..num_layers)
        .map(|i| {
            if (i + 1) % interval == 0 {
                MixerKind::Attention
            } else {
                MixerKind::GatedDeltaNet
            }
        })
        .collect();
    let Some((key, types)) = o.opt_str_list(&["layer_types"])? else {
        return Ok(from_interval);
    };
    check_layer_count(o, key, types.len())?;
    let mixers = types
        .iter()
        .enumerate()
        .map(|(i, t)| match *t {
            "linear_attention" => Ok(MixerKind::GatedDeltaNet),
            "full_attention" | "attention" => Ok(MixerKind::Attention),
            other => Err(unknown_layer_type(
                o,
                key,
                i,
                other,
                &["linear_attention", "full_attention"],
            )),
        })
        .collect::<Result<Vec<_>>>()?;
    if o.get(&["full_attention_interval"]).is_some() {
        check_same_layers(
            o,
            (key, &mixers),
            ("full_attention_interval", &from_interval),
            mixer_name,
        )?;
    }
    Ok(mixers)
}

/// The gated full attention (query and output gate from `q_proj`, q/k
/// norms, a quarter of each head rotated by default), when a layer has it.
pub(super) fn gated_attention(
    o: &Obj<'_>,
    mixers: &[MixerKind],
    hidden: usize,
) -> Result<Option<AttentionConfig>> {
    if !mixers.contains(&MixerKind::Attention) {
        return Ok(None);
    }
    let (n_heads, n_kv_heads, head_dim) = attention_heads(o, hidden, Some(256))?;
    let bias = o.bool_or(&["attention_bias"], false)?;
    let defaults = RopeDefaults {
        partial_rotary_factor: 0.25,
        ..RopeDefaults::default()
    };
    Ok(Some(AttentionConfig {
        n_heads,
        n_kv_heads,
        head_dim,
        rope: Some(parse_rope(o, head_dim, defaults)?),
        scale: (head_dim as f32).powf(-0.5),
        qk_norm: true,
        output_gate: true,
        qkv_bias: bias,
        o_bias: bias,
    }))
}

/// The gated DeltaNet's shape (`linear_*` keys), when a layer has it.
pub(super) fn deltanet(
    o: &Obj<'_>,
    mixers: &[MixerKind],
    norm_eps: f32,
) -> Result<Option<DeltaNetConfig>> {
    if !mixers.contains(&MixerKind::GatedDeltaNet) {
        return Ok(None);
    }
    let d = DeltaNetConfig {
        n_k_heads: o.count_or(&["linear_num_key_heads"], 16, limits::HEADS)?,
        n_v_heads: o.count_or(&["linear_num_value_heads"], 32, limits::HEADS)?,
        k_head_dim: o.count_or(&["linear_key_head_dim"], 128, limits::HEAD_DIM)?,
        v_head_dim: o.count_or(&["linear_value_head_dim"], 128, limits::HEAD_DIM)?,
        conv_kernel: o.count_or(&["linear_conv_kernel_dim"], 4, limits::CONV_KERNEL)?,
        norm_eps,
        tiled_v_heads: false,
    };
    if !d.n_v_heads.is_multiple_of(d.n_k_heads) {
        return Err(o.err(format!(
            "linear_num_value_heads ({}) is not a multiple of linear_num_key_heads ({})",
            d.n_v_heads, d.n_k_heads
        )));
    }
    if d.conv_kernel < 2 {
        return Err(o.err("key `linear_conv_kernel_dim` must be at least 2"));
    }
    Ok(Some(d))
}

/// A Gated DeltaNet mixer's tensors under `l` (`….linear_attn`), given
/// its input projections (Qwen3-Next groups them, Qwen3.5 splits them).
pub(super) fn deltanet_names(l: &str, proj: DeltaProjNames) -> MixerNames {
    MixerNames::GatedDeltaNet(DeltaNetNames {
        proj,
        conv_weight: format!("{l}.conv1d.weight"),
        dt_bias: format!("{l}.dt_bias"),
        a_log: format!("{l}.A_log"),
        norm: format!("{l}.norm.weight"),
        out_proj: format!("{l}.out_proj.weight"),
    })
}

/// The family's tensor-name table.
fn layer_names(
    i: usize,
    mixer: MixerKind,
    ffn: FfnKind,
    a: Option<&AttentionConfig>,
    raw: &RawQwen3Next,
) -> LayerNames {
    let p = format!("model.layers.{i}");
    let mixer = match (mixer, a) {
        (MixerKind::Attention, Some(a)) => {
            MixerNames::Attention(attention_names(&format!("{p}.self_attn"), a))
        }
        _ => {
            let l = format!("{p}.linear_attn");
            let proj = DeltaProjNames::Grouped {
                qkvz: format!("{l}.in_proj_qkvz.weight"),
                ba: format!("{l}.in_proj_ba.weight"),
            };
            deltanet_names(&l, proj)
        }
    };
    let ffn = match ffn {
        FfnKind::Moe => {
            let shared = raw.shared_expert_intermediate_size > 0;
            FfnNames::Moe(moe_names(&p, raw.num_experts, shared))
        }
        _ => FfnNames::Mlp(split_mlp(&format!("{p}.mlp"), false)),
    };
    layer(&p, mixer, ffn)
}

/// The sparse MoE under `{p}.mlp` (also Qwen3.5's): a softmax router,
/// `n_experts` experts of their own, the shared expert and its gate.
pub(super) fn moe_names(p: &str, n_experts: usize, shared: bool) -> MoeNames {
    MoeNames {
        router: format!("{p}.mlp.gate.weight"),
        router_bias: None,
        experts: ExpertNames::Separate(
            (0..n_experts)
                .map(|e| split_mlp(&format!("{p}.mlp.experts.{e}"), false))
                .collect(),
        ),
        shared: shared.then(|| split_mlp(&format!("{p}.mlp.shared_expert"), false)),
        shared_gate: shared.then(|| format!("{p}.mlp.shared_expert_gate.weight")),
    }
}

/// A decoder layer under `p` with its two norms (also Qwen3.5's).
pub(super) fn layer(p: &str, mixer: MixerNames, ffn: FfnNames) -> LayerNames {
    LayerNames {
        input_norm: format!("{p}.input_layernorm.weight"),
        ffn_norm: Some(format!("{p}.post_attention_layernorm.weight")),
        mixer,
        ffn,
    }
}

fn model_names(tied: bool) -> ModelNames {
    ModelNames {
        embed: "model.embed_tokens.weight".into(),
        final_norm: "model.norm.weight".into(),
        lm_head: (!tied).then(|| "lm_head.weight".into()),
    }
}

use crate::gguf::GgufName::{Expert, NegExp, PlusOne, Qkvz, Same};

/// Qwen3-Next as llama.cpp's converter writes it (`qwen3next`): norm
/// weights stored as `w + 1` (but the gated norm's), `in_proj_qkvz`
/// regrouped into `attn_qkv` and `attn_gate`, `A_log` as `A = -exp(A_log)`,
/// the experts stacked into `ffn_*_exps`.
pub(crate) const GGUF: crate::gguf::GgufTable = crate::gguf::GgufTable {
    layer_prefix: "model.layers.",
    globals: &[
        ("model.embed_tokens.weight", Same("token_embd.weight")),
        ("model.norm.weight", PlusOne("output_norm.weight")),
        ("lm_head.weight", Same("output.weight")),
    ],
    layer: &[
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
                (
                    "in_proj_qkvz.weight",
                    Qkvz {
                        qkv: "attn_qkv.weight",
                        gate: "attn_gate.weight",
                    },
                ),
                ("in_proj_ba.weight", Same("ssm_ba.weight")),
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
        ("mlp.", GGUF_MOE),
        ("mlp.", crate::gguf::GATED_MLP),
    ],
};

/// The sparse MoE block's tensors (after `mlp.`), also Qwen3.5's.
pub(crate) const GGUF_MOE: crate::gguf::GgufGroup = &[
    ("gate.weight", Same("ffn_gate_inp.weight")),
    ("experts.*.gate_proj.weight", Expert("ffn_gate_exps.weight")),
    ("experts.*.up_proj.weight", Expert("ffn_up_exps.weight")),
    ("experts.*.down_proj.weight", Expert("ffn_down_exps.weight")),
    (
        "shared_expert.gate_proj.weight",
        Same("ffn_gate_shexp.weight"),
    ),
    ("shared_expert.up_proj.weight", Same("ffn_up_shexp.weight")),
    (
        "shared_expert.down_proj.weight",
        Same("ffn_down_shexp.weight"),
    ),
    (
        "shared_expert_gate.weight",
        Same("ffn_gate_inp_shexp.weight"),
    ),
];
