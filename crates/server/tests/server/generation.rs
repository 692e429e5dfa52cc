//! Completions and chat over HTTP on the llama fixture: greedy text equal
//! to `Generator::generate`'s, streamed chunks that add up to the
//! non-streamed text and end with [DONE], usage, n, stop strings, seeds,
//! logprobs, and a client that leaves mid-stream cancelling its request.

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use metrale::SamplingParams;
use serde_json::{Value, json};

const PROMPT: &str = "The quick brown fox";

/// The greedy continuation `Generator::generate` gives.
fn reference(prompt: &str, max_tokens: usize) -> metrale::Generation {
    let mut g = generator();
    let params = SamplingParams {
        max_tokens: Some(max_tokens),
        ..SamplingParams::greedy()
    };
    let out = g.generate(prompt, &params).unwrap();
    g.shutdown().unwrap();
    out
}

/// The texts of a streamed response's choices, and its last chunk before [DONE].
fn streamed_texts(resp: &Response, key: fn(&Value) -> Option<&str>) -> (Vec<String>, Vec<Value>) {
    assert_eq!(resp.status, 200, "{}", resp.body);
    assert!(
        resp.header("content-type")
            .unwrap()
            .starts_with("text/event-stream"),
        "{:?}",
        resp.headers
    );
    let data = resp.sse_data();
    assert_eq!(
        data.last().map(String::as_str),
        Some("[DONE]"),
        "{}",
        resp.body
    );
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let mut texts = Vec::new();
    for c in &chunks {
        for choice in c["choices"].as_array().unwrap() {
            let i = choice["index"].as_u64().unwrap() as usize;
            if texts.len() <= i {
                texts.resize(i + 1, String::new());
            }
            if let Some(t) = key(choice) {
                texts[i].push_str(t);
            }
        }
    }
    (texts, chunks)
}

#[test]
fn completion_greedy_matches_generate_streamed_and_not() {
    let want = reference(PROMPT, 12);
    let server = served();
    let body = json!({"model": "llama", "prompt": PROMPT, "max_tokens": 12, "temperature": 0});
    let resp = post(server.addr, "/v1/completions", &body);
    assert_eq!(resp.status, 200, "{}", resp.body);
    let v = resp.json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], "llama");
    assert_eq!(v["choices"][0]["text"], want.text.as_str());
    let reason = if want.finish_reason == metrale::Finish::Length {
        "length"
    } else {
        "stop"
    };
    assert_eq!(v["choices"][0]["finish_reason"], reason);
    assert_eq!(v["usage"]["prompt_tokens"], want.usage.prompt_tokens);
    assert_eq!(
        v["usage"]["completion_tokens"],
        want.usage.completion_tokens
    );
    assert_eq!(
        v["usage"]["total_tokens"],
        want.usage.prompt_tokens + want.usage.completion_tokens
    );

    let mut body = body;
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let resp = post(server.addr, "/v1/completions", &body);
    let (texts, chunks) = streamed_texts(&resp, |c| c["text"].as_str());
    assert_eq!(texts, vec![want.text.clone()]);
    let finish = chunks
        .iter()
        .filter(|c| !c["choices"][0]["finish_reason"].is_null())
        .count();
    assert_eq!(finish, 1);
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(
        usage["completion_tokens"], want.usage.completion_tokens,
        "{usage}"
    );
    assert_eq!(chunks.last().unwrap()["choices"], json!([]));
}

#[test]
fn chat_streamed_equals_non_streamed() {
    let server = served();
    let messages = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]);
    let body = json!({"messages": messages, "max_completion_tokens": 10, "temperature": 0});
    let resp = post(server.addr, "/v1/chat/completions", &body);
    assert_eq!(resp.status, 200, "{}", resp.body);
    let v = resp.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    let usage = &v["usage"];
    assert!(usage["completion_tokens"].as_u64().unwrap() <= 10);
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 5);

    // The same through the template by hand gives the same text.
    let mut g = generator();
    let template = g.chat_template().unwrap();
    let msgs = [
        metrale::ChatMessage::new("system", "Be brief."),
        metrale::ChatMessage::new("user", "Hello there"),
    ];
    let ids = g.chat_prompt(&template, &msgs).unwrap();
    let params = SamplingParams {
        max_tokens: Some(10),
        ..SamplingParams::greedy()
    };
    let want = g.generate_ids(ids, &params).unwrap();
    g.shutdown().unwrap();
    assert_eq!(text, want.text);
    assert_eq!(usage["prompt_tokens"], want.usage.prompt_tokens);

    let mut body = body;
    body["stream"] = json!(true);
    let resp = post(server.addr, "/v1/chat/completions", &body);
    let (texts, chunks) = streamed_texts(&resp, |c| c["delta"]["content"].as_str());
    assert_eq!(texts, vec![text]);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    assert!(
        chunks.iter().all(|c| c.get("usage").is_none()),
        "usage only when asked"
    );
}

#[test]
fn n_choices_seeds_and_stop_strings() {
    let server = served();
    let body = json!({"prompt": PROMPT, "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": 7});
    let a = post(server.addr, "/v1/completions", &body).json();
    assert_eq!(a["choices"].as_array().unwrap().len(), 2, "{a}");
    assert_eq!(a["choices"][1]["index"], 1);
    let b = post(server.addr, "/v1/completions", &body).json();
    let texts = |v: &Value| -> Vec<String> {
        v["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["text"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(texts(&a), texts(&b), "a seed reproduces");
    // Prompt tokens are counted once for the n choices.
    let one = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 1}),
    )
    .json();
    assert_eq!(a["usage"]["prompt_tokens"], one["usage"]["prompt_tokens"]);
    // Streamed n=2 gives both choices, each finished once.
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let (streamed, chunks) = streamed_texts(&post(server.addr, "/v1/completions", &sb), |c| {
        c["text"].as_str()
    });
    assert_eq!(streamed, texts(&a));
    let finished = chunks
        .iter()
        .filter(|c| !c["choices"][0]["finish_reason"].is_null())
        .count();
    assert_eq!(finished, 2);

    // A stop string cut from the greedy text ends the output before it.
    let greedy = reference(PROMPT, 16).text;
    let chars: Vec<char> = greedy.chars().collect();
    if chars.len() >= 6 {
        let stop: String = chars[3..5].iter().collect();
        let v = post(
            server.addr,
            "/v1/completions",
            &json!({"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": [stop.clone(), "\u{1}never"]}),
        )
        .json();
        let text = v["choices"][0]["text"].as_str().unwrap();
        assert_eq!(
            text,
            &greedy[..greedy.find(&stop).unwrap()],
            "stop {stop:?}"
        );
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        let v = post(
            server.addr,
            "/v1/completions",
            &json!({"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": stop}),
        )
        .json();
        assert_eq!(
            v["choices"][0]["text"],
            &greedy[..greedy.find(&stop).unwrap()]
        );
    }
}

#[test]
fn logprobs_are_the_sampled_tokens() {
    let server = served();
    let want = reference(PROMPT, 4);
    let v = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 0}),
    )
    .json();
    let lp = &v["choices"][0]["logprobs"];
    let got: Vec<f64> = lp["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert_eq!(got.len(), want.logprobs.len(), "{v}");
    for (g, w) in got.iter().zip(&want.logprobs) {
        assert!((g - *w as f64).abs() < 1e-4, "{g} vs {w}");
    }
    let v = post(
        server.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": true}),
    )
    .json();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        content.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap()
    );
    assert!(
        content
            .iter()
            .all(|c| c["logprob"].as_f64().unwrap() <= 0.0)
    );
}

/// `logprobs: N` (completions) and `top_logprobs` (chat) report the N most
/// likely tokens per position; greedily, the best is the sampled one.
#[test]
fn top_logprobs_list_the_most_likely_tokens() {
    let server = served();
    let v = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 3}),
    )
    .json();
    let lp = &v["choices"][0]["logprobs"];
    let tops = lp["top_logprobs"].as_array().expect("top_logprobs");
    let sampled = lp["token_logprobs"].as_array().unwrap();
    assert_eq!(tops.len(), sampled.len(), "{v}");
    for (top, s) in tops.iter().zip(sampled) {
        let map = top.as_object().unwrap();
        assert!(!map.is_empty() && map.len() <= 3, "{top}");
        let best = map
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::NEG_INFINITY, f64::max);
        assert!((best - s.as_f64().unwrap()).abs() < 1e-6, "{top} vs {s}");
    }
    let v = post(
        server.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                "temperature": 0, "logprobs": true, "top_logprobs": 2}),
    )
    .json();
    for c in v["choices"][0]["logprobs"]["content"].as_array().unwrap() {
        let top = c["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2, "{c}");
        assert_eq!(top[0]["token"], c["token"], "{c}");
        assert!(top[0]["logprob"].as_f64() >= top[1]["logprob"].as_f64());
    }
    for (route, body) in [
        ("/v1/completions", json!({"prompt": PROMPT, "logprobs": 21})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}),
        ),
    ] {
        let r = post(server.addr, route, &body);
        assert_eq!(r.status, 400, "{route}: {}", r.body);
    }
}

#[test]
fn a_client_leaving_mid_stream_cancels_its_request() {
    let server = served();
    let body = json!({"prompt": PROMPT, "max_tokens": 400, "ignore_eos": true, "stream": true});
    let socket = open_stream(server.addr, "/v1/completions", &body, 3);
    assert_eq!(
        server.state.metrics.running() + server.state.metrics.waiting(),
        1
    );
    // The engine's view: one sequence, holding KV blocks (the prompt's and
    // the tokens streamed so far).
    let m = get(server.addr, "/metrics").body;
    assert_eq!(metric(&m, "metrale_sequences_running"), 1.0, "{m}");
    assert_eq!(metric(&m, "metrale_sequences_waiting"), 0.0);
    assert!(metric(&m, "metrale_kv_blocks_in_use") >= 1.0, "{m}");
    assert_eq!(metric(&m, "metrale_kv_blocks_total"), 128.0);
    assert_eq!(
        metric(&m, "metrale_ssm_slots_in_use"),
        0.0,
        "llama has no SSM layers"
    );
    drop(socket);
    let start = Instant::now();
    while server.state.metrics.running() + server.state.metrics.waiting() > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the request is still running"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The engine frees the request's memory at its next step boundary.
    loop {
        let m = get(server.addr, "/metrics").body;
        if metric(&m, "metrale_sequences_running") == 0.0
            && metric(&m, "metrale_kv_blocks_in_use") == 0.0
        {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the engine still holds the request: {m}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let generated_then = metric(
        &get(server.addr, "/metrics").body,
        "metrale_generation_tokens_total",
    );
    // Prompt tokens are counted when a request finishes: this one never did.
    assert_eq!(
        metric(
            &get(server.addr, "/metrics").body,
            "metrale_prompt_tokens_total"
        ),
        0.0
    );
    assert!(
        generated_then < 400.0,
        "cancelled before its end: {generated_then}"
    );
    // The engine goes on serving.
    let v = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 2}),
    )
    .json();
    assert_eq!(v["usage"]["completion_tokens"], 2);
    let m = get(server.addr, "/metrics").body;
    assert_eq!(metric(&m, "metrale_requests_running"), 0.0);
    assert_eq!(metric(&m, "metrale_requests_waiting"), 0.0);
}

#[test]
fn shutdown_lets_a_running_stream_finish_and_stops_accepting() {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = start_until(metrale_server::ServerConfig::default(), async {
        let _ = stopped.await;
    });
    let body = json!({"prompt": PROMPT, "max_tokens": 300, "ignore_eos": true, "stream": true});
    let mut socket = open_stream(server.addr, "/v1/completions", &body, 2);
    stop.send(()).unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut socket, &mut rest).unwrap();
    assert!(rest.contains("\"finish_reason\":\"length\""), "{rest}");
    assert!(rest.contains("data: [DONE]"), "{rest}");
    // The listener is closed once the connections have ended.
    let start = Instant::now();
    while std::net::TcpStream::connect(server.addr).is_ok() {
        assert!(start.elapsed() < Duration::from_secs(10), "still accepting");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A copy of the llama fixture whose generation_config.json also holds
/// `extra` (JSON members, without braces).
fn with_generation_config(tag: &str, extra: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "metrale-server-gen-defaults-{}-{tag}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(fixture()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    let path = dir.join("generation_config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replacen('{', &format!("{{\n  {extra},"), 1)).unwrap();
    dir
}

/// A request that leaves a field out gets the checkpoint's default for it
/// (generation_config.json: top_k 1, so any seed gives the greedy text;
/// max_new_tokens 3); a field given overrides it.
#[test]
fn absent_request_fields_take_the_checkpoints_defaults() {
    let dir = with_generation_config("server", r#""top_k": 1, "max_new_tokens": 3"#);
    let mut g = metrale::Generator::load(
        &dir,
        &load_options(),
        metrale::EngineConfig::default(),
        &mut |_| {},
    )
    .unwrap();
    let greedy = SamplingParams {
        max_tokens: Some(3),
        ignore_eos: true,
        ..SamplingParams::greedy()
    };
    let want = g.generate(PROMPT, &greedy).unwrap();
    g.shutdown().unwrap();

    let server = start_app(
        &dir,
        &load_options(),
        metrale_server::ServerConfig::default(),
        metrale_server::router,
    );
    for seed in 0..3 {
        let body = json!({"prompt": PROMPT, "seed": seed, "ignore_eos": true});
        let resp = post(server.addr, "/v1/completions", &body);
        assert_eq!(resp.status, 200, "{}", resp.body);
        let v = resp.json();
        assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
        assert_eq!(v["choices"][0]["text"], want.text.as_str(), "seed {seed}");
    }
    // Given fields win: max_tokens 5 instead of 3.
    let body = json!({"prompt": PROMPT, "max_tokens": 5, "ignore_eos": true, "top_k": -1});
    let v = post(server.addr, "/v1/completions", &body).json();
    assert_eq!(v["usage"]["completion_tokens"], 5, "{v}");
    // Chat's default is the checkpoint's max_new_tokens too.
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": true});
    let resp = post(server.addr, "/v1/chat/completions", &body);
    assert_eq!(resp.status, 200, "{}", resp.body);
    assert_eq!(
        resp.json()["usage"]["completion_tokens"],
        3,
        "{}",
        resp.body
    );
}

const HASH: &str = "0123456789abcdef0123456789abcdef01234567";

/// `metrale-serve --model org/name` finds the model in the Hugging Face
/// cache (refs/main, a snapshot of symlinks into blobs/) and serves it
/// under that name; a model not in the cache is a clear error.
#[test]
fn the_server_binary_takes_a_hub_id() {
    let cache = std::env::temp_dir().join(format!("metrale-server-hub-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let root = cache.join("models--org--tiny");
    let snapshot = root.join("snapshots").join(HASH);
    std::fs::create_dir_all(root.join("blobs")).unwrap();
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(root.join("refs")).unwrap();
    std::fs::write(root.join("refs/main"), HASH).unwrap();
    for entry in std::fs::read_dir(fixture()).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        std::fs::copy(entry.path(), root.join("blobs").join(&name)).unwrap();
        std::os::unix::fs::symlink(
            std::path::Path::new("../../blobs").join(&name),
            snapshot.join(&name),
        )
        .unwrap();
    }
    let serve = |model: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_metrale-serve"))
            .args([
                "--model",
                model,
                "--port",
                "0",
                "--device",
                "cpu",
                "--threads",
                "1",
            ])
            .env("HF_HUB_CACHE", &cache)
            .env_remove("METRALE_MODEL")
            .stderr(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap()
    };
    let out = serve("org/absent").wait_with_output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("not in the Hugging Face cache"), "{stderr}");

    let mut child = serve("org/tiny");
    let (addr, seen) = server_address(&mut child);
    let models = get(addr, "/v1/models").json();
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(models["data"][0]["id"], "org/tiny", "{models}");
    assert!(
        seen.contains(HASH),
        "it names the snapshot it loaded: {seen}"
    );
}
