//! Decode steps replayed as device graphs (CUDA graphs), so that a small
//! model's decode is not bound by the host launching hundreds of kernels.
//!
//! A step is *graphable* when every sequence feeds exactly one token and
//! wants its logits, there are at most [`MAX_GRAPH_BATCH`] of them, the
//! backend captures graphs and `ModelOptions::cuda_graphs` is on. For such
//! a step of B sequences everything between the metadata upload and the
//! logits download (the layers, the gather of the logit rows, the final
//! norm, the LM head) queues the same kernels with the same device
//! addresses and scalar arguments for every step of B sequences: the
//! activations are the arena's regions cut to B rows, the metadata has a
//! fixed layout for B (`meta.rs`), the ops read each step's real positions,
//! context lengths, slots and block tables from that metadata on the
//! device. So the work is captured once per B and replayed:
//!
//! 1. the first step of B runs eagerly (the backend's scratch grows to
//!    what B needs: a capture may not allocate);
//! 2. the second captures the work into a graph (nothing runs while
//!    capturing) and replays it;
//! 3. later ones replay it. A graph the backend calls stale (its scratch
//!    moved since, after a larger step) is released and captured again.
//!
//! A capture that fails (something in the step cannot be captured) is
//! logged once and B stays eager. The metadata upload and the logits
//! download stay outside the graph. Graphs are released with the model
//! (first in teardown) and before new weights are attached.

use std::collections::BTreeMap;

use metrale_gpu_runtime::GpuError;
use metrale_gpu_runtime::gpu::{GpuBackend, GraphId};

use super::{Cx, Logits, Step, dev};
use crate::error::{EngineError, Result};
use crate::model::TransformerModel;
use crate::model::types::LOGIT_ROWS;
use crate::model::weights::ModelWeights;

/// The largest decode batch run as a graph: one LM-head pass.
pub const MAX_GRAPH_BATCH: usize = LOGIT_ROWS;

/// What the model knows about decode steps of one batch size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    /// Ran eagerly once: the next step captures.
    Warm,
    Captured(GraphId),
    /// The capture failed: steps of this size run eagerly.
    Eager,
}

/// Counters of the decode graphs, for reports and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Graphs alive now.
    pub live: usize,
    /// Captures made (recaptures of stale graphs included).
    pub captures: usize,
    /// Steps run by replaying a graph.
    pub replays: usize,
    /// Captures that failed (those batch sizes run eagerly).
    pub failed: usize,
}

/// The model's decode graphs, by batch size.
#[derive(Debug, Default)]
pub struct DecodeGraphs {
    by_batch: BTreeMap<usize, Entry>,
    stats: GraphStats,
}

impl DecodeGraphs {
    pub fn stats(&self) -> GraphStats {
        GraphStats {
            live: self
                .by_batch
                .values()
                .filter(|e| matches!(e, Entry::Captured(_)))
                .count(),
            ..self.stats
        }
    }

    /// Releases every graph (each is attempted; the first error returned).
    /// The model's first teardown step: graphs point into everything else.
    pub fn release(&mut self, gpu: &dyn GpuBackend) -> anyhow::Result<()> {
        let mut first: Option<anyhow::Error> = None;
        for (b, entry) in std::mem::take(&mut self.by_batch) {
            if let Entry::Captured(g) = entry
                && let Err(e) = gpu.release_graph(g)
                && first.is_none()
            {
                first = Some(anyhow::Error::new(e).context(format!("decode graph of batch {b}")));
            }
        }
        first.map_or(Ok(()), Err)
    }
}

/// The batch size of a graphable step of `steps` (see the module docs).
pub(super) fn graph_batch(
    steps: &[Step<'_>],
    enabled: bool,
    gpu: &dyn GpuBackend,
) -> Option<usize> {
    let b = steps.len();
    let decode = steps
        .iter()
        .all(|s| s.tokens.len() == 1 && s.logits != Logits::None);
    (enabled && decode && (1..=MAX_GRAPH_BATCH).contains(&b) && gpu.graphs_supported()).then_some(b)
}

impl TransformerModel {
    /// Counters of this model's decode graphs.
    pub fn graph_stats(&self) -> GraphStats {
        self.graphs.lock().stats()
    }

    /// A graphable step of `b` sequences (metadata uploaded): replays, or
    /// warms up, or captures then replays; the logits of the `b` rows.
    pub(super) fn forward_graphed(
        &self,
        cx: &Cx<'_>,
        w: &ModelWeights,
        b: usize,
        counts: &[usize],
    ) -> Result<Vec<Vec<f32>>> {
        let gpu = cx.gpu;
        let mut graphs = self.graphs.lock();
        let eager = |this: &Self| {
            this.run_layers(cx, w)
                .and_then(|_| this.logits(cx, w, counts))
        };
        let mut entry = graphs.by_batch.get(&b).copied();
        if let Some(Entry::Captured(g)) = entry {
            if gpu.replay(g).map_err(dev("graph replay"))? {
                graphs.stats.replays += 1;
                return self.graph_logits(cx, b, counts);
            }
            // Stale: the backend's scratch moved. Capture again.
            if let Err(e) = gpu.release_graph(g) {
                tracing::warn!("releasing a stale decode graph of batch {b}: {e}");
            }
            entry = Some(Entry::Warm);
        }
        match entry {
            None => {
                graphs.by_batch.insert(b, Entry::Warm);
                return eager(self);
            }
            Some(Entry::Eager) => return eager(self),
            Some(Entry::Warm | Entry::Captured(_)) => {}
        }
        let mut failure: Option<EngineError> = None;
        let captured = gpu.capture(&mut || {
            self.graph_body(cx, w, b).map_err(|e| {
                let message = e.to_string();
                failure = Some(e);
                GpuError::Unavailable(message)
            })
        });
        let g = match captured {
            Ok(g) => g,
            Err(e) => {
                let why = failure.map_or_else(|| e.to_string(), |f| f.to_string());
                tracing::warn!(
                    "decode steps of {b} sequence(s) run without a graph: capture failed: {why}"
                );
                graphs.by_batch.insert(b, Entry::Eager);
                graphs.stats.failed += 1;
                return eager(self);
            }
        };
        graphs.by_batch.insert(b, Entry::Captured(g));
        graphs.stats.captures += 1;
        if !gpu.replay(g).map_err(dev("graph replay"))? {
            // Stale at once (cannot happen: a capture allocates nothing).
            return eager(self);
        }
        graphs.stats.replays += 1;
        self.graph_logits(cx, b, counts)
    }

    /// What a decode graph holds: the layers, then the LM head over the
    /// `b` logit rows (one pass, as `logits` makes it), into the arena's
    /// `logits` region.
    fn graph_body(&self, cx: &Cx<'_>, w: &ModelWeights, b: usize) -> Result<()> {
        self.run_layers(cx, w)?;
        self.logit_pass(cx, w, 0, b).map(|_| ())
    }

    /// After a replay: downloads the `b` rows' logits.
    fn graph_logits(&self, cx: &Cx<'_>, b: usize, counts: &[usize]) -> Result<Vec<Vec<f32>>> {
        let vocab = self.config.vocab_size;
        let out = cx.s.logits.slice(0, b * vocab).map_err(dev("logits"))?;
        let all = cx.gpu.download_f32(out).map_err(dev("logits download"))?;
        Ok(self.split_logits(all, counts))
    }
}
