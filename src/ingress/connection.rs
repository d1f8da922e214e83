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
//! `keepalive_timeout`. And when every connection slot is taken, the connection idle the
//! longest is closed for the new one ([`OpenConnections`]).

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

/// What one connection is doing, for its deadlines and for the choice of which idle connection
/// to close when all are taken: when the head of an HTTP/1 request began to arrive, how many
/// requests (HTTP/2: streams) are being answered, and when the last answer was done.
pub(super) struct ConnectionClock {
    origin: Instant,
    /// Milliseconds after `origin` (plus one) when the first byte of a request head arrived;
    /// 0 while no head is under way (HTTP/1 only).
    head_started: AtomicU64,
    /// Requests whose head is complete and whose answer is not done yet.
    in_flight: AtomicUsize,
    /// Milliseconds after `origin` when the last answer was done (0: none yet).
    last_answered: AtomicU64,
}

impl ConnectionClock {
    pub(super) fn new() -> Arc<ConnectionClock> {
        Arc::new(ConnectionClock {
            origin: Instant::now(),
            head_started: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
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

    /// A head is complete: its request is being answered.
    pub(super) fn answering(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.head_started.store(0, Ordering::Relaxed);
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

/// A connection idle for less than this is never closed to make room: its client may be about
/// to reuse it.
const MIN_IDLE_TO_CLOSE: Duration = Duration::from_secs(1);

/// The open webhook connections, each with its clock, its peer address and a token that closes
/// it: when every `max_connections` slot is taken, the one idle the longest is closed so that a
/// new connection is served instead of waiting in the backlog behind idle ones; and one peer
/// address holds at most `max_connections_per_peer` of them.
#[derive(Default)]
pub(super) struct OpenConnections {
    next_id: AtomicU64,
    open: Mutex<Table>,
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
    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        // The table holds no invariant a panic elsewhere could break.
        self.open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
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

    /// Closes the connection idle the longest (at least [`MIN_IDLE_TO_CLOSE`]), of `peer` only
    /// when one is given; whether there was one.
    pub(super) fn close_longest_idle(&self, peer: Option<IpAddr>) -> bool {
        let table = self.table();
        let longest = table
            .connections
            .values()
            .filter(|open| !open.close.is_cancelled())
            .filter(|open| peer.is_none() || open.peer == peer)
            .filter_map(|open| Some((open.clock.idle_for()?, &open.close)))
            .filter(|(idle, _)| *idle >= MIN_IDLE_TO_CLOSE)
            .max_by_key(|(idle, _)| *idle);
        match longest {
            Some((_, close)) => {
                close.cancel();
                true
            }
            None => false,
        }
    }
}
