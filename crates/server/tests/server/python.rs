//! Running the official-client scripts (`crates/server/tests/*_client.py`)
//! against a test server: the Python packages they import, pinned and
//! installed once under the target dir when python3 lacks them (never
//! skipped: a python3 that cannot get them fails the test), the spec file
//! they read, a loopback-only environment, and a time limit.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A pip package a script imports, at the version `.ci/run` installs.
#[derive(Clone, Copy, Debug)]
pub struct Package {
    pub name: &'static str,
    pub module: &'static str,
    pub version: &'static str,
}

impl Package {
    pub const OPENAI: Package = Package {
        name: "openai",
        module: "openai",
        version: "1.109.1",
    };
    pub const JSONSCHEMA: Package = Package {
        name: "jsonschema",
        module: "jsonschema",
        version: "4.26.0",
    };
}

/// Runs `crates/server/tests/SCRIPT` on `spec` (written to a file named
/// by `tag`) with `packages` importable, killed after `limit`; fails the
/// test unless the script exits 0 (each script exits 1 on any failed
/// check) having run at least one check.
pub fn run_client(
    script: &str,
    tag: &str,
    spec: &serde_json::Value,
    packages: &[Package],
    limit: Duration,
) {
    let paths: Vec<PathBuf> = packages
        .iter()
        .filter_map(|p| pip_target(p.name, p.module, p.version))
        .collect();
    let spec_path = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("{script}-spec-{tag}-{}.json", std::process::id()));
    std::fs::write(&spec_path, spec.to_string()).unwrap();
    let mut cmd = Command::new(python());
    cmd.arg(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests")
            .join(script),
    )
    .arg(&spec_path)
    // Loopback only: no proxy between the client and the server.
    .env("NO_PROXY", "127.0.0.1,localhost")
    .env("no_proxy", "127.0.0.1,localhost")
    .env_remove("OPENAI_BASE_URL")
    .env_remove("OPENAI_API_KEY");
    for proxy in ["HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"] {
        cmd.env_remove(proxy).env_remove(proxy.to_lowercase());
    }
    if !paths.is_empty() {
        cmd.env("PYTHONPATH", std::env::join_paths(&paths).unwrap());
    }
    let out = run_bounded(cmd, limit);
    let _ = std::fs::remove_file(&spec_path);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}{stderr}");
    assert!(
        out.status.success(),
        "{script} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains(" checks passed, 0 failed") && !stdout.contains("\n0 checks passed"),
        "{script} ran no checks:\n{stdout}"
    );
}

fn python() -> &'static str {
    "python3"
}

/// A directory from which python3 imports `module` of the pip package
/// `package` at `version`: none when python3's own is that version, else
/// `target/tmp/pydeps-PACKAGE-VERSION`, where pip installs it once (later
/// runs reuse it; `.ci/run` installs it there up front). Fails the test
/// when it cannot be installed: the tests that need it are never skipped.
fn pip_target(package: &str, module: &str, version: &str) -> Option<PathBuf> {
    // The version of `package` python3 imports with `pythonpath`.
    let installed = |pythonpath: Option<&Path>| {
        let mut cmd = Command::new(python());
        cmd.args([
            "-c",
            &format!("import {module}, importlib.metadata as m; print(m.version({package:?}))"),
        ]);
        if let Some(p) = pythonpath {
            cmd.env("PYTHONPATH", p);
        }
        let out = cmd.output().unwrap_or_else(|e| {
            panic!(
                "the official-client tests need python3 on PATH to run the `{package}` \
                 package, and running it failed: {e}"
            )
        });
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    };
    if installed(None).as_deref() == Some(version) {
        eprintln!("python3 has {package} {version}");
        return None;
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("pydeps-{package}-{version}"));
    if installed(Some(&dir)).as_deref() != Some(version) {
        eprintln!("installing {package}=={version} into {}", dir.display());
        let out = Command::new(python())
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--upgrade",
            ])
            .arg("--target")
            .arg(&dir)
            .arg(format!("{package}=={version}"))
            .output()
            .unwrap_or_else(|e| panic!("running `python3 -m pip install` failed: {e}"));
        let got = installed(Some(&dir));
        assert!(
            out.status.success() && got.as_deref() == Some(version),
            "could not install the `{package}` Python package ({package}=={version}) into {} \
             with pip ({}; importing it then gives {got:?}); the official-client tests cannot \
             run without it.\nstdout: {}\nstderr: {}",
            dir.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
    }
    Some(dir)
}

/// Runs `cmd` to its end, killing it (and failing) after `limit`.
fn run_bounded(mut cmd: Command, limit: Duration) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running openai_client.py with python3");
    // Read both pipes on threads so a full pipe never blocks the script.
    let pipe = |r: Option<Box<dyn Read + Send>>| {
        let mut r = r.unwrap();
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = r.read_to_end(&mut buf);
            buf
        })
    };
    let out = pipe(child.stdout.take().map(|p| Box::new(p) as _));
    let err = pipe(child.stderr.take().map(|p| Box::new(p) as _));
    let began = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if began.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{:?} ran past {limit:?} and was killed; its output:\n{}\n{}",
                cmd.get_args().next().unwrap_or_default(),
                String::from_utf8_lossy(&out.join().unwrap()),
                String::from_utf8_lossy(&err.join().unwrap())
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}
