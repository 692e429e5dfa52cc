//! Helpers of the recurrent kernels: `softplus`, per-thread scratch buffers,
//! the decay matrix of a chunk, and a safe strided GEMM on top of the `gemm`
//! crate. The vector helpers the other CPU kernels share too (`simd_fn!`,
//! `exp_fast`, `dot`, `axpy`, ...) are in `cpu/simd.rs`.

use crate::cpu::simd::{exp_fast, simd_fn};

/// Side of the sub-blocks through which [`decay_lower`] factorises.
const SUB: usize = 16;

/// Most tokens of one sequence processed per pass of the scans: their
/// per-call buffers hold this many rows, whatever the sequence's length.
pub(super) const SPAN: usize = 256;

thread_local! {
    static POOL: std::cell::RefCell<Vec<Vec<f32>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Buffers a thread keeps for reuse, and the largest kept (f32s): at most
/// 16 MiB per thread stays allocated between calls.
const POOL_BUFFERS: usize = 4;
const POOL_MAX_LEN: usize = 1 << 20;

/// A zeroed f32 buffer whose storage is reused across calls (kept per
/// thread, a few at a time), so that the scans' per-call buffers do not
/// fault in fresh pages on every call.
pub(super) struct Buf(Vec<f32>);

impl Buf {
    pub fn zeroed(n: usize) -> Self {
        let mut v = POOL.with(|p| p.borrow_mut().pop()).unwrap_or_default();
        v.clear();
        v.resize(n, 0.0);
        Buf(v)
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        POOL.with(|p| {
            let mut p = p.borrow_mut();
            if p.len() < POOL_BUFFERS && v.capacity() <= POOL_MAX_LEN {
                p.push(v);
            }
        });
    }
}

impl std::ops::Deref for Buf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.0
    }
}

impl std::ops::DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.0
    }
}

/// torch `softplus` (beta 1, threshold 20).
#[inline]
pub(super) fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// A read-only strided matrix: element `(i, j)` at `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub(super) struct View<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

impl<'a> View<'a> {
    /// Row-major rows `ld` apart.
    pub fn rows(data: &'a [f32], ld: usize) -> Self {
        Self {
            data,
            rs: ld,
            cs: 1,
        }
    }

    /// The transpose of a row-major matrix with rows `ld` apart.
    pub fn t(data: &'a [f32], ld: usize) -> Self {
        Self {
            data,
            rs: 1,
            cs: ld,
        }
    }
}

fn extent(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * rs + (cols - 1) * cs + 1
    }
}

/// `dst[m, n] = keep * dst + scale * lhs[m, k] · rhs[k, n]`, or without the
/// `keep` term when `keep` is None. `dst` is row-major with rows `dst_ld` apart.
/// Single-threaded unless `threads > 1`.
#[allow(clippy::too_many_arguments)]
pub(super) fn matmul(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_ld: usize,
    keep: Option<f32>,
    lhs: View<'_>,
    rhs: View<'_>,
    scale: f32,
    threads: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    // These bounds make the raw-pointer call below stay inside the slices;
    // callers derive the shapes from validated operands, so a failure here
    // is a bug in this module, not bad input.
    assert!(dst.len() >= extent(m, n, dst_ld, 1), "matmul dst too short");
    assert!(
        lhs.data.len() >= extent(m, k, lhs.rs, lhs.cs),
        "matmul lhs too short"
    );
    assert!(
        rhs.data.len() >= extent(k, n, rhs.rs, rhs.cs),
        "matmul rhs too short"
    );
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: every element the strides address lies inside its slice
    // (asserted above); `dst` is borrowed mutably, so it aliases neither input.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_ld as isize,
            keep.is_some(),
            lhs.data.as_ptr(),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr(),
            rhs.cs as isize,
            rhs.rs as isize,
            keep.unwrap_or(0.0),
            scale,
            false,
            false,
            false,
            par,
        );
    }
}

simd_fn! {
    /// The decay matrix of a chunk: for `t < cum.len()`, row `t` of `out`
    /// (rows `ld` apart) gets `exp(cum_t − cum_s)` at `s ≤ t`; entries right of
    /// `t` are left alone. `col` holds `cum.len()` scratch values.
    ///
    /// Away from the diagonal this is `exp(cum_t − cum_e)·exp(cum_e − cum_s)`
    /// with `e` the end of `s`'s sub-block of [`SUB`]: two factors in (0, 1], so
    /// nothing overflows, and one exp per row and sub-block instead of one per
    /// entry. Differences are taken in f64.
    pub(super) fn decay_lower(cum: &[f64], out: &mut [f32], ld: usize, col: &mut [f32]) {
        let q = cum.len();
        for (s, c) in col[..q].iter_mut().enumerate() {
            let e = ((s / SUB + 1) * SUB).min(q) - 1;
            *c = exp_fast((cum[e] - cum[s]) as f32);
        }
        for (t, &ct) in cum.iter().enumerate() {
            let tb = t / SUB * SUB;
            let row = &mut out[t * ld..t * ld + t + 1];
            let (far, near) = row.split_at_mut(tb);
            for (jb, (o, c)) in far.chunks_mut(SUB).zip(col.chunks(SUB)).enumerate() {
                let u = exp_fast((ct - cum[jb * SUB + SUB - 1]) as f32);
                o.iter_mut().zip(c).for_each(|(o, c)| *o = u * c);
            }
            near.iter_mut().zip(&cum[tb..]).for_each(|(o, &cs)| *o = exp_fast((ct - cs) as f32));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decay_lower_matches_direct_exp() {
        let q = 53;
        let mut acc = 0f64;
        let cum: Vec<f64> = (0..q)
            .map(|i| {
                acc -= [0.01, 3.0, 0.5, 20.0][i % 4];
                acc
            })
            .collect();
        let (mut out, mut col) = (vec![-1.0f32; q * q], vec![0.0; q]);
        decay_lower(&cum, &mut out, q, &mut col);
        for t in 0..q {
            for s in 0..q {
                let got = out[t * q + s];
                if s > t {
                    assert_eq!(got, -1.0);
                } else {
                    // An f32 exponent d carries |d|·2^-24 of rounding.
                    let d = cum[t] - cum[s];
                    let want = d.exp();
                    let tol = 3e-7 * (1.0 + d.abs()) * want + 1e-37;
                    assert!(
                        (got as f64 - want).abs() <= tol,
                        "({t}, {s}): {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn matmul_strided_matches_naive() {
        let (m, n, k) = (5, 3, 4);
        let a: Vec<f32> = (0..m * k).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b: Vec<f32> = (0..n * k).map(|i| (i as f32).sin()).collect();
        // b viewed transposed: b is [n, k] row-major, rhs = bᵀ [k, n].
        let mut out = vec![1.0f32; m * n];
        matmul(
            m,
            n,
            k,
            &mut out,
            n,
            Some(2.0),
            View::rows(&a, k),
            View::t(&b, k),
            -1.0,
            1,
        );
        for i in 0..m {
            for j in 0..n {
                let dot: f32 = (0..k).map(|kk| a[i * k + kk] * b[j * k + kk]).sum();
                assert!((out[i * n + j] - (2.0 - dot)).abs() < 1e-5);
            }
        }
    }
}
