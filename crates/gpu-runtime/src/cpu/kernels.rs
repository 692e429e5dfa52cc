//! Inner loops shared by the CPU ops: weight widening, dot products, GEMM.
//!
//! Written as plain slices with fixed-width accumulators so that LLVM
//! vectorises them; no allocation per element.

use half::{bf16, f16};
use metrale_core::{DType, QuantFormat};

use crate::error::{GpuError, Result};

/// A weight matrix in its stored dtype.
#[derive(Clone, Copy)]
pub(crate) enum Weights<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
    /// bf16 pairs in panels ([`DType::BF16Panels`]): the matmuls read them
    /// through `gemm_bf16`; not addressable by element offset alone.
    Panels(&'a [u32]),
    /// GGML blocks (a format `cpu::quant` multiplies); element offsets into
    /// it are whole blocks (the ops check their row lengths).
    Quant(QuantFormat, &'a [u8]),
    /// GGML blocks in groups of rows ([`DType::QuantGroups`]): read by the
    /// matmuls and by whole rows.
    QuantGroups(QuantFormat, &'a [u8]),
}

impl<'a> Weights<'a> {
    pub(crate) fn from_bytes(op: &'static str, dtype: DType, bytes: &'a [u8]) -> Result<Self> {
        let whole_pairs =
            (bytes.as_ptr() as usize).is_multiple_of(4) && bytes.len().is_multiple_of(4);
        if dtype == DType::BF16Panels && !whole_pairs {
            return Err(GpuError::Shape {
                op,
                detail: "bf16 panels must start and end on whole pairs".into(),
            });
        }
        // SAFETY: backend allocations are 64-byte aligned and slices start at
        // whole-element offsets, so the casts below are aligned (panels, as
        // u32 pairs, were checked to start on 4 bytes just above); f32, bf16,
        // f16 and u32 accept every bit pattern.
        unsafe {
            Ok(match dtype {
                DType::F32 => Weights::F32(std::slice::from_raw_parts(
                    bytes.as_ptr().cast(),
                    bytes.len() / 4,
                )),
                DType::BF16 => Weights::BF16(std::slice::from_raw_parts(
                    bytes.as_ptr().cast(),
                    bytes.len() / 2,
                )),
                DType::F16 => Weights::F16(std::slice::from_raw_parts(
                    bytes.as_ptr().cast(),
                    bytes.len() / 2,
                )),
                DType::BF16Panels => Weights::Panels(std::slice::from_raw_parts(
                    bytes.as_ptr().cast(),
                    bytes.len() / 4,
                )),
                DType::Quant(q) if super::quant::supports(q.ggml()) => Weights::Quant(q, bytes),
                DType::QuantGroups(q) if super::quant::supports(q.ggml()) => {
                    Weights::QuantGroups(q, bytes)
                }
                other => return Err(GpuError::UnsupportedDType { op, dtype: other }),
            })
        }
    }

    /// The block length rows must be a whole number of (1 for floats).
    pub(crate) fn block_elems(&self) -> usize {
        match self {
            Weights::Quant(q, _) | Weights::QuantGroups(q, _) => q.block_elems(),
            _ => 1,
        }
    }

    /// Widens elements `start..start + out.len()` into `out` (grouped
    /// quantized weights: a whole row, `start` a multiple of `out.len()`;
    /// NaN otherwise).
    pub(crate) fn widen_into(&self, start: usize, out: &mut [f32]) {
        let n = out.len();
        match self {
            Weights::F32(w) => out.copy_from_slice(&w[start..start + n]),
            Weights::BF16(w) => {
                for (o, v) in out.iter_mut().zip(&w[start..start + n]) {
                    *o = f32::from_bits((v.to_bits() as u32) << 16);
                }
            }
            Weights::F16(w) => {
                for (o, v) in out.iter_mut().zip(&w[start..start + n]) {
                    *o = v.to_f32();
                }
            }
            Weights::Quant(q, bytes) => dequantize(*q, bytes, start, out),
            Weights::QuantGroups(q, bytes) => match start.checked_div(n) {
                Some(j) if j * n == start => {
                    super::quant::dequantize_grouped_row(q.ggml(), bytes, j, out)
                }
                _ => out.fill(f32::NAN),
            },
            // Reached by no op (the matmuls route panels to `gemm_bf16`,
            // `embedding` reads rows with `panel_row`); NaN, not a panic.
            Weights::Panels(_) => out.fill(f32::NAN),
        }
    }

    /// `dot(x, w[start..start + x.len()])`.
    #[inline]
    pub(crate) fn dot(&self, start: usize, x: &[f32]) -> f32 {
        match self {
            Weights::F32(w) => dot_f32(x, &w[start..start + x.len()]),
            Weights::BF16(w) => dot_bf16(x, &w[start..start + x.len()]),
            Weights::F16(w) => {
                let mut buf = [0f32; 64];
                let mut acc = 0f32;
                for (xc, wc) in x.chunks(64).zip(w[start..start + x.len()].chunks(64)) {
                    for (b, v) in buf.iter_mut().zip(wc) {
                        *b = v.to_f32();
                    }
                    acc += dot_f32(xc, &buf[..xc.len()]);
                }
                acc
            }
            // Reached by no op (the matmuls route both to their kernels);
            // NaN, not a panic.
            Weights::Panels(_) | Weights::QuantGroups(..) => f32::NAN,
            Weights::Quant(q, _) => {
                // Block by block through f32 (the matmuls take the integer
                // path, `cpu::quant`; this serves odd callers).
                let mut buf = [0f32; 256];
                let step = q.block_elems().max(1);
                let mut acc = 0f32;
                for (c, xc) in x.chunks(step).enumerate() {
                    self.widen_into(start + c * step, &mut buf[..xc.len()]);
                    acc += dot_f32(xc, &buf[..xc.len()]);
                }
                acc
            }
        }
    }
}

/// Dequantizes elements `start..start + out.len()` of GGML blocks. The ops
/// check that both are whole blocks inside `bytes`; were they not, the
/// values come out NaN (never a panic, never a read out of bounds).
fn dequantize(q: QuantFormat, bytes: &[u8], start: usize, out: &mut [f32]) {
    let ty = q.ggml();
    let from = DType::Quant(q).bytes_for(start);
    let len = DType::Quant(q).bytes_for(out.len());
    let done = match (from, len) {
        (Some(a), Some(l)) => bytes
            .get(a..a.saturating_add(l))
            .is_some_and(|src| metrale_core::quant::dequantize_row(ty, src, out).is_ok()),
        _ => false,
    };
    if !done {
        out.fill(f32::NAN);
    }
}

const LANES: usize = 16;

/// f32 dot product with independent accumulators (vectorises).
#[inline]
pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = a.len() / LANES;
    for c in 0..chunks {
        let (x, y) = (
            &a[c * LANES..c * LANES + LANES],
            &b[c * LANES..c * LANES + LANES],
        );
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = 0f32;
    for i in chunks * LANES..a.len() {
        s += a[i] * b[i];
    }
    acc.iter().sum::<f32>() + s
}

/// Dot product of f32 activations with bf16 weights, widening in registers.
#[inline]
pub(crate) fn dot_bf16(a: &[f32], b: &[bf16]) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = a.len() / LANES;
    for c in 0..chunks {
        let (x, y) = (
            &a[c * LANES..c * LANES + LANES],
            &b[c * LANES..c * LANES + LANES],
        );
        for l in 0..LANES {
            acc[l] += x[l] * f32::from_bits((y[l].to_bits() as u32) << 16);
        }
    }
    let mut s = 0f32;
    for i in chunks * LANES..a.len() {
        s += a[i] * f32::from_bits((b[i].to_bits() as u32) << 16);
    }
    acc.iter().sum::<f32>() + s
}

/// `out[m, n] = x[m, k] · w[n, k]ᵀ` with f32 `w`, through the `gemm` crate.
/// `out` rows are `out_ld` apart (columns beyond `n` are left alone).
pub(crate) fn gemm_xwt(
    x: &[f32],
    w: &[f32],
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    out_ld: usize,
    threads: usize,
) {
    assert!(
        x.len() >= m * k && w.len() >= n * k && out_ld >= n && out.len() >= (m - 1) * out_ld + n
    );
    let par = if threads > 1 && m * n * k > 64 * 64 * 64 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the pointers cover the m*k, n*k and m*n elements the strides
    // address (asserted above); `out` does not alias `x` or `w` (the caller
    // holds it as `&mut`). Strides: x row-major (rs = k, cs = 1); wᵀ is
    // [k, n] with element (kk, nn) at w[nn * k + kk] (rs = 1, cs = k);
    // out row-major (rs = out_ld, cs = 1).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            out_ld as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}
