//! `metrale-serve`'s command line: `--ctx-size` / `--max-model-len` bound
//! the context, `--dtype` and the prefix cache's flags are accepted as by
//! the `metrale` subcommands, and
//! a user error is one clean line.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};

fn llama() -> String {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/llama"
    ))
    .to_str()
    .unwrap()
    .to_string()
}

/// Starts the server on the llama fixture on a free port; returns its
/// banner line, then stops it.
fn banner(args: &[&str]) -> String {
    let mut all = vec!["-m".to_string(), llama()];
    all.extend(args.iter().map(|a| a.to_string()));
    banner_with(&all, &[])
}

/// Starts the server with `args` and `env` on a free port; returns its
/// banner line, then stops it.
fn banner_with(args: &[String], env: &[(&str, &std::path::Path)]) -> String {
    let mut command = Command::new(env!("CARGO_BIN_EXE_metrale-serve"));
    for (k, v) in env {
        command.env(k, v);
    }
    let mut child = command
        .args(args)
        .args(["--port", "0", "-t", "1"])
        .env_remove("RUST_LOG")
        .env_remove("METRALE_MODEL")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("metrale-serve runs");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let line = lines
        .find_map(|l| l.ok().filter(|l| l.contains("on http://")))
        .unwrap_or_default();
    let _ = child.kill();
    let _ = child.wait();
    line
}

#[test]
fn ctx_size_bounds_the_served_context() {
    for flag in ["--ctx-size", "--max-model-len"] {
        let line = banner(&[flag, "64"]);
        assert!(line.contains("context 64 tokens"), "{flag}: {line:?}");
    }
    let line = banner(&["--dtype", "bf16"]);
    assert!(line.contains("context"), "{line:?}");
}

#[test]
fn the_prefix_cache_flags_are_accepted() {
    for args in [
        &["--no-prefix-cache"][..],
        &["--snapshot-interval", "32", "--snapshot-budget", "16MiB"],
    ] {
        let line = banner(args);
        assert!(line.contains("context"), "{args:?}: {line:?}");
    }
}

#[test]
fn a_bad_ctx_size_is_one_clean_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_metrale-serve"))
        .args(["-m", &llama(), "--ctx-size", "100000"])
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("metrale-serve runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("error: --ctx-size 100000")
            && stderr.contains("max_position_embeddings"),
        "{stderr}"
    );
}

/// Without --model the bundled model is served as `default`, not under
/// its cache directory's hashed name.
#[test]
fn the_bundled_model_is_served_as_default() {
    let cache = std::env::temp_dir().join(format!("metrale-serve-cache-{}", std::process::id()));
    let line = banner_with(&[], &[("METRALE_CACHE_DIR", &cache)]);
    let _ = std::fs::remove_dir_all(&cache);
    assert!(line.contains("(model `default`"), "{line:?}");
}
