//! `cargo xtask gpu-check`: builds the GPU check's bundle (docs/GPU-CHECK.md)
//! on a machine without a GPU: the check program and the `metrale` binary
//! (x86-64, debug info stripped), the fixtures they need, the Llama bench
//! config and `run.sh`, as `OUT/gpu-check/` and `OUT/gpu-check.tar.gz`;
//! checks its contents and size (< 60 MB) and, where there is no GPU, that
//! the bundled program says so without panicking.
//!
//! The binaries come from `cargo test --workspace --no-run`: the very
//! build (test profile, the workspace's unified features, `cuda` among
//! them through the metrale-gpu-check package) that CI's `cargo test
//! --workspace` makes, so after the tests it compiles nothing.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};

/// The bundle's size limit, bytes (directory and archive alike).
const MAX_BYTES: u64 = 60 * 1000 * 1000;

/// The fixtures the check reads: the dense ones (conformance, parity,
/// generation, teardown), the hybrid and MoE ones (refused at load until
/// the backend runs their ops) and the shared tokenizer.
const FIXTURES: &[&str] = &[
    "llama",
    "qwen3",
    "mamba2",
    "bamba",
    "nemotron_h",
    "granitemoehybrid",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "lfm2",
    "lfm2_moe",
    "tokenizer",
];

/// The bench shapes `metrale bench` runs on the GPU (the check program finds
/// the second beside the first).
const BENCH_CONFIGS: [&str; 2] = [
    "benches/configs/llama-370m.json",
    "benches/configs/granite-4.0-h-350m.json",
];

#[derive(clap::Args)]
pub struct Args {
    /// Where to write `gpu-check/` and `gpu-check.tar.gz` (default: the
    /// cargo target directory).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Take the binaries as they are in the target directory (skip `cargo
    /// test --workspace --no-run`).
    #[arg(long)]
    no_build: bool,
}

pub fn run(root: &Path, args: Args) -> Result<()> {
    let target = target_dir(root)?;
    let out = args.out.map_or_else(|| target.clone(), |o| root.join(o));
    if !args.no_build {
        build(root)?;
    }
    let bins = target.join("debug");
    let bundle = out.join("gpu-check");
    assemble(root, &bins, &bundle)?;
    let archive = out.join("gpu-check.tar.gz");
    run_cmd(
        Command::new("tar")
            .arg("czf")
            .arg(&archive)
            .arg("-C")
            .arg(&out)
            .arg("gpu-check"),
    )?;
    verify(&bundle, &archive)?;
    println!(
        "\nOn the GPU machine (from the repository root there):\n  \
         tar xzf {} -C /tmp && /tmp/gpu-check/run.sh",
        archive.strip_prefix(root).unwrap_or(&archive).display()
    );
    Ok(())
}

/// Cargo's target directory: `CARGO_TARGET_DIR`, else what `cargo
/// metadata` says, else `target/`.
fn target_dir(root: &Path) -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        return Ok(root.join(dir));
    }
    let out = Command::new(cargo())
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .current_dir(root)
        .output()
        .context("cargo metadata")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let key = "\"target_directory\":\"";
    if let Some(start) = text.find(key).map(|i| i + key.len())
        && let Some(len) = text[start..].find('"')
    {
        return Ok(PathBuf::from(&text[start..start + len]));
    }
    Ok(root.join("target"))
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

/// The test build, which makes both binaries (each package has
/// integration tests that run its binary).
fn build(root: &Path) -> Result<()> {
    let mut cmd = Command::new(cargo());
    cmd.args(["test", "--workspace", "--no-run"])
        .current_dir(root);
    // The workspace's features are unified: the `tests` package turns on
    // `metrale/cuda` and this package `metrale-gpu-runtime/cuda`, so the
    // bundled `metrale` runs `--device cuda` with no second build.
    run_cmd(&mut cmd).context("building the test binaries")
}

fn assemble(root: &Path, bins: &Path, bundle: &Path) -> Result<()> {
    if bundle.exists() {
        std::fs::remove_dir_all(bundle).with_context(|| bundle.display().to_string())?;
    }
    std::fs::create_dir_all(bundle.join("bin"))?;
    for name in ["metrale-gpu-check", "metrale"] {
        let from = bins.join(name);
        ensure!(
            from.is_file(),
            "{} was not built (run `cargo test --workspace --no-run`)",
            from.display()
        );
        let to = bundle.join("bin").join(name);
        strip(&from, &to)?;
    }
    for name in FIXTURES {
        let from = root.join("tests/fixtures").join(name);
        let to = bundle.join("fixtures").join(name);
        std::fs::create_dir_all(&to)?;
        for entry in std::fs::read_dir(&from).with_context(|| from.display().to_string())? {
            let path = entry?.path();
            if path.is_file() {
                std::fs::copy(&path, to.join(path.file_name().context("file name")?))?;
            }
        }
    }
    std::fs::create_dir_all(bundle.join("bench"))?;
    for config in BENCH_CONFIGS {
        let name = Path::new(config).file_name().context("file name")?;
        std::fs::copy(root.join(config), bundle.join("bench").join(name))?;
    }
    let script = bundle.join("run.sh");
    std::fs::copy(root.join("crates/gpu-check/run.sh"), &script)?;
    set_executable(&script)?;
    std::fs::write(bundle.join("BUILD-INFO"), build_info(root))?;
    Ok(())
}

/// Copies `from` to `to` without debug info (symbols stay, for
/// backtraces): with `strip`, `objcopy`, their LLVM namesakes, or the
/// `rust-objcopy` every Rust toolchain ships.
fn strip(from: &Path, to: &Path) -> Result<()> {
    // (tool, the folder of its libLLVM where it needs one)
    let mut objcopies = vec![
        (PathBuf::from("objcopy"), None),
        (PathBuf::from("llvm-objcopy"), None),
    ];
    if let Ok(out) = Command::new("rustc").args(["--print", "sysroot"]).output() {
        let sysroot = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if let Ok(dirs) = std::fs::read_dir(sysroot.join("lib/rustlib")) {
            for d in dirs.flatten() {
                objcopies.push((d.path().join("bin/rust-objcopy"), Some(sysroot.join("lib"))));
            }
        }
    }
    let mut tried = Vec::new();
    for tool in ["strip", "llvm-strip"] {
        let ok = Command::new(tool)
            .arg("--strip-debug")
            .arg("-o")
            .arg(to)
            .arg(from)
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return set_executable(to);
        }
        tried.push(tool.to_string());
    }
    for (tool, libs) in objcopies {
        let mut cmd = Command::new(&tool);
        if let Some(libs) = libs {
            cmd.env("LD_LIBRARY_PATH", libs);
        }
        let ok = cmd
            .arg("--strip-debug")
            .arg(from)
            .arg(to)
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return set_executable(to);
        }
        tried.push(tool.display().to_string());
    }
    bail!(
        "could not strip the debug info of {} (tried {}); the bundle would be far over its \
         size limit",
        from.display(),
        tried.join(", ")
    )
}

fn set_executable(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

fn build_info(root: &Path) -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(root)
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    };
    let rustc = Command::new("rustc")
        .arg("-V")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let dirty = if git(&["status", "--porcelain", "--untracked-files=no"]).is_empty() {
        ""
    } else {
        " (with uncommitted changes)"
    };
    format!(
        "commit {}{dirty}: {}\nbranch {}\n{rustc}, test profile, features: metrale-gpu-runtime/cuda\n",
        git(&["rev-parse", "--short=12", "HEAD"]),
        git(&["log", "-1", "--format=%s"]),
        git(&["rev-parse", "--abbrev-ref", "HEAD"]),
    )
}

/// Every file under `dir` with its size, sorted.
fn files(dir: &Path) -> Result<Vec<(PathBuf, u64)>> {
    let mut all = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d)? {
            let entry = entry?;
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let size = entry.metadata()?.len();
                all.push((path.strip_prefix(dir)?.to_path_buf(), size));
            }
        }
    }
    all.sort();
    Ok(all)
}

fn mb(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

/// The contents and size, and the bundled program's behaviour here.
fn verify(bundle: &Path, archive: &Path) -> Result<()> {
    let all = files(bundle)?;
    let total: u64 = all.iter().map(|(_, s)| s).sum();
    let packed = std::fs::metadata(archive)?.len();
    println!("\n{}:", bundle.display());
    for (path, size) in &all {
        println!("  {:>10}  {}", size, path.display());
    }
    println!(
        "{} files, {} unpacked; {}: {}",
        all.len(),
        mb(total),
        archive.display(),
        mb(packed)
    );
    let has = |p: &str| all.iter().any(|(f, _)| f == Path::new(p));
    let mut expected = vec![
        "run.sh".to_string(),
        "BUILD-INFO".into(),
        "bin/metrale".into(),
        "bin/metrale-gpu-check".into(),
        "bench/llama-370m.json".into(),
        "bench/granite-4.0-h-350m.json".into(),
        "fixtures/tokenizer/tokenizer.json".into(),
    ];
    for f in FIXTURES.iter().filter(|f| **f != "tokenizer") {
        for file in [
            "config.json",
            "model.safetensors",
            "golden.safetensors",
            "tokenizer.json",
        ] {
            expected.push(format!("fixtures/{f}/{file}"));
        }
    }
    let missing: Vec<&String> = expected.iter().filter(|p| !has(p)).collect();
    ensure!(missing.is_empty(), "the bundle lacks {missing:?}");
    ensure!(
        total < MAX_BYTES && packed < MAX_BYTES,
        "the bundle is too big: {} unpacked, {} packed (limit {})",
        mb(total),
        mb(packed),
        mb(MAX_BYTES)
    );
    for bin in ["bin/metrale", "bin/metrale-gpu-check"] {
        let head = std::fs::read(bundle.join(bin))?;
        ensure!(
            head.len() > 20 && head[..4] == *b"\x7fELF" && head[4] == 2 && head[18] == 62,
            "{bin} is not an x86-64 ELF executable"
        );
    }
    // The script parses, and the program runs here.
    run_cmd(Command::new("bash").arg("-n").arg(bundle.join("run.sh")))?;
    let list = Command::new(bundle.join("bin/metrale-gpu-check"))
        .arg("--list")
        .output()
        .context("running the bundled metrale-gpu-check")?;
    ensure!(
        list.status.success(),
        "metrale-gpu-check --list failed: {}",
        String::from_utf8_lossy(&list.stderr)
    );
    // Without a GPU: a clear line, a failure, no panic.
    let out = Command::new(bundle.join("bin/metrale-gpu-check"))
        .args(["--only", "device", "--fixtures"])
        .arg(bundle.join("fixtures"))
        .env_remove("LD_LIBRARY_PATH")
        .output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if text.contains("PASS device") {
        println!("this machine has a GPU: {}", text.trim());
    } else {
        ensure!(
            !out.status.success() && text.contains("no CUDA driver") && !text.contains("panicked"),
            "without a GPU the bundled program must fail with a clear \"no CUDA driver\" line \
             and no panic; it printed:\n{text}"
        );
        println!("no GPU here; the bundled program says so: {}", text.trim());
    }
    println!(
        "bundle ok: {} files, {} ({} packed), under the {} limit",
        all.len(),
        mb(total),
        mb(packed),
        mb(MAX_BYTES)
    );
    if total >= MAX_BYTES || packed >= MAX_BYTES {
        bail!("over the limit");
    }
    Ok(())
}

fn run_cmd(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("starting {cmd:?}"))?;
    ensure!(status.success(), "{cmd:?} failed with {status}");
    Ok(())
}
