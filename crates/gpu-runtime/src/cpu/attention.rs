//! The paged KV cache's writes and grouped-query attention over it, on the CPU.
//!
//! Keys are stored transposed within each block (see [`KvLayer`]): a
//! block's keys of one kv head are a `[head_dim, block_size]` tile, and a
//! query's scores for the block are `block_size` lanes of one vector loop
//! (`q[d]` broadcast times row `d` of the tile, no horizontal sums). Values
//! stay token-major, so the output sums `p_t · v_t` with whole-row vector
//! operations. The heads of a kv group are taken up to four at a time, each
//! tile row and value row loaded once for all of them; one task per (query
//! row, those heads); the softmax uses the vectorised `exp`.
//!
//! Each (row, head) is computed by the same operations in the same order
//! whatever else is in the call and however the team splits it, so a row's
//! result depends on its own sequence only.

use std::cell::RefCell;

use super::CpuBackend;
use super::dense::{need, shape_err};
use super::elementwise as ew;
use super::gemv::Isa;
use super::simd::simd_fn;
use super::vec;
use half::bf16;
use metrale_core::DType;

use crate::error::{GpuError, Result};
use crate::gpu::DeviceSlice;
use crate::ops::dense::{AttnParams, KvLayer};
use crate::ops::step::{ATTN_SEQ_WORDS, AttnBatch, AttnSeqDesc};

/// How many blocks ahead of its reads a query's walk over the keys
/// prefetches them. Measured on Llama-370M Q4_K_M decode, 2048-token
/// context, 2 threads, three rounds: attention 251-275 ms without
/// prefetches, 177-203 ms with one block of keys and values ahead,
/// 167-204 ms with four blocks of keys ahead (into L2); one block ahead
/// into L1 was no better than none.
const KEY_BLOCKS_AHEAD: usize = 4;

thread_local! {
    /// One query's scores (per team thread).
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// A bf16 cache's key tile or value rows widened to f32 (per team thread).
    static WIDE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

pub(super) fn kv_store(
    cpu: &CpuBackend,
    k: DeviceSlice,
    v: DeviceSlice,
    cache: &KvLayer,
    slots: DeviceSlice,
    kv_width: usize,
) -> Result<()> {
    const OP: &str = "kv_store";
    let _timer = cpu.begin_op(OP)?;
    let slots = cpu.read_u32(OP, slots)?;
    need(OP, k, slots.len() * kv_width, "k")?;
    need(OP, v, slots.len() * kv_width, "v")?;
    let bs = cache.block_size.max(1);
    let capacity = cache.k.len().min(cache.v.len()) / (kv_width * bs).max(1) * bs;
    if let Some(&s) = slots.iter().find(|&&s| s as usize >= capacity) {
        return Err(shape_err(
            OP,
            format!("slot {s} beyond cache capacity {capacity}"),
        ));
    }
    let (ks, vs) = (cpu.read_f32(OP, k)?, cpu.read_f32(OP, v)?);
    match cache.k.dtype() {
        DType::F32 => {
            let kc = cpu.write_f32(OP, cache.k, &[k, v])?;
            let vc = cpu.write_f32(OP, cache.v, &[k, v, cache.k])?;
            store_rows(slots, ks, vs, kc, vc, kv_width, bs, |x| x);
        }
        DType::BF16 => {
            let kc = cpu.write_as::<bf16>(OP, cache.k, &[k, v])?;
            let vc = cpu.write_as::<bf16>(OP, cache.v, &[k, v, cache.k])?;
            store_rows(slots, ks, vs, kc, vc, kv_width, bs, bf16::from_f32);
        }
        dtype => return Err(GpuError::UnsupportedDType { op: OP, dtype }),
    }
    Ok(())
}

/// Row `i` of `ks` / `vs` into slot `slots[i]`: keys transposed within
/// their block's tiles, values token-major; `cast` rounds to the cache's dtype.
#[allow(clippy::too_many_arguments)]
fn store_rows<T: Copy>(
    slots: &[u32],
    ks: &[f32],
    vs: &[f32],
    kc: &mut [T],
    vc: &mut [T],
    kv_width: usize,
    bs: usize,
    cast: impl Fn(f32) -> T,
) {
    for (i, &slot) in slots.iter().enumerate() {
        let (block, off) = (slot as usize / bs, slot as usize % bs);
        let tile = &mut kc[block * kv_width * bs..(block + 1) * kv_width * bs];
        for (c, &x) in ks[i * kv_width..(i + 1) * kv_width].iter().enumerate() {
            tile[c * bs + off] = cast(x);
        }
        let s = slot as usize;
        for (o, &x) in vc[s * kv_width..(s + 1) * kv_width]
            .iter_mut()
            .zip(&vs[i * kv_width..(i + 1) * kv_width])
        {
            *o = cast(x);
        }
    }
}

/// A layer's cached keys or values, in the cache's dtype.
#[derive(Clone, Copy)]
enum KvData<'a> {
    F32(&'a [f32]),
    /// Widened to f32 a block at a time (into per-thread buffers).
    BF16(&'a [bf16]),
}

impl<'a> KvData<'a> {
    fn read(cpu: &'a CpuBackend, op: &'static str, s: DeviceSlice) -> Result<Self> {
        match s.dtype() {
            DType::F32 => Ok(KvData::F32(cpu.read_f32(op, s)?)),
            DType::BF16 => Ok(KvData::BF16(cpu.read_as(op, s)?)),
            dtype => Err(GpuError::UnsupportedDType { op, dtype }),
        }
    }

    /// `len` elements at `at`, as f32: in place, or widened into `buf`.
    fn run<'b>(&self, at: usize, len: usize, buf: &'b mut Vec<f32>) -> &'b [f32]
    where
        'a: 'b,
    {
        match *self {
            KvData::F32(d) => &d[at..at + len],
            KvData::BF16(d) => {
                buf.clear();
                buf.extend(d[at..at + len].iter().map(|x| x.to_f32()));
                buf
            }
        }
    }

    /// Prefetches `rows` rows of `width` elements at `at`, `stride` apart
    /// (one row: `width` contiguous elements).
    fn prefetch(&self, at: usize, rows: usize, width: usize, stride: usize) {
        for r in 0..rows {
            let from = at + r * stride;
            match *self {
                KvData::F32(d) => super::simd::prefetch_l2(d, from, from + width),
                KvData::BF16(d) => super::simd::prefetch_l2(d, from, from + width),
            }
        }
    }

    /// `rows` rows of `width` at `at`, `stride` apart, as f32 rows and their
    /// stride: in place, or widened into `buf` (stride `width`).
    fn rows<'b>(
        &self,
        at: usize,
        rows: usize,
        width: usize,
        stride: usize,
        buf: &'b mut Vec<f32>,
    ) -> (&'b [f32], usize)
    where
        'a: 'b,
    {
        match *self {
            KvData::F32(d) => (&d[at..], stride),
            KvData::BF16(d) => {
                buf.clear();
                for r in 0..rows {
                    let row = &d[at + r * stride..][..width];
                    buf.extend(row.iter().map(|x| x.to_f32()));
                }
                (buf, width)
            }
        }
    }
}

/// One sequence of an attention call, decoded from device memory.
struct SeqView<'a> {
    q_start: usize,
    q_len: usize,
    kv_len: usize,
    /// Block ids, in order; covers `kv_len` tokens.
    table: &'a [u32],
}

/// The sequences of `batch`, checked against the cache's block size and
/// the block tables' length.
fn decode_seqs<'a>(
    cpu: &'a CpuBackend,
    batch: &AttnBatch,
    block_size: usize,
) -> Result<Vec<SeqView<'a>>> {
    const OP: &str = "paged_attention";
    need(OP, batch.seqs, batch.n_seqs * ATTN_SEQ_WORDS, "sequences")?;
    let words = cpu.read_u32(OP, batch.seqs)?;
    let tables = cpu.read_u32(OP, batch.block_tables)?;
    (0..batch.n_seqs)
        .map(|i| {
            let d = AttnSeqDesc::decode(&words[i * ATTN_SEQ_WORDS..]);
            let (start, kv_len) = (d.table_start as usize, d.kv_len as usize);
            let blocks = kv_len.div_ceil(block_size.max(1));
            let table = tables.get(start..start + blocks).ok_or_else(|| {
                shape_err(
                    OP,
                    format!(
                        "sequence {i}: a table of {blocks} blocks at {start} lies outside {} entries",
                        tables.len()
                    ),
                )
            })?;
            if d.q_len > d.kv_len {
                return Err(shape_err(
                    OP,
                    format!("sequence {i}: {} queries, {kv_len} cached tokens", d.q_len),
                ));
            }
            Ok(SeqView {
                q_start: d.q_start as usize,
                q_len: d.q_len as usize,
                kv_len,
                table,
            })
        })
        .collect()
}

/// Which sequence and position each query row belongs to (None: no query).
fn rows_of(seqs: &[SeqView<'_>]) -> Vec<Option<(usize, usize)>> {
    let rows = seqs.iter().map(|s| s.q_start + s.q_len).max().unwrap_or(0);
    let mut row_of = vec![None; rows];
    for (si, s) in seqs.iter().enumerate() {
        for i in 0..s.q_len {
            row_of[s.q_start + i] = Some((si, s.kv_len - s.q_len + i));
        }
    }
    row_of
}

pub(super) fn paged_attention(
    cpu: &CpuBackend,
    q: DeviceSlice,
    cache: &KvLayer,
    out: DeviceSlice,
    batch: &AttnBatch,
    p: &AttnParams,
) -> Result<()> {
    const OP: &str = "paged_attention";
    let _timer = cpu.begin_op(OP)?;
    let (hd, width) = (p.head_dim, p.n_heads * p.head_dim);
    let kv_width = p.n_kv_heads * hd;
    let bs = cache.block_size;
    if p.n_kv_heads == 0 || !p.n_heads.is_multiple_of(p.n_kv_heads) || hd == 0 || bs == 0 {
        return Err(shape_err(
            OP,
            format!(
                "{} heads over {} kv heads of {hd}, blocks of {bs}",
                p.n_heads, p.n_kv_heads
            ),
        ));
    }
    let seqs = decode_seqs(cpu, batch, bs)?;
    let blocks = cache.k.len().min(cache.v.len()) / (kv_width * bs);
    if let Some(b) = seqs
        .iter()
        .flat_map(|s| s.table)
        .find(|&&b| b as usize >= blocks)
    {
        return Err(shape_err(
            OP,
            format!("block {b} beyond a cache of {blocks}"),
        ));
    }
    let row_of = rows_of(&seqs);
    let rows = row_of.len();
    need(OP, q, rows * width, "q")?;
    need(OP, out, rows * width, "out")?;
    if cache.k.dtype() != cache.v.dtype() {
        return Err(shape_err(
            OP,
            format!(
                "keys in {} but values in {}",
                cache.k.dtype(),
                cache.v.dtype()
            ),
        ));
    }
    let (qs, kc, vc) = (
        cpu.read_f32(OP, q)?,
        KvData::read(cpu, OP, cache.k)?,
        KvData::read(cpu, OP, cache.v)?,
    );
    let o = cpu.write_f32(OP, out, &[q, cache.k, cache.v])?;
    let (isa, group) = (Isa::detect(), p.n_heads / p.n_kv_heads);
    // Heads are taken a few at a time (`hpt`, dividing the group): each
    // block of keys and values is loaded once for all of them. One task per
    // (row, few heads), or per row in a long prefill; the last rows (the
    // most keys) first.
    let hpt = (1..=vec::MAX_HEADS)
        .rev()
        .find(|d| group.is_multiple_of(*d))
        .unwrap_or(1);
    let pieces = p.n_heads / hpt;
    let per_task = if rows >= 4 * cpu.threads() { pieces } else { 1 };
    cpu.team()
        .chunks_rev(&mut o[..rows * width], hpt * hd, per_task, |idx, oh| {
            let (r, h0) = (idx / pieces, idx % pieces * hpt);
            let Some((si, pos)) = row_of[r] else { return };
            let first = p.sliding_window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let keys = Keys {
                seq: &seqs[si],
                kc,
                vc,
                kvh: h0 / group,
                first,
                pos,
                bs,
                hd,
                kv_width,
            };
            let mut qh: [&[f32]; vec::MAX_HEADS] = [&[]; vec::MAX_HEADS];
            for (j, q) in qh.iter_mut().take(hpt).enumerate() {
                *q = &qs[r * width + (h0 + j) * hd..][..hd];
            }
            keys.attend(isa, &qh[..hpt], p.scale, oh);
        });
    Ok(())
}

/// The keys and values a query row sees, of one kv head.
struct Keys<'a> {
    seq: &'a SeqView<'a>,
    kc: KvData<'a>,
    vc: KvData<'a>,
    kvh: usize,
    /// The visible positions, `first..=pos`.
    first: usize,
    pos: usize,
    bs: usize,
    hd: usize,
    kv_width: usize,
}

impl Keys<'_> {
    /// Where block `b`'s key tile of this kv head starts.
    fn key_tile(&self, b: usize) -> usize {
        (self.seq.table[b] as usize * (self.kv_width / self.hd) + self.kvh) * self.hd * self.bs
    }

    /// Where the value of position `t` (in block `b`) of this kv head starts.
    fn value_row(&self, b: usize, t: usize) -> usize {
        (self.seq.table[b] as usize * self.bs + t - b * self.bs) * self.kv_width
            + self.kvh * self.hd
    }

    /// Prefetches block `b`'s values of this kv head from position `lo`.
    fn prefetch_values(&self, b: usize, lo: usize) {
        let hi = ((b + 1) * self.bs).min(self.pos + 1);
        let lo = lo.max(b * self.bs);
        if lo < hi {
            let at = self.value_row(b, lo);
            self.vc.prefetch(at, hi - lo, self.hd, self.kv_width);
        }
    }

    /// Attention of the queries `qs` (at most `MAX_HEADS`) over these keys
    /// into `out` (`qs.len()` heads of `hd`).
    fn attend(&self, isa: Isa, qs: &[&[f32]], scale: f32, out: &mut [f32]) {
        let (bs, hd) = (self.bs, self.hd);
        let (b0, b1) = (self.first / bs, self.pos / bs);
        let span = (b1 + 1 - b0) * bs;
        let tile_len = hd * bs;
        WIDE.with_borrow_mut(|wide| {
            SCORES.with_borrow_mut(|scores| {
                // Per head, the scores of the whole blocks that hold keys
                // `first..=pos`; the visible ones are `first - b0 * bs..=pos - b0 * bs`.
                scores.resize(qs.len() * span, 0.0);
                let mut lanes = [[0f32; vec::TILE_LANES]; vec::MAX_HEADS];
                // The key tiles lie where the block table puts them, a
                // tile per page or more apart: the hardware prefetcher
                // does not follow them, so the walk prefetches its own,
                // `KEY_BLOCKS_AHEAD` ahead.
                for b in b0 + 1..(b0 + KEY_BLOCKS_AHEAD).min(b1 + 1) {
                    self.kc.prefetch(self.key_tile(b), 1, tile_len, 0);
                }
                for (j, b) in (b0..=b1).enumerate() {
                    if b + KEY_BLOCKS_AHEAD <= b1 {
                        self.kc
                            .prefetch(self.key_tile(b + KEY_BLOCKS_AHEAD), 1, tile_len, 0);
                    } else if b == b1 {
                        // The values come next.
                        self.prefetch_values(b0, self.first);
                    }
                    let at = self.key_tile(b);
                    let tile = self.kc.run(at, tile_len, wide);
                    if bs == vec::TILE_LANES {
                        vec::tile_dot_heads(isa, qs, tile, &mut lanes);
                        for (h, l) in lanes.iter().take(qs.len()).enumerate() {
                            scores[h * span + j * bs..][..bs].copy_from_slice(l);
                        }
                    } else {
                        for (h, q) in qs.iter().enumerate() {
                            tile_scores_any(q, tile, &mut scores[h * span + j * bs..][..bs]);
                        }
                    }
                }
                let visible = self.first - b0 * bs..self.pos + 1 - b0 * bs;
                for head in scores.chunks_mut(span) {
                    let v = &mut head[visible.clone()];
                    let mut max = f32::NEG_INFINITY;
                    for s in v.iter_mut() {
                        *s *= scale;
                        max = max.max(*s);
                    }
                    let mut sum = 0f32;
                    ew::exp_sub_sum(v, max, &mut sum);
                    v.iter_mut().for_each(|s| *s /= sum);
                }
                out.fill(0.0);
                // The values of keys `first..=pos`, block by block: each block's
                // run of tokens is rows `kv_width` apart.
                let mut done = visible.start;
                for b in b0..=b1 {
                    let (lo, hi) = ((b * bs).max(self.first), ((b + 1) * bs).min(self.pos + 1));
                    if b < b1 {
                        self.prefetch_values(b + 1, (b + 1) * bs);
                    }
                    let at = self.value_row(b, lo);
                    let mut ws: [&[f32]; vec::MAX_HEADS] = [&[]; vec::MAX_HEADS];
                    for (w, head) in ws.iter_mut().zip(scores.chunks(span)) {
                        *w = &head[done..done + hi - lo];
                    }
                    let ws = &ws[..qs.len()];
                    let (rows, stride) = self.vc.rows(at, hi - lo, hd, self.kv_width, wide);
                    vec::axpy_rows_heads(isa, out, hd, ws, rows, stride);
                    done += hi - lo;
                }
            })
        });
    }
}

simd_fn! {
    /// `lanes[j] = Σ_d q[d] · tile[d * lanes.len() + j]`, summed over `d` in
    /// order: blocks of other sizes than the default 16 ([`vec::tile_dot`]).
    fn tile_scores_any(q: &[f32], tile: &[f32], lanes: &mut [f32]) {
        lanes.fill(0.0);
        for (&qd, row) in q.iter().zip(tile.chunks_exact(lanes.len())) {
            for (a, &k) in lanes.iter_mut().zip(row) {
                *a += qd * k;
            }
        }
    }
}
