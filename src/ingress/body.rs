//! Reading request bodies with bounded memory.
//!
//! A webhook's signature can only be checked once its whole body is in memory, so an
//! unauthenticated sender decides how much memory its request holds, and for how long (up to
//! the body timeout). Each body is read into a buffer that grows with what actually arrived,
//! never with what `Content-Length` promised. The first [`SMALL_BODY`] bytes of any body are
//! read freely: nearly every webhook fits, and a crowd of stalled connections that each sent a
//! little costs little. A body larger than that needs one of [`LARGE_BODY_SLOTS`] slots before
//! more of it is read; while it waits, nothing more is read and the sender is held back by TCP.
//! So stalled large bodies hold at most `LARGE_BODY_SLOTS × max_body` between them (64 MiB at
//! the default `max_body`), where they could otherwise hold `max_connections × max_body`, and
//! they never delay a small webhook. The first bytes of all bodies together are bounded too
//! ([`SMALL_BODY_BUDGET`]), whatever the number of connections and HTTP/2 streams. A body that
//! arrives in many small chunks is gathered into one buffer as it comes, so that it never holds
//! more than its own bytes. See docs/reference.md, "Threat model".

use std::time::Duration;

use crate::config::ServerSettings;
use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Limited};
use tokio::sync::Semaphore;
use tokio::time::{Instant, timeout_at};

/// How long a body may take to arrive once its head has, per `header_timeout`.
const BODY_TIMEOUT_FACTOR: u32 = 4;

/// How long a request body may take to arrive on any listener: four times `header_timeout`
/// (docs/reference.md, `[server]`); past it the answer is `408` and the connection is closed.
pub(super) fn body_timeout(server: &ServerSettings) -> Duration {
    server.header_timeout * BODY_TIMEOUT_FACTOR
}

/// Bytes of a body read without a large-body slot.
pub(super) const SMALL_BODY: usize = 16 * 1024;
/// Bodies larger than [`SMALL_BODY`] read at once.
pub(super) const LARGE_BODY_SLOTS: usize = 64;

/// Why a body could not be read.
#[derive(Debug)]
pub(super) enum BodyError {
    /// Larger than the route's `max_body`.
    TooLarge,
    /// The connection failed while the body arrived.
    Unreadable,
    /// The sender did not send the body in time.
    TimedOut,
    /// No large-body slot came free in time: the server, not the sender, was the bottleneck.
    NoSlot,
}

/// The large-body slots of the webhook listener (or of the control listeners together), and the
/// memory budget of the small bodies' first bytes.
pub(crate) struct BodySlots {
    large: Semaphore,
    /// KiB of [`SMALL_BODY_BUDGET`]: each body holds what its first [`SMALL_BODY`] bytes take.
    small: Semaphore,
}

/// Bytes of bodies' first [`SMALL_BODY`] bytes held at once across all connections (4,096
/// bodies' worth), so that however many connections and HTTP/2 streams a flood opens, the
/// bodies it sends hold at most this plus the large-body slots.
pub(super) const SMALL_BODY_BUDGET: usize = 64 * 1024 * 1024;

/// A body as it arrives: the first chunk kept as it came (nearly every webhook is one chunk,
/// never copied); from the second on, the bytes are copied into one buffer, so that a body sent
/// in many tiny chunks does not keep every chunk's read buffer alive.
#[derive(Default)]
struct Gathered {
    first: Option<Bytes>,
    rest: BytesMut,
}

impl Gathered {
    fn push(&mut self, chunk: Bytes) {
        match self.first.take() {
            None if self.rest.is_empty() => self.first = Some(chunk),
            None => self.rest.extend_from_slice(&chunk),
            Some(first) => {
                self.rest.reserve(first.len() + chunk.len());
                self.rest.extend_from_slice(&first);
                self.rest.extend_from_slice(&chunk);
            }
        }
    }

    fn into_bytes(self) -> Bytes {
        match self.first {
            Some(first) => first,
            None => self.rest.freeze(),
        }
    }
}

impl BodySlots {
    pub(crate) fn new() -> BodySlots {
        BodySlots {
            large: Semaphore::new(LARGE_BODY_SLOTS),
            small: Semaphore::new(SMALL_BODY_BUDGET / 1024),
        }
    }

    /// Reads `body`: at most `limit` bytes (`declared` is its `Content-Length`, if any), within
    /// `timeout`, waiting for a slot or budget included.
    pub(super) async fn read<B>(
        &self,
        body: B,
        limit: usize,
        declared: Option<u64>,
        timeout: Duration,
    ) -> Result<Bytes, BodyError>
    where
        B: hyper::body::Body<Data = Bytes> + Send,
        B::Error: std::error::Error + Send + Sync + 'static,
    {
        let deadline = Instant::now() + timeout;
        let mut body = std::pin::pin!(Limited::new(body, limit));
        let mut gathered = Gathered::default();
        let mut received = 0;
        // Held from the moment the body is known to be large until it is read.
        let mut slot = None;
        // The share of the small-body budget this body's first bytes hold, in KiB.
        let mut budget: Option<tokio::sync::SemaphorePermit<'_>> = None;
        // A body that says it is large waits for its slot before any of it is read.
        if declared.is_some_and(|length| length > SMALL_BODY as u64) {
            slot = Some(self.wait(deadline).await?);
        }
        while let Some(frame) = timeout_at(deadline, body.frame())
            .await
            .map_err(|_| BodyError::TimedOut)?
        {
            let frame = frame.map_err(|err| {
                if err
                    .downcast_ref::<http_body_util::LengthLimitError>()
                    .is_some()
                {
                    BodyError::TooLarge
                } else {
                    BodyError::Unreadable
                }
            })?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            received += data.len();
            if slot.is_none() && received > SMALL_BODY {
                slot = Some(self.wait(deadline).await?);
            }
            self.budget(&mut budget, received.min(SMALL_BODY), deadline)
                .await?;
            gathered.push(data);
        }
        Ok(gathered.into_bytes())
    }

    /// Makes `held` cover `bytes` of the small-body budget (whole KiB), waiting until
    /// `deadline` for what other bodies hold.
    async fn budget<'a>(
        &'a self,
        held: &mut Option<tokio::sync::SemaphorePermit<'a>>,
        bytes: usize,
        deadline: Instant,
    ) -> Result<(), BodyError> {
        let wanted = u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX);
        let holding = held
            .as_ref()
            .map_or(0, tokio::sync::SemaphorePermit::num_permits);
        let Some(more) = (wanted as usize)
            .checked_sub(holding)
            .filter(|more| *more > 0)
        else {
            return Ok(());
        };
        let more = u32::try_from(more).unwrap_or(u32::MAX);
        match timeout_at(deadline, self.small.acquire_many(more)).await {
            Ok(Ok(permit)) => {
                match held {
                    Some(held) => held.merge(permit),
                    None => *held = Some(permit),
                }
                Ok(())
            }
            // The semaphore is never closed.
            Ok(Err(_)) | Err(_) => Err(BodyError::NoSlot),
        }
    }

    async fn wait(&self, deadline: Instant) -> Result<Slot<'_>, BodyError> {
        match timeout_at(deadline, self.large.acquire()).await {
            Ok(Ok(permit)) => {
                crate::metrics::large_body_slots(1);
                Ok(Slot { _permit: permit })
            }
            // The semaphore is never closed.
            Ok(Err(_)) | Err(_) => Err(BodyError::NoSlot),
        }
    }
}

/// A large-body slot, counted in `agentgate_large_body_slots_in_use` while it is held.
struct Slot<'a> {
    /// Given back to the semaphore when the slot is dropped.
    _permit: tokio::sync::SemaphorePermit<'a>,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        crate::metrics::large_body_slots(-1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Full;

    #[tokio::test]
    async fn a_large_body_waits_for_a_slot_and_a_small_one_does_not() {
        let slots = BodySlots::new();
        let taken = slots.large.acquire_many(LARGE_BODY_SLOTS as u32).await;
        assert!(taken.is_ok());
        let wait = Duration::from_millis(50);
        let large = Full::new(Bytes::from(vec![b' '; SMALL_BODY + 1]));
        let read = slots.read(large, 1 << 20, Some(SMALL_BODY as u64 + 1), wait);
        assert!(
            matches!(read.await, Err(BodyError::NoSlot)),
            "a large body was read without a slot"
        );

        // Undeclared length: the slot is needed once the body grows past SMALL_BODY.
        let unsized_large = Full::new(Bytes::from(vec![b' '; SMALL_BODY + 1]));
        let read = slots.read(unsized_large, 1 << 20, None, wait);
        assert!(
            matches!(read.await, Err(BodyError::NoSlot)),
            "a large body was read without a slot"
        );

        let small = Full::new(Bytes::from_static(b"{\"small\":true}"));
        let read = slots.read(small, 1 << 20, Some(14), wait);
        assert_eq!(
            read.await.ok(),
            Some(Bytes::from_static(b"{\"small\":true}"))
        );
        drop(taken);
    }

    /// A body that arrives in several chunks, as a chunked upload does.
    struct Chunks(std::collections::VecDeque<Bytes>);

    impl hyper::body::Body for Chunks {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
            std::task::Poll::Ready(
                self.0
                    .pop_front()
                    .map(|chunk| Ok(hyper::body::Frame::data(chunk))),
            )
        }
    }

    #[tokio::test]
    async fn chunks_are_joined_in_order() {
        let slots = BodySlots::new();
        let chunks = Chunks(
            [&b"{\"a\":"[..], b"[1,", b"2]}"]
                .into_iter()
                .map(Bytes::from_static)
                .collect(),
        );
        let read = slots
            .read(chunks, 1 << 20, None, Duration::from_secs(1))
            .await;
        assert_eq!(read.ok(), Some(Bytes::from_static(b"{\"a\":[1,2]}")));
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_too_large() {
        let slots = BodySlots::new();
        let body = Full::new(Bytes::from(vec![b' '; 100]));
        let read = slots.read(body, 10, None, Duration::from_secs(1)).await;
        assert!(matches!(read, Err(BodyError::TooLarge)));
    }

    /// Counts the read buffers alive: a chunk that is a slice of one keeps it alive.
    struct Buffer(std::sync::Arc<std::sync::atomic::AtomicUsize>);

    impl AsRef<[u8]> for Buffer {
        fn as_ref(&self) -> &[u8] {
            &[b'x'; 1]
        }
    }

    impl Drop for Buffer {
        fn drop(&mut self) {
            self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// One-byte chunks, each the slice of a read buffer of its own (as hyper's decoder yields
    /// them), recording the most buffers alive at once.
    struct TinyChunks {
        left: usize,
        alive: std::sync::Arc<std::sync::atomic::AtomicUsize>,
        most: usize,
    }

    impl hyper::body::Body for TinyChunks {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
            use std::sync::atomic::Ordering;
            let alive = self.alive.load(Ordering::SeqCst);
            self.most = self.most.max(alive);
            if self.left == 0 {
                return std::task::Poll::Ready(None);
            }
            self.left -= 1;
            self.alive.fetch_add(1, Ordering::SeqCst);
            let chunk = Bytes::from_owner(Buffer(self.alive.clone()));
            std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(chunk))))
        }
    }

    #[tokio::test]
    async fn a_body_of_tiny_chunks_holds_its_bytes_not_their_buffers() {
        let slots = BodySlots::new();
        let mut body = TinyChunks {
            left: 1000,
            alive: std::sync::Arc::default(),
            most: 0,
        };
        let read = slots
            .read(&mut body, 1 << 20, None, Duration::from_secs(1))
            .await;
        assert_eq!(read.ok().map(|bytes| bytes.len()), Some(1000));
        assert!(body.most <= 2, "{} read buffers alive at once", body.most);
    }

    #[tokio::test]
    async fn the_first_bytes_of_all_bodies_share_one_budget() {
        let slots = BodySlots::new();
        let all = u32::try_from(SMALL_BODY_BUDGET / 1024).expect("KiB");
        let taken = slots.small.acquire_many(all).await;
        let small = Full::new(Bytes::from_static(b"{}"));
        let read = slots.read(small, 1 << 20, Some(2), Duration::from_millis(50));
        assert!(matches!(read.await, Err(BodyError::NoSlot)));
        drop(taken);
        let small = Full::new(Bytes::from_static(b"{}"));
        let read = slots.read(small, 1 << 20, Some(2), Duration::from_millis(50));
        assert_eq!(read.await.ok(), Some(Bytes::from_static(b"{}")));
    }
}
