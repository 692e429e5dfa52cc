//! The K-quants: super-blocks of 256 elements split into sub-blocks of 16
//! or 32 with their own quantized scales.
//!
//! Layouts (little-endian; `d`, `dmin` f16 unless noted):
//!
//! | type | bytes | layout (byte offsets)                                        |
//! |------|-------|--------------------------------------------------------------|
//! | Q2_K | 84    | `scales[16]`@0 (low nibble scale, high nibble min), `qs[64]`@16, `d`@80, `dmin`@82 |
//! | Q3_K | 110   | `hmask[32]`@0, `qs[64]`@32, `scales[12]`@96 (16 6-bit scales), `d`@108 |
//! | Q4_K | 144   | `d`@0, `dmin`@2, `scales[12]`@4 (8 6-bit scales and mins, see [`scale_min_k4`]), `qs[128]`@16 |
//! | Q5_K | 176   | `d`@0, `dmin`@2, `scales[12]`@4, `qh[32]`@16, `qs[128]`@48     |
//! | Q6_K | 210   | `ql[128]`@0, `qh[64]`@128, `scales[16]: i8`@192, `d`@208      |
//! | Q8_K | 292   | `d: f32`@0, `qs[256]: i8`@4, `bsums[16]: i16`@260 (sums of 16 quants) |
//!
//! In Q4_K/Q5_K, quants 64i..64i+31 are the low nibbles of
//! `qs[32i..32i+32]` and 64i+32.. the high nibbles (Q5_K's fifth bits:
//! bit 2i resp. 2i+1 of `qh[l]`). In Q6_K, each half of 128 elements takes
//! 64 bytes of `ql` and 32 of `qh`: element l+32k (k < 4) has low bits from
//! nibble k/2 of `ql[l + 32(k%2)]` and high bits `qh[l] >> 2k`.

use super::{f16_at, put_f16};

// Q2_K and Q3_K (rare in practice: the 2-3 bit mixes) live in `k23.rs`.

pub(super) const QK_K: usize = 256;

/// llama.cpp's `nearest_int`: round to nearest, ties to even, through the
/// float's mantissa (valid for |f| < 2^22, which the callers ensure).
#[inline]
pub(super) fn nearest_int(f: f32) -> i32 {
    let v = f + 12_582_912.0;
    // Wrapping (the difference lies in ±2^22): a checked subtraction would
    // keep the quantizers' loops scalar under overflow checks.
    (v.to_bits() as i32 & 0x007f_ffff).wrapping_sub(0x0040_0000)
}

/// Scale and min `j` (< 8) of a Q4_K/Q5_K block's 12 scale bytes: 6 bits
/// each; the first four in the low 6 bits of bytes j and j+4, the last
/// four in bytes j+4's nibbles plus the top 2 bits of bytes j-4 and j.
#[inline]
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// llama.cpp's `make_qkx2_quants`: levels 0..=nmax with a scale and a
/// (non-positive) offset, fitted by weighted least squares over a sweep of
/// `nstep + 1` candidate scales. Returns (scale, -offset).
#[allow(clippy::too_many_arguments)]
pub(super) fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l_out: &mut [u8],
    laux: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l_out.fill(0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l_out[i] = l as u8;
        let diff = scale * l as f32 + min - x[i];
        best_error += weights[i] * if use_mad { diff.abs() } else { diff * diff };
    }
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = l as u8;
            let w = weights[i];
            let lf = l as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * if use_mad { diff.abs() } else { diff * diff };
            }
            if cur_error < best_error {
                l_out[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// llama.cpp's `make_qx_quants` with `rmse_type` 1 and no importance
/// weights (weights x²): symmetric levels -nmax..nmax-1 (stored + nmax),
/// the best of 19 candidate scales by weighted least squares.
fn make_qx_quants(nmax: i32, x: &[f32], l_out: &mut [i8]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < 1e-15 {
        l_out.fill(0);
        return 0.0;
    }
    let mut iscale = -nmax as f32 / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for (i, &v) in x.iter().enumerate() {
        let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        l_out[i] = (l + nmax) as i8;
        let w = v * v;
        let lf = l as f32;
        sumlx += w * v * lf;
        suml2 += w * lf * lf;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for &v in x {
            let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
            let w = v * v;
            let lf = l as f32;
            sumlx += w * v * lf;
            suml2 += w * lf * lf;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (i, &v) in x.iter().enumerate() {
                let l = nearest_int(iscale * v);
                l_out[i] = (nmax + l.clamp(-nmax, nmax - 1)) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// The shared part of Q4_K and Q5_K: per sub-block of 32 a scale and min
/// (`make_qkx2_quants` with llama.cpp's parameters for `nmax`), 6-bit
/// quantized against the super-block's `d`/`dmin`, then the levels
/// recomputed with the quantized scales. Writes `d`, `dmin`, `scales`,
/// returns the levels.
fn quant_k_scales(x: &[f32], y: &mut [u8], nmax: i32) -> [u8; QK_K] {
    let (rmin, nstep) = if nmax == 15 { (-1.0, 20) } else { (-0.5, 15) };
    let mut l = [0u8; QK_K];
    let mut laux = [0u8; 32];
    let mut weights = [0f32; 32];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        let (s, m) = make_qkx2_quants(
            nmax,
            xs,
            &weights,
            &mut l[32 * j..32 * j + 32],
            &mut laux,
            rmin,
            0.1,
            nstep,
            false,
        );
        scales[j] = s;
        mins[j] = m;
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let sc = &mut y[4..16];
    sc.fill(0);
    for j in 0..8 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    put_f16(y, 0, max_scale / 63.0);
    put_f16(y, 2, max_min / 63.0);
    let (d_all, dmin_all) = (f16_at(y, 0), f16_at(y, 2));
    for j in 0..8 {
        let (s, m) = scale_min_k4(j, &y[4..16]);
        let d = d_all * s as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dmin_all * m as f32;
        for ii in 0..32 {
            let q = nearest_int((x[32 * j + ii] + dm) / d).clamp(0, nmax);
            l[32 * j + ii] = q as u8;
        }
    }
    l
}

pub(super) fn quant_q4_k(x: &[f32], y: &mut [u8]) {
    let l = quant_k_scales(x, y, 15);
    for (c, chunk) in l.chunks_exact(64).enumerate() {
        for i in 0..32 {
            y[16 + 32 * c + i] = chunk[i] | (chunk[i + 32] << 4);
        }
    }
}

pub(super) fn dequant_q4_k(b: &[u8], y: &mut [f32]) {
    let (d, min) = (f16_at(b, 0), f16_at(b, 2));
    for c in 0..4 {
        let q = &b[16 + 32 * c..48 + 32 * c];
        let (s1, m1) = scale_min_k4(2 * c, &b[4..16]);
        let (s2, m2) = scale_min_k4(2 * c + 1, &b[4..16]);
        let (d1, m1) = (d * s1 as f32, min * m1 as f32);
        let (d2, m2) = (d * s2 as f32, min * m2 as f32);
        let out = &mut y[64 * c..64 * c + 64];
        for l in 0..32 {
            out[l] = d1 * (q[l] & 0xF) as f32 - m1;
            out[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

pub(super) fn quant_q5_k(x: &[f32], y: &mut [u8]) {
    let l = quant_k_scales(x, y, 31);
    y[16..48].fill(0);
    let (mut m1, mut m2) = (1u8, 2u8);
    for (c, chunk) in l.chunks_exact(64).enumerate() {
        for j in 0..32 {
            let (mut l1, mut l2) = (chunk[j], chunk[j + 32]);
            if l1 > 15 {
                l1 -= 16;
                y[16 + j] |= m1;
            }
            if l2 > 15 {
                l2 -= 16;
                y[16 + j] |= m2;
            }
            y[48 + 32 * c + j] = l1 | (l2 << 4);
        }
        m1 <<= 2;
        m2 <<= 2;
    }
}

pub(super) fn dequant_q5_k(b: &[u8], y: &mut [f32]) {
    let (d, min) = (f16_at(b, 0), f16_at(b, 2));
    let qh = &b[16..48];
    for c in 0..4 {
        let ql = &b[48 + 32 * c..80 + 32 * c];
        let (s1, m1) = scale_min_k4(2 * c, &b[4..16]);
        let (s2, m2) = scale_min_k4(2 * c + 1, &b[4..16]);
        let (d1, m1) = (d * s1 as f32, min * m1 as f32);
        let (d2, m2) = (d * s2 as f32, min * m2 as f32);
        let (u1, u2) = (1u8 << (2 * c), 2u8 << (2 * c));
        let out = &mut y[64 * c..64 * c + 64];
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            out[l] = d1 * ((ql[l] & 0xF) + h1) as f32 - m1;
            out[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
        }
    }
}

pub(super) fn quant_q6_k(x: &[f32], y: &mut [u8]) {
    let mut l = [0i8; QK_K];
    let mut scales = [0f32; 16];
    let (mut max_scale, mut max_abs_scale) = (0f32, 0f32);
    for ib in 0..16 {
        let s = make_qx_quants(32, &x[16 * ib..16 * ib + 16], &mut l[16 * ib..16 * ib + 16]);
        scales[ib] = s;
        if s.abs() > max_abs_scale {
            max_abs_scale = s.abs();
            max_scale = s;
        }
    }
    y.fill(0);
    if max_abs_scale < 1e-15 {
        return;
    }
    let iscale = -128.0 / max_scale;
    put_f16(y, 208, 1.0 / iscale);
    for ib in 0..16 {
        y[192 + ib] = nearest_int(iscale * scales[ib]).min(127) as i8 as u8;
    }
    let d_all = f16_at(y, 208);
    for j in 0..16 {
        let d = d_all * (y[192 + j] as i8) as f32;
        if d == 0.0 {
            continue;
        }
        for ii in 0..16 {
            let q = nearest_int(x[16 * j + ii] / d).clamp(-32, 31);
            l[16 * j + ii] = (q + 32) as i8;
        }
    }
    for h in 0..2 {
        let lh = &l[128 * h..128 * h + 128];
        for i in 0..32 {
            let q = |k: usize| lh[i + 32 * k] as u8;
            y[64 * h + i] = (q(0) & 0xF) | ((q(2) & 0xF) << 4);
            y[64 * h + i + 32] = (q(1) & 0xF) | ((q(3) & 0xF) << 4);
            y[128 + 32 * h + i] =
                (q(0) >> 4) | ((q(1) >> 4) << 2) | ((q(2) >> 4) << 4) | ((q(3) >> 4) << 6);
        }
    }
}

pub(super) fn dequant_q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    for h in 0..2 {
        let ql = &b[64 * h..64 * h + 64];
        let qh = &b[128 + 32 * h..160 + 32 * h];
        let sc = &b[192 + 8 * h..200 + 8 * h];
        let out = &mut y[128 * h..128 * h + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let s = |k: usize| d * (sc[is + 2 * k] as i8) as f32;
            out[l] = s(0) * q1 as f32;
            out[l + 32] = s(1) * q2 as f32;
            out[l + 64] = s(2) * q3 as f32;
            out[l + 96] = s(3) * q4 as f32;
        }
    }
}

/// A Q8_K block decoded into its fields (the K-quant dot products'
/// activation format; `d` is f32, not rounded).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Q8KBlock {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; 16],
}

impl Q8KBlock {
    /// llama.cpp's `quantize_row_q8_K_ref` for one block: `d = max / -127`
    /// of the largest-magnitude element (so that element maps to −127
    /// exactly), quants rounded to nearest even, capped at 127.
    pub fn quantize(x: &[f32]) -> Q8KBlock {
        let mut b = Q8KBlock {
            d: 0.0,
            qs: [0; QK_K],
            bsums: [0; 16],
        };
        // The first element of the largest magnitude (as the reference's
        // strict `>` scan finds it), in two passes that vectorise.
        let amax = x[..QK_K].iter().fold(0f32, |a, v| a.max(v.abs()));
        if amax == 0.0 || amax.is_nan() {
            return b;
        }
        let max = x[..QK_K]
            .iter()
            .copied()
            .find(|v| v.abs() == amax)
            .unwrap_or(0.0);
        let iscale = -127.0 / max;
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for (s, c) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
            // 16 quants fit an i16: wrapping adds, which vectorise.
            *s = c.iter().fold(0i16, |s, &q| s.wrapping_add(q as i16));
        }
        b.d = 1.0 / iscale;
        b
    }
}

pub(super) fn quant_q8_k(x: &[f32], y: &mut [u8]) {
    let b = Q8KBlock::quantize(x);
    y[0..4].copy_from_slice(&b.d.to_le_bytes());
    for (o, q) in y[4..260].iter_mut().zip(b.qs) {
        *o = q as u8;
    }
    for (o, s) in y[260..292].chunks_exact_mut(2).zip(b.bsums) {
        o.copy_from_slice(&s.to_le_bytes());
    }
}

pub(super) fn dequant_q8_k(b: &[u8], y: &mut [f32]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (v, &q) in y.iter_mut().zip(&b[4..260]) {
        *v = (q as i8) as f32 * d;
    }
}
