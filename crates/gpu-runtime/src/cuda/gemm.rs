//! GEMMs through cuBLASLt. PLACEHOLDER: the API the ops call; the body is
//! being written.

use super::CudaBackend;
use crate::error::{GpuError, Result};
use crate::gpu::DeviceSlice;
use crate::ops::MatmulDims;

impl CudaBackend {
    /// `out[m, n] = x[m, k] · w[n, k]ᵀ`: `x` and `out` f32 row-major, `w`
    /// f32, bf16 or f16 row-major (the Hugging Face `Linear` layout). Low
    /// precision weights multiply `x` rounded to the same type, with f32
    /// accumulation; f32 weights use full f32 arithmetic (no TF32).
    pub(crate) fn gemm(
        &self,
        _x: DeviceSlice,
        _w: DeviceSlice,
        _out: DeviceSlice,
        _dims: MatmulDims,
    ) -> Result<()> {
        Err(GpuError::Unavailable("gemm: not written yet".into()))
    }
}
