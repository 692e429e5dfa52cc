//! The weight panels: `DType::BF16Panels` made at load (`pack_in_place`),
//! a row-major operand packed per call (`pack`), and a panel as a kernel
//! reads it (`panel`; `tile_panel` pads it to whole AMX tiles).

use half::bf16;

#[cfg(target_arch = "x86_64")]
use super::x86;
use super::{NR, Operand, amx_pairs, available};

/// Panel `t` of an `[n, k]` operand packed at load: its `NR` columns (fewer
/// for the last) of `k.div_ceil(2)` pairs each.
pub(super) fn panel_pairs(p: &[u32], t: usize, n: usize, k: usize) -> &[u32] {
    let (j0, kp) = (t * NR, k.div_ceil(2));
    &p[j0 * kp..(j0 + NR.min(n - j0)) * kp]
}

/// One panel of an operand as the micro-tile reads it: `kp` rows of
/// `stride` pairs.
pub(super) struct Panel<'p> {
    pub(super) pairs: &'p [u32],
    pub(super) stride: usize,
}

/// Panel `t` (columns `t * NR..t * NR + cols`) of `w`: in place when packed
/// at load, else packed into `buf`.
pub(super) fn panel<'p>(
    w: Operand<'p>,
    buf: &'p mut Vec<u32>,
    t: usize,
    n: usize,
    k: usize,
    tiles: bool,
) -> Panel<'p> {
    if tiles {
        return tile_panel(w, buf, t, n, k);
    }
    let (kp, j0) = (k.div_ceil(2), t * NR);
    let cols = NR.min(n - j0);
    match w {
        Operand::Panels(p) => Panel {
            pairs: panel_pairs(p, t, n, k),
            stride: cols,
        },
        Operand::Rows(w) => {
            // `pack` overwrites the whole panel: no need to clear it.
            buf.resize(kp * NR, 0);
            pack(w, k, kp, j0, cols, buf);
            Panel {
                pairs: buf,
                stride: NR,
            }
        }
    }
}

/// [`panel`] for [`Kernel::Amx`]: `NR` columns and [`amx_pairs`] pairs,
/// the missing ones zeros. A full panel packed at load whose pairs fill
/// whole tiles (every matrix of the bench shapes) is read in place.
fn tile_panel<'p>(
    w: Operand<'p>,
    buf: &'p mut Vec<u32>,
    t: usize,
    n: usize,
    k: usize,
) -> Panel<'p> {
    let (kp, kpa, j0) = (k.div_ceil(2), amx_pairs(k), t * NR);
    let cols = NR.min(n - j0);
    match w {
        Operand::Panels(p) if cols == NR && kp == kpa => {
            return Panel {
                pairs: panel_pairs(p, t, n, k),
                stride: NR,
            };
        }
        Operand::Panels(p) => {
            buf.clear();
            buf.resize(kpa * NR, 0);
            let src = panel_pairs(p, t, n, k);
            for (dst, src) in buf.chunks_exact_mut(NR).zip(src.chunks_exact(cols)) {
                dst[..cols].copy_from_slice(src);
            }
        }
        Operand::Rows(w) => {
            buf.resize(kpa * NR, 0);
            pack(w, k, kp, j0, cols, buf);
            buf[kp * NR..].fill(0);
        }
    }
    Panel {
        pairs: buf,
        stride: NR,
    }
}

/// Packs rows `j0..j0 + cols` of `w` as `panel[p * NR + r] = pair p of row r`
/// (missing rows and an odd last element as zeros).
fn pack(w: &[bf16], k: usize, kp: usize, j0: usize, cols: usize, panel: &mut [u32]) {
    #[cfg(target_arch = "x86_64")]
    if cols == NR && k.is_multiple_of(2) {
        let rows = &w[j0 * k..(j0 + NR) * k];
        // SAFETY: callers checked `available()`; `rows` holds NR rows of `k`
        // (even) elements and `panel` `kp * NR` pairs.
        unsafe { x86::pack_full(rows, kp, panel) };
        return;
    }
    pack_scalar(w, k, kp, j0, cols, NR, panel);
}

/// [`pack`] without vectors, into panels `stride >= cols` wide.
fn pack_scalar(
    w: &[bf16],
    k: usize,
    kp: usize,
    j0: usize,
    cols: usize,
    stride: usize,
    panel: &mut [u32],
) {
    for r in 0..stride {
        if r >= cols {
            for p in 0..kp {
                panel[p * stride + r] = 0;
            }
            continue;
        }
        let row = &w[(j0 + r) * k..(j0 + r + 1) * k];
        for p in 0..kp {
            let lo = row[2 * p].to_bits() as u32;
            let hi = row.get(2 * p + 1).map_or(0, |v| v.to_bits() as u32);
            panel[p * stride + r] = lo | (hi << 16);
        }
    }
}

/// Rewrites `w`, an `[n, k]` row-major bf16 matrix held as `n · k / 2`
/// pairs (`k` even), into [`DType::BF16Panels`](metrale_core::DType::BF16Panels)
/// in place, the panels in parallel on the calling rayon pool.
pub(crate) fn pack_in_place(w: &mut [u32], n: usize, k: usize) {
    assert!(k.is_multiple_of(2) && w.len() == n * k / 2);
    let kp = k / 2;
    if kp == 0 {
        return;
    }
    use rayon::prelude::*;
    w.par_chunks_mut(NR * kp).for_each(|region| {
        let cols = region.len() / kp;
        let rows: Vec<bf16> = region
            .iter()
            .flat_map(|&v| [bf16::from_bits(v as u16), bf16::from_bits((v >> 16) as u16)])
            .collect();
        if cols == NR && available() {
            pack(&rows, k, kp, 0, NR, region);
        } else {
            pack_scalar(&rows, k, kp, 0, cols, cols, region);
        }
    });
}

/// Row `row` of an `[n, k]` matrix in panels (`n · k / 2` pairs), widened.
pub(crate) fn panel_row(w: &[u32], n: usize, k: usize, row: usize, out: &mut [f32]) {
    let kp = k / 2;
    let (j0, r) = (row / NR * NR, row % NR);
    let cols = NR.min(n - j0);
    let panel = &w[j0 * kp..(j0 + cols) * kp];
    for (p, o) in out.chunks_exact_mut(2).enumerate() {
        let v = panel[p * cols + r];
        o[0] = f32::from_bits(v << 16);
        o[1] = f32::from_bits(v & 0xffff_0000);
    }
}
