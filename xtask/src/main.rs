//! Developer tasks: `cargo xtask <task>`.

mod features;
mod gpu_check;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

mod kernel_sig;
mod msrv;
mod nvrtc;
mod ptx;
mod ptxas;
mod table;
mod tools;

#[derive(Parser)]
#[command(name = "cargo xtask", about = "metrale developer tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Compile kernels/*.cu to PTX with NVRTC (from a pinned pip wheel)
    /// into crates/gpu-runtime/ptx/, and generate the typed kernel table
    /// crates/gpu-runtime/src/cuda/kernels.rs.
    Ptx {
        /// Write nothing; fail when the committed PTX or kernel table differs
        /// from what the sources give.
        #[arg(long)]
        check: bool,
    },
    /// Assemble every committed PTX file with ptxas (from a pinned pip wheel)
    /// for sm_80 and sm_90.
    Ptxas {
        /// Pass -v to ptxas (registers, shared memory, spills per kernel).
        #[arg(long, short)]
        verbose: bool,
    },
    /// Regenerate the golden fixtures with Hugging Face transformers
    /// (needs `pip install torch transformers safetensors tokenizers`).
    Fixtures {
        /// Where to write them.
        #[arg(long, default_value = "tests/fixtures")]
        out: PathBuf,
    },
    /// Run what CI runs: formatting check and the test suite.
    Ci,
    /// Build the GPU check's bundle (docs/GPU-CHECK.md).
    GpuCheck(gpu_check::Args),
    /// Check that `cargo run -p metrale` and `cargo test --workspace`
    /// resolve the same dependency features (crates/workspace-hack).
    Features,
    /// Check that the declared rust-version is no lower than any locked
    /// dependency's.
    Msrv,
}

fn main() -> std::process::ExitCode {
    // The error's chain without a backtrace: NVRTC's and ptxas's messages
    // are what matter here.
    match task(Cli::parse().task) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            for cause in e.chain().skip(1) {
                eprintln!("caused by: {cause}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}

fn task(task: Task) -> Result<()> {
    let root = workspace_root();
    match task {
        Task::Ptx { check } => ptx::run(&root, check),
        Task::Ptxas { verbose } => ptxas::run(&root, verbose),
        Task::Fixtures { out } => run(Command::new("python3")
            .arg(root.join("tests/fixtures/gen_fixtures.py"))
            .arg(root.join(out))
            .current_dir(&root)),
        Task::GpuCheck(args) => gpu_check::run(&root, args),
        Task::Features => features::run(&root),
        Task::Msrv => msrv::run(&root),
        Task::Ci => {
            run(Command::new("cargo")
                .args(["fmt", "--all", "--", "--check"])
                .current_dir(&root))?;
            run(Command::new("cargo")
                .args(["test", "--workspace"])
                .current_dir(&root))
        }
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("starting {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed with {status}");
    }
    Ok(())
}
