//! Recurrent ops of [`FaultInjecting`] pass through to the wrapped backend.

use super::FaultInjecting;
use crate::gpu::GpuBackend;
use crate::ops::recurrent::RecurrentOps;

impl<B: GpuBackend> RecurrentOps for FaultInjecting<B> {}
