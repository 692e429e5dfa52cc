//! The backend's own scratch memory, outside the ledger.
//!
//! Some ops need device memory that belongs to no model object: cuBLASLt's
//! workspace, activations cast to a GEMM's input type, split-KV attention
//! partials. That memory is the backend's own: it is not on the ledger (so
//! `live_bytes`, `sweep_unreleased` and a model's teardown never see it),
//! the memory limit ([`CudaBackend::with_memory_limit`]) does not count it,
//! and it is freed when the backend is dropped, before the
//! context goes. `available_memory` reports the driver's free memory, which
//! already leaves it out. [`CudaBackend::scratch_bytes`] tells how much
//! there is, for reports.
//!
//! One buffer per [`Scratch`] kind, allocated with the stream-ordered
//! allocator on the backend's stream. When an op asks for more than the
//! buffer holds, the old buffer is freed on the stream (the free takes
//! effect after the work already queued, which may still be reading it) and
//! a larger one allocated after it, so growing never waits for the device.

use cudarc::driver::result;
use parking_lot::Mutex;

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

impl Scratch {
    const COUNT: usize = 3;

    fn index(self) -> usize {
        match self {
            Scratch::GemmInput => 0,
            Scratch::GemmWorkspace => 1,
            Scratch::AttnPartials => 2,
        }
    }
}

/// Scratch buffers are allocated in multiples of this (and so never tiny).
const GRANULE: usize = 1 << 20;

/// The scratch buffers of a backend: (address, bytes) per kind, 0 when none.
#[derive(Default)]
pub(super) struct ScratchBuffers {
    buffers: Mutex<[(u64, usize); Scratch::COUNT]>,
}

impl ScratchBuffers {
    /// Bytes held over all kinds.
    fn bytes(&self) -> usize {
        self.buffers.lock().iter().map(|&(_, bytes)| bytes).sum()
    }
}

impl CudaBackend {
    /// At least `bytes` of scratch of `kind`, valid for work queued on the
    /// backend's stream until the next call for the same kind.
    ///
    /// The caller queues its work on the backend's stream while nothing else
    /// asks for the same kind (a larger request would free the buffer under
    /// it): the GEMM holds its own lock across its use of
    /// [`Scratch::GemmInput`] and [`Scratch::GemmWorkspace`].
    pub(crate) fn scratch(&self, kind: Scratch, bytes: usize) -> Result<Ptr> {
        let mut buffers = self.scratch.buffers.lock();
        let slot = &mut buffers[kind.index()];
        if slot.0 != 0 && slot.1 >= bytes.max(1) {
            return Ok(Ptr(slot.0));
        }
        // Growth frees the old buffer, which a captured graph may point into.
        self.graphs.refuse_during_capture("scratch growth")?;
        let size = bytes.max(1).div_ceil(GRANULE) * GRANULE;
        self.ctx.bind()?;
        let stream = self.ctx.stream;
        if slot.0 != 0 {
            let old = std::mem::take(slot);
            self.graphs.scratch_moved();
            // SAFETY: `old` was allocated here on this stream; the free is
            // ordered after the work already queued that may still use it.
            unsafe { result::free_async(old.0, stream) }
                .map_err(|e| self.device_error("scratch", e))?;
        }
        // SAFETY: a stream-ordered allocation on the backend's live stream.
        let raw = unsafe { result::malloc_async(stream, size) }.map_err(|e| match e.0 {
            cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => GpuError::OutOfMemory {
                bytes: size,
                owner: format!("{} scratch ({kind:?})", self.label),
                live: self.ledger.live_bytes(),
            },
            _ => self.device_error("scratch", e),
        })?;
        *slot = (raw, size);
        Ok(Ptr(raw))
    }

    /// Bytes of the backend's own scratch memory (outside the ledger): the
    /// GEMM workspace and staging, attention partials.
    pub fn scratch_bytes(&self) -> usize {
        self.scratch.bytes()
    }

    /// Frees every scratch buffer on the stream (at drop; the caller
    /// synchronises afterwards).
    pub(super) fn free_scratch(&self) {
        let mut buffers = self.scratch.buffers.lock();
        if buffers.iter().all(|&(ptr, _)| ptr == 0) || self.ctx.bind().is_err() {
            return;
        }
        for slot in buffers.iter_mut() {
            let (ptr, _) = std::mem::take(slot);
            if ptr != 0 {
                // SAFETY: allocated by `scratch` on this stream, freed once
                // (the slot is cleared), after the work queued before.
                unsafe {
                    let _ = result::free_async(ptr, self.ctx.stream);
                }
            }
        }
    }
}
