//! Running the checks: each guarded (a panic or an error is that check's
//! `FAIL`), in this process or each in a child process under a time limit,
//! within the run's budget; the summary line.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::Args;
use crate::checks;

/// The last panic's message and place, for the `FAIL` line.
static LAST_PANIC: Mutex<Option<String>> = Mutex::new(None);

/// Records each panic's message (the default hook still prints it, with
/// the backtrace hint, on stderr).
pub fn install_panic_hook() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let place = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        let text = if let Some(s) = info.payload().downcast_ref::<&str>() {
            (*s).to_string()
        } else if let Some(s) = info.payload().downcast_ref::<String>() {
            s.clone()
        } else {
            "(non-string panic payload)".to_string()
        };
        if let Ok(mut last) = LAST_PANIC.lock() {
            *last = Some(format!("{text}{place}"));
        }
        default(info);
    }));
}

/// One-line text of an error chain.
pub fn one_line(e: &anyhow::Error) -> String {
    // Each cause once (an error whose text already ends with its source's
    // is not followed by the source again).
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if parts.last().is_some_and(|p| p.ends_with(&text)) {
            continue;
        }
        parts.push(text);
    }
    parts.join(": ").replace('\n', " | ")
}

fn result_line(pass: bool, name: &str, detail: &str) {
    let word = if pass { "PASS" } else { "FAIL" };
    println!("{word} {name}: {}", detail.replace('\n', " | "));
}

/// Runs check `name` here, guarded; prints its result line; whether it
/// passed.
pub fn run_one_here(args: &Args, name: &str) -> bool {
    let started = Instant::now();
    if let Ok(mut last) = LAST_PANIC.lock() {
        *last = None;
    }
    let outcome = catch_unwind(AssertUnwindSafe(|| checks::run(args, name)));
    let secs = started.elapsed().as_secs_f64();
    match outcome {
        Ok(Ok(detail)) => {
            result_line(true, name, &format!("{detail} [{secs:.2} s]"));
            true
        }
        Ok(Err(e)) => {
            result_line(false, name, &format!("{} [{secs:.2} s]", one_line(&e)));
            false
        }
        Err(_) => {
            let why = LAST_PANIC
                .lock()
                .ok()
                .and_then(|l| l.clone())
                .unwrap_or_else(|| "unknown".into());
            result_line(false, name, &format!("panicked: {why} [{secs:.2} s]"));
            false
        }
    }
}

/// What the run found so far.
#[derive(Default)]
struct Tally {
    passed: usize,
    failed: usize,
    device: Option<String>,
    failed_names: Vec<String>,
}

impl Tally {
    fn count(&mut self, name: &str, pass: bool) {
        if pass {
            self.passed += 1;
        } else {
            self.failed += 1;
            self.failed_names.push(name.to_string());
        }
    }

    fn summary(&self, started: Instant) -> String {
        let mut line = format!(
            "gpu-check: {} passed, {} failed, device {}, {:.1} s",
            self.passed,
            self.failed,
            self.device.as_deref().unwrap_or("(none)"),
            started.elapsed().as_secs_f64()
        );
        if !self.failed_names.is_empty() {
            line.push_str(&format!(" (failed: {})", self.failed_names.join(", ")));
        }
        line
    }
}

/// Whether a check needs the device open (all but `device` itself).
fn needs_device(name: &str) -> bool {
    name != "device"
}

/// Every check in this process, one after another, under a watchdog that
/// ends the run with a summary when the budget is spent.
pub fn run_all_here(args: &Args) -> bool {
    let started = Instant::now();
    let names = checks::names(args);
    let tally = std::sync::Arc::new(Mutex::new(Tally::default()));
    let current = std::sync::Arc::new(Mutex::new(String::new()));
    let done = std::sync::Arc::new(AtomicBool::new(false));
    {
        let (tally, current, done, budget) =
            (tally.clone(), current.clone(), done.clone(), args.budget);
        std::thread::spawn(move || {
            while started.elapsed() < budget {
                if done.load(Ordering::SeqCst) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            if done.load(Ordering::SeqCst) {
                return;
            }
            let name = current.lock().map(|c| c.clone()).unwrap_or_default();
            result_line(
                false,
                &name,
                &format!(
                    "still running when the time budget of {:.0} s ran out",
                    budget.as_secs_f64()
                ),
            );
            if let Ok(mut t) = tally.lock() {
                t.count(&name, false);
                println!("{}", t.summary(started));
            }
            std::process::exit(1);
        });
    }
    let mut device_failed = None;
    for name in &names {
        if let Ok(mut c) = current.lock() {
            *c = name.clone();
        }
        let pass = match &device_failed {
            Some(why) if needs_device(name) => {
                result_line(false, name, &format!("not run: {why}"));
                false
            }
            _ => run_one_here(args, name),
        };
        if name == "device" {
            if pass {
                if let Ok(mut t) = tally.lock() {
                    t.device = checks::device_name_seen();
                }
            } else {
                device_failed = Some("the device did not open (see the device check)".to_string());
            }
        }
        if let Ok(mut t) = tally.lock() {
            t.count(name, pass);
        }
    }
    done.store(true, Ordering::SeqCst);
    let t = tally.lock().expect("tally");
    println!("{}", t.summary(started));
    t.failed == 0
}

/// Each check in a child process of its own, with a time limit.
pub fn run_all_isolated(args: &Args) -> bool {
    let started = Instant::now();
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => {
            println!("FAIL runner: cannot find this program's own path ({e}); use --in-process");
            println!("gpu-check: 0 passed, 1 failed, device (none), 0.0 s");
            return false;
        }
    };
    let mut tally = Tally::default();
    let mut device_failed = None;
    for name in checks::names(args) {
        let pass = if let (Some(why), true) = (&device_failed, needs_device(&name)) {
            result_line(false, &name, &format!("not run: {why}"));
            false
        } else {
            let left = args.budget.saturating_sub(started.elapsed());
            let limit = checks::time_limit(&name).min(left);
            if limit < Duration::from_secs(3) {
                result_line(
                    false,
                    &name,
                    &format!(
                        "not run: the time budget of {:.0} s is spent",
                        args.budget.as_secs_f64()
                    ),
                );
                false
            } else {
                let (pass, device) = run_child(&exe, args, &name, limit);
                if device.is_some() {
                    tally.device = device;
                }
                pass
            }
        };
        if name == "device" && !pass {
            device_failed = Some("the device did not open (see the device check)".to_string());
        }
        tally.count(&name, pass);
    }
    println!("{}", tally.summary(started));
    tally.failed == 0
}

/// Runs `exe --only name` with the same options; relays its lines as they
/// come; whether it passed, and the device name if it printed one.
fn run_child(
    exe: &std::path::Path,
    args: &Args,
    name: &str,
    limit: Duration,
) -> (bool, Option<String>) {
    let mut cmd = Command::new(exe);
    cmd.arg("--only")
        .arg(name)
        .arg("--fixtures")
        .arg(&args.fixtures)
        .arg("--metrale")
        .arg(&args.metrale)
        .arg("--backend")
        .arg(args.backend.name())
        .arg("--bench-prompt")
        .arg(args.bench_prompt.to_string())
        .arg("--bench-gen")
        .arg(args.bench_gen.to_string())
        .arg("--budget-s")
        .arg(format!("{}", limit.as_secs_f64()));
    if let Some(c) = &args.bench_config {
        cmd.arg("--bench-config").arg(c);
    }
    if let Some(c) = &args.bench_hybrid_config {
        cmd.arg("--bench-hybrid-config").arg(c);
    }
    let batches: Vec<String> = args.bench_batches.iter().map(|b| b.to_string()).collect();
    cmd.arg("--bench-batches").arg(batches.join(","));
    if args.no_bench {
        cmd.arg("--no-bench");
    }
    if args.selftests {
        cmd.arg("--with-selftests");
    }
    // Its own process group, so that a hung child and whatever it started
    // (the bench) end together.
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .stdin(Stdio::null())
        .process_group(0);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            result_line(
                false,
                name,
                &format!("could not start {}: {e}", exe.display()),
            );
            return (false, None);
        }
    };
    let (tx, rx) = mpsc::channel::<Option<String>>();
    if let Some(out) = child.stdout.take() {
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                println!("{line}");
                let _ = tx.send(Some(line));
            }
            let _ = tx.send(None);
        });
    }
    let started = Instant::now();
    let mut timed_out = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if started.elapsed() >= limit => {
                timed_out = true;
                let _ = Command::new("kill")
                    .args(["-KILL", "--", &format!("-{}", child.id())])
                    .status();
                let _ = child.kill();
                break child.wait().ok();
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(_) => break None,
        }
    };
    // The lines it printed (give the reader a moment to drain the pipe).
    let mut result = None;
    let mut device = None;
    let until = Instant::now() + Duration::from_secs(3);
    while let Ok(Some(line)) = rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
        if let Some(d) = line.strip_prefix(checks::DEVICE_NAME_PREFIX) {
            device = Some(d.trim().to_string());
        }
        for word in ["PASS", "FAIL"] {
            if line.starts_with(&format!("{word} {name}:")) {
                result = Some(word == "PASS");
            }
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let exit_ok = status.is_some_and(|s| s.success());
    match (timed_out, result) {
        (true, _) => {
            result_line(
                false,
                name,
                &format!(
                    "timed out after {secs:.0} s (limit {:.0} s); killed",
                    limit.as_secs_f64()
                ),
            );
            (false, device)
        }
        (false, Some(pass)) => (pass && exit_ok, device),
        (false, None) => {
            let how = match status {
                Some(s) => describe_status(s),
                None => "was lost".to_string(),
            };
            result_line(
                false,
                name,
                &format!("the check's process {how} after {secs:.1} s without a result"),
            );
            (false, device)
        }
    }
}

fn describe_status(s: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(sig)) => format!(
            "was killed by signal {sig}{}",
            match sig {
                6 => " (SIGABRT)",
                9 => " (SIGKILL: out of memory?)",
                11 => " (SIGSEGV)",
                7 => " (SIGBUS)",
                _ => "",
            }
        ),
        _ => format!("ended: {s}"),
    }
}
