//! Connections: accepted within a limit, served over HTTP/1.1 with
//! timeouts, closed in order at shutdown with a deadline.
//!
//! What a client can hold, and for how long ([`ConnConfig`]):
//! - a descriptor: at most `max_connections` connections are served at
//!   once; one more is answered 503 and closed at once;
//! - a connection without a request: `header_timeout`, counted from the
//!   connection's opening or the end of its previous response (so it is
//!   also the idle keep-alive timeout), bounds the wait for a request's
//!   whole header;
//! - a response it does not read: a write that makes no progress for
//!   `write_timeout` closes the connection, which cancels its requests
//!   and frees their KV blocks and SSM slots (the engine never waits on a
//!   client: its events queue on the request's channel, bounded by
//!   admission);
//! - shutdown: after the signal no connection is accepted, idle ones close,
//!   and requests in flight may finish for `shutdown_timeout`; then every
//!   connection left is closed. A second signal closes them at once.
//!
//! The request body's own timeout is the router's
//! ([`ServerConfig::body_timeout`](crate::server::ServerConfig::body_timeout)).

use std::future::Future;
use std::io;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::Sleep;
use tower_service::Service;

/// How connections are held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnConfig {
    /// Most connections served at once (`--max-connections`).
    pub max_connections: usize,
    /// Most time for a request's header to arrive, from the connection's
    /// opening or its previous response (`--header-timeout`).
    pub header_timeout: Duration,
    /// Most time a response's write may stall (`--write-timeout`).
    pub write_timeout: Duration,
    /// Most time requests in flight get to finish after the shutdown
    /// signal (`--shutdown-timeout`).
    pub shutdown_timeout: Duration,
}

impl Default for ConnConfig {
    fn default() -> Self {
        Self {
            max_connections: default_max_connections(),
            header_timeout: Duration::from_secs(15),
            write_timeout: Duration::from_secs(30),
            shutdown_timeout: Duration::from_secs(30),
        }
    }
}

/// Descriptors kept free of connections: the model's files, the
/// listener, the runtime's own.
const SPARE_DESCRIPTORS: u64 = 64;

/// The default `max_connections`: 4096, or fewer when the process's
/// descriptor limit (its soft `RLIMIT_NOFILE`) leaves less beside
/// [`SPARE_DESCRIPTORS`].
pub fn default_max_connections() -> usize {
    let soft = descriptor_limit().unwrap_or(1024);
    soft.saturating_sub(SPARE_DESCRIPTORS).clamp(16, 4096) as usize
}

/// Raises the process's soft descriptor limit to its hard limit (at most
/// 65536), as servers do: a soft limit of 1024 is a shell's default, not
/// the system's. Returns the soft limit in force.
#[cfg(unix)]
pub fn raise_descriptor_limit() -> Option<u64> {
    let mut limit = rlimit_nofile()?;
    let wanted = limit.rlim_max.min(65536);
    if limit.rlim_cur < wanted {
        let raised = libc::rlimit {
            rlim_cur: wanted,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: setrlimit reads one `rlimit` through a pointer to a
        // live, properly aligned local; it keeps no reference to it.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit = raised;
        }
    }
    Some(limit.rlim_cur as u64)
}

#[cfg(not(unix))]
pub fn raise_descriptor_limit() -> Option<u64> {
    None
}

#[cfg(unix)]
fn rlimit_nofile() -> Option<libc::rlimit> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` through a pointer to a live,
    // properly aligned local; it keeps no reference to it.
    let status = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    (status == 0).then_some(limit)
}

#[cfg(unix)]
fn descriptor_limit() -> Option<u64> {
    rlimit_nofile().map(|l| l.rlim_cur as u64)
}

#[cfg(not(unix))]
fn descriptor_limit() -> Option<u64> {
    None
}

/// Serves `app` on `listener` until `shutdown` completes; then stops
/// accepting, lets the requests in flight finish (streams included) for
/// `config.shutdown_timeout` or until `force` completes, and closes every
/// connection left.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    config: ConnConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
    force: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let slots = Arc::new(Semaphore::new(config.max_connections));
    let (closing, closed) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut shutdown = pin!(shutdown);
    let mut last_warning: Option<Instant> = None;
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => match slots.clone().try_acquire_owned() {
                    Ok(permit) => {
                        let conn = connection(stream, app.clone(), config, closed.clone(), permit);
                        connections.spawn(conn);
                    }
                    Err(_) => refuse(&stream),
                },
                Err(e) => accept_failed(&e, &mut last_warning).await,
            },
        }
    }
    drop(listener);
    let _ = closing.send(true);
    let drain = async { while connections.join_next().await.is_some() {} };
    let deadline = tokio::time::sleep(config.shutdown_timeout);
    tokio::select! {
        _ = drain => return Ok(()),
        _ = deadline => tracing::warn!(
            "{} connections still open {:?} after the shutdown signal (--shutdown-timeout); \
             closing them",
            connections.len(),
            config.shutdown_timeout
        ),
        _ = force => tracing::warn!(
            "a second shutdown signal: closing {} connections now",
            connections.len()
        ),
    }
    connections.shutdown().await;
    Ok(())
}

/// One connection, until it closes or the server closes it.
async fn connection(
    stream: TcpStream,
    app: Router,
    config: ConnConfig,
    mut closed: watch::Receiver<bool>,
    _slot: OwnedSemaphorePermit,
) {
    let _ = stream.set_nodelay(true);
    let io = TokioIo::new(WriteDeadline::new(stream, config.write_timeout));
    let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
        app.clone().call(request)
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(config.header_timeout);
    let mut conn = pin!(builder.serve_connection(io, service));
    tokio::select! {
        result = conn.as_mut() => {
            if let Err(e) = result {
                tracing::debug!("connection closed: {e}");
            }
            return;
        }
        _ = closed.wait_for(|closed| *closed) => conn.as_mut().graceful_shutdown(),
    }
    if let Err(e) = conn.await {
        tracing::debug!("connection closed at shutdown: {e}");
    }
}

/// Answers a connection past `max_connections` with a 503 and closes it,
/// without waiting: a fresh socket's send buffer takes the whole answer.
fn refuse(stream: &TcpStream) {
    const BODY: &str = "{\"error\":{\"message\":\"the server has as many connections open as its \
        --max-connections allows; retry later\",\"type\":\"server_error\",\"param\":null,\
        \"code\":\"too_many_connections\"}}";
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{BODY}",
        BODY.len()
    );
    let _ = stream.try_write(answer.as_bytes());
}

/// An accept that failed: out of descriptors or memory, the listener
/// waits a moment (retrying at once would spin); a connection that went
/// away before it was accepted is nothing. Warns at most once a second.
async fn accept_failed(e: &io::Error, last_warning: &mut Option<Instant>) {
    let transient = matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
    );
    if transient {
        return;
    }
    if last_warning.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
        tracing::warn!("accepting a connection: {e}");
        *last_warning = Some(Instant::now());
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// A stream whose writes fail with `TimedOut` once one has made no
/// progress for `timeout` (a client that stopped reading).
struct WriteDeadline<S> {
    inner: S,
    timeout: Duration,
    /// Armed while a write is pending.
    stall: Option<Pin<Box<Sleep>>>,
}

impl<S> WriteDeadline<S> {
    fn new(inner: S, timeout: Duration) -> Self {
        Self {
            inner,
            timeout,
            stall: None,
        }
    }

    /// After the inner write answered `poll`: disarms on progress; on
    /// `Pending`, arms the deadline (once) and fails when it has passed.
    fn watch<T>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if poll.is_ready() {
            self.stall = None;
            return poll;
        }
        let timeout = self.timeout;
        let stall = self
            .stall
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match stall.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client read nothing for {timeout:?} (--write-timeout)"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteDeadline<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.watch(cx, poll)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.watch(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_flush(cx);
        this.watch(cx, poll)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_shutdown(cx);
        this.watch(cx, poll)
    }
}
