//! The `metrale` command line.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cli;

#[derive(Parser)]
#[command(
    name = "metrale",
    version = env!("METRALE_BUILD_VERSION"),
    about = "LLM inference for hybrid transformer / state-space models"
)]
struct Cli {
    /// Log more to stderr: -v info (the device chosen, ...), -vv debug,
    /// -vvv trace (default: warnings, or what RUST_LOG says).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    /// Only errors on stderr: no progress bar, no summary lines, no warnings.
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    quiet: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Describe a model directory: type, layer plan, sizes, what fits in memory.
    Inspect(cli::inspect::Args),
    /// Run a model over token ids and write its logits (the parity interface).
    Logits(cli::logits::Args),
    /// Measure prefill and decode throughput, time to first token and peak memory.
    Bench(cli::bench::Args),
    /// Write the random-weight model of a config.json as a checkpoint (for comparisons).
    #[command(hide = true)]
    ExportRandom(cli::bench::ExportArgs),
    /// Generate a continuation of a prompt, streamed to stdout. Without --model: the bundled
    /// default model, a tiny hybrid trained on Debian's fortune quotations.
    Generate(cli::generate::Args),
    /// Chat through the model's chat template, one user message per line of stdin. Without
    /// --model: the bundled default model, a tiny hybrid trained on Debian's fortune
    /// quotations (it answers each line with a quotation-like text of its own).
    ///
    /// A message that gets no reply (a line that is not UTF-8, a turn that fails) is reported
    /// and the session goes on; the exit status is then 1 at the end, else 0 (a reply stopped
    /// with Ctrl-C counts as a reply).
    Chat(cli::chat::Args),
    /// Serve the model over an OpenAI-compatible HTTP API (`metrale serve --help` lists its
    /// options).
    Serve(cli::serve::Args),
    /// Write a GGUF file llama.cpp loads (f32/f16/bf16, or quantized: q8_0, q4_k_m, ...) from a
    /// checkpoint directory or a float GGUF file.
    Quantize(cli::quantize::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The server sets up its own logging, from its flags and these.
    if !matches!(cli.command, Command::Serve(_)) {
        cli::init_tracing(cli.verbose, cli.quiet);
    }
    let result = match cli.command {
        Command::Inspect(args) => cli::inspect::run(args),
        Command::Logits(args) => cli::logits::run(args),
        Command::Bench(args) => cli::bench::run(args),
        Command::ExportRandom(args) => cli::bench::export_random(args),
        Command::Generate(args) => cli::generate::run(args),
        Command::Chat(args) => cli::chat::run(args),
        Command::Serve(args) => cli::serve::run(args, cli.verbose, cli.quiet),
        Command::Quantize(args) => cli::quantize::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One message, never a backtrace (whatever RUST_BACKTRACE says).
            eprintln!("error: {}", cli::format_error(&e));
            ExitCode::FAILURE
        }
    }
}
