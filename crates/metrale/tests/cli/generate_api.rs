//! The facade's generation API on the bundled default model: blocking,
//! streaming and batched generation agree; dropping a stream cancels its
//! request; teardown leaves the ledger empty.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use metrale::gpu_runtime::cpu::CpuBackend;
use metrale::gpu_runtime::gpu::GpuBackend;
use metrale::{
    ChatMessage, EngineConfig, Finish, Generator, LoadOptions, Model, SamplingParams, StreamEvent,
};

fn default_model() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/default"))
}

fn load() -> (Arc<CpuBackend>, Generator) {
    let cpu = Arc::new(CpuBackend::with_threads(2));
    let gpu: Arc<dyn GpuBackend> = cpu.clone();
    let options = LoadOptions::default();
    let model = Model::load_on(&default_model(), gpu, &options, &mut |_| {})
        .expect("the default model loads");
    let config = EngineConfig {
        step_tokens: 32,
        prefill_chunk: 8,
        ..EngineConfig::default()
    };
    (cpu, model.into_generator(config).expect("tokenizer loads"))
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams {
        max_tokens: Some(n),
        ignore_eos: true,
        ..SamplingParams::greedy()
    }
}

#[test]
fn blocking_streaming_and_batched_generation_agree() {
    let (cpu, mut g) = load();
    let prompt = "The quick brown fox jumps over the lazy dog, again and again";
    let blocking = g.generate(prompt, &greedy(16)).expect("generate");
    assert_eq!(blocking.tokens.len(), 16);
    assert_eq!(blocking.finish_reason, Finish::Length);
    assert_eq!(blocking.usage.completion_tokens, 16);
    assert_eq!(blocking.timings.generated_tokens, 16);
    assert!(blocking.timings.time_to_first_token <= blocking.timings.total);
    assert_eq!(
        blocking.text,
        g.tokenizer()
            .decode_with(&blocking.tokens, true)
            .expect("decode")
    );

    let mut streamed = String::new();
    let mut last = None;
    for event in g.stream(prompt, &greedy(16)).expect("stream") {
        match event.expect("event") {
            StreamEvent::Token { text, .. } => streamed.push_str(&text),
            finished @ StreamEvent::Finished { .. } => last = Some(finished),
            StreamEvent::PromptLogprobs { .. } => panic!("not asked for"),
        }
    }
    assert_eq!(streamed, blocking.text);
    assert!(matches!(
        last,
        Some(StreamEvent::Finished {
            reason: Finish::Length,
            ..
        })
    ));

    let batch = g
        .generate_batch(&["Hello", prompt, "Once upon a time"], &greedy(16))
        .expect("batch");
    assert_eq!(batch.len(), 3);
    assert_eq!(
        batch[1].tokens, blocking.tokens,
        "batching changed a greedy output"
    );
    g.shutdown().expect("shutdown");
    assert_eq!(cpu.live_bytes(), 0);
}

#[test]
fn dropping_a_stream_cancels_and_frees_its_request() {
    let (cpu, mut g) = load();
    let mut stream = g
        .stream("A long story about nothing at all", &greedy(64))
        .expect("stream");
    for _ in 0..3 {
        assert!(matches!(stream.next(), Some(Ok(StreamEvent::Token { .. }))));
    }
    drop(stream);
    let engine = g.engine();
    assert!(!engine.has_unfinished());
    assert_eq!(engine.model().kv_cache().used_blocks(), 0);
    assert_eq!(engine.model().ssm_pool().in_use(), 0);
    // The generator is still usable.
    let next = g
        .generate("hi", &greedy(4))
        .expect("generate after a cancelled stream");
    assert_eq!(next.tokens.len(), 4);
    g.shutdown().expect("shutdown");
    assert_eq!(cpu.live_bytes(), 0);
}

/// `stop_when` is checked before every engine step: a flag raised while a
/// long prompt waits to be prefilled in chunks (8 tokens a step here) ends
/// the stream before another step runs, with no token, and frees the
/// request.
#[test]
fn a_stop_flag_ends_a_stream_before_the_next_step() {
    let (cpu, mut g) = load();
    let stop = AtomicBool::new(false);
    let prompt = "many words of a long prompt ".repeat(20);
    let before = g.engine().stats().steps;
    {
        let mut stream = g
            .stream(&prompt, &greedy(64))
            .expect("stream")
            .stop_when(&stop);
        stop.store(true, Ordering::SeqCst);
        assert!(stream.next().is_none(), "a set flag ends the stream");
    }
    let engine = g.engine();
    assert_eq!(engine.stats().steps, before, "no step ran after the stop");
    assert!(!engine.has_unfinished());
    assert_eq!(engine.model().kv_cache().used_blocks(), 0);
    assert_eq!(engine.model().ssm_pool().in_use(), 0);

    // Raised while the reply streams: the next read ends it with no step
    // more than a stream dropped at that point runs.
    let two_tokens_then = |g: &mut Generator, stop: Option<&AtomicBool>| {
        let before = g.engine().stats().steps;
        {
            let unset = AtomicBool::new(false);
            let mut stream = g
                .stream(&prompt, &greedy(64))
                .expect("stream")
                .stop_when(stop.unwrap_or(&unset));
            for _ in 0..2 {
                assert!(matches!(stream.next(), Some(Ok(StreamEvent::Token { .. }))));
            }
            if let Some(stop) = stop {
                stop.store(true, Ordering::SeqCst);
                assert!(stream.next().is_none(), "the raised flag ends it");
            }
        }
        g.engine().stats().steps - before
    };
    // On two generators, so that the second run does not start from the
    // prefix the first one cached.
    let (cpu2, mut g2) = load();
    let dropped = two_tokens_then(&mut g, None);
    let stopped = two_tokens_then(&mut g2, Some(&AtomicBool::new(false)));
    assert_eq!(stopped, dropped, "no step ran after the stop");
    for (cpu, g) in [(cpu, g), (cpu2, g2)] {
        assert!(!g.engine().has_unfinished());
        g.shutdown().expect("shutdown");
        assert_eq!(cpu.live_bytes(), 0);
    }
}

#[test]
fn chat_prompts_and_errors() {
    let (cpu, mut g) = load();
    let template = g
        .chat_template()
        .expect("the default model has a chat template");
    let ids = g
        .chat_prompt(&template, &[ChatMessage::new("user", "hi")])
        .expect("render");
    let rendered = g.tokenizer().decode(&ids).expect("decode");
    // Each message a quotation ending with the separator the model was
    // trained on; its reply is a quotation of its own.
    assert_eq!(rendered, "hi<|endoftext|>");
    let stop = SamplingParams {
        stop: vec!["e".into()],
        ..greedy(32)
    };
    let out = g.generate_ids(ids, &stop).expect("generate");
    assert!(!out.text.contains('e'));
    // Requests that cannot fit fail clearly and leave nothing behind.
    let err = g.generate("hi", &greedy(1_000_000)).expect_err("too long");
    assert!(err.to_string().contains("max_tokens"), "{err}");
    let err = g
        .generate(
            "hi",
            &SamplingParams {
                temperature: -1.0,
                ..greedy(4)
            },
        )
        .expect_err("bad temperature");
    assert!(err.to_string().contains("temperature"), "{err}");
    assert!(!g.engine().has_unfinished());
    g.shutdown().expect("shutdown");
    assert_eq!(cpu.live_bytes(), 0);
}

#[test]
fn a_spawned_generator_serves_requests_from_many_threads() {
    let (cpu, mut g) = load();
    let prompts = [
        "Hello",
        "The quick brown fox",
        "Once upon a time there was",
        "1 2 3 4 5 6 7 8 9 10 11 12",
    ];
    let expected: Vec<_> = prompts
        .iter()
        .map(|p| g.generate(p, &greedy(12)).expect("generate").text)
        .collect();
    let handle = Arc::new(g.spawn().expect("spawn"));
    let threads: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (handle, prompt) = (handle.clone(), p.to_string());
            std::thread::spawn(move || {
                // A request abandoned after one token is cancelled.
                let mut abandoned = handle.submit(&prompt, greedy(64)).expect("submit");
                assert!(matches!(
                    abandoned.next(),
                    Some(Ok(StreamEvent::Token { .. }))
                ));
                drop(abandoned);
                let stream = handle.submit(&prompt, greedy(12)).expect("submit");
                let mut text = String::new();
                for event in stream {
                    if let StreamEvent::Token { text: t, .. } = event.expect("event") {
                        text.push_str(&t);
                    }
                }
                text
            })
        })
        .collect();
    let got: Vec<_> = threads
        .into_iter()
        .map(|t| t.join().expect("thread"))
        .collect();
    assert_eq!(
        got, expected,
        "concurrent requests give the greedy text of each alone"
    );
    let err = handle
        .submit_ids(vec![], greedy(4))
        .err()
        .expect("an empty prompt is rejected");
    assert!(err.to_string().contains("no tokens"), "{err}");
    let handle = Arc::try_unwrap(handle).ok().expect("the last handle");
    handle.shutdown().expect("shutdown");
    assert_eq!(cpu.live_bytes(), 0);
}
