//! Opening weight files (only regular files) and creating output files
//! (only new ones).
//!
//! A FIFO named `model.gguf` blocks `open(2)` until a writer appears, and
//! a device (`/dev/zero`) or a pipe reads without end: given as a model,
//! either hung the loader or read until memory ran out. The kind of file
//! is checked before it is opened (so a FIFO is never opened, and the
//! error names the kind), and again on the opened handle, which on unix is
//! opened with `O_NONBLOCK`: a path swapped for a FIFO in between cannot
//! block the open itself.
//!
//! A temporary output file has a guessable name (`.OUT.tmp-<pid>`); in a
//! shared directory a link planted under that name once made `metrale
//! quantize` truncate the file it pointed to. [`create_new`] creates the
//! file only where nothing is.

use std::fs::{File, FileType, Metadata};
use std::path::Path;

use crate::error::WeightsError;

/// What kind of file `t` is, in words, for an error message ("a FIFO
/// (named pipe)", "a character device", ...).
pub fn file_kind(t: FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if t.is_file() {
        "a regular file"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_symlink() {
        "a symbolic link"
    } else {
        "not a regular file"
    }
}

fn check(path: &Path, meta: &Metadata) -> Result<(), WeightsError> {
    if meta.is_file() {
        return Ok(());
    }
    Err(WeightsError::NotARegularFile {
        path: path.to_path_buf(),
        kind: file_kind(meta.file_type()),
    })
}

/// Opens `path` for reading if it is a regular file (or a link to one);
/// anything else is [`WeightsError::NotARegularFile`], without opening it.
pub fn open_regular(path: &Path) -> Result<File, WeightsError> {
    let io = |source| WeightsError::Io {
        path: path.to_path_buf(),
        source,
    };
    check(path, &std::fs::metadata(path).map_err(io)?)?;
    open_checked(path)
}

/// Opens `path` for reading without blocking, whatever it has become since
/// it was checked, and refuses the handle unless it is a regular file.
/// `O_NONBLOCK` stays set: on a regular file it changes nothing.
fn open_checked(path: &Path) -> Result<File, WeightsError> {
    let io = |source| WeightsError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(path).map_err(io)?;
    check(path, &file.metadata().map_err(io)?)?;
    Ok(file)
}

/// Creates `path` for writing only if nothing is there: an existing file,
/// or a link (dangling or not, which `O_EXCL` never follows), is
/// [`WeightsError::AlreadyExists`].
pub fn create_new(path: &Path) -> Result<File, WeightsError> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NOFOLLOW);
    }
    options.open(path).map_err(|source| {
        // Linux answers a link with EEXIST (O_EXCL), some BSDs with ELOOP
        // (O_NOFOLLOW).
        #[cfg(unix)]
        let link = source.raw_os_error() == Some(libc::ELOOP);
        #[cfg(not(unix))]
        let link = false;
        if link || source.kind() == std::io::ErrorKind::AlreadyExists {
            return WeightsError::AlreadyExists {
                path: path.to_path_buf(),
            };
        }
        WeightsError::Io {
            path: path.to_path_buf(),
            source,
        }
    })
}

/// The whole of the regular file `path` as text (a JSON index).
pub fn read_regular_to_string(path: &Path) -> Result<String, WeightsError> {
    use std::io::Read;
    let mut text = String::new();
    open_regular(path)?
        .read_to_string(&mut text)
        .map_err(|source| WeightsError::Io {
            path: path.to_path_buf(),
            source,
        })?;
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directories_are_refused_by_kind() {
        let dir = std::env::temp_dir();
        let e = open_regular(&dir).unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
    }

    /// The open itself cannot block: a FIFO reached past the kind check
    /// (a path swapped in between) is opened without waiting for a writer
    /// and refused by the handle's kind.
    #[cfg(unix)]
    #[test]
    fn a_fifo_past_the_check_is_refused_without_blocking() {
        use std::time::Duration;
        let dir = std::env::temp_dir().join(format!("metrale-open-fifo-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("model.gguf");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.is_ok_and(|s| s.success()), "mkfifo");
        let (tx, rx) = std::sync::mpsc::channel();
        let path = fifo.clone();
        std::thread::spawn(move || {
            let _ = tx.send(open_checked(&path).map(drop).map_err(|e| e.to_string()));
        });
        let result = rx.recv_timeout(Duration::from_secs(5));
        if result.is_err() {
            // Release the blocked open (a writer appears) before failing.
            let _ = std::fs::OpenOptions::new().write(true).open(&fifo);
        }
        let _ = std::fs::remove_dir_all(&dir);
        let e = result.expect("the open returns at once").unwrap_err();
        assert!(e.contains("FIFO"), "{e}");
    }

    #[cfg(unix)]
    #[test]
    fn devices_are_refused_by_kind() {
        let e = open_regular(Path::new("/dev/zero"))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("/dev/zero: ") && e.contains("character device"),
            "{e}"
        );
    }
}
