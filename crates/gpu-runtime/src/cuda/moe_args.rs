//! The host side of the MoE kernels' launches (`kernels/moe.cu`), as free
//! functions: each checks an op's operands as far as the host sees them
//! (the CPU backend's errors: [`GpuError::Shape`] and
//! [`GpuError::UnsupportedDType`]) and returns the launch, or `None` when
//! there is nothing to do. What only the device holds (the routed experts,
//! the group offsets, the experts' weight addresses) is not checked here:
//! the kernels skip out-of-range experts and clamp offsets instead of
//! faulting.

// Launch argument tuples mirror the kernels' parameter lists.
#![allow(clippy::type_complexity)]

use metrale_core::DType;

use super::args::{Launch, elements, expect, f32s, int, need, shape_err, weight_code};
use super::launch::{LaunchCfg, Ptr};
use crate::error::Result;
use crate::gpu::DeviceSlice;
use crate::ops::{ExpertGroups, ExpertTable, GroupedTopK, Routes};

/// Threads of a router block (`ROUTER_THREADS` in `moe.cu`): one block a row.
pub(super) const ROUTER_THREADS: u32 = 128;
/// Threads of the one grouping block (`GROUP_THREADS`).
pub(super) const GROUP_THREADS: u32 = 1024;
/// Output tile of the grouped matmuls (`TM` = `TN`) and its threads.
pub(super) const TILE: usize = 64;
pub(super) const GM_THREADS: u32 = 256;
/// Dynamic shared memory a block may take without opting in.
const SHARED_LIMIT: usize = 48 * 1024;

/// The routes' buffers: u32 experts and f32 weights of `rows * k`.
fn check_routes(op: &'static str, r: &Routes) -> Result<()> {
    expect(op, r.experts, DType::U32)?;
    need(op, r.experts, r.rows * r.k, "route experts")?;
    f32s(op, r.weights, r.rows * r.k, "route weights")
}

/// A one-block-per-row router launch with `shared` dynamic bytes.
fn router_cfg(op: &'static str, rows: usize, shared: usize) -> Result<LaunchCfg> {
    if shared > SHARED_LIMIT {
        return Err(shape_err(
            op,
            format!("{shared} bytes of shared memory a row exceed {SHARED_LIMIT}"),
        ));
    }
    let mut cfg = LaunchCfg::linear(
        u32::try_from(rows).map_err(|_| shape_err(op, format!("{rows} rows")))?,
        ROUTER_THREADS,
    );
    cfg.shared_bytes = shared as u32;
    Ok(cfg)
}

pub(super) fn softmax_topk(
    logits: DeviceSlice,
    n: usize,
    renormalize: bool,
    r: &Routes,
) -> Result<Option<Launch<(Ptr, Ptr, Ptr, i32, i32, i32, i32)>>> {
    const OP: &str = "softmax_topk";
    let (rows, k) = (r.rows, r.k);
    if k == 0 || k > n {
        return Err(shape_err(OP, format!("top-{k} of {n}")));
    }
    f32s(OP, logits, rows * n, "logits")?;
    check_routes(OP, r)?;
    if rows == 0 {
        return Ok(None);
    }
    Ok(Some(Launch {
        cfg: router_cfg(OP, rows, n * 5)?,
        args: (
            Ptr::of(logits),
            Ptr::of(r.experts),
            Ptr::of(r.weights),
            int(OP, rows, "rows")?,
            int(OP, n, "n")?,
            int(OP, k, "k")?,
            renormalize as i32,
        ),
    }))
}

/// The grouping's shape checks, with the CPU's texts (`cpu/routing.rs`).
pub(super) fn check_grouping(n: usize, p: &GroupedTopK) -> std::result::Result<(), String> {
    let groups = p.n_group;
    if groups == 0 || !n.is_multiple_of(groups) {
        return Err(format!("{n} experts do not split into {groups} groups"));
    }
    let per_group = n / groups;
    if p.topk_group == 0 || p.topk_group > groups {
        return Err(format!("top-{} of {groups} groups", p.topk_group));
    }
    if p.k == 0 || p.k > p.topk_group * per_group {
        return Err(format!(
            "top-{} of the {} experts in {} groups",
            p.k,
            p.topk_group * per_group,
            p.topk_group
        ));
    }
    Ok(())
}

pub(super) type SigmoidTopkArgs = (
    Ptr,
    Ptr,
    i32,
    Ptr,
    Ptr,
    i32,
    i32,
    i32,
    i32,
    i32,
    i32,
    f32,
    f32,
);

pub(super) fn sigmoid_topk(
    logits: DeviceSlice,
    bias: Option<DeviceSlice>,
    n: usize,
    p: &GroupedTopK,
    r: &Routes,
) -> Result<Option<Launch<SigmoidTopkArgs>>> {
    const OP: &str = "sigmoid_topk";
    if p.k != r.k {
        return Err(shape_err(OP, format!("top-{} into routes of {}", p.k, r.k)));
    }
    f32s(OP, logits, r.rows * n, "logits")?;
    let bias_code = match bias {
        Some(b) => {
            need(OP, b, n, "correction bias")?;
            weight_code(OP, b.dtype())?
        }
        None => 0,
    };
    check_grouping(n, p).map_err(|d| shape_err(OP, d))?;
    check_routes(OP, r)?;
    if r.rows == 0 {
        return Ok(None);
    }
    // s and choice (2n floats), group scores, taken flags of experts and groups.
    let shared = 8 * n + 4 * p.n_group + n + p.n_group;
    Ok(Some(Launch {
        cfg: router_cfg(OP, r.rows, shared)?,
        args: (
            Ptr::of(logits),
            bias.map_or(Ptr::NULL, Ptr::of),
            bias_code,
            Ptr::of(r.experts),
            Ptr::of(r.weights),
            int(OP, r.rows, "rows")?,
            int(OP, n, "n")?,
            int(OP, p.k, "k")?,
            int(OP, p.n_group, "n_group")?,
            int(OP, p.topk_group, "topk_group")?,
            p.renormalize as i32,
            p.scale,
            p.renorm_eps,
        ),
    }))
}

/// The groups' buffers for `entries` routed entries.
fn check_groups(op: &'static str, g: &ExpertGroups, entries: usize) -> Result<()> {
    expect(op, g.offsets, DType::U32)?;
    need(op, g.offsets, g.n_experts + 1, "offsets")?;
    expect(op, g.rows, DType::U32)?;
    need(op, g.rows, entries, "rows")?;
    f32s(op, g.weights, entries, "weights")
}

/// One block, always (the offsets are written even with no entries).
pub(super) fn moe_group(
    r: &Routes,
    g: &ExpertGroups,
) -> Result<Launch<(Ptr, Ptr, Ptr, Ptr, Ptr, i32, i32, i32)>> {
    const OP: &str = "moe_group";
    let entries = r.rows * r.k;
    check_routes(OP, r)?;
    check_groups(OP, g, entries)?;
    let shared = 4 * g.n_experts;
    if shared > SHARED_LIMIT {
        return Err(shape_err(OP, format!("{} experts", g.n_experts)));
    }
    let mut cfg = LaunchCfg::linear(1, GROUP_THREADS);
    cfg.shared_bytes = shared as u32;
    Ok(Launch {
        cfg,
        args: (
            Ptr::of(r.experts),
            Ptr::of(r.weights),
            Ptr::of(g.offsets),
            Ptr::of(g.rows),
            Ptr::of(g.weights),
            int(OP, entries, "entries")?,
            // k = 0 means no entries: any divisor will do.
            int(OP, r.k.max(1), "k")?,
            int(OP, g.n_experts, "n_experts")?,
        ),
    })
}

/// A table's operands: u64 addresses of `n_experts`, a weight dtype.
fn check_table(op: &'static str, t: &ExpertTable, n_experts: usize, what: &str) -> Result<i32> {
    expect(op, t.ptrs, DType::U64)?;
    need(op, t.ptrs, n_experts, what)?;
    weight_code(op, t.dtype)
}

/// The grid of a grouped matmul: a bound on the experts' row tiles in all
/// (each expert adds at most one partial tile) by the column tiles.
pub(super) fn grouped_grid(entries: usize, n: usize, n_experts: usize) -> (u32, u32, u32) {
    let row_tiles = entries.div_ceil(TILE) + n_experts.min(entries);
    (row_tiles as u32, n.div_ceil(TILE) as u32, 1)
}

/// Checks shared by both grouped matmuls: x `[entries, k]`, out `[entries,
/// n]`, the groups; the launch shape and the integer arguments
/// (entries, n, k, n_experts), or `None` with nothing to do.
fn grouped(
    op: &'static str,
    x: DeviceSlice,
    n: usize,
    k: usize,
    g: &ExpertGroups,
    out: DeviceSlice,
) -> Result<Option<(LaunchCfg, [i32; 4])>> {
    let entries = g.entries();
    f32s(op, x, entries * k, "x")?;
    f32s(op, out, entries * n, "out")?;
    expect(op, g.offsets, DType::U32)?;
    need(op, g.offsets, g.n_experts + 1, "offsets")?;
    if entries == 0 || n == 0 || g.n_experts == 0 {
        return Ok(None);
    }
    let grid = grouped_grid(entries, n, g.n_experts);
    if n.div_ceil(TILE) > 65_535 || entries.div_ceil(TILE) + g.n_experts > i32::MAX as usize {
        return Err(shape_err(op, format!("{entries} rows of {n} columns")));
    }
    let cfg = LaunchCfg {
        grid,
        block: (GM_THREADS, 1, 1),
        shared_bytes: 0,
    };
    let ints = [
        int(op, entries, "entries")?,
        int(op, n, "n")?,
        int(op, k, "k")?,
        int(op, g.n_experts, "n_experts")?,
    ];
    Ok(Some((cfg, ints)))
}

pub(super) fn grouped_matmul(
    x: DeviceSlice,
    w: &ExpertTable,
    g: &ExpertGroups,
    out: DeviceSlice,
) -> Result<Option<Launch<(Ptr, Ptr, i32, Ptr, Ptr, i32, i32, i32, i32)>>> {
    const OP: &str = "grouped_matmul";
    let code = check_table(OP, w, g.n_experts, "weight table")?;
    let Some((cfg, [entries, n, k, experts])) = grouped(OP, x, w.n, w.k, g, out)? else {
        return Ok(None);
    };
    Ok(Some(Launch {
        cfg,
        args: (
            Ptr::of(x),
            Ptr::of(w.ptrs),
            code,
            Ptr::of(g.offsets),
            Ptr::of(out),
            entries,
            n,
            k,
            experts,
        ),
    }))
}

pub(super) fn grouped_matmul_swiglu(
    x: DeviceSlice,
    gate: &ExpertTable,
    up: &ExpertTable,
    g: &ExpertGroups,
    out: DeviceSlice,
    scratch: DeviceSlice,
) -> Result<Option<Launch<(Ptr, Ptr, Ptr, i32, Ptr, Ptr, Ptr, i32, i32, i32, i32)>>> {
    const OP: &str = "grouped_matmul_swiglu";
    let (n, k) = (gate.n, gate.k);
    if (up.n, up.k) != (n, k) {
        return Err(shape_err(
            OP,
            format!("gate [{n}, {k}] but up [{}, {}]", up.n, up.k),
        ));
    }
    let code = check_table(OP, gate, g.n_experts, "gate table")?;
    check_table(OP, up, g.n_experts, "up table")?;
    // One kernel rounds x once, for both products.
    if up.dtype != gate.dtype {
        return Err(shape_err(
            OP,
            format!("gate weights {} but up weights {}", gate.dtype, up.dtype),
        ));
    }
    f32s(OP, scratch, g.entries() * n, "scratch")?;
    let Some((cfg, [entries, n, k, experts])) = grouped(OP, x, n, k, g, out)? else {
        return Ok(None);
    };
    Ok(Some(Launch {
        cfg,
        args: (
            Ptr::of(x),
            Ptr::of(gate.ptrs),
            Ptr::of(up.ptrs),
            code,
            Ptr::of(g.offsets),
            Ptr::of(out),
            Ptr::of(scratch),
            entries,
            n,
            k,
            experts,
        ),
    }))
}

pub(super) fn sigmoid_gate_add(
    acc: DeviceSlice,
    x: DeviceSlice,
    gate: DeviceSlice,
    rows: usize,
    width: usize,
) -> Result<Option<Launch<(Ptr, Ptr, Ptr, i32, i64)>>> {
    const OP: &str = "sigmoid_gate_add";
    f32s(OP, acc, rows * width, "acc")?;
    f32s(OP, x, rows * width, "x")?;
    f32s(OP, gate, rows, "gate")?;
    if rows == 0 || width == 0 {
        return Ok(None);
    }
    Ok(Some(Launch {
        cfg: elements(rows * width),
        args: (
            Ptr::of(acc),
            Ptr::of(x),
            Ptr::of(gate),
            int(OP, width, "width")?,
            (rows * width) as i64,
        ),
    }))
}
