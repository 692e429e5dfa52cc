//! Recurrent ops of [`FaultInjecting`] pass through to the wrapped backend.

use super::FaultInjecting;
use crate::error::Result;
use crate::gpu::{DeviceSlice, GpuBackend};
use crate::ops::recurrent::{DeltaParams, GateOrder, RecurrentOps, SsdParams};

impl<B: GpuBackend> RecurrentOps for FaultInjecting<B> {
    fn causal_conv1d(
        &self,
        x: DeviceSlice,
        weight: DeviceSlice,
        bias: Option<DeviceSlice>,
        out: DeviceSlice,
        states: crate::ops::step::StateSlots,
        seqs: &crate::ops::step::RecurrentBatch,
        channels: usize,
        kernel: usize,
        silu: bool,
    ) -> Result<()> {
        self.inner
            .causal_conv1d(x, weight, bias, out, states, seqs, channels, kernel, silu)
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
        states: crate::ops::step::StateSlots,
        seqs: &crate::ops::step::RecurrentBatch,
        p: &SsdParams,
    ) -> Result<()> {
        self.inner
            .ssd_scan(x, dt_raw, b, c, a_log, d, dt_bias, y, states, seqs, p)
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
        self.inner
            .gated_rms_norm(x, gate, weight, out, rows, dim, group_size, eps, order)
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
        states: crate::ops::step::StateSlots,
        seqs: &crate::ops::step::RecurrentBatch,
        p: &DeltaParams,
    ) -> Result<()> {
        self.inner
            .gated_delta_rule(q, k, v, a, b, a_log, dt_bias, out, states, seqs, p)
    }
}
