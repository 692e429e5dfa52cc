//! AVX2 and AVX-512 VNNI dot products. Both are the same code (a macro
//! instantiates it twice) and differ only in the u8×i8 multiply: AVX2's
//! `maddubs` + `madd` pair, or VNNI's one `vpdpbusd` (on 256-bit
//! registers, AVX512VL: the 32-element blocks are 32 bytes). The K-quants'
//! row kernels here are AVX2's only (`k_quant_kernels!`); on AVX-512 they
//! are `zmm.rs`'s, on 512-bit registers. Both give the same exact i32 sums:
//! `maddubs` saturates only past 32767, and a pair of products here is at
//! most 2·128·127 (activations are within ±127 by construction).
//!
//! Signed weights (Q8_0, IQ4_NL) use the usual sign trick, |w| × (a with
//! w's sign); unsigned ones (the nibble formats) subtract their offset
//! times the activation block's sum afterwards. Blocks of 32 go four at a
//! time: their eight-lane sums fold into one 4-lane vector with three
//! `hadd`s, then the f32 terms follow `scalar.rs`'s order exactly.
//!
//! Each kernel takes one weight row and up to four activation rows, and
//! unpacks each block once for all of them (prefill's several rows pay
//! the nibble unpacking once); every row's arithmetic is the same whatever
//! the number of rows, so its result is too.

use std::arch::x86_64::*;

// Loads without `core`'s precondition checks (see `packed.rs`).
use super::packed::ld32;

/// 16 bytes at `p` as a vector (as `ld32`).
///
/// # Safety
/// `p` must be valid for reading 16 bytes.
#[inline(always)]
pub(super) unsafe fn ld16(p: *const __m128i) -> __m128i {
    // SAFETY: the caller's contract; `[u8; 16]` has no alignment.
    unsafe { std::mem::transmute::<[u8; 16], __m128i>(*(p as *const [u8; 16])) }
}

/// The little-endian u32 at `p`.
///
/// # Safety
/// `p` must be valid for reading 4 bytes.
#[inline(always)]
unsafe fn ld_u32(p: *const u8) -> u32 {
    // SAFETY: the caller's contract; `[u8; 4]` has no alignment.
    u32::from_le_bytes(unsafe { *(p as *const [u8; 4]) })
}

/// The little-endian u16 at `p`.
///
/// # Safety
/// `p` must be valid for reading 2 bytes.
#[inline(always)]
unsafe fn ld_u16(p: *const u8) -> u16 {
    // SAFETY: the caller's contract; `[u8; 2]` has no alignment.
    u16::from_le_bytes(unsafe { *(p as *const [u8; 2]) })
}

/// How far ahead of its reads a decode kernel prefetches its weights: the
/// hardware prefetcher alone left this Intel host's decode at about half
/// the bandwidth; 1 KiB and 16 KiB were no better than 4 KiB.
pub(super) const DECODE_AHEAD: usize = 4096;

/// Prefetches into L1 the lines of the `len` bytes [`DECODE_AHEAD`] past
/// `p`, where a decode kernel is reading a weight stream: one call per block
/// read, so that the prefetches go out a line or two at a time between the
/// arithmetic. (A burst of a whole row's lines before its kernel ran left
/// the core stalled on its fill buffers: Llama Q8_0 decode was 1.10x
/// faster with the prefetches in the kernel.)
#[inline(always)]
pub(super) fn prefetch_ahead(p: *const u8, len: usize) {
    let at = p.wrapping_add(DECODE_AHEAD);
    // Every 64th byte and the last: one touch in each line of the range.
    // SAFETY (each): a prefetch never faults, whatever the address; past
    // the end of the weights it fetches a line no one reads.
    let mut o = 0;
    while o < len {
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(o).cast()) };
        o += 64;
    }
    if len > 0 {
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(len - 1).cast()) };
    }
}

/// Which 32-element format a monomorphised loop handles.
pub(super) const Q8_0: u8 = 0;
pub(super) const Q4_0: u8 = 1;
pub(super) const Q4_1: u8 = 2;
pub(super) const Q5_0: u8 = 3;
pub(super) const Q5_1: u8 = 4;
pub(super) const IQ4_NL: u8 = 5;

/// Bytes of a block of format `t` (`GgmlType::block_bytes`), a constant in
/// each monomorphised loop: the per-row division and lookup cost short
/// decode rows a few percent.
const fn block_bytes(t: u8) -> usize {
    match t {
        Q8_0 => 34,
        Q4_0 | IQ4_NL => 18,
        Q4_1 => 20,
        Q5_0 => 22,
        _ => 24,
    }
}

/// u8 × i8 products summed in fours (no saturation for our ranges).
#[target_feature(enable = "avx2")]
#[inline]
fn dot_avx2(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

#[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
#[inline]
fn dot_vnni(u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
}

/// The low and high nibbles of 16 bytes as 32 bytes (elements 0..16 from
/// the low nibbles, 16..32 from the high ones, as GGML packs them).
///
/// # Safety
/// `p` must be valid for reading 16 bytes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn nibbles(p: *const u8) -> __m256i {
    // SAFETY: the caller's contract.
    let x = unsafe { ld16(p as *const __m128i) };
    let m = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(x, m);
    let hi = _mm_and_si128(_mm_srli_epi16(x, 4), m);
    _mm256_set_m128i(hi, lo)
}

/// 0x10 in byte j where bit j of `qh` is set (Q5's fifth bits).
#[target_feature(enable = "avx2")]
#[inline]
fn fifth_bits(qh: u32) -> __m256i {
    let v = _mm256_set1_epi32(qh as i32);
    let spread = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0,
    );
    let v = _mm256_shuffle_epi8(v, spread);
    let bits = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(v, bits), bits);
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

#[target_feature(enable = "avx2")]
#[inline]
fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
    _mm_cvtsi128_si32(s)
}

/// Four f16 at `p`, `p + stride`, ... as f32.
///
/// # Safety
/// The four 2-byte reads must be in bounds.
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(super) unsafe fn f16x4(p: *const u8, stride: usize) -> __m128 {
    // SAFETY: the caller's contract.
    let r = |i: usize| unsafe { ld_u16(p.wrapping_add(i * stride)) } as i16;
    _mm_cvtph_ps(_mm_set_epi16(0, 0, 0, 0, r(3), r(2), r(1), r(0)))
}

/// The f16 at `p` as f32.
///
/// # Safety
/// `p` must be valid for reading 2 bytes.
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(super) unsafe fn f16x1(p: *const u8) -> f32 {
    // SAFETY: the caller's contract.
    let v = unsafe { ld_u16(p) };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(v as i32)))
}

/// The f16 at `p` and `p + 2` as f32.
///
/// # Safety
/// `p` must be valid for reading 4 bytes.
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(super) unsafe fn f16x2(p: *const u8) -> (f32, f32) {
    // SAFETY: the caller's contract.
    let v = unsafe { ld_u32(p) };
    let f = _mm_cvtph_ps(_mm_cvtsi32_si128(v as i32));
    (_mm_cvtss_f32(f), _mm_cvtss_f32(_mm_shuffle_ps(f, f, 1)))
}

/// A Q4_K/Q5_K block's eight 6-bit scales and eight mins (bytes 4..16),
/// as `scalar::scales_mins_k4` gives them, with 32-bit masks (llama.cpp's
/// `utmp` trick) instead of byte by byte.
///
/// # Safety
/// `p` must point at a whole block.
#[inline(always)]
pub(super) unsafe fn scales_mins_k4(p: *const u8) -> ([u8; 8], [u8; 8]) {
    const K1: u32 = 0x3f3f_3f3f;
    const K2: u32 = 0x0f0f_0f0f;
    const K3: u32 = 0x0303_0303;
    // SAFETY: the caller's contract (bytes 4..16 are the scales).
    let u = unsafe {
        [
            ld_u32(p.wrapping_add(4)),
            ld_u32(p.wrapping_add(8)),
            ld_u32(p.wrapping_add(12)),
        ]
    };
    // Scales: bytes j < 4 are u[0]'s low 6 bits; j >= 4 are u[2]'s low
    // nibbles with u[0]'s top 2 bits above them. Mins likewise from u[1].
    let sc_lo = u[0] & K1;
    let sc_hi = (u[2] & K2) | (((u[0] >> 6) & K3) << 4);
    let mn_lo = u[1] & K1;
    let mn_hi = ((u[2] >> 4) & K2) | (((u[1] >> 6) & K3) << 4);
    let join = |lo: u32, hi: u32| (lo as u64 | (hi as u64) << 32).to_le_bytes();
    (join(sc_lo, sc_hi), join(mn_lo, mn_hi))
}

/// The eight mins of a Q4_K/Q5_K block as i16 pairs `(m0, m0, m1, m1,
/// ...)`, lined up with an activation block's 16 sums (made once per block
/// for every activation row).
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn min_pairs(mins: &[u8; 8]) -> __m256i {
    let m = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(i64::from_le_bytes(*mins)));
    _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m))
}

/// `Σ_j mins[j] · (bsums[2j] + bsums[2j+1])` (Q4_K/Q5_K's min term), with
/// the mins from [`min_pairs`].
///
/// # Safety
/// `bsums` must be valid for reading 16 i16.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn imin_k(pairs: __m256i, bsums: *const i16) -> i32 {
    // SAFETY: the caller's contract.
    let bs = unsafe { ld32(bsums as *const __m256i) };
    hsum_i32(_mm256_madd_epi16(bs, pairs))
}

/// Bits `s..s + 2` of each byte of `qh`, moved to bits 4..6 (Q6_K's
/// high bits).
#[target_feature(enable = "avx2")]
#[inline]
fn q6_high(qh: __m256i, s: i32) -> __m256i {
    let v = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(s));
    _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi8(0x03)), 4)
}

/// The K-quants' row kernels (AVX2 only: on AVX-512 they are `zmm.rs`'s).
macro_rules! k_quant_kernels {
    (k_quants, $features:literal, $dot:ident) => {
        /// Q4_K (`Q5 == false`) or Q5_K: one weight row with `R`
        /// activation rows, each super-block unpacked once.
        ///
        /// # Safety
        /// `w` must hold whole super-blocks, every `a[r]` a Q8_K row
        /// with as many; the CPU must have `$features`.
        #[target_feature(enable = $features)]
        pub(in crate::cpu::quant) unsafe fn dot_q45_k<const Q5: bool, const R: usize>(
            w: &[u8],
            a: &[ActRow<'_>; R],
        ) -> [f32; R] {
            let bb = if Q5 { 176 } else { 144 };
            let qs_off = if Q5 { 48 } else { 16 };
            let m4 = _mm256_set1_epi8(0x0F);
            let nb = w.len() / bb;
            // Each row's arrays, hoisted out of the block loop.
            let qa: [*const i8; R] = std::array::from_fn(|r| a[r].qs.as_ptr());
            let bsums: [*const i16; R] = std::array::from_fn(|r| a[r].bsums.as_ptr());
            let da: [*const f32; R] = std::array::from_fn(|r| a[r].d.as_ptr());
            let mut total = [0f32; R];
            for b in 0..nb {
                let mut acc = [_mm256_setzero_si256(); R];
                // SAFETY: block b < nb is inside `w`, and every row has
                // nb blocks of 256 quants, 16 sums and one scale (the
                // caller's contract).
                unsafe {
                    let p = w.as_ptr().wrapping_add(b * bb);
                    if R == 1 {
                        // One row: decode, its weights streaming.
                        prefetch_ahead(p, bb);
                    }
                    let (scales, mins) = scales_mins_k4(p);
                    let qh = if Q5 {
                        ld32(p.wrapping_add(16) as *const __m256i)
                    } else {
                        _mm256_setzero_si256()
                    };
                    for c in 0..4 {
                        let x = ld32(p.wrapping_add(qs_off + 32 * c) as *const __m256i);
                        let mut lo = _mm256_and_si256(x, m4);
                        let mut hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
                        if Q5 {
                            let sixteen = _mm256_set1_epi8(0x10);
                            let b1 = _mm256_set1_epi8((1u8 << (2 * c)) as i8);
                            let b2 = _mm256_set1_epi8((2u8 << (2 * c)) as i8);
                            let h1 = _mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1);
                            let h2 = _mm256_cmpeq_epi8(_mm256_and_si256(qh, b2), b2);
                            lo = _mm256_or_si256(lo, _mm256_and_si256(h1, sixteen));
                            hi = _mm256_or_si256(hi, _mm256_and_si256(h2, sixteen));
                        }
                        let s1 = _mm256_set1_epi32(scales[2 * c] as i32);
                        let s2 = _mm256_set1_epi32(scales[2 * c + 1] as i32);
                        for r in 0..R {
                            let q = qa[r].wrapping_add(256 * b + 64 * c);
                            let a_lo = ld32(q as *const __m256i);
                            let a_hi = ld32(q.wrapping_add(32) as *const __m256i);
                            let d1 = _mm256_mullo_epi32($dot(lo, a_lo), s1);
                            let d2 = _mm256_mullo_epi32($dot(hi, a_hi), s2);
                            acc[r] = _mm256_add_epi32(acc[r], _mm256_add_epi32(d1, d2));
                        }
                    }
                    let (dw, dmin) = f16x2(p);
                    let pairs = min_pairs(&mins);
                    for r in 0..R {
                        let imin = imin_k(pairs, bsums[r].wrapping_add(16 * b));
                        let isum = hsum_i32(acc[r]);
                        total[r] += scalar::term_k(*da[r].wrapping_add(b), dw, dmin, isum, imin);
                    }
                }
            }
            total
        }

        /// Q6_K: one weight row with `R` activation rows.
        ///
        /// # Safety
        /// As [`dot_q45_k`].
        #[target_feature(enable = $features)]
        pub(in crate::cpu::quant) unsafe fn dot_q6_k<const R: usize>(
            w: &[u8],
            a: &[ActRow<'_>; R],
        ) -> [f32; R] {
            let m4 = _mm256_set1_epi8(0x0F);
            let qa: [*const i8; R] = std::array::from_fn(|r| a[r].qs.as_ptr());
            let bsums: [*const i16; R] = std::array::from_fn(|r| a[r].bsums.as_ptr());
            let da: [*const f32; R] = std::array::from_fn(|r| a[r].d.as_ptr());
            let mut total = [0f32; R];
            for (b, wb) in w.chunks_exact(210).enumerate() {
                let mut acc = [_mm256_setzero_si256(); R];
                // SAFETY: as in `dot_q45_k`; the 16 scales are at 192 and
                // `d` at 208 in the block.
                unsafe {
                    let p = wb.as_ptr();
                    if R == 1 {
                        // One row: decode, its weights streaming.
                        prefetch_ahead(p, 210);
                    }
                    for h in 0..2 {
                        // Scales 8h..8h+8 as i32; pair (2k, 2k + 1) goes to
                        // the low and high four lanes with one permute.
                        let sc8 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                            p.wrapping_add(192 + 8 * h) as *const __m128i,
                        ));
                        let ql0 = ld32(p.wrapping_add(64 * h) as *const __m256i);
                        let ql1 = ld32(p.wrapping_add(64 * h + 32) as *const __m256i);
                        let qh = ld32(p.wrapping_add(128 + 32 * h) as *const __m256i);
                        let q = [
                            _mm256_or_si256(_mm256_and_si256(ql0, m4), q6_high(qh, 0)),
                            _mm256_or_si256(_mm256_and_si256(ql1, m4), q6_high(qh, 2)),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                                q6_high(qh, 4),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                q6_high(qh, 6),
                            ),
                        ];
                        for (k, qk) in q.into_iter().enumerate() {
                            let (lo, hi) = (2 * k as i32, 2 * k as i32 + 1);
                            let s = _mm256_permutevar8x32_epi32(
                                sc8,
                                _mm256_set_epi32(hi, hi, hi, hi, lo, lo, lo, lo),
                            );
                            for r in 0..R {
                                let q = qa[r].wrapping_add(256 * b + 128 * h + 32 * k);
                                let av = ld32(q as *const __m256i);
                                acc[r] =
                                    _mm256_add_epi32(acc[r], _mm256_mullo_epi32($dot(qk, av), s));
                            }
                        }
                    }
                    // Σ sc·(q − 32)·a = Σ sc·q·a − 32 Σ_j sc_j · bsum_j.
                    let scv = _mm256_cvtepi8_epi16(ld16(p.wrapping_add(192) as *const __m128i));
                    let dw = f16x1(p.wrapping_add(208));
                    for r in 0..R {
                        let bs = ld32(bsums[r].wrapping_add(16 * b) as *const __m256i);
                        let off = hsum_i32(_mm256_madd_epi16(scv, bs));
                        let isum = hsum_i32(acc[r]).wrapping_sub(off.wrapping_mul(32));
                        total[r] += scalar::term_q6_k(*da[r].wrapping_add(b), dw, isum);
                    }
                }
            }
            total
        }
    };
}

macro_rules! kernels {
    ($name:ident, $features:literal, $dot:ident $(, $k_quants:ident)?) => {
        pub(super) mod $name {
            use std::arch::x86_64::*;

            use super::super::act::ActRow;
            use super::super::scalar;
            use super::*;

            /// One block's weights, unpacked once for every activation row:
            /// unsigned quants, or (Q8_0, IQ4_NL) the signed ones.
            ///
            /// # Safety
            /// `p` must point at a whole block.
            #[target_feature(enable = $features)]
            #[inline]
            unsafe fn unpack<const T: u8>(p: *const u8) -> __m256i {
                // SAFETY: the caller's contract; offsets are inside the
                // block (see `metrale_core::quant`'s layouts).
                unsafe {
                    match T {
                        Q8_0 => ld32(p.wrapping_add(2) as *const __m256i),
                        IQ4_NL => {
                            let table =
                                ld16(metrale_core::quant::KVALUES_IQ4NL.as_ptr() as *const __m128i);
                            let t = _mm256_set_m128i(table, table);
                            _mm256_shuffle_epi8(t, nibbles(p.wrapping_add(2)))
                        }
                        Q4_0 => nibbles(p.wrapping_add(2)),
                        Q4_1 => nibbles(p.wrapping_add(4)),
                        Q5_0 => _mm256_or_si256(
                            nibbles(p.wrapping_add(6)),
                            fifth_bits(ld_u32(p.wrapping_add(2))),
                        ),
                        _ => _mm256_or_si256(
                            nibbles(p.wrapping_add(8)),
                            fifth_bits(ld_u32(p.wrapping_add(4))),
                        ),
                    }
                }
            }

            /// The eight-lane products of an unpacked block with 32
            /// activation quants at `a`.
            ///
            /// # Safety
            /// `a` must be valid for reading 32 bytes.
            #[target_feature(enable = $features)]
            #[inline]
            unsafe fn mul<const T: u8>(w: __m256i, a: *const i8) -> __m256i {
                // SAFETY: the caller's contract.
                let av = unsafe { ld32(a as *const __m256i) };
                if T == Q8_0 || T == IQ4_NL {
                    $dot(_mm256_abs_epi8(w), _mm256_sign_epi8(av, w))
                } else {
                    $dot(w, av)
                }
            }

            /// A 32-element format's dot products of one weight row with
            /// `R` activation rows (`scalar.rs`'s order for each, so a
            /// row's result does not depend on `R`): each block is read and
            /// unpacked once for all of them.
            ///
            /// # Safety
            /// `w` must hold whole blocks of format `T`, and every `a[r]` a
            /// Q8_0 row with as many blocks. The CPU must have `$features`.
            #[target_feature(enable = $features)]
            pub(in crate::cpu::quant) unsafe fn dot32<const T: u8, const R: usize>(
                ty: metrale_core::GgmlType,
                w: &[u8],
                a: &[ActRow<'_>; R],
            ) -> [f32; R] {
                let bb = block_bytes(T);
                debug_assert_eq!(bb, ty.block_bytes());
                let nb = w.len() / bb;
                let groups = nb / 4;
                let mut acc = [_mm_setzero_ps(); R];
                let wp = w.as_ptr();
                // Each row's arrays, hoisted out of the block loop.
                let qa: [*const i8; R] = std::array::from_fn(|r| a[r].qs.as_ptr());
                let da: [*const f32; R] = std::array::from_fn(|r| a[r].d.as_ptr());
                for g in 0..groups {
                    let b = 4 * g;
                    // SAFETY: blocks b..b+4 < nb are inside `w`, and every
                    // `a[r]` has nb blocks (the caller's contract).
                    unsafe {
                        let p = wp.wrapping_add(b * bb);
                        if R == 1 {
                            // One row: decode, its weights streaming.
                            prefetch_ahead(p, 4 * bb);
                        }
                        let u = [
                            unpack::<T>(p),
                            unpack::<T>(p.wrapping_add(bb)),
                            unpack::<T>(p.wrapping_add(2 * bb)),
                            unpack::<T>(p.wrapping_add(3 * bb)),
                        ];
                        let dw = f16x4(p, bb);
                        let mw = if T == Q4_1 || T == Q5_1 {
                            f16x4(p.wrapping_add(2), bb)
                        } else {
                            _mm_setzero_ps()
                        };
                        for r in 0..R {
                            let q = qa[r].wrapping_add(32 * b);
                            let h = _mm256_hadd_epi32(
                                _mm256_hadd_epi32(
                                    mul::<T>(u[0], q),
                                    mul::<T>(u[1], q.wrapping_add(32)),
                                ),
                                _mm256_hadd_epi32(
                                    mul::<T>(u[2], q.wrapping_add(64)),
                                    mul::<T>(u[3], q.wrapping_add(96)),
                                ),
                            );
                            let mut sums = _mm_add_epi32(
                                _mm256_castsi256_si128(h),
                                _mm256_extracti128_si256(h, 1),
                            );
                            if T == Q4_0 || T == Q5_0 {
                                let s = ld16(a[r].sum.as_ptr().wrapping_add(b) as *const __m128i);
                                let shift = if T == Q4_0 { 3 } else { 4 };
                                sums =
                                    _mm_sub_epi32(sums, _mm_sll_epi32(s, _mm_cvtsi32_si128(shift)));
                            }
                            let dd = _mm_mul_ps(dw, _mm_loadu_ps(da[r].wrapping_add(b)));
                            let mut t = _mm_mul_ps(_mm_cvtepi32_ps(sums), dd);
                            if T == Q4_1 || T == Q5_1 {
                                let ms =
                                    _mm_mul_ps(mw, _mm_loadu_ps(a[r].s.as_ptr().wrapping_add(b)));
                                t = _mm_add_ps(t, ms);
                            }
                            acc[r] = _mm_add_ps(acc[r], t);
                        }
                    }
                }
                let mut out = [0f32; R];
                for r in 0..R {
                    let mut lanes = [0f32; 4];
                    // SAFETY: `lanes` holds four f32.
                    unsafe { _mm_storeu_ps(lanes.as_mut_ptr(), acc[r]) };
                    if 4 * groups < nb {
                        scalar::accumulate32(ty, w, a[r], 4 * groups, &mut lanes);
                    }
                    out[r] = scalar::finish4(lanes);
                }
                out
            }

            $(k_quant_kernels!($k_quants, $features, $dot);)?
        }
    };
}

kernels!(avx2, "avx2,f16c", dot_avx2, k_quants);
kernels!(vnni, "avx2,f16c,avx512f,avx512vl,avx512vnni", dot_vnni);
