//! GEMMs through cuBLASLt: `out[m, n] = x[m, k] · w[n, k]ᵀ`, all row-major.
//!
//! # Row-major operands in a column-major library
//!
//! cuBLASLt reads every matrix column-major: a buffer holding a row-major
//! `R×C` matrix with row stride `C` is, to it, the `C×R` matrix (its
//! transpose) with leading dimension `C`. So the three buffers read as
//!
//! - `w`, row-major `[n, k]`   → column-major `wᵀ`, `k×n`, ld = k;
//! - `x`, row-major `[m, k]`   → column-major `xᵀ`, `k×m`, ld = k;
//! - `out`, row-major `[m, n]` → column-major `outᵀ`, `n×m`, ld = n.
//!
//! and `out = x·wᵀ` is `outᵀ = w·xᵀ`, an `n×m` product over `k`. cuBLASLt
//! computes `D = op(A)·op(B)` with `D` `M×N`, so (in its names):
//!
//! - `A` = the `w` buffer, layout `k×n`, ld = k, `TRANSA = T`: op(A) = `w`, `n×k`;
//! - `B` = the `x` buffer (or its cast), layout `k×m`, ld = k, `TRANSB = N`: op(B) = `xᵀ`, `k×m`;
//! - `C` = `D` = the `out` buffer, layout `n×m`, ld = n;
//! - `M = n`, `N = m`, `K = k`.
//!
//! This is the "TN" form, the one every cuBLASLt tensor-core kernel takes.
//! `α = 1`, `β = 0` (C is not read), scale type f32.
//!
//! Types: bf16 (f16) weights multiply `x` cast to bf16 (f16) by
//! `convert.cu` into [`Scratch::GemmInput`], A and B bf16 (f16), C and D
//! f32, `CUBLAS_COMPUTE_32F` (f32 accumulation). f32 weights: everything
//! f32 with `CUBLAS_COMPUTE_32F`, which is full f32 arithmetic (not the
//! `..._FAST_TF32` mode).
//!
//! The handle is created at the first GEMM (so a machine without cuBLASLt
//! can still open the backend and run the other ops; the GEMM then says
//! what is missing) and destroyed with the backend. The descriptors and the
//! heuristic's algorithm are cached per (type, m, n, k, operand alignments).

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::result::CublasError;
use cudarc::cublaslt::sys;
use metrale_core::DType;
use parking_lot::Mutex;

use super::CudaBackend;
use super::kernels;
use super::launch::{LaunchCfg, Ptr};
use super::workspace::Scratch;
use crate::error::{GpuError, Result};
use crate::gpu::{DeviceSlice, GpuBackend};
use crate::ops::MatmulDims;

/// cuBLASLt's workspace: NVIDIA's recommendation for Hopper (32 MiB), which
/// covers the older parts' 4 MiB.
pub(super) const WORKSPACE_BYTES: usize = 32 << 20;

/// Plans kept before the cache is cleared (decode batch sizes and prefill
/// chunk lengths make the distinct `m`s many but bounded).
const MAX_PLANS: usize = 512;

/// `cublasOperation_t` values (the type lives in cuBLAS's bindings, which
/// this build does not enable): `CUBLAS_OP_N`, `CUBLAS_OP_T`.
const OP_N: i32 = 0;
const OP_T: i32 = 1;

/// The cuBLASLt side of a backend: the handle and the cached plans, created
/// at the first GEMM. The lock is held across a whole GEMM, so its scratch
/// (cast input, workspace) is never regrown under a GEMM still being queued.
#[derive(Default)]
pub(super) struct BlasState {
    inner: Mutex<Option<Blas>>,
}

impl BlasState {
    /// Destroys the handle and plans (the context must be current and the
    /// stream idle).
    pub(super) fn release(&self) {
        self.inner.lock().take();
    }
}

struct Blas {
    handle: sys::cublasLtHandle_t,
    plans: HashMap<PlanKey, Plan>,
}

// SAFETY: a cuBLASLt handle and descriptors may be used from any thread
// (with the context current, which every caller binds); the backend uses
// them under a mutex.
unsafe impl Send for Blas {}

impl Blas {
    fn new() -> Result<Self> {
        // SAFETY: only tries to dlopen the library's candidate names; every
        // other cuBLASLt call panics when the library is missing.
        if !unsafe { sys::is_culib_present() } {
            return Err(GpuError::Unavailable(
                "the cuBLASLt library (libcublasLt.so.13) was not found: install the CUDA 13 \
                 cuBLAS (e.g. the nvidia-cublas pip package) and put its lib directory on \
                 LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let handle = lt::create_handle().map_err(|e| blas_error("cublasLtCreate", e))?;
        Ok(Self {
            handle,
            plans: HashMap::new(),
        })
    }

    fn plan(&mut self, key: PlanKey) -> Result<&Plan> {
        if !self.plans.contains_key(&key) {
            if self.plans.len() >= MAX_PLANS {
                self.plans.clear();
            }
            let plan = Plan::new(self.handle, key)?;
            self.plans.insert(key, plan);
        }
        Ok(&self.plans[&key])
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: created in `new`, destroyed once, after its plans.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

/// What a plan depends on: the weight type, the shape, and the alignment
/// (bytes, at most 256) of the A, B and D pointers, which limits the
/// kernels the heuristic may pick.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct PlanKey {
    dtype: DType,
    m: usize,
    n: usize,
    k: usize,
    align_a: u32,
    align_b: u32,
    align_d: u32,
}

/// A matmul descriptor, the A, B and C/D layouts, and the algorithm the
/// heuristic chose for them.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Plan {
    fn new(handle: sys::cublasLtHandle_t, key: PlanKey) -> Result<Self> {
        let ab_type = match key.dtype {
            DType::F32 => sys::cudaDataType_t::CUDA_R_32F,
            DType::BF16 => sys::cudaDataType_t::CUDA_R_16BF,
            DType::F16 => sys::cudaDataType_t::CUDA_R_16F,
            dtype => return Err(GpuError::UnsupportedDType { op: "gemm", dtype }),
        };
        let (m, n, k) = (key.m as u64, key.n as u64, key.k as u64);
        // Filled in step by step; Drop destroys whatever was created.
        let mut plan = Plan {
            desc: std::ptr::null_mut(),
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
            algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        plan.desc = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType_t::CUDA_R_32F,
        )
        .map_err(err("cublasLtMatmulDescCreate"))?;
        // SAFETY: the descriptor is live; each attribute is an int32
        // cublasOperation_t passed by pointer with its size.
        unsafe {
            set_desc(
                plan.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &OP_T,
            )
            .map_err(err("cublasLtMatmulDescSetAttribute"))?;
            set_desc(
                plan.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                &OP_N,
            )
            .map_err(err("cublasLtMatmulDescSetAttribute"))?;
        }
        // A: the w buffer, column-major k×n (ld k), transposed by TRANSA.
        plan.a = lt::create_matrix_layout(ab_type, k, n, k as i64)
            .map_err(err("cublasLtMatrixLayoutCreate"))?;
        // B: the (cast) x buffer, column-major k×m (ld k), not transposed.
        plan.b = lt::create_matrix_layout(ab_type, k, m, k as i64)
            .map_err(err("cublasLtMatrixLayoutCreate"))?;
        // C = D: the out buffer, column-major n×m (ld n), f32.
        plan.d = lt::create_matrix_layout(sys::cudaDataType_t::CUDA_R_32F, n, m, n as i64)
            .map_err(err("cublasLtMatrixLayoutCreate"))?;

        let pref = Pref(lt::create_matmul_pref().map_err(err("cublasLtMatmulPreferenceCreate"))?);
        use sys::cublasLtMatmulPreferenceAttributes_t::*;
        let workspace = WORKSPACE_BYTES as u64;
        // SAFETY: the preference is live; MAX_WORKSPACE_BYTES is a uint64,
        // the MIN_ALIGNMENT attributes uint32, each passed with its size.
        unsafe {
            set_pref(pref.0, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace)
                .map_err(err("cublasLtMatmulPreferenceSetAttribute"))?;
            for (attr, align) in [
                (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_a),
                (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_b),
                (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_d),
                (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_d),
            ] {
                set_pref(pref.0, attr, &align)
                    .map_err(err("cublasLtMatmulPreferenceSetAttribute"))?;
            }
        }
        // SAFETY: every descriptor is live; C and D share a layout.
        let heuristic = unsafe {
            lt::get_matmul_algo_heuristic(handle, plan.desc, plan.a, plan.b, plan.d, plan.d, pref.0)
        }
        .map_err(|e| match e.0 {
            sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED => GpuError::Shape {
                op: "gemm",
                detail: format!(
                    "cuBLASLt has no algorithm for {:?} weights with m={} n={} k={} \
                     (alignments A {} B {} D {} bytes)",
                    key.dtype, key.m, key.n, key.k, key.align_a, key.align_b, key.align_d
                ),
            },
            _ => blas_error("cublasLtMatmulAlgoGetHeuristic", e),
        })?;
        plan.algo = heuristic.algo;
        Ok(plan)
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created once by `new` (or is null).
        unsafe {
            for layout in [self.a, self.b, self.d] {
                if !layout.is_null() {
                    let _ = lt::destroy_matrix_layout(layout);
                }
            }
            if !self.desc.is_null() {
                let _ = lt::destroy_matmul_desc(self.desc);
            }
        }
    }
}

/// A matmul preference, destroyed when dropped.
struct Pref(sys::cublasLtMatmulPreference_t);

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once.
        unsafe {
            let _ = lt::destroy_matmul_pref(self.0);
        }
    }
}

unsafe fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> std::result::Result<(), CublasError> {
    // SAFETY: the caller passes a live descriptor and the attribute's type.
    unsafe { lt::set_matmul_desc_attribute(desc, attr, (value as *const T).cast(), size_of::<T>()) }
}

unsafe fn set_pref<T>(
    pref: sys::cublasLtMatmulPreference_t,
    attr: sys::cublasLtMatmulPreferenceAttributes_t,
    value: &T,
) -> std::result::Result<(), CublasError> {
    // SAFETY: the caller passes a live preference and the attribute's type.
    unsafe { lt::set_matmul_pref_attribute(pref, attr, (value as *const T).cast(), size_of::<T>()) }
}

/// `blas_error(call, _)` as a closure, for `map_err`.
fn err(call: &'static str) -> impl Fn(CublasError) -> GpuError {
    move |e| blas_error(call, e)
}

fn blas_error(call: &str, e: CublasError) -> GpuError {
    GpuError::Driver {
        op: "gemm",
        code: e.0 as i32,
        message: format!("{call}: cuBLASLt {:?}", e.0),
    }
}

/// The alignment of `addr` in bytes, at most 256 (cuBLASLt's default
/// assumption, which a sub-slice of a weight need not meet).
fn alignment(addr: u64) -> u32 {
    1 << addr.trailing_zeros().min(8)
}

fn shape(detail: String) -> GpuError {
    GpuError::Shape { op: "gemm", detail }
}

impl CudaBackend {
    /// `out[m, n] = x[m, k] · w[n, k]ᵀ`: `x` and `out` f32 row-major, `w`
    /// f32, bf16 or f16 row-major (the Hugging Face `Linear` layout). Low
    /// precision weights multiply `x` rounded to the same type, with f32
    /// accumulation; f32 weights use full f32 arithmetic (no TF32).
    pub(crate) fn gemm(
        &self,
        x: DeviceSlice,
        w: DeviceSlice,
        out: DeviceSlice,
        dims: MatmulDims,
    ) -> Result<()> {
        let MatmulDims { m, n, k } = dims;
        for s in [x, out] {
            if s.dtype() != DType::F32 {
                return Err(GpuError::UnsupportedDType {
                    op: "gemm",
                    dtype: s.dtype(),
                });
            }
        }
        let cast = match w.dtype() {
            DType::F32 => None,
            DType::BF16 => Some(&kernels::CAST_F32_BF16),
            DType::F16 => Some(&kernels::CAST_F32_F16),
            dtype => return Err(GpuError::UnsupportedDType { op: "gemm", dtype }),
        };
        // cuBLASLt takes the sizes as 64-bit but its kernels index with
        // 32-bit sizes; refuse what does not fit rather than risk it.
        if [m, n, k].iter().any(|&d| d > i32::MAX as usize) {
            return Err(shape(format!("m={m} n={n} k={k}: a size exceeds 2^31-1")));
        }
        let elements = |a: usize, b: usize| {
            a.checked_mul(b)
                .ok_or_else(|| shape(format!("m={m} n={n} k={k} overflows")))
        };
        let (mk, nk, mn) = (elements(m, k)?, elements(n, k)?, elements(m, n)?);
        x.checked_len("gemm", mk)?;
        w.checked_len("gemm", nk)?;
        out.checked_len("gemm", mn)?;
        if mn == 0 {
            return Ok(());
        }
        let x_at = self.check_range("gemm", x.ptr(), 0, mk * 4)?;
        let w_at = self.check_range("gemm", w.ptr(), 0, nk * w.dtype().size_of())?;
        let out_at = self.check_range("gemm", out.ptr(), 0, mn * 4)?;
        if k == 0 {
            // An empty sum: zeros, as the CPU backend gives.
            return self.memset_zero_raw(out.ptr(), 0, mn * 4);
        }

        let mut blas = self.blas.inner.lock();
        self.ctx.bind()?;
        if blas.is_none() {
            *blas = Some(Blas::new()?);
        }
        let blas = blas.as_mut().expect("created above");

        // B: x itself, or x cast to the weights' type in scratch.
        let b_at = match cast {
            None => x_at,
            Some(kernel) => {
                let staged = self.scratch(Scratch::GemmInput, mk * 2)?;
                let blocks = mk.div_ceil(256).min(1 << 16) as u32;
                self.launch(
                    kernel,
                    LaunchCfg::linear(blocks, 256),
                    (Ptr(x_at), staged, mk as i64),
                )?;
                staged.0
            }
        };
        let workspace = self.scratch(Scratch::GemmWorkspace, WORKSPACE_BYTES)?;
        let key = PlanKey {
            dtype: w.dtype(),
            m,
            n,
            k,
            align_a: alignment(w_at),
            align_b: alignment(b_at),
            align_d: alignment(out_at),
        };
        let handle = blas.handle;
        let plan = blas.plan(key)?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the descriptors are live; A, B and D point at device
        // memory holding at least the elements their layouts describe
        // (checked above against the ledger, or scratch of `mk` elements);
        // C is D and is not read (β = 0); the workspace holds
        // WORKSPACE_BYTES; everything is queued on the backend's stream.
        unsafe {
            lt::matmul(
                handle,
                plan.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                w_at as *const c_void,
                plan.a,
                b_at as *const c_void,
                plan.b,
                out_at as *const c_void,
                plan.d,
                out_at as *mut c_void,
                plan.d,
                &plan.algo,
                workspace.0 as *mut c_void,
                WORKSPACE_BYTES,
                self.ctx.stream as sys::cudaStream_t,
            )
        }
        .map_err(|e| blas_error("cublasLtMatmul", e))?;
        self.after_launch("gemm")
    }
}
