//! One webhook connection: which protocol it speaks, and how long it may take.
//!
//! Two different clocks apply. A client that has begun a request must send its headers within
//! `header_timeout` (slow clients are cut off); a keep-alive connection with no request under way
//! may stay idle for `keepalive_timeout`, longer than senders' own idle timeouts (Alertmanager,
//! Go's default transport: 90 s), so that agentgate is never the side that closes a connection
//! a sender is about to reuse. hyper has one timer for both, started whenever it waits for a
//! request head; it is set to the idle limit here, and the header limit is enforced by watching
//! the bytes: [`ConnectionClock`] notes when the first byte of a request arrives, and the service
//! notes when the head was complete. HTTP/2 has no such timer: a connection with no stream is
//! closed (GOAWAY) after `header_timeout` if it never opened one, else after
//! `keepalive_timeout`. And when every connection slot is taken, a connection that is idle or
//! stalled (no request under way, a head that does not finish, bodies that stop arriving) is
//! closed for the new one ([`OpenConnections`]), so that any number of addresses holding
//! connections open cannot keep a valid request waiting.

use std::collections::HashMap;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_util::sync::CancellationToken;

/// A connection's byte stream, plain TCP or TLS.
pub(super) trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

/// What a client speaks: HTTP/1.1, or HTTP/2 (prior knowledge in cleartext, ALPN under TLS).
pub(super) enum Protocol {
    Http1,
    Http2,
}

/// The connection preface of HTTP/2 (RFC 9113 §3.4).
const HTTP2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// How long to wait for more bytes of a preface that has only begun.
const PREFACE_POLL: Duration = Duration::from_millis(10);
/// How often a connection checks whether a request head is overdue.
const HEADER_CHECK: Duration = Duration::from_millis(250);

/// Tells the protocol from the connection's first bytes, without consuming them. A client that
/// sends nothing within `within`, or closes, is dropped (`None`).
pub(super) async fn detect_protocol(
    stream: &tokio::net::TcpStream,
    within: Duration,
) -> Option<Protocol> {
    let deadline = tokio::time::Instant::now() + within;
    let mut first = [0u8; HTTP2_PREFACE.len()];
    loop {
        let seen = tokio::time::timeout_at(deadline, stream.peek(&mut first))
            .await
            .ok()?
            .ok()?;
        if seen == 0 {
            return None;
        }
        if !HTTP2_PREFACE.starts_with(&first[..seen]) {
            return Some(Protocol::Http1);
        }
        if seen == HTTP2_PREFACE.len() {
            return Some(Protocol::Http2);
        }
        tokio::time::sleep_until(deadline.min(tokio::time::Instant::now() + PREFACE_POLL)).await;
    }
}

/// What one connection is doing, for its deadlines and for the choice of which connection to
/// close when all are taken: when the head of an HTTP/1 request began to arrive, how many
/// requests (HTTP/2: streams) are being answered and how many of them still wait for their
/// body, when a body last made progress, and when the last answer was done.
pub(super) struct ConnectionClock {
    origin: Instant,
    /// Milliseconds after `origin` (plus one) when the first byte of a request head arrived;
    /// 0 while no head is under way (HTTP/1 only).
    head_started: AtomicU64,
    /// Requests whose head is complete and whose answer is not done yet.
    in_flight: AtomicUsize,
    /// Requests whose body has not ended (nor been given up) yet.
    reading: AtomicUsize,
    /// Milliseconds after `origin` when a request began or a body's bytes last arrived.
    last_progress: AtomicU64,
    /// Milliseconds after `origin` when the last answer was done (0: none yet).
    last_answered: AtomicU64,
}

/// What a connection is doing, when it may be closed to make room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Quiet {
    /// No request under way: between requests, or none yet (HTTP/2: no stream open).
    Idle,
    /// A request head that has not finished arriving.
    Head,
    /// Every request under way waits for body bytes that do not come.
    Body,
}

impl Quiet {
    /// The `state` label of `agentgate_idle_connections_closed_total`.
    pub(super) fn label(self) -> &'static str {
        match self {
            Quiet::Idle => "idle",
            Quiet::Head => "head",
            Quiet::Body => "body",
        }
    }
}

impl ConnectionClock {
    pub(super) fn new() -> Arc<ConnectionClock> {
        Arc::new(ConnectionClock {
            origin: Instant::now(),
            head_started: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            reading: AtomicUsize::new(0),
            last_progress: AtomicU64::new(0),
            last_answered: AtomicU64::new(0),
        })
    }

    fn now(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn bytes_arrived(&self) {
        if self.in_flight.load(Ordering::Relaxed) == 0 {
            let _ = self.head_started.compare_exchange(
                0,
                self.now().saturating_add(1),
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    /// A head is complete: its request is being answered, and its body is awaited.
    pub(super) fn answering(&self) {
        self.last_progress.store(self.now(), Ordering::Relaxed);
        self.reading.fetch_add(1, Ordering::Relaxed);
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.head_started.store(0, Ordering::Relaxed);
    }

    fn body_progressed(&self) {
        self.last_progress.store(self.now(), Ordering::Relaxed);
    }

    fn body_done(&self) {
        self.reading.fetch_sub(1, Ordering::Relaxed);
    }

    /// How long the connection has made no progress that may be worth waiting for, and what
    /// it is doing then: nothing under way (since its last answer, or its opening), a head
    /// under way (since its first byte), or only bodies that are awaited (since their last
    /// bytes). `None` while a request is being answered.
    pub(super) fn quiet_for(&self) -> Option<(Duration, Quiet)> {
        if let Some(idle) = self.idle_for() {
            return Some((idle, Quiet::Idle));
        }
        let since = |millis: u64| {
            self.origin
                .elapsed()
                .saturating_sub(Duration::from_millis(millis))
        };
        let started = self.head_started.load(Ordering::Relaxed);
        let in_flight = self.in_flight.load(Ordering::Relaxed);
        if in_flight == 0 && started != 0 {
            return Some((since(started - 1), Quiet::Head));
        }
        (self.reading.load(Ordering::Relaxed) >= in_flight).then(|| {
            (
                since(self.last_progress.load(Ordering::Relaxed)),
                Quiet::Body,
            )
        })
    }

    /// An answer is done: on HTTP/1 the next bytes start a new head.
    pub(super) fn answered(&self) {
        self.last_answered
            .store(self.now().max(1), Ordering::Relaxed);
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }

    /// How long the connection has had nothing under way (no head arriving, nothing being
    /// answered), counted from its last answer or, before any, from its opening.
    pub(super) fn idle_for(&self) -> Option<Duration> {
        if self.in_flight.load(Ordering::Relaxed) != 0
            || self.head_started.load(Ordering::Relaxed) != 0
        {
            return None;
        }
        let since = Duration::from_millis(self.last_answered.load(Ordering::Relaxed));
        Some(self.origin.elapsed().saturating_sub(since))
    }

    /// Resolves once a request head has been under way for longer than `limit`.
    pub(super) async fn overdue(&self, limit: Duration) {
        loop {
            tokio::time::sleep(HEADER_CHECK).await;
            let started = self.head_started.load(Ordering::Relaxed);
            if started != 0 && self.in_flight.load(Ordering::Relaxed) == 0 {
                let since = Duration::from_millis(started - 1);
                if self.origin.elapsed().saturating_sub(since) > limit {
                    return;
                }
            }
        }
    }

    /// Resolves once an HTTP/2 connection has had no stream for `first` since it opened, or for
    /// `between` since its last answer.
    pub(super) async fn idle_past(&self, first: Duration, between: Duration) {
        loop {
            tokio::time::sleep(HEADER_CHECK).await;
            let limit = if self.last_answered.load(Ordering::Relaxed) == 0 {
                first
            } else {
                between
            };
            if self.idle_for().is_some_and(|idle| idle > limit) {
                return;
            }
        }
    }
}

/// The connection's bytes, reporting to a [`ConnectionClock`] when they arrive.
pub(super) struct Clocked<I> {
    inner: I,
    clock: Arc<ConnectionClock>,
}

impl<I> Clocked<I> {
    pub(super) fn new(inner: I, clock: Arc<ConnectionClock>) -> Clocked<I> {
        Clocked { inner, clock }
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Clocked<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(result, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.clock.bytes_arrived();
        }
        result
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Clocked<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
}

/// A connection quiet for less than this is never closed to make room: its client may be about
/// to send (a head or a body under way, a connection it is about to reuse or has just opened).
const MIN_QUIET_TO_CLOSE: Duration = Duration::from_millis(500);

/// Lines about connections closed to make room, at most this many a second per listener.
const CLOSED_LINES_PER_SECOND: u32 = 5;

/// The open connections of a listener, each with its clock, its peer address and a token that
/// closes it: when every slot is taken, the one quiet the longest (idle, or stalled in its head
/// or body) is closed so that a new connection is served instead of waiting in the backlog
/// behind them; and one peer address holds at most `max_connections_per_peer` of them.
pub(super) struct OpenConnections {
    /// The listener's name in logs and metrics: `webhook`, `control`, `metrics`, `console`.
    pub(super) listener: &'static str,
    next_id: AtomicU64,
    open: Mutex<Table>,
    closed_lines: crate::logging::LineBudget,
}

#[derive(Default)]
struct Table {
    connections: HashMap<u64, Open>,
    /// Open connections by peer address, of the peers that are counted (not trusted proxies).
    per_peer: HashMap<IpAddr, usize>,
}

struct Open {
    clock: Arc<ConnectionClock>,
    close: CancellationToken,
    /// `None` for a peer that is not counted (a trusted proxy).
    peer: Option<IpAddr>,
}

/// A connection's place in [`OpenConnections`], given up when dropped.
pub(super) struct Registration {
    connections: Arc<OpenConnections>,
    id: u64,
    /// Fires when the connection is to be closed to make room.
    pub(super) close: CancellationToken,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut table = self.connections.table();
        let Some(open) = table.connections.remove(&self.id) else {
            return;
        };
        if let Some(peer) = open.peer
            && let std::collections::hash_map::Entry::Occupied(mut count) =
                table.per_peer.entry(peer)
        {
            *count.get_mut() -= 1;
            if *count.get() == 0 {
                count.remove();
            }
        }
    }
}

impl OpenConnections {
    pub(super) fn new(listener: &'static str) -> OpenConnections {
        OpenConnections {
            listener,
            next_id: AtomicU64::new(0),
            open: Mutex::default(),
            closed_lines: crate::logging::LineBudget::new(CLOSED_LINES_PER_SECOND),
        }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        crate::locks::lock(&self.open)
    }

    /// Registers a connection from `peer` (`None`: a peer that is not counted).
    pub(super) fn register(
        self: &Arc<Self>,
        clock: Arc<ConnectionClock>,
        peer: Option<IpAddr>,
    ) -> Registration {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let close = CancellationToken::new();
        let mut table = self.table();
        table.connections.insert(
            id,
            Open {
                clock,
                close: close.clone(),
                peer,
            },
        );
        if let Some(peer) = peer {
            *table.per_peer.entry(peer).or_default() += 1;
        }
        drop(table);
        Registration {
            connections: self.clone(),
            id,
            close,
        }
    }

    /// Open connections from `peer`.
    pub(super) fn of_peer(&self, peer: IpAddr) -> usize {
        self.table().per_peer.get(&peer).copied().unwrap_or(0)
    }

    /// Closes the connection quiet the longest (at least [`MIN_QUIET_TO_CLOSE`]), counting and
    /// logging it (within a budget of lines); whether there was one. With `peer`, only an idle
    /// one of that address (its stalled ones hold only its own share).
    pub(super) fn close_quietest(&self, peer: Option<IpAddr>) -> bool {
        let table = self.table();
        let quietest = table
            .connections
            .values()
            .filter(|open| !open.close.is_cancelled())
            .filter(|open| peer.is_none() || open.peer == peer)
            .filter_map(|open| Some((open.clock.quiet_for()?, open)))
            .filter(|((_, state), _)| peer.is_none() || *state == Quiet::Idle)
            .filter(|((quiet, _), _)| *quiet >= MIN_QUIET_TO_CLOSE)
            .max_by_key(|((quiet, _), _)| *quiet);
        let Some(((quiet, state), open)) = quietest else {
            return false;
        };
        open.close.cancel();
        crate::metrics::idle_connection_closed(self.listener, state.label());
        if let Some(suppressed) = self.closed_lines.admit() {
            let peer = open.peer.map(|peer| peer.to_string()).unwrap_or_default();
            tracing::info!(listener = self.listener, peer = %peer, state = state.label(),
                quiet_ms = quiet.as_millis() as u64, suppressed_before = suppressed,
                "connection closed to make room for a new one: every slot was taken");
        }
        true
    }
}

/// A response body that tells its connection's clock when it is done (sent, or dropped with
/// the connection), so that a connection streaming an answer is not taken for an idle one.
pub(super) struct Answering<B> {
    body: B,
    clock: Arc<ConnectionClock>,
}

impl<B> Answering<B> {
    pub(super) fn new(body: B, clock: Arc<ConnectionClock>) -> Answering<B> {
        Answering { body, clock }
    }
}

impl<B> Drop for Answering<B> {
    fn drop(&mut self) {
        self.clock.answered();
    }
}

impl<B: hyper::body::Body + Unpin> hyper::body::Body for Answering<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<B::Data>, B::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// A request body that tells its connection's clock when its bytes arrive and when it is done
/// (ended, or given up), so that a connection whose bodies stall can be told from one whose
/// request is being answered.
pub(super) struct Watched<B> {
    body: B,
    clock: Option<Arc<ConnectionClock>>,
}

/// A request body on the control, metrics and console listeners.
pub(super) type RequestBody = Watched<hyper::body::Incoming>;

impl<B: hyper::body::Body> Watched<B> {
    /// `body` watched; one that is empty (no body, `Content-Length: 0`) is done at once, so
    /// that a request that never reads it is not taken for one whose body stalls.
    pub(super) fn new(body: B, clock: Arc<ConnectionClock>) -> Watched<B> {
        let mut watched = Watched {
            body,
            clock: Some(clock),
        };
        if watched.body.is_end_stream() {
            watched.done();
        }
        watched
    }
}

impl<B> Watched<B> {
    fn done(&mut self) {
        if let Some(clock) = self.clock.take() {
            clock.body_done();
        }
    }
}

impl<B> Drop for Watched<B> {
    fn drop(&mut self) {
        self.done();
    }
}

impl<B: hyper::body::Body + Unpin> hyper::body::Body for Watched<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<B::Data>, B::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(_))) => {
                if let Some(clock) = &self.clock {
                    clock.body_progressed();
                }
            }
            Poll::Ready(None | Some(Err(_))) => self.done(),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}
