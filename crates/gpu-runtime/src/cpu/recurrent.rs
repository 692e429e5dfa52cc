//! CPU implementations of the recurrent-mixer ops.

use super::CpuBackend;
use crate::ops::recurrent::RecurrentOps;

impl RecurrentOps for CpuBackend {}
