//! The habits users bring from llama.cpp, vLLM and mistral.rs: short flags,
//! the prompt from an argument, an option, a file or stdin, negative numbers
//! as values, `--ctx-size`, the presence and frequency penalties, `--dtype`
//! as the arithmetic on every subcommand that runs a model, one clean error
//! message, a version that names the build, and the log level.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(name)
}

fn llama() -> String {
    fixture("llama").to_str().expect("utf-8 path").to_string()
}

fn run(args: &[&str], stdin: Option<&str>, env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_metrale"));
    command
        .args(args)
        .env_remove("METRALE_MODEL")
        .env_remove("RUST_LOG")
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        command.env(k, v);
    }
    let mut child = command.spawn().expect("the metrale binary runs");
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes()).expect("write stdin");
    }
    child.wait_with_output().expect("metrale finishes")
}

fn metrale(args: &[&str]) -> Output {
    run(args, None, &[])
}

/// The output as text, without the line a `cuda` build prints saying which
/// device `--device auto` chose (these tests are about everything else).
fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .lines()
        .filter(|l| !l.starts_with("metrale: --device auto: "))
        .map(|l| format!("{l}\n"))
        .collect()
}

fn ok(out: &Output) -> (String, String) {
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "stderr: {stderr}");
    (stdout, stderr)
}

/// Fails with exit status 1 and one `error:` line naming `words`, without a
/// backtrace or anyhow's `Caused by:` list.
fn clean_error(out: &Output, words: &[&str]) {
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line: {stderr:?}");
    assert!(lines[0].starts_with("error: "), "{stderr:?}");
    for w in words {
        assert!(stderr.contains(w), "{w:?} missing from {stderr:?}");
    }
    for noise in ["backtrace", "Caused by", "Stack", "panicked"] {
        assert!(!stderr.contains(noise), "{noise:?} in {stderr:?}");
    }
}

/// Greedy, a few tokens: the same text whichever way the options are spelt.
fn greedy(extra: &[&str], stdin: Option<&str>) -> String {
    let model = llama();
    let mut args = vec!["generate", "--temperature", "0"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["-m", &model]);
    ok(&run(&args, stdin, &[])).0
}

#[test]
fn short_flags_and_every_way_of_giving_the_prompt_agree() {
    let long = greedy(
        &[
            "--max-tokens",
            "6",
            "--seed",
            "3",
            "--threads",
            "1",
            "Once upon a time",
        ],
        None,
    );
    assert!(!long.trim().is_empty());
    let short = greedy(&["-n", "6", "-s", "3", "-t", "1", "Once upon a time"], None);
    assert_eq!(short, long, "short flags");
    let option = greedy(&["-n", "6", "-p", "Once upon a time"], None);
    assert_eq!(option, long, "-p");
    let stdin = greedy(&["-n", "6", "-"], Some("Once upon a time"));
    assert_eq!(stdin, long, "- reads stdin");
    let file = std::env::temp_dir().join(format!("metrale-prompt-{}.txt", std::process::id()));
    std::fs::write(&file, "Once upon a time").unwrap();
    let from_file = greedy(&["-n", "6", "--file", file.to_str().unwrap()], None);
    assert_eq!(from_file, long, "--file");
    let _ = std::fs::remove_file(&file);
    let stdin_file = greedy(&["-n", "6", "--file", "-"], Some("Once upon a time"));
    assert_eq!(stdin_file, long, "--file - reads stdin");
}

#[test]
fn a_prompt_is_required_once() {
    let none = metrale(&["generate", "-m", &llama()]);
    assert_eq!(none.status.code(), Some(2), "a usage error");
    let two = metrale(&["generate", "-m", &llama(), "-p", "a", "b"]);
    assert_eq!(two.status.code(), Some(2), "{}", text(&two.stderr));
    let missing = metrale(&[
        "generate",
        "-m",
        &llama(),
        "--file",
        "/nonexistent/prompt.txt",
    ]);
    clean_error(&missing, &["/nonexistent/prompt.txt"]);
}

#[test]
fn a_mistyped_option_is_an_error_wherever_it_stands() {
    let model = llama();
    for args in [
        &["generate", "-m", &model, "--temprature", "hi"][..],
        &["generate", "-m", &model, "--temprature"][..],
        &["generate", "-m", &model, "--temprature", "0.5", "hi"][..],
        &["generate", "--temprature", "0.5", "-m", &model, "hi"][..],
    ] {
        let out = metrale(args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains("'--temprature'") && stderr.contains("'--temperature'"),
            "{args:?}: clap's suggestion: {stderr}"
        );
        assert!(out.stdout.is_empty(), "{args:?}: nothing generated");
    }
    // A prompt that starts with a dash: with -p, or after `--`.
    let dash = greedy(&["-n", "3", "-p", "-5°C is"], None);
    let args = [
        "generate",
        "--temperature",
        "0",
        "-n",
        "3",
        "-m",
        &model,
        "--",
        "-5°C is",
    ];
    let after = ok(&metrale(&args)).0;
    assert_eq!(dash, after);
    assert!(!dash.trim().is_empty());
}

#[test]
fn negative_numbers_reach_validation() {
    let model = llama();
    for (flag, value, words) in [
        ("--temperature", "-1", "temperature must be"),
        ("--top-p", "-0.5", "top_p must be"),
        (
            "--presence-penalty",
            "-3",
            "presence_penalty must be in [-2, 2]",
        ),
        (
            "--frequency-penalty",
            "2.5",
            "frequency_penalty must be in [-2, 2]",
        ),
    ] {
        let out = metrale(&["generate", "-m", &model, flag, value, "hi"]);
        clean_error(&out, &[words]);
    }
    // vLLM's spelling of "top-k off".
    let (stdout, _) = ok(&metrale(&[
        "generate", "-m", &model, "--top-k", "-1", "-n", "2", "-s", "1", "hi",
    ]));
    assert!(!stdout.is_empty());
}

#[test]
fn penalties_change_greedy_output() {
    let plain = greedy(&["-n", "24", "--ignore-eos", "hello hello"], None);
    let zero = greedy(
        &[
            "-n",
            "24",
            "--ignore-eos",
            "--presence-penalty",
            "0",
            "--frequency-penalty",
            "0",
            "hello hello",
        ],
        None,
    );
    assert_eq!(zero, plain, "0 is off");
    let penalised = greedy(
        &[
            "-n",
            "24",
            "--ignore-eos",
            "--presence-penalty",
            "2",
            "--frequency-penalty",
            "2",
            "hello hello",
        ],
        None,
    );
    assert_ne!(penalised, plain, "the penalties reach the sampler");
}

/// `prompt: P tokens ... generated: G tokens` from the summary line.
fn counts(stderr: &str) -> (usize, usize) {
    let number = |key: &str| -> usize {
        let at = stderr
            .find(key)
            .unwrap_or_else(|| panic!("{key} in {stderr}"))
            + key.len();
        stderr[at..]
            .split_whitespace()
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("a count after {key} in {stderr}"))
    };
    (number("prompt:"), number("generated:"))
}

#[test]
fn ctx_size_bounds_the_context_on_every_subcommand() {
    let model = llama();
    for flag in ["--ctx-size", "--max-model-len"] {
        let out = metrale(&[
            "generate",
            "-m",
            &model,
            flag,
            "12",
            "-n",
            "100",
            "--ignore-eos",
            "hello there",
        ]);
        let (_, stderr) = ok(&out);
        let (prompt, generated) = counts(&stderr);
        assert_eq!(prompt + generated, 12, "{flag}: {stderr}");
    }
    let out = metrale(&["generate", "-m", &model, "--ctx-size", "100000", "hi"]);
    clean_error(
        &out,
        &["--ctx-size 100000", "512", "max_position_embeddings"],
    );
    let out = metrale(&["generate", "-m", &model, "--ctx-size", "2", "a b c d e f g"]);
    clean_error(&out, &["context"]);
    let dir = std::env::temp_dir().join(format!("metrale-ctx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let logits = dir.join("logits.safetensors");
    let out = metrale(&[
        "logits",
        "-m",
        &model,
        "--ids",
        "1,2,3,4",
        "--ctx-size",
        "3",
        "--out",
        logits.to_str().unwrap(),
    ]);
    clean_error(&out, &["4 ids", "3 positions", "--ctx-size"]);
    let out = metrale(&[
        "bench",
        "-m",
        &model,
        "--ctx-size",
        "16",
        "--prompt-len",
        "16",
        "--gen-len",
        "4",
        "--no-probe",
        "--json",
    ]);
    clean_error(&out, &["--ctx-size", "16 positions"]);
    let out = metrale(&[
        "bench",
        "-m",
        &model,
        "--ctx-size",
        "24",
        "--prompt-len",
        "16",
        "--gen-len",
        "4",
        "--no-probe",
        "--json",
        "-t",
        "1",
    ]);
    ok(&out);
    let chat = run(
        &[
            "chat",
            "-m",
            &model,
            "--ctx-size",
            "64",
            "-n",
            "1000",
            "--ignore-eos",
        ],
        Some("hi\n"),
        &[],
    );
    let (_, stderr) = ok(&chat);
    let (prompt, generated) = counts(&stderr);
    assert_eq!(prompt + generated, 64, "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn dtype_is_the_arithmetic_on_every_subcommand() {
    let model = llama();
    let dir = std::env::temp_dir().join(format!("metrale-dtype-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let read = |name: &str, extra: &[&str]| -> Vec<u8> {
        let path = dir.join(name);
        let mut args = vec!["logits", "-m", &model, "--ids", "1,5,9,2", "--out"];
        args.push(path.to_str().unwrap());
        args.extend_from_slice(extra);
        ok(&metrale(&args));
        std::fs::read(&path).unwrap()
    };
    let default = read("default.safetensors", &[]);
    let f32 = read("f32.safetensors", &["--dtype", "f32"]);
    assert_eq!(
        default, f32,
        "the default, auto, computes f32 weights in f32 (exactly)"
    );
    // So for recurrent layers, whose states and scan products follow the
    // weights (a prefill of two chunks, then decode steps that read the
    // state back).
    for name in ["mamba2", "qwen3_next"] {
        let model = fixture(name);
        let logits = |file: &str, extra: &[&str]| -> Vec<u8> {
            let path = dir.join(file);
            let ids = "1,5,9,2,7,3,11,4,8,6,2,9,4,1,7,5,3,8,2";
            let mut args = vec!["logits", "-m", model.to_str().unwrap(), "--ids", ids];
            args.extend(["--decode-from", "17", "--out", path.to_str().unwrap()]);
            args.extend_from_slice(extra);
            ok(&metrale(&args));
            std::fs::read(&path).unwrap()
        };
        assert_eq!(
            logits("rec-default.safetensors", &[]),
            logits("rec-f32.safetensors", &["--dtype", "f32"]),
            "{name}: the default computes f32 weights, states included, in f32"
        );
    }
    // The fixture's weights are f32: bf16 arithmetic leaves them exact.
    read("bf16.safetensors", &["--dtype", "bf16"]);
    ok(&metrale(&[
        "generate", "-m", &model, "--dtype", "bf16", "-n", "2", "hi",
    ]));
    let out = metrale(&["chat", "-m", &model, "--dtype", "bf16", "-n", "2"]);
    ok(&out);
    let out = metrale(&["generate", "-m", &model, "--dtype", "f16", "hi"]);
    assert_eq!(out.status.code(), Some(2), "f16 is not an arithmetic here");
    let bench = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec![
            "bench",
            "-m",
            &model,
            "--prompt-len",
            "8",
            "--gen-len",
            "2",
            "--no-probe",
            "--json",
            "-t",
            "1",
        ];
        args.extend_from_slice(extra);
        let (stdout, _) = ok(&metrale(&args));
        serde_json::from_str(&stdout).expect("JSON")
    };
    let v = bench(&["--weight-dtype", "f32", "--dtype", "f32"]);
    assert_eq!(v["weight_dtype"], "f32", "{v}");
    assert_eq!(v["bf16_dot_products"], false, "{v}");
    let v = bench(&["--dtype", "f32"]);
    assert_eq!(
        v["weight_dtype"], "bf16",
        "bench's weights default to bf16: {v}"
    );
    assert_eq!(v["bf16_dot_products"], false, "{v}");
    // auto (the default) asks for bf16 dot products, as bf16 does (the
    // backend uses them where the CPU has them).
    assert_eq!(
        bench(&[])["bf16_dot_products"],
        bench(&["--dtype", "bf16"])["bf16_dot_products"]
    );
    // The old spelling still works (hidden).
    bench(&["--bf16-dot"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_user_error_is_one_clean_line_even_with_rust_backtrace() {
    let out = run(
        &["generate", "-m", "/nonexistent/model", "hi"],
        None,
        &[("RUST_BACKTRACE", "1"), ("RUST_LIB_BACKTRACE", "1")],
    );
    clean_error(&out, &["no model at /nonexistent/model"]);
    // A model directory that is not one: the path is said once.
    let dir = std::env::temp_dir().join(format!("metrale-broken-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), "{ not json").unwrap();
    let out = run(
        &["generate", "-m", dir.to_str().unwrap(), "hi"],
        None,
        &[("RUST_BACKTRACE", "full")],
    );
    clean_error(&out, &["config.json"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn version_names_the_build() {
    let (stdout, _) = ok(&metrale(&["--version"]));
    assert!(
        stdout.starts_with(&format!("metrale {}", env!("CARGO_PKG_VERSION"))),
        "{stdout}"
    );
    let in_git = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success());
    if let Some(git) = in_git {
        assert!(stdout.contains("(git "), "{stdout}");
        let _ = git;
    }
}

#[test]
fn verbosity_flags_and_rust_log_set_the_log_level() {
    let model = llama();
    let args = ["generate", "-m", &model, "-n", "2", "-s", "1", "hi"];
    let with = |flags: &[&str], env: &[(&str, &str)]| -> String {
        let mut all: Vec<&str> = flags.to_vec();
        all.extend_from_slice(&args);
        ok(&run(&all, None, env)).1
    };
    let plain = with(&[], &[]);
    assert!(!plain.contains("INFO"), "warnings only by default: {plain}");
    assert!(plain.contains("generated:"), "the summary line: {plain}");
    let info = with(&["-v"], &[]);
    assert!(info.contains("INFO"), "-v logs info: {info}");
    assert!(!info.contains("DEBUG"), "{info}");
    let debug = with(&["-vv"], &[]);
    assert!(debug.contains("DEBUG"), "-vv logs debug: {debug}");
    let env = with(&[], &[("RUST_LOG", "info")]);
    assert!(env.contains("INFO"), "RUST_LOG is honoured: {env}");
    let quiet = with(&["-q"], &[("RUST_LOG", "debug")]);
    assert!(quiet.trim().is_empty(), "-q: nothing but errors: {quiet}");
    let both = metrale(&["-q", "-v", "generate", "hi"]);
    assert_eq!(both.status.code(), Some(2), "-q and -v conflict");
}

/// A copy of the llama fixture with a tensor the model does not use.
fn with_unused_tensor() -> PathBuf {
    use safetensors::SafeTensors;
    use safetensors::tensor::{Dtype, TensorView};
    let src = fixture("llama");
    let dir = std::env::temp_dir().join(format!("metrale-unused-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap();
        if name != "model.safetensors" && name != "golden.safetensors" {
            std::fs::copy(&path, dir.join(name)).unwrap();
        }
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let extra = [0u8; 16];
    let mut tensors: Vec<(String, TensorView<'_>)> =
        st.tensors().into_iter().map(|(n, v)| (n, v)).collect();
    tensors.push((
        "lm_head.extra_scale".to_string(),
        TensorView::new(Dtype::F32, vec![4], &extra).unwrap(),
    ));
    safetensors::serialize_to_file(tensors, None, &dir.join("model.safetensors")).unwrap();
    dir
}

#[test]
fn load_warnings_reach_the_user_by_default_and_no_bar_off_a_terminal() {
    let dir = with_unused_tensor();
    let out = metrale(&["generate", "-m", dir.to_str().unwrap(), "-n", "2", "hi"]);
    let (_, stderr) = ok(&out);
    assert!(
        stderr.contains("lm_head.extra_scale") && stderr.contains("not used"),
        "the unused tensor is reported: {stderr}"
    );
    assert!(
        !stderr.contains("loading"),
        "no bar when stderr is not a terminal: {stderr}"
    );
    let quiet = metrale(&[
        "-q",
        "generate",
        "-m",
        dir.to_str().unwrap(),
        "-n",
        "2",
        "hi",
    ]);
    let (_, stderr) = ok(&quiet);
    assert!(stderr.trim().is_empty(), "-q: {stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `metrale ARGS` under `script`, which gives it a pseudo-terminal
/// for stdin, stdout and stderr; returns what the terminal showed.
#[cfg(unix)]
fn on_a_terminal(args: &[&str]) -> Option<String> {
    let mut line = String::from(env!("CARGO_BIN_EXE_metrale"));
    for a in args {
        line.push_str(&format!(" '{a}'"));
    }
    let out = Command::new("script")
        .args(["-qec", &line, "/dev/null"])
        .env_remove("METRALE_MODEL")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .ok()?;
    out.status.success().then(|| text(&out.stdout))
}

#[cfg(unix)]
#[test]
fn loading_shows_a_bar_on_a_terminal_for_every_subcommand_that_loads() {
    let model = llama();
    let dir = std::env::temp_dir().join(format!("metrale-bar-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("l.safetensors");
    let runs: [Vec<&str>; 4] = [
        vec!["generate", "-m", &model, "-n", "2", "hi"],
        vec![
            "logits",
            "-m",
            &model,
            "--ids",
            "1,2",
            "--out",
            out.to_str().unwrap(),
        ],
        vec!["inspect", &model],
        vec![
            "bench",
            "-m",
            &model,
            "--prompt-len",
            "4",
            "--gen-len",
            "1",
            "--no-probe",
            "-t",
            "1",
        ],
    ];
    let Some(_) = on_a_terminal(&["--version"]) else {
        eprintln!("no `script` to make a pseudo-terminal: skipped");
        return;
    };
    for args in runs {
        let shown = on_a_terminal(&args).unwrap_or_else(|| panic!("{args:?} fails"));
        assert!(shown.contains("loading"), "{args:?}: {shown:?}");
        let mut quiet = vec!["-q"];
        quiet.extend_from_slice(&args);
        let shown = on_a_terminal(&quiet).unwrap_or_else(|| panic!("{quiet:?} fails"));
        assert!(
            !shown.contains("loading"),
            "-q hides it: {quiet:?}: {shown:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// inspect and logits run the bundled model without --model, as generate
/// does; a $METRALE_MODEL that names nothing is refused naming the
/// variable.
#[test]
fn every_model_subcommand_falls_back_to_the_default_model() {
    let cache = std::env::temp_dir().join(format!("metrale-fallback-{}", std::process::id()));
    let cache_env = ("METRALE_CACHE_DIR", cache.to_str().unwrap());
    let out = run(&["inspect", "--no-load"], None, &[cache_env]);
    assert!(ok(&out).0.contains("granitemoehybrid"));
    let file = cache.join("logits.safetensors");
    let out = run(
        &["logits", "--ids", "1,2", "--out", file.to_str().unwrap()],
        None,
        &[cache_env],
    );
    ok(&out);
    assert!(file.is_file());
    let out = run(
        &["generate", "hi"],
        None,
        &[cache_env, ("METRALE_MODEL", "/nonexistent/model")],
    );
    clean_error(&out, &["$METRALE_MODEL", "/nonexistent/model"]);
    let _ = std::fs::remove_dir_all(&cache);
}
