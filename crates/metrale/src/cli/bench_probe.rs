//! Measurements `metrale bench` reports beside its own timings: the memory
//! bandwidth the machine sustains, its arithmetic peaks (f32 FMA and, where
//! the CPU has AVX512-BF16, bf16 dot products), the process's peak memory,
//! the bytes of weights a decode step reads, and what one sequence's KV
//! cache and recurrent state take.

use std::time::Instant;

use metrale::engine::config::{ExpertNames, FfnNames, MlpNames, ModelConfig};
use metrale::engine::model::ModelOptions;
use metrale::engine::model::types::{kv_spec, recurrent_state_shapes};
use metrale::gpu_runtime::gpu::GpuBackend;

use super::bench_report::CacheTraffic;

/// Bytes the bandwidth probe streams through per pass (far beyond any L3).
const PROBE_BYTES: usize = 512 << 20;

/// Sustained read bandwidth in bytes/s with `threads` threads, each summing
/// its share of a buffer much larger than the caches; the median of a few
/// passes (the best one was an outlier now and then on a shared machine:
/// 53 GB/s in one run where every other read 32–35).
pub fn read_bandwidth(threads: usize) -> f64 {
    median(read_bandwidth_passes(threads, 5))
}

/// The median of `rates` (0 for none).
pub fn median(mut rates: Vec<f64>) -> f64 {
    rates.sort_by(f64::total_cmp);
    rates.get(rates.len() / 2).copied().unwrap_or(0.0)
}

/// `passes` timed reads of the probe's buffer, bytes/s each.
fn read_bandwidth_passes(threads: usize, passes: usize) -> Vec<f64> {
    let threads = threads.max(1);
    let words = PROBE_BYTES / 8;
    // Touch every page first so the timed passes read memory, not page faults.
    let buf: Vec<u64> = (0..words as u64).collect();
    let share = words.div_ceil(threads);
    let mut rates = Vec::with_capacity(passes);
    for _ in 0..passes {
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
    rates
}

/// The bandwidth probe taken right before and right after each decode
/// window on the CPU, so that the roofline divides by what the memory gave
/// in the same second or two rather than a second or more later. On this
/// project's shared host, six runs a minute apart: the probe after the
/// runs read 12.9-20.7 GB/s and put the same decode at 55-105% of its
/// roofline; the probes either side of each decode read 17-20 in five of
/// the six (one read 19.8 before its decode and 12.5 after).
///
/// Each probe's buffer would count in the process's peak memory, so the
/// kernel's high-water mark is read before a probe and reset after it
/// (`/proc/self/clear_refs`); [`Self::peak_rss`] is the largest reading.
pub struct NearProbe {
    threads: usize,
    peak: Option<u64>,
}

/// Timed passes per probe, each side of a decode window.
const NEAR_PASSES: usize = 3;

impl NearProbe {
    /// None where the high-water mark cannot be reset (not Linux, or a
    /// read-only /proc): the bench probes once, after its runs. Make it
    /// before the model loads: the reset forgets the peak so far.
    pub fn new(threads: usize) -> Option<Self> {
        let peak = peak_rss_bytes();
        reset_peak_rss().ok()?;
        Some(Self { threads, peak })
    }

    /// A probe's passes, bytes/s each.
    pub fn read(&mut self) -> Vec<f64> {
        self.peak = self.peak.max(peak_rss_bytes());
        let rates = read_bandwidth_passes(self.threads, NEAR_PASSES);
        // It worked in `new`; should it fail now, the peak includes the
        // probe's buffer (an over-count, never an under-count).
        let _ = reset_peak_rss();
        rates
    }

    /// The process's peak resident memory, the probes' buffers left out.
    pub fn peak_rss(&self) -> Option<u64> {
        self.peak.max(peak_rss_bytes())
    }
}

/// Resets the kernel's high-water mark of this process's resident memory
/// (VmHWM) to what it holds now.
fn reset_peak_rss() -> std::io::Result<()> {
    std::fs::write("/proc/self/clear_refs", "5")
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

/// Seconds each compute probe pass runs; the best of [`COMPUTE_PASSES`].
const COMPUTE_PASS_S: f64 = 0.1;
const COMPUTE_PASSES: usize = 3;

/// The CPU's arithmetic peaks in FLOP/s on the bench's threads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ComputePeaks {
    /// Fused multiply-adds on f32 vectors (2 FLOP per lane).
    pub f32_fma: f64,
    /// `vdpbf16ps` (4 FLOP per f32 lane: two products, two sums), where
    /// the CPU has AVX512-BF16.
    pub bf16_dot: Option<f64>,
    /// AMX's `tdpbf16ps` on tiles held in the registers (4 FLOP per pair
    /// of products, as `vdpbf16ps`), where the CPU and OS run AMX tiles.
    pub amx_bf16: Option<f64>,
}

/// Measures [`ComputePeaks`] with `threads` threads, each running
/// independent chains of the instruction from registers (no memory
/// traffic), for a fraction of a second per probe.
pub fn compute_peaks(threads: usize) -> ComputePeaks {
    ComputePeaks {
        f32_fma: peak_flops(threads, fma_block),
        bf16_dot: bf16_dot_available().then(|| peak_flops(threads, bf16_block)),
        amx_bf16: metrale::Bf16Kernel::Amx
            .runs_here()
            .then(|| peak_flops(threads, amx_block)),
    }
}

/// FLOP/s of `block` (which returns the FLOPs it did) on `threads`
/// threads, each repeating it for [`COMPUTE_PASS_S`]; the best pass, since
/// a peak is what the probe is after and a shared machine only lowers it.
fn peak_flops(threads: usize, block: fn() -> f64) -> f64 {
    let threads = threads.max(1);
    let mut best = 0.0f64;
    for _ in 0..COMPUTE_PASSES {
        let start = Instant::now();
        let flops: f64 = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|_| s.spawn(move || repeat_for(block, start)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
        });
        best = best.max(flops / start.elapsed().as_secs_f64());
    }
    best
}

fn repeat_for(block: fn() -> f64, start: Instant) -> f64 {
    let mut flops = 0.0;
    while start.elapsed().as_secs_f64() < COMPUTE_PASS_S {
        flops += block();
    }
    flops
}

/// Iterations of a probe block between clock reads (about 10 µs of work).
const BLOCK_ITERS: usize = 4096;
/// Independent accumulators: enough to cover the FMA latency (4 cycles) on
/// two ports.
const CHAINS: usize = 10;

fn fma_block() -> f64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F (checked just above).
        return unsafe { x86::fma_avx512() };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports AVX2 and FMA (checked just above).
        return unsafe { x86::fma_avx2() };
    }
    fma_portable()
}

/// Scalar chains the compiler may vectorise: a floor, not the CPU's peak,
/// where the probe has no kernel for the architecture.
fn fma_portable() -> f64 {
    let mut acc = [1.0f32; CHAINS * 8];
    let (a, b) = (
        std::hint::black_box(0.999_f32),
        std::hint::black_box(1e-3_f32),
    );
    for _ in 0..BLOCK_ITERS {
        for x in acc.iter_mut() {
            *x = x.mul_add(a, b);
        }
    }
    std::hint::black_box(acc);
    (2 * BLOCK_ITERS * acc.len()) as f64
}

/// Rounds of four tile products per AMX probe block (64 cycles each: about
/// 10 µs of work).
const AMX_ROUNDS: usize = 256;

fn amx_block() -> f64 {
    metrale::amx_peak_block(AMX_ROUNDS).unwrap_or(0.0)
}

fn bf16_dot_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bf16");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

fn bf16_block() -> f64 {
    #[cfg(target_arch = "x86_64")]
    if bf16_dot_available() {
        // SAFETY: the CPU supports AVX-512F and AVX512-BF16 (checked just above).
        return unsafe { x86::dot_bf16() };
    }
    0.0
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::hint::black_box;

    use super::{BLOCK_ITERS, CHAINS};

    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn fma_avx512() -> f64 {
        // Opaque to the optimiser, which would fold the loop away otherwise.
        let (a, b) = black_box((_mm512_set1_ps(0.999), _mm512_set1_ps(1e-3)));
        let mut acc = black_box([_mm512_set1_ps(1.0); CHAINS]);
        for _ in 0..BLOCK_ITERS {
            for x in acc.iter_mut() {
                *x = _mm512_fmadd_ps(*x, a, b);
            }
        }
        black_box(acc);
        (2 * 16 * CHAINS * BLOCK_ITERS) as f64
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn fma_avx2() -> f64 {
        // Opaque to the optimiser, which would fold the loop away otherwise.
        let (a, b) = black_box((_mm256_set1_ps(0.999), _mm256_set1_ps(1e-3)));
        let mut acc = black_box([_mm256_set1_ps(1.0); CHAINS]);
        for _ in 0..BLOCK_ITERS {
            for x in acc.iter_mut() {
                *x = _mm256_fmadd_ps(*x, a, b);
            }
        }
        black_box(acc);
        (2 * 8 * CHAINS * BLOCK_ITERS) as f64
    }

    /// # Safety
    /// The CPU must support AVX-512F and AVX512-BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn dot_bf16() -> f64 {
        // 0x3f80 is bf16 1.0; small products keep the sums finite.
        // SAFETY: __m512bh and __m512i are both 512-bit vectors.
        let (a, b): (__m512bh, __m512bh) = unsafe {
            (
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(0x3f80_3f80)),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(0x3a83_3a83)),
            )
        };
        let (a, b) = black_box((a, b));
        let mut acc = black_box([_mm512_setzero_ps(); CHAINS]);
        for _ in 0..BLOCK_ITERS {
            for x in acc.iter_mut() {
                *x = _mm512_dpbf16_ps(*x, a, b);
            }
        }
        black_box(acc);
        // 16 lanes, each two products and two sums.
        (4 * 16 * CHAINS * BLOCK_ITERS) as f64
    }
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

    #[test]
    fn compute_peaks_are_positive() {
        let p = compute_peaks(1);
        assert!(p.f32_fma.is_finite() && p.f32_fma > 0.0, "{p:?}");
        assert!(p.bf16_dot.is_none_or(|f| f.is_finite() && f > 0.0), "{p:?}");
    }
}

/// One sequence's KV bytes per token and recurrent state bytes, in the
/// layouts `gpu` gives them under `options` (the KV dtype, a bf16 SSM
/// state), as `metrale inspect` reports them.
pub fn cache_traffic(
    c: &ModelConfig,
    gpu: &dyn GpuBackend,
    options: &ModelOptions,
) -> anyhow::Result<CacheTraffic> {
    let layout = gpu.kv_layout(kv_spec(c, options))?;
    let kv_per_token =
        layout.block_bytes() / options.kv_block_size.max(1) * c.attention_layers().count();
    let state_per_seq = recurrent_state_shapes(c)
        .iter()
        .map(|s| s.slot_bytes(gpu, options.ssm_state_dtype))
        .sum();
    Ok(CacheTraffic {
        kv_per_token,
        state_per_seq,
        kv_dtype: layout.dtype,
    })
}
