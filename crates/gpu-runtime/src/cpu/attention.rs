//! Grouped-query attention over the paged KV cache, on the CPU (its writes: `kv_store`).
//!
//! Keys are stored transposed within each block (see [`KvLayer`]): a
//! block's keys of one kv head are a `[head_dim, block_size]` tile, and a
//! query's scores for the block are `block_size` lanes of one vector loop
//! (`q[d]` broadcast times row `d` of the tile, no horizontal sums). Values
//! stay token-major, so the output sums `p_t · v_t` with whole-row vector
//! operations. The heads of a kv group are taken up to four at a time, each
//! tile row and value row loaded once for all of them. A decode step runs
//! one task per (query row, those heads); a prefill one per tile of up to
//! 16 rows, which walk the blocks together, so that each block is loaded
//! (and a narrow cache's widened) once per tile rather than once per row from
//! L3. The softmax's passes (scale and max, `exp` and sum, divide) are
//! vector loops. Measured on Llama-370M Q4_K_M, a 2048-token prompt, 2
//! threads: prefill attention 3.3 s before, 2.5 s with the tiles, 1.7 s
//! with the softmax's vector loops (prefill 307 -> 394 tok/s).
//!
//! A row alone (decode) reads a bf16 or f16 cache as it lies: the kernels widen
//! each element in the register ([`vec::KvElem`]). Widening the block into
//! a buffer first had been a third of the call. Llama-370M Q4_K_M decode
//! over 2048 tokens, 64 steps, four interleaved rounds: attention 297-358
//! ms before, 186-259 ms after (`examples/attn_stream`, cold caches:
//! 297-303 -> 213-220 µs a call).
//!
//! Each (row, head) is computed by the same operations in the same order
//! whatever else is in the call and however the team splits it (a row of a
//! tile takes each block's operations as it would alone), so a row's
//! result depends on its own sequence only.

use std::cell::RefCell;

use super::dense::{need, shape_err};
use super::elementwise as ew;
use super::gemv::Isa;
use super::vec::{self, KvElem};
use super::{CpuBackend, Element};
use half::{bf16, f16};
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
    /// A bf16 cache's key tile or value rows widened to f32 for a tile of
    /// query rows (per team thread).
    static WIDE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Prefetches into L2 `rows` rows of `width` elements of `data` from `at`,
/// `stride` elements apart: one touch per 64-byte line and the last byte
/// of each row. (A row of a kv head's values is two or three lines; the
/// slice prefetch's loop cost more than its touches, a fifth of a call on
/// a warm cache.)
fn prefetch_rows<E>(data: &[E], at: usize, rows: usize, width: usize, stride: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
        let size = std::mem::size_of::<E>();
        let (bytes, step) = (width * size, stride * size);
        if bytes == 0 {
            return;
        }
        let start = data.as_ptr().wrapping_add(at).cast::<i8>();
        for r in 0..rows {
            let row = start.wrapping_add(r * step);
            let mut o = 0;
            while o < bytes {
                // SAFETY: a prefetch never faults, whatever the address
                // (the pointers are computed with wrapping arithmetic).
                unsafe { _mm_prefetch::<_MM_HINT_T1>(row.wrapping_add(o)) };
                o += 64;
            }
            // SAFETY: as above.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(row.wrapping_add(bytes - 1)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, at, rows, width, stride);
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
    let qs = cpu.read_f32(OP, q)?;
    let (isa, group) = (Isa::detect(), p.n_heads / p.n_kv_heads);
    // Heads are taken a few at a time (`hpt`, dividing the group): each
    // block of keys and values is loaded once for all of them.
    let hpt = (1..=vec::MAX_HEADS)
        .rev()
        .find(|d| group.is_multiple_of(*d))
        .unwrap_or(1);
    let call = Call {
        seqs: &seqs,
        row_of: &row_of,
        qs,
        p,
        isa,
        hpt,
        bs,
    };
    match cache.k.dtype() {
        DType::F32 => call.run_on::<f32>(cpu, q, cache, out, rows * width),
        DType::BF16 => call.run_on::<bf16>(cpu, q, cache, out, rows * width),
        DType::F16 => call.run_on::<f16>(cpu, q, cache, out, rows * width),
        dtype => Err(GpuError::UnsupportedDType { op: OP, dtype }),
    }
}

/// Most query rows a prefill task takes at once.
const MAX_TILE_ROWS: usize = 16;

/// About how many bytes of scores a task's tile of rows may hold (fewer
/// rows at long contexts).
const SCORE_BYTES: usize = 2 << 20;

/// What every task of one `paged_attention` call reads, but the cache.
struct Call<'a> {
    seqs: &'a [SeqView<'a>],
    row_of: &'a [Option<(usize, usize)>],
    qs: &'a [f32],
    p: &'a AttnParams,
    isa: Isa,
    hpt: usize,
    bs: usize,
}

impl Call<'_> {
    /// The call over `cache`, whose element is `E`, into the first `n`
    /// values of `out` (`q` and the cache its inputs).
    fn run_on<E: KvElem + Element>(
        &self,
        cpu: &CpuBackend,
        q: DeviceSlice,
        cache: &KvLayer,
        out: DeviceSlice,
        n: usize,
    ) -> Result<()> {
        const OP: &str = "paged_attention";
        let (kc, vc) = (cpu.read_as::<E>(OP, cache.k)?, cpu.read_as(OP, cache.v)?);
        let o = cpu.write_f32(OP, out, &[q, cache.k, cache.v])?;
        Shared { call: self, kc, vc }.run_all(cpu, &mut o[..n]);
        Ok(())
    }
}

/// A [`Call`] and its cache's keys and values, whose element is `E`.
struct Shared<'a, E> {
    call: &'a Call<'a>,
    kc: &'a [E],
    vc: &'a [E],
}

impl<'a, E> std::ops::Deref for Shared<'a, E> {
    type Target = Call<'a>;

    fn deref(&self) -> &Call<'a> {
        self.call
    }
}

impl<E: KvElem> Shared<'_, E> {
    /// Every query row into `o` (`rows` rows of `n_heads · head_dim`), on
    /// the team.
    fn run_all(&self, cpu: &CpuBackend, o: &mut [f32]) {
        let (p, hd, hpt) = (self.p, self.p.head_dim, self.hpt);
        let width = p.n_heads * hd;
        let rows = o.len() / width;
        let pieces = p.n_heads / hpt;
        let threads = cpu.threads();
        if rows < 4 * threads {
            // Decode (a few rows): one task per (row, few heads).
            cpu.team().chunks_rev(o, hpt * hd, 1, |idx, oh| {
                self.run(idx / pieces, 1, idx % pieces * hpt, &mut [oh]);
            });
            return;
        }
        // A prefill: one task per tile of rows, each block of keys and
        // values loaded once for the tile, not once per row from L3. The
        // last rows (the most keys) first.
        let longest = self.seqs.iter().map(|s| s.kv_len).max().unwrap_or(0) + self.bs;
        let tile = (SCORE_BYTES / (4 * hpt * longest))
            .clamp(1, MAX_TILE_ROWS)
            .min(rows.div_ceil(4 * threads));
        cpu.team().chunks_rev(o, tile * width, 1, |i, oh| {
            let r0 = i * tile;
            let n = oh.len() / width;
            for h0 in (0..p.n_heads).step_by(hpt) {
                let mut outs: Vec<&mut [f32]> = oh
                    .chunks_mut(width)
                    .map(|row| &mut row[h0 * hd..(h0 + hpt) * hd])
                    .collect();
                self.run(r0, n, h0, &mut outs);
            }
        });
    }

    /// Heads `h0..h0 + hpt` of query rows `r0..r0 + n` into `outs` (one per
    /// row), in runs of rows of the same sequence.
    fn run(&self, r0: usize, n: usize, h0: usize, outs: &mut [&mut [f32]]) {
        let (p, hd) = (self.p, self.p.head_dim);
        let width = p.n_heads * hd;
        let group = p.n_heads / p.n_kv_heads;
        let mut r = r0;
        while r < r0 + n {
            let Some((si, _)) = self.row_of[r] else {
                r += 1;
                continue;
            };
            let end = (r..r0 + n)
                .find(|&e| self.row_of[e].is_none_or(|(s, _)| s != si))
                .unwrap_or(r0 + n);
            let keys = Keys {
                seq: &self.seqs[si],
                kc: self.kc,
                vc: self.vc,
                kvh: h0 / group,
                bs: self.bs,
                hd,
                kv_width: p.n_kv_heads * hd,
            };
            let queries: Vec<Query<'_>> = (r..end)
                .map(|row| {
                    let pos = self.row_of[row].map_or(0, |(_, pos)| pos);
                    let mut qs: [&[f32]; vec::MAX_HEADS] = [&[]; vec::MAX_HEADS];
                    for (j, q) in qs.iter_mut().take(self.hpt).enumerate() {
                        *q = &self.qs[row * width + (h0 + j) * hd..][..hd];
                    }
                    Query {
                        qs,
                        first: p.sliding_window.map_or(0, |w| (pos + 1).saturating_sub(w)),
                        pos,
                    }
                })
                .collect();
            keys.attend(
                self.isa,
                &queries,
                self.hpt,
                p.scale,
                &mut outs[r - r0..end - r0],
            );
            r = end;
        }
    }
}

/// One query row of a kv head's group: its heads' queries and the
/// positions it sees, `first..=pos`.
struct Query<'a> {
    qs: [&'a [f32]; vec::MAX_HEADS],
    first: usize,
    pos: usize,
}

impl Query<'_> {
    /// The blocks holding the positions it sees.
    fn blocks(&self, bs: usize) -> std::ops::RangeInclusive<usize> {
        self.first / bs..=self.pos / bs
    }

    /// Its scores' length per head: the whole blocks it sees.
    fn span(&self, bs: usize) -> usize {
        (self.pos / bs + 1 - self.first / bs) * bs
    }
}

/// The keys and values of one kv head of one sequence.
struct Keys<'a, E> {
    seq: &'a SeqView<'a>,
    kc: &'a [E],
    vc: &'a [E],
    kvh: usize,
    bs: usize,
    hd: usize,
    kv_width: usize,
}

impl<E: KvElem> Keys<'_, E> {
    /// Where block `b`'s key tile of this kv head starts.
    fn key_tile(&self, b: usize) -> usize {
        (self.seq.table[b] as usize * (self.kv_width / self.hd) + self.kvh) * self.hd * self.bs
    }

    /// Where the value of position `t` (in block `b`) of this kv head starts.
    fn value_row(&self, b: usize, t: usize) -> usize {
        (self.seq.table[b] as usize * self.bs + t - b * self.bs) * self.kv_width
            + self.kvh * self.hd
    }

    /// Prefetches block `b`'s values of this kv head, positions `lo..hi`
    /// (clipped to the block).
    fn prefetch_values(&self, b: usize, lo: usize, hi: usize) {
        let (lo, hi) = (lo.max(b * self.bs), hi.min((b + 1) * self.bs));
        if lo < hi {
            let at = self.value_row(b, lo);
            prefetch_rows(self.vc, at, hi - lo, self.hd, self.kv_width);
        }
    }

    /// Attention of the query rows `rows` (`hpt` heads each, at most
    /// `MAX_HEADS`) over these keys into `outs` (`hpt` heads of `hd` per
    /// row). The rows share each block's loads; each row's result takes the
    /// same operations in the same order as it would alone.
    fn attend(
        &self,
        isa: Isa,
        rows: &[Query<'_>],
        hpt: usize,
        scale: f32,
        outs: &mut [&mut [f32]],
    ) {
        let bs = self.bs;
        let Some(b_first) = rows.iter().map(|q| q.first / bs).min() else {
            return;
        };
        // Each row's scores start at `base[i]`: `hpt` heads of its span.
        let mut base = Vec::with_capacity(rows.len() + 1);
        base.push(0);
        for q in rows {
            base.push(base[base.len() - 1] + hpt * q.span(bs));
        }
        let walk = Walk {
            isa,
            rows,
            hpt,
            blocks: b_first..=rows.iter().map(|q| q.pos / bs).max().unwrap_or(b_first),
            first: rows.iter().map(|q| q.first).min().unwrap_or(0),
            last: rows.iter().map(|q| q.pos).max().unwrap_or(0),
            base,
        };
        // A tile of rows widens each block of a bf16 or f16 cache once for
        // all of them; a row alone reads it as it lies, widened in the
        // registers (the same bits: widening is exact).
        let widen_once = E::KIND != vec::KvKind::F32 && rows.len() > 1;
        WIDE.with_borrow_mut(|wide| {
            SCORES.with_borrow_mut(|scores| {
                let mut wide = widen_once.then_some(wide);
                scores.resize(walk.base[rows.len()], 0.0);
                self.key_walk(&walk, scores, wide.as_deref_mut());
                for (i, q) in rows.iter().enumerate() {
                    let b0 = q.first / bs;
                    let visible = q.first - b0 * bs..q.pos + 1 - b0 * bs;
                    for head in scores[walk.base[i]..walk.base[i + 1]].chunks_mut(q.span(bs)) {
                        let v = &mut head[visible.clone()];
                        let (mut max, mut sum) = (f32::NEG_INFINITY, 0f32);
                        ew::scale_max(v, scale, &mut max);
                        ew::exp_sub_sum(v, max, &mut sum);
                        ew::div_in_place(v, sum);
                    }
                }
                outs.iter_mut().for_each(|o| o.fill(0.0));
                self.value_walk(&walk, scores, outs, wide);
            })
        });
    }

    /// Every row's scores (unscaled `q · k`), block by block; `wide`: where
    /// to widen each key tile first.
    fn key_walk(&self, walk: &Walk<'_>, scores: &mut [f32], mut wide: Option<&mut Vec<f32>>) {
        let (b_first, b_last) = (*walk.blocks.start(), *walk.blocks.end());
        let tile_len = self.hd * self.bs;
        // The key tiles lie where the block table puts them, a tile per
        // page or more apart: the hardware prefetcher does not follow
        // them, so the walk prefetches its own, `KEY_BLOCKS_AHEAD` ahead.
        for b in b_first + 1..(b_first + KEY_BLOCKS_AHEAD).min(b_last + 1) {
            prefetch_rows(self.kc, self.key_tile(b), 1, tile_len, 0);
        }
        for b in walk.blocks.clone() {
            if b + KEY_BLOCKS_AHEAD <= b_last {
                let next = self.key_tile(b + KEY_BLOCKS_AHEAD);
                prefetch_rows(self.kc, next, 1, tile_len, 0);
            } else if b == b_last {
                // The values come next.
                self.prefetch_values(b_first, walk.first, walk.last + 1);
            }
            let tile = &self.kc[self.key_tile(b)..][..tile_len];
            match wide.as_deref_mut() {
                Some(buf) => {
                    let buf = fit(buf, tile_len);
                    E::widen(tile, buf);
                    self.block_scores(walk, b, buf, scores);
                }
                None => self.block_scores(walk, b, tile, scores),
            }
        }
    }

    /// Block `b`'s scores of every row that sees it, from its key `tile`.
    fn block_scores<F: KvElem>(&self, walk: &Walk<'_>, b: usize, tile: &[F], scores: &mut [f32]) {
        let (bs, hpt) = (self.bs, walk.hpt);
        let mut lanes = [[0f32; vec::TILE_LANES]; vec::MAX_HEADS];
        for (i, q) in walk.rows.iter().enumerate() {
            if !q.blocks(bs).contains(&b) {
                continue;
            }
            let (span, j) = (q.span(bs), b - q.first / bs);
            let at = |h: usize| walk.base[i] + h * span + j * bs;
            if bs == vec::TILE_LANES {
                vec::tile_dot_heads(walk.isa, &q.qs[..hpt], tile, &mut lanes);
                for (h, l) in lanes.iter().take(hpt).enumerate() {
                    scores[at(h)..][..bs].copy_from_slice(l);
                }
            } else {
                for (h, qh) in q.qs[..hpt].iter().enumerate() {
                    tile_scores_any(qh, tile, &mut scores[at(h)..][..bs]);
                }
            }
        }
    }

    /// Every row's output, `Σ p_t · v_t` over its keys `first..=pos`, block
    /// by block (a block's run of tokens is rows `kv_width` apart); `wide`:
    /// where to widen each block's run first.
    fn value_walk(
        &self,
        walk: &Walk<'_>,
        scores: &[f32],
        outs: &mut [&mut [f32]],
        mut wide: Option<&mut Vec<f32>>,
    ) {
        let (bs, hd, kv_width) = (self.bs, self.hd, self.kv_width);
        let mut done: Vec<usize> = walk.rows.iter().map(|q| q.first % bs).collect();
        let b_last = *walk.blocks.end();
        for b in walk.blocks.clone() {
            if b < b_last {
                self.prefetch_values(b + 1, walk.first, walk.last + 1);
            }
            let (lo, hi) = ((b * bs).max(walk.first), ((b + 1) * bs).min(walk.last + 1));
            match wide.as_deref_mut() {
                Some(buf) => {
                    let buf = fit(buf, (hi - lo) * hd);
                    for (t, out) in buf.chunks_exact_mut(hd).enumerate() {
                        E::widen(&self.vc[self.value_row(b, lo + t)..][..hd], out);
                    }
                    let run = |t: usize| &buf[(t - lo) * hd..];
                    self.block_values(walk, b, run, hd, scores, outs, &mut done);
                }
                None => {
                    let run = |t: usize| &self.vc[self.value_row(b, t)..];
                    self.block_values(walk, b, run, kv_width, scores, outs, &mut done);
                }
            }
        }
    }

    /// Block `b`'s values into every row that sees it: `run(t)` is the
    /// values from position `t` on, rows `stride` apart; `done[i]`, how many
    /// of row `i`'s weights are spent.
    #[allow(clippy::too_many_arguments)]
    fn block_values<'v, F: KvElem>(
        &self,
        walk: &Walk<'_>,
        b: usize,
        run: impl Fn(usize) -> &'v [F],
        stride: usize,
        scores: &[f32],
        outs: &mut [&mut [f32]],
        done: &mut [usize],
    ) {
        let (bs, hpt) = (self.bs, walk.hpt);
        for (i, q) in walk.rows.iter().enumerate() {
            if !q.blocks(bs).contains(&b) {
                continue;
            }
            let (lo_q, hi_q) = ((b * bs).max(q.first), ((b + 1) * bs).min(q.pos + 1));
            let span = q.span(bs);
            let mut ws: [&[f32]; vec::MAX_HEADS] = [&[]; vec::MAX_HEADS];
            for (h, w) in ws.iter_mut().take(hpt).enumerate() {
                *w = &scores[walk.base[i] + h * span + done[i]..][..hi_q - lo_q];
            }
            vec::axpy_rows_heads(walk.isa, outs[i], self.hd, &ws[..hpt], run(lo_q), stride);
            done[i] += hi_q - lo_q;
        }
    }
}

/// One [`Keys::attend`] call's rows and the span of keys they see.
struct Walk<'a> {
    isa: Isa,
    rows: &'a [Query<'a>],
    hpt: usize,
    /// The blocks any row sees.
    blocks: std::ops::RangeInclusive<usize>,
    /// The first and last position any row sees.
    first: usize,
    last: usize,
    /// Where each row's scores start (`hpt` heads of its span), and their end.
    base: Vec<usize>,
}

/// `buf`'s first `len` elements, grown to hold them.
fn fit(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    &mut buf[..len]
}

/// `lanes[j] = Σ_d q[d] · tile[d * lanes.len() + j]`, summed over `d` in
/// order: blocks of other sizes than the default 16 ([`vec::tile_dot`]).
fn tile_scores_any<E: KvElem>(q: &[f32], tile: &[E], lanes: &mut [f32]) {
    lanes.fill(0.0);
    for (&qd, row) in q.iter().zip(tile.chunks_exact(lanes.len())) {
        for (a, &k) in lanes.iter_mut().zip(row) {
            *a += qd * k.to_f32();
        }
    }
}
