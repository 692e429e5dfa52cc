//! The ops the backend does not run yet: the MoE ops (the gated delta rule's
//! stub is with the other recurrent ops, in `recurrent.rs`). [`GpuBackend::supports`] answers
//! false for them, so a model that needs one is refused at load with its
//! name; called anyway, each returns an error naming itself.

use super::CudaBackend;
use crate::error::{GpuError, Result};
use crate::gpu::DeviceSlice;
use crate::ops::{ExpertGroups, ExpertTable, GroupedTopK, MoeOps, Op, Routes};

impl CudaBackend {
    pub(super) fn lacks(&self, op: Op) -> Result<()> {
        self.hooks.check(op.name())?;
        Err(GpuError::Unavailable(format!(
            "{op} is not implemented by the CUDA backend yet"
        )))
    }
}

impl MoeOps for CudaBackend {
    fn softmax_topk(
        &self,
        _logits: DeviceSlice,
        _n: usize,
        _renormalize: bool,
        _routes: &Routes,
    ) -> Result<()> {
        self.lacks(Op::SoftmaxTopk)
    }

    fn sigmoid_topk(
        &self,
        _logits: DeviceSlice,
        _bias: Option<DeviceSlice>,
        _n: usize,
        _p: &GroupedTopK,
        _routes: &Routes,
    ) -> Result<()> {
        self.lacks(Op::SigmoidTopk)
    }

    fn moe_group(&self, _routes: &Routes, _groups: &ExpertGroups) -> Result<()> {
        self.lacks(Op::MoeGroup)
    }

    fn grouped_matmul(
        &self,
        _x: DeviceSlice,
        _w: &ExpertTable,
        _groups: &ExpertGroups,
        _out: DeviceSlice,
    ) -> Result<()> {
        self.lacks(Op::GroupedMatmul)
    }

    fn grouped_matmul_swiglu(
        &self,
        _x: DeviceSlice,
        _gate: &ExpertTable,
        _up: &ExpertTable,
        _groups: &ExpertGroups,
        _out: DeviceSlice,
        _scratch: DeviceSlice,
    ) -> Result<()> {
        self.lacks(Op::GroupedMatmulSwiglu)
    }

    fn sigmoid_gate_add(
        &self,
        _acc: DeviceSlice,
        _x: DeviceSlice,
        _gate: DeviceSlice,
        _rows: usize,
        _width: usize,
    ) -> Result<()> {
        self.lacks(Op::SigmoidGateAdd)
    }
}
