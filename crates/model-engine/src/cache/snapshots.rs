//! Snapshots of a slot's recurrent state at chosen token positions, so that a
//! request sharing a prefix can start from the snapshot instead of
//! recomputing it.

use std::collections::HashMap;

use metrale_core::scope::ModelResource;
use metrale_core::{DType, SlotId};
use metrale_gpu_runtime::gpu::{DeviceSlice, GpuBackend};

use super::ssm_pool::SsmStatePool;
use crate::error::{EngineError, Result};

/// Identifies a snapshot: typically a hash of the token prefix it summarises.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SnapshotKey(pub u64);

struct Snapshot {
    /// Per recurrent layer: conv then SSM state.
    states: Vec<(DeviceSlice, DeviceSlice)>,
    tokens: usize,
}

/// Stored recurrent-state snapshots, each its own device allocations.
#[derive(Default)]
pub struct SsmSnapshots {
    snapshots: HashMap<SnapshotKey, Snapshot>,
}

impl SsmSnapshots {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.snapshots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.snapshots.is_empty()
    }

    /// Copies `slot`'s state (after `tokens` tokens) under `key`, replacing
    /// any earlier snapshot with that key. On failure nothing is kept.
    pub fn capture(
        &mut self,
        gpu: &dyn GpuBackend,
        pool: &SsmStatePool,
        slot: SlotId,
        key: SnapshotKey,
        tokens: usize,
    ) -> Result<()> {
        let mut states: Vec<(DeviceSlice, DeviceSlice)> = Vec::with_capacity(pool.layers());
        let result = (|| {
            for layer in 0..pool.layers() {
                let (conv, ssm) = (pool.conv_state(layer, slot)?, pool.ssm_state(layer, slot)?);
                let c = gpu
                    .alloc_slice(DType::F32, conv.len(), "ssm snapshots")
                    .map_err(EngineError::device("snapshot"))?;
                let s = match gpu.alloc_slice(DType::F32, ssm.len(), "ssm snapshots") {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = gpu.free(c.ptr());
                        return Err(EngineError::device("snapshot")(e));
                    }
                };
                states.push((c, s));
                gpu.copy_slice(conv, c)
                    .and_then(|_| gpu.copy_slice(ssm, s))
                    .map_err(EngineError::device("snapshot copy"))?;
            }
            Ok(())
        })();
        if let Err(e) = result {
            let _ = free_states(gpu, &states); // the capture error is the one to report
            return Err(e);
        }
        if let Some(old) = self.snapshots.insert(key, Snapshot { states, tokens }) {
            let _ = free_states(gpu, &old.states);
        }
        Ok(())
    }

    /// Copies the snapshot `key` into `slot`; returns how many tokens it covers.
    pub fn restore(
        &self,
        gpu: &dyn GpuBackend,
        pool: &SsmStatePool,
        slot: SlotId,
        key: SnapshotKey,
    ) -> Result<Option<usize>> {
        let Some(snap) = self.snapshots.get(&key) else {
            return Ok(None);
        };
        for (layer, (c, s)) in snap.states.iter().enumerate() {
            let (conv, ssm) = (pool.conv_state(layer, slot)?, pool.ssm_state(layer, slot)?);
            gpu.copy_slice(*c, conv)
                .and_then(|_| gpu.copy_slice(*s, ssm))
                .map_err(EngineError::device("snapshot restore"))?;
        }
        Ok(Some(snap.tokens))
    }

    /// Frees one snapshot.
    pub fn remove(&mut self, gpu: &dyn GpuBackend, key: SnapshotKey) -> bool {
        match self.snapshots.remove(&key) {
            Some(s) => {
                let _ = free_states(gpu, &s.states);
                true
            }
            None => false,
        }
    }
}

/// Frees a snapshot's buffers; the first failure is returned.
fn free_states(
    gpu: &dyn GpuBackend,
    states: &[(DeviceSlice, DeviceSlice)],
) -> metrale_gpu_runtime::error::Result<()> {
    gpu.free_all(states.iter().flat_map(|(c, s)| [c.ptr(), s.ptr()]))
}

impl<'g> ModelResource<dyn GpuBackend + 'g> for SsmSnapshots {
    fn label(&self) -> &str {
        "ssm snapshots"
    }

    fn release(&mut self, gpu: &(dyn GpuBackend + 'g)) -> anyhow::Result<()> {
        let states: Vec<(DeviceSlice, DeviceSlice)> = self
            .snapshots
            .drain()
            .flat_map(|(_, snap)| snap.states)
            .collect();
        Ok(free_states(gpu, &states)?)
    }
}
