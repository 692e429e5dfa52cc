//! The Mamba-2 SSD scan: the chunked (matrix) form for prefill and the
//! per-token recurrence for decode.
//!
//! Chunked form, per head, for a chunk of `q` tokens with `a_t = dt_t·A` and
//! `cum_t = Σ_{s≤t} a_s` (accumulated in f64, so that differences of large
//! sums stay exact enough):
//!
//! - `y_t = exp(cum_t)·C_t·S + Σ_{s≤t} (C_t·B_s)·exp(cum_t − cum_s)·dt_s·x_s + D·x_t`
//! - `S ← exp(cum_last)·S + Σ_s exp(cum_last − cum_s)·dt_s·x_s ⊗ B_s`
//!
//! `C·Bᵀ` is computed once per group and chunk (heads of a group share it).

use super::math::{Buf, SPAN, View, decay_lower, matmul, softplus};
use super::{Mode, SeqIo};
use crate::cpu::simd::{exp_fast, from_bf16, simd_fn, to_bf16, to_bf16_state};
use half::bf16;

use crate::cpu::gemm_bf16;
use crate::cpu::team::Team;
use crate::ops::recurrent::SsdParams;

/// Most tokens per chunk of the chunked form (`chunk_size` may lower it):
/// the work per token grows with the chunk, so this is as short as keeps
/// the matrix products efficient. The result does not depend on it.
const MAX_CHUNK: usize = 64;

/// The operands of one call, read-only, with the per-head parameters widened.
pub(super) struct Ctx<'a> {
    pub x: &'a [f32],
    pub dt_raw: &'a [f32],
    pub b: &'a [f32],
    pub c: &'a [f32],
    /// Elements between rows of `x`, and of `b` and `c`.
    pub x_stride: usize,
    pub bc_stride: usize,
    /// `A = -exp(A_log)`.
    pub neg_a: Vec<f32>,
    pub d: Vec<f32>,
    pub dt_bias: Vec<f32>,
    pub p: SsdParams,
    /// The backend's bf16 dot products are on and the states are held in
    /// bf16: the chunked form's two state products (entering state · C,
    /// weighted x · B) use them too.
    pub bf16_dot: bool,
    /// Those products on AMX tiles (the backend's bf16 kernel is
    /// `Bf16Kernel::Amx`), else with `vdpbf16ps`.
    pub tiles: bool,
}

impl Ctx<'_> {
    fn dt(&self, row: usize, h: usize) -> f32 {
        softplus(self.dt_raw[row * self.p.n_heads + h] + self.dt_bias[h])
            .clamp(self.p.dt_min, self.p.dt_max)
    }

    fn group(&self, h: usize) -> usize {
        h / (self.p.n_heads / self.p.n_groups)
    }
}

/// Scans one sequence, writing its rows of `y` and updating its state, its
/// heads spread over `par`.
pub(super) fn scan_seq(ctx: &Ctx<'_>, io: SeqIo<'_>, mode: Mode, team: &Team) {
    let SsdParams {
        n_heads: nh,
        head_dim: hp,
        d_state: n,
        ..
    } = ctx.p;
    let (len, row0) = (io.len, io.row_start);
    if len == 0 {
        return;
    }
    let recurrent = len == 1 || mode == Mode::Recurrent;
    let span = SPAN.min(len);
    // Head-major output [nh, span, hp], so each head writes a contiguous piece.
    let mut ys = Buf::zeroed(nh * span * hp);
    for s0 in (0..len).step_by(span) {
        let sl = span.min(len - s0);
        let ys = &mut ys[..nh * sl * hp];
        if recurrent {
            team.chunks2(io.state, hp * n, ys, sl * hp, |h, s, yh| {
                recurrent_head(ctx, row0 + s0, sl, h, s, yh)
            });
        } else {
            chunked(ctx, row0 + s0, sl, io.state, ys, team);
        }
        let ys = &*ys;
        let out = &mut io.out[s0 * nh * hp..(s0 + sl) * nh * hp];
        team.chunks(out, nh * hp, |t, row| {
            for (h, dst) in row.chunks_mut(hp).enumerate() {
                dst.copy_from_slice(&ys[(h * sl + t) * hp..(h * sl + t + 1) * hp]);
            }
        });
    }
}

/// One token of each of `seqs` (every one of length 1): each head's state
/// updated in place and its output written, all (sequence, head) pairs
/// shared out over the team in one pass. The same arithmetic as
/// [`scan_seq`] on one token, so a sequence's bits do not depend on the
/// others in its step.
pub(super) fn step_seqs(ctx: &Ctx<'_>, seqs: Vec<SeqIo<'_>>, team: &Team) {
    step_heads(ctx, seqs, team, |ctx, row, h, s, y| {
        recurrent_head(ctx, row, 1, h, s, y)
    });
}

/// [`step_seqs`] on states held in bf16: every (sequence, head) state read,
/// updated and rounded back in one pass (with AVX512-BF16's conversion
/// where the CPU has it), so the state crosses memory at half the f32
/// traffic.
pub(super) fn step_seqs_bf16(ctx: &Ctx<'_>, seqs: Vec<SeqIo<'_, bf16>>, team: &Team) {
    #[cfg(target_arch = "x86_64")]
    if gemm_bf16::available() {
        step_heads(ctx, seqs, team, |ctx, row, h, s, y| {
            // SAFETY: the CPU has AVX-512F and AVX512-BF16 (`available`).
            unsafe { head_token_bf16_avx512(ctx, row, h, s, y) }
        });
        return;
    }
    step_heads(ctx, seqs, team, head_token_bf16);
}

/// `update(ctx, row, head, state, y)` for every (sequence, head) of `seqs`,
/// shared out over the team.
fn step_heads<S: Send>(
    ctx: &Ctx<'_>,
    seqs: Vec<SeqIo<'_, S>>,
    team: &Team,
    update: impl Fn(&Ctx<'_>, usize, usize, &mut [S], &mut [f32]) + Sync,
) {
    let (hp, n) = (ctx.p.head_dim, ctx.p.d_state);
    let mut heads: Vec<(usize, usize, &mut [S], &mut [f32])> = Vec::new();
    for io in seqs {
        let row = io.row_start;
        let pairs = io.state.chunks_mut(hp * n).zip(io.out.chunks_mut(hp));
        heads.extend(pairs.enumerate().map(|(h, (s, y))| (row, h, s, y)));
    }
    team.chunks(&mut heads, heads_per_task(&ctx.p), |_, group| {
        for (row, h, s, y) in group {
            update(ctx, *row, *h, s, y);
        }
    });
}

/// A state value as stored: f32, or bf16 widened on load and rounded on
/// store (nearest even, subnormals to zero: `to_bf16_state`).
trait StateValue: Copy {
    fn load(self) -> f32;
    fn store(v: f32) -> Self;
}

impl StateValue for f32 {
    #[inline(always)]
    fn load(self) -> f32 {
        self
    }
    #[inline(always)]
    fn store(v: f32) -> f32 {
        v
    }
}

impl StateValue for bf16 {
    #[inline(always)]
    fn load(self) -> f32 {
        from_bf16(self)
    }
    #[inline(always)]
    fn store(v: f32) -> bf16 {
        to_bf16_state(v)
    }
}

/// What one token of head `h` at `row` reads: its `dt`, the state's decay
/// `exp(dt·A)`, its `x` (`hp` values) and its group's `B` and `C` (`n`).
struct TokenInputs<'a> {
    dt: f32,
    da: f32,
    x: &'a [f32],
    b: &'a [f32],
    c: &'a [f32],
}

impl<'a> TokenInputs<'a> {
    #[inline(always)]
    fn new(ctx: &'a Ctx<'_>, row: usize, h: usize) -> Self {
        let (hp, n) = (ctx.p.head_dim, ctx.p.d_state);
        let (width, bc, g) = (ctx.x_stride, ctx.bc_stride, ctx.group(h));
        let dt = ctx.dt(row, h);
        Self {
            dt,
            da: (dt * ctx.neg_a[h]).exp(),
            x: &ctx.x[row * width + h * hp..][..hp],
            b: &ctx.b[row * bc + g * n..][..n],
            c: &ctx.c[row * bc + g * n..][..n],
        }
    }
}

/// One token of head `h` at `row`: `s = s·exp(dt·A) + dt·x·B` and `y =
/// s·C + D·x` in one pass, 16 lanes wide; `y` sums the new values before
/// they are stored (for bf16, before rounding: as an f32 state rounded
/// after the update). Inlined into the `simd_fn` kernels below.
#[inline(always)]
fn head_token<S: StateValue>(ctx: &Ctx<'_>, row: usize, h: usize, s: &mut [S], y: &mut [f32]) {
    let (hp, n) = (ctx.p.head_dim, ctx.p.d_state);
    let TokenInputs { dt, da, x, b, c } = TokenInputs::new(ctx, row, h);
    for ((sp, &xp), y) in s.chunks_mut(n).zip(x).zip(&mut y[..hp]) {
        let xdt = xp * dt;
        let mut acc = [0f32; 16];
        let (sc, st) = sp.as_chunks_mut::<16>();
        let ((bc, bt), (cc, ct)) = (b.as_chunks::<16>(), c.as_chunks::<16>());
        for ((sv, bv), cv) in sc.iter_mut().zip(bc).zip(cc) {
            for l in 0..16 {
                let v = sv[l].load() * da + xdt * bv[l];
                sv[l] = S::store(v);
                acc[l] += v * cv[l];
            }
        }
        let mut tail = 0f32;
        for ((sv, bv), cv) in st.iter_mut().zip(bt).zip(ct) {
            let v = sv.load() * da + xdt * bv;
            *sv = S::store(v);
            tail += v * cv;
        }
        *y = acc.iter().sum::<f32>() + tail + ctx.d[h] * xp;
    }
}

simd_fn! {
    /// The per-token recurrence of head `h` over rows `row0..row0 + len`.
    fn recurrent_head(ctx: &Ctx<'_>, row0: usize, len: usize, h: usize, s: &mut [f32], yh: &mut [f32]) {
        let hp = ctx.p.head_dim;
        for t in 0..len {
            head_token(ctx, row0 + t, h, s, &mut yh[t * hp..(t + 1) * hp]);
        }
    }
}

simd_fn! {
    /// [`head_token`] on a bf16 state, portable (where the CPU lacks
    /// AVX512-BF16 for [`head_token_bf16_avx512`]; the same bits).
    fn head_token_bf16(ctx: &Ctx<'_>, row: usize, h: usize, s: &mut [bf16], y: &mut [f32]) {
        head_token(ctx, row, h, s, y)
    }
}

/// [`head_token`] on a bf16 state with 512-bit vectors: the state widened
/// with a shift and rounded with `vcvtneps2bf16` (three instructions per 16
/// values, where the portable rounding takes a dozen and made a batched
/// step slower than an f32 state). The arithmetic is `head_token`'s, in
/// its order, and `to_bf16_state` is the instruction's rounding (tested in
/// `simd.rs`), so the bits are the portable kernel's.
///
/// # Safety
/// The CPU must have AVX-512F and AVX512-BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn head_token_bf16_avx512(
    ctx: &Ctx<'_>,
    row: usize,
    h: usize,
    s: &mut [bf16],
    y: &mut [f32],
) {
    use std::arch::x86_64::*;
    let (hp, n) = (ctx.p.head_dim, ctx.p.d_state);
    let TokenInputs { dt, da, x, b, c } = TokenInputs::new(ctx, row, h);
    let full = n / 16 * 16;
    for ((sp, &xp), y) in s.chunks_mut(n).zip(x).zip(&mut y[..hp]) {
        let xdt = xp * dt;
        let (vda, vxdt) = (_mm512_set1_ps(da), _mm512_set1_ps(xdt));
        let mut acc = _mm512_setzero_ps();
        for k in (0..full).step_by(16) {
            // SAFETY: `k + 16 <= n`, the length of `sp`, `b` and `c`.
            unsafe {
                let at = sp.as_mut_ptr().add(k) as *mut __m256i;
                let raw = _mm256_loadu_si256(at);
                let sv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
                let bv = _mm512_loadu_ps(b.as_ptr().add(k));
                let cv = _mm512_loadu_ps(c.as_ptr().add(k));
                let v = _mm512_add_ps(_mm512_mul_ps(sv, vda), _mm512_mul_ps(vxdt, bv));
                _mm256_storeu_si256(
                    at,
                    std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(v)),
                );
                acc = _mm512_add_ps(acc, _mm512_mul_ps(v, cv));
            }
        }
        let mut lanes = [0f32; 16];
        // SAFETY: `lanes` holds 16 f32.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), acc) };
        let mut tail = 0f32;
        for ((sv, &bv), &cv) in sp[full..].iter_mut().zip(&b[full..]).zip(&c[full..]) {
            let v = sv.load() * da + xdt * bv;
            *sv = <half::bf16 as StateValue>::store(v);
            tail += v * cv;
        }
        *y = lanes.iter().sum::<f32>() + tail + ctx.d[h] * xp;
    }
}

/// Runs `f` with this thread's scratch for chunks of `cap` tokens.
fn with_scratch(cap: usize, hp: usize, n: usize, f: impl FnOnce(&mut Scratch)) {
    thread_local! {
        /// This thread's scratch and the (cap, hp, n) it was sized for.
        static SCRATCH: std::cell::RefCell<Option<(ScratchKey, Scratch)>> =
            const { std::cell::RefCell::new(None) };
    }
    SCRATCH.with_borrow_mut(|slot| {
        if !matches!(slot, Some((key, _)) if *key == (cap, hp, n)) {
            *slot = Some(((cap, hp, n), Scratch::new(cap, hp, n)));
        }
        if let Some((_, scr)) = slot {
            f(scr)
        }
    })
}

type ScratchKey = (usize, usize, usize);

/// Per-task buffers of the chunked form, sized for chunks of `cap` tokens.
struct Scratch {
    /// `[cap, cap]`: the masked, decayed `C·Bᵀ` of one head.
    m: Vec<f32>,
    col: Vec<f32>,
    /// `[HEADS_PER_TASK · hp, q]`: x of a task's heads, transposed and
    /// weighted for the state update.
    xw: Vec<f32>,
    /// `[HEADS_PER_TASK · hp, n]`: the update, with bf16 dot products.
    upd: Vec<f32>,
    /// Per head of a task: its state's decay over the chunk.
    decay: [f32; HEADS_PER_TASK],
}

impl Scratch {
    fn new(cap: usize, hp: usize, n: usize) -> Self {
        Self {
            m: vec![0.0; cap * cap],
            col: vec![0.0; cap],
            xw: vec![0.0; HEADS_PER_TASK * hp * cap],
            upd: vec![0.0; HEADS_PER_TASK * hp * n],
            decay: [0.0; HEADS_PER_TASK],
        }
    }
}

/// Heads whose state products one task computes as one matrix product
/// (fewer, larger products than one per head). Fixed, not derived from the
/// thread count, so the results do not depend on it.
const HEADS_PER_TASK: usize = 4;

/// Heads per task: [`HEADS_PER_TASK`] or fewer, never straddling a group.
fn heads_per_task(p: &SsdParams) -> usize {
    let per_group = p.n_heads / p.n_groups;
    (1..=HEADS_PER_TASK)
        .rev()
        .find(|h| per_group.is_multiple_of(*h))
        .unwrap_or(1)
}

fn chunked(ctx: &Ctx<'_>, row0: usize, len: usize, state: &mut [f32], ys: &mut [f32], team: &Team) {
    let SsdParams {
        n_heads: nh,
        head_dim: hp,
        d_state: n,
        n_groups: ng,
        chunk_size,
        ..
    } = ctx.p;
    let bc = ctx.bc_stride;
    let cap = chunk_size.min(MAX_CHUNK).min(len);
    let hpt = heads_per_task(&ctx.p);
    let mut dts = Buf::zeroed(nh * len);
    team.chunks(&mut dts, len, |h, d| {
        d.iter_mut()
            .enumerate()
            .for_each(|(t, v)| *v = ctx.dt(row0 + t, h))
    });
    let (mut gram, mut y_in) = (Buf::zeroed(ng * cap * cap), Buf::zeroed(nh * hp * cap));
    // With bf16 dot products: per group, C `[q, n]` and Bᵀ `[n, q]` as bf16.
    let mut cb = vec![bf16::ZERO; if ctx.bf16_dot { 2 * ng * cap * n } else { 0 }];
    let mut cums = vec![0f64; nh * cap];
    for c0 in (0..len).step_by(cap) {
        let q = cap.min(len - c0);
        let r0 = row0 + c0;
        // cum[h, t] = Σ_{s≤t} dt_s·A_h, in f64.
        for (h, cum) in cums.chunks_mut(cap).enumerate() {
            let mut acc = 0f64;
            for (cu, &d) in cum.iter_mut().zip(&dts[h * len + c0..h * len + c0 + q]) {
                acc += (d * ctx.neg_a[h]) as f64;
                *cu = acc;
            }
        }
        let cums = &cums;
        // G = C·Bᵀ per group (heads of a group share it).
        team.chunks(&mut gram, cap * cap, |g, gm| {
            let cv = View::rows(&ctx.c[r0 * bc + g * n..], bc);
            let bt = View::t(&ctx.b[r0 * bc + g * n..], bc);
            matmul(q, q, n, gm, cap, None, cv, bt, 1.0, 1);
        });
        team.chunks(&mut cb, 2 * cap * n, |g, gb| {
            let (c16, bt16) = gb.split_at_mut(cap * n);
            for t in 0..q {
                let row = (r0 + t) * bc + g * n;
                let (c, b) = (&ctx.c[row..row + n], &ctx.b[row..row + n]);
                for i in 0..n {
                    c16[t * n + i] = to_bf16(c[i]);
                    bt16[i * q + t] = to_bf16(b[i]);
                }
            }
        });
        let cb = &cb;
        // From the state entering the chunk, for a few heads at a time:
        // y_in[h, p, t] = S_h[p]·C_t (transposed: the heads' state rows are
        // contiguous), rows `q` apart.
        team.chunks(&mut y_in[..nh * hp * q], hpt * hp * q, |task, yt| {
            let h0 = task * hpt;
            let g = ctx.group(h0);
            let s = &state[h0 * hp * n..(h0 + hpt) * hp * n];
            if let Some(c16) = cb.get(2 * g * cap * n..2 * g * cap * n + q * n)
                && gemm_bf16::gemm(ctx.tiles, team, s, c16, yt, hpt * hp, q, n)
            {
                return;
            }
            let ct = View::t(&ctx.c[r0 * bc + g * n..], bc);
            matmul(hpt * hp, q, n, yt, q, None, View::rows(s, n), ct, 1.0, 1);
        });
        let (gram, y_in, dts) = (&*gram, &*y_in, &*dts);
        // Per head: the outputs of the chunk.
        team.chunks(ys, len * hp, |h, yh| {
            let g = ctx.group(h);
            let io = HeadChunk {
                gm: &gram[g * cap * cap..(g + 1) * cap * cap],
                ld: cap,
                h,
                r0,
                dt: &dts[h * len + c0..h * len + c0 + q],
                cum: &cums[h * cap..h * cap + q],
            };
            let y_in = &y_in[h * hp * q..(h + 1) * hp * q];
            with_scratch(cap, hp, n, |scr| {
                chunk_outputs(ctx, scr, &io, y_in, &mut yh[c0 * hp..(c0 + q) * hp])
            });
        });
        // Per few heads: the state leaving the chunk.
        team.chunks(state, hpt * hp * n, |task, s| {
            let g = ctx.group(task * hpt);
            let bt16 = cb.get((2 * g + 1) * cap * n..(2 * g + 1) * cap * n + n * q);
            with_scratch(cap, hp, n, |scr| {
                advance_state(ctx, scr, task * hpt, hpt, r0, q, cums, cap, dts, len, c0);
                update_state(ctx, scr, task * hpt, hpt, r0, q, bt16, team, s);
            })
        });
    }
}

/// One head's view of one chunk.
struct HeadChunk<'a> {
    /// The group's `C·Bᵀ`, rows `ld` apart.
    gm: &'a [f32],
    ld: usize,
    h: usize,
    /// The chunk's first row.
    r0: usize,
    /// `dt` and the cumulative `dt·A` of the chunk's rows.
    dt: &'a [f32],
    cum: &'a [f64],
}

simd_fn! {
    /// Head `io.h`'s outputs for the chunk (`yh`, `[q, hp]`): the part from
    /// the entering state (`y_in`, `[hp, q]`, not yet decayed), the part
    /// from within the chunk, and the skip connection.
    fn chunk_outputs(ctx: &Ctx<'_>, scr: &mut Scratch, io: &HeadChunk<'_>, y_in: &[f32], yh: &mut [f32]) {
        let (hp, q, ld) = (ctx.p.head_dim, io.dt.len(), io.ld);
        let xv = &ctx.x[io.r0 * ctx.x_stride + io.h * hp..];
        // y_t = exp(cum_t)·C_t·S, transposed back from `y_in` (the factors
        // in one vectorised pass: cum_t ≤ 0, and f32 keeps exp's relative
        // error at f32 level).
        let e = &mut scr.col[..q];
        e.iter_mut().zip(io.cum).for_each(|(e, &ct)| *e = exp_fast(ct as f32));
        for (t, (yr, &et)) in yh.chunks_mut(hp).zip(e.iter()).enumerate() {
            for (p, y) in yr.iter_mut().enumerate() {
                *y = y_in[p * q + t] * et;
            }
        }
        // Within the chunk: M[t, s] = G[t, s]·exp(cum_t − cum_s)·dt_s for s ≤ t,
        // zero above; then y += M·x.
        let m = &mut scr.m;
        decay_lower(io.cum, m, ld, &mut scr.col);
        for t in 0..q {
            let (low, high) = m[t * ld..t * ld + q].split_at_mut(t + 1);
            low.iter_mut().zip(&io.gm[t * ld..]).zip(io.dt).for_each(|((v, gv), d)| *v *= gv * d);
            high.fill(0.0);
        }
        // M is lower triangular: the first half of the rows needs only the
        // first half of x (a quarter of the products skipped).
        let half = if q >= 16 { q / 2 } else { 0 };
        let xs = View::rows(xv, ctx.x_stride);
        if half > 0 {
            matmul(half, hp, half, &mut yh[..half * hp], hp, Some(1.0), View::rows(m, ld), xs, 1.0, 1);
        }
        matmul(q - half, hp, q, &mut yh[half * hp..], hp, Some(1.0), View::rows(&m[half * ld..], ld), xs, 1.0, 1);
        // Skip connection.
        let dh = ctx.d[io.h];
        for (t, yr) in yh.chunks_mut(hp).enumerate() {
            yr.iter_mut().zip(&xv[t * ctx.x_stride..t * ctx.x_stride + hp]).for_each(|(y, x)| *y += dh * x);
        }
    }
}

simd_fn! {
    /// For heads `h0..h0 + hpt`: their state's decay over the chunk,
    /// `exp(cum_last)`, into `scr.decay`, and their `x_s·exp(cum_last −
    /// cum_s)·dt_s`, transposed, into `scr.xw` (`[hpt·hp, q]`), for
    /// [`update_state`].
    #[allow(clippy::too_many_arguments)]
    fn advance_state(ctx: &Ctx<'_>, scr: &mut Scratch, h0: usize, hpt: usize, r0: usize, q: usize, cums: &[f64], cap: usize, dts: &[f32], len: usize, c0: usize) {
        let (hp, width) = (ctx.p.head_dim, ctx.x_stride);
        for i in 0..hpt {
            let h = h0 + i;
            let (cum, dt) = (&cums[h * cap..h * cap + q], &dts[h * len + c0..h * len + c0 + q]);
            let last = cum[q - 1];
            scr.decay[i] = last.exp() as f32;
            // The weights in one vectorised pass (last − cum_s ≤ 0 is small
            // enough for f32: a difference within one chunk).
            let w = &mut scr.col[..q];
            w.iter_mut()
                .zip(cum.iter().zip(dt))
                .for_each(|(w, (&ct, &d))| *w = exp_fast((last - ct) as f32) * d);
            let xw = &mut scr.xw[i * hp * q..(i + 1) * hp * q];
            for (t, &wt) in w.iter().enumerate() {
                let x = &ctx.x[(r0 + t) * width + h * hp..][..hp];
                for (p, &xp) in x.iter().enumerate() {
                    xw[p * q + t] = xp * wt;
                }
            }
        }
    }
}

/// `S = S·decay + xw · B` for heads `h0..h0 + hpt` (`s`; `scr` as
/// [`advance_state`] left it): with bf16 dot products when `bt16` (the
/// group's Bᵀ as bf16) is given and the CPU has them, the decay and the
/// update in one pass over the state; in f32 otherwise.
#[allow(clippy::too_many_arguments)]
fn update_state(
    ctx: &Ctx<'_>,
    scr: &mut Scratch,
    h0: usize,
    hpt: usize,
    r0: usize,
    q: usize,
    bt16: Option<&[bf16]>,
    team: &Team,
    s: &mut [f32],
) {
    let (hp, n) = (ctx.p.head_dim, ctx.p.d_state);
    let m = hpt * hp;
    let xw = &scr.xw[..m * q];
    if let Some(bt16) = bt16
        && gemm_bf16::gemm(ctx.tiles, team, xw, bt16, &mut scr.upd[..m * n], m, n, q)
    {
        for ((sh, uh), &d) in s
            .chunks_mut(hp * n)
            .zip(scr.upd[..m * n].chunks(hp * n))
            .zip(&scr.decay)
        {
            decay_add(sh, Some(uh), d);
        }
        return;
    }
    for (sh, &d) in s.chunks_mut(hp * n).take(hpt).zip(&scr.decay) {
        decay_add(sh, None, d);
    }
    let g = ctx.group(h0);
    let b = View::rows(&ctx.b[r0 * ctx.bc_stride + g * n..], ctx.bc_stride);
    matmul(m, n, q, s, n, Some(1.0), View::rows(xw, q), b, 1.0, 1);
}

simd_fn! {
    /// `s = s·d + u` (or `s = s·d` without `u`): the two roundings of a
    /// decay followed by an addition, in one pass.
    fn decay_add(s: &mut [f32], u: Option<&[f32]>, d: f32) {
        match u {
            Some(u) => s.iter_mut().zip(u).for_each(|(v, u)| *v = *v * d + u),
            None => s.iter_mut().for_each(|v| *v *= d),
        }
    }
}
