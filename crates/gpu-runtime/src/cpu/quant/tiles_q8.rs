//! Q8_0 products on Intel AMX-INT8 tiles (`tdpbssd`, Sapphire Rapids and
//! later): prefill and batched decode steps, wherever [`takes`] says.
//!
//! The weights are the A tiles as the file holds them: block `b` of 16
//! weight rows is 16 rows of 32 signed quants (2 bytes into each row's
//! block, the row length apart), loaded in place. Nothing is repacked, so
//! a step of a few rows reads each weight byte once, as decode does. The
//! activations are the B tile, regrouped once per call into the layout
//! the instruction wants (row `g` of block `b`: quants `4g..4g + 4` of 16
//! activation rows side by side); they are few beside the weights. One
//! `tdpbssd` makes the 16 × 16 integer sums of a block, 8192 products,
//! exact in i32.
//!
//! The f32 work then follows `scalar.rs` to the bit, one weight row per
//! register with the activation rows in its lanes: block `b`'s `sumi ·
//! (d_w · d_a)` into accumulator `b % 4`, then `(acc0 + acc1) + (acc2 +
//! acc3)`, no fused multiply-add. That per-block work (four vector
//! operations per weight row and 16 activation rows) is what bounds the
//! kernel, not the tiles; so two tile sets alternate, the next block's
//! products issued before this block's are read.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;

use half::f16;
use metrale_core::GgmlType;

use super::act::ActRow;
use super::matrix::QuantMatrix;
use super::{QuantIsa, run_tasks};
use crate::cpu::amx_os;
use crate::cpu::team::{OutPtr, Team};

/// Weight rows per panel: two A tiles.
const WR: usize = 32;
/// Activation rows per B tile: its 16 i32 columns.
const AR: usize = 16;
/// Bytes of one block's B tile: 8 rows of `AR` groups of four quants.
const B_TILE: usize = 32 * AR;
/// Bytes of a Q8_0 block: the f16 scale, then 32 quants.
const BLOCK: usize = 34;
/// Blocks of a panel's slice that every group passes in turn: 32 rows of
/// 32 blocks, 34 KiB, stay in L1 (a whole panel of a 4096-wide matrix,
/// 136 KiB, was read from L2 once per group; 16 and 64 blocks measured
/// no better).
const SLICE: usize = 32;

/// Fewest activation rows the tiles take (a tile of 16 holds fewer as
/// zeros). `examples/quant_rows`, 2 threads, 1024x4096 and 3072x768
/// against the other kernels: 4 rows 0.60-0.71x, 6 rows 1.08x, 8 rows
/// 1.16-1.40x, 16 rows 2.1-2.6x, 512 rows 1.2x.
const MIN_ROWS: usize = 8;

/// Whether this CPU and OS run AMX-INT8 tiles for this process.
pub(crate) fn available() -> bool {
    amx_os::available(amx_os::Unit::Int8)
}

/// Whether [`matmul`] takes `m` activation rows of `w`: Q8_0 in GGUF's
/// row layout, at least one panel of rows, tiles allowed and available.
pub(super) fn takes(isa: QuantIsa, tiles: bool, w: &QuantMatrix<'_>, m: usize) -> bool {
    tiles
        && isa == QuantIsa::Vnni
        && w.ty() == GgmlType::Q8_0
        && !w.is_grouped()
        && w.rows() >= WR
        && m >= MIN_ROWS
        && available()
}

/// The tile shapes: sums 0-3 of 16 rows of 16 i32 (two sets of two),
/// weights 4 and 5 of 16 rows of 32 quants, activations 6 of 8 rows of
/// 64 bytes.
fn config() -> amx_os::Config {
    let (sums, weights, acts) = ((16, 64), (16, 32), (8, 64));
    amx_os::Config::new([sums, sums, sums, sums, weights, weights, acts, (0, 0)])
}

thread_local! {
    /// The activations regrouped for the B tiles (quants, scales), on the
    /// calling thread, reused.
    static ACTS: RefCell<(Vec<i8>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
    /// A panel's weight scales as f32, `[block][row]`, and its
    /// accumulators per group, per pool thread.
    static SCALES: RefCell<(Vec<f32>, Vec<Acc>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// `out[i * n + j] = dot(acts[i], w[j])` for the weight rows `j < n / WR
/// · WR`, which it returns; the rest are the caller's. The bits of
/// `scalar.rs`.
///
/// `w` and the rows as [`takes`] says; every activation row as many Q8_0
/// blocks as a weight row, `out` at least `acts.len() · n` floats
/// (`quant_matmul_with` checks both).
pub(super) fn matmul(
    team: Option<&Team>,
    w: QuantMatrix<'_>,
    acts: &[ActRow<'_>],
    out: &mut [f32],
) -> usize {
    let (n, nb, m) = (w.rows(), w.cols() / 32, acts.len());
    let (panels, groups) = (n / WR, m.div_ceil(AR));
    let rb = w.row_bytes();
    let threads = team.map_or(1, Team::threads);
    // Prefill is compute-bound: eight shares a thread, so that a thread
    // held up leaves the others little to wait for. A step streams its
    // weights: shares of 1 MiB or more, as `quant_matmul_with`'s.
    let per_thread = if m > 64 {
        8
    } else {
        (w.bytes() >> 20).clamp(1, 8)
    };
    let share = panels.div_ceil(threads * per_thread).max(1);
    let ptr = OutPtr::new(out);
    ACTS.with_borrow_mut(|(q, d)| {
        q.resize(groups * nb * B_TILE, 0);
        d.resize(groups * nb * AR, 0.0);
        regroup(team, acts, nb, q, d);
        let (q, d) = (&*q, &*d);
        let run = |t: usize| {
            let (p0, p1) = (t * share, ((t + 1) * share).min(panels));
            // SAFETY: `takes` found AMX-INT8 available; `config`'s shapes
            // are within 16 rows of 64 bytes.
            let _tiles = unsafe { amx_os::Tiles::configure(&config()) };
            // The tiles' sums, stored and read back (`blocks`).
            let mut sums = Box::new([Sums([[[0; AR]; WR]; CHUNK]), Sums([[[0; AR]; WR]; CHUNK])]);
            SCALES.with_borrow_mut(|(dw, accs)| {
                dw.resize(nb * WR, 0.0);
                for p in p0..p1 {
                    let j0 = p * WR;
                    let Some(rows) = w.row_run(j0, WR) else {
                        return;
                    };
                    weight_scales(rows, rb, nb, dw);
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
                            // SAFETY: this thread's tiles hold `config`;
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

/// The activation rows as B tiles: per group of `AR` rows (the last
/// padded with zero quants and scales) and block, `q[c * 64 + 4t..][..4]`
/// = row `t`'s quants `4c..4c + 4` of the block, and `d[t]` its scale.
/// The groups spread over the team: alone, a 512-row prompt's regrouping
/// was a tenth of the product's time.
fn regroup(team: Option<&Team>, acts: &[ActRow<'_>], nb: usize, q: &mut [i8], d: &mut [f32]) {
    let groups = acts.len().div_ceil(AR);
    assert!(q.len() >= groups * nb * B_TILE && d.len() >= groups * nb * AR);
    let dst = GroupsOut(q.as_mut_ptr(), d.as_mut_ptr());
    let run = |g: usize| {
        // SAFETY: group `g`'s ranges are inside `q` and `d` (asserted
        // above), and task `g` alone writes them.
        let (qg, dg) = unsafe { dst.group(g, nb) };
        qg.fill(0);
        dg.fill(0.0);
        for (t, a) in acts.iter().skip(g * AR).take(AR).enumerate() {
            for (b, (qs, &da)) in a.qs.chunks_exact(32).zip(a.d).enumerate() {
                let tile = &mut qg[b * B_TILE..(b + 1) * B_TILE];
                for (c, four) in qs.chunks_exact(4).enumerate() {
                    tile[c * 64 + 4 * t..c * 64 + 4 * t + 4].copy_from_slice(four);
                }
                dg[b * AR + t] = da;
            }
        }
    };
    run_tasks(team.filter(|_| groups > 1), groups, &run);
}

/// Where [`regroup`]'s tasks write: disjoint groups of the quants and
/// scales.
#[derive(Clone, Copy)]
struct GroupsOut(*mut i8, *mut f32);
// SAFETY: each task writes its own group's ranges only (see `regroup`).
unsafe impl Send for GroupsOut {}
unsafe impl Sync for GroupsOut {}

impl GroupsOut {
    /// Group `g`'s quants and scales (`nb` blocks).
    ///
    /// # Safety
    /// They must lie inside the arrays, and no other live reference may
    /// touch them.
    #[allow(clippy::mut_from_ref)]
    unsafe fn group(&self, g: usize, nb: usize) -> (&mut [i8], &mut [f32]) {
        // SAFETY: the caller's contract.
        unsafe {
            (
                std::slice::from_raw_parts_mut(self.0.add(g * nb * B_TILE), nb * B_TILE),
                std::slice::from_raw_parts_mut(self.1.add(g * nb * AR), nb * AR),
            )
        }
    }
}

/// `dw[b * WR + r]` = row `r`'s block `b` scale as f32.
fn weight_scales(rows: &[u8], rb: usize, nb: usize, dw: &mut [f32]) {
    for r in 0..WR {
        for b in 0..nb {
            let o = r * rb + b * BLOCK;
            dw[b * WR + r] = f16::from_bits(u16::from_le_bytes([rows[o], rows[o + 1]])).to_f32();
        }
    }
}

/// Blocks whose sums are stored before the f32 work reads them: the four
/// accumulators' cycle.
const CHUNK: usize = 4;

/// Integer sums as stored: per block of a chunk, weight rows `0..WR` of 16
/// activation rows each (two tiles).
#[repr(C, align(64))]
pub(super) struct Sums([[[i32; AR]; WR]; CHUNK]);

/// A panel's weights: `WR` rows of Q8_0 blocks `rb` bytes apart, and
/// their scales as f32 (`[block][row]`).
#[derive(Clone, Copy)]
struct Panel<'a> {
    rows: &'a [u8],
    rb: usize,
    dw: &'a [f32],
}

/// Per weight row of a panel, its four f32 accumulators (activation rows
/// in the lanes).
pub(super) type Acc = [[__m512; CHUNK]; WR];

/// Adds blocks `lo..hi` (`lo` a multiple of [`CHUNK`]) of one panel and one
/// group to `acc`, in `scalar.rs`'s order (see the module's doc): block `b`
/// into accumulator `b % 4`.
///
/// The tiles' sums go through memory, and a vector load that meets a tile
/// store still in flight waits for it to retire: read one block at a time
/// after its store, that made each block a round trip. So the sums of a
/// chunk of blocks are stored while the previous chunk's, stored a chunk
/// earlier, are read, in two buffers.
///
/// # Safety
/// This thread's tiles hold [`config`]; `rows` is `WR` rows of Q8_0
/// blocks `rb` bytes apart, `hi` of them or more; `bq` holds `hi` B tiles,
/// `da` `hi · AR` scales and `dw` `hi · WR`; the CPU has AVX-512 F.
#[target_feature(enable = "avx512f")]
unsafe fn blocks(
    Panel { rows, rb, dw }: Panel<'_>,
    (bq, da): (&[i8], &[f32]),
    (lo, hi): (usize, usize),
    acc: &mut Acc,
    sums: &mut [Sums; 2],
) {
    assert!(lo.is_multiple_of(CHUNK) && lo < hi);
    assert!(rows.len() >= WR * rb && bq.len() >= hi * B_TILE && rb >= hi * BLOCK);
    assert!(dw.len() >= hi * WR && da.len() >= hi * AR);
    let (w, bt) = (rows.as_ptr(), bq.as_ptr());
    // SAFETY (both calls): the chunk's blocks are below hi, inside `rows`
    // and `bq` (asserted above).
    unsafe { chunk_sums(w, rb, bt, lo, CHUNK.min(hi - lo), &mut sums[0]) };
    for (c, b0) in (lo..hi).step_by(CHUNK).enumerate() {
        let next = b0 + CHUNK;
        if next < hi {
            // SAFETY: as above.
            unsafe {
                chunk_sums(
                    w,
                    rb,
                    bt,
                    next,
                    CHUNK.min(hi - next),
                    &mut sums[(c + 1) % 2],
                )
            };
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
/// The CPU has AVX-512 F; `dw` holds `C · WR` scales and `da` `C · AR`.
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

/// Blocks `b0..b0 + count`'s sums into `out`: each block's products
/// issued before the previous block's are stored, the two tile sets
/// alternating.
///
/// # Safety
/// As [`products`] for every block.
#[inline(always)]
unsafe fn chunk_sums(
    w: *const u8,
    rb: usize,
    bq: *const i8,
    b0: usize,
    count: usize,
    out: &mut Sums,
) {
    for u in 0..count {
        // SAFETY: the caller's contract.
        unsafe { products(w, rb, bq, b0 + u) };
        if u > 0 {
            // SAFETY: as above; `out.0[u - 1]` is 32 rows of 64 bytes.
            unsafe { store((b0 + u - 1) % 2, &mut out.0[u - 1]) };
        }
    }
    // SAFETY: as above.
    unsafe { store((b0 + count - 1) % 2, &mut out.0[count - 1]) };
}

/// Block `b`'s products into tile set `b % 2` (tiles 0, 1 or 2, 3): the
/// panel's two halves of 16 weight rows times the group's B tile.
///
/// # Safety
/// The tiles hold [`config`]; block `b` of 32 rows `rb` bytes apart from
/// `w`, and the 512 bytes of its B tile from `bq`, are readable.
#[inline(always)]
unsafe fn products(w: *const u8, rb: usize, bq: *const i8, b: usize) {
    let wa = w.wrapping_add(b * BLOCK + 2);
    let wb = wa.wrapping_add(16 * rb);
    let bt = bq.wrapping_add(b * B_TILE);
    // SAFETY: the caller's contract; the loads read 16 rows of 32 bytes
    // `rb` apart from `wa` and `wb`, 8 rows of 64 bytes from `bt`.
    unsafe {
        if b.is_multiple_of(2) {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tileloadd tmm4, [{wa} + {rb} * 1]",
                "tileloadd tmm5, [{wb} + {rb} * 1]",
                "tileloadd tmm6, [{bt} + {s} * 1]",
                "tdpbssd tmm0, tmm4, tmm6",
                "tdpbssd tmm1, tmm5, tmm6",
                wa = in(reg) wa, wb = in(reg) wb, rb = in(reg) rb,
                bt = in(reg) bt, s = in(reg) 64usize,
                options(nostack, readonly)
            );
        } else {
            asm!(
                "tilezero tmm2",
                "tilezero tmm3",
                "tileloadd tmm4, [{wa} + {rb} * 1]",
                "tileloadd tmm5, [{wb} + {rb} * 1]",
                "tileloadd tmm6, [{bt} + {s} * 1]",
                "tdpbssd tmm2, tmm4, tmm6",
                "tdpbssd tmm3, tmm5, tmm6",
                wa = in(reg) wa, wb = in(reg) wb, rb = in(reg) rb,
                bt = in(reg) bt, s = in(reg) 64usize,
                options(nostack, readonly)
            );
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
    // SAFETY: `out` is 32 rows of 64 bytes; each tile stores 16 of them.
    unsafe {
        if set == 0 {
            asm!(
                "tilestored [{o} + {s} * 1], tmm0",
                "tilestored [{o} + {s} * 1 + 1024], tmm1",
                o = in(reg) o, s = in(reg) 64usize,
                options(nostack)
            );
        } else {
            asm!(
                "tilestored [{o} + {s} * 1], tmm2",
                "tilestored [{o} + {s} * 1 + 1024], tmm3",
                o = in(reg) o, s = in(reg) 64usize,
                options(nostack)
            );
        }
    }
}
