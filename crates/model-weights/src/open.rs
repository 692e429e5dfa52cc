//! Opening weight files: only regular files.
//!
//! A FIFO named `model.gguf` blocks `open(2)` until a writer appears, and
//! a device (`/dev/zero`) or a pipe reads without end: given as a model,
//! either hung the loader or read until memory ran out. The kind of file
//! is checked before it is opened (so a FIFO is never opened), and again
//! on the opened handle (in case the path changed in between).

use std::fs::{File, FileType, Metadata};
use std::path::Path;

use crate::error::WeightsError;

/// What kind of file `t` is, in words, for an error message.
fn kind(t: FileType) -> &'static str {
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
    if t.is_dir() {
        "a directory"
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
        kind: kind(meta.file_type()),
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
    let file = File::open(path).map_err(io)?;
    check(path, &file.metadata().map_err(io)?)?;
    Ok(file)
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
