//! Feed-forward blocks: dense MLPs (SwiGLU split or fused, relu²) and sparse
//! mixtures of experts with an optional (gated) shared expert.

use metrale_gpu_runtime::DeviceSlice;
use metrale_gpu_runtime::ops::{ExpertGroups, GroupedTopK, MatmulDims, Routes};

use super::{Cx, dev};
use crate::config::Routing;
use crate::error::Result;
use crate::model::experts::ExpertTables;
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

/// Routed experts plus the shared expert, into `mixed`. The router writes
/// the routes on the device, the routed rows are grouped by expert there,
/// and the experts run as grouped matmuls over all routed rows at once: no
/// host work depends on the routing.
pub(super) fn moe(cx: &Cx<'_>, w: &MoeWeights) -> Result<()> {
    let (gpu, s) = (cx.gpu, cx.s);
    let moe = cx.model.config.moe.as_ref().ok_or_else(|| {
        crate::error::EngineError::Internal("MoE layer without MoE config".into())
    })?;
    let (t, h, k) = (cx.batch.tokens, cx.model.config.hidden_size, moe.top_k);
    let entries = t * k;
    let cut = |s: DeviceSlice, n: usize| s.slice(0, n).map_err(dev("moe scratch"));
    let logits = cut(s.r[0], t * moe.n_experts)?;
    cx.linear(s.normed, &w.router, logits, t)?;
    let routes = Routes {
        experts: cut(s.route_experts, entries)?,
        weights: cut(s.route_weights, entries)?,
        rows: t,
        k,
    };
    match moe.routing {
        Routing::Softmax => gpu.softmax_topk(logits, moe.n_experts, moe.norm_topk_prob, &routes),
        Routing::SigmoidGrouped {
            n_group,
            topk_group,
            scale,
            renorm_eps,
        } => {
            let p = GroupedTopK {
                k,
                n_group,
                topk_group,
                renormalize: moe.norm_topk_prob,
                scale,
                renorm_eps,
            };
            gpu.sigmoid_topk(logits, w.router_bias, moe.n_experts, &p, &routes)
        }
    }
    .map_err(dev("router"))?;
    let groups = ExpertGroups {
        offsets: cut(s.group_offsets, moe.n_experts + 1)?,
        rows: cut(s.group_rows, entries)?,
        weights: cut(s.group_weights, entries)?,
        n_experts: moe.n_experts,
    };
    gpu.moe_group(&routes, &groups).map_err(dev("moe group"))?;
    let ei = w.experts.intermediate();
    let xin = cut(s.expert_in, entries * h)?;
    let (a, b, y) = (
        cut(s.ffn_a, entries * ei)?,
        cut(s.ffn_b, entries * ei)?,
        cut(s.ffn_out, entries * h)?,
    );
    gpu.gather_rows(s.normed, groups.rows, h, xin)
        .map_err(dev("expert gather"))?;
    match &w.experts {
        ExpertTables::SwiGlu { gate, up, down } => {
            gpu.grouped_matmul_swiglu(xin, gate, up, &groups, a, b)
                .map_err(dev("expert swiglu"))?;
            gpu.grouped_matmul(a, down, &groups, y)
                .map_err(dev("expert down"))?;
        }
        ExpertTables::Plain { up, down } => {
            gpu.grouped_matmul(xin, up, &groups, a)
                .map_err(dev("expert up"))?;
            gpu.relu2(a, b, entries * ei).map_err(dev("expert relu2"))?;
            gpu.grouped_matmul(b, down, &groups, y)
                .map_err(dev("expert down"))?;
        }
    }
    gpu.zero(s.mixed).map_err(dev("moe output"))?;
    gpu.scatter_add_rows(y, groups.rows, groups.weights, h, s.mixed)
        .map_err(dev("expert scatter"))?;
    if let Some(shared) = &w.shared {
        mlp(cx, shared, s.normed, s.ffn_out, t)?;
        match &w.shared_gate {
            Some(gate) => {
                let g = cut(s.r[1], t)?;
                cx.linear(s.normed, gate, g, t)?;
                gpu.sigmoid_gate_add(s.mixed, s.ffn_out, g, t, h)
                    .map_err(dev("shared expert gate"))?;
            }
            None => gpu
                .add_scaled(s.mixed, s.ffn_out, 1.0, t * h)
                .map_err(dev("shared expert"))?,
        }
    }
    Ok(())
}
