//! Short vector loops of attention (a head's `q · k` and `o += w · v`), with
//! AVX-512 or AVX2+FMA chosen at run time and a portable fallback. The build
//! targets baseline x86-64, so without these the loops run on SSE2.

use super::gemv::Isa;

/// `a · b` over `a.len()` elements (`b` at least as long).
#[inline]
pub(crate) fn dot(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    let b = &b[..a.len()];
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::detect` found AVX-512F on this CPU; equal lengths.
        Isa::Avx512 => unsafe { x86::dot512(a, b) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::detect` found AVX2 and FMA on this CPU; equal lengths.
        Isa::Avx2 => unsafe { x86::dot256(a, b) },
        _ => super::kernels::dot_f32(a, b),
    }
}

/// `o += w * v` over `o.len()` elements (`v` at least as long).
#[inline]
pub(crate) fn axpy(isa: Isa, o: &mut [f32], w: f32, v: &[f32]) {
    let v = &v[..o.len()];
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::detect` found AVX-512F on this CPU; equal lengths.
        Isa::Avx512 => unsafe { x86::axpy512(o, w, v) },
        _ => o.iter_mut().zip(v).for_each(|(o, v)| *o += w * v),
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX-512F; `a.len() == b.len()`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dot512(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len() / 16 * 16;
        let (mut s0, mut s1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut c = 0;
        while c + 32 <= n {
            // SAFETY: `c + 32 <= n <= len` for both slices.
            unsafe {
                s0 = _mm512_fmadd_ps(
                    _mm512_loadu_ps(a.as_ptr().add(c)),
                    _mm512_loadu_ps(b.as_ptr().add(c)),
                    s0,
                );
                s1 = _mm512_fmadd_ps(
                    _mm512_loadu_ps(a.as_ptr().add(c + 16)),
                    _mm512_loadu_ps(b.as_ptr().add(c + 16)),
                    s1,
                );
            }
            c += 32;
        }
        if c < n {
            // SAFETY: `c + 16 == n <= len`.
            unsafe {
                s0 = _mm512_fmadd_ps(
                    _mm512_loadu_ps(a.as_ptr().add(c)),
                    _mm512_loadu_ps(b.as_ptr().add(c)),
                    s0,
                )
            };
        }
        let tail: f32 = (n..a.len()).map(|i| a[i] * b[i]).sum();
        _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) + tail
    }

    /// # Safety
    /// AVX2 and FMA; `a.len() == b.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot256(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len() / 8 * 8;
        let mut s = _mm256_setzero_ps();
        let mut c = 0;
        while c < n {
            // SAFETY: `c + 8 <= n <= len` for both slices.
            unsafe {
                s = _mm256_fmadd_ps(
                    _mm256_loadu_ps(a.as_ptr().add(c)),
                    _mm256_loadu_ps(b.as_ptr().add(c)),
                    s,
                )
            };
            c += 8;
        }
        let hi = _mm256_extractf128_ps::<1>(s);
        let q = _mm_add_ps(hi, _mm256_castps256_ps128(s));
        let q = _mm_add_ps(q, _mm_movehl_ps(q, q));
        let q = _mm_add_ss(q, _mm_shuffle_ps::<1>(q, q));
        _mm_cvtss_f32(q) + (n..a.len()).map(|i| a[i] * b[i]).sum::<f32>()
    }

    /// # Safety
    /// AVX-512F; `o.len() == v.len()`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn axpy512(o: &mut [f32], w: f32, v: &[f32]) {
        let n = o.len() / 16 * 16;
        let wv = _mm512_set1_ps(w);
        let mut c = 0;
        while c < n {
            // SAFETY: `c + 16 <= n <= len` for both slices.
            unsafe {
                let acc = _mm512_fmadd_ps(
                    wv,
                    _mm512_loadu_ps(v.as_ptr().add(c)),
                    _mm512_loadu_ps(o.as_ptr().add(c)),
                );
                _mm512_storeu_ps(o.as_mut_ptr().add(c), acc);
            }
            c += 16;
        }
        for i in n..o.len() {
            o[i] += w * v[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn match_the_portable_loops() {
        for n in [1usize, 7, 16, 33, 64, 128, 131] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            for isa in [Isa::detect(), Isa::Portable] {
                let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
                assert!((dot(isa, &a, &b) - want).abs() < 1e-4, "{isa:?} dot {n}");
                let mut o = a.clone();
                axpy(isa, &mut o, 0.5, &b);
                for i in 0..n {
                    assert!((o[i] - (a[i] + 0.5 * b[i])).abs() < 1e-6);
                }
            }
        }
    }
}
