//! Fault injection, for tests of failure paths: which allocation, free, copy
//! or op launch fails. A plan is installed on any backend with
//! [`Hooks::set_faults`](crate::hooks::Hooks::set_faults); the provided memory
//! methods of [`GpuBackend`](crate::GpuBackend) and every op's launch hook
//! consult it, so no backend forwards anything by hand.

use crate::error::{GpuError, Result};

/// Which operations fail: the Nth (0-based) of each kind, counted from the
/// last [`Hooks::set_faults`](crate::hooks::Hooks::set_faults).
///
/// An allocation, free or copy fault fails that one call
/// ([`GpuError::InjectedFault`]); a failed free still returns the memory, so
/// tests do not leak, and still reports the error. An op fault is a *sticky
/// device fault* ([`GpuError::Driver`], code [`INJECTED_OP_FAULT_CODE`]): the
/// device is unusable from then on, as after a real illegal address on CUDA.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultPlan {
    pub fail_alloc_at: Option<usize>,
    pub fail_free_at: Option<usize>,
    /// Counts host-to-device, device-to-host and device-to-device copies
    /// together (memsets are not copies).
    pub fail_copy_at: Option<usize>,
    /// The Nth op launch hits a sticky device fault.
    pub fail_op_at: Option<usize>,
}

/// The code an injected op fault reports: CUDA_ERROR_ILLEGAL_ADDRESS, the
/// fault a bad kernel most often causes.
pub const INJECTED_OP_FAULT_CODE: i32 = 700;

/// The message an injected op fault reports (CUDA's, marked as injected).
pub const INJECTED_OP_FAULT_MESSAGE: &str = "an illegal memory access was encountered (injected)";

/// The kinds of calls a plan counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Counted {
    Alloc,
    Free,
    Copy,
    Op,
}

/// An installed plan, its counts since it was installed, and the owners
/// freed through `GpuBackend::free` in order.
#[derive(Debug, Default)]
pub(crate) struct FaultState {
    pub(crate) plan: FaultPlan,
    allocs: usize,
    frees: usize,
    copies: usize,
    ops: usize,
    pub(crate) freed_owners: Vec<String>,
}

impl FaultState {
    pub(crate) fn new(plan: FaultPlan) -> Self {
        Self {
            plan,
            ..Self::default()
        }
    }

    /// Replaces the plan and restarts the counts; the freed owners stay, so a
    /// test can set a plan after building and still read every free.
    pub(crate) fn replan(&mut self, plan: FaultPlan) {
        *self = Self {
            plan,
            freed_owners: std::mem::take(&mut self.freed_owners),
            ..Self::default()
        };
    }

    pub(crate) fn alloc_count(&self) -> usize {
        self.allocs
    }

    /// Counts one call of `kind`; true when the plan makes this one fail.
    pub(crate) fn tick(&mut self, kind: Counted) -> (usize, bool) {
        let (counter, fail_at) = match kind {
            Counted::Alloc => (&mut self.allocs, self.plan.fail_alloc_at),
            Counted::Free => (&mut self.frees, self.plan.fail_free_at),
            Counted::Copy => (&mut self.copies, self.plan.fail_copy_at),
            Counted::Op => (&mut self.ops, self.plan.fail_op_at),
        };
        let index = *counter;
        *counter += 1;
        (index, fail_at == Some(index))
    }

    /// Counts one allocation, free or copy; the injected error if it fails.
    pub(crate) fn tick_call(&mut self, kind: Counted) -> Result<()> {
        let op = match kind {
            Counted::Alloc => "allocation",
            Counted::Free => "free",
            Counted::Copy => "copy",
            Counted::Op => "op",
        };
        match self.tick(kind) {
            (index, true) => Err(GpuError::InjectedFault { op, index }),
            _ => Ok(()),
        }
    }
}
