//! Structured outputs through the official `openai` client (never skipped,
//! like `openai_client`): `structured_client.py` asks for every schema of
//! the committed corpus (`tests/fixtures/schemas/corpus.json`, 200 schemas
//! made by `gen_schemas.py` with a fixed seed) under three seeds, sampled
//! at temperature 1 on the random-weight llama fixture, and validates every
//! reply with the `jsonschema` package (a reply cut by `max_tokens` fails);
//! then `json_object`, vLLM's `structured_outputs` / `guided_*` spellings,
//! a constrained completion, and malformed constraints refused with 400s.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use metrale::{Device, LoadOptions};
use metrale_server::ServerConfig;
use serde_json::{Value, json};

use crate::common::*;
use crate::python::{Package, run_client};

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
    run_client(
        "structured_client.py",
        "corpus",
        &spec,
        &[Package::OPENAI, Package::JSONSCHEMA],
        SCRIPT_LIMIT,
    );
    eprintln!(
        "structured-output client test took {:.1} s",
        started.elapsed().as_secs_f64()
    );
}
