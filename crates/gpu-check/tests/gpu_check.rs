//! The GPU check without a GPU: the program fails clearly (no panic) where
//! there is no CUDA driver; every check passes with the CPU backend in the
//! device's place (so the checks themselves are right); `run.sh` finds the
//! CUDA libraries in a Python environment's tree.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const EXE: &str = env!("CARGO_BIN_EXE_metrale-gpu-check");

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixtures() -> PathBuf {
    repo().join("tests/fixtures")
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Whether this machine has a CUDA driver library the loader finds.
fn has_driver() -> bool {
    let out = Command::new(EXE)
        .args(["--only", "device", "--fixtures"])
        .arg(fixtures())
        .output()
        .unwrap();
    text(&out).0.contains("PASS device")
}

#[test]
fn without_a_gpu_it_fails_clearly_and_does_not_panic() {
    if has_driver() {
        eprintln!("this machine has a CUDA device; nothing to check here");
        return;
    }
    let out = Command::new(EXE)
        .args(["--no-bench", "--fixtures"])
        .arg(fixtures())
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    println!("{stdout}\n{stderr}");
    assert_eq!(out.status.code(), Some(1), "exit status");
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("FAIL device:") && l.contains("no CUDA driver")),
        "no clear no-driver line"
    );
    assert!(!stdout.contains("panicked") && !stderr.contains("panicked"));
    let summary = stdout.lines().last().unwrap();
    assert!(
        summary.starts_with("gpu-check: 0 passed, ") && summary.contains("device (none)"),
        "{summary}"
    );
    // Every check has its line.
    let listed = Command::new(EXE)
        .args(["--list", "--no-bench"])
        .output()
        .unwrap();
    for name in text(&listed).0.lines() {
        assert!(
            stdout.contains(&format!("FAIL {name}: ")),
            "no line for {name}"
        );
    }
}

/// The metrale binary beside this test's (built by the metrale package's
/// tests in a workspace test run).
fn metrale_bin() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let bin = exe.parent()?.parent()?.join("metrale");
    bin.is_file().then_some(bin)
}

#[test]
fn every_check_passes_with_the_cpu_in_the_devices_place() {
    let mut cmd = Command::new(EXE);
    cmd.args(["--backend", "cpu", "--fixtures"])
        .arg(fixtures())
        .args(["--budget-s", "600"]);
    // A small bench shape (the Llama 370M one is for the GPU).
    match metrale_bin() {
        Some(bin) => {
            cmd.arg("--metrale")
                .arg(bin)
                .arg("--bench-config")
                .arg(repo().join("benches/configs/tiny-hybrid.json"))
                .arg("--bench-hybrid-config")
                .arg(repo().join("benches/configs/tiny-hybrid.json"))
                .args(["--bench-batches", "1,2"])
                .args(["--bench-prompt", "16", "--bench-gen", "4"]);
        }
        None => {
            eprintln!("no metrale binary beside the tests: leaving the bench out");
            cmd.arg("--no-bench");
        }
    }
    let out = cmd.output().unwrap();
    let (stdout, stderr) = text(&out);
    println!("{stdout}\n{stderr}");
    assert!(out.status.success(), "a check failed on the CPU");
    assert!(!stdout.contains("\nFAIL "));
    let summary = stdout.lines().last().unwrap();
    assert!(summary.contains(" 0 failed, device cpu"), "{summary}");
    for line in stdout.lines().filter(|l| l.starts_with("PASS parity/")) {
        assert!(line.contains("against tol"), "{line}");
    }
    // The CPU lacks what the CUDA backend lacks: the conformance suite
    // reports those ops unsupported, and models needing them are refused.
    let unsupported = stdout
        .lines()
        .filter(|l| l.starts_with("UNSUPPORTED "))
        .count();
    let refused = stdout
        .lines()
        .filter(|l| l.starts_with("PASS refusal/") && l.contains(": refused, naming "))
        .count();
    // Since part 2 the CUDA backend has every op: nothing is unsupported,
    // nothing refused, and every fixture architecture's parity passed.
    assert_eq!((unsupported, refused), (0, 0), "unsupported / refused");
    let parity = stdout
        .lines()
        .filter(|l| l.starts_with("PASS parity/"))
        .count();
    assert_eq!(parity, 11, "parity of every fixture architecture");
}

#[test]
fn a_failing_check_does_not_stop_the_others() {
    // A fixture folder without the dense models: their checks fail, the
    // device check still passes, and the summary counts both.
    let dir = std::env::temp_dir().join(format!("gpu-check-empty-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = Command::new(EXE)
        .args([
            "--backend",
            "cpu",
            "--no-bench",
            "--budget-s",
            "120",
            "--fixtures",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    let (stdout, _) = text(&out);
    println!("{stdout}");
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout.contains("PASS device: "));
    assert!(stdout.contains("FAIL parity/llama: no fixture"));
    assert!(
        stdout
            .lines()
            .last()
            .unwrap()
            .starts_with("gpu-check: 1 passed, ")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A fake Python environment and driver folder for run.sh.
struct FakeTree {
    root: PathBuf,
}

impl FakeTree {
    fn new(tag: &str) -> Self {
        let root =
            std::env::temp_dir().join(format!("gpu-check-libs-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        FakeTree { root }
    }

    fn file(&self, rel: &str) -> PathBuf {
        let p = self.root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, b"").unwrap();
        p
    }

    /// run.sh --find-libs with this tree's python and driver folder.
    fn find_libs(&self) -> (i32, String) {
        let python = self.root.join("bin/python3");
        std::fs::create_dir_all(python.parent().unwrap()).unwrap();
        // A python that prints its site-packages, as run.sh asks.
        std::fs::write(
            &python,
            format!(
                "#!/bin/sh\ncat >/dev/null\necho {}\necho /nonexistent\n",
                self.root
                    .join("venv/lib/python3.12/site-packages")
                    .display()
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
        let out = Command::new("bash")
            .arg(repo().join("crates/gpu-check/run.sh"))
            .arg("--find-libs")
            .env("GPU_CHECK_PYTHON", &python)
            .env("GPU_CHECK_DRIVER_DIRS", self.root.join("driver"))
            .env("GPU_CHECK_NO_LDCONFIG", "1")
            .env_remove("LD_LIBRARY_PATH")
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        println!("{stdout}{stderr}");
        (out.status.code().unwrap_or(-1), stdout)
    }
}

impl Drop for FakeTree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

#[test]
fn run_sh_finds_the_cuda_libraries_in_the_python_environment() {
    let t = FakeTree::new("all");
    let sp = "venv/lib/python3.12/site-packages/nvidia";
    // CUDA 13 wheels put everything in nvidia/cu13/lib; older ones one
    // folder per library.
    t.file(&format!("{sp}/cu13/lib/libcublasLt.so.13"));
    t.file(&format!("{sp}/cu13/lib/libcublas.so.13"));
    t.file(&format!("{sp}/cuda_nvrtc/lib/libnvrtc.so.13"));
    t.file(&format!("{sp}/cuda_runtime/lib/libcudart.so.13"));
    // No library in it: not on the path.
    t.file(&format!("{sp}/cudnn/include/cudnn.h"));
    t.file(&format!("{sp}/empty/lib/README"));
    t.file("driver/libcuda.so.1");
    let (code, out) = t.find_libs();
    assert_eq!(code, 0, "{out}");
    let path = out
        .lines()
        .find_map(|l| l.strip_prefix("LD_LIBRARY_PATH="))
        .unwrap();
    let dirs: Vec<&str> = path.split(':').collect();
    let root = t.root.display().to_string();
    for want in [
        format!("{root}/{sp}/cu13/lib"),
        format!("{root}/{sp}/cuda_nvrtc/lib"),
        format!("{root}/{sp}/cuda_runtime/lib"),
        format!("{root}/driver"),
    ] {
        assert!(dirs.contains(&want.as_str()), "{want} not in {path}");
    }
    assert!(!path.contains("cudnn") && !path.contains("empty"), "{path}");
    for lib in [
        "libcuda.so.1",
        "libcublasLt.so.13",
        "libcublas.so.13",
        "libnvrtc.so.13",
        "libcudart.so.13",
    ] {
        assert!(out.contains(&format!("found   {lib}: ")), "{lib}: {out}");
    }
}

#[test]
fn run_sh_names_a_missing_library() {
    let t = FakeTree::new("missing");
    t.file("venv/lib/python3.12/site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so.13");
    let (code, out) = t.find_libs();
    assert_eq!(code, 3, "{out}");
    assert!(
        out.contains("MISSING libcublasLt.so.13 (required)"),
        "{out}"
    );
    assert!(out.contains("MISSING libcuda.so.1 (required)"), "{out}");
    assert!(out.contains("found   libnvrtc.so.13: "), "{out}");
}

#[test]
fn a_panic_an_abort_a_hang_and_an_error_are_each_one_failure() {
    let dir = std::env::temp_dir().join(format!("gpu-check-selftest-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let started = std::time::Instant::now();
    let out = Command::new(EXE)
        .args([
            "--backend",
            "cpu",
            "--no-bench",
            "--with-selftests",
            "--budget-s",
            "60",
        ])
        .arg("--fixtures")
        .arg(&dir)
        .output()
        .unwrap();
    let (stdout, _) = text(&out);
    println!("{stdout}");
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout.contains("FAIL selftest/panic: panicked: a planted panic at "));
    assert!(
        stdout
            .contains("FAIL selftest/abort: the check's process was killed by signal 6 (SIGABRT)")
    );
    assert!(stdout.contains("FAIL selftest/hang: timed out after 3 s (limit 3 s); killed"));
    assert!(stdout.contains("FAIL selftest/error: a planted error"));
    assert!(stdout.contains("PASS device: "));
    let summary = stdout.lines().last().unwrap();
    assert!(summary.starts_with("gpu-check: 1 passed, "), "{summary}");
    assert!(
        summary.contains("selftest/hang, selftest/error)"),
        "{summary}"
    );
    assert!(started.elapsed().as_secs() < 30);
    let _ = std::fs::remove_dir_all(&dir);
}
