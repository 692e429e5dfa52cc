//! The allocation ledger every backend keeps: one entry per live allocation,
//! with its size, owner label and call site.

use std::collections::BTreeMap;
use std::fmt;

use parking_lot::Mutex;

use crate::gpu::{CallSite, DevicePtr};

/// One live allocation.
#[derive(Clone, Debug)]
pub struct Allocation {
    pub bytes: usize,
    pub owner: String,
    pub site: CallSite,
}

/// Live allocations by address. Shared code: backends hold one and the
/// [`crate::GpuBackend`] provided methods do the bookkeeping.
#[derive(Default)]
pub struct Ledger {
    live: Mutex<BTreeMap<DevicePtr, Allocation>>,
}

impl Ledger {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(&self, ptr: DevicePtr, bytes: usize, owner: &str, site: CallSite) {
        let previous = self.live.lock().insert(
            ptr,
            Allocation {
                bytes,
                owner: owner.to_string(),
                site,
            },
        );
        debug_assert!(previous.is_none(), "backend returned a live address twice");
    }

    /// Takes `ptr` off the ledger, returning its entry if it was live.
    pub fn remove(&self, ptr: DevicePtr) -> Option<Allocation> {
        self.live.lock().remove(&ptr)
    }

    /// Takes every entry off the ledger.
    pub fn drain(&self) -> Vec<(DevicePtr, Allocation)> {
        std::mem::take(&mut *self.live.lock()).into_iter().collect()
    }

    /// The allocation containing `[ptr, ptr + bytes)`, as (base, size), if any.
    pub fn containing(&self, ptr: u64, bytes: usize) -> Option<(u64, usize)> {
        let live = self.live.lock();
        let probe = DevicePtr::from_raw(ptr)?;
        let (base, entry) = live.range(..=probe).next_back()?;
        let start = base.raw();
        let end = start + entry.bytes as u64;
        (ptr >= start && ptr + bytes as u64 <= end).then_some((start, entry.bytes))
    }

    pub fn live_bytes(&self) -> usize {
        self.live.lock().values().map(|a| a.bytes).sum()
    }

    pub fn live_count(&self) -> usize {
        self.live.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.lock().is_empty()
    }

    /// Live allocations grouped by owner, largest first.
    pub fn report(&self) -> LedgerReport {
        let mut by_owner: BTreeMap<String, OwnerTotal> = BTreeMap::new();
        for a in self.live.lock().values() {
            let t = by_owner.entry(a.owner.clone()).or_default();
            t.allocations += 1;
            t.bytes += a.bytes;
            if !t.sites.contains(&a.site.to_string()) {
                t.sites.push(a.site.to_string());
            }
        }
        let mut owners: Vec<(String, OwnerTotal)> = by_owner.into_iter().collect();
        owners.sort_by(|a, b| b.1.bytes.cmp(&a.1.bytes).then(a.0.cmp(&b.0)));
        LedgerReport { owners }
    }
}

/// Totals for one owner label.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OwnerTotal {
    pub allocations: usize,
    pub bytes: usize,
    pub sites: Vec<String>,
}

/// What is live, grouped by owner.
#[derive(Clone, Debug, Default)]
pub struct LedgerReport {
    pub owners: Vec<(String, OwnerTotal)>,
}

impl LedgerReport {
    pub fn total_bytes(&self) -> usize {
        self.owners.iter().map(|(_, t)| t.bytes).sum()
    }

    pub fn owner(&self, label: &str) -> Option<&OwnerTotal> {
        self.owners.iter().find(|(l, _)| l == label).map(|(_, t)| t)
    }
}

impl fmt::Display for LedgerReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.owners.is_empty() {
            return writeln!(f, "no live allocations");
        }
        for (owner, t) in &self.owners {
            writeln!(
                f,
                "{owner:<32} {:>14} bytes in {:>5} allocation(s)  first at {}",
                t.bytes, t.allocations, t.sites[0]
            )?;
        }
        writeln!(f, "{:<32} {:>14} bytes", "total", self.total_bytes())
    }
}
