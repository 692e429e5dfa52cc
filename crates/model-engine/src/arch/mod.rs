//! The architecture families: config.json to a validated [`ModelConfig`]
//! with its layer plan and tensor names, one file per family.
//!
//! | file | model_type |
//! |---|---|
//! | `llama.rs` | `llama`, `qwen2`, `qwen3`, `mistral` |
//! | `mamba2.rs` | `mamba2` |
//! | `bamba.rs` | `bamba` |
//! | `nemotron_h.rs` | `nemotron_h` |
//! | `granite_hybrid.rs` | `granitemoehybrid` |
//! | `qwen3_next.rs` | `qwen3_next` |
//! | `lfm2.rs` | `lfm2`, `lfm2_moe` |
//! | `qwen3_5.rs` | `qwen3_5`, `qwen3_5_moe` (and their `_text` language models) |
//!
//! Each file holds the family's raw config (both spellings accepted), its
//! validation into a [`ModelConfig`] with derived sizes, and one table (a
//! function) from plan entries to Hugging Face tensor names. The helpers
//! here are the pieces the tables share.
//!
//! The same rules hold in every family: two keys that describe the layers
//! twice (a pattern string and a list, a list and its alias, a list and the
//! interval or index list it could be derived from) must agree
//! ([`check_same_layers`]), a list's length must match `num_hidden_layers`
//! ([`check_layer_count`]), and layer indices must name layers that exist
//! ([`layer_indices`]); otherwise the config is refused with an error naming
//! the file and both keys. transformers often keeps one of two
//! contradicting keys without a word, so which model it builds depends on
//! details of its attribute handling; metrale does not guess. Where
//! transformers accepts a config and only warns (or should), metrale keeps
//! its reading and adds a warning to [`ModelConfig::warnings`].

pub(crate) mod bamba;
pub(crate) mod granite_hybrid;
pub(crate) mod lfm2;
pub(crate) mod llama;
pub(crate) mod mamba2;
pub(crate) mod nemotron_h;
pub(crate) mod qwen3_5;
pub(crate) mod qwen3_next;

use metrale_core::DType;

use crate::config::json::Obj;
use crate::config::limits;
use crate::config::{
    AttentionConfig, AttentionNames, MambaConfig, MambaNames, MixerKind, MlpNames, ModelConfig,
    ModelNames, ModelType,
};
use crate::error::Result;

/// Builds the config of `model_type` from the parsed config.json.
pub(crate) fn build(model_type: ModelType, o: &Obj<'_>) -> Result<ModelConfig> {
    let config = match model_type {
        ModelType::Llama | ModelType::Qwen2 | ModelType::Qwen3 | ModelType::Mistral => {
            llama::build(model_type, o)?
        }
        ModelType::Mamba2 => mamba2::build(o)?,
        ModelType::Bamba => bamba::build(o)?,
        ModelType::NemotronH => nemotron_h::build(o)?,
        ModelType::GraniteMoeHybrid => granite_hybrid::build(o)?,
        ModelType::Qwen3Next => qwen3_next::build(o)?,
        ModelType::Qwen35 | ModelType::Qwen35Moe => qwen3_5::build(model_type, o)?,
        ModelType::Lfm2 | ModelType::Lfm2Moe => lfm2::build(model_type, o)?,
    };
    if config.layers.is_empty() {
        return Err(o.err("the model has no layers"));
    }
    check_totals(o, &config)?;
    Ok(config)
}

/// Refuses configs whose totals are implausible (beyond 2^48 parameters,
/// state elements or cache elements per token), so that no size derived
/// from the config can overflow.
fn check_totals(o: &Obj<'_>, c: &ModelConfig) -> Result<()> {
    const LIMIT: u128 = 1 << 48;
    let params: u128 = c
        .expected_tensors()
        .iter()
        .map(|t| {
            t.shape
                .iter()
                .fold(1u128, |acc, &d| acc.saturating_mul(d as u128))
        })
        .fold(0u128, u128::saturating_add);
    let layers = c.layers.len() as u128;
    let mamba = c.mamba.as_ref().map_or(0u128, |m| {
        let (h, p, n, k) = (
            m.n_heads as u128,
            m.head_dim as u128,
            m.d_state as u128,
            m.conv_kernel as u128,
        );
        (h * p + 2 * m.n_groups as u128 * n) * k + h * p * n
    });
    let delta = c.deltanet.as_ref().map_or(0u128, |d| {
        let (kh, vh, dk, dv, k) = (
            d.n_k_heads as u128,
            d.n_v_heads as u128,
            d.k_head_dim as u128,
            d.v_head_dim as u128,
            d.conv_kernel as u128,
        );
        (2 * kh * dk + vh * dv) * k + vh * dk * dv
    });
    let kv = c.attention.as_ref().map_or(0u128, |a| {
        2 * (a.n_heads.max(a.n_kv_heads) as u128) * a.head_dim as u128
    });
    for (what, n) in [
        ("parameters", params),
        ("recurrent state elements", (mamba + delta) * layers),
        ("KV elements per token", kv * layers),
    ] {
        if n > LIMIT {
            return Err(o.err(format!("the config describes {n} {what}, more than any real model (the sizes are implausible)")));
        }
    }
    Ok(())
}

/// What every family reads the same way.
pub(crate) struct Common {
    pub hidden_size: usize,
    pub vocab_size: usize,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub declared_dtype: Option<DType>,
    /// Warnings found while reading these keys (for [`ModelConfig::warnings`]).
    pub warnings: Vec<String>,
}

impl Common {
    pub fn read(o: &Obj<'_>) -> Result<Self> {
        let mut warnings = Vec::new();
        Ok(Self {
            hidden_size: o.count(&["hidden_size", "d_model"], limits::WIDTH)?,
            vocab_size: o.count(&["vocab_size"], limits::VOCAB)?,
            tie_word_embeddings: o.bool_or(&["tie_word_embeddings"], false)?,
            bos_token_id: o.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids: o.token_ids("eos_token_id")?,
            declared_dtype: o.declared_dtype(&mut warnings)?,
            warnings,
        })
    }

    /// A config with this family-independent part filled in and neutral
    /// defaults elsewhere; the family sets the rest.
    pub fn base(
        &self,
        model_type: ModelType,
        norm_eps: f32,
        max_position_embeddings: usize,
        names: ModelNames,
    ) -> ModelConfig {
        ModelConfig {
            model_type,
            hidden_size: self.hidden_size,
            vocab_size: self.vocab_size,
            norm_eps,
            norm_weight_offset: 0.0,
            tie_word_embeddings: self.tie_word_embeddings,
            embedding_multiplier: 1.0,
            residual_multiplier: 1.0,
            logits_divisor: 1.0,
            max_position_embeddings,
            declared_dtype: self.declared_dtype,
            bos_token_id: self.bos_token_id,
            eos_token_ids: self.eos_token_ids.clone(),
            attention: None,
            mamba: None,
            deltanet: None,
            short_conv: None,
            mlp: None,
            moe: None,
            names,
            layers: Vec::new(),
            aside: Vec::new(),
            warnings: self.warnings.clone(),
        }
    }
}

/// A vision-language wrapper's `tie_word_embeddings` (`default` when
/// absent). transformers ties the head by the top-level key and ignores
/// `text_config`'s, and itself saves the two differing whenever only the
/// top level was set (its LFM2-VL and Qwen3.5 configs do): the inner key
/// says nothing, so a difference is neither an error nor a warning. Read
/// here so that a mistyped inner value is still refused by name.
pub(crate) fn wrapper_tie(o: &Obj<'_>, text: &Obj<'_>, default: bool) -> Result<bool> {
    text.bool_or(&["tie_word_embeddings"], default)?;
    o.bool_or(&["tie_word_embeddings"], default)
}

/// A multimodal wrapper's (`wrapper`) language-model settings: its
/// `text_config`, required, whose `model_type` (when given) must be
/// `text_type`.
pub(crate) fn text_config<'a>(o: &Obj<'a>, wrapper: &str, text_type: &str) -> Result<Obj<'a>> {
    let Some(text) = o.opt_obj("text_config")? else {
        return Err(o.err(format!(
            "model_type {wrapper:?} keeps the language model's settings under `text_config`, \
             which is missing (a language model alone is model_type {text_type:?})"
        )));
    };
    if let Some(inner) = text.opt_str(&["model_type"])?
        && inner != text_type
    {
        return Err(o.err(format!(
            "keys `model_type` and `text_config.model_type` disagree: {wrapper:?} holds a \
             {text_type:?} language model, not {inner:?}"
        )));
    }
    Ok(text)
}

/// Head counts and size: `(n_heads, n_kv_heads, head_dim)`. `head_dim`
/// comes from the config, else `default_head_dim`, else `hidden / n_heads`.
pub(crate) fn attention_heads(
    o: &Obj<'_>,
    hidden: usize,
    default_head_dim: Option<usize>,
) -> Result<(usize, usize, usize)> {
    let n_heads = o.count(&["num_attention_heads"], limits::HEADS)?;
    let n_kv = o.count_or(&["num_key_value_heads"], n_heads, limits::HEADS)?;
    if n_heads % n_kv != 0 {
        return Err(o.err(format!(
            "num_attention_heads ({n_heads}) is not a multiple of num_key_value_heads ({n_kv})"
        )));
    }
    let head_dim_keys = ["head_dim", "attention_head_dim"];
    let head_dim = match o.opt_usize(&head_dim_keys)? {
        Some(0) => return Err(o.err("key `head_dim` must be positive")),
        Some(d) => o.within(&head_dim_keys, d, limits::HEAD_DIM)?,
        None => match default_head_dim {
            Some(d) => d,
            None if hidden.is_multiple_of(n_heads) => hidden / n_heads,
            None => return Err(o.err(format!("hidden_size ({hidden}) is not a multiple of num_attention_heads ({n_heads}) and head_dim is not given"))),
        },
    };
    Ok((n_heads, n_kv, head_dim))
}

/// Refuses a `hidden_act` other than the one the family's layers implement.
pub(crate) fn require_act(
    o: &Obj<'_>,
    keys: &[&str],
    expected: &[&str],
    default: &str,
) -> Result<()> {
    let act = o.opt_str(keys)?.unwrap_or(default);
    if expected.contains(&act) {
        Ok(())
    } else {
        Err(o.err(format!(
            "key `{}` = {act:?} is not supported here (supported: {})",
            keys[0],
            expected.join(", ")
        )))
    }
}

/// `mlp_bias`: biases on every MLP projection (default false).
pub(crate) fn mlp_bias(o: &Obj<'_>) -> Result<bool> {
    o.bool_or(&["mlp_bias"], false)
}

/// `time_step_limit` (alias `mamba_dt_limit`): two numbers, the upper may be infinite.
pub(crate) fn time_step_limit(o: &Obj<'_>) -> Result<(f32, f32)> {
    let Some((k, list)) = o.opt_list(&["time_step_limit", "mamba_dt_limit"])? else {
        return Ok((0.0, f32::INFINITY));
    };
    let values: Vec<f64> = list
        .iter()
        .filter_map(crate::config::json::as_f64)
        .collect();
    match values.as_slice() {
        [lo, hi]
            if values.len() == list.len()
                && !lo.is_nan()
                && !hi.is_nan()
                && lo <= hi
                && *lo >= 0.0 =>
        {
            Ok((*lo as f32, *hi as f32))
        }
        _ => Err(o.err(format!(
            "key `{k}`: expected two numbers [min, max] with 0 <= min <= max"
        ))),
    }
}

/// `{prefix}.{q,k,v,o}_proj.weight` with the biases and q/k norms `a` asks for.
pub(crate) fn attention_names(prefix: &str, a: &AttentionConfig) -> AttentionNames {
    let w = |n: &str| format!("{prefix}.{n}.weight");
    let b = |n: &str, on: bool| on.then(|| format!("{prefix}.{n}.bias"));
    AttentionNames {
        q: w("q_proj"),
        k: w("k_proj"),
        v: w("v_proj"),
        o: w("o_proj"),
        q_bias: b("q_proj", a.qkv_bias),
        k_bias: b("k_proj", a.qkv_bias),
        v_bias: b("v_proj", a.qkv_bias),
        o_bias: b("o_proj", a.o_bias),
        q_norm: a.qk_norm.then(|| w("q_norm")),
        k_norm: a.qk_norm.then(|| w("k_norm")),
    }
}

/// `{prefix}.{gate,up,down}_proj.weight`, and their `.bias` when `bias`.
pub(crate) fn split_mlp(prefix: &str, bias: bool) -> MlpNames {
    MlpNames::Split {
        gate: format!("{prefix}.gate_proj.weight"),
        up: format!("{prefix}.up_proj.weight"),
        down: format!("{prefix}.down_proj.weight"),
        bias,
    }
}

/// The Mamba-2 mixer under `prefix`, as every family stores it.
pub(crate) fn mamba_names(prefix: &str, m: &MambaConfig) -> MambaNames {
    MambaNames {
        in_proj: format!("{prefix}.in_proj.weight"),
        in_proj_bias: m.proj_bias.then(|| format!("{prefix}.in_proj.bias")),
        conv_weight: format!("{prefix}.conv1d.weight"),
        conv_bias: m.conv_bias.then(|| format!("{prefix}.conv1d.bias")),
        dt_bias: format!("{prefix}.dt_bias"),
        a_log: format!("{prefix}.A_log"),
        d: format!("{prefix}.D"),
        norm: format!("{prefix}.norm.weight"),
        out_proj: format!("{prefix}.out_proj.weight"),
        out_proj_bias: m.proj_bias.then(|| format!("{prefix}.out_proj.bias")),
    }
}

/// Checks the Mamba-2 head layout against the groups.
pub(crate) fn check_mamba(o: &Obj<'_>, m: &MambaConfig) -> Result<()> {
    if !m.n_heads.is_multiple_of(m.n_groups) {
        return Err(o.err(format!(
            "the Mamba heads ({}) are not a multiple of the groups ({})",
            m.n_heads, m.n_groups
        )));
    }
    if !m.d_inner().is_multiple_of(m.norm_groups) {
        return Err(o.err(format!(
            "the Mamba inner size ({}) is not a multiple of the norm groups ({})",
            m.d_inner(),
            m.norm_groups
        )));
    }
    if m.conv_kernel < 2 {
        return Err(o.err(format!(
            "the Mamba conv kernel ({}) must be at least 2",
            m.conv_kernel
        )));
    }
    Ok(())
}

/// The index of a layer list entry that is not one of `known`, as an error.
pub(crate) fn unknown_layer_type(
    o: &Obj<'_>,
    key: &str,
    index: usize,
    found: &str,
    known: &[&str],
) -> crate::error::EngineError {
    o.err(format!(
        "key `{key}`[{index}] = {found:?} is not a known layer type (known: {})",
        known.join(", ")
    ))
}

/// The most layers a config may have ([`limits::LAYERS`]).
pub(crate) const MAX_LAYERS: usize = limits::LAYERS.max;

/// `num_hidden_layers`, bounded by [`MAX_LAYERS`].
pub(crate) fn num_layers<'a>(o: &Obj<'a>, keys: &[&'a str]) -> Result<usize> {
    o.count(keys, limits::LAYERS)
}

/// Refuses `experts` routed experts (the value of the first of `keys`
/// given) in each of `moe_layers` layers beyond
/// [`limits::EXPERTS_IN_ALL_LAYERS`]: each is its own names in the plan,
/// and the per-layer bound alone still allows 2^24 of them.
pub(crate) fn check_expert_total(
    o: &Obj<'_>,
    keys: &[&str],
    experts: usize,
    moe_layers: usize,
) -> Result<()> {
    let limit = limits::EXPERTS_IN_ALL_LAYERS;
    let key = keys
        .iter()
        .find(|k| o.raw(k).is_some_and(|v| !v.is_null()))
        .unwrap_or(&keys[0]);
    let total = experts.saturating_mul(moe_layers);
    if total > limit.max {
        return Err(o.err(format!(
            "key `{key}` = {experts} in each of {moe_layers} MoE layers: more than {} {} is \
             not supported",
            limit.max, limit.what
        )));
    }
    Ok(())
}

/// `layers.len()` must match `num_hidden_layers` when both are given.
pub(crate) fn check_layer_count(o: &Obj<'_>, key: &str, len: usize) -> Result<()> {
    if let Some(n) = o.opt_usize(&["num_hidden_layers"])?
        && n != len
    {
        return Err(o.err(format!(
            "key `{key}` lists {len} layers, but num_hidden_layers is {n}"
        )));
    }
    Ok(())
}

/// The name transformers 5 gives a layer whose mixer is `m`, for messages.
pub(crate) fn mixer_name(m: &MixerKind) -> &'static str {
    match m {
        MixerKind::Attention => "full_attention",
        MixerKind::Mamba2 | MixerKind::GatedDeltaNet => "linear_attention",
        MixerKind::ShortConv => "conv",
        MixerKind::None => "no mixer",
    }
}

/// Two keys that each describe every layer (`a` and `b`, with what each
/// says layer by layer, named by `name`) must describe the same layers.
/// transformers keeps one of them without a word; a config whose two
/// descriptions differ is refused, naming both keys and the first layer
/// where they part.
pub(crate) fn check_same_layers<T: PartialEq>(
    o: &Obj<'_>,
    (a, xs): (&str, &[T]),
    (b, ys): (&str, &[T]),
    name: impl Fn(&T) -> &'static str,
) -> Result<()> {
    if xs.len() != ys.len() {
        return Err(o.err(format!(
            "keys `{a}` and `{b}` disagree: `{a}` describes {} layers, `{b}` {}",
            xs.len(),
            ys.len()
        )));
    }
    match xs.iter().zip(ys).position(|(x, y)| x != y) {
        None => Ok(()),
        Some(i) => Err(o.err(format!(
            "keys `{a}` and `{b}` disagree at layer {i}: `{a}` makes it {}, `{b}` {}",
            name(&xs[i]),
            name(&ys[i])
        ))),
    }
}

/// A list of layer indices under `key` (`attn_layer_indices`,
/// `mlp_only_layers`), absent meaning none. Every index must name one of the
/// model's `layers` layers (transformers skips the others without a word);
/// an index listed twice counts once, with a warning on `warnings`.
pub(crate) fn layer_indices(
    o: &Obj<'_>,
    key: &str,
    layers: usize,
    warnings: &mut Vec<String>,
) -> Result<Vec<usize>> {
    let listed = o.opt_usize_list(&[key])?.unwrap_or_default();
    let mut times = vec![0usize; layers];
    let mut indices = Vec::new();
    for i in listed {
        let Some(n) = times.get_mut(i) else {
            return Err(o.err(format!(
                "key `{key}` names layer {i}, but the model has {layers} layers \
                 (num_hidden_layers, numbered from 0)"
            )));
        };
        *n += 1;
        if *n == 1 {
            indices.push(i);
        } else if *n == 2 {
            warnings.push(o.warning(format_args!("key `{key}` lists layer {i} more than once")));
        }
    }
    Ok(indices)
}
