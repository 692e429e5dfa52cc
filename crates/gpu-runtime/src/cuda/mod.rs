//! The CUDA backend (feature `cuda`): device memory on the shared ledger,
//! PTX kernels compiled from `kernels/*.cu` by `cargo xtask ptx`, and GEMMs
//! through cuBLASLt.
//!
//! cudarc loads `libcuda.so.1` and `libcublasLt.so.13` at run time, so a
//! build with the feature runs on machines without them: there
//! [`CudaBackend::try_new`] returns [`GpuError::Unavailable`] saying what is
//! missing, before any call that could panic.
//!
//! Memory is the driver's stream-ordered allocator on the backend's one
//! stream: an allocation is usable by the ops queued after it and a free
//! takes effect after the ops queued before it. Every pointer the model
//! code holds is on the ledger with its owner and call site, exactly as on
//! the CPU, so the seed's teardown and `sweep_unreleased` work unchanged.
//! The backend's own scratch (cuBLASLt's workspace, staging for bf16
//! operands, attention partials; `workspace.rs`) is allocated when first
//! needed, outside the ledger, grown on demand and freed on drop;
//! `available_memory` leaves it out and [`CudaBackend::scratch_bytes`]
//! reports it.
//!
//! Every op of `ops/` runs here: the dense transformer's (`dense.rs`,
//! `attention.rs`, `gemm.rs`), Mamba-2's (`recurrent.rs`), the gated delta
//! rule (`delta.rs`) and the MoE ops (`moe.rs`).

mod driver;
pub(crate) mod launch;
#[rustfmt::skip]
mod kernels;
mod args;
mod attention;
#[cfg(test)]
mod core_tests;
mod delta;
#[cfg(test)]
mod delta_tests;
mod dense;
#[cfg(test)]
mod device_tests;
mod gemm;
mod graph;
mod moe;
mod moe_args;
#[cfg(test)]
mod moe_tests;
mod probe;
mod recurrent;
#[cfg(test)]
mod recurrent_device_tests;
#[cfg(test)]
mod recurrent_tests;
#[cfg(test)]
mod tests;
mod workspace;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::{result, sys};
use metrale_core::DType;
use parking_lot::Mutex;

use crate::error::{GpuError, Result};
use crate::gpu::{DevicePtr, Fence, GpuBackend, GraphId};
use crate::hooks::Hooks;
use crate::ledger::Ledger;
use crate::ops::{KvLayout, KvSpec, Op, StateLayout};

pub use driver::MIN_DRIVER_VERSION;
use driver::{Context, driver_error, is_sticky};
use launch::Modules;

/// The ops this backend runs: all of them. A later op family that CUDA
/// does not have yet is left out here, and a model needing it is refused at
/// load with its name.
pub const SUPPORTED_OPS: &[Op] = &Op::ALL;

/// A recorded CUDA event.
struct Event(sys::CUevent);

// SAFETY: an event handle may be waited on and destroyed from any thread
// with the context current (`bind`).
unsafe impl Send for Event {}

/// One NVIDIA GPU.
pub struct CudaBackend {
    label: String,
    ledger: Ledger,
    hooks: Hooks,
    memory_limit: Option<usize>,
    /// Events of fences not yet waited on, by fence id.
    fences: Mutex<HashMap<u64, Event>>,
    next_fence: AtomicU64,
    /// The backend's own scratch buffers (`workspace.rs`), outside the ledger.
    scratch: workspace::ScratchBuffers,
    /// The cuBLASLt handle and plans (`gemm.rs`), created at the first GEMM.
    blas: gemm::BlasState,
    /// Captured graphs and the capture state (`graph.rs`).
    graphs: graph::Graphs,
    // Dropped in this order: the modules before the context they live in.
    modules: Modules,
    ctx: Context,
}

impl CudaBackend {
    /// Opens device `ordinal`. Fails with [`GpuError::Unavailable`] saying
    /// why when there is no driver library, the driver is too old, there is
    /// no such device, or the kernels do not load; never panics.
    pub fn try_new(ordinal: usize) -> Result<Self> {
        let ctx = Context::new(ordinal)?;
        let modules = Modules::load(&kernels::MODULES)?;
        let hooks = Hooks::new();
        if std::env::var_os("METRALE_DEBUG_SYNC").is_some_and(|v| v == "1") {
            hooks.set_debug_sync(true);
        }
        Ok(Self {
            label: format!("cuda:{ordinal}"),
            ledger: Ledger::new(),
            hooks,
            memory_limit: None,
            fences: Mutex::new(HashMap::new()),
            next_fence: AtomicU64::new(1),
            scratch: Default::default(),
            blas: Default::default(),
            graphs: Default::default(),
            modules,
            ctx,
        })
    }

    /// Refuses allocations beyond `limit` live bytes.
    pub fn with_memory_limit(mut self, limit: Option<usize>) -> Self {
        self.memory_limit = limit;
        self
    }

    /// The device's name, e.g. "NVIDIA H200".
    pub fn device_name(&self) -> &str {
        &self.ctx.name
    }

    /// The compute capability, e.g. (9, 0).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.ctx.compute_capability
    }

    /// Streaming multiprocessors.
    pub fn multiprocessors(&self) -> i32 {
        self.ctx.multiprocessors
    }

    /// The driver's CUDA version as cuDriverGetVersion gives it (13000: 13.0).
    pub fn driver_version(&self) -> i32 {
        self.ctx.driver_version
    }

    /// Free and total device memory, bytes.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.ctx.memory_info()
    }

    /// A driver error of `op`: faults that poison the context become the
    /// backend's sticky error.
    fn device_error(&self, op: &'static str, e: result::DriverError) -> GpuError {
        let error = driver_error(op, e);
        if is_sticky(&e)
            && let GpuError::Driver { code, message, .. } = &error
        {
            return self.hooks.record_device_fault(op, *code, message);
        }
        error
    }

    /// After queuing `op`: in debug-sync mode, wait for it so that a fault
    /// is reported by the op that caused it.
    fn after_launch(&self, op: &'static str) -> Result<()> {
        if self.hooks.debug_sync() {
            self.stream_sync(op)?;
        }
        Ok(())
    }

    fn stream_sync(&self, op: &'static str) -> Result<()> {
        self.graphs.refuse_during_capture(op)?;
        self.ctx.bind()?;
        // SAFETY: the stream lives as long as the context.
        unsafe { result::stream::synchronize(self.ctx.stream) }
            .map_err(|e| self.device_error(op, e))
    }

    fn check_range(
        &self,
        op: &'static str,
        ptr: DevicePtr,
        offset: usize,
        bytes: usize,
    ) -> Result<u64> {
        let start = ptr.raw() + offset as u64;
        if bytes > 0 && self.ledger.containing(start, bytes).is_none() {
            return Err(GpuError::Shape {
                op,
                detail: format!("{bytes} bytes at {start:#x} lie outside every live allocation"),
            });
        }
        Ok(start)
    }
}

impl GpuBackend for CudaBackend {
    fn name(&self) -> &str {
        &self.label
    }

    fn supports(&self, op: Op) -> bool {
        SUPPORTED_OPS.contains(&op)
    }

    fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    fn hooks(&self) -> &Hooks {
        &self.hooks
    }

    fn alloc_raw(&self, bytes: usize) -> Result<DevicePtr> {
        let live = self.ledger.live_bytes();
        let oom = || GpuError::OutOfMemory {
            bytes,
            owner: String::new(),
            live,
        };
        self.graphs.refuse_during_capture("alloc")?;
        if self.memory_limit.is_some_and(|limit| live + bytes > limit) {
            return Err(oom());
        }
        self.ctx.bind()?;
        let stream = self.ctx.stream;
        // SAFETY: a stream-ordered allocation on the backend's live stream;
        // the memset covers exactly the bytes just allocated.
        let raw = unsafe {
            let raw = result::malloc_async(stream, bytes).map_err(|e| match e.0 {
                sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => oom(),
                _ => self.device_error("alloc", e),
            })?;
            result::memset_d8_async(raw, 0, bytes, stream)
                .map_err(|e| self.device_error("alloc", e))?;
            raw
        };
        DevicePtr::from_raw(raw).ok_or_else(oom)
    }

    fn free_raw(&self, ptr: DevicePtr, _bytes: usize) -> Result<()> {
        self.graphs.refuse_during_capture("free")?;
        self.ctx.bind()?;
        // SAFETY: `ptr` came from `alloc_raw` (the ledger entry was removed
        // first, so it is freed once); the free is ordered after the work
        // queued before it on the same stream.
        unsafe { result::free_async(ptr.raw(), self.ctx.stream) }
            .map_err(|e| self.device_error("free", e))
    }

    fn copy_h2d_raw(&self, src: &[u8], dst: DevicePtr, offset: usize) -> Result<()> {
        self.graphs.refuse_during_capture("copy_h2d")?;
        let at = self.check_range("copy_h2d", dst, offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        self.ctx.bind()?;
        // SAFETY: the destination range lies in a live allocation (checked);
        // from pageable memory the driver stages `src` before returning, so
        // the caller may reuse it at once.
        unsafe { result::memcpy_htod_async(at, src, self.ctx.stream) }
            .map_err(|e| self.device_error("copy_h2d", e))?;
        self.after_launch("copy_h2d")
    }

    fn copy_d2h_raw(&self, src: DevicePtr, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.graphs.refuse_during_capture("copy_d2h")?;
        let at = self.check_range("copy_d2h", src, offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        self.ctx.bind()?;
        // SAFETY: the source range lies in a live allocation (checked); the
        // stream is synchronised before `dst` is read or released.
        unsafe { result::memcpy_dtoh_async(dst, at, self.ctx.stream) }
            .map_err(|e| self.device_error("copy_d2h", e))?;
        self.stream_sync("copy_d2h")
    }

    fn copy_d2d_raw(
        &self,
        src: DevicePtr,
        src_offset: usize,
        dst: DevicePtr,
        dst_offset: usize,
        bytes: usize,
    ) -> Result<()> {
        self.graphs.check_queue("copy_d2d")?;
        let from = self.check_range("copy_d2d", src, src_offset, bytes)?;
        let to = self.check_range("copy_d2d", dst, dst_offset, bytes)?;
        if bytes == 0 {
            return Ok(());
        }
        self.ctx.bind()?;
        // SAFETY: both ranges lie in live allocations (checked).
        unsafe { result::memcpy_dtod_async(to, from, bytes, self.ctx.stream) }
            .map_err(|e| self.device_error("copy_d2d", e))?;
        self.after_launch("copy_d2d")
    }

    fn memset_zero_raw(&self, dst: DevicePtr, offset: usize, bytes: usize) -> Result<()> {
        self.graphs.check_queue("memset_zero")?;
        let at = self.check_range("memset_zero", dst, offset, bytes)?;
        if bytes == 0 {
            return Ok(());
        }
        self.ctx.bind()?;
        // SAFETY: the range lies in a live allocation (checked).
        unsafe { result::memset_d8_async(at, 0, bytes, self.ctx.stream) }
            .map_err(|e| self.device_error("memset_zero", e))?;
        self.after_launch("memset_zero")
    }

    fn synchronize_raw(&self) -> Result<()> {
        self.stream_sync("synchronize")
    }

    fn record_fence_raw(&self) -> Result<Fence> {
        self.graphs.refuse_during_capture("record_fence")?;
        self.ctx.bind()?;
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| self.device_error("record_fence", e))?;
        // SAFETY: a fresh event recorded on the backend's live stream.
        if let Err(e) = unsafe { result::event::record(event, self.ctx.stream) } {
            // SAFETY: the event was never handed out.
            unsafe {
                let _ = result::event::destroy(event);
            }
            return Err(self.device_error("record_fence", e));
        }
        let id = self.next_fence.fetch_add(1, Ordering::Relaxed);
        self.fences.lock().insert(id, Event(event));
        Ok(Fence::from_raw(id))
    }

    fn wait_fence_raw(&self, fence: Fence) -> Result<()> {
        self.graphs.refuse_during_capture("wait_fence")?;
        let Some(Event(event)) = self.fences.lock().remove(&fence.raw()) else {
            // Waited on before: everything before it has finished.
            return Ok(());
        };
        self.ctx.bind()?;
        // SAFETY: the event was recorded by `record_fence_raw` and is
        // destroyed once, here.
        unsafe {
            let waited = result::event::synchronize(event);
            let _ = result::event::destroy(event);
            waited.map_err(|e| self.device_error("wait_fence", e))
        }
    }

    fn kv_layout(&self, spec: KvSpec) -> Result<KvLayout> {
        let dtype = spec.dtype.unwrap_or(DType::BF16);
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(GpuError::UnsupportedDType {
                op: "kv_layout",
                dtype,
            });
        }
        Ok(KvLayout {
            dtype,
            block_elements: spec.kv_width.saturating_mul(spec.block_size),
        })
    }

    fn state_layout(&self, elements: usize) -> StateLayout {
        StateLayout {
            dtype: DType::F32,
            elements,
        }
    }

    /// cuBLASLt multiplies bf16 (f16) weights by activations cast to bf16
    /// (f16), accumulating in f32 (see `gemm.rs`); f32 weights by f32.
    fn matmul_input_rounding(&self, weights: DType) -> Option<DType> {
        matches!(weights, DType::BF16 | DType::F16).then_some(weights)
    }

    fn graphs_supported(&self) -> bool {
        self.graphs_supported_here()
    }

    fn capture(&self, body: &mut dyn FnMut() -> Result<()>) -> Result<GraphId> {
        self.capture_graph(body)
    }

    fn replay(&self, graph: GraphId) -> Result<bool> {
        self.replay_graph(graph)
    }

    fn release_graph(&self, graph: GraphId) -> Result<()> {
        self.destroy_graph(graph)
    }

    /// The grouped GEMM is `moe.cu`'s tiled kernel (it reads the routing on
    /// the device); `matmul` is cuBLASLt's: they agree to f32 accumulation,
    /// not to the bit.
    fn grouped_matmul_is_matmul(&self) -> bool {
        false
    }

    fn available_memory(&self) -> Option<usize> {
        let free = self.memory_info().ok().map(|(free, _)| free);
        match (free, self.memory_limit) {
            (Some(free), Some(limit)) => Some(free.min(limit.saturating_sub(self.live_bytes()))),
            (free, limit) => free.or(limit.map(|l| l.saturating_sub(self.live_bytes()))),
        }
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let _ = self.stream_sync("drop");
        // Graphs first: they point into the memory freed below.
        self.destroy_graphs();
        let n = self.sweep_unreleased();
        if n > 0 {
            tracing::warn!(
                "{} dropped with {n} live allocation(s); freed them",
                self.label
            );
        }
        for (_, Event(event)) in self.fences.lock().drain() {
            // SAFETY: events recorded here and never waited on; destroyed once.
            unsafe {
                let _ = result::event::destroy(event);
            }
        }
        // The backend's own memory and cuBLASLt, before the context goes
        // (the stream is idle: synchronised above).
        if self.ctx.bind().is_ok() {
            self.blas.release();
        }
        self.free_scratch();
        let _ = self.stream_sync("drop");
    }
}
