//! Feed-forward blocks: dense MLPs (SwiGLU split or fused, relu²) and sparse
//! mixtures of experts with an optional (gated) shared expert.

use metrale_gpu_runtime::DeviceSlice;
use metrale_gpu_runtime::ops::dense::{GroupedTopK, MatmulDims};

use super::{Cx, dev};
use crate::config::Routing;
use crate::error::Result;
use crate::model::weights::{Linear, MlpWeights, MoeWeights};

/// `out[rows, hidden] = mlp(x[rows, hidden])`, using ffn_a / ffn_b as scratch.
pub(super) fn mlp(
    cx: &Cx<'_>,
    w: &MlpWeights,
    x: DeviceSlice,
    out: DeviceSlice,
    rows: usize,
) -> Result<()> {
    let gpu = cx.gpu;
    let inter = w.intermediate();
    let n = rows * inter;
    let half = |s: DeviceSlice, i: usize| s.slice(i * n, n).map_err(dev("mlp scratch"));
    match w {
        MlpWeights::Split { gate, up, down } => {
            swiglu(cx, x, gate, up, half(cx.s.ffn_a, 1)?, rows)?;
            cx.linear(half(cx.s.ffn_a, 1)?, down, out, rows)
        }
        MlpWeights::Fused { gate_up, down } => {
            // The gate and up halves of the fused weight, each used in place.
            let (gate, up) = (gate_up.rows(0, inter)?, gate_up.rows(inter, inter)?);
            swiglu(cx, x, &gate, &up, half(cx.s.ffn_a, 0)?, rows)?;
            cx.linear(half(cx.s.ffn_a, 0)?, down, out, rows)
        }
        MlpWeights::Plain { up, down } => {
            cx.linear(x, up, half(cx.s.ffn_a, 0)?, rows)?;
            gpu.relu2(half(cx.s.ffn_a, 0)?, half(cx.s.ffn_b, 0)?, n)
                .map_err(dev("relu2"))?;
            cx.linear(half(cx.s.ffn_b, 0)?, down, out, rows)
        }
    }
}

/// `out = silu(x·gateᵀ + b_g) * (x·upᵀ + b_u)`: one op without biases (a
/// backend that fuses it never writes the two products out; one that does
/// not puts the up product in ffn_b), else both projections into ffn_b and
/// `silu_mul`.
fn swiglu(
    cx: &Cx<'_>,
    x: DeviceSlice,
    gate: &Linear,
    up: &Linear,
    out: DeviceSlice,
    rows: usize,
) -> Result<()> {
    let dims = MatmulDims {
        m: rows,
        n: gate.n,
        k: gate.k,
    };
    let n = rows * gate.n;
    if gate.b.is_none() && up.b.is_none() {
        let scratch = cx.s.ffn_b.slice(0, n).map_err(dev("mlp scratch"))?;
        return cx
            .gpu
            .matmul_swiglu(x, gate.w, up.w, out, scratch, dims)
            .map_err(dev("swiglu"));
    }
    let g = cx.s.ffn_b.slice(0, n).map_err(dev("mlp scratch"))?;
    let u = cx.s.ffn_b.slice(n, n).map_err(dev("mlp scratch"))?;
    cx.linear(x, gate, g, rows)?;
    cx.linear(x, up, u, rows)?;
    cx.gpu.silu_mul(g, u, out, n).map_err(dev("silu"))
}

/// Routed experts plus the shared expert, into `mixed`.
pub(super) fn moe(cx: &Cx<'_>, w: &MoeWeights) -> Result<()> {
    let (gpu, s) = (cx.gpu, cx.s);
    let moe =
        cx.model.config.moe.as_ref().ok_or_else(|| {
            crate::error::EngineError::Request("MoE layer without MoE config".into())
        })?;
    let (t, h) = (cx.batch.tokens, cx.model.config.hidden_size);
    let logits = s.r[0]
        .slice(0, t * moe.n_experts)
        .map_err(dev("router scratch"))?;
    cx.linear(s.normed, &w.router, logits, t)?;
    let routes = match moe.routing {
        Routing::Softmax => {
            gpu.softmax_topk(logits, t, moe.n_experts, moe.top_k, moe.norm_topk_prob)
        }
        Routing::SigmoidGrouped {
            n_group,
            topk_group,
            scale,
        } => {
            let p = GroupedTopK {
                k: moe.top_k,
                n_group,
                topk_group,
                renormalize: moe.norm_topk_prob,
                scale,
            };
            gpu.sigmoid_topk(logits, w.router_bias, t, moe.n_experts, &p)
        }
    }
    .map_err(dev("router"))?;
    // Rows and weights per expert.
    let mut per_expert: Vec<(Vec<u32>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); moe.n_experts];
    for (i, &(e, weight)) in routes.iter().enumerate() {
        let (rows, weights) = &mut per_expert[e as usize];
        rows.push((i / moe.top_k) as u32);
        weights.push(weight);
    }
    gpu.zero(s.mixed).map_err(dev("moe output"))?;
    for (expert, (rows, weights)) in w.experts.iter().zip(&per_expert) {
        if rows.is_empty() {
            continue;
        }
        let n = rows.len();
        let (xin, yout) = (
            s.expert_in.slice(0, n * h).map_err(dev("expert scratch"))?,
            s.ffn_out.slice(0, n * h).map_err(dev("expert scratch"))?,
        );
        gpu.gather_rows(s.normed, rows, h, xin)
            .map_err(dev("expert gather"))?;
        mlp(cx, expert, xin, yout, n)?;
        gpu.scatter_add_rows(yout, rows, weights, h, s.mixed)
            .map_err(dev("expert scatter"))?;
    }
    if let Some(shared) = &w.shared {
        mlp(cx, shared, s.normed, s.ffn_out, t)?;
        match &w.shared_gate {
            Some(gate) => {
                let g = s.r[1].slice(0, t).map_err(dev("shared gate scratch"))?;
                cx.linear(s.normed, gate, g, t)?;
                let weights: Vec<f32> = gpu
                    .download_f32(g)
                    .map_err(dev("shared gate"))?
                    .iter()
                    .map(|x| 1.0 / (1.0 + (-x).exp()))
                    .collect();
                let rows: Vec<u32> = (0..t as u32).collect();
                gpu.scatter_add_rows(s.ffn_out, &rows, &weights, h, s.mixed)
                    .map_err(dev("shared expert"))?;
            }
            None => gpu
                .add_scaled(s.mixed, s.ffn_out, 1.0, t * h)
                .map_err(dev("shared expert"))?,
        }
    }
    Ok(())
}
