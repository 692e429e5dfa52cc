//! The AVX-512 kernels of the bf16 GEMM: packing, activation rounding and
//! the micro-tile.

use std::arch::x86_64::*;

use super::{FMA_MR, Lookahead, MR, NR};

/// Packs NR full rows of `kp` pairs each (`rows`, row-major bf16) into
/// `panel[p * NR + r]`: 16×16 blocks of pairs transposed in registers
/// (four butterfly stages of two-source permutes), the last `kp % 16`
/// pair indices by gathers.
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn pack_full(rows: &[half::bf16], kp: usize, panel: &mut [u32]) {
    assert!(rows.len() == NR * kp * 2 && panel.len() >= kp * NR);
    let base = rows.as_ptr().cast::<u32>();
    // Stage `b` swaps bit `b` of the row index with bit `b` of the lane:
    // lane j of the low row takes the high row's lane j - b where j has
    // bit b set; lane j of the high row takes the low row's lane j + b
    // where j has it clear.
    let stages: [(usize, __m512i, __m512i); 4] = [8, 4, 2, 1].map(|b| {
        let mut lo = [0i32; 16];
        let mut hi = [0i32; 16];
        for j in 0..16 {
            (lo[j], hi[j]) = if j & b == 0 {
                (j as i32, (j + b) as i32)
            } else {
                ((16 + j - b) as i32, (16 + j) as i32)
            };
        }
        // SAFETY: 16 i32 are 64 bytes; unaligned loads.
        unsafe {
            (
                b,
                _mm512_loadu_si512(lo.as_ptr().cast()),
                _mm512_loadu_si512(hi.as_ptr().cast()),
            )
        }
    });
    let blocks = kp / 16;
    for half in 0..NR / 16 {
        for blk in 0..blocks {
            let p0 = blk * 16;
            // SAFETY: rows `half * 16 + r < NR` hold `kp` pairs from
            // `base + row * kp`; pairs `p0..p0 + 16 <= kp`; the stores
            // write `panel[(p0 + i) * NR + half * 16..][..16]`, inside
            // `kp * NR`. Unaligned loads and stores.
            unsafe {
                let mut v = [_mm512_setzero_si512(); 16];
                for (r, v) in v.iter_mut().enumerate() {
                    let row = base.add((half * 16 + r) * kp + p0);
                    *v = _mm512_loadu_si512(row.cast());
                }
                for &(b, lo, hi) in &stages {
                    for i in (0..16).filter(|i| i & b == 0) {
                        let (a, c) = (v[i], v[i + b]);
                        v[i] = _mm512_permutex2var_epi32(a, lo, c);
                        v[i + b] = _mm512_permutex2var_epi32(a, hi, c);
                    }
                }
                for (i, v) in v.iter().enumerate() {
                    let dst = panel.as_mut_ptr().add((p0 + i) * NR + half * 16);
                    _mm512_storeu_si512(dst.cast(), *v);
                }
            }
        }
    }
    let idx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(kp as i32),
    );
    let bytes = rows.as_ptr().cast::<u8>();
    for p in blocks * 16..kp {
        // SAFETY: pair `p` of row `r` is the 4 bytes at `(r * kp + p) * 4`,
        // inside `rows` for `r < NR`, `p < kp`; gathers and stores unaligned.
        unsafe {
            let lo = _mm512_i32gather_epi32::<4>(idx, bytes.add(p * 4).cast());
            let hi = _mm512_i32gather_epi32::<4>(idx, bytes.add((16 * kp + p) * 4).cast());
            _mm512_storeu_si512(panel.as_mut_ptr().add(p * NR).cast(), lo);
            _mm512_storeu_si512(panel.as_mut_ptr().add(p * NR + 16).cast(), hi);
        }
    }
}

/// bf16 pairs of `src` (a multiple of 32 long) into `dst` (half as long).
///
/// # Safety
/// The CPU must support AVX-512F and AVX512-BF16.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn to_pairs(src: &[f32], dst: &mut [u32]) {
    assert!(src.len().is_multiple_of(32) && dst.len() * 2 == src.len());
    for c in (0..src.len()).step_by(32) {
        // SAFETY: `c + 32 <= src.len()` and `c / 2 + 16 <= dst.len()`.
        unsafe {
            let lo = _mm512_loadu_ps(src.as_ptr().add(c));
            let hi = _mm512_loadu_ps(src.as_ptr().add(c + 16));
            // Lanes 0..16 from the second operand, 16..32 from the first.
            let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(dst.as_mut_ptr().add(c / 2).cast(), v);
        }
    }
}

/// `tile[r][c] = Σ_p dot2(a[r * kp + p], panel[p * stride + c])` for
/// `r < R`, `c < NR`: each output one accumulator lane, fed pair `p` after
/// pair `p - 1` whatever `R` is, so a row's sums do not depend on how many
/// rows share the tile. `FULL`: `stride == NR`, plain loads; otherwise the
/// panel is `stride < NR` wide and its missing columns load as zeros.
///
/// # Safety
/// The CPU must support AVX-512F and AVX512-BF16; `a` holds `R * kp`
/// pairs and `panel` `kp * stride`, `stride <= NR`.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn tile<const R: usize, const FULL: bool>(
    a: &[u32],
    panel: &[u32],
    kp: usize,
    stride: usize,
    tile: &mut [[f32; NR]],
) {
    assert!(
        R <= MR
            && tile.len() >= R
            && a.len() >= R * kp
            && panel.len() >= kp * stride
            && stride <= NR
    );
    assert!(!FULL || stride == NR);
    let m0: __mmask16 = if stride >= 16 {
        0xffff
    } else {
        (1u16 << stride) - 1
    };
    let m1: __mmask16 = if stride >= NR {
        0xffff
    } else if stride > 16 {
        (1u16 << (stride - 16)) - 1
    } else {
        0
    };
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    for p in 0..kp {
        // SAFETY: `p * stride + stride <= kp * stride` and `r * kp + p <
        // R * kp` (asserted above); the masked loads read only the lanes
        // below `stride` (inside the panel), the plain ones `NR == stride`.
        unsafe {
            let at = panel.as_ptr().add(p * stride);
            let (b0, b1): (__m512bh, __m512bh) = if FULL {
                (
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(at.cast())),
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(at.add(16).cast())),
                )
            } else {
                (
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_maskz_loadu_epi32(
                        m0,
                        at.cast(),
                    )),
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_maskz_loadu_epi32(
                        m1,
                        at.add(16).cast(),
                    )),
                )
            };
            for (r, acc) in acc.iter_mut().enumerate() {
                let av: __m512bh =
                    std::mem::transmute(_mm512_set1_epi32(*a.get_unchecked(r * kp + p) as i32));
                acc[0] = _mm512_dpbf16_ps(acc[0], av, b0);
                acc[1] = _mm512_dpbf16_ps(acc[1], av, b1);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: each row of `tile` holds NR = 32 f32.
        unsafe {
            _mm512_storeu_ps(tile[r].as_mut_ptr(), acc[0]);
            _mm512_storeu_ps(tile[r].as_mut_ptr().add(16), acc[1]);
        }
    }
}

/// [`tile`] with f32 FMAs: `tile[r][c] = Σ_e x[r * k + e] · w_c[e]` for
/// `r < R`, `c < NR`, each bf16 weight widened exactly to f32 (a bf16 is
/// an f32's top half: the pair's low element shifted up, its high element
/// masked) and each activation as it is.
///
/// Each output is the sum of two accumulator lanes, one fed the even
/// elements 0, 2, ... in order, one the odd ones, one FMA each: the same
/// operations whatever `R` is, so a row's sums do not depend on the rows
/// beside it. Two chains, not one, so that a lone row (decode) does not
/// wait on the FMA's latency. Both chains run in one pass over the panel:
/// up to [`FMA_MR`] rows of four accumulators, 24 of the 32 vector
/// registers. `FULL` and `stride` as for [`tile`]; an odd `k`'s
/// last pair has no high element to read.
///
/// `ahead` is told of every step over the panel (one pair of every row),
/// on which it prefetches its share of the next panel a decode step will
/// multiply (see [`Lookahead`]).
///
/// # Safety
/// The CPU must support AVX-512F; `x` holds `R * k` floats, `panel`
/// `k.div_ceil(2) * stride` with `stride <= NR`, and `tile` `R` rows.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn tile_fma<const R: usize, const FULL: bool>(
    x: &[f32],
    k: usize,
    panel: &[u32],
    stride: usize,
    ahead: &mut Lookahead<'_>,
    tile: &mut [[f32; NR]],
) {
    let kp = k.div_ceil(2);
    assert!(R <= FMA_MR && tile.len() >= R && x.len() >= R * k);
    assert!(panel.len() >= kp * stride && stride <= NR && (!FULL || stride == NR));
    let w = Pairs { panel, stride };
    let x = Rows { x, k };
    let mut even = [[_mm512_setzero_ps(); 2]; R];
    let mut odd = [[_mm512_setzero_ps(); 2]; R];
    // A local copy, whose counters stay in registers through the loop
    // (through the `&mut` they were stored every step: with the general
    // loop of `Lookahead::step`, a lone row's decode lost about 7%).
    let mut next = *ahead;
    // SAFETY (both calls): pairs `p < kp` of the panel, elements `2p` (and
    // `2p + 1` for whole pairs, `< k`) of every row, inside the operands
    // (asserted above).
    for p in 0..k / 2 {
        next.step();
        unsafe { fma_step::<R, FULL, true>(x, w, p, &mut even, &mut odd) };
    }
    if k % 2 == 1 {
        next.step();
        unsafe { fma_step::<R, FULL, false>(x, w, k / 2, &mut even, &mut odd) };
    }
    *ahead = next;
    for (r, ([e0, e1], [o0, o1])) in even.into_iter().zip(odd).enumerate() {
        // SAFETY: each row of `tile` holds NR = 32 f32.
        unsafe {
            _mm512_storeu_ps(tile[r].as_mut_ptr(), _mm512_add_ps(e0, o0));
            _mm512_storeu_ps(tile[r].as_mut_ptr().add(16), _mm512_add_ps(e1, o1));
        }
    }
}

/// A panel of bf16 pairs, `stride` columns wide.
#[derive(Clone, Copy)]
struct Pairs<'a> {
    panel: &'a [u32],
    stride: usize,
}

/// Activation rows of `k` floats.
#[derive(Clone, Copy)]
struct Rows<'a> {
    x: &'a [f32],
    k: usize,
}

/// Pair `p`'s two vectors of columns 0..16 and 16..32 (zeros past
/// `stride`), as loaded.
///
/// # Safety
/// AVX-512F; `p < k.div_ceil(2)`, the panel holding `kp * stride` pairs.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn load_pair<const FULL: bool>(w: Pairs<'_>, p: usize) -> [__m512i; 2] {
    let lanes = |from: usize| -> __mmask16 {
        match w.stride.saturating_sub(from) {
            0 => 0,
            s if s >= 16 => 0xffff,
            s => (1u16 << s) - 1,
        }
    };
    // SAFETY: the caller's contract; the masked loads read only the lanes
    // below `stride`, the plain ones `NR == stride`.
    unsafe {
        let at = w.panel.as_ptr().add(p * w.stride);
        if FULL {
            [
                _mm512_loadu_si512(at.cast()),
                _mm512_loadu_si512(at.add(16).cast()),
            ]
        } else {
            [
                _mm512_maskz_loadu_epi32(lanes(0), at.cast()),
                _mm512_maskz_loadu_epi32(lanes(16), at.add(16).cast()),
            ]
        }
    }
}

/// The pair's even (low) elements widened.
#[target_feature(enable = "avx512f")]
#[inline]
fn low(b: __m512i) -> __m512 {
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(b))
}

/// The pair's odd (high) elements widened.
#[target_feature(enable = "avx512f")]
#[inline]
fn high(b: __m512i) -> __m512 {
    _mm512_castsi512_ps(_mm512_and_si512(
        b,
        _mm512_set1_epi32(0xffff_0000_u32 as i32),
    ))
}

/// `acc[r] += x[r][2p] · even(p)` and (`WHOLE`) `odd[r] += x[r][2p + 1] ·
/// odd(p)` for every row: one step of [`tile_fma`]'s pass.
///
/// # Safety
/// As [`tile_fma`], with `p < k.div_ceil(2)`, and `2p + 1 < k` if `WHOLE`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn fma_step<const R: usize, const FULL: bool, const WHOLE: bool>(
    x: Rows<'_>,
    w: Pairs<'_>,
    p: usize,
    acc: &mut [[__m512; 2]; R],
    odd: &mut [[__m512; 2]; R],
) {
    // SAFETY: the caller's contract: pair `p` is inside the panel, and
    // elements `2p` (and `2p + 1`) of the `R` rows inside `x`.
    unsafe {
        let [b0, b1] = load_pair::<FULL>(w, p);
        let (e0, e1, o0, o1) = (low(b0), low(b1), high(b0), high(b1));
        for r in 0..R {
            let xr = x.x.as_ptr().add(r * x.k + 2 * p);
            let xe = _mm512_set1_ps(*xr);
            acc[r][0] = _mm512_fmadd_ps(xe, e0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xe, e1, acc[r][1]);
            if WHOLE {
                let xo = _mm512_set1_ps(*xr.add(1));
                odd[r][0] = _mm512_fmadd_ps(xo, o0, odd[r][0]);
                odd[r][1] = _mm512_fmadd_ps(xo, o1, odd[r][1]);
            }
        }
    }
}
