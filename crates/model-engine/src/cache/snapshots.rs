//! Snapshots of a slot's recurrent state at chosen token positions, so that a
//! request sharing a prefix can start from the snapshot instead of
//! recomputing it: the prefix cache's half for recurrent layers (the KV
//! blocks are the other half, `prefix.rs`).
//!
//! A snapshot is keyed by the token prefix it summarises
//! ([`SnapshotKey::of`]: its length and two independent 64-bit hashes), and
//! the store keeps them within a byte budget, evicting the least recently
//! used first. A snapshot is only ever copied into a slot, so evicting one
//! never touches a running sequence.

use std::collections::HashMap;

use metrale_core::SlotId;
use metrale_core::scope::ModelResource;
use metrale_gpu_runtime::gpu::{DeviceSlice, GpuBackend};

use super::ssm_pool::SsmStatePool;
use crate::error::{EngineError, Result};

/// Identifies a token prefix: its length and two independent hashes of its
/// tokens (so that two prefixes share a key with probability about 2^-128).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SnapshotKey {
    tokens: usize,
    hashes: (u64, u64),
}

const SEEDS: (u64, u64) = (0x9e37_79b9_7f4a_7c15, 0xc2b2_ae3d_27d4_eb4f);

/// splitmix64's finaliser: every input bit moves every output bit.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl SnapshotKey {
    /// The key of the empty prefix.
    const EMPTY: Self = Self {
        tokens: 0,
        hashes: SEEDS,
    };

    /// The key of this prefix followed by `token`.
    fn then(self, token: u32) -> Self {
        let (a, b) = self.hashes;
        let t = u64::from(token);
        Self {
            tokens: self.tokens + 1,
            hashes: (mix(a ^ t), mix(b.rotate_left(23).wrapping_add(t ^ SEEDS.1))),
        }
    }

    /// The key of the prefix `tokens`.
    pub fn of(tokens: &[u32]) -> Self {
        tokens.iter().fold(Self::EMPTY, |key, &t| key.then(t))
    }

    /// The keys of `tokens[..0]`, `tokens[..1]`, ... `tokens[..]`, in order.
    pub fn prefixes(tokens: &[u32]) -> impl Iterator<Item = Self> + '_ {
        std::iter::once(Self::EMPTY).chain(tokens.iter().scan(Self::EMPTY, |key, &t| {
            *key = key.then(t);
            Some(*key)
        }))
    }

    /// Tokens in the prefix.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
}

struct Snapshot {
    /// Per recurrent layer: conv then SSM state.
    states: Vec<(DeviceSlice, DeviceSlice)>,
    bytes: usize,
    last_used: u64,
}

/// Stored recurrent-state snapshots, each its own device allocations,
/// within a byte budget.
pub struct SsmSnapshots {
    snapshots: HashMap<SnapshotKey, Snapshot>,
    budget: usize,
    bytes: usize,
    clock: u64,
}

impl Default for SsmSnapshots {
    fn default() -> Self {
        Self::with_budget(usize::MAX)
    }
}

impl SsmSnapshots {
    /// A store without a budget.
    pub fn new() -> Self {
        Self::default()
    }

    /// A store that keeps at most `budget` bytes of snapshots.
    pub fn with_budget(budget: usize) -> Self {
        Self {
            snapshots: HashMap::new(),
            budget,
            bytes: 0,
            clock: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.snapshots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.snapshots.is_empty()
    }

    /// Bytes the snapshots hold.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn budget(&self) -> usize {
        self.budget
    }

    pub fn contains(&self, key: SnapshotKey) -> bool {
        self.snapshots.contains_key(&key)
    }

    /// Copies `slot`'s state under `key` (the prefix it has seen), evicting
    /// the least recently used snapshots to stay within the budget. Returns
    /// false, keeping nothing, when one snapshot is larger than the budget;
    /// an existing snapshot of `key` is kept as it is. On failure nothing
    /// is kept.
    pub fn capture(
        &mut self,
        gpu: &dyn GpuBackend,
        pool: &SsmStatePool,
        slot: SlotId,
        key: SnapshotKey,
    ) -> Result<bool> {
        self.clock += 1;
        if let Some(s) = self.snapshots.get_mut(&key) {
            s.last_used = self.clock;
            return Ok(true);
        }
        let bytes = snapshot_bytes(pool, slot)?;
        if bytes > self.budget {
            return Ok(false);
        }
        while self.bytes + bytes > self.budget && self.evict_lru(gpu) {}
        let mut states: Vec<(DeviceSlice, DeviceSlice)> = Vec::with_capacity(pool.layers());
        let result = copy_out(gpu, pool, slot, &mut states);
        if let Err(e) = result {
            let _ = free_states(gpu, &states); // the capture error is the one to report
            return Err(e);
        }
        self.bytes += bytes;
        let last_used = self.clock;
        self.snapshots.insert(
            key,
            Snapshot {
                states,
                bytes,
                last_used,
            },
        );
        Ok(true)
    }

    /// The longest prefix of `keys` (the keys of a token sequence's
    /// prefixes, [`SnapshotKey::prefixes`]) no longer than `max_tokens`
    /// that has a snapshot.
    pub fn longest(&mut self, keys: &[SnapshotKey], max_tokens: usize) -> Option<SnapshotKey> {
        let end = keys.len().min(max_tokens.saturating_add(1));
        let found = keys[..end]
            .iter()
            .rev()
            .find(|k| k.tokens > 0 && self.snapshots.contains_key(k))
            .copied()?;
        self.clock += 1;
        if let Some(s) = self.snapshots.get_mut(&found) {
            s.last_used = self.clock;
        }
        Some(found)
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
        Ok(Some(key.tokens))
    }

    /// Frees one snapshot.
    pub fn remove(&mut self, gpu: &dyn GpuBackend, key: SnapshotKey) -> bool {
        match self.snapshots.remove(&key) {
            Some(s) => {
                self.bytes -= s.bytes;
                let _ = free_states(gpu, &s.states);
                true
            }
            None => false,
        }
    }

    /// Frees the least recently used snapshot; false when there is none.
    fn evict_lru(&mut self, gpu: &dyn GpuBackend) -> bool {
        let oldest = self
            .snapshots
            .iter()
            .min_by_key(|(_, s)| s.last_used)
            .map(|(k, _)| *k);
        oldest.is_some_and(|k| self.remove(gpu, k))
    }
}

/// Bytes of one slot's state, every layer.
fn snapshot_bytes(pool: &SsmStatePool, slot: SlotId) -> Result<usize> {
    let mut bytes = 0;
    for layer in 0..pool.layers() {
        let (conv, ssm) = (pool.conv_state(layer, slot)?, pool.ssm_state(layer, slot)?);
        bytes += conv.len() * conv.dtype().size_of() + ssm.len() * ssm.dtype().size_of();
    }
    Ok(bytes)
}

/// Allocates and fills copies of `slot`'s state, pushing each as it is made
/// (so the caller can free what was made when a later one fails).
fn copy_out(
    gpu: &dyn GpuBackend,
    pool: &SsmStatePool,
    slot: SlotId,
    states: &mut Vec<(DeviceSlice, DeviceSlice)>,
) -> Result<()> {
    for layer in 0..pool.layers() {
        let (conv, ssm) = (pool.conv_state(layer, slot)?, pool.ssm_state(layer, slot)?);
        let c = gpu
            .alloc_slice(conv.dtype(), conv.len(), "ssm snapshots")
            .map_err(EngineError::device("snapshot"))?;
        let s = match gpu.alloc_slice(ssm.dtype(), ssm.len(), "ssm snapshots") {
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
        self.bytes = 0;
        Ok(free_states(gpu, &states)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_names_its_prefix_and_only_it() {
        let tokens = [5, 1, 4, 1, 5, 9];
        let keys: Vec<SnapshotKey> = SnapshotKey::prefixes(&tokens).collect();
        assert_eq!(keys.len(), tokens.len() + 1);
        for (n, key) in keys.iter().enumerate() {
            assert_eq!(*key, SnapshotKey::of(&tokens[..n]));
            assert_eq!(key.tokens(), n);
        }
        // Order, values and length all count.
        assert_ne!(SnapshotKey::of(&[1, 4]), SnapshotKey::of(&[4, 1]));
        assert_ne!(SnapshotKey::of(&[0]), SnapshotKey::of(&[0, 0]));
        assert_ne!(SnapshotKey::of(&[7]).hashes, SnapshotKey::of(&[8]).hashes);
    }
}
