//! Q8_0 on the tiles: 32-quant blocks, each block's sums scaled in f32
//! as `scalar.rs` does: block `b`'s `sumi · (d_w · d_a)` into accumulator
//! `b % 4`, then `(acc0 + acc1) + (acc2 + acc3)`, no fused multiply-add.
//! The weights load in place: block `b` of 16 rows, 2 bytes into it, the
//! row length apart; nothing is repacked, so a step of a few rows reads
//! each weight byte once, as decode does.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;

use super::super::act::ActRow;
use super::super::matrix::QuantMatrix;
use super::super::run_tasks;
use super::{AR, WR, regroup, share};
use crate::cpu::amx_os;
use crate::cpu::team::{OutPtr, Team};

/// Words of one block's B tile: 8 rows of `AR` groups of four quants.
const B_TILE: usize = 8 * AR;
/// Bytes of a Q8_0 block: the f16 scale, then 32 quants.
const BLOCK: usize = 34;
/// Blocks whose sums are stored before the f32 work reads them: the four
/// accumulators' cycle.
const CHUNK: usize = 4;
/// Blocks of a panel's slice that every group passes in turn: 32 rows of
/// 32 blocks, 34 KiB, stay in L1 (a whole panel of a 4096-wide matrix,
/// 136 KiB, was read from L2 once per group; 16 and 64 blocks measured
/// no better).
const SLICE: usize = 32;

/// Per weight row of a panel, its four f32 accumulators (activation rows
/// in the lanes).
type Acc = [[__m512; CHUNK]; WR];

thread_local! {
    /// The activations regrouped for the B tiles (quants, scales), on the
    /// calling thread, reused.
    static ACTS: RefCell<(Vec<u32>, Vec<f32>, Vec<i32>)> =
        const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
    /// A panel's weight scales as f32, `[block][row]`, and its
    /// accumulators per group, per pool thread.
    static PANEL: RefCell<(Vec<f32>, Vec<Acc>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// [`super::matmul`] for Q8_0 weights in GGUF's row layout.
pub(super) fn matmul(
    team: Option<&Team>,
    w: QuantMatrix<'_>,
    acts: &[ActRow<'_>],
    out: &mut [f32],
) -> usize {
    let (n, nb, m) = (w.rows(), w.cols() / 32, acts.len());
    let (panels, groups) = (n / WR, m.div_ceil(AR));
    let rb = w.row_bytes();
    let share = share(team, &w, m);
    let ptr = OutPtr::new(out);
    ACTS.with_borrow_mut(|(q, d, unused)| {
        // Per group, each block's activation scales.
        let scales = |rows: &[ActRow<'_>], d: &mut [f32], _: &mut [i32]| {
            for (t, a) in rows.iter().enumerate() {
                for (b, &da) in a.d.iter().enumerate() {
                    d[b * AR + t] = da;
                }
            }
        };
        regroup(team, acts, 32, q, (d, nb * AR), (unused, 0), &scales);
        let (q, d) = (&*q, &*d);
        let run = |t: usize| {
            let (p0, p1) = (t * share, ((t + 1) * share).min(panels));
            // SAFETY: `takes` found AMX-INT8 available; `config`'s shapes
            // are within 16 rows of 64 bytes.
            let _tiles = unsafe { amx_os::Tiles::configure(&config()) };
            let mut sums = Sums::pair();
            PANEL.with_borrow_mut(|(dw, accs)| {
                dw.resize(nb * WR, 0.0);
                for p in p0..p1 {
                    let j0 = p * WR;
                    let Some(rows) = w.row_run(j0, WR) else {
                        return;
                    };
                    if p + 1 < p1 {
                        // The next panel into L2 while this one is worked:
                        // a step of a few rows streams its weights, and the
                        // 32 rows' streams are more than the hardware
                        // prefetchers follow (the scales' strided reads
                        // below waited on memory: a third of a batch-16
                        // step).
                        super::prefetch_l2(w.span_of_rows(j0 + WR, WR));
                    }
                    // SAFETY: `takes` means VNNI, so AVX-512 F.
                    unsafe { weight_scales(rows, rb, nb, dw) };
                    let panel = Panel { rows, rb, dw };
                    accs.clear();
                    // SAFETY: all-zero bits are f32 zeros.
                    accs.resize(groups, unsafe { std::mem::zeroed() });
                    // A slice of the panel's blocks stays in L1 while every
                    // group's tiles of the slice pass it.
                    for lo in (0..nb).step_by(SLICE) {
                        let hi = (lo + SLICE).min(nb);
                        for (g, acc) in accs.iter_mut().enumerate() {
                            let (bq, da) = (&q[g * nb * B_TILE..], &d[g * nb * AR..]);
                            // SAFETY: this thread's tiles hold `config()`;
                            // `rows` is WR rows of nb blocks `rb` apart,
                            // `bq` nb B tiles, `dw` and `da` nb blocks'
                            // scales; `takes` means VNNI, so AVX-512 F.
                            unsafe { blocks(panel, (bq, da), (lo, hi), acc, &mut sums) };
                        }
                    }
                    for (g, acc) in accs.iter().enumerate() {
                        // SAFETY: AVX-512 F, as above.
                        let v = unsafe { finish(acc) };
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

/// `dw[b * WR + r]` = row `r`'s block `b` scale as f32: per block, the
/// 32 rows' f16 bits gathered, then widened 16 at a time. (A conversion
/// call per scale, rows outer, had been a third of a batch-16 step.)
///
/// # Safety
/// The CPU has AVX-512 F.
#[target_feature(enable = "avx512f")]
unsafe fn weight_scales(rows: &[u8], rb: usize, nb: usize, dw: &mut [f32]) {
    assert!(rows.len() >= (WR - 1) * rb + nb * BLOCK && dw.len() >= nb * WR);
    for (b, out) in dw.chunks_exact_mut(WR).take(nb).enumerate() {
        let bits: [u16; WR] = std::array::from_fn(|r| {
            let o = r * rb + b * BLOCK;
            u16::from_le_bytes([rows[o], rows[o + 1]])
        });
        for (half, out) in bits.chunks_exact(16).zip(out.chunks_exact_mut(16)) {
            // SAFETY: 16 u16 in, 16 f32 out; AVX-512 F (this function's).
            unsafe {
                let h = _mm256_loadu_si256(half.as_ptr().cast());
                _mm512_storeu_ps(out.as_mut_ptr(), _mm512_cvtph_ps(h));
            }
        }
    }
}

/// The tile shapes: sums 0-3 of 16 rows of 16 i32 (two sets of two),
/// weights 4 and 5 of 16 rows of a block's 32 quants, activations 6 of 8
/// rows of 64 bytes.
fn config() -> amx_os::Config {
    let (sums, weights, acts) = ((16, 64), (16, 32), (8, 64));
    amx_os::Config::new([sums, sums, sums, sums, weights, weights, acts, (0, 0)])
}

/// Integer sums as stored: per block of a chunk, weight rows `0..WR` of
/// 16 activation rows each (two tiles).
#[repr(C, align(64))]
struct Sums([[[i32; AR]; WR]; CHUNK]);

impl Sums {
    /// Two buffers, zeroed, on the heap.
    fn pair() -> Box<[Sums; 2]> {
        Box::new([Sums([[[0; AR]; WR]; CHUNK]), Sums([[[0; AR]; WR]; CHUNK])])
    }
}

/// Blocks `0..count` of a chunk into `out`, each one's products issued
/// before the previous one's are stored, the two tile sets alternating.
/// `at(u)` is block `u`'s weights (16 rows `stride` bytes apart, the
/// second 16 from `second`) and its B tile.
///
/// # Safety
/// The tiles hold [`config`], and every `at(u)` is readable as
/// [`products`] says.
#[inline(always)]
unsafe fn chunk_sums(count: usize, at: impl Fn(usize) -> Operands, out: &mut Sums) {
    for u in 0..count {
        // SAFETY: the caller's contract.
        unsafe { products(at(u), u % 2) };
        if u > 0 {
            // SAFETY: as above; `out.0[u - 1]` is 32 rows of 64 bytes.
            unsafe { store((u - 1) % 2, &mut out.0[u - 1]) };
        }
    }
    if count > 0 {
        // SAFETY: as above.
        unsafe { store((count - 1) % 2, &mut out.0[count - 1]) };
    }
}

/// Where one block's tiles load from.
#[derive(Clone, Copy)]
struct Operands {
    /// Weight rows 0-15, `stride` bytes apart, and rows 16-31.
    first: *const u8,
    second: *const u8,
    stride: usize,
    /// The B tile: rows of 64 bytes, contiguous.
    acts: *const i8,
}

/// A block's products into tile set `set` (tiles 0, 1 or 2, 3): the
/// panel's two halves of 16 weight rows times the group's B tile.
///
/// # Safety
/// The tiles hold [`config`]; 16 rows of 32 quants `stride` apart from
/// `first` and from `second`, and the B tile, are readable.
#[inline(always)]
unsafe fn products(at: Operands, set: usize) {
    let Operands {
        first,
        second,
        stride,
        acts,
    } = at;
    macro_rules! into {
        ($c0:literal, $c1:literal) => {
            asm!(
                concat!("tilezero tmm", $c0),
                concat!("tilezero tmm", $c1),
                "tileloadd tmm4, [{wa} + {rb} * 1]",
                "tileloadd tmm5, [{wb} + {rb} * 1]",
                "tileloadd tmm6, [{bt} + {s} * 1]",
                concat!("tdpbssd tmm", $c0, ", tmm4, tmm6"),
                concat!("tdpbssd tmm", $c1, ", tmm5, tmm6"),
                wa = in(reg) first, wb = in(reg) second, rb = in(reg) stride,
                bt = in(reg) acts, s = in(reg) 64usize,
                options(nostack, readonly)
            )
        };
    }
    // SAFETY: the caller's contract.
    unsafe {
        if set == 0 {
            into!(0, 1);
        } else {
            into!(2, 3);
        }
    }
}

/// Tile set `set`'s sums into `out` (weight rows 0-15 from tile 0 or 2,
/// 16-31 from 1 or 3).
///
/// # Safety
/// The tiles hold [`config`].
#[inline(always)]
unsafe fn store(set: usize, out: &mut [[i32; AR]; WR]) {
    let o = out.as_mut_ptr().cast::<u8>();
    macro_rules! from {
        ($c0:literal, $c1:literal) => {
            asm!(
                concat!("tilestored [{o} + {s} * 1], tmm", $c0),
                concat!("tilestored [{o} + {s} * 1 + 1024], tmm", $c1),
                o = in(reg) o, s = in(reg) 64usize,
                options(nostack)
            )
        };
    }
    // SAFETY: `out` is 32 rows of 64 bytes; each tile stores 16 of them.
    unsafe {
        if set == 0 {
            from!(0, 1);
        } else {
            from!(2, 3);
        }
    }
}

/// A panel's weights: `WR` rows of Q8_0 blocks `rb` bytes apart, and
/// their scales as f32 (`[block][row]`).
#[derive(Clone, Copy)]
struct Panel<'a> {
    rows: &'a [u8],
    rb: usize,
    dw: &'a [f32],
}

/// Adds blocks `lo..hi` (`lo` a multiple of [`CHUNK`]) of one panel and one
/// group (its B tiles `bq`, scales `da`) to `acc`: block `b` into
/// accumulator `b % 4`.
///
/// # Safety
/// This thread's tiles hold `config()`; `rows` holds `hi` blocks or more
/// of each row, `bq` `hi` B tiles, `da` `hi · AR` scales and `dw` `hi ·
/// WR`; the CPU has AVX-512 F.
#[target_feature(enable = "avx512f")]
unsafe fn blocks(
    Panel { rows, rb, dw }: Panel<'_>,
    (bq, da): (&[u32], &[f32]),
    (lo, hi): (usize, usize),
    acc: &mut Acc,
    sums: &mut [Sums; 2],
) {
    assert!(lo.is_multiple_of(CHUNK) && lo < hi);
    assert!(rows.len() >= WR * rb && bq.len() >= hi * B_TILE && rb >= hi * BLOCK);
    assert!(dw.len() >= hi * WR && da.len() >= hi * AR);
    let (w, bt) = (rows.as_ptr(), bq.as_ptr());
    let at = |b0: usize| {
        move |u: usize| {
            let first = w.wrapping_add((b0 + u) * BLOCK + 2);
            Operands {
                first,
                second: first.wrapping_add(16 * rb),
                stride: rb,
                acts: bt.wrapping_add((b0 + u) * B_TILE).cast(),
            }
        }
    };
    // SAFETY (both calls): the chunk's blocks are below hi, inside `rows`
    // and `bq` (asserted above).
    unsafe { chunk_sums(CHUNK.min(hi - lo), at(lo), &mut sums[0]) };
    for (c, b0) in (lo..hi).step_by(CHUNK).enumerate() {
        let next = b0 + CHUNK;
        if next < hi {
            // SAFETY: as above.
            unsafe { chunk_sums(CHUNK.min(hi - next), at(next), &mut sums[(c + 1) % 2]) };
        }
        let count = CHUNK.min(hi - b0);
        let s = &sums[c % 2].0;
        let dw = &dw[b0 * WR..(b0 + count) * WR];
        let da = &da[b0 * AR..(b0 + count) * AR];
        // SAFETY: AVX-512 F (this function's); `s`, `dw` and `da` hold
        // `count` blocks' sums and scales.
        unsafe {
            match count {
                CHUNK => scale_add::<CHUNK>(s, dw, da, acc),
                3 => scale_add::<3>(s, dw, da, acc),
                2 => scale_add::<2>(s, dw, da, acc),
                _ => scale_add::<1>(s, dw, da, acc),
            }
        }
    }
}

/// Block `u < C` of a chunk (its first block a multiple of four) into
/// accumulator `u` of every weight row: `sumi · (d_w · d_a)`.
///
/// # Safety
/// The CPU has AVX-512 F.
#[inline(always)]
unsafe fn scale_add<const C: usize>(
    s: &[[[i32; AR]; WR]; CHUNK],
    dw: &[f32],
    da: &[f32],
    acc: &mut Acc,
) {
    assert!(C <= CHUNK && dw.len() >= C * WR && da.len() >= C * AR);
    // SAFETY (all loads): AVX-512 F (the caller's contract); `da` holds C
    // blocks of AR = 16 f32, each `s[u][r]` 16 i32.
    unsafe {
        let dab: [__m512; C] = std::array::from_fn(|u| _mm512_loadu_ps(da[u * AR..].as_ptr()));
        for (r, acc) in acc.iter_mut().enumerate() {
            let mut a = *acc;
            for u in 0..C {
                let sumi = _mm512_loadu_si512(s[u][r].as_ptr().cast());
                let dd = _mm512_mul_ps(_mm512_set1_ps(dw[u * WR + r]), dab[u]);
                let t = _mm512_mul_ps(_mm512_cvtepi32_ps(sumi), dd);
                a[u] = _mm512_add_ps(a[u], t);
            }
            *acc = a;
        }
    }
}

/// `v[r][t]`: weight row `r`'s four accumulators summed, `(acc0 + acc1) +
/// (acc2 + acc3)`.
///
/// # Safety
/// The CPU has AVX-512 F.
#[target_feature(enable = "avx512f")]
unsafe fn finish(acc: &Acc) -> [[f32; AR]; WR] {
    let mut v = [[0f32; AR]; WR];
    for (out, &[a0, a1, a2, a3]) in v.iter_mut().zip(acc) {
        let total = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
        // SAFETY: `out` holds AR = 16 f32.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), total) };
    }
    v
}
