//! Running a test's body in a child process with a bounded address space
//! and a deadline: an input that makes the code under test allocate
//! without bound aborts the child (not the machine, not the test runner),
//! and one that makes it loop is killed; either fails the test.
//!
//! The child is this test binary run again for the one test, with
//! [`CHILD_ENV`] set to its name; it limits its own address space
//! (`RLIMIT_AS`) before running the body.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Set in the child to the name of the test it runs.
pub const CHILD_ENV: &str = "METRALE_LIMITED_CHILD";

/// The child's address space: room for the test binary, its threads and
/// what a legitimate parse of a small file needs, far below what a
/// block-count-sized allocation asks.
pub const ADDRESS_SPACE: u64 = 2 << 30;

/// Runs `body` for the test `name` (its function's name) in a limited
/// child; fails when the child fails, is killed by a signal (an aborted
/// allocation), or outlives `deadline`.
pub fn run_limited(name: &str, deadline: Duration, body: impl FnOnce()) {
    // libtest runs each test on a thread named by its path in the binary
    // (`module::name`), which `--exact` takes.
    let thread = std::thread::current();
    let name = thread.name().filter(|n| n.ends_with(name)).unwrap_or(name);
    if std::env::var(CHILD_ENV).as_deref() == Ok(name) {
        limit_address_space(ADDRESS_SPACE);
        body();
        return;
    }
    let log = log_path(name);
    let out = std::fs::File::create(&log).expect("the child's log file");
    let err = out.try_clone().expect("the child's log file");
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut child = Command::new(exe)
        .args([name, "--exact", "--test-threads=1", "--nocapture"])
        .env(CHILD_ENV, name)
        // glibc reserves 64 MiB of address space per malloc arena.
        .env("MALLOC_ARENA_MAX", "2")
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .expect("the test binary runs again");
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for the child") {
            break Some(status);
        }
        if start.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    let tail: String = {
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    };
    match status {
        None => panic!("{name}: still running after {deadline:?}; its output ended with:\n{tail}"),
        Some(s) if !s.success() => {
            panic!("{name}: the limited child ended with {s}; its output ended with:\n{tail}")
        }
        Some(_) => {}
    }
    assert!(
        text.contains("1 passed"),
        "{name}: the child ran no test:\n{tail}"
    );
}

fn log_path(name: &str) -> PathBuf {
    let safe: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    std::env::temp_dir().join(format!("metrale-limited-{}-{safe}.log", std::process::id()))
}

#[cfg(target_os = "linux")]
fn limit_address_space(bytes: u64) {
    let limit = libc::rlimit {
        rlim_cur: bytes,
        rlim_max: bytes,
    };
    // SAFETY: setrlimit only reads the struct passed by reference.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) };
    assert_eq!(
        rc,
        0,
        "setrlimit(RLIMIT_AS): {}",
        std::io::Error::last_os_error()
    );
}

/// Elsewhere the child still runs under the deadline, without the limit.
#[cfg(not(target_os = "linux"))]
fn limit_address_space(_bytes: u64) {}
