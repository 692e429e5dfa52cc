//! Decode's K-quant dot products (Q4_K, Q5_K, Q6_K) on 512-bit registers
//! (AVX-512 BW and VNNI): a weight row against up to four activation rows,
//! and a group of four weight rows of a grouped matrix (`matrix.rs`)
//! against one activation row.
//!
//! Why: one thread of the 256-bit kernels (`x86.rs`) multiplied about 29 G
//! weights a second from cache in every format (15 GiB/s of Q4_K), so with
//! Q4_K two threads' decode was bound by these instructions as much as by
//! memory. Here a super-block takes about three quarters of them:
//! - 64 quants are unpacked per instruction: a 32-byte group of nibbles is
//!   broadcast to both halves of a register and shifted by 4 in the high
//!   half only, which lines the unpacked weights up with 64 contiguous
//!   activation quants (no shuffle of either side);
//! - the sub-block scales are applied by `vpdpwssd` on `maddubs`' 16-bit
//!   pairs (one instruction, accumulating), where `x86.rs` needs a
//!   `vpdpbusd`, a `vpmulld` and an add per 32 quants; the scale vectors
//!   come from one `vpermw` each, with constant index tables;
//! - the block's two sums (scaled products, and the mins' or Q6_K's
//!   offset term) are folded together in one short `hadd` tree.
//!
//! Measured (one thread, `examples/quant_gemv.rs`, five interleaved
//! rounds, medians): Q4_K 1.11x the 256-bit kernel at k = 4096 and 1.23x at
//! k = 768 (Granite's rows); Q6_K 1.08x and 1.05-1.15x. A super-block then
//! took about 29 cycles, much of it the tail (the fold and the f32 term:
//! skipping three in four made the kernel 1.35x faster). Folding two or
//! four blocks' sums in one tree, with the same bits, was 1.04-1.09x at
//! k = 4096 but 0.88-0.99x at k = 768, so it is not done; at short rows
//! the per-row dispatch around the kernel cost more, and `quant_matmul`
//! now resolves the kernel once per call (`decode_kernel`: 1.13-1.33x at
//! k = 768).
//!
//! The group kernels (`*_group`) take decode's rows four at a time: the
//! activation's quants loaded once for the four, their eight sums folded
//! in one `hadd` tree, their f32 terms four lanes of one instruction. Two
//! rows read in turn from row-major storage had been 1.12-1.31x faster
//! from cache but 0.36-0.56x from memory (two streams); grouped at load,
//! the four rows are one stream. Measured on an Intel Xeon (2 threads,
//! Q4_K, k = 768, an 85 MB matrix, prototype): 1.25x the one-row kernel;
//! Granite and Llama Q4_K_M decode 1.16-1.18x (paired medians).
//!
//! The Q4_K/Q5_K group kernel unpacks the scales and mins of its four
//! rows at once (one register of the four heads, `scales_mins_k4`'s masks
//! as vector operations, the min terms two `vpmaddwd`, one fold for the
//! sums and the min terms): from cache (`examples/quant_stream.rs`, `C=1`,
//! 2 threads) 1.08-1.20x in three pairs; streamed from memory, and in
//! Granite Q4_K_M decode, no change beyond the noise (0.99x, 8 pairs):
//! there a decode step waits on memory, not on these instructions.
//!
//! The results are bit for bit those of `scalar.rs`: the integer sums are
//! exact whatever their order (no 16-bit pair can saturate: at most
//! 2·63·128), and the f32 term of each super-block is `scalar.rs`'s, added
//! in its order.

use std::arch::x86_64::*;

use super::act::ActRow;
use super::packed::{ld32, ld64};
use super::scalar;

/// The 32 bytes at `p` in both halves of a register.
///
/// # Safety
/// `p` must be valid for reading 32 bytes.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn both_halves(p: *const u8) -> __m512i {
    // SAFETY: the caller's contract.
    _mm512_broadcast_i64x4(unsafe { ld32(p as *const __m256i) })
}

/// 16-bit lanes `0..16` of the result take `lo`, lanes `16..32` take `hi`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
fn halves16(lo: i16, hi: i16) -> __m512i {
    _mm512_inserti64x4(_mm512_set1_epi16(lo), _mm256_set1_epi16(hi), 1)
}

/// Index vectors for `vpermw`: vector `v` spreads 16-bit lane
/// `first + v * step + i / run` over lanes `i` (`run` lanes each).
const fn spread<const V: usize>(step: usize, run: usize) -> [[i16; 32]; V] {
    let mut idx = [[0i16; 32]; V];
    let mut v = 0;
    while v < V {
        let mut i = 0;
        while i < 32 {
            idx[v][i] = (v * step + i / run) as i16;
            i += 1;
        }
        v += 1;
    }
    idx
}

/// Q4_K/Q5_K: sub-block pair c's two scales, 16 lanes each.
static PICK_Q45: [[i16; 32]; 4] = spread(2, 16);
/// Q6_K: quarter g's four scales, 8 lanes each.
static PICK_Q6: [[i16; 32]; 4] = spread(4, 8);

/// Index vector `v` of `table`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
fn pick(table: &'static [[i16; 32]; 4], v: usize) -> __m512i {
    index(&table[v])
}

/// A table of 32 words as an index vector for `vpermw`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
fn index(words: &'static [i16; 32]) -> __m512i {
    // SAFETY: `[i16; 32]` and `__m512i` have the same size, and every bit
    // pattern is a valid `__m512i`.
    unsafe { std::mem::transmute::<[i16; 32], __m512i>(*words) }
}

/// Q4_K/Q5_K: quarter `c` of a block's quants (`qs` at the nibbles, Q5_K's
/// fifth bits `qh` in both halves of a register), 64 quants as bytes lined
/// up with activation quants `64c..64c + 64`: a 32-byte group of nibbles
/// in both halves, shifted by 4 in the high half's 16 words only.
///
/// # Safety
/// `qs` must be valid for reading `32c + 32` bytes.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn q45_quarter<const Q5: bool>(qs: *const u8, qh: __m512i, c: usize) -> __m512i {
    // SAFETY: the caller's contract.
    let x = unsafe { both_halves(qs.wrapping_add(32 * c)) };
    let x = _mm512_mask_srli_epi16::<4>(x, 0xFFFF_0000, x);
    let q = _mm512_and_si512(x, _mm512_set1_epi8(0x0F));
    if !Q5 {
        return q;
    }
    // Fifth bits: bit 2c for the low half's quants, bit 2c + 1 for the
    // high half's.
    let bits = _mm512_inserti64x4(
        _mm512_set1_epi8((1u8 << (2 * c)) as i8),
        _mm256_set1_epi8((2u8 << (2 * c)) as i8),
        1,
    );
    let high = _mm512_test_epi8_mask(qh, bits);
    _mm512_mask_add_epi8(q, high, q, _mm512_set1_epi8(0x10))
}

/// Q6_K: half `h` of the block at `p` (`ql` at 0, `qh` at 128), its quants
/// `0..64` and `64..128` as bytes. The two high bits of quants 0..32 and
/// 32..64 of a half (bits 0-1 and 2-3 of `qh`) go to bits 4-5; of quants
/// 64..96 and 96..128 (bits 4-5 and 6-7) likewise.
///
/// # Safety
/// `p` must point at a whole block.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn q6_half(p: *const u8, h: usize) -> (__m512i, __m512i) {
    let (m4, m30) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x30));
    // SAFETY: the caller's contract.
    let (ql, qh) = unsafe {
        (
            ld64(p.wrapping_add(64 * h)),
            both_halves(p.wrapping_add(128 + 32 * h)),
        )
    };
    let q01 = _mm512_or_si512(
        _mm512_and_si512(ql, m4),
        _mm512_and_si512(_mm512_sllv_epi16(qh, halves16(4, 2)), m30),
    );
    let q23 = _mm512_or_si512(
        _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
        _mm512_and_si512(_mm512_srlv_epi16(qh, halves16(0, 2)), m30),
    );
    (q01, q23)
}

/// `(Σ a, Σ b)` over the 16 and 8 i32 lanes of `a` and `b`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
fn sums2(a: __m512i, b: __m256i) -> (i32, i32) {
    let a = _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
    // [a01 a23 b01 b23 | a45 a67 b45 b67]
    let h = _mm256_hadd_epi32(a, b);
    let x = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    let x = _mm_hadd_epi32(x, x);
    (_mm_cvtsi128_si32(x), _mm_extract_epi32(x, 1))
}

/// Q4_K (`Q5 == false`) or Q5_K: one weight row with `R` activation rows
/// (Q8_K), each super-block unpacked once for all of them.
///
/// # Safety
/// `w` must hold whole super-blocks, every `a[r]` a Q8_K row with as many;
/// the CPU must have AVX-512 F, BW, VL and VNNI.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn dot_q45_k<const Q5: bool, const R: usize>(
    w: &[u8],
    a: &[ActRow<'_>; R],
) -> [f32; R] {
    let bb = if Q5 { 176 } else { 144 };
    let qs_off = if Q5 { 48 } else { 16 };
    let nb = w.len() / bb;
    let mut total = [0f32; R];
    for b in 0..nb {
        // SAFETY: block b < nb is inside `w`, and every row has nb blocks
        // of 256 quants, 16 sums and one scale (the caller's contract).
        unsafe {
            let p = w.as_ptr().wrapping_add(b * bb);
            if R == 1 {
                // One row: decode, its weights streaming.
                super::x86::prefetch_ahead(p, bb);
            }
            let (scales, mins) = super::x86::scales_mins_k4(p);
            let sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(
                i64::from_le_bytes(scales),
            )));
            let pairs = super::x86::min_pairs(&mins);
            let qh = if Q5 {
                both_halves(p.wrapping_add(16))
            } else {
                _mm512_setzero_si512()
            };
            let mut acc = [_mm512_setzero_si512(); R];
            for c in 0..4 {
                let q = q45_quarter::<Q5>(p.wrapping_add(qs_off), qh, c);
                let s = _mm512_permutexvar_epi16(pick(&PICK_Q45, c), sc16);
                for r in 0..R {
                    let av = ld64(a[r].qs.as_ptr().wrapping_add(256 * b + 64 * c) as *const u8);
                    acc[r] = _mm512_dpwssd_epi32(acc[r], _mm512_maddubs_epi16(q, av), s);
                }
            }
            let (dw, dmin) = super::x86::f16x2(p);
            for r in 0..R {
                let bs = ld32(a[r].bsums.as_ptr().wrapping_add(16 * b) as *const __m256i);
                let (isum, imin) = sums2(acc[r], _mm256_madd_epi16(bs, pairs));
                let da = *a[r].d.as_ptr().wrapping_add(b);
                total[r] += scalar::term_k(da, dw, dmin, isum, imin);
            }
        }
    }
    total
}

/// Q6_K: one weight row with `R` activation rows (Q8_K).
///
/// # Safety
/// As [`dot_q45_k`].
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn dot_q6_k<const R: usize>(w: &[u8], a: &[ActRow<'_>; R]) -> [f32; R] {
    let mut total = [0f32; R];
    for (b, wb) in w.chunks_exact(210).enumerate() {
        // SAFETY: as in `dot_q45_k`; `ql` is at 0, `qh` at 128, the 16
        // scales at 192 and `d` at 208 in the block.
        unsafe {
            let p = wb.as_ptr();
            if R == 1 {
                // One row: decode, its weights streaming.
                super::x86::prefetch_ahead(p, 210);
            }
            let sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(super::x86::ld16(
                p.wrapping_add(192) as *const __m128i,
            )));
            let mut acc = [_mm512_setzero_si512(); R];
            for h in 0..2 {
                let (q01, q23) = q6_half(p, h);
                let s01 = _mm512_permutexvar_epi16(pick(&PICK_Q6, 2 * h), sc16);
                let s23 = _mm512_permutexvar_epi16(pick(&PICK_Q6, 2 * h + 1), sc16);
                for r in 0..R {
                    let q = a[r].qs.as_ptr().wrapping_add(256 * b + 128 * h) as *const u8;
                    let (a01, a23) = (ld64(q), ld64(q.wrapping_add(64)));
                    acc[r] = _mm512_dpwssd_epi32(acc[r], _mm512_maddubs_epi16(q01, a01), s01);
                    acc[r] = _mm512_dpwssd_epi32(acc[r], _mm512_maddubs_epi16(q23, a23), s23);
                }
            }
            // Σ sc·(q − 32)·a = Σ sc·q·a − 32 Σ_j sc_j · bsum_j.
            let scv = _mm512_castsi512_si256(sc16);
            let dw = super::x86::f16x1(p.wrapping_add(208));
            for r in 0..R {
                let bs = ld32(a[r].bsums.as_ptr().wrapping_add(16 * b) as *const __m256i);
                let (sum, off) = sums2(acc[r], _mm256_madd_epi16(scv, bs));
                let isum = sum.wrapping_sub(off.wrapping_mul(32));
                total[r] += scalar::term_q6_k(*a[r].d.as_ptr().wrapping_add(b), dw, isum);
            }
        }
    }
    total
}

/// Rows per group of the grouped layout (`DType::QuantGroups`).
pub(super) const G: usize = metrale_core::QUANT_GROUP_ROWS;

/// The eight i32 sums of `v` (`v[i]`'s eight lanes summed into lane `i`).
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
pub(super) fn sums8(v: &[__m256i; 8]) -> __m256i {
    let h0 = _mm256_hadd_epi32(v[0], v[1]);
    let h1 = _mm256_hadd_epi32(v[2], v[3]);
    let h2 = _mm256_hadd_epi32(v[4], v[5]);
    let h3 = _mm256_hadd_epi32(v[6], v[7]);
    // [s0 s1 s2 s3 | s0 s1 s2 s3] (each lane holding half of its sum).
    let g0 = _mm256_hadd_epi32(h0, h1);
    let g1 = _mm256_hadd_epi32(h2, h3);
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(g0, g1),
        _mm256_permute2x128_si256::<0x31>(g0, g1),
    )
}

/// A 512-bit sum's two halves added (eight lanes of the same sums).
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
fn halve(a: __m512i) -> __m256i {
    _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1))
}

/// Super-block `b` of a Q8_K activation row: its 256 quants in four
/// registers, its 16 sums, and its scale in every lane.
///
/// # Safety
/// `a` must hold block `b`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn act_block(a: &ActRow<'_>, b: usize) -> ([__m512i; 4], __m256i, __m128) {
    let q = a.qs.as_ptr().wrapping_add(256 * b) as *const u8;
    // SAFETY: the caller's contract (256 quants, 16 sums and a scale).
    unsafe {
        (
            std::array::from_fn(|c| ld64(q.wrapping_add(64 * c))),
            ld32(a.bsums.as_ptr().wrapping_add(16 * b) as *const __m256i),
            _mm_set1_ps(*a.d.as_ptr().wrapping_add(b)),
        )
    }
}

/// The four lanes of `v`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
fn lanes(v: __m128) -> [f32; G] {
    let mut out = [0f32; G];
    // SAFETY: `out` holds four floats.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), v) };
    out
}

/// Q4_K/Q5_K in a group: `vpermw` indices picking, from the 16-bit scales
/// and mins of two rows ([`heads_scales_mins`]: row `h` in words
/// `16h..16h + 16`, its eight scales then its eight mins), row `h`'s
/// sub-block pair `c` (scale `2c` in lanes 0..16, `2c + 1` in 16..32).
static GROUP_PICK_Q45: [[[i16; 32]; 4]; 2] = {
    let mut idx = [[[0i16; 32]; 4]; 2];
    let mut h = 0;
    while h < 2 {
        let mut c = 0;
        while c < 4 {
            let mut i = 0;
            while i < 32 {
                idx[h][c][i] = (16 * h + 2 * c + i / 16) as i16;
                i += 1;
            }
            c += 1;
        }
        h += 1;
    }
    idx
};

/// Two rows' mins as [`min_pairs`](super::x86::min_pairs) lays out one
/// row's: `(m0, m0, m1, m1, ...)`, the first row in lanes 0..16.
static GROUP_MIN_PAIRS: [i16; 32] = {
    let mut idx = [0i16; 32];
    let mut i = 0;
    while i < 32 {
        idx[i] = (16 * (i / 16) + 8 + (i % 16) / 2) as i16;
        i += 1;
    }
    idx
};

/// The four rows' `d` (lanes 0..4) and `dmin` (4..8) from their heads.
static GROUP_D_DMIN: [i16; 32] = {
    let mut idx = [0i16; 32];
    let mut i = 0;
    while i < 8 {
        idx[i] = (8 * (i % 4) + i / 4) as i16;
        i += 1;
    }
    idx
};

/// The [`G`] rows' first 16 bytes of a K-quant block (`d`, `dmin`, the 12
/// bytes of scales and mins), row `r` in 128-bit lane `r`.
///
/// # Safety
/// `base + r·bb` must hold 16 bytes for every `r < G`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn group_heads(base: *const u8, bb: usize) -> __m512i {
    // SAFETY: the caller's contract.
    let h = |r: usize| unsafe { super::x86::ld16(base.wrapping_add(bb * r) as *const __m128i) };
    let v = _mm512_castsi128_si512(h(0));
    let v = _mm512_inserti32x4::<1>(v, h(1));
    let v = _mm512_inserti32x4::<2>(v, h(2));
    _mm512_inserti32x4::<3>(v, h(3))
}

/// The eight 6-bit scales and mins of the four rows (`scales_mins_k4`'s
/// masks on all four heads at once) as 16-bit words: rows 0 and 1 in the
/// first register, 2 and 3 in the second, each row's scales then mins.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
fn heads_scales_mins(heads: __m512i) -> (__m512i, __m512i) {
    // Each row's dwords are [d|dmin, u0, u1, u2]; its scales are
    // [u0 & K1, (u2 & K2) | (u0 >> 2) & 0x30.., u1 & K1, (u2 >> 4) & K2 |
    // (u1 >> 2) & 0x30..] (see `x86::scales_mins_k4`).
    let lane4 = |a: i32, b: i32| _mm512_set4_epi32(b, a, b, a);
    let x = _mm512_shuffle_epi32::<0b11_10_11_01>(heads); // [u0, u2, u1, u2]
    let y = _mm512_shuffle_epi32::<0b10_10_01_01>(heads); // [u0, u0, u1, u1]
    let x = _mm512_srlv_epi32(x, _mm512_set4_epi32(4, 0, 0, 0));
    let low = _mm512_and_si512(x, lane4(0x3f3f_3f3f, 0x0f0f_0f0f));
    let top = _mm512_and_si512(_mm512_srli_epi32::<2>(y), lane4(0, 0x3030_3030));
    let bytes = _mm512_or_si512(low, top);
    (
        _mm512_cvtepu8_epi16(_mm512_castsi512_si256(bytes)),
        _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64::<1>(bytes)),
    )
}

/// Sums the four rows' 16 product lanes (`acc`) and their min terms (two
/// rows' eight lanes in each of `m01`, `m23`): `([Σ acc[r]], [Σ min r])`.
/// Integer sums, exact in any order.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
fn fold_group(acc: [__m512i; G], m01: __m512i, m23: __m512i) -> (__m128i, __m128i) {
    // 16 lanes to 8, two rows to a register (as `m01` and `m23` are).
    let half = |x, y| {
        _mm512_add_epi32(
            _mm512_shuffle_i64x2::<0b01_00_01_00>(x, y),
            _mm512_shuffle_i64x2::<0b11_10_11_10>(x, y),
        )
    };
    // 8 lanes to 4: row r's in 128-bit lane r.
    let quarter = |x, y| {
        _mm512_add_epi32(
            _mm512_shuffle_i64x2::<0b10_00_10_00>(x, y),
            _mm512_shuffle_i64x2::<0b11_01_11_01>(x, y),
        )
    };
    let sums = quarter(half(acc[0], acc[1]), half(acc[2], acc[3]));
    let mins = quarter(m01, m23);
    // Per 128-bit lane: [s0 + s2, s1 + s3, m0 + m2, m1 + m3], then [S, S, M, M].
    let c = _mm512_add_epi32(
        _mm512_unpacklo_epi64(sums, mins),
        _mm512_unpackhi_epi64(sums, mins),
    );
    let d = _mm512_add_epi32(c, _mm512_shuffle_epi32::<0b10_11_00_01>(c));
    let v = _mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0),
        d,
    );
    (_mm512_castsi512_si128(v), _mm512_extracti32x4_epi32::<1>(v))
}

/// Q4_K (`Q5 == false`) or Q5_K: the [`G`] weight rows of a group in the
/// grouped layout (block `b` of row `r` at `(b·G + r)·block_bytes`) with
/// one activation row. The same bits as [`dot_q45_k`] row by row: the
/// integer sums are exact, and lane `r` of the f32 terms is row `r`'s
/// `scalar::term_k`, added in block order.
///
/// Why: decode's rows are short (Granite's k = 768 is three super-blocks),
/// and per row and block the scales, the fold and the f32 term cost about
/// a third of the kernel. Here the four rows' scales and mins are unpacked
/// together in vector registers, their min terms are two `vpmaddwd`, one
/// fold and one f32 term serve the four, and the activation's quants are
/// loaded once for them.
///
/// # Safety
/// `w` must hold `G·nb` whole super-blocks, `a` a Q8_K row of `nb`; the
/// CPU must have AVX-512 F, BW, VL and VNNI.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn dot_q45_k_group<const Q5: bool>(w: &[u8], a: &ActRow<'_>) -> [f32; G] {
    let bb = if Q5 { 176 } else { 144 };
    let qs_off = if Q5 { 48 } else { 16 };
    let nb = w.len() / (G * bb);
    let mut total = _mm_setzero_ps();
    for b in 0..nb {
        // SAFETY: the group's block b < nb is inside `w` (G blocks of bb
        // bytes from G·bb·b), and `a` has nb blocks of 256 quants, 16 sums
        // and one scale (the caller's contract).
        unsafe {
            let base = w.as_ptr().wrapping_add(G * bb * b);
            let (av, bs, da) = act_block(a, b);
            let heads = group_heads(base, bb);
            let (sm01, sm23) = heads_scales_mins(heads);
            let mut acc = [_mm512_setzero_si512(); G];
            for (r, acc) in acc.iter_mut().enumerate() {
                let p = base.wrapping_add(bb * r);
                // Decode's kernel: the group's bytes stream past.
                super::x86::prefetch_ahead(p, bb);
                let words = if r < 2 { sm01 } else { sm23 };
                let qh = if Q5 {
                    both_halves(p.wrapping_add(16))
                } else {
                    _mm512_setzero_si512()
                };
                for (c, &av) in av.iter().enumerate() {
                    let q = q45_quarter::<Q5>(p.wrapping_add(qs_off), qh, c);
                    let s = _mm512_permutexvar_epi16(pick(&GROUP_PICK_Q45[r % 2], c), words);
                    *acc = _mm512_dpwssd_epi32(*acc, _mm512_maddubs_epi16(q, av), s);
                }
            }
            let pairs = index(&GROUP_MIN_PAIRS);
            let bs2 = _mm512_broadcast_i64x4(bs);
            let m01 = _mm512_madd_epi16(_mm512_permutexvar_epi16(pairs, sm01), bs2);
            let m23 = _mm512_madd_epi16(_mm512_permutexvar_epi16(pairs, sm23), bs2);
            let (isum, imin) = fold_group(acc, m01, m23);
            let (isum, imin) = (_mm_cvtepi32_ps(isum), _mm_cvtepi32_ps(imin));
            let f = _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutexvar_epi16(
                index(&GROUP_D_DMIN),
                heads,
            )));
            let (dw, dmin) = (_mm256_castps256_ps128(f), _mm256_extractf128_ps::<1>(f));
            // scalar::term_k, four rows at once (no fused multiply-add).
            let t = _mm_sub_ps(
                _mm_mul_ps(_mm_mul_ps(da, dw), isum),
                _mm_mul_ps(_mm_mul_ps(da, dmin), imin),
            );
            total = _mm_add_ps(total, t);
        }
    }
    lanes(total)
}

/// Q6_K: the [`G`] weight rows of a group in the grouped layout with one
/// activation row; the same bits as [`dot_q6_k`] row by row.
///
/// # Safety
/// As [`dot_q45_k_group`].
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn dot_q6_k_group(w: &[u8], a: &ActRow<'_>) -> [f32; G] {
    const BB: usize = 210;
    let nb = w.len() / (G * BB);
    let thirty_two = _mm_set1_epi32(32);
    let mut total = _mm_setzero_ps();
    for b in 0..nb {
        // SAFETY: as in `dot_q45_k_group`; within a block `ql` is at 0,
        // `qh` at 128, the 16 scales at 192 and `d` at 208.
        unsafe {
            let base = w.as_ptr().wrapping_add(G * BB * b);
            let (av, bs, da) = act_block(a, b);
            let mut v = [_mm256_setzero_si256(); 8];
            for r in 0..G {
                let p = base.wrapping_add(BB * r);
                // Decode's kernel: the group's bytes stream past.
                super::x86::prefetch_ahead(p, BB);
                let sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(super::x86::ld16(
                    p.wrapping_add(192) as *const __m128i,
                )));
                let mut acc = _mm512_setzero_si512();
                for h in 0..2 {
                    let (q01, q23) = q6_half(p, h);
                    let s01 = _mm512_permutexvar_epi16(pick(&PICK_Q6, 2 * h), sc16);
                    let s23 = _mm512_permutexvar_epi16(pick(&PICK_Q6, 2 * h + 1), sc16);
                    let (a01, a23) = (av[2 * h], av[2 * h + 1]);
                    acc = _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(q01, a01), s01);
                    acc = _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(q23, a23), s23);
                }
                v[r] = halve(acc);
                v[G + r] = _mm256_madd_epi16(_mm512_castsi512_si256(sc16), bs);
            }
            let s = sums8(&v);
            // Σ sc·q·a − 32 Σ_j sc_j · bsum_j, wrapping as `dot_q6_k` does.
            let isum = _mm_sub_epi32(
                _mm256_castsi256_si128(s),
                _mm_mullo_epi32(_mm256_extracti128_si256::<1>(s), thirty_two),
            );
            let dw = super::x86::f16x4(base.wrapping_add(208), BB);
            // scalar::term_q6_k, four rows at once.
            total = _mm_add_ps(total, _mm_mul_ps(_mm_mul_ps(da, dw), _mm_cvtepi32_ps(isum)));
        }
    }
    lanes(total)
}
