//! The report `metrale bench` prints: a table, or one JSON object per
//! batch size (an array of them for a list of batch sizes), with the
//! decode roofline and, per batch size, the FLOP/s and weight bytes/s a
//! decode step achieved against the machine's peaks.
//!
//! Two memory bounds on decode: the roofline counts the weights alone (what
//! engines usually quote); the memory floor adds what a step must also move
//! for its sequences, each one's recurrent state read and written and its
//! KV cache read over the run's mean context. A Granite-4.0-H-350M step
//! with a 512-token prompt moves 44 MB of f32 SSM state beside 219 MB of
//! Q4_K_M weights, so its roofline overstates what any engine can reach by
//! a sixth.

use metrale::core::DType;
use metrale::engine::config::ModelConfig;
use metrale::engine::model::GraphStats;
use metrale::{Device, DeviceInfo, OpTime};

use super::bench::{Args, Measured};
use super::bench_probe::{ComputePeaks, decode_params_per_token, peak_rss_bytes};

/// What the FLOP/s of a decode step count, for the JSON report.
const FLOPS_COUNTED: &str = "2 x the parameters a decode step reads per token (every weight \
     matrix but the embedding gather; in MoE layers the top-k experts) per decoded token; \
     attention over the KV cache and recurrent state updates are not counted";

/// The reports of one run, one per batch size: a table (the model's lines
/// once, then each batch size's), or JSON (one object for one batch size,
/// as before lists, an array for several).
pub(super) fn render(reports: &[Report], json: bool) -> anyhow::Result<String> {
    match reports {
        [] => Ok(String::new()),
        [one] if json => Ok(format!("{}\n", serde_json::to_string(&one.json())?)),
        [one] => Ok(one.text()),
        many if json => {
            let all: Vec<_> = many.iter().map(Report::json).collect();
            Ok(format!("{}\n", serde_json::to_string(&all)?))
        }
        [first, ..] => Ok(first.header() + &reports.iter().map(Report::body).collect::<String>()),
    }
}

const MIB: f64 = (1u64 << 20) as f64;

/// What one sequence's caches hold, as the backend lays them out.
#[derive(Clone, Copy, Debug)]
pub(super) struct CacheTraffic {
    /// KV cache bytes per token (every attention layer's K and V).
    pub(super) kv_per_token: usize,
    /// Recurrent state bytes per sequence (conv windows and SSM states).
    pub(super) state_per_seq: usize,
    /// The KV cache's element type.
    pub(super) kv_dtype: DType,
}

pub(super) struct Report {
    pub(super) model: String,
    pub(super) model_type: &'static str,
    /// The backend it ran on.
    pub(super) device: Device,
    /// What the accelerator is (None: the CPU).
    pub(super) device_info: Option<DeviceInfo>,
    pub(super) params: usize,
    pub(super) weight_bytes: usize,
    pub(super) dtype: DType,
    pub(super) threads: usize,
    pub(super) batch: usize,
    pub(super) prompt_len: usize,
    pub(super) gen_len: usize,
    pub(super) load_s: f64,
    pub(super) prefill_tok_s: f64,
    pub(super) decode_tok_s: f64,
    pub(super) ttft_ms: f64,
    pub(super) peak_rss: Option<u64>,
    /// The CPU's arithmetic peaks (None on a GPU or with --no-probe).
    pub(super) compute: Option<ComputePeaks>,
    /// Parameters a decode step reads per token (FLOPs are twice these).
    pub(super) decode_params: f64,
    pub(super) bandwidth: Option<f64>,
    pub(super) decode_bytes: f64,
    /// The KV cache's and the recurrent state's sizes (None: unknown).
    pub(super) cache: Option<CacheTraffic>,
    pub(super) bf16_dot: bool,
    /// The CPU's bf16 kernel where bf16 arithmetic is on.
    pub(super) bf16_kernel: Option<metrale::Bf16Kernel>,
    /// Whether quantized weights' prefill and batched steps took AMX-INT8
    /// tiles.
    pub(super) int8_tiles: bool,
    /// Whether the recurrent states were held in bf16.
    pub(super) bf16_state: bool,
    /// On a backend with graphs: whether decode graphs were on, and their counters.
    pub(super) graphs: Option<(bool, GraphStats)>,
    /// (phase, its seconds, its ops) for --profile.
    pub(super) ops: Vec<(&'static str, f64, Vec<OpTime>)>,
}

impl Report {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        c: &ModelConfig,
        model: String,
        args: &Args,
        batch: usize,
        threads: usize,
        dtype: DType,
        weight_bytes: usize,
        m: &Measured,
        bandwidth: Option<f64>,
    ) -> Self {
        let rate = |count: usize, secs: f64| if secs > 0.0 { count as f64 / secs } else { 0.0 };
        Report {
            model,
            model_type: c.model_type.as_str(),
            device: Device::Cpu,
            device_info: None,
            params: c.parameter_count(),
            weight_bytes,
            dtype,
            threads,
            batch,
            prompt_len: args.prompt_len,
            gen_len: args.gen_len,
            load_s: m.load_s,
            prefill_tok_s: rate(batch * args.prompt_len, m.prefill_s),
            decode_tok_s: rate(m.decoded, m.decode_s),
            ttft_ms: m.ttft_s * 1e3,
            peak_rss: peak_rss_bytes(),
            compute: None,
            decode_params: decode_params_per_token(c),
            bandwidth,
            decode_bytes: decode_params_per_token(c) * dtype.size_of() as f64,
            cache: None,
            bf16_dot: false,
            bf16_kernel: None,
            int8_tiles: false,
            bf16_state: false,
            graphs: None,
            ops: [
                ("prefill", m.prefill_s, &m.prefill_ops),
                ("decode", m.decode_s, &m.decode_ops),
            ]
            .into_iter()
            .filter(|(_, _, ops)| !ops.is_empty())
            .map(|(phase, secs, ops)| (phase, secs, ops.clone()))
            .collect(),
        }
    }

    /// Decode tokens/s if every step only streamed its weights at full bandwidth.
    fn roofline(&self) -> Option<f64> {
        self.bandwidth
            .map(|bw| self.batch as f64 * bw / self.decode_bytes.max(1.0))
    }

    /// The tokens each decode step attends over, on average: the prompt and
    /// half the generated ones (step j attends over prompt + j + 1).
    fn mean_context(&self) -> f64 {
        self.prompt_len as f64 + (self.gen_len as f64 + 1.0) / 2.0
    }

    /// Bytes a decode step must move: the weights once, and per sequence
    /// its recurrent state read and written, its KV cache read over the
    /// mean context and one token's KV written.
    fn floor_bytes(&self) -> Option<f64> {
        let c = self.cache?;
        let per_seq =
            2.0 * c.state_per_seq as f64 + (self.mean_context() + 1.0) * c.kv_per_token as f64;
        Some(self.decode_bytes + self.batch as f64 * per_seq)
    }

    /// Decode tokens/s if every step moved [`Self::floor_bytes`] at full bandwidth.
    fn floor(&self) -> Option<f64> {
        let (bw, bytes) = (self.bandwidth?, self.floor_bytes()?);
        Some(self.batch as f64 * bw / bytes.max(1.0))
    }

    /// Decode FLOP/s of all sequences together (see [`FLOPS_COUNTED`]).
    fn decode_flop_s(&self) -> f64 {
        2.0 * self.decode_params * self.decode_tok_s
    }

    /// Weight bytes/s the decode steps read: each step reads the weights
    /// once for all of its `batch` tokens.
    fn weight_bytes_s(&self) -> f64 {
        self.decode_bytes * self.decode_tok_s / self.batch.max(1) as f64
    }

    /// The compute peak to hold the decode FLOP/s against: AMX tiles' or
    /// the bf16 dot products' when the run used them (and the CPU has
    /// them), else f32 FMA (as the bf16 kernel that widens the weights).
    fn compute_peak(&self) -> Option<(f64, &'static str)> {
        use metrale::Bf16Kernel;
        let c = self.compute?;
        match (self.bf16_kernel, c.amx_bf16, c.bf16_dot) {
            (Some(Bf16Kernel::Amx), Some(amx), _) => Some((amx, "bf16 AMX")),
            (Some(Bf16Kernel::Fma), ..) => Some((c.f32_fma, "f32 FMA")),
            (_, _, Some(dot)) if self.bf16_dot => Some((dot, "bf16 dot")),
            _ => Some((c.f32_fma, "f32 FMA")),
        }
    }

    /// How the recurrent states were held: None for a model without them
    /// (or whose cache sizes are unknown).
    /// How prefill multiplies quantized weights, for a model of them on the
    /// CPU (decode's one row takes integer dot products either way).
    fn quant_kernel(&self) -> Option<&'static str> {
        let quant = matches!(self.dtype, DType::Quant(_) | DType::QuantGroups(_));
        let kernel = if self.int8_tiles {
            "int8 AMX tiles"
        } else {
            "int8 dot products"
        };
        (quant && self.device_info.is_none()).then_some(kernel)
    }

    fn state_dtype(&self) -> Option<&'static str> {
        let has_state = self.cache.is_some_and(|c| c.state_per_seq > 0);
        has_state.then_some(if self.bf16_state { "bf16" } else { "f32" })
    }

    /// The KV cache's element type: None for a model without attention
    /// (or whose cache sizes are unknown).
    fn kv_dtype(&self) -> Option<&'static str> {
        let c = self.cache.filter(|c| c.kv_per_token > 0)?;
        Some(c.kv_dtype.name())
    }

    /// "decode b16: 112 tok/s aggregate, 7.0 tok/s per sequence, ..."
    fn batch_line(&self) -> String {
        let flops = self.decode_flop_s();
        let bytes = self.weight_bytes_s();
        let peak = match self.compute_peak() {
            Some((p, what)) => format!(
                " ({:.1}% of the {:.0} GFLOP/s {what} peak)",
                100.0 * flops / p,
                p / 1e9
            ),
            None => String::new(),
        };
        let bw = match self.bandwidth {
            Some(bw) => format!(" ({:.0}% of {:.1} GB/s)", 100.0 * bytes / bw, bw / 1e9),
            None => String::new(),
        };
        format!(
            "decode b{}: {:.1} tok/s aggregate, {:.2} tok/s per sequence, {:.2} GFLOP/s{peak}, {:.2} GB/s weights{bw}",
            self.batch,
            self.decode_tok_s,
            self.decode_tok_s / self.batch.max(1) as f64,
            flops / 1e9,
            bytes / 1e9
        )
    }

    pub(super) fn json(&self) -> serde_json::Value {
        let roofline = self.roofline();
        let peak = self.compute_peak();
        let mut v = serde_json::json!({
            "model": self.model,
            "model_type": self.model_type,
            "device": self.device.to_string(),
            "params": self.params,
            "weight_bytes": self.weight_bytes,
            "weight_dtype": self.dtype.name(),
            "bf16_dot_products": self.bf16_dot,
            "bf16_kernel": self.bf16_kernel.map(|k| k.describe()),
            "quant_kernel": self.quant_kernel(),
            "ssm_state_dtype": self.state_dtype(),
            "kv_dtype": self.kv_dtype(),
            "threads": self.threads,
            "batch": self.batch,
            "prompt_len": self.prompt_len,
            "gen_len": self.gen_len,
            "load_s": self.load_s,
            "prefill_tok_s": self.prefill_tok_s,
            "decode_tok_s": self.decode_tok_s,
            "ttft_ms": self.ttft_ms,
            "peak_rss_bytes": self.peak_rss,
            "bandwidth_bytes_s": self.bandwidth,
            "decode_bytes_per_step": self.decode_bytes,
            "roofline_decode_tok_s": roofline,
            "roofline_fraction": roofline.map(|r| self.decode_tok_s / r),
            "kv_bytes_per_token": self.cache.map(|c| c.kv_per_token),
            "state_bytes_per_seq": self.cache.map(|c| c.state_per_seq),
            "floor_bytes_per_step": self.floor_bytes(),
            "floor_decode_tok_s": self.floor(),
            "floor_fraction": self.floor().map(|f| self.decode_tok_s / f),
            "decode_tok_s_per_seq": self.decode_tok_s / self.batch.max(1) as f64,
            "decode_flop_s": self.decode_flop_s(),
            "decode_flops_per_token": 2.0 * self.decode_params,
            "flops_counted": FLOPS_COUNTED,
            "decode_weight_bytes_s": self.weight_bytes_s(),
            "peak_f32_fma_flop_s": self.compute.map(|c| c.f32_fma),
            "peak_bf16_dot_flop_s": self.compute.and_then(|c| c.bf16_dot),
            "peak_amx_bf16_flop_s": self.compute.and_then(|c| c.amx_bf16),
            "compute_peak_flop_s": peak.map(|p| p.0),
            "compute_peak_kind": peak.map(|p| p.1),
            "compute_fraction": peak.map(|p| self.decode_flop_s() / p.0),
            "bandwidth_fraction": self.bandwidth.map(|bw| self.weight_bytes_s() / bw),
        });
        if let Some(info) = &self.device_info {
            v["device_name"] = info.name.clone().into();
            v["compute_capability"] = format!(
                "{}.{}",
                info.compute_capability.0, info.compute_capability.1
            )
            .into();
            v["device_memory_bytes"] = info.total_memory.into();
            v["device_free_memory_bytes"] = info.free_memory.into();
        }
        if let Some((on, g)) = &self.graphs {
            v["cuda_graphs"] = serde_json::json!({
                "enabled": on,
                "captures": g.captures,
                "replays": g.replays,
                "failed": g.failed,
            });
        }
        for (phase, secs, ops) in &self.ops {
            let rows: Vec<_> = ops
                .iter()
                .map(|t| {
                    serde_json::json!({
                        "op": t.op,
                        "calls": t.calls,
                        "ms": t.total.as_secs_f64() * 1e3,
                        "share": t.total.as_secs_f64() / secs.max(f64::MIN_POSITIVE),
                    })
                })
                .collect();
            v[format!("{phase}_ops")] = rows.into();
        }
        v
    }

    /// The table `metrale bench` prints for one batch size.
    pub(super) fn text(&self) -> String {
        self.header() + &self.body()
    }

    /// The model's lines (and the device's): once per run.
    fn header(&self) -> String {
        let mut out = String::new();
        let mut line = |s: String| {
            out.push_str(&s);
            out.push('\n');
        };
        line(format!(
            "model        {} ({}, {:.1}M parameters, weights {} = {:.2} GiB)",
            self.model,
            self.model_type,
            self.params as f64 / 1e6,
            self.dtype,
            gib(self.weight_bytes as f64)
        ));
        let Some(info) = &self.device_info else {
            return out;
        };
        line(format!(
            "device       {} ({}), compute capability {}.{}, {:.1} GiB ({:.1} GiB free)",
            self.device,
            info.name,
            info.compute_capability.0,
            info.compute_capability.1,
            gib(info.total_memory as f64),
            gib(info.free_memory as f64)
        ));
        match &self.graphs {
            Some((true, g)) => line(format!(
                "graphs       decode steps as CUDA graphs: {} captured, {} steps replayed{}",
                g.captures,
                g.replays,
                if g.failed > 0 {
                    format!(", {} batch size(s) eager after a failed capture", g.failed)
                } else {
                    String::new()
                }
            )),
            Some((false, _)) => {
                line("graphs       off (--no-cuda-graphs): every step eager".into())
            }
            None => {}
        }
        out
    }

    /// The lines of this batch size.
    fn body(&self) -> String {
        let mut out = String::new();
        let mut line = |s: String| {
            out.push_str(&s);
            out.push('\n');
        };
        // On a GPU the host threads say nothing of the run.
        let threads = match self.device_info {
            Some(_) => String::new(),
            None => format!("{} thread(s), ", self.threads),
        };
        line(format!(
            "run          {}, {threads}batch {}, prompt {} tokens, {} generated; load {:.2} s",
            self.device, self.batch, self.prompt_len, self.gen_len, self.load_s
        ));
        let math = if let Some(kernel) = self.quant_kernel() {
            kernel
        } else if let Some(kernel) = self.bf16_kernel {
            kernel.describe()
        } else if self.bf16_dot {
            "bf16 dot products"
        } else if self.device_info.is_some() && self.dtype != DType::F32 {
            "f32 accumulation"
        } else {
            "f32"
        };
        let mut state = match self.state_dtype() {
            Some(dtype) => format!(", {dtype} recurrent state"),
            None => String::new(),
        };
        if let Some(dtype) = self.kv_dtype() {
            state += &format!(", {dtype} KV cache");
        }
        line(format!(
            "prefill      {:>10.1} tok/s ({math} arithmetic{state})",
            self.prefill_tok_s
        ));
        line(format!("ttft         {:>10.1} ms", self.ttft_ms));
        match (self.roofline(), self.bandwidth) {
            (Some(r), Some(bw)) => line(format!(
                "decode       {:>10.2} tok/s   roofline {:.2} tok/s ({:.2} GiB/step at {:.1} GB/s): {:.0}%",
                self.decode_tok_s,
                r,
                gib(self.decode_bytes),
                bw / 1e9,
                100.0 * self.decode_tok_s / r
            )),
            _ => line(format!("decode       {:>10.2} tok/s", self.decode_tok_s)),
        }
        if let (Some(f), Some(bytes), Some(c)) = (self.floor(), self.floor_bytes(), self.cache) {
            let state = match c.state_per_seq {
                0 => String::new(),
                b => format!(", {:.1} MiB of state read and written", b as f64 / MIB),
            };
            line(format!(
                "memory floor {f:>10.2} tok/s ({:.2} GiB/step: the weights{state}, {:.0} tokens of KV at {} B, per sequence): {:.0}%",
                gib(bytes),
                self.mean_context(),
                c.kv_per_token,
                100.0 * self.decode_tok_s / f
            ));
        }
        line(self.batch_line());
        match self.peak_rss {
            Some(p) => line(format!(
                "peak memory  {:>10.2} GiB (resident)",
                gib(p as f64)
            )),
            None => line("peak memory  unknown on this OS".into()),
        }
        for (phase, secs, ops) in &self.ops {
            line(format!("{phase} by op ({:.1} ms in all):", secs * 1e3));
            for t in ops {
                let ms = t.total.as_secs_f64() * 1e3;
                line(format!(
                    "  {:<20} {:>9.1} ms {:>5.1}% {:>7} calls",
                    t.op,
                    ms,
                    100.0 * ms / (secs * 1e3).max(f64::MIN_POSITIVE),
                    t.calls
                ));
            }
        }
        out
    }
}

fn gib(bytes: f64) -> f64 {
    bytes / (1u64 << 30) as f64
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use clap::Parser;
    use metrale::engine::config::parse_config;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn report(bandwidth: Option<f64>, device_info: Option<DeviceInfo>) -> Report {
        let path = PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../benches/configs/tiny-hybrid.json"
        ));
        let config = parse_config(&std::fs::read_to_string(&path).unwrap(), &path).unwrap();
        let cli = Cli::parse_from(["bench", "--config", "x.json", "--batch", "2"]);
        let measured = Measured {
            load_s: 1.0,
            prefill_s: 1.0,
            ttft_s: 0.01,
            decode_s: 1.0,
            decoded: 100,
            prefill_ops: Vec::new(),
            decode_ops: Vec::new(),
            near_bandwidth: Vec::new(),
        };
        let mut r = Report::new(
            &config,
            "tiny".into(),
            &cli.args,
            2,
            1,
            DType::BF16,
            1 << 20,
            &measured,
            bandwidth,
        );
        r.device_info = device_info;
        r
    }

    fn h200() -> DeviceInfo {
        DeviceInfo {
            name: "NVIDIA H200".into(),
            compute_capability: (9, 0),
            free_memory: 140 << 30,
            total_memory: 141 << 30,
            driver_version: 13000,
            scratch_bytes: 0,
        }
    }

    #[test]
    fn a_gpu_run_reports_the_device_and_its_roofline() {
        let bw = 4.0e12;
        let r = report(Some(bw), Some(h200()));
        let text = r.text();
        assert!(
            text.contains("(NVIDIA H200), compute capability 9.0, 141.0 GiB (140.0 GiB free)"),
            "{text}"
        );
        assert!(!text.contains("thread(s)"), "{text}");
        // Roofline: batch x bandwidth / bytes a decode step reads.
        let roofline = 2.0 * bw / r.decode_bytes;
        assert!(
            text.contains(&format!("roofline {roofline:.2} tok/s")),
            "{text}"
        );
        assert!(text.contains("at 4000.0 GB/s"), "{text}");
        let v = r.json();
        assert_eq!(v["device_name"], "NVIDIA H200");
        assert_eq!(v["compute_capability"], "9.0");
        assert_eq!(v["device_memory_bytes"], 141u64 << 30);
        assert_eq!(v["bandwidth_bytes_s"], bw);
        assert!((v["roofline_decode_tok_s"].as_f64().unwrap() - roofline).abs() < 1e-6);
    }

    #[test]
    fn the_batch_line_holds_flops_and_bytes_against_the_peaks() {
        let mut r = report(Some(40e9), None);
        r.bf16_dot = true;
        r.compute = Some(ComputePeaks {
            f32_fma: 100e9,
            bf16_dot: Some(200e9),
            amx_bf16: Some(1000e9),
        });
        let flops = 2.0 * r.decode_params * 100.0;
        let line = r.batch_line();
        assert!(
            line.starts_with("decode b2: 100.0 tok/s aggregate, 50.00 tok/s per sequence"),
            "{line}"
        );
        assert!(line.contains("of the 200 GFLOP/s bf16 dot peak"), "{line}");
        let v = r.json();
        assert!((v["decode_flop_s"].as_f64().unwrap() - flops).abs() < 1e-3);
        assert_eq!(v["compute_peak_kind"], "bf16 dot");
        // Each step reads the weights once for both sequences.
        let bytes = r.decode_bytes * 50.0;
        assert!((v["decode_weight_bytes_s"].as_f64().unwrap() - bytes).abs() < 1e-3);
        // The kernel that widens the weights is held against the FMA peak.
        r.bf16_kernel = Some(metrale::Bf16Kernel::Fma);
        assert!(r.batch_line().contains("100 GFLOP/s f32 FMA peak"));
        assert_eq!(r.json()["bf16_kernel"], "f32 FMA on bf16 weights");
        r.bf16_kernel = Some(metrale::Bf16Kernel::Dot);
        assert!(r.batch_line().contains("200 GFLOP/s bf16 dot peak"));
        // AMX tiles against their own probe's peak.
        r.bf16_kernel = Some(metrale::Bf16Kernel::Amx);
        assert!(r.batch_line().contains("1000 GFLOP/s bf16 AMX peak"));
        assert_eq!(r.json()["bf16_kernel"], "bf16 AMX tiles");
        r.bf16_dot = false;
        r.bf16_kernel = None;
        assert!(r.batch_line().contains("100 GFLOP/s f32 FMA peak"));
    }

    #[test]
    fn quantized_weights_name_their_prefill_kernel() {
        let mut r = report(None, None);
        assert!(r.text().contains("f32 arithmetic"), "{}", r.text());
        assert!(r.json()["quant_kernel"].is_null());
        let q4 = metrale_core::QuantFormat::new(metrale_core::GgmlType::Q4K).unwrap();
        r.dtype = DType::QuantGroups(q4);
        assert!(
            r.text().contains("(int8 dot products arithmetic"),
            "{}",
            r.text()
        );
        r.int8_tiles = true;
        r.bf16_kernel = Some(metrale::Bf16Kernel::Amx);
        assert!(
            r.text().contains("(int8 AMX tiles arithmetic"),
            "{}",
            r.text()
        );
        assert_eq!(r.json()["quant_kernel"], "int8 AMX tiles");
    }

    #[test]
    fn the_memory_floor_adds_the_state_and_the_kv_cache() {
        let bw = 40e9;
        let mut r = report(Some(bw), None);
        assert!(
            !r.text().contains("memory floor"),
            "no cache sizes, no floor"
        );
        assert!(r.json()["floor_decode_tok_s"].is_null());
        r.cache = Some(CacheTraffic {
            kv_per_token: 1000,
            state_per_seq: 1 << 20,
            kv_dtype: DType::BF16,
        });
        // Per sequence: the state twice, and KV over the mean context
        // (prompt + (gen + 1) / 2) plus the new token's.
        let ctx = r.prompt_len as f64 + (r.gen_len as f64 + 1.0) / 2.0;
        let bytes = r.decode_bytes + 2.0 * (2.0 * (1 << 20) as f64 + (ctx + 1.0) * 1000.0);
        let floor = 2.0 * bw / bytes;
        let text = r.text();
        assert!(
            text.contains(&format!("memory floor {floor:>10.2} tok/s")),
            "{text}"
        );
        assert!(text.contains("1.0 MiB of state"), "{text}");
        assert!(text.contains("bf16 KV cache)"), "{text}");
        let v = r.json();
        assert_eq!(v["kv_dtype"], "bf16");
        assert!((v["floor_decode_tok_s"].as_f64().unwrap() - floor).abs() < 1e-9);
        assert!(floor < v["roofline_decode_tok_s"].as_f64().unwrap());
    }

    #[test]
    fn a_list_renders_the_model_once_and_json_as_an_array() {
        let reports = [report(None, None), report(None, None)];
        let text = render(&reports, false).unwrap();
        assert_eq!(text.matches("model        ").count(), 1, "{text}");
        assert_eq!(text.matches("decode b2: ").count(), 2, "{text}");
        let v: serde_json::Value = serde_json::from_str(&render(&reports, true).unwrap()).unwrap();
        assert_eq!(v.as_array().map(Vec::len), Some(2));
        let one: serde_json::Value =
            serde_json::from_str(&render(&reports[..1], true).unwrap()).unwrap();
        assert!(one.is_object());
    }

    #[test]
    fn a_cpu_run_has_no_device_line() {
        let r = report(None, None);
        let text = r.text();
        assert!(!text.contains("compute capability"), "{text}");
        assert!(text.contains("1 thread(s), batch 2"), "{text}");
        assert!(text.contains("decode       "), "{text}");
        assert!(r.json().get("device_name").is_none());
    }
}
