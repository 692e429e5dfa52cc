//! The host side of the paged KV cache's kernels (`kernels/attention.cu`,
//! and `kv_store` of `kernels/dense.cu`): operand checks, the launch shape
//! and the split of long key ranges across blocks.
//!
//! `paged_attention` runs blocks of `hpb` query heads of one kv head (one
//! warp per query head; grid y), which walk the step's work items, (query
//! row, split of its visible keys), grid-stride (grid x). The host knows an
//! upper bound of the step's rows (`q`'s length: the engine passes its
//! whole activation buffer) but not the sequences (device memory), so the
//! kernels find the real rows from the descriptors and choose the splits
//! from them, with [`choose_splits`]'s policy: few rows (decode) get enough
//! splits to fill the GPU, many rows (prefill) one, and the partials stay
//! under `PARTIALS_BUDGET`. The host sizes the grid and the partials for
//! the worst case of that policy over every possible row count. A split
//! covers at least `MIN_SPLIT_CHUNK` (128) positions, so a short context
//! uses only its first splits; the others write empty partials, which
//! `attn_reduce` leaves out.

// Launch argument tuples mirror the kernels' parameter lists.
#![allow(clippy::type_complexity, clippy::too_many_arguments)]

use metrale_core::DType;

use super::CudaBackend;
use super::args::{Launch, elements, expect, f32s, int, need, shape_err};
use super::kernels::{ATTN_REDUCE, KV_STORE, PAGED_ATTENTION};
use super::launch::{LaunchCfg, Ptr};
use super::workspace::Scratch;
use crate::error::{GpuError, Result};
use crate::gpu::DeviceSlice;
use crate::ops::step::ATTN_SEQ_WORDS;
use crate::ops::{AttnBatch, AttnParams, KvLayer};

/// Positions a tile stages in shared memory (`TILE` of attention.cu).
const TILE: usize = 32;
/// head_dim up to this (`32 * MAX_DIMS` of attention.cu).
pub(super) const MAX_HEAD_DIM: usize = 256;
/// Query heads (warps) per block at most.
const MAX_HEADS_PER_BLOCK: usize = 16;
/// Dynamic shared memory a block may use without opting in (48 KiB, less
/// the kernel's static shared memory and a margin).
const SHARED_BUDGET: usize = 47 * 1024;
/// Splits at most (`MAX_SPLITS` of attention.cu).
pub(super) const MAX_SPLITS: usize = 64;
/// Split partials stay under this many bytes (`PARTIAL_FLOATS` of attention.cu).
pub(super) const PARTIALS_BUDGET: usize = 64 << 20;
/// Blocks per multiprocessor a split launch aims for.
pub(super) const BLOCKS_PER_SM: usize = 8;

fn cache_code(op: &'static str, cache: &KvLayer) -> Result<i32> {
    if cache.k.dtype() != cache.v.dtype() {
        return Err(shape_err(
            op,
            format!(
                "keys in {} but values in {}",
                cache.k.dtype(),
                cache.v.dtype()
            ),
        ));
    }
    match cache.k.dtype() {
        DType::F32 => Ok(0),
        DType::BF16 => Ok(1),
        DType::F16 => Ok(2),
        dtype => Err(GpuError::UnsupportedDType { op, dtype }),
    }
}

/// `paged_attention`'s flag bit for a cache of dtype `code`
/// ([`cache_code`]): `FLAG_BF16` or `FLAG_F16` of attention.cu.
fn dtype_flag(code: i32) -> i32 {
    match code {
        1 => 1,
        2 => 8,
        _ => 0,
    }
}

pub(super) type KvStoreArgs = (Ptr, Ptr, Ptr, Ptr, Ptr, i32, i32, i32, i64, i32);

pub(super) fn kv_store_launch(
    k: DeviceSlice,
    v: DeviceSlice,
    cache: &KvLayer,
    slots: DeviceSlice,
    kv_width: usize,
) -> Result<Option<Launch<KvStoreArgs>>> {
    const OP: &str = "kv_store";
    expect(OP, slots, DType::U32)?;
    let n = slots.len();
    f32s(OP, k, n * kv_width, "k")?;
    f32s(OP, v, n * kv_width, "v")?;
    let code = cache_code(OP, cache)?;
    let bs = cache.block_size;
    if bs == 0 {
        return Err(shape_err(OP, "blocks of 0 tokens".into()));
    }
    if n == 0 || kv_width == 0 {
        return Ok(None);
    }
    // Slots beyond it are skipped by the kernel (the CPU reports them).
    let capacity = cache.k.len().min(cache.v.len()) / (kv_width * bs) * bs;
    Ok(Some(Launch {
        cfg: elements(n * kv_width),
        args: (
            Ptr::of(k),
            Ptr::of(v),
            Ptr::of(cache.k),
            Ptr::of(cache.v),
            Ptr::of(slots),
            int(OP, n, "slots")?,
            int(OP, kv_width, "kv_width")?,
            int(OP, bs, "block_size")?,
            capacity as i64,
            code,
        ),
    }))
}

/// How a block of `paged_attention` is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct BlockPlan {
    /// Query heads (warps) per block: divides the group.
    pub hpb: usize,
    /// Keys and values staged side by side (else the values overwrite the
    /// keys once they are scored).
    pub separate_kv: bool,
    pub shared_bytes: usize,
}

/// The most heads per block (dividing `group`) whose tiles fit the shared
/// memory budget, keys and values side by side where they fit.
pub(super) fn block_plan(group: usize, head_dim: usize) -> BlockPlan {
    let bytes = |hpb: usize, tiles: usize| 4 * (hpb * head_dim + tiles * TILE * head_dim);
    for hpb in (1..=MAX_HEADS_PER_BLOCK.min(group)).rev() {
        if !group.is_multiple_of(hpb) {
            continue;
        }
        for (separate_kv, tiles) in [(true, 2), (false, 1)] {
            if bytes(hpb, tiles) <= SHARED_BUDGET {
                return BlockPlan {
                    hpb,
                    separate_kv,
                    shared_bytes: bytes(hpb, tiles),
                };
            }
        }
    }
    // head_dim <= 256: one head with one tile always fits.
    BlockPlan {
        hpb: 1,
        separate_kv: false,
        shared_bytes: bytes(1, 1),
    }
}

/// Splits of each row's key range when the step has `rows` query rows:
/// enough blocks (`rows * head_blocks * splits`) for `target_blocks` when
/// there are few rows, bounded so that the partials (max, sum and head_dim
/// accumulators per row, head and split) stay under `PARTIALS_BUDGET`; 1
/// (no partials) when the rows fill the GPU alone. The kernels compute the
/// same (`attn_geometry` of attention.cu) from the rows they find.
pub(super) fn choose_splits(
    rows: usize,
    n_heads: usize,
    head_blocks: usize,
    head_dim: usize,
    target_blocks: usize,
) -> usize {
    let blocks = rows * head_blocks;
    if rows == 0 || blocks >= target_blocks {
        return 1;
    }
    let per_split = rows * n_heads * (head_dim + 2) * 4;
    target_blocks
        .div_ceil(blocks)
        .min(MAX_SPLITS)
        .min(PARTIALS_BUDGET / per_split.max(1))
        .max(1)
}

/// The worst case of [`choose_splits`] over every row count up to
/// `rows_bound`: the most work items (rows times splits), the most bytes
/// of partials, and the most rows that take several splits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct SplitBounds {
    pub items: usize,
    pub partial_bytes: usize,
    pub split_rows: usize,
}

pub(super) fn split_bounds(
    rows_bound: usize,
    n_heads: usize,
    head_blocks: usize,
    head_dim: usize,
    target_blocks: usize,
) -> SplitBounds {
    let mut b = SplitBounds {
        items: rows_bound,
        partial_bytes: 0,
        split_rows: 0,
    };
    // Beyond `target_blocks` rows every row takes one split.
    for rows in 1..=rows_bound.min(target_blocks) {
        let splits = choose_splits(rows, n_heads, head_blocks, head_dim, target_blocks);
        b.items = b.items.max(rows * splits);
        if splits > 1 {
            b.partial_bytes = b
                .partial_bytes
                .max(rows * n_heads * splits * (head_dim + 2) * 4);
            b.split_rows = rows;
        }
    }
    b
}

pub(super) type AttnArgs = (
    Ptr,
    Ptr,
    Ptr,
    Ptr,
    Ptr,
    Ptr,
    Ptr,
    i32,
    i32,
    i32,
    i32,
    f32,
    i32,
    u32,
    u32,
    i32,
    i64,
    i32,
);

pub(super) type ReduceArgs = (Ptr, Ptr, Ptr, i32, i32, i32, i32, i64, i32);

/// A checked `paged_attention` call: the main launch (its partials pointer
/// still null), and where some row count would split, the bytes of
/// partials it needs and the reduce launch (its partials pointer null too).
#[derive(Clone, Copy)]
pub(super) struct AttnLaunch {
    pub main: Launch<AttnArgs>,
    pub partial_bytes: usize,
    pub reduce: Option<Launch<ReduceArgs>>,
}

pub(super) fn attention_launch(
    q: DeviceSlice,
    cache: &KvLayer,
    out: DeviceSlice,
    seqs: &AttnBatch,
    p: &AttnParams,
    sms: usize,
) -> Result<Option<AttnLaunch>> {
    const OP: &str = "paged_attention";
    let (hd, bs) = (p.head_dim, cache.block_size);
    if p.n_kv_heads == 0
        || !p.n_heads.is_multiple_of(p.n_kv_heads)
        || p.n_heads == 0
        || hd == 0
        || bs == 0
    {
        return Err(shape_err(
            OP,
            format!(
                "{} heads over {} kv heads of {hd}, blocks of {bs}",
                p.n_heads, p.n_kv_heads
            ),
        ));
    }
    if hd > MAX_HEAD_DIM {
        return Err(shape_err(
            OP,
            format!("head_dim {hd} beyond the {MAX_HEAD_DIM} supported"),
        ));
    }
    if p.sliding_window == Some(0) {
        return Err(shape_err(OP, "a sliding window of 0 positions".into()));
    }
    let code = cache_code(OP, cache)?;
    expect(OP, seqs.seqs, DType::U32)?;
    need(OP, seqs.seqs, seqs.n_seqs * ATTN_SEQ_WORDS, "sequences")?;
    expect(OP, seqs.block_tables, DType::U32)?;
    let width = p.n_heads * hd;
    expect(OP, q, DType::F32)?;
    // At most this many query rows (the sequences' rows lie among them).
    let rows_bound = q.len() / width;
    f32s(OP, out, rows_bound * width, "out")?;
    if rows_bound == 0 || seqs.n_seqs == 0 {
        return Ok(None);
    }
    let kv_width = p.n_kv_heads * hd;
    let num_blocks = cache.k.len().min(cache.v.len()) / (kv_width * bs);
    let plan = block_plan(p.n_heads / p.n_kv_heads, hd);
    let head_blocks = p.n_heads / plan.hpb;
    let target = BLOCKS_PER_SM * sms.max(1);
    let bounds = split_bounds(rows_bound, p.n_heads, head_blocks, hd, target);
    // Enough blocks for a few waves; more items are walked grid-stride.
    let grid_x = bounds.items.min((4 * target).div_ceil(head_blocks)).max(1);
    let window = p
        .sliding_window
        .map_or(0, |w| w.min(i32::MAX as usize) as i32);
    // Tiles move 16 bytes at a time where blocks of keys split into whole
    // units of 8 tokens, value rows into units of 8 channels, and both
    // caches are 16-byte aligned.
    let vec = bs.is_multiple_of(8)
        && hd.is_multiple_of(8)
        && cache.k.ptr().raw().is_multiple_of(16)
        && cache.v.ptr().raw().is_multiple_of(16);
    let flags = dtype_flag(code) | if plan.separate_kv { 2 } else { 0 } | if vec { 4 } else { 0 };
    let (n_seqs, n_heads) = (int(OP, seqs.n_seqs, "sequences")?, p.n_heads as i32);
    let reduce = (bounds.split_rows > 0).then(|| Launch {
        cfg: LaunchCfg {
            grid: ((bounds.split_rows * p.n_heads).min(2 * target) as u32, 1, 1),
            block: (hd.next_multiple_of(32).min(256) as u32, 1, 1),
            shared_bytes: 0,
        },
        args: (
            Ptr::NULL,
            Ptr::of(seqs.seqs),
            Ptr::of(out),
            n_seqs,
            n_heads,
            head_blocks as i32,
            hd as i32,
            rows_bound as i64,
            target as i32,
        ),
    });
    Ok(Some(AttnLaunch {
        main: Launch {
            cfg: LaunchCfg {
                grid: (grid_x as u32, head_blocks as u32, 1),
                block: ((plan.hpb * 32) as u32, 1, 1),
                shared_bytes: plan.shared_bytes as u32,
            },
            args: (
                Ptr::of(q),
                Ptr::of(cache.k),
                Ptr::of(cache.v),
                Ptr::of(seqs.seqs),
                Ptr::of(seqs.block_tables),
                Ptr::of(out),
                Ptr::NULL,
                n_seqs,
                int(OP, p.n_kv_heads, "n_kv_heads")?,
                hd as i32,
                int(OP, bs, "block_size")?,
                p.scale,
                window,
                num_blocks.min(u32::MAX as usize) as u32,
                seqs.block_tables.len().min(u32::MAX as usize) as u32,
                flags,
                rows_bound as i64,
                target as i32,
            ),
        },
        partial_bytes: bounds.partial_bytes,
        reduce,
    }))
}

impl CudaBackend {
    pub(super) fn kv_store_op(
        &self,
        k: DeviceSlice,
        v: DeviceSlice,
        cache: &KvLayer,
        slots: DeviceSlice,
        kv_width: usize,
    ) -> Result<()> {
        self.hooks.begin_op("kv_store")?;
        match kv_store_launch(k, v, cache, slots, kv_width)? {
            Some(l) => self.launch(&KV_STORE, l.cfg, l.args),
            None => Ok(()),
        }
    }

    pub(super) fn paged_attention_op(
        &self,
        q: DeviceSlice,
        cache: &KvLayer,
        out: DeviceSlice,
        seqs: &AttnBatch,
        p: &AttnParams,
    ) -> Result<()> {
        self.hooks.begin_op("paged_attention")?;
        let sms = self.multiprocessors().max(1) as usize;
        let Some(mut a) = attention_launch(q, cache, out, seqs, p, sms)? else {
            return Ok(());
        };
        let Some(mut reduce) = a.reduce else {
            return self.launch(&PAGED_ATTENTION, a.main.cfg, a.main.args);
        };
        let partials = self.scratch(Scratch::AttnPartials, a.partial_bytes)?;
        a.main.args.6 = partials;
        reduce.args.0 = partials;
        self.launch(&PAGED_ATTENTION, a.main.cfg, a.main.args)?;
        self.launch(&ATTN_REDUCE, reduce.cfg, reduce.args)
    }
}
