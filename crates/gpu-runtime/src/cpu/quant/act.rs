//! Activations quantized per block, as llama.cpp quantizes them for its
//! integer dot products: Q8_0 (with Q8_1's block sum) for the 32-element
//! formats, Q8_K for the K-quants. The values are those of llama.cpp's
//! `quantize_row_q8_0_ref` / `q8_1_ref` / `q8_K_ref` (checked against
//! `metrale_core::quant::quantize_row` in the tests), stored as separate
//! arrays rather than blocks so that the SIMD kernels load four blocks'
//! scales with one instruction.
//!
//! These are the reference quantizers' values. llama.cpp's own x86
//! `quantize_row_q8_0` rounds halves to even and scales by `127 / amax`
//! instead, so on rare ties its activations (and dot products) differ from
//! these by one quant; ours are the same on every CPU and every path.

use half::f16;
use metrale_core::quant::Q8KBlock;

use super::super::team::Team;

/// Quantized activation rows; reused across calls (grows, never shrinks).
#[derive(Default, Debug)]
pub struct QuantScratch {
    /// Q8_0 quants (`m * k`) and, per 32-block, the scale (f16-rounded,
    /// as the block stores it), the exact sum of its quants, and Q8_1's
    /// `s` (`d·Σq` rounded to f16, `d` unrounded).
    pub(super) q8: Vec<i8>,
    pub(super) q8_d: Vec<f32>,
    pub(super) q8_sum: Vec<i32>,
    pub(super) q8_s: Vec<f32>,
    /// Q8_K quants (`m * k`), per 256-block the f32 scale, per 16 the sums.
    pub(super) qk: Vec<i8>,
    pub(super) qk_d: Vec<f32>,
    pub(super) qk_bsums: Vec<i16>,
}

/// One activation row's blocks, as the dot products read them.
#[derive(Clone, Copy)]
pub(crate) struct ActRow<'a> {
    pub(crate) qs: &'a [i8],
    /// Per block of 32 (Q8_0) or 256 (Q8_K).
    pub(crate) d: &'a [f32],
    /// Q8_0: per block, the sum of its quants.
    pub(crate) sum: &'a [i32],
    /// Q8_0: per block, Q8_1's `s`.
    pub(crate) s: &'a [f32],
    /// Q8_K: per 16 quants, their sum.
    pub(crate) bsums: &'a [i16],
}

fn grow<T: Default + Clone>(v: &mut Vec<T>, len: usize) {
    if v.len() < len {
        v.resize(len, T::default());
    }
}

/// A scratch array that tasks write disjoint ranges of.
#[derive(Clone, Copy)]
struct Ptr<T>(*mut T);
// SAFETY: tasks write disjoint ranges (see `by_rows`' callers).
unsafe impl<T: Send> Send for Ptr<T> {}
unsafe impl<T: Send> Sync for Ptr<T> {}

impl<T> Ptr<T> {
    /// # Safety
    /// `lo..hi` must be inside the array, and no other live reference may
    /// touch it.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, lo: usize, hi: usize) -> &mut [T] {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(lo), hi - lo) }
    }
}

/// Elements below which quantizing stays on the calling thread.
const SERIAL_ELEMENTS: usize = 1 << 15;

/// `f(i0, i1)` over contiguous ranges of the `m` rows (of `k` elements),
/// on `team` when there is enough work.
fn by_rows(team: Option<&Team>, m: usize, k: usize, f: &(dyn Fn(usize, usize) + Sync)) {
    match team {
        Some(team) if m > 1 && m * k >= SERIAL_ELEMENTS => {
            let tasks = m.min(team.threads() * 4);
            let per = m.div_ceil(tasks);
            team.run(m.div_ceil(per), &|t| f(t * per, ((t + 1) * per).min(m)));
        }
        _ => f(0, m),
    }
}

impl QuantScratch {
    pub fn new() -> Self {
        Self::default()
    }

    /// Quantizes `m` rows of `k` (a multiple of 32) to Q8_0/Q8_1, rows
    /// spread over `team` (each row's values do not depend on it).
    pub(super) fn quantize_q8_0(&mut self, team: Option<&Team>, x: &[f32], m: usize, k: usize) {
        let nb = k / 32;
        grow(&mut self.q8, m * k);
        grow(&mut self.q8_d, m * nb);
        grow(&mut self.q8_sum, m * nb);
        grow(&mut self.q8_s, m * nb);
        let (qs, ds, sums, ss) = (
            Ptr(self.q8.as_mut_ptr()),
            Ptr(self.q8_d.as_mut_ptr()),
            Ptr(self.q8_sum.as_mut_ptr()),
            Ptr(self.q8_s.as_mut_ptr()),
        );
        #[cfg(target_arch = "x86_64")]
        let avx512 = std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw");
        by_rows(team, m, k, &|i0, i1| {
            // SAFETY: rows `i0..i1` of every array are in bounds (grown
            // above) and handed to this task alone; the `&mut self` borrow
            // keeps them unaliased until `by_rows` returns.
            let (q8, q8_d, q8_sum, q8_s) = unsafe {
                (
                    qs.slice(i0 * k, i1 * k),
                    ds.slice(i0 * nb, i1 * nb),
                    sums.slice(i0 * nb, i1 * nb),
                    ss.slice(i0 * nb, i1 * nb),
                )
            };
            let blocks = x[i0 * k..i1 * k]
                .chunks_exact(32)
                .zip(q8.chunks_exact_mut(32));
            for (b, (xb, qb)) in blocks.enumerate() {
                #[cfg(target_arch = "x86_64")]
                let (d, sum) = if avx512 {
                    // SAFETY: AVX-512F/BW detected above; 32 values, 32 quants.
                    unsafe { q8_0_avx512(xb, qb) }
                } else {
                    q8_0_block(xb, qb)
                };
                #[cfg(not(target_arch = "x86_64"))]
                let (d, sum) = q8_0_block(xb, qb);
                q8_d[b] = f16::from_f32(d).to_f32();
                q8_sum[b] = sum;
                q8_s[b] = f16::from_f32(sum as f32 * d).to_f32();
            }
        });
    }

    /// Quantizes `m` rows of `k` (a multiple of 256) to Q8_K, rows spread
    /// over `team`.
    pub(super) fn quantize_q8_k(&mut self, team: Option<&Team>, x: &[f32], m: usize, k: usize) {
        let nb = k / 256;
        grow(&mut self.qk, m * k);
        grow(&mut self.qk_d, m * nb);
        grow(&mut self.qk_bsums, m * k / 16);
        let (qs, ds, bsums) = (
            Ptr(self.qk.as_mut_ptr()),
            Ptr(self.qk_d.as_mut_ptr()),
            Ptr(self.qk_bsums.as_mut_ptr()),
        );
        #[cfg(target_arch = "x86_64")]
        let avx512 = std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw");
        by_rows(team, m, k, &|i0, i1| {
            // SAFETY: as in `quantize_q8_0`: disjoint rows, in bounds.
            let (qk, qk_d, qk_bsums) = unsafe {
                (
                    qs.slice(i0 * k, i1 * k),
                    ds.slice(i0 * nb, i1 * nb),
                    bsums.slice(i0 * k / 16, i1 * k / 16),
                )
            };
            for (b, xb) in x[i0 * k..i1 * k].chunks_exact(256).enumerate() {
                let qs = &mut qk[256 * b..256 * b + 256];
                let bs = &mut qk_bsums[16 * b..16 * b + 16];
                #[cfg(target_arch = "x86_64")]
                if avx512 {
                    // SAFETY: AVX-512F/BW detected above; a block of 256
                    // values, 256 quants and 16 sums.
                    qk_d[b] = unsafe { q8_k_avx512(xb, qs, bs) };
                    continue;
                }
                let blk = Q8KBlock::quantize(xb);
                qs.copy_from_slice(&blk.qs);
                qk_d[b] = blk.d;
                bs.copy_from_slice(&blk.bsums);
            }
        });
    }

    /// Row `i` of the last [`quantize_q8_0`](Self::quantize_q8_0).
    pub(super) fn q8_0_row(&self, i: usize, k: usize) -> ActRow<'_> {
        let nb = k / 32;
        ActRow {
            qs: &self.q8[i * k..(i + 1) * k],
            d: &self.q8_d[i * nb..(i + 1) * nb],
            sum: &self.q8_sum[i * nb..(i + 1) * nb],
            s: &self.q8_s[i * nb..(i + 1) * nb],
            bsums: &[],
        }
    }

    /// Row `i` of the last [`quantize_q8_k`](Self::quantize_q8_k).
    pub(super) fn q8_k_row(&self, i: usize, k: usize) -> ActRow<'_> {
        let nb = k / 256;
        ActRow {
            qs: &self.qk[i * k..(i + 1) * k],
            d: &self.qk_d[i * nb..(i + 1) * nb],
            sum: &[],
            s: &[],
            bsums: &self.qk_bsums[i * k / 16..(i + 1) * k / 16],
        }
    }
}

/// One Q8_0 block: `qs[i] = round(x[i] / d)` (halves away from zero) with
/// `d = max |x| / 127` (NaNs skipped, `1/d` taken as 0 where `d` is 0, a
/// NaN's quant 0), as llama.cpp's reference `quantize_row_q8_0`; returns
/// `d` and the quants' sum.
pub(super) fn q8_0_block(x: &[f32], qs: &mut [i8]) -> (f32, i32) {
    let amax = x[..32].iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    for (q, &v) in qs[..32].iter_mut().zip(x) {
        *q = (v * id).round() as i8;
    }
    // Wrapping (32 quants cannot overflow an i32): a checked add would
    // keep the loop scalar in the dev profile.
    let sum = qs[..32].iter().fold(0i32, |s, &q| s.wrapping_add(q as i32));
    (d, sum)
}

/// [`q8_0_block`] on AVX-512, the same bits: the scalar loop's `round`
/// was a libm call per value (3% of a Llama Q8_0 decode's samples with
/// the loop around it). `round` is emulated exactly: the integer part,
/// plus one away from zero where what is left is a half or more.
///
/// # Safety
/// The CPU must have AVX-512F and BW; `x` and `qs` hold 32 elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn q8_0_avx512(x: &[f32], qs: &mut [i8]) -> (f32, i32) {
    use std::arch::x86_64::*;
    assert!(x.len() >= 32 && qs.len() >= 32);
    // SAFETY: two vectors of 16 floats inside `x` (asserted).
    let v = unsafe {
        [
            _mm512_loadu_ps(x.as_ptr()),
            _mm512_loadu_ps(x.as_ptr().add(16)),
        ]
    };
    // `_mm512_max_ps(a, b)` gives `b` where `a` is NaN: NaNs skipped, as
    // `f32::max` skips them; the maximum does not depend on the order.
    let m = _mm512_max_ps(
        _mm512_abs_ps(v[1]),
        _mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_setzero_ps()),
    );
    let amax = _mm512_reduce_max_ps(m);
    let d = amax / 127.0;
    let id = _mm512_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
    let mut sum = _mm512_setzero_si512();
    for (i, &vi) in v.iter().enumerate() {
        let y = _mm512_mul_ps(vi, id);
        let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
        // `y - t` is exact; a half or more rounds away from zero.
        let up = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(
            _mm512_abs_ps(_mm512_sub_ps(y, t)),
            _mm512_set1_ps(0.5),
        );
        // 1 with `y`'s sign (integer ops: AVX-512F has no `vorps`).
        let sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(i32::MIN));
        let away = _mm512_castsi512_ps(_mm512_or_si512(
            _mm512_castps_si512(_mm512_set1_ps(1.0)),
            sign,
        ));
        let r = _mm512_mask_add_ps(t, up, t, away);
        // `as i8`: NaN to 0, the rest saturated (|y| <= 127 but for NaN).
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(y, y);
        let q = _mm512_maskz_cvttps_epi32(!nan, r);
        sum = _mm512_add_epi32(sum, q);
        // SAFETY: 16 bytes at `16 i < 32` inside `qs`.
        unsafe { _mm_storeu_si128(qs.as_mut_ptr().add(16 * i).cast(), _mm512_cvtsepi32_epi8(q)) };
    }
    (d, _mm512_reduce_add_epi32(sum))
}

/// `Q8KBlock::quantize` of one block on AVX-512, the same bits: the scale
/// from the first value of the largest magnitude (NaNs skipped, as
/// `f32::max` skips them), each quant `nearest_int(iscale · v)` capped at
/// 127 by the same float and integer steps, lane by lane; writes the 256
/// quants and 16 sums and returns `d`. (The reference is scalar code in
/// `metrale-core`, built for the baseline x86-64: 5% of a Q4_K_M prefill.)
///
/// # Safety
/// The CPU must have AVX-512F and BW; `x` and `qs` hold 256 elements,
/// `bsums` 16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn q8_k_avx512(x: &[f32], qs: &mut [i8], bsums: &mut [i16]) -> f32 {
    use std::arch::x86_64::*;
    assert!(x.len() >= 256 && qs.len() >= 256 && bsums.len() >= 16);
    // Plain index loops: `array::map` and `from_fn` with intrinsics inside
    // their closures stayed calls (outside this function's features), a
    // fifth of the quantizing's time.
    let (mut v, mut abs) = ([_mm512_setzero_ps(); 16], [_mm512_setzero_ps(); 16]);
    for i in 0..16 {
        // SAFETY: 16 vectors of 16 floats inside `x` (asserted).
        v[i] = unsafe { _mm512_loadu_ps(x.as_ptr().add(16 * i)) };
        abs[i] = _mm512_abs_ps(v[i]);
    }
    // `_mm512_max_ps(a, b)` gives `b` where `a` is NaN: NaNs skipped.
    let amax = _mm512_reduce_max_ps(
        abs.iter()
            .fold(_mm512_setzero_ps(), |m, &a| _mm512_max_ps(a, m)),
    );
    if amax == 0.0 || amax.is_nan() {
        qs[..256].fill(0);
        bsums[..16].fill(0);
        return 0.0;
    }
    let at = abs.iter().enumerate().find_map(|(i, &a)| {
        let hit = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(a, _mm512_set1_ps(amax));
        (hit != 0).then(|| 16 * i + hit.trailing_zeros() as usize)
    });
    let iscale = -127.0 / at.map_or(0.0, |i| x[i]);
    let (scale, magic) = (_mm512_set1_ps(iscale), _mm512_set1_ps(12_582_912.0));
    for (i, &vi) in v.iter().enumerate() {
        // kquants::nearest_int, then `.min(127)`.
        let f = _mm512_add_ps(_mm512_mul_ps(scale, vi), magic);
        let bits = _mm512_and_si512(_mm512_castps_si512(f), _mm512_set1_epi32(0x007f_ffff));
        let q = _mm512_min_epi32(
            _mm512_sub_epi32(bits, _mm512_set1_epi32(0x0040_0000)),
            _mm512_set1_epi32(127),
        );
        // Every quant lies in -127..=127 (|iscale · v| <= 127; a NaN's
        // quant is its payload's low bits, capped), so the i32 sum is the
        // reference's i16 one and the narrowing keeps each value.
        bsums[i] = _mm512_reduce_add_epi32(q) as i16;
        // SAFETY: 16 bytes at `16 i < 256` inside `qs`.
        unsafe { _mm_storeu_si128(qs.as_mut_ptr().add(16 * i).cast(), _mm512_cvtepi32_epi8(q)) };
    }
    1.0 / iscale
}
