//! `cargo xtask msrv`: the workspace's declared `rust-version` is no lower
//! than any locked dependency's. A dependency bump that raises the real
//! minimum (the `parking_lot` 0.13 family needs 1.95) fails here, naming
//! the packages, instead of leaving a declared version no compiler of that
//! version can build.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// `1.95` or `1.88.0` as comparable numbers (a missing patch is 0).
fn parse(v: &str) -> Option<(u64, u64, u64)> {
    let mut parts = v.trim().split('.').map(|p| p.parse::<u64>().ok());
    let major = parts.next()??;
    let minor = parts.next().flatten().unwrap_or(0);
    let patch = parts.next().flatten().unwrap_or(0);
    Some((major, minor, patch))
}

pub fn run(root: &Path) -> Result<()> {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["metadata", "--format-version", "1", "--locked"])
        .current_dir(root)
        .output()
        .context("running cargo metadata")?;
    if !out.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let meta: Value = serde_json::from_slice(&out.stdout).context("cargo metadata's JSON")?;
    let members: Vec<&str> = (meta["workspace_members"].as_array())
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut declared = None;
    let mut deps = Vec::new();
    for p in meta["packages"].as_array().into_iter().flatten() {
        let Some(v) = p["rust_version"].as_str().and_then(parse) else {
            continue;
        };
        let name = format!(
            "{} {}",
            p["name"].as_str().unwrap_or("?"),
            p["version"].as_str().unwrap_or("?")
        );
        if members.contains(&p["id"].as_str().unwrap_or("")) {
            if p["name"] == "metrale" {
                declared = Some(v);
            }
        } else {
            deps.push((v, name));
        }
    }
    let Some(declared) = declared else {
        bail!("the metrale package declares no rust-version");
    };
    deps.sort();
    let Some((needed, _)) = deps.last() else {
        bail!("cargo metadata lists no dependency with a rust-version");
    };
    let needing: Vec<&str> = (deps.iter())
        .filter(|(v, _)| v == needed)
        .map(|(_, n)| n.as_str())
        .collect();
    let show = |v: (u64, u64, u64)| format!("{}.{}.{}", v.0, v.1, v.2);
    if declared < *needed {
        bail!(
            "rust-version {} in Cargo.toml is below what the locked dependencies need: {} ({}); \
             raise it (and the README's) or pin older versions",
            show(declared),
            show(*needed),
            needing.join(", ")
        );
    }
    println!(
        "msrv: rust-version {} covers every locked dependency (the highest: {}, {})",
        show(declared),
        show(*needed),
        needing.join(", ")
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn versions_compare_as_numbers() {
        assert_eq!(parse("1.95"), Some((1, 95, 0)));
        assert!(parse("1.9").unwrap() < parse("1.10.0").unwrap());
        assert_eq!(parse("x"), None);
    }
}
