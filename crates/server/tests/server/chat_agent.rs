//! Agent conversations on the chat route: `chat_template_kwargs`, the
//! reply's reasoning split out, and tools (a forced call, streamed and
//! not, its result sent back), on the qwen3_5 fixture rendered with
//! Qwen3.5's published chat template (tools, `<think>`, Qwen3Xml calls).
//! `agent_client.py` drives the tool loop with the official `openai`
//! client and validates the calls' arguments with `jsonschema`.
//!
//! The weights are random: a reply is only of a known shape where a
//! grammar holds it (a forced call, a regex), so every check here is of
//! such a reply, with a fixed seed.

use std::path::{Path, PathBuf};
use std::time::Duration;

use metrale_server::ServerConfig;
use serde_json::{Value, json};

use crate::common::*;
use crate::python::{Package, run_client};

const SCRIPT_LIMIT: Duration = Duration::from_secs(600);

/// The qwen3_5 fixture with Qwen3.5's published chat template and room
/// for its tool instructions (a few thousand of this tokenizer's tokens;
/// the config says 512 positions, RoPE takes any); written once for all
/// the tests of this module, which run at once.
fn agent_fixture() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(write_agent_fixture).clone()
}

fn write_agent_fixture() -> PathBuf {
    let src = fixture().join("../qwen3_5");
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("qwen3_5-agent");
    std::fs::create_dir_all(&dir).unwrap();
    for name in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(src.join(name), dir.join(name)).unwrap();
    }
    let edit = |name: &str, f: &dyn Fn(&mut Value)| {
        let path = dir.join(name);
        let mut v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        f(&mut v);
        std::fs::write(&path, v.to_string()).unwrap();
    };
    edit("config.json", &|c| {
        c["text_config"]["max_position_embeddings"] = json!(8192);
    });
    let template = std::fs::read_to_string(src.join("../templates/qwen3_5.jinja")).unwrap();
    edit("tokenizer_config.json", &|c| {
        c["chat_template"] = json!(template)
    });
    dir
}

fn agent_server() -> TestServer {
    let mut options = load_options();
    options.model.kv_blocks = 1024;
    start_app(
        &agent_fixture(),
        &options,
        ServerConfig::default(),
        metrale_server::router,
    )
}

fn weather_tool() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "days"]}}})
}

fn ask() -> Value {
    json!([{"role": "user", "content": "Weather in Paris?"}])
}

fn chat(server: &TestServer, body: Value) -> Value {
    let r = post(server.addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

/// The chunks of a streamed chat.
fn stream(server: &TestServer, mut body: Value) -> Vec<Value> {
    body["stream"] = json!(true);
    let r = post(server.addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    r.sse_data()
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

#[test]
fn chat_template_kwargs_reach_the_template() {
    let server = agent_server();
    let count = |kwargs: Value| {
        let body = json!({"messages": ask(), "chat_template_kwargs": kwargs});
        let r = post(server.addr, "/tokenize", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["count"].as_u64().unwrap()
    };
    let on = count(json!({"enable_thinking": true}));
    let off = count(json!({"enable_thinking": false}));
    assert_eq!(count(Value::Null), on, "thinking is on unless turned off");
    assert!(off > on, "off closes the think block: {off} vs {on}");
    for bad in [json!([1]), json!({"tools": []})] {
        let body = json!({"messages": ask(), "chat_template_kwargs": bad});
        let e = post(server.addr, "/v1/chat/completions", &body).error(400);
        assert!(
            e["message"]
                .as_str()
                .unwrap()
                .contains("chat_template_kwargs"),
            "{e}"
        );
    }
}

#[test]
fn reasoning_is_split_from_the_answer() {
    let server = agent_server();
    let body = json!({"messages": ask(), "max_tokens": 40, "seed": 1,
        "structured_outputs": {"regex": "x{2}</think>\n\nanswer"}});
    let r = chat(&server, body.clone());
    let m = &r["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], "xx", "{r}");
    assert_eq!(m["content"], "answer", "{r}");
    let chunks = stream(&server, body.clone());
    let joined = |key: &str| -> String {
        (chunks.iter())
            .filter_map(|c| c["choices"][0]["delta"][key].as_str())
            .collect()
    };
    assert_eq!(joined("reasoning_content"), "xx");
    assert_eq!(joined("content"), "answer");
    // Thinking turned off: nothing is split.
    let mut off = body;
    off["chat_template_kwargs"] = json!({"enable_thinking": false});
    off["structured_outputs"] = json!({"regex": "plain"});
    let r = chat(&server, off);
    let m = &r["choices"][0]["message"];
    assert_eq!(
        (&m["content"], m.get("reasoning_content")),
        (&json!("plain"), None)
    );
}

#[test]
fn a_forced_call_streamed_and_not() {
    let server = agent_server();
    let body = json!({"messages": ask(), "tools": [weather_tool()], "tool_choice": "required",
        "max_tokens": 200, "seed": 3, "chat_template_kwargs": {"enable_thinking": false}});
    let r = chat(&server, body.clone());
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{r}");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert!(!calls.is_empty());
    assert_eq!(choice["message"]["content"], Value::Null, "{r}");
    let whole: Vec<(String, String)> = calls
        .iter()
        .map(|c| {
            assert!(c["id"].as_str().unwrap().starts_with("call_"));
            assert_eq!(c["type"], "function");
            let f = &c["function"];
            let args: Value = serde_json::from_str(f["arguments"].as_str().unwrap()).unwrap();
            assert!(
                ["Paris", "Tokyo"].contains(&args["city"].as_str().unwrap()),
                "{args}"
            );
            assert!((1..=7).contains(&args["days"].as_i64().unwrap()), "{args}");
            (
                f["name"].as_str().unwrap().into(),
                f["arguments"].as_str().unwrap().into(),
            )
        })
        .collect();
    let chunks = stream(&server, body);
    let mut streamed: Vec<(String, String)> = Vec::new();
    for c in &chunks {
        for d in c["choices"][0]["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let i = d["index"].as_u64().unwrap() as usize;
            if let Some(name) = d["function"]["name"].as_str() {
                assert_eq!(i, streamed.len(), "calls start in order");
                assert!(d["id"].as_str().unwrap().starts_with("call_"));
                streamed.push((name.into(), String::new()));
            }
            streamed[i].1 += d["function"]["arguments"].as_str().unwrap_or("");
        }
    }
    assert_eq!(streamed, whole);
    let last = chunks
        .iter()
        .rev()
        .find(|c| c["choices"][0]["finish_reason"].is_string());
    assert_eq!(last.unwrap()["choices"][0]["finish_reason"], "tool_calls");
}

#[test]
fn bad_tools_are_refused_by_name() {
    let server = agent_server();
    for (tools, choice, named) in [
        (
            json!([{"type": "function", "function": {"name": ""}}]),
            json!("auto"),
            "tools[0]",
        ),
        (
            json!([weather_tool(), {"type": "code"}]),
            json!("auto"),
            "tools[1].type",
        ),
        (
            json!([weather_tool()]),
            json!({"type": "function", "function": {"name": "nope"}}),
            "tool_choice",
        ),
    ] {
        let body = json!({"messages": ask(), "tools": tools, "tool_choice": choice});
        let e = post(server.addr, "/v1/chat/completions", &body).error(400);
        let message = e["message"].as_str().unwrap();
        assert!(message.contains(named), "{named}: {e}");
    }
    // A forced call and a response format both constrain the reply.
    let body = json!({"messages": ask(), "tools": [weather_tool()], "tool_choice": "required",
        "response_format": {"type": "json_object"}});
    post(server.addr, "/v1/chat/completions", &body).error(400);
}

/// A strict tool under `auto`: the reply is text or calls that hold (the
/// grammar's walks are `tool_grammar`'s unit tests); here, that the route
/// holds it, and refuses a second constraint beside it.
#[test]
fn a_strict_tool_under_auto_holds_the_reply() {
    let server = agent_server();
    let mut tool = weather_tool();
    tool["function"]["strict"] = json!(true);
    for seed in 0..4 {
        let body = json!({"messages": ask(), "tools": [tool.clone()], "seed": seed,
            "max_tokens": 200, "chat_template_kwargs": {"enable_thinking": false}});
        let reply = chat(&server, body);
        let choice = &reply["choices"][0];
        match choice["message"]["tool_calls"].as_array() {
            Some(calls) => {
                assert_eq!(choice["finish_reason"], "tool_calls", "{reply}");
                for call in calls {
                    let args: Value =
                        serde_json::from_str(call["function"]["arguments"].as_str().unwrap())
                            .unwrap();
                    assert!(["Paris", "Tokyo"].contains(&args["city"].as_str().unwrap()));
                }
            }
            None => {
                let text = choice["message"]["content"].as_str().unwrap_or_default();
                assert!(!text.contains("<tool_call>"), "{reply}");
            }
        }
    }
    let body =
        json!({"messages": ask(), "tools": [tool], "response_format": {"type": "json_object"}});
    let e = post(server.addr, "/v1/chat/completions", &body).error(400);
    assert_eq!(e["param"], "tools", "{e}");
}

/// The tool loop through the official client: `agent_client.py`.
#[test]
fn the_official_client_runs_a_tool_loop() {
    let server = agent_server();
    let spec = json!({
        "base_url": format!("http://{}/v1", server.addr),
        "model": server.state.model_name,
        "tools": [weather_tool(), {"type": "function", "function": {"name": "now",
            "parameters": {"type": "object", "properties": {}}}}],
    });
    run_client(
        "agent_client.py",
        "tool-loop",
        &spec,
        &[Package::OPENAI, Package::JSONSCHEMA],
        SCRIPT_LIMIT,
    );
}

/// A model whose template and type show no call format (Bamba's fixture):
/// tools are a 400 that says to name one; named with `--tool-call-parser`
/// (the config's `tool_call_parser`), a forced call comes back parsed.
#[test]
fn tool_call_parser_names_a_format_the_model_does_not_show() {
    let bamba = fixture().join("../bamba");
    // Closed, so that a random model's call ends well inside max_tokens.
    let mut tool = weather_tool();
    tool["function"]["parameters"]["additionalProperties"] = json!(false);
    let body = json!({"messages": ask(), "tools": [tool], "tool_choice": "required",
        "parallel_tool_calls": false, "max_tokens": 200, "seed": 1});
    let server = |config| start_app(&bamba, &load_options(), config, metrale_server::router);
    let plain = server(ServerConfig::default());
    let e = post(plain.addr, "/v1/chat/completions", &body).error(400);
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("--tool-call-parser"),
        "{e}"
    );
    let hermes = server(ServerConfig {
        tool_call_parser: Some(metrale::engine::chat::tools::ToolCallFormat::Hermes),
        ..ServerConfig::default()
    });
    let reply = chat(&hermes, body);
    let calls = reply["choices"][0]["message"]["tool_calls"]
        .as_array()
        .unwrap_or_else(|| panic!("{reply}"));
    assert_eq!(calls.len(), 1, "{reply}");
    assert_eq!(calls[0]["function"]["name"], "get_weather", "{reply}");
    assert_eq!(
        reply["choices"][0]["finish_reason"], "tool_calls",
        "{reply}"
    );
}
