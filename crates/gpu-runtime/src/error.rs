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
    #[error("{op}: {detail}")]
    Shape { op: &'static str, detail: String },
    #[error("{op}: dtype {dtype} is not supported here")]
    UnsupportedDType { op: &'static str, dtype: DType },
    #[error("{op}: output overlaps an input")]
    Aliasing { op: &'static str },
    /// The device reported an error. Faults such as an illegal address are
    /// *sticky*, as CUDA's are: once one happens every later op, copy,
    /// synchronisation, allocation and free of the backend fails with it, and
    /// the backend must be recreated. `op` is where the error surfaced, which
    /// on an asynchronous device is not necessarily the op that caused it
    /// (the message says so; `METRALE_DEBUG_SYNC=1` makes them the same).
    #[error("{op}: device error {code}: {message}")]
    Driver {
        op: &'static str,
        code: i32,
        message: String,
    },
    #[error("backend unavailable: {0}")]
    Unavailable(String),
}

pub type Result<T, E = GpuError> = std::result::Result<T, E>;
