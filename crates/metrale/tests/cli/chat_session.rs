//! `metrale chat` as a chat: Ctrl-C stops the reply being generated and the
//! session goes on, `/exit` and end of input (Ctrl-D) leave, `/reset`
//! forgets the conversation.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(name)
}

fn chat(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .arg("chat")
        .args(["-m", fixture("llama").to_str().unwrap()])
        .args(args)
        .env_remove("METRALE_MODEL")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the metrale binary runs");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().expect("metrale finishes")
}

/// The prompt token counts of the summary lines, in order.
fn prompt_counts(stderr: &str) -> Vec<usize> {
    stderr
        .lines()
        .filter_map(|l| l.strip_prefix("prompt: "))
        .map(|rest| rest.split_whitespace().next().unwrap().parse().unwrap())
        .collect()
}

/// Piped input: `/reset` starts over at once (a confirmation is asked on
/// a terminal only), and the next line is the next message, not an answer.
#[test]
fn reset_from_a_pipe_starts_over_without_eating_a_line() {
    let out = chat(
        &["-n", "4", "--temperature", "0"],
        "hello\nhello\n/reset\nhello\n",
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let counts = prompt_counts(&stderr);
    assert_eq!(counts.len(), 3, "three replies: {stderr}");
    assert!(counts[1] > counts[0], "the conversation grows: {counts:?}");
    assert_eq!(counts[2], counts[0], "/reset starts over: {counts:?}");
    assert!(
        stderr.contains("(the conversation starts over)"),
        "{stderr}"
    );
}

/// The second turn prefills only what is new: its summary says how many
/// prompt tokens the prefix cache held, and its prompt rate counts only
/// the tokens it prefilled.
#[test]
fn a_turn_says_what_the_prefix_cache_held() {
    let out = chat(&["-n", "4", "--temperature", "0"], "hello\nhello again\n");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let summaries: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("prompt: "))
        .collect();
    assert_eq!(summaries.len(), 2, "{stderr}");
    assert!(!summaries[0].contains("cached"), "{}", summaries[0]);
    let cached: usize = (summaries[1].split(" (").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no cached count: {}", summaries[1]));
    let counts = prompt_counts(&stderr);
    assert!(cached > 0 && cached < counts[1], "{cached} of {counts:?}");
}

#[test]
fn exit_leaves() {
    let out = chat(&["-n", "3"], "hello\n/exit\nhello again\n");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(
        prompt_counts(&stderr).len(),
        1,
        "nothing after /exit: {stderr}"
    );
}

/// A copy of the llama fixture with a context long enough that a reply
/// runs for minutes unless stopped.
fn long_context_llama() -> PathBuf {
    let src = fixture("llama");
    let dir = std::env::temp_dir().join(format!("metrale-chat-long-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap();
        if name != "golden.safetensors" {
            std::fs::copy(&path, dir.join(name)).unwrap();
        }
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["max_position_embeddings"] = serde_json::json!(40000);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    dir
}

/// Collects a pipe's bytes on a thread, for polling.
fn collect(mut pipe: impl Read + Send + 'static) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = pipe.read(&mut buf) {
            if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    rx
}

/// Reads `rx` into `seen` until `until(seen)` holds; panics after a minute.
fn wait_for(
    rx: &mpsc::Receiver<Vec<u8>>,
    seen: &mut Vec<u8>,
    what: &str,
    until: impl Fn(&[u8]) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !until(seen) {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(bytes) => seen.extend_from_slice(&bytes),
            Err(_) => panic!(
                "timed out waiting for {what}: {}",
                String::from_utf8_lossy(seen)
            ),
        }
    }
}

#[cfg(unix)]
fn interrupt(pid: u32) {
    let status = Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success());
}

#[cfg(unix)]
#[test]
fn ctrl_c_stops_the_reply_and_keeps_the_session() {
    let dir = long_context_llama();
    let mut child = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args(["chat", "-m", dir.to_str().unwrap()])
        .args([
            "--ctx-size",
            "40000",
            "-n",
            "39000",
            "--ignore-eos",
            "-t",
            "1",
        ])
        .env_remove("METRALE_MODEL")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the metrale binary runs");
    let mut stdin = child.stdin.take().unwrap();
    let stdout = collect(child.stdout.take().unwrap());
    let stderr = collect(child.stderr.take().unwrap());
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let pid = child.id();
    let stopped =
        |n: usize| move |e: &[u8]| String::from_utf8_lossy(e).matches("[stopped]").count() >= n;

    // First turn: wait for the reply to stream, then Ctrl-C.
    stdin.write_all(b"Tell me a very long story.\n").unwrap();
    stdin.flush().unwrap();
    wait_for(&stdout, &mut out, "the first reply", |o| !o.is_empty());
    interrupt(pid);
    wait_for(&stderr, &mut err, "the first stop", stopped(1));
    // The stopped reply's last bytes may still be on their way through the
    // collecting thread; nothing more comes until the next line is sent, so
    // a quiet half second has them all. (Counting them as the second reply
    // would send the next Ctrl-C before that reply starts.)
    while let Ok(bytes) = stdout.recv_timeout(Duration::from_millis(500)) {
        out.extend_from_slice(&bytes);
    }
    let first = out.len();

    // The session goes on: a second turn streams, and stops the same way.
    stdin.write_all(b"And another one.\n").unwrap();
    stdin.flush().unwrap();
    wait_for(&stdout, &mut out, "the second reply", |o| o.len() > first);
    interrupt(pid);
    wait_for(&stderr, &mut err, "the second stop", stopped(2));

    // End of input (Ctrl-D) leaves, cleanly.
    drop(stdin);
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "chat did not end at end of input"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    while let Ok(bytes) = stderr.recv_timeout(Duration::from_secs(5)) {
        err.extend_from_slice(&bytes);
    }
    let err = String::from_utf8_lossy(&err);
    assert!(status.success(), "{status}: {err}");
    assert!(!err.contains("error"), "{err}");
    assert!(
        !err.contains("generated:"),
        "no reply ran to its end: {err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
