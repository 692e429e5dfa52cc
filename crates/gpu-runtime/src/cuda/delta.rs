//! The gated delta rule on CUDA (`kernels/delta.cu`): the host's operand
//! checks and the launch shape.
//!
//! The kernel runs the per-token recurrence for every row (prefill too;
//! the op's contract lets the chunked form differ in rounding only). Each
//! column of a v head's state `[k_head_dim, v_head_dim]` evolves on its own,
//! so a group of `lpc` lanes holds one column in registers (at most
//! [`MAX_RPL`] rows a lane) and a block [`WARPS`] warps of `32 / lpc`
//! columns; the grid is (v heads × column blocks, sequences). As for
//! attention, the host knows the operands' lengths but not the sequences
//! (device memory): it passes the rows every operand holds and the pool's
//! slots, and the kernel skips a sequence outside them.

// Launch argument tuples mirror the kernel's parameter list.
#![allow(clippy::type_complexity, clippy::too_many_arguments)]

use metrale_core::DType;

use super::CudaBackend;
use super::args::{Launch, expect, f32s, int, need, shape_err, weight_code};
use super::kernels::GATED_DELTA_RULE;
use super::launch::{LaunchCfg, Ptr};
use crate::error::Result;
use crate::gpu::DeviceSlice;
use crate::ops::step::RECURRENT_SEQ_WORDS;
use crate::ops::{DeltaParams, RecurrentBatch, StateSlots};

/// Warps per block (`DELTA_WARPS` of delta.cu).
pub(super) const WARPS: usize = 4;
/// State rows a lane holds at most (`MAX_RPL` of delta.cu).
pub(super) const MAX_RPL: usize = 8;
/// k_head_dim up to this: 32 lanes of `MAX_RPL` rows.
pub(super) const MAX_K_HEAD_DIM: usize = 32 * MAX_RPL;
/// Most blocks along the grid's y axis (the kernel walks the sequences
/// grid-stride beyond it).
const MAX_GRID_Y: usize = 65_535;

/// Lanes per state column: the fewest (a power of two) that hold
/// `k_head_dim` rows at `MAX_RPL` a lane.
pub(super) fn lanes_per_column(k_head_dim: usize) -> usize {
    k_head_dim
        .div_ceil(MAX_RPL)
        .next_power_of_two()
        .clamp(1, 32)
}

/// Columns of one v head per block, and blocks per v head.
pub(super) fn column_blocks(k_head_dim: usize, v_head_dim: usize) -> (usize, usize) {
    let cols = WARPS * (32 / lanes_per_column(k_head_dim));
    (cols, v_head_dim.div_ceil(cols))
}

pub(super) type DeltaArgs = (
    Ptr,
    Ptr,
    Ptr,
    Ptr,
    Ptr,
    Ptr,
    Ptr,
    Ptr,
    Ptr,
    Ptr,
    i32,
    i32,
    i32,
    i32,
    i64,
    i64,
    i64,
    i32,
);

/// The checked launch of a `gated_delta_rule` call, or `None` when there is
/// nothing to do (no sequences, no v heads, or no rows in the operands).
pub(super) fn delta_launch(
    q: DeviceSlice,
    k: DeviceSlice,
    v: DeviceSlice,
    a: DeviceSlice,
    b: DeviceSlice,
    a_log: DeviceSlice,
    dt_bias: DeviceSlice,
    out: DeviceSlice,
    states: StateSlots,
    seqs: &RecurrentBatch,
    p: &DeltaParams,
) -> Result<Option<Launch<DeltaArgs>>> {
    const OP: &str = "gated_delta_rule";
    let DeltaParams {
        n_k_heads: nk,
        n_v_heads: nv,
        k_head_dim: dk,
        v_head_dim: dv,
        chunk_size,
        tiled_v_heads,
    } = *p;
    // The CPU backend's shape checks.
    if nk == 0 || dk == 0 || dv == 0 || !nv.is_multiple_of(nk) || chunk_size == 0 {
        return Err(shape_err(
            OP,
            format!("{nv} v heads of {dv} over {nk} k heads of {dk}, chunk {chunk_size}"),
        ));
    }
    if dk > MAX_K_HEAD_DIM {
        return Err(shape_err(
            OP,
            format!("k_head_dim {dk} beyond the {MAX_K_HEAD_DIM} supported"),
        ));
    }
    let a_code = weight_code(OP, a_log.dtype())?;
    need(OP, a_log, nv, "A_log")?;
    let bias_code = weight_code(OP, dt_bias.dtype())?;
    need(OP, dt_bias, nv, "dt_bias")?;
    for (s, what) in [
        (q, "q"),
        (k, "k"),
        (v, "v"),
        (a, "a"),
        (b, "b"),
        (out, "out"),
    ] {
        f32s(OP, s, 0, what)?;
    }
    expect(OP, seqs.seqs, DType::U32)?;
    need(
        OP,
        seqs.seqs,
        seqs.n_seqs * RECURRENT_SEQ_WORDS,
        "sequences",
    )?;
    expect(OP, states.states, DType::F32)?;
    let state_len = nv * dk * dv;
    if states.per_slot < state_len {
        return Err(shape_err(
            OP,
            format!(
                "state slots of {} elements, need {state_len}",
                states.per_slot
            ),
        ));
    }
    let (kw, vw) = (nk * dk, nv * dv);
    // The rows every operand holds: a sequence ending past them is skipped
    // by the kernel (the CPU reports it; the host cannot see it here).
    let rows_bound = (q.len() / kw)
        .min(k.len() / kw)
        .min(v.len() / vw.max(1))
        .min(out.len() / vw.max(1))
        .min(a.len() / nv.max(1))
        .min(b.len() / nv.max(1));
    let n_slots = states
        .states
        .len()
        .checked_div(states.per_slot)
        .unwrap_or(0);
    if seqs.n_seqs == 0 || nv == 0 || rows_bound == 0 || n_slots == 0 {
        return Ok(None);
    }
    let group = nv / nk;
    if group > 0x7f_ffff {
        return Err(shape_err(OP, format!("{nv} v heads over {nk} k heads")));
    }
    let lpc = lanes_per_column(dk);
    let (_, col_blocks) = column_blocks(dk, dv);
    let grid_x = u32::try_from(nv * col_blocks)
        .map_err(|_| shape_err(OP, format!("{nv} v heads of {dv}")))?;
    let flags = a_code
        | (bias_code << 2)
        | ((lpc.trailing_zeros() as i32) << 4)
        | ((tiled_v_heads as i32) << 7)
        | ((group as i32) << 8);
    Ok(Some(Launch {
        cfg: LaunchCfg {
            grid: (grid_x, seqs.n_seqs.min(MAX_GRID_Y) as u32, 1),
            block: ((WARPS * 32) as u32, 1, 1),
            shared_bytes: 0,
        },
        args: (
            Ptr::of(q),
            Ptr::of(k),
            Ptr::of(v),
            Ptr::of(a),
            Ptr::of(b),
            Ptr::of(a_log),
            Ptr::of(dt_bias),
            Ptr::of(out),
            Ptr::of(states.states),
            Ptr::of(seqs.seqs),
            int(OP, seqs.n_seqs, "sequences")?,
            int(OP, nv, "n_v_heads")?,
            int(OP, dk, "k_head_dim")?,
            int(OP, dv, "v_head_dim")?,
            rows_bound as i64,
            n_slots as i64,
            states.per_slot as i64,
            flags,
        ),
    }))
}

impl CudaBackend {
    pub(super) fn gated_delta_rule_op(
        &self,
        q: DeviceSlice,
        k: DeviceSlice,
        v: DeviceSlice,
        a: DeviceSlice,
        b: DeviceSlice,
        a_log: DeviceSlice,
        dt_bias: DeviceSlice,
        out: DeviceSlice,
        states: StateSlots,
        seqs: &RecurrentBatch,
        p: &DeltaParams,
    ) -> Result<()> {
        self.hooks.begin_op("gated_delta_rule")?;
        match delta_launch(q, k, v, a, b, a_log, dt_bias, out, states, seqs, p)? {
            Some(l) => self.launch(&GATED_DELTA_RULE, l.cfg, l.args),
            None => Ok(()),
        }
    }
}
