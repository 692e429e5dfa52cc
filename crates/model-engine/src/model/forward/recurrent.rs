//! Recurrent mixers: Mamba-2 (conv, SSD scan, gated norm), the gated
//! DeltaNet of Qwen3-Next and Qwen3.5, and LFM2's gated short convolution,
//! each carrying its state in the sequence's slot.

use metrale_gpu_runtime::DeviceSlice;
use metrale_gpu_runtime::ops::{ConvAct, DeltaParams, GateOrder, SsdParams};

use super::{Cx, Scratch, dev};
use crate::error::{EngineError, Result};
use crate::model::weights::{DeltaWeights, MambaWeights, ShortConvWeights};

/// Mamba-2's intermediates, each in one of the arena's scratch regions.
struct MambaRegs {
    /// The gate `z`, `[t, d_inner]`.
    z: DeviceSlice,
    /// The conv input `xBC`, `[t, conv_dim]`.
    xbc: DeviceSlice,
    /// The raw time step, `[t, n_heads]`.
    dt: DeviceSlice,
    /// The conv output (after SiLU), `[t, x | B | C]`.
    xbc_act: DeviceSlice,
    /// The scan output, `[t, d_inner]`.
    y: DeviceSlice,
    /// The gated norm's output, `[t, d_inner]`.
    normed: DeviceSlice,
}

impl MambaRegs {
    fn of(s: &Scratch) -> Self {
        let [_, z, xbc, dt, xbc_act, _, _, _, y, normed] = s.r;
        Self {
            z,
            xbc,
            dt,
            xbc_act,
            y,
            normed,
        }
    }
}

/// The gated DeltaNet's intermediates, each in one scratch region.
struct DeltaRegs {
    /// The gated norm's output, `[t, value_dim]`.
    normed: DeviceSlice,
    /// `q | k | v` before the conv, then the delta rule's output.
    mixed: DeviceSlice,
    /// The gate `z`, `[t, value_dim]`.
    z: DeviceSlice,
    /// The conv output, `[t, q | k | v]`.
    conv: DeviceSlice,
    q: DeviceSlice,
    k: DeviceSlice,
    v: DeviceSlice,
    /// `beta`'s and the decay's raw projections, `[t, n_v_heads]`.
    b: DeviceSlice,
    a: DeviceSlice,
}

impl DeltaRegs {
    fn of(s: &Scratch) -> Self {
        let [normed, _, mixed, z, conv, q, k, v, b, a] = s.r;
        Self {
            normed,
            mixed,
            z,
            conv,
            q,
            k,
            v,
            b,
            a,
        }
    }
}

/// Mamba-2: in_proj -> z | xBC | dt; conv1d+SiLU over xBC; SSD scan;
/// gated RMSNorm with z; out_proj.
pub(super) fn mamba(cx: &Cx<'_>, w: &MambaWeights) -> Result<()> {
    let gpu = cx.gpu;
    let m = cx
        .model
        .config
        .mamba
        .as_ref()
        .ok_or_else(|| EngineError::Internal("Mamba layer without Mamba config".into()))?;
    let t = cx.batch.tokens;
    let (di, cd, gs, nh, pd) = (
        m.d_inner(),
        m.conv_dim(),
        m.n_groups * m.d_state,
        m.n_heads,
        m.in_proj_dim(),
    );
    let MambaRegs {
        z,
        xbc,
        dt,
        xbc_act,
        y,
        normed,
    } = MambaRegs::of(cx.s);
    let cut = |s: DeviceSlice, n: usize| s.slice(0, n).map_err(dev("mamba scratch"));
    let seqs = &cx.batch.meta.recurrent;
    // in_proj's parts straight into their buffers (no split copies).
    debug_assert_eq!(pd, di + cd + nh);
    cx.linear(cx.s.normed, &w.in_proj.rows(0, di)?, z, t)?;
    cx.linear(cx.s.normed, &w.in_proj.rows(di, cd)?, xbc, t)?;
    cx.linear(cx.s.normed, &w.in_proj.rows(di + cd, nh)?, dt, t)?;
    gpu.causal_conv1d(
        cut(xbc, t * cd)?,
        w.conv_w,
        w.conv_b,
        cut(xbc_act, t * cd)?,
        cx.states(w.state_layer, true)?,
        seqs,
        cd,
        m.conv_kernel,
        ConvAct::Silu,
    )
    .map_err(dev("conv1d"))?;
    // x, B and C read in place from the conv output `[t, x | B | C]`.
    let part = |start: usize, n: usize| {
        let span = (t.max(1) - 1) * cd + n;
        xbc_act.slice(start, span).map_err(dev("conv output part"))
    };
    let p = SsdParams {
        n_heads: nh,
        head_dim: m.head_dim,
        d_state: m.d_state,
        n_groups: m.n_groups,
        chunk_size: m.chunk_size,
        dt_min: m.time_step_limit.0,
        dt_max: m.time_step_limit.1,
        input_row_stride: Some(cd),
    };
    gpu.ssd_scan(
        part(0, di)?,
        cut(dt, t * nh)?,
        part(di, gs)?,
        part(di + gs, gs)?,
        w.a_log,
        w.d,
        w.dt_bias,
        cut(y, t * di)?,
        cx.states(w.state_layer, false)?,
        seqs,
        &p,
    )
    .map_err(dev("ssd scan"))?;
    let group = di / m.norm_groups.max(1);
    gpu.gated_rms_norm(
        cut(y, t * di)?,
        cut(z, t * di)?,
        w.norm,
        cut(normed, t * di)?,
        t,
        di,
        group,
        m.norm_eps,
        GateOrder::BeforeNorm,
    )
    .map_err(dev("gated norm"))?;
    cx.linear(normed, &w.out_proj, cx.s.mixed, t)
}

/// Gated DeltaNet: the q|k|v, z, b and a projections; conv1d+SiLU over
/// q|k|v; the gated delta rule; gated RMSNorm per head with z; out_proj.
pub(super) fn deltanet(cx: &Cx<'_>, w: &DeltaWeights) -> Result<()> {
    let gpu = cx.gpu;
    let d = cx
        .model
        .config
        .deltanet
        .as_ref()
        .ok_or_else(|| EngineError::Internal("DeltaNet layer without its config".into()))?;
    let t = cx.batch.tokens;
    let (kd, vd, cd, nv) = (d.key_dim(), d.value_dim(), d.conv_dim(), d.n_v_heads);
    let DeltaRegs {
        normed,
        mixed,
        z,
        conv,
        q,
        k,
        v,
        b,
        a,
    } = DeltaRegs::of(cx.s);
    let cut = |s: DeviceSlice, n: usize| s.slice(0, n).map_err(dev("deltanet scratch"));
    let seqs = &cx.batch.meta.recurrent;
    // The projections' parts straight into their buffers (no split copies).
    cx.linear(cx.s.normed, &w.qkv, mixed, t)?;
    cx.linear(cx.s.normed, &w.z, z, t)?;
    cx.linear(cx.s.normed, &w.b, b, t)?;
    cx.linear(cx.s.normed, &w.a, a, t)?;
    gpu.causal_conv1d(
        cut(mixed, t * cd)?,
        w.conv_w,
        None,
        cut(conv, t * cd)?,
        cx.states(w.state_layer, true)?,
        seqs,
        cd,
        d.conv_kernel,
        ConvAct::Silu,
    )
    .map_err(dev("conv1d"))?;
    gpu.copy_cols(conv, cd, 0, kd, q, t)
        .map_err(dev("split q"))?;
    gpu.copy_cols(conv, cd, kd, kd, k, t)
        .map_err(dev("split k"))?;
    gpu.copy_cols(conv, cd, 2 * kd, vd, v, t)
        .map_err(dev("split v"))?;
    let p = DeltaParams {
        n_k_heads: d.n_k_heads,
        n_v_heads: nv,
        k_head_dim: d.k_head_dim,
        v_head_dim: d.v_head_dim,
        chunk_size: 64,
        tiled_v_heads: d.tiled_v_heads,
    };
    let core = cut(mixed, t * vd)?;
    gpu.gated_delta_rule(
        cut(q, t * kd)?,
        cut(k, t * kd)?,
        cut(v, t * vd)?,
        cut(a, t * nv)?,
        cut(b, t * nv)?,
        w.a_log,
        w.dt_bias,
        core,
        cx.states(w.state_layer, false)?,
        seqs,
        &p,
    )
    .map_err(dev("gated delta rule"))?;
    let normed = cut(normed, t * vd)?;
    gpu.gated_rms_norm(
        core,
        cut(z, t * vd)?,
        w.norm,
        normed,
        t * nv,
        d.v_head_dim,
        d.v_head_dim,
        d.norm_eps,
        GateOrder::AfterNorm,
    )
    .map_err(dev("gated norm"))?;
    cx.linear(normed, &w.out_proj, cx.s.mixed, t)
}

/// LFM2's gated short convolution: `in_proj`'s b, c and x parts straight
/// into their buffers; `y = c ⊙ conv(b ⊙ x)` in one conv call (its gates);
/// `out_proj`.
pub(super) fn short_conv(cx: &Cx<'_>, w: &ShortConvWeights) -> Result<()> {
    let c = cx
        .model
        .config
        .short_conv
        .as_ref()
        .ok_or_else(|| EngineError::Internal("short conv layer without its config".into()))?;
    let (h, t) = (cx.model.config.hidden_size, cx.batch.tokens);
    let [_, b, gate, x, y, ..] = cx.s.r;
    let cut = |s: DeviceSlice| s.slice(0, t * h).map_err(dev("short conv scratch"));
    cx.linear(cx.s.normed, &w.in_proj.rows(0, h)?, b, t)?;
    cx.linear(cx.s.normed, &w.in_proj.rows(h, h)?, gate, t)?;
    cx.linear(cx.s.normed, &w.in_proj.rows(2 * h, h)?, x, t)?;
    let gates = ConvAct::Gated {
        pre: cut(b)?,
        post: cut(gate)?,
    };
    cx.gpu
        .causal_conv1d(
            cut(x)?,
            w.conv_w,
            w.conv_b,
            cut(y)?,
            cx.states(w.state_layer, true)?,
            &cx.batch.meta.recurrent,
            h,
            c.kernel,
            gates,
        )
        .map_err(dev("short conv"))?;
    cx.linear(y, &w.out_proj, cx.s.mixed, t)
}
