//! Scheduler tests on the fixture checkpoints: rejection of requests that can
//! never fit, waiting for slots and blocks, the step budget, chunked
//! prefill, preemption when the cache is full, cancellation.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_model_weights::loader::WeightDType;

use super::*;
use crate::model::ModelOptions;
use crate::sampling::Finish;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn options(kv_blocks: usize, max_seqs: usize) -> ModelOptions {
    ModelOptions {
        kv_block_size: 4,
        kv_blocks,
        max_seqs,
        max_batch_tokens: 64,
        kv_dtype: None,
        kv_follows_weights: false,
        ssm_state_dtype: None,
        ssm_state_follows_weights: false,
        cuda_graphs: true,
        prefix_cache: Default::default(),
    }
}

fn engine(
    name: &str,
    options: ModelOptions,
    config: EngineConfig,
    tokenizer: bool,
) -> (Arc<CpuBackend>, Engine) {
    let cpu = Arc::new(CpuBackend::with_threads(2));
    let gpu: Arc<dyn GpuBackend> = cpu.clone();
    let model = TransformerModel::load(
        &fixture(name),
        gpu,
        options,
        WeightDType::AsStored,
        &mut |_| {},
    )
    .expect("fixture loads");
    let tok = tokenizer.then(|| Tokenizer::from_dir(fixture(name)).expect("fixture tokenizer"));
    (cpu, Engine::new(model, tok, config))
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        ..SamplingParams::greedy()
    }
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 3 + (i * 37 + salt * 101) % 500)
        .collect()
}

/// Steps until idle, checking `each` after every step; the tokens and
/// finish of every request.
fn drain(
    engine: &mut Engine,
    mut each: impl FnMut(&Engine, &[Event]),
) -> HashMap<RequestId, (Vec<u32>, Finish)> {
    let mut out: HashMap<RequestId, (Vec<u32>, Option<Finish>)> = HashMap::new();
    let mut steps = 0;
    while engine.has_unfinished() {
        let events = engine.step().expect("step");
        each(engine, &events);
        for e in events {
            match e {
                Event::Token { id, token, .. } => out.entry(id).or_default().0.push(token),
                Event::Finished { id, reason, .. } => out.entry(id).or_default().1 = Some(reason),
                Event::Error { id, message } => panic!("{id}: {message}"),
                Event::PromptLogprobs { .. } => {}
            }
        }
        steps += 1;
        assert!(steps < 10_000, "the engine does not make progress");
    }
    out.into_iter()
        .map(|(id, (t, f))| (id, (t, f.expect("finished"))))
        .collect()
}

fn teardown(cpu: &CpuBackend, engine: Engine) {
    assert_eq!(engine.model().kv_cache().used_blocks(), 0);
    assert_eq!(engine.model().ssm_pool().in_use(), 0);
    engine.shutdown().expect("shutdown");
    assert_eq!(cpu.live_bytes(), 0);
}

#[test]
fn rejects_requests_that_can_never_fit() {
    let (cpu, mut e) = engine("llama", options(8, 2), EngineConfig::default(), false);
    let err = |r: Result<RequestId>| r.expect_err("rejected").to_string();
    // 8 blocks of 4 tokens: 32 tokens in all.
    let msg = err(e.add_request(prompt(20, 0), greedy(13)));
    assert!(msg.contains("KV cache holds 32 tokens"), "{msg}");
    assert!(e.add_request(prompt(20, 0), greedy(12)).is_ok());
    assert!(err(e.add_request(vec![], greedy(1))).contains("no tokens"));
    assert!(err(e.add_request(vec![600], greedy(1))).contains("outside the vocabulary"));
    let bad = SamplingParams {
        top_p: 0.0,
        ..greedy(1)
    };
    assert!(err(e.add_request(vec![5], bad)).contains("top_p"));
    let stop = SamplingParams {
        stop: vec!["x".into()],
        ..greedy(1)
    };
    assert!(err(e.add_request(vec![5], stop)).contains("tokenizer"));
    assert_eq!(e.num_waiting(), 1);
    teardown(&cpu, e);

    // A pure Mamba-2 model has no KV cache: only max_position_embeddings limits.
    let (cpu, mut e) = engine("mamba2", options(1, 1), EngineConfig::default(), false);
    let limit = e.context_limit();
    assert_eq!(limit, e.model().config().max_position_embeddings);
    let msg = err(e.add_request(vec![5; limit], greedy(1)));
    assert!(msg.contains("max_position_embeddings"), "{msg}");
    // A max_tokens near usize::MAX is refused, not an overflow.
    let msg = err(e.add_request(vec![5], greedy(usize::MAX)));
    assert!(msg.contains("max_tokens"), "{msg}");
    teardown(&cpu, e);
}

#[test]
fn waits_for_slots_and_keeps_the_step_budget() {
    let config = EngineConfig {
        step_tokens: 16,
        prefill_chunk: 6,
        ..EngineConfig::default()
    };
    let (cpu, mut e) = engine("granitemoehybrid", options(64, 2), config, false);
    let ids: Vec<_> = (0..5)
        .map(|i| {
            e.add_request(prompt(10 + 7 * i, i as u32), greedy(5))
                .expect("add")
        })
        .collect();
    let mut last_fed = 0;
    let out = drain(&mut e, |e, _| {
        assert!(e.num_running() <= 2, "at most max_seqs run at once");
        assert!(e.model().ssm_pool().in_use() <= 2);
        let fed = e.stats().tokens_fed;
        assert!(fed - last_fed <= 16, "a step fed {} tokens", fed - last_fed);
        last_fed = fed;
    });
    for id in ids {
        assert_eq!(out[&id], (out[&id].0.clone(), Finish::Length));
        assert_eq!(out[&id].0.len(), 5);
    }
    teardown(&cpu, e);
}

#[test]
fn chunked_prefill_and_batching_give_the_tokens_of_one_request_alone() {
    for name in ["llama", "granitemoehybrid", "qwen3_next"] {
        let prompts: Vec<_> = (0..4).map(|i| prompt(9 + 11 * i, i as u32)).collect();
        let (cpu, mut alone) = engine(name, options(64, 4), EngineConfig::default(), false);
        let mut expected = Vec::new();
        for p in &prompts {
            let id = alone.add_request(p.clone(), greedy(6)).expect("add");
            expected.push(drain(&mut alone, |_, _| {}).remove(&id).expect("done").0);
        }
        teardown(&cpu, alone);

        let config = EngineConfig {
            step_tokens: 12,
            prefill_chunk: 5,
            ..EngineConfig::default()
        };
        let (cpu, mut batched) = engine(name, options(64, 4), config, false);
        let ids: Vec<_> = prompts
            .iter()
            .map(|p| batched.add_request(p.clone(), greedy(6)).expect("add"))
            .collect();
        let out = drain(&mut batched, |_, _| {});
        for (id, want) in ids.iter().zip(&expected) {
            assert_eq!(&out[id].0, want, "{name} {id}");
        }
        teardown(&cpu, batched);
    }
}

#[test]
fn preempts_when_the_cache_is_full_and_recomputes() {
    // 6 blocks of 4 tokens; each request needs up to 4 blocks (8 + 8 tokens).
    for name in ["llama", "granitemoehybrid"] {
        let prompts: Vec<_> = (0..3).map(|i| prompt(8, i)).collect();
        let (cpu, mut roomy) = engine(name, options(64, 3), EngineConfig::default(), false);
        let ids: Vec<_> = prompts
            .iter()
            .map(|p| roomy.add_request(p.clone(), greedy(8)).expect("add"))
            .collect();
        let expected = drain(&mut roomy, |_, _| {});
        assert_eq!(roomy.stats().preemptions, 0);
        teardown(&cpu, roomy);

        let (cpu, mut tight) = engine(name, options(6, 3), EngineConfig::default(), false);
        let tight_ids: Vec<_> = prompts
            .iter()
            .map(|p| tight.add_request(p.clone(), greedy(8)).expect("add"))
            .collect();
        let out = drain(&mut tight, |e, _| {
            assert!(e.model().kv_cache().used_blocks() <= 6)
        });
        assert!(
            tight.stats().preemptions > 0,
            "{name}: the tight cache should preempt"
        );
        for (a, b) in ids.iter().zip(&tight_ids) {
            assert_eq!(
                expected[a].0, out[b].0,
                "{name}: preemption changed the output"
            );
        }
        teardown(&cpu, tight);
    }
}

#[test]
fn cancel_frees_blocks_and_slot_at_once() {
    let config = EngineConfig {
        step_tokens: 8,
        prefill_chunk: 4,
        ..EngineConfig::default()
    };
    let (cpu, mut e) = engine("bamba", options(32, 2), config, false);
    let gauges = e.gauges();
    let g = gauges.read();
    assert_eq!((g.running, g.waiting, g.kv_blocks_in_use), (0, 0, 0));
    assert_eq!(
        (g.ssm_slots_in_use, g.ssm_slots_total, g.kv_blocks_total),
        (0, 2, 32)
    );
    let a = e.add_request(prompt(30, 1), greedy(10)).expect("add");
    let b = e.add_request(prompt(5, 2), greedy(10)).expect("add");
    let c = e.add_request(prompt(5, 3), greedy(10)).expect("add");
    assert_eq!(gauges.read().waiting, 3, "queued requests count at once");
    e.step().expect("step");
    assert_eq!(e.num_running(), 2, "a and b run, c waits for a slot");
    assert!(e.model().kv_cache().used_blocks() > 0);
    let g = gauges.read();
    assert_eq!((g.running, g.waiting, g.ssm_slots_in_use), (2, 1, 2));
    assert_eq!(g.kv_blocks_in_use, e.model().kv_cache().used_blocks());
    assert!(e.cancel(a), "a is mid-prefill");
    assert!(e.cancel(c), "c is waiting");
    assert!(!e.cancel(c));
    assert_eq!(e.model().ssm_pool().in_use(), 1);
    e.step().expect("step");
    e.step().expect("step");
    assert!(e.cancel(b), "b is decoding");
    assert_eq!(e.model().kv_cache().used_blocks(), 0);
    assert_eq!(e.model().ssm_pool().in_use(), 0);
    let g = gauges.read();
    assert_eq!(
        (g.running, g.waiting, g.kv_blocks_in_use, g.ssm_slots_in_use),
        (0, 0, 0, 0),
        "a cancel updates the gauges at once"
    );
    assert!(!e.has_unfinished());
    assert!(e.step().expect("idle step").is_empty());
    teardown(&cpu, e);
}

#[test]
fn stop_token_ids_and_max_tokens_end_requests() {
    let (cpu, mut e) = engine("qwen3", options(64, 2), EngineConfig::default(), false);
    let id = e.add_request(prompt(7, 4), greedy(10)).expect("add");
    let tokens = drain(&mut e, |_, _| {}).remove(&id).expect("done").0;
    assert_eq!(tokens.len(), 10);
    let stop = tokens[3];
    let first = tokens.iter().position(|&t| t == stop).unwrap_or(3);
    let params = SamplingParams {
        stop_token_ids: vec![stop],
        ..greedy(10)
    };
    let id = e.add_request(prompt(7, 4), params).expect("add");
    let (got, finish) = drain(&mut e, |_, _| {}).remove(&id).expect("done");
    assert_eq!(finish, Finish::StopToken(stop));
    assert_eq!(got, tokens[..=first]);
    teardown(&cpu, e);
}

#[test]
fn decoding_requests_get_a_token_every_step_while_a_long_prompt_is_prefilled() {
    let config = EngineConfig {
        mixed_prefill_tokens: 6,
        ..EngineConfig::default()
    };
    let (cpu, mut e) = engine("granitemoehybrid", options(64, 4), config, false);
    // Nothing decodes yet: the three prompts go in one step, whole.
    let decoders: Vec<_> = (0..3)
        .map(|i| {
            e.add_request(prompt(4 + i, i as u32), greedy(40))
                .expect("add")
        })
        .collect();
    let events = e.step().expect("step");
    assert_eq!(e.stats().tokens_fed, 15);
    assert_eq!(events.len(), 3, "a first token each");
    let long = e.add_request(prompt(100, 7), greedy(2)).expect("add");
    let mut steps = 0;
    loop {
        let fed = e.stats().tokens_fed;
        let events = e.step().expect("step");
        steps += 1;
        assert!(
            e.stats().tokens_fed - fed <= 3 + 6,
            "a step fed {} tokens",
            e.stats().tokens_fed - fed
        );
        for id in &decoders {
            assert!(
                events
                    .iter()
                    .any(|ev| matches!(ev, Event::Token { id: t, .. } if t == id)),
                "{id} got no token in step {steps}"
            );
        }
        if events.iter().any(|ev| ev.id() == long) {
            break;
        }
        assert!(steps < 100, "the long prompt never finished its prefill");
    }
    assert_eq!(steps, 100usize.div_ceil(6), "6 prompt tokens a step");
    let out = drain(&mut e, |_, _| {});
    assert_eq!(out[&long].0.len(), 1, "its second token");
    teardown(&cpu, e);
}

#[test]
fn requests_prepared_on_other_threads_queue_in_id_order() {
    // One slot: requests run one after the other, in queue order.
    let (cpu, mut e) = engine("llama", options(64, 1), EngineConfig::default(), false);
    let intake = e.intake();
    let (first, second) = std::thread::spawn(move || {
        let first = intake.prepare(prompt(5, 1), greedy(3)).expect("prepare");
        let err = intake
            .prepare(vec![600], greedy(1))
            .expect_err("outside the vocabulary");
        assert!(err.to_string().contains("vocabulary"), "{err}");
        let second = intake.prepare(prompt(6, 2), greedy(3)).expect("prepare");
        (first, second)
    })
    .join()
    .expect("thread");
    let (a, b) = (first.id(), second.id());
    assert_eq!(b.0, a.0 + 1, "a rejected request uses up no id");
    assert_eq!(e.enqueue(second).expect("enqueue"), b);
    assert_eq!(e.enqueue(first).expect("enqueue"), a);
    let events = e.step().expect("step");
    assert!(
        events.iter().all(|ev| ev.id() == a),
        "the older request runs first"
    );
    assert!(!events.is_empty());

    // A request prepared for another engine is refused, not queued.
    let (other_cpu, other) = engine("llama", options(64, 1), EngineConfig::default(), false);
    let foreign = other
        .intake()
        .prepare(prompt(5, 3), greedy(3))
        .expect("prepare");
    let err = e.enqueue(foreign).expect_err("foreign");
    assert!(err.to_string().contains("another engine"), "{err}");
    teardown(&other_cpu, other);

    let out = drain(&mut e, |_, _| {});
    assert_eq!(out.len(), 2);
    teardown(&cpu, e);
}

#[test]
fn constrained_requests_batch_with_free_ones_and_end_valid() {
    use crate::sampling::OutputConstraint;
    let (cpu, mut e) = engine(
        "granitemoehybrid",
        options(64, 4),
        EngineConfig::default(),
        true,
    );
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "name": {"type": "string", "maxLength": 5},
            "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}
        },
        "required": ["id", "name", "flags"],
        "additionalProperties": false
    });
    let sampled = |seed, constraint| SamplingParams {
        temperature: 1.0,
        seed: Some(seed),
        max_tokens: Some(60),
        constraint,
        ..SamplingParams::default()
    };
    let json = Some(OutputConstraint::JsonSchema(schema));
    let regex = Some(OutputConstraint::Regex("[a-c]{2,4}-[0-9]".into()));
    let ids = [
        e.add_request(prompt(9, 1), sampled(1, json.clone()))
            .unwrap(),
        e.add_request(prompt(5, 2), sampled(2, regex)).unwrap(),
        e.add_request(prompt(7, 3), sampled(3, None)).unwrap(),
        e.add_request(prompt(3, 4), sampled(4, json)).unwrap(),
    ];
    let out = drain(&mut e, |_, _| {});
    let tok = Tokenizer::from_dir(fixture("granitemoehybrid")).unwrap();
    for (i, id) in ids.iter().enumerate() {
        let (tokens, finish) = &out[id];
        let text = tok.decode(tokens).unwrap();
        match i {
            0 | 3 => {
                assert_eq!(finish, &Finish::Grammar, "{text:?}");
                let v: serde_json::Value = serde_json::from_str(&text).unwrap();
                assert!(v["id"].as_u64().unwrap() <= 999, "{text}");
                assert!(v["name"].as_str().unwrap().chars().count() <= 5, "{text}");
            }
            1 => {
                assert_eq!(finish, &Finish::Grammar, "{text:?}");
                let (letters, digit) = text.split_once('-').unwrap();
                assert!((2..=4).contains(&letters.len()), "{text}");
                assert!(
                    letters.bytes().all(|b| (b'a'..=b'c').contains(&b)),
                    "{text}"
                );
                assert!(
                    digit.len() == 1 && digit.as_bytes()[0].is_ascii_digit(),
                    "{text}"
                );
            }
            _ => assert!(!tokens.is_empty()),
        }
    }
    // A constraint that does not compile is refused before it is queued.
    let bad = e.add_request(
        prompt(3, 5),
        sampled(5, Some(OutputConstraint::Regex("(".into()))),
    );
    assert!(bad.unwrap_err().to_string().contains("regex"));
    teardown(&cpu, e);
}

/// The model's own log-softmax of every row of one prefill of `ids`.
fn reference_logprobs(name: &str, ids: &[u32]) -> Vec<f32> {
    let (_cpu, e) = engine(name, options(64, 2), EngineConfig::default(), false);
    let model = e.into_model();
    let mut seq = model.new_sequence().unwrap();
    let rows = model
        .forward(&mut [crate::model::Step {
            seq: &mut seq,
            tokens: ids,
            logits: crate::model::Logits::All,
        }])
        .unwrap()
        .remove(0);
    model.free_sequence(seq);
    let vocab = rows.len() / ids.len();
    let mut out = Vec::new();
    for (i, row) in rows.chunks_exact(vocab).enumerate().take(ids.len() - 1) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
        out.push((row[ids[i + 1] as usize] as f64 - max - sum.ln()) as f32);
    }
    model.shutdown().unwrap();
    out
}

#[test]
fn prompt_logprobs_are_the_models_log_softmax_in_any_chunking() {
    for name in ["llama", "granitemoehybrid"] {
        let ids = prompt(40, 7);
        let want = reference_logprobs(name, &ids);
        for chunk in [0, 7] {
            let config = EngineConfig {
                prefill_chunk: chunk,
                ..EngineConfig::default()
            };
            let mut opts = options(64, 2);
            opts.prefix_cache.enabled = true;
            let (cpu, mut e) = engine(name, opts, config, true);
            // The same prompt twice: the second would start from the
            // first's cached prefix, but a scoring request computes it all.
            let mut got = HashMap::new();
            for round in 0..2 {
                let scoring = SamplingParams {
                    prompt_logprobs: Some(3),
                    max_tokens: Some(if round == 0 { 0 } else { 2 }),
                    ..SamplingParams::greedy()
                };
                let id = e.add_request(ids.clone(), scoring).unwrap();
                let mut scores = Vec::new();
                let mut tokens = 0;
                while e.has_unfinished() {
                    for event in e.step().unwrap() {
                        match event {
                            Event::PromptLogprobs {
                                first, logprobs, ..
                            } => {
                                assert_eq!(first, scores.len() + 1, "{name}: in order");
                                scores.extend(logprobs);
                            }
                            Event::Token { .. } => {
                                assert_eq!(scores.len(), ids.len() - 1, "scored first");
                                tokens += 1;
                            }
                            Event::Finished { usage, .. } => {
                                assert_eq!(usage.cached_tokens, 0);
                            }
                            Event::Error { message, .. } => panic!("{message}"),
                        }
                    }
                }
                assert_eq!(
                    tokens,
                    if round == 0 { 0 } else { 2 },
                    "{name} round {round}"
                );
                got.insert(id, scores);
            }
            for scores in got.values() {
                assert_eq!(scores.len(), want.len());
                for (i, (s, w)) in scores.iter().zip(&want).enumerate() {
                    assert!(
                        (s.logprob - w).abs() < 1e-5,
                        "{name} chunk {chunk} token {}: {} vs {w}",
                        i + 1,
                        s.logprob
                    );
                    assert_eq!(s.token, ids[i + 1]);
                    assert_eq!(s.top_logprobs.len(), 3);
                    assert!(s.top_logprobs[0].1 >= s.logprob);
                    // Its rank is its place among the most likely.
                    match s.top_logprobs.iter().position(|t| t.0 == s.token) {
                        Some(at) => assert_eq!(s.rank as usize, at + 1, "{s:?}"),
                        None => assert!(s.rank > 3, "{s:?}"),
                    }
                }
            }
            teardown(&cpu, e);
        }
    }
}
