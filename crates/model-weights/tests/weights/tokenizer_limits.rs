//! A GGUF vocabulary cannot make the tokenizer rebuild allocate or work
//! out of proportion to the file: the hostile inputs run in a child process
//! whose address space is capped, so a regression fails the test instead of
//! exhausting the machine.

#![cfg(unix)]

use std::process::Command;
use std::time::{Duration, Instant};

use metrale_model_weights::gguf::{GgufArray, GgufFile, GgufValue, GgufWriter, tokenizer_json};

/// Set in the child process that runs a test's body.
const CHILD: &str = "METRALE_CAPPED_CHILD";
/// The child's address-space limit (KiB, as `ulimit -v` takes it): 2 GiB.
const CHILD_LIMIT_KIB: u64 = 2 << 20;

/// In the parent, runs the test `name` of this binary again in a child
/// capped at [`CHILD_LIMIT_KIB`] and asserts that it passed; returns
/// whether the caller is that child (and should run the body).
fn in_capped_child(name: &str) -> bool {
    if std::env::var_os(CHILD).is_some() {
        return true;
    }
    // libtest runs each test on a thread named by its path in the binary
    // (`module::name`), which `--exact` takes.
    let thread = std::thread::current();
    let name = thread.name().filter(|n| n.ends_with(name)).unwrap_or(name);
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -v {CHILD_LIMIT_KIB} && exec \"$0\" \"$@\""))
        .arg(exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        // glibc reserves 64 MiB of address space per malloc arena.
        .env("MALLOC_ARENA_MAX", "2")
        .output()
        .expect("the test binary runs again");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{name} in a child capped at {CHILD_LIMIT_KIB} KiB: {}\n{stdout}\n{stderr}",
        out.status
    );
    false
}

fn strings(v: Vec<String>) -> GgufValue {
    GgufValue::Array(GgufArray::String(v))
}

/// A SentencePiece (`llama`) vocabulary of `tokens`, every score 0.
fn spm_file(tokens: Vec<String>) -> GgufFile {
    let n = tokens.len();
    let mut w = GgufWriter::new();
    w.add("tokenizer.ggml.model", GgufValue::String("llama".into()))
        .add("tokenizer.ggml.tokens", strings(tokens))
        .add(
            "tokenizer.ggml.scores",
            GgufValue::Array(GgufArray::F32(vec![0.0; n])),
        );
    GgufFile::from_bytes("hostile.gguf", w.to_bytes().unwrap()).unwrap()
}

/// "a", "aa", ..., 2,000 a's: 2 MB of vocabulary whose every piece splits
/// into two pieces at every position, so "every split of every piece" is
/// about 2.7 GB of merges. The rebuild refuses it, naming the key and the
/// sizes, without allocating them.
#[test]
fn a_vocabulary_of_nested_runs_is_refused_not_exhausting_memory() {
    if !in_capped_child("a_vocabulary_of_nested_runs_is_refused_not_exhausting_memory") {
        return;
    }
    let file = spm_file((1..=2000).map(|n| "a".repeat(n)).collect());
    let err = tokenizer_json(&file).unwrap_err().to_string();
    assert!(err.contains("\"tokenizer.ggml.tokens\""), "{err}");
    assert!(err.contains("merges"), "{err}");
    assert!(err.contains("2001000 bytes"), "{err}");
}

/// Long pieces that split nowhere: trying every split by hashing both
/// halves is quadratic in a piece's length (4,000 pieces of 4,000 bytes
/// would hash about 10^11 bytes); the rebuild's work stays linear.
#[test]
fn long_pieces_without_splits_load_in_linear_time() {
    if !in_capped_child("long_pieces_without_splits_load_in_linear_time") {
        return;
    }
    let tokens: Vec<String> = (0..4000)
        .map(|i| format!("{i:04}{}", "z".repeat(3996)))
        .collect();
    let file = spm_file(tokens);
    let start = Instant::now();
    let json = tokenizer_json(&file).expect("a vocabulary without merges loads");
    assert_eq!(json["model"]["merges"].as_array().map(Vec::len), Some(0));
    let took = start.elapsed();
    assert!(took < Duration::from_secs(10), "took {took:?}");
}
