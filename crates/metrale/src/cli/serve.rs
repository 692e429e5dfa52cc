//! `metrale serve`: runs `metrale-serve`, the OpenAI-compatible HTTP server
//! of the `metrale-server` crate, with the same arguments.
//!
//! The server is its own binary because `metrale-server` depends on this
//! package's library: this package depending on it back would be a cycle
//! between packages, which Cargo refuses. `cargo build` of the workspace
//! builds both binaries side by side; `metrale serve` looks for
//! `metrale-serve` next to its own executable, then on `PATH`.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result};

const SERVER: &str = "metrale-serve";

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

fn server_path() -> PathBuf {
    let name = format!("{SERVER}{}", std::env::consts::EXE_SUFFIX);
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join(&name)))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from(name))
}

pub fn run(args: Args) -> Result<()> {
    let path = server_path();
    let mut command = Command::new(&path);
    command.args(&args.args);
    #[cfg(unix)]
    {
        // The server takes this process's place (and its signals: SIGINT
        // and SIGTERM shut it down gracefully).
        use std::os::unix::process::CommandExt;
        let e = command.exec();
        Err::<(), _>(e).with_context(|| not_found(&path))
    }
    #[cfg(not(unix))]
    {
        let status = command.status().with_context(|| not_found(&path))?;
        std::process::exit(status.code().unwrap_or(1));
    }
}

fn not_found(path: &std::path::Path) -> String {
    format!(
        "running {} (build it with `cargo build -p metrale-server`, or put {SERVER} on PATH)",
        path.display()
    )
}
