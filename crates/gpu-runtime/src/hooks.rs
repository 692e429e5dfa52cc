//! What every backend shares around its raw primitives: fault injection,
//! transfer counters, the debug-sync switch and the sticky device error.
//!
//! Each backend owns one [`Hooks`] and returns it from
//! [`GpuBackend::hooks`](crate::GpuBackend::hooks). The provided memory
//! methods of `GpuBackend` (`alloc_at`, `free`, the copies, `memset_zero`,
//! `synchronize`, the fences) consult it before calling the backend's `*_raw`
//! primitives, and every op calls [`Hooks::begin_op`] first; so every backend
//! gets fault injection and counting without forwarding anything by hand, and
//! every backend reports a device fault the same way.
//!
//! The sticky error models CUDA: a kernel that faults (an illegal address)
//! poisons the context, and from then on every call fails until the context
//! is recreated. Because launches are asynchronous the fault is only seen at
//! a later synchronising call, unless debug sync is on (synchronise after
//! every op, so the op that caused it reports it).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::error::{GpuError, Result};
use crate::fault::{
    Counted, FaultPlan, FaultState, INJECTED_OP_FAULT_CODE, INJECTED_OP_FAULT_MESSAGE,
};

/// The environment variable that turns debug sync on for every backend
/// created while it is `1`.
pub const DEBUG_SYNC_ENV: &str = "METRALE_DEBUG_SYNC";

/// Whether an environment flag's value means on.
fn flag_is_on(value: &str) -> bool {
    matches!(
        value.trim().to_ascii_lowercase().as_str(),
        "1" | "true" | "on" | "yes"
    )
}

/// Counts of what crossed between host and device, and of op launches,
/// since the backend was created or [`Hooks::reset_transfers`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Transfers {
    pub h2d_copies: u64,
    pub h2d_bytes: u64,
    pub d2h_copies: u64,
    pub d2h_bytes: u64,
    pub d2d_copies: u64,
    pub memsets: u64,
    pub op_launches: u64,
}

/// The first device fault, which every later call reports.
#[derive(Debug)]
struct Sticky {
    /// The op that caused it.
    origin: &'static str,
    code: i32,
    message: String,
    /// Whether the op that caused it reported it (debug sync was on).
    reported_at_origin: bool,
}

impl Sticky {
    /// The error as a later call, `op`, reports it.
    fn surfaced_at(&self, op: &'static str) -> GpuError {
        let message = if self.reported_at_origin {
            format!(
                "{}; the device faulted earlier, at {}, and stays unusable: recreate the backend",
                self.message, self.origin
            )
        } else {
            format!(
                "{}; an earlier asynchronous op failed and the device stays unusable: \
                 rerun with {DEBUG_SYNC_ENV}=1 to find the op, and recreate the backend",
                self.message
            )
        };
        GpuError::Driver {
            op,
            code: self.code,
            message,
        }
    }
}

/// Hooks every backend owns: see the module documentation.
pub struct Hooks {
    /// Fast path for every call: whether `faults` holds a plan.
    armed: AtomicBool,
    faults: Mutex<Option<FaultState>>,
    /// Fast path for every call: whether `sticky` holds an error.
    faulted: AtomicBool,
    sticky: Mutex<Option<Sticky>>,
    debug_sync: AtomicBool,
    h2d_copies: AtomicU64,
    h2d_bytes: AtomicU64,
    d2h_copies: AtomicU64,
    d2h_bytes: AtomicU64,
    d2d_copies: AtomicU64,
    memsets: AtomicU64,
    op_launches: AtomicU64,
}

impl Default for Hooks {
    fn default() -> Self {
        Self::new()
    }
}

impl Hooks {
    /// No fault plan, zero counters; debug sync on when `METRALE_DEBUG_SYNC`
    /// is `1` (or `true`/`on`/`yes`).
    pub fn new() -> Self {
        let debug_sync = std::env::var(DEBUG_SYNC_ENV).is_ok_and(|v| flag_is_on(&v));
        Self {
            armed: AtomicBool::new(false),
            faults: Mutex::new(None),
            faulted: AtomicBool::new(false),
            sticky: Mutex::new(None),
            debug_sync: AtomicBool::new(debug_sync),
            h2d_copies: AtomicU64::new(0),
            h2d_bytes: AtomicU64::new(0),
            d2h_copies: AtomicU64::new(0),
            d2h_bytes: AtomicU64::new(0),
            d2d_copies: AtomicU64::new(0),
            memsets: AtomicU64::new(0),
            op_launches: AtomicU64::new(0),
        }
    }

    // ---- fault injection ----

    /// Installs `plan` (restarting its counts) and starts recording the
    /// owners freed through `free`. Owners recorded under an earlier plan are
    /// kept, so a test may build with an empty plan and arm it later.
    pub fn set_faults(&self, plan: FaultPlan) {
        let mut faults = self.faults.lock();
        match faults.as_mut() {
            Some(state) => state.replan(plan),
            None => *faults = Some(FaultState::new(plan)),
        }
        self.armed.store(true, Ordering::SeqCst);
    }

    /// Removes the plan and forgets the freed owners. A sticky device error
    /// stays: only a new backend clears it, as on a real device.
    pub fn clear_faults(&self) {
        *self.faults.lock() = None;
        self.armed.store(false, Ordering::SeqCst);
    }

    /// The installed plan, if any.
    pub fn fault_plan(&self) -> Option<FaultPlan> {
        self.faults.lock().as_ref().map(|s| s.plan)
    }

    /// Allocations attempted since the plan was set (0 without a plan).
    pub fn alloc_count(&self) -> usize {
        self.faults
            .lock()
            .as_ref()
            .map_or(0, FaultState::alloc_count)
    }

    /// Owner labels of the allocations freed through `free`, in order, since
    /// a plan was first set (empty without a plan). The sweep is not `free`.
    pub fn freed_owners(&self) -> Vec<String> {
        self.faults
            .lock()
            .as_ref()
            .map_or_else(Vec::new, |s| s.freed_owners.clone())
    }

    /// Counts a call of `kind` against the plan; the injected error if it fails.
    fn tick(&self, kind: Counted) -> Result<()> {
        if !self.armed.load(Ordering::Relaxed) {
            return Ok(());
        }
        match self.faults.lock().as_mut() {
            Some(state) => state.tick_call(kind),
            None => Ok(()),
        }
    }

    // ---- transfer counters ----

    /// What was copied and launched since creation or the last reset.
    pub fn transfers(&self) -> Transfers {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Transfers {
            h2d_copies: get(&self.h2d_copies),
            h2d_bytes: get(&self.h2d_bytes),
            d2h_copies: get(&self.d2h_copies),
            d2h_bytes: get(&self.d2h_bytes),
            d2d_copies: get(&self.d2d_copies),
            memsets: get(&self.memsets),
            op_launches: get(&self.op_launches),
        }
    }

    /// Sets every transfer counter to zero.
    pub fn reset_transfers(&self) {
        for c in [
            &self.h2d_copies,
            &self.h2d_bytes,
            &self.d2h_copies,
            &self.d2h_bytes,
            &self.d2d_copies,
            &self.memsets,
            &self.op_launches,
        ] {
            c.store(0, Ordering::Relaxed);
        }
    }

    // ---- debug sync ----

    /// Synchronise after every op, so that a device fault is reported by the
    /// op that caused it rather than by a later call. Slow on a real device;
    /// free on the CPU, which is synchronous anyway.
    pub fn set_debug_sync(&self, on: bool) {
        self.debug_sync.store(on, Ordering::Relaxed);
    }

    pub fn debug_sync(&self) -> bool {
        self.debug_sync.load(Ordering::Relaxed)
    }

    // ---- the sticky device error ----

    /// Whether a device fault has made the backend unusable.
    pub fn is_faulted(&self) -> bool {
        self.faulted.load(Ordering::Acquire)
    }

    /// The sticky error as the call `op` reports it, if the device faulted.
    pub fn check(&self, op: &'static str) -> Result<()> {
        if !self.is_faulted() {
            return Ok(());
        }
        match self.sticky.lock().as_ref() {
            Some(sticky) => Err(sticky.surfaced_at(op)),
            None => Ok(()),
        }
    }

    /// Records a device fault caused by `op` (injected here; a real device's
    /// backend calls this when its driver reports one). The first fault is
    /// the one every later call reports. Returns the error as `op` itself
    /// reports it, for the callers that report it there (debug sync).
    pub fn record_device_fault(&self, op: &'static str, code: i32, message: &str) -> GpuError {
        let debug_sync = self.debug_sync();
        let mut sticky = self.sticky.lock();
        if sticky.is_none() {
            *sticky = Some(Sticky {
                origin: op,
                code,
                message: message.to_string(),
                reported_at_origin: debug_sync,
            });
            self.faulted.store(true, Ordering::Release);
        }
        GpuError::Driver {
            op,
            code,
            message: message.to_string(),
        }
    }

    /// What every op launch does first: counts the launch, fails with the
    /// sticky error if the device faulted, and applies the fault plan. An
    /// injected op fault makes the device faulted; it is returned here only
    /// in debug-sync mode, otherwise (a device fault being asynchronous) the
    /// next synchronising call or op reports it.
    pub fn begin_op(&self, op: &'static str) -> Result<()> {
        self.op_launches.fetch_add(1, Ordering::Relaxed);
        self.check(op)?;
        if !self.armed.load(Ordering::Relaxed) {
            return Ok(());
        }
        let faults_here = match self.faults.lock().as_mut() {
            Some(state) => state.tick(Counted::Op).1,
            None => false,
        };
        if faults_here {
            let error =
                self.record_device_fault(op, INJECTED_OP_FAULT_CODE, INJECTED_OP_FAULT_MESSAGE);
            if self.debug_sync() {
                return Err(error);
            }
        }
        Ok(())
    }

    // ---- the provided memory methods' side of it (crate::gpu) ----

    /// Before an allocation: the sticky error, then the plan.
    pub(crate) fn before_alloc(&self) -> Result<()> {
        self.check("alloc")?;
        self.tick(Counted::Alloc)
    }

    /// Before a copy: the sticky error, then the plan.
    pub(crate) fn before_copy(&self, op: &'static str) -> Result<()> {
        self.check(op)?;
        self.tick(Counted::Copy)
    }

    /// Records `owner` as freed through `free`, while a plan is installed.
    pub(crate) fn record_free(&self, owner: &str) {
        if !self.armed.load(Ordering::Relaxed) {
            return;
        }
        if let Some(state) = self.faults.lock().as_mut() {
            state.freed_owners.push(owner.to_string());
        }
    }

    /// A free: `raw` is always called, so the memory is returned whatever
    /// else fails; the error reported is the sticky one, else the injected
    /// one, else the raw free's.
    pub(crate) fn free_with(&self, raw: impl FnOnce() -> Result<()>) -> Result<()> {
        let sticky = self.check("free");
        let injected = self.tick(Counted::Free);
        let real = raw();
        sticky.and(injected).and(real)
    }

    pub(crate) fn count_h2d(&self, bytes: usize) {
        self.h2d_copies.fetch_add(1, Ordering::Relaxed);
        self.h2d_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub(crate) fn count_d2h(&self, bytes: usize) {
        self.d2h_copies.fetch_add(1, Ordering::Relaxed);
        self.d2h_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub(crate) fn count_d2d(&self) {
        self.d2d_copies.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn count_memset(&self) {
        self.memsets.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests;
