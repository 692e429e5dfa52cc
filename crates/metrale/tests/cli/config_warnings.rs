//! A config.json that loads but deserves a word (here a nemotron_h
//! `num_hidden_layers` that disagrees with its block list: transformers and
//! metrale use the list) reaches the user: on the stderr of `metrale inspect`
//! and `metrale generate` at the default log level, and through the
//! facade's load progress as `LoadProgress::Warning`.

use std::path::{Path, PathBuf};
use std::process::Command;

use metrale::weights::loader::LoadProgress;
use metrale::{LoadOptions, Model};

const WARNING: &str = "num_hidden_layers is 9, but `layers_block_type` describes 4 layers";

/// A copy of the nemotron_h fixture whose config says 9 layers.
fn stale_layer_count(tag: &str) -> PathBuf {
    let src = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/nemotron_h"
    ));
    let dir = std::env::temp_dir().join(format!("metrale-warn-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for entry in std::fs::read_dir(&src).expect("fixture") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), dir.join(entry.file_name())).expect("copy");
    }
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).expect("config");
    let mut map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&text).expect("json");
    map.insert("num_hidden_layers".into(), 9.into());
    std::fs::write(&path, serde_json::Value::Object(map).to_string()).expect("write");
    dir
}

/// Runs the binary with the default log level (no RUST_LOG).
fn metrale(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove("METRALE_MODEL")
        .output()
        .expect("the metrale binary runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn assert_warns(stderr: &str, dir: &Path) {
    let file = dir.join("config.json");
    assert!(
        stderr.contains(&format!("{}: {WARNING}", file.display())),
        "the warning is missing from {stderr:?}"
    );
}

#[test]
fn inspect_shows_config_warnings() {
    let dir = stale_layer_count("inspect");
    let model = dir.to_str().expect("utf-8 path");
    for args in [vec!["inspect", model], vec!["inspect", model, "--no-load"]] {
        let (ok, stderr) = metrale(&args);
        assert!(ok, "{args:?}: {stderr}");
        assert_warns(&stderr, &dir);
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn generate_shows_config_warnings() {
    let dir = stale_layer_count("generate");
    let model = dir.to_str().expect("utf-8 path");
    let (ok, stderr) = metrale(&[
        "generate",
        "--model",
        model,
        "--max-tokens",
        "2",
        "--temperature",
        "0",
        "Hi",
    ]);
    assert!(ok, "{stderr}");
    assert_warns(&stderr, &dir);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_facade_reports_config_warnings_as_load_progress() {
    let dir = stale_layer_count("facade");
    let mut warnings = Vec::new();
    let model = Model::load(&dir, &LoadOptions::default(), &mut |p| {
        if let LoadProgress::Warning(w) = p {
            warnings.push(w);
        }
    })
    .expect("loads: the block list decides");
    assert_eq!(model.engine().config().plan_line(), "M * M -");
    let expected = format!(
        "{}: {WARNING}; using `layers_block_type`, as transformers does",
        dir.join("config.json").display()
    );
    assert_eq!(warnings, vec![expected]);
    assert_eq!(model.engine().config().warnings, warnings);
    model.shutdown().expect("teardown");
    std::fs::remove_dir_all(&dir).ok();
}
