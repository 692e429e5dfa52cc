//! Pure Mamba-2 (`mamba2`): Dao & Gu, "Transformers are SSMs: Generalized
//! Models and Efficient Algorithms Through Structured State Space Duality",
//! arXiv:2405.21060; checkpoints such as mistralai/Mamba-Codestral-7B-v0.1.
//!
//! Every layer is `x + mixer(rmsnorm(x))` with no feed-forward (a
//! `layer_types` key may only say so; `n_layer`, mamba_ssm's spelling of
//! `num_hidden_layers`, must agree with it when both are given). The mixer's
//! gated RMSNorm normalises each of the `n_groups` groups of `d_inner /
//! n_groups` channels separately (transformers 5 `MambaRMSNormGated` with
//! `group_size = intermediate_size // n_groups`; checked against the golden
//! fixture, which has `n_groups = 2`), with `layer_norm_epsilon`, the same
//! epsilon as the layer and final norms.

use super::{Common, check_mamba, mamba_names, require_act, time_step_limit};
use crate::config::json::Obj;
use crate::config::limits;
use crate::config::{
    FfnKind, FfnNames, LayerNames, LayerPlan, MambaConfig, MixerKind, MixerNames, ModelConfig,
    ModelNames, ModelType,
};
use crate::error::Result;

/// Pure Mamba-2 has no position limit; this bounds what the engine assumes.
pub const MAX_POSITIONS: usize = 1 << 20;

/// config.json of `mamba2`, as read.
struct RawMamba2 {
    common: Common,
    num_layers: usize,
    num_heads: usize,
    head_dim: usize,
    state_size: usize,
    expand: usize,
    n_groups: usize,
    conv_kernel: usize,
    chunk_size: usize,
    use_bias: bool,
    use_conv_bias: bool,
    layer_norm_epsilon: f32,
    time_step_limit: (f32, f32),
}

impl RawMamba2 {
    fn read(o: &Obj<'_>) -> Result<Self> {
        require_act(o, &["hidden_act"], &["silu"], "silu")?;
        // transformers reads only `num_hidden_layers`; metrale also takes
        // mamba_ssm's `n_layer` (the two must agree, as any two spellings).
        let num_layers = super::num_layers(o, &["num_hidden_layers", "n_layer"])?;
        check_layer_types(o, num_layers)?;
        Ok(Self {
            common: Common::read(o)?,
            num_layers,
            num_heads: o.count(&["num_heads"], limits::HEADS)?,
            head_dim: o.count(&["head_dim"], limits::HEAD_DIM)?,
            state_size: o.count(&["state_size", "d_state"], limits::HEAD_DIM)?,
            expand: o.size_or(&["expand"], 2)?,
            n_groups: o.count_or(&["n_groups", "ngroups"], 8, limits::HEADS)?,
            conv_kernel: o.count_or(&["conv_kernel", "d_conv"], 4, limits::CONV_KERNEL)?,
            chunk_size: o.size_or(&["chunk_size"], 256)?,
            use_bias: o.bool_or(&["use_bias"], false)?,
            use_conv_bias: o.bool_or(&["use_conv_bias"], true)?,
            layer_norm_epsilon: o.pos_f32_or(&["layer_norm_epsilon"], 1e-5)?,
            time_step_limit: time_step_limit(o)?,
        })
    }
}

/// Every layer is Mamba-2, so a `layer_types` list (which transformers
/// refuses: it is a read-only property there) may only say so, once per layer.
fn check_layer_types(o: &Obj<'_>, num_layers: usize) -> Result<()> {
    let Some((key, types)) = o.opt_str_list(&["layer_types"])? else {
        return Ok(());
    };
    let known = ["mamba", "linear_attention"];
    if let Some((i, bad)) = types.iter().enumerate().find(|(_, t)| !known.contains(t)) {
        return Err(super::unknown_layer_type(o, key, i, bad, &known));
    }
    if types.len() != num_layers {
        return Err(o.err(format!(
            "key `{key}` lists {} layers, but num_hidden_layers is {num_layers}",
            types.len()
        )));
    }
    Ok(())
}

pub(super) fn build(o: &Obj<'_>) -> Result<ModelConfig> {
    let raw = RawMamba2::read(o)?;
    let mamba = MambaConfig {
        n_heads: raw.num_heads,
        head_dim: raw.head_dim,
        d_state: raw.state_size,
        n_groups: raw.n_groups,
        conv_kernel: raw.conv_kernel,
        chunk_size: raw.chunk_size,
        time_step_limit: raw.time_step_limit,
        conv_bias: raw.use_conv_bias,
        proj_bias: raw.use_bias,
        norm_eps: raw.layer_norm_epsilon,
        norm_groups: raw.n_groups,
    };
    if mamba.d_inner() != raw.expand * raw.common.hidden_size {
        return Err(o.err(format!(
            "num_heads * head_dim ({}) must equal expand * hidden_size ({})",
            mamba.d_inner(),
            raw.expand * raw.common.hidden_size
        )));
    }
    check_mamba(o, &mamba)?;
    let mut config = raw.common.base(
        ModelType::Mamba2,
        raw.layer_norm_epsilon,
        MAX_POSITIONS,
        model_names(raw.common.tie_word_embeddings),
    );
    config.layers = (0..raw.num_layers)
        .map(|i| LayerPlan {
            mixer: MixerKind::Mamba2,
            ffn: FfnKind::None,
            names: layer_names(i, &mamba),
            sliding_window: None,
        })
        .collect();
    config.mamba = Some(mamba);
    Ok(config)
}

/// The family's tensor-name table: every layer is one Mamba-2 mixer.
fn layer_names(i: usize, m: &MambaConfig) -> LayerNames {
    let p = format!("backbone.layers.{i}");
    LayerNames {
        input_norm: format!("{p}.norm.weight"),
        ffn_norm: None,
        mixer: MixerNames::Mamba2(mamba_names(&format!("{p}.mixer"), m)),
        ffn: FfnNames::None,
    }
}

fn model_names(tied: bool) -> ModelNames {
    ModelNames {
        embed: "backbone.embeddings.weight".into(),
        final_norm: "backbone.norm_f.weight".into(),
        lm_head: (!tied).then(|| "lm_head.weight".into()),
    }
}

use crate::gguf::GgufName::*;
use crate::gguf::GgufTable;
/// llama.cpp's names for Mamba-2 (`convert_hf_to_gguf.py`'s
/// `Mamba2Model`): `A_log` is stored as `A = -exp(A_log)` with shape
/// `[n_heads, 1]`, `D` as `[n_heads, 1]`, the conv weight squeezed to
/// `[conv_dim, kernel]`, the gated norm's weight as `[n_groups, d_inner / n_groups]`.
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
    ],
};
