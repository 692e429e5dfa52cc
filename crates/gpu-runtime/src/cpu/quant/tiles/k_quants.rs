//! Q4_K and Q6_K on the tiles: super-blocks of 256 quants in sub-blocks
//! of 32 (Q4_K: eight, 6-bit scales and mins) or 16 (Q6_K: sixteen, i8
//! scales). Per call, a slice of a panel's rows is unpacked to one byte a
//! quant in the A tiles' layout (Q4_K's 0..15; Q6_K's `q − 32`, signed, so
//! no offset term), the integer scales beside. The sub-blocks' sums are
//! scaled and added in i32 (exact in any order), and each super-block's
//! term is made in f32 as `scalar.rs` makes it, into one accumulator per
//! row in block order: Q4_K `(d_a · d)·isum − (d_a · dmin)·imin` with
//! `imin = Σ_j min_j · Σ a` from the activations' sums, Q6_K `(d_a ·
//! d)·isum`.

use std::arch::x86_64::*;
use std::cell::RefCell;

use metrale_core::GgmlType;

use super::super::act::ActRow;
use super::super::matrix::QuantMatrix;
use super::super::run_tasks;
use super::super::scalar::{f16_at, scales_mins_k4};
use super::{AR, Operands, Sums, WR, chunk_sums, config, regroup, share};
use crate::cpu::amx_os;
use crate::cpu::team::{OutPtr, Team};

/// Sub-blocks whose sums are stored before the integer work reads them.
const CHUNK: usize = 4;
/// Super-blocks of a panel unpacked at a time: 32 rows of 2 × 256 quants,
/// 16 KiB, beside the two 8 KiB buffers of sums in L1.
const SLICE: usize = 2;

/// What differs between the two formats.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Format {
    Q4K,
    Q6K,
}

impl Format {
    /// Quants per sub-block.
    fn width(self) -> usize {
        match self {
            Format::Q4K => 32,
            Format::Q6K => 16,
        }
    }

    /// Sub-blocks per super-block.
    fn subs(self) -> usize {
        256 / self.width()
    }

    /// Bytes of a super-block.
    fn block_bytes(self) -> usize {
        match self {
            Format::Q4K => 144,
            Format::Q6K => 210,
        }
    }
}

/// A slice of a panel, unpacked: per super-block `s` of the slice,
/// sub-block `j` and row `r`, the quants at `((s · subs + j) · WR + r) ·
/// width` and the scale at `(s · subs + j) · WR + r`; per super-block and
/// row, `d` and (Q4_K) `dmin`, and the mins as i16 pairs `(min_2p,
/// min_2p+1)` at `(s · 4 + p) · WR + r`.
#[derive(Default)]
struct Unpacked {
    quants: Vec<i8>,
    scales: Vec<i32>,
    mins: Vec<i32>,
    d: Vec<f32>,
    dmin: Vec<f32>,
}

/// Per weight row of a panel, its accumulator (activation rows in the
/// lanes).
type Acc = [__m512; WR];

thread_local! {
    /// The activations regrouped for the B tiles (quants; per super-block
    /// the scales, and Q4_K's sums of 32 as i16 pairs), on the calling
    /// thread, reused.
    static ACTS: RefCell<(Vec<i8>, Vec<f32>, Vec<i32>)> =
        const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
    /// A panel's unpacked slice, its rows gathered from the grouped
    /// layout, and its accumulators per group, per pool thread.
    static PANEL: RefCell<(Unpacked, Vec<u8>, Vec<Acc>)> =
        RefCell::new((Unpacked::default(), Vec::new(), Vec::new()));
}

/// [`super::matmul`] for Q4_K and Q6_K weights, either layout.
pub(super) fn matmul(
    team: Option<&Team>,
    w: QuantMatrix<'_>,
    acts: &[ActRow<'_>],
    out: &mut [f32],
) -> usize {
    let f = if w.ty() == GgmlType::Q4K {
        Format::Q4K
    } else {
        Format::Q6K
    };
    let (n, nsb, m) = (w.rows(), w.cols() / 256, acts.len());
    let (panels, groups) = (n / WR, m.div_ceil(AR));
    let share = share(team, &w, m);
    let ptr = OutPtr::new(out);
    let pair_words = if f == Format::Q4K { 4 * AR } else { 0 };
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
            f.width(),
            q,
            (fw, nsb * AR),
            (iw, nsb * pair_words),
            &scales,
        );
        let (q, fw, iw) = (&*q, &*fw, &*iw);
        let run = |t: usize| {
            let (p0, p1) = (t * share, ((t + 1) * share).min(panels));
            // SAFETY: `takes` found AMX-INT8 available; `config`'s shapes
            // are within 16 rows of 64 bytes.
            let _tiles = unsafe { amx_os::Tiles::configure(&config(f.width())) };
            let mut sums = Sums::<CHUNK>::pair();
            PANEL.with_borrow_mut(|(un, gathered, accs)| {
                for p in p0..p1 {
                    let j0 = p * WR;
                    let rows: [&[u8]; WR] = w.rows_in(j0, gathered);
                    accs.clear();
                    // SAFETY: all-zero bits are f32 zeros.
                    accs.resize(groups, unsafe { std::mem::zeroed() });
                    for s0 in (0..nsb).step_by(SLICE) {
                        let s1 = (s0 + SLICE).min(nsb);
                        unpack(f, &rows, (s0, s1), un);
                        for (g, acc) in accs.iter_mut().enumerate() {
                            let group = Group {
                                bq: &q[g * nsb * 256 * AR..][s0 * 256 * AR..],
                                da: &fw[g * nsb * AR..][s0 * AR..],
                                pairs: &iw[g * nsb * pair_words..][s0 * pair_words..],
                            };
                            // SAFETY: this thread's tiles hold the format's
                            // config; `un` holds the slice's s1 - s0
                            // super-blocks, `group` as many of every
                            // array; `takes` means VNNI, so AVX-512 F/BW.
                            unsafe { superblocks(f, un, group, s1 - s0, acc, &mut sums) };
                        }
                    }
                    for (g, acc) in accs.iter().enumerate() {
                        let mut v = [[0f32; AR]; WR];
                        for (o, a) in v.iter_mut().zip(acc) {
                            // SAFETY: `o` holds AR = 16 f32; AVX-512 F.
                            unsafe { _mm512_storeu_ps(o.as_mut_ptr(), *a) };
                        }
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

/// Super-blocks `s0..s1` of the panel's rows into `un` (see [`Unpacked`]).
fn unpack(f: Format, rows: &[&[u8]; WR], (s0, s1): (usize, usize), un: &mut Unpacked) {
    let (ns, subs) = (s1 - s0, f.subs());
    un.quants.resize(ns * 256 * WR, 0);
    un.scales.resize(ns * subs * WR, 0);
    un.d.resize(ns * WR, 0.0);
    if f == Format::Q4K {
        un.mins.resize(ns * 4 * WR, 0);
        un.dmin.resize(ns * WR, 0.0);
    }
    let bb = f.block_bytes();
    for (r, row) in rows.iter().enumerate() {
        for s in 0..ns {
            let blk = &row[(s0 + s) * bb..(s0 + s + 1) * bb];
            let at = (s * subs * WR + r) * f.width();
            // SAFETY: `blk` is a whole super-block, and sub-block j's
            // quants of row r, `(j · WR + r) · width` past `at`, are inside
            // `un.quants` (sized above); `takes` means VNNI, so AVX2.
            unsafe {
                match f {
                    Format::Q4K => unpack_q4_k(blk, un.quants[at..].as_mut_ptr()),
                    Format::Q6K => unpack_q6_k(blk, un.quants[at..].as_mut_ptr()),
                }
            }
            match f {
                Format::Q4K => {
                    let (sc, mn) = scales_mins_k4(blk);
                    for (j, &sc) in sc.iter().enumerate() {
                        un.scales[(s * 8 + j) * WR + r] = sc as i32;
                    }
                    for p in 0..4 {
                        let pair = (mn[2 * p] as i32) | ((mn[2 * p + 1] as i32) << 16);
                        un.mins[(s * 4 + p) * WR + r] = pair;
                    }
                    un.d[s * WR + r] = f16_at(blk, 0);
                    un.dmin[s * WR + r] = f16_at(blk, 2);
                }
                Format::Q6K => {
                    for j in 0..16 {
                        un.scales[(s * 16 + j) * WR + r] = blk[192 + j] as i8 as i32;
                    }
                    un.d[s * WR + r] = f16_at(blk, 208);
                }
            }
        }
    }
}

/// A Q4_K super-block's quants, one byte each: sub-block `j` (the low
/// nibbles of bytes `32·(j/2)..` for even j, the high for odd) to the 32
/// bytes at `out + j · WR · 32`.
///
/// # Safety
/// `blk` is 144 bytes; the eight destinations are writable; AVX2.
#[target_feature(enable = "avx2")]
unsafe fn unpack_q4_k(blk: &[u8], out: *mut i8) {
    assert!(blk.len() >= 144);
    let mask = _mm256_set1_epi8(0x0F);
    for c in 0..4 {
        // SAFETY: bytes 16 + 32c.. + 32 are inside `blk` (asserted); the
        // stores as the caller's contract says.
        unsafe {
            let v = _mm256_loadu_si256(blk[16 + 32 * c..].as_ptr().cast());
            let lo = _mm256_and_si256(v, mask);
            let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            _mm256_storeu_si256(out.add(2 * c * WR * 32).cast(), lo);
            _mm256_storeu_si256(out.add((2 * c + 1) * WR * 32).cast(), hi);
        }
    }
}

/// A Q6_K super-block's quants minus 32, one byte each: element `e =
/// 128h + 32k + l` (the low nibble of `ql[64h + 32(k % 2) + l]` for k < 2,
/// else the high; bits 2k, 2k + 1 of `qh[32h + l]` above it) to sub-block
/// `e / 16`'s 16 bytes at `out + (e / 16) · WR · 16`.
///
/// # Safety
/// `blk` is 210 bytes; the sixteen destinations are writable; AVX2.
#[target_feature(enable = "avx2")]
unsafe fn unpack_q6_k(blk: &[u8], out: *mut i8) {
    assert!(blk.len() >= 210);
    let (mask4, mask2, bias) = (
        _mm256_set1_epi8(0x0F),
        _mm256_set1_epi8(3),
        _mm256_set1_epi8(32),
    );
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
                let hi = _mm256_slli_epi16(_mm256_and_si256(shifted, mask2), 4);
                let q = _mm256_sub_epi8(_mm256_or_si256(lo, hi), bias);
                let j = 8 * h + 2 * k;
                _mm_storeu_si128(out.add(j * WR * 16).cast(), _mm256_castsi256_si128(q));
                _mm_storeu_si128(
                    out.add((j + 1) * WR * 16).cast(),
                    _mm256_extracti128_si256(q, 1),
                );
            }
        }
    }
}

/// One group's share of a slice: its B tiles, per super-block its rows'
/// scales and (Q4_K) sums of 32 as i16 pairs.
#[derive(Clone, Copy)]
struct Group<'a> {
    bq: &'a [i8],
    da: &'a [f32],
    pairs: &'a [i32],
}

/// Adds the slice's `ns` super-blocks of one group to `acc`, in block
/// order.
///
/// # Safety
/// This thread's tiles hold `config(f.width())`; `un` and `g` hold `ns`
/// super-blocks; the CPU has AVX-512 F/BW.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn superblocks(
    f: Format,
    un: &Unpacked,
    g: Group<'_>,
    ns: usize,
    acc: &mut Acc,
    sums: &mut [Sums<CHUNK>; 2],
) {
    let (width, subs) = (f.width(), f.subs());
    let per_block = subs / CHUNK;
    let chunks = ns * per_block;
    assert!(un.quants.len() >= ns * 256 * WR && g.bq.len() >= ns * 256 * AR);
    assert!(un.scales.len() >= ns * subs * WR && un.d.len() >= ns * WR && g.da.len() >= ns * AR);
    if f == Format::Q4K {
        assert!(un.mins.len() >= ns * 4 * WR && un.dmin.len() >= ns * WR);
        assert!(g.pairs.len() >= ns * 4 * AR);
    }
    let (a, b) = (un.quants.as_ptr().cast::<u8>(), g.bq.as_ptr());
    let at = |c: usize| {
        move |u: usize| {
            let sub = c * CHUNK + u;
            let first = a.wrapping_add(sub * WR * width);
            Operands {
                first,
                second: first.wrapping_add(16 * width),
                stride: width,
                acts: b.wrapping_add(sub * width * AR),
            }
        }
    };
    let mut isum = [_mm512_setzero_si512(); WR];
    // SAFETY (both calls): every chunk's sub-blocks are inside `un` and
    // `g.bq` (asserted above).
    unsafe { chunk_sums(CHUNK, at(0), &mut sums[0]) };
    for c in 0..chunks {
        if c + 1 < chunks {
            // SAFETY: as above.
            unsafe { chunk_sums(CHUNK, at(c + 1), &mut sums[(c + 1) % 2]) };
        }
        let s = &sums[c % 2].0;
        let sc = &un.scales[c * CHUNK * WR..][..CHUNK * WR];
        for (r, isum) in isum.iter_mut().enumerate() {
            let mut v = if c % per_block == 0 {
                _mm512_setzero_si512()
            } else {
                *isum
            };
            for u in 0..CHUNK {
                // SAFETY: `s[u][r]` is 16 i32.
                let sumi = unsafe { _mm512_loadu_si512(s[u][r].as_ptr().cast()) };
                let scaled = _mm512_mullo_epi32(sumi, _mm512_set1_epi32(sc[u * WR + r]));
                v = _mm512_add_epi32(v, scaled);
            }
            *isum = v;
        }
        if (c + 1) % per_block == 0 {
            // SAFETY: AVX-512 F/BW (this function's); super-block c /
            // per_block is inside every array (asserted above).
            unsafe { terms(f, un, g, c / per_block, &isum, acc) };
        }
    }
}

/// Super-block `s`'s terms into `acc`, as `scalar::term_k` and
/// `term_q6_k` make them, lane by lane.
///
/// # Safety
/// The CPU has AVX-512 F/BW; super-block `s` is inside `un`'s and `g`'s
/// arrays.
#[inline(always)]
unsafe fn terms(
    f: Format,
    un: &Unpacked,
    g: Group<'_>,
    s: usize,
    isum: &[__m512i; WR],
    acc: &mut Acc,
) {
    // SAFETY: `g.da[s * AR..]` holds AR = 16 f32, `g.pairs[(s * 4 + p) *
    // AR..]` 16 i32 (the caller's contract).
    unsafe {
        let da = _mm512_loadu_ps(g.da[s * AR..][..AR].as_ptr());
        let bp: [__m512i; 4] = match f {
            Format::Q4K => std::array::from_fn(|p| {
                _mm512_loadu_si512(g.pairs[(s * 4 + p) * AR..][..AR].as_ptr().cast())
            }),
            Format::Q6K => [_mm512_setzero_si512(); 4],
        };
        for (r, (acc, &isum)) in acc.iter_mut().zip(isum).enumerate() {
            let dd = _mm512_mul_ps(da, _mm512_set1_ps(un.d[s * WR + r]));
            let mut t = _mm512_mul_ps(dd, _mm512_cvtepi32_ps(isum));
            if f == Format::Q4K {
                let mut imin = _mm512_setzero_si512();
                for (p, &bp) in bp.iter().enumerate() {
                    let mins = _mm512_set1_epi32(un.mins[(s * 4 + p) * WR + r]);
                    imin = _mm512_add_epi32(imin, _mm512_madd_epi16(mins, bp));
                }
                let dm = _mm512_mul_ps(da, _mm512_set1_ps(un.dmin[s * WR + r]));
                t = _mm512_sub_ps(t, _mm512_mul_ps(dm, _mm512_cvtepi32_ps(imin)));
            }
            *acc = _mm512_add_ps(*acc, t);
        }
    }
}
