//! Decode-sized matmuls (1 to [`MAX_ROWS`] rows) with bf16 dot products
//! (AVX512-BF16 `vdpbf16ps`), for bf16 weights under bf16 arithmetic.
//!
//! `out[i, j] = Σ_c bf16(x[i, c]) · w[j, c]`, as the prefill GEMM
//! (`gemm_bf16.rs`) computes it, but reading the weights as stored (row
//! major, no packing per call, which for a few rows would cost as much as
//! the products) and once for all rows of the step: a group of four weight
//! rows stays in L1 while every activation row, as bf16 pairs, is taken
//! against it (one weight row against four activation rows at a time for a
//! few rows, four against three for more).
//!
//! Batch invariance: every output is summed the same way whatever the
//! number of rows, their grouping or the thread that computes it: chunk `c`
//! of 32 elements into the 16-lane accumulator `c % 2`, in order, then
//! `s0 + s1` reduced across lanes in a fixed order. A decode row's result is therefore bitwise the same
//! alone or among up to [`MAX_ROWS`] others.

use std::cell::RefCell;

use half::bf16;

use super::team::{OutPtr, Team};

/// Most activation rows this kernel takes (more: the prefill GEMM).
pub(crate) const MAX_ROWS: usize = 64;
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
        // A few rows: each weight row streamed alone against up to four
        // activation rows (one sequential stream, which the prefetchers
        // follow best). More: four weight rows against three activation
        // rows at a time, each activation load used four times.
        let (wide, mb) = if m <= MB { (false, MB) } else { (true, 3) };
        let mut j = j0;
        while j < j1 {
            let rows = ROWS.min(j1 - j);
            let mut i = 0;
            while i < m {
                let block = mb.min(m - i);
                let mut acc = [[0f32; ROWS]; MB];
                let xs = &xp[i * stride..(i + block) * stride];
                group(xs, stride, block, w, j, rows, k, wide, &mut acc);
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

/// `acc[b][r] = Σ dot(x row b, w row j + r)` for `b < block`, `r < rows`;
/// `wide`: the four weight rows together (`block <= 3`), else one by one.
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
    wide: bool,
    acc: &mut [[f32; ROWS]; MB],
) {
    // Short groups repeat their last row: the same loads, results unused.
    let row = |r: usize| &w[(j + r.min(rows - 1)) * k..][..k];
    let ws = [row(0), row(1), row(2), row(3)];
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `available()` (checked by `gemv`) found AVX-512F/BW/BF16;
    // `xp` holds `block` rows of `stride` pairs, `stride` covers `k`, each
    // weight row `k` elements.
    unsafe {
        use x86::tile;
        let mut put = |r0: usize, sums: &[[f32; MB]]| {
            for (r, s) in sums.iter().enumerate() {
                for b in 0..block {
                    acc[b][r0 + r] = s[b];
                }
            }
        };
        if wide {
            match block {
                1 => put(0, &tile::<4, 1>(xp, stride, ws, k)),
                2 => put(0, &tile::<4, 2>(xp, stride, ws, k)),
                _ => put(0, &tile::<4, 3>(xp, stride, ws, k)),
            }
        } else {
            for (r, wr) in ws.into_iter().enumerate() {
                match block {
                    1 => put(r, &tile::<1, 1>(xp, stride, [wr], k)),
                    2 => put(r, &tile::<1, 2>(xp, stride, [wr], k)),
                    3 => put(r, &tile::<1, 3>(xp, stride, [wr], k)),
                    _ => put(r, &tile::<1, 4>(xp, stride, [wr], k)),
                }
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (xp, stride, block, ws, k, wide, acc);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::bf16;

    use super::{LANES, MB};

    /// `out[r][b] = Σ_c dot2(x[b * stride + c], w[r][2c..2c + 2])` for
    /// `r < R`, `b < B`. Each sum is kept in two accumulators (chunk `c` of
    /// 32 elements in accumulator `c % 2`, in order), added and reduced
    /// across lanes: the same order whatever `R` and `B`, so a row's result
    /// does not depend on the tile it was computed in.
    ///
    /// # Safety
    /// The CPU must support AVX-512F, AVX-512BW and AVX512-BF16; `xp` holds
    /// `B * stride` pairs with `stride >= k.div_ceil(32) * 16`; each `w[r]`
    /// holds `k` elements.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn tile<const R: usize, const B: usize>(
        xp: &[u32],
        stride: usize,
        w: [&[bf16]; R],
        k: usize,
    ) -> [[f32; MB]; R] {
        let chunks = k.div_ceil(2 * LANES);
        assert!(B <= MB && xp.len() >= B * stride && stride >= chunks * LANES);
        assert!(w.iter().all(|r| r.len() >= k));
        let full = k / (2 * LANES);
        let xs = xp.as_ptr();
        let wp: [*const bf16; R] = std::array::from_fn(|r| w[r].as_ptr());
        let mut s = [[[_mm512_setzero_ps(); 2]; B]; R];
        // Index loops over fixed bounds (no iterators over arrays of
        // vectors): LLVM keeps every accumulator in a register.
        for c in 0..chunks {
            let start = c * 2 * LANES;
            let mask = if c < full {
                !0
            } else {
                (1u32 << (k - start)) - 1
            };
            // SAFETY: the weight loads read elements `start..start + 32`,
            // masked to those below `k`, of rows holding `k`; the pair loads
            // `b * stride + c * 16 + 16 <= B * stride` (asserted). Unaligned.
            unsafe {
                let mut wv = [_mm512_setzero_si512(); R];
                for r in 0..R {
                    wv[r] = if c < full {
                        _mm512_loadu_si512(wp[r].add(start).cast())
                    } else {
                        _mm512_maskz_loadu_epi16(mask, wp[r].add(start).cast())
                    };
                }
                for b in 0..B {
                    let xv: __m512bh = std::mem::transmute(_mm512_loadu_si512(
                        xs.add(b * stride + c * LANES).cast(),
                    ));
                    for r in 0..R {
                        let wr: __m512bh = std::mem::transmute(wv[r]);
                        s[r][b][c % 2] = _mm512_dpbf16_ps(s[r][b][c % 2], xv, wr);
                    }
                }
            }
        }
        let mut out = [[0f32; MB]; R];
        for r in 0..R {
            for b in 0..B {
                out[r][b] = _mm512_reduce_add_ps(_mm512_add_ps(s[r][b][0], s[r][b][1]));
            }
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
        for m in [1, 2, 3, 5, 16, 33] {
            for start in [0, 7, MAX_ROWS - m] {
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
