//! Steps of a few activation rows (batched decode) on Q8_0 weights with
//! AVX-512 VNNI: four weight rows at a time dotted with every activation
//! row, four at a time, while their blocks sit in L1 (`zmm_q8.rs`).
//!
//! Why: between decode's one row and prefill's hundreds, a step of 2 to 32
//! rows took either the one-row kernels four activation rows at a time
//! (each weight block unpacked and its sums folded per activation row) or
//! the packed panels of `packed.rs`, which repack every weight row on every
//! call. Llama-370M Q8_0, 64-token prompts, three interleaved rounds: batch
//! 4 89-102 -> 132-147 tok/s, batch 16 128-135 -> 156-164; Granite-350M
//! Q8_0 74-91 -> 119-125 and 121-122 -> 143-145. Batch 64 keeps the panels
//! (this way it ran at 172-176 tok/s against their 263-270).

use metrale_core::GgmlType;

use super::super::team::{OutPtr, Team};
use super::act::ActRow;
use super::matrix::QuantMatrix;
use super::{MAX_ROWS, QuantIsa, by_tile, run_tasks, vec_dot_rows, zmm_q8};

/// Weight rows a kernel call takes.
const W: usize = 4;

/// Most activation rows [`matmul_steps`] takes; more go to the packed
/// panels (prefill).
const MAX_STEP_ROWS: usize = 32;

/// Whether [`matmul_steps`] takes a step of `m` rows of `w` on `isa`.
pub(super) fn takes(isa: QuantIsa, w: &QuantMatrix<'_>, m: usize) -> bool {
    isa == QuantIsa::Vnni
        && w.ty() == GgmlType::Q8_0
        && !w.is_grouped()
        && (2..=MAX_STEP_ROWS).contains(&m)
}

/// `out[i * n + j] = dot(acts[i], w[j])`: the weight rows split over the
/// team in runs of [`W`], each run with [`MAX_ROWS`] activation rows per
/// kernel call; the last `n % W` rows one by one. The bits of the one-row
/// kernel.
///
/// `w` and `isa` as [`takes`] says; every activation row as many blocks as
/// a weight row, `out` at least `acts.len() · n` floats (`quant_matmul_with`
/// checks both).
pub(super) fn matmul_steps(
    isa: QuantIsa,
    team: Option<&Team>,
    w: QuantMatrix<'_>,
    acts: &[ActRow<'_>],
    out: &mut [f32],
) {
    let (n, m) = (w.rows(), acts.len());
    let runs = n.div_ceil(W);
    let threads = team.map_or(1, Team::threads);
    // A few shares per thread, about 1 MiB of weights or more each (as
    // `quant_matmul_with`'s row shares).
    let per_thread = (w.bytes() >> 20).clamp(1, 8);
    let share = runs.div_ceil(threads * per_thread).max(1);
    let ptr = OutPtr::new(out);
    let run = |t: usize| {
        let (g0, g1) = (t * share, ((t + 1) * share).min(runs));
        let mut buf = Vec::new();
        let mut vals = [0f32; MAX_ROWS];
        for g in g0..g1 {
            let j0 = g * W;
            let rows = W.min(n - j0);
            for i0 in (0..m).step_by(MAX_ROWS) {
                let r = MAX_ROWS.min(m - i0);
                let a = &acts[i0..i0 + r];
                if rows < W {
                    for j in j0..j0 + rows {
                        let row = w.row_in(j, &mut buf);
                        vec_dot_rows(isa, w.ty(), row, a, &mut vals[..r]);
                        for (u, &v) in vals[..r].iter().enumerate() {
                            // SAFETY: `(i0 + u) * n + j < m * n` (the
                            // caller's contract); task `t` alone writes
                            // the columns of runs `g0..g1`.
                            unsafe { ptr.write((i0 + u) * n + j, v) };
                        }
                    }
                    continue;
                }
                let wr: [&[u8]; W] = w.rows_in(j0, &mut buf);
                by_tile!(a, |a, R| {
                    // SAFETY: every weight row and activation row holds as
                    // many whole Q8_0 blocks, and the CPU has AVX-512 VNNI
                    // (the caller's contract).
                    let v = unsafe { zmm_q8::dot_q8_0_rows::<R>(&wr, a) };
                    for (u, row) in v.iter().enumerate() {
                        // SAFETY: `(i0 + u) * n + j0 + W <= m * n` (`j0 + W
                        // <= n`); task `t` alone writes the columns of runs
                        // `g0..g1`.
                        unsafe { ptr.write_run((i0 + u) * n + j0, row) };
                    }
                });
            }
        }
    };
    run_tasks(team, runs.div_ceil(share), &run);
}
