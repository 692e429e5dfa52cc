//! metrale-gpu-runtime: device memory with an allocation ledger, and the typed
//! compute operations the engine runs, behind one object-safe trait.
//!
//! - [`gpu::GpuBackend`]: memory (allocate, free, copies, memset) on top of the
//!   shared [`ledger::Ledger`], plus the op families in [`ops`].
//! - [`cpu::CpuBackend`]: host memory, 64-byte aligned; the reference
//!   implementation of every op, and the default backend.
//! - [`hooks::Hooks`]: what every backend owns and the provided methods
//!   consult: fault injection ([`fault::FaultPlan`]: the Nth allocation, free,
//!   copy or op launch fails), transfer counters, debug sync, and the sticky
//!   device error.
//! - [`arena::BufferArena`]: activation scratch, allocated once.
//! - [`conformance`]: every op against f64 references at an architecture's
//!   shapes, for any backend; [`gpu::GpuBackend::supports`] says which ops
//!   a backend has.

pub mod arena;
pub mod conformance;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod fault;
pub mod gpu;
pub mod hooks;
pub mod ledger;
pub mod ops;

pub use error::GpuError;
pub use gpu::{DevicePtr, DeviceSlice, Fence, GpuBackend, GraphId};
pub use hooks::{Hooks, Transfers};
