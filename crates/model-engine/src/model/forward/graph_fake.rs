//! A test backend with graphs: the CPU backend, whose `capture` records the
//! ops (and device copies and memsets) the body queues, each with its
//! arguments as they were, *without running them*, and whose `replay` runs
//! the recording again. Like a CUDA graph, a replay repeats the captured
//! addresses and scalars and reads whatever memory holds now, so a forward
//! step that passed anything step-specific outside its device metadata
//! gives different logits replayed than eager. Like a CUDA capture, it
//! refuses host copies, waits, fences and (de)allocation while recording.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use metrale_gpu_runtime::GpuError;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::error::Result;
use metrale_gpu_runtime::gpu::{DevicePtr, DeviceSlice, Fence, GpuBackend, GraphId};
use metrale_gpu_runtime::hooks::Hooks;
use metrale_gpu_runtime::ledger::Ledger;
use metrale_gpu_runtime::ops::step::{AttnBatch, RecurrentBatch, StateSlots};
use metrale_gpu_runtime::ops::{
    AttnParams, ConvAct, DeltaParams, DenseOps, ExpertGroups, ExpertTable, GateOrder, GroupedTopK,
    KvLayer, KvLayout, KvSpec, MatmulDims, MoeOps, Op, RecurrentOps, RopeParams, Routes, SsdParams,
    StateLayout,
};
use parking_lot::Mutex;

type Call = Box<dyn Fn(&CpuBackend) -> Result<()> + Send + Sync>;

#[derive(Default)]
pub struct Recorder {
    pub inner: CpuBackend,
    recording: Mutex<Option<Vec<Call>>>,
    graphs: Mutex<HashMap<u64, Vec<Call>>>,
    next: AtomicU64,
    pub captures: AtomicUsize,
    pub replays: AtomicUsize,
    pub released: AtomicUsize,
    /// The next replay says the graph is stale.
    pub stale_once: AtomicBool,
    /// Captures fail (as a capture that met something it cannot hold).
    pub refuse_captures: AtomicBool,
}

impl Recorder {
    pub fn new() -> Self {
        Self {
            inner: CpuBackend::with_threads(1),
            ..Self::default()
        }
    }

    pub fn live_graphs(&self) -> usize {
        self.graphs.lock().len()
    }

    /// Runs `f` now, or records it while capturing.
    fn queue(&self, f: impl Fn(&CpuBackend) -> Result<()> + Send + Sync + 'static) -> Result<()> {
        let mut rec = self.recording.lock();
        match rec.as_mut() {
            Some(calls) => {
                calls.push(Box::new(f));
                Ok(())
            }
            None => {
                drop(rec);
                f(&self.inner)
            }
        }
    }

    fn refuse(&self, op: &str) -> Result<()> {
        if self.recording.lock().is_some() {
            return Err(GpuError::Unavailable(format!(
                "{op} is not allowed while a graph is being captured"
            )));
        }
        Ok(())
    }
}

impl GpuBackend for Recorder {
    fn name(&self) -> &str {
        "recording-cpu"
    }
    fn supports(&self, op: Op) -> bool {
        self.inner.supports(op)
    }
    fn supports_weights(&self, dtype: metrale_core::DType) -> bool {
        self.inner.supports_weights(dtype)
    }
    fn matmul_input_rounding(&self, weights: metrale_core::DType) -> Option<metrale_core::DType> {
        self.inner.matmul_input_rounding(weights)
    }
    fn ledger(&self) -> &Ledger {
        self.inner.ledger()
    }
    fn hooks(&self) -> &Hooks {
        self.inner.hooks()
    }
    fn alloc_raw(&self, bytes: usize) -> Result<DevicePtr> {
        self.refuse("alloc")?;
        self.inner.alloc_raw(bytes)
    }
    fn free_raw(&self, ptr: DevicePtr, bytes: usize) -> Result<()> {
        self.refuse("free")?;
        self.inner.free_raw(ptr, bytes)
    }
    fn copy_h2d_raw(&self, src: &[u8], dst: DevicePtr, offset: usize) -> Result<()> {
        self.refuse("copy_h2d")?;
        self.inner.copy_h2d_raw(src, dst, offset)
    }
    fn copy_d2h_raw(&self, src: DevicePtr, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.refuse("copy_d2h")?;
        self.inner.copy_d2h_raw(src, offset, dst)
    }
    fn copy_d2d_raw(
        &self,
        s: DevicePtr,
        so: usize,
        d: DevicePtr,
        o: usize,
        n: usize,
    ) -> Result<()> {
        self.queue(move |c| c.copy_d2d_raw(s, so, d, o, n))
    }
    fn memset_zero_raw(&self, dst: DevicePtr, offset: usize, bytes: usize) -> Result<()> {
        self.queue(move |c| c.memset_zero_raw(dst, offset, bytes))
    }
    fn synchronize_raw(&self) -> Result<()> {
        self.refuse("synchronize")?;
        self.inner.synchronize_raw()
    }
    fn record_fence_raw(&self) -> Result<Fence> {
        self.refuse("record_fence")?;
        self.inner.record_fence_raw()
    }
    fn wait_fence_raw(&self, fence: Fence) -> Result<()> {
        self.refuse("wait_fence")?;
        self.inner.wait_fence_raw(fence)
    }
    fn kv_layout(&self, spec: KvSpec) -> Result<KvLayout> {
        self.inner.kv_layout(spec)
    }
    fn state_layout(&self, elements: usize) -> StateLayout {
        self.inner.state_layout(elements)
    }

    fn ssm_state_layout(&self, elements: usize) -> StateLayout {
        self.inner.ssm_state_layout(elements)
    }
    fn available_memory(&self) -> Option<usize> {
        self.inner.available_memory()
    }
    fn graphs_supported(&self) -> bool {
        true
    }
    fn capture(&self, body: &mut dyn FnMut() -> Result<()>) -> Result<GraphId> {
        {
            let mut rec = self.recording.lock();
            if rec.is_some() {
                return Err(GpuError::Unavailable("a capture is open".into()));
            }
            *rec = Some(Vec::new());
        }
        let ran = body();
        let calls = self.recording.lock().take().unwrap_or_default();
        ran?;
        if self.refuse_captures.load(Ordering::Relaxed) {
            return Err(GpuError::Unavailable("this capture is refused".into()));
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        self.graphs.lock().insert(id, calls);
        self.captures.fetch_add(1, Ordering::Relaxed);
        Ok(GraphId::from_raw(id))
    }
    fn replay(&self, graph: GraphId) -> Result<bool> {
        self.refuse("replay")?;
        if self.stale_once.swap(false, Ordering::Relaxed) {
            return Ok(false);
        }
        let graphs = self.graphs.lock();
        let calls = graphs.get(&graph.raw()).ok_or_else(|| GpuError::Shape {
            op: "replay",
            detail: format!("no graph {}", graph.raw()),
        })?;
        for call in calls {
            call(&self.inner)?;
        }
        self.replays.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }
    fn release_graph(&self, graph: GraphId) -> Result<()> {
        self.graphs
            .lock()
            .remove(&graph.raw())
            .map(|_| {
                self.released.fetch_add(1, Ordering::Relaxed);
            })
            .ok_or_else(|| GpuError::Shape {
                op: "release_graph",
                detail: format!("no graph {}", graph.raw()),
            })
    }
}

type S = DeviceSlice;

impl DenseOps for Recorder {
    fn embedding(&self, t: S, ids: S, h: usize, o: S) -> Result<()> {
        self.queue(move |c| c.embedding(t, ids, h, o))
    }
    fn matmul(&self, x: S, w: S, b: Option<S>, o: S, d: MatmulDims) -> Result<()> {
        self.queue(move |c| c.matmul(x, w, b, o, d))
    }
    fn matmul_swiglu(&self, x: S, g: S, u: S, o: S, s: S, d: MatmulDims) -> Result<()> {
        self.queue(move |c| c.matmul_swiglu(x, g, u, o, s, d))
    }
    fn rms_norm(
        &self,
        x: S,
        w: S,
        o: S,
        rows: usize,
        dim: usize,
        eps: f32,
        off: f32,
    ) -> Result<()> {
        self.queue(move |c| c.rms_norm(x, w, o, rows, dim, eps, off))
    }
    fn rope(&self, x: S, pos: S, p: &RopeParams) -> Result<()> {
        let p = *p;
        self.queue(move |c| c.rope(x, pos, &p))
    }
    fn kv_store(&self, k: S, v: S, cache: &KvLayer, slots: S, w: usize) -> Result<()> {
        let cache = *cache;
        self.queue(move |c| c.kv_store(k, v, &cache, slots, w))
    }
    fn paged_attention(
        &self,
        q: S,
        cache: &KvLayer,
        o: S,
        s: &AttnBatch,
        p: &AttnParams,
    ) -> Result<()> {
        let (cache, s, p) = (*cache, *s, *p);
        self.queue(move |c| c.paged_attention(q, &cache, o, &s, &p))
    }
    fn silu_mul(&self, g: S, u: S, o: S, n: usize) -> Result<()> {
        self.queue(move |c| c.silu_mul(g, u, o, n))
    }
    fn relu2(&self, x: S, o: S, n: usize) -> Result<()> {
        self.queue(move |c| c.relu2(x, o, n))
    }
    fn sigmoid_mul(&self, x: S, g: S, o: S, n: usize) -> Result<()> {
        self.queue(move |c| c.sigmoid_mul(x, g, o, n))
    }
    fn add_scaled(&self, a: S, x: S, f: f32, n: usize) -> Result<()> {
        self.queue(move |c| c.add_scaled(a, x, f, n))
    }
    fn scale(&self, x: S, f: f32, n: usize) -> Result<()> {
        self.queue(move |c| c.scale(x, f, n))
    }
    fn copy_cols(&self, s: S, sw: usize, c0: usize, cols: usize, d: S, rows: usize) -> Result<()> {
        self.queue(move |c| c.copy_cols(s, sw, c0, cols, d, rows))
    }
    fn scatter_cols(
        &self,
        s: S,
        cols: usize,
        d: S,
        dw: usize,
        c0: usize,
        rows: usize,
    ) -> Result<()> {
        self.queue(move |c| c.scatter_cols(s, cols, d, dw, c0, rows))
    }
    fn gather_rows(&self, s: S, r: S, w: usize, o: S) -> Result<()> {
        self.queue(move |c| c.gather_rows(s, r, w, o))
    }
    fn scatter_add_rows(&self, s: S, r: S, wt: S, w: usize, d: S) -> Result<()> {
        self.queue(move |c| c.scatter_add_rows(s, r, wt, w, d))
    }
}

impl RecurrentOps for Recorder {
    fn causal_conv1d(
        &self,
        x: S,
        w: S,
        b: Option<S>,
        o: S,
        st: StateSlots,
        s: &RecurrentBatch,
        ch: usize,
        k: usize,
        act: ConvAct,
    ) -> Result<()> {
        let s = *s;
        self.queue(move |c| c.causal_conv1d(x, w, b, o, st, &s, ch, k, act))
    }
    fn ssd_scan(
        &self,
        x: S,
        dt: S,
        b: S,
        cc: S,
        a: S,
        d: S,
        db: S,
        y: S,
        st: StateSlots,
        s: &RecurrentBatch,
        p: &SsdParams,
    ) -> Result<()> {
        let (s, p) = (*s, *p);
        self.queue(move |c| c.ssd_scan(x, dt, b, cc, a, d, db, y, st, &s, &p))
    }
    fn gated_rms_norm(
        &self,
        x: S,
        g: S,
        w: S,
        o: S,
        rows: usize,
        dim: usize,
        gs: usize,
        eps: f32,
        order: GateOrder,
    ) -> Result<()> {
        self.queue(move |c| c.gated_rms_norm(x, g, w, o, rows, dim, gs, eps, order))
    }
    fn gated_delta_rule(
        &self,
        q: S,
        k: S,
        v: S,
        a: S,
        b: S,
        al: S,
        db: S,
        o: S,
        st: StateSlots,
        s: &RecurrentBatch,
        p: &DeltaParams,
    ) -> Result<()> {
        let (s, p) = (*s, *p);
        self.queue(move |c| c.gated_delta_rule(q, k, v, a, b, al, db, o, st, &s, &p))
    }
}

impl MoeOps for Recorder {
    fn softmax_topk(&self, l: S, n: usize, r: bool, routes: &Routes) -> Result<()> {
        let routes = *routes;
        self.queue(move |c| c.softmax_topk(l, n, r, &routes))
    }
    fn sigmoid_topk(
        &self,
        l: S,
        b: Option<S>,
        n: usize,
        p: &GroupedTopK,
        routes: &Routes,
    ) -> Result<()> {
        let (p, routes) = (*p, *routes);
        self.queue(move |c| c.sigmoid_topk(l, b, n, &p, &routes))
    }
    fn moe_group(&self, routes: &Routes, g: &ExpertGroups) -> Result<()> {
        let (routes, g) = (*routes, *g);
        self.queue(move |c| c.moe_group(&routes, &g))
    }
    fn grouped_matmul(&self, x: S, w: &ExpertTable, g: &ExpertGroups, o: S) -> Result<()> {
        let (w, g) = (*w, *g);
        self.queue(move |c| c.grouped_matmul(x, &w, &g, o))
    }
    fn grouped_matmul_swiglu(
        &self,
        x: S,
        gate: &ExpertTable,
        up: &ExpertTable,
        g: &ExpertGroups,
        o: S,
        s: S,
    ) -> Result<()> {
        let (gate, up, g) = (*gate, *up, *g);
        self.queue(move |c| c.grouped_matmul_swiglu(x, &gate, &up, &g, o, s))
    }
    fn sigmoid_gate_add(&self, a: S, x: S, g: S, rows: usize, w: usize) -> Result<()> {
        self.queue(move |c| c.sigmoid_gate_add(a, x, g, rows, w))
    }
}
