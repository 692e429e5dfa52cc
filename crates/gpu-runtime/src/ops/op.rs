//! The ops by name: what [`GpuBackend::supports`](crate::gpu::GpuBackend::supports)
//! answers for, what the conformance suite reports on, and what a model
//! checks it needs.

use std::fmt;

/// One method of [`DenseOps`](super::DenseOps), [`RecurrentOps`](super::RecurrentOps)
/// or [`MoeOps`](super::MoeOps).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    Embedding,
    Matmul,
    MatmulSwiglu,
    RmsNorm,
    Rope,
    KvStore,
    PagedAttention,
    SiluMul,
    Relu2,
    SigmoidMul,
    AddScaled,
    Scale,
    CopyCols,
    ScatterCols,
    GatherRows,
    ScatterAddRows,
    CausalConv1d,
    SsdScan,
    GatedRmsNorm,
    GatedDeltaRule,
    SoftmaxTopk,
    SigmoidTopk,
    MoeGroup,
    GroupedMatmul,
    GroupedMatmulSwiglu,
    SigmoidGateAdd,
}

impl Op {
    /// Every op, in trait order: dense, recurrent, MoE.
    pub const ALL: [Op; 26] = [
        Op::Embedding,
        Op::Matmul,
        Op::MatmulSwiglu,
        Op::RmsNorm,
        Op::Rope,
        Op::KvStore,
        Op::PagedAttention,
        Op::SiluMul,
        Op::Relu2,
        Op::SigmoidMul,
        Op::AddScaled,
        Op::Scale,
        Op::CopyCols,
        Op::ScatterCols,
        Op::GatherRows,
        Op::ScatterAddRows,
        Op::CausalConv1d,
        Op::SsdScan,
        Op::GatedRmsNorm,
        Op::GatedDeltaRule,
        Op::SoftmaxTopk,
        Op::SigmoidTopk,
        Op::MoeGroup,
        Op::GroupedMatmul,
        Op::GroupedMatmulSwiglu,
        Op::SigmoidGateAdd,
    ];

    /// The trait method's name, which is also the `op` of its errors
    /// (`GpuError::Shape { op, .. }`) and of the CPU's op profile.
    pub fn name(self) -> &'static str {
        match self {
            Op::Embedding => "embedding",
            Op::Matmul => "matmul",
            Op::MatmulSwiglu => "matmul_swiglu",
            Op::RmsNorm => "rms_norm",
            Op::Rope => "rope",
            Op::KvStore => "kv_store",
            Op::PagedAttention => "paged_attention",
            Op::SiluMul => "silu_mul",
            Op::Relu2 => "relu2",
            Op::SigmoidMul => "sigmoid_mul",
            Op::AddScaled => "add_scaled",
            Op::Scale => "scale",
            Op::CopyCols => "copy_cols",
            Op::ScatterCols => "scatter_cols",
            Op::GatherRows => "gather_rows",
            Op::ScatterAddRows => "scatter_add_rows",
            Op::CausalConv1d => "causal_conv1d",
            Op::SsdScan => "ssd_scan",
            Op::GatedRmsNorm => "gated_rms_norm",
            Op::GatedDeltaRule => "gated_delta_rule",
            Op::SoftmaxTopk => "softmax_topk",
            Op::SigmoidTopk => "sigmoid_topk",
            Op::MoeGroup => "moe_group",
            Op::GroupedMatmul => "grouped_matmul",
            Op::GroupedMatmulSwiglu => "grouped_matmul_swiglu",
            Op::SigmoidGateAdd => "sigmoid_gate_add",
        }
    }

    /// The op of a [`name`](Op::name).
    pub fn from_name(name: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|op| op.name() == name)
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::Op;

    #[test]
    fn names_are_distinct_and_round_trip() {
        for (i, op) in Op::ALL.iter().enumerate() {
            assert_eq!(Op::from_name(op.name()), Some(*op));
            assert!(Op::ALL[..i].iter().all(|o| o.name() != op.name()));
        }
    }

    /// Each name is the `OP` the CPU backend's implementation names its
    /// errors and profile entries with.
    #[test]
    fn names_are_the_cpu_ops_names() {
        let sources = [
            include_str!("../cpu/dense.rs"),
            include_str!("../cpu/attention.rs"),
            include_str!("../cpu/kv_store.rs"),
            include_str!("../cpu/recurrent.rs"),
            include_str!("../cpu/moe.rs"),
        ]
        .concat();
        for op in Op::ALL {
            let named = [
                format!("const OP: &str = \"{}\";", op.name()),
                format!("decode_recurrent(\"{}\"", op.name()),
            ];
            assert!(
                named.iter().any(|n| sources.contains(n.as_str())),
                "{op}: no CPU op of that name"
            );
        }
    }
}
