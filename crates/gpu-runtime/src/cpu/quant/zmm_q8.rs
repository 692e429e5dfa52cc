//! Q8_0 for steps of a few activation rows (batched decode): four weight
//! rows against one to four activation rows on 512-bit registers (AVX-512
//! BW and VNNI), each weight block loaded once for all of them
//! (`steps.rs` drives it).
//!
//! Why: the one-row kernel (`x86.rs`'s `dot32`) spends about ten
//! instructions on a 34-byte block per activation row (a 256-bit
//! `vpdpbusd` after `vpabsb`/`vpsignb`, a share of a `hadd` tree, an f16
//! scale widened per four blocks); here one `vpdpbusd` takes two blocks of
//! a row, the four rows' sums are folded in two `hadd` trees, and the
//! weights are unpacked once for every activation row.
//!
//! `vpdpbusd` multiplies unsigned bytes by signed ones, and both Q8_0
//! sides are signed: the weights are offset to unsigned (`w ^ 0x80` is
//! `w + 128`), and `128 · Σ a`, the activation block's exact sum
//! (`ActRow::sum`), is taken off again. The integer sums are exact, and
//! each block's f32 term and each row's four accumulators are `scalar.rs`'s
//! (`t_b = sumi · (d_w · d_a)`, `acc[b % 4] += t_b`), so every result is
//! the one-row kernel's, bit for bit.
//!
//! Tried: the same kernel over a matrix grouped at load (`matrix.rs`, one
//! stream for the four rows) and for decode's lone row. Llama-370M Q8_0,
//! three interleaved rounds: batch 1 43-47 against 45-53 tok/s (the one-row
//! kernel, row-major), and batch 64's packed panels lost 8% gathering the
//! grouped rows back, so Q8_0 matrices stay row-major.

use std::arch::x86_64::*;

use super::act::ActRow;
use super::packed::ld32;
use super::scalar;
use super::zmm::{G, sums8};

/// The four weight rows' first bytes and the bytes from one block of a row
/// to the next.
type Rows = ([*const u8; G], usize);

/// Bytes of a Q8_0 block: an f16 scale, then 32 signed quants.
const BB: usize = 34;

/// Row `r`'s blocks `b` and `b + 1` in one register, offset to unsigned
/// (`w ^ 0x80`): lanes 0..32 block `b`'s quants, 32..64 block `b + 1`'s.
///
/// # Safety
/// Row `r` of `rows` must hold blocks `b` and `b + 1`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn pair((ptrs, stride): Rows, r: usize, b: usize) -> __m512i {
    let at = |b: usize| ptrs[r].wrapping_add(b * stride + 2) as *const __m256i;
    // SAFETY: the caller's contract; the quants are 2 bytes into a block.
    let (lo, hi) = unsafe { (ld32(at(b)), ld32(at(b + 1))) };
    let w = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
    _mm512_xor_si512(w, _mm512_set1_epi8(-128))
}

/// A register's two 256-bit halves.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
fn halves(v: __m512i) -> (__m256i, __m256i) {
    (_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
}

/// The f16 scales of rows `r` and `r + 1` for blocks `b..b + 4`, widened:
/// lanes 0..4 row `r`'s, 4..8 row `r + 1`'s.
///
/// # Safety
/// Rows `r` and `r + 1` of `rows` must hold blocks `b..b + 4`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn scales2((ptrs, stride): Rows, r: usize, b: usize) -> __m256 {
    // SAFETY: the caller's contract; a block's scale is its first 2 bytes.
    unsafe {
        let lo = super::x86::f16x4(ptrs[r].wrapping_add(b * stride), stride);
        let hi = super::x86::f16x4(ptrs[r + 1].wrapping_add(b * stride), stride);
        _mm256_set_m128(hi, lo)
    }
}

/// [`G`] row-major weight rows of Q8_0 blocks with `R` Q8_0 activation
/// rows (`out[i][r]`: activation row `i`, weight row `r`), each the bits of
/// `x86::vnni::dot32::<Q8_0, 1>` for that pair of rows. Every weight block
/// is loaded once for the `R` rows.
///
/// # Safety
/// Every `w[r]` and `a[i]` must hold the same number of whole Q8_0 blocks.
/// The CPU must have AVX-512 F, BW, VL and VNNI, AVX2 and F16C.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn dot_q8_0_rows<const R: usize>(
    w: &[&[u8]; G],
    a: &[ActRow<'_>; R],
) -> [[f32; G]; R] {
    let nb = w[0].len() / BB;
    let rows: Rows = (std::array::from_fn(|r| w[r].as_ptr()), BB);
    let quads = nb / 4;
    // Per activation row, weight rows (0, 1) and (2, 3): lanes 0..4
    // the first row's `acc[b % 4]`, 4..8 the second's.
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for q in 0..quads {
        let b = 4 * q;
        // SAFETY: blocks b..b + 4 < nb of every row are inside `w[r]`, and
        // every `a[i]` holds nb blocks (the caller's contract).
        unsafe {
            for &p in &rows.0 {
                // The four rows' next blocks stream past (read once for the
                // R activation rows).
                super::x86::prefetch_ahead(p.wrapping_add(b * BB), 4 * BB);
            }
            // wq[r]: row r's blocks (b, b + 1) and (b + 2, b + 3).
            let wq: [[__m512i; 2]; G] = [
                [pair(rows, 0, b), pair(rows, 0, b + 2)],
                [pair(rows, 1, b), pair(rows, 1, b + 2)],
                [pair(rows, 2, b), pair(rows, 2, b + 2)],
                [pair(rows, 3, b), pair(rows, 3, b + 2)],
            ];
            let dw = [scales2(rows, 0, b), scales2(rows, 2, b)];
            for (ai, acc) in a.iter().zip(acc.iter_mut()) {
                let qa = ai.qs.as_ptr().wrapping_add(32 * b);
                let act01 = _mm512_loadu_si512(qa.cast());
                let act23 = _mm512_loadu_si512(qa.wrapping_add(64).cast());
                // 128 · Σ a of blocks b..b + 4, for both rows of a pair.
                let sa = _mm_loadu_si128(ai.sum.as_ptr().wrapping_add(b).cast());
                let offs = _mm256_slli_epi32::<7>(_mm256_broadcastsi128_si256(sa));
                let da4 = _mm_loadu_ps(ai.d.as_ptr().wrapping_add(b));
                let da8 = _mm256_set_m128(da4, da4);
                for h in 0..2 {
                    let (r0, r1) = (2 * h, 2 * h + 1);
                    let zero = _mm512_setzero_si512();
                    let (s0, s1) = halves(_mm512_dpbusd_epi32(zero, wq[r0][0], act01));
                    let (s2, s3) = halves(_mm512_dpbusd_epi32(zero, wq[r0][1], act23));
                    let (s4, s5) = halves(_mm512_dpbusd_epi32(zero, wq[r1][0], act01));
                    let (s6, s7) = halves(_mm512_dpbusd_epi32(zero, wq[r1][1], act23));
                    // Lane i: row r0's block b + i (i < 4), row r1's b + i - 4.
                    let sums = _mm256_sub_epi32(sums8(&[s0, s1, s2, s3, s4, s5, s6, s7]), offs);
                    // scalar::term32: sumi · (d_w · d_a), added to acc[b % 4].
                    let dd = _mm256_mul_ps(dw[h], da8);
                    acc[h] = _mm256_add_ps(acc[h], _mm256_mul_ps(_mm256_cvtepi32_ps(sums), dd));
                }
            }
        }
    }
    std::array::from_fn(|i| {
        // Row r's four accumulators in lanes 4r..4r + 4.
        let mut lanes = [0f32; 4 * G];
        for (h, v) in acc[i].iter().enumerate() {
            // SAFETY: `lanes` holds 16 floats; `8h + 8 <= 16` for h < 2.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr().wrapping_add(8 * h), *v) };
        }
        std::array::from_fn(|r| {
            let mut row: [f32; 4] = std::array::from_fn(|l| lanes[4 * r + l]);
            for b in 4 * quads..nb {
                let block = &w[r][b * BB..][..BB];
                scalar::accumulate32_block(metrale_core::GgmlType::Q8_0, block, a[i], b, &mut row);
            }
            scalar::finish4(row)
        })
    })
}
