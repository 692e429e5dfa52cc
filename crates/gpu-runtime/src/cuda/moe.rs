//! The mixture-of-experts ops on CUDA (`kernels/moe.cu`): the routers, the
//! grouping of routed entries by expert, the grouped matmuls and the shared
//! expert's gate. Each op begins (`Hooks::begin_op`), checks its operands on
//! the host (`moe_args.rs`), then queues one kernel. The routing stays on the
//! device: the grouped matmuls read the group offsets from device memory and
//! launch a grid bounded by the entries in all, whose row tiles past the
//! experts' last exit at once.

use super::CudaBackend;
use super::kernels::{
    GROUPED_MATMUL, GROUPED_MATMUL_SWIGLU, MOE_GROUP, SIGMOID_GATE_ADD, SIGMOID_TOPK, SOFTMAX_TOPK,
};
use super::moe_args as args;
use crate::error::Result;
use crate::gpu::DeviceSlice;
use crate::ops::{ExpertGroups, ExpertTable, GroupedTopK, MoeOps, Routes};

impl MoeOps for CudaBackend {
    fn softmax_topk(
        &self,
        logits: DeviceSlice,
        n: usize,
        renormalize: bool,
        routes: &Routes,
    ) -> Result<()> {
        self.hooks.begin_op("softmax_topk")?;
        let l = args::softmax_topk(logits, n, renormalize, routes)?;
        self.launch_opt(&SOFTMAX_TOPK, l)
    }

    fn sigmoid_topk(
        &self,
        logits: DeviceSlice,
        bias: Option<DeviceSlice>,
        n: usize,
        p: &GroupedTopK,
        routes: &Routes,
    ) -> Result<()> {
        self.hooks.begin_op("sigmoid_topk")?;
        let l = args::sigmoid_topk(logits, bias, n, p, routes)?;
        self.launch_opt(&SIGMOID_TOPK, l)
    }

    fn moe_group(&self, routes: &Routes, groups: &ExpertGroups) -> Result<()> {
        self.hooks.begin_op("moe_group")?;
        let l = args::moe_group(routes, groups)?;
        self.launch(&MOE_GROUP, l.cfg, l.args)
    }

    fn grouped_matmul(
        &self,
        x: DeviceSlice,
        w: &ExpertTable,
        groups: &ExpertGroups,
        out: DeviceSlice,
    ) -> Result<()> {
        self.hooks.begin_op("grouped_matmul")?;
        let l = args::grouped_matmul(x, w, groups, out)?;
        self.launch_opt(&GROUPED_MATMUL, l)
    }

    fn grouped_matmul_swiglu(
        &self,
        x: DeviceSlice,
        gate: &ExpertTable,
        up: &ExpertTable,
        groups: &ExpertGroups,
        out: DeviceSlice,
        scratch: DeviceSlice,
    ) -> Result<()> {
        self.hooks.begin_op("grouped_matmul_swiglu")?;
        let l = args::grouped_matmul_swiglu(x, gate, up, groups, out, scratch)?;
        self.launch_opt(&GROUPED_MATMUL_SWIGLU, l)
    }

    fn sigmoid_gate_add(
        &self,
        acc: DeviceSlice,
        x: DeviceSlice,
        gate: DeviceSlice,
        rows: usize,
        width: usize,
    ) -> Result<()> {
        self.hooks.begin_op("sigmoid_gate_add")?;
        let l = args::sigmoid_gate_add(acc, x, gate, rows, width)?;
        self.launch_opt(&SIGMOID_GATE_ADD, l)
    }
}
