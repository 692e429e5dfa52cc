//! The per-sequence sampler: penalties, temperature, top-k / top-p / min-p,
//! then a draw from the sequence's own seeded generator.

use std::collections::{HashMap, HashSet};

use rand::rngs::{ChaCha8Rng, SysRng};
use rand::{Rng, SeedableRng};

use super::params::SamplingParams;
use crate::error::{EngineError, Result};

/// The token chosen at one step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// Log-probability of `token` under the model's raw distribution:
    /// log-softmax of the logits as given, before penalties, temperature and
    /// filters (vLLM's default "raw_logprobs"). It is the model's confidence
    /// in the token whatever the sampling settings; the processed
    /// distribution would give 0 for every greedy token.
    pub logprob: f32,
}

/// Chooses the tokens of one sequence.
///
/// Each step runs, in this order: repetition, presence and frequency
/// penalties; temperature; the top-k, top-p and min-p filters; a draw from
/// what is left. Greedy sampling (temperature 0) is an exact argmax, lowest
/// id on ties, and draws nothing from the generator, so a greedy sequence is
/// deterministic without a seed. A sampled step draws exactly one number.
///
/// The generator is ChaCha8 seeded with `seed` (`seed_from_u64`), so a seed
/// gives the same tokens for the same logits on every machine and run.
///
/// Working memory (a copy of the logits, a candidate list and their weights)
/// is kept between steps; penalty bookkeeping is only kept when a penalty is
/// on.
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    prompt_len: usize,
    ingested: usize,
    /// Distinct tokens of the prompt and output (repetition penalty).
    seen: HashSet<u32>,
    /// How often each token was generated (presence / frequency penalties).
    generated: HashMap<u32, u32>,
    work: Vec<f32>,
    candidates: Vec<u32>,
    weights: Vec<f64>,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler")
            .field("params", &self.params)
            .field("prompt_len", &self.prompt_len)
            .field("ingested", &self.ingested)
            .finish_non_exhaustive()
    }
}

impl Sampler {
    /// A sampler for a sequence whose first `prompt_len` tokens are the
    /// prompt. Fails if `params` do not validate.
    pub fn new(params: &SamplingParams, prompt_len: usize) -> Result<Self> {
        params.validate()?;
        let rng = match params.seed {
            Some(seed) => ChaCha8Rng::seed_from_u64(seed),
            None => ChaCha8Rng::try_from_rng(&mut SysRng)
                .map_err(|e| EngineError::Sampling(format!("cannot seed from the OS: {e}")))?,
        };
        Ok(Self {
            params: params.clone(),
            rng,
            prompt_len,
            ingested: 0,
            seen: HashSet::new(),
            generated: HashMap::new(),
            work: Vec::new(),
            candidates: Vec::new(),
            weights: Vec::new(),
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Chooses the next token from `logits` (one per vocabulary id).
    /// `history` is the sequence so far: the prompt, then every generated
    /// token; only what was not seen by earlier calls is read again.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> Result<Sampled> {
        if logits.is_empty() {
            return Err(EngineError::Sampling("no logits".into()));
        }
        self.ingest(history);

        self.work.clear();
        self.work.extend(logits.iter().map(|&x| sanitize(x)));
        self.apply_penalties();

        let token = if self.params.is_greedy() {
            argmax(&self.work).ok_or_else(all_masked)?
        } else {
            self.draw()?
        };
        Ok(Sampled {
            token,
            logprob: raw_logprob(logits, token as usize),
        })
    }

    /// Updates the penalty bookkeeping with the tokens of `history` not yet
    /// read (all of it again if it shrank).
    fn ingest(&mut self, history: &[u32]) {
        let track_seen = self.params.repetition_penalty != 1.0;
        let track_counts =
            self.params.presence_penalty != 0.0 || self.params.frequency_penalty != 0.0;
        if !track_seen && !track_counts {
            self.ingested = history.len();
            return;
        }
        if history.len() < self.ingested {
            self.seen.clear();
            self.generated.clear();
            self.ingested = 0;
        }
        let start = self.ingested;
        for (pos, &token) in history.iter().enumerate().skip(start) {
            if track_seen {
                self.seen.insert(token);
            }
            if track_counts && pos >= self.prompt_len {
                *self.generated.entry(token).or_insert(0) += 1;
            }
        }
        self.ingested = history.len();
    }

    fn apply_penalties(&mut self) {
        let rep = self.params.repetition_penalty;
        if rep != 1.0 {
            for &token in &self.seen {
                if let Some(x) = self.work.get_mut(token as usize) {
                    *x = if *x > 0.0 { *x / rep } else { *x * rep };
                }
            }
        }
        let (presence, frequency) = (self.params.presence_penalty, self.params.frequency_penalty);
        if presence != 0.0 || frequency != 0.0 {
            for (&token, &count) in &self.generated {
                if let Some(x) = self.work.get_mut(token as usize) {
                    *x -= frequency * count as f32 + presence;
                }
            }
        }
    }

    /// Temperature, filters, and one draw from the generator.
    fn draw(&mut self) -> Result<u32> {
        let temperature = self.params.temperature;
        if temperature != 1.0 {
            for x in &mut self.work {
                *x = sanitize(*x / temperature);
            }
        }
        let work = &self.work;
        self.candidates.clear();
        self.candidates
            .extend((0..work.len() as u32).filter(|&i| work[i as usize] > f32::NEG_INFINITY));
        if self.candidates.is_empty() {
            return Err(all_masked());
        }
        // Most likely first, lowest id first among equals.
        let by_rank = |a: &u32, b: &u32| {
            work[*b as usize]
                .total_cmp(&work[*a as usize])
                .then(a.cmp(b))
        };

        let top_k = self.params.top_k;
        if top_k > 0 && top_k < self.candidates.len() {
            self.candidates.select_nth_unstable_by(top_k - 1, by_rank);
            self.candidates.truncate(top_k);
        }

        let top_p = self.params.top_p;
        if top_p < 1.0 {
            self.candidates.sort_unstable_by(by_rank);
            let max = work[self.candidates[0] as usize];
            let total: f64 = self
                .candidates
                .iter()
                .map(|&i| weight(work[i as usize], max))
                .sum();
            let target = f64::from(top_p) * total;
            let mut cumulative = 0.0;
            let mut keep = self.candidates.len();
            for (n, &i) in self.candidates.iter().enumerate() {
                cumulative += weight(work[i as usize], max);
                if cumulative >= target {
                    keep = n + 1;
                    break;
                }
            }
            self.candidates.truncate(keep);
        }

        let max = self
            .candidates
            .iter()
            .map(|&i| work[i as usize])
            .fold(f32::NEG_INFINITY, f32::max);
        let min_p = self.params.min_p;
        if min_p > 0.0 {
            // p_i >= min_p * p_max  <=>  logit_i >= max + ln(min_p)
            let threshold = max + min_p.ln();
            self.candidates.retain(|&i| work[i as usize] >= threshold);
        }

        self.weights.clear();
        self.weights.extend(
            self.candidates
                .iter()
                .map(|&i| weight(work[i as usize], max)),
        );
        let total: f64 = self.weights.iter().sum();
        let mut target = uniform(&mut self.rng) * total;
        for (n, &w) in self.weights.iter().enumerate() {
            if target < w {
                return Ok(self.candidates[n]);
            }
            target -= w;
        }
        // Rounding can leave a sliver past the last weight.
        self.candidates.last().copied().ok_or_else(all_masked)
    }
}

fn all_masked() -> EngineError {
    EngineError::Sampling("every logit is NaN or -inf".into())
}

/// NaN becomes -inf (never chosen), +inf the largest finite value.
fn sanitize(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else {
        x.min(f32::MAX)
    }
}

fn weight(x: f32, max: f32) -> f64 {
    f64::from(x - max).exp()
}

/// Index of the largest value, the lowest on ties; `None` if all are -inf.
fn argmax(values: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in values.iter().enumerate() {
        if x > best.map_or(f32::NEG_INFINITY, |(_, b)| b) {
            best = Some((i, x));
        }
    }
    best.map(|(i, _)| i as u32)
}

/// log-softmax of `logits` at `index` (NaN logits count as -inf).
fn raw_logprob(logits: &[f32], index: usize) -> f32 {
    let max = logits
        .iter()
        .map(|&x| sanitize(x))
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return f32::NEG_INFINITY;
    }
    let sum: f64 = logits.iter().map(|&x| weight(sanitize(x), max)).sum();
    let x = logits
        .get(index)
        .map_or(f32::NEG_INFINITY, |&x| sanitize(x));
    (f64::from(x - max) - sum.ln()) as f32
}

/// A uniform number in [0, 1) from the top 53 bits of one `u64`.
fn uniform(rng: &mut ChaCha8Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}
