//! The CPU backend: host memory behind the ledger, and the reference
//! implementation of every op.
//!
//! Memory is 64-byte aligned and zeroed. Ops reach it through [`CpuBackend::read`]
//! and [`CpuBackend::write`], the one place host pointers are made from device
//! addresses; they check that the range lies inside a live allocation first.

#[cfg(target_arch = "x86_64")]
mod amx_os;
mod attention;
mod dense;
mod elementwise;
mod gemm_bf16;
mod gemv;
mod host_memory;
mod kernels;
mod kv_store;
mod moe;
mod profile;
pub mod quant;
mod recurrent;
mod routing;
mod simd;
mod team;
mod vec;

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::sync::atomic::{AtomicU64, Ordering};

use half::{bf16, f16};
use metrale_core::DType;

use dense::need;
use kernels::Weights;

use crate::error::{GpuError, Result};
use crate::gpu::{DevicePtr, DeviceSlice, Fence, GpuBackend};
use crate::hooks::Hooks;
use crate::ledger::Ledger;
use crate::ops::{KvLayout, KvSpec, StateLayout};
pub use gemm_bf16::{Kernel as Bf16Kernel, amx_peak_block};
pub use profile::OpTime;

const ALIGN: usize = 64;

/// Host memory and multithreaded kernels.
pub struct CpuBackend {
    ledger: Ledger,
    /// Fault plan, counters, debug sync and the sticky error (see `hooks.rs`).
    hooks: Hooks,
    /// The last fence id handed out: the CPU is synchronous, so every fence
    /// is complete when recorded; the ids only tell fences apart.
    fences: AtomicU64,
    /// Refuse allocations beyond this many live bytes (None: no limit).
    memory_limit: Option<usize>,
    /// Runs the `gemm` crate's f32 GEMM (prefill with f32 arithmetic), which
    /// parallelises over rayon.
    pool: rayon::ThreadPool,
    /// Persistent workers that spin between ops (see `team.rs`): every other
    /// parallel loop of every op runs on them.
    team: team::Team,
    /// Matmuls with bf16 weights round the activations to bf16 and use bf16
    /// dot products, the weights packed in panels at load (see
    /// `gemm_bf16/`); off by default.
    bf16_dot: bool,
    /// The bf16 kernel asked for ([`CpuBackend::with_bf16_kernel`]); None:
    /// the fastest this CPU runs.
    bf16_kernel: Option<Bf16Kernel>,
    /// Round every recurrent state to bf16 after each update
    /// ([`CpuBackend::with_bf16_state_rounding`]); off by default.
    bf16_states: bool,
    /// Hold SSM / delta-rule states in bf16 ([`CpuBackend::with_bf16_ssm_state`]).
    bf16_ssm_state: bool,
    /// Wall time per op, when asked for ([`CpuBackend::with_op_profile`]).
    profile: profile::OpProfile,
    /// Ops this backend pretends not to have ([`CpuBackend::lacking`]).
    lacking: Vec<crate::ops::Op>,
    /// The quantized activations of matmuls with GGML weights (grown to the
    /// largest step, then reused: nothing is allocated per call).
    quant_scratch: parking_lot::Mutex<quant::QuantScratch>,
}

/// The most CPU threads per core [`CpuBackend::try_with_threads`] accepts.
pub const MAX_THREADS_PER_CORE: usize = 4;

impl CpuBackend {
    /// A backend using every core.
    pub fn new() -> Self {
        Self::with_threads(0)
    }

    /// A backend with `threads` worker threads (0: one per core). Panics
    /// where [`try_with_threads`](Self::try_with_threads) errs.
    pub fn with_threads(threads: usize) -> Self {
        match Self::try_with_threads(threads) {
            Ok(cpu) => cpu,
            Err(e) => panic!("{e}"),
        }
    }

    /// A backend with `threads` worker threads (0: one per core), refusing
    /// more than [`MAX_THREADS_PER_CORE`] per core the system reports (the
    /// team's threads spin between ops: beyond the cores they only take
    /// turns) and threads the system cannot spawn.
    pub fn try_with_threads(threads: usize) -> Result<Self> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let most = cores.saturating_mul(MAX_THREADS_PER_CORE);
        if threads > most {
            return Err(GpuError::Unavailable(format!(
                "{threads} threads asked for, but this machine runs {cores} at a time; \
                 at most {most} ({MAX_THREADS_PER_CORE} per core) are allowed"
            )));
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("metrale-cpu-{i}"))
            .build()
            .map_err(|e| GpuError::Unavailable(format!("starting {threads} CPU threads: {e}")))?;
        let team = team::Team::new(pool.current_num_threads());
        Ok(Self {
            ledger: Ledger::new(),
            hooks: Hooks::new(),
            fences: AtomicU64::new(0),
            memory_limit: None,
            pool,
            team,
            bf16_dot: false,
            bf16_kernel: None,
            bf16_states: false,
            bf16_ssm_state: false,
            profile: profile::OpProfile::default(),
            lacking: Vec::new(),
            quant_scratch: parking_lot::Mutex::new(quant::QuantScratch::new()),
        })
    }

    /// Makes allocations fail once `limit` bytes are live (for out-of-memory tests
    /// and for honouring a user's memory budget).
    pub fn with_memory_limit(mut self, limit: usize) -> Self {
        self.memory_limit = Some(limit);
        self
    }

    /// Lets matmuls with bf16 weights take the bf16 kernel of a CPU with
    /// AVX512-BF16 ([`Self::bf16_kernel`]): AVX512-BF16 dot products on
    /// activations rounded to bf16 (up to twice the f32 rate, as llama.cpp
    /// computes with bf16 weights), or f32 FMAs on the widened weights
    /// where those are the faster (Intel's cores); model weights are then
    /// packed at load (`pack_matmul_weight`). The logits differ from the
    /// f32 reference by more than 1e-4: off by default. Each row's result
    /// is independent of the others (`gemm_bf16`).
    pub fn with_bf16_dot_products(mut self, on: bool) -> Self {
        self.bf16_dot = on;
        self
    }

    /// Takes `kernel` for bf16 weights under bf16 arithmetic instead of
    /// the fastest ([`Bf16Kernel::detect`]), where this CPU runs it (for
    /// benches and tests that compare the kernels; None: the fastest).
    pub fn with_bf16_kernel(mut self, kernel: Option<Bf16Kernel>) -> Self {
        self.bf16_kernel = kernel;
        self
    }

    /// Rounds every recurrent state (Mamba-2's SSD state, the gated delta
    /// rule's) to bf16 after each update, held in f32 memory: the values a
    /// bf16 state would hold (what vLLM keeps with
    /// `mamba_ssm_cache_dtype="bfloat16"`), so that its accuracy can be
    /// measured against the f32 state before one is offered
    /// (`tests/examples/bf16_state.rs`). It saves no memory or traffic and
    /// costs a pass over the states; off by default.
    pub fn with_bf16_state_rounding(mut self, on: bool) -> Self {
        self.bf16_states = on;
        self
    }

    /// Holds the SSM and delta-rule states (not the conv windows) in bf16,
    /// as vLLM's `mamba_ssm_cache_dtype="bfloat16"`: half the state's
    /// memory and half its traffic per decode step. Each update computes in
    /// f32 from the stored values and rounds the new state to bf16 (nearest
    /// even, subnormals to zero, as AVX512-BF16's conversion, which the
    /// decode step uses where the CPU has it): the same values as
    /// [`Self::with_bf16_state_rounding`] on an
    /// f32 state, whose accuracy `tests/examples/bf16_state.rs` measures.
    /// Off by default.
    pub fn with_bf16_ssm_state(mut self, on: bool) -> Self {
        self.bf16_ssm_state = on;
        self
    }

    /// Whether prefill may use bf16 dot products (asked for, and the CPU has them).
    pub fn bf16_dot_products(&self) -> bool {
        self.bf16_dot && gemm_bf16::available()
    }

    /// How bf16 weights multiply under bf16 arithmetic on this CPU (None
    /// where it is off or the CPU lacks it): the faster of `vdpbf16ps` and
    /// f32 FMAs on the widened weights ([`Bf16Kernel`]).
    pub fn bf16_kernel(&self) -> Option<Bf16Kernel> {
        let chosen = self.bf16_kernel.filter(|k| k.runs_here());
        self.bf16_dot_products()
            .then(|| chosen.or_else(Bf16Kernel::detect))
            .flatten()
    }

    /// A backend that says it lacks `ops` and fails them when called, as a
    /// backend without those kernels does: for tests of what a model that
    /// needs a missing op gets (a clear error at load, never a fallback).
    pub fn lacking(mut self, ops: &[crate::ops::Op]) -> Self {
        self.lacking = ops.to_vec();
        self
    }

    /// Records the wall time of every op call (read with
    /// [`CpuBackend::take_op_times`]); off by default.
    pub fn with_op_profile(self, on: bool) -> Self {
        self.profile.set(on);
        self
    }

    /// Per-op call counts and wall times since the last call, largest first
    /// (empty unless [`CpuBackend::with_op_profile`] turned them on).
    pub fn take_op_times(&self) -> Vec<OpTime> {
        self.profile.take()
    }

    /// What every op does first: the launch hooks (count, sticky error,
    /// injected fault; see [`Hooks::begin_op`]), then a timer for the op's
    /// wall time until the returned guard drops (when profiling).
    pub(crate) fn begin_op(&self, op: &'static str) -> Result<Option<profile::OpTimer<'_>>> {
        if !self.lacking.is_empty() && self.lacking.iter().any(|l| l.name() == op) {
            return Err(GpuError::Unavailable(format!(
                "{op} is not implemented by this backend"
            )));
        }
        self.hooks.begin_op(op)?;
        Ok(self.profile.start(op))
    }

    /// Number of worker threads ops use.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Runs `f` on this backend's rayon pool (the team's spinning workers
    /// park first, so as not to compete with it for the cores).
    pub(crate) fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.team.park_spinners();
        self.pool.install(f)
    }

    /// The spinning team that the ops' parallel loops run on.
    pub(crate) fn team(&self) -> &team::Team {
        &self.team
    }

    fn check_range(&self, op: &'static str, ptr: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        match self.ledger.containing(ptr, bytes) {
            Some(_) => Ok(()),
            None => Err(GpuError::UnknownPointer { ptr }),
        }
        .map_err(|e| match e {
            GpuError::UnknownPointer { ptr } => GpuError::Shape {
                op,
                detail: format!("{bytes} bytes at {ptr:#x} are not inside one live allocation"),
            },
            e => e,
        })
    }

    /// The f32 elements of `s`, read-only.
    pub(crate) fn read<'a>(
        &'a self,
        op: &'static str,
        s: DeviceSlice,
        dtype: DType,
    ) -> Result<&'a [u8]> {
        if s.dtype() != dtype {
            return Err(GpuError::UnsupportedDType {
                op,
                dtype: s.dtype(),
            });
        }
        self.check_range(op, s.ptr().raw(), s.bytes())?;
        // SAFETY: the range lies inside a live allocation of this backend
        // (checked against the ledger above), which is host memory from
        // `alloc_zeroed` and stays valid until freed. Ops take outputs through
        // `write`, which checks they do not overlap the inputs they are given.
        Ok(unsafe { std::slice::from_raw_parts(s.ptr().raw() as *const u8, s.bytes()) })
    }

    /// Mutable bytes of `s`.
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn write<'a>(
        &'a self,
        op: &'static str,
        s: DeviceSlice,
        inputs: &[DeviceSlice],
    ) -> Result<&'a mut [u8]> {
        self.check_range(op, s.ptr().raw(), s.bytes())?;
        let (start, end) = (s.ptr().raw(), s.ptr().raw() + s.bytes() as u64);
        for i in inputs {
            let (a, b) = (i.ptr().raw(), i.ptr().raw() + i.bytes() as u64);
            if a < end && start < b {
                return Err(GpuError::Aliasing { op });
            }
        }
        // SAFETY: as in `read`; in addition the output range was checked to
        // be disjoint from every input the op reads.
        Ok(unsafe { std::slice::from_raw_parts_mut(s.ptr().raw() as *mut u8, s.bytes()) })
    }

    /// A small parameter vector (`[n]`, f32/bf16/f16) widened to f32.
    pub(crate) fn param_vec(
        &self,
        op: &'static str,
        s: DeviceSlice,
        n: usize,
        what: &str,
    ) -> Result<Vec<f32>> {
        need(op, s, n, what)?;
        let w = Weights::from_bytes(op, s.dtype(), self.read(op, s, s.dtype())?)?;
        let mut v = vec![0f32; n];
        w.widen_into(0, &mut v);
        Ok(v)
    }

    /// The elements of `s` as `T` (f32 activations, u32 step metadata, a
    /// bf16 KV cache), read-only; `s` must hold `T`'s dtype.
    pub(crate) fn read_as<'a, T: Element>(
        &'a self,
        op: &'static str,
        s: DeviceSlice,
    ) -> Result<&'a [T]> {
        let b = self.read(op, s, T::DTYPE)?;
        debug_assert_eq!(b.as_ptr() as usize % std::mem::align_of::<T>(), 0);
        // SAFETY: allocations are 64-byte aligned and a slice of `T`'s dtype
        // starts a whole number of elements from its base, so the cast is
        // aligned; `read` checked the range is live and holds whole
        // elements; every bit pattern is a valid `T` (`Element`).
        Ok(unsafe {
            std::slice::from_raw_parts(b.as_ptr().cast::<T>(), b.len() / T::DTYPE.size_of())
        })
    }

    /// Mutable elements of `s` as `T`, checked not to overlap `inputs`.
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn write_as<'a, T: Element>(
        &'a self,
        op: &'static str,
        s: DeviceSlice,
        inputs: &[DeviceSlice],
    ) -> Result<&'a mut [T]> {
        if s.dtype() != T::DTYPE {
            return Err(GpuError::UnsupportedDType {
                op,
                dtype: s.dtype(),
            });
        }
        let b = self.write(op, s, inputs)?;
        // SAFETY: as `read_as`; in addition `write` checked the range is
        // disjoint from every input the op reads.
        Ok(unsafe {
            std::slice::from_raw_parts_mut(b.as_mut_ptr().cast::<T>(), b.len() / T::DTYPE.size_of())
        })
    }

    pub(crate) fn read_u32<'a>(&'a self, op: &'static str, s: DeviceSlice) -> Result<&'a [u32]> {
        self.read_as(op, s)
    }

    #[allow(clippy::mut_from_ref)]
    pub(crate) fn write_u32<'a>(
        &'a self,
        op: &'static str,
        s: DeviceSlice,
        inputs: &[DeviceSlice],
    ) -> Result<&'a mut [u32]> {
        self.write_as(op, s, inputs)
    }

    pub(crate) fn read_f32<'a>(&'a self, op: &'static str, s: DeviceSlice) -> Result<&'a [f32]> {
        self.read_as(op, s)
    }

    #[allow(clippy::mut_from_ref)]
    pub(crate) fn write_f32<'a>(
        &'a self,
        op: &'static str,
        s: DeviceSlice,
        inputs: &[DeviceSlice],
    ) -> Result<&'a mut [f32]> {
        self.write_as(op, s, inputs)
    }

    fn layout(bytes: usize) -> Result<Layout> {
        Layout::from_size_align(bytes, ALIGN).map_err(|_| GpuError::OutOfMemory {
            bytes,
            owner: String::new(),
            live: 0,
        })
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

/// Element types ops view device memory as: plain data whose every bit
/// pattern is a valid value, stored as `DTYPE`.
pub(crate) trait Element: Copy {
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}

impl Element for u32 {
    const DTYPE: DType = DType::U32;
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
}

impl GpuBackend for CpuBackend {
    fn name(&self) -> &str {
        "cpu"
    }

    /// The reference backend implements every op.
    fn supports_weights(&self, dtype: DType) -> bool {
        dtype.is_float() || dtype.quant().is_some_and(|q| quant::supports(q.ggml()))
    }

    fn matmul_input_rounding(&self, weights: DType) -> Option<DType> {
        // Quantized weights meet activations quantized per block.
        let q = weights.quant()?;
        metrale_core::QuantFormat::new(quant::activation_format(q.ggml())).map(DType::Quant)
    }

    fn supports(&self, op: crate::ops::Op) -> bool {
        !self.lacking.contains(&op)
    }

    fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    fn hooks(&self) -> &Hooks {
        &self.hooks
    }

    fn available_memory(&self) -> Option<usize> {
        let limit = self
            .memory_limit
            .map(|l| l.saturating_sub(self.ledger.live_bytes()));
        match (host_memory::available(), limit) {
            (Some(host), Some(limit)) => Some(host.min(limit)),
            (host, limit) => host.or(limit),
        }
    }

    fn alloc_raw(&self, bytes: usize) -> Result<DevicePtr> {
        let live = self.ledger.live_bytes();
        if let Some(limit) = self.memory_limit
            && live + bytes > limit
        {
            return Err(GpuError::OutOfMemory {
                bytes,
                owner: String::new(),
                live,
            });
        }
        let layout = Self::layout(bytes)?;
        // SAFETY: `layout` has non-zero size (callers allocate at least 1 byte).
        let p = unsafe { alloc_zeroed(layout) };
        DevicePtr::from_raw(p as u64).ok_or(GpuError::OutOfMemory {
            bytes,
            owner: String::new(),
            live,
        })
    }

    fn free_raw(&self, ptr: DevicePtr, bytes: usize) -> Result<()> {
        let layout = Self::layout(bytes)?;
        // SAFETY: `ptr` came from `alloc_raw` with this same size (the ledger
        // records it) and the ledger entry was removed first, so it is freed once.
        unsafe { dealloc(ptr.raw() as *mut u8, layout) };
        Ok(())
    }

    fn copy_h2d_raw(&self, src: &[u8], dst: DevicePtr, offset: usize) -> Result<()> {
        let dst = DeviceSlice::new(dst, DType::U8, offset + src.len()).slice(offset, src.len())?;
        self.write("copy_h2d", dst, &[])?.copy_from_slice(src);
        Ok(())
    }

    fn copy_d2h_raw(&self, src: DevicePtr, offset: usize, dst: &mut [u8]) -> Result<()> {
        let src = DeviceSlice::new(src, DType::U8, offset + dst.len()).slice(offset, dst.len())?;
        dst.copy_from_slice(self.read("copy_d2h", src, DType::U8)?);
        Ok(())
    }

    fn copy_d2d_raw(
        &self,
        src: DevicePtr,
        src_offset: usize,
        dst: DevicePtr,
        dst_offset: usize,
        bytes: usize,
    ) -> Result<()> {
        let src = DeviceSlice::new(src, DType::U8, src_offset + bytes).slice(src_offset, bytes)?;
        let dst = DeviceSlice::new(dst, DType::U8, dst_offset + bytes).slice(dst_offset, bytes)?;
        let out = self.write("copy_d2d", dst, &[src])?;
        out.copy_from_slice(self.read("copy_d2d", src, DType::U8)?);
        Ok(())
    }

    fn memset_zero_raw(&self, dst: DevicePtr, offset: usize, bytes: usize) -> Result<()> {
        let dst = DeviceSlice::new(dst, DType::U8, offset + bytes).slice(offset, bytes)?;
        self.write("memset_zero", dst, &[])?.fill(0);
        Ok(())
    }

    /// Every op has finished when it returns: nothing to wait for.
    fn synchronize_raw(&self) -> Result<()> {
        Ok(())
    }

    fn record_fence_raw(&self) -> Result<Fence> {
        Ok(Fence::from_raw(
            self.fences.fetch_add(1, Ordering::Relaxed) + 1,
        ))
    }

    /// Complete already: see `fences`.
    fn wait_fence_raw(&self, _fence: Fence) -> Result<()> {
        Ok(())
    }

    /// f32 by default (the reference); bf16 or f16 on request (half the
    /// bytes, keys and values rounded once when stored, widened when read).
    fn kv_layout(&self, spec: KvSpec) -> Result<KvLayout> {
        let dtype = spec.dtype.unwrap_or(DType::F32);
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

    fn ssm_state_layout(&self, elements: usize) -> StateLayout {
        StateLayout {
            dtype: if self.bf16_ssm_state {
                DType::BF16
            } else {
                DType::F32
            },
            elements,
        }
    }
}

impl Drop for CpuBackend {
    fn drop(&mut self) {
        let n = self.sweep_unreleased();
        if n > 0 {
            tracing::warn!("CPU backend dropped with {n} live allocation(s); freed them");
        }
    }
}

#[cfg(test)]
mod tests;
