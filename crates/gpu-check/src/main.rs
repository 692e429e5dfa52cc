//! `metrale-gpu-check`: the one-command check of the CUDA backend on a
//! machine with a GPU and no Rust toolchain (see docs/GPU-CHECK.md).
//!
//! It prints one line per check, `PASS name: detail` or `FAIL name:
//! detail` (and `UNSUPPORTED op` for op families the backend says it
//! lacks), indented detail lines, and a summary line
//! `gpu-check: N passed, M failed, device NAME, S s`; it exits 1 when any
//! check failed (2 on bad arguments).
//!
//! By default every check runs in a child process of its own (this binary
//! with `--only NAME`) under a time limit, so a crash or a hang in one
//! (a segfault in a driver, a kernel that never ends) is reported as that
//! check's failure and the others still run; within a child, a panic is
//! caught and reported the same way. The whole run stays inside
//! `--budget-s` (270 s by default).
//!
//! `--backend cpu` (hidden) runs the same checks with the CPU backend in
//! the device's place, configured as the CUDA backend computes (bf16
//! weights, bf16 activations into the GEMMs, a bf16 KV cache): it shows
//! that the checks pass on a correct backend, and measures the bf16 error
//! the tolerances must allow.

mod checks;
mod runner;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// Which backend plays the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Cuda,
    Cpu,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cuda => "cuda",
            BackendKind::Cpu => "cpu",
        }
    }
}

/// The command line.
#[derive(Clone, Debug)]
pub struct Args {
    pub fixtures: PathBuf,
    pub bench_config: Option<PathBuf>,
    /// The hybrid bench shape (Granite-4.0-H-350M's).
    pub bench_hybrid_config: Option<PathBuf>,
    /// The batch sizes each bench shape runs at.
    pub bench_batches: Vec<usize>,
    pub metrale: PathBuf,
    pub backend: BackendKind,
    pub budget: Duration,
    pub only: Option<String>,
    pub in_process: bool,
    pub no_bench: bool,
    pub selftests: bool,
    pub bench_prompt: usize,
    pub bench_gen: usize,
}

const USAGE: &str = "\
usage: metrale-gpu-check [--fixtures DIR] [--bench-config FILE] [--metrale PATH]
                         [--budget-s SECONDS] [--only CHECK] [--in-process] [--list]

Runs the CUDA backend's checks on device 0: conformance, golden parity of the
dense fixtures, refusal of models needing ops the backend lacks, generation
through the engine, teardown, and `metrale bench`. One line per check, a
summary line; exit status 1 when a check failed.

  --fixtures DIR       the fixture models (default: ../fixtures beside this binary)
  --bench-config FILE  the dense shape `metrale bench` runs (default: ../bench/llama-370m.json)
  --bench-hybrid-config FILE
                       the hybrid shape (default: ../bench/granite-4.0-h-350m.json)
  --bench-batches LIST each shape's batch sizes, with CUDA graphs and without (default: 1,64)
  --metrale PATH       the metrale binary (default: metrale beside this binary)
  --budget-s SECONDS   the whole run's time limit (default 270)
  --only CHECK         run one check, in this process
  --in-process         run every check in this process (no crash isolation)
  --list               print the checks' names";

fn parse_args() -> Result<Option<Args>, String> {
    let exe_dir = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("."));
    let mut args = Args {
        fixtures: exe_dir.join("../fixtures"),
        bench_config: Some(exe_dir.join("../bench/llama-370m.json")),
        bench_hybrid_config: Some(exe_dir.join("../bench/granite-4.0-h-350m.json")),
        bench_batches: vec![1, 64],
        metrale: exe_dir.join("metrale"),
        backend: BackendKind::Cuda,
        budget: Duration::from_secs(270),
        only: None,
        in_process: false,
        no_bench: false,
        selftests: false,
        bench_prompt: 128,
        bench_gen: 32,
    };
    let mut list = false;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))
        };
        match flag.as_str() {
            "--fixtures" => args.fixtures = PathBuf::from(value()?),
            "--bench-config" => args.bench_config = Some(PathBuf::from(value()?)),
            "--bench-hybrid-config" => args.bench_hybrid_config = Some(PathBuf::from(value()?)),
            "--bench-batches" => {
                let v = value()?;
                args.bench_batches = v
                    .split(',')
                    .map(|b| b.trim().parse().ok().filter(|&b: &usize| b > 0))
                    .collect::<Option<Vec<usize>>>()
                    .ok_or_else(|| format!("--bench-batches {v}: batch sizes, e.g. 1,64"))?;
            }
            "--metrale" => args.metrale = PathBuf::from(value()?),
            "--budget-s" => {
                let v = value()?;
                let s: f64 = v
                    .parse()
                    .map_err(|_| format!("--budget-s {v}: not a number"))?;
                args.budget = Duration::from_secs_f64(s.max(1.0));
            }
            "--only" => args.only = Some(value()?),
            "--in-process" => args.in_process = true,
            // Hidden: the CPU backend in the device's place.
            "--backend" => {
                args.backend = match value()?.as_str() {
                    "cuda" => BackendKind::Cuda,
                    "cpu" => BackendKind::Cpu,
                    other => return Err(format!("--backend {other}: cuda or cpu")),
                }
            }
            // Hidden: leave `metrale bench` out (CI's dry run).
            "--no-bench" => args.no_bench = true,
            // Hidden: add checks that fail on purpose (the runner's test).
            "--with-selftests" => args.selftests = true,
            "--bench-prompt" => {
                args.bench_prompt = value()?.parse().map_err(|_| "--bench-prompt: a number")?
            }
            "--bench-gen" => {
                args.bench_gen = value()?.parse().map_err(|_| "--bench-gen: a number")?
            }
            "--list" => list = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(None);
            }
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    if list {
        for c in checks::names(&args) {
            println!("{c}");
        }
        return Ok(None);
    }
    Ok(Some(args))
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(Some(args)) => args,
        Ok(None) => return ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("metrale-gpu-check: {e}");
            return ExitCode::from(2);
        }
    };
    runner::install_panic_hook();
    let ok = match &args.only {
        Some(name) => runner::run_one_here(&args, name),
        None if args.in_process => runner::run_all_here(&args),
        None => runner::run_all_isolated(&args),
    };
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
