//! Prefill GEMM with bf16 dot products (AVX512-BF16 `vdpbf16ps`), opt-in.
//!
//! `out[m, n] = x[m, k] · w[n, k]ᵀ` with bf16 weights, the activations
//! rounded to bf16 (round to nearest even) and each pair of products summed
//! in f32: what llama.cpp does with bf16 weights. One instruction does 32
//! multiply-adds where an f32 FMA does 16, so prefill's matmuls run up to
//! twice as fast; the price is the rounding of the activations (relative
//! error about 2⁻⁹ per product), which takes the logits out of the 1e-4
//! agreement with the f32 reference. Hence opt-in
//! ([`super::CpuBackend::with_bf16_dot_products`]); the default stays f32.
//!
//! Layout: the weight rows are packed per panel of [`NR`] rows so that one
//! 64-byte load holds the pair `(2p, 2p+1)` of all 16 rows of a vector; the
//! activations are converted once to bf16 pairs and broadcast. The panels are
//! shared out over the backend's team; each task writes its own columns of `out`.

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};

use half::bf16;

use super::team::Team;

/// Weight rows per panel (two 16-lane vectors).
const NR: usize = 32;
/// Activation rows per micro-tile.
const MR: usize = 8;

thread_local! {
    /// The packed weight panel, per team thread.
    static PANEL: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    /// The second operand's panel of a fused SwiGLU, per team thread.
    static PANEL_UP: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    /// The activations as bf16 pairs, per calling thread.
    static ACTS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// Whether this CPU can run [`gemm`].
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512bf16")
            && std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// A pointer to `out` that tasks write disjoint columns of.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: each task writes only the columns of its own panel.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// # Safety
    /// `i..i + v.len()` must be inside `out`, and no other task may touch it.
    unsafe fn write_row(self, i: usize, v: &[f32]) {
        // SAFETY: the caller's contract; `v` is a different allocation. A
        // full panel's row is copied with a constant length (two vector
        // moves, not a `memmove` call per row).
        unsafe {
            if v.len() == NR {
                std::ptr::copy_nonoverlapping(v.as_ptr(), self.0.add(i), NR)
            } else {
                std::ptr::copy_nonoverlapping(v.as_ptr(), self.0.add(i), v.len())
            }
        };
    }
}

/// `out[i * n + j] = Σ_c bf16(x[i * k + c]) · w[j * k + c]` (f32 sums).
/// Returns false, doing nothing, when the CPU lacks AVX512-BF16.
pub(crate) fn gemm(
    team: &Team,
    x: &[f32],
    w: &[bf16],
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
) -> bool {
    gemm_with(team, x, w, None, out, m, n, k)
}

/// `out = silu(x·gateᵀ) * (x·upᵀ)`, each product as [`gemm`] computes it
/// and the SiLU as `silu_mul` does, applied to each tile before it is
/// stored: the same bits as two [`gemm`] calls and `silu_mul`, without
/// writing and reading back the two products. False where [`gemm`] is.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_swiglu(
    team: &Team,
    x: &[f32],
    gate: &[bf16],
    up: &[bf16],
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
) -> bool {
    assert!(up.len() >= n * k);
    gemm_with(team, x, gate, Some(up), out, m, n, k)
}

#[allow(clippy::too_many_arguments)]
fn gemm_with(
    team: &Team,
    x: &[f32],
    w: &[bf16],
    up: Option<&[bf16]>,
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
    let kp = k.div_ceil(2);
    let rows = m.div_ceil(MR) * MR;
    ACTS.with_borrow_mut(|xb| {
        // Activations as bf16 pairs, padded to whole micro-tiles with zeros.
        // Every row is overwritten, so only growth and the padding are zeroed
        // (zeroing it all, on one thread, had cost 4% of a prefill).
        if xb.len() < rows * kp {
            xb.resize(rows * kp, 0);
        }
        let xb = &mut xb[..rows * kp];
        xb[m * kp..].fill(0);
        team.chunks(&mut xb[..m * kp], kp, |i, dst| {
            to_pairs(&x[i * k..(i + 1) * k], dst)
        });
        run(team, xb, w, up, out, m, n, k);
    });
    true
}

/// `src` (f32) as bf16 pairs `(2p, 2p+1)` in `dst`, rounded to nearest even.
pub(super) fn to_pairs(src: &[f32], dst: &mut [u32]) {
    let even = src.len() / 32 * 32;
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `gemm` checked `available()`; the kernel reads `even` elements of
    // `src` and writes `even / 2` of `dst` (which holds `src.len().div_ceil(2)`).
    unsafe {
        x86::to_pairs(&src[..even], &mut dst[..even / 2])
    };
    let done = if cfg!(target_arch = "x86_64") {
        even
    } else {
        0
    };
    for p in done / 2..dst.len() {
        let lo = bf16::from_f32(src[2 * p]).to_bits() as u32;
        let hi = src
            .get(2 * p + 1)
            .map_or(0, |v| bf16::from_f32(*v).to_bits() as u32);
        dst[p] = lo | (hi << 16);
    }
}

#[allow(clippy::too_many_arguments)]
fn run(
    team: &Team,
    xb: &[u32],
    w: &[bf16],
    up: Option<&[bf16]>,
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
) {
    let kp = k.div_ceil(2);
    let panels = n.div_ceil(NR);
    let next = AtomicUsize::new(0);
    let ptr = OutPtr(out.as_mut_ptr());
    let work = || {
        PANEL.with_borrow_mut(|panel| {
            PANEL_UP.with_borrow_mut(|panel_up| {
                // `pack` overwrites the whole panel: no need to clear it.
                panel.resize(kp * NR, 0);
                if up.is_some() {
                    panel_up.resize(kp * NR, 0);
                }
                // Each thread claims its next panel one ahead and, during the
                // last quarter of the current panel's row tiles, prefetches
                // the weight rows packing will read (32 rows at a time: more
                // streams than the hardware prefetcher follows).
                let mut t = next.fetch_add(1, Ordering::Relaxed);
                while t < panels {
                    let ahead = next.fetch_add(1, Ordering::Relaxed);
                    let upcoming = (ahead < panels).then(|| {
                        let (a0, rows) = (ahead * NR, NR.min(n - ahead * NR));
                        (
                            &w[a0 * k..(a0 + rows) * k],
                            up.map(|u| &u[a0 * k..(a0 + rows) * k]),
                        )
                    });
                    let tiles = m.div_ceil(MR);
                    let from = tiles - tiles.div_ceil(4);
                    let j0 = t * NR;
                    let cols = NR.min(n - j0);
                    pack(w, k, kp, j0, cols, panel);
                    if let Some(up) = up {
                        pack(up, k, kp, j0, cols, panel_up);
                    }
                    let (mut tile, mut tile_up) = ([[0f32; NR]; MR], [[0f32; NR]; MR]);
                    let mut row = [0f32; NR];
                    for (ti, i0) in (0..m).step_by(MR).enumerate() {
                        if let Some((wr, ur)) = upcoming.filter(|_| ti >= from) {
                            prefetch_part(wr, ti - from, tiles - from);
                            if let Some(ur) = ur {
                                prefetch_part(ur, ti - from, tiles - from);
                            }
                        }
                        let a = &xb[i0 * kp..(i0 + MR) * kp];
                        // SAFETY: `available()` found AVX-512F and AVX512-BF16;
                        // `a` holds `MR` full rows (padded), the panels `kp * NR`.
                        unsafe { x86::tile(a, panel, kp, &mut tile) };
                        if up.is_some() {
                            // SAFETY: as above.
                            unsafe { x86::tile(a, panel_up, kp, &mut tile_up) };
                        }
                        for (r, g) in tile.iter().enumerate().take(m - i0) {
                            let v = if up.is_some() {
                                super::elementwise::silu_mul(
                                    &mut row[..cols],
                                    &g[..cols],
                                    &tile_up[r][..cols],
                                );
                                &row[..cols]
                            } else {
                                &g[..cols]
                            };
                            // SAFETY: `(i0 + r) < m` and `j0 + cols <= n`, inside
                            // `out` (asserted); this task alone writes columns
                            // `j0..j0 + cols`.
                            unsafe { ptr.write_row((i0 + r) * n + j0, v) };
                        }
                    }
                    t = ahead;
                }
            })
        })
    };
    // One task per thread, each taking panels from the counter.
    team.run(team.threads().min(panels), &|_| work());
}

/// Prefetches part `i` of `parts` of `data` (whole cache lines) into L1.
fn prefetch_part(data: &[bf16], i: usize, parts: usize) {
    const LINE: usize = 32; // bf16s per 64-byte line
    let lines = data.len().div_ceil(LINE);
    let per = lines.div_ceil(parts);
    for l in (i * per..((i + 1) * per).min(lines)).map(|l| l * LINE) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch never faults, and `l < data.len()` besides.
        unsafe {
            use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
            _mm_prefetch::<_MM_HINT_T0>(data.as_ptr().add(l).cast());
        }
    }
}

/// Packs rows `j0..j0 + cols` of `w` as `panel[p * NR + r] = pair p of row r`
/// (missing rows and an odd last element as zeros).
fn pack(w: &[bf16], k: usize, kp: usize, j0: usize, cols: usize, panel: &mut [u32]) {
    #[cfg(target_arch = "x86_64")]
    if cols == NR && k.is_multiple_of(2) {
        let rows = &w[j0 * k..(j0 + NR) * k];
        // SAFETY: `gemm` checked `available()`; `rows` holds NR rows of `k`
        // (even) elements and `panel` `kp * NR` pairs.
        unsafe { x86::pack_full(rows, kp, panel) };
        return;
    }
    for r in 0..NR {
        if r >= cols {
            for p in 0..kp {
                panel[p * NR + r] = 0;
            }
            continue;
        }
        let row = &w[(j0 + r) * k..(j0 + r + 1) * k];
        for p in 0..kp {
            let lo = row[2 * p].to_bits() as u32;
            let hi = row.get(2 * p + 1).map_or(0, |v| v.to_bits() as u32);
            panel[p * NR + r] = lo | (hi << 16);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{MR, NR};

    /// Packs NR full rows of `kp` pairs each (`rows`, row-major bf16) into
    /// `panel[p * NR + r]`: 16×16 blocks of pairs transposed in registers
    /// (four butterfly stages of two-source permutes), the last `kp % 16`
    /// pair indices by gathers.
    ///
    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn pack_full(rows: &[half::bf16], kp: usize, panel: &mut [u32]) {
        assert!(rows.len() == NR * kp * 2 && panel.len() >= kp * NR);
        let base = rows.as_ptr().cast::<u32>();
        // Stage `b` swaps bit `b` of the row index with bit `b` of the lane:
        // lane j of the low row takes the high row's lane j - b where j has
        // bit b set; lane j of the high row takes the low row's lane j + b
        // where j has it clear.
        let stages: [(usize, __m512i, __m512i); 4] = [8, 4, 2, 1].map(|b| {
            let mut lo = [0i32; 16];
            let mut hi = [0i32; 16];
            for j in 0..16 {
                (lo[j], hi[j]) = if j & b == 0 {
                    (j as i32, (j + b) as i32)
                } else {
                    ((16 + j - b) as i32, (16 + j) as i32)
                };
            }
            // SAFETY: 16 i32 are 64 bytes; unaligned loads.
            unsafe {
                (
                    b,
                    _mm512_loadu_si512(lo.as_ptr().cast()),
                    _mm512_loadu_si512(hi.as_ptr().cast()),
                )
            }
        });
        let blocks = kp / 16;
        for half in 0..NR / 16 {
            for blk in 0..blocks {
                let p0 = blk * 16;
                // SAFETY: rows `half * 16 + r < NR` hold `kp` pairs from
                // `base + row * kp`; pairs `p0..p0 + 16 <= kp`; the stores
                // write `panel[(p0 + i) * NR + half * 16..][..16]`, inside
                // `kp * NR`. Unaligned loads and stores.
                unsafe {
                    let mut v = [_mm512_setzero_si512(); 16];
                    for (r, v) in v.iter_mut().enumerate() {
                        let row = base.add((half * 16 + r) * kp + p0);
                        *v = _mm512_loadu_si512(row.cast());
                    }
                    for &(b, lo, hi) in &stages {
                        for i in (0..16).filter(|i| i & b == 0) {
                            let (a, c) = (v[i], v[i + b]);
                            v[i] = _mm512_permutex2var_epi32(a, lo, c);
                            v[i + b] = _mm512_permutex2var_epi32(a, hi, c);
                        }
                    }
                    for (i, v) in v.iter().enumerate() {
                        let dst = panel.as_mut_ptr().add((p0 + i) * NR + half * 16);
                        _mm512_storeu_si512(dst.cast(), *v);
                    }
                }
            }
        }
        let idx = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(kp as i32),
        );
        let bytes = rows.as_ptr().cast::<u8>();
        for p in blocks * 16..kp {
            // SAFETY: pair `p` of row `r` is the 4 bytes at `(r * kp + p) * 4`,
            // inside `rows` for `r < NR`, `p < kp`; gathers and stores unaligned.
            unsafe {
                let lo = _mm512_i32gather_epi32::<4>(idx, bytes.add(p * 4).cast());
                let hi = _mm512_i32gather_epi32::<4>(idx, bytes.add((16 * kp + p) * 4).cast());
                _mm512_storeu_si512(panel.as_mut_ptr().add(p * NR).cast(), lo);
                _mm512_storeu_si512(panel.as_mut_ptr().add(p * NR + 16).cast(), hi);
            }
        }
    }

    /// bf16 pairs of `src` (a multiple of 32 long) into `dst` (half as long).
    ///
    /// # Safety
    /// The CPU must support AVX-512F and AVX512-BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn to_pairs(src: &[f32], dst: &mut [u32]) {
        assert!(src.len().is_multiple_of(32) && dst.len() * 2 == src.len());
        for c in (0..src.len()).step_by(32) {
            // SAFETY: `c + 32 <= src.len()` and `c / 2 + 16 <= dst.len()`.
            unsafe {
                let lo = _mm512_loadu_ps(src.as_ptr().add(c));
                let hi = _mm512_loadu_ps(src.as_ptr().add(c + 16));
                // Lanes 0..16 from the second operand, 16..32 from the first.
                let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
                _mm512_storeu_si512(dst.as_mut_ptr().add(c / 2).cast(), v);
            }
        }
    }

    /// `tile[r][c] = Σ_p dot2(a[r * kp + p], panel[p * NR + c])`.
    ///
    /// # Safety
    /// The CPU must support AVX-512F and AVX512-BF16; `a` holds `MR * kp`
    /// pairs and `panel` `kp * NR`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn tile(a: &[u32], panel: &[u32], kp: usize, tile: &mut [[f32; NR]; MR]) {
        assert!(a.len() >= MR * kp && panel.len() >= kp * NR);
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        for p in 0..kp {
            // SAFETY: `p * NR + 32 <= kp * NR` and `r * kp + p < MR * kp`
            // (asserted above); unaligned loads.
            unsafe {
                let b0: __m512bh =
                    std::mem::transmute(_mm512_loadu_si512(panel.as_ptr().add(p * NR).cast()));
                let b1: __m512bh =
                    std::mem::transmute(_mm512_loadu_si512(panel.as_ptr().add(p * NR + 16).cast()));
                for r in 0..MR {
                    let av: __m512bh =
                        std::mem::transmute(_mm512_set1_epi32(*a.get_unchecked(r * kp + p) as i32));
                    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
                }
            }
        }
        for r in 0..MR {
            // SAFETY: each row of `tile` holds NR = 32 f32.
            unsafe {
                _mm512_storeu_ps(tile[r].as_mut_ptr(), acc[r][0]);
                _mm512_storeu_ps(tile[r].as_mut_ptr().add(16), acc[r][1]);
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    pub(super) unsafe fn to_pairs(_: &[f32], _: &mut [u32]) {}

    pub(super) unsafe fn tile(
        _: &[u32],
        _: &[u32],
        _: usize,
        _: &mut [[f32; super::NR]; super::MR],
    ) {
        unreachable!("available() is false off x86_64")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_bf16_rounded_reference_on_odd_shapes() {
        if !available() {
            return;
        }
        let team = Team::new(2);
        for &(m, n, k) in &[
            (1, 1, 1),
            (9, 33, 7),
            (17, 70, 130),
            (9, 64, 100),
            (40, 64, 768),
        ] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 37.0)
                .collect();
            let w: Vec<bf16> = (0..n * k)
                .map(|i| bf16::from_f32(((i * 53 % 97) as f32 - 48.0) / 48.0))
                .collect();
            let mut out = vec![f32::NAN; m * n];
            assert!(gemm(&team, &x, &w, &mut out, m, n, k));
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
}
