//! The engine's live counts, readable from any thread while the engine runs
//! on another (a server's `/metrics`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A handle on an engine's gauges ([`Engine::gauges`](super::Engine::gauges)).
/// The engine updates them whenever a request joins or leaves and after
/// every step; cloning the handle shares them.
#[derive(Clone, Debug, Default)]
pub struct EngineGauges(Arc<Cells>);

#[derive(Debug, Default)]
struct Cells {
    running: AtomicUsize,
    waiting: AtomicUsize,
    kv_blocks_in_use: AtomicUsize,
    kv_blocks_total: AtomicUsize,
    ssm_slots_in_use: AtomicUsize,
    ssm_slots_total: AtomicUsize,
    kv_blocks_cached: AtomicUsize,
    snapshot_bytes: AtomicUsize,
    prefix_hit_tokens: AtomicUsize,
    prefix_recomputed_tokens: AtomicUsize,
}

/// The gauges' values at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GaugeValues {
    /// Requests holding a sequence (prefilling or decoding).
    pub running: usize,
    /// Requests queued for memory.
    pub waiting: usize,
    /// KV cache blocks owned by sequences.
    pub kv_blocks_in_use: usize,
    /// KV cache blocks in all (0 for a model without attention layers).
    pub kv_blocks_total: usize,
    /// SSM state slots owned by sequences.
    pub ssm_slots_in_use: usize,
    /// SSM state slots in all (0 for a model without recurrent layers).
    pub ssm_slots_total: usize,
    /// KV cache blocks in the prefix cache (some also owned by sequences;
    /// those only the cache holds are free to take).
    pub kv_blocks_cached: usize,
    /// Bytes of recurrent-state snapshots the prefix cache holds.
    pub snapshot_bytes: usize,
    /// Prompt tokens whose computation a cached prefix saved, since start.
    pub prefix_hit_tokens: usize,
    /// Prompt tokens the KV cache matched but that were recomputed because
    /// the nearest state snapshot lay before them, since start.
    pub prefix_recomputed_tokens: usize,
}

impl EngineGauges {
    /// The current values. Each is exact as of the engine's last update;
    /// they are stored one by one, so a reader racing an update may see
    /// some fields before it and some after.
    pub fn read(&self) -> GaugeValues {
        let c = &self.0;
        GaugeValues {
            running: c.running.load(Ordering::Acquire),
            waiting: c.waiting.load(Ordering::Acquire),
            kv_blocks_in_use: c.kv_blocks_in_use.load(Ordering::Acquire),
            kv_blocks_total: c.kv_blocks_total.load(Ordering::Acquire),
            ssm_slots_in_use: c.ssm_slots_in_use.load(Ordering::Acquire),
            ssm_slots_total: c.ssm_slots_total.load(Ordering::Acquire),
            kv_blocks_cached: c.kv_blocks_cached.load(Ordering::Acquire),
            snapshot_bytes: c.snapshot_bytes.load(Ordering::Acquire),
            prefix_hit_tokens: c.prefix_hit_tokens.load(Ordering::Acquire),
            prefix_recomputed_tokens: c.prefix_recomputed_tokens.load(Ordering::Acquire),
        }
    }

    pub(super) fn store(&self, v: GaugeValues) {
        let c = &self.0;
        c.running.store(v.running, Ordering::Release);
        c.waiting.store(v.waiting, Ordering::Release);
        c.kv_blocks_in_use
            .store(v.kv_blocks_in_use, Ordering::Release);
        c.kv_blocks_total
            .store(v.kv_blocks_total, Ordering::Release);
        c.ssm_slots_in_use
            .store(v.ssm_slots_in_use, Ordering::Release);
        c.ssm_slots_total
            .store(v.ssm_slots_total, Ordering::Release);
        c.kv_blocks_cached
            .store(v.kv_blocks_cached, Ordering::Release);
        c.snapshot_bytes.store(v.snapshot_bytes, Ordering::Release);
        c.prefix_hit_tokens
            .store(v.prefix_hit_tokens, Ordering::Release);
        c.prefix_recomputed_tokens
            .store(v.prefix_recomputed_tokens, Ordering::Release);
    }
}
