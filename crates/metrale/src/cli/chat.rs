//! `metrale chat`: a conversation through the model's chat template. Reads
//! one user message per line from stdin until end of input (so it also runs
//! with stdin from a pipe or a file); streams each reply to stdout, one
//! summary line per reply to stderr.
//!
//! Ctrl-C while a reply is generated stops it (the request is cancelled and
//! its memory freed; the part already shown stays in the conversation) and
//! the session goes on; at the prompt of a terminal it says how to leave,
//! and with stdin that is not a terminal it ends the process. Ctrl-D (end
//! of input) or `/exit` leaves; `/reset` forgets the conversation, on a
//! terminal after a confirmation (`y`) read from the next line.
//!
//! A message that gets no reply (a line that is not UTF-8, or a turn that
//! fails, such as a message longer than the context) is reported on stderr
//! and the session goes on; at the end, the exit status is 1 if any message
//! got no reply, else 0 (a reply stopped with Ctrl-C counts as a reply), so
//! that a script feeding stdin sees the failure.

use std::io::{BufRead, IsTerminal, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result, bail};
use metrale::{ChatMessage, ChatTokens, Generator, StreamEvent};
use metrale_model_engine::chat::ChatTemplate;

use super::generate::{ModelArgs, SamplingArgs, summary};
use metrale::server::reply::{self, Piece, ReplyStream, Shape};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// A system message that starts the conversation.
    #[arg(long)]
    pub system: Option<String>,
    /// Sets the chat template's thinking switch (`enable_thinking`, as
    /// Qwen3 and Qwen3.5 templates read it): `off` asks for an answer
    /// without a reasoning block. Default: the template's own default.
    #[arg(long, value_enum, value_name = "on|off")]
    pub think: Option<Think>,
    /// Leaves the model's reasoning (`<think>…</think>`, where the chat
    /// template has it) out of the printed reply; by default it is shown
    /// before the answer, dimmed on a terminal. The conversation keeps it.
    #[arg(long)]
    pub hide_reasoning: bool,
    /// Prints each turn's rendered prompt (the chat template's output) to
    /// stderr before the reply.
    #[arg(long)]
    pub show_prompt: bool,
}

/// `--think`'s values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Think {
    On,
    Off,
}

impl Args {
    /// The template variables the flags set.
    fn template_vars(&self) -> Vec<(&'static str, serde_json::Value)> {
        self.think
            .map(|t| ("enable_thinking", serde_json::Value::Bool(t == Think::On)))
            .into_iter()
            .collect()
    }
}

pub fn run(args: Args) -> Result<()> {
    let mut generator = args.model.load()?;
    let result = chat(&mut generator, &args);
    let shutdown = generator.shutdown();
    result?;
    shutdown
}

/// Ctrl-C: while a reply is generated (`generating`), asks it to stop
/// (`stop`); otherwise, at a terminal's prompt, a hint, and without a
/// terminal, the end of the process (exit status 130, as a shell reports
/// SIGINT).
#[derive(Clone)]
struct Interrupt {
    generating: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl Interrupt {
    fn install(interactive: bool) -> Result<Self> {
        let this = Self {
            generating: Arc::new(AtomicBool::new(false)),
            stop: Arc::new(AtomicBool::new(false)),
        };
        let handler = this.clone();
        // ctrlc runs this on a thread of its own, not in the signal handler:
        // it may print and exit.
        ctrlc::set_handler(move || {
            if handler.generating.load(Ordering::SeqCst) {
                handler.stop.store(true, Ordering::SeqCst);
            } else if interactive {
                eprint!("\n(Ctrl-D or /exit leaves)\n> ");
            } else {
                std::process::exit(130);
            }
        })
        .context("installing the Ctrl-C handler")?;
        Ok(this)
    }

    /// Marks a reply as running (true) or done (false); clears a stop.
    fn generating(&self, on: bool) {
        self.stop.store(false, Ordering::SeqCst);
        self.generating.store(on, Ordering::SeqCst);
    }
}

fn chat(generator: &mut Generator, args: &Args) -> Result<()> {
    let template = generator.chat_template()?;
    if args.think.is_some() && !template.reads("enable_thinking") {
        eprintln!(
            "warning: --think: this model's chat template has no thinking switch \
             (`enable_thinking`); the flag changes nothing"
        );
    }
    let interactive = std::io::stdin().is_terminal();
    let interrupt = Interrupt::install(interactive)?;
    if interactive {
        eprintln!(
            "metrale chat with {} (Ctrl-C stops a reply; end with Ctrl-D or /exit; /reset starts over)",
            generator.dir().display()
        );
    }
    let start: Vec<ChatMessage> = args
        .system
        .iter()
        .map(|s| ChatMessage::new("system", s.as_str()))
        .collect();
    let mut messages = start.clone();
    // The ids the model saw, so that each turn prefills only what is new.
    let mut tokens = ChatTokens::new();
    let mut input = std::io::stdin().lock();
    let mut lines = Lines::default();
    loop {
        if interactive {
            eprint!("> ");
        }
        let Some(line) = lines.read(&mut input)? else {
            if interactive {
                // Ctrl-D leaves the shell's prompt on a line of its own.
                eprintln!();
            }
            break;
        };
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                // Asked on a terminal only: piped input's next line is a
                // message, not an answer.
                let answer = if interactive {
                    eprint!("forget the conversation? [y/N] ");
                    lines.read(&mut input)?
                } else {
                    Some("yes".to_string())
                };
                let yes = answer
                    .as_deref()
                    .is_some_and(|a| matches!(a.trim().to_ascii_lowercase().as_str(), "y" | "yes"));
                if yes {
                    messages = start.clone();
                    tokens.clear();
                    eprintln!("(the conversation starts over)");
                } else {
                    eprintln!("(the conversation goes on)");
                }
                if answer.is_none() {
                    break;
                }
                continue;
            }
            _ => {}
        }
        lines.messages += 1;
        messages.push(ChatMessage::new("user", line));
        interrupt.generating(true);
        let result = turn(
            generator,
            &template,
            &mut messages,
            &mut tokens,
            args,
            &interrupt,
        );
        interrupt.generating(false);
        match result {
            Ok(reply) => messages.push(ChatMessage::new("assistant", reply)),
            Err(e) if is_broken_pipe(&e) => return Err(e),
            Err(e) => {
                // The message is dropped again, so the next turn starts from
                // a conversation the model could answer.
                eprintln!("error: {}", super::format_error(&e));
                lines.failed += 1;
                messages.pop();
                tokens.clear();
            }
        }
    }
    if lines.failed > 0 {
        bail!(
            "{} of {} messages got no reply (see the errors above)",
            lines.failed,
            lines.messages
        );
    }
    Ok(())
}

/// The lines of input read so far, and what became of them.
#[derive(Default)]
struct Lines {
    /// Lines read, for error messages.
    number: usize,
    /// Messages: lines sent to the model, and lines skipped as not UTF-8.
    messages: usize,
    /// Messages that got no reply.
    failed: usize,
}

impl Lines {
    /// The next line of input without its line ending; `None` at the end
    /// of input. A line that is not UTF-8 is reported and skipped, as a
    /// message that failed.
    fn read(&mut self, input: &mut impl BufRead) -> Result<Option<String>> {
        let mut raw = Vec::new();
        loop {
            raw.clear();
            self.number += 1;
            if input.read_until(b'\n', &mut raw)? == 0 {
                return Ok(None);
            }
            match std::str::from_utf8(&raw) {
                Ok(text) => return Ok(Some(text.trim_end_matches(['\n', '\r']).to_string())),
                Err(e) => {
                    eprintln!("line {} is not valid UTF-8 ({e}); skipped", self.number);
                    self.messages += 1;
                    self.failed += 1;
                }
            }
        }
    }
}

/// Whether `e` is a write to a closed stdout: the session cannot go on.
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// One reply: renders the conversation (dropping its oldest turns if it no
/// longer fits the context), streams the answer until it ends or Ctrl-C
/// stops it, returns its text (what was shown, when stopped). `tokens`
/// holds the ids of the conversation so far and gets the reply's.
fn turn(
    generator: &mut Generator,
    template: &ChatTemplate,
    messages: &mut Vec<ChatMessage>,
    tokens: &mut ChatTokens,
    args: &Args,
    interrupt: &Interrupt,
) -> Result<String> {
    let limit = generator.engine().context_limit();
    let vars = args.template_vars();
    let mut render = generator.chat_text_with(template, messages, &vars)?;
    let mut ids = tokens.prompt(generator.tokenizer(), &render)?;
    while ids.len() >= limit && drop_oldest_turn(messages) {
        render = generator.chat_text_with(template, messages, &vars)?;
        ids = tokens.prompt(generator.tokenizer(), &render)?;
    }
    if args.show_prompt {
        eprintln!("--- prompt ---\n{}\n--- end of prompt ---", render.text());
    }
    let params = args.sampling.params(generator, ids.len())?;
    let hits_before = generator.engine().stats().prefix_hit_tokens;
    let mut out = std::io::stdout().lock();
    let mut shown = Shown::new(template, render.text(), args);
    let mut text = String::new();
    let mut generated = Vec::new();
    let mut finished = None;
    {
        // Stopped, the stream ends between two engine steps (also between
        // the chunks of a long prompt's prefill) and cancels the request.
        let stream = generator
            .stream_ids(ids, &params)?
            .stop_when(&interrupt.stop);
        for event in stream {
            match event? {
                // Never asked for by chat.
                StreamEvent::PromptLogprobs { .. } => {}
                StreamEvent::Token {
                    token, text: delta, ..
                } => {
                    generated.push(token);
                    shown.write(&mut out, &delta, false)?;
                    text.push_str(&delta);
                }
                StreamEvent::Finished {
                    reason, timings, ..
                } => {
                    finished = Some((reason, timings));
                    break;
                }
            }
        }
    }
    shown.write(&mut out, "", true)?;
    writeln!(out)?;
    out.flush()?;
    match finished {
        Some((reason, timings)) => {
            if !super::quiet() {
                eprintln!("{}", summary(&timings, &reason));
            }
            let reused = (generator.engine().stats().prefix_hit_tokens).saturating_sub(hits_before);
            tracing::info!(
                "prefix cache: reused {reused} of {} prompt tokens",
                timings.prompt_tokens
            );
            tokens.push_reply(&text, &generated, &reason);
        }
        None => {
            eprintln!("[stopped]");
            // What was shown stays in the conversation, but the ids fed
            // stop anywhere: the next prompt is tokenized whole.
            tokens.clear();
        }
    }
    Ok(text)
}

/// How a reply is printed: its reasoning split out (where the template
/// has reasoning and `--think off` did not turn it off) and dimmed on a
/// terminal, or left out with `--hide-reasoning`; the answer as it comes.
struct Shown {
    reader: Option<ReplyStream>,
    hide: bool,
    dim: bool,
    /// Whether the last thing printed was reasoning.
    in_reasoning: bool,
}

const DIM: &str = "\x1b[2m";
const RESET: &str = "\x1b[0m";

impl Shown {
    fn new(template: &ChatTemplate, prompt: &str, args: &Args) -> Self {
        let reasons = reply::template_reasons(template.source()) && args.think != Some(Think::Off);
        let shape = Shape {
            reasoning: Some(reply::prompt_opens_reasoning(prompt)),
            tools: None,
        };
        Self {
            reader: reasons.then(|| ReplyStream::new(&shape)),
            hide: args.hide_reasoning,
            dim: std::io::stdout().is_terminal(),
            in_reasoning: false,
        }
    }

    /// Prints `delta` (and, at the `end`, what the reader held back).
    fn write(&mut self, out: &mut impl Write, delta: &str, end: bool) -> Result<()> {
        let Some(reader) = &mut self.reader else {
            out.write_all(delta.as_bytes())
                .context("writing to stdout")?;
            return out.flush().context("writing to stdout");
        };
        let mut pieces = reader.push(delta);
        if end {
            pieces.extend(reader.finish());
        }
        for piece in pieces {
            match piece {
                Piece::Reasoning(t) if !self.hide => {
                    if !self.in_reasoning && self.dim {
                        out.write_all(DIM.as_bytes())?;
                    }
                    self.in_reasoning = true;
                    out.write_all(t.as_bytes())?;
                }
                Piece::Content(t) => {
                    if self.in_reasoning {
                        out.write_all(if self.dim { RESET } else { "" }.as_bytes())?;
                        out.write_all(b"\n\n")?;
                        self.in_reasoning = false;
                    }
                    out.write_all(t.as_bytes())?;
                }
                _ => {}
            }
        }
        if end && self.in_reasoning && self.dim {
            out.write_all(RESET.as_bytes())?;
        }
        out.flush().context("writing to stdout")
    }
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
