//! Prefill's Q4_K, Q6_K and Q8_0 products on AVX-512 VNNI: weight rows
//! packed sixteen at a time (llama.cpp's "repack" idea, done per call and
//! per tile of activation rows), so that one 512-bit `vpdpbusd` multiplies
//! four quants of sixteen weight rows by the same four activation quants
//! (broadcast), and one `vpmulld` applies sixteen rows' sub-block scales at
//! once. Per 32 elements of 16 weight rows and 4 activation rows that is 8
//! weight loads, 32 broadcasts and 32 `vpdpbusd` for 2048 products, where
//! the row-at-a-time kernels (`x86.rs`) spend an unpack, a `vpmulld` and an
//! add per 256. Q8_0's signed quants are stored plus 128 (`vpdpbusd` wants
//! an unsigned operand), 128 times the activation block's sum taken off.
//!
//! Why sixteen rows on 512-bit registers: Intel's server cores (this
//! project's Emerald Rapids host) run two 512-bit `vpdpbusd` a cycle, twice
//! the work of two 256-bit ones; Zen 4 splits a 512-bit one in two, the
//! same work a cycle, with half the broadcasts and scale products per
//! product. (Eight rows on 256-bit registers, tuned on the Zen 4, left half
//! of the Intel core idle.)
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

/// 64 bytes at `p` as a vector.
///
/// # Safety
/// `p` must be valid for reading 64 bytes.
#[inline(always)]
pub(super) unsafe fn ld64(p: *const u8) -> __m512i {
    // SAFETY: the caller's contract; `[u8; 64]` has no alignment, and every
    // bit pattern is a valid `__m512i`.
    unsafe { std::mem::transmute::<[u8; 64], __m512i>(*(p as *const [u8; 64])) }
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

/// The little-endian u32 at `s[o..o + 4]` (packing's four quants at once).
fn u32_at(s: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([s[o], s[o + 1], s[o + 2], s[o + 3]])
}

/// Stores `v` little-endian at `out[o..o + 4]`.
fn put4(out: &mut [u8], o: usize, v: [u8; 4]) {
    out[o..o + 4].copy_from_slice(&v);
}

/// Weight rows per panel: the sixteen i32 lanes of a 512-bit vector.
pub(super) const NR: usize = 16;

/// Bytes of one group of four quants of the panel's `NR` rows: one vector.
const VEC: usize = 4 * NR;

/// Bytes of one packed block of `NR` rows of `ty` (a packed format).
pub(super) fn block_bytes(ty: metrale_core::GgmlType) -> usize {
    match ty {
        metrale_core::GgmlType::Q4K => PACKED_BLOCK,
        metrale_core::GgmlType::Q6K => PACKED_Q6_K,
        _ => PACKED_Q8_0,
    }
}

/// Bytes of one packed Q4_K super-block of `NR` rows: the quants as
/// `[sub-block j][group g of 4][row w][4]` (`256·NR`), the scales as
/// `[j][w]` i32, the mins as `[pair p][w]` i16 pairs `(min_2p, min_2p+1)`,
/// then `d` and `dmin` per row as f32.
pub(super) const PACKED_BLOCK: usize = DMIN + 4 * NR;
const SCALES: usize = 256 * NR;
const MINS: usize = SCALES + 8 * 4 * NR;
const DW: usize = MINS + 4 * 4 * NR;
const DMIN: usize = DW + 4 * NR;

/// Packs `NR` Q4_K rows of `nb` super-blocks each into `out` (`nb *
/// PACKED_BLOCK` bytes).
pub(super) fn pack_q4_k(rows: &[&[u8]; NR], nb: usize, out: &mut [u8]) {
    assert_eq!(out.len(), nb * PACKED_BLOCK, "a panel's bytes");
    for (b, pb) in out.chunks_exact_mut(PACKED_BLOCK).enumerate() {
        for (w, row) in rows.iter().enumerate() {
            let blk = &row[144 * b..144 * (b + 1)];
            let qs = &blk[16..144];
            for j in 0..8 {
                // Sub-block j: the low (even j) or high nibbles of 32 bytes.
                let (c, shift) = (j / 2, 4 * (j % 2));
                for g in 0..8 {
                    let q = (u32_at(qs, 32 * c + 4 * g) >> shift) & 0x0F0F_0F0F;
                    put4(pb, ((j * 8 + g) * NR + w) * 4, q.to_le_bytes());
                }
            }
            let (sc, mn) = scalar::scales_mins_k4(blk);
            for (j, &scale) in sc.iter().enumerate() {
                put4(pb, SCALES + (j * NR + w) * 4, (scale as i32).to_le_bytes());
            }
            for p in 0..4 {
                let [a0, a1] = (mn[2 * p] as i16).to_le_bytes();
                let [b0, b1] = (mn[2 * p + 1] as i16).to_le_bytes();
                put4(pb, MINS + (p * NR + w) * 4, [a0, a1, b0, b1]);
            }
            let f = |o: usize| f16::from_bits(u16::from_le_bytes([blk[o], blk[o + 1]])).to_f32();
            put4(pb, DW + 4 * w, f(0).to_le_bytes());
            put4(pb, DMIN + 4 * w, f(2).to_le_bytes());
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
/// and the CPU has AVX-512 F/BW/VNNI.
#[inline(always)]
unsafe fn scaled_sums<const R: usize, const J: usize, const G: usize>(
    p: *const u8,
    scales: usize,
    qa: &[*const i8; R],
    at: usize,
) -> [__m512i; R] {
    // SAFETY: inlined into the panel kernels, which enable the features
    // these intrinsics need; every load is in bounds by the caller's
    // contract.
    unsafe {
        let mut isum = [_mm512_setzero_si512(); R];
        for j in 0..J {
            // Two accumulators per row (even and odd groups): twice the
            // independent `vpdpbusd` chains. (Arrays indexed by `r` alone,
            // in loops the compiler unrolls: they stay in registers at
            // opt-level 2 too.)
            let (mut acc0, mut acc1) = ([_mm512_setzero_si512(); R], [_mm512_setzero_si512(); R]);
            let wj = p.wrapping_add(j * G * VEC);
            let aj: [*const i32; R] =
                std::array::from_fn(|r| qa[r].wrapping_add(at + 4 * G * j) as *const i32);
            for g in (0..G).step_by(2) {
                let w0 = ld64(wj.wrapping_add(g * VEC));
                let w1 = ld64(wj.wrapping_add((g + 1) * VEC));
                for r in 0..R {
                    let q0 = ld4(aj[r].wrapping_add(g));
                    let q1 = ld4(aj[r].wrapping_add(g + 1));
                    acc0[r] = _mm512_dpbusd_epi32(acc0[r], w0, _mm512_set1_epi32(q0));
                    acc1[r] = _mm512_dpbusd_epi32(acc1[r], w1, _mm512_set1_epi32(q1));
                }
            }
            let sc = ld64(p.wrapping_add(scales + VEC * j));
            for r in 0..R {
                let sum = _mm512_add_epi32(acc0[r], acc1[r]);
                isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(sum, sc));
            }
        }
        isum
    }
}

/// The panel's `R` rows of results, one vector of `NR` lanes each, stored.
///
/// # Safety
/// The CPU must have AVX-512 F (the callers' features).
#[inline(always)]
unsafe fn store<const R: usize>(v: [__m512; R]) -> [[f32; NR]; R] {
    let mut out = [[0f32; NR]; R];
    for r in 0..R {
        // SAFETY: `out[r]` holds NR = 16 f32.
        unsafe { _mm512_storeu_ps(out[r].as_mut_ptr(), v[r]) };
    }
    out
}

/// `out[r][w] = dot(weight row w, a[r])` for a panel packed by
/// [`pack_q4_k`] (`nb` super-blocks) and `R` Q8_K activation rows.
///
/// # Safety
/// `panel` must hold `nb * PACKED_BLOCK` bytes, every `a[r]` must be a Q8_K
/// row of `nb` blocks, and the CPU must have AVX-512 F/BW/VNNI.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn dot_q4_k_panel<const R: usize>(
    panel: &[u8],
    nb: usize,
    a: &[ActRow<'_>; R],
) -> [[f32; NR]; R] {
    let qa: [*const i8; R] = std::array::from_fn(|r| a[r].qs.as_ptr());
    let bsums: [*const i16; R] = std::array::from_fn(|r| a[r].bsums.as_ptr());
    let da: [*const f32; R] = std::array::from_fn(|r| a[r].d.as_ptr());
    let mut total = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        // SAFETY: block b < nb is inside `panel`, and every row's quants,
        // sums and scales for block b are in bounds (the caller's
        // contract); every read below is within them.
        unsafe {
            let p = panel.as_ptr().wrapping_add(b * PACKED_BLOCK);
            let isum = scaled_sums::<R, 8, 8>(p, SCALES, &qa, 256 * b);
            let mins: [__m512i; 4] = std::array::from_fn(|q| ld64(p.wrapping_add(MINS + VEC * q)));
            let dw = _mm512_castsi512_ps(ld64(p.wrapping_add(DW)));
            let dmin = _mm512_castsi512_ps(ld64(p.wrapping_add(DMIN)));
            for r in 0..R {
                // The activation's 8 sub-block sums as i16, (j, j + 1) pairs
                // in 4 i32 lanes.
                let bs = bsums[r].wrapping_add(16 * b);
                let s = _mm_hadd_epi16(
                    super::x86::ld16(bs as *const __m128i),
                    super::x86::ld16(bs.wrapping_add(8) as *const __m128i),
                );
                let pair = |q: usize| {
                    let lane = match q {
                        0 => s,
                        1 => _mm_shuffle_epi32(s, 0x55),
                        2 => _mm_shuffle_epi32(s, 0xAA),
                        _ => _mm_shuffle_epi32(s, 0xFF),
                    };
                    _mm512_madd_epi16(mins[q], _mm512_broadcastd_epi32(lane))
                };
                let imin = _mm512_add_epi32(
                    _mm512_add_epi32(pair(0), pair(1)),
                    _mm512_add_epi32(pair(2), pair(3)),
                );
                // scalar::term_k lane by lane: (da·dw)·isum − (da·dmin)·imin.
                let d = _mm512_set1_ps(*da[r].wrapping_add(b));
                let t = _mm512_sub_ps(
                    _mm512_mul_ps(_mm512_mul_ps(d, dw), _mm512_cvtepi32_ps(isum[r])),
                    _mm512_mul_ps(_mm512_mul_ps(d, dmin), _mm512_cvtepi32_ps(imin)),
                );
                total[r] = _mm512_add_ps(total[r], t);
            }
        }
    }
    // SAFETY: this function's features.
    unsafe { store(total) }
}

/// Bytes of one packed Q8_0 block of `NR` rows: the quants plus 128 (as
/// u8, for `vpdpbusd`'s unsigned operand) as `[group g of 4][row w][4]`
/// (`32·NR`), then `d` per row as f32.
pub(super) const PACKED_Q8_0: usize = Q8_D + 4 * NR;
const Q8_D: usize = 32 * NR;

/// Packs `NR` Q8_0 rows of `nb` blocks each into `out` (`nb *
/// PACKED_Q8_0` bytes).
pub(super) fn pack_q8_0(rows: &[&[u8]; NR], nb: usize, out: &mut [u8]) {
    assert_eq!(out.len(), nb * PACKED_Q8_0, "a panel's bytes");
    for (b, pb) in out.chunks_exact_mut(PACKED_Q8_0).enumerate() {
        for (w, row) in rows.iter().enumerate() {
            let blk = &row[34 * b..34 * (b + 1)];
            for g in 0..8 {
                let q = u32_at(blk, 2 + 4 * g) ^ 0x8080_8080;
                put4(pb, (g * NR + w) * 4, q.to_le_bytes());
            }
            let d = f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f32();
            put4(pb, Q8_D + 4 * w, d.to_le_bytes());
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
/// AVX-512 F/BW/VNNI.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn dot_q8_0_panel<const R: usize>(
    panel: &[u8],
    nb: usize,
    a: &[ActRow<'_>; R],
) -> [[f32; NR]; R] {
    let qa: [*const i8; R] = std::array::from_fn(|r| a[r].qs.as_ptr());
    let sums: [*const i32; R] = std::array::from_fn(|r| a[r].sum.as_ptr());
    let da: [*const f32; R] = std::array::from_fn(|r| a[r].d.as_ptr());
    let mut acc4 = [[_mm512_setzero_ps(); 4]; R];
    for b4 in (0..nb).step_by(4) {
        // Block b4 + u into accumulator u: a constant index, so the four
        // accumulators stay in registers.
        for u in 0..4.min(nb - b4) {
            let b = b4 + u;
            // SAFETY: block b < nb is inside `panel`, and every row's
            // quants, scale and sum for block b are in bounds (the caller's
            // contract).
            unsafe {
                let p = panel.as_ptr().wrapping_add(b * PACKED_Q8_0);
                // Two accumulators per row (even and odd groups): twice the
                // independent `vpdpbusd` chains.
                let (mut acc0, mut acc1) =
                    ([_mm512_setzero_si512(); R], [_mm512_setzero_si512(); R]);
                let ab: [*const i32; R] =
                    std::array::from_fn(|r| qa[r].wrapping_add(32 * b) as *const i32);
                for g in (0..8).step_by(2) {
                    let w0 = ld64(p.wrapping_add(g * VEC));
                    let w1 = ld64(p.wrapping_add((g + 1) * VEC));
                    for r in 0..R {
                        let q0 = ld4(ab[r].wrapping_add(g));
                        let q1 = ld4(ab[r].wrapping_add(g + 1));
                        acc0[r] = _mm512_dpbusd_epi32(acc0[r], w0, _mm512_set1_epi32(q0));
                        acc1[r] = _mm512_dpbusd_epi32(acc1[r], w1, _mm512_set1_epi32(q1));
                    }
                }
                let dw = _mm512_castsi512_ps(ld64(p.wrapping_add(Q8_D)));
                for r in 0..R {
                    // Σ (q + 128)·a − 128 Σ a = Σ q·a, exactly.
                    let off = _mm512_set1_epi32(128 * *sums[r].wrapping_add(b));
                    let sumi = _mm512_sub_epi32(_mm512_add_epi32(acc0[r], acc1[r]), off);
                    let dd = _mm512_mul_ps(dw, _mm512_set1_ps(*da[r].wrapping_add(b)));
                    let t = _mm512_mul_ps(_mm512_cvtepi32_ps(sumi), dd);
                    acc4[r][u] = _mm512_add_ps(acc4[r][u], t);
                }
            }
        }
    }
    let total: [__m512; R] = std::array::from_fn(|r| {
        let [a0, a1, a2, a3] = acc4[r];
        _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))
    });
    // SAFETY: this function's features.
    unsafe { store(total) }
}

/// Bytes of one packed Q6_K super-block of `NR` rows: the 6-bit quants
/// (0..64, unsigned) as `[sub-block j of 16][group g of 4][row w][4]`
/// (`256·NR`), the 16 signed scales as `[j][w]` i32, the same as i16 pairs
/// `(sc_2p, sc_2p+1)` `[p][w]`, then `d` per row as f32.
pub(super) const PACKED_Q6_K: usize = Q6_D + 4 * NR;
const Q6_SCALES: usize = 256 * NR;
const Q6_PAIRS: usize = Q6_SCALES + 16 * 4 * NR;
const Q6_D: usize = Q6_PAIRS + 8 * 4 * NR;

/// Packs `NR` Q6_K rows of `nb` super-blocks each into `out` (`nb *
/// PACKED_Q6_K` bytes).
pub(super) fn pack_q6_k(rows: &[&[u8]; NR], nb: usize, out: &mut [u8]) {
    assert_eq!(out.len(), nb * PACKED_Q6_K, "a panel's bytes");
    for (b, pb) in out.chunks_exact_mut(PACKED_Q6_K).enumerate() {
        for (w, row) in rows.iter().enumerate() {
            let blk = &row[210 * b..210 * (b + 1)];
            // Elements e..e + 4 (one group) at a time: element e is the low
            // (k < 2) or high nibble of `ql[64h + 32(k % 2) + l]` and bits
            // 2k, 2k + 1 of `qh[32h + l]`, for e = 128h + 32k + l.
            for e in (0..256).step_by(4) {
                let (h, k, l) = (e / 128, (e % 128) / 32, e % 32);
                let ql = u32_at(blk, 64 * h + l + 32 * (k % 2));
                let lo = if k < 2 { ql } else { ql >> 4 } & 0x0F0F_0F0F;
                let hi = ((u32_at(blk, 128 + 32 * h + l) >> (2 * k)) & 0x0303_0303) << 4;
                let (j, g) = (e / 16, (e % 16) / 4);
                put4(pb, ((j * 4 + g) * NR + w) * 4, (lo | hi).to_le_bytes());
            }
            for j in 0..16 {
                let sc = blk[192 + j] as i8;
                put4(pb, Q6_SCALES + (j * NR + w) * 4, (sc as i32).to_le_bytes());
                let o = Q6_PAIRS + ((j / 2) * NR + w) * 4 + 2 * (j % 2);
                pb[o..o + 2].copy_from_slice(&(sc as i16).to_le_bytes());
            }
            let d = f16::from_bits(u16::from_le_bytes([blk[208], blk[209]])).to_f32();
            put4(pb, Q6_D + 4 * w, d.to_le_bytes());
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
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn dot_q6_k_panel<const R: usize>(
    panel: &[u8],
    nb: usize,
    a: &[ActRow<'_>; R],
) -> [[f32; NR]; R] {
    let qa: [*const i8; R] = std::array::from_fn(|r| a[r].qs.as_ptr());
    let bsums: [*const i16; R] = std::array::from_fn(|r| a[r].bsums.as_ptr());
    let da: [*const f32; R] = std::array::from_fn(|r| a[r].d.as_ptr());
    let mut total = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        // SAFETY: block b < nb is inside `panel`, and every row's quants,
        // sums and scale for block b are in bounds (the caller's contract).
        unsafe {
            let p = panel.as_ptr().wrapping_add(b * PACKED_Q6_K);
            let isum = scaled_sums::<R, 16, 4>(p, Q6_SCALES, &qa, 256 * b);
            let pairs: [__m512i; 8] =
                std::array::from_fn(|q| ld64(p.wrapping_add(Q6_PAIRS + VEC * q)));
            let dw = _mm512_castsi512_ps(ld64(p.wrapping_add(Q6_D)));
            for r in 0..R {
                // The activation's 16 sums as 8 (j, j + 1) pairs of i16,
                // each pair broadcast from memory.
                let bs = bsums[r].wrapping_add(16 * b) as *const i32;
                let mut off = _mm512_setzero_si512();
                for (q, &pq) in pairs.iter().enumerate() {
                    let bq = _mm512_set1_epi32(ld4(bs.wrapping_add(q)));
                    off = _mm512_add_epi32(off, _mm512_madd_epi16(pq, bq));
                }
                let isum = _mm512_sub_epi32(isum[r], _mm512_slli_epi32(off, 5));
                // scalar::term_q6_k lane by lane: (da·dw)·isum.
                let d = _mm512_set1_ps(*da[r].wrapping_add(b));
                let t = _mm512_mul_ps(_mm512_mul_ps(d, dw), _mm512_cvtepi32_ps(isum));
                total[r] = _mm512_add_ps(total[r], t);
            }
        }
    }
    // SAFETY: this function's features.
    unsafe { store(total) }
}
