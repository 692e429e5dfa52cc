//! The op family the backend does not run yet: the recurrent ops (Mamba-2,
//! Gated DeltaNet). [`GpuBackend::supports`] answers
//! false for them, so a model that needs one is refused at load with its
//! name; called anyway, each returns an error naming itself.

use super::CudaBackend;
use crate::error::{GpuError, Result};
use crate::gpu::DeviceSlice;
use crate::ops::{DeltaParams, GateOrder, Op, RecurrentBatch, RecurrentOps, SsdParams, StateSlots};

impl CudaBackend {
    fn lacks(&self, op: Op) -> Result<()> {
        self.hooks.check(op.name())?;
        Err(GpuError::Unavailable(format!(
            "{op} is not implemented by the CUDA backend yet"
        )))
    }
}

impl RecurrentOps for CudaBackend {
    fn causal_conv1d(
        &self,
        _x: DeviceSlice,
        _weight: DeviceSlice,
        _bias: Option<DeviceSlice>,
        _out: DeviceSlice,
        _states: StateSlots,
        _seqs: &RecurrentBatch,
        _channels: usize,
        _kernel: usize,
        _silu: bool,
    ) -> Result<()> {
        self.lacks(Op::CausalConv1d)
    }

    fn ssd_scan(
        &self,
        _x: DeviceSlice,
        _dt_raw: DeviceSlice,
        _b: DeviceSlice,
        _c: DeviceSlice,
        _a_log: DeviceSlice,
        _d: DeviceSlice,
        _dt_bias: DeviceSlice,
        _y: DeviceSlice,
        _states: StateSlots,
        _seqs: &RecurrentBatch,
        _p: &SsdParams,
    ) -> Result<()> {
        self.lacks(Op::SsdScan)
    }

    fn gated_rms_norm(
        &self,
        _x: DeviceSlice,
        _gate: DeviceSlice,
        _weight: DeviceSlice,
        _out: DeviceSlice,
        _rows: usize,
        _dim: usize,
        _group_size: usize,
        _eps: f32,
        _order: GateOrder,
    ) -> Result<()> {
        self.lacks(Op::GatedRmsNorm)
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
        // Implemented in `delta.rs`.
        self.gated_delta_rule_op(q, k, v, a, b, a_log, dt_bias, out, states, seqs, p)
    }
}
