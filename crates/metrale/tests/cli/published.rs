//! The config.json files of real published checkpoints
//! (`tests/fixtures/published`, sources in its SOURCES.md), as published:
//! each parses to the expected layer plan and sizes (`inspect --no-load`,
//! expected.json), or is refused with the expected reason; and a random-weight
//! model of each, reduced in depth and in widths that leave every layer's
//! semantics alone, runs a `generate` step through the CLI.
//!
//! The reduction, the same for every config (and printed per config; a
//! vision-language wrapper's `text_config`, where the language model's
//! settings are):
//! - depth: the shortest prefix of the layers holding every layer kind of
//!   the plan (at least two layers), every per-layer list cut to it;
//! - `hidden_size` to 256, with the head sizes it used to imply written out
//!   (`head_dim`, `mamba_d_head`, and `mamba_expand` / `expand` so that the
//!   Mamba heads stay as they are);
//! - `vocab_size` to 512 (the fixture tokenizer's), MLP / expert / shared
//!   expert intermediate sizes to at most 512, the routed experts to at most
//!   `top_k + 4`.
//!
//! The test checks that the reduced config has the same attention, Mamba-2,
//! DeltaNet and routing settings and the same layers (kinds, windows) as the
//! prefix of the full one, so the reduction cannot change what is computed
//! per layer.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use metrale::core::json::wrap_nonfinite;
use metrale::engine::config::{ModelConfig, parse_config};
use serde_json::{Map, Value, json};

const HIDDEN: u64 = 256;
const VOCAB: u64 = 512;
const INTERMEDIATE: u64 = 512;
/// Stands for a bare `Infinity` while the config is a serde value.
const BARE_INF: &str = "__metrale_bare_infinity__";

fn published() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/published"
    ))
}

fn metrale(args: &[&str]) -> Result<(bool, String, String)> {
    let out = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args(args)
        .env_remove("METRALE_MODEL")
        .env("RUST_LOG", "error")
        .env("RUST_BACKTRACE", "0")
        .output()
        .context("running metrale")?;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// The value of `inspect`'s line for `key`.
fn field<'a>(stdout: &'a str, key: &str) -> Option<&'a str> {
    stdout.lines().find_map(|l| {
        l.strip_prefix(key)
            .filter(|rest| rest.starts_with("  "))
            .map(str::trim)
    })
}

/// `inspect --no-load` against the expected entry (its cache sizes are
/// the exact f32 layouts: `--dtype f32`, where the default would halve the
/// KV cache and the SSM states of bf16 checkpoints).
fn check_inspect(dir: &Path, expected: &Map<String, Value>) -> Result<()> {
    let dir = dir.to_string_lossy();
    let (ok, stdout, stderr) = metrale(&["inspect", "--no-load", "--dtype", "f32", &dir])?;
    if let Some(reason) = expected.get("refused").and_then(Value::as_str) {
        ensure!(!ok, "expected a refusal ({reason}), got\n{stdout}");
        ensure!(
            stderr.contains(reason),
            "refused, but not for {reason:?}: {stderr}"
        );
        return Ok(());
    }
    ensure!(ok, "inspect failed: {stderr}");
    let number = |key: &str| -> Result<Value> {
        let text = field(&stdout, key).with_context(|| format!("no {key} line"))?;
        let n: u64 = text.split_whitespace().next().unwrap_or("").parse()?;
        Ok(json!(n))
    };
    let got: Vec<(&str, Value)> = vec![
        ("model_type", json!(field(&stdout, "model type"))),
        ("layers", number("layers")?),
        (
            "plan",
            json!(field(&stdout, "layer plan").map(|p| p.replace(' ', ""))),
        ),
        ("parameters", number("parameters")?),
        ("kv_bytes_per_token", number("kv cache")?),
        ("recurrent_bytes_per_sequence", number("recurrent state")?),
        ("attention", json!(field(&stdout, "attention"))),
        ("mamba-2", json!(field(&stdout, "mamba-2"))),
        ("gated deltanet", json!(field(&stdout, "gated deltanet"))),
        ("experts", json!(field(&stdout, "experts"))),
    ];
    for (key, value) in got {
        let want = expected.get(key).cloned().unwrap_or(Value::Null);
        ensure!(
            value == want,
            "{key}: inspect says {value}, expected {want}"
        );
    }
    Ok(())
}

/// The config as a JSON object, bare non-finite numbers kept recognisable.
fn read_config(path: &Path) -> Result<Map<String, Value>> {
    let text = std::fs::read_to_string(path)?;
    let value: Value = serde_json::from_str(&wrap_nonfinite(&text))?;
    let Value::Object(mut map) = value else {
        bail!("not an object")
    };
    for v in map.values_mut() {
        mark_bare(v);
    }
    Ok(map)
}

fn mark_bare(v: &mut Value) {
    match v {
        Value::Object(o) if o.len() == 1 && o.get("__float__") == Some(&json!("Infinity")) => {
            *v = json!(BARE_INF);
        }
        Value::Object(o) => o.values_mut().for_each(mark_bare),
        Value::Array(a) => a.iter_mut().for_each(mark_bare),
        _ => {}
    }
}

/// The config text with `BARE_INF` written back as bare `Infinity`.
fn config_text(map: &Map<String, Value>) -> Result<String> {
    let text = serde_json::to_string_pretty(&Value::Object(map.clone()))?;
    Ok(text.replace(&format!("\"{BARE_INF}\""), "Infinity"))
}

fn get_u64(map: &Map<String, Value>, key: &str) -> Option<u64> {
    map.get(key).and_then(Value::as_u64)
}

/// Applies the reduction (module doc) to `c`; returns what it changed.
fn reduce(c: &mut Map<String, Value>, keep: usize, has_mamba: bool) -> Result<Vec<String>> {
    let mut changed = Vec::new();
    let mut set = |c: &mut Map<String, Value>, key: &str, value: Value| {
        let old = c.get(key).cloned().unwrap_or(Value::Null);
        if old != value {
            changed.push(format!("{key} {} -> {}", short(&old), short(&value)));
            c.insert(key.to_owned(), value);
        }
    };
    // Depth.
    if get_u64(c, "num_hidden_layers").is_some() {
        set(c, "num_hidden_layers", json!(keep));
    }
    for key in ["layer_types", "layers_block_type"] {
        if let Some(Value::Array(list)) = c.get(key) {
            let cut: Vec<Value> = list.iter().take(keep).cloned().collect();
            set(c, key, json!(cut));
        }
    }
    for key in ["attn_layer_indices", "mlp_only_layers", "full_attn_idxs"] {
        if let Some(Value::Array(list)) = c.get(key) {
            let cut: Vec<Value> = list
                .iter()
                .filter(|i| i.as_u64().is_some_and(|i| (i as usize) < keep))
                .cloned()
                .collect();
            set(c, key, json!(cut));
        }
    }
    if let Some(Value::String(p)) = c.get("hybrid_override_pattern") {
        let cut: String = p.chars().take(keep).collect();
        set(c, "hybrid_override_pattern", json!(cut));
    }
    // Widths: hidden, with the head sizes it implied written out.
    if let Some(hidden) = get_u64(c, "hidden_size").filter(|&h| h > HIDDEN) {
        let heads = get_u64(c, "num_attention_heads");
        let has_head_dim = ["head_dim", "attention_head_dim"]
            .iter()
            .any(|k| c.get(*k).is_some_and(|v| !v.is_null()));
        if let (Some(heads), false) = (heads, has_head_dim) {
            set(c, "head_dim", json!(hidden / heads));
        }
        let mamba_heads = get_u64(c, "mamba_n_heads").or(get_u64(c, "num_heads"));
        let expand_key = if c.contains_key("mamba_expand") {
            "mamba_expand"
        } else {
            "expand"
        };
        let is_mamba2 = c.get("model_type") == Some(&json!("mamba2"));
        if let (Some(nh), Some(expand), true) = (
            mamba_heads,
            get_u64(c, expand_key),
            has_mamba && (c.contains_key("mamba_n_heads") || is_mamba2),
        ) {
            let inner = expand * hidden;
            let d_head_key = if is_mamba2 {
                "head_dim"
            } else {
                "mamba_d_head"
            };
            let d_head = get_u64(c, d_head_key).unwrap_or(inner / nh);
            set(c, d_head_key, json!(d_head));
            ensure!(
                inner % HIDDEN == 0,
                "Mamba width {inner} is not a multiple of {HIDDEN}"
            );
            set(c, expand_key, json!(inner / HIDDEN));
        }
        set(c, "hidden_size", json!(HIDDEN));
    }
    set(c, "vocab_size", json!(VOCAB));
    for key in [
        "intermediate_size",
        "shared_intermediate_size",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
    ] {
        if get_u64(c, key).is_some_and(|v| v > INTERMEDIATE) {
            set(c, key, json!(INTERMEDIATE));
        }
    }
    if let Some(top_k) = get_u64(c, "num_experts_per_tok") {
        for key in ["num_local_experts", "num_experts", "n_routed_experts"] {
            if get_u64(c, key).is_some_and(|n| n > top_k + 4) {
                set(c, key, json!(top_k + 4));
            }
        }
    }
    Ok(changed)
}

/// A value for the log: lists longer than a few entries by their length.
fn short(v: &Value) -> String {
    match v {
        Value::Array(a) if a.len() > 4 => format!("[{} entries]", a.len()),
        Value::String(s) if s.len() > 16 => format!("{:?}… ({} layers)", &s[..8], s.len()),
        other => other.to_string(),
    }
}

/// Fails unless `reduced` computes per layer what the first layers of `full` do.
fn same_semantics(full: &ModelConfig, reduced: &ModelConfig) -> Result<()> {
    ensure!(full.model_type == reduced.model_type, "model type");
    ensure!(
        full.attention == reduced.attention,
        "attention settings changed"
    );
    ensure!(full.mamba == reduced.mamba, "Mamba-2 settings changed");
    ensure!(
        full.deltanet == reduced.deltanet,
        "DeltaNet settings changed"
    );
    let routing = |c: &ModelConfig| {
        c.moe.as_ref().map(|m| {
            (
                m.top_k,
                m.norm_topk_prob,
                m.shared_intermediate.is_some(),
                m.shared_expert_gate,
            )
        })
    };
    ensure!(routing(full) == routing(reduced), "routing changed");
    ensure!(
        full.mlp.as_ref().map(|m| m.activation) == reduced.mlp.as_ref().map(|m| m.activation),
        "MLP activation changed"
    );
    let scalars = |c: &ModelConfig| {
        (
            c.norm_eps,
            c.norm_weight_offset,
            c.tie_word_embeddings,
            c.embedding_multiplier,
            c.residual_multiplier,
            c.logits_divisor,
        )
    };
    ensure!(
        scalars(full) == scalars(reduced),
        "model-wide scalars changed"
    );
    let kinds = |c: &ModelConfig| -> Vec<_> {
        c.layers
            .iter()
            .map(|l| (l.mixer, l.ffn, l.sliding_window))
            .collect()
    };
    let (f, r) = (kinds(full), kinds(reduced));
    ensure!(
        f.len() >= r.len() && f[..r.len()] == r[..],
        "the reduced layers are not the full config's first ones"
    );
    let distinct = |k: &[_]| {
        let mut v: Vec<String> = k.iter().map(|x| format!("{x:?}")).collect();
        v.sort();
        v.dedup();
        v
    };
    ensure!(distinct(&f) == distinct(&r), "a layer kind was cut away");
    Ok(())
}

/// The reduced random model runs a greedy generate step through the CLI.
fn check_generate(name: &str, dir: &Path, keep: usize, scratch: &Path) -> Result<Vec<String>> {
    let full_text = std::fs::read_to_string(dir.join("config.json"))?;
    let full = parse_config(&full_text, &dir.join("config.json"))?;
    let mut map = read_config(&dir.join("config.json"))?;
    // A vision-language wrapper keeps the language model under `text_config`.
    let changed = match map.get_mut("text_config") {
        Some(Value::Object(text)) => reduce(text, keep, full.mamba.is_some())?,
        _ => reduce(&mut map, keep, full.mamba.is_some())?,
    };
    let text = config_text(&map)?;
    let work = scratch.join(name);
    std::fs::create_dir_all(&work)?;
    let config_path = scratch.join(format!("{name}.json"));
    std::fs::write(&config_path, &text)?;
    let reduced = parse_config(&text, &config_path)?;
    same_semantics(&full, &reduced)?;

    let (ok, _, stderr) = metrale(&[
        "export-random",
        "--config",
        &config_path.to_string_lossy(),
        "--out",
        &work.to_string_lossy(),
    ])?;
    ensure!(ok, "export-random: {stderr}");
    let tokenizer = published().join("../tokenizer");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tokenizer.join(f), work.join(f))?;
    }
    let (ok, _, stderr) = metrale(&[
        "generate",
        "--model",
        &work.to_string_lossy(),
        "--max-tokens",
        "2",
        "--temperature",
        "0",
        "--ignore-eos",
        "Hello",
    ])?;
    ensure!(ok, "generate: {stderr}");
    ensure!(stderr.contains("generated: 2 tokens"), "generate: {stderr}");
    std::fs::remove_dir_all(&work).ok();
    Ok(changed)
}

#[test]
fn published_configs_parse_and_run() -> Result<()> {
    let text = std::fs::read_to_string(published().join("expected.json"))?;
    let expected: Map<String, Value> = serde_json::from_str(&text)?;
    let mut folders: Vec<String> = std::fs::read_dir(published())?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    folders.sort();
    let listed: Vec<&String> = expected.keys().collect();
    ensure!(
        folders.iter().collect::<Vec<_>>() == listed,
        "expected.json lists {listed:?}, the folders are {folders:?}"
    );
    let scratch = std::env::temp_dir().join(format!("metrale-published-{}", std::process::id()));
    let mut failures = Vec::new();
    for name in &folders {
        let dir = published().join(name);
        let entry = expected[name].as_object().context("entry")?;
        let result = check_inspect(&dir, entry).and_then(|()| {
            let Some(keep) = entry.get("keep_layers").and_then(Value::as_u64) else {
                return Ok(vec!["(refused)".to_string()]);
            };
            check_generate(name, &dir, keep as usize, &scratch)
        });
        match result {
            Ok(changed) => eprintln!("{name}: ok; reduced: {}", changed.join(", ")),
            Err(e) => failures.push(format!("{name}: {e:#}")),
        }
    }
    std::fs::remove_dir_all(&scratch).ok();
    if !failures.is_empty() {
        bail!(
            "{} config(s) failed:\n{}",
            failures.len(),
            failures.join("\n")
        );
    }
    Ok(())
}
