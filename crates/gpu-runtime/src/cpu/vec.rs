//! The short vector loops of attention (a block's scores, `o += w · v`),
//! with AVX-512 chosen at run time and a portable fallback. The build
//! targets baseline x86-64, so without these the loops run on SSE2.
//!
//! The cache operands (key tiles, value rows) are f32, bf16 or f16
//! ([`KvElem`]): a narrow element is widened as it is loaded, in the
//! register, which is exact, so a narrow cache gives the bits its f32
//! widening would, without a widened copy (that copy was a third of a
//! decode step's attention).

use half::{bf16, f16};

use super::gemv::Isa;
use super::simd::simd_fn;

/// How a KV cache element is held (chooses the vector load).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KvKind {
    F32,
    Bf16,
    F16,
}

/// An element of a KV cache: f32 as it is, or bf16 or f16, widened to f32
/// as it is loaded (exactly: both are subsets of f32).
pub(crate) trait KvElem: Copy + Send + Sync + 'static {
    const KIND: KvKind;
    /// The element as f32, exactly.
    fn to_f32(self) -> f32;
    /// `out = src` as f32 (a vector loop).
    fn widen(src: &[Self], out: &mut [f32]);
}

impl KvElem for f32 {
    const KIND: KvKind = KvKind::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    fn widen(src: &[f32], out: &mut [f32]) {
        out.copy_from_slice(&src[..out.len()]);
    }
}

impl KvElem for bf16 {
    const KIND: KvKind = KvKind::Bf16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
    fn widen(src: &[bf16], out: &mut [f32]) {
        widen_bf16(src, out)
    }
}

impl KvElem for f16 {
    const KIND: KvKind = KvKind::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn widen(src: &[f16], out: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        // F16C's conversions where the CPU has them (`half` asks at run time).
        src[..out.len()].convert_to_f32_slice(out);
    }
}

simd_fn! {
    /// `out = src` widened to f32 (exact: a bf16 is an f32's top half).
    fn widen_bf16(src: &[bf16], out: &mut [f32]) {
        for (o, s) in out.iter_mut().zip(src) {
            *o = f32::from_bits(u32::from(s.to_bits()) << 16);
        }
    }
}

/// `o += w * v` over `o.len()` elements (`v` at least as long).
#[inline]
pub(crate) fn axpy<E: KvElem>(isa: Isa, o: &mut [f32], w: f32, v: &[E]) {
    let v = &v[..o.len()];
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::detect` found AVX-512F on this CPU; equal lengths.
        Isa::Avx512 => unsafe { x86::axpy512(o, w, v) },
        _ => o.iter_mut().zip(v).for_each(|(o, v)| *o += w * v.to_f32()),
    }
}

/// `o += Σ_i w[i] · v[i * stride..][..o.len()]`, the rows added in order
/// (exactly [`axpy`] row by row; the usual head sizes keep `o` in registers).
pub(crate) fn axpy_rows<E: KvElem>(isa: Isa, o: &mut [f32], w: &[f32], v: &[E], stride: usize) {
    if let Some(last) = w.len().checked_sub(1) {
        assert!(v.len() >= last * stride + o.len(), "axpy_rows: v too short");
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: `Isa::detect` found AVX-512F; the rows are inside `v` (asserted)
        // and each kernel handles `o.len() == 16 * N`.
        unsafe {
            match o.len() {
                32 => return x86::axpy_rows512::<E, 2>(o, w, v, stride),
                64 => return x86::axpy_rows512::<E, 4>(o, w, v, stride),
                128 => return x86::axpy_rows512::<E, 8>(o, w, v, stride),
                256 => return x86::axpy_rows512::<E, 16>(o, w, v, stride),
                _ => {}
            }
        }
    }
    for (i, &wi) in w.iter().enumerate() {
        axpy(isa, o, wi, &v[i * stride..]);
    }
}

/// Lanes of [`tile_dot`]: one score per key of a 16-token block.
pub(crate) const TILE_LANES: usize = 16;

/// `out[j] = Σ_d q[d] · tile[d * 16 + j]` for a `[q.len(), 16]` tile, over
/// four chains of `d` (`d mod 4`, each in order) added as `(c0 + c1) + (c2 + c3)`:
/// four chains hide the latency of the adds.
pub(crate) fn tile_dot<E: KvElem>(isa: Isa, q: &[f32], tile: &[E], out: &mut [f32; TILE_LANES]) {
    assert!(
        tile.len() >= q.len() * TILE_LANES,
        "tile_dot: tile too short"
    );
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: `Isa::detect` found AVX-512F; the tile holds `q.len()` rows (asserted).
        unsafe { x86::tile_dot512(q, tile, out) };
        return;
    }
    let mut acc = [[0f32; TILE_LANES]; 4];
    for (d, (&qd, row)) in q.iter().zip(tile.chunks_exact(TILE_LANES)).enumerate() {
        for (a, &k) in acc[d % 4].iter_mut().zip(row) {
            *a += qd * k.to_f32();
        }
    }
    for (j, o) in out.iter_mut().enumerate() {
        *o = (acc[0][j] + acc[1][j]) + (acc[2][j] + acc[3][j]);
    }
}

/// Most query heads [`tile_dot_heads`] and [`axpy_rows_heads`] take at once.
pub(crate) const MAX_HEADS: usize = 4;

/// [`tile_dot`] for several queries (`qs.len() <= MAX_HEADS`) against one
/// tile, each row of the tile loaded once for all of them; every score the
/// same bits as [`tile_dot`] gives it alone.
pub(crate) fn tile_dot_heads<E: KvElem>(
    isa: Isa,
    qs: &[&[f32]],
    tile: &[E],
    out: &mut [[f32; TILE_LANES]],
) {
    assert!(qs.len() <= MAX_HEADS && out.len() >= qs.len());
    let hd = qs.first().map_or(0, |q| q.len());
    assert!(qs.iter().all(|q| q.len() == hd) && tile.len() >= hd * TILE_LANES);
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: `Isa::detect` found AVX-512F; every query has `hd` elements
        // and the tile `hd` rows (asserted).
        unsafe {
            match qs.len() {
                2 => return x86::tile_dot_heads512::<E, 2>(qs, tile, out),
                3 => return x86::tile_dot_heads512::<E, 3>(qs, tile, out),
                4 => return x86::tile_dot_heads512::<E, 4>(qs, tile, out),
                _ => {}
            }
        }
    }
    for (q, o) in qs.iter().zip(out.iter_mut()) {
        tile_dot(isa, q, tile, o);
    }
}

/// [`axpy_rows`] for several heads at once: `os` holds `ws.len()` outputs of
/// `hd` each, head `i`'s rows weighted by `ws[i]`; each row of `v` loaded
/// once for all of them, every output the same bits as [`axpy_rows`] gives.
pub(crate) fn axpy_rows_heads<E: KvElem>(
    isa: Isa,
    os: &mut [f32],
    hd: usize,
    ws: &[&[f32]],
    v: &[E],
    stride: usize,
) {
    let rows = ws.first().map_or(0, |w| w.len());
    assert!(
        ws.len() <= MAX_HEADS && os.len() >= ws.len() * hd && ws.iter().all(|w| w.len() == rows)
    );
    if let Some(last) = rows.checked_sub(1) {
        assert!(
            v.len() >= last * stride + hd,
            "axpy_rows_heads: v too short"
        );
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: `Isa::detect` found AVX-512F; `os` holds `ws.len()` heads
        // of `hd = 16 * N` and the rows are inside `v` (asserted).
        unsafe {
            match (hd, ws.len()) {
                (64, 2) => return x86::axpy_rows_heads512::<E, 4, 2>(os, ws, v, stride),
                (64, 3) => return x86::axpy_rows_heads512::<E, 4, 3>(os, ws, v, stride),
                (64, 4) => return x86::axpy_rows_heads512::<E, 4, 4>(os, ws, v, stride),
                (128, 2) => return x86::axpy_rows_heads512::<E, 8, 2>(os, ws, v, stride),
                (32, 2) => return x86::axpy_rows_heads512::<E, 2, 2>(os, ws, v, stride),
                (32, 3) => return x86::axpy_rows_heads512::<E, 2, 3>(os, ws, v, stride),
                (32, 4) => return x86::axpy_rows_heads512::<E, 2, 4>(os, ws, v, stride),
                _ => {}
            }
        }
    }
    for (o, w) in os.chunks_mut(hd).zip(ws) {
        axpy_rows(isa, o, w, v, stride);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{KvElem, KvKind};

    /// 16 elements at `p` as f32 (a bf16 or f16 widened in the register).
    ///
    /// # Safety
    /// AVX-512F; `p` points at 16 readable elements.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load16<E: KvElem>(p: *const E) -> __m512 {
        match E::KIND {
            KvKind::Bf16 => {
                // SAFETY: the caller's contract (16 bf16: 32 bytes).
                let h = unsafe { _mm256_loadu_si256(p.cast()) };
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            }
            KvKind::F16 => {
                // SAFETY: the caller's contract (16 f16: 32 bytes).
                // `vcvtph2ps` on 512 bits is AVX-512F.
                _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(p.cast()) })
            }
            // SAFETY: the caller's contract (16 f32).
            KvKind::F32 => unsafe { _mm512_loadu_ps(p.cast()) },
        }
    }

    /// [`super::tile_dot_heads`] for `H` queries: the same four chains per
    /// query as [`tile_dot512`], each tile row loaded once.
    ///
    /// # Safety
    /// AVX-512F; `qs.len() == H`, each of `hd` elements; `tile.len() >= hd * 16`;
    /// `out.len() >= H`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tile_dot_heads512<E: KvElem, const H: usize>(
        qs: &[&[f32]],
        tile: &[E],
        out: &mut [[f32; 16]],
    ) {
        let hd = qs[0].len();
        // Plain index loops over constant bounds and the queries' pointers
        // hoisted: the 4·H accumulators stay in registers (iterator zips
        // over arrays of vectors kept them on the stack, every FMA waiting
        // on a store: 30x slower).
        let mut qp = [std::ptr::null::<f32>(); H];
        for h in 0..H {
            qp[h] = qs[h].as_ptr();
        }
        let mut acc = [[_mm512_setzero_ps(); 4]; H];
        let t = tile.as_ptr();
        let mut d = 0;
        // Four rows at a time, so that the chains' indices are constants.
        while d + 4 <= hd {
            // SAFETY: rows `d..d + 4 <= hd` of the tile are inside it.
            let r = unsafe {
                [
                    load16(t.add(d * 16)),
                    load16(t.add((d + 1) * 16)),
                    load16(t.add((d + 2) * 16)),
                    load16(t.add((d + 3) * 16)),
                ]
            };
            for h in 0..H {
                for j in 0..4 {
                    // SAFETY: `d + j < hd == qs[h].len()`.
                    let q = _mm512_set1_ps(unsafe { *qp[h].add(d + j) });
                    acc[h][j] = _mm512_fmadd_ps(q, r[j], acc[h][j]);
                }
            }
            d += 4;
        }
        while d < hd {
            // SAFETY: row `d < hd` of the tile is inside it.
            let r = unsafe { load16(t.add(d * 16)) };
            for h in 0..H {
                // SAFETY: `d < hd == qs[h].len()`.
                let q = _mm512_set1_ps(unsafe { *qp[h].add(d) });
                acc[h][d % 4] = _mm512_fmadd_ps(q, r, acc[h][d % 4]);
            }
            d += 1;
        }
        for h in 0..H {
            let a = &acc[h];
            let sum = _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
            // SAFETY: `out[h]` holds 16 f32 (`out.len() >= H`).
            unsafe { _mm512_storeu_ps(out[h].as_mut_ptr(), sum) };
        }
    }

    /// [`super::axpy_rows_heads`] for `H` heads of `16 * N`, held in registers.
    ///
    /// # Safety
    /// AVX-512F; `os.len() >= H * 16 * N`; `ws.len() == H`, all of one length
    /// `r`; rows `i < r` of `v` (at `i * stride`) hold `16 * N` elements.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn axpy_rows_heads512<E: KvElem, const N: usize, const H: usize>(
        os: &mut [f32],
        ws: &[&[f32]],
        v: &[E],
        stride: usize,
    ) {
        // Index loops over constant bounds, weight pointers hoisted: the
        // accumulators stay in registers (see `tile_dot_heads512`).
        let mut wp = [std::ptr::null::<f32>(); H];
        for h in 0..H {
            wp[h] = ws[h].as_ptr();
        }
        let (o, vp) = (os.as_mut_ptr(), v.as_ptr());
        let mut acc = [[_mm512_setzero_ps(); N]; H];
        for h in 0..H {
            for j in 0..N {
                // SAFETY: `16 * (h * N + j) + 16 <= os.len()`.
                acc[h][j] = unsafe { _mm512_loadu_ps(o.add(16 * (h * N + j))) };
            }
        }
        for i in 0..ws[0].len() {
            let mut row = [_mm512_setzero_ps(); N];
            for j in 0..N {
                // SAFETY: the caller's contract: `v[i * stride..][..16 * N]`.
                row[j] = unsafe { load16(vp.add(i * stride + 16 * j)) };
            }
            for h in 0..H {
                // SAFETY: `i < ws[h].len()` (all of one length).
                let wv = _mm512_set1_ps(unsafe { *wp[h].add(i) });
                for j in 0..N {
                    acc[h][j] = _mm512_fmadd_ps(wv, row[j], acc[h][j]);
                }
            }
        }
        for h in 0..H {
            for j in 0..N {
                // SAFETY: as for the loads.
                unsafe { _mm512_storeu_ps(o.add(16 * (h * N + j)), acc[h][j]) };
            }
        }
    }

    /// [`super::tile_dot`] with fused multiply-adds.
    ///
    /// # Safety
    /// AVX-512F; `tile.len() >= q.len() * 16`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tile_dot512<E: KvElem>(q: &[f32], tile: &[E], out: &mut [f32; 16]) {
        let (mut a0, mut a1, mut a2, mut a3) = (
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
        );
        // SAFETY (every load): row `d < q.len()` of the tile is inside it
        // (the caller's contract).
        let row = |d: usize| unsafe { load16(tile.as_ptr().add(d * 16)) };
        let (quads, rest) = q.as_chunks::<4>();
        for (i, c) in quads.iter().enumerate() {
            let d = 4 * i;
            a0 = _mm512_fmadd_ps(_mm512_set1_ps(c[0]), row(d), a0);
            a1 = _mm512_fmadd_ps(_mm512_set1_ps(c[1]), row(d + 1), a1);
            a2 = _mm512_fmadd_ps(_mm512_set1_ps(c[2]), row(d + 2), a2);
            a3 = _mm512_fmadd_ps(_mm512_set1_ps(c[3]), row(d + 3), a3);
        }
        let d = 4 * quads.len();
        let acc = [&mut a0, &mut a1, &mut a2];
        for (i, (&qd, a)) in rest.iter().zip(acc).enumerate() {
            *a = _mm512_fmadd_ps(_mm512_set1_ps(qd), row(d + i), *a);
        }
        let sum = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
        // SAFETY: `out` holds 16 f32.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), sum) };
    }

    /// [`super::axpy_rows`] for `o.len() == 16 * N`, `o` held in `N` registers.
    ///
    /// # Safety
    /// AVX-512F; `o.len() == 16 * N`; row `i < w.len()` of `v` (at `i * stride`)
    /// holds `o.len()` elements.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn axpy_rows512<E: KvElem, const N: usize>(
        o: &mut [f32],
        w: &[f32],
        v: &[E],
        stride: usize,
    ) {
        debug_assert_eq!(o.len(), 16 * N);
        let mut acc = [_mm512_setzero_ps(); N];
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: `16 * j + 16 <= o.len()`.
            *a = unsafe { _mm512_loadu_ps(o.as_ptr().add(16 * j)) };
        }
        for (i, &wi) in w.iter().enumerate() {
            let wv = _mm512_set1_ps(wi);
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: the caller's contract: `v[i * stride..][..16 * N]`.
                *a =
                    unsafe { _mm512_fmadd_ps(wv, load16(v.as_ptr().add(i * stride + 16 * j)), *a) };
            }
        }
        for (j, a) in acc.iter().enumerate() {
            // SAFETY: as for the loads.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr().add(16 * j), *a) };
        }
    }

    /// # Safety
    /// AVX-512F; `o.len() == v.len()`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn axpy512<E: KvElem>(o: &mut [f32], w: f32, v: &[E]) {
        let n = o.len() / 16 * 16;
        let wv = _mm512_set1_ps(w);
        let mut c = 0;
        while c < n {
            // SAFETY: `c + 16 <= n <= len` for both slices.
            unsafe {
                let acc = _mm512_fmadd_ps(
                    wv,
                    load16(v.as_ptr().add(c)),
                    _mm512_loadu_ps(o.as_ptr().add(c)),
                );
                _mm512_storeu_ps(o.as_mut_ptr().add(c), acc);
            }
            c += 16;
        }
        for i in n..o.len() {
            o[i] += w * v[i].to_f32();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn match_the_portable_loops() {
        for n in [1usize, 7, 16, 32, 33, 64, 128, 131, 256] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            for isa in [Isa::detect(), Isa::Portable] {
                let mut o = a.clone();
                axpy(isa, &mut o, 0.5, &b);
                for i in 0..n {
                    assert!((o[i] - (a[i] + 0.5 * b[i])).abs() < 1e-6);
                }
                // Three rows of `n`, 5 apart beyond `n`: the same bits as axpy row by row.
                let stride = n + 5;
                let v: Vec<f32> = (0..3 * stride).map(|i| (i as f32 * 0.23).sin()).collect();
                let w = [0.25, -1.5, 0.75];
                let mut rows = a.clone();
                axpy_rows(isa, &mut rows, &w, &v, stride);
                let mut one_by_one = a.clone();
                for (i, &wi) in w.iter().enumerate() {
                    axpy(isa, &mut one_by_one, wi, &v[i * stride..]);
                }
                assert_eq!(rows, one_by_one, "{isa:?} axpy_rows {n}");
                let tile: Vec<f32> = (0..n * TILE_LANES)
                    .map(|i| (i as f32 * 0.17).cos())
                    .collect();
                // Several heads at once: the bits of one at a time.
                let qs: Vec<Vec<f32>> = (0..MAX_HEADS)
                    .map(|h| a.iter().map(|x| x * (h as f32 + 0.5)).collect())
                    .collect();
                for heads in 1..=MAX_HEADS {
                    let refs: Vec<&[f32]> = qs[..heads].iter().map(|q| &q[..]).collect();
                    let mut many = vec![[0f32; TILE_LANES]; heads];
                    tile_dot_heads(isa, &refs, &tile, &mut many);
                    let mut ws: Vec<Vec<f32>> = Vec::new();
                    for (h, q) in refs.iter().enumerate() {
                        let mut one = [0f32; TILE_LANES];
                        tile_dot(isa, q, &tile, &mut one);
                        assert_eq!(one, many[h], "{isa:?} tile_dot_heads {n} x {heads}");
                        ws.push(vec![0.5 - h as f32, 0.25, 2.0]);
                    }
                    let wrefs: Vec<&[f32]> = ws.iter().map(|w| &w[..]).collect();
                    let mut os: Vec<f32> = (0..heads * n).map(|i| i as f32 * 0.01).collect();
                    let mut each = os.clone();
                    axpy_rows_heads(isa, &mut os, n, &wrefs, &v, stride);
                    for (o, w) in each.chunks_mut(n).zip(&wrefs) {
                        axpy_rows(isa, o, w, &v, stride);
                    }
                    assert_eq!(os, each, "{isa:?} axpy_rows_heads {n} x {heads}");
                }
                narrow_like_widened(isa, &qs, &tile, &v, stride, n, bf16::from_f32);
                narrow_like_widened(isa, &qs, &tile, &v, stride, n, f16::from_f32);
                let mut got = [0f32; TILE_LANES];
                tile_dot(isa, &a, &tile, &mut got);
                for (j, g) in got.iter().enumerate() {
                    let want: f32 = (0..n).map(|d| a[d] * tile[d * TILE_LANES + j]).sum();
                    assert!((g - want).abs() < 1e-4, "{isa:?} tile_dot {n} lane {j}");
                }
            }
        }
    }

    /// A narrow (bf16, f16) tile and value rows give the bits of their f32
    /// widening, in every loop (the widening happens in the register).
    fn narrow_like_widened<E: KvElem>(
        isa: Isa,
        qs: &[Vec<f32>],
        tile: &[f32],
        v: &[f32],
        stride: usize,
        n: usize,
        round: fn(f32) -> E,
    ) {
        let narrow = |x: &[f32]| -> Vec<E> { x.iter().map(|&x| round(x)).collect() };
        let (tile16, v16) = (narrow(tile), narrow(v));
        let widen = |x: &[E]| -> Vec<f32> { x.iter().map(|x| x.to_f32()).collect() };
        let (tile32, v32) = (widen(&tile16), widen(&v16));
        for heads in 1..=MAX_HEADS {
            let refs: Vec<&[f32]> = qs[..heads].iter().map(|q| &q[..]).collect();
            let (mut from16, mut from32) = (
                vec![[0f32; TILE_LANES]; heads],
                vec![[0f32; TILE_LANES]; heads],
            );
            tile_dot_heads(isa, &refs, &tile16, &mut from16);
            tile_dot_heads(isa, &refs, &tile32, &mut from32);
            assert_eq!(
                from16,
                from32,
                "{isa:?} {:?} tile_dot_heads {n} x {heads}",
                E::KIND
            );
            let ws: Vec<Vec<f32>> = (0..heads)
                .map(|h| vec![0.5 - h as f32, 0.25, 2.0])
                .collect();
            let wrefs: Vec<&[f32]> = ws.iter().map(|w| &w[..]).collect();
            let mut o16: Vec<f32> = (0..heads * n).map(|i| i as f32 * 0.01).collect();
            let mut o32 = o16.clone();
            axpy_rows_heads(isa, &mut o16, n, &wrefs, &v16, stride);
            axpy_rows_heads(isa, &mut o32, n, &wrefs, &v32, stride);
            assert_eq!(
                o16,
                o32,
                "{isa:?} {:?} axpy_rows_heads {n} x {heads}",
                E::KIND
            );
        }
        // Lengths not a multiple of 16 take the scalar tail.
        let mut o16 = vec![1.0f32; n];
        let mut o32 = o16.clone();
        axpy(isa, &mut o16, 0.75, &v16);
        axpy(isa, &mut o32, 0.75, &v32);
        assert_eq!(o16, o32, "{isa:?} {:?} axpy {n}", E::KIND);
        // And the widening of a whole slice, as a tile of rows takes it.
        let mut wide = vec![0f32; v16.len()];
        E::widen(&v16, &mut wide);
        assert_eq!(wide, v32, "{:?} widen {n}", E::KIND);
    }
}
