//! The CUDA tools xtask uses, from pinned pip wheels (no CUDA toolkit needed):
//! NVRTC from `nvidia-cuda-nvrtc-cu12` and ptxas from `nvidia-cuda-nvcc-cu12`,
//! each installed on first use under `<workspace>/target/cuda-tools/`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// A pinned wheel and the file xtask needs from it.
pub struct Wheel {
    pub package: &'static str,
    pub version: &'static str,
    /// Folder under `target/cuda-tools/`.
    pub dir: &'static str,
    /// Where the wheel puts the file, relative to the install folder.
    pub file: &'static str,
    /// An environment variable that may name the file instead.
    pub env: &'static str,
}

/// NVRTC 12.4: PTX ISA 8.4, which drivers from CUDA 12.4 on load.
pub const NVRTC: Wheel = Wheel {
    package: "nvidia-cuda-nvrtc-cu12",
    version: "12.4.127",
    dir: "nvrtc-12.4.127",
    file: "nvidia/cuda_nvrtc/lib/libnvrtc.so.12",
    env: "METRALE_NVRTC_LIB",
};

/// ptxas 12.4, matching NVRTC's PTX ISA.
pub const PTXAS: Wheel = Wheel {
    package: "nvidia-cuda-nvcc-cu12",
    version: "12.4.131",
    dir: "nvcc-12.4.131",
    file: "nvidia/cuda_nvcc/bin/ptxas",
    env: "METRALE_PTXAS",
};

/// The tool's path: the environment variable's when set, else the pinned
/// wheel's file, installing the wheel first when it is absent.
pub fn locate(root: &Path, wheel: &Wheel) -> Result<PathBuf> {
    if let Some(path) = std::env::var_os(wheel.env).filter(|v| !v.is_empty()) {
        let path = PathBuf::from(path);
        if !path.is_file() {
            bail!("{}={} is not a file", wheel.env, path.display());
        }
        return Ok(path);
    }
    let tools = root.join("target/cuda-tools");
    let dir = tools.join(wheel.dir);
    let file = dir.join(wheel.file);
    if !file.is_file() {
        install(&tools, &dir, wheel)?;
    }
    let file = if file.is_file() {
        file
    } else {
        // The wheel's layout changed: look for the file by name.
        let name = Path::new(wheel.file)
            .file_name()
            .context("tool file name")?;
        find_file(&dir, name).with_context(|| {
            format!(
                "{}=={} installed in {} has no {}",
                wheel.package,
                wheel.version,
                dir.display(),
                name.to_string_lossy()
            )
        })?
    };
    make_executable_if_bin(&file)?;
    Ok(file)
}

/// `pip install --target` into a fresh folder, renamed into place only once
/// complete, so an interrupted install is never taken for a finished one.
fn install(tools: &Path, dir: &Path, wheel: &Wheel) -> Result<()> {
    let spec = format!("{}=={}", wheel.package, wheel.version);
    eprintln!("xtask: installing {spec} into {}", dir.display());
    std::fs::create_dir_all(tools).with_context(|| tools.display().to_string())?;
    let partial = tools.join(format!("{}.partial-{}", wheel.dir, std::process::id()));
    let _ = std::fs::remove_dir_all(&partial);
    let status = Command::new("python3")
        .args(["-m", "pip", "install", "--quiet", "--no-deps"])
        .args([
            "--disable-pip-version-check",
            "--only-binary=:all:",
            "--target",
        ])
        .arg(&partial)
        .arg(&spec)
        .env("PIP_ROOT_USER_ACTION", "ignore")
        .status()
        .context(
            "starting `python3 -m pip` (python3 with pip is needed to fetch the CUDA tools)",
        )?;
    if !status.success() {
        let _ = std::fs::remove_dir_all(&partial);
        bail!(
            "`python3 -m pip install {spec}` failed ({status}); it needs network access to \
             PyPI, or set {} to an existing file",
            wheel.env
        );
    }
    let _ = std::fs::remove_dir_all(dir);
    std::fs::rename(&partial, dir)
        .with_context(|| format!("moving {} to {}", partial.display(), dir.display()))
}

fn find_file(dir: &Path, name: &std::ffi::OsStr) -> Option<PathBuf> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            if let Some(found) = find_file(&path, name) {
                return Some(found);
            }
        } else if path.file_name() == Some(name) {
            return Some(path);
        }
    }
    None
}

/// Wheels do not always keep the executable bit: restore it on binaries.
fn make_executable_if_bin(file: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let in_bin = file
        .parent()
        .and_then(Path::file_name)
        .is_some_and(|d| d == "bin");
    if !in_bin {
        return Ok(());
    }
    let meta = std::fs::metadata(file).with_context(|| file.display().to_string())?;
    let mut perm = meta.permissions();
    if perm.mode() & 0o111 != 0o111 {
        perm.set_mode(perm.mode() | 0o755);
        std::fs::set_permissions(file, perm).with_context(|| file.display().to_string())?;
    }
    Ok(())
}
