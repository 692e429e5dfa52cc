//! Q2_K and Q3_K: reference quantizers and dequantizers (block layouts in
//! `kquants.rs`'s table). Models quantized to Q4_K_M and above do not use
//! them; they are here so that any K-quant GGUF file can be read.

use super::kquants::{QK_K, make_qkx2_quants, nearest_int};
use super::{f16_at, put_f16};

/// llama.cpp's `make_q3_quants` with `do_rmse`: symmetric levels
/// -nmax..nmax-1 (stored + nmax), refined one element at a time (up to
/// five passes) while the weighted (x²) fit improves.
fn make_q3_quants(nmax: i32, x: &[f32], l_out: &mut [i8]) -> f32 {
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
    let iscale = -nmax as f32 / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    let mut l = [0i32; 16];
    for (i, &v) in x.iter().enumerate() {
        l[i] = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        let w = v * v;
        sumlx += w * v * l[i] as f32;
        suml2 += w * l[i] as f32 * l[i] as f32;
    }
    for _ in 0..5 {
        let mut changed = 0;
        for (i, &v) in x.iter().enumerate() {
            let w = v * v;
            let mut slx = sumlx - w * v * l[i] as f32;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * l[i] as f32 * l[i] as f32;
                let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != l[i] {
                    slx += w * v * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        changed += 1;
                    }
                }
            }
        }
        if changed == 0 {
            break;
        }
    }
    for (o, &q) in l_out.iter_mut().zip(&l) {
        *o = (q + nmax) as i8;
    }
    if suml2 > 0.0 { sumlx / suml2 } else { 0.0 }
}

/// Packs 2-bit levels as Q2_K/Q3_K do: element 128h + 32k + l in bits
/// 2k..2k+2 of `qs[32h + l]`.
fn pack_2bit(l: &[u8; QK_K], qs: &mut [u8]) {
    for h in 0..2 {
        for i in 0..32 {
            let e = |k: usize| l[128 * h + 32 * k + i];
            qs[32 * h + i] = e(0) | (e(1) << 2) | (e(2) << 4) | (e(3) << 6);
        }
    }
}

/// llama.cpp's `quantize_row_q2_K_ref`: per 16 elements a 4-bit scale and
/// 4-bit min (`make_qkx2_quants` with absolute-error weights |x|).
pub(super) fn quant_q2_k(x: &[f32], y: &mut [u8]) {
    let mut l = [0u8; QK_K];
    let mut laux = [0u8; 16];
    let mut weights = [0f32; 16];
    let (mut scales, mut mins) = ([0f32; 16], [0f32; 16]);
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..16 {
        let xs = &x[16 * j..16 * j + 16];
        for (w, v) in weights.iter_mut().zip(xs) {
            *w = v.abs();
        }
        let (s, m) = make_qkx2_quants(
            3,
            xs,
            &weights,
            &mut l[16 * j..16 * j + 16],
            &mut laux,
            -0.5,
            0.1,
            15,
            true,
        );
        (scales[j], mins[j]) = (s, m);
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    y[..16].fill(0);
    if max_scale > 0.0 {
        let iscale = 15.0 / max_scale;
        for j in 0..16 {
            y[j] = nearest_int(iscale * scales[j]) as u8;
        }
        put_f16(y, 80, max_scale / 15.0);
    } else {
        put_f16(y, 80, 0.0);
    }
    if max_min > 0.0 {
        let iscale = 15.0 / max_min;
        for j in 0..16 {
            y[j] |= (nearest_int(iscale * mins[j]) << 4) as u8;
        }
        put_f16(y, 82, max_min / 15.0);
    } else {
        put_f16(y, 82, 0.0);
    }
    let (d_all, dmin_all) = (f16_at(y, 80), f16_at(y, 82));
    for j in 0..16 {
        let d = d_all * (y[j] & 0xF) as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dmin_all * (y[j] >> 4) as f32;
        for ii in 0..16 {
            l[16 * j + ii] = nearest_int((x[16 * j + ii] + dm) / d).clamp(0, 3) as u8;
        }
    }
    pack_2bit(&l, &mut y[16..80]);
}

/// llama.cpp's `quantize_row_q3_K_ref`: per 16 elements a 6-bit signed
/// scale (`make_q3_quants`), levels −4..3 as 2 low bits plus a high bit
/// in `hmask`.
pub(super) fn quant_q3_k(x: &[f32], y: &mut [u8]) {
    let mut l8 = [0i8; QK_K];
    let mut scales = [0f32; 16];
    let (mut max_scale, mut amax) = (0f32, 0f32);
    for j in 0..16 {
        scales[j] = make_q3_quants(4, &x[16 * j..16 * j + 16], &mut l8[16 * j..16 * j + 16]);
        if scales[j].abs() > amax {
            amax = scales[j].abs();
            max_scale = scales[j];
        }
    }
    let sc = 96;
    y[sc..sc + 12].fill(0);
    if max_scale != 0.0 {
        let iscale = -32.0 / max_scale;
        for j in 0..16 {
            // C stores nearest_int's result in an int8_t before clamping.
            let mut l = (nearest_int(iscale * scales[j]) as i8).clamp(-32, 31) + 32;
            if j < 8 {
                y[sc + j] = (l & 0xF) as u8;
            } else {
                y[sc + j - 8] |= ((l & 0xF) << 4) as u8;
            }
            l >>= 4;
            y[sc + 8 + j % 4] |= (l << (2 * (j / 4))) as u8;
        }
        put_f16(y, 108, 1.0 / iscale);
    } else {
        put_f16(y, 108, 0.0);
    }
    let d_all = f16_at(y, 108);
    for j in 0..16 {
        let low = if j < 8 {
            y[sc + j] & 0xF
        } else {
            y[sc + j - 8] >> 4
        };
        let high = (y[sc + 8 + j % 4] >> (2 * (j / 4))) & 3;
        let s = (low | (high << 4)) as i32 - 32;
        let d = d_all * s as f32;
        if d == 0.0 {
            continue;
        }
        for ii in 0..16 {
            l8[16 * j + ii] = (nearest_int(x[16 * j + ii] / d).clamp(-4, 3) + 4) as i8;
        }
    }
    let mut l = [0u8; QK_K];
    y[..32].fill(0);
    for j in 0..QK_K {
        let mut q = l8[j] as u8;
        if q > 3 {
            y[j % 32] |= 1 << (j / 32);
            q -= 4;
        }
        l[j] = q;
    }
    pack_2bit(&l, &mut y[32..96]);
}

pub(super) fn dequant_q2_k(b: &[u8], y: &mut [f32]) {
    let (d, min) = (f16_at(b, 80), f16_at(b, 82));
    let mut is = 0;
    for h in 0..2 {
        let q = &b[16 + 32 * h..48 + 32 * h];
        for j in 0..4 {
            let shift = 2 * j;
            for half in 0..2 {
                let sc = b[is];
                is += 1;
                let (dl, ml) = (d * (sc & 0xF) as f32, min * (sc >> 4) as f32);
                let out = &mut y[128 * h + 32 * j + 16 * half..][..16];
                for (l, o) in out.iter_mut().enumerate() {
                    *o = dl * ((q[l + 16 * half] >> shift) & 3) as f32 - ml;
                }
            }
        }
    }
}

pub(super) fn dequant_q3_k(b: &[u8], y: &mut [f32]) {
    let d_all = f16_at(b, 108);
    let sc = &b[96..108];
    let scale = |j: usize| -> i32 {
        let low = if j < 8 { sc[j] & 0xF } else { sc[j - 8] >> 4 };
        let high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
        (low | (high << 4)) as i32 - 32
    };
    let hm = &b[0..32];
    let mut is = 0;
    let mut m = 1u8;
    for h in 0..2 {
        let q = &b[32 + 32 * h..64 + 32 * h];
        for j in 0..4 {
            let shift = 2 * j;
            for half in 0..2 {
                let dl = d_all * scale(is) as f32;
                is += 1;
                let out = &mut y[128 * h + 32 * j + 16 * half..][..16];
                for (l, o) in out.iter_mut().enumerate() {
                    let i = l + 16 * half;
                    let lo = ((q[i] >> shift) & 3) as i32;
                    let v = lo - if hm[i] & m != 0 { 0 } else { 4 };
                    *o = dl * v as f32;
                }
            }
            m <<= 1;
        }
    }
}
