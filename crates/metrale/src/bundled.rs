//! The bundled default model: the files of `models/default/` compiled into
//! the binary (feature `bundled-model`, on by default), so `metrale
//! generate` runs offline from any directory and from an installed binary
//! (`cargo install --path crates/metrale`), never through the path of the
//! source tree it was built from.
//!
//! The loader reads a directory (it memory-maps the safetensors), so the
//! first use writes the files once into a per-user cache directory named by
//! a hash of their contents: `$METRALE_CACHE_DIR`, else
//! `$XDG_CACHE_HOME/metrale`, else `~/.cache/metrale`, else the system's
//! temporary directory. Later runs check the copy byte for byte and reuse it;
//! a different build's model gets a directory of its own. The copy is
//! written under a temporary name and renamed into place, so a concurrent
//! first run never sees half a model.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// The environment variable naming the cache directory (overrides XDG).
pub const CACHE_ENV: &str = "METRALE_CACHE_DIR";

/// The model's files: (name, contents).
#[cfg(feature = "bundled-model")]
const FILES: &[(&str, &[u8])] = &[
    (
        "config.json",
        include_bytes!("../../../models/default/config.json"),
    ),
    (
        "generation_config.json",
        include_bytes!("../../../models/default/generation_config.json"),
    ),
    (
        "model.safetensors",
        include_bytes!("../../../models/default/model.safetensors"),
    ),
    (
        "tokenizer.json",
        include_bytes!("../../../models/default/tokenizer.json"),
    ),
    (
        "tokenizer_config.json",
        include_bytes!("../../../models/default/tokenizer_config.json"),
    ),
    (
        "README.md",
        include_bytes!("../../../models/default/README.md"),
    ),
];

#[cfg(not(feature = "bundled-model"))]
const FILES: &[(&str, &[u8])] = &[];

/// Whether this build carries the default model.
pub fn has_bundled_model() -> bool {
    !FILES.is_empty()
}

/// The bundled model's directory, written into the cache on first use.
pub fn bundled_model_dir() -> Result<PathBuf> {
    if !has_bundled_model() {
        anyhow::bail!(
            "this build has no bundled model (built without the `bundled-model` feature): \
             give --model or set {}",
            crate::MODEL_ENV
        );
    }
    let root = cache_root();
    let dir = root.join(format!("default-model-{:016x}", content_hash()));
    if holds_files(&dir) {
        return Ok(dir);
    }
    write_atomically(&root, &dir)
        .with_context(|| format!("writing the bundled model into {}", dir.display()))?;
    Ok(dir)
}

/// Where cached files go (see the module's doc).
pub fn cache_root() -> PathBuf {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(dir) = var(CACHE_ENV) {
        return PathBuf::from(dir);
    }
    if let Some(dir) = var("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("metrale");
    }
    if let Some(home) = var("HOME") {
        return PathBuf::from(home).join(".cache").join("metrale");
    }
    std::env::temp_dir().join("metrale-cache")
}

/// FNV-1a over every file's name, length and bytes: names the copy, so two
/// builds with different models never share a directory.
fn content_hash() -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325_u64;
    let mut feed = |bytes: &[u8]| {
        for &b in bytes {
            hash = (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    for (name, bytes) in FILES {
        feed(name.as_bytes());
        feed(&(bytes.len() as u64).to_le_bytes());
        feed(bytes);
    }
    hash
}

/// Whether `dir` holds every file with exactly the bundled contents (a
/// truncated or edited copy is rewritten).
fn holds_files(dir: &Path) -> bool {
    FILES
        .iter()
        .all(|(name, bytes)| std::fs::read(dir.join(name)).is_ok_and(|on_disk| on_disk == *bytes))
}

fn write_atomically(root: &Path, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(root)?;
    let tmp = root.join(format!(
        ".default-model-{}-{}.tmp",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    let written = (|| -> Result<()> {
        std::fs::create_dir(&tmp)?;
        for (name, bytes) in FILES {
            std::fs::write(tmp.join(name), bytes)?;
        }
        if dir.exists() {
            // A stale or damaged copy: replace it.
            std::fs::remove_dir_all(dir)?;
        }
        std::fs::rename(&tmp, dir)?;
        Ok(())
    })();
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
        // Another process may have won the race with a good copy.
        if holds_files(dir) {
            return Ok(());
        }
    }
    written
}

#[cfg(all(test, feature = "bundled-model"))]
mod tests {
    use super::*;

    #[test]
    fn the_bundled_files_are_the_models_files() {
        let names: Vec<_> = FILES.iter().map(|(n, _)| *n).collect();
        for needed in ["config.json", "model.safetensors", "tokenizer.json"] {
            assert!(names.contains(&needed), "{needed} is not bundled");
        }
        assert!(FILES.iter().all(|(_, b)| !b.is_empty()));
    }

    #[test]
    fn a_damaged_copy_is_rewritten() {
        let root = std::env::temp_dir().join(format!("metrale-bundled-{}", std::process::id()));
        let dir = root.join("model");
        write_atomically(&root, &dir).unwrap();
        assert!(holds_files(&dir));
        std::fs::write(dir.join("config.json"), b"{").unwrap();
        assert!(!holds_files(&dir));
        write_atomically(&root, &dir).unwrap();
        assert!(holds_files(&dir));
        std::fs::remove_dir_all(&root).unwrap();
    }
}
