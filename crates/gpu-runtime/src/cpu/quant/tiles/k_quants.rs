//! Q4_K, Q5_K and Q6_K on the tiles: super-blocks of 256 quants in
//! sub-blocks of 32 (Q4_K, Q5_K: eight, 6-bit scales and mins) or 16
//! (Q6_K: sixteen, i8 scales).
//!
//! A super-block's integer sum `isum = Σ_j sc_j · Σ_{i in j} q_i·a_i` is
//! taken by the tiles whole, the sub-block scales folded into the
//! weights: each scale is split into base-8 digits (Q4_K's and Q5_K's
//! `0..64` into two in `0..8`; Q6_K's `-128..128` into three in `-3..=4`),
//! and pass `p` multiplies `q_i · digit_p(sc_j)` (at most 105, or 217
//! for Q5_K, as unsigned bytes: `tdpbusd`; -128..=124 for Q6_K's `q −
//! 32`: `tdpbssd`) by the activations over all 256 quants, four tile
//! products of 64. `isum = Σ_p 8^p · sum_p`, exact in i32. So a
//! super-block stores two or three tiles of sums per 16 weight rows, where
//! one tile per sub-block took eight or sixteen, and the vector work is a
//! few shifts and adds per row, not a multiply per sub-block.
//!
//! Per call, each super-block of a panel's rows is unpacked into the
//! passes' quants (one `vpshufb` of a digit's table per 32 quants) and
//! every group of activation rows takes it in turn, each group's sums
//! stored while the previous group's are read; each super-block's term is
//! made in f32 as `scalar.rs` makes it, into one accumulator per row in
//! block order: Q4_K `(d_a · d)·isum − (d_a · dmin)·imin` with `imin =
//! Σ_j min_j · Σ a` from the activations' sums, Q6_K `(d_a · d)·isum`.
//!
//! Tried: one tile of sums per sub-block, scaled by `vpmulld` (the tile
//! stores and the multiplies bound it: Q6_K at 512 rows 1.24x the VNNI
//! panels, against 1.6-1.8x now; at 16 rows it was the faster, 1.35x
//! against 1.0-1.15x, its unpacking lighter).

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;

use metrale_core::GgmlType;

use super::super::act::ActRow;
use super::super::matrix::QuantMatrix;
use super::super::run_tasks;
use super::super::scalar::{f16_at, scales_mins_k4};
use super::{AR, WR, regroup, share};
use crate::cpu::amx_os;
use crate::cpu::team::{OutPtr, Team};

/// Most passes (Q6_K's three digits).
const PASSES: usize = 3;

/// What differs between the two formats.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Format {
    Q4K,
    Q5K,
    Q6K,
}

impl Format {
    /// Digits of a sub-block scale: tile passes per super-block.
    fn passes(self) -> usize {
        match self {
            Format::Q4K | Format::Q5K => 2,
            Format::Q6K => 3,
        }
    }

    /// Whether the format has mins (a `dmin · imin` term).
    fn mins(self) -> bool {
        self != Format::Q6K
    }
}

/// One super-block of a panel's rows, unpacked: per pass `p` and row `r`,
/// the 256 quants times their sub-blocks' digit `p` at `(p · WR + r) ·
/// 256`; per row `d` and (Q4_K) `dmin`, and the mins as i16 pairs
/// `(min_2p, min_2p+1)` at `p · WR + r`. A pass of 32 rows is 8 KiB: the
/// super-block stays in L1 while every group's tiles pass it (two
/// super-blocks at a time, 48 KiB, were read from L2 at half the speed).
#[derive(Default)]
struct Unpacked {
    quants: Vec<i8>,
    mins: Vec<i32>,
    d: Vec<f32>,
    dmin: Vec<f32>,
}

/// Per weight row of a panel, its accumulator (activation rows in the
/// lanes).
type Acc = [__m512; WR];

/// One super-block's sums as stored: per pass, per half of the panel, 16
/// weight rows of 16 activation rows.
#[repr(C, align(64))]
struct BlockSums([[[[i32; AR]; 16]; 2]; PASSES]);

thread_local! {
    /// The activations regrouped for the B tiles (quants; per super-block
    /// the scales, and Q4_K's sums of 32 as i16 pairs), on the calling
    /// thread, reused.
    static ACTS: RefCell<(Vec<u32>, Vec<f32>, Vec<i32>)> =
        const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
    /// A panel's unpacked super-block and its accumulators per group, per
    /// pool thread.
    static PANEL: RefCell<(Unpacked, Vec<Acc>)> = RefCell::new((Unpacked::default(), Vec::new()));
}

/// The tile shapes: sums 0-5 (two halves of up to three passes), weights
/// 6 and activations 7, all 16 rows of 64 bytes.
fn config() -> amx_os::Config {
    amx_os::Config::new([(16, 64); 8])
}

/// [`super::matmul`] for Q4_K, Q5_K and Q6_K weights, either layout.
pub(super) fn matmul(
    team: Option<&Team>,
    w: QuantMatrix<'_>,
    acts: &[ActRow<'_>],
    out: &mut [f32],
) -> usize {
    let f = match w.ty() {
        GgmlType::Q4K => Format::Q4K,
        GgmlType::Q5K => Format::Q5K,
        _ => Format::Q6K,
    };
    let (n, nsb, m) = (w.rows(), w.cols() / 256, acts.len());
    let (panels, groups) = (n / WR, m.div_ceil(AR));
    let share = share(team, &w, m);
    let ptr = OutPtr::new(out);
    let pair_words = if f.mins() { 4 * AR } else { 0 };
    ACTS.with_borrow_mut(|(q, fw, iw)| {
        let scales = |rows: &[ActRow<'_>], fw: &mut [f32], iw: &mut [i32]| {
            for (t, a) in rows.iter().enumerate() {
                for s in 0..nsb {
                    fw[s * AR + t] = a.d[s];
                    for p in 0..pair_words / AR {
                        let b = &a.bsums[16 * s + 4 * p..][..4];
                        let (lo, hi) = (b[0] + b[1], b[2] + b[3]);
                        iw[(s * 4 + p) * AR + t] = (lo as u16 as i32) | ((hi as i32) << 16);
                    }
                }
            }
        };
        regroup(
            team,
            acts,
            64,
            q,
            (fw, nsb * AR),
            (iw, nsb * pair_words),
            &scales,
        );
        let (q, fw, iw) = (&*q, &*fw, &*iw);
        let run = |t: usize| {
            let (p0, p1) = (t * share, ((t + 1) * share).min(panels));
            // SAFETY: `takes` found AMX-INT8 available; `config`'s shapes
            // are 16 rows of 64 bytes.
            let _tiles = unsafe { amx_os::Tiles::configure(&config()) };
            let mut sums = Box::new([
                BlockSums([[[[0; AR]; 16]; 2]; PASSES]),
                BlockSums([[[[0; AR]; 16]; 2]; PASSES]),
            ]);
            PANEL.with_borrow_mut(|(un, accs)| {
                for p in p0..p1 {
                    let j0 = p * WR;
                    if p + 1 < p1 {
                        // The next panel into L2 while this one is worked
                        // (as `q8_0.rs` does).
                        super::prefetch_l2(w.span_of_rows(j0 + WR, WR));
                    }
                    accs.clear();
                    // SAFETY: all-zero bits are f32 zeros.
                    accs.resize(groups, unsafe { std::mem::zeroed() });
                    for sb in 0..nsb {
                        // SAFETY: `takes` means VNNI, so AVX2.
                        unsafe { unpack(f, &w, j0, sb, un) };
                        let group = |g: usize| Group {
                            bq: &q[(g * nsb + sb) * 64 * AR..][..64 * AR],
                            da: &fw[(g * nsb + sb) * AR..][..AR],
                            pairs: &iw[(g * nsb + sb) * pair_words..][..pair_words],
                        };
                        // SAFETY: this thread's tiles hold `config`; `un`
                        // holds the super-block, `group(g)` its share of
                        // every array; AVX-512 F/BW (VNNI).
                        unsafe { groups_pass(f, un, groups, &group, accs, &mut sums) };
                    }
                    for (g, acc) in accs.iter().enumerate() {
                        // SAFETY: a vector of 16 f32 is 16 f32 (any bits
                        // are valid either way). (A store intrinsic here,
                        // outside a function with AVX-512 enabled, was a
                        // call per vector: 5% of a prefill.)
                        let v = unsafe { std::mem::transmute::<Acc, [[f32; AR]; WR]>(*acc) };
                        for i in g * AR..(g * AR + AR).min(m) {
                            let row: [f32; WR] = std::array::from_fn(|r| v[r][i - g * AR]);
                            // SAFETY: `i * n + j0 + WR <= m * n` (`j0 + WR
                            // <= n`); task `t` alone writes the columns of
                            // panels `p0..p1`.
                            unsafe { ptr.write_run(i * n + j0, &row) };
                        }
                    }
                }
            });
        };
        run_tasks(team, panels.div_ceil(share), &run);
    });
    panels * WR
}

/// Base-8 digits of a Q6_K scale, each in `-3..=4` (so that `(q − 32) ·
/// digit` is a byte): `sc = d0 + 8·d1 + 64·d2`.
fn digits_q6_k(sc: i32) -> [i32; 3] {
    let d0 = (sc + 3).rem_euclid(8) - 3;
    let r1 = (sc - d0) / 8;
    let d1 = (r1 + 3).rem_euclid(8) - 3;
    [d0, d1, (r1 - d1) / 8]
}

/// `vpshufb` tables: row `i` maps `x` in `0..16` to `x · (lo + i)` (or,
/// with `high`, `y` in `0..4` to `(16y − 32) · (lo + i)`: Q6_K's two high
/// bits and its offset), as bytes.
const fn tables(lo: i32, high: bool) -> [[i8; 16]; 8] {
    let mut t = [[0i8; 16]; 8];
    let mut i = 0;
    while i < 8 {
        let mut x = 0;
        while x < 16 {
            let v = if high {
                (16 * x - 32) * (lo + i as i32)
            } else {
                x * (lo + i as i32)
            };
            if !high || x < 4 {
                t[i][x as usize] = v as i8;
            }
            x += 1;
        }
        i += 1;
    }
    t
}

/// Q4_K's quants times a digit in `0..8` (as unsigned bytes).
const TIMES_Q4: [[i8; 16]; 8] = tables(0, false);
/// Q5_K's fifth bit (`x` in `0..2`) as `16 · x · digit`, a digit in
/// `0..8` (as unsigned bytes).
const TIMES_16: [[i8; 16]; 8] = times_sixteen();

/// [`TIMES_16`].
const fn times_sixteen() -> [[i8; 16]; 8] {
    let mut t = [[0i8; 16]; 8];
    let mut d = 0;
    while d < 8 {
        t[d][1] = (16 * d) as u8 as i8;
        d += 1;
    }
    t
}
/// Q6_K's low four bits, and its high two less the offset, times a digit
/// in `-3..=4` (row `digit + 3`).
const TIMES_Q6_LOW: [[i8; 16]; 8] = tables(-3, false);
const TIMES_Q6_HIGH: [[i8; 16]; 8] = tables(-3, true);

/// Two tables as the two lanes of a `vpshufb` (`lo` the low lane).
///
/// # Safety
/// The CPU has AVX2.
#[inline(always)]
unsafe fn lanes(lo: &[i8; 16], hi: &[i8; 16]) -> __m256i {
    // SAFETY: 16 bytes each; AVX2 (the caller's contract).
    unsafe { _mm256_loadu2_m128i(hi.as_ptr().cast(), lo.as_ptr().cast()) }
}

/// Super-block `sb` of the panel's rows (`j0..j0 + WR` of `w`, read in
/// place in either layout) into `un` (see [`Unpacked`]).
///
/// # Safety
/// The CPU has AVX2.
#[target_feature(enable = "avx2")]
unsafe fn unpack(f: Format, w: &QuantMatrix<'_>, j0: usize, sb: usize, un: &mut Unpacked) {
    un.quants.resize(PASSES * WR * 256, 0);
    un.d.resize(WR, 0.0);
    if f.mins() {
        un.mins.resize(4 * WR, 0);
        un.dmin.resize(WR, 0.0);
    }
    for r in 0..WR {
        let blk = w.block(j0 + r, sb);
        let out: [*mut i8; PASSES] =
            std::array::from_fn(|p| un.quants.as_mut_ptr().wrapping_add((p * WR + r) * 256));
        match f {
            Format::Q4K | Format::Q5K => {
                let (sc, mn) = scales_mins_k4(blk);
                // SAFETY: `blk` is a whole super-block; every pass's 256
                // bytes of row r are inside `un.quants` (sized above); AVX2
                // (this function's).
                unsafe { unpack_q45_k(f == Format::Q5K, blk, &sc, &out) };
                for p in 0..4 {
                    un.mins[p * WR + r] = (mn[2 * p] as i32) | ((mn[2 * p + 1] as i32) << 16);
                }
                un.d[r] = f16_at(blk, 0);
                un.dmin[r] = f16_at(blk, 2);
            }
            Format::Q6K => {
                // SAFETY: as above.
                unsafe { unpack_q6_k(blk, &out) };
                un.d[r] = f16_at(blk, 208);
            }
        }
    }
}

/// A Q4_K or Q5_K super-block's passes, as unsigned bytes: sub-block `j`
/// (the low nibbles of bytes `32·(j/2)..` of the quants for even j, the
/// high for odd; Q5_K's bit j of `qh[l]` as 16 above) times `sc_j % 8` to
/// `out[0] + 32j`, times `sc_j / 8` to `out[1] + 32j`.
///
/// # Safety
/// `blk` is a whole super-block (144 or 176 bytes); 256 bytes from
/// `out[0]` and `out[1]` are writable; AVX2.
#[target_feature(enable = "avx2")]
unsafe fn unpack_q45_k(q5: bool, blk: &[u8], sc: &[u8; 8], out: &[*mut i8; PASSES]) {
    let qs = if q5 { 48 } else { 16 };
    assert!(blk.len() >= qs + 128);
    let (mask, one) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(1));
    // SAFETY (both): AVX2 (this function's).
    let times = |d: u8| unsafe { lanes(&TIMES_Q4[d as usize], &TIMES_Q4[d as usize]) };
    let sixteen = |d: u8| unsafe { lanes(&TIMES_16[d as usize], &TIMES_16[d as usize]) };
    // SAFETY: bytes 16..48 are inside `blk` (a Q5_K block; asserted).
    let qh = q5.then(|| unsafe { _mm256_loadu_si256(blk[16..].as_ptr().cast()) });
    for c in 0..4 {
        // SAFETY: bytes qs + 32c.. + 32 are inside `blk` (asserted); the
        // stores as the caller's contract says.
        unsafe {
            let v = _mm256_loadu_si256(blk[qs + 32 * c..].as_ptr().cast());
            let q = [
                _mm256_and_si256(v, mask),
                _mm256_and_si256(_mm256_srli_epi16(v, 4), mask),
            ];
            for (h, q) in q.into_iter().enumerate() {
                let j = 2 * c + h;
                // Q5_K's fifth bit of each quant, 0 or 1 a byte.
                let high = qh.map(|qh| {
                    let shift = _mm_cvtsi32_si128(j as i32);
                    _mm256_and_si256(_mm256_srl_epi16(qh, shift), one)
                });
                for (p, out) in out.iter().take(2).enumerate() {
                    let digit = if p == 0 { sc[j] % 8 } else { sc[j] / 8 };
                    let mut v = _mm256_shuffle_epi8(times(digit), q);
                    if let Some(high) = high {
                        v = _mm256_add_epi8(v, _mm256_shuffle_epi8(sixteen(digit), high));
                    }
                    _mm256_storeu_si256(out.add(32 * j).cast(), v);
                }
            }
        }
    }
}

/// A Q6_K super-block's passes: element `e = 128h + 32k + l` (the low
/// nibble of `ql[64h + 32(k % 2) + l]` for k < 2, else the high; bits 2k,
/// 2k + 1 of `qh[32h + l]` above it), minus 32, times digit `p` of its
/// sub-block's scale (`e / 16`) to `out[p] + e`.
///
/// # Safety
/// `blk` is 210 bytes; 256 bytes from every `out[p]` are writable; AVX2.
#[target_feature(enable = "avx2")]
unsafe fn unpack_q6_k(blk: &[u8], out: &[*mut i8; PASSES]) {
    assert!(blk.len() >= 210);
    let (mask4, mask2) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(3));
    let digits: [[i32; 3]; 16] = std::array::from_fn(|j| digits_q6_k(blk[192 + j] as i8 as i32));
    for h in 0..2 {
        // SAFETY: bytes 128 + 32h.. + 32 and 64h.. + 64 are inside `blk`
        // (asserted); the stores as the caller's contract says.
        unsafe {
            let qh = _mm256_loadu_si256(blk[128 + 32 * h..].as_ptr().cast());
            for k in 0..4 {
                let ql = _mm256_loadu_si256(blk[64 * h + 32 * (k % 2)..].as_ptr().cast());
                let lo = if k < 2 {
                    _mm256_and_si256(ql, mask4)
                } else {
                    _mm256_and_si256(_mm256_srli_epi16(ql, 4), mask4)
                };
                let shifted = match k {
                    0 => qh,
                    1 => _mm256_srli_epi16(qh, 2),
                    2 => _mm256_srli_epi16(qh, 4),
                    _ => _mm256_srli_epi16(qh, 6),
                };
                let hi = _mm256_and_si256(shifted, mask2);
                // Sub-blocks j (lane 0) and j + 1 (lane 1).
                let j = 8 * h + 2 * k;
                for (p, out) in out.iter().enumerate() {
                    let (d0, d1) = ((digits[j][p] + 3) as usize, (digits[j + 1][p] + 3) as usize);
                    let low = lanes(&TIMES_Q6_LOW[d0], &TIMES_Q6_LOW[d1]);
                    let high = lanes(&TIMES_Q6_HIGH[d0], &TIMES_Q6_HIGH[d1]);
                    let v = _mm256_add_epi8(
                        _mm256_shuffle_epi8(low, lo),
                        _mm256_shuffle_epi8(high, hi),
                    );
                    _mm256_storeu_si256(out.add(128 * h + 32 * k).cast(), v);
                }
            }
        }
    }
}

/// One group's share of a slice: its B tiles, per super-block its rows'
/// scales and (Q4_K) sums of 32 as i16 pairs.
#[derive(Clone, Copy)]
struct Group<'a> {
    bq: &'a [u32],
    da: &'a [f32],
    pairs: &'a [i32],
}

/// Adds the unpacked super-block to every group's accumulators: each
/// group's sums stored while the previous group's, stored a group
/// earlier, are read (a load meeting a tile store in flight waits for it
/// to retire).
///
/// # Safety
/// This thread's tiles hold [`config`]; `un` holds one super-block, every
/// `group(g)` its share of the activations; the CPU has AVX-512 F/BW.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn groups_pass<'a>(
    f: Format,
    un: &Unpacked,
    groups: usize,
    group: &dyn Fn(usize) -> Group<'a>,
    accs: &mut [Acc],
    sums: &mut [BlockSums; 2],
) {
    assert!(un.quants.len() >= PASSES * WR * 256 && un.d.len() >= WR && accs.len() >= groups);
    if f.mins() {
        assert!(un.mins.len() >= 4 * WR && un.dmin.len() >= WR);
    }
    for g in 0..groups + 1 {
        if g < groups {
            let b = group(g).bq;
            assert!(b.len() >= 64 * AR);
            // SAFETY: the super-block's passes and the group's B tiles are
            // inside `un.quants` and `b` (asserted); `sums[g % 2]` is
            // aligned.
            unsafe {
                products(un.quants.as_ptr(), b.as_ptr().cast(), f.passes(), f.mins());
                store(&mut sums[g % 2], f.passes());
            }
        }
        if g > 0 {
            let prev = group(g - 1);
            assert!(prev.da.len() >= AR && prev.pairs.len() >= if f.mins() { 4 * AR } else { 0 });
            // SAFETY: AVX-512 F/BW (this function's); the arrays hold the
            // super-block (asserted).
            unsafe { terms(f, un, prev, &sums[(g - 1) % 2], &mut accs[g - 1]) };
        }
    }
}

/// One super-block's sums into tiles `3h + p` (half `h` of the panel, pass
/// `p`): per 64 quants, the group's B tile (7) times each pass's weights
/// (6, 16 rows of 64 bytes, 256 bytes apart).
///
/// `unsigned`: the weights' bytes are unsigned (`tdpbusd`), else signed
/// (`tdpbssd`).
///
/// # Safety
/// The tiles hold [`config`]; `a` holds the super-block's `PASSES` passes
/// of `WR` rows of 256 bytes, `b` its four B tiles of 1 KiB.
#[inline(always)]
unsafe fn products(a: *const i8, b: *const i8, passes: usize, unsigned: bool) {
    // SAFETY (throughout): the caller's contract; tile zeroing touches no
    // memory.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "tilezero tmm4",
            "tilezero tmm5",
            options(nostack, nomem)
        );
        for kc in 0..4 {
            asm!(
                "tileloadd tmm7, [{b} + {s} * 1]",
                b = in(reg) b.wrapping_add(kc * 64 * AR), s = in(reg) 64usize,
                options(nostack, readonly)
            );
            for h in 0..2 {
                for p in 0..passes {
                    let w = a.wrapping_add(((p * WR) + 16 * h) * 256 + 64 * kc);
                    macro_rules! tdp {
                        ($op:literal, $c:literal) => {
                            asm!(
                                "tileloadd tmm6, [{w} + {s} * 1]",
                                concat!($op, " tmm", $c, ", tmm6, tmm7"),
                                w = in(reg) w, s = in(reg) 256usize,
                                options(nostack, readonly)
                            )
                        };
                    }
                    match (unsigned, 3 * h + p) {
                        (true, 0) => tdp!("tdpbusd", 0),
                        (true, 1) => tdp!("tdpbusd", 1),
                        (true, 3) => tdp!("tdpbusd", 3),
                        (true, _) => tdp!("tdpbusd", 4),
                        (false, 0) => tdp!("tdpbssd", 0),
                        (false, 1) => tdp!("tdpbssd", 1),
                        (false, 2) => tdp!("tdpbssd", 2),
                        (false, 3) => tdp!("tdpbssd", 3),
                        (false, 4) => tdp!("tdpbssd", 4),
                        (false, _) => tdp!("tdpbssd", 5),
                    }
                }
            }
        }
    }
}

/// Tiles `3h + p` into `out.0[p][h]`.
///
/// # Safety
/// The tiles hold [`config`].
#[inline(always)]
unsafe fn store(out: &mut BlockSums, passes: usize) {
    for p in 0..passes {
        for h in 0..2 {
            let o = out.0[p][h].as_mut_ptr().cast::<u8>();
            macro_rules! st {
                ($c:literal) => {
                    asm!(
                        concat!("tilestored [{o} + {s} * 1], tmm", $c),
                        o = in(reg) o, s = in(reg) 64usize,
                        options(nostack)
                    )
                };
            }
            // SAFETY: `out.0[p][h]` is 16 rows of 64 bytes.
            unsafe {
                match 3 * h + p {
                    0 => st!(0),
                    1 => st!(1),
                    2 => st!(2),
                    3 => st!(3),
                    4 => st!(4),
                    _ => st!(5),
                }
            }
        }
    }
}

/// The unpacked super-block's terms for one group into `acc`, as
/// `scalar::term_k` and `term_q6_k` make them, lane by lane, from its
/// passes' sums.
///
/// # Safety
/// The CPU has AVX-512 F/BW; `g.da` holds 16 scales and (Q4_K) `g.pairs`
/// 64 words.
#[inline(always)]
unsafe fn terms(f: Format, un: &Unpacked, g: Group<'_>, sums: &BlockSums, acc: &mut Acc) {
    // SAFETY: `g.da` holds AR = 16 f32, `g.pairs[p * AR..]` 16 i32, each
    // `sums.0[p][h][r]` 16 i32 (the caller's contract).
    unsafe {
        let da = _mm512_loadu_ps(g.da[..AR].as_ptr());
        let mut bp = [_mm512_setzero_si512(); 4];
        if f.mins() {
            // (A loop, not `array::from_fn`: an intrinsic in a closure can
            // stay a call in the dev profile.)
            for (p, bp) in bp.iter_mut().enumerate() {
                *bp = _mm512_loadu_si512(g.pairs[p * AR..][..AR].as_ptr().cast());
            }
        }
        for (r, acc) in acc.iter_mut().enumerate() {
            let sum = |p: usize| _mm512_loadu_si512(sums.0[p][r / 16][r % 16].as_ptr().cast());
            // isum = Σ_p 8^p · sum_p.
            let mut isum = _mm512_add_epi32(sum(0), _mm512_slli_epi32(sum(1), 3));
            if f == Format::Q6K {
                isum = _mm512_add_epi32(isum, _mm512_slli_epi32(sum(2), 6));
            }
            let dd = _mm512_mul_ps(da, _mm512_set1_ps(un.d[r]));
            let mut t = _mm512_mul_ps(dd, _mm512_cvtepi32_ps(isum));
            if f.mins() {
                let mut imin = _mm512_setzero_si512();
                for (p, &bp) in bp.iter().enumerate() {
                    let mins = _mm512_set1_epi32(un.mins[p * WR + r]);
                    imin = _mm512_add_epi32(imin, _mm512_madd_epi16(mins, bp));
                }
                let dm = _mm512_mul_ps(da, _mm512_set1_ps(un.dmin[r]));
                t = _mm512_sub_ps(t, _mm512_mul_ps(dm, _mm512_cvtepi32_ps(imin)));
            }
            *acc = _mm512_add_ps(*acc, t);
        }
    }
}
