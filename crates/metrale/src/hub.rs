//! What `--model` names, resolved to a model directory: a local directory,
//! a `.safetensors` file (its directory), or a Hugging Face hub id
//! (`org/name`) found in the local Hugging Face cache. This build does not
//! download: a hub id must already be in the cache (`huggingface-cli
//! download org/name` or `hf download org/name` put it there).
//!
//! The cache is the one the hub client uses: `$HF_HUB_CACHE`, else
//! `$HF_HOME/hub`, else `~/.cache/huggingface/hub`. A repository `org/name`
//! lives in `models--org--name/`, with `refs/<revision>` (a file holding a
//! commit hash) and `snapshots/<hash>/` (the files, usually symlinks into
//! `blobs/`). A ref is read only from a regular file of at most 4 KiB, and
//! must hold a plain name (no path separator, no `..`).

use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// The revision used when none is given.
pub const DEFAULT_REVISION: &str = "main";

/// The model directory `spec` names:
///
/// - a path that exists wins: a directory is the model directory; a
///   `.safetensors` file stands for its directory, which must hold the
///   `config.json` (and the tokenizer) beside it;
/// - else `org/name` is a Hugging Face hub id, looked up in the local cache
///   ([`hub_cache_dir`]) at `revision` (default `main`: a branch or tag
///   name under `refs/`, or a commit hash naming a snapshot directly).
///
/// A hub id not in the cache is an error saying where it looked and that
/// this build does not download. A path that does not exist and is no hub
/// id comes back as it is, for the loader to report as missing. `revision` given with a local path is
/// ignored, with a warning.
pub fn resolve_model(spec: impl AsRef<Path>, revision: Option<&str>) -> Result<PathBuf> {
    resolve_model_in(spec.as_ref(), revision, hub_cache_dir().as_deref())
}

/// [`resolve_model`] with the hub cache given (`None`: no cache location
/// could be determined).
pub fn resolve_model_in(
    spec: &Path,
    revision: Option<&str>,
    cache: Option<&Path>,
) -> Result<PathBuf> {
    if spec.exists() {
        if let Some(rev) = revision {
            tracing::warn!(
                "--revision {rev} is ignored: {} is a local path, not a hub id",
                spec.display()
            );
        }
        return local(spec);
    }
    let Some(id) = spec.to_str().filter(|s| is_hub_id(s)) else {
        // Neither a path that exists nor a hub id: the path, for the
        // loader to report as missing (naming the file it wanted).
        return Ok(spec.to_path_buf());
    };
    let Some(cache) = cache else {
        bail!(
            "{id} is not a local path, and there is no Hugging Face cache to look for it in \
             (HF_HUB_CACHE, HF_HOME and HOME are all unset); this build of metrale does not \
             download models"
        );
    };
    let dir = snapshot(cache, id, revision.unwrap_or(DEFAULT_REVISION))?;
    tracing::info!("model {id}: {}", dir.display());
    Ok(dir)
}

/// The local Hugging Face hub cache: `$HF_HUB_CACHE`, else `$HF_HOME/hub`,
/// else `$HOME/.cache/huggingface/hub` (an empty variable counts as unset).
pub fn hub_cache_dir() -> Option<PathBuf> {
    hub_cache_dir_from(
        std::env::var_os("HF_HUB_CACHE"),
        std::env::var_os("HF_HOME"),
        std::env::var_os("HOME"),
    )
}

/// [`hub_cache_dir`] from the three variables' values.
pub fn hub_cache_dir_from(
    hf_hub_cache: Option<OsString>,
    hf_home: Option<OsString>,
    home: Option<OsString>,
) -> Option<PathBuf> {
    let set = |v: Option<OsString>| v.filter(|v| !v.is_empty()).map(PathBuf::from);
    set(hf_hub_cache)
        .or_else(|| set(hf_home).map(|h| h.join("hub")))
        .or_else(|| set(home).map(|h| h.join(".cache").join("huggingface").join("hub")))
}

/// Whether `s` reads as a hub id: `org/name`, each part made of letters,
/// digits, `-`, `_` and `.`, not starting with `.` (so `./x` and `../x`
/// are paths).
pub fn is_hub_id(s: &str) -> bool {
    match s.split_once('/') {
        Some((org, name)) => is_plain_name(org) && is_plain_name(name),
        None => false,
    }
}

/// 1 to 96 letters, digits, `-`, `_` and `.`, not starting with `.`: a
/// part of a hub id, or a snapshot's name (a commit hash is one).
fn is_plain_name(p: &str) -> bool {
    !p.is_empty()
        && !p.starts_with('.')
        && p.len() <= 96
        && p.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// A local path: a directory, a `.safetensors` file's directory, or a
/// `.gguf` file.
fn local(spec: &Path) -> Result<PathBuf> {
    if spec.is_dir() {
        return Ok(spec.to_path_buf());
    }
    let ext = spec
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    match ext.as_deref() {
        Some("safetensors") => {
            let dir = match spec.parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                _ => PathBuf::from("."),
            };
            if !dir.join("config.json").is_file() {
                bail!(
                    "{}: a .safetensors file is loaded with the config.json and tokenizer.json \
                     of its directory, and {} has no config.json",
                    spec.display(),
                    dir.display()
                );
            }
            let name = spec.file_name().and_then(|n| n.to_str()).unwrap_or("");
            let single = name == metrale_model_weights::loader::SINGLE_FILE;
            let indexed = dir
                .join(metrale_model_weights::loader::INDEX_FILE)
                .is_file();
            if !single && !indexed {
                bail!(
                    "{}: metrale loads a directory's {} or the shards its {} lists, and {} has \
                     neither (rename the file to {0}?)",
                    spec.display(),
                    metrale_model_weights::loader::SINGLE_FILE,
                    metrale_model_weights::loader::INDEX_FILE,
                    dir.display()
                );
            }
            Ok(dir)
        }
        // A GGUF file is the whole model (config, weights, tokenizer).
        Some("gguf") => Ok(spec.to_path_buf()),
        _ => bail!(
            "{} is a file, not a model directory or a .safetensors file",
            spec.display()
        ),
    }
}

/// The model a command names (`spec`, resolved by [`resolve_model`] at
/// `revision`), else `$METRALE_MODEL`, else the bundled one
/// ([`crate::default_model_dir`]): what every subcommand and the server
/// load. Refused, naming where it looked, unless it holds a `config.json`
/// or is a GGUF file.
pub fn model_dir(spec: Option<&Path>, revision: Option<&str>) -> Result<PathBuf> {
    let dir = match spec {
        Some(spec) => resolve_model(spec, revision)?,
        None => crate::default_model_dir()?,
    };
    let gguf = matches!(
        crate::engine::gguf::ModelSource::from_path(&dir),
        crate::engine::gguf::ModelSource::Gguf(_)
    );
    if !dir.join("config.json").is_file() && !gguf {
        bail!(
            "no model at {}: no {} there, nor is it a GGUF file (give --model DIR or \
             FILE.gguf, or set {})",
            dir.display(),
            dir.join("config.json").display(),
            crate::MODEL_ENV
        );
    }
    Ok(dir)
}

/// The snapshot directory of `id` at `revision` in `cache`.
fn snapshot(cache: &Path, id: &str, revision: &str) -> Result<PathBuf> {
    let repo = cache.join(format!("models--{}", id.replace('/', "--")));
    let not_downloading = "this build of metrale does not download models: fetch it with \
                           `huggingface-cli download`, or give --model a local directory";
    if !repo.is_dir() {
        bail!(
            "model {id} is not in the Hugging Face cache (looked for {}; the cache is \
             HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub); {not_downloading}",
            repo.display()
        );
    }
    let snapshots = repo.join("snapshots");
    let plain = !revision.is_empty()
        && !revision.contains("..")
        && !revision.starts_with('/')
        && !revision.contains('\\');
    if !plain {
        bail!("--revision {revision:?} is not a revision name or commit hash");
    }
    let direct = snapshots.join(revision);
    let dir = if is_commit_hash(revision) && direct.is_dir() {
        direct
    } else {
        let ref_file = repo.join("refs").join(revision);
        let hash = match read_ref(&ref_file)?.or(short_hash(&snapshots, id, revision)?) {
            Some(hash) => hash,
            None => {
                let known = list(&repo.join("refs"));
                let hashes = list(&snapshots);
                bail!(
                    "revision {revision} of model {id} is not in the Hugging Face cache (no {} \
                     nor snapshot {revision}; refs there: {}; snapshots: {}); {not_downloading}",
                    ref_file.display(),
                    if known.is_empty() {
                        "none".into()
                    } else {
                        known.join(", ")
                    },
                    if hashes.is_empty() {
                        "none".into()
                    } else {
                        hashes.join(", ")
                    },
                );
            }
        };
        let dir = snapshots.join(&hash);
        if !dir.is_dir() {
            bail!(
                "model {id}: {} names commit {hash}, whose snapshot {} is not in the cache \
                 (an interrupted download?); {not_downloading}",
                ref_file.display(),
                dir.display()
            );
        }
        dir
    };
    if !dir.join("config.json").is_file() {
        bail!(
            "model {id} at revision {revision}: the cached snapshot {} has no config.json \
             (only some of its files were downloaded?); {not_downloading}",
            dir.display()
        );
    }
    Ok(dir)
}

/// The most bytes a `refs/` file may hold: a commit hash is 40 characters
/// (64 in a SHA-256 repository), so a file past this is not a ref.
const MAX_REF_BYTES: u64 = 4096;

/// The snapshot name `ref_file` holds; `None` when there is no such file.
/// Only a regular file (or a symlink to one) of at most [`MAX_REF_BYTES`]
/// is read, since a FIFO would block and `/dev/zero` never end, and what it
/// holds must be a commit hash or another plain name ([`is_plain_name`]: no
/// path separator, not `.` or `..`), since it names a directory.
fn read_ref(ref_file: &Path) -> Result<Option<String>> {
    let meta = match std::fs::metadata(ref_file) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", ref_file.display())),
        Ok(meta) => meta,
    };
    check_ref_file(ref_file, &meta)?;
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    // A FIFO put there after the check must not block the open either.
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, libc::O_NONBLOCK);
    let file =
        (options.open(ref_file)).with_context(|| format!("reading {}", ref_file.display()))?;
    let meta = file
        .metadata()
        .with_context(|| format!("reading {}", ref_file.display()))?;
    check_ref_file(ref_file, &meta)?;
    let mut bytes = Vec::new();
    (file.take(MAX_REF_BYTES + 1).read_to_end(&mut bytes))
        .with_context(|| format!("reading {}", ref_file.display()))?;
    if bytes.len() as u64 > MAX_REF_BYTES {
        bail!(
            "{}: grew past {MAX_REF_BYTES} bytes while read",
            ref_file.display()
        );
    }
    let text = String::from_utf8_lossy(&bytes);
    let hash = text.trim();
    if !is_plain_name(hash) {
        bail!("{}: not a commit hash: {hash:?}", ref_file.display());
    }
    Ok(Some(hash.to_string()))
}

/// A ref must be a regular file of at most [`MAX_REF_BYTES`].
fn check_ref_file(ref_file: &Path, meta: &std::fs::Metadata) -> Result<()> {
    if !meta.is_file() {
        bail!(
            "{}: is {}, not a file holding a commit hash",
            ref_file.display(),
            metrale_model_weights::file_kind(meta.file_type())
        );
    }
    if meta.len() > MAX_REF_BYTES {
        bail!(
            "{}: {} bytes, too long for a ref (a commit hash is 40 characters; at most \
             {MAX_REF_BYTES} bytes are read)",
            ref_file.display(),
            meta.len()
        );
    }
    Ok(())
}

/// The one snapshot whose commit hash starts with `revision`, when that is
/// a shortened hash (7 to 39 hex digits, as `git log --oneline` and the
/// hub's pages show them); an error when several do.
fn short_hash(snapshots: &Path, id: &str, revision: &str) -> Result<Option<String>> {
    let hex = revision.chars().all(|c| c.is_ascii_hexdigit());
    if !hex || !(7..40).contains(&revision.len()) {
        return Ok(None);
    }
    let lower = revision.to_ascii_lowercase();
    let matches: Vec<String> = (list(snapshots).into_iter())
        .filter(|name| is_commit_hash(name) && name.starts_with(&lower))
        .collect();
    match matches.as_slice() {
        [] => Ok(None),
        [one] => Ok(Some(one.clone())),
        several => bail!(
            "revision {revision} of model {id} is ambiguous: snapshots {} all start with it; \
             give more of the hash",
            several.join(", ")
        ),
    }
}

/// A hex string of 40 characters (a git commit).
fn is_commit_hash(s: &str) -> bool {
    s.len() == 40 && s.chars().all(|c| c.is_ascii_hexdigit())
}

/// The names in a directory, sorted (for error messages).
fn list(dir: &Path) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids_and_paths() {
        assert!(is_hub_id("ibm-granite/granite-4.0-h-tiny"));
        assert!(is_hub_id("Qwen/Qwen3-0.6B"));
        assert!(!is_hub_id("granite"));
        assert!(!is_hub_id("./models/x"));
        assert!(!is_hub_id("../x"));
        assert!(!is_hub_id("/abs/path"));
        assert!(!is_hub_id("a/b/c"));
        assert!(!is_hub_id("a/"));
    }

    #[test]
    fn cache_dir_precedence() {
        let s = |v: &str| Some(OsString::from(v));
        assert_eq!(
            hub_cache_dir_from(s("/c"), s("/h"), s("/home/u")),
            Some(PathBuf::from("/c"))
        );
        assert_eq!(
            hub_cache_dir_from(None, s("/h"), s("/home/u")),
            Some(PathBuf::from("/h/hub"))
        );
        assert_eq!(
            hub_cache_dir_from(s(""), s(""), s("/home/u")),
            Some(PathBuf::from("/home/u/.cache/huggingface/hub"))
        );
        assert_eq!(hub_cache_dir_from(None, None, None), None);
    }
}
