//! Helpers of the recurrent kernels: activations, a vectorisable `exp`, and
//! a safe strided GEMM on top of the `gemm` crate.

/// torch `softplus` (beta 1, threshold 20).
#[inline]
pub(super) fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

#[inline]
pub(super) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub(super) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `exp(x)` to about 1 ulp (Cephes `expf` polynomial), branch-free so that
/// loops over slices vectorise. Inputs below -87 give 0, above 88 are clamped.
#[inline(always)]
pub(super) fn exp_fast(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    let xc = x.clamp(-87.0, 88.0);
    let t = xc * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 5.000_000_1e-1;
    let e = p * r * r + r + 1.0;
    let ni = t.to_bits() as i32 - MAGIC.to_bits() as i32;
    let scale = f32::from_bits(((ni + 127) << 23) as u32);
    if x < -87.0 { 0.0 } else { e * scale }
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

/// `y += a * x`.
#[inline]
pub(super) fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_fast_matches_std() {
        let mut x = -90.0f32;
        while x < 20.0 {
            let (got, want) = (exp_fast(x), x.exp());
            assert!(
                (got - want).abs() <= 4.0 * f32::EPSILON * want.abs() + 1e-37,
                "exp({x}) = {got}, want {want}"
            );
            x += 0.013;
        }
        assert_eq!(exp_fast(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_fast(0.0), 1.0);
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
