//! A GGUF file's metadata read back as the Hugging Face `config.json` the
//! converter was given: the `{arch}.*` keys llama.cpp's
//! `convert_hf_to_gguf.py` writes, per architecture, mapped onto the keys
//! each family's config parser reads.

use metrale_model_weights::gguf::{GgufArray, GgufFile, GgufValue};
use serde_json::{Map, Value, json};

use super::checks::{fits, layer_count, meta_err, opt_finite, sized};
use crate::error::{EngineError, Result};

/// The `general.architecture` values llama.cpp's converter writes for the
/// families metrale runs.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &[
    "llama",
    "qwen2",
    "qwen3",
    "qwen3next",
    "qwen35",
    "qwen35moe",
    "lfm2",
    "lfm2moe",
    "mamba2",
    "granitehybrid",
    "nemotron_h",
    "nemotron_h_moe",
];

/// A per-layer integer key: a single value for every layer, or an array
/// of `layers` values.
fn per_layer(file: &GgufFile, key: &str, layers: usize) -> Result<Vec<usize>> {
    match file.value(key)? {
        GgufValue::Array(a) => {
            let v: Vec<usize> = match a {
                GgufArray::U32(v) => v.iter().map(|&n| n as usize).collect(),
                GgufArray::I32(v) if v.iter().all(|&n| n >= 0) => {
                    v.iter().map(|&n| n as usize).collect()
                }
                GgufArray::U64(v) => v.iter().map(|&n| n as usize).collect(),
                GgufArray::I64(v) if v.iter().all(|&n| n >= 0) => {
                    v.iter().map(|&n| n as usize).collect()
                }
                _ => return Err(meta_err(file, key, "expected an array of integers")),
            };
            if v.len() != layers {
                return Err(meta_err(
                    file,
                    key,
                    format!("has {} entries for {layers} layers", v.len()),
                ));
            }
            Ok(v)
        }
        _ => Ok(vec![file.get_u32(key)? as usize; layers]),
    }
}

fn set(c: &mut Map<String, Value>, key: &str, v: Value) {
    c.insert(key.to_string(), v);
}

/// The fewest tensor bytes one expert of one MoE layer takes: at least two
/// matrices (up and down) of at least one row of at least two bytes (an
/// f16 element; a quantized row is a whole block, more).
const EXPERT_BYTES: u64 = 4;

/// Granite's scales: the GGUF key (under the architecture) and the
/// `config.json` key (the export writes them from the same table).
pub(crate) const GRANITE_SCALES: [(&str, &str); 4] = [
    ("attention.scale", "attention_multiplier"),
    ("embedding_scale", "embedding_multiplier"),
    ("residual_scale", "residual_multiplier"),
    ("logit_scale", "logits_scaling"),
];

/// The Hugging Face `config.json` the metadata of `file` describes.
pub fn config_json(file: &GgufFile) -> Result<Value> {
    let arch = file.architecture()?.to_string();
    if !SUPPORTED_ARCHITECTURES.contains(&arch.as_str()) {
        return Err(EngineError::Config {
            path: file.path().to_path_buf(),
            detail: format!(
                "GGUF architecture {arch:?} is not supported (metrale loads GGUF files of \
                 architecture {})",
                SUPPORTED_ARCHITECTURES.join(", ")
            ),
        });
    }
    let k = |s: &str| format!("{arch}.{s}");
    let u = |s: &str| -> Result<usize> { Ok(file.get_u32(&k(s))? as usize) };
    let opt_u = |s: &str| -> Result<Option<usize>> { Ok(file.opt_u32(&k(s))?.map(|n| n as usize)) };
    let opt_f = |s: &str| opt_finite(file, &k(s));
    let has = |t: &str| file.get_tensor(t).is_some();
    // `[vocab, hidden]` row-major.
    let vocab = sized(file.tensor("token_embd.weight")?, file, 2)?[0];
    let mut c = Map::new();
    set(&mut c, "vocab_size", json!(vocab));
    set(&mut c, "hidden_size", json!(u("embedding_length")?));
    set(&mut c, "tie_word_embeddings", json!(!has("output.weight")));
    // Bounded before anything is built per layer.
    let layers = layer_count(file, &k("block_count"))?;
    set(&mut c, "num_hidden_layers", json!(layers));
    if let Some(n) = opt_u("context_length")? {
        set(&mut c, "max_position_embeddings", json!(n));
    }
    for (key, name) in [
        ("eos_token_id", "eos"),
        ("bos_token_id", "bos"),
        ("pad_token_id", "padding"),
    ] {
        if let Some(id) = file.opt_u32(&format!("tokenizer.ggml.{name}_token_id"))? {
            set(&mut c, key, json!(id));
        }
    }
    let rms = opt_f("attention.layer_norm_rms_epsilon")?.or(opt_f("attention.layer_norm_epsilon")?);
    // Attention hyper-parameters, shared by the families that have it.
    let attention = |c: &mut Map<String, Value>, kv: usize| -> Result<()> {
        let heads = u("attention.head_count")?;
        c.insert("num_attention_heads".into(), json!(heads));
        c.insert("num_key_value_heads".into(), json!(kv));
        let hidden = u("embedding_length")?;
        let head_dim = opt_u("attention.key_length")?.unwrap_or(hidden / heads.max(1));
        c.insert("head_dim".into(), json!(head_dim));
        let mut rope = Map::new();
        rope.insert("rope_type".into(), json!("default"));
        rope.insert(
            "rope_theta".into(),
            json!(opt_f("rope.freq_base")?.unwrap_or(10000.0)),
        );
        if let Some(dims) = opt_u("rope.dimension_count")?
            && dims != head_dim
            && head_dim > 0
        {
            rope.insert(
                "partial_rotary_factor".into(),
                json!(dims as f64 / head_dim as f64),
            );
        }
        if let Some(kind) = file.opt_str(&k("rope.scaling.type"))?
            && kind != "none"
        {
            let factor = opt_f("rope.scaling.factor")?.unwrap_or(1.0);
            rope.insert("rope_type".into(), json!(kind));
            rope.insert("factor".into(), json!(factor));
            if let Some(n) = opt_u("rope.scaling.original_context_length")? {
                rope.insert("original_max_position_embeddings".into(), json!(n));
            }
        }
        c.insert("rope_parameters".into(), Value::Object(rope));
        // `attention_bias` is o_proj's bias too (Llama's, Qwen 3's): Qwen 2
        // has q/k/v biases without it, and they come with its model type.
        c.insert(
            "attention_bias".into(),
            json!(
                file.tensor_infos()
                    .iter()
                    .any(|t| t.name.ends_with("attn_output.bias"))
            ),
        );
        Ok(())
    };
    // Mamba-2 hyper-parameters under the keys of `prefix` (`""` for
    // mamba2/nemotron_h spellings, `"mamba_"` for Bamba/Granite).
    let mamba = |c: &mut Map<String, Value>, granite: bool| -> Result<()> {
        let inner = u("ssm.inner_size")?;
        let heads = u("ssm.time_step_rank")?;
        let hidden = u("embedding_length")?;
        if heads == 0
            || !inner.is_multiple_of(heads)
            || hidden == 0
            || !inner.is_multiple_of(hidden)
        {
            return Err(meta_err(
                file,
                &k("ssm.inner_size"),
                format!(
                    "{inner} is not a multiple of the head count {heads} and of the width {hidden}"
                ),
            ));
        }
        let conv_bias = file
            .tensor_infos()
            .iter()
            .any(|t| t.name.ends_with("ssm_conv1d.bias"));
        let proj_bias = file
            .tensor_infos()
            .iter()
            .any(|t| t.name.ends_with("ssm_in.bias"));
        let entries = [
            ("n_heads", "num_heads", "mamba_num_heads", json!(heads)),
            ("d_head", "head_dim", "mamba_head_dim", json!(inner / heads)),
            (
                "d_state",
                "state_size",
                "ssm_state_size",
                json!(u("ssm.state_size")?),
            ),
            (
                "n_groups",
                "n_groups",
                "n_groups",
                json!(u("ssm.group_count")?),
            ),
            (
                "d_conv",
                "conv_kernel",
                "conv_kernel",
                json!(u("ssm.conv_kernel")?),
            ),
            ("expand", "expand", "expand", json!(inner / hidden)),
            (
                "conv_bias",
                "use_conv_bias",
                "use_conv_bias",
                json!(conv_bias),
            ),
            ("proj_bias", "use_bias", "use_bias", json!(proj_bias)),
        ];
        for (g, m, n, v) in entries {
            let key = match (granite, arch.as_str()) {
                (true, _) => format!("mamba_{g}"),
                (false, "nemotron_h" | "nemotron_h_moe") => n.to_string(),
                _ => m.to_string(),
            };
            c.insert(key, v);
        }
        Ok(())
    };
    let model_type = match arch.as_str() {
        "llama" | "qwen2" | "qwen3" => {
            if has("rope_freqs.weight") {
                return Err(meta_err(
                    file,
                    "rope_freqs.weight",
                    "the file carries per-dimension rope factors (Llama 3.1-style rope scaling), \
                     which metrale does not read from GGUF yet",
                ));
            }
            set(
                &mut c,
                "intermediate_size",
                json!(u("feed_forward_length")?),
            );
            let heads = u("attention.head_count")?;
            let kv = opt_u("attention.head_count_kv")?.unwrap_or(heads);
            attention(&mut c, kv)?;
            if let Some(eps) = rms {
                set(&mut c, "rms_norm_eps", json!(eps));
            }
            arch.clone()
        }
        "qwen3next" => {
            qwen3next(file, &arch, &mut c, layers)?;
            attention(&mut c, opt_u("attention.head_count_kv")?.unwrap_or(0))?;
            if let Some(eps) = rms {
                set(&mut c, "rms_norm_eps", json!(eps));
            }
            "qwen3_next".into()
        }
        "qwen35" | "qwen35moe" => {
            // The multi-token prediction blocks follow the text layers.
            let layers = super::hybrids::text_layers(file, &arch, layers)?;
            set(&mut c, "num_hidden_layers", json!(layers));
            qwen3next(file, &arch, &mut c, layers)?;
            attention(&mut c, opt_u("attention.head_count_kv")?.unwrap_or(0))?;
            super::hybrids::mrope(file, &arch, &mut c)?;
            if let Some(eps) = rms {
                set(&mut c, "rms_norm_eps", json!(eps));
            }
            match arch.as_str() {
                "qwen35" => "qwen3_5_text".into(),
                _ => "qwen3_5_moe_text".into(),
            }
        }
        "lfm2" | "lfm2moe" => {
            let kv = per_layer(file, &k("attention.head_count_kv"), layers)?;
            attention(&mut c, kv.iter().copied().max().unwrap_or(0))?;
            super::hybrids::lfm2(file, &arch, &mut c, &kv)?;
            if let Some(eps) = rms {
                set(&mut c, "norm_eps", json!(eps));
            }
            match arch.as_str() {
                "lfm2" => "lfm2".into(),
                _ => "lfm2_moe".into(),
            }
        }
        "mamba2" => {
            mamba(&mut c, false)?;
            if let Some(eps) = rms {
                set(&mut c, "layer_norm_epsilon", json!(eps));
            }
            "mamba2".into()
        }
        "nemotron_h" | "nemotron_h_moe" => {
            let kv = per_layer(file, &k("attention.head_count_kv"), layers)?;
            let ff = per_layer(file, &k("feed_forward_length"), layers)?;
            // In a MoE file every feed-forward layer is a MoE layer (the
            // converter writes no dense ones there).
            let moe = arch == "nemotron_h_moe";
            let pattern: String = (0..layers)
                .map(|i| match (kv[i] > 0, ff[i] > 0) {
                    (true, _) => '*',
                    (false, true) if moe => 'E',
                    (false, true) => '-',
                    _ => 'M',
                })
                .collect();
            if moe {
                let moe_layers = pattern.chars().filter(|&b| b == 'E').count();
                nemotron_moe(file, &mut c, moe_layers)?;
            }
            set(&mut c, "hybrid_override_pattern", json!(pattern));
            set(
                &mut c,
                "intermediate_size",
                json!(ff.iter().copied().max().unwrap_or(0)),
            );
            set(&mut c, "mlp_hidden_act", json!("relu2"));
            attention(&mut c, kv.iter().copied().max().unwrap_or(0))?;
            mamba(&mut c, false)?;
            if let Some(eps) = rms {
                set(&mut c, "layer_norm_epsilon", json!(eps));
            }
            "nemotron_h".into()
        }
        "granitehybrid" => {
            let kv = per_layer(file, &k("attention.head_count_kv"), layers)?;
            attention(&mut c, kv.iter().copied().max().unwrap_or(0))?;
            mamba(&mut c, true)?;
            // head_dim is not a Granite/Bamba key: the attention's width is
            // the model's.
            c.remove("head_dim");
            if let Some(eps) = rms {
                set(&mut c, "rms_norm_eps", json!(eps));
            }
            let ffn = u("feed_forward_length")?;
            set(&mut c, "intermediate_size", json!(ffn));
            // llama.cpp's granitehybrid graph applies rope when
            // `rope.scaling.finetuned` is true or absent. Bamba's converter
            // writes it true and none of Granite's scales; a Granite file
            // (4.0-H: finetuned false, no rope) has them.
            let rope = file.opt_bool(&k("rope.scaling.finetuned"))?.unwrap_or(true);
            let granite = (GRANITE_SCALES.iter())
                .map(|(key, _)| *key)
                .chain(["expert_count", "expert_shared_feed_forward_length"])
                .any(|key| file.get(&k(key)).is_some());
            if rope && !granite {
                let indices: Vec<usize> = (0..layers).filter(|&i| kv[i] > 0).collect();
                set(&mut c, "attn_layer_indices", json!(indices));
                "bamba".into()
            } else {
                let types: Vec<&str> = kv
                    .iter()
                    .map(|&n| if n > 0 { "attention" } else { "mamba" })
                    .collect();
                set(&mut c, "layer_types", json!(types));
                let positions = if rope { "rope" } else { "nope" };
                set(&mut c, "position_embedding_type", json!(positions));
                let experts = opt_u("expert_count")?.unwrap_or(0);
                fits(file, &k("expert_count"), experts, layers, EXPERT_BYTES)?;
                set(&mut c, "num_local_experts", json!(experts));
                if let Some(n) = opt_u("expert_used_count")? {
                    set(&mut c, "num_experts_per_tok", json!(n));
                }
                let shared = match opt_u("expert_shared_feed_forward_length")? {
                    Some(n) => n,
                    // `[intermediate, hidden]` row-major.
                    None => match (file.get_tensor("blk.0.ffn_gate.weight"))
                        .or(file.get_tensor("blk.0.ffn_gate_shexp.weight"))
                    {
                        Some(t) => sized(t, file, 2)?[0],
                        None => ffn,
                    },
                };
                set(&mut c, "shared_intermediate_size", json!(shared));
                for (key, hf) in GRANITE_SCALES {
                    if let Some(v) = opt_f(key)? {
                        set(&mut c, hf, json!(v));
                    }
                }
                // Without the key llama.cpp scales q·k by head_dim^-0.5,
                // where transformers' Granite default is 1.
                if opt_f("attention.scale")?.is_none_or(|v| v == 0.0) {
                    let heads = u("attention.head_count")?.max(1);
                    let head_dim = (u("embedding_length")? / heads).max(1);
                    set(
                        &mut c,
                        "attention_multiplier",
                        json!(1.0 / (head_dim as f64).sqrt()),
                    );
                }
                "granitemoehybrid".into()
            }
        }
        other => {
            return Err(EngineError::Config {
                path: file.path().to_path_buf(),
                detail: format!(
                    "GGUF architecture {other:?} is not supported (metrale loads GGUF files of \
                     architecture {})",
                    SUPPORTED_ARCHITECTURES.join(", ")
                ),
            });
        }
    };
    c.insert("model_type".into(), json!(model_type));
    Ok(Value::Object(c))
}

/// Qwen3-Next's keys beyond attention's (and Qwen3.5's, under `arch`):
/// Gated DeltaNet sizes from the `ssm.*` keys, the layer kinds from
/// `attention.recurrent_layers` (else every `full_attention_interval`-th
/// layer attends), the experts, and the dense layers (`mlp_only_layers`)
/// found by their `ffn_gate` tensor.
fn qwen3next(file: &GgufFile, arch: &str, c: &mut Map<String, Value>, layers: usize) -> Result<()> {
    let k = |s: &str| format!("{arch}.{s}");
    let u = |s: &str| -> Result<usize> { Ok(file.get_u32(&k(s))? as usize) };
    let v_heads = u("ssm.time_step_rank")?;
    let inner = u("ssm.inner_size")?;
    if v_heads == 0 || !inner.is_multiple_of(v_heads) {
        return Err(meta_err(
            file,
            &k("ssm.inner_size"),
            format!("{inner} is not a multiple of the value head count {v_heads}"),
        ));
    }
    set(c, "linear_conv_kernel_dim", json!(u("ssm.conv_kernel")?));
    set(c, "linear_key_head_dim", json!(u("ssm.state_size")?));
    let groups = u("ssm.group_count")?;
    set(c, "linear_num_key_heads", json!(groups));
    set(c, "linear_num_value_heads", json!(v_heads));
    set(c, "linear_value_head_dim", json!(inner / v_heads));
    // Qwen3.5-MoE has no dense MLP, and no width for one.
    if let Some(n) = file.opt_u32(&k("feed_forward_length"))? {
        set(c, "intermediate_size", json!(n));
    }
    let key = k("attention.recurrent_layers");
    let recurrent = match file.get(&key) {
        Some(GgufValue::Array(GgufArray::Bool(recurrent))) => {
            if recurrent.len() < layers {
                return Err(meta_err(
                    file,
                    &key,
                    format!("has {} entries for {layers} layers", recurrent.len()),
                ));
            }
            let types: Vec<&str> = recurrent[..layers]
                .iter()
                .map(|&r| {
                    if r {
                        "linear_attention"
                    } else {
                        "full_attention"
                    }
                })
                .collect();
            set(c, "layer_types", json!(types));
            recurrent[..layers].iter().filter(|&&r| r).count()
        }
        Some(_) => return Err(meta_err(file, &key, "expected an array of booleans")),
        None => {
            let interval = file.opt_u32(&k("full_attention_interval"))?.unwrap_or(4);
            set(c, "full_attention_interval", json!(interval));
            // Every `interval`-th layer attends (none when 0, which the
            // config's parser refuses).
            layers - layers.checked_div(interval as usize).unwrap_or(0)
        }
    };
    // Each key group of a DeltaNet layer is at least a q and a k row of
    // `attn_qkv` (two rows of at least two bytes).
    fits(file, &k("ssm.group_count"), groups, recurrent, 4)?;
    let dense: Vec<usize> = (0..layers)
        .filter(|i| {
            file.get_tensor(&format!("blk.{i}.ffn_gate.weight"))
                .is_some()
        })
        .collect();
    let experts = file.opt_u32(&k("expert_count"))?.unwrap_or(0) as usize;
    fits(
        file,
        &k("expert_count"),
        experts,
        layers - dense.len(),
        EXPERT_BYTES,
    )?;
    set(c, "num_experts", json!(experts));
    if let Some(n) = file.opt_u32(&k("expert_used_count"))? {
        set(c, "num_experts_per_tok", json!(n));
    }
    if let Some(n) = file.opt_u32(&k("expert_feed_forward_length"))? {
        set(c, "moe_intermediate_size", json!(n));
    }
    let shared = file.opt_u32(&k("expert_shared_feed_forward_length"))?;
    set(
        c,
        "shared_expert_intermediate_size",
        json!(shared.unwrap_or(0)),
    );
    // llama.cpp renormalises the top-k weights of every qwen3next file.
    set(c, "norm_topk_prob", json!(true));
    set(c, "mlp_only_layers", json!(dense));
    Ok(())
}

/// Nemotron 3's MoE keys: routed and shared experts, the sigmoid routing's
/// groups and scale. A latent MoE (`moe_latent_size`) is refused, as for a
/// checkpoint.
fn nemotron_moe(file: &GgufFile, c: &mut Map<String, Value>, moe_layers: usize) -> Result<()> {
    let k = |s: &str| format!("nemotron_h_moe.{s}");
    if file.get(&k("moe_latent_size")).is_some() {
        return Err(meta_err(
            file,
            &k("moe_latent_size"),
            "latent MoE projections are not supported",
        ));
    }
    let u = |s: &str| -> Result<usize> { Ok(file.get_u32(&k(s))? as usize) };
    let opt_u = |s: &str| -> Result<Option<u32>> { Ok(file.opt_u32(&k(s))?) };
    let experts = u("expert_count")?;
    fits(file, &k("expert_count"), experts, moe_layers, EXPERT_BYTES)?;
    set(c, "n_routed_experts", json!(experts));
    set(c, "num_experts_per_tok", json!(u("expert_used_count")?));
    set(
        c,
        "moe_intermediate_size",
        json!(u("expert_feed_forward_length")?),
    );
    set(
        c,
        "moe_shared_expert_intermediate_size",
        json!(u("expert_shared_feed_forward_length")?),
    );
    set(
        c,
        "n_group",
        json!(opt_u("expert_group_count")?.unwrap_or(1)),
    );
    set(
        c,
        "topk_group",
        json!(opt_u("expert_group_used_count")?.unwrap_or(1)),
    );
    if let Some(scale) = opt_finite(file, &k("expert_weights_scale"))? {
        set(c, "routed_scaling_factor", json!(scale));
    }
    if let Some(norm) = file.opt_bool(&k("expert_weights_norm"))? {
        set(c, "norm_topk_prob", json!(norm));
    }
    Ok(())
}
