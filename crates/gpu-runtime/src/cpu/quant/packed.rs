//! Prefill's Q4_K, Q6_K and Q8_0 products on AVX-512 VNNI: weight rows
//! packed eight at a time (llama.cpp's "repack" idea, done per call and
//! per tile of activation rows), so that one `vpdpbusd` multiplies four
//! quants of eight weight rows by the same four activation quants
//! (broadcast), and one `vpmulld` applies eight rows' sub-block scales at
//! once. Per 32 elements of 8 weight rows and 4 activation rows that is 8
//! weight loads, 32 broadcasts and 32 `vpdpbusd` for 1024 products, where
//! the row-at-a-time kernels (`x86.rs`) spend an unpack, a `vpmulld` and an
//! add per 256. Q8_0's signed quants are stored plus 128 (`vpdpbusd` wants
//! an unsigned operand), 128 times the activation block's sum taken off.
//!
//! The results are bit for bit those of `scalar.rs`: the integer sums are
//! exact whatever their order, and each weight row's f32 terms are made
//! and summed in `scalar.rs`'s order, one weight row per vector lane (no
//! fused multiply-add).
//!
//! Decode (one activation row) reads the weights as they are held, row by
//! row or, grouped at load (`matrix.rs`), four rows as one stream
//! (`zmm.rs`): packing per call would touch the weights twice.

use std::arch::x86_64::*;

use half::f16;

use super::act::ActRow;
use super::scalar;

// The loads of the kernels below, as plain byte-array copies: the
// `_mm256_loadu_si256` and `read_unaligned` of `core` go through
// `copy_nonoverlapping`, whose precondition checks (on with debug
// assertions, as in the workspace's dev profile) cost these loops 3-4x.

/// 32 bytes at `p` as a vector.
///
/// # Safety
/// `p` must be valid for reading 32 bytes.
#[inline(always)]
pub(super) unsafe fn ld32(p: *const __m256i) -> __m256i {
    // SAFETY: the caller's contract; `[u8; 32]` has no alignment, and every
    // bit pattern is a valid `__m256i`.
    unsafe { std::mem::transmute::<[u8; 32], __m256i>(*(p as *const [u8; 32])) }
}

/// The 4 bytes at `p` as an i32 (little-endian, as x86 loads them).
///
/// # Safety
/// `p` must be valid for reading 4 bytes.
#[inline(always)]
unsafe fn ld4(p: *const i32) -> i32 {
    // SAFETY: the caller's contract; `[u8; 4]` has no alignment.
    i32::from_le_bytes(unsafe { *(p as *const [u8; 4]) })
}

/// Weight rows per panel: the eight i32 lanes of a 256-bit vector.
pub(super) const NR: usize = 8;

/// Bytes of one packed block of `NR` rows of `ty` (a packed format).
pub(super) fn block_bytes(ty: metrale_core::GgmlType) -> usize {
    match ty {
        metrale_core::GgmlType::Q4K => PACKED_BLOCK,
        metrale_core::GgmlType::Q6K => PACKED_Q6_K,
        _ => PACKED_Q8_0,
    }
}

/// Bytes of one packed super-block of `NR` rows: the quants as
/// `[sub-block j][group g of 4][row w][4]` (2048), the scales as
/// `[j][w]` i32 (256), the mins as `[pair p][w]` i16 pairs `(min_2p,
/// min_2p+1)` (128), then `d` and `dmin` per row as f32 (64).
pub(super) const PACKED_BLOCK: usize = 2048 + 256 + 128 + 64;
const SCALES: usize = 2048;
const MINS: usize = SCALES + 256;
const DW: usize = MINS + 128;
const DMIN: usize = DW + 32;

/// Packs `NR` Q4_K rows of `nb` super-blocks each into `out` (`nb *
/// PACKED_BLOCK` bytes).
pub(super) fn pack_q4_k(rows: &[&[u8]; NR], nb: usize, out: &mut [u8]) {
    assert_eq!(out.len(), nb * PACKED_BLOCK, "a panel's bytes");
    for (b, pb) in out.chunks_exact_mut(PACKED_BLOCK).enumerate() {
        for (w, row) in rows.iter().enumerate() {
            let blk = &row[144 * b..144 * (b + 1)];
            let qs = &blk[16..144];
            for j in 0..8 {
                let (c, shift) = (j / 2, 4 * (j % 2));
                for g in 0..8 {
                    for t in 0..4 {
                        pb[((j * 8 + g) * NR + w) * 4 + t] =
                            (qs[32 * c + 4 * g + t] >> shift) & 0xF;
                    }
                }
            }
            let (sc, mn) = scalar::scales_mins_k4(blk);
            for (j, &scale) in sc.iter().enumerate() {
                let o = SCALES + (j * NR + w) * 4;
                pb[o..o + 4].copy_from_slice(&(scale as i32).to_le_bytes());
            }
            for p in 0..4 {
                let o = MINS + (p * NR + w) * 4;
                pb[o..o + 2].copy_from_slice(&(mn[2 * p] as i16).to_le_bytes());
                pb[o + 2..o + 4].copy_from_slice(&(mn[2 * p + 1] as i16).to_le_bytes());
            }
            let f = |o: usize| f16::from_bits(u16::from_le_bytes([blk[o], blk[o + 1]])).to_f32();
            pb[DW + 4 * w..DW + 4 * w + 4].copy_from_slice(&f(0).to_le_bytes());
            pb[DMIN + 4 * w..DMIN + 4 * w + 4].copy_from_slice(&f(2).to_le_bytes());
        }
    }
}

/// The scaled integer sums of one packed super-block for `R` activation
/// rows: over its `J` sub-blocks of `G` groups of four quants (Q4_K: 8 of
/// 8, Q6_K: 16 of 4), `Σ_j sc_j · Σ q·a` per weight row (lane), where the
/// block's packed quants start at `p`, its sub-block scales at `p +
/// scales`, and row `r`'s activation quants of the block at `qa[r] + at`.
/// Exact (integer); shared by the Q4_K and Q6_K panel kernels.
///
/// # Safety
/// As the panel kernels: the block and every row's quants are in bounds,
/// and the CPU has AVX2 and AVX-512 VNNI/VL.
#[inline(always)]
unsafe fn scaled_sums<const R: usize, const J: usize, const G: usize>(
    p: *const u8,
    scales: usize,
    qa: &[*const i8; R],
    at: usize,
) -> [__m256i; R] {
    // SAFETY: inlined into the panel kernels, which enable the features
    // these intrinsics need; every load is in bounds by the caller's
    // contract.
    unsafe {
        let mut isum = [_mm256_setzero_si256(); R];
        for j in 0..J {
            // Two accumulators per row (even and odd groups): twice the
            // independent `vpdpbusd` chains. (Arrays indexed by `r` alone,
            // in loops the compiler unrolls: they stay in registers at
            // opt-level 2 too.)
            let (mut acc0, mut acc1) = ([_mm256_setzero_si256(); R], [_mm256_setzero_si256(); R]);
            let wj = p.wrapping_add(j * G * 32);
            let aj: [*const i32; R] =
                std::array::from_fn(|r| qa[r].wrapping_add(at + 4 * G * j) as *const i32);
            for g in (0..G).step_by(2) {
                let w0 = ld32(wj.wrapping_add(g * 32) as *const __m256i);
                let w1 = ld32(wj.wrapping_add(g * 32 + 32) as *const __m256i);
                for r in 0..R {
                    let q0 = ld4(aj[r].wrapping_add(g));
                    let q1 = ld4(aj[r].wrapping_add(g + 1));
                    acc0[r] = _mm256_dpbusd_epi32(acc0[r], w0, _mm256_set1_epi32(q0));
                    acc1[r] = _mm256_dpbusd_epi32(acc1[r], w1, _mm256_set1_epi32(q1));
                }
            }
            let sc = ld32(p.wrapping_add(scales + 32 * j) as *const __m256i);
            for r in 0..R {
                let sum = _mm256_add_epi32(acc0[r], acc1[r]);
                isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(sum, sc));
            }
        }
        isum
    }
}

/// `out[r][w] = dot(weight row w, a[r])` for a panel packed by
/// [`pack_q4_k`] (`nb` super-blocks) and `R` Q8_K activation rows.
///
/// # Safety
/// `panel` must hold `nb * PACKED_BLOCK` bytes, every `a[r]` must be a Q8_K
/// row of `nb` blocks, and the CPU must have AVX2, AVX-512F/VL and
/// AVX-512 VNNI.
#[target_feature(enable = "avx2,f16c,avx512f,avx512vl,avx512vnni")]
pub(super) unsafe fn dot_q4_k_panel<const R: usize>(
    panel: &[u8],
    nb: usize,
    a: &[ActRow<'_>; R],
) -> [[f32; NR]; R] {
    let qa: [*const i8; R] = std::array::from_fn(|r| a[r].qs.as_ptr());
    let bsums: [*const i16; R] = std::array::from_fn(|r| a[r].bsums.as_ptr());
    let da: [*const f32; R] = std::array::from_fn(|r| a[r].d.as_ptr());
    let mut total = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        // SAFETY: block b < nb is inside `panel`, and every row's quants,
        // sums and scales for block b are in bounds (the caller's
        // contract); every read below is within them.
        unsafe {
            let p = panel.as_ptr().wrapping_add(b * PACKED_BLOCK);
            let isum = scaled_sums::<R, 8, 8>(p, SCALES, &qa, 256 * b);
            let mins: [__m256i; 4] =
                std::array::from_fn(|q| ld32(p.wrapping_add(MINS + 32 * q) as *const __m256i));
            let dw = _mm256_castsi256_ps(ld32(p.wrapping_add(DW) as *const __m256i));
            let dmin = _mm256_castsi256_ps(ld32(p.wrapping_add(DMIN) as *const __m256i));
            for r in 0..R {
                // The activation's 8 sub-block sums as i16, (j, j + 1) pairs
                // in 4 i32 lanes.
                let bs = bsums[r].wrapping_add(16 * b);
                let s = _mm_hadd_epi16(
                    super::x86::ld16(bs as *const __m128i),
                    super::x86::ld16(bs.wrapping_add(8) as *const __m128i),
                );
                let mut imin = _mm256_madd_epi16(mins[0], _mm256_broadcastd_epi32(s));
                imin = _mm256_add_epi32(
                    imin,
                    _mm256_madd_epi16(mins[1], _mm256_broadcastd_epi32(_mm_shuffle_epi32(s, 0x55))),
                );
                imin = _mm256_add_epi32(
                    imin,
                    _mm256_madd_epi16(mins[2], _mm256_broadcastd_epi32(_mm_shuffle_epi32(s, 0xAA))),
                );
                imin = _mm256_add_epi32(
                    imin,
                    _mm256_madd_epi16(mins[3], _mm256_broadcastd_epi32(_mm_shuffle_epi32(s, 0xFF))),
                );
                // scalar::term_k lane by lane: (da·dw)·isum − (da·dmin)·imin.
                let d = _mm256_set1_ps(*da[r].wrapping_add(b));
                let t = _mm256_sub_ps(
                    _mm256_mul_ps(_mm256_mul_ps(d, dw), _mm256_cvtepi32_ps(isum[r])),
                    _mm256_mul_ps(_mm256_mul_ps(d, dmin), _mm256_cvtepi32_ps(imin)),
                );
                total[r] = _mm256_add_ps(total[r], t);
            }
        }
    }
    let mut out = [[0f32; NR]; R];
    for r in 0..R {
        // SAFETY: `out[r]` holds NR = 8 f32.
        unsafe { _mm256_storeu_ps(out[r].as_mut_ptr(), total[r]) };
    }
    out
}

/// Bytes of one packed Q8_0 block of `NR` rows: the quants plus 128 (as
/// u8, for `vpdpbusd`'s unsigned operand) as `[group g of 4][row w][4]`
/// (256), then `d` per row as f32 (32).
pub(super) const PACKED_Q8_0: usize = 256 + 32;

/// Packs `NR` Q8_0 rows of `nb` blocks each into `out` (`nb *
/// PACKED_Q8_0` bytes).
pub(super) fn pack_q8_0(rows: &[&[u8]; NR], nb: usize, out: &mut [u8]) {
    assert_eq!(out.len(), nb * PACKED_Q8_0, "a panel's bytes");
    for (b, pb) in out.chunks_exact_mut(PACKED_Q8_0).enumerate() {
        for (w, row) in rows.iter().enumerate() {
            let blk = &row[34 * b..34 * (b + 1)];
            for g in 0..8 {
                for t in 0..4 {
                    pb[(g * NR + w) * 4 + t] = blk[2 + 4 * g + t] ^ 0x80;
                }
            }
            let d = f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f32();
            pb[256 + 4 * w..256 + 4 * w + 4].copy_from_slice(&d.to_le_bytes());
        }
    }
}

/// `out[r][w] = dot(weight row w, a[r])` for a panel packed by
/// [`pack_q8_0`] (`nb` blocks) and `R` Q8_0 activation rows, with
/// `scalar.rs`'s order of f32 operations: block b's `sumi · (d_w · d_a)`
/// into accumulator `b % 4`, then `(acc0 + acc1) + (acc2 + acc3)`.
///
/// # Safety
/// `panel` must hold `nb * PACKED_Q8_0` bytes, every `a[r]` must be a Q8_0
/// row of `nb` blocks (quants, scales and sums), and the CPU must have
/// AVX2, AVX-512F/VL and AVX-512 VNNI.
#[target_feature(enable = "avx2,f16c,avx512f,avx512vl,avx512vnni")]
pub(super) unsafe fn dot_q8_0_panel<const R: usize>(
    panel: &[u8],
    nb: usize,
    a: &[ActRow<'_>; R],
) -> [[f32; NR]; R] {
    let qa: [*const i8; R] = std::array::from_fn(|r| a[r].qs.as_ptr());
    let sums: [*const i32; R] = std::array::from_fn(|r| a[r].sum.as_ptr());
    let da: [*const f32; R] = std::array::from_fn(|r| a[r].d.as_ptr());
    let mut acc4 = [[_mm256_setzero_ps(); 4]; R];
    for b in 0..nb {
        // SAFETY: block b < nb is inside `panel`, and every row's quants,
        // scale and sum for block b are in bounds (the caller's contract).
        unsafe {
            let p = panel.as_ptr().wrapping_add(b * PACKED_Q8_0);
            // Two accumulators per row (even and odd groups): twice the
            // independent `vpdpbusd` chains.
            let (mut acc0, mut acc1) = ([_mm256_setzero_si256(); R], [_mm256_setzero_si256(); R]);
            let ab: [*const i32; R] =
                std::array::from_fn(|r| qa[r].wrapping_add(32 * b) as *const i32);
            for g in (0..8).step_by(2) {
                let w0 = ld32(p.wrapping_add(g * 32) as *const __m256i);
                let w1 = ld32(p.wrapping_add(g * 32 + 32) as *const __m256i);
                for r in 0..R {
                    let q0 = ld4(ab[r].wrapping_add(g));
                    let q1 = ld4(ab[r].wrapping_add(g + 1));
                    acc0[r] = _mm256_dpbusd_epi32(acc0[r], w0, _mm256_set1_epi32(q0));
                    acc1[r] = _mm256_dpbusd_epi32(acc1[r], w1, _mm256_set1_epi32(q1));
                }
            }
            let dw = _mm256_castsi256_ps(ld32(p.wrapping_add(256) as *const __m256i));
            for r in 0..R {
                // Σ (q + 128)·a − 128 Σ a = Σ q·a, exactly.
                let off = _mm256_set1_epi32(128 * *sums[r].wrapping_add(b));
                let sumi = _mm256_sub_epi32(_mm256_add_epi32(acc0[r], acc1[r]), off);
                let dd = _mm256_mul_ps(dw, _mm256_set1_ps(*da[r].wrapping_add(b)));
                let t = _mm256_mul_ps(_mm256_cvtepi32_ps(sumi), dd);
                acc4[r][b % 4] = _mm256_add_ps(acc4[r][b % 4], t);
            }
        }
    }
    let mut out = [[0f32; NR]; R];
    for r in 0..R {
        let [a0, a1, a2, a3] = acc4[r];
        let v = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
        // SAFETY: `out[r]` holds NR = 8 f32.
        unsafe { _mm256_storeu_ps(out[r].as_mut_ptr(), v) };
    }
    out
}

/// Bytes of one packed Q6_K super-block of `NR` rows: the 6-bit quants
/// (0..64, unsigned) as `[sub-block j of 16][group g of 4][row w][4]`
/// (2048), the 16 signed scales as `[j][w]` i32 (512), the same as i16
/// pairs `(sc_2p, sc_2p+1)` `[p][w]` (256), then `d` per row as f32 (32).
pub(super) const PACKED_Q6_K: usize = 2048 + 512 + 256 + 32;
const Q6_SCALES: usize = 2048;
const Q6_PAIRS: usize = Q6_SCALES + 512;
const Q6_D: usize = Q6_PAIRS + 256;

/// Packs `NR` Q6_K rows of `nb` super-blocks each into `out` (`nb *
/// PACKED_Q6_K` bytes).
pub(super) fn pack_q6_k(rows: &[&[u8]; NR], nb: usize, out: &mut [u8]) {
    assert_eq!(out.len(), nb * PACKED_Q6_K, "a panel's bytes");
    for (b, pb) in out.chunks_exact_mut(PACKED_Q6_K).enumerate() {
        for (w, row) in rows.iter().enumerate() {
            let blk = &row[210 * b..210 * (b + 1)];
            for e in 0..256 {
                let (h, k, l) = (e / 128, (e % 128) / 32, e % 32);
                let ql = blk[64 * h + l + 32 * (k % 2)];
                let lo = if k < 2 { ql & 0xF } else { ql >> 4 };
                let q = lo | (((blk[128 + 32 * h + l] >> (2 * k)) & 3) << 4);
                let (j, g, t) = (e / 16, (e % 16) / 4, e % 4);
                pb[((j * 4 + g) * NR + w) * 4 + t] = q;
            }
            for j in 0..16 {
                let sc = blk[192 + j] as i8;
                let o = Q6_SCALES + (j * NR + w) * 4;
                pb[o..o + 4].copy_from_slice(&(sc as i32).to_le_bytes());
                let o = Q6_PAIRS + ((j / 2) * NR + w) * 4 + 2 * (j % 2);
                pb[o..o + 2].copy_from_slice(&(sc as i16).to_le_bytes());
            }
            let d = f16::from_bits(u16::from_le_bytes([blk[208], blk[209]])).to_f32();
            pb[Q6_D + 4 * w..Q6_D + 4 * w + 4].copy_from_slice(&d.to_le_bytes());
        }
    }
}

/// `out[r][w] = dot(weight row w, a[r])` for a panel packed by
/// [`pack_q6_k`] (`nb` super-blocks) and `R` Q8_K activation rows:
/// `isum = Σ_j sc_j·Σ q·a − 32·Σ_j sc_j·bsum_j` (exact), then
/// `scalar::term_q6_k` lane by lane, summed in block order.
///
/// # Safety
/// As [`dot_q4_k_panel`], with `nb * PACKED_Q6_K` bytes in `panel`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512vl,avx512vnni")]
pub(super) unsafe fn dot_q6_k_panel<const R: usize>(
    panel: &[u8],
    nb: usize,
    a: &[ActRow<'_>; R],
) -> [[f32; NR]; R] {
    let qa: [*const i8; R] = std::array::from_fn(|r| a[r].qs.as_ptr());
    let bsums: [*const i16; R] = std::array::from_fn(|r| a[r].bsums.as_ptr());
    let da: [*const f32; R] = std::array::from_fn(|r| a[r].d.as_ptr());
    let mut total = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        // SAFETY: block b < nb is inside `panel`, and every row's quants,
        // sums and scale for block b are in bounds (the caller's contract).
        unsafe {
            let p = panel.as_ptr().wrapping_add(b * PACKED_Q6_K);
            let isum = scaled_sums::<R, 16, 4>(p, Q6_SCALES, &qa, 256 * b);
            let pairs: [__m256i; 8] =
                std::array::from_fn(|q| ld32(p.wrapping_add(Q6_PAIRS + 32 * q) as *const __m256i));
            let dw = _mm256_castsi256_ps(ld32(p.wrapping_add(Q6_D) as *const __m256i));
            for r in 0..R {
                // The activation's 16 sums as 8 (j, j + 1) pairs of i16.
                let bs = ld32(bsums[r].wrapping_add(16 * b) as *const __m256i);
                let mut off = _mm256_setzero_si256();
                for (q, &pq) in pairs.iter().enumerate() {
                    let bq = _mm256_permutevar8x32_epi32(bs, _mm256_set1_epi32(q as i32));
                    off = _mm256_add_epi32(off, _mm256_madd_epi16(pq, bq));
                }
                let isum = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(off, 5));
                // scalar::term_q6_k lane by lane: (da·dw)·isum.
                let d = _mm256_set1_ps(*da[r].wrapping_add(b));
                let t = _mm256_mul_ps(_mm256_mul_ps(d, dw), _mm256_cvtepi32_ps(isum));
                total[r] = _mm256_add_ps(total[r], t);
            }
        }
    }
    let mut out = [[0f32; NR]; R];
    for r in 0..R {
        // SAFETY: `out[r]` holds NR = 8 f32.
        unsafe { _mm256_storeu_ps(out[r].as_mut_ptr(), total[r]) };
    }
    out
}
