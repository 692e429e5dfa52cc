//! Errors in OpenAI's shape and status, the API key, the body limit, the
//! waiting-queue bound, /health, /v1/models and /metrics.

use crate::common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::*;
use metrale_server::ServerConfig;
use serde_json::json;

fn raw_post(server: &TestServer, path: &str, body: &str) -> Response {
    send(server.addr, "POST", path, &[], Some(body.as_bytes()))
}

#[test]
fn bad_requests_are_openai_shaped() {
    let server = served();
    let e = raw_post(&server, "/v1/completions", "{\"prompt\": ").error(400);
    assert_eq!(e["type"], "invalid_request_error");
    raw_post(
        &server,
        "/v1/completions",
        r#"{"prompt": "x", "max_tokens": "ten"}"#,
    )
    .error(400);
    let e = raw_post(
        &server,
        "/v1/completions",
        r#"{"prompt": "x", "max_tokens": -1}"#,
    )
    .error(400);
    assert!(e["message"].as_str().unwrap().contains("max_tokens"), "{e}");
    raw_post(
        &server,
        "/v1/completions",
        r#"{"prompt": "x", "max_tokens": 0}"#,
    )
    .error(400);
    raw_post(
        &server,
        "/v1/completions",
        r#"{"prompt": "x", "temperature": -1}"#,
    )
    .error(400);
    raw_post(&server, "/v1/completions", r#"{"prompt": "x", "top_p": 0}"#).error(400);
    raw_post(&server, "/v1/completions", r#"{"prompt": "x", "n": 0}"#).error(400);
    raw_post(&server, "/v1/chat/completions", r#"{"messages": "hi"}"#).error(400);
    raw_post(&server, "/v1/chat/completions", r#"{"messages": []}"#).error(400);
    // Beyond the context (512 positions).
    let e = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 100000}),
    )
    .error(400);
    assert!(e["message"].as_str().unwrap().contains("max_tokens"), "{e}");
    let long = "word ".repeat(2000);
    post(server.addr, "/v1/completions", &json!({"prompt": long})).error(400);

    let e = post(
        server.addr,
        "/v1/completions",
        &json!({"model": "gpt-4", "prompt": "x"}),
    )
    .error(404);
    assert_eq!(e["code"], "model_not_found");
    assert_eq!(e["param"], "model");
    let e = post(
        server.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f g"}}]}),
    )
    .error(400);
    assert_eq!(e["param"], "tools", "{e}");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("tools[0].function.name"),
        "{e}"
    );
    post(
        server.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}),
    )
    .error(400);
    get(server.addr, "/v1/nothing").error(404);

    // Completion options this server does not implement are refused, not
    // ignored.
    for (body, param) in [
        (json!({"prompt": "x", "suffix": "!"}), "suffix"),
        (json!({"prompt": "x", "best_of": 2}), "best_of"),
        (json!({"prompt": "x", "best_of": 3, "n": 2}), "best_of"),
        (json!({"prompt": "x", "best_of": 1, "n": 2}), "best_of"),
    ] {
        let e = post(server.addr, "/v1/completions", &body).error(400);
        assert_eq!(e["param"], param, "{body}: {e}");
    }
    // best_of = n is plain sampling, and echo: false asks for nothing.
    for body in [
        json!({"prompt": "x", "best_of": 2, "n": 2, "max_tokens": 1}),
        json!({"prompt": "x", "echo": false, "max_tokens": 1}),
    ] {
        let r = post(server.addr, "/v1/completions", &body);
        assert_eq!(r.status, 200, "{body}: {}", r.body);
    }

    // Nothing that would change the reply is silently dropped: a logit
    // bias, a template of the request's own are refused naming the field; their inert
    // values, labels and fields nobody defines pass.
    let chat = |extra: serde_json::Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        post(server.addr, "/v1/chat/completions", &body)
    };
    for (extra, param) in [
        (json!({"logit_bias": {"5": 10}}), "logit_bias"),
        (json!({"chat_template": "{{ messages }}"}), "chat_template"),
        (json!({"min_tokens": 3}), "min_tokens"),
    ] {
        let e = chat(extra.clone()).error(400);
        assert_eq!(e["param"], param, "{extra}: {e}");
        assert_eq!(e["code"], "unsupported_field", "{extra}: {e}");
    }
    for extra in [
        json!({"response_format": {"type": "text"}, "logit_bias": {}, "min_tokens": 0}),
        json!({"user": "u", "metadata": {"k": "v"}, "store": false, "service_tier": "auto"}),
        json!({"x_gateway_trace_id": "abc", "skip_special_tokens": false}),
        json!({"chat_template_kwargs": {"enable_thinking": false}}),
    ] {
        let r = chat(extra.clone());
        assert_eq!(r.status, 200, "{extra}: {}", r.body);
    }
    // Structured outputs are honoured; a malformed one is refused naming
    // its field, on both routes.
    for (extra, param) in [
        (
            json!({"response_format": {"type": "yaml"}}),
            "response_format",
        ),
        (
            json!({"guided_json": {"type": "object", "properties": 5}}),
            "",
        ),
        (
            json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}),
            "guided_regex",
        ),
    ] {
        let e = chat(extra.clone()).error(400);
        if !param.is_empty() {
            assert_eq!(e["param"], param, "{extra}: {e}");
        }
        let mut body = json!({"prompt": "x", "max_tokens": 1});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        post(server.addr, "/v1/completions", &body).error(400);
    }
    let r = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 4, "response_format": {"type": "json_object"}}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    // A message's image, a legacy function call or a malformed tool call
    // in the history is refused where it stands, never dropped; a
    // participant's `name` reaches the template.
    let image = json!([{"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]);
    let e = chat(json!({"messages": [{"role": "user", "content": image}]})).error(400);
    assert_eq!(e["param"], "messages[0].content[1]", "{e}");
    let call =
        json!([{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]);
    let history = json!([{"role": "user", "content": "hi"},
        {"role": "assistant", "content": null, "tool_calls": call}]);
    let e = chat(json!({"messages": history})).error(400);
    let message = e["message"].as_str().unwrap();
    assert!(
        message.contains("messages[1].tool_calls[0].function.arguments"),
        "{e}"
    );
    let legacy = json!([{"role": "user", "content": "hi"},
        {"role": "assistant", "content": null, "function_call": {"name": "f", "arguments": "{}"}}]);
    let e = chat(json!({"messages": legacy})).error(400);
    assert_eq!(e["param"], "messages[1].function_call", "{e}");
    let named = json!([{"role": "user", "content": "hi", "name": "ada"}]);
    assert_eq!(chat(json!({"messages": named})).status, 200);
}

#[test]
fn oversize_body_is_413() {
    let server = start(ServerConfig {
        body_limit: 64 << 10,
        ..ServerConfig::default()
    });
    let body = format!("{{\"prompt\": \"{}\"}}", "a".repeat(256 << 10));
    // Written on a thread while the answer is read, in case the server
    // answers before reading it all.
    let mut s = TcpStream::connect(server.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let mut w = s.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        let _ = w.write_all(head.as_bytes());
        let _ = w.write_all(body.as_bytes());
    });
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(_) if !raw.is_empty() => break,
            Err(e) => panic!("{e}"),
        }
    }
    let _ = writer.join();
    let e = parse(&raw).error(413);
    assert_eq!(e["code"], "request_too_large");
}

#[test]
fn api_key_guards_every_v1_route() {
    let server = start(ServerConfig {
        api_key: Some("sekrit".into()),
        ..ServerConfig::default()
    });
    let body = json!({"prompt": "x", "max_tokens": 1}).to_string();
    for (method, path, body) in [
        ("POST", "/v1/completions", Some(body.as_bytes())),
        ("POST", "/v1/chat/completions", Some(body.as_bytes())),
        ("GET", "/v1/models", None),
    ] {
        let e = send(server.addr, method, path, &[], body).error(401);
        assert_eq!(e["type"], "authentication_error");
        send(
            server.addr,
            method,
            path,
            &[("Authorization", "Bearer wrong")],
            body,
        )
        .error(401);
        send(
            server.addr,
            method,
            path,
            &[("Authorization", "sekrit")],
            body,
        )
        .error(401);
    }
    let ok = send(
        server.addr,
        "POST",
        "/v1/completions",
        &[("Authorization", "Bearer sekrit")],
        Some(body.as_bytes()),
    );
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert_eq!(
        get(server.addr, "/health").status,
        200,
        "/health needs no key"
    );
}

#[test]
fn a_full_waiting_queue_is_429() {
    let server = start(ServerConfig {
        max_waiting: 0,
        ..ServerConfig::default()
    });
    let e = post(server.addr, "/v1/completions", &json!({"prompt": "x"})).error(429);
    assert_eq!(e["code"], "rate_limit_exceeded");
}

#[test]
fn health_models_and_metrics() {
    let server = start(ServerConfig {
        served_model_name: Some("tiny".into()),
        ..ServerConfig::default()
    });
    let h = get(server.addr, "/health");
    assert_eq!(h.status, 200);
    let m = get(server.addr, "/v1/models").json();
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"].as_array().unwrap().len(), 1);
    assert_eq!(m["data"][0]["id"], "tiny");
    assert_eq!(m["data"][0]["object"], "model");
    post(
        server.addr,
        "/v1/completions",
        &json!({"model": "llama", "prompt": "x"}),
    )
    .error(404);

    let ok = post(
        server.addr,
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "Hello", "max_tokens": 5, "ignore_eos": true}),
    )
    .json();
    let prompt = ok["usage"]["prompt_tokens"].as_f64().unwrap();
    let s = post(
        server.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": true, "stream": true}),
    );
    assert_eq!(s.status, 200);
    raw_post(&server, "/v1/completions", "not json").error(400);

    let text = get(server.addr, "/metrics").body;
    let count = |route: &str, status: u16| {
        metric(
            &text,
            &format!("metrale_requests_total{{route=\"{route}\",status=\"{status}\"}}"),
        )
    };
    assert_eq!(count("/v1/completions", 200), 1.0, "{text}");
    assert_eq!(count("/v1/completions", 404), 1.0);
    assert_eq!(count("/v1/completions", 400), 1.0);
    assert_eq!(count("/v1/chat/completions", 200), 1.0);
    assert_eq!(count("/v1/models", 200), 1.0);
    assert_eq!(count("/health", 200), 1.0);
    assert_eq!(metric(&text, "metrale_generation_tokens_total"), 8.0);
    assert!(metric(&text, "metrale_prompt_tokens_total") > prompt);
    assert_eq!(
        metric(&text, "metrale_time_to_first_token_seconds_count"),
        2.0
    );
    assert_eq!(
        metric(&text, "metrale_inter_token_latency_seconds_count"),
        6.0
    );
    assert_eq!(metric(&text, "metrale_requests_running"), 0.0);
    assert_eq!(metric(&text, "metrale_requests_waiting"), 0.0);
    // Every request has ended: the engine holds nothing.
    for gauge in [
        "metrale_sequences_running",
        "metrale_sequences_waiting",
        "metrale_kv_blocks_in_use",
        "metrale_ssm_slots_in_use",
    ] {
        assert_eq!(metric(&text, gauge), 0.0, "{gauge}: {text}");
    }
    assert_eq!(metric(&text, "metrale_kv_blocks_total"), 128.0);
}

#[test]
fn the_prefix_cache_metrics_count_a_repeated_prompt() {
    let server = start(ServerConfig::default());
    let text = get(server.addr, "/metrics").body;
    for (series, kind) in [
        ("metrale_kv_blocks_cached", "gauge"),
        ("metrale_prefix_snapshot_bytes", "gauge"),
        ("metrale_prefix_cache_hit_tokens_total", "counter"),
        ("metrale_prefix_cache_recomputed_tokens_total", "counter"),
    ] {
        assert!(
            text.contains(&format!("# TYPE {series} {kind}\n")),
            "{series}: {text}"
        );
        assert_eq!(metric(&text, series), 0.0, "{series}: {text}");
    }
    let body = json!({"prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 1});
    let first = post(server.addr, "/v1/completions", &body).json();
    let prompt = first["usage"]["prompt_tokens"].as_f64().unwrap();
    let text = get(server.addr, "/metrics").body;
    assert_eq!(metric(&text, "metrale_prefix_cache_hit_tokens_total"), 0.0);
    post(server.addr, "/v1/completions", &body).json();
    let text = get(server.addr, "/metrics").body;
    // The whole prompt is cached but its last token is fed again: its
    // logits give the first generated token.
    assert_eq!(
        metric(&text, "metrale_prefix_cache_hit_tokens_total"),
        prompt - 1.0,
        "{text}"
    );
    // Attention layers only: no recurrent state to restore from a snapshot.
    assert_eq!(
        metric(&text, "metrale_prefix_cache_recomputed_tokens_total"),
        0.0
    );
    assert_eq!(metric(&text, "metrale_prefix_snapshot_bytes"), 0.0);
    assert!(metric(&text, "metrale_kv_blocks_cached") >= 1.0, "{text}");
}

#[test]
fn a_panicking_handler_is_a_500_and_the_server_stays_up() {
    let server = start_app(
        &fixture(),
        &load_options(),
        ServerConfig::default(),
        |state| {
            let app = metrale_server::api_routes(state.clone()).route(
                "/test/panic",
                axum::routing::get(|| async {
                    if true {
                        panic!("a test handler panics");
                    }
                    "unreachable"
                }),
            );
            metrale_server::layered(app, state)
        },
    );
    for _ in 0..2 {
        let e = get(server.addr, "/test/panic").error(500);
        assert_eq!(e["type"], "server_error", "{e}");
        assert!(e["message"].as_str().unwrap().contains("panicked"), "{e}");
    }
    assert_eq!(get(server.addr, "/health").status, 200);
    let v = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 2}),
    );
    assert_eq!(v.status, 200, "{}", v.body);
    let text = get(server.addr, "/metrics").body;
    assert_eq!(
        metric(
            &text,
            "metrale_requests_total{route=\"/test/panic\",status=\"500\"}"
        ),
        2.0,
        "{text}"
    );
}

/// A refused request whose body arrives after its headers leaves the
/// connection usable: a keep-alive client (the openai package's) sends its
/// next request on it.
#[test]
fn a_401_keeps_the_connection_alive() {
    let server = start(ServerConfig {
        api_key: Some("sekrit".into()),
        ..ServerConfig::default()
    });
    let mut s = TcpStream::connect(server.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let body = json!({"prompt": "x", "max_tokens": 1}).to_string();
    s.write_all(
        format!(
            "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer wrong\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .as_bytes(),
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    s.write_all(body.as_bytes()).unwrap();
    // One response, then the next request on the same connection.
    let read_response = |s: &mut TcpStream| {
        let mut raw = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            let n = s.read(&mut buf).unwrap();
            assert!(
                n > 0,
                "the connection closed: {}",
                String::from_utf8_lossy(&raw)
            );
            raw.extend_from_slice(&buf[..n]);
            if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length: "))
                    .unwrap()
                    .trim()
                    .parse()
                    .unwrap();
                if raw.len() >= end + 4 + len {
                    return parse(&raw[..end + 4 + len]);
                }
            }
        }
    };
    read_response(&mut s).error(401);
    s.write_all(
        b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer sekrit\r\n\r\n",
    )
    .unwrap();
    let r = read_response(&mut s);
    assert_eq!(r.status, 200, "{}", r.body);
}
