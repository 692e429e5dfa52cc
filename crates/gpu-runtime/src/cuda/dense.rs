//! The dense transformer ops on CUDA. PLACEHOLDER: every op errors until the
//! kernels land (being written now).

use super::CudaBackend;
use crate::error::{GpuError, Result};
use crate::gpu::DeviceSlice;
use crate::ops::{AttnBatch, AttnParams, DenseOps, KvLayer, MatmulDims, RopeParams};

fn todo(op: &str) -> Result<()> {
    Err(GpuError::Unavailable(format!(
        "{op}: CUDA kernel not written yet"
    )))
}

impl DenseOps for CudaBackend {
    fn embedding(
        &self,
        _t: DeviceSlice,
        _i: DeviceSlice,
        _h: usize,
        _o: DeviceSlice,
    ) -> Result<()> {
        todo("embedding")
    }
    fn matmul(
        &self,
        _x: DeviceSlice,
        _w: DeviceSlice,
        _b: Option<DeviceSlice>,
        _o: DeviceSlice,
        _d: MatmulDims,
    ) -> Result<()> {
        todo("matmul")
    }
    fn matmul_swiglu(
        &self,
        _x: DeviceSlice,
        _g: DeviceSlice,
        _u: DeviceSlice,
        _o: DeviceSlice,
        _s: DeviceSlice,
        _d: MatmulDims,
    ) -> Result<()> {
        todo("matmul_swiglu")
    }
    fn rms_norm(
        &self,
        _x: DeviceSlice,
        _w: DeviceSlice,
        _o: DeviceSlice,
        _r: usize,
        _d: usize,
        _e: f32,
        _wo: f32,
    ) -> Result<()> {
        todo("rms_norm")
    }
    fn rope(&self, _x: DeviceSlice, _p: DeviceSlice, _r: &RopeParams) -> Result<()> {
        todo("rope")
    }
    fn kv_store(
        &self,
        _k: DeviceSlice,
        _v: DeviceSlice,
        _c: &KvLayer,
        _s: DeviceSlice,
        _w: usize,
    ) -> Result<()> {
        todo("kv_store")
    }
    fn paged_attention(
        &self,
        _q: DeviceSlice,
        _c: &KvLayer,
        _o: DeviceSlice,
        _s: &AttnBatch,
        _p: &AttnParams,
    ) -> Result<()> {
        todo("paged_attention")
    }
    fn silu_mul(&self, _g: DeviceSlice, _u: DeviceSlice, _o: DeviceSlice, _n: usize) -> Result<()> {
        todo("silu_mul")
    }
    fn relu2(&self, _x: DeviceSlice, _o: DeviceSlice, _n: usize) -> Result<()> {
        todo("relu2")
    }
    fn sigmoid_mul(
        &self,
        _x: DeviceSlice,
        _g: DeviceSlice,
        _o: DeviceSlice,
        _n: usize,
    ) -> Result<()> {
        todo("sigmoid_mul")
    }
    fn add_scaled(&self, _a: DeviceSlice, _x: DeviceSlice, _f: f32, _n: usize) -> Result<()> {
        todo("add_scaled")
    }
    fn scale(&self, _x: DeviceSlice, _f: f32, _n: usize) -> Result<()> {
        todo("scale")
    }
    fn copy_cols(
        &self,
        _s: DeviceSlice,
        _sw: usize,
        _c0: usize,
        _c: usize,
        _d: DeviceSlice,
        _r: usize,
    ) -> Result<()> {
        todo("copy_cols")
    }
    fn scatter_cols(
        &self,
        _s: DeviceSlice,
        _c: usize,
        _d: DeviceSlice,
        _dw: usize,
        _c0: usize,
        _r: usize,
    ) -> Result<()> {
        todo("scatter_cols")
    }
    fn gather_rows(
        &self,
        _s: DeviceSlice,
        _r: DeviceSlice,
        _w: usize,
        _o: DeviceSlice,
    ) -> Result<()> {
        todo("gather_rows")
    }
    fn scatter_add_rows(
        &self,
        _s: DeviceSlice,
        _r: DeviceSlice,
        _w: DeviceSlice,
        _wd: usize,
        _d: DeviceSlice,
    ) -> Result<()> {
        todo("scatter_add_rows")
    }
}
