//! The official `openai` Python client against the server (never skipped:
//! no python3, or an `openai` package that cannot be installed, fails the
//! test). The expected greedy texts come from the library: a completion's
//! from `Generator::generate` (what `metrale generate` runs: the prompt
//! encoded with special tokens, streamed to its end), a chat's from the
//! model's chat template through `Generator::chat_prompt` and
//! `generate_ids`. `openai_client.py` checks completions and chat, streamed
//! and not, stop, seed, n, logprobs, usage, and the errors as the client's
//! exception types (400, 404 `model_not_found`, 401 with an API key).

use crate::common;

use std::time::{Duration, Instant};

use crate::python::{Package, run_client};
use common::*;
use metrale::{ChatMessage, Finish, SamplingParams};
use metrale_server::ServerConfig;
use serde_json::json;

const PROMPT: &str = "The quick brown fox";
const MAX_TOKENS: usize = 12;
const API_KEY: &str = "sk-metrale-test";
/// The script takes a few seconds; past this it is killed and the test fails.
const SCRIPT_LIMIT: Duration = Duration::from_secs(300);

fn finish(reason: &Finish) -> &'static str {
    match reason {
        Finish::Length => "length",
        _ => "stop",
    }
}

#[test]
fn the_official_openai_client_gets_the_library_s_outputs() {
    let started = Instant::now();

    // The expected outputs, from the library.
    let mut g = generator();
    let greedy = SamplingParams {
        max_tokens: Some(MAX_TOKENS),
        logprobs: true,
        ..SamplingParams::greedy()
    };
    let completion = g.generate(PROMPT, &greedy).unwrap();
    let messages = [
        ChatMessage::new("system", "You are terse."),
        ChatMessage::new("user", "Name a colour."),
    ];
    let template = g
        .chat_template()
        .expect("the llama fixture has a chat template");
    let chat_ids = g.chat_prompt(&template, &messages).unwrap();
    let chat = g.generate_ids(chat_ids, &greedy).unwrap();
    g.shutdown().unwrap();
    let echo_ids: Vec<u32> = vec![1, 450, 4996, 17354, 1701, 29916, 432, 17204];
    let echo_ids: Vec<u32> = echo_ids.into_iter().map(|id| id % 512).collect();
    let echo_logprobs = model_logprobs(&echo_ids);
    let echo_text = metrale::Tokenizer::from_dir(fixture())
        .unwrap()
        .decode(&echo_ids)
        .unwrap();

    let server = served();
    let keyed = start(ServerConfig {
        api_key: Some(API_KEY.into()),
        ..ServerConfig::default()
    });
    let spec = json!({
        "base_url": format!("http://{}/v1", server.addr),
        "keyed_base_url": format!("http://{}/v1", keyed.addr),
        "api_key": API_KEY,
        "model": server.state.model_name,
        "completion": {
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "text": completion.text,
            "finish_reason": finish(&completion.finish_reason),
            "prompt_tokens": completion.usage.prompt_tokens,
            "completion_tokens": completion.usage.completion_tokens,
            "logprobs": completion.logprobs,
        },
        "chat": {
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a colour."},
            ],
            "max_tokens": MAX_TOKENS,
            "text": chat.text,
            "finish_reason": finish(&chat.finish_reason),
            "prompt_tokens": chat.usage.prompt_tokens,
            "completion_tokens": chat.usage.completion_tokens,
        },
        "echo": {"ids": echo_ids, "logprobs": echo_logprobs, "text": echo_text},
    });
    run_script(&spec, "official");
    eprintln!(
        "official-client test took {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// Each token of `ids` after the first: its log-probability under the
/// model given those before it, the log-softmax (in f64) of the logits
/// `metrale logits` writes for `ids` ([`metrale::Model::logits`], one
/// prefill).
fn model_logprobs(ids: &[u32]) -> Vec<f64> {
    let model = metrale::Model::load(&fixture(), &load_options(), &mut |_| {}).unwrap();
    let logits = model.logits(ids, None).unwrap();
    let vocab = logits.len() / ids.len();
    let out = logits
        .chunks_exact(vocab)
        .zip(&ids[1..])
        .map(|(row, &next)| {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
            row[next as usize] as f64 - max - sum.ln()
        })
        .collect();
    model.shutdown().unwrap();
    out
}

/// Runs `openai_client.py` on `spec`; fails the test unless every check
/// passed.
fn run_script(spec: &serde_json::Value, tag: &str) {
    run_client(
        "openai_client.py",
        tag,
        spec,
        &[Package::OPENAI],
        SCRIPT_LIMIT,
    );
}

/// A model of each newer family (Qwen3.5 as published: the vision-language
/// wrapper; Qwen3.5-MoE, LFM2, LFM2-MoE) through the server: listed, and
/// a greedy chat streamed and not equal to the library's templated
/// generation.
#[test]
fn every_newer_family_chats_through_the_official_client() {
    for name in ["qwen3_5", "qwen3_5_moe", "lfm2", "lfm2_moe"] {
        let dir = fixture().join("..").join(name);
        let greedy = SamplingParams {
            max_tokens: Some(MAX_TOKENS),
            ..SamplingParams::greedy()
        };
        let mut g = metrale::Generator::load(
            &dir,
            &load_options(),
            metrale::EngineConfig::default(),
            &mut |_| {},
        )
        .unwrap_or_else(|e| panic!("{name}: {e:#}"));
        let messages = [
            ChatMessage::new("system", "You are terse."),
            ChatMessage::new("user", "Name a colour."),
        ];
        let template = g.chat_template().expect("the fixture has a chat template");
        let ids = g.chat_prompt(&template, &messages).unwrap();
        let chat = g.generate_ids(ids, &greedy).unwrap();
        g.shutdown().unwrap();
        let server = start_app(
            &dir,
            &load_options(),
            ServerConfig::default(),
            metrale_server::router,
        );
        let spec = json!({
            "sections": ["models", "chat"],
            "base_url": format!("http://{}/v1", server.addr),
            "model": server.state.model_name,
            "chat": {
                "messages": [
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Name a colour."},
                ],
                "max_tokens": MAX_TOKENS,
                "text": chat.text,
                "finish_reason": finish(&chat.finish_reason),
                "prompt_tokens": chat.usage.prompt_tokens,
                "completion_tokens": chat.usage.completion_tokens,
            },
        });
        eprintln!("{name}: greedy chat {:?}", chat.text);
        run_script(&spec, name);
    }
}
