//! A chat keeps the token ids the model saw ([`ChatTokens`]), so the prefix
//! cache serves every earlier turn: turn N prefills only the new text, on
//! the bundled default model (a hybrid: its recurrent state comes back from
//! the snapshot taken where the previous request ended).

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use metrale::{
    ChatMessage, ChatTokens, EngineConfig, Finish, Generator, LoadOptions, SamplingParams,
};

fn default_model() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/default"))
}

fn load() -> Generator {
    let options = LoadOptions {
        device: metrale::Device::Cpu,
        threads: 2,
        ..LoadOptions::default()
    };
    Generator::load(
        &default_model(),
        &options,
        EngineConfig::default(),
        &mut |_| {},
    )
    .expect("the default model loads")
}

#[test]
fn each_turn_reuses_all_that_the_previous_turn_fed() {
    let mut g = load();
    let template = g.chat_template().unwrap();
    let params = SamplingParams {
        // Enough that the quotations end with EOS (they do, greedy); the
        // CLI test below ends its replies by length.
        max_tokens: Some(40),
        ..SamplingParams::greedy()
    };
    let mut messages = vec![ChatMessage::new("system", "Quotations.")];
    let mut tokens = ChatTokens::new();
    // (prompt length, generated tokens) of the previous turn.
    let mut previous: Option<(usize, usize)> = None;
    for line in ["A penny saved", "What is life?", "Tell me more."] {
        messages.push(ChatMessage::new("user", line));
        let kept = tokens.ids().to_vec();
        let render = g.chat_text(&template, &messages).unwrap();
        let ids = tokens.prompt(g.tokenizer(), &render).unwrap();
        assert!(ids.starts_with(&kept), "the kept ids lead the prompt");
        let hits = g.engine().stats().prefix_hit_tokens;
        let reply = g.generate_ids(ids.clone(), &params).unwrap();
        let reused = (g.engine().stats().prefix_hit_tokens - hits) as usize;
        match previous {
            // The last generated token was never fed: its logits are the
            // end of the request.
            Some((prompt, generated)) => assert_eq!(reused, prompt + generated - 1, "{line}"),
            None => assert_eq!(reused, 0),
        }
        assert!(matches!(
            reply.finish_reason,
            Finish::Length | Finish::Eos(_)
        ));
        tokens.push_reply(&reply.text, &reply.tokens, &reply.finish_reason);
        messages.push(ChatMessage::new("assistant", reply.text.clone()));
        previous = Some((ids.len(), reply.tokens.len()));
    }
    g.shutdown().unwrap();
}

#[test]
fn a_render_that_does_not_continue_the_kept_text_is_tokenized_whole() {
    let g = load();
    let template = g.chat_template().unwrap();
    let mut tokens = ChatTokens::new();
    let first = [ChatMessage::new("user", "Hello there")];
    let ids = tokens
        .prompt(g.tokenizer(), &g.chat_text(&template, &first).unwrap())
        .unwrap();
    assert_eq!(ids, g.chat_prompt(&template, &first).unwrap());
    tokens.push_reply(" and goodbye", &[1, 2, 3], &Finish::Length);
    assert_eq!(&tokens.ids()[ids.len()..], &[1, 2, 3]);
    // The conversation after a dropped turn: a different start.
    let other = [ChatMessage::new("user", "Something else")];
    let whole = g.chat_prompt(&template, &other).unwrap();
    let render = g.chat_text(&template, &other).unwrap();
    assert_eq!(tokens.prompt(g.tokenizer(), &render).unwrap(), whole);
    // An end-of-sequence id is left out: the template renders its own.
    tokens.push_reply("x", &[5, 9], &Finish::Eos(9));
    assert_eq!(&tokens.ids()[whole.len()..], &[5]);
    // A stop string cut the reply: nothing is kept.
    tokens.push_reply("x", &[7], &Finish::StopString("y".into()));
    assert!(tokens.ids().is_empty());
    g.shutdown().unwrap();
}

/// `metrale chat -v` says after each reply how many prompt tokens the
/// prefix cache reused: from the second turn on, all the previous turn fed.
#[test]
fn chat_verbose_reports_the_reused_tokens() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args(["chat", "-v", "-s", "1", "--temperature", "0", "-n", "6"])
        .args(["-m", default_model().to_str().unwrap()])
        .env_remove("METRALE_MODEL")
        .env_remove("RUST_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the metrale binary runs");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"A penny saved\nWhat is life?\nTell me more.\n")
        .unwrap();
    let out = child.wait_with_output().expect("metrale finishes");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // "prompt: P tokens, ... | generated: G tokens, ..."
    let counts: Vec<(usize, usize)> = stderr
        .lines()
        .filter_map(|l| l.strip_prefix("prompt: "))
        .map(|rest| {
            let number = |s: &str| s.split_whitespace().next().unwrap().parse().unwrap();
            let generated = rest.split("generated: ").nth(1).unwrap();
            (number(rest), number(generated))
        })
        .collect();
    let reused: Vec<usize> = stderr
        .lines()
        .filter_map(|l| l.split("prefix cache: reused ").nth(1))
        .map(|rest| rest.split_whitespace().next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(counts.len(), 3, "{stderr}");
    assert_eq!(reused.len(), 3, "{stderr}");
    assert_eq!(reused[0], 0, "{stderr}");
    for turn in 1..3 {
        let (prompt, generated) = counts[turn - 1];
        assert_eq!(reused[turn], prompt + generated - 1, "{stderr}");
    }
}
