//! Products of several activation rows (prefill, batched decode steps)
//! on Intel AMX-INT8 tiles (`tdpbssd`, Sapphire Rapids and later), for
//! Q8_0 (`q8_0.rs`), Q4_K, Q5_K and Q6_K (`k_quants.rs`) weights.
//!
//! The weights are the A tiles: 16 weight rows' quants, 16 rows of up to
//! 64 bytes. Q8_0's are loaded in place, 32 at a time out of the file's
//! blocks; the K-quants' are unpacked per call, a super-block of a panel
//! at a time, with their sub-block scales folded in (`k_quants.rs`). The
//! activations are the B tile, regrouped once per call into the layout
//! the instruction wants (row `c`: quants `4c..4c + 4` of 16 activation
//! rows side by side); they are few beside the weights. One `tdpbssd`
//! makes 16 × 16 integer sums, exact in i32.
//!
//! The scales then follow `scalar.rs` to the bit, one weight row per
//! register with the activation rows in its lanes: a row's result is the
//! same bits as on every other path, whatever `m`. The sums reach the
//! vector registers through memory (`tilestored`), and a vector load that
//! meets a tile store still in flight waits for it to retire: read right
//! after its store, each block was a round trip (45 multiply-adds a
//! cycle). So one buffer of sums is stored while the other, stored a step
//! earlier, is read.

use metrale_core::GgmlType;

use super::act::ActRow;
use super::matrix::QuantMatrix;
use super::{QuantIsa, run_tasks};
use crate::cpu::amx_os;
use crate::cpu::team::Team;

mod k_quants;
mod q8_0;

/// Weight rows per panel: two A tiles.
const WR: usize = 32;
/// Activation rows per B tile: its 16 i32 columns.
const AR: usize = 16;

/// Fewest activation rows the tiles take for weights of type `ty` (a
/// tile of 16 holds fewer as zeros, and the K-quants are unpacked per
/// call). `examples/quant_rows`, 2 threads, 1024x4096 and 3072x768,
/// against the other kernels: Q8_0 4 rows 0.60-0.71x, 6 rows 1.08x, 8 rows
/// 1.16-1.47x, 16 rows 2.1-2.6x; Q4_K 8 rows 1.01x, 10 rows 1.19x, 16 rows
/// 1.73-1.79x; Q5_K as Q4_K; Q6_K 16 rows 0.93-1.15x, 24 rows
/// 1.08-1.28x, 32 rows 1.41-1.69x; at 512 rows (prefill) Q8_0 1.2-1.4x,
/// Q4_K 1.0-1.4x, Q5_K 4.2x (it has no VNNI panels), Q6_K 1.1-1.8x.
fn min_rows(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q8_0 => 8,
        GgmlType::Q4K | GgmlType::Q5K => 10,
        _ => 24,
    }
}

/// Whether this CPU and OS run AMX-INT8 tiles for this process.
pub(crate) fn available() -> bool {
    amx_os::available(amx_os::Unit::Int8)
}

/// Whether [`matmul`] takes `m` activation rows of `w`: Q8_0 in GGUF's
/// row layout, Q4_K, Q5_K or Q6_K in either layout, at least one panel of rows,
/// tiles allowed and available.
pub(super) fn takes(isa: QuantIsa, tiles: bool, w: &QuantMatrix<'_>, m: usize) -> bool {
    let format = match w.ty() {
        GgmlType::Q8_0 => !w.is_grouped(),
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => true,
        _ => false,
    };
    tiles
        && format
        && isa == QuantIsa::Vnni
        && w.rows() >= WR
        && m >= min_rows(w.ty())
        && available()
}

/// `out[i * n + j] = dot(acts[i], w[j])` for the weight rows `j < n / WR
/// · WR`, which it returns; the rest are the caller's. The bits of
/// `scalar.rs`.
///
/// `w` and the rows as [`takes`] says; every activation row quantized as
/// `w`'s type wants and as long as a weight row, `out` at least
/// `acts.len() · n` floats (`quant_matmul_with` checks both).
pub(super) fn matmul(
    team: Option<&Team>,
    w: QuantMatrix<'_>,
    acts: &[ActRow<'_>],
    out: &mut [f32],
) -> usize {
    if w.ty() == GgmlType::Q8_0 {
        q8_0::matmul(team, w, acts, out)
    } else {
        k_quants::matmul(team, w, acts, out)
    }
}

/// Panels per task: prefill is compute-bound, eight shares a thread, so
/// that a thread held up leaves the others little to wait for; a step
/// streams its weights, shares of 1 MiB or more, as `quant_matmul_with`'s.
fn share(team: Option<&Team>, w: &QuantMatrix<'_>, m: usize) -> usize {
    let threads = team.map_or(1, Team::threads);
    let per_thread = if m > 64 {
        8
    } else {
        (w.bytes() >> 20).clamp(1, 8)
    };
    (w.rows() / WR).div_ceil(threads * per_thread).max(1)
}

/// Asks for `bytes` in L2, a touch per 64-byte line.
fn prefetch_l2(bytes: &[u8]) {
    use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
    for line in bytes.chunks(64) {
        // SAFETY: a prefetch never faults; the address is inside `bytes`.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast()) };
    }
}

/// The activation rows as B tiles of `kb`-wide sub-blocks, and their
/// scales: per group of `AR` rows (the last padded with zero quants),
/// sub-block `s`'s tile at word `s · kb / 4 · AR` of `q`, its row `c`
/// holding row `t`'s quants `4c..4c + 4` in word `c · AR + t`; then
/// `scales(rows, f, i)` fills the group's `fn_` f32 and `in_` i32 words.
/// The groups spread over the team: alone, a 512-row prompt's regrouping
/// was a tenth of the product's time.
fn regroup(
    team: Option<&Team>,
    acts: &[ActRow<'_>],
    kb: usize,
    q: &mut Vec<u32>,
    (f, fn_): (&mut Vec<f32>, usize),
    (i, in_): (&mut Vec<i32>, usize),
    scales: &FillScales<'_>,
) {
    let (groups, k) = (
        acts.len().div_ceil(AR),
        acts.first().map_or(0, |a| a.qs.len()),
    );
    let qn = k / 4 * AR;
    q.resize(groups * qn, 0);
    f.resize(groups * fn_, 0.0);
    i.resize(groups * in_, 0);
    let dst = GroupsOut(q.as_mut_ptr(), f.as_mut_ptr(), i.as_mut_ptr());
    let run = |g: usize| {
        // SAFETY: group `g`'s ranges are inside the arrays (sized above),
        // and task `g` alone writes them.
        let (qg, fg, ig) = unsafe { dst.group(g, qn, fn_, in_) };
        let rows = &acts[g * AR..(g * AR + AR).min(acts.len())];
        if rows.len() < AR {
            // The missing rows' quants and scales as zeros (a full group
            // writes every word).
            qg.fill(0);
            fg.fill(0.0);
            ig.fill(0);
        }
        for (t, a) in rows.iter().enumerate() {
            for (s, sub) in a.qs.chunks_exact(kb).enumerate() {
                let tile = &mut qg[s * kb / 4 * AR..(s + 1) * kb / 4 * AR];
                for (c, four) in sub.chunks_exact(4).enumerate() {
                    tile[c * AR + t] = u32::from_le_bytes([
                        four[0] as u8,
                        four[1] as u8,
                        four[2] as u8,
                        four[3] as u8,
                    ]);
                }
            }
        }
        scales(rows, fg, ig);
    };
    run_tasks(team.filter(|_| groups > 1), groups, &run);
}

/// What [`regroup`] calls per group: its rows, its f32 and i32 words.
type FillScales<'a> = dyn Fn(&[ActRow<'_>], &mut [f32], &mut [i32]) + Sync + 'a;

/// One group's quants, f32 and i32 words, as [`regroup`]'s tasks write them.
type GroupSlices<'a> = (&'a mut [u32], &'a mut [f32], &'a mut [i32]);

/// Where [`regroup`]'s tasks write: disjoint groups of the arrays.
#[derive(Clone, Copy)]
struct GroupsOut(*mut u32, *mut f32, *mut i32);
// SAFETY: each task writes its own group's ranges only (see `regroup`).
unsafe impl Send for GroupsOut {}
unsafe impl Sync for GroupsOut {}

impl GroupsOut {
    /// Group `g`'s ranges: `qn` quants, `fn_` and `in_` words.
    ///
    /// # Safety
    /// They must lie inside the arrays, and no other live reference may
    /// touch them.
    #[allow(clippy::mut_from_ref)]
    unsafe fn group(&self, g: usize, qn: usize, fn_: usize, in_: usize) -> GroupSlices<'_> {
        // SAFETY: the caller's contract.
        unsafe {
            (
                std::slice::from_raw_parts_mut(self.0.add(g * qn), qn),
                std::slice::from_raw_parts_mut(self.1.add(g * fn_), fn_),
                std::slice::from_raw_parts_mut(self.2.add(g * in_), in_),
            )
        }
    }
}
