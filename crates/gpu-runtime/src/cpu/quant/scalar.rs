//! The portable dot products, which define every path's result.
//!
//! Integer sums are exact, so the paths can only differ in how the f32
//! scales are applied and summed; that order is fixed here and the SIMD
//! paths reproduce it:
//!
//! * 32-element formats: block b contributes `t_b = (Σ w·a) as f32 ·
//!   (d_w · d_a)` (plus `m_w · s_a` for Q4_1/Q5_1, whose quants are
//!   unsigned); `acc[b % 4] += t_b`, and the row's result is
//!   `(acc[0] + acc[1]) + (acc[2] + acc[3])`. (Four lanes: the SIMD paths
//!   reduce four blocks' integer sums into one 4-lane vector.)
//! * K-quants: super-block b's integer sums `isum = Σ_j scale_j · Σ w·a`
//!   and `imin = Σ_j min_j · Σ a` (Q4_K/Q5_K) become `t_b = (d_a · d_w) ·
//!   isum − (d_a · dmin_w) · imin`, summed in order over b.
//!
//! No multiply-add is fused anywhere, so the result is the same on every
//! CPU and for every path.

use half::f16;
use metrale_core::GgmlType;
use metrale_core::quant::{KVALUES_IQ4NL, scale_min_k4};

use super::act::ActRow;

#[inline]
pub(super) fn f16_at(b: &[u8], off: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

#[inline]
fn qh_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// The 32 quants of a 32-element block as integers (offsets applied).
fn block_values(ty: GgmlType, b: &[u8]) -> [i32; 32] {
    let mut v = [0i32; 32];
    match ty {
        GgmlType::Q8_0 => {
            for (o, &q) in v.iter_mut().zip(&b[2..34]) {
                *o = q as i8 as i32;
            }
        }
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Iq4Nl => {
            let off = if ty == GgmlType::Q4_1 { 4 } else { 2 };
            for j in 0..16 {
                let q = b[off + j];
                let (lo, hi) = ((q & 0xF) as usize, (q >> 4) as usize);
                (v[j], v[j + 16]) = match ty {
                    GgmlType::Q4_0 => (lo as i32 - 8, hi as i32 - 8),
                    GgmlType::Q4_1 => (lo as i32, hi as i32),
                    _ => (KVALUES_IQ4NL[lo] as i32, KVALUES_IQ4NL[hi] as i32),
                };
            }
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let (qh_off, qs_off, bias) = if ty == GgmlType::Q5_0 {
                (2, 6, 16)
            } else {
                (4, 8, 0)
            };
            let qh = qh_at(b, qh_off);
            for j in 0..16 {
                let q = b[qs_off + j] as i32;
                let h0 = ((qh >> j) & 1) as i32;
                let h1 = ((qh >> (j + 16)) & 1) as i32;
                v[j] = ((q & 0xF) | (h0 << 4)) - bias;
                v[j + 16] = ((q >> 4) | (h1 << 4)) - bias;
            }
        }
        _ => unreachable!("{ty} is not a 32-element format"),
    }
    v
}

/// Block `b`'s term (see the module docs), given its exact integer sum.
#[inline]
pub(super) fn term32(ty: GgmlType, w: &[u8], a: ActRow<'_>, b: usize, sumi: i32) -> f32 {
    let t = sumi as f32 * (f16_at(w, 0) * a.d[b]);
    match ty {
        GgmlType::Q4_1 | GgmlType::Q5_1 => t + f16_at(w, 2) * a.s[b],
        _ => t,
    }
}

/// Adds blocks `b0..` of row `w` to `acc` (the portable path, and the
/// SIMD paths' tail).
pub(super) fn accumulate32(ty: GgmlType, w: &[u8], a: ActRow<'_>, b0: usize, acc: &mut [f32; 4]) {
    let bb = ty.block_bytes();
    for b in b0..w.len() / bb {
        accumulate32_block(ty, &w[b * bb..(b + 1) * bb], a, b, acc);
    }
}

/// Adds block `b` of a row (`wb`, its bytes) to `acc[b % 4]`.
pub(super) fn accumulate32_block(
    ty: GgmlType,
    wb: &[u8],
    a: ActRow<'_>,
    b: usize,
    acc: &mut [f32; 4],
) {
    let v = block_values(ty, wb);
    let sumi: i32 = v
        .iter()
        .zip(&a.qs[32 * b..32 * b + 32])
        .map(|(&q, &x)| q * x as i32)
        .sum();
    acc[b % 4] += term32(ty, wb, a, b, sumi);
}

#[inline]
pub(super) fn finish4(acc: [f32; 4]) -> f32 {
    (acc[0] + acc[1]) + (acc[2] + acc[3])
}

/// Super-block `b`'s term: Q4_K/Q5_K, with the block's `d` and `dmin`.
#[inline]
pub(super) fn term_k(da: f32, dw: f32, dmin: f32, isum: i32, imin: i32) -> f32 {
    (da * dw) * isum as f32 - (da * dmin) * imin as f32
}

/// The eight 6-bit scales and mins of a Q4_K/Q5_K block (`scale_min_k4`
/// for every j at once).
#[inline]
pub(super) fn scales_mins_k4(w: &[u8]) -> ([u8; 8], [u8; 8]) {
    let s: &[u8; 12] = w[4..16].try_into().expect("a whole block");
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    (sc, mn)
}

/// Q4_K/Q5_K's `Σ_j min_j · Σ a` from the activation's sums of 16.
#[inline]
pub(super) fn imin_k(mins: &[u8; 8], bsums: &[i16]) -> i32 {
    (0..8)
        .map(|j| mins[j] as i32 * (bsums[2 * j] as i32 + bsums[2 * j + 1] as i32))
        .sum()
}

fn dot_q45_k(ty: GgmlType, w: &[u8], a: ActRow<'_>) -> f32 {
    let bb = ty.block_bytes();
    let mut acc = 0f32;
    for (b, wb) in w.chunks_exact(bb).enumerate() {
        let qa = &a.qs[256 * b..256 * b + 256];
        let (scales, mins) = scales_mins_k4(wb);
        debug_assert!((0..8).all(|j| scale_min_k4(j, &wb[4..16]) == (scales[j], mins[j])));
        let mut isum = 0i32;
        for (j, &sc) in scales.iter().enumerate() {
            let (c, hi) = (j / 2, j % 2);
            let mut s = 0i32;
            for l in 0..32 {
                let mut q = if ty == GgmlType::Q4K {
                    wb[16 + 32 * c + l]
                } else {
                    wb[48 + 32 * c + l]
                };
                q = if hi == 1 { q >> 4 } else { q & 0xF };
                let mut q = q as i32;
                if ty == GgmlType::Q5K {
                    q |= (((wb[16 + l] >> j) & 1) as i32) << 4;
                }
                s += q * qa[32 * j + l] as i32;
            }
            isum += sc as i32 * s;
        }
        let imin = imin_k(&mins, &a.bsums[16 * b..16 * b + 16]);
        acc += term_k(a.d[b], f16_at(wb, 0), f16_at(wb, 2), isum, imin);
    }
    acc
}

/// Q6_K's term: `(d_a · d_w) · isum`.
#[inline]
pub(super) fn term_q6_k(da: f32, dw: f32, isum: i32) -> f32 {
    (da * dw) * isum as f32
}

fn dot_q6_k(w: &[u8], a: ActRow<'_>) -> f32 {
    let mut acc = 0f32;
    for (b, wb) in w.chunks_exact(210).enumerate() {
        let qa = &a.qs[256 * b..256 * b + 256];
        let mut isum = 0i32;
        for h in 0..2 {
            let (ql, qh) = (&wb[64 * h..64 * h + 64], &wb[128 + 32 * h..160 + 32 * h]);
            for k in 0..4 {
                for l in 0..32 {
                    let lo = if k < 2 {
                        ql[l + 32 * k] & 0xF
                    } else {
                        ql[l + 32 * (k - 2)] >> 4
                    };
                    let q = (lo | (((qh[l] >> (2 * k)) & 3) << 4)) as i32 - 32;
                    let e = 128 * h + 32 * k + l;
                    let sc = wb[192 + e / 16] as i8 as i32;
                    isum += sc * q * qa[e] as i32;
                }
            }
        }
        acc += term_q6_k(a.d[b], f16_at(wb, 208), isum);
    }
    acc
}

/// `dot(dequantized w row, dequantized activation row)` in integer
/// arithmetic, the reference for every path.
pub(super) fn vec_dot(ty: GgmlType, w: &[u8], a: ActRow<'_>) -> f32 {
    match ty {
        GgmlType::Q4K | GgmlType::Q5K => dot_q45_k(ty, w, a),
        GgmlType::Q6K => dot_q6_k(w, a),
        _ => {
            let mut acc = [0f32; 4];
            accumulate32(ty, w, a, 0, &mut acc);
            finish4(acc)
        }
    }
}
