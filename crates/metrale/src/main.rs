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
}

fn main() -> Result<()> {
    cli::init_tracing();
    match Cli::parse().command {
        Command::Inspect(args) => cli::inspect::run(args),
        Command::Logits(args) => cli::logits::run(args),
    }
}
