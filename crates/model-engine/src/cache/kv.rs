//! The paged KV cache: fixed-size blocks shared by all attention layers,
//! handed to sequences through block tables, with refcounts and a free list,
//! and (with prefix caching) a tree of cached prefixes whose blocks stay
//! allocated after their sequences end, until memory is needed.
//!
//! Invariants:
//! - A block is free (on the free list, refcount 0) or held: by sequences
//!   (one reference each) and by the prefix tree (one more).
//! - `idle` counts the blocks only the tree holds; they are as good as free
//!   (`free_blocks` counts them) and are evicted, least recently used leaf
//!   first, when a block is wanted and the free list is empty.

use metrale_core::scope::ModelResource;
use metrale_core::{BlockId, DType};
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_gpu_runtime::ops::{KvLayer, KvSpec};

use super::prefix::{BlockTree, Inserted, NodeRef, PrefixMatch};
use crate::error::{EngineError, Result};

/// Default tokens per block.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// K and V storage for every attention layer, in blocks of `block_size` tokens.
/// Block `b` holds the same token range in every layer.
pub struct KvCache {
    block_size: usize,
    num_blocks: usize,
    kv_width: usize,
    /// The element type the backend stores keys and values in.
    dtype: DType,
    layers: Vec<KvLayer>,
    /// Elements of one block in each layer's K (and V) buffer.
    block_elements: usize,
    refcounts: Vec<u32>,
    free: Vec<BlockId>,
    /// Cached prefixes (`None`: prefix caching is off).
    tree: Option<BlockTree>,
    /// Blocks held by the tree alone.
    idle: usize,
}

impl KvCache {
    /// Allocates `num_blocks` blocks for `n_layers` attention layers as the
    /// backend lays out `spec` (`kv_width` = kv heads * head dim elements per
    /// token, in the backend's dtype). On failure nothing stays allocated.
    #[track_caller]
    pub fn allocate(
        gpu: &dyn GpuBackend,
        n_layers: usize,
        spec: KvSpec,
        num_blocks: usize,
    ) -> Result<Self> {
        let (kv_width, block_size) = (spec.kv_width, spec.block_size);
        if block_size == 0 {
            return Err(EngineError::Request(
                "KV block size must be positive".into(),
            ));
        }
        let layout = gpu
            .kv_layout(spec)
            .map_err(EngineError::device("laying out the KV cache"))?;
        let mut cache = Self {
            block_size,
            num_blocks,
            kv_width,
            dtype: layout.dtype,
            layers: Vec::with_capacity(n_layers),
            block_elements: layout.block_elements,
            refcounts: vec![0; num_blocks],
            free: (0..num_blocks as u32).rev().map(BlockId).collect(),
            tree: None,
            idle: 0,
        };
        let elements = num_blocks.saturating_mul(layout.block_elements);
        let dtype = layout.dtype;
        for layer in 0..n_layers {
            let pair = gpu.alloc_slice(dtype, elements, "kv cache").and_then(|k| {
                gpu.alloc_slice(dtype, elements, "kv cache")
                    .map(|v| (k, v))
                    .inspect_err(|_| {
                        let _ = gpu.free(k.ptr());
                    })
            });
            match pair {
                Ok((k, v)) => cache.layers.push(KvLayer { k, v, block_size }),
                Err(source) => {
                    let _ = cache.release(gpu);
                    return Err(EngineError::Device {
                        context: format!("allocating KV cache layer {layer}"),
                        source,
                    });
                }
            }
        }
        Ok(cache)
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Blocks a sequence can take: free ones and those only the prefix
    /// tree holds (evicted on demand).
    pub fn free_blocks(&self) -> usize {
        self.free.len() + self.idle
    }

    /// Blocks held by sequences.
    pub fn used_blocks(&self) -> usize {
        self.num_blocks - self.free_blocks()
    }

    /// Blocks in the prefix tree (some of them also held by sequences).
    pub fn cached_blocks(&self) -> usize {
        self.tree.as_ref().map_or(0, BlockTree::len)
    }

    /// Turns prefix caching on (an empty tree) or off (every cached block
    /// the tree alone held is freed).
    pub fn set_prefix_cache(&mut self, on: bool) {
        match (on, self.tree.is_some()) {
            (true, false) => self.tree = Some(BlockTree::new(self.block_size)),
            (false, true) => {
                while self.evict_one() {}
                if let Some(tree) = self.tree.take() {
                    for b in tree.blocks().collect::<Vec<_>>() {
                        self.release_block(b);
                    }
                }
                self.idle = 0;
            }
            _ => {}
        }
    }

    pub fn prefix_cache_enabled(&self) -> bool {
        self.tree.is_some()
    }

    pub fn kv_width(&self) -> usize {
        self.kv_width
    }

    /// The cache of the `i`-th attention layer (counting attention layers only).
    pub fn layer(&self, i: usize) -> Result<&KvLayer> {
        self.layers
            .get(i)
            .ok_or_else(|| EngineError::Internal(format!("no KV cache for attention layer {i}")))
    }

    /// Takes a block off the free list with refcount 1, evicting the least
    /// recently used cached prefix block nobody else holds if none is free.
    pub fn alloc_block(&mut self) -> Result<BlockId> {
        if self.free.is_empty() {
            self.evict_one();
        }
        let b = self.free.pop().ok_or_else(|| EngineError::Exhausted {
            resource: "KV cache blocks",
            detail: format!(
                "all {} blocks of {} tokens are in use",
                self.num_blocks, self.block_size
            ),
        })?;
        self.refcounts[b.index()] = 1;
        Ok(b)
    }

    /// Shares a block (prefix reuse): one more owner.
    pub fn retain(&mut self, b: BlockId) {
        if self.refcounts[b.index()] == 1 && self.is_cached(b) {
            self.idle -= 1;
        }
        self.refcounts[b.index()] += 1;
    }

    /// Drops one owner; the block returns to the free list at zero.
    pub fn release_block(&mut self, b: BlockId) {
        let rc = &mut self.refcounts[b.index()];
        debug_assert!(*rc > 0, "{b} released more often than allocated");
        *rc = rc.saturating_sub(1);
        let rc = *rc;
        match rc {
            0 => self.free.push(b),
            1 if self.is_cached(b) => self.idle += 1,
            _ => {}
        }
    }

    fn is_cached(&self, b: BlockId) -> bool {
        self.tree.as_ref().is_some_and(|t| t.contains_block(b))
    }

    /// Frees the least recently used cached leaf block that only the tree
    /// holds; false when there is none.
    fn evict_one(&mut self) -> bool {
        let refcounts = &self.refcounts;
        let Some(tree) = self.tree.as_mut() else {
            return false;
        };
        let Some(b) = tree.lru_leaf(|b| refcounts[b.index()] == 1) else {
            return false;
        };
        tree.remove_leaf(b);
        self.idle -= 1;
        self.refcounts[b.index()] = 0;
        self.free.push(b);
        true
    }

    /// The longest cached prefix of `tokens` (nothing when caching is off).
    pub fn lookup(&mut self, tokens: &[u32]) -> PrefixMatch {
        self.tree
            .as_mut()
            .map_or_else(PrefixMatch::default, |t| t.lookup(tokens))
    }

    /// Indexes `block`, holding `tokens`, under `parent` in the prefix tree,
    /// taking one reference on it for the tree when it is added.
    pub fn cache_block(
        &mut self,
        parent: Option<NodeRef>,
        tokens: &[u32],
        block: BlockId,
    ) -> Inserted {
        debug_assert!(
            self.refcounts[block.index()] > 0,
            "{block} is cached while free"
        );
        let Some(tree) = self.tree.as_mut() else {
            return Inserted::StaleParent;
        };
        let inserted = tree.insert(parent, tokens, block);
        if let Inserted::Added(_) = inserted {
            // The tree's own reference; `retain` sees the block as cached.
            self.refcounts[block.index()] += 1;
            if self.refcounts[block.index()] == 1 {
                self.idle += 1;
            }
        }
        inserted
    }

    /// Copies block `src`'s keys and values, in every layer, into `dst`.
    pub fn copy_block(&self, gpu: &dyn GpuBackend, src: BlockId, dst: BlockId) -> Result<()> {
        let n = self.block_elements;
        for layer in &self.layers {
            for buf in [layer.k, layer.v] {
                let from = buf.slice(src.index() * n, n);
                let to = buf.slice(dst.index() * n, n);
                from.and_then(|f| to.and_then(|t| gpu.copy_slice(f, t)))
                    .map_err(EngineError::device("copying a cached KV block"))?;
            }
        }
        Ok(())
    }

    pub fn refcount(&self, b: BlockId) -> u32 {
        self.refcounts[b.index()]
    }

    /// Bytes one token occupies across all layers.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.kv_width * self.dtype.size_of() * self.layers.len()
    }

    /// The element type keys and values are stored in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
}

impl<'g> ModelResource<dyn GpuBackend + 'g> for KvCache {
    fn label(&self) -> &str {
        "kv cache"
    }

    fn release(&mut self, gpu: &(dyn GpuBackend + 'g)) -> anyhow::Result<()> {
        let freed = gpu.free_all(self.layers.drain(..).flat_map(|l| [l.k.ptr(), l.v.ptr()]));
        self.free.clear();
        self.refcounts.iter_mut().for_each(|r| *r = 0);
        if let Some(tree) = self.tree.as_mut() {
            tree.clear();
        }
        self.idle = 0;
        Ok(freed?)
    }
}

/// A sequence's block table and how many tokens it has cached.
#[derive(Default, Debug)]
pub struct SeqBlocks {
    blocks: Vec<BlockId>,
    len: usize,
}

impl SeqBlocks {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Tokens cached.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Makes room for `new_len` tokens, allocating blocks as needed. On
    /// failure the blocks taken by this call are returned.
    pub fn reserve(&mut self, cache: &mut KvCache, new_len: usize) -> Result<()> {
        let needed = new_len.div_ceil(cache.block_size());
        let before = self.blocks.len();
        while self.blocks.len() < needed {
            match cache.alloc_block() {
                Ok(b) => self.blocks.push(b),
                Err(e) => {
                    for b in self.blocks.drain(before..) {
                        cache.release_block(b);
                    }
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Appends a block the caller has taken a reference on for this
    /// sequence (a shared cached block, or a copy of one).
    pub fn push(&mut self, b: BlockId) {
        self.blocks.push(b);
    }

    /// Puts `b` (referenced for this sequence by the caller) in place of
    /// block `i`, returning the block it replaces (whose reference the
    /// caller drops).
    pub fn replace(&mut self, i: usize, b: BlockId) -> Option<BlockId> {
        self.blocks
            .get_mut(i)
            .map(|slot| std::mem::replace(slot, b))
    }

    /// Records that tokens up to `new_len` are now cached.
    pub fn set_len(&mut self, new_len: usize) {
        self.len = new_len;
    }

    /// Cache slot (block * block_size + offset) of token position `pos`.
    pub fn slot(&self, pos: usize, block_size: usize) -> Option<u32> {
        self.blocks
            .get(pos / block_size)
            .map(|b| (b.index() * block_size + pos % block_size) as u32)
    }

    /// Returns every block to the cache.
    pub fn free(&mut self, cache: &mut KvCache) {
        for b in self.blocks.drain(..) {
            cache.release_block(b);
        }
        self.len = 0;
    }
}

#[cfg(test)]
mod tests {
    use metrale_gpu_runtime::cpu::CpuBackend;

    use super::*;

    fn cache(gpu: &CpuBackend, blocks: usize) -> KvCache {
        let spec = KvSpec {
            kv_width: 2,
            block_size: 2,
            dtype: None,
        };
        let mut kv = KvCache::allocate(gpu, 1, spec, blocks).unwrap();
        kv.set_prefix_cache(true);
        kv
    }

    #[test]
    fn cached_blocks_are_free_to_take_and_evicted_least_recently_used_first() {
        let gpu = CpuBackend::new();
        let mut kv = cache(&gpu, 3);
        let (a, b) = (kv.alloc_block().unwrap(), kv.alloc_block().unwrap());
        let Inserted::Added(na) = kv.cache_block(None, &[1, 2], a) else {
            panic!()
        };
        kv.cache_block(Some(na), &[3, 4], b);
        let tail = kv.alloc_block().unwrap();
        kv.cache_block(None, &[9], tail);
        // The sequences holding them end; the tree keeps them.
        for blk in [a, b, tail] {
            kv.release_block(blk);
        }
        assert_eq!(
            (kv.used_blocks(), kv.free_blocks(), kv.cached_blocks()),
            (0, 3, 3)
        );
        // A lookup of [1,2,3] shares a and copies b's first token's block.
        let found = kv.lookup(&[1, 2, 3]);
        assert_eq!(found.tokens, 3);
        kv.retain(a);
        assert_eq!(kv.used_blocks(), 1);
        // None is free: the tail (not used since it was cached) goes
        // first, then b (a leaf under the held a); a is held and stays.
        let first = kv.alloc_block().unwrap();
        let second = kv.alloc_block().unwrap();
        assert_eq!([first, second], [tail, b]);
        assert!(
            kv.alloc_block().is_err(),
            "a held cached block is not taken"
        );
        assert_eq!(kv.cached_blocks(), 1);
        kv.release_block(a);
        kv.set_prefix_cache(false);
        assert_eq!((kv.cached_blocks(), kv.used_blocks()), (0, 2));
        kv.release(&gpu).unwrap();
    }

    #[test]
    fn a_copied_block_holds_the_same_keys_and_values() {
        let gpu = CpuBackend::new();
        let kv = cache(&gpu, 2);
        let layer = kv.layer(0).unwrap();
        let n = layer.k.len() / 2;
        let values: Vec<f32> = (0..n).map(|i| i as f32 + 0.5).collect();
        let g: &dyn GpuBackend = &gpu;
        g.upload_f32(&values, layer.k.slice(0, n).unwrap()).unwrap();
        g.upload_f32(&values, layer.v.slice(0, n).unwrap()).unwrap();
        kv.copy_block(&gpu, BlockId(0), BlockId(1)).unwrap();
        assert_eq!(
            g.download_f32(layer.k.slice(n, n).unwrap()).unwrap(),
            values
        );
        assert_eq!(
            g.download_f32(layer.v.slice(n, n).unwrap()).unwrap(),
            values
        );
        let mut kv = kv;
        kv.release(&gpu).unwrap();
    }
}
