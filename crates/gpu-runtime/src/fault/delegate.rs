//! Compute ops of [`FaultInjecting`] pass through to the wrapped backend.

use super::FaultInjecting;
use crate::error::Result;
use crate::gpu::{DeviceSlice, GpuBackend};
use crate::ops::dense::{AttnParams, DenseOps, KvLayer, MatmulDims, RopeParams};
use crate::ops::moe::{ExpertGroups, ExpertTable, GroupedTopK, Routes};

impl<B: GpuBackend> DenseOps for FaultInjecting<B> {
    fn embedding(
        &self,
        table: DeviceSlice,
        ids: DeviceSlice,
        hidden: usize,
        out: DeviceSlice,
    ) -> Result<()> {
        self.inner.embedding(table, ids, hidden, out)
    }
    fn matmul(
        &self,
        x: DeviceSlice,
        w: DeviceSlice,
        bias: Option<DeviceSlice>,
        out: DeviceSlice,
        dims: MatmulDims,
    ) -> Result<()> {
        self.inner.matmul(x, w, bias, out, dims)
    }
    fn rms_norm(
        &self,
        x: DeviceSlice,
        w: DeviceSlice,
        out: DeviceSlice,
        rows: usize,
        dim: usize,
        eps: f32,
        off: f32,
    ) -> Result<()> {
        self.inner.rms_norm(x, w, out, rows, dim, eps, off)
    }
    fn matmul_swiglu(
        &self,
        x: DeviceSlice,
        gate: DeviceSlice,
        up: DeviceSlice,
        out: DeviceSlice,
        scratch: DeviceSlice,
        d: MatmulDims,
    ) -> Result<()> {
        self.inner.matmul_swiglu(x, gate, up, out, scratch, d)
    }
    fn rope(&self, x: DeviceSlice, positions: DeviceSlice, p: &RopeParams) -> Result<()> {
        self.inner.rope(x, positions, p)
    }
    fn kv_store(
        &self,
        k: DeviceSlice,
        v: DeviceSlice,
        cache: &KvLayer,
        slots: DeviceSlice,
        kv_width: usize,
    ) -> Result<()> {
        self.inner.kv_store(k, v, cache, slots, kv_width)
    }
    fn paged_attention(
        &self,
        q: DeviceSlice,
        cache: &KvLayer,
        out: DeviceSlice,
        seqs: &crate::ops::step::AttnBatch,
        p: &AttnParams,
    ) -> Result<()> {
        self.inner.paged_attention(q, cache, out, seqs, p)
    }
    fn silu_mul(
        &self,
        gate: DeviceSlice,
        up: DeviceSlice,
        out: DeviceSlice,
        n: usize,
    ) -> Result<()> {
        self.inner.silu_mul(gate, up, out, n)
    }
    fn relu2(&self, x: DeviceSlice, out: DeviceSlice, n: usize) -> Result<()> {
        self.inner.relu2(x, out, n)
    }
    fn sigmoid_mul(
        &self,
        x: DeviceSlice,
        gate: DeviceSlice,
        out: DeviceSlice,
        n: usize,
    ) -> Result<()> {
        self.inner.sigmoid_mul(x, gate, out, n)
    }
    fn add_scaled(&self, acc: DeviceSlice, x: DeviceSlice, factor: f32, n: usize) -> Result<()> {
        self.inner.add_scaled(acc, x, factor, n)
    }
    fn scale(&self, x: DeviceSlice, factor: f32, n: usize) -> Result<()> {
        self.inner.scale(x, factor, n)
    }
    fn copy_cols(
        &self,
        src: DeviceSlice,
        sw: usize,
        c0: usize,
        cols: usize,
        dst: DeviceSlice,
        rows: usize,
    ) -> Result<()> {
        self.inner.copy_cols(src, sw, c0, cols, dst, rows)
    }
    fn scatter_cols(
        &self,
        src: DeviceSlice,
        cols: usize,
        dst: DeviceSlice,
        dw: usize,
        c0: usize,
        rows: usize,
    ) -> Result<()> {
        self.inner.scatter_cols(src, cols, dst, dw, c0, rows)
    }
    fn gather_rows(
        &self,
        src: DeviceSlice,
        rows: DeviceSlice,
        width: usize,
        out: DeviceSlice,
    ) -> Result<()> {
        self.inner.gather_rows(src, rows, width, out)
    }
    fn scatter_add_rows(
        &self,
        src: DeviceSlice,
        rows: DeviceSlice,
        weights: DeviceSlice,
        width: usize,
        dst: DeviceSlice,
    ) -> Result<()> {
        self.inner.scatter_add_rows(src, rows, weights, width, dst)
    }
}

impl<B: GpuBackend> crate::ops::MoeOps for FaultInjecting<B> {
    fn softmax_topk(&self, l: DeviceSlice, n: usize, r: bool, routes: &Routes) -> Result<()> {
        self.inner.softmax_topk(l, n, r, routes)
    }
    fn sigmoid_topk(
        &self,
        l: DeviceSlice,
        b: Option<DeviceSlice>,
        n: usize,
        p: &GroupedTopK,
        routes: &Routes,
    ) -> Result<()> {
        self.inner.sigmoid_topk(l, b, n, p, routes)
    }
    fn moe_group(&self, routes: &Routes, g: &ExpertGroups) -> Result<()> {
        self.inner.moe_group(routes, g)
    }
    fn grouped_matmul(
        &self,
        x: DeviceSlice,
        w: &ExpertTable,
        g: &ExpertGroups,
        o: DeviceSlice,
    ) -> Result<()> {
        self.inner.grouped_matmul(x, w, g, o)
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
        self.inner.grouped_matmul_swiglu(x, gate, up, g, o, s)
    }
    fn sigmoid_gate_add(
        &self,
        a: DeviceSlice,
        x: DeviceSlice,
        g: DeviceSlice,
        rows: usize,
        w: usize,
    ) -> Result<()> {
        self.inner.sigmoid_gate_add(a, x, g, rows, w)
    }
}
