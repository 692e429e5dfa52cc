//! Elementwise loops over activation rows, compiled for AVX2+FMA as well as
//! the baseline (chosen at run time by `simd_fn!`): without it the crate's
//! portable build vectorises them with SSE2 only, and the SiLU of a 512-row
//! prefill ran at a fraction of the speed the vector units allow. The
//! results do not depend on which is chosen (the same IEEE operations, no
//! fused multiply-adds).

use super::simd::{exp_fast, sigmoid, silu, simd_fn};
use crate::ops::recurrent::GateOrder;

simd_fn! {
    /// `o = silu(g) · u`.
    pub(super) fn silu_mul(o: &mut [f32], g: &[f32], u: &[f32]) {
        o.iter_mut().zip(g).zip(u).for_each(|((o, g), u)| *o = silu(*g) * u);
    }
}

simd_fn! {
    /// `g = silu(g) · u`, in place (the same operations as [`silu_mul`]).
    pub(super) fn silu_mul_in_place(g: &mut [f32], u: &[f32]) {
        g.iter_mut().zip(u).for_each(|(g, u)| *g = silu(*g) * u);
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

simd_fn! {
    /// `s = exp(s − max)` in place, and `sum` their sum, added in eight
    /// lanes in a fixed order (so the result depends on `s` alone).
    pub(super) fn exp_sub_sum(s: &mut [f32], max: f32, sum: &mut f32) {
        s.iter_mut().for_each(|v| *v = exp_fast(*v - max));
        let mut lanes = [0f32; 8];
        let (body, tail) = s.as_chunks::<8>();
        for c in body {
            for l in 0..8 {
                lanes[l] += c[l];
            }
        }
        *sum = lanes.iter().sum::<f32>() + tail.iter().sum::<f32>();
    }
}

simd_fn! {
    /// `s *= scale` in place, and `max` their maximum: the same value
    /// whatever the order it is taken in, so eight lanes take it.
    pub(super) fn scale_max(s: &mut [f32], scale: f32, max: &mut f32) {
        let mut lanes = [f32::NEG_INFINITY; 8];
        let (body, tail) = s.as_chunks_mut::<8>();
        for c in body {
            for l in 0..8 {
                c[l] *= scale;
                lanes[l] = lanes[l].max(c[l]);
            }
        }
        let mut m = f32::NEG_INFINITY;
        for t in tail {
            *t *= scale;
            m = m.max(*t);
        }
        *max = lanes.iter().fold(m, |a, &b| a.max(b));
    }
}

simd_fn! {
    /// `s /= d` in place (a division each, as the scalar loop did).
    pub(super) fn div_in_place(s: &mut [f32], d: f32) {
        s.iter_mut().for_each(|v| *v /= d);
    }
}

simd_fn! {
    /// One row of [`crate::ops::recurrent::RecurrentOps::gated_rms_norm`]:
    /// each group of `group_size` normalised, weighted and gated by `silu(g)`.
    pub(super) fn gated_rms_norm_row(o: &mut [f32], x: &[f32], g: &[f32], w: &[f32], group_size: usize, eps: f32, order: GateOrder) {
        for (((o, x), g), w) in o
            .chunks_mut(group_size)
            .zip(x.chunks(group_size))
            .zip(g.chunks(group_size))
            .zip(w.chunks(group_size))
        {
            match order {
                GateOrder::BeforeNorm => {
                    o.iter_mut()
                        .zip(x)
                        .zip(g)
                        .for_each(|((o, x), g)| *o = x * silu(*g));
                    let r = 1.0
                        / (super::kernels::dot_f32(o, o) / group_size as f32 + eps).sqrt();
                    o.iter_mut().zip(w).for_each(|(o, w)| *o *= r * w);
                }
                GateOrder::AfterNorm => {
                    let r = 1.0
                        / (super::kernels::dot_f32(x, x) / group_size as f32 + eps).sqrt();
                    o.iter_mut()
                        .zip(x)
                        .zip(g)
                        .zip(w)
                        .for_each(|(((o, x), g), w)| *o = x * r * w * silu(*g));
                }
            }
        }
    }
}

simd_fn! {
    /// A decode step of a causal conv1d with four taps: `o[c] = bias[c] +
    /// Σ_j w[c][j] · ins[j][c]` with `w` as stored (`[o.len(), 4]`), added
    /// in [`conv_row4`]'s order (from 0 where there is no bias).
    pub(super) fn conv_decode4(o: &mut [f32], bias: Option<&[f32]>, w: &[f32], ins: [&[f32]; 4]) {
        let n = o.len();
        let w = &w[..4 * n];
        let (i0, i1, i2, i3) = (&ins[0][..n], &ins[1][..n], &ins[2][..n], &ins[3][..n]);
        let taps = w.as_chunks::<4>().0;
        match bias {
            Some(b) => {
                let b = &b[..n];
                for c in 0..n {
                    let t = taps[c];
                    let mut a = b[c];
                    a += t[0] * i0[c];
                    a += t[1] * i1[c];
                    a += t[2] * i2[c];
                    a += t[3] * i3[c];
                    o[c] = a;
                }
            }
            None => {
                for c in 0..n {
                    let t = taps[c];
                    let mut a = 0.0;
                    a += t[0] * i0[c];
                    a += t[1] * i1[c];
                    a += t[2] * i2[c];
                    a += t[3] * i3[c];
                    o[c] = a;
                }
            }
        }
    }
}

simd_fn! {
    /// One output row of a causal conv1d with four taps, in one pass:
    /// `o = bias + Σ_j w[j] · ins[j]` (`w` tap-major, `[4, o.len()]`), added
    /// in that order as [`mul_add`] tap by tap would, then SiLU if asked.
    pub(super) fn conv_row4(o: &mut [f32], bias: &[f32], w: &[f32], ins: [&[f32]; 4], silu_out: bool) {
        let n = o.len();
        let (b, w) = (&bias[..n], &w[..4 * n]);
        let (w0, w1, w2, w3) = (&w[..n], &w[n..2 * n], &w[2 * n..3 * n], &w[3 * n..]);
        let (i0, i1, i2, i3) = (&ins[0][..n], &ins[1][..n], &ins[2][..n], &ins[3][..n]);
        for c in 0..n {
            let mut a = b[c];
            a += w0[c] * i0[c];
            a += w1[c] * i1[c];
            a += w2[c] * i2[c];
            a += w3[c] * i3[c];
            o[c] = a;
        }
        if silu_out {
            o.iter_mut().for_each(|v| *v = silu(*v));
        }
    }
}
