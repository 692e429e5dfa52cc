//! Per-sequence memory: the paged KV cache of attention layers, the SSM state
//! pool of recurrent layers, and snapshots of recurrent state.

pub mod kv;
pub mod prefix;
pub mod snapshots;
pub mod ssm_pool;

pub use kv::{KvCache, SeqBlocks};
pub use prefix::{BlockTree, Inserted, NodeRef, PrefixMatch};
pub use snapshots::{SnapshotKey, SsmSnapshots};
pub use ssm_pool::{SlotGuard, SsmStatePool, StateShape};
