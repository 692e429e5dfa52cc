//! The typed compute operations, in families. Every backend implements every
//! family; model code calls them through `dyn GpuBackend`.
//!
//! Conventions shared by all ops:
//! - Activations are f32, row-major; shapes are passed explicitly.
//! - Weights may be f32, bf16 or f16 where an op says so; they are widened to
//!   f32 inside the kernel.
//! - Outputs never alias inputs unless an op says "in place".
//! - Small per-step metadata (token ids, positions, block tables) is passed as
//!   host slices; the backend uploads it if it needs to.

pub mod dense;
pub mod recurrent;

pub use dense::{AttnParams, AttnSeq, DenseOps, GroupedTopK, KvLayer, MatmulDims, RopeParams};
pub use recurrent::{DeltaParams, GateOrder, RecurrentOps, RecurrentSeq, SsdParams};
