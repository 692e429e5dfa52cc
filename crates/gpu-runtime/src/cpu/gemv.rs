//! Matrix-vector products for decode: `out[i, j] = dot(x[i, :], w[j, :])`
//! for a few rows of `x`. Decode reads every weight once per token, so these
//! loops are built to stream `w` at the memory's pace: rows of `w` read one
//! after the other (one sequential stream per thread, which the hardware
//! prefetchers follow; software prefetch measured slower)
//! against one row of `x` (which stays in L1), bf16 widened in registers,
//! AVX-512 or AVX2+FMA where the CPU has them (detected at run time), a
//! portable loop elsewhere. The rows of `w` are split evenly over the
//! backend's threads; nothing is allocated per call.

use super::kernels::Weights;
use super::team::{OutPtr, Team};
use half::bf16;

/// Which vector instructions the kernels may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    Avx512,
    Avx2,
    Portable,
}

impl Isa {
    /// The best this CPU supports (detected once; the std macro caches it).
    pub(crate) fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }
}

/// Rows of `w` one kernel call handles.
const ROWS: usize = 4;

/// `out[i * n + j] = dot(x[i * k..], w[j * k..])` for `i < m`, `j < n`.
///
/// With a team, its threads take shares (handed out from a counter, the
/// calling thread among them); without one the calling thread does it all.
pub(crate) fn gemv(
    team: Option<&Team>,
    x: &[f32],
    w: Weights<'_>,
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
) {
    let threads = team.map_or(1, Team::threads);
    assert!(x.len() >= m * k && out.len() >= m * n);
    if m == 0 || n == 0 {
        return;
    }
    let isa = Isa::detect();
    // Even shares, the same number per thread: up to eight (so that the
    // thread that finishes first waits for at most a small share of the
    // other's work at the end), but about 1 Mi weights or more each: every
    // share is a new stream for the hardware prefetchers to pick up, and
    // short ones cost bandwidth (MoE experts of 196-393 Ki weights streamed
    // at 23 GiB/s in 32-64 Ki pieces, 31 GiB/s in one piece per thread;
    // `gemv/stream_moe_experts_64_bf16`). A multiple of ROWS rows.
    let per_thread = ((n * k) >> 20).clamp(1, 8);
    let share = n.div_ceil(threads * per_thread).div_ceil(ROWS) * ROWS;
    let ptr = OutPtr::new(out);
    let run = |t: usize| {
        let (j0, j1) = (t * share, ((t + 1) * share).min(n));
        // Weight rows outside, activation rows inside: each group of ROWS
        // weight rows is read from memory once and stays in L1 for all m rows.
        let mut j = j0;
        while j < j1 {
            let rows = ROWS.min(j1 - j);
            for i in 0..m {
                let xi = &x[i * k..(i + 1) * k];
                let mut acc = [0f32; ROWS];
                dot_rows(isa, xi, w, j, rows, k, &mut acc);
                for (r, v) in acc[..rows].iter().enumerate() {
                    // SAFETY: `i * n + j + r < m * n <= out.len()` (asserted
                    // above), and task `t` alone writes columns `j0..j1`.
                    unsafe { ptr.write(i * n + j + r, *v) };
                }
            }
            j += rows;
        }
    };
    let count = n.div_ceil(share);
    match team {
        Some(team) => team.run(count, &run),
        None => (0..count).for_each(run),
    }
}

/// `acc[r] = dot(x, w[(j + r) * k..][..k])` for `r < rows`.
#[inline]
fn dot_rows(
    isa: Isa,
    x: &[f32],
    w: Weights<'_>,
    j: usize,
    rows: usize,
    k: usize,
    acc: &mut [f32; ROWS],
) {
    match w {
        Weights::BF16(wb) => {
            let row = |r: usize| &wb[(j + r.min(rows - 1)) * k..][..k];
            let rs = [row(0), row(1), row(2), row(3)];
            match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `detect` found AVX-512F on this CPU.
                Isa::Avx512 => unsafe { x86::dot4_bf16_avx512(x, rs, acc) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `detect` found AVX2 and FMA on this CPU.
                Isa::Avx2 => unsafe { x86::dot4_bf16_avx2(x, rs, acc) },
                _ => dot4_bf16_portable(x, rs, acc),
            }
        }
        Weights::F32(wf) => {
            let row = |r: usize| &wf[(j + r.min(rows - 1)) * k..][..k];
            let rs = [row(0), row(1), row(2), row(3)];
            match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `detect` found AVX-512F on this CPU.
                Isa::Avx512 => unsafe { x86::dot4_f32_avx512(x, rs, acc) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `detect` found AVX2 and FMA on this CPU.
                Isa::Avx2 => unsafe { x86::dot4_f32_avx2(x, rs, acc) },
                _ => {
                    for (a, r) in acc.iter_mut().zip(rs) {
                        *a = super::kernels::dot_f32(x, r);
                    }
                }
            }
        }
        Weights::F16(_) | Weights::Quant(..) | Weights::QuantGroups(..) | Weights::Panels(_) => {
            for (r, a) in acc[..rows].iter_mut().enumerate() {
                *a = w.dot((j + r) * k, x);
            }
        }
    }
}

fn dot4_bf16_portable(x: &[f32], rs: [&[bf16]; ROWS], acc: &mut [f32; ROWS]) {
    for (a, r) in acc.iter_mut().zip(rs) {
        *a = super::kernels::dot_bf16(x, r);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::bf16;

    use super::ROWS;

    #[inline]
    fn widen(v: bf16) -> f32 {
        f32::from_bits((v.to_bits() as u32) << 16)
    }

    /// # Safety
    /// The CPU must support AVX-512F; every row must be as long as `x`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dot4_bf16_avx512(x: &[f32], rs: [&[bf16]; ROWS], acc: &mut [f32; ROWS]) {
        // One row at a time: the rows are adjacent in memory, so the reads
        // form one sequential stream, which is what the prefetchers follow
        // best; four accumulators hide the FMA latency.
        let k = x.len();
        let full = k / 64 * 64;
        for r in 0..ROWS {
            let row = rs[r];
            let p = row.as_ptr();
            let mut s = [_mm512_setzero_ps(); 4];
            let mut c = 0;
            while c < full {
                // SAFETY: `c + 64 <= k` and the row holds `k` elements.
                unsafe {
                    for u in 0..4 {
                        let xv = _mm512_loadu_ps(x.as_ptr().add(c + 16 * u));
                        let raw = _mm256_loadu_si256(p.add(c + 16 * u).cast());
                        let wv = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(
                            _mm512_cvtepu16_epi32(raw),
                        ));
                        s[u] = _mm512_fmadd_ps(xv, wv, s[u]);
                    }
                }
                c += 64;
            }
            let tail: f32 = (full..k).map(|i| x[i] * widen(row[i])).sum();
            let v = _mm512_add_ps(_mm512_add_ps(s[0], s[1]), _mm512_add_ps(s[2], s[3]));
            acc[r] = _mm512_reduce_add_ps(v) + tail;
        }
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA; every row must be as long as `x`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot4_bf16_avx2(x: &[f32], rs: [&[bf16]; ROWS], acc: &mut [f32; ROWS]) {
        // As the AVX-512 kernel: one sequential stream, four accumulators.
        let k = x.len();
        let full = k / 32 * 32;
        for r in 0..ROWS {
            let row = rs[r];
            let p = row.as_ptr();
            let mut s = [_mm256_setzero_ps(); 4];
            let mut c = 0;
            while c < full {
                // SAFETY: `c + 32 <= k` and the row holds `k` elements.
                unsafe {
                    for u in 0..4 {
                        let xv = _mm256_loadu_ps(x.as_ptr().add(c + 8 * u));
                        let raw = _mm_loadu_si128(p.add(c + 8 * u).cast());
                        let wv = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(
                            _mm256_cvtepu16_epi32(raw),
                        ));
                        s[u] = _mm256_fmadd_ps(xv, wv, s[u]);
                    }
                }
                c += 32;
            }
            let tail: f32 = (full..k).map(|i| x[i] * widen(row[i])).sum();
            acc[r] = hsum256(_mm256_add_ps(
                _mm256_add_ps(s[0], s[1]),
                _mm256_add_ps(s[2], s[3]),
            )) + tail;
        }
    }

    /// # Safety
    /// The CPU must support AVX-512F; every row must be as long as `x`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dot4_f32_avx512(x: &[f32], rs: [&[f32]; ROWS], acc: &mut [f32; ROWS]) {
        let k = x.len();
        let full = k / 64 * 64;
        for r in 0..ROWS {
            let row = rs[r];
            let p = row.as_ptr();
            let mut s = [_mm512_setzero_ps(); 4];
            let mut c = 0;
            while c < full {
                // SAFETY: `c + 64 <= k` and the row holds `k` elements.
                unsafe {
                    for u in 0..4 {
                        let xv = _mm512_loadu_ps(x.as_ptr().add(c + 16 * u));
                        s[u] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(p.add(c + 16 * u)), s[u]);
                    }
                }
                c += 64;
            }
            let tail: f32 = (full..k).map(|i| x[i] * row[i]).sum();
            let v = _mm512_add_ps(_mm512_add_ps(s[0], s[1]), _mm512_add_ps(s[2], s[3]));
            acc[r] = _mm512_reduce_add_ps(v) + tail;
        }
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA; every row must be as long as `x`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot4_f32_avx2(x: &[f32], rs: [&[f32]; ROWS], acc: &mut [f32; ROWS]) {
        let k = x.len();
        let full = k / 32 * 32;
        for r in 0..ROWS {
            let row = rs[r];
            let p = row.as_ptr();
            let mut s = [_mm256_setzero_ps(); 4];
            let mut c = 0;
            while c < full {
                // SAFETY: `c + 32 <= k` and the row holds `k` elements.
                unsafe {
                    for u in 0..4 {
                        let xv = _mm256_loadu_ps(x.as_ptr().add(c + 8 * u));
                        s[u] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(p.add(c + 8 * u)), s[u]);
                    }
                }
                c += 32;
            }
            let tail: f32 = (full..k).map(|i| x[i] * row[i]).sum();
            acc[r] = hsum256(_mm256_add_ps(
                _mm256_add_ps(s[0], s[1]),
                _mm256_add_ps(s[2], s[3]),
            )) + tail;
        }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn hsum256(v: __m256) -> f32 {
        let hi = _mm256_extractf128_ps::<1>(v);
        let lo = _mm256_castps256_ps128(v);
        let s = _mm_add_ps(hi, lo);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k)
                    .map(|c| x[i * k + c] as f64 * w[j * k + c] as f64)
                    .sum::<f64>() as f32;
            }
        }
        out
    }

    #[test]
    fn every_isa_matches_the_reference_on_odd_shapes() {
        let team = Team::new(2);
        for &(m, n, k) in &[
            (1, 1, 1),
            (1, 7, 33),
            (3, 130, 67),
            (4, 513, 1000),
            (1, 64, 4096),
        ] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
                .collect();
            let wb: Vec<bf16> = (0..n * k)
                .map(|i| bf16::from_f32(((i * 53 % 97) as f32 - 48.0) / 48.0))
                .collect();
            let wf: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
            let want = reference(&x, &wf, m, n, k);
            for isa in [Isa::detect(), Isa::Portable] {
                for w in [Weights::BF16(&wb), Weights::F32(&wf)] {
                    let mut out = vec![0f32; m * n];
                    if isa == Isa::Portable {
                        for i in 0..m {
                            for j in (0..n).step_by(ROWS) {
                                let rows = ROWS.min(n - j);
                                let mut acc = [0f32; ROWS];
                                dot_rows(isa, &x[i * k..(i + 1) * k], w, j, rows, k, &mut acc);
                                out[i * n + j..i * n + j + rows].copy_from_slice(&acc[..rows]);
                            }
                        }
                    } else {
                        gemv(Some(&team), &x, w, &mut out, m, n, k);
                    }
                    for (a, b) in out.iter().zip(&want) {
                        assert!(
                            (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                            "{isa:?} {m}x{n}x{k}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }
}
