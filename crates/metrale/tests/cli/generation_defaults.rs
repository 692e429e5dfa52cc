//! The checkpoint's generation_config.json gives the sampling defaults of
//! the library and the CLI (vLLM's rule), seen in what generation actually
//! uses: the parameters `Generator` hands out, the number of tokens
//! generated (max_new_tokens), greedy output under `do_sample: false`, and
//! what `-v` logs.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

use metrale::{Device, EngineConfig, Generator, LoadOptions, SamplingOverrides, SamplingParams};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(name)
}

/// A copy of the llama fixture whose generation_config.json also holds
/// `extra` (JSON members, without braces).
fn with_generation_config(tag: &str, extra: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::SeqCst);
    let dir = std::env::temp_dir().join(format!(
        "metrale-gen-defaults-{}-{tag}-{n}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(fixture("llama")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    let path = dir.join("generation_config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replacen('{', &format!("{{\n  {extra},"), 1)).unwrap();
    dir
}

fn load(dir: &Path) -> Generator {
    let options = LoadOptions {
        device: Device::Cpu,
        threads: 1,
        ..LoadOptions::default()
    };
    Generator::load(dir, &options, EngineConfig::default(), &mut |_| {})
        .unwrap_or_else(|e| panic!("loading {}: {e:#}", dir.display()))
}

#[test]
fn the_library_defaults_are_the_checkpoints() {
    let dir = with_generation_config(
        "lib",
        r#""do_sample": true, "temperature": 0.6, "top_k": 5, "top_p": 0.9,
           "min_p": 0.01, "repetition_penalty": 1.05, "max_new_tokens": 4"#,
    );
    let mut g = load(&dir);
    let p = g.default_params();
    assert_eq!(p.temperature, 0.6);
    assert_eq!(p.top_k, 5);
    assert_eq!(p.top_p, 0.9);
    assert_eq!(p.min_p, 0.01);
    assert_eq!(p.repetition_penalty, 1.05);
    assert_eq!(p.max_tokens, Some(4));
    assert_eq!(
        g.defaults().source.as_deref(),
        Some(dir.join("generation_config.json").as_path())
    );
    // max_new_tokens is what generation stops at.
    let params = SamplingParams {
        ignore_eos: true,
        seed: Some(1),
        ..g.default_params()
    };
    let out = g.generate("Hello world", &params).unwrap();
    assert_eq!(out.tokens.len(), 4);
    // An override wins over the checkpoint's value; the rest stay.
    let p = g.params(&SamplingOverrides {
        max_tokens: Some(2),
        top_k: Some(0),
        ..SamplingOverrides::default()
    });
    assert_eq!((p.max_tokens, p.top_k, p.temperature), (Some(2), 0, 0.6));
    g.shutdown().unwrap();

    // Without sampling keys (the fixture as committed): temperature 1, top_p 1.
    let g = load(&fixture("llama"));
    assert_eq!(g.default_params(), SamplingParams::default());
    assert_eq!(
        (g.default_params().temperature, g.default_params().top_p),
        (1.0, 1.0)
    );
    g.shutdown().unwrap();
}

#[test]
fn do_sample_false_generates_greedily() {
    let dir = with_generation_config("greedy", r#""do_sample": false, "temperature": 0.9"#);
    let mut g = load(&dir);
    assert!(g.default_params().is_greedy());
    let greedy = SamplingParams {
        max_tokens: Some(8),
        ignore_eos: true,
        ..SamplingParams::greedy()
    };
    let want = g.generate("The quick brown fox", &greedy).unwrap().tokens;
    for seed in 0..4 {
        let params = SamplingParams {
            max_tokens: Some(8),
            ignore_eos: true,
            seed: Some(seed),
            ..g.default_params()
        };
        assert_eq!(
            g.generate("The quick brown fox", &params).unwrap().tokens,
            want
        );
    }
    g.shutdown().unwrap();
}

#[test]
fn a_bad_generation_config_fails_the_load_naming_it() {
    let dir = with_generation_config("bad", r#""top_p": 1.5"#);
    let options = LoadOptions {
        device: Device::Cpu,
        threads: 1,
        ..LoadOptions::default()
    };
    let e = match Generator::load(&dir, &options, EngineConfig::default(), &mut |_| {}) {
        Ok(_) => panic!("top_p 1.5 should be refused"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        e.contains("generation_config.json") && e.contains("top_p"),
        "{e}"
    );
}

fn metrale(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args(args)
        .env_remove("METRALE_MODEL")
        .env_remove("RUST_LOG")
        .output()
        .expect("metrale runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn the_cli_uses_and_logs_the_checkpoint_defaults() {
    let dir = with_generation_config(
        "cli",
        r#""temperature": 0.6, "top_k": 5, "max_new_tokens": 3"#,
    );
    let model = dir.to_str().unwrap();
    let out = metrale(&["-v", "generate", "--model", model, "--ignore-eos", "Hello"]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    for logged in [
        "temperature 0.6 (generation_config.json)",
        "top_k 5 (generation_config.json)",
        "top_p 1 (default)",
        "max_tokens 3 (generation_config.json)",
    ] {
        assert!(stderr.contains(logged), "{logged:?} not in {stderr}");
    }
    assert!(stderr.contains("generated: 3 tokens"), "{stderr}");

    // Flags override; the rest stay the checkpoint's.
    let out = metrale(&[
        "-v",
        "generate",
        "--model",
        model,
        "--ignore-eos",
        "--temperature",
        "0",
        "--max-tokens",
        "2",
        "Hello",
    ]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("temperature 0 (given)"), "{stderr}");
    assert!(
        stderr.contains("top_k 5 (generation_config.json)"),
        "{stderr}"
    );
    assert!(stderr.contains("generated: 2 tokens"), "{stderr}");

    // Without a generation_config.json sampling key: temperature 1, top_p 1,
    // and the CLI's 256 tokens (cut to the context).
    let plain = with_generation_config("cli-plain", r#""x_unused": 0"#);
    let out = metrale(&[
        "-v",
        "generate",
        "--model",
        plain.to_str().unwrap(),
        "Hello",
    ]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("temperature 1 (default)"), "{stderr}");
    assert!(stderr.contains("top_p 1 (default)"), "{stderr}");
}

#[test]
fn the_cli_generates_greedily_under_do_sample_false() {
    let dir = with_generation_config("cli-greedy", r#""do_sample": false"#);
    let model = dir.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            model,
            "--ignore-eos",
            "--max-tokens",
            "6",
        ];
        args.extend_from_slice(extra);
        args.push("The quick brown fox");
        let out = metrale(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    let greedy = run(&["--temperature", "0"]);
    assert_eq!(run(&["--seed", "1"]), greedy);
    assert_eq!(run(&["--seed", "2"]), greedy);
}
