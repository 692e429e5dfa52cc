//! The driver side of the CUDA backend: finding the driver library, the
//! device's primary context and the backend's one stream, binding the
//! context to whichever thread calls, and turning driver errors into
//! [`GpuError`]s.
//!
//! Everything here goes through cudarc's raw layer (`driver::result` /
//! `driver::sys`): device pointers are plain addresses that the ledger owns,
//! never cudarc's self-freeing slices.

use std::cell::Cell;
use std::ffi::c_int;
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::driver::{result, sys};

use crate::error::{GpuError, Result};

/// The oldest driver this build runs on: cudarc is bound to the CUDA 13.0
/// driver API and loads the CUDA 13 cuBLASLt (`libcublasLt.so.13`), which
/// needs driver 580 or later. The PTX itself (ISA 8.4) loads from CUDA 12.4.
pub const MIN_DRIVER_VERSION: i32 = 13000;

/// A driver error as a [`GpuError::Driver`] reported by `op`.
pub fn driver_error(op: &'static str, e: result::DriverError) -> GpuError {
    let name = e
        .error_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    let text = e
        .error_string()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    GpuError::Driver {
        op,
        code: e.0 as i32,
        message: format!("{name}: {text}"),
    }
}

/// Whether a driver error leaves the context unusable (a fault in a kernel,
/// as opposed to a refused call such as an out-of-memory allocation).
pub fn is_sticky(e: &result::DriverError) -> bool {
    use sys::CUresult::*;
    matches!(
        e.0,
        CUDA_ERROR_ILLEGAL_ADDRESS
            | CUDA_ERROR_LAUNCH_FAILED
            | CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUDA_ERROR_MISALIGNED_ADDRESS
            | CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUDA_ERROR_INVALID_PC
            | CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUDA_ERROR_ASSERT
            | CUDA_ERROR_ECC_UNCORRECTABLE
            | CUDA_ERROR_LAUNCH_TIMEOUT
    )
}

/// Checks that a CUDA driver can be used at all, before any other cudarc
/// call (cudarc panics when a library it needs is missing): the library is
/// present, initialises, is new enough, and has device `ordinal`.
fn check_driver(ordinal: usize) -> Result<i32> {
    // SAFETY: only tries to dlopen the driver library's candidate names.
    if !unsafe { sys::is_culib_present() } {
        return Err(GpuError::Unavailable(
            "no CUDA driver library (libcuda.so.1) was found: this machine has no NVIDIA \
             driver, or the library is not on the loader's path"
                .into(),
        ));
    }
    result::init().map_err(|e| unavailable("cuInit", e))?;
    let mut version: c_int = 0;
    // SAFETY: cuDriverGetVersion writes one int to a valid pointer.
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| unavailable("cuDriverGetVersion", e))?;
    if version < MIN_DRIVER_VERSION {
        return Err(GpuError::Unavailable(format!(
            "the CUDA driver supports CUDA {}.{}, this build needs {}.{} or later \
             (driver 580 or newer)",
            version / 1000,
            version % 1000 / 10,
            MIN_DRIVER_VERSION / 1000,
            MIN_DRIVER_VERSION % 1000 / 10,
        )));
    }
    let count = result::device::get_count().map_err(|e| unavailable("cuDeviceGetCount", e))?;
    if ordinal >= count.max(0) as usize {
        return Err(GpuError::Unavailable(format!(
            "no CUDA device {ordinal}: the driver sees {count} device(s)"
        )));
    }
    Ok(version)
}

fn unavailable(call: &str, e: result::DriverError) -> GpuError {
    GpuError::Unavailable(format!("{call} failed: {}", driver_error("init", e)))
}

/// One device's primary context and the backend's stream.
pub struct Context {
    pub device: sys::CUdevice,
    pub ctx: sys::CUcontext,
    pub stream: sys::CUstream,
    pub name: String,
    pub driver_version: i32,
    /// Compute capability, e.g. (9, 0).
    pub compute_capability: (i32, i32),
    pub multiprocessors: i32,
    /// Tells contexts apart in [`BOUND`], unlike `ctx`, whose address a
    /// later backend on the same device gets again.
    id: usize,
}

static NEXT_ID: AtomicUsize = AtomicUsize::new(1);

// SAFETY: CUDA contexts and streams may be used from any thread once the
// context is made current there, which `bind` does before every call.
unsafe impl Send for Context {}
// SAFETY: as above; the driver API is thread-safe.
unsafe impl Sync for Context {}

thread_local! {
    /// The [`Context::id`] last made current on this thread by [`Context::bind`].
    static BOUND: Cell<usize> = const { Cell::new(0) };
}

impl Context {
    /// Retains device `ordinal`'s primary context and makes a non-blocking
    /// stream on it.
    pub fn new(ordinal: usize) -> Result<Self> {
        let driver_version = check_driver(ordinal)?;
        let device =
            result::device::get(ordinal as c_int).map_err(|e| unavailable("cuDeviceGet", e))?;
        let name = result::device::get_name(device).unwrap_or_else(|_| "CUDA device".into());
        let attr = |a| {
            // SAFETY: `device` came from cuDeviceGet.
            unsafe { result::device::get_attribute(device, a) }.unwrap_or(0)
        };
        use sys::CUdevice_attribute::*;
        let compute_capability = (
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        );
        let multiprocessors = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
        // SAFETY: `device` came from cuDeviceGet; the retain is undone in Drop.
        let ctx = unsafe { result::primary_ctx::retain(device) }
            .map_err(|e| unavailable("cuDevicePrimaryCtxRetain", e))?;
        let mut this = Self {
            device,
            ctx,
            stream: std::ptr::null_mut(),
            name,
            driver_version,
            compute_capability,
            multiprocessors,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        };
        this.bind()?;
        this.stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| unavailable("cuStreamCreate", e))?;
        Ok(this)
    }

    /// Makes this context current on the calling thread (a no-op when it
    /// already is): every entry point of the backend calls this first, so
    /// the engine thread, a test thread or a server worker may each use it.
    pub fn bind(&self) -> Result<()> {
        let key = self.id;
        if BOUND.with(Cell::get) == key {
            return Ok(());
        }
        // SAFETY: `ctx` is a retained primary context, alive until Drop.
        unsafe { result::ctx::set_current(self.ctx) }
            .map_err(|e| driver_error("cuCtxSetCurrent", e))?;
        BOUND.with(|b| b.set(key));
        Ok(())
    }

    /// Free and total device memory, in bytes.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        result::mem_get_info().map_err(|e| driver_error("cuMemGetInfo", e))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        if self.bind().is_err() {
            return;
        }
        if !self.stream.is_null() {
            // SAFETY: the stream was created on this context and nothing
            // queued on it outlives the backend (callers synchronised).
            unsafe {
                let _ = result::stream::synchronize(self.stream);
                let _ = result::stream::destroy(self.stream);
            }
        }
        // SAFETY: balances the retain in `new`.
        unsafe {
            let _ = result::primary_ctx::release(self.device);
        }
        BOUND.with(|b| b.set(0));
    }
}
