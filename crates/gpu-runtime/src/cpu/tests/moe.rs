//! Tests of the mixture-of-experts ops: the routers against f64
//! references, the grouping, the grouped matmuls against per-expert
//! `matmul` / `matmul_swiglu` calls (to the bit), the shared expert's gate,
//! and bad expert tables.

use metrale_core::DType;

use super::super::recurrent::tests::{Env, Rng, assert_close};
use crate::error::GpuError;
use crate::gpu::DeviceSlice;
use crate::ops::dense::{DenseOps, MatmulDims};
use crate::ops::moe::{ExpertGroups, ExpertTable, GroupedTopK, MoeOps, Routes};

fn sigmoid64(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// The `k` best of `score` among `allowed` (ties to the lower index).
fn top_k(score: &[f64], allowed: impl Fn(usize) -> bool, k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..score.len()).filter(|&e| allowed(e)).collect();
    order.sort_by(|&a, &b| score[b].total_cmp(&score[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

/// Softmax routing in f64: per row, (expert, weight) best first.
fn softmax_topk_ref(logits: &[f32], n: usize, k: usize, renorm: bool) -> Vec<(u32, f64)> {
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
fn sigmoid_topk_ref(
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
            top.iter().map(|&i| s[i]).sum()
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

/// Device routes of `rows * k` entries.
fn routes_of(env: &mut Env, rows: usize, k: usize) -> Routes {
    Routes {
        experts: env.u32s(&vec![0; rows * k]),
        weights: env.up(&vec![0.0; rows * k]),
        rows,
        k,
    }
}

fn read_routes(env: &Env, r: &Routes) -> (Vec<u32>, Vec<f32>) {
    (env.down_u32(r.experts), env.down(r.weights))
}

fn check_routes(env: &Env, r: &Routes, want: &[(u32, f64)], what: &str) {
    let (experts, weights) = read_routes(env, r);
    let want_e: Vec<u32> = want.iter().map(|w| w.0).collect();
    let want_w: Vec<f64> = want.iter().map(|w| w.1).collect();
    assert_eq!(experts, want_e, "{what}: experts");
    assert_close(&weights, &want_w, 1e-6, what);
}

#[test]
fn softmax_topk_writes_the_routes() {
    let (rows, n) = (7, 8);
    let mut rng = Rng::new(21);
    for (k, renorm) in [(2, true), (2, false), (1, true), (8, false)] {
        let mut env = Env::new();
        let mut logits = rng.vec(rows * n, -3.0, 3.0);
        // A tie: the lower index goes first.
        logits[3] = logits[5];
        let l = env.up(&logits);
        let routes = routes_of(&mut env, rows, k);
        env.cpu
            .softmax_topk(l, n, renorm, &routes)
            .expect("softmax_topk");
        let want = softmax_topk_ref(&logits, n, k, renorm);
        check_routes(&env, &routes, &want, &format!("top-{k} renorm {renorm}"));
        env.finish();
    }
}

#[test]
fn sigmoid_topk_writes_the_routes() {
    let (rows, n) = (6, 8);
    let mut rng = Rng::new(22);
    for (k, n_group, topk_group, renormalize, bias_dtype) in [
        (2, 1, 1, true, None),
        (2, 4, 2, true, Some(DType::F32)),
        (3, 2, 1, false, Some(DType::BF16)),
        (4, 4, 4, true, Some(DType::F32)),
    ] {
        let mut env = Env::new();
        let logits = rng.vec(rows * n, -3.0, 3.0);
        let b = rng.vec(n, -0.5, 0.5);
        let (bias, b) = match bias_dtype {
            None => (None, None),
            Some(DType::BF16) => {
                let (s, v) = env.up_bf16(&b);
                (Some(s), Some(v))
            }
            Some(_) => (Some(env.up(&b)), Some(b)),
        };
        let p = GroupedTopK {
            k,
            n_group,
            topk_group,
            renormalize,
            scale: 2.5,
        };
        let l = env.up(&logits);
        let routes = routes_of(&mut env, rows, k);
        env.cpu
            .sigmoid_topk(l, bias, n, &p, &routes)
            .expect("sigmoid_topk");
        let want = sigmoid_topk_ref(&logits, b.as_deref(), n, &p);
        check_routes(&env, &routes, &want, &format!("{p:?}"));
        env.finish();
    }
}

/// Groups of `n_experts` for `routes`, zeroed.
fn groups_of(env: &mut Env, routes: &Routes, n_experts: usize) -> ExpertGroups {
    let entries = routes.rows * routes.k;
    ExpertGroups {
        offsets: env.u32s(&vec![0; n_experts + 1]),
        rows: env.u32s(&vec![0; entries]),
        weights: env.up(&vec![0.0; entries]),
        n_experts,
    }
}

#[test]
fn moe_group_is_a_stable_counting_sort() {
    let mut env = Env::new();
    // 4 tokens, top-2 of 5 experts; experts 2 and 4 get nothing.
    let experts = [3u32, 0, 0, 3, 1, 3, 3, 0];
    let weights = [0.1f32, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8];
    let routes = Routes {
        experts: env.u32s(&experts),
        weights: env.up(&weights),
        rows: 4,
        k: 2,
    };
    let g = groups_of(&mut env, &routes, 5);
    env.cpu.moe_group(&routes, &g).expect("moe_group");
    assert_eq!(env.down_u32(g.offsets), vec![0, 3, 4, 4, 8, 8]);
    // Within an expert, token order.
    assert_eq!(env.down_u32(g.rows), vec![0, 1, 3, 2, 0, 1, 2, 3]);
    assert_eq!(
        env.down(g.weights),
        vec![0.2, 0.3, 0.8, 0.5, 0.1, 0.4, 0.6, 0.7]
    );
    // An expert outside the table is an error.
    let bad = Routes {
        experts: env.u32s(&[5, 0]),
        weights: env.up(&[1.0, 1.0]),
        rows: 1,
        k: 2,
    };
    let g = groups_of(&mut env, &bad, 5);
    assert!(matches!(
        env.cpu.moe_group(&bad, &g),
        Err(GpuError::Shape { .. })
    ));
    env.finish();
}

/// `n_experts` weights `[n, k]` of `dtype` and their address table.
fn expert_table(
    env: &mut Env,
    rng: &mut Rng,
    n_experts: usize,
    n: usize,
    k: usize,
    dtype: DType,
) -> (ExpertTable, Vec<DeviceSlice>) {
    let ws: Vec<DeviceSlice> = (0..n_experts)
        .map(|_| {
            let v = rng.vec(n * k, -0.3, 0.3);
            if dtype == DType::BF16 {
                env.up_bf16(&v).0
            } else {
                env.up(&v)
            }
        })
        .collect();
    let ptrs: Vec<u64> = ws.iter().map(|w| w.ptr().raw()).collect();
    let table = ExpertTable {
        ptrs: env.up_u64(&ptrs),
        dtype,
        n,
        k,
    };
    (table, ws)
}

/// Routes of 40 tokens, top-2 of 4 experts, expert 3 unused and expert 0 in
/// more than 32 rows (the CPU's GEMM rather than its GEMV).
fn skewed_groups(env: &mut Env, rows: usize) -> (ExpertGroups, Vec<u32>) {
    let experts: Vec<u32> = (0..rows).flat_map(|t| [0, 1 + (t % 2) as u32]).collect();
    let routes = Routes {
        experts: env.u32s(&experts),
        weights: env.up(&vec![1.0; rows * 2]),
        rows,
        k: 2,
    };
    let g = groups_of(env, &routes, 4);
    env.cpu.moe_group(&routes, &g).expect("moe_group");
    let offsets = env.down_u32(g.offsets);
    assert_eq!(offsets[3], offsets[4], "expert 3 is empty");
    (g, offsets)
}

#[test]
fn grouped_matmul_equals_per_expert_matmuls() {
    let (rows, n, k) = (40, 24, 48);
    for dtype in [DType::F32, DType::BF16] {
        let mut env = Env::with_threads(2);
        let mut rng = Rng::new(23);
        let (g, offsets) = skewed_groups(&mut env, rows);
        let (table, ws) = expert_table(&mut env, &mut rng, 4, n, k, dtype);
        let entries = rows * 2;
        let x = env.up(&rng.vec(entries * k, -1.0, 1.0));
        let out = env.up(&vec![f32::NAN; entries * n]);
        env.cpu
            .grouped_matmul(x, &table, &g, out)
            .expect("grouped_matmul");
        let got = env.down(out);
        for e in 0..4 {
            let (a, b) = (offsets[e] as usize, offsets[e + 1] as usize);
            if a == b {
                continue;
            }
            let want = env.up(&vec![0.0; (b - a) * n]);
            let d = MatmulDims { m: b - a, n, k };
            env.cpu
                .matmul(x.rows(a, b - a, k).unwrap(), ws[e], None, want, d)
                .expect("matmul");
            assert_eq!(got[a * n..b * n], env.down(want)[..], "{dtype} expert {e}");
        }
        env.finish();
    }
}

#[test]
fn grouped_matmul_swiglu_equals_per_expert_matmul_swiglu() {
    let (rows, n, k) = (40, 24, 48);
    for dtype in [DType::F32, DType::BF16] {
        let mut env = Env::with_threads(2);
        let mut rng = Rng::new(24);
        let (g, offsets) = skewed_groups(&mut env, rows);
        let (gate, gws) = expert_table(&mut env, &mut rng, 4, n, k, dtype);
        let (up, uws) = expert_table(&mut env, &mut rng, 4, n, k, dtype);
        let entries = rows * 2;
        let x = env.up(&rng.vec(entries * k, -1.0, 1.0));
        let out = env.up(&vec![f32::NAN; entries * n]);
        let scratch = env.up(&vec![0.0; entries * n]);
        env.cpu
            .grouped_matmul_swiglu(x, &gate, &up, &g, out, scratch)
            .expect("grouped_matmul_swiglu");
        let got = env.down(out);
        for e in 0..3 {
            let (a, b) = (offsets[e] as usize, offsets[e + 1] as usize);
            let (want, s) = (
                env.up(&vec![0.0; (b - a) * n]),
                env.up(&vec![0.0; (b - a) * n]),
            );
            let d = MatmulDims { m: b - a, n, k };
            let xe = x.rows(a, b - a, k).unwrap();
            env.cpu
                .matmul_swiglu(xe, gws[e], uws[e], want, s, d)
                .expect("matmul_swiglu");
            assert_eq!(got[a * n..b * n], env.down(want)[..], "{dtype} expert {e}");
        }
        env.finish();
    }
}

#[test]
fn sigmoid_gate_add_matches_reference() {
    let (rows, width) = (5, 12);
    let mut env = Env::new();
    let mut rng = Rng::new(25);
    let (acc0, x, gate) = (
        rng.vec(rows * width, -1.0, 1.0),
        rng.vec(rows * width, -2.0, 2.0),
        rng.vec(rows, -4.0, 4.0),
    );
    let (acc, xs, gs) = (env.up(&acc0), env.up(&x), env.up(&gate));
    env.cpu
        .sigmoid_gate_add(acc, xs, gs, rows, width)
        .expect("sigmoid_gate_add");
    let want: Vec<f64> = (0..rows * width)
        .map(|i| acc0[i] as f64 + sigmoid64(gate[i / width] as f64) * x[i] as f64)
        .collect();
    assert_close(&env.down(acc), &want, 1e-6, "sigmoid_gate_add");
    env.finish();
}

/// A table entry that is not the address of a live allocation (null, or
/// inside none) is a shape error, not a read of someone else's memory.
#[test]
fn a_bad_expert_address_is_an_error() {
    let mut env = Env::new();
    let mut rng = Rng::new(26);
    let (n, k) = (8, 16);
    let (g, _) = skewed_groups(&mut env, 4);
    let (good, ws) = expert_table(&mut env, &mut rng, 4, n, k, DType::F32);
    let x = env.up(&vec![1.0; 8 * k]);
    let (out, scratch) = (env.up(&vec![0.0; 8 * n]), env.up(&vec![0.0; 8 * n]));
    let live = ws[0].ptr().raw();
    for bad in [0x40u64, 0, live + 4] {
        let ptrs = [live, bad, live, live];
        let table = ExpertTable {
            ptrs: env.up_u64(&ptrs),
            ..good
        };
        let r = env.cpu.grouped_matmul(x, &table, &g, out);
        assert!(matches!(r, Err(GpuError::Shape { .. })), "{bad:#x}: {r:?}");
        let r = env
            .cpu
            .grouped_matmul_swiglu(x, &table, &good, &g, out, scratch);
        assert!(matches!(r, Err(GpuError::Shape { .. })), "{bad:#x}: {r:?}");
    }
    env.finish();
}
