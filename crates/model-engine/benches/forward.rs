//! End-to-end forward steps on random-weight models at real shapes
//! (`benches/configs/`): a prefill chunk and a decode step.
//!
//! `cargo bench -p metrale-model-engine --bench forward -- --warm-up-time 1 --measurement-time 5`
//! `METRALE_BENCH_CONFIGS=granite-4.0-h-350m,llama-370m` picks the shapes
//! (default: the Granite hybrid), `METRALE_THREADS` the threads (default 2),
//! `METRALE_PREFILL` the prefill chunk (default 128 tokens).

use std::path::PathBuf;
use std::sync::Arc;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use metrale_core::DType;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_engine::config::load_config;
use metrale_model_engine::model::{Logits, ModelOptions, Step, TransformerModel};

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn forward(c: &mut Criterion) {
    let threads: usize = env_or("METRALE_THREADS", 2);
    let prefill: usize = env_or("METRALE_PREFILL", 128);
    let shapes: String = env_or("METRALE_BENCH_CONFIGS", "granite-4.0-h-350m".to_string());
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../benches/configs");
    for shape in shapes.split(',') {
        // load_config reads DIR/config.json; the bench configs are single files.
        let dir =
            std::env::temp_dir().join(format!("metrale-bench-{shape}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        std::fs::copy(root.join(format!("{shape}.json")), dir.join("config.json")).expect("config");
        let config = load_config(&dir).expect("config parses");
        let _ = std::fs::remove_dir_all(&dir);
        let vocab = config.vocab_size as u32;
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::with_threads(threads));
        let options = ModelOptions {
            max_batch_tokens: prefill,
            kv_blocks: 4 * prefill.div_ceil(16) + 64,
            max_seqs: 2,
            ..ModelOptions::default()
        };
        let model =
            TransformerModel::random(gpu, config, options, 0, DType::BF16).expect("random model");
        let prompt: Vec<u32> = (0..prefill as u32)
            .map(|i| (i * 7919 + 13) % vocab)
            .collect();
        let mut g = c.benchmark_group(format!("forward/{shape}"));
        g.sample_size(10);
        g.throughput(Throughput::Elements(prefill as u64));
        g.bench_function(format!("prefill{prefill}"), |b| {
            b.iter(|| {
                let mut seq = model.new_sequence().expect("sequence");
                let out = model.forward(&mut [Step {
                    seq: &mut seq,
                    tokens: &prompt,
                    logits: Logits::Last,
                }]);
                model.free_sequence(seq);
                out.expect("prefill")
            })
        });
        // Decode steps continue one sequence from a prefilled prompt; the
        // cache is reset (a fresh sequence) every 256 steps to stay in bounds.
        let mut seq = model.new_sequence().expect("sequence");
        model
            .forward(&mut [Step {
                seq: &mut seq,
                tokens: &prompt,
                logits: Logits::None,
            }])
            .expect("prefill");
        let mut steps = 0usize;
        g.throughput(Throughput::Elements(1));
        g.bench_function("decode_step", |b| {
            b.iter(|| {
                if steps == 256 {
                    let fresh = model.new_sequence().expect("sequence");
                    model.free_sequence(std::mem::replace(&mut seq, fresh));
                    model
                        .forward(&mut [Step {
                            seq: &mut seq,
                            tokens: &prompt,
                            logits: Logits::None,
                        }])
                        .expect("prefill");
                    steps = 0;
                }
                steps += 1;
                let id = [(steps as u32 * 31) % vocab];
                model
                    .forward(&mut [Step {
                        seq: &mut seq,
                        tokens: &id,
                        logits: Logits::Last,
                    }])
                    .expect("decode")
            })
        });
        g.finish();
        model.free_sequence(seq);
        model.shutdown().expect("teardown");
    }
}

criterion_group!(benches, forward);
criterion_main!(benches);
