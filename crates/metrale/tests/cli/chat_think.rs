//! `metrale chat --think on|off` sets the chat template's thinking switch:
//! the qwen3_5 fixture with Qwen3.5's published template
//! (`tests/fixtures/templates`) renders its assistant turn with and
//! without the empty thinking block (`--show-prompt` prints what was
//! rendered); a template without the switch gets a warning.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn fixtures() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures"))
}

/// The qwen3_5 fixture in a scratch folder, its chat template Qwen3.5's.
fn qwen3_5_with_its_template(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("metrale-think-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ] {
        std::fs::copy(fixtures().join("qwen3_5").join(f), dir.join(f)).unwrap();
    }
    let template = std::fs::read_to_string(fixtures().join("templates/qwen3_5.jinja")).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("qwen3_5/tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    config["chat_template"] = serde_json::Value::String(template);
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    dir
}

/// One turn of `metrale chat` on `model`, its rendered prompt shown.
fn chat(model: &Path, args: &[&str]) -> Output {
    run_chat(model, &[&["-n", "1", "--show-prompt"], args].concat())
}

/// `metrale chat -m model ARGS` answering "What is 2+2?".
fn run_chat(model: &Path, args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .arg("chat")
        .args(["-m", model.to_str().unwrap()])
        .args(args)
        .env_remove("METRALE_MODEL")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the metrale binary runs");
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"What is 2+2?\n").unwrap();
    drop(stdin);
    child.wait_with_output().expect("metrale finishes")
}

/// The rendered prompt `--show-prompt` printed.
fn prompt(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let start = stderr.find("--- prompt ---\n").expect("a prompt") + "--- prompt ---\n".len();
    let end = stderr.find("\n--- end of prompt ---").expect("its end");
    stderr[start..end].to_string()
}

#[test]
fn think_on_and_off_render_qwen3_5_s_template() {
    let model = qwen3_5_with_its_template("render");
    let turn = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n";
    let off = prompt(&chat(&model, &["--think", "off"]));
    assert_eq!(off, format!("{turn}<think>\n\n</think>\n\n"));
    let on = prompt(&chat(&model, &["--think", "on"]));
    assert_eq!(on, format!("{turn}<think>\n"));
    // The template's own default is to think.
    assert_eq!(prompt(&chat(&model, &[])), on);
    std::fs::remove_dir_all(&model).unwrap();
}

#[test]
fn think_with_a_template_without_the_switch_warns() {
    let out = chat(&fixtures().join("llama"), &["--think", "off"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--think: this model's chat template has no thinking switch"),
        "{stderr}"
    );
}

/// The reply's reasoning is printed (dimmed only on a terminal) unless
/// `--hide-reasoning`; a grammar holds the random model's reply to
/// `<reasoning></think>\n\n<answer>` after the prompt's open `<think>`.
#[test]
fn hide_reasoning_leaves_the_reasoning_out() {
    let model = qwen3_5_with_its_template("hide");
    let grammar = model.join("reply.lark");
    std::fs::write(
        &grammar,
        "start: \"pondering\" \"</think>\" \"\\n\\nfour\"\n",
    )
    .unwrap();
    let run = |extra: &[&str]| {
        let grammar = ["--grammar", grammar.to_str().unwrap()];
        let out = run_chat(
            &model,
            &[&["-n", "64", "--think", "on"], &grammar[..], extra].concat(),
        );
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{stderr}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let shown = run(&[]);
    assert!(
        shown.contains("pondering") && shown.contains("four"),
        "{shown:?}"
    );
    assert!(
        !shown.contains('\u{1b}'),
        "no colour off a terminal: {shown:?}"
    );
    let hidden = run(&["--hide-reasoning"]);
    assert!(
        !hidden.contains("pondering") && hidden.contains("four"),
        "{hidden:?}"
    );
    std::fs::remove_dir_all(&model).unwrap();
}
