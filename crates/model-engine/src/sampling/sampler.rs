//! The per-sequence sampler: penalties, temperature, top-k / top-p / min-p,
//! then a draw from the sequence's own seeded generator.

use std::collections::{HashMap, HashSet};

use rand::rngs::{ChaCha8Rng, SysRng};
use rand::{Rng, SeedableRng};

use super::params::SamplingParams;
use crate::error::{EngineError, Result};

/// The token chosen at one step, with its log-probability and, when asked
/// ([`SamplingParams::top_logprobs`]), the most likely alternatives.
///
/// Every log-probability here is of the model's raw distribution:
/// log-softmax of the logits as given to [`Sampler::sample`], before
/// penalties, temperature and filters (vLLM's default "raw_logprobs", what
/// OpenAI's APIs report). It is the model's confidence in a token whatever
/// the sampling settings; the processed distribution would give 0 for every
/// greedy token. NaN logits count as -inf. The normalizer is summed in f64
/// around the largest logit; each value is rounded to f32 at the end.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// Log-probability of `token` under the raw distribution.
    pub logprob: f32,
    /// The `top_logprobs` most likely ids under the raw distribution with
    /// their log-probabilities, most likely first, the lower id first among
    /// equal logits. Ids whose logit is -inf or NaN (masked) are never
    /// listed, so there are fewer when fewer are finite. The sampled token
    /// is listed only if it is among them. Empty, without an allocation,
    /// when `top_logprobs` is 0.
    pub top_logprobs: Vec<(u32, f32)>,
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
        let raw = LogSoftmax::of(logits);
        let mut top_logprobs = top_n(logits, self.params.top_logprobs);
        for (_, value) in &mut top_logprobs {
            *value = raw.at(*value);
        }
        Ok(Sampled {
            token,
            logprob: raw.at(logits[token as usize]),
            top_logprobs,
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

/// The log-softmax of a vector of logits: `at(x)` is `x - max - ln Σ exp(y -
/// max)`, the sum in f64 (NaN logits count as -inf).
struct LogSoftmax {
    max: f32,
    log_sum: f64,
}

impl LogSoftmax {
    fn of(logits: &[f32]) -> Self {
        let max = logits
            .iter()
            .map(|&x| sanitize(x))
            .fold(f32::NEG_INFINITY, f32::max);
        let log_sum = if max == f32::NEG_INFINITY {
            0.0
        } else {
            logits
                .iter()
                .map(|&x| weight(sanitize(x), max))
                .sum::<f64>()
                .ln()
        };
        Self { max, log_sum }
    }

    /// The log-probability of a token whose logit is `x`.
    fn at(&self, x: f32) -> f32 {
        let x = sanitize(x);
        if x == f32::NEG_INFINITY || self.max == f32::NEG_INFINITY {
            return f32::NEG_INFINITY;
        }
        (f64::from(x - self.max) - self.log_sum) as f32
    }
}

/// The `n` largest logits (sanitized) with their ids, largest first, the
/// lower id first among equals; -inf and NaN are left out. A partial
/// selection in one pass (a sorted list of at most `n`, insertion by binary
/// search), not a sort of the vocabulary. Allocates nothing when `n` is 0.
fn top_n(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n.min(logits.len()));
    for (id, &x) in logits.iter().enumerate() {
        let x = sanitize(x);
        if x == f32::NEG_INFINITY || (top.len() == n && x <= top[n - 1].1) {
            continue;
        }
        // Ids come in ascending order: an equal value already listed has
        // the lower id and stays ahead.
        let at = top.partition_point(|&(_, y)| y >= x);
        if top.len() == n {
            top.pop();
        }
        top.insert(at, (id as u32, x));
    }
    top
}

/// A token scored under some logits ([`score`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Score {
    /// Its log-probability (log-softmax, as [`Sampled::logprob`]).
    pub logprob: f32,
    /// 1 + how many ids have a larger logit (vLLM's `rank`).
    pub rank: u32,
    /// The most likely ids with theirs (as [`Sampled::top_logprobs`]).
    pub top: Vec<(u32, f32)>,
}

/// `token` scored under `logits`, with the `top` most likely ids: what
/// the prompt's tokens are scored with.
pub fn score(logits: &[f32], token: u32, top: usize) -> Score {
    let raw = LogSoftmax::of(logits);
    let mut top = top_n(logits, top);
    for (_, value) in &mut top {
        *value = raw.at(*value);
    }
    let own = logits
        .get(token as usize)
        .map_or(f32::NEG_INFINITY, |&x| sanitize(x));
    let above = logits.iter().filter(|&&x| sanitize(x) > own).count();
    Score {
        logprob: raw.at(own),
        rank: u32::try_from(above + 1).unwrap_or(u32::MAX),
        top,
    }
}

/// A uniform number in [0, 1) from the top 53 bits of one `u64`.
fn uniform(rng: &mut ChaCha8Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample_top(logits: &[f32], n: usize) -> Sampled {
        let params = SamplingParams {
            top_logprobs: n,
            ..SamplingParams::greedy()
        };
        Sampler::new(&params, 0)
            .unwrap()
            .sample(logits, &[])
            .unwrap()
    }

    /// log-softmax in f64 over the finite logits.
    fn reference(logits: &[f32]) -> Vec<f64> {
        let max = logits
            .iter()
            .filter(|x| x.is_finite())
            .fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
        let lse = logits
            .iter()
            .filter(|x| x.is_finite())
            .map(|&x| (f64::from(x) - max).exp())
            .sum::<f64>()
            .ln()
            + max;
        logits
            .iter()
            .map(|&x| {
                if x.is_finite() {
                    f64::from(x) - lse
                } else {
                    f64::NEG_INFINITY
                }
            })
            .collect()
    }

    /// The full sort the selection must agree with: by log-probability
    /// descending, the lower id first among equals, masked ids left out.
    fn full_sort(logits: &[f32], n: usize) -> Vec<(u32, f64)> {
        let lp = reference(logits);
        let mut all: Vec<(u32, f64)> = (0..logits.len() as u32)
            .filter(|&i| logits[i as usize].is_finite())
            .map(|i| (i, lp[i as usize]))
            .collect();
        all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        all.truncate(n);
        all
    }

    #[test]
    fn ties_go_to_the_lower_id() {
        let logits = [1.0f32, 3.0, 3.0, 0.0, 3.0, 1.0];
        let ids = |n| -> Vec<u32> { top_n(&logits, n).iter().map(|e| e.0).collect() };
        assert_eq!(ids(1), [1]);
        assert_eq!(ids(2), [1, 2]);
        assert_eq!(ids(4), [1, 2, 4, 0]);
        assert_eq!(ids(6), [1, 2, 4, 0, 5, 3]);
        assert_eq!(ids(9), [1, 2, 4, 0, 5, 3], "no more than there are");
        let s = sample_top(&logits, 3);
        assert_eq!(s.token, 1);
        assert_eq!(s.top_logprobs[0], (1, s.logprob));
        assert_eq!(s.top_logprobs[1].1, s.logprob);
        assert_eq!(s.top_logprobs[2].1, s.logprob);
    }

    #[test]
    fn no_alternatives_when_none_are_asked() {
        let s = sample_top(&[0.5, 2.0, -1.0], 0);
        assert!(s.top_logprobs.is_empty());
        assert_eq!(s.top_logprobs.capacity(), 0, "nothing allocated");
        assert!(top_n(&[1.0; 100], 0).capacity() == 0);
    }

    #[test]
    fn masked_logits_are_never_alternatives() {
        let logits = [f32::NAN, 1.0, f32::NEG_INFINITY, 0.0, f32::NAN];
        let s = sample_top(&logits, 5);
        let ids: Vec<u32> = s.top_logprobs.iter().map(|e| e.0).collect();
        assert_eq!(ids, [1, 3]);
        let total: f32 = s.top_logprobs.iter().map(|e| e.1.exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
    }

    #[test]
    fn alternatives_ignore_temperature_filters_and_penalties() {
        let logits = [1.0f32, 2.0, 0.5, -1.0];
        let plain = sample_top(&logits, 4).top_logprobs;
        let params = SamplingParams {
            temperature: 0.3,
            top_k: 1,
            repetition_penalty: 1.7,
            frequency_penalty: 1.0,
            top_logprobs: 4,
            seed: Some(3),
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(&params, 1).unwrap();
        for _ in 0..5 {
            let out = s.sample(&logits, &[1, 1, 0]).unwrap();
            assert_eq!(out.top_logprobs, plain);
            let lp = reference(&logits)[out.token as usize];
            assert!((f64::from(out.logprob) - lp).abs() < 1e-6);
        }
    }

    #[test]
    fn more_than_twenty_is_refused() {
        let params = SamplingParams {
            top_logprobs: 21,
            ..SamplingParams::default()
        };
        let err = Sampler::new(&params, 0).unwrap_err();
        assert!(matches!(err, EngineError::Request(_)), "{err}");
        assert!(err.to_string().contains("top_logprobs"), "{err}");
        let params = SamplingParams {
            top_logprobs: 20,
            ..SamplingParams::default()
        };
        assert!(params.wants_logprobs());
        assert!(Sampler::new(&params, 0).is_ok());
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

        /// The selection equals a full sort of the log-softmax, and each
        /// value is the f64 log-softmax rounded to f32.
        #[test]
        fn top_n_equals_a_full_sort(
            logits in prop::collection::vec(
                prop_oneof![
                    8 => -40f32..40.0,
                    // Few distinct values: many ties.
                    2 => (-3i32..3).prop_map(|v| v as f32),
                    1 => Just(f32::NEG_INFINITY),
                    1 => Just(f32::NAN),
                ],
                1..400,
            ),
            n in 0usize..=20,
        ) {
            prop_assume!(logits.iter().any(|x| x.is_finite()));
            let got = sample_top(&logits, n);
            let want = full_sort(&logits, n);
            prop_assert_eq!(got.top_logprobs.len(), want.len());
            for (g, w) in got.top_logprobs.iter().zip(&want) {
                prop_assert_eq!(g.0, w.0);
                prop_assert!((f64::from(g.1) - w.1).abs() <= 1e-6 * w.1.abs().max(1.0),
                    "id {}: {} vs {}", g.0, g.1, w.1);
            }
            if n > 0 {
                prop_assert_eq!(got.top_logprobs[0], (got.token, got.logprob));
            }
            let total: f64 = got.top_logprobs.iter().map(|e| f64::from(e.1).exp()).sum();
            prop_assert!(total <= 1.0 + 1e-5, "{}", total);
        }
    }
}
