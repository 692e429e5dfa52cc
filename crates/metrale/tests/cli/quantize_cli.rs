//! `metrale quantize`: writes a file metrale itself then runs, prints a
//! summary, and fails cleanly (one message naming the file and the tensor,
//! no partial output) on bad input. What the files hold is checked against
//! llama.cpp in crates/model-engine/tests/engine/gguf_export.rs.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn metrale(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args(args)
        .output()
        .expect("running metrale")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn quantize_writes_a_file_metrale_runs() {
    let dir = std::env::temp_dir().join(format!("metrale-quantize-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let input = fixture("gguf-bf16/llama.gguf");
    let out = dir.join("llama-q8.gguf");
    let o = metrale(&[
        "quantize",
        input.to_str().unwrap(),
        out.to_str().unwrap(),
        "--type",
        "q8_0",
    ]);
    let err = text(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("wrote") && err.contains("Q8_0") && err.contains("tensors"),
        "{err}"
    );
    let g = metrale(&[
        "generate",
        "--model",
        out.to_str().unwrap(),
        "--threads",
        "2",
        "--temperature",
        "0",
        "-n",
        "4",
        "--ignore-eos",
        "Hello",
    ]);
    assert!(g.status.success(), "{}", text(&g.stderr));
    assert!(!text(&g.stdout).is_empty());

    // -q: nothing on stderr.
    let o = metrale(&[
        "-q",
        "quantize",
        input.to_str().unwrap(),
        out.to_str().unwrap(),
        "--type",
        "bf16",
    ]);
    assert!(
        o.status.success() && o.stderr.is_empty(),
        "{}",
        text(&o.stderr)
    );

    // Bad arguments and input: one error line each, no output file.
    let bad = dir.join("bad.gguf");
    let q4 = fixture("gguf/llama/Q4_0.gguf");
    let cases: [(&[&str], &str); 3] = [
        (
            &[
                input.to_str().unwrap(),
                bad.to_str().unwrap(),
                "--type",
                "q3_k",
            ],
            "unknown type \"q3_k\"",
        ),
        (
            &[
                "/nonexistent/model",
                bad.to_str().unwrap(),
                "--type",
                "q8_0",
            ],
            "/nonexistent/model: no such file or directory",
        ),
        (
            &[
                q4.to_str().unwrap(),
                bad.to_str().unwrap(),
                "--type",
                "q8_0",
            ],
            "Q4_0.gguf: tensor \"output.weight\" is already quantized (q6_K)",
        ),
    ];
    for (args, expected) in cases {
        let mut a = vec!["quantize"];
        a.extend_from_slice(args);
        let o = metrale(&a);
        let err = text(&o.stderr);
        assert!(!o.status.success(), "{a:?}");
        assert!(err.contains(expected), "{a:?}: {err}");
        assert!(
            !err.contains("panicked") && !err.contains("backtrace"),
            "{err}"
        );
        assert!(!bad.exists(), "{a:?}");
    }
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["llama-q8.gguf"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A fresh empty directory for one test.
fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("metrale-quantize-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Whether this process runs with `signal` ignored (inherited, as `nohup`
/// ignores SIGHUP): a child inherits that too.
#[cfg(unix)]
fn ignored(signal: i32) -> bool {
    // SAFETY: sigaction with a null new action only reads the current
    // one into `old`, a zeroed plain C struct it fully writes.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(signal, std::ptr::null(), &mut old) == 0
            && old.sa_sigaction == libc::SIG_IGN
    }
}

/// SIGINT, SIGTERM, SIGHUP and SIGQUIT mid-write: the temporary file goes,
/// OUT is not written, and the exit status is 128 + the signal's number.
/// The test hook METRALE_TEST_QUANTIZE_PAUSE_MS keeps the write going long
/// enough to be interrupted. A signal this test runs with ignored (SIGHUP
/// under `nohup`) is ignored by the child too, as documented: the write
/// then completes.
#[cfg(unix)]
#[test]
fn a_terminating_signal_removes_the_temporary_file() {
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let input = fixture("gguf-bf16/llama.gguf");
    for (signal, number) in [("INT", 2), ("TERM", 15), ("HUP", 1), ("QUIT", 3)] {
        let dir = scratch(&format!("signal-{signal}"));
        let out = dir.join("out.gguf");
        let child = Command::new(env!("CARGO_BIN_EXE_metrale"))
            .args(["quantize", input.to_str().unwrap(), out.to_str().unwrap()])
            .args(["--type", "q8_0"])
            .env("METRALE_TEST_QUANTIZE_PAUSE_MS", "200")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("running metrale");
        let tmp = dir.join(format!(".out.gguf.tmp-{}", child.id()));
        let deadline = Instant::now() + Duration::from_secs(60);
        while !tmp.exists() {
            assert!(Instant::now() < deadline, "SIG{signal}: no {tmp:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
        let kill = Command::new("kill")
            .args([format!("-{signal}"), child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(kill.success());
        let o = child.wait_with_output().unwrap();
        if ignored(number) {
            assert_eq!(o.status.code(), Some(0), "SIG{signal} ignored");
            assert_eq!(names(&dir), ["out.gguf"], "SIG{signal} ignored");
            let _ = std::fs::remove_dir_all(&dir);
            continue;
        }
        assert_eq!(
            o.status.code(),
            Some(128 + number),
            "SIG{signal}: {:?} {}",
            o.status,
            text(&o.stderr)
        );
        assert!(names(&dir).is_empty(), "SIG{signal}: {:?}", names(&dir));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// OUT must be absent or a regular file: a symlink (dangling or not), a
/// FIFO, a device node or a directory is refused before anything is
/// written, naming the path and what it is.
#[cfg(unix)]
#[test]
fn out_that_is_not_a_regular_file_is_refused() {
    use std::os::unix::fs::FileTypeExt;
    let input = fixture("gguf-bf16/llama.gguf");
    let dir = scratch("not-regular");
    let target = dir.join("target.gguf");
    std::fs::write(&target, "keep me").unwrap();
    let link = dir.join("link.gguf");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let dangling = dir.join("dangling.gguf");
    std::os::unix::fs::symlink(dir.join("nowhere"), &dangling).unwrap();
    let fifo = dir.join("fifo.gguf");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let subdir = dir.join("sub.gguf");
    std::fs::create_dir(&subdir).unwrap();
    let mut cases = vec![
        (link.clone(), "is a symbolic link"),
        (dangling.clone(), "is a symbolic link"),
        (fifo.clone(), "is a FIFO"),
        (subdir.clone(), "is a directory"),
    ];
    // A device node of our own (/dev/null's numbers), where mknod is
    // allowed (root); never a real one under /dev.
    let device = dir.join("null.gguf");
    let mknod = Command::new("mknod")
        .args([device.to_str().unwrap(), "c", "1", "3"])
        .stderr(std::process::Stdio::null())
        .status();
    if mknod.is_ok_and(|s| s.success()) {
        cases.push((device.clone(), "is a character device"));
    }
    let before = names(&dir);
    for (out, what) in &cases {
        let o = metrale(&[
            "quantize",
            input.to_str().unwrap(),
            out.to_str().unwrap(),
            "--type",
            "q8_0",
        ]);
        let err = text(&o.stderr);
        assert!(!o.status.success(), "{out:?}: {err}");
        assert!(
            err.contains(out.to_str().unwrap()) && err.contains(what),
            "{out:?}: {err}"
        );
        assert_eq!(names(&dir), before, "{out:?}: nothing written");
    }
    assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
    assert!(
        std::fs::symlink_metadata(&fifo)
            .unwrap()
            .file_type()
            .is_fifo()
    );
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep me");
    let _ = std::fs::remove_dir_all(&dir);
}
