//! `metrale generate` and `metrale chat` end to end: the bundled default
//! model, sampling options, the stderr summary, stdin that is not a terminal,
//! and clear failures.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(name)
}

fn metrale(args: &[&str], stdin: Option<&str>) -> Output {
    metrale_bytes(args, stdin.map(str::as_bytes))
}

fn metrale_bytes(args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args(args)
        .env_remove("METRALE_MODEL")
        .env("RUST_LOG", "warn")
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the metrale binary runs");
    if let (Some(bytes), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(bytes).expect("write stdin");
    }
    child.wait_with_output().expect("metrale finishes")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).expect("output is UTF-8")
}

#[test]
fn generate_streams_from_the_default_model_with_a_summary() {
    let out = metrale(
        &[
            "generate",
            "--max-tokens",
            "12",
            "--temperature",
            "0",
            "The capital of France is",
        ],
        None,
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "stderr: {stderr}");
    assert!(!stdout.trim().is_empty(), "no text generated");
    assert!(
        !stdout.contains("The capital of France"),
        "the prompt is not echoed: {stdout:?}"
    );
    for needle in [
        "prompt:",
        "generated: 12 tokens",
        "tokens/s",
        "time to first token",
        "finish: length",
    ] {
        assert!(
            stderr.contains(needle),
            "{needle:?} missing from {stderr:?}"
        );
    }
    // Greedy is deterministic.
    let again = metrale(
        &[
            "generate",
            "--max-tokens",
            "12",
            "--temperature",
            "0",
            "The capital of France is",
        ],
        None,
    );
    assert_eq!(text(&again.stdout), stdout);
}

#[test]
fn generate_takes_every_sampling_option() {
    let args = |seed: &str| {
        let mut a = vec![
            "generate",
            "--max-tokens",
            "20",
            "--temperature",
            "0.9",
            "--top-k",
            "40",
            "--top-p",
            "0.95",
        ];
        a.extend([
            "--min-p",
            "0.01",
            "--repetition-penalty",
            "1.1",
            "--seed",
            seed,
            "--stop",
            "zzz",
            "--stop",
            "qqq",
            "hello",
        ]);
        a.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    let run = |seed: &str| {
        let a = args(seed);
        let out = metrale(&a.iter().map(String::as_str).collect::<Vec<_>>(), None);
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    let a = run("7");
    assert_eq!(run("7"), a, "a seed makes sampling reproducible");
    assert_ne!(run("8"), a, "another seed, other text");
}

#[test]
fn generate_stops_before_a_stop_string() {
    let base = metrale(
        &[
            "generate",
            "--max-tokens",
            "40",
            "--temperature",
            "0",
            "Once upon a time",
        ],
        None,
    );
    let full = text(&base.stdout);
    let full = full.strip_suffix('\n').unwrap_or(&full).to_owned();
    // A stop string from the middle of the greedy output.
    let chars: Vec<char> = full.chars().collect();
    let plain = |c: &char| !c.is_whitespace() && *c != '\u{FFFD}';
    let at = (chars.len() / 2..chars.len() - 1)
        .find(|&i| plain(&chars[i]) && plain(&chars[i + 1]))
        .expect("two plain characters");
    let stop: String = chars[at..at + 2].iter().collect();
    let before = &full[..full.find(&stop).expect("stop string is in the text")];
    let out = metrale(
        &[
            "generate",
            "--max-tokens",
            "40",
            "--temperature",
            "0",
            "--stop",
            &stop,
            "Once upon a time",
        ],
        None,
    );
    assert!(out.status.success());
    assert_eq!(
        text(&out.stdout).trim_end_matches('\n'),
        before.trim_end_matches('\n')
    );
    assert!(
        text(&out.stderr).contains("finish: stop string"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn generate_uses_model_flag_and_env() {
    let out = metrale(
        &[
            "generate",
            "--model",
            fixture("llama").to_str().unwrap_or_default(),
            "--max-tokens",
            "4",
            "hi",
        ],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let env = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args(["generate", "--max-tokens", "4", "hi"])
        .env("METRALE_MODEL", fixture("does-not-exist"))
        .output()
        .expect("runs");
    assert!(!env.status.success());
    assert!(
        text(&env.stderr).contains("does-not-exist"),
        "{}",
        text(&env.stderr)
    );
}

#[test]
fn chat_reads_messages_from_stdin_until_eof() {
    let out = metrale(
        &[
            "chat",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
            "--system",
            "Be brief.",
        ],
        Some("hello\n\nhow are you?\n"),
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "stderr: {stderr}");
    assert_eq!(
        stderr.matches("time to first token").count(),
        2,
        "one summary per reply: {stderr}"
    );
    assert!(stdout.lines().count() >= 2, "two replies: {stdout:?}");
    assert!(
        !stdout.contains("<|im_start|>"),
        "the template is not echoed"
    );
}

#[test]
fn chat_ends_quietly_on_empty_input() {
    let out = metrale(&["chat"], Some(""));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(out.stdout.is_empty());
}

#[test]
fn help_and_errors_are_clear() {
    let help = metrale(&["generate", "--help"], None);
    let help = text(&help.stdout);
    assert!(
        help.contains("fortune quotations") && help.contains("--top-p") && help.contains("--stop"),
        "{help}"
    );
    let missing = metrale(&["generate", "--model", "/nonexistent/model", "hi"], None);
    assert!(!missing.status.success());
    assert!(
        text(&missing.stderr).contains("no model at /nonexistent/model"),
        "{}",
        text(&missing.stderr)
    );
    let bad = metrale(&["generate", "--top-p", "0", "hi"], None);
    assert!(!bad.status.success());
    assert!(text(&bad.stderr).contains("top_p"), "{}", text(&bad.stderr));
}

/// A copy of fixture `name` whose JSON files carry bare non-finite floats,
/// as Python's `json` writes them in published checkpoints.
fn with_bare_infinity(name: &str) -> PathBuf {
    let src = fixture(name);
    let dir = std::env::temp_dir().join(format!("metrale-bare-inf-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for entry in std::fs::read_dir(&src).expect("fixture") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), dir.join(entry.file_name())).expect("copy");
    }
    let config = std::fs::read_to_string(dir.join("config.json")).expect("config");
    let wrapped = "[\n    0.0,\n    {\n      \"__float__\": \"Infinity\"\n    }\n  ]";
    assert!(
        config.contains(wrapped),
        "fixture spells time_step_limit as expected"
    );
    let bare = config.replace(wrapped, "[0.0, Infinity]");
    std::fs::write(dir.join("config.json"), bare).expect("write config");
    for file in ["generation_config.json", "tokenizer_config.json"] {
        let text = std::fs::read_to_string(dir.join(file)).expect("read");
        let patched = text.replacen('{', "{\n  \"x_limit\": [-Infinity, NaN],", 1);
        std::fs::write(dir.join(file), patched).expect("write");
    }
    dir
}

#[test]
fn generate_and_chat_read_configs_with_bare_infinity() {
    for name in ["bamba", "granitemoehybrid", "mamba2"] {
        let dir = with_bare_infinity(name);
        let model = dir.to_str().expect("utf-8 path");
        let out = metrale(
            &[
                "generate",
                "--model",
                model,
                "--max-tokens",
                "3",
                "--temperature",
                "0",
                "Hello",
            ],
            None,
        );
        assert!(
            out.status.success(),
            "{name} generate: {}",
            text(&out.stderr)
        );
        let out = metrale(
            &["chat", "--model", model, "--max-tokens", "3"],
            Some("Hi\n"),
        );
        assert!(out.status.success(), "{name} chat: {}", text(&out.stderr));
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[test]
fn chat_reports_a_bad_line_and_goes_on() {
    // A line that is not UTF-8, a line longer than the whole context, then
    // a good one: two errors on stderr, one reply, and exit status 1 at the
    // end (a message got no reply).
    let long = "word ".repeat(3000);
    let mut input: Vec<u8> = b"caf\xe9 au lait\n".to_vec();
    input.extend_from_slice(long.as_bytes());
    input.extend_from_slice(b"\nHello there\n");
    let out = metrale_bytes(
        &["chat", "--max-tokens", "4", "--temperature", "0"],
        Some(&input),
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    assert!(stderr.contains("line 1 is not valid UTF-8"), "{stderr}");
    assert!(stderr.contains("error:"), "{stderr}");
    assert_eq!(
        stderr.matches("generated:").count(),
        1,
        "one reply, for the good line: {stderr}"
    );
    assert!(
        stderr.contains("error: 2 of 3 messages got no reply"),
        "{stderr}"
    );
}

#[test]
fn chat_exits_non_zero_when_every_turn_fails() {
    // Two messages longer than the whole context: each turn fails, the
    // session goes on to the next, and the exit status says so.
    let long = "word ".repeat(3000);
    let input = format!("{long}\n{long}\n");
    let out = metrale(
        &["chat", "--max-tokens", "4", "--temperature", "0"],
        Some(&input),
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    assert_eq!(stderr.matches("generated:").count(), 0, "{stderr}");
    assert!(
        stderr.contains("error: 2 of 2 messages got no reply"),
        "{stderr}"
    );
}

#[test]
fn generate_is_the_same_without_the_prefix_cache() {
    let run = |flags: &[&str]| {
        let mut args = vec!["generate", "--max-tokens", "16", "--temperature", "0", "-q"];
        args.extend_from_slice(flags);
        args.push("A fool and his money");
        let out = metrale(&args, None);
        assert!(out.status.success(), "{flags:?}: {}", text(&out.stderr));
        text(&out.stdout)
    };
    let cached = run(&[]);
    assert!(!cached.trim().is_empty());
    assert_eq!(run(&["--no-prefix-cache"]), cached);
    // An interval longer than the prompt and the answer: the flags are
    // taken and change nothing. (A shorter one moves where the SSD scan's
    // chunks end, which reorders its sums by a few 1e-7, and this tiny
    // model has greedy near-ties that such a change can flip.)
    assert_eq!(
        run(&["--snapshot-interval", "64", "--snapshot-budget", "1MiB"]),
        cached
    );
    // Documented in the help of each subcommand that runs a model.
    for sub in ["generate", "chat", "bench", "logits"] {
        let help = text(&metrale(&[sub, "--help"], None).stdout);
        for flag in [
            "--no-prefix-cache",
            "--snapshot-interval",
            "--snapshot-budget",
        ] {
            assert!(help.contains(flag), "{sub} --help lacks {flag}");
        }
    }
}

/// `--json-schema` and `--grammar` hold sampled output to the file's
/// schema or grammar on the default model; a file that does not compile is
/// an error naming it, before anything is generated.
#[test]
fn generate_holds_output_to_a_json_schema_or_grammar_file() {
    let dir = std::env::temp_dir().join(format!("metrale-structured-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let schema = dir.join("schema.json");
    std::fs::write(
        &schema,
        r#"{"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
            "count": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["colour", "count"], "additionalProperties": false}"#,
    )
    .unwrap();
    let grammar = dir.join("answer.lark");
    std::fs::write(
        &grammar,
        "start: (\"yes\" | \"no\") \" (\" /[0-9]{1,2}/ \"%)\"\n",
    )
    .unwrap();
    for seed in ["1", "2", "3"] {
        let args = ["generate", "--seed", seed, "--temperature", "1"];
        let out = metrale(
            &[
                &args[..],
                &["--json-schema", schema.to_str().unwrap(), "Pick:"],
            ]
            .concat(),
            None,
        );
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert!(out.status.success(), "stderr: {stderr}");
        let v: serde_json::Value = serde_json::from_str(stdout.trim())
            .unwrap_or_else(|e| panic!("{stdout:?} is not JSON: {e}"));
        assert!(
            ["red", "green", "blue"].contains(&v["colour"].as_str().unwrap()),
            "{v}"
        );
        assert!((1..=9).contains(&v["count"].as_i64().unwrap()), "{v}");
        assert!(stderr.contains("completed its grammar"), "{stderr}");
        let out = metrale(
            &[
                &args[..],
                &["--grammar", grammar.to_str().unwrap(), "Sure?"],
            ]
            .concat(),
            None,
        );
        let stdout = text(&out.stdout);
        let answer = stdout.trim();
        let (word, rest) = answer
            .split_once(" (")
            .unwrap_or_else(|| panic!("{answer:?}"));
        assert!(["yes", "no"].contains(&word), "{answer:?}");
        let digits = rest
            .strip_suffix("%)")
            .unwrap_or_else(|| panic!("{answer:?}"));
        assert!(
            (1..=2).contains(&digits.len()) && digits.bytes().all(|b| b.is_ascii_digit()),
            "{answer:?}"
        );
    }
    std::fs::write(&schema, r#"{"type": "object", "properties": 5}"#).unwrap();
    let out = metrale(
        &["generate", "--json-schema", schema.to_str().unwrap(), "x"],
        None,
    );
    let stderr = text(&out.stderr);
    assert!(!out.status.success() && out.stdout.is_empty(), "{stderr}");
    assert!(
        stderr.contains("schema.json") && stderr.contains("properties"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
