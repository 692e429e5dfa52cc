//! Prefix caching on a model: a new sequence starts from the longest
//! cached prefix of its tokens instead of position 0.
//!
//! Attention layers reuse KV blocks from the prefix tree (`cache/prefix.rs`):
//! whole blocks are shared, the block the reuse ends in is copied (copy on
//! write), so reuse can end at any token. Recurrent layers cannot rewind, so
//! a hybrid or recurrent model reuses up to the longest prefix that has a
//! state snapshot (`cache/snapshots.rs`) and that the KV blocks cover; the
//! tokens between that snapshot and the end of the KV match are recomputed.
//! Sequences are snapshotted at multiples of
//! [`PrefixCacheOptions::snapshot_interval`] (during prefill, at the last
//! such point of each step, where the scheduler ends the step's chunk: one
//! cut per step, not one per interval, since smaller steps cost more per
//! token), at the end of every finished request, and where a request's
//! match ended (so the next request sharing that prefix recomputes
//! nothing).
//!
//! The engine drives it: [`TransformerModel::reuse_prefix`] when it starts a
//! sequence, [`TransformerModel::cache_prefix`] after every step (full
//! blocks join the tree as soon as they are computed, so concurrent requests
//! share them), [`TransformerModel::snapshot_prefix`] at snapshot points,
//! and [`TransformerModel::finish_prefix`] when a request finishes.

use metrale_gpu_runtime::gpu::GpuBackend;

use super::forward::Sequence;
use super::types::TransformerModel;
use crate::cache::{Inserted, KvCache, NodeRef, PrefixMatch, SnapshotKey};
use crate::error::Result;

/// The default of [`PrefixCacheOptions::snapshot_interval`]. A prefill
/// step of up to 512 tokens ends at its last multiple of 128, so a prompt
/// leaves a snapshot within 128 tokens of its end and one every step
/// before; each snapshot of Granite-4.0-H-350M is about 22 MB. Measured
/// (docs/SERVER.md, 2 threads): a 1,000-token shared prefix's first
/// hit comes 6.0x sooner than its miss on that shape (4.8x on a
/// Qwen3-Next-400M shape, whose MoE layers make the recomputed short step
/// dearer), later hits 19-25x; a miss costs 0-8% more than without
/// snapshots (one more step). 64 would cut two steps per prefill step.
pub const DEFAULT_SNAPSHOT_INTERVAL: usize = 128;

/// How the model caches prefixes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixCacheOptions {
    /// Reuse cached prefixes (on by default).
    pub enabled: bool,
    /// Recurrent-state snapshots are taken at multiples of this position:
    /// every one during decode, the last one within each prefill step; 0:
    /// only at the end of a request and at match ends.
    pub snapshot_interval: usize,
    /// Most bytes of snapshots kept; `None`: twice the SSM state pool (as
    /// many snapshots as twice `max_seqs` sequences hold).
    pub snapshot_budget: Option<usize>,
}

impl Default for PrefixCacheOptions {
    fn default() -> Self {
        Self {
            enabled: true,
            snapshot_interval: DEFAULT_SNAPSHOT_INTERVAL,
            snapshot_budget: None,
        }
    }
}

impl PrefixCacheOptions {
    /// Prefix caching off.
    pub fn disabled() -> Self {
        Self {
            enabled: false,
            ..Self::default()
        }
    }
}

/// What [`TransformerModel::reuse_prefix`] found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixHit {
    /// Tokens the sequence starts with (their KV blocks and state reused).
    pub tokens: usize,
    /// Tokens of the prompt the KV cache matched (at least `tokens`; more
    /// where a recurrent model's nearest snapshot lies before the match
    /// end, and the tokens between are recomputed).
    pub matched: usize,
}

/// A reusable prefix: its blocks, its snapshot, how much it saves.
struct Found {
    blocks: PrefixMatch,
    snapshot: Option<SnapshotKey>,
    hit: PrefixHit,
}

/// How far a sequence's block table is indexed by the prefix tree.
#[derive(Clone, Copy, Debug, Default)]
pub struct PrefixCursor {
    /// Leading blocks of the table that are tree nodes.
    blocks: usize,
    /// The node of the last of them.
    node: Option<NodeRef>,
    /// The sequence's path was evicted under it (only possible after a
    /// failure): it indexes no more blocks.
    detached: bool,
}

impl TransformerModel {
    /// Whether prefix caching is on.
    pub fn prefix_cache_enabled(&self) -> bool {
        self.options.prefix_cache.enabled
    }

    fn caches_kv(&self) -> bool {
        self.prefix_cache_enabled() && self.config.attention_layers().next().is_some()
    }

    /// Whether recurrent state is snapshotted for reuse (prefix caching on,
    /// a model with recurrent layers).
    pub fn caches_state(&self) -> bool {
        self.prefix_cache_enabled() && self.ssm_pool.layers() > 0
    }

    /// Whether a recurrent sequence at `pos` tokens is due a snapshot by
    /// the interval.
    pub fn snapshot_due(&self, pos: usize) -> bool {
        let every = self.options.prefix_cache.snapshot_interval;
        self.caches_state() && every > 0 && pos > 0 && pos.is_multiple_of(every)
    }

    /// The last position in `pos + 1..=end` due a snapshot by the interval,
    /// if any: where a chunk from `pos` to `end` is cut, so that it ends
    /// there. One cut per chunk at most (the last point before its end),
    /// not one per interval: a step of fewer tokens costs more per token
    /// (the weights are read once a step; a MoE layer's experts get fewer
    /// rows each).
    pub fn last_snapshot_point(&self, pos: usize, end: usize) -> Option<usize> {
        let every = self.options.prefix_cache.snapshot_interval;
        if !self.caches_state() || every == 0 {
            return None;
        }
        let last = end / every * every;
        (last > pos).then_some(last)
    }

    /// Starts the fresh sequence `seq` (position 0) from the longest cached
    /// prefix of `tokens` (its prompt), leaving at least the last token to
    /// compute. A failure to reuse is no failure of the request: it is
    /// logged and the sequence starts from 0, unless putting it back fails.
    pub fn reuse_prefix(&mut self, seq: &mut Sequence, tokens: &[u32]) -> Result<PrefixHit> {
        if seq.pos != 0 {
            return Ok(PrefixHit::default());
        }
        let Some(found) = self.find_prefix(tokens) else {
            return Ok(PrefixHit::default());
        };
        let hit = found.hit;
        if hit.tokens == 0 {
            return Ok(hit);
        }
        match self.start_from(seq, &found.blocks, hit.tokens, found.snapshot) {
            Ok(()) => Ok(hit),
            Err(e) => {
                tracing::warn!(
                    "reusing a cached prefix of {} tokens failed ({e}); computing it",
                    hit.tokens
                );
                self.reset_sequence(seq)?;
                Ok(PrefixHit { tokens: 0, ..hit })
            }
        }
    }

    /// How many tokens of `tokens` a new sequence would start with (what
    /// [`reuse_prefix`](Self::reuse_prefix) will reuse, barring failures),
    /// without taking anything: for admission to budget the rest.
    pub fn probe_prefix(&mut self, tokens: &[u32]) -> usize {
        self.find_prefix(tokens).map_or(0, |f| f.hit.tokens)
    }

    /// The longest reusable prefix of `tokens`; `None` when caching is off
    /// or there is nothing to reuse (a prompt of one token).
    fn find_prefix(&mut self, tokens: &[u32]) -> Option<Found> {
        if !self.prefix_cache_enabled() || tokens.len() < 2 {
            return None;
        }
        let limit = tokens.len() - 1;
        let blocks = if self.caches_kv() {
            self.kv_cache.lock().lookup(&tokens[..limit])
        } else {
            PrefixMatch::default()
        };
        // Without attention layers only snapshots say what is cached.
        let reach = if self.caches_kv() {
            blocks.tokens
        } else {
            limit
        };
        let (reuse, snapshot) = if self.caches_state() {
            let keys: Vec<SnapshotKey> = SnapshotKey::prefixes(&tokens[..reach]).collect();
            match self.ssm_snapshots.longest(&keys, reach) {
                Some(key) => (key.tokens(), Some(key)),
                None => (0, None),
            }
        } else {
            (reach, None)
        };
        let matched = if self.caches_kv() { reach } else { reuse };
        Some(Found {
            blocks,
            snapshot,
            hit: PrefixHit {
                tokens: reuse,
                matched,
            },
        })
    }

    /// Gives `seq` the KV blocks of `found`'s first `reuse` tokens and the
    /// snapshot's state.
    fn start_from(
        &self,
        seq: &mut Sequence,
        found: &PrefixMatch,
        reuse: usize,
        snapshot: Option<SnapshotKey>,
    ) -> Result<()> {
        if self.caches_kv() {
            share_blocks(&mut self.kv_cache.lock(), self.gpu(), seq, found, reuse)?;
        }
        if let (Some(key), Some(slot)) = (snapshot, &seq.slot) {
            self.ssm_snapshots
                .restore(self.gpu(), &self.ssm_pool, slot.slot(), key)?;
        }
        seq.pos = reuse;
        seq.kv.set_len(reuse);
        Ok(())
    }

    /// Puts a sequence whose reuse failed back to position 0.
    fn reset_sequence(&self, seq: &mut Sequence) -> Result<()> {
        seq.kv.free(&mut self.kv_cache.lock());
        seq.prefix = PrefixCursor::default();
        seq.pos = 0;
        if let Some(slot) = &seq.slot {
            for layer in 0..self.ssm_pool.layers() {
                let conv = self.ssm_pool.conv_state(layer, slot.slot())?;
                let ssm = self.ssm_pool.ssm_state(layer, slot.slot())?;
                self.gpu()
                    .zero(conv)
                    .and_then(|_| self.gpu().zero(ssm))
                    .map_err(crate::error::EngineError::device("clearing a slot"))?;
            }
        }
        Ok(())
    }

    /// Indexes the blocks `seq` has filled since the last call (its first
    /// `seq.position()` tokens are `tokens[..position]`). A block whose
    /// prefix is already cached under another block is swapped for that
    /// one, and its own is freed.
    pub fn cache_prefix(&self, seq: &mut Sequence, tokens: &[u32]) {
        if !self.caches_kv() || seq.prefix.detached {
            return;
        }
        let mut kv = self.kv_cache.lock();
        let bs = kv.block_size();
        let full = seq.pos.min(tokens.len()) / bs;
        while seq.prefix.blocks < full {
            let i = seq.prefix.blocks;
            let Some(&block) = seq.kv.blocks().get(i) else {
                return;
            };
            let node = match kv.cache_block(seq.prefix.node, &tokens[i * bs..(i + 1) * bs], block) {
                Inserted::Added(node) => node,
                Inserted::Existing(node, other) => {
                    if other != block {
                        kv.retain(other);
                        seq.kv.replace(i, other);
                        kv.release_block(block);
                    }
                    node
                }
                Inserted::StaleParent => {
                    seq.prefix.detached = true;
                    return;
                }
            };
            seq.prefix.blocks += 1;
            seq.prefix.node = Some(node);
        }
    }

    /// Snapshots `seq`'s recurrent state under the prefix it has seen
    /// (`tokens[..position]`). Returns whether a snapshot of it is kept; a
    /// failure (out of memory, say) only costs the cache, so it is logged.
    pub fn snapshot_prefix(&mut self, seq: &Sequence, tokens: &[u32]) -> bool {
        let Some(slot) = &seq.slot else { return false };
        if !self.caches_state() || seq.pos == 0 || seq.pos > tokens.len() {
            return false;
        }
        let key = SnapshotKey::of(&tokens[..seq.pos]);
        let pool = self.ssm_pool.clone();
        match self
            .ssm_snapshots
            .capture(self.gpu.as_ref(), &pool, slot.slot(), key)
        {
            Ok(kept) => kept,
            Err(e) => {
                tracing::warn!("snapshot after {} tokens failed: {e}", seq.pos);
                false
            }
        }
    }

    /// Caches what a finished request computed: its full blocks, its last
    /// partly filled block, and (recurrent models) its final state, so that
    /// a request continuing it (the next turn of a chat) recomputes nothing.
    pub fn finish_prefix(&mut self, seq: &mut Sequence, tokens: &[u32]) {
        self.cache_prefix(seq, tokens);
        if self.caches_kv() && !seq.prefix.detached {
            let mut kv = self.kv_cache.lock();
            let bs = kv.block_size();
            let (full, pos) = (seq.pos / bs, seq.pos.min(tokens.len()));
            if pos > full * bs
                && let Some(&block) = seq.kv.blocks().get(full)
            {
                kv.cache_block(seq.prefix.node, &tokens[full * bs..pos], block);
            }
        }
        self.snapshot_prefix(seq, tokens);
    }

    /// Cached KV blocks, snapshots and their bytes.
    pub fn prefix_cache_usage(&self) -> PrefixCacheUsage {
        PrefixCacheUsage {
            cached_blocks: self.kv_cache.lock().cached_blocks(),
            snapshots: self.ssm_snapshots.len(),
            snapshot_bytes: self.ssm_snapshots.bytes(),
        }
    }
}

/// How much the prefix cache holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCacheUsage {
    /// KV blocks in the prefix tree (some also held by running sequences).
    pub cached_blocks: usize,
    pub snapshots: usize,
    pub snapshot_bytes: usize,
}

/// Shares `found`'s blocks for the first `reuse` tokens with `seq`: whole
/// blocks as they are, the block `reuse` ends in as a private copy.
fn share_blocks(
    kv: &mut KvCache,
    gpu: &dyn GpuBackend,
    seq: &mut Sequence,
    found: &PrefixMatch,
    reuse: usize,
) -> Result<()> {
    let bs = kv.block_size();
    let full = reuse / bs;
    for &(_, block) in &found.path[..full] {
        kv.retain(block);
        seq.kv.push(block);
    }
    seq.prefix.blocks = full;
    seq.prefix.node = full.checked_sub(1).map(|i| found.path[i].0);
    if reuse % bs != 0 {
        let src = found.path[full].1;
        // Held through the copy, so that allocating cannot evict it.
        kv.retain(src);
        let copy = kv
            .alloc_block()
            .and_then(|dst| match kv.copy_block(gpu, src, dst) {
                Ok(()) => Ok(dst),
                Err(e) => {
                    kv.release_block(dst);
                    Err(e)
                }
            });
        kv.release_block(src);
        seq.kv.push(copy?);
    }
    Ok(())
}
