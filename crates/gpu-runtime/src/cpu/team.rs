//! A persistent team of worker threads that spin between ops.
//!
//! A decode step is hundreds of short ops (a GEMV of a few hundred KiB takes
//! tens of microseconds). Handing each to a rayon pool costs a sleep and a
//! wake-up of the workers per op, 10–15% of a decode step on two cores. The
//! team's workers instead spin on an epoch counter for a while after each op
//! (llama.cpp's threads spin on a barrier the same way), so the next op starts
//! on every thread within a microsecond; after [`SPIN_FOR`] without work they
//! park on a condition variable and cost nothing.
//!
//! The calling thread always works too, and never waits for a parked worker:
//! workers *join* an open job and the caller waits only for those that joined.
//! A job that finds the team busy (another caller, or a task that itself asks
//! for the team) runs on its calling thread alone, so nesting cannot deadlock.

use std::cell::UnsafeCell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks.
const SPIN_FOR: Duration = Duration::from_millis(2);

/// Set in `Shared::active` while a job is open for workers to join.
const OPEN: usize = 1 << (usize::BITS - 1);

type Task<'a> = dyn Fn(usize) + Sync + 'a;

/// The job being run: a task and how many times to call it.
#[derive(Clone, Copy)]
struct Job {
    task: *const Task<'static>,
    count: usize,
}

struct Shared {
    /// Bumped for every job: what spinning and parked workers watch.
    epoch: AtomicU64,
    /// `OPEN` while workers may join, plus the number of workers inside the job.
    active: AtomicUsize,
    /// The next task index to hand out.
    next: AtomicUsize,
    /// Written by the caller while `active` is 0 and not `OPEN`; read by a
    /// worker only after it joined (see `Team::run`).
    job: UnsafeCell<Job>,
    /// A task panicked on a worker.
    panicked: AtomicBool,
    /// Workers stop spinning and park (another pool is about to use the cores).
    quiet: AtomicBool,
    shutdown: AtomicBool,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is the only non-Sync field. The caller writes it only while no
// worker is inside a job and none can join (`active == 0`, `OPEN` clear); a
// worker reads it only after joining, which happens-after the write (the
// caller publishes `OPEN` with Release, the worker joins with Acquire). The
// task it points to is `Sync`, and the caller keeps it alive until every
// worker that joined has left (`Team::run` waits for `active == 0`).
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

/// `threads - 1` workers plus the calling thread.
pub(crate) struct Team {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Held by the one caller whose job is running.
    busy: AtomicBool,
}

impl Team {
    /// A team of `threads` threads in all (at least 1: the caller alone).
    pub(crate) fn new(threads: usize) -> Self {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            active: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            job: UnsafeCell::new(Job {
                task: &noop as &Task<'static>,
                count: 0,
            }),
            panicked: AtomicBool::new(false),
            quiet: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let workers = (1..threads.max(1))
            .filter_map(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("metrale-team-{i}"))
                    .spawn(move || worker(&shared))
                    .ok()
            })
            .collect();
        Self {
            shared,
            workers,
            busy: AtomicBool::new(false),
        }
    }

    /// Threads a job runs on, the caller included.
    pub(crate) fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Calls `task(t)` once for every `t < count`, spread over the team, and
    /// returns when all calls have returned.
    pub(crate) fn run(&self, count: usize, task: &Task<'_>) {
        if count <= 1 || self.workers.is_empty() || self.busy.swap(true, Ordering::Acquire) {
            (0..count).for_each(task);
            return;
        }
        let s = &*self.shared;
        // SAFETY: no worker is inside a job and none can join: the previous
        // job's `Finish` left `active` at 0 with `OPEN` clear, and `busy`
        // keeps other callers out. Erasing the lifetime is sound because
        // `Finish` (run even if a task panics) waits until every worker that
        // joined has left before this function returns.
        unsafe {
            *s.job.get() = Job {
                task: std::mem::transmute::<&Task<'_>, &'static Task<'static>>(task),
                count,
            }
        };
        s.next.store(0, Ordering::Relaxed);
        s.panicked.store(false, Ordering::Relaxed);
        s.quiet.store(false, Ordering::Relaxed);
        // `fetch_or`, not `store`: a late worker may be between its join
        // attempt and its leaving, counted in `active`.
        s.active.fetch_or(OPEN, Ordering::Release);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _guard = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let finish = Finish(self);
        work(s, task, count);
        drop(finish);
        if s.panicked.swap(false, Ordering::Relaxed) {
            panic!("a CPU kernel panicked on a team worker thread");
        }
    }

    /// Sends spinning workers to park now: another thread pool is about to
    /// use the cores, and spinning would steal them.
    pub(crate) fn park_spinners(&self) {
        self.shared.quiet.store(true, Ordering::Relaxed);
    }
}

/// Closes the job and waits for the workers inside it, on every exit from
/// `Team::run` (a panicking task included).
struct Finish<'a>(&'a Team);

impl Drop for Finish<'_> {
    fn drop(&mut self) {
        let s = &*self.0.shared;
        s.active.fetch_and(!OPEN, Ordering::AcqRel);
        let mut spins = 0u32;
        while s.active.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) {
                // A worker inside the job lost its core (more threads than
                // cores): let it have this one.
                std::thread::yield_now();
            }
        }
        self.0.busy.store(false, Ordering::Release);
    }
}

fn noop(_: usize) {}

/// Takes task indices until none are left.
fn work(s: &Shared, task: &Task<'_>, count: usize) {
    loop {
        let t = s.next.fetch_add(1, Ordering::Relaxed);
        if t >= count {
            return;
        }
        task(t);
    }
}

fn worker(s: &Shared) {
    let mut seen = s.epoch.load(Ordering::Acquire);
    loop {
        if s.shutdown.load(Ordering::Acquire) {
            return;
        }
        let epoch = s.epoch.load(Ordering::Acquire);
        if epoch != seen {
            seen = epoch;
            join(s);
            continue;
        }
        wait_for_epoch(s, seen);
    }
}

/// Joins the open job, if there is one, and works on it.
fn join(s: &Shared) {
    if s.active.fetch_add(1, Ordering::Acquire) & OPEN != 0 {
        // SAFETY: joined while OPEN: the job was written before `OPEN` was
        // published and stays alive until this worker leaves (see `Shared`).
        let job = unsafe { *s.job.get() };
        let task = unsafe { &*job.task };
        if catch_unwind(AssertUnwindSafe(|| work(s, task, job.count))).is_err() {
            // The rest of this worker's share is lost; the caller panics.
            s.panicked.store(true, Ordering::Relaxed);
            s.next.store(usize::MAX / 2, Ordering::Relaxed);
        }
    }
    s.active.fetch_sub(1, Ordering::Release);
}

/// Spins until the epoch moves past `seen`, then parks if it does not within
/// `SPIN_FOR` (or at once when asked to be quiet).
fn wait_for_epoch(s: &Shared, seen: u64) {
    let start = Instant::now();
    let mut spins = 0u32;
    while s.epoch.load(Ordering::Acquire) == seen {
        std::hint::spin_loop();
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(128) {
            if s.quiet.load(Ordering::Relaxed)
                || s.shutdown.load(Ordering::Relaxed)
                || start.elapsed() > SPIN_FOR
            {
                park(s, seen);
                return;
            }
            // Let another runnable thread have this core, should there be
            // more threads than cores (several backends, other programs).
            std::thread::yield_now();
        }
    }
}

fn park(s: &Shared, seen: u64) {
    let mut guard = s.lock.lock().unwrap_or_else(|e| e.into_inner());
    s.sleepers.fetch_add(1, Ordering::SeqCst);
    while s.epoch.load(Ordering::SeqCst) == seen && !s.shutdown.load(Ordering::SeqCst) {
        guard = s.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
    }
    s.sleepers.fetch_sub(1, Ordering::SeqCst);
}

impl Drop for Team {
    fn drop(&mut self) {
        let s = &*self.shared;
        {
            let _guard = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.shutdown.store(true, Ordering::SeqCst);
            s.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

impl Team {
    /// `f(i, chunk)` for each `chunk`-long piece of `data` (the last may be
    /// shorter), with contiguous runs of pieces spread over the team.
    pub(crate) fn chunks<T: Send>(
        &self,
        data: &mut [T],
        chunk: usize,
        f: impl Fn(usize, &mut [T]) + Sync,
    ) {
        let chunk = chunk.max(1);
        let pieces = data.len().div_ceil(chunk);
        let tasks = pieces.min(self.threads() * 4);
        if tasks == 0 {
            return;
        }
        let per_task = pieces.div_ceil(tasks);
        let (base, len) = (SendPtr(data.as_mut_ptr()), data.len());
        self.run(pieces.div_ceil(per_task), &|t| {
            let base = &base;
            for i in t * per_task..((t + 1) * per_task).min(pieces) {
                let (lo, hi) = (i * chunk, ((i + 1) * chunk).min(len));
                // SAFETY: pieces `i` are disjoint ranges of `data`, which the
                // `&mut` borrow keeps alive and unaliased until `run` returns;
                // each piece is handed to one task only.
                let piece = unsafe { std::slice::from_raw_parts_mut(base.0.add(lo), hi - lo) };
                f(i, piece);
            }
        });
    }

    /// `f(i, piece)` for each `chunk`-long piece of `data`, `per_task`
    /// consecutive pieces per task, the tasks taken last first: for loops
    /// whose later pieces cost more (causal attention), so that the longest
    /// start first and the threads finish together.
    pub(crate) fn chunks_rev<T: Send>(
        &self,
        data: &mut [T],
        chunk: usize,
        per_task: usize,
        f: impl Fn(usize, &mut [T]) + Sync,
    ) {
        let (chunk, per_task) = (chunk.max(1), per_task.max(1));
        let pieces = data.len().div_ceil(chunk);
        let tasks = pieces.div_ceil(per_task);
        let (base, len) = (SendPtr(data.as_mut_ptr()), data.len());
        self.run(tasks, &|t| {
            let base = &base;
            let t = tasks - 1 - t;
            for i in t * per_task..((t + 1) * per_task).min(pieces) {
                let (lo, hi) = (i * chunk, ((i + 1) * chunk).min(len));
                // SAFETY: as in `chunks`: disjoint pieces, one task each,
                // `data` borrowed mutably until `run` returns.
                let piece = unsafe { std::slice::from_raw_parts_mut(base.0.add(lo), hi - lo) };
                f(i, piece);
            }
        });
    }

    /// `f(i, a_i, b_i)` for the `i`-th `ca`-long piece of `a` and `cb`-long
    /// piece of `b`, as many as the shorter has (like `zip` over two
    /// `chunks_mut`), one task per pair.
    pub(crate) fn chunks2<A: Send, B: Send>(
        &self,
        a: &mut [A],
        ca: usize,
        b: &mut [B],
        cb: usize,
        f: impl Fn(usize, &mut [A], &mut [B]) + Sync,
    ) {
        let (ca, cb) = (ca.max(1), cb.max(1));
        let pieces = a.len().div_ceil(ca).min(b.len().div_ceil(cb));
        let (pa, la, pb, lb) = (
            SendPtr(a.as_mut_ptr()),
            a.len(),
            SendPtr(b.as_mut_ptr()),
            b.len(),
        );
        self.run(pieces, &|i| {
            let (pa, pb) = (&pa, &pb);
            let (a0, a1) = (i * ca, ((i + 1) * ca).min(la));
            let (b0, b1) = (i * cb, ((i + 1) * cb).min(lb));
            // SAFETY: piece `i` of each slice is a disjoint range that the
            // `&mut` borrows keep alive and unaliased until `run` returns;
            // task `i` alone receives it.
            let (ai, bi) = unsafe {
                (
                    std::slice::from_raw_parts_mut(pa.0.add(a0), a1 - a0),
                    std::slice::from_raw_parts_mut(pb.0.add(b0), b1 - b0),
                )
            };
            f(i, ai, bi);
        });
    }
}

struct SendPtr<T>(*mut T);
// SAFETY: used only to hand disjoint pieces of a `&mut [T]` with `T: Send` to
// other threads (see `Team::chunks`).
unsafe impl<T: Send> Sync for SendPtr<T> {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once() {
        let team = Team::new(3);
        for count in [0, 1, 2, 7, 1000] {
            let hits: Vec<AtomicUsize> = (0..count).map(|_| AtomicUsize::new(0)).collect();
            team.run(count, &|t| {
                hits[t].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn chunks_rev_cover_the_slice() {
        let team = Team::new(3);
        for per_task in [1, 4, 7] {
            let mut v = vec![0usize; 103];
            team.chunks_rev(&mut v, 5, per_task, |i, c| {
                c.iter_mut().for_each(|x| *x += i + 1)
            });
            assert!(
                v.iter().enumerate().all(|(j, &x)| x == j / 5 + 1),
                "{per_task}"
            );
        }
    }

    #[test]
    fn chunks_cover_the_slice() {
        let team = Team::new(2);
        let mut v = vec![0usize; 1003];
        team.chunks(&mut v, 10, |i, c| c.iter_mut().for_each(|x| *x += i + 1));
        for (j, x) in v.iter().enumerate() {
            assert_eq!(*x, j / 10 + 1);
        }
    }

    #[test]
    fn nested_and_concurrent_jobs_run_serially() {
        let team = Arc::new(Team::new(2));
        let total = AtomicUsize::new(0);
        team.run(4, &|_| {
            team.run(5, &|_| {
                total.fetch_add(1, Ordering::Relaxed);
            })
        });
        assert_eq!(total.load(Ordering::Relaxed), 20);
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let team = Arc::clone(&team);
                std::thread::spawn(move || {
                    let n = AtomicUsize::new(0);
                    for _ in 0..200 {
                        team.run(16, &|_| {
                            n.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                    n.load(Ordering::Relaxed)
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), 3200);
        }
    }

    #[test]
    fn parked_workers_wake_for_the_next_job() {
        let team = Team::new(2);
        team.run(2, &|_| {});
        std::thread::sleep(SPIN_FOR * 3);
        let n = AtomicUsize::new(0);
        team.run(64, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 64);
    }

    #[test]
    fn a_panicking_task_panics_the_caller_and_the_team_goes_on() {
        let team = Team::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            team.run(64, &|t| {
                if t == 40 {
                    panic!("task 40");
                }
            })
        }));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        team.run(8, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 8);
    }
}

/// A pointer to a kernel's output that the team's tasks write disjoint
/// elements of (each task its own columns or rows, as the kernel splits
/// the work).
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(*mut f32);
// SAFETY: the kernels that make one hand each task a disjoint set of
// elements to write (the `write` contract), so sharing the pointer across
// the team's threads cannot race.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    pub(crate) fn new(out: &mut [f32]) -> Self {
        Self(out.as_mut_ptr())
    }

    /// # Safety
    /// `i` must be inside the output, and no other task may touch element `i`.
    pub(crate) unsafe fn write(self, i: usize, v: f32) {
        // SAFETY: the caller's contract.
        unsafe { *self.0.add(i) = v };
    }

    /// `v` into elements `i..i + N`, one copy of a constant length (vector
    /// moves, not a store per element).
    ///
    /// # Safety
    /// `i..i + N` must be inside the output, and no other task may touch it.
    pub(crate) unsafe fn write_run<const N: usize>(self, i: usize, v: &[f32; N]) {
        // SAFETY: the caller's contract; `v` is a different allocation.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), self.0.add(i), N) };
    }
}
