//! Compute ops of [`FaultInjecting`] pass through to the wrapped backend.

use super::FaultInjecting;
use crate::error::Result;
use crate::gpu::{DeviceSlice, GpuBackend};
use crate::ops::dense::{
    AttnParams, AttnSeq, DenseOps, GroupedTopK, KvLayer, MatmulDims, RopeParams,
};

impl<B: GpuBackend> DenseOps for FaultInjecting<B> {
    fn embedding(
        &self,
        table: DeviceSlice,
        ids: &[u32],
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
    fn rope(&self, x: DeviceSlice, positions: &[u32], p: &RopeParams<'_>) -> Result<()> {
        self.inner.rope(x, positions, p)
    }
    fn kv_store(
        &self,
        k: DeviceSlice,
        v: DeviceSlice,
        cache: &KvLayer,
        slots: &[u32],
        kv_width: usize,
    ) -> Result<()> {
        self.inner.kv_store(k, v, cache, slots, kv_width)
    }
    fn paged_attention(
        &self,
        q: DeviceSlice,
        cache: &KvLayer,
        out: DeviceSlice,
        seqs: &[AttnSeq<'_>],
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
        rows: &[u32],
        width: usize,
        out: DeviceSlice,
    ) -> Result<()> {
        self.inner.gather_rows(src, rows, width, out)
    }
    fn scatter_add_rows(
        &self,
        src: DeviceSlice,
        rows: &[u32],
        weights: &[f32],
        width: usize,
        dst: DeviceSlice,
    ) -> Result<()> {
        self.inner.scatter_add_rows(src, rows, weights, width, dst)
    }
    fn softmax_topk(
        &self,
        logits: DeviceSlice,
        rows: usize,
        n: usize,
        k: usize,
        renorm: bool,
    ) -> Result<Vec<(u32, f32)>> {
        self.inner.softmax_topk(logits, rows, n, k, renorm)
    }
    fn sigmoid_topk(
        &self,
        logits: DeviceSlice,
        bias: Option<DeviceSlice>,
        rows: usize,
        n: usize,
        p: &GroupedTopK,
    ) -> Result<Vec<(u32, f32)>> {
        self.inner.sigmoid_topk(logits, bias, rows, n, p)
    }
}
