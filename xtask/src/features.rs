//! `cargo xtask features`: checks that `crates/workspace-hack` still makes
//! the README's two first commands build each dependency once. Cargo builds a
//! crate once per feature set; the run command (`cargo run -p metrale`)
//! resolves the facade's normal dependencies, the test command (`cargo test
//! --workspace`) every member with its dev-dependencies. Every crate the
//! run command builds must get the same features in both, but for the
//! metrale crates' own `cuda` (on in the test build only, by design).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

/// Features the test build may add: (package, feature).
const ALLOWED: &[(&str, &str)] = &[("metrale", "cuda"), ("metrale-gpu-runtime", "cuda")];

pub fn run(root: &Path) -> Result<()> {
    let run = features(root, &["-p", "metrale", "-e", "features,normal,build"])?;
    let test = features(root, &["--workspace", "-e", "features"])?;
    let mut extra = Vec::new();
    for (package, wanted) in &run {
        let Some(tested) = test.get(package) else {
            continue;
        };
        for feature in tested.difference(wanted) {
            let (name, _) = package.split_once(' ').unwrap_or((package, ""));
            if !ALLOWED.contains(&(name, feature.as_str())) {
                extra.push(format!("{package}: \"{feature}\""));
            }
        }
    }
    if !extra.is_empty() {
        bail!(
            "the test build turns on features the run build does not, so both build these \
             crates: {}\nask for them in crates/workspace-hack/Cargo.toml",
            extra.join(", ")
        );
    }
    println!(
        "features: the run and test builds agree on all {} crates the run build uses",
        run.len()
    );
    Ok(())
}

/// `cargo tree`'s features per package ("name vX.Y.Z").
fn features(root: &Path, args: &[&str]) -> Result<BTreeMap<String, BTreeSet<String>>> {
    let out = Command::new(env!("CARGO"))
        .args(["tree", "--prefix", "none", "--format", "{p} {f}"])
        .args(args)
        .current_dir(root)
        .output()
        .context("running cargo tree")?;
    if !out.status.success() {
        bail!(
            "cargo tree failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut map: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        // "name vX.Y.Z [(path)] feat1,feat2" and, with `-e features`,
        // lines for the feature nodes, which repeat what {f} says.
        let mut words = line.split_whitespace();
        let (Some(name), Some(version)) = (words.next(), words.next()) else {
            continue;
        };
        if !version.starts_with('v') {
            continue;
        }
        let entry = map.entry(format!("{name} {version}")).or_default();
        if let Some(list) = words.rfind(|w| !w.starts_with('(') && !w.ends_with(')')) {
            entry.extend(
                list.split(',')
                    .filter(|f| !f.is_empty())
                    .map(str::to_string),
            );
        }
    }
    Ok(map)
}
