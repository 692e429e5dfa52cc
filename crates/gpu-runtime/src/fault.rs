//! A backend wrapper that makes chosen allocations, frees or copies fail, and
//! records what was freed in which order. For tests of failure paths.

use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::error::{GpuError, Result};
use crate::gpu::{DevicePtr, GpuBackend};
use crate::ledger::Ledger;

/// Which operations fail: the Nth (0-based) of each kind, counted from the
/// wrapper's creation or the last [`FaultInjecting::set_plan`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultPlan {
    pub fail_alloc_at: Option<usize>,
    pub fail_free_at: Option<usize>,
    pub fail_copy_at: Option<usize>,
}

/// Wraps a backend; compute ops pass straight through.
pub struct FaultInjecting<B: GpuBackend> {
    inner: B,
    plan: Mutex<FaultPlan>,
    allocs: AtomicUsize,
    frees: AtomicUsize,
    copies: AtomicUsize,
    freed_owners: Mutex<Vec<String>>,
}

impl<B: GpuBackend> FaultInjecting<B> {
    pub fn new(inner: B, plan: FaultPlan) -> Self {
        Self {
            inner,
            plan: Mutex::new(plan),
            allocs: AtomicUsize::new(0),
            frees: AtomicUsize::new(0),
            copies: AtomicUsize::new(0),
            freed_owners: Mutex::new(Vec::new()),
        }
    }

    /// Replaces the plan and restarts the counts.
    pub fn set_plan(&self, plan: FaultPlan) {
        *self.plan.lock() = plan;
        self.allocs.store(0, Ordering::SeqCst);
        self.frees.store(0, Ordering::SeqCst);
        self.copies.store(0, Ordering::SeqCst);
    }

    /// How many allocations were attempted since the plan was set.
    pub fn alloc_count(&self) -> usize {
        self.allocs.load(Ordering::SeqCst)
    }

    /// Owner labels of the allocations freed through `free`, in order.
    pub fn freed_owners(&self) -> Vec<String> {
        self.freed_owners.lock().clone()
    }

    pub fn inner(&self) -> &B {
        &self.inner
    }

    fn tick(counter: &AtomicUsize, fail_at: Option<usize>, op: &'static str) -> Result<()> {
        let index = counter.fetch_add(1, Ordering::SeqCst);
        if fail_at == Some(index) {
            Err(GpuError::InjectedFault { op, index })
        } else {
            Ok(())
        }
    }

    fn copy_tick(&self) -> Result<()> {
        Self::tick(&self.copies, self.plan.lock().fail_copy_at, "copy")
    }
}

impl<B: GpuBackend> GpuBackend for FaultInjecting<B> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn supports(&self, op: crate::ops::Op) -> bool {
        self.inner.supports(op)
    }

    fn ledger(&self) -> &Ledger {
        self.inner.ledger()
    }

    fn alloc_raw(&self, bytes: usize) -> Result<DevicePtr> {
        Self::tick(&self.allocs, self.plan.lock().fail_alloc_at, "allocation")?;
        self.inner.alloc_raw(bytes)
    }

    fn free_raw(&self, ptr: DevicePtr, bytes: usize) -> Result<()> {
        let injected = Self::tick(&self.frees, self.plan.lock().fail_free_at, "free");
        // The memory is returned either way, so that an injected failure
        // does not leak host memory in tests; the error is still reported.
        let real = self.inner.free_raw(ptr, bytes);
        injected.and(real)
    }

    /// As the provided `free`, recording the owner label first.
    fn free(&self, ptr: DevicePtr) -> Result<()> {
        let entry = self
            .ledger()
            .remove(ptr)
            .ok_or(GpuError::UnknownPointer { ptr: ptr.raw() })?;
        self.freed_owners.lock().push(entry.owner.clone());
        self.free_raw(ptr, entry.bytes)
    }

    fn copy_h2d(&self, src: &[u8], dst: DevicePtr, offset: usize) -> Result<()> {
        self.copy_tick()?;
        self.inner.copy_h2d(src, dst, offset)
    }

    fn copy_d2h(&self, src: DevicePtr, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.copy_tick()?;
        self.inner.copy_d2h(src, offset, dst)
    }

    fn copy_d2d(
        &self,
        src: DevicePtr,
        so: usize,
        dst: DevicePtr,
        d: usize,
        bytes: usize,
    ) -> Result<()> {
        self.copy_tick()?;
        self.inner.copy_d2d(src, so, dst, d, bytes)
    }

    fn memset_zero(&self, dst: DevicePtr, offset: usize, bytes: usize) -> Result<()> {
        self.inner.memset_zero(dst, offset, bytes)
    }

    fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }
}

mod delegate;
mod delegate_recurrent;
