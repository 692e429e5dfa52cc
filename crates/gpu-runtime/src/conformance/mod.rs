//! The backend conformance suite: every op of [`DenseOps`](crate::ops::DenseOps),
//! [`RecurrentOps`](crate::ops::RecurrentOps) and [`MoeOps`](crate::ops::MoeOps)
//! against scalar f64 references, at one architecture's shapes, on any
//! backend.
//!
//! [`run`] takes a `&dyn GpuBackend` and an [`ArchShapes`]. For each
//! [`Op`] the backend [`supports`](GpuBackend::supports), it runs the op at
//! those shapes: one decode token, a mixed step (a prefill, decode steps and
//! a chunk after cached tokens in one call) and a long prefill that crosses
//! chunks and KV blocks; with f32, bf16 and f16 weights where the op takes
//! weights; recurrent ops also fed in pieces. Results are compared with f64
//! references under the tolerances of the op's contract (and, where the
//! contract says "the same values, to the bit", with the ops it names). An
//! op the backend does not support is called once and must fail; one the
//! architecture has no layer for is not run. The [`Report`] lists every op:
//! passed (with its largest errors), failed (why), unsupported, or not used.
//!
//! Every case frees what it allocates; `run` checks the ledger is back where
//! it started. The CPU backend runs the suite in CI at built-in small shapes
//! ([`ArchShapes::small_set`]) and at the fixture models' shapes
//! (`metrale_model_engine::conformance::arch_shapes`); a new backend runs the
//! same.

mod attention;
mod dense;
pub(crate) mod harness;
mod moe;
mod recurrent;
mod report;
pub(crate) mod scans;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Instant;

pub use crate::ops::Op;
pub use report::{OpReport, Report, Status};

use crate::gpu::GpuBackend;
use harness::{Cx, Fail};

/// An attention layer's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct AttnShapes {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Channels RoPE rotates per head (0: no RoPE).
    pub rotary_dim: usize,
    /// A sliding window, where some layer has one.
    pub sliding_window: Option<usize>,
}

/// A dense MLP's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct MlpShapes {
    pub intermediate: usize,
    /// SwiGLU (`matmul_swiglu`); otherwise relu².
    pub gated: bool,
}

/// A Mamba-2 mixer's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct MambaShapes {
    pub n_heads: usize,
    pub head_dim: usize,
    pub d_state: usize,
    pub n_groups: usize,
    pub conv_kernel: usize,
    pub chunk_size: usize,
    /// Channels the gated RMSNorm normalises at a time (`d_inner` or
    /// `d_inner / n_groups`).
    pub norm_group_size: usize,
    /// dt's clamp after the softplus.
    pub dt_limit: (f32, f32),
}

impl MambaShapes {
    pub fn d_inner(&self) -> usize {
        self.n_heads * self.head_dim
    }
    /// Channels of the conv: x, B and C.
    pub fn conv_dim(&self) -> usize {
        self.d_inner() + 2 * self.n_groups * self.d_state
    }
}

/// A gated DeltaNet mixer's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct DeltaShapes {
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
    pub conv_kernel: usize,
    /// The chunk size the model passes (64, HF's).
    pub chunk_size: usize,
}

impl DeltaShapes {
    pub fn key_dim(&self) -> usize {
        self.n_k_heads * self.k_head_dim
    }
    pub fn value_dim(&self) -> usize {
        self.n_v_heads * self.v_head_dim
    }
    /// Channels of the conv: q, k and v.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
}

/// A sparse mixture of experts' shape.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeShapes {
    pub n_experts: usize,
    pub top_k: usize,
    /// Each expert's intermediate size.
    pub intermediate: usize,
    /// SwiGLU experts (`grouped_matmul_swiglu`); otherwise relu².
    pub gated: bool,
    /// The shared expert's intermediate size, if there is one.
    pub shared_intermediate: Option<usize>,
    /// Sigmoid routing's `(n_group, topk_group)`, where the model routes so.
    pub groups: Option<(usize, usize)>,
}

/// One architecture's op shapes: what [`run`] runs every op at.
#[derive(Clone, Debug, PartialEq)]
pub struct ArchShapes {
    /// For the report ("llama", a fixture's folder, ...).
    pub name: String,
    pub hidden: usize,
    pub vocab: usize,
    pub mlp: Option<MlpShapes>,
    pub attention: Option<AttnShapes>,
    /// Tokens per KV-cache block.
    pub block_size: usize,
    /// LFM2's gated short convolution over `hidden` channels: its kernel.
    pub short_conv: Option<usize>,
    pub mamba: Option<MambaShapes>,
    pub deltanet: Option<DeltaShapes>,
    pub moe: Option<MoeShapes>,
}

impl ArchShapes {
    /// Tokens of the long prefill: past two chunks of every scan, three KV
    /// blocks and the CPU GEMV's 32 rows.
    pub fn long_len(&self) -> usize {
        let chunks = [
            self.mamba.as_ref().map_or(0, |m| m.chunk_size),
            self.deltanet.as_ref().map_or(0, |d| d.chunk_size),
        ];
        let chunk = chunks.into_iter().max().unwrap_or(0);
        (2 * chunk + 3).max(3 * self.block_size + 1).max(40)
    }

    /// The ops this architecture's layers run (those outside it are
    /// reported as not used).
    pub fn uses(&self, op: Op) -> bool {
        let gated_mlp = self.mlp.as_ref().is_some_and(|m| m.gated)
            || self
                .moe
                .as_ref()
                .is_some_and(|m| m.gated && m.shared_intermediate.is_some());
        match op {
            Op::Rope => self.attention.as_ref().is_some_and(|a| a.rotary_dim > 0),
            Op::KvStore | Op::PagedAttention => self.attention.is_some(),
            Op::MatmulSwiglu => gated_mlp,
            Op::CausalConv1d => {
                self.mamba.is_some() || self.deltanet.is_some() || self.short_conv.is_some()
            }
            Op::GatedRmsNorm => self.mamba.is_some() || self.deltanet.is_some(),
            Op::SsdScan => self.mamba.is_some(),
            Op::GatedDeltaRule => self.deltanet.is_some(),
            Op::SoftmaxTopk
            | Op::SigmoidTopk
            | Op::MoeGroup
            | Op::GroupedMatmul
            | Op::SigmoidGateAdd => self.moe.is_some(),
            Op::GroupedMatmulSwiglu => self.moe.as_ref().is_some_and(|m| m.gated),
            _ => true,
        }
    }

    /// Small shapes that between them run every op at every path the CPU
    /// backend has (block sizes 4 and 16, head sizes 8 to 128, windows,
    /// partial RoPE, conv kernels 1, 2 and 4, grouped and ungrouped scans
    /// down to chunks of 1, clamped dt, GQA in the delta rule, routed
    /// experts of both kinds, grouped sigmoid routing).
    pub fn small_set() -> Vec<ArchShapes> {
        let attn = |n_heads, n_kv_heads, head_dim, rotary_dim, sliding_window| AttnShapes {
            n_heads,
            n_kv_heads,
            head_dim,
            rotary_dim,
            sliding_window,
        };
        let mamba =
            |n_heads, head_dim, d_state, n_groups, chunk_size, norm_groups: usize| MambaShapes {
                n_heads,
                head_dim,
                d_state,
                n_groups,
                conv_kernel: 4,
                chunk_size,
                norm_group_size: n_heads * head_dim / norm_groups,
                dt_limit: (0.0, f32::INFINITY),
            };
        vec![
            ArchShapes {
                name: "dense-gqa".into(),
                hidden: 48,
                vocab: 97,
                mlp: Some(MlpShapes {
                    intermediate: 70,
                    gated: true,
                }),
                attention: Some(attn(6, 2, 8, 8, None)),
                block_size: 4,
                short_conv: Some(3),
                mamba: None,
                deltanet: None,
                moe: None,
            },
            ArchShapes {
                name: "hybrid-mamba-moe".into(),
                hidden: 64,
                vocab: 130,
                mlp: None,
                attention: Some(attn(6, 2, 64, 32, Some(5))),
                block_size: 4,
                short_conv: None,
                mamba: Some(mamba(4, 8, 16, 2, 8, 2)),
                deltanet: None,
                moe: Some(MoeShapes {
                    n_experts: 8,
                    top_k: 2,
                    intermediate: 24,
                    gated: true,
                    shared_intermediate: Some(40),
                    groups: None,
                }),
            },
            ArchShapes {
                name: "relu2-clamped-dt".into(),
                hidden: 40,
                vocab: 64,
                mlp: Some(MlpShapes {
                    intermediate: 56,
                    gated: false,
                }),
                attention: Some(attn(6, 2, 40, 40, Some(3))),
                block_size: 16,
                // Kernel 1: a conv without a state.
                short_conv: None,
                mamba: Some(MambaShapes {
                    dt_limit: (0.05, 0.3),
                    conv_kernel: 1,
                    ..mamba(3, 4, 8, 1, 64, 1)
                }),
                deltanet: None,
                moe: Some(MoeShapes {
                    n_experts: 8,
                    top_k: 3,
                    intermediate: 16,
                    gated: false,
                    shared_intermediate: None,
                    groups: Some((4, 2)),
                }),
            },
            ArchShapes {
                name: "deltanet".into(),
                hidden: 32,
                vocab: 50,
                mlp: Some(MlpShapes {
                    intermediate: 64,
                    gated: true,
                }),
                attention: Some(attn(4, 1, 128, 32, Some(17))),
                block_size: 16,
                short_conv: None,
                mamba: Some(mamba(2, 4, 8, 1, 1, 1)),
                deltanet: Some(DeltaShapes {
                    n_k_heads: 2,
                    n_v_heads: 4,
                    k_head_dim: 16,
                    v_head_dim: 8,
                    conv_kernel: 4,
                    chunk_size: 8,
                }),
                moe: Some(MoeShapes {
                    n_experts: 4,
                    top_k: 2,
                    intermediate: 12,
                    gated: true,
                    shared_intermediate: Some(20),
                    groups: None,
                }),
            },
            ArchShapes {
                name: "deltanet-mha".into(),
                hidden: 24,
                vocab: 40,
                mlp: Some(MlpShapes {
                    intermediate: 40,
                    gated: true,
                }),
                attention: Some(attn(4, 1, 64, 64, None)),
                block_size: 16,
                short_conv: Some(2),
                mamba: None,
                deltanet: Some(DeltaShapes {
                    n_k_heads: 3,
                    n_v_heads: 3,
                    k_head_dim: 8,
                    v_head_dim: 12,
                    conv_kernel: 2,
                    chunk_size: 64,
                }),
                moe: None,
            },
        ]
    }
}

/// Runs every op at `shapes` on `gpu` (see the module documentation).
pub fn run(gpu: &dyn GpuBackend, shapes: &ArchShapes) -> Report {
    let started = Instant::now();
    let live_at_start = gpu.live_bytes();
    let ops = Op::ALL
        .iter()
        .enumerate()
        .map(|(i, &op)| run_op(gpu, shapes, op, i as u64))
        .collect();
    Report {
        backend: gpu.name().to_string(),
        arch: shapes.name.clone(),
        ops,
        leaked_bytes: gpu.live_bytes().saturating_sub(live_at_start),
        elapsed: started.elapsed(),
    }
}

fn run_op(gpu: &dyn GpuBackend, shapes: &ArchShapes, op: Op, seed: u64) -> OpReport {
    let started = Instant::now();
    let supported = gpu.supports(op);
    let report = |status, stats: harness::Stats| OpReport {
        op,
        status,
        cases: stats.cases,
        max_abs: stats.max_abs,
        max_rel: stats.max_rel,
        tolerance: stats.tolerance,
        elapsed: started.elapsed(),
    };
    if !shapes.uses(op) {
        let status = if supported {
            Status::NotUsed
        } else {
            Status::Unsupported
        };
        return report(status, harness::Stats::default());
    }
    let live = gpu.live_bytes();
    let mut cx = Cx::new(gpu, shapes, 0x5EED + seed);
    let outcome = catch_unwind(AssertUnwindSafe(|| run_cases(&mut cx, op)));
    let leaked = gpu.live_bytes().saturating_sub(live);
    let status = match (outcome, supported) {
        (Err(panic), _) => Status::Failed(format!("panicked: {}", panic_text(&panic))),
        (Ok(Ok(())), true) if leaked > 0 => {
            Status::Failed(format!("{leaked} bytes left allocated after its cases"))
        }
        (Ok(Ok(())), true) => Status::Passed,
        (Ok(Err(Fail::Op(e))), true) => Status::Failed(format!("returned an error: {e}")),
        (Ok(Err(Fail::Setup(e))), _) => Status::Failed(format!("could not set up: {e}")),
        (Ok(Err(Fail::Mismatch(m))), true) => Status::Failed(m),
        (Ok(Err(Fail::Op(_))), false) => Status::Unsupported,
        (Ok(Ok(())), false) => Status::Failed(
            "the backend says it does not support this op, but calling it succeeded".into(),
        ),
        (Ok(Err(Fail::Mismatch(m))), false) => Status::Failed(format!(
            "the backend says it does not support this op, but calling it \
             returned no error (and wrong results: {m})"
        )),
    };
    report(status, cx.stats)
}

fn run_cases(cx: &mut Cx<'_>, op: Op) -> harness::Outcome {
    match op {
        Op::Embedding => dense::embedding(cx).and_then(|()| dense::embedding_quantized(cx)),
        Op::Matmul => dense::matmul(cx).and_then(|()| dense::matmul_quantized(cx)),
        Op::MatmulSwiglu => dense::matmul_swiglu(cx),
        Op::RmsNorm => dense::rms_norm(cx),
        Op::Rope => attention::rope(cx),
        Op::KvStore => attention::kv_store(cx),
        Op::PagedAttention => attention::paged_attention(cx),
        Op::SiluMul => dense::silu_mul(cx),
        Op::Relu2 => dense::relu2(cx),
        Op::SigmoidMul => dense::sigmoid_mul(cx),
        Op::AddScaled => dense::add_scaled(cx),
        Op::Scale => dense::scale(cx),
        Op::CopyCols => dense::copy_cols(cx),
        Op::ScatterCols => dense::scatter_cols(cx),
        Op::GatherRows => dense::gather_rows(cx),
        Op::ScatterAddRows => dense::scatter_add_rows(cx),
        Op::CausalConv1d => recurrent::causal_conv1d(cx),
        Op::SsdScan => recurrent::ssd_scan(cx),
        Op::GatedRmsNorm => recurrent::gated_rms_norm(cx),
        Op::GatedDeltaRule => recurrent::gated_delta_rule(cx),
        Op::SoftmaxTopk => moe::softmax_topk(cx),
        Op::SigmoidTopk => moe::sigmoid_topk(cx),
        Op::MoeGroup => moe::moe_group(cx),
        Op::GroupedMatmul => moe::grouped_matmul(cx),
        Op::GroupedMatmulSwiglu => moe::grouped_matmul_swiglu(cx),
        Op::SigmoidGateAdd => moe::sigmoid_gate_add(cx),
    }
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}
