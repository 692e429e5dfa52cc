//! Choosing what one step runs: a token budget shared by running decodes
//! (first), prefill chunks of running requests, then new requests admitted by
//! the memory plan (an SSM slot free, KV blocks for their first chunk). A
//! step with decodes takes at most `mixed_prefill_tokens` prompt tokens
//! besides, so that it stays short: every running decode is in every step
//! (at most as many requests run as a step has tokens), and the step's
//! length is the decoding sequences' time between tokens.
//!
//! With prefix caching, an admitted request first takes what the cache holds
//! of its prompt (`TransformerModel::reuse_prefix`) and is budgeted for the
//! rest; a recurrent sequence's prefill chunk ends at the last snapshot
//! point it reaches, so the state there can be snapshotted after the step.
//!
//! When a running decode finds no free KV block, the youngest running request
//! is preempted: its sequence is freed and it goes back to the queue with its
//! prompt and output so far, to be prefilled again (recompute; with prefix
//! caching, from what the cache still holds of it). When every
//! running request is mid-prefill and none can continue, the youngest is
//! preempted too, so the cache never deadlocks.

use super::Engine;
use super::request::{Event, Request, RequestId};
use crate::error::EngineError;

/// One request's share of a step: its next `tokens` pending tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Scheduled {
    pub id: RequestId,
    pub tokens: usize,
}

/// What is left of a step's tokens and of the free KV blocks.
struct Budget {
    tokens: usize,
    /// Free blocks minus those this plan will take.
    free_blocks: usize,
    /// Blocks this plan will take.
    reserved: usize,
    block_size: usize,
    /// Whether the model has attention layers (a KV cache to fit into).
    paged: bool,
}

impl Budget {
    /// Most of `want` tokens a sequence at `pos` holding `blocks` blocks can take.
    fn fit(&self, pos: usize, blocks: usize, want: usize) -> usize {
        let n = want.min(self.tokens);
        if !self.paged {
            return n;
        }
        n.min(((blocks + self.free_blocks) * self.block_size).saturating_sub(pos))
    }

    fn take(&mut self, pos: usize, blocks: usize, n: usize) {
        self.tokens -= n;
        if self.paged {
            let new = (pos + n).div_ceil(self.block_size).saturating_sub(blocks);
            self.free_blocks = self.free_blocks.saturating_sub(new);
            self.reserved += new;
        }
    }

    /// After blocks were freed: the cache's free count less this plan's.
    fn refresh(&mut self, free_in_cache: usize) {
        self.free_blocks = free_in_cache.saturating_sub(self.reserved);
    }
}

/// The most prompt tokens a request that scores its prompt feeds in one
/// step: 256 rows of logits, 150 MB on the host for a 150k vocabulary.
pub(super) const SCORED_CHUNK: usize = 256;

impl Engine {
    /// The requests of the next step and how many tokens each feeds. Errors
    /// of single requests (e.g. a device failure clearing a slot) become
    /// `Error` events and remove them.
    pub(super) fn schedule(&mut self, events: &mut Vec<Event>) -> Vec<Scheduled> {
        loop {
            let mut budget = self.budget();
            let mut plan = Vec::new();
            let preempted = self.schedule_decodes(&mut budget, &mut plan);
            if !plan.is_empty() && self.config.mixed_prefill_tokens > 0 {
                budget.tokens = budget.tokens.min(self.config.mixed_prefill_tokens);
            }
            self.schedule_prefills(&mut budget, &mut plan);
            if !preempted {
                self.admit(&mut budget, &mut plan, events);
            }
            if !plan.is_empty() || self.running.is_empty() {
                return plan;
            }
            // Every running request is mid-prefill and the cache is full.
            self.preempt(self.running.len() - 1);
        }
    }

    fn budget(&self) -> Budget {
        let kv = self.model.kv_cache();
        Budget {
            tokens: self.step_tokens(),
            free_blocks: kv.free_blocks(),
            reserved: 0,
            block_size: kv.block_size(),
            paged: self.paged,
        }
    }

    /// Most tokens of `r` in a step, of its `pending`. A request scoring
    /// its prompt takes every row's logits (a row of the vocabulary's size
    /// each, on the host), so its chunks are at most
    /// [`SCORED_CHUNK`] tokens.
    fn chunk(&self, r: &Request, pending: usize) -> usize {
        let pending = if r.params.prompt_logprobs.is_some() {
            pending.min(SCORED_CHUNK)
        } else {
            pending
        };
        match self.config.prefill_chunk {
            0 => pending,
            cap => pending.min(cap),
        }
    }

    /// Running requests with one pending token, oldest first; returns
    /// whether a request was preempted to make room.
    fn schedule_decodes(&mut self, budget: &mut Budget, plan: &mut Vec<Scheduled>) -> bool {
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i];
            if r.pending() != 1 {
                i += 1;
                continue;
            }
            let (pos, blocks) = (r.position(), r.kv_blocks());
            if budget.fit(pos, blocks, 1) == 1 {
                budget.take(pos, blocks, 1);
                plan.push(Scheduled {
                    id: r.id,
                    tokens: 1,
                });
                i += 1;
            } else if budget.tokens == 0 {
                i += 1;
            } else {
                // The youngest request not yet scheduled (this one, if it is
                // the youngest) gives its blocks back.
                self.preempt(self.running.len() - 1);
                budget.refresh(self.model.kv_cache().free_blocks());
                preempted = true;
            }
        }
        preempted
    }

    /// Running requests mid-prefill, oldest first, each as much as fits.
    fn schedule_prefills(&mut self, budget: &mut Budget, plan: &mut Vec<Scheduled>) {
        for r in &self.running {
            let pending = r.pending();
            if pending <= 1 {
                continue;
            }
            let (pos, blocks) = (r.position(), r.kv_blocks());
            let n = budget.fit(
                pos,
                blocks,
                self.snapshot_cut(r, pos, self.chunk(r, pending)),
            );
            if n > 0 {
                budget.take(pos, blocks, n);
                plan.push(Scheduled {
                    id: r.id,
                    tokens: n,
                });
            }
        }
    }

    /// Starts waiting requests, first come first served, while a slot is
    /// free and each one's first chunk (as much as the step's tokens leave,
    /// after what the prefix cache holds of its prompt) fits in the free KV
    /// blocks. The first that does not fit stops admission: later requests
    /// do not overtake it.
    fn admit(&mut self, budget: &mut Budget, plan: &mut Vec<Scheduled>, events: &mut Vec<Event>) {
        while let Some(front) = self.waiting.front() {
            if self.running.len() >= self.max_running() {
                return;
            }
            // A request scoring its prompt computes all of it.
            let scores = front.params.prompt_logprobs.is_some();
            let reuse = if scores {
                0
            } else {
                self.model.probe_prefix(&front.tokens)
            };
            let held = if budget.paged {
                reuse / budget.block_size
            } else {
                0
            };
            let want = self.first_chunk(front, reuse, budget.tokens);
            if want == 0 || budget.fit(reuse, held, want) < want {
                return;
            }
            let seq = match self.model.new_sequence() {
                Ok(seq) => seq,
                Err(EngineError::Exhausted { .. }) => return,
                Err(e) => {
                    if let Some(r) = self.waiting.pop_front() {
                        events.push(Event::Error {
                            id: r.id,
                            message: format!("starting the sequence: {e}"),
                        });
                    }
                    continue;
                }
            };
            let Some(mut r) = self.waiting.pop_front() else {
                self.model.free_sequence(seq);
                return;
            };
            r.seq = Some(seq);
            if let Err(e) = self.reuse_prefix(&mut r, scores) {
                self.remove_failed(r, format!("starting from a cached prefix: {e}"), events);
                continue;
            }
            // Shared blocks only the cache held are no longer free.
            budget.refresh(self.model.kv_cache().free_blocks());
            let (pos, blocks) = (r.position(), r.kv_blocks());
            let want = self.first_chunk(&r, pos, budget.tokens);
            if want == 0 || budget.fit(pos, blocks, want) < want {
                // Back to the front of the queue, holding nothing.
                if let Some(seq) = r.seq.take() {
                    self.model.free_sequence(seq);
                }
                self.waiting.push_front(r);
                return;
            }
            budget.take(pos, blocks, want);
            plan.push(Scheduled {
                id: r.id,
                tokens: want,
            });
            self.insert_running(r);
        }
    }

    /// The first chunk of `r` if it starts at `pos`, within `tokens`.
    fn first_chunk(&self, r: &Request, pos: usize, tokens: usize) -> usize {
        let pending = r.tokens.len().saturating_sub(pos);
        self.snapshot_cut(r, pos, self.chunk(r, pending).min(tokens))
    }

    /// Starts `r`'s fresh sequence from the longest cached prefix of its
    /// tokens, counting what it saved.
    fn reuse_prefix(&mut self, r: &mut Request, scores: bool) -> crate::error::Result<()> {
        let Some(seq) = r.seq.as_mut() else {
            return Ok(());
        };
        if scores {
            r.cached_tokens.get_or_insert(0);
            return Ok(());
        }
        let hit = self.model.reuse_prefix(seq, &r.tokens)?;
        self.stats.prefix_hit_tokens += hit.tokens as u64;
        r.cached_tokens.get_or_insert(hit.tokens.min(r.prompt_len));
        self.stats.prefix_recomputed_tokens += (hit.matched - hit.tokens) as u64;
        // Snapshot where the match ended, so the next request sharing this
        // prefix starts there.
        r.snapshot_at =
            (hit.matched > hit.tokens && self.model.caches_state()).then_some(hit.matched);
        Ok(())
    }

    /// Ends a request that failed before it ran, freeing its sequence.
    fn remove_failed(&mut self, mut r: Request, message: String, events: &mut Vec<Event>) {
        if let Some(seq) = r.seq.take() {
            self.model.free_sequence(seq);
        }
        events.push(Event::Error { id: r.id, message });
    }

    /// Most of `n` tokens `r`, at `pos`, may feed next without passing a
    /// point where its recurrent state is to be snapshotted.
    fn snapshot_cut(&self, r: &Request, pos: usize, n: usize) -> usize {
        let mut end = pos + n;
        if let Some(p) = self.model.last_snapshot_point(pos, end) {
            end = p;
        }
        if let Some(m) = r.snapshot_at.filter(|&m| m > pos) {
            end = end.min(m);
        }
        end - pos
    }

    /// Concurrent requests: SSM slots (or `max_seqs` for models without
    /// recurrent layers), and no more than a step's tokens, so that every
    /// running decode fits in each step.
    pub(super) fn max_running(&self) -> usize {
        self.model.options().max_seqs.min(self.step_tokens()).max(1)
    }

    /// Keeps `running` in arrival order (a preempted request comes back
    /// among younger ones).
    fn insert_running(&mut self, r: Request) {
        let at = self.running.partition_point(|x| x.id < r.id);
        self.running.insert(at, r);
    }

    /// Frees the sequence of `running[index]` and queues the request again,
    /// ahead of every younger one.
    pub(super) fn preempt(&mut self, index: usize) {
        if index >= self.running.len() {
            return;
        }
        let mut r = self.running.remove(index);
        if let Some(mut seq) = r.seq.take() {
            // Cached, the work done so far is reused when the request
            // starts again (unless memory pressure evicts it first).
            self.model.finish_prefix(&mut seq, &r.tokens);
            self.model.free_sequence(seq);
        }
        self.stats.preemptions += 1;
        tracing::debug!("preempted {} after {} tokens", r.id, r.tokens.len());
        let at = self.waiting.partition_point(|x| x.id < r.id);
        self.waiting.insert(at, r);
    }
}
