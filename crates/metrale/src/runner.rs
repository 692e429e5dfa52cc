//! A [`Generator`] on a thread of its own, for callers that submit requests
//! concurrently (a server): each request's events arrive over its own
//! channel while the thread runs the engine loop, batching every request in
//! flight. Dropping a request's stream (or its receiver) cancels it.
//!
//! Submitting and cancelling never wait for the engine thread, which reads
//! its commands only between steps: a request is checked, numbered and set
//! up on the caller's thread by the engine's [`Intake`] (everything it
//! checks is fixed when the engine is made) and sent; the engine thread
//! queues it at its next step boundary, and a cancel frees the request's KV
//! blocks and SSM slot there too.
//!
//! Events leave the engine thread through an [`EventSink`] that must never
//! block: a [`RequestStream`]'s is an unbounded channel; an async server
//! gives its own (an async channel's `send`), so no thread of its waits on
//! a request.

use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Result, anyhow};
use metrale_model_engine::engine::{Intake, NewRequest, RequestId};
use metrale_model_engine::sampling::{GenerationDefaults, SamplingParams};
use metrale_model_engine::tokenizer::Tokenizer;

use crate::Generator;
use crate::generate::{StreamEvent, Tracker};

enum Command {
    Submit {
        /// Boxed: a request (sampler, detokenizer) is large beside a cancel.
        request: Box<NewRequest>,
        tracker: Tracker,
        sink: EventSink,
    },
    Cancel(RequestId),
    Shutdown,
}

/// Where one request's events go. Called on the engine thread, in order,
/// ending with `Finished` or an error; it must return at once (never wait
/// on a reader). `false` says nobody listens any more: the request is then
/// cancelled and the sink dropped. It is dropped too when the request ends,
/// is cancelled, or the engine thread stops.
pub type EventSink = Box<dyn FnMut(Result<StreamEvent>) -> bool + Send>;

/// Cancels its request when dropped, unless [`disarm`](Self::disarm)ed:
/// what [`GeneratorHandle::submit_to`] returns.
pub struct CancelOnDrop {
    id: RequestId,
    commands: Sender<Command>,
    armed: bool,
}

impl CancelOnDrop {
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Dropping no longer cancels (the request has ended).
    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.commands.send(Command::Cancel(self.id));
        }
    }
}

/// The handle of a generator running on its own thread. Cloning the handle
/// is not offered; share it behind an `Arc` (it is `Sync`).
pub struct GeneratorHandle {
    commands: Sender<Command>,
    intake: Intake,
    tokenizer: Tokenizer,
    defaults: GenerationDefaults,
    thread: Option<JoinHandle<Result<()>>>,
}

/// One request's events, in order, ending after `Finished` or an error.
/// Dropping it cancels the request if it is still running: without waiting;
/// the engine thread frees its memory at its next step boundary.
pub struct RequestStream {
    cancel: CancelOnDrop,
    events: Receiver<Result<StreamEvent>>,
    done: bool,
}

impl Generator {
    /// Moves the generator to a thread that runs the engine loop.
    pub fn spawn(self) -> Result<GeneratorHandle> {
        let tokenizer = self.tokenizer().clone();
        let defaults = self.defaults().clone();
        let intake = self.engine.intake();
        let (commands, inbox) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("metrale-engine".into())
            .spawn(move || serve(self, inbox))?;
        Ok(GeneratorHandle {
            commands,
            intake,
            tokenizer,
            defaults,
            thread: Some(thread),
        })
    }
}

impl GeneratorHandle {
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Builds the structured-output compiler for the tokenizer on a thread
    /// of its own now, so the first request with a schema does not wait
    /// for it (its token trie takes a while on a large vocabulary).
    pub fn warm_structured_outputs(&self) {
        let intake = self.intake.clone();
        let spawned = std::thread::Builder::new()
            .name("metrale-grammar-warmup".into())
            .spawn(move || {
                let began = std::time::Instant::now();
                match intake.grammars() {
                    Ok(_) => tracing::debug!("structured outputs ready in {:.0?}", began.elapsed()),
                    Err(e) => tracing::info!("structured outputs are unavailable: {e}"),
                }
            });
        if let Err(e) = spawned {
            tracing::debug!(
                "no thread to prepare structured outputs ({e}); the first request will"
            );
        }
    }

    /// The checkpoint's sampling defaults ([`Generator::defaults`]).
    pub fn defaults(&self) -> &GenerationDefaults {
        &self.defaults
    }

    /// Submits a text prompt (encoded with the tokenizer's special tokens,
    /// on the calling thread). See [`submit_ids`](Self::submit_ids).
    pub fn submit(&self, prompt: &str, params: SamplingParams) -> Result<RequestStream> {
        self.submit_ids(self.tokenizer.encode(prompt, true)?, params)
    }

    /// Submits prompt token ids. Returns without waiting for the engine
    /// thread (not even for the step it is running): the request is checked
    /// and set up here by the engine's [`Intake`]. Fails when the request is
    /// invalid (an empty prompt, an id outside the vocabulary, a parameter
    /// out of range) or can never fit, or when the engine thread has
    /// stopped; whatever the engine thread itself fails the request with
    /// arrives as an error on the stream.
    pub fn submit_ids(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<RequestStream> {
        let (events_tx, events) = mpsc::channel();
        let sink: EventSink = Box::new(move |event| events_tx.send(event).is_ok());
        Ok(RequestStream {
            cancel: self.submit_to(prompt, params, sink)?,
            events,
            done: false,
        })
    }

    /// Submits prompt token ids whose events go to `sink` (see
    /// [`EventSink`]); checked as [`submit_ids`](Self::submit_ids) checks.
    /// Dropping the returned guard cancels the request (a no-op once it
    /// has ended). A request refused here never calls `sink`.
    pub fn submit_to(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        sink: EventSink,
    ) -> Result<CancelOnDrop> {
        let tracker = Tracker::new(prompt.len());
        let request = self.intake.prepare(prompt, params)?;
        let id = request.id();
        self.commands
            .send(Command::Submit {
                request: Box::new(request),
                tracker,
                sink,
            })
            .map_err(|_| anyhow!("the engine thread has stopped"))?;
        Ok(CancelOnDrop {
            id,
            commands: self.commands.clone(),
            armed: true,
        })
    }

    /// Stops the thread (cancelling what is left) and tears the model down.
    pub fn shutdown(mut self) -> Result<()> {
        let _ = self.commands.send(Command::Shutdown);
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(result)) => result,
            Some(Err(_)) => Err(anyhow!("the engine thread panicked")),
            None => Ok(()),
        }
    }
}

impl Drop for GeneratorHandle {
    fn drop(&mut self) {
        if let Some(thread) = self.thread.take() {
            let _ = self.commands.send(Command::Shutdown);
            match thread.join() {
                Ok(Err(e)) => tracing::error!("engine thread teardown failed: {e:#}"),
                Err(_) => tracing::error!("the engine thread panicked"),
                Ok(Ok(())) => {}
            }
        }
    }
}

impl RequestStream {
    /// The request's id (its engine's, from [`Intake::prepare`]).
    pub fn id(&self) -> RequestId {
        self.cancel.id()
    }

    /// The next event, waiting at most `timeout`; `None` on timeout or at
    /// the end of the stream.
    pub fn next_timeout(&mut self, timeout: Duration) -> Option<Result<StreamEvent>> {
        if self.done {
            return None;
        }
        match self.events.recv_timeout(timeout) {
            Ok(event) => Some(self.note(event)),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => {
                Some(self.note(Err(anyhow!("the engine thread has stopped"))))
            }
        }
    }

    fn note(&mut self, event: Result<StreamEvent>) -> Result<StreamEvent> {
        if !matches!(event, Ok(StreamEvent::Token { .. })) {
            self.done = true;
            self.cancel.disarm();
        }
        event
    }
}

impl Iterator for RequestStream {
    type Item = Result<StreamEvent>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let event = self
            .events
            .recv()
            .unwrap_or_else(|_| Err(anyhow!("the engine thread has stopped")));
        Some(self.note(event))
    }
}

/// A request in flight on the engine thread.
struct Client {
    sink: EventSink,
    tracker: Tracker,
}

/// The engine thread: takes commands (waiting for one when idle), steps,
/// routes events; a request whose receiver is gone is cancelled.
fn serve(mut generator: Generator, inbox: Receiver<Command>) -> Result<()> {
    let mut clients: HashMap<RequestId, Client> = HashMap::new();
    'run: loop {
        let mut next = if clients.is_empty() {
            match inbox.recv() {
                Ok(command) => Some(command),
                Err(_) => break,
            }
        } else {
            take(&inbox)
        };
        while let Some(command) = next {
            match command {
                Command::Shutdown => break 'run,
                Command::Cancel(id) => {
                    generator.engine.cancel(id);
                    clients.remove(&id);
                }
                Command::Submit {
                    request,
                    tracker,
                    mut sink,
                } => {
                    let id = request.id();
                    match generator.engine.enqueue(*request) {
                        Ok(id) => {
                            clients.insert(id, Client { sink, tracker });
                        }
                        Err(e) => {
                            sink(Err(anyhow!("{id}: {e}")));
                        }
                    }
                }
            }
            next = take(&inbox);
        }
        step(&mut generator, &mut clients);
    }
    generator.shutdown()
}

/// The next command without waiting; a closed inbox means shutdown.
fn take(inbox: &Receiver<Command>) -> Option<Command> {
    match inbox.try_recv() {
        Ok(command) => Some(command),
        Err(TryRecvError::Empty) => None,
        Err(TryRecvError::Disconnected) => Some(Command::Shutdown),
    }
}

/// One engine step; events go to their clients.
fn step(generator: &mut Generator, clients: &mut HashMap<RequestId, Client>) {
    let events = match generator.engine.step() {
        Ok(events) => events,
        Err(e) => {
            let message = format!("{e:#}");
            for (id, mut client) in clients.drain() {
                generator.engine.cancel(id);
                (client.sink)(Err(anyhow!("{message}")));
            }
            return;
        }
    };
    for event in events {
        let id = event.id();
        let Some(client) = clients.get_mut(&id) else {
            continue;
        };
        let event = client.tracker.observe(event);
        let last = !matches!(
            event,
            Ok(StreamEvent::Token { .. } | StreamEvent::PromptLogprobs { .. })
        );
        if !(client.sink)(event) && !last {
            generator.engine.cancel(id);
            clients.remove(&id);
        } else if last {
            clients.remove(&id);
        }
    }
}
