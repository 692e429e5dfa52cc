//! Measurements `metrale bench` reports beside its own timings: the memory
//! bandwidth the machine sustains, the process's peak memory, and the bytes
//! of weights a decode step reads.

use std::time::Instant;

use metrale::engine::config::{ExpertNames, FfnNames, MlpNames, ModelConfig};

/// Bytes the bandwidth probe streams through per pass (far beyond any L3).
const PROBE_BYTES: usize = 512 << 20;

/// Sustained read bandwidth in bytes/s with `threads` threads, each summing
/// its share of a buffer much larger than the caches; the median of a few
/// passes (the best one was an outlier now and then on a shared machine:
/// 53 GB/s in one run where every other read 32–35).
pub fn read_bandwidth(threads: usize) -> f64 {
    let threads = threads.max(1);
    let words = PROBE_BYTES / 8;
    // Touch every page first so the timed passes read memory, not page faults.
    let buf: Vec<u64> = (0..words as u64).collect();
    let share = words.div_ceil(threads);
    let mut rates = Vec::with_capacity(5);
    for _ in 0..5 {
        let start = Instant::now();
        let total: u64 = std::thread::scope(|s| {
            let handles: Vec<_> = buf
                .chunks(share)
                .map(|part| s.spawn(move || sum_words(part)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(0))
                .fold(0u64, u64::wrapping_add)
        });
        let secs = start.elapsed().as_secs_f64();
        std::hint::black_box(total);
        rates.push(PROBE_BYTES as f64 / secs);
    }
    rates.sort_by(f64::total_cmp);
    rates[rates.len() / 2]
}

/// Sums words with independent accumulators so that the loop is load-bound
/// (with the widest loads the CPU has: narrow loads under-report bandwidth).
fn sum_words(part: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { sum_words_avx2(part) };
    }
    sum_words_portable(part)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn sum_words_avx2(part: &[u64]) -> u64 {
    sum_words_portable(part)
}

#[inline(always)]
fn sum_words_portable(part: &[u64]) -> u64 {
    let mut acc = [0u64; 16];
    let chunks = part.chunks_exact(16);
    let rest: u64 = chunks.remainder().iter().fold(0, |a, &b| a.wrapping_add(b));
    for c in chunks {
        for (a, &b) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(b);
        }
    }
    acc.iter().fold(rest, |a, &b| a.wrapping_add(b))
}

/// The process's peak resident memory (VmHWM), in bytes, where the OS says.
pub fn peak_rss_bytes() -> Option<u64> {
    status_kib("VmHWM:").map(|k| k * 1024)
}

fn status_kib(key: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Parameters a decode step reads for one token: every weight but the
/// embedding table (one row of it is gathered; when the head is tied the
/// table is read once as the head) and, in MoE layers, only `top_k` of the
/// routed experts.
pub fn decode_params_per_token(c: &ModelConfig) -> f64 {
    decode_read(c, &|_, elems| elems as f64)
}

/// Bytes a decode step reads for one token, as [`decode_params_per_token`]
/// counts them, with each tensor's size from `bytes(name)` where it knows
/// it (a loaded model's store: quantized GGUF tensors, f32 norms) and
/// `fallback` bytes per element where it does not.
pub fn decode_bytes_per_token(
    c: &ModelConfig,
    bytes: &dyn Fn(&str) -> Option<usize>,
    fallback: usize,
) -> f64 {
    decode_read(c, &|name, elems| {
        bytes(name).map_or((elems * fallback) as f64, |b| b as f64)
    })
}

/// What a decode step reads, each tensor counted as `size(name, elements)`.
fn decode_read(c: &ModelConfig, size_of: &dyn Fn(&str, usize) -> f64) -> f64 {
    let specs = c.expected_tensors();
    let size = |name: &str| {
        specs
            .iter()
            .find(|t| t.name == name)
            .map_or(0.0, |t| size_of(name, t.shape.iter().product::<usize>()))
    };
    let all: f64 = specs
        .iter()
        .map(|t| size_of(&t.name, t.shape.iter().product::<usize>()))
        .sum();
    let mut read = all;
    if c.names.lm_head.is_some() {
        read -= size(&c.names.embed);
    }
    let Some(moe) = &c.moe else { return read };
    let active = moe.top_k as f64 / moe.n_experts.max(1) as f64;
    for layer in &c.layers {
        let FfnNames::Moe(m) = &layer.names.ffn else {
            continue;
        };
        let experts: f64 = match &m.experts {
            ExpertNames::Separate(list) => list
                .iter()
                .map(|e| mlp_names(e).iter().map(|n| size(n)).sum::<f64>())
                .sum(),
            ExpertNames::Fused { gate_up, down } => size(gate_up) + size(down),
        };
        read -= (1.0 - active) * experts;
    }
    read
}

fn mlp_names(m: &MlpNames) -> Vec<&str> {
    match m {
        MlpNames::Split { gate, up, down, .. } => vec![gate, up, down],
        MlpNames::Fused { gate_up, down } => vec![gate_up, down],
        MlpNames::Plain { up, down, .. } => vec![up, down],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_words() {
        let v: Vec<u64> = (0..1003).collect();
        assert_eq!(sum_words(&v), 1002 * 1003 / 2);
    }
}
