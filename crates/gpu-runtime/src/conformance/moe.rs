//! Cases of the mixture-of-experts ops: the routers against f64 routing,
//! the grouping as a stable counting sort, the grouped matmuls against f64
//! and (their contract) against per-expert `matmul` / `matmul_swiglu` to the
//! bit, and the shared expert's sigmoid gate.

use metrale_core::DType;

use super::MoeShapes;
use super::harness::{
    Cx, Fail, Mem, Outcome, WEIGHT_DTYPES, matmul64, row_counts, sigmoid64, silu64,
};
use crate::gpu::DeviceSlice;
use crate::ops::{ExpertGroups, ExpertTable, GroupedTopK, MatmulDims, Op, Routes};

/// Router weights: a softmax or sigmoid and a division, in f32.
const ROUTE_TOL: f64 = 1e-6;
/// As `matmul`'s.
const MATMUL_TOL: f64 = 1e-5;
/// One sigmoid and a multiply-add.
const GATE_TOL: f64 = 2e-6;

fn moe(cx: &Cx<'_>) -> Result<MoeShapes, Fail> {
    cx.shapes
        .moe
        .clone()
        .ok_or_else(|| Fail::Setup("no MoE shapes".into()))
}

/// The `k` best of `score` among `allowed` (ties to the lower index).
fn top_k(score: &[f64], allowed: impl Fn(usize) -> bool, k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..score.len()).filter(|&e| allowed(e)).collect();
    order.sort_by(|&a, &b| score[b].total_cmp(&score[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

/// Softmax routing in f64: per row, (expert, weight), best first.
fn softmax_topk64(logits: &[f32], n: usize, k: usize, renorm: bool) -> Vec<(u32, f64)> {
    let mut out = Vec::new();
    for row in logits.chunks(n) {
        let max = row
            .iter()
            .map(|&v| v as f64)
            .fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = row.iter().map(|&v| (v as f64 - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        let p: Vec<f64> = e.iter().map(|v| v / sum).collect();
        let top = top_k(&p, |_| true, k);
        let denom = if renorm {
            top.iter().map(|&i| p[i]).sum()
        } else {
            1.0
        };
        out.extend(top.iter().map(|&i| (i as u32, p[i] / denom)));
    }
    out
}

/// Grouped sigmoid routing in f64 (DeepSeek-V3's), as `sigmoid_topk` specifies.
fn sigmoid_topk64(
    logits: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    p: &GroupedTopK,
) -> Vec<(u32, f64)> {
    let per_group = n / p.n_group;
    let mut out = Vec::new();
    for row in logits.chunks(n) {
        let s: Vec<f64> = row.iter().map(|&v| sigmoid64(v as f64)).collect();
        let choice: Vec<f64> = (0..n)
            .map(|i| s[i] + bias.map_or(0.0, |b| b[i] as f64))
            .collect();
        let group_score: Vec<f64> = choice
            .chunks(per_group)
            .map(|g| top_k(g, |_| true, 2).iter().map(|&i| g[i]).sum())
            .collect();
        let groups = top_k(&group_score, |_| true, p.topk_group);
        let top = top_k(&choice, |e| groups.contains(&(e / per_group)), p.k);
        let denom = if p.renormalize {
            top.iter().map(|&i| s[i]).sum::<f64>() + p.renorm_eps as f64
        } else {
            1.0
        };
        out.extend(
            top.iter()
                .map(|&i| (i as u32, s[i] / denom * p.scale as f64)),
        );
    }
    out
}

fn routes(m: &mut Mem<'_>, rows: usize, k: usize) -> Result<Routes, Fail> {
    Ok(Routes {
        experts: m.u32s(&vec![u32::MAX; rows * k])?,
        weights: m.fill(rows * k, f32::NAN)?,
        rows,
        k,
    })
}

fn check_routes(
    cx: &mut Cx<'_>,
    m: &Mem<'_>,
    r: &Routes,
    want: &[(u32, f64)],
    what: &str,
) -> Outcome {
    let want_e: Vec<u32> = want.iter().map(|w| w.0).collect();
    let want_w: Vec<f64> = want.iter().map(|w| w.1).collect();
    cx.equal(
        &m.down_u32(r.experts)?,
        &want_e,
        &format!("{what}: experts"),
    )?;
    cx.close(
        &m.down(r.weights)?,
        &want_w,
        ROUTE_TOL,
        &format!("{what}: weights"),
    )
}

/// Random router logits `[rows, n]`, the first row with a tie for first place.
fn logits(cx: &mut Cx<'_>, rows: usize, n: usize) -> Vec<f32> {
    let mut l = cx.rng.vec(rows * n, -3.0, 3.0);
    if n > 1 {
        l[1] = 3.5;
        l[0] = 3.5;
    }
    l
}

pub(super) fn softmax_topk(cx: &mut Cx<'_>) -> Outcome {
    let s = moe(cx)?;
    let n = s.n_experts;
    for rows in row_counts(cx.shapes) {
        for (k, renorm) in [(s.top_k, true), (s.top_k, false), (1, true)] {
            let mut m = cx.mem();
            let lv = logits(cx, rows, n);
            let (l, r) = (m.f32s(&lv)?, routes(&mut m, rows, k)?);
            cx.tested(cx.gpu.softmax_topk(l, n, renorm, &r))?;
            let what = format!("{rows} rows, top-{k} of {n}, renormalised {renorm}");
            check_routes(cx, &m, &r, &softmax_topk64(&lv, n, k, renorm), &what)?;
        }
    }
    Ok(())
}

pub(super) fn sigmoid_topk(cx: &mut Cx<'_>) -> Outcome {
    let s = moe(cx)?;
    let (n, k) = (s.n_experts, s.top_k);
    // (n_group, topk_group): none, the model's, and halves where they fit.
    let mut groupings = vec![(1, 1)];
    groupings.extend(s.groups);
    if n % 2 == 0 && k <= n / 2 {
        groupings.push((2, 1));
    }
    for (gi, &(n_group, topk_group)) in groupings.iter().enumerate() {
        for (bi, bias_dtype) in [None]
            .into_iter()
            .chain(WEIGHT_DTYPES.map(Some))
            .enumerate()
        {
            let p = GroupedTopK {
                k,
                n_group,
                topk_group,
                renormalize: (gi + bi) % 2 == 0,
                scale: if bi % 2 == 0 { 2.5 } else { 1.0 },
                // LFM2-MoE's epsilon where there are no groups, DeepSeek's else.
                renorm_eps: if n_group == 1 { 1e-6 } else { 1e-20 },
            };
            for rows in row_counts(cx.shapes) {
                let mut m = cx.mem();
                let lv = logits(cx, rows, n);
                let bias = match bias_dtype {
                    Some(dtype) => Some(m.weights(&cx.rng.vec(n, -0.5, 0.5), dtype)?),
                    None => None,
                };
                let (l, r) = (m.f32s(&lv)?, routes(&mut m, rows, k)?);
                let res = cx
                    .gpu
                    .sigmoid_topk(l, bias.as_ref().map(|b| b.0), n, &p, &r);
                cx.tested(res)?;
                let want = sigmoid_topk64(&lv, bias.as_ref().map(|b| &b.1[..]), n, &p);
                let what = format!("{rows} rows of {n}, {p:?}, bias {bias_dtype:?}");
                check_routes(cx, &m, &r, &want, &what)?;
            }
        }
    }
    Ok(())
}

/// Routes of `tokens` tokens, `k` distinct experts each: expert 0 first for
/// every token (more than 32 rows in the long step), the last expert never
/// (an empty group) where there are more experts than `k`.
fn host_routes(cx: &mut Cx<'_>, s: &MoeShapes, tokens: usize, k: usize) -> (Vec<u32>, Vec<f32>) {
    let pool = if s.n_experts > k {
        s.n_experts - 1
    } else {
        s.n_experts
    };
    let mut experts = Vec::with_capacity(tokens * k);
    for _ in 0..tokens {
        let mut chosen = vec![0u32];
        while chosen.len() < k {
            let e = cx.rng.below(pool) as u32;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        experts.extend(chosen);
    }
    let weights = cx.rng.vec(tokens * k, 0.0, 1.0);
    (experts, weights)
}

/// The grouping on the host: a stable counting sort by expert.
fn group64(experts: &[u32], weights: &[f32], k: usize, n: usize) -> (Vec<u32>, Vec<u32>, Vec<f32>) {
    let mut offsets = vec![0u32; n + 1];
    let (mut rows, mut ws) = (Vec::new(), Vec::new());
    for (e, offset) in offsets.iter_mut().enumerate().take(n) {
        *offset = rows.len() as u32;
        for (i, _) in experts
            .iter()
            .enumerate()
            .filter(|(_, x)| **x as usize == e)
        {
            rows.push((i / k) as u32);
            ws.push(weights[i]);
        }
    }
    offsets[n] = rows.len() as u32;
    (offsets, rows, ws)
}

pub(super) fn moe_group(cx: &mut Cx<'_>) -> Outcome {
    let s = moe(cx)?;
    for tokens in row_counts(cx.shapes) {
        let mut m = cx.mem();
        let k = s.top_k;
        let (ev, wv) = host_routes(cx, &s, tokens, k);
        let r = Routes {
            experts: m.u32s(&ev)?,
            weights: m.f32s(&wv)?,
            rows: tokens,
            k,
        };
        let g = ExpertGroups {
            offsets: m.u32s(&vec![u32::MAX; s.n_experts + 1])?,
            rows: m.u32s(&vec![u32::MAX; tokens * k])?,
            weights: m.fill(tokens * k, f32::NAN)?,
            n_experts: s.n_experts,
        };
        cx.tested(cx.gpu.moe_group(&r, &g))?;
        let (offsets, rows, weights) = group64(&ev, &wv, k, s.n_experts);
        let what = format!("{tokens} tokens, top-{k} of {}", s.n_experts);
        cx.equal(
            &m.down_u32(g.offsets)?,
            &offsets,
            &format!("{what}: offsets"),
        )?;
        cx.equal(&m.down_u32(g.rows)?, &rows, &format!("{what}: rows"))?;
        cx.equal(&m.down(g.weights)?, &weights, &format!("{what}: weights"))?;
    }
    Ok(())
}

/// Staged groups of host routes, and their offsets.
struct Grouped {
    groups: ExpertGroups,
    offsets: Vec<u32>,
}

fn staged_groups(
    cx: &mut Cx<'_>,
    m: &mut Mem<'_>,
    s: &MoeShapes,
    tokens: usize,
) -> Result<Grouped, Fail> {
    let (ev, wv) = host_routes(cx, s, tokens, s.top_k);
    let (offsets, rows, weights) = group64(&ev, &wv, s.top_k, s.n_experts);
    let groups = ExpertGroups {
        offsets: m.u32s(&offsets)?,
        rows: m.u32s(&rows)?,
        weights: m.f32s(&weights)?,
        n_experts: s.n_experts,
    };
    Ok(Grouped { groups, offsets })
}

/// Every expert's weight and its values.
type Experts = Vec<(DeviceSlice, Vec<f32>)>;

/// Every expert's `[n, k]` weight of `dtype`, its values, and the table of
/// their addresses.
fn expert_table(
    cx: &mut Cx<'_>,
    m: &mut Mem<'_>,
    n_experts: usize,
    n: usize,
    k: usize,
    dtype: DType,
) -> Result<(ExpertTable, Experts), Fail> {
    let ws = (0..n_experts)
        .map(|_| m.weights(&cx.rng.vec(n * k, -0.3, 0.3), dtype))
        .collect::<crate::error::Result<Vec<_>>>()?;
    let ptrs: Vec<u64> = ws.iter().map(|w| w.0.ptr().raw()).collect();
    let table = ExpertTable {
        ptrs: m.u64s(&ptrs)?,
        dtype,
        n,
        k,
    };
    Ok((table, ws))
}

/// The experts' up (and gate) and down projections: `[inter, hidden]` and
/// `[hidden, inter]`, at every step's routed rows.
pub(super) fn grouped_matmul(cx: &mut Cx<'_>) -> Outcome {
    let s = moe(cx)?;
    let h = cx.shapes.hidden;
    for (n, k) in [(s.intermediate, h), (h, s.intermediate)] {
        for dtype in WEIGHT_DTYPES {
            for tokens in row_counts(cx.shapes) {
                let mut m = cx.mem();
                let g = staged_groups(cx, &mut m, &s, tokens)?;
                let (table, ws) = expert_table(cx, &mut m, s.n_experts, n, k, dtype)?;
                let entries = tokens * s.top_k;
                let xv = cx.rng.vec(entries * k, -1.0, 1.0);
                let (x, out) = (m.f32s(&xv)?, m.fill(entries * n, f32::NAN)?);
                cx.tested(cx.gpu.grouped_matmul(x, &table, &g.groups, out))?;
                let got = m.down(out)?;
                let what = format!(
                    "{entries} rows x {} experts [{n}, {k}] {dtype}",
                    s.n_experts
                );
                for (e, we) in ws.iter().enumerate() {
                    let (a, b) = (g.offsets[e] as usize, g.offsets[e + 1] as usize);
                    let xe = cx.matmul_input(&xv[a * k..b * k], dtype);
                    let want = matmul64(&xe, &we.1, b - a, n, k);
                    let what = format!("{what}, expert {e}");
                    cx.close(&got[a * n..b * n], &want, MATMUL_TOL, &what)?;
                    if a < b && cx.has(Op::Matmul) {
                        let single = m.fill((b - a) * n, f32::NAN)?;
                        let d = MatmulDims { m: b - a, n, k };
                        let xe = x.rows(a, b - a, k)?;
                        cx.helper(Op::Matmul, cx.gpu.matmul(xe, we.0, None, single, d))?;
                        let single = m.down(single)?;
                        cx.like_matmul(&got[a * n..b * n], &single, &format!("{what} vs matmul"))?;
                    }
                }
            }
        }
    }
    Ok(())
}

pub(super) fn grouped_matmul_swiglu(cx: &mut Cx<'_>) -> Outcome {
    let s = moe(cx)?;
    let (n, k) = (s.intermediate, cx.shapes.hidden);
    for dtype in WEIGHT_DTYPES {
        for tokens in row_counts(cx.shapes) {
            let mut m = cx.mem();
            let g = staged_groups(cx, &mut m, &s, tokens)?;
            let (gate, gws) = expert_table(cx, &mut m, s.n_experts, n, k, dtype)?;
            let (up, uws) = expert_table(cx, &mut m, s.n_experts, n, k, dtype)?;
            let entries = tokens * s.top_k;
            let xv = cx.rng.vec(entries * k, -1.0, 1.0);
            let x = m.f32s(&xv)?;
            let (out, scratch) = (
                m.fill(entries * n, f32::NAN)?,
                m.fill(entries * n, f32::NAN)?,
            );
            let r = cx
                .gpu
                .grouped_matmul_swiglu(x, &gate, &up, &g.groups, out, scratch);
            cx.tested(r)?;
            let got = m.down(out)?;
            let what = format!(
                "{entries} rows x {} experts [{n}, {k}] {dtype}",
                s.n_experts
            );
            for (e, (ge, ue)) in gws.iter().zip(&uws).enumerate() {
                let (a, b) = (g.offsets[e] as usize, g.offsets[e + 1] as usize);
                let xe = cx.matmul_input(&xv[a * k..b * k], dtype);
                let (wg, wu) = (
                    matmul64(&xe, &ge.1, b - a, n, k),
                    matmul64(&xe, &ue.1, b - a, n, k),
                );
                let want: Vec<f64> = wg.iter().zip(&wu).map(|(&g, &u)| silu64(g) * u).collect();
                let what = format!("{what}, expert {e}");
                cx.close(&got[a * n..b * n], &want, MATMUL_TOL, &what)?;
                if a < b && cx.has(Op::MatmulSwiglu) {
                    let (single, s2) = (m.fill((b - a) * n, f32::NAN)?, m.fill((b - a) * n, 0.0)?);
                    let d = MatmulDims { m: b - a, n, k };
                    let xe = x.rows(a, b - a, k)?;
                    let r = cx.gpu.matmul_swiglu(xe, ge.0, ue.0, single, s2, d);
                    cx.helper(Op::MatmulSwiglu, r)?;
                    let what = format!("{what} vs matmul_swiglu");
                    cx.like_matmul(&got[a * n..b * n], &m.down(single)?, &what)?;
                }
            }
        }
    }
    Ok(())
}

impl Cx<'_> {
    /// A grouped matmul's rows against `matmul`'s for the same rows: equal,
    /// or as close as two f32-accumulating GEMMs where the backend's grouped
    /// GEMM is another kernel ([`GpuBackend::grouped_matmul_is_matmul`]).
    ///
    /// [`GpuBackend::grouped_matmul_is_matmul`]: crate::gpu::GpuBackend::grouped_matmul_is_matmul
    fn like_matmul(&mut self, got: &[f32], single: &[f32], what: &str) -> Outcome {
        if self.gpu.grouped_matmul_is_matmul() {
            return self.equal(got, single, what);
        }
        let want: Vec<f64> = single.iter().map(|&v| v as f64).collect();
        self.close(got, &want, 2.0 * MATMUL_TOL, what)
    }
}

pub(super) fn sigmoid_gate_add(cx: &mut Cx<'_>) -> Outcome {
    let width = cx.shapes.hidden;
    for rows in row_counts(cx.shapes) {
        let mut m = cx.mem();
        let (av, xv, gv) = (
            cx.rng.vec(rows * width, -1.0, 1.0),
            cx.rng.vec(rows * width, -2.0, 2.0),
            cx.rng.vec(rows, -8.0, 8.0),
        );
        let (acc, x, gate) = (m.f32s(&av)?, m.f32s(&xv)?, m.f32s(&gv)?);
        cx.tested(cx.gpu.sigmoid_gate_add(acc, x, gate, rows, width))?;
        let want: Vec<f64> = (0..rows * width)
            .map(|i| av[i] as f64 + sigmoid64(gv[i / width] as f64) * xv[i] as f64)
            .collect();
        cx.close(
            &m.down(acc)?,
            &want,
            GATE_TOL,
            &format!("{rows} rows of {width}"),
        )?;
    }
    Ok(())
}
