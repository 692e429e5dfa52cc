//! Structured outputs in the step: the grammar masks of the requests a step
//! will sample are computed while its forward pass runs, not after it, on a
//! thread of their own (several requests' masks in parallel on rayon's
//! pool), so a constraint adds little to a step's time when the mask takes
//! less than the forward pass.

use rayon::prelude::*;

use super::Engine;
use super::request::RequestId;
use super::scheduler::Scheduled;
use crate::error::Result;
use crate::sampling::Grammar;

impl Engine {
    /// [`forward`](Engine::forward), with the next masks of the grammars
    /// of the requests it will sample computed beside it and left in
    /// those requests (`next_mask`).
    pub(super) fn forward_masking(&mut self, plan: &[Scheduled]) -> Result<Vec<super::StepLogits>> {
        let mut grammars = self.take_due_grammars(plan);
        if grammars.is_empty() {
            return self.forward(plan);
        }
        let (outputs, masks) = std::thread::scope(|scope| {
            let masking = scope.spawn(|| {
                if grammars.len() == 1 {
                    grammars
                        .iter_mut()
                        .map(|(_, g)| g.mask())
                        .collect::<Vec<_>>()
                } else {
                    grammars.par_iter_mut().map(|(_, g)| g.mask()).collect()
                }
            });
            let outputs = self.forward(plan);
            let masks = masking.join();
            (outputs, masks)
        });
        let masks = match masks {
            Ok(masks) => masks
                .into_iter()
                .map(|m| m.map_err(|e| e.to_string()))
                .collect(),
            Err(_) => vec![
                Err("structured output: the mask computation panicked".to_owned());
                grammars.len()
            ],
        };
        for ((id, grammar), mask) in grammars.into_iter().zip(masks) {
            if let Some(r) = self.running.iter_mut().find(|r| r.id == id) {
                r.grammar = Some(grammar);
                r.next_mask = Some(mask);
            }
        }
        outputs
    }

    /// Takes out the grammars of the requests `plan` finishes feeding (the
    /// step gives them logits to sample), with their ids.
    fn take_due_grammars(&mut self, plan: &[Scheduled]) -> Vec<(RequestId, Grammar)> {
        let mut due = Vec::new();
        for r in self.running.iter_mut() {
            if r.grammar.is_none() {
                continue;
            }
            let Some(s) = plan.iter().find(|s| s.id == r.id) else {
                continue;
            };
            if s.tokens == r.pending()
                && let Some(grammar) = r.grammar.take()
            {
                r.next_mask = None;
                due.push((r.id, grammar));
            }
        }
        due
    }
}
