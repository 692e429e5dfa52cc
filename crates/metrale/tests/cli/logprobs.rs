//! Top-N log-probabilities on the bundled default model: with greedy
//! decoding the sampled token is the first alternative, and every reported
//! value is the log-softmax of the logits `Model::logits` gives for the same
//! prefix (within 1e-4); streaming and blocking report the same; none are
//! reported unless asked; more than 20 are refused.

use std::path::PathBuf;
use std::sync::Arc;

use metrale::gpu_runtime::cpu::CpuBackend;
use metrale::gpu_runtime::gpu::GpuBackend;
use metrale::{
    EngineConfig, Generator, LoadOptions, Model, PrefixCacheOptions, SamplingParams, StreamEvent,
};

fn default_model() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/default"))
}

fn load_model() -> (Arc<CpuBackend>, Model) {
    let cpu = Arc::new(CpuBackend::with_threads(2));
    let gpu: Arc<dyn GpuBackend> = cpu.clone();
    // Without prefix caching: the tests compare a prompt's second run with
    // its first, which would otherwise reuse the first's KV and state and
    // compute the rest in other chunks (other roundings).
    let mut options = LoadOptions::default();
    options.model.prefix_cache = PrefixCacheOptions::disabled();
    let model = Model::load_on(&default_model(), gpu, &options, &mut |_| {})
        .expect("the default model loads");
    (cpu, model)
}

fn load() -> (Arc<CpuBackend>, Generator) {
    let (cpu, model) = load_model();
    let config = EngineConfig {
        step_tokens: 32,
        prefill_chunk: 8,
        ..EngineConfig::default()
    };
    (cpu, model.into_generator(config).expect("tokenizer loads"))
}

fn params(n: usize, top: usize, temperature: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        seed: Some(7),
        max_tokens: Some(n),
        ignore_eos: true,
        logprobs: true,
        top_logprobs: top,
        ..SamplingParams::default()
    }
}

/// log-softmax of one row of logits, in f64.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row
        .iter()
        .fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
    let lse = row
        .iter()
        .map(|&x| (f64::from(x) - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    row.iter().map(|&x| f64::from(x) - lse).collect()
}

#[test]
fn top_logprobs_are_the_log_softmax_of_the_logits() {
    const STEPS: usize = 8;
    const TOP: usize = 5;
    let (cpu, mut g) = load();
    let prompt = g.encode("The quick brown fox jumps").expect("encode");
    let out = g
        .generate_ids(prompt.clone(), &params(STEPS, TOP, 0.0))
        .expect("generate");
    // Streaming reports the same alternatives.
    let mut streamed = Vec::new();
    for event in g
        .stream_ids(prompt.clone(), &params(STEPS, TOP, 0.0))
        .expect("stream")
    {
        if let StreamEvent::Token {
            token,
            logprob,
            top_logprobs,
            ..
        } = event.expect("event")
        {
            streamed.push((token, logprob, top_logprobs));
        }
    }
    let vocab = g.engine().model().config().vocab_size;
    let tokenizer = g.tokenizer().clone();
    g.shutdown().expect("shutdown");
    assert_eq!(cpu.live_bytes(), 0);

    assert_eq!(out.tokens.len(), STEPS);
    assert_eq!(out.logprobs.len(), STEPS);
    assert_eq!(out.top_logprobs.len(), STEPS);
    for (i, (token, logprob, top)) in streamed.iter().enumerate() {
        assert_eq!(*token, out.tokens[i]);
        assert_eq!(*logprob, out.logprobs[i]);
        assert_eq!(top, &out.top_logprobs[i]);
    }

    // The logits of the same prefixes, computed apart from the engine.
    let (cpu, model) = load_model();
    let mut ids = prompt.clone();
    ids.extend_from_slice(&out.tokens[..STEPS - 1]);
    let logits = model.logits(&ids, None).expect("logits");
    model.shutdown().expect("shutdown");
    assert_eq!(cpu.live_bytes(), 0);

    for step in 0..STEPS {
        let top = &out.top_logprobs[step];
        assert_eq!(top.len(), TOP, "step {step}");
        // Greedy: the sampled token is the first alternative, same value.
        assert_eq!(
            top[0],
            (out.tokens[step], out.logprobs[step]),
            "step {step}"
        );
        assert!(
            top.windows(2).all(|w| w[0].1 >= w[1].1),
            "step {step}: not sorted: {top:?}"
        );
        let mass: f64 = top.iter().map(|e| f64::from(e.1).exp()).sum();
        assert!(mass <= 1.0 + 1e-6, "step {step}: mass {mass}");

        let pos = prompt.len() - 1 + step;
        let expected = log_softmax(&logits[pos * vocab..(pos + 1) * vocab]);
        let total: f64 = expected.iter().map(|v| v.exp()).sum();
        assert!((total - 1.0).abs() < 1e-9);
        for &(id, lp) in top {
            let want = expected[id as usize];
            assert!(
                (f64::from(lp) - want).abs() < 1e-4,
                "step {step} id {id}: {lp} vs {want}"
            );
            assert!(tokenizer.token_text(id).is_ok(), "id {id} renders");
        }
        // No id left out is more likely than the least likely listed.
        let least = f64::from(top[TOP - 1].1);
        for (id, &v) in expected.iter().enumerate() {
            if !top.iter().any(|e| e.0 as usize == id) {
                assert!(v <= least + 1e-4, "step {step}: id {id} ({v}) left out");
            }
        }
    }
}

#[test]
fn sampled_tokens_report_the_raw_distribution_too() {
    let (cpu, mut g) = load();
    let out = g
        .generate("Once upon a time", &params(12, 20, 1.3))
        .expect("generate");
    for (i, top) in out.top_logprobs.iter().enumerate() {
        assert_eq!(top.len(), 20);
        // The sampled token is no more likely than the first alternative,
        // and where it is listed its value is the same.
        assert!(out.logprobs[i] <= top[0].1);
        if let Some(e) = top.iter().find(|e| e.0 == out.tokens[i]) {
            assert_eq!(e.1, out.logprobs[i]);
        }
    }
    g.shutdown().expect("shutdown");
    assert_eq!(cpu.live_bytes(), 0);
}

#[test]
fn none_unless_asked_and_at_most_twenty() {
    let (cpu, mut g) = load();
    let out = g.generate("hi", &params(4, 0, 0.0)).expect("generate");
    assert_eq!(out.top_logprobs.len(), 4, "one (empty) list per token");
    assert!(out.top_logprobs.iter().all(|t| t.is_empty()));
    assert!(out.logprobs.iter().all(|&lp| lp <= 0.0 && lp.is_finite()));
    let err = g
        .generate("hi", &params(4, 21, 0.0))
        .expect_err("21 alternatives");
    assert!(err.to_string().contains("top_logprobs"), "{err}");
    assert!(!g.engine().has_unfinished());
    g.shutdown().expect("shutdown");
    assert_eq!(cpu.live_bytes(), 0);
}
