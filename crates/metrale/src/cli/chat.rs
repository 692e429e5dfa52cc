//! `metrale chat`: a conversation through the model's chat template. Reads
//! one user message per line from stdin until end of input (so it also runs
//! with stdin from a pipe or a file); streams each reply to stdout, one
//! summary line per reply to stderr.

use std::io::{BufRead, IsTerminal, Write};

use anyhow::Result;
use metrale::{ChatMessage, Generator};
use metrale_model_engine::chat::ChatTemplate;

use super::generate::{ModelArgs, SamplingArgs, stream_to, summary};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// A system message that starts the conversation.
    #[arg(long)]
    pub system: Option<String>,
}

pub fn run(args: Args) -> Result<()> {
    let mut generator = args.model.load()?;
    let result = chat(&mut generator, &args);
    let shutdown = generator.shutdown();
    result?;
    shutdown
}

fn chat(generator: &mut Generator, args: &Args) -> Result<()> {
    let template = generator.chat_template()?;
    let interactive = std::io::stdin().is_terminal();
    if interactive {
        eprintln!(
            "metrale chat with {} (end with Ctrl-D or /exit; /reset starts over)",
            generator.dir().display()
        );
    }
    let start: Vec<ChatMessage> = args
        .system
        .iter()
        .map(|s| ChatMessage::new("system", s.as_str()))
        .collect();
    let mut messages = start.clone();
    let mut input = std::io::stdin().lock();
    let mut raw = Vec::new();
    for number in 1.. {
        if interactive {
            eprint!("> ");
        }
        raw.clear();
        if input.read_until(b'\n', &mut raw)? == 0 {
            break;
        }
        // A bad line is reported and the session goes on.
        let line = match std::str::from_utf8(&raw) {
            Ok(text) => text.trim_end_matches(['\n', '\r']).to_string(),
            Err(e) => {
                eprintln!("line {number} is not valid UTF-8 ({e}); skipped");
                continue;
            }
        };
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages = start.clone();
                continue;
            }
            _ => {}
        }
        messages.push(ChatMessage::new("user", line));
        match turn(generator, &template, &mut messages, args) {
            Ok(reply) => messages.push(ChatMessage::new("assistant", reply)),
            Err(e) if is_broken_pipe(&e) => return Err(e),
            Err(e) => {
                // The message is dropped again, so the next turn starts from
                // a conversation the model could answer.
                eprintln!("error: {e:#}");
                messages.pop();
            }
        }
    }
    Ok(())
}

/// Whether `e` is a write to a closed stdout: the session cannot go on.
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// One reply: renders the conversation (dropping its oldest turns if it no
/// longer fits the context), streams the answer, returns its text.
fn turn(
    generator: &mut Generator,
    template: &ChatTemplate,
    messages: &mut Vec<ChatMessage>,
    args: &Args,
) -> Result<String> {
    let limit = generator.engine().context_limit();
    let mut ids = generator.chat_prompt(template, messages)?;
    while ids.len() >= limit && drop_oldest_turn(messages) {
        ids = generator.chat_prompt(template, messages)?;
    }
    let params = args.sampling.params(generator, ids.len())?;
    let mut out = std::io::stdout().lock();
    let (text, finish, timings) = stream_to(generator, ids, &params, &mut out)?;
    writeln!(out)?;
    out.flush()?;
    eprintln!("{}", summary(&timings, &finish));
    Ok(text)
}

/// Removes the oldest message after any system message, keeping the last
/// one (the new user message). Returns whether one was removed.
fn drop_oldest_turn(messages: &mut Vec<ChatMessage>) -> bool {
    let first = messages.iter().position(|m| m.role != "system");
    match first {
        Some(i) if i + 1 < messages.len() => {
            messages.remove(i);
            true
        }
        _ => false,
    }
}
