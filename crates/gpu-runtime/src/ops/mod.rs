//! The typed compute operations, in families. Every backend implements every
//! family's trait; model code calls them through `dyn GpuBackend`. An op a
//! backend cannot run returns an error, and
//! [`GpuBackend::supports`](crate::gpu::GpuBackend::supports) says so
//! beforehand ([`Op`] names each op).
//!
//! Conventions shared by all ops:
//! - Activations are f32, row-major; shapes are passed explicitly.
//! - Weights may be f32, bf16 or f16 where an op says so; they are widened to
//!   f32 inside the kernel.
//! - Outputs never alias inputs unless an op says "in place".
//! - No op takes a host slice: per-step metadata (token ids, positions, KV
//!   slots, block tables, state slots) lives in device memory, in the
//!   layouts of [`step`], uploaded once per step; MoE routes are written and
//!   read on the device ([`moe`]). Scalars (shapes, epsilons) are arguments.

pub mod dense;
pub mod layout;
pub mod moe;
pub mod op;
pub mod recurrent;
pub mod step;

pub use dense::{AttnParams, DenseOps, KvLayer, MatmulDims, RopeParams};
pub use layout::{KvLayout, KvSpec, StateLayout};
pub use moe::{ExpertGroups, ExpertTable, GroupedTopK, MoeOps, Routes};
pub use op::Op;
pub use recurrent::{ConvAct, DeltaParams, GateOrder, RecurrentOps, RecurrentSeq, SsdParams};
pub use step::{AttnBatch, RecurrentBatch, StateSlots};
