//! The Mamba-2 ops on CUDA (`kernels/mamba.cu`): the causal conv1d with its
//! state, the gated RMSNorm and the SSD scan. As for attention, the
//! sequences (`[row_start, len, slot]` words) are in device memory: the host
//! checks what it can see (dtypes, shapes, the state slots' size, the
//! descriptors' length) and bounds the rows every operand holds; the kernels
//! skip a sequence whose rows or slot lie beyond them.
//!
//! The SSD scan runs the per-token recurrence for every length: the function
//! the CPU's chunked form computes (the op contract: chunking changes only
//! rounding), with the state in registers over the sequence's tokens.

// Launch argument tuples mirror the kernels' parameter lists.
#![allow(clippy::type_complexity, clippy::too_many_arguments)]

use metrale_core::DType;

use super::CudaBackend;
use super::args::{Launch, THREADS, expect, f32s, int, need, shape_err, weight_code};
use super::kernels::{CAUSAL_CONV1D, CONV_STATE_UPDATE, GATED_RMS_NORM, SSD_SCAN};
use super::launch::{LaunchCfg, Ptr};
use crate::error::Result;
use crate::gpu::DeviceSlice;
use crate::ops::step::RECURRENT_SEQ_WORDS;
use crate::ops::{
    ConvAct, DeltaParams, GateOrder, RecurrentBatch, RecurrentOps, SsdParams, StateSlots,
};

/// Warps per block, state rows per warp and d_state values per lane of
/// `ssd_scan` (`SSD_WARPS`, `SSD_ROWS`, `SSD_KPL` of mamba.cu).
const SSD_WARPS: usize = 4;
const SSD_ROWS: usize = 4;
const SSD_KPL: usize = 8;
/// d_state up to this.
pub(super) const MAX_D_STATE: usize = 32 * SSD_KPL;
/// A sequence's share of the conv's blocks, where it may be long: about
/// this many blocks over the call's sequences.
const CONV_SPREAD_BLOCKS: usize = 4096;
/// Grid y (the sequences) at most.
const MAX_GRID_Y: usize = 65535;

/// The descriptors' checks; the sequences as a kernel's `int`.
fn check_seqs(op: &'static str, seqs: &RecurrentBatch) -> Result<i32> {
    expect(op, seqs.seqs, DType::U32)?;
    need(
        op,
        seqs.seqs,
        seqs.n_seqs * RECURRENT_SEQ_WORDS,
        "sequences",
    )?;
    int(op, seqs.n_seqs, "sequences")
}

/// The pool's checks: f32 slots of at least `state_len` elements (when there
/// are sequences to use them); the slots it holds.
fn check_states(
    op: &'static str,
    states: StateSlots,
    state_len: usize,
    n_seqs: usize,
) -> Result<u32> {
    expect(op, states.states, DType::F32)?;
    if n_seqs > 0 && states.per_slot < state_len {
        return Err(shape_err(
            op,
            format!(
                "state slots of {} elements, need {state_len}",
                states.per_slot
            ),
        ));
    }
    Ok(match states.per_slot {
        // Nothing to read or write in a slot (a conv of kernel 1).
        0 => u32::MAX,
        per => (states.states.len() / per).min(u32::MAX as usize) as u32,
    })
}

/// Rows of `n` elements, `stride` apart, that a slice of `len` holds.
pub(super) fn rows_held(len: usize, stride: usize, n: usize) -> usize {
    if len < n || stride == 0 {
        0
    } else {
        (len - n) / stride + 1
    }
}

pub(super) type ConvArgs = (
    Ptr,
    Ptr,
    Ptr,
    Ptr,
    Ptr,
    Ptr,
    i32,
    i32,
    i32,
    i64,
    u32,
    i64,
    i32,
    i32,
    i32,
    Ptr,
    Ptr,
);
pub(super) type ConvStateArgs = (Ptr, Ptr, Ptr, i32, i32, i32, i64, u32, i64, Ptr);

/// A checked `causal_conv1d` call: the outputs, then (kernel > 1) the states.
#[derive(Clone, Copy)]
pub(super) struct ConvLaunch {
    pub out: Launch<ConvArgs>,
    pub state: Option<Launch<ConvStateArgs>>,
}

pub(super) fn conv_launch(
    x: DeviceSlice,
    weight: DeviceSlice,
    bias: Option<DeviceSlice>,
    out: DeviceSlice,
    states: StateSlots,
    seqs: &RecurrentBatch,
    channels: usize,
    kernel: usize,
    act: ConvAct,
) -> Result<Option<ConvLaunch>> {
    const OP: &str = "causal_conv1d";
    let (silu, gates) = match act {
        ConvAct::Silu => (true, None),
        ConvAct::Linear => (false, None),
        ConvAct::Gated { pre, post } => (false, Some((pre, post))),
    };
    if channels == 0 || kernel == 0 {
        return Err(shape_err(
            OP,
            format!("{channels} channels, kernel {kernel}"),
        ));
    }
    let n_seqs = check_seqs(OP, seqs)?;
    expect(OP, x, DType::F32)?;
    expect(OP, out, DType::F32)?;
    let w_code = weight_code(OP, weight.dtype())?;
    need(OP, weight, channels * kernel, "weight")?;
    let b_code = match bias {
        Some(b) => {
            need(OP, b, channels, "bias")?;
            weight_code(OP, b.dtype())?
        }
        None => 0,
    };
    let km1 = kernel - 1;
    let n_slots = check_states(OP, states, channels * km1, seqs.n_seqs)?;
    // Rows every buffer holds (the gates' too): the kernels skip a
    // sequence past them instead of faulting.
    let mut held = x.len().min(out.len());
    if let Some((pre, post)) = gates {
        expect(OP, pre, DType::F32)?;
        expect(OP, post, DType::F32)?;
        held = held.min(pre.len()).min(post.len());
    }
    let rows_bound = held / channels;
    if seqs.n_seqs == 0 || rows_bound == 0 {
        return Ok(None);
    }
    if seqs.n_seqs > MAX_GRID_Y {
        return Err(shape_err(
            OP,
            format!("{} sequences in one call", seqs.n_seqs),
        ));
    }
    let ch = int(OP, channels, "channels")?;
    let k = int(OP, kernel, "kernel")?;
    let per_slot = states.per_slot as i64;
    let row_blocks = channels.div_ceil(THREADS as usize);
    // A sequence may hold every row: enough blocks to spread the longest,
    // at least one row's worth each.
    let gx = (rows_bound * channels)
        .div_ceil(THREADS as usize)
        .min(row_blocks.max(CONV_SPREAD_BLOCKS.div_ceil(seqs.n_seqs)))
        .max(1);
    let out_launch = Launch {
        cfg: LaunchCfg {
            grid: (
                u32::try_from(gx).map_err(|_| shape_err(OP, format!("{gx} blocks")))?,
                seqs.n_seqs as u32,
                1,
            ),
            block: (THREADS, 1, 1),
            shared_bytes: 0,
        },
        args: (
            Ptr::of(x),
            Ptr::of(weight),
            bias.map_or(Ptr::NULL, Ptr::of),
            Ptr::of(out),
            Ptr::of(states.states),
            Ptr::of(seqs.seqs),
            n_seqs,
            ch,
            k,
            per_slot,
            n_slots,
            rows_bound as i64,
            w_code,
            b_code,
            silu as i32,
            gates.map_or(Ptr::NULL, |g| Ptr::of(g.0)),
            gates.map_or(Ptr::NULL, |g| Ptr::of(g.1)),
        ),
    };
    let state = (km1 > 0).then(|| Launch {
        cfg: LaunchCfg {
            grid: (row_blocks as u32, seqs.n_seqs as u32, 1),
            block: (THREADS, 1, 1),
            shared_bytes: 0,
        },
        args: (
            Ptr::of(x),
            Ptr::of(states.states),
            Ptr::of(seqs.seqs),
            n_seqs,
            ch,
            k,
            per_slot,
            n_slots,
            rows_bound as i64,
            gates.map_or(Ptr::NULL, |g| Ptr::of(g.0)),
        ),
    });
    Ok(Some(ConvLaunch {
        out: out_launch,
        state,
    }))
}

pub(super) type NormArgs = (Ptr, Ptr, Ptr, Ptr, i64, i32, i32, f32, i32, i32);

pub(super) fn gated_norm_launch(
    x: DeviceSlice,
    gate: DeviceSlice,
    weight: DeviceSlice,
    out: DeviceSlice,
    rows: usize,
    dim: usize,
    group_size: usize,
    eps: f32,
    order: GateOrder,
) -> Result<Option<Launch<NormArgs>>> {
    const OP: &str = "gated_rms_norm";
    if dim == 0 || group_size == 0 || !dim.is_multiple_of(group_size) {
        return Err(shape_err(
            OP,
            format!("groups of {group_size} do not divide rows of {dim}"),
        ));
    }
    f32s(OP, x, rows * dim, "x")?;
    f32s(OP, gate, rows * dim, "gate")?;
    f32s(OP, out, rows * dim, "out")?;
    let code = weight_code(OP, weight.dtype())?;
    need(OP, weight, dim, "weight")?;
    if rows == 0 {
        return Ok(None);
    }
    // One block per (row, group); about four elements a thread.
    let blocks = rows * (dim / group_size);
    let blocks_u32 = u32::try_from(blocks)
        .ok()
        .filter(|&b| b <= i32::MAX as u32)
        .ok_or_else(|| shape_err(OP, format!("{blocks} groups of {group_size}")))?;
    let threads = group_size.div_ceil(4).next_multiple_of(32).clamp(32, 1024) as u32;
    Ok(Some(Launch {
        cfg: LaunchCfg::linear(blocks_u32, threads),
        args: (
            Ptr::of(x),
            Ptr::of(gate),
            Ptr::of(weight),
            Ptr::of(out),
            blocks as i64,
            int(OP, dim, "dim")?,
            int(OP, group_size, "group_size")?,
            eps,
            match order {
                GateOrder::BeforeNorm => 0,
                GateOrder::AfterNorm => 1,
            },
            code,
        ),
    }))
}

pub(super) type SsdArgs = (
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
    i32,
    f32,
    f32,
    i64,
    i64,
    i64,
    u32,
    i64,
    i32,
    i32,
    i32,
);

/// Blocks of `ssd_scan` per head: each takes `SSD_WARPS * SSD_ROWS` rows.
pub(super) fn ssd_row_blocks(head_dim: usize) -> usize {
    head_dim.div_ceil(SSD_WARPS * SSD_ROWS)
}

pub(super) fn ssd_launch(
    x: DeviceSlice,
    dt_raw: DeviceSlice,
    b: DeviceSlice,
    c: DeviceSlice,
    a_log: DeviceSlice,
    d: DeviceSlice,
    dt_bias: DeviceSlice,
    y: DeviceSlice,
    states: StateSlots,
    seqs: &RecurrentBatch,
    p: &SsdParams,
) -> Result<Option<Launch<SsdArgs>>> {
    const OP: &str = "ssd_scan";
    let SsdParams {
        n_heads: nh,
        head_dim: hd,
        d_state: n,
        n_groups: ng,
        chunk_size,
        dt_min,
        dt_max,
        input_row_stride,
    } = *p;
    if nh == 0 || hd == 0 || n == 0 || ng == 0 || !nh.is_multiple_of(ng) || chunk_size == 0 {
        return Err(shape_err(
            OP,
            format!("{nh} heads of {hd} over {ng} groups, d_state {n}, chunk {chunk_size}"),
        ));
    }
    if dt_min.is_nan() || dt_max.is_nan() || dt_min > dt_max {
        return Err(shape_err(OP, format!("dt range [{dt_min}, {dt_max}]")));
    }
    if n > MAX_D_STATE {
        return Err(shape_err(
            OP,
            format!("d_state {n} beyond the {MAX_D_STATE} supported"),
        ));
    }
    let (width, bc) = (nh * hd, ng * n);
    let (x_stride, bc_stride) = match input_row_stride {
        Some(stride) if stride < width.max(bc) => {
            return Err(shape_err(
                OP,
                format!("input rows {stride} apart, narrower than x ({width}) or B ({bc})"),
            ));
        }
        Some(stride) => (stride, stride),
        None => (width, bc),
    };
    let n_seqs = check_seqs(OP, seqs)?;
    for s in [x, dt_raw, b, c, y] {
        expect(OP, s, DType::F32)?;
    }
    let mut codes = [0i32; 3];
    for (code, (s, what)) in
        codes
            .iter_mut()
            .zip([(a_log, "A_log"), (d, "D"), (dt_bias, "dt_bias")])
    {
        *code = weight_code(OP, s.dtype())?;
        need(OP, s, nh, what)?;
    }
    let n_slots = check_states(OP, states, width * n, seqs.n_seqs)?;
    let rows_bound = [
        rows_held(x.len(), x_stride, width),
        rows_held(b.len(), bc_stride, bc),
        rows_held(c.len(), bc_stride, bc),
        dt_raw.len() / nh,
        y.len() / width,
    ]
    .into_iter()
    .min()
    .unwrap_or(0);
    if seqs.n_seqs == 0 || rows_bound == 0 {
        return Ok(None);
    }
    let head_blocks = nh * ssd_row_blocks(hd);
    if head_blocks > MAX_GRID_Y {
        return Err(shape_err(
            OP,
            format!("{nh} heads of {hd}: {head_blocks} blocks per sequence"),
        ));
    }
    Ok(Some(Launch {
        cfg: LaunchCfg {
            grid: (seqs.n_seqs as u32, head_blocks as u32, 1),
            block: ((SSD_WARPS * 32) as u32, 1, 1),
            shared_bytes: 0,
        },
        args: (
            Ptr::of(x),
            Ptr::of(dt_raw),
            Ptr::of(b),
            Ptr::of(c),
            Ptr::of(a_log),
            Ptr::of(d),
            Ptr::of(dt_bias),
            Ptr::of(y),
            Ptr::of(states.states),
            Ptr::of(seqs.seqs),
            n_seqs,
            int(OP, nh, "n_heads")?,
            int(OP, hd, "head_dim")?,
            n as i32,
            int(OP, ng, "n_groups")?,
            dt_min,
            dt_max,
            x_stride as i64,
            bc_stride as i64,
            states.per_slot as i64,
            n_slots,
            rows_bound as i64,
            codes[0],
            codes[1],
            codes[2],
        ),
    }))
}

impl RecurrentOps for CudaBackend {
    fn causal_conv1d(
        &self,
        x: DeviceSlice,
        weight: DeviceSlice,
        bias: Option<DeviceSlice>,
        out: DeviceSlice,
        states: StateSlots,
        seqs: &RecurrentBatch,
        channels: usize,
        kernel: usize,
        act: ConvAct,
    ) -> Result<()> {
        self.hooks.begin_op("causal_conv1d")?;
        let Some(l) = conv_launch(x, weight, bias, out, states, seqs, channels, kernel, act)?
        else {
            return Ok(());
        };
        // The outputs read the old state; the update is queued after them.
        self.launch(&CAUSAL_CONV1D, l.out.cfg, l.out.args)?;
        match l.state {
            Some(s) => self.launch(&CONV_STATE_UPDATE, s.cfg, s.args),
            None => Ok(()),
        }
    }

    fn ssd_scan(
        &self,
        x: DeviceSlice,
        dt_raw: DeviceSlice,
        b: DeviceSlice,
        c: DeviceSlice,
        a_log: DeviceSlice,
        d: DeviceSlice,
        dt_bias: DeviceSlice,
        y: DeviceSlice,
        states: StateSlots,
        seqs: &RecurrentBatch,
        p: &SsdParams,
    ) -> Result<()> {
        self.hooks.begin_op("ssd_scan")?;
        match ssd_launch(x, dt_raw, b, c, a_log, d, dt_bias, y, states, seqs, p)? {
            Some(l) => self.launch(&SSD_SCAN, l.cfg, l.args),
            None => Ok(()),
        }
    }

    fn gated_rms_norm(
        &self,
        x: DeviceSlice,
        gate: DeviceSlice,
        weight: DeviceSlice,
        out: DeviceSlice,
        rows: usize,
        dim: usize,
        group_size: usize,
        eps: f32,
        order: GateOrder,
    ) -> Result<()> {
        self.hooks.begin_op("gated_rms_norm")?;
        match gated_norm_launch(x, gate, weight, out, rows, dim, group_size, eps, order)? {
            Some(l) => self.launch(&GATED_RMS_NORM, l.cfg, l.args),
            None => Ok(()),
        }
    }

    fn gated_delta_rule(
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
        // In `delta.rs`.
        self.gated_delta_rule_op(q, k, v, a, b, a_log, dt_bias, out, states, seqs, p)
    }
}
