//! `cargo xtask ptx [--check]`: `kernels/*.cu` to PTX with NVRTC, written
//! into `crates/gpu-runtime/ptx/` where the crate embeds it, and the typed
//! kernel table.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::kernel_sig::parse_kernels;
use crate::nvrtc::Nvrtc;
use crate::table::{self, Module};
use crate::tools;

pub const KERNELS_DIR: &str = "kernels";
/// Where the PTX goes: inside the crate that embeds it (`include_str!`
/// stays inside the package, so `cargo package` works).
pub const PTX_DIR: &str = "crates/gpu-runtime/ptx";
pub const TABLE: &str = "crates/gpu-runtime/src/cuda/kernels.rs";

/// NVRTC options besides `--include-path`.
const OPTIONS: [&str; 4] = [
    "--gpu-architecture=compute_80",
    "--std=c++17",
    "-default-device",
    "--fmad=true",
];

/// What the sources give: each module's PTX and the table.
struct Built {
    ptx: Vec<(String, String)>,
    table: String,
}

pub fn run(root: &Path, check: bool) -> Result<()> {
    let dir = root.join(KERNELS_DIR);
    let built = build(root, &dir)?;
    let out = root.join(PTX_DIR);
    let stale = stale_ptx(&out, &built)?;
    if check {
        return check_against(root, &out, &built, &stale);
    }
    std::fs::create_dir_all(&out).with_context(|| out.display().to_string())?;
    for (stem, ptx) in &built.ptx {
        let path = out.join(format!("{stem}.ptx"));
        let changed = write_if_changed(&path, ptx)?;
        let lines = ptx.lines().count();
        let what = if changed { "wrote" } else { "unchanged" };
        println!("{what} {} ({lines} lines)", rel(root, &path));
    }
    for path in &stale {
        std::fs::remove_file(path).with_context(|| path.display().to_string())?;
        eprintln!(
            "removed stale {} (no {KERNELS_DIR}/*.cu gives it)",
            rel(root, path)
        );
    }
    let table = root.join(TABLE);
    if let Some(parent) = table.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let changed = write_if_changed(&table, &built.table)?;
    println!("{} {TABLE}", if changed { "wrote" } else { "unchanged" });
    Ok(())
}

/// Compiles every source and renders the table, all in memory.
fn build(root: &Path, dir: &Path) -> Result<Built> {
    let sources = sources(dir)?;
    let mut modules = Vec::new();
    let mut texts = Vec::new();
    for src in &sources {
        let name = rel(root, src);
        let text = std::fs::read_to_string(src).with_context(|| name.clone())?;
        let kernels = parse_kernels(&name, &text)?;
        modules.push(Module {
            stem: stem(src)?,
            kernels,
        });
        texts.push((name, text));
    }
    let lib = tools::locate(root, &tools::NVRTC)?;
    let nvrtc = Nvrtc::load(&lib)?;
    let (major, minor) = nvrtc.version()?;
    println!("NVRTC {major}.{minor} ({})", rel(root, &nvrtc.path));
    let mut options: Vec<String> = OPTIONS.iter().map(|o| o.to_string()).collect();
    options.push(format!("--include-path={}", dir.display()));
    let mut ptx = Vec::new();
    for ((name, text), module) in texts.iter().zip(&modules) {
        let compiled = nvrtc
            .compile(name, text, &options)
            .with_context(|| format!("NVRTC failed to compile {name}"))?;
        if !compiled.log.trim().is_empty() {
            eprintln!("NVRTC warnings for {name}:\n{}", compiled.log.trim_end());
        }
        table::cross_check(name, &module.kernels, &compiled.ptx)?;
        println!("compiled {name}: {} kernel(s)", module.kernels.len());
        ptx.push((module.stem.clone(), compiled.ptx));
    }
    let table = table::rustfmt(root, &table::render(&modules)?)?;
    Ok(Built { ptx, table })
}

/// `*.cu` in `dir`, sorted by name; an error when there are none.
fn sources(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut found: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(rd) => rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "cu"))
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(e).with_context(|| dir.display().to_string()),
    };
    if found.is_empty() {
        bail!(
            "no CUDA sources: {} has no *.cu file; there is nothing to compile and the \
             kernel table would be empty",
            dir.display()
        );
    }
    found.sort();
    Ok(found)
}

/// `*.ptx` in `out` that no source gives.
fn stale_ptx(out: &Path, built: &Built) -> Result<Vec<PathBuf>> {
    let Ok(rd) = std::fs::read_dir(out) else {
        return Ok(Vec::new());
    };
    let mut stale: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "ptx"))
        .filter(|p| {
            let s = p.file_stem().map(|s| s.to_string_lossy().into_owned());
            !built.ptx.iter().any(|(stem, _)| Some(stem) == s.as_ref())
        })
        .collect();
    stale.sort();
    Ok(stale)
}

fn check_against(root: &Path, out: &Path, built: &Built, stale: &[PathBuf]) -> Result<()> {
    let mut problems = Vec::new();
    for (stem, ptx) in &built.ptx {
        let path = out.join(format!("{stem}.ptx"));
        match std::fs::read_to_string(&path) {
            Ok(committed) if committed == *ptx => {}
            Ok(_) => problems.push(format!(
                "{} differs from what {KERNELS_DIR}/{stem}.cu compiles to",
                rel(root, &path)
            )),
            Err(_) => problems.push(format!(
                "{KERNELS_DIR}/{stem}.cu has no PTX ({} is missing)",
                rel(root, &path)
            )),
        }
    }
    for path in stale {
        problems.push(format!("{} has no source", rel(root, path)));
    }
    match std::fs::read_to_string(root.join(TABLE)) {
        Ok(committed) if committed == built.table => {}
        Ok(_) => problems.push(format!("{TABLE} differs from what the sources give")),
        Err(_) => problems.push(format!("{TABLE} is missing")),
    }
    if !problems.is_empty() {
        bail!(
            "the committed PTX is stale:\n  {}\nrun `cargo xtask ptx` and commit the result",
            problems.join("\n  ")
        );
    }
    println!(
        "ptx --check: {} PTX file(s) and {TABLE} match the sources",
        built.ptx.len()
    );
    Ok(())
}

fn write_if_changed(path: &Path, text: &str) -> Result<bool> {
    if std::fs::read_to_string(path).is_ok_and(|old| old == text) {
        return Ok(false);
    }
    std::fs::write(path, text).with_context(|| path.display().to_string())?;
    Ok(true)
}

fn stem(path: &Path) -> Result<String> {
    let stem = path
        .file_stem()
        .context("kernel file name")?
        .to_string_lossy();
    if stem.is_empty() || !stem.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        bail!(
            "{}: a kernel file's stem must be ASCII letters, digits and `_`",
            path.display()
        );
    }
    Ok(stem.into_owned())
}

/// `path` relative to the workspace root, for messages.
pub fn rel(root: &Path, path: &Path) -> String {
    path.strip_prefix(root)
        .unwrap_or(path)
        .display()
        .to_string()
}
