//! The 32-element formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1 and IQ4_NL.
//!
//! Layouts (little-endian, no padding; `d`, `m`, `s` are f16):
//!
//! | type   | bytes | layout                                              |
//! |--------|-------|-----------------------------------------------------|
//! | Q4_0   | 18    | `d`, `qs[16]`: element j in the low nibble of qs[j], j+16 in the high one; x = d·(q − 8) |
//! | Q4_1   | 20    | `d`, `m`, `qs[16]` as Q4_0; x = d·q + m             |
//! | Q5_0   | 22    | `d`, `qh: u32` (bit j: 5th bit of element j), `qs[16]`; x = d·(q − 16) |
//! | Q5_1   | 24    | `d`, `m`, `qh`, `qs[16]`; x = d·q + m               |
//! | Q8_0   | 34    | `d`, `qs[32]: i8`; x = d·q                          |
//! | Q8_1   | 36    | `d`, `s` (= d·Σq, rounded to f16), `qs[32]: i8`      |
//! | IQ4_NL | 18    | `d`, `qs[16]` as Q4_0, x = d·KVALUES_IQ4NL[q]       |
//!
//! The quantizers follow llama.cpp's `quantize_row_*_ref` operation by
//! operation (same f32 operations in the same order, the same truncating
//! casts), which is what makes their output bit-identical.

use super::{f16_at, put_f16};

/// IQ4_NL's 16 levels (a non-uniform grid fitted to weight distributions).
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The element of `x` with the largest magnitude, the first one on ties
/// (as llama.cpp's loops: `if (amax < fabsf(v))`).
fn signed_absmax(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

/// C's `(int8_t)f` for the values these quantizers produce (the float is
/// truncated toward zero; out-of-range values wrap as x86's cvttss2si and
/// a byte store would).
#[inline]
fn trunc_i8(f: f32) -> i32 {
    (f as i32) as i8 as i32
}

pub(super) fn quant_q4_0(x: &[f32], y: &mut [u8]) {
    let max = signed_absmax(x);
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(y, 0, d);
    for j in 0..16 {
        let x0 = x[j] * id;
        let x1 = x[j + 16] * id;
        let q0 = trunc_i8(x0 + 8.5).min(15) as u8;
        let q1 = trunc_i8(x1 + 8.5).min(15) as u8;
        y[2 + j] = q0 | (q1 << 4);
    }
}

pub(super) fn dequant_q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..16 {
        let q = b[2 + j];
        y[j] = ((q & 0xF) as i32 - 8) as f32 * d;
        y[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

pub(super) fn quant_q4_1(x: &[f32], y: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(y, 0, d);
    put_f16(y, 2, min);
    for j in 0..16 {
        let x0 = (x[j] - min) * id;
        let x1 = (x[j + 16] - min) * id;
        let q0 = trunc_i8(x0 + 0.5).min(15) as u8;
        let q1 = trunc_i8(x1 + 0.5).min(15) as u8;
        y[4 + j] = q0 | (q1 << 4);
    }
}

pub(super) fn dequant_q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for j in 0..16 {
        let q = b[4 + j];
        y[j] = (q & 0xF) as f32 * d + m;
        y[j + 16] = (q >> 4) as f32 * d + m;
    }
}

pub(super) fn quant_q5_0(x: &[f32], y: &mut [u8]) {
    let max = signed_absmax(x);
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(y, 0, d);
    let mut qh = 0u32;
    for j in 0..16 {
        let x0 = x[j] * id;
        let x1 = x[j + 16] * id;
        let q0 = trunc_i8(x0 + 16.5).min(31) as u8;
        let q1 = trunc_i8(x1 + 16.5).min(31) as u8;
        y[6 + j] = (q0 & 0xF) | ((q1 & 0xF) << 4);
        qh |= (((q0 & 0x10) >> 4) as u32) << j;
        qh |= (((q1 & 0x10) >> 4) as u32) << (j + 16);
    }
    y[2..6].copy_from_slice(&qh.to_le_bytes());
}

#[inline]
fn qh_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

pub(super) fn dequant_q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = qh_at(b, 2);
    for j in 0..16 {
        let q = b[6 + j];
        let h0 = ((qh >> j) << 4) as u8 & 0x10;
        let h1 = (qh >> (j + 12)) as u8 & 0x10;
        y[j] = (((q & 0xF) | h0) as i32 - 16) as f32 * d;
        y[j + 16] = (((q >> 4) | h1) as i32 - 16) as f32 * d;
    }
}

pub(super) fn quant_q5_1(x: &[f32], y: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(y, 0, d);
    put_f16(y, 2, min);
    let mut qh = 0u32;
    for j in 0..16 {
        let x0 = (x[j] - min) * id;
        let x1 = (x[j + 16] - min) * id;
        // C's `(uint8_t)(x0 + 0.5f)`: no clamp in llama.cpp (the values
        // cannot exceed 31.5 for finite input).
        let q0 = (x0 + 0.5) as i32 as u8;
        let q1 = (x1 + 0.5) as i32 as u8;
        y[8 + j] = (q0 & 0xF) | ((q1 & 0xF) << 4);
        qh |= (((q0 & 0x10) >> 4) as u32) << j;
        qh |= (((q1 & 0x10) >> 4) as u32) << (j + 16);
    }
    y[4..8].copy_from_slice(&qh.to_le_bytes());
}

pub(super) fn dequant_q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = qh_at(b, 4);
    for j in 0..16 {
        let q = b[8 + j];
        let h0 = ((qh >> j) << 4) as u8 & 0x10;
        let h1 = (qh >> (j + 12)) as u8 & 0x10;
        y[j] = ((q & 0xF) | h0) as f32 * d + m;
        y[j + 16] = ((q >> 4) | h1) as f32 * d + m;
    }
}

/// The Q8_0 scale and quants of one block: `d = amax / 127` and
/// `q = round(x / d)` (half away from zero), `d` stored as f16 but the
/// quants computed with the f32 `d`, as llama.cpp does.
#[inline]
pub(super) fn q8_block(x: &[f32], qs: &mut [u8]) -> f32 {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = (v * id).round() as i8 as u8;
    }
    d
}

pub(super) fn quant_q8_0(x: &[f32], y: &mut [u8]) {
    let d = q8_block(x, &mut y[2..34]);
    put_f16(y, 0, d);
}

pub(super) fn dequant_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (v, &q) in y.iter_mut().zip(&b[2..34]) {
        *v = (q as i8) as f32 * d;
    }
}

pub(super) fn quant_q8_1(x: &[f32], y: &mut [u8]) {
    let d = q8_block(x, &mut y[4..36]);
    let sum: i32 = y[4..36].iter().map(|&q| q as i8 as i32).sum();
    put_f16(y, 0, d);
    put_f16(y, 2, sum as f32 * d);
}

pub(super) fn dequant_q8_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (v, &q) in y.iter_mut().zip(&b[4..36]) {
        *v = (q as i8) as f32 * d;
    }
}

/// The index of the level of `val` (sorted, 16 long) nearest `x`; level i
/// wins from the midpoint of `val[i-1]` and `val[i]` on (llama.cpp's
/// branchless `best_index_int8`, exact because both sides are doubled).
#[inline]
pub(super) fn best_index_int8(val: &[i8; 16], x: f32) -> usize {
    let x2 = x + x;
    let mut idx = 0;
    let mut step = 8;
    while step > 0 {
        let j = idx + step;
        if x2 >= (val[j - 1] as i32 + val[j] as i32) as f32 {
            idx = j;
        }
        step >>= 1;
    }
    idx
}

/// llama.cpp's `quantize_row_iq4_nl_ref`: the scale that maps the
/// largest-magnitude element to level −127, levels by nearest value, then
/// the least-squares scale for those levels (weights x²). An all-zero
/// block (|x| < 1e-15) gets d = 0 and zero quants (llama.cpp leaves the
/// previous block's quants there; they decode to zero either way).
pub(super) fn quant_iq4_nl(x: &[f32], y: &mut [u8]) {
    let v = &KVALUES_IQ4NL;
    let (mut amax, mut max) = (0f32, 0f32);
    for &e in x {
        if e.abs() > amax {
            amax = e.abs();
            max = e;
        }
    }
    y.fill(0);
    if amax < 1e-15 {
        return;
    }
    let d = max / v[0] as f32;
    let id = 1.0 / d;
    let mut l = [0u8; 32];
    let (mut sumqx, mut sumq2) = (0f32, 0f32);
    for (j, &e) in x.iter().enumerate() {
        let i = best_index_int8(v, id * e);
        l[j] = i as u8;
        let q = v[i] as f32;
        let w = e * e;
        sumqx += w * q * e;
        sumq2 += w * q * q;
    }
    let d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
    put_f16(y, 0, d);
    for j in 0..16 {
        y[2 + j] = l[j] | (l[j + 16] << 4);
    }
}

pub(super) fn dequant_iq4_nl(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..16 {
        let q = b[2 + j];
        y[j] = d * KVALUES_IQ4NL[(q & 0xF) as usize] as f32;
        y[j + 16] = d * KVALUES_IQ4NL[(q >> 4) as usize] as f32;
    }
}
