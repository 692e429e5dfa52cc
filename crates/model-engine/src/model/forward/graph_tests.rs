//! Decode graphs without a GPU: the step metadata's layout, and the engine
//! capturing, replaying and releasing graphs on a recording backend
//! (`graph_fake.rs`) whose replays re-run the captured ops with the
//! captured arguments, so any step-specific value left outside the device
//! metadata shows up as logits that differ from an eager run's.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use metrale_core::DType;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;

use super::graph_fake::Recorder;
use super::meta::{StepMeta, as_words};
use super::{Logits, Sequence, Step};
use crate::model::{ModelOptions, TransformerModel};

const FIXTURES: [&str; 7] = [
    "llama",
    "qwen3",
    "mamba2",
    "bamba",
    "nemotron_h",
    "granitemoehybrid",
    "qwen3_next",
];

fn model(gpu: Arc<dyn GpuBackend>, name: &str, graphs: bool) -> TransformerModel {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let config = crate::config::load_config(&root.join(name)).unwrap();
    let options = ModelOptions {
        // Small blocks: decode steps cross block boundaries, so the block
        // tables grow while a graph is replayed.
        kv_block_size: 4,
        kv_blocks: 32,
        max_seqs: 3,
        max_batch_tokens: 24,
        kv_dtype: None,
        kv_follows_weights: false,
        ssm_state_dtype: None,
        ssm_state_follows_weights: false,
        cuda_graphs: graphs,
        prefix_cache: Default::default(),
    };
    TransformerModel::random(gpu, config, options, 7, DType::BF16).unwrap()
}

/// Decode batches (sequence indices) after the prefill: sizes 3, 2, 3.
const SCRIPT: [&[usize]; 8] = [
    &[0, 1, 2],
    &[0, 1, 2],
    &[0, 1, 2],
    &[0, 2],
    &[0, 2],
    &[0, 2],
    &[0, 1, 2],
    &[0, 1, 2],
];

/// Prefills three sequences of 3, 6 and 9 tokens in one step, then runs
/// `SCRIPT` with fixed tokens, calling `between` before each decode step;
/// every step's logits.
fn run(model: &TransformerModel, mut between: impl FnMut(usize)) -> Vec<Vec<f32>> {
    let mut seqs: Vec<Sequence> = (0..3).map(|_| model.new_sequence().unwrap()).collect();
    let prompts: Vec<Vec<u32>> = [3u32, 6, 9]
        .iter()
        .map(|&n| (0..n).map(|i| (i * 7 + n) % 50 + 1).collect())
        .collect();
    let mut out = Vec::new();
    {
        let mut steps: Vec<Step<'_>> = seqs
            .iter_mut()
            .zip(&prompts)
            .map(|(seq, p)| Step {
                seq,
                tokens: p,
                logits: Logits::Last,
            })
            .collect();
        out.extend(model.forward(&mut steps).unwrap());
    }
    for (i, batch) in SCRIPT.iter().enumerate() {
        between(i);
        let tokens: Vec<[u32; 1]> = batch
            .iter()
            .map(|&s| [(i * 3 + s) as u32 % 40 + 2])
            .collect();
        let mut steps: Vec<Step<'_>> = seqs
            .iter_mut()
            .enumerate()
            .filter(|(s, _)| batch.contains(s))
            .zip(&tokens)
            .map(|((_, seq), t)| Step {
                seq,
                tokens: t,
                logits: Logits::Last,
            })
            .collect();
        out.extend(model.forward(&mut steps).unwrap());
    }
    for s in seqs {
        model.free_sequence(s);
    }
    out
}

fn eager_logits(name: &str) -> Vec<Vec<f32>> {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::with_threads(1));
    let m = model(gpu, name, true);
    let out = run(&m, |_| {});
    assert_eq!(m.graph_stats().captures, 0, "the CPU backend has no graphs");
    m.shutdown().unwrap();
    out
}

#[test]
fn replayed_decode_steps_give_the_eager_logits_for_every_fixture() {
    for name in FIXTURES {
        let eager = eager_logits(name);
        let rec = Arc::new(Recorder::new());
        let m = model(rec.clone(), name, true);
        let graphed = run(&m, |_| {});
        assert_eq!(graphed, eager, "{name}: replayed logits differ from eager");
        let stats = m.graph_stats();
        // B=3: warm-up, capture + replay, replay; B=2 likewise; B=3 twice more.
        assert_eq!(stats.captures, 2, "{name}: one capture per batch size");
        assert_eq!(stats.replays, 6, "{name}");
        assert_eq!((stats.live, stats.failed), (2, 0), "{name}");
        assert_eq!(rec.replays.load(Ordering::Relaxed), 6);
        m.shutdown().unwrap();
        assert_eq!(rec.live_graphs(), 0, "{name}: teardown releases the graphs");
        assert_eq!(rec.released.load(Ordering::Relaxed), 2);
        assert_eq!(rec.live_bytes(), 0);
    }
}

#[test]
fn with_graphs_off_nothing_is_captured() {
    let rec = Arc::new(Recorder::new());
    let m = model(rec.clone(), "qwen3", false);
    assert_eq!(run(&m, |_| {}), eager_logits("qwen3"));
    assert_eq!(rec.captures.load(Ordering::Relaxed), 0);
    assert_eq!(m.graph_stats(), Default::default());
    m.shutdown().unwrap();
}

#[test]
fn a_stale_graph_is_captured_again() {
    let rec = Arc::new(Recorder::new());
    let m = model(rec.clone(), "bamba", true);
    // Before the third B=3 step, the graph captured at the second is stale.
    let out = run(&m, |i| {
        if i == 2 {
            rec.stale_once.store(true, Ordering::Relaxed);
        }
    });
    assert_eq!(out, eager_logits("bamba"));
    let stats = m.graph_stats();
    assert_eq!((stats.captures, stats.replays, stats.live), (3, 6, 2));
    assert_eq!(rec.released.load(Ordering::Relaxed), 1, "the stale one");
    m.shutdown().unwrap();
    assert_eq!(rec.live_graphs(), 0);
}

#[test]
fn a_failed_capture_leaves_that_batch_size_eager() {
    let rec = Arc::new(Recorder::new());
    rec.refuse_captures.store(true, Ordering::Relaxed);
    let m = model(rec.clone(), "llama", true);
    assert_eq!(run(&m, |_| {}), eager_logits("llama"));
    let stats = m.graph_stats();
    assert_eq!((stats.captures, stats.replays, stats.failed), (0, 0, 2));
    m.shutdown().unwrap();
}

#[test]
fn a_capture_refuses_host_copies() {
    let rec = Recorder::new();
    let gpu: &dyn GpuBackend = &rec;
    let buf = gpu.alloc(16, "test").unwrap();
    let err = gpu
        .capture(&mut || gpu.copy_h2d(&[0u8; 4], buf, 0))
        .unwrap_err();
    assert!(err.to_string().contains("copy_h2d"), "{err}");
    gpu.free(buf).unwrap();
}

/// The metadata of decode steps of B sequences at different positions,
/// with block tables of different lengths, lies at the same offsets, and
/// every view (address, length) is the same.
#[test]
fn decode_metadata_has_a_fixed_layout_per_batch_size() {
    for name in ["qwen3", "bamba"] {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::with_threads(1));
        let m = model(gpu.clone(), name, true);
        let has_attn = m.config.attention_layers().next().is_some();
        let buffer = as_words(m.buffers.get("step_meta").unwrap());
        let mut a = m.new_sequence().unwrap();
        let mut b = m.new_sequence().unwrap();
        let mut layouts = Vec::new();
        let mut views = Vec::new();
        for (len_a, len_b) in [(1usize, 2usize), (5, 2), (3, 11)] {
            a.pos = len_a;
            b.pos = len_b;
            let (ta, tb) = ([4u32], [9u32]);
            let mut steps = [
                Step {
                    seq: &mut a,
                    tokens: &ta,
                    logits: Logits::Last,
                },
                Step {
                    seq: &mut b,
                    tokens: &tb,
                    logits: Logits::Last,
                },
            ];
            m.reserve_kv(&mut steps).unwrap();
            let meta = StepMeta::build(&steps, 2, m.options.kv_block_size, has_attn).unwrap();
            let mut layout = meta.layout();
            let tables = layout[6].clone();
            if has_attn {
                let blocks = (len_a + 1).div_ceil(4) + (len_b + 1).div_ceil(4);
                assert_eq!(
                    tables.len(),
                    blocks,
                    "{name}: the tables hold the real blocks"
                );
            }
            layout[6] = tables.start..tables.start; // only their length varies
            layouts.push(layout);
            let v = meta.upload(gpu.as_ref(), buffer).unwrap();
            views.push(format!(
                "{:?} {:?} {:?} {:?} {} {:?} {:?} {} {:?}",
                v.ids,
                v.positions,
                v.kv_slots,
                v.attn.seqs,
                v.attn.n_seqs,
                v.attn.block_tables,
                v.recurrent.seqs,
                v.recurrent.n_seqs,
                v.logit_rows
            ));
            assert_eq!(meta.words().len(), tables.end);
        }
        assert!(
            layouts.windows(2).all(|w| w[0] == w[1]),
            "{name}: {layouts:?}"
        );
        assert!(views.windows(2).all(|w| w[0] == w[1]), "{name}: {views:?}");
        m.free_sequence(a);
        m.free_sequence(b);
        m.shutdown().unwrap();
    }
}
