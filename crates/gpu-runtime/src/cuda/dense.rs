//! The dense transformer ops on CUDA: each op begins (`Hooks::begin_op`),
//! checks its operands on the host (`args.rs`, `attention.rs`), then queues
//! its kernels (`kernels/dense.cu`, `kernels/attention.cu`) or GEMMs.

use super::CudaBackend;
use super::args::{self, Launch, elements, matmul as check_matmul};
use super::kernels::{
    ADD_SCALED, BIAS_ADD, COPY_COLS, EMBEDDING, GATHER_ROWS, RELU2, RMS_NORM, ROPE, SCALE,
    SCATTER_ADD_ROWS, SCATTER_COLS, SIGMOID_MUL, SILU_MUL,
};
use super::launch::{Kernel, KernelArgs, Ptr};
use crate::error::Result;
use crate::gpu::{DeviceSlice, GpuBackend};
use crate::ops::{AttnBatch, AttnParams, DenseOps, KvLayer, MatmulDims, RopeParams};

impl CudaBackend {
    /// Queues `l` on `kernel`, if there is anything to do.
    pub(super) fn launch_opt<A: KernelArgs>(
        &self,
        kernel: &Kernel<A>,
        l: Option<Launch<A>>,
    ) -> Result<()> {
        match l {
            Some(l) => self.launch(kernel, l.cfg, l.args),
            None => Ok(()),
        }
    }

    /// `out = x · wᵀ` through cuBLASLt; `k == 0` gives zeros.
    fn gemm_or_zero(
        &self,
        x: DeviceSlice,
        w: DeviceSlice,
        out: DeviceSlice,
        d: MatmulDims,
    ) -> Result<()> {
        if d.k == 0 {
            return self.memset_zero_raw(out.ptr(), 0, d.m * d.n * 4);
        }
        self.gemm(x, w, out, d)
    }
}

impl DenseOps for CudaBackend {
    fn embedding(
        &self,
        table: DeviceSlice,
        ids: DeviceSlice,
        hidden: usize,
        out: DeviceSlice,
    ) -> Result<()> {
        self.hooks.begin_op("embedding")?;
        self.launch_opt(&EMBEDDING, args::embedding(table, ids, hidden, out)?)
    }

    fn matmul(
        &self,
        x: DeviceSlice,
        w: DeviceSlice,
        bias: Option<DeviceSlice>,
        out: DeviceSlice,
        d: MatmulDims,
    ) -> Result<()> {
        const OP: &str = "matmul";
        self.hooks.begin_op(OP)?;
        let MatmulDims { m, n, k } = d;
        let bias_code = check_matmul(OP, x, &[(w, "w")], bias, out, m, n, k)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        self.gemm_or_zero(x, w, out, d)?;
        if let (Some(b), Some(code)) = (bias, bias_code) {
            let l = args::bias_add(out, b, code, m, n)?;
            self.launch(&BIAS_ADD, l.cfg, l.args)?;
        }
        Ok(())
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
        const OP: &str = "matmul_swiglu";
        self.hooks.begin_op(OP)?;
        let MatmulDims { m, n, k } = d;
        check_matmul(OP, x, &[(gate, "gate"), (up, "up")], None, out, m, n, k)?;
        args::f32s(OP, scratch, m * n, "scratch")?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        // Not fused: the values of two matmuls and silu_mul, to the bit.
        self.gemm_or_zero(x, gate, out, d)?;
        self.gemm_or_zero(x, up, scratch, d)?;
        let len = (m * n) as i64;
        self.launch(
            &SILU_MUL,
            elements(m * n),
            (Ptr::of(out), Ptr::of(scratch), Ptr::of(out), len),
        )
    }

    fn rms_norm(
        &self,
        x: DeviceSlice,
        w: DeviceSlice,
        out: DeviceSlice,
        rows: usize,
        dim: usize,
        eps: f32,
        weight_offset: f32,
    ) -> Result<()> {
        self.hooks.begin_op("rms_norm")?;
        let l = args::rms_norm(x, w, out, rows, dim, eps, weight_offset)?;
        self.launch_opt(&RMS_NORM, l)
    }

    fn rope(&self, x: DeviceSlice, positions: DeviceSlice, p: &RopeParams) -> Result<()> {
        self.hooks.begin_op("rope")?;
        self.launch_opt(&ROPE, args::rope(x, positions, p)?)
    }

    fn kv_store(
        &self,
        k: DeviceSlice,
        v: DeviceSlice,
        cache: &KvLayer,
        slots: DeviceSlice,
        kv_width: usize,
    ) -> Result<()> {
        self.kv_store_op(k, v, cache, slots, kv_width)
    }

    fn paged_attention(
        &self,
        q: DeviceSlice,
        cache: &KvLayer,
        out: DeviceSlice,
        seqs: &AttnBatch,
        p: &AttnParams,
    ) -> Result<()> {
        self.paged_attention_op(q, cache, out, seqs, p)
    }

    fn silu_mul(
        &self,
        gate: DeviceSlice,
        up: DeviceSlice,
        out: DeviceSlice,
        n: usize,
    ) -> Result<()> {
        const OP: &str = "silu_mul";
        self.hooks.begin_op(OP)?;
        let Some(len) = args::elementwise(OP, &[(gate, "gate"), (up, "up"), (out, "out")], n)?
        else {
            return Ok(());
        };
        self.launch(
            &SILU_MUL,
            elements(n),
            (Ptr::of(gate), Ptr::of(up), Ptr::of(out), len),
        )
    }

    fn relu2(&self, x: DeviceSlice, out: DeviceSlice, n: usize) -> Result<()> {
        const OP: &str = "relu2";
        self.hooks.begin_op(OP)?;
        let Some(len) = args::elementwise(OP, &[(x, "x"), (out, "out")], n)? else {
            return Ok(());
        };
        self.launch(&RELU2, elements(n), (Ptr::of(x), Ptr::of(out), len))
    }

    fn sigmoid_mul(
        &self,
        x: DeviceSlice,
        gate: DeviceSlice,
        out: DeviceSlice,
        n: usize,
    ) -> Result<()> {
        const OP: &str = "sigmoid_mul";
        self.hooks.begin_op(OP)?;
        let Some(len) = args::elementwise(OP, &[(x, "x"), (gate, "gate"), (out, "out")], n)? else {
            return Ok(());
        };
        self.launch(
            &SIGMOID_MUL,
            elements(n),
            (Ptr::of(x), Ptr::of(gate), Ptr::of(out), len),
        )
    }

    fn add_scaled(&self, acc: DeviceSlice, x: DeviceSlice, factor: f32, n: usize) -> Result<()> {
        const OP: &str = "add_scaled";
        self.hooks.begin_op(OP)?;
        let Some(len) = args::elementwise(OP, &[(acc, "acc"), (x, "x")], n)? else {
            return Ok(());
        };
        self.launch(
            &ADD_SCALED,
            elements(n),
            (Ptr::of(acc), Ptr::of(x), factor, len),
        )
    }

    fn scale(&self, x: DeviceSlice, factor: f32, n: usize) -> Result<()> {
        const OP: &str = "scale";
        self.hooks.begin_op(OP)?;
        let Some(len) = args::elementwise(OP, &[(x, "x")], n)? else {
            return Ok(());
        };
        self.launch(&SCALE, elements(n), (Ptr::of(x), factor, len))
    }

    fn copy_cols(
        &self,
        src: DeviceSlice,
        src_width: usize,
        col_start: usize,
        cols: usize,
        dst: DeviceSlice,
        rows: usize,
    ) -> Result<()> {
        self.hooks.begin_op("copy_cols")?;
        let l = args::copy_cols(src, src_width, col_start, cols, dst, rows)?;
        self.launch_opt(&COPY_COLS, l)
    }

    fn scatter_cols(
        &self,
        src: DeviceSlice,
        cols: usize,
        dst: DeviceSlice,
        dst_width: usize,
        col_start: usize,
        rows: usize,
    ) -> Result<()> {
        self.hooks.begin_op("scatter_cols")?;
        let l = args::scatter_cols(src, cols, dst, dst_width, col_start, rows)?;
        self.launch_opt(&SCATTER_COLS, l)
    }

    fn gather_rows(
        &self,
        src: DeviceSlice,
        rows: DeviceSlice,
        width: usize,
        out: DeviceSlice,
    ) -> Result<()> {
        self.hooks.begin_op("gather_rows")?;
        self.launch_opt(&GATHER_ROWS, args::gather_rows(src, rows, width, out)?)
    }

    fn scatter_add_rows(
        &self,
        src: DeviceSlice,
        rows: DeviceSlice,
        weights: DeviceSlice,
        width: usize,
        dst: DeviceSlice,
    ) -> Result<()> {
        self.hooks.begin_op("scatter_add_rows")?;
        let l = args::scatter_add_rows(src, rows, weights, width, dst)?;
        self.launch_opt(&SCATTER_ADD_ROWS, l)
    }
}
