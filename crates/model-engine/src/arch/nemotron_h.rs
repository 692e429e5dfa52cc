//! Nemotron-H (`nemotron_h`): NVIDIA, "Nemotron-H: A Family of Accurate and
//! Efficient Hybrid Mamba-Transformer Models", arXiv:2504.03624; model cards
//! nvidia/Nemotron-H-8B-Base-8K, nvidia/NVIDIA-Nemotron-Nano-9B-v2.
//!
//! Each layer is a single residual block `x + mixer(rmsnorm(x))` whose mixer
//! is one of: Mamba-2 (`M`), attention (`*`), a squared-ReLU MLP (`-`:
//! `down(relu(up(x))^2)`, no gate), or a mixture of squared-ReLU experts
//! (`E`, Nemotron 3: sigmoid routing over expert groups, see [`read_moe`]). The layer list is `layers_block_type` (transformers 5:
//! `linear_attention` / `full_attention` / `mlp` / `moe`; older: `mamba` /
//! `attention`), its alias `layer_types`, or the string
//! `hybrid_override_pattern` such as `"M-M*-"`. A config may carry more than
//! one of them only if they describe the same layers (transformers keeps
//! `layer_types` over `layers_block_type` over the pattern without a word).
//! The list sets the layer count: a `num_hidden_layers` that disagrees is
//! ignored, as in transformers, with a warning.
//!
//! Attention has no positional encoding (no RoPE) and no biases (transformers
//! ignores `attention_bias`); MLP projections have biases when `mlp_bias`,
//! the Mamba projections when `use_bias`. The Mamba gated RMSNorm
//! normalises each of the `n_groups` groups separately (`group_size =
//! d_inner / n_groups`) with `layer_norm_epsilon`, the epsilon of every norm
//! here. In an MLP-only layer the block's norm is `input_norm` and
//! `ffn_norm` is None: the MLP is the layer's only sub-block.

use super::{
    Common, attention_heads, attention_names, check_mamba, mamba_names, mlp_bias, require_act,
};
use crate::config::json::Obj;
use crate::config::limits;
use crate::config::{
    Activation, AttentionConfig, ExpertNames, FfnKind, FfnNames, LayerNames, LayerPlan,
    MambaConfig, MixerKind, MixerNames, MlpConfig, MlpNames, ModelConfig, ModelNames, ModelType,
    MoeConfig, MoeNames, Routing,
};
use crate::error::Result;

/// A block of the hybrid pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Block {
    Mamba,
    Attention,
    Mlp,
    Moe,
}

impl Block {
    /// transformers 5's name of the block.
    fn name(&self) -> &'static str {
        match self {
            Block::Mamba => "linear_attention",
            Block::Attention => "full_attention",
            Block::Mlp => "mlp",
            Block::Moe => "moe",
        }
    }
}

/// config.json of `nemotron_h`, as read (both spellings).
struct RawNemotronH {
    common: Common,
    blocks: Vec<Block>,
    layer_norm_epsilon: f32,
    max_position_embeddings: usize,
}

const KNOWN: [&str; 6] = [
    "mamba",
    "linear_attention",
    "attention",
    "full_attention",
    "mlp",
    "moe",
];

/// The block list, with the key it was read from: every spelling present
/// (`layers_block_type`, `layer_types`, `hybrid_override_pattern`) is read,
/// and they must agree.
fn blocks<'a>(o: &Obj<'a>) -> Result<(&'a str, Vec<Block>)> {
    let mut found: Vec<(&'a str, Vec<Block>)> = Vec::new();
    for key in ["layers_block_type", "layer_types"] {
        let Some((key, types)) = o.opt_str_list(&[key])? else {
            continue;
        };
        let blocks = types
            .iter()
            .enumerate()
            .map(|(i, t)| match *t {
                "mamba" | "linear_attention" => Ok(Block::Mamba),
                "attention" | "full_attention" => Ok(Block::Attention),
                "mlp" => Ok(Block::Mlp),
                "moe" => Ok(Block::Moe),
                other => Err(super::unknown_layer_type(o, key, i, other, &KNOWN)),
            })
            .collect::<Result<Vec<_>>>()?;
        found.push((key, blocks));
    }
    if let Some(pattern) = o.opt_str(&["hybrid_override_pattern"])? {
        let blocks = pattern
            .chars()
            .enumerate()
            .map(|(i, c)| match c {
                'M' => Ok(Block::Mamba),
                '*' => Ok(Block::Attention),
                '-' => Ok(Block::Mlp),
                'E' => Ok(Block::Moe),
                other => Err(o.err(format!(
                    "key `hybrid_override_pattern`[{i}] = {other:?} is not one of M * - E"
                ))),
            })
            .collect::<Result<Vec<_>>>()?;
        found.push(("hybrid_override_pattern", blocks));
    }
    let mut found = found.into_iter();
    let Some((key, blocks)) = found.next() else {
        return Err(o.err("key `layers_block_type` / `hybrid_override_pattern` is missing"));
    };
    for (other, theirs) in found {
        super::check_same_layers(o, (key, &blocks), (other, &theirs), Block::name)?;
    }
    Ok((key, blocks))
}

impl RawNemotronH {
    fn read(o: &Obj<'_>) -> Result<Self> {
        let (key, blocks) = blocks(o)?;
        if blocks.len() > limits::LAYERS.max {
            return Err(o.err(format!(
                "key `{key}` describes {} layers: more than {} is not supported",
                blocks.len(),
                limits::LAYERS.max
            )));
        }
        let mut common = Common::read(o)?;
        // transformers 5 derives the layer count from the block list and
        // ignores `num_hidden_layers` (its check against the list compares
        // the list with itself, so it never warns); so do we, but we say so.
        if let Some(n) = o.opt_usize(&["num_hidden_layers"])?
            && n != blocks.len()
        {
            common.warnings.push(o.warning(format_args!(
                "num_hidden_layers is {n}, but `{key}` describes {} layers; using `{key}`, \
                 as transformers does",
                blocks.len()
            )));
        }
        Ok(Self {
            common,
            blocks,
            layer_norm_epsilon: o.pos_f32_or(&["layer_norm_epsilon", "rms_norm_eps"], 1e-5)?,
            max_position_embeddings: o.size_or(&["max_position_embeddings"], 4096)?,
        })
    }
}

pub(super) fn build(o: &Obj<'_>) -> Result<ModelConfig> {
    let raw = RawNemotronH::read(o)?;
    let has = |b: Block| raw.blocks.contains(&b);
    let attention = if has(Block::Attention) {
        let (n_heads, n_kv_heads, head_dim) =
            attention_heads(o, raw.common.hidden_size, Some(128))?;
        // transformers builds these projections without biases whatever
        // `attention_bias` says (published configs carry `false`).
        Some(AttentionConfig {
            n_heads,
            n_kv_heads,
            head_dim,
            rope: None,
            scale: (head_dim as f32).powf(-0.5),
            qk_norm: false,
            output_gate: false,
            qkv_bias: false,
            o_bias: false,
        })
    } else {
        None
    };
    let mamba = if has(Block::Mamba) {
        require_act(o, &["mamba_hidden_act"], &["silu"], "silu")?;
        let n_groups = o.count_or(&["n_groups", "mamba_n_groups"], 8, limits::HEADS)?;
        let m = MambaConfig {
            n_heads: o.count_or(&["mamba_num_heads"], 128, limits::HEADS)?,
            head_dim: o.count_or(&["mamba_head_dim"], 64, limits::HEAD_DIM)?,
            d_state: o.count_or(&["ssm_state_size"], 128, limits::HEAD_DIM)?,
            n_groups,
            conv_kernel: o.count_or(&["conv_kernel", "mamba_d_conv"], 4, limits::CONV_KERNEL)?,
            chunk_size: o.size_or(&["chunk_size", "mamba_chunk_size"], 128)?,
            // The HF mixer (Zamba2's torch_forward) clamps dt from below at
            // `time_step_min` and ignores `time_step_limit`.
            time_step_limit: (o.f32_or(&["time_step_min"], 0.001)?, f32::INFINITY),
            conv_bias: o.bool_or(&["use_conv_bias", "mamba_conv_bias"], true)?,
            proj_bias: o.bool_or(&["use_bias"], false)?,
            norm_eps: raw.layer_norm_epsilon,
            norm_groups: n_groups,
        };
        check_mamba(o, &m)?;
        Some(m)
    } else {
        None
    };
    let mlp = if has(Block::Mlp) {
        require_act(o, &["mlp_hidden_act"], &["relu2"], "relu2")?;
        Some(MlpConfig {
            intermediate_size: o.count(&["intermediate_size"], limits::WIDTH)?,
            activation: Activation::Relu2,
        })
    } else {
        None
    };

    let moe = if has(Block::Moe) {
        let m = read_moe(o)?;
        let moe_layers = raw.blocks.iter().filter(|b| **b == Block::Moe).count();
        super::check_expert_total(o, &EXPERT_KEYS, m.n_experts, moe_layers)?;
        Some(m)
    } else {
        None
    };

    let mlp_bias = mlp_bias(o)?;
    let experts = moe.as_ref().map_or(0, |m| m.n_experts);
    let mut config = raw.common.base(
        ModelType::NemotronH,
        raw.layer_norm_epsilon,
        raw.max_position_embeddings,
        model_names(),
    );
    // transformers never ties Nemotron-H's head to its embedding (its model
    // declares no tied weights): `lm_head.weight` is read whatever
    // `tie_word_embeddings` says (published configs say false).
    config.tie_word_embeddings = false;
    config.layers = raw
        .blocks
        .iter()
        .enumerate()
        .map(|(i, &b)| {
            let (mixer, ffn) = match b {
                Block::Mamba => (MixerKind::Mamba2, FfnKind::None),
                Block::Attention => (MixerKind::Attention, FfnKind::None),
                Block::Mlp => (MixerKind::None, FfnKind::Mlp),
                Block::Moe => (MixerKind::None, FfnKind::Moe),
            };
            LayerPlan {
                mixer,
                ffn,
                names: layer_names(i, b, attention.as_ref(), mamba.as_ref(), mlp_bias, experts),
                sliding_window: None,
            }
        })
        .collect();
    config.attention = attention;
    config.mamba = mamba;
    config.mlp = mlp;
    config.moe = moe;
    Ok(config)
}

/// The spellings of the routed-expert count.
const EXPERT_KEYS: [&str; 2] = ["n_routed_experts", "num_local_experts"];

/// The MoE layers' settings: `n_routed_experts` squared-ReLU experts (no
/// gate) chosen by sigmoid routing with a correction bias over expert groups
/// (`n_group`, `topk_group`), weights renormalised when `norm_topk_prob` and
/// scaled by `routed_scaling_factor`, plus one always-on shared expert of
/// `moe_shared_expert_intermediate_size` (transformers builds exactly one,
/// whatever `n_shared_experts` says).
fn read_moe(o: &Obj<'_>) -> Result<MoeConfig> {
    require_act(o, &["mlp_hidden_act"], &["relu2"], "relu2")?;
    if o.opt_usize(&["moe_latent_size"])?.is_some() {
        return Err(o.err("key `moe_latent_size`: latent MoE projections are not supported"));
    }
    let n_experts = o.count_or(&EXPERT_KEYS, 8, limits::EXPERTS)?;
    let top_k = o.size_or(&["num_experts_per_tok"], 2)?;
    let n_group = o.size_or(&["n_group"], 1)?;
    let topk_group = o.size_or(&["topk_group"], 1)?;
    if !n_experts.is_multiple_of(n_group) || topk_group > n_group {
        return Err(o.err(format!(
            "{n_experts} experts in {n_group} groups, of which the best {topk_group} are kept: not a valid grouping"
        )));
    }
    if top_k > topk_group * (n_experts / n_group) {
        return Err(o.err(format!(
            "num_experts_per_tok ({top_k}) exceeds the experts of the {topk_group} kept groups"
        )));
    }
    Ok(MoeConfig {
        n_experts,
        top_k,
        routing: Routing::SigmoidGrouped {
            n_group,
            topk_group,
            scale: o.f32_or(&["routed_scaling_factor"], 1.0)?,
            renorm_eps: 1e-20,
        },
        expert_intermediate: o.count_or(&["moe_intermediate_size"], 7688, limits::WIDTH)?,
        norm_topk_prob: o.bool_or(&["norm_topk_prob"], true)?,
        shared_intermediate: Some(o.count_or(
            &["moe_shared_expert_intermediate_size"],
            7688,
            limits::WIDTH,
        )?),
        shared_expert_gate: false,
    })
}

/// The family's tensor-name table: one `norm` and one `mixer` per layer.
fn layer_names(
    i: usize,
    block: Block,
    a: Option<&AttentionConfig>,
    m: Option<&MambaConfig>,
    mlp_bias: bool,
    experts: usize,
) -> LayerNames {
    let p = format!("backbone.layers.{i}");
    let (mixer, ffn) = match (block, a, m) {
        (Block::Attention, Some(a), _) => (
            MixerNames::Attention(attention_names(&format!("{p}.mixer"), a)),
            FfnNames::None,
        ),
        (Block::Mamba, _, Some(m)) => (
            MixerNames::Mamba2(mamba_names(&format!("{p}.mixer"), m)),
            FfnNames::None,
        ),
        (Block::Moe, ..) => {
            let plain = |q: &str, bias: bool| MlpNames::Plain {
                up: format!("{q}.up_proj.weight"),
                down: format!("{q}.down_proj.weight"),
                bias,
            };
            let moe = MoeNames {
                router: format!("{p}.mixer.gate.weight"),
                router_bias: Some(format!("{p}.mixer.gate.e_score_correction_bias")),
                experts: ExpertNames::Separate(
                    (0..experts)
                        .map(|e| plain(&format!("{p}.mixer.experts.{e}"), false))
                        .collect(),
                ),
                shared: Some(plain(&format!("{p}.mixer.shared_experts"), mlp_bias)),
                shared_gate: None,
            };
            (MixerNames::None, FfnNames::Moe(moe))
        }
        _ => (
            MixerNames::None,
            FfnNames::Mlp(MlpNames::Plain {
                up: format!("{p}.mixer.up_proj.weight"),
                down: format!("{p}.mixer.down_proj.weight"),
                bias: mlp_bias,
            }),
        ),
    };
    LayerNames {
        input_norm: format!("{p}.norm.weight"),
        ffn_norm: None,
        mixer,
        ffn,
    }
}

fn model_names() -> ModelNames {
    ModelNames {
        embed: "backbone.embeddings.weight".into(),
        final_norm: "backbone.norm_f.weight".into(),
        lm_head: Some("lm_head.weight".into()),
    }
}

use crate::gguf::GgufName::*;
use crate::gguf::GgufTable;
/// llama.cpp's names for Nemotron-H (`convert_hf_to_gguf.py`'s
/// `NemotronHModel`, a `GraniteHybridModel`): Mamba-2 layers as
/// `Mamba2Model` stores them, attention q/k rows permuted as `LlamaModel`'s,
/// the MLP as `ffn_up`/`ffn_down`. (MoE layers, `nemotron_h_moe`, are not
/// mapped.)
pub(crate) const GGUF: GgufTable = GgufTable {
    layer_prefix: "backbone.layers.",
    globals: &[
        ("backbone.embeddings.weight", Same("token_embd.weight")),
        ("backbone.norm_f.weight", Same("output_norm.weight")),
        ("lm_head.weight", Same("output.weight")),
    ],
    layer: &[
        ("", &[("norm.weight", Same("attn_norm.weight"))]),
        ("mixer.", crate::gguf::MAMBA2),
        ("mixer.", crate::gguf::ATTENTION_PERMUTED),
        (
            "mixer.",
            &[
                ("up_proj.weight", Same("ffn_up.weight")),
                ("down_proj.weight", Same("ffn_down.weight")),
                ("up_proj.bias", Same("ffn_up.bias")),
                ("down_proj.bias", Same("ffn_down.bias")),
            ],
        ),
        // The MoE layers (`nemotron_h_moe`): experts stacked per matrix.
        (
            "mixer.",
            &[
                ("gate.weight", Same("ffn_gate_inp.weight")),
                ("gate.e_score_correction_bias", Same("exp_probs_b.bias")),
                ("experts.*.up_proj.weight", Expert("ffn_up_exps.weight")),
                ("experts.*.down_proj.weight", Expert("ffn_down_exps.weight")),
                ("shared_experts.up_proj.weight", Same("ffn_up_shexp.weight")),
                (
                    "shared_experts.down_proj.weight",
                    Same("ffn_down_shexp.weight"),
                ),
                ("shared_experts.up_proj.bias", Same("ffn_up_shexp.bias")),
                ("shared_experts.down_proj.bias", Same("ffn_down_shexp.bias")),
            ],
        ),
    ],
};
