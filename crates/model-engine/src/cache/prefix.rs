//! The prefix cache's radix tree over KV blocks: each node is one block of
//! the paged KV cache and the tokens it holds, under the node of the block
//! before it, so a path from a root spells a token prefix and lists the
//! blocks whose keys and values were computed for exactly that prefix.
//!
//! Full nodes hold `block_size` tokens and may have children; a tail node
//! (the last, partly filled block of a finished request) holds fewer and is
//! always a leaf. A sequence may share full blocks as they are (nobody
//! writes a full block again), but must copy a tail block before writing
//! into it (copy on write, `KvCache::copy_block`).
//!
//! The tree only indexes blocks; who owns them is the KV cache's refcount
//! (`KvCache`): the tree holds one reference on each of its blocks. Nodes
//! are evicted leaf first, least recently used first, and only when no
//! sequence holds their block (`KvCache::evict_one`). A sequence holds every
//! block of its path (it shares or owns them all), so a node on a running
//! sequence's path is never evicted.
//!
//! Invariants:
//! - A node's tokens are `block_size` long unless it is a leaf.
//! - Siblings never hold the same tokens.
//! - A block is in the tree at most once (`by_block`).

use std::collections::HashMap;

use metrale_core::BlockId;

/// A node of the tree, valid until the node is evicted (a stale reference
/// is detected by its generation, never confused with a later node).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeRef {
    index: u32,
    generation: u32,
}

struct Node {
    parent: Option<u32>,
    tokens: Box<[u32]>,
    block: BlockId,
    children: Vec<u32>,
    last_used: u64,
}

/// What the tree holds for a token prefix.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// The matched path's nodes and blocks, root first; every block but the
    /// last is matched in full.
    pub path: Vec<(NodeRef, BlockId)>,
    /// Tokens matched: the last block's share is `tokens - (path.len() - 1)
    /// * block_size`.
    pub tokens: usize,
}

/// What [`BlockTree::insert`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Inserted {
    /// A new node holds the block (the caller gives the tree one reference).
    Added(NodeRef),
    /// A node for these tokens already exists, holding this block (the same
    /// as the one offered, or another one with the same contents).
    Existing(NodeRef, BlockId),
    /// The parent was evicted since it was handed out; nothing was done.
    StaleParent,
}

/// The radix tree of cached prefixes, one block per node.
pub struct BlockTree {
    block_size: usize,
    nodes: Vec<Option<Node>>,
    generations: Vec<u32>,
    free_nodes: Vec<u32>,
    roots: Vec<u32>,
    by_block: HashMap<BlockId, u32>,
    clock: u64,
}

impl BlockTree {
    pub fn new(block_size: usize) -> Self {
        Self {
            block_size: block_size.max(1),
            nodes: Vec::new(),
            generations: Vec::new(),
            free_nodes: Vec::new(),
            roots: Vec::new(),
            by_block: HashMap::new(),
            clock: 0,
        }
    }

    /// Blocks (nodes) in the tree.
    pub fn len(&self) -> usize {
        self.by_block.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_block.is_empty()
    }

    pub fn contains_block(&self, block: BlockId) -> bool {
        self.by_block.contains_key(&block)
    }

    fn node(&self, index: u32) -> &Node {
        self.nodes[index as usize]
            .as_ref()
            .expect("tree links point at live nodes")
    }

    fn reference(&self, index: u32) -> NodeRef {
        NodeRef {
            index,
            generation: self.generations[index as usize],
        }
    }

    /// The node `r` points at, if it was not evicted since.
    fn resolve(&self, r: NodeRef) -> Option<u32> {
        let live = self.generations.get(r.index as usize) == Some(&r.generation)
            && self.nodes[r.index as usize].is_some();
        live.then_some(r.index)
    }

    fn children(&self, parent: Option<u32>) -> &[u32] {
        match parent {
            None => &self.roots,
            Some(p) => &self.node(p).children,
        }
    }

    /// The longest cached prefix of `tokens`, marking its nodes as used.
    pub fn lookup(&mut self, tokens: &[u32]) -> PrefixMatch {
        self.clock += 1;
        let mut found = PrefixMatch::default();
        let mut parent = None;
        for chunk in tokens.chunks(self.block_size) {
            let mut best: Option<(u32, usize)> = None;
            for &c in self.children(parent) {
                let held = &self.node(c).tokens;
                let common = held.iter().zip(chunk).take_while(|(a, b)| a == b).count();
                if common > best.map_or(0, |b| b.1) {
                    best = Some((c, common));
                }
            }
            let Some((child, common)) = best else { break };
            let reference = self.reference(child);
            let node = self.nodes[child as usize].as_mut().expect("live child");
            node.last_used = self.clock;
            found.path.push((reference, node.block));
            found.tokens += common;
            if common < self.block_size {
                break;
            }
            parent = Some(child);
        }
        found
    }

    /// Adds `block`, holding `tokens` (at most a block), under `parent`
    /// (`None`: a first block). A tail (fewer tokens than a block) already
    /// covered by a sibling is reported as that sibling.
    pub fn insert(&mut self, parent: Option<NodeRef>, tokens: &[u32], block: BlockId) -> Inserted {
        debug_assert!(!tokens.is_empty() && tokens.len() <= self.block_size);
        let parent = match parent {
            None => None,
            Some(r) => match self.resolve(r) {
                Some(p) if self.node(p).tokens.len() == self.block_size => Some(p),
                _ => return Inserted::StaleParent,
            },
        };
        self.clock += 1;
        let clock = self.clock;
        for &c in self.children(parent) {
            let held = &self.node(c).tokens;
            if held.starts_with(tokens) {
                let reference = self.reference(c);
                let node = self.nodes[c as usize].as_mut().expect("live child");
                node.last_used = clock;
                return Inserted::Existing(reference, node.block);
            }
        }
        if self.by_block.contains_key(&block) {
            // The block is already indexed elsewhere: a caller's bug, but
            // not one to corrupt the tree over.
            return Inserted::StaleParent;
        }
        let node = Node {
            parent,
            tokens: tokens.into(),
            block,
            children: Vec::new(),
            last_used: clock,
        };
        let index = match self.free_nodes.pop() {
            Some(i) => {
                self.nodes[i as usize] = Some(node);
                i
            }
            None => {
                self.nodes.push(Some(node));
                self.generations.push(0);
                (self.nodes.len() - 1) as u32
            }
        };
        match parent {
            None => self.roots.push(index),
            Some(p) => self.nodes[p as usize]
                .as_mut()
                .expect("live parent")
                .children
                .push(index),
        }
        self.by_block.insert(block, index);
        Inserted::Added(self.reference(index))
    }

    /// The least recently used leaf whose block `evictable` accepts.
    pub fn lru_leaf(&self, evictable: impl Fn(BlockId) -> bool) -> Option<BlockId> {
        self.nodes
            .iter()
            .flatten()
            .filter(|n| n.children.is_empty() && evictable(n.block))
            .min_by_key(|n| n.last_used)
            .map(|n| n.block)
    }

    /// Removes the leaf holding `block`; false if it is not a leaf here.
    pub fn remove_leaf(&mut self, block: BlockId) -> bool {
        let Some(&index) = self.by_block.get(&block) else {
            return false;
        };
        if !self.node(index).children.is_empty() {
            return false;
        }
        let node = self.nodes[index as usize].take().expect("indexed node");
        let siblings = match node.parent {
            None => &mut self.roots,
            Some(p) => {
                &mut self.nodes[p as usize]
                    .as_mut()
                    .expect("live parent")
                    .children
            }
        };
        siblings.retain(|&c| c != index);
        self.by_block.remove(&block);
        self.generations[index as usize] = self.generations[index as usize].wrapping_add(1);
        self.free_nodes.push(index);
        true
    }

    /// Every block in the tree.
    pub fn blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.by_block.keys().copied()
    }

    /// Forgets every node (the blocks' memory is the cache's to free).
    pub fn clear(&mut self) {
        for g in &mut self.generations {
            *g = g.wrapping_add(1);
        }
        self.free_nodes = (0..self.nodes.len() as u32).rev().collect();
        self.nodes.iter_mut().for_each(|n| *n = None);
        self.roots.clear();
        self.by_block.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(i: u32) -> BlockId {
        BlockId(i)
    }

    /// Inserts `tokens` as consecutive blocks 0.., returning the last node.
    fn chain(tree: &mut BlockTree, tokens: &[u32], first_block: u32) -> Option<NodeRef> {
        let mut parent = None;
        for (i, chunk) in tokens.chunks(tree.block_size).enumerate() {
            match tree.insert(parent, chunk, b(first_block + i as u32)) {
                Inserted::Added(n) | Inserted::Existing(n, _) => parent = Some(n),
                Inserted::StaleParent => panic!("stale"),
            }
        }
        parent
    }

    #[test]
    fn lookup_matches_whole_blocks_then_a_partial_one() {
        let mut tree = BlockTree::new(4);
        chain(&mut tree, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0);
        assert_eq!(tree.len(), 3);
        let m = tree.lookup(&[1, 2, 3, 4, 5, 6, 0, 0]);
        assert_eq!(m.tokens, 6);
        assert_eq!(m.path.iter().map(|p| p.1).collect::<Vec<_>>(), [b(0), b(1)]);
        let m = tree.lookup(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]);
        assert_eq!(m.tokens, 10);
        assert_eq!(m.path.len(), 3);
        assert_eq!(tree.lookup(&[2, 2]).tokens, 0);
        assert!(tree.lookup(&[]).path.is_empty());
    }

    #[test]
    fn siblings_branch_and_the_longer_match_wins() {
        let mut tree = BlockTree::new(2);
        chain(&mut tree, &[1, 2, 3, 4], 0);
        chain(&mut tree, &[1, 2, 3, 5], 10);
        // [1,2] is shared: the second chain's first block found the first's.
        assert_eq!(tree.len(), 3);
        let m = tree.lookup(&[1, 2, 3, 5, 9]);
        assert_eq!(m.tokens, 4);
        assert_eq!(m.path[1].1, b(11));
    }

    #[test]
    fn a_tail_covered_by_a_sibling_is_that_sibling() {
        let mut tree = BlockTree::new(4);
        chain(&mut tree, &[1, 2, 3, 4], 0);
        assert_eq!(
            tree.insert(None, &[1, 2], b(5)),
            Inserted::Existing(tree.reference(0), b(0))
        );
        // A tail under a tail is refused: only full nodes have children.
        let tail = match tree.insert(None, &[7], b(6)) {
            Inserted::Added(n) => n,
            other => panic!("{other:?}"),
        };
        assert_eq!(tree.insert(Some(tail), &[8], b(7)), Inserted::StaleParent);
    }

    #[test]
    fn leaves_go_least_recently_used_first_and_stale_refs_are_refused() {
        let mut tree = BlockTree::new(1);
        let a = chain(&mut tree, &[1, 2], 0).unwrap();
        chain(&mut tree, &[5], 2);
        tree.lookup(&[1, 2]);
        // Leaves: block 1 (used just now) and block 2: block 2 goes first.
        assert_eq!(tree.lru_leaf(|_| true), Some(b(2)));
        assert!(tree.remove_leaf(b(2)));
        // An inner node is not a leaf.
        assert!(!tree.remove_leaf(b(0)));
        assert_eq!(tree.lru_leaf(|blk| blk != b(1)), None);
        assert!(tree.remove_leaf(b(1)));
        assert_eq!(tree.insert(Some(a), &[3], b(9)), Inserted::StaleParent);
        assert!(tree.remove_leaf(b(0)));
        assert!(tree.is_empty());
        // Reused slots get new generations.
        chain(&mut tree, &[4, 4], 20);
        assert_eq!(tree.insert(Some(a), &[3], b(9)), Inserted::StaleParent);
        tree.clear();
        assert!(tree.is_empty() && tree.lookup(&[4]).path.is_empty());
    }
}
