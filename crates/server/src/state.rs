//! What every handler shares, and the bridge from the engine's blocking
//! request streams to async handlers.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrale::engine::chat::ChatTemplate;
use metrale::engine::engine::EngineGauges;
use metrale::engine::tokenizer::Tokenizer;
use metrale::{Generator, GeneratorHandle, SamplingParams, StreamEvent};
use tokio::sync::mpsc;

use crate::error::ApiError;
use crate::metrics::Metrics;

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
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            served_model_name: None,
            api_key: None,
            max_waiting: 256,
            body_limit: 4 << 20,
        }
    }
}

/// The shared state of the handlers.
pub struct AppState {
    pub handle: GeneratorHandle,
    pub model_name: String,
    pub model_dir: PathBuf,
    /// The model's chat template, or why it has none (then chat gets 400).
    pub template: Result<ChatTemplate, String>,
    /// Longest prompt plus output.
    pub context_limit: usize,
    pub config: ServerConfig,
    pub metrics: Arc<Metrics>,
    /// The engine's own counts: requests running and waiting for memory,
    /// KV blocks and SSM slots in use.
    pub gauges: EngineGauges,
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
        let context_limit = generator.engine().context_limit();
        let gauges = generator.engine().gauges();
        Ok(Self {
            handle: generator.spawn()?,
            model_name,
            model_dir,
            template,
            context_limit,
            config,
            metrics: Arc::new(Metrics::default()),
            gauges,
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

    /// Submits `n` requests for `prompt` (seeds `seed`, `seed + 1`, ...
    /// when a seed is given) and returns one channel of events carrying
    /// each choice's index. Nothing waits for the engine. Dropping the
    /// receiver cancels every request still running (within ~50 ms),
    /// freeing its KV blocks and SSM slot.
    pub fn submit(
        &self,
        prompts: &[Vec<u32>],
        params: &SamplingParams,
        n: usize,
    ) -> Result<mpsc::Receiver<(usize, anyhow::Result<StreamEvent>)>, ApiError> {
        let total = prompts.len() * n;
        let (tx, rx) = mpsc::channel(64 * total.max(1));
        let mut streams = Vec::with_capacity(total);
        for prompt in prompts {
            for i in 0..n {
                if !self.metrics.try_wait(self.config.max_waiting) {
                    for _ in &streams {
                        self.metrics.ended(false);
                    }
                    return Err(ApiError::TooManyRequests(self.config.max_waiting));
                }
                let mut params = params.clone();
                params.seed = params.seed.map(|s| s.wrapping_add(i as u64));
                match self.handle.submit_ids(prompt.clone(), params) {
                    Ok(stream) => streams.push(stream),
                    Err(e) => {
                        for _ in 0..=streams.len() {
                            self.metrics.ended(false);
                        }
                        return Err(ApiError::from_submit(e));
                    }
                }
            }
        }
        for (index, stream) in streams.into_iter().enumerate() {
            let tx = tx.clone();
            let metrics = self.metrics.clone();
            tokio::task::spawn_blocking(move || forward(index, stream, tx, &metrics));
        }
        Ok(rx)
    }
}

/// Forwards one request's events until its end or until the receiver is
/// gone; dropping the stream then cancels the request.
fn forward(
    index: usize,
    mut stream: metrale::RequestStream,
    tx: mpsc::Sender<(usize, anyhow::Result<StreamEvent>)>,
    metrics: &Metrics,
) {
    let submitted = Instant::now();
    let mut last_token: Option<Instant> = None;
    loop {
        if tx.is_closed() {
            break;
        }
        let Some(event) = stream.next_timeout(Duration::from_millis(50)) else {
            continue;
        };
        let end = match &event {
            Ok(StreamEvent::Token { .. }) => {
                let now = Instant::now();
                match last_token {
                    None => {
                        metrics.started();
                        metrics.time_to_first_token(now - submitted);
                    }
                    Some(t) => metrics.inter_token_latency(now - t),
                }
                last_token = Some(now);
                metrics.generated_token();
                false
            }
            Ok(StreamEvent::Finished { usage, .. }) => {
                metrics.prompt_tokens(usage.prompt_tokens);
                true
            }
            Err(_) => true,
        };
        if end {
            // Before the last event goes out: whoever reads it sees the
            // request counted out.
            metrics.ended(last_token.is_some());
            let _ = tx.blocking_send((index, event));
            return;
        }
        if tx.blocking_send((index, event)).is_err() {
            break;
        }
    }
    // The receiver is gone: cancel (the engine frees the request's memory
    // at its next step), then count the request out.
    drop(stream);
    metrics.ended(last_token.is_some());
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
