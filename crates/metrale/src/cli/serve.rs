//! `metrale serve`: the OpenAI-compatible HTTP server of the library's
//! `server` module, in this process, with the arguments after `serve`
//! (`metrale-serve` of the metrale-server package runs the same).

use anyhow::Result;

#[derive(clap::Args, Debug)]
#[command(disable_help_flag = true)]
pub struct Args {
    /// The server's arguments: [-m DIR|ORG/NAME] [--revision REV] [--host 127.0.0.1] [--port
    /// 8000] [--api-key KEY] [--served-model-name NAME] [--device DEVICE]
    /// [-t N] [--memory-limit SIZE] [--kv-dtype auto|f32|bf16|f16]
    /// [--ctx-size N] [--dtype auto|f32|bf16] [--quant TYPE] [--max-seqs N] [--max-waiting N]
    /// [--no-prefix-cache] [--snapshot-interval N] [--snapshot-budget SIZE]
    /// [--max-request-tokens N] [--max-response-bytes SIZE]
    /// [--max-queued-prompt-bytes SIZE] [--max-body-bytes SIZE] [--max-connections N]
    /// [--header-timeout S] [--body-timeout S] [--write-timeout S] [--shutdown-timeout S]
    /// [--allowed-hosts HOSTS] (`metrale serve --help` lists them).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<String>,
}

/// Runs the server with the arguments after `serve`, and `metrale`'s own
/// `-v` / `-q` (given before `serve`) passed on.
pub fn run(args: Args, verbose: u8, quiet: bool) -> Result<()> {
    // The server's own command line: its exit status is this process's (a
    // usage error exits inside, as clap does).
    let global = (0..verbose)
        .map(|_| "-v".to_string())
        .chain(quiet.then(|| "-q".to_string()));
    let argv = std::iter::once("metrale serve".to_string())
        .chain(global)
        .chain(args.args);
    let status = metrale::server::cli::main(argv);
    if status == std::process::ExitCode::SUCCESS {
        Ok(())
    } else {
        std::process::exit(1)
    }
}
