//! The error enum of the backends.

use metrale_core::DType;

/// What a backend operation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("out of device memory allocating {bytes} bytes for {owner:?} ({live} bytes live)")]
    OutOfMemory {
        bytes: usize,
        owner: String,
        live: usize,
    },
    #[error("injected fault: {op} #{index} fails")]
    InjectedFault { op: &'static str, index: usize },
    #[error("pointer {ptr:#x} is not a live allocation of this backend")]
    UnknownPointer { ptr: u64 },
    #[error("{op}: range {offset}..{end} bytes lies outside its allocation of {size} bytes")]
    OutOfRange {
        op: &'static str,
        offset: usize,
        end: usize,
        size: usize,
    },
    #[error("{op}: {detail}")]
    Shape { op: &'static str, detail: String },
    #[error("{op}: dtype {dtype} is not supported here")]
    UnsupportedDType { op: &'static str, dtype: DType },
    #[error("{op}: output overlaps an input")]
    Aliasing { op: &'static str },
    #[error("backend unavailable: {0}")]
    Unavailable(String),
}

pub type Result<T, E = GpuError> = std::result::Result<T, E>;
