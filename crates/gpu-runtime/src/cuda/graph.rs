//! CUDA graphs: the work a closure queues on the backend's stream, captured
//! once (`cuStreamBeginCapture` .. `cuStreamEndCapture`, instantiated) and
//! replayed with one `cuGraphLaunch`, so a small model's decode step is not
//! bound by the host's kernel launches.
//!
//! A graph holds the device addresses and scalar arguments its kernels were
//! captured with; the engine makes them the same for every step it replays
//! (the step's metadata in a fixed layout, uploaded before the replay). The
//! backend's own scratch is the one thing that can move under a graph: when
//! a buffer grows (a larger step after the capture) the old one is freed, so
//! every growth bumps an epoch and a graph captured in an earlier epoch is
//! *stale*: `replay` queues nothing and says so, and the engine captures again.
//!
//! While a capture is open, whatever cannot be captured fails with an error
//! naming the call instead of invalidating the capture (or, worse, running
//! during it): copies to or from the host (the host memory is pageable, and a
//! download waits), synchronisation and fences, allocation and free, and
//! scratch growth. Kernels, device-to-device copies and memsets queued by the
//! capturing thread are captured; the same from another thread fails, since
//! they would land in the graph. The capture mode is thread-local: only the
//! capturing thread's calls are checked by the driver, so another backend
//! used elsewhere in the process is not disturbed.
//!
//! Executable graphs belong to the backend: destroyed on `release_graph`,
//! and those left when the backend is dropped before the context goes.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::{result, sys};
use parking_lot::Mutex;

use super::CudaBackend;
use crate::error::{GpuError, Result};
use crate::gpu::GraphId;

/// An instantiated graph and the scratch epoch it was captured in.
struct Exec {
    exec: sys::CUgraphExec,
    epoch: u64,
}

// SAFETY: an executable graph may be launched and destroyed from any thread
// with its context current (`bind`).
unsafe impl Send for Exec {}

/// The backend's graphs and capture state.
pub(super) struct Graphs {
    execs: Mutex<HashMap<u64, Exec>>,
    next: AtomicU64,
    /// The [`thread_token`] of the thread capturing now; 0 when none.
    capturing: AtomicU64,
    /// Bumped whenever a scratch buffer moves (graphs captured before are stale).
    scratch_epoch: AtomicU64,
}

impl Default for Graphs {
    fn default() -> Self {
        Self {
            execs: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            capturing: AtomicU64::new(0),
            scratch_epoch: AtomicU64::new(0),
        }
    }
}

static NEXT_TOKEN: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static TOKEN: Cell<u64> = const { Cell::new(0) };
}

/// A non-zero number unique to the calling thread.
fn thread_token() -> u64 {
    TOKEN.with(|t| {
        if t.get() == 0 {
            t.set(NEXT_TOKEN.fetch_add(1, Ordering::Relaxed));
        }
        t.get()
    })
}

/// The error of `op` called while a graph is being captured.
pub(super) fn refused(op: &'static str, why: &str) -> GpuError {
    GpuError::Unavailable(format!(
        "{op} is not allowed while a CUDA graph is being captured: {why}"
    ))
}

impl Graphs {
    /// Whether a capture is open (on any thread).
    pub fn capturing(&self) -> bool {
        self.capturing.load(Ordering::Acquire) != 0
    }

    /// For calls that can never be captured (host copies, waits, fences,
    /// allocation, free, scratch growth): an error while a capture is open.
    pub fn refuse_during_capture(&self, op: &'static str) -> Result<()> {
        if self.capturing() {
            return Err(refused(
                op,
                "it would copy host memory, wait for the device or (de)allocate",
            ));
        }
        Ok(())
    }

    /// For work that is captured (kernels, device copies, memsets): an
    /// error when another thread is capturing, since it would land in that
    /// thread's graph.
    pub fn check_queue(&self, op: &'static str) -> Result<()> {
        let now = self.capturing.load(Ordering::Acquire);
        if now != 0 && now != thread_token() {
            return Err(refused(
                op,
                "another thread is capturing this backend's stream",
            ));
        }
        Ok(())
    }

    /// Marks the calling thread as capturing; an error when a capture is open.
    fn begin(&self) -> Result<()> {
        self.capturing
            .compare_exchange(0, thread_token(), Ordering::AcqRel, Ordering::Acquire)
            .map(|_| ())
            .map_err(|_| refused("capture", "a capture is already open"))
    }

    fn end(&self) {
        self.capturing.store(0, Ordering::Release);
    }

    /// A scratch buffer moved: every graph captured so far is stale.
    pub fn scratch_moved(&self) {
        self.scratch_epoch.fetch_add(1, Ordering::AcqRel);
    }

    fn epoch(&self) -> u64 {
        self.scratch_epoch.load(Ordering::Acquire)
    }

    /// Whether a graph captured in `epoch` still points at live scratch.
    fn fresh(&self, epoch: u64) -> bool {
        epoch == self.epoch()
    }

    /// Graphs alive now.
    pub fn count(&self) -> usize {
        self.execs.lock().len()
    }
}

/// Ends an open capture however `capture_graph` leaves (an error, a panic
/// in the body): the stream leaves capture mode and the flag is cleared.
struct OpenCapture<'a> {
    backend: &'a CudaBackend,
    open: bool,
}

impl OpenCapture<'_> {
    /// Ends the capture: the captured graph, or the driver's error (an
    /// invalidated capture).
    fn end(mut self) -> std::result::Result<sys::CUgraph, result::DriverError> {
        self.open = false;
        // SAFETY: the stream is in capture mode, begun by `capture_graph`.
        let graph = unsafe { result::stream::end_capture(self.backend.ctx.stream) };
        self.backend.graphs.end();
        graph
    }
}

impl Drop for OpenCapture<'_> {
    fn drop(&mut self) {
        if self.open {
            // SAFETY: as in `end`; the graph (if any) is discarded at once.
            unsafe {
                if let Ok(g) = result::stream::end_capture(self.backend.ctx.stream)
                    && !g.is_null()
                {
                    let _ = result::graph::destroy(g);
                }
            }
            self.backend.graphs.end();
        }
    }
}

impl CudaBackend {
    pub(super) fn graphs_supported_here(&self) -> bool {
        !self.hooks.debug_sync()
    }

    pub(super) fn capture_graph(&self, body: &mut dyn FnMut() -> Result<()>) -> Result<GraphId> {
        self.hooks.check("capture")?;
        if self.hooks.debug_sync() {
            return Err(refused(
                "capture",
                "debug-sync mode waits after every op (graphs are off there)",
            ));
        }
        self.ctx.bind()?;
        let epoch = self.graphs.epoch();
        self.graphs.begin()?;
        // SAFETY: the backend's live stream, not capturing (the flag was clear).
        if let Err(e) = unsafe {
            result::stream::begin_capture(
                self.ctx.stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        } {
            self.graphs.end();
            return Err(self.device_error("capture", e));
        }
        let open = OpenCapture {
            backend: self,
            open: true,
        };
        let ran = body();
        let ended = open.end();
        let graph = match (ran, ended) {
            (Ok(()), Ok(g)) if !g.is_null() => g,
            (ran, ended) => {
                if let Ok(g) = ended
                    && !g.is_null()
                {
                    // SAFETY: a graph just captured, never instantiated.
                    unsafe {
                        let _ = result::graph::destroy(g);
                    }
                }
                ran?;
                return Err(match ended {
                    Err(e) => self.device_error("capture", e),
                    Ok(_) => refused("capture", "the body queued no work"),
                });
            }
        };
        // SAFETY: a valid graph from `end_capture`; the template is destroyed
        // once the executable exists (or instantiation failed).
        let exec = unsafe {
            let exec = result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0));
            let _ = result::graph::destroy(graph);
            exec.map_err(|e| self.device_error("graph instantiate", e))?
        };
        if !self.graphs.fresh(epoch) {
            // Scratch moved during the capture (refused, so this is only a
            // guard): the graph may point at freed memory.
            // SAFETY: never launched; destroyed once.
            unsafe {
                let _ = result::graph::exec_destroy(exec);
            }
            return Err(refused("capture", "a scratch buffer moved during it"));
        }
        let id = self.graphs.next.fetch_add(1, Ordering::Relaxed);
        self.graphs.execs.lock().insert(id, Exec { exec, epoch });
        Ok(GraphId::from_raw(id))
    }

    pub(super) fn replay_graph(&self, graph: GraphId) -> Result<bool> {
        self.hooks.check("replay")?;
        self.graphs.refuse_during_capture("replay")?;
        let execs = self.graphs.execs.lock();
        let exec = execs.get(&graph.raw()).ok_or_else(|| GpuError::Shape {
            op: "replay",
            detail: format!("no graph {}", graph.raw()),
        })?;
        if !self.graphs.fresh(exec.epoch) {
            return Ok(false);
        }
        self.ctx.bind()?;
        // SAFETY: an executable graph of this context, launched on its stream;
        // every address it holds is live (ledgered memory the engine keeps for
        // the graph's lifetime; scratch of the current epoch).
        unsafe { result::graph::launch(exec.exec, self.ctx.stream) }
            .map_err(|e| self.device_error("replay", e))?;
        drop(execs);
        self.after_launch("replay")?;
        Ok(true)
    }

    pub(super) fn destroy_graph(&self, graph: GraphId) -> Result<()> {
        let Some(Exec { exec, .. }) = self.graphs.execs.lock().remove(&graph.raw()) else {
            return Err(GpuError::Shape {
                op: "release_graph",
                detail: format!("no graph {}", graph.raw()),
            });
        };
        self.ctx.bind()?;
        // SAFETY: removed from the map, so destroyed once; one still queued
        // is freed by the driver when it completes.
        unsafe { result::graph::exec_destroy(exec) }
            .map_err(|e| self.device_error("release_graph", e))
    }

    /// Destroys every graph left (at drop, before the context goes).
    pub(super) fn destroy_graphs(&self) {
        let left: Vec<Exec> = self.graphs.execs.lock().drain().map(|(_, e)| e).collect();
        if left.is_empty() || self.ctx.bind().is_err() {
            return;
        }
        for Exec { exec, .. } in left {
            // SAFETY: drained from the map, destroyed once.
            unsafe {
                let _ = result::graph::exec_destroy(exec);
            }
        }
    }

    /// Graphs alive on this backend.
    pub fn graph_count(&self) -> usize {
        self.graphs.count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_refused_without_a_capture() {
        let g = Graphs::default();
        assert!(!g.capturing());
        g.refuse_during_capture("copy_h2d").unwrap();
        g.check_queue("launch").unwrap();
    }

    #[test]
    fn a_capture_refuses_host_work_and_other_threads_work() {
        let g = Graphs::default();
        g.begin().unwrap();
        let e = g.refuse_during_capture("copy_d2h").unwrap_err().to_string();
        assert!(e.contains("copy_d2h") && e.contains("captured"), "{e}");
        // The capturing thread queues work into the graph.
        g.check_queue("launch").unwrap();
        std::thread::scope(|s| {
            s.spawn(|| {
                let e = g.check_queue("memset_zero").unwrap_err().to_string();
                assert!(e.contains("another thread"), "{e}");
            });
        });
        assert!(g.begin().is_err(), "one capture at a time");
        g.end();
        g.refuse_during_capture("copy_d2h").unwrap();
    }

    /// On a GPU (passes at once, saying so, without one): a graph captures
    /// without running, replays, goes stale when scratch moves, and host
    /// work inside a capture is refused with the stream left usable.
    #[test]
    fn on_a_device_graphs_capture_replay_and_refuse_host_work() {
        use super::super::workspace::Scratch;
        use crate::gpu::GpuBackend;
        use metrale_core::DType;
        let gpu = match CudaBackend::try_new(0) {
            Ok(gpu) => gpu,
            Err(e) => {
                eprintln!("no CUDA device, skipped: {e}");
                return;
            }
        };
        let g: &dyn GpuBackend = &gpu;
        assert!(g.graphs_supported());
        let x = g.alloc_slice(DType::F32, 1024, "x").unwrap();
        g.upload_f32(&[1.0; 1024], x).unwrap();
        for which in 0..4 {
            let e = g
                .capture(&mut || match which {
                    0 => g.download_f32(x).map(|_| ()),
                    1 => g.upload_f32(&[0.0; 4], x),
                    2 => g.synchronize(),
                    _ => g.alloc(16, "in capture").map(|_| ()),
                })
                .unwrap_err()
                .to_string();
            assert!(e.contains("captured"), "{which}: {e}");
        }
        let graph = g.capture(&mut || g.scale(x, 2.0, 1024)).unwrap();
        assert_eq!(
            g.download_f32(x).unwrap()[0],
            1.0,
            "nothing ran while capturing"
        );
        assert!(g.replay(graph).unwrap());
        assert!(g.replay(graph).unwrap());
        assert_eq!(g.download_f32(x).unwrap()[7], 4.0);
        // Scratch that moves makes the graph stale.
        gpu.scratch(Scratch::AttnPartials, 1).unwrap();
        let graph2 = g.capture(&mut || g.scale(x, 0.5, 1024)).unwrap();
        gpu.scratch(Scratch::AttnPartials, 64 << 20).unwrap();
        assert!(!g.replay(graph2).unwrap(), "stale after scratch moved");
        assert_eq!(
            g.download_f32(x).unwrap()[7],
            4.0,
            "a stale graph queues nothing"
        );
        g.release_graph(graph).unwrap();
        assert_eq!(gpu.graph_count(), 1);
        g.free(x.ptr()).unwrap();
        // graph2 is destroyed with the backend.
    }

    #[test]
    fn a_scratch_move_makes_earlier_graphs_stale() {
        let g = Graphs::default();
        let epoch = g.epoch();
        assert!(g.fresh(epoch));
        g.scratch_moved();
        assert!(!g.fresh(epoch));
        assert!(g.fresh(g.epoch()));
    }
}
