//! The `metrale` command line.

use anyhow::Result;
use clap::{Parser, Subcommand};

mod cli;

#[derive(Parser)]
#[command(name = "metrale", version, about = "LLM inference for hybrid transformer / state-space models")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Describe a model directory: type, layer plan, sizes, what fits in memory.
    Inspect(cli::inspect::Args),
    /// Run a model over token ids and write its logits (the parity interface).
    Logits(cli::logits::Args),
    /// Generate a continuation of a prompt, streamed to stdout. Without --model: the bundled
    /// default model, whose weights are random (its text is gibberish).
    Generate(cli::generate::Args),
    /// Chat through the model's chat template, one user message per line of stdin. Without
    /// --model: the bundled default model, whose weights are random (its text is gibberish).
    Chat(cli::chat::Args),
}

fn main() -> Result<()> {
    cli::init_tracing();
    match Cli::parse().command {
        Command::Inspect(args) => cli::inspect::run(args),
        Command::Logits(args) => cli::logits::run(args),
        Command::Generate(args) => cli::generate::run(args),
        Command::Chat(args) => cli::chat::run(args),
    }
}
