//! The official `openai` Python client against the server (never skipped:
//! no python3, or an `openai` package that cannot be installed, fails the
//! test). The expected greedy texts come from the library: a completion's
//! from `Generator::generate` (what `metrale generate` runs: the prompt
//! encoded with special tokens, streamed to its end), a chat's from the
//! model's chat template through `Generator::chat_prompt` and
//! `generate_ids`. `openai_client.py` checks completions and chat, streamed
//! and not, stop, seed, n, logprobs, usage, and the errors as the client's
//! exception types (400, 404 `model_not_found`, 401 with an API key).

use crate::common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use common::*;
use metrale::{ChatMessage, Finish, SamplingParams};
use metrale_server::ServerConfig;
use serde_json::json;

/// The `openai` package version the test installs when python3 has none
/// (`.ci/run` installs the same).
pub(crate) const OPENAI_VERSION: &str = "1.109.1";

const PROMPT: &str = "The quick brown fox";
const MAX_TOKENS: usize = 12;
const API_KEY: &str = "sk-metrale-test";
/// The script takes a few seconds; past this it is killed and the test fails.
const SCRIPT_LIMIT: Duration = Duration::from_secs(300);

pub(crate) fn python() -> &'static str {
    "python3"
}

/// `PYTHONPATH` for a python3 that imports `openai` at the pinned version:
/// none when python3's own is that version (`.ci/run` installs it), else a
/// directory under the target dir where pip installs it (once; later runs
/// reuse it).
fn openai_pythonpath() -> Option<PathBuf> {
    pip_target("openai", "openai", OPENAI_VERSION)
}

/// A directory from which python3 imports `module` of the pip package
/// `package` at `version`: none when python3's own is that version, else
/// `target/tmp/pydeps-PACKAGE-VERSION`, where pip installs it once (later
/// runs reuse it; `.ci/run` installs it there up front). Fails the test
/// when it cannot be installed: the tests that need it are never skipped.
pub(crate) fn pip_target(package: &str, module: &str, version: &str) -> Option<PathBuf> {
    // The version of `package` python3 imports with `pythonpath`.
    let installed = |pythonpath: Option<&Path>| {
        let mut cmd = Command::new(python());
        cmd.args([
            "-c",
            &format!("import {module}, importlib.metadata as m; print(m.version({package:?}))"),
        ]);
        if let Some(p) = pythonpath {
            cmd.env("PYTHONPATH", p);
        }
        let out = cmd.output().unwrap_or_else(|e| {
            panic!(
                "the official-client tests need python3 on PATH to run the `{package}` \
                 package, and running it failed: {e}"
            )
        });
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    };
    if installed(None).as_deref() == Some(version) {
        eprintln!("python3 has {package} {version}");
        return None;
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("pydeps-{package}-{version}"));
    if installed(Some(&dir)).as_deref() != Some(version) {
        eprintln!("installing {package}=={version} into {}", dir.display());
        let out = Command::new(python())
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--upgrade",
            ])
            .arg("--target")
            .arg(&dir)
            .arg(format!("{package}=={version}"))
            .output()
            .unwrap_or_else(|e| panic!("running `python3 -m pip install` failed: {e}"));
        let got = installed(Some(&dir));
        assert!(
            out.status.success() && got.as_deref() == Some(version),
            "could not install the `{package}` Python package ({package}=={version}) into {} \
             with pip ({}; importing it then gives {got:?}); the official-client tests cannot \
             run without it.\nstdout: {}\nstderr: {}",
            dir.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
    }
    Some(dir)
}

/// Runs `cmd` to its end, killing it (and failing) after `limit`.
pub(crate) fn run_bounded(mut cmd: Command, limit: Duration) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running openai_client.py with python3");
    // Read both pipes on threads so a full pipe never blocks the script.
    let pipe = |r: Option<Box<dyn Read + Send>>| {
        let mut r = r.unwrap();
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = r.read_to_end(&mut buf);
            buf
        })
    };
    let out = pipe(child.stdout.take().map(|p| Box::new(p) as _));
    let err = pipe(child.stderr.take().map(|p| Box::new(p) as _));
    let began = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if began.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{:?} ran past {limit:?} and was killed; its output:\n{}\n{}",
                cmd.get_args().next().unwrap_or_default(),
                String::from_utf8_lossy(&out.join().unwrap()),
                String::from_utf8_lossy(&err.join().unwrap())
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

fn finish(reason: &Finish) -> &'static str {
    match reason {
        Finish::Length => "length",
        _ => "stop",
    }
}

#[test]
fn the_official_openai_client_gets_the_library_s_outputs() {
    let started = Instant::now();
    let pythonpath = openai_pythonpath();

    // The expected outputs, from the library.
    let mut g = generator();
    let greedy = SamplingParams {
        max_tokens: Some(MAX_TOKENS),
        logprobs: true,
        ..SamplingParams::greedy()
    };
    let completion = g.generate(PROMPT, &greedy).unwrap();
    let messages = [
        ChatMessage::new("system", "You are terse."),
        ChatMessage::new("user", "Name a colour."),
    ];
    let template = g
        .chat_template()
        .expect("the llama fixture has a chat template");
    let chat_ids = g.chat_prompt(&template, &messages).unwrap();
    let chat = g.generate_ids(chat_ids, &greedy).unwrap();
    g.shutdown().unwrap();
    let echo_ids: Vec<u32> = vec![1, 450, 4996, 17354, 1701, 29916, 432, 17204];
    let echo_ids: Vec<u32> = echo_ids.into_iter().map(|id| id % 512).collect();
    let echo_logprobs = model_logprobs(&echo_ids);
    let echo_text = metrale::Tokenizer::from_dir(fixture())
        .unwrap()
        .decode(&echo_ids)
        .unwrap();

    let server = served();
    let keyed = start(ServerConfig {
        api_key: Some(API_KEY.into()),
        ..ServerConfig::default()
    });
    let spec = json!({
        "base_url": format!("http://{}/v1", server.addr),
        "keyed_base_url": format!("http://{}/v1", keyed.addr),
        "api_key": API_KEY,
        "model": server.state.model_name,
        "completion": {
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "text": completion.text,
            "finish_reason": finish(&completion.finish_reason),
            "prompt_tokens": completion.usage.prompt_tokens,
            "completion_tokens": completion.usage.completion_tokens,
            "logprobs": completion.logprobs,
        },
        "chat": {
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a colour."},
            ],
            "max_tokens": MAX_TOKENS,
            "text": chat.text,
            "finish_reason": finish(&chat.finish_reason),
            "prompt_tokens": chat.usage.prompt_tokens,
            "completion_tokens": chat.usage.completion_tokens,
        },
        "echo": {"ids": echo_ids, "logprobs": echo_logprobs, "text": echo_text},
    });
    run_script(&spec, pythonpath.as_deref(), "official");
    eprintln!(
        "official-client test took {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// Each token of `ids` after the first: its log-probability under the
/// model given those before it, the log-softmax (in f64) of the logits
/// `metrale logits` writes for `ids` ([`metrale::Model::logits`], one
/// prefill).
fn model_logprobs(ids: &[u32]) -> Vec<f64> {
    let model = metrale::Model::load(&fixture(), &load_options(), &mut |_| {}).unwrap();
    let logits = model.logits(ids, None).unwrap();
    let vocab = logits.len() / ids.len();
    let out = logits
        .chunks_exact(vocab)
        .zip(&ids[1..])
        .map(|(row, &next)| {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
            row[next as usize] as f64 - max - sum.ln()
        })
        .collect();
    model.shutdown().unwrap();
    out
}

/// Runs `openai_client.py` on `spec` (its file named by `tag`); fails the
/// test unless every check passed.
fn run_script(spec: &serde_json::Value, pythonpath: Option<&Path>, tag: &str) {
    let spec_path = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "openai-client-spec-{tag}-{}.json",
        std::process::id()
    ));
    std::fs::write(&spec_path, spec.to_string()).unwrap();

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py");
    let mut cmd = Command::new(python());
    cmd.arg(&script)
        .arg(&spec_path)
        // Loopback only: no proxy between the client and the server.
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
    if let Some(dir) = pythonpath {
        cmd.env("PYTHONPATH", dir);
    }
    let out = run_bounded(cmd, SCRIPT_LIMIT);
    let _ = std::fs::remove_file(&spec_path);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}{stderr}");
    assert!(
        out.status.success(),
        "openai_client.py failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(stdout.contains(" 0 failed"), "{stdout}");
}

/// A model of each newer family (Qwen3.5 as published: the vision-language
/// wrapper; Qwen3.5-MoE, LFM2, LFM2-MoE) through the server: listed, and
/// a greedy chat streamed and not equal to the library's templated
/// generation.
#[test]
fn every_newer_family_chats_through_the_official_client() {
    let pythonpath = openai_pythonpath();
    for name in ["qwen3_5", "qwen3_5_moe", "lfm2", "lfm2_moe"] {
        let dir = fixture().join("..").join(name);
        let greedy = SamplingParams {
            max_tokens: Some(MAX_TOKENS),
            ..SamplingParams::greedy()
        };
        let mut g = metrale::Generator::load(
            &dir,
            &load_options(),
            metrale::EngineConfig::default(),
            &mut |_| {},
        )
        .unwrap_or_else(|e| panic!("{name}: {e:#}"));
        let messages = [
            ChatMessage::new("system", "You are terse."),
            ChatMessage::new("user", "Name a colour."),
        ];
        let template = g.chat_template().expect("the fixture has a chat template");
        let ids = g.chat_prompt(&template, &messages).unwrap();
        let chat = g.generate_ids(ids, &greedy).unwrap();
        g.shutdown().unwrap();
        let server = start_app(
            &dir,
            &load_options(),
            ServerConfig::default(),
            metrale_server::router,
        );
        let spec = json!({
            "sections": ["models", "chat"],
            "base_url": format!("http://{}/v1", server.addr),
            "model": server.state.model_name,
            "chat": {
                "messages": [
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Name a colour."},
                ],
                "max_tokens": MAX_TOKENS,
                "text": chat.text,
                "finish_reason": finish(&chat.finish_reason),
                "prompt_tokens": chat.usage.prompt_tokens,
                "completion_tokens": chat.usage.completion_tokens,
            },
        });
        eprintln!("{name}: greedy chat {:?}", chat.text);
        run_script(&spec, pythonpath.as_deref(), name);
    }
}
