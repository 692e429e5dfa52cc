//! `/tokenize` and `/detokenize` in vLLM's shapes: the ids the server runs
//! for a prompt or a conversation, and back to text.

use serde_json::json;

use crate::common::{post, served};

#[test]
fn tokenize_gives_the_ids_the_routes_run() {
    let server = served();
    let tokenize = |body| post(server.addr, "/tokenize", &body).json();
    let t = tokenize(json!({"prompt": "Once upon a time", "return_token_strs": true}));
    let ids: Vec<u64> = serde_json::from_value(t["tokens"].clone()).unwrap();
    assert_eq!(t["count"], ids.len(), "{t}");
    assert!(
        !ids.is_empty() && t["max_model_len"].as_u64().unwrap() > 0,
        "{t}"
    );
    assert_eq!(t["token_strs"].as_array().unwrap().len(), ids.len(), "{t}");
    // The completion of those ids counts as many prompt tokens.
    let c = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 1}),
    )
    .json();
    assert_eq!(c["usage"]["prompt_tokens"], ids.len(), "{c}");
    // A conversation: the ids /v1/chat/completions runs for it.
    let messages = json!([{"role": "user", "content": "hello there"}]);
    let t = tokenize(json!({"messages": messages}));
    let c = post(
        server.addr,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 1}),
    )
    .json();
    assert_eq!(c["usage"]["prompt_tokens"], t["count"], "{t} {c}");
    // Without the assistant's opening: the conversation as it stands, a
    // prefix of the ids with it.
    let closed = tokenize(json!({"messages": messages, "add_generation_prompt": false}));
    let (open_ids, closed_ids) = (
        t["tokens"].as_array().unwrap(),
        closed["tokens"].as_array().unwrap(),
    );
    assert!(closed_ids.len() < open_ids.len(), "{closed} {t}");
    assert_eq!(open_ids[..closed_ids.len()], closed_ids[..], "{closed} {t}");
    let c2 = post(
        server.addr,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 1, "add_generation_prompt": false}),
    )
    .json();
    assert_eq!(c2["usage"]["prompt_tokens"], closed["count"], "{c2}");
    // Back to text.
    let d = post(server.addr, "/detokenize", &json!({"tokens": ids})).json();
    assert!(
        d["prompt"].as_str().unwrap().ends_with("Once upon a time"),
        "{d}"
    );
}

#[test]
fn bad_tokenize_requests_are_400s_naming_the_field() {
    let server = served();
    let bad = |path: &str, body| post(server.addr, path, &body).error(400);
    bad("/tokenize", json!({}));
    bad("/tokenize", json!({"prompt": "x", "messages": []}));
    let e = bad("/detokenize", json!({"tokens": [1, 99999999]}));
    assert_eq!(e["param"], "tokens", "{e}");
    let e = bad("/tokenize", json!({"prompt": "x", "logit_bias": {"5": 10}}));
    assert_eq!(e["param"], "logit_bias", "{e}");
    let e = post(
        server.addr,
        "/tokenize",
        &json!({"model": "other", "prompt": "x"}),
    )
    .error(404);
    assert_eq!(e["param"], "model", "{e}");
}
