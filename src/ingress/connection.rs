//! One webhook connection: which protocol it speaks, and how long it may take.
//!
//! Two different clocks apply. A client that has begun a request must send its headers within
//! `header_timeout` (slow clients are cut off); a keep-alive connection with no request under way
//! may stay idle for `keepalive_timeout`, longer than senders' own idle timeouts (Alertmanager,
//! Go's default transport: 90 s), so that agentgate is never the side that closes a connection
//! a sender is about to reuse. hyper has one timer for both, started whenever it waits for a
//! request head; it is set to the idle limit here, and the header limit is enforced by watching
//! the bytes: [`HeaderClock`] notes when the first byte of a request arrives, and the service
//! notes when the head was complete.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

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

/// When the head of the request under way began to arrive, for one HTTP/1 connection.
pub(super) struct HeaderClock {
    origin: Instant,
    /// Milliseconds after `origin` (plus one) when the first byte of a request head arrived;
    /// 0 while no head is under way.
    head_started: AtomicU64,
    /// A request is being answered: its head is complete.
    answering: AtomicBool,
}

impl HeaderClock {
    pub(super) fn new() -> Arc<HeaderClock> {
        Arc::new(HeaderClock {
            origin: Instant::now(),
            head_started: AtomicU64::new(0),
            answering: AtomicBool::new(false),
        })
    }

    fn bytes_arrived(&self) {
        if !self.answering.load(Ordering::Relaxed) {
            let now = u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX);
            let _ = self.head_started.compare_exchange(
                0,
                now.saturating_add(1),
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    /// The head is complete: the request is being answered.
    pub(super) fn answering(&self) {
        self.answering.store(true, Ordering::Relaxed);
        self.head_started.store(0, Ordering::Relaxed);
    }

    /// The answer is done: the next bytes start a new head.
    pub(super) fn answered(&self) {
        self.answering.store(false, Ordering::Relaxed);
    }

    /// Resolves once a request head has been under way for longer than `limit`.
    pub(super) async fn overdue(&self, limit: Duration) {
        loop {
            tokio::time::sleep(HEADER_CHECK).await;
            let started = self.head_started.load(Ordering::Relaxed);
            if started != 0 && !self.answering.load(Ordering::Relaxed) {
                let since = Duration::from_millis(started - 1);
                if self.origin.elapsed().saturating_sub(since) > limit {
                    return;
                }
            }
        }
    }
}

/// The connection's bytes, reporting to a [`HeaderClock`] when they arrive.
pub(super) struct Clocked<I> {
    inner: I,
    clock: Arc<HeaderClock>,
}

impl<I> Clocked<I> {
    pub(super) fn new(inner: I, clock: Arc<HeaderClock>) -> Clocked<I> {
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
