//! Structured outputs through the official `openai` client (never skipped,
//! like `openai_client`): `structured_client.py` asks for every schema of
//! the committed corpus (`tests/fixtures/schemas/corpus.json`, 200 schemas
//! made by `gen_schemas.py` with a fixed seed) under three seeds, sampled
//! at temperature 1 on the random-weight llama fixture, and validates every
//! reply with the `jsonschema` package (a reply cut by `max_tokens` fails);
//! then `json_object`, vLLM's `structured_outputs` / `guided_*` spellings,
//! a constrained completion, and malformed constraints refused with 400s.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use metrale::{Device, LoadOptions};
use metrale_server::ServerConfig;
use serde_json::{Value, json};

use crate::common::*;
use crate::openai_client::{OPENAI_VERSION, pip_target, python, run_bounded};

/// The `jsonschema` package version the test installs when python3 has
/// none (`.ci/run` installs the same).
const JSONSCHEMA_VERSION: &str = "4.26.0";

/// A random model walks anywhere the grammar allows: strings at their
/// `maxLength` of multi-byte characters, each one to four tokens. The
/// corpus's largest instance is 598 characters, 96 of them free string
/// characters; 1,500 tokens cover it escaped.
const MAX_TOKENS: usize = 1500;
const SCRIPT_LIMIT: Duration = Duration::from_secs(900);

/// The llama fixture with room for `MAX_TOKENS` after a chat prompt
/// (its config says 512 positions; RoPE takes any).
fn long_context_fixture() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("llama-long-context");
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(fixture()).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        if name == "golden.safetensors" {
            continue;
        }
        std::fs::copy(entry.path(), dir.join(&name)).unwrap();
    }
    let path = dir.join("config.json");
    let mut config: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    config["max_position_embeddings"] = json!(2048);
    std::fs::write(&path, config.to_string()).unwrap();
    dir
}

#[test]
fn every_corpus_schema_validates_through_the_official_client() {
    let started = Instant::now();
    let paths: Vec<PathBuf> = [
        pip_target("openai", "openai", OPENAI_VERSION),
        pip_target("jsonschema", "jsonschema", JSONSCHEMA_VERSION),
    ]
    .into_iter()
    .flatten()
    .collect();
    let options = LoadOptions {
        device: Device::Cpu,
        threads: 2,
        model: metrale::ModelOptions {
            kv_blocks: 1024,
            max_seqs: 8,
            ..load_options().model
        },
        ..load_options()
    };
    let server = start_app(
        &long_context_fixture(),
        &options,
        ServerConfig::default(),
        metrale_server::router,
    );
    let corpus =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/schemas/corpus.json");
    let spec = json!({
        "base_url": format!("http://{}/v1", server.addr),
        "model": server.state.model_name,
        "corpus": corpus,
        "seeds": [1, 2, 3],
        "max_tokens": MAX_TOKENS,
        "workers": 8,
    });
    let spec_path = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("structured-spec-{}.json", std::process::id()));
    std::fs::write(&spec_path, spec.to_string()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/structured_client.py");
    let mut cmd = Command::new(python());
    cmd.arg(&script)
        .arg(&spec_path)
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost")
        .env_remove("HTTP_PROXY")
        .env_remove("HTTPS_PROXY")
        .env_remove("ALL_PROXY")
        .env_remove("http_proxy")
        .env_remove("https_proxy")
        .env_remove("all_proxy")
        .env_remove("OPENAI_BASE_URL")
        .env_remove("OPENAI_API_KEY");
    if !paths.is_empty() {
        cmd.env("PYTHONPATH", std::env::join_paths(&paths).unwrap());
    }
    let out = run_bounded(cmd, SCRIPT_LIMIT);
    let _ = std::fs::remove_file(&spec_path);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}{stderr}");
    assert!(
        out.status.success(),
        "structured_client.py failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    eprintln!(
        "structured-output client test took {:.1} s",
        started.elapsed().as_secs_f64()
    );
}
