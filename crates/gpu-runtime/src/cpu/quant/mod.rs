//! Matrix products with GGML block-quantized weights (GGUF checkpoints):
//! `out[i, j] = dot(x[i, :], w[j, :])` with `w` in Q8_0, Q4_0, Q4_1, Q5_0,
//! Q5_1, IQ4_NL, Q4_K, Q5_K or Q6_K.
//!
//! As llama.cpp does, the activations are quantized too, per block (Q8_0
//! for the 32-element formats, Q8_K for the K-quants; see `act.rs`), and
//! the dot products run on integers: a byte of weight times a byte of
//! activation, summed exactly in i32, the f32 scales applied once per
//! block. That is what makes them fast (one `vpdpbusd` multiplies 32 byte
//! pairs) and what lets every path give the same bits: `scalar.rs` defines
//! the order of the few f32 operations, and the AVX2 and AVX-512 VNNI
//! paths (`x86.rs`, chosen at run time) follow it.
//!
//! [`quant_matmul`] quantizes the activations once per call (rows spread
//! over the team), then splits the weight rows over the team's threads;
//! each weight row (a few KiB) is dotted with a tile of activation rows
//! (about 256 KiB of quants, which stay in L2) while it sits in L1, four
//! activation rows per kernel call so that each block is unpacked once per
//! four rows. A row's result does not depend on `m`, the tiling or the
//! thread count.
//!
//! The backend's matmuls call [`quant_matmul`] for `DType::Quant` weights,
//! and for `DType::QuantGroups`: matrices of the K-quants that
//! `pack_matmul_weight` regrouped at load ([`group_rows`]) where this CPU
//! has decode kernels for a whole group (`zmm.rs`), four rows read as one
//! stream with one fold and one f32 term for the four. Where the CPU has
//! AMX-INT8, Q8_0 and K-quant products of 8 or more activation rows
//! take its tiles (`tiles/`); elsewhere Q8_0 steps of a few rows (batched
//! decode) take `steps.rs`. Every other path gathers a grouped matrix's
//! rows back (a row's bytes per weight row and activation tile), so the
//! products are the same bits either way.

mod act;
mod matrix;
#[cfg(target_arch = "x86_64")]
mod packed;
mod scalar;
#[cfg(target_arch = "x86_64")]
mod steps;
#[cfg(target_arch = "x86_64")]
mod tiles;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod zmm;
#[cfg(target_arch = "x86_64")]
mod zmm_q8;

#[cfg(test)]
mod tests;

pub(crate) use act::ActRow;
pub use act::QuantScratch;
pub(crate) use matrix::dequantize_grouped_row;
pub use matrix::{QuantMatrix, group_rows};

use metrale_core::GgmlType;

use super::team::{OutPtr, Team};
use crate::error::{GpuError, Result};

/// The weight formats [`quant_matmul`] multiplies.
pub const SUPPORTED: [GgmlType; 9] = [
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Iq4Nl,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

/// Whether [`quant_matmul`] handles weights of type `ty`.
pub fn supports(ty: GgmlType) -> bool {
    SUPPORTED.contains(&ty)
}

/// Which dot-product code runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantIsa {
    /// AVX2 with AVX-512 VNNI's `vpdpbusd` on 256-bit registers, and
    /// AVX-512 BW for the K-quants' 512-bit kernels (`zmm.rs`).
    Vnni,
    Avx2,
    Portable,
}

impl QuantIsa {
    /// The best this CPU supports.
    pub fn detect() -> QuantIsa {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("f16c") {
                if has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512vnni") {
                    return QuantIsa::Vnni;
                }
                return QuantIsa::Avx2;
            }
        }
        QuantIsa::Portable
    }

    /// Every ISA this CPU can run (for tests and benches).
    pub fn available() -> Vec<QuantIsa> {
        match Self::detect() {
            QuantIsa::Vnni => vec![QuantIsa::Vnni, QuantIsa::Avx2, QuantIsa::Portable],
            QuantIsa::Avx2 => vec![QuantIsa::Avx2, QuantIsa::Portable],
            QuantIsa::Portable => vec![QuantIsa::Portable],
        }
    }
}

/// Whether `ty`'s activations are Q8_K (else Q8_0).
fn uses_q8_k(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K)
}

/// The format the activations are quantized to before they meet weights of
/// type `ty`: Q8_K for the K-quants, Q8_0 for the others (Q4_1 and Q5_1
/// also use each block's sum, Q8_1's `s`, rounded to f16).
pub fn activation_format(ty: GgmlType) -> GgmlType {
    if uses_q8_k(ty) {
        GgmlType::Q8K
    } else {
        GgmlType::Q8_0
    }
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// Packed weight panels (`packed.rs`), per pool thread, reused.
    static PACKED: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Bytes of quantized activations a prefill tile holds (half of a Zen 4 or
/// recent Intel core's L2, leaving room for the weights streaming past).
const ACT_TILE_BYTES: usize = 256 << 10;

/// Activation rows from which Q4_K, Q6_K and Q8_0 weights are packed
/// sixteen rows at a time (`packed.rs`; VNNI only): below it repacking
/// every weight row on every call costs more than it saves. Measured on
/// batched decode (Q4_K_M, 64-token prompts, two interleaved rounds, from
/// 8 rows packed to 33): Llama-370M batch 8 48 -> 121-123 tok/s, 16 83-86
/// -> 144-145, 32 138-140 -> 163-165; Granite-350M 55 -> 131-134, 94 ->
/// 148-149, 143-148 -> 158-159.
const PACKED_MIN_ROWS: usize = 33;

/// Activation rows one kernel call takes (each weight block is unpacked
/// once for all of them).
pub(crate) const MAX_ROWS: usize = 4;

/// `$body` with `$a`'s first rows (a slice of 1 to [`MAX_ROWS`] activation
/// rows; nothing for none) as an array reference of their count, `$r` that
/// count as a constant: the kernels' row counts are const generics.
macro_rules! by_tile {
    ($a:expr, |$arr:ident, $r:ident| $body:expr) => {{
        match $a {
            [] => {}
            [a0] => {
                const $r: usize = 1;
                let $arr = &[*a0];
                $body
            }
            [a0, a1] => {
                const $r: usize = 2;
                let $arr = &[*a0, *a1];
                $body
            }
            [a0, a1, a2] => {
                const $r: usize = 3;
                let $arr = &[*a0, *a1, *a2];
                $body
            }
            [a0, a1, a2, a3, ..] => {
                const $r: usize = 4;
                let $arr = &[*a0, *a1, *a2, *a3];
                $body
            }
        }
    }};
}
use by_tile;

/// Tasks `0..count` on the team, or in turn on this thread without one.
fn run_tasks(team: Option<&Team>, count: usize, run: &(dyn Fn(usize) + Sync)) {
    match team {
        Some(team) => team.run(count, run),
        None => (0..count).for_each(run),
    }
}

/// `dot(w, a[r])` for `r < R`: one weight row (`w`, whole blocks of `ty`)
/// with `R` quantized activation rows of as many blocks.
///
/// `isa` must be one of [`QuantIsa::available`]; lengths are the caller's
/// to check (`quant_matmul` does).
#[inline]
fn dot_rows<const R: usize>(
    isa: QuantIsa,
    ty: GgmlType,
    w: &[u8],
    a: &[ActRow<'_>; R],
) -> [f32; R] {
    #[cfg(target_arch = "x86_64")]
    {
        use x86::*;
        // `$m`'s kernels, the K-quants' from `$k`.
        macro_rules! go {
            ($m:ident, $k:ident) => {
                // SAFETY: `isa` was detected on this CPU (the caller's
                // contract), and `w` and every `a[r]` hold the same number
                // of whole blocks (checked by `quant_matmul`, asserted in
                // debug builds).
                unsafe {
                    match ty {
                        GgmlType::Q8_0 => $m::dot32::<Q8_0, R>(ty, w, a),
                        GgmlType::Q4_0 => $m::dot32::<Q4_0, R>(ty, w, a),
                        GgmlType::Q4_1 => $m::dot32::<Q4_1, R>(ty, w, a),
                        GgmlType::Q5_0 => $m::dot32::<Q5_0, R>(ty, w, a),
                        GgmlType::Q5_1 => $m::dot32::<Q5_1, R>(ty, w, a),
                        GgmlType::Iq4Nl => $m::dot32::<IQ4_NL, R>(ty, w, a),
                        GgmlType::Q4K => $k::dot_q45_k::<false, R>(w, a),
                        GgmlType::Q5K => $k::dot_q45_k::<true, R>(w, a),
                        GgmlType::Q6K => $k::dot_q6_k::<R>(w, a),
                        _ => unreachable!("{ty} is not supported"),
                    }
                }
            };
        }
        // (Lengths: checked once per call by `quant_matmul_with`; a debug
        // assertion here, per weight row, cost decode a few percent.)
        match isa {
            // The K-quants on 512-bit registers (`Vnni` includes AVX-512 BW).
            QuantIsa::Vnni => return go!(vnni, zmm),
            QuantIsa::Avx2 => return go!(avx2, avx2),
            QuantIsa::Portable => {}
        }
    }
    std::array::from_fn(|r| scalar::vec_dot(ty, w, a[r]))
}

/// One weight row's dot product with one activation row.
type DecodeKernel = fn(&[u8], &[ActRow<'_>; 1]) -> [f32; 1];

/// Decode's kernel for `ty` on `isa`, resolved once per call, where one is
/// worth it (the formats of Q4_K_M, Q5_K_M, Q6_K and Q8_0 files on AVX-512
/// and AVX2; else `None`, and [`vec_dot_rows`] dispatches per row).
///
/// `isa` must be one of [`QuantIsa::available`] (the pointers returned call
/// its kernels).
fn decode_kernel(isa: QuantIsa, ty: GgmlType) -> Option<DecodeKernel> {
    // SAFETY (each kernel below): `isa` was detected on this CPU (the
    // caller's contract), and `quant_matmul_with` checked that every row
    // holds as many whole blocks as the activation row.
    #[cfg(target_arch = "x86_64")]
    {
        use x86::{Q8_0, avx2, vnni};
        let kernel: DecodeKernel = match (isa, ty) {
            (QuantIsa::Vnni, GgmlType::Q4K) => |w, a| unsafe { zmm::dot_q45_k::<false, 1>(w, a) },
            (QuantIsa::Vnni, GgmlType::Q5K) => |w, a| unsafe { zmm::dot_q45_k::<true, 1>(w, a) },
            (QuantIsa::Vnni, GgmlType::Q6K) => |w, a| unsafe { zmm::dot_q6_k::<1>(w, a) },
            (QuantIsa::Vnni, GgmlType::Q8_0) => {
                |w, a| unsafe { vnni::dot32::<Q8_0, 1>(GgmlType::Q8_0, w, a) }
            }
            (QuantIsa::Avx2, GgmlType::Q4K) => |w, a| unsafe { avx2::dot_q45_k::<false, 1>(w, a) },
            (QuantIsa::Avx2, GgmlType::Q5K) => |w, a| unsafe { avx2::dot_q45_k::<true, 1>(w, a) },
            (QuantIsa::Avx2, GgmlType::Q6K) => |w, a| unsafe { avx2::dot_q6_k::<1>(w, a) },
            (QuantIsa::Avx2, GgmlType::Q8_0) => {
                |w, a| unsafe { avx2::dot32::<Q8_0, 1>(GgmlType::Q8_0, w, a) }
            }
            _ => return None,
        };
        Some(kernel)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (isa, ty);
        None
    }
}

/// Rows per group of the grouped layout ([`QuantMatrix::grouped`]).
const GROUP: usize = metrale_core::QUANT_GROUP_ROWS;

/// A grouped matrix's group of [`GROUP`] rows dotted with one activation row.
type GroupKernel = fn(&[u8], &ActRow<'_>) -> [f32; GROUP];

/// Decode's kernel for a whole group of a grouped matrix of `ty` on `isa`
/// (the K-quants on AVX-512); `None` where there is none, and the rows are
/// gathered one by one.
///
/// `isa` must be one of [`QuantIsa::available`].
fn group_kernel(isa: QuantIsa, ty: GgmlType) -> Option<GroupKernel> {
    // SAFETY (each kernel below): `isa` was detected on this CPU (the
    // caller's contract), and `quant_matmul_with` checked that every group
    // holds GROUP rows of as many whole blocks as the activation row.
    #[cfg(target_arch = "x86_64")]
    {
        let kernel: GroupKernel = match (isa, ty) {
            (QuantIsa::Vnni, GgmlType::Q4K) => {
                |w, a| unsafe { zmm::dot_q45_k_group::<false>(w, a) }
            }
            (QuantIsa::Vnni, GgmlType::Q5K) => |w, a| unsafe { zmm::dot_q45_k_group::<true>(w, a) },
            (QuantIsa::Vnni, GgmlType::Q6K) => |w, a| unsafe { zmm::dot_q6_k_group(w, a) },
            _ => return None,
        };
        Some(kernel)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (isa, ty);
        None
    }
}

/// Whether decode has a group kernel for `ty` on this CPU: what makes
/// grouping `ty`'s weights at load worth it.
pub fn groups_pay(ty: GgmlType) -> bool {
    group_kernel(QuantIsa::detect(), ty).is_some()
}

/// `out[r] = dot(w, a[r])` for up to [`MAX_ROWS`] activation rows.
pub(crate) fn vec_dot_rows(
    isa: QuantIsa,
    ty: GgmlType,
    w: &[u8],
    a: &[ActRow<'_>],
    out: &mut [f32],
) {
    fn arr<'a, 'b, const R: usize>(a: &'b [ActRow<'a>]) -> &'b [ActRow<'a>; R] {
        a.try_into().expect("R rows")
    }
    match a.len() {
        0 => {}
        1 => out[..1].copy_from_slice(&dot_rows::<1>(isa, ty, w, arr(a))),
        2 => out[..2].copy_from_slice(&dot_rows::<2>(isa, ty, w, arr(a))),
        3 => out[..3].copy_from_slice(&dot_rows::<3>(isa, ty, w, arr(a))),
        4 => out[..4].copy_from_slice(&dot_rows::<4>(isa, ty, w, arr(a))),
        n => panic!("{n} activation rows (at most {MAX_ROWS})"),
    }
}

/// `dot(w, a)`: one weight row with one activation row (for single dot
/// products, e.g. routed experts; the tests use it).
#[cfg_attr(not(test), allow(dead_code))]
#[inline]
pub(crate) fn vec_dot(isa: QuantIsa, ty: GgmlType, w: &[u8], a: ActRow<'_>) -> f32 {
    debug_assert_eq!(
        w.len() / ty.block_bytes() * ty.block_elems(),
        a.qs.len(),
        "weight and activation rows differ"
    );
    dot_rows::<1>(isa, ty, w, &[a])[0]
}

/// `out[i * n + j] = dot(x[i * k..][..k], w[j])` for `i < m`, `j < n`,
/// with the best ISA this CPU has.
///
/// `scratch` holds the quantized activations (it grows to the largest `m·k`
/// seen; nothing else is allocated). With a team, weight rows are split
/// evenly over its threads.
pub(crate) fn quant_matmul(
    team: Option<&Team>,
    x: &[f32],
    w: QuantMatrix<'_>,
    out: &mut [f32],
    m: usize,
    scratch: &mut QuantScratch,
    tiles: bool,
) -> Result<()> {
    quant_matmul_with(QuantIsa::detect(), tiles, team, x, w, out, m, scratch)
}

/// Whether this CPU and OS run the AMX-INT8 tiles that [`quant_matmul`]
/// takes for Q8_0, Q4_K, Q5_K and Q6_K weights and 8 or more activation rows
/// where allowed (`tiles/`): the same bits as the other kernels, faster.
pub fn int8_tiles_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    return tiles::available();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// [`quant_matmul`] with a chosen ISA (one of [`QuantIsa::available`]),
/// and AMX-INT8 tiles allowed or not (used where the CPU has them).
#[allow(clippy::too_many_arguments)]
pub(crate) fn quant_matmul_with(
    isa: QuantIsa,
    tiles: bool,
    team: Option<&Team>,
    x: &[f32],
    w: QuantMatrix<'_>,
    out: &mut [f32],
    m: usize,
    scratch: &mut QuantScratch,
) -> Result<()> {
    let (n, k, ty) = (w.rows(), w.cols(), w.ty());
    if x.len() < m * k || out.len() < m * n {
        return Err(GpuError::Shape {
            op: "quant_matmul",
            detail: format!(
                "x holds {} floats, out {}: need {m}x{k} and {m}x{n}",
                x.len(),
                out.len()
            ),
        });
    }
    if !QuantIsa::available().contains(&isa) {
        return Err(GpuError::Unavailable(format!("{isa:?} on this CPU")));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let q8k = uses_q8_k(ty);
    if q8k {
        scratch.quantize_q8_k(team, x, m, k);
    } else {
        scratch.quantize_q8_0(team, x, m, k);
    }
    let scratch = &*scratch;
    let act = |i: usize| {
        if q8k {
            scratch.q8_k_row(i, k)
        } else {
            scratch.q8_0_row(i, k)
        }
    };
    debug_assert!(
        (0..m).all(|i| act(i).qs.len() == k),
        "weight and activation rows differ"
    );
    // Every activation row's slices, made once (not once per weight row:
    // that was a tenth of prefill's time); decode's one row on the stack.
    let one: [ActRow<'_>; 1];
    let many: Vec<ActRow<'_>>;
    let acts: &[ActRow<'_>] = if m == 1 {
        one = [act(0)];
        &one
    } else {
        many = (0..m).map(act).collect();
        &many
    };
    let threads = team.map_or(1, Team::threads);
    // Q8_0 and the K-quants on AMX-INT8 tiles, 32 weight rows a panel: the
    // rows past the last whole panel take the paths below.
    #[cfg(target_arch = "x86_64")]
    let n_tiled = if tiles::takes(isa, tiles, &w, m) {
        tiles::matmul(team, w, acts, out)
    } else {
        0
    };
    #[cfg(not(target_arch = "x86_64"))]
    let n_tiled = {
        let _ = tiles;
        0
    };
    if n_tiled == n {
        return Ok(());
    }
    // A few rows (batched decode) where a kernel takes several weight and
    // activation rows at once (`steps.rs`).
    #[cfg(target_arch = "x86_64")]
    if n_tiled == 0 && steps::takes(isa, &w, m) {
        steps::matmul_steps(isa, team, w, acts, out);
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    let n_packed = if n_tiled == 0
        && isa == QuantIsa::Vnni
        && matches!(ty, GgmlType::Q4K | GgmlType::Q6K | GgmlType::Q8_0)
        && m >= PACKED_MIN_ROWS
    {
        n / packed::NR * packed::NR
    } else {
        0
    };
    #[cfg(not(target_arch = "x86_64"))]
    let n_packed = 0;
    let tile = (ACT_TILE_BYTES / k.max(1)).max(MAX_ROWS) / MAX_ROWS * MAX_ROWS;
    #[cfg(target_arch = "x86_64")]
    if n_packed > 0 {
        let groups = n_packed / packed::NR;
        // Compute-bound: eight shares a thread whatever the matrix's size,
        // so that a thread held up (the host's other work, a slower core)
        // leaves the others at most an eighth of its part to wait for.
        let per_thread = 8;
        let share = groups.div_ceil(threads * per_thread).max(1);
        let nb = k / ty.block_elems();
        let ptr = OutPtr::new(out);
        let run = |t: usize| {
            let (g0, g1) = (t * share, ((t + 1) * share).min(groups));
            // The task's weight rows packed once (they are read once per
            // tile of activation rows), in this thread's reused buffer.
            let mut rows_buf = Vec::new();
            PACKED.with_borrow_mut(|buf| {
                let size = nb * packed::block_bytes(ty);
                buf.resize((g1 - g0) * size, 0);
                for (g, out) in (g0..g1).zip(buf.chunks_exact_mut(size)) {
                    let j0 = g * packed::NR;
                    let rows: [&[u8]; packed::NR] = w.rows_in(j0, &mut rows_buf);
                    match ty {
                        GgmlType::Q4K => packed::pack_q4_k(&rows, nb, out),
                        GgmlType::Q6K => packed::pack_q6_k(&rows, nb, out),
                        _ => packed::pack_q8_0(&rows, nb, out),
                    }
                }
                for t0 in (0..m).step_by(tile) {
                    let t1 = (t0 + tile).min(m);
                    for g in g0..g1 {
                        let j0 = g * packed::NR;
                        let panel = &buf[(g - g0) * size..(g - g0 + 1) * size];
                        for i0 in (t0..t1).step_by(MAX_ROWS) {
                            let r = MAX_ROWS.min(t1 - i0);
                            let a = &acts[i0..i0 + r];
                            by_tile!(a, |a, R| {
                                // SAFETY: `panel` holds nb packed blocks of the
                                // weights' format, every activation row nb
                                // blocks of the matching one (Q8_K for the
                                // K-quants, Q8_0 for Q8_0), and `isa` (VNNI) was
                                // detected on this CPU.
                                let v = unsafe {
                                    match ty {
                                        GgmlType::Q4K => packed::dot_q4_k_panel::<R>(panel, nb, a),
                                        GgmlType::Q6K => packed::dot_q6_k_panel::<R>(panel, nb, a),
                                        _ => packed::dot_q8_0_panel::<R>(panel, nb, a),
                                    }
                                };
                                for (u, row) in v.iter().enumerate() {
                                    // SAFETY: `(i0 + u) * n + j0 + NR <= m * n`
                                    // (checked above; `j0 + NR <= n_packed`);
                                    // task `t` alone writes columns of groups
                                    // `g0..g1`.
                                    unsafe { ptr.write_run((i0 + u) * n + j0, row) };
                                }
                            });
                        }
                    }
                }
            });
        };
        run_tasks(team, groups.div_ceil(share), &run);
        if n_packed == n {
            return Ok(());
        }
    }
    // A few shares per thread (the first to finish waits for at most a
    // small one), but about 1 MiB of weights or more each, as `gemv.rs`
    // found short streams cost bandwidth; whole groups when grouped.
    let per_thread = (w.bytes() >> 20).clamp(1, 8);
    // Past the rows the tiles or the panels took (at most one of them ran).
    let n_done = n_tiled.max(n_packed);
    let share = (n - n_done).div_ceil(threads * per_thread).max(1);
    let share = if w.is_grouped() {
        share.next_multiple_of(GROUP)
    } else {
        share
    };
    let ptr = OutPtr::new(out);
    // Prefill: the activation rows go in tiles of about `ACT_TILE_BYTES`
    // of quants, which stay in L2 while the task's weight rows stream past
    // them (each weight row is then read once per tile rather than once,
    // but a few hundred bytes of it against a tile's tens of KiB).
    // Decode: the kernels chosen once per call, not per row (a Granite row
    // of k = 768 is three super-blocks).
    let decode_row = if m == 1 { decode_kernel(isa, ty) } else { None };
    let decode_group = if m == 1 && w.is_grouped() {
        group_kernel(isa, ty)
    } else {
        None
    };
    let run = |t: usize| {
        let (j0, j1) = (n_done + t * share, (n_done + (t + 1) * share).min(n));
        // Rows gathered from the grouped layout (else unused).
        let mut buf = Vec::new();
        if let [a] = acts {
            let a = std::array::from_ref(a);
            let mut j = j0;
            // The task's bytes are read in order; the kernels prefetch
            // them ahead of their reads (`x86::prefetch_ahead`).
            if let Some(dot) = decode_group {
                // Whole groups (`j0` is a group's first row).
                while j + GROUP <= j1 {
                    let v = dot(w.group(j / GROUP).0, &a[0]);
                    for (r, val) in v.into_iter().enumerate() {
                        // SAFETY: `j + r < j1 <= n` (m = 1, so `out` holds
                        // n floats); task `t` alone writes `j0..j1`.
                        unsafe { ptr.write(j + r, val) };
                    }
                    j += GROUP;
                }
            }
            for j in j..j1 {
                let row = w.row_in(j, &mut buf);
                let v = match decode_row {
                    Some(dot) => dot(row, a)[0],
                    None => dot_rows::<1>(isa, ty, row, a)[0],
                };
                // SAFETY: as above.
                unsafe { ptr.write(j, v) };
            }
            return;
        }
        let mut vals = [0f32; MAX_ROWS];
        for t0 in (0..m).step_by(tile) {
            let t1 = (t0 + tile).min(m);
            for j in j0..j1 {
                let row = w.row_in(j, &mut buf);
                for i0 in (t0..t1).step_by(MAX_ROWS) {
                    let r = MAX_ROWS.min(t1 - i0);
                    vec_dot_rows(isa, ty, row, &acts[i0..i0 + r], &mut vals[..r]);
                    for (u, &v) in vals[..r].iter().enumerate() {
                        // SAFETY: `(i0 + u) * n + j < m * n <= out.len()`
                        // (checked above); task `t` alone writes columns
                        // `j0..j1`.
                        unsafe { ptr.write((i0 + u) * n + j, v) };
                    }
                }
            }
        }
    };
    run_tasks(team, (n - n_done).div_ceil(share), &run);
    Ok(())
}

impl super::CpuBackend {
    /// `out[i * n + j] = dot(x[i * k..][..k], w[j])` on this backend's
    /// threads: the entry point for benches and, until the quantized dtype
    /// lands, for callers holding GGUF weights in host memory.
    pub fn quant_matmul(
        &self,
        x: &[f32],
        w: QuantMatrix<'_>,
        out: &mut [f32],
        m: usize,
        scratch: &mut QuantScratch,
    ) -> Result<()> {
        quant_matmul(Some(self.team()), x, w, out, m, scratch, self.int8_tiles())
    }

    /// Whether Q8_0 products may take AMX-INT8 tiles: unless a bf16 kernel
    /// other than AMX was asked for ([`Self::with_bf16_kernel`]: the
    /// `METRALE_CPU_KERNEL` switch, which so turns AMX off throughout).
    /// The bits are the same either way; only the speed differs.
    pub fn int8_tiles(&self) -> bool {
        self.bf16_kernel.is_none_or(|k| k == super::Bf16Kernel::Amx) && int8_tiles_available()
    }
}
