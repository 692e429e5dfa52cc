//! Prometheus metrics, written as text by `GET /metrics`.
//!
//! Two views of the requests in flight. `metrale_requests_running` /
//! `metrale_requests_waiting` are the server's: a request waits from its
//! submission to its first token (queued in the engine or being prefilled)
//! and runs from then to its end (the 429 bound counts these waiting
//! requests). `metrale_sequences_running` / `metrale_sequences_waiting`
//! are the engine's ([`EngineGauges`](crate::engine::engine::EngineGauges)):
//! requests holding a sequence, and requests queued for memory; with
//! `metrale_kv_blocks_in_use` and `metrale_ssm_slots_in_use` (and their
//! `_total` capacities) as of the engine's last step, queueing or cancel.
//! The prefix cache's: `metrale_kv_blocks_cached` and
//! `metrale_prefix_snapshot_bytes` (what it holds), and the prompt tokens it
//! saved (`metrale_prefix_cache_hit_tokens_total`) or matched but had to
//! recompute (`metrale_prefix_cache_recomputed_tokens_total`).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use crate::engine::engine::GaugeValues;

/// Upper bounds (seconds) of the latency histograms' buckets.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    5.0,
];

/// A histogram with fixed buckets.
#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, value: f64) {
        for (bound, count) in self.bounds.iter().zip(&mut self.counts) {
            if value <= *bound {
                *count += 1;
            }
        }
        self.sum += value;
        self.count += 1;
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (bound, count) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {count}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

/// The server's counters, gauges and histograms.
#[derive(Debug)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    running: AtomicI64,
    waiting: AtomicI64,
    ttft: Mutex<Histogram>,
    itl: Mutex<Histogram>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            requests: Mutex::default(),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            running: AtomicI64::new(0),
            waiting: AtomicI64::new(0),
            ttft: Mutex::new(Histogram::new(TTFT_BUCKETS)),
            itl: Mutex::new(Histogram::new(ITL_BUCKETS)),
        }
    }
}

impl Metrics {
    /// Counts a finished HTTP request (its status is the response's).
    pub fn request(&self, route: &str, status: u16) {
        let mut requests = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *requests.entry((route.to_owned(), status)).or_default() += 1;
    }

    pub fn prompt_tokens(&self, n: usize) {
        self.prompt_tokens.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub fn generated_token(&self) {
        self.generation_tokens.fetch_add(1, Ordering::Relaxed);
    }

    pub fn time_to_first_token(&self, time: Duration) {
        let mut h = self.ttft.lock().unwrap_or_else(|e| e.into_inner());
        h.observe(time.as_secs_f64());
    }

    pub fn inter_token_latency(&self, time: Duration) {
        let mut h = self.itl.lock().unwrap_or_else(|e| e.into_inner());
        h.observe(time.as_secs_f64());
    }

    /// Reserves `count` places among the waiting requests unless that
    /// would make more than `limit` wait; returns whether it did.
    pub fn try_wait_many(&self, count: usize, limit: usize) -> bool {
        let (count, limit) = (count as i64, limit as i64);
        self.waiting
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |waiting| {
                waiting.checked_add(count).filter(|&total| total <= limit)
            })
            .is_ok()
    }

    /// Gives back `count` reserved places that were never used.
    pub fn unwait(&self, count: usize) {
        self.waiting.fetch_sub(count as i64, Ordering::SeqCst);
    }

    /// A waiting request got its first token.
    pub fn started(&self) {
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        self.running.fetch_add(1, Ordering::SeqCst);
    }

    /// A request ended (finished, failed or cancelled); `started` says
    /// whether it had run.
    pub fn ended(&self, started: bool) {
        let gauge = if started {
            &self.running
        } else {
            &self.waiting
        };
        gauge.fetch_sub(1, Ordering::SeqCst);
    }

    pub fn running(&self) -> i64 {
        self.running.load(Ordering::SeqCst)
    }

    pub fn waiting(&self) -> i64 {
        self.waiting.load(Ordering::SeqCst)
    }

    /// The Prometheus text exposition.
    pub fn render(&self, engine: &GaugeValues) -> String {
        let mut out = String::new();
        out.push_str("# HELP metrale_requests_total HTTP requests by route and status.\n");
        out.push_str("# TYPE metrale_requests_total counter\n");
        for ((route, status), n) in self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "metrale_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}"
            );
        }
        for (name, help, kind, value) in [
            (
                "metrale_prompt_tokens_total",
                "Prompt tokens of finished requests.",
                "counter",
                self.prompt_tokens.load(Ordering::Relaxed) as i64,
            ),
            (
                "metrale_generation_tokens_total",
                "Tokens generated.",
                "counter",
                self.generation_tokens.load(Ordering::Relaxed) as i64,
            ),
            (
                "metrale_requests_running",
                "Requests generating (past their first token).",
                "gauge",
                self.running(),
            ),
            (
                "metrale_requests_waiting",
                "Requests submitted that have no token yet (queued or prefilling).",
                "gauge",
                self.waiting(),
            ),
            (
                "metrale_sequences_running",
                "Requests holding a sequence in the engine (prefilling or decoding).",
                "gauge",
                engine.running as i64,
            ),
            (
                "metrale_sequences_waiting",
                "Requests queued in the engine for memory (no sequence yet).",
                "gauge",
                engine.waiting as i64,
            ),
            (
                "metrale_kv_blocks_in_use",
                "KV cache blocks held by sequences.",
                "gauge",
                engine.kv_blocks_in_use as i64,
            ),
            (
                "metrale_kv_blocks_total",
                "KV cache blocks in all.",
                "gauge",
                engine.kv_blocks_total as i64,
            ),
            (
                "metrale_ssm_slots_in_use",
                "SSM state slots held by sequences.",
                "gauge",
                engine.ssm_slots_in_use as i64,
            ),
            (
                "metrale_ssm_slots_total",
                "SSM state slots in all.",
                "gauge",
                engine.ssm_slots_total as i64,
            ),
            (
                "metrale_kv_blocks_cached",
                "KV cache blocks held by the prefix cache (some also by sequences).",
                "gauge",
                engine.kv_blocks_cached as i64,
            ),
            (
                "metrale_prefix_snapshot_bytes",
                "Bytes of recurrent-state snapshots held by the prefix cache.",
                "gauge",
                engine.snapshot_bytes as i64,
            ),
            (
                "metrale_prefix_cache_hit_tokens_total",
                "Prompt tokens whose computation a cached prefix saved.",
                "counter",
                engine.prefix_hit_tokens as i64,
            ),
            (
                "metrale_prefix_cache_recomputed_tokens_total",
                "Prompt tokens the prefix cache matched but recomputed (the nearest state snapshot lay before them).",
                "counter",
                engine.prefix_recomputed_tokens as i64,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        }
        self.ttft.lock().unwrap_or_else(|e| e.into_inner()).write(
            &mut out,
            "metrale_time_to_first_token_seconds",
            "From a request's submission to its first token.",
        );
        self.itl.lock().unwrap_or_else(|e| e.into_inner()).write(
            &mut out,
            "metrale_inter_token_latency_seconds",
            "Between consecutive tokens of a request.",
        );
        out
    }
}
