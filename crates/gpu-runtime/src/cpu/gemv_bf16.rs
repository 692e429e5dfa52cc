//! Decode-sized matmuls (1 to [`MAX_ROWS`] rows) with bf16 dot products
//! (AVX512-BF16 `vdpbf16ps`), for bf16 weights under bf16 arithmetic.
//!
//! `out[i, j] = Σ_c bf16(x[i, c]) · w[j, c]`, as the prefill GEMM
//! (`gemm_bf16.rs`) computes it, but reading the weights as stored (row
//! major, no packing per call, which for a few rows would cost as much as
//! the products) and once for all rows of the step: a weight row stays in
//! L1 while every activation row, as bf16 pairs, is taken against it, four
//! at a time.
//!
//! Batch invariance: every output is summed the same way whatever the
//! number of rows, their grouping or the thread that computes it: chunk `c`
//! of 32 elements into the 16-lane accumulator `c % 4`, in order, then
//! `(s0 + s1) + (s2 + s3)` reduced across lanes in a fixed order. A decode row's result is therefore bitwise the same
//! alone or among up to [`MAX_ROWS`] others.

use std::cell::RefCell;

use half::bf16;

use super::team::{OutPtr, Team};

/// Most activation rows this kernel takes (more: the prefill GEMM, whose
/// packed tiles use each load more often: at 64 rows of the Granite-350M
/// shape it decodes 112-114 tok/s where this kernel gave 80-88).
pub(crate) const MAX_ROWS: usize = 32;
/// Weight rows per group.
const ROWS: usize = 4;
/// Activation rows per pass over a group.
const MB: usize = 4;
/// bf16 pairs per vector (32 elements).
const LANES: usize = 16;

thread_local! {
    /// The activations as bf16 pairs, each row padded with zeros to whole
    /// vectors, per calling thread.
    static ACTS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// `out[i * n + j] = Σ_c bf16(x[i * k + c]) · w[j * k + c]` for `i < m`,
/// `j < n`. Returns false, doing nothing, when the CPU lacks AVX512-BF16.
pub(crate) fn gemv(
    team: Option<&Team>,
    x: &[f32],
    w: &[bf16],
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
) -> bool {
    if !available() {
        return false;
    }
    assert!(x.len() >= m * k && w.len() >= n * k && out.len() >= m * n);
    if m == 0 || n == 0 {
        return true;
    }
    let stride = k.div_ceil(2 * LANES) * LANES;
    ACTS.with_borrow_mut(|xp| {
        if xp.len() < m * stride {
            xp.resize(m * stride, 0);
        }
        for (i, row) in xp[..m * stride].chunks_exact_mut(stride).enumerate() {
            let pairs = k.div_ceil(2);
            super::gemm_bf16::to_pairs(&x[i * k..(i + 1) * k], &mut row[..pairs]);
            row[pairs..].fill(0);
        }
        run(team, &xp[..m * stride], stride, w, out, m, n, k);
    });
    true
}

/// Whether this CPU can run [`gemv`].
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::gemm_bf16::available() && std::arch::is_x86_feature_detected!("avx512bw")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[allow(clippy::too_many_arguments)]
fn run(
    team: Option<&Team>,
    xp: &[u32],
    stride: usize,
    w: &[bf16],
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
) {
    let threads = team.map_or(1, Team::threads);
    // Even shares of whole groups, up to eight per thread (as `gemv.rs`:
    // one weight stream per share for the prefetchers).
    let per_thread = ((n * k) >> 20).clamp(1, 8);
    let share = n.div_ceil(threads * per_thread).div_ceil(ROWS) * ROWS;
    let ptr = OutPtr::new(out);
    let task = |t: usize| {
        let (j0, j1) = (t * share, ((t + 1) * share).min(n));
        let mut j = j0;
        while j < j1 {
            let rows = ROWS.min(j1 - j);
            let mut i = 0;
            while i < m {
                let block = MB.min(m - i);
                let mut acc = [[0f32; ROWS]; MB];
                group(
                    &xp[i * stride..(i + block) * stride],
                    stride,
                    block,
                    w,
                    j,
                    rows,
                    k,
                    &mut acc,
                );
                for (b, sums) in acc[..block].iter().enumerate() {
                    for (r, v) in sums[..rows].iter().enumerate() {
                        // SAFETY: `(i + b) * n + j + r < m * n <= out.len()`
                        // (asserted in `gemv`); task `t` alone writes
                        // columns `j0..j1`.
                        unsafe { ptr.write((i + b) * n + j + r, *v) };
                    }
                }
                i += block;
            }
            j += rows;
        }
    };
    let count = n.div_ceil(share);
    match team {
        Some(team) => team.run(count, &task),
        None => (0..count).for_each(task),
    }
}

/// `acc[b][r] = Σ dot(x row b, w row j + r)` for `b < block`, `r < rows`.
#[allow(clippy::too_many_arguments)]
#[inline]
fn group(
    xp: &[u32],
    stride: usize,
    block: usize,
    w: &[bf16],
    j: usize,
    rows: usize,
    k: usize,
    acc: &mut [[f32; ROWS]; MB],
) {
    // Short groups repeat their last row: the same loads, results unused.
    let row = |r: usize| &w[(j + r.min(rows - 1)) * k..][..k];
    let ws = [row(0), row(1), row(2), row(3)];
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `available()` (checked by `gemv`) found AVX-512F/BW/BF16;
    // `xp` holds `block` rows of `stride` pairs, `stride` covers `k`.
    unsafe {
        match block {
            1 => x86::group::<1>(xp, stride, ws, k, acc),
            2 => x86::group::<2>(xp, stride, ws, k, acc),
            3 => x86::group::<3>(xp, stride, ws, k, acc),
            _ => x86::group::<4>(xp, stride, ws, k, acc),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (xp, stride, block, ws, k, acc);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::bf16;

    use super::{LANES, MB, ROWS};

    /// `acc[b][r] = Σ_c dot2(x[b * stride + c], w[r][2c..2c + 2])` for
    /// `b < B`: each sum kept in four accumulators (chunk `c` of 32 elements
    /// in accumulator `c % 4`), added as `(s0 + s1) + (s2 + s3)` and reduced
    /// across lanes.
    ///
    /// # Safety
    /// The CPU must support AVX-512F, AVX-512BW and AVX512-BF16; `xp` holds
    /// `B * stride` pairs with `stride >= k.div_ceil(32) * 16`; each `w[r]`
    /// holds `k` elements.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn group<const B: usize>(
        xp: &[u32],
        stride: usize,
        w: [&[bf16]; ROWS],
        k: usize,
        acc: &mut [[f32; ROWS]; MB],
    ) {
        assert!(B <= MB && xp.len() >= B * stride && stride >= k.div_ceil(2 * LANES) * LANES);
        assert!(w.iter().all(|r| r.len() >= k));
        // One weight row at a time: the group's rows are adjacent, so the
        // reads are one sequential stream, which the prefetchers follow
        // best (four interleaved rows streamed at half the speed).
        for r in 0..ROWS {
            // SAFETY: the caller's contract, checked above.
            let sums = unsafe { row::<B>(xp.as_ptr(), stride, w[r].as_ptr(), k) };
            for b in 0..B {
                acc[b][r] = sums[b];
            }
        }
    }

    /// The `B` dot products of one weight row (see [`group`]).
    ///
    /// # Safety
    /// As [`group`], for the row at `w`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn row<const B: usize>(
        xs: *const u32,
        stride: usize,
        w: *const bf16,
        k: usize,
    ) -> [f32; B] {
        let mut s = [[_mm512_setzero_ps(); 4]; B];
        let chunks = k.div_ceil(2 * LANES);
        let full = k / (2 * LANES);
        // Index loops over fixed bounds, no iterators over arrays of
        // vectors: LLVM keeps every accumulator in a register.
        let mut c = 0;
        while c + 4 <= full {
            for u in 0..4 {
                // SAFETY: elements `(c + u) * 32 + 32 <= k` of the row; pairs
                // `b * stride + (c + u) * 16 + 16 <= B * stride`. Unaligned.
                unsafe {
                    let wv: __m512bh =
                        std::mem::transmute(_mm512_loadu_si512(w.add((c + u) * 2 * LANES).cast()));
                    for b in 0..B {
                        let xv: __m512bh = std::mem::transmute(_mm512_loadu_si512(
                            xs.add(b * stride + (c + u) * LANES).cast(),
                        ));
                        s[b][u] = _mm512_dpbf16_ps(s[b][u], xv, wv);
                    }
                }
            }
            c += 4;
        }
        while c < chunks {
            let start = c * 2 * LANES;
            let mask = if c < full {
                !0
            } else {
                (1u32 << (k - start)) - 1
            };
            // SAFETY: as above; the weight load is masked to the elements
            // below `k`.
            unsafe {
                let wv: __m512bh =
                    std::mem::transmute(_mm512_maskz_loadu_epi16(mask, w.add(start).cast()));
                for b in 0..B {
                    let xv: __m512bh = std::mem::transmute(_mm512_loadu_si512(
                        xs.add(b * stride + c * LANES).cast(),
                    ));
                    s[b][c % 4] = _mm512_dpbf16_ps(s[b][c % 4], xv, wv);
                }
            }
            c += 1;
        }
        let mut out = [0f32; B];
        for b in 0..B {
            let v = _mm512_add_ps(
                _mm512_add_ps(s[b][0], s[b][1]),
                _mm512_add_ps(s[b][2], s[b][3]),
            );
            out[b] = _mm512_reduce_add_ps(v);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(m: usize, n: usize, k: usize) -> (Vec<f32>, Vec<bf16>) {
        let x = (0..m * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 37.0)
            .collect();
        let w = (0..n * k)
            .map(|i| bf16::from_f32(((i * 53 % 97) as f32 - 48.0) / 48.0))
            .collect();
        (x, w)
    }

    #[test]
    fn matches_the_bf16_rounded_reference() {
        if !available() {
            return;
        }
        let team = Team::new(2);
        for &(m, n, k) in &[
            (1, 1, 1),
            (3, 5, 31),
            (5, 9, 33),
            (17, 70, 130),
            (64, 40, 768),
        ] {
            let (x, w) = inputs(m, n, k);
            let mut out = vec![f32::NAN; m * n];
            assert!(gemv(Some(&team), &x, &w, &mut out, m, n, k));
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|c| {
                            bf16::from_f32(x[i * k + c]).to_f32() as f64
                                * w[j * k + c].to_f32() as f64
                        })
                        .sum();
                    let got = out[i * n + j] as f64;
                    assert!(
                        (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "{m}x{n}x{k} [{i},{j}]: {got} vs {want}"
                    );
                }
            }
        }
    }

    /// A row's result is bitwise the same alone, among any number of rows
    /// up to MAX_ROWS, with or without the team.
    #[test]
    fn a_row_is_bitwise_the_same_whatever_shares_the_call() {
        if !available() {
            return;
        }
        let team = Team::new(2);
        let (n, k) = (37, 300);
        let (x, w) = inputs(MAX_ROWS, n, k);
        let mut all = vec![0f32; MAX_ROWS * n];
        assert!(gemv(Some(&team), &x, &w, &mut all, MAX_ROWS, n, k));
        for m in [1, 2, 3, 5, 16, MAX_ROWS - 1] {
            for start in [0, 7.min(MAX_ROWS - m), MAX_ROWS - m] {
                let mut some = vec![0f32; m * n];
                let xs = &x[start * k..(start + m) * k];
                assert!(gemv(None, xs, &w, &mut some, m, n, k));
                assert_eq!(
                    some,
                    all[start * n..(start + m) * n],
                    "{m} rows from {start}"
                );
            }
        }
    }
}
