//! A backend that is the CPU backend with chosen ops broken: what the suite
//! must catch.

use std::collections::HashMap;

use metrale_gpu_runtime::GpuError;
use metrale_gpu_runtime::conformance::Op;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::error::Result;
use metrale_gpu_runtime::gpu::{DevicePtr, DeviceSlice, Fence, GpuBackend};
use metrale_gpu_runtime::hooks::Hooks;
use metrale_gpu_runtime::ledger::Ledger;
use metrale_gpu_runtime::ops::step::{AttnBatch, RecurrentBatch, StateSlots};
use metrale_gpu_runtime::ops::{
    AttnParams, ConvAct, DeltaParams, DenseOps, ExpertGroups, ExpertTable, GateOrder, GroupedTopK,
    KvLayer, MatmulDims, MoeOps, RecurrentOps, RopeParams, Routes, SsdParams,
};
use metrale_gpu_runtime::ops::{KvLayout, KvSpec, StateLayout};

/// How an op is broken.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fault {
    /// Not supported, and an error when called (as it must be).
    Missing,
    /// Said to be unsupported, but runs anyway.
    Lying,
    /// Runs, then adds 0.01 to the first output element.
    Off,
    /// Runs, and leaves 64 bytes allocated.
    Leaks,
    /// Panics.
    Panics,
}

pub struct Doctored {
    pub inner: CpuBackend,
    pub faults: HashMap<Op, Fault>,
}

impl Doctored {
    fn run(&self, op: Op, out: DeviceSlice, f: impl FnOnce() -> Result<()>) -> Result<()> {
        match self.faults.get(&op) {
            None | Some(Fault::Lying) => f(),
            Some(Fault::Missing) => Err(GpuError::Unavailable(format!("no {op} here"))),
            Some(Fault::Off) => {
                f()?;
                let mut b = [0u8; 4];
                self.inner.copy_d2h(out.ptr(), 0, &mut b)?;
                let v = f32::from_le_bytes(b) + 0.01;
                self.inner.copy_h2d(&v.to_le_bytes(), out.ptr(), 0)
            }
            Some(Fault::Leaks) => {
                f()?;
                let gpu: &dyn GpuBackend = &self.inner;
                gpu.alloc(64, "leak").map(|_| ())
            }
            Some(Fault::Panics) => panic!("doctored {op} panics"),
        }
    }
}

impl GpuBackend for Doctored {
    fn name(&self) -> &str {
        "doctored-cpu"
    }
    fn supports(&self, op: Op) -> bool {
        !matches!(self.faults.get(&op), Some(Fault::Missing | Fault::Lying))
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
    fn alloc_raw(&self, bytes: usize) -> Result<DevicePtr> {
        self.inner.alloc_raw(bytes)
    }
    fn free_raw(&self, ptr: DevicePtr, bytes: usize) -> Result<()> {
        self.inner.free_raw(ptr, bytes)
    }
    fn hooks(&self) -> &Hooks {
        self.inner.hooks()
    }
    fn copy_h2d_raw(&self, src: &[u8], dst: DevicePtr, offset: usize) -> Result<()> {
        self.inner.copy_h2d_raw(src, dst, offset)
    }
    fn copy_d2h_raw(&self, src: DevicePtr, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.inner.copy_d2h_raw(src, offset, dst)
    }
    fn copy_d2d_raw(
        &self,
        s: DevicePtr,
        so: usize,
        d: DevicePtr,
        dof: usize,
        n: usize,
    ) -> Result<()> {
        self.inner.copy_d2d_raw(s, so, d, dof, n)
    }
    fn memset_zero_raw(&self, dst: DevicePtr, offset: usize, bytes: usize) -> Result<()> {
        self.inner.memset_zero_raw(dst, offset, bytes)
    }
    fn synchronize_raw(&self) -> Result<()> {
        self.inner.synchronize_raw()
    }
    fn record_fence_raw(&self) -> Result<Fence> {
        self.inner.record_fence_raw()
    }
    fn wait_fence_raw(&self, fence: Fence) -> Result<()> {
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
}

impl DenseOps for Doctored {
    fn embedding(&self, t: DeviceSlice, ids: DeviceSlice, h: usize, o: DeviceSlice) -> Result<()> {
        self.run(Op::Embedding, o, || self.inner.embedding(t, ids, h, o))
    }
    fn matmul(
        &self,
        x: DeviceSlice,
        w: DeviceSlice,
        b: Option<DeviceSlice>,
        o: DeviceSlice,
        d: MatmulDims,
    ) -> Result<()> {
        self.run(Op::Matmul, o, || self.inner.matmul(x, w, b, o, d))
    }
    fn matmul_swiglu(
        &self,
        x: DeviceSlice,
        g: DeviceSlice,
        u: DeviceSlice,
        o: DeviceSlice,
        s: DeviceSlice,
        d: MatmulDims,
    ) -> Result<()> {
        self.run(Op::MatmulSwiglu, o, || {
            self.inner.matmul_swiglu(x, g, u, o, s, d)
        })
    }
    fn rms_norm(
        &self,
        x: DeviceSlice,
        w: DeviceSlice,
        o: DeviceSlice,
        rows: usize,
        dim: usize,
        eps: f32,
        off: f32,
    ) -> Result<()> {
        self.run(Op::RmsNorm, o, || {
            self.inner.rms_norm(x, w, o, rows, dim, eps, off)
        })
    }
    fn rope(&self, x: DeviceSlice, pos: DeviceSlice, p: &RopeParams) -> Result<()> {
        self.run(Op::Rope, x, || self.inner.rope(x, pos, p))
    }
    fn kv_store(
        &self,
        k: DeviceSlice,
        v: DeviceSlice,
        c: &KvLayer,
        slots: DeviceSlice,
        w: usize,
    ) -> Result<()> {
        self.run(Op::KvStore, c.v, || self.inner.kv_store(k, v, c, slots, w))
    }
    fn paged_attention(
        &self,
        q: DeviceSlice,
        c: &KvLayer,
        o: DeviceSlice,
        s: &AttnBatch,
        p: &AttnParams,
    ) -> Result<()> {
        self.run(Op::PagedAttention, o, || {
            self.inner.paged_attention(q, c, o, s, p)
        })
    }
    fn silu_mul(&self, g: DeviceSlice, u: DeviceSlice, o: DeviceSlice, n: usize) -> Result<()> {
        self.run(Op::SiluMul, o, || self.inner.silu_mul(g, u, o, n))
    }
    fn relu2(&self, x: DeviceSlice, o: DeviceSlice, n: usize) -> Result<()> {
        self.run(Op::Relu2, o, || self.inner.relu2(x, o, n))
    }
    fn sigmoid_mul(&self, x: DeviceSlice, g: DeviceSlice, o: DeviceSlice, n: usize) -> Result<()> {
        self.run(Op::SigmoidMul, o, || self.inner.sigmoid_mul(x, g, o, n))
    }
    fn add_scaled(&self, a: DeviceSlice, x: DeviceSlice, f: f32, n: usize) -> Result<()> {
        self.run(Op::AddScaled, a, || self.inner.add_scaled(a, x, f, n))
    }
    fn scale(&self, x: DeviceSlice, f: f32, n: usize) -> Result<()> {
        self.run(Op::Scale, x, || self.inner.scale(x, f, n))
    }
    fn copy_cols(
        &self,
        s: DeviceSlice,
        sw: usize,
        c0: usize,
        cols: usize,
        d: DeviceSlice,
        rows: usize,
    ) -> Result<()> {
        self.run(Op::CopyCols, d, || {
            self.inner.copy_cols(s, sw, c0, cols, d, rows)
        })
    }
    fn scatter_cols(
        &self,
        s: DeviceSlice,
        cols: usize,
        d: DeviceSlice,
        dw: usize,
        c0: usize,
        rows: usize,
    ) -> Result<()> {
        self.run(Op::ScatterCols, d, || {
            self.inner.scatter_cols(s, cols, d, dw, c0, rows)
        })
    }
    fn gather_rows(&self, s: DeviceSlice, r: DeviceSlice, w: usize, o: DeviceSlice) -> Result<()> {
        self.run(Op::GatherRows, o, || self.inner.gather_rows(s, r, w, o))
    }
    fn scatter_add_rows(
        &self,
        s: DeviceSlice,
        r: DeviceSlice,
        wt: DeviceSlice,
        w: usize,
        d: DeviceSlice,
    ) -> Result<()> {
        self.run(Op::ScatterAddRows, d, || {
            self.inner.scatter_add_rows(s, r, wt, w, d)
        })
    }
}

impl RecurrentOps for Doctored {
    fn causal_conv1d(
        &self,
        x: DeviceSlice,
        w: DeviceSlice,
        b: Option<DeviceSlice>,
        o: DeviceSlice,
        st: StateSlots,
        s: &RecurrentBatch,
        ch: usize,
        k: usize,
        act: ConvAct,
    ) -> Result<()> {
        self.run(Op::CausalConv1d, o, || {
            self.inner.causal_conv1d(x, w, b, o, st, s, ch, k, act)
        })
    }
    fn ssd_scan(
        &self,
        x: DeviceSlice,
        dt: DeviceSlice,
        b: DeviceSlice,
        c: DeviceSlice,
        a: DeviceSlice,
        d: DeviceSlice,
        db: DeviceSlice,
        y: DeviceSlice,
        st: StateSlots,
        s: &RecurrentBatch,
        p: &SsdParams,
    ) -> Result<()> {
        self.run(Op::SsdScan, y, || {
            self.inner.ssd_scan(x, dt, b, c, a, d, db, y, st, s, p)
        })
    }
    fn gated_rms_norm(
        &self,
        x: DeviceSlice,
        g: DeviceSlice,
        w: DeviceSlice,
        o: DeviceSlice,
        rows: usize,
        dim: usize,
        gs: usize,
        eps: f32,
        order: GateOrder,
    ) -> Result<()> {
        self.run(Op::GatedRmsNorm, o, || {
            self.inner
                .gated_rms_norm(x, g, w, o, rows, dim, gs, eps, order)
        })
    }
    fn gated_delta_rule(
        &self,
        q: DeviceSlice,
        k: DeviceSlice,
        v: DeviceSlice,
        a: DeviceSlice,
        b: DeviceSlice,
        al: DeviceSlice,
        db: DeviceSlice,
        o: DeviceSlice,
        st: StateSlots,
        s: &RecurrentBatch,
        p: &DeltaParams,
    ) -> Result<()> {
        self.run(Op::GatedDeltaRule, o, || {
            self.inner
                .gated_delta_rule(q, k, v, a, b, al, db, o, st, s, p)
        })
    }
}

impl MoeOps for Doctored {
    fn softmax_topk(&self, l: DeviceSlice, n: usize, r: bool, routes: &Routes) -> Result<()> {
        self.run(Op::SoftmaxTopk, routes.weights, || {
            self.inner.softmax_topk(l, n, r, routes)
        })
    }
    fn sigmoid_topk(
        &self,
        l: DeviceSlice,
        b: Option<DeviceSlice>,
        n: usize,
        p: &GroupedTopK,
        routes: &Routes,
    ) -> Result<()> {
        self.run(Op::SigmoidTopk, routes.weights, || {
            self.inner.sigmoid_topk(l, b, n, p, routes)
        })
    }
    fn moe_group(&self, routes: &Routes, g: &ExpertGroups) -> Result<()> {
        self.run(Op::MoeGroup, g.weights, || self.inner.moe_group(routes, g))
    }
    fn grouped_matmul(
        &self,
        x: DeviceSlice,
        w: &ExpertTable,
        g: &ExpertGroups,
        o: DeviceSlice,
    ) -> Result<()> {
        self.run(Op::GroupedMatmul, o, || {
            self.inner.grouped_matmul(x, w, g, o)
        })
    }
    fn grouped_matmul_swiglu(
        &self,
        x: DeviceSlice,
        gate: &ExpertTable,
        up: &ExpertTable,
        g: &ExpertGroups,
        o: DeviceSlice,
        s: DeviceSlice,
    ) -> Result<()> {
        self.run(Op::GroupedMatmulSwiglu, o, || {
            self.inner.grouped_matmul_swiglu(x, gate, up, g, o, s)
        })
    }
    fn sigmoid_gate_add(
        &self,
        a: DeviceSlice,
        x: DeviceSlice,
        g: DeviceSlice,
        rows: usize,
        w: usize,
    ) -> Result<()> {
        self.run(Op::SigmoidGateAdd, a, || {
            self.inner.sigmoid_gate_add(a, x, g, rows, w)
        })
    }
}
