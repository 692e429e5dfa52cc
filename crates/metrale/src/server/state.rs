//! What every handler shares, and the bridge from the engine thread to
//! async handlers: each request's events arrive on an async channel that
//! the engine thread feeds without waiting (no thread per request).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::engine::chat::ChatTemplate;
use crate::engine::chat::tools::ToolCallFormat;
use crate::engine::engine::EngineGauges;
use crate::engine::tokenizer::Tokenizer;
use crate::{CancelOnDrop, EventSink, Generator, GeneratorHandle, SamplingParams, StreamEvent};
use tokio::sync::mpsc;

use crate::server::admission::{Limits, PromptBudget, PromptBytes};
use crate::server::error::ApiError;
use crate::server::metrics::Metrics;

/// How the server runs.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The id `/v1/models` lists and requests must name (or leave out);
    /// `None`: the model directory's name.
    pub served_model_name: Option<String>,
    /// When set, every `/v1` route wants `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Most requests waiting for their first token; more get 429.
    pub max_waiting: usize,
    /// Largest request body, in bytes; larger gets 413.
    pub body_limit: usize,
    /// How long a request's body may take to arrive; then 408.
    pub body_timeout: Duration,
    /// What one request may cost ([`Limits`]).
    pub limits: Limits,
    /// Which Host headers are answered (403 otherwise).
    pub hosts: HostPolicy,
    /// The syntax the model writes tool calls in (`--tool-call-parser`);
    /// `None`: detected from the chat template and model type.
    pub tool_call_parser: Option<ToolCallFormat>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            served_model_name: None,
            api_key: None,
            max_waiting: 256,
            body_limit: 4 << 20,
            body_timeout: Duration::from_secs(30),
            limits: Limits::default(),
            hosts: HostPolicy::Any,
            tool_call_parser: None,
        }
    }
}

/// Which `Host` headers the server answers. A server bound to a loopback
/// address answers loopback names only: a web page the user visits could
/// otherwise reach it through a DNS name that resolves to 127.0.0.1 (DNS
/// rebinding).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostPolicy {
    /// Any host (a server bound to a routable address, by default).
    Any,
    /// `localhost`, `*.localhost`, `127.0.0.0/8` and `[::1]`, any port.
    Loopback,
    /// These names (`--allowed-hosts`, any port; a `*` among them: any).
    Named(Vec<String>),
}

impl HostPolicy {
    /// The policy for a server bound to `bind` with `--allowed-hosts`
    /// `allowed` (a comma-separated list, or absent).
    pub fn new(bind: std::net::IpAddr, allowed: Option<&str>) -> Self {
        match allowed {
            Some(list) => {
                let names: Vec<String> = list
                    .split(',')
                    .map(|h| h.trim().to_ascii_lowercase())
                    .filter(|h| !h.is_empty())
                    .collect();
                if names.iter().any(|h| h == "*") {
                    Self::Any
                } else {
                    Self::Named(names)
                }
            }
            None if bind.is_loopback() => Self::Loopback,
            None => Self::Any,
        }
    }

    /// Whether a request whose Host header is `host` (None: absent) is
    /// answered.
    pub fn allows(&self, host: Option<&str>) -> bool {
        let name = host.map(host_name);
        match (self, name) {
            (Self::Any, _) => true,
            (_, None) => false,
            (Self::Loopback, Some(name)) => is_loopback_name(&name),
            (Self::Named(names), Some(name)) => names.contains(&name),
        }
    }
}

/// A Host header's name without its port, lower-cased (`[::1]:80` ->
/// `[::1]`).
fn host_name(host: &str) -> String {
    let host = host.trim();
    let name = if host.starts_with('[') {
        host.split_inclusive(']').next().unwrap_or(host)
    } else {
        host.rsplit_once(':').map_or(host, |(name, _)| name)
    };
    name.trim_end_matches('.').to_ascii_lowercase()
}

fn is_loopback_name(name: &str) -> bool {
    if name == "localhost" || name.ends_with(".localhost") {
        return true;
    }
    let bare = name.trim_start_matches('[').trim_end_matches(']');
    bare.parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback())
}

/// The shared state of the handlers.
pub struct AppState {
    pub handle: GeneratorHandle,
    pub model_name: String,
    pub model_dir: PathBuf,
    /// The model's chat template, or why it has none (then chat gets 400).
    pub template: Result<ChatTemplate, String>,
    /// The syntax the model writes tool calls in, if known (a request with
    /// tools gets 400 otherwise).
    pub tool_format: Option<ToolCallFormat>,
    /// Longest prompt plus output.
    pub context_limit: usize,
    pub config: ServerConfig,
    pub metrics: Arc<Metrics>,
    /// The engine's own counts: requests running and waiting for memory,
    /// KV blocks and SSM slots in use.
    pub gauges: EngineGauges,
    /// The prompt bytes of requests not yet generating
    /// (`--max-queued-prompt-bytes`).
    pub prompt_budget: Arc<PromptBudget>,
    pub created: u64,
}

impl AppState {
    /// Moves `generator` to its engine thread (continuous batching: every
    /// request in flight shares its steps).
    pub fn new(generator: Generator, config: ServerConfig) -> anyhow::Result<Self> {
        let model_dir = generator.dir().to_path_buf();
        let model_name = config.served_model_name.clone().unwrap_or_else(|| {
            model_dir
                .canonicalize()
                .unwrap_or_else(|_| model_dir.clone())
                .file_name()
                .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned())
        });
        let template = generator.chat_template().map_err(|e| format!("{e:#}"));
        let model_type = generator.engine().model().config().model_type.as_str();
        let tool_format = config.tool_call_parser.or_else(|| {
            ToolCallFormat::detect(model_type, template.as_ref().ok().map(|t| t.source()))
        });
        let context_limit = generator.engine().context_limit();
        let gauges = generator.engine().gauges();
        let handle = generator.spawn()?;
        handle.warm_structured_outputs();
        Ok(Self {
            handle,
            model_name,
            model_dir,
            template,
            tool_format,
            context_limit,
            metrics: Arc::new(Metrics::default()),
            gauges,
            prompt_budget: PromptBudget::new(config.limits.max_queued_prompt_bytes),
            config,
            created: unix_now(),
        })
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        self.handle.tokenizer()
    }

    /// 404 unless `model` is absent or the served model's id.
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.model_name => Err(ApiError::ModelNotFound(m.to_owned())),
            _ => Ok(()),
        }
    }

    /// Submits `n` requests for each of `prompts` (seeds `seed`, `seed +
    /// 1`, ... when a seed is given) and returns one channel of events
    /// carrying each choice's index. Nothing waits for the engine and no
    /// thread is held: the engine thread hands each event to the channel.
    /// Every choice takes its place among the waiting requests before any
    /// is submitted (429 when they do not all fit). `prompt_bytes` is held
    /// until every choice has its first token or has ended. Dropping the
    /// [`Submitted`] cancels every request still running, freeing its KV
    /// blocks and SSM slot at the engine's next step.
    /// [`submit`](Self::submit), on a blocking thread where the request
    /// has a structured-output constraint: compiling a large schema, regex
    /// or choice list can take a second, which must not hold an async
    /// worker (every other connection's).
    pub async fn submit_off(
        self: &Arc<Self>,
        prompts: Vec<Vec<u32>>,
        params: SamplingParams,
        n: usize,
        prompt_bytes: PromptBytes,
    ) -> Result<Submitted, ApiError> {
        if params.constraint.is_none() {
            return self.submit(prompts, &params, n, prompt_bytes);
        }
        let state = self.clone();
        off_the_workers(move || state.submit(prompts, &params, n, prompt_bytes)).await
    }

    pub fn submit(
        &self,
        prompts: Vec<Vec<u32>>,
        params: &SamplingParams,
        n: usize,
        prompt_bytes: PromptBytes,
    ) -> Result<Submitted, ApiError> {
        let total = prompts.len().saturating_mul(n);
        let mut places = Places::reserve(&self.metrics, total, self.config.max_waiting)
            .ok_or(ApiError::TooManyRequests(self.config.max_waiting))?;
        let prompt_bytes = Arc::new(prompt_bytes);
        let (tx, rx) = mpsc::unbounded_channel();
        let backlog = Arc::new(Backlog::default());
        let mut cancels = Vec::with_capacity(total);
        for prompt in prompts {
            for i in 0..n {
                let mut params = params.clone();
                params.seed = params.seed.map(|s| s.wrapping_add(i as u64));
                let mut tracked = places.take(prompt_bytes.clone());
                let index = cancels.len();
                let tx = tx.clone();
                let backlog = backlog.clone();
                let sink: EventSink = Box::new(move |event| {
                    tracked.observe(&event);
                    backlog.send(&tx, index, event)
                });
                let cancel = self
                    .handle
                    .submit_to(prompt.clone(), params, sink)
                    .map_err(ApiError::from_submit)?;
                cancels.push(cancel);
            }
        }
        Ok(Submitted {
            rx,
            backlog,
            cancels,
        })
    }
}

type Event = (usize, anyhow::Result<StreamEvent>);

/// Most events of one request sent and not yet taken by its handler: a
/// client that reads this far behind (its socket and the server's write
/// buffer full) has stopped reading, and its request is cancelled rather
/// than computed for nobody until the write timeout closes the connection.
pub const MAX_BACKLOG: usize = 4096;

/// The events of a request's choices, `(choice index, event)`; dropping it
/// cancels the choices still running.
pub struct Submitted {
    rx: mpsc::UnboundedReceiver<Event>,
    backlog: Arc<Backlog>,
    pub cancels: Vec<CancelOnDrop>,
}

impl Submitted {
    /// The next event of any choice; `None` once the engine has dropped
    /// every choice without ending it (it stopped, or the request was
    /// abandoned).
    pub async fn recv(&mut self) -> Option<Event> {
        let event = self.rx.recv().await?;
        self.backlog.sent.fetch_sub(1, Ordering::SeqCst);
        Some(event)
    }
}

/// The events of one request in its channel, counted by the engine
/// thread's sinks and its handler.
#[derive(Default)]
struct Backlog {
    /// Sent and not taken.
    sent: AtomicUsize,
    /// Past [`MAX_BACKLOG`]: every choice is cancelled.
    abandoned: AtomicBool,
}

impl Backlog {
    /// Sends `event` unless the request has been abandoned; abandons it
    /// (one last error event, then every choice's sink says stop) when its
    /// handler has fallen [`MAX_BACKLOG`] events behind.
    fn send(
        &self,
        tx: &mpsc::UnboundedSender<Event>,
        index: usize,
        event: anyhow::Result<StreamEvent>,
    ) -> bool {
        if self.abandoned.load(Ordering::SeqCst) {
            return false;
        }
        if self.sent.fetch_add(1, Ordering::SeqCst) >= MAX_BACKLOG {
            self.abandoned.store(true, Ordering::SeqCst);
            let message = format!(
                "the client fell {MAX_BACKLOG} events behind its stream and stopped reading; \
                 the request was cancelled"
            );
            tracing::info!("{message}");
            let _ = tx.send((index, Err(anyhow::anyhow!(message))));
            return false;
        }
        tx.send((index, event)).is_ok()
    }
}

/// Places among the waiting requests, reserved together; those not taken
/// are given back when dropped.
struct Places {
    metrics: Arc<Metrics>,
    left: usize,
}

impl Places {
    fn reserve(metrics: &Arc<Metrics>, count: usize, limit: usize) -> Option<Self> {
        metrics.try_wait_many(count, limit).then(|| Self {
            metrics: metrics.clone(),
            left: count,
        })
    }

    fn take(&mut self, prompt_bytes: Arc<PromptBytes>) -> Tracked {
        self.left -= 1;
        Tracked {
            metrics: self.metrics.clone(),
            submitted: Instant::now(),
            last_token: None,
            ended: false,
            prompt_bytes: Some(prompt_bytes),
        }
    }
}

impl Drop for Places {
    fn drop(&mut self) {
        self.metrics.unwait(self.left);
    }
}

/// One choice's place in the metrics: waiting until its first token,
/// running until its end; counted out exactly once, when its last event
/// goes out or, cancelled or refused, when it is dropped.
struct Tracked {
    metrics: Arc<Metrics>,
    submitted: Instant,
    last_token: Option<Instant>,
    ended: bool,
    /// The request's prompt bytes, held until this choice's first token.
    prompt_bytes: Option<Arc<PromptBytes>>,
}

impl Tracked {
    fn observe(&mut self, event: &anyhow::Result<StreamEvent>) {
        match event {
            Ok(StreamEvent::Token { .. }) => {
                let now = Instant::now();
                match self.last_token {
                    None => {
                        self.metrics.started();
                        self.metrics.time_to_first_token(now - self.submitted);
                        self.prompt_bytes = None;
                    }
                    Some(t) => self.metrics.inter_token_latency(now - t),
                }
                self.last_token = Some(now);
                self.metrics.generated_token();
            }
            Ok(StreamEvent::PromptLogprobs { .. }) => {}
            Ok(StreamEvent::Finished { usage, .. }) => {
                self.metrics.prompt_tokens(usage.prompt_tokens);
                // Before the last event goes out: whoever reads it sees the
                // request counted out.
                self.end();
            }
            Err(_) => self.end(),
        }
    }

    fn end(&mut self) {
        if !self.ended {
            self.ended = true;
            self.prompt_bytes = None;
            self.metrics.ended(self.last_token.is_some());
        }
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.end();
    }
}

/// Runs `work` (tokenizing, rendering a template: CPU work proportional to
/// the request) on the runtime's bounded blocking pool, off the async
/// workers that answer every connection.
pub async fn off_the_workers<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ApiError::Internal(format!("a tokenizing task failed: {e}")))?
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loopback_server_answers_loopback_hosts_only() {
        let policy = HostPolicy::new("127.0.0.1".parse().unwrap(), None);
        assert_eq!(policy, HostPolicy::Loopback);
        for host in [
            "localhost",
            "localhost:8000",
            "127.0.0.1:8000",
            "127.1.2.3",
            "[::1]:80",
            "a.localhost",
        ] {
            assert!(policy.allows(Some(host)), "{host}");
        }
        for host in [
            "evil.example",
            "evil.example:8000",
            "localhost.evil.example",
            "10.0.0.1",
        ] {
            assert!(!policy.allows(Some(host)), "{host}");
        }
        assert!(!policy.allows(None));
        let open = HostPolicy::new("0.0.0.0".parse().unwrap(), None);
        assert!(open.allows(Some("evil.example")) && open.allows(None));
        let named = HostPolicy::new(
            "127.0.0.1".parse().unwrap(),
            Some("api.example, Other.Example"),
        );
        assert!(named.allows(Some("API.example:443")) && named.allows(Some("other.example")));
        assert!(!named.allows(Some("localhost")));
        assert_eq!(
            HostPolicy::new("127.0.0.1".parse().unwrap(), Some("*")),
            HostPolicy::Any
        );
    }
}
