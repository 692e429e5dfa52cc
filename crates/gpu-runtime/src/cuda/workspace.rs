//! The backend's own scratch memory, outside the ledger. PLACEHOLDER: the
//! API the ops call; the body is being written.

use super::CudaBackend;
use super::launch::Ptr;
use crate::error::{GpuError, Result};

/// What a scratch buffer is for; each kind is a separate buffer, so an op
/// may hold one of each at once. Buffers are reused by the ops that follow
/// on the stream (stream order makes that safe) and grow when asked for more.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scratch {
    /// Activations cast to a GEMM's low-precision input type.
    GemmInput,
    /// cuBLASLt's workspace.
    GemmWorkspace,
    /// Split-KV attention partials (running max, sum, accumulator).
    AttnPartials,
}

impl CudaBackend {
    /// At least `bytes` of scratch of `kind`, valid for work queued on the
    /// backend's stream until the next call for the same kind.
    pub(crate) fn scratch(&self, _kind: Scratch, _bytes: usize) -> Result<Ptr> {
        Err(GpuError::Unavailable("scratch: not written yet".into()))
    }
}
