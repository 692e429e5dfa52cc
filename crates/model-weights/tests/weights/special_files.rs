//! A weight file that is not a regular file (a FIFO, a device, a
//! directory) is refused by name and kind, promptly: a FIFO used to block
//! `open` forever and `/dev/zero` to be read until memory ran out.
#![cfg(unix)]

use crate::common;

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use common::scratch;
use metrale_model_weights::WeightsError;
use metrale_model_weights::gguf::GgufFile;
use metrale_model_weights::loader::Checkpoint;

fn mkfifo(path: &Path) {
    let status = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .expect("mkfifo runs");
    assert!(status.success(), "mkfifo {}", path.display());
}

/// Runs `open` on `path` in a thread and returns its error message; fails
/// if it has not returned within 10 s (then a writer is opened on the FIFO
/// so that the blocked thread can end).
fn refused<T: Send + 'static>(
    path: &Path,
    open: impl FnOnce(PathBuf) -> Result<T, WeightsError> + Send + 'static,
) -> String {
    let (tx, rx) = mpsc::channel();
    let p = path.to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(open(p).map(|_| ()).map_err(|e| e.to_string()));
    });
    match rx.recv_timeout(Duration::from_secs(10)) {
        Ok(Ok(())) => panic!("{} was accepted", path.display()),
        Ok(Err(e)) => e,
        Err(_) => {
            // Unblock the reader (a FIFO's open waits for a writer).
            let _ = std::fs::OpenOptions::new().write(true).open(path);
            panic!("opening {} did not return within 10 s", path.display())
        }
    }
}

#[test]
fn a_fifo_named_gguf_is_refused_without_blocking() {
    let dir = scratch("fifo-gguf");
    let path = dir.join("model.gguf");
    mkfifo(&path);
    let e = refused(&path, |p| GgufFile::open(&p));
    assert!(e.starts_with(&format!("{}: ", path.display())), "{e}");
    assert!(
        e.contains("FIFO") && e.contains("not a regular file"),
        "{e}"
    );
}

#[test]
fn a_device_named_gguf_is_refused() {
    let dir = scratch("dev-gguf");
    let path = dir.join("model.gguf");
    std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
    let e = refused(&path, |p| GgufFile::open(&p));
    assert!(
        e.contains("model.gguf") && e.contains("character device"),
        "{e}"
    );
}

#[test]
fn a_directory_named_gguf_is_refused() {
    let dir = scratch("dir-gguf");
    let path = dir.join("model.gguf");
    std::fs::create_dir(&path).unwrap();
    let e = refused(&path, |p| GgufFile::open(&p));
    assert!(
        e.contains("model.gguf") && e.contains("is a directory"),
        "{e}"
    );
}

#[test]
fn a_fifo_in_place_of_safetensors_is_refused_without_blocking() {
    let dir = scratch("fifo-st");
    let path = dir.join("model.safetensors");
    mkfifo(&path);
    let e = refused(&dir, |d| Checkpoint::open(&d));
    assert!(e.contains("model.safetensors") && e.contains("FIFO"), "{e}");

    let dir = scratch("fifo-index");
    let path = dir.join("model.safetensors.index.json");
    mkfifo(&path);
    let e = refused(&dir, |d| Checkpoint::open(&d));
    assert!(e.contains("index.json") && e.contains("FIFO"), "{e}");
}

#[test]
fn a_fifo_shard_is_refused_without_blocking() {
    let dir = scratch("fifo-shard");
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"weight_map": {"a.weight": "model-00001-of-00001.safetensors"}}"#,
    )
    .unwrap();
    mkfifo(&dir.join("model-00001-of-00001.safetensors"));
    let e = refused(&dir, |d| Checkpoint::open(&d));
    assert!(
        e.contains("model-00001-of-00001") && e.contains("FIFO"),
        "{e}"
    );
}
