//! Intel AMX (Advanced Matrix Extensions) tiles for the bf16 GEMM
//! ([`Kernel::Amx`](super::Kernel::Amx)): Sapphire Rapids and later.
//!
//! One `tdpbf16ps` multiplies a 16×32 bf16 tile of activations by a 32×16
//! one of weights into a 16×16 f32 tile: 8192 multiply-adds, where a
//! 512-bit FMA does 16. The weights' B tiles are read straight out of the
//! panels packed at load: a B tile's row `p` is pair `p` of 16 weight rows,
//! 64 bytes, which is how a panel holds them (`panel[p * NR + r]`), 128
//! bytes (`NR` pairs) apart. So a panel of `NR` = 32 columns is two B tiles
//! per 16 pairs of `k`, loaded with a stride of 128 bytes.
//!
//! Batch invariance: row `r` of an output tile is computed from row `r` of
//! the activation tile and the weight tile alone, and every tile of a
//! product takes its chunks of `k` in the same order with the same
//! instruction, whatever `m`. So a row's sums are bitwise the same alone or
//! among others (the tests check it on this hardware).
//!
//! What the CPU and OS grant, and the per-thread tile configuration, are
//! `cpu/amx_os.rs`'s.

use std::arch::asm;

use super::{Lookahead, NR};
use crate::cpu::amx_os;

/// Rows of a tile, and pairs of `k` per tile (64 bytes a row).
pub(super) const TILE: usize = 16;
/// Activation rows per micro-tile: two activation tiles.
pub(super) const AMX_MR: usize = 2 * TILE;
/// Bytes between a panel's pairs: a B tile's row stride.
const PANEL_STRIDE: usize = NR * 4;
/// Bytes of one chunk of a panel: `TILE` pairs of its `NR` columns.
const CHUNK_BYTES: usize = TILE * PANEL_STRIDE;

/// Whether this CPU and OS run AMX-BF16 tiles for this process.
pub(super) fn available() -> bool {
    amx_os::available(amx_os::Unit::Bf16)
}

/// This thread's tile registers, configured for [`tile`]: the weight
/// tiles (6, 7) of 16 rows, the activation (4, 5) and output tiles (0-3)
/// of `rows`, all of 64-byte rows.
pub(super) struct Tiles {
    /// Rows of the activation and output tiles (16, or fewer for a product
    /// of fewer rows).
    rows: usize,
    _tiles: amx_os::Tiles,
}

impl Tiles {
    /// Tiles for a product of `m` rows: activation and output tiles of
    /// `m.min(16)` rows. A lone decode row then loads one row of
    /// activations a chunk, not sixteen (the rows beyond a product's
    /// last are never read back, and a row's result depends on its own
    /// row alone).
    ///
    /// # Safety
    /// [`available`] must have returned true.
    pub(super) unsafe fn configure(m: usize) -> Tiles {
        let rows = m.clamp(1, TILE);
        let shapes = std::array::from_fn(|t| {
            let r = if t >= 6 { TILE } else { rows };
            (r as u8, 64)
        });
        // SAFETY: AMX-BF16 is available (the caller's contract); every
        // shape is at most 16 rows of 64 bytes.
        let tiles = unsafe { amx_os::Tiles::configure(&amx_os::Config::new(shapes)) };
        Tiles {
            rows,
            _tiles: tiles,
        }
    }
}

/// `out[r][c] = Σ_p dot2(a[r * kp + p], panel[p * NR + c])` for `r < rows
/// <= AMX_MR` and `c < NR`, by 16-pair chunks of `k` in order: two B tiles
/// (the panel's two halves) per chunk, times one activation tile (up to 16
/// rows) or two (up to 32). Rows of the activation tiles past `rows` (up
/// to the tiles' configured rows) are read and their ignored output rows
/// written: a row's result depends on its own row alone.
///
/// `ahead` is told of every chunk twice (see [`Lookahead`]): a lone
/// tile's chunk between its two weight tiles, so that the next panel's
/// prefetches go out in two bursts of 16 lines, not one of 32 (measured
/// no worse, in the noise).
///
/// # Safety
/// `tiles` proves this thread's tiles are configured, for `rows` rows or
/// more (a product of `m` rows has tiles of `m.min(16)`). `a` holds
/// `rows.next_multiple_of(16)` rows of `kp` pairs, `kp` a multiple of 16,
/// and `panel` `kp * NR` pairs.
pub(super) unsafe fn tile(
    tiles: &Tiles,
    a: &[u32],
    rows: usize,
    kp: usize,
    panel: &[u32],
    ahead: &mut Lookahead<'_>,
    out: &mut [[f32; NR]; AMX_MR],
) {
    assert!(rows > 0 && rows <= AMX_MR && kp.is_multiple_of(TILE));
    assert!(rows <= TILE && tiles.rows >= rows || tiles.rows == TILE);
    assert!(a.len() >= rows.next_multiple_of(TILE) * kp && panel.len() >= kp * NR);
    let a_stride = kp * 4;
    let (a0, b) = (a.as_ptr(), panel.as_ptr().cast::<u8>());
    let two = rows > TILE;
    // SAFETY: the tiles are configured (`tiles`); tile zeroing touches no
    // memory.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem)
        )
    };
    for c in 0..kp / TILE {
        // SAFETY: chunk `c`'s activation tiles are up to 16 rows (the
        // configured ones, no more than `rows.next_multiple_of(16)`) of 64 bytes at
        // `a + (row0 * kp + 16 c) * 4`, rows `a_stride` apart, inside `a`
        // (rows `0..16`, and `16..32` when `two`); its B tiles are 16 rows of
        // 64 bytes at `panel + c * CHUNK_BYTES` (+ 64), 128 bytes apart,
        // inside the panel's `kp * NR` pairs.
        unsafe {
            let a_c = a0.add(c * TILE).cast::<u8>();
            let b_c = b.add(c * CHUNK_BYTES);
            if two {
                asm!(
                    "tileloadd tmm4, [{a} + {sa} * 1]",
                    "tileloadd tmm5, [{a2} + {sa} * 1]",
                    "tileloadd tmm6, [{b} + {sb} * 1]",
                    "tileloadd tmm7, [{b} + {sb} * 1 + 64]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    a = in(reg) a_c,
                    a2 = in(reg) a_c.add(TILE * a_stride),
                    sa = in(reg) a_stride,
                    b = in(reg) b_c,
                    sb = in(reg) PANEL_STRIDE,
                    options(nostack, readonly)
                );
                ahead.step();
            } else {
                asm!(
                    "tileloadd tmm4, [{a} + {sa} * 1]",
                    "tileloadd tmm6, [{b} + {sb} * 1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    a = in(reg) a_c,
                    sa = in(reg) a_stride,
                    b = in(reg) b_c,
                    sb = in(reg) PANEL_STRIDE,
                    options(nostack, readonly)
                );
                ahead.step();
                asm!(
                    "tileloadd tmm7, [{b} + {sb} * 1 + 64]",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    b = in(reg) b_c,
                    sb = in(reg) PANEL_STRIDE,
                    options(nostack, readonly)
                );
            }
        }
        ahead.step();
    }
    let o = out.as_mut_ptr().cast::<u8>();
    // SAFETY: `out` is 32 rows of NR f32 (128 bytes): tiles 0 and 1 fill
    // rows 0..16 (bytes 0..64 and 64..128 of each), tiles 2 and 3 rows
    // 16..32.
    unsafe {
        asm!(
            "tilestored [{o} + {s} * 1], tmm0",
            "tilestored [{o} + {s} * 1 + 64], tmm1",
            o = in(reg) o,
            s = in(reg) PANEL_STRIDE,
            options(nostack)
        );
        if two {
            asm!(
                "tilestored [{o} + {s} * 1], tmm2",
                "tilestored [{o} + {s} * 1 + 64], tmm3",
                o = in(reg) o.add(TILE * PANEL_STRIDE),
                s = in(reg) PANEL_STRIDE,
                options(nostack)
            );
        }
    }
}

/// `iters` rounds of four independent `tdpbf16ps` on tiles that stay in
/// the registers (no memory traffic): the FLOPs done, for the compute
/// probe of `metrale bench` (each is 16 × 16 × 32 multiply-adds).
///
/// # Safety
/// [`available`] must have returned true.
pub(super) unsafe fn peak_block(iters: usize) -> f64 {
    let ones = [0x3f80_3f80u32; 256]; // 16 rows of 16 pairs of bf16 1.0
    // SAFETY: AMX is available (the caller's contract); the loads read the
    // 1 KiB of `ones`, 64 bytes a row.
    unsafe {
        let tiles = Tiles::configure(TILE);
        asm!(
            "tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3",
            "tileloadd tmm4, [{p} + {s} * 1]",
            "tileloadd tmm5, [{p} + {s} * 1]",
            "tileloadd tmm6, [{p} + {s} * 1]",
            "tileloadd tmm7, [{p} + {s} * 1]",
            p = in(reg) ones.as_ptr(),
            s = in(reg) 64usize,
            options(nostack, readonly)
        );
        for _ in 0..iters {
            asm!(
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                options(nostack, nomem)
            );
        }
        drop(tiles);
    }
    (iters * 4 * TILE * TILE * 2 * TILE * 2) as f64
}
