//! `cargo xtask ptxas`: assembles every committed PTX file for sm_80 and
//! sm_90 with the pinned ptxas, so PTX that NVRTC accepts but the assembler
//! rejects fails here rather than at module load on a GPU.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::ptx::{PTX_DIR, rel};
use crate::tools;

pub const ARCHS: [&str; 2] = ["sm_80", "sm_90"];

pub fn run(root: &Path, verbose: bool) -> Result<()> {
    let dir = root.join(PTX_DIR);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "ptx"))
                .collect()
        })
        .unwrap_or_default();
    if files.is_empty() {
        bail!(
            "no PTX to assemble: {} has no *.ptx file (run `cargo xtask ptx`)",
            dir.display()
        );
    }
    files.sort();
    let ptxas = tools::locate(root, &tools::PTXAS)?;
    let version = Command::new(&ptxas)
        .arg("--version")
        .output()
        .with_context(|| format!("running {}", ptxas.display()))?;
    let version = String::from_utf8_lossy(&version.stdout);
    let version = version
        .lines()
        .find(|l| l.contains("release"))
        .unwrap_or("version unknown");
    println!("ptxas: {version} ({})", rel(root, &ptxas));
    let tmp = std::env::temp_dir().join(format!("metrale-ptxas-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).with_context(|| tmp.display().to_string())?;
    let result = assemble_all(root, &ptxas, &files, &tmp, verbose);
    let _ = std::fs::remove_dir_all(&tmp);
    result
}

fn assemble_all(
    root: &Path,
    ptxas: &Path,
    files: &[PathBuf],
    tmp: &Path,
    verbose: bool,
) -> Result<()> {
    let mut failures = Vec::new();
    for file in files {
        let stem = file.file_stem().context("ptx name")?.to_string_lossy();
        for arch in ARCHS {
            let cubin = tmp.join(format!("{stem}.{arch}.cubin"));
            let mut cmd = Command::new(ptxas);
            cmd.current_dir(root);
            cmd.arg(format!("-arch={arch}")).arg("-o").arg(&cubin);
            if verbose {
                cmd.arg("-v");
            }
            let out = cmd
                .arg(file.strip_prefix(root).unwrap_or(file))
                .output()
                .with_context(|| format!("running {}", ptxas.display()))?;
            let msg = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            let name = rel(root, file);
            if !out.status.success() {
                eprintln!("ptxas -arch={arch} {name}: FAILED\n{}", msg.trim_end());
                failures.push(format!("{name} for {arch}"));
                continue;
            }
            let bytes = std::fs::metadata(&cubin).map(|m| m.len()).unwrap_or(0);
            println!("ptxas -arch={arch} {name}: ok ({bytes} bytes of cubin)");
            if !msg.trim().is_empty() {
                println!("{}", msg.trim_end());
            }
        }
    }
    if !failures.is_empty() {
        bail!(
            "ptxas rejected (messages above):\n  {}",
            failures.join("\n  ")
        );
    }
    Ok(())
}
