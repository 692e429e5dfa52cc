//! Tests that need an NVIDIA GPU: they pass at once (saying so) where
//! `CudaBackend::try_new(0)` fails, as on CI machines. On a GPU: the
//! conformance suite at the small shapes and at a few model-like ones, and
//! paged attention at long contexts (many splits) against the CPU backend.

use metrale_core::{BlockId, DType};

use super::CudaBackend;
use crate::conformance::{self, ArchShapes, AttnShapes, MlpShapes, Op, Status};
use crate::cpu::CpuBackend;
use crate::gpu::GpuBackend;
use crate::ops::step::Staged;
use crate::ops::{AttnParams, KvLayer};

fn device() -> Option<CudaBackend> {
    match CudaBackend::try_new(0) {
        Ok(gpu) => Some(gpu),
        Err(e) => {
            eprintln!("no CUDA device, skipped: {e}");
            None
        }
    }
}

/// Ops whose CUDA path is not this file's (the GEMM) when `METRALE_GEMM_PENDING` is set.
fn excused(op: Op) -> bool {
    std::env::var_os("METRALE_GEMM_PENDING").is_some()
        && matches!(op, Op::Matmul | Op::MatmulSwiglu)
}

fn model_like() -> Vec<ArchShapes> {
    let arch = |name: &str, hidden, heads, kv, hd, rot, window, bs| ArchShapes {
        name: name.into(),
        hidden,
        vocab: 300,
        mlp: Some(MlpShapes {
            intermediate: 2 * hidden,
            gated: true,
        }),
        attention: Some(AttnShapes {
            n_heads: heads,
            n_kv_heads: kv,
            head_dim: hd,
            rotary_dim: rot,
            sliding_window: window,
        }),
        block_size: bs,
        short_conv: None,
        mamba: None,
        deltanet: None,
        moe: None,
    };
    vec![
        arch("llama-like", 256, 32, 8, 128, 128, None, 16),
        arch("gemma-like-256", 256, 8, 1, 256, 256, Some(20), 16),
        arch("mha-80", 160, 4, 4, 80, 40, None, 32),
        arch("group16-bs1", 128, 16, 1, 64, 64, Some(7), 1),
    ]
}

#[test]
fn conformance_on_device() {
    let Some(gpu) = device() else { return };
    eprintln!(
        "{} ({:?}, {} SMs)",
        gpu.device_name(),
        gpu.compute_capability(),
        gpu.multiprocessors()
    );
    let mut failed = Vec::new();
    for shapes in ArchShapes::small_set().into_iter().chain(model_like()) {
        let report = conformance::run(&gpu, &shapes);
        println!("{report}");
        for r in &report.ops {
            if let Status::Failed(why) = &r.status
                && !excused(r.op)
            {
                failed.push(format!("{}: {:?}: {why}", shapes.name, r.op));
            }
        }
        if report.leaked_bytes > 0 {
            failed.push(format!(
                "{}: {} bytes leaked",
                shapes.name, report.leaked_bytes
            ));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// A deterministic generator of values in `lo..hi`.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 40) as f32 / (1u64 << 24) as f32
    }
    fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| lo + (hi - lo) * self.next()).collect()
    }
}

struct Case {
    heads: usize,
    kv_heads: usize,
    hd: usize,
    bs: usize,
    dtype: DType,
    window: Option<usize>,
    /// (cached, new) per sequence.
    seqs: Vec<(usize, usize)>,
    /// Rows of q and out beyond the sequences' (the engine passes its
    /// whole activation buffer).
    spare: usize,
}

/// Runs `c` on `gpu` and returns the output of its query rows.
fn run_case(gpu: &dyn GpuBackend, c: &Case, rng_seed: u64, time: bool) -> Vec<f32> {
    let mut rng = Lcg(rng_seed);
    let kv_width = c.kv_heads * c.hd;
    let width = c.heads * c.hd;
    let needs: Vec<usize> = c
        .seqs
        .iter()
        .map(|&(a, b)| (a + b).div_ceil(c.bs))
        .collect();
    let blocks: usize = needs.iter().sum::<usize>() + 1;
    // Blocks handed out back to front, so tables are not in order.
    let mut next = (0..blocks as u32).rev();
    let tables: Vec<Vec<BlockId>> = needs
        .iter()
        .map(|&n| next.by_ref().take(n).map(BlockId).collect())
        .collect();
    let mut st = Staged::new();
    let k = gpu
        .alloc_slice(c.dtype, blocks * c.bs * kv_width, "test k")
        .unwrap();
    let v = gpu
        .alloc_slice(c.dtype, blocks * c.bs * kv_width, "test v")
        .unwrap();
    let cache = KvLayer {
        k,
        v,
        block_size: c.bs,
    };
    let (mut slots, mut q_rows) = (Vec::new(), 0);
    for (si, &(a, b)) in c.seqs.iter().enumerate() {
        for t in 0..a + b {
            slots.push(tables[si][t / c.bs].0 * c.bs as u32 + (t % c.bs) as u32);
        }
        q_rows += b;
    }
    let kv = rng.vec(slots.len() * kv_width, -2.0, 2.0);
    let vv = rng.vec(slots.len() * kv_width, -1.0, 1.0);
    let (ks, vs, sl) = (
        st.f32s(gpu, &kv).unwrap(),
        st.f32s(gpu, &vv).unwrap(),
        st.u32s(gpu, &slots).unwrap(),
    );
    gpu.kv_store(ks, vs, &cache, sl, kv_width).unwrap();
    let q = st
        .f32s(gpu, &rng.vec((q_rows + c.spare) * width, -2.0, 2.0))
        .unwrap();
    let out = st
        .f32s(gpu, &vec![f32::NAN; (q_rows + c.spare) * width])
        .unwrap();
    let mut descs = Vec::new();
    let mut r0 = 0;
    for (si, &(a, b)) in c.seqs.iter().enumerate() {
        descs.push((r0, b, a + b, &tables[si][..]));
        r0 += b;
    }
    let batch = st.attn(gpu, &descs).unwrap();
    let p = AttnParams {
        n_heads: c.heads,
        n_kv_heads: c.kv_heads,
        head_dim: c.hd,
        scale: 1.0 / (c.hd as f32).sqrt(),
        sliding_window: c.window,
    };
    gpu.paged_attention(q, &cache, out, &batch, &p).unwrap();
    if time {
        gpu.synchronize().unwrap();
        let t = std::time::Instant::now();
        for _ in 0..10 {
            gpu.paged_attention(q, &cache, out, &batch, &p).unwrap();
        }
        gpu.synchronize().unwrap();
        let per = t.elapsed().as_secs_f64() / 10.0;
        let bytes: usize = c
            .seqs
            .iter()
            .map(|&(a, b)| (a + b) * kv_width * 2 * c.dtype.size_of())
            .sum();
        println!(
            "  {:.3} ms, {:.0} GB/s of KV read once",
            per * 1e3,
            bytes as f64 / per / 1e9
        );
    }
    let mut got = gpu.download_f32(out).unwrap();
    assert!(
        got[q_rows * width..].iter().all(|v| v.is_nan()),
        "spare rows written"
    );
    got.truncate(q_rows * width);
    st.free(gpu).unwrap();
    gpu.free(k.ptr()).unwrap();
    gpu.free(v.ptr()).unwrap();
    got
}

#[test]
fn long_attention_matches_cpu() {
    let Some(gpu) = device() else { return };
    let cpu = CpuBackend::new();
    let case = |heads, kv_heads, hd, bs, dtype, window, seqs: Vec<(usize, usize)>| Case {
        heads,
        kv_heads,
        hd,
        bs,
        dtype,
        window,
        seqs,
        spare: 0,
    };
    let cases = [
        // Decode at long contexts: many splits.
        case(
            32,
            8,
            128,
            16,
            DType::BF16,
            None,
            vec![(3000, 1), (17, 1), (1000, 1)],
        ),
        case(
            32,
            8,
            128,
            16,
            DType::F32,
            Some(700),
            vec![(3000, 1), (5, 1)],
        ),
        case(8, 1, 256, 16, DType::BF16, None, vec![(2500, 1)]),
        case(12, 4, 80, 32, DType::F32, None, vec![(1500, 1), (40, 1)]),
        // Prefill chunks after cached tokens, and a mixed step.
        case(32, 8, 128, 16, DType::BF16, None, vec![(500, 300)]),
        case(
            16,
            2,
            64,
            16,
            DType::F32,
            Some(100),
            vec![(0, 200), (300, 1), (50, 20)],
        ),
    ];
    let mut worst = 0f32;
    for (i, c) in cases.iter().enumerate() {
        let g = run_case(&gpu, c, 7 + i as u64, false);
        let want = run_case(&cpu, c, 7 + i as u64, false);
        let err = g
            .iter()
            .zip(&want)
            .map(|(a, b)| {
                if a.is_finite() {
                    (a - b).abs()
                } else {
                    f32::INFINITY
                }
            })
            .fold(0f32, f32::max);
        println!(
            "case {i}: {} rows, max |gpu - cpu| = {err:e}",
            g.len() / (c.heads * c.hd)
        );
        worst = worst.max(err);
    }
    assert!(worst < 2e-5, "attention differs from the CPU's by {worst}");
    assert_eq!(gpu.live_bytes(), 0);
}

#[test]
fn attention_timings() {
    let Some(gpu) = device() else { return };
    let c = |seqs: Vec<(usize, usize)>| Case {
        heads: 32,
        kv_heads: 8,
        hd: 128,
        bs: 16,
        dtype: DType::BF16,
        window: None,
        seqs,
        spare: 0,
    };
    for (what, case) in [
        ("decode, 1 x 32768", c(vec![(32767, 1)])),
        (
            "decode, 1 x 32768 in a buffer of 2048 rows",
            Case {
                spare: 2047,
                ..c(vec![(32767, 1)])
            },
        ),
        ("decode, 64 x 4096", c(vec![(4095, 1); 64])),
        ("prefill, 4096", c(vec![(0, 4096)])),
    ] {
        println!("{what}:");
        let _ = run_case(&gpu, &case, 1, true);
    }
}

/// The harness itself, on the CPU (runs everywhere).
#[test]
fn attention_case_harness_runs_on_cpu() {
    let cpu = CpuBackend::with_threads(2);
    let c = Case {
        heads: 4,
        kv_heads: 2,
        hd: 8,
        bs: 4,
        dtype: DType::BF16,
        window: Some(5),
        seqs: vec![(9, 1), (0, 6)],
        spare: 3,
    };
    let out = run_case(&cpu, &c, 3, false);
    assert_eq!(out.len(), 7 * 32);
    assert!(out.iter().all(|v| v.is_finite()));
    assert_eq!(cpu.live_bytes(), 0);
}
