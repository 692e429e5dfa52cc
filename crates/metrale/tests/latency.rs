//! Latency isolation of a spawned generator: submitting or cancelling a
//! request does not wait for the step the engine thread is running.
//!
//! The assertion is about order, not only wall time: while the engine
//! thread runs one long prefill step, a submit returns before that step's
//! token is out (the engine used to answer submits only between steps, so
//! a submit returned after it). The step's measured duration only sets the
//! moment the submit is issued and a generous bound on how long it may take.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrale::engine::model::ModelOptions;
use metrale::gpu_runtime::cpu::CpuBackend;
use metrale::gpu_runtime::gpu::GpuBackend;
use metrale::{
    EngineConfig, GeneratorHandle, LoadOptions, Model, PrefixCacheOptions, SamplingParams,
    StreamEvent,
};

/// Tokens of the long prompt, prefilled in one step.
const LONG: usize = 3000;

/// The bundled default model with room for a [`LONG`] prompt: its files,
/// `max_position_embeddings` raised (its weights do not depend on it).
fn long_context_model() -> PathBuf {
    let from = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/default"));
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("latency-default-long");
    std::fs::create_dir_all(&dir).expect("scratch dir");
    for entry in std::fs::read_dir(&from).expect("the default model") {
        let path = entry.expect("entry").path();
        let name = path.file_name().expect("a file name");
        std::fs::copy(&path, dir.join(name)).expect("copy");
    }
    let text = std::fs::read_to_string(from.join("config.json")).expect("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&text).expect("json");
    config["max_position_embeddings"] = serde_json::json!(LONG + 64);
    std::fs::write(dir.join("config.json"), config.to_string()).expect("write config.json");
    dir
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams {
        max_tokens: Some(n),
        ignore_eos: true,
        ..SamplingParams::greedy()
    }
}

/// A prompt of `len` ids of the default model's vocabulary (512).
fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 3 + (i * 37 + salt * 101) % 500)
        .collect()
}

/// Reads a stream to its end; the number of tokens.
fn finish(stream: metrale::RequestStream) -> usize {
    let mut tokens = 0;
    for event in stream {
        match event.expect("event") {
            StreamEvent::Token { .. } => tokens += 1,
            StreamEvent::Finished { .. } => return tokens,
            StreamEvent::PromptLogprobs { .. } => {}
        }
    }
    panic!("the stream ended without Finished");
}

/// The wall time of one step that prefills `long` whole (the engine idle
/// before): a one-token request's time from submit to its token.
fn step_time(handle: &GeneratorHandle, long: &[u32]) -> Duration {
    let start = Instant::now();
    let stream = handle.submit_ids(long.to_vec(), greedy(1)).expect("submit");
    assert_eq!(finish(stream), 1);
    start.elapsed()
}

#[test]
fn submit_and_cancel_do_not_wait_for_the_running_step() {
    let cpu = Arc::new(CpuBackend::with_threads(2));
    let gpu: Arc<dyn GpuBackend> = cpu.clone();
    let options = LoadOptions {
        model: ModelOptions {
            max_batch_tokens: LONG,
            kv_blocks: (LONG + 64).div_ceil(16) * 2,
            // The same long prompt is sent again and again: with the
            // prefix cache each would prefill only its last token, and the
            // step this test needs to overlap would not run.
            prefix_cache: PrefixCacheOptions::disabled(),
            ..ModelOptions::default()
        },
        ..LoadOptions::default()
    };
    let model = Model::load_on(&long_context_model(), gpu, &options, &mut |_| {}).expect("loads");
    // An idle engine prefills the whole prompt in one step.
    let long = prompt(LONG, 1);
    let handle = model
        .into_generator(EngineConfig::default())
        .expect("tokenizer")
        .spawn()
        .expect("spawn");
    step_time(&handle, &long); // Warm-up.
    let step = (0..3)
        .map(|_| step_time(&handle, &long))
        .min()
        .expect("three runs");
    eprintln!("one {}-token prefill step: {step:?}", long.len());

    // The engine thread starts the long step at once; a fifth of it later,
    // it is surely running.
    let mut running = handle.submit_ids(long.clone(), greedy(1)).expect("submit");
    std::thread::sleep(step / 5);
    let start = Instant::now();
    let submitted = handle.submit_ids(prompt(8, 2), greedy(3));
    let submit_took = start.elapsed();
    let cancelled = handle.submit_ids(prompt(8, 3), greedy(50)).expect("submit");
    let start = Instant::now();
    drop(cancelled);
    let cancel_took = start.elapsed();
    let step_over = running.next_timeout(Duration::ZERO).is_some();
    eprintln!("submit: {submit_took:?}, cancel: {cancel_took:?}");
    let submitted = submitted.expect("the submit succeeds");
    assert!(
        !step_over,
        "submit returned only after the running step ({step:?}) had ended (it took {submit_took:?})"
    );
    assert!(
        submit_took < step / 2,
        "submit took {submit_took:?} while a {step:?} step ran"
    );
    assert!(
        cancel_took < step / 2,
        "cancelling took {cancel_took:?} while a {step:?} step ran"
    );
    // Both requests still run to their ends; the cancelled one left nothing.
    assert!(matches!(
        running.next(),
        Some(Ok(StreamEvent::Token { .. }))
    ));
    assert!(matches!(
        running.next(),
        Some(Ok(StreamEvent::Finished { .. }))
    ));
    assert_eq!(finish(submitted), 3);
    handle.shutdown().expect("shutdown");
    assert_eq!(cpu.live_bytes(), 0);
}
