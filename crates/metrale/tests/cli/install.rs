//! An installed binary and the library's examples, as a new user meets them:
//! the built `metrale` copied out of the tree and run from elsewhere with a
//! bare environment (what `cargo install --path crates/metrale` gives),
//! and `cargo run --example generate | stream | batch | chat` on the
//! bundled model. No second build: the binaries `cargo test` already made.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("metrale-install-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Runs `program` in `cwd` with nothing of this environment but PATH.
fn run_bare(program: &Path, args: &[&str], cwd: &Path, home: &Path) -> Output {
    Command::new(program)
        .args(args)
        .current_dir(cwd)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", home)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", program.display()))
}

fn source_root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .canonicalize()
        .expect("source root")
}

/// The installed binary alone serves (no `metrale-serve` beside it or on
/// PATH): `metrale serve` answers /health and a completion, and stops on
/// SIGTERM; `metrale -v serve` passes -v on.
#[cfg(unix)]
#[test]
fn an_installed_binary_serves() {
    use std::io::{BufRead, BufReader, Read, Write};
    let root = scratch("serve");
    let (bin_dir, home) = (root.join("bin"), root.join("home"));
    for dir in [&bin_dir, &home] {
        std::fs::create_dir_all(dir).unwrap();
    }
    let installed = bin_dir.join("metrale");
    std::fs::copy(env!("CARGO_BIN_EXE_metrale"), &installed).expect("copy the binary");
    let mut child = Command::new(&installed)
        .args(["-v", "serve", "--port", "0", "-t", "1"])
        .current_dir(&root)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("HOME", &home)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("metrale serve runs");
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    let mut line = String::new();
    let addr = loop {
        line.clear();
        if stderr.read_line(&mut line).unwrap_or(0) == 0 {
            let _ = child.kill();
            panic!("metrale serve ended before listening: {seen}");
        }
        seen.push_str(&line);
        if let Some(at) = line.find("on http://") {
            break line[at + "on http://".len()..].trim().to_string();
        }
    };
    // -v reached the server: its info lines were logged.
    assert!(seen.contains("INFO"), "{seen}");
    let request = |body: &str| {
        let mut s = std::net::TcpStream::connect(&addr).expect("connect");
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    };
    let reply = request(r#"{"prompt": "Nothing is", "max_tokens": 4, "temperature": 0}"#);
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(reply.contains("\"model\":\"default\""), "{reply}");
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn an_installed_binary_runs_its_default_model_from_anywhere_offline() {
    let root = scratch("bin");
    let (bin_dir, home, elsewhere) = (root.join("bin"), root.join("home"), root.join("work"));
    for dir in [&bin_dir, &home, &elsewhere] {
        std::fs::create_dir_all(dir).unwrap();
    }
    let installed = bin_dir.join("metrale");
    std::fs::copy(env!("CARGO_BIN_EXE_metrale"), &installed).expect("copy the binary");

    // Nothing in the binary points back at the source tree's model.
    let bytes = std::fs::read(&installed).unwrap();
    let model_path = source_root().join("models").join("default");
    let needle = model_path.to_string_lossy();
    assert!(
        !bytes.windows(needle.len()).any(|w| w == needle.as_bytes()),
        "the binary names {needle}"
    );

    let args = ["generate", "-n", "8", "-s", "1", "The capital of France is"];
    let first = run_bare(&installed, &args, &elsewhere, &home);
    assert!(
        first.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&first.stderr)
    );
    // The continuation of the prompt.
    assert!(first.stdout.len() > 1, "{:?}", first.stdout);

    // The model was unpacked once into the user's cache, and is reused.
    let cache = home.join(".cache").join("metrale");
    let copies: Vec<_> = std::fs::read_dir(&cache)
        .expect("the cache directory exists")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .collect();
    assert_eq!(copies.len(), 1, "{copies:?}");
    assert!(copies[0].join("model.safetensors").is_file());
    let modified = std::fs::metadata(copies[0].join("model.safetensors"))
        .and_then(|m| m.modified())
        .unwrap();
    let second = run_bare(&installed, &args, &elsewhere, &home);
    assert!(second.status.success());
    assert_eq!(second.stdout, first.stdout, "same seed, same text");
    let again = std::fs::metadata(copies[0].join("model.safetensors"))
        .and_then(|m| m.modified())
        .unwrap();
    assert_eq!(modified, again, "the cached copy was rewritten");

    // METRALE_CACHE_DIR moves the cache.
    let moved = root.join("cache");
    let out = Command::new(&installed)
        .args(args)
        .current_dir(&elsewhere)
        .env_clear()
        .env("METRALE_CACHE_DIR", &moved)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout, first.stdout);
    assert_eq!(std::fs::read_dir(&moved).unwrap().count(), 1);
    std::fs::remove_dir_all(&root).unwrap();
}

/// The example binaries `cargo test` built next to this test's own binary.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test's path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>");
    let path = profile_dir
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.is_file(),
        "{} is missing: `cargo test -p metrale` builds the examples (a --test filter does not)",
        path.display()
    );
    path
}

#[test]
fn the_examples_run_on_the_bundled_model() {
    let root = scratch("examples");
    let expect: [(&str, &str); 4] = [
        ("generate", "The capital of France is"),
        ("stream", "Once upon a time"),
        ("batch", "\"The meaning of life is\" -> "),
        ("chat", "assistant: "),
    ];
    for (name, needle) in expect {
        let out = run_bare(&example(name), &[], &root, &root);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "example {name} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains(needle), "example {name} printed {stdout:?}");
    }
    std::fs::remove_dir_all(&root).unwrap();
}
