//! Ops of recurrent mixers: causal conv1d, the Mamba-2 SSD scan and step,
//! the gated delta rule, gated RMSNorm.

/// Recurrent-mixer operations.
pub trait RecurrentOps {}
