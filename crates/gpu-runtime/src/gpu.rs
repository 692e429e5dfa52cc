//! The backend trait: device memory on the shared ledger, plus typed compute ops.

use std::fmt;
use std::num::NonZeroU64;
use std::panic::Location;

use metrale_core::DType;

use crate::error::{GpuError, Result};
use crate::hooks::Hooks;
use crate::ledger::{Ledger, LedgerReport};
use crate::ops::{DenseOps, KvLayout, KvSpec, MoeOps, Op, RecurrentOps, StateLayout};

/// An opaque device address. Model code passes these around but never
/// dereferences them; only the backend that allocated one gives it meaning.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DevicePtr(NonZeroU64);

impl DevicePtr {
    /// For backends: wraps a raw address. Zero is not an address.
    pub fn from_raw(raw: u64) -> Option<Self> {
        NonZeroU64::new(raw).map(Self)
    }

    /// For backends: the raw address.
    pub fn raw(self) -> u64 {
        self.0.get()
    }
}

impl fmt::Debug for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DevicePtr({:#x})", self.0)
    }
}

/// A typed run of elements in device memory: what ops take as operands.
///
/// `len` counts elements, not bytes. Shapes are passed to each op explicitly.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct DeviceSlice {
    ptr: DevicePtr,
    dtype: DType,
    len: usize,
}

impl DeviceSlice {
    pub fn new(ptr: DevicePtr, dtype: DType, len: usize) -> Self {
        Self { ptr, dtype, len }
    }

    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of the slice (whole blocks for a quantized dtype: slices of
    /// one are only made from block-aligned element counts).
    pub fn bytes(&self) -> usize {
        self.dtype
            .bytes_for(self.len)
            .unwrap_or(self.len * self.dtype.size_of())
    }

    /// The sub-slice of `len` elements starting at element `start`.
    pub fn slice(&self, start: usize, len: usize) -> Result<DeviceSlice> {
        let end = start
            .checked_add(len)
            .filter(|&e| e <= self.len)
            .ok_or_else(|| GpuError::Shape {
                op: "slice",
                detail: format!("{start}+{len} exceeds {} elements", self.len),
            })?;
        let _ = end;
        // A quantized slice splits only between blocks.
        let (Some(offset), Some(_)) = (self.dtype.bytes_for(start), self.dtype.bytes_for(len))
        else {
            return Err(GpuError::Shape {
                op: "slice",
                detail: format!(
                    "{start}+{len} splits a block of {} elements ({})",
                    self.dtype.block_elems(),
                    self.dtype
                ),
            });
        };
        let offset = offset as u64;
        let ptr = DevicePtr::from_raw(self.ptr.raw() + offset).expect("non-zero base plus offset");
        Ok(DeviceSlice {
            ptr,
            dtype: self.dtype,
            len,
        })
    }

    /// Rows `start..start+count` of a row-major matrix with `width` columns.
    pub fn rows(&self, start: usize, count: usize, width: usize) -> Result<DeviceSlice> {
        self.slice(start * width, count * width)
    }

    /// The same memory seen as elements of another type of the same size.
    pub fn checked_len(&self, op: &'static str, expected: usize) -> Result<()> {
        if self.len < expected {
            return Err(GpuError::Shape {
                op,
                detail: format!("operand has {} elements, needs {expected}", self.len),
            });
        }
        Ok(())
    }
}

/// Where an allocation was made, recorded on the ledger.
pub type CallSite = &'static Location<'static>;

/// A point in a backend's stream of work, recorded by
/// [`GpuBackend::record_fence`]: waiting on it waits for everything queued
/// before it. Only meaningful to the backend that recorded it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fence(u64);

impl Fence {
    /// For backends: wraps the backend's own id (an event, a counter).
    pub fn from_raw(raw: u64) -> Self {
        Self(raw)
    }

    /// For backends: the id.
    pub fn raw(self) -> u64 {
        self.0
    }
}

/// A captured run of queued work ([`GpuBackend::capture`]) that the
/// backend can replay. Only meaningful to the backend that captured it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GraphId(u64);

impl GraphId {
    /// For backends: wraps the backend's own id.
    pub fn from_raw(raw: u64) -> Self {
        Self(raw)
    }

    /// For backends: the id.
    pub fn raw(self) -> u64 {
        self.0
    }
}

/// A device: memory on the shared allocation ledger, and the compute ops.
///
/// Object safe; held as `Box<dyn GpuBackend>` / `&dyn GpuBackend`. Backends
/// implement the `*_raw` primitives and own a [`Hooks`]; the provided methods
/// around them (ledger bookkeeping, fault injection, transfer counters, the
/// sticky device error) are written here once, for every backend. Every op a
/// backend implements calls [`Hooks::begin_op`] first.
///
/// The device may be asynchronous: ops and copies are queued in order on the
/// backend's one stream and may still be running when they return. Only
/// `copy_d2h`, `synchronize` and `wait_fence` wait for the stream, which is
/// where an asynchronous device fault is reported (or at the next call, which
/// fails with the same sticky error).
pub trait GpuBackend: DenseOps + RecurrentOps + MoeOps + Send + Sync {
    /// "cpu", "cuda:0", ...
    fn name(&self) -> &str;

    /// Whether this backend implements `op`. One that does not returns an
    /// error from it (never a silent fallback). The conformance suite
    /// ([`crate::conformance`]) tests every op a backend supports; a
    /// model's ops can be checked against this before it runs.
    fn supports(&self, op: Op) -> bool;

    /// Whether weights held as `dtype` work in every op that reads weights
    /// (`embedding`, the matmuls, the grouped matmuls). f32, bf16 and f16
    /// everywhere; a backend with kernels for quantized formats
    /// ([`DType::Quant`]) says which. A model is refused at load, naming
    /// the tensor and the format, when its backend lacks one.
    fn supports_weights(&self, dtype: DType) -> bool {
        dtype.is_float()
    }

    /// The ledger of this backend's live allocations.
    fn ledger(&self) -> &Ledger;

    /// This backend's fault plan, counters, debug-sync switch and sticky error.
    fn hooks(&self) -> &Hooks;

    /// Allocates `bytes` of zeroed device memory, without ledger bookkeeping.
    fn alloc_raw(&self, bytes: usize) -> Result<DevicePtr>;

    /// Frees memory from `alloc_raw`, without ledger bookkeeping. Called even
    /// after a device fault: a backend returns what memory it still can.
    fn free_raw(&self, ptr: DevicePtr, bytes: usize) -> Result<()>;

    /// `copy_h2d` without the hooks.
    fn copy_h2d_raw(&self, src: &[u8], dst: DevicePtr, offset: usize) -> Result<()>;

    /// `copy_d2h` without the hooks.
    fn copy_d2h_raw(&self, src: DevicePtr, offset: usize, dst: &mut [u8]) -> Result<()>;

    /// `copy_d2d` without the hooks.
    fn copy_d2d_raw(
        &self,
        src: DevicePtr,
        src_offset: usize,
        dst: DevicePtr,
        dst_offset: usize,
        bytes: usize,
    ) -> Result<()>;

    /// `memset_zero` without the hooks.
    fn memset_zero_raw(&self, dst: DevicePtr, offset: usize, bytes: usize) -> Result<()>;

    /// `synchronize` without the hooks.
    fn synchronize_raw(&self) -> Result<()>;

    /// `record_fence` without the hooks.
    fn record_fence_raw(&self) -> Result<Fence>;

    /// `wait_fence` without the hooks.
    fn wait_fence_raw(&self, fence: Fence) -> Result<()>;

    /// How this backend stores a KV block for `spec` (its default dtype when
    /// the spec names none); an error names a dtype it cannot store.
    fn kv_layout(&self, spec: KvSpec) -> Result<KvLayout>;

    /// How this backend stores a recurrent state of `elements` values.
    fn state_layout(&self, elements: usize) -> StateLayout;

    /// How this backend stores an SSM or delta-rule state (the running sum
    /// of a Mamba-2 or gated-delta layer) of `elements` values: as
    /// [`Self::state_layout`] unless the backend was asked for a narrower
    /// one (the CPU's `with_bf16_ssm_state`). Conv windows keep
    /// `state_layout`.
    fn ssm_state_layout(&self, elements: usize) -> StateLayout {
        self.state_layout(elements)
    }

    /// The type `matmul`, `matmul_swiglu` and the grouped matmuls round the
    /// f32 activations to before multiplying them by weights of type
    /// `weights` (None: they multiply the f32 values). A GPU's tensor cores
    /// take both operands in the weights' type (bf16 or f16) and accumulate
    /// in f32; the conformance suite rounds its reference's inputs the same
    /// way, so the products are still held to f32 accumulation accuracy.
    fn matmul_input_rounding(&self, weights: DType) -> Option<DType> {
        let _ = weights;
        None
    }

    /// Whether the grouped matmuls compute each expert's rows to the bit as
    /// `matmul` / `matmul_swiglu` compute a call with those rows (the CPU:
    /// one kernel serves both). A GPU whose dense GEMM is a vendor library
    /// and whose grouped GEMM reads device-side routing in its own kernel
    /// says false: its rows then agree with `matmul` to f32-accumulation
    /// accuracy, which the conformance suite checks instead.
    fn grouped_matmul_is_matmul(&self) -> bool {
        true
    }

    /// Bytes this backend can still allocate, where it can tell (the host's
    /// available memory and cgroup limit for the CPU, free device memory for
    /// a GPU, and any limit the backend was given): what a model's memory
    /// plan is checked against before anything is allocated.
    fn available_memory(&self) -> Option<usize> {
        None
    }

    /// Whether [`capture`](Self::capture) works here (a CUDA backend, not in
    /// debug-sync mode). A backend without graphs runs every step eagerly.
    fn graphs_supported(&self) -> bool {
        false
    }

    /// Runs `body`, which queues ops on this backend, *capturing* them
    /// instead of running them: the returned graph replays the same work
    /// (the same kernels, device addresses and scalar arguments) on each
    /// [`replay`](Self::replay), reading whatever device memory then holds.
    /// Nothing `body` queues runs during the capture. While capturing,
    /// whatever would wait for the device, copy from host memory, or
    /// allocate or free (copies to and from the host, `synchronize`,
    /// fences, `alloc`/`free`, growth of the backend's own scratch) fails
    /// with an error saying so, and the capture is discarded: a caller runs
    /// `body`'s work once eagerly first, so the backend's scratch has grown.
    /// On failure nothing was queued.
    fn capture(&self, body: &mut dyn FnMut() -> Result<()>) -> Result<GraphId> {
        let _ = body;
        Err(GpuError::Unavailable(format!(
            "{} does not capture graphs",
            self.name()
        )))
    }

    /// Queues graph `graph` on the stream, ordered like any op. `Ok(false)`:
    /// the graph is stale (memory of the backend's own it points into has
    /// moved since the capture, e.g. a scratch buffer grew) and nothing was
    /// queued; the caller releases it and captures again.
    fn replay(&self, graph: GraphId) -> Result<bool> {
        let _ = graph;
        Err(GpuError::Unavailable(format!(
            "{} does not replay graphs",
            self.name()
        )))
    }

    /// Destroys a captured graph (once no longer queued it frees its
    /// resources). Graphs are not on the ledger; a backend destroys the ones
    /// still alive when it is dropped.
    fn release_graph(&self, graph: GraphId) -> Result<()> {
        let _ = graph;
        Err(GpuError::Unavailable(format!(
            "{} has no graphs",
            self.name()
        )))
    }

    /// Copies host bytes to `dst + offset` (bytes). Ordered on the backend's
    /// stream after everything queued before it; `src` may be reused as soon
    /// as this returns (the backend stages it if the copy is still queued).
    fn copy_h2d(&self, src: &[u8], dst: DevicePtr, offset: usize) -> Result<()> {
        let hooks = self.hooks();
        hooks.before_copy("copy_h2d")?;
        self.copy_h2d_raw(src, dst, offset)?;
        hooks.count_h2d(src.len());
        Ok(())
    }

    /// Copies `dst.len()` bytes from `src + offset` to the host. Waits for the
    /// stream to reach the copy (everything queued before it finishes), so a
    /// device fault of an earlier op surfaces here.
    fn copy_d2h(&self, src: DevicePtr, offset: usize, dst: &mut [u8]) -> Result<()> {
        let hooks = self.hooks();
        hooks.before_copy("copy_d2h")?;
        self.copy_d2h_raw(src, offset, dst)?;
        hooks.count_d2h(dst.len());
        Ok(())
    }

    /// Copies `bytes` between device addresses (ranges must not overlap),
    /// ordered on the stream.
    fn copy_d2d(
        &self,
        src: DevicePtr,
        src_offset: usize,
        dst: DevicePtr,
        dst_offset: usize,
        bytes: usize,
    ) -> Result<()> {
        let hooks = self.hooks();
        hooks.before_copy("copy_d2d")?;
        self.copy_d2d_raw(src, src_offset, dst, dst_offset, bytes)?;
        hooks.count_d2d();
        Ok(())
    }

    /// Sets `bytes` at `dst + offset` to zero, ordered on the stream.
    fn memset_zero(&self, dst: DevicePtr, offset: usize, bytes: usize) -> Result<()> {
        let hooks = self.hooks();
        hooks.check("memset_zero")?;
        self.memset_zero_raw(dst, offset, bytes)?;
        hooks.count_memset();
        Ok(())
    }

    /// Waits for all queued work to finish.
    fn synchronize(&self) -> Result<()> {
        self.hooks().check("synchronize")?;
        self.synchronize_raw()
    }

    /// Marks the current end of the stream, for a later `wait_fence`.
    fn record_fence(&self) -> Result<Fence> {
        self.hooks().check("record_fence")?;
        self.record_fence_raw()
    }

    /// Waits until the work queued before `fence` has finished.
    fn wait_fence(&self, fence: Fence) -> Result<()> {
        self.hooks().check("wait_fence")?;
        self.wait_fence_raw(fence)
    }

    /// Allocates and records the allocation with its owner and call site.
    fn alloc_at(&self, bytes: usize, owner: &str, site: CallSite) -> Result<DevicePtr> {
        self.hooks().before_alloc()?;
        // The raw allocation does not know its owner; its error names it.
        let ptr = self.alloc_raw(bytes.max(1)).map_err(|e| match e {
            GpuError::OutOfMemory { bytes, live, .. } => GpuError::OutOfMemory {
                bytes,
                owner: owner.to_string(),
                live,
            },
            other => other,
        })?;
        self.ledger().insert(ptr, bytes.max(1), owner, site);
        Ok(ptr)
    }

    /// Frees a ledgered allocation. The pointer leaves the ledger *before* the
    /// free is attempted, whatever the free returns, so it is never freed twice.
    /// After a device fault the free is still attempted (the CPU returns the
    /// memory) and the sticky error is reported; an injected free fault also
    /// returns the memory and reports its error.
    fn free(&self, ptr: DevicePtr) -> Result<()> {
        let entry = self
            .ledger()
            .remove(ptr)
            .ok_or(GpuError::UnknownPointer { ptr: ptr.raw() })?;
        let hooks = self.hooks();
        hooks.record_free(&entry.owner);
        hooks.free_with(|| self.free_raw(ptr, entry.bytes))
    }

    /// Frees everything still on the ledger; returns how many allocations it
    /// freed. Failures (injected, or after a device fault) are logged: the
    /// memory is gone from the ledger either way.
    fn sweep_unreleased(&self) -> usize {
        let leftovers = self.ledger().drain();
        let count = leftovers.len();
        for (ptr, entry) in leftovers {
            tracing::debug!(owner = %entry.owner, bytes = entry.bytes, site = %entry.site, "sweeping unreleased allocation");
            if let Err(e) = self.hooks().free_with(|| self.free_raw(ptr, entry.bytes)) {
                tracing::warn!(owner = %entry.owner, "sweep could not free {ptr:?}: {e}");
            }
        }
        count
    }

    /// Bytes currently allocated through the ledger.
    fn live_bytes(&self) -> usize {
        self.ledger().live_bytes()
    }

    /// Live allocations grouped by owner.
    fn ledger_report(&self) -> LedgerReport {
        self.ledger().report()
    }
}

impl dyn GpuBackend + '_ {
    /// Allocates `bytes` for `owner`, recording the caller's location.
    #[track_caller]
    pub fn alloc(&self, bytes: usize, owner: &str) -> Result<DevicePtr> {
        self.alloc_at(bytes, owner, Location::caller())
    }

    /// Allocates a zeroed slice of `len` elements of `dtype` for `owner`.
    #[track_caller]
    pub fn alloc_slice(&self, dtype: DType, len: usize, owner: &str) -> Result<DeviceSlice> {
        if len % dtype.block_elems() != 0 {
            return Err(GpuError::Shape {
                op: "alloc_slice",
                detail: format!(
                    "{len} elements of {dtype} for {owner} are not whole blocks of {}",
                    dtype.block_elems()
                ),
            });
        }
        let bytes = dtype.bytes_for(len).ok_or_else(|| GpuError::OutOfMemory {
            bytes: usize::MAX,
            owner: owner.to_string(),
            live: self.live_bytes(),
        })?;
        let ptr = self.alloc_at(bytes, owner, Location::caller())?;
        Ok(DeviceSlice::new(ptr, dtype, len))
    }

    /// Uploads f32 values into `dst` starting at element 0.
    pub fn upload_f32(&self, src: &[f32], dst: DeviceSlice) -> Result<()> {
        check_f32(dst, src.len(), "upload_f32")?;
        self.copy_h2d(as_bytes(src), dst.ptr(), 0)
    }

    /// Downloads the f32 elements of `src`.
    pub fn download_f32(&self, src: DeviceSlice) -> Result<Vec<f32>> {
        check_f32(src, src.len(), "download_f32")?;
        let mut out = vec![0f32; src.len()];
        // SAFETY: f32 has no invalid bit patterns and the byte view covers
        // exactly `out`'s initialised storage.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), out.len() * 4) };
        self.copy_d2h(src.ptr(), 0, bytes)?;
        Ok(out)
    }

    /// Copies all of `src` into `dst` (same dtype; `dst` at least as long).
    pub fn copy_slice(&self, src: DeviceSlice, dst: DeviceSlice) -> Result<()> {
        if src.dtype() != dst.dtype() || dst.len() < src.len() {
            return Err(GpuError::Shape {
                op: "copy_slice",
                detail: format!(
                    "{} x {} into {} x {}",
                    src.len(),
                    src.dtype(),
                    dst.len(),
                    dst.dtype()
                ),
            });
        }
        self.copy_d2d(src.ptr(), 0, dst.ptr(), 0, src.bytes())
    }

    /// Zeroes all of `dst`.
    pub fn zero(&self, dst: DeviceSlice) -> Result<()> {
        self.memset_zero(dst.ptr(), 0, dst.bytes())
    }

    /// Frees every pointer, even after a failure; returns the first error.
    /// What resources' `release` is made of.
    pub fn free_all(&self, ptrs: impl IntoIterator<Item = DevicePtr>) -> Result<()> {
        let mut first = None;
        for p in ptrs {
            if let Err(e) = self.free(p) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

fn check_f32(s: DeviceSlice, n: usize, op: &'static str) -> Result<()> {
    if s.dtype() != DType::F32 {
        return Err(GpuError::UnsupportedDType {
            op,
            dtype: s.dtype(),
        });
    }
    s.checked_len(op, n)
}

/// The bytes of an f32 slice.
pub fn as_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: any initialised f32 storage is valid as bytes; the length is
    // the same storage measured in bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}
