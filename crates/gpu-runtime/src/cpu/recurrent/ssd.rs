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

use super::math::{Buf, SPAN, View, decay_lower, matmul, simd_fn, softplus};
use super::{Mode, SeqIo};
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

simd_fn! {
    /// The per-token recurrence of head `h` over rows `row0..row0 + len`.
    fn recurrent_head(ctx: &Ctx<'_>, row0: usize, len: usize, h: usize, s: &mut [f32], yh: &mut [f32]) {
        let (hp, n) = (ctx.p.head_dim, ctx.p.d_state);
        let (width, bc, g) = (ctx.x_stride, ctx.bc_stride, ctx.group(h));
        for t in 0..len {
            let row = row0 + t;
            let dt = ctx.dt(row, h);
            let da = (dt * ctx.neg_a[h]).exp();
            let x = &ctx.x[row * width + h * hp..][..hp];
            let b = &ctx.b[row * bc + g * n..][..n];
            let c = &ctx.c[row * bc + g * n..][..n];
            for ((sp, &xp), y) in s.chunks_mut(n).zip(x).zip(&mut yh[t * hp..(t + 1) * hp]) {
                // s = s·exp(dt·A) + dt·x·B and y = s·C in one pass, 16 lanes wide.
                let xdt = xp * dt;
                let mut acc = [0f32; 16];
                let (sc, st) = sp.as_chunks_mut::<16>();
                let ((bc, bt), (cc, ct)) = (b.as_chunks::<16>(), c.as_chunks::<16>());
                for ((sv, bv), cv) in sc.iter_mut().zip(bc).zip(cc) {
                    for l in 0..16 {
                        let v = sv[l] * da + xdt * bv[l];
                        sv[l] = v;
                        acc[l] += v * cv[l];
                    }
                }
                let mut tail = 0f32;
                for ((sv, bv), cv) in st.iter_mut().zip(bt).zip(ct) {
                    *sv = *sv * da + xdt * bv;
                    tail += *sv * cv;
                }
                *y = acc.iter().sum::<f32>() + tail + ctx.d[h] * xp;
            }
        }
    }
}

/// Runs `f` with this thread's scratch for chunks of `cap` tokens.
fn with_scratch(cap: usize, n: usize, f: impl FnOnce(&mut Scratch)) {
    thread_local! {
        static SCRATCH: std::cell::RefCell<Option<(usize, usize, Scratch)>> =
            const { std::cell::RefCell::new(None) };
    }
    SCRATCH.with_borrow_mut(|slot| {
        if !matches!(slot, Some((c, d, _)) if (*c, *d) == (cap, n)) {
            *slot = Some((cap, n, Scratch::new(cap, n)));
        }
        if let Some((_, _, scr)) = slot {
            f(scr)
        }
    })
}

/// Per-task buffers of the chunked form, sized for chunks of `cap` tokens.
struct Scratch {
    cum: Vec<f64>,
    /// `[cap, cap]`: the masked, decayed `C·Bᵀ` of one head.
    m: Vec<f32>,
    /// `[cap, d_state]`: B rows weighted for the state update.
    bw: Vec<f32>,
    col: Vec<f32>,
}

impl Scratch {
    fn new(cap: usize, n: usize) -> Self {
        Self {
            cum: vec![0.0; cap],
            m: vec![0.0; cap * cap],
            bw: vec![0.0; cap * n],
            col: vec![0.0; cap],
        }
    }
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
    let mut dts = Buf::zeroed(nh * len);
    team.chunks(&mut dts, len, |h, d| {
        d.iter_mut()
            .enumerate()
            .for_each(|(t, v)| *v = ctx.dt(row0 + t, h))
    });
    let mut gram = Buf::zeroed(ng * cap * cap);
    for c0 in (0..len).step_by(cap) {
        let q = cap.min(len - c0);
        let r0 = row0 + c0;
        // G = C·Bᵀ per group (heads of a group share it).
        team.chunks(&mut gram, cap * cap, |g, gm| {
            let cv = View::rows(&ctx.c[r0 * bc + g * n..], bc);
            let bt = View::t(&ctx.b[r0 * bc + g * n..], bc);
            matmul(q, q, n, gm, cap, None, cv, bt, 1.0, 1);
        });
        let (gram, dts) = (&*gram, &*dts);
        let head = |scr: &mut Scratch, h: usize, s: &mut [f32], yh: &mut [f32]| {
            let g = ctx.group(h);
            let gm = &gram[g * cap * cap..(g + 1) * cap * cap];
            let dt = &dts[h * len + c0..h * len + c0 + q];
            let yh = &mut yh[c0 * hp..(c0 + q) * hp];
            head_chunk(ctx, scr, gm, cap, h, r0, dt, s, yh);
        };
        // Each thread keeps its scratch between chunks and calls.
        team.chunks2(state, hp * n, ys, len * hp, |h, s, yh| {
            with_scratch(cap, n, |scr| head(scr, h, s, yh))
        });
    }
}

simd_fn! {
    /// One chunk of head `h` (rows `r0..r0 + dt.len()`): writes `yh` (`[q, hp]`)
    /// and advances `s` (`[hp, n]`). `gm` is the group's `C·Bᵀ`, rows `ld` apart.
    #[allow(clippy::too_many_arguments)]
    fn head_chunk(ctx: &Ctx<'_>, scr: &mut Scratch, gm: &[f32], ld: usize, h: usize, r0: usize, dt: &[f32], s: &mut [f32], yh: &mut [f32]) {
        let (hp, n, q) = (ctx.p.head_dim, ctx.p.d_state, dt.len());
        let (width, bc, g) = (ctx.x_stride, ctx.bc_stride, ctx.group(h));
        let a = ctx.neg_a[h];
        let mut acc = 0f64;
        for (cu, &d) in scr.cum.iter_mut().zip(dt) {
            acc += (d * a) as f64;
            *cu = acc;
        }
        let cum = &scr.cum[..q];
        let xv = &ctx.x[r0 * width + h * hp..];
        let cv = &ctx.c[r0 * bc + g * n..];
        let bv = &ctx.b[r0 * bc + g * n..];

        // From the state entering the chunk: y_t = exp(cum_t)·C_t·S (S is [hp, n]).
        matmul(q, hp, n, yh, hp, None, View::rows(cv, bc), View::t(s, n), 1.0, 1);
        for (yr, &ct) in yh.chunks_mut(hp).zip(cum) {
            let e = ct.exp() as f32;
            yr.iter_mut().for_each(|v| *v *= e);
        }

        // Within the chunk: M[t, s] = G[t, s]·exp(cum_t − cum_s)·dt_s for s ≤ t,
        // zero above; then y += M·x.
        let m = &mut scr.m;
        decay_lower(cum, m, ld, &mut scr.col);
        for t in 0..q {
            let (low, high) = m[t * ld..t * ld + q].split_at_mut(t + 1);
            low.iter_mut().zip(&gm[t * ld..]).zip(dt).for_each(|((v, gv), d)| *v *= gv * d);
            high.fill(0.0);
        }
        matmul(q, hp, q, yh, hp, Some(1.0), View::rows(m, ld), View::rows(xv, width), 1.0, 1);

        // Skip connection.
        let dh = ctx.d[h];
        for (t, yr) in yh.chunks_mut(hp).enumerate() {
            yr.iter_mut().zip(&xv[t * width..t * width + hp]).for_each(|(y, x)| *y += dh * x);
        }

        // State: S = exp(cum_last)·S + xᵀ·(B_s·exp(cum_last − cum_s)·dt_s).
        let last = cum[q - 1];
        for (i, bw) in scr.bw.chunks_mut(n).take(q).enumerate() {
            let w = ((last - cum[i]) as f32).exp() * dt[i];
            bw.iter_mut().zip(&bv[i * bc..i * bc + n]).for_each(|(o, b)| *o = b * w);
        }
        matmul(hp, n, q, s, n, Some(last.exp() as f32), View::t(xv, width), View::rows(&scr.bw, n), 1.0, 1);
    }
}
