//! An in-process server on 127.0.0.1:0 over the llama fixture, and a small
//! blocking HTTP/1.1 client on std's TcpStream (no client crate needed).

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use metrale::engine::model::ModelOptions;
use metrale::{Device, EngineConfig, Generator, LoadOptions};
use metrale_server::{AppState, ConnConfig, ServerConfig};
use serde_json::Value;

pub fn fixture() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/llama"
    ))
}

pub fn load_options() -> LoadOptions {
    LoadOptions {
        device: Device::Cpu,
        threads: 1,
        model: ModelOptions {
            kv_block_size: 16,
            kv_blocks: 128,
            max_seqs: 8,
            max_batch_tokens: 256,
            kv_dtype: None,
            kv_follows_weights: false,
            ssm_state_dtype: None,
            ssm_state_follows_weights: false,
            cuda_graphs: true,
            prefix_cache: Default::default(),
        },
        ..LoadOptions::default()
    }
}

pub fn generator() -> Generator {
    Generator::load(
        &fixture(),
        &load_options(),
        EngineConfig::default(),
        &mut |_| {},
    )
    .expect("loading the llama fixture")
}

/// A server running on its own runtime; dropped, it stops.
pub struct TestServer {
    pub addr: SocketAddr,
    pub state: Arc<AppState>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(Duration::from_secs(5));
        }
    }
}

pub fn start(config: ServerConfig) -> TestServer {
    start_until(config, std::future::pending())
}

/// A server on `fixture` whose app `app` makes from the shared state.
pub fn start_app(
    fixture: &std::path::Path,
    options: &LoadOptions,
    config: ServerConfig,
    app: impl FnOnce(Arc<AppState>) -> axum::Router,
) -> TestServer {
    let generator = Generator::load(fixture, options, EngineConfig::default(), &mut |_| {})
        .unwrap_or_else(|e| panic!("loading {}: {e:#}", fixture.display()));
    let state = Arc::new(AppState::new(generator, config).expect("starting the engine"));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let app = app(state.clone());
    runtime.spawn(metrale_server::serve(
        listener,
        app,
        ConnConfig::default(),
        std::future::pending(),
        std::future::pending(),
    ));
    TestServer {
        addr,
        state,
        runtime: Some(runtime),
    }
}

/// A server that shuts down gracefully when `shutdown` completes.
pub fn start_until(
    config: ServerConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> TestServer {
    start_full(
        config,
        ConnConfig::default(),
        shutdown,
        std::future::pending(),
    )
}

/// A server on the llama fixture with connection settings `conn`, that
/// shuts down when `shutdown` completes and closes what is left when
/// `force` does.
pub fn start_full(
    config: ServerConfig,
    conn: ConnConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    force: impl std::future::Future<Output = ()> + Send + 'static,
) -> TestServer {
    let state = Arc::new(AppState::new(generator(), config).expect("starting the engine"));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let app = metrale_server::router(state.clone());
    runtime.spawn(metrale_server::serve(listener, app, conn, shutdown, force));
    TestServer {
        addr,
        state,
        runtime: Some(runtime),
    }
}

pub fn served() -> TestServer {
    start(ServerConfig::default())
}

#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The `data:` payloads of an SSE body.
    pub fn sse_data(&self) -> Vec<String> {
        self.body
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .map(str::to_owned)
            .collect()
    }

    /// Asserts an OpenAI-shaped error with `status`; returns its `error`.
    pub fn error(&self, status: u16) -> Value {
        assert_eq!(self.status, status, "{}", self.body);
        let v = self.json();
        let e = v["error"].clone();
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(e["type"].is_string(), "{v}");
        assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
        e
    }
}

fn head(method: &str, path: &str, headers: &[(&str, &str)], len: Option<usize>) -> String {
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(n) = len {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {n}\r\n"
        ));
    }
    req.push_str("\r\n");
    req
}

pub fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Response {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    s.write_all(head(method, path, headers, body.map(<[u8]>::len)).as_bytes())
        .unwrap();
    if let Some(b) = body {
        s.write_all(b).unwrap();
    }
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    parse(&raw)
}

pub fn parse(raw: &[u8]) -> Response {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("no end of headers");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    if chunked {
        body = dechunk(&body);
    }
    Response {
        status,
        headers,
        body: String::from_utf8(body).expect("a UTF-8 body"),
    }
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = data.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size =
            usize::from_str_radix(std::str::from_utf8(&data[..eol]).unwrap().trim(), 16).unwrap();
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&data[eol + 2..eol + 2 + size]);
        data = &data[eol + 2 + size + 2..];
    }
}

pub fn post(addr: SocketAddr, path: &str, body: &Value) -> Response {
    send(addr, "POST", path, &[], Some(body.to_string().as_bytes()))
}

pub fn get(addr: SocketAddr, path: &str) -> Response {
    send(addr, "GET", path, &[], None)
}

/// Opens a streamed request and returns the socket after the response's
/// first `events` SSE events have arrived (the caller drops it to leave).
pub fn open_stream(addr: SocketAddr, path: &str, body: &Value, events: usize) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body = body.to_string();
    s.write_all(head("POST", path, &[], Some(body.len())).as_bytes())
        .unwrap();
    s.write_all(body.as_bytes()).unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while seen.windows(6).filter(|w| w == b"data: ").count() < events {
        let n = s.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "the stream ended early: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    s
}

/// A metric's value from the Prometheus text (the first line starting with `series`).
pub fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|r| r.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {series} in\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

/// The address a `metrale-serve` child prints on stderr, and the lines it
/// printed up to it.
pub fn server_address(child: &mut std::process::Child) -> (SocketAddr, String) {
    use std::io::BufRead;
    let stderr = child.stderr.take().unwrap();
    let mut seen = String::new();
    for line in std::io::BufReader::new(stderr).lines() {
        let line = line.unwrap();
        seen.push_str(&line);
        seen.push('\n');
        if let Some(a) = line.split("http://").nth(1) {
            return (a.trim().parse().unwrap(), seen);
        }
    }
    let _ = child.kill();
    panic!("the server did not start: {seen}");
}
