//! Developer tasks: `cargo xtask <task>`.

mod gpu_check;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "metrale developer tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Compile the CUDA C kernels in kernels/ to PTX with nvcc (kernels/ptx/).
    Ptx {
        /// The GPU architecture to target, e.g. sm_90.
        #[arg(long, default_value = "sm_80")]
        arch: String,
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
}

fn main() -> Result<()> {
    let root = workspace_root();
    match Cli::parse().task {
        Task::Ptx { arch } => ptx(&root, &arch),
        Task::Fixtures { out } => run(Command::new("python3")
            .arg(root.join("tests/fixtures/gen_fixtures.py"))
            .arg(root.join(out))
            .current_dir(&root)),
        Task::GpuCheck(args) => gpu_check::run(&root, args),
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

fn ptx(root: &Path, arch: &str) -> Result<()> {
    let dir = root.join("kernels");
    let sources: Vec<PathBuf> = std::fs::read_dir(&dir)
        .with_context(|| dir.display().to_string())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    if sources.is_empty() {
        println!("no CUDA sources in {}; nothing to build", dir.display());
        return Ok(());
    }
    let out = dir.join("ptx");
    std::fs::create_dir_all(&out)?;
    for src in sources {
        let stem = src
            .file_stem()
            .context("kernel file name")?
            .to_string_lossy()
            .into_owned();
        let target = out.join(format!("{stem}.ptx"));
        run(Command::new("nvcc")
            .args(["--ptx", "-O3", &format!("-arch={arch}"), "-o"])
            .arg(&target)
            .arg(&src))
        .with_context(|| format!("compiling {} (is nvcc on PATH?)", src.display()))?;
    }
    Ok(())
}

fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("starting {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed with {status}");
    }
    Ok(())
}
