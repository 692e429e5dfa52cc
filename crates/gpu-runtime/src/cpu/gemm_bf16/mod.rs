//! Matmuls with bf16 dot products (AVX512-BF16 `vdpbf16ps`, or Intel AMX
//! tiles: `amx.rs`), for bf16 weights under bf16 arithmetic (`--dtype
//! auto`, the default, or `bf16`). [`Kernel`] names the three kernels and
//! picks the fastest this CPU runs.
//!
//! `out[m, n] = x[m, k] · w[n, k]ᵀ` with bf16 weights, the activations
//! rounded to bf16 (round to nearest even) and each pair of products summed
//! in f32: what llama.cpp does with bf16 weights. One instruction does 32
//! multiply-adds where an f32 FMA does 16; the price is the rounding of the
//! activations (relative error about 2⁻⁹ per product), which takes the
//! logits out of the 1e-4 agreement with the f32 reference.
//!
//! Layout: the weights are read in panels of [`NR`] rows in which one
//! 64-byte load holds the pair `(2p, 2p+1)` of 16 rows
//! ([`DType::BF16Panels`](metrale_core::DType::BF16Panels)). Model weights
//! are packed so once at load ([`pack_in_place`]); a row-major operand
//! (the SSD scan's products, a weight left unpacked) is packed per call and
//! per panel into a thread's buffer. The activations are converted once to
//! bf16 pairs and broadcast. The panels are shared out over the backend's
//! team; each task writes its own columns of `out`.
//!
//! Batch invariance: every output `out[i, j]` is one accumulator lane fed
//! pair 0, 1, ..., `k/2 - 1` of row `i` and column `j` in that order, by the
//! same instruction, whatever `m` is, however the rows are tiled, whichever
//! thread runs the panel and whether the panel was packed at load or per
//! call. A decode row's result is therefore bitwise the same alone or among
//! any number of others, in decode steps and prefill chunks alike.

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};

use half::bf16;

use super::team::Team;

#[cfg(target_arch = "x86_64")]
mod amx;
mod lookahead;
mod panels;
#[cfg(target_arch = "x86_64")]
mod x86;

use lookahead::{Lookahead, prefetch_part};
use panels::{Panel, panel, panel_pairs};
pub(crate) use panels::{pack_in_place, panel_row};

#[cfg(target_arch = "x86_64")]
use amx::Tiles;
/// No tiles off x86-64 ([`Kernel::Amx`] is never available there).
#[cfg(not(target_arch = "x86_64"))]
struct Tiles;

/// Weight rows per panel (two 16-lane vectors).
pub(crate) const NR: usize = metrale_core::PANEL_ROWS;
/// Activation rows per micro-tile of [`Kernel::Dot`], and the rows of a
/// tile's output buffer.
const MR: usize = 8;
/// Up to this many activation rows each task takes one run of panels (see
/// `run`). Measured on 40 streamed 3072x768 matrices, 2 threads, against
/// panels dealt one at a time: at 16 rows 253 against 290 µs a matrix
/// (medians of 4 rounds), at 1 and 32 rows the same.
const STREAMING_ROWS: usize = 64;
/// Below this many activation elements the pairs are made on the calling
/// thread alone (a team dispatch costs more than the conversion).
const SERIAL_PAIRS: usize = 1 << 14;
/// Activation rows per micro-tile of [`Kernel::Fma`]: six rows' four
/// accumulators (even and odd elements, two column vectors) fill 24 of the
/// 32 vector registers, so a tile takes both chains in one pass over its
/// panel. Eight rows in two passes (the even elements, then the odd) read
/// each panel twice as often: 12% slower on cached 64-row products (and
/// Granite's batch-16 decode 1.04x slower, the median of 12 noisy pairs).
const FMA_MR: usize = 6;
const _: () = assert!(FMA_MR <= MR);
/// Activation rows per micro-tile of [`Kernel::Amx`]: two 16-row tiles.
const AMX_MR: usize = 32;
/// Rows of a tile's output buffer: the most rows any kernel's tile takes.
const OUT_ROWS: usize = AMX_MR;
const _: () = assert!(MR <= OUT_ROWS);
#[cfg(target_arch = "x86_64")]
const _: () = assert!(AMX_MR == amx::AMX_MR);
/// Pairs of `k` per AMX tile: [`Kernel::Amx`]'s activations and panels
/// are padded with zeros to a multiple of it.
const AMX_PAIRS: usize = 16;

thread_local! {
    /// A row-major operand's panel, packed per call, per team thread.
    static PANEL: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    /// The second operand's panel of a fused SwiGLU, per team thread.
    static PANEL_UP: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    /// The activations as bf16 pairs, per calling thread.
    static ACTS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// Whether this CPU can run these kernels.
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

/// Whether this CPU and OS run [`Kernel::Amx`] (asks Linux for the tile
/// state the first time).
fn amx_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        available() && amx::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The micro-kernel of the products: the fastest this CPU runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// AVX512-BF16's `vdpbf16ps`: the activations rounded to bf16, 32
    /// multiply-adds an instruction (what llama.cpp does with bf16
    /// weights). Zen 4 runs one 512-bit `vdpbf16ps` a cycle, as many as
    /// FMAs: twice their multiply-adds.
    Dot,
    /// AVX-512F FMAs on the weights widened to f32 (exactly: a bf16 is an
    /// f32's top half) and the activations as they are: 16 multiply-adds an
    /// instruction and no rounding of the activations. Intel's cores run
    /// two 512-bit FMAs a cycle but one `vdpbf16ps` every two (measured on
    /// Emerald Rapids: 5.0 against 1.25 billion a second per core), so
    /// there the FMAs do twice the multiply-adds, widening included.
    Fma,
    /// Intel AMX's `tdpbf16ps` tiles (Sapphire Rapids and later): the same
    /// arithmetic as [`Kernel::Dot`] (activations rounded to bf16, pairs of
    /// products summed in f32), 16 rows by 16 columns by 32 of `k` an
    /// instruction. Where the FMAs top out at a third of a batch-16
    /// decode step's time, the tiles leave it bound by the weights'
    /// streaming alone.
    Amx,
}

impl Kernel {
    /// The faster kernel on this CPU, where it runs them ([`available`]):
    /// by vendor, so that a model's numbers do not depend on a timing.
    pub fn detect() -> Option<Kernel> {
        available().then(|| {
            if amx_available() {
                Kernel::Amx
            } else if intel() {
                Kernel::Fma
            } else {
                Kernel::Dot
            }
        })
    }

    /// Whether this CPU runs the kernel.
    pub fn runs_here(self) -> bool {
        match self {
            Kernel::Dot | Kernel::Fma => available(),
            Kernel::Amx => amx_available(),
        }
    }

    /// Every kernel this CPU runs.
    pub fn available_here() -> Vec<Kernel> {
        [Kernel::Dot, Kernel::Fma, Kernel::Amx]
            .into_iter()
            .filter(|k| k.runs_here())
            .collect()
    }

    /// The kernel's short name, as `METRALE_CPU_KERNEL` and `bench
    /// --cpu-kernel` spell it: `amx`, `dot` or `fma`.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Dot => "dot",
            Kernel::Fma => "fma",
            Kernel::Amx => "amx",
        }
    }

    /// The kernel of a short name ([`Kernel::name`]), any case.
    pub fn from_name(name: &str) -> Option<Kernel> {
        [Kernel::Amx, Kernel::Dot, Kernel::Fma]
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(name.trim()))
    }

    /// What the kernel computes, for reports ("bf16 dot products").
    pub fn describe(self) -> &'static str {
        match self {
            Kernel::Dot => "bf16 dot products",
            Kernel::Fma => "f32 FMA on bf16 weights",
            Kernel::Amx => "bf16 AMX tiles",
        }
    }
}

/// Whether this is an Intel CPU (CPUID's vendor string), asked once.
fn intel() -> bool {
    static INTEL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *INTEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let r = std::arch::x86_64::__cpuid(0);
            let vendor: Vec<u8> = [r.ebx, r.edx, r.ecx]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            vendor == b"GenuineIntel"
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

/// A tile's activations as its kernel reads them.
#[derive(Clone, Copy)]
enum Acts<'a> {
    /// Rounded to bf16 pairs, `k.div_ceil(2)` a row ([`Kernel::Dot`]).
    Pairs(&'a [u32]),
    /// As they are, `k` a row ([`Kernel::Fma`]).
    F32(&'a [f32]),
    /// Rounded to bf16 pairs, `k.div_ceil(2)` padded with zeros to a
    /// multiple of [`AMX_PAIRS`] a row, the rows to a multiple of 16
    /// ([`Kernel::Amx`]).
    Tiles(&'a [u32]),
}

impl<'a> Acts<'a> {
    /// Rows `i0..i0 + rows` of `k` elements.
    fn rows(self, i0: usize, rows: usize, k: usize) -> Acts<'a> {
        match self {
            Acts::Pairs(a) => {
                let kp = k.div_ceil(2);
                Acts::Pairs(&a[i0 * kp..(i0 + rows) * kp])
            }
            Acts::F32(x) => Acts::F32(&x[i0 * k..(i0 + rows) * k]),
            Acts::Tiles(a) => {
                let kp = amx_pairs(k);
                Acts::Tiles(&a[i0 * kp..(i0 + rows.next_multiple_of(16)) * kp])
            }
        }
    }
}

/// A matmul's weight operand `[n, k]`.
#[derive(Clone, Copy)]
pub(crate) enum Operand<'a> {
    /// Row-major bf16, packed per call.
    Rows(&'a [bf16]),
    /// Packed at load ([`pack_in_place`]): `n · k / 2` pairs.
    Panels(&'a [u32]),
}

impl<'a> Operand<'a> {
    fn check(&self, n: usize, k: usize) -> bool {
        match self {
            Operand::Rows(w) => w.len() >= n * k,
            Operand::Panels(p) => k.is_multiple_of(2) && p.len() >= n * k / 2,
        }
    }

    /// Panel `t`'s pairs where the operand was packed at load (None for a
    /// row-major one).
    fn panel_at_load(&self, t: usize, n: usize, k: usize) -> Option<&'a [u32]> {
        match *self {
            Operand::Panels(p) => Some(panel_pairs(p, t, n, k)),
            Operand::Rows(_) => None,
        }
    }

    /// The rows panel `t` is packed from, for a row-major operand: what to
    /// prefetch before packing it. None for panels packed at load.
    fn rows_of_panel(&self, t: usize, n: usize, k: usize) -> Option<&'a [bf16]> {
        let (a, rows) = (t * NR, NR.min(n - t * NR));
        match *self {
            Operand::Rows(w) => Some(&w[a * k..(a + rows) * k]),
            Operand::Panels(_) => None,
        }
    }
}

/// Where `out` is written by the tasks, each its own columns.
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

/// `out[i * n + j] = Σ_c bf16(x[i * k + c]) · w[j * k + c]` (f32 sums):
/// the SSD scan's products, on AMX tiles with `tiles` where the CPU runs
/// them (the backend's kernel is [`Kernel::Amx`]), else with [`Kernel::Dot`]
/// (never [`Kernel::Fma`]). With `Fma` the scan ran 25%
/// slower on Emerald Rapids, most likely from the microcode assists FMAs
/// take on subnormals, which its f32 operands (states, inputs weighted by
/// decays) hold where the decays underflow, and which `vdpbf16ps` and AMX
/// flush (that host's VM shows no performance counters to confirm it).
/// AMX against `Dot`, Granite-4.0-H-350M Q4_K_M, 512-token prefill, four
/// interleaved pairs: `ssd_scan` 356-409 -> 290-361 ms. Returns false,
/// doing nothing, when the CPU lacks AVX512-BF16.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    tiles: bool,
    team: &Team,
    x: &[f32],
    w: &[bf16],
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
) -> bool {
    let kernel = if tiles && amx_available() {
        Kernel::Amx
    } else {
        Kernel::Dot
    };
    matmul(kernel, Some(team), x, Operand::Rows(w), None, out, m, n, k)
}

/// `out = x · wᵀ`, or with `up` `silu(x · wᵀ) * (x · upᵀ)`, each product
/// by `kernel` (one of [`Kernel::all`]; the backend's is
/// [`Kernel::detect`]'s) and the SiLU as `silu_mul` does, applied to each
/// tile before it is stored (the same bits as two products and `silu_mul`).
/// `team`: None runs on the calling thread alone (small matrices). False,
/// doing nothing, where the CPU lacks AVX512-BF16 or `w` and `up` are not
/// both of one kind.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    kernel: Kernel,
    team: Option<&Team>,
    x: &[f32],
    w: Operand<'_>,
    up: Option<Operand<'_>>,
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
) -> bool {
    let same_kind = match up {
        None => true,
        Some(u) => std::mem::discriminant(&u) == std::mem::discriminant(&w),
    };
    let tiles = kernel == Kernel::Amx;
    if !available() || !same_kind || (tiles && !amx_available()) {
        return false;
    }
    assert!(x.len() >= m * k && out.len() >= m * n && w.check(n, k));
    assert!(up.is_none_or(|u| u.check(n, k)));
    if m == 0 || n == 0 {
        return true;
    }
    if kernel == Kernel::Fma {
        run(team, Acts::F32(x), w, up, out, m, n, k);
        return true;
    }
    // AMX's activation tiles are read 16 pairs a row: pairs padded with
    // zeros to a multiple of 16; rows (of products of 16 or more) to a
    // multiple of 16, left unwritten.
    let kp = k.div_ceil(2);
    let (stride, rows) = if tiles {
        (amx_pairs(k), m.next_multiple_of(16))
    } else {
        (kp, m)
    };
    ACTS.with_borrow_mut(|xb| {
        // Every row is overwritten: only growth is zeroed.
        if xb.len() < rows * stride {
            xb.resize(rows * stride, 0);
        }
        let xb = &mut xb[..rows * stride];
        // The padding rows are left as they are: their output rows are
        // never read back, and a row's result depends on its own row alone
        // (a product of fewer than 16 rows does not even load them).
        let convert = |i: usize, dst: &mut [u32]| {
            if i < m {
                to_pairs(&x[i * k..(i + 1) * k], &mut dst[..kp]);
                dst[kp..].fill(0);
            }
        };
        match team.filter(|_| m * k >= SERIAL_PAIRS) {
            Some(team) => team.chunks(xb, stride, convert),
            None => xb
                .chunks_mut(stride)
                .enumerate()
                .for_each(|(i, d)| convert(i, d)),
        }
        let acts = if tiles {
            Acts::Tiles(xb)
        } else {
            Acts::Pairs(xb)
        };
        run(team, acts, w, up, out, m, n, k);
    });
    true
}

/// FLOPs of `iters` rounds of [`Kernel::Amx`]'s instruction on tiles
/// held in the registers, for a compute probe; None where this CPU runs no
/// AMX tiles.
pub fn amx_peak_block(iters: usize) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    if amx_available() {
        // SAFETY: AMX is available (checked just above).
        return Some(unsafe { amx::peak_block(iters) });
    }
    let _ = iters;
    None
}

/// Pairs of `k` as [`Kernel::Amx`] reads them: padded to whole tiles.
fn amx_pairs(k: usize) -> usize {
    k.div_ceil(2).next_multiple_of(AMX_PAIRS)
}

/// `src` (f32) as bf16 pairs `(2p, 2p+1)` in `dst`, rounded to nearest even.
pub(super) fn to_pairs(src: &[f32], dst: &mut [u32]) {
    let even = src.len() / 32 * 32;
    #[cfg(target_arch = "x86_64")]
    // SAFETY: callers checked `available()`; the kernel reads `even` elements
    // of `src` and writes `even / 2` of `dst` (which holds
    // `src.len().div_ceil(2)`).
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

/// `tile = a[..rows] · panel` for `rows <= tile_rows(a)` activation rows
/// of `k`; `ahead`: the next panel's prefetch, kept up with
/// ([`Kernel::Fma`] only).
#[allow(clippy::too_many_arguments)]
fn tile(
    a: Acts<'_>,
    rows: usize,
    p: &Panel<'_>,
    tiles: Option<&Tiles>,
    ahead: &mut Lookahead<'_>,
    k: usize,
    out: &mut [[f32; NR]; OUT_ROWS],
) {
    let kp = k.div_ceil(2);
    let full = p.stride == NR;
    // SAFETY (every arm): `available()` was checked by `matmul`; `a` holds
    // `rows` rows (of `kp` pairs or `k` floats) and the panel `kp * stride`.
    macro_rules! dot {
        ($($r:literal)*) => {
            match (rows, full, a) {
                $(($r, true, Acts::Pairs(a)) =>
                    unsafe { x86::tile::<$r, true>(a, p.pairs, kp, p.stride, out) },
                  ($r, false, Acts::Pairs(a)) =>
                    unsafe { x86::tile::<$r, false>(a, p.pairs, kp, p.stride, out) },)*
                _ => unreachable!("at most MR rows per bf16 dot tile"),
            }
        };
    }
    macro_rules! fma {
        ($($r:literal)*) => {
            match (rows, full, a) {
                $(($r, true, Acts::F32(x)) =>
                    unsafe { x86::tile_fma::<$r, true>(x, k, p.pairs, p.stride, ahead, out) },
                  ($r, false, Acts::F32(x)) =>
                    unsafe { x86::tile_fma::<$r, false>(x, k, p.pairs, p.stride, ahead, out) },)*
                _ => unreachable!("at most FMA_MR rows per FMA tile"),
            }
        };
    }
    #[cfg(target_arch = "x86_64")]
    match a {
        Acts::Pairs(_) => dot!(1 2 3 4 5 6 7 8),
        Acts::F32(_) => fma!(1 2 3 4 5 6),
        Acts::Tiles(a) => {
            let tiles = tiles.expect("Acts::Tiles come with configured tiles");
            // SAFETY: `tiles` is this thread's configuration; `a` holds
            // `rows` rows padded to 16 of `amx_pairs(k)` pairs and the
            // panel (from `tile_panel`) as many pairs of NR columns.
            unsafe { amx::tile(tiles, a, rows, amx_pairs(k), p.pairs, ahead, out) }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (a, rows, p, tiles, ahead, kp, full, out);
}

#[allow(clippy::too_many_arguments)]
fn run(
    team: Option<&Team>,
    acts: Acts<'_>,
    w: Operand<'_>,
    up: Option<Operand<'_>>,
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
) {
    let panels = n.div_ceil(NR);
    let next = AtomicUsize::new(0);
    let ptr = OutPtr(out.as_mut_ptr());
    let tasks = team.map_or(1, |t| t.threads().min(panels));
    // Decode-sized steps stream the weights: each task takes one run of
    // whole panels, one sequential stream as the hardware prefetcher likes
    // it. Prefill-sized ones are compute-bound: the panels go out one at a
    // time from a counter, which evens out the tasks' speeds.
    let streaming = m <= STREAMING_ROWS;
    let work = |task: usize| {
        let (mut from, to) = (panels * task / tasks, panels * (task + 1) / tasks);
        let mut claim = || {
            if streaming {
                from += 1;
                (from <= to).then_some(from - 1)
            } else {
                Some(next.fetch_add(1, Ordering::Relaxed)).filter(|&t| t < panels)
            }
        };
        // This thread's AMX tiles, configured for the task's panels.
        let session = tile_session(acts, m);
        PANEL.with_borrow_mut(|buf| {
            PANEL_UP.with_borrow_mut(|buf_up| {
                // Each task claims its next panel one ahead and, during the
                // last quarter of the current panel's row tiles, prefetches
                // the rows packing it will read (32 rows at a time: more
                // streams than the hardware prefetcher follows; a panel
                // packed at load is one stream, left to the hardware).
                let mut current = claim();
                while let Some(t) = current {
                    let ahead = claim();
                    let upcoming = ahead.and_then(|ahead| {
                        let w_rows = w.rows_of_panel(ahead, n, k)?;
                        Some((w_rows, up.and_then(|u| u.rows_of_panel(ahead, n, k))))
                    });
                    let mr = tile_rows(acts);
                    let tiles = m.div_ceil(mr);
                    let from = tiles - tiles.div_ceil(4);
                    let j0 = t * NR;
                    let cols = NR.min(n - j0);
                    let on_tiles = session.is_some();
                    let pw = panel(w, buf, t, n, k, on_tiles);
                    let pu = up.map(|u| panel(u, buf_up, t, n, k, on_tiles));
                    // A decode step's panels stream from memory: each
                    // operand's next panel is prefetched over all the
                    // steps of this one's.
                    let next = ahead.filter(|_| streaming && !matches!(acts, Acts::Pairs(_)));
                    let steps = lookahead_steps(acts, m, k);
                    let mut ahead_w = Lookahead::new(w, next, n, k, steps);
                    let mut ahead_u = up.map(|u| Lookahead::new(u, next, n, k, steps));
                    let (mut g, mut u) = ([[0f32; NR]; OUT_ROWS], [[0f32; NR]; OUT_ROWS]);
                    let mut row = [0f32; NR];
                    for (ti, i0) in (0..m).step_by(mr).enumerate() {
                        if let Some((wr, ur)) = upcoming.filter(|_| ti >= from) {
                            prefetch_part(wr, ti - from, tiles - from);
                            if let Some(ur) = ur {
                                prefetch_part(ur, ti - from, tiles - from);
                            }
                        }
                        let rows = mr.min(m - i0);
                        let a = acts.rows(i0, rows, k);
                        let s = session.as_ref();
                        tile(a, rows, &pw, s, &mut ahead_w, k, &mut g);
                        if let (Some(pu), Some(ahead_u)) = (&pu, &mut ahead_u) {
                            tile(a, rows, pu, s, ahead_u, k, &mut u);
                        }
                        for (r, g) in g.iter().enumerate().take(rows) {
                            let v = if pu.is_some() {
                                super::elementwise::silu_mul(
                                    &mut row[..cols],
                                    &g[..cols],
                                    &u[r][..cols],
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
                    current = ahead;
                }
            })
        })
    };
    match team {
        Some(team) => team.run(tasks, &work),
        None => work(0),
    }
}

/// Activation rows per tile: [`MR`] for [`Kernel::Dot`], [`FMA_MR`] for
/// [`Kernel::Fma`], [`AMX_MR`] for [`Kernel::Amx`].
fn tile_rows(acts: Acts<'_>) -> usize {
    match acts {
        Acts::Pairs(_) => MR,
        Acts::F32(_) => FMA_MR,
        Acts::Tiles(_) => AMX_MR,
    }
}

/// The calling thread's tiles configured, for [`Kernel::Amx`]'s
/// activations, for a product of `m` rows (released when dropped); None
/// for the other kernels.
fn tile_session(acts: Acts<'_>, m: usize) -> Option<Tiles> {
    match acts {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Acts::Tiles` are made by `matmul` only where
        // `amx_available()`.
        Acts::Tiles(_) => Some(unsafe { Tiles::configure(m) }),
        _ => None,
    }
}

/// Steps over a panel that [`Lookahead`] spreads the next one's prefetch
/// over: [`Kernel::Fma`]'s (see [`fma_steps`]), or [`Kernel::Amx`]'s, two
/// per 16-pair chunk of each 32-row tile.
fn lookahead_steps(acts: Acts<'_>, m: usize, k: usize) -> usize {
    match acts {
        Acts::Tiles(_) => 2 * m.div_ceil(AMX_MR) * amx_pairs(k) / AMX_PAIRS,
        _ => fma_steps(m, k),
    }
}

/// [`Kernel::Fma`]'s steps over a panel for `m` activation rows of `k`:
/// one per pair in each of its tiles' single pass.
fn fma_steps(m: usize, k: usize) -> usize {
    m.div_ceil(FMA_MR) * k.div_ceil(2)
}

#[cfg(test)]
mod tests;
