//! Wall time per operation, for `metrale bench --profile`: where a prefill
//! or a decode step spends its time, op by op. Off by default; when off an
//! op pays one relaxed atomic load.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The calls to one op and their total wall time.
#[derive(Clone, Debug, PartialEq)]
pub struct OpTime {
    pub op: &'static str,
    pub calls: u64,
    pub total: Duration,
}

/// Per-op totals since the last [`OpProfile::take`].
#[derive(Default)]
pub(crate) struct OpProfile {
    on: AtomicBool,
    times: Mutex<Vec<OpTime>>,
}

impl OpProfile {
    pub(crate) fn set(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    /// A timer that adds its lifetime to `op` when dropped; None when off.
    pub(crate) fn start(&self, op: &'static str) -> Option<OpTimer<'_>> {
        self.on.load(Ordering::Relaxed).then(|| OpTimer {
            profile: self,
            op,
            start: Instant::now(),
        })
    }

    /// The totals, largest first, and a fresh start.
    pub(crate) fn take(&self) -> Vec<OpTime> {
        let mut times = std::mem::take(&mut *self.lock());
        times.sort_by(|a, b| b.total.cmp(&a.total).then(a.op.cmp(b.op)));
        times
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<OpTime>> {
        // A panic while holding the lock leaves only timings behind: go on.
        self.times.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Adds the time from its creation to its drop to one op's total.
pub(crate) struct OpTimer<'a> {
    profile: &'a OpProfile,
    op: &'static str,
    start: Instant,
}

impl Drop for OpTimer<'_> {
    fn drop(&mut self) {
        let elapsed = self.start.elapsed();
        let mut times = self.profile.lock();
        match times.iter_mut().find(|t| t.op == self.op) {
            Some(t) => {
                t.calls += 1;
                t.total += elapsed;
            }
            None => times.push(OpTime {
                op: self.op,
                calls: 1,
                total: elapsed,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_only_while_on_and_take_starts_afresh() {
        let p = OpProfile::default();
        drop(p.start("a"));
        assert!(p.take().is_empty());
        p.set(true);
        for op in ["a", "b", "a"] {
            drop(p.start(op));
        }
        let times = p.take();
        let calls: Vec<_> = times.iter().map(|t| (t.op, t.calls)).collect();
        assert!(calls.contains(&("a", 2)) && calls.contains(&("b", 1)) && calls.len() == 2);
        assert!(p.take().is_empty());
    }
}
