//! What `--model` names: a directory, a `.safetensors` file, or a Hugging
//! Face hub id in the local cache (built here in a temporary directory as
//! the hub client lays it out: `refs/`, `snapshots/` of symlinks into
//! `blobs/`); the cache's environment variables and their precedence; a
//! model not in the cache; `--revision`; and quantized checkpoints refused
//! as such, by their config or by their tensor names.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

use metrale::{Device, LoadOptions, Model, resolve_model, resolve_model_in};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures")).join(name)
}

/// A fresh empty directory, unique per call.
fn scratch(tag: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::SeqCst);
    let dir = std::env::temp_dir().join(format!(
        "metrale-models-by-name-{}-{tag}-{n}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A copy of a fixture's files in a new directory.
fn copy_fixture(name: &str, tag: &str) -> PathBuf {
    let dir = scratch(tag);
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    dir
}

const HASH_MAIN: &str = "0123456789abcdef0123456789abcdef01234567";
const HASH_V1: &str = "89abcdef0123456789abcdef0123456789abcdef";

/// Puts fixture `name` into the hub cache `cache` as `repo` at commit
/// `hash`: its files as blobs, the snapshot as symlinks to them, and
/// `refs/<each of refs>` naming the commit. Returns the snapshot directory.
fn cache_model(cache: &Path, repo: &str, name: &str, hash: &str, refs: &[&str]) -> PathBuf {
    let root = cache.join(format!("models--{}", repo.replace('/', "--")));
    let blobs = root.join("blobs");
    let snapshot = root.join("snapshots").join(hash);
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(root.join("refs")).unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        let file = entry.file_name().to_string_lossy().into_owned();
        if file == "golden.safetensors" {
            continue;
        }
        // Blobs are named by content hash; a unique name does here.
        let blob = format!("{hash}-{file}");
        std::fs::copy(entry.path(), blobs.join(&blob)).unwrap();
        std::os::unix::fs::symlink(Path::new("../../blobs").join(&blob), snapshot.join(&file))
            .unwrap();
    }
    for r in refs {
        std::fs::write(root.join("refs").join(r), hash).unwrap();
    }
    snapshot
}

fn metrale(args: &[&str], env: &[(&str, &Path)], cwd: Option<&Path>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_metrale"));
    cmd.args(args)
        .env_remove("METRALE_MODEL")
        .env_remove("HF_HUB_CACHE")
        .env_remove("HF_HOME")
        .env("RUST_LOG", "warn");
    for (k, v) in env {
        cmd.env(k, v);
    }
    if let Some(dir) = cwd {
        cmd.current_dir(dir);
    }
    cmd.output().expect("metrale runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn a_hub_id_resolves_to_its_snapshot_by_ref_or_commit() {
    let cache = scratch("cache");
    let main = cache_model(&cache, "org/tiny", "llama", HASH_MAIN, &["main"]);
    let v1 = cache_model(&cache, "org/tiny", "qwen3", HASH_V1, &["v1"]);
    let found = resolve_model_in(Path::new("org/tiny"), None, Some(&cache)).unwrap();
    assert_eq!(found, main);
    // The snapshot's files are symlinks into blobs/, and read through them.
    assert!(
        std::fs::symlink_metadata(found.join("config.json"))
            .unwrap()
            .is_symlink()
    );
    assert!(
        std::fs::read_to_string(found.join("config.json"))
            .unwrap()
            .contains("llama")
    );
    let found = resolve_model_in(Path::new("org/tiny"), Some("main"), Some(&cache)).unwrap();
    assert_eq!(found, main);
    // A branch or tag name through refs/, a commit hash directly.
    let found = resolve_model_in(Path::new("org/tiny"), Some("v1"), Some(&cache)).unwrap();
    assert_eq!(found, v1);
    let found = resolve_model_in(Path::new("org/tiny"), Some(HASH_V1), Some(&cache)).unwrap();
    assert_eq!(found, v1);
    // A shortened hash, as `git log --oneline` and the hub show it.
    let found = resolve_model_in(Path::new("org/tiny"), Some(&HASH_V1[..7]), Some(&cache)).unwrap();
    assert_eq!(found, v1);
    let short = HASH_MAIN[..10].to_ascii_uppercase();
    let found = resolve_model_in(Path::new("org/tiny"), Some(&short), Some(&cache)).unwrap();
    assert_eq!(found, main);
    // Two snapshots sharing the prefix: ambiguous, both named.
    let twin = format!("{}ffffffff", &HASH_MAIN[..32]);
    cache_model(&cache, "org/tiny", "llama", &twin, &[]);
    let e = resolve_model_in(Path::new("org/tiny"), Some(&HASH_MAIN[..8]), Some(&cache))
        .unwrap_err()
        .to_string();
    assert!(e.contains("ambiguous") && e.contains(&twin), "{e}");
}

#[test]
fn a_model_or_revision_not_in_the_cache_says_so() {
    let cache = scratch("missing");
    let e = resolve_model_in(Path::new("org/absent"), None, Some(&cache))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("org/absent") && e.contains("not in the Hugging Face cache"),
        "{e}"
    );
    assert!(
        e.contains(&cache.join("models--org--absent").display().to_string()),
        "{e}"
    );
    assert!(e.contains("does not download"), "{e}");

    cache_model(&cache, "org/tiny", "llama", HASH_MAIN, &["main"]);
    let e = resolve_model_in(Path::new("org/tiny"), Some("v2"), Some(&cache))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("revision v2") && e.contains("not in the Hugging Face cache"),
        "{e}"
    );
    assert!(
        e.contains("main") && e.contains(HASH_MAIN),
        "lists what is there: {e}"
    );

    // A ref whose snapshot is gone (an interrupted download).
    let root = cache.join("models--org--tiny");
    std::fs::write(root.join("refs").join("broken"), HASH_V1).unwrap();
    let e = resolve_model_in(Path::new("org/tiny"), Some("broken"), Some(&cache))
        .unwrap_err()
        .to_string();
    assert!(e.contains(HASH_V1) && e.contains("not in the cache"), "{e}");

    // Not a path and not a hub id: left to the loader, which names the
    // file it wanted.
    let missing = Path::new("/no/such/dir");
    assert_eq!(
        resolve_model_in(missing, None, Some(&cache)).unwrap(),
        missing
    );
}

/// `metrale inspect org/tiny --revision <rev>` against `cache`, under a
/// memory limit and a deadline: a resolver that blocks or reads without end
/// fails the test instead of hanging it or exhausting the machine.
fn inspect_bounded(cache: &Path, revision: &str) -> Output {
    use std::time::{Duration, Instant};
    let bin = env!("CARGO_BIN_EXE_metrale");
    let mut child = Command::new("sh")
        .args(["-c", "ulimit -v 2000000 && exec \"$0\" \"$@\""])
        .args([
            bin,
            "inspect",
            "org/tiny",
            "--no-load",
            "--revision",
            revision,
        ])
        .env_remove("METRALE_MODEL")
        .env_remove("HF_HOME")
        .env("HF_HUB_CACHE", cache)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("sh runs");
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "--revision {revision}: still running after 30 s: {}",
                text(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn a_ref_that_is_not_a_small_file_holding_a_hash_is_refused() {
    let cache = scratch("bad-refs");
    cache_model(&cache, "org/tiny", "llama", HASH_MAIN, &["main"]);
    let refs = cache.join("models--org--tiny/refs");
    let made = Command::new("mkfifo")
        .arg(refs.join("fifo"))
        .status()
        .unwrap();
    assert!(made.success());
    std::os::unix::fs::symlink("/dev/zero", refs.join("zero")).unwrap();
    std::fs::create_dir(refs.join("dir")).unwrap();
    // A valid hash padded past the bound, and a name that is no snapshot's
    // (`.` would be snapshots/ itself).
    let padded = format!("{HASH_MAIN}{}", "\n".repeat(5000));
    std::fs::write(refs.join("huge"), padded).unwrap();
    std::fs::write(refs.join("dot"), ".\n").unwrap();
    let cases = [
        ("fifo", "is a FIFO"),
        ("zero", "is a character device"),
        ("dir", "is a directory"),
        ("huge", "too long"),
        ("dot", "not a commit hash"),
    ];
    for (revision, what) in cases {
        let out = inspect_bounded(&cache, revision);
        let stderr = text(&out.stderr);
        assert!(!out.status.success(), "--revision {revision}: {stderr}");
        let path = refs.join(revision).display().to_string();
        assert!(
            stderr.contains(&path) && stderr.contains(what),
            "--revision {revision}: {stderr}"
        );
    }
    // The good ref beside them still resolves.
    assert!(inspect_bounded(&cache, "main").status.success());
}

#[test]
fn a_safetensors_file_stands_for_its_directory() {
    let dir = copy_fixture("llama", "file");
    let file = dir.join("model.safetensors");
    assert_eq!(resolve_model(&file, None).unwrap(), dir);
    assert_eq!(resolve_model(&dir, None).unwrap(), dir);
    // A file the directory's loader would not read is refused, naming why.
    let other = dir.join("other.safetensors");
    std::fs::copy(&file, &other).unwrap();
    let e = resolve_model(&other, None).unwrap_err().to_string();
    assert!(
        e.contains("other.safetensors") && e.contains("model.safetensors"),
        "{e}"
    );
    // A .safetensors file without a config.json beside it.
    let bare = scratch("bare");
    std::fs::copy(&file, bare.join("model.safetensors")).unwrap();
    let e = resolve_model(bare.join("model.safetensors"), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("no config.json"), "{e}");
    // A GGUF file is a model by itself; a broken one fails at load, named.
    std::fs::write(dir.join("m.gguf"), b"GGUF").unwrap();
    let gguf = resolve_model(dir.join("m.gguf"), None).unwrap();
    assert_eq!(gguf, dir.join("m.gguf"));
    let e = match metrale::Model::load(&gguf, &metrale::LoadOptions::default(), &mut |_| {}) {
        Ok(_) => panic!("a 4-byte GGUF file loads"),
        Err(e) => format!("{e:#}"),
    };
    assert!(e.contains("m.gguf") && e.contains("truncated"), "{e}");

    // End to end: `generate --model <file>`.
    let out = metrale(
        &[
            "generate",
            "--model",
            file.to_str().unwrap(),
            "--max-tokens",
            "3",
            "--temperature",
            "0",
            "Hello",
        ],
        &[],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
}

/// `inspect` prints the directory it resolved, so each cache location
/// shows in its output.
fn inspected_dir(out: &Output) -> String {
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    let stdout = text(&out.stdout);
    stdout
        .lines()
        .find(|l| l.trim_start().starts_with("model "))
        .unwrap_or_else(|| panic!("no model line in {stdout}"))
        .to_string()
}

#[test]
fn the_cache_is_hf_hub_cache_else_hf_home_else_home() {
    let (hub_cache, hf_home, home) = (scratch("hub-cache"), scratch("hf-home"), scratch("home"));
    cache_model(&hub_cache, "org/tiny", "llama", HASH_MAIN, &["main"]);
    cache_model(
        &hf_home.join("hub"),
        "org/tiny",
        "llama",
        HASH_MAIN,
        &["main"],
    );
    cache_model(
        &home.join(".cache/huggingface/hub"),
        "org/tiny",
        "llama",
        HASH_MAIN,
        &["main"],
    );
    let args = ["inspect", "org/tiny", "--no-load"];
    let all = [
        ("HF_HUB_CACHE", hub_cache.as_path()),
        ("HF_HOME", hf_home.as_path()),
        ("HOME", home.as_path()),
    ];
    let line = inspected_dir(&metrale(&args, &all, None));
    assert!(line.contains(hub_cache.to_str().unwrap()), "{line}");
    let line = inspected_dir(&metrale(&args, &all[1..], None));
    assert!(
        line.contains(hf_home.join("hub").to_str().unwrap()),
        "{line}"
    );
    let line = inspected_dir(&metrale(&args, &all[2..], None));
    assert!(
        line.contains(home.join(".cache/huggingface/hub").to_str().unwrap()),
        "{line}"
    );

    // --revision on the CLI; a missing model is a clean error.
    cache_model(&hub_cache, "org/tiny", "qwen3", HASH_V1, &["v1"]);
    let line = inspected_dir(&metrale(
        &["inspect", "org/tiny", "--no-load", "--revision", "v1"],
        &all,
        None,
    ));
    assert!(line.contains(HASH_V1), "{line}");
    let out = metrale(&["generate", "--model", "org/absent", "hi"], &all, None);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(stderr.contains("not in the Hugging Face cache"), "{stderr}");
    assert!(stderr.contains(hub_cache.to_str().unwrap()), "{stderr}");
}

#[test]
fn a_hub_id_runs_and_a_local_path_wins_over_it() {
    let cache = scratch("run-cache");
    cache_model(&cache, "org/tiny", "llama", HASH_MAIN, &["main"]);
    let args = [
        "generate",
        "--model",
        "org/tiny",
        "--max-tokens",
        "3",
        "--temperature",
        "0",
        "Hello",
    ];
    let out = metrale(&args, &[("HF_HUB_CACHE", &cache)], None);
    assert!(out.status.success(), "{}", text(&out.stderr));

    // A directory org/tiny under the working directory is taken instead
    // (here one that fails to load, so the error shows which was read).
    let cwd = scratch("cwd");
    std::fs::create_dir_all(cwd.join("org/tiny")).unwrap();
    std::fs::write(cwd.join("org/tiny/config.json"), "{}").unwrap();
    let out = metrale(&args, &[("HF_HUB_CACHE", &cache)], Some(&cwd));
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("org/tiny/config.json") && stderr.contains("model_type"),
        "{stderr}"
    );
}

fn load(dir: &Path) -> String {
    let options = LoadOptions {
        device: Device::Cpu,
        threads: 1,
        ..LoadOptions::default()
    };
    match Model::load(dir, &options, &mut |_| {}) {
        Ok(_) => panic!("{} should be refused", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn quantized_configs_are_refused_by_method() {
    for (config, method) in [
        (
            r#"{"quant_method": "gptq", "bits": 4, "group_size": 128}"#,
            "GPTQ",
        ),
        (r#"{"quant_method": "awq", "bits": 4}"#, "AWQ"),
        (
            r#"{"load_in_4bit": true, "bnb_4bit_quant_type": "nf4"}"#,
            "bitsandbytes",
        ),
        (
            r#"{"quant_method": "fp8", "activation_scheme": "dynamic"}"#,
            "FP8",
        ),
        (
            r#"{"quant_method": "compressed-tensors"}"#,
            "compressed-tensors",
        ),
    ] {
        let dir = copy_fixture("llama", "quant-config");
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).unwrap();
        let patched = text.replacen('{', &format!("{{\n  \"quantization_config\": {config},"), 1);
        std::fs::write(&path, patched).unwrap();
        let e = load(&dir);
        assert!(
            e.contains(&format!("quantized with {method}")) && e.contains("config.json"),
            "{method}: {e}"
        );
        assert!(!e.contains("missing"), "{e}");
        // The CLI says the same, inspect --no-load included.
        let out = metrale(&["inspect", dir.to_str().unwrap(), "--no-load"], &[], None);
        assert!(!out.status.success());
        assert!(text_of(&out).contains(method), "{}", text_of(&out));
    }
}

fn text_of(out: &Output) -> String {
    text(&out.stderr)
}

#[test]
fn quantized_tensor_names_are_refused_by_method() {
    use safetensors::tensor::{SafeTensors, TensorView};
    let src = std::fs::read(fixture("llama").join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&src).unwrap();
    for (renames, method) in [
        (
            &[
                ("q_proj.weight", "q_proj.qweight"),
                ("k_proj.weight", "q_proj.g_idx"),
            ][..],
            "GPTQ",
        ),
        (
            &[
                ("q_proj.weight", "q_proj.qweight"),
                ("k_proj.weight", "q_proj.qzeros"),
            ][..],
            "AWQ",
        ),
    ] {
        let dir = copy_fixture("llama", "quant-tensors");
        let mut tensors: Vec<(String, TensorView<'_>)> = Vec::new();
        for (name, view) in st.tensors() {
            let mut name = name.to_string();
            if name.starts_with("model.layers.0.") {
                for (from, to) in renames {
                    if name.ends_with(from) {
                        name = name.replace(from, to);
                    }
                }
            }
            tensors.push((name, view));
        }
        let bytes = safetensors::serialize(tensors, None).unwrap();
        std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
        let e = load(&dir);
        assert!(
            e.contains(&format!("quantized with {method}")) && e.contains("model.safetensors"),
            "{method}: {e}"
        );
        assert!(!e.contains("is missing"), "{e}");
    }
}
