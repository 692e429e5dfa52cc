//! Elementwise loops over activation rows, compiled for AVX2+FMA as well as
//! the baseline (chosen at run time by `simd_fn!`): without it the crate's
//! portable build vectorises them with SSE2 only, and the SiLU of a 512-row
//! prefill ran at a fraction of the speed the vector units allow. The
//! results do not depend on which is chosen (the same IEEE operations, no
//! fused multiply-adds).

use super::recurrent::math::{sigmoid, silu, simd_fn};

simd_fn! {
    /// `o = silu(g) · u`.
    pub(super) fn silu_mul(o: &mut [f32], g: &[f32], u: &[f32]) {
        o.iter_mut().zip(g).zip(u).for_each(|((o, g), u)| *o = silu(*g) * u);
    }
}

simd_fn! {
    /// `o = x · sigmoid(g)`.
    pub(super) fn sigmoid_mul(o: &mut [f32], x: &[f32], g: &[f32]) {
        o.iter_mut().zip(x).zip(g).for_each(|((o, x), g)| *o = x * sigmoid(*g));
    }
}

simd_fn! {
    /// `o = max(x, 0)²`.
    pub(super) fn relu2(o: &mut [f32], x: &[f32]) {
        o.iter_mut().zip(x).for_each(|(o, x)| {
            let r = x.max(0.0);
            *o = r * r
        });
    }
}

simd_fn! {
    /// `a += factor · x` (`a += x` when the factor is 1, exactly).
    pub(super) fn add_scaled(a: &mut [f32], x: &[f32], factor: f32) {
        if factor == 1.0 {
            a.iter_mut().zip(x).for_each(|(a, x)| *a += x);
        } else {
            a.iter_mut().zip(x).for_each(|(a, x)| *a += factor * x);
        }
    }
}

simd_fn! {
    /// `o += w · x`.
    pub(super) fn mul_add(o: &mut [f32], w: &[f32], x: &[f32]) {
        o.iter_mut().zip(w).zip(x).for_each(|((o, w), x)| *o += w * x);
    }
}

simd_fn! {
    /// `o = silu(o)`.
    pub(super) fn silu_in_place(o: &mut [f32]) {
        o.iter_mut().for_each(|v| *v = silu(*v));
    }
}
